"""Lexical retrieval beside chroma: BM25 over the chunk texts, fused with the dense ranking.

Dense MiniLM retrieval misses chunks whose words match a question exactly but whose
meaning the small embedder blurs (names, codes, numbers: the facts a RAG user asks
about). BM25 (``bm25s``, a sparse-matrix implementation, with the Snowball English
stemmer from PyStemmer where it is installed) ranks those first, and the two rankings
are fused by **reciprocal rank fusion** (Cormack et al., 2009): a chunk's score is
``sum over rankings of 1 / (RRF_K + rank)``, which needs no score calibration between
the two.

The BM25 index is built in memory from the chunk texts chroma holds, and rebuilt when
the index's ``generation`` changes: every commit (an ingest's file, a prune, a repair,
by any process) bumps it, so the lexical side always matches the chunks chroma serves.
Nothing of it is written to disk, so there is no second copy to damage or to load
unsafely; rebuilding costs about a second per 10,000 chunks here, once per commit seen.
"""

from __future__ import annotations

import logging
import threading
import time

from .. import words

log = logging.getLogger(__name__)

#: the constant of reciprocal rank fusion (60 in the original paper and in most systems since)
RRF_K = 60
RETRIEVAL_MODES = ("hybrid", "dense")


def check_retrieval(mode: str) -> str:
    if mode not in RETRIEVAL_MODES:
        raise ValueError(f"retrieval must be one of {', '.join(RETRIEVAL_MODES)}, not {mode!r}")
    return mode


class BM25Index:
    """BM25 over ``(chunk id, text)`` pairs, rebuilt for each new ``generation``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._generation: object = None
        self._ids: list[str] = []
        self._bm25 = None
        self.build_s = 0.0

    def _tokenize(self, texts: list[str]):
        return words.tokenize(texts)

    def ensure(self, generation: object, load) -> None:
        """Build the index from ``load()`` -> ``[(id, text)]`` unless it was built for ``generation``."""
        with self._lock:
            if self._generation == generation and self._bm25 is not None:
                return
            bm25s = words.bm25s()
            t0 = time.perf_counter()
            pairs = [(cid, text) for cid, text in load() if text]
            self._ids = [cid for cid, _ in pairs]
            self._bm25 = bm25s.BM25()
            if pairs:
                self._bm25.index(self._tokenize([t for _, t in pairs]), show_progress=False)
            self._generation = generation
            self.build_s = time.perf_counter() - t0
            log.info("BM25 index of %d chunks built in %.2f s", len(pairs), self.build_s)

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        """``[(chunk id, BM25 score)]``, best first; chunks sharing no word with ``query`` are left out."""
        with self._lock:
            n = len(self._ids)
            if not n or k < 1:
                return []
            tokens = self._tokenize([query])
            if not tokens[0]:
                return []
            docs, scores = self._bm25.retrieve(tokens, k=min(k, n), show_progress=False, n_threads=1)
            return [(self._ids[int(d)], float(s)) for d, s in zip(docs[0], scores[0]) if s > 0]


#: collections up to this many chunks are ranked exactly (see :class:`ExactDense`); larger ones by chroma's HNSW
EXACT_MAX_CHUNKS = 20_000


class ExactDense:
    """Exact cosine ranking over every stored embedding, for collections of at most
    :data:`EXACT_MAX_CHUNKS` chunks, rebuilt for each new ``generation`` like BM25.

    Chroma's HNSW index is approximate, and it is rebuilt from chroma's log when a process
    opens the collection, so its answers can differ from process to process: on the eval's
    rag index (200 chunks) the fifth-closest chunk (similarity 0.258, the sixth 0.233) was
    missing from the top 20 in about one process of seven, which changed the prompt. Up to
    20,000 chunks (30 MB of 384-d vectors), one matrix-vector product costs about a
    millisecond, so ranking exactly is cheap and the same in every process. Written here
    because chroma's query has no exact mode."""

    def __init__(self):
        self._lock = threading.Lock()
        self._generation: object = None
        self._ids: list[str] = []
        self._unit = None  # (n, d) float32, rows of unit length; None: not built, or too many chunks

    def ensure(self, generation: object, index) -> bool:
        """Load the vectors of ``index`` unless they were loaded for ``generation``; whether the
        exact ranking serves it (False above :data:`EXACT_MAX_CHUNKS`: chroma's HNSW does)."""
        import numpy as np

        with self._lock:
            if self._generation != generation:
                self._unit = None
                if index.count() <= EXACT_MAX_CHUNKS:
                    self._ids, vecs = index.embeddings()
                    norms = np.linalg.norm(vecs, axis=1, keepdims=True)
                    self._unit = vecs / np.maximum(norms, 1e-12)
                self._generation = generation
            return self._unit is not None

    def search(self, embedding, k: int) -> list[tuple[str, float]]:
        """``[(chunk id, cosine similarity)]`` of the ``k`` closest, best first; ties in id order."""
        import numpy as np

        with self._lock:
            if self._unit is None or not self._ids:
                return []
            q = np.asarray(embedding, dtype=np.float32)
            sims = self._unit @ (q / max(float(np.linalg.norm(q)), 1e-12))  # (n,)
            top = np.argsort(-sims, kind="stable")[:k]
            return [(self._ids[i], float(sims[i])) for i in top]


def rrf(rankings: list[list[str]], k: int = RRF_K) -> list[tuple[str, float]]:
    """Reciprocal rank fusion of several rankings (ids, best first): ``[(id, score)]``, best first.
    Ties keep the order of the first ranking that holds the id."""
    score: dict[str, float] = {}
    first: dict[str, tuple[int, int]] = {}
    for r, ranking in enumerate(rankings):
        for rank, cid in enumerate(ranking):
            score[cid] = score.get(cid, 0.0) + 1.0 / (k + rank + 1)
            first.setdefault(cid, (r, rank))
    return sorted(score.items(), key=lambda kv: (-kv[1], first[kv[0]]))


__all__ = ["BM25Index", "ExactDense", "EXACT_MAX_CHUNKS", "rrf", "RRF_K", "RETRIEVAL_MODES", "check_retrieval"]


def dense_ranking(index, exact: ExactDense | None, tag: object, emb, k: int) -> tuple[list[tuple[str, float]], dict]:
    """``([(id, similarity)], {id: (text, metadata)})``: the ``k`` closest chunks, best first,
    exact where ``exact`` serves the index (:class:`ExactDense`: no texts come with them, so the
    caller fetches only those it keeps), else chroma's HNSW with the texts it returns."""
    if exact is None or not exact.ensure(tag, index):
        hits = index.query(emb, k)
        return [(h[0], h[1]) for h in hits], {h[0]: (h[2], h[3]) for h in hits}
    return exact.search(emb, k), {}


def hybrid_search(index, embedder, bm25: BM25Index, tag: object, question: str, k: int,
                  mode: str = "hybrid", embedding: list[float] | None = None,
                  exact: ExactDense | None = None) -> list[tuple]:
    """``[(id, score, text, metadata)]``, best first: the dense ranking, or (hybrid) the
    dense and BM25 rankings to a depth of ``max(4k, 20)``, fused by reciprocal rank. ``tag``
    names the index's version: BM25 (and ``exact``'s vectors) are rebuilt when it changes.
    ``embedding``: the question's vector when the caller embedded it already (several
    questions in one call). A chunk removed meanwhile comes back with text and metadata None."""
    emb = embedding if embedding is not None else embedder.embed([question])[0]
    if mode == "dense":
        ranked, known = dense_ranking(index, exact, tag, emb, k)
        known.update(index.get([cid for cid, _ in ranked if cid not in known]))
        return [(cid, sim, *known.get(cid, (None, None))) for cid, sim in ranked]
    depth = max(4 * k, 20)
    ranked, known = dense_ranking(index, exact, tag, emb, depth)
    bm25.ensure(tag, index.texts)
    lexical = bm25.search(question, depth)
    fused = rrf([[cid for cid, _ in ranked], [cid for cid, _ in lexical]])[:k]
    sims, scores = dict(ranked), dict(lexical)
    known.update(index.get([cid for cid, _ in fused if cid not in known]))  # one fetch, of the kept chunks only
    out = []
    for cid, score in fused:
        doc, meta = known.get(cid, (None, None))
        if meta is not None:
            meta = dict(meta)
            if cid in sims:
                meta["similarity"] = round(sims[cid], 6)
            if cid in scores:
                meta["bm25"] = round(scores[cid], 6)
        out.append((cid, score, doc, meta))
    return out
