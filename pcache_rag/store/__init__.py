"""Tiered KV storage: device, host, disk and remote (Redis) tiers behind one interface."""

from .base import KVStore, LFUPolicy, LRUPolicy, Policy, TierStats
from .disk import DiskTier
from .keys import model_fingerprint, unit_key
from .memory import MemoryTier
from .remote import RemoteTier
from .tiered import TieredStore


def _disk_from_url(url: str) -> KVStore:
    from urllib.parse import unquote, urlsplit

    return DiskTier(unquote(urlsplit(url).path))


#: URL scheme -> what builds its tier: the one place a tier is found by kind (a new tier adds its
#: schemes here; nothing else names tier classes)
TIER_SCHEMES = {"redis": RemoteTier, "rediss": RemoteTier, "unix": RemoteTier, "file": _disk_from_url}


def open_tier(url: str) -> KVStore:
    """The tier at ``url``: ``redis://host:6379/0``, ``rediss://`` (TLS) or ``unix://`` (a Redis or
    Valkey server), or ``file:///path`` (a disk tier in that folder). Any other scheme is refused by name."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    make = TIER_SCHEMES.get(scheme)
    if make is None:
        raise ValueError(f"no KV tier serves {scheme + '://' if scheme else repr(url)}: the URL must start with one "
                         f"of {', '.join(s + '://' for s in TIER_SCHEMES)}")
    return make(url)


def default_store(device="cpu", cache_dir=None, host_budget: int | None = None, disk_budget: int | None = None,
                  policy: str = "lru", kv_url: str | None = None) -> TieredStore:
    """A device tier (when ``device`` is CUDA), a host tier, a disk tier when ``cache_dir`` is
    given, and the tier at ``kv_url`` when given (:func:`open_tier`: a Redis/Valkey server, shared
    by processes and machines)."""
    import torch

    tiers: list[KVStore] = []
    if torch.device(device).type == "cuda":
        tiers.append(MemoryTier(device, policy=policy, name="device"))
    tiers.append(MemoryTier("cpu", budget_bytes=host_budget, policy=policy, name="host"))
    if cache_dir is not None:
        tiers.append(DiskTier(cache_dir, size_limit=disk_budget, policy=policy))
    if kv_url is not None:
        tiers.append(open_tier(kv_url))
    return TieredStore(tiers)


__all__ = ["KVStore", "Policy", "LRUPolicy", "LFUPolicy", "TierStats", "MemoryTier", "DiskTier", "RemoteTier", "TieredStore",
           "default_store", "open_tier", "TIER_SCHEMES", "model_fingerprint", "unit_key"]
