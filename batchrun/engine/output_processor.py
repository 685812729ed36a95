"""What follows the forward: the step's logits become tokens, and finished sequences become text.

Per step, for the sequences the plan scheduled: score prompt positions (prompt logprobs), make the parallel
samples of a prompt just prefilled, mask logits by grammars, sample, record logprobs, and flag the samples a stop
ends (the grammar's end, a stop string). The engine calls `sample` once per step and hands what it returns to the
scheduler (`Scheduler.update_from_output`, where tokens are appended and sequences finish); `completion_text`
turns a finished sequence into its text.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from batchrun.engine import cpu_kernels
from batchrun.engine.config import SamplingParams
from batchrun.engine.core.scheduler_output import SampledOutput, SchedulerOutput
from batchrun.engine.core.sequence import Sequence
from batchrun.engine.structured import Grammars
from batchrun.engine.worker.sampler import prompt_logprobs, sample, token_logprobs


class OutputProcessor:
    """The engine's sampling half (vLLM's name for it): owns the grammars, the sequences' ids and generators."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._grammars: Grammars | None = None  # made on the first structured request
        self.seq_ids = itertools.count()  # every sequence's id, forked samples' too
        # whether every live request decodes greedily with no grammar, no logprobs and no stop strings, so a step
        # of decodes is one argmax: set again when a request comes to an engine with none live (`idle`), cleared
        # by the first request that is not plain (until then no step passes over its rows to ask)
        self.plain = True

    def new_sequence(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request: Any,
        seeds: list[int] | None,
        idle: bool,
    ) -> Sequence:
        """A new request's sequence (its sampling state: logprobs, grammar, generator, the samples to fork);
        `idle`: no request is live."""
        self.plain = (self.plain or idle) and params.plain
        seq = Sequence(next(self.seq_ids), prompt_token_ids, params, request=request)
        seq.eos_token_ids = frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)
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

    def sample(self, plan: SchedulerOutput, logits: torch.Tensor) -> SampledOutput:
        """The step's tokens from its logits (prompt positions scored, samples of a prompt just prefilled made,
        grammars advanced), as the scheduler takes them (Scheduler.update_from_output)."""
        # the positions scoring prompt tokens were fixed when the step was planned (ScheduledSequence): scoring
        # them changes what is left to score
        if plan.scores_prompts:
            self._score_prompts(plan, logits)
        if plan.num_generating == plan.num_scheduled:
            # each sequence samples its next generated token (the common step): a logits row each, in order, no
            # prompt token to count or score, no sample to fork, none done unsampled
            if self.plain:  # greedy, no grammar, logprobs or stop strings: one argmax over the rows
                return SampledOutput(plan.seqs, cpu_kernels.argmax_rows(logits).tolist())
            out, rows = SampledOutput(plan.seqs, []), None
        else:
            out, rows = self._sampling_rows(plan)
        if out.seqs:
            out.tokens = self._sample(logits, rows, out.seqs)
            self._stops(out)
        return out

    def _stops(self, out: SampledOutput) -> None:
        """Each grammar takes its token; the samples a stop ends flagged (a grammar's end, a stop string where EOS
        does not end the sequence first)."""
        eos = self.eos_token_ids
        for i, (seq, token) in enumerate(zip(out.seqs, out.tokens)):
            if seq.grammar is not None:
                seq.grammar.accept_token(token)
                if seq.grammar.is_terminated():  # it accepted the end of sequence
                    out.stopped.add(i)
                    continue
            stop = seq.params.stop
            if (
                stop
                and (seq.params.ignore_eos or token not in eos)
                and self._hit_stop_string(seq, token, stop)
            ):
                out.stopped.add(i)

    def _sampling_rows(self, plan: SchedulerOutput) -> tuple[SampledOutput, list[int]]:
        """The sequences that sample (forked samples of a prompt just prefilled among them), the prompt tokens
        computed and the scoring sequences done; and the logits row each sequence samples from."""
        out, rows = SampledOutput([], []), []  # sequences that sample, and the logits row each samples from
        sampling = out.seqs
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
                        out.forks.append((seq, child))
                row += 1
            elif s.samples:  # a scoring sequence (max_new_tokens 0): its prompt is scored, it is done
                out.scored.append(seq)
        out.num_prompt_tokens = prompt_tokens
        return out, rows

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
            child.eos_token_ids = parent.eos_token_ids
            if parent.prompt_logprobs is not None:
                child.prompt_logprobs = list(parent.prompt_logprobs)
            if parent.logprobs is not None:
                child.logprobs = list(parent.logprobs)
            if parent.grammar is not None:
                child.grammar = self.grammars.matcher(parent.params.response_format, parent.output_token_ids)
            if not parent.params.greedy:
                child.generator = self.generator(parent.sibling_seeds[i])
            children.append(child)
        parent.num_siblings_to_fork = 0
        return children

    def _hit_stop_string(self, seq: Sequence, token: int, stop: list[str]) -> bool:
        """Whether the completion ends in one of `stop` once `token` is appended."""
        window = max(len(s) for s in stop) + 8
        tail = self.tokenizer.decode(seq.output_token_ids[-window + 1 :] + [token], skip_special_tokens=True)
        return any(s in tail for s in stop)

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
