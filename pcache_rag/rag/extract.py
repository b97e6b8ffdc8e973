"""Reading PDF, Word and HTML files in a child process with a memory limit.

A small compressed file can expand without bound when parsed: a 120 KB ``.docx`` of empty
paragraphs is 60 MB of XML and gigabytes of parsed tree, a 1 MB PDF stream inflates to
1 GiB. Limits inside the parsers (the zip directory checked before parsing, pypdf's own
output limits, a cap on the extracted text; see :mod:`.chunking`) catch the known shapes;
this module is the backstop for the unknown ones. The parsers run in one long-lived child
process per ingest whose address space is capped with ``resource.setrlimit(RLIMIT_AS)``,
so no single file can take the caller's (a server's) memory, and what the child grew to
is returned to the system when it exits at the end of the ingest.

The child is ``reader_child.py`` run as a script: it loads the sibling
``chunking.py`` as a bare module (no package ``__init__``), so it starts in a fraction of a second without importing torch
or the rest of the package. It reads one JSON request per line on stdin and answers one
JSON line on stdout. A file that needs more memory than the limit, takes longer than the
timeout, or crashes the child is a :class:`~.chunking.SkipFile` with that reason; the
child is started again for the next file.

Plain text formats are read in the caller: their size on disk bounds their memory.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
from pathlib import Path

from .documents import Document, SkipFile

#: address space of the reading process, in bytes (the parsers' working memory: html.parser
#: trees take about 40 bytes per byte of HTML)
MEMORY_LIMIT = 2 << 30
#: seconds one file may take to read
TIMEOUT_S = 300.0


class Extractor:
    """A child process that reads documents under ``memory_limit`` bytes of address space,
    one file at a time (thread-safe). Use as a context manager, or :meth:`close` it."""

    def __init__(self, memory_limit: int = MEMORY_LIMIT, timeout_s: float = TIMEOUT_S):
        self.memory_limit = int(memory_limit)
        self.timeout_s = float(timeout_s)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
        env["PCACHE_RAG_EXTRACT_LIMIT"] = str(self.memory_limit)
        self._proc = subprocess.Popen(
            [sys.executable, "-u", str(Path(__file__).with_name("reader_child.py").resolve())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=None, env=env, text=True, encoding="utf-8", errors="surrogateescape",
        )
        return self._proc

    def read(self, path: str | Path):
        """The :class:`~.chunking.Document` of ``path``; :class:`~.chunking.SkipFile` says why not."""
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
            try:
                proc.stdin.write(json.dumps({"path": str(path)}) + "\n")
                proc.stdin.flush()
                # selectors (epoll here), not select.select: a process with over 1,024 open files
                # (a long-running server, a test session) gets descriptors select() cannot watch
                with selectors.DefaultSelector() as sel:
                    sel.register(proc.stdout, selectors.EVENT_READ)
                    ready = sel.select(self.timeout_s)
                line = proc.stdout.readline() if ready else None
            except (BrokenPipeError, OSError):
                line = ""
            if line is None:
                self._kill()
                raise SkipFile(f"reading it took longer than {self.timeout_s:g} s")
            if not line:
                code = proc.wait()
                self._proc = None
                raise SkipFile(f"the reader process died while reading it (exit {code}); it may need more than "
                               f"{self.memory_limit >> 20} MB of memory")
            reply = json.loads(line)
            if reply.get("exit"):  # the child ran out of memory and ends: start afresh next time
                proc.wait()
                self._proc = None
        if "skip" in reply:
            raise SkipFile(reply["skip"])
        d = reply["doc"]
        return Document(d["text"], d["encoding"], d["note"], tuple(d["pages"]))

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop the child (its memory goes back to the system); the next read starts a new one."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                try:
                    self._proc.stdin.close()
                    self._proc.wait(10)
                except (OSError, subprocess.TimeoutExpired):
                    self._kill()
            self._proc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_shared: Extractor | None = None
_shared_lock = threading.Lock()


def extract(path: str | Path):
    """Read ``path`` through the process-wide :class:`Extractor` (started on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Extractor()
        ex = _shared
    return ex.read(path)


def release() -> None:
    """Stop the process-wide reader, returning its memory (called at the end of an ingest)."""
    with _shared_lock:
        ex = _shared
    if ex is not None:
        ex.close()
