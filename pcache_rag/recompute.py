"""Selective recomputation: which cached context tokens to compute again, and the exact mask.

Modules are encoded apart, so a prompt that imports several of them reads
states that never saw each other. Recomputing a few well-chosen context tokens
on top of the cached states recovers much of the lost quality:

* ``none``: the cached path as it is.
* ``epic:K``: the first ``K`` tokens of every unit after the first (EPIC /
  LegoLink, arXiv 2410.15332). The set is known before the forward.
* ``blend:R`` (``blend:R@L``): CacheBlend's selection. Every context token is
  run through layers ``0..L`` (``L = 1`` by default); tokens are ranked by how
  far their fresh keys at layer ``L`` are from the cached ones, and the top
  ``R`` fraction is recomputed. Unlike CacheBlend, the fresh early-layer states
  are used only to choose: the chosen tokens are recomputed through every layer
  by the same exact forward as ``epic``, and the other tokens keep their cached
  states in every layer, so one definition of "recomputed" holds for all modes.
* ``focus:R``: the question's neighbourhood. The new tokens (the question) are
  run once over the cached states; context tokens are ranked by the attention
  the question gives them, summed over layers and heads, and each keeps the
  best score within ``FOCUS_WINDOW`` tokens of it, so that the words around a
  match (where an answer sits) come along. The top ``R`` fraction is then
  recomputed by the same exact forward. RoPE and learned-position models whose
  attention runs through ``pcache_sdpa``; ALiBi is refused.
* ``match:N``: the question's own sentences. Every context unit after the first is cut
  into sentences and lines (:class:`Lexicon`); the one sharing the most words with the
  question (stemmed, stopwords dropped) is recomputed, then the one sharing the most with
  the question and the sentences chosen so far, ``N`` in all (a chain, so that a second
  hop's sentence, named only by the first, comes along). Nothing is chosen where no
  sentence shares a word. A few dozen tokens, chosen before the forward from text alone:
  it reads a document's states where a cached read goes wrong most, on the sentence a
  question asks about when a neighbour holds a sentence like it (issue 20's competing facts).
* ``each:N``: the question's sentence and its look-alikes. In every context unit after the
  first, the ``N`` sentences or lines sharing the most words with the question (at least one;
  ties go to the shorter, then the earlier), cut as ``match:N`` cuts them. Where retrieval
  brings several chunks that state the same kind of fact about other subjects (a catalogue,
  a policy manual's sections), each chunk's own sentence of that shape is read in context,
  not the asked one alone (issue 56). At most ``N`` x 64 tokens a unit.
* ``alike:N``: ``each:N``'s sentences that look alike: only those sharing at least half as many
  of the question's words as the best-matching sentence of the prompt (rounded up). A filler line
  that shares one word ("time", "code") with a question naming four is not a look-alike of the
  fact it asks about, and reading it again costs rows without telling facts apart (issue 56).
  Where the best sentence shares one or two words, it is ``each:N``.
* ``each:N@U`` / ``alike:N@U``: the same, from the ``U``-th unit on (the first unit is 0; ``U = 1``,
  every unit after the first, when no ``@`` is given). In ``CachedRAG``'s order the unit after the
  preamble holds the weakest retrieved chunk, and its states were encoded at that slot after the
  learned prefix, the nearest of all to what full prefill computes there: ``@2`` leaves it as cached.
* ``contrast:N``: ``match:N``'s sentences whole, and in every other unit after the first only
  the tokens of its closest look-alike sentence that the question does not name: what tells
  the look-alikes apart (another place's name, its value), a few tokens a chunk where
  ``each:N`` reads the whole sentence (issue 56).
* ``all``: every context token (a correctness anchor: it equals a full causal
  prefill of the same tokens and positions).
* ``Recompute.explicit(rows)``: the given cache rows (no string form). This is
  how ``pcache-rag eval quality``'s oracle modes recompute exactly the tokens
  that hold an answer, to tell a selection's misses from what recomputation
  can recover at all.

The first unit (the preamble, or the first module) is never selected by
``epic``/``blend``: it starts at position 0 and its states are already exact.

How a set is recomputed (:func:`recompute_mask`): the selected tokens go into
the forward's query, before the new tokens, with their own ids and positions.
Each one attends causally, in cache order, to every token before it: cached
rows that were not selected, and the fresh rows of selected ones (never their
stale cached rows). New tokens see the same. Afterwards the fresh rows replace
the stale ones in the workspace only; the store is never changed.
"""

from __future__ import annotations

import array
import hashlib
import math
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .words import tokenize

KINDS = ("none", "epic", "blend", "focus", "match", "each", "alike", "contrast", "all", "rows")
#: ``focus``: a token's score is the best within this many tokens either side
FOCUS_WINDOW = 4
#: ``match``: a sentence or line longer than this many tokens is cut into pieces of at most this many
MATCH_MAX_TOKENS = 64
#: the policy of answers over retrieved or marked documents (``CachedRAG(recompute="auto")``, the
#: connectors' default, ``"auto"`` in :func:`resolve_auto`): the question's sentence in *every*
#: retrieved document, recomputed in context. It was ``match:1`` (the best-matching sentence only:
#: issue 20, competing facts, 47 against full prefill's 45 at ~18x). Over documents that state the
#: same kind of fact about other subjects (issue 56's look-alike corpus, ~330-token documents),
#: ``match:1`` trailed full prefill by 14 points on 150 tuning questions (38 against 59, p = 0.001)
#: where ``each:1`` answered 55 (p = 0.45) at 10.2x, with the rows over cached states in bf16
#: (docs/runs/2026-12-07-lookalike-default.md, which also has the reporting draw and the four sets).
#: ``alike:1`` is faster on the four older sets (13-22x against 12-19x) and within the bar, but agrees
#: with full prefill less on two of them, and was never tuned there: not the default
#: (docs/runs/2026-12-07-alike-four-sets.md)
RAG_RECOMPUTE = "each:1"
#: ``"auto"`` for a structured answer (a grammar constrains it): the same. Over four look-alike
#: documents per prompt, 24 structured prompts per draw (scripts/measure-structured-recompute.py),
#: ``match:1`` changed 17 and 19 answers of full prefill's where reordering the documents changed 14
#: and 13 (its floor); ``each:1`` changed 14 and 12 (tuning seed 0, reporting seed 1;
#: docs/runs/2026-12-06-structured-recompute.md)
STRUCTURED_RECOMPUTE = "each:1"
#: ``match``: the units whose sentences a :class:`Lexicon` keeps (~16 KB each at 400 tokens, measured;
#: cutting a unit again costs ~3 ms)
LEXICON_MEMO = 1024


@dataclass(frozen=True, slots=True)
class Recompute:
    """A recompute policy; build one with :meth:`parse` (``"none"``, ``"epic:16"``,
    ``"blend:0.15"``, ``"blend:0.15@2"``, ``"focus:0.1"``, ``"match:1"``, ``"each:1"``, ``"alike:1"``, ``"all"``)."""

    kind: str = "none"
    k: int = 0  # epic: tokens per unit; match: sentences; each, alike: sentences a unit
    ratio: float = 0.0  # blend: fraction of candidate tokens
    check_layer: int = 1  # blend: the layer whose keys are compared
    first_unit: int = 1  # each, alike: the first unit (0: the first of all) whose sentences are read
    rows: tuple[int, ...] = ()  # rows: the cache rows to recompute (see :meth:`explicit`)

    @classmethod
    def explicit(cls, rows) -> Recompute:
        """Recompute exactly these cache rows (indices into the assembled context, in cache
        order; the first unit's rows are refused because its states are already exact)."""
        rs = tuple(sorted({int(r) for r in rows}))
        if rs and rs[0] < 0:
            raise ValueError(f"recompute rows must be >= 0, not {rs[0]}")
        return cls("rows", rows=rs)

    @classmethod
    def parse(cls, spec: str | Recompute | None) -> Recompute:
        if spec is None:
            return cls()
        if isinstance(spec, Recompute):
            return spec
        s = str(spec).strip().lower()
        name, _, arg = s.partition(":")
        try:
            if name in ("none", "all") and not arg:
                return cls(name)
            if name in ("each", "alike") and "@" in arg:
                n, _, u = arg.partition("@")
                if int(n) < 1 or int(u) < 1:
                    raise ValueError
                return cls(name, k=int(n), first_unit=int(u))
            if name in ("epic", "match", "each", "alike", "contrast") and arg:
                k = int(arg)
                if k < 1:
                    raise ValueError
                return cls(name, k=k)
            if name == "blend" and arg:
                r, _, layer = arg.partition("@")
                ratio = float(r)
                if not 0.0 < ratio <= 1.0:
                    raise ValueError
                return cls("blend", ratio=ratio, check_layer=int(layer) if layer else 1)
            if name == "focus" and arg:
                ratio = float(arg)
                if not 0.0 < ratio <= 1.0:
                    raise ValueError
                return cls("focus", ratio=ratio)
        except ValueError:
            pass
        raise ValueError(
            f"recompute must be 'none', 'all', 'epic:K', 'match:N', 'each:N', 'alike:N' or 'contrast:N' (K, N >= 1; "
            f"each and alike also 'each:N@U', from unit U >= 1), 'blend:R' / "
            f"'blend:R@LAYER' or 'focus:R' (0 < R <= 1), not {spec!r}"
        )

    def __str__(self) -> str:
        if self.kind in ("epic", "match", "each", "alike", "contrast"):
            return f"{self.kind}:{self.k}" + (f"@{self.first_unit}" if self.first_unit != 1 else "")
        if self.kind == "blend":
            return f"blend:{self.ratio:g}" + (f"@{self.check_layer}" if self.check_layer != 1 else "")
        if self.kind == "focus":
            return f"focus:{self.ratio:g}"
        if self.kind == "rows":
            return f"rows({len(self.rows)})"
        return self.kind


def resolve_auto(spec: str | Recompute | None, calibration: str | None = None,
                 structured: bool = False) -> str | Recompute | None:
    """The one reading of a recompute argument, for ``CachedRAG``, the connectors and the server:
    ``"auto"`` is :data:`RAG_RECOMPUTE`, the default of answers over documents
    (:data:`STRUCTURED_RECOMPUTE` for a ``structured`` answer), or nothing (None) where an index's
    ``calibration`` is in force (the two do not combine); ``None`` stays the engine's own
    (``none``); anything else is itself. A bad policy is refused here, by name."""
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        if calibration is not None:
            return None
        return STRUCTURED_RECOMPUTE if structured else RAG_RECOMPUTE
    if spec is not None:
        Recompute.parse(spec)
    return spec


def epic_rows(lengths: list[int], k: int) -> list[int]:
    """Cache rows of the first ``k`` tokens of every unit after the first."""
    rows: list[int] = []
    off = lengths[0] if lengths else 0
    for n in lengths[1:]:
        rows.extend(range(off, off + min(k, n)))
        off += n
    return rows


def blend_rows(scores: torch.Tensor, lengths: list[int], ratio: float) -> list[int]:
    """The top ``ratio`` of the rows after the first unit by ``scores`` (C,), in cache order."""
    first = lengths[0] if lengths else 0
    cand = scores[first:]
    n = min(cand.shape[0], max(1, math.ceil(ratio * cand.shape[0]))) if cand.shape[0] else 0
    if n == 0:
        return []
    top = torch.topk(cand.float(), n).indices + first
    return sorted(top.tolist())


def focus_scores(attention: torch.Tensor, window: int = FOCUS_WINDOW) -> torch.Tensor:
    """Each row's score (C,) is the best attention (C,) within ``window`` rows either side."""
    return torch.nn.functional.max_pool1d(attention[None, None].float(), 2 * window + 1, 1, window)[0, 0]


#: one sentence or line of a unit: its (start, end) token offsets in the unit, and its words
Segment = tuple[int, int, frozenset]


class Lexicon:
    """The sentences and lines of cached units, and their words, for ``match:N``.

    A unit's tokens are cut after every token that holds a newline, and after a token ending
    in ``.``, ``!`` or ``?`` when the next token starts with whitespace; a piece longer than
    :data:`MATCH_MAX_TOKENS` is cut into pieces of at most that many. Cuts fall on token
    boundaries, so a chosen sentence is recomputed token for token. A piece's words are
    :func:`pcache_rag.words.tokenize`'s of its decoded text. Each unit's pieces are kept
    (the last :data:`LEXICON_MEMO` units read), since one document serves many questions.
    Safe to share between threads.
    """

    def __init__(self, tokenizer, memo: int = LEXICON_MEMO) -> None:
        self.tokenizer = tokenizer
        self.memo = memo
        self._units: OrderedDict[bytes, list[Segment]] = OrderedDict()  # digest of the ids -> pieces
        self._lock = threading.Lock()

    def words(self, ids) -> frozenset:
        """The words of the text of token ``ids`` (special tokens left out)."""
        return frozenset(tokenize([self.tokenizer.decode(list(ids), skip_special_tokens=True)])[0])

    def segments(self, ids) -> list[Segment]:
        """The pieces of the unit whose token ids are ``ids`` (a list or a 1-D tensor)."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        key = hashlib.blake2b(array.array("q", ids).tobytes(), digest_size=16).digest()
        with self._lock:
            seg = self._units.get(key)
            if seg is not None:
                self._units.move_to_end(key)
                return seg
        seg = self._cut(ids)
        with self._lock:
            self._units[key] = seg
            while len(self._units) > self.memo:
                self._units.popitem(last=False)
        return seg

    def _cut(self, ids: list[int]) -> list[Segment]:
        if not ids:
            return []
        tok = self.tokenizer
        pieces = tok.batch_decode([[i] for i in ids])  # each token's text (a split character reads as U+FFFD)
        raw = tok.convert_ids_to_tokens(ids)  # a leading space's mark: byte-level Ġ (or Ċ, a newline), SentencePiece ▁

        def spaced(j: int) -> bool:  # a space starts token j (a newline there ends the line after it)
            return "\n" not in pieces[j] and (pieces[j][:1].isspace() or str(raw[j])[:1] in ("\u0120", "\u2581"))

        bounds, start = [], 0
        for i, p in enumerate(pieces):
            end_here = "\n" in p or (p.rstrip().endswith((".", "!", "?")) and i + 1 < len(ids) and spaced(i + 1))
            if end_here or i + 1 == len(ids):
                for s in range(start, i + 1, MATCH_MAX_TOKENS):
                    bounds.append((s, min(i + 1, s + MATCH_MAX_TOKENS)))
                start = i + 1
        texts = [tok.decode(ids[s:e], skip_special_tokens=True) for s, e in bounds]
        return [(s, e, frozenset(sys.intern(x) for x in w)) for (s, e), w in zip(bounds, tokenize(texts))]


def match_rows(lexicon: Lexicon, kvs: list, new_ids, n: int) -> list[int]:
    """Cache rows of the ``n`` sentences (after the first unit) that ``match:n`` chooses for the
    question ``new_ids``: the one sharing the most words with it, then each next one sharing
    the most with the question and the sentences chosen before; ties go to the shorter, then
    the earlier. In cache order."""
    want = set(lexicon.words(new_ids))
    if not want or len(kvs) < 2:
        return []
    cands: list[Segment] = []  # (first row, end row, words), rows in the assembled context
    off = kvs[0].length
    for kv in kvs[1:]:
        cands.extend((off + s, off + e, w) for s, e, w in lexicon.segments(kv.token_ids) if w)
        off += kv.length
    chosen: list[int] = []
    for _ in range(n):
        best, key = -1, (0, 0)
        for i, (s, e, w) in enumerate(cands):
            k = (len(want & w), s - e)  # shared words, then shortness
            if k[0] and i not in chosen and k > key:
                best, key = i, k
        if best < 0:
            break
        chosen.append(best)
        want |= cands[best][2]
    return sorted(r for i in chosen for r in range(cands[i][0], cands[i][1]))


def each_rows(lexicon: Lexicon, kvs: list, new_ids, n: int, alike: bool = False, first: int = 1) -> list[int]:
    """Cache rows of ``each:n``: in every unit from ``first`` on (1: every unit after the first), the
    ``n`` sentences sharing the most words with the question ``new_ids`` (at least one word; ties go
    to the shorter, then the earlier). ``alike`` (``alike:n``): only sentences sharing at least half
    as many words (rounded up) as the best-sharing sentence of all those units. In cache order."""
    want = lexicon.words(new_ids)
    if not want or len(kvs) < 2:
        return []
    first = max(1, first)
    units: list[tuple[int, list[tuple[int, int, int, int]]]] = []  # (first row, ranked pieces)
    off = sum(kv.length for kv in kvs[:first])
    for kv in kvs[first:]:
        units.append((off, sorted((-len(want & w), e - s, s, e) for s, e, w in lexicon.segments(kv.token_ids)
                                  if want & w)))
        off += kv.length
    least = 1
    if alike:
        best = max((-ranked[0][0] for _, ranked in units if ranked), default=0)
        least = max(1, (best + 1) // 2)
    rows: list[int] = []
    for off, ranked in units:
        picked = sorted((s, e) for shared, _, s, e in ranked[:n] if -shared >= least)
        rows.extend(off + r for s, e in picked for r in range(s, e))
    return rows


def contrast_rows(lexicon: Lexicon, kvs: list, new_ids, n: int) -> list[int]:
    """Cache rows of ``contrast:n``: :func:`match_rows`' sentences whole, and in every unit after
    the first the tokens of its sentence sharing the most words with the question (as
    :func:`each_rows` picks it) whose words the question does not have, and its digits. In
    cache order."""
    want = lexicon.words(new_ids)
    if not want or len(kvs) < 2:
        return []
    rows = set(match_rows(lexicon, kvs, new_ids, n))
    off = kvs[0].length
    for kv in kvs[1:]:
        ranked = sorted((-len(want & w), e - s, s, e) for s, e, w in lexicon.segments(kv.token_ids) if want & w)
        if ranked:
            _, _, s, e = ranked[0]
            ids = kv.token_ids[s:e].tolist()
            for j, t in enumerate(ids):
                words = lexicon.words([t])  # a number's pieces have no words of their own: kept by their digits
                if (words and not words & want) or any(c.isdigit() for c in lexicon.tokenizer.decode([t])):
                    rows.add(off + s + j)
        off += kv.length
    return sorted(rows)


def recompute_mask(base: torch.Tensor, C: int, rows: torch.Tensor) -> torch.Tensor:
    """The (nS + q, C + nS + q) mask of a forward whose query is the ``rows`` (nS,) of the
    cache, recomputed, followed by the q new tokens whose own mask is ``base`` (q, C + q).

    Physical key columns: the C assembled rows (the selected ones now stale and never
    attended), the nS fresh rows, then the q new tokens.
    """
    q = base.shape[0]
    nS = rows.shape[0]
    cmap = torch.arange(C)  # logical cache row -> physical column
    cmap[rows] = C + torch.arange(nS)
    out = torch.zeros(nS + q, C + nS + q, dtype=torch.bool)
    out[:nS, cmap] = torch.arange(C)[None, :] <= rows[:, None]  # causal in cache order, fresh rows
    out[nS:, cmap] = base[:, :C]
    out[nS:, C + nS :] = base[:, C:]
    return out


class _Stop(Exception):
    pass


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's list of decoder blocks (the largest ``ModuleList`` of blocks)."""
    n = None
    c = model.config
    for name in ("num_hidden_layers", "n_layer", "n_layers"):
        n = getattr(c, name, None) or n
    best = None
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and (n is None or len(m) == n):
            if best is None or len(m) > len(best):
                best = m
    if best is None:
        raise RuntimeError(f"cannot find the decoder layers of {type(model).__name__}")
    return best


def first_layers_keys(adapter, ids: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
    """Fresh keys (H, C, D) at ``layer`` of a causal forward over ``ids``, stopped as soon as that
    layer has written them (its attention and MLP, and every later layer, are never run)."""
    from transformers.cache_utils import DynamicCache

    n_layers = len(decoder_layers(adapter.model))
    if not 0 <= layer < n_layers:
        raise ValueError(f"blend check layer {layer} is outside 0..{n_layers - 1}")

    class StopAfterKeys(DynamicCache):  # the forward ends where layer ``layer`` stores its keys
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            if layer_idx == layer:
                raise _Stop
            return out

    cache = StopAfterKeys()
    C = ids.shape[0]
    if adapter.needs_key_positions:  # ALiBi: its bias needs every key's position, so the explicit mask
        allowed, key_pos = torch.ones(C, C, dtype=torch.bool, device=ids.device).tril_(), pos
    else:  # plain causal, as a full prefill runs (no dense C x C mask: the causal flash kernel)
        allowed = key_pos = None
    try:
        adapter.forward(ids, pos, cache, allowed, key_pos)
    except _Stop:
        pass
    if len(cache.layers) <= layer or cache.layers[layer].keys is None:
        raise RuntimeError(f"blend: {type(adapter.model).__name__} never stored the keys of layer {layer}")
    return cache.layers[layer].keys[0]  # (H, C, D)


def select_rows(adapter, workspace, kvs: list, policy: Recompute, new_ids=(), new_pos=(),
                lexicon: Lexicon | None = None) -> list[int]:
    """Cache rows to recompute under ``policy`` for the assembled ``kvs`` (only when several
    units are assembled); ``focus`` ranks them by the attention of ``new_ids`` at ``new_pos``
    (the question), computed over ``workspace``; ``match`` by the words ``lexicon`` reads."""
    lengths = [kv.length for kv in kvs]
    if policy.kind == "rows":  # checked even for one unit: explicit rows are never dropped in silence
        C = sum(lengths)
        first = lengths[0] if lengths else 0
        bad = [r for r in policy.rows if not first <= r < C]
        if bad:
            raise ValueError(f"recompute rows {bad[:5]} are outside the rows after the first unit "
                             f"({first}..{C - 1}) of this prompt")
        return list(policy.rows)
    if policy.kind == "none" or len(kvs) < 2:
        return []
    if policy.kind == "all":
        return list(range(sum(lengths)))
    if policy.kind == "epic":
        return epic_rows(lengths, policy.k)
    if policy.kind in ("match", "each", "alike", "contrast"):
        if lexicon is None:
            raise ValueError(f"recompute '{policy.kind}' compares words: give select_rows the engine's Lexicon")
        if not new_ids:
            raise ValueError(f"recompute '{policy.kind}' ranks context by the new tokens' words; this prompt has none")
        if policy.kind in ("each", "alike"):
            return each_rows(lexicon, kvs, list(new_ids), policy.k, policy.kind == "alike", policy.first_unit)
        rank = {"match": match_rows, "contrast": contrast_rows}[policy.kind]
        return rank(lexicon, kvs, list(new_ids), policy.k)
    if policy.kind == "focus":
        return blend_rows(focus_scores(question_attention(adapter, workspace, kvs, list(new_ids), list(new_pos))),
                          lengths, policy.ratio)
    # blend: score every context token by its key deviation at the check layer
    dev = adapter.device
    ids = torch.cat([kv.token_ids for kv in kvs]).to(dev)
    pos = torch.cat([kv.position_ids for kv in kvs]).to(dev)
    fresh = first_layers_keys(adapter, ids, pos, policy.check_layer)  # (H, C, D)
    cached = torch.cat([kv.layer_keys(policy.check_layer, dev, fresh.dtype) for kv in kvs], dim=1)
    scores = (fresh - cached).pow(2).sum(dim=(0, 2))  # (C,)
    return blend_rows(scores, lengths, policy.ratio)


def question_attention(adapter, workspace, kvs: list, new_ids: list[int], new_pos: list[int]) -> torch.Tensor:
    """Attention (C,) that ``new_ids`` give each assembled row, summed over layers and heads:
    one forward of the new tokens over the cached states, whose rows are then dropped."""
    from .models import UnsupportedModelError, attention

    if adapter.family == "alibi":
        raise UnsupportedModelError("recompute 'focus' reads attention through pcache_sdpa; ALiBi models "
                                    "do not use it: choose 'epic' or 'blend'")
    if not new_ids:
        raise ValueError("recompute 'focus' ranks context by the new tokens' attention; this prompt has none")
    dev = adapter.device
    C, _ = workspace.assemble(kvs, extra=len(new_ids))
    U = len(new_ids)
    allowed = torch.ones(U, C + U, dtype=torch.bool)
    allowed[:, C:] = torch.ones(U, U, dtype=torch.bool).tril_()
    try:
        probe = attention.AttentionProbe(C)
        new_pos_t = torch.tensor(new_pos, device=dev)
        key_pos = (torch.cat([kv.position_ids.to(dev) for kv in kvs] + [new_pos_t])
                   if adapter.needs_key_positions else None)
        adapter.forward(torch.tensor(new_ids, device=dev), new_pos_t, workspace.cache(), allowed.to(dev), key_pos,
                        fwd=attention.Forward(probe=probe))
    finally:
        for layer in workspace.layers:
            layer.set_length(C)
    if probe.calls == 0 or probe.scores is None:
        raise UnsupportedModelError(f"recompute 'focus': {type(adapter.model).__name__} does not run its "
                                    "attention through pcache_sdpa; choose 'epic' or 'blend'")
    return probe.scores
