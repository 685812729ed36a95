"""Memory statistics: one snapshot per engine step, the job summary, and `stats.parquet`.

Definitions are docs/statistics.md's. A snapshot is taken after the step's forward pass from
the engine's `memory_snapshot()`; P is the page size; sums run over the sequences holding accelerator pages
(`num_running`). `COLUMNS` and `SUMMARY_KEYS` are the one list of each: the writer, `batchrun stats` and the
lists of docs/statistics.md (checked by a test) follow them. What they hold of the units a sequence keeps beside its pages
(a hybrid's state slots) is derived from the cache managers' `usage_columns` (engine/core/state_slots.py, read
without torch): a new manager's columns and summary keys are one entry of `KIND_USAGE`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.engine.core.state_slots import StateSlots
from batchrun.engine.timing import PHASES, summary_key

from . import storage
from .rows import FINGERPRINT_KEY

if TYPE_CHECKING:  # `batchrun stats` reads files: it needs neither torch nor the engine
    from batchrun.engine import Engine, StepResult

SUMMARY_KEY = b"batchrun.summary"

# each cache manager's usage columns (engine/cache_spec.UsageColumns), in the engine's order of managers
KIND_USAGE = (StateSlots.usage_columns,)


def kind_columns(usage) -> list[str]:
    """The kinds' columns of every step's row: each kind's units there are and units in use (0 for a model
    without the kind)."""
    return [name for c in usage for name in (c.total, c.used)]


def kind_summary_rules(usage) -> dict[str, tuple[str, str]]:
    """The kinds' summary keys and how summaries combine them, by role: the units there are at the run's end
    and the most in use (summed over shards and replicas, the largest over runs), the bytes per unit (one
    model: the same everywhere)."""
    rules = {}
    for c in usage:
        rules |= {c.total: ("sum", "max"), c.peak: ("sum", "max"), c.bytes_per_unit: ("first", "first")}
    return rules


def step_columns(usage) -> list[str]:
    """Every step's row's columns, in order, with the kinds' `usage` (`KIND_USAGE`: the registered kinds')."""
    return [
        "run",  # 1 for the first run of the job, 2 for its first resume, ...
        "replica",  # the engine process that took the step (0 without replicas)
        "step",
        "time_s",
        "num_running",
        "num_waiting",
        "num_swapped",
        "batch_tokens",
        "pages_total",
        "pages_used",
        "pages_free",
        "tokens_stored",
        "slots_allocated",
        "internal_waste_slots",
        "logical_pages",
        "shared_pages_saved",
        "swap_out_pages",
        "swap_in_pages",
        "preemptions",
        "recomputations",
        "reserved_slots_contiguous",
        "tokens_cached_per_sequence",
        "external_fragmentation",
        "prefix_hit_tokens",
        "cow_copies",
        "window_freed",
        *kind_columns(usage),  # a hybrid model's per-sequence state slots (0 for other models)
        "generated_tokens",
    ]


COLUMNS = step_columns(KIND_USAGE)
FLOAT_COLUMNS = {"time_s", "external_fragmentation"}


def merge_fp32_samples(samples: list) -> dict | None:
    """Summaries' `fp32_sample`s (fp32_sample.Fp32Sample.summary; None or 0 where a run sampled nothing) as one:
    their rows one after another, the min of their mins, their means weighted by their rows compared, the largest
    score difference, their seconds added, and the first error."""
    present = [s for s in samples if s]
    if not present:
        return None
    compared = [(len(s["rows"]), s) for s in present if s.get("cosine_mean") is not None]
    counted = sum(n for n, _ in compared)
    diffs = [s["score_max_abs_diff"] for s in present if s.get("score_max_abs_diff") is not None]
    return {
        "rows": [row for s in present for row in s["rows"]],
        "cosine_min": min((s["cosine_min"] for _, s in compared), default=None),
        "cosine_mean": sum(n * s["cosine_mean"] for n, s in compared) / counted if counted else None,
        "score_max_abs_diff": max(diffs, default=None),
        "seconds": sum(s.get("seconds", 0.0) for s in present),
        "error": next((s["error"] for s in present if s.get("error")), None),
    }


# Every key of the summary, and how summaries combine: (side by side -- shards, replicas; one after another --
# resumed runs). "sum"; "max"; "mean" (weighted by steps); "rate" (summed tokens over the combined wall time);
# "first" (the same for all); a function: of the values, the combined one.
SUMMARY_KEYS = {
    "wall_s": ("max", "sum"),  # the run after the model loaded
    "load_s": ("max", "sum"),  # loading the model (replicas load side by side)
    "runs": ("max", "sum"),
    "rows": ("sum", "sum"),
    # rows whose output is an error row (the job counts them as it writes them; a resume: the whole job's)
    "error_rows": ("sum", "sum"),
    # rows recomputed because their input changed since their output was written
    "rows_changed": ("sum", "sum"),
    "steps": ("sum", "sum"),
    "prompt_tokens": ("sum", "sum"),
    "prompt_tokens_computed": ("sum", "sum"),
    "generated_tokens": ("sum", "sum"),
    "prompt_tokens_per_s": ("rate", "rate"),
    "generated_tokens_per_s": ("rate", "rate"),
    "peak_running": ("sum", "max"),
    "mean_running": ("mean", "mean"),
    "kv_utilization_mean": ("mean", "mean"),
    "kv_utilization_peak": ("max", "max"),
    "internal_fragmentation_mean": ("mean", "mean"),
    "external_fragmentation_max": ("max", "max"),
    "duplication_saved_peak": ("max", "max"),
    "window_freed_peak": ("sum", "max"),
    "window_freed_mean": ("mean", "mean"),
    "prefix_query_tokens": ("sum", "sum"),
    "prefix_hit_tokens": ("sum", "sum"),
    "cow_copies": ("sum", "sum"),
    "preemptions": ("sum", "sum"),
    "recomputations": ("sum", "sum"),
    "swap_out_pages": ("sum", "sum"),
    "swap_in_pages": ("sum", "sum"),
    "swap_out_bytes": ("sum", "sum"),
    "swap_in_bytes": ("sum", "sum"),
    "contiguous_utilization_mean": ("mean", "mean"),
    "contiguous_max_concurrency": ("sum", "max"),
    "page_size": ("first", "first"),
    "pages_total": ("sum", "max"),
    "peak_pages_used": ("sum", "max"),
    "bytes_per_page": ("first", "first"),
    # each kind's (a hybrid's state_slots_total, peak_state_slots_used, bytes_per_state_slot)
    **kind_summary_rules(KIND_USAGE),
    "rows_with_images": ("sum", "sum"),
    "images_encoded": ("sum", "sum"),
    "image_tokens": ("sum", "sum"),
    "encoder_peak_bytes": ("sum", "max"),  # image features waiting for prefill, the most at once
    "encoder_budget_bytes": ("sum", "max"),
    "structured_rows": ("sum", "sum"),
    "structured_complete": ("sum", "sum"),
    "grammar_compile_s": ("sum", "sum"),
    "grammar_mask_s": ("sum", "sum"),
    # a pooling job: the tokens a run padding each step's texts to its longest would have computed on top
    "padding_tokens_avoided": ("sum", "sum"),
    # and a run sorting the texts by length first, in batches of 32, as sentence-transformers' encode batches
    "padding_tokens_sorted": ("sum", "sum"),
    "truncated_rows": ("sum", "sum"),  # a pooling job's texts cut at the longest the model takes
    # a bf16/fp16 pooling job's first texts pooled again in fp32 (fp32_sample.py), merged row for row
    "fp32_sample": (merge_fp32_samples, merge_fp32_samples),
    # LoRA adapters (engine/model/lora/layers.py): per adapter name, the rows finished, their prompt and generated tokens
    "adapter_rows": ("counts", "counts"),
    "adapter_prompt_tokens": ("counts", "counts"),
    "adapter_generated_tokens": ("counts", "counts"),
    "adapter_loads": ("sum", "sum"),  # adapters loaded into a slot beside the model, and evicted from one
    "adapter_evictions": ("sum", "sum"),
    "adapter_bytes": (
        "sum",
        "max",
    ),  # the adapters' weights in memory (CPU copies, and slots on an accelerator)
    # where the steps' time went (engine/timing.py), seconds summed over processes and runs
    **{summary_key(phase): ("sum", "sum") for phase in PHASES},
}


def combine(summaries: list[dict], sequential: bool = False) -> dict:
    """One summary from several: side by side (shards, replicas of one run) or one after another (runs)."""
    out = dict(summaries[0])
    steps = sum(s.get("steps", 0) for s in summaries) or 1
    for key, rules in SUMMARY_KEYS.items():
        how = rules[sequential]
        values = [s.get(key, 0) for s in summaries]
        if how == "sum":
            out[key] = sum(values)
        elif how == "max":
            out[key] = max(values)
        elif how == "mean":
            out[key] = sum(v * s.get("steps", 0) for v, s in zip(values, summaries)) / steps
        elif how == "counts":  # {name: count}, added name by name
            out[key] = dict(sum((Counter(v or {}) for v in values), Counter()))
        elif callable(how):
            out[key] = how(values)
    wall = out["wall_s"]
    out["prompt_tokens_per_s"] = out["prompt_tokens"] / wall if wall else 0.0
    out["generated_tokens_per_s"] = out["generated_tokens"] / wall if wall else 0.0
    return out


def snapshot(engine: Engine, step: StepResult, step_index: int, time_s: float, recount: bool = False) -> dict:
    """The statistics row for the state right after a step (docs/statistics.md's definitions). `recount`: also recount
    every statistic slot by slot and fail on a mismatch (BATCHRUN_DEBUG_STATS=1)."""
    m = engine.memory_snapshot()
    if recount:
        check_snapshot(engine, m)
    return {
        "step": step_index,
        "time_s": time_s,
        "num_running": m.num_running,
        "num_waiting": m.num_waiting,
        "num_swapped": m.num_swapped,
        "batch_tokens": step.num_batched_tokens,
        "pages_total": m.pages_total,
        "pages_used": m.pages_used,
        "pages_free": m.pages_free,
        "tokens_stored": m.tokens_stored,
        "slots_allocated": m.slots_allocated,
        "internal_waste_slots": m.internal_waste_slots,
        "logical_pages": m.logical_pages,
        "shared_pages_saved": m.shared_pages_saved,
        "swap_out_pages": step.num_swapped_out_pages,
        "swap_in_pages": step.num_swapped_in_pages,
        "preemptions": step.num_preempted,
        "recomputations": step.num_recomputed,
        "reserved_slots_contiguous": m.reserved_slots_contiguous,
        "tokens_cached_per_sequence": m.tokens_cached_per_sequence,
        "external_fragmentation": m.external_fragmentation,
        "prefix_hit_tokens": m.prefix_hit_tokens,
        "cow_copies": m.cow_copies,
        "window_freed": m.window_freed_pages,
        **{name: m.usage.get(name, 0) for name in kind_columns(KIND_USAGE)},  # COLUMNS' kind columns
        "generated_tokens": step.num_generated,
    }


def check_snapshot(engine: Engine, counted) -> None:
    """Debug mode: the brute-force recount must equal the count from the block tables, field for field."""
    recounted = engine.memory_snapshot(recount=True)
    for key, value in asdict(recounted).items():
        assert getattr(counted, key) == value, (
            f"stat {key}: snapshot {getattr(counted, key)} != recount {value}"
        )
    assert 0 <= counted.internal_waste_slots <= counted.slots_allocated
    engine.check_integrity()


@dataclass
class _Running:
    """Aggregates over every step (not only the sampled rows)."""

    steps: int = 0
    running_sum: float = 0.0
    peak_running: int = 0
    util_sum: float = 0.0
    util_n: int = 0
    util_peak: float = 0.0
    frag_sum: float = 0.0
    ext_frag_max: float = 0.0
    dup_peak: float = 0.0
    window_freed_peak: int = 0
    window_freed_sum: int = 0
    contig_util_sum: float = 0.0
    contig_util_n: int = 0
    peak_pages_used: int = 0
    kind_peaks: dict = field(default_factory=dict)  # each kind's `used` column -> its most over the steps
    swap_out_pages: int = 0
    swap_in_pages: int = 0
    preemptions: int = 0
    recomputations: int = 0
    reservation_sum: int = 0
    reservation_n: int = 0
    seen_reservations: set = field(default_factory=set)


class StatsCollector:
    """One engine's statistics: per-step rows (thinned to about 10 a second; first, last and preemption steps
    always kept) and running aggregates for its summary. `StatsFile` writes them."""

    def __init__(
        self,
        engine: Engine,
        extra: dict | None = None,
        replica: int = 0,
        min_interval_s: float = 0.1,
        debug_recount: bool = False,
        load_s: float = 0.0,
    ):
        self.engine = engine
        self.load_s = load_s  # seconds the model took to load, before this collector's start
        self.extra = dict(extra or {})  # facts about the run (job, device, dtype...) added to the summary
        self.replica = replica
        self.min_interval_s = min_interval_s
        self.debug_recount = debug_recount or os.environ.get("BATCHRUN_DEBUG_STATS") == "1"
        self.rows: list[dict] = []  # kept rows not yet taken
        self.agg = _Running()
        self.start = time.perf_counter()
        self._last_kept = -math.inf
        self._pending: dict | None = None  # the latest unkept row, so the last step is always written
        self.step_index = 0
        self.prompt_tokens = 0  # prompt tokens of the rows finished
        self.prompt_tokens_computed = 0  # prefix-cache hits excluded, recomputation included
        self.generated_tokens = 0
        self.rows_with_images = 0  # input rows whose prompt held images
        self.structured_rows = 0  # output rows with a response format, and those whose grammar completed
        self.structured_complete = 0
        # per LoRA adapter: rows finished, their prompt tokens, and the tokens generated
        self.adapter_rows: Counter[str] = Counter()
        self.adapter_prompt_tokens: Counter[str] = Counter()
        self.adapter_generated_tokens: Counter[str] = Counter()

    def record(self, step: StepResult) -> dict:
        now = time.perf_counter() - self.start
        row = snapshot(self.engine, step, self.step_index, now, recount=self.debug_recount)
        row["replica"] = self.replica
        self.step_index += 1
        self.generated_tokens += step.num_generated
        self.prompt_tokens_computed += step.num_prompt_tokens
        self.prompt_tokens += step.num_finished_prompt_tokens
        self.rows_with_images += step.num_finished_image_rows
        structured, complete = step.structured_finished
        self.structured_rows += structured
        self.structured_complete += complete
        if self.engine.lora is not None:
            self._count_adapters(step)
        self._aggregate(row)
        # a sequence first runs in a step that admits or forks (a swapped one ran before it was swapped out)
        if self.step_index == 1 or step.plan.new_requests or step.forks:
            self._count_reservations()
        if self.step_index == 1 or row["preemptions"] or now - self._last_kept >= self.min_interval_s:
            self.rows.append(row)
            self._last_kept = now
            self._pending = None
        else:
            self._pending = row
        return row

    def _count_reservations(self) -> None:
        """Each running sequence's contiguous reservation, once per sequence (the summary's mean)."""
        for seq in self.engine.running_sequences():
            if seq.seq_id not in self.agg.seen_reservations:
                self.agg.seen_reservations.add(seq.seq_id)
                self.agg.reservation_sum += self.engine.reservation(seq)
                self.agg.reservation_n += 1

    def _count_adapters(self, step: StepResult) -> None:
        names = self.engine.lora.names
        for seq in step.finished:
            if seq.adapter is None:
                continue
            name = names[seq.adapter]
            self.adapter_generated_tokens[name] += len(seq.output_token_ids)
            if seq.sample_index == 0:  # the row's first sample: forks share its prompt
                self.adapter_rows[name] += 1
                self.adapter_prompt_tokens[name] += seq.num_prompt_tokens

    def take_rows(self, final: bool = False) -> list[dict]:
        """The rows kept since the last call (the last step's too when `final`)."""
        rows, self.rows = self.rows, []
        if final and self._pending is not None:
            rows.append(self._pending)
            self._pending = None
        return rows

    def _aggregate(self, row: dict) -> None:
        a = self.agg
        a.steps += 1
        a.running_sum += row["num_running"]
        a.peak_running = max(a.peak_running, row["num_running"])
        a.peak_pages_used = max(a.peak_pages_used, row["pages_used"])
        for c in KIND_USAGE:
            a.kind_peaks[c.used] = max(a.kind_peaks.get(c.used, 0), row[c.used])
        if row["slots_allocated"]:
            util = row["tokens_stored"] / row["slots_allocated"]
            a.util_sum += util
            a.util_n += 1
            a.util_peak = max(a.util_peak, util)
            a.frag_sum += row["internal_waste_slots"] / row["slots_allocated"]
        if row["logical_pages"]:
            a.dup_peak = max(a.dup_peak, row["shared_pages_saved"] / row["logical_pages"])
        if row["reserved_slots_contiguous"]:
            a.contig_util_sum += row["tokens_cached_per_sequence"] / row["reserved_slots_contiguous"]
            a.contig_util_n += 1
        a.ext_frag_max = max(a.ext_frag_max, row["external_fragmentation"])
        a.window_freed_peak = max(a.window_freed_peak, row["window_freed"])
        a.window_freed_sum += row["window_freed"]
        a.swap_out_pages += row["swap_out_pages"]
        a.swap_in_pages += row["swap_in_pages"]
        a.preemptions += row["preemptions"]
        a.recomputations += row["recomputations"]

    def summary(self) -> dict:
        """This engine's summary; `rows` and `error_rows` 0: the job counts them (job.Job.run_counts), as it
        writes them."""
        a = self.agg
        wall = time.perf_counter() - self.start
        m = self.engine.memory_snapshot()
        compile_s, mask_s = self.engine.grammar_times()
        bytes_per_page = self.engine.plan.kv_spec.bytes_per_page
        total_slots = m.pages_total * m.page_size
        mean_reservation = a.reservation_sum / a.reservation_n if a.reservation_n else 0
        s = {
            "wall_s": wall,
            "load_s": self.load_s,
            "runs": 1,
            "rows": 0,
            "error_rows": 0,
            "rows_changed": 0,  # the job counts them: it compares the input with the output
            "steps": a.steps,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "generated_tokens": self.generated_tokens,
            "prompt_tokens_per_s": self.prompt_tokens / wall if wall else 0.0,
            "generated_tokens_per_s": self.generated_tokens / wall if wall else 0.0,
            "peak_running": a.peak_running,
            "mean_running": a.running_sum / a.steps if a.steps else 0.0,
            "kv_utilization_mean": a.util_sum / a.util_n if a.util_n else 0.0,
            "kv_utilization_peak": a.util_peak,
            "internal_fragmentation_mean": a.frag_sum / a.util_n if a.util_n else 0.0,
            "external_fragmentation_max": a.ext_frag_max,
            "duplication_saved_peak": a.dup_peak,
            "window_freed_peak": a.window_freed_peak,
            "window_freed_mean": a.window_freed_sum / a.steps if a.steps else 0.0,
            "prefix_query_tokens": m.prefix_query_tokens,
            "prefix_hit_tokens": m.prefix_hit_tokens,
            "cow_copies": m.cow_copies,
            "preemptions": a.preemptions,
            "recomputations": a.recomputations,
            "swap_out_pages": a.swap_out_pages,
            "swap_in_pages": a.swap_in_pages,
            "swap_out_bytes": a.swap_out_pages * bytes_per_page,
            "swap_in_bytes": a.swap_in_pages * bytes_per_page,
            "contiguous_utilization_mean": a.contig_util_sum / a.contig_util_n if a.contig_util_n else 0.0,
            "contiguous_max_concurrency": int(total_slots // mean_reservation) if mean_reservation else 0,
            "page_size": m.page_size,
            "pages_total": m.pages_total,
            "peak_pages_used": a.peak_pages_used,
            "bytes_per_page": bytes_per_page,
            **self._kind_summary(m),  # a hybrid's state slots
            "rows_with_images": self.rows_with_images,
            **self.engine.image_counts(),
            "structured_rows": self.structured_rows,
            "structured_complete": self.structured_complete,
            "grammar_compile_s": compile_s,
            "grammar_mask_s": mask_s,
            "padding_tokens_avoided": 0,
            "padding_tokens_sorted": 0,
            "truncated_rows": 0,
            "fp32_sample": None,
            **self._adapter_summary(),
            **self.engine.times.summary(),
        }
        assert s.keys() == SUMMARY_KEYS.keys(), "SUMMARY_KEYS is the one list of summary keys"
        s.update(self.extra)
        return s

    def _kind_summary(self, m) -> dict:
        """Each registered kind's summary keys (kind_summary_rules): 0 for a kind the model does not have."""
        bytes_per_unit = self.engine.unit_bytes()
        out = {}
        for c in KIND_USAGE:
            out[c.total] = m.usage.get(c.total, 0)
            out[c.peak] = self.agg.kind_peaks.get(c.used, 0)
            out[c.bytes_per_unit] = bytes_per_unit.get(c.bytes_per_unit, 0)
        return out

    def _adapter_summary(self) -> dict:
        lora = self.engine.lora
        return {
            "adapter_rows": dict(self.adapter_rows),
            "adapter_prompt_tokens": dict(self.adapter_prompt_tokens),
            "adapter_generated_tokens": dict(self.adapter_generated_tokens),
            "adapter_loads": lora.stats.loads if lora else 0,
            "adapter_evictions": lora.stats.evictions if lora else 0,
            "adapter_bytes": lora.host_bytes + lora.slot_bytes if lora else 0,
        }


SORTED_BATCH = 32  # sentence-transformers' encode and predict batch_size default


def padding_sorted(lengths: Counter[int], batch: int = SORTED_BATCH) -> int:
    """The padding tokens of a run that sorts its texts by length, longest first, and pads each batch of `batch`
    to its longest (as sentence-transformers' encode sorts before batching; it sorts by characters, this by tokens:
    no order of the texts pads less). `lengths`: token count -> texts of that count."""
    padding, batch_max, in_batch = 0, 0, 0
    for length in sorted(lengths, reverse=True):
        left = lengths[length]
        while left:
            if in_batch == 0:
                batch_max = length
            take = min(left, batch - in_batch)
            padding += take * (batch_max - length)
            in_batch = (in_batch + take) % batch
            left -= take
    return padding


class PoolingStats:
    """A pooling job's statistics (task: embed): texts, tokens computed and the padding avoided, in the summary's
    keys (no per-step rows: there are no pages to watch)."""

    def __init__(self, extra: dict | None = None, replica: int = 0, load_s: float = 0.0, sample=None):
        """`sample`: a bf16/fp16 job's fp32_sample.Fp32Sample (None: an fp32 job, or LLM's calls)."""
        self.extra = dict(extra or {})
        self.sample = sample
        self.replica = replica
        self.load_s = load_s
        self.start = time.perf_counter()
        self.steps = self.rows = self.tokens = self.padding = self.truncated = 0
        self.lengths: Counter[int] = Counter()  # texts by their token count (padding_sorted)

    def record(self, step) -> None:
        """One runner step (engine/pooling.PoolingStep)."""
        self.steps += 1
        self.rows += len(step.finished)
        self.tokens += step.num_tokens
        self.padding += step.num_padded_tokens
        self.truncated += sum(text.truncated for text, _ in step.finished)
        self.lengths.update(len(text.token_ids) for text, _ in step.finished)

    def take_rows(self, final: bool = False) -> list[dict]:
        return []

    def summary(self) -> dict:
        """As StatsCollector.summary: `rows` and `error_rows` are the job's to count."""
        wall = time.perf_counter() - self.start
        # nothing counted: 0, and {} for the per-name counts (no adapter's rows), as a generation job says it
        s = {key: {} if rules[0] == "counts" else 0 for key, rules in SUMMARY_KEYS.items()}
        s.update(
            wall_s=wall,
            load_s=self.load_s,
            runs=1,
            steps=self.steps,
            prompt_tokens=self.tokens,
            prompt_tokens_computed=self.tokens,
            prompt_tokens_per_s=self.tokens / wall if wall else 0.0,
            padding_tokens_avoided=self.padding,
            padding_tokens_sorted=padding_sorted(self.lengths),
            truncated_rows=self.truncated,
            fp32_sample=self.sample.summary() if self.sample is not None else None,
        )
        s.update(self.extra)
        return s


class StatsFile:
    """One shard's `stats.parquet` across the job's runs: the earlier runs' rows and summary (kept when the file
    belongs to this job), then this run's rows (from every replica) and summary. Written atomically, every
    `refresh_s` seconds while the run goes and at its end, so a killed run still leaves its statistics."""

    def __init__(self, path: Path, fingerprint: str, fresh: bool = False, refresh_s: float = 10.0):
        self.path = path
        self.fingerprint = fingerprint
        self.refresh_s = refresh_s
        self.earlier_rows: list[dict] = []
        self.earlier: dict | None = None
        if not fresh and self.path.is_file():
            self._load_earlier()
        self.run = (self.earlier or {}).get("runs", 0) + 1
        self.rows: list[dict] = []
        self._last_write = time.perf_counter()

    def _load_earlier(self) -> None:
        try:
            parquet = storage.parquet_file(self.path)
            meta = parquet.schema_arrow.metadata or {}
            theirs = meta.get(
                FINGERPRINT_KEY, self.fingerprint.encode()
            ).decode()  # files before fingerprints
            if theirs != self.fingerprint:
                return  # another job's statistics: this job starts its own
            table = parquet.read()
            summary = json.loads(meta[SUMMARY_KEY])
        except Exception:
            return  # unreadable: start afresh rather than fail the run
        summary.setdefault("runs", 1)
        rows = table.to_pylist()
        for r in rows:
            r.setdefault("run", 1)
            r.setdefault("replica", 0)
        self.earlier, self.earlier_rows = summary, rows

    def add(self, rows: list[dict]) -> None:
        for r in rows:
            r["run"] = self.run
        self.rows.extend(rows)

    def due(self) -> bool:
        return time.perf_counter() - self._last_write >= self.refresh_s

    def start(self) -> None:
        """Count this run once its model is loaded: a run killed before its first refresh is still one of the
        job's runs."""
        self.write({key: 0 for key in SUMMARY_KEYS} | {"runs": 1})

    def write(self, run_summary: dict, job_counts: dict | None = None) -> dict:
        """Write everything; returns the whole job's summary (this run folded into the earlier ones).
        `job_counts`: `rows` and `error_rows` as the output directory holds them (every run's, a killed run's
        too), which adding up the runs' summaries would not give."""
        whole = combine([self.earlier, run_summary], sequential=True) if self.earlier else dict(run_summary)
        whole.update(job_counts or {})
        write_stats(self.path, self.earlier_rows + self.rows, whole, self.fingerprint)
        self._last_write = time.perf_counter()
        return whole


def write_stats(path: Path, rows: list[dict], summary: dict, fingerprint: str = "") -> None:
    """Write rows + summary (JSON in key-value metadata), whole (storage.write_whole)."""
    columns = {c: [r[c] for r in rows] for c in COLUMNS}
    schema = pa.schema(
        [(c, pa.float64() if c in FLOAT_COLUMNS else pa.int64()) for c in COLUMNS],
        metadata={SUMMARY_KEY: json.dumps(summary).encode(), FINGERPRINT_KEY: fingerprint.encode()},
    )
    table = pa.table(columns, schema=schema)
    storage.write_whole(path, lambda f: pq.write_table(table, f))


def read_summary(path: Path) -> dict:
    meta = storage.parquet_file(path).schema_arrow.metadata or {}
    if SUMMARY_KEY not in meta:
        raise ValueError(
            f"{path}: no `batchrun.summary` in the file's metadata; is it a batchrun stats file?"
        )
    return json.loads(meta[SUMMARY_KEY])
