"""The continuous batch's watchdog: a request that cannot move is failed and its place freed.

Rows of one batch move together: every step decodes a token of each running request and
feeds the prompts being prefilled, oldest first. A single row cannot stall while the batch
steps, so the watchdog watches the batch: when no step has ended for ``stall_s`` seconds
(a step wedged inside a kernel or a grammar, the engine held by another caller), every
request that has waited that long (running, prefilling or queued) ends with
:class:`~.types.StalledError`. Its caller gets the error at once and its slot upstream (a
server's answering place) is freed; the batch drops its rows at its next step, if one comes.
A request waiting for room while the batch steps is queued, not stalled, and is left alone.

It runs in a thread of its own because the thread it watches may be the one that is stuck.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from .types import StalledError

log = logging.getLogger(__name__)

#: seconds without a batch step before the requests waiting on it are failed. Long enough for
#: the longest single step this project takes (a full 8K-token prompt prefilled in one step,
#: ~30 s on two cores, twice that on a busy machine), short enough that a wedged answer frees
#: its client within two minutes
DEFAULT_STALL_S = 120.0


class Watched(Protocol):
    """What the watchdog reads of a :class:`~.scheduler.Scheduler` (named here: the scheduler imports this module)."""

    stepped: float  # time.monotonic() when its last step ended

    def requests(self) -> list[Any]: ...  # its unfinished requests (``arrived``, ``cancelled``, ``out``)


class Watchdog:
    """Fails the requests of ``sched`` that waited ``stall_s`` seconds on a batch that made no
    step in that time; :meth:`check` does one pass (the thread calls it every ``stall_s / 4``
    seconds, at most every second)."""

    def __init__(self, sched: Watched, stall_s: float) -> None:
        if stall_s <= 0:
            raise ValueError("stall_s must be positive")
        self.sched = sched
        self.stall_s = float(stall_s)
        self.failed = 0  # requests this watchdog ended
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pcache-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        every = min(1.0, self.stall_s / 4)
        while not self._stop.wait(every):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watchdog outlives one bad pass
                log.exception("the batch watchdog's check failed")

    def check(self, now: float | None = None) -> int:
        """Fail what has stalled; how many requests were failed."""
        now = time.monotonic() if now is None else now
        quiet = now - self.sched.stepped
        if quiet <= self.stall_s:
            return 0
        stalled = [r for r in self.sched.requests() if now - r.arrived > self.stall_s and not r.cancelled.is_set()]
        for r in stalled:
            waited = now - max(r.arrived, self.sched.stepped)
            r.cancel()  # the batch drops its rows at its next step
            r.out.put(StalledError(f"the answer made no progress for {waited:.0f} s (the batch's stall limit is "
                                   f"{self.stall_s:g} s): it was stopped and its place freed"))
        if stalled:
            self.failed += len(stalled)
            log.warning("the batch made no step for %.0f s: %d waiting request(s) failed and freed", quiet,
                        len(stalled))
        return len(stalled)
