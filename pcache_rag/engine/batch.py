"""The continuous batch's requests and the KV rows they hold: the data the scheduler's policy
(:mod:`.scheduler`) and its step runner (:mod:`.runner`) share.

A :class:`Request` is one answer to compute, from its submission to its output; a
:class:`Batch` is the requests admitted and not finished: those decoding (``live``) and those
whose new tokens are being prefilled (``filling``), each with its own rows
(:class:`~pcache_rag.kv.RequestKV`). The scheduler decides what joins a batch; the runner steps it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..kv import BufferLayer, ModuleKV, RequestKV
from ..models.attention import CalibratedSpan
from .decode import Decoding, SamplingParams
from .types import GenerationOutput, PrefillResult


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


@dataclass(eq=False)
class Batch:
    """The admitted requests: ``live`` (decoding, a token a step) and ``filling`` (their new tokens
    prefilled in the steps), and ``counts`` of what the steps did (steps, sequence-steps decoded,
    prefills, chunks, finished, cancelled, failed, the most sequences in one step)."""

    live: list[Request] = field(default_factory=list)
    filling: list[Request] = field(default_factory=list)
    counts: dict = field(default_factory=lambda: {"steps": 0, "decoded": 0, "prefills": 0, "chunks": 0, "finished": 0,
                                                  "cancelled": 0, "failed": 0, "max_batch_seen": 0})

    def __len__(self) -> int:
        return len(self.live) + len(self.filling)

    @property
    def rows(self) -> int:
        """KV rows the admitted requests hold (prompt and answer each), against the scheduler's budget."""
        return sum(r.rows for r in self.live) + sum(r.rows for r in self.filling)

    def drop(self, req: Request) -> None:
        """``req`` out of the batch, its rows freed."""
        for group in (self.live, self.filling):
            if req in group:
                group.remove(req)
        req.kv, req.rows_view = None, None


__all__ = ["Batch", "Request"]
