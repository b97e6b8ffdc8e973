"""The disk tier: diskcache in a directory the user names, tensors as safetensors.

Each entry is ``sha256(blob) || blob`` where ``blob`` is a safetensors file
holding ``keys``, ``values``, ``token_ids`` and ``position_ids`` (their shapes
and dtypes are in its header) with metadata naming the entry's key and format.
On read the checksum, the format and the key are verified; a damaged entry is
dropped, logged and reported as a miss, so the engine re-encodes it. Nothing is
ever unpickled: values are raw bytes and safetensors only parses tensors.

diskcache writes a value's file before committing its index row in SQLite, so
a process killed during a write leaves no visible entry, and several processes
may share one directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import diskcache
import safetensors.torch as st
import torch

from ..kv import ModuleKV
from .base import KVStore, TierStats

log = logging.getLogger(__name__)
FORMAT = "pcache-kv-1"
_DC_POLICY = {"lru": "least-recently-used", "lfu": "least-frequently-used", "none": "none"}


def encode_entry(key: str, kv: ModuleKV) -> bytes:
    """Serialize one entry (checksum + safetensors)."""
    blob = st.save(
        {
            "keys": kv.keys.contiguous().cpu(),
            "values": kv.values.contiguous().cpu(),
            "token_ids": kv.token_ids.contiguous().cpu(),
            "position_ids": kv.position_ids.contiguous().cpu(),
        },
        metadata={"format": FORMAT, "key": key},
    )
    return hashlib.sha256(blob).digest() + blob


def decode_entry(key: str, data: bytes) -> ModuleKV:
    """Parse and verify one entry; raises ``ValueError`` if it is damaged or not ``key``'s."""
    if len(data) < 40:
        raise ValueError("entry is truncated")
    digest, blob = data[:32], data[32:]
    if hashlib.sha256(blob).digest() != digest:
        raise ValueError("checksum mismatch")
    try:
        t = st.load(blob)
        n = int.from_bytes(blob[:8], "little")
        meta = json.loads(blob[8 : 8 + n]).get("__metadata__", {})
    except Exception as e:  # noqa: BLE001 - any parse failure is damage
        raise ValueError(f"unreadable safetensors: {e}") from None
    if meta.get("format") != FORMAT or meta.get("key") != key:
        raise ValueError("entry belongs to another key or format")
    k, v, ids, pos = t["keys"], t["values"], t["token_ids"], t["position_ids"]
    if k.ndim != 4 or v.shape[:3] != k.shape[:3] or ids.shape != (k.shape[2],) or pos.shape != ids.shape:
        raise ValueError(f"inconsistent shapes {tuple(k.shape)} {tuple(v.shape)} {tuple(ids.shape)}")
    return ModuleKV(k, v, ids, pos)


class DiskTier(KVStore):
    """KV entries in ``directory`` (diskcache), within ``size_limit`` bytes."""

    name = "disk"

    def __init__(self, directory: str | Path, size_limit: int | None = None, policy: str = "lru"):
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)
        if size_limit is None:
            size_limit = int(min(shutil.disk_usage(self.directory).free * 0.5, 64 << 30))
        if policy not in _DC_POLICY:
            raise ValueError(f"disk eviction policy must be one of {sorted(_DC_POLICY)}, not {policy!r}")
        self.size_limit = int(size_limit)
        self._dc = diskcache.Cache(
            str(self.directory),
            size_limit=self.size_limit,
            eviction_policy=_DC_POLICY[policy],
            statistics=False,
            disk_min_file_size=0,  # every entry is a file: one integrity story for all sizes
        )
        self._stats = TierStats()

    def contains(self, key: str) -> bool:
        return key in self._dc

    def get(self, key: str) -> ModuleKV | None:
        t0 = time.perf_counter()
        data = self._dc.get(key, default=None, retry=True)
        if data is None:
            self._stats.misses += 1
            return None
        try:
            kv = decode_entry(key, bytes(data))
        except ValueError as e:
            log.warning("dropping damaged KV entry %s from %s: %s", key[:16], self.directory, e)
            self._stats.corrupt += 1
            self._stats.misses += 1
            self._dc.delete(key, retry=True)
            return None
        self._stats.hits += 1
        self._stats.load_s += time.perf_counter() - t0
        return kv

    def put(self, key: str, kv: ModuleKV) -> list[tuple[str, ModuleKV]]:
        self._dc.set(key, encode_entry(key, kv), retry=True)
        self._stats.puts += 1
        return []  # diskcache culls by its own policy; the last tier has nowhere to demote to

    def remove(self, key: str) -> bool:
        return bool(self._dc.delete(key, retry=True))

    def keys(self) -> list[str]:
        return list(self._dc.iterkeys())

    def close(self) -> None:
        self._dc.close()

    def stats(self) -> TierStats:
        s = self._stats
        s.bytes = int(self._dc.volume())
        s.entries = len(self._dc)
        return s
