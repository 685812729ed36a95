"""Pooling jobs: embeddings, scores and classes from a model's token states, as sentence-transformers and HF
make them."""
