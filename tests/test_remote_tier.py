"""The remote tier against a real ``redis-server`` (Debian's package, installed by
``make setup``), started by each test on a loopback port. Skips, saying why, when the
server is not installed."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import RedisServer, free_port, tiny_model, wait_http

from pcache_rag.conditioning import installed_prefix
from pcache_rag.engine import Parts

redis = pytest.importorskip("redis")

DOCS = {
    "gates.md": "The access code for the north gate is 4417.\n\nThe north gate opens at dawn and closes at dusk.\n",
    "ferry.md": "The ferry to the island leaves at 07:45 every morning and returns at 18:30.\n",
    "bakery.md": "The bakery on Elm Street sells rye bread on Tuesdays. Its owner is called Marta Lindqvist.\n",
}
Q = "What is the access code for the north gate?"


@pytest.fixture()
def server():
    srv = RedisServer()
    yield srv
    srv.kill()


def _docs(tmp_path: Path) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    return docs


def _engine(smol, kv_dir: Path, url: str):
    from pcache_rag import PromptCache

    return PromptCache(smol.model, smol.tokenizer, cache_dir=str(kv_dir), kv_url=url)


def _count_encodes(pc) -> list[int]:
    """Counts the engine's encodes (every path goes through its encoder's ``encode``)."""
    n = [0]
    encode = pc.encoder.encode

    def counted(*a, **kw):
        n[0] += 1
        return encode(*a, **kw)

    pc.encoder.encode = counted
    return n


def _machine(smol, root: Path, url: str, from_index: Path | None = None):
    """A CachedRAG as another machine would have it: its own disk, and (when given) a copy
    of the chroma index only, without any states."""
    from pcache_rag.rag import CachedRAG

    if from_index is not None:
        shutil.copytree(from_index, root / "index", ignore=shutil.ignore_patterns("kv"))
    return CachedRAG(root / "index", pc=_engine(smol, root / "index" / "kv", url), k=3, chunk_tokens=64)


def _logits(rag, q: str) -> torch.Tensor:
    handles = rag.retrieve(q)
    res = rag.pc.prefill(Parts(rag.chunks.parts(handles), rag.question_ids(q), preamble="preamble"))
    return res.logits


@pytest.mark.real_model
def test_process_b_answers_from_what_a_encoded(server, smol, tmp_path):
    docs = _docs(tmp_path)
    a = _machine(smol, tmp_path / "a", server.url)
    a.ingest([docs], progress=False)
    # the RAG default (a learned prefix installed for the model, else the neutral passage): its states are stored too
    installed = installed_prefix(a.pc.fingerprint)
    assert a.asm.conditioning == (installed.spec if installed is not None else "neutral:1")
    assert a.pc.store.remote.stats().puts == len(DOCS) + 2, "chunks, the preamble and the conditioning written through"

    b = _machine(smol, tmp_path / "b", server.url, from_index=a.index_dir)
    encodes = _count_encodes(b.pc)
    assert torch.equal(_logits(b, Q), _logits(a, Q)), "identical logits from the shared states"
    assert encodes[0] == 0 and b.pc.store.remote.stats().hits >= 3
    assert b.answer(Q, max_new_tokens=16).text == a.answer(Q, max_new_tokens=16).text

    # a flipped byte in a remote value: detected, dropped, re-encoded and written back
    c = _machine(smol, tmp_path / "c", server.url, from_index=a.index_dir)
    encodes = _count_encodes(c.pc)
    key = c.retrieve(Q)[-1].kv_key
    part = f"pcache:{key}:0"
    at = server.client.strlen(part) // 2
    byte = server.client.getrange(part, at, at)
    server.client.setrange(part, at, bytes([byte[0] ^ 0x01]))
    assert torch.equal(_logits(c, Q), _logits(a, Q))
    assert encodes[0] == 1 and c.pc.store.remote.stats().corrupt == 1
    assert c.pc.store.remote.get(key) is not None, "the re-encoded entry is back on the server"
    for rag in (a, b, c):
        rag.close()


@pytest.mark.real_model
def test_killing_redis_mid_run_falls_back_to_local_tiers(server, smol, tmp_path, caplog):
    docs = _docs(tmp_path)
    rag = _machine(smol, tmp_path / "a", server.url)
    rag.ingest([docs], progress=False)
    before = rag.answer(Q, max_new_tokens=16).text
    remote = rag.pc.store.remote
    remote.retry_s = 0.5
    server.kill()
    with caplog.at_level(logging.WARNING, logger="pcache_rag.store.remote"):
        encodes = _count_encodes(rag.pc)
        assert rag.answer(Q, max_new_tokens=16).text == before
        (docs / "new.md").write_text("The lighthouse keeper is called Ada Moreno.\n")
        rep = rag.ingest([docs], progress=False)  # a new chunk: kept locally while the server is down
        assert rep.chunks_encoded == 1 and rag.answer("Who keeps the lighthouse?", max_new_tokens=16).text
    assert encodes[0] == 1 and remote.failures >= 1
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1, "one warning per outage"

    again = RedisServer(port=server.port)  # back, empty: the tier reconnects by itself
    try:
        time.sleep(0.6)
        with caplog.at_level(logging.WARNING, logger="pcache_rag.store.remote"):
            key = rag.retrieve(Q)[0].kv_key
            rag.pc.store.put(key, rag.pc.store.get(key))
        assert any("is back" in r.getMessage() for r in caplog.records)
        assert again.client.exists(f"pcache:{key}") == 1
    finally:
        again.kill()
    rag.close()


def test_two_models_share_a_server_without_mixing(server, smol_tok):
    from pcache_rag import PromptCache

    schema = "<schema name='s'><module name='doc'>A long shared document about gates and ferries.</module></schema>"
    prompt = "<prompt schema='s'><doc/>What time is it?</prompt>"
    m1, m2 = tiny_model("llama", len(smol_tok), seed=1), tiny_model("llama", len(smol_tok), seed=2)
    p1 = PromptCache(m1, smol_tok, kv_url=server.url)
    p1.add_schema(schema)
    p2 = PromptCache(m2, smol_tok, kv_url=server.url)
    p2.add_schema(schema)
    assert p2.last_report.encoded == p1.last_report.encoded > 0, "model 2 found nothing of model 1's"
    assert p2.store.remote.stats().hits == 0
    heads = [k for k in server.client.scan_iter("pcache:*") if k.count(b":") == 1]
    assert len(heads) == 2 * p1.last_report.encoded

    p1b = PromptCache(m1, smol_tok, kv_url=server.url)  # a second process of model 1
    p1b.add_schema(schema)
    assert p1b.last_report.encoded == 0 and p1b.last_report.loaded == p1.last_report.encoded
    assert torch.equal(p1b.prefill(prompt).logits, p1.prefill(prompt).logits)


def test_large_values_are_split_into_parts(server, smol_tok):
    from pcache_rag.kv import ModuleKV
    from pcache_rag.store import RemoteTier

    tier = RemoteTier(server.url, prefix="t", part_bytes=1000)
    kv = ModuleKV(torch.randn(2, 2, 40, 8, dtype=torch.float16), torch.randn(2, 2, 40, 8, dtype=torch.float16),
                  torch.arange(40), torch.arange(40))
    tier.put("k1", kv)
    n = int(server.client.get("t:k1").split()[1])
    assert n > 5 and server.client.exists(*[f"t:k1:{i}" for i in range(n)]) == n
    back = tier.get("k1")
    assert torch.equal(back.keys, kv.keys) and torch.equal(back.values, kv.values)
    server.client.delete("t:k1:3")  # one part evicted by the server: a miss, and the rest removed
    assert tier.get("k1") is None and not tier.contains("k1") and server.client.exists("t:k1:0") == 0
    assert tier.remove("nothing") is False
    q = kv.to(dtype=torch.int8)  # int8 states travel with their scales
    tier.put("k8", q)
    back = tier.get("k8")
    assert back.quantized and torch.equal(back.v_scale, q.v_scale) and torch.equal(back.keys, q.keys)


@pytest.mark.slow  # three processes and a chroma server: about a minute; `make test-slow`
@pytest.mark.real_model
def test_two_answering_processes_share_a_chroma_server_and_redis(server, smol_dir, tmp_path):
    """The README's several-machines deployment on one host: `chroma run` for the index, Redis
    for the states, one process ingests, two `pcache-rag serve` processes answer."""
    import sys

    import httpx

    pytest.importorskip("fastapi")
    chroma_exe = shutil.which("chroma") or str(Path(sys.executable).with_name("chroma"))
    cport = free_port()
    chroma = subprocess.Popen([chroma_exe, "run", "--path", str(tmp_path / "chroma"), "--host", "127.0.0.1",
                               "--port", str(cport)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    servers = []
    try:
        wait_http(f"http://127.0.0.1:{cport}/api/v2/heartbeat", chroma, 60)
        shared = ["--chroma-url", f"http://127.0.0.1:{cport}", "--kv-url", server.url, "--model", str(smol_dir)]
        cli = [sys.executable, "-m", "pcache_rag.cli"]
        docs = _docs(tmp_path)
        subprocess.run(cli + ["ingest", str(docs), "--index", str(tmp_path / "ingester"), "--chunk-tokens", "64",
                              *shared], check=True, capture_output=True)
        urls = []
        for name in ("answer-1", "answer-2"):  # each with its own local index folder and disk tier
            port = free_port()
            proc = subprocess.Popen(cli + ["serve", "--index", str(tmp_path / name), "--port", str(port), "--k", "2",
                                           "--quiet", *shared],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            servers.append(proc)
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, servers):
            wait_http(url + "/healthz", proc)
        questions = [Q, "When does the ferry leave?", "Who owns the bakery on Elm Street?"]
        answers = []
        for url in urls:
            got = []
            for q in questions:
                r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                    "model": "pcache-rag", "messages": [{"role": "user", "content": q}], "max_tokens": 16})
                assert r.status_code == 200, r.text
                got.append(r.json()["choices"][0]["message"]["content"])
            answers.append(got)
            st = httpx.get(url + "/api/status").json()
            assert st["encoded"]["units"] == 0, "every state came from the shared server"
            assert st["tiers"]["remote"]["hits"] > 0 and st["chunks"] == len(DOCS)
        assert answers[0] == answers[1] and all(answers[0])
    finally:
        for p in servers:
            p.terminate()
            p.wait(30)
        chroma.terminate()
        chroma.wait(30)
