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
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from ..conditioning import LearnedPrefix
from ..docmodules import DEFAULT_SYSTEM
from ..engine import Generation, Parts, PromptCache
from ..models.attention import Calibration
from ..moved import moved
from ..recompute import Recompute
from ..request import AnswerRequest, SamplingParams
from .chunks import ChunkStates, index_assembler
from .embed import MiniLMEmbedder
from .index import ChromaIndex
from .calibrate import answer_settings
from .index_dir import MANIFEST, Index, check_index_dir
from .ingest import IngestTooLargeError
from .live import LiveIndex
from .maintenance import Upkeep
from .states import bytes_per_token
from .prompt import check_fits, fit_question, question_ids, user_turn
from .retrieval import Retriever
from .types import IngestReport, ModuleHandle, RAGAnswer, VerifyReport

__all__ = ["CachedRAG", "ModuleHandle", "RAGAnswer", "IngestReport", "VerifyReport", "IngestTooLargeError",
           "DEFAULT_SYSTEM", "MANIFEST", "Index", "check_index_dir", "question_ids", "index_conditioning"]

log = logging.getLogger(__name__)

#: ``eager``: encode chunks at ingest; ``lazy``: index them now, encode each on first use
EncodeMode = Literal["eager", "lazy"]


def index_conditioning(index_dir: str | Path | Index) -> str | LearnedPrefix:
    """The conditioning an index's chunks are encoded under (:meth:`Index.conditioning`), for a
    framework component that answers from it (:func:`pcache_rag.docmodules.assembler_for`)."""
    if not Path(index_dir).expanduser().exists():
        return "default"  # an index not made yet: nothing is encoded under any conditioning
    return Index(index_dir, create=False).conditioning()


class CachedRAG:
    """Ingest documents into chroma + the KV store, and answer questions from cached states.

    ``index_dir``: an :class:`Index` or its path (a new or empty directory, or an index;
    ``create=False``: it must exist). ``chunk_tokens``: the index's own (512 for a new one); ``k``
    chunks of that size must fit the model's context with the question. ``recompute``: the answers'
    policy (``"auto"``: :func:`~pcache_rag.recompute.resolve_auto`; per call: ``answer(..., recompute=)``).
    ``kv_url`` (``"redis://host:6379/0"``): a remote tier that several processes or machines share.
    ``conditioning`` (``"neutral"``, ``"neutral:2"``, a learned prefix): what chunks are encoded after
    besides the preamble (:mod:`pcache_rag.docmodules`); an index keeps its own until ``pcache-rag
    calibrate --learn`` moves it. ``retrieval``: ``"hybrid"`` (BM25 fused with MiniLM) or ``"dense"``.
    ``calibration``: ``"auto"`` (the index's own, from ``pcache-rag calibrate``), ``"none"`` or ``"ape:T:S"``.
    ``learn``: a prompt answered as sent (:meth:`stream_prompt`, the server's plain model) has its
    unknown blocks encoded and kept as documents (False: only known documents are read from the cache).
    ``namespace``: what this object's prompts teach (their prefixes, their documents not in the
    index) is kept for it alone (:mod:`pcache_rag.store.learned`); the index is shared by design.
    A server passes each request's own tenant instead (``tenant=``).
    """

    def __init__(
        self, index_dir: str | Path | Index, pc: PromptCache | None = None, model: str | None = None, k: int = 4,
        chunk_tokens: int | None = None, system_prompt: str = DEFAULT_SYSTEM, chroma_url: str | None = None,
        embedder: MiniLMEmbedder | None = None, create: bool = True, recompute: str | None = "auto",
        kv_url: str | None = None, conditioning: str | LearnedPrefix | None = None, retrieval: str = "hybrid",
        calibration: str | None = "auto", learn: bool = True, namespace: str = "",
    ):
        if calibration not in (None, "auto"):
            Calibration.parse(calibration)  # refused by name before anything loads
        self._calibration_arg = calibration
        #: prompts answered as sent (:meth:`stream_prompt`) teach their unknown blocks as documents
        self.learn = bool(learn)
        #: the tenant this object's prompts learn for, unless a call names another
        self.namespace = str(namespace)
        #: the index directory's owner: its paths, manifest and settings
        self.folder = Index(index_dir, create)
        self.index_dir = self.folder.path
        #: the recompute policy asked for: "auto", None (the engine's default) or a policy
        self._recompute_arg = recompute if recompute in (None, "auto") else str(Recompute.parse(recompute))
        self.k = _check_k(k)
        self.chunk_tokens, cond = self.folder.settings(self.folder.manifest(), chunk_tokens, conditioning)
        if pc is not None and kv_url is not None:
            raise ValueError("give kv_url to the PromptCache you pass (pc), or let CachedRAG build one")
        self.pc = pc = pc if pc is not None else self.folder.engine(model, kv_url=kv_url)
        self.embedder = embedder or MiniLMEmbedder()
        #: chroma as this process sees it, reopened when any process commits
        self.live = LiveIndex(self.folder, chroma_url)
        #: the index's chunks as states: content-addressed, shared with the LlamaIndex/LangChain components
        self.chunks = ChunkStates(index_assembler(pc, self.folder, system_prompt, cond), pc.store, bytes_per_token(pc))
        self.retriever = Retriever(self.live, self.embedder, self.chunks, retrieval)
        #: every write to the index: ingest, prune, repair, verify, commit
        self.upkeep = Upkeep(self.folder, self.live, self.chunks, self.embedder, pc.tokenizer, self.chunk_tokens)
        self.check_fits(self.k)

    @property
    def asm(self):
        """The :class:`~pcache_rag.docmodules.Assembler` the index's chunks are encoded under."""
        return self.chunks.asm

    @property
    def preamble_ids(self) -> list[int]:
        return self.chunks.preamble_ids

    @property
    def manifest(self) -> dict:
        """The index's manifest as this process last read or wrote it."""
        return self.live.manifest

    @property
    def retrieval(self) -> str:
        """``"hybrid"`` (BM25 fused with MiniLM) or ``"dense"`` (MiniLM alone)."""
        return self.retriever.mode

    # ------------------------------------------------------------------ the index directory

    @property
    def generation(self) -> int:
        """The manifest's commit counter this process has seen (see :meth:`refresh`)."""
        return self.live.generation

    @property
    def index(self) -> ChromaIndex:
        """The chroma side (:attr:`LiveIndex.chroma`: a damaged database raises, and an ingest rebuilds it)."""
        return self.live.chroma

    def check_fits(self, k: int) -> None:
        """Refuse a ``k`` x ``chunk_tokens`` that cannot fit the model's context with a question."""
        check_fits(len(self.preamble_ids), k, self.chunk_tokens, self.asm.max_positions)

    chunk_text = staticmethod(ChunkStates.text)

    # ------------------------------------------------------------------ writes: the rest is :attr:`upkeep`'s

    def ingest(self, paths: Sequence[str | Path], progress: bool = True, encode: EncodeMode = "eager",
               prune: bool = False,
               repair: bool = True, on_progress: Callable[[str, int, int], None] | None = None) -> IngestReport:
        """Index files (or directories of them): new and changed files are read, chunked, embedded and
        (``encode="eager"``) encoded; unchanged ones cost nothing; one bad file never stops the run
        (``report.skipped`` says why). ``prune``, ``repair``, the budget check, the lock and
        ``on_progress``: :meth:`Upkeep.ingest`."""
        return self.upkeep.ingest(paths, progress, encode, prune, repair, on_progress)

    def verify(self, store: bool = True) -> VerifyReport:
        """Check the index against the files and the store (see :class:`VerifyReport`)."""
        return self.upkeep.verify(store)

    def __getattr__(self, name: str):
        """The index-maintenance methods that moved to :attr:`upkeep` (and :attr:`chunks`) after
        0.1 (:data:`_MOVED`): still reached here for one release, with a ``DeprecationWarning``."""
        return moved(self, name, _MOVED, "rag")

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

    # ------------------------------------------------------------------ retrieve and answer

    def retrieve(self, question: str | AnswerRequest, k: int | None = None, prefetch: bool = True,
                 notes: list[str] | None = None, embedding: list[float] | None = None,
                 context: Sequence[str] = ()) -> list[ModuleHandle]:
        """The ``k`` closest chunks as handles, best first; their states start moving to the fastest tier at once
        (``prefetch``). Sees every ingest committed by any process (:meth:`refresh`); what cannot be used is said
        in ``notes`` (when given) and the log. ``embedding``: the question's vector, if the caller has it.
        ``context``: the conversation's earlier texts, most recent first (``conversation_context(turns)``): a
        follow-up is looked up with them (:func:`~pcache_rag.rag.retrieval.with_context`). An
        :class:`~pcache_rag.request.AnswerRequest` (checked where it was built) brings its question and ``k``."""
        q, k = _question_and_k(question, k)
        return self._retrieve(q, k, prefetch, notes, embedding, context)

    def _retrieve(self, question: str, k: int | None, prefetch: bool = True, notes: list[str] | None = None,
                  embedding: list[float] | None = None, context: Sequence[str] = ()) -> list[ModuleHandle]:
        """:meth:`retrieve` of a question and ``k`` already checked (None: the index's own ``k``)."""
        k = self.k if k is None else k
        self.upkeep.refresh()
        hits = self.retriever.hits(question, k, embedding, context)
        if self.retriever.stale(hits):  # chunks that vanished since chroma's vector index was loaded: look again
            self.upkeep.refresh(force=True)
            hits = self.retriever.hits(question, k, embedding, context)
        return self.retriever.handles(hits, prefetch, notes)

    def know_indexed(self) -> int:
        """Make every indexed chunk a known document of the engine, so prompts that paste chunks
        in without marks read them from the cache (:mod:`pcache_rag.discovery`). Once per
        index version; returns how many texts were added (:meth:`Retriever.know_indexed`)."""
        self.upkeep.refresh()
        return self.retriever.know_indexed()

    def question_ids(self, question: str) -> list[int]:
        return question_ids(self.pc, question)

    def answer(self, question: str | AnswerRequest, k: int | None = None, handles: list[ModuleHandle] | None = None,
               params: SamplingParams | None = None, **gen) -> RAGAnswer:
        """Retrieve (unless ``handles`` are given), assemble cached states, generate. ``question``:
        the text, or an :class:`~pcache_rag.request.AnswerRequest` built and checked elsewhere (the
        server's edge), which then carries ``k``, its instruction and how to decode. How to decode:
        ``params`` (a :class:`~pcache_rag.request.SamplingParams`) and/or its fields as keywords
        (``max_new_tokens=...``); ``recompute`` and ``calibration`` override the index's own."""
        t0 = time.perf_counter()
        handles, prompt, recompute, sp, t_ret = prepare_answer(self, question, k, handles, params, gen)
        t_pre = time.perf_counter() - t0
        out = self.pc.generate(prompt, recompute=recompute, params=sp)
        return RAGAnswer(out.text, handles, out, t_ret, t_pre + out.ttft_s)

    def stream(self, question: str | AnswerRequest, k: int | None = None, handles: list[ModuleHandle] | None = None,
               params: SamplingParams | None = None, **gen) -> Generation:
        """Text deltas of the answer (arguments as :meth:`answer`); the returned :class:`Generation`
        holds its output (tokens, cached and computed counts, TTFT) once exhausted."""
        _, prompt, recompute, sp, _ = prepare_answer(self, question, k, handles, params, gen)
        return self.pc.stream(prompt, recompute=recompute, params=sp)

    def stream_turns(self, turns: list[tuple[str, str]], question: str, handles: list[ModuleHandle],
                     notes: list[str] | None = None, tenant: str | None = None, params: SamplingParams | None = None,
                     **gen) -> Generation:
        """A conversation's answer: its ``turns`` (a system message, else the index's own, then the
        earlier turns), then a user turn of the retrieved chunks and the ``question``; the chunks'
        states are read as in :meth:`stream`. Calibrated attention applies to single questions only,
        and ``notes`` says so. Returns the Assembler's :class:`Generation`, as :meth:`stream` does."""
        turns = list(turns)
        if not any(role == "system" for role, _ in turns):
            turns.insert(0, ("system", self.asm.system_prompt))
        turns.append(("user", user_turn([self.chunk_text(h) for h in sorted(handles, key=lambda h: h.score)],
                                        question)))
        if self.calibration[0] is not None and notes is not None:
            notes.append(f"the index's calibrated attention ({self.calibration[0]}) applies to single questions, "
                         "not to conversations: this answer is uncalibrated")
        segs = self.asm.message_segments(turns, tenant=self.namespace if tenant is None else tenant)
        return self.asm.stream_planned(segs, recompute=self.recompute, params=SamplingParams.of(params, **gen))

    def stream_prompt(self, messages: Sequence[tuple[str, str]] | None = None, prompt: str | None = None,
                      notes: list[str] | None = None, tenant: str | None = None, params: SamplingParams | None = None,
                      **gen) -> Generation:
        """A prompt answered as sent, chat ``messages`` or a text ``prompt``, with no retrieval: the
        index's chunks (and other known documents) in it are read from the cache, marked or not;
        why other text was computed joins ``notes``; what it teaches is kept for ``tenant`` (default:
        :attr:`namespace`). Returns the Assembler's :class:`Generation`."""
        self.know_indexed()
        t = self.namespace if tenant is None else tenant
        segs = (self.asm.message_segments(messages, learn=self.learn, tenant=t) if messages is not None
                else self.asm.text_segments(prompt or "", learn=self.learn, tenant=t))
        if notes is not None:
            notes.extend(segs.uncached)
        return self.asm.stream_planned(segs, params=SamplingParams.of(params, **gen))

    def carries_documents(self, text: str) -> bool:
        """Whether ``text`` holds one of the index's chunks (or another known document): a prompt
        with its own context, not a query."""
        self.know_indexed()
        return bool(self.asm.known_texts.find(text))

    def full_prompt_ids(self, question: str, handles: list[ModuleHandle]) -> list[int]:
        """The same tokens the cached path reads, for a full prefill."""
        return self.chunks.prompt_ids(handles, self.question_ids(question))

    def answer_full_prefill(self, question: str | AnswerRequest, k: int | None = None,
                            handles: list[ModuleHandle] | None = None, params: SamplingParams | None = None,
                            **gen) -> RAGAnswer:
        """The baseline: the same retrieved text, prefilled in full (nothing reused); arguments as
        :meth:`answer`."""
        t0 = time.perf_counter()
        gen.pop("recompute", None)  # nothing is cached: there is nothing to recompute or calibrate
        gen.pop("calibration", None)
        req = as_request(question, k, params, gen)
        assert req.question is not None
        if handles is None:
            handles = self._retrieve(req.question, req.k, prefetch=False)
        t_ret = time.perf_counter() - t0
        fit_question(self, req.asked, handles, req.sampling.max_new_tokens)
        out = self.pc.generate(Parts([], self.full_prompt_ids(req.asked, handles)), params=req.sampling)
        return RAGAnswer(out.text, handles, out, t_ret, t_ret + out.ttft_s)

    def close(self) -> None:
        self.chunks.store.close()


#: what moved from CachedRAG to its parts after 0.1 (:meth:`CachedRAG.__getattr__` warns and forwards)
_MOVED = {"refresh": "upkeep.refresh", "pending_uploads": "upkeep.pending_uploads", "state_stats": "upkeep.state_stats",
          "prune": "upkeep.prune", "repair": "upkeep.repair", "commit": "upkeep.commit", "chunk_ids": "chunks.ids",
          "parts": "chunks.parts", "upload_dir": "folder.upload_dir"}


def prepare_answer(rag: CachedRAG, question: str | AnswerRequest, k: int | None, handles: list[ModuleHandle] | None,
                   params: SamplingParams | None,
                   gen: dict) -> tuple[list[ModuleHandle], Parts, str | Recompute | None, SamplingParams, float]:
    """The handles (retrieved unless given), the answer's prompt (its states fetched, lazy ones
    encoded on first use; calibrated as the index says unless ``gen`` sets it), its recompute
    policy (the index's unless ``gen`` sets it), how to decode, and the seconds retrieval took.
    The request is built (and checked) once, here or at the caller's edge."""
    t0 = time.perf_counter()
    settings = {name: gen.pop(name) for name in ("recompute", "calibration") if name in gen}
    req = as_request(question, k, params, gen)
    assert req.question is not None
    sp = req.sampling
    if handles is None:
        handles = rag._retrieve(req.question, req.k)
    t_ret = time.perf_counter() - t0
    q_ids = fit_question(rag, req.asked, handles, sp.max_new_tokens)  # the instruction is read, not searched for
    calibration = rag.calibration[0]
    structured = sp.grammar is not None  # "auto" is each:1 for a structured answer
    settings = answer_settings(settings, rag.folder.recompute(rag._recompute_arg, calibration, structured),
                               calibration)
    prompt = Parts(rag.chunks.parts(handles), q_ids, "preamble", settings["calibration"])
    return handles, prompt, settings["recompute"], sp, t_ret


def as_request(question: str | AnswerRequest, k: int | None, params: SamplingParams | None,
               gen: dict) -> AnswerRequest:
    """``question`` as a checked :class:`AnswerRequest` (itself when it is one already: then ``k``,
    ``params`` and ``gen`` must be unset; its own fields say them). An unknown keyword is refused by name."""
    if isinstance(question, AnswerRequest):
        if k is not None or params is not None or gen:
            raise TypeError("an AnswerRequest carries its own k and sampling: give them in it, not beside it")
        if question.question is None:
            raise ValueError("this AnswerRequest is a plain prompt: CachedRAG.stream_prompt answers it")
        return question
    return AnswerRequest(question=question, k=None if k is None else _check_k(k), sampling=SamplingParams.of(params, **gen))


def _question_and_k(question: str | AnswerRequest, k: int | None) -> tuple[str, int | None]:
    """A retrieval's question and ``k``: an :class:`AnswerRequest`'s own (checked where it was built,
    not again), or the two given, checked here."""
    if isinstance(question, AnswerRequest):
        if k is not None or question.question is None:
            raise ValueError("retrieve takes an AnswerRequest's own question and k: "
                             + ("give k in it, not beside it" if k is not None else "this one is a plain prompt"))
        return question.question, question.k
    _check_question(question)
    return question, None if k is None else _check_k(k)


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer (chunks to retrieve), not {k!r}")
    return k


def _check_question(question) -> None:
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question is empty")

