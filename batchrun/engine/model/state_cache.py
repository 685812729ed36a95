"""The state slots' tensors: a slot per sequence, for hybrid models' stateful layers.

Linear-attention (Gated DeltaNet, KDA), Mamba and short-convolution layers do not read back over earlier
tokens: each carries a fixed-size state from one step to the next, a convolution window and (most of them) a
recurrent state. A hybrid model (Qwen 3.5, Granite 4, Nemotron-H, LFM 2, Falcon-H1, ...) has such layers beside
its attention layers. batchrun keeps their states in a pool of *state slots*, one slot per running sequence
holding every stateful layer's states, beside the pages of the attention layers:

- `StateSpec` (cache_spec.py): what one slot holds, found by the load probe (`StateProbe`, below): each
  stateful layer's conv and recurrent state shapes, as the model's own code creates them.
- `StateSlots` (state_slots.py): which slot each sequence holds (pure integers, like page_pool.py):
  accelerator slots and CPU swap slots, a slot reserved at admission for each parallel sample still to be
  forked.
- `StateCache`: the slot tensors and the copies between them (swap out, swap in, a fork's copy) that the
  plan carries for the state manager (cache_spec.UnitCopies).
- `StepStates`: one step's view, passed to the layers with the attention metadata. Each stateful layer runs its
  own `transformers` code, never a re-implementation: on a `transformers` cache whose layer objects
  (`LinearAttentionLayer`, with its own padding and update rules) hold views of the sequence's slot. The
  decoding sequences run together as one batch (their states gathered, then written back); a prompt, or a
  chunk of one, runs on its own, continuing the state its earlier chunks left.

A slot is never shared: a state is rewritten every step, so a fork copies it at once (as `n > 1` samples do)
rather than on write. Prefix sharing needs the state at the end of the shared prefix: a few more slots keep such
states (snapshots, chosen and restored by `StateSlots`), and a row behind the prefix starts from a copy.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from batchrun.engine.core.cache_spec import LayerStates, StateShape, StateSpec, UnitCopies, UnitCopy
from batchrun.engine.model import families


class StateCache:
    """The slot tensors: per stateful layer and state index, [num_slots, *shape] on the device and
    [num_cpu_slots, *shape] on the CPU (pinned on CUDA). A step's view of them is `StepStates`, which the
    stateful layers read as `AttentionMetadata.views[StateCache]` (stateful_layers.py)."""

    def __init__(self, spec: StateSpec, num_slots: int, num_cpu_slots: int, device: torch.device):
        self.spec = spec
        self.device = device
        pin = device.type == "cuda"
        self.conv: dict[int, list[torch.Tensor | None]] = {}
        self.recurrent: dict[int, list[torch.Tensor | None]] = {}
        self.cpu: list[torch.Tensor] = []  # every CPU tensor, in the order of `self.tensors`
        for layer in spec.layers:
            for which, shapes in (("conv", layer.conv), ("recurrent", layer.recurrent)):
                getattr(self, which)[layer.layer] = [
                    None if s is None else torch.zeros(num_slots, *s.shape, dtype=s.dtype, device=device)
                    for s in shapes
                ]
        for t in self.tensors:
            self.cpu.append(torch.empty(num_cpu_slots, *t.shape[1:], dtype=t.dtype, pin_memory=pin))

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for d in (self.conv, self.recurrent) for ts in d.values() for t in ts if t is not None]

    def apply(self, copies: UnitCopies) -> None:
        """A step's copies, in the only safe order: forks and kept prefixes (from slots still held), out, in."""
        swap_out, swap_in = copies.swap_out, copies.swap_in
        for wave in _waves(copies.device):
            src = torch.tensor([c.src for c in wave], device=self.device)
            dst = torch.tensor([c.dst for c in wave], device=self.device)
            for t in self.tensors:
                t[dst] = t[src]
        if swap_out:
            src = torch.tensor([c.src for c in swap_out], device=self.device)
            dst = torch.tensor([c.dst for c in swap_out])
            for t, cpu in zip(self.tensors, self.cpu):
                cpu[dst] = t[src].to("cpu")
        if swap_in:
            src = torch.tensor([c.src for c in swap_in])
            dst = torch.tensor([c.dst for c in swap_in], device=self.device)
            for t, cpu in zip(self.tensors, self.cpu):
                t[dst] = cpu[src].to(self.device, non_blocking=True)

    def step_view(self, units: list[int], query_lens: list[int], starts: list[int]) -> StepStates:
        """The step's slots, one per scheduled sequence in packed order (StateSlots.unit_of)."""
        return StepStates(self, units, query_lens, starts)


def _waves(copies: list[UnitCopy]) -> list[list[UnitCopy]]:
    """The copies in order, batched where no copy reads a slot an earlier one of its batch writes (a snapshot
    kept, then restored into a new sequence in the same step: the second reads what the first wrote)."""
    waves: list[list[UnitCopy]] = []
    written: set[int] = set()
    for c in copies:
        if not waves or c.src in written:
            waves.append([])
            written = set()
        waves[-1].append(c)
        written.add(c.dst)
    return waves


# ---- the layers' side: transformers' cache interface over slots ------------------------------------------------
def linear_layer(conv: list, recurrent: list, has_previous: bool):
    """A transformers `LinearAttentionLayer` whose states are the given tensors (views of slots, or slots
    gathered for a batch): the model's own code reads and updates them through it, in place."""
    from transformers.cache_utils import LinearAttentionLayer

    n = max(len(conv), len(recurrent))
    layer = LinearAttentionLayer(number_of_states=n)
    for i in range(n):
        c = conv[i] if i < len(conv) else None
        r = recurrent[i] if i < len(recurrent) else None
        like = c if c is not None else r
        layer.device, layer.dtype = like.device, like.dtype
        if c is not None:
            layer.conv_states[i] = c
            layer.conv_kernel_size[i] = c.shape[-1]
            layer.is_conv_states_initialized[i] = True
        if r is not None:
            layer.recurrent_states[i] = r
            layer.is_recurrent_states_initialized[i] = True
        layer.has_previous_state[i] = has_previous
    return layer


def layer_cache(layer_idx: int, layer) -> Any:
    """A transformers `Cache` holding one layer (the one the called module reads by its `layer_idx`)."""
    return _cache_class()(layers={layer_idx: layer})


@functools.cache
def _cache_class():
    """transformers' cache interface, and the names a family's own code gives it (families.cache_methods:
    MiniMax's `get_linear_cache` / `set_linear_cache`)."""
    from transformers.cache_utils import Cache

    return type("SlotCache", (Cache,), families.cache_methods())


class StatefulCall(NamedTuple):
    """How a stateful module is called: its own forward, the keyword its cache goes in, and the names of its
    parameters after the hidden states (arguments given by position are passed on by name, so that the
    per-token ones are cut per sequence: Inkling 2's convolutions take their weights' input so)."""

    forward: Any
    cache_keyword: str
    positional: tuple[str, ...]


class StepStates:
    """One step's state slots, in packed order (one entry per scheduled sequence), for the stateful layers."""

    def __init__(self, cache: StateCache, slots: list[int], query_lens: list[int], starts: list[int]):
        self.cache = cache
        self.slots, self.query_lens, self.starts = slots, query_lens, starts
        offsets, decodes, prompts = 0, [], []
        for i, (n, start) in enumerate(zip(query_lens, starts)):
            # a decode continues a state; a prompt's first token (start 0) has none to continue
            (decodes if n == 1 and start > 0 else prompts).append((i, offsets))
            offsets += n
        self.num_tokens = offsets
        device = cache.device
        self.decode_rows = torch.tensor([t for _, t in decodes], dtype=torch.long, device=device)
        self.decode_slots = torch.tensor([slots[i] for i, _ in decodes], dtype=torch.long, device=device)
        self.prompts = prompts  # (index in the step, first packed row)

    def run(self, module, call: StatefulCall, hidden: torch.Tensor, kwargs: dict):
        """The module's own forward over the step's packed rows hidden [1, T, H], in the form the module returns
        it (`packed_output`)."""
        layer_idx = module.layer_idx
        conv, recurrent = self.cache.conv[layer_idx], self.cache.recurrent[layer_idx]
        pieces: list[tuple[Any, torch.Tensor, Any]] = []  # (rows, input [B, n, H], output)
        if len(self.decode_rows):
            slots = self.decode_slots
            given = (
                [None if t is None else t.index_select(0, slots) for t in conv],
                [None if t is None else t.index_select(0, slots) for t in recurrent],
            )
            layer = linear_layer(*given, has_previous=True)
            x = hidden[0].index_select(0, self.decode_rows)[:, None]  # [B, 1, H]: a batch of one-token rows
            mine = _token_rows(kwargs, self.num_tokens, self.decode_rows)
            out = call.forward(x, **{call.cache_keyword: layer_cache(layer_idx, layer)}, **mine)
            pools = (conv, recurrent)
            _write_back(layer, given, lambda which, i, new, _: pools[which][i].index_copy_(0, slots, new))
            pieces.append((self.decode_rows, x, out))
        for i, row in self.prompts:
            slot, n = self.slots[i], self.query_lens[i]
            given = (
                [None if t is None else t[slot : slot + 1] for t in conv],
                [None if t is None else t[slot : slot + 1] for t in recurrent],
            )
            layer = linear_layer(*given, has_previous=self.starts[i] > 0)
            cache = layer_cache(layer_idx, layer)
            mine = _token_slices(kwargs, self.num_tokens, row, row + n)
            x = hidden[:, row : row + n]
            out = call.forward(x, **{call.cache_keyword: cache}, **mine)
            # the layer updates the slot's views in place; a state it replaced instead is copied in
            _write_back(layer, given, lambda which, j, new, view: None if new is view else view.copy_(new))
            pieces.append((slice(row, row + n), x, out))
        return packed_output(pieces, self.num_tokens)


def packed_output(pieces: list[tuple], num_tokens: int):
    """The pieces' outputs (each a tensor, or a tuple) packed into the step's rows, in the module's own form: each
    item that is per token in every piece ([B, n, ...] for an input [B, n, H]: the output, or Zaya's projection's
    q, k and v [B, n, heads, head_dim]) as [1, T, ...]; any other (MiniMax's state, which its decoder layer
    drops) None."""
    outs = [out if isinstance(out, tuple) else (out,) for _, _, out in pieces]
    packed = []
    for j in range(len(outs[0])):
        items = [out[j] for out in outs]
        if not all(
            isinstance(t, torch.Tensor) and t.shape[:2] == x.shape[:2] for t, (_, x, _) in zip(items, pieces)
        ):
            packed.append(None)
            continue
        result = items[0].new_empty(num_tokens, *items[0].shape[2:])
        for t, (rows, _, _) in zip(items, pieces):
            result[rows] = t.flatten(0, 1)
        packed.append(result[None])
    return tuple(packed) if isinstance(pieces[0][2], tuple) else packed[0]


def first_output(out) -> torch.Tensor:
    """A stateful module's output, the first item of a tuple (MiniMax's attention returns its state too)."""
    return out[0] if isinstance(out, tuple) else out


def _write_back(layer, given: tuple[list, list], put) -> None:
    """The states the layer object holds after the call, into the slots: `put(which, i, new, given)` for each."""
    for which, held in enumerate((layer.conv_states, layer.recurrent_states)):
        for i, t in enumerate(given[which]):
            if t is not None:
                put(which, i, held[i], t)


class StateProbe:
    """The load probe's states: a fresh `LinearAttentionLayer` per stateful layer, created by the model's own
    code as it would be under `generate`; afterwards, the shapes it made (the `StateSpec`)."""

    MAX_STATES = 8
    view_key = StateCache  # where the stateful layers look (stateful_layers._stateful_forward)

    def __init__(self) -> None:
        self.layers: dict[int, Any] = {}  # layer -> its states, of all its stateful modules (one per index)
        # (layer, call, hidden, kwargs) of each module's call: to call it again in pieces
        self.calls: list[tuple] = []

    def run(self, module, call: StatefulCall, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
        layer_idx = module.layer_idx
        self.calls.append((layer_idx, call, hidden, kwargs))
        self.layers[layer_idx], out = self._call(layer_idx, call, hidden, kwargs, self.layers.get(layer_idx))
        return out

    def _call(self, layer_idx: int, call: StatefulCall, hidden, kwargs, layer=None):
        from transformers.cache_utils import LinearAttentionLayer

        layer = layer or LinearAttentionLayer(number_of_states=self.MAX_STATES)
        return layer, call.forward(hidden, **{call.cache_keyword: layer_cache(layer_idx, layer)}, **kwargs)

    def continues_state(self) -> bool:
        """Whether each layer's several-token form continues the state it is given: the probe's tokens run in
        two pieces, the second after the first, must give what the whole run gives for them, far closer than
        the second piece run afresh does. A layer that drops part of the state it is given (Jamba's Mamba scan
        takes no initial state: `generate` only ever runs it over a whole prompt) is as far off as a fresh run.
        """
        for layer_idx, call, hidden, kwargs in self.calls:
            T = hidden.shape[1]
            cut = T // 2
            head, tail = (_token_slices(kwargs, T, a, b) for a, b in ((0, cut), (cut, T)))
            _, whole = self._call(layer_idx, call, hidden, kwargs)
            layer, _ = self._call(layer_idx, call, hidden[:, :cut], head)
            _, continued = self._call(layer_idx, call, hidden[:, cut:], tail, layer)
            _, afresh = self._call(layer_idx, call, hidden[:, cut:], tail)
            expected = first_output(whole)[:, cut:].float()
            off_continued, off_afresh = (
                (first_output(out).float() - expected).abs().max().item() for out in (continued, afresh)
            )
            # a layer wrongly judged not to continue (noise in a low precision) loses chunks and sharing only
            if off_continued > 1e-3 * off_afresh:
                return False
        return True

    def spec(self, measured: bool = True) -> StateSpec | None:
        """The states the layers made (None: no stateful layer). `measured` False (a meta-device probe, which has
        shapes but no numbers to compare): the layers are taken to continue their states, a fact only the load's
        probe settles."""
        found = []
        for idx, layer in sorted(self.layers.items()):
            n = 1 + max(
                [i for i in range(self.MAX_STATES) if layer.is_conv_states_initialized[i]]
                + [i for i in range(self.MAX_STATES) if layer.is_recurrent_states_initialized[i]],
                default=-1,
            )
            shape = lambda t: None if t is None else StateShape(tuple(t.shape[1:]), t.dtype)
            conv = tuple(shape(layer.conv_states[i]) for i in range(n))
            recurrent = tuple(shape(layer.recurrent_states[i]) for i in range(n))
            found.append(LayerStates(idx, conv, recurrent))
        if not found:
            return None
        return StateSpec(tuple(found), self.continues_state() if measured else True)


def _token_slices(kwargs: dict, num_tokens: int, a: int, b: int) -> dict:
    """The keyword arguments of a call on packed tokens a:b."""
    return _per_token(kwargs, num_tokens, lambda t: t[:, a:b])


def _token_rows(kwargs: dict, num_tokens: int, rows: torch.Tensor) -> dict:
    """The keyword arguments of a call on the packed rows `rows` (on the step's device, StepStates) as a batch of
    one-token rows [B, 1, ...]."""
    return _per_token(kwargs, num_tokens, lambda t: t[0].index_select(0, rows)[:, None])


def _per_token(kwargs: dict, num_tokens: int, cut) -> dict:
    """A stateful layer's keyword arguments with `cut` applied to each per-token one ([1, T, ...], or a tuple of
    such, as rotary embeddings are); the others as they are."""

    def one(value):
        if isinstance(value, tuple):
            return tuple(one(v) for v in value)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == num_tokens:
            return cut(value)
        return value

    return {k: one(v) for k, v in kwargs.items()}
