"""Sentence embeddings and reranking from the models a server holds beside its chat models: which encoder a
path holds (``encoders``), and decoders read through an engine's pooling requests (``decoder_encoder``)."""
