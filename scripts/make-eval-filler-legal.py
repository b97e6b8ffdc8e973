#!/usr/bin/env python3
"""Write ``pcache_rag/data/eval-filler-legal.json.gz``: the eval's second filler text, legal prose.

The eval's first filler is standard-library documentation (``make-eval-filler.py``); the
learned conditioning prefix was learned on text of that style, so a set built on it alone
cannot tell a fit to the style from a gain. This second source is of another style: the
free-software licence texts Debian ships in ``/usr/share/common-licenses`` (numbered sections,
long sentences of obligations and definitions, like a policy manual). Each licence permits
verbatim copies. They are read once here and shipped, so every machine reads the same text;
the eval reads the shipped file and nothing else. Run it again only to change the filler
(the eval's input hashes change with it).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

SRC = Path("/usr/share/common-licenses")
OUT = Path(__file__).resolve().parent.parent / "pcache_rag" / "data" / "eval-filler-legal.json.gz"
NAMES = ("Apache-2.0", "Artistic", "CC0-1.0", "GFDL-1.3", "GPL-2", "GPL-3", "LGPL-2.1", "MPL-1.1", "MPL-2.0")


def main() -> int:
    pages = {}
    for name in NAMES:
        text = (SRC / name).read_text(encoding="utf-8")
        # hard-wrapped at ~72 columns: join each paragraph's lines, so that a planted sentence is a line of its
        # own among lines of the same kind (the documentation filler's lines are whole sentences too)
        paras = [" ".join(ln.strip() for ln in p.splitlines() if ln.strip()) for p in text.split("\n\n")]
        pages[name] = "\n".join(p for p in paras if p)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(OUT, "wb", mtime=0) as f:
        f.write(json.dumps({"source": str(SRC), "pages": pages}, ensure_ascii=False, indent=0).encode())
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(pages)} pages)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
