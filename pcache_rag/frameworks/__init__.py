"""The cache inside other frameworks' pipelines: prompts with marked or discovered documents
(:mod:`.marked`) and the engines framework components share (:mod:`.registry`). Built on the
engine's public API only; the LlamaIndex and LangChain connectors import from here."""

from ..conditioning import neutral_text, parse_conditioning
from .marked import (
    DEFAULT_CONDITIONING,
    DEFAULT_SYSTEM,
    DOC_CLOSE,
    DOC_OPEN,
    DOC_SEPARATOR,
    MIN_CONDITIONED_TOKENS,
    Assembler,
    CachedOutput,
    PCacheFallbackWarning,
    Segment,
    document_ids,
    format_documents,
    mark_document,
    preamble_ids,
    sampling,
    split_marked,
    unmark,
)
from .registry import assembler_for, default_states_dir, register_engine, shared_engine

__all__ = ["Assembler", "MIN_CONDITIONED_TOKENS", "DEFAULT_CONDITIONING", "sampling", "shared_engine",
           "register_engine", "assembler_for", "default_states_dir", "Segment", "CachedOutput",
           "PCacheFallbackWarning", "mark_document", "format_documents", "split_marked", "unmark", "DOC_OPEN",
           "DOC_CLOSE", "DOC_SEPARATOR", "DEFAULT_SYSTEM", "preamble_ids", "document_ids", "neutral_text",
           "parse_conditioning"]
