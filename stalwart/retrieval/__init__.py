"""Retrieval: an embeddings model's vectors in a vector store, hybrid (vector + BM25) search scoped to a
tenant inside the query, crash-safe ingest, and the pieces retrieval-augmented completions use."""
