"""The OpenAI-compatible API: ``GET /v1/models`` and ``POST /v1/chat/completions``.

The last user message is the question; retrieval runs over the server's index and the
answer comes from the chunks' cached states. Stock clients work unchanged with
``base_url="http://127.0.0.1:8000/v1"`` (the ``openai`` package, LangChain's
``ChatOpenAI``, LlamaIndex's ``OpenAILike``). Each response carries an extra ``pcache``
field (sources, time-to-first-token, cached and computed tokens, notes) that standard
clients ignore, and ``usage.prompt_tokens_details.cached_tokens`` says how much of the
prompt was read from the cache.

Differences from OpenAI, each refused or reported by name, never silent: ``temperature``
defaults to 0 (greedy: answers from documents should not vary); ``n`` must be 1; tools,
response formats, logprobs, logit bias and non-zero penalties are refused (400); earlier
messages (including system messages) are not used, and ``pcache.notes`` says so; ``k``
(chunks to retrieve) may be passed in the body (``extra_body`` in the clients).
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from .http import body_json, events_of, first_event
from .service import RequestError

router = APIRouter(prefix="/v1")

_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options", "prediction",
            "reasoning_effort", "modalities"}
_KNOWN = {"model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed",
          "stream", "n", "k", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs", "logit_bias",
          "tools", "tool_choice", "functions", "function_call", "response_format"} | _IGNORED
_UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias", "top_logprobs")


def _model_ids(service) -> list[str]:
    return [service.model_id, "pcache-rag"]


@router.get("/models")
async def models(request: Request):
    service = request.app.state.service
    return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "pcache-rag"}
                                       for m in _model_ids(service)]}


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise RequestError(f"only text content is supported, not {kind!r}")
            parts.append(p["text"])
        return "".join(parts)
    raise RequestError("message content must be a string or a list of text parts")


def _number(data: dict, name: str, lo: float, hi: float, integer: bool = False):
    v = data.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise RequestError(f"{name} must be a {'whole ' if integer else ''}number")
    if not lo <= v <= hi:
        raise RequestError(f"{name} must be between {lo:g} and {hi:g}, not {v}")
    return v


def parse_request(data: dict, service) -> tuple[str, dict, int | None, list[str]]:
    """(question, generation arguments, k, notes) from a chat-completions body, or
    :class:`RequestError` naming what cannot be honoured."""
    unknown = set(data) - _KNOWN
    if unknown:
        raise RequestError(f"unsupported parameters: {', '.join(sorted(unknown))}")
    for name in _UNSUPPORTED:
        v = data.get(name)
        harmless = v in (None, [], {}) or (name == "tool_choice" and v in ("none", "auto")) or (
            name == "response_format" and v == {"type": "text"})
        if not harmless:
            raise RequestError(f"{name} is not supported by this server")
    if data.get("logprobs"):
        raise RequestError("logprobs is not supported by this server")
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(data, name, -2, 2):
            raise RequestError(f"{name} is not supported by this server (only 0)")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required (see GET /v1/models)")
    if model not in _model_ids(service):
        raise RequestError(f"model {model!r} is not served here; use one of {_model_ids(service)}", 404)
    if (_number(data, "n", 1, 128, integer=True) or 1) != 1:
        raise RequestError("n must be 1")
    msgs = data.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a role")
    last = msgs[-1]
    if last["role"] != "user":
        raise RequestError(f"the last message must be the user's question, not a {last['role']!r} message")
    question = _text(last.get("content"))
    notes = []
    if len(msgs) > 1:
        notes.append(f"{len(msgs) - 1} earlier message(s) not used: this endpoint answers the last user message "
                     f"from the server's documents")
    gen: dict = {}
    t = _number(data, "temperature", 0, 2)
    if t:
        gen.update(do_sample=True, temperature=float(t))
    p = _number(data, "top_p", 0, 1)
    if p is not None and p < 1:
        if not t:
            notes.append("top_p has no effect with temperature 0 (greedy)")
        else:
            gen["top_p"] = float(p)
    m = _number(data, "max_completion_tokens", 1, 4096, integer=True) or _number(data, "max_tokens", 1, 4096,
                                                                                  integer=True)
    if m is not None:
        gen["max_new_tokens"] = int(m)
    s = _number(data, "seed", -(2**63), 2**63 - 1, integer=True)
    if s is not None:
        gen["seed"] = int(s) % (1 << 62)
    stop = data.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop) or len(stop) > 4:
            raise RequestError("stop must be a string or a list of up to 4 strings")
        gen["stop"] = stop
    k = data.get("k")
    return question, gen, k, notes


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _extra(start: dict, done: dict, notes: list[str]) -> dict:
    return {"sources": start["sources"], "notes": notes + start.get("notes", []),
            **{k: done[k] for k in ("ttft_s", "queued_s", "retrieve_s", "cached_tokens", "computed_tokens",
                                    "recomputed_tokens")}}


def _usage(done: dict) -> dict:
    return {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["output_tokens"],
            "total_tokens": done["prompt_tokens"] + done["output_tokens"],
            "prompt_tokens_details": {"cached_tokens": done["cached_tokens"]}}


@router.post("/chat/completions")
async def chat_completions(request: Request):
    service = request.app.state.service
    data = await body_json(request)
    question, gen, k, notes = parse_request(data, service)
    job = service.submit(question, k, **gen)
    try:
        start = await first_event(job, request)
    except BaseException:
        job.cancel()
        raise
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), data["model"]

    if not data.get("stream"):
        text, done = [], None
        async for kind, payload in events_of(job):
            if kind == "delta":
                text.append(payload)
            elif kind == "done":
                done = payload
            elif kind == "error":
                raise RequestError(payload["message"], payload.get("status", 500))
        if done is None:
            raise RequestError("the answer was interrupted", 500)
        return {"id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                             "finish_reason": _finish(done["finish_reason"]), "logprobs": None}],
                "usage": _usage(done), "pcache": _extra(start[1], done, notes)}

    include_usage = bool((data.get("stream_options") or {}).get("include_usage"))

    def chunk(delta: dict, finish=None, **extra) -> dict:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
        return {"data": json.dumps(body)}

    async def stream():
        yield chunk({"role": "assistant", "content": ""})
        async for kind, payload in events_of(job):
            if kind == "delta":
                yield chunk({"content": payload})
            elif kind == "done":
                yield chunk({}, _finish(payload["finish_reason"]), pcache=_extra(start[1], payload, notes))
                if include_usage:
                    yield {"data": json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created,
                                               "model": model, "choices": [], "usage": _usage(payload)})}
            elif kind == "error":  # headers are sent: the error goes in the stream, as OpenAI does
                yield {"data": json.dumps({"error": {"message": payload["message"], "type": "server_error"}})}
        yield {"data": "[DONE]"}

    return EventSourceResponse(stream(), ping=15)
