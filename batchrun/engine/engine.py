"""The step loop: schedule, move pages, run the model, sample, finish sequences."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from .block_manager import BlockManager
from .kv_cache import KVCache, KVCacheShape
from .model_runner import ModelRunner
from .sampler import sample
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import SamplingParams, Sequence


@dataclass
class EngineConfig:
    num_pages: int
    page_size: int = 16
    num_cpu_pages: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefix_sharing: bool = True
    preemption: str = "swap"
    attention: str = "torch"  # torch | triton
    max_model_len: int = 8192


@dataclass
class StepResult:
    plan: SchedulerOutput
    finished: list[Sequence] = field(default_factory=list)
    num_generated: int = 0  # tokens sampled this step
    num_prompt_tokens: int = 0  # prompt tokens computed this step (recomputed ones included)


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        config: EngineConfig,
        device: torch.device,
        eos_token_ids: set[int] | None = None,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.device = device
        self.kv_shape = self.kv_shape_of(model, config.page_size)
        self.block_manager = BlockManager(
            config.num_pages, config.page_size, config.num_cpu_pages, config.prefix_sharing
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                preemption=config.preemption,
                watermark_pages=max(1, config.num_pages // 100),
            ),
            self.block_manager,
        )
        self.kv_cache = KVCache(self.kv_shape, config.num_pages, config.num_cpu_pages, device)
        self.runner = ModelRunner(model, self.kv_cache, config.page_size, config.attention, device)
        self.eos_token_ids = eos_token_ids or set()
        self._seq_ids = itertools.count()
        self.num_recomputations = 0
        self.num_preemptions = 0

    @staticmethod
    def kv_shape_of(model: torch.nn.Module, page_size: int) -> KVCacheShape:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return KVCacheShape(
            cfg.num_hidden_layers, num_kv_heads, head_dim, page_size, next(model.parameters()).dtype
        )

    # ---- requests -------------------------------------------------------------------------------------------
    def admission_error(self, num_prompt_tokens: int, params: SamplingParams) -> str | None:
        """Why a prompt can never run here, or None. Checked before a row enters the queue, so no row waits
        forever for pages that do not exist."""
        limit = self.config.max_model_len
        if num_prompt_tokens == 0:
            return "the prompt has no tokens"
        if num_prompt_tokens >= limit:
            return (
                f"prompt of {num_prompt_tokens} tokens does not fit the model's context: max_model_len is "
                f"{limit} (prompt + at least one generated token)"
            )
        total = min(num_prompt_tokens + params.max_new_tokens, limit)
        capacity = self.config.num_pages * self.config.page_size
        if total > capacity:
            return (
                f"prompt of {num_prompt_tokens} tokens + {params.max_new_tokens} new tokens needs {total} KV "
                f"slots; the whole KV cache holds {capacity} ({self.config.num_pages} pages)"
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

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        plan = self.scheduler.schedule()
        result = StepResult(plan)
        self.num_preemptions += len(plan.preempted)
        self.num_recomputations += len(plan.recomputed)
        self.kv_cache.apply(plan.swap_out, plan.swap_in, plan.copy_on_write)
        if plan.is_empty:
            if self.scheduler.has_unfinished() and not plan.preempted:
                raise RuntimeError(
                    "scheduler made no progress: nothing is running and nothing can be admitted"
                )
            return result
        logits = self.runner.execute(plan.scheduled)
        sampling, rows = [], []  # sequences that sample, and the logits row each samples from
        num_logit_rows = 0
        for s in plan.scheduled:
            seq = s.seq
            result.num_prompt_tokens += max(
                0, min(seq.num_prompt_tokens, s.start + s.num_new_tokens) - s.start
            )
            seq.num_computed_tokens += s.num_new_tokens
            if s.samples:
                for member in [seq, *self._fork_siblings(seq)]:
                    sampling.append(member)
                    rows.append(num_logit_rows)
                num_logit_rows += 1
        if sampling:
            row_index = torch.tensor(rows, device=logits.device)
            tokens = sample(logits[row_index], sampling)
            for seq, token in zip(sampling, tokens):
                seq.append_token(token)
                result.num_generated += 1
                if self._check_finished(seq):
                    self.scheduler.finish(seq)
                    result.finished.append(seq)
        return result

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
            if not parent.params.greedy:
                child.generator = self._generator(parent.sibling_seeds[i])
            self.scheduler.fork(parent, child)
            children.append(child)
        parent.num_siblings_to_fork = 0
        return children

    def _check_finished(self, seq: Sequence) -> bool:
        params = seq.params
        token = seq.output_token_ids[-1]
        if not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "eos"
        elif params.stop and self._hit_stop_string(seq):
            seq.finish_reason = "stop"
        elif (
            len(seq.output_token_ids) >= params.max_new_tokens or seq.num_tokens >= self.config.max_model_len
        ):
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

    def live_sequences(self) -> list[Sequence]:
        """Sequences holding pages: running ones (accelerator pages) and swapped ones (CPU pages)."""
        return self.scheduler.live_sequences()
