"""RAG over cached documents: ingestion, the chroma index, handle retrieval, answering."""

from .chunking import Chunk, find_files, split_tokens
from .embed import MiniLMEmbedder
from .pipeline import DEFAULT_SYSTEM, CachedRAG, IngestReport, ModuleHandle, RAGAnswer

__all__ = ["CachedRAG", "ModuleHandle", "RAGAnswer", "IngestReport", "MiniLMEmbedder", "Chunk", "find_files",
           "split_tokens", "DEFAULT_SYSTEM"]
