#!/usr/bin/env python3
"""Measure what decompression bombs do to a running server's memory (issue 19).

Starts ``pcache-rag serve`` on a new index over a one-file corpus, then uploads, one at a
time: a 120 KB ``.docx`` holding 60 MB of empty paragraphs, and a 1 MB PDF whose stream
inflates to 1 GiB, each next to a good file. While each ingests, the resident memory of the
server process and of its child processes (the document reader) is sampled every 20 ms
from /proc. Prints one JSON object: per bomb, the server's resident memory before, its
peak, after, the children's peak, and the ingest's outcome.

Run it against any checkout (``PYTHONPATH=/path/to/checkout``) to compare before and after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import docx_bomb, free_port, pdf_bomb  # noqa: E402


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


class Sampler:
    def __init__(self, pid: int):
        self.pid, self.peak, self.child_peak = pid, 0.0, 0.0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, rss_mb(self.pid))
            self.child_peak = max([self.child_peak, *(rss_mb(c) for c in children(self.pid))])

    def close(self):
        self.stop.set()
        self.t.join()


def main() -> int:
    import httpx

    work = Path(tempfile.mkdtemp(prefix="bombs-"))
    docs = work / "docs"
    docs.mkdir()
    (docs / "ferry.md").write_text("The ferry to the island leaves at 07:45 every morning.\n")
    exe = [sys.executable, "-m", "pcache_rag.cli"]
    subprocess.run(exe + ["ingest", str(docs), "--index", str(work / "idx"), "--chunk-tokens", "64"], check=True,
                   capture_output=True)
    port = free_port()
    srv = subprocess.Popen(exe + ["serve", "--index", str(work / "idx"), "--port", str(port), "--quiet"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    results = {}
    try:
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert srv.poll() is None and time.time() < deadline, "the server did not start"
            time.sleep(0.5)
        time.sleep(2)
        bombs = {"docx: 60 MB of XML": ("bomb.docx", lambda p: docx_bomb(p, 60 << 20)),
                 "pdf: a 1 GiB stream": ("bomb.pdf", lambda p: pdf_bomb(p, 1 << 30))}
        for i, (what, (name, make)) in enumerate(bombs.items()):
            path = work / name
            make(path)
            good = f"good{i}.md"
            before = rss_mb(srv.pid)
            s = Sampler(srv.pid)
            t0 = time.time()
            r = httpx.post(url + "/api/documents", timeout=60,
                           files=[("files", (name, path.read_bytes())),
                                  ("files", (good, f"Good file {i}: the bridge opens at {i + 6} o'clock.\n".encode()))])
            state = {}
            if r.status_code == 202:
                while time.time() - t0 < 600:
                    state = httpx.get(url + "/api/ingest", timeout=10).json()
                    if not state.get("running"):
                        break
                    time.sleep(0.2)
            s.close()
            results[what] = {
                "file_bytes": path.stat().st_size, "upload_status": r.status_code,
                "server_rss_before_mb": round(before, 1), "server_rss_peak_mb": round(max(s.peak, before), 1),
                "server_rss_after_mb": round(rss_mb(srv.pid), 1), "reader_child_peak_mb": round(s.child_peak, 1),
                "ingest_report": state.get("report"), "ingest_error": state.get("error"),
                "server_alive": srv.poll() is None, "seconds": round(time.time() - t0, 1),
            }
    finally:
        srv.terminate()
        srv.wait(30)
    print(json.dumps({"python": sys.version.split()[0], "code": os.environ.get("PYTHONPATH", "installed"),
                      "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
