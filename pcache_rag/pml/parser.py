"""Parse PML schemas and prompts into small typed records.

The parser is hand-written rather than built on an XML library because PML is
*not* XML: free text may hold ``<`` and ``&`` (code, maths, prose), every node
must carry its line and column for error messages, and text must come back
exactly as written. The rules for authors:

Markup
    ``<`` starts a tag only when followed by a letter, ``_``, ``/`` or ``!``.
    Elsewhere (``a < b``, ``x <= 3``, ``<3``) it is plain text. A ``<`` that
    does start a tag but is meant as text (``if a<b``) must be written
    ``&lt;`` — an unknown tag is an error, never silently dropped.
References
    ``&lt; &gt; &amp; &quot; &apos;`` and numeric references (``&#10;``,
    ``&#x3C;``) are decoded in text and attribute values. A ``&`` that does not
    begin one of these is plain text (``R&D``).
Raw blocks and comments
    ``<![CDATA[ ... ]]>`` holds text taken verbatim (no references, no tags,
    no whitespace trimming). ``<!-- ... -->`` is a comment and is dropped.
Whitespace
    Text is kept verbatim, with one rule for layout: where a run of text
    *touches a tag* and the whitespace at that end contains a newline, that
    whitespace (the line break and indentation) is dropped. A run that is only
    such whitespace disappears. Spaces on the same line as a tag are kept,
    so ``lasting <param .../> with`` keeps both spaces. Write ``&#10;`` for a
    line break that must survive next to a tag.

:func:`escape` makes arbitrary end-user text safe to embed: an escaped string
never opens or closes a tag and parses back to exactly the original text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import PMLError

ROLES = ("system", "user", "assistant")
_STRUCTURAL = ("schema", "prompt", "module", "union", "param", "scaffold") + ROLES
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.:\-]*")
_ENTITY_RE = re.compile(r"&(?:(lt|gt|amp|quot|apos)|#([0-9]{1,7})|#[xX]([0-9a-fA-F]{1,6}));")
_NAMED = {"lt": "<", "gt": ">", "amp": "&", "quot": '"', "apos": "'"}
MAX_PARAM_LEN = 4096
#: deepest element nesting a document may have (a schema needs a handful; this bounds the
#: recursive layout and planning code, so hostile input gets a PMLError, not a RecursionError)
MAX_DEPTH = 64


# ----------------------------------------------------------------------------
# Typed records
# ----------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Text:
    """Literal text, already decoded."""

    text: str
    line: int = 0  # where the text starts in the document (1-based)
    column: int = 0


@dataclass(slots=True, frozen=True)
class Param:
    """``<param name len/>``: ``length`` positions reserved for an argument."""

    name: str
    length: int
    line: int = 0
    column: int = 0


@dataclass(slots=True, frozen=True)
class Role:
    """``<system>``, ``<user>`` or ``<assistant>``: content in a chat turn."""

    role: str
    body: tuple[Node, ...]
    line: int = 0
    column: int = 0


@dataclass(slots=True, frozen=True)
class Module:
    """``<module name>``: a reusable piece whose attention states are cached."""

    name: str
    body: tuple[Node, ...]
    line: int = 0
    column: int = 0


@dataclass(slots=True, frozen=True)
class Union:
    """``<union>``: mutually exclusive modules sharing one start position."""

    members: tuple[Module, ...]
    line: int = 0
    column: int = 0


@dataclass(slots=True, frozen=True)
class Scaffold:
    """``<scaffold name>``: modules also encoded jointly (they attend to each other)."""

    name: str
    members: tuple[Module, ...]
    line: int = 0
    column: int = 0


Node = Text | Param | Role | Module | Union | Scaffold


@dataclass(slots=True, frozen=True)
class Schema:
    """A parsed ``<schema name>`` document."""

    name: str
    body: tuple[Node, ...]
    conditioning: str = "none"  # <schema conditioning="neutral">: modules encoded after neutral passages


@dataclass(slots=True, frozen=True)
class Import:
    """``<name arg="value"/>`` in a prompt: import a module (or scaffold)."""

    name: str
    args: dict[str, str] = field(default_factory=dict)
    line: int = 0
    column: int = 0


PromptNode = Import | Text | Role


@dataclass(slots=True, frozen=True)
class Prompt:
    """A parsed ``<prompt schema>`` document."""

    schema: str
    body: tuple[PromptNode, ...]
    line: int = 0
    column: int = 0


# ----------------------------------------------------------------------------
# Escaping
# ----------------------------------------------------------------------------


def escape(text: str) -> str:
    """Make ``text`` safe to embed in PML as plain text.

    The result contains no ``<``, ``>``, ``&`` or raw line breaks, so it can
    never open or close a tag, and :func:`parse_prompt` returns exactly
    ``text`` for it (line breaks are written as ``&#10;``/``&#13;`` so the
    whitespace rule cannot trim them).
    """
    if not isinstance(text, str):
        raise TypeError(f"escape() takes a str, not {type(text).__name__}")
    return (
        text.replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&quot;")
        .replace("\n", "&#10;")
        .replace("\r", "&#13;")
    )


def unescape(text: str, line: int = 0, column: int = 0) -> str:
    """Decode the references PML recognises; other ``&`` are kept as text."""

    def sub(m: re.Match[str]) -> str:
        if m.group(1):
            return _NAMED[m.group(1)]
        code = int(m.group(2)) if m.group(2) else int(m.group(3), 16)
        if code == 0 or code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            raise PMLError(f"character reference {m.group(0)} is not a valid character", line, column)
        return chr(code)

    return _ENTITY_RE.sub(sub, text) if "&" in text else text


# ----------------------------------------------------------------------------
# Tokenizer of the markup: a flat list of tags and text runs
# ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Raw:
    """A raw element while parsing, before it becomes a typed record."""

    tag: str
    attrs: dict[str, str]
    attr_pos: dict[str, tuple[int, int]]
    children: list  # list[_Raw | Text]
    line: int
    column: int
    self_closing: bool = False


class _Reader:
    def __init__(self, source: str):
        if not isinstance(source, str):
            raise PMLError(f"a PML document must be a str, not {type(source).__name__}")
        self.s = source
        self.i = 0
        self.n = len(source)
        # Line starts for O(log n) line/column look-ups.
        self._starts = [0] + [m.end() for m in re.finditer(r"\n", source)]

    def pos(self, i: int) -> tuple[int, int]:
        import bisect

        ln = bisect.bisect_right(self._starts, i)
        return ln, i - self._starts[ln - 1] + 1

    def error(self, msg: str, i: int | None = None) -> PMLError:
        ln, col = self.pos(self.i if i is None else i)
        return PMLError(msg, ln, col)

    # -- pieces ---------------------------------------------------------------

    def parse_document(self) -> _Raw:
        root: _Raw | None = None
        stack: list[_Raw] = []
        pending: list[tuple[str, int, bool]] = []  # (text, start index, verbatim)
        # Whether the text gathered in `pending` is preceded by a tag.
        after_tag = False

        def flush(before_tag: bool) -> None:
            nonlocal pending
            if not pending:
                return
            parts = []
            for k, (txt, start, verbatim) in enumerate(pending):
                if not verbatim:
                    if k == 0 and after_tag:
                        txt = _trim_leading(txt)
                    if k == len(pending) - 1 and before_tag:
                        txt = _trim_trailing(txt)
                    ln, col = self.pos(start)
                    txt = unescape(txt, ln, col)
                parts.append(txt)
            text = "".join(parts)
            start = pending[0][1]
            pending = []
            if not text:
                return
            if not stack:
                if text.strip():
                    raise self.error(
                        "text outside the root element; put it inside <schema> or <prompt>", start
                    )
                return
            ln, col = self.pos(start)
            stack[-1].children.append(Text(text, ln, col))

        while self.i < self.n:
            lt = self._next_markup(self.i)
            if lt > self.i or lt == -1:
                end = self.n if lt == -1 else lt
                pending.append((self.s[self.i : end], self.i, False))
                self.i = end
                continue
            # self.s[self.i] == "<" and starts markup
            if self.s.startswith("<!--", self.i):
                end = self.s.find("-->", self.i + 4)
                if end == -1:
                    raise self.error("comment is never closed; add '-->'")
                self.i = end + 3
                continue
            if self.s.startswith("<![CDATA[", self.i):
                end = self.s.find("]]>", self.i + 9)
                if end == -1:
                    raise self.error("CDATA block is never closed; add ']]>'")
                if not stack:
                    raise self.error("CDATA outside the root element")
                pending.append((self.s[self.i + 9 : end], self.i, True))
                self.i = end + 3
                continue
            if self.s.startswith("<!", self.i) or self.s.startswith("<?", self.i):
                raise self.error(
                    "unsupported markup '<!' ; only comments <!-- --> and <![CDATA[ ]]> are allowed "
                    "(write &lt; for a literal '<')"
                )
            flush(before_tag=True)
            start = self.i
            if self.s.startswith("</", self.i):
                self.i += 2
                name = self._name("closing tag")
                self._skip_ws()
                if not self.s.startswith(">", self.i):
                    raise self.error(f"closing tag </{name} must end with '>'")
                self.i += 1
                if not stack:
                    raise self.error(f"</{name}> closes nothing", start)
                if stack[-1].tag != name:
                    o = stack[-1]
                    raise self.error(
                        f"</{name}> does not match <{o.tag}> opened at line {o.line}, column {o.column}",
                        start,
                    )
                stack.pop()
                after_tag = True
                continue
            el = self._open_tag()
            if root is None and stack:
                raise AssertionError("unreachable: stack without root")
            if not stack:
                if root is not None:
                    raise self.error("a document has exactly one root element", start)
                root = el
            else:
                stack[-1].children.append(el)
            if not el.self_closing:
                stack.append(el)
                if len(stack) > MAX_DEPTH:
                    raise self.error(
                        f"elements are nested more than {MAX_DEPTH} deep; flatten the document", start
                    )
            after_tag = True
        flush(before_tag=False)
        if stack:
            o = stack[-1]
            raise PMLError(f"<{o.tag}> is never closed; add </{o.tag}>", o.line, o.column)
        if root is None:
            raise PMLError("empty document: expected <schema name=...> or <prompt schema=...>", 1, 1)
        return root

    def _next_markup(self, i: int) -> int:
        """Index of the next '<' that starts markup, or -1."""
        while True:
            j = self.s.find("<", i)
            if j == -1 or j + 1 >= self.n:
                return -1
            c = self.s[j + 1]
            if c.isascii() and (c.isalpha() or c in "_/!?"):
                return j
            i = j + 1

    def _skip_ws(self) -> None:
        while self.i < self.n and self.s[self.i] in " \t\r\n":
            self.i += 1

    def _name(self, what: str) -> str:
        m = _NAME_RE.match(self.s, self.i)
        if not m:
            raise self.error(f"expected a name in {what}")
        self.i = m.end()
        return m.group(0)

    def _open_tag(self) -> _Raw:
        start = self.i
        self.i += 1
        tag = self._name("tag")
        ln, col = self.pos(start)
        attrs: dict[str, str] = {}
        attr_pos: dict[str, tuple[int, int]] = {}
        while True:
            had_ws = self.i < self.n and self.s[self.i] in " \t\r\n"
            self._skip_ws()
            if self.i >= self.n:
                raise PMLError(f"<{tag} is never finished; add '>'", ln, col)
            if self.s.startswith("/>", self.i):
                self.i += 2
                return _Raw(tag, attrs, attr_pos, [], ln, col, self_closing=True)
            if self.s[self.i] == ">":
                self.i += 1
                return _Raw(tag, attrs, attr_pos, [], ln, col)
            if not had_ws:
                raise PMLError(
                    f"<{tag} is not a well-formed tag (expected a space, '>' or '/>'); "
                    "if this '<' is text, write &lt;",
                    ln,
                    col,
                )
            a_start = self.i
            aname = self._name(f"an attribute of <{tag}>")
            self._skip_ws()
            if not self.s.startswith("=", self.i):
                raise self.error(f"attribute '{aname}' of <{tag}> needs a value: {aname}=\"...\"")
            self.i += 1
            self._skip_ws()
            if self.i >= self.n or self.s[self.i] not in "\"'":
                raise self.error(f"the value of '{aname}' must be quoted")
            q = self.s[self.i]
            end = self.s.find(q, self.i + 1)
            if end == -1:
                raise self.error(f"the value of '{aname}' is never closed; add {q}")
            raw = self.s[self.i + 1 : end]
            if "<" in raw:
                raise self.error(f"'<' in the value of '{aname}': write &lt;")
            if aname in attrs:
                raise self.error(f"attribute '{aname}' given twice in <{tag}>", a_start)
            attrs[aname] = unescape(raw, *self.pos(self.i))
            attr_pos[aname] = self.pos(a_start)
            self.i = end + 1


def _trim_leading(t: str) -> str:
    stripped = t.lstrip(" \t\r\n")
    return stripped if "\n" in t[: len(t) - len(stripped)] else t


def _trim_trailing(t: str) -> str:
    stripped = t.rstrip(" \t\r\n")
    return stripped if "\n" in t[len(stripped) :] else t


# ----------------------------------------------------------------------------
# Raw elements -> typed records
# ----------------------------------------------------------------------------


def _check_name(el: _Raw, attr: str = "name") -> str:
    if attr not in el.attrs:
        raise PMLError(f"<{el.tag}> needs a {attr}=\"...\" attribute", el.line, el.column)
    v = el.attrs[attr]
    if not _NAME_RE.fullmatch(v):
        ln, col = el.attr_pos[attr]
        raise PMLError(
            f"{attr}={v!r} is not a valid name: use letters, digits, '_', '-', '.', ':' "
            "and start with a letter or '_'",
            ln,
            col,
        )
    if v in _STRUCTURAL:
        ln, col = el.attr_pos[attr]
        raise PMLError(f"{v!r} is a reserved PML tag; choose another name", ln, col)
    return v


def _only_attrs(el: _Raw, allowed: tuple[str, ...]) -> None:
    for a in el.attrs:
        if a not in allowed:
            ln, col = el.attr_pos[a]
            want = ", ".join(allowed) if allowed else "no attributes"
            raise PMLError(f"<{el.tag}> does not take '{a}' (it takes {want})", ln, col)


def _only_whitespace(children: list, where: _Raw) -> list:
    out = []
    for c in children:
        if isinstance(c, Text):
            if c.text.strip():
                raise PMLError(
                    f"text is not allowed directly inside <{where.tag}>; put it in a <module>",
                    c.line,
                    c.column,
                )
            continue
        out.append(c)
    return out


class _SchemaBuilder:
    def __init__(self) -> None:
        self.names: dict[str, tuple[int, int]] = {}

    def claim(self, name: str, el: _Raw) -> None:
        if name in self.names:
            pl, pc = self.names[name]
            ln, col = el.attr_pos.get("name", (el.line, el.column))
            raise PMLError(
                f"the name {name!r} is already used at line {pl}, column {pc}; names must be unique in a schema",
                ln,
                col,
            )
        self.names[name] = el.attr_pos.get("name", (el.line, el.column))

    def body(self, children: list, in_module: bool, in_role: bool) -> tuple[Node, ...]:
        out: list[Node] = []
        for c in children:
            if isinstance(c, Text):
                out.append(c)
            else:
                out.append(self.element(c, in_module, in_role))
        return tuple(out)

    def element(self, el: _Raw, in_module: bool, in_role: bool) -> Node:
        t = el.tag
        if t == "module":
            _only_attrs(el, ("name",))
            name = _check_name(el)
            self.claim(name, el)
            return Module(name, self.body(el.children, True, in_role), el.line, el.column)
        if t == "union":
            _only_attrs(el, ())
            kids = _only_whitespace(el.children, el)
            members = []
            for k in kids:
                if k.tag != "module":
                    raise PMLError(f"<union> may hold only <module> elements, not <{k.tag}>", k.line, k.column)
                members.append(self.element(k, in_module, in_role))
            if not members:
                raise PMLError("<union> is empty; give it at least one <module>", el.line, el.column)
            return Union(tuple(members), el.line, el.column)
        if t == "scaffold":
            _only_attrs(el, ("name",))
            name = _check_name(el)
            self.claim(name, el)
            if in_module:
                raise PMLError("<scaffold> must be at the top level of the schema", el.line, el.column)
            kids = _only_whitespace(el.children, el)
            members = []
            for k in kids:
                if k.tag != "module":
                    raise PMLError(f"<scaffold> may hold only <module> elements, not <{k.tag}>", k.line, k.column)
                members.append(self.element(k, True, in_role))
            if len(members) < 2:
                raise PMLError("a <scaffold> groups two or more modules", el.line, el.column)
            return Scaffold(name, tuple(members), el.line, el.column)
        if t == "param":
            _only_attrs(el, ("name", "len"))
            name = _check_name(el)
            if not in_module:
                raise PMLError(f"<param name={name!r}> must be inside a <module>", el.line, el.column)
            if not el.self_closing and el.children:
                raise PMLError("<param> takes no content; write <param name=\"...\" len=\"N\"/>", el.line, el.column)
            if "len" not in el.attrs:
                raise PMLError(f"<param name={name!r}> needs len=\"N\" (the most tokens an argument may take)", el.line, el.column)
            raw = el.attrs["len"].strip()
            if not raw.isdigit() or not (1 <= int(raw) <= MAX_PARAM_LEN):
                ln, col = el.attr_pos["len"]
                raise PMLError(f"len={el.attrs['len']!r} must be a whole number from 1 to {MAX_PARAM_LEN}", ln, col)
            self.claim(name, el)
            return Param(name, int(raw), el.line, el.column)
        if t in ROLES:
            _only_attrs(el, ())
            if in_role:
                raise PMLError(f"<{t}> cannot be nested inside another role tag", el.line, el.column)
            return Role(t, self.body(el.children, in_module, True), el.line, el.column)
        if t in ("schema", "prompt"):
            raise PMLError(f"<{t}> can only be the root element", el.line, el.column)
        raise PMLError(
            f"unknown tag <{t}> in a schema (allowed: module, union, param, scaffold, system, user, "
            "assistant); write &lt; for a literal '<'",
            el.line,
            el.column,
        )


def parse_schema(source: str) -> Schema:
    """Parse a ``<schema name="...">`` document.

    Raises :class:`PMLError` for anything malformed, with line and column.
    """
    root = _Reader(source).parse_document()
    if root.tag != "schema":
        raise PMLError(f"expected <schema name=...> as the root element, found <{root.tag}>", root.line, root.column)
    _only_attrs(root, ("name", "conditioning"))
    name = _check_name(root)
    cond = root.attrs.get("conditioning", "none").strip() or "none"
    b = _SchemaBuilder()
    return Schema(name, b.body(root.children, False, False), cond)


def parse_prompt(source: str) -> Prompt:
    """Parse a ``<prompt schema="...">`` document.

    Imports (self-closing tags naming modules) must be at the top level of the
    prompt; role tags hold uncached text only.
    """
    root = _Reader(source).parse_document()
    if root.tag != "prompt":
        raise PMLError(f"expected <prompt schema=...> as the root element, found <{root.tag}>", root.line, root.column)
    _only_attrs(root, ("schema",))
    schema = _check_name(root, "schema")
    body: list[PromptNode] = []
    seen: dict[str, tuple[int, int]] = {}
    for c in root.children:
        if isinstance(c, Text):
            body.append(c)
            continue
        if c.tag in ROLES:
            _only_attrs(c, ())
            parts = []
            for k in c.children:
                if not isinstance(k, Text):
                    raise PMLError(
                        f"<{k.tag}> inside <{c.tag}>: imports go at the top level of the prompt, "
                        "role tags hold new text only",
                        k.line,
                        k.column,
                    )
                parts.append(k)
            body.append(Role(c.tag, tuple(parts), c.line, c.column))
            continue
        if c.tag in _STRUCTURAL:
            raise PMLError(f"<{c.tag}> belongs in a schema, not in a prompt", c.line, c.column)
        if not c.self_closing:
            raise PMLError(f"import <{c.tag}> must be self-closing: write <{c.tag}/>", c.line, c.column)
        if c.tag in seen:
            pl, pc = seen[c.tag]
            raise PMLError(f"module {c.tag!r} is imported twice (first at line {pl}, column {pc})", c.line, c.column)
        seen[c.tag] = (c.line, c.column)
        body.append(Import(c.tag, dict(c.attrs), c.line, c.column))
    return Prompt(schema, tuple(body), root.line, root.column)


def parse(source: str) -> Schema | Prompt:
    """Parse either document type, by its root element."""
    s = source.lstrip() if isinstance(source, str) else source
    if isinstance(s, str) and s.startswith("<prompt"):
        return parse_prompt(source)
    return parse_schema(source)
