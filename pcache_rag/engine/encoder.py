"""Encoding units into states, and the memo of the context they are encoded after.

An :class:`Encoder` runs the model over tokens at given positions (optionally after a
context) and returns their per-layer keys and values; it fetches or encodes stored
contexts (a preamble, conditioning passages) and keeps the last one converted to the
model's dtype, since a schema or a corpus encodes every unit after the same context.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from ..kv import ModuleKV
from ..store import KVStore
from .mask import context_mask


class Encoder:
    """Encodes tokens with ``adapter`` and keeps what it stores at ``store_dtype``."""

    def __init__(self, adapter, store: KVStore, store_dtype: torch.dtype) -> None:
        self.adapter = adapter
        self.store = store
        self.store_dtype = store_dtype
        #: units (modules, chunks, preambles) and tokens encoded so far
        self.counts = {"units": 0, "tokens": 0}
        self._context_memo: tuple[str, ModuleKV] | None = None
        self._cond_memo: tuple[str, ModuleKV] | None = None

    def place(self, kv: ModuleKV, start: int) -> ModuleKV:
        """The states of ``kv`` moved so its first token sits at position ``start``.

        RoPE keys are re-rotated (exact up to rounding); ALiBi states carry no
        position and are reused as they are; learned-position models cannot
        move states (encode at the target positions instead).
        """
        delta = start - int(kv.position_ids[0])
        return kv if delta == 0 else self.adapter.move(kv, delta)

    @torch.no_grad()
    def encode(self, token_ids: list[int], position_ids: list[int], context: ModuleKV | None = None,
               embeds: torch.Tensor | None = None) -> ModuleKV:
        """Encode tokens at the given positions; with ``context``, they also attend to it.
        Returns the tokens' own states (not the context's), in the model's dtype. ``embeds``
        ``(T, hidden)`` (a learned prefix) are encoded instead of the tokens' embeddings."""
        dev = self.adapter.device
        ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        extra = {} if embeds is None else {"inputs_embeds": embeds.to(device=dev, dtype=self.adapter.dtype)}
        pos = torch.tensor(position_ids, dtype=torch.long, device=dev)
        T = ids.shape[0]
        self.counts["units"] += 1
        self.counts["tokens"] += T
        if context is None:
            cache = DynamicCache()
            self.adapter.forward(ids, pos, cache, None, None, **extra)
            layers: list[Any] = list(cache.layers)  # DynamicLayer each (transformers types them as a union)
            keys = torch.stack([layer.keys[0] for layer in layers])  # (L, H, T, D)
            values = torch.stack([layer.values[0] for layer in layers])
        else:
            P = context.length
            # DynamicCache concatenates on update, so the context tensors are never written.
            cache = DynamicCache([(context.keys[i][None], context.values[i][None])
                                  for i in range(context.keys.shape[0])])
            kpos = torch.cat([context.position_ids.to(dev), pos])
            self.adapter.forward(ids, pos, cache, context_mask(T, P, dev), kpos, **extra)
            layers = list(cache.layers)
            keys = torch.stack([layer.keys[0, :, P:] for layer in layers])  # (L, H, T, D)
            values = torch.stack([layer.values[0, :, P:] for layer in layers])
        return ModuleKV(keys.contiguous(), values.contiguous(), ids.cpu(), pos.cpu())

    def encode_stored(self, token_ids: list[int], position_ids: list[int],
                      context: ModuleKV | None = None, embeds: torch.Tensor | None = None) -> ModuleKV:
        """:meth:`encode`, converted to the store's dtype."""
        return self.encode(token_ids, position_ids, context, embeds).to(dtype=self.store_dtype)

    def stored_states(self, key: str, token_ids: list[int], position_ids: list[int]) -> ModuleKV:
        """The stored states under ``key``, encoding (and storing) them first if absent."""
        kv = self.store.get(key)
        if kv is None:
            kv = self.encode_stored(token_ids, position_ids)
            self.store.put(key, kv)
        return kv

    def context_states(self, key: str, token_ids: list[int], position_ids: list[int]) -> ModuleKV:
        """A context (the preamble) in the model's dtype, for encoding units that attend to it;
        the last one is memoized."""
        memo = self._context_memo
        if memo is None or memo[0] != key:
            kv = self.stored_states(key, token_ids, position_ids)
            memo = self._context_memo = (key, kv.to(dtype=self.adapter.dtype, device=self.adapter.device))
        return memo[1]

    def conditioned_context(self, base_key: str, base_ids: list[int], base_pos: list[int], cond_key: str,
                            cond_ids: list[int], embeds: torch.Tensor | None = None) -> ModuleKV:
        """A preamble's states followed by conditioning passages' (which attend to it, at the
        positions after it), in the model's dtype: both stored, the last pair memoized. With
        ``embeds`` (a learned prefix, ``(len(cond_ids), hidden)``) those are encoded instead of
        the tokens' embeddings."""
        memo = self._cond_memo
        if memo is None or memo[0] != cond_key:
            base = self.context_states(base_key, base_ids, base_pos)
            P = int(base.position_ids[-1]) + 1
            cond = self.store.get(cond_key)
            if cond is None:
                cond = self.encode_stored(cond_ids, list(range(P, P + len(cond_ids))), base, embeds)
                self.store.put(cond_key, cond)
            cond = cond.to(device=self.adapter.device, dtype=self.adapter.dtype)
            memo = self._cond_memo = (cond_key, ModuleKV.concat([base, cond]))
        return memo[1]

    def encode_moved(self, token_ids: list[int], position_ids: list[int], context: ModuleKV) -> ModuleKV:
        """Tokens encoded right after ``context`` (their gaps kept), then moved back to their
        own ``position_ids``: conditioned encoding. Needs states that can move."""
        shift = context.length - position_ids[0]
        kv = self.encode(token_ids, [p + shift for p in position_ids], context=context)
        return self.adapter.move(kv, -shift).to(dtype=self.store_dtype)
