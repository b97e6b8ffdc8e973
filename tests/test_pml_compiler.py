"""Python-to-PML: the paper's three kinds of prompt program compile, lay out and import correctly."""

import pytest

from helpers import WordTokenizer
from pcache_rag.pml import PMLError, chat_format_for, layout_schema, parse_schema, plan_prompt
from pcache_rag.pml.compiler import compile_program, system, template

SOURCES = {
    "utils.py": "def add(a, b):\n    return a + b",
    "main.py": "from utils import add\nprint(add(1, 2))",
}


def codegen(files, task):
    """You write Python code that uses the given source files."""
    if "utils.py" in files:
        "# utils.py\ndef add(a, b):\n    return a + b"
    if "main.py" in files:
        "# main.py\nfrom utils import add\nprint(add(1, 2))"


def tutor(level, style):
    system("You are a patient tutor.")
    if level == "beginner":
        "The student is new to the subject."
    elif level == "intermediate":
        "The student knows the basics."
    else:
        "The student is advanced."
    match style:
        case "visual":
            "Explain with diagrams."
        case "verbal":
            "Explain in words."
        case _:
            "Mix explanations."


@template(duration=6)
def trip_plan(duration):
    return f"Plan a trip lasting {duration} with a daily budget & a map."


def planner(city, duration):
    system("You are a concise travel planner.")
    if city == "miami":
        "Miami is a coastal city in Florida."
    elif city == "paris":
        "Paris is the capital of France."
    trip_plan(duration)


def check(prog, tok=None):
    tok = tok or WordTokenizer()
    parse_schema(prog.schema)
    return layout_schema(prog.schema, tok, chat_format_for(tok)), tok


def test_codegen_source_files_become_modules():
    prog = compile_program(codegen)
    L, tok = check(prog)
    assert {"utils.py", "main.py"} <= set(L.units)
    assert L.units["utils.py"].union is None
    assert prog.imports(files=["main.py"], task="x") == [("main.py", {})]
    p = prog.prompt(files=["utils.py", "main.py"], task="x", question="Add a test")
    plan = plan_prompt(p, L, tok)
    assert [u.name for u in plan.units if u.kind == "module"] == ["utils.py", "main.py"]
    assert "# utils.py\ndef add(a, b):" in parse_schema(prog.schema).body[1].body[0].text


def test_tutor_if_elif_else_and_match_become_unions():
    prog = compile_program(tutor)
    L, tok = check(prog)
    assert L.unions == [["beginner", "intermediate", "beginner-else"], ["visual", "verbal", "style-other"]]
    assert L.units["beginner"].start == L.units["beginner-else"].start
    assert prog.imports(level="advanced", style="verbal") == [("beginner-else", {}), ("verbal", {})]
    plan_prompt(prog.prompt(level="beginner", style="other", question="What is a set?"), L, tok)


def test_trip_planner_template_becomes_module_with_param():
    prog = compile_program(planner)
    L, tok = check(prog)
    unit = L.units["trip-plan"]
    assert unit.params[0].name == "duration" and unit.params[0].length == 6
    assert prog.imports(city="paris", duration="3 days") == [("paris", {}), ("trip-plan", {"duration": "3 days"})]
    plan = plan_prompt(prog.prompt(city="paris", duration="3 days", question="Where to eat?"), L, tok)
    (_, slot, ids), = plan.args
    assert len(ids) == 2
    assert "&amp; a map" in prog.schema


def test_unsupported_statements_are_pml_errors():
    def bad(x):
        for i in range(3):
            "loop"

    with pytest.raises(PMLError, match="For is not supported"):
        compile_program(bad)

    def runtime_fstring(x):
        f"value {x}"

    with pytest.raises(PMLError, match="only use constants"):
        compile_program(runtime_fstring)


def test_compiled_program_runs_on_the_engine(smol):
    prog = compile_program(planner)
    smol.add_schema(prog.schema)
    out = smol.generate(prog.prompt(city="paris", duration="3 days", question="Name one museum."), max_new_tokens=4)
    assert out.cached_tokens > 0 and out.token_ids
