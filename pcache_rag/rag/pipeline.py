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

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from ..conditioning import LearnedPrefix, conditioning_kind, installed_prefix
from ..frameworks import DEFAULT_SYSTEM, Assembler
from ..engine import ContextOverflowError, Generation, PromptCache
from ..fsutil import quarantine
from ..kv import ModuleKV
from ..models.attention import Calibration
from ..recompute import Recompute
from . import maintenance
from .chunks import ChunkStates
from .chunking import scan
from .embed import MiniLMEmbedder
from .extract import release as release_reader
from .index import ChromaIndex, IndexDamagedError
from .calibrate import answer_settings
from .index_dir import FORMAT, MANIFEST, Index, check_index_dir, same_conditioning
from .ingest import Ingestor, IngestTooLargeError, pending_uploads
from .states import bytes_per_token
from .lexical import BM25Index, ExactDense, check_retrieval, hybrid_search
from .prompt import check_fits, question_ids
from .types import IngestReport, ModuleHandle, RAGAnswer, VerifyReport

__all__ = ["CachedRAG", "ModuleHandle", "RAGAnswer", "IngestReport", "VerifyReport", "IngestTooLargeError",
           "DEFAULT_SYSTEM", "MANIFEST", "Index", "check_index_dir", "question_ids", "index_conditioning"]

log = logging.getLogger(__name__)

#: ``eager``: encode chunks at ingest; ``lazy``: index them now, encode each on first use
EncodeMode = Literal["eager", "lazy"]


# ---------------------------------------------------------------------------- an index's conditioning
# (functions beside the class, as maintenance and calibration are: CachedRAG stays a façade)

def index_assembler(pc: PromptCache, index: Index, system_prompt: str, conditioning: str) -> Assembler:
    """The Assembler that encodes an index's chunks under ``conditioning`` (neutral passages, or a
    learned prefix read from the index's own file: ``pcache-rag calibrate --learn`` leaves it there)."""
    if conditioning == "default" or conditioning_kind(conditioning) != "learned":
        asm = Assembler(pc, system_prompt, conditioning=conditioning)
        if asm.prefix is not None:  # the model's installed prefix: the index keeps its own copy, as for a learned one
            path = index.prefix_path(asm.prefix.spec)
            try:
                if not path.exists():
                    asm.prefix.save(path)
            except OSError:  # another process wrote it at the same moment
                if not path.exists():
                    raise
        return asm
    try:
        prefix = index.load_prefix(conditioning)
    except (OSError, ValueError) as e:  # missing or damaged: the installed prefix of the same spec restores it
        installed = installed_prefix(pc.fingerprint)
        if installed is None or installed.spec != conditioning:
            raise
        log.warning("%s; restored from the prefix installed for this model", e)
        prefix = installed
        prefix.save(index.prefix_path(conditioning))
    return Assembler(pc, system_prompt, prefix=prefix)


def index_conditioning(index_dir: str | Path | Index) -> str | LearnedPrefix:
    """The conditioning an index's chunks are encoded under (:meth:`Index.conditioning`), for a
    framework component that answers from it (:func:`pcache_rag.frameworks.assembler_for`)."""
    if not Path(index_dir).expanduser().exists():
        return "default"  # an index not made yet: nothing is encoded under any conditioning
    return Index(index_dir, create=False).conditioning()


def follow_conditioning(asm: Assembler, index: Index, manifest: dict) -> Assembler:
    """``asm``, or a new Assembler where another process moved the index to another conditioning
    (``calibrate --learn``): chunks are keyed by it, so this one encodes and reads under it from now on."""
    cond = manifest.get("conditioning")
    if not cond or same_conditioning(cond, asm.conditioning):
        return asm
    log.info("the index %s is now encoded with conditioning=%s", index.path, cond)
    return index_assembler(asm.pc, index, asm.system_prompt, cond)


class CachedRAG:
    """Ingest documents into chroma + the KV store, and answer questions from cached states.

    ``index_dir`` holds chroma (``chroma/``), the KV store (``kv/``) and a small manifest;
    it must be a new or empty directory or an existing index (``create=False``: it must
    exist). ``chunk_tokens`` defaults to the index's own (512 for a new one); ``k`` chunks
    of that size must fit the model's context with the question. ``recompute`` sets the policy
    for answers (``"auto"``: :func:`~pcache_rag.recompute.resolve_auto`; per call: ``answer(..., recompute=)``).
    ``kv_url`` (``"redis://host:6379/0"``) adds a remote tier that several processes or
    machines share: states encoded by one are read by the others. ``conditioning`` (``"neutral"``,
    ``"neutral:2"``) encodes every chunk after neutral passages as well as the preamble (see
    :mod:`pcache_rag.frameworks`); an index keeps the one it was built with until ``pcache-rag
    calibrate --learn`` moves it to a learned prefix (see :func:`index_assembler`).
    ``retrieval``: ``"hybrid"`` fuses BM25 with the dense ranking (:mod:`pcache_rag.rag.lexical`),
    ``"dense"`` is MiniLM alone. ``calibration``: calibrated attention for answers: ``"auto"``
    (the index's own, chosen by ``pcache-rag calibrate`` for this model; none if it has none),
    ``"none"``, or ``"ape:T:S"`` (see :mod:`pcache_rag.rag.calibrate`).
    """

    def __init__(
        self, index_dir: str | Path | Index, pc: PromptCache | None = None, model: str | None = None, k: int = 4,
        chunk_tokens: int | None = None, system_prompt: str = DEFAULT_SYSTEM, chroma_url: str | None = None,
        embedder: MiniLMEmbedder | None = None, create: bool = True, recompute: str | None = "auto",
        kv_url: str | None = None, conditioning: str | LearnedPrefix | None = None, retrieval: str = "hybrid",
        calibration: str | None = "auto",
    ):
        self.retrieval = check_retrieval(retrieval)
        if calibration not in (None, "auto"):
            Calibration.parse(calibration)  # refused by name before anything loads
        self._calibration_arg = calibration
        #: the index directory's owner: its paths, manifest and settings
        self.folder = Index(index_dir, create)
        self.index_dir = self.folder.path
        #: the recompute policy asked for: "auto", None (the engine's default) or a policy
        self._recompute_arg = recompute if recompute in (None, "auto") else str(Recompute.parse(recompute))
        self.k = _check_k(k)
        self.manifest = self.folder.manifest()
        self.chunk_tokens, cond = self.folder.settings(self.manifest, chunk_tokens, conditioning)
        if pc is not None and kv_url is not None:
            raise ValueError("give kv_url to the PromptCache you pass (pc), or let CachedRAG build one")
        self.pc = pc = pc if pc is not None else self.folder.engine(model, kv_url=kv_url)
        self.embedder = embedder or MiniLMEmbedder()
        self.chroma_url = chroma_url
        self._index: ChromaIndex | None = None
        self._index_error: Exception | None = None
        self._watch = self.folder.watch(int(self.manifest.get("generation", 0)))
        self._refresh_lock = threading.RLock()
        self._ingesting = 0  # ingests running in this process (their commits are our own)
        self._bm25, self._dense = BM25Index(), ExactDense()
        self._known_generation: tuple | None = None  # the index version know_indexed() last read
        self._open_index()
        #: the index's chunks as states: content-addressed, shared with the LlamaIndex/LangChain components
        self.chunks = ChunkStates(index_assembler(pc, self.folder, system_prompt, cond), pc.store, bytes_per_token(pc))
        self.check_fits(self.k)

    @property
    def asm(self):
        """The :class:`~pcache_rag.frameworks.Assembler` the index's chunks are encoded under."""
        return self.chunks.asm

    @asm.setter
    def asm(self, asm) -> None:
        self.chunks.asm = asm

    @property
    def preamble_ids(self) -> list[int]:
        return self.chunks.preamble_ids

    # ------------------------------------------------------------------ the index directory

    def _open_index(self) -> None:
        try:
            self._index = ChromaIndex(self.folder.chroma_dir, url=self.chroma_url)
            self._index_error = None
            n = self.manifest.get("chunks")
            if self.chroma_url is None and n and self._index.count() == 0:
                raise IndexDamagedError(self.folder.chroma_dir / "chroma.sqlite3",
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
            m = self._watch.changed(force)
            if m is None:
                return False
            if m:
                self.manifest = m
                self.asm = follow_conditioning(self.asm, self.folder, m)
            log.info("the index %s changed (generation %d): reopening it", self.index_dir, self.generation)
            self._open_index()
            return True

    @property
    def generation(self) -> int:
        """The manifest's commit counter this process has seen (see :meth:`refresh`)."""
        return self._watch.generation

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
        folder = self.folder.chroma_dir
        moved = quarantine(folder) if folder.exists() else folder
        self.manifest.pop("chunks", None)  # the count belonged to the damaged database
        log.warning("%s; moved to %s and rebuilt from the documents given to this ingest", err, moved)
        self._open_index()
        if self._index is None:
            raise self._index_error  # type: ignore[misc]
        return str(moved)

    def check_fits(self, k: int) -> None:
        """Refuse a ``k`` x ``chunk_tokens`` that cannot fit the model's context with a question."""
        check_fits(len(self.preamble_ids), k, self.chunk_tokens, self.asm.max_positions)

    # ------------------------------------------------------------------ chunks

    chunk_text = staticmethod(ChunkStates.text)

    def chunk_ids(self, text: str, source: str) -> list[int]:
        """A chunk's token ids (:meth:`ChunkStates.ids`)."""
        return self.chunks.ids(text, source)

    # ------------------------------------------------------------------ ingest

    def ingest(self, paths: Sequence[str | Path], progress: bool = True, encode: EncodeMode = "eager",
               prune: bool = False,
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
        lock = self.folder.lock()
        with self._refresh_lock:
            self.refresh()  # what other processes committed, before this one adds to it
            self._ingesting += 1
        try:
            if self._index is None:
                rep.rebuilt_from = self._rebuild_index()
            ing = self._ingestor()
            ing.run(files, [Path(p).expanduser().absolute() for p in paths], rep, progress, encode, self.upload_dir,
                    on_progress)
            if prune:
                rep.pruned = self._prune()
            if repair:
                rep.repaired = maintenance.repair(ing, self.upload_dir)
            ing.finish(rep, encode == "eager" or repair, self.upload_dir)
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
        return self.folder.upload_dir

    def pending_uploads(self, folder: str | Path | None = None) -> list[Path]:
        """Uploaded files (in ``folder``, default :attr:`upload_dir`) that no chunk comes from:
        left by an ingest that was killed. Files an ingest skipped are moved to
        ``.skipped/`` there, so they are not pending forever."""
        return pending_uploads(self.index, Path(folder) if folder is not None else self.upload_dir)

    # ------------------------------------------------------------------ the store's budget

    def _ingestor(self) -> Ingestor:
        return Ingestor(self.index, self.chunks, self.embedder, self.asm.tokenizer, self.chunk_tokens, self.commit)

    def state_stats(self) -> dict:
        """How many chunks have states (:func:`~pcache_rag.rag.maintenance.state_stats`)."""
        self.refresh()
        return maintenance.state_stats(self.index, self.chunks.store)

    def prune(self) -> int:
        """Remove every indexed source whose file no longer exists (a renamed or deleted folder);
        returns how many were removed."""
        self.refresh()
        return self._prune()

    def _prune(self) -> int:
        n = maintenance.prune(self.index, self.chunks.store)
        if n:
            self.commit()
        return n

    def verify(self, store: bool = True) -> VerifyReport:
        """Check the index against the files and the store (see :class:`VerifyReport`)."""
        self.refresh()
        return maintenance.verify(self.index, self.chunks.store, self.upload_dir, store)

    def repair(self) -> list[str]:
        """Fix what :meth:`verify` finds, except sources that are gone (see :meth:`prune`;
        :func:`~pcache_rag.rag.maintenance.repair` says what). Returns what was fixed."""
        self.refresh()
        fixed = maintenance.repair(self._ingestor(), self.upload_dir)
        if fixed:
            self.commit()
        return fixed

    def commit(self) -> None:
        """Write the manifest with the next ``generation``: every process serving this index
        sees the change at its next question (:meth:`refresh`). Called under the ingest lock."""
        try:
            n = self.index.count()
        except Exception:  # noqa: BLE001 - a count that fails leaves the old manifest
            return
        on_disk = int(self.folder.manifest(quiet=True).get("generation", 0))
        self._watch.generation = max(on_disk, self.generation) + 1
        self.manifest = {"format": FORMAT, "chunk_tokens": self.chunk_tokens, "chunks": n,
                         "conditioning": self.asm.conditioning, "generation": self.generation,
                         **({"calibration": self.manifest["calibration"]} if "calibration" in self.manifest else {})}
        self.folder.write_manifest(self.manifest)

    # ------------------------------------------------------------------ calibration

    @property
    def calibration(self) -> tuple[str | None, str]:
        """``(the calibration answers use, where it comes from)``: the constructor's, or the
        index's own when it was chosen for this model (``pcache-rag calibrate``)."""
        return self.folder.calibration(self._calibration_arg, self.manifest, self.asm.fingerprint)

    def calibrate(self, n: int = 24, k: int | None = None, progress: bool = True, save: bool = True, grid=None):
        """Choose calibrated attention for this index and model without labels
        (:func:`pcache_rag.rag.calibrate.calibrate`) and, with ``save``, keep the choice in the
        manifest, where every process serving the index sees it at its next question."""
        from .calibrate import calibrate_index

        return calibrate_index(self, n, k, progress, save, grid)

    @property
    def recompute(self) -> str | None:
        """The recompute policy answers use (None: the engine's default)."""
        return self.folder.recompute(self._recompute_arg, self.calibration[0])

    def _answer_gen(self, gen: dict) -> dict:
        """``gen`` with this index's recompute policy and calibration."""
        return answer_settings(gen, self.recompute, self.calibration[0])

    # ------------------------------------------------------------------ retrieve and answer

    def retrieve(self, question: str, k: int | None = None, prefetch: bool = True,
                 notes: list[str] | None = None, embedding: list[float] | None = None) -> list[ModuleHandle]:
        """The ``k`` closest chunks as handles, best first; their states start moving to the fastest tier at once
        (``prefetch``). Sees every ingest committed by any process (:meth:`refresh`); what cannot be used is said
        in ``notes`` (when given) and the log. ``embedding``: the question's vector, if the caller has it."""
        k = self.k if k is None else _check_k(k)
        _check_question(question)
        self.refresh()
        hits = hybrid_search(self.index, self.embedder, self._bm25, (self.generation, id(self._index)), question, k,
                             self.retrieval, embedding, self._dense)
        if any(doc is None or meta is None for _cid, _s, doc, meta in hits):
            # chunks that vanished since chroma's vector index was loaded: look again
            self.refresh(force=True)
            hits = hybrid_search(self.index, self.embedder, self._bm25, (self.generation, id(self._index)), question, k,
                                 self.retrieval, embedding, self._dense)
        gone = [cid for cid, _s, doc, meta in hits if doc is None or meta is None]
        if gone:
            hits = [h for h in hits if h[2] is not None and h[3] is not None]
            msg = f"{len(gone)} retrieved chunks were removed by an ingest meanwhile and are left out"
            log.warning(msg)
            if notes is not None:
                notes.append(msg)
        handles = [ModuleHandle.from_hit(*hit) for hit in hits]
        # a stock chain may paste these texts into any message, unmarked: the engine finds them there
        self.asm.known_texts.add(self.chunk_text(h) for h in handles)
        fn = getattr(self.chunks.store, "prefetch", None)
        if prefetch and fn is not None and handles:
            fn([h.kv_key for h in handles])
        return handles

    def fit_question(self, question: str, handles: list[ModuleHandle], gen: dict) -> list[int]:
        """The question's ids, or :class:`ContextOverflowError` if the prompt cannot fit."""
        q = self.question_ids(question)
        ctx = len(self.preamble_ids) + sum(h.n_tokens or len(self.chunk_ids(h.text, h.source)) for h in handles)
        need = ctx + len(q) + int(gen.get("max_new_tokens", 64))
        if need > self.asm.max_positions:
            raise ContextOverflowError(
                f"the question is {len(q)} tokens; with {len(handles)} chunks ({ctx} tokens) and "
                f"{gen.get('max_new_tokens', 64)} new tokens the prompt needs {need} positions, but the model "
                f"takes {self.asm.max_positions}: shorten the question or retrieve fewer chunks"
            )
        return q

    def know_indexed(self) -> int:
        """Make every indexed chunk a known document of the engine, so prompts that paste chunks
        in without marks read them from the cache (:mod:`pcache_rag.discovery`). Once per
        index generation; returns how many texts were added."""
        self.refresh()
        if self._known_generation == (self.generation, id(self._index)):
            return 0
        sources = {cid: m["source"] for cid, m in self.index.chunks()}
        texts = [self.chunk_text(t, sources[cid]) for cid, t in self.index.texts() if cid in sources and t]
        self.asm.known_texts.add(texts)
        self._known_generation = (self.generation, id(self._index))
        return len(texts)

    def question_ids(self, question: str) -> list[int]:
        return question_ids(self.pc, question)

    def parts(self, handles: list[ModuleHandle]) -> list[tuple[str, ModuleKV]]:
        """The prompt's cached parts for ``handles`` (:meth:`ChunkStates.parts`)."""
        return self.chunks.parts(handles)

    def answer(self, question: str, k: int | None = None, handles: list[ModuleHandle] | None = None,
               **gen) -> RAGAnswer:
        """Retrieve (unless ``handles`` are given), assemble cached states, generate."""
        t0 = time.perf_counter()
        _check_question(question)
        if handles is None:
            handles = self.retrieve(question, k)
        t_ret = time.perf_counter() - t0
        q_ids = self.fit_question(question, handles, gen)
        gen = self._answer_gen(gen)
        parts = self.parts(handles)  # fetches states, encoding lazy chunks on first use
        t_pre = time.perf_counter() - t0
        out = self.pc.generate_parts(parts, q_ids, preamble="preamble", **gen)
        return RAGAnswer(out.text, handles, out, t_ret, t_pre + out.ttft_s)

    def stream(self, question: str, k: int | None = None, handles: list[ModuleHandle] | None = None,
               **gen) -> Generation:
        """Text deltas of the answer; the returned :class:`Generation` holds its output (tokens,
        cached and computed counts, TTFT) once exhausted."""
        _check_question(question)
        if handles is None:
            handles = self.retrieve(question, k)
        q_ids = self.fit_question(question, handles, gen)
        gen = self._answer_gen(gen)
        return self.pc.stream_parts(self.parts(handles), q_ids, preamble="preamble", **gen)

    def full_prompt_ids(self, question: str, handles: list[ModuleHandle]) -> list[int]:
        """The same tokens the cached path reads, for a full prefill."""
        return self.chunks.prompt_ids(handles, self.question_ids(question))

    def answer_full_prefill(self, question: str, k: int | None = None,
                            handles: list[ModuleHandle] | None = None, **gen) -> RAGAnswer:
        """The baseline: the same retrieved text, prefilled in full (nothing reused)."""
        t0 = time.perf_counter()
        _check_question(question)
        if handles is None:
            handles = self.retrieve(question, k, prefetch=False)
        t_ret = time.perf_counter() - t0
        self.fit_question(question, handles, gen)
        gen.pop("recompute", None)  # nothing is cached: there is nothing to recompute or calibrate
        gen.pop("calibration", None)
        out = self.pc.generate_parts([], self.full_prompt_ids(question, handles), **gen)
        return RAGAnswer(out.text, handles, out, t_ret, t_ret + out.ttft_s)

    def close(self) -> None:
        self.chunks.store.close()


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer (chunks to retrieve), not {k!r}")
    return k


def _check_question(question) -> None:
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question is empty")

