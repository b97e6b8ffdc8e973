"""``pcache-rag serve``: the document-QA web app and the OpenAI-compatible API.

:func:`create_app` builds the FastAPI app around an :class:`AnswerService` (one answering
worker behind a bounded queue); :func:`serve` runs it with uvicorn, behind the checks of
:mod:`.guard` (allowed hosts, same-origin writes, an optional API key, body limits, a
connection cap and a header timeout). Needs the ``serve`` extra (FastAPI, uvicorn,
sse-starlette, python-multipart).
"""

import asyncio
import math
from collections.abc import Sequence

from .app import create_app
from .errors import Busy, RequestError
from .service import AnswerService, fail_in_flight

__all__ = ["AnswerService", "Busy", "RequestError", "create_app", "graceful_server", "serve", "server_config"]


def server_config(app, host: str = "127.0.0.1", port: int = 8000, max_connections: int | None = None,
                  header_timeout: float = 10.0, log_level: str = "info", shutdown_timeout: float = 10.0):
    """The ``uvicorn.Config`` :func:`serve` runs: h11 with at most ``max_connections`` held
    (default: well under the file descriptor limit), request headers due within
    ``header_timeout`` seconds, and a stop (SIGTERM, SIGINT) that waits at most
    ``shutdown_timeout`` seconds for answers in flight before it cancels them (a wedged answer
    never keeps the server up)."""
    import uvicorn

    from .guard import default_max_connections, guarded_protocol

    proto = guarded_protocol(max_connections or default_max_connections(), header_timeout)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=proto,
                          timeout_keep_alive=5, h11_max_incomplete_event_size=64 << 10,
                          timeout_graceful_shutdown=max(1, math.ceil(shutdown_timeout)))  # uvicorn takes whole seconds


def serve(rag, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 64, max_new_tokens: int = 128,
          max_batch: int = 16, prefill_tokens: int = 128, max_upload_mb: float = 20.0, log_level: str = "info",
          allowed_hosts=None, api_key: str | Sequence[str] | None = None, max_connections: int | None = None,
          header_timeout: float = 10.0, shutdown_timeout: float = 10.0, stall_timeout: float | None = 120.0) -> None:
    """Serve ``rag`` (a :class:`~pcache_rag.rag.CachedRAG`) until interrupted. ``allowed_hosts``
    defaults to the names of ``host`` (see :func:`~.guard.allowed_hosts_for`); ``stall_timeout``
    as :class:`AnswerService` takes it."""
    from .guard import allowed_hosts_for

    app = create_app(AnswerService(rag, max_queue=max_queue, max_new_tokens=max_new_tokens, max_batch=max_batch,
                                   prefill_tokens=prefill_tokens, stall_timeout=stall_timeout),
                     max_upload_mb=max_upload_mb, api_key=api_key,
                     allowed_hosts=allowed_hosts if allowed_hosts is not None else allowed_hosts_for(host))
    graceful_server(server_config(app, host, port, max_connections, header_timeout, log_level,
                                  shutdown_timeout)).run()


def graceful_server(config):
    """A ``uvicorn.Server`` for ``config`` (:func:`server_config`) whose stop ends what is in
    flight with a clear error: answers still running half a second before the shutdown timeout
    get an ``error`` (503, code ``shutting_down``) in their stream, or as their response, and
    their connections close cleanly; uvicorn cancels whatever is left at the timeout. The
    service's streams wait that long before sse-starlette ends them on the signal
    (:attr:`AnswerService.shutdown_grace_s`), so the error reaches their clients."""
    import uvicorn

    service = getattr(getattr(config.app, "state", None), "service", None)
    grace = max(0.5, (config.timeout_graceful_shutdown or 1) - 0.5)
    if service is not None:
        service.shutdown_grace_s = grace

    class GracefulServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            timer = None
            if service is not None:
                timer = asyncio.get_running_loop().call_later(grace, fail_in_flight, service,
                                                              "the server is shutting down: this answer was stopped")
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

    return GracefulServer(config)
