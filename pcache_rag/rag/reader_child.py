"""The document reader's child process (started by :mod:`.extract`; stdlib only at start).

It caps its own address space, loads ``chunking`` without running any package
``__init__`` (so torch and the rest never load), then reads one JSON request per line on
stdin and answers one JSON line on stdout: ``{"doc": ...}`` or ``{"skip": reason}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def serve() -> None:
    import importlib
    import logging
    import resource

    limit = int(os.environ["PCACHE_RAG_EXTRACT_LIMIT"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.basicConfig(level=logging.ERROR)  # pypdf's warnings about odd files stay quiet
    # The package's folders as bare packages: chunking and its sibling modules load by their
    # own names, and no package __init__ runs (torch and the rest stay unloaded).
    import types

    root = Path(__file__).resolve().parents[1]
    for name, folder in (("pcache_rag", root), ("pcache_rag.rag", root / "rag")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(folder)]
        sys.modules[name] = pkg
    chunking = importlib.import_module("pcache_rag.rag.chunking")
    for line in sys.stdin:
        path = Path(json.loads(line)["path"])
        try:
            d = chunking.read_document(path, isolate=False)
            reply = {"doc": {"text": d.text, "encoding": d.encoding, "note": d.note, "pages": list(d.pages)}}
        except chunking.SkipFile as e:
            reply = {"skip": str(e)}
        except MemoryError:  # a heap that hit the limit stays fragmented: answer, then end
            reply = {"skip": f"reading it needs more than {limit >> 20} MB of memory (a decompression bomb?)",
                     "exit": True}
        except RecursionError:
            reply = {"skip": "its structure is nested too deeply to read"}
        except Exception as e:  # noqa: BLE001 - any parser failure is this file's skip reason
            reply = {"skip": f"unreadable: {type(e).__name__}: {e}"}
        try:
            out = json.dumps(reply)
        except MemoryError:
            reply = {"skip": f"its text needs more than {limit >> 20} MB of memory", "exit": True}
            out = json.dumps(reply)
        sys.stdout.write(out + "\n")
        sys.stdout.flush()
        if reply.get("exit"):
            return


if __name__ == "__main__":
    serve()
