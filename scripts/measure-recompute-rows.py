"""How many context rows each recompute policy reads again, question by question, on the look-alike
set's retrieved prompts (no forward: the policies' choice of rows alone), and on how many questions two
policies choose the same rows.

    .venv/bin/python scripts/measure-recompute-rows.py --split reporting --n 150 --policies each:1 alike:1
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=150, help="questions (and documents: one fact each) of the corpus")
    ap.add_argument("--split", choices=("tuning", "reporting"), default="tuning")
    ap.add_argument("--policies", nargs="+", default=["each:1", "alike:1"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import pcache_rag  # noqa: F401  - before torch
    from pcache_rag.conditioning import LearnedPrefix
    from pcache_rag.default_model import load_model
    from pcache_rag.measure import quality as Q
    from pcache_rag.rag.prompt import fit_question
    from pcache_rag.recompute import Recompute, select_rows

    model, tok = load_model()
    prefix = LearnedPrefix.load(ROOT / "pcache_rag/data/learned/smollm2-135m-instruct.safetensors")
    with tempfile.TemporaryDirectory() as wd:
        qs, rags, _ = Q._rag_set(model, tok, Path(wd), a.n, 330, 4, 0, a.split,
                                 {"cond:learned"}, prefix=prefix, set_name="lookalike")
        rag = rags["cond:learned"]
        lexicon = rag.pc.prefiller.lexicon
        rows: dict[str, list[list[int]]] = {p: [] for p in a.policies}
        for q in qs:
            hs = rag.retrieve(q.question)
            kvs = [kv for _, kv in rag.chunks.parts(hs)]
            q_ids = fit_question(rag, q.question, hs, 24)
            for p in a.policies:
                rows[p].append(select_rows(None, None, kvs, Recompute.parse(p), q_ids, (), lexicon))
    first = a.policies[0]
    out = {"split": a.split, "n": len(qs), "policies": {
        p: {"mean_rows": statistics.mean(len(r) for r in rs), "median_rows": statistics.median(len(r) for r in rs),
            f"same_rows_as_{first}": sum(r == f for r, f in zip(rs, rows[first]))} for p, rs in rows.items()}}
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
