"""The README's Quick start code runs as written."""

import re
from pathlib import Path
from helpers import last_output

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quick_start_block_runs(smol_dir, capsys):
    text = README.read_text()
    quick = text[text.index("## Quick start"):]
    code = re.search(r"```python\n(.*?)```", quick, re.S).group(1)
    exec(compile(code, "README.md:quick-start", "exec"), {})
    out = capsys.readouterr().out
    assert out.strip(), "the example printed an answer"


def _framework_block(title: str) -> str:
    text = README.read_text()
    part = text[text.index(title):]
    return re.search(r"```python\n(.*?)```", part, re.S).group(1)


def _my_docs(tmp_path, monkeypatch, smol):
    from pcache_rag.frameworks import register_engine

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
    exec(compile(_framework_block("**LlamaIndex** (`pip"), "README.md:llamaindex", "exec"), {})
    out = capsys.readouterr().out
    assert "4417" in out and "'cached_tokens'" in out
    assert last_output(smol).cached_tokens > 0


def test_langchain_example_runs(tmp_path, monkeypatch, smol, capsys):
    _my_docs(tmp_path, monkeypatch, smol)
    exec(compile(_framework_block("**LangChain** (`pip"), "README.md:langchain", "exec"), {})
    out = capsys.readouterr().out
    assert "4417" in out and "gates.md" in out
    assert last_output(smol).cached_tokens > 0


def test_structured_output_example_runs(smol, capsys):
    import textwrap

    from pcache_rag.frameworks import register_engine

    register_engine(smol)  # the default config's engine: the session's model, an in-memory store
    exec(compile(textwrap.dedent(_framework_block("* **Structured output.**")), "README.md:structured", "exec"), {})
    out = capsys.readouterr().out
    assert "code=4417" in out, out
