"""The classification runner (task: classify): a sequence-classification checkpoint's base model over the packed
row, then its own head per text.

The head is the model's own code: its `*ForSequenceClassification.forward` runs once per text with its base
model replaced, for that call, by `_TextStates`, which hands over the text's token states from the packed row
(and its pooler's output, for a base model with a pooler, as BERT's). So whatever the head reads (BERT's pooled
first token, RoBERTa's first token, ModernBERT's mean or CLS, a decoder's last token that is not padding, found
from the text's own ids) is what it reads when transformers runs the text alone. Probabilities are the softmax
of the logits (a sigmoid each for a `multi_label_classification` checkpoint), and the label is `id2label` of the
most likely.
"""

from __future__ import annotations

import torch

from .packed_attention import PackedLayout
from .pooling import PooledText, PoolingRunner


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


class ClassifierRunner(PoolingRunner):
    task = "classify"
    auto_class = "AutoModelForSequenceClassification"

    def _base_model(self, model):
        self.classifier = model
        return model.base_model

    @torch.inference_mode()
    def _heads(self, hidden: torch.Tensor, texts: list[PooledText], layout: PackedLayout) -> torch.Tensor:
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
        logits = torch.stack(logits).float()
        if self.classifier.config.problem_type == "multi_label_classification":
            return logits.sigmoid()
        return logits.softmax(dim=-1)

    def result(self, vector: torch.Tensor) -> dict:
        labels = self.classifier.config.id2label
        return {"label": str(labels[int(vector.argmax())]), "probs": vector.tolist()}
