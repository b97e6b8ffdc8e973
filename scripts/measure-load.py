"""Load test of the OpenAI-compatible server: concurrent streamed questions, batched against
one at a time, in one run.

Starts the real server (``pcache-rag serve`` in a process of its own, on a loopback port)
over the sample-corpus index, twice: once with ``--max-batch 1`` (the queue: one answer at
a time) and once with continuous batching. At each concurrency, that many clients send
their questions at once over HTTP (k=2 retrieved chunks, greedy, 24 new tokens) and read
the streamed answers. Reports per mode and concurrency: throughput (answers/s and
tokens/s), client-side TTFT p50/p95, the longest pause between two tokens of an answer
(p95: what a burst's prefill costs the streams already running) and whether every answer
equals its one-at-a-time answer. ``--busy N`` times every level again beside N
single-threaded busy-loop processes (a busy machine), on the same server in the same run.

    .venv/bin/python scripts/measure-load.py [--concurrency 1,16,64] [--max-batch 16]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from pcache_rag.measure.decode_bench import busy_processes


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ask(url: str, q: str, max_tokens: int) -> tuple[str, float, int, float, dict, float]:
    """(answer, TTFT, completion tokens, seconds, the server's own figures, the longest pause
    between two of its tokens) of one streamed question."""
    body = {"model": "pcache-rag", "messages": [{"role": "user", "content": q}], "stream": True, "temperature": 0,
            "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, parts, tokens, server, last, gap = None, [], 0, {}, None, 0.0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                ttft = ttft or now - t0
                gap = max(gap, now - last) if last is not None else gap
                last = now
                parts.append(ev["choices"][0]["delta"]["content"])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            if ev.get("pcache"):
                server.update(ev["pcache"])
    return ("".join(parts), ttft if ttft is not None else time.perf_counter() - t0, tokens, time.perf_counter() - t0,
            server, gap)


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p * (len(xs) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", default=None, help="index directory (default: the demo index of the sample corpus)")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--batched-only", action="store_true", help="skip the queue (for tuning)")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="time every level again beside N single-threaded busy processes this run starts")
    a = ap.parse_args()

    from pcache_rag.fsutil import cache_home
    from pcache_rag.rag import CachedRAG
    from pcache_rag.samples import QUESTIONS, build_corpus

    index = Path(a.index) if a.index else cache_home() / "demo-index"
    rag = CachedRAG(index, k=2)
    if rag.index.count() == 0:
        rag.ingest([build_corpus(cache_home() / "sample-corpus")])
    chunks = rag.index.count()
    rag.close()
    del rag
    levels = [int(x) for x in a.concurrency.split(",")]
    questions = (QUESTIONS * (max(levels) // len(QUESTIONS) + 1))[: max(levels)]
    results: dict = {"index_chunks": chunks, "k": 2, "max_tokens": a.max_tokens, "modes": {}}
    reference: dict[str, str] = {}
    modes = (("queue", 1), ("batched", a.max_batch)) if not a.batched_only else (("batched", a.max_batch),)
    for mode, mb in modes:
        # the server in a process of its own, as a deployment runs it: the clients' threads here
        # never share its interpreter (or its CPU threads' scheduling) with it
        port = _port()
        server = subprocess.Popen([sys.executable, "-m", "pcache_rag.cli", "serve", "--index", str(index), "--k", "2",
                                   "--max-new-tokens", str(a.max_tokens), "--max-batch", str(mb),
                                   "--prefill-tokens", str(a.prefill_tokens), "--queue", str(max(levels) + 8),
                                   "--port", str(port), "--quiet"])
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 600
            while True:
                try:
                    if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"the server did not start (exit code {server.poll()})")
                time.sleep(0.5)
            _ask(url, questions[0], a.max_tokens)  # warm: embedder, preamble states, first kernels
            rows = {}
            for c, load in [(c, "quiet") for c in levels] + [(c, "busy") for c in (levels if a.busy else [])]:
                qs = questions[:c]
                before = httpx.get(url + "/api/status", timeout=30).json().get("batch") or {}
                with busy_processes(a.busy if load == "busy" else 0):
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(c) as ex:
                        got = list(ex.map(lambda q: _ask(url, q, a.max_tokens), qs))
                    wall = time.perf_counter() - t0
                after = httpx.get(url + "/api/status", timeout=30).json().get("batch") or {}
                for q, g in zip(qs, got):
                    reference.setdefault(q, g[0])
                same = sum(g[0] == reference[q] for q, g in zip(qs, got))
                ttfts = [g[1] for g in got]
                row = {"answers_per_s": c / wall, "tokens_per_s": sum(g[2] for g in got) / wall,
                       "ttft_p50_s": statistics.median(ttfts), "ttft_p95_s": _pct(ttfts, 0.95), "wall_s": wall,
                       "identical": f"{same}/{c}",
                       "server_queued_p50_s": statistics.median(g[4].get("queued_s", 0.0) for g in got),
                       "server_ttft_p50_s": statistics.median(g[4].get("ttft_s", 0.0) for g in got),
                       "server_retrieve_p50_s": statistics.median(g[4].get("retrieve_s", 0.0) for g in got),
                       # each request: the client's TTFT and seconds; the server's wait in the queue,
                       # retrieval and TTFT after the wait; its prompt's cached and computed tokens
                       "requests": [{"client_ttft_s": g[1], "client_s": g[3], **{k: g[4].get(k) for k in
                                     ("queued_s", "retrieve_s", "ttft_s", "cached_tokens", "computed_tokens")}}
                                    for g in got],
                       "longest_pause_p95_s": _pct([g[5] for g in got], 0.95)}
                if after:  # the batch's own figures for this level: steps, seconds in steps
                    steps = after["steps"] - before["steps"]
                    row["scheduler"] = {"steps": steps, "busy_s": after["busy_s"] - before["busy_s"],
                                        "step_ms": 1000 * (after["busy_s"] - before["busy_s"]) / max(1, steps),
                                        "mean_batch": (after["decoded"] - before["decoded"]) / max(1, steps)}
                row["load"] = load
                rows[c if load == "quiet" else f"{c} busy"] = row
                print(f"{mode:8s} {load:5s} c={c:3d}: {row['answers_per_s']:.2f} answers/s, {row['tokens_per_s']:.1f} tokens/s, "
                      f"TTFT p50 {row['ttft_p50_s']:.2f} s p95 {row['ttft_p95_s']:.2f} s, wall {wall:.1f} s, "
                      f"identical to one at a time {same}/{c}; in the server: queued p50 "
                      f"{row['server_queued_p50_s']:.2f} s, TTFT after that p50 {row['server_ttft_p50_s']:.2f} s; "
                      f"longest pause between two tokens of an answer p95 {row['longest_pause_p95_s']:.2f} s"
                      + (f"; batch: {row['scheduler']['steps']} steps of {row['scheduler']['step_ms']:.0f} ms, "
                         f"{row['scheduler']['mean_batch']:.1f} answers a step" if "scheduler" in row else ""),
                      flush=True)
            results["modes"][mode] = rows
            batch = httpx.get(url + "/api/status", timeout=30).json().get("batch")
            if batch:
                results["modes"][mode]["scheduler_total"] = batch
        finally:
            server.terminate()
            server.wait(60)
    q1 = results["modes"].get("queue", {})
    for c in levels if q1 else ():
        b = results["modes"]["batched"][c]
        print(f"c={c}: throughput batched / queue = {b['answers_per_s'] / q1[c]['answers_per_s']:.2f}x "
              f"(against one at a time, c=1 of the queue: {b['answers_per_s'] / q1[levels[0]]['answers_per_s']:.2f}x)")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
