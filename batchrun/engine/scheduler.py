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

from .config import EngineConfig
from .kv_coordinator import KVCacheCoordinator
from .multimodal import EncoderCache
from .scheduler_output import ChunkRules, NewRequest, ScheduledSequence, SchedulerOutput
from .sequence import Sequence
from .steady_decodes import MIN_SEQS, SteadyDecodes

# how far down the waiting queue admission looks for a row of an adapter already running, when the oldest row's
# adapter would be one more than a step may run
ADAPTER_LOOKAHEAD = 64


def _adapter_order(s: ScheduledSequence) -> int:
    return -1 if s.seq.adapter is None else s.seq.adapter


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheCoordinator,
        rules: ChunkRules = ChunkRules(),  # noqa: B008 - frozen, so one default shared by all is safe
        encoder: EncoderCache | None = None,
    ):
        """`kv`: what sequences hold in the cache (pages, and a hybrid model's state slots), one call per action;
        `rules`: the model plan's chunk rules (scheduler_output.ChunkRules); `encoder`: a vision-language model's
        image features waiting for prefill, and their budget (None: text only)."""
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
        # enters or leaves it (_enter, _leave) and where its tokens are computed (`computed`, the output
        # processor's plain pass): the statistics read them every step instead of passing over the sequences
        self.running_reserved_tokens = self.running_computed_tokens = 0
        # whether any request given so far has a LoRA adapter (a fork has its parent's): until one has, a step
        # needs no pass over its sequences to order them by adapter
        self.adapted = False
        # the running sequences as columns while each only decodes (steady_decodes.py); None once `running`
        # changes or a step cannot be planned over them
        self.steady: SteadyDecodes | None = None

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
        self._drop_steady()
        self.running[seq] = None
        self.running_reserved_tokens += seq.reserved_tokens
        self.running_computed_tokens += seq.num_computed_tokens

    def _leave(self, seq: Sequence) -> None:
        """`seq` runs no more (finished, preempted, to be recomputed): before its computed count changes."""
        self._drop_steady()
        del self.running[seq]
        self.running_reserved_tokens -= seq.reserved_tokens
        self.running_computed_tokens -= seq.num_computed_tokens

    def _drop_steady(self) -> None:
        if self.steady is not None:
            self.steady.release()  # the tokens it holds are written into the sequences first
        self.steady = None

    def abort_all(self) -> None:
        """Drop every request and free its pages and state slots (the caller gave up on them)."""
        self._drop_steady()
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
        budget, plain_decodes = self.config.max_num_batched_tokens, 0
        left = None if self.steady is None else self.steady.plan(self.kv, out, budget)  # every one decodes
        if left is None:  # the loop, sequence by sequence
            self._drop_steady()
            left, plain_decodes = self._schedule_running(out, budget)
        budget = left
        if not out.preempted:
            budget = self._swap_in(out, budget)
            if not self.swapped:
                budget = self._admit_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget  # every path takes its tokens
        steady = plain_decodes == out.num_scheduled == len(self.running) >= MIN_SEQS  # each a plain decode
        if steady and not (self.adapted or self.kv.managers):
            self.steady = SteadyDecodes(out.scheduled, self.kv.bm)  # the next step, over columns
        if self.adapted and out.decodes is None and any([s.seq.adapter is not None for s in out.scheduled]):
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

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, int]:
        """The running sequences' step, one by one: the budget left and the decodes planned by the fast path."""
        # a running sequence's growth is pages alone (a state slot never grows): this loop asks the block
        # manager itself (kv.bm: trim, num_pages_to_grow, grow), every step, for every sequence
        kv, running = self.kv, self.running
        bm, windowed = kv.bm, kv.bm.layout.windowed
        # a decode where no page is held twice, none is given back behind a window and no encoder budget
        # counts: planned at once (what the general path below would plan, without its calls: this loop is most
        # of a decode step's scheduling; it registers full pages as `kv.planned` would, where no kept prefix
        # state ends). Its token goes into a page it has, or, crossing into a new page (every sequence does in
        # the same step, once a page of tokens), into one more page per group while free pages last
        P, records, snapshot_ends = bm.page_size, bm.sequences, kv.snapshot_ends
        plain = bm.num_groups and not windowed and self.encoder is None and not bm.pool.num_shared
        num_groups = bm.num_groups
        register = kv.prefix_cache.register_full_pages if kv.prefix_cache.enabled else None
        scheduled, units_of = out.scheduled, kv.units_of
        stateless = not kv.managers  # no cache manager's units: not asked sequence by sequence
        decode = ScheduledSequence.decode
        decodes = 0
        for seq in list(running):  # a copy: preemption takes sequences off the end
            if budget <= 0:
                break
            if out.preempted and seq not in running:
                break  # preempted for an older one: so is every sequence after it
            if plain:
                start, generated = seq.num_computed_tokens, seq.output_token_ids
                # decodes_generated_token (_chunk's 1) written out: its last token, a generated one (there is
                # one, and the tokens before it are computed), where no kept prefix state ends
                if (
                    generated
                    and start == len(seq.prompt_token_ids) + len(generated) - 1
                    and seq.seq_id not in snapshot_ends
                ):
                    record = records[seq.seq_id]  # its tables as the runner has them already
                    if record.unsent is None:
                        tables = record.tables
                        room = P * (len(tables[0]) if num_groups == 1 else min(map(len, tables)))
                        if start < room:  # with room for its token
                            news = None
                        elif start == room and bm.num_free_pages >= num_groups:
                            news = bm.append_pages(record, room // P + 1)  # handed on at once
                            out.tables_changed = True
                        else:
                            news = False  # the general path below (it preempts for pages)
                        if news is not False:
                            # register_full_pages returns at once unless a page is newly full: asked only then
                            # (its own test, on the record it reads: the same pages, registered in the same step)
                            if register is not None and (start + 1) // P > record.num_registered:
                                register(seq, start + 1)
                            scheduled.append(decode(seq, start, () if stateless else units_of(seq), news))
                            budget -= 1
                            decodes += 1
                            continue
            n = self._chunk(seq, budget, out)
            if not n:  # it waits a step (a whole prompt or image that does not fit, images' features held)
                continue
            if windowed:
                bm.trim(seq)  # pages behind a window go back before anything new is taken
            need = bm.num_pages_to_grow(seq, n)
            while need and need > bm.num_free_pages:
                victim = next(reversed(self.running))  # the most recently admitted
                self._preempt(victim, out)
                if victim is seq:
                    out.num_generating += decodes
                    return budget, 0  # it preempted itself: every sequence after it is gone already
                need = bm.num_pages_to_grow(seq, n)
            if need:  # most decodes write into a page they already own: nothing to grow
                self._schedule(seq, n, out)
            else:
                self._planned(seq, n, out)
            budget -= n
        out.num_generating += decodes
        return budget, decodes

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
    def computed(self, plan: SchedulerOutput) -> None:
        """The step of `plan` ran: its tokens' K/V are in the cache (before its samples are forked and its tokens
        sampled). The output processor calls it first thing; its plain pass does the same itself."""
        if plan.decodes is not None:
            for seq, end in zip(plan.decodes.seqs, (plan.decodes.positions + 1).tolist()):
                seq.num_computed_tokens = end
        else:
            for s in plan.scheduled:  # every step, for every sequence: kept lean
                s.seq.num_computed_tokens = s.start + s.num_new_tokens
        self.running_computed_tokens += plan.num_batched_tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Add a parallel sample that shares every page of its parent (and takes a copy of its state, made
        before the next step)."""
        self.kv.fork(parent, child)
        self._enter(child)


def decodes_generated_token(seq: Sequence, start: int, snapshot_ends) -> bool:
    """Whether `seq` computes one token from `start`, its last, a generated one, that no resource cuts: the rule
    `_chunk` asks first and the decode fast path writes out (keep the two alike). With a budget > 0, whole prompts,
    whole images and the encoder cut prompt tokens only; a hybrid's kept prefix (`snapshot_ends`) cuts anywhere."""
    p = len(seq.prompt_token_ids)  # not the properties: asked of every running sequence, every step
    return p <= start == p + len(seq.output_token_ids) - 1 and seq.seq_id not in snapshot_ends
