"""ALiBi models (BLOOM, MPT): the bias follows the real position ids.

Stock BLOOM builds its bias from the attention mask's running count and MPT
from a static range, so neither can express a gap left by a skipped module.
This adapter replaces exactly that piece: a forward pre-hook on each block
swaps the block's ``alibi`` / ``position_bias`` (and mask) arguments for ones
built from the positions of the keys. The slopes are read from the stock
builders, so they match the model's own. Outside an adapter call the hooks do
nothing and the model behaves as stock, in any other thread too.

The bias is ``slope * (key_pos - max_key_pos)``: softmax ignores a constant per
query row, so this equals ALiBi's ``-slope * (query_pos - key_pos)`` for every
attended key and stays small in low precision.
"""

from __future__ import annotations

import threading

import torch

from .base import Adapter


class AlibiAdapter(Adapter):
    family = "alibi"

    @staticmethod
    def matches(model) -> bool:
        return getattr(model.config, "model_type", "") in ("bloom", "mpt")

    def __init__(self, model):
        super().__init__(model)
        mt = self.config.model_type
        tr = model.transformer
        n_heads = self.kv_shape.n_kv_heads
        if mt == "bloom":
            from transformers.models.bloom.modeling_bloom import build_alibi_tensor

            # (heads, 1, 2) holding slope * [0, 1]
            self.slopes = build_alibi_tensor(torch.ones(1, 2), n_heads, torch.float32)[:, 0, 1].clone()
            self.blocks, self.bias_arg, self.mask_format = tr.h, "alibi", "additive"
        else:
            # (heads, 1, 2) holding slope * [-1, 0]
            self.slopes = -tr.build_mpt_alibi_tensor(n_heads, 2)[:, 0, 0].float().clone()
            self.blocks, self.bias_arg, self.mask_format = tr.blocks, "position_bias", "bool_inverted"
        #: the bias and mask of each adapter forward in progress, by the thread that runs it: the
        #: blocks run in the caller's thread, and a stock forward of the model in another thread at the
        #: same time finds nothing here (BLOOM's and MPT's blocks take no extra keywords to carry it)
        self._ctx: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hooks = [b.register_forward_pre_hook(self._hook, with_kwargs=True) for b in self.blocks]

    def move(self, kv, delta: int):
        """ALiBi keys and values carry no position: only the position ids change."""
        return kv.with_positions(kv.position_ids + delta)

    def _max_positions(self) -> int:
        return int(getattr(self.config, "max_seq_len", 0) or 1 << 20)

    def _hook(self, module, args, kwargs):
        ctx = self._ctx.get(threading.get_ident())
        if ctx is None:  # a stock forward
            return None
        bias, mask = ctx
        kwargs[self.bias_arg] = bias
        kwargs["attention_mask"] = mask
        return args, kwargs

    def forward(self, input_ids, position_ids, cache, allowed, key_positions, logits_to_keep: int | torch.Tensor = 1,
                inputs_embeds: torch.Tensor | None = None, fwd=None):
        """As :meth:`Adapter.forward`; ``fwd`` is not read: these models' attention is their own,
        not pcache_sdpa (its counters stay 0, and the callers that need it say so)."""
        if inputs_embeds is not None:
            raise ValueError("the ALiBi adapter runs token ids only; a learned conditioning prefix needs a RoPE model")
        q = input_ids.shape[0]
        if allowed is None:  # plain causal over a fresh cache
            allowed = torch.ones(q, q, dtype=torch.bool, device=input_ids.device).tril_()
            key_positions = position_ids
        kp = key_positions.to(torch.float32)
        rel = (kp - kp.max())[None, None, :]  # (1, 1, kv)
        bias = (self.slopes.to(kp.device)[:, None, None] * rel).to(self.dtype)  # (heads, 1, kv)
        me = threading.get_ident()
        self._ctx[me] = (bias, self.mask(allowed))
        try:
            out = self.model(
                input_ids=input_ids[None], cache=cache, use_cache=True, logits_to_keep=logits_to_keep
            )
        finally:
            del self._ctx[me]
        return out.logits[0]
