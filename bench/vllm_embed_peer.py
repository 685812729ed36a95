"""The peer's side of `bench/embed.py`: vLLM's pooling runner (`runner="pooling"`, `llm.embed`) on the CPU, on the
same token ids sentence-transformers' tokenizer makes, timed on `embed` alone. Runs in vLLM's own virtual
environment (bench/vs_vllm.py says how to make it), never in batchrun's.

Usage: VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 /tmp/vllm-venv/bin/python bench/vllm_embed_peer.py \
           MODEL_DIR IDS.json RESULT.json [DTYPE]
Writes RESULT.json (vLLM prints its own lines): embed seconds, start-up seconds (imports and load), the tokens,
the first 50 vectors, and the peak RSS of this process and its engine process together (vLLM runs its engine in
a child process, which this process's own peak would miss: both are sampled every 0.1 s).
"""

import json
import sys
import threading
import time


def watch_rss(peak: list[float], stop: threading.Event) -> None:
    """Keeps peak[0] at the largest RSS (MiB) this process and its children have had together."""
    import psutil

    me = psutil.Process()
    while not stop.wait(0.1):
        total = 0
        for p in [me, *me.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:  # a child that has just exited
                pass
        peak[0] = max(peak[0], total / 2**20)


def main() -> None:
    t_start = time.perf_counter()
    peak, stop = [0.0], threading.Event()
    threading.Thread(target=watch_rss, args=(peak, stop), daemon=True).start()
    model_dir, ids_file, result_file = sys.argv[1:4]
    dtype = sys.argv[4] if len(sys.argv) > 4 else "float32"  # bench/embed.py's --dtype
    from vllm import LLM

    ids = json.loads(open(ids_file).read())
    llm = LLM(model=model_dir, runner="pooling", dtype=dtype, enforce_eager=True, enable_prefix_caching=False)
    t_ready = time.perf_counter()
    t0 = time.perf_counter()
    outs = llm.embed([{"prompt_token_ids": x} for x in ids], use_tqdm=False)
    embed_s = time.perf_counter() - t0
    stop.set()
    result = dict(
        embed_s=embed_s,
        startup_s=t_ready - t_start,
        tokens=sum(map(len, ids)),
        peak_rss_mib=peak[0],
        vectors=[list(o.outputs.embedding) for o in outs[:50]],
    )
    with open(result_file, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
