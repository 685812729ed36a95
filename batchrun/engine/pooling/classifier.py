"""The runner of a sequence-classification checkpoint (task: classify, score, reward): its base model over the
packed row, then its own head per text.

The head is the model's own code: its `*ForSequenceClassification.forward` runs once per text with its base
model replaced, for that call, by `_TextStates`, which hands over the text's token states from the packed row
(and its pooler's output, for a base model with a pooler, as BERT's). So whatever the head reads (BERT's pooled
first token, RoBERTa's first token, ModernBERT's mean or CLS, a decoder's last token that is not padding, found
from the text's own ids) is what it reads when transformers runs the text alone.

What a task makes of the logits (`HEAD_RESULTS`):
- classify: probabilities, the softmax of the logits (a sigmoid each for a `multi_label_classification`
  checkpoint), and the label, `id2label` of the most likely;
- score (a cross-encoder or reranker over a pair): its one logit through the checkpoint's activation, as
  sentence-transformers' CrossEncoder applies it (`score_activation`: the one its files name, read as
  CrossEncoder reads them, else a sigmoid);
- reward (a reward model's score head): its one logit as it is.
"""

from __future__ import annotations

import functools

import torch

from batchrun.engine.attention import PackedLayout, UnsupportedModel
from batchrun.engine.pooling.runner import PooledText, PoolingRunner
from batchrun.engine.pooling.sentence_config import CrossEncoderActivation, cross_encoder_activation

# the activations a cross-encoder may name (a torch class path, as sentence-transformers saves it; the short
# paths import the same classes)
_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.Tanh": torch.tanh,
    "torch.nn.Sigmoid": torch.sigmoid,
    "torch.nn.Identity": lambda x: x,
    "torch.nn.Tanh": torch.tanh,
}


def score_activation(activation: CrossEncoderActivation):
    """The function of a cross-encoder's activation (sentence_config.cross_encoder_activation). One batchrun
    cannot apply is refused (UnsupportedModel naming it and where it was read), never replaced by another."""
    if activation.name not in _ACTIVATIONS:
        raise UnsupportedModel(
            f"the cross-encoder's activation {activation.name!r} ({activation.source}) is not one batchrun applies "
            f"({', '.join(_ACTIVATIONS)})"
        )
    return _ACTIVATIONS[activation.name]


class _TextStates(torch.nn.Module):
    """Stands in for the base model inside the head's forward: returns one text's token states."""

    def __init__(self, base: torch.nn.Module):
        super().__init__()
        self.pooler = getattr(base, "pooler", None)
        self.states: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        """The base model's output as its head reads it: with its pooler's output (an encoder with a pooler, whose
        head takes `outputs[1]`), or as a decoder's (its head reads `.cache` too)."""
        from transformers.modeling_outputs import BaseModelOutputWithPast, BaseModelOutputWithPooling

        states = self.states[None]
        if self.pooler is not None:
            return BaseModelOutputWithPooling(last_hidden_state=states, pooler_output=self.pooler(states))
        return BaseModelOutputWithPast(last_hidden_state=states)


def _classification(runner: ClassifierRunner, logits: torch.Tensor) -> dict:
    config = runner.classifier.config
    if config.problem_type == "multi_label_classification":
        probs = logits.sigmoid()
    else:
        probs = logits.softmax(dim=-1)
    return {"label": str(config.id2label[int(probs.argmax())]), "probs": probs.tolist()}


def _relevance(runner: ClassifierRunner, logits: torch.Tensor) -> dict:
    return {"score": float(runner.score_activation(logits)[0])}


def _reward(runner: ClassifierRunner, logits: torch.Tensor) -> dict:
    return {"score": float(logits[0])}


HEAD_RESULTS = {"classify": _classification, "score": _relevance, "reward": _reward}


class ClassifierRunner(PoolingRunner):
    tasks = tuple(HEAD_RESULTS)
    auto_class = "AutoModelForSequenceClassification"

    def _base_model(self, model):
        self.classifier = model
        # a text or conversation runs whole, as transformers runs it alone (one over the model's positions is the
        # row's error), unless pooler.truncate_prompt_tokens asks for a cut; a pair is cut as CrossEncoder cuts it
        self.cuts_texts = self.plan.max_length is not None
        return model.base_model

    @functools.cached_property
    def activation(self) -> CrossEncoderActivation:
        """What task score applies to the head's logit, as sentence-transformers' CrossEncoder does (read when
        first asked: a classify or reward job does not depend on it)."""
        return cross_encoder_activation(self.model_dir, self.classifier.config.num_labels)

    @functools.cached_property
    def score_activation(self):
        return score_activation(self.activation)

    @torch.inference_mode()
    def _heads(self, hidden: torch.Tensor, texts: list[PooledText], layout: PackedLayout) -> torch.Tensor:
        """[len(texts), num_labels] fp32: each text's logits from its head."""
        prefix = self.classifier.base_model_prefix
        stand_in = _TextStates(self.model)
        setattr(self.classifier, prefix, stand_in)
        try:
            logits = []
            for text, (a, b) in zip(texts, layout.spans()):
                stand_in.states = hidden[a:b]
                ids = torch.tensor([text.token_ids], device=hidden.device)
                logits.append(self.classifier(input_ids=ids).logits[0])
        finally:
            setattr(self.classifier, prefix, self.model)
        return torch.stack(logits).float()

    def result(self, logits: torch.Tensor, task: str) -> dict:
        return HEAD_RESULTS[task](self, logits)
