"""The peer's side of `bench/vs_vllm.py`: vLLM's CPU build on the same prompt token ids, timed on `generate`
alone. Runs in vLLM's own virtual environment (bench/vs_vllm.py says how to make it), never in batchrun's.

Usage: VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 /tmp/vllm-venv/bin/python bench/vllm_peer.py \
           MODEL_DIR PROMPTS.json DTYPE on|off MAX_NEW_TOKENS RESULT.json [ignore_eos] [compiled]
`compiled`: vLLM's default mode (torch.compile with inductor, the compile done before `generate`'s clock starts);
without it, eager mode (`enforce_eager=True`). Writes RESULT.json (vLLM prints its own lines): generated tokens, generate seconds, start-up seconds (imports and load), each
row's completion token ids.
"""

import json
import sys
import time


def main() -> None:
    t_start = time.perf_counter()
    model_dir, prompts_file, dtype, sharing, max_new, result_file = sys.argv[1:7]
    from vllm import LLM, SamplingParams

    prompts = json.loads(open(prompts_file).read())
    flags = set(sys.argv[7:])
    unknown = flags - {"ignore_eos", "compiled"}
    if unknown:
        raise SystemExit(f"vllm_peer.py: unknown flags {sorted(unknown)}")
    llm = LLM(
        model_dir,
        dtype=dtype,
        enforce_eager="compiled" not in flags,
        enable_prefix_caching=sharing == "on",
        max_model_len=2048,
    )
    t_ready = time.perf_counter()
    ignore_eos = "ignore_eos" in flags  # every row generates MAX_NEW_TOKENS (bench/host.py)
    params = SamplingParams(temperature=0.0, max_tokens=int(max_new), ignore_eos=ignore_eos)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    completions = [list(o.outputs[0].token_ids) for o in outs]
    result = dict(generated_tokens=sum(map(len, completions)), gen_wall_s=gen_s, completions=completions)
    with open(result_file, "w") as f:
        json.dump(dict(result, startup_s=t_ready - t_start), f)


if __name__ == "__main__":
    main()
