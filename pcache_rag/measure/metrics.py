"""Timing helpers every benchmark shares: a median of repeated runs, a cold page cache."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median(fn: Callable[[], object], repeats: int) -> float:
    """The median wall time in seconds of ``repeats`` calls of ``fn``."""
    xs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs)


def drop_page_cache(directory) -> None:
    """Ask the kernel to forget cached pages of every file under ``directory`` (no root needed)."""
    import os
    from pathlib import Path

    for f in Path(directory).rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd) if os.access(f, os.W_OK) else None
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
