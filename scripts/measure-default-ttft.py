"""The RAG default's time to first token against full prefill on look-alike questions, as the eval
times them (fetching the states, assembling, the forward), on this CPU's instruction set or a capped one.

    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 PCACHE_RAG_KERNELS=avx2 \
      .venv/bin/python scripts/measure-default-ttft.py --n 24
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=24, help="questions timed")
    ap.add_argument("--corpus", type=int, default=150,
                    help="questions (and so documents, one fact each) the look-alike corpus is built for, as the eval's "
                         "--n: a small corpus retrieves unrelated documents beside the look-alikes")
    ap.add_argument("--recompute", default=None, help="the policy timed (default: the RAG default)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import pcache_rag  # noqa: F401  - before torch
    from pcache_rag.conditioning import LearnedPrefix
    from pcache_rag.default_model import load_model
    from pcache_rag.engine import Parts
    from pcache_rag.measure import quality as Q
    from pcache_rag.measure.decode_bench import cpu_line, isa_caps
    from pcache_rag.models.fast_decode import RAG_DECODE_WEIGHTS, RAG_QUERY_WEIGHTS, use_decode_weights
    from pcache_rag.rag.prompt import fit_question
    from pcache_rag.recompute import RAG_RECOMPUTE

    model, tok = load_model()
    use_decode_weights(model, RAG_DECODE_WEIGHTS, tok)
    prefix = LearnedPrefix.load(ROOT / "pcache_rag/data/learned/smollm2-135m-instruct.safetensors")
    with tempfile.TemporaryDirectory() as wd:
        qs, rags, _ = Q._rag_set(model, tok, Path(wd), max(a.n, a.corpus), 330, 4, 0, "tuning", {"cond:learned"},
                                 prefix=prefix, set_name="lookalike", query_weights=RAG_QUERY_WEIGHTS)
        rag = rags["cond:learned"]
        pc = rag.pc
        cached, full = [], []
        policy = a.recompute or RAG_RECOMPUTE
        for q in qs[: a.n]:
            hs = rag.retrieve(q.question)
            q_ids = fit_question(rag, q.question, hs, 24)
            pc.workspace.invalidate()
            t0 = time.perf_counter()
            parts = rag.chunks.parts(hs)
            o = pc.generate(Parts(parts, q_ids, "preamble"), recompute=policy, max_new_tokens=1)
            cached.append(time.perf_counter() - t0 - (o.total_s - o.ttft_s))
            f = pc.generate(Parts([], rag.full_prompt_ids(q.question, hs)), max_new_tokens=1)
            full.append(f.ttft_s)
        out = {"cpu": cpu_line(), "env": isa_caps(),
               "query_weights": pc.core.query_weights, "recompute": policy, "n": len(cached), "corpus": len(qs),
               "cached_ms": statistics.median(cached) * 1e3, "full_ms": statistics.median(full) * 1e3}
        out["speedup"] = out["full_ms"] / out["cached_ms"]
        print(json.dumps(out))
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
