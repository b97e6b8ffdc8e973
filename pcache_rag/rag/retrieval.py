"""Retrieval over a live index: the chunks closest to a question, as module handles.

A :class:`Retriever` ranks an index's chunks (BM25 fused with the dense ranking, or the dense
ranking alone: :mod:`.lexical`), turns hits into :class:`~.types.ModuleHandle` s (chunks an
ingest removed meanwhile are left out, and said so), makes the retrieved texts known documents
of the engine (a stock chain may paste them anywhere, unmarked) and starts moving their states
to the fastest tier.

**Conversations.** A follow-up ("And the south gate?", "What is its access code?") means little
alone. :func:`with_context` makes one query of it and the conversation before it (its earlier
user messages and system messages, most recent first): the question's vector plus each earlier
text's at half the weight of the one after it (:data:`CONTEXT_WEIGHTS`), and a lexical query of
the question twice and the context once. So what the follow-up names itself (the south gate)
outweighs what came before, and what it leaves out (which gate) comes from before. No model
call: a condensing prompt on a small model rewrites questions badly, and costs a generation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from .chunks import ChunkStates
from .embed import MiniLMEmbedder
from .lexical import BM25Index, ExactDense, check_retrieval, hybrid_search
from .live import LiveIndex
from .types import ModuleHandle

log = logging.getLogger(__name__)

#: how much each earlier text of a conversation counts in its retrieval query against the
#: question's 1.0, most recent first; texts beyond these are not read
CONTEXT_WEIGHTS = (0.5, 0.25, 0.125)
#: the longest earlier text read for retrieval, in characters (a long system prompt's opening)
CONTEXT_CHARS = 1000


def conversation_context(turns: Sequence[tuple[str, str]]) -> list[str]:
    """The texts of a conversation's earlier ``(role, text)`` turns that retrieval reads: user
    and system messages (an answer may be wrong, and repeats the documents), most recent first, as
    many as :data:`CONTEXT_WEIGHTS` weighs."""
    texts = [t[:CONTEXT_CHARS] for role, t in reversed(turns) if role in ("user", "system") and t.strip()]
    return texts[: len(CONTEXT_WEIGHTS)]


def with_context(embedder: MiniLMEmbedder, question: str, context: Sequence[str],
                 embedding: list[float] | None = None) -> tuple[str, list[float]]:
    """``(lexical query, vector)`` for ``question`` asked after ``context`` (most recent first;
    see the module docstring). ``embedding``: the question's own vector, when known."""
    ctx = list(context)[: len(CONTEXT_WEIGHTS)]
    vecs = embedder.embed(([] if embedding is not None else [question]) + ctx)
    q = np.asarray(embedding if embedding is not None else vecs[0], dtype=np.float64)
    for w, v in zip(CONTEXT_WEIGHTS, vecs[len(vecs) - len(ctx):]):
        q = q + w * np.asarray(v, dtype=np.float64)
    q /= max(float(np.linalg.norm(q)), 1e-12)
    return " ".join([question, question, *ctx]), q.tolist()


class Retriever:
    """Ranks ``live``'s chunks for a question (``mode``: ``"hybrid"`` or ``"dense"``)."""

    def __init__(self, live: LiveIndex, embedder: MiniLMEmbedder, chunks: ChunkStates, mode: str = "hybrid") -> None:
        self.live, self.embedder, self.chunks = live, embedder, chunks
        self.mode = check_retrieval(mode)
        self._bm25, self._dense = BM25Index(), ExactDense()
        self._known: tuple | None = None  # the index version know_indexed() last read

    def hits(self, question: str, k: int, embedding: list[float] | None = None,
             context: Sequence[str] = ()) -> list[tuple]:
        """The ``k`` best ``(id, score, text, metadata)``, best first (text and metadata are None
        for a chunk removed since chroma's vector index was loaded). ``context``: the conversation
        before the question, most recent first (:func:`with_context`)."""
        query = question
        if context:
            query, embedding = with_context(self.embedder, question, context, embedding)
        return hybrid_search(self.live.chroma, self.embedder, self._bm25, self.live.version, query, k, self.mode,
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
