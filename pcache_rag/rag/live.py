"""The index as this process sees it: chroma opened, the manifest as last read, and the watch
that reopens chroma when any process commits.

A :class:`LiveIndex` is what :class:`~pcache_rag.rag.CachedRAG` reads chunks through. Every
commit (an ingest's file, a prune, a repair, a move to a learned prefix) bumps the manifest's
``generation``; when the number on disk moves, chroma's in-memory vector index is stale (it
would name chunks that are gone), so it is opened again.
"""

from __future__ import annotations

import logging
import threading

from ..fsutil import quarantine
from .index import ChromaIndex, IndexDamagedError
from .index_dir import FORMAT, Index

log = logging.getLogger(__name__)


class LiveIndex:
    """Chroma over ``folder`` (or the chroma server at ``chroma_url``), reopened on commits."""

    def __init__(self, folder: Index, chroma_url: str | None = None) -> None:
        self.folder = folder
        self.chroma_url = chroma_url
        #: the manifest as this process last read or wrote it
        self.manifest = folder.manifest()
        self._watch = folder.watch(int(self.manifest.get("generation", 0)))
        self._chroma: ChromaIndex | None = None
        self._error: Exception | None = None
        #: held while reading the watch; an ingest of this process counts itself in :attr:`ingesting`
        self.lock = threading.RLock()
        self.ingesting = 0  # ingests running in this process (their commits are our own)
        self.open()

    def open(self) -> None:
        """Open chroma; a damaged database is kept as :attr:`chroma`'s error, not raised here."""
        try:
            self._chroma = ChromaIndex(self.folder.chroma_dir, url=self.chroma_url)
            self._error = None
            n = self.manifest.get("chunks")
            if self.chroma_url is None and n and self._chroma.count() == 0:
                raise IndexDamagedError(self.folder.chroma_dir / "chroma.sqlite3",
                                        f"it lists no chunks, but the index had {n}")
        except IndexDamagedError as e:
            self._chroma, self._error = None, e

    @property
    def chroma(self) -> ChromaIndex:
        """The chroma side; raises :class:`IndexDamagedError` if its database is damaged (an
        ingest rebuilds it)."""
        if self._chroma is None:
            raise self._error  # type: ignore[misc]
        return self._chroma

    @property
    def damaged(self) -> bool:
        return self._chroma is None

    @property
    def version(self) -> tuple[int, int]:
        """What changes when the chunks may have: the generation and the chroma handle."""
        return self.generation, id(self._chroma)

    @property
    def generation(self) -> int:
        """The manifest's commit counter this process has seen."""
        return self._watch.generation

    def changed(self, force: bool = False) -> dict | None:
        """Reopen chroma when any process committed since this one last looked (or with
        ``force``); returns the manifest then read (``{}`` if unreadable), else None. One small
        file read per call; skipped while an ingest of this process runs (it holds the index's
        lock, so nobody else commits)."""
        with self.lock:
            if self.ingesting and not force:
                return None
            m = self._watch.changed(force)
            if m is None:
                return None
            if m:
                self.manifest = m
            log.info("the index %s changed (generation %d): reopening it", self.folder.path, self.generation)
            self.open()
            return m

    def rebuild(self) -> str:
        """Set a damaged chroma database aside and open an empty one; returns where it went."""
        err = self._error
        self._chroma = None
        folder = self.folder.chroma_dir
        moved = quarantine(folder) if folder.exists() else folder
        self.manifest.pop("chunks", None)  # the count belonged to the damaged database
        log.warning("%s; moved to %s and rebuilt from the documents given to this ingest", err, moved)
        self.open()
        if self._chroma is None:
            raise self._error  # type: ignore[misc]
        return str(moved)

    def commit(self, chunk_tokens: int, conditioning: str) -> None:
        """Write the manifest with the next ``generation``: every process serving this index sees
        the change at its next question. Called under the ingest lock."""
        try:
            n = self.chroma.count()
        except Exception:  # noqa: BLE001 - a count that fails leaves the old manifest
            return
        on_disk = int(self.folder.manifest(quiet=True).get("generation", 0))
        self._watch.generation = max(on_disk, self.generation) + 1
        self.manifest = {"format": FORMAT, "chunk_tokens": chunk_tokens, "chunks": n, "conditioning": conditioning,
                         "generation": self.generation,
                         **({"calibration": self.manifest["calibration"]} if "calibration" in self.manifest else {})}
        self.folder.write_manifest(self.manifest)
