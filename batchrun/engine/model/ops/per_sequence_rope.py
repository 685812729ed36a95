"""RoPE whose factors depend on the sequence's length (LongRoPE, dynamic NTK), computed per packed sequence.

transformers' rotary module picks these factors per forward from `max(position_ids) + 1`
(`modeling_rope_utils.dynamic_rope_update`): LongRoPE its short factors up to the original context and its long
ones past it, dynamic NTK frequencies rescaled to that length (the originals up to the original context). Under
HF `generate` one sequence runs alone, so that length is its own: the whole prompt's length for every prompt
token, and position + 1 for each generated token. Earlier tokens keep the rotation they were cached with, except
in the Phi-3 family, whose `prepare_inputs_for_generation` drops the cache when the sequence first passes the
original context and computes every token again with the long factors.

batchrun packs sequences of every length into one row, so the model's own call would give each the choice of its
longest batch-mate. Here each token gets the length HF would have used for it (its "rotation length"):

- tokens keep their rotation (dynamic NTK; LongRoPE outside the Phi-3 family): max(prompt length, position + 1),
  whatever step computes it: a prompt's chunks, a decode, a recompute after preemption;
- Phi-3's LongRoPE: the sequence's current length for every token a step computes (a prompt's chunks all use the
  prompt's length; a recompute after preemption the whole sequence's, as HF's cache drop does), and a sequence
  whose cache was computed with the short factors is computed again whole when its length reaches
  original context + 1 (`recompute_at`: the scheduler drops its pages, as HF drops its cache).

The cos/sin are made in `ModelRunner.prepare`, by the model's own rotary module called once per distinct choice
of factors in the step (its state reset before each call, so no sequence inherits another's dynamic NTK length),
and the module's forward returns them during the step's forward. Dynamic NTK has a choice per sequence past the
original context (its length grows by one a step), so one call per sequence would cost a step of 64 decodes
milliseconds (bench/RESULTS.md); for a module that is transformers' standard one (`DynamicNtkFrequencies.of`)
the frequencies of every length are computed at once instead, bit for bit as the module computes them for one.

A page holds K/V rotated for its tokens' lengths, so the prefix cache shares only the pages every sequence of the
same tokens computes alike (`shareable_tokens`): those whose tokens all take the original context's factors.
"""

from __future__ import annotations

import inspect

import torch
from transformers import modeling_rope_utils

from batchrun.engine.attention import AttentionMetadata, UnsupportedModel, int_tensor, refusal

# RoPE scalings whose factors transformers picks from the sequence's length
LENGTH_DEPENDENT_ROPE = frozenset({"longrope", "dynamic"})


def recomputes_cache_at_original_context(model) -> bool:
    """The model's own `prepare_inputs_for_generation` drops the cache once the sequence passes
    `original_max_position_embeddings` (Phi-3, PhiMoE, Phi-4-multimodal), read from its source."""
    prepare = getattr(type(model), "prepare_inputs_for_generation", None)
    try:
        return "original_max_position_embeddings" in inspect.getsource(prepare)
    except (OSError, TypeError):
        return False


class PerSequenceRope:
    """The model's rotary module, its cos/sin computed per packed sequence (module docstring)."""

    def __init__(self, module: torch.nn.Module, rope_type: str, recompute_at: int | None):
        self.module = module
        self.rope_type = rope_type
        # LongRoPE: the longest sequence that keeps the short factors
        self.original_context = _original_context(module, rope_type)
        # a sequence reaching this many tokens is computed again whole (Phi-3's LongRoPE); None: tokens keep
        # their rotation
        self.recompute_at = recompute_at
        if "_batchrun_rope_forward" not in module.__dict__:
            module._batchrun_rope_forward = module.forward
            module.forward = _step_rotary_forward.__get__(module)
        # dynamic NTK's frequencies of all the step's lengths at once; None: the module called per length
        self.frequencies = DynamicNtkFrequencies.of(self) if rope_type == "dynamic" else None

    @classmethod
    def of(cls, model, rope_types: set[str]) -> PerSequenceRope | None:
        """For a model whose RoPE scaling depends on the length (`rope_types`: what its config asks for), else
        None; UnsupportedModel where batchrun cannot choose its factors per sequence."""
        found = rope_types & LENGTH_DEPENDENT_ROPE
        if not found:
            return None
        arch = model.config.model_type
        # a module with RoPE types per layer type holds them in a dict: none found, refused below
        modules = [m for m in model.modules() if _rope_type(m) in found]
        if len(modules) != 1 or not hasattr(modules[0], "original_inv_freq"):
            raise refusal(
                arch,
                f"its RoPE scaling `{'/'.join(sorted(found))}` picks its factors from the sequence's length, and "
                f"batchrun chooses them per sequence only for one rotary module of one RoPE type (found "
                f"{len(modules)}, or RoPE types per layer type)",
            )
        (module,) = modules
        recompute_at = None
        if recomputes_cache_at_original_context(model):
            if module.rope_type != "longrope":
                raise refusal(
                    arch,
                    f"its RoPE scaling `{module.rope_type}` with a cache dropped at the original context "
                    "(Phi-3's `prepare_inputs_for_generation`) is not computed per sequence",
                )
            if model.config.original_max_position_embeddings != _original_context(module, "longrope"):
                raise refusal(arch, "its config's two original contexts differ")
            recompute_at = model.config.original_max_position_embeddings + 1
        return cls(module, module.rope_type, recompute_at)

    def rotation_lengths(self, spans: list[tuple[int, int, int, int]]) -> list[int]:
        """Each packed token's rotation length (module docstring), in packed order, from each sequence's
        (tokens, prompt tokens, start, tokens computed this step) as the runner's batch holds them."""
        lengths: list[int] = []
        for num_tokens, prompt, start, n in spans:
            if self.recompute_at is not None:
                lengths += [num_tokens] * n
            else:
                lengths += [max(prompt, p + 1) for p in range(start, start + n)]
        return lengths

    def shareable_tokens(self, seq) -> int:
        """How many of seq's leading tokens hold K/V that every sequence of the same tokens computes (the prefix
        cache shares their pages, prefix_cache.PrefixCache): those rotated with the original context's factors,
        which every length up to it takes. Phi-3's are all of a sequence still within the original context (its
        tokens all rotated for its current length), none past it; otherwise the tokens before the original
        context of a prompt within it, none of a longer prompt (every prompt token rotated for its length)."""
        if self.recompute_at is not None:
            return seq.num_tokens if seq.num_tokens <= self.original_context else 0
        return self.original_context if seq.num_prompt_tokens <= self.original_context else 0

    def _factors(self, length: int) -> int:
        """Lengths with equal factors map to one key: LongRoPE's two sets, dynamic NTK's originals up to the
        original context."""
        if self.rope_type == "longrope":
            return int(length > self.original_context)
        return max(length, self.module.original_max_seq_len)

    def step_embeddings(self, spans: list, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's cos and sin, [1, T, rotary dim] in float32 (the module casts to the model's dtype itself),
        for the step's packed `positions` [T] and its sequences' spans (`rotation_lengths`)."""
        if self.frequencies is not None:
            return self.frequencies.embeddings(self.rotation_lengths(spans), positions)
        groups: dict[int, tuple[int, list[int]]] = {}
        for t, length in enumerate(self.rotation_lengths(spans)):
            groups.setdefault(self._factors(length), (length, []))[1].append(t)
        if len(groups) == 1:
            ((length, _),) = groups.values()
            return self._rotary(positions, length)
        parts = []
        for length, tokens in groups.values():
            index = int_tensor(tokens, device=positions.device)
            parts.append((index, self._rotary(positions[index], length)))
        dim = parts[0][1][0].shape[-1]
        cos = torch.empty(1, len(positions), dim, device=positions.device)
        sin = torch.empty_like(cos)
        for index, (c, s) in parts:
            cos[:, index], sin[:, index] = c, s
        return cos, sin

    @torch.inference_mode()
    def _rotary(self, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's own forward at these positions with the factors of a sequence of `length` tokens: it
        reads the length as max(position_ids) + 1, so position length - 1 rides along and is dropped."""
        m = self.module
        ids = torch.cat([positions, int_tensor([length - 1], device=positions.device)])[None]
        x = torch.empty(0, device=positions.device)  # float32: the module's dtype and device come from it
        self._reset()
        try:
            cos, sin = m._batchrun_rope_forward(x, ids)
        finally:
            self._reset()
        return cos[:, :-1], sin[:, :-1]

    def _reset(self) -> None:
        """Dynamic NTK's module as first made: its frequencies the original ones, for the original length."""
        m = self.module
        if self.rope_type == "dynamic":
            m.register_buffer("inv_freq", m.original_inv_freq, persistent=False)
            m.max_seq_len_cached = m.original_max_seq_len


class DynamicNtkFrequencies:
    """Dynamic NTK's cos/sin for tokens of many rotation lengths in one computation, equal bit for bit to the
    rotary module's own call per length: its original frequencies up to the original context, past it
    transformers' `_compute_dynamic_ntk_parameters` for each distinct length, vectorised over the lengths.

    Used only for a module whose computation this reproduces (`of`): transformers' standard rotary forward under
    its `dynamic_rope_update`, and its dynamic NTK function; checked at load against the module's own call at
    lengths on both sides of the original context, on the module's device, and otherwise not used (the module is
    then called per length, as before)."""

    def __init__(self, module: torch.nn.Module):
        config = module.config
        params = config.rope_parameters
        # the lines of `_compute_dynamic_ntk_parameters` that depend on the config alone
        head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        self.module = module
        self.theta = params["rope_theta"]
        self.factor = params["factor"]
        self.max_position_embeddings = config.max_position_embeddings
        self.base_exponent = dim / (dim - 2)
        device = module.original_inv_freq.device
        self.frequency_exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device, torch.float) / dim

    @classmethod
    def of(cls, rope: PerSequenceRope) -> DynamicNtkFrequencies | None:
        """For a module whose call this reproduces exactly (class docstring), else None."""
        module = rope.module
        if not _is_standard_dynamic_rotary(module):
            return None
        frequencies = cls(module)
        original = rope.original_context
        device = module.original_inv_freq.device
        for length in (1, original, original + 1, original + 2, 2 * original + 3, 16 * original + 5):
            positions = int_tensor(sorted({0, length // 3, length // 2, length - 1}), device=device)
            expected = rope._rotary(positions, length)
            got = frequencies.embeddings([length] * len(positions), positions)
            if not all(torch.equal(e, g) for e, g in zip(expected, got)):
                return None
        return frequencies

    def inverse_frequencies(self, lengths: torch.Tensor) -> torch.Tensor:
        """[G, rotary dim / 2] float32 for `lengths` [G]: `_compute_dynamic_ntk_parameters(seq_len=length)` per
        row past the original context (the module's growth), its original frequencies up to it (its reset).

        The base's power is taken in float64 and rounded to float32: transformers takes it on a one-element
        tensor, which torch computes as a scalar loop in double, where a vectorised float32 power over many
        lengths differs in the last bit (checked at load, `of`)."""
        m = self.module
        seq_len = torch.maximum(lengths, torch.tensor(self.max_position_embeddings, device=lengths.device))
        scaled = (self.factor * seq_len / self.max_position_embeddings) - (self.factor - 1)
        base = self.theta * (scaled.double() ** self.base_exponent).float()
        grown = 1.0 / (base[:, None] ** self.frequency_exponents)
        return torch.where((lengths > m.original_max_seq_len)[:, None], grown, m.original_inv_freq)

    def embeddings(self, lengths: list[int], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The module forward's cos and sin, [1, T, rotary dim] float32, for tokens of rotation `lengths` at
        `positions` [T]: each distinct length's frequencies computed once."""
        rows: dict[int, int] = {}
        row_of_token = [rows.setdefault(length, len(rows)) for length in lengths]
        device = positions.device
        inv_freq = self.inverse_frequencies(int_tensor(list(rows), device=device))
        freqs = positions[:, None].float() * inv_freq[int_tensor(row_of_token, device=device)]
        emb = torch.cat((freqs, freqs), dim=-1)[None]
        scaling = self.module.attention_scaling
        return emb.cos() * scaling, emb.sin() * scaling


def _is_standard_dynamic_rotary(module: torch.nn.Module) -> bool:
    """The module's forward is transformers' standard rotary forward (Llama's, which most families copy: compared
    by its compiled code) under `dynamic_rope_update`, and its dynamic NTK is transformers' own function."""
    # here, not at the top: `batchrun validate`'s memory check reaches this module through the KV sizing, and
    # Llama's modeling file imports much of torch (its compiler, distributed tensors: seconds) that it never needs
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    forward = type(module).forward
    standard = LlamaRotaryEmbedding.forward
    inner = getattr(forward, "__wrapped__", None)
    return (
        modeling_rope_utils.ROPE_INIT_FUNCTIONS.get("dynamic")
        is modeling_rope_utils._compute_dynamic_ntk_parameters
        and getattr(forward, "__code__", None) is standard.__code__
        and inner is not None
        and _same_code(inner.__code__, standard.__wrapped__.__code__)
    )


def _same_code(a, b) -> bool:
    """Two functions' compiled code is the same computation (names, constants, bytecode; not line numbers)."""
    return all(getattr(a, k) == getattr(b, k) for k in ("co_code", "co_consts", "co_names", "co_varnames"))


def _rope_type(module: torch.nn.Module) -> str | None:
    """A rotary module's one RoPE type; None for a module with none, or with one per layer type."""
    rope_type = getattr(module, "rope_type", None)
    return rope_type if isinstance(rope_type, str) else None


def _original_context(module: torch.nn.Module, rope_type: str) -> int:
    """LongRoPE's original context (the rope parameters' key, which transformers reads); dynamic NTK's the
    module's original length."""
    if rope_type == "longrope":
        return module.config.rope_parameters["original_max_position_embeddings"]
    return module.original_max_seq_len


def _step_rotary_forward(self, x, position_ids, *args, **kwargs):
    """The rotary module's forward under batchrun: the step's per-sequence cos/sin, cast as the module casts.
    Outside a step (the load probe, the model run by transformers) its own forward."""
    meta = AttentionMetadata.current()
    embeddings = meta.rotary_embeddings if meta is not None else None
    if embeddings is None:
        return self._batchrun_rope_forward(x, position_ids, *args, **kwargs)
    cos, sin = embeddings
    if position_ids.shape[-1] != cos.shape[1] or args or kwargs:
        raise UnsupportedModel(
            f"{type(self).__name__} is called on other positions than the step's tokens, or per layer type"
        )
    return cos.to(x.dtype), sin.to(x.dtype)
