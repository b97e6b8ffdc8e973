"""Test helpers: tiny random models of every positional-encoding family, an independent
reference (one full forward with the mask docs/pml.md defines), a PDF writer, and a real
uvicorn server on a loopback port."""

from __future__ import annotations

import copy
import socket
import threading
import time

import torch
import transformers as tf


#: the sliding window of the tiny windowed families
WINDOW = 16
WINDOWED = ["mistral_sw", "qwen2_sw", "gemma2", "gemma3"]


def stock_mask(model, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """The ``attention_mask`` a stock (eager) forward takes for ``allowed`` (q, kv): an additive
    4-D mask, and for a model with sliding-window layers, the same with the window applied on
    those layers (a key is seen while ``query position - key position < window``, counted over
    the given positions), as the per-layer-kind dict such models accept."""
    cfg = model.config
    neg = torch.finfo(torch.float32).min

    def additive(a):
        return torch.zeros(1, 1, *a.shape).masked_fill(~a, neg)

    w = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not w or (types is not None and "sliding_attention" not in types):
        return additive(allowed)
    near = (q_pos[:, None] - k_pos[None, :]) < w
    if types is None:  # every layer is local (Mistral)
        return additive(allowed & near)
    return {"full_attention": additive(allowed), "sliding_attention": additive(allowed & near)}


def tiny_model(family: str, vocab: int, seed: int = 0):
    """A small random float32 model; no download."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab)
    if family == "llama":
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=1024, **common)
        return tf.LlamaForCausalLM(cfg).eval()
    if family == "qwen2":
        cfg = tf.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, max_position_embeddings=1024, use_sliding_window=False, **common)
        return tf.Qwen2ForCausalLM(cfg).eval()
    if family == "mistral":
        cfg = tf.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=1024, sliding_window=None, **common)
        return tf.MistralForCausalLM(cfg).eval()
    # sliding-window families: windows of 16 positions, smaller than every test prompt
    if family == "mistral_sw":  # every layer local
        cfg = tf.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=1024, sliding_window=WINDOW, **common)
        return tf.MistralForCausalLM(cfg).eval()
    if family == "qwen2_sw":  # layer 0 global, layer 1 local
        cfg = tf.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, max_position_embeddings=1024, use_sliding_window=True,
                             sliding_window=WINDOW, max_window_layers=1, **common)
        return tf.Qwen2ForCausalLM(cfg).eval()
    if family == "gemma2":  # local and global layers, soft-capped attention and final logits
        cfg = tf.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                              sliding_window=WINDOW, attn_logit_softcapping=5.0, **common)
        return tf.Gemma2ForCausalLM(cfg).eval()
    if family == "gemma3":  # local and global layers, each kind with its own RoPE base
        cfg = tf.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                                  sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                                  **common)
        return tf.Gemma3ForCausalLM(cfg).eval()
    if family == "gpt2":
        cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **common)
        return tf.GPT2LMHeadModel(cfg).eval()
    if family == "bloom":
        cfg = tf.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **common)
        return tf.BloomForCausalLM(cfg).eval()
    if family == "mpt":
        cfg = tf.MptConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=1024, **common)
        return tf.MptForCausalLM(cfg).eval()
    raise ValueError(family)


def adapter_of(pc):
    """The engine's model adapter (its family, shapes, rotation), for tests of the adapter itself:
    the one place the tests read a part the public API does not offer."""
    return pc.core.adapter


def contiguous_parts(pc, texts, question: str = " Which chunk is third?"):
    """``(parts, question ids)``: each text encoded apart, at contiguous positions (as RAG places them)."""
    parts, pos = [], 0
    for i, t in enumerate(texts):
        ids = pc.safe.text(t)
        parts.append((f"c{i}", pc.encoder.encode(ids, list(range(pos, pos + len(ids))))))
        pos += len(ids)
    return parts, pc.safe.text(question)


def reference_allowed(res, encoding: str, preamble: str | None = "#0") -> torch.Tensor:
    """The attention pattern of docs/pml.md over ``res.input_ids``, built from the spans.

    Written independently of the engine: units attend causally within their
    span (and to the preamble span in preamble mode); an argument attends to its
    module's tokens before the slot (by position), the preamble in preamble
    mode, and itself causally; uncached tokens attend to everything before them.
    """
    T = res.input_ids.shape[0]
    allowed = torch.zeros(T, T, dtype=torch.bool)
    spans = {lab: (a, b) for lab, a, b in res.spans}
    pre = spans.get(preamble) if (encoding == "preamble" and preamble) else None
    for lab, a, b in res.spans:
        tri = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        if lab == "uncached":
            allowed[a:b, :a] = True
            allowed[a:b, a:b] = tri
            continue
        allowed[a:b, a:b] = tri
        if "." in lab and lab.split(".")[0] in spans:
            m0, m1 = spans[lab.split(".")[0]]
            slot_start = int(res.position_ids[a])
            before = torch.nonzero(res.position_ids[m0:m1] < slot_start).flatten() + m0
            allowed[a:b, before] = True
        if pre is not None and lab != preamble:
            allowed[a:b, pre[0]:pre[1]] = True
    return allowed


def reference_logits(pc, res, encoding: str) -> torch.Tensor:
    """One forward of the stock model (eager attention, its own positional code)
    over ``res.input_ids`` with ``res.position_ids`` and the reference mask.

    ALiBi models cannot take position ids in their stock code, so for them the
    forward goes through the family adapter on a fresh copy of the model (its
    bias override is checked against the stock model separately)."""
    from pcache_rag.models import adapter_for

    allowed = reference_allowed(res, encoding)
    model = copy.deepcopy(pc.model)
    model.set_attn_implementation("eager")
    ids, pos = res.input_ids[None], res.position_ids[None]
    if adapter_of(pc).family == "alibi":
        ad = adapter_for(model)
        from transformers.cache_utils import DynamicCache

        return ad.forward(res.input_ids, res.position_ids, DynamicCache(), allowed, res.position_ids)[-1]
    mask = stock_mask(model, allowed, res.position_ids, res.position_ids)
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos, attention_mask=mask).logits[0, -1]


class WordTokenizer:
    """One token per whitespace-separated word (ids stable per word): exact position
    arithmetic in layout tests. No chat template, no BOS."""

    chat_template = None
    bos_token_id = None
    eos_token_id = 0

    def __init__(self):
        self.vocab: dict[str, int] = {"<eos>": 0}

    def __call__(self, text: str, add_special_tokens: bool = False):
        ids = [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens: bool = False):
        inv = {v: k for k, v in self.vocab.items()}
        return " ".join(inv[i] for i in ids)


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def write_pdf(path, pages: list[str]) -> None:
    """A PDF with one text page per string (fpdf2; the calling test skips without it)."""
    import fpdf

    pdf = fpdf.FPDF()
    pdf.set_font("Helvetica", size=12)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 8, text)
    pdf.output(str(path))


#: how long a wait may last before it is called a hang: generous, so that a slow or busy machine
#: only waits longer (times are measured in benchmarks, never asserted in tests)
HANG_S = 300.0


def wait_until(ready, what: str, timeout: float = HANG_S, step: float = 0.05):
    """Poll ``ready()`` until it returns something true and return that; after ``timeout``
    seconds raise ``TimeoutError`` naming ``what`` (a hang guard, not a speed check). ``what``
    may be a callable, called then, for a message that says where things stood."""
    end = time.monotonic() + timeout
    while True:
        got = ready()
        if got:
            return got
        if time.monotonic() > end:
            raise TimeoutError(f"{what() if callable(what) else what} (waited {timeout:g} s)")
        time.sleep(step)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc, timeout: float = HANG_S) -> None:
    """Wait until ``url`` answers (any status below 500), failing with the output of ``proc``
    (a server started with ``subprocess.Popen``) if it exits first, or after ``timeout`` s."""
    import httpx

    def up() -> bool:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "the process exited"
        try:
            return httpx.get(url, timeout=10).status_code < 500
        except httpx.TransportError:
            return False

    wait_until(up, f"{url} did not come up", timeout, step=0.3)


class Server:
    """A real uvicorn server on a loopback port, in a thread of this process, configured as
    ``pcache-rag serve`` configures it (``config``: :func:`pcache_rag.serve.server_config`'s)."""

    def __init__(self, app, **config):
        import uvicorn  # imported here: only the serve tests need it

        from pcache_rag.serve import graceful_server, server_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: uvicorn.Server = graceful_server(server_config(app, "127.0.0.1", self.port, log_level="warning",
                                                                    **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        def started() -> bool:
            assert self.thread.is_alive(), "the server thread ended before it started"
            return self.server.started

        wait_until(started, "the server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def docx_bomb(path, xml_bytes: int) -> None:
    """A valid .docx whose document.xml is ``xml_bytes`` of empty paragraphs: a few hundred KB
    on disk (python-docx writes the package; the body is replaced, deflated)."""
    import docx
    import zipfile

    docx.Document().save(str(path))
    with zipfile.ZipFile(path) as z:
        parts = {i.filename: z.read(i) for i in z.infolist()}
    head = (b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n<w:document xmlns:w="http://schemas.'
            b'openxmlformats.org/wordprocessingml/2006/main"><w:body>')
    tail = b"</w:body></w:document>"
    para = b"<w:p/>"
    body = para * ((xml_bytes - len(head) - len(tail)) // len(para))
    parts["word/document.xml"] = head + body + tail
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for name, data in parts.items():
            z.writestr(name, data)


def pdf_bomb(path, inflated_bytes: int) -> None:
    """A one-page PDF whose content stream (FlateDecode) inflates to ``inflated_bytes`` of
    spaces: about 1 KB per MB on disk."""
    import zlib

    co = zlib.compressobj(9)
    block = b" " * (1 << 20)
    parts = []
    left = inflated_bytes
    while left > 0:
        parts.append(co.compress(block[: min(left, len(block))]))
        left -= len(block)
    stream = b"".join(parts) + co.flush()
    objs = [b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
            b"/Resources << /Font << /F1 5 0 R >> >> >>",
            b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(stream) + stream + b"\nendstream",
            b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    with open(path, "wb") as f:
        f.write(pdf_bytes(objs))


def pdf_bytes(objs: list[bytes]) -> bytes:
    """A PDF file of ``objs`` (object bodies, numbered from 1; object 1 is the catalog), with its
    cross-reference table: what hostile-PDF tests build their files from."""
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    return bytes(out)


class RedisServer:
    """``redis-server`` on 127.0.0.1, nothing persisted, LRU eviction as the budget."""

    def __init__(self, port: int | None = None, *extra: str, maxmemory: str = "512mb",
                 policy: str = "allkeys-lru"):
        import shutil
        import subprocess

        import pytest
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed (make setup installs it as root with apt-get; "
                        "see scripts/install-system-deps.sh)")
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory", maxmemory, "--maxmemory-policy", policy, *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.exceptions.ConnectionError:
                assert self.proc.poll() is None, "redis-server exited"
                return False

        wait_until(up, "redis-server did not start")
        self.client = client

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


_LAST: dict[int, list] = {}


def watch(pc):
    """Record ``pc``'s finished generations, for :func:`last_output` (returns ``pc``)."""
    got = _LAST.setdefault(id(pc), [])
    pc.listeners.add(lambda out: got.append(out))
    return pc


def last_output(pc):
    """The output of the latest generation ``pc`` finished (after :func:`watch`), however deep in a
    framework's chain it ran."""
    got = _LAST.get(id(pc))
    assert got, "no generation finished on this engine (or it was never watched)"
    return got[-1]
