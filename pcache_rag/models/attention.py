"""``pcache_sdpa``: scaled-dot-product attention over a long cache without repeating keys.

Stock sdpa with an explicit mask repeats every key/value head ``n_heads /
n_kv_heads`` times before attending (``repeat_kv``), which on the cached path
copies the whole assembled cache each layer. Here the query heads of one group
are folded into the query length instead: ``(B, H, q, D) -> (B, H_kv, G*q, D)``,
so keys and values are read in place. Results equal stock sdpa; with no mask
and a square query it is plain causal attention (what full prefill uses).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "pcache_sdpa"


def pcache_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H, q, D)
    key: torch.Tensor,  # (B, H_kv, kv, D)
    value: torch.Tensor,  # (B, H_kv, kv, Dv)
    attention_mask: torch.Tensor | None,  # (B, 1, q, kv) bool, True = attend; or None
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    B, H, q, D = query.shape
    Hkv, kv = key.shape[1], key.shape[2]
    G = H // Hkv
    probe = getattr(_probing, "probe", None)
    if probe is not None:
        probe.add(query, key, attention_mask, scaling)
    if attention_mask is None:
        if q > 1 and q != kv:
            raise ValueError(f"{NAME}: a query of {q} tokens over {kv} keys needs an explicit mask")
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=q > 1, scale=scaling, enable_gqa=G > 1
        )  # (B, H, q, Dv)
        return out.transpose(1, 2).contiguous(), None
    if G > 1:
        query = query.reshape(B, Hkv, G * q, D)  # rows ordered (group member, token)
        attention_mask = attention_mask.repeat(1, 1, G, 1)  # (B, 1, G*q, kv)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    out = out.reshape(B, H, q, -1)  # (B, H, q, Dv)
    return out.transpose(1, 2).contiguous(), None  # (B, q, H, Dv)


class AttentionProbe:
    """How much attention the query rows of a forward give to each of the first ``C`` keys,
    summed over layers, heads and query rows: ``scores`` (C,). Used as a context manager
    around one forward (``recompute="focus:R"``); counts the layers it saw in ``calls``."""

    def __init__(self, C: int):
        self.C = C
        self.scores: torch.Tensor | None = None
        self.calls = 0

    def add(self, query, key, mask, scaling) -> None:
        B, H, q, D = query.shape
        Hkv = key.shape[1]
        G = H // Hkv
        qq = query.float().reshape(B, Hkv, G * q, D)  # rows ordered (group member, token)
        logits = qq @ key.float().transpose(-1, -2) * (scaling if scaling is not None else D**-0.5)
        if mask is not None:  # (B, 1, q, kv) bool, True = attend
            logits = logits.masked_fill(~mask.repeat(1, 1, G, 1), float("-inf"))
        w = torch.softmax(logits, dim=-1)[..., : self.C].sum(dim=(0, 1, 2))  # (C,)
        self.scores = w if self.scores is None else self.scores + w
        self.calls += 1

    def __enter__(self) -> "AttentionProbe":
        _probing.probe = self
        return self

    def __exit__(self, *exc) -> None:
        _probing.probe = None


#: the probe of this thread's forward, if any (another thread's forwards are not probed)
_probing = threading.local()

AttentionInterface.register(NAME, pcache_sdpa)
