"""LoRA adapters: many fine-tunes of one base model in one packed step.

Each adapter is read once at load (its `adapter_config.json` by config.py here, its weights by weights.py,
which checks them against the model). Each layer an adapter targets becomes a `LoRALinear` around the layer as
it was (later packed for oneDNN like any other). A sequence carries its adapter's id
(`Sequence.adapter`; None: the base model), and each step the model runner groups the step's packed tokens by
adapter (`LoRABatch`, on the step's metadata; the scheduler puts each adapter's sequences side by side, so its
tokens are one slice): every adapted layer makes its base product once for all tokens,
then for each adapter of the step adds `lora_B(lora_A(x)) * scaling` on that adapter's tokens, the computation
PEFT's unmerged LoRA layer makes (in the adapter's dtype, then back to the layer's, as PEFT casts). Rows of the
base model pay nothing: a step without adapter tokens makes no extra product, a layer no extra call.

On a GPU each adapted layer keeps the slots' weights stacked ([slots, rank, in] and [slots, out, rank], zero
past an adapter's rank) and applies every token's adapter in two Triton kernels over the whole step
(batchrun_kernels/lora.py: shrink, then expand into the base product), two launches a layer however many
adapters the step has; the step then carries each token's slot (`LoRABatch.token_slots`).

At most `engine.max_loras` adapters take part in one step: their weights sit in that many slots beside the model
(`LoRAManager`), the rest wait in CPU memory and are loaded into the least recently used free slot when a step
needs them; the scheduler never runs a step with more adapters than slots (`Scheduler` asks
`admits_adapter`), and prefers waiting rows of the adapters already running.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from batchrun.engine.attention import AttentionMetadata
from batchrun.engine.model.lora.config import AdapterConfig
from batchrun.engine.model.lora.weights import LoRAAdapter, load_adapter
from batchrun.errors import BadInput


@dataclass(frozen=True)
class LoRABatch:
    """The step's packed tokens by adapter: per slot taking part, its tokens' rows, one slice (the scheduler puts
    each adapter's sequences side by side). Built once per step by the model runner, read by every LoRALinear."""

    num_tokens: int
    groups: tuple[tuple[int, slice], ...]
    token_slots: torch.Tensor | None = None  # [T] int32, each token's slot (-1: none): the stacked (GPU) path


class LoRALinear(torch.nn.Module):
    """A linear layer and the adapters that target it: the base product for every token, then each adapter's
    low-rank product added on its own tokens (the module docstring)."""

    def __init__(
        self, base_layer: torch.nn.Module, name: str, num_slots: int, stacked_rank: int | None = None
    ):
        """`stacked_rank`: keep the slots' weights stacked to this rank for the Triton kernels (a GPU); None:
        per slot, for the PyTorch path."""
        super().__init__()
        self.base_layer = base_layer
        self.name = name
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        # per slot: (lora_A, lora_B, scaling) of the adapter loaded there, None where it does not target this layer
        self.slots: list[tuple[torch.Tensor, torch.Tensor, float] | None] = [None] * num_slots
        self.stacked = None  # (A [S, R, in], B [S, out, R], scaling [S] float32) for the kernels
        if stacked_rank is not None:
            from batchrun_kernels.lora import lora_apply  # imported once, at load: not in the forward

            self.apply_kernels = lora_apply
            weight = next(base_layer.parameters(), None)
            device = weight.device if weight is not None else None
            dtype = torch.float32 if weight is None or weight.dtype != torch.float64 else weight.dtype
            self.stacked = (
                torch.zeros(num_slots, stacked_rank, self.in_features, device=device, dtype=dtype),
                torch.zeros(num_slots, self.out_features, stacked_rank, device=device, dtype=dtype),
                torch.zeros(num_slots, device=device, dtype=torch.float32),
            )

    def load(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor, float] | None) -> None:
        """The adapter `weights` (None: one that does not target this layer) into `slot`."""
        if self.stacked is None:
            self.slots[slot] = weights
            return
        a_stack, b_stack, scales = self.stacked
        a_stack[slot].zero_()
        b_stack[slot].zero_()
        scales[slot] = 0.0
        if weights is not None:
            a, b, scaling = weights
            a_stack[slot, : a.shape[0]].copy_(a)
            b_stack[slot, :, : b.shape[1]].copy_(b)
            scales[slot] = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        step = getattr(AttentionMetadata.current(), "step", None)
        batch = getattr(step, "lora", None)
        if batch is None:
            return out
        flat_x, flat = x.reshape(-1, self.in_features), out.view(-1, self.out_features)
        if flat_x.shape[0] != batch.num_tokens:
            raise RuntimeError(
                f"LoRA layer {self.name} was called on {flat_x.shape[0]} rows, not the step's {batch.num_tokens} "
                "tokens: batchrun cannot tell which adapter each row is for"
            )
        if self.stacked is not None:
            self.apply_kernels(flat_x, *self.stacked, batch.token_slots, flat)
            return out
        linear = torch.nn.functional.linear
        widened = None  # the input in the adapters' dtype (a half-precision model's adapters are fp32), once
        for slot, rows in batch.groups:
            weights = self.slots[slot]
            if weights is None:
                continue
            a, b, scaling = weights
            if a.dtype != flat_x.dtype:
                widened = flat_x.to(a.dtype) if widened is None else widened
                h = linear(widened[rows], a)
            else:
                h = linear(flat_x[rows], a)
            # PEFT's `result + delta`, rounded once to the layer's dtype
            if scaling == 1.0 and h.dtype == flat.dtype:
                # the expand and the add as one product, out + h B^T: with a rank far below the library's
                # blocking of the sum, it sums the product, then adds it to out once (bit for bit the two
                # steps on the development machine; tests/test_lora.py holds them within a rounding)
                flat[rows].addmm_(h, b.t())
                continue
            delta = linear(h, b)
            if scaling != 1.0:
                delta = delta * scaling
            flat[rows].add_(delta)  # in place, an add computes in the wider dtype and rounds into the output
        return out

    def extra_repr(self) -> str:
        return f"{self.name}, {sum(s is not None for s in self.slots)} adapters loaded"


@dataclass
class LoRAStats:
    """What the statistics report of the adapters: loads into a slot and evictions from one."""

    loads: int = 0
    evictions: int = 0


class LoRAManager:
    """The job's adapters (every one read into CPU memory at load) and the `max_loras` slots beside the model
    that a step's adapters are loaded into: one manager for the resource, as the block manager is the pages'."""

    def __init__(
        self,
        model: torch.nn.Module,
        adapters: list[LoRAAdapter],
        max_loras: int,
        device,
        stacked: bool | None = None,
    ):
        """`stacked`: the Triton kernels' path (default: on a CUDA device)."""
        self.adapters = adapters
        self.ids = {a.name: a.index for a in adapters}
        self.max_loras = max_loras
        self.device = torch.device(device)
        self.stacked = self.device.type == "cuda" if stacked is None else stacked
        rank = max((a.rank for a in adapters), default=1) if self.stacked else None
        targets = {m for a in adapters for m in a.weights}
        self.layers: dict[str, LoRALinear] = {}
        for name in sorted(targets):
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            layer = LoRALinear(getattr(owner, child), name, max_loras, rank)
            setattr(owner, child, layer)
            self.layers[name] = layer
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.stats = LoRAStats()

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adapters]

    def id_of(self, name: str | None) -> int | None:
        """The id of adapter `name` (None: the base model); ValueError naming the known ones for another."""
        if name is None:
            return None
        if name not in self.ids:
            known = ", ".join(self.ids) or "none"
            raise ValueError(f"adapter {name!r} is not one of this job's adapters ({known})")
        return self.ids[name]

    @property
    def host_bytes(self) -> int:
        """Bytes of every adapter's weights in CPU memory."""
        return sum(a.nbytes for a in self.adapters)

    @property
    def slot_bytes(self) -> int:
        """Bytes the slots beside the model hold: the stacked weights (a GPU), or on the CPU nothing more (the
        slots are the CPU copies themselves)."""
        return sum(t.nbytes for layer in self.layers.values() if layer.stacked for t in layer.stacked)

    def step_batch(self, adapter_ids: list[int | None], query_lens: list[int], num_tokens: int):
        """The step's LoRABatch for its sequences' adapters (in packed order, with their token counts), their
        adapters loaded into slots first; None when no token of the step has an adapter."""
        if all(a is None for a in adapter_ids):
            return None
        runs: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for adapter, n in zip(adapter_ids, query_lens):
            if adapter is not None:
                spans = runs.setdefault(adapter, [])
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + n)
                else:
                    spans.append((start, start + n))
            start += n
        slots = self._load(set(runs))
        if self.stacked:  # every token's slot, for the kernels
            token_slots = [
                s for a, n in zip(adapter_ids, query_lens) for s in [-1 if a is None else slots[a]] * n
            ]
            tensor = torch.tensor(token_slots, dtype=torch.int32).to(self.device)
            return LoRABatch(num_tokens, (), tensor)
        groups = []
        for adapter, spans in runs.items():
            if len(spans) != 1:
                raise RuntimeError(
                    f"adapter {self.adapters[adapter].name!r}'s sequences are not side by side in the step; the "
                    "scheduler orders a step's sequences by adapter (Scheduler.schedule)"
                )
            groups.append((slots[adapter], slice(*spans[0])))
        return LoRABatch(num_tokens, tuple(groups))

    def _load(self, wanted: set[int]) -> dict[int, int]:
        """Each wanted adapter's slot, loading those not resident into free slots or evicting the least recently
        used adapter that this step does not use (the scheduler keeps a step's adapters within max_loras)."""
        assert len(wanted) <= self.max_loras, "the scheduler runs at most max_loras adapters a step"
        for adapter in wanted:
            if adapter in self.resident:
                self.resident.move_to_end(adapter)
                continue
            used = set(self.resident.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(a for a in self.resident if a not in wanted)
                slot = self.resident.pop(victim)
                self.stats.evictions += 1
            self._put(adapter, slot)
            self.resident[adapter] = slot
        return {a: self.resident[a] for a in wanted}

    def _put(self, adapter_id: int, slot: int) -> None:
        adapter = self.adapters[adapter_id]
        for name, layer in self.layers.items():
            w = adapter.weights.get(name)
            layer.load(slot, None if w is None else (w[0].to(self.device), w[1].to(self.device), w[2]))
        self.stats.loads += 1


def attach(
    model: torch.nn.Module,
    adapters: dict[str, tuple[Path, AdapterConfig]],
    max_loras: int,
    device,
    stacked: bool | None = None,
) -> LoRAManager:
    """Reads each adapter ({name: (folder, config)}, in order: the id is the place) against `model`, wraps the
    layers they target, and returns the manager (also kept on the model, where the model plan finds it). A model
    transformers loaded through a quantizer is refused: PEFT's LoRA over a quantized layer computes in the
    format's own dtype, which batchrun does not reproduce."""
    from batchrun.engine.model.quantization import checkpoint_format, quantized

    if quantized(model):
        raise BadInput(
            f"model.adapters: LoRA adapters over a quantized checkpoint "
            f"({checkpoint_format(model.config) or 'quantized'}) are not applied by batchrun; use the float model"
        )
    loaded = [
        load_adapter(name, i, folder, config, model, f"model.adapters.{name}")
        for i, (name, (folder, config)) in enumerate(adapters.items())
    ]
    manager = LoRAManager(model, loaded, max_loras, device, stacked)
    model.batchrun_lora = manager
    return manager


def manager_of(model: torch.nn.Module) -> LoRAManager | None:
    """The adapters `attach` put on `model`, or None."""
    return getattr(model, "batchrun_lora", None)
