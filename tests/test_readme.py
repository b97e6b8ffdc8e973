"""The README's code runs as written: every Python block is run by a test here (the test below
counts them), every ``pcache-rag`` command line in its shell blocks (and the tour's) parses, and
its table of numbers is the one its run reports give. The guide's structured-output example, the
tour's OpenAI client and the connectors' quick starts run here too."""

import re
import shlex
from pathlib import Path

import pytest
from helpers import last_output

README = Path(__file__).resolve().parents[1] / "README.md"
GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"
TOUR = Path(__file__).resolve().parents[1] / "docs" / "tour.md"
#: the README's and the tour's Python blocks, by their first line, and the test that runs each
RUN = {README: {"from pcache_rag import PromptCache, escape": "test_quick_start_block_runs",
                "from pcache_rag.rag import CachedRAG": "test_rag_block_runs",
                "from llama_index.core import SimpleDirectoryReader, VectorStoreIndex": "test_llamaindex_example_runs",
                "from pathlib import Path": "test_langchain_example_runs"},
       TOUR: {"from openai import OpenAI": "test_openai_client_block_runs"}}


@pytest.mark.parametrize("doc", list(RUN), ids=lambda p: p.name)
def test_every_python_block_is_run_here(doc):
    firsts = [b.splitlines()[0] for b in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)]
    assert sorted(firsts) == sorted(RUN[doc]), f"a {doc.name} block without a test here (or a test without its block)"
    assert all(name in globals() for name in RUN[doc].values())


@pytest.mark.parametrize("page,which", [("README.md", "readme"), ("docs/numbers.md", "all")])
def test_the_numbers_are_their_run_reports(page, which):
    """The table between the markers of the README (a few rows) and of docs/numbers.md (every
    figure) is exactly what scripts/readme-numbers.py computes from the runs' JSON: a number typed
    by hand, or a report replaced alone, fails here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_numbers", README.parent / "scripts" / "readme-numbers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = (README.parent / page).read_text()
    have = mod.readme_table(text)
    assert have == mod.table(which)
    edited = text.replace(have, have.replace(" vs ", " vs 1", 1))  # one number typed by hand
    assert edited != text and mod.readme_table(edited) != mod.table(which), "the check can fail"


def test_the_readme_shows_a_small_table():
    """The README's first screen keeps a few rows (issue 58); the rest live in docs/numbers.md."""
    table = README.read_text().split("<!-- numbers:")[1].split("<!-- /numbers -->")[0]
    assert 3 <= table.count("\n| ") - 1 <= 6


def test_the_readmes_command_lines_parse():
    """Each ``pcache-rag ...`` line of a shell block is a command the CLI takes (parsed, not run;
    ``[...]`` option lists are dropped)."""
    from pcache_rag.cli import build_parser

    parser = build_parser()
    lines = [ln for doc in (README, TOUR) for b in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S)
             for ln in b.splitlines()]
    cmds = [ln.split("#")[0].strip() for ln in lines if ln.strip().startswith("pcache-rag ")]
    assert len(cmds) >= 10
    for cmd in cmds:
        words = shlex.split(re.sub(r"\[[^\]]*\]", "", cmd))[1:]
        words = [w.split("|")[0] for w in words]  # "ttft|rag": the first choice
        try:
            parser.parse_args(words)
        except SystemExit as e:
            raise AssertionError(f"the README's `{cmd}` does not parse") from e


def test_quick_start_block_runs(smol_dir, capsys):
    text = README.read_text()
    quick = text[text.index("## Quick start"):]
    code = re.search(r"```python\n(.*?)```", quick, re.S).group(1)
    exec(compile(code, "README.md:quick-start", "exec"), {})
    out = capsys.readouterr().out
    assert out.strip(), "the example printed an answer"


def _framework_block(title: str, doc: Path = README) -> str:
    text = doc.read_text()
    part = text[text.index(title):]
    return re.search(r"```python\n(.*?)```", part, re.S).group(1)


def _my_docs(tmp_path, monkeypatch, smol):
    from pcache_rag.docmodules import register_engine

    register_engine(smol)  # the default config's engine: the session's model, an in-memory store
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-docs").mkdir()
    (tmp_path / "my-docs" / "gates.md").write_text(
        "The access code for the north gate is 4417.\n\nThe south gate is closed for repairs until May.\n")
    # one code only: the reader puts each file's absolute (temporary) path into the prompt, and with two
    # codes the 135M model's pick between them turned on those random characters (CI failed on it once)
    (tmp_path / "my-docs" / "ferry.md").write_text("The ferry to the island leaves at 07:45 every morning.\n")


def test_llamaindex_example_runs(tmp_path, monkeypatch, smol, capsys):
    _my_docs(tmp_path, monkeypatch, smol)
    exec(compile(_framework_block("## LlamaIndex"), "README.md:llamaindex", "exec"), {})
    out = capsys.readouterr().out
    assert "4417" in out and "'cached_tokens'" in out
    assert last_output(smol).cached_tokens > 0


def test_langchain_example_runs(tmp_path, monkeypatch, smol, capsys):
    _my_docs(tmp_path, monkeypatch, smol)
    exec(compile(_framework_block("## LangChain"), "README.md:langchain", "exec"), {})
    out = capsys.readouterr().out
    assert "4417" in out and "gates.md" in out
    assert last_output(smol).cached_tokens > 0


CONNECTORS = Path(__file__).resolve().parents[1] / "connectors"


def _connector_block(name: str) -> str:
    text = (CONNECTORS / name / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_langchain_connectors_quick_start_runs(smol, capsys):
    """Its stock chain: the second question reads the documents the first one's prompt taught."""
    from pcache_rag import PromptCache
    from pcache_rag.docmodules import register_engine

    register_engine(PromptCache(smol.model, smol.tokenizer))  # the default config: a fresh in-memory engine
    exec(compile(_connector_block("langchain-pcache"), "langchain-pcache/README.md", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "23:40" in lines[0]
    assert "'cache_read': 0}" in lines[0] and "'cache_read': 0}" not in lines[1] and lines[1].endswith(" []")


def test_the_llamaindex_connectors_quick_start_runs(smol, capsys):
    from pcache_rag.docmodules import register_engine

    register_engine(smol)
    exec(compile(_connector_block("llama-index-llms-pcache"), "llama-index-llms-pcache/README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "4417" in out and "07:45" in out and "'cached_tokens'" in out
    assert last_output(smol).cached_tokens > 0


def test_structured_output_example_runs(smol, capsys):
    import textwrap

    from pcache_rag.docmodules import register_engine

    register_engine(smol)  # the default config's engine: the session's model, an in-memory store
    exec(compile(textwrap.dedent(_framework_block("* **Structured output.**", GUIDE)), "guide.md:structured", "exec"),
         {})
    out = capsys.readouterr().out
    assert "code=4417" in out, out


def test_rag_block_runs(tmp_path, monkeypatch, capsys):
    """``CachedRAG("./my-index")`` over ``./docs``: the embedded model, loaded by the block itself."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "logs.md").write_text("Logs are rotated by logrotate every night at 02:00.\n\n"
                                               "Rotated logs are compressed with gzip after one day.\n")
    g: dict = {}
    exec(compile(_framework_block("```python\nfrom pcache_rag.rag import CachedRAG").replace("```python\n", "", 1),
                 "README.md:rag", "exec"), g)
    assert g["ans"].text.strip() and g["ans"].output.cached_tokens > 0
    assert capsys.readouterr().out.strip(), "the streamed answer was printed"
    g["rag"].close()


def test_openai_client_block_runs(smol, tmp_path, capsys):
    """The OpenAI client block against a server on a loopback port (its URL put in the block's place)."""
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from helpers import Server

    from pcache_rag import PromptCache
    from pcache_rag.rag import CachedRAG
    from pcache_rag.serve import AnswerService, create_app

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "csv.md").write_text("To read a CSV file, open it and pass the file to csv.reader.\n")
    rag = CachedRAG(tmp_path / "index", pc=PromptCache(smol.model, smol.tokenizer), k=1, chunk_tokens=64)
    rag.ingest([docs], progress=False)
    srv = Server(create_app(AnswerService(rag, max_new_tokens=16)))
    try:
        code = _framework_block("```python\nfrom openai import OpenAI", TOUR).replace("```python\n", "", 1)
        code = code.replace("http://127.0.0.1:8000/v1", f"{srv.url}/v1")
        assert srv.url in code
        exec(compile(code, "tour.md:openai", "exec"), {})
    finally:
        srv.stop()
        rag.close()
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) >= 3 and int(out[-2]) > 0 and "csv.md" in out[-1]
