"""HTTP helpers shared by the page's API (:mod:`.app`) and the OpenAI-compatible API
(:mod:`.openai_api`): JSON errors, strict JSON bodies, and a job's events as the
request sees them."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from .errors import RequestError
from .service import Job

log = logging.getLogger(__name__)


def error(status: int, message: str, kind: str = "invalid_request_error", retry_after: int | None = None,
          code: str | None = None, param: str | None = None):
    """A JSON error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class CatchAll:
    """ASGI middleware: an exception no handler answered becomes our own 500 (code
    ``internal_error``, one line naming the request's id; the exception's text stays in the
    log), and never reaches uvicorn. Uvicorn closes the connection of an app that raised, even
    after a complete response, so a keep-alive client's next request on it was reset. A
    response already started when the exception came is left unfinished: uvicorn then closes
    that connection, which is the truthful end of a half-sent answer."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:  # noqa: BLE001 - the point: no exception reaches the server
            rid = uuid.uuid4().hex[:12]
            log.exception("%s %s failed (request %s)", scope.get("method"), scope.get("path"), rid)
            if not started:
                await error(500, f"the request failed inside the server (request {rid}; its log has why)",
                            "server_error", code="internal_error")(scope, receive, send)


async def body_json(request: Request) -> dict:
    """The request body as a JSON object, or :class:`RequestError` saying what is wrong.
    Only ``application/json`` bodies are read: a form or ``text/plain`` post, which a page on
    another site can send without asking, is refused (415)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise RequestError(f"the body must be sent as Content-Type: application/json, not {kind or 'nothing'!r}", 415)
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError("the body's JSON is nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError("the body must be a JSON object")
    return data


async def first_event(job: Job, request: Request | None = None):
    """The job's first event; an ``error`` first means nothing was streamed yet, so the
    caller can still answer with an HTTP error status. A client that disconnects while its
    question waits in the queue cancels it (checked each second)."""
    while True:
        try:
            ev = await asyncio.wait_for(job.events.get(), 1.0)
            break
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                job.cancel()
                raise RequestError("the client disconnected", 499) from None
    if ev is None:
        raise RequestError("the question was dropped", 500)
    if ev[0] == "error":
        raise RequestError(ev[1]["message"], ev[1].get("status", 500), ev[1].get("retry_after"), code=ev[1].get("code"))
    return ev


async def events_of(job: Job):
    """The job's remaining events until it ends; cancels the job if the consumer stops."""
    try:
        while True:
            ev = await job.events.get()
            if ev is None:
                return
            yield ev
    finally:
        job.cancel()  # a client that went away frees the engine at its next token
