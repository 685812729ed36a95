"""Nothing inside the model forward reads a tensor back to the host (on a GPU each such read waits for the
device), nor makes a tensor from Python data: every shape, table and grid mapping the attention needs is built
before the forward, once per step (what a CUDA graph of the step needs)."""

import sys
import traceback

import pytest
import torch
from helpers import make_engine, run_engine
from torch.overrides import TorchFunctionMode

from batchrun.engine import SamplingParams

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


def watch_forward(model: torch.nn.Module, mode: HostReadsInForward):
    def enter(*_):
        mode.in_forward = True

    def leave(*_):
        mode.in_forward = False

    return [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]


def run_watched(tok_model, prompts, attention: str, extra_hook=None) -> HostReadsInForward:
    engine = make_engine(tok_model, attention=attention, max_num_batched_tokens=96, num_pages=128)
    return watch_engine(engine, prompts, extra_hook)


def watch_engine(engine, prompts, extra_hook=None) -> HostReadsInForward:
    """Run the prompts on `engine`, recording the host reads and tensors from Python data of its forwards."""
    decoder = engine.runner.model.get_decoder()  # also what runs when no sequence samples
    mode = HostReadsInForward()
    hooks = watch_forward(decoder, mode)
    if extra_hook is not None:
        hooks.append(decoder.layers[0].register_forward_hook(extra_hook))
    frombuffer = torch.frombuffer

    def watched_frombuffer(*args, **kwargs):
        if mode.in_forward:
            mode.record_made("frombuffer")
        return frombuffer(*args, **kwargs)

    torch.frombuffer = watched_frombuffer
    try:
        with mode:
            run_engine(engine, prompts, SamplingParams(max_new_tokens=6))
    finally:
        torch.frombuffer = frombuffer
        for h in hooks:
            h.remove()
    return mode


@pytest.mark.parametrize("attention", ["torch", "gather", "triton"])
def test_the_forward_reads_nothing_back_from_the_device(tok_model, chat_prompts, attention):
    # a shared prefix (prefix-cached prefill), chunked prompts next to decodes, and plain decodes
    prompts = [chat_prompts[0], chat_prompts[0][:40] + chat_prompts[1][:30], chat_prompts[2][:150]]
    if attention == "triton":
        prompts = [p[:40] for p in prompts]  # the interpreter is slow
    watched = run_watched(tok_model, prompts, attention)
    reads, made = watched.reads, watched.made
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
