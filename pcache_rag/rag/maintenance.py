"""Keeping an index honest: verify it against its files and store, repair what is wrong,
prune sources that are gone, and count which chunks have states. Each function takes the
parts it reads (the chroma side, the store, an :class:`~.ingest.Ingestor` to re-ingest with);
the caller refreshes and commits."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..store import KVStore
from .chunking import SkipFile, read_document
from .extract import release as release_reader
from .index import ChromaIndex
from .ingest import Ingestor, pending_uploads
from .states import budget_room, check_store, drop_chunks, human, persisted
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
        rep.store.extend(check_store(kv))
    return rep


def repair(ing: Ingestor, upload_dir: Path) -> list[str]:
    """Fix what :func:`verify` finds, except sources that are gone (see :func:`prune`):
    stale and duplicate chunks are dropped (their file is re-ingested with ``ing`` if no current
    version is indexed), missing states are encoded from the indexed text, and the disk
    tier's rows without files and files without rows are removed. Returns what was fixed."""
    chroma, store = ing.chroma, ing.chunks.store
    v = verify(chroma, store, upload_dir, check=False)
    fixed: list[str] = []
    fixed.extend(check_store(store, repair=True))
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
