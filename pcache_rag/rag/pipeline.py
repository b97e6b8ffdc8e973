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
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..assembly import DEFAULT_SYSTEM, Assembler, parse_conditioning
from ..engine import ContextOverflowError, GenerationOutput, PromptCache
from ..kv import ModuleKV
from ..recompute import Recompute
from ..models.attention import Calibration
from ..fsutil import quarantine
from .chunking import SUPPORTED, SkipFile, read_document, scan, split_tokens
from .extract import release as release_reader
from .embed import MiniLMEmbedder
from .index import ChromaIndex, IndexDamagedError
from .lexical import BM25Index, check_retrieval, rrf

log = logging.getLogger(__name__)

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


MANIFEST = "pcache-index.json"
_FORMAT = "pcache-index-1"


class CachedRAG:
    """Ingest documents into chroma + the KV store, and answer questions from cached states.

    ``index_dir`` holds chroma (``chroma/``), the KV store (``kv/``) and a small manifest;
    it must be a new or empty directory or an existing index (``create=False``: it must
    exist). ``chunk_tokens`` defaults to the index's own (512 for a new one); ``k`` chunks
    of that size must fit the model's context with the question. ``recompute`` sets the
    policy for answers (``"epic:16"``, ``"blend:0.15"``...; per call: ``answer(..., recompute=)``).
    ``kv_url`` (``"redis://host:6379/0"``) adds a remote tier that several processes or
    machines share: states encoded by one are read by the others. ``conditioning``
    (``"neutral"``, ``"neutral:2"``) encodes every chunk after neutral passages as well as
    the preamble (see :mod:`pcache_rag.assembly`); an index keeps the one it was built with.
    ``retrieval``: ``"hybrid"`` fuses BM25 with the dense ranking (:mod:`pcache_rag.rag.lexical`),
    ``"dense"`` is MiniLM alone. ``calibration``: calibrated attention for answers: ``"auto"``
    (the index's own, chosen by ``pcache-rag calibrate`` for this model; none if it has none),
    ``"none"``, or ``"ape:T:S"`` (see :mod:`pcache_rag.rag.calibrate`).
    """

    def __init__(
        self,
        index_dir: str | Path,
        pc: PromptCache | None = None,
        model: str | None = None,
        k: int = 4,
        chunk_tokens: int | None = None,
        system_prompt: str = DEFAULT_SYSTEM,
        chroma_url: str | None = None,
        embedder: MiniLMEmbedder | None = None,
        create: bool = True,
        recompute: str | None = None,
        kv_url: str | None = None,
        conditioning: str | None = None,
        retrieval: str = "hybrid",
        calibration: str | None = "auto",
    ):
        self.retrieval = check_retrieval(retrieval)
        if calibration not in (None, "auto"):
            Calibration.parse(calibration)  # refused by name before anything loads
        self._calibration_arg = calibration
        self.index_dir = check_index_dir(index_dir, create)
        #: recompute policy for answers (None: the engine's default; see pcache_rag.recompute)
        self.recompute = None if recompute is None else str(Recompute.parse(recompute))
        self.k = _check_k(k)
        self.manifest = _read_manifest(self.index_dir)
        built = self.manifest.get("chunk_tokens")
        if chunk_tokens is not None and built and self.manifest.get("chunks") and chunk_tokens != built:
            raise ValueError(
                f"the index {self.index_dir} was built with chunk_tokens={built}; ingest with "
                f"--chunk-tokens {built}, or use a new index directory for chunk_tokens={chunk_tokens}"
            )
        self.chunk_tokens = int(chunk_tokens or built or 512)
        # conditioned encoding: the index's own (an index from before it existed: none), or the
        # default for a new one; another one for an index with chunks is refused
        had = self.manifest.get("conditioning", "none" if self.manifest.get("chunks") else None)
        if conditioning is not None and had is not None and self.manifest.get("chunks") and \
                parse_conditioning(conditioning) != parse_conditioning(had):
            raise ValueError(f"the index {self.index_dir} was encoded with conditioning={had!r}; use it, or a new "
                             f"index directory for conditioning={conditioning!r}")
        cond = conditioning if conditioning is not None else (had if had is not None else "default")
        if self.chunk_tokens < 16:
            raise ValueError("chunk_tokens must be at least 16")
        if pc is not None and kv_url is not None:
            raise ValueError("give kv_url to the PromptCache you pass (pc), or let CachedRAG build one")
        self.pc = pc if pc is not None else PromptCache.from_pretrained(model, cache_dir=str(self.index_dir / "kv"),
                                                                        kv_url=kv_url)
        self.embedder = embedder or MiniLMEmbedder()
        self.chroma_url = chroma_url
        self._index: ChromaIndex | None = None
        self._index_error: Exception | None = None
        #: the manifest's commit counter this process has seen (see :meth:`refresh`)
        self.generation = int(self.manifest.get("generation", 0))
        self._refresh_lock = threading.RLock()
        self._ingesting = 0  # ingests running in this process (their commits are our own)
        self._manifest_stamp: tuple | None = None  # (mtime, size, inode) of the manifest last read
        self._bm25 = BM25Index()
        self._open_index()
        #: content-addressed chunk states (shared with the LlamaIndex/LangChain components)
        self.asm = Assembler(self.pc, system_prompt, conditioning=cond)
        self.preamble_ids = self.asm.base_ids
        self.preamble_key = self.asm.base_key
        self.check_fits(self.k)

    # ------------------------------------------------------------------ the index directory

    def _open_index(self) -> None:
        try:
            self._index = ChromaIndex(self.index_dir / "chroma", url=self.chroma_url)
            self._index_error = None
            n = self.manifest.get("chunks")
            if self.chroma_url is None and n and self._index.count() == 0:
                raise IndexDamagedError(self.index_dir / "chroma" / "chroma.sqlite3",
                                        f"it lists no chunks, but the index had {n}")
        except IndexDamagedError as e:
            self._index, self._index_error = None, e

    def refresh(self, force: bool = False) -> bool:
        """See every ingest committed since this process last looked, by any process.

        Every commit (an ingest's file, a prune, a repair) bumps the manifest's ``generation``;
        a different number on disk means another process changed the index, and chroma's
        in-memory vector index is stale (it would name chunks that are gone), so it is opened
        again. One small file read per call; returns True when the index was reopened. Skipped
        while an ingest of this process runs: it holds the index's lock, so nobody else commits."""
        with self._refresh_lock:
            if self._ingesting and not force:
                return False
            try:
                st = (self.index_dir / MANIFEST).stat()
                stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            except OSError:
                stamp = None
            if stamp == self._manifest_stamp and not force:
                return False  # the file is as last read: no JSON parse per question
            self._manifest_stamp = stamp
            m = _read_manifest(self.index_dir, quiet=True)
            gen = int(m.get("generation", 0))
            if gen == self.generation and not force:
                return False
            if m:
                self.manifest = m
            self.generation = gen
            log.info("the index %s changed (generation %d): reopening it", self.index_dir, gen)
            self._open_index()
            return True

    @property
    def index(self) -> ChromaIndex:
        """The chroma side; raises :class:`IndexDamagedError` if its database is damaged
        (an ingest rebuilds it)."""
        if self._index is None:
            raise self._index_error  # type: ignore[misc]
        return self._index

    def _rebuild_index(self) -> str:
        err = self._index_error
        self._index = None
        folder = self.index_dir / "chroma"
        moved = quarantine(folder) if folder.exists() else folder
        self.manifest.pop("chunks", None)  # the count belonged to the damaged database
        log.warning("%s; moved to %s and rebuilt from the documents given to this ingest", err, moved)
        self._open_index()
        if self._index is None:
            raise self._index_error  # type: ignore[misc]
        return str(moved)

    def _lock(self):
        """An exclusive lock on the index for the length of an ingest (other processes wait)."""
        from filelock import FileLock, Timeout

        lock = FileLock(str(self.index_dir / ".ingest.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log.warning("another ingest holds %s; waiting for it", self.index_dir)
            lock.acquire()
        return lock

    def check_fits(self, k: int) -> None:
        """Refuse a ``k`` x ``chunk_tokens`` that cannot fit the model's context with a question."""
        need = len(self.preamble_ids) + k * (self.chunk_tokens + _HEADER_ALLOWANCE) + _QUESTION_ALLOWANCE
        if need > self.pc.max_positions:
            fit = (self.pc.max_positions - len(self.preamble_ids) - _QUESTION_ALLOWANCE) // k - _HEADER_ALLOWANCE
            raise ValueError(
                f"k={k} chunks of up to {self.chunk_tokens} tokens need about {need} positions with the "
                f"question, but the model takes {self.pc.max_positions}: use chunk_tokens <= {max(fit, 0)} "
                f"or a smaller k"
            )

    # ------------------------------------------------------------------ states

    @property
    def canonical_start(self) -> int:
        return len(self.preamble_ids)

    def preamble(self) -> ModuleKV:
        """The preamble's states (and, with conditioning, the passages' after it), made and
        stored on first use: an ingest or a server's warm-up makes them before any chunk."""
        if self.asm.cond_ids:
            self.asm.conditioned_context()
        return self.asm.base()

    @staticmethod
    def chunk_text(handle_or_text, source: str | None = None) -> str:
        """A chunk as the model reads it: a ``[file name]`` header line, then its text. Framework
        retrievers return this text, so marked documents hit the states encoded at ingest."""
        if isinstance(handle_or_text, ModuleHandle):
            handle_or_text, source = handle_or_text.text, handle_or_text.source
        return f"[{Path(source or '').name}]\n{handle_or_text}"

    def chunk_ids(self, text: str, source: str) -> list[int]:
        # file names and documents are text, never markup; the same ids as a marked document
        return self.asm.doc_ids(self.chunk_text(text, source))

    def _key(self, ids: list[int], start: int) -> str:
        return self.asm.key(ids, start)

    def _encode(self, ids: list[int], start: int, key: str) -> ModuleKV:
        return self.asm.encode_ids(ids, key, start)

    # ------------------------------------------------------------------ ingest

    def ingest(self, paths, progress: bool = True, encode: str = "eager", prune: bool = False,
               repair: bool = True, on_progress: Callable[[str, int, int], None] | None = None) -> IngestReport:
        """Index files (or directories of them).

        New and changed files are read, chunked, embedded and (``encode="eager"``) encoded;
        unchanged files cost nothing; files under ``paths`` that were indexed before and are
        gone now are removed. One bad file never stops the run: it is listed in
        ``report.skipped`` with its reason. Before encoding, the states' size is projected and
        the ingest is refused (:class:`IngestTooLargeError`) if it exceeds the store's budget;
        ``encode="lazy"`` indexes without states (encoded on first use); a later eager ingest of
        the same paths encodes what is still missing (``report.lazy_filled``). ``prune`` also removes
        every indexed source that no longer exists; ``repair`` fixes what :meth:`verify` finds
        (stale or duplicate chunks, missing states, store rows without files).
        A lock on the index directory makes concurrent ingests take turns. ``on_progress(stage,
        done, total)`` is called as the bars move (stage ``"read"`` in bytes, then ``"encode"``
        in chunks), for a caller with no terminal such as the web app.
        """
        if encode not in ("eager", "lazy"):
            raise ValueError(f"encode must be 'eager' or 'lazy', not {encode!r}")
        t0 = time.perf_counter()
        rep = IngestReport()
        files, skipped = scan(paths, exclude=[self.index_dir])  # validates paths before any work
        rep.skipped.extend((str(p), r) for p, r in skipped)
        lock = self._lock()
        with self._refresh_lock:
            self.refresh()  # what other processes committed, before this one adds to it
            self._ingesting += 1
        try:
            if self._index is None:
                rep.rebuilt_from = self._rebuild_index()
            pending = [f for f in self.pending_uploads() if f not in set(files)]
            if pending:
                rep.notes.append(f"indexing {len(pending)} uploaded files that an interrupted ingest left in "
                                 f"{self.upload_dir}")
                files = sorted([*files, *pending])
            roots = [Path(p).expanduser().absolute() for p in paths]
            self._ingest_locked(files, roots, rep, progress, encode, on_progress)
            if encode == "eager":
                rep.lazy_filled = self._fill_lazy(roots, progress)
            if prune:
                rep.pruned = self.prune()
            if repair:
                rep.repaired = self.repair()
            if encode == "eager" or repair:
                self._check_kept(rep)
            self._set_aside_skipped_uploads(rep)
            self._commit()
        finally:
            release_reader()  # the document reader's child process ends: its memory goes back
            with self._refresh_lock:
                self._ingesting -= 1
            lock.release()
        rep.seconds = time.perf_counter() - t0
        return rep

    # ------------------------------------------------------------------ uploads

    @property
    def upload_dir(self) -> Path:
        """Where the web app keeps uploaded files (``<index>/uploads``)."""
        return self.index_dir / "uploads"

    def pending_uploads(self, folder: str | Path | None = None) -> list[Path]:
        """Uploaded files (in ``folder``, default :attr:`upload_dir`) that no chunk comes from:
        left by an ingest that was killed. Files an ingest skipped are moved to
        ``.skipped/`` there, so they are not pending forever."""
        d = Path(folder) if folder is not None else self.upload_dir
        if not d.is_dir():
            return []
        found = [f.resolve() for f in d.iterdir()
                 if f.is_file() and not f.name.startswith(".") and f.suffix.lower() in SUPPORTED]
        if not found:
            return []
        have = set(self.index.sources())
        return sorted(f for f in found if str(f) not in have)

    def _set_aside_skipped_uploads(self, rep: IngestReport) -> None:
        root = self.upload_dir.resolve()
        for path, why in rep.skipped:
            p = Path(path)
            if p.parent.resolve() == root and p.is_file():
                dest = root / ".skipped" / p.name
                dest.parent.mkdir(exist_ok=True)
                os.replace(p, dest)
                rep.notes.append(f"{p.name}: moved to {dest.parent} ({why})")

    # ------------------------------------------------------------------ the store's budget

    def _persisted(self, key: str) -> bool:
        """Whether ``key``'s states are in the store's persistent tier (what a new process finds)."""
        disk = getattr(self.pc.store, "disk", None)
        return disk.contains(key) if disk is not None else self.pc.store.contains(key)

    def _budget_room(self) -> int | None:
        """Bytes the disk tier can still take within its budget (None: no budget)."""
        disk = getattr(self.pc.store, "disk", None)
        if disk is None:
            return None
        return int(disk.size_limit) - int(disk.stats().bytes)

    def _check_kept(self, rep: IngestReport) -> None:
        """An ingest never reports success with states missing: chunks whose states the store
        did not keep (evicted to stay within its budget) are marked lazy (encoded on first use),
        and the report says so."""
        lost = [(cid, m) for cid, m in self.index.chunks() if not m.get("lazy") and not self._persisted(m["kv_key"])]
        if not lost:
            return
        self.index.update_metadata([c for c, _ in lost], [{**m, "lazy": True} for _c, m in lost])
        rep.chunks_lazy += len(lost)
        msg = (f"the store kept the states of all but {len(lost)} chunks within its budget of "
               f"{_human(_store_budget(self.pc.store))}: those are now encoded on first use (raise --disk-budget "
               f"to keep them)")
        rep.notes.append(msg)
        log.warning(msg)

    def _say(self, progress: bool, msg: str) -> None:
        if progress:
            from tqdm.auto import tqdm

            tqdm.write(msg, file=sys.stderr)
        else:
            log.info(msg)

    def _ingest_locked(self, files: list[Path], roots: list[Path], rep: IngestReport, progress: bool,
                       encode: str, on_progress=None) -> None:
        known = self.index.sources()  # source -> (shas, [ids], [kv keys])
        self.preamble()
        start = self.canonical_start
        # 1. read and chunk what changed (a bar over the bytes, moving during long files)
        work: list[tuple[str, str, list, list[list[int]]]] = []  # (source, sha, chunks, token ids)
        bar = _Bar(progress, on_progress, "read", sum(_size(f) for f in files), desc="read+chunk", unit="B",
                   unit_scale=True) if progress or on_progress else None
        for f in files:
            src = str(f)
            nbytes = _size(f)
            try:
                doc = read_document(f)
            except SkipFile as e:
                rep.skipped.append((src, str(e)))
                if bar:
                    bar.update(nbytes)
                continue
            if doc.note:
                rep.notes.append(f"{src}: {doc.note}")
            sha = hashlib.sha256(doc.text.encode()).hexdigest()
            old = known.pop(src, None)
            if old is not None and old[0] == {sha}:
                rep.unchanged += 1
                if bar:
                    bar.update(nbytes)
                continue
            if not doc.text.strip():
                rep.empty += 1
                if old is not None:
                    self._release(self.index.delete_where_source(src))
                if bar:
                    bar.update(nbytes)
                continue
            ratio = nbytes / max(len(doc.text), 1)
            tick = (lambda n, r=ratio: bar.update(int(n * r))) if bar else None
            chunks = split_tokens(doc.text, self.pc.tokenizer, self.chunk_tokens, progress=tick)
            work.append((src, sha, chunks, [self.chunk_ids(c.text, src) for c in chunks]))
            if old is not None:
                rep.changed += 1
            else:
                rep.added += 1
        if bar:
            bar.close()
        # 2. project the states' size (and, once the first chunk is encoded, the time)
        todo: dict[str, tuple[list[int], int]] = {}
        for src, _sha, _chunks, ids_list in work:
            for ids in ids_list:
                key = self._key(ids, start)
                if key not in todo and not self.pc.store.contains(key):
                    todo[key] = (ids, start)
        rep.projected_tokens = sum(len(ids) for ids, _ in todo.values())
        bpt = self.pc.adapter.kv_shape.bytes_per_token(_element_size(self.pc.store_dtype))
        rep.projected_bytes = rep.projected_tokens * bpt
        if encode == "eager" and todo:
            budget = _store_budget(self.pc.store)
            room = self._budget_room()
            self._say(progress, f"to encode: {len(todo)} chunks, {rep.projected_tokens} tokens, "
                                f"{_human(rep.projected_bytes)} of states (store budget {_human(budget)}"
                                + (f", {_human(max(room, 0))} free)" if room is not None else ")"))
            if room is not None and rep.projected_bytes > room:
                raise IngestTooLargeError(
                    f"encoding {len(todo)} chunks ({rep.projected_tokens} tokens) needs {_human(rep.projected_bytes)} "
                    f"of states, but the store's budget of {_human(budget)} has {_human(max(room, 0))} free (it holds "
                    f"{_human(budget - room)}); ingest with --encode lazy (states made on first use), a larger "
                    f"--disk-budget, or fewer files"
                )
        # 3. encode, then commit each file to chroma (states first: chroma never names a
        #    chunk without states, so a killed ingest resumes without re-encoding)
        bar = None
        if (progress or on_progress) and work:
            bar = _Bar(progress, on_progress, "encode", sum(len(w[2]) for w in work),
                       desc="encode+index" if encode == "eager" else "index", unit="chunk")
        t_enc, n_enc = 0.0, 0
        for src, sha, chunks, ids_list in work:
            keys, metas, docs, cids = [], [], [], []
            done_here = 0
            for c, ids in zip(chunks, ids_list):
                key = self._key(ids, start)
                lazy = False
                if key in todo and encode == "eager":
                    t1 = time.perf_counter()
                    self._encode(ids, start, key)
                    t_enc += time.perf_counter() - t1
                    n_enc += 1
                    todo.pop(key)
                    rep.chunks_encoded += 1
                    if n_enc == 1 and len(todo) > 1:
                        self._say(progress, f"projected encoding time: ~{_duration(t_enc * (len(todo) + 1))}")
                    if bar:
                        bar.update(1)
                        done_here += 1
                elif key in todo:
                    lazy = True
                    rep.chunks_lazy += 1
                else:
                    rep.chunks_reused += 1
                cids.append(hashlib.sha256(f"{src}\0{sha}\0{c.index}".encode()).hexdigest()[:24])
                keys.append(key)
                docs.append(c.text)
                metas.append({"source": src, "sha": sha, "chunk": c.index, "n_tokens": len(ids), "kv_key": key,
                              "lazy": lazy})
            embs = self.embedder.embed(docs)
            # Reconcile by source: every earlier version of this file goes, whoever wrote it.
            old_keys = self.index.delete_where_source(src)
            self.index.add(cids, embs, docs, metas)
            self._commit()  # readers in other processes see this file from now on
            self._release(set(old_keys) - set(keys))
            if bar:
                bar.update(len(chunks) - done_here)
        if bar:
            bar.close()
        for src, (_shas, ids, keys) in known.items():
            p = Path(src)
            if any(p == r or r in p.parents for r in roots) and not p.exists():
                self._drop(ids, keys)
                rep.removed += 1

    def _fill_lazy(self, roots: list[Path], progress: bool) -> int:
        """Encode the lazily indexed chunks under ``roots`` that have no states yet, and mark
        every lazy chunk there as encoded; returns how many were encoded."""
        lazy = [(cid, m) for cid, m in self.index.chunks()
                if m.get("lazy") and any(Path(m["source"]) == r or r in Path(m["source"]).parents for r in roots)]
        if not lazy:
            return 0
        ids = [cid for cid, _ in lazy]
        n = self._encode_indexed(ids, progress, "encode lazy chunks")
        self.index.update_metadata(ids, [{**m, "lazy": False} for _cid, m in lazy])
        return n

    def _encode_indexed(self, ids: list[str], progress: bool = False, desc: str = "encode") -> int:
        """Encode, from the text chroma keeps, the chunks ``ids`` whose states the store lacks;
        returns how many."""
        got = self.index.col.get(ids=ids, include=["documents", "metadatas"])
        it = zip(got["documents"], got["metadatas"])
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(it, total=len(got["ids"]), desc=desc, unit="chunk")
        n = 0
        for doc, m in it:
            if not self.pc.store.contains(m["kv_key"]):
                self._encode(self.chunk_ids(doc, m["source"]), self.canonical_start, m["kv_key"])
                n += 1
        return n

    def state_stats(self) -> dict:
        """How many chunks have states: ``chunks`` (and ``documents``) in the index, ``lazy``
        indexed without states, ``hot`` lazy ones whose states were made on first use, ``cold``
        the rest. Reads every chunk's metadata once."""
        self.refresh()
        chunks = self.index.chunks()
        lazy = [m["kv_key"] for _cid, m in chunks if m.get("lazy")]
        hot = sum(self.pc.store.contains(k) for k in lazy)
        return {"chunks": len(chunks), "documents": len({m["source"] for _cid, m in chunks}), "lazy": len(lazy),
                "hot": hot, "cold": len(lazy) - hot}

    def _drop(self, ids, keys) -> None:
        """Remove chunks from chroma, then the states no other chunk uses."""
        self.index.delete(ids)
        self._release(keys)

    def _release(self, keys) -> None:
        """Remove the states of ``keys`` that no chunk uses any more (identical files share states)."""
        keys = set(keys)
        if not keys:
            return
        for k in keys - self.index.referenced(keys):
            self.pc.store.remove(k)

    def prune(self) -> int:
        """Remove every indexed source whose file no longer exists (a renamed or deleted folder);
        returns how many were removed."""
        n = 0
        for src, (_shas, ids, keys) in self.index.sources().items():
            if not Path(src).exists():
                self._drop(ids, keys)
                n += 1
        if n:
            self._commit()
        return n

    def verify(self, store: bool = True) -> VerifyReport:
        """Check the index against the files and the store (see :class:`VerifyReport`)."""
        try:
            return self._verify(store)
        finally:
            release_reader()

    def _verify(self, store: bool) -> VerifyReport:
        self.refresh()
        rep = VerifyReport()
        rep.pending_uploads = [str(f) for f in self.pending_uploads()]
        chunks = self.index.chunks()
        current: dict[str, str | None] = {}
        for _cid, m in chunks:
            src = m["source"]
            if src not in current:
                current[src] = _current_sha(Path(src))
                if current[src] is None and not Path(src).exists():
                    rep.missing_sources.append(src)
        seen: dict[tuple[str, int], list[tuple[str, dict]]] = {}
        for cid, m in chunks:
            cur = current[m["source"]]
            if cur is not None and m["sha"] != cur:
                rep.stale.append(cid)
            seen.setdefault((m["source"], int(m["chunk"])), []).append((cid, m))
            if not m.get("lazy") and not self._persisted(m["kv_key"]):
                rep.missing_states.append(cid)
        for (_src, _i), group in seen.items():
            if len(group) > 1:
                cur = current[group[0][1]["source"]]
                rep.duplicates.extend(cid for cid, m in group if m["sha"] != cur or cur is None)
        disk = getattr(self.pc.store, "disk", None)
        if store and disk is not None:
            rep.store.extend(disk.check())
        return rep

    def repair(self) -> list[str]:
        """Fix what :meth:`verify` finds, except sources that are gone (see :meth:`prune`):
        stale and duplicate chunks are dropped (their file is re-ingested if no current
        version is indexed), missing states are encoded from the indexed text, and the disk
        tier's rows without files and files without rows are removed. Returns what was fixed."""
        v = self.verify(store=False)
        fixed: list[str] = []
        disk = getattr(self.pc.store, "disk", None)
        if disk is not None:
            fixed.extend(disk.check(repair=True))
        drop = set(v.stale) | set(v.duplicates)
        if drop:
            chunks = dict(self.index.chunks())
            srcs = {chunks[c]["source"] for c in drop if c in chunks}
            keys = [chunks[c]["kv_key"] for c in drop if c in chunks]
            self._drop(sorted(drop), keys)
            fixed.append(f"removed {len(drop)} stale or duplicate chunks of {len(srcs)} files")
            have = set(self.index.sources())
            again = [s for s in srcs if s not in have and Path(s).exists()]
            if again:
                self._ingest_locked([Path(s) for s in again], [], IngestReport(), False, "eager")
                fixed.append(f"re-ingested {len(again)} files that had no current version")
        if v.missing_states:
            chunks = dict(self.index.chunks())
            need = sum(int(chunks[c].get("n_tokens", 0)) for c in v.missing_states if c in chunks)
            bpt = self.pc.adapter.kv_shape.bytes_per_token(_element_size(self.pc.store_dtype))
            room = self._budget_room()
            if room is not None and need * bpt > room:
                ids = [c for c in v.missing_states if c in chunks]
                self.index.update_metadata(ids, [{**chunks[c], "lazy": True} for c in ids])
                fixed.append(f"{len(ids)} chunks whose states were missing need {_human(need * bpt)}, more than the "
                             f"{_human(max(room, 0))} the store's budget has free: marked to encode on first use")
            else:
                n = self._encode_indexed(v.missing_states)
                fixed.append(f"encoded {n} chunks whose states were missing")
        return fixed

    def _commit(self) -> None:
        """Write the manifest with the next ``generation``: every process serving this index
        sees the change at its next question (:meth:`refresh`). Called under the ingest lock."""
        try:
            n = self.index.count()
        except Exception:  # noqa: BLE001 - a count that fails leaves the old manifest
            return
        on_disk = int(_read_manifest(self.index_dir, quiet=True).get("generation", 0))
        self.generation = max(on_disk, self.generation) + 1
        self.manifest = {"format": _FORMAT, "chunk_tokens": self.chunk_tokens, "chunks": n,
                         "conditioning": self.asm.conditioning, "generation": self.generation,
                         **({"calibration": self.manifest["calibration"]} if "calibration" in self.manifest else {})}
        tmp = self.index_dir / (MANIFEST + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.manifest, indent=1))
        os.replace(tmp, self.index_dir / MANIFEST)

    # ------------------------------------------------------------------ calibration

    @property
    def calibration(self) -> tuple[str | None, str]:
        """``(the calibration answers use, where it comes from)``: the constructor's, or the
        index's own when it was chosen for this model (``pcache-rag calibrate``)."""
        arg = self._calibration_arg
        if arg not in (None, "auto"):
            c = Calibration.parse(arg)
            return (c.spec if c else None), "given"
        if arg is None:
            return None, "given"
        saved = self.manifest.get("calibration") or {}
        if not saved:
            return None, "none: the index was not calibrated"
        if saved.get("fingerprint") != self.pc.fingerprint:
            return None, "none: the index was calibrated for another model or settings"
        att = saved.get("attention", "none")
        return (None if att == "none" else att), (f"the index's (KL {saved.get('kl', 0):.4f} against "
                                                  f"{saved.get('kl_uncalibrated', 0):.4f} uncalibrated)")

    def calibrate(self, n: int = 24, k: int | None = None, progress: bool = True, save: bool = True, grid=None):
        """Choose calibrated attention for this index and model without labels
        (:func:`pcache_rag.rag.calibrate.calibrate`) and, with ``save``, keep the choice in the
        manifest, where every process serving the index sees it at its next question."""
        from .calibrate import DEFAULT_GRID, calibrate

        self.refresh()
        rep = calibrate(self, n=n, k=k, progress=progress, grid=DEFAULT_GRID if grid is None else grid)
        if save:
            lock = self._lock()
            try:
                self.manifest = dict(_read_manifest(self.index_dir, quiet=True) or self.manifest)
                self.manifest["calibration"] = rep.manifest_entry()
                self._commit()
            finally:
                lock.release()
        return rep

    def _answer_gen(self, gen: dict) -> dict:
        """``gen`` with this index's recompute policy and calibration (a policy that recomputes
        runs uncalibrated: the two do not combine, and the log says so once)."""
        gen.setdefault("recompute", self.recompute)
        if "calibration" in gen:
            return gen
        cal, _src = self.calibration
        rc = gen.get("recompute")
        if cal is not None and rc is not None and Recompute.parse(rc).kind != "none":
            if not getattr(self, "_warned_cal", False):
                log.warning("recompute %s runs without the index's calibrated attention (%s): they do not combine",
                            rc, cal)
                self._warned_cal = True
            cal = None
        gen["calibration"] = cal
        return gen

    # ------------------------------------------------------------------ retrieve and answer

    def retrieve(self, question: str, k: int | None = None, prefetch: bool = True,
                 notes: list[str] | None = None) -> list[ModuleHandle]:
        """The ``k`` closest chunks as handles, best first; their states start moving to the
        fastest tier at once (``prefetch``). Sees every ingest committed by any process
        (:meth:`refresh`); what cannot be used is said in ``notes`` (when given) and the log."""
        k = self.k if k is None else _check_k(k)
        _check_question(question)
        self.refresh()
        hits = self._search(question, k)
        if any(doc is None or meta is None for _cid, _s, doc, meta in hits):
            # chunks that vanished since chroma's vector index was loaded: look again
            self.refresh(force=True)
            hits = self._search(question, k)
        gone = [cid for cid, _s, doc, meta in hits if doc is None or meta is None]
        if gone:
            hits = [h for h in hits if h[2] is not None and h[3] is not None]
            msg = f"{len(gone)} retrieved chunks were removed by an ingest meanwhile and are left out"
            log.warning(msg)
            if notes is not None:
                notes.append(msg)
        handles = [
            ModuleHandle(
                id=cid, score=score, kv_key=meta["kv_key"], source=meta["source"], text=doc,
                n_tokens=int(meta.get("n_tokens", 0)), metadata=dict(meta),
            )
            for cid, score, doc, meta in hits
        ]
        # a stock chain may paste these texts into any message, unmarked: the engine finds them there
        self.pc.known_texts.add(self.chunk_text(h) for h in handles)
        fn = getattr(self.pc.store, "prefetch", None)
        if prefetch and fn is not None and handles:
            fn([h.kv_key for h in handles])
        return handles

    def _search(self, question: str, k: int) -> list[tuple]:
        """``[(id, score, text, metadata)]``, best first: the dense ranking, or (hybrid) the
        dense and BM25 rankings to a depth of ``max(4k, 20)``, fused by reciprocal rank."""
        emb = self.embedder.embed([question])[0]
        if self.retrieval == "dense":
            return self.index.query(emb, k)
        depth = max(4 * k, 20)
        dense = self.index.query(emb, depth)
        self._bm25.ensure((self.generation, id(self._index)), self.index.texts)
        lexical = self._bm25.search(question, depth)
        fused = rrf([[h[0] for h in dense], [cid for cid, _ in lexical]])[:k]
        by_id = {h[0]: h for h in dense}
        bm25 = dict(lexical)
        extra = self.index.get([cid for cid, _ in fused if cid not in by_id])
        out = []
        for cid, score in fused:
            doc, meta = by_id[cid][2:] if cid in by_id else extra.get(cid, (None, None))
            if meta is not None:
                meta = dict(meta)
                if cid in by_id:
                    meta["similarity"] = round(by_id[cid][1], 6)
                if cid in bm25:
                    meta["bm25"] = round(bm25[cid], 6)
            out.append((cid, score, doc, meta))
        return out

    def _fit_question(self, question: str, handles: list[ModuleHandle], gen: dict) -> list[int]:
        """The question's ids, or :class:`ContextOverflowError` if the prompt cannot fit."""
        q = self.question_ids(question)
        ctx = len(self.preamble_ids) + sum(h.n_tokens or len(self.chunk_ids(h.text, h.source)) for h in handles)
        need = ctx + len(q) + int(gen.get("max_new_tokens", 64))
        if need > self.pc.max_positions:
            raise ContextOverflowError(
                f"the question is {len(q)} tokens; with {len(handles)} chunks ({ctx} tokens) and "
                f"{gen.get('max_new_tokens', 64)} new tokens the prompt needs {need} positions, but the model "
                f"takes {self.pc.max_positions}: shorten the question or retrieve fewer chunks"
            )
        return q

    def question_ids(self, question: str) -> list[int]:
        return question_ids(self.pc, question)

    def _parts(self, handles: list[ModuleHandle]) -> list[tuple[str, ModuleKV]]:
        parts = [("preamble", self.preamble())]
        pos = self.canonical_start
        for h in sorted(handles, key=lambda h: h.score):  # most relevant last
            kv = self.pc.store.get(h.kv_key)
            if kv is None:  # evicted or damaged: re-encode from the stored text
                kv = self._encode(self.chunk_ids(h.text, h.source), self.canonical_start, h.kv_key)
            if pos != self.canonical_start:
                kv, _ = self.asm.place(kv, pos)
            parts.append((h.id, kv))
            pos += kv.length
        return parts

    def answer(self, question: str, k: int | None = None, handles: list[ModuleHandle] | None = None,
               **gen) -> RAGAnswer:
        """Retrieve (unless ``handles`` are given), assemble cached states, generate."""
        t0 = time.perf_counter()
        _check_question(question)
        if handles is None:
            handles = self.retrieve(question, k)
        t_ret = time.perf_counter() - t0
        q_ids = self._fit_question(question, handles, gen)
        gen = self._answer_gen(gen)
        parts = self._parts(handles)  # fetches states, encoding lazy chunks on first use
        t_pre = time.perf_counter() - t0
        out = self.pc.generate_parts(parts, q_ids, preamble="preamble", **gen)
        return RAGAnswer(out.text, handles, out, t_ret, t_pre + out.ttft_s)

    def stream(self, question: str, k: int | None = None, handles: list[ModuleHandle] | None = None,
               **gen) -> Iterator[str]:
        _check_question(question)
        if handles is None:
            handles = self.retrieve(question, k)
        q_ids = self._fit_question(question, handles, gen)
        gen = self._answer_gen(gen)
        return self.pc.stream_parts(self._parts(handles), q_ids, preamble="preamble", **gen)

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
        _check_question(question)
        if handles is None:
            handles = self.retrieve(question, k, prefetch=False)
        t_ret = time.perf_counter() - t0
        self._fit_question(question, handles, gen)
        gen.pop("recompute", None)  # nothing is cached: there is nothing to recompute or calibrate
        gen.pop("calibration", None)
        out = self.pc.generate_parts([], self.full_prompt_ids(question, handles), **gen)
        return RAGAnswer(out.text, handles, out, t_ret, t_ret + out.ttft_s)

    def close(self) -> None:
        self.pc.store.close()


def question_ids(pc: PromptCache, question: str) -> list[int]:
    """The question after the documents, closing the user turn and opening the assistant's.
    The question is text: control-token strings in it stay characters."""
    chat = pc.chat
    return pc.safe.segments([(f"Question: {question}", False), (chat.suffix["user"], True),
                             (chat.generation_prompt, True)])


class _Bar:
    """A tqdm bar (when ``progress``) that also reports to ``on_progress(stage, done, total)``."""

    def __init__(self, progress: bool, on_progress, stage: str, total: int, **tqdm_args):
        self.cb, self.stage, self.total, self.n = on_progress, stage, total, 0
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, **tqdm_args)
        if self.cb:
            self.cb(stage, 0, total)

    def update(self, n: int) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        if self.cb:
            self.cb(self.stage, min(self.n, self.total), self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# Room kept per chunk for its file-name header, and for the question and the answer.
_HEADER_ALLOWANCE = 32
_QUESTION_ALLOWANCE = 128


class IngestTooLargeError(RuntimeError):
    """The states an ingest would encode exceed the store's budget."""


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer (chunks to retrieve), not {k!r}")
    return k


def _check_question(question) -> None:
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question is empty")


def check_index_dir(path: str | Path, create: bool = True) -> Path:
    """Validate an index directory before anything is loaded: it may be new, empty, or an
    index; never a file or a folder of other things (documents would get chroma/ and kv/)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"the index must be a directory, but {p} is a file")
    if p.is_dir():
        names = {c.name for c in p.iterdir()}
        ours = {MANIFEST, "chroma", "kv", ".ingest.lock"}
        if names and not (names & ours):
            raise ValueError(
                f"{p} holds other files and is not a pcache-rag index; point the index at a new or empty "
                f"directory (documents are given to ingest separately)"
            )
        if not create and not (names & {MANIFEST, "chroma"}):
            raise FileNotFoundError(f"{p} is not an index yet: run `pcache-rag ingest PATH... --index {p}` first")
    elif not create:
        raise FileNotFoundError(f"no index at {p}: run `pcache-rag ingest PATH... --index {p}` first")
    p.mkdir(parents=True, exist_ok=True)
    return p


def _read_manifest(index_dir: Path, quiet: bool = False) -> dict:
    f = index_dir / MANIFEST
    if not f.exists():
        return {}
    try:
        m = json.loads(f.read_text(encoding="utf-8"))
        if not isinstance(m, dict) or m.get("format") != _FORMAT:
            raise ValueError("unknown format")
        return m
    except (ValueError, UnicodeDecodeError, OSError) as e:
        if not quiet:
            log.warning("index manifest %s is unreadable (%s); it is rewritten at the next ingest", f, e)
        return {}


def _current_sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(read_document(path).text.encode()).hexdigest()
    except (SkipFile, OSError):
        return None


def _size(f: Path) -> int:
    try:
        return f.stat().st_size
    except OSError:
        return 0


def _element_size(dtype) -> int:
    import torch

    return torch.empty(0, dtype=dtype).element_size()


def _store_budget(store) -> int | None:
    disk = getattr(store, "disk", None)
    if disk is not None:
        return int(disk.size_limit)
    return None


def _human(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"
