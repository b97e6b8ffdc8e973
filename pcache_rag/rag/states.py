"""The store as RAG sees it: what persists, the budget's room, and releasing states no chunk uses.

The store's persistent tier (:meth:`~pcache_rag.store.KVStore.persistent_tier`: the disk tier of
a tiered store) is what persists; these helpers are the one place RAG asks for it.
"""

from __future__ import annotations

import torch

from ..store import KVStore


def persisted(store: KVStore, key: str) -> bool:
    """Whether ``key``'s states are in the store's persistent tier (what a new process finds)."""
    disk = store.persistent_tier()
    return disk.contains(key) if disk is not None else store.contains(key)


def budget_room(store: KVStore) -> int | None:
    """Bytes the persistent tier can still take within its budget (``store.budget_bytes()``;
    None: no budget)."""
    limit, disk = store.budget_bytes(), store.persistent_tier()
    return None if limit is None or disk is None else limit - int(disk.stats().bytes)


def bytes_per_token(pc) -> int:
    """Bytes of stored states per token for the engine ``pc``."""
    return pc.adapter.kv_shape.bytes_per_token(torch.empty(0, dtype=pc.store_dtype).element_size())


def release_states(index, store: KVStore, keys) -> None:
    """Remove the states of ``keys`` that no chunk of ``index`` uses any more (identical files
    share states)."""
    keys = set(keys)
    if not keys:
        return
    for k in keys - index.referenced(keys):
        store.remove(k)


def drop_chunks(index, store: KVStore, ids, keys) -> None:
    """Remove chunks from the index, then the states no other chunk uses."""
    index.delete(ids)
    release_states(index, store, keys)


def human(n: int | float | None) -> str:
    """Bytes for people: ``"1.5 MB"``; None is ``"unlimited"``."""
    if n is None:
        return "unlimited"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
