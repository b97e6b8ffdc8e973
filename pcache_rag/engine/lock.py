"""The engine's lock: one call at a time over the shared workspace."""

from __future__ import annotations

import threading


class EngineLock:
    """Serializes engine calls. Unlike an ``RLock`` it may be released by another thread:
    a stream started in one thread and resumed in others (``asyncio.to_thread(next, it)``)
    releases it wherever it finishes. A thread that calls the engine while its own
    stream is still open gets an error instead of a deadlock or a clobbered workspace."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        #: threads waiting for the lock (the batch scheduler steps aside for them between steps)
        self.waiting = 0
        self._count = threading.Lock()

    def __enter__(self) -> EngineLock:
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError(
                "PromptCache is busy in this thread: finish (or close) the running stream before another call"
            )
        if not self._lock.acquire(blocking=False):
            with self._count:
                self.waiting += 1
            try:
                self._lock.acquire()
            finally:
                with self._count:
                    self.waiting -= 1
        self._owner = me
        return self

    def __exit__(self, *exc: object) -> None:
        self._owner = None
        self._lock.release()
