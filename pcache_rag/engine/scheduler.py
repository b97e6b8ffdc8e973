"""Continuous batching: requests join and leave a running batch at token boundaries.

Each request owns its KV rows (:class:`~pcache_rag.kv.RequestKV`: its cached units copied
in, then its new tokens and its answer), so requests with different documents, lengths and
positions run together. Each step is one forward over a flattened query: one token of
every request that decodes, plus chunks of the prompts being prefilled, up to a token
budget (chunked prefill: a long prompt cannot stall the streams already running). Every
sequence attends to its own rows only (:class:`~pcache_rag.models.attention.RaggedStep`);
the projections and MLPs run over all tokens at once. Decoding on a CPU is bound by
reading the weights, which the step reads once for everyone. While no prompt is being
prefilled, the running requests' tokens take the engine's fused decode step instead
(:meth:`~pcache_rag.models.decode_step.FusedDecodeStep.many` on the C kernels, or its one-token
form for a request alone): the weights are still read once a step, and every request's logits
are the bits it would get decoding alone.

A prompt that needs more than its new tokens computed over its cache (recomputed context
rows, PML parameters) is prefilled by the engine's own prefill in the workspace, then its
rows are copied out and it decodes in the batch like the others. Memory is bounded by a
budget on live KV rows: a request that would exceed it waits until others finish; none is
stopped mid-answer.

Requests reach it through :meth:`PromptCache.start_batching` (every stream of the engine
then goes through one scheduler thread) or through :meth:`PromptCache.generate_batch`
(a private scheduler driven in the caller's thread).

Three parts: this module is the policy (:class:`Scheduler`: the queue, admission in arrival
order within the row budget and the step's prefill budget, cancellation, the thread, the
watchdog); :mod:`.batch` holds the admitted requests and their KV rows; :mod:`.runner`
executes one step for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from .batch import Batch, Request
from .core import EngineCore
from .decode import SamplingParams
from .runner import StepRunner
from .threads import release_pool
from .types import ContextOverflowError, GenerationOutput, PrefillResult
from .watchdog import DEFAULT_STALL_S, Watchdog

log = logging.getLogger(__name__)

#: new tokens prefilled per scheduler step, across requests (a longer prompt is chunked). On the
#: project's 2-core CPU, 16 questions arriving at once (~18 new tokens each over ~850 cached
#: ones) got TTFT p50 1.7 s with 512 against 2.6 s with 128; the price is one longer pause of
#: the running streams while a burst is prefilled (see scripts/measure-load.py's gap figure)
DEFAULT_PREFILL_TOKENS = 512
#: the most requests decoding together
DEFAULT_MAX_BATCH = 16
#: live KV rows (prompt and answer tokens of every admitted request), unless told otherwise
DEFAULT_KV_BUDGET_BYTES = 4 << 30


class Scheduler:
    """Runs requests on one engine's :class:`~.core.EngineCore` as one continuous batch.

    ``max_batch``: the most requests decoding together. ``prefill_tokens``: new tokens
    prefilled per step (a prompt with more is chunked). ``kv_budget``: live KV rows (default:
    4 GiB of states in the model's dtype, and at least one full context). ``stall_s``: with the
    batch in its own thread, requests that waited that long on a batch that made no step end
    with :class:`~.types.StalledError` (:mod:`.watchdog`; None: never).
    :meth:`start` runs it in a thread of its own; :meth:`run_until_idle` drives it in the
    caller's. Each step holds the engine's lock, and lets other callers of the engine in
    between steps."""

    def __init__(self, core: EngineCore, max_batch: int = DEFAULT_MAX_BATCH,
                 prefill_tokens: int = DEFAULT_PREFILL_TOKENS, kv_budget: int | None = None,
                 stall_s: float | None = DEFAULT_STALL_S) -> None:
        if max_batch < 1 or prefill_tokens < 1:
            raise ValueError("max_batch and prefill_tokens must be at least 1")
        self.core = core
        self._lock = core.lock  # the engine's: one step at a time over its workspace
        self.max_batch = int(max_batch)
        s = core.adapter.kv_shape
        per_row = s.bytes_per_token(torch.empty(0, dtype=core.adapter.dtype).element_size())
        self.kv_budget = int(kv_budget) if kv_budget is not None else max(
            DEFAULT_KV_BUDGET_BYTES // per_row, core.max_positions + 1024)
        self._pending: deque[Request] = deque()
        self.batch = Batch()  # the admitted requests and their rows
        self.counts = self.batch.counts  # what the steps did (the runner counts them)
        self.runner = StepRunner(core, int(prefill_tokens))  # it holds the step's prefill budget
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.busy_s = 0.0  # seconds spent in steps
        self.stepped = time.monotonic()  # when the last step ended (or the batch went idle)
        self.watchdog = Watchdog(self, stall_s) if stall_s is not None else None

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

    def requests(self) -> list[Request]:
        """Every request submitted and not yet finished (a copy: waiting, prefilling, decoding)."""
        with self._cond:
            return list(self._pending) + list(self.batch.filling) + list(self.batch.live)

    @property
    def prefill_tokens(self) -> int:
        """New tokens prefilled a step, across requests (the runner's budget; admission spends it too)."""
        return self.runner.prefill_tokens

    @property
    def live_rows(self) -> int:
        return self.batch.rows

    def stats(self) -> dict:
        """Live and waiting requests, rows held against the budget, the counters (steps, sequence-steps
        decoded, prefills, chunks, requests stalled); ``mean_batch`` = decoded / steps; ``busy_s``: in steps."""
        steps = self.counts["steps"]
        return {"live": len(self.batch.live) + len(self.batch.filling), "waiting": len(self._pending),
                "live_rows": self.live_rows, "kv_budget": self.kv_budget, "max_batch": self.max_batch,
                "prefill_tokens": self.prefill_tokens, **self.counts, "busy_s": round(self.busy_s, 3),
                "mean_batch": round(self.counts["decoded"] / steps, 2) if steps else 0.0,
                "stalled": self.watchdog.failed if self.watchdog else 0}

    # ------------------------------------------------------------------ running

    def start(self) -> None:
        """Run in a daemon thread (and the watchdog in another) until :meth:`stop`. The calling thread
        hands back its OpenMP pool, so the batch's thread keeps the only one (:mod:`.threads`)."""
        release_pool()
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="pcache-batch", daemon=True)
            self._thread.start()
            if self.watchdog is not None:
                self.watchdog.start()

    @property
    def alive(self) -> bool:
        """Whether the batch's thread runs (False before :meth:`start` and after it died)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; waiting and running requests get an error."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._fail_all(RuntimeError("the batch scheduler stopped"))

    def run_until_idle(self) -> None:
        """Drive the scheduler in this thread until nothing is waiting or running."""
        while self._busy():
            self.step()

    def _busy(self) -> bool:
        return bool(self._pending or self.batch.live or self.batch.filling)

    def _loop(self) -> None:
        lock = self._lock
        while True:
            with self._cond:
                while not self._busy() and not self._stopping:
                    self._cond.wait()
                    self.stepped = time.monotonic()  # idle is not stalled
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
            reqs = list(self._pending) + self.batch.live + self.batch.filling
            self._pending.clear()
            self.batch.live, self.batch.filling = [], []
        for r in reqs:
            r.out.put(err)

    def step(self) -> None:
        """One step: drop cancelled requests, admit waiting ones, then one forward for the
        running requests' next tokens and the prompts being prefilled."""
        with self._lock, torch.no_grad():
            t0 = time.perf_counter()
            self._drop_cancelled()
            self._admit()
            self.runner.forward(self.batch)
            self.busy_s += time.perf_counter() - t0
        self.stepped = time.monotonic()

    def _drop_cancelled(self) -> None:
        with self._cond:
            gone = [r for r in self._pending if r.cancelled.is_set()]
            for r in gone:
                self._pending.remove(r)
        gone += [r for r in self.batch.live + self.batch.filling if r.cancelled.is_set()]
        self.batch.live = [r for r in self.batch.live if not r.cancelled.is_set()]
        self.batch.filling = [r for r in self.batch.filling if not r.cancelled.is_set()]
        for r in gone:
            r.kv, r.rows_view = None, None
            self.counts["cancelled"] += 1

    def _next(self) -> Request | None:
        """The next waiting request, if the batch and the row budget have room for it."""
        with self._cond:
            if not self._pending or len(self.batch.live) + len(self.batch.filling) >= self.max_batch:
                return None
            r = self._pending[0]
            if (self.batch.live or self.batch.filling) and self.live_rows + r.rows > self.kv_budget:
                return None  # it waits for rows to be freed: first come, first served
            return self._pending.popleft()

    def _admit(self) -> None:
        """Take waiting requests in, first come first served, while the step's prefill budget lasts."""
        budget = self.prefill_tokens
        while budget > 0:
            req = self._next()
            if req is None:
                return
            budget -= self.runner.admit(self.batch, req)


def stream_request(sched: Scheduler, make: Callable[[], Request]) -> Iterator[str | GenerationOutput]:
    """A stream's items from the batch: the request is made and submitted at the first item
    (its TTFT counts from there); closing the stream cancels it. The stream's thread then only
    waits, so it hands back any OpenMP pool that making the request built (:mod:`.threads`)."""
    req = make()
    req.t0 = time.perf_counter()
    sched.submit(req)
    release_pool()
    try:
        for item in req.items():
            if isinstance(item, GenerationOutput) and req.seq is not None:
                req.seq.warn_if_cut(stacklevel=4)  # in the caller's thread, where it can be seen
            yield item
    finally:
        req.cancel()


def parts_request(core: EngineCore, parts, new_ids: list[int], params: SamplingParams,
                  prepare: Callable[[int], PrefillResult], direct: bool, calibration=None) -> Request:
    """The batch request for cached ``parts`` (label, states) and ``new_ids`` on ``core``:
    with ``direct``, its new tokens are prefilled in the batch's steps over its own rows (with
    ``calibration`` on the parts after the first); otherwise (recomputed rows) ``prepare`` is
    the engine's prefill."""
    rows = sum(kv.length for _, kv in parts) + len(new_ids) + params.max_new_tokens  # cache, prompt, answer
    if not direct or not new_ids:
        return Request(params, rows, prepare=prepare)
    kvs = [kv for _, kv in parts]
    start = max((int(kv.position_ids[-1]) + 1 for kv in kvs), default=0)
    if start + len(new_ids) > core.max_positions:
        raise ContextOverflowError(f"the prompt needs {start + len(new_ids)} positions; the model takes "
                                   f"{core.max_positions}")
    span = core.prefiller.calibrated_span(kvs, calibration, False, None)
    return Request(params, rows, kvs, list(new_ids), start, span)


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
