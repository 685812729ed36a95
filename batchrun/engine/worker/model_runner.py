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

from batchrun.engine.attention import (
    AttentionMetadata,
    AttentionServices,
    GroupMetadata,
    StepMetadata,
    int_tensor,
    products_as_generate,
)
from batchrun.engine.core.scheduler_output import SchedulerOutput
from batchrun.engine.model.model_plan import ModelPlan
from batchrun.engine.model.multimodal import EncoderCache
from batchrun.engine.model.ops import decoder_stack, fused_rotary
from batchrun.engine.model.structure import text_config
from batchrun.engine.worker.input_batch import InputBatch
from batchrun.engine.worker.staging import StepStaging


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
        self.unit_tensors = services.unit_tensors  # each cache manager's tensors (a hybrid's StateCache)
        self.times = services.times
        self.services = services  # the backend (make_backend), the KV cache, the layers' specs
        spec = services.kv_cache.spec
        self.page_size = spec.page_size
        self.dtype = spec.dtype
        # per KV cache group: its mask kind, whether its layers add per-token terms and whether any runs the
        # eager reference (GroupMetadata), as the KV groups and the plan hold them
        self.mask_kinds = spec.groups.mask_kinds
        self.token_terms, self.eager = plan.group_calls.token_terms, plan.group_calls.eager
        self.device = services.kv_cache.device
        # each request's token ids, prompt length, adapter, computed count and block tables, kept here
        # (input_batch.py); the engine adds the admitted requests' rows (execute), forks, sampled tokens and
        # finished requests (`sampled`)
        self.batch = InputBatch(
            2 * max_num_seqs, num_groups=spec.groups.num_groups, pin=self.device.type == "cuda"
        )
        self.staging = StepStaging(spec.groups.num_groups, self.device)  # a step's per-token tensors
        # the forward a step calls: the outer forwards' module calls made directly where HF's are a form
        # decoder_stack.py knows (less Python a step), HF's own otherwise
        self.forward = decoder_stack.forward_of(model)

    def prepare(
        self, plan: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | int, list | None]:
        """The step's tensors and metadata, the tokens whose logits are needed as the model's `logits_to_keep`
        takes them (0 for every token: a decode step where each sequence samples, no index, no copy of the
        hidden states; their indices otherwise, none an empty tensor), and for a vision-language model each
        sequence's (req_id, images, start, end) in packed order (None: a text model). Everything comes from the
        runner's batch and the plan's fields: no live Sequence is read here."""
        # every step, for every sequence: kept lean (host time per step, bench/host.py); per-sequence values are
        # numpy arrays over the batch's rows, staged in persistent buffers (staging.py)
        batch, stage = self.batch, self.staging
        rows = batch.rows(plan.req_ids)
        starts = batch.num_computed[rows]  # where each row's step begins
        num_seqs = plan.num_scheduled
        if plan.num_batched_tokens == num_seqs and not plan.scores_prompts:
            # decode-only (the common step): one token per sequence, at its start
            input_ids, positions, token_rows = batch.decode_ids(rows, starts), starts, rows
            query_lens = [1] * num_seqs
            ends = starts + 1
            logits_index = (
                None
                if plan.num_generating == num_seqs  # each samples: every token's logits
                else [i for i, s in enumerate(plan.scheduled) if s.needs_sample_logits]
            )
        else:
            scheduled = plan.scheduled
            pieces, positions, logits_index, products = [], [], [], []
            query_lens = [s.num_new_tokens for s in scheduled]
            for s, row, start in zip(scheduled, rows.tolist(), starts.tolist()):
                end = start + s.num_new_tokens
                if self.generate_products:
                    products += products_as_generate(start, end, batch.num_prompt_tokens[row])
                if s.prompt_logprob_positions:
                    logits_index += [len(positions) + p - start for p in s.prompt_logprob_positions]
                pieces.append(batch.slice_ids(row, start, end))
                positions += range(start, end)
                if s.needs_sample_logits:
                    logits_index.append(len(positions) - 1)
            input_ids, positions = np.concatenate(pieces), np.array(positions, dtype=np.int64)
            token_rows = np.repeat(rows, query_lens)
            ends = starts + query_lens
        dev, P = self.device, self.page_size
        stage.begin()
        context_lens = ends.tolist()
        step = StepMetadata(query_lens, context_lens, stage.positions.put(positions), dev)
        if self.generate_products and not step.decode_only:
            step.generate_products = products
        # the step's tokens by adapter (none: the base model's alone, nothing added)
        if self.lora is not None:
            adapters = batch.adapters
            step.lora = self.lora.step_batch([adapters[r] for r in rows], query_lens, len(positions))
        batch.computed(rows, ends)
        if plan.tables_changed:
            places, news = plan.table_changes()
            batch.block_tables.write(rows[places].tolist(), news)
        tables = batch.block_tables.step_tables(rows)
        page_index = positions // P  # each token's page in its sequence's table
        offsets = stage.slot_offsets.put(positions % P)  # and its place in that page: every group's
        starts = starts.tolist()
        images = self._image_blocks(rows, starts, query_lens)
        groups = [
            GroupMetadata(
                g,
                self.mask_kinds[g],
                P,
                table,
                stage.slot_pages[g].put(batch.block_tables.pages(g, token_rows, page_index)),
                offsets,
                images if images and self.image_blocks.applies(self.mask_kinds[g]) else None,
                self.token_terms[g],
                self.eager[g],
            )
            for g, table in enumerate(tables)
        ]
        views = {  # each manager's step view, keyed by its tensors' class, from its units in packed order
            type(tensors): tensors.step_view([s.units[i] for s in plan.scheduled], query_lens, starts)
            for i, tensors in enumerate(self.unit_tensors)
        }
        rotary = None
        if self.rope is not None:  # LongRoPE, dynamic NTK: each sequence's own factors, from its lengths
            spans = zip(
                batch.num_tokens[rows].tolist(),
                [batch.num_prompt_tokens[r] for r in rows],
                starts,
                query_lens,
            )
            rotary = self.rope.step_embeddings(list(spans), step.positions)
        meta = AttentionMetadata(self.services, step, groups, views, self.dtype, rotary)
        ids = stage.input_ids.put(input_ids)[None]
        stage.end()
        pos = step.positions[None]
        chunks = None
        if self.encoder is not None:  # images: what each sequence computes, for the encoder and 3-D positions
            chunks = [
                (s.req_id, batch.images[r], a, a + n)
                for s, r, a, n in zip(plan.scheduled, rows.tolist(), starts, query_lens)
            ]
            if self.mrope is not None:  # [3, 1, T]
                pos = self.mrope.step_positions(pos[0], chunks)
        if logits_index is None or len(logits_index) == len(input_ids):  # every token's, in order: all kept
            return ids, pos, meta, 0, chunks
        return ids, pos, meta, int_tensor(logits_index, device=dev), chunks

    def _image_blocks(self, rows: list[int], starts: list[int], query_lens: list[int]) -> list | None:
        """Per sequence, the images among the tokens it prefills this step whose tokens see each other; None
        when the model has no such images or this step computes none."""
        if self.image_blocks is None:
            return None
        per_seq, images = [], self.batch.images
        for row, start, n in zip(rows, starts, query_lens):
            end = start + n
            inside = () if n == 1 or images[row] is None else images[row].blocks
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
        with self.times("prepare"):
            ids, pos, meta, logits_to_keep, chunks = self.prepare(plan)
        images = {}
        if self.encoder is not None:
            with self.times("encode"):
                images = self.encoder.step_inputs(chunks)
        # within the forward, the rotary kernel prepare_model installed (fused_rotary.py) computes
        with self.times("forward"), meta.running(), fused_rotary.applied():
            if not isinstance(logits_to_keep, int) and logits_to_keep.numel() == 0 and not images:
                # nothing samples (every sequence is mid-prompt): run the decoder alone for its K/V
                self.forward.decoder(ids, pos, batchrun_attn=meta)
                return torch.empty(0, text_config(self.model.config).vocab_size, device=self.device)
            # a vision-language model merges the image tokens' features itself
            return self.forward.logits(ids, pos, logits_to_keep, batchrun_attn=meta, **images)
