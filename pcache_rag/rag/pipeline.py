"""Cached RAG: documents become union-member modules, retrieval returns handles,
and answers are computed from cached states plus the question.

The RAG schema, in PML terms::

    <schema name="rag">
      <system>{system prompt}</system>  + the opening of the user turn   (preamble)
      <union> every chunk </union>      x k slots
    </schema>
    prompt: the k retrieved chunks + "Question: {escaped question}" + the assistant turn

A literal PML schema with k unions of thousands of chunks would reserve the
longest chunk per slot and lay every chunk out k times, so the slots are
realised directly on the engine's parts API instead, with the same semantics:

* every chunk is encoded once at ingest, at the canonical position right after
  the preamble (attending to the preamble in ``encoding="preamble"``);
* at question time the retrieved chunks are placed one after another with
  contiguous positions. RoPE models re-rotate each chunk's keys to its slot;
  ALiBi states carry no position and are reused as they are; learned-position
  models (GPT-2) get per-slot encodings, made on demand and cached in the store;
* **order**: the most relevant chunk is placed last, next to the question
  (small models attend most to what is recent); ties keep retrieval order.

The question is tokenized as plain text after the chunks: it is never parsed
as PML, so markup typed by a user cannot import a module.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..engine import GenerationOutput, PromptCache
from ..kv import ModuleKV
from ..store import unit_key
from .chunking import find_files, read_text, split_tokens
from .embed import MiniLMEmbedder
from .index import ChromaIndex

log = logging.getLogger(__name__)

DEFAULT_SYSTEM = (
    "You are a helpful assistant. Answer the question using only the documents provided. "
    "If they do not contain the answer, say you do not know."
)


@dataclass(slots=True)
class ModuleHandle:
    """A retrieved chunk: what the LLM side needs to use its cached states."""

    id: str  # chunk (module) id in chroma
    score: float  # cosine similarity to the question (higher is closer)
    kv_key: str  # store key of its states at the canonical position
    source: str  # file it came from
    text: str = ""  # for display only; the model reads the cached states
    n_tokens: int = 0
    metadata: dict = field(default_factory=dict)


@dataclass(slots=True)
class RAGAnswer:
    text: str
    handles: list[ModuleHandle]
    output: GenerationOutput
    retrieve_s: float  # seconds to embed the question and query chroma
    ttft_s: float  # retrieve + assemble + first token


@dataclass(slots=True)
class IngestReport:
    added: int = 0
    changed: int = 0
    unchanged: int = 0
    removed: int = 0
    chunks_encoded: int = 0
    chunks_reused: int = 0  # states already in the store (resumed or shared)
    seconds: float = 0.0


class CachedRAG:
    """Ingest documents into chroma + the KV store, and answer questions from cached states."""

    def __init__(
        self,
        index_dir: str | Path,
        pc: PromptCache | None = None,
        model: str | None = None,
        k: int = 4,
        chunk_tokens: int = 512,
        system_prompt: str = DEFAULT_SYSTEM,
        chroma_url: str | None = None,
        embedder: MiniLMEmbedder | None = None,
    ):
        self.index_dir = Path(index_dir).expanduser()
        self.index_dir.mkdir(parents=True, exist_ok=True)
        self.pc = pc if pc is not None else PromptCache.from_pretrained(model, cache_dir=str(self.index_dir / "kv"))
        self.k = k
        self.chunk_tokens = chunk_tokens
        self.embedder = embedder or MiniLMEmbedder()
        self.index = ChromaIndex(self.index_dir / "chroma", url=chroma_url)
        tok, chat = self.pc.tokenizer, self.pc.chat
        from ..pml import bos_ids

        self.preamble_ids = bos_ids(tok) + self.pc.safe.segments([
            (chat.prefix["system"], True), (system_prompt, False), (chat.suffix["system"], True),
            (chat.prefix["user"], True), ("Documents:\n\n", False),
        ])
        P = len(self.preamble_ids)
        self.preamble_key = unit_key(self.pc.fingerprint, self.preamble_ids, range(P), None, "rag-preamble")

    # ------------------------------------------------------------------ states

    @property
    def canonical_start(self) -> int:
        return len(self.preamble_ids)

    def preamble(self) -> ModuleKV:
        return self.pc.stored_states(self.preamble_key, self.preamble_ids, list(range(len(self.preamble_ids))))

    def chunk_ids(self, text: str, source: str) -> list[int]:
        header = f"[{Path(source).name}]\n"
        return self.pc.safe.text(header + text + "\n\n")  # file names and documents are text, never markup

    def _key(self, ids: list[int], start: int) -> str:
        ctx = self.preamble_key if self.pc.encoding == "preamble" else None
        return unit_key(self.pc.fingerprint, ids, range(start, start + len(ids)), ctx, "rag-chunk")

    def _encode(self, ids: list[int], start: int, key: str) -> ModuleKV:
        ctx_kv = None
        if self.pc.encoding == "preamble":
            ctx_kv = self.pc.context_states(self.preamble_key, self.preamble_ids, list(range(len(self.preamble_ids))))
        kv = self.pc.encode(ids, list(range(start, start + len(ids))), context=ctx_kv).to(dtype=self.pc.store_dtype)
        self.pc.store.put(key, kv)
        return kv

    # ------------------------------------------------------------------ ingest

    def ingest(self, paths, progress: bool = True) -> IngestReport:
        """Index files (or directories of them): new and changed files are chunked, embedded and
        encoded; unchanged files cost nothing; files under ``paths`` that were indexed before
        and are gone now are removed from chroma and the store."""
        t0 = time.perf_counter()
        rep = IngestReport()
        files = find_files(paths)
        roots = [Path(p).expanduser().resolve() for p in paths]
        known = self.index.sources()  # source -> (sha, [ids], [kv keys])
        self.preamble()
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(files), desc="ingest", unit="file")
        start = self.canonical_start
        for f in files:
            src = str(f)
            text = read_text(f)
            sha = hashlib.sha256(text.encode()).hexdigest()
            old = known.pop(src, None)
            if old is not None and old[0] == sha:
                rep.unchanged += 1
                if bar:
                    bar.update(1)
                continue
            chunks = [c for c in split_tokens(text, self.pc.tokenizer, self.chunk_tokens)]
            ids, keys, metas, docs = [], [], [], []
            for c in chunks:
                tok_ids = self.chunk_ids(c.text, src)
                key = self._key(tok_ids, start)
                if self.pc.store.contains(key):
                    rep.chunks_reused += 1
                else:
                    self._encode(tok_ids, start, key)
                    rep.chunks_encoded += 1
                    if bar:
                        bar.set_postfix(file=f.name, chunks_encoded=rep.chunks_encoded, refresh=True)
                cid = hashlib.sha256(f"{src}\0{sha}\0{c.index}".encode()).hexdigest()[:24]
                ids.append(cid)
                keys.append(key)
                docs.append(c.text)
                metas.append({"source": src, "sha": sha, "chunk": c.index, "n_tokens": len(tok_ids), "kv_key": key})
            embs = self.embedder.embed(docs)
            # States first, then chroma: chroma never names a chunk without states.
            if old is not None:
                self.index.delete(old[1])
                for k in set(old[2]) - set(keys):
                    self.pc.store.remove(k)
                rep.changed += 1
            else:
                rep.added += 1
            if ids:
                self.index.add(ids, embs, docs, metas)
            if bar:
                bar.update(1)
        for src, (sha, ids, keys) in known.items():
            p = Path(src)
            if any(p == r or r in p.parents for r in roots) and not p.exists():
                self.index.delete(ids)
                for k in keys:
                    self.pc.store.remove(k)
                rep.removed += 1
        if bar:
            bar.close()
        rep.seconds = time.perf_counter() - t0
        return rep

    def verify(self) -> list[str]:
        """Ids of chunks that chroma lists but whose states the store lacks (should be empty)."""
        return [cid for cid, key in self.index.keys().items() if not self.pc.store.contains(key)]

    # ------------------------------------------------------------------ retrieve and answer

    def retrieve(self, question: str, k: int | None = None, prefetch: bool = True) -> list[ModuleHandle]:
        """The ``k`` closest chunks as handles, best first; their states start moving to the
        fastest tier at once (``prefetch``)."""
        k = k or self.k
        hits = self.index.query(self.embedder.embed([question])[0], k)
        handles = [
            ModuleHandle(
                id=cid, score=score, kv_key=meta["kv_key"], source=meta["source"], text=doc,
                n_tokens=int(meta.get("n_tokens", 0)), metadata=dict(meta),
            )
            for cid, score, doc, meta in hits
        ]
        fn = getattr(self.pc.store, "prefetch", None)
        if prefetch and fn is not None and handles:
            fn([h.kv_key for h in handles])
        return handles

    def question_ids(self, question: str) -> list[int]:
        chat = self.pc.chat
        # The question is text: control-token strings in it stay characters.
        return self.pc.safe.segments([(f"Question: {question}", False), (chat.suffix["user"], True),
                                      (chat.generation_prompt, True)])

    def _parts(self, handles: list[ModuleHandle]) -> list[tuple[str, ModuleKV]]:
        parts = [("preamble", self.preamble())]
        pos = self.canonical_start
        for h in sorted(handles, key=lambda h: h.score):  # most relevant last
            kv = self.pc.store.get(h.kv_key)
            if kv is None:  # evicted or damaged: re-encode from the stored text
                kv = self._encode(self.chunk_ids(h.text, h.source), self.canonical_start, h.kv_key)
            if pos != self.canonical_start:
                try:
                    kv = self.pc.place(kv, pos)
                except ValueError:  # learned positions: a per-slot encoding, cached
                    ids = kv.token_ids.tolist()
                    key = self._key(ids, pos)
                    kv = self.pc.store.get(key) or self._encode(ids, pos, key)
            parts.append((h.id, kv))
            pos += kv.length
        return parts

    def answer(self, question: str, k: int | None = None, handles: list[ModuleHandle] | None = None,
               **gen) -> RAGAnswer:
        """Retrieve (unless ``handles`` are given), assemble cached states, generate."""
        t0 = time.perf_counter()
        if handles is None:
            handles = self.retrieve(question, k)
        t_ret = time.perf_counter() - t0
        out = self.pc.generate_parts(self._parts(handles), self.question_ids(question), preamble="preamble", **gen)
        return RAGAnswer(out.text, handles, out, t_ret, t_ret + out.ttft_s)

    def stream(self, question: str, k: int | None = None, handles: list[ModuleHandle] | None = None,
               **gen) -> Iterator[str]:
        if handles is None:
            handles = self.retrieve(question, k)
        return self.pc.stream_parts(self._parts(handles), self.question_ids(question), preamble="preamble", **gen)

    def full_prompt_ids(self, question: str, handles: list[ModuleHandle]) -> list[int]:
        """The same tokens the cached path reads, for a full prefill."""
        ids = list(self.preamble_ids)
        for h in sorted(handles, key=lambda h: h.score):
            ids.extend(self.chunk_ids(h.text, h.source))
        return ids + self.question_ids(question)

    def answer_full_prefill(self, question: str, k: int | None = None,
                            handles: list[ModuleHandle] | None = None, **gen) -> RAGAnswer:
        """The baseline: the same retrieved text, prefilled in full (nothing reused)."""
        t0 = time.perf_counter()
        if handles is None:
            handles = self.retrieve(question, k, prefetch=False)
        t_ret = time.perf_counter() - t0
        out = self.pc.generate_parts([], self.full_prompt_ids(question, handles), **gen)
        return RAGAnswer(out.text, handles, out, t_ret, t_ret + out.ttft_s)

    def close(self) -> None:
        self.pc.store.close()
