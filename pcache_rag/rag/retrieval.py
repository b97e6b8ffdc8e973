"""Retrieval over a live index: the chunks closest to a question, as module handles.

A :class:`Retriever` ranks an index's chunks (BM25 fused with the dense ranking, or the dense
ranking alone: :mod:`.lexical`), turns hits into :class:`~.types.ModuleHandle` s (chunks an
ingest removed meanwhile are left out, and said so), makes the retrieved texts known documents
of the engine (a stock chain may paste them anywhere, unmarked) and starts moving their states
to the fastest tier.
"""

from __future__ import annotations

import logging

from .chunks import ChunkStates
from .embed import MiniLMEmbedder
from .lexical import BM25Index, ExactDense, check_retrieval, hybrid_search
from .live import LiveIndex
from .types import ModuleHandle

log = logging.getLogger(__name__)


class Retriever:
    """Ranks ``live``'s chunks for a question (``mode``: ``"hybrid"`` or ``"dense"``)."""

    def __init__(self, live: LiveIndex, embedder: MiniLMEmbedder, chunks: ChunkStates, mode: str = "hybrid") -> None:
        self.live, self.embedder, self.chunks = live, embedder, chunks
        self.mode = check_retrieval(mode)
        self._bm25, self._dense = BM25Index(), ExactDense()
        self._known: tuple | None = None  # the index version know_indexed() last read

    def hits(self, question: str, k: int, embedding: list[float] | None = None) -> list[tuple]:
        """The ``k`` best ``(id, score, text, metadata)``, best first (text and metadata are None
        for a chunk removed since chroma's vector index was loaded)."""
        return hybrid_search(self.live.chroma, self.embedder, self._bm25, self.live.version, question, k, self.mode,
                             embedding, self._dense)

    @staticmethod
    def stale(hits: list[tuple]) -> bool:
        """Whether some hit names a chunk that is gone (the index should be reopened)."""
        return any(doc is None or meta is None for _cid, _s, doc, meta in hits)

    def handles(self, hits: list[tuple], prefetch: bool = True, notes: list[str] | None = None) -> list[ModuleHandle]:
        """``hits`` as handles, best first, without chunks that are gone (said in ``notes`` and the
        log); their texts become known documents, and their states start moving (``prefetch``)."""
        gone = [cid for cid, _s, doc, meta in hits if doc is None or meta is None]
        if gone:
            hits = [h for h in hits if h[2] is not None and h[3] is not None]
            msg = f"{len(gone)} retrieved chunks were removed by an ingest meanwhile and are left out"
            log.warning(msg)
            if notes is not None:
                notes.append(msg)
        handles = [ModuleHandle.from_hit(*hit) for hit in hits]
        # a stock chain may paste these texts into any message, unmarked: the engine finds them there
        self.chunks.asm.known_texts.add(self.chunks.text(h) for h in handles)
        if prefetch and handles:
            self.chunks.store.prefetch([h.kv_key for h in handles])
        return handles

    def know_indexed(self) -> int:
        """Make every indexed chunk a known document of the engine, so prompts that paste chunks
        in without marks read them from the cache (:mod:`pcache_rag.discovery`). Once per index
        version; returns how many texts were added."""
        if self._known == self.live.version:
            return 0
        chroma = self.live.chroma
        sources = {cid: m["source"] for cid, m in chroma.chunks()}
        texts = [self.chunks.text(t, sources[cid]) for cid, t in chroma.texts() if cid in sources and t]
        self.chunks.asm.known_texts.add(texts)
        self._known = self.live.version
        return len(texts)
