"""The default test suite quiet and beside busy processes, in one run: its wall time and counts.

Runs CI's pytest command (``python -m pytest -q -p no:cacheprovider``, without the lint that
``make test`` runs first) once quiet and once beside ``--busy`` single-threaded busy-loop
processes (the same ones ``bench decode --busy`` starts), and prints both times, their ratio and
pytest's summary line of each. Takes the suite's time twice over and more: ~10 min quiet on this
project's 2-core machine.

    .venv/bin/python scripts/measure-suite-load.py [--busy 2] [--json out.json] [-- pytest args]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pcache_rag.measure.decode_bench import busy_processes, cpu_line  # noqa: E402


def run_suite(extra: list[str]) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra], cwd=ROOT,
                         capture_output=True, text=True)
    took = time.perf_counter() - t0
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    failed = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]  # pytest's short summary
    return took, "\n".join(failed + lines[-1:]) if lines else out.stderr[-500:], out.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("pytest_args", nargs="*")
    a = ap.parse_args()
    print(cpu_line(), f"| cpus {os.cpu_count()} | load {os.getloadavg()[0]:.2f}", flush=True)
    rows = {}
    for busy in (0, a.busy):
        with busy_processes(busy):
            took, summary, rc = run_suite(a.pytest_args)
        rows[f"busy={busy}"] = {"seconds": round(took, 1), "summary": summary, "returncode": rc}
        print(f"busy={busy}: {took:.1f} s, rc {rc}: {summary}", flush=True)
    ratio = rows[f"busy={a.busy}"]["seconds"] / rows["busy=0"]["seconds"]
    print(f"busy / quiet: {ratio:.2f}x")
    if a.json:
        a.json.write_text(json.dumps({"cpu": cpu_line(), "rows": rows, "ratio": round(ratio, 2)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
