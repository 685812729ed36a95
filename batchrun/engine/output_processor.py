"""What follows the forward: the step's logits become tokens, and tokens become finished sequences.

Per step, for the sequences the plan scheduled: score prompt positions (prompt logprobs), fork the parallel
samples of a prompt just prefilled (they share its pages), mask logits by grammars, sample, record logprobs,
append the tokens, and decide who finished (the grammar's end, EOS, a stop string, the length limit). The engine
calls `process` once per step; `completion_text` turns a finished sequence into its text.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from . import cpu_kernels
from .config import SamplingParams
from .sampler import prompt_logprobs, sample, token_logprobs
from .scheduler import Scheduler
from .scheduler_output import DecodeColumns, SchedulerOutput
from .sequence import Sequence
from .structured import Grammars
from .timing import PhaseTimes


class OutputProcessor:
    """The engine's sampling and finishing half (vLLM's name for it): owns the grammars, the sequences' ids and
    generators; finishes sequences through the scheduler."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: set[int],
        scheduler: Scheduler,
        times: PhaseTimes,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.scheduler = scheduler  # forks the samples of a prefilled prompt, finishes sequences
        self.times = times
        self._grammars: Grammars | None = None  # made on the first structured request
        self.seq_ids = itertools.count()  # every sequence's id, forked samples' too
        # whether every live request decodes greedily with no grammar, no logprobs and no stop strings, so a step
        # of decodes is one argmax and one loop of length and EOS checks (`_decode_plain`): set again when a
        # request comes to an engine with none live, cleared by the first request that is not plain (until then
        # no step passes over its rows to ask)
        self.plain = scheduler.recompute_at is None

    def new_sequence(
        self, prompt_token_ids: list[int], params: SamplingParams, request: Any, seeds: list[int] | None
    ) -> Sequence:
        """A new request's sequence (its sampling state: logprobs, grammar, generator, the samples to fork)."""
        if not self.scheduler.has_unfinished():
            self.plain = self.scheduler.recompute_at is None
        self.plain = self.plain and params.plain
        seq = Sequence(next(self.seq_ids), prompt_token_ids, params, request=request)
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
            seq.generator = self.generator(seq.sibling_seeds[0])
        return seq

    def generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        return g

    def process(self, plan: SchedulerOutput, logits: torch.Tensor, result) -> None:
        """The step's tokens from its logits, into `result` (engine.StepResult): finished sequences, counts. The
        step's tokens are marked computed first (Scheduler.computed: before samples are forked or tokens
        appended), under the "finish" timer; the plain path does it itself (`_decode_plain`)."""
        times = self.times
        if self.plain and plan.num_generating == plan.num_scheduled:
            self._decode_plain(plan, logits, result)
            return
        with times("finish"):
            self.scheduler.computed(plan)
        with times("sample"):  # scoring, forking samples, grammar masks, sampling, logprobs
            # the positions scoring prompt tokens were fixed when the step was planned (ScheduledSequence):
            # scoring them changes what is left to score
            if plan.scores_prompts:
                self._score_prompts(plan, logits)
            if plan.num_generating == plan.num_scheduled:
                # each sequence samples its next generated token (the common step): a logits row each, in order,
                # no prompt token to count or score, no sample to fork, none done unsampled
                sampling, rows = plan.seqs, None
            else:
                sampling, rows = self._sampling_rows(plan, result)
            tokens = self._sample(logits, rows, sampling) if sampling else []
            result.sampled = ([seq.seq_id for seq in sampling], tokens)
        with times("finish"):
            recompute_at = self.scheduler.recompute_at
            for seq, token in zip(sampling, tokens):  # every step, for every sequence: kept lean
                if seq.grammar is not None:
                    seq.grammar.accept_token(token)
                seq.append_token(token)
                if self._check_finished(seq):
                    self.scheduler.finish(seq)
                    result.finished.append(seq)
                elif recompute_at is not None and seq.num_tokens == recompute_at:
                    self.scheduler.recompute(seq)  # Phi-3's LongRoPE switch (per_sequence_rope.py)
            result.num_generated += len(tokens)

    def _decode_plain(self, plan: SchedulerOutput, logits: torch.Tensor, result) -> None:
        """`process` where every sequence samples its next generated token greedily, one logits row each, and no
        request has a grammar, logprobs or stop strings: one argmax over the rows, then each token appended and
        marked computed (what Scheduler.computed does) and EOS and the length limit checked (`_check_finished`'s
        checks that apply), in one pass over the step's sequences; for a step the scheduler's steady columns
        planned, the columns hold the tokens instead and the checks run over arrays (`_finish_columns`)."""
        with self.times("sample"):
            sampled = cpu_kernels.argmax_rows(logits)  # sample()'s greedy rows
            tokens = sampled.tolist()
            result.sampled = (plan.req_ids, tokens)
        with self.times("finish"):
            self.scheduler.running_computed_tokens += plan.num_batched_tokens  # as Scheduler.computed adds
            result.num_generated += len(tokens)
            if plan.decodes is not None:
                self._finish_columns(plan.decodes, sampled, tokens, result.finished)
                return
            eos, finished = self.eos_token_ids, result.finished
            for s, token in zip(plan.scheduled, tokens):  # every step, for every sequence: kept lean
                seq = s.seq
                seq.num_computed_tokens = s.start + s.num_new_tokens  # Scheduler.computed's
                out = seq.output_token_ids
                out.append(token)
                if token in eos and not seq.params.ignore_eos:
                    seq.finish_reason = "eos"
                elif len(out) + len(seq.prompt_token_ids) >= seq.reserved_tokens:
                    seq.finish_reason = "length"
                else:
                    continue
                self.scheduler.finish(seq)
                finished.append(seq)

    def _finish_columns(
        self, batch: DecodeColumns, sampled: torch.Tensor, tokens: list[int], finished: list
    ) -> None:
        """`_decode_plain`'s pass over a step of the scheduler's steady columns: their holder keeps the tokens
        (steady_decodes.py: written into a sequence when it is read), EOS and the length limit are checked over
        arrays, and only the sequences that finish are visited, in the step's order."""
        sampled = sampled.cpu().numpy()  # on the host already, but for a GPU's logits
        batch.owner.generated(sampled)
        # each one's count is now its position + 2: the length limit is reached at its limit (reserved_tokens)
        done = batch.positions + 2 >= batch.limits
        eos, at_eos = self.eos_token_ids, None
        if not eos.isdisjoint(tokens):
            at_eos = np.isin(sampled, list(eos)) & batch.stops_at_eos
            done |= at_eos
        for i in np.flatnonzero(done).tolist():
            seq = batch.seqs[i]
            seq.finish_reason = "eos" if at_eos is not None and at_eos[i] else "length"
            self.scheduler.finish(seq)
            finished.append(seq)

    def _sampling_rows(self, plan: SchedulerOutput, result) -> tuple[list[Sequence], list[int]]:
        """The sequences that sample (forked samples of a prompt just prefilled among them) and the logits row
        each samples from; the prompt tokens computed counted and scoring sequences finished, into `result`."""
        sampling, rows = [], []  # sequences that sample, and the logits row each samples from
        row = prompt_tokens = 0
        for s in plan.scheduled:  # every step, for every sequence: kept lean (bench/host.py)
            seq, start = s.seq, s.start
            if start < len(seq.prompt_token_ids):
                prompt_tokens += min(len(seq.prompt_token_ids), start + s.num_new_tokens) - start
            row += len(s.prompt_logprob_positions)
            if s.needs_sample_logits:
                sampling.append(seq)
                rows.append(row)
                if seq.num_siblings_to_fork:
                    for child in self._fork_siblings(seq):
                        sampling.append(child)
                        rows.append(row)
                        result.forks.append((seq.seq_id, child.seq_id))
                row += 1
            elif s.samples:  # a scoring sequence (max_new_tokens 0): its prompt is scored, it is done
                seq.finish_reason = "length"
                self.scheduler.finish(seq)
                result.finished.append(seq)
        result.num_prompt_tokens += prompt_tokens
        return sampling, rows

    def _sample(self, logits: torch.Tensor, rows: list[int] | None, sampling: list[Sequence]) -> list[int]:
        """One token for each sampling sequence, from its logits row (grammar-masked where it has one; `rows`
        None: row i is sequence i's); the logprobs rows asked for, from the raw logits."""
        if rows is None or rows == list(range(logits.shape[0])):
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
                next(self.seq_ids),
                parent.prompt_token_ids,
                parent.params,
                request=parent.request,
                sample_index=i,
            )
            child.output_token_ids = list(parent.output_token_ids)
            child.reserved_tokens = parent.reserved_tokens
            child.images = parent.images
            child.adapter = parent.adapter
            if parent.prompt_logprobs is not None:
                child.prompt_logprobs = list(parent.prompt_logprobs)
            if parent.logprobs is not None:
                child.logprobs = list(parent.logprobs)
            if parent.grammar is not None:
                child.grammar = self.grammars.matcher(parent.params.response_format, parent.output_token_ids)
            if not parent.params.greedy:
                child.generator = self.generator(parent.sibling_seeds[i])
            self.scheduler.fork(parent, child)
            children.append(child)
        parent.num_siblings_to_fork = 0
        return children

    def _check_finished(self, seq: Sequence) -> bool:
        # _decode_plain restates the EOS and length checks for requests without the others (SamplingParams.plain)
        params = seq.params
        token = seq.output_token_ids[-1]
        if seq.grammar is not None and seq.grammar.is_terminated():
            seq.finish_reason = "stop"  # the grammar is complete (it accepted the end of sequence)
        elif not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "eos"
        elif params.stop and self._hit_stop_string(seq):
            seq.finish_reason = "stop"
        elif seq.num_tokens >= seq.reserved_tokens:  # max_new_tokens or the context's limit
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _hit_stop_string(self, seq: Sequence) -> bool:
        window = max(len(s) for s in seq.params.stop) + 8
        tail = self.tokenizer.decode(seq.output_token_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in seq.params.stop)

    # ---- text ----------------------------------------------------------------------------------------------
    def completion_text(self, seq: Sequence) -> str:
        """The decoded completion; a stop string and what follows it are cut off, and so is a character the
        length limit cut in half (its first bytes decode as U+FFFD; token_ids keep them)."""
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        if seq.finish_reason == "length":
            text = text.rstrip("\ufffd")
        elif seq.finish_reason == "stop":
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
