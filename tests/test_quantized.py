"""Quantized checkpoints (tests/quantized_models.py makes them with each format's own tooling): batchrun's
tokens equal HF `generate` on the same checkpoint loaded the same way, greedy fp32, on the torch and gather
backends and under preemption; quantized layers are never packed for oneDNN; the summary counts the weights'
real bytes and names their format; a missing package names the batchrun extra that brings it.

Each format's test skips when its package is not installed (`make install` installs none of them); `make test`
runs this file in .venv-quant, which has them all, where a missing one fails (`make test-quant`)."""

import importlib
import json
import os

import pytest
import torch
from helpers import hf_greedy, write_job, write_prompts
from quantized_models import FORMATS, save_float

from batchrun import LLM, SamplingParams
from batchrun.errors import BadInput

PROMPTS = [[1, 5, 9, 33, 70], [1, *range(10, 60)], [1, 200, 3], [1, *range(100, 140, 3)]]
NEW_TOKENS = 16
DEQUANTIZED = {"fp8", "mxfp4"}  # dequantized by transformers on a CPU: plain float weights, packed like any


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory, model_dir):
    return save_float(tmp_path_factory.mktemp("float"), model_dir)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, float_dir):
    """A format's checkpoint and HF generate's tokens on it, made once per format."""
    made = {}

    def get(name):
        package, make = FORMATS[name]
        if package:
            if os.environ.get("BATCHRUN_REQUIRE_FORMATS"):  # `make test-quant`: a missing package fails
                importlib.import_module(package)
            else:
                pytest.importorskip(package)
        if name not in made:
            target = tmp_path_factory.mktemp(name)
            make(float_dir, target)
            made[name] = target, hf_greedy(target, PROMPTS, NEW_TOKENS)
        return made[name]

    return get


def generate(target, **engine):
    llm = LLM(model=str(target), dtype="float32", device="cpu", **{"num_pages": 64, **engine})
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
    return llm, outs


@pytest.mark.parametrize("attention", ["torch", "gather"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_equals_hf_generate_on_the_same_checkpoint(checkpoint, name, attention):
    target, want = checkpoint(name)
    llm, outs = generate(target, attention=attention)
    assert [o.outputs[0].token_ids for o in outs] == want
    # weights transformers keeps quantized are never packed; FP8 and MXFP4 are dequantized to plain floats
    assert (llm.rewrites["packed_linear"] > 0) == (name in DEQUANTIZED)


# 8 pages of 16 tokens cannot hold the four sequences (up to 67 tokens, 5 pages, each) at once; gpt-oss's
# sliding-window layers take pages of their own (up to 4 more a sequence), so 10 for it. bnb-4bit's tiny model
# ends its longest prompt early (EOS): no preemption at 8 pages of 16, and in pages of 4 tokens 17 is the fewest
# its 51-token prompt runs in (16 cannot hold it with its 16 new tokens: that row's error)
PREEMPTION_PAGES = {"mxfp4": (10, 16), "bnb-4bit": (17, 4)}  # format -> (pages, tokens a page)


@pytest.mark.parametrize(
    "name, num_pages, page_size",
    [(name, *PREEMPTION_PAGES.get(name, (8, 16))) for name in FORMATS],
)
def test_equals_hf_generate_under_preemption(checkpoint, name, num_pages, page_size):
    target, want = checkpoint(name)
    _, outs = generate(target, num_pages=num_pages, page_size=page_size, preemption="recompute")
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.outputs[0].num_preemptions for o in outs) > 0


@pytest.mark.parametrize("name", ["ct-w8a8", "ct-fp8-dynamic"])
def test_layers_that_quantize_their_input_compute_each_sequence_apart(checkpoint, name, monkeypatch):
    """W8A8 and FP8-dynamic round each token's input to 8 bits after a float product whose last bits depend on
    how many rows are multiplied at once (HF generate itself gives a prompt other tokens beside a copy of itself
    on an Intel Xeon with AMX): each sequence of a step is its own product (the prompt's rows together, each
    decode's row alone, as HF generate multiplies them), so every prompt gives alone the tokens it gives beside the
    others."""
    from batchrun.engine.model.quantization import quantizes_its_input

    target, want = checkpoint(name)
    llm = LLM(model=str(target), dtype="float32", device="cpu", num_pages=64, prefix_sharing=False)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if quantizes_its_input(m)]
    assert len(layers) == 7 * model.config.num_hidden_layers  # q, k, v, o, gate, up, down
    weight, rows = layers[0].weight, []
    linear = torch.nn.functional.linear

    def counted(x, w, *args):
        if w is weight:
            rows.append(x.shape[-2])
        return linear(x, w, *args)

    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "linear", counted)
        outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    # the four prompts in one step (a product per prompt), then decodes of one row each
    assert rows[: len(PROMPTS)] == [len(p) for p in PROMPTS]
    assert len(rows) > len(PROMPTS) and set(rows[len(PROMPTS) :]) == {1}
    sp = SamplingParams(max_new_tokens=NEW_TOKENS)
    assert [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS] == want


@pytest.mark.parametrize("name", ["ct-w4a16", "torchao-int8", "bnb-4bit", "gptq"])
def test_quantized_layers_are_never_packed(checkpoint, name):
    """Even where the model does not say it is quantized (no hf_quantizer, is_quantized or quantization_config), each
    quantized layer is told apart by its class, its weight's type or dtype, or its quantization scheme."""
    from transformers import AutoModelForCausalLM

    from batchrun.engine.model.ops.cpu_linear import PackedLinear, pack_linear_layers
    from batchrun.engine.model.quantization import quantized

    target, _ = checkpoint(name)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    assert quantized(model) and pack_linear_layers(model) == 0
    model.hf_quantizer, model.is_quantized = None, False
    del model.config.quantization_config
    layers = dict(model.named_modules())
    assert not quantized(model) and pack_linear_layers(model) == 1  # the LM head, which stays float
    assert isinstance(model.lm_head, PackedLinear)
    kept = {n: m for n, m in model.named_modules() if n.startswith("model.layers.0.") and n.endswith("proj")}
    assert kept and all(m is layers[n] for n, m in kept.items())


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_bf16_models_fused_modules_stay_within_one_ulp_of_hfs(checkpoint, name):
    """Around its quantized layers a format's model is bf16 (bitsandbytes keeps its norms in fp32: a norm is
    rewritten only at the model's dtype): the Llama-form modules (model_families.LLAMA_FORM) are fused as in the
    family matrix (tests/test_fused_elementwise_families.py), each one's values within the kernel's ulps of HF's
    own on the inputs one HF forward gave it; as batchrun loads the checkpoint, the same count."""
    from helpers import check_fused, fused_modules, record_calls
    from model_families import LLAMA_FORM
    from transformers import AutoModelForCausalLM

    from batchrun.engine.model.loading import load_model
    from batchrun.engine.model.ops import fused_elementwise
    from batchrun.model_loader import load_config

    target, _ = checkpoint(name)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
    llama_form = [
        m
        for m in model.modules()
        if type(m).__name__ in LLAMA_FORM[model.config.model_type]
        and getattr(m, "weight", torch.empty(0, dtype=torch.bfloat16)).dtype == torch.bfloat16
    ]
    calls = record_calls(model, torch.tensor([PROMPTS[1]]))
    assert fused_elementwise.fuse(model, torch.bfloat16) == len(llama_form)
    if llama_form:  # none in MXFP4's checkpoint, which is GPT-OSS's layout
        equal, total = map(sum, zip(*(check_fused(m, calls) for m in fused_modules(model)), strict=True))
        assert equal / total > 0.99
    ours = load_model(target, torch.bfloat16, torch.device("cpu"), load_config(target))[1]
    assert fused_elementwise.fuse(ours, torch.bfloat16) == len(llama_form)


def loaded(target):
    """The model as batchrun loads it (the compressed-tensors weights unpacked, as at load)."""
    from batchrun.engine.model.loading import load_model
    from batchrun.model_loader import load_config

    return load_model(target, torch.float32, torch.device("cpu"), load_config(target))[1]


def tensors(model):
    return {id(t): t for t in (*model.parameters(), *model.buffers())}.values()


def test_weights_bytes_and_format_in_the_summary(checkpoint, tmp_path):
    """torchao's int8 weights in memory: int8 values, a float scale and an int8 zero point per row (its
    Int8Tensor's own
    `nbytes` is that of the float weight it stands for); the job summary names the format and those bytes."""
    from batchrun.config import load_job
    from batchrun.job import Job
    from batchrun.report import format_summary

    target, _ = checkpoint("torchao-int8")
    write_prompts(tmp_path / "in.parquet", ["a,b.c"])  # token ids under the tiny model's 256
    job = write_job(
        tmp_path / "job.yaml",
        f"name: q\nmodel:\n  path: {target}\n  dtype: float32\n  chat_template: false\ninput:\n  parquet: {tmp_path / 'in.parquet'}\n"
        f"sampling:\n  max_new_tokens: 4\nengine:\n  num_pages: 16\n  device: cpu\n"
        f"output:\n  path: {tmp_path / 'out'}\n",
    )
    summary = Job(load_job(job), progress=False).run()
    model = loaded(target)
    expected = float_bytes = 0
    for t in tensors(model):
        float_bytes += t.numel() * t.element_size()
        if type(t).__name__ == "Int8Tensor":
            parts = (t.qdata, t.scale, t.zero_point)
            expected += sum(part.numel() * part.element_size() for part in parts)
        else:
            expected += t.numel() * t.element_size()
    assert summary["weights_format"] == "torchao" and summary["weights_bytes"] == expected, summary
    assert expected < float_bytes / 2  # the projections' weights in a quarter of their float bytes
    printed = format_summary(summary)
    assert "torchao, " in printed and "in memory (beside a KV cache of" in printed, printed


def test_compressed_tensors_weights_are_unpacked_at_load(checkpoint):
    """compressed-tensors unpacks a CPU model's weights on its first forward; batchrun does it at load, so the
    bytes it counts are the run's: every parameter and buffer, the dequantized float weights among them."""
    from batchrun.engine.model.quantization import Weights

    target, _ = checkpoint("ct-w4a16")
    model = loaded(target)
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.endswith("weight_packed") for n in names), names
    assert any(n.endswith("up_proj.weight") for n in names)
    weights = Weights.of(model, "compressed-tensors")
    assert weights.format == "compressed-tensors"
    assert weights.bytes == sum(t.numel() * t.element_size() for t in tensors(model))


@pytest.mark.parametrize("name", sorted(DEQUANTIZED))
def test_a_dequantized_format_is_named(checkpoint, name):
    target, _ = checkpoint(name)
    llm = LLM(model=str(target), dtype="float32", device="cpu", num_pages=16)
    assert llm.weights.format == f"{name}, dequantized to float32"


def test_mxfp4_checkpoint_is_in_gpt_oss_layout():
    """The MXFP4 maker's blocks and scales read back by transformers' own dequantizer (what it loads gpt-oss's
    checkpoints with) to the very weights, where each is an e2m1 number times its run's power of two and each
    run's largest is 4 or 6 times it: so the nibble order, the runs' axis and the exponent's bias are the
    published checkpoints'."""
    from quantized_models import FP4_MAGNITUDES, to_mxfp4
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    experts, n_in, n_out = 2, 64, 96  # stored [experts, in, out], as gpt-oss's experts are
    values = FP4_MAGNITUDES[torch.randint(0, 8, (experts, n_out, n_in // 32, 32), generator=g)]
    values[..., 0] = FP4_MAGNITUDES[torch.randint(6, 8, values.shape[:-1], generator=g)]  # 4 or 6
    signs = torch.randint(0, 2, values.shape, generator=g) * 2 - 1
    exponents = torch.randint(-6, 4, (*values.shape[:-1], 1), generator=g)
    weight = (values * signs * torch.exp2(exponents)).reshape(experts, n_out, n_in).transpose(1, 2)
    blocks, scales = to_mxfp4(weight.transpose(1, 2))
    assert blocks.shape == (experts, n_out, n_in // 32, 16) and scales.shape == (experts, n_out, n_in // 32)
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), weight)


@pytest.mark.parametrize(
    "method, absent, check, extra",
    [
        ("compressed-tensors", "compressed_tensors", "is_compressed_tensors_available", "compressed-tensors"),
        ("gptq", "optimum", "is_optimum_available", "gptq"),
        # without gptqmodel on a CPU, transformers says "GPU is required", not `pip install gptqmodel`
        ("gptq", "gptqmodel", "is_gptqmodel_available", "gptq"),
        ("awq", "gptqmodel", "is_gptqmodel_available", "gptq"),
    ],
)
def test_a_missing_package_names_the_batchrun_extra(
    float_dir, tmp_path, monkeypatch, method, absent, check, extra
):
    """transformers' own error for a missing package reaches the user with the package and the extra that
    brings it (the package is made to look absent, installed or not)."""
    import shutil

    target = tmp_path / "quantized"
    shutil.copytree(float_dir, target)
    config = json.loads((target / "config.json").read_text())
    settings = (
        {"format": "pack-quantized"} if method == "compressed-tensors" else {"bits": 4, "group_size": 64}
    )
    config["quantization_config"] = {"quant_method": method, **settings}
    (target / "config.json").write_text(json.dumps(config))
    from batchrun.engine.model import quantization

    quantizer = importlib.import_module(f"transformers.quantizers.quantizer_{method.replace('-', '_')}")
    monkeypatch.setattr(quantizer, check, lambda: False)
    monkeypatch.setattr(quantization, "installed", lambda module: module != absent)
    with pytest.raises(BadInput) as e:
        LLM(model=str(target), dtype="float32", device="cpu", num_pages=16)
    message = str(e.value)
    assert f"{method} format" in message and f"needs the {absent} package" in message, message
    assert f"pip install 'batchrun[{extra}]'" in message, message


def test_llm_int8_with_outliers_chooses_each_sequences_columns_from_it_alone(checkpoint, monkeypatch):
    """LLM.int8() with an outlier threshold (6.0, the default) computes in fp16 the input columns where any row it
    is given passes the threshold: each sequence of a step runs the layer alone, so a prompt's fp16 columns are
    its own, as HF generate chooses them for that prompt alone. Checked to matter: the four prompts' columns
    differ, so the packed step's (their union) would be another set for some prompt."""
    import bitsandbytes.functional as bnb_functional

    from batchrun.engine.model.quantization import chooses_columns_from_its_batch

    target, want = checkpoint("bnb-8bit-outliers")
    llm = LLM(model=str(target), dtype="float32", device="cpu", num_pages=64, prefix_sharing=False)
    model = llm.engine.runner.model
    layers = {name: m for name, m in model.named_modules() if chooses_columns_from_its_batch(m)}
    assert len(layers) == 7 * model.config.num_hidden_layers  # q, k, v, o, gate, up, down
    watched = layers["model.layers.0.self_attn.o_proj"]
    calls, inside = [], []  # (rows, fp16 columns) of the watched layer's quantizations
    quantize = bnb_functional.int8_vectorwise_quant

    def recorded(a, threshold=0.0):
        out = quantize(a, threshold=threshold)
        if inside:
            calls.append((a.shape[0], frozenset(out[2].tolist() if out[2] is not None else ())))
        return out

    monkeypatch.setattr(bnb_functional, "int8_vectorwise_quant", recorded)
    watched.register_forward_pre_hook(lambda *_: inside.append(True))
    watched.register_forward_hook(lambda *_: inside.clear())
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    prompts = calls[: len(PROMPTS)]
    assert [rows for rows, _ in prompts] == [len(p) for p in PROMPTS]
    assert set(rows for rows, _ in calls[len(PROMPTS) :]) == {1}
    union = frozenset().union(*(columns for _, columns in prompts))
    assert union and any(columns != union for _, columns in prompts)
    sp = SamplingParams(max_new_tokens=NEW_TOKENS)
    assert [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS] == want


def test_llm_int8_with_outliers_computes_each_prompt_whole_and_shares_no_prefix(checkpoint):
    """A chunk of a prompt, or a prompt started from a prefix another prompt's product computed, would choose its
    fp16 columns from other tokens than HF generate's one product of the whole prompt: such a model's prompts
    are computed whole past the step's token budget, and no prefix is shared."""
    target, _ = checkpoint("bnb-8bit-outliers")
    prefix = list(range(100, 140))  # two and a half pages of 16
    prompts = [[1, *prefix, 7, 8], [1, *prefix, 9], [1, *prefix, *range(150, 190)]]
    want = hf_greedy(target, prompts, NEW_TOKENS)
    llm = LLM(model=str(target), dtype="float32", device="cpu", num_pages=64, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert not llm.engine.block_manager.prefix_cache.enabled
    assert llm.engine.scheduler.whole_prompts
