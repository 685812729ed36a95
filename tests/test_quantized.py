"""Quantized checkpoints (tests/quantized_models.py makes them with each format's own tooling): batchrun's
tokens equal HF `generate` on the same checkpoint loaded the same way, greedy fp32, on the torch and gather
backends and under preemption; quantized layers are never packed for oneDNN; the summary counts the weights'
real bytes and names their format; a missing package names the batchrun extra that brings it.

Each format's test skips when its package is not installed (`make install` installs none of them)."""

import importlib
import json

import pytest
import torch
from helpers import hf_greedy, write_job, write_prompts
from quantized_models import FORMATS, save_float

from batchrun import LLM, SamplingParams
from batchrun.errors import BadInput

PROMPTS = [[1, 5, 9, 33, 70], [1, *range(10, 60)], [1, 200, 3], [1, *range(100, 140, 3)]]
NEW_TOKENS = 16
REFUSED = {"bnb-8bit-outliers": "llm_int8_threshold=6.0"}  # format -> what the refusal names


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
@pytest.mark.parametrize("name", [name for name in FORMATS if name not in REFUSED])
def test_equals_hf_generate_on_the_same_checkpoint(checkpoint, name, attention):
    target, want = checkpoint(name)
    llm, outs = generate(target, attention=attention)
    assert [o.outputs[0].token_ids for o in outs] == want
    # weights transformers keeps quantized are never packed; FP8 is dequantized to plain floats on a CPU
    assert llm.packed_weights == (name == "fp8")


@pytest.mark.parametrize("name", ["ct-w4a16", "torchao-int8"])
def test_equals_hf_generate_under_preemption(checkpoint, name):
    target, want = checkpoint(name)
    # 8 pages of 16 tokens cannot hold the four sequences (up to 67 tokens each) at once
    _, outs = generate(target, num_pages=8, page_size=16, preemption="recompute")
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.outputs[0].num_preemptions for o in outs) > 0


@pytest.mark.parametrize("name", ["ct-w4a16", "torchao-int8", "bnb-4bit"])
def test_quantized_layers_are_never_packed(checkpoint, name):
    """Even where the model does not say it is quantized (no hf_quantizer, is_quantized or quantization_config), each
    quantized layer is told apart by its class, its weight's type or dtype, or its quantization scheme."""
    from transformers import AutoModelForCausalLM

    from batchrun.engine.cpu_linear import PackedLinear, pack_linear_layers
    from batchrun.engine.quantization import quantized

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


def loaded(target):
    """The model as batchrun loads it (the compressed-tensors weights unpacked, as at load)."""
    from batchrun.engine.loading import load_model
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
    from batchrun.engine.quantization import Weights

    target, _ = checkpoint("ct-w4a16")
    model = loaded(target)
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.endswith("weight_packed") for n in names), names
    assert any(n.endswith("up_proj.weight") for n in names)
    weights = Weights.of(model, "compressed-tensors")
    assert weights.format == "compressed-tensors"
    assert weights.bytes == sum(t.numel() * t.element_size() for t in tensors(model))


def test_dequantized_fp8_is_named(checkpoint):
    target, _ = checkpoint("fp8")
    llm = LLM(model=str(target), dtype="float32", device="cpu", num_pages=16)
    assert llm.weights.format == "fp8, dequantized to float32"


def test_a_missing_package_names_the_batchrun_extra(float_dir, tmp_path, monkeypatch):
    """transformers' own `pip install compressed-tensors` error reaches the user with the extra that brings
    it (the package is made to look absent, installed or not)."""
    import shutil

    target = tmp_path / "ct"
    shutil.copytree(float_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (target / "config.json").write_text(json.dumps(config))
    from batchrun.engine import quantization

    quantizer = importlib.import_module("transformers.quantizers.quantizer_compressed_tensors")
    monkeypatch.setattr(quantizer, "is_compressed_tensors_available", lambda: False)
    monkeypatch.setattr(quantization, "installed", lambda module: False)
    with pytest.raises(BadInput) as e:
        LLM(model=str(target), dtype="float32", device="cpu", num_pages=16)
    assert "compressed-tensors format" in str(
        e.value
    ) and "pip install 'batchrun[compressed-tensors]'" in str(e.value)


def test_bnb_8bit_with_outlier_columns_is_refused_at_load(checkpoint, tmp_path):
    """LLM.int8()'s outlier columns are chosen from the whole batch: refused, exit 2, naming the setting (HF
    generate gives each prompt alone tokens that batching would change)."""
    from helpers import run_cli

    target, _ = checkpoint("bnb-8bit-outliers")
    write_prompts(tmp_path / "in.parquet", ["Hi"])
    job = write_job(
        tmp_path / "job.yaml",
        f"name: q\nmodel:\n  path: {target}\n  dtype: float32\ninput:\n  parquet: {tmp_path / 'in.parquet'}\n"
        f"engine:\n  num_pages: 16\n  device: cpu\noutput:\n  path: {tmp_path / 'out'}\n",
    )
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 2 and REFUSED["bnb-8bit-outliers"] in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
