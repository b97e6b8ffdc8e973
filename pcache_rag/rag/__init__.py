"""RAG over cached documents: ingestion, the chroma index, handle retrieval, answering."""

from .chunking import Chunk, SkipFile, find_files, scan, split_tokens
from .embed import MiniLMEmbedder
from .index import IndexDamagedError
from .pipeline import (DEFAULT_SYSTEM, CachedRAG, IngestReport, IngestTooLargeError, ModuleHandle, RAGAnswer,
                       VerifyReport, check_index_dir, index_conditioning)
from .index_dir import Index

__all__ = ["CachedRAG", "ModuleHandle", "RAGAnswer", "IngestReport", "VerifyReport", "MiniLMEmbedder", "Chunk",
           "find_files", "scan", "split_tokens", "SkipFile", "DEFAULT_SYSTEM", "IndexDamagedError",
           "IngestTooLargeError", "Index", "check_index_dir", "index_conditioning"]
