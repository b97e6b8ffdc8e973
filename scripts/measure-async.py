"""Eight async calls on one ``ChatPromptCache``: one after another, then all at once, in one run.

The issue-61 measurement: eight questions (the embedded model, up to ``--max-tokens`` greedy
tokens each) through ``await llm.ainvoke(q)`` one at a time, then through
``asyncio.gather(*(llm.ainvoke(q) ...))``. The concurrent calls join the engine's continuous
batch (:func:`pcache_rag.connector.share_batch`); the sequential ones run first, before it
starts, as they did before. Prints both wall times, their ratio, and whether every answer is
identical.

    .venv/bin/python scripts/measure-async.py [--max-tokens 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "connectors" / "langchain-pcache"))

QUESTIONS = [f"Write two sentences about {w}." for w in
             ("rivers", "bread", "copper", "owls", "trains", "snow", "violins", "maps")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import tempfile

    from langchain_pcache import ChatPromptCache

    llm = ChatPromptCache(cache_dir=tempfile.mkdtemp(prefix="pcache-async-"), max_tokens=a.max_tokens)
    llm.invoke("warm up")

    async def one_by_one():
        return [await llm.ainvoke(q) for q in QUESTIONS]

    async def together():
        return await asyncio.gather(*(llm.ainvoke(q) for q in QUESTIONS))

    # the sequential calls first, before the batch exists: as every async call ran before
    asm = llm._asm()
    t0 = time.perf_counter()
    seq = [llm.invoke(q) for q in QUESTIONS]
    seq_s = time.perf_counter() - t0
    assert asm.pc.batch_stats() is None
    t0 = time.perf_counter()
    con = asyncio.run(together())
    con_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    seq_b = asyncio.run(one_by_one())  # one at a time again, now through the batch (a batch of one)
    seq_b_s = time.perf_counter() - t0
    same = [m.content for m in con] == [m.content for m in seq] == [m.content for m in seq_b]
    tokens = sum(m.usage_metadata["output_tokens"] for m in con)
    stats = asm.pc.batch_stats()
    print(f"8 calls, {tokens} tokens: one after another {seq_s:.2f} s (invoke, no batch), {seq_b_s:.2f} s (ainvoke "
          f"awaited one at a time, through the batch); all at once {con_s:.2f} s = {con_s / seq_s:.2f}x and "
          f"{con_s / seq_b_s:.2f}x; answers identical: {same}; most decoding together: {stats['max_batch_seen']}")
    if a.json:
        Path(a.json).write_text(json.dumps({"sequential_s": seq_s, "sequential_ainvoke_s": seq_b_s,
                                            "concurrent_s": con_s, "ratio": con_s / seq_s, "identical": same,
                                            "output_tokens": tokens, "max_batch_seen": stats["max_batch_seen"],
                                            "max_tokens": a.max_tokens}, indent=1) + "\n")


if __name__ == "__main__":
    main()
