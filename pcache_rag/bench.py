"""Benchmarks that report measured numbers side by side with the baseline of the same run.

``ttft``: for each prompt length, a schema of ~500-token document modules
filling all but a 32-token question, and three timings, medians of ``repeats``
runs in one process:

* full prefill: one causal forward over the same tokens (the baseline);
* cached: ``PromptCache.prefill`` with a cold workspace (every module copied
  in, as for a prompt whose documents were not in the buffers);
* floor: the forward of the uncached tokens alone against an already
  assembled cache (nothing to copy).

The text comes from the documentation of Python's standard library, rendered
by ``pydoc`` on this machine, so the project ships no third-party prose.
"""

from __future__ import annotations

import importlib
import pydoc
import statistics
import time
import warnings

from .pml import escape

_DOC_MODULES = (
    "json", "os", "re", "collections", "functools", "itertools", "argparse", "logging", "pathlib",
    "subprocess", "typing", "dataclasses", "asyncio", "threading", "socket", "email", "http.client",
    "unittest", "sqlite3", "csv", "datetime", "decimal", "random", "statistics", "textwrap", "string",
    "shutil", "tempfile", "zipfile", "tarfile", "heapq", "bisect", "contextlib", "inspect", "abc",
)

QUESTION = "Using the documents above, what does the json module do, and how do I read a file with it?"


def stdlib_docs(min_chars: int = 0, modules=_DOC_MODULES) -> list[tuple[str, str]]:
    """``(module name, plain-text pydoc page)`` for standard-library modules."""
    out = []
    total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in modules:
            try:
                mod = importlib.import_module(name)
            except ImportError:  # pragma: no cover - stdlib modules are present
                continue
            text = pydoc.render_doc(mod, renderer=pydoc.plaintext)
            out.append((name, text))
            total += len(text)
            if min_chars and total >= min_chars:
                break
    return out


def doc_schema(pc, name: str, total_tokens: int, question_tokens: int = 32, chunk: int = 500):
    """A schema of document modules laid out to ``total_tokens - question_tokens`` positions,
    and a prompt importing them all plus a question padded/cut to ``question_tokens``."""
    tok = pc.tokenizer
    ids: list[int] = []
    for _, text in stdlib_docs(min_chars=total_tokens * 6):
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        if len(ids) > total_tokens * 2:
            break
    system = "<system>Answer the question from the documents.</system>"
    head = pc.tokenizer(pc.chat.wrap("system", "Answer the question from the documents."), add_special_tokens=False)
    budget = total_tokens - question_tokens - len(head["input_ids"])
    mods = []
    pos = 0
    i = 0
    while pos < budget - 8:
        piece = ids[pos : pos + min(chunk, budget - pos)]
        text = tok.decode(piece)
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        while n > budget - pos and len(piece) > 1:  # decode/encode may not round-trip exactly
            piece = piece[:-1]
            text = tok.decode(piece)
            n = len(tok(text, add_special_tokens=False)["input_ids"])
        mods.append(f'<module name="d{i}">{escape(text)}</module>')
        pos += n
        i += 1
    schema = f'<schema name="{name}">{system}{"".join(mods)}</schema>'
    q_ids = tok(QUESTION, add_special_tokens=False)["input_ids"]
    wrap = len(tok(pc.chat.wrap("user", "") + pc.chat.generation_prompt, add_special_tokens=False)["input_ids"])
    want = max(1, question_tokens - wrap)
    q_ids = (q_ids * (want // max(1, len(q_ids)) + 1))[:want]
    question = tok.decode(q_ids)
    imports = "".join(f"<d{k}/>" for k in range(i))
    prompt = f'<prompt schema="{name}">{imports}<user>{escape(question)}</user></prompt>'
    return schema, prompt


def _median(fn, repeats: int) -> float:
    xs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs)


def bench_ttft(pc, lengths=(512, 1024, 2048, 4096, 8192), repeats: int = 3, question_tokens: int = 32, log=print):
    """Run the TTFT sweep; returns a list of row dicts."""
    rows = []
    need = max(lengths) + 64
    pc.workspace.ensure(need)
    for n in lengths:
        if n > pc.max_positions:
            log(f"skip {n}: the model takes at most {pc.max_positions} positions")
            continue
        schema, prompt = doc_schema(pc, f"bench{n}", n, question_tokens)
        pc.add_schema(schema)
        res = pc.prefill(prompt)  # warm-up, and the token ids for the baseline

        def cached():
            pc.workspace.invalidate()
            pc.prefill(prompt)

        def floor():
            r = pc.prefill(prompt)  # assembly is a no-op: the same units are resident
            assert r.copied_tokens == 0, "floor must not copy"
            floor_fwd.append(r.forward_s)

        floor_fwd: list[float] = []
        full = _median(lambda: pc.full_prefill(res.input_ids), repeats)
        t_cached = _median(cached, repeats)
        pc.prefill(prompt)
        _median(floor, repeats)
        t_floor = statistics.median(floor_fwd)
        base = pc.full_prefill(res.input_ids)
        row = {
            "tokens": int(res.input_ids.shape[0]),
            "cached_tokens": res.cached_tokens,
            "computed_tokens": res.computed_tokens,
            "full_prefill_s": round(full, 4),
            "cached_s": round(t_cached, 4),
            "floor_s": round(t_floor, 4),
            "speedup": round(full / t_cached, 1),
            "cached_over_floor": round(t_cached / t_floor, 3),
            "same_next_token": int(base.argmax()) == int(res.logits.argmax()),
        }
        rows.append(row)
        log(
            f"{row['tokens']:>6} tok  full {full:8.3f}s  cached {t_cached:7.3f}s  floor {t_floor:7.3f}s  "
            f"x{row['speedup']:<6} cached/floor {row['cached_over_floor']:.2f}  same token: {row['same_next_token']}"
        )
    return rows


def _drop_page_cache(directory) -> None:
    """Ask the kernel to forget cached pages of every file under ``directory`` (no root needed)."""
    import os
    from pathlib import Path

    for f in Path(directory).rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd) if os.access(f, os.W_OK) else None
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def bench_store(model_path=None, tokens: int = 4096, repeats: int = 3, directory=None, log=print) -> dict:
    """Bytes per cached token vs the formula, disk load throughput, and TTFT from each tier
    (memory fp32, host fp16, disk with warm and cold page cache) against full prefill, one run."""
    import tempfile

    import torch

    from .default_model import load_model
    from .engine import PromptCache
    from .store import DiskTier, MemoryTier, TieredStore

    model, tok = load_model(model_path)
    tmp = tempfile.mkdtemp(prefix="pcache-bench-") if directory is None else directory
    out: dict = {"tokens": tokens}

    # Engine's in-memory baseline: states kept in the model's dtype.
    mem = PromptCache(model, tok, store_dtype=None, max_tokens=tokens + 64)
    schema, prompt = doc_schema(mem, "store", tokens)
    mem.add_schema(schema)
    res = mem.prefill(prompt)
    full = _median(lambda: mem.full_prefill(res.input_ids), repeats)

    def ttft(pc, before=None) -> float:
        xs = []
        for _ in range(repeats):
            if before:
                before()
            pc.workspace.invalidate()
            t = time.perf_counter()
            pc.prefill(prompt)
            xs.append(time.perf_counter() - t)
        return statistics.median(xs)

    t_mem = ttft(mem)
    host = MemoryTier("cpu", name="host")
    disk = DiskTier(tmp)
    pc = PromptCache(model, tok, store=TieredStore([host, disk]), max_tokens=tokens + 64)
    pc.add_schema(schema)
    keys = list(pc._schemas["store"].keys.values())
    t_host = ttft(pc)

    def evict_host():
        for k in keys:
            host.remove(k)

    t_warm = ttft(pc, evict_host)

    def evict_cold():
        evict_host()
        _drop_page_cache(tmp)

    t_cold = ttft(pc, evict_cold)

    # bytes per token, and raw disk load throughput
    shape = pc.adapter.kv_shape
    kvs = [disk.get(k) for k in keys]
    n_tok = sum(kv.length for kv in kvs)
    n_bytes = sum(kv.nbytes() for kv in kvs)
    t0 = time.perf_counter()
    for k in keys:
        disk.get(k)
    warm_s = time.perf_counter() - t0
    _drop_page_cache(tmp)
    t0 = time.perf_counter()
    for k in keys:
        disk.get(k)
    cold_s = time.perf_counter() - t0
    out.update(
        {
            "bytes_per_token_fp16": round(n_bytes / n_tok, 1),
            "formula_fp16": shape.bytes_per_token(2),
            "formula_fp32": shape.bytes_per_token(4),
            "bytes_per_token_fp32": mem.store.get(mem._schemas["store"].keys["d0"]).nbytes()
            / mem.store.get(mem._schemas["store"].keys["d0"]).length,
            "disk_load_MBps_warm": round(n_bytes / warm_s / 1e6, 1),
            "disk_load_MBps_cold": round(n_bytes / cold_s / 1e6, 1),
            "full_prefill_s": round(full, 3),
            "ttft_memory_fp32_s": round(t_mem, 4),
            "ttft_host_fp16_s": round(t_host, 4),
            "ttft_disk_warm_s": round(t_warm, 4),
            "ttft_disk_cold_s": round(t_cold, 4),
            "device_tier": "not run (no CUDA on this machine)" if not torch.cuda.is_available() else "see below",
        }
    )
    out["host_over_memory"] = round(t_host / t_mem, 2)
    out["speedup_disk_warm"] = round(full / t_warm, 1)
    out["speedup_disk_cold"] = round(full / t_cold, 1)
    log(
        f"bytes/token fp16 {out['bytes_per_token_fp16']} (formula {out['formula_fp16']}), "
        f"fp32 {out['bytes_per_token_fp32']:.0f} (formula {out['formula_fp32']})\n"
        f"disk load {out['disk_load_MBps_warm']} MB/s warm, {out['disk_load_MBps_cold']} MB/s cold\n"
        f"{tokens} tokens: full prefill {full:.2f}s | memory fp32 {t_mem * 1e3:.0f} ms | host fp16 {t_host * 1e3:.0f} ms "
        f"(x{out['host_over_memory']} of memory) | disk warm {t_warm * 1e3:.0f} ms (x{out['speedup_disk_warm']} vs full) | "
        f"disk cold {t_cold * 1e3:.0f} ms (x{out['speedup_disk_cold']})"
    )
    pc.store.close()
    return out
