"""Benchmarks that report measured numbers side by side with the baseline of the same run.

* ``ttft``: cached prefill vs full prefill across prompt lengths (below);
* ``store``: bytes per cached token vs the formula, disk throughput, TTFT per tier;
* ``rag``: end-to-end TTFT (retrieve + assemble + first token) vs the same pipeline with
  full prefill of the same retrieved text;
* ``quality``: answer-contained accuracy, cached encodings vs full prefill, same questions.

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
import time

from ..pml import escape
from ..samples import stdlib_docs
from .metrics import drop_page_cache, median

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
        full = median(lambda: pc.full_prefill(res.input_ids), repeats)
        t_cached = median(cached, repeats)
        pc.prefill(prompt)
        median(floor, repeats)
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


def bench_store(model_path=None, tokens: int = 4096, repeats: int = 3, directory=None, log=print,
                kv_url: str | None = None) -> dict:
    """Bytes per cached token vs the formula, disk load throughput, and TTFT from each tier
    (memory fp32, host fp16 and int8, disk with warm and cold page cache, and the Redis
    tier at ``kv_url`` when given) against full prefill, one run."""
    import tempfile

    import torch

    from ..default_model import load_model
    from ..engine import PromptCache
    from ..store import DiskTier, MemoryTier, TieredStore

    model, tok = load_model(model_path)
    tmp = tempfile.mkdtemp(prefix="pcache-bench-") if directory is None else directory
    out: dict = {"tokens": tokens}

    # Engine's in-memory baseline: states kept in the model's dtype.
    mem = PromptCache(model, tok, store_dtype=None, max_tokens=tokens + 64)
    schema, prompt = doc_schema(mem, "store", tokens)
    mem.add_schema(schema)
    res = mem.prefill(prompt)
    full = median(lambda: mem.full_prefill(res.input_ids), repeats)

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
    keys = list(pc.unit_keys("store").values())
    t_host = ttft(pc)

    def evict_host():
        for k in keys:
            host.remove(k)

    t_warm = ttft(pc, evict_host)

    def evict_cold():
        evict_host()
        drop_page_cache(tmp)

    t_cold = ttft(pc, evict_cold)

    # int8 states (KIVI-style) from the host tier: half the bytes, dequantized while copied in
    pc8 = PromptCache(model, tok, store=TieredStore([MemoryTier("cpu", name="host")]), store_dtype="int8",
                      max_tokens=tokens + 64)
    pc8.add_schema(schema)
    kvs8 = [pc8.store.get(k) for k in pc8.unit_keys("store").values()]
    t_host8 = ttft(pc8)
    out["bytes_per_token_int8"] = round(sum(kv.nbytes() for kv in kvs8) / sum(kv.length for kv in kvs8), 1)
    out["ttft_host_int8_s"] = round(t_host8, 4)
    del pc8, kvs8

    if kv_url:  # the remote tier: host emptied before each run, no disk, so every unit comes from Redis
        import uuid

        from ..store import RemoteTier

        host_r = MemoryTier("cpu", name="host")
        remote = RemoteTier(kv_url, prefix=f"pcache-bench-{uuid.uuid4().hex[:8]}")
        pcr = PromptCache(model, tok, store=TieredStore([host_r, remote]), max_tokens=tokens + 64)
        pcr.add_schema(schema)
        keys_r = list(pcr.unit_keys("store").values())
        assert all(remote.contains(k) for k in keys_r), f"the Redis server at {kv_url} did not keep the states"

        def evict_host_r():
            for k in keys_r:
                host_r.remove(k)

        out["ttft_remote_s"] = round(ttft(pcr, evict_host_r), 4)
        out["speedup_remote"] = round(full / out["ttft_remote_s"], 1)
        remote.clear()
        pcr.store.close()

    # bytes per token, and raw disk load throughput
    shape = pc.adapter.kv_shape
    kvs = [disk.get(k) for k in keys]
    n_tok = sum(kv.length for kv in kvs)
    n_bytes = sum(kv.nbytes() for kv in kvs)
    t0 = time.perf_counter()
    for k in keys:
        disk.get(k)
    warm_s = time.perf_counter() - t0
    drop_page_cache(tmp)
    t0 = time.perf_counter()
    for k in keys:
        disk.get(k)
    cold_s = time.perf_counter() - t0
    out.update(
        {
            "bytes_per_token_fp16": round(n_bytes / n_tok, 1),
            "formula_fp16": shape.bytes_per_token(2),
            "formula_fp32": shape.bytes_per_token(4),
            "bytes_per_token_fp32": mem.store.get(mem.unit_key("store", "d0")).nbytes()
            / mem.store.get(mem.unit_key("store", "d0")).length,
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
        f"disk cold {t_cold * 1e3:.0f} ms (x{out['speedup_disk_cold']})\n"
        f"int8: {out['bytes_per_token_int8']} bytes/token, host {t_host8 * 1e3:.0f} ms"
        + (f" | remote (Redis) {out['ttft_remote_s'] * 1e3:.0f} ms (x{out['speedup_remote']} vs full)" if kv_url else "")
    )
    pc.store.close()
    return out


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
    from ..engine import PromptCache
    from ..rag import CachedRAG

    index = Path(index_dir) if index_dir else Path(tempfile.mkdtemp(prefix="pcache-rag-bench-"))
    corpus = build_corpus(index / "corpus", modules=RAG_MODULES)
    pc = PromptCache.from_pretrained(model_path, cache_dir=str(index / "kv"))
    rag = CachedRAG(index / "index", pc=pc, k=k, chunk_tokens=chunk_tokens)
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


_NAMES = ("Ada Ferrell", "Bruno Castell", "Chiara Lind", "Dmitri Osei", "Elena Vasko", "Farid Moreau",
          "Greta Holm", "Hiro Tanabe", "Ines Duarte", "Jonas Weller", "Kalani Brooks", "Lena Marsh",
          "Mateo Ruiz", "Nadia Petrov", "Oskar Lund", "Priya Nair", "Quentin Blake", "Rosa Amaral",
          "Sven Dahl", "Tara Quinn", "Umar Haddad", "Vera Novak", "Wen Li", "Yusuf Kaya")
_CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Tbilisi", "Quito", "Dublin", "Kyoto", "Tunis",
           "Zagreb", "Perth", "Accra", "Riga", "Bergen", "Cusco", "Malmo", "Porto", "Krakow", "Leipzig",
           "Valencia", "Tallinn", "Bilbao", "Lyon")


def quality_set(tokenizer, doc_tokens: int = 450, facts_in_distractors: bool = True):
    """24 documents (stdlib doc text with one fictional fact inserted) and one question each.

    With ``facts_in_distractors=False`` the 24 answer documents are followed by 24 plain ones
    (no fact) to serve as distractors: the usual RAG case, where other retrieved chunks do not
    state competing facts of the same form."""
    docs, qs = [], []
    from .quality import filler_pages  # the shipped, process-independent text (pydoc holds addresses)

    pages = filler_pages()[6:]
    ids = [i for p in pages for i in tokenizer(p, add_special_tokens=False)["input_ids"][:4000]]
    for j, (name, city) in enumerate(zip(_NAMES, _CITIES)):
        if not facts_in_distractors:  # interleaved, so every union slot holds both kinds
            docs.append(tokenizer.decode(ids[(24 + j) * doc_tokens : (25 + j) * doc_tokens]))
        piece = tokenizer.decode(ids[j * doc_tokens : (j + 1) * doc_tokens])
        cut = piece.find("\n", len(piece) // 2)
        cut = cut if cut > 0 else len(piece) // 2
        fact = f"\n{name} was born in {city} in {1950 + j}.\n"
        docs.append(piece[:cut] + fact + piece[cut:])
        qs.append((len(docs) - 1, f"In which city was {name} born?", city))
    return docs, qs


def bench_quality(model_path=None, slots: int = 4, max_new_tokens: int = 16, facts_in_distractors: bool = True,
                  log=print) -> dict:
    """Answer-contained accuracy on the same questions: full prefill vs cached (isolated,
    preamble fp16, preamble fp32). Each question reads its answer document and 3 others
    (documents that state competing facts, or plain ones with ``facts_in_distractors=False``)."""
    import torch

    from ..default_model import load_model
    from ..engine import PromptCache

    model, tok = load_model(model_path)
    docs, qs = quality_set(tok, facts_in_distractors=facts_in_distractors)
    n = len(docs)
    per = n // slots
    unions = []
    for s in range(slots):
        members = "".join(f'<module name="doc{j}">{escape(docs[j])}</module>' for j in range(s * per, (s + 1) * per))
        unions.append(f"<union>{members}</union>")
    system = "Answer the question using the documents. Reply with a short answer."
    schema = f'<schema name="quality"><system>{system}</system>{"".join(unions)}</schema>'

    answer_docs = {j for j, _, _ in qs}

    def prompt(j: int, q: str) -> str:
        pick = []
        for s in range(slots):
            members = [s * per + (j + 1 + s + t) % per for t in range(per)]
            plain = [m for m in members if m not in answer_docs]
            pick.append((plain or members)[0] if not facts_in_distractors else members[0])
        pick[j // per] = j  # the answer document sits in its own slot
        return f'<prompt schema="quality">{"".join(f"<doc{i}/>" for i in pick)}<user>{escape(q)}</user></prompt>'

    modes = {
        "full prefill": None,
        "cached isolated fp16": dict(encoding="isolated"),
        "cached preamble fp16": dict(encoding="preamble"),
        "cached preamble fp32": dict(encoding="preamble", store_dtype=None),
        "cached preamble int8": dict(encoding="preamble", store_dtype="int8"),
    }
    results: dict[str, dict] = {}
    for mode, kw in modes.items():
        pc = PromptCache(model, tok, **(kw or {}))
        t0 = time.perf_counter()
        pc.add_schema(schema)
        enc_s = time.perf_counter() - t0
        correct, answers, ttfts = 0, [], []
        for j, q, a in qs:
            p = prompt(j, q)
            if kw is None:
                res = pc.prefill(p)
                out = pc.generate_parts([], res.input_ids.tolist(), max_new_tokens=max_new_tokens)
            else:
                out = pc.generate(p, max_new_tokens=max_new_tokens)
            ok = a.lower() in out.text.lower()
            correct += ok
            answers.append(out.text.strip())
            ttfts.append(out.ttft_s)
        results[mode] = {"accuracy": round(correct / len(qs), 3), "correct": correct, "n": len(qs),
                         "median_ttft_s": round(statistics.median(ttfts), 3), "encode_s": round(enc_s, 1),
                         "answers": answers}
        log(f"{mode:<22} {correct}/{len(qs)} = {correct / len(qs):.1%}   median ttft {statistics.median(ttfts) * 1e3:.0f} ms")
        del pc
        torch.manual_seed(0)
    full = results["full prefill"]["answers"]
    fp16 = results["cached preamble fp16"]["answers"]
    for mode, r in results.items():
        r["same_answer_as_full"] = sum(x == y for x, y in zip(r["answers"], full))
        r["same_answer_as_fp16"] = sum(x == y for x, y in zip(r["answers"], fp16))
    return {"slots": slots, "results": results}
