"""The pooling runner: texts in, one vector each out, on the model's own `transformers` code.

Each step packs the queued texts into one row of tokens with no padding (up to `max_num_batched_tokens` tokens
and `max_num_seqs` texts), runs the stock base model (`AutoModel`: BERT, XLM-R, ModernBERT, Qwen3 ...) on it with
batchrun's attention function, the generation engine's, given the step's packed layout (attention/packed.py: each
text attends only to itself, no K/V kept), positions restarting at 0
for every text, and pools each text's token states as the checkpoint says (`PoolingPlan`): pooling, then its
Dense and Normalize modules, then Matryoshka truncation, in fp32 whatever the model's dtype (sentence_modules.py).
No K/V is kept: a text is done when its step is.

The tokens are sentence-transformers': the prompt put before the text, the tokenizer's special tokens (an
end-of-text appended where its post-processor appends one, as Qwen3-Embedding's does), cut at the longest text
it allows. A model class whose attention does not go through transformers' attention interface is refused at
load (`UnsupportedModel`), as is one the engine's load probe refuses (architecture.inspect_model: a layer that
does not reach batchrun's attention function, an argument batchrun does not honour) and one whose texts reach
across each other in a packed row.
"""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchrun.engine import cpu_kernels
from batchrun.engine.attention import METADATA_KEYWORD, PackedLayout, UnsupportedModel, int_tensor
from batchrun.engine.model.architecture import inspect_model, rope_types
from batchrun.engine.model.loading import load_model
from batchrun.engine.model.ops import fused_rotary
from batchrun.engine.model.ops.per_sequence_rope import LENGTH_DEPENDENT_ROPE
from batchrun.engine.model.prepare import Preparation, prepare_model
from batchrun.engine.pooling.pooler import PoolingPlan
from batchrun.engine.pooling.sentence_modules import after_pooling, load_modules, pool


@dataclass
class EncodedText:
    """A text's tokens as the runner takes them (`PoolingRunner.encode`, `encode_pair`, `encode_conversation`)."""

    token_ids: list[int]
    truncated: bool = False  # cut at the longest text allowed
    token_type_ids: list[int] | None = None  # a pair's segments (BERT's 0s, then 1s); None: all 0


@dataclass
class PooledText:
    """A queued text: its tokens, how many of the first are the prompt's (pooled or not, as the plan says)."""

    request: Any
    token_ids: list[int]
    prompt_tokens: int
    truncated: bool = False  # cut at the longest text allowed
    token_type_ids: list[int] | None = None


@dataclass
class PoolingStep:
    """One step's finished texts with their vectors, and what it computed: tokens, and the tokens a batch padded
    to its longest text would have computed on top."""

    finished: list[tuple[PooledText, torch.Tensor]]
    num_tokens: int
    num_padded_tokens: int


def position_offset(model) -> int:
    """The first position id of a text. RoBERTa's family (XLM-R, CamemBERT) numbers positions from
    padding_idx + 1, computing them from the input ids where none are given; a packed row gives them, so it
    gives them as the model would."""
    embeddings = getattr(model, "embeddings", None)
    if embeddings is not None and hasattr(embeddings, "create_position_ids_from_input_ids"):
        return embeddings.padding_idx + 1
    return 0


class PoolingRunner:
    """Texts in, one vector each out (task: embed); engine/pooling/classifier.py's runner puts the model's own
    classification head in place of the pooling."""

    tasks = ("embed",)  # what the runner computes (LLM.embed; a job's `task`)
    auto_class = "AutoModel"  # the transformers class the checkpoint loads as
    cuts_texts = True  # a text over the longest allowed is cut, as sentence-transformers' encode cuts it

    def __init__(
        self,
        model_dir: Path,
        plan: PoolingPlan,
        config,
        dtype: torch.dtype,
        device: torch.device,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        pack_weights: bool = False,
    ):
        """`config`: the transformers config of the model's folder, as the job's checks read it (read once,
        pooling_worker.read_checkpoint); `pack_weights`: on the CPU, linear weights packed for oneDNN where it
        can (engine.pack_weights)."""
        self.plan = plan
        self.model_dir = model_dir / plan.transformer_path  # the transformers model's folder
        self.device, self.dtype = device, dtype
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.tokenizer, model = load_model(self.model_dir, dtype, device, config, auto_class=self.auto_class)
        self.model = self._base_model(model)
        # the CPU rewrites (prepare.py), generation's: how many modules each rewrote
        self.rewrites = prepare_model(self.model, Preparation(device, dtype, pack_weights))
        # bf16 texts of a few dozen tokens or more attend by generation's C++ prompt kernel (attention/packed.py)
        cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16
        self.attention_kernel = cpu_kernels.load() if cpu_bf16 else None
        config = self.model.config
        self.position_offset = position_offset(self.model)
        max_positions = getattr(config, "max_position_embeddings", None)
        self.max_positions = None if max_positions is None else max_positions - self.position_offset
        if plan.max_length is not None:
            self.max_length = plan.max_length
        else:  # sentence-transformers' default: the tokenizer's limit, capped at the model's positions
            self.max_length = min(
                self.tokenizer.model_max_length, max_positions or self.tokenizer.model_max_length
            )
        self.pair_max_length = plan.pair_max_length or self.max_length
        self.takes_token_types = "token_type_ids" in inspect.signature(self.model.forward).parameters
        self.dense = load_modules(plan.after, device)  # fp32, as the pooling (sentence_modules.py)
        self.prompt_length = (
            self._prompt_length(plan.prompt) if plan.prompt and not plan.include_prompt else 0
        )
        self.queue: deque[PooledText] = deque()
        self.layer_specs = None  # each layer's call, frozen by the probe's first forward
        self._probe()

    def _base_model(self, model):
        """The model the packed row runs through (the loaded model itself: a base model)."""
        return model

    def result(self, vector: torch.Tensor, task: str) -> dict:
        """A text's output columns from its vector (task: embed)."""
        return {"embedding": vector.float().tolist()}

    # ---- texts -> tokens ---------------------------------------------------------------------------------------
    def encode(self, text: str) -> EncodedText:
        """The text's tokens as sentence-transformers makes them: the plan's prompt before it, the tokenizer's
        special tokens, cut at the longest text allowed (where `cuts_texts`). ValueError for a text the model
        cannot take."""
        return self._checked(self.tokenizer(self.plan.prompt + text, **self._cut()))

    def _cut(self) -> dict:
        """The tokenizer's arguments that cut a text (not a pair) at the longest allowed, where the runner cuts."""
        return {"truncation": True, "max_length": self.max_length} if self.cuts_texts else {}

    def encode_pair(self, text: str, pair: str) -> EncodedText:
        """A pair's tokens as the model's tokenizer makes a pair (as sentence-transformers' CrossEncoder and
        transformers do): both texts between the tokenizer's special tokens, with their segment ids, the longer
        one cut first when the two are over the longest text allowed. Tokenized as a batch of one pair, as
        CrossEncoder tokenizes its batches: called with one pair, a tokenizer takes an empty second text for none
        (no separator after it). The plan's pair prompt (a cross-encoder's) goes before the first text, as
        CrossEncoder.predict puts it, and the pair is cut at the plan's pair_max_length where it has one."""
        encoded = self.tokenizer(
            [self.plan.pair_prompt + text], [pair], truncation=True, max_length=self.pair_max_length
        )
        return self._checked(encoded, batch_of_one=True)

    def encode_conversation(self, turns: list[dict]) -> EncodedText:
        """A conversation's tokens through the tokenizer's chat template, with no generation prompt (a reward
        model reads the whole conversation, its last reply included), as `apply_chat_template(tokenize=True)`
        makes them. ValueError when the tokenizer has no chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("a conversation, and the model's tokenizer has no chat template (give a text)")
        text = self.tokenizer.apply_chat_template(turns, tokenize=False)
        return self._checked(self.tokenizer(text, add_special_tokens=False, **self._cut()), "conversation")

    def _checked(self, encoded, what: str = "text", batch_of_one: bool = False) -> EncodedText:
        """The tokenizer's output (of one text, or a batch of one) as the runner takes it; ValueError for a text
        the model cannot take (`what`: text, or conversation): none of its tokens, or more than the model's
        positions."""
        ids = encoded["input_ids"][0] if batch_of_one else encoded["input_ids"]
        truncated = bool(encoded.encodings and encoded.encodings[0].overflowing)
        if not ids:
            raise ValueError(f"the {what} has no tokens")
        if self.max_positions is not None and len(ids) > self.max_positions:
            raise ValueError(
                f"the {what} has {len(ids)} tokens, more than the model's {self.max_positions} positions (set "
                "pooler.truncate_prompt_tokens to cut it)"
            )
        types = encoded.get("token_type_ids") if self.takes_token_types else None
        types = types[0] if types and batch_of_one else types
        return EncodedText(ids, truncated, types if types and any(types) else None)

    def _prompt_length(self, prompt: str) -> int:
        """The prompt's tokens at the head of every text, as sentence-transformers counts them: the prompt
        tokenized alone, less a special token it ends with (an end-of-text or separator)."""
        ids = self.tokenizer(prompt, truncation=True, max_length=self.max_length)["input_ids"]
        return len(ids) - (1 if ids and ids[-1] in self.tokenizer.all_special_ids else 0)

    # ---- the queue and the steps --------------------------------------------------------------------------------
    def add(self, text: EncodedText, request: Any) -> None:
        self.queue.append(
            PooledText(request, text.token_ids, self.prompt_length, text.truncated, text.token_type_ids)
        )

    @property
    def num_waiting(self) -> int:
        return len(self.queue)

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step(self) -> PoolingStep:
        """Pool the next texts that fit one step (at least one)."""
        texts = [self.queue.popleft()]
        tokens = len(texts[0].token_ids)
        while self.queue and len(texts) < self.max_num_seqs:
            n = len(self.queue[0].token_ids)
            if tokens + n > self.max_num_batched_tokens:
                break
            texts.append(self.queue.popleft())
            tokens += n
        vectors = self.embed_packed(texts)
        longest = max(len(t.token_ids) for t in texts)
        return PoolingStep(list(zip(texts, vectors)), tokens, longest * len(texts) - tokens)

    @torch.inference_mode()
    def embed_packed(self, texts: list[PooledText]) -> torch.Tensor:
        """[len(texts), output_dim]: the texts in one packed row through the model, then each text's vector."""
        hidden, layout = self._forward([t.token_ids for t in texts], [t.token_type_ids for t in texts])
        return self._heads(hidden, texts, layout)

    def _heads(self, hidden: torch.Tensor, texts: list[PooledText], layout: PackedLayout) -> torch.Tensor:
        """Each text's fp32 vector from its token states: pooled, then the checkpoint's Dense and Normalize."""
        pooled = torch.stack(
            [pool(hidden[a:b], self.plan.modes, t.prompt_tokens) for t, (a, b) in zip(texts, layout.spans())]
        )
        return after_pooling(pooled, self.dense, self.plan.dimensions, self.plan.normalize_output)

    def _forward(
        self, token_lists: list[list[int]], type_lists: list[list[int] | None] | None = None
    ) -> tuple[torch.Tensor, PackedLayout]:
        """The packed row through the model: its last hidden states [T, H] and its layout (the texts in the
        layout's packing order: text i's states are at `layout.spans()`'s i-th). `type_lists`: each text's
        segment ids (None: all 0), for a model that takes them."""
        layout = PackedLayout.of_lengths(
            [len(ids) for ids in token_lists], self.layer_specs, self.attention_kernel
        )
        ids = int_tensor(layout.packed(token_lists), device=self.device)[None]
        offset = self.position_offset
        positions = layout.packed([range(offset, offset + len(ids)) for ids in token_lists])
        inputs = {"input_ids": ids, "position_ids": int_tensor(positions, device=self.device)[None]}
        if self.takes_token_types and any(type_lists or ()):
            segments = [kinds or [0] * len(ids) for ids, kinds in zip(token_lists, type_lists)]
            inputs["token_type_ids"] = int_tensor(layout.packed(segments), device=self.device)[None]
        elif self.takes_token_types:
            inputs["token_type_ids"] = torch.zeros_like(ids)
        with fused_rotary.applied():
            out = self.model(**inputs, use_cache=False, **{METADATA_KEYWORD: layout})
        return out.last_hidden_state[0], layout

    def _probe(self) -> None:
        """The load's checks: the engine's own probe (architecture.inspect_model: every layer reaches batchrun's
        attention function, every argument of its calls is honoured or refused), then what a packed row adds: a
        text's token states must not change beside another (its positions restart, nothing crosses texts), and
        what the packed attention does not compute (soft-capping, sinks) is refused by its first call here.
        That first forward's calls are frozen (`layer_specs`): later steps check only that each layer passes the
        same keywords (attention.interface.packed_forward)."""
        name = type(self.model).__name__
        # LongRoPE and dynamic NTK take their factors from the longest position of the forward: over a packed
        # row of texts, a text's vector would depend on its batch-mates (generation computes them per sequence,
        # per_sequence_rope.py; a pooling forward has no such split)
        for rope in sorted(rope_types(self.model.config) & LENGTH_DEPENDENT_ROPE):
            raise UnsupportedModel(
                f"{name} cannot run on batchrun: its RoPE scaling `{rope}` takes its factors from the longest "
                "text of a packed row, so a text's vector would depend on the texts beside it"
            )
        if "position_ids" not in inspect.signature(self.model.forward).parameters:
            raise UnsupportedModel(f"{name} cannot run on batchrun: its forward takes no position_ids")
        attention = inspect_model(self.model)
        if attention.states is not None:  # a hybrid's states (cache_spec.StateSpec)
            raise UnsupportedModel(
                f"{name} cannot run on batchrun: some of its layers keep a state from token to token (a hybrid), "
                "which a packed row of texts does not give each text"
            )
        # what the probe knows of a layer beyond its call (architecture.ModelLayers) and the packed attention
        # does not compute: a chunk (Llama 4's, only in `layer_types`), a window of the mask alone (Phi-MoE's) or a
        # query scale by true position
        layers = attention.layers
        for i, call in enumerate(attention.calls):
            # a window in the mask alone: a packed call takes the window its call passes
            mask_only = call is not None and "sliding_window" not in call.signature.keywords
            asks = [
                what
                for what, found in (
                    (f"chunked attention ({layers.chunk(i)} tokens)", layers.chunk(i)),
                    (
                        f"a window of {layers.window(i)} tokens in its mask alone",
                        mask_only and layers.window(i),
                    ),
                    ("a query scale by position", layers.query_scale_fix(i)),
                )
                if found
            ]
            if asks:
                raise UnsupportedModel(
                    f"{name} cannot run on batchrun as a pooling model: layer {i} asks for {asks[0]}"
                )
        vocab = self.model.config.vocab_size
        text, other = [i % vocab for i in range(5, 11)], [i % vocab for i in range(20, 29)]
        try:
            with torch.inference_mode():
                alone, layout = self._forward([text])
                self.layer_specs = tuple(layout.probed)
                beside, layout_beside = self._forward([other, text])
        except UnsupportedModel as e:
            raise UnsupportedModel(f"{name} cannot run on batchrun: {e}") from None
        tolerance = 1e-3 if self.dtype == torch.float32 else 5e-2
        scale = alone.abs().max().item() + 1.0
        a, b = list(layout_beside.spans())[1]
        if (alone - beside[a:b]).abs().max().item() > tolerance * scale:
            raise UnsupportedModel(
                f"{name} cannot run on batchrun: a text's token states change beside another text in one packed "
                "row (something in the model reaches across texts besides attention)"
            )
