"""A prompt's token ids against the model's input embedding: the one check every prompt passes after it is
tokenized (text, a conversation, token ids given as they are; generation and pooling alike), before it is
queued. An id the embedding has no row for would fail the lookup (IndexError) inside a step and take every
prompt of that step down with it; here it is that prompt's error. A text makes such ids when its tokenizer has
tokens the embedding lacks (tokens added to the tokenizer without resizing the model's embeddings).

The bound is the embedding's own row count, not `config.vocab_size`: the lookup indexes the rows, and the two
can differ (a composite config whose text part declares another size, a checkpoint edited by hand); an id below
the row count embeds as Hugging Face's forward embeds it, one at or past it cannot run anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence


def embedding_rows(model) -> int:
    """How many token ids the model embeds: its input embedding's rows (the config's vocab_size where the
    embedding does not say)."""
    embedding = model.get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)
    if rows is None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        rows = config.vocab_size
    return rows


def token_id_error(token_ids: Sequence[int], rows: int, placeholder: int | None = None) -> str | None:
    """Why these token ids cannot be embedded by an embedding of `rows` rows, or None. `placeholder`: the image
    token of a prompt with images, which a vision-language model's forward replaces before its embedding (Gemma
    3's and PaliGemma's may lie past it)."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < rows):
        return None  # the common case, at C speed
    for position, token in enumerate(token_ids):
        if not 0 <= token < rows and token != placeholder:
            return (
                f"token id {token} (position {position}) is outside the vocabulary: this model's input "
                f"embedding has {rows} rows (token ids 0 .. {rows - 1})"
            )
    return None
