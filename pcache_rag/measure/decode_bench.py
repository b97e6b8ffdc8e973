"""``bench decode``: what a whole answer costs once the prompt is read, in one run.

For one RAG prompt (a ~1,000-token document read from the cache, then a question) it times,
each a median of ``repeats`` runs in one process:

* stock transformers ``generate`` on the same prompt's text (fp32, full prefill, its own
  cache): the baseline a newcomer would otherwise get;
* the cached path decoding through transformers' own forward (``fused_decode=False``: the
  step every answer took before the fused step);
* the cached path with the fused decode step (:mod:`pcache_rag.models.decode_step`, the
  default) in fp32, and with each smaller decode-weight format, on a fresh copy of the model each;

and reports, for each: time-to-first-token, milliseconds a generated token, and the whole
answer (TTFT + ``new_tokens`` tokens), beside the **weight-streaming floor** of its format:
the bytes of linear weights one token reads, over this machine's read bandwidth (a sum over a
tensor of the fp32 weights' size), read just before and just after that row's timing: the
bandwidth of a shared machine moves from minute to minute (28-54 GB/s here), so a floor read
minutes earlier says little; the higher of the two readings gives the stricter floor. Every row decodes exactly
``new_tokens`` tokens (end tokens are not honoured while timing), and every row's greedy
tokens are compared with the stock step's (``same_tokens``).

Then each cached row decodes ``together`` answers at once (:meth:`PromptCache.generate_batch`,
the continuous batch a server runs: the fused step's many-sequence form, or transformers' ragged
forward without it): milliseconds a step (every answer's next token), tokens a second over all
answers, and how many answers equal the same question's answer decoded alone.

``busy=N`` then starts N single-threaded busy-loop processes (each spinning on one core, as a
neighbour's job would) and times every row again while they run, so a row's quiet and busy
figures come from one process and one run, beside the stock step's. The header names the CPU's
instruction set and the kernel variant each fused row ran on (``PCACHE_RAG_KERNELS=avx2``
shows the AVX2 path on an AVX-512 machine).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..samples import stdlib_docs

QUESTION = "Using the document above, what does this module do, and how is it used?"


def read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes a second this machine reads: the median time of a sum over ``nbytes`` of float32."""
    big = torch.ones(nbytes // 4)
    big.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


@contextlib.contextmanager
def busy_processes(n: int):
    """``n`` single-threaded busy-loop processes running until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
             for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)  # let the scheduler see them
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


#: the environment variables that cap what instructions torch's kernels, MKL, oneDNN, fbgemm and the decode
#: kernels use (how an AVX-512 machine runs the code an AVX2-only CPU runs); a run's report names those set
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS",
            "PCACHE_RAG_KERNELS")


def isa_caps() -> dict[str, str]:
    """The :data:`ISA_CAPS` this process runs under (name -> value), those set only."""
    return {k: os.environ[k] for k in ISA_CAPS if k in os.environ}


def cpu_line() -> str:
    """The CPU's vector features and the kernel variant the fused rows run on."""
    from ..models import kernels

    flags = set(kernels.cpu_flags().split())
    feats = [f for f in ("avx512f", "avx512bw", "avx2", "fma", "asimd") if f in flags]
    want = kernels.wanted()
    forced = f" ({kernels.ENV}={want})" if os.environ.get(kernels.ENV) else ""
    return (f"CPU: {kernels.cpu_variant()} ({' '.join(feats) or 'no vector features reported'}); decode kernels: "
            f"{want or 'off'}{forced}; {kernels.threads()} threads now")


class Floor(NamedTuple):
    """What one decoded token must read, as time at this machine's read bandwidth."""

    weights_ms: float  # the decode step's weights
    gb_s: float  # the read bandwidth it was measured at
    kv_ms_per_1000: float  # attention's read of float32 keys and values, per 1,000 cached positions

    def with_cache_ms(self, positions: int) -> float:
        """The floor of a token attending to ``positions`` cached positions."""
        return self.weights_ms + self.kv_ms_per_1000 * positions / 1000


def step_floor(pc) -> Floor | None:
    """The :class:`Floor` of ``pc``'s fused decode step, with the read bandwidth measured now
    (about a second); None when the engine decodes with the stock step."""
    step = getattr(pc.core.decoder, "step", None)
    if step is None:
        return None
    bw = read_bandwidth(max(step.nbytes, 256 << 20))
    s = pc.core.adapter.kv_shape
    kv_per_1000 = 1000 * s.n_layers * s.n_kv_heads * (s.head_dim + s.head_dim_v) * 4  # float32 rows
    return Floor(step.nbytes / bw * 1e3, bw / 1e9, kv_per_1000 / bw * 1e3)


def bench_decode(model=None, formats=("int8", "bf16"), new_tokens: int = 64, doc_tokens: int = 1000,
                 repeats: int = 3, together=(4, 8), busy: int = 0, log=print) -> dict:
    """The rows described in the module docstring, as a dict (also logged as a table)."""
    from ..default_model import load_model
    from ..engine import PromptCache
    from ..docmodules import Assembler, format_documents
    from ..models import kernels

    m, tok = load_model(model)
    name, text = next((n, t) for n, t in stdlib_docs(min_chars=doc_tokens * 8) if len(t) > doc_tokens * 4)
    doc = tok.decode(tok(text, add_special_tokens=False)["input_ids"][:doc_tokens])
    turns = [("user", f"Documents:\n\n{format_documents([doc])}\n\nQuestion: {QUESTION}")]
    linear_bytes = sum(x.weight.numel() * x.weight.element_size() for x in m.modules()
                       if isinstance(x, torch.nn.Linear))
    bw = read_bandwidth(linear_bytes)
    cpu = cpu_line()  # before any busy process starts
    rows: list[dict] = []

    # stock transformers on the prompt's text: full prefill, its own cache
    plain = tok.apply_chat_template([{"role": r, "content": c.replace("\ue000", "").replace("\ue001", "")}
                                     for r, c in turns], add_generation_prompt=True, return_tensors="pt",
                                    return_dict=True)["input_ids"]
    gen = dict(do_sample=False, pad_token_id=tok.eos_token_id)

    @torch.no_grad()
    def stock() -> tuple[float, float]:
        ttft = statistics.median(_timed(lambda: m.generate(plain, max_new_tokens=1, **gen)) for _ in range(repeats))
        whole = statistics.median(_timed(lambda: m.generate(plain, min_new_tokens=new_tokens,
                                                            max_new_tokens=new_tokens, **gen))
                                  for _ in range(repeats))
        return ttft, whole

    with torch.no_grad():
        m.generate(plain, max_new_tokens=2, **gen)
    timers: list[Callable[[], tuple[float, float]]] = [stock]  # each row's (TTFT, whole answer) again
    rows.append(_beside(lambda: _row("transformers generate (fp32, full prefill)", *stock(), new_tokens,
                                     linear_bytes), linear_bytes))
    stock_tokens: list[int] | None = None
    for fmt, fused in ((None, False), (None, True), *((f, True) for f in formats)):
        mm, _ = load_model(model)
        pc = PromptCache(mm, tok, decode_weights=fmt, fused_decode=fused)
        rep = pc.decode_report
        if fmt is not None and (rep is None or rep.fmt != fmt):
            log(f"{fmt}: refused ({rep.refused if rep else 'no report'})")
            continue
        if fused and not pc.core.decode_path.startswith("fused"):
            log(f"{fmt or 'fp32'} fused step: refused ({pc.core.decode_path})")
            continue
        pc.eos_ids = set()  # every row decodes exactly new_tokens tokens
        asm = Assembler(pc, conditioning="none")
        segs = asm.message_segments(turns)
        asm.generate(segs, max_new_tokens=2)  # encodes the document once

        def answers(asm=asm, segs=segs) -> list:
            return [asm.generate(segs, max_new_tokens=new_tokens).output for _ in range(repeats)]

        before = read_bandwidth(linear_bytes)
        outs = answers()
        after = read_bandwidth(linear_bytes)
        ttft, whole = _medians(outs)

        def again(answers=answers) -> tuple[float, float]:
            return _medians(answers())

        timers.append(again)
        nbytes = linear_bytes if fmt is None else rep.small_bytes  # type: ignore[union-attr]
        label = (f"pcache-rag, cached, fused step, {fmt or 'fp32'} weights" if fused
                 else "pcache-rag, cached, transformers step, fp32 weights")
        if stock_tokens is None:
            stock_tokens = outs[0].token_ids
        row = _floored(_row(label, ttft, whole, new_tokens, nbytes), before, after)
        row["same_tokens"] = sum(a == b for a, b in zip(outs[0].token_ids, stock_tokens)) / max(len(stock_tokens), 1)
        row["decode_path"] = pc.core.decode_path
        row["together"] = _together(pc, tok, tok(doc, add_special_tokens=False)["input_ids"], together, new_tokens,
                                    repeats)
        rows.append(row)
    if busy:
        with busy_processes(busy):
            for r, timer in zip(rows, timers):
                ttft, whole = timer()
                r["busy_ms_per_token"] = (whole - ttft) / (new_tokens - 1) * 1e3
                r["busy_answer_s"] = whole
                r["busy_threads"] = kernels.threads()
    base = rows[0]
    log(cpu)
    log(f"decode, one run: a {doc_tokens}-token document ({name}) and a question; {new_tokens} new tokens; "
        f"medians of {repeats}; read bandwidth {bw / 1e9:.1f} GB/s")
    log("each row's floor is at the higher of the bandwidths read just before and just after its timing (GB/s)")
    log(f"{'':56} {'TTFT':>8} {'ms/token':>9} {'GB/s':>11} {'floor':>7} {'x floor':>8} {'answer':>8} {'vs stock':>9} "
        f"{'same tokens':>12}")
    for r in rows:
        same = f"{r['same_tokens']:.0%}" if "same_tokens" in r else ""
        read = "-".join(f"{g:.0f}" for g in r["bandwidth_gb_s"])
        log(f"{r['name']:56} {r['ttft_s'] * 1e3:7.0f}ms {r['ms_per_token']:9.1f} {read:>11} {r['floor_ms']:7.1f} "
            f"{r['ms_per_token'] / r['floor_ms']:8.1f} {r['answer_s']:7.2f}s {base['answer_s'] / r['answer_s']:8.1f}x "
            f"{same:>12}")
    if busy:
        step = next(r for r in rows if r["name"].endswith("transformers step, fp32 weights"))
        log(f"with {busy} single-threaded busy processes beside it (started by this run): ms a token quiet and busy; "
            f"busy against the cached transformers step's busy {step['busy_ms_per_token']:.1f} ms")
        log(f"{'':56} {'quiet':>8} {'busy':>8} {'busy/quiet':>11} {'vs step busy':>13} {'threads':>8}")
        for r in rows:
            log(f"{r['name']:56} {r['ms_per_token']:8.1f} {r['busy_ms_per_token']:8.1f} "
                f"{r['busy_ms_per_token'] / r['ms_per_token']:10.2f}x "
                f"{r['busy_ms_per_token'] / step['busy_ms_per_token']:12.2f}x {r['busy_threads']:>8}")
    if together:
        log(f"several answers decoding together (one document, {new_tokens} new tokens each): ms a step, tokens/s over "
            "all answers, answers equal to their own decoded alone")
        log(f"{'':56} " + " ".join(f"{f'{m} answers':>24}" for m in together))
        for r in rows[1:]:
            log(f"{r['name']:56} " + " ".join(f"{t['ms_per_step']:6.1f}ms {t['tokens_per_s']:6.0f}/s {t['identical']:>7}"
                                             for t in r["together"]))
    return {"bandwidth_gb_s": bw / 1e9, "new_tokens": new_tokens, "doc_tokens": doc_tokens, "rows": rows,
            "cpu": cpu, "cpu_variant": kernels.cpu_variant(), "kernels": kernels.wanted(), "busy": busy}


def _together(pc, tok, doc_ids: list[int], counts, new_tokens: int, repeats: int) -> list[dict]:
    """``pc`` decoding ``m`` answers at once, for each ``m`` of ``counts``: one cached document,
    a question of each answer's own (see the module docstring)."""
    from ..engine import Parts

    if not counts:
        return []
    kv = pc.encoder.encode(doc_ids, list(range(len(doc_ids))))
    qs = [tok(f"\nQuestion {i + 1}: {QUESTION}\nAnswer:", add_special_tokens=False)["input_ids"]
          for i in range(max(counts))]
    alone = [pc.generate(Parts([("doc", kv)], q), max_new_tokens=new_tokens).token_ids for q in qs]
    out = []
    for m in counts:
        reqs = [Parts([("doc", kv)], q) for q in qs[:m]]
        pc.generate_batch(reqs, max_new_tokens=2)
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            outs = pc.generate_batch(reqs, max_new_tokens=new_tokens)
            runs.append((time.perf_counter() - t, outs))
        wall, outs = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        first = max(o.ttft_s for o in outs)  # every answer's first token is out: from here on all decode
        out.append({"answers": m, "ms_per_step": (wall - first) / (new_tokens - 1) * 1e3,
                    "tokens_per_s": m * new_tokens / wall,
                    "identical": f"{sum(o.token_ids == a for o, a in zip(outs, alone))}/{m}"})
    return out


def _medians(outs: list) -> tuple[float, float]:
    """The median TTFT and whole-answer seconds of ``outs``."""
    return statistics.median(o.ttft_s for o in outs), statistics.median(o.total_s for o in outs)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _row(name: str, ttft: float, whole: float, n: int, nbytes: int) -> dict:
    return {"name": name, "ttft_s": ttft, "answer_s": whole, "ms_per_token": (whole - ttft) / (n - 1) * 1e3,
            "weight_bytes": nbytes}


def _floored(row: dict, before: float, after: float) -> dict:
    """``row`` with its weight-streaming floor at the higher of the read bandwidths measured just
    ``before`` and just ``after`` its timing (bytes a second): the bandwidth moves from minute to
    minute on a shared machine, and the higher reading gives the stricter floor."""
    row["bandwidth_gb_s"] = [before / 1e9, after / 1e9]
    row["floor_ms"] = row["weight_bytes"] / max(before, after) * 1e3
    return row


def _beside(timed: Callable[[], dict], nbytes: int) -> dict:
    """The row ``timed`` returns, floored by bandwidths read around it (:func:`_floored`)."""
    before = read_bandwidth(nbytes)
    row = timed()
    return _floored(row, before, read_bandwidth(nbytes))
