"""Document QA in the terminal: index a folder, then ask questions; answers stream from the cache.

    python demos/docqa.py ~/notes ./docs [--index DIR] [--k 4] [--compare]

Each answer shows its sources and its time-to-first-token (with --compare, also
the full-prefill TTFT of the same retrieved text). Type a question per line;
an empty line or Ctrl-D quits. Questions can also be piped in on stdin.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="files or folders of .txt/.md/.rst documents")
    ap.add_argument("--index", default=None, help="index directory (default: ./.docqa-index)")
    ap.add_argument("--model", default=None, help="local model folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--compare", action="store_true", help="also time a full prefill of the same text")
    a = ap.parse_args(argv)

    from pcache_rag import CachedRAG, Index

    index = Index(a.index or ".docqa-index")
    rag = CachedRAG(index, pc=index.engine(a.model), k=a.k)
    rep = rag.ingest(a.paths)
    print(f"{rag.index.count()} chunks indexed ({rep.chunks_encoded} encoded now). Ask away; empty line quits.")
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("\n> ", end="", flush=True)
        line = sys.stdin.readline()
        q = line.strip()
        if not q:
            break
        if not interactive:
            print(f"\n> {q}")
        t0 = time.perf_counter()
        handles = rag.retrieve(q)
        first = None
        for delta in rag.stream(q, handles=handles, max_new_tokens=a.max_new_tokens):
            if first is None:
                first = time.perf_counter() - t0
            print(delta, end="", flush=True)
        print()
        for h in handles:
            print(f"   [{h.score:.2f}] {Path(h.source).name} #{h.metadata.get('chunk')}")
        msg = f"   time to first token: {first * 1000:.0f} ms (cached)" if first is not None else "   (no output)"
        if a.compare and first is not None:
            full = rag.answer_full_prefill(q, handles=handles, max_new_tokens=1)
            msg += f" vs {full.ttft_s * 1000:.0f} ms full prefill (x{full.ttft_s / first:.1f})"
        print(msg)
    rag.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
