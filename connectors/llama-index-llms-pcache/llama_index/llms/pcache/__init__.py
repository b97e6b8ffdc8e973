"""LlamaIndex integration: a cached LLM, an ingestion encoder for any vector store, a response
synthesizer and chat engine that read documents from cached states, readers for PDF/HTML/DOCX,
and a retriever over pcache-rag indexes."""

from .base import (PromptCacheChatEngine, PromptCacheEncoder, MiniLMEmbedding, PromptCacheFileReader, PromptCacheLLM,
                   PromptCacheRetriever, PromptCacheSynthesizer, build_query_engine, file_extractor)

__all__ = ["PromptCacheLLM", "PromptCacheEncoder", "PromptCacheSynthesizer", "PromptCacheChatEngine",
           "PromptCacheRetriever", "PromptCacheFileReader", "file_extractor", "build_query_engine", "MiniLMEmbedding"]
