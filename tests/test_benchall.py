"""`pcache-rag bench all --quick`: every figure of the report gets its table and its PNG, and
every number in them is finite and non-negative, with times, throughputs and speed-ups above zero."""

import json
import math

import pytest

from pcache_rag.cli import main

FIGURES = ("length", "fraction", "recompute", "size", "encoding", "ingest", "scaffold", "memory", "concurrency",
           "decode")


@pytest.mark.slow  # every figure of the benchmark at quick sizes: minutes on a 2-core CPU; `make test-slow`
def test_bench_all_quick_writes_every_figure(smol_dir, tmp_path, capsys):
    out = tmp_path / "docs"
    assert main(["bench", "all", "--quick", "--model", str(smol_dir), "--out", str(out), "--json"]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert tuple(raw["figures"]) == FIGURES
    md = (out / "benchmarks.md").read_text()
    assert raw["machine"]["cores"] >= 1 and raw["machine"]["cpu"] in md
    assert f"| model | {smol_dir.name} |" in md and "--model" not in md.splitlines()[2]  # the default: no flag
    assert raw["figures"]["encoding"]["notes"], "a figure's notes are kept in the JSON"
    for key, fig in raw["figures"].items():
        assert fig["rows"], key
        png = out / fig["png"]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", key
        assert f"## {fig['title']}" in md and f"]({fig['png']})" in md
        for row in fig["rows"]:
            assert len(row) == len(fig["columns"]), key
            for col, v in zip(fig["columns"], row):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                assert math.isfinite(v) and v >= 0, (key, col, v)
                if col.endswith(("ms", "/s", "speed-up", "seconds")) or "bytes" in col or col.startswith("vs "):
                    assert v > 0, (key, col, v)
    assert "## Headline" in md and ("No GPU in this run" in md) == (not raw["machine"]["gpu"])
    heads = dict(raw["headline"])
    assert "TTFT speed-up, cached (host fp16) vs full prefill" in heads and "bytes per cached token (measured)" in heads
    # speed is reported, not asserted: the figures hold the measured times beside full prefill
    length = raw["figures"]["length"]
    assert {"floor ms", "host fp16 ms", "full prefill ms"} <= set(length["columns"]) and length["rows"]
    frac = raw["figures"]["fraction"]["rows"]
    assert frac[0][0] == 0.0 and frac[-1][0] == 100.0
    rc = {r[0]: r for r in raw["figures"]["recompute"]["rows"]}
    assert set(rc) == {"full prefill", "none", "epic:4"} and rc["none"][1] == 0 and rc["epic:4"][1] > 0
    assert "TTFT speed-up by recompute mode (split path; dense mask)" in heads
    conc = raw["figures"]["concurrency"]["rows"]
    assert [r[0] for r in conc] == [1, 2] and all(r[8] == f"{r[0]}/{r[0]}" for r in conc)  # same answers batched
    assert "throughput, continuous batching against the queue" in heads
    dec = [r[0] for r in raw["figures"]["decode"]["rows"]]
    assert dec[0].startswith("transformers generate") and any("int8" in n for n in dec), dec
    sc = {r[0]: r for r in raw["figures"]["scaffold"]["rows"]}
    assert set(sc) == {"full prefill", "separate modules", "scaffold"} and sc["scaffold"][2] == 2


def test_encoding_figure_on_a_sliding_window_model_says_which_batches_it_refuses(smol_tok):
    """One chunk longer than the window is encoded through the adapter (which gives the window
    its positions); a batch of such chunks is refused by the engine, and the figure names it
    instead of failing (`bench all --model gemma3-270m` did, at 1,024-token chunks)."""
    from helpers import WINDOW, tiny_model

    from pcache_rag import PromptCache
    from pcache_rag.measure.bench_all import Sizes, encoding_figure

    pc = PromptCache(tiny_model("gemma3", len(smol_tok)), smol_tok, store_dtype=None)
    sz = Sizes(chunk_sizes=(WINDOW // 2, WINDOW * 2), batch_sizes=(1, 2), repeats=1)
    fig = encoding_figure(pc, smol_tok, sz, "cpu", lambda _msg: None)
    assert [(r[0], r[1]) for r in fig.rows] == [(WINDOW // 2, 1), (WINDOW // 2, 2), (WINDOW * 2, 1)]
    assert all(r[2] > 0 for r in fig.rows)
    assert f"Not measured (chunk tokens x batch): {WINDOW * 2}x2" in fig.notes[-1]


def test_report_names_its_model(tmp_path):
    """A report says which model it measured: the default needs no flag on its command line,
    any other model is named there and in the machine table."""
    from pcache_rag.default_model import DEFAULT_NAME, model_name
    from pcache_rag.measure.bench_all import Figure, write_report

    assert model_name(None) == DEFAULT_NAME and model_name("gemma3-270m") == "gemma3-270m"
    assert model_name("/models/smol/model.gguf") == "model" and model_name("/models/qwen2-0.5b/") == "qwen2-0.5b"

    info = {"device": "cpu", "date": "2026-12-03 00:00 UTC", "cpu": "a CPU", "cores": 2, "torch_threads": 2,
            "gpu": None, "python": "3.11", "torch": "2", "transformers": "5", "pcache_rag": "0.1"}
    fig = Figure("length", "A figure", ["tokens", "ms"], [[128, 1.5]], ["A note."])
    for name, flag in ((DEFAULT_NAME, ""), ("gemma3-270m", " --model gemma3-270m")):
        out = tmp_path / name
        out.mkdir()
        md = write_report([fig], {**info, "model": name}, out, False, 60.0, []).read_text()
        assert f"`pcache-rag bench all{flag} --device cpu`" in md, md[:300]
        assert f"| model | {name} |" in md and "A note." in md
