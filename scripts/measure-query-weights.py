"""Query weights: the forward of a cached prompt's computed rows in fp32 against bf16, and full
prefill of the same tokens, in one run (the engine's ``query_weights``; docs/guide.md).

One engine per setting on the same model (bf16 decode weights for both), a prompt of ~500-token
document modules filling ``--tokens`` positions with ``Q`` question tokens after them (the
benchmark's own prompt, :func:`pcache_rag.measure.bench.doc_schema`), and for each ``Q`` the
median time of ``--repeats`` prefills over already resident states (no copy: the forward alone),
the two settings interleaved, then full prefill. Prints ms, the bf16/fp32 ratio, and the relative
difference of the two settings' last logits.

    .venv/bin/python scripts/measure-query-weights.py [--tokens 1500] [--rows 16 40 96] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 40, 96])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import pcache_rag  # noqa: F401  - before torch: OpenMP's spin setting
    from pcache_rag import PromptCache
    from pcache_rag.default_model import load_model
    from pcache_rag.measure.bench import doc_schema
    from pcache_rag.measure.decode_bench import cpu_line

    model, tok = load_model()
    engines = {w: PromptCache(model, tok, decode_weights="bf16", query_weights=w) for w in ("fp32", "bf16")}
    print(cpu_line())
    rows = []
    for q in a.rows:
        schema, prompt = doc_schema(engines["fp32"], f"q{q}", a.tokens, q)
        times: dict[str, list[float]] = {w: [] for w in engines}
        last = {}
        for pc in engines.values():
            pc.add_schema(schema)
            pc.workspace.ensure(a.tokens + 64)
            pc.prefill(prompt)  # warm: the units resident
        for _ in range(a.repeats):
            for w, pc in engines.items():
                r = pc.prefill(prompt)
                assert r.copied_tokens == 0
                times[w].append(r.forward_s)
                last[w] = r
        full = statistics.median(
            _timed(lambda: engines["fp32"].core.full_prefill(last["fp32"].input_ids)) for _ in range(3))
        ref, got = last["fp32"].logits, last["bf16"].logits
        row = {"computed_rows": last["fp32"].computed_tokens, "cached": last["fp32"].cached_tokens,
               "fp32_ms": statistics.median(times["fp32"]) * 1e3, "bf16_ms": statistics.median(times["bf16"]) * 1e3,
               "full_prefill_ms": full * 1e3, "logits_rel_diff": float((got - ref).norm() / ref.norm()),
               "same_top": int(got.argmax()) == int(ref.argmax())}
        row["bf16_over_fp32"] = row["bf16_ms"] / row["fp32_ms"]
        rows.append(row)
        print(f"{row['computed_rows']:>4} rows over {row['cached']} cached: fp32 {row['fp32_ms']:.0f} ms, bf16 "
              f"{row['bf16_ms']:.0f} ms ({row['bf16_over_fp32']:.2f}x); full prefill {row['full_prefill_ms']:.0f} ms; "
              f"logits differ by {row['logits_rel_diff']:.4f}, same top token: {row['same_top']}")
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu_line(), "tokens": a.tokens, "rows": rows}, indent=1))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
