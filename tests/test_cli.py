"""The command line and the document-QA demo app, on the embedded model."""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import write_pdf
from pcache_rag.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_run_prints_answer_and_ttft(tmp_path, smol_dir, capsys):
    (tmp_path / "s.pml").write_text('<schema name="t"><system>Be brief.</system><module name="d">Oslo is in Norway.</module></schema>')
    (tmp_path / "p.pml").write_text('<prompt schema="t"><d/><user>Where is Oslo?</user></prompt>')
    rc = main(["run", "--schema", str(tmp_path / "s.pml"), "--prompt", str(tmp_path / "p.pml"),
               "--model", str(smol_dir), "--max-new-tokens", "4"])
    out = capsys.readouterr()
    assert rc == 0 and out.out.strip()
    assert "ttft" in out.err and "cached" in out.err


def test_pml_errors_are_reported_not_raised(tmp_path, smol_dir, capsys):
    (tmp_path / "s.pml").write_text('<schema name="t"><module name="d">x</schema>')
    (tmp_path / "p.pml").write_text('<prompt schema="t"><d/>q</prompt>')
    rc = main(["run", "--schema", str(tmp_path / "s.pml"), "--prompt", str(tmp_path / "p.pml"), "--model", str(smol_dir)])
    assert rc == 2 and "PML error: line 1" in capsys.readouterr().err


def test_ingest_and_ask_compare(tmp_path, smol_dir, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The Nile flows north into the Mediterranean Sea.")
    (docs / "b.md").write_text("# Cities\n\nParis is the capital of France.")
    idx = str(tmp_path / "idx")
    assert main(["ingest", str(docs), "--index", idx, "--model", str(smol_dir), "--chunk-tokens", "32"]) == 0
    assert "2 added" in capsys.readouterr().out
    assert main(["ask", "Where does the Nile flow?", "--index", idx, "--model", str(smol_dir), "--k", "2",
                 "--max-new-tokens", "4", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "[cached]" in out and "[full prefill]" in out and "ratio: x" in out and "a.txt" in out


def test_docqa_demo_app_answers_piped_questions(tmp_path, smol_dir):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Sushi is a Japanese dish of rice with fish.")
    p = subprocess.run([sys.executable, str(ROOT / "demos" / "docqa.py"), str(docs), "--index", str(tmp_path / "i"),
                        "--model", str(smol_dir), "--max-new-tokens", "6", "--k", "1"],
                       input="What is sushi?\n\n", capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "> What is sushi?" in p.stdout and "a.txt" in p.stdout and "time to first token" in p.stdout


def test_ingest_pdf_html_docx_and_name_what_it_cannot_read(tmp_path, smol_dir, capsys):
    """`pcache-rag ingest` reads the formats people have; anything else is named with its reason."""
    pytest.importorskip("fpdf")
    import docx

    docs = tmp_path / "docs"
    docs.mkdir()
    write_pdf(docs / "gates.pdf", ["The access code for the north gate is 4417."])
    (docs / "page.html").write_text("<html><body><script>alert(1)</script><p>Tokyo is the capital of Japan.</p>"
                                    "</body></html>")
    w = docx.Document()
    w.add_paragraph("The ferry leaves at 07:45.")
    w.save(str(docs / "ferry.docx"))
    (docs / "scan.pdf").write_bytes(_blank_pdf())
    (docs / "broken.docx").write_bytes(b"PK\x03\x04 not really a zip")
    (docs / "tool.py").write_text("print('code')\n")
    idx = str(tmp_path / "idx")
    rc = main(["ingest", str(docs), "--index", idx, "--model", str(smol_dir), "--chunk-tokens", "32"])
    out, err = capsys.readouterr()
    assert rc == 1 and "3 added" in out
    assert "scan.pdf: the PDF has no text layer" in err
    assert "broken.docx: damaged or not a .docx file" in err
    assert "tool.py: unsupported file type '.py'" in err
    assert main(["ask", "What is the access code for the north gate?", "--index", idx, "--model", str(smol_dir),
                 "--k", "1", "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "4417" in out and "gates.pdf" in out


def _blank_pdf() -> bytes:
    import io

    from pypdf import PdfWriter

    w = PdfWriter()
    w.add_blank_page(width=200, height=200)
    buf = io.BytesIO()
    w.write(buf)
    return buf.getvalue()


@pytest.mark.parametrize("what,replacement", [("store", "pcache-rag bench all"),
                                              ("quality", "pcache-rag eval quality --modes full,preamble,preamble@int8")])
def test_retired_benchmarks_say_where_their_numbers_are(what, replacement, capsys):
    assert main(["bench", what]) == 2
    assert replacement in capsys.readouterr().err


@pytest.mark.slow  # five CLI runs, learning included: minutes on a 2-core CPU; `make test-slow`
def test_calibrate_learn_moves_the_index_and_ask_says_so(tmp_path, smol_dir, capsys):
    """`calibrate --learn` on a small index: prints the validation KL of no conditioning, the
    neutral passage and the learned prefix, and (where the prefix measured lower) moves the
    index to it, which `ask` then reports; `--dry-run` keeps nothing."""
    import json

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"n{i}.txt").write_text(f"Ledger {i}. " + "The archive files each shipment record by date and office. " * 9)
    idx = str(tmp_path / "idx")
    base = ["--index", idx, "--model", str(smol_dir)]
    # from the neutral passage (the embedded model's default is its installed prefix, where one is installed)
    assert main(["ingest", str(docs), *base, "--chunk-tokens", "96", "--conditioning", "neutral"]) == 0
    capsys.readouterr()
    assert main(["calibrate", *base, "--learn", "--prompts", "2", "--steps", "1", "--k", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "neutral (start)" in out and "learned:" in out and "validation KL" in out
    manifest = json.loads((Path(idx) / "pcache-index.json").read_text())
    assert manifest["conditioning"] == "neutral:1", "--dry-run keeps nothing"
    assert main(["calibrate", *base, "--learn", "--prompts", "2", "--steps", "2", "--k", "2"]) == 0
    out = capsys.readouterr().out
    cond = json.loads((Path(idx) / "pcache-index.json").read_text())["conditioning"]
    if "the index now encodes its chunks after" in out:
        assert cond.startswith("learned:") and cond in out
    else:
        assert "kept: neutral:1" in out and cond == "neutral:1"
    assert main(["ask", "Which ledger is first?", *base, "--max-new-tokens", "2"]) == 0
    assert f"conditioning {cond}" in capsys.readouterr().out
