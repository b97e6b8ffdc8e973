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
        rp = getattr(self.config, "rope_parameters", None) or {}
        rope_type = rp.get("rope_type", "default") if isinstance(rp, dict) else "default"
        self.rope_type = rope_type
        self.inv_freq = rot.inv_freq.detach().clone()  # (head_dim/2,)
        self.rerotatable = (
            not any(t in str(rope_type) for t in _LENGTH_DEPENDENT)
            and self.inv_freq.numel() * 2 == self.kv_shape.head_dim
        )
        self.fast = use_fast_attention(model)

    def rerotate(self, keys: torch.Tensor, delta, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if not self.rerotatable:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} cannot be re-rotated exactly (its frequencies depend on the "
                "sequence length or it rotates part of the head); encode modules at their slot instead"
            )
        return rerotate(keys, delta, self.inv_freq, out_dtype)

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
            keys.append(cache.layers[0].keys.float())
        err = (self.rerotate(keys[0], shift) - keys[1]).abs().max().item()
        if err > atol:
            raise RuntimeError(f"RoPE re-rotation self-check failed: max error {err:.2e} > {atol}")
        return err
