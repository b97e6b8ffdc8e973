"""The README's Quick start code runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quick_start_block_runs(smol_dir, capsys):
    text = README.read_text()
    quick = text[text.index("## Quick start"):]
    code = re.search(r"```python\n(.*?)```", quick, re.S).group(1)
    exec(compile(code, "README.md:quick-start", "exec"), {})
    out = capsys.readouterr().out
    assert out.strip(), "the example printed an answer"
