"""torch.compile around attention, measured before building it in: the decoder layers' norms (and MLPs) compiled
by inductor for the CPU, dynamic token counts, on the reference workload (fp32, sharing off) through the API.

    python bench/compile_cpu.py off         # eager, linear weights packed (the engine's default)
    python bench/compile_cpu.py norms       # both RMSNorms of every layer compiled, weights packed
    python bench/compile_cpu.py mlp-norms   # MLPs too: inductor refuses packed weights that are parameters
                                            # (mkldnn_lowerings asserts they are graph constants), so unpacked,
                                            # with inductor's freezing (which packs them itself)

Prints warm-up seconds (compiling happens there), tokens/s, and writes the completions' token ids to
out/bench/compile-<mode>.json to compare modes. Needs out/bench/speed/prompt_ids.json (python bench/speed.py
--only none writes it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "off"
    assert mode in ("off", "norms", "mlp-norms"), mode
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    from batchrun import LLM, SamplingParams

    dynamo_config.cache_size_limit = 256  # one compiled frame per layer's module: 30 layers, 2 shapes
    dynamo_config.accumulated_cache_size_limit = 4096
    inductor_config.freezing = mode == "mlp-norms"
    ids = json.loads((ROOT / "out" / "bench" / "speed" / "prompt_ids.json").read_text())
    llm = LLM(device="cpu", dtype="float32", prefix_sharing=False, pack_weights=mode != "mlp-norms")
    for layer in llm.engine.runner.model.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm", "mlp")[: 3 if mode == "mlp-norms" else 2]:
            if mode != "off":
                module = getattr(layer, name)
                module.forward = torch.compile(module.forward, dynamic=True)
    t0 = time.perf_counter()
    llm.generate(ids[:4], SamplingParams(max_new_tokens=4), use_tqdm=False)  # compiles prefill and decode
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(ids, SamplingParams(max_new_tokens=64), use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(map(len, tokens))
    print(
        f"{mode}: warm-up {warm:.1f} s, {n} tokens in {seconds:.1f} s = {n / seconds:.1f} tok/s", flush=True
    )
    out = ROOT / "out" / "bench" / f"compile-{mode}.json"
    out.write_text(json.dumps(tokens))


if __name__ == "__main__":
    main()
