"""The storage interface every KV tier implements, and the eviction policies.

A store maps a string key (a fingerprint, see :mod:`pcache_rag.store.keys`) to
a :class:`~pcache_rag.kv.ModuleKV`. Tiers differ in where the tensors live and
how much they may hold; the tiered store composes them. What a tier can do beyond
get and put is declared on the interface (``persistent``, ``shared``, ``prefetch``,
``tier_stats``, ``budget_bytes``, ``check``), so nobody above probes for an
attribute or asks a tier's class.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from ..kv import ModuleKV


@dataclass(slots=True)
class TierStats:
    """Counters of one tier."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    corrupt: int = 0  # entries found damaged and dropped
    load_s: float = 0.0  # seconds spent reading entries
    bytes: int = 0  # bytes held now
    entries: int = 0  # entries held now


class KVStore(ABC):
    """contains / get / put / remove / close, plus a batched get, plus the capabilities below
    (each with the answer of a tier that lacks it)."""

    name = "store"
    #: its entries survive the process on this machine (a new process finds them): the disk tier
    persistent = False
    #: other processes and machines read and write it (a Redis server)
    shared = False

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def get(self, key: str) -> ModuleKV | None:
        """The entry, or ``None`` if absent (or found damaged, which is dropped)."""

    @abstractmethod
    def put(self, key: str, kv: ModuleKV) -> list[tuple[str, ModuleKV]]:
        """Store ``kv``; returns what was evicted to make room (for demotion)."""

    @abstractmethod
    def remove(self, key: str) -> bool: ...

    def get_many(self, keys: list[str]) -> list[ModuleKV | None]:
        return [self.get(k) for k in keys]

    def close(self) -> None:
        return None

    @abstractmethod
    def stats(self) -> TierStats: ...

    @property
    def write_through(self) -> bool:
        """A tiered store writes every ``put`` through to this tier (to persist, or to share)."""
        return self.persistent or self.shared

    def prefetch(self, keys: list[str]) -> Future | None:
        """Start moving ``keys`` to the fastest tier; None where there is nowhere faster."""
        return None

    def tier_stats(self) -> dict[str, TierStats]:
        """Statistics per tier, by tier name."""
        return {self.name: self.stats()}

    def persistent_tier(self) -> KVStore | None:
        """The tier whose entries outlive the process (None: nothing persists)."""
        return self if self.persistent else None

    def shared_tier(self) -> KVStore | None:
        """The tier other processes and machines share (None: none)."""
        return self if self.shared else None

    def budget_bytes(self) -> int | None:
        """The most bytes this store may hold (None: no budget)."""
        return None

    def check(self, repair: bool = False) -> list[str]:
        """Problems of the store's own bookkeeping (fixed with ``repair``); none by default."""
        return []

    def __contains__(self, key: str) -> bool:
        return self.contains(key)


class Policy(ABC):
    """Chooses the victim when a tier is over budget."""

    @abstractmethod
    def touch(self, key: str) -> None:
        """``key`` was read or written."""

    @abstractmethod
    def remove(self, key: str) -> None: ...

    @abstractmethod
    def victim(self) -> str | None:
        """The key to evict next, or ``None`` if empty."""


class LRUPolicy(Policy):
    """Evict the least recently used entry."""

    def __init__(self):
        self._order: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def touch(self, key: str) -> None:
        with self._lock:
            self._order[key] = None
            self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        with self._lock:
            self._order.pop(key, None)

    def victim(self) -> str | None:
        with self._lock:
            return next(iter(self._order), None)


class LFUPolicy(Policy):
    """Evict the least frequently used entry (ties: the least recent)."""

    def __init__(self):
        self._count: dict[str, int] = {}
        self._tick: dict[str, int] = {}
        self._clock = 0
        self._lock = threading.Lock()

    def touch(self, key: str) -> None:
        with self._lock:
            self._clock += 1
            self._count[key] = self._count.get(key, 0) + 1
            self._tick[key] = self._clock

    def remove(self, key: str) -> None:
        with self._lock:
            self._count.pop(key, None)
            self._tick.pop(key, None)

    def victim(self) -> str | None:
        with self._lock:
            if not self._count:
                return None
            return min(self._count, key=lambda k: (self._count[k], self._tick[k]))


POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(policy: str | Policy) -> Policy:
    if isinstance(policy, Policy):
        return policy
    try:
        return POLICIES[policy]()
    except KeyError:
        raise ValueError(f"eviction policy must be one of {sorted(POLICIES)} or a Policy, not {policy!r}") from None
