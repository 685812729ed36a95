"""One sequence being generated: its token ids, sampling state and counters. The resources it holds are kept
by their managers, keyed by `seq_id`: its pages and page hashes by the block manager (block_manager.py), its
state slots by state_slots.py (the scheduler reaches both through kv_coordinator.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchrun.engine.config import SamplingParams

NULL_PAGE = -1  # a block-table entry whose page was given back: behind its group's window, never read again


@dataclass(eq=False, slots=True)
class Sequence:
    """A prompt and what has been generated for it.

    `num_computed_tokens` counts tokens whose K/V is in the cache (prefix-cache hits included); the tokens
    `token_ids[num_computed_tokens:]` are what the next forward passes must compute. The block manager sets it
    when the sequence is admitted (its cached prefix) or forked (its parent's), the scheduler after each step
    (`Scheduler.update_from_output`) and for a sequence preempted by recompute, which goes back to 0 and computes
    prompt + generated tokens again as one longer prompt.
    """

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    request: Any = None  # the job's handle for the row this sequence answers
    sample_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)  # the tokens generated so far
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_siblings_to_fork: int = 0  # n - 1 until the prompt is prefilled; then the samples are forked
    sibling_seeds: list[int] = field(default_factory=list)  # the generator seed of each sample 0 .. n-1
    finish_reason: str | None = None
    generator: Any = None  # torch.Generator for sampled rows
    # with params.logprobs: one (token_id, logprob, top token ids, top logprobs) per generated token
    logprobs: list[tuple[int, float, list[int], list[float]]] | None = None
    # with params.prompt_logprobs: log p(prompt token i | tokens before it); None for the first token
    prompt_logprobs: list[float | None] | None = None
    grammar: Any = None  # with params.response_format: this sequence's grammar matcher (engine/structured.py)
    images: Any = None  # multimodal.ImageInputs of a prompt with images; None: text alone
    adapter: int | None = None  # its LoRA adapter's id (model/lora/layers.py); None: the base model
    eos_token_ids: frozenset[int] = (
        frozenset()
    )  # the tokens that end it: the model's, none where it ignores EOS
    # prompt + max_new_tokens within the context limit: the most tokens it may reach, where it finishes by length
    # (the output processor's check) and what a contiguous reservation would hold for it (the statistics sum it
    # over the running sequences every step); set where the engine makes it
    reserved_tokens: int = 0

    @property
    def cache_salt(self) -> bytes | None:
        """What the prefix cache's hash chain starts from: a page computed under one adapter holds other K/V than
        the same tokens under another (or under the base model), so the adapter is part of every page's key."""
        return None if self.adapter is None else b"lora:%d" % self.adapter

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def cache_key_tokens(self) -> list[int]:
        """The tokens as the prefix cache keys them: token_ids, but each image token keyed by the images
        (multimodal.ImageInputs.key_tokens)."""
        if self.images is None:
            return self.token_ids
        return self.images.key_tokens + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens
