"""One prefill: assemble cached states in the workspace, compute the new tokens over them.

The data path of every cached prompt: the :class:`~pcache_rag.kv.Workspace` places the
units' states (copying only what is not resident), :mod:`.mask` lays out the query and
its mask, :mod:`pcache_rag.recompute` picks context rows to compute again, and one
forward of the stock model computes them all. When nothing needs a mask beyond "every
earlier key, and the new tokens causally", no mask is built: the attention's split path
(:mod:`pcache_rag.models.attention`) serves the cache unmasked and the new tokens causally.
Recomputed rows ride on it too (a mask of recomputed rows by cache rows only); PML
parameters and ALiBi keep the dense mask.
The same path carries calibrated attention (``ape:T:S``) on every cached key after the
first unit.

**Query weights.** With :attr:`Prefiller.query_weights` (an engine's ``query_weights="bf16"``),
the rows computed over cached states (the new tokens and the recomputed rows) read the bf16
copies of the linear weights that the decode step reads
(:mod:`pcache_rag.models.fast_decode`): oneDNN's bf16 products run 2-3.6x faster than fp32's
on a CPU with AVX-512 BF16 at 16-96 rows. Without bf16 dot products (an AVX2 CPU) they are 4-5x
slower than fp32's there, and only the output head's one row reads them
(:attr:`Prefiller.head_weights`: the first token's logits, a product that streams its weights).
A prompt with nothing cached is computed in the model's own weights: it is the baseline, and states that will be stored are never computed
in bf16 (the encoder does not come here).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..kv import ModuleKV, Workspace
from ..models import UnsupportedModelError
from ..models.attention import CalibratedSpan, Calibration, Forward, RecomputedRows
from ..models.fast_decode import decoding as small_weights
from ..recompute import Lexicon, Recompute, recompute_mask, select_rows
from .mask import query_layout
from .types import PrefillResult


class Prefiller:
    """Runs prefills over one workspace with one model adapter."""

    def __init__(self, adapter, workspace: Workspace, lexicon: Lexicon | None = None) -> None:
        self.adapter = adapter
        self.workspace = workspace
        #: the words of cached sentences, for ``match:N`` (None: that policy is refused)
        self.lexicon = lexicon
        #: recomputed rows on the split path (no dense mask) where the attention allows it;
        #: False forces the dense mask, the baseline ``bench all``'s recompute figure measures
        self.split_recompute = True
        #: the rows computed over cached states read the bf16 decode weights (module docstring);
        #: set by the engine's ``query_weights``, never without bf16 decode weights in the model
        self.query_weights = False
        #: only the output head's row reads them (the first token's logits): ``query_weights="bf16"``
        #: on a CPU whose bf16 products of many rows are slower than fp32's (module docstring)
        self.head_weights = False

    @torch.no_grad()
    def full(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, last: int = 1) -> torch.Tensor:
        """The baseline: one causal forward over all tokens, nothing reused. Returns the last
        logits (vocab,), or those of the ``last`` positions (last, vocab) when ``last > 1``."""
        from transformers.cache_utils import DynamicCache

        dev = self.adapter.device
        ids = input_ids.to(dev)  # (T,)
        pos = position_ids.to(dev) if position_ids is not None else torch.arange(ids.shape[0], device=dev)
        out = self.adapter.forward(ids, pos, DynamicCache(), None, None, logits_to_keep=last)  # (last, vocab)
        return out[-1] if last == 1 else out[-last:]

    @torch.no_grad()
    def run(self, labels: Sequence[str], kvs: list[ModuleKV], args: Sequence[tuple[Any, Any, list[int]]],
            uncached_ids: Sequence[int], uncached_positions: Sequence[int], preamble: str | None, reserve: int,
            policy: Recompute = Recompute(), calibration: Calibration | None = None) -> PrefillResult:
        """Assemble ``kvs`` (labelled), compute arguments and uncached tokens (and the context
        rows ``policy`` selects), return the last logits. ``reserve`` leaves room for that many
        generated tokens."""
        adapter, ws = self.adapter, self.workspace
        dev = adapter.device
        t0 = time.perf_counter()
        q = sum(len(ids) for _, _, ids in args) + len(uncached_ids)
        rows = select_rows(adapter, ws, kvs, policy, uncached_ids, uncached_positions, self.lexicon)
        C, copied = ws.assemble(kvs, extra=q + len(rows) + reserve)
        t1 = time.perf_counter()
        plain = C == 0 and not args  # nothing cached: an ordinary causal prefill
        # the split path, with no dense mask: new tokens over the cache, and recomputed rows
        # where the attention is pcache_sdpa's (it reads which rows from the forward's record, ``rec``)
        split = not args and adapter.family != "alibi" and (
            not rows or (self.split_recompute and adapter.fast and not adapter.constrained))
        span = self.calibrated_span(kvs, calibration, bool(args), policy if rows else None)
        lay = query_layout(labels, [kv.length for kv in kvs], args, uncached_ids, uncached_positions, preamble,
                           need_mask=not (plain or split), attend_all=policy.kind == "all" and bool(rows))
        allowed = lay.allowed
        new_ids = torch.tensor(lay.ids, dtype=torch.long)  # (q,)
        new_pos = torch.tensor(lay.positions, dtype=torch.long)
        cached_pos = [kv.position_ids for kv in kvs]
        ids_t, pos_t = new_ids, new_pos
        nS = len(rows)
        rows_t = torch.tensor(rows, dtype=torch.long) if nS else None  # (nS,) only when rows are recomputed
        rec = None
        if rows_t is not None:
            # Selected context rows join the query, before the new tokens (recompute.py).
            ids_t = torch.cat([torch.cat([kv.token_ids for kv in kvs])[rows_t], new_ids])
            pos_t = torch.cat([torch.cat(cached_pos)[rows_t], new_pos])
            if allowed is None:  # the split path: the attention reads the rows, no mask is built
                rec = RecomputedRows.of(rows_t, C, dev)
            else:
                allowed = recompute_mask(allowed, C, rows_t)
        if allowed is not None:
            allowed = allowed.to(dev)
        key_pos = torch.cat(cached_pos + [pos_t]).to(dev) if adapter.needs_key_positions and not plain else None
        t2 = time.perf_counter()
        if plain or not (self.query_weights or self.head_weights):
            rows_in_bf16: Any = contextlib.nullcontext()
        else:
            rows_in_bf16 = small_weights(None) if self.query_weights else small_weights(0, head=1)  # the head's row
        fwd = None if plain else Forward(span=span, rec=rec)  # a plain forward is a stock one
        with rows_in_bf16:
            try:
                logits = adapter.forward(ids_t.to(dev), pos_t.to(dev), ws.cache(), allowed, key_pos, fwd=fwd)[-1]
            except BaseException:
                if rec is not None:  # fresh rows may stand in place of stored ones: trust nothing resident
                    ws.invalidate()
                raise
        if fwd is not None and fwd.span is not None and fwd.calibrated_calls == 0:
            raise UnsupportedModelError(f"calibrated attention: {type(adapter.model).__name__} does not run its "
                                        "attention through pcache_sdpa")
        if fwd is not None and fwd.rec is not None and fwd.recomputed_calls == 0:  # the adapter said it does
            raise UnsupportedModelError(f"recompute: {type(adapter.model).__name__} did not run its attention "
                                        "through pcache_sdpa")
        if rows_t is not None:
            # On the split path the attention already wrote the fresh rows over the stale ones in
            # the workspace's key views; replace_rows writes them again (n rows a layer), which
            # keeps the result right for a model whose attention received copies, and moves the tail.
            ws.replace_rows(rec.rows if rec is not None else rows_t.to(dev), C, nS, q)
        t3 = time.perf_counter()
        return PrefillResult(
            logits=logits,
            input_ids=torch.cat([kv.token_ids for kv in kvs] + [new_ids]),
            position_ids=torch.cat(cached_pos + [new_pos]),
            spans=lay.spans,
            cached_tokens=C - nS,
            computed_tokens=q + nS,
            copied_tokens=copied,
            assemble_s=t1 - t0,
            forward_s=t3 - t2,
            recomputed_tokens=nS,
            calibrated=span,
        )

    def calibrated_span(self, kvs: list[ModuleKV], calibration: Calibration | None, args: bool,
                        recompute: Recompute | None) -> CalibratedSpan | None:
        """The keys ``calibration`` applies to: every cached key after the first unit (the
        shared preamble); ``None`` without a calibration or with fewer than two units.
        Refused by name where the split path cannot run."""
        if calibration is None or len(kvs) < 2:
            return None
        if self.adapter.family == "alibi":
            raise UnsupportedModelError("calibrated attention runs through pcache_sdpa's split path; ALiBi models "
                                        "attend with their own bias")
        if self.adapter.constrained:
            raise UnsupportedModelError(f"calibrated attention ({calibration.spec}) is not supported with "
                                        f"{self.adapter.constrained}: it would be applied beyond the window")
        if args or recompute is not None:
            what = "PML parameters" if args else f"recompute {recompute}"
            raise ValueError(f"calibrated attention ({calibration.spec}) does not combine with {what}: choose one")
        P = kvs[0].length
        return CalibratedSpan(P, sum(kv.length for kv in kvs), calibration)
