"""The tiered store: device > host > disk > remote, reads promote, evictions demote, prefetch
in the background.

``put`` writes to the fastest tier and through to the disk and remote tiers when there
are any, so a new process (or, through the remote tier, another machine) finds every
module. Entries
evicted from a memory tier move to the next tier down (skipped when that tier
already holds them). ``get`` searches fastest first and promotes a hit to the
fastest tier. ``prefetch(keys)`` does the same on a background thread, so a
retriever can start moving states as soon as it knows the handles.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from ..kv import ModuleKV
from .base import KVStore, TierStats


class TieredStore(KVStore):
    name = "tiered"

    def __init__(self, tiers: list[KVStore]):
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers = list(tiers)
        self._lock = threading.RLock()
        self._pool: ThreadPoolExecutor | None = None

    def persistent_tier(self) -> KVStore | None:
        return next((t for t in self.tiers if t.persistent), None)

    def shared_tier(self) -> KVStore | None:
        return next((t for t in self.tiers if t.shared), None)

    @property
    def disk(self):
        """The persistent tier (:meth:`persistent_tier`), by its usual name."""
        return self.persistent_tier()

    @property
    def remote(self):
        """The shared tier (:meth:`shared_tier`), by its usual name."""
        return self.shared_tier()

    def budget_bytes(self) -> int | None:
        """The persistent tier's budget: what the store can keep (None: no budget or nothing persists)."""
        t = self.persistent_tier()
        return t.budget_bytes() if t is not None else None

    def check(self, repair: bool = False) -> list[str]:
        return [p for t in self.tiers for p in t.check(repair)]

    def contains(self, key: str) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def where(self, key: str) -> str | None:
        """Name of the fastest tier holding ``key``."""
        return next((t.name for t in self.tiers if t.contains(key)), None)

    def get(self, key: str) -> ModuleKV | None:
        with self._lock:
            for i, t in enumerate(self.tiers):
                if not t.contains(key):
                    continue
                kv = t.get(key)
                if kv is None:  # damaged, dropped by the tier
                    continue
                if i > 0:
                    self._put_from(0, key, kv)
                return kv
            return None

    def _put_from(self, level: int, key: str, kv: ModuleKV) -> None:
        """Put into tier ``level``; what it evicts cascades to the tiers below."""
        pending = [(key, kv)]
        for j in range(level, len(self.tiers)):
            tier = self.tiers[j]
            nxt = []
            for k, v in pending:
                if j > level and tier.contains(k):
                    continue  # already there: nothing to demote
                nxt.extend(tier.put(k, v))
            pending = nxt
            if not pending:
                return

    def put(self, key: str, kv: ModuleKV) -> list[tuple[str, ModuleKV]]:
        with self._lock:
            self._put_from(0, key, kv)
            for t in self.tiers[1:]:  # write-through: persistence, and sharing
                if t.write_through and not t.contains(key):
                    t.put(key, kv)
        return []

    def remove(self, key: str) -> bool:
        with self._lock:
            return any([t.remove(key) for t in self.tiers])

    def prefetch(self, keys: list[str]) -> Future | None:
        """Promote ``keys`` to the fastest tier on a background thread."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pcache-prefetch")
        return self._pool.submit(lambda: [self.get(k) is not None for k in keys])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for t in self.tiers:
            t.close()

    def stats(self) -> TierStats:
        total = TierStats()
        for t in self.tiers:
            s = t.stats()
            total.hits += s.hits
            total.misses += s.misses
            total.bytes += s.bytes
            total.entries += s.entries
        return total

    def tier_stats(self) -> dict[str, TierStats]:
        return {t.name: t.stats() for t in self.tiers}
