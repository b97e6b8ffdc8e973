"""The web app in a real headless Chromium (Debian's ``chromium``, driven by Playwright
through its executable path: no browser download). Loads the page, uploads a small corpus
and waits for ingestion, asks a question and watches the answer stream with its sources,
then toggles compare. Skips, saying why, when the browser or Playwright is missing.

The screenshot goes to ``$PCACHE_RAG_SCREENSHOT`` (``docs/webapp.png`` for the README)
or, by default, the test's temporary folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import Server

pytestmark = pytest.mark.real_model

DOCS = {
    "gates.md": "The access code for the north gate is 4417.\n\nThe north gate opens at dawn and closes at dusk.\n",
    "ferry.md": "The ferry to the island leaves at 07:45 every morning and returns at 18:30.\n",
}


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("Debian's chromium is not installed (make setup installs it as root with apt-get; "
                "see scripts/install-system-deps.sh)")


@pytest.fixture()
def page(tmp_path, smol):
    pw = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    exe = _chromium()
    from pcache_rag import PromptCache
    from pcache_rag.rag import CachedRAG
    from pcache_rag.serve import AnswerService, create_app

    index = tmp_path / "index"
    rag = CachedRAG(index, pc=PromptCache(smol.model, smol.tokenizer, cache_dir=str(index / "kv")), k=4,
                    chunk_tokens=256)
    srv = Server(create_app(AnswerService(rag, max_new_tokens=32)))
    with pw.sync_playwright() as p:
        try:  # root needs --no-sandbox; the page is our own
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        except Exception as e:  # noqa: BLE001 - a browser that cannot start is a skip with its reason
            srv.stop()
            pytest.skip(f"chromium at {exe} did not start: {str(e).splitlines()[0]}")
        pg = browser.new_page(viewport={"width": 1280, "height": 860})
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        pg.goto(srv.url + "/")
        yield pg, tmp_path, errors
        browser.close()
    srv.stop()
    rag.close()


def test_page_ingests_asks_streams_and_compares(page):
    pg, tmp_path, errors = page
    from pcache_rag.samples import stdlib_docs

    docs = []
    # the facts, and real documentation around them: about 1,100 prompt tokens with k=4
    for name, text in [*DOCS.items(), *((f"{m}.txt", t[:3000]) for m, t in stdlib_docs(modules=("heapq", "bisect")))]:
        (tmp_path / name).write_text(text)
        docs.append(str(tmp_path / name))

    # add documents and see ingestion finish
    pg.set_input_files("#file-input", docs)
    pg.click("#upload-btn")
    pg.wait_for_function("document.getElementById('ingest-status').textContent.startsWith('Ingested')",
                         timeout=120_000)
    assert "Ingested 4 new" in pg.inner_text("#ingest-status")
    pg.wait_for_function("document.getElementById('n-docs').textContent === '4'", timeout=10_000)

    # ask: the answer streams (several updates of the answer box), then sources and TTFT
    pg.evaluate("""() => { window.updates = 0;
        new MutationObserver(() => window.updates++).observe(document.getElementById('answer'),
            {childList: true, characterData: true, subtree: true}); }""")
    pg.fill("#question", "What is the access code for the north gate?")
    pg.click("#ask-btn")
    pg.wait_for_selector("#answer[data-state=done]", timeout=120_000)
    assert pg.evaluate("window.updates") > 2, "the answer arrived in pieces"
    assert pg.inner_text("#answer").strip()
    assert "gates.md" in pg.inner_text("#sources li:first-child")
    assert "time to first token" in pg.inner_text("#ttft") and "cached" in pg.inner_text("#ttft")

    # compare: both times and the ratio
    pg.check("#compare")
    pg.click("#ask-btn")
    pg.wait_for_selector("#answer[data-compare=done]", timeout=120_000)
    assert "full prefill" in pg.inner_text("#full-ttft") and "x faster" in pg.inner_text("#ratio")
    assert pg.inner_text("#full-answer").strip()
    pg.wait_for_function("Number(document.getElementById('answered').textContent.split(' ')[0]) >= 2")
    shot = Path(os.environ.get("PCACHE_RAG_SCREENSHOT") or tmp_path / "webapp.png")
    shot.parent.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000

    # markup in a question stays text on the page, and a bad request shows its message
    pg.uncheck("#compare")
    pg.fill("#question", '<img src=x onerror="window.pwned=1"> When does the ferry leave?')
    pg.click("#ask-btn")
    pg.wait_for_selector("#answer[data-state=done]", timeout=120_000)
    assert pg.evaluate("document.querySelectorAll('#answer *, #sources img').length") == 0
    assert pg.evaluate("window.pwned") is None
    assert not errors, errors  # no script error, no failed request so far
    pg.fill("#question", "   ")
    pg.click("#ask-btn")
    pg.wait_for_selector("#answer[data-state=error]", timeout=30_000)
    assert "empty" in pg.inner_text("#error")
