"""Benchmarks that report measured numbers side by side with the baseline of the same run.

* ``ttft``: cached prefill vs full prefill across prompt lengths (below);
* ``store``: bytes per cached token vs the formula, disk throughput, TTFT per tier;
* ``rag``: end-to-end TTFT (retrieve + assemble + first token) vs the same pipeline with
  full prefill of the same retrieved text;
* ``quality``: answer-contained accuracy, cached encodings vs full prefill, same questions;
* ``discovery``: finding known chunks in a long unmarked prompt (``bench_discovery``, below).

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

import statistics

from ..pml import escape
from ..samples import stdlib_docs
from .metrics import median

QUESTION = "Using the documents above, what does the json module do, and how do I read a file with it?"


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
        full = median(lambda: pc.core.full_prefill(res.input_ids), repeats)
        t_cached = median(cached, repeats)
        pc.prefill(prompt)
        median(floor, repeats)
        t_floor = statistics.median(floor_fwd)
        base = pc.core.full_prefill(res.input_ids)
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


RAG_MODULES = ("json", "csv", "textwrap", "heapq", "bisect", "shutil", "tempfile", "zipfile", "string", "statistics")
RAG_QUESTIONS = (
    "How do I read rows from a CSV file?",
    "What does textwrap.dedent do?",
    "Which function keeps a list sorted when inserting an item?",
    "How do I copy a whole directory tree?",
    "How can I parse a JSON string into Python objects?",
    "How do I create a temporary directory that is removed automatically?",
)


def bench_rag(model_path=None, index_dir=None, k: int = 4, chunk_tokens: int = 512, repeats: int = 3,
              questions=RAG_QUESTIONS, log=print) -> dict:
    """End-to-end TTFT (retrieve + assemble + first token) vs the same pipeline with full prefill
    of the same retrieved text, on a stdlib-docs corpus; medians over questions and repeats."""
    import tempfile
    from pathlib import Path

    from ..samples import build_corpus
    from ..rag import CachedRAG, Index

    work = Path(index_dir) if index_dir else Path(tempfile.mkdtemp(prefix="pcache-rag-bench-"))
    corpus = build_corpus(work / "corpus", modules=RAG_MODULES)
    index = Index(work / "index")
    pc = index.engine(model_path)
    rag = CachedRAG(index, pc=pc, k=k, chunk_tokens=chunk_tokens)
    rep = rag.ingest([corpus], progress=False)
    log(f"corpus: {rag.index.count()} chunks of <= {chunk_tokens} tokens ({rep.chunks_encoded} encoded in "
        f"{rep.seconds:.0f}s); k={k}; medians of {repeats} runs per question")
    rows = []
    for q in questions:
        rag.answer(q, max_new_tokens=1)  # warm-up: the first read promotes from disk
        cached, full, ret = [], [], []
        for _ in range(repeats):
            a = rag.answer(q, max_new_tokens=1)
            b = rag.answer_full_prefill(q, max_new_tokens=1)
            cached.append(a.ttft_s)
            full.append(b.ttft_s)
            ret.append(a.retrieve_s)
        row = {
            "question": q,
            "prompt_tokens": a.output.cached_tokens + a.output.computed_tokens,
            "computed_tokens": a.output.computed_tokens,
            "retrieve_s": round(statistics.median(ret), 4),
            "cached_ttft_s": round(statistics.median(cached), 4),
            "full_ttft_s": round(statistics.median(full), 4),
        }
        row["speedup"] = round(row["full_ttft_s"] / row["cached_ttft_s"], 1)
        rows.append(row)
        log(f"{row['prompt_tokens']:>5} tok  retrieve {row['retrieve_s'] * 1e3:5.0f} ms  cached {row['cached_ttft_s'] * 1e3:6.0f} ms"
            f"  full prefill {row['full_ttft_s'] * 1e3:7.0f} ms  x{row['speedup']:<5} {q}")
    med = statistics.median(r["speedup"] for r in rows)
    log(f"median speed-up x{med}")
    rag.close()
    return {"k": k, "chunk_tokens": chunk_tokens, "rows": rows, "median_speedup": med}


def discovery_corpus(n: int, seed: int = 0) -> tuple[list[str], str, list[str]]:
    """``n`` random 40-word chunks, a prompt of ~32K characters (~8K tokens) quoting every
    ``n // 10``-th chunk followed by 5,000 loose words, and the quoted chunks in order."""
    import random

    r = random.Random(seed)
    words = [f"w{r.randrange(50_000)}" for _ in range(max(4 * n, 5_000))]
    chunks = [" ".join(words[i * 4 : i * 4 + 40]) + f" chunk {i}." for i in range(n)]
    quoted = [chunks[i] for i in range(0, n, max(1, n // 10))]
    return chunks, "\n\n".join(quoted) + "\n\n" + " ".join(words[:5000]), quoted


def bench_discovery(n: int = 100_000, log=print) -> dict:
    """Time ``KnownTexts.find`` on a ~32K-character prompt against ``n`` known chunks: the first
    lookup (which builds the automaton), a second, and one after a text is added. Each figure
    is one measured run; the baseline is the first lookup of the same run."""
    import time

    from ..discovery import KnownTexts

    chunks, prompt, quoted = discovery_corpus(n)
    kt = KnownTexts()
    t0 = time.perf_counter()
    kt.add(chunks)
    add_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    spans = kt.find(prompt)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = kt.find(prompt)
    second = time.perf_counter() - t0
    kt.add(["A chunk retrieved just now, after the automaton was built: " + chunks[5]])
    t0 = time.perf_counter()
    after = kt.find(prompt)
    after_add = time.perf_counter() - t0
    found = [prompt[a:b] for a, b in spans]
    if found[: len(quoted)] != quoted or again != spans or len(after) != len(spans):
        raise RuntimeError("discovery benchmark: the lookup missed a quoted chunk")  # a wrong result is not timed
    row = {"chunks": n, "prompt_chars": len(prompt), "add_s": add_s, "first_ms": first * 1e3,
           "again_ms": second * 1e3, "after_add_ms": after_add * 1e3}
    log(f"discovery: {len(prompt):,} characters against {n:,} known chunks: adding them {add_s:.1f} s, first "
        f"lookup (builds the automaton) {first * 1e3:,.0f} ms, again {second * 1e3:.1f} ms, after adding one text "
        f"{after_add * 1e3:.1f} ms")
    return row
