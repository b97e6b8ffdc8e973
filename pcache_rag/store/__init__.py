"""Tiered KV storage: device, host, disk and remote (Redis) tiers behind one interface."""

from .base import KVStore, LFUPolicy, LRUPolicy, Policy, TierStats
from .disk import DiskTier
from .keys import model_fingerprint, unit_key
from .memory import MemoryTier
from .remote import RemoteTier
from .tiered import TieredStore


def default_store(device="cpu", cache_dir=None, host_budget: int | None = None, disk_budget: int | None = None,
                  policy: str = "lru", kv_url: str | None = None) -> TieredStore:
    """A device tier (when ``device`` is CUDA), a host tier, a disk tier when ``cache_dir`` is
    given, and a remote tier on the Redis/Valkey server at ``kv_url`` when given."""
    import torch

    tiers: list[KVStore] = []
    if torch.device(device).type == "cuda":
        tiers.append(MemoryTier(device, policy=policy, name="device"))
    tiers.append(MemoryTier("cpu", budget_bytes=host_budget, policy=policy, name="host"))
    if cache_dir is not None:
        tiers.append(DiskTier(cache_dir, size_limit=disk_budget, policy=policy))
    if kv_url is not None:
        tiers.append(RemoteTier(kv_url))
    return TieredStore(tiers)


__all__ = ["KVStore", "Policy", "LRUPolicy", "LFUPolicy", "TierStats", "MemoryTier", "DiskTier", "RemoteTier", "TieredStore",
           "default_store", "model_fingerprint", "unit_key"]
