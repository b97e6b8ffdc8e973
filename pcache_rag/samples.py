"""The sample corpus: plain-text documentation of Python standard-library modules.

Built at run time from real text already on the machine (``pydoc``), so the project
ships no third-party prose. The demo, the web app's sample button and the benchmarks
read it.
"""

from __future__ import annotations

import importlib
import pydoc
import re
import warnings
from pathlib import Path

DOC_MODULES = (
    "json", "os", "re", "collections", "functools", "itertools", "argparse", "logging", "pathlib",
    "subprocess", "typing", "dataclasses", "asyncio", "threading", "socket", "email", "http.client",
    "unittest", "sqlite3", "csv", "datetime", "decimal", "random", "statistics", "textwrap", "string",
    "shutil", "tempfile", "zipfile", "tarfile", "heapq", "bisect", "contextlib", "inspect", "abc",
)


def normalise(text: str) -> str:
    """A pydoc page without what differs between processes and machines: object reprs' memory
    addresses (``<... at 0x7f...>``) and the module's file path."""
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)
    return re.sub(r"^FILE\n    .*$", "FILE\n    (path)", text, flags=re.M)


def stdlib_docs(min_chars: int = 0, modules=DOC_MODULES) -> list[tuple[str, str]]:
    """``(module name, plain-text pydoc page)`` for standard-library modules, normalised
    (:func:`normalise`): the same text in every process, so a demo corpus written once stays
    unchanged and its chunks are not re-encoded."""
    out = []
    total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in modules:
            try:
                mod = importlib.import_module(name)
            except ImportError:  # pragma: no cover - stdlib modules are present
                continue
            text = normalise(pydoc.render_doc(mod, renderer=pydoc.plaintext))
            out.append((name, text))
            total += len(text)
            if min_chars and total >= min_chars:
                break
    return out


MODULES = ("json", "csv", "textwrap", "heapq", "bisect", "shutil", "pathlib", "zipfile")
QUESTIONS = [
    "How do I read rows from a CSV file?",
    "What does textwrap.dedent do?",
    "Which function keeps a list sorted when inserting an item?",
]


def build_corpus(directory: Path, modules=MODULES) -> Path:
    """Write one ``<module>.txt`` per standard-library module (skips files already written)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in stdlib_docs(modules=modules):
        f = directory / f"{name}.txt"
        if not f.exists() or f.read_text(encoding="utf-8") != text:
            f.write_text(text, encoding="utf-8")
    return directory
