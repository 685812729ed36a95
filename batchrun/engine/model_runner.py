"""Turns a scheduler plan into tensors, runs the stock `transformers` model on them, returns logits.

One step = one packed row of every scheduled token: `input_ids` and `position_ids` [1, T], the slot mapping
(where each token's K/V goes), the attention backend's metadata (built once here, before the forward, and
shared by every layer), and the indices of the tokens whose logits are needed (the last token of each sequence
that samples this step, and the prompt positions of sequences that asked for prompt logprobs).
"""

from __future__ import annotations

import torch

from .attention import AttentionMetadata, StepLayout
from .kv_cache import KVCache
from .scheduler import ScheduledSequence
from .timing import PhaseTimes


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, kv_cache: KVCache, backend, device: torch.device, times: PhaseTimes
    ):
        self.model = model
        self.times = times
        self.kv_cache = kv_cache
        self.page_size = kv_cache.shape.page_size
        self.backend = backend  # attention.TorchAttention | GatherAttention | TritonAttention: make_backend
        self.device = device

    def prepare(
        self, scheduled: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        P = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, tables, logits_index = [], [], [], []
        for s in scheduled:
            seq, start, end = s.seq, s.start, s.start + s.num_new_tokens
            logits_index += [len(input_ids) + p - start for p in s.prompt_logprob_positions]
            input_ids += seq.token_slice(start, end)
            positions += range(start, end)
            bt = seq.block_table
            slots += [bt[p // P] * P + p % P for p in range(start, end)]
            query_lens.append(s.num_new_tokens)
            context_lens.append(end)
            tables.append(bt)
            if s.needs_sample_logits:
                logits_index.append(len(input_ids) - 1)
        dev = self.device
        layout = StepLayout(
            query_lens, context_lens, tables, torch.tensor(slots, dtype=torch.long, device=dev)
        )
        meta = AttentionMetadata(
            times=self.times,
            backend=self.backend,
            kv_cache=self.kv_cache,
            slot_mapping=layout.slot_mapping,
            max_seq_len=max(context_lens),
            plan=self.backend.prepare(layout),
        )
        ids = torch.tensor([input_ids], dtype=torch.long, device=dev)
        pos = torch.tensor([positions], dtype=torch.long, device=dev)
        return ids, pos, meta, torch.tensor(logits_index, dtype=torch.long, device=dev)

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
