"""Memory tiers: device (GPU) memory and host (CPU) memory, each with a byte budget.

Entries are moved to the tier's device (and dtype) on ``put``. On a machine
with CUDA the host tier pins its tensors so host-to-device copies overlap
compute. ``put`` evicts by the policy until the new entry fits and returns
what it evicted, for the tiered store to demote.
"""

from __future__ import annotations

import threading

import torch

from ..kv import ModuleKV
from .base import KVStore, Policy, TierStats, make_policy


def free_host_bytes() -> int:
    """Available physical memory in bytes (Linux), or 4 GiB if unknown."""
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 << 30


class MemoryTier(KVStore):
    """KV entries held in memory on ``device``, within ``budget_bytes``."""

    def __init__(self, device="cpu", budget_bytes: int | None = None, policy: str | Policy = "lru",
                 pin: bool | None = None, name: str | None = None):
        self.device = torch.device(device)
        self.name = name or ("device" if self.device.type != "cpu" else "host")
        if budget_bytes is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget_bytes = int(free * 0.5)
            else:
                budget_bytes = int(free_host_bytes() * 0.25)
        self.budget = int(budget_bytes)
        self.pin = (torch.cuda.is_available() and self.device.type == "cpu") if pin is None else pin
        self.policy = make_policy(policy)
        self._d: dict[str, ModuleKV] = {}
        self._bytes = 0
        self._stats = TierStats()
        self._lock = threading.RLock()

    def contains(self, key: str) -> bool:
        return key in self._d

    def get(self, key: str) -> ModuleKV | None:
        kv = self._d.get(key)
        if kv is None:
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        self.policy.touch(key)
        return kv

    def _place(self, kv: ModuleKV) -> ModuleKV:
        if kv.keys.device == self.device and (not self.pin or kv.keys.is_pinned()):
            return kv
        return kv.map(lambda t: t.to(self.device).pin_memory() if self.pin else t.to(self.device))

    def put(self, key: str, kv: ModuleKV) -> list[tuple[str, ModuleKV]]:
        n = kv.nbytes()
        evicted: list[tuple[str, ModuleKV]] = []
        if n > self.budget:
            return [(key, kv)]  # never fits: pass it straight down
        with self._lock:
            if key in self._d:
                self.remove(key)
            while self._bytes + n > self.budget:
                victim = self.policy.victim()
                assert victim is not None, "over budget with nothing to evict"
                old = self._d[victim]
                self.remove(victim)
                self._stats.evictions += 1
                evicted.append((victim, old))
            self._d[key] = self._place(kv)
            self._bytes += n
            self.policy.touch(key)
            self._stats.puts += 1
            assert self._bytes <= self.budget, "budget exceeded"
        return evicted

    def remove(self, key: str) -> bool:
        with self._lock:
            kv = self._d.pop(key, None)
            if kv is None:
                return False
            self._bytes -= kv.nbytes()
            self.policy.remove(key)
            return True

    def keys(self) -> list[str]:
        return list(self._d)

    def stats(self) -> TierStats:
        s = self._stats
        s.bytes, s.entries = self._bytes, len(self._d)
        return s
