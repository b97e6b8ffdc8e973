"""The package's shape, checked on its source: imports point down (no cycles, counting imports
under ``TYPE_CHECKING``), no module calls another module's private names, nothing outside the
engine reaches through it for its parts (``x.pc.store``), an index's paths are built in one
place, and no class grows past ``MAX_CLASS_LINES``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pcache_rag"
CONNECTORS = [ROOT / "connectors" / "langchain-pcache" / "langchain_pcache",
              ROOT / "connectors" / "llama-index-llms-pcache" / "llama_index" / "llms" / "pcache"]
MAX_CLASS_LINES = 250
#: private names of other libraries that are their documented way in (each with its reason)
FOREIGN_PRIVATE = {
    "_attn_implementation",  # transformers: the config field set_attn_implementation() writes
    "_llm",  # llama_index Settings: reading Settings.llm would resolve (and try to reach) OpenAI
    "_streaming", "_context_prompt_template", "_system_prompt",  # llama_index base classes: a subclass reads its own inherited state
    "_scaled_dot_product_flash_attention_for_cpu",  # torch: the CPU flash kernel, the one that returns the log-sum-exp
    "_weight_int8pack_mm",  # torch: the weight-only int8 matmul kernel (torchao's and gpt-fast's on CPU)
    "_reorder_linear_weight", "_linear_pointwise",  # torch: oneDNN's prepacked linear (inductor's CPU freezing path)
    "_identifier_to_system",  # chromadb: its client cache, cleared so a reopened index is read afresh
    "_sql",  # diskcache: its SQL connection, for the one consistency query it has no API for
}


def _modules(base: Path, prefix: str) -> dict[str, Path]:
    out = {}
    for f in sorted(base.rglob("*.py")):
        rel = f.relative_to(base).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out[".".join([prefix, *parts])] = f
    return out


MODULES = _modules(PACKAGE, "pcache_rag")


def _imports(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports, at any depth of the file: in a function, and under
    ``TYPE_CHECKING`` too (a type that needs a module above is a dependency on it all the same)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("pcache_rag"):
                    found.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("pcache_rag"):
                continue
            for a in node.names:  # `from . import x` imports the module x when it is one
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in MODULES else mod)
    return {m for m in found if m in MODULES and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports. A package's ``__init__`` re-exports are
    edges too, so only edges into the package itself (``from ..engine import X``) count them."""
    return {name: _imports(name, path) for name, path in MODULES.items()}


def test_no_import_cycles():
    graph = import_graph()
    # a package's __init__ importing its own submodules is how re-exports work: not a cycle
    for name in graph:
        graph[name] = {m for m in graph[name] if not (MODULES[name].name == "__init__.py" and m.startswith(name + "."))}
    assert _cycles(graph) == []


def _owned_private_names(tree: ast.AST) -> set[str]:
    """Private names this file defines: functions, classes, attributes it assigns, arguments."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    owned = _owned_private_names(tree)
    bad = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            name = node.attr
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    bad.append(f"{path.name}:{node.lineno} imports {a.name}")
            continue
        if name and name.startswith("_") and not name.startswith("__") and name not in owned \
                and name not in FOREIGN_PRIVATE:
            bad.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return bad


@pytest.mark.parametrize("path", [*MODULES.values(), *(f for c in CONNECTORS for f in sorted(c.rglob("*.py")))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_names_of_other_modules(path):
    """A module may use only the private names it defines itself: the public API is enough."""
    assert _private_uses(path) == []


def test_no_class_is_too_big():
    """No class of the library or of a connector is over ``MAX_CLASS_LINES`` lines."""
    big = []
    connectors = [f for c in CONNECTORS for f in sorted(c.rglob("*.py")) if "build" not in f.parts]
    for path in [*MODULES.values(), *connectors]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    big.append(f"{path.relative_to(ROOT)}:{node.name} has {n} lines")
    assert big == []


MAX_FORWARDS = 3


def _forwards(cls: ast.ClassDef) -> list[str]:
    """Methods of ``cls`` whose body (docstring aside) only calls ``self.<part>.<method>`` with the
    method's own parameters: a pass-through to another object."""
    out = []
    for m in cls.body:
        if not isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = [b for b in m.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
        call = body[0].value if len(body) == 1 and isinstance(body[0], (ast.Return, ast.Expr)) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and isinstance(call.func.value, ast.Attribute) and isinstance(call.func.value.value, ast.Name)
                and call.func.value.value.id == "self"):
            continue
        a = m.args
        params = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]}
        given = [*call.args, *(k.value for k in call.keywords)]
        if all(isinstance(g.value if isinstance(g, ast.Starred) else g, ast.Name)
               and (g.value if isinstance(g, ast.Starred) else g).id in params for g in given):
            out.append(m.name)
    return out


def _classes(paths):
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                yield path, node


def test_no_class_is_mostly_pass_throughs():
    """A class forwards at most ``MAX_FORWARDS`` methods to its parts; callers use the part."""
    many = [f"{p.relative_to(ROOT)}:{c.name} forwards {fw}" for p, c in _classes([*MODULES.values(), *(
        f for c in CONNECTORS for f in sorted(c.rglob("*.py")))]) if len(fw := _forwards(c)) > MAX_FORWARDS]
    assert many == []


def test_the_checks_can_fail(tmp_path):
    """The checkers find what they look for: a cycle, a foreign private name."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    f = tmp_path / "m.py"
    f.write_text("def f(pc):\n    return pc._schemas\n\nclass A:\n    def g(self):\n        self._x = 1\n        return self._x\n")
    assert _private_uses(f) == ["m.py:2 pc._schemas"]
    cls = ast.parse("class A:\n    def f(self, x):\n        'doc'\n        return self.b.f(x)\n"
                    "    def g(self, *a, **k):\n        self.b.g(*a, **k)\n"
                    "    def h(self, x):\n        return self.b.h(x + 1)\n").body[0]
    assert isinstance(cls, ast.ClassDef) and _forwards(cls) == ["f", "g"]


def test_connectors_import_without_the_engine():
    """A connector imports in the time its framework takes: torch, transformers, chromadb and the
    engine load when the first model is built, not at import (was 11 to 14 s here)."""
    import subprocess
    import sys

    code = ("import sys, langchain_pcache, llama_index.llms.pcache, pcache_rag; "
            "print(sorted(m for m in ('torch', 'transformers', 'chromadb', 'redis', 'pypdf', 'docx', "
            "'pcache_rag.engine') if m in sys.modules))")
    got = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert got.strip().splitlines()[-1] == "[]"


def _engine_parts() -> set[str]:
    """The engine's parts: what ``PromptCache`` assigns to ``self`` (its store, adapter, tokenizer,
    core, dispatcher...). Its methods and properties are its front; a layer above is handed the part it
    uses, and never reaches for it through the engine."""
    tree = ast.parse((PACKAGE / "engine" / "prompt_cache.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PromptCache")
    front = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    attrs = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
             and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return attrs - front


def _reach_through(path: Path, parts: set[str]) -> list[str]:
    """``x.pc.<part>`` (or ``x.engine.<part>``) chains in ``path``: a part of the engine read
    through an object that holds the engine."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and node.value.attr in ("pc", "engine", "_pc", "_engine") and node.attr in parts:
            bad.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return bad


OUTSIDE_ENGINE = [p for p in MODULES.values() if "engine" not in p.relative_to(PACKAGE).parts] + \
    [f for c in CONNECTORS for f in sorted(c.rglob("*.py"))]


def test_nothing_outside_the_engine_reaches_through_it():
    parts = _engine_parts()
    assert {"store", "adapter", "tokenizer", "core", "dispatch"} <= parts, parts  # the check looks at what it should
    assert [b for p in OUTSIDE_ENGINE for b in _reach_through(p, parts)] == []


def test_an_index_path_is_built_in_one_place():
    """``<index>/kv`` and its siblings are :class:`pcache_rag.rag.Index`'s to build."""
    names = {"kv", "chroma", "uploads"}
    bad = []
    for path in [*MODULES.values(), *(f for c in CONNECTORS for f in sorted(c.rglob("*.py")))]:
        if path == PACKAGE / "rag" / "index_dir.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                    and node.right.value in names:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert bad == []


def test_the_reach_through_check_can_fail(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f(rag):\n    return rag.pc.store, rag.pc.generate_parts, rag.engine.workspace\n")
    assert _reach_through(f, {"store", "workspace"}) == ["m.py:2 rag.pc.store", "m.py:2 rag.engine.workspace"]


def test_per_forward_state_rides_with_the_call_not_in_a_thread():
    """What a forward asks of the attention (a calibrated span, recomputed rows, a probe, a ragged
    step, windows' positions) is a ``Forward`` record passed with the model's call
    (``models/attention.py``). The one thread-local left is ``models/fast_decode.py``'s row marker:
    transformers calls ``nn.Linear`` with no keywords, and an attribute on the model would be
    shared by every thread that runs it."""
    kept = sorted(str(p.relative_to(ROOT)) for p in MODULES.values()
                  if "threading.local(" in p.read_text(encoding="utf-8"))
    assert kept == ["pcache_rag/models/fast_decode.py"]
