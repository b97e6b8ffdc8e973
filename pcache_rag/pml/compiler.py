"""Compile prompt programs written in Python into PML schemas (the paper's compiler).

A *prompt program* is a plain function whose body builds a prompt from string
statements and control flow. The mapping:

* a string statement (``"text"`` or an f-string of constants) is text; at the
  top level it is always included, inside a branch it belongs to that module;
* ``if cond:`` with no ``else`` becomes a ``<module>`` (imported when ``cond``
  holds);
* ``if/elif/else`` chains and ``match`` statements become a ``<union>`` whose
  members are the branches (exactly one is imported);
* a call to a function decorated with :func:`template` becomes a module nested
  where it is called: the template's f-string is its text and each
  ``{placeholder}`` a ``<param>`` whose ``len`` the decorator declares;
* ``system("...")``, ``user("...")``, ``assistant("...")`` wrap text in role tags.

Module names come from the conditions: ``if kids:`` -> ``kids``,
``if level == "beginner":`` -> ``beginner``, ``if "utils.py" in files:`` ->
``utils.py``, ``else`` -> ``<first branch>-else``; repeats get ``-2``, ``-3``.

:func:`compile_program` returns a :class:`CompiledProgram` with the schema and
a ``prompt(**arguments)`` method that evaluates the conditions for concrete
arguments and writes the matching PML prompt.

Example::

    @template(duration=6)
    def trip_plan(duration):
        return f"Plan a trip lasting {duration} with a daily budget."

    def planner(city, duration):
        system("You are a concise travel planner.")
        if city == "miami":
            "Miami is a coastal city in Florida."
        elif city == "paris":
            "Paris is the capital of France."
        trip_plan(duration)

    prog = compile_program(planner)
    prog.schema                      # <schema name="planner"> ... </schema>
    prog.prompt(city="paris", duration="3 days", question="Where to eat?")
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass, field

from .errors import PMLError
from .parser import escape

ROLE_CALLS = ("system", "user", "assistant")


def template(**lengths: int):
    """Declare a function as a prompt template; ``lengths`` give each parameter's
    maximum length in tokens (the ``len`` of its ``<param>``)."""

    def deco(fn):
        fn.__pml_template__ = dict(lengths)
        return fn

    return deco


def system(text: str) -> str:  # pragma: no cover - markers read by the compiler
    """Marks system text in a prompt program (read by the compiler, not run)."""
    return text


def user(text: str) -> str:  # pragma: no cover
    return text


def assistant(text: str) -> str:  # pragma: no cover
    return text


@dataclass(slots=True)
class _Branch:
    name: str
    cond: ast.expr | None  # None: the "else" of a union
    union: int | None  # index of the union, or None for a lone if
    parent: str | None
    template_args: dict[str, ast.expr] = field(default_factory=dict)


@dataclass(slots=True)
class CompiledProgram:
    """A compiled prompt program: its schema and how to import for given arguments."""

    name: str
    schema: str  # the PML schema
    branches: list[_Branch]
    globals: dict
    arg_names: list[str]

    def imports(self, **arguments) -> list[tuple[str, dict[str, str]]]:
        """The modules (with template arguments) a prompt for ``arguments`` imports."""
        missing = [a for a in self.arg_names if a not in arguments]
        if missing:
            raise TypeError(f"{self.name}() missing arguments: {', '.join(missing)}")
        env = dict(self.globals)
        env.update(arguments)
        taken: dict[int, bool] = {}
        chosen: set[str | None] = {None}
        out = []
        for b in self.branches:
            if b.parent not in chosen:
                continue
            if b.union is not None and taken.get(b.union):
                continue
            ok = True if b.cond is None else bool(eval(compile(ast.Expression(b.cond), "<pml>", "eval"), env))
            if not ok:
                continue
            if b.union is not None:
                taken[b.union] = True
            chosen.add(b.name)
            args = {k: str(eval(compile(ast.Expression(v), "<pml>", "eval"), env)) for k, v in b.template_args.items()}
            out.append((b.name, args))
        return out

    def prompt(self, question: str | None = None, **arguments) -> str:
        """A PML prompt for ``arguments``; ``question`` becomes an escaped ``<user>`` turn."""
        parts = []
        for name, args in self.imports(**arguments):
            attrs = "".join(f' {k}="{escape(v)}"' for k, v in args.items())
            parts.append(f"<{name}{attrs}/>")
        if question is not None:
            parts.append(f"<user>{escape(question)}</user>")
        return f'<prompt schema="{self.name}">{"".join(parts)}</prompt>'


def _slug(s: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_.:\-]+", "-", s).strip("-")
    if not s or not (s[0].isalpha() or s[0] == "_"):
        s = "m-" + s
    return s


class _Compiler:
    def __init__(self, fn):
        self.fn = fn
        self.globals = dict(fn.__globals__)
        if fn.__closure__:
            self.globals.update(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
        self.names: set[str] = set()
        self.branches: list[_Branch] = []
        self.n_unions = 0
        self.file = inspect.getsourcefile(fn) or "<program>"
        self.first_line = fn.__code__.co_firstlineno

    def error(self, msg: str, node: ast.AST) -> PMLError:
        return PMLError(f"{self.fn.__name__}: {msg}", self.first_line + getattr(node, "lineno", 1) - 1,
                        getattr(node, "col_offset", 0) + 1)

    def unique(self, base: str) -> str:
        name, k = _slug(base), 2
        while name in self.names or name in ("schema", "prompt", "module", "union", "param", "scaffold") + ROLE_CALLS:
            name = f"{_slug(base)}-{k}"
            k += 1
        self.names.add(name)
        return name

    def cond_name(self, cond: ast.expr) -> str:
        if isinstance(cond, ast.Name):
            return cond.id
        if isinstance(cond, ast.Attribute):
            return cond.attr
        if isinstance(cond, ast.UnaryOp) and isinstance(cond.op, ast.Not):
            return "no-" + self.cond_name(cond.operand)
        if isinstance(cond, ast.Compare) and len(cond.comparators) == 1:
            for side in (cond.comparators[0], cond.left):
                if isinstance(side, ast.Constant) and isinstance(side.value, (str, int, float, bool)):
                    return str(side.value)
            return self.cond_name(cond.left)
        if isinstance(cond, ast.Call):
            return self.cond_name(cond.func)
        return "branch"

    def const_text(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            try:
                return str(eval(compile(ast.Expression(node), "<pml>", "eval"), dict(self.globals)))
            except Exception:  # noqa: BLE001 - placeholders of runtime values
                raise self.error("an f-string in a program may only use constants; pass runtime values "
                                 "to a @template function instead", node) from None
        return None

    def body(self, stmts: list[ast.stmt], parent: str | None) -> str:
        out = []
        for i, s in enumerate(stmts):
            if i == 0 and parent is None and isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) \
                    and isinstance(s.value.value, str) and stmts is self.fn_body:
                out.append(escape(inspect.cleandoc(s.value.value)))  # the docstring is the preamble
                continue
            out.append(self.stmt(s, parent))
        return "".join(out)

    def stmt(self, s: ast.stmt, parent: str | None) -> str:
        if isinstance(s, ast.Expr):
            v = s.value
            text = self.const_text(v)
            if text is not None:
                return escape(text)
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name):
                fname = v.func.id
                if fname in ROLE_CALLS:
                    if len(v.args) != 1 or (t := self.const_text(v.args[0])) is None:
                        raise self.error(f"{fname}() takes one constant string", v)
                    return f"<{fname}>{escape(t)}</{fname}>"
                target = self.globals.get(fname)
                if callable(target) and hasattr(target, "__pml_template__"):
                    return self.call_template(target, v, parent)
            raise self.error("a program statement must be a string, an if/match, a role call or a @template call", s)
        if isinstance(s, ast.If):
            return self.if_chain(s, parent)
        if isinstance(s, ast.Match):
            return self.match(s, parent)
        if isinstance(s, ast.Pass):
            return ""
        raise self.error(f"{type(s).__name__} is not supported in a prompt program", s)

    def module(self, name: str, cond, union, parent, stmts) -> str:
        self.branches.append(_Branch(name, cond, union, parent))
        inner = self.body(stmts, name)
        if not inner.strip():
            raise self.error(f"branch {name!r} adds no text", stmts[0] if stmts else ast.Pass())
        return f'<module name="{name}">{inner}</module>'

    def if_chain(self, s: ast.If, parent) -> str:
        arms: list[tuple[ast.expr | None, list[ast.stmt]]] = []
        node: ast.If | None = s
        while node is not None:
            arms.append((node.test, node.body))
            if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
                node = node.orelse[0]
            else:
                if node.orelse:
                    arms.append((None, node.orelse))
                node = None
        if len(arms) == 1:
            cond, body = arms[0]
            return self.module(self.unique(self.cond_name(cond)), cond, None, parent, body)
        u = self.n_unions
        self.n_unions += 1
        first = self.cond_name(arms[0][0])
        members = []
        for cond, body in arms:
            name = self.unique(self.cond_name(cond) if cond is not None else f"{first}-else")
            members.append(self.module(name, cond, u, parent, body))
        return "<union>" + "".join(members) + "</union>"

    def match(self, s: ast.Match, parent) -> str:
        u = self.n_unions
        self.n_unions += 1
        members = []
        for case in s.cases:
            p = case.pattern
            if isinstance(p, ast.MatchValue):
                cond = ast.Compare(left=s.subject, ops=[ast.Eq()], comparators=[p.value])
                base = self.cond_name(cond)
            elif isinstance(p, ast.MatchAs) and p.pattern is None:
                cond, base = None, f"{self.cond_name(s.subject)}-other"
            else:
                raise self.error("match cases must be constants or _", p)
            if case.guard is not None:
                raise self.error("match guards are not supported", case.guard)
            ast.fix_missing_locations(cond) if cond is not None else None
            members.append(self.module(self.unique(base), cond, u, parent, case.body))
        return "<union>" + "".join(members) + "</union>"

    def call_template(self, fn, call: ast.Call, parent) -> str:
        lengths = fn.__pml_template__
        sig = inspect.signature(fn)
        try:
            bound = sig.bind(*call.args, **{k.arg: k.value for k in call.keywords})
        except TypeError as e:
            raise self.error(f"{fn.__name__}(): {e}", call) from None
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        fdef = tree.body[0]
        ret = next((n for n in ast.walk(fdef) if isinstance(n, ast.Return)), None)
        if ret is None or not isinstance(ret.value, (ast.JoinedStr, ast.Constant)):
            raise self.error(f"template {fn.__name__}() must return an f-string", call)
        name = self.unique(fn.__name__.replace("_", "-"))
        pieces = []
        pnames: dict[str, str] = {}  # template parameter -> its (schema-unique) param name
        parts = ret.value.values if isinstance(ret.value, ast.JoinedStr) else [ret.value]
        for part in parts:
            if isinstance(part, ast.Constant):
                pieces.append(escape(str(part.value)))
            elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name) \
                    and part.value.id in sig.parameters:
                pname = part.value.id
                if pname not in lengths:
                    raise self.error(f"@template({pname}=N) is needed: how many tokens may {pname} take?", call)
                if pname not in pnames:
                    pnames[pname] = self.unique(pname)
                pieces.append(f'<param name="{pnames[pname]}" len="{int(lengths[pname])}"/>')
            else:
                raise self.error(f"template {fn.__name__}(): placeholders must be its parameters", call)
        b = _Branch(name, None, None, parent)
        b.template_args = {pnames[p]: expr for p, expr in bound.arguments.items() if p in pnames}
        self.branches.append(b)
        return f'<module name="{name}">{"".join(pieces)}</module>'


def compile_program(fn, name: str | None = None) -> CompiledProgram:
    """Compile the prompt program ``fn`` into a :class:`CompiledProgram`."""
    src = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(src)
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        raise PMLError(f"{fn!r} is not a plain function")
    c = _Compiler(fn)
    c.fn_body = fdef.body
    schema_name = _slug(name or fn.__name__.replace("_", "-"))
    body = c.body(fdef.body, None)
    schema = f'<schema name="{schema_name}">{body}</schema>'
    args = [a.arg for a in fdef.args.args]
    return CompiledProgram(schema_name, schema, c.branches, c.globals, args)
