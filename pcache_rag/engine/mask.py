"""The query a prefill computes, and what each of its rows may attend to (``docs/pml.md``).

Pure: lengths and token ids in, tensors out; testable without a model. Rows of the
mask are the query tokens (PML arguments, then the uncached text); columns are the
assembled cache (``C`` keys) followed by the query itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class QueryLayout:
    """The new tokens of a prefill, in query order, and their mask."""

    ids: list[int]  # (q,) argument tokens, then the uncached tokens
    positions: list[int]  # (q,) their position ids
    spans: list[tuple[str, int, int]]  # (label, start, end) over cache order: units, arguments, "uncached"
    allowed: torch.Tensor | None  # (q, C + q) bool, or None where no mask is needed


def query_layout(labels: Sequence[str], lengths: Sequence[int], args: Sequence[tuple[Any, Any, list[int]]],
                 uncached_ids: Sequence[int], uncached_positions: Sequence[int], preamble: str | None,
                 need_mask: bool, attend_all: bool = False) -> QueryLayout:
    """Lay out the query over cached units of ``lengths`` (labelled ``labels``).

    ``args``: ``(unit, slot, ids)`` for each PML parameter argument; an argument attends to
    its module's tokens before the slot (``slot.offset`` of them), to the ``preamble`` unit
    when given, and to itself causally, at positions from ``slot.start``. Uncached tokens
    attend to everything before them. ``need_mask=False`` returns no mask (the attention's
    split path: every cached key, then the new tokens causally). ``attend_all`` makes every
    query row see the whole cache, then the query causally (the ``recompute="all"`` anchor).
    """
    C = sum(lengths)
    spans: list[tuple[str, int, int]] = []
    offsets: dict[str, int] = {}
    sizes: dict[str, int] = {}
    off = 0
    for name, n in zip(labels, lengths):
        offsets[name], sizes[name] = off, n
        spans.append((name, off, off + n))
        off += n
    q = sum(len(ids) for _, _, ids in args) + len(uncached_ids)
    allowed = torch.zeros(q, C + q, dtype=torch.bool) if need_mask else None
    ids_out: list[int] = []
    pos_out: list[int] = []
    row = 0
    for u, slot, ids in args:
        n, a = len(ids), C + row
        spans.append((f"{u.name}.{slot.name}", a, a + n))
        if allowed is not None:
            m0 = offsets[u.name]
            allowed[row : row + n, m0 : m0 + slot.offset] = True
            if preamble is not None and preamble in offsets:
                allowed[row : row + n, offsets[preamble] : offsets[preamble] + sizes[preamble]] = True
            allowed[row : row + n, a : a + n] = torch.ones(n, n, dtype=torch.bool).tril_()
        ids_out.extend(ids)
        pos_out.extend(range(slot.start, slot.start + n))
        row += n
    U = len(uncached_ids)
    spans.append(("uncached", C + row, C + row + U))
    if allowed is not None:
        allowed[row:, : C + row] = True
        allowed[row:, C + row :] = torch.ones(U, U, dtype=torch.bool).tril_()
        if attend_all:
            allowed[:, :C] = True
            allowed[:, C:] = torch.ones(q, q, dtype=torch.bool).tril_()
    ids_out.extend(uncached_ids)
    pos_out.extend(uncached_positions)
    return QueryLayout(ids_out, pos_out, spans, allowed)


def context_mask(T: int, P: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(T, P + T): ``T`` new tokens see all ``P`` context keys, then each other causally."""
    allowed = torch.ones(T, P + T, dtype=torch.bool, device=device)
    allowed[:, P:] = torch.ones(T, T, dtype=torch.bool, device=device).tril_()
    return allowed
