"""The values RAG hands out: retrieved handles, answers, and the reports of ingest and verify."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine import GenerationOutput


@dataclass(slots=True)
class ModuleHandle:
    """A retrieved chunk: what the LLM side needs to use its cached states."""

    id: str  # chunk (module) id in chroma
    score: float  # relevance, higher is closer: cosine similarity (dense) or the fused RRF score (hybrid)
    kv_key: str  # store key of its states at the canonical position
    source: str  # file it came from
    text: str = ""  # for display only; the model reads the cached states
    n_tokens: int = 0
    metadata: dict = field(default_factory=dict)

    @classmethod
    def from_hit(cls, cid: str, score: float, doc: str, meta: dict) -> ModuleHandle:
        """The handle of an index hit ``(id, score, text, metadata)``."""
        return cls(id=cid, score=score, kv_key=meta["kv_key"], source=meta["source"], text=doc,
                   n_tokens=int(meta.get("n_tokens", 0)), metadata=dict(meta))


@dataclass(slots=True)
class RAGAnswer:
    text: str
    handles: list[ModuleHandle]
    output: GenerationOutput
    retrieve_s: float  # seconds to embed the question and query chroma
    ttft_s: float  # retrieve + fetch (and encode lazy chunks) + assemble + first token


@dataclass(slots=True)
class IngestReport:
    added: int = 0
    changed: int = 0
    unchanged: int = 0
    removed: int = 0  # files under the given paths that are gone
    pruned: int = 0  # sources anywhere that are gone (``prune=True``)
    empty: int = 0  # files with no text (not indexed, not an error)
    chunks_encoded: int = 0
    chunks_reused: int = 0  # states already in the store (resumed or shared)
    chunks_lazy: int = 0  # indexed without states (``encode="lazy"``): encoded on first use
    lazy_filled: int = 0  # chunks indexed lazily earlier whose states this eager ingest made
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason): not indexed
    notes: list[str] = field(default_factory=list)  # e.g. a file decoded from a detected encoding
    repaired: list[str] = field(default_factory=list)  # problems found and fixed
    rebuilt_from: str | None = None  # where a damaged chroma folder was moved before rebuilding
    projected_tokens: int = 0  # tokens to encode, counted before encoding
    projected_bytes: int = 0  # bytes of states they take in the store
    seconds: float = 0.0


@dataclass(slots=True)
class VerifyReport:
    """What :meth:`CachedRAG.verify` found; ``clean`` when every list is empty."""

    missing_states: list[str] = field(default_factory=list)  # chunk ids whose states the store lacks
    stale: list[str] = field(default_factory=list)  # chunk ids of a version their source no longer has
    duplicates: list[str] = field(default_factory=list)  # chunk ids whose (source, chunk) appears twice
    missing_sources: list[str] = field(default_factory=list)  # indexed files that no longer exist
    store: list[str] = field(default_factory=list)  # problems of the disk tier (rows vs files)
    pending_uploads: list[str] = field(default_factory=list)  # uploaded files an interrupted ingest left

    @property
    def clean(self) -> bool:
        return not (self.missing_states or self.stale or self.duplicates or self.missing_sources or self.store
                    or self.pending_uploads)

    def lines(self) -> list[str]:
        out = []
        for name in ("missing_states", "stale", "duplicates", "missing_sources", "pending_uploads"):
            v = getattr(self, name)
            if v:
                out.append(f"{len(v)} {name.replace('_', ' ')}: {', '.join(v[:5])}{' ...' if len(v) > 5 else ''}")
        out.extend(self.store)
        return out
