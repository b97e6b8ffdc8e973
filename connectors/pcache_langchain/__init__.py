"""LangChain integration: a handle retriever, a cached LLM, and a question -> answer chain."""

from .base import PromptCacheLLM, PromptCacheRetriever, build_qa_chain, handles_from_documents

__all__ = ["PromptCacheRetriever", "PromptCacheLLM", "build_qa_chain", "handles_from_documents"]
