"""LoRA adapters: what rows of many adapters cost against the base model, side by side in one run.

The reference workload (common.reference_prompts: 60 chat prompts, half behind one shared context), greedy, 64 new
tokens, fp32, on the embedded SmolLM2-135M-Instruct with four random rank-16 adapters (PEFT, init_lora_weights
False) on every linear layer of the decoder (q, k, v, o, gate, up, down):

1. base: the model alone, no adapters;
2. base, 4 loaded: the four adapters loaded, every row on the base model (what wrapping the layers costs);
3. one adapter: every row on adapter 0;
4. four adapters: the rows spread over the four, in turn (four adapters in every step);
5. PEFT: `PeftModel.generate` per adapter over that adapter's 15 rows, one padded batch each (as a user of PEFT
   would run the four-adapter workload).

batchrun's runs alternate in rounds (`--runs`, default 2), each in its own process; each configuration is given as
its best run and as the median over the rounds of its run against the base run of the same round (the machine's
speed drifts between minutes by more than what is measured, so a cost is judged beside its own base); the rows of
adapter 0 in
(4) are checked equal to (3) token for token (a row does not depend on its batch-mates' adapters). vLLM's CPU
build with `enable_lora` (bench/vllm_lora_peer.py: max_loras 4, eager mode, a LoRARequest per prompt) runs the
base, one-adapter and four-adapter workloads where its virtual environment is (bench/vs_vllm.py); without it the
table says so.

Usage: python -m bench.lora [--runs 2] [--rank 16] [--no-peers]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from .common import (
    OUT,
    VLLM_PYTHON,
    chat_ids,
    environment,
    in_process,
    reference_prompts,
    run_vllm_peer,
    save,
    serve_one,
    table,
)

MODULE = "bench.lora"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW_TOKENS = 64


def make_adapters(model_dir: Path, work: Path, rank: int, count: int = 4) -> list[str]:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    folders = []
    for i in range(count):
        torch.manual_seed(1000 + i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        model = peft.get_peft_model(base, config)
        with torch.no_grad():  # B small enough that the adapted model still writes text
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.05)
        folder = work / f"adapter-{i}"
        model.save_pretrained(folder)
        folders.append(str(folder))
    return folders


def batchrun_run(work: str, label: str, model_dir: str, adapters: list[str], cells: list) -> dict:
    """One job over the workload; `cells`: each row's adapter name (None: the base model)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchrun import run_job

    work_path = Path(work)
    slug = "".join(c if c.isalnum() else "-" for c in label)
    prompts = reference_prompts()
    pq.write_table(
        pa.table({"id": list(range(len(prompts))), "prompt": prompts, "adapter": cells}),
        work_path / f"in-{slug}.parquet",
    )
    out = work_path / f"out-{slug}"
    model = {"path": model_dir, "dtype": "float32"}
    inp = {"parquet": str(work_path / f"in-{slug}.parquet"), "id_column": "id"}
    if adapters:
        model["adapters"] = {f"a{i}": f for i, f in enumerate(adapters)}
        inp["adapter_column"] = "adapter"
    job = {
        "name": f"lora-{slug}",
        "model": model,
        "input": inp,
        "output": {"path": str(out), "token_ids": True},
        "sampling": {"max_new_tokens": NEW_TOKENS},
        "engine": {"device": "cpu"},
    }
    summary = run_job(job, overwrite=True, progress=False)
    rows = sorted(
        pq.read_table(out, columns=["id", "completion_token_ids"]).to_pylist(), key=lambda r: r["id"]
    )
    return {
        "label": label,
        "tokens_per_s": summary["generated_tokens"] / summary["wall_s"],
        "generated_tokens": summary["generated_tokens"],
        "adapter_loads": summary["adapter_loads"],
        "completions": [r["completion_token_ids"] for r in rows],
    }


def peft_run(label: str, model_dir: str, adapters: list[str], cells: list) -> dict:
    """PEFT: each adapter's rows as one left-padded batch through `PeftModel.generate`."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .common import chat_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = chat_ids(tok, reference_prompts())
    generated, seconds = 0, 0.0
    for i, folder in enumerate(adapters):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(base, folder).eval()
        rows = [p for p, c in zip(ids, cells) if c == f"a{i}"]
        width = max(map(len, rows))
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        batch = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=batch,
                attention_mask=mask,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=pad,
            )
        seconds += time.perf_counter() - t0
        generated += sum(
            int((row[width:] != pad).sum())
            if tok.eos_token_id is None
            else _until_eos(row[width:], tok.eos_token_id)
            for row in out
        )
    return {"label": "peft", "tokens_per_s": generated / seconds, "generated_tokens": generated}


def vllm_run(work: Path, model_dir: str, adapters: list[str], cells: list, rank: int) -> dict | None:
    """vLLM's CPU build with enable_lora on the workload (None where it is not installed or fails: the reason is
    printed)."""
    import json

    from transformers import AutoTokenizer

    if not VLLM_PYTHON.exists():
        return None
    ids = chat_ids(AutoTokenizer.from_pretrained(model_dir), reference_prompts())
    index = [None if c is None else int(c[1:]) for c in cells]
    files = {}
    for name, value in (("prompts", ids), ("adapters", adapters), ("cells", index)):
        files[name] = work / f"vllm-{name}.json"
        files[name].write_text(json.dumps(value))
    result = work / "vllm-result.json"
    args = [model_dir, files["prompts"], files["adapters"], files["cells"], NEW_TOKENS, rank, result]
    proc = run_vllm_peer("vllm_lora_peer.py", args)
    if proc.returncode != 0:
        print(f"vLLM failed: {proc.stderr[-2000:]}")
        return None
    r = json.loads(result.read_text())
    return {
        "tokens_per_s": r["generated_tokens"] / r["gen_wall_s"],
        "generated_tokens": r["generated_tokens"],
    }


def _until_eos(row, eos: int) -> int:
    ids = row.tolist()
    return ids.index(eos) + 1 if eos in ids else len(ids)


def main() -> None:
    import tempfile

    from batchrun.model_loader import resolve_model_dir

    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--no-peers", action="store_true", help="batchrun alone: no vLLM, no PEFT")
    args = parser.parse_args()
    env = environment()
    model_dir = str(resolve_model_dir(None))
    n = len(reference_prompts())
    configs = {
        "base": ([], [None] * n),
        "base, 4 loaded": (None, [None] * n),
        "one adapter": (None, ["a0"] * n),
        "four adapters": (None, [f"a{i % 4}" for i in range(n)]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        adapters = make_adapters(Path(model_dir), work, args.rank)
        best: dict[str, dict] = {}
        # each round's run of a configuration against that round's base run: the machine's speed drifts by
        # 10-20% from one minute to the next (seen here), more than a configuration's cost, so a configuration
        # is judged against the base run next to it (the median of its rounds), not against the best of all
        ratios: dict[str, list[float]] = {}
        for _ in range(args.runs):
            for label, (given, cells) in configs.items():
                r = in_process(
                    MODULE,
                    "batchrun_run",
                    work=str(work),
                    label=label,
                    model_dir=model_dir,
                    adapters=adapters if given is None else given,
                    cells=cells,
                )
                print(f"    {label}: {r['tokens_per_s']:.1f} tok/s", flush=True)
                if label == "base":
                    round_base = r["tokens_per_s"]
                ratios.setdefault(label, []).append(r["tokens_per_s"] / round_base)
                if label not in best or r["tokens_per_s"] > best[label]["tokens_per_s"]:
                    best[label] = r
        vllm = {}
        for label in () if args.no_peers else ("base", "one adapter", "four adapters"):
            given, cells = configs[label]
            print(f"  running vLLM, {label} ...", flush=True)
            vllm[label] = vllm_run(work, model_dir, adapters, cells, args.rank)
            print(f"    vLLM {label}: {vllm[label]}", flush=True)
        peft_result = None
        if not args.no_peers:
            peft_result = in_process(
                MODULE,
                "peft_run",
                label="peft",
                model_dir=model_dir,
                adapters=adapters,
                cells=configs["four adapters"][1],
            )
    one, four = best["one adapter"]["completions"], best["four adapters"]["completions"]
    same = all(one[i] == four[i] for i in range(0, n, 4))  # the rows on adapter 0 in both runs
    base = best["base"]["tokens_per_s"]
    vllm_base = (vllm.get("base") or {}).get("tokens_per_s")
    rows = []
    for label, r in best.items():
        peer = vllm.get(label)
        rounds = sorted(ratios[label])
        rows.append(
            [
                label,
                r["tokens_per_s"],
                f"{r['tokens_per_s'] / base:.2f}",
                f"{statistics.median(rounds):.2f} ({', '.join(f'{x:.2f}' for x in ratios[label])})",
                r.get("adapter_loads", ""),
                f"{peer['tokens_per_s']:.1f}" if peer else "-",
                f"{peer['tokens_per_s'] / vllm_base:.2f}" if peer and vllm_base else "-",
                f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer else "-",
            ]
        )
    if peft_result is not None:
        rows.append(
            [
                "PEFT generate, a padded batch per adapter",
                peft_result["tokens_per_s"],
                f"{peft_result['tokens_per_s'] / base:.2f}",
                "",
                "",
                "-",
                "-",
                "-",
            ]
        )
    header = [
        "configuration",
        "batchrun tok/s (best)",
        "best / best base",
        "of its round's base (median; each round)",
        "adapter loads",
        "vLLM tok/s",
        "of its base",
    ]
    text = "\n".join(
        [
            f"LoRA adapters, rank {args.rank} on every decoder linear, reference workload, fp32, greedy, "
            f"{NEW_TOKENS} new tokens ({env['cpu']}, {env['cpus']} CPUs, {env['date']})",
            "",
            *table([*header, "batchrun / vLLM"], rows),
            "",
            f"adapter 0's rows equal in 'one adapter' and 'four adapters': {same}",
            "vLLM with enable_lora: "
            + (
                "ran (eager mode, max_loras 4)"
                if vllm_base
                else "not run (--no-peers)"
                if args.no_peers
                else f"not run (no working vLLM at {VLLM_PYTHON})"
            ),
        ]
    )
    save(
        {
            "best": {k: {kk: vv for kk, vv in v.items() if kk != "completions"} for k, v in best.items()},
            "peft": peft_result,
            "ratios_to_round_base": ratios,
            "vllm": vllm,
            "same": same,
            **env,
        },
        OUT / "lora.json",
        text,
    )


if __name__ == "__main__":
    if not serve_one({"batchrun_run": batchrun_run, "peft_run": peft_run}):
        main()
