"""pcache-rag: Prompt Cache (modular attention reuse) for retrieval-augmented generation.

Reusable prompt pieces are declared as modules in a PML schema; their attention
states are computed once; a prompt that imports them computes only its new
tokens. See README.md for the two commands that run everything, and docs/layout.md
for where each part lives.

What users import: :class:`PromptCache` (the engine), :class:`CachedRAG` (documents in,
answers out; loaded on first use, since it brings chromadb), :class:`Recompute`,
:class:`SamplingParams`, :func:`escape`, and the errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .engine import ContextOverflowError, Generation, GenerationOutput, PrefillResult, PromptCache, SamplingParams
from .models import UnsupportedModelError
from .pml import PMLError, escape
from .recompute import Recompute

if TYPE_CHECKING:
    from .rag import CachedRAG, IngestTooLargeError

__version__ = "0.1.0"
__all__ = ["PromptCache", "CachedRAG", "Recompute", "SamplingParams", "Generation", "GenerationOutput",
           "PrefillResult", "escape", "PMLError", "UnsupportedModelError", "ContextOverflowError",
           "IngestTooLargeError"]


def __getattr__(name: str) -> Any:
    if name in ("CachedRAG", "IngestTooLargeError"):  # RAG brings chromadb: imported on first use
        from . import rag

        return getattr(rag, name)
    raise AttributeError(f"module 'pcache_rag' has no attribute {name!r}")
