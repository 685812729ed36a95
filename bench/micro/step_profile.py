"""Where one prefill step of the reference workload W goes, in one thread's CPU time (issue 50).

W with prefix sharing off (bench/vs_vllm.py's prompts through the chat template, SmolLM2-135M) is queued on an
engine made by `LLM(...)`, and its first step, a chunk of `--max-num-batched-tokens` prompt tokens, is timed by
`time.thread_time` around each module's forward (forward hooks added after load: the engine's own rewrites are
already in place), around HF's `apply_rotary_pos_emb` and around the attention function transformers calls. Each
scope's self time (its time less the scopes inside it) is put in a group: the linear products, the LM head,
attention (batchrun's backend: K/V writes and the prompt attention), the RMSNorm chain, SiLU-and-mul (the
activation and the MLP's own multiply), rotary (cos/sin and its application), the residual adds (the decoder
layer's own time), the attention module's own reshapes, and the host (the step outside the forward: schedule,
prepare, sample). The step runs `--repeat` times (the queue dropped and W queued again between them; the first
step of each is what is timed): the table gives each group's best and median.

With `--compare`, the rewrites that have an undo (engine/model/prepare.py) are undone on a second engine and the two are
alternated: "as loaded" against HF's modules, on the same step, best/median of `--repeat` each.

Usage: OMP_NUM_THREADS=1 python -m bench.micro.step_profile --dtype bfloat16 [--compare] [--repeat 5]
On a machine shared with other jobs a thread's CPU time is the work it did, whoever else runs.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from ..common import chat_ids, reference_prompts

GROUPS = (
    "products",
    "LM head",
    "attention",
    "RMSNorm chain",
    "SiLU-and-mul",
    "rotary",
    "residual adds",
    "attention module's own",
    "embedding",
    "other in the forward",
    "host (outside the forward)",
)


def group_of(name: str, module: torch.nn.Module) -> str:
    """The group a module's self time goes to, by its place and class (HF's and batchrun's names)."""
    kind = type(module).__name__
    if name.endswith("lm_head"):
        return "LM head"
    if kind in ("PackedLinear", "FusedMember", "FusedProduct", "Linear"):
        return "products"
    if kind.endswith("RMSNorm") or kind == "FusedRMSNorm":
        return "RMSNorm chain"
    if kind.endswith("MLP") or "Activation" in kind or kind in ("SiLU", "GELU"):
        return "SiLU-and-mul"
    if kind.endswith("RotaryEmbedding"):
        return "rotary"
    if kind.endswith("DecoderLayer"):
        return "residual adds"
    if kind.endswith("Attention"):
        return "attention module's own"
    if kind == "Embedding":
        return "embedding"
    return "other in the forward"


class Scopes:
    """Self CPU time of nested scopes, by group: a stack of (group, start, time of the scopes inside)."""

    def __init__(self):
        self.times: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []

    def enter(self, group: str) -> None:
        self.stack.append([group, time.thread_time(), 0.0])

    def leave(self) -> None:
        group, start, inner = self.stack.pop()
        spent = time.thread_time() - start
        self.times[group] += spent - inner
        if self.stack:
            self.stack[-1][2] += spent

    @contextmanager
    def scope(self, group: str):
        self.enter(group)
        try:
            yield
        finally:
            self.leave()

    def timed(self, group: str, fn):
        def wrapper(*args, **kwargs):
            with self.scope(group):
                return fn(*args, **kwargs)

        return wrapper


def hook_model(model: torch.nn.Module, scopes: Scopes) -> None:
    """Time every module's forward into `scopes`, by the module's group."""
    for name, module in model.named_modules():
        group = group_of(name, module)
        module.register_forward_pre_hook(lambda m, args, g=group: scopes.enter(g))
        module.register_forward_hook(lambda m, args, out: scopes.leave())


def make_llm(dtype: str, max_tokens: int):
    from batchrun import LLM

    return LLM(dtype=dtype, device="cpu", prefix_sharing=False, max_num_batched_tokens=max_tokens)


def one_step(llm, prompts: list[list[int]], scopes: Scopes, decode: bool = False) -> tuple[float, int]:
    """W queued, its first step (or with `decode`, its first step where every sequence decodes) run and timed,
    the queue dropped: (thread CPU seconds, tokens computed)."""
    from batchrun import SamplingParams

    engine = llm.engine
    for ids in prompts:
        engine.add(ids, SamplingParams(max_new_tokens=64, ignore_eos=True))
    if decode:  # the steps that prefill, untimed (their hooks still count: cleared below)
        while engine.step().plan.num_generating < len(prompts):
            pass
        scopes.times.clear()
    t0 = time.thread_time()
    result = engine.step()
    spent = time.thread_time() - t0
    engine.abort_all()
    return spent, result.plan.num_batched_tokens


def profile(
    llms: dict[str, object], prompts, repeat: int, decode: bool = False
) -> dict[str, list[dict[str, float]]]:
    """Each engine's step `repeat` times, alternated: per engine, one {group: seconds} per run."""
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in llms}
    scopes = {label: Scopes() for label in llms}
    for label, llm in llms.items():
        hook_model(llm.engine.runner.model, scopes[label])
        one_step(llm, prompts[:2], Scopes())  # warm-up: oneDNN primitives, the allocator's blocks
    order = list(llms)
    for i in range(repeat):
        for label in order if i % 2 == 0 else order[::-1]:
            s = scopes[label]
            s.times.clear()
            # the rotary and attention wrappers are per process: point them at this engine's scopes
            hook_functions(llms[label].engine.runner.model, s)
            spent, tokens = one_step(llms[label], prompts, s, decode)
            times = dict(s.times)
            times["host (outside the forward)"] = spent - sum(times.values())
            times["step"], times["tokens"] = spent, tokens
            runs[label].append(times)
    return runs


def hook_functions(model, scopes: Scopes) -> None:
    """Point the attention function and HF's rotary application at `scopes` (they are looked up by name)."""
    import sys

    from batchrun.engine.attention import interface

    interface.register(scopes.timed("attention", interface.attention_forward))
    code = sys.modules[type(model).__module__]
    original = getattr(code, "_untimed_apply_rotary_pos_emb", None) or getattr(
        code, "apply_rotary_pos_emb", None
    )
    if original is not None:
        code._untimed_apply_rotary_pos_emb = original
        code.apply_rotary_pos_emb = scopes.timed("rotary", original)


def table(runs: dict[str, list[dict[str, float]]]) -> None:
    labels = list(runs)
    best = {label: min(runs[label], key=lambda r: r["step"]) for label in labels}
    med = {label: sorted(runs[label], key=lambda r: r["step"])[len(runs[label]) // 2] for label in labels}
    head = " | ".join(f"{label} ms best / median / share" for label in labels)
    print(f"| group | {head} |")
    print("|---|" + "---|" * len(labels))
    for group in (*GROUPS, "step"):
        cells = []
        for label in labels:
            b, m = best[label].get(group, 0.0), med[label].get(group, 0.0)
            cells.append(f"{b * 1e3:.1f} / {m * 1e3:.1f} / {100 * b / best[label]['step']:.1f}%")
        print(f"| {group} | " + " | ".join(cells) + " |")
    print(f"tokens in the step: {best[labels[0]]['tokens']:.0f}; runs: {len(runs[labels[0]])} each")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--compare", action="store_true", help="as loaded against HF's elementwise modules")
    ap.add_argument("--decode", action="store_true", help="time W's first step where every sequence decodes")
    a = ap.parse_args()
    print(f"threads: {torch.get_num_threads()} (set OMP_NUM_THREADS=1 for CPU time to be the work)")
    llms = {"as loaded": make_llm(a.dtype, a.max_num_batched_tokens)}
    if a.compare:
        from batchrun.engine.model import prepare

        llms["HF's modules"] = make_llm(a.dtype, a.max_num_batched_tokens)
        model = llms["HF's modules"].engine.runner.model  # its layers' own forwards too (the in-place adds)
        undone = prepare.undo(model)
        print(f"undone on the second engine: {undone} modules")
    prompts = chat_ids(llms["as loaded"].tokenizer, reference_prompts())
    load0 = os.getloadavg()[0]
    runs = profile(llms, prompts, a.repeat, a.decode)
    print(
        f"{a.dtype}, sharing off, W ({sum(map(len, prompts))} prompt tokens), {'a decode' if a.decode else 'the first'} step, load {load0:.2f} -> "
        f"{os.getloadavg()[0]:.2f}"
    )
    table(runs)


if __name__ == "__main__":
    main()
