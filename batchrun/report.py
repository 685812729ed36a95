"""`batchrun stats`: the summary in words, shards combined, and the memory-over-time plot."""

from __future__ import annotations

from pathlib import Path

from . import storage
from .config import STATE_DIR
from .errors import BadInput
from .stats import KIND_USAGE, combine, read_summary


def stats_files(path: Path) -> list[Path]:
    """A stats file (or, where it does not exist, the shards' `NAME-IofN` files beside it); or every shard's
    stats file in a directory, or in the state folder of an output directory (`<output>/.batchrun/`)."""
    if storage.fresh(path).is_dir():
        files = sorted(path.glob("stats*.parquet")) or sorted((path / STATE_DIR).glob("stats*.parquet"))
        if not files:
            raise BadInput(f"{path}: no stats*.parquet files in this directory or its {STATE_DIR}/ folder.")
        return files
    if not path.is_file():
        # an explicit output.stats of a sharded job: its shards' NAME-IofN files beside it
        shards = sorted(path.parent.glob(f"{path.stem}-*of*{path.suffix}")) if path.suffix else []
        if shards:
            return shards
        raise BadInput(f"{path}: no such stats file or directory.")
    return [path]


def load_summary(path: Path) -> dict:
    """The summary of one stats file, or of every shard's stats file in a directory, combined."""
    summaries = []
    files = stats_files(path)
    for f in files:
        try:
            summaries.append(read_summary(f))
        except Exception as e:
            raise BadInput(f"{f}: not a batchrun stats file ({e}).") from None
    if len(summaries) == 1:
        return summaries[0]
    # each file's shard ("I/N"; a file written before shards were named: its name)
    labels = [s.get("shard", f.stem) for f, s in zip(files, summaries)]
    out = combine(summaries)
    out["shard"] = labels  # the shards combined, not the first one's label
    out["shards"] = len(summaries)
    out["error_rows_by_shard"] = {label: s.get("error_rows", 0) for label, s in zip(labels, summaries)}
    return out


def counted(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless one: "1 LoRA adapter", "2 rows"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _fp32_sample(sample: dict) -> str:
    """A bf16/fp16 pooling job's `fp32_sample` in words (fp32_sample.py)."""
    if sample.get("error"):
        return f"no sample: {sample['error']}"
    rows = sample["rows"]
    named = ", ".join(map(str, rows[:4])) + (", ..." if len(rows) > 4 else "")
    out = f"{len(rows)} texts pooled again in fp32 ({named}; {sample['seconds']:.1f} s)"
    if sample.get("cosine_min") is not None:
        out += f": cosine min {sample['cosine_min']:.6f}, mean {sample['cosine_mean']:.6f}"
    if sample.get("score_max_abs_diff") is not None:
        out += f"; scores within {sample['score_max_abs_diff']:.2e}"
    return out


def format_summary(s: dict) -> str:
    lines = [
        (
            "wall time",
            f"{s['wall_s'] + s.get('load_s', 0):.1f} s: loading the model {s.get('load_s', 0):.1f} s, "
            f"running {s['wall_s']:.1f} s"
            + (f" over {s['runs']} runs" if s.get("runs", 1) > 1 else "")
            + (f" ({s['shards']} shards)" if s.get("shards") else ""),
        ),
        (
            "rows",
            f"{s['rows']}"
            + (f" ({s['rows_changed']} recomputed: their input changed)" if s.get("rows_changed") else "")
            + (
                f", {s['error_rows']} failed (error rows: their `error` says why)"
                if s.get("error_rows")
                else ""
            ),
        ),
        (
            "prompt tokens",
            f"{s['prompt_tokens']} ({s.get('prompt_tokens_per_s', 0):.1f}/s), "
            f"{s.get('prompt_tokens_computed', 0)} computed",
        ),
    ]
    if s.get("slow_dtype"):
        lines.append(("dtype", f"{s['dtype']}: {s['slow_dtype']}"))
    if s.get("task", "generate") != "generate":  # a pooling job: no generation, no pages
        rate = s["rows"] / s["wall_s"] if s["wall_s"] else 0.0
        computed = s.get("prompt_tokens_computed", 0)
        lines += [
            (
                "texts",
                f"{rate:.1f}/s over {s['steps']} packed steps; {s['truncated_rows']} cut at the longest text",
            ),
            (
                "padding avoided",
                f"{s['padding_tokens_avoided']} tokens: a batch padded to its longest text per step would have "
                f"computed {computed + s['padding_tokens_avoided']}; sorted by length in batches of 32 "
                f"(as sentence-transformers batches), {computed + s.get('padding_tokens_sorted', 0)}",
            ),
        ]
        if s.get("fp32_sample"):
            lines.append(("against fp32", _fp32_sample(s["fp32_sample"])))
        return _table(lines)
    lines += [
        ("generated tokens", f"{s['generated_tokens']} ({s['generated_tokens_per_s']:.1f}/s)"),
        ("running sequences", f"peak {s['peak_running']}, mean {s['mean_running']:.1f}"),
        *(
            [
                (
                    "weights",
                    f"{s['weights_format']}, {_bytes(s['weights_bytes'])} in memory (beside a KV cache of "
                    f"{_bytes(s['pages_total'] * s.get('bytes_per_page', 0))})",
                )
            ]
            if "weights_format" in s  # absent in statistics written before it was recorded
            else []
        ),
        (
            "KV pages",
            f"{s['pages_total']} of {s['page_size']} tokens, peak in use {s.get('peak_pages_used', 0)}",
        ),
        *(
            [
                (
                    "swap space",
                    f"{_bytes(s['swap_space_bytes'])}"
                    + (f" (engine.swap_space unset: {s['swap_space_auto']})" if s["swap_space_auto"] else ""),
                )
            ]
            if "swap_space_bytes" in s  # absent in statistics written before it was recorded
            else []
        ),
        (
            "KV utilization (paged)",
            f"mean {s['kv_utilization_mean']:.1%}, peak {s['kv_utilization_peak']:.1%}",
        ),
        ("internal fragmentation", f"mean {s['internal_fragmentation_mean']:.1%} of allocated slots"),
        ("external fragmentation", f"max {s['external_fragmentation_max']:.1%} of free pages"),
        (
            "duplication saved",
            f"peak {s['duplication_saved_peak']:.1%} of logical pages "
            f"({s['prefix_hit_tokens']} prompt tokens from the prefix cache)",
        ),
        ("preemptions", f"{s['preemptions']} ({s['recomputations']} by recompute)"),
        ("swapped out", f"{s['swap_out_pages']} pages, {_bytes(s['swap_out_bytes'])}"),
        ("swapped in", f"{s['swap_in_pages']} pages, {_bytes(s['swap_in_bytes'])}"),
        (
            "contiguous counterfactual",
            f"utilization mean {s['contiguous_utilization_mean']:.1%}; "
            f"would fit {s['contiguous_max_concurrency']} sequences at once "
            f"(paging ran up to {s['peak_running']})",
        ),
    ]
    for c in KIND_USAGE:  # each kind a sequence keeps beside its pages (a hybrid's state slots)
        if s.get(c.total):
            lines.append(
                (
                    f"{c.label} ({c.holder})",
                    f"{s[c.total]} of {_bytes(s.get(c.bytes_per_unit, 0))}, peak in use {s.get(c.peak, 0)}",
                )
            )
    if s.get("rows_with_images"):
        lines.append(
            (
                "images",
                f"{s['rows_with_images']} rows with images; {s.get('images_encoded', 0)} encoded "
                f"({s.get('image_tokens', 0)} image tokens) in {s.get('time_encode_s', 0):.2f} s; features "
                f"waiting {_bytes(s.get('encoder_peak_bytes', 0))} at most of "
                f"{_bytes(s.get('encoder_budget_bytes', 0))}",
            )
        )
    if s.get("window_freed_peak"):
        lines.append(
            (
                "pages behind a window",
                f"given back: peak {s['window_freed_peak']}, mean {s.get('window_freed_mean', 0):.1f}",
            )
        )
    if s.get("adapter_bytes"):
        rows, prompt, generated = (
            s.get(k) or {} for k in ("adapter_rows", "adapter_prompt_tokens", "adapter_generated_tokens")
        )
        per = "; ".join(
            f"{name} {counted(rows[name], 'row')}, {prompt.get(name, 0)} + {generated.get(name, 0)} tokens"
            for name in sorted(rows)
        )
        lines.append(
            (
                "LoRA adapters",
                f"{per or 'no rows'}; {counted(s.get('adapter_loads', 0), 'load')}, "
                f"{counted(s.get('adapter_evictions', 0), 'eviction')}; weights {_bytes(s['adapter_bytes'])}",
            )
        )
    if s.get("structured_rows"):
        lines.append(
            (
                "structured outputs",
                f"{s['structured_complete']} of {s['structured_rows']} rows completed their grammar; compiling "
                f"{s.get('grammar_compile_s', 0):.2f} s, masking {s.get('grammar_mask_s', 0):.2f} s",
            )
        )
    return _table(lines)


def _table(lines: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in lines)


def plot(path: Path, out_png: Path) -> None:
    """Memory over time: KV slots holding tokens vs allocated by paging (and what paging would hold without
    giving back the pages behind a sliding window) vs a contiguous reservation; running, waiting and swapped
    sequences below; preemptions marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = stats_files(path)
    fig, (ax_mem, ax_seq) = plt.subplots(
        2, 1, figsize=(11, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    for f in files:
        t = storage.parquet_file(f).read().to_pydict()
        tag = f" ({f.stem})" if len(files) > 1 else ""
        time_s = t["time_s"]
        ax_mem.fill_between(time_s, t["tokens_stored"], step="post", alpha=0.35, color="tab:green")
        ax_mem.step(
            time_s, t["tokens_stored"], where="post", color="tab:green", label=f"slots holding tokens{tag}"
        )
        ax_mem.step(
            time_s,
            t["slots_allocated"],
            where="post",
            color="tab:blue",
            label=f"slots allocated by paging{tag}",
        )
        ax_mem.step(
            time_s,
            t["reserved_slots_contiguous"],
            where="post",
            color="tab:red",
            linestyle="--",
            label=f"slots a contiguous reservation would hold{tag}",
        )
        freed = t.get("window_freed")  # absent in statistics written before KV cache groups
        if freed and any(freed):  # what a full-attention cache would hold on top of the pages allocated
            page_slots = [a // u if u else 0 for a, u in zip(t["slots_allocated"], t["pages_used"])]
            ax_mem.step(
                time_s,
                [a + f * ps for a, f, ps in zip(t["slots_allocated"], freed, page_slots)],
                where="post",
                color="tab:purple",
                linestyle="-.",
                label=f"slots allocated without giving back pages behind the window{tag}",
            )
        capacity = [
            p * (t["slots_allocated"][i] // t["pages_used"][i] if t["pages_used"][i] else 0)
            for i, p in enumerate(t["pages_total"])
        ]
        if any(capacity):
            ax_mem.axhline(max(capacity), color="gray", linestyle=":", label="KV cache capacity")
        ax_seq.step(time_s, t["num_running"], where="post", label=f"running{tag}")
        ax_seq.step(time_s, t["num_waiting"], where="post", label=f"waiting{tag}")
        ax_seq.step(time_s, t["num_swapped"], where="post", label=f"swapped{tag}")
        for c in KIND_USAGE:  # each kind's units (a hybrid's state slots; absent in older statistics)
            used = t.get(c.used)
            if used and any(t.get(c.total) or []):
                ax_seq.step(time_s, used, where="post", linestyle="--", label=f"{c.label} in use{tag}")
                ax_seq.axhline(max(t[c.total]), color="gray", linestyle=":", label=c.label)
        pre = [time_s[i] for i, n in enumerate(t["preemptions"]) if n]
        if pre:
            ax_seq.plot(pre, [0] * len(pre), "v", color="black", markersize=7, label="preemption")
            for x in pre:
                ax_mem.axvline(x, color="black", alpha=0.15, linewidth=0.8)
    summary = load_summary(path)
    fig.suptitle(
        f"batchrun KV memory — paged utilization {summary['kv_utilization_mean']:.0%} vs contiguous "
        f"{summary['contiguous_utilization_mean']:.0%}, page size {summary['page_size']}"
    )
    ax_mem.set_ylabel("KV cache slots (tokens)")
    ax_mem.legend(loc="upper left", fontsize=8)
    ax_mem.grid(alpha=0.3)
    ax_seq.set_ylabel("sequences")
    ax_seq.set_xlabel("time since the job started (s)")
    ax_seq.legend(loc="upper right", fontsize=8)
    ax_seq.grid(alpha=0.3)
    fig.tight_layout()
    storage.write_whole(out_png, lambda f: fig.savefig(f, dpi=110, format="png"))
    plt.close(fig)
