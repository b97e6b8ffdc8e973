"""The remote tier: states shared through a Redis (or Valkey) server, via redis-py.

Several answering processes, on one machine or many, point at one server: what one
encodes, the others read. Entries are the disk tier's exact bytes (``sha256 || safetensors``,
see :func:`~pcache_rag.store.codec.encode_entry`), so a damaged value is detected the same
way, dropped, and re-encoded by the engine. Keys are the store's fingerprints under a
prefix, so two models can share a server without ever reading each other's states.

Layout of one entry (``P`` = prefix, ``K`` = fingerprint key)::

    P:K          "pcache-remote-1 <parts> <bytes>"   the header, written last
    P:K:0 ...    the value, split into parts of at most ``part_bytes`` (Redis values are
                 capped at 512 MB, and big single values stall the server)

Parts and header are written in one MULTI/EXEC transaction, so a reader sees all or
nothing. The server's own eviction (``maxmemory`` + ``maxmemory-policy allkeys-lru``) is
the budget: an entry with a part evicted reads as a miss and is removed.

A server that is down or slow (socket timeouts), or that does not speak Redis (a URL that
points at an HTTP port), never fails an answer: the tier logs one warning, counts itself
down, and is skipped for ``retry_s`` seconds; after that it tries again and says when it
is back. Every other Redis error (a full server with ``noeviction``, a key of another type,
a read-only replica, missing permissions) is a miss or a skipped write for that call, with
one warning per kind of error. A header is checked against sane bounds (at most
:data:`MAX_PARTS` parts of at least one byte, at most :data:`MAX_ENTRY_BYTES`) before any
part is read. Nothing is unpickled: values are raw bytes.
"""

from __future__ import annotations

import logging
import threading
import time

from ..kv import ModuleKV
from .base import KVStore, TierStats
from .codec import decode_entry, encode_entry

log = logging.getLogger(__name__)
_HEADER = "pcache-remote-1"
#: bounds a header must meet before its parts are read (a header claiming millions of parts
#: would cost seconds per read)
MAX_PARTS = 4096
MAX_ENTRY_BYTES = 64 << 30


class RemoteTier(KVStore):
    """KV entries on the Redis server at ``url`` (``redis://host:port/db``, ``rediss://`` for
    TLS, ``unix://`` for a socket). ``timeout`` bounds every call in seconds."""

    name = "remote"
    shared = True

    def __init__(self, url: str, prefix: str = "pcache", timeout: float = 2.0, part_bytes: int = 32 << 20,
                 retry_s: float = 5.0):
        try:
            import redis
        except ImportError as e:  # pragma: no cover - redis is a base dependency
            raise ImportError("the remote tier needs redis-py: pip install redis") from e
        self.url = url
        self.prefix = prefix
        self.part_bytes = int(part_bytes)
        self.retry_s = float(retry_s)
        # the server is unreachable, slow, or not a Redis server: skip the tier for a while
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                        redis.exceptions.InvalidResponse, OSError)
        # the server answered with an error for this call: a miss or a skipped write
        self._refusals = (redis.exceptions.RedisError,)
        self._warned: set[str] = set()
        self._r = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                       health_check_interval=30)
        self._stats = TierStats()
        self._down_until = 0.0
        self._down = False
        self._lock = threading.Lock()
        self.failures = 0  # calls that found the server down, slow, or refusing
        self._counted_at = -1e9

    # ------------------------------------------------------------------ availability

    def _call(self, what: str, fn, default):
        """Run ``fn(redis)``. If the server is down, slow or not Redis, warn once, skip the
        tier for ``retry_s`` seconds and return ``default``; if it refuses this call (any other
        Redis error), return ``default`` with one warning per kind of error."""
        if self._down and time.monotonic() < self._down_until:
            return default
        try:
            out = fn(self._r)
        except self._refusals as e:
            if isinstance(e, self._errors):
                return self._went_down(what, e, default)
            kind = f"{type(e).__name__} {str(e).split(' ', 1)[0]}"
            with self._lock:
                self.failures += 1
                first = kind not in self._warned
                self._warned.add(kind)
            if first:
                log.warning("remote KV tier %s refused %s (%s: %s): %s; warned once for this kind of error",
                            self._shown(), what, type(e).__name__, _reason(e),
                            "the write is skipped" if what == "put" else "read as a miss")
            return default
        except self._errors as e:
            return self._went_down(what, e, default)
        if self._down:
            with self._lock:
                if self._down:
                    log.warning("remote KV tier %s is back", self._shown())
                    self._down = False
        return out

    def _went_down(self, what: str, e: BaseException, default):
        """Count the tier down for ``retry_s`` seconds (one warning until it is back)."""
        with self._lock:
            self.failures += 1
            if not self._down:
                log.warning("remote KV tier %s is unreachable or not a Redis server (%s: %s) during %s: answering "
                            "from local tiers; retrying every %gs", self._shown(), type(e).__name__, e, what,
                            self.retry_s)
            self._down = True
            self._down_until = time.monotonic() + self.retry_s
        return default

    def _shown(self) -> str:
        """The URL without a password."""
        scheme, sep, rest = self.url.partition("://")
        return f"{scheme}{sep}{rest.rsplit('@', 1)[-1]}"

    # ------------------------------------------------------------------ entries

    def _k(self, key: str) -> str:
        return f"{self.prefix}:{key}"

    def contains(self, key: str) -> bool:
        """Whether ``key`` holds an entry :meth:`get` would read: its header is there and sound
        (a key of another type, or a damaged header, is not an entry). One round trip."""
        head = self._call("contains", lambda r: r.getrange(self._k(key), 0, 63), b"")
        try:
            _parse_head(head)
        except ValueError:
            return False
        return True

    def get(self, key: str) -> ModuleKV | None:
        t0 = time.perf_counter()
        head = self._call("get", lambda r: r.get(self._k(key)), None)
        if head is None:
            self._stats.misses += 1
            return None
        try:
            n, size = _parse_head(head)
        except ValueError:
            return self._drop(key, f"unreadable header ({len(head)} bytes)")
        parts = self._call("get", lambda r: r.mget([f"{self._k(key)}:{i}" for i in range(n)]), None)
        if parts is None:
            self._stats.misses += 1
            return None
        if any(p is None for p in parts):
            return self._drop(key, "a part is missing (evicted by the server?)")
        data = b"".join(parts)
        if len(data) != size:
            return self._drop(key, f"{len(data)} bytes instead of {size}")
        try:
            kv = decode_entry(key, data)
        except ValueError as e:
            return self._drop(key, str(e))
        self._stats.hits += 1
        self._stats.load_s += time.perf_counter() - t0
        return kv

    def _drop(self, key: str, why: str) -> None:
        log.warning("dropping damaged KV entry %s from %s: %s", key[:16], self._shown(), why)
        self._stats.corrupt += 1
        self._stats.misses += 1
        self.remove(key)
        return None

    def put(self, key: str, kv: ModuleKV) -> list[tuple[str, ModuleKV]]:
        data = encode_entry(key, kv)
        parts = [data[i:i + self.part_bytes] for i in range(0, len(data), self.part_bytes)] or [b""]
        k = self._k(key)

        def write(r):
            with r.pipeline(transaction=True) as p:
                for i, part in enumerate(parts):
                    p.set(f"{k}:{i}", part)
                p.set(k, f"{_HEADER} {len(parts)} {len(data)}")
                p.execute()
            return True

        if self._call("put", write, False):
            self._stats.puts += 1
        return []  # the server evicts by its own policy

    def remove(self, key: str) -> bool:
        k = self._k(key)

        def run(r):
            head = r.get(k)
            try:
                n = _parse_head(head)[0] if head is not None else 0
            except ValueError:  # a damaged header: its parts cannot be named
                n = 0
            keys = [k, *(f"{k}:{i}" for i in range(n))]
            return r.delete(*keys) > 0

        return bool(self._call("remove", run, False))

    def clear(self) -> int:
        """Remove every entry under this tier's prefix (all models); returns how many keys."""
        def run(r):
            n = 0
            for batch in _batched(r.scan_iter(match=f"{self.prefix}:*", count=500), 500):
                n += r.delete(*batch)
            return n

        return int(self._call("clear", run, 0))

    def stats(self) -> TierStats:
        """Counters of this process; ``bytes`` is the server's used memory and ``entries`` the
        entries under this prefix, all models (both 0 while the server is down). The entry
        count scans the keys, so it is refreshed at most every 10 s."""
        s = self._stats
        now = time.monotonic()
        if now - self._counted_at >= 10.0:

            def run(r):
                heads = sum(1 for k in r.scan_iter(match=f"{self.prefix}:*", count=1000) if k.count(b":") == 1)
                return int(r.info("memory").get("used_memory", 0)), heads

            s.bytes, s.entries = self._call("stats", run, (0, 0))
            self._counted_at = now
        return s

    def close(self) -> None:
        try:
            self._r.close()
        except self._errors:  # pragma: no cover - closing a dead connection
            pass


def _reason(e: BaseException) -> str:
    """A Redis error's reason without the command it quotes: redis-py names a failed pipeline
    command with its arguments, the stored bytes among them, which never go to the log."""
    msg = str(e)
    if "caused error:" in msg:
        msg = msg.split("caused error:", 1)[1]
    return msg.strip().splitlines()[0][:200] if msg.strip() else type(e).__name__


def _parse_head(head: bytes) -> tuple[int, int]:
    """``(parts, bytes)`` from an entry's header; ``ValueError`` if it is not one or its
    numbers are out of bounds (checked before any part is read)."""
    if not isinstance(head, bytes) or len(head) > 64:
        raise ValueError(f"not a {_HEADER} header")
    tag, n, size = head.decode("ascii").split()
    n, size = int(n), int(size)
    if tag != _HEADER or not 1 <= n <= MAX_PARTS or not 0 <= size <= MAX_ENTRY_BYTES or n > max(size, 1):
        raise ValueError(f"not a {_HEADER} header, or out of bounds")
    return n, size


def _batched(it, n: int):
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch
