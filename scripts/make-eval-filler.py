#!/usr/bin/env python3
"""Write ``pcache_rag/data/eval-filler.json.gz``: the filler text of ``pcache-rag eval quality``.

The eval plants facts in real documentation text. Rendering the standard library's pydoc
pages at run time gives text that differs from process to process (memory addresses in
reprs, the logging module's live handlers, ``__slotnames__`` caches, hooks a test runner
installs) and from one Python version to another, so every run asked its questions over
slightly different distractors. This script renders the pages once, in a fresh process,
takes out what is process-specific, keeps the first 40,000 characters of each, and writes
them; the eval reads that file and nothing else. Run it again only to change the filler
(the eval's input hashes change with it).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "pcache_rag" / "data" / "eval-filler.json.gz"
KEEP = 40_000


def main() -> int:
    sys.path.insert(0, str(OUT.parent.parent.parent))
    from pcache_rag.samples import DOC_MODULES, stdlib_docs

    pages = {}
    for name, text in stdlib_docs(modules=DOC_MODULES):  # normalised: no addresses, no file paths
        assert "0x7f" not in text, name
        pages[name] = text[:KEEP]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(OUT, "wb", mtime=0) as f:
        f.write(json.dumps({"python": sys.version.split()[0], "pages": pages}, ensure_ascii=False,
                           indent=0).encode())
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(pages)} pages)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
