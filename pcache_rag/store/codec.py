"""The entry format every persistent tier stores (disk, remote): one unit's states as bytes.

An entry is ``sha256(blob) || blob`` where ``blob`` is a safetensors file holding ``keys``,
``values``, ``token_ids`` and ``position_ids`` (their shapes and dtypes are in its header;
int8 states add ``k_scale`` and ``v_scale``), with metadata naming the entry's key and
format. Nothing is ever unpickled: safetensors only parses tensors.
"""

from __future__ import annotations

import hashlib
import json

import safetensors.torch as st
import torch

from ..kv import ModuleKV

FORMAT = "pcache-kv-1"


def encode_entry(key: str, kv: ModuleKV) -> bytes:
    """Serialize one entry (checksum + safetensors)."""
    tensors = {name: t.contiguous().cpu() for name, t in kv.tensors().items()}
    tensors.update(token_ids=kv.token_ids.contiguous().cpu(), position_ids=kv.position_ids.contiguous().cpu())
    blob = st.save(tensors, metadata={"format": FORMAT, "key": key})
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
    ks, vs = t.get("k_scale"), t.get("v_scale")
    scaled = ks is not None and vs is not None
    if (k.dtype == torch.int8) != scaled or (ks is None) != (vs is None) or (ks is not None and vs is not None and (
            ks.shape != (*k.shape[:2], 1, k.shape[3]) or vs.shape != (*v.shape[:3], 1))):
        raise ValueError("int8 states without matching scales (or scales without int8 states)")
    return ModuleKV(k, v, ids, pos, k_scale=ks, v_scale=vs)
