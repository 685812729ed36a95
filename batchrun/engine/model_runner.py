"""Turns a scheduler plan into tensors, runs the stock `transformers` model on them, returns logits.

One step = one packed row of every scheduled token: `input_ids` and `position_ids` [1, T], the slot mapping
(where each token's K/V goes), the attention backend's metadata (built once here, before the forward, and
shared by every layer), and the indices of the tokens whose logits are needed (the last token of each sequence
that samples this step, and the prompt positions of sequences that asked for prompt logprobs).
"""

from __future__ import annotations

import torch

from .attention import AttentionMetadata, AttentionServices, StepLayout, int_tensor
from .scheduler import ScheduledSequence
from .timing import PhaseTimes


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, services: AttentionServices, device: torch.device, times: PhaseTimes
    ):
        self.model = model
        self.times = times
        self.services = services  # the backend (make_backend), the KV cache, the per-layer facts
        self.page_size = services.kv_cache.shape.page_size
        self.device = device

    def prepare(
        self, scheduled: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        P = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, tables, logits_index = [], [], [], []
        for s in scheduled:  # every step, for every sequence: kept lean (host time per step, bench/speed.py)
            seq, start, n = s.seq, s.start, s.num_new_tokens
            end = start + n
            bt = seq.block_table
            if s.prompt_logprob_positions:
                logits_index += [len(input_ids) + p - start for p in s.prompt_logprob_positions]
            if n == 1:  # a decode
                input_ids.append(seq.token_at(start))
                positions.append(start)
                slots.append(bt[start // P] * P + start % P)
            else:
                input_ids += seq.token_slice(start, end)
                positions += range(start, end)
                slots += [bt[p // P] * P + p % P for p in range(start, end)]
            query_lens.append(n)
            context_lens.append(end)
            tables.append(bt)
            if s.needs_sample_logits:
                logits_index.append(len(input_ids) - 1)
        dev = self.device
        layout = StepLayout(query_lens, context_lens, tables, int_tensor(slots, device=dev))
        meta = AttentionMetadata(self.services, layout, positions)
        ids = int_tensor(input_ids, device=dev)[None]
        pos = int_tensor(positions, device=dev)[None]
        return ids, pos, meta, int_tensor(logits_index, device=dev)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Run one step; returns logits [rows, vocab] in `scheduled` order: for each sequence, its prompt-logprob
        positions (ScheduledSequence.prompt_logprob_positions), then its sampling position if it samples."""
        with self.times("prepare"):
            ids, pos, meta, logits_index = self.prepare(scheduled)
        with self.times("forward"):
            if logits_index.numel() == 0:
                # nothing samples (every sequence is mid-prompt): run the decoder alone for its K/V
                self.model.get_decoder()(input_ids=ids, position_ids=pos, use_cache=False, batchrun_attn=meta)
                return torch.empty(0, self.model.config.vocab_size, device=self.device)
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                use_cache=False,
                logits_to_keep=logits_index,
                batchrun_attn=meta,
            )
            return out.logits[0]
