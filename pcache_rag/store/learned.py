"""States learned from prompts: per tenant, in memory, within a byte budget.

A prompt answered as sent carries text no ingest ever saw: a system message, a template's
header, documents a stock pipeline pasted in. Their states are worth keeping (the next prompt
that holds them reads them from the cache), but they are the *senders'* text, so they are
governed separately from the ingested index:

* **Private per tenant.** Every key is salted with the tenant it was learned for (a server
  derives it from the authenticated API key; a ``CachedRAG`` or connector object names its
  own), so what one tenant's prompts taught is never read for another: a right guess of
  someone else's text is exactly as uncached, and as slow, as a wrong one. The shared,
  unsalted store holds only what was ingested or explicitly encoded (``Assembler.ensure``).
* **Bounded.** Learned states live in a host-memory tier of their own (``budget_bytes``,
  least recently used first out), never on disk or in Redis: a flood of distinct prompts
  evicts learned states only, never an ingested document, and writes nothing to disk. One
  tenant holds at most ``tenant_share`` of the budget (past it, its own oldest go first) and
  learns at most ``rate_bytes_per_s`` on average (a bucket of one minute's worth; past it, its
  new documents are computed and not kept), so one busy client cannot flush the others'.
* **Forgotten.** Entries older than ``retention_s`` are dropped when next touched, and
  :meth:`forget` drops a tenant's (or everyone's) learned states at once. Nothing of a prompt's
  text is written anywhere: the texts it taught are known to this process only, per tenant.

One instance serves an engine (:attr:`PromptCache.learned`); it is thread-safe.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass

from ..discovery import KnownTexts
from ..kv import ModuleKV
from .memory import MemoryTier

#: bytes of learned states kept in memory by default (about 11,000 tokens of the embedded model's
#: fp16 states): a shared server's learned prompts never crowd out its index, and its memory stays flat
DEFAULT_LEARNED_BYTES = 256 << 20
#: how long a learned state may be kept, in seconds, unless told otherwise (a day)
DEFAULT_RETENTION_S = 24 * 3600.0
#: texts one tenant's prompts may make known (found unmarked later); past it the set starts anew
KNOWN_TEXTS_PER_TENANT = 10_000


def tenant_id(secret: str | None) -> str:
    """A tenant's name from a secret that identifies it (an API key): a short hash, never the
    secret itself; ``""`` (the one default tenant) for None or empty."""
    if not secret:
        return ""
    return hashlib.sha256(b"pcache-rag tenant\0" + secret.encode("utf-8", "surrogatepass")).hexdigest()[:16]


@dataclass(slots=True)
class LearnedStats:
    """What :class:`LearnedStore` holds and did."""

    bytes: int
    entries: int
    budget: int
    hits: int
    misses: int
    puts: int
    evictions: int
    expired: int
    refused: int  # states not kept: their tenant was over its rate or share
    tenants: int


class LearnedStore:
    """Prompt-borne states (see the module docstring): ``get``/``put`` by ``(tenant, key)``,
    least recently used out past ``budget_bytes``, none older than ``retention_s`` seconds."""

    def __init__(self, budget_bytes: int = DEFAULT_LEARNED_BYTES, retention_s: float = DEFAULT_RETENTION_S,
                 tenant_share: float = 0.5, rate_bytes_per_s: float | None = None) -> None:
        if budget_bytes < 0 or retention_s <= 0 or not 0 < tenant_share <= 1:
            raise ValueError("budget_bytes must be at least 0, retention_s positive and tenant_share in (0, 1]")
        self.retention_s = float(retention_s)
        self.tenant_share = float(tenant_share)
        #: default: the whole budget a minute per tenant
        self.rate = float(rate_bytes_per_s) if rate_bytes_per_s is not None else budget_bytes / 60.0
        self._bucket: dict[str, tuple[float, float]] = {}  # tenant -> (bytes it may still learn, when)
        self._held: dict[str, int] = {}  # tenant -> bytes of learned states it holds
        self._sizes: dict[str, int] = {}  # salted key -> its bytes
        self.refused = 0  # states not kept: their tenant was over its rate
        self._tier = MemoryTier("cpu", budget_bytes=int(budget_bytes), name="learned", pin=False)
        self._born: dict[str, float] = {}  # salted key -> when it was learned
        self._owner: dict[str, str] = {}  # salted key -> tenant
        self._known: dict[str, KnownTexts] = {}  # tenant -> the texts learned for it
        self._lock = threading.Lock()
        self.expired = 0

    @property
    def budget(self) -> int:
        return self._tier.budget

    @staticmethod
    def salted(tenant: str, key: str) -> str:
        """The key ``key`` has for ``tenant``: no two tenants share one."""
        return hashlib.sha256(f"{tenant}\0{key}".encode()).hexdigest()

    def get(self, tenant: str, key: str) -> ModuleKV | None:
        k = self.salted(tenant, key)
        with self._lock:
            born = self._born.get(k)
            if born is not None and time.monotonic() - born > self.retention_s:
                self._drop(k)
                self.expired += 1
        return self._tier.get(k)

    def contains(self, tenant: str, key: str) -> bool:
        return self._tier.contains(self.salted(tenant, key))

    def put(self, tenant: str, key: str, kv: ModuleKV) -> bool:
        """Keep ``kv`` for ``tenant``: its own oldest states make room past its share, the least
        recently used of all past the budget. False if it was not kept (the tenant is over its
        rate, or the state is larger than its share)."""
        k = self.salted(tenant, key)
        n = kv.nbytes()
        now = time.monotonic()
        with self._lock:
            if k in self._owner:
                self._drop(k)
            room, at = self._bucket.get(tenant, (self.rate * 60.0, now))
            room = min(self.rate * 60.0, room + (now - at) * self.rate)
            share = self.tenant_share * self._tier.budget
            if n > room or n > share:
                self._bucket[tenant] = (room, now)
                self.refused += 1
                return False
            self._bucket[tenant] = (room - n, now)
            if self._held.get(tenant, 0) + n > share:  # its own oldest make room (sorted only then)
                mine = sorted((b, x) for x, b in self._born.items() if self._owner.get(x) == tenant)
                while mine and self._held.get(tenant, 0) + n > share:
                    self._drop(mine.pop(0)[1])
            for gone, _ in self._tier.put(k, kv):
                self._forget_key(gone)
            if not self._tier.contains(k):
                return False
            self._born[k], self._owner[k], self._sizes[k] = now, tenant, n
            self._held[tenant] = self._held.get(tenant, 0) + n
            return True

    def known(self, tenant: str):
        """The texts learned for ``tenant``, found in its later prompts (a
        :class:`~pcache_rag.discovery.KnownTexts` of this process only: nothing is journalled; at most
        :data:`KNOWN_TEXTS_PER_TENANT`)."""
        with self._lock:
            got = self._known.get(tenant)
            if got is None or len(got) > KNOWN_TEXTS_PER_TENANT:  # bounded: what it forgets is found as blocks
                got = self._known[tenant] = KnownTexts(None)
            return got

    def forget(self, tenant: str | None = None) -> int:
        """Drop the learned states (and texts) of ``tenant``, or of every tenant; how many states."""
        with self._lock:
            keys = [k for k, t in self._owner.items() if tenant is None or t == tenant]
            for k in keys:
                self._drop(k)
            if tenant is None:
                self._known.clear()
            else:
                self._known.pop(tenant, None)
        return len(keys)

    def _drop(self, k: str) -> None:
        self._tier.remove(k)
        self._forget_key(k)

    def _forget_key(self, k: str) -> None:
        """The books of a key that left the tier (dropped or evicted)."""
        self._born.pop(k, None)
        tenant = self._owner.pop(k, None)
        if tenant is not None:
            self._held[tenant] = self._held.get(tenant, 0) - self._sizes.pop(k, 0)

    def stats(self) -> LearnedStats:
        s = self._tier.stats()
        return LearnedStats(s.bytes, s.entries, self._tier.budget, s.hits, s.misses, s.puts, s.evictions, self.expired,
                            self.refused, len(set(self._owner.values())))


__all__ = ["DEFAULT_LEARNED_BYTES", "DEFAULT_RETENTION_S", "LearnedStats", "LearnedStore", "tenant_id"]
