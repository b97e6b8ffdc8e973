"""Documents as cached modules: their content-addressed states and conditioning (:mod:`.states`),
prompts with marked or discovered documents answered from them, the cache inside other
frameworks' pipelines (:mod:`.assembler`), and the engines framework components share
(:mod:`.registry`). Built on the engine's public API only; the LlamaIndex and LangChain
connectors import from here (through :mod:`pcache_rag.connector`, their core).

The marks and segments (:mod:`.marks`) need no model and load at once; the rest loads torch
and the engine on first use, so importing a connector costs what its framework costs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..conditioning import neutral_text, parse_conditioning
from .marks import (
    DEFAULT_CONDITIONING,
    DEFAULT_SYSTEM,
    DOC_CLOSE,
    DOC_OPEN,
    DOC_SEPARATOR,
    DOCUMENTS_HEADER,
    MIN_CONDITIONED_TOKENS,
    PCacheFallbackWarning,
    Segment,
    SegmentKind,
    Segments,
    format_documents,
    mark_document,
    sampling,
    split_marked,
    unmark,
)

if TYPE_CHECKING:
    from .assembler import Assembler
    from .states import DocumentStates, check_prefix, default_conditioning, document_ids, preamble_ids
    from .registry import assembler_for, default_states_dir, register_engine, shared_engine

_LAZY = {"Assembler": "assembler", "CachedOutput": "assembler", "DocumentStates": "states", "check_prefix": "states",
         "default_conditioning": "states", "document_ids": "states", "preamble_ids": "states", "assembler_for": "registry",
         "default_states_dir": "registry", "register_engine": "registry", "shared_engine": "registry"}

__all__ = ["Assembler", "MIN_CONDITIONED_TOKENS", "DEFAULT_CONDITIONING", "sampling", "shared_engine",
           "register_engine", "assembler_for", "default_states_dir", "Segment", "SegmentKind", "Segments",
           "PCacheFallbackWarning", "mark_document", "format_documents", "split_marked", "unmark", "DOC_OPEN",
           "DOC_CLOSE", "DOC_SEPARATOR", "DOCUMENTS_HEADER", "DEFAULT_SYSTEM", "preamble_ids", "document_ids", "default_conditioning",
           "neutral_text", "parse_conditioning", "DocumentStates", "check_prefix"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'pcache_rag.docmodules' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{mod}", __name__), name)
