"""Corpus discovery, tokenizer training/loading, and the packed, sharded, stateful data loader."""
