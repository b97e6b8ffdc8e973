"""Tool calling: the tools' text in the prompt, the grammar of a call, and the calls read back.

One format for every model (documented in docs/guide.md, "Tool calling"): the Hermes form
that Qwen2.5 and the Hermes models were trained on. The tools are listed as OpenAI function
specs between ``<tools>`` tags in the system message, and a call is one line::

    <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>

A tool's result comes back as a ``tool`` message: the chat template's own ``tool`` turn
where it renders one (:func:`pcache_rag.pml.chat.chat_format_for`), else a user turn
wrapped in ``<tool_response>`` tags. pcache-rag does not use a template's own tool markup
(``apply_chat_template(tools=...)``): SmolLM2's template has none, and one format keeps the
grammar, the parser and the stream below exact for every model.

The call's JSON is decoded under a grammar (llguidance, as structured output is,
:mod:`pcache_rag.grammar`): the tool's name is one of the tools' and its arguments match that
tool's parameter schema, so a call always parses once it is complete. ``tool_choice``:

* ``"auto"``: free text, or calls once the model writes ``<tool_call>`` (a lazy trigger:
  text is unconstrained until then);
* ``"required"`` (LangChain's ``"any"``): the answer is a call;
* a tool's name (or ``{"type": "function", "function": {"name": ...}}``): one call of it;
* ``"none"``: text without a call (``<tool`` cannot be written; nothing is read as a call).

An answer holds one call unless ``parallel_tool_calls`` is True (then several, one a line).
OpenAI's default is several; ours is one because a small model that may write another call
writes the same one again until its token limit (SmolLM2-135M did), and an agent loops anyway.

The tools' text sits in the system message, before the conversation: it is part of the
prompt's cached prefix, so every later turn of an agent reads it from the cache.
"""

from __future__ import annotations

import json
import re
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .grammar import JSON_LAYOUT, check_schema, closed, lark_grammar

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# A call is CALL_OPEN + NAME_AT + name + ARGS_AT + arguments + CALL_END: the one place its form is
# spelled (the grammar, the history and the stream reader all use these). A tool's name needs no
# JSON escaping (tools_of checks it), so the stream reader finds it between the quotes as it is.
NAME_AT, ARGS_AT, CALL_END = '{"name": "', '", "arguments": ', "}" + CALL_CLOSE

TOOLS_INSTRUCTION = (
    "You can call tools. Their JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a tool, answer with one line per call:\n"
    f'{CALL_OPEN}{{{{"name": <tool name>, "arguments": <arguments object>}}}}{CALL_CLOSE}\n'
    "Each result comes back in a tool message; then answer the user."
)
DEFAULT_SYSTEM = "You are a helpful assistant."
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)


class ToolWarning(UserWarning):
    """Tools were given in a way that changes what the model sees (a repeated name)."""


class ToolError(ValueError):
    """A tool spec or a ``tool_choice`` that cannot be served (names what is wrong)."""


@dataclass(frozen=True)
class Tool:
    """One function the model may call: ``parameters`` is its arguments' JSON schema."""

    name: str
    description: str
    parameters: dict

    def spec(self) -> dict:
        """The OpenAI function spec (what the prompt lists)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: ``arguments`` parsed; ``id`` is new for each call."""

    id: str
    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)

    def openai(self) -> dict:
        """OpenAI's shape of the call (``arguments`` as JSON text)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


def from_openai(calls: Sequence[Any] | None, strict: bool = False) -> list[ToolCall]:
    """Calls in OpenAI's shape (``{"id", "function": {"name", "arguments": JSON text}}``, as the
    server receives them and LlamaIndex keeps them) as :class:`ToolCall` s. ``strict``: a call
    without a name or with arguments that are not a JSON object is a :class:`ToolError` naming it;
    otherwise its arguments are read as ``{}`` (a call still streaming)."""
    out = []
    for i, c in enumerate(calls or ()):
        fn = c.get("function") if isinstance(c, Mapping) else None
        fn = fn if isinstance(fn, Mapping) else {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (json.JSONDecodeError, TypeError):
            args = None
        name = fn.get("name")
        if strict and (not isinstance(args, dict) or not isinstance(name, str)):
            raise ToolError(f"tool_calls[{i}] needs a function with a name and JSON-object arguments")
        out.append(ToolCall(str(c.get("id") or ""), name if isinstance(name, str) else "",
                            args if isinstance(args, dict) else {}))
    return out


def new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tools_of(specs: Sequence[Mapping[str, Any]] | None) -> list[Tool]:
    """OpenAI tool specs (``{"type": "function", "function": {name, description, parameters}}``)
    as :class:`Tool` s (a name given again keeps its first tool, with a :class:`ToolWarning` when
    the two differ); a spec of another type, a bad name, or a parameter schema
    beyond :data:`~pcache_rag.grammar.SCHEMA_LIMITS` is a :class:`ToolError` that says which."""
    out: list[Tool] = []
    for i, spec in enumerate(specs or ()):
        if not isinstance(spec, Mapping) or spec.get("type", "function") != "function":
            raise ToolError(f"tools[{i}]: only function tools are supported, not {spec!r:.80}")
        fn = spec.get("function")
        if not isinstance(fn, Mapping):
            raise ToolError(f'tools[{i}] needs {{"function": {{"name": ..., "parameters": ...}}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"tools[{i}]: the name must be 1-64 letters, digits, '_', '.' or '-', not {name!r}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        first = next((t for t in out if t.name == name), None)
        if first is not None:  # a call names its tool: one spec per name (the same tool given twice is fine)
            if first.parameters != params:
                warnings.warn(f"tools[{i}] repeats the name {name!r} with other parameters; the first tool of that "
                              "name is used", ToolWarning, stacklevel=3)
            continue
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            raise ToolError(f"tools[{i}] ({name}): parameters must be a JSON schema of an object")
        try:
            check_schema(params)
        except ValueError as e:
            raise ToolError(f"tools[{i}] ({name}): {e}") from None
        out.append(Tool(name, str(fn.get("description") or ""), dict(params)))
    return out


def choice_of(tool_choice: Any, tools: Sequence[Tool]) -> str:
    """``tool_choice`` as ``"auto"``, ``"required"``, ``"none"`` or a tool's name. Accepts
    OpenAI's strings and ``{"type": "function", "function": {"name": ...}}``, LangChain's
    ``"any"`` and ``True`` (required), and a bare tool name."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice is True or tool_choice == "any":
        tool_choice = "required"
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        tool_choice = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
    if tool_choice in ("auto", "required", "none"):
        if tool_choice != "none" and not tools:
            raise ToolError(f"tool_choice={tool_choice!r} needs tools")
        return tool_choice
    if isinstance(tool_choice, str) and any(t.name == tool_choice for t in tools):
        return tool_choice
    names = ", ".join(t.name for t in tools) or "none given"
    raise ToolError(f"tool_choice {tool_choice!r} is not 'auto', 'required', 'none' or a tool's name ({names})")


def instruction(tools: Sequence[Tool]) -> str:
    """The tools' text for the system message."""
    return TOOLS_INSTRUCTION.format(tools="\n".join(json.dumps(t.spec(), ensure_ascii=False) for t in tools))


def with_tools(turns: list[tuple[str, str]], tools: Sequence[Tool]) -> list[tuple[str, str]]:
    """``(role, text)`` turns with the tools' text opening the first system message (or a system
    message of its own, first, when there is none). It opens the message so that it is read with
    the system message as one cached prefix: a message's first block is never taken for a
    document (:mod:`pcache_rag.discovery`), a later one may be."""
    if not tools:
        return turns
    text = instruction(tools)
    if turns and turns[0][0] == "system":
        return [("system", text + "\n\n" + turns[0][1]), *turns[1:]]
    return [("system", text + "\n\n" + DEFAULT_SYSTEM), *turns]


@dataclass(frozen=True)
class ToolUse:
    """What a call's tools ask of a generation: the ``turns`` with the tools' text, the ``grammar``
    of the answer (None: free text) and whether the answer is read for calls (``parse``)."""

    turns: list[tuple[str, str]]
    grammar: str | None
    parse: bool


def prepare(turns: list[tuple[str, str]], specs: Sequence[Mapping[str, Any]] | None, tool_choice: Any = None,
            parallel: bool | None = None, grammar_given: bool = False, plan: Sequence[str] = ()) -> ToolUse:
    """A chat call with OpenAI tool ``specs``: the turns to render, the answer's grammar, and whether
    to read calls from it. Without tools the turns are returned as they are. Tools with a grammar
    of the call's own (``grammar_given``: a ``response_format``) are refused unless the choice is ``"none"``: the two would conflict.
    ``plan`` (tool names, :func:`planned`) overrides ``tool_choice`` while it lasts."""
    tools = tools_of(specs)
    choice = planned(turns, plan, tools) or choice_of(tool_choice, tools)
    if not tools:
        return ToolUse(turns, None, False)
    if grammar_given and choice != "none":
        raise ToolError("give tools or a response_format (structured output), not both")
    text = grammar(tools, choice, parallel is True) if not grammar_given else None
    return ToolUse(with_tools(turns, tools), text, choice != "none")


def planned(turns: Sequence[tuple[str, str]], plan: Sequence[str], tools: Sequence[Tool]) -> str | None:
    """The tool a ``plan`` calls next: its n-th name after n assistant turns since the last user
    message, then ``"none"`` (a text answer); None without a plan (the call's ``tool_choice`` holds).

    A plan is for models too small to choose: SmolLM2-135M never opened a call under ``"auto"``
    (0 of 6 prompts that asked for a tool) and, with a call required at every step, repeated
    its first tool instead of calling the one that gives the answer (docs/guide.md, "Tool
    calling"). With a plan the order is fixed and the model writes each call's arguments."""
    if not plan or not tools:
        return None
    for name in plan:
        if not any(t.name == name for t in tools):
            raise ToolError(f"tool_plan names {name!r}, which is not among the tools ({', '.join(t.name for t in tools)})")
    done = 0
    for role, _ in reversed(turns):
        if role == "user":
            break
        done += role == "assistant"
    return plan[done] if done < len(plan) else "none"


def _lit(s: str) -> str:
    return json.dumps(s)


def _head(name: str) -> str:
    """A call's text between ``<tool_call>`` and its arguments (a name from another model's history
    is escaped; ours never need it)."""
    return NAME_AT + json.dumps(name, ensure_ascii=False)[1:-1] + ARGS_AT


def grammar(tools: Sequence[Tool], choice: str, parallel: bool = False) -> str | None:
    """The grammar of an answer under ``choice`` (:func:`choice_of`): for ``"none"``, any text
    without ``<tool`` (a small model that sees calls in the conversation writes one as
    text otherwise); None without tools.
    A call is ``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>``, ARGS under the
    tool's parameter schema (objects closed, JSON laid out as :data:`~pcache_rag.grammar.JSON_LAYOUT`)."""
    if not tools:
        return None
    if choice == "none":
        # not even a look-alike: SmolLM2 wrote "<tool_call_2>{...}" and "<tool_check_data>{...}" as its
        # answer once calls were ruled out
        return lark_grammar(f"start: TEXT\nTEXT: /{_without('<tool')}/")
    chosen = [t for t in tools if choice in ("auto", "required") or t.name == choice]
    lines = ["%llguidance {}"]
    alts = []
    for i, t in enumerate(chosen):
        schema = {**closed(t.parameters), "x-guidance": JSON_LAYOUT}
        lines.append(f"args{i}: %json {json.dumps(schema)}")
        alts.append(f"{_lit(_head(t.name))} args{i} {_lit(CALL_END)}")
    lines.append("body: " + " | ".join(alts))
    if choice == "auto":  # free text until the model opens a call (a lazy trigger); then the call is constrained
        lines += ["start: TEXT | call" + ("+" if parallel else ""), "call: trig body", f"trig[lazy]: TEXT {_lit(CALL_OPEN)}", r"TEXT: /(.|\n)*/"]
    else:
        lines.append(f"one: {_lit(CALL_OPEN)} body")
        several = parallel and choice == "required"  # a named choice is one call of that tool
        lines.append('start: one ("\\n" one)*' if several else "start: one")
    return lark_grammar("\n".join(lines))


def _without(word: str) -> str:
    """A regular expression of the texts that do not contain ``word`` (which starts with the only
    ``<`` in it). Spelled out, not as llguidance's ``~`` complement: that one is checked only when
    the answer ends, so the mask would let the word be decoded."""
    head, rest = re.escape(word[0]), word[1:]
    alts = "|".join(f"{re.escape(rest[:k])}[^{re.escape(rest[k])}{head}]" for k in range(len(rest)))
    ends = "|".join(re.escape(rest[:k]) for k in range(1, len(rest)))
    return f"([^{head}]|{head}+({alts}))*({head}+({ends})?)?"


def render_calls(content: str, calls: Sequence[ToolCall]) -> str:
    """An assistant turn that made ``calls``, as the model wrote it (for the conversation's history)."""
    lines = [CALL_OPEN + _head(c.name) + c.arguments_json + CALL_END for c in calls]
    return "\n".join(([content] if content else []) + lines)


def parse(text: str) -> tuple[str, list[ToolCall], list[dict]]:
    """``(content, calls, invalid)`` of an answer: the text outside the calls (stripped), the
    calls, and those that do not parse (an answer cut by ``max_tokens``), each as
    ``{"name", "args", "error"}`` with the raw text."""
    calls: list[ToolCall] = []
    invalid: list[dict] = []
    for m in _CALL.finditer(text):
        _read(m.group(1), calls, invalid)
    rest = _CALL.sub("", text)
    cut = rest.find(CALL_OPEN)
    if cut >= 0:  # opened and never closed
        invalid.append({"name": None, "args": rest[cut + len(CALL_OPEN):], "error": "the call was cut off"})
        rest = rest[:cut]
    return rest.strip(), calls, invalid


def _read(raw: str, calls: list[ToolCall], invalid: list[dict]) -> None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        invalid.append({"name": None, "args": raw, "error": f"not JSON: {e}"})
        return
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments", {}), dict):
        invalid.append({"name": None, "args": raw, "error": 'not {"name": ..., "arguments": {...}}'})
        return
    calls.append(ToolCall(new_id(), obj["name"], obj.get("arguments", {})))


@dataclass
class Delta:
    """One step of a streamed answer: ``text`` to show, or a call's ``name`` (with its ``id``,
    at the call's start) or a piece of its ``arguments`` JSON, for call number ``index``."""

    text: str = ""
    index: int = -1
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class CallStream:
    """Reads text deltas of an answer and yields :class:`Delta` s: text as it comes (held back
    only while it may be the start of ``<tool_call>``), each call's name once it is complete and
    its arguments as they are decoded (held back only by the closing ``}</tool_call>``). The
    grammar fixes a call's form, so what streams is what :func:`parse` reads at the end."""

    _HEAD = CALL_OPEN + NAME_AT
    _MID = ARGS_AT
    _TAIL = CALL_END

    def __init__(self) -> None:
        self._buf = ""
        self._state = "text"  # text | name | args
        self._index = -1
        self._sent = 0  # characters of the current call's arguments already sent
        self._joint = False  # just after a call: the newline before the next is not text

    def feed(self, delta: str) -> Iterator[Delta]:
        self._buf += delta
        while True:
            if self._state == "text":
                if self._joint:
                    self._buf = self._buf.lstrip("\n")
                    if not self._buf:
                        return
                    self._joint = False
                at = self._buf.find(CALL_OPEN)
                if at < 0:
                    keep = _partial(self._buf, CALL_OPEN)
                    if len(self._buf) > keep:
                        yield Delta(text=self._buf[: len(self._buf) - keep])
                        self._buf = self._buf[len(self._buf) - keep:]
                    return
                if at:
                    yield Delta(text=self._buf[:at])
                self._buf = self._buf[at:]
                self._state = "name"
            if self._state == "name":
                if not self._buf.startswith(self._HEAD[: len(self._buf)]):
                    self._state = "text_raw"  # not our form (choice "none"): plain text
                elif len(self._buf) >= len(self._HEAD) and self._MID in self._buf[len(self._HEAD):]:
                    name, _, rest = self._buf[len(self._HEAD):].partition(self._MID)
                    self._index += 1
                    self._sent = 0
                    yield Delta(index=self._index, id=new_id(), name=name)
                    self._buf = rest
                    self._state = "args"
                else:
                    return
            if self._state == "args":
                end = self._buf.find(self._TAIL)
                if end >= 0:
                    if end > self._sent:
                        yield Delta(index=self._index, arguments=self._buf[self._sent:end])
                    self._buf = self._buf[end + len(self._TAIL):]
                    self._state, self._joint = "text", True
                    continue
                safe = len(self._buf) - _partial(self._buf, self._TAIL)
                if safe > self._sent:
                    yield Delta(index=self._index, arguments=self._buf[self._sent:safe])
                    self._sent = safe
                return
            if self._state == "text_raw":
                yield Delta(text=self._buf)
                self._buf = ""
                self._state = "text"
                return

    def flush(self) -> Iterator[Delta]:
        """What is held back at the end of the answer (text, or the rest of a call cut short)."""
        if self._buf and self._state == "args":
            if len(self._buf) > self._sent:
                yield Delta(index=self._index, arguments=self._buf[self._sent:])
        elif self._buf:
            yield Delta(text=self._buf)
        self._buf = ""


def _partial(buf: str, tag: str) -> int:
    """The length of the longest end of ``buf`` that is a start of ``tag``."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


__all__ = ["CALL_CLOSE", "CALL_OPEN", "CallStream", "Delta", "Tool", "ToolCall", "ToolError", "ToolUse", "ToolWarning", "choice_of",
           "from_openai", "grammar", "instruction", "new_id", "parse", "planned", "prepare", "render_calls", "tools_of", "with_tools"]
