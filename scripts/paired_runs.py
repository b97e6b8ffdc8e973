"""Two eval checkpoints of the same questions (same config but the decode weights) side by side,
mode by mode: accuracy with its 95% Wilson interval, the exact McNemar p of the paired answers,
the share of answers identical, and each one's agreement with the first run's full prefill.

    python scripts/paired_runs.py BASE.json OTHER.json [--mode MODE]
"""

from __future__ import annotations

import argparse
import json

from pcache_rag.measure.quality import mcnemar_p, wilson

KEYS = ("n_per_set", "doc_tokens", "k", "max_new_tokens", "seed", "split", "model", "prefix")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("other")
    ap.add_argument("--mode", default="cond:learned+match:1")
    a = ap.parse_args()
    base, other = (json.load(open(p)) for p in (a.base, a.other))
    diff = [k for k in KEYS if base["config"].get(k) != other["config"].get(k)]
    if diff:
        raise SystemExit(f"the runs differ in {diff}: their questions are not the same")
    print(f"| set | n | {a.base.split('/')[-1]} | {a.other.split('/')[-1]} | McNemar p | same answer "
          "| agrees with full (base) | agrees with full (other) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for s, modes in other["records"].items():
        o = modes[a.mode]
        b = base["records"][s][a.mode]
        n = min(len(o["correct"]), len(b["correct"]))
        bc, oc = b["correct"][:n], o["correct"][:n]
        same = sum(x == y for x, y in zip(b["answers"][:n], o["answers"][:n])) / n
        full = base["records"][s].get("full")
        agree = ["", ""]
        if full is not None:
            fa = full["answers"][:n]
            agree = [f"{sum(x == y for x, y in zip(fa, r['answers'][:n])) / n:.0%}" for r in (b, o)]
        cells = []
        for c in (bc, oc):
            lo, hi = wilson(sum(c), n)
            cells.append(f"{sum(c) / n:.0%} [{lo:.0%}, {hi:.0%}]")
        print(f"| {s} | {n} | {cells[0]} | {cells[1]} | {mcnemar_p(bc, oc):.2f} | {same:.0%} | {agree[0]} | {agree[1]} |")


if __name__ == "__main__":
    main()
