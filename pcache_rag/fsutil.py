"""Small helpers for paths: the user data folder, moving damaged data aside, and showing names
safely in a terminal (torch-free: the connectors and the conditioning specs import it)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def cache_home() -> Path:
    """Where pcache-rag keeps converted models, installed learned prefixes and other user data
    (``$PCACHE_RAG_HOME``, else ``~/.cache/pcache-rag``)."""
    return Path(os.environ.get("PCACHE_RAG_HOME") or Path.home() / ".cache" / "pcache-rag")


def quarantine(path: str | Path) -> Path:
    """Move ``path`` (a file or directory) aside to ``<name>.damaged-<time>`` next to it, for
    inspection, and return the new path. Nothing is deleted."""
    path = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    path.rename(dest)
    return dest


def shown(text: str) -> str:
    """``text`` safe for a terminal: control characters (ANSI escapes, carriage returns, bidi
    overrides) are written as escapes, so a file name cannot rewrite the screen."""
    import unicodedata

    out = []
    for ch in str(text):
        cat = unicodedata.category(ch)
        if not (cat.startswith("C") or cat in ("Zl", "Zp")):
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)
