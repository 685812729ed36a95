"""The step loop: schedule, move pages, run the model, then sample and finish sequences (output_processor.py).

`Engine` is the engine's public face: the job runner, the statistics and the Python API add prompts, step,
read queue sizes and memory snapshots, and check integrity through it; nothing outside `engine/` touches the
scheduler or the block manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from batchrun.engine.attention import AttentionLayers, AttentionServices, make_backend
from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.core import memory
from batchrun.engine.core.block_manager import BlockManager
from batchrun.engine.core.kv_coordinator import KVCacheCoordinator
from batchrun.engine.core.memory import MemorySnapshot
from batchrun.engine.core.scheduler import Scheduler
from batchrun.engine.core.scheduler_output import SchedulerOutput
from batchrun.engine.core.sequence import Sequence
from batchrun.engine.core.state_slots import StateSlots
from batchrun.engine.model.loading import LoadedModel
from batchrun.engine.model.model_plan import ModelPlan
from batchrun.engine.model.multimodal import (
    EncoderCache,
    ImageInputs,
    image_feature_bytes,
)
from batchrun.engine.model.sizing import pool_sizes
from batchrun.engine.model.state_cache import StateCache
from batchrun.engine.output_processor import OutputProcessor
from batchrun.engine.timing import PhaseTimes
from batchrun.engine.worker.kv_cache import KVCache
from batchrun.engine.worker.model_runner import ModelRunner
from batchrun.errors import BadInput
from batchrun.vocabulary import token_id_error


@dataclass
class StepResult:
    plan: SchedulerOutput
    finished: list[Sequence] = field(default_factory=list)
    num_generated: int = 0  # tokens sampled this step
    num_prompt_tokens: int = 0  # prompt tokens computed this step (recomputed ones included)
    # for the model runner's input batch: the samples forked (parent id, child id), the tokens sampled (ids, tokens)
    forks: list[tuple[int, int]] = field(default_factory=list)
    sampled: tuple[list[int], list[int]] = ([], [])

    # what the statistics count, so they need not read the plan's lists or the sequences' grammars
    @property
    def num_batched_tokens(self) -> int:
        return self.plan.num_batched_tokens

    @property
    def num_swapped_out_pages(self) -> int:
        return len(self.plan.swap_out)

    @property
    def num_swapped_in_pages(self) -> int:
        return len(self.plan.swap_in)

    @property
    def num_preempted(self) -> int:
        return len(self.plan.preempted)

    @property
    def num_recomputed(self) -> int:
        return len(self.plan.recomputed)

    @property
    def num_finished_prompt_tokens(self) -> int:
        """Prompt tokens of the rows finished this step (each row's first sample: forks share the prompt)."""
        return sum(s.num_prompt_tokens for s in self.finished if s.sample_index == 0)

    @property
    def num_finished_image_rows(self) -> int:
        """Rows finished this step whose prompt held images (each row's first sample)."""
        return sum(1 for s in self.finished if s.sample_index == 0 and s.images is not None)

    @property
    def structured_finished(self) -> tuple[int, int]:
        """Sequences finished this step with a response format, and those of them whose grammar completed."""
        with_grammar = [s.grammar for s in self.finished if s.grammar is not None]
        return len(with_grammar), sum(g.is_terminated() for g in with_grammar)


class Engine:
    """A paged engine over one stock `transformers` model.

    Errors in `config` that only show once the model is known (a KV budget that holds no page) raise
    `BadInput` naming the `engine.*` key; a model whose attention batchrun cannot compute exactly raises
    `UnsupportedModel` (a BadInput) naming the architecture and the reason (architecture.py)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, device: torch.device):
        """`loaded`: the model with its tokenizer, end-of-sequence ids and context limit (loading.py)."""
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.device = device
        self.eos_token_ids = set(loaded.eos_token_ids)
        model = loaded.model
        # everything known of the model, found once (refusing what cannot run exactly, before any page is made)
        plan = ModelPlan.of(model, config.page_size, loaded.max_model_len)
        specs = plan.layer_specs  # each attention layer, fixed from now on
        attention_layers = AttentionLayers(plan.attention.num_heads, plan.kv_spec, specs)
        self.attention = make_backend(config.attention, attention_layers, device)
        self.plan = plan = plan.for_backend(self.attention.capabilities, self.attention.name)
        self.kv_groups = plan.kv_spec.groups
        self.lora = plan.lora  # LoRA adapters (model/lora/layers.py); None: none
        # a vision-language model's image encoder outputs, while prompts with images are prefilled, and their
        # budget: at most a step's tokens' features at once (their bytes come out of the KV budget)
        self.encoder = (
            EncoderCache(model, device, config.max_num_batched_tokens) if plan.images is not None else None
        )
        self.encoder_budget_bytes = (
            self.encoder.max_tokens * image_feature_bytes(model) if self.encoder else 0
        )
        states = plan.attention.states  # what a hybrid's stateful layers keep per sequence (None: none)
        sizes = pool_sizes(
            config,
            plan.kv_spec.bytes_per_page,
            self.kv_groups.num_groups,
            states,
            device,
            reserved_bytes=self.encoder_budget_bytes + (plan.lora.slot_bytes if plan.lora else 0),
        )
        self.num_pages = sizes.num_pages
        self.swap_bytes = sizes.swap_bytes  # unset engine.swap_space: what fit this machine at start
        block_manager = BlockManager(
            self.num_pages,
            config.page_size,
            sizes.num_cpu_pages,
            config.prefix_sharing and plan.shares_prefixes,
            [kind.first_key for kind in self.kv_groups.mask_kinds],
        )
        if plan.rope is not None:  # RoPE factors per sequence: pages rotated alike are shared
            block_manager.prefix_cache.shareable_tokens = plan.rope.shareable_tokens
        # what each sequence holds in the cache: pages, and a hybrid's state slots (a manager and its tensors)
        slots = sizes.states
        managers = (
            (StateSlots(slots.num_slots, slots.num_cpu_slots, slots.num_snapshots, states.bytes_per_slot),)
            if slots
            else ()
        )
        self.kv = KVCacheCoordinator(block_manager, *managers)
        self.scheduler = Scheduler(config, self.kv, plan.chunks, self.encoder)
        if self.admission_error(1, SamplingParams(max_new_tokens=1)):
            raise BadInput(
                f"key `engine.num_pages`: a KV cache of {self.num_pages} pages cannot run even one "
                f"sequence; give it more pages or memory."
            )
        self.kv_cache = KVCache(plan.kv_spec, self.num_pages, sizes.num_cpu_pages, device)
        # each manager's tensors, in the coordinator's order of managers (the plan's `unit_copies`)
        self.unit_tensors = (
            (StateCache(states, slots.num_slots + slots.num_snapshots, slots.num_cpu_slots, device),)
            if slots
            else ()
        )
        self.times = PhaseTimes()  # where the steps' time went (timing.py)
        services = AttentionServices(
            self.attention,
            self.kv_cache,
            self.times,
            specs=specs,
            layers=plan.attention.layers,
            unit_tensors=self.unit_tensors,
            encoder=self.encoder,
        )
        self.runner = ModelRunner(model, plan, services, config.max_num_seqs)
        self.outputs = OutputProcessor(self.tokenizer, plan.vocab_size, self.eos_token_ids)

    # ---- requests -------------------------------------------------------------------------------------------
    def prompt_error(
        self, token_ids: list[int], params: SamplingParams, images: ImageInputs | None = None
    ) -> str | None:
        """Why a tokenized prompt (from text, a conversation or given ids) can never run here, or None: a token
        id its embedding has no row for (vocabulary.py), then admission_error. Every prompt is checked here
        before it is added, by the job's worker and the Python API alike."""
        placeholder = self.plan.image_token_id if images is not None else None
        return token_id_error(token_ids, self.plan.embedding_rows, placeholder) or self.admission_error(
            len(token_ids), params, images
        )

    def admission_error(
        self, num_prompt_tokens: int, params: SamplingParams, images: ImageInputs | None = None
    ) -> str | None:
        """Why a prompt can never run here, or None: too long, a response format that does not compile, more
        pages than exist. Checked before a row enters the queue, so no row waits forever for pages that do not
        exist. `images`: the prompt's (an image computed whole may make a longer step)."""
        limit = self.plan.max_model_len
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
        units = self.kv.admission_error(
            params.n
        )  # a manager's (a hybrid's state slots: each sample holds one)
        if units:
            return units
        total = min(num_prompt_tokens + params.max_new_tokens, limit)
        # the most pages it holds at once, in every KV cache group (a windowed group only what its window reads)
        pages = self.kv.pages_to_run(
            num_prompt_tokens, total, self.scheduler.max_chunk_of(images) or num_prompt_tokens
        )
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
        images: ImageInputs | None = None,
        adapter: str | None = None,
    ) -> Sequence:
        """Queue a prompt; with params.n > 1 the other samples are forked once the prompt is prefilled.
        `seeds[i]` seeds sample i's generator (sampled rows only). `images`: the prompt's images, as the model's
        processor made them (its image tokens are in the prompt); ValueError where this model takes none.
        `adapter`: the name of the LoRA adapter it runs with (None: the base model); ValueError for a name the
        engine was not given."""
        adapter_id = self.adapter_id(adapter)
        idle = not self.scheduler.has_unfinished()
        seq = self.outputs.new_sequence(list(prompt_token_ids), params, request, seeds, idle)
        seq.adapter = adapter_id
        seq.reserved_tokens = min(len(seq.prompt_token_ids) + params.max_new_tokens, self.plan.max_model_len)
        if images is not None and images.num_images:
            if self.plan.images is None:
                raise ValueError(f"this model takes no images here: {self.plan.images_refusal}")
            if self.plan.images.positions is not None:
                images.rope_positions, images.rope_delta = self.plan.images.positions.prompt_positions(
                    prompt_token_ids, images
                )
            seq.images = images
        self.scheduler.add(seq)
        return seq

    def adapter_id(self, name: str | None) -> int | None:
        """The id of LoRA adapter `name` (None: the base model); ValueError naming the adapters there are."""
        if name is None:
            return None
        if self.lora is None:
            raise ValueError(f"adapter {name!r}: this engine was given no LoRA adapters")
        return self.lora.id_of(name)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_all(self) -> None:
        """Drop every queued, running and swapped request and free its pages (and image features)."""
        self.scheduler.abort_all()
        self.runner.batch.clear()
        if self.encoder is not None:
            self.encoder.clear()

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        with self.times("schedule"):
            plan = self.scheduler.schedule()
            self.kv_cache.apply(plan.swap_out, plan.swap_in, plan.copy_on_write)
            for tensors, copies in zip(self.unit_tensors, plan.unit_copies):  # the managers' order, both
                tensors.apply(copies)
            if self.encoder is not None:  # a preempted prompt encodes its images again when it resumes
                self.encoder.release(plan.preempted)
        result = StepResult(plan)
        if plan.is_empty:
            if self.scheduler.has_unfinished() and not plan.preempted:
                raise RuntimeError(
                    "scheduler made no progress: nothing is running and nothing can be admitted"
                )
            return result
        logits = self.runner.execute(plan)
        with self.times("sample"):  # scoring, samples forked, grammar masks, sampling, logprobs, stops
            sampled = self.outputs.sample(plan, logits)
        with self.times("finish"):  # the one place the step changes its requests; the runner's rows follow
            result.finished = self.scheduler.update_from_output(plan, sampled)
            result.forks = [(parent.seq_id, child.seq_id) for parent, child in sampled.forks]
            result.sampled = ([seq.seq_id for seq in sampled.seqs], sampled.tokens)
            result.num_generated, result.num_prompt_tokens = len(sampled.tokens), sampled.num_prompt_tokens
            self.runner.sampled(result.forks, *result.sampled, result.finished)
        return result

    # ---- text and grammars ---------------------------------------------------------------------------------
    def completion_text(self, seq: Sequence) -> str:
        """The decoded completion; a stop string and what follows it are cut off."""
        return self.outputs.completion_text(seq)

    @property
    def grammars(self):
        """The grammar compiler and cache (structured.Grammars), made on first use."""
        return self.outputs.grammars

    def grammar_times(self) -> tuple[float, float]:
        """Seconds spent compiling grammars and masking logits so far."""
        return self.outputs.grammar_times()

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
        return self.kv.num_used_pages

    @property
    def block_manager(self) -> BlockManager:
        """The coordinator's pages (its counters: prefix-cache hits, copies on write, pages freed by windows)."""
        return self.kv.bm

    def unit_bytes(self) -> dict[str, int]:
        """Each manager's bytes per unit for the run's summary, by its key (a hybrid's bytes_per_state_slot)."""
        return self.kv.unit_bytes()

    def image_counts(self) -> dict[str, int]:
        """Images encoded (each distinct image of a step once), image tokens computed, the most image-feature
        bytes held at once and the budget for them, for the summary (the encoder's seconds are the `encode`
        phase); zeros for a text model."""
        encoder = self.encoder
        return {
            "images_encoded": encoder.images_encoded if encoder else 0,
            "image_tokens": encoder.image_tokens if encoder else 0,
            "encoder_peak_bytes": encoder.peak_bytes if encoder else 0,
            "encoder_budget_bytes": self.encoder_budget_bytes,
        }

    def running_sequences(self) -> dict[Sequence, None]:
        """Sequences holding accelerator pages, in admission order (the scheduler's own: read, do not modify)."""
        return self.scheduler.running

    def live_sequences(self) -> list[Sequence]:
        """Sequences holding pages: running ones (accelerator pages) and swapped ones (CPU pages)."""
        return self.scheduler.live_sequences()

    def reservation(self, seq: Sequence) -> int:
        """The KV slots a contiguous allocator reserving prompt + max_new_tokens would hold for `seq` (in every
        KV cache group: a slot is one token of one group's layers)."""
        return self.reserved_slots((seq,))

    def reserved_slots(self, seqs) -> int:
        """`reservation` summed over `seqs` (the recount asks it of every running sequence; a step's count reads
        the scheduler's running sum instead)."""
        return sum([s.reserved_tokens for s in seqs]) * self.kv_groups.num_groups

    def memory_snapshot(self, recount: bool = False) -> MemorySnapshot:
        """What the KV cache holds now, from the block tables; `recount`: slot by slot, to check the first."""
        scheduler = self.scheduler
        running = scheduler.running
        if recount:  # from the sequences themselves, not the scheduler's running sums
            return memory.recount(self.kv, running, self.num_waiting, self.num_swapped, self.reserved_slots)
        return memory.count(
            self.kv,
            running,
            self.num_waiting,
            self.num_swapped,
            scheduler.running_reserved_tokens * self.kv_groups.num_groups,
            scheduler.running_computed_tokens,
        )

    def check_integrity(self) -> None:
        """Page and state-slot bookkeeping agrees with every live sequence, the runner's persistent block
        tables with the block manager's, its input batch's rows and the scheduler's columns with the sequences
        (AssertionError otherwise)."""
        running, rows = self.scheduler.running, self.scheduler.rows
        self.kv.check_integrity(running, self.scheduler.swapped)
        self.runner.batch.check(self.scheduler.live_sequences(), self.kv.bm.sequences)
        if rows is not None:  # the columns the scheduler plans over (running_rows.py)
            rows.check(running, self.kv.bm, self.kv.units_of)
