"""Writing to an index and keeping it honest: :class:`Upkeep` ingests (under the index's lock,
through an :class:`~.ingest.Ingestor`), verifies the index against its files and store, repairs
what is wrong, prunes sources that are gone, counts which chunks have states, and commits. The
functions below it take only the parts they read (the chroma side, the store, an Ingestor)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..store import KVStore
from .chunking import SkipFile, read_document, scan
from .chunks import ChunkStates
from .embed import MiniLMEmbedder
from .extract import release as release_reader
from .index import ChromaIndex
from .index_dir import Index
from .ingest import Ingestor, pending_uploads
from .live import LiveIndex
from .states import budget_room, drop_chunks, human, persisted
from .types import IngestReport, VerifyReport


def state_stats(chroma: ChromaIndex, store: KVStore) -> dict:
    """How many chunks have states: ``chunks`` (and ``documents``) in the index, ``lazy``
    indexed without states, ``hot`` lazy ones whose states were made on first use, ``cold``
    the rest. Reads every chunk's metadata once."""
    chunks = chroma.chunks()
    lazy = [m["kv_key"] for _cid, m in chunks if m.get("lazy")]
    hot = sum(store.contains(k) for k in lazy)
    return {"chunks": len(chunks), "documents": len({m["source"] for _cid, m in chunks}), "lazy": len(lazy),
            "hot": hot, "cold": len(lazy) - hot}


def prune(chroma: ChromaIndex, store: KVStore) -> int:
    """Remove every indexed source whose file no longer exists (a renamed or deleted folder);
    returns how many were removed (the caller commits when any were)."""
    n = 0
    for src, (_shas, ids, keys) in chroma.sources().items():
        if not Path(src).exists():
            drop_chunks(chroma, store, ids, keys)
            n += 1
    return n


def verify(chroma: ChromaIndex, store: KVStore, upload_dir: Path, check: bool = True) -> VerifyReport:
    """Check the index against the files and the store (with ``check``, the store's own
    consistency too; see :class:`VerifyReport`)."""
    try:
        return _verify(chroma, store, upload_dir, check)
    finally:
        release_reader()


def _verify(chroma: ChromaIndex, kv: KVStore, upload_dir: Path, store: bool) -> VerifyReport:
    rep = VerifyReport()
    rep.pending_uploads = [str(f) for f in pending_uploads(chroma, upload_dir)]
    chunks = chroma.chunks()
    current: dict[str, str | None] = {}
    for _cid, m in chunks:
        src = m["source"]
        if src not in current:
            current[src] = current_sha(Path(src))
            if current[src] is None and not Path(src).exists():
                rep.missing_sources.append(src)
    seen: dict[tuple[str, int], list[tuple[str, dict]]] = {}
    for cid, m in chunks:
        cur = current[m["source"]]
        if cur is not None and m["sha"] != cur:
            rep.stale.append(cid)
        seen.setdefault((m["source"], int(m["chunk"])), []).append((cid, m))
        if not m.get("lazy") and not persisted(kv, m["kv_key"]):
            rep.missing_states.append(cid)
    for (_src, _i), group in seen.items():
        if len(group) > 1:
            cur = current[group[0][1]["source"]]
            rep.duplicates.extend(cid for cid, m in group if m["sha"] != cur or cur is None)
    if store:
        rep.store.extend(kv.check())
    return rep


def repair_index(ing: Ingestor, upload_dir: Path) -> list[str]:
    """Fix what :func:`verify` finds, except sources that are gone (see :func:`prune`):
    stale and duplicate chunks are dropped (their file is re-ingested with ``ing`` if no current
    version is indexed), missing states are encoded from the indexed text, and the disk
    tier's rows without files and files without rows are removed. Returns what was fixed."""
    chroma, store = ing.chroma, ing.chunks.store
    v = verify(chroma, store, upload_dir, check=False)
    fixed: list[str] = []
    fixed.extend(store.check(repair=True))
    drop = set(v.stale) | set(v.duplicates)
    if drop:
        chunks = dict(chroma.chunks())
        srcs = {chunks[c]["source"] for c in drop if c in chunks}
        keys = [chunks[c]["kv_key"] for c in drop if c in chunks]
        drop_chunks(chroma, store, sorted(drop), keys)
        fixed.append(f"removed {len(drop)} stale or duplicate chunks of {len(srcs)} files")
        have = set(chroma.sources())
        again = [s for s in srcs if s not in have and Path(s).exists()]
        if again:
            ing.read_and_commit([Path(s) for s in again], [], IngestReport(), False, "eager")
            fixed.append(f"re-ingested {len(again)} files that had no current version")
    if v.missing_states:
        chunks = dict(chroma.chunks())
        need = sum(int(chunks[c].get("n_tokens", 0)) for c in v.missing_states if c in chunks)
        bpt = ing.chunks.bytes_per_token
        room = budget_room(store)
        if room is not None and need * bpt > room:
            ids = [c for c in v.missing_states if c in chunks]
            chroma.update_metadata(ids, [{**chunks[c], "lazy": True} for c in ids])
            fixed.append(f"{len(ids)} chunks whose states were missing need {human(need * bpt)}, more than the "
                         f"{human(max(room, 0))} the store's budget has free: marked to encode on first use")
        else:
            n = ing.encode_indexed(v.missing_states)
            fixed.append(f"encoded {n} chunks whose states were missing")
    return fixed


def current_sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(read_document(path).text.encode()).hexdigest()
    except (SkipFile, OSError):
        return None


class Upkeep:
    """Every write to one index: ``folder`` (its directory), ``live`` (chroma as this process sees
    it), ``chunks`` (their states), ``embedder``, and the ``tokenizer`` that splits documents into
    chunks of ``chunk_tokens``."""

    def __init__(self, folder: Index, live: LiveIndex, chunks: ChunkStates, embedder: MiniLMEmbedder, tokenizer,
                 chunk_tokens: int) -> None:
        self.folder, self.live, self.chunks, self.embedder = folder, live, chunks, embedder
        self.tokenizer, self.chunk_tokens = tokenizer, chunk_tokens

    def refresh(self, force: bool = False) -> bool:
        """See every commit of any process since this one last looked (:meth:`LiveIndex.changed`);
        an index another process moved to another conditioning is read under it from then on."""
        m = self.live.changed(force)
        if m:
            self.chunks.follow(self.folder, m)
        return m is not None

    def ingestor(self) -> Ingestor:
        return Ingestor(self.live.chroma, self.chunks, self.embedder, self.tokenizer, self.chunk_tokens, self.commit)

    def commit(self) -> None:
        """Publish the index's state to every process (:meth:`LiveIndex.commit`)."""
        self.live.commit(self.chunk_tokens, self.chunks.asm.conditioning)

    def ingest(self, paths: Sequence[str | Path], progress: bool = True, encode: str = "eager", prune: bool = False,
               repair: bool = True, on_progress: Callable[[str, int, int], None] | None = None) -> IngestReport:
        """Index files (or directories of them) (:meth:`pcache_rag.rag.CachedRAG.ingest`).

        New and changed files are read, chunked, embedded and (``encode="eager"``) encoded;
        unchanged files cost nothing; files under ``paths`` that were indexed before and are
        gone now are removed. One bad file never stops the run: it is listed in
        ``report.skipped`` with its reason. Before encoding, the states' size is projected and
        the ingest is refused (:class:`IngestTooLargeError`) if it exceeds the store's budget;
        ``encode="lazy"`` indexes without states (encoded on first use); a later eager ingest of
        the same paths encodes what is still missing (``report.lazy_filled``). ``prune`` also removes
        every indexed source that no longer exists; ``repair`` fixes what :meth:`verify` finds
        (stale or duplicate chunks, missing states, store rows without files).
        A lock on the index directory makes concurrent ingests take turns. ``on_progress(stage,
        done, total)`` is called as the bars move (stage ``"read"`` in bytes, then ``"encode"``
        in chunks), for a caller with no terminal such as the web app.
        """
        if encode not in ("eager", "lazy"):
            raise ValueError(f"encode must be 'eager' or 'lazy', not {encode!r}")
        t0 = time.perf_counter()
        rep = IngestReport()
        files, skipped = scan(paths, exclude=[self.folder.path])  # validates paths before any work
        rep.skipped.extend((str(p), r) for p, r in skipped)
        lock = self.folder.lock()
        with self.live.lock:
            self.refresh()  # what other processes committed, before this one adds to it
            self.live.ingesting += 1
        try:
            if self.live.damaged:
                rep.rebuilt_from = self.live.rebuild()
            ing = self.ingestor()
            upload_dir = self.folder.upload_dir
            ing.run(files, [Path(p).expanduser().absolute() for p in paths], rep, progress, encode, upload_dir,
                    on_progress)
            if prune:
                rep.pruned = self._prune()
            if repair:
                rep.repaired = repair_index(ing, upload_dir)
            ing.finish(rep, encode == "eager" or repair, upload_dir)
        finally:
            release_reader()  # the document reader's child process ends: its memory goes back
            with self.live.lock:
                self.live.ingesting -= 1
            lock.release()
        rep.seconds = time.perf_counter() - t0
        return rep

    def pending_uploads(self, folder: Path | None = None) -> list[Path]:
        """Uploaded files that no chunk comes from (see :func:`~.ingest.pending_uploads`)."""
        return pending_uploads(self.live.chroma, folder if folder is not None else self.folder.upload_dir)

    def state_stats(self) -> dict:
        self.refresh()
        return state_stats(self.live.chroma, self.chunks.store)

    def prune(self) -> int:
        self.refresh()
        return self._prune()

    def _prune(self) -> int:
        n = prune(self.live.chroma, self.chunks.store)
        if n:
            self.commit()
        return n

    def verify(self, store: bool = True) -> VerifyReport:
        self.refresh()
        return verify(self.live.chroma, self.chunks.store, self.folder.upload_dir, store)

    def repair(self) -> list[str]:
        self.refresh()
        fixed = repair_index(self.ingestor(), self.folder.upload_dir)
        if fixed:
            self.commit()
        return fixed
