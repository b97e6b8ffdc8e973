"""The shared base of the family adapters, and the choice of adapter for a model.

An adapter runs one forward pass of a *stock* transformers model with explicit
position ids and an explicit ``allowed`` matrix (which query attends to which
key), over a cache. Families differ only in how positions reach the model
(``position_ids`` for RoPE and learned tables, a bias for ALiBi) and in the
mask format their attention code expects; that is all a subclass overrides.

Models with sliding-window layers (Gemma 2/3, Mistral, Qwen2 with ``use_sliding_window``)
count each window over positions: every forward is given the position of each key as well
as each query (a :class:`~.attention.Forward`'s ``positions``), so a cached unit's states are encoded with
the window and new tokens see only the keys inside it, wherever the units sit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import attention


@dataclass(slots=True, frozen=True)
class KVShape:
    """The geometry of one token's cached states."""

    n_layers: int
    n_kv_heads: int
    head_dim: int  # key head size
    head_dim_v: int  # value head size

    def bytes_per_token(self, element_size: int) -> int:
        return self.n_layers * self.n_kv_heads * (self.head_dim + self.head_dim_v) * element_size


class UnsupportedModelError(ValueError):
    """The model's positional encoding or attention is not one pcache-rag can cache exactly."""


class Adapter:
    """Base adapter. Subclasses set ``family`` and override what differs."""

    family = "base"
    #: whether cached keys can be moved to other positions by rotation (RoPE)
    rerotatable = False
    #: whether the model's attention runs through pcache_sdpa (split recompute, the batch's ragged
    #: step and the fused decode step need it); set by adapters that install it
    fast = False
    #: mask format: "bool" (True = attend), "additive" (0 / -inf) or "bool_inverted" (True = masked)
    mask_format = "bool"

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.max_positions = self._max_positions()
        self.kv_shape = self._kv_shape()
        #: the sliding window of the model's local layers (None: every layer is global)
        self.window: int | None = sliding_window(self.config)
        #: attention logit soft-capping (Gemma 2), applied inside pcache_sdpa
        self.softcap: float | None = getattr(self.config, "attn_logit_softcapping", None) or None

    @property
    def needs_key_positions(self) -> bool:
        """Whether every forward over a cache needs ``key_positions`` (ALiBi's bias; windows)."""
        return self.family == "alibi" or self.window is not None

    @property
    def constrained(self) -> str:
        """Why this model's attention takes the dense-mask path for recomputed rows and cannot
        be calibrated ('' when it need not): windows and soft-capping."""
        if self.window is not None:
            return f"sliding-window attention ({self.window} positions)"
        if self.softcap is not None:
            return f"soft-capped attention logits ({self.softcap:g})"
        return ""

    # -- facts about the model -------------------------------------------------

    def _max_positions(self) -> int:
        c = self.config
        for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
            v = getattr(c, name, None)
            if isinstance(v, int) and v > 0:
                return v
        return 1 << 20  # ALiBi models have no hard limit

    def _kv_shape(self) -> KVShape:
        c = self.config
        n_heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None) or c.n_heads
        n_kv = getattr(c, "num_key_value_heads", None) or n_heads
        hidden = getattr(c, "hidden_size", None) or getattr(c, "n_embd", None) or c.d_model
        head_dim = getattr(c, "head_dim", None) or hidden // n_heads
        n_layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None) or c.n_layers
        return KVShape(n_layers, n_kv, head_dim, head_dim)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def move(self, kv, delta: int):
        """``kv`` shifted by ``delta`` positions, or an error if this family cannot move states."""
        raise UnsupportedModelError(
            f"{self.family} position models cannot move cached states; encode them at the target positions"
        )

    # -- masks -----------------------------------------------------------------

    def mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """``allowed`` (q, kv) bool -> the 4-D mask this family's attention reads."""
        m = allowed[None, None]  # (1, 1, q, kv)
        if self.mask_format == "bool":
            return m
        if self.mask_format == "bool_inverted":
            return ~m
        neg = torch.finfo(self.dtype).min
        return torch.zeros(m.shape, dtype=self.dtype, device=m.device).masked_fill_(~m, neg)

    # -- the forward pass --------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,  # (q,)
        position_ids: torch.Tensor,  # (q,)
        cache,  # a transformers Cache holding the kv states before these tokens
        allowed: torch.Tensor | None,  # (q, kv_total) bool, or None for plain causal over a fresh cache
        key_positions: torch.Tensor | None,  # (kv_total,) position of every key (ALiBi needs it)
        logits_to_keep: int | torch.Tensor = 1,
        inputs_embeds: torch.Tensor | None = None,  # (q, hidden): these instead of input_ids' embeddings
        fwd: attention.Forward | None = None,  # what this forward asks of pcache_sdpa
    ) -> torch.Tensor:
        """Run the model; returns logits ``(logits_to_keep, vocab)``, or those of the rows a tensor
        ``logits_to_keep`` (M,) names (a batch step's last token of each sequence); fills ``cache``.
        A windowed model needs ``key_positions`` over a non-empty cache. ``inputs_embeds`` (a
        learned conditioning prefix) replaces the tokens' embeddings; ``input_ids`` then only
        gives the length. ``fwd`` (:class:`~.attention.Forward`) goes with the model's call to its
        attention; a windowed model's positions are written into it (a new one when None)."""
        mask = None if allowed is None else self.mask(allowed)
        if self.window is not None and (fwd is None or fwd.step is None):  # (a ragged step's sequences bring theirs)
            if key_positions is None:
                if cache.get_seq_length() > 0:
                    raise ValueError(f"{self.family} adapter: a sliding-window model needs key_positions "
                                     "for a forward over a filled cache")
                key_positions = position_ids
            fwd = fwd if fwd is not None else attention.Forward()
            fwd.positions = attention.Positions.of(position_ids, key_positions)
        tokens = {"input_ids": input_ids[None]} if inputs_embeds is None else {"inputs_embeds": inputs_embeds[None]}
        out = self.model(
            **tokens,
            position_ids=position_ids[None],
            attention_mask=mask,
            cache=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **({attention.FORWARD: fwd} if fwd is not None else {}),
        )
        return out.logits[0]


def sliding_window(config) -> int | None:
    """The window of the config's sliding (local) attention layers, or None if it has none."""
    sw = getattr(config, "sliding_window", None)
    if not sw:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return int(sw) if any("sliding" in str(t) for t in types) else None
    return int(sw) if getattr(config, "use_sliding_window", True) else None


def use_fast_attention(model) -> bool:
    """Switch a model whose attention goes through transformers' interface to ``pcache_sdpa``."""
    try:
        model.set_attn_implementation(attention.NAME)
    except Exception:  # noqa: BLE001 - older/odd models: set the config directly
        model.config._attn_implementation = attention.NAME
    return model.config._attn_implementation == attention.NAME
