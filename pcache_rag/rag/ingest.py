"""Ingest: read and chunk what changed, project the states' size, encode, commit per file.

An :class:`Ingestor` does the work of :meth:`CachedRAG.ingest
<pcache_rag.rag.pipeline.CachedRAG.ingest>` under the index's lock, on the parts it is handed
(the chroma side, the chunk states, the embedder and the commit): states first, then chroma,
then the manifest, so a killed ingest resumes without re-encoding and chroma never names a
chunk without states.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from collections.abc import Callable

from .chunking import SUPPORTED, SkipFile, read_document, split_tokens
from .chunks import ChunkStates
from .embed import MiniLMEmbedder
from .index import ChromaIndex
from .states import budget_room, drop_chunks, human, persisted, release_states
from .types import IngestReport

log = logging.getLogger(__name__)


class IngestTooLargeError(RuntimeError):
    """The states an ingest would encode exceed the store's budget."""


class Ingestor:
    """The phases of one ingest (called with the index's lock held): ``chroma`` gets the chunks,
    ``chunks`` their states, ``embedder`` their vectors; ``tokenizer`` splits documents into
    chunks of ``chunk_tokens``; ``commit()`` publishes each file to every process."""

    def __init__(self, chroma: ChromaIndex, chunks: ChunkStates, embedder: MiniLMEmbedder, tokenizer,
                 chunk_tokens: int, commit: Callable[[], None]) -> None:
        self.chroma, self.chunks, self.embedder = chroma, chunks, embedder
        self.tokenizer, self.chunk_tokens, self.commit = tokenizer, chunk_tokens, commit

    def run(self, files: list[Path], roots: list[Path], rep: IngestReport, progress: bool, encode: str,
            upload_dir: Path, on_progress=None) -> None:
        """The ingest of ``files`` (found under ``roots``), uploads an interrupted ingest left in
        ``upload_dir`` included; then lazy chunks under ``roots`` are filled."""
        pending = [f for f in pending_uploads(self.chroma, upload_dir) if f not in set(files)]
        if pending:
            rep.notes.append(f"indexing {len(pending)} uploaded files that an interrupted ingest left in "
                             f"{upload_dir}")
            files = sorted([*files, *pending])
        self.read_and_commit(files, roots, rep, progress, encode, on_progress)
        if encode == "eager":
            rep.lazy_filled = self.fill_lazy(roots, progress)

    def finish(self, rep: IngestReport, check: bool, upload_dir: Path) -> None:
        """After the ingest (and any prune or repair): with ``check``, chunks the store did not
        keep become lazy; skipped uploads are set aside; the result is committed."""
        if check:
            self.check_kept(rep)
        self.set_aside_skipped_uploads(rep, upload_dir)
        self.commit()

    def read_and_commit(self, files: list[Path], roots: list[Path], rep: IngestReport, progress: bool,
                        encode: str, on_progress=None) -> None:
        """The three phases over ``files``: read and chunk what changed, project the states'
        size (refusing what exceeds the budget), encode and commit file by file; then remove
        the indexed files under ``roots`` that are gone."""
        known = self.chroma.sources()  # source -> (shas, [ids], [kv keys])
        self.chunks.preamble()
        start = self.chunks.canonical_start
        # 1. read and chunk what changed (a bar over the bytes, moving during long files)
        work: list[tuple[str, str, list, list[list[int]]]] = []  # (source, sha, chunks, token ids)
        bar = Bar(progress, on_progress, "read", sum(file_size(f) for f in files), desc="read+chunk", unit="B",
                   unit_scale=True) if progress or on_progress else None
        for f in files:
            src = str(f)
            nbytes = file_size(f)
            try:
                doc = read_document(f)
            except SkipFile as e:
                rep.skipped.append((src, str(e)))
                if bar:
                    bar.update(nbytes)
                continue
            if doc.note:
                rep.notes.append(f"{src}: {doc.note}")
            sha = hashlib.sha256(doc.text.encode()).hexdigest()
            old = known.pop(src, None)
            if old is not None and old[0] == {sha}:
                rep.unchanged += 1
                if bar:
                    bar.update(nbytes)
                continue
            if not doc.text.strip():
                rep.empty += 1
                if old is not None:
                    release_states(self.chroma, self.chunks.store, self.chroma.delete_where_source(src))
                if bar:
                    bar.update(nbytes)
                continue
            ratio = nbytes / max(len(doc.text), 1)
            tick = (lambda n, r=ratio: bar.update(int(n * r))) if bar else None
            chunks = split_tokens(doc.text, self.tokenizer, self.chunk_tokens, progress=tick)
            work.append((src, sha, chunks, [self.chunks.ids(c.text, src) for c in chunks]))
            if old is not None:
                rep.changed += 1
            else:
                rep.added += 1
        if bar:
            bar.close()
        # 2. project the states' size (and, once the first chunk is encoded, the time)
        todo: dict[str, tuple[list[int], int]] = {}
        for src, _sha, _chunks, ids_list in work:
            for ids in ids_list:
                key = self.chunks.asm.key(ids, start)
                if key not in todo and not self.chunks.store.contains(key):
                    todo[key] = (ids, start)
        rep.projected_tokens = sum(len(ids) for ids, _ in todo.values())
        bpt = self.chunks.bytes_per_token
        rep.projected_bytes = rep.projected_tokens * bpt
        if encode == "eager" and todo:
            store_budget = self.chunks.store.budget_bytes()
            room = budget_room(self.chunks.store)
            self.say(progress, f"to encode: {len(todo)} chunks, {rep.projected_tokens} tokens, "
                                f"{human(rep.projected_bytes)} of states (store budget {human(store_budget)}"
                                + (f", {human(max(room, 0))} free)" if room is not None else ")"))
            if room is not None and rep.projected_bytes > room:
                raise IngestTooLargeError(
                    f"encoding {len(todo)} chunks ({rep.projected_tokens} tokens) needs {human(rep.projected_bytes)} "
                    f"of states, but the store's budget of {human(store_budget)} has {human(max(room, 0))} free (it holds "
                    f"{human(store_budget - room)}); ingest with --encode lazy (states made on first use), a larger "
                    f"--disk-budget, or fewer files"
                )
        # 3. encode, then commit each file to chroma (states first: chroma never names a
        #    chunk without states, so a killed ingest resumes without re-encoding)
        bar = None
        if (progress or on_progress) and work:
            bar = Bar(progress, on_progress, "encode", sum(len(w[2]) for w in work),
                       desc="encode+index" if encode == "eager" else "index", unit="chunk")
        t_enc, n_enc = 0.0, 0
        for src, sha, chunks, ids_list in work:
            keys, metas, docs, cids = [], [], [], []
            done_here = 0
            for c, ids in zip(chunks, ids_list):
                key = self.chunks.asm.key(ids, start)
                lazy = False
                if key in todo and encode == "eager":
                    t1 = time.perf_counter()
                    self.chunks.asm.encode_ids(ids, key, start)
                    t_enc += time.perf_counter() - t1
                    n_enc += 1
                    todo.pop(key)
                    rep.chunks_encoded += 1
                    if n_enc == 1 and len(todo) > 1:
                        self.say(progress, f"projected encoding time: ~{duration(t_enc * (len(todo) + 1))}")
                    if bar:
                        bar.update(1)
                        done_here += 1
                elif key in todo:
                    lazy = True
                    rep.chunks_lazy += 1
                else:
                    rep.chunks_reused += 1
                cids.append(hashlib.sha256(f"{src}\0{sha}\0{c.index}".encode()).hexdigest()[:24])
                keys.append(key)
                docs.append(c.text)
                metas.append({"source": src, "sha": sha, "chunk": c.index, "n_tokens": len(ids), "kv_key": key,
                              "lazy": lazy})
            embs = self.embedder.embed(docs)
            # Reconcile by source: every earlier version of this file goes, whoever wrote it.
            old_keys = self.chroma.delete_where_source(src)
            self.chroma.add(cids, embs, docs, metas)
            self.commit()  # readers in other processes see this file from now on
            release_states(self.chroma, self.chunks.store, set(old_keys) - set(keys))
            if bar:
                bar.update(len(chunks) - done_here)
        if bar:
            bar.close()
        for src, (_shas, ids, keys) in known.items():
            p = Path(src)
            if any(p == r or r in p.parents for r in roots) and not p.exists():
                drop_chunks(self.chroma, self.chunks.store, ids, keys)
                rep.removed += 1

    def fill_lazy(self, roots: list[Path], progress: bool) -> int:
        """Encode the lazily indexed chunks under ``roots`` that have no states yet, and mark
        every lazy chunk there as encoded; returns how many were encoded."""
        lazy = [(cid, m) for cid, m in self.chroma.chunks()
                if m.get("lazy") and any(Path(m["source"]) == r or r in Path(m["source"]).parents for r in roots)]
        if not lazy:
            return 0
        ids = [cid for cid, _ in lazy]
        n = self.encode_indexed(ids, progress, "encode lazy chunks")
        self.chroma.update_metadata(ids, [{**m, "lazy": False} for _cid, m in lazy])
        return n

    def encode_indexed(self, ids: list[str], progress: bool = False, desc: str = "encode") -> int:
        """Encode, from the text chroma keeps, the chunks ``ids`` whose states the store lacks;
        returns how many."""
        got = self.chroma.get(ids)
        it = iter(got.values())
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(it, total=len(got), desc=desc, unit="chunk")
        n = 0
        for doc, m in it:
            if not self.chunks.store.contains(m["kv_key"]):
                self.chunks.asm.encode_ids(self.chunks.ids(doc, m["source"]), m["kv_key"], self.chunks.canonical_start)
                n += 1
        return n

    def check_kept(self, rep: IngestReport) -> None:
        """An ingest never reports success with states missing: chunks whose states the store
        did not keep (evicted to stay within its budget) are marked lazy (encoded on first use),
        and the report says so."""
        store = self.chunks.store
        lost = [(cid, m) for cid, m in self.chroma.chunks() if not m.get("lazy") and not persisted(store, m["kv_key"])]
        if not lost:
            return
        self.chroma.update_metadata([c for c, _ in lost], [{**m, "lazy": True} for _c, m in lost])
        rep.chunks_lazy += len(lost)
        msg = (f"the store kept the states of all but {len(lost)} chunks within its budget of "
               f"{human(self.chunks.store.budget_bytes())}: those are now encoded on first use (raise --disk-budget "
               f"to keep them)")
        rep.notes.append(msg)
        log.warning(msg)

    def set_aside_skipped_uploads(self, rep: IngestReport, upload_dir: Path) -> None:
        root = upload_dir.resolve()
        for path, why in rep.skipped:
            p = Path(path)
            if p.parent.resolve() == root and p.is_file():
                dest = root / ".skipped" / p.name
                dest.parent.mkdir(exist_ok=True)
                os.replace(p, dest)
                rep.notes.append(f"{p.name}: moved to {dest.parent} ({why})")

    def say(self, progress: bool, msg: str) -> None:
        if progress:
            from tqdm.auto import tqdm

            tqdm.write(msg, file=sys.stderr)
        else:
            log.info(msg)


class Bar:
    """A tqdm bar (when ``progress``) that also reports to ``on_progress(stage, done, total)``."""

    def __init__(self, progress: bool, on_progress, stage: str, total: int, **tqdm_args):
        self.cb, self.stage, self.total, self.n = on_progress, stage, total, 0
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, **tqdm_args)
        if self.cb:
            self.cb(stage, 0, total)

    def update(self, n: int) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        if self.cb:
            self.cb(self.stage, min(self.n, self.total), self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def file_size(f: Path) -> int:
    try:
        return f.stat().st_size
    except OSError:
        return 0


def duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def pending_uploads(index, folder: Path) -> list[Path]:
    """Supported files in ``folder`` that no chunk of ``index`` comes from (left by an ingest
    that was killed)."""
    if not folder.is_dir():
        return []
    found = [f.resolve() for f in folder.iterdir()
             if f.is_file() and not f.name.startswith(".") and f.suffix.lower() in SUPPORTED]
    if not found:
        return []
    have = set(index.sources())
    return sorted(f for f in found if str(f) not in have)
