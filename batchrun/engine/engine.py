"""The step loop: schedule, move pages, run the model, sample, finish sequences.

`Engine` is the engine's public face: the job runner, the statistics and the Python API add prompts, step,
read queue sizes and memory snapshots, and check integrity through it; nothing outside `engine/` touches the
scheduler or the block manager.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checks import parse_size
from ..errors import BadInput
from . import memory
from .architecture import inspect_model
from .attention import AttentionServices, make_backend
from .block_manager import BlockManager
from .config import EngineConfig, SamplingParams
from .kv_cache import KVCache
from .memory import MemorySnapshot
from .model_runner import ModelRunner
from .sampler import prompt_logprobs, sample, token_logprobs
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence
from .sizing import model_max_len, num_pages_for
from .structured import Grammars
from .timing import PhaseTimes


@dataclass
class StepResult:
    plan: SchedulerOutput
    finished: list[Sequence] = field(default_factory=list)
    num_generated: int = 0  # tokens sampled this step
    num_prompt_tokens: int = 0  # prompt tokens computed this step (recomputed ones included)


class Engine:
    """A paged engine over one stock `transformers` model.

    Errors in `config` that only show once the model is known (a KV budget that holds no page) raise
    `BadInput` naming the `engine.*` key; a model whose attention batchrun cannot compute exactly raises
    `UnsupportedModel` (a BadInput) naming the architecture and the reason (architecture.py)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        config: EngineConfig,
        device: torch.device,
        eos_token_ids: set[int] | None = None,
        max_model_len: int | None = None,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.device = device
        self.eos_token_ids = eos_token_ids or set()
        self.max_model_len = min(model_max_len(model.config), max_model_len or 1 << 62)
        dtype = next(model.parameters()).dtype
        self.model_attention = inspect_model(
            model
        )  # refuses what cannot run exactly, before any page is made
        self.kv_shape = self.model_attention.kv_shape(config.page_size, dtype)
        self.num_pages = num_pages_for(config, self.kv_shape.bytes_per_page, device)
        num_cpu_pages = parse_size(config.swap_space) // self.kv_shape.bytes_per_page
        self.kv_groups = self.model_attention.groups
        self.block_manager = BlockManager(
            self.num_pages,
            config.page_size,
            num_cpu_pages,
            config.prefix_sharing,
            [kind.first_key for kind in self.kv_groups.kinds],
        )
        self.scheduler = Scheduler(config, self.block_manager, watermark_pages=max(1, self.num_pages // 100))
        if self.admission_error(1, SamplingParams(max_new_tokens=1)):
            raise BadInput(
                f"key `engine.num_pages`: a KV cache of {self.num_pages} pages cannot run even one "
                f"sequence; give it more pages or memory."
            )
        self.kv_cache = KVCache(self.kv_shape, self.num_pages, num_cpu_pages, device)
        self.attention = make_backend(config.attention, self.model_attention.num_heads, self.kv_shape, device)
        self.times = PhaseTimes()  # where the steps' time went (timing.py)
        services = AttentionServices(
            self.attention, self.kv_cache, self.times, self.model_attention.layers, self.kv_groups
        )
        self.runner = ModelRunner(model, services, device, self.times)
        self.vocab_size = model.config.vocab_size
        self._grammars: Grammars | None = None  # made on the first structured request
        self._seq_ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------------------------
    def admission_error(self, num_prompt_tokens: int, params: SamplingParams) -> str | None:
        """Why a prompt can never run here, or None: too long, a response format that does not compile, more
        pages than exist. Checked before a row enters the queue, so no row waits forever for pages that do not
        exist."""
        limit = self.max_model_len
        if num_prompt_tokens == 0:
            return "the prompt has no tokens"
        if num_prompt_tokens >= limit:
            return (
                f"prompt of {num_prompt_tokens} tokens does not fit the model's context: max_model_len is "
                f"{limit} (prompt + at least one generated token)"
            )
        if params.structured:
            try:
                self.grammars.compile(params.response_format)
            except ValueError as e:
                return str(e)
        total = min(num_prompt_tokens + params.max_new_tokens, limit)
        # the most pages it holds at once, in every KV cache group (a windowed group only what its window reads)
        pages = self.block_manager.pages_to_run(num_prompt_tokens, total, self.config.max_num_batched_tokens)
        if pages > self.num_pages:
            return (
                f"prompt of {num_prompt_tokens} tokens + {params.max_new_tokens} new tokens needs {pages} KV "
                f"pages at once; the whole KV cache holds {self.num_pages} pages of {self.config.page_size} "
                "tokens"
            )
        return None

    def add(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request: Any = None,
        seeds: list[int] | None = None,
    ) -> Sequence:
        """Queue a prompt; with params.n > 1 the other samples are forked once the prompt is prefilled.
        `seeds[i]` seeds sample i's generator (sampled rows only)."""
        seq = Sequence(next(self._seq_ids), list(prompt_token_ids), params, request=request)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs:
            seq.prompt_logprobs = [None]
        if params.structured:
            seq.grammar = self.grammars.matcher(params.response_format)
        seq.num_siblings_to_fork = params.n - 1
        seq.sibling_seeds = list(seeds) if seeds else [params.seed + i for i in range(params.n)]
        assert len(seq.sibling_seeds) == params.n, "one seed per sample"
        if not params.greedy:
            seq.generator = self._generator(seq.sibling_seeds[0])
        self.scheduler.add(seq)
        return seq

    def _generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        return g

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_all(self) -> None:
        """Drop every queued, running and swapped request and free its pages."""
        self.scheduler.abort_all()

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        with self.times("schedule"):
            plan = self.scheduler.schedule()
            self.kv_cache.apply(plan.swap_out, plan.swap_in, plan.copy_on_write)
        result = StepResult(plan)
        if plan.is_empty:
            if self.scheduler.has_unfinished() and not plan.preempted:
                raise RuntimeError(
                    "scheduler made no progress: nothing is running and nothing can be admitted"
                )
            return result
        logits = self.runner.execute(plan.scheduled)
        with self.times("sample"):  # scoring, forking samples, grammar masks, sampling, logprobs
            # the positions scoring prompt tokens were fixed when the step was planned (ScheduledSequence):
            # scoring them changes what is left to score
            if any(s.prompt_logprob_positions for s in plan.scheduled):
                self._score_prompts(plan, logits)
            sampling, rows = [], []  # sequences that sample, and the logits row each samples from
            row = 0
            for s in plan.scheduled:  # every step, for every sequence: kept lean (bench/speed.py's host work)
                seq = s.seq
                num_prompt = seq.num_prompt_tokens
                if s.start < num_prompt:
                    result.num_prompt_tokens += min(num_prompt, s.start + s.num_new_tokens) - s.start
                seq.num_computed_tokens += s.num_new_tokens
                row += len(s.prompt_logprob_positions)
                if s.needs_sample_logits:
                    sampling.append(seq)
                    rows.append(row)
                    if seq.num_siblings_to_fork:
                        for child in self._fork_siblings(seq):
                            sampling.append(child)
                            rows.append(row)
                    row += 1
                elif s.samples:  # a scoring sequence (max_new_tokens 0): its prompt is scored, it is done
                    seq.finish_reason = "length"
                    self.scheduler.finish(seq)
                    result.finished.append(seq)
            tokens = self._sample(logits, rows, sampling) if sampling else []
        with self.times("finish"):
            for seq, token in zip(sampling, tokens):
                if seq.grammar is not None:
                    seq.grammar.accept_token(token)
                seq.append_token(token)
                result.num_generated += 1
                if self._check_finished(seq):
                    self.scheduler.finish(seq)
                    result.finished.append(seq)
        return result

    def _sample(self, logits: torch.Tensor, rows: list[int], sampling: list[Sequence]) -> list[int]:
        """One token for each sampling sequence, from its logits row (grammar-masked where it has one); the
        logprobs rows asked for, from the raw logits."""
        if rows == list(range(logits.shape[0])):
            sample_logits = logits  # one row each, in order: no copy (at 256 rows it is 50 MB)
        else:  # siblings share their parent's row; scoring rows come first
            sample_logits = logits[torch.tensor(rows, device=logits.device)]
        grammars = [seq.grammar for seq in sampling]
        if any(g is not None for g in grammars):
            masked = sample_logits.clone()  # logprobs come from the raw logits
            self.grammars.apply(masked, grammars)
            tokens = sample(masked, sampling)
        else:
            tokens = sample(sample_logits, sampling)
        want = [j for j, seq in enumerate(sampling) if seq.logprobs is not None]
        if want:
            entries = token_logprobs(
                sample_logits[want], [tokens[j] for j in want], [sampling[j].params.logprobs for j in want]
            )
            for j, entry in zip(want, entries):
                sampling[j].logprobs.append(entry)
        return tokens

    def _score_prompts(self, plan: SchedulerOutput, logits: torch.Tensor) -> None:
        """Prompt logprobs of this step's scoring positions. Logits rows come per sequence: its scoring
        positions, then its sampling position."""
        rows, targets = [], []
        row = 0
        for s in plan.scheduled:
            positions = s.prompt_logprob_positions
            rows += range(row, row + len(positions))
            targets += [s.seq.prompt_token_ids[p + 1] for p in positions]
            row += len(positions) + s.needs_sample_logits
        scores = iter(prompt_logprobs(logits[torch.tensor(rows, device=logits.device)], targets))
        for s in plan.scheduled:
            if s.prompt_logprob_positions:
                s.seq.prompt_logprobs += [next(scores) for _ in s.prompt_logprob_positions]

    def _fork_siblings(self, parent: Sequence) -> list[Sequence]:
        """Parallel sampling: once the prompt is prefilled, the other samples share every page of it."""
        children = []
        for i in range(1, parent.num_siblings_to_fork + 1):
            child = Sequence(
                next(self._seq_ids),
                parent.prompt_token_ids,
                parent.params,
                request=parent.request,
                sample_index=i,
            )
            child.output_token_ids = list(parent.output_token_ids)
            if parent.prompt_logprobs is not None:
                child.prompt_logprobs = list(parent.prompt_logprobs)
            if parent.logprobs is not None:
                child.logprobs = list(parent.logprobs)
            if parent.grammar is not None:
                child.grammar = self.grammars.matcher(parent.params.response_format, parent.output_token_ids)
            if not parent.params.greedy:
                child.generator = self._generator(parent.sibling_seeds[i])
            self.scheduler.fork(parent, child)
            children.append(child)
        parent.num_siblings_to_fork = 0
        return children

    def _check_finished(self, seq: Sequence) -> bool:
        params = seq.params
        token = seq.output_token_ids[-1]
        if seq.grammar is not None and seq.grammar.is_terminated():
            seq.finish_reason = "stop"  # the grammar is complete (it accepted the end of sequence)
        elif not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "eos"
        elif params.stop and self._hit_stop_string(seq):
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= params.max_new_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _hit_stop_string(self, seq: Sequence) -> bool:
        window = max(len(s) for s in seq.params.stop) + 8
        tail = self.tokenizer.decode(seq.output_token_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in seq.params.stop)

    # ---- text ----------------------------------------------------------------------------------------------
    def completion_text(self, seq: Sequence) -> str:
        """The decoded completion; a stop string and what follows it are cut off."""
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        if seq.finish_reason == "stop":
            cut = min((i for i in (text.find(s) for s in seq.params.stop) if i >= 0), default=len(text))
            text = text[:cut]
        return text

    @property
    def grammars(self) -> Grammars:
        """The grammar compiler and cache, made on first use (xgrammar loads only for structured jobs)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def grammar_times(self) -> tuple[float, float]:
        """Seconds spent compiling grammars and masking logits so far."""
        g = self._grammars
        return (g.compile_s, g.mask_s) if g else (0.0, 0.0)

    # ---- the public face: queues, memory, integrity --------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_swapped(self) -> int:
        return len(self.scheduler.swapped)

    @property
    def num_used_pages(self) -> int:
        return self.block_manager.num_used_pages

    def running_sequences(self) -> list[Sequence]:
        """Sequences holding accelerator pages, in admission order (do not modify the list)."""
        return self.scheduler.running

    def live_sequences(self) -> list[Sequence]:
        """Sequences holding pages: running ones (accelerator pages) and swapped ones (CPU pages)."""
        return self.scheduler.live_sequences()

    def reservation(self, seq: Sequence) -> int:
        """The KV slots a contiguous allocator reserving prompt + max_new_tokens would hold for `seq` (in every
        KV cache group: a slot is one token of one group's layers)."""
        tokens = min(seq.num_prompt_tokens + seq.params.max_new_tokens, self.max_model_len)
        return tokens * self.kv_groups.num_groups

    def memory_snapshot(self, recount: bool = False) -> MemorySnapshot:
        """What the KV cache holds now, from the block tables; `recount`: slot by slot, to check the first."""
        counter = memory.recount if recount else memory.count
        return counter(
            self.block_manager, self.scheduler.running, self.num_waiting, self.num_swapped, self.reservation
        )

    def check_integrity(self) -> None:
        """Page bookkeeping agrees with every live block table (AssertionError otherwise)."""
        self.block_manager.check_integrity(self.scheduler.live_sequences())
