"""Turns a scheduler plan into tensors, runs the stock `transformers` model on them, returns logits.

One step = one packed row of every scheduled token: `input_ids` and `position_ids` [1, T], and the step's
attention metadata, built here before the forward and shared by every layer (attention/metadata.py): what the
KV cache groups share once (query and context lengths, positions), then each group's block tables (from the
persistent rows of block_table_buffer.py) and its slots (the page each token's K/V goes to in that group, and
the token's place in its page, which every group shares), then each group's backend plan. Also the tokens
whose logits are needed (the last token of each sequence that samples this step, and the prompt positions of
sequences that asked for prompt logprobs).
"""

from __future__ import annotations

import numpy as np
import torch

from .attention import (
    AttentionMetadata,
    AttentionServices,
    GroupMetadata,
    StepMetadata,
    int_tensor,
    products_as_generate,
)
from .block_table_buffer import BlockTableBuffer, slot_pages
from .input_batch import InputBatch
from .kv_cache import text_config
from .model_plan import ModelPlan
from .multimodal import EncoderCache
from .scheduler import ScheduledSequence, SchedulerOutput
from .state_cache import StateCache, StepStates


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        plan: ModelPlan,
        services: AttentionServices,
        max_num_seqs: int,
    ):
        """`plan`: the model plan (its rope, image rules); `services`: the backend, the caches a step reads and
        writes (KV pages, a hybrid model's state slots, a vision-language model's image features), the clock and
        the layers' specs; `max_num_seqs`: the most sequences a step runs (the block tables' rows)."""
        self.model = model
        self.rope = plan.rope  # RoPE factors per sequence (LongRoPE, dynamic NTK); None: the model's own
        self.generate_products = plan.generate_products  # quantized layers that compute each sequence apart
        self.lora = plan.lora  # LoRA adapters (None: none)
        images = plan.images
        self.mrope = images and images.positions  # 3-D rotary positions (Qwen-VL); None: 1-D positions
        self.image_blocks = images and images.blocks  # Gemma's bidirectional image attention; None: causal
        self.encoder: EncoderCache | None = services.encoder
        self.state_cache: StateCache | None = services.state_cache
        self.times = services.times
        self.services = services  # the backend (make_backend), the KV cache, the layers' specs
        spec = services.kv_cache.spec
        self.page_size = spec.page_size
        self.dtype = spec.dtype
        # per KV cache group: its layers' mask kind, whether they add per-token terms (their prompts then
        # need each query's row and position), and whether any runs the eager reference (GroupMetadata.eager)
        self.kinds, self.token_terms, self.eager = [], [], []
        for g in range(spec.groups.num_groups):
            members = [s for s in services.specs if s is not None and s.group == g]
            (kind,) = {s.kind for s in members}  # one kind a group (KVGroups)
            self.kinds.append(kind)
            self.token_terms.append(any(s.token_terms for s in members))
            self.eager.append(any(s.token_terms or not s.call.plain for s in members))
        self.device = services.kv_cache.device
        self.block_tables = BlockTableBuffer(
            spec.groups.num_groups, 2 * max_num_seqs, pin=self.device.type == "cuda"
        )
        # each request's token ids, prompt length and adapter, kept here (input_batch.py); the engine adds the
        # admitted requests' rows (execute), forks, sampled tokens and finished requests (`sampled`)
        self.batch = InputBatch(2 * max_num_seqs)

    def prepare(
        self, scheduled: list[ScheduledSequence], chunks: list | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | int]:
        """The step's tensors and metadata, and the tokens whose logits are needed as the model's
        `logits_to_keep` takes them: 0 for every token (a decode step where each sequence samples: no index, no
        copy of the hidden states), their indices otherwise (none: an empty tensor). `chunks`: each sequence's
        (sequence, start, end), for a vision-language model (execute makes them once)."""
        # every step, for every sequence: kept lean (host time per step, bench/host.py)
        starts = [s.start for s in scheduled]
        batch = self.batch
        rows = batch.rows([s.seq.seq_id for s in scheduled])
        if sum([s.num_new_tokens for s in scheduled]) == len(scheduled) and not any(
            [s.prompt_logprob_positions for s in scheduled]
        ):  # decode-only (the common step): one token per sequence, at its start
            input_ids = batch.decode_ids(rows, starts)
            positions = starts
            query_lens = [1] * len(scheduled)
            context_lens = [p + 1 for p in starts]
            logits_index = [i for i, s in enumerate(scheduled) if s.needs_sample_logits]
        else:
            pieces, positions, logits_index, products = [], [], [], []
            query_lens = [s.num_new_tokens for s in scheduled]
            context_lens = [p + n for p, n in zip(starts, query_lens)]
            for s, row, start, end in zip(scheduled, rows, starts, context_lens):
                if self.generate_products:
                    products += products_as_generate(start, end, batch.num_prompt_tokens[row])
                if s.prompt_logprob_positions:
                    logits_index += [len(positions) + p - start for p in s.prompt_logprob_positions]
                pieces.append(batch.slice_ids(row, start, end))
                positions += range(start, end)
                if s.needs_sample_logits:
                    logits_index.append(len(positions) - 1)
            input_ids = np.concatenate(pieces)
        dev, P = self.device, self.page_size
        host_positions = int_tensor(positions)
        page_index = host_positions // P  # each token's page in its sequence's table
        offsets = (host_positions % P).to(dev)  # and its place in that page: every group's
        step = StepMetadata(query_lens, context_lens, host_positions.to(dev), dev)
        if self.generate_products and not step.decode_only:
            step.generate_products = products
        if (
            self.lora is not None
        ):  # the step's tokens by adapter (none: the base model's alone, nothing added)
            adapters = batch.adapters
            step.lora = self.lora.step_batch([adapters[r] for r in rows], query_lens, len(positions))
        tables = self.block_tables.step_tables(scheduled)
        if step.decode_only:  # token i is sequence i's
            token_seq = step.decode_index  # 0..S-1
        else:
            token_seq = torch.repeat_interleave(torch.arange(len(scheduled)), int_tensor(query_lens))
        images = self._image_blocks(scheduled, rows)
        groups = [
            GroupMetadata(
                g,
                self.kinds[g],
                P,
                table,
                slot_pages(table, token_seq, page_index).to(dev),
                offsets,
                images if images and self.image_blocks.applies(self.kinds[g]) else None,
                self.token_terms[g],
                self.eager[g],
            )
            for g, table in enumerate(tables)
        ]
        states = None
        if self.state_cache is not None:
            slots = [s.state_slot for s in scheduled]
            states = StepStates(self.state_cache, slots, query_lens, [s.start for s in scheduled])
        rotary = None
        if self.rope is not None:  # LongRoPE, dynamic NTK: each sequence's own factors
            rotary = self.rope.step_embeddings(scheduled, step.positions)
        meta = AttentionMetadata(self.services, step, groups, states, self.dtype, rotary)
        ids = torch.from_numpy(input_ids).to(dev)[None]
        pos = step.positions[None]
        if self.mrope is not None:  # [3, 1, T]
            pos = self.mrope.step_positions(pos[0], chunks)
        if len(logits_index) == len(input_ids):  # every token's, in order: the model keeps them all
            return ids, pos, meta, 0
        return ids, pos, meta, int_tensor(logits_index, device=dev)

    def _image_blocks(self, scheduled: list[ScheduledSequence], rows: list[int]) -> list | None:
        """Per sequence, the images among the tokens it prefills this step whose tokens see each other; None
        when the model has no such images or this step computes none."""
        if self.image_blocks is None:
            return None
        per_seq, blocks = [], self.batch.image_blocks
        for s, row in zip(scheduled, rows):
            start, end = s.start, s.start + s.num_new_tokens
            inside = () if s.num_new_tokens == 1 else blocks[row]
            per_seq.append([(a, b) for a, b in inside if a < end and b > start])
        return per_seq if any(per_seq) else None

    def sampled(self, forks: list[tuple[int, int]], req_ids: list[int], tokens: list[int], finished) -> None:
        """After a step: its forked samples' rows (parent, child ids), its sampled tokens onto their rows, and
        the rows of its finished requests back."""
        batch = self.batch
        for parent, child in forks:
            batch.fork(parent, child)
        batch.append(req_ids, tokens)
        batch.remove([seq.seq_id for seq in finished])

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> torch.Tensor:
        """Run one step (the admitted requests' rows added first); returns logits [rows, vocab] in
        `plan.scheduled` order: for each sequence, its prompt-logprob positions
        (ScheduledSequence.prompt_logprob_positions), then its sampling position if it samples."""
        self.batch.add(plan.new_requests)
        scheduled = plan.scheduled
        chunks = None
        if self.encoder is not None:  # images: what each sequence computes, for the encoder and 3-D positions
            chunks = [(s.seq, s.start, s.start + s.num_new_tokens) for s in scheduled]
        with self.times("prepare"):
            ids, pos, meta, logits_to_keep = self.prepare(scheduled, chunks)
        images = {}
        if self.encoder is not None:
            with self.times("encode"):
                images = self.encoder.step_inputs(chunks)
        with self.times("forward"), meta.running():
            if not isinstance(logits_to_keep, int) and logits_to_keep.numel() == 0 and not images:
                # nothing samples (every sequence is mid-prompt): run the decoder alone for its K/V
                self.model.get_decoder()(input_ids=ids, position_ids=pos, use_cache=False, batchrun_attn=meta)
                return torch.empty(0, text_config(self.model.config).vocab_size, device=self.device)
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                use_cache=False,
                logits_to_keep=logits_to_keep,
                batchrun_attn=meta,
                **images,  # the model merges the image tokens' features itself
            )
            return out.logits[0]
