"""``pcache-rag serve``: the document-QA web app and the OpenAI-compatible API.

:func:`create_app` builds the FastAPI app around an :class:`AnswerService` (one answering
worker behind a bounded queue); :func:`serve` runs it with uvicorn. Needs the ``serve``
extra (FastAPI, uvicorn, sse-starlette, python-multipart).
"""

from .app import create_app
from .service import AnswerService, Busy, RequestError

__all__ = ["AnswerService", "Busy", "RequestError", "create_app", "serve"]


def serve(rag, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 64, max_new_tokens: int = 128,
          max_upload_mb: float = 20.0, log_level: str = "info") -> None:
    """Serve ``rag`` (a :class:`~pcache_rag.rag.CachedRAG`) until interrupted."""
    import uvicorn

    app = create_app(AnswerService(rag, max_queue=max_queue, max_new_tokens=max_new_tokens),
                     max_upload_mb=max_upload_mb)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
