"""One request, typed and checked once at the edge: how to decode (:class:`SamplingParams`) and
what to answer (:class:`AnswerRequest`).

The OpenAI layer, the web app's ``/api/ask``, the connectors and :class:`~pcache_rag.rag.CachedRAG`
each build these records from their own conventions (OpenAI's fields, LangChain's and
LlamaIndex's keywords, Python keywords) and hand them down; nothing below them parses or checks
the settings again. A request that cannot be answered as asked is refused here, by name
(:class:`RequestError`, which carries the HTTP status the server sends).

No torch here: the records are built before anything heavy is loaded (``import pcache_rag``
loads no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

#: Longest question accepted, in characters (checked before tokenizing; the model's context is
#: checked after, against the retrieved chunks).
MAX_QUESTION_CHARS = 16_000
#: a plain-model prompt carries its documents: far longer than a question, still bounded
MAX_PROMPT_CHARS = 400_000
#: most chunks one question may retrieve
MAX_K = 32


class RequestError(ValueError):
    """A request that cannot be answered as asked; ``status`` is the HTTP status the server sends,
    ``param`` the request field at fault and ``code`` a machine-readable reason (OpenAI's error
    fields), when known."""

    def __init__(self, message: str, status: int = 400, retry_after: int | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to decode: greedy by default; ``do_sample=True`` samples with ``temperature`` and
    ``top_p`` (``seed`` makes it repeatable). Decoding stops at the model's end token, at any
    string in ``stop`` (excluded from the text) or after ``max_new_tokens``. ``grammar`` (an
    llguidance grammar from :mod:`pcache_rag.grammar`, e.g. ``json_grammar(schema)``)
    constrains every token to it; the answer then ends where the grammar is complete."""

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        object.__setattr__(self, "stop", tuple(s for s in (self.stop or ()) if s))
        if self.grammar is not None:
            from .grammar import check

            check(self.grammar)  # a bad grammar is refused here, not after the prefill

    @classmethod
    def of(cls, params: SamplingParams | None = None, **kw: object) -> SamplingParams:
        """``params`` with the keyword settings applied (``params`` itself, not checked again, when
        there are none); an unknown name is refused (TypeError)."""
        if params is not None and not kw:
            return params
        names = {f.name for f in fields(cls)}
        bad = set(kw) - names
        if bad:
            raise TypeError(f"unexpected arguments: {', '.join(sorted(bad))}")
        base = {f.name: getattr(params, f.name) for f in fields(cls)} if params is not None else {}
        base.update(kw)
        if base.get("stop") is None:
            base["stop"] = ()
        return cls(**base)  # type: ignore[arg-type]

    @classmethod
    def from_frameworks(cls, max_new_tokens: int, temperature: float | None = 0.0, top_p: float | None = 1.0,
                        seed: int | None = None, stop=None, grammar: str | None = None) -> SamplingParams:
        """The frameworks' (and OpenAI's) conventions: ``temperature`` 0 (or None) is greedy, and
        ``top_p`` applies only when sampling."""
        t = float(temperature or 0.0)
        return cls(max_new_tokens=int(max_new_tokens), do_sample=t > 0, temperature=t if t > 0 else 1.0,
                   top_p=float(1.0 if top_p is None else top_p), seed=seed, stop=tuple(stop or ()), grammar=grammar)


def check_question(question, max_chars: int | None = MAX_QUESTION_CHARS) -> str:
    """The question stripped, or :class:`RequestError` (empty, longer than ``max_chars``, not a
    string, not valid Unicode)."""
    if not isinstance(question, str):
        raise RequestError("the question must be a string")
    q = question.strip()
    if not q:
        raise RequestError("the question is empty")
    if max_chars is not None and len(q) > max_chars:
        raise RequestError(f"the question is {len(q)} characters; the limit is {max_chars}", 413)
    try:
        q.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON can carry "\ud800"; no tokenizer can read it
        raise RequestError(f"the question is not valid Unicode: it holds an unpaired surrogate "
                           f"({q[e.start].encode('unicode_escape').decode()}) at character {e.start}") from None
    return q


def check_k(k) -> int | None:
    """``k`` (chunks to retrieve) if it is None or a whole number from 1 to :data:`MAX_K`; else :class:`RequestError`."""
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K):
        raise RequestError(f"k must be a whole number from 1 to {MAX_K}", param="k")
    return k


Turns = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class AnswerRequest:
    """What one client asked, built once at the edge and checked there.

    Exactly one of three inputs:

    * ``question``: the RAG model's question. It is retrieved for (``k`` chunks, the index's
      default when None) and answered after ``history`` (the conversation before it, a system
      message included); ``instruction`` follows the question in the prompt and is not searched
      for (a response format's schema).
    * ``messages``: chat turns ``(role, text)`` for the plain model, answered as sent.
    * ``prompt``: a text prompt for the plain model, answered as written.

    ``sampling`` says how to decode; ``tenant`` whose learned states the prompt reads and adds to;
    ``compare`` also answers the question by full prefill (the web app's side-by-side view).
    ``max_chars``: the longest question (or plain prompt) accepted, in characters; a server sets its
    own (:data:`MAX_QUESTION_CHARS`, :data:`MAX_PROMPT_CHARS`, with status 413), and None (the
    library's default) leaves the length to the model's context, checked after tokenizing.
    """

    question: str | None = None
    history: Turns = ()
    messages: Turns | None = None
    prompt: str | None = None
    instruction: str = ""
    k: int | None = None
    sampling: SamplingParams = SamplingParams()
    tenant: str = ""
    compare: bool = False
    max_chars: int | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("question", "messages", "prompt") if getattr(self, name) is not None]
        if len(given) != 1:
            raise RequestError("give exactly one of a question, chat messages or a prompt"
                               + (f" (got {', '.join(given)})" if given else ""))
        if self.question is not None:
            object.__setattr__(self, "question", check_question(self.question, self.max_chars))
        else:
            if self.history or self.k is not None or self.instruction or self.compare:
                raise RequestError("history, k, instruction and compare belong to a question, not to a plain prompt")
            size = len(self.prompt) if self.prompt is not None else sum(len(c) for _, c in self.messages or ())
            if self.prompt is not None and not self.prompt:
                raise RequestError("the prompt is empty", param="prompt")
            if self.max_chars is not None and size > self.max_chars:
                raise RequestError(f"the prompt is {size} characters; the limit is {self.max_chars}", 413)
        check_k(self.k)
        object.__setattr__(self, "history", tuple((str(r), str(t)) for r, t in self.history))
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple((str(r), str(t)) for r, t in self.messages))
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, not {type(self.sampling).__name__}")

    @property
    def asked(self) -> str:
        """What the prompt reads after the documents: the question, then the instruction (which
        retrieval does not search for)."""
        return (self.question or "") + self.instruction

    @property
    def plain(self) -> bool:
        """Whether the plain model answers it as sent (no retrieval)."""
        return self.question is None


__all__ = ["AnswerRequest", "SamplingParams", "RequestError", "check_question", "check_k", "MAX_QUESTION_CHARS",
           "MAX_PROMPT_CHARS", "MAX_K"]
