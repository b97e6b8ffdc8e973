"""Grammar-constrained decoding (structured output): JSON schemas, JSON mode and Lark grammars.

The grammar engine is llguidance (the one vLLM and SGLang also use), not code of ours: a
matcher follows the grammar token by token and, before each step, gives a bitmask of the
tokens that may come next; the disallowed logits are set to ``-inf`` before sampling. It
works on any device because the mask is applied to the one row of logits a step samples
from, and it changes nothing about how the prompt is read: a constrained answer is
prefilled from the cache exactly as a free one.

A grammar travels as llguidance's own text form (a string, so :class:`SamplingParams`
stays frozen and hashable); :func:`json_grammar`, :func:`lark_grammar` and
:func:`regex_grammar` build one. :func:`structured` reads OpenAI's ``response_format``, which
the server and both connectors take.

A grammar decides which tokens may come, not which the model wants: a small model that is
never told the schema starts a string and repeats itself inside it until ``max_tokens``
(SmolLM2-135M did on 3 of 3 prompts here). So a ``response_format`` also puts the schema in
the prompt, after the last user message (:attr:`Structured.instruction`), as hosted APIs do
and as their guides advise; with it, the same three prompts gave three complete objects.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads with the engine: the builders here need no model
    import torch

#: JSON written the way chat models write it (``{"a": 1, "b": 2}``): one space after ``:`` and
#: ``,``, no newlines. Flexible whitespace would let a small model emit blank lines for ever.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputWarning(UserWarning):
    """A constrained answer ended before its grammar was complete (``max_tokens`` ran out)."""


def _ll():
    try:
        import llguidance
    except ImportError as e:  # a dependency of pcache-rag; only a broken install lacks it
        raise ImportError("structured output needs llguidance (pip install llguidance)") from e
    return llguidance


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its
    properties and says nothing of others. JSON Schema admits any extra key by default; a
    model shown a schema then writes its keywords (``"description": ...``) as keys. An answer
    with only the named keys still matches the schema (OpenAI's strict mode decodes so too)."""
    if isinstance(schema, list):
        return [closed(x) for x in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class SchemaLimits:
    """Bounds a JSON schema must meet before it is compiled (:func:`check_schema`), so that one
    request's schema cannot take a server's time or memory: nesting ``depth``, ``nodes`` (objects,
    arrays and values in it), ``enum`` members in one enum, its size in ``bytes`` as JSON, and
    whether a ``$ref`` may reach itself (a recursive schema; off: llguidance follows such a
    grammar, but a small model can nest in it until its token limit, and the compile time grows
    with it). Set :data:`SCHEMA_LIMITS` to change them for a process."""

    depth: int = 32
    nodes: int = 4_096
    enum: int = 512
    bytes: int = 65_536
    recursion: bool = False


#: the limits :func:`json_grammar` checks every schema against
SCHEMA_LIMITS = SchemaLimits()


class SchemaLimitError(ValueError):
    """A JSON schema beyond :class:`SchemaLimits` (refused before it is compiled)."""


def check_schema(schema: Any, limits: SchemaLimits | None = None) -> None:
    """Refuse ``schema`` with a :class:`SchemaLimitError` that names the limit if it is deeper,
    larger or has longer enums than ``limits`` (default :data:`SCHEMA_LIMITS`) allow, names a
    ``$ref`` that is not a local ``#/...`` pointer, or (unless ``limits.recursion``) holds a
    ``$ref`` that reaches itself. The walk is iterative: a schema nested thousands deep is
    refused by depth, never by Python's recursion limit."""
    lim = limits or SCHEMA_LIMITS
    refs: list[tuple[str, str]] = []  # (where the $ref is, what it points to), as JSON pointers
    stack: list[tuple[Any, str, int]] = [(schema, "", 1)]
    nodes = 0
    while stack:
        node, path, depth = stack.pop()
        nodes += 1
        if nodes > lim.nodes:
            raise SchemaLimitError(f"the JSON schema has more than {lim.nodes} nodes")
        if depth > lim.depth:
            raise SchemaLimitError(f"the JSON schema is nested deeper than {lim.depth} levels")
        if isinstance(node, Mapping):
            enum = node.get("enum")
            if isinstance(enum, list) and len(enum) > lim.enum:
                raise SchemaLimitError(f"an enum of the JSON schema has {len(enum)} members (the limit is {lim.enum})")
            ref = node.get("$ref")
            if ref is not None:
                if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
                    raise SchemaLimitError(f"$ref {str(ref)[:80]!r}: only local references (#/...) are supported")
                refs.append((path, ref[1:]))
            stack.extend((v, f"{path}/{_escape(str(k))}", depth + 1) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{path}/{i}", depth + 1) for i, v in enumerate(node))
    try:
        size = len(json.dumps(schema))
    except (TypeError, ValueError) as e:
        raise SchemaLimitError(f"the JSON schema is not JSON: {e}") from None
    if size > lim.bytes:
        raise SchemaLimitError(f"the JSON schema is {size} bytes as JSON (the limit is {lim.bytes})")
    if refs and not lim.recursion and (cycle := _ref_cycle(refs)):
        raise SchemaLimitError(f"the JSON schema is recursive ($ref {cycle!r} reaches itself): recursive schemas are "
                               "not supported")


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _ref_cycle(refs: list[tuple[str, str]]) -> str | None:
    """A ``$ref`` target from which the references inside it lead back to it, if any. A target
    ``t`` reaches every target of a ``$ref`` located in ``t``'s subtree."""
    def inside(path: str, target: str) -> bool:
        return path == target or path.startswith(target + "/") or target == ""

    targets = {t for _, t in refs}
    edges = {t: {u for p, u in refs if inside(p, t)} for t in targets}
    for start in targets:
        seen, todo = set(), list(edges[start])
        while todo:
            t = todo.pop()
            if t == start:
                return "#" + start
            if t not in seen:
                seen.add(t)
                todo.extend(edges.get(t, ()))
    return None


def json_grammar(schema: Mapping[str, Any] | str | None = None) -> str:
    """A grammar for one JSON value that matches ``schema`` (a JSON schema as a mapping or
    text; objects are :func:`closed`); without a schema, any JSON object (OpenAI's
    ``json_object`` mode). A schema beyond :data:`SCHEMA_LIMITS` is refused first
    (:class:`SchemaLimitError`, a ``ValueError``)."""
    if schema is None:
        schema = {"type": "object"}
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"the JSON schema is not valid JSON: {type(e).__name__}") from None
    check_schema(schema)
    return check(_ll().LLMatcher.grammar_from_json_schema(json.dumps(closed(schema)), defaults=JSON_LAYOUT))


#: appended to the last user message when an answer must be JSON (the schema follows)
SCHEMA_INSTRUCTION = "\n\nRespond with a JSON object that matches this JSON schema: "
JSON_INSTRUCTION = "\n\nRespond with a JSON object."


@dataclass(frozen=True)
class Structured:
    """What a ``response_format`` asks for: the ``grammar`` that constrains decoding, the JSON
    ``schema`` (None in JSON mode) and the ``instruction`` that tells the model about it."""

    grammar: str
    schema: dict | None
    instruction: str


def structured(response_format: Mapping[str, Any] | None) -> Structured | None:
    """OpenAI's ``response_format``: ``{"type": "json_schema", "json_schema": {"schema": {...}}}``,
    ``{"type": "json_object"}``, or ``{"type": "text"}`` / None (free text: None). Anything else
    is a :class:`ValueError` that names it."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError(f"response_format must be an object, not {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured(json_grammar(None), None, JSON_INSTRUCTION)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise ValueError('response_format json_schema needs {"json_schema": {"schema": {...}}}')
        schema = dict(schema)
        return Structured(json_grammar(schema), schema, SCHEMA_INSTRUCTION + json.dumps(schema))
    raise ValueError(f"response_format type {kind!r} is not supported (use text, json_object or json_schema)")


def resolve(response_format: Mapping[str, Any] | None = None, grammar: str | None = None) -> tuple[str | None, str]:
    """``(grammar, instruction for the prompt)`` of a call that gives a ``response_format``
    (:func:`structured`) or a raw ``grammar`` (no instruction: the caller wrote the prompt), or
    neither; both at once is a :class:`ValueError`."""
    fmt = structured(response_format)
    if fmt is None:
        return grammar, ""
    if grammar is not None:
        raise ValueError("give response_format or grammar, not both")
    return fmt.grammar, fmt.instruction


def with_instruction(turns: list[tuple[str, str]], instruction: str) -> list[tuple[str, str]]:
    """``(role, text)`` chat turns with ``instruction`` after the last user message (or as a
    user message of its own when there is none)."""
    if not instruction:
        return turns
    out = list(turns)
    for i in range(len(out) - 1, -1, -1):
        if out[i][0] == "user":
            out[i] = ("user", out[i][1] + instruction)
            return out
    return [*out, ("user", instruction.strip())]


def lark_grammar(text: str) -> str:
    """A grammar from llguidance's Lark syntax (GBNF is accepted too)."""
    return check(_ll().grammar_from("lark", text))


def regex_grammar(pattern: str) -> str:
    """A grammar for text that matches the regular expression ``pattern`` in full."""
    return check(_ll().grammar_from("regex", pattern))


def check(grammar: str) -> str:
    """``grammar`` if llguidance accepts it; a :class:`ValueError` that says why if not."""
    error = _ll().LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid grammar: {error}")
    return grammar


# One llguidance tokenizer per (tokenizer, vocabulary size): building it reads the whole
# vocabulary (~0.6 s for 49K tokens), so it is done once and dropped with the tokenizer.
_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    """llguidance's view of a Hugging Face fast tokenizer, with ``n_vocab`` logits per step
    (a model may have more rows than the tokenizer has tokens: those are never allowed)."""
    per = _TOKENIZERS.setdefault(tokenizer, {})
    if n_vocab not in per:
        import llguidance.hf

        try:
            per[n_vocab] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab)
        except Exception as e:  # a slow (Python) tokenizer, or one llguidance cannot read
            raise ValueError(f"structured output needs a fast tokenizer; {type(tokenizer).__name__} "
                             f"cannot be read by llguidance: {e}") from e
    return per[n_vocab]


def warm(tokenizer: Any, n_vocab: int) -> float:
    """Pay llguidance's one-time cost for ``tokenizer`` now (its tables for the vocabulary:
    ~4 s for SmolLM2's 49K tokens on this CPU), so the first structured answer does not;
    returns the seconds it took. Later grammars cost about a millisecond each."""
    import time

    import torch

    t0 = time.perf_counter()
    Constraint(tokenizer, json_grammar(None), n_vocab).apply(torch.zeros(n_vocab))
    return time.perf_counter() - t0


class Constraint:
    """One generation's position in its grammar: :meth:`apply` masks a step's logits,
    :meth:`advance` takes the token sampled from them, and :attr:`done` says that the grammar
    is complete and allows nothing more."""

    def __init__(self, tokenizer: Any, grammar: str, n_vocab: int) -> None:
        ll = _ll()
        import llguidance.torch as llt

        self._llt = llt
        self._matcher = ll.LLMatcher(ll_tokenizer(tokenizer, n_vocab), grammar)
        if self._matcher.is_error():
            raise ValueError(f"invalid grammar: {self._matcher.get_error()}")
        self._mask = llt.allocate_token_bitmask(1, n_vocab)  # (1, ceil(n_vocab / 32)) int32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (vocab,) with every token the grammar forbids next set to ``-inf``."""
        self._llt.fill_next_token_bitmask(self._matcher, self._mask, 0)
        row = logits.float().cpu().unsqueeze(0).clone()  # (1, vocab): the mask is applied on the host
        self._llt.apply_token_bitmask_inplace(row, self._mask)
        return row[0]

    def advance(self, token: int) -> None:
        """Move past ``token``; a token the grammar forbids is an error (the mask prevents it)."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"token {token} violates the grammar: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """Whether the text so far is a complete match (an answer cut here would be valid)."""
        return bool(self._matcher.is_accepting())


__all__ = ["Constraint", "JSON_INSTRUCTION", "JSON_LAYOUT", "SCHEMA_INSTRUCTION", "Structured", "StructuredOutputWarning", "structured", "check", "closed", "json_grammar", "lark_grammar", "ll_tokenizer", "regex_grammar", "resolve", "warm", "with_instruction"]
