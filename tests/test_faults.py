"""Fault injection with real processes: what a crash, a damaged file, a lost Redis server, a
crowd of clients that vanish at once and hostile files do to a running ``pcache-rag serve``.

Each test starts the real command (``python -m pcache_rag.cli serve``) on a loopback port over
an index built by the real ``ingest``, breaks something from the outside (``kill -9``, bytes
changed on disk, ``redis-server`` killed, sockets closed) and checks what a user would check
afterwards: the answers, ``pcache-rag verify``, the server's own status. Nothing is mocked.

The long ones are marked ``faults`` and run by ``make test-faults`` (the whole file); the
default run keeps the quick ones (damaged state files, hostile files refused by the reader).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers import RedisServer, docx_bomb, free_port, pdf_bytes, wait_until

pytestmark = pytest.mark.real_model

CLI = [sys.executable, "-m", "pcache_rag.cli"]
DOCS = {
    "gates.md": "The access code for the north gate is 4417.\n\nThe north gate opens at dawn and closes at dusk.\n",
    "ferry.md": "The ferry to the island leaves at 07:45 every morning and returns at 18:30.\n",
    "bakery.md": "The bakery on Elm Street sells rye bread on Tuesdays. Its owner is called Marta Lindqvist.\n",
}
QUESTIONS = {"gates.md": "What is the access code for the north gate?", "ferry.md": "When does the ferry leave?",
             "bakery.md": "Who owns the bakery on Elm Street?"}


class Serve:
    """``pcache-rag serve`` in a process of its own, its output in a log file."""

    def __init__(self, index: Path, model: Path, log_dir: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"serve-{self.port}.log"
        with self.log_path.open("w") as out:
            self.proc = subprocess.Popen(CLI + ["serve", "--index", str(index), "--port", str(self.port), "--model",
                                                str(model), "--quiet", *args], stdout=out, stderr=subprocess.STDOUT)

        def up() -> bool:
            assert self.proc.poll() is None, f"the server exited:\n{self.log()}"
            try:
                return httpx.get(self.url + "/healthz", timeout=10).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, "the server did not start")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss(self) -> int:
        """The server process's resident memory, in bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS line")

    def status(self) -> dict:
        return httpx.get(self.url + "/api/status", timeout=30).json()

    def ingest_done(self) -> dict:
        st: dict = {}

        def done() -> bool:
            st.update(httpx.get(self.url + "/api/ingest", timeout=30).json())
            return not st["running"]

        wait_until(done, f"the ingestion never ended:\n{self.log()}")
        return st

    def ask(self, question: str, model: str = "pcache-rag", **extra) -> httpx.Response:
        return httpx.post(self.url + "/v1/chat/completions", timeout=300, json={
            "model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0,
            **extra})

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


@pytest.fixture(scope="module")
def built(tmp_path_factory, smol_dir) -> Path:
    """An index of :data:`DOCS` built by the real ``ingest`` (64-token chunks)."""
    root = tmp_path_factory.mktemp("faults")
    docs = root / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    subprocess.run(CLI + ["ingest", str(docs), "--index", str(root / "index"), "--chunk-tokens", "64", "--model",
                          str(smol_dir)], check=True, capture_output=True)
    return root / "index"


def _copy(built: Path, tmp_path: Path) -> Path:
    shutil.copytree(built, tmp_path / "index")
    return tmp_path / "index"


def _verify(index: Path, model: Path) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + ["verify", "--index", str(index), "--model", str(model)], capture_output=True,
                          text=True)


def _ask_cli(index: Path, model: Path, question: str) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + ["ask", question, "--index", str(index), "--model", str(model), "--max-new-tokens",
                                 "16"], capture_output=True, text=True)


def _answer_line(out: str) -> str:
    """The answer ``pcache-rag ask`` printed (its first line; statistics follow)."""
    return out.strip().splitlines()[0]


def _top_source(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["pcache"]["sources"][0]["document"]


# ------------------------------------------------------------------ state files damaged on disk (quick)


def test_state_files_truncated_or_bit_flipped_are_detected_and_re_encoded(built, tmp_path, smol_dir):
    """Half of the index's state files cut short, the other half with one byte flipped, between
    two runs of ``pcache-rag ask``: the second run detects each one it reads (the entry's
    checksum), re-encodes it and gives the same answer; ``pcache-rag verify`` then finds every
    entry whole (the rewritten ones included)."""
    index = _copy(built, tmp_path)
    q = QUESTIONS["gates.md"]
    first = _ask_cli(index, smol_dir, q)
    assert first.returncode == 0, first.stderr
    files = sorted((index / "kv").rglob("*.val"))
    assert len(files) >= len(DOCS), f"expected a value file per state, found {files}"
    for i, f in enumerate(files):
        data = f.read_bytes()
        if i % 2:
            f.write_bytes(data[: len(data) // 2])
        else:
            at = len(data) // 2
            f.write_bytes(data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:])
    second = _ask_cli(index, smol_dir, q)
    assert second.returncode == 0, second.stderr
    assert _answer_line(second.stdout) == _answer_line(first.stdout)
    assert "damaged" in second.stderr, second.stderr
    checked = _verify(index, smol_dir)
    assert checked.returncode == 0, checked.stdout + checked.stderr


# ------------------------------------------------------------------ hostile files (quick: the reader alone)


def _hostile(d: Path) -> dict[str, str]:
    """Hostile files in ``d``: name -> the words their refusal must contain."""
    d.mkdir(parents=True, exist_ok=True)
    docx_bomb(d / "bomb.docx", 16 << 20)  # 16 MB of XML in a few KB: past the bomb ratio
    ents = ['<!ENTITY lol "lol">'] + [f'<!ENTITY lol{i} "{("&lol%s;" % ("" if i == 1 else i - 1)) * 10}">'
                                      for i in range(1, 10)]
    laughs = "<!DOCTYPE html [\n" + "\n".join(ents) + "\n]>\n<html><body><p>&lol9;</p></body></html>\n"
    (d / "laughs.html").write_text(laughs)
    (d / "laughs.xhtml").write_text('<?xml version="1.0"?>\n' + laughs)
    (d / "cycle.pdf").write_bytes(pdf_bytes([b"<< /Type /Catalog /Pages 2 0 R >>",
                                        b"<< /Type /Pages /Kids [2 0 R 3 0 R] /Count 2 >>",
                                        b"<< /Type /Page /Parent 2 0 R /Contents 4 0 R /MediaBox [0 0 9 9] >>",
                                        b"[4 0 R 4 0 R]"]))
    return {"bomb.docx": "decompression bomb", "laughs.html": "entities", "laughs.xhtml": "entities",
            "cycle.pdf": "cyclic"}


def test_hostile_files_are_refused_by_the_reader_by_name(tmp_path):
    """A zip-bomb .docx, billion-laughs HTML and XHTML and a PDF whose page tree holds itself:
    each is refused with its reason, before any expansion."""
    from pcache_rag.rag.chunking import read_document
    from pcache_rag.rag.documents import SkipFile

    for name, words in _hostile(tmp_path).items():
        with pytest.raises(SkipFile, match=words):
            read_document(tmp_path / name)


@pytest.mark.faults
def test_hostile_uploads_are_refused_by_name_in_bounded_server_memory(built, tmp_path, smol_dir):
    """The hostile files above, and a zip-bomb .xlsx and .epub, uploaded to a running server:
    the formats it does not read are refused at the door (415), the others are skipped by name
    in the ingest report; the server's resident memory stays within +300 MB of what it was
    before, and it still answers."""
    index = _copy(built, tmp_path)
    want = _hostile(tmp_path / "hostile")
    srv = Serve(index, smol_dir, tmp_path)
    try:
        srv.ask(QUESTIONS["gates.md"])  # the answering path warm before the baseline
        before, peak = srv.rss(), [0]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], srv.rss())
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            for name in ("bomb.xlsx", "bomb.epub"):
                shutil.copy(tmp_path / "hostile" / "bomb.docx", tmp_path / name)  # a zip bomb by any other name
                r = httpx.post(srv.url + "/api/documents", timeout=60,
                               files={"files": (name, (tmp_path / name).read_bytes(), "application/zip")})
                assert r.status_code == 415 and name.rsplit(".", 1)[1] in r.json()["error"]["message"], r.text
            for name, words in want.items():
                r = httpx.post(srv.url + "/api/documents", timeout=60,
                               files={"files": (name, (tmp_path / "hostile" / name).read_bytes(), "application/octet-stream")})
                assert r.status_code == 202, r.text
                st = srv.ingest_done()
                skipped = dict(st["report"]["skipped"])
                assert name in skipped and words in skipped[name], st
        finally:
            done.set()
            sampler.join()
        grew = peak[0] - before
        print(f"server RSS {before / 2**20:.0f} MB before, peak {peak[0] / 2**20:.0f} MB (+{grew / 2**20:.0f} MB)")
        assert grew < 300 << 20, f"the server grew by {grew / 2**20:.0f} MB"
        assert _top_source(srv.ask(QUESTIONS["ferry.md"])) == "ferry.md"
    finally:
        srv.stop()


# ------------------------------------------------------------------ kill -9


def _harbour(sections: int) -> str:
    return "\n\n".join(f"Section {i}. The harbour crane number {i} lifts {i * 7} tonnes on weekdays and is painted "
                       f"{('red', 'green', 'blue', 'ochre')[i % 4]}." for i in range(sections))


@pytest.mark.faults
def test_kill_9_during_an_uploads_ingest_then_restart_leaves_a_consistent_index(built, tmp_path, smol_dir):
    """Three files uploaded (the server acknowledged them), the server killed with SIGKILL in the
    middle of encoding them; restarted, it finishes them by itself. Then ``verify`` is clean,
    each acknowledged file is answerable, and the long file has exactly the chunks that a clean
    ingest of it gives (no half file)."""
    index = _copy(built, tmp_path)
    files = {"harbour.txt": _harbour(300), "lighthouse.md": "The lighthouse keeper is called Ingrid Solberg.\n",
             "orchard.md": "The oldest tree in the orchard is a pear tree planted in 1911.\n"}
    srv = Serve(index, smol_dir, tmp_path)
    try:
        r = httpx.post(srv.url + "/api/documents", timeout=60,
                       files=[("files", (n, t.encode(), "text/plain")) for n, t in files.items()])
        assert r.status_code == 202, r.text

        def encoding() -> bool:
            st = httpx.get(srv.url + "/api/ingest", timeout=30).json()
            assert st["running"] or st["report"] is None, f"the ingest ended before it could be killed: {st}"
            return st["stage"] == "encode" and 0 < st["done"] < st["total"]

        wait_until(encoding, "the ingest never reached its encoding", step=0.02)
        srv.kill9()
    finally:
        srv.stop()
    print("verify after the kill:", _verify(index, smol_dir).stdout.strip().splitlines()[-1:])

    again = Serve(index, smol_dir, tmp_path)
    try:
        st = again.ingest_done()
        assert st["error"] is None and set(st["files"]) >= set(files), st
        assert "never indexed" in again.log() or st["report"]["added"] >= 1
        assert _top_source(again.ask("Who is the lighthouse keeper?")) == "lighthouse.md"
        assert _top_source(again.ask("When was the oldest pear tree in the orchard planted?")) == "orchard.md"
        assert _top_source(again.ask("How many tonnes does harbour crane number 299 lift?")) == "harbour.txt"
        chunks = again.status()["chunks"]
    finally:
        again.stop()
    v = _verify(index, smol_dir)
    assert v.returncode == 0, v.stdout + v.stderr

    # the same three files ingested cleanly into an index like the first
    ref = _copy(built, tmp_path / "ref")
    (tmp_path / "ref-docs").mkdir()
    for n, t in files.items():
        (tmp_path / "ref-docs" / n).write_text(t)
    subprocess.run(CLI + ["ingest", str(tmp_path / "ref-docs"), "--index", str(ref), "--model", str(smol_dir)],
                   check=True, capture_output=True)
    clean = Serve(ref, smol_dir, tmp_path)
    try:
        assert chunks == clean.status()["chunks"]
    finally:
        clean.stop()


@pytest.mark.faults
def test_kill_9_while_learning_from_prompts_then_restart(built, tmp_path, smol_dir):
    """Four prompts, each pasting a document never seen, sent at once to the plain model; the
    server killed with SIGKILL as soon as the first is answered, while the others are being
    answered and their documents learned (states written, the journal appended). Restarted over
    the same index: it starts, ``verify`` is clean, and the same prompt, asked twice, is
    answered and then read from the cache."""
    index = _copy(built, tmp_path)
    docs = [" ".join(f"Depot {i} stores {j * 3 + i} crates of tin on shelf {j}." for j in range(24)) for i in range(4)]

    def prompt(i: int) -> list[dict]:
        return [{"role": "system", "content": f"Answer from the document.\n\n{docs[i]}"},
                {"role": "user", "content": f"How many crates of tin are on shelf 5 of depot {i}?"}]

    def send(srv: Serve, i: int) -> httpx.Response:
        return httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
            "model": "pcache-rag-plain", "messages": prompt(i), "max_tokens": 8, "temperature": 0})

    srv = Serve(index, smol_dir, tmp_path)
    try:
        with ThreadPoolExecutor(4) as ex:
            futures = [ex.submit(send, srv, i) for i in range(4)]
            wait_until(lambda: any(f.done() for f in futures), "no prompt was answered")
            srv.kill9()
    finally:
        srv.stop()
    journal = list(index.rglob("known-texts.jsonl"))
    print("journal after the kill:", [(p.name, p.stat().st_size) for p in journal])

    again = Serve(index, smol_dir, tmp_path)
    try:
        first = send(again, 3)
        assert first.status_code == 200, first.text
        second = send(again, 3)
        assert second.status_code == 200, second.text
        assert second.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
        assert second.json()["pcache"]["documents"] >= 1, second.json()["pcache"]
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > \
            first.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    finally:
        again.stop()
    v = _verify(index, smol_dir)
    assert v.returncode == 0, v.stdout + v.stderr


# ------------------------------------------------------------------ Redis lost mid-answer


@pytest.mark.faults
def test_redis_killed_mid_answer_then_restarted(built, tmp_path, smol_dir):
    """A server whose states come from Redis (its own disk holds none at first). Redis is killed
    while an answer streams: that answer completes; the next question, on a document not yet
    read, is answered by encoding it locally. Redis restarted (from its append-only file): a
    question on a third document reads its states from Redis again."""
    data = tmp_path / "redis-data"
    data.mkdir()
    persist = ("--appendonly", "yes", "--appendfsync", "always", "--dir", str(data))
    redis = RedisServer(None, *persist)
    srv = None
    try:
        ingester = tmp_path / "ingester"
        docs = tmp_path / "docs"
        docs.mkdir()
        for name, text in DOCS.items():
            (docs / name).write_text(text)
        subprocess.run(CLI + ["ingest", str(docs), "--index", str(ingester), "--chunk-tokens", "64", "--kv-url",
                              redis.url, "--model", str(smol_dir)], check=True, capture_output=True)
        answering = tmp_path / "answering"
        shutil.copytree(ingester, answering, ignore=shutil.ignore_patterns("kv"))  # the index, none of the states
        srv = Serve(answering, smol_dir, tmp_path, "--kv-url", redis.url, "--k", "1")
        hits = srv.status()["tiers"]["remote"]["hits"]

        body = {"model": "pcache-rag", "messages": [{"role": "user", "content": QUESTIONS["gates.md"]}],
                "max_tokens": 64, "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                events.append(line[5:].strip())
                if len(events) == 2:  # the first text: the states are read, the answer is decoding
                    redis.kill()
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
        assert any('"pcache"' in e for e in events), "the answer completed with its statistics"
        assert srv.status()["tiers"]["remote"]["hits"] > hits, "the first answer's states came from Redis"

        assert _top_source(srv.ask(QUESTIONS["ferry.md"])) == "ferry.md"  # Redis down: encoded here
        assert "unreachable" in srv.log()

        redis = RedisServer(redis.port, *persist)  # back, with what it held
        assert redis.client.dbsize() > 0
        time.sleep(6)  # the tier retries a lost server every 5 s (RemoteTier.retry_s)
        before = srv.status()["tiers"]["remote"]["hits"]
        assert _top_source(srv.ask(QUESTIONS["bakery.md"])) == "bakery.md"
        assert srv.status()["tiers"]["remote"]["hits"] > before, "the third document's states came from Redis"
        assert "is back" in srv.log()
    finally:
        if srv is not None:
            srv.stop()
        redis.kill()


# ------------------------------------------------------------------ sixteen clients gone at once


@pytest.mark.faults
def test_sixteen_streams_dropped_at_once_free_every_slot(built, tmp_path, smol_dir):
    """Sixteen long answers streaming in one batch; every client closes its connection at the
    same moment. Every answering place and every batch row is free again within a few batch
    steps (counted, and the seconds printed), and the server answers the next question."""
    index = _copy(built, tmp_path)
    srv = Serve(index, smol_dir, tmp_path, "--max-batch", "16")
    try:
        started = threading.Barrier(17)
        drop = threading.Event()
        errors: list[BaseException] = []

        def client(i: int) -> None:
            body = {"model": "pcache-rag-plain", "stream": True, "max_tokens": 1024, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Count from {i} to 2000, one number a line."}]}
            try:
                with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=300) as r:
                    lines = r.iter_lines()
                    while '"content": "' not in next(lines).replace('"content": ""', ""):
                        pass
                    started.wait(300)
                    drop.wait(300)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                started.abort()

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(16)]
        for t in threads:
            t.start()
        started.wait(300)
        st = srv.status()
        assert st["queue"]["answering"] == 16 and st["batch"]["live"] == 16, st
        steps = st["batch"]["steps"]
        t0 = time.perf_counter()
        drop.set()  # each client leaves its `with` block: its connection closes
        for t in threads:
            t.join(60)
        assert not errors, errors

        def freed() -> bool:
            s = srv.status()
            return s["queue"]["answering"] == 0 and s["batch"]["live"] == 0 and s["batch"]["live_rows"] == 0

        wait_until(freed, "the dropped streams kept their places", step=0.01)
        seconds = time.perf_counter() - t0
        taken = srv.status()["batch"]["steps"] - steps
        print(f"16 dropped streams freed in {seconds:.2f} s, {taken} batch steps after the drop")
        assert taken <= 16, f"{taken} batch steps ran for clients that had gone"
        assert srv.status()["cancelled"] == 16
        assert _top_source(srv.ask(QUESTIONS["gates.md"])) == "gates.md"
    finally:
        srv.stop()


# ------------------------------------------------------------------ SIGTERM


@pytest.mark.faults
def test_sigterm_mid_answer_stops_the_server_and_tells_the_client(built, tmp_path, smol_dir):
    """SIGTERM while a long answer streams (``--shutdown-timeout 1``): the server exits within
    the timeout and a little more, and the client reads an error with code ``shutting_down``
    and the end of the stream, not a torn connection."""
    index = _copy(built, tmp_path)
    srv = Serve(index, smol_dir, tmp_path, "--shutdown-timeout", "1")
    body = {"model": "pcache-rag-plain", "stream": True, "max_tokens": 1024, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from 1 to 2000, one number a line."}]}
    got: list[str] = []
    try:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    got.append(line[5:].strip())
                    if len(got) == 3:
                        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(60)
    finally:
        srv.stop()
    errors = [json.loads(e)["error"] for e in got if e.startswith('{"error"')]
    assert errors and errors[0]["code"] == "shutting_down", got[-3:]
    assert got[-1] == "[DONE]"
    assert srv.proc.returncode in (0, -signal.SIGTERM), srv.log()  # uvicorn exits by the signal it caught
    assert "answer(s) in flight ended: the server is shutting down" in srv.log()
