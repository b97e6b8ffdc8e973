"""LangChain integration: a cached chat model, a document encoder for any vector store,
the drop-in documents chain, a retriever over pcache-rag indexes, and a text LLM."""

from .base import (ChatPromptCache, MiniLMEmbeddings, PromptCacheDocumentEncoder, PromptCacheRetriever, PromptCacheTextLLM,
                   build_qa_chain, create_cached_documents_chain, format_docs)

__all__ = ["ChatPromptCache", "PromptCacheDocumentEncoder", "PromptCacheRetriever", "PromptCacheTextLLM",
           "build_qa_chain", "create_cached_documents_chain", "format_docs", "MiniLMEmbeddings"]
