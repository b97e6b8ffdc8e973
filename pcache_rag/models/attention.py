"""``pcache_sdpa``: scaled-dot-product attention over a long cache without repeating keys.

Stock sdpa with an explicit mask repeats every key/value head ``n_heads /
n_kv_heads`` times before attending (``repeat_kv``), which on the cached path
copies the whole assembled cache each layer. Here the query heads of one group
are folded into the query length instead: ``(B, H, q, D) -> (B, H_kv, G*q, D)``,
so keys and values are read in place. Results equal stock sdpa; with no mask
and a square query it is plain causal attention (what full prefill uses).

**The split path.** With no mask and a query of ``q`` tokens over ``kv > q`` keys (new
tokens after an assembled cache, or a decode step), the query sees every earlier key and
its own block causally. No dense mask is built: the earlier keys are attended without a
mask, the block causally, and the partial results are merged exactly by their
log-sum-exps (``softmax`` over a union of key sets is the LSE-weighted mean of the
softmaxes over each set). On CPU the pieces run on PyTorch's flash kernel, which returns
the LSE (``aten._scaled_dot_product_flash_attention_for_cpu``); elsewhere on a float32
math path.

**One call where the mask is small.** Where a block of ``q`` query rows over ``kv`` keys needs
at most :data:`ONE_CALL_MASK` mask elements (``G*q x kv``), the unmasked range and the causal block
are one flash call with an additive mask that is zero but over the block's upper triangle (and
over a skipped range of keys): a recomputing forward's few dozen rows make ~4 such calls a layer,
and the second call and the log-sum-exp merge cost more than the mask (~20-25% of each call on this
CPU). The masks are built once a forward and kept on its :class:`Forward` for all its layers.

**Recomputed rows** (:func:`recompute_attention`) ride on the split too, when a
:class:`Forward` names them (``rec``): the rows' fresh keys replace their stale ones in place,
runs of consecutive rows attend to the cache before them unmasked and to themselves causally, and
the new tokens see the whole cache; only a scattered selection needs masks, small ones
(blocks of rows, each over the keys between its first and last row).

**Calibrated attention** (APE, arXiv 2502.05431) rides on the same split. With
a forward's ``span``, the keys of one cached range (the documents, after the shared
preamble) get logits ``s/T + (S*T - 1) * LSE(s/T)`` on every query row, so that range's
share of attention is ``exp(S*T*LSE(s/T))`` and its distribution inside is ``softmax(s/T)``:
one flash call with scale ``1/T``, its LSE multiplied by ``S*T``. The preamble and the new
tokens keep their logits. ``T = S = 1`` is ordinary attention.

**Ragged steps** (a forward's ``step``, for continuous batching): one forward computes the tokens
of ``B`` sequences that own their keys and values, of any lengths: one token of each
sequence that decodes, and chunks of the prompts being prefilled, flattened into one query.
The projections and MLPs run over all of them at once (one read of the weights); the
attention runs per sequence over that sequence's own rows, by the same call its solo
prefill or decode step makes (with its own calibrated span, if any). No padding and no
mask: a short sequence reads only its own rows.

**Sliding windows and soft-capping** (Gemma 2/3, Mistral, Qwen2 local layers). transformers
passes ``sliding_window`` and ``softcap`` to the attention of the layers that have them. A
window is counted over *positions*, not cache rows (an assembled cache has gaps and moved
units): a forward's ``positions``, given by the adapter, hold the position of each
query and key, and a key is seen only where ``query_pos - key_pos < window`` (transformers'
own rule). When no key falls outside a layer's window the ordinary paths serve it
unchanged; otherwise, and on every soft-capped layer, :func:`constrained_attention` runs
the same semantics (the mask, or "every earlier key and the block causally") in blocks of
query rows, each over only the keys its rows can see, with the small mask that block needs.

**How a forward says what it needs.** The engine's adapter passes one :class:`Forward` record
with the model's own call, as the keyword :data:`FORWARD`; transformers hands a forward's
extra keywords to every layer's attention function, so :func:`pcache_sdpa` reads it there.
Nothing is kept in a thread's state or on the model between forwards, and a stock forward of
the caller's model (no record) attends as stock attention does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    fwd: Forward | None = kwargs.pop(FORWARD, None)  # what the engine asks of this forward (None: a stock one)
    step = fwd.step if fwd is not None else None
    if step is not None:  # a batch of sequences of their own lengths: each attends alone
        return step.attend(module, query, scaling, **kwargs), None
    B, H, q, D = query.shape
    Hkv, kv = key.shape[1], key.shape[2]
    G = H // Hkv
    window: int | None = kwargs.get("sliding_window") or None
    softcap: float | None = kwargs.get("softcap") or None
    if window is not None or softcap is not None:
        pos = fwd.positions if fwd is not None else None
        if window is not None and pos is None and kv > window and attention_mask is None:
            # a stock forward of the caller's model, no engine in the call and no mask: one sequence
            # at contiguous positions, its queries the last q of its keys (transformers' own layout)
            pos = Positions.of(torch.arange(kv - q, kv, device=query.device), torch.arange(kv, device=query.device))
        # the engine's forwards give the keys' positions; a stock forward with a mask (the window already
        # in it) takes the masked path below
        cut = window is not None and pos is not None and pos.cuts(window)
        if cut or softcap:
            if fwd is not None and (fwd.rec is not None or fwd.span is not None):
                raise ValueError(f"{NAME}: recomputed rows and calibrated attention take the dense mask on "
                                 "windowed or soft-capped layers")
            probe = fwd.probe if fwd is not None else None
            if probe is not None:  # what the rows really see: the window applied
                probe.add(query, key, effective_mask(attention_mask, q, kv, window if cut else None, pos,
                                                     query.device), scaling)
            return constrained_attention(query, key, value, attention_mask, scaling,
                                         window if cut else None, pos, softcap), None
    probe, rec, cal = (fwd.probe, fwd.rec, fwd.span) if fwd is not None else (None, None, None)
    if probe is not None:
        probe.add(query, key, attention_mask, scaling)
    if attention_mask is None and rec is not None:
        fwd.recomputed_calls += 1  # type: ignore[union-attr]
        return recompute_attention(query, key, value, scaling, rec, fwd.masks), None  # type: ignore[union-attr]
    if attention_mask is None and (cal is not None or q < kv and q > 1):
        if q > kv:
            raise ValueError(f"{NAME}: a query of {q} tokens over {kv} keys")
        if cal is not None:
            fwd.calibrated_calls += 1  # type: ignore[union-attr]
        return split_attention(query, key, value, scaling, cal, fwd.masks if fwd is not None else None), None
    if cal is not None:
        raise ValueError(f"{NAME}: calibrated attention needs the split path (no mask); this forward has one")
    if attention_mask is None:
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


@dataclass(frozen=True, slots=True)
class Calibration:
    """APE's temperature ``T`` and scale ``S`` for the documents' keys (see the module
    docstring). ``Calibration.parse("ape:0.9:0.9")``; ``"none"`` is ``None``."""

    temperature: float = 1.0
    scale: float = 1.0

    def __post_init__(self):
        if not (self.temperature > 0 and self.scale > 0):
            raise ValueError(f"calibration needs T > 0 and S > 0, not T={self.temperature}, S={self.scale}")

    @property
    def spec(self) -> str:
        return f"ape:{self.temperature:g}:{self.scale:g}"

    @classmethod
    def parse(cls, spec: str | Calibration | None) -> Calibration | None:
        if spec is None or isinstance(spec, Calibration):
            return spec
        s = str(spec).strip()
        if s in ("", "none"):
            return None
        bits = s.split(":")
        try:
            if bits[0] == "ape" and len(bits) == 3:
                return cls(float(bits[1]), float(bits[2]))
        except ValueError:
            pass
        raise ValueError(f"calibration must be 'none' or 'ape:T:S' (e.g. 'ape:0.9:0.9'), not {spec!r}")


@dataclass(frozen=True, slots=True)
class CalibratedSpan:
    """Keys ``[start, end)`` of every forward inside :func:`calibrated` get ``calibration``."""

    start: int
    end: int
    calibration: Calibration


@dataclass(frozen=True, slots=True)
class RecomputedRows:
    """A recompute forward: its query starts with the cache ``rows`` (n,) computed again, whose
    fresh keys are written after the ``C`` assembled ones, then the new tokens."""

    rows: torch.Tensor  # (n,) long, ascending, on the model's device
    C: int
    spans: tuple[tuple[int, int], ...] = ()  # the runs of consecutive rows, [a, b); see of()
    host: tuple[int, ...] = ()  # ``rows`` on the host

    @classmethod
    def of(cls, rows: torch.Tensor, C: int, device) -> RecomputedRows:
        """``rows`` (n,) ascending, with its runs of consecutive rows found once (on the host)."""
        r = rows.tolist()
        spans, a = [], 0
        for i in range(1, len(r) + 1):
            if i == len(r) or r[i] != r[i - 1] + 1:
                spans.append((r[a], r[i - 1] + 1))
                a = i
        return cls(rows.to(device), C, tuple(spans), tuple(r))


@dataclass(slots=True, eq=False)
class RaggedStep:
    """One forward over the tokens of ``B`` sequences that each own their rows, flattened into
    one query of ``N = sum(counts)`` tokens: sequence ``b`` brings ``counts[b]`` tokens (one
    when it decodes, a chunk of its prompt when it is prefilled), written after the first
    ``lengths[b]`` rows of its ``keys[b]`` (L, H_kv, capacity, D) and ``values[b]``
    (:meth:`write`, from the cache layer). Each attends to its own earlier rows unmasked and
    to its own new tokens causally (:meth:`attend`); ``spans[b]``: its calibrated keys;
    ``positions[b]``: its tokens' and rows' positions, for sliding-window layers."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: list[int]
    counts: list[int]
    spans: list[CalibratedSpan | None]
    positions: list[Positions] | None = None
    layer: int = -1  # the layer whose attention runs next (set by write)
    calls: int = 0  # attention calls served (0 after a forward: the model bypassed pcache_sdpa)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store this step's ``key`` (1, H_kv, N, D) and ``value`` of ``layer`` in each sequence's rows."""
        self.layer = layer
        off = 0
        for b, (n, c) in enumerate(zip(self.lengths, self.counts)):
            self.keys[b][layer, :, n : n + c].copy_(key[0, :, off : off + c])  # (H_kv, c, D)
            self.values[b][layer, :, n : n + c].copy_(value[0, :, off : off + c])
            off += c

    def attend(self, module, query: torch.Tensor, scaling: float | None, **kwargs) -> torch.Tensor:
        """``query`` (1, H, N, D) -> (1, N, H, Dv): each sequence's tokens over its own rows, by the
        call its own prefill or decode step makes (the split path, or plain attention)."""
        if query.shape[0] != 1 or query.shape[2] != sum(self.counts):
            raise ValueError(f"{NAME}: a ragged step of {sum(self.counts)} tokens got a query of {tuple(query.shape)}")
        self.calls += 1
        i, off, outs = self.layer, 0, []
        for b, (n, c) in enumerate(zip(self.lengths, self.counts)):
            q = query[:, :, off : off + c]  # (1, H, c, D)
            k = self.keys[b][i, :, : n + c][None]  # (1, H_kv, n+c, D), a view
            v = self.values[b][i, :, : n + c][None]
            # each sequence's call is an ordinary one: its own calibrated span, or its own positions
            # for windows (calibrated attention is refused on windowed models)
            assert self.positions is None or self.spans[b] is None
            own = Forward(span=self.spans[b], positions=self.positions[b] if self.positions is not None else None)
            out, _ = pcache_sdpa(module, q, k, v, None, scaling=scaling, **{**kwargs, FORWARD: own})
            outs.append(out)  # (1, c, H, Dv)
            off += c
        return torch.cat(outs, dim=1)


def _attend(query, key, value, scale: float, causal: bool, mask: torch.Tensor | None = None):
    """``(out (B, H, q, Dv), lse (B, H, q) float32)`` of softmax attention over all of ``key``
    (or causally, for a square block; or with ``mask`` (q, k), added to the logits: 0 or
    -inf, every row seeing some key); ``query`` and ``key`` have the same number of heads.
    On CPU, PyTorch's flash kernel, which returns the LSE; elsewhere :func:`_attend_math`."""
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, attn_mask=None if mask is None else mask[None, None], scale=scale)
        return out, lse.float()
    return _attend_math(query, key, value, scale, causal, mask)


def _attend_math(query, key, value, scale: float, causal: bool, mask: torch.Tensor | None = None):
    """:func:`_attend` on explicit float32 logits (any device). Written out because no
    public kernel returns the LSE on every device; the CUDA flash and efficient kernels
    do, and are the next step where a GPU can measure them."""
    s = (query.float() @ key.float().transpose(-1, -2)) * scale  # (B, H, q, k)
    if mask is not None:
        s = s + mask.float()
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril_(), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return (torch.softmax(s, dim=-1) @ value.float()).to(query.dtype), lse


def split_attention(
    query: torch.Tensor,  # (B, H, q, D): the last q of the keys' tokens
    key: torch.Tensor,  # (B, H_kv, kv, D)
    value: torch.Tensor,  # (B, H_kv, kv, Dv)
    scaling: float | None,
    span: CalibratedSpan | None = None,
    masks: dict | None = None,
) -> torch.Tensor:
    """Each query row attends to every key before the query block and causally inside it,
    with ``span``'s keys calibrated; merged by log-sum-exp (or, with no span and a small mask, one
    masked call: :func:`_tail_causal`; ``masks``: a forward's memo of them). Returns (B, q, H, Dv)."""
    q = query.shape[2]
    if span is None and _one_call(query, key):
        return _tail_causal(query, key, value, scaling, masks=masks)
    before = key.shape[2] - q
    return _split(query, key[:, :, :before], value[:, :, :before], key[:, :, before:], value[:, :, before:],
                  scaling, span)


def recompute_attention(
    query: torch.Tensor,  # (B, H, n + q, D): the n recomputed cache rows, then the q new tokens
    key: torch.Tensor,  # (B, H_kv, C + n + q, D): the assembled cache, the fresh rows, the new tokens
    value: torch.Tensor,  # (B, H_kv, C + n + q, Dv)
    scaling: float | None,
    rec: RecomputedRows,
    masks: dict | None = None,
) -> torch.Tensor:
    """Exactly :func:`pcache_rag.recompute.recompute_mask`'s attention, without its dense mask.

    Each recomputed row's fresh keys are first written over its stale ones, in place (the
    workspace gets them after the forward anyway: :meth:`~pcache_rag.kv.Workspace.replace_rows`),
    so the cache reads in cache order. A run of consecutive recomputed rows ``[a, b)`` then
    attends to the cache before it unmasked and to itself causally (the whole cache, for
    ``all``: one causal pass); more than :data:`MAX_RUNS` runs (a scattered selection) attend
    in blocks of rows instead, each with a small mask (:func:`_scattered_rows`). The new tokens attend to the
    whole cache unmasked and to themselves causally. Every piece is merged by log-sum-exp, or is one
    masked call where its mask is small (:func:`_tail_causal`; ``masks``: the forward's memo).
    Returns (B, n + q, H, Dv)."""
    rows, C = rec.rows, rec.C
    n = rows.shape[0]
    key[:, :, :C].index_copy_(2, rows, key[:, :, C : C + n])  # fresh rows in place of the stale ones
    value[:, :, :C].index_copy_(2, rows, value[:, :, C : C + n])
    kc, vc = key[:, :, :C], value[:, :, :C]
    runs = rec.spans
    if len(runs) <= MAX_RUNS:
        outs, i = [], 0
        for a, b in runs:  # query rows i .. i + (b - a) are cache rows a .. b
            m = b - a
            qr = query[:, :, i : i + m]
            if _one_call(qr, kc[:, :, :b]):  # keys [0, b): the last m are the run's own
                outs.append(_tail_causal(qr, kc[:, :, :b], vc[:, :, :b], scaling, masks=masks))
            else:
                outs.append(_split(qr, kc[:, :, :a], vc[:, :, :a], kc[:, :, a:b], vc[:, :, a:b], scaling, None))
            i += m
        rows_out = torch.cat(outs, dim=1)  # (B, n, H, Dv)
    else:
        rows_out = _scattered_rows(query[:, :, :n], kc, vc, rows, rec.host, scaling)
    if _one_call(query[:, :, n:], key):  # the n fresh rows after the cache are already in it: skipped
        new_out = _tail_causal(query[:, :, n:], key, value, scaling, skip=(C, C + n), masks=masks)
    else:
        new_out = _split(query[:, :, n:], kc, vc, key[:, :, C + n :], value[:, :, C + n :], scaling, None)
    return torch.cat([rows_out.to(new_out.dtype), new_out], dim=1).contiguous()  # (B, n + q, H, Dv)


#: a selection in more runs of consecutive rows than this attends in blocks (:func:`_scattered_rows`)
MAX_RUNS = 8
#: recomputed rows per block of a scattered selection
SCATTERED_BLOCK = 48


def _scattered_rows(
    query: torch.Tensor,  # (B, H, n, D): recomputed cache rows, in cache order
    key: torch.Tensor,  # (B, H_kv, C, D): the cache, the rows' fresh keys already in place
    value: torch.Tensor,  # (B, H_kv, C, Dv)
    rows: torch.Tensor,  # (n,) their cache rows, ascending, on the device
    host: tuple[int, ...],  # the same, on the host
    scaling: float | None,
) -> torch.Tensor:
    """Row ``rows[i]`` attends to cache rows ``0..rows[i]`` (causal in cache order), for a
    scattered selection, in blocks of :data:`SCATTERED_BLOCK` rows ``lo..hi``: every row of a
    block sees keys ``[0, lo)`` (one unmasked pass) and keys ``[lo, hi]`` through a small mask;
    the two are merged by log-sum-exp. Keys after ``hi`` are never read, so this costs about
    half of one dense ``n x C`` mask (the way a causal kernel skips its upper triangle).
    Returns (B, n, H, Dv)."""
    B, H, n, D = query.shape
    Hkv = key.shape[1]
    G = H // Hkv
    sc = scaling if scaling is not None else D**-0.5
    outs = []
    for s in range(0, n, SCATTERED_BLOCK):
        e = min(n, s + SCATTERED_BLOCK)
        m, lo, hi = e - s, host[s], host[e - 1] + 1
        qb = query[:, :, s:e].reshape(B, Hkv, G * m, D)  # rows ordered (group member, token): no repeat of keys
        seen = torch.arange(lo, hi, device=query.device)[None, :] <= rows[s:e, None]  # (m, hi - lo)
        mask = torch.zeros(seen.shape, dtype=query.dtype, device=query.device).masked_fill_(~seen, float("-inf"))
        o, lse = _attend(qb, key[:, :, lo:hi], value[:, :, lo:hi], sc, False, mask.repeat(G, 1))
        if lo > 0:  # every row of the block sees all of [0, lo): unmasked; each row sees its own key above
            o0, lse0 = _attend(qb, key[:, :, :lo], value[:, :, :lo], sc, False)
            w = torch.softmax(torch.stack([lse0, lse]), dim=0).unsqueeze(-1)  # each part's share
            o = (w[0] * o0.float() + w[1] * o.float()).to(query.dtype)
        outs.append(o.reshape(B, Hkv, G, m, -1))
    return torch.cat(outs, dim=3).reshape(B, H, n, -1).transpose(1, 2)  # (B, n, H, Dv)


#: the most mask elements (``G*q x kv``, fp32: 4 MB) a block of query rows attends through in one
#: call (:func:`_tail_causal`); a larger block takes the split's unmasked calls and merge
ONE_CALL_MASK = 1 << 20


def _one_call(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether ``query`` (B, H, q, D), the last ``q`` of ``key``'s rows, attends in one masked call."""
    B, H, q, _ = query.shape
    return B == 1 and 1 < q <= key.shape[2] and (H // key.shape[1]) * q * key.shape[2] <= ONE_CALL_MASK


def _tail_causal(
    query: torch.Tensor,  # (1, H, q, D): the last q of the keys' tokens
    key: torch.Tensor,  # (1, H_kv, kv, D)
    value: torch.Tensor,  # (1, H_kv, kv, Dv)
    scaling: float | None,
    skip: tuple[int, int] = (0, 0),
    masks: dict | None = None,
) -> torch.Tensor:
    """Each query row sees every key before the block (but the ``skip`` range ``[s, e)``) and the
    block causally, in one flash call: the query heads of a group folded into the rows (keys read
    in place), and an additive mask ``(G*q, kv)`` that is ``-inf`` over the block's upper triangle
    and the skipped range. ``masks`` keeps each mask for the forward's other layers.
    Returns (1, q, H, Dv)."""
    B, H, q, D = query.shape
    Hkv, kv = key.shape[1], key.shape[2]
    G = H // Hkv
    ident = (G, q, kv, skip, query.dtype, query.device)
    mask = masks.get(ident) if masks is not None else None
    if mask is None:
        mask = torch.zeros(q, kv, dtype=query.dtype, device=query.device)
        mask[:, kv - q :].masked_fill_(torch.ones(q, q, dtype=torch.bool, device=query.device).triu_(1),
                                       float("-inf"))
        mask[:, skip[0] : skip[1]] = float("-inf")
        mask = mask.repeat(G, 1)  # rows ordered (group member, token), as the folded query's
        if masks is not None:
            masks[ident] = mask
    sc = scaling if scaling is not None else D**-0.5
    out, _ = _attend(query.reshape(B, Hkv, G * q, D), key, value, sc, False, mask)
    return out.reshape(B, H, q, -1).transpose(1, 2).contiguous()  # (1, q, H, Dv)


def _split(
    query: torch.Tensor,  # (B, H, q, D)
    key: torch.Tensor,  # (B, H_kv, before, D): every row attends to all of these
    value: torch.Tensor,  # (B, H_kv, before, Dv)
    kb: torch.Tensor,  # (B, H_kv, q, D): the query block's own keys, attended causally
    vb: torch.Tensor,  # (B, H_kv, q, Dv)
    scaling: float | None,
    span: CalibratedSpan | None,
) -> torch.Tensor:
    """The split path's body: unmasked ranges of ``key`` and the causal block, merged by
    log-sum-exp. Returns (B, q, H, Dv)."""
    B, H, q, D = query.shape
    Hkv = key.shape[1]
    G = H // Hkv
    sc = scaling if scaling is not None else D**-0.5
    before = key.shape[2]
    # (start, end, scale, LSE multiplier) of each unmasked range before the block
    ranges = [(0, before, sc, 1.0)]
    if span is not None:
        a, b = max(0, min(span.start, before)), max(0, min(span.end, before))
        T, S = span.calibration.temperature, span.calibration.scale
        ranges = [(0, a, sc, 1.0), (a, b, sc / T, S * T), (b, before, sc, 1.0)]
    outs, lses = [], []
    folded = query.reshape(B, Hkv, G * q, D)  # rows ordered (group member, token): no mask, so no repeat
    for a, b, scale, mult in ranges:
        if b <= a:
            continue
        o, lse = _attend(folded, key[:, :, a:b], value[:, :, a:b], scale, False)
        outs.append(o.reshape(B, H, q, -1))
        lses.append(lse.reshape(B, H, q) * mult)
    if G > 1:  # the block itself: q keys, repeated for the groups
        kb, vb = kb.repeat_interleave(G, dim=1), vb.repeat_interleave(G, dim=1)
    o, lse = _attend(query, kb, vb, sc, True)
    outs.append(o)
    lses.append(lse)
    if len(outs) == 1:
        return o.transpose(1, 2).contiguous()
    L = torch.stack(lses)  # (n, B, H, q)
    w = torch.softmax(L, dim=0).unsqueeze(-1)  # each range's share of the attention
    out = sum(wi * oi.float() for wi, oi in zip(w, outs))
    return out.to(query.dtype).transpose(1, 2).contiguous()  # (B, q, H, Dv)


@dataclass(frozen=True, slots=True, eq=False)
class Positions:
    """The position of every query row (q,) and key (kv,) of one forward (the keys: the cache's
    rows, then the query's own), for windowed layers. ``span``: the widest query-key distance."""

    queries: torch.Tensor  # (q,) long
    keys: torch.Tensor  # (kv,) long
    span: int

    @classmethod
    def of(cls, queries: torch.Tensor, keys: torch.Tensor) -> Positions:
        return cls(queries, keys, int(queries.max()) - int(keys.min()) if keys.numel() and queries.numel() else 0)

    def cuts(self, window: int) -> bool:
        """Whether some key lies outside ``window`` of some query row (else the window changes nothing)."""
        return self.span >= window


def effective_mask(mask: torch.Tensor | None, q: int, kv: int, window: int | None, pos: Positions | None,
                   device, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The keys query rows ``rows`` (default: all ``q``) see: ``mask`` (B, 1, q, kv), or every
    earlier key and the block causally, with ``window`` applied over ``pos``. Returns
    (B or 1, 1, rows, kv) bool."""
    r0, r1 = rows if rows is not None else (0, q)
    if mask is None:
        cols = torch.arange(kv, device=device)
        allowed = (cols[None, :] <= (kv - q + torch.arange(r0, r1, device=device))[:, None])[None, None]
    else:
        allowed = mask[:, :, r0:r1]
    if window is not None and pos is not None:
        near = pos.keys.to(device)[None, :] > pos.queries.to(device)[r0:r1, None] - window  # (rows, kv)
        allowed = allowed & near
    return allowed


#: query rows per block of :func:`constrained_attention` (bounds its masks to BLOCK x keys seen)
BLOCK = 256


def constrained_attention(
    query: torch.Tensor,  # (B, H, q, D): the last q of the keys' tokens
    key: torch.Tensor,  # (B, H_kv, kv, D)
    value: torch.Tensor,  # (B, H_kv, kv, Dv)
    mask: torch.Tensor | None,  # (B, 1, q, kv) bool, True = attend; None: every earlier key, the block causally
    scaling: float | None,
    window: int | None,  # keys at ``query_pos - key_pos >= window`` are not seen
    pos: Positions | None,  # needed with a window
    softcap: float | None,  # logits become softcap * tanh(logits / softcap) (Gemma 2)
) -> torch.Tensor:
    """Attention with a sliding window over positions and/or soft-capped logits, exactly the
    stock eager semantics, in blocks of :data:`BLOCK` query rows: each block attends to the
    range of keys its rows can see, with a mask of that range (SDPA's kernel, or float32
    logits where soft-capping needs them). Returns (B, q, H, Dv)."""
    B, H, q, D = query.shape
    Hkv, kv = key.shape[1], key.shape[2]
    G = H // Hkv
    sc = scaling if scaling is not None else D**-0.5
    if B != 1 and window is not None:
        raise ValueError(f"{NAME}: windowed attention counts one sequence's positions, not a batch of {B}")
    dev = query.device
    out = torch.empty(B, q, H, value.shape[-1], dtype=query.dtype, device=dev)
    for r0 in range(0, q, BLOCK):
        r1 = min(q, r0 + BLOCK)
        b = r1 - r0
        allowed = effective_mask(mask, q, kv, window, pos, dev, (r0, r1))  # (B or 1, 1, b, kv)
        seen = allowed.reshape(-1, kv).any(0).nonzero()
        lo, hi = (int(seen[0]), int(seen[-1]) + 1) if seen.numel() else (0, 1)
        a = allowed[..., lo:hi]  # (B or 1, 1, b, n): the range of keys this block sees
        qb = query[:, :, r0:r1].reshape(B, Hkv, G * b, D)  # rows ordered (group member, token)
        am = a.repeat(1, 1, G, 1)  # (B or 1, 1, G*b, n)
        kb, vb = key[:, :, lo:hi], value[:, :, lo:hi]
        if softcap is None:
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=am, scale=sc)
        else:
            s = (qb.float() @ kb.float().transpose(-1, -2)) * sc
            s = torch.tanh(s / softcap) * softcap
            s = s.masked_fill(~am, float("-inf"))
            o = (torch.softmax(s, dim=-1) @ vb.float()).to(query.dtype)
        out[:, r0:r1] = o.reshape(B, H, b, -1).transpose(1, 2)
    return out


class AttentionProbe:
    """How much attention the query rows of a forward give to each of the first ``C`` keys,
    summed over layers, heads and query rows: ``scores`` (C,). Given to one forward as its
    :class:`Forward`'s ``probe`` (``recompute="focus:R"``); counts the layers it saw in ``calls``."""

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



#: the model keyword that carries a :class:`Forward` down to :func:`pcache_sdpa` (transformers
#: passes a forward's extra keywords to every layer's attention function)
FORWARD = "pcache_forward"


@dataclass(slots=True, eq=False)
class Forward:
    """What one of the engine's forwards asks of :func:`pcache_sdpa`, passed with it as the
    model's keyword :data:`FORWARD` (:meth:`~.base.Adapter.forward`'s ``fwd``), never kept
    between forwards or in a thread's state. Every field None is a stock forward.

    * ``span``: keys calibrated on every query row (:class:`CalibratedSpan`);
    * ``rec``: the query starts with recomputed cache rows (:class:`RecomputedRows`);
    * ``probe``: an :class:`AttentionProbe` that sums the attention each cached key gets;
    * ``step``: the forward is a :class:`RaggedStep` (each sequence attends alone);
    * ``positions``: the positions windows count over (:class:`Positions`).

    ``calibrated_calls`` and ``recomputed_calls`` count the attention calls that applied
    ``span`` and ``rec``: 0 after a forward means the model's attention did not run through
    :func:`pcache_sdpa`, and the caller says so."""

    span: CalibratedSpan | None = None
    rec: RecomputedRows | None = None
    probe: AttentionProbe | None = None
    step: RaggedStep | None = None
    positions: Positions | None = None
    calibrated_calls: int = 0
    recomputed_calls: int = 0
    #: the additive masks its layers attend through (:func:`_tail_causal`), built by the first layer
    masks: dict = field(default_factory=dict)

AttentionInterface.register(NAME, pcache_sdpa)
