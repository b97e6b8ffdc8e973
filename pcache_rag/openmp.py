"""What ``import pcache_rag`` sets for OpenMP before torch loads it: a short idle spin.

GNU OpenMP (bundled with the PyTorch wheels) reads ``GOMP_SPINCOUNT`` once, when torch loads it.
Its default lets a worker that reaches a barrier spin for about 3 ms. On a machine with other
busy processes, that spinning spends this process's CPU share while the worker it waits for is
descheduled: a 300-token prefill of the embedded model on 2 cores beside two busy processes took
2.4 s at the default and 1.7 s at 1,000 spins (~10 us), with no measurable cost quiet
(``scripts/measure-prefill-load.py``; docs/runs/2026-12-06-prefill-under-load.md). This module is
imported by ``pcache_rag/__init__.py`` and imports nothing heavy, so it runs before torch when a
program imports pcache_rag first. A value the user set (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``)
is kept. :func:`pcache_rag.engine.threads.check_spin` warns, once, where torch came first.
"""

from __future__ import annotations

import os
import sys

SPIN = "1000"


def _set_short_spin() -> str:
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return "user"
    if "torch" in sys.modules:
        return "too late"
    os.environ["GOMP_SPINCOUNT"] = SPIN
    return "pcache_rag"


#: how this process's spin count was decided: "pcache_rag" (set here), "user" (the environment
#: named one) or "too late" (torch was imported before pcache_rag; libgomp's default stands)
SPIN_SET_BY = _set_short_spin()
