"""LlamaIndex integration: a cached LLM, a handle retriever, a handle synthesizer, a query engine."""

from .base import ModuleRetriever, ModuleSynthesizer, PromptCacheLLM, build_query_engine, handles_from_nodes

__all__ = ["PromptCacheLLM", "ModuleRetriever", "ModuleSynthesizer", "build_query_engine", "handles_from_nodes"]
