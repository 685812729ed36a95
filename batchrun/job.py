"""One job: stream rows in, keep the engine fed, write every row out, record statistics, stop cleanly.

Row lifecycle: read -> checked and tokenized (a bad row becomes an error row at once) -> queued in the engine
-> its n samples finish -> written together in a part file. Only a bounded window of rows is in memory.

On SIGTERM or SIGINT the job stops admitting rows, abandons the rows still in flight (a rerun redoes them),
writes every finished row and the statistics, and exits with code 3 ("stopped, resumable").
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from . import model_loader
from .config import JobSpec, parse_size
from .engine import Engine, EngineConfig, SamplingParams, Sequence
from .errors import BadInput, JobStopped
from .sinks import (
    OutputRow,
    PartWriter,
    check_writable,
    done_keys,
    existing_parts,
    fingerprint,
    output_schema,
    remove_parts,
)
from .sources import InputRow, InputSource, Shard
from .stats import StatsCollector

CPU_KV_SHARE = 0.1  # on the CPU, kv_cache_memory as a fraction means a fraction of 10% of available RAM


@dataclass
class RowState:
    row: InputRow
    prompt_tokens: int
    results: list[OutputRow | None] = field(default_factory=list)


def check_duplicate_ids(source: InputSource, limit: int | None, src: str) -> None:
    """Ids must be unique: outputs and resume are keyed on (id, sample). Reads the id column only."""
    if not source.spec.id_column:
        return
    seen: set = set()
    for index, row_id in enumerate(source.ids(limit)):
        if row_id in seen:
            raise BadInput(
                f"{src}: key `input.id_column`: id {row_id!r} appears more than once (row {index}); "
                f"ids must be unique, since outputs and resume are keyed on (id, sample)."
            )
        seen.add(row_id)


def row_seed(seed: int, row_id: Any, sample: int) -> int:
    digest = hashlib.sha256(f"{seed}:{row_id!r}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def available_ram() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def kv_cache_pages(spec: JobSpec, bytes_per_page: int, device: torch.device) -> int:
    eng = spec.engine
    if eng.num_pages is not None:
        return eng.num_pages
    mem = eng.kv_cache_memory
    if isinstance(mem, float | int):
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * mem)
        else:
            budget = int(available_ram() * CPU_KV_SHARE * mem)
    else:
        budget = parse_size(mem)
    pages = budget // bytes_per_page
    if pages < 1:
        raise BadInput(
            f"{spec.source_file}: key `engine.kv_cache_memory`: {mem!r} leaves room for no KV page "
            f"({bytes_per_page} bytes each); give more memory or set engine.num_pages."
        )
    return pages


class Job:
    def __init__(
        self,
        spec: JobSpec,
        shard: Shard | None = None,
        resume: bool = True,
        overwrite: bool = False,
        limit: int | None = None,
        progress: bool = True,
    ):
        self.spec = spec
        self.shard = shard or Shard()
        self.resume = resume
        self.overwrite = overwrite
        self.limit = limit if limit is not None else spec.input.limit
        self.progress = progress
        self.stop_requested = False
        self.src = spec.source_file

    # ---- set-up -----------------------------------------------------------------------------------------------
    def _open(self) -> None:
        spec = self.spec
        self.source = InputSource(spec.input, self.src)
        check_duplicate_ids(self.source, self.limit, self.src)
        self.fp = fingerprint(spec, self.shard)
        out_dir = spec.output_dir
        check_writable(out_dir, "output.path", self.src)
        check_writable(spec.stats_path.parent, "output.stats", self.src)
        if self.overwrite:
            remove_parts(out_dir)
        self.done = done_keys(out_dir, self.fp, self.src) if self.resume else set()
        if not self.resume and not self.overwrite and existing_parts(out_dir):
            raise BadInput(
                f"{self.src}: output.path {out_dir} already holds part files and --no-resume was "
                f"given; use --overwrite to start over, or --resume to finish the job."
            )

    def _nothing_to_do(self) -> bool:
        """Every row of this shard already has its output rows (checked without loading the model)."""
        if not self.done:
            return False
        n = self.spec.sampling.n
        return all(
            (row.id, i) in self.done for row in self.source.rows(self.shard, self.limit) for i in range(n)
        )

    def _load(self) -> None:
        spec = self.spec
        out_dir = spec.output_dir
        self.device = model_loader.pick_device(spec.engine.device)
        dtype = model_loader.pick_dtype(spec.model.dtype, self.device)
        model_dir = model_loader.resolve_model_dir(spec.model.path, self.src)
        self.tokenizer, self.model = model_loader.load_model(model_dir, dtype, self.device)
        attention = spec.engine.attention
        if attention == "auto":
            attention = "triton" if self.device.type == "cuda" else "torch"
        max_len = model_loader.model_max_len(self.model)
        if spec.model.max_model_len:
            max_len = min(max_len, spec.model.max_model_len)
        probe = Engine.kv_shape_of(self.model, spec.engine.page_size)
        num_pages = kv_cache_pages(spec, probe.bytes_per_page, self.device)
        num_cpu_pages = parse_size(spec.engine.swap_space) // probe.bytes_per_page
        config = EngineConfig(
            num_pages=num_pages,
            page_size=spec.engine.page_size,
            num_cpu_pages=num_cpu_pages,
            max_num_seqs=spec.engine.max_num_seqs,
            max_num_batched_tokens=spec.engine.max_num_batched_tokens,
            prefix_sharing=spec.engine.prefix_sharing,
            preemption=spec.engine.preemption,
            attention=attention,
            max_model_len=max_len,
        )
        self.engine = Engine(
            self.model,
            self.tokenizer,
            config,
            self.device,
            model_loader.eos_token_ids(self.tokenizer, self.model),
        )
        s = spec.sampling
        self.params = SamplingParams(
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            stop=tuple(s.stop),
            n=s.n,
            ignore_eos=s.ignore_eos,
        )
        if self.engine.admission_error(1, SamplingParams(max_new_tokens=1)):
            raise BadInput(
                f"{self.src}: key `engine.num_pages`: a KV cache of {num_pages} pages cannot run even "
                f"one sequence; give it more pages or memory."
            )
        schema = output_schema(self.source.id_type, self.source.passthrough_fields())
        self.writer = PartWriter(
            out_dir,
            schema,
            self.fp,
            spec.name,
            self.shard,
            rows_per_part=spec.output.rows_per_part,
            max_wait_s=spec.output.flush_seconds,
        )
        self.stats = StatsCollector(spec.stats_path, self.engine)
        self.stats.extra.update(
            {
                "job": spec.name,
                "shard": str(self.shard),
                "attention": attention,
                "device": str(self.device),
                "dtype": str(dtype).replace("torch.", ""),
                "model": str(model_dir),
                "max_num_seqs": spec.engine.max_num_seqs,
            }
        )

    # ---- rows ---------------------------------------------------------------------------------------------------
    def _tokenize(self, row: InputRow) -> list[int]:
        """Token ids of the row's prompt; ValueError with the reason for a row that cannot be served."""
        prompt = row.prompt
        if prompt is None:
            raise ValueError("prompt is null")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt is not a string (got {type(prompt).__name__})")
        if not prompt.strip():
            raise ValueError("prompt is empty")
        m = self.spec.model
        if m.chat_template:
            messages = [{"role": "system", "content": m.system_prompt}] if m.system_prompt else []
            messages.append({"role": "user", "content": prompt})
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
            except Exception as e:
                raise ValueError(f"chat template failed: {e}") from None
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt)["input_ids"]

    def _error_rows(self, row: InputRow, reason: str, prompt_tokens: int) -> list[OutputRow]:
        return [
            OutputRow(row.id, i, None, "error", reason, prompt_tokens, 0, 0, row.passthrough)
            for i in range(self.params.n)
        ]

    def _feed(self, rows) -> bool:
        """Queue rows until the engine has a full window waiting; returns False once the input is exhausted."""
        target = max(self.spec.engine.max_num_seqs, 16)
        while len(self.engine.scheduler.waiting) < target and not self.stop_requested:
            row = next(rows, None)
            if row is None:
                return False
            if all((row.id, i) in self.done for i in range(self.params.n)):
                continue
            try:
                ids = self._tokenize(row)
            except ValueError as e:
                self._emit(self._error_rows(row, str(e), 0))
                continue
            reason = self.engine.admission_error(len(ids), self.params)
            if reason:
                self._emit(self._error_rows(row, reason, len(ids)))
                continue
            state = RowState(row, len(ids), [None] * self.params.n)
            self.in_flight[row.index] = state
            seeds = [row_seed(self.params.seed, row.id, i) for i in range(self.params.n)]
            self.engine.add(ids, self.params, request=state, seeds=seeds)
        return True

    def _finish(self, seq: Sequence) -> None:
        state: RowState = seq.request
        state.results[seq.sample_index] = OutputRow(
            state.row.id,
            seq.sample_index,
            self.engine.completion_text(seq),
            seq.finish_reason,
            None,
            state.prompt_tokens,
            len(seq.output_token_ids),
            seq.num_preemptions,
            state.row.passthrough,
        )
        if all(r is not None for r in state.results):
            del self.in_flight[state.row.index]
            self._emit(state.results)

    def _emit(self, rows: list[OutputRow]) -> None:
        self.writer.add(rows)
        self.stats.rows_done += 1
        if self.bar is not None:
            self.bar.update(1)

    # ---- the loop -----------------------------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        if self.stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop_requested = True
        print(
            f"\nbatchrun: {signal.Signals(signum).name} received: writing finished rows and stopping "
            f"(rerun the same command to resume).",
            file=sys.stderr,
            flush=True,
        )

    def _total_rows(self) -> int | None:
        n = self.source.num_rows()
        if n is None:
            return None
        if self.limit is not None:
            n = min(n, self.limit)
        mine = len(range(self.shard.index, n, self.shard.count))
        return max(0, mine - len(self.done) // max(1, self.params.n))

    def run(self) -> dict | None:
        """Runs the job; returns its summary, or None when every row was already done."""
        self._open()
        if self._nothing_to_do():
            return None
        self._load()
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        self.in_flight: dict[int, RowState] = {}
        total = self._total_rows()
        self.bar = tqdm(
            total=total,
            unit="row",
            desc=self.spec.name,
            disable=not self.progress,
            mininterval=0.5 if sys.stderr.isatty() else 10.0,
            dynamic_ncols=True,
        )
        try:
            rows = self.source.rows(self.shard, self.limit)
            more = True
            while not self.stop_requested:
                if more:
                    more = self._feed(rows)
                if not self.engine.has_unfinished():
                    if not more:
                        break
                    continue
                result = self.engine.step()
                self.stats.record(result)
                for seq in result.finished:
                    self._finish(seq)
                self._progress()
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            self.bar.close()
            self.writer.flush()
            self.stats.write()
        if self.stop_requested:
            raise JobStopped(
                f"stopped with {len(self.in_flight)} rows in flight (not written); "
                f"{self.writer.rows_written} rows written this run."
            )
        self.engine.block_manager.check_integrity(self.engine.scheduler.live_sequences())
        return self.stats.summary()

    def _progress(self) -> None:
        if self.bar.disable:
            return
        now = time.perf_counter()
        if now - getattr(self, "_last_postfix", 0.0) < 0.5:
            return
        self._last_postfix = now
        elapsed = now - self.stats.start
        bm = self.engine.block_manager
        self.bar.set_postfix_str(
            f"{self.stats.generated_tokens / elapsed:.1f} tok/s, running {len(self.engine.scheduler.running)}, "
            f"pages {bm.num_used_pages}/{bm.num_pages}",
            refresh=False,
        )
