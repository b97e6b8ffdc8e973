"""The connector core: what the LlamaIndex and LangChain classes share, so each connector is
framework glue only.

A framework class is built from plain config (it must serialize): a ``model`` name or path,
and where document states live, ``index_dir`` (an index made by ``pcache-rag ingest``) or
``cache_dir``. From that config this module gives the engine and the
:class:`~pcache_rag.docmodules.Assembler` (under the index's own conditioning, so its chunks'
states are read as it stored them), a retriever over an index, the packaged MiniLM embedder,
the argument checks, and the usage statistics a response carries. Nothing here loads torch at
import: each function loads what it needs on first use.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .docmodules import Assembler
    from .engine import GenerationOutput, PromptCache
    from .rag import CachedRAG

_EMBEDDER: list[Any] = []
_EMBEDDER_LOCK = threading.Lock()
_BATCH_LOCK = threading.Lock()
_ASYNC_POOL: list[Any] = []
#: worker threads for the connectors' async calls: each waits on the batch while its answer decodes, so
#: there are as many as the batch takes answers (asyncio's default pool has cpu_count + 4: six here)
ASYNC_THREADS = 32


async def in_thread(fn, *args):
    """``fn(*args)`` in a worker thread of the connectors' own pool (:data:`ASYNC_THREADS`), so
    that as many async calls as the batch takes run at once."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    with _BATCH_LOCK:
        if not _ASYNC_POOL:
            _ASYNC_POOL.append(ThreadPoolExecutor(ASYNC_THREADS, thread_name_prefix="pcache-async"))
    return await asyncio.get_running_loop().run_in_executor(_ASYNC_POOL[0], fn, *args)


def share_batch(asm: Assembler) -> None:
    """Start the continuous batch of ``asm``'s engine, once (the async calls' entry): concurrent
    ``ainvoke``/``achat`` calls each run in a worker thread, and with the batch on their answers
    decode together, one forward a token for all, instead of one call after another. Each answer
    is the one it gets alone. A model that cannot batch (ALiBi) keeps answering one at a time."""
    pc = asm.pc
    with _BATCH_LOCK:
        if pc.batch_stats() is None and not pc.batch_refusal:
            pc.start_batching()


def engine_key(model: str | None, index_dir: str | None = None, cache_dir: str | None = None) -> tuple[str | None, str | None]:
    """``(model, states folder)`` of a config: an index's ``kv/`` (it must exist), else ``cache_dir``."""
    if index_dir:
        from .rag import Index

        return model, str(Index(index_dir, create=False).kv_dir)
    return model, cache_dir


def engine(model: str | None, index_dir: str | None = None, cache_dir: str | None = None) -> PromptCache:
    """The engine of a config, shared by every class with the same one in this process."""
    from .docmodules import shared_engine

    return shared_engine(*engine_key(model, index_dir, cache_dir))


def assembler(model: str | None, index_dir: str | None = None, cache_dir: str | None = None,
              system_prompt: str | None = None) -> Assembler:
    """The Assembler of a config: documents encoded against ``system_prompt`` (default: the RAG
    preamble), under the index's own conditioning when there is an index, else the engine's default."""
    from .docmodules import DEFAULT_SYSTEM, assembler_for

    conditioning: Any = "default"
    if index_dir:
        from .rag import Index

        conditioning = Index(index_dir, create=False).conditioning()
    return assembler_for(engine(model, index_dir, cache_dir), system_prompt or DEFAULT_SYSTEM, conditioning)


def check_index(index_dir: str) -> str:
    """``index_dir`` if it is an index; a mistyped path is an error, never an empty index."""
    from .rag import Index

    Index(index_dir, create=False)
    return str(index_dir)


def check_count(name: str, value: Any) -> int:
    """``value`` if it is a positive whole number (``k``, ``similarity_top_k``...), else ValueError by ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return value


def check_recompute(policy: str | None) -> str | None:
    """``policy`` if the engine takes it (``"auto"``, None, ``"epic:16"``...); refused by name at
    construction, not at the first call."""
    from .recompute import resolve_auto

    resolve_auto(policy)
    return policy


def index_rag(model: str | None, index_dir: str, k: int) -> CachedRAG:
    """A retriever over an index: its CachedRAG on the config's shared engine."""
    from .rag import CachedRAG, Index

    index = Index(index_dir, create=False)
    return CachedRAG(index, pc=engine(model, index_dir), k=k)


def embed(texts: list[str]) -> list[list[float]]:
    """The packaged all-MiniLM-L6-v2 vectors (384-dim) of ``texts``, as plain floats; one
    embedder per process, loaded on first use (offline, no hub)."""
    with _EMBEDDER_LOCK:
        if not _EMBEDDER:
            from .rag import MiniLMEmbedder

            _EMBEDDER.append(MiniLMEmbedder())
    return [list(map(float, v)) for v in _EMBEDDER[0].embed(list(texts))]


def usage(out: GenerationOutput) -> dict:
    """A response's token usage in the shape frameworks count it: ``input_tokens`` (the whole
    prompt), ``output_tokens``, ``total_tokens`` and ``cache_read`` (prompt tokens read from the
    cache as they were stored)."""
    n_out = len(out.token_ids)
    return {"input_tokens": out.prompt_tokens, "output_tokens": n_out, "total_tokens": out.prompt_tokens + n_out,
            "cache_read": out.cached_tokens}


__all__ = ["engine_key", "engine", "assembler", "check_index", "check_count", "check_recompute", "index_rag", "embed",
           "usage"]
