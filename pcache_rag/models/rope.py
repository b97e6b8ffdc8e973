"""Rotary position models (Llama, Qwen2, Mistral, ...): positions go in as ``position_ids``.

Stock models already compute RoPE from arbitrary ``position_ids``, so gaps
need no override; this adapter only switches attention to ``pcache_sdpa`` and
adds :func:`rerotate`: moving cached keys from positions ``p`` to ``p + d`` is
one more rotation by ``d`` (RoPE is a rotation and rotations compose), exact up
to rounding. :meth:`RopeAdapter.self_check` proves it on the live model at
start-up, as LMCache does for its own re-rotation.
"""

from __future__ import annotations

import torch

from .base import Adapter, UnsupportedModelError, use_fast_attention

# rope types whose frequencies depend on the sequence length: a key rotated for
# one length is not the key another length would produce.
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    # The HF convention (first half / second half), which the stock models use.
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rerotate(keys: torch.Tensor, delta, inv_freq: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Keys rotated by RoPE at positions ``p`` -> the same keys at ``p + delta``.

    ``keys``: (..., T, head_dim); ``delta``: an int or a (T,) tensor of shifts;
    ``inv_freq``: (head_dim/2,). Angles are formed in float64 so large shifts
    lose no precision. The result is in ``out_dtype`` (default: the keys' dtype);
    it is computed in float32 or wider.
    """
    if isinstance(delta, int):
        return _rerotate_scalar(keys, delta, inv_freq, out_dtype or keys.dtype)
    d = torch.as_tensor(delta, dtype=torch.float64, device=keys.device)
    d = d.reshape(-1, 1) if d.ndim else d.reshape(1, 1)  # (T or 1, 1)
    ang = d * inv_freq.to(device=keys.device, dtype=torch.float64)[None, :]  # (T, head_dim/2)
    ang = torch.cat((ang, ang), dim=-1)
    cos, sin = ang.cos().to(keys.dtype), ang.sin().to(keys.dtype)
    out = keys * cos + _rotate_half(keys) * sin
    return out if out_dtype is None else out.to(out_dtype)


def _rerotate_scalar(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor, out_dtype) -> torch.Tensor:
    # One shift for every token: cos/sin are (head_dim/2,) vectors, and the rotation is
    # written half by half into a single output (no rotate_half copy, no temporaries of
    # the keys' size): lo' = lo*c - hi*s, hi' = hi*c + lo*s.
    wide = torch.promote_types(out_dtype, torch.float32)
    ang = float(delta) * inv_freq.to(device=keys.device, dtype=torch.float64)  # (head_dim/2,)
    c, s = ang.cos().to(wide), ang.sin().to(wide)
    h = keys.shape[-1] // 2
    lo, hi = keys[..., :h], keys[..., h:]
    out = torch.empty(keys.shape, dtype=wide, device=keys.device)
    o_lo, o_hi = out[..., :h], out[..., h:]
    torch.mul(lo, c, out=o_lo)
    o_lo.addcmul_(hi, s, value=-1)
    torch.mul(hi, c, out=o_hi)
    o_hi.addcmul_(lo, s)
    return out if wide == out_dtype else out.to(out_dtype)


class RopeAdapter(Adapter):
    family = "rope"

    @staticmethod
    def matches(model) -> bool:
        base = getattr(model, "model", None)
        return base is not None and hasattr(base, "rotary_emb")

    def __init__(self, model):
        super().__init__(model)
        rot = model.model.rotary_emb
        n = self.kv_shape.n_layers
        rp = getattr(self.config, "rope_parameters", None) or {}
        types = list(getattr(self.config, "layer_types", None) or [])
        if hasattr(rot, "inv_freq"):  # one RoPE for every layer
            tables = [rot.inv_freq.detach().clone()] * n  # (head_dim/2,) each
            kinds = [rp.get("rope_type", "default") if isinstance(rp, dict) else "default"]
        elif len(types) == n and all(hasattr(rot, f"{t}_inv_freq") for t in types):  # per layer kind
            tables = [getattr(rot, f"{t}_inv_freq").detach().clone() for t in types]
            kinds = [(rp.get(t) or {}).get("rope_type", "default") for t in sorted(set(types))]
        else:
            raise UnsupportedModelError(f"{type(model).__name__}: its rotary embedding has no frequency table "
                                        "pcache-rag can read (inv_freq, or one per layer type)")
        self.rope_type = kinds[0] if len(set(kinds)) == 1 else "/".join(kinds)
        #: (head_dim/2,) RoPE frequencies of each layer
        self.layer_inv_freq = tables
        self.inv_freq = tables[0]
        self.shared_rope = all(t is tables[0] or torch.equal(t, tables[0]) for t in tables)
        self.rerotatable = (
            not any(t in str(k) for k in kinds for t in _LENGTH_DEPENDENT)
            and all(t.numel() * 2 == self.kv_shape.head_dim for t in tables)
        )
        self.fast = use_fast_attention(model)

    def rerotate(self, keys: torch.Tensor, delta, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``keys`` (L, H, T, D) of every layer (or (H, T, D) on a model with one RoPE) moved by ``delta``."""
        if not self.rerotatable:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} cannot be re-rotated exactly (its frequencies depend on the "
                "sequence length or it rotates part of the head); encode modules at their slot instead"
            )
        if self.shared_rope:
            return rerotate(keys, delta, self.inv_freq, out_dtype)
        if keys.ndim != 4 or keys.shape[0] != len(self.layer_inv_freq):
            raise ValueError(f"per-layer RoPE re-rotates every layer's keys (L, H, T, D), not {tuple(keys.shape)}")
        return torch.stack([rerotate(keys[i], delta, f, out_dtype) for i, f in enumerate(self.layer_inv_freq)])

    def move(self, kv, delta: int):
        from ..kv import ModuleKV

        # Rotated in float32 or wider (stored states may be fp16), returned in the model's dtype.
        if kv.quantized:
            kv = kv.to(dtype=self.dtype)
        keys = self.rerotate(kv.keys, int(delta), out_dtype=self.dtype)  # (L, H, T, D)
        return ModuleKV(keys, kv.values, kv.token_ids, kv.position_ids + delta)

    @torch.no_grad()
    def self_check(self, length: int = 8, shift: int = 37, atol: float = 1e-3) -> float:
        """Encode a few tokens at 0 and at ``shift``; re-rotation must map one onto the other.

        Returns the max abs error; raises if it exceeds ``atol``.
        """
        from transformers.cache_utils import DynamicCache

        ids = torch.arange(3, 3 + length, device=self.device) % self.config.vocab_size
        keys = []
        for start in (0, shift):
            cache = DynamicCache()
            pos = torch.arange(start, start + length, device=self.device)
            self.forward(ids, pos, cache, None, None)
            keys.append(torch.stack([layer.keys[0].float() for layer in cache.layers]))  # (L, H, T, D)
        err = (self.rerotate(keys[0], shift) - keys[1]).abs().max().item()
        if err > atol:
            raise RuntimeError(f"RoPE re-rotation self-check failed: max error {err:.2e} > {atol}")
        return err
