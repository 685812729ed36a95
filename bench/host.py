"""A step's host work, on a model whose arithmetic is negligible, side by side with HF `generate` and vLLM.

  python -m bench.host                  the tiny model at 1, 64 and 256 running sequences, and the tensor
                                        operations a decode step of a SmolLM2-135M-shaped model dispatches
  python -m bench.host --seqs 1 --no-peers --no-ops     batchrun alone, quickly
  python -m bench.host --seqs 1,256 --variants plain,window,hybrid,lora --no-ops
                                        every kind of model's decode step beside the plain one's, and HF's

The tiny model is a Llama of 2 layers, hidden 128 and a 512-token vocabulary (random weights, fp32): a step is
almost all host work, so what is measured is the engine's own overhead. Each of S prompts has 16 tokens and
generates 128 (greedy, EOS ignored); every prompt is admitted in the first step, so there are S sequences
running in every step. batchrun's split comes from the engine's own phase timers (engine/timing.py) plus the
statistics row the job runner records each step (stats.StatsCollector.record); "attention per layer call" is
the attention phase over steps x layers. HF `generate` runs the same prompts as one batch of equal lengths (no
padding) on the same weights; vLLM (its CPU build, `enforce_eager`, prefix caching off) where
/tmp/vllm-venv exists (bench/vs_vllm.py says how to make it): generation seconds / 128 steps.

`--variants` runs other kinds of model of the same tiny shape beside the plain Llama, each against HF `generate` on
the same weights, with its step as a ratio to the plain model's (a kind of model should cost the host what the
plain one does): `window`, a Gemma-3-form model whose layers alternate a 32-token sliding window (shorter than the
sequences) and full attention; `hybrid`, a Qwen-3.5-form model of three Gated DeltaNet layers to one attention
layer; `lora`, the plain Llama with four random rank-16 adapters taking the rows in turn (HF: PEFT's `generate`
with each row's adapter named, `adapter_names`).

The operation count: a TorchDispatchMode counts every aten operation of one decode step of 8 sequences on a
SmolLM2-135M-shaped model (random weights); batchrun's own are those dispatched outside the model's forward
(prepare, sampling, bookkeeping) plus those inside batchrun's attention function.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .common import OUT, SMOLLM2_135M, VLLM_PYTHON, environment, run_vllm_peer, save, table

NEW_TOKENS = 128
PROMPT_TOKENS = 16


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,  # vLLM's peer asks for max_model_len 2048 (bench/vllm_peer.py)
        tie_word_embeddings=False,
    )


def smollm2_config():
    from transformers import LlamaConfig

    return LlamaConfig(**SMOLLM2_135M, rope_theta=100000.0)


def variant_config(variant: str):
    """The tiny model of `variant` (its weights' folder name is the variant's): the plain Llama for lora too."""
    from transformers import AutoConfig

    if variant in ("plain", "lora"):
        return tiny_config()
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, max_position_embeddings=2048)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    if variant == "window":
        layers = ["sliding_attention", "full_attention"]
        return AutoConfig.for_model(
            "gemma3_text", **shape, **heads, num_hidden_layers=2, layer_types=layers, sliding_window=32
        )
    layers = ["linear_attention"] * 3 + ["full_attention"]
    linear = dict(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32
    )
    return AutoConfig.for_model(
        "qwen3_5_text", **shape, **heads, **linear, num_hidden_layers=4, layer_types=layers
    )


def lora_adapters(model_dir: Path) -> list[str]:
    """Four random rank-16 PEFT adapters of the tiny Llama (bench/lora.py's), saved beside it once."""
    from .lora import make_adapters

    work = model_dir.parent / "tiny-llama-adapters"
    if not (work / "adapter-3" / "adapter_config.json").exists():
        make_adapters(model_dir, work, 16)
    return [str(work / f"adapter-{i}") for i in range(4)]


def row_adapters(n: int) -> list[str]:
    return [f"a{i % 4}" for i in range(n)]


def save_model(config, name: str) -> Path:
    """A random-weight model of `config` (seed 0) saved under out/bench/host/NAME, with a tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    target = OUT / "host" / name
    if (target / "config.json").exists():
        return target
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="t0", eos_token="t1").save_pretrained(target)
    return target


def prompts(n: int, vocab: int) -> list[list[int]]:
    return [[(37 * i + 11 * j + 3) % (vocab - 2) + 2 for j in range(PROMPT_TOKENS)] for i in range(n)]


def make_engine(
    model_dir: Path, max_num_seqs: int, dtype: str = "float32", adapters: list[str] | None = None
):
    """An engine on the CPU, its model prepared as LLM prepares it (engine/model/prepare.py), but that in fp32 its
    weights stay as HF holds them (not packed for oneDNN); `adapters`: LoRA folders, attached as a0, a1, ..."""
    import torch

    from batchrun.adapters import read_adapters
    from batchrun.engine import Engine, EngineConfig, LoadedModel
    from batchrun.engine.model.loading import load_model
    from batchrun.engine.model.prepare import Preparation, prepare_model

    torch_dtype, cpu = getattr(torch, dtype), torch.device("cpu")
    tok, model = load_model(model_dir, torch_dtype, cpu)
    named = read_adapters({f"a{i}": f for i, f in enumerate(adapters or [])}, 64, "bench") if adapters else {}
    preparation = Preparation(cpu, torch_dtype, torch_dtype != torch.float32, named, max_loras=4)
    prepare_model(model, preparation)
    config = EngineConfig(
        device="cpu",
        num_pages=max_num_seqs * 16 + 64,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(4096, max_num_seqs * PROMPT_TOKENS),
        prefix_sharing=False,
    )
    return Engine(LoadedModel(model, tok, max_model_len=4096), config, torch.device("cpu"))


def batchrun_steps(model_dir: Path, n: int, adapters: list[str] | None = None) -> dict:
    """ms per step and its split, for n sequences running together (`adapters`: four, taking the rows in turn)."""
    from batchrun.engine import SamplingParams
    from batchrun.stats import StatsCollector

    engine = make_engine(model_dir, max(n, 1), adapters=adapters)
    names = row_adapters(n) if adapters else [None] * n
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    stats = StatsCollector(engine)
    ids = prompts(n, 512)

    def run() -> tuple[float, int]:
        for p, name in zip(ids, names):
            engine.add(p, params, adapter=name)
        steps = 0
        t0 = time.perf_counter()
        while engine.has_unfinished():
            result = engine.step()
            with engine.times("stats"):
                stats.record(result)
            steps += 1
        return time.perf_counter() - t0, steps

    run()  # warm-up: the kernels' first calls, the allocator's first pages
    times = engine.times
    for phase in times.seconds:
        times.seconds[phase] = 0.0
    wall, steps = run()
    layers = sum(1 for g in engine.kv_groups.layer_group if g >= 0)
    per_step = {p: 1e3 * s / steps for p, s in times.seconds.items()}
    outside = sum(per_step[p] for p in ("schedule", "prepare", "sample", "finish", "stats"))
    return {
        "seqs": n,
        "steps": steps,
        "ms_per_step": 1e3 * wall / steps,
        **{f"{p}_ms": v for p, v in per_step.items()},
        "attention_us_per_layer_call": 1e3 * per_step["attention"] / layers,
        "bookkeeping_ms": outside,
    }


def hf_steps(model_dir: Path, n: int, adapters: list[str] | None = None) -> dict:
    """HF `generate` on the same weights, the n prompts as one batch: ms per generated token step (`adapters`:
    PEFT's, each row naming its own)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts(n, 512))
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    if adapters:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapters[0], adapter_name="a0").eval()
        for i, folder in enumerate(adapters[1:], 1):
            model.load_adapter(folder, adapter_name=f"a{i}")
        kw["adapter_names"] = row_adapters(n)
    with torch.inference_mode():
        model.generate(
            ids[:1, :4],
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
            **({"adapter_names": ["a0"]} if adapters else {}),
        )  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        wall = time.perf_counter() - t0
    return {"seqs": n, "ms_per_step": 1e3 * wall / NEW_TOKENS}


def vllm_steps(model_dir: Path, n: int) -> dict | None:
    """vLLM's CPU build on the same prompt ids (bench/vllm_peer.py in its own venv): ms per step."""
    if not VLLM_PYTHON.exists():
        return None
    work = OUT / "host"
    prompts_file, result_file = work / f"vllm-prompts-{n}.json", work / f"vllm-result-{n}.json"
    prompts_file.write_text(json.dumps(prompts(n, 512)))
    args = [model_dir, prompts_file, "float32", "off", NEW_TOKENS, result_file, "ignore_eos"]
    proc = run_vllm_peer("vllm_peer.py", args, kv_cache_gib=2)
    if proc.returncode != 0:
        print(f"  vLLM failed at {n} sequences:\n{proc.stderr[-2000:]}")
        return None
    result = json.loads(result_file.read_text())
    return {"seqs": n, "ms_per_step": 1e3 * result["gen_wall_s"] / NEW_TOKENS}


def count_ops(dtype: str = "float32") -> dict:
    """aten operations one decode step of 8 sequences dispatches on a SmolLM2-135M-shaped model: all, inside
    the model's forward but outside batchrun's attention (the model's own), and batchrun's own."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from batchrun.engine import SamplingParams
    from batchrun.engine.attention import ATTENTION_NAME

    engine = make_engine(save_model(smollm2_config(), "smollm2-135m-random"), 8, dtype)
    for p in prompts(8, 49152):
        engine.add(p, SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()  # the prompts
    engine.step()  # a first decode step (the kernels' first calls)

    where = {"in_model": False, "in_attention": 0}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = {"model": 0, "attention": 0, "outside": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            key = "attention" if where["in_attention"] else "model" if where["in_model"] else "outside"
            self.counts[key] += 1
            return func(*args, **(kwargs or {}))

    forward = engine.runner.forward  # the model's forward as the runner calls it (a hook on the model would
    # turn batchrun's own outer forward, decoder_stack.py, back into HF's)
    logits = forward.logits

    def in_model(*args, **kwargs):
        where.update(in_model=True)
        try:
            return logits(*args, **kwargs)
        finally:
            where.update(in_model=False)

    forward.logits = in_model
    real = ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME]  # batchrun's attention function, as registered

    def counted(*args, **kwargs):
        where["in_attention"] += 1
        try:
            return real(*args, **kwargs)
        finally:
            where["in_attention"] -= 1

    AttentionInterface.register(ATTENTION_NAME, counted)
    try:
        with Count() as mode:
            engine.step()
    finally:
        AttentionInterface.register(ATTENTION_NAME, real)
        del forward.logits
    c = mode.counts
    return {
        "total": sum(c.values()),
        "model_own": c["model"],
        "batchrun_attention": c["attention"],
        "batchrun_outside_forward": c["outside"],
        "layers": 30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1,64,256")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--no-ops", action="store_true")
    parser.add_argument(
        "--ops-dtype", default="float32", help="the operation count's dtype (bfloat16: fused)"
    )
    parser.add_argument("--variants", default="plain", help="of plain, window, hybrid, lora (plain: always)")
    args = parser.parse_args()
    model_dir = save_model(tiny_config(), "tiny-llama")
    others = [v for v in args.variants.split(",") if v != "plain"]
    rows, kinds = [], []
    for n in [int(s) for s in args.seqs.split(",")]:
        print(f"  {n} sequences ...", flush=True)
        ours = batchrun_steps(model_dir, n)
        hf = None if args.no_peers else hf_steps(model_dir, n)
        vllm = None if args.no_peers else vllm_steps(model_dir, n)
        rows.append({"batchrun": ours, "hf": hf, "vllm": vllm})
        for variant in others:
            print(f"  {n} sequences, {variant} ...", flush=True)
            folder = (
                model_dir if variant == "lora" else save_model(variant_config(variant), f"tiny-{variant}")
            )
            adapters = lora_adapters(model_dir) if variant == "lora" else None
            mine = batchrun_steps(folder, n, adapters)
            peer = None if args.no_peers else hf_steps(folder, n, adapters)
            kinds.append({"variant": variant, "batchrun": mine, "hf": peer, "plain": ours})
    ops = None if args.no_ops else count_ops(args.ops_dtype)
    env = environment()
    lines = [
        f"bench/host.py, {env['date']}, {env['cpu']}, {env['cpus']} cores: ms per step (tiny Llama, fp32)",
        "",
    ]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    lines += table(
        ["seqs", "batchrun", "HF generate", "batchrun / HF", "vLLM", "batchrun / vLLM"],
        [
            [
                r["batchrun"]["seqs"],
                fmt(r["batchrun"]["ms_per_step"]),
                fmt(r["hf"] and r["hf"]["ms_per_step"]),
                fmt(r["hf"] and r["batchrun"]["ms_per_step"] / r["hf"]["ms_per_step"]),
                fmt(r["vllm"] and r["vllm"]["ms_per_step"]),
                fmt(r["vllm"] and r["batchrun"]["ms_per_step"] / r["vllm"]["ms_per_step"]),
            ]
            for r in rows
        ],
    )
    lines += ["", "batchrun's step, ms (the engine's phase timers):", ""]
    phases = ["schedule", "prepare", "forward", "attention", "sample", "finish", "stats"]
    lines += table(
        ["seqs", *phases, "bookkeeping", "attention µs / layer call"],
        [
            [
                r["batchrun"]["seqs"],
                *[fmt(r["batchrun"][f"{p}_ms"]) for p in phases],
                fmt(r["batchrun"]["bookkeeping_ms"]),
                f"{r['batchrun']['attention_us_per_layer_call']:.0f}",
            ]
            for r in rows
        ],
    )
    if kinds:
        lines += [
            "",
            "Each kind of model's step, ms, beside the plain Llama's (one run, same shape; host: the bookkeeping",
            "phases above, the step less the forward):",
            "",
        ]
        lines += table(
            [
                "seqs",
                "model",
                "batchrun",
                "HF generate",
                "batchrun / HF",
                "step / plain step",
                "host / plain host",
            ],
            [
                [
                    r["batchrun"]["seqs"],
                    r["variant"],
                    fmt(r["batchrun"]["ms_per_step"]),
                    fmt(r["hf"] and r["hf"]["ms_per_step"]),
                    fmt(r["hf"] and r["batchrun"]["ms_per_step"] / r["hf"]["ms_per_step"]),
                    fmt(r["batchrun"]["ms_per_step"] / r["plain"]["ms_per_step"]),
                    fmt(r["batchrun"]["bookkeeping_ms"] / r["plain"]["bookkeeping_ms"]),
                ]
                for r in kinds
            ],
        )
    if ops:
        lines += [
            "",
            f"One decode step of 8 sequences, SmolLM2-135M shape: {ops['total']} aten operations; the model's "
            f"own {ops['model_own']}, batchrun's attention {ops['batchrun_attention']} "
            f"({ops['batchrun_attention'] / ops['layers']:.1f} per layer), batchrun outside the forward "
            f"{ops['batchrun_outside_forward']}.",
        ]
    save({"env": env, "rows": rows, "variants": kinds, "ops": ops}, OUT / "host.json", "\n".join(lines))


if __name__ == "__main__":
    main()
