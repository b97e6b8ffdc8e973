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
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..kv import BufferLayer, ModuleKV, RequestKV
from ..models import UnsupportedModelError
from ..models.attention import CalibratedSpan, Positions, RaggedStep, ragged
from ..models.fast_decode import decoding as generated_rows
from .decode import Decoding, SamplingParams
from .core import EngineCore
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
    """One answer to compute: either cached ``units`` (states at their positions) and
    ``new_ids`` starting at position ``start``, prefilled in the batch's steps (``span``: its
    calibrated keys), or ``prepare(reserve)``, the engine's own prefill in its workspace.
    ``rows`` is the KV rows it will hold (prompt and answer), for the budget. Items go to
    ``out``: text deltas, then the :class:`GenerationOutput` (or an exception)."""

    params: SamplingParams
    rows: int
    units: list[ModuleKV] = field(default_factory=list)
    new_ids: list[int] = field(default_factory=list)
    start: int = 0
    span: CalibratedSpan | None = None
    prepare: Callable[[int], PrefillResult] | None = None
    t0: float | None = None  # when its wait began; None: when its prefill begins
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)  # for the watchdog (:mod:`.watchdog`)
    # set by the scheduler
    kv: RequestKV | None = None
    seq: Decoding | None = None
    fed: int = 0  # new tokens prefilled so far
    next_pos: int = 0
    counts: tuple[int, int, int] = (0, 0, 0)  # cached, computed, recomputed tokens
    batch: int = 1  # the most sequences it shared a step with
    rows_view: list[BufferLayer] | None = None  # its rows, for the fused step

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
        self.prefill_tokens = int(prefill_tokens)
        s = core.adapter.kv_shape
        per_row = s.bytes_per_token(torch.empty(0, dtype=core.adapter.dtype).element_size())
        self.kv_budget = int(kv_budget) if kv_budget is not None else max(
            DEFAULT_KV_BUDGET_BYTES // per_row, core.max_positions + 1024)
        self._pending: deque[Request] = deque()
        self._live: list[Request] = []
        self._filling: list[Request] = []  # requests whose new tokens are being prefilled
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.counts = {"steps": 0, "decoded": 0, "prefills": 0, "chunks": 0, "finished": 0, "cancelled": 0,
                       "failed": 0, "max_batch_seen": 0}
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
            return list(self._pending) + list(self._filling) + list(self._live)

    @property
    def live_rows(self) -> int:
        return sum(r.rows for r in self._live) + sum(r.rows for r in self._filling)

    def stats(self) -> dict:
        """Live and waiting requests, rows held against the budget, the counters (steps, sequence-steps
        decoded, prefills, chunks, requests stalled); ``mean_batch`` = decoded / steps; ``busy_s``: in steps."""
        steps = self.counts["steps"]
        return {"live": len(self._live) + len(self._filling), "waiting": len(self._pending),
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
        return bool(self._pending or self._live or self._filling)

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
            reqs = list(self._pending) + self._live + self._filling
            self._pending.clear()
            self._live, self._filling = [], []
        for r in reqs:
            r.out.put(err)

    def step(self) -> None:
        """One step: drop cancelled requests, admit waiting ones, then one forward for the
        running requests' next tokens and the prompts being prefilled."""
        with self._lock, torch.no_grad():
            t0 = time.perf_counter()
            self._drop_cancelled()
            self._admit()
            self._forward()
            self.busy_s += time.perf_counter() - t0
        self.stepped = time.monotonic()

    def _drop_cancelled(self) -> None:
        with self._cond:
            gone = [r for r in self._pending if r.cancelled.is_set()]
            for r in gone:
                self._pending.remove(r)
        gone += [r for r in self._live + self._filling if r.cancelled.is_set()]
        self._live = [r for r in self._live if not r.cancelled.is_set()]
        self._filling = [r for r in self._filling if not r.cancelled.is_set()]
        for r in gone:
            r.kv, r.rows_view = None, None
            self.counts["cancelled"] += 1

    def _next(self) -> Request | None:
        """The next waiting request, if the batch and the row budget have room for it."""
        with self._cond:
            if not self._pending or len(self._live) + len(self._filling) >= self.max_batch:
                return None
            r = self._pending[0]
            if (self._live or self._filling) and self.live_rows + r.rows > self.kv_budget:
                return None  # it waits for rows to be freed: first come, first served
            return self._pending.popleft()

    def _admit(self) -> None:
        """Take waiting requests in: cached units copied into their own rows (their new tokens
        are prefilled by the steps), or the engine's own prefill for the others (within the
        step's token budget)."""
        budget = self.prefill_tokens
        while budget > 0:
            req = self._next()
            if req is None:
                return
            if req.t0 is None:
                req.t0 = time.perf_counter()
            try:
                if req.prepare is None:
                    req.kv = RequestKV.assemble(req.units, len(req.new_ids) + req.params.max_new_tokens,
                                                self.core.workspace.shape, self.core.adapter.dtype, self.core.adapter.device)
                    req.units = []  # the rows hold them now
                    req.next_pos = req.start
                    req.counts = (req.kv.length, len(req.new_ids), 0)
                    self._filling.append(req)
                    continue
                res = req.prepare(0)
                budget -= res.computed_tokens
                self.counts["prefills"] += 1
                req.next_pos = int(res.position_ids.max()) + 1
                req.span = res.calibrated
                req.counts = (res.cached_tokens, res.computed_tokens, res.recomputed_tokens)
                # The first token is sampled (and streams) before the request's rows are copied out
                # of the workspace: that copy (every cached row, ~80 MB at 1,700 float32 tokens on
                # the embedded model) is the decode's cost, not the time to the first token.
                self._begin(req, res.logits)
                if not req.seq.done:  # type: ignore[union-attr]
                    req.kv = RequestKV.from_workspace(self.core.workspace, req.params.max_new_tokens,
                                                      res.position_ids)
            except Exception as e:  # noqa: BLE001 - the request's own error (a bad prompt, no room)
                if req in self._live:
                    self._live.remove(req)
                req.kv = None
                req.out.put(e)

    def _forward(self) -> None:
        """One forward: a token of each running request, and the next chunks of the prompts
        being prefilled (at most ``prefill_tokens`` of them, oldest first). A request decoding
        alone (nothing else live or filling, no calibrated span) takes the fused decode step, as
        it would outside the batch; several decoding together (nothing filling) take its
        many-sequence form on the C kernels, each to the same bits as alone."""
        step = self.core.decoder.step
        if step is not None and self._live and not self._filling and all(r.span is None for r in self._live) \
                and (len(self._live) == 1 or step.kernels == "c"):
            self._fused(self._live)
            return
        seqs: list[tuple[Request, list[int]]] = [(r, [r.seq.last]) for r in self._live]  # type: ignore[union-attr]
        budget = self.prefill_tokens
        for r in self._filling:
            if budget <= 0:
                break
            chunk = r.new_ids[r.fed : r.fed + budget]
            seqs.append((r, chunk))
            budget -= len(chunk)
        if not seqs:
            return
        logits = ragged_forward(self.core, seqs, len(self._live))  # (B, vocab)
        B = len(seqs)
        decoding = len(self._live)
        self.counts["steps"] += 1
        self.counts["decoded"] += decoding
        self.counts["chunks"] += B - decoding
        self.counts["max_batch_seen"] = max(self.counts["max_batch_seen"], B)
        for b, (r, chunk) in enumerate(seqs):
            r.kv.length += len(chunk)  # type: ignore[union-attr]
            r.next_pos += len(chunk)
            r.batch = max(r.batch, B)
            if b < decoding:
                self._emit(r, logits[b])
                continue
            r.fed += len(chunk)
            if r.fed == len(r.new_ids):  # its prompt is in: the first token, as in a solo prefill
                r.new_ids = []
                self._filling.remove(r)
                self._begin(r, logits[b])

    def _fused(self, reqs: list[Request]) -> None:
        """One token of each running request through the engine's fused decode step."""
        logits = fused_forward(self.core, reqs)  # (B, vocab)
        self.counts["steps"] += 1
        self.counts["decoded"] += len(reqs)
        self.counts["max_batch_seen"] = max(self.counts["max_batch_seen"], len(reqs))
        for r, row in zip(list(reqs), logits):
            r.kv.length = r.rows_view[0].length  # type: ignore[union-attr,index]
            r.next_pos += 1
            r.batch = max(r.batch, len(reqs))
            self._emit(r, row)

    def _begin(self, req: Request, logits: torch.Tensor) -> None:
        """The first token, from the prefill's logits; then it decodes with the others."""
        assert req.t0 is not None
        try:
            req.seq = self.core.decoder.start(req.params, logits.shape[-1], req.t0)
        except Exception as e:  # noqa: BLE001 - its own parameters (a grammar that will not compile)
            self._fail(req, e)
            return
        if self._emit(req, logits) and not req.seq.done:
            self._live.append(req)

    def _fail(self, req: Request, err: BaseException) -> None:
        """End ``req`` alone with ``err`` (its grammar, its sampling, a callback of its own): its
        rows are freed and the other requests of the batch go on as if it had never joined."""
        log.warning("a request in the batch failed alone: %s: %s", type(err).__name__, str(err)[:200])
        for group in (self._live, self._filling):
            if req in group:
                group.remove(req)
        req.kv, req.rows_view = None, None
        self.counts["failed"] += 1
        req.out.put(err)

    def _emit(self, req: Request, logits: torch.Tensor) -> bool:
        """Take ``req``'s next token from ``logits`` and send what it adds; False if that failed
        (the request has then ended alone, with its error)."""
        assert req.seq is not None
        try:
            delta = req.seq.push(logits)
        except Exception as e:  # noqa: BLE001 - this request's fault, not the batch's
            self._fail(req, e)
            return False
        if delta:
            req.out.put(delta)
        if req.seq.done:  # out of the batch before its output is seen, so stats() never lag it
            if req in self._live:
                self._live.remove(req)
            req.kv, req.rows_view = None, None
            self.counts["finished"] += 1
            req.out.put(req.seq.output(*req.counts, decode_batch=req.batch))
        return True


def fused_forward(core: EngineCore, reqs: list[Request]) -> torch.Tensor:
    """One token of each of ``reqs`` (each decoding, with its rows) through the engine's fused
    decode step: its one-token form for a request alone, else its many-sequence form; the
    logits (B, vocab). Each request's rows move on by one token."""
    for r in reqs:
        assert r.kv is not None and r.seq is not None
        if r.rows_view is None:
            r.rows_view = r.kv.buffer_layers()
        if r.rows_view[0].length != r.kv.length:  # the batch moved it on
            for layer in r.rows_view:
                layer.set_length(r.kv.length)
    step = core.decoder.step
    assert step is not None
    if len(reqs) == 1:
        return step(reqs[0].seq.last, reqs[0].next_pos, reqs[0].rows_view)[None]  # type: ignore[union-attr]
    return step.many([r.seq.last for r in reqs], [r.next_pos for r in reqs],  # type: ignore[union-attr]
                     [r.rows_view for r in reqs])


def ragged_forward(core: EngineCore, seqs: list, decoding: int) -> torch.Tensor:
    """One forward of the model over ``seqs`` (``(request, token ids)`` each: the first ``decoding``
    a generated token, the rest a chunk of a prompt), each over its own rows (:class:`RaggedStep`);
    the logits (B, vocab) at each sequence's last token."""
    dev = core.adapter.device
    kvs = [r.kv for r, _ in seqs]
    step = RaggedStep([kv.k for kv in kvs], [kv.v for kv in kvs], [kv.length for kv in kvs],  # type: ignore[union-attr]
                      [len(ids) for _, ids in seqs], [r.span for r, _ in seqs])
    if core.adapter.window is not None:  # each sequence's window, over its own rows' positions
        step.positions = []
        for r, chunk in seqs:
            kv = r.kv
            assert kv is not None
            n, c = kv.length, len(chunk)
            kv.pos[n : n + c] = torch.arange(r.next_pos, r.next_pos + c, device=kv.pos.device)
            step.positions.append(Positions.of(kv.pos[n : n + c], kv.pos[: n + c]))
    like = kvs[0].k[0, None, :, :0]  # type: ignore[union-attr]  # (1, H, 0, D)
    longest = max(n + c for n, c in zip(step.lengths, step.counts))
    n_layers = kvs[0].k.shape[0]  # type: ignore[union-attr]
    cache = Cache(layers=[_RaggedLayer(step, i, longest, like) for i in range(n_layers)])
    ids = torch.tensor([t for _, chunk in seqs for t in chunk], dtype=torch.long, device=dev)  # (N,)
    pos = torch.tensor([p for r, chunk in seqs for p in range(r.next_pos, r.next_pos + len(chunk))],
                       dtype=torch.long, device=dev)
    ends = torch.tensor(list(itertools.accumulate(step.counts)), dtype=torch.long, device=dev) - 1
    with ragged(step), generated_rows(decoding):  # the generated tokens lead: the decode weights, if any
        logits = core.adapter.forward(ids, pos, cache, None, None, logits_to_keep=ends)  # (B, vocab)
    if step.calls == 0:
        raise UnsupportedModelError(f"{type(core.model).__name__} does not run its attention through "
                                    "pcache_sdpa: it cannot decode in a batch")
    return logits


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
