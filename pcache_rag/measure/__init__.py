"""Measurement, kept out of the library core: the benchmarks (``pcache-rag bench``) and the
quality eval (``pcache-rag eval quality``). Nothing in the engine, the store, RAG or the
server imports this package."""
