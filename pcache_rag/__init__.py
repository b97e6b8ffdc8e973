"""pcache-rag: Prompt Cache (modular attention reuse) for retrieval-augmented generation.

Reusable prompt pieces are declared as modules in a PML schema; their attention
states are computed once; a prompt that imports them computes only its new
tokens. See README.md for the two commands that run everything, and docs/layout.md
for where each part lives.

What users import: :class:`PromptCache` (the engine), :class:`CachedRAG` (documents in,
answers out), :class:`Index` (an index directory: its paths, settings and engine), :class:`Recompute`, :class:`SamplingParams`, :func:`escape`, and the errors.
Each loads on first use (torch, transformers and chromadb are not imported by
``import pcache_rag``), so a connector imports in the time its framework takes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import (ContextOverflowError, Generation, GenerationOutput, Parts, PrefillResult, PromptCache,
                         SamplingParams)
    from .models import UnsupportedModelError
    from .pml import PMLError, escape
    from .rag import CachedRAG, Index, IngestTooLargeError
    from .recompute import Recompute

from . import openmp as _openmp  # noqa: F401  # first, before anything loads torch: OpenMP's short spin

__version__ = "0.1.0"

_LAZY = {"PromptCache": "engine", "Parts": "engine", "SamplingParams": "engine", "Generation": "engine", "GenerationOutput": "engine",
         "PrefillResult": "engine", "ContextOverflowError": "engine", "UnsupportedModelError": "models",
         "PMLError": "pml", "escape": "pml", "Recompute": "recompute", "CachedRAG": "rag", "Index": "rag",
         "IngestTooLargeError": "rag"}

__all__ = ["PromptCache", "Parts", "CachedRAG", "Index", "Recompute", "SamplingParams", "Generation", "GenerationOutput",
           "PrefillResult", "escape", "PMLError", "UnsupportedModelError", "ContextOverflowError",
           "IngestTooLargeError"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'pcache_rag' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{mod}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
