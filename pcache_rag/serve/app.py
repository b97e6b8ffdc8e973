"""The FastAPI app: the document-QA page, its JSON/SSE API under ``/api``, and the
OpenAI-compatible API under ``/v1`` (see :mod:`.openai_api`).

Every asset is served from the package's ``static/`` folder: no CDN, font or analytics,
so the page works offline. Errors are JSON ``{"error": {"message", "type"}}`` with the
status that fits (400 bad input, 409 conflict, 413 too large, 415 unsupported type,
503 + ``Retry-After`` when the queue is full).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..rag.chunking import SUPPORTED
from ..request import MAX_QUESTION_CHARS, AnswerRequest
from .guard import LOOPBACK_NAMES, Guard
from .http import CatchAll, body_json, error, events_of, first_event
from .openai_api import router as openai_router
from .errors import Busy, RequestError
from .service import AnswerService, service_health

STATIC = Path(__file__).parent / "static"
_SAFE = re.compile(r"[^A-Za-z0-9._ -]+")


def safe_upload_name(name: str | None) -> str:
    """A file name that stays inside the upload folder: the last path component only,
    characters outside ``[A-Za-z0-9._ -]`` replaced, no leading dots; :class:`RequestError`
    if nothing usable is left or the type is not supported."""
    base = (name or "").replace("\\", "/").split("/")[-1]
    clean = _SAFE.sub("_", base).strip(" .")[:120]
    if not clean or not any(c.isalnum() for c in clean):
        raise RequestError(f"unusable file name {name!r}")
    if Path(clean).suffix.lower() not in SUPPORTED:
        raise RequestError(f"{clean}: unsupported file type {Path(clean).suffix or '(none)'!r}; supported: "
                           f"{', '.join(SUPPORTED)}", 415)
    return clean


def create_app(service: AnswerService, max_upload_mb: float = 20.0, allowed_hosts=LOOPBACK_NAMES,
               api_key: str | Sequence[str] | None = None, max_request_mb: float | None = None, max_json_kb: int = 2048) -> FastAPI:
    """The app around ``service``; it starts the service's worker on startup and stops it
    on shutdown. ``max_upload_mb`` bounds each uploaded file and ``max_request_mb`` one upload
    request (default: 8 files' worth); ``max_json_kb`` bounds every other body. Requests pass
    :class:`~.guard.Guard` first: ``Host`` among ``allowed_hosts`` (``"*"``: any),
    state-changing requests from this server's own origin only, and with ``api_key`` a bearer
    token on ``/v1`` and ``/api``."""
    @asynccontextmanager
    async def lifespan(app):
        await asyncio.to_thread(service.warm)
        service.start()
        await asyncio.to_thread(service.uploads.resume)
        yield
        service.stop()

    app = FastAPI(title="pcache-rag", summary="document QA from cached attention states", lifespan=lifespan)
    app.state.service = service
    max_bytes = int(max_upload_mb * 1024 * 1024)
    request_bytes = int((max_request_mb if max_request_mb is not None else 8 * max_upload_mb) * 1024 * 1024)
    app.add_middleware(Guard, allowed_hosts=tuple(allowed_hosts), api_key=api_key, json_limit=int(max_json_kb) * 1024,
                       upload_limit=request_bytes + (64 << 10))  # room for the form's own framing
    app.add_middleware(CatchAll)  # added last: outermost of ours, so nothing unanswered reaches uvicorn

    @app.exception_handler(RequestError)
    async def _request_error(_req, e: RequestError):
        return error(e.status, str(e), retry_after=e.retry_after, code=e.code, param=e.param)

    @app.exception_handler(Busy)
    async def _busy(_req, e: Busy):
        return error(503, str(e), "server_busy", retry_after=e.retry_after)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, e: RequestValidationError):
        parts = [f"{'.'.join(str(x) for x in d.get('loc', ()) if x != 'body') or 'body'}: {d.get('msg')}"
                 for d in e.errors()]
        return error(400, "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, e: StarletteHTTPException):
        code = {404: "not_found", 413: "request_too_large", 405: "method_not_allowed"}.get(e.status_code)
        return error(e.status_code, str(e.detail), "not_found" if e.status_code == 404 else "invalid_request_error",
                     code=code)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html")

    @app.get("/healthz")
    async def health():
        """200 ``{"ok": true}``; 503 with the reason while the service is stalled (service_health)."""
        ok, why = service_health(service)
        return {"ok": True} if ok else JSONResponse({"ok": False, "reason": why}, status_code=503)

    @app.get("/api/status")
    async def status():
        return await asyncio.to_thread(service.stats)

    @app.get("/api/ingest")
    async def ingest_status():
        return service.uploads.status()

    @app.post("/api/documents", status_code=202)
    async def upload(files: list[UploadFile]):
        """Save the uploaded files under the upload folder and ingest them in the background."""
        if not files:
            raise RequestError("no file was uploaded")
        service.uploads.check_idle()  # before writing anything
        names = [safe_upload_name(f.filename) for f in files]  # refuse the lot before writing any
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise RequestError(f"two files in this upload have the same name ({', '.join(twice)}): rename one, or "
                               f"upload them separately (the later one replaces the earlier)")
        service.uploads.upload_dir.mkdir(parents=True, exist_ok=True)
        root = service.uploads.upload_dir.resolve()
        saved = []
        for f, name in zip(files, names):
            dest = (root / name).resolve()
            if dest.parent != root:  # cannot happen after safe_upload_name; checked anyway
                raise RequestError(f"unusable file name {f.filename!r}")
            tmp = dest.with_name(f".{dest.name}.part")
            size = 0
            try:
                with tmp.open("wb") as out:
                    while chunk := await f.read(1 << 20):
                        size += len(chunk)
                        if size > max_bytes:
                            raise RequestError(f"{name} is larger than the {max_upload_mb:g} MB upload limit", 413)
                        out.write(chunk)
                if size == 0:
                    raise RequestError(f"{name} is empty")
                tmp.replace(dest)
            finally:
                tmp.unlink(missing_ok=True)
            saved.append(dest)
        service.uploads.start(saved, label=names)
        return {"files": names, "ingest": "/api/ingest"}

    @app.post("/api/sample", status_code=202)
    async def sample():
        """Ingest the sample corpus (standard-library documentation written on first use)."""
        from ..fsutil import cache_home
        from ..samples import build_corpus

        corpus = await asyncio.to_thread(build_corpus, cache_home() / "sample-corpus")
        files = sorted(corpus.glob("*.txt"))
        service.uploads.start([corpus], label=[f.name for f in files])
        return {"files": [f.name for f in files], "ingest": "/api/ingest"}

    @app.post("/api/forget")
    async def forget_learned(request: Request):
        """Drop what the caller's prompts taught this server (its tenant's learned states, in
        memory); the ingested index is not touched."""
        tenant = getattr(request.state, "tenant", "")
        return {"forgotten": service.rag.asm.learned.forget(tenant)}

    @app.post("/api/ask")
    async def ask(request: Request):
        """``{"question", "k"?, "compare"?, "max_tokens"?}`` -> server-sent events ``start``
        (sources), ``delta`` (answer text), ``done`` (statistics), ``full`` (compare), ``error``."""
        data = await body_json(request)
        unknown = set(data) - {"question", "k", "compare", "max_tokens"}
        if unknown:
            raise RequestError(f"unknown fields: {', '.join(sorted(unknown))}")
        m = data.get("max_tokens")
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= 1024):
            raise RequestError("max_tokens must be a whole number from 1 to 1024")
        job = service.submit(AnswerRequest(question=data.get("question", ""), k=data.get("k"),
                                           compare=bool(data.get("compare")), sampling=service.sampling(m),
                                           tenant=getattr(request.state, "tenant", ""),
                                           max_chars=MAX_QUESTION_CHARS))
        try:
            first = await first_event(job, request)
        except BaseException:
            job.cancel()
            raise

        async def stream():
            yield {"event": first[0], "data": json.dumps(first[1])}
            async for kind, payload in events_of(job):
                yield {"event": kind, "data": json.dumps(payload)}

        return EventSourceResponse(stream(), ping=15, shutdown_grace_period=service.shutdown_grace_s + 1.0)

    app.include_router(openai_router)
    return app
