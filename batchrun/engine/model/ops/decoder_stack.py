"""The model's forward above its decoder layers, run by batchrun where HF's is, statement for statement, a form
this file knows (Llama's and Qwen2's, which most text families copy); anywhere else HF's own forward runs.

Why: at one running sequence a decode step is mostly Python, and HF's two outer forwards (`LlamaForCausalLM`,
`LlamaModel`) are a large part of it: seven decorators between them (renamed arguments, config defaults, output
capture, tuple returns), two output records built and checked field by field, a causal-mask builder that returns
None under an attention implementation of one's own, and a slice of the layer list made anew each call. What
they compute for batchrun is five module calls: the token embeddings, the rotary embeddings, each decoder layer,
the final norm, the LM head on the kept positions (bench/RESULTS.md, 2026-12-06, by bench/host.py).

Exact by construction:
- every module below the two outer ones is called as a module, in HF's order and with HF's arguments, so its
  hooks run (LoRA, quantized products, batchrun's fused layers, a user's);
- the attention mask is None, as transformers' mask builders give it for a registered attention implementation
  (every layer call refuses a mask of its own: attention/interface.py `read_call`);
- the form is checked at load: both classes' `forward` statements (docstrings and annotations aside) must be one
  of `FORMS`, their decorators among `DECORATORS` (none of which changes what batchrun reads: the logits), the
  config must not set `is_causal` (which the config-defaults decorator would pass to every layer), and every
  layer must run (`num_hidden_layers` of them). So a family whose forward does anything more (Gemma's embedding
  scale, Cohere's logit scale, a final soft cap, images, 3-D positions) keeps HF's.
- the forwards must be transformers' own (a `functools.wraps` wrapper from anywhere else, which `inspect` reads
  through, is refused), the decoder the one `get_decoder` gives, the attention batchrun's;
- and at each step: a hook on either outer module (or a global one, or accelerate's) would see no call, a class
  forward replaced or a config changed since the load would not be honoured, so the step runs HF's forward
  instead.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch
from torch.nn.modules import module as torch_module
from transformers.modeling_utils import slice_logits_to_keep

from batchrun.engine.attention import ATTENTION_NAME
from batchrun.engine.model.ops.cpu_linear import hooked
from batchrun.engine.model.ops.fused_elementwise import forward_source, statements
from batchrun.engine.model.structure import decoder_of

# the causal LM's forward: the model's last hidden states, the kept positions, the LM head (Llama's; also
# Qwen2's, Mistral's, Phi-3's and some thirty others')
CAUSAL_LM_FORMS = (
    """
def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
            labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    outputs: BaseModelOutputWithPast = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    hidden_states = outputs.last_hidden_state
    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
    logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    return CausalLMOutputWithPast(
        loss=loss,
        logits=logits,
        cache=outputs.cache,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
""",
)
# the decoder stack's forward: embeddings, one causal mask (Llama's) or one per layer type (Qwen2's), rotary
# embeddings, the layers, the final norm
MODEL_FORMS = (
    """
def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
            use_cache=None, **kwargs):
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds: torch.Tensor = self.embed_tokens(input_ids)
    if use_cache and cache is None:
        cache = DynamicCache(config=self.config)
    if position_ids is None:
        past_seen_tokens = cache.get_seq_length() if cache is not None else 0
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
        position_ids = position_ids.unsqueeze(0)
    causal_mask = create_causal_mask(
        config=self.config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
    )
    hidden_states = inputs_embeds
    position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
    for decoder_layer in self.layers[: self.config.num_hidden_layers]:
        hidden_states = decoder_layer(
            hidden_states,
            attention_mask=causal_mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            **kwargs,
        )
    hidden_states = self.norm(hidden_states)
    return BaseModelOutputWithPast(
        last_hidden_state=hidden_states,
        cache=cache,
    )
""",
    """
def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
            use_cache=None, **kwargs):
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = self.embed_tokens(input_ids)
    if use_cache and cache is None:
        cache = DynamicCache(config=self.config)
    if position_ids is None:
        past_seen_tokens = cache.get_seq_length() if cache is not None else 0
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
        position_ids = position_ids.unsqueeze(0)
    if not isinstance(causal_mask_mapping := attention_mask, dict):
        mask_kwargs = {
            "config": self.config,
            "inputs_embeds": inputs_embeds,
            "attention_mask": attention_mask,
            "cache": cache,
            "position_ids": position_ids,
        }
        causal_mask_mapping = {
            "full_attention": create_causal_mask(**mask_kwargs),
        }
        if self.has_sliding_layers:
            causal_mask_mapping["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
    hidden_states = inputs_embeds
    position_embeddings = self.rotary_emb(hidden_states, position_ids)
    for i, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
        hidden_states = decoder_layer(
            hidden_states,
            attention_mask=causal_mask_mapping[self.config.layer_types[i]],
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            **kwargs,
        )
    hidden_states = self.norm(hidden_states)
    return BaseModelOutputWithPast(
        last_hidden_state=hidden_states,
        cache=cache if use_cache else None,
    )
""",
)
# what the outer forwards' decorators do is beside the logits: renamed arguments, the config's `use_cache`
# default (batchrun passes False), output capture (hidden states and attention weights; batchrun asks for
# neither), tuple returns, docstrings. `is_causal` from the config is the one they pass on: refused below.
DECORATORS = frozenset(
    {"deprecate_kwarg", "merge_with_config_defaults", "capture_outputs", "can_return_tuple", "auto_docstring"}
)
KNOWN_CAUSAL_LM = frozenset(statements(s) for s in CAUSAL_LM_FORMS)
KNOWN_MODEL = frozenset(statements(s) for s in MODEL_FORMS)


def _decorators(source: str) -> set[str] | None:
    """The names of the decorators a function's `source` was written with; None when it cannot be parsed."""
    try:
        fn = ast.parse(textwrap.dedent(source)).body[0]
    except (SyntaxError, IndexError):
        return None
    calls = [d.func if isinstance(d, ast.Call) else d for d in getattr(fn, "decorator_list", [])]
    return {d.id if isinstance(d, ast.Name) else ast.unparse(d) for d in calls}


def _form(cls, known: frozenset) -> bool:
    """`cls.forward` is a known form, with transformers' decorators alone (its wrappers checked by
    `forward_source`), and a function of transformers' own modeling files (not remote code, whose helper functions
    may differ under the same names)."""
    source = forward_source(cls.forward)
    if source is None:
        return False
    decorators = _decorators(source)
    return (
        statements(source) in known
        and decorators is not None
        and decorators <= DECORATORS
        and getattr(inspect.unwrap(cls.forward), "__module__", "").startswith("transformers.models.")
    )


def _hooked(module: torch.nn.Module) -> bool:
    """Whether anything would see this module's call that a direct call of its children would bypass: its hooks
    (cpu_linear.hooked: hooks, accelerate's), backward pre-hooks, a forward set on the instance, a compiled call,
    a global module hook."""
    return bool(
        hooked(module)
        or module._backward_pre_hooks
        or "forward" in module.__dict__
        or getattr(module, "_compiled_call_impl", None) is not None
        or torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
        or torch_module._global_backward_hooks
        or torch_module._global_backward_pre_hooks
    )


def refusal(model: torch.nn.Module) -> str | None:
    """Why batchrun does not run `model`'s outer forwards itself (None: it does)."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, torch.nn.Module):
        return "the causal LM holds no `model` decoder stack"
    if not _form(type(model), KNOWN_CAUSAL_LM):
        return f"{type(model).__name__}.forward is not a form decoder_stack.py knows"
    if not _form(type(inner), KNOWN_MODEL):
        return f"{type(inner).__name__}.forward is not a form decoder_stack.py knows"
    if decoder_of(model) is not inner:
        return "its decoder (get_decoder) is not its `model`"
    config = inner.config
    if getattr(config, "_attn_implementation", None) != ATTENTION_NAME:
        return "it does not attend by batchrun's attention (whose masks transformers leaves to it: None)"
    return _config_refusal(inner)


def _config_refusal(inner: torch.nn.Module) -> str | None:
    """What of the config would make HF's forward differ from the stack's (read at load and every step)."""
    config = inner.config
    if getattr(config, "is_causal", None) is not None:
        return "the config sets `is_causal`, which HF's forward passes to every layer"
    if len(inner.layers) != config.num_hidden_layers:
        return f"the model holds {len(inner.layers)} layers, its config runs {config.num_hidden_layers}"
    return None


class HFForward:
    """The model's own forward (the general case)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def logits(self, input_ids, position_ids, logits_to_keep, **kwargs) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=logits_to_keep,
            **kwargs,  # the step's metadata, a vision-language model's image inputs
        )
        return out.logits[0]

    def decoder(self, input_ids, position_ids, **kwargs) -> None:
        """The decoder alone, for the K/V it writes (a step where nothing samples)."""
        decoder_of(self.model)(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)


class DecoderStack(HFForward):
    """The outer forwards' five module calls made directly (the module docstring says when and why)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self.inner = model.model
        # the classes' forwards the form was read from: replaced later (a patch after load), HF's runs
        self.forwards = (type(model).forward, type(self.inner).forward)
        self.num_layers = len(self.inner.layers)

    def _intact(self, outer: bool) -> bool:
        """Whether the step may run the stack: what was checked at load still holds (each step: a hook, a
        patch or a config change may come after the load; a few attribute reads)."""
        model, inner = self.model, self.inner
        return (
            type(model).forward is self.forwards[0]
            and type(inner).forward is self.forwards[1]
            and not (outer and _hooked(model))
            and not _hooked(inner)
            and self._config_unchanged(inner.config.__dict__)
        )

    def _config_unchanged(self, config: dict) -> bool:
        """`_config_refusal`'s two checks on the config's own attributes, as a step can afford them (a config
        attribute read goes through transformers' `__getattribute__`: microseconds each)."""
        return config.get("is_causal") is None and config.get("num_hidden_layers") == self.num_layers

    def logits(self, input_ids, position_ids, logits_to_keep, **kwargs) -> torch.Tensor:
        if not self._intact(outer=True):
            return super().logits(input_ids, position_ids, logits_to_keep, **kwargs)
        hidden = self._hidden_states(input_ids, position_ids, kwargs)
        return self.model.lm_head(slice_logits_to_keep(hidden, logits_to_keep))[0]

    def decoder(self, input_ids, position_ids, **kwargs) -> None:
        if not self._intact(outer=False):
            return super().decoder(input_ids, position_ids, **kwargs)
        self._hidden_states(input_ids, position_ids, kwargs)

    def _hidden_states(self, input_ids, position_ids, kwargs: dict) -> torch.Tensor:
        inner = self.inner
        hidden = inner.embed_tokens(input_ids)
        # Llama's form passes position_ids by keyword, Qwen2's by position: the same call for the module
        position_embeddings = inner.rotary_emb(hidden, position_ids=position_ids)
        for layer in inner.layers:
            hidden = layer(
                hidden,
                attention_mask=None,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=None,
                use_cache=False,
                **kwargs,
            )
        return inner.norm(hidden)


def forward_of(model: torch.nn.Module) -> HFForward:
    """The forward a step runs: batchrun's `DecoderStack` where the model's outer forwards are a known form,
    HF's own otherwise."""
    return HFForward(model) if refusal(model) is not None else DecoderStack(model)
