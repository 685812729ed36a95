"""sentence-transformers' modules after the Transformer, as a pooling job computes them: Pooling (`pool`), then
the checkpoint's Dense and Normalize modules and Matryoshka truncation (`after_pooling`).

They compute in fp32 whatever the model's dtype: a bf16 model's token states are upcast as they are pooled (a mean
of hundreds of bf16 vectors summed in bf16 would lose the digits a bf16 model's states still have), and the Dense
layers are loaded in fp32 (one small product per text, next to the model's). For an fp32 model this is the
computation it always was: the states are already fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.engine.pooling.sentence_config import DenseLayer
from batchrun.errors import BadInput


def pool(hidden: torch.Tensor, modes: tuple[str, ...], prompt_tokens: int) -> torch.Tensor:
    """One text's fp32 vector from its token states [n, H] (of any float dtype), as sentence-transformers'
    Pooling computes it for that text alone: each mode over the tokens after the first `prompt_tokens` (0: every
    token), concatenated."""
    n = hidden.shape[0]
    first = prompt_tokens if prompt_tokens < n else n  # a text of prompt alone pools nothing (as theirs)
    kept = hidden[first:]
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(hidden[first if first < n else 0].float())
        elif mode == "lasttoken":
            out.append(hidden[n - 1].float())
        elif mode == "max":
            out.append(
                kept.max(dim=0).values.float()
                if len(kept)
                else torch.full_like(hidden[0], float("-inf"), dtype=torch.float32)
            )
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            count = torch.tensor(float(len(kept)), dtype=torch.float32).clamp(min=1e-9)
            total = kept.sum(dim=0, dtype=torch.float32)
            out.append(total / (count if mode == "mean" else count.sqrt()))
        elif mode == "weightedmean":
            weights = torch.arange(first + 1, n + 1, dtype=torch.float32, device=hidden.device)[:, None]
            total = (kept.float() * weights).sum(dim=0)
            out.append(total / weights.sum().clamp(min=1e-9))
        else:  # PoolingPlan's modes are checked against sentence_config.POOLING_MODES
            raise ValueError(f"pooling mode {mode!r}")
    return torch.cat(out)


def after_pooling(
    x: torch.Tensor, dense: list, dimensions: int | None, normalize_output: bool
) -> torch.Tensor:
    """The pooled vectors [n, D] (fp32) through the checkpoint's Dense and Normalize modules in their order
    (`dense`: `load_modules`' list), then the first `dimensions` components, then normalised where asked."""
    for module in dense:
        x = F.normalize(x, p=2, dim=-1) if module == "normalize" else module(x)
    if dimensions is not None:
        x = x[:, :dimensions]
    if normalize_output:
        x = F.normalize(x, p=2, dim=-1)
    return x


class _Dense(torch.nn.Module):
    """sentence-transformers' Dense: a linear layer, then its activation."""

    def __init__(self, layer: DenseLayer):
        super().__init__()
        self.linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias)
        self.activation = torch.tanh if layer.activation == "tanh" else (lambda x: x)

    def forward(self, x):
        return self.activation(self.linear(x))


def load_modules(after: tuple, device: torch.device) -> list:
    """The plan's modules after pooling (`PoolingPlan.after`): each Dense layer loaded in fp32, "normalize" as
    it is."""
    return [_load_dense(m, device) if isinstance(m, DenseLayer) else m for m in after]


def _load_dense(layer: DenseLayer, device) -> _Dense:
    module = _Dense(layer)
    weights = layer.folder / "model.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file

        state = load_file(str(weights))
    elif (layer.folder / "pytorch_model.bin").is_file():
        state = torch.load(layer.folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise BadInput(f"model.path: the Dense module in {layer.folder} has no weights (model.safetensors)")
    try:
        module.linear.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()})
    except RuntimeError as e:
        raise BadInput(f"model.path: the Dense module in {layer.folder}: {e}") from None
    return module.to(device=device, dtype=torch.float32).eval()
