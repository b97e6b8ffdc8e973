"""Shared engines for framework components: one :class:`PromptCache` per ``(model, cache_dir)``
in a process, and one :class:`~.marked.Assembler` per engine and system prompt.

LlamaIndex and LangChain classes are built from plain config (so they serialize); each
resolves its engine here, so every component with the same config shares one engine and
one store.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ..conditioning import LearnedPrefix
from ..engine import PromptCache
from .assembler import Assembler
from .marks import DEFAULT_SYSTEM

_ENGINES: dict[tuple[str, str], PromptCache] = {}
_ASSEMBLERS: dict[tuple[int, str, str], Assembler] = {}
_REG_LOCK = threading.Lock()


def default_states_dir() -> Path:
    """Where framework components keep document states by default (``$PCACHE_RAG_HOME/states``).
    Keys carry the model's fingerprint, so several models share the folder safely."""
    from ..fsutil import cache_home

    return cache_home() / "states"


def shared_engine(model: str | None = None, cache_dir: str | None = None) -> PromptCache:
    """One :class:`PromptCache` per ``(model, cache_dir)`` in this process, loaded on first use
    (decoding, and computing over cached states, with the RAG default's bf16 weights).
    Framework classes are built from this plain config (so they serialize), and every class
    with the same config shares one engine and one store."""
    key = _engine_key(model, cache_dir)
    with _REG_LOCK:
        pc = _ENGINES.get(key)
        if pc is None:
            from ..models.fast_decode import RAG_DECODE_WEIGHTS, RAG_QUERY_WEIGHTS

            pc = _ENGINES[key] = PromptCache.from_pretrained(None if key[0] == "default" else key[0],
                                                             cache_dir=key[1], decode_weights=RAG_DECODE_WEIGHTS,
                                                             query_weights=RAG_QUERY_WEIGHTS)
        return pc


def register_engine(pc: PromptCache, model: str | None = None, cache_dir: str | None = None) -> None:
    """Make ``pc`` the engine that :func:`shared_engine` returns for this config (an engine
    built in code, e.g. with its own store, used by config-built framework classes)."""
    with _REG_LOCK:
        _ENGINES[_engine_key(model, cache_dir)] = pc


def _engine_key(model, cache_dir) -> tuple[str, str]:
    from ..default_model import DEFAULT_NAME

    name = "default" if model in (None, "", "default", DEFAULT_NAME) else str(Path(str(model)).expanduser())
    return name, str(Path(cache_dir or default_states_dir()).expanduser())


def assembler_for(pc: PromptCache, system_prompt: str = DEFAULT_SYSTEM,
                  conditioning: str | LearnedPrefix = "default") -> Assembler:
    """The :class:`Assembler` of ``pc`` for documents encoded against ``system_prompt`` under
    ``conditioning`` (memoized): ``"default"`` (the model's installed learned prefix, else the
    neutral passage), a spec, or a :class:`~pcache_rag.conditioning.LearnedPrefix`. A component
    answering from an index passes the index's own (:func:`pcache_rag.rag.index_conditioning`),
    so its chunks' states are read as the index stored them."""
    spec = conditioning.spec if isinstance(conditioning, LearnedPrefix) else str(conditioning)
    with _REG_LOCK:
        a = _ASSEMBLERS.get((id(pc), system_prompt, spec))
        if a is None or a.pc is not pc:
            if isinstance(conditioning, LearnedPrefix):
                a = Assembler(pc, system_prompt, prefix=conditioning)
            else:
                a = Assembler(pc, system_prompt, conditioning=conditioning)
            _ASSEMBLERS[(id(pc), system_prompt, spec)] = a
        return a
