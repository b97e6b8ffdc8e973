"""Decode speed through every caller, quiet and beside busy processes, in one run.

Issue 57 asks that the fused step degrade no worse than the stock step under load *in every
caller's thread*: a request alone through ``PromptCache.generate``, the LangChain connector's
``invoke`` (the caller's thread) and ``ainvoke`` (an executor thread), and ``CachedRAG.answer``.
For each caller this times the same requests quiet, then again while ``--busy`` single-threaded
busy-loop processes run (started here), and prints ms a generated token (the engine's own
TTFT subtracted; for ``invoke``/``ainvoke`` from the call's wall time and the TTFT in its
``response_metadata``) with its busy/quiet ratio, beside the same figure for the stock
transformers step (``fused_decode=False``) on the PromptCache row.

    .venv/bin/python scripts/measure-callers.py [--busy 2] [--tokens 32] [--repeats 3]

The RAG row needs the demo's index (``make demo`` builds it); without it the row is skipped,
said by name.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from pcache_rag.measure.decode_bench import busy_processes, cpu_line

QUESTION = "Using the document above, what does this module do, and how is it used?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    from langchain_core.messages import HumanMessage
    from langchain_pcache import ChatPromptCache

    from pcache_rag.default_model import load_model
    from pcache_rag.docmodules import format_documents
    from pcache_rag.engine import Parts, PromptCache
    from pcache_rag.fsutil import cache_home
    from pcache_rag.rag import CachedRAG, Index
    from pcache_rag.samples import QUESTIONS, stdlib_docs

    import torch

    torch_threads = torch.get_num_threads()  # the stock row runs at torch's own count (see below)
    cpu = cpu_line()
    m, tok = load_model(None)
    _, text = next((n, t) for n, t in stdlib_docs(min_chars=8000) if len(t) > 4000)
    doc = tok.decode(tok(text, add_special_tokens=False)["input_ids"][:1000])
    rows: dict[str, dict] = {}

    def engine_row(name: str, pc: PromptCache) -> None:
        pc.eos_ids = set()
        ids = tok(doc, add_special_tokens=False)["input_ids"]
        kv = pc.encoder.encode(ids, list(range(len(ids))))
        q = tok(f"\n{QUESTION}\nAnswer:", add_special_tokens=False)["input_ids"]
        pc.generate(Parts([("doc", kv)], q), max_new_tokens=2)

        def one() -> float:
            o = pc.generate(Parts([("doc", kv)], q), max_new_tokens=a.tokens)
            return (o.total_s - o.ttft_s) / (len(o.token_ids) - 1) * 1e3
        rows[name] = {"fn": one}

    m2, _ = load_model(None)
    engine_row("PromptCache.generate, stock step (fused_decode=False)", PromptCache(m2, tok, fused_decode=False))
    # the fused step sets its decoding thread's OpenMP team to the CPUs it finds free; the stock
    # step is the baseline, so it gets torch's own count back before each of its answers
    stock_fn = rows["PromptCache.generate, stock step (fused_decode=False)"]["fn"]

    def stock_own_threads() -> float:
        torch.set_num_threads(torch_threads)
        return stock_fn()
    rows["PromptCache.generate, stock step (fused_decode=False)"]["fn"] = stock_own_threads
    engine_row("PromptCache.generate, fused bf16 step", PromptCache(m, tok, decode_weights="bf16"))

    llm = ChatPromptCache(max_tokens=a.tokens)
    msgs = [HumanMessage(f"Documents:\n\n{format_documents([doc])}\n\nQuestion: {QUESTION}")]
    llm.invoke(msgs)  # learns the document

    def per_token(res, wall: float) -> float:
        meta = res.response_metadata
        return (wall - meta["ttft_s"]) / max(meta["output_tokens"] - 1, 1) * 1e3

    def invoke() -> float:
        t = time.perf_counter()
        res = llm.invoke(msgs)
        return per_token(res, time.perf_counter() - t)

    loop = asyncio.new_event_loop()  # one loop for every call, as an application has

    def ainvoke() -> float:
        async def go():
            t = time.perf_counter()
            res = await llm.ainvoke(msgs)
            return per_token(res, time.perf_counter() - t)
        return loop.run_until_complete(go())

    rows["ChatPromptCache.invoke (LangChain, caller's thread)"] = {"fn": invoke}
    rows["ChatPromptCache.ainvoke (LangChain, executor thread)"] = {"fn": ainvoke}

    index_dir = cache_home() / "demo-index"
    if (index_dir / "kv").exists():
        index = Index(index_dir)
        rag = CachedRAG(index, pc=index.engine(None), k=4)
        handles = rag.retrieve(QUESTIONS[0])

        def answer() -> float:
            o = rag.answer(QUESTIONS[0], handles=handles, max_new_tokens=a.tokens).output
            return (o.total_s - o.ttft_s) / max(len(o.token_ids) - 1, 1) * 1e3
        answer()
        rows["CachedRAG.answer (demo index, k=4)"] = {"fn": answer}
    else:
        print(f"CachedRAG row skipped: no demo index at {index_dir} (run `make demo` first)")

    for r in rows.values():
        r["quiet"] = statistics.median(r["fn"]() for _ in range(a.repeats))
    with busy_processes(a.busy):
        for r in rows.values():
            r["busy"] = statistics.median(r["fn"]() for _ in range(a.repeats))
    stock = rows["PromptCache.generate, stock step (fused_decode=False)"]
    print(cpu)
    print(f"ms a generated token, quiet and beside {a.busy} single-threaded busy processes; medians of {a.repeats}")
    print(f"{'':58} {'quiet':>7} {'busy':>7} {'busy/quiet':>11} {'busy vs stock busy':>19}")
    for name, r in rows.items():
        print(f"{name:58} {r['quiet']:7.1f} {r['busy']:7.1f} {r['busy'] / r['quiet']:10.2f}x "
              f"{r['busy'] / stock['busy']:18.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
