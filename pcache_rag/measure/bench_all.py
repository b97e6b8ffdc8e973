"""``pcache-rag bench all``: the benchmark report, every figure measured on the machine that runs it.

Writes ``benchmarks.md`` (machine, date, versions; a table and a PNG plot per figure) and
``benchmarks.json`` to ``out``. The figures:

* ``length``: TTFT against prompt length, full prefill vs cached from each tier the store has
  (model-dtype memory, host fp16, host int8, disk warm and cold, Redis when ``kv_url`` is given,
  the GPU device tier when the model runs on CUDA), with the floor (the new tokens alone);
* ``fraction``: TTFT against the cached share of a prompt of fixed length (the experiment the
  paper lacks);
* ``recompute``: TTFT of each recompute mode against full prefill, split path against dense mask;
* ``size``: the TTFT ratio against model size, on random-initialised Llama shapes;
* ``encoding``: encoding cost, the break-even number of reuses, ingest throughput, and
  whether encoding several chunks in one batch pays;
* ``scaffold``: joint (scaffold) encoding against separate modules on cross-document
  questions, with full prefill as the baseline;
* ``memory``: bytes per cached token (formula against measured) and disk use per 1,000 chunks;
* ``concurrency``: throughput and TTFT against the number of concurrent requests, continuous
  batching against the queue (one answer at a time).

Every speed-up is against full prefill of the same model and tokens in the same run. Nothing
is estimated: a tier or device that is not there is reported as not run.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..default_model import DEFAULT_NAME, model_name
from ..engine import Parts
from .metrics import median

QUESTION_TOKENS = 32


@dataclass(slots=True)
class Figure:
    """One figure of the report: a table (``columns``, ``rows``) and a plot."""

    key: str
    title: str
    columns: list[str]
    rows: list[list] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    png: str = ""


@dataclass(frozen=True, slots=True)
class Sizes:
    """How big each figure's run is: the full report, or ``--quick`` (a few minutes)."""

    lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)
    repeats: int = 3
    fraction_tokens: int = 2048
    recompute_tokens: int = 1728
    recompute_modes: tuple[str, ...] = ("none", "match:1", "epic:16", "blend:0.15", "focus:0.15", "all")
    fractions: tuple[float, ...] = (0.0, 0.125, 0.25, 0.5, 0.75, 0.875, 1.0)
    size_lengths: tuple[int, ...] = (2048, 8192)
    size_models: tuple[str, ...] = ("llama-30M", "smollm2-135M", "smollm2-360M", "tinyllama-1.1B")
    chunk_sizes: tuple[int, ...] = (128, 256, 512, 1024)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    ingest_files: int = 40
    scaffold_questions: int = 40
    doc_tokens: int = 400
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    load_new_tokens: int = 24
    load_doc_tokens: int = 256
    decode_doc_tokens: int = 1000
    decode_new_tokens: int = 64


QUICK = Sizes(lengths=(128, 256), repeats=1, fraction_tokens=256, fractions=(0.0, 0.5, 1.0), size_lengths=(128,),
              size_models=("tiny-a", "tiny-b"), chunk_sizes=(64, 128), batch_sizes=(1, 2), ingest_files=3,
              scaffold_questions=2, doc_tokens=64, recompute_tokens=256, recompute_modes=("none", "epic:4"),
              concurrency=(1, 2), load_new_tokens=4, load_doc_tokens=32, decode_doc_tokens=64, decode_new_tokens=4)

#: Llama shapes for the size sweep: public models' shapes (random weights, no download) and
#: two tiny ones for ``--quick``. (hidden, layers, heads, kv heads, intermediate, vocab)
SHAPES = {
    "llama-30M": (384, 8, 6, 2, 1024, 49152),  # the SmolLM2 family's shape, narrowed
    "smollm2-135M": (576, 30, 9, 3, 1536, 49152),
    "smollm2-360M": (960, 32, 15, 5, 2560, 49152),
    "tinyllama-1.1B": (2048, 22, 32, 4, 5632, 32000),
    "tiny-a": (64, 2, 4, 2, 128, 49152),
    "tiny-b": (128, 4, 4, 2, 256, 49152),
}


# ---------------------------------------------------------------------------- helpers


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def machine(device) -> dict:
    """The machine and software this report was measured on."""
    import transformers

    from .. import __version__

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "gpu": gpu,
            "device": str(device), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "pcache_rag": __version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


_DOC_IDS: dict[int, list[int]] = {}  # tokenizer id -> the docs' token ids (pydoc rendering is slow)


def _context_ids(tok, n: int, seed: int = 0) -> list[int]:
    """``n`` token ids of real documentation text (this machine's standard-library docs),
    starting ``seed`` tokens in."""
    from ..samples import stdlib_docs

    ids = _DOC_IDS.get(id(tok))
    if ids is None:
        ids = []
        for _, text in stdlib_docs(min_chars=200):
            ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        _DOC_IDS[id(tok)] = ids
    reps = (n + seed) // max(len(ids), 1) + 1
    return (ids * reps)[seed : seed + n]


def _modules(pc, ids: list[int], chunk: int) -> list:
    """``ids`` encoded as modules of ``chunk`` tokens at contiguous positions (as RAG places them)."""
    out, pos = [], 0
    while pos < len(ids):
        piece = ids[pos : pos + chunk]
        out.append((f"m{len(out)}", pc.encoder.encode(piece, list(range(pos, pos + len(piece))))))
        pos += len(piece)
    return out


# ---------------------------------------------------------------------------- figures


def fig_length(model, tok, sz: Sizes, device, kv_url, workdir: Path, log) -> tuple[Figure, dict]:
    """TTFT against prompt length: full prefill, cached from every tier, and the floor."""
    from .metrics import drop_page_cache
    from ..engine import PromptCache
    from ..store import DiskTier, MemoryTier, TieredStore

    need = max(sz.lengths) + 64
    engines = {"memory": PromptCache(model, tok, store_dtype=None, max_tokens=need,
                                     store=TieredStore([MemoryTier(device, name="memory")]))}
    host = MemoryTier("cpu", name="host")
    disk = DiskTier(workdir / "disk-tier")
    engines["host fp16"] = PromptCache(model, tok, store=TieredStore([MemoryTier("cpu", name="host")]), max_tokens=need)
    engines["host int8"] = PromptCache(model, tok, store=TieredStore([MemoryTier("cpu", name="host")]),
                                       store_dtype="int8", max_tokens=need)
    engines["disk"] = PromptCache(model, tok, store=TieredStore([host, disk]), max_tokens=need)
    remote = None
    if kv_url:
        import uuid

        from ..store import RemoteTier

        remote = RemoteTier(kv_url, prefix=f"pcache-benchall-{uuid.uuid4().hex[:8]}")
        host_r = MemoryTier("cpu", name="host")
        engines["redis"] = PromptCache(model, tok, store=TieredStore([host_r, remote]), max_tokens=need)
    tiers = ["memory", "host fp16", "host int8", "disk warm", "disk cold"] + (["redis"] if kv_url else [])
    fig = Figure("length", "Time to first token against prompt length",
                 ["prompt tokens", "full prefill ms"] + [f"{t} ms" for t in tiers]
                 + ["floor ms", "speed-up (host fp16)", "encode ms", "break-even reuses"])
    raw: dict = {"tiers": tiers, "rows": []}
    for n in sz.lengths:
        if n > engines["memory"].max_positions:
            fig.notes.append(f"{n} tokens: skipped, the model takes at most {engines['memory'].max_positions} positions")
            continue
        ids = _context_ids(tok, n - QUESTION_TOKENS)
        q = _context_ids(tok, QUESTION_TOKENS, seed=7)
        chunk = 512
        full_ids = torch.tensor(ids + q)
        pc0 = engines["memory"]
        full_rep = sz.repeats if n <= 2048 else 1
        full = median(lambda: (pc0.core.full_prefill(full_ids), _sync(device)), full_rep)
        times = {}
        floor = None
        # Encode once (what ingest pays), store a copy in every engine's tiers in its dtype.
        t0 = time.perf_counter()
        parts = _modules(pc0, ids, chunk)
        keys = [f"bench-len-{n}-{i}" for i in range(len(parts))]
        for k, (_, kv) in zip(keys, parts):
            engines["host fp16"].store.put(k, kv.to(dtype=torch.float16))
        _sync(device)
        enc_s = time.perf_counter() - t0
        for name, pc in engines.items():
            for k, (_, kv) in zip(keys, parts):
                if not pc.store.contains(k):
                    pc.store.put(k, kv.to(dtype=pc.store_dtype))
            tier_host = pc.store.tiers[0]

            def run(pc=pc):
                pc.workspace.invalidate()
                kvs = [(k, pc.store.get(k)) for k in keys]
                pc.prefill(Parts(kvs, q))
                _sync(device)

            def evict(tier_host=tier_host):
                for k in keys:
                    tier_host.remove(k)

            if name == "disk":
                times["disk warm"] = _median_with(run, evict, sz.repeats)
                times["disk cold"] = _median_with(run, lambda: (evict(), drop_page_cache(disk.directory)), sz.repeats)
            elif name == "redis":
                times["redis"] = _median_with(run, evict, sz.repeats)
            else:
                times[name] = median(run, sz.repeats)
            if name == "memory":  # floor: the same prompt again, nothing to copy
                kvs = [(k, pc.store.get(k)) for k in keys]
                pc.prefill(Parts(kvs, q))
                fl = []
                for _ in range(sz.repeats):
                    fl.append(pc.prefill(Parts(kvs, q)).forward_s)
                floor = statistics.median(fl)
            for k in keys:
                pc.store.remove(k)
        del parts
        cached = times["host fp16"]
        gain = full - cached
        breakeven = math.ceil(enc_s / gain) if gain > 0 else "never"
        fig.rows.append([n, full * 1e3] + [times[t] * 1e3 for t in tiers]
                        + [floor * 1e3, full / cached, enc_s * 1e3, breakeven])
        raw["rows"].append({"tokens": n, "full_s": full, **{t: times[t] for t in tiers}, "floor_s": floor,
                            "encode_s": enc_s, "full_repeats": full_rep})
        log(f"[length] {n} tokens: full {full * 1e3:.0f} ms, host fp16 {cached * 1e3:.0f} ms "
            f"(x{full / cached:.1f}), floor {floor * 1e3:.0f} ms, break-even after {breakeven} reuses")
    fig.notes.append(f"Cached prompts are ~512-token modules plus a {QUESTION_TOKENS}-token question. Each time is "
                     f"the median of {sz.repeats} run(s) (full prefill: 1 run at 4K tokens and more). Encode: encoding the "
                     "modules once and storing them (host fp16); break-even: the reuses after which encoding once "
                     "and answering from the cache costs less than full prefill every time "
                     "(encode / (full - cached), rounded up).")
    if remote is not None:
        remote.clear()
    for pc in engines.values():
        pc.store.close()
    return fig, raw


def _median_with(fn, before, repeats: int) -> float:
    """The median time of ``fn`` over ``repeats`` runs, each after an untimed ``before``."""
    xs = []
    for _ in range(repeats):
        before()
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs)


def fig_fraction(model, tok, sz: Sizes, device, log) -> Figure:
    """TTFT against the cached share of a prompt of fixed length."""
    from ..engine import PromptCache

    N = sz.fraction_tokens
    pc = PromptCache(model, tok, store_dtype=None, max_tokens=N + 64)
    ctx = _context_ids(tok, N - QUESTION_TOKENS)
    q = _context_ids(tok, QUESTION_TOKENS, seed=7)
    fig = Figure("fraction", f"Time to first token against the cached share of a {N}-token prompt",
                 ["cached share (%)", "cached tokens", "computed tokens", "TTFT ms", "speed-up vs 0% cached"])
    base = None
    for f in sz.fractions:
        c = int(round(f * len(ctx)))
        parts = _modules(pc, ctx[:c], 512) if c else []
        new = ctx[c:] + q

        def run():
            pc.workspace.invalidate()
            pc.prefill(Parts(parts, new))
            _sync(device)

        t = median(run, sz.repeats)
        base = t if base is None else base
        fig.rows.append([f * 100, c, len(new), t * 1e3, base / t])
        log(f"[fraction] {f:.0%} cached: {t * 1e3:.0f} ms (x{base / t:.1f})")
    fig.notes.append("The cached share is a prefix of modules; the rest of the context and the question are "
                     "computed, attending to everything before them. 0% is a full prefill.")
    return fig


def fig_recompute(model, tok, sz: Sizes, device, log) -> Figure:
    """TTFT of each recompute mode against full prefill at ~1,700 tokens, with recomputed rows
    on the split path (no dense mask) and, for the baseline, through the dense mask."""
    from ..engine import PromptCache

    pc = PromptCache(model, tok, store_dtype=None, max_tokens=sz.recompute_tokens + 512)
    n_mod = 4
    per = (sz.recompute_tokens - 64 - QUESTION_TOKENS) // n_mod
    ctx = _context_ids(tok, 64 + n_mod * per)
    parts = _modules(pc, ctx[:64], 64) + [
        (f"d{i}", pc.encoder.encode(ctx[64 + i * per : 64 + (i + 1) * per], list(range(64 + i * per, 64 + (i + 1) * per))))
        for i in range(n_mod)]
    q = _context_ids(tok, QUESTION_TOKENS, seed=7)
    full_ids = ctx + q
    N = len(full_ids)
    fig = Figure("recompute", f"Time to first token of each recompute mode at {N} tokens",
                 ["mode", "recomputed tokens", "TTFT ms (split path)", "TTFT ms (dense mask)",
                  "speed-up vs full prefill (split)", "speed-up vs full prefill (dense)"])

    def full():
        pc.core.full_prefill(torch.tensor(full_ids))
        _sync(device)

    base = median(full, sz.repeats)
    fig.rows.append(["full prefill", N, base * 1e3, base * 1e3, 1.0, 1.0])
    for mode in sz.recompute_modes:
        times, n_rows = [], 0
        for split in (True, False):
            pc.prefiller.split_recompute = split

            def run():
                nonlocal n_rows
                pc.workspace.invalidate()
                n_rows = pc.prefill(Parts(parts, q), recompute=mode).recomputed_tokens
                _sync(device)

            times.append(median(run, sz.repeats))
        pc.prefiller.split_recompute = True
        fig.rows.append([mode, n_rows, times[0] * 1e3, times[1] * 1e3, base / times[0], base / times[1]])
        log(f"[recompute] {mode}: {times[0] * 1e3:.0f} ms split, {times[1] * 1e3:.0f} ms dense "
            f"(x{base / times[0]:.1f} vs x{base / times[1]:.1f} full prefill)")
    fig.notes.append(f"A {64}-token preamble and {n_mod} modules of {per} tokens, encoded apart, then a "
                     f"{QUESTION_TOKENS}-token question. Split path: the recomputed rows and the question attend "
                     "without a dense mask (one mask of recomputed rows by cache rows); dense mask: the same "
                     "forward with the full boolean mask. Full prefill: the same tokens, nothing reused.")
    return fig


def fig_concurrency(model, tok, sz: Sizes, device, log) -> Figure:
    """Throughput and TTFT against concurrent requests: continuous batching against the queue."""
    import threading

    from ..engine import PromptCache
    from ..engine.scheduler import DEFAULT_MAX_BATCH

    pc = PromptCache(model, tok, store_dtype=torch.float16)
    pre = _context_ids(tok, 64, seed=99)
    pool = [pc.encoder.encode(_context_ids(tok, sz.load_doc_tokens, seed=200 + i), list(range(64, 64 + sz.load_doc_tokens)))
            for i in range(8)]
    pre_kv = pc.encoder.encode(pre, list(range(64)))
    n = max(sz.concurrency)
    reqs = []
    for i in range(n):  # k=2 documents per request, placed after the preamble, and a question of its own
        a, b = pool[i % 8], pool[(i * 3 + 1) % 8]
        parts = [("pre", pre_kv), ("d0", pc.encoder.place(a, 64)), ("d1", pc.encoder.place(b, 64 + sz.load_doc_tokens))]
        reqs.append(Parts(parts, _context_ids(tok, 20, seed=1000 + i)))
    fig = Figure("concurrency", f"Throughput and TTFT against concurrent requests (k=2 documents of "
                 f"{sz.load_doc_tokens} tokens, {sz.load_new_tokens} new tokens each)",
                 ["concurrent", "queue answers/s", "batched answers/s", "throughput gain", "queue TTFT p50 s",
                  "queue TTFT p95 s", "batched TTFT p50 s", "batched TTFT p95 s", "identical answers"])

    def load(c: int) -> tuple[float, list[float], list[str]]:
        outs: list = [None] * c
        go = threading.Barrier(c + 1)

        def one(i: int) -> None:
            go.wait()
            outs[i] = pc.generate(reqs[i], max_new_tokens=sz.load_new_tokens)

        ths = [threading.Thread(target=one, args=(i,)) for i in range(c)]
        for t in ths:
            t.start()
        go.wait()
        t0 = time.perf_counter()
        for t in ths:
            t.join()
        wall = time.perf_counter() - t0
        return c / wall, sorted(o.ttft_s for o in outs), [o.text for o in outs]

    def pct(xs: list[float], p: float) -> float:
        return xs[min(len(xs) - 1, round(p * (len(xs) - 1)))]

    pc.generate(reqs[0], max_new_tokens=2)  # warm
    for c in sz.concurrency:
        q_rate, q_ttft, q_text = load(c)
        pc.start_batching(max_batch=DEFAULT_MAX_BATCH)
        try:
            b_rate, b_ttft, b_text = load(c)
        finally:
            pc.stop_batching()
        same = sum(x == y for x, y in zip(q_text, b_text))
        fig.rows.append([c, q_rate, b_rate, b_rate / q_rate, statistics.median(q_ttft), pct(q_ttft, 0.95),
                         statistics.median(b_ttft), pct(b_ttft, 0.95), f"{same}/{c}"])
        log(f"[concurrency] {c}: queue {q_rate:.2f}/s, batched {b_rate:.2f}/s (x{b_rate / q_rate:.1f}); TTFT p50 "
            f"{statistics.median(q_ttft):.2f} s vs {statistics.median(b_ttft):.2f} s; identical {same}/{c}")
    fig.notes.append(f"In-process: `concurrent` threads send their requests at once to one engine. Queue: the "
                     f"engine answers one at a time (its lock is the queue); batched: `PromptCache.start_batching` "
                     f"with max_batch={DEFAULT_MAX_BATCH} (more requests wait for a place), every step one forward "
                     "over the running answers' next tokens and the new prompts' tokens. TTFT counts from the "
                     "request, its wait included. Greedy decoding; 'identical' compares each batched answer with "
                     "its queued one. The HTTP server's own load test is `scripts/measure-load.py`.")
    return fig


def _random_llama(shape: str, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    h, layers, heads, kv, inter, vocab = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=inter, vocab_size=vocab, max_position_embeddings=16384,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.eval()


def fig_size(tok, sz: Sizes, device, log) -> Figure:
    """The TTFT ratio against model size, on random-initialised Llama shapes."""
    from ..engine import PromptCache

    fig = Figure("size", "TTFT speed-up against model size (random-initialised Llama shapes)",
                 ["model shape", "parameters (M)", "prompt tokens", "full prefill ms", "cached ms", "speed-up"])
    for shape in sz.size_models:
        model = _random_llama(shape, device)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        vocab = SHAPES[shape][5]
        for n in sz.size_lengths:
            pc = PromptCache(model, tok, store_dtype=None, max_tokens=n + 64)
            r = random.Random(n)
            ids = [r.randrange(vocab) for _ in range(n - QUESTION_TOKENS)]
            q = [r.randrange(vocab) for _ in range(QUESTION_TOKENS)]
            parts = _modules(pc, ids, 512)
            full_ids = torch.tensor(ids + q)
            rep = sz.repeats if n <= 2048 and params < 500 else 1
            full = median(lambda: (pc.core.full_prefill(full_ids), _sync(device)), rep)

            def run():
                pc.workspace.invalidate()
                pc.prefill(Parts(parts, q))
                _sync(device)

            cached = median(run, sz.repeats)
            fig.rows.append([shape, params, n, full * 1e3, cached * 1e3, full / cached])
            log(f"[size] {shape} ({params:.0f}M) at {n} tokens: full {full * 1e3:.0f} ms, cached "
                f"{cached * 1e3:.0f} ms (x{full / cached:.1f})")
            pc = parts = None  # free the workspace before the next length
        del model
    fig.notes.append("Random weights in float32 (no download): speed depends on shapes, not on weights. "
                     "Shapes: " + "; ".join(f"{s}: hidden {SHAPES[s][0]}, {SHAPES[s][1]} layers, "
                                            f"{SHAPES[s][2]}/{SHAPES[s][3]} heads/kv heads" for s in sz.size_models)
                     + ". Token ids are random.")
    return fig


def encoding_figure(pc, tok, sz: Sizes, device, log) -> Figure:
    """Per-module encoding cost by chunk size and batch. One chunk runs through the model's
    adapter (which gives a sliding-window model its positions); a batch runs one forward over
    equal-length chunks. Windowed attention counts one sequence's positions, so a batch of
    chunks longer than the window is refused by the engine, and the figure says so."""
    from transformers.cache_utils import DynamicCache

    enc = Figure("encoding", "Encoding cost: one module, and batches of modules",
                 ["chunk tokens", "batch", "ms per batch", "ms per chunk", "tokens/s", "vs batch 1"])
    window = pc.adapter.window
    refused = []
    for c in sz.chunk_sizes:
        base, n_rows = None, len(enc.rows)
        for b in sz.batch_sizes:
            if b > 1 and window is not None and c > window:
                refused.append(f"{c}x{b}")
                continue
            ids = torch.tensor([_context_ids(tok, c, seed=1000 * i) for i in range(b)], device=pc.adapter.device)
            pos = torch.arange(c, device=pc.adapter.device)[None].expand(b, c)

            def run():
                with torch.no_grad():
                    if b == 1:
                        pc.adapter.forward(ids[0], pos[0], DynamicCache(), None, None)
                    else:
                        pc.model(input_ids=ids, position_ids=pos, cache=DynamicCache(), use_cache=True,
                                 logits_to_keep=1)
                _sync(device)

            t = median(run, sz.repeats)
            per = t / b
            base = per if base is None else base
            enc.rows.append([c, b, t * 1e3, per * 1e3, b * c / t, base / per])
        log(f"[encoding] {c}-token chunks: " + ", ".join(f"batch {r[1]} {r[3]:.0f} ms/chunk" for r in enc.rows[n_rows:]))
    enc.notes.append("One forward over `batch` chunks of equal length, each from position 0 (as chunks are "
                     "encoded at their canonical start). 'vs batch 1' above 1 means batching pays.")
    if refused:
        enc.notes.append(f"Not measured (chunk tokens x batch): {', '.join(refused)}. The model has {window}-position "
                         "sliding-window layers, and the engine refuses a batch of chunks longer than the window "
                         "(windowed attention counts one sequence's positions). Ingest encodes chunks one at a time.")
    return enc


def fig_encoding(model, tok, sz: Sizes, device, workdir: Path, log) -> tuple[Figure, Figure, dict]:
    """Per-module encoding cost by chunk size, batching, and ingest throughput."""
    from ..engine import PromptCache

    pc = PromptCache(model, tok, store_dtype=None)
    enc = encoding_figure(pc, tok, sz, device, log)

    # ingest throughput through CachedRAG (chunking, embedding, encoding, storing)
    from .quality import Filler
    from ..rag import CachedRAG, Index

    corpus = workdir / "ingest-corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    fill = Filler(tok, sz.doc_tokens * 3)
    for i in range(sz.ingest_files):
        (corpus / f"doc-{i:03d}.txt").write_text(fill.passage(60_000 + i))
    index = Index(workdir / "ingest-index")
    ipc = index.engine(model, tok, decode_weights="fp32")  # the model is shared with the other figures: keep it fp32
    rag = CachedRAG(index, pc=ipc, chunk_tokens=sz.doc_tokens)
    t0 = time.perf_counter()
    rep = rag.ingest([corpus], progress=False)
    secs = time.perf_counter() - t0
    chunks = rep.chunks_encoded
    tokens = ipc.encoded["tokens"] - len(rag.preamble_ids)
    disk_bytes = sum(f.stat().st_size for f in index.path.rglob("*") if f.is_file())
    kv_bytes = sum(f.stat().st_size for f in index.kv_dir.rglob("*") if f.is_file())
    rag.close()
    ingest = {"files": sz.ingest_files, "chunks": chunks, "tokens": tokens, "seconds": secs,
              "chunks_per_s": chunks / secs, "tokens_per_s": tokens / secs, "chunk_tokens": sz.doc_tokens,
              "disk_bytes": disk_bytes, "kv_bytes": kv_bytes}
    log(f"[encoding] ingest: {chunks} chunks, {tokens} tokens in {secs:.1f} s "
        f"({chunks / secs:.2f} chunks/s, {tokens / secs:.0f} tokens/s)")
    thr = Figure("ingest", "Ingest throughput (CachedRAG.ingest, eager encoding)",
                 ["files", "chunks", "tokens", "seconds", "chunks/s", "tokens/s"],
                 [[sz.ingest_files, chunks, tokens, secs, chunks / secs, tokens / secs]],
                 [f"Chunks of up to {sz.doc_tokens} tokens of documentation text; reading, chunking, "
                  "embedding (all-MiniLM-L6-v2), encoding and writing states (fp16) to disk."])
    return enc, thr, ingest


def fig_scaffold(model, tok, sz: Sizes, log) -> Figure:
    """Scaffolded joint encoding against separate modules on cross-document questions."""
    from ..engine import PromptCache
    from .quality import SYSTEM, build_sets, contains
    from ..pml import escape

    qs = build_sets(tok, sz.scaffold_questions, sz.doc_tokens, 4, seed=3)["cross"]
    modes = ("full prefill", "separate modules", "scaffold")
    got = {m: [] for m in modes}
    ttft = {m: [] for m in modes}
    pc = PromptCache(model, tok)
    for i, q in enumerate(qs):
        name = q.question.split(" works for", 1)[0]
        d1 = next(d for d in q.docs if f"{name} works for " in d)
        company = d1.split(f"{name} works for ", 1)[1].split(".", 1)[0]
        d2 = next(d for d in q.docs if f"headquarters of {company} " in d)
        pair = [d1, d2]
        rest = [d for d in q.docs if d not in pair]
        order = pair + rest
        mods = [f'<module name="d{j}">{escape(d)}</module>' for j, d in enumerate(order)]
        joint = f'<scaffold name="pair">{mods[0]}{mods[1]}</scaffold>' + "".join(mods[2:])
        system = f"<system>{escape(SYSTEM)}</system>"
        imports = "".join(f"<d{j}/>" for j in range(len(order)))
        for mode, body in (("separate modules", "".join(mods)), ("scaffold", joint)):
            name = f"sc{i}{'j' if mode == 'scaffold' else 's'}"
            pc.add_schema(f'<schema name="{name}">{system}{body}</schema>')
            prompt = f'<prompt schema="{name}">{imports}<user>{escape(q.question)}</user></prompt>'
            out = pc.generate(prompt, max_new_tokens=24, stop=["\n"])
            got[mode].append(contains(out.text, q.answer))
            ttft[mode].append(out.ttft_s)
            if mode == "separate modules":
                ids = pc.prefill(prompt).input_ids.tolist()
                full = pc.generate(Parts([], ids), max_new_tokens=24, stop=["\n"])
                got["full prefill"].append(contains(full.text, q.answer))
                ttft["full prefill"].append(full.ttft_s)
    from .quality import wilson

    fig = Figure("scaffold", "Scaffolds: the two documents an answer needs, encoded jointly",
                 ["mode", "correct", "questions", "accuracy", "95% CI low", "95% CI high", "median TTFT ms",
                  "speed-up"])
    base = statistics.median(ttft["full prefill"])
    for m in modes:
        c, n = sum(got[m]), len(got[m])
        lo, hi = wilson(c, n)
        t = statistics.median(ttft[m])
        fig.rows.append([m, c, n, c / n, lo, hi, t * 1e3, base / t])
        log(f"[scaffold] {m}: {c}/{n}, median TTFT {t * 1e3:.0f} ms")
    fig.notes.append("The cross-document set of `pcache-rag eval quality` (who works where, where that company "
                     "sits, two competing pairs as distractors); the pair that holds the answer is a "
                     "`<scaffold>`, so its two documents attend to each other, and the distractors are separate "
                     "modules. Preamble encoding, fp16 states, greedy answers of at most 24 tokens.")
    return fig


def fig_memory(model, tok, ingest: dict, log) -> Figure:
    """Bytes per cached token, formula against measured, and disk use per 1,000 chunks."""
    from ..engine import PromptCache

    ids = _context_ids(tok, 512)
    fig = Figure("memory", "Memory: bytes per cached token, and disk per 1,000 chunks",
                 ["states", "formula bytes/token", "measured bytes/token"])
    shape = PromptCache(model, tok).adapter.kv_shape
    for label, dt, elt in (("model dtype (fp32)", None, 4), ("fp16", torch.float16, 2), ("int8", "int8", 1)):
        pc = PromptCache(model, tok, store_dtype=dt)
        kv = pc.encoder.encode(ids, list(range(len(ids)))).to(dtype=pc.store_dtype)
        measured = kv.nbytes() / kv.length
        formula = shape.bytes_per_token(elt)
        if label == "int8":  # + fp16 scales: keys per channel (over the chunk), values per token
            formula = shape.bytes_per_token(1) + 2 * shape.n_layers * shape.n_kv_heads * (1 + shape.head_dim / len(ids))
        fig.rows.append([label, formula, measured])
        log(f"[memory] {label}: {measured:.0f} bytes/token (formula {formula:.0f})")
    per_1000 = ingest["kv_bytes"] / max(ingest["chunks"], 1) * 1000
    fig.rows.append([f"disk: states per 1,000 chunks of {ingest['chunk_tokens']} tokens (MB)", "", per_1000 / 1e6])
    fig.rows.append(["disk: whole index per 1,000 chunks (MB)", "",
                     ingest["disk_bytes"] / max(ingest["chunks"], 1) * 1000 / 1e6])
    fig.notes.append(f"Formula: 2 (keys, values) x layers ({shape.n_layers}) x kv heads ({shape.n_kv_heads}) x "
                     f"head dim ({shape.head_dim}) x bytes per element; int8 adds its fp16 scales. The disk rows "
                     "are from the ingest run (states as fp16 safetensors; the whole index adds chroma).")
    return fig


def fig_decode(model_path, sz: Sizes, log) -> Figure:
    """A whole answer: ms a generated token against the weight-streaming floor, stock
    transformers against the cached path with fp32, bf16 and int8 decode weights
    (:func:`pcache_rag.measure.decode_bench.bench_decode`)."""
    from .decode_bench import bench_decode

    res = bench_decode(model_path, new_tokens=sz.decode_new_tokens, doc_tokens=sz.decode_doc_tokens,
                       repeats=sz.repeats, busy=2, log=lambda *a: log("[decode]", *a))
    fig = Figure("decode", f"Decoding: ms a token and a whole answer ({sz.decode_new_tokens} new tokens)",
                 ["path", "TTFT ms", "ms a token", "floor ms", "x floor", "answer s", "answer speed-up",
                  "tokens as transformers step", "ms a token, 2 busy processes"])
    base = res["rows"][0]["answer_s"]
    for r in res["rows"]:
        same = f"{r['same_tokens']:.0%}" if "same_tokens" in r else ""
        fig.rows.append([r["name"], r["ttft_s"] * 1e3, r["ms_per_token"], r["floor_ms"],
                         r["ms_per_token"] / r["floor_ms"], r["answer_s"], base / r["answer_s"], same,
                         r["busy_ms_per_token"]])
    fig.notes.append(f"{res['cpu']}. The last column times every row again beside two single-threaded busy-loop "
                     "processes this run started.")
    fig.notes.append(f"A {res['doc_tokens']}-token document read from the cache and a question; every row decodes "
                     f"exactly {res['new_tokens']} tokens. The floor is the linear weights' bytes a token over the "
                     "higher of the read bandwidths measured just before and just after the row's timing ("
                     + ", ".join("-".join(f"{g:.0f}" for g in r["bandwidth_gb_s"]) for r in res["rows"])
                     + " GB/s, row by row). The fused fp32 step "
                     "is PromptCache's default; bf16 decode weights are the RAG stack's default (Index.engine, "
                     "the CLI, the connectors), int8 is opt-in; prompt tokens keep fp32.")
    return fig


# ---------------------------------------------------------------------------- plots and report


def _plot(fig: Figure, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f, ax = plt.subplots(figsize=(6.4, 4.0))
    cols = fig.columns
    if fig.key == "length":
        xs = [r[0] for r in fig.rows]
        for j, c in enumerate(cols[1:-3], start=1):
            ax.plot(xs, [r[j] for r in fig.rows], marker="o", label=c.replace(" ms", ""))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("time to first token (ms)")
    elif fig.key == "fraction":
        ax.plot([r[0] for r in fig.rows], [r[3] for r in fig.rows], marker="o")
        ax.set_yscale("log")
        ax.set_xlabel("cached share of the prompt (%)")
        ax.set_ylabel("time to first token (ms)")
    elif fig.key == "recompute":
        names = [r[0] for r in fig.rows[1:]]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [r[4] for r in fig.rows[1:]], width=0.4, label="split path")
        ax.bar([x + 0.2 for x in xs], [r[5] for r in fig.rows[1:]], width=0.4, label="dense mask")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("TTFT speed-up vs full prefill")
    elif fig.key == "size":
        for n in sorted({r[2] for r in fig.rows}):
            pts = [r for r in fig.rows if r[2] == n]
            ax.plot([r[1] for r in pts], [r[5] for r in pts], marker="o", label=f"{n} tokens")
            for r in pts:
                ax.annotate(r[0], (r[1], r[5]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("parameters (millions)")
        ax.set_ylabel("TTFT speed-up (full / cached)")
    elif fig.key == "encoding":
        for c in sorted({r[0] for r in fig.rows}):
            pts = [r for r in fig.rows if r[0] == c]
            ax.plot([r[1] for r in pts], [r[3] for r in pts], marker="o", label=f"{c}-token chunks")
        ax.set_xlabel("chunks per forward (batch)")
        ax.set_ylabel("ms per chunk")
    elif fig.key == "ingest":
        ax.bar(["chunks/s", "tokens/s / 100"], [fig.rows[0][4], fig.rows[0][5] / 100])
        ax.set_ylabel("throughput")
    elif fig.key == "scaffold":
        names = [r[0] for r in fig.rows]
        acc = [r[3] * 100 for r in fig.rows]
        err = [[r[3] * 100 - r[4] * 100 for r in fig.rows], [r[5] * 100 - r[3] * 100 for r in fig.rows]]
        ax.bar(names, acc, yerr=err, capsize=4)
        for i, r in enumerate(fig.rows):
            ax.annotate(f"{r[6]:.0f} ms", (i, acc[i]), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        ax.set_ylabel("accuracy (%), 95% interval; median TTFT above")
    elif fig.key == "concurrency":
        xs = [r[0] for r in fig.rows]
        ax.plot(xs, [r[1] for r in fig.rows], marker="o", label="queue answers/s")
        ax.plot(xs, [r[2] for r in fig.rows], marker="o", label="batched answers/s")
        ax2 = ax.twinx()
        ax2.plot(xs, [r[6] for r in fig.rows], ls="--", marker="x", color="gray", label="batched TTFT p50 s")
        ax2.plot(xs, [r[4] for r in fig.rows], ls=":", marker="x", color="black", label="queue TTFT p50 s")
        ax2.set_yscale("log")
        ax2.set_ylabel("TTFT p50 (s)")
        ax2.legend(fontsize=7, loc="center right")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("answers per second")
    elif fig.key == "decode":
        names = [r[0].replace("pcache-rag, cached, ", "").replace(" weights", "") for r in fig.rows]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [r[2] for r in fig.rows], width=0.4, label="ms a token")
        ax.bar([x + 0.2 for x in xs], [r[3] for r in fig.rows], width=0.4, label="weight-streaming floor")
        ax.set_xticks(list(xs), [n.split(" (")[0] for n in names], fontsize=7)
        ax.set_ylabel("ms a generated token")
    elif fig.key == "memory":
        rows = [r for r in fig.rows if r[1] != ""]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r[1] for r in rows], width=0.4, label="formula")
        ax.bar([x + 0.2 for x in xs], [r[2] for r in rows], width=0.4, label="measured")
        ax.set_xticks(list(xs), [r[0] for r in rows])
        ax.set_ylabel("bytes per cached token")
    ax.set_title(fig.title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    f.tight_layout()
    path = out / f"bench-{fig.key}.png"
    f.savefig(path, dpi=110)
    plt.close(f)
    fig.png = path.name


def _cell(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) or (isinstance(v, float) and math.isinf(v)):
        return f"{v:,}" if isinstance(v, int) else "never"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def _x(v: float) -> str:
    return f"{v:.1f}x" if v < 10 else f"{v:.0f}x"


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def headline(figs: list[Figure]) -> list[tuple[str, str]]:
    """The report's headline rows (measure, value), read from the figures' tables."""
    by = {f.key: f for f in figs}
    out: list[tuple[str, str]] = []
    if "length" in by and by["length"].rows:
        f = by["length"]
        c = {name: j for j, name in enumerate(f.columns)}
        rows = f.rows
        sp = [(r[0], r[c["speed-up (host fp16)"]]) for r in rows]
        out.append(("TTFT speed-up, cached (host fp16) vs full prefill", " · ".join(f"{_k(n)}: {_x(v)}" for n, v in sp)))
        pays = [n for n, v in sp if v >= 2]
        if pays:
            below = [f"{_k(n)} {_x(v)}" for n, v in sp if n < min(pays)]
            out.append(("shortest prompt where caching is at least 2x faster",
                        f"{_k(min(pays))} tokens" + (f" (below it: {', '.join(below)})" if below
                                                     else " (the shortest measured)")))
        top = rows[-1]
        out.append((f"at {_k(top[0])} tokens: full prefill, cached, floor",
                    f"{top[1] / 1e3:.2f} s, {top[c['host fp16 ms']]:.0f} ms, {top[c['floor ms']]:.0f} ms"))
        be = [(r[0], r[c["break-even reuses"]]) for r in rows]
        out.append(("reuses after which encoding once pays", " · ".join(f"{_k(n)}: {v}" for n, v in be)))
        if "disk cold ms" in c:
            out.append((f"cold disk against memory at {_k(top[0])}",
                        f"{top[c['disk cold ms']]:.0f} ms vs {top[c['memory ms']]:.0f} ms"))
    if "recompute" in by and by["recompute"].rows:
        out.append(("TTFT speed-up by recompute mode (split path; dense mask)",
                    " · ".join(f"{r[0]}: {_x(r[4])} ({_x(r[5])})" for r in by["recompute"].rows[1:])))
    if "fraction" in by and by["fraction"].rows:
        rows = by["fraction"].rows
        out.append(("TTFT speed-up by cached share of the prompt",
                    " · ".join(f"{r[0]:g}%: {_x(r[4])}" for r in rows)))
    if "size" in by and by["size"].rows:
        rows = by["size"].rows
        for n in sorted({r[2] for r in rows}):
            pts = [r for r in rows if r[2] == n]
            out.append((f"TTFT speed-up by model size at {_k(n)} tokens",
                        " · ".join(f"{r[0]} ({r[1]:.0f}M): {_x(r[5])}" for r in pts)))
    if "encoding" in by and by["encoding"].rows:
        rows = by["encoding"].rows
        best = max(rows, key=lambda r: r[5])
        out.append(("batched encoding", f"best {best[5]:.2f}x per chunk (batch {best[1]}, {best[0]}-token chunks)"
                    if best[5] > 1.05 else f"does not pay here (best {best[5]:.2f}x per chunk)"))
    if "ingest" in by and by["ingest"].rows:
        r = by["ingest"].rows[0]
        out.append(("ingest throughput (eager encoding)", f"{r[4]:.2f} chunks/s, {r[5]:,.0f} tokens/s"))
    if "scaffold" in by and by["scaffold"].rows:
        out.append(("cross-document questions: full / separate / scaffold",
                    " · ".join(f"{r[0]} {r[1]}/{r[2]} ({_x(r[7])})" for r in by["scaffold"].rows)))
    if "concurrency" in by and by["concurrency"].rows:
        rows = by["concurrency"].rows
        out.append(("throughput, continuous batching against the queue",
                    " · ".join(f"{r[0]}: {_x(r[3])}" for r in rows)))
        out.append(("TTFT p50 / p95, batched (queue)",
                    " · ".join(f"{r[0]}: {r[6]:.1f}/{r[7]:.1f} s ({r[4]:.1f}/{r[5]:.1f} s)" for r in rows)))
    if "memory" in by and by["memory"].rows:
        rows = [r for r in by["memory"].rows if r[1] != ""]
        out.append(("bytes per cached token (measured)", " · ".join(f"{r[0]}: {r[2]:,.0f}" for r in rows)))
    return out


def _model_flag(info: dict) -> str:
    """The ``--model`` a report's command line needs (none for the default model)."""
    name = info.get("model", DEFAULT_NAME)
    return "" if name == DEFAULT_NAME else f" --model {name}"


def write_report(figs: list[Figure], info: dict, out: Path, quick: bool, seconds: float,
                 heads: list[tuple[str, str]] | None = None) -> Path:
    lines = ["# pcache-rag benchmarks", "",
             f"Generated by `pcache-rag bench all{' --quick' if quick else ''}{_model_flag(info)} "
             f"--device {info['device']}` on "
             f"{info['date']} in {seconds / 60:.1f} min. Every number is measured in this run on this machine; "
             "every speed-up is against full prefill of the same model and tokens in the same run.", "",
             "| machine | |", "|---|---|",
             f"| model | {info.get('model', DEFAULT_NAME)} |",
             f"| CPU | {info['cpu']} ({info['cores']} cores, torch uses {info['torch_threads']} threads) |",
             f"| GPU | {info['gpu'] or 'none'} |",
             f"| software | Python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, "
             f"pcache-rag {info['pcache_rag']} |", ""]
    if quick:
        lines += ["**Quick run**: tiny sizes that check the harness, not numbers to quote.", ""]
    if not info["gpu"]:
        lines += ["**No GPU in this run.** The device tier, pinned-host to device copies overlapping compute, "
                  "and prefetch of hot documents to a GPU are measured only by `pcache-rag bench all --device cuda` "
                  "on a machine with one (committed as `docs/benchmarks-gpu.md` when such a run has been made). "
                  "GPU numbers are never estimated.", ""]
    lines += ["## Headline", "", "| measure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in (heads if heads is not None else headline(figs))]
    lines.append("")
    for fig in figs:
        lines += [f"## {fig.title}", "", "| " + " | ".join(fig.columns) + " |",
                  "|" + "|".join("---" if i == 0 else "---:" for i in range(len(fig.columns))) + "|"]
        lines += ["| " + " | ".join(_cell(v) for v in r) + " |" for r in fig.rows]
        lines.append("")
        lines += [n + "\n" for n in fig.notes]
        if fig.png:
            lines += [f"![{fig.title}]({fig.png})", ""]
    path = out / "benchmarks.md"
    path.write_text("\n".join(lines))
    return path


def run_all(model_path=None, quick: bool = False, device: str = "cpu", out="docs", kv_url: str | None = None,
            log=print) -> dict:
    """Measure every figure and write ``benchmarks.md``, its PNGs and ``benchmarks.json`` to ``out``."""
    from ..default_model import load_model

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device here (the report never estimates GPU numbers)")
    sz = QUICK if quick else Sizes()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    info = machine(device)
    info["model"] = model_name(model_path)
    model, tok = load_model(model_path, device=device)
    figs: list[Figure] = []
    raw: dict = {"machine": info, "quick": quick}
    with tempfile.TemporaryDirectory(prefix="pcache-benchall-") as tmp:
        work = Path(tmp)
        length, raw["length"] = fig_length(model, tok, sz, device, kv_url, work, log)
        figs.append(length)
        figs.append(fig_fraction(model, tok, sz, device, log))
        figs.append(fig_recompute(model, tok, sz, device, log))
        figs.append(fig_size(tok, sz, device, log))
        enc, thr, raw["ingest"] = fig_encoding(model, tok, sz, device, work, log)
        figs += [enc, thr]
        figs.append(fig_scaffold(model, tok, sz, log))
        figs.append(fig_memory(model, tok, raw["ingest"], log))
        figs.append(fig_concurrency(model, tok, sz, device, log))
        if device == "cpu":  # the decode weights' kernels and floor are measured on the CPU
            figs.append(fig_decode(model_path, sz, log))
    for fig in figs:
        _plot(fig, out)
    seconds = time.perf_counter() - t0
    raw["headline"] = headline(figs)
    md = write_report(figs, info, out, quick, seconds, raw["headline"])
    raw["figures"] = {f.key: {"title": f.title, "columns": f.columns, "rows": f.rows, "notes": f.notes, "png": f.png}
                      for f in figs}
    raw["seconds"] = seconds
    (out / "benchmarks.json").write_text(json.dumps(raw, indent=1, default=str))
    log(f"wrote {md} and {len(figs)} plots in {seconds:.0f} s")
    return raw
