"""The peer's side of `bench/lora.py`: vLLM's CPU build with `enable_lora` on the same prompt token ids, each
prompt with its adapter's `LoRARequest` (none: the base model), timed on `generate` alone. Runs in vLLM's own
virtual environment (bench/vs_vllm.py says how to make it), never in batchrun's.

Usage: VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 /tmp/vllm-venv/bin/python bench/vllm_lora_peer.py \
           MODEL_DIR PROMPTS.json ADAPTERS.json CELLS.json MAX_NEW_TOKENS MAX_RANK RESULT.json
ADAPTERS.json: [folder, ...]; CELLS.json: each prompt's adapter index or null. Writes RESULT.json: generated
tokens, generate seconds, each row's completion token ids.
"""

import json
import sys
import time


def main() -> None:
    model_dir, prompts_file, adapters_file, cells_file, max_new, max_rank, result_file = sys.argv[1:8]
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    prompts = json.loads(open(prompts_file).read())
    adapters = json.loads(open(adapters_file).read())
    cells = json.loads(open(cells_file).read())
    enable = any(c is not None for c in cells)
    llm = LLM(
        model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        enable_lora=enable,
        **(dict(max_loras=len(adapters), max_lora_rank=int(max_rank)) if enable else {}),
    )
    requests = [LoRARequest(f"a{i}", i + 1, folder) for i, folder in enumerate(adapters)]
    params = SamplingParams(temperature=0.0, max_tokens=int(max_new))
    t0 = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts],
        params,
        use_tqdm=False,
        lora_request=[None if c is None else requests[c] for c in cells] if enable else None,
    )
    gen_s = time.perf_counter() - t0
    completions = [list(o.outputs[0].token_ids) for o in outs]
    with open(result_file, "w") as f:
        json.dump(
            dict(generated_tokens=sum(map(len, completions)), gen_wall_s=gen_s, completions=completions), f
        )


if __name__ == "__main__":
    main()
