"""The disk tier: diskcache in a directory the user names, tensors as safetensors.

Each entry is the bytes of :mod:`.codec` (checksum + safetensors). On read the checksum,
the format and the key are verified; a damaged entry is dropped, logged and reported as a
miss, so the engine re-encodes it. Nothing is ever unpickled.

diskcache writes a value's file before committing its index row in SQLite, so
a process killed during a write leaves no visible entry, and several processes
may share one directory.

The index database can itself be damaged (a flipped byte, a truncated file).
A cache must never take the application down: the tier checks the database
when it opens it and whenever SQLite reports damage, moves the whole directory
aside as ``<dir>.damaged-<time>`` (kept for inspection), starts an empty one and
logs one warning; the engine re-encodes on demand. ``contains`` agrees with
``get``: an index row whose value file is gone counts as absent and is dropped.
:meth:`DiskTier.check` lists rows without files and files without rows, and
repairs them.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import time
from pathlib import Path

import diskcache

from ..kv import ModuleKV
from ..fsutil import quarantine
from .base import KVStore, TierStats
from .codec import decode_entry, encode_entry

log = logging.getLogger(__name__)
_DC_POLICY = {"lru": "least-recently-used", "lfu": "least-frequently-used", "none": "none"}


def _is_damage(e: BaseException) -> bool:
    """Errors that mean a damaged file (not a busy or locked one): SQLite's own, and text
    that cannot be decoded (a flipped byte in the schema makes even the error text undecodable)."""
    if isinstance(e, UnicodeDecodeError):
        return True
    msg = str(e).encode("utf-8", "backslashreplace").decode().lower()
    return isinstance(e, sqlite3.DatabaseError) and any(
        w in msg for w in ("malformed", "not a database", "corrupt", "no such table", "disk i/o error",
                           "no such column", "unsupported file format", "schema")
    )


def _printable(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".encode("utf-8", "backslashreplace").decode("utf-8")


class DiskTier(KVStore):
    """KV entries in ``directory`` (diskcache), within ``size_limit`` bytes."""

    name = "disk"
    persistent = True

    def __init__(self, directory: str | Path, size_limit: int | None = None, policy: str = "lru"):
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)
        if size_limit is None:
            size_limit = int(min(shutil.disk_usage(self.directory).free * 0.5, 64 << 30))
        elif isinstance(size_limit, bool) or not size_limit > 0:
            raise ValueError(f"the disk budget must be a positive number of bytes, not {size_limit!r}")
        if policy not in _DC_POLICY:
            raise ValueError(f"disk eviction policy must be one of {sorted(_DC_POLICY)}, not {policy!r}")
        self.size_limit = int(size_limit)
        self._policy = policy
        #: where a damaged directory was moved, if that happened in this process
        self.quarantined: list[Path] = []
        self._stats = TierStats()
        self._dc = self._open()

    def _open(self) -> diskcache.Cache:
        db = self.directory / "cache.db"
        try:
            if db.exists() and db.stat().st_size > 0:
                con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
                try:
                    con.text_factory = bytes  # damaged schema text must not fail the check itself
                    res = con.execute("PRAGMA quick_check").fetchone()
                finally:
                    con.close()
                if not res or res[0] != b"ok":
                    shown = res[0].decode("utf-8", "backslashreplace")[:200] if res else "no answer"
                    raise sqlite3.DatabaseError(f"database disk image is malformed ({shown})")
            return self._make()
        except (sqlite3.DatabaseError, UnicodeDecodeError) as e:
            # any failure to read the database is damage, except SQLite's operational errors
            # (locked, busy, cannot open: another process or the permissions) that are not
            if isinstance(e, sqlite3.OperationalError) and not _is_damage(e):
                raise
            return self._rebuild(e)

    def _make(self) -> diskcache.Cache:
        return diskcache.Cache(
            str(self.directory),
            size_limit=self.size_limit,
            eviction_policy=_DC_POLICY[self._policy],
            statistics=False,
            disk_min_file_size=0,  # every entry is a file: one integrity story for all sizes
        )

    def _rebuild(self, err: BaseException) -> diskcache.Cache:
        old = getattr(self, "_dc", None)
        if old is not None:
            try:
                old.close()
            except Exception:  # noqa: BLE001 - closing a damaged database may fail too
                pass
        moved = quarantine(self.directory)
        self.quarantined.append(moved)
        self._stats.corrupt += 1
        log.warning("KV store index %s is damaged (%s): moved to %s, starting empty; states are re-encoded on use",
                    self.directory / "cache.db", _printable(err), moved)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._dc = self._make()
        return self._dc

    def _guard(self, fn, *args, **kw):
        """Run a diskcache call; on database damage rebuild once and run it again."""
        try:
            return fn(self._dc, *args, **kw)
        except (sqlite3.DatabaseError, UnicodeDecodeError) as e:
            if not _is_damage(e):
                raise
            self._rebuild(e)
            return fn(self._dc, *args, **kw)

    def _file_of(self, dc: diskcache.Cache, key: str):
        """``(row exists, value file path or None)``. diskcache has no public call for the file
        name of an entry, so its documented ``Cache`` table is read directly."""
        row = dc._sql("SELECT filename FROM Cache WHERE key = ? AND raw = 1", (key,)).fetchone()
        if row is None:
            return False, None
        return True, (self.directory / row[0]) if row[0] else None

    def contains(self, key: str) -> bool:
        def run(dc):
            exists, f = self._file_of(dc, key)
            return exists and (f is None or f.exists())

        return self._guard(run)

    def get(self, key: str) -> ModuleKV | None:
        t0 = time.perf_counter()
        data = self._guard(lambda dc: dc.get(key, default=None, retry=True))
        if data is None:
            self._stats.misses += 1
            if self._guard(lambda dc: self._file_of(dc, key)[0]):
                # a row whose value file is gone: drop it so the next put writes it back
                log.warning("dropping KV entry %s from %s: its value file is missing", key[:16], self.directory)
                self._stats.corrupt += 1
                self._guard(lambda dc: dc.delete(key, retry=True))
            return None
        try:
            kv = decode_entry(key, bytes(data))
        except ValueError as e:
            log.warning("dropping damaged KV entry %s from %s: %s", key[:16], self.directory, e)
            self._stats.corrupt += 1
            self._stats.misses += 1
            self._guard(lambda dc: dc.delete(key, retry=True))
            return None
        self._stats.hits += 1
        self._stats.load_s += time.perf_counter() - t0
        return kv

    def put(self, key: str, kv: ModuleKV) -> list[tuple[str, ModuleKV]]:
        blob = encode_entry(key, kv)
        self._guard(lambda dc: dc.set(key, blob, retry=True))
        self._stats.puts += 1
        return []  # diskcache culls by its own policy; the last tier has nowhere to demote to

    def remove(self, key: str) -> bool:
        return bool(self._guard(lambda dc: dc.delete(key, retry=True)))

    def keys(self) -> list[str]:
        return self._guard(lambda dc: list(dc.iterkeys()))

    def budget_bytes(self) -> int:
        return self.size_limit

    def check(self, repair: bool = False) -> list[str]:
        """Problems of the directory: index rows whose value file is missing, and value files
        no row names (left by a truncated or replaced index). With ``repair`` they are removed.
        (Damaged values are found, and dropped, when read.)"""

        def run(dc):
            rows = dc._sql("SELECT key, filename FROM Cache WHERE filename IS NOT NULL").fetchall()
            named = set()
            problems = []
            for key, fn in rows:
                named.add(os.path.normpath(fn))
                if not (self.directory / fn).exists():
                    problems.append(f"kv entry {str(key)[:16]}: value file {fn} is missing")
                    if repair:
                        dc.delete(key, retry=True)
            for root, _dirs, files in os.walk(self.directory):
                for f in files:
                    if not f.endswith(".val"):
                        continue
                    rel = os.path.normpath(os.path.relpath(os.path.join(root, f), self.directory))
                    if rel not in named:
                        problems.append(f"kv file {rel} belongs to no entry")
                        if repair:
                            os.remove(os.path.join(self.directory, rel))
            return problems

        return self._guard(run)

    def close(self) -> None:
        self._dc.close()

    def stats(self) -> TierStats:
        s = self._stats
        s.bytes = int(self._guard(lambda dc: dc.volume()))
        s.entries = self._guard(lambda dc: len(dc))
        return s
