"""What the server checks before a request reaches the app, and how it holds connections.

:class:`Guard` is an ASGI middleware; in order, per HTTP request:

1. **Host** (DNS rebinding): the ``Host`` header must name an address the server is bound
   to, ``localhost``, or a name given with ``--allowed-host``. A page on ``evil.example``
   whose name an attacker points at 127.0.0.1 is refused (400).
2. **Origin** (cross-site requests): a state-changing request (any method but GET, HEAD and
   OPTIONS) whose ``Origin`` is not this server's own, or whose ``Sec-Fetch-Site`` says it
   came from another site, is refused (403). Browsers send both, even on ``no-cors``
   requests; clients that are not browsers send neither and are not affected.
3. **API key** (optional): with ``api_key`` set (one key, or several: one per client), every
   ``/v1`` and ``/api`` request, and the API's own description (``/docs``, ``/redoc``,
   ``/openapi.json``), needs ``Authorization: Bearer <key>``, as OpenAI clients send it (401
   otherwise). The page and its assets stay open, and the page asks for the key. The key a
   request was let in with names its tenant (``scope["state"]["tenant"]``,
   :func:`~pcache_rag.store.learned.tenant_id`): what its prompts teach is kept for that key
   alone. Without keys every client is the one tenant ``""``.
4. **Size before body**: a ``Content-Length`` over the limit is refused (413) before a byte
   of the body is read, and a body without one is counted as it streams and cut at the
   limit. Uploads (``POST /api/documents``) have their own, larger limit.

Errors are JSON in OpenAI's shape. Starlette ships ``TrustedHostMiddleware`` for the first
check, but it answers in plain text and knows nothing of origins, keys or sizes; one small
middleware keeps the four checks, their order and their error shape in one place.

:class:`GuardedH11Protocol` is uvicorn's h11 protocol with two limits uvicorn lacks: a
connection must finish its request headers within ``header_timeout`` seconds (slow-header
attacks), and at most ``max_connections`` are held, well under the process's file
descriptor limit. When the cap is reached, the oldest connection still waiting for its
headers is closed to make room (a slow-header flood cannot lock out a real client); when
none is, the new connection is closed.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException

from ..store.learned import tenant_id

log = logging.getLogger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
UPLOAD_PATH = "/api/documents"


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a body passes its limit: a 413 (an HTTP exception, so the
    frameworks' body parsers pass it on instead of calling it a parse error)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than the limit of {_human(limit)}")
        self.limit = limit


def _human(n: int) -> str:
    return f"{n / (1 << 20):g} MB" if n >= 1 << 20 else f"{n / 1024:g} KB"


def host_name(value: str) -> str:
    """The host of a ``Host`` header or URL netloc, lower-cased, without port or brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    if value.count(":") > 1:  # a bare IPv6 address
        return value
    return value.rsplit(":", 1)[0] if ":" in value else value


def allowed_hosts_for(bind: str, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The ``Host`` names a server bound to ``bind`` answers: that address, the loopback
    names, and ``extra``. A wildcard bind (0.0.0.0, ::) adds this machine's host names.
    ``"*"`` in ``extra`` turns the check off."""
    import socket

    hosts = {host_name(bind), *LOOPBACK_NAMES}
    if bind in ("0.0.0.0", "::", ""):
        hosts.discard(host_name(bind))
        for name in (socket.gethostname(), socket.getfqdn()):
            if name:
                hosts.add(name.lower())
    hosts.update(host_name(h) if h != "*" else "*" for h in extra)
    return sorted(hosts)


def _error(status: int, message: str, kind: str, code: str | None = None, headers=()) -> tuple[dict, dict]:
    """The two ASGI messages of a JSON error in OpenAI's shape."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *headers]}
    return start, {"type": "http.response.body", "body": body}


#: paths that need the API key besides everything under /v1/ and /api/ (the API's description)
KEYED_PATHS = ("/v1", "/api", "/openapi.json", "/docs", "/redoc")


class Guard:
    """The checks above, in front of ``app``. ``allowed_hosts``: names accepted in ``Host``
    (``"*"``: any); ``api_key``: the bearer token, several (a sequence: one per client, each its
    own tenant), or None; ``json_limit`` and ``upload_limit``: the largest bodies, in bytes."""

    def __init__(self, app, allowed_hosts=LOOPBACK_NAMES, api_key: str | Sequence[str] | None = None,
                 json_limit: int = 2 << 20, upload_limit: int = 160 << 20):
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.hosts = {host_name(h) for h in allowed_hosts if h != "*"}
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        self.api_keys = tuple(k for k in keys if k)
        self.json_limit = int(json_limit)
        self.upload_limit = int(upload_limit)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refused = self._check(scope, headers)
        if refused is not None:
            start, body = refused
            await send(start)
            await send(body)
            return
        limit = self.upload_limit if scope["path"] == UPLOAD_PATH else self.json_limit
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            start, body = _error(413, f"the request body is {_human(int(length))}, more than the limit of "
                                         f"{_human(limit)}", "invalid_request_error", "request_too_large",
                                    [(b"connection", b"close")])
            await send(start)
            await send(body)
            return
        seen = 0
        started = False

        async def counted_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return msg

        async def watched_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge as e:
            if started:
                raise
            start, body = _error(413, str(e.detail), "invalid_request_error", "request_too_large",
                                    [(b"connection", b"close")])
            await send(start)
            await send(body)

    def _check(self, scope, headers: dict):
        host = headers.get("host", "")
        if not self.any_host and host_name(host) not in self.hosts:
            return _error(400, f"this server does not answer for the host {host!r}; start it with --allowed-host "
                               f"{host_name(host) or 'NAME'} to allow it", "invalid_request_error", "host_not_allowed")
        if scope["method"] not in SAFE_METHODS:
            site = headers.get("sec-fetch-site")
            origin = headers.get("origin")
            if site is not None and site not in ("same-origin", "none"):
                return _error(403, f"cross-site request refused (Sec-Fetch-Site: {site})", "permission_error",
                              "cross_site")
            if origin is not None and not self._same_origin(origin, host, scope.get("scheme", "http")):
                return _error(403, f"cross-origin request refused (Origin: {origin})", "permission_error",
                              "cross_origin")
        path = scope["path"]
        if self.api_keys and (path.startswith(("/v1/", "/api/", "/docs", "/redoc")) or path in KEYED_PATHS):
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            sent = token.strip().encode()
            match = None
            for key in self.api_keys:  # every key compared, in constant time each: no early exit to time
                if hmac.compare_digest(sent, key.encode()):
                    match = key
            if scheme.lower() != "bearer" or match is None:
                what = "no API key was sent" if not auth else "the API key is not valid"
                return _error(401, f"{what}: send it as 'Authorization: Bearer KEY' (the server's --api-key or "
                                   f"PCACHE_RAG_API_KEY)", "invalid_request_error", "invalid_api_key",
                              [(b"www-authenticate", b"Bearer")])
            scope.setdefault("state", {})["tenant"] = tenant_id(match)
        return None

    @staticmethod
    def _same_origin(origin: str, host: str, scheme: str) -> bool:
        if origin == "null":
            return False
        try:
            o = urlsplit(origin)
            h = urlsplit(f"{scheme}://{host}")
            default = {"http": 80, "https": 443}
            return (o.scheme == scheme and (o.hostname or "") == (h.hostname or "")
                    and (o.port or default.get(o.scheme)) == (h.port or default.get(scheme)))
        except ValueError:
            return False


def _protocol_base():
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


def guarded_protocol(max_connections: int, header_timeout: float):
    """uvicorn's h11 protocol class with a connection cap and a header timeout (see the
    module's docstring); pass it as ``uvicorn.Config(http=...)``."""
    base = _protocol_base()

    class GuardedH11Protocol(base):
        _max = int(max_connections)
        _timeout = float(header_timeout)

        def connection_made(self, transport):
            super().connection_made(transport)
            self._born = time.monotonic()
            self._seen_cycle = None
            self._header_timer = None
            self._start_header_timer()
            if len(self.connections) > self._max:
                waiting = [c for c in self.connections
                           if c is not self and getattr(c, "_header_timer", None) is not None]
                victim = min(waiting, key=lambda c: c._born) if waiting else self
                victim._drop("the server is at its connection limit")

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._seen_cycle:
                self._seen_cycle = self.cycle  # a request's headers are complete
                self._stop_header_timer()
            elif self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._start_header_timer()  # the next request on a kept-alive connection has begun

        def connection_lost(self, exc):
            self._stop_header_timer()
            super().connection_lost(exc)

        def _start_header_timer(self):
            self._header_timer = self.loop.call_later(self._timeout, self._drop, "slow request headers")

        def _stop_header_timer(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _drop(self, why: str):
            self._stop_header_timer()
            if not self.transport.is_closing():
                log.debug("closing a connection from %s: %s", self.client, why)
                self.transport.close()

    GuardedH11Protocol.__qualname__ = GuardedH11Protocol.__name__ = "GuardedH11Protocol"
    return GuardedH11Protocol


def default_max_connections() -> int:
    """Connections held at once: 1,024, or fewer where the file descriptor limit is low
    (a quarter of it is kept for the model, the store and the index)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 256
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(16, min(1024, soft * 3 // 4))
