"""The scheduler's plan for one step (vLLM v1's `SchedulerOutput`): what each scheduled sequence computes, which
requests are new to the model runner, and the copies the cache owners make first.

After the forward, what the step sampled comes back as one value (`SampledOutput`), which one scheduler method
applies (`Scheduler.update_from_output`).

A scheduled sequence carries, of its block tables, only what changed since the runner last saw them
(`new_block_ids`, from the block manager's record of what it has handed on): nothing for most decodes, one page
for a decode crossing into a new page, a copied page for copy on write, and the whole table once for a request
admitted, swapped in or forked. The runner keeps the tables themselves (input_batch.py), so nothing downstream
reads the block manager's lists.

The types that cross from the scheduler to the runner live here, beside the plan, so neither imports the other:
a request new to the runner (`NewRequest`), and the model plan's rules of how much of a prompt a step computes
(`ChunkRules`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchrun.engine.core.cache_spec import PageCopy, UnitCopies
from batchrun.engine.core.sequence import Sequence

_NONE = range(0)

# per KV cache group: (the first entry of the table that changed, the table's entries from there), or None for
# a table that did not change since the runner last saw it (block_manager.BlockManager.take_new_block_ids)
NewBlockIds = list[tuple[int, list[int]]] | None


@dataclass(frozen=True)
class ChunkRules:
    """How much of a prompt one step may compute (the scheduler's one chunk policy reads these):
    - whole_prompts: each prompt (and a recompute) in one step, past the token budget when it begins the step: a
      hybrid whose stateful layers cannot continue a state over several tokens, or a quantized layer that
      chooses its arithmetic from all of a prompt's tokens (LLM.int8() with outliers);
    - whole_images: a chunk never splits an image whose tokens attend to each other;
    - recompute_at: a sequence reaching this many tokens is computed again whole (Phi-3's LongRoPE switches
      factors there); None: never."""

    whole_prompts: bool = False
    whole_images: bool = False
    recompute_at: int | None = None


@dataclass(frozen=True, slots=True)
class NewRequest:
    """What the runner needs once of a request it holds no row for (SchedulerOutput.new_requests)."""

    req_id: int  # Sequence.seq_id
    token_ids: list[int]  # its prompt, then what it generated so far (a recompute's)
    num_prompt_tokens: int
    adapter: int | None  # its LoRA adapter's id; None: the base model
    images: Any = None  # its images as the processor made them (multimodal.ImageInputs); None: none
    num_computed_tokens: int = 0  # its tokens in the cache already (a cached prefix)

    @classmethod
    def of(cls, seq) -> NewRequest:
        """`seq` as admitted (its cached prefix counted)."""
        return cls(
            seq.seq_id, seq.token_ids, seq.num_prompt_tokens, seq.adapter, seq.images, seq.num_computed_tokens
        )


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's part of a step. What it implies is worked out once, when it is planned (the model runner
    and the engine both read it, every step, for every sequence)."""

    seq: Sequence  # the scheduler's and the engine's: the model runner reads `req_id` and the fields below
    num_new_tokens: int  # tokens computed for it this step: token_ids[start : start + num_new_tokens]
    start: int  # = seq.num_computed_tokens when scheduled (the runner keeps its own count: input_batch.py)
    new_block_ids: NewBlockIds  # what changed in its block tables since the runner last saw them
    # each kind's unit its step reads, in the coordinator's order of managers (KVCacheCoordinator.units_of: a
    # hybrid's state slot); () for a model with pages alone
    units: tuple[int, ...]
    req_id: int = field(init=False)  # seq.seq_id: the runner's row of it
    # whether this step ends at the sequence's last token, so a next token is sampled (or, for a scoring
    # sequence with max_new_tokens 0, the sequence is done)
    samples: bool = field(init=False)
    needs_sample_logits: bool = field(init=False)
    # positions of this step whose logits score the next prompt token and are not scored yet (a recomputed
    # prompt is not scored twice); position p scores prompt token p + 1
    prompt_logprob_positions: range = field(init=False)

    @classmethod
    def decode(cls, seq: Sequence, start: int, units: tuple[int, ...], new_block_ids: NewBlockIds = None):
        """A generated token's decode (one token at `start`, the sequence's last): it samples and scores no
        prompt position, so what __post_init__ works out is known (the scheduler's every-step path)."""
        s = object.__new__(cls)
        s.seq, s.start, s.units, s.req_id = seq, start, units, seq.seq_id
        s.new_block_ids = new_block_ids  # None: its tables did not change since the runner last saw them
        s.num_new_tokens = 1
        s.samples = True
        s.needs_sample_logits = seq.params.max_new_tokens > 0
        s.prompt_logprob_positions = _NONE
        return s

    def __post_init__(self) -> None:
        seq, end = self.seq, self.start + self.num_new_tokens
        self.req_id = seq.seq_id
        self.samples = end == seq.num_tokens
        self.needs_sample_logits = self.samples and seq.params.max_new_tokens > 0
        scored = seq.prompt_logprobs
        self.prompt_logprob_positions = (
            range(0)
            if scored is None
            else range(max(self.start, len(scored) - 1), min(end, seq.num_prompt_tokens - 1))
        )


@dataclass
class SchedulerOutput:
    """The plan for one step; the KV-cache owner applies the copies, the model runner the rest."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)  # admitted: the model runner's new rows
    swap_out: list[PageCopy] = field(default_factory=list)  # accelerator page -> CPU page
    swap_in: list[PageCopy] = field(default_factory=list)  # CPU page -> accelerator page
    copy_on_write: list[PageCopy] = field(default_factory=list)  # accelerator page -> accelerator page
    preempted: list[Sequence] = field(default_factory=list)
    recomputed: list[Sequence] = field(default_factory=list)
    # each manager's copies beside the pages' (cache_spec.UnitCopies: a hybrid's state slots), in the
    # coordinator's order of managers, which is the engine's of their tensors (none for a model with pages alone)
    unit_copies: list[UnitCopies] = field(default_factory=list)
    # what the scheduler counts as it plans, so that the runner, the output processor and the statistics need
    # not pass over `scheduled` to learn it (every step): the tokens computed, the sequences that compute only
    # generated tokens and sample (one logits row each, no prompt token to count or score, no sample to fork),
    # whether a prompt position is scored, and whether a block table changed
    num_batched_tokens: int = 0
    num_generating: int = 0
    scores_prompts: bool = False
    tables_changed: bool = False

    @property
    def num_scheduled(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled

    @property
    def req_ids(self) -> list[int]:
        """The step's sequences' ids, in order."""
        return [s.req_id for s in self.scheduled]

    @property
    def seqs(self) -> list[Sequence]:
        """The step's sequences, in order."""
        return [s.seq for s in self.scheduled]

    def table_changes(self) -> tuple[list[int], list]:
        """The places in the step whose block tables changed, and what changed in each (NewBlockIds)."""
        changed = [(i, s.new_block_ids) for i, s in enumerate(self.scheduled) if s.new_block_ids is not None]
        return [i for i, _ in changed], [new for _, new in changed]


@dataclass
class SampledOutput:
    """What a step's forward gave back, as the output processor sampled it (the one return the scheduler applies,
    `Scheduler.update_from_output`): the sequences that sampled, in order, and their tokens; the samples forked
    from a prompt finished this step (parent, child: each child samples from its parent's row, among `seqs`); the
    scoring sequences (max_new_tokens 0) whose prompt is scored, so done; and the places in `seqs` that end by a
    stop: a grammar's end, or a stop string where EOS does not end them first (the output processor's checks)."""

    seqs: list[Sequence]
    tokens: list[int]
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    scored: list[Sequence] = field(default_factory=list)
    stopped: set[int] = field(default_factory=set)
    num_prompt_tokens: int = 0  # prompt tokens the step computed (recomputed ones included)
