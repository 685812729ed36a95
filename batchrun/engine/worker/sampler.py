"""Next-token sampling (greedy, temperature, top-k, top-p, each row with its own seeded generator) and the
log-probabilities rows ask for.

A row's random draws come only from its own `torch.Generator`, so its completion does not depend on which
rows share its batch.
"""

from __future__ import annotations

import torch

from batchrun.engine import cpu_kernels
from batchrun.engine.core.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits [N, V] (row i belongs to seqs[i]) -> one token id per row."""
    assert logits.dim() == 2 and logits.shape[0] == len(seqs), (logits.shape, len(seqs))
    # as HF generate: greedy ties and sampling decided in fp32 (bf16 models too; widening bf16 is exact)
    tokens = cpu_kernels.argmax_rows(logits).tolist()
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if not random_rows:
        return tokens
    rows = torch.tensor(random_rows, device=logits.device)
    x = logits[rows].float()
    temperature = torch.tensor([seqs[i].params.temperature for i in random_rows], device=x.device)
    x = x / temperature[:, None]
    top_k = [seqs[i].params.top_k for i in random_rows]
    if any(k > 0 for k in top_k):
        k_max = min(max(top_k), x.shape[-1])
        kth = x.topk(k_max, dim=-1).values  # [R, k_max], descending
        k_idx = torch.tensor([(min(k, k_max) if k > 0 else k_max) - 1 for k in top_k], device=x.device)
        threshold = kth.gather(1, k_idx[:, None])
        use = torch.tensor([k > 0 for k in top_k], device=x.device)[:, None]
        x = torch.where(use & (x < threshold), float("-inf"), x)
    top_p = torch.tensor([seqs[i].params.top_p for i in random_rows], device=x.device)
    if (top_p < 1).any():
        sorted_x, order = x.sort(dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_x.softmax(-1)) >= top_p[:, None]  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = x.softmax(dim=-1).cpu()
    for j, i in enumerate(random_rows):
        tokens[i] = int(torch.multinomial(probs[j], 1, generator=seqs[i].generator).item())
    return tokens


def prompt_logprobs(logits: torch.Tensor, targets: list[int]) -> list[float]:
    """logits [N, V] -> log-softmax of row i at targets[i] (the raw logits: no temperature, no mask)."""
    logp = logits.float().log_softmax(dim=-1)
    index = torch.tensor(targets, device=logits.device)[:, None]
    return logp.gather(1, index)[:, 0].tolist()


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], ks: list[int]
) -> list[tuple[int, float, list[int], list[float]]]:
    """For each row: (the chosen token, its logprob, the k most likely tokens, their logprobs), computed from
    the raw logits (before temperature, top-k, top-p and any grammar mask), most likely first."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    k_max = max(ks)
    top_lp, top_ids = logp.topk(k_max, dim=-1) if k_max else (logp[:, :0], logp[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [
        (token, lp, ids[:k], lps[:k]) for token, lp, ids, lps, k in zip(tokens, chosen, top_ids, top_lp, ks)
    ]
