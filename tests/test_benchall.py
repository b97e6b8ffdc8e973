"""`pcache-rag bench all --quick`: every figure of the report gets its table and its PNG, and
every number in them is finite and non-negative, with times, throughputs and speed-ups above zero."""

import json
import math

import pytest

from pcache_rag.cli import main

FIGURES = ("length", "fraction", "recompute", "size", "encoding", "ingest", "scaffold", "memory", "concurrency")


@pytest.mark.slow  # every figure of the benchmark at quick sizes: minutes on a 2-core CPU; `make test-slow`
def test_bench_all_quick_writes_every_figure(smol_dir, tmp_path, capsys):
    out = tmp_path / "docs"
    assert main(["bench", "all", "--quick", "--model", str(smol_dir), "--out", str(out), "--json"]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert tuple(raw["figures"]) == FIGURES
    md = (out / "benchmarks.md").read_text()
    assert raw["machine"]["cores"] >= 1 and raw["machine"]["cpu"] in md
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
    sc = {r[0]: r for r in raw["figures"]["scaffold"]["rows"]}
    assert set(sc) == {"full prefill", "separate modules", "scaffold"} and sc["scaffold"][2] == 2
