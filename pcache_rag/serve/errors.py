"""The errors the service answers with before anything streams: a full queue (:class:`Busy`)
and a request it cannot answer as asked (:class:`RequestError`, with its HTTP status, raised where
the request is built: :mod:`pcache_rag.request`)."""

from __future__ import annotations

from ..request import MAX_QUESTION_CHARS, RequestError, check_question

__all__ = ["Busy", "RequestError", "check_question", "MAX_QUESTION_CHARS"]


class Busy(RuntimeError):
    """The queue is full; ``retry_after`` is a guess in whole seconds."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"the server is busy: {waiting} questions are waiting; retry in about {retry_after} s")
        self.retry_after = retry_after
