"""Prefill of the embedded model quiet and beside busy processes, per OpenMP spin setting, in one run.

Each setting runs in a fresh interpreter, since GNU OpenMP reads ``GOMP_SPINCOUNT`` and
``OMP_WAIT_POLICY`` once, when torch loads it: ``300000`` (libgomp's own default, ~3 ms of
spinning at a barrier), ``1000`` (what ``import pcache_rag`` sets before torch), and
``OMP_WAIT_POLICY=PASSIVE`` (no spinning). Each times a full forward of random prompts of
64, 300 and 1,000 tokens (median of 5 after a warm-up) at 1 and 2 torch threads, quiet and
beside ``--busy`` single-threaded busy-loop processes (bench decode's).

    .venv/bin/python scripts/measure-prefill-load.py [--busy 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"GOMP_SPINCOUNT=300000 (libgomp's default)": {"GOMP_SPINCOUNT": "300000"},
            "GOMP_SPINCOUNT=1000 (pcache_rag's)": {"GOMP_SPINCOUNT": "1000"},
            "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}}

CHILD = r"""
import json, statistics, sys, time
import torch
from pcache_rag.default_model import load_model
from pcache_rag.measure.decode_bench import busy_processes
model, tok = load_model()[:2]
busy = int(sys.argv[1])
torch.manual_seed(0)
rows = {}
with busy_processes(busy), torch.no_grad():
    for n in (64, 300, 1000):
        ids = torch.randint(100, 20000, (1, n))
        for th in (1, 2):
            torch.set_num_threads(th)
            model(ids)
            xs = []
            for _ in range(5):
                t0 = time.perf_counter(); model(ids); xs.append(time.perf_counter() - t0)
            rows[f"{n} tokens, {th} threads"] = round(statistics.median(xs) * 1e3, 1)
print("ROWS", json.dumps(rows))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out: dict = {}
    for name, env in SETTINGS.items():
        for busy in (0, a.busy):
            p = subprocess.run([sys.executable, "-c", CHILD, str(busy)], env={**base, **env}, cwd=ROOT,
                               capture_output=True, text=True, check=True)
            rows = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("ROWS "))[5:])
            out.setdefault(name, {})[f"busy={busy}"] = rows
            print(f"{name}, busy={busy}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in rows.items()), flush=True)
    print("\nms a prefill (quiet / busy):")
    keys = list(next(iter(out.values()))["busy=0"])
    print(f"{'':<42}" + "".join(f"{k:>26}" for k in keys))
    for name, r in out.items():
        print(f"{name:<42}" + "".join(f"{r['busy=0'][k]:>12.0f} / {r[f'busy={a.busy}'][k]:<11.0f}" for k in keys))
    if a.json:
        a.json.write_text(json.dumps({"busy": a.busy, "rows": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
