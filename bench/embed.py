"""Embedding: batchrun's `task: embed` against sentence-transformers' `encode` (its default batch size of 32 and
its length sorting) and vLLM's pooling runner (`LLM(runner="pooling").embed`, its CPU build), side by side in one
run, each side in a process of its own (its own start, imports, load, peak RSS), on the CPU in fp32 (or, with
`--dtype bfloat16`, each side loading the model in bf16: batchrun's `model.dtype`, sentence-transformers'
`model_kwargs`, vLLM's `dtype`), on the same texts and the same checkpoint folder: jobs/make_embed_data.py's MiniLM-L6-shaped BERT (random weights, the
embedded model's tokenizer) on passages of 5 to N words, or with `--shape qwen3` its Qwen3-Embedding-0.6B-shaped
decoder (last-token pooling of an appended end-of-text, the older folder layout).

Reports texts/s and tokens/s of the whole process and of the embedding alone, peak RSS, the padding each
computed (batchrun: none; sentence-transformers: its length-sorted batches padded to their longest; vLLM: none,
it packs too), and the largest difference of each side's vectors from sentence-transformers' (in bf16 also the
smallest cosine of each side's vectors to sentence-transformers' fp32 ones, first 50 texts). vLLM is handed the
token ids sentence-transformers' tokenizer makes (so its embedding time has no tokenizing in it) and runs in its
own virtual environment (`$VLLM_PYTHON`, default /tmp/vllm-venv/bin/python; bench/vs_vllm.py says how to make
it) with both cores; without it the table has no vLLM row and says so.

Usage: python -m bench.embed [--texts 2000] [--max-words 400] [--shape minilm|qwen3] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .common import (
    OUT,
    VLLM_PYTHON,
    columns,
    environment,
    in_process,
    peak_rss_mib,
    run_vllm_peer,
    save,
)

MODULE = "bench.embed"
# --shape: what the table calls it, and the longest text its sentence-transformers folder keeps (max_seq_length)
SHAPES = {
    "minilm": ("MiniLM-L6 shape (BERT, 6 layers, 384 wide, mean pooling)", 256),
    "qwen3": ("Qwen3-Embedding-0.6B shape (28 layers, 1024 wide, last-token pooling)", 512),
}


def run_batchrun(model: str, data: str, label: str, dtype: str = "float32") -> dict:
    t0 = time.perf_counter()
    import pyarrow.parquet as pq

    from batchrun import LLM

    texts = pq.read_table(data).column("text").to_pylist()
    llm = LLM(model, dtype=dtype, device="cpu", runner="pooling", max_num_batched_tokens=4096)
    t1 = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=False)
    t2 = time.perf_counter()
    return {
        "label": label,
        "process_s": t2 - t0,
        "embed_s": t2 - t1,
        "texts": len(texts),
        "tokens": sum(len(o.prompt_token_ids) for o in outs),
        "padding": 0,
        "peak_rss_mib": peak_rss_mib(),
        "vectors": [o.outputs.embedding for o in outs[:50]],
    }


def run_sentence_transformers(model: str, data: str, label: str, dtype: str = "float32") -> dict:
    t0 = time.perf_counter()
    import pyarrow.parquet as pq
    import torch
    from sentence_transformers import SentenceTransformer

    texts = pq.read_table(data).column("text").to_pylist()
    st = SentenceTransformer(model, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
    t1 = time.perf_counter()
    vectors = st.encode(texts, convert_to_tensor=True)
    t2 = time.perf_counter()
    fp32 = vectors[:50].float()  # the reference the sides' cosines are taken to: fp32's own vectors
    if dtype != "float32":  # after the timed part: an fp32 load of its own, on the first 50 texts
        fp32 = SentenceTransformer(model, device="cpu").encode(texts[:50], convert_to_tensor=True)
    # what its batches computed: sorted by length (longest first, as encode sorts), 32 a batch, each padded
    lengths = sorted(st.tokenize(texts)["attention_mask"].sum(dim=1).tolist(), reverse=True)
    padded = sum(max(lengths[i : i + 32]) * len(lengths[i : i + 32]) for i in range(0, len(lengths), 32))
    return {
        "label": label,
        "process_s": t2 - t0,
        "embed_s": t2 - t1,
        "texts": len(texts),
        "tokens": sum(lengths),
        "padding": padded - sum(lengths),
        "peak_rss_mib": peak_rss_mib(),
        "vectors": vectors[:50].float().tolist(),
        "fp32_vectors": fp32.tolist(),
    }


def run_vllm(model: str, texts: list[str], work: Path, label: str, dtype: str = "float32") -> dict:
    """vLLM's pooling runner on the token ids sentence-transformers' tokenizer makes of `texts`, in its own
    environment (bench/vllm_embed_peer.py); the process's wall time from its start to the last vector."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)(texts, truncation=True)["input_ids"]  # cut at max_seq_length
    (work / "vllm-ids.json").write_text(json.dumps(ids))
    result = work / "vllm-result.json"
    print(f"  running {label} ...", flush=True)
    t0 = time.perf_counter()
    proc = run_vllm_peer("vllm_embed_peer.py", [model, work / "vllm-ids.json", result, dtype])
    process_s = time.perf_counter() - t0
    if proc.returncode != 0:  # the other sides' figures stand: the table says how vLLM ended
        print(f"vLLM failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
        last = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or [""]
        return {"label": label, "failed": f"exit {proc.returncode}: {last[0].strip()[:200]}"}
    r = json.loads(result.read_text())
    return {**r, "label": label, "process_s": process_s, "texts": len(texts), "padding": 0}


def cosine(u: list[float], v: list[float]) -> float:
    dot = sum(a * b for a, b in zip(u, v))
    return dot / max((sum(a * a for a in u) * sum(b * b for b in v)) ** 0.5, 1e-30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--max-words", type=int, default=400)
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="minilm", help="the embedder's shape (random weights)"
    )
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="every side's model dtype"
    )
    args = parser.parse_args()
    work = OUT / f"embed-{args.shape}"
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.make_embed_data import make_model, passages

    work.mkdir(parents=True, exist_ok=True)
    texts = passages(args.texts, args.max_words)
    pq.write_table(pa.table({"text": texts}), work / "texts.parquet")
    model = make_model(work / "model", max_seq_length=SHAPES[args.shape][1], shape=args.shape)
    common = {"model": str(model), "data": str(work / "texts.parquet"), "dtype": args.dtype}
    reference = in_process(MODULE, "run_sentence_transformers", label="sentence-transformers", **common)
    results = [in_process(MODULE, "run_batchrun", label="batchrun", **common), reference]
    if VLLM_PYTHON.exists():
        peer = (
            "vLLM: its CPU build, both cores, eager, prefix caching off, fed sentence-transformers' token ids"
        )
        vllm = run_vllm(common["model"], texts, work, "vLLM", args.dtype)
        if "failed" in vllm:
            peer = f"vLLM: failed, {vllm['failed']}"
        else:
            results.append(vllm)
    else:
        peer = f"vLLM: not run ({VLLM_PYTHON} absent; bench/vs_vllm.py says how to install its CPU build)"
    expected, fp32 = reference["vectors"], reference.pop("fp32_vectors")
    for r in results:
        vectors = r.pop("vectors")
        r["diff"] = max(abs(a - b) for u, v in zip(vectors, expected) for a, b in zip(u, v))
        r["cosine_fp32"] = min(cosine(u, v) for u, v in zip(vectors, fp32))
        r["texts_per_s"] = r["texts"] / r["process_s"]
        r["embed_texts_per_s"] = r["texts"] / r["embed_s"]
        r["tokens_per_s"] = r["tokens"] / r["embed_s"]
        r["ratio"] = reference["embed_s"] / r["embed_s"]
    env = environment()
    text = "\n".join(
        [
            f"{args.texts} texts of 5 to {args.max_words} words, {SHAPES[args.shape][0]}, {args.dtype}, "
            f"{env.get('cpu')}",
            *columns(
                {
                    "": "{label}",
                    "texts/s (process)": "{texts_per_s:.1f}",
                    "texts/s (embedding)": "{embed_texts_per_s:.1f}",
                    "tokens/s (embedding)": "{tokens_per_s:.0f}",
                    "x sentence-transformers (embedding)": "{ratio:.2f}",
                    "tokens": "{tokens}",
                    "padding computed": "{padding}",
                    "peak RSS MiB": "{peak_rss_mib:.0f}",
                    "max abs diff from sentence-transformers (first 50 texts)": "{diff:.1e}",
                    "min cosine to sentence-transformers fp32 (first 50 texts)": "{cosine_fp32:.6f}",
                },
                results,
            ),
            peer,
        ]
    )
    save({"results": results, "environment": env}, work / "report.json", text)


if __name__ == "__main__":
    from .common import serve_one

    if not serve_one({"run_batchrun": run_batchrun, "run_sentence_transformers": run_sentence_transformers}):
        main()
