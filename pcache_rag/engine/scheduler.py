"""Continuous batching: requests join and leave a running batch at token boundaries.

Each request owns its KV rows (:class:`~pcache_rag.kv.RequestKV`: its assembled cache,
copied out of the workspace after its prefill, with room for its answer), so requests with
different documents, lengths and positions decode together: one forward per step, in which
every sequence attends to its own rows (:class:`~pcache_rag.models.attention.RaggedStep`)
while the projections and MLPs run batched. Decoding on a CPU is bound by reading the
weights; a batch reads them once per step instead of once per request.

Between decode steps the scheduler prefills waiting requests, under a token budget per
step: the new tokens of a long prompt are prefilled in chunks over the request's own rows
(exact: each chunk attends to everything before it and to itself causally), so a long
prompt cannot stall the streams already running. Memory is bounded by a budget on live KV
rows: a request that would exceed it waits until others finish; none is stopped mid-answer.

Requests reach it through :meth:`PromptCache.start_batching` (every stream of the engine
then goes through one scheduler thread) or through :meth:`PromptCache.generate_parts_batch`
(a private scheduler driven in the caller's thread).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..kv import RequestKV
from ..models import UnsupportedModelError
from ..models.attention import RaggedStep, ragged
from .decode import Decoding, SamplingParams
from .lock import EngineLock
from .types import ContextOverflowError, GenerationOutput, PrefillResult

log = logging.getLogger(__name__)

#: new tokens prefilled per scheduler step, across requests (a longer prompt is chunked)
DEFAULT_PREFILL_TOKENS = 256
#: the most requests decoding together
DEFAULT_MAX_BATCH = 16
#: live KV rows (prompt and answer tokens of every admitted request), unless told otherwise
DEFAULT_KV_BUDGET_BYTES = 4 << 30


class _RaggedLayer(DynamicLayer):
    """One layer of a ragged decode step's cache: writes each sequence's new key and value
    into that sequence's own rows (:meth:`RaggedStep.write`) and hands the attention the new
    rows only; ``pcache_sdpa`` reads each sequence's keys from the step."""

    def __init__(self, step: RaggedStep, index: int, longest: int, like: torch.Tensor) -> None:
        super().__init__()
        self.step, self.index, self.longest = step, index, longest
        self.is_initialized = True
        self.device = like.device
        self.keys = like[:0]
        self.values = like[:0]

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.step.write(self.index, key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.longest

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.longest + query_length, 0


@dataclass(eq=False)
class Request:
    """One answer to compute. ``prepare(reserve)`` prefills its prompt (or the prompt's first
    chunk) in the engine's workspace; ``rest`` are new tokens still to prefill after it, in
    chunks; ``rows`` is the KV rows it will hold (prompt and answer), for the budget. Items go
    to ``out``: text deltas, then the :class:`GenerationOutput` (or an exception)."""

    prepare: Callable[[int], PrefillResult]
    params: SamplingParams
    rows: int
    rest: list[int] = field(default_factory=list)
    t0: float | None = None  # when its wait began; None: when its prefill begins
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # set by the scheduler
    res: PrefillResult | None = None
    kv: RequestKV | None = None
    seq: Decoding | None = None
    next_pos: int = 0
    chunked: int = 0  # tokens prefilled in chunks after the first
    batch: int = 1  # the largest decode batch it joined

    def cancel(self) -> None:
        """Stop at the next step (a client that went away); its rows are freed."""
        self.cancelled.set()

    def items(self) -> Iterator[str | GenerationOutput]:
        """What the scheduler sends, until the output (an exception is raised here)."""
        while True:
            item = self.out.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, GenerationOutput):
                return


class Scheduler:
    """Runs requests of one :class:`~pcache_rag.engine.PromptCache` as one continuous batch.

    ``max_batch``: the most requests decoding together. ``prefill_tokens``: new tokens
    prefilled per step (a prompt with more is chunked). ``kv_budget``: live KV rows (default:
    4 GiB of states in the model's dtype, and at least one full context).
    :meth:`start` runs it in a thread of its own; :meth:`run_until_idle` drives it in the
    caller's. Each step holds the engine's lock, and lets other callers of the engine in
    between steps."""

    def __init__(self, pc, lock: EngineLock, max_batch: int = DEFAULT_MAX_BATCH,
                 prefill_tokens: int = DEFAULT_PREFILL_TOKENS, kv_budget: int | None = None) -> None:
        if max_batch < 1 or prefill_tokens < 1:
            raise ValueError("max_batch and prefill_tokens must be at least 1")
        self.pc = pc
        self._lock = lock  # the engine's: one step at a time over its workspace
        self.max_batch = int(max_batch)
        self.prefill_tokens = int(prefill_tokens)
        s = pc.adapter.kv_shape
        per_row = s.bytes_per_token(torch.empty(0, dtype=pc.adapter.dtype).element_size())
        self.kv_budget = int(kv_budget) if kv_budget is not None else max(
            DEFAULT_KV_BUDGET_BYTES // per_row, pc.max_positions + 1024)
        self._pending: deque[Request] = deque()
        self._live: list[Request] = []
        self._filling: Request | None = None  # a request between prefill chunks
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.counts = {"steps": 0, "decoded": 0, "prefills": 0, "chunks": 0, "finished": 0, "cancelled": 0,
                       "max_batch_seen": 0}

    # ------------------------------------------------------------------ requests

    def submit(self, req: Request) -> Request:
        """Queue ``req``; refused (:class:`ContextOverflowError`) if it alone exceeds the budget."""
        if req.rows > self.kv_budget:
            raise ContextOverflowError(f"the request needs {req.rows} KV rows; the batch budget is {self.kv_budget}")
        with self._cond:
            if self._stopping:
                raise RuntimeError("the batch scheduler is stopped")
            self._pending.append(req)
            self._cond.notify()
        return req

    @property
    def live_rows(self) -> int:
        return sum(r.rows for r in self._live) + (self._filling.rows if self._filling else 0)

    def stats(self) -> dict:
        """Live and waiting requests, rows held against the budget, and the counters (decode
        steps, sequence-steps decoded, prefills, chunks; ``mean_batch`` = decoded / steps)."""
        steps = self.counts["steps"]
        return {"live": len(self._live) + (self._filling is not None), "waiting": len(self._pending),
                "live_rows": self.live_rows, "kv_budget": self.kv_budget, "max_batch": self.max_batch,
                "prefill_tokens": self.prefill_tokens, **self.counts,
                "mean_batch": round(self.counts["decoded"] / steps, 2) if steps else 0.0}

    # ------------------------------------------------------------------ running

    def start(self) -> None:
        """Run in a daemon thread until :meth:`stop`."""
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="pcache-batch", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; waiting and running requests get an error."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._fail_all(RuntimeError("the batch scheduler stopped"))

    def run_until_idle(self) -> None:
        """Drive the scheduler in this thread until nothing is waiting or running."""
        while self._busy():
            self.step()

    def _busy(self) -> bool:
        return bool(self._pending or self._live or self._filling)

    def _loop(self) -> None:
        lock = self._lock
        while True:
            with self._cond:
                while not self._busy() and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - the thread outlives one bad step
                log.exception("a batch step failed")
                self._fail_all(e)
            # let another caller of the engine (an ingest, a full-prefill comparison) in
            deadline = time.perf_counter() + 0.05
            while lock.waiting and time.perf_counter() < deadline:
                time.sleep(0.001)

    def _fail_all(self, err: BaseException) -> None:
        with self._cond:
            reqs = list(self._pending) + self._live + ([self._filling] if self._filling else [])
            self._pending.clear()
            self._live, self._filling = [], None
        for r in reqs:
            r.out.put(err)

    def step(self) -> None:
        """One step: drop cancelled requests, prefill within the token budget, then one decode
        step for every running request."""
        with self._lock, torch.no_grad():
            self._drop_cancelled()
            self._prefill()
            self._decode()

    def _drop_cancelled(self) -> None:
        with self._cond:
            gone = [r for r in self._pending if r.cancelled.is_set()]
            for r in gone:
                self._pending.remove(r)
        gone += [r for r in self._live if r.cancelled.is_set()]
        self._live = [r for r in self._live if not r.cancelled.is_set()]
        if self._filling is not None and self._filling.cancelled.is_set():
            gone.append(self._filling)
            self._filling = None
        for r in gone:
            r.kv = None
            self.counts["cancelled"] += 1

    def _next(self) -> Request | None:
        """The next waiting request, if the batch and the row budget have room for it."""
        with self._cond:
            if not self._pending or len(self._live) + (self._filling is not None) >= self.max_batch:
                return None
            r = self._pending[0]
            if (self._live or self._filling) and self.live_rows + r.rows > self.kv_budget:
                return None  # it waits for rows to be freed: first come, first served
            return self._pending.popleft()

    def _prefill(self) -> None:
        budget = self.prefill_tokens
        while budget > 0:
            req = self._filling or self._next()
            if req is None:
                return
            try:
                if req is self._filling:
                    budget -= self._chunk(req, budget)
                else:
                    budget -= self._first(req)
            except Exception as e:  # noqa: BLE001 - the request's own error (a bad prompt, no room)
                if req is self._filling:
                    self._filling = None
                req.kv = None
                req.out.put(e)

    def _first(self, req: Request) -> int:
        """Prefill a new request (or its first chunk); returns the tokens it computed."""
        if req.t0 is None:
            req.t0 = time.perf_counter()
        res = req.prepare(0)
        self.counts["prefills"] += 1
        req.res = res
        req.next_pos = int(res.position_ids.max()) + 1
        req.kv = RequestKV.from_workspace(self.pc.workspace, len(req.rest) + req.params.max_new_tokens)
        if req.rest:
            self._filling = req
        else:
            self._begin(req, res.logits)
        return res.computed_tokens

    def _chunk(self, req: Request, budget: int) -> int:
        """Prefill the next chunk of ``req``'s new tokens over its own rows."""
        assert req.kv is not None
        ids, req.rest = req.rest[:budget], req.rest[budget:]
        dev = self.pc.adapter.device
        pos = torch.arange(req.next_pos, req.next_pos + len(ids), device=dev)
        cache = req.kv.cache()
        logits = self.pc.adapter.forward(torch.tensor(ids, device=dev), pos, cache, None, None)[-1]
        req.kv.sync(cache)
        req.next_pos += len(ids)
        req.chunked += len(ids)
        self.counts["chunks"] += 1
        if not req.rest:
            self._filling = None
            self._begin(req, logits)
        return len(ids)

    def _begin(self, req: Request, logits: torch.Tensor) -> None:
        """The first token: from the prefill's logits, as in a solo decode."""
        assert req.t0 is not None
        req.seq = self.pc.decoder.start(req.params, logits.shape[-1], req.t0)
        self._emit(req, logits)
        if not req.seq.done:
            self._live.append(req)

    def _emit(self, req: Request, logits: torch.Tensor) -> None:
        assert req.seq is not None and req.res is not None
        delta = req.seq.push(logits)
        if delta:
            req.out.put(delta)
        if req.seq.done:
            req.kv = None
            self.counts["finished"] += 1
            req.out.put(req.seq.output(req.res, req.chunked, req.batch))

    def _decode(self) -> None:
        live = self._live
        if not live:
            return
        B = len(live)
        dev = self.pc.adapter.device
        kvs = [r.kv for r in live]
        assert all(kv is not None for kv in kvs)
        step = RaggedStep([kv.k for kv in kvs], [kv.v for kv in kvs], [kv.length for kv in kvs],  # type: ignore[union-attr]
                          [r.res.calibrated for r in live])  # type: ignore[union-attr]
        like = kvs[0].k[0, None, :, :0]  # type: ignore[union-attr]  # (1, H, 0, D)
        longest = max(step.lengths)
        cache = Cache(layers=[_RaggedLayer(step, i, longest, like) for i in range(kvs[0].k.shape[0])])  # type: ignore[union-attr]
        ids = torch.tensor([r.seq.last for r in live], dtype=torch.long, device=dev)  # type: ignore[union-attr]
        pos = torch.tensor([r.next_pos for r in live], dtype=torch.long, device=dev)
        with ragged(step):
            logits = self.pc.adapter.decode_step(ids, pos, cache)  # (B, vocab)
        if step.calls == 0:
            raise UnsupportedModelError(f"{type(self.pc.model).__name__} does not run its attention through "
                                        "pcache_sdpa: it cannot decode in a batch")
        self.counts["steps"] += 1
        self.counts["decoded"] += B
        self.counts["max_batch_seen"] = max(self.counts["max_batch_seen"], B)
        for b, r in enumerate(live):
            r.kv.length += 1  # type: ignore[union-attr]
            r.next_pos += 1
            r.batch = max(r.batch, B)
            self._emit(r, logits[b])
        self._live = [r for r in live if not r.seq.done]  # type: ignore[union-attr]


def batch_refusal(adapter) -> str:
    """Why a model cannot decode in a batch ('' when it can)."""
    if adapter.family == "alibi":
        return "ALiBi models decode alone: their bias needs each request's key positions"
    if not getattr(adapter, "fast", False):
        return f"{type(adapter.model).__name__} does not run its attention through pcache_sdpa"
    return ""


def first_chunk(sched: Scheduler | None, ids, chunkable: bool) -> tuple[list[int], list[int]]:
    """``ids`` split into what the prefill computes and what later chunks do: a prompt is
    chunked only in a batch, and only where nothing but its new tokens is computed (no
    recompute, no calibration: both see all new tokens at once)."""
    ids = list(ids)
    if sched is None or not chunkable or len(ids) <= sched.prefill_tokens:
        return ids, []
    return ids[: sched.prefill_tokens], ids[sched.prefill_tokens :]


def stream_request(sched: Scheduler, prepare: Callable[[int], PrefillResult], params: SamplingParams,
                   rows: Callable[[], int], rest: list[int]) -> Iterator[str | GenerationOutput]:
    """A stream's items from the batch: the request is submitted at the first item (its TTFT
    counts from there); closing the stream cancels it."""
    req = Request(prepare, params, rows(), rest, t0=time.perf_counter())
    sched.submit(req)
    try:
        for item in req.items():
            if isinstance(item, GenerationOutput) and req.seq is not None:
                req.seq.warn_if_cut(stacklevel=4)  # in the caller's thread, where it can be seen
            yield item
    finally:
        req.cancel()


def run_batch(sched: Scheduler, reqs: list[Request]) -> list[GenerationOutput]:
    """Run ``reqs`` on ``sched`` in this thread; their outputs, in order (an error is raised)."""
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    outs = []
    for r in reqs:
        *_, last = r.items()
        assert isinstance(last, GenerationOutput)
        outs.append(last)
    return outs
