"""The errors the service answers with before anything streams: a full queue (:class:`Busy`)
and a request it cannot answer as asked (:class:`RequestError`, with its HTTP status)."""

from __future__ import annotations

#: Longest question accepted, in characters (checked before tokenizing; the model's
#: context is checked after).
MAX_QUESTION_CHARS = 16_000


class Busy(RuntimeError):
    """The queue is full; ``retry_after`` is a guess in whole seconds."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"the server is busy: {waiting} questions are waiting; retry in about {retry_after} s")
        self.retry_after = retry_after


class RequestError(ValueError):
    """A request the service cannot answer as asked; ``status`` is the HTTP status to send,
    ``param`` the request field at fault and ``code`` a machine-readable reason (OpenAI's
    error fields), when known."""

    def __init__(self, message: str, status: int = 400, retry_after: int | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.param = param
        self.code = code


def check_question(question) -> str:
    """The question stripped, or :class:`RequestError` (empty, too long, not a string, not valid Unicode)."""
    if not isinstance(question, str):
        raise RequestError("the question must be a string")
    q = question.strip()
    if not q:
        raise RequestError("the question is empty")
    if len(q) > MAX_QUESTION_CHARS:
        raise RequestError(f"the question is {len(q)} characters; the limit is {MAX_QUESTION_CHARS}", 413)
    try:
        q.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON can carry "\ud800"; no tokenizer can read it
        raise RequestError(f"the question is not valid Unicode: it holds an unpaired surrogate "
                           f"({q[e.start].encode('unicode_escape').decode()}) at character {e.start}") from None
    return q
