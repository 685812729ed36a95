"""Nothing inside the model forward reads a tensor back to the host (on a GPU each such read waits for the
device), nor makes a tensor from Python data: every shape, table, mask and grid mapping the attention needs is
built before the forward, once per step (what a CUDA graph of the step needs). Watched on the plain model, on
every attention path of the family matrix (tests/model_families.py: windows, soft-capping, sinks, chunks,
per-token terms, hybrids' state slots, KV-shared layers) and on images (image blocks, 3-D rotary positions);
`arange`, `full`, `zeros`, `ones` and `empty` made by batchrun, and its copies to the device, are caught too."""

import copy
import os
import sys
import traceback

import pytest
import torch
from helpers import make_engine, paged_model_from_config, run_engine
from torch.overrides import TorchFunctionMode

import batchrun
from batchrun.engine import SamplingParams
from batchrun.engine.model.ops.decoder_stack import DecoderStack

# tensor methods that copy device data to the host
HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}
# functions that make a tensor from Python data (torch.frombuffer, which a TorchFunctionMode does not see, is
# wrapped by the test itself)
FROM_PYTHON_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}
# functions that make a tensor from Python numbers (a range, a shape, a fill value): watched in batchrun's own
# code, not in the model's (transformers' modules make their own cache positions and expert indices)
FROM_PYTHON_NUMBERS = {torch.arange, torch.full, torch.zeros, torch.ones, torch.empty}
BATCHRUN = os.path.dirname(batchrun.__file__) + os.sep
TORCH = os.path.dirname(torch.__file__) + os.sep


def host_to_device(func, args, kwargs) -> bool:
    """A copy from the host to the device: `.to` given a device (or a tensor, whose device it takes), even the
    CPU it is on here, `.cuda()`, or `copy_` from a tensor on another device (seen only on a GPU)."""
    if func is torch.Tensor.to:
        given = list(args[1:]) + [kwargs.get("device")]
        return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in given)
    if func is torch.Tensor.copy_:
        return args[1].device != args[0].device
    return func is torch.Tensor.cuda


def besides_the_gather_workspace(made: list[str]) -> list[str]:
    """The tensors made, but for gather's reused workspace (gather.Workspace.get), which the forward still grows
    with `torch.empty` when a step needs more rows than any before: sizing it with the step's plan needs each
    group's page shape where the backend is made (backends/__init__.py), left to that change."""

    def in_workspace(record: str) -> bool:
        last_frame = [line for line in record.splitlines() if line.lstrip().startswith("File ")][-1]
        return "backends/gather.py" in last_frame and last_frame.endswith(", in get")

    return [m for m in made if not in_workspace(m)]


def made_by_batchrun() -> bool:
    """The call comes from batchrun's code: the first frame outside torch and this file is batchrun's."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(TORCH) and name != __file__:
            return name.startswith(BATCHRUN)
        frame = frame.f_back
    return False


class HostReadsInForward(TorchFunctionMode):
    """Records every host read made while the model's forward runs (the Triton interpreter's own reads, which
    emulate the GPU on CPU tensors, are not the engine's)."""

    def __init__(self):
        super().__init__()
        self.in_forward = False
        self.reads: list[str] = []
        self.made: list[str] = []  # tensors made from Python data

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.in_forward and not self._inside_triton_interpreter():
            if func in HOST_READS:
                self.reads.append(f"{func.__name__}\n" + "".join(traceback.format_stack(limit=8)[:-1]))
            elif func in FROM_PYTHON_DATA:
                self.record_made(func.__name__)
            elif func in FROM_PYTHON_NUMBERS and made_by_batchrun():
                self.record_made(func.__name__)
            elif host_to_device(func, args, kwargs or {}) and made_by_batchrun():
                self.record_made(f"{func.__name__} to a device")
        return func(*args, **(kwargs or {}))

    def record_made(self, name: str) -> None:
        self.made.append(f"{name}\n" + "".join(traceback.format_stack(limit=8)[:-2]))

    @staticmethod
    def _inside_triton_interpreter() -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if "triton/runtime/interpreter" in frame.f_code.co_filename.replace("\\", "/"):
                return True
            frame = frame.f_back
        return False


class Unwrap:
    """Takes an instance's wrapped method back off (as a hook's handle removes the hook)."""

    def __init__(self, owner, name: str):
        self.owner, self.name = owner, name

    def remove(self) -> None:
        delattr(self.owner, self.name)


def watch_forward(engine, mode: HostReadsInForward) -> list:
    """Mark the decoder's forward (also what runs when no sequence samples) however the runner calls it: around
    batchrun's own outer forward (decoder_stack.DecoderStack, which a hook on the decoder would turn back into
    HF's, unwatched), else by hooks on HF's decoder."""
    forward = engine.runner.forward
    if isinstance(forward, DecoderStack):
        hidden_states = forward._hidden_states

        def marked(*args, **kwargs):
            mode.in_forward = True
            try:
                return hidden_states(*args, **kwargs)
            finally:
                mode.in_forward = False

        forward._hidden_states = marked
        return [Unwrap(forward, "_hidden_states")]

    def enter(*_):
        mode.in_forward = True

    def leave(*_):
        mode.in_forward = False

    decoder = engine.runner.model.get_decoder()
    return [decoder.register_forward_pre_hook(enter), decoder.register_forward_hook(leave)]


def run_watched(tok_model, prompts, attention: str, extra_hook=None) -> HostReadsInForward:
    engine = make_engine(tok_model, attention=attention, max_num_batched_tokens=96, num_pages=128)
    assert type(engine.runner.forward) is DecoderStack  # the embedded model's outer forward is batchrun's own
    return watch_engine(engine, prompts, extra_hook)


def watch_engine(engine, prompts, extra_hook=None) -> HostReadsInForward:
    """Run the prompts on `engine`, recording the host reads and tensors from Python data of its forwards."""
    return watch(engine, lambda: run_engine(engine, prompts, SamplingParams(max_new_tokens=6)), extra_hook)


def watch(engine, run, extra_hook=None) -> HostReadsInForward:
    """`run()`, which steps `engine`, recording the host reads and tensors from Python data of its forwards."""
    mode = HostReadsInForward()
    hooks = watch_forward(engine, mode)
    if extra_hook is not None:
        hooks.append(engine.runner.model.get_decoder().layers[0].register_forward_hook(extra_hook))
    frombuffer = torch.frombuffer

    def watched_frombuffer(*args, **kwargs):
        if mode.in_forward:
            mode.record_made("frombuffer")
        return frombuffer(*args, **kwargs)

    torch.frombuffer = watched_frombuffer
    try:
        with mode:
            run()
    finally:
        torch.frombuffer = frombuffer
        for h in hooks:
            h.remove()
    return mode


@pytest.mark.parametrize("attention", ["torch", "gather", "triton"])
def test_the_forward_reads_nothing_back_from_the_device(tok_model, chat_prompts, attention):
    # a shared prefix (prefix-cached prefill), chunked prompts next to decodes, and plain decodes
    prompts = [chat_prompts[0], chat_prompts[0][:40] + chat_prompts[1][:30], chat_prompts[2][:150]]
    if attention == "triton":  # the interpreter is slow: shorter prompts, and two layers of the model's shape
        prompts = [p[:40] for p in prompts]
        tok, model = tok_model
        config = copy.deepcopy(model.config)
        config.num_hidden_layers = 2
        torch.manual_seed(0)
        tok_model = (tok, paged_model_from_config(config).eval())
    watched = run_watched(tok_model, prompts, attention)
    reads, made = watched.reads, besides_the_gather_workspace(watched.made)
    assert not reads, f"{len(reads)} host reads inside the forward; the first:\n{reads[0]}"
    assert not made, f"{len(made)} tensors made from Python data inside the forward; the first:\n{made[0]}"


def test_the_watch_catches_a_host_read(tok_model, chat_prompts):
    def read_back(module, args, output):
        output[0].sum().item()  # returns None: the output stays as it is

    reads = run_watched(tok_model, [chat_prompts[0][:30]], "torch", read_back).reads
    assert reads and reads[0].startswith("item")


@pytest.mark.parametrize("how", ["tensor", "frombuffer"])
def test_the_watch_catches_a_tensor_made_from_python_data(tok_model, chat_prompts, how):
    import array

    def make(module, args, output):
        if how == "tensor":
            torch.tensor([1, 2, 3])
        else:
            torch.frombuffer(array.array("q", [1, 2, 3]), dtype=torch.long)

    made = run_watched(tok_model, [chat_prompts[0][:30]], "torch", make).made
    assert made and made[0].startswith(how)


# every attention path of the family matrix: a sliding window and soft-capping (Gemma 2), sinks beside a window
# (gpt-oss), chunks and a query-scale fix (Llama 4), per-token sinks and relative bias beside short
# convolutions' state slots (Inkling 2), a hybrid's Gated DeltaNet state slots (Qwen 3.5), KV-shared layers of
# other head dims (Gemma 4), MLA's unequal key and value head dims (DeepSeek V3), each sequence's own rotary
# factors (Phi-3's LongRoPE: the step's cos/sin made in `prepare`)
FAMILIES = [
    "gemma2",
    "gpt_oss",
    "llama4_text",
    "inkling2_text",
    "qwen3_5_text",
    "gemma4_text",
    "deepseek_v3",
    "phi3:longrope",
]


@pytest.mark.parametrize("attention", ["torch", "gather"])
@pytest.mark.parametrize("family", FAMILIES)
def test_no_attention_path_of_the_matrix_reads_back_or_makes_tensors(family, attention):
    from test_families import family_engine, models, prompts

    model, _ = models(family)
    # 11, 33 and 75 tokens: whole prompts, one past the window of 32, one prefilled in chunks beside decodes
    token_lists = [prompts(model.config.vocab_size)[i] for i in (1, 3, 5)]
    watched = watch_engine(family_engine(model, attention), token_lists)
    assert not watched.reads, (
        f"{len(watched.reads)} host reads inside the forward; the first:\n{watched.reads[0]}"
    )
    made = besides_the_gather_workspace(watched.made)
    assert not made, f"{len(made)} tensors made inside the forward; the first:\n{made[0]}"


# images: Gemma 3's image blocks (an image's tokens see each other, beside sliding layers of a window narrower than
# an image) and Qwen2.5-VL's 3-D rotary positions, with prompts in chunks of 8 tokens beside decodes (cutting
# through Qwen's images; each of Gemma's taken whole)
@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_no_image_path_reads_back_or_makes_tensors(family, tmp_path, model_dir):
    from test_image_families import cases, conversations, make_gemma3, make_qwen_vl

    from batchrun import LLM

    if family == "gemma3":
        make_gemma3(tmp_path, model_dir)
    else:
        make_qwen_vl(family, tmp_path, model_dir)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", num_pages=256, max_num_batched_tokens=8)
    assert (llm.engine.runner.mrope is not None) == (family == "qwen2_5_vl")
    assert (llm.engine.runner.image_blocks is not None) == (family == "gemma3")
    params = SamplingParams(max_new_tokens=6)
    watched = watch(llm.engine, lambda: llm.chat(conversations(cases()), params, use_tqdm=False))
    assert llm.engine.image_counts()["images_encoded"] > 0
    assert not watched.reads, (
        f"{len(watched.reads)} host reads inside the forward; the first:\n{watched.reads[0]}"
    )
    made = besides_the_gather_workspace(watched.made)
    assert not made, f"{len(made)} tensors made inside the forward; the first:\n{made[0]}"


def as_batchrun_code(statement: str):
    """A function running `statement` on x whose frame reads as batchrun's own code (the watch tells batchrun's
    calls from the model's by their file)."""
    namespace = {"torch": torch}
    source = f"def make(x):\n    {statement}\n"
    exec(compile(source, os.path.join(BATCHRUN, "engine", "attention", "made_here.py"), "exec"), namespace)
    return namespace["make"]


@pytest.mark.parametrize(
    "statement",
    [
        "torch.arange(3)",
        "torch.full((3,), 1.0)",
        "torch.zeros(3)",
        "torch.ones(3)",
        "torch.empty(3)",
        "x.to(x.device)",
    ],
)
def test_the_watch_catches_batchruns_tensors_from_python_numbers_and_copies_to_the_device(
    tok_model, chat_prompts, statement
):
    make = as_batchrun_code(statement)
    made = run_watched(tok_model, [chat_prompts[0][:30]], "torch", lambda m, a, out: make(out[0])).made
    assert made and made[0].startswith(statement.split("(")[0].split(".")[-1]), made[:1]
