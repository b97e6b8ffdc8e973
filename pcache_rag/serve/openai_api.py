"""The OpenAI-compatible API: ``GET /v1/models``, ``POST /v1/chat/completions`` and
``POST /v1/completions``.

Two models are served. The **RAG model** (the model's name, or ``pcache-rag``): the last
user message (or the completion's prompt) is the question; retrieval runs over the server's
index and the answer comes from the chunks' cached states, after the conversation's system
message and earlier turns when it has them. The **plain model**
(``<name>-plain``, or ``pcache-rag-plain``): the messages exactly as sent, every role and
every earlier turn (or the prompt as text), with no retrieval; documents the server knows
(its ingested chunks, documents seen before) are found in them and read from the cache.
Stock clients work unchanged with ``base_url="http://127.0.0.1:8000/v1"`` (the ``openai``
package, LangChain's ``ChatOpenAI``, LlamaIndex's ``OpenAILike``, chat or not). Each response
carries an extra ``pcache`` field (sources, time-to-first-token, cached and computed tokens,
notes) that standard clients ignore, and ``usage.prompt_tokens_details.cached_tokens`` says
how much of the prompt was read from the cache. Errors carry OpenAI's ``param`` and ``code``.

Differences from OpenAI, each refused or reported by name, never silent: ``temperature``
defaults to 0 (greedy: answers from documents should not vary); ``n`` must be 1; legacy
``functions``, logprobs, logit bias, non-zero penalties, ``echo``, ``suffix`` and ``best_of``
above 1 are refused (400); ``tools`` are served by the plain model (an agent's loop sends the
whole conversation, tool results last; the RAG model answers a user's question from its own
retrieval and refuses them), with one call per answer unless ``parallel_tool_calls`` is true
(:mod:`pcache_rag.tools`); on the RAG model retrieval runs on the last user message alone, while the
system message and earlier turns go into the prompt before the documents; ``k`` (chunks to
retrieve) may be passed in the body (``extra_body`` in the clients). ``response_format``
(``json_schema``, ``json_object``) constrains decoding by the schema's grammar
(:mod:`pcache_rag.grammar`) and puts the schema after the last user message, for the model to
read; an answer cut by ``max_tokens`` before its JSON is whole says so in ``pcache.notes``.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from .. import tools
from ..grammar import resolve, with_instruction
from ..request import MAX_PROMPT_CHARS, MAX_QUESTION_CHARS, AnswerRequest, SamplingParams
from .http import body_json, events_of, first_event
from .errors import RequestError

router = APIRouter(prefix="/v1")

_IGNORED = {"user", "metadata", "store", "service_tier", "stream_options", "prediction",
            "reasoning_effort", "modalities"}
_SAMPLING = {"model", "temperature", "top_p", "max_tokens", "stop", "seed", "stream", "n", "k", "frequency_penalty",
             "presence_penalty", "logprobs", "logit_bias"}
_KNOWN = _SAMPLING | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                      "function_call", "response_format", "parallel_tool_calls"} | _IGNORED
_KNOWN_TEXT = _SAMPLING | {"prompt", "echo", "suffix", "best_of"} | _IGNORED
_UNSUPPORTED = ("functions", "function_call", "logit_bias", "top_logprobs")
#: the plain model's name is the RAG model's with this suffix
PLAIN = "-plain"
#: chat roles the plain model renders (``developer`` is OpenAI's newer name for system)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _model_ids(service) -> list[str]:
    return [service.model_id, "pcache-rag"]


def _plain_ids(service) -> list[str]:
    return [m + PLAIN for m in _model_ids(service)]


def _is_plain(data: dict, service) -> bool:
    """Whether the body asks for the plain model (else the RAG model); unknown models are a 404."""
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required (see GET /v1/models)", param="model")
    if model in _plain_ids(service):
        return True
    if model in _model_ids(service):
        return False
    raise RequestError(f"model {model!r} is not served here; use one of {_model_ids(service) + _plain_ids(service)}",
                       404, param="model", code="model_not_found")


@router.get("/models")
async def models(request: Request):
    service = request.app.state.service
    return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "pcache-rag"}
                                       for m in _model_ids(service) + _plain_ids(service)]}


def _text(content, param: str = "messages") -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise RequestError(f"only text content is supported, not {kind!r}", param=param)
            parts.append(p["text"])
        return "".join(parts)
    raise RequestError("message content must be a string or a list of text parts", param=param)


def _number(data: dict, name: str, lo: float, hi: float, integer: bool = False):
    v = data.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise RequestError(f"{name} must be a {'whole ' if integer else ''}number", param=name, code="invalid_type")
    if not lo <= v <= hi:
        raise RequestError(f"{name} must be between {lo:g} and {hi:g}, not {v}", param=name, code="invalid_value")
    return v


def _refuse_unknown(data: dict, known: set[str]) -> None:
    unknown = set(data) - known
    if unknown:
        raise RequestError(f"unsupported parameters: {', '.join(sorted(unknown))}", param=sorted(unknown)[0],
                           code="unsupported_parameter")


def _unsupported(name: str) -> RequestError:
    return RequestError(f"{name} is not supported by this server", param=name, code="unsupported_parameter")


def _sampling(data: dict, notes: list[str], default_max: int, max_name: str = "max_tokens",
              grammar: str | None = None) -> SamplingParams:
    """How to decode, from OpenAI's sampling fields (refusing what cannot be honoured by name);
    ``default_max`` new tokens when the body sets no limit."""
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(data, name, -2, 2):
            raise RequestError(f"{name} is not supported by this server (only 0)", param=name,
                               code="unsupported_parameter")
    if data.get("logit_bias"):
        raise _unsupported("logit_bias")
    if (_number(data, "n", 1, 128, integer=True) or 1) != 1:
        raise RequestError("n must be 1", param="n", code="unsupported_value")
    gen: dict = {"max_new_tokens": default_max, "grammar": grammar}
    t = _number(data, "temperature", 0, 2)
    if t:
        gen.update(do_sample=True, temperature=float(t))
    p = _number(data, "top_p", 0, 1)
    if p is not None and p < 1:
        if not t:
            notes.append("top_p has no effect with temperature 0 (greedy)")
        else:
            gen["top_p"] = float(p)
    m = _number(data, max_name, 1, 4096, integer=True) or _number(data, "max_tokens", 1, 4096, integer=True)
    if m is not None:
        gen["max_new_tokens"] = int(m)
    s = _number(data, "seed", -(2**63), 2**63 - 1, integer=True)
    if s is not None:
        gen["seed"] = int(s) % (1 << 62)
    stop = data.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop) or len(stop) > 4:
            raise RequestError("stop must be a string or a list of up to 4 strings", param="stop")
        gen["stop"] = tuple(stop)
    return SamplingParams(**gen)


def parse_request(data: dict, service, tenant: str = "") -> tuple[AnswerRequest, list[str], bool]:
    """The request a chat-completions body asks for (the plain model's messages, or the RAG model's
    question after its earlier turns), the notes for its answer, and whether the answer is read
    for tool calls; or :class:`RequestError` naming what cannot be honoured."""
    _refuse_unknown(data, _KNOWN)
    for name in _UNSUPPORTED:
        v = data.get(name)
        harmless = v in (None, [], {}) or (name == "tool_choice" and v in ("none", "auto"))
        if not harmless:
            raise _unsupported(name)
    if data.get("logprobs"):
        raise _unsupported("logprobs")
    plain = _is_plain(data, service)
    msgs = data.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a role", param="messages")
    with_tools = data.get("tools") not in (None, [])
    if with_tools and not plain:
        raise RequestError(f"tools are served by the plain model ({_plain_ids(service)[0]}): the RAG model answers "
                           "the user's question from its own retrieval; give an agent a retrieval tool instead",
                           param="tools", code="unsupported_parameter")
    last = msgs[-1]
    if last["role"] != "user" and not (with_tools and last["role"] == "tool"):
        raise RequestError(f"the last message must be the user's question{' or a tool result' if with_tools else ''},"
                           f" not a {last['role']!r} message", param="messages")
    notes: list[str] = []
    try:
        grammar, instruction = resolve(data.get("response_format"))
    except ValueError as e:
        raise RequestError(str(e), param="response_format", code="invalid_value") from None
    turns = []
    for i, m in enumerate(msgs):
        role = _ROLES.get(m["role"])
        if role is None:
            raise RequestError(f"messages[{i}]: the role {m['role']!r} is not supported (use system, user, "
                               "assistant or tool)", param="messages")
        text = _text(m.get("content")) if m.get("content") is not None or role != "assistant" else ""
        turns.append((role, tools.render_calls(text, _calls(m, i)) if m.get("tool_calls") else text))
    try:
        use = tools.prepare(turns, data.get("tools"), data.get("tool_choice"), data.get("parallel_tool_calls"),
                            grammar_given=grammar is not None)
    except tools.ToolError as e:
        raise RequestError(str(e), param="tools" if "tool_choice" not in str(e) else "tool_choice",
                           code="invalid_value") from None
    # decoding follows the grammar; the model reads the schema or the tools too
    sp = _sampling(data, notes, service.max_new_tokens, "max_completion_tokens", grammar or use.grammar)
    if plain:
        if data.get("k") is not None:
            raise RequestError("k is for the RAG model's retrieval; the plain model reads the prompt as sent",
                               param="k", code="unsupported_parameter")
        return AnswerRequest(messages=tuple(with_instruction(use.turns, instruction)), sampling=sp,
                             tenant=tenant, max_chars=MAX_PROMPT_CHARS), notes, use.parse
    # the RAG model: the last user message is the question, retrieval runs on it alone; the
    # system message and earlier turns go into the prompt before the documents, and a response
    # format's instruction after the question
    return AnswerRequest(question=turns[-1][1], history=tuple(turns[:-1]), instruction=instruction,
                         k=data.get("k"), sampling=sp, tenant=tenant, max_chars=MAX_QUESTION_CHARS), notes, False


def _calls(m: dict, i: int) -> list[tools.ToolCall]:
    """An assistant message's ``tool_calls`` (OpenAI's shape: arguments as JSON text)."""
    try:
        return tools.from_openai(m.get("tool_calls"), strict=True)
    except tools.ToolError as e:
        raise RequestError(f"messages[{i}].{e}", param="messages") from None


def parse_completion(data: dict, service, tenant: str = "") -> tuple[AnswerRequest, list[str]]:
    """The request a completions body asks for (the plain model's text prompt, or the RAG model's
    question) and the notes for its answer."""
    _refuse_unknown(data, _KNOWN_TEXT)
    if data.get("logprobs") is not None:
        raise _unsupported("logprobs")
    if data.get("echo"):
        raise _unsupported("echo")
    if data.get("suffix"):
        raise _unsupported("suffix")
    if (_number(data, "best_of", 1, 20, integer=True) or 1) != 1:
        raise RequestError("best_of must be 1", param="best_of", code="unsupported_value")
    plain = _is_plain(data, service)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("prompt must be a non-empty string (one prompt per request)", param="prompt")
    notes: list[str] = []
    sp = _sampling(data, notes, service.max_new_tokens)
    if plain:
        return AnswerRequest(prompt=prompt, sampling=sp, tenant=tenant, max_chars=MAX_PROMPT_CHARS), notes
    return AnswerRequest(question=prompt, k=data.get("k"), sampling=sp, tenant=tenant,
                         max_chars=MAX_QUESTION_CHARS), notes


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _extra(start: dict, done: dict, notes: list[str]) -> dict:
    return {"sources": start["sources"], "notes": notes + start.get("notes", []),
            **{k: done[k] for k in ("ttft_s", "queued_s", "retrieve_s", "cached_tokens", "computed_tokens",
                                    "recomputed_tokens", "documents") if k in done}}


def _usage(done: dict) -> dict:
    return {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["output_tokens"],
            "total_tokens": done["prompt_tokens"] + done["output_tokens"],
            "prompt_tokens_details": {"cached_tokens": done["cached_tokens"]}}


def tenant_of(request: Request) -> str:
    """The tenant the request's API key names (set by :class:`~.guard.Guard`; ``""`` without keys)."""
    return getattr(request.state, "tenant", "")


async def _respond(request: Request, data: dict, job, notes: list[str], chat: bool, read_calls: bool = False):
    """The job's answer as a chat completion or a text completion, whole or streamed; with
    ``read_calls``, the answer's tool calls as ``tool_calls`` (finish reason ``tool_calls``)."""
    try:
        start = await first_event(job, request)
    except BaseException:
        job.cancel()
        raise
    prefix, obj = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
    cid, created, model = f"{prefix}-{uuid.uuid4().hex}", int(time.time()), data["model"]

    def choice(text: str | None, finish, delta: bool = False) -> dict:
        if not chat:
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        if delta:
            return {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish,
                    "logprobs": None}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                "logprobs": None}

    if not data.get("stream"):
        text, done = [], None
        async for kind, payload in events_of(job):
            if kind == "delta":
                text.append(payload)
            elif kind == "done":
                done = payload
            elif kind == "error":
                raise RequestError(payload["message"], payload.get("status", 500), payload.get("retry_after"),
                                   code=payload.get("code"))
        if done is None:
            raise RequestError("the answer was interrupted", 500)
        answer = choice("".join(text), _finish(done["finish_reason"]))
        if read_calls:
            content, calls, bad = tools.parse("".join(text))
            if calls:
                answer["message"] = {"role": "assistant", "content": content or None,
                                     "tool_calls": [c.openai() for c in calls]}
                answer["finish_reason"] = "tool_calls"
            if bad:
                notes = notes + [f"a tool call was cut short by max_tokens and is left out: {bad[0]['args'][:80]!r}"]
        return {"id": cid, "object": obj, "created": created, "model": model,
                "choices": [answer], "usage": _usage(done), "pcache": _extra(start[1], done, notes)}

    include_usage = bool((data.get("stream_options") or {}).get("include_usage"))
    chunk_obj = obj + ".chunk" if chat else obj

    def chunk(c: dict | None, **extra) -> dict:
        body = {"id": cid, "object": chunk_obj, "created": created, "model": model,
                "choices": [c] if c is not None else [], **extra}
        return {"data": json.dumps(body)}

    async def stream():
        if chat:
            yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                         "logprobs": None})
        reader = tools.CallStream() if read_calls else None
        called = False
        async for kind, payload in events_of(job):
            if kind == "delta" and reader is None:
                yield chunk(choice(payload, None, delta=True))
            elif kind == "delta" or (kind == "done" and reader is not None):
                for d in reader.feed(payload) if kind == "delta" else reader.flush():
                    called |= d.index >= 0
                    yield chunk(_call_delta(d))
            if kind == "done":
                finish = "tool_calls" if called else _finish(payload["finish_reason"])
                yield chunk(choice(None, finish, delta=True), pcache=_extra(start[1], payload, notes))
                if include_usage:
                    yield chunk(None, usage=_usage(payload))
            elif kind == "error":  # headers are sent: the error goes in the stream, as OpenAI does
                yield {"data": json.dumps({"error": {"message": payload["message"], "type": "server_error",
                                                     "param": None, "code": payload.get("code")}})}
        yield {"data": "[DONE]"}

    return EventSourceResponse(stream(), ping=15,
                               shutdown_grace_period=request.app.state.service.shutdown_grace_s + 1.0)


def _call_delta(d: tools.Delta) -> dict:
    """A streamed :class:`~pcache_rag.tools.Delta` as a chat chunk's choice: text, a call's start
    (its index, id and name) or a piece of its arguments."""
    if d.index < 0:
        delta: dict = {"content": d.text}
    elif d.name is not None:
        delta = {"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                 "function": {"name": d.name, "arguments": ""}}]}
    else:
        delta = {"tool_calls": [{"index": d.index, "function": {"arguments": d.arguments}}]}
    return {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}


@router.post("/chat/completions")
async def chat_completions(request: Request):
    service = request.app.state.service
    data = await body_json(request)
    req, notes, read_calls = parse_request(data, service, tenant_of(request))
    return await _respond(request, data, service.submit(req), notes, chat=True, read_calls=read_calls)


@router.post("/completions")
async def completions(request: Request):
    """Text completions (LlamaIndex's ``OpenAILike`` without ``is_chat_model``, older clients):
    on the plain model the prompt is read as text, documents in it found in the cache; on the
    RAG model it is the question."""
    service = request.app.state.service
    data = await body_json(request)
    req, notes = parse_completion(data, service, tenant_of(request))
    return await _respond(request, data, service.submit(req), notes, chat=False)
