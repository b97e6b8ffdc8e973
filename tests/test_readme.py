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


CONNECTORS = Path(__file__).resolve().parents[1] / "connectors"


def _connector_block(name: str) -> str:
    text = (CONNECTORS / name / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_langchain_connectors_quick_start_runs(smol, capsys):
    """Its stock chain: the second question reads the documents the first one's prompt taught."""
    from pcache_rag import PromptCache
    from pcache_rag.frameworks import register_engine

    register_engine(PromptCache(smol.model, smol.tokenizer))  # the default config: a fresh in-memory engine
    exec(compile(_connector_block("langchain-pcache"), "langchain-pcache/README.md", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "23:40" in lines[0]
    assert "'cache_read': 0}" in lines[0] and "'cache_read': 0}" not in lines[1] and lines[1].endswith(" []")


def test_the_llamaindex_connectors_quick_start_runs(smol, capsys):
    from pcache_rag.frameworks import register_engine

    register_engine(smol)
    exec(compile(_connector_block("llama-index-llms-pcache"), "llama-index-llms-pcache/README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "4417" in out and "07:45" in out and "'cached_tokens'" in out
    assert last_output(smol).cached_tokens > 0


def test_structured_output_example_runs(smol, capsys):
    import textwrap

    from pcache_rag.frameworks import register_engine

    register_engine(smol)  # the default config's engine: the session's model, an in-memory store
    exec(compile(textwrap.dedent(_framework_block("* **Structured output.**")), "README.md:structured", "exec"), {})
    out = capsys.readouterr().out
    assert "code=4417" in out, out
