"""The answering service behind the web app and the OpenAI-compatible API.

Requests wait in a bounded FIFO queue (fair by arrival), and a full queue is refused at
once (:class:`Busy`, which the app turns into 503 + Retry-After) instead of piling up.
One worker thread takes them in order (all those waiting at once, as far as the batch has
places, their retrieval queries embedded in one call), retrieves and builds each prompt, and
hands its stream to the engine's continuous batch (:meth:`PromptCache.start_batching`): up to
``max_batch`` answers decode together, one forward per token step, and each streams as
its tokens come. With ``max_batch=1`` (or a model that cannot batch) answers are decoded
one at a time. Ingestion runs in its own thread: questions asked meanwhile are answered
from the chunks indexed so far, and say so.

Events of a request reach the asyncio side through ``loop.call_soon_threadsafe``; a
client that goes away sets ``cancelled`` and its stream is closed at the next token,
which takes it out of the batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path


from ..engine import ContextOverflowError, StalledError
from ..engine.scheduler import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_TOKENS
from ..engine.watchdog import DEFAULT_STALL_S
from ..engine.threads import release_pool
from ..discovery import MIN_CHARS
from ..rag.retrieval import conversation_context
from ..request import MAX_PROMPT_CHARS, MAX_QUESTION_CHARS, AnswerRequest, SamplingParams
from .errors import Busy, RequestError
from .uploads import Uploads

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One request on its way through the service: the :class:`~pcache_rag.request.AnswerRequest`
    as the edge built it, and where its answer goes. ``events`` receives ``(kind, data)``:
    ``start`` (sources), ``delta`` (text), ``done`` (statistics), ``full`` (the compare answer),
    ``error``; ``None`` ends it."""

    req: AnswerRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    submitted: float = field(default_factory=time.perf_counter)
    #: the question's retrieval vector, when the worker embedded several waiting questions at once
    query_embedding: list[float] | None = None

    def emit(self, kind: str | None, data=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, None if kind is None else (kind, data))
        except RuntimeError:  # the loop is closed: the client is long gone
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class AnswerService:
    """Questions through one worker and a bounded queue; ingestion beside it (:attr:`uploads`).

    ``rag`` is a :class:`~pcache_rag.rag.CachedRAG`; ``max_queue`` bounds the waiting
    questions (those being answered not counted); ``max_batch`` is how many are answered
    together (1: one at a time) and ``prefill_tokens`` how many prompt tokens a batch step
    computes besides decoding (longer prompts are prefilled in chunks); ``max_new_tokens``
    is the default answer length;
    ``upload_dir`` is where uploaded files are kept (default ``<index>/uploads``);
    ``stall_timeout``: answers waiting that many seconds on a batch that makes no step are
    failed (503, code ``stalled``) and their places freed (:mod:`pcache_rag.engine.watchdog`).
    """

    def __init__(self, rag, max_queue: int = 64, max_new_tokens: int = 128, upload_dir: str | Path | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH, prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
                 stall_timeout: float | None = DEFAULT_STALL_S):
        if max_queue < 1 or max_batch < 1:
            raise ValueError("max_queue and max_batch must be at least 1")
        self.rag = rag
        refusal = rag.pc.batch_refusal
        if max_batch > 1 and refusal:
            log.warning("answers are decoded one at a time: %s", refusal)
        self.max_batch = 1 if refusal else int(max_batch)
        self.prefill_tokens = int(prefill_tokens)
        self.stall_timeout = stall_timeout
        self._slots = threading.Semaphore(self.max_batch)  # answers in flight
        self._own_batch = False  # whether this service started the engine's batch
        self.max_new_tokens = int(max_new_tokens)
        #: files uploaded to the page, ingested in the background beside the answers
        self.uploads = Uploads(rag, upload_dir)
        self._q: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.max_queue = max_queue
        self._worker: threading.Thread | None = None
        self._running: dict[str, Job] = {}  # the jobs being answered, by id
        self.counts = {"answered": 0, "cancelled": 0, "rejected": 0, "failed": 0, "stalled": 0}
        self._job_s: list[float] = []  # recent service times, for Retry-After
        #: when an answer last moved (a token, an end): :meth:`health` calls a long silence with
        #: every slot held a stall
        self._progress = time.monotonic()
        self.stall_s = 60.0
        #: on a stop, how long answers in flight may go on before :func:`fail_in_flight` ends them (set
        #: from the shutdown timeout by :func:`~pcache_rag.serve.graceful_server`); streams are not
        #: cut before it
        self.shutdown_grace_s = 9.5

    # ------------------------------------------------------------------ lifecycle

    @property
    def running(self) -> str | None:
        """The id of a job being answered (any of them, when several are), or None."""
        return next(iter(tuple(self._running)), None)  # a copy: stream threads change it

    def start(self) -> None:
        release_pool()  # the answers' threads keep the only OpenMP pool (pcache_rag.engine.threads)
        if self.max_batch > 1 and self.rag.pc.batch_stats() is None:
            self.rag.pc.start_batching(max_batch=self.max_batch, prefill_tokens=self.prefill_tokens,
                                       stall_s=self.stall_timeout)
            self._own_batch = True
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name="pcache-answer", daemon=True)
            self._worker.start()

    def warm(self) -> None:
        """Load what the first question would otherwise wait for: the embedding model, the
        system-prompt states and the index's chunk texts (for document discovery)."""
        self.rag.embedder.embed(["warm up"])
        self.rag.chunks.preamble()
        self.rag.know_indexed()  # the index's chunks, found in prompts that paste them in
        release_pool()  # this thread now waits; answers run elsewhere

    def stop(self, timeout: float = 10.0) -> None:
        if self._worker is not None and self._worker.is_alive():
            while True:  # make room for the sentinel: waiting jobs are cancelled
                try:
                    job = self._q.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.emit("error", {"status": 503, "message": "the server is shutting down"})
                    job.emit(None)
            self._q.put(None)
            self._worker.join(timeout)
        self._worker = None
        if self._own_batch:
            self.rag.pc.stop_batching()
            self._own_batch = False
        self.uploads.join(timeout)

    # ------------------------------------------------------------------ questions

    @property
    def model_id(self) -> str:
        return self.rag.pc.model_name

    def submit(self, req: AnswerRequest, *old, **old_kw) -> Job:
        """Queue ``req`` (call from the event loop; the edge built and checked it); raises
        :class:`Busy` at once when the queue is full rather than failing later. An empty index is
        refused by the worker (:func:`_indexed`), before anything streams. (A question string
        with keywords, the form before 0.2, still works for one release, with a DeprecationWarning.)"""
        if not isinstance(req, AnswerRequest):
            req = legacy_request(self, "submit", req, *old, **old_kw)
        elif old or old_kw:
            raise TypeError("an AnswerRequest carries its own settings: give them in it, not beside it")
        return self._enqueue(Job(req, asyncio.get_running_loop()))

    def submit_plain(self, messages=None, prompt: str | None = None, tenant: str = "", **gen) -> Job:
        """Deprecated (removed in the next release): ``submit(AnswerRequest(messages=...))`` or
        ``submit(AnswerRequest(prompt=...))``."""
        return self.submit(legacy_request(self, "submit_plain", None, messages=messages, prompt=prompt,
                                          tenant=tenant, **gen))

    def sampling(self, max_new_tokens: int | None = None) -> SamplingParams:
        """Greedy decoding of ``max_new_tokens`` (this service's default answer length when None)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens)

    def _enqueue(self, job: Job) -> Job:
        """Put ``job`` in the queue, or :class:`Busy` when it is full."""
        try:
            self._q.put_nowait(job)
        except queue.Full:
            self.counts["rejected"] += 1
            raise Busy(self._q.qsize(), self._retry_after()) from None
        return job

    def _retry_after(self) -> int:
        recent = self._job_s[-16:]
        per = sum(recent) / len(recent) if recent else 2.0
        return max(1, round(per * (self._q.qsize() + 1) / max(2, self.max_batch)))  # answers overlap

    def _work(self) -> None:
        while True:
            self._slots.acquire()  # a free place in the batch before the next job is taken
            first = self._q.get()
            if first is None:
                self._slots.release()
                return
            # the others waiting now are opened with it, their queries embedded in one call
            jobs, stop = _take_waiting(first, self._q, self._slots)
            live = []
            for job in jobs:
                if job.cancelled.is_set():
                    self.counts["cancelled"] += 1
                    self._slots.release()
                else:
                    live.append(job)
            _embed_together(self.rag, live)
            for job in live:
                self._start(job)
            if stop:
                return

    def _start(self, job: Job) -> None:
        """Open ``job`` (retrieval, its prompt) and stream it: in this thread when answers go one
        at a time, else in a thread of its own while this one takes the next."""
        self._running[job.id] = job
        t0 = time.perf_counter()
        opened = self._guarded(job, open_job, self, job)
        if self.max_batch > 1:  # the batch's thread decodes: this one waits for the next job
            release_pool()
        if opened is None:
            self._done(job, t0)
        elif self.max_batch == 1:
            self._guarded(job, self._drain, job, opened)
            self._done(job, t0)
        else:  # it streams from the batch in a thread of its own; the worker takes the next
            threading.Thread(target=self._stream_job, args=(job, opened, t0), name="pcache-stream",
                             daemon=True).start()

    def _stream_job(self, job: Job, opened: _Opened, t0: float) -> None:
        try:
            self._guarded(job, self._drain, job, opened)
        finally:
            self._done(job, t0)

    def _guarded(self, job: Job, fn, *args):
        try:
            return fn(*args)
        except StalledError as e:  # the batch's watchdog freed it (pcache_rag.engine.watchdog)
            self.counts["stalled"] += 1
            log.warning("request %s: %s", job.id, e)
            job.emit("error", {"status": 503, "code": "stalled", "message": str(e), "retry_after": 5})
            return None
        except Exception:  # noqa: BLE001 - one bad request never stops the service
            self.counts["failed"] += 1
            log.exception("answering request %s (%r) failed", job.id, (job.req.question or "")[:80])
            # a stable code and one line of our own: the exception's text (an internal parser's, a
            # library's) stays in the log, under the request's id
            job.emit("error", {"status": 500, "code": "internal_error",
                               "message": f"the answer failed inside the server (request {job.id}; its log has why)"})
            return None

    def _done(self, job: Job, t0: float) -> None:
        self._progress = time.monotonic()
        self._running.pop(job.id, None)
        self._job_s.append(time.perf_counter() - t0)
        del self._job_s[:-64]
        job.emit(None)
        self._slots.release()

    def _drain(self, job: Job, o: _Opened) -> None:
        """Stream the job's answer to its events, then its statistics (and the comparison)."""
        rag, stream, t0, notes, handles = self.rag, o.stream, o.t0, o.notes, o.handles
        queued, retrieve_s = o.queued, o.retrieve_s
        ttft = None
        try:
            for item in stream:  # text deltas; afterwards stream.output (every stream is a Generation)
                if job.cancelled.is_set():
                    break
                if ttft is None:
                    ttft = time.perf_counter() - t0
                self._progress = time.monotonic()
                job.emit("delta", item)
        finally:
            stream.close()  # releases the engine at once when the client went away
        if job.cancelled.is_set():
            self.counts["cancelled"] += 1
            return
        out = stream.output
        if out is None:
            raise RuntimeError("the answer stream ended without its output")
        usage = out.usage()
        if job.req.sampling.grammar and usage["finish_reason"] == "length":
            notes.append("the answer reached max_tokens before its structured output was complete: it is cut "
                         "short (raise max_tokens)")
        stats = {**usage, "ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
                 "queued_s": queued, "retrieve_s": retrieve_s, "total_s": time.perf_counter() - t0, "notes": notes}
        job.emit("done", stats)
        self.counts["answered"] += 1
        if job.req.compare and handles is not None and not job.cancelled.is_set():
            compare_full(rag, job, handles, retrieve_s, stats["ttft_s"])

    # ------------------------------------------------------------------ state

    def stats(self) -> dict:
        """What the page's cache panel shows (:func:`service_stats`)."""
        return service_stats(self)


def legacy_request(service: AnswerService, name: str, question: str | None = None, k: int | None = None,
                   compare: bool = False, history=None, instruction: str = "", tenant: str = "", messages=None,
                   prompt: str | None = None, **gen) -> AnswerRequest:
    """The :class:`AnswerRequest` that ``service.submit(question, ...)`` or ``submit_plain(...)`` (the
    forms before 0.2) asked for, with a DeprecationWarning that names the new call."""
    warnings.warn(f"AnswerService.{name}(...) with loose arguments is deprecated: build an AnswerRequest "
                  "(pcache_rag.request) and call submit(request) (removed in the next release)",
                  DeprecationWarning, stacklevel=3)
    sampling = SamplingParams.of(service.sampling(), **gen)
    if question is None:
        return AnswerRequest(messages=None if messages is None else tuple(messages), prompt=prompt, sampling=sampling,
                             tenant=tenant, max_chars=MAX_PROMPT_CHARS)
    return AnswerRequest(question=question, k=k, compare=compare, history=tuple(history or ()), instruction=instruction,
                         sampling=sampling, tenant=tenant, max_chars=MAX_QUESTION_CHARS)


def open_job(service: AnswerService, job: Job) -> _Opened | None:
    """Retrieve and build ``job``'s stream on ``service``, up to its first item (None: an error was
    sent). The plain model's prompt, and a question that carries documents the server knows, are
    answered as sent; any other question is retrieved for, with the conversation before it."""
    rag, req = service.rag, job.req
    queued = time.perf_counter() - job.submitted
    t0 = time.perf_counter()
    notes: list[str] = []
    handles = None
    retrieve_s = 0.0
    sp = req.sampling
    try:
        messages = req.messages
        if req.question is not None and len(req.question) >= MIN_CHARS and rag.carries_documents(req.question):
            # a client's own RAG prompt ("Context: ... Question: ..."): it retrieved already
            notes.append("the question carries documents this server knows: answered as sent, without "
                         "retrieval (they are read from the cache)")
            messages = (*req.history, ("user", req.asked))
        if messages is not None or req.prompt is not None:  # the plain model: the prompt as sent
            stream = rag.stream_prompt(messages, req.prompt, notes, tenant=req.tenant, params=sp)
        else:
            assert req.question is not None
            indexed = _indexed(rag, service.uploads.running)
            if service.uploads.running:
                notes.append(f"ingestion is running: this answer uses the {indexed} chunks indexed so far")
            context = conversation_context(list(req.history))  # a follow-up is looked up with what came before
            if context:
                notes.append(f"retrieval also read {len(context)} earlier message(s) of the conversation")
            handles = rag.retrieve(req, notes=notes, embedding=job.query_embedding, context=context)  # checked at the edge
            retrieve_s = time.perf_counter() - t0
            stream = (rag.stream_turns(list(req.history), req.asked, handles, notes,
                                       tenant=req.tenant, params=sp)
                      if req.history
                      else rag.stream(req, handles=handles))
        # a prompt through the Assembler is planned now (Assembler.stream_planned): a prompt too long or
        # unsupported is the client's error, said before anything streams
    except RequestError as e:
        job.emit("error", {"status": e.status, "message": str(e), "retry_after": e.retry_after})
        return None
    except (ContextOverflowError, ValueError, TypeError) as e:
        job.emit("error", {"status": 400, "message": str(e)})
        return None
    job.emit("start", {"sources": [_source(h) for h in handles or []], "queued_s": queued, "notes": notes})
    return _Opened(stream, t0, queued, retrieve_s, notes, handles)


def compare_full(rag, job: Job, handles, retrieve_s: float, cached_ttft_s: float) -> None:
    """The ``full`` event of a compare job: the same retrieved text prefilled in full (both
    times to first token include the same retrieval)."""
    full = rag.answer_full_prefill(job.req, handles=handles)
    full_ttft = retrieve_s + full.output.ttft_s
    job.emit("full", {"text": full.text, "ttft_s": full_ttft, "cached_ttft_s": cached_ttft_s,
                      "speedup": full_ttft / max(cached_ttft_s, 1e-9), "prompt_tokens": full.output.computed_tokens})


def service_stats(service: AnswerService) -> dict:
    """What the page's cache panel shows: chunks, documents, bytes/hits/misses per tier,
    the queue and the counters."""
    pc = service.rag.pc
    st = pc.stats()
    tiers = {name: {k: t[k] for k in ("bytes", "entries", "hits", "misses", "evictions")}
             for name, t in st["tiers"].items()}
    try:
        states = service.rag.upkeep.state_stats()
        chunks, documents = states["chunks"], states["documents"]
    except Exception as e:  # noqa: BLE001 - a damaged index is reported, not fatal
        chunks, documents, states = 0, 0, {}
        log.warning("index statistics unavailable: %s", e)
    return {
        "model": service.model_id,
        "chunks": chunks,
        "documents": documents,
        "bytes_per_token": service.rag.chunks.bytes_per_token,
        "tiers": tiers,
        "states": states,  # lazily indexed chunks: hot (encoded on first use) and cold
        "encoded": st["encoded"],  # by this process: zero when another one encoded everything
        # how answers read the cache: calibrated attention (and where it comes from), conditioning, retrieval
        "calibration": dict(zip(("attention", "source"), service.rag.calibration)),
        "conditioning": service.rag.asm.conditioning,
        "retrieval": service.rag.retrieval,
        "queue": {"waiting": service._q.qsize(), "limit": service.max_queue, "running": bool(service._running),
                  "answering": len(service._running), "max_batch": service.max_batch},
        "batch": service.rag.pc.batch_stats(),
        **service.counts,
        "ingest": service.uploads.status(),
    }



def fail_in_flight(service: AnswerService, reason: str) -> int:
    """End every answer in flight on ``service`` with ``reason`` (503, code ``shutting_down``): a
    stop that cannot wait for them any longer says so to their clients
    (:func:`~pcache_rag.serve.graceful_server`). Their streams leave the batch at their next
    token; how many were ended."""
    jobs = list(service._running.copy().values())  # copied at once: stream threads change it
    for job in jobs:
        job.emit("error", {"status": 503, "code": "shutting_down", "message": reason})
        job.emit(None)
        job.cancel()
    if jobs:
        log.warning("%d answer(s) in flight ended: %s", len(jobs), reason)
    return len(jobs)


def service_health(service: AnswerService, stall_s: float | None = None) -> tuple[bool, str]:
    """``(ok, why not)``: degraded while every answering slot is held and no answer has made
    progress for ``stall_s`` seconds (default ``service.stall_s``), or when the batch's thread
    has died; it recovers on its own as soon as an answer moves again."""
    stall = service.stall_s if stall_s is None else stall_s
    sched = service.rag.pc.scheduler
    if service._own_batch and sched is not None and not sched.alive:
        return False, "the batch scheduler's thread has stopped"
    idle = time.monotonic() - service._progress
    if len(service._running) >= service.max_batch and idle > stall:
        return False, (f"all {service.max_batch} answering slots are held and no answer has moved for "
                       f"{idle:.0f} s")
    return True, ""


def _indexed(rag, ingesting: bool) -> int:
    """The chunks in ``rag``'s index, or :class:`RequestError` (409) when there are none. The
    worker asks, not the request's handler: a chroma call there holds the event loop, and so
    every client's stream, for each request that arrives (~10 ms a call under load here, 0.4 ms idle)."""
    n = rag.index.count()
    if n == 0 and ingesting:
        raise RequestError("no document is indexed yet: ingestion is running, ask again in a moment", 409,
                           retry_after=5)
    if n == 0:
        raise RequestError("no document is indexed yet: add documents first", 409)
    return n


def _take_waiting(first: Job, q: queue.Queue, slots: threading.Semaphore) -> tuple[list[Job], bool]:
    """``first`` and the other questions waiting in ``q`` now, as far as the batch has places
    (``slots``, one taken for each), so that a burst is opened together and reaches the batch
    at once; and whether the stop sentinel came after them (they are answered, then the worker ends)."""
    jobs = [first]
    while slots.acquire(blocking=False):
        try:
            nxt = q.get_nowait()
        except queue.Empty:
            slots.release()
            return jobs, False
        if nxt is None:
            slots.release()
            return jobs, True
        jobs.append(nxt)
    return jobs, False


def _embed_together(rag, jobs: list[Job]) -> None:
    """Embed the retrieval queries of several questions in one call of the embedding model;
    each job keeps its vector for its retrieval. One question embeds its own."""
    asking = [j for j in jobs if j.req.question is not None]
    if len(asking) < 2:
        return
    try:
        vectors = rag.embedder.embed([j.req.question for j in asking])
    except Exception as e:  # noqa: BLE001 - each question then embeds its own, and fails on its own
        log.warning("embedding %d questions together failed (%s): each is embedded alone", len(asking), e)
        return
    for j, v in zip(asking, vectors):
        j.query_embedding = v


@dataclass
class _Opened:
    """A job's stream once built and started, and what its statistics need."""

    stream: Any
    t0: float
    queued: float
    retrieve_s: float
    notes: list[str]
    handles: list | None


def _source(h) -> dict:
    return {"document": Path(h.source).name, "chunk": int(h.metadata.get("chunk", 0)), "score": round(h.score, 4),
            "tokens": h.n_tokens, "preview": h.text[:240]}
