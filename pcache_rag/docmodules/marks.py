"""Document marks and prompt segments: the part of :mod:`pcache_rag.docmodules` that needs
no model (standard library only), so a connector imports in the time its framework takes.

:func:`mark_document` wraps a document's text in two private-use characters (U+E000 ...
U+E001) that survive every prompt template unchanged; :func:`split_marked` finds them again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from ..request import SamplingParams

DOC_OPEN = "\ue000"
DOC_CLOSE = "\ue001"
#: what :func:`format_documents` puts between documents (and what ingest encodes after each)
DOC_SEPARATOR = "\n\n"
ROLES = ("system", "user", "assistant", "tool")

#: opens the documents in a RAG prompt's user turn (the end of the RAG preamble)
DOCUMENTS_HEADER = "Documents:\n\n"

DEFAULT_SYSTEM = (
    "You are a helpful assistant. Answer the question using only the documents provided. "
    "If they do not contain the answer, say you do not know."
)


#: the conditioning of RAG documents (CachedRAG's new indexes, the connectors' content-addressed
#: documents) where the engine allows it; PML schemas keep the paper's semantics
DEFAULT_CONDITIONING = "neutral"
#: documents shorter than this are encoded without conditioning: the passage (~390 tokens)
#: outweighs a document of a few words (docs/guide.md, "Conditioned encoding")
MIN_CONDITIONED_TOKENS = 64


class PCacheFallbackWarning(UserWarning):
    """A prompt was answered by full prefill because it carries no cached documents."""


def unmark(text: str) -> str:
    """``text`` without document marks."""
    return text.replace(DOC_OPEN, "").replace(DOC_CLOSE, "")


def mark_document(text: str) -> str:
    """Wrap one document's text so that :class:`Assembler` reads it as a cached module."""
    return DOC_OPEN + unmark(text) + DOC_CLOSE


def format_documents(texts: Iterable[str], separator: str = DOC_SEPARATOR) -> str:
    """Marked documents joined by ``separator``: the ``{context}`` of a RAG prompt."""
    return separator.join(mark_document(t) for t in texts)


def split_marked(text: str) -> list[tuple[str, bool]]:
    """``text`` as ``(piece, is_document)`` pieces. Marks that do not pair up are dropped
    (their text stays plain text)."""
    out: list[tuple[str, bool]] = []
    rest = text
    while rest:
        i = rest.find(DOC_OPEN)
        j = rest.find(DOC_CLOSE, i + 1) if i >= 0 else -1
        if i < 0 or j < 0:
            out.append((unmark(rest), False))
            break
        if i:
            out.append((unmark(rest[:i]), False))
        doc = rest[i + 1 : j]
        if DOC_OPEN in doc:  # an unpaired opening: the text up to the last one is plain
            k = doc.rfind(DOC_OPEN)
            out.append((unmark(doc[:k]), False))
            doc = doc[k + 1 :]
        out.append((doc, True))
        rest = rest[j + 1 :]
    return [(t, d) for t, d in out if t]


#: ``cut``: the end of a cacheable prefix without documents
SegmentKind = Literal["markup", "text", "document", "cut"]


@dataclass(slots=True)
class Segment:
    """A piece of a prompt: chat ``markup`` (may hold control tokens), ``text``, or a ``document``."""

    text: str
    kind: SegmentKind


class Segments(list):
    """A prompt as :class:`Segment` s, and ``uncached``: why text that could have been a
    document was computed (:meth:`pcache_rag.discovery.Uncached.reasons`; empty when nothing was)."""

    def __init__(self, items=(), tenant: str = "") -> None:
        super().__init__(items)
        self.uncached: list[str] = []
        #: whose prompt this is: what it teaches is kept for this tenant only (:mod:`pcache_rag.store.learned`)
        self.tenant = tenant


#: how to decode, from the frameworks' conventions (temperature 0 is greedy): the connectors build
#: their SamplingParams with it, once
sampling = SamplingParams.from_frameworks
