"""Lay a parsed schema out in token ids and position ids; plan a prompt against it.

A :class:`SchemaLayout` gives every cached unit of a schema (anonymous text,
module, scaffold) its token ids and fixed position ids, in document order, as
``docs/pml.md`` defines:

* a module starts where the elements before it end;
* a union reserves its longest member, all members share its start;
* a param reserves ``len`` positions inside its module and holds *no* tokens
  in the cached states: tokens after the slot never attend to it, so the
  argument computed at prompt time substitutes exactly (this is equivalent to
  the paper's filler token whose states are later overwritten, minus the
  filler's influence on the tokens after it);
* nested modules sit inside their parent's position range;
* each run of top-level text outside modules is an always-imported anonymous
  module named ``#0``, ``#1``, ...; the one starting at position 0 is the
  schema's *preamble*;
* role tags become the model's chat markup (:mod:`pcache_rag.pml.chat`).

:func:`plan_prompt` checks a prompt against the layout and returns a
:class:`PromptPlan`: the imported units in cache order, argument tokens at
their reserved positions, and the uncached tokens after the schema's end.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from ..tokens import safe_tokenizer
from .chat import ChatFormat
from .errors import PMLError
from .parser import Import, Module, Param, Prompt, Role, Scaffold, Schema, Text, Union, parse_prompt, parse_schema


@dataclass(slots=True)
class ParamSlot:
    """A parameter's reserved positions inside its module."""

    name: str
    length: int  # positions reserved (the param's len)
    start: int  # first reserved position id
    offset: int  # number of the module's tokens that come before the slot
    line: int = 0
    column: int = 0


@dataclass(slots=True)
class Unit:
    """One cached unit of a schema: anonymous text, a module or a scaffold."""

    name: str  # module/scaffold name, or "#k" for anonymous text
    kind: str  # "anonymous" | "module" | "scaffold"
    token_ids: list[int] = field(default_factory=list)  # (T,) the unit's own tokens
    position_ids: list[int] = field(default_factory=list)  # (T,) fixed positions, increasing
    start: int = 0  # first position of the unit's range (includes children and slots)
    end: int = 0  # one past its last position
    parent: str | None = None  # enclosing module, for nested modules
    union: int | None = None  # index of the union it belongs to
    scaffold: str | None = None  # scaffold it is a member of
    members: tuple[str, ...] = ()  # for scaffolds: member module names, in order
    params: list[ParamSlot] = field(default_factory=list)
    line: int = 0
    column: int = 0


@dataclass(slots=True)
class SchemaLayout:
    """A schema laid out for one tokenizer."""

    name: str
    units: dict[str, Unit]  # by name, in document order
    length: int  # positions the schema occupies: uncached text starts here
    preamble: str | None  # name of the anonymous unit at position 0, if any
    unions: list[list[str]]  # member names of each union
    chat: ChatFormat
    source: str = ""  # the schema PML
    conditioning: str = "none"  # the schema's opt-in to conditioned encoding (see pcache_rag.conditioning)


@dataclass(slots=True)
class PromptPlan:
    """What a prompt needs: cached units in cache order, arguments, new tokens."""

    layout: SchemaLayout
    units: list[Unit]  # imported units (anonymous ones included), by start position
    args: list[tuple[Unit, ParamSlot, list[int]]]  # (module, slot, argument token ids)
    uncached_ids: list[int]  # (U,) tokens to compute after the schema's end
    uncached_positions: list[int]  # (U,)
    imports: list[str]  # module names the prompt imported (scaffold members expanded)


class _Tok:
    """Tokenizes with no special tokens added. A ``str`` is text (never a control token);
    a list of ``(text, is_markup)`` segments lets chat markup keep its control tokens
    (:mod:`pcache_rag.tokens`)."""

    def __init__(self, tokenizer):
        self.t = safe_tokenizer(tokenizer)

    def __call__(self, text: str | list[tuple[str, bool]]) -> list[int]:
        if isinstance(text, str):
            return self.t.text(text)
        return self.t.segments(text)


def bos_ids(tokenizer) -> list[int]:
    """The ids a tokenizer puts before every sequence (``[bos]`` or ``[]``)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return [bos] if ids and ids[0] == bos else []


class _Layouter:
    def __init__(self, tokenizer, chat: ChatFormat):
        self.tok = _Tok(tokenizer)
        self.chat = chat
        self.pos = 0
        self.units: dict[str, Unit] = {}
        self.unions: list[list[str]] = []
        self.anon: Unit | None = None  # the open anonymous unit, if text is accumulating
        self.n_anon = 0
        self.pending: list[tuple[str, bool]] = []  # (text, is_markup) waiting to be tokenized for `owner`
        self.owner: Unit | None = None

    # Text accumulates per owner and is tokenized at structural boundaries, so
    # a role's markup and its content tokenize together.
    def flush(self) -> None:
        if self.owner is None or not self.pending:
            self.pending = []
            return
        ids = self.tok(self.pending)
        self.pending = []
        self.owner.token_ids.extend(ids)
        self.owner.position_ids.extend(range(self.pos, self.pos + len(ids)))
        self.pos += len(ids)

    def text(self, s: str, owner: Unit | None, markup: bool = False) -> None:
        if not s:
            return
        if owner is None:  # top level: anonymous unit
            if self.anon is None:
                self.flush()
                self.anon = Unit(f"#{self.n_anon}", "anonymous", start=self.pos)
                self.n_anon += 1
                self.units[self.anon.name] = self.anon
            owner = self.anon
        if owner is not self.owner:
            self.flush()
            self.owner = owner
        self.pending.append((s, markup))

    def close_anon(self) -> None:
        self.flush()
        if self.anon is not None:
            self.anon.end = self.pos
            self.anon = None
        self.owner = None

    def nodes(self, nodes, owner: Unit | None, union: int | None = None, scaffold: str | None = None) -> None:
        for n in nodes:
            if isinstance(n, Text):
                self.text(n.text, owner)
            elif isinstance(n, Role):
                self.text(self.chat.prefix[n.role], owner, markup=True)
                self.nodes(n.body, owner)
                self.text(self.chat.suffix[n.role], owner, markup=True)
            elif isinstance(n, Param):
                assert owner is not None, "the parser only allows params inside modules"
                if scaffold is not None or owner.scaffold is not None:
                    raise PMLError(
                        f"<param name={n.name!r}> inside a scaffold member: scaffolds are encoded jointly "
                        "and cannot take arguments; move the param to a module outside the scaffold",
                        n.line,
                        n.column,
                    )
                self.flush()
                owner.params.append(ParamSlot(n.name, n.length, self.pos, len(owner.token_ids), n.line, n.column))
                self.pos += n.length
            elif isinstance(n, Module):
                self.module(n, owner, union, scaffold)
            elif isinstance(n, Union):
                self.union(n, owner)
            elif isinstance(n, Scaffold):
                self.scaffold(n)
            else:  # pragma: no cover - the parser produces no other node
                raise AssertionError(f"unexpected node {n!r}")

    def module(self, m: Module, parent: Unit | None, union: int | None, scaffold: str | None) -> Unit:
        if parent is None:
            self.close_anon()
        else:
            self.flush()
        u = Unit(
            m.name,
            "module",
            start=self.pos,
            parent=parent.name if parent is not None else None,
            union=union,
            scaffold=scaffold,
            line=m.line,
            column=m.column,
        )
        self.units[m.name] = u
        saved = self.owner
        self.owner = u
        self.nodes(m.body, u)
        self.flush()
        u.end = self.pos
        self.owner = saved
        if not u.token_ids and not u.params:
            raise PMLError(f"module {m.name!r} is empty; give it some text", m.line, m.column)
        return u

    def union(self, un: Union, parent: Unit | None) -> None:
        if parent is None:
            self.close_anon()
        else:
            self.flush()
        idx = len(self.unions)
        names = []
        start = self.pos
        end = start
        for m in un.members:
            self.pos = start
            u = self.module(m, parent, idx, None)
            names.append(u.name)
            end = max(end, u.end)
        self.pos = end
        self.unions.append(names)

    def scaffold(self, sc: Scaffold) -> None:
        self.close_anon()
        s = Unit(sc.name, "scaffold", start=self.pos, line=sc.line, column=sc.column)
        members = []
        for m in sc.members:
            members.append(self.module(m, None, None, sc.name))
        s.end = self.pos
        s.members = tuple(u.name for u in members)
        # Joint states cover the members' own tokens, in document order.
        for u in members:
            s.token_ids.extend(u.token_ids)
            s.position_ids.extend(u.position_ids)
        self.units[sc.name] = s


def layout_schema(
    schema: Schema | str,
    tokenizer,
    chat: ChatFormat,
    max_positions: int | None = None,
) -> SchemaLayout:
    """Lay ``schema`` out for ``tokenizer``. Deterministic for equal inputs.

    The tokenizer's BOS token, if it adds one, opens the first anonymous unit
    (a BOS-only unit is created when the schema starts with a module).
    Raises :class:`PMLError` if the layout does not fit in ``max_positions``.
    """
    source = schema if isinstance(schema, str) else ""
    if isinstance(schema, str):
        schema = parse_schema(schema)
    lo = _Layouter(tokenizer, chat)
    bos = bos_ids(tokenizer)
    if bos:
        lo.anon = Unit("#0", "anonymous", start=0)
        lo.n_anon = 1
        lo.units["#0"] = lo.anon
        lo.anon.token_ids.extend(bos)
        lo.anon.position_ids.extend(range(len(bos)))
        lo.pos = len(bos)
        lo.owner = lo.anon
    lo.nodes(schema.body, None)
    lo.close_anon()
    # Anonymous units that ended up empty (only whitespace trimmed away) are dropped.
    units = {k: u for k, u in lo.units.items() if u.kind != "anonymous" or u.token_ids}
    preamble = next((u.name for u in units.values() if u.kind == "anonymous" and u.start == 0), None)
    if max_positions is not None and lo.pos > max_positions:
        raise PMLError(
            f"schema {schema.name!r} lays out to {lo.pos} positions but the model takes at most "
            f"{max_positions}; shorten modules, or put long alternatives in a <union>"
        )
    return SchemaLayout(schema.name, units, lo.pos, preamble, lo.unions, chat, source, schema.conditioning)


def _unknown(name: str, layout: SchemaLayout, imp: Import) -> PMLError:
    names = [u for u in layout.units if not u.startswith("#")]
    close = difflib.get_close_matches(name, names, n=3)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return PMLError(f"schema {layout.name!r} has no module {name!r}{hint}", imp.line, imp.column)


def plan_prompt(
    prompt: Prompt | str,
    layout: SchemaLayout,
    tokenizer,
    max_positions: int | None = None,
) -> PromptPlan:
    """Check ``prompt`` against ``layout`` and return what to fetch and compute.

    Uncached text (top-level text and role turns) is placed after the schema's
    end in prompt order; if the prompt's last element is a ``<user>`` or
    ``<system>`` turn, the chat format's generation prompt is appended so the
    model answers as the assistant. A final ``<assistant>`` turn is left open.
    """
    if isinstance(prompt, str):
        prompt = parse_prompt(prompt)
    if prompt.schema != layout.name:
        raise PMLError(
            f"prompt is for schema {prompt.schema!r} but was planned against {layout.name!r}",
            prompt.line,
            prompt.column,
        )
    tok = _Tok(tokenizer)
    chat = layout.chat
    chosen: dict[str, Import] = {}
    union_pick: dict[int, str] = {}
    for imp in (n for n in prompt.body if isinstance(n, Import)):
        u = layout.units.get(imp.name)
        if u is None or u.kind == "anonymous":
            raise _unknown(imp.name, layout, imp)
        names = list(u.members) if u.kind == "scaffold" else [u.name]
        if u.kind == "scaffold" and imp.args:
            a = next(iter(imp.args))
            raise PMLError(f"scaffold {u.name!r} takes no arguments (got {a!r})", imp.line, imp.column)
        for nm in names:
            if nm in chosen:
                raise PMLError(f"module {nm!r} is imported twice", imp.line, imp.column)
            chosen[nm] = imp
            m = layout.units[nm]
            if m.union is not None:
                other = union_pick.get(m.union)
                if other is not None:
                    raise PMLError(
                        f"{nm!r} and {other!r} are members of the same <union>; import at most one",
                        imp.line,
                        imp.column,
                    )
                union_pick[m.union] = nm
    args: list[tuple[Unit, ParamSlot, list[int]]] = []
    for nm, imp in chosen.items():
        m = layout.units[nm]
        if m.parent is not None and m.parent not in chosen:
            raise PMLError(
                f"{nm!r} is nested in {m.parent!r}; import <{m.parent}/> too", imp.line, imp.column
            )
        slots = {s.name: s for s in m.params}
        given = imp.args if imp.name == nm else {}
        for a in given:
            if a not in slots:
                want = ", ".join(slots) if slots else "no arguments"
                raise PMLError(f"module {nm!r} has no parameter {a!r} (it takes {want})", imp.line, imp.column)
        for s in m.params:
            if s.name not in given:
                raise PMLError(
                    f"module {nm!r} needs the argument {s.name}=\"...\" (up to {s.length} tokens)",
                    imp.line,
                    imp.column,
                )
            ids = tok(given[s.name])
            if len(ids) > s.length:
                raise PMLError(
                    f"argument {s.name}={given[s.name]!r} is {len(ids)} tokens; the param allows {s.length}",
                    imp.line,
                    imp.column,
                )
            args.append((m, s, ids))
    # Scaffolds whose members are all imported replace them with joint states.
    units: list[Unit] = []
    covered: set[str] = set()
    for u in layout.units.values():
        if u.kind == "scaffold" and all(mn in chosen for mn in u.members):
            units.append(u)
            covered.update(u.members)
    for u in layout.units.values():
        if u.kind == "anonymous" or (u.kind == "module" and u.name in chosen and u.name not in covered):
            units.append(u)
    units.sort(key=lambda u: (u.start, u.kind != "anonymous"))
    # Uncached text, in prompt order.
    # (text, is_markup): only the chat format's markup may produce control tokens.
    parts: list[tuple[str, bool]] = []
    body = prompt.body
    last = next((n for n in reversed(body) if not (isinstance(n, Text) and not n.text.strip())), None)
    for n in body:
        if isinstance(n, Text):
            parts.append((n.text, False))
        elif isinstance(n, Role):
            parts.append((chat.prefix[n.role], True))
            parts.append(("".join(t.text for t in n.body), False))
            if not (n is last and n.role == "assistant"):
                parts.append((chat.suffix[n.role], True))
    if isinstance(last, Role) and last.role in ("user", "system"):
        parts.append((chat.generation_prompt, True))
    uncached = tok(parts)
    positions = list(range(layout.length, layout.length + len(uncached)))
    if max_positions is not None and layout.length + len(uncached) > max_positions:
        raise PMLError(
            f"prompt needs positions up to {layout.length + len(uncached)} (schema {layout.length} + "
            f"{len(uncached)} new tokens) but the model takes at most {max_positions}; shorten the prompt",
            prompt.line,
            prompt.column,
        )
    args.sort(key=lambda a: a[1].start)
    return PromptPlan(layout, units, args, uncached, positions, list(chosen))
