"""Conversation turns read in their context: what :class:`~.assembler.Assembler` does with the
parts of a prompt that are not documents once a conversation goes on (an agent's steps, a chat).

A document is read from its canonical states wherever a prompt puts it (content addressing).
A turn is not a document: the question, an assistant's calls, the opening of a tool's result
only mean something after what came before them. Read without that context, the model lost
the thread (an agent's next call took garbage arguments when its question was encoded on its
own). So a turn is encoded attending to every part before it, exactly as a full prefill reads
it, and kept among the tenant's learned states under a key of its tokens and of those parts:
the next step of the same conversation reads it from the cache.

* :func:`turn_states` - a turn between documents (tool results after it);
* :func:`extend_prefix` - a prompt whose text before its first document is new, but whose first
  system message an earlier prompt taught: that message is read, the rest computed after it.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from ..kv import ModuleKV
from ..store import unit_key

if TYPE_CHECKING:
    from .states import DocumentStates


def turn_key(fingerprint: str, ids: list[int], pos: int, names: list[str]) -> str:
    """The key of a turn's states at ``pos`` after the parts ``names`` (their store keys and where
    they sit): the states depend on that context, so it is part of the key."""
    context = hashlib.sha256("|".join(names).encode()).hexdigest()
    return unit_key(fingerprint, ids, range(pos, pos + len(ids)), context, "turn")


def turn_states(asm: DocumentStates, ids: list[int], pos: int, parts: list[tuple[str, ModuleKV]], key: str,
                tenant: str) -> tuple[ModuleKV, bool]:
    """The states of a turn at ``pos`` (``key``: :func:`turn_key`), attending to ``parts`` (the
    prompt's states before it, in order): learned for ``tenant`` by an earlier step, else encoded
    now and learned. ``(states, encoded now)``; exact up to the store's dtype."""
    kv = asm.learned.get(tenant, key)
    if kv is not None:
        return kv, False
    dtype = asm.encoder.adapter.dtype
    ctx = ModuleKV.concat([p.to(dtype=dtype) for _, p in parts]) if parts else None  # (L, H, pos, D)
    kv = asm.encoder.encode(ids, list(range(pos, pos + len(ids))), context=ctx).to(dtype=asm.store_dtype)
    asm.learned.put(tenant, key, kv)
    return kv, True


def extend_prefix(asm: DocumentStates, head: list[int], prefix: list[int], key: str, tenant: str) -> ModuleKV | None:
    """The states of ``prefix`` (stored under ``key``) from those of its ``head`` (the first system
    message with the tools, learned for ``tenant`` by an earlier prompt) and the rest encoded now
    after it: exact, and only the new turns computed. An agent's second step is the case: its
    system message is read, its question and first call computed, the documents its tool returned
    read after them. None when the head was never learned."""
    head_kv = asm.learned.get(tenant, unit_key(asm.fingerprint, head, range(len(head)), None, "prefix"))
    if head_kv is None:
        return None
    ctx = head_kv.to(dtype=asm.encoder.adapter.dtype)  # (L, H, len(head), D), dequantized if int8
    rest = asm.encoder.encode(prefix[len(head):], list(range(len(head), len(prefix))), context=ctx)
    if head_kv.quantized:  # int8 states are joined in float and quantized again, as one unit
        kv = ModuleKV.concat([ctx, rest]).to(dtype=asm.store_dtype)
    else:  # the head's stored states as they are: only the rest is converted
        kv = ModuleKV.concat([head_kv, rest.to(dtype=asm.store_dtype)])
    asm.learned.put(tenant, key, kv)
    return kv


__all__ = ["extend_prefix", "turn_key", "turn_states"]
