"""What giving back the pages behind a sliding window buys: a Gemma-3-shaped model (5 sliding layers of window
1024 : 1 full, random weights, narrow layers so that the CPU runs it), prompts of 4,096 tokens and 256 new
tokens each, under one KV budget, run twice by the same engine:

  groups  KV cache groups (what batchrun does): the sliding layers' pages behind the window go back to the pool
  kept    every layer in one group, every page held to the end (batchrun before KV cache groups)

  python -m bench.micro.window_memory [--rows 24] [--budget-seqs 4] [--chunk 1024]

Prints, per mode: KV memory held per running sequence in decode-only steps (mean, as a share of what full
attention holds), sequences running at once (peak and mean over decode steps), generated tokens per second,
and whether both modes generated the same tokens. `--budget-seqs`: the budget in sequences of 4,352 tokens
under full attention.
"""

from __future__ import annotations

import argparse
import time

import torch


def make_model():
    from transformers import AutoConfig

    from batchrun.engine.loading import paged_model_from_config

    cfg = AutoConfig.for_model(
        "gemma3_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        sliding_window=1024,
        max_position_embeddings=8192,
        initializer_range=0.3,
    )
    assert cfg.layer_types.count("sliding_attention") == 5, cfg.layer_types
    torch.manual_seed(0)
    return paged_model_from_config(cfg).eval()


def run(model, mode: str, prompts, new_tokens: int, budget_bytes: int, chunk: int) -> dict:
    from batchrun.engine import Engine, EngineConfig, SamplingParams
    from batchrun.engine.architecture import KVGroups, ModelAttention
    from batchrun.engine.attention import FULL

    groups_property = ModelAttention.groups
    if mode == "kept":  # one group of full attention for every layer: no page goes back
        ModelAttention.groups = property(lambda self: KVGroups.of_layers([FULL] * self.num_layers))
    try:
        config = EngineConfig(
            device="cpu", kv_cache_memory=str(budget_bytes), max_num_batched_tokens=chunk, max_num_seqs=256
        )
        engine = Engine(model, None, config, torch.device("cpu"), set(), 8192)
    finally:
        ModelAttention.groups = groups_property
    params = SamplingParams(max_new_tokens=new_tokens)
    for i, p in enumerate(prompts):
        engine.add(p, params, request=i)
    bytes_per_page = engine.kv_shape.bytes_per_page
    held, running, outputs, generated = [], [], {}, 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        r = engine.step()
        generated += r.num_generated
        for s in r.finished:
            outputs[s.request] = s.output_token_ids
        decode_only = r.plan.scheduled and all(s.num_new_tokens == 1 for s in r.plan.scheduled)
        if decode_only and engine.num_running:
            held.append(engine.num_used_pages * bytes_per_page / engine.num_running)
            running.append(engine.num_running)
    wall = time.perf_counter() - t0
    return {
        "bytes_per_seq": sum(held) / len(held),
        "peak_running": max(running),
        "mean_running": sum(running) / len(running),
        "tok_s": generated / wall,
        "wall_s": wall,
        "groups": engine.kv_groups.num_groups,
        "outputs": [outputs[i] for i in range(len(prompts))],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--budget-seqs", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=1024, help="engine.max_num_batched_tokens")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = make_model()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (args.prompt,), generator=gen).tolist() for _ in range(args.rows)]
    # the budget: `budget_seqs` whole sequences under full attention (pages of all 6 layers)
    full_bytes_per_token = 6 * 2 * 16 * 2 * 4  # layers x (K, V) x head dim x KV heads x fp32
    seq_tokens = -(-(args.prompt + args.new) // 16) * 16
    budget = args.budget_seqs * seq_tokens * full_bytes_per_token
    full_seq_bytes = seq_tokens * full_bytes_per_token
    results = {mode: run(model, mode, prompts, args.new, budget, args.chunk) for mode in ("kept", "groups")}
    print(
        f"gemma3-shaped (5 sliding of 1024 : 1 full), {args.rows} rows of {args.prompt} + {args.new} tokens, "
        f"KV budget {budget / 2**20:.1f} MiB ({args.budget_seqs} full-attention sequences), "
        f"max_num_batched_tokens {args.chunk}"
    )
    print("mode    groups  KV held per sequence (decode)  running peak  running mean  gen tok/s  wall s")
    for mode, r in results.items():
        share = r["bytes_per_seq"] / full_seq_bytes
        print(
            f"{mode:7s} {r['groups']:6d}  {r['bytes_per_seq'] / 2**20:7.2f} MiB = {share:5.2f} x full     "
            f"{r['peak_running']:12d}  {r['mean_running']:12.1f}  {r['tok_s']:9.1f}  {r['wall_s']:6.1f}"
        )
    k, g = results["kept"], results["groups"]
    print(
        f"groups / kept: KV per sequence {g['bytes_per_seq'] / k['bytes_per_seq']:.2f}x, running peak "
        f"{g['peak_running'] / k['peak_running']:.2f}x, mean {g['mean_running'] / k['mean_running']:.2f}x, "
        f"tok/s {g['tok_s'] / k['tok_s']:.2f}x; same tokens: {g['outputs'] == k['outputs']}"
    )


if __name__ == "__main__":
    main()
