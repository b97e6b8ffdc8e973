"""Ingestion beside the answers: files uploaded to the web app (or the sample corpus) are
ingested in a background thread, one ingestion at a time, with its progress for the page.

:class:`Uploads` owns the uploads folder, the ingestion thread and its :class:`IngestState`;
:class:`~.service.AnswerService` answers while it runs (each answer says how many chunks it saw).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .errors import RequestError

log = logging.getLogger(__name__)

_INGESTING = "an ingestion is already running: wait for it to finish"


@dataclass
class IngestState:
    """The running or last ingestion, as the page shows it."""

    running: bool = False
    stage: str = ""
    done: int = 0
    total: int = 0
    files: list[str] = field(default_factory=list)
    report: dict | None = None
    error: str | None = None
    started: float = 0.0
    seconds: float = 0.0


class Uploads:
    """Background ingestion into ``rag``'s index of files kept in ``upload_dir`` (default
    ``<index>/uploads``)."""

    def __init__(self, rag, upload_dir: str | Path | None = None) -> None:
        self.rag = rag
        self.upload_dir = Path(upload_dir) if upload_dir else rag.folder.upload_dir
        self.state = IngestState()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.state.running

    def resume(self) -> list[str]:
        """Finish what a killed server left: uploads saved but never indexed are ingested in the
        background, and half-written ``.part`` files are removed. Returns the names resumed."""
        for part in self.upload_dir.glob(".*.part") if self.upload_dir.is_dir() else ():
            part.unlink(missing_ok=True)
        try:
            pending = self.rag.upkeep.pending_uploads(self.upload_dir)
        except Exception as e:  # noqa: BLE001 - a damaged index is reported by the status panel
            log.warning("cannot look for unindexed uploads: %s", e)
            return []
        if pending:
            log.warning("%d uploaded files were never indexed (an ingest was interrupted): indexing them now",
                        len(pending))
            self.start(pending, label=[p.name for p in pending])
        return [p.name for p in pending]

    def check_idle(self) -> None:
        """:class:`RequestError` (409) if an ingestion is running."""
        if self.state.running:
            raise RequestError(_INGESTING, 409, retry_after=5)

    def start(self, paths: Sequence[str | Path], label: list[str] | None = None) -> None:
        """Start ingesting ``paths`` in the background; :class:`RequestError` (409) if an
        ingestion is already running."""
        if not self._lock.acquire(blocking=False):
            raise RequestError(_INGESTING, 409, retry_after=5)
        st = self.state = IngestState(running=True, files=label or [Path(p).name for p in paths],
                                             started=time.perf_counter())

        def progress(stage: str, done: int, total: int) -> None:
            st.stage, st.done, st.total = stage, done, total

        def run() -> None:
            try:
                rep = self.rag.upkeep.ingest(paths, progress=False, on_progress=progress)
                st.report = {
                    "added": rep.added, "changed": rep.changed, "unchanged": rep.unchanged, "empty": rep.empty,
                    "chunks_encoded": rep.chunks_encoded, "chunks_reused": rep.chunks_reused,
                    "skipped": [[Path(p).name, why] for p, why in rep.skipped], "notes": rep.notes,
                    "seconds": rep.seconds,
                }
            except Exception as e:  # noqa: BLE001 - reported on the page; the server stays up
                log.exception("ingestion failed")
                st.error = f"{type(e).__name__}: {e}"
            finally:
                st.seconds = time.perf_counter() - st.started
                st.running = False
                self._lock.release()

        self._thread = threading.Thread(target=run, name="pcache-ingest", daemon=True)
        self._thread.start()

    def status(self) -> dict:
        """The running or last ingestion: stage (``read`` bytes, ``encode`` chunks), done,
        total, files, and the report or error once it ended."""
        st = self.state
        return {k: v for k, v in vars(st).items() if k != "started"}


    def join(self, timeout: float | None = None) -> None:
        """Wait for a running ingestion to end."""
        if self._thread is not None:
            self._thread.join(timeout)
