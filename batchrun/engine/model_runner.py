"""Turns a scheduler plan into tensors, runs the stock `transformers` model on them, returns logits.

One step = one packed row of every scheduled token: `input_ids` and `position_ids` [1, T], the slot mapping of
each KV cache group (where each token's K/V goes in that group's pages), the attention backend's metadata (built once here, before the forward, and
shared by every layer), and the indices of the tokens whose logits are needed (the last token of each sequence
that samples this step, and the prompt positions of sequences that asked for prompt logprobs).
"""

from __future__ import annotations

import torch

from .attention import AttentionMetadata, AttentionServices, StepLayout, int_tensor
from .kv_cache import text_config
from .multimodal import EncoderCache, ImageBlocks, MRope
from .scheduler import ScheduledSequence
from .state_cache import StateCache, StepStates
from .timing import PhaseTimes


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        services: AttentionServices,
        device: torch.device,
        times: PhaseTimes,
        state_cache: StateCache | None = None,
        encoder: EncoderCache | None = None,
        mrope: MRope | None = None,
        image_blocks: ImageBlocks | None = None,
    ):
        self.model = model
        self.mrope = mrope  # a model with 3-D rotary positions (Qwen-VL); None: 1-D positions
        self.image_blocks = image_blocks  # Gemma's bidirectional image attention; None: images are causal
        self.encoder = encoder  # a vision-language model's image features (multimodal.py); None: text only
        self.state_cache = state_cache  # a hybrid model's state slots; None: no stateful layers
        self.times = times
        self.services = services  # the backend (make_backend), the KV cache, the per-layer facts
        self.page_size = services.kv_cache.spec.page_size
        self.num_groups = services.kv_cache.spec.groups.num_groups
        self.device = device

    def prepare(
        self, scheduled: list[ScheduledSequence], chunks: list | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's tensors and metadata; `chunks`: each sequence's (sequence, start, end), for a
        vision-language model (execute makes them once)."""
        P = self.page_size
        num_groups = self.num_groups
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(num_groups)]  # per KV cache group
        tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
        query_lens, context_lens, logits_index = [], [], []
        # every step, for every sequence: kept lean (host time per step, bench/vs_vllm.py)
        for s in scheduled:
            seq, start, n = s.seq, s.start, s.num_new_tokens
            end = start + n
            if s.prompt_logprob_positions:
                logits_index += [len(input_ids) + p - start for p in s.prompt_logprob_positions]
            if n == 1:  # a decode
                input_ids.append(seq.token_at(start))
                positions.append(start)
                for g, bt in enumerate(seq.block_tables):
                    slots[g].append(bt[start // P] * P + start % P)
                    tables[g].append(bt)
            else:
                input_ids += seq.token_slice(start, end)
                positions += range(start, end)
                for g, bt in enumerate(seq.block_tables):
                    slots[g] += [bt[p // P] * P + p % P for p in range(start, end)]
                    tables[g].append(bt)
            query_lens.append(n)
            context_lens.append(end)
            if s.needs_sample_logits:
                logits_index.append(len(input_ids) - 1)
        dev = self.device
        images = self._image_blocks(scheduled)
        kinds = self.services.kv_cache.spec.groups.kinds
        layouts = [
            StepLayout(
                query_lens,
                context_lens,
                tables[g],
                int_tensor(slots[g], device=dev),
                P,
                images if images and self.image_blocks.applies(kinds[g]) else None,
            )
            for g in range(num_groups)
        ]
        states = None
        if self.state_cache is not None:
            slots = [s.seq.state_slot for s in scheduled]
            states = StepStates(self.state_cache, slots, query_lens, [s.start for s in scheduled])
        meta = AttentionMetadata(self.services, layouts, positions, states)
        ids = int_tensor(input_ids, device=dev)[None]
        pos = int_tensor(positions, device=dev)[None]
        if self.mrope is not None:  # [3, 1, T]
            pos = self.mrope.step_positions(pos[0], chunks)
        return ids, pos, meta, int_tensor(logits_index, device=dev)

    def _image_blocks(self, scheduled: list[ScheduledSequence]) -> list[list[tuple[int, int]]] | None:
        """Per sequence, the images among the tokens it prefills this step whose tokens see each other; None
        when the model has no such images or this step computes none."""
        if self.image_blocks is None:
            return None
        per_seq = []
        for s in scheduled:
            images, start, end = s.seq.images, s.start, s.start + s.num_new_tokens
            inside = [] if images is None or s.num_new_tokens == 1 else images.blocks
            per_seq.append([(a, b) for a, b in inside if a < end and b > start])
        return per_seq if any(per_seq) else None

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Run one step; returns logits [rows, vocab] in `scheduled` order: for each sequence, its prompt-logprob
        positions (ScheduledSequence.prompt_logprob_positions), then its sampling position if it samples."""
        chunks = None
        if self.encoder is not None:  # images: what each sequence computes, for the encoder and 3-D positions
            chunks = [(s.seq, s.start, s.start + s.num_new_tokens) for s in scheduled]
        with self.times("prepare"):
            ids, pos, meta, logits_index = self.prepare(scheduled, chunks)
        images = {}
        if self.encoder is not None:
            with self.times("encode"):
                images = self.encoder.step_inputs(chunks)
        with self.times("forward"), meta.running():
            if logits_index.numel() == 0 and not images:
                # nothing samples (every sequence is mid-prompt): run the decoder alone for its K/V
                self.model.get_decoder()(input_ids=ids, position_ids=pos, use_cache=False, batchrun_attn=meta)
                return torch.empty(0, text_config(self.model.config).vocab_size, device=self.device)
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                use_cache=False,
                logits_to_keep=logits_index,
                batchrun_attn=meta,
                **images,  # the model merges the image tokens' features itself
            )
            return out.logits[0]
