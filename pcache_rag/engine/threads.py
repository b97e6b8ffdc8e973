"""One OpenMP thread pool at a time: threads that wait hand theirs back.

PyTorch's CPU kernels run on OpenMP, and the PyTorch wheels bundle GNU OpenMP (libgomp).
libgomp keeps a pool of worker threads for every thread that ever ran a parallel region,
and while the process holds more pooled threads than it has CPUs it throttles spinning:
each parallel region then wakes its workers from sleep. A server has many threads (the
model is loaded on the main one, questions are retrieved and planned on a worker), so the
batch's steps pay that wake-up on every kernel. Measured on this project's 2-core machine:
a (16, 576) x (576, 1536) product took 295 us when one thread had a pool and 420 us once a
second one had; a one-token attention call 19 us against 72 us; the same 16 answers in
continuous batching took 3.4 s with the scheduler alone and 6.1 s in a thread of its own
beside the main thread's idle pool.

:func:`release_pool` frees the calling thread's pool (OpenMP 5's ``omp_pause_resource_all``
with ``omp_pause_soft``; the next parallel region of that thread builds a new one), so the
thread that decodes keeps the only pool while the others wait. It is called by the thread
that starts the batch and by the threads that prepare requests, after their part. Written
here with ctypes because neither PyTorch nor the standard library exposes the call; where
PyTorch does not run on a bundled libgomp (Intel or LLVM OpenMP, macOS), it does nothing.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import threading

log = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t in libgomp's omp.h
_lock = threading.Lock()
_pause = None  # the bound omp_pause_resource_all, once found
_looked = False


def _find():
    """``omp_pause_resource_all`` of the libgomp that PyTorch loaded, or None."""
    global _pause, _looked
    if _looked:  # every request asks: no lock once the answer is known
        return _pause
    with _lock:
        if _looked:
            return _pause
        _looked = True
        import torch

        if "OpenMP" not in torch.__config__.parallel_info():
            return None
        for path in sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))):
            try:
                fn = ctypes.CDLL(path).omp_pause_resource_all  # the copy already loaded: same handle
            except (OSError, AttributeError) as e:
                log.debug("cannot bind omp_pause_resource_all in %s: %s", path, e)
                continue
            fn.argtypes = [ctypes.c_int]
            fn.restype = ctypes.c_int
            _pause = fn
            break
        return _pause


def release_pool() -> bool:
    """Free the calling thread's OpenMP worker pool; True if there was a runtime to ask."""
    fn = _find()
    if fn is None:
        return False
    return fn(_OMP_PAUSE_SOFT) == 0


def has_pool_release() -> bool:
    """Whether :func:`release_pool` can act in this process (PyTorch on a bundled libgomp)."""
    return _find() is not None


_spin_warned = False


def check_spin() -> str:
    """How this process's OpenMP spin count was decided; warns once when it is libgomp's long default.

    ``import pcache_rag`` before torch sets ``GOMP_SPINCOUNT=1000`` (:mod:`pcache_rag.openmp`);
    when torch was imported first nothing can change it any more, and prefill beside busy processes
    runs up to ~1.4x slower. Setting ``GOMP_SPINCOUNT`` (any value) yourself silences the warning.
    """
    global _spin_warned
    from ..openmp import SPIN_SET_BY as how
    if how == "too late" and not _spin_warned and has_pool_release():
        _spin_warned = True
        log.warning("torch was imported before pcache_rag, so OpenMP workers keep libgomp's default spin "
                    "(~3 ms at every barrier), which slows prefill on a machine with other busy processes; "
                    "import pcache_rag first or set GOMP_SPINCOUNT=1000 in the environment")
    return how
