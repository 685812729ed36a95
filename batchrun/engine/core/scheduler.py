"""Waiting / running / swapped queues: admission, preemption and the plan for one engine step.

Each step, in this order:
1. running sequences (oldest admitted first) get their next tokens — one for a decode, a chunk for a prompt
   still being prefilled — and the page each needs; when none is free, the most recently admitted running
   sequence is preempted (swapped to the CPU pool, or dropped for recompute);
2. swapped sequences come back, oldest preemption first, when nothing was preempted this step;
3. waiting sequences are admitted first-come first-served while pages, `max_num_seqs` and the token budget
   allow, and only when no swapped sequence is waiting to come back.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Protocol

import numpy as np

from batchrun.engine.config import EngineConfig
from batchrun.engine.core.kv_coordinator import KVCacheCoordinator
from batchrun.engine.core.running_rows import RunningRows
from batchrun.engine.core.scheduler_output import (
    ChunkRules,
    NewRequest,
    SampledOutput,
    ScheduledSequence,
    SchedulerOutput,
)
from batchrun.engine.core.sequence import Sequence

# how far down the waiting queue admission looks for a row of an adapter already running, when the oldest row's
# adapter would be one more than a step may run
ADAPTER_LOOKAHEAD = 64


def _adapter_order(s: ScheduledSequence) -> int:
    return -1 if s.seq.adapter is None else s.seq.adapter


class ImageBudget(Protocol):
    """What the scheduler asks of a vision-language model's image features waiting for prefill (the runner's
    `multimodal.EncoderCache` answers): the scheduler plans within their budget and imports nothing of the
    runner's side."""

    def new_step(self) -> None: ...

    def fit(self, seq: Sequence, start: int, n: int) -> int: ...

    def take(self, seq: Sequence, start: int, n: int) -> None: ...


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheCoordinator,
        rules: ChunkRules = ChunkRules(),  # noqa: B008 - frozen, so one default shared by all is safe
        encoder: ImageBudget | None = None,
    ):
        """`kv`: what sequences hold in the cache (pages, and a hybrid model's state slots), one call per action;
        `rules`: the model plan's chunk rules (scheduler_output.ChunkRules); `encoder`: a vision-language model's image
        features waiting for prefill, and their budget (None: text only). A sequence's own `eos_token_ids` say
        which tokens end it."""
        self.config = config  # reads max_num_seqs, max_num_batched_tokens, preemption
        self.recompute_at = rules.recompute_at
        self.kv = kv
        self.whole_prompts = rules.whole_prompts
        # the most tokens of a prompt one step computes (None: the whole prompt)
        self.max_chunk = None if rules.whole_prompts else config.max_num_batched_tokens
        self.whole_images = rules.whole_images
        self.encoder = encoder
        # free pages admission leaves untouched, so decodes do not preempt at once: 1% of the pool
        self.watermark_pages = max(1, kv.num_pages // 100)
        self.waiting: deque[Sequence] = deque()
        # in admission order: a dict as an ordered set, so that a finished or preempted sequence leaves in O(1)
        self.running: dict[Sequence, None] = {}
        self.swapped: deque[Sequence] = deque()  # in preemption order
        # sums over `running` of each sequence's reserved_tokens and num_computed_tokens, kept where a sequence
        # enters or leaves it (_enter, _leave) and where its tokens are computed (`update_from_output`): the
        # statistics read them every step instead of passing over the sequences
        self.running_reserved_tokens = self.running_computed_tokens = 0
        # whether any request given so far has a LoRA adapter (a fork has its parent's): until one has, a step
        # needs no pass over its sequences to order them by adapter
        self.adapted = False
        # `running` as the columns each step is planned over (running_rows.py); None once it changes, made again
        # by the next plan
        self.rows: RunningRows | None = None

    # ---- queues ---------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.adapted = self.adapted or seq.adapter is not None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def live_sequences(self) -> list[Sequence]:
        return [*self.running, *self.swapped]

    def finish(self, seq: Sequence) -> None:
        self.kv.finish(seq)
        self._leave(seq)

    def _enter(self, seq: Sequence) -> None:
        """`seq` runs from now on (admitted, swapped in, forked), its computed tokens counted as they are."""
        self.rows = None
        self.running[seq] = None
        self.running_reserved_tokens += seq.reserved_tokens
        self.running_computed_tokens += seq.num_computed_tokens

    def _leave(self, seq: Sequence) -> None:
        """`seq` runs no more (finished, preempted, to be recomputed): before its computed count changes."""
        self.rows = None
        del self.running[seq]
        self.running_reserved_tokens -= seq.reserved_tokens
        self.running_computed_tokens -= seq.num_computed_tokens

    def abort_all(self) -> None:
        """Drop every request and free its pages and state slots (the caller gave up on them)."""
        self.rows = None
        self.kv.abort(self.running, self.swapped, self.waiting)
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()
        self.running_reserved_tokens = self.running_computed_tokens = 0

    # ---- the step -------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        # the cache managers' copies (a hybrid's states): those the last plan left first (forks, kept prefixes)
        out = SchedulerOutput(unit_copies=self.kv.new_step())
        if self.encoder is not None:
            self.encoder.new_step()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            budget = self._swap_in(out, budget)
            if not self.swapped:
                budget = self._admit_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget  # every path takes its tokens
        if self.adapted and any([s.seq.adapter is not None for s in out.scheduled]):
            # each LoRA adapter's sequences side by side: its tokens are then one run of the packed step, which
            # every adapted layer reads as a slice (no gather, no scatter); the order of a step's sequences
            # changes nothing else (each row is computed apart, its outputs are matched by place)
            out.scheduled.sort(key=_adapter_order)
        return out

    def _chunk(self, seq: Sequence, budget: int, out: SchedulerOutput, start: int | None = None) -> int:
        """The tokens `seq` computes this step from `start` (its computed tokens, unless given): 1 for a decode,
        a chunk of a long prompt, 0 for none this step. The one chunk policy of every call site: each resource
        in turn takes its limit: the step's token budget (a prompt computed whole instead, by a hybrid that
        cannot continue a state over several tokens, when it fits or begins the step), whole images (when the
        model's image tokens see each other), the encoder's budget for features waiting for prefill, and the
        prefix whose state a hybrid keeps (the step stops there)."""
        start = seq.num_computed_tokens if start is None else start
        snapshot_ends = self.kv.snapshot_ends
        if decodes_generated_token(seq, start, snapshot_ends):
            return 1
        n = seq.num_tokens - start
        if self.whole_prompts:
            n = n if n <= budget or out.is_empty else 0
        else:
            n = min(n, budget)
            if self.whole_images and seq.images is not None:
                n = seq.images.keep_whole(start, n, first=out.is_empty)
            if self.encoder is not None:
                n = self.encoder.fit(seq, start, n)
        if n and seq.seq_id in snapshot_ends:
            n = self.kv.limit(seq, start, n)
        return n

    def max_chunk_of(self, images) -> int | None:
        """The most tokens one step computes of a prompt with these images (multimodal.ImageInputs or None):
        what a windowed group's pages must hold at once. None: the whole prompt."""
        if self.max_chunk is None or not self.whole_images or images is None:
            return self.max_chunk
        return max([self.max_chunk] + [b - a for a, b in images.blocks])

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """The running sequences' step, over their columns (running_rows.py): the rows that decode a generated
        token into a page they have, or crossing into a new page while free pages last, planned at once; every
        other row in its turn by the general path (`_chunk`, pages grown or preempted for). Returns the budget
        left."""
        if not self.running:
            return budget
        kv, running = self.kv, self.running
        bm = kv.bm
        if self.rows is None:
            self.rows = RunningRows(list(running), bm, kv.units_of)
        rows = self.rows
        S, P = len(rows), bm.page_size
        # a page held twice may need a copy on write, and a budget under the rows may stop any of them: asked
        # sequence by sequence
        fast = (
            rows.decodes(bm, kv.snapshot_ends)
            if budget >= S and not bm.pool.num_shared
            else np.zeros(S, bool)
        )
        crossing = fast & (rows.computed == rows.rooms)
        registering = fast & ((rows.computed + 1) % P == 0) if kv.prefix_cache.enabled else None
        begin = 0
        for i in [*np.flatnonzero(~fast).tolist(), S]:
            while True:  # the decodes before row i, then row i (or a decode short of pages first)
                # preemption takes rows off the end: none after it is planned; nor past the budget
                end = min(i, len(running), begin + budget)
                stop = self._decodes(rows, begin, end, crossing, registering, out) if begin < end else end
                budget -= max(0, stop - begin)
                row = stop if stop < end else i
                if row >= len(running) or budget <= 0:
                    return budget
                seq, begin = rows.seqs[row], row + 1
                n = self._chunk(seq, budget, out)
                if (
                    n
                ):  # else it waits a step (a whole prompt or image that does not fit, images' features held)
                    bm.trim(seq)  # pages behind a window go back before anything new is taken
                    need = bm.num_pages_to_grow(seq, n)
                    while need and need > bm.num_free_pages:
                        victim = next(reversed(running))  # the most recently admitted
                        self._preempt(victim, out)
                        if victim is seq:
                            return budget  # it preempted itself: every sequence after it is gone already
                        need = bm.num_pages_to_grow(seq, n)
                    if need:  # most steps write into a page they already own: nothing to grow
                        out.copy_on_write.extend(kv.grow(seq, n))
                    self._planned(seq, n, out)
                    if self.rows is not None:
                        rows.planned[row] = n
                        rows.replanned(row, bm)
                    budget -= n
                if row == i:
                    break
        return budget

    def _decodes(
        self, rows: RunningRows, begin: int, end: int, crossing, registering, out: SchedulerOutput
    ) -> int:
        """Rows begin..end, each decoding its last token (`RunningRows.decodes`), planned: a new page in each group
        for those crossing into one, the pages they fill registered in the prefix cache (both in the rows'
        order, as the general path would: a page taken from the free pool may be a cached one whose hash a later
        registration reuses). Returns the row it stopped at: end, or one crossing with too few pages left (the
        rows planned before it took them), which the general path plans (it preempts)."""
        bm, kv, P = self.kv.bm, self.kv, self.kv.bm.page_size
        news, stop = {}, end
        visit = crossing[begin:end] if registering is None else crossing[begin:end] | registering[begin:end]
        for i in (begin + np.flatnonzero(visit)).tolist():
            start = int(rows.computed[i])
            if not crossing[i]:
                kv.prefix_cache.register_full_pages(rows.seqs[i], start + 1)
            elif bm.num_free_pages < bm.num_groups:
                stop = i
                break
            else:
                news[i] = bm.append_pages(bm.sequences[int(rows.ids[i])], start // P + 1)
                rows.rooms[i] += P
        decode, seqs, units, get = ScheduledSequence.decode, rows.seqs, rows.units, news.get
        starts = rows.computed[begin:stop].tolist()
        out.scheduled += [decode(seqs[i], c, units[i], get(i)) for i, c in enumerate(starts, begin)]
        rows.planned[begin:stop] = 1
        out.num_generating += stop - begin
        out.tables_changed = out.tables_changed or bool(news)
        return stop

    def _schedule(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        out.copy_on_write.extend(self.kv.grow(seq, n))
        self._planned(seq, n, out)

    def _planned(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        start = seq.num_computed_tokens
        if self.encoder is not None:
            self.encoder.take(seq, start, n)
        self.kv.planned(seq, start + n)
        s = ScheduledSequence(seq, n, start, self.kv.take_new_block_ids(seq), self.kv.units_of(seq))
        out.scheduled.append(s)
        if s.samples and start >= len(seq.prompt_token_ids):  # generated tokens only (one, unless recomputed)
            out.num_generating += 1
        out.scores_prompts = out.scores_prompts or bool(s.prompt_logprob_positions)
        out.tables_changed = out.tables_changed or s.new_block_ids is not None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._leave(seq)
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if self.config.preemption == "swap" and self.kv.can_swap_out(seq):
            out.swap_out.extend(self.kv.swap_out(seq))
            self.swapped.append(seq)
        else:
            self._drop_for_recompute(seq)
            out.recomputed.append(seq)

    def recompute(self, seq: Sequence) -> None:
        """A running sequence computes its tokens again, as one prompt, next admitted (not a preemption: the
        model asks for it, `recompute_at`)."""
        self._leave(seq)
        self._drop_for_recompute(seq)

    def _drop_for_recompute(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)

    def _running_adapters(self) -> set[int]:
        """The LoRA adapters the running sequences use (a step runs at most engine.max_loras of them)."""
        if not self.adapted:
            return set()
        return {s.adapter for s in self.running if s.adapter is not None}

    def _admits_adapter(self, seq: Sequence, adapters: set[int]) -> bool:
        return seq.adapter is None or seq.adapter in adapters or len(adapters) < self.config.max_loras

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        if not self.swapped:
            return budget
        adapters = self._running_adapters()
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            if not self._admits_adapter(seq, adapters):
                break  # it comes back once a running adapter's rows are done
            n = self._chunk(seq, budget, out)
            if not n:
                break
            if not self.kv.can_swap_in(seq, n):  # its pages come back, plus what its next tokens need
                break
            self.swapped.popleft()
            out.swap_in.extend(self.kv.swap_in(seq))
            self._enter(seq)
            if seq.adapter is not None:
                adapters.add(seq.adapter)
            self._schedule(seq, n, out)
            budget -= n
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        if not self.waiting:
            return budget
        adapters = self._running_adapters()
        while self.waiting and budget > 0:
            seq = self._next_waiting(adapters)
            if seq is None:
                break  # every waiting row within reach needs one more adapter than a step may run
            seats = 1 + seq.num_siblings_to_fork
            if self.running and len(self.running) + seats > self.config.max_num_seqs:
                break
            # a hybrid matches only prefixes whose state is kept (a snapshot); the page hashes are kept on seq
            match = self.kv.match(seq)
            start = match.num_blocks * self.kv.page_size
            if not self._chunk(seq, budget, out, start):
                break  # a prompt or image to compute whole that does not fit this step, images' features held
            # pages and state slots; a longer prefix of it whose state is kept this step: computed once, not twice
            reserve = self.watermark_pages if self.running else 0
            if not self.kv.can_admit(seq, match, self.max_chunk_of(seq.images), reserve):
                break
            if seq is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(seq)
            if seq.adapter is not None:
                adapters.add(seq.adapter)
            self.kv.keep_prefix_state(seq, match, self.waiting)
            # again: the snapshot it may have been given ends its first chunk
            n = self.kv.admit(seq, self._chunk(seq, budget, out, start), match)
            self._enter(seq)
            out.new_requests.append(NewRequest.of(seq))
            self._planned(seq, n, out)
            budget -= n
        return budget

    def _next_waiting(self, adapters: set[int]) -> Sequence | None:
        """The next sequence to admit: the oldest waiting one, unless its LoRA adapter would make one more than a
        step runs (engine.max_loras); then the oldest among the next few whose adapter is running already (or
        that has none), so rows of the loaded adapters go on while the others wait their turn."""
        head = self.waiting[0]
        if self._admits_adapter(head, adapters):
            return head
        return next(
            (s for s in islice(self.waiting, ADAPTER_LOOKAHEAD) if self._admits_adapter(s, adapters)), None
        )

    # ---- after the forward pass -----------------------------------------------------------------------------
    def update_from_output(self, plan: SchedulerOutput, sampled: SampledOutput) -> list[Sequence]:
        """The one place a step changes its requests: the step of `plan` ran and gave `sampled` back. Its tokens
        are computed, its forked samples run from now on (sharing their parent's pages), its scoring sequences
        are done, each sampled token is appended and its sequence finished by a stop, EOS or its length limit,
        or computed again whole where the model asks (`recompute_at`). Returns the sequences finished."""
        if self.rows is not None:
            self.rows.advance()
        for s in plan.scheduled:  # every step, for every sequence: kept lean
            s.seq.num_computed_tokens = s.start + s.num_new_tokens
        self.running_computed_tokens += plan.num_batched_tokens
        for parent, child in sampled.forks:
            self.fork(parent, child)
        finished = []
        for seq in sampled.scored:  # its prompt is scored: nothing to generate
            seq.finish_reason = "length"
            self.finish(seq)
            finished.append(seq)
        stopped, recompute_at = sampled.stopped, self.recompute_at
        for i, (seq, token) in enumerate(zip(sampled.seqs, sampled.tokens)):  # every step, for every sequence
            out = seq.output_token_ids
            out.append(token)
            if stopped and i in stopped:
                seq.finish_reason = "stop"
            elif token in seq.eos_token_ids:
                seq.finish_reason = "eos"
            elif len(out) + len(seq.prompt_token_ids) >= seq.reserved_tokens:  # max_new_tokens or the context
                seq.finish_reason = "length"
            else:
                if recompute_at is not None and len(out) + len(seq.prompt_token_ids) == recompute_at:
                    self.recompute(seq)  # Phi-3's LongRoPE switch (per_sequence_rope.py)
                continue
            self.finish(seq)
            finished.append(seq)
        return finished

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Add a parallel sample that shares every page of its parent (and takes a copy of its state, made
        before the next step)."""
        self.kv.fork(parent, child)
        self._enter(child)


def decodes_generated_token(seq: Sequence, start: int, snapshot_ends) -> bool:
    """Whether `seq` computes one token from `start`, its last, a generated one, that no resource cuts: the rule
    `_chunk` asks first (RunningRows.decodes asks it of the columns). With a budget > 0, whole prompts, whole images
    and the encoder cut prompt tokens only; a hybrid's kept prefix (`snapshot_ends`) cuts anywhere."""
    p = len(seq.prompt_token_ids)  # not the properties: asked of every running sequence, every step
    return p <= start == p + len(seq.output_token_ids) - 1 and seq.seq_id not in snapshot_ends
