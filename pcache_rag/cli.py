"""The ``pcache-rag`` command line: run a PML prompt, benchmark, and the demo job."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .fsutil import shown


def _read(path: str) -> str:
    return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")


def cmd_run(a) -> int:
    from .engine import PromptCache

    pc = PromptCache.from_pretrained(a.model, encoding=a.encoding, cache_dir=a.cache_dir)
    pc.add_schema(_read(a.schema), progress=True)
    r = pc.last_report
    print(f"[schema {r.name}: {r.encoded} units encoded, {r.loaded} loaded from the store, {r.tokens} tokens, "
          f"{r.seconds:.1f}s]", file=sys.stderr)
    out = None
    prompt = _read(a.prompt)
    if a.stream:
        stream = pc.stream(prompt, max_new_tokens=a.max_new_tokens)
        for delta in stream:
            print(delta, end="", flush=True)
        print()
        out = stream.output
    else:
        out = pc.generate(prompt, max_new_tokens=a.max_new_tokens)
        print(out.text)
    print(
        f"\n[ttft {out.ttft_s * 1000:.1f} ms | cached {out.cached_tokens} tokens | computed {out.computed_tokens} tokens]",
        file=sys.stderr,
    )
    return 0


#: benchmarks folded into others, and where their numbers are now
RETIRED_BENCHES = {
    "store": "`bench store` is retired: `pcache-rag bench all` measures TTFT from every tier (memory, host "
             "fp16 and int8, disk with a warm and a cold page cache, Redis with --kv-url) against full prefill in "
             "the same run, and bytes per cached token (docs/benchmarks.md)",
    "quality": "`bench quality` is retired: `pcache-rag eval quality --modes full,preamble,preamble@int8` answers "
               "the same questions from fp16 and int8 states beside full prefill, with 95% intervals and a "
               "paired test (docs/quality.md)",
}


def cmd_bench(a) -> int:
    from .measure.bench import bench_ttft
    from .engine import PromptCache

    log = (lambda *x: print(*x, file=sys.stderr)) if a.json else print
    if a.what in RETIRED_BENCHES:
        print(f"pcache-rag: {RETIRED_BENCHES[a.what]}", file=sys.stderr)
        return 2
    if a.what == "all":
        from .measure.bench_all import run_all

        raw = run_all(a.model, quick=a.quick, device=a.device, out=a.out, kv_url=a.kv_url, log=log)
        if a.json:
            print(json.dumps(raw, indent=1, default=str))
        return 0
    if a.what == "decode":
        from .measure.decode_bench import bench_decode

        out = bench_decode(a.model, repeats=a.repeats, busy=a.busy, log=log)
        if a.json:
            print(json.dumps({"benchmark": "decode", **out}, indent=2))
        return 0
    if a.what == "discovery":
        from .measure.bench import bench_discovery

        row = bench_discovery(a.chunks, log=log)
        if a.json:
            print(json.dumps({"benchmark": "discovery", **row}, indent=2))
        return 0
    if a.what == "rag":
        from .measure.bench import bench_rag

        row = bench_rag(a.model, a.dir, k=a.k, repeats=a.repeats, log=log)
        if a.json:
            print(json.dumps({"benchmark": "rag", **row}, indent=2))
        return 0
    pc = PromptCache.from_pretrained(a.model, max_tokens=max(a.lengths) + 64)
    log(f"model {pc.model.config.model_type}, {sum(p.numel() for p in pc.model.parameters()) / 1e6:.0f}M params, "
        f"encoding {pc.encoding}; medians of {a.repeats} runs")
    rows = bench_ttft(pc, a.lengths, a.repeats, a.question_tokens, log=log)
    if a.json:
        print(json.dumps({"benchmark": "ttft", "rows": rows}, indent=2))
    return 0


def _positive(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def _positive_float(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not a number") from None
    if not x > 0 or x != x or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {v}")
    return x


def _rag(a, create: bool):
    from .rag import CachedRAG, Index

    index = Index(a.index, create)
    budget = int(a.disk_budget * (1 << 30)) if a.disk_budget else None
    pc = index.engine(a.model, encoding=a.encoding, store_dtype=a.store_dtype, disk_budget=budget, kv_url=a.kv_url,
                      decode_weights=a.decode_weights)
    return CachedRAG(index, pc=pc, k=getattr(a, "k", 4), chunk_tokens=getattr(a, "chunk_tokens", None),
                     chroma_url=a.chroma_url, create=create, recompute=getattr(a, "recompute", None) or "auto",
                     conditioning=a.conditioning, retrieval=getattr(a, "retrieval", "hybrid"),
                     calibration=getattr(a, "calibration", "auto"), learn=getattr(a, "learn", True))


def cmd_ingest(a) -> int:
    from .rag import Index, scan

    if not a.paths and not (a.prune or a.repair):
        print("pcache-rag: give files or directories to ingest (or --prune / --repair alone)", file=sys.stderr)
        return 2
    # Validate everything cheap before the model loads.
    from .docmodules import parse_conditioning

    parse_conditioning(a.conditioning)
    Index(a.index, create=True)
    scan(a.paths, exclude=[a.index])
    rag = _rag(a, create=True)
    rep = rag.upkeep.ingest(a.paths, progress=True, encode=a.encode, prune=a.prune)
    if rep.rebuilt_from:
        print(f"warning: the damaged chroma folder was moved to {shown(rep.rebuilt_from)}; the index was rebuilt "
              "from the paths given", file=sys.stderr)
    for note in rep.notes:
        print(f"note: {shown(note)}", file=sys.stderr)
    for fix in rep.repaired:
        print(f"repaired: {shown(fix)}", file=sys.stderr)
    for path, why in rep.skipped:
        print(f"skipped: {shown(path)}: {why}", file=sys.stderr)
    extra = f", {rep.pruned} pruned" if a.prune else ""
    lazy = f", {rep.chunks_lazy} left to encode on first use" if rep.chunks_lazy else ""
    lazy += f", {rep.lazy_filled} lazily indexed before and encoded now" if rep.lazy_filled else ""
    print(
        f"files: {rep.added} added, {rep.changed} changed, {rep.unchanged} unchanged, {rep.removed} removed{extra}, "
        f"{rep.empty} empty, {len(rep.skipped)} skipped; chunks: {rep.chunks_encoded} encoded, "
        f"{rep.chunks_reused} already cached{lazy}; {rep.seconds:.1f}s"
    )
    v = rag.upkeep.verify()
    for line in v.lines():
        print(f"warning: {shown(line)}", file=sys.stderr)
    if rep.skipped:
        print(f"pcache-rag: {len(rep.skipped)} files were skipped (listed above)", file=sys.stderr)
        return 1
    return 0


def cmd_verify(a) -> int:
    rag = _rag(a, create=False)
    v = rag.upkeep.verify()
    for line in v.lines():
        print(shown(line))
    st = rag.upkeep.state_stats()
    print(f"{st['chunks']} chunks; {st['lazy']} indexed lazily, of which {st['hot']} hot (states made on first "
          f"use) and {st['cold']} cold" if st["lazy"] else f"{st['chunks']} chunks, all encoded at ingest")
    print("clean" if v.clean else "problems found: `pcache-rag ingest --repair --index DIR` fixes them "
          "(`--prune` removes sources that are gone)")
    return 0 if v.clean else 1


def cmd_forget(a) -> int:
    from .rag.forget import forget

    texts = list(a.texts)
    for f in a.file or []:
        texts.append(Path(f).read_text(encoding="utf-8"))
    if not texts and a.older_than is None:
        print("pcache-rag forget: name texts, --file FILE or --older-than DAYS", file=sys.stderr)
        return 2
    rag = _rag(a, create=False)
    for line in forget(rag, texts, a.older_than).lines():
        print(shown(line))
    rag.close()
    return 0


def cmd_ask(a) -> int:
    from .rag import Index

    from .recompute import Recompute

    if not a.question.strip():
        print("pcache-rag: the question is empty", file=sys.stderr)
        return 2
    Recompute.parse(a.recompute)  # a bad policy is refused before the model loads
    Index(a.index, create=False)
    rag = _rag(a, create=False)
    if rag.index.count() == 0:
        print(f"the index at {a.index} is empty: run `pcache-rag ingest PATH --index {a.index}` first", file=sys.stderr)
        return 2
    handles = rag.retrieve(a.question, a.k)
    runs = []
    if not a.no_cache:
        runs.append(("cached", rag.answer(a.question, handles=handles, max_new_tokens=a.max_new_tokens)))
    if a.no_cache or a.compare:
        runs.append(("full prefill", rag.answer_full_prefill(a.question, handles=handles,
                                                             max_new_tokens=a.max_new_tokens)))
    for name, ans in runs:
        print(f"[{name}] {ans.text.strip()}")
    print("\nsources:")
    for h in handles:
        print(f"  {h.score:.3f}  {shown(h.source)}  (chunk {h.metadata.get('chunk')}, {h.n_tokens} tokens)")
    for name, ans in runs:
        re_ = f" ({ans.output.recomputed_tokens} recomputed)" if ans.output.recomputed_tokens else ""
        print(f"{name:>12}: ttft {ans.ttft_s * 1000:.0f} ms (retrieve {ans.retrieve_s * 1000:.0f} ms); "
              f"cached {ans.output.cached_tokens} tokens, computed {ans.output.computed_tokens}{re_}")
    if len(runs) == 2:
        print(f"       ratio: x{runs[1][1].ttft_s / runs[0][1].ttft_s:.1f}")
    cal, src = rag.calibration
    print(f" calibration: {cal or 'none'} ({src}); conditioning {rag.asm.conditioning}; retrieval {rag.retrieval}")
    hits = {n: t["hits"] for n, t in rag.pc.stats()["tiers"].items()}
    print(f"      states: {rag.pc.encoded['units']} encoded here; hits per tier: "
          + ", ".join(f"{n} {h}" for n, h in hits.items()))
    return 0


def cmd_calibrate(a) -> int:
    from .rag import Index

    Index(a.index, create=False)
    a.calibration = "auto"
    rag = _rag(a, create=False)
    if rag.index.count() == 0:
        print(f"the index at {a.index} is empty: run `pcache-rag ingest PATH --index {a.index}` first", file=sys.stderr)
        return 2
    if a.learn:
        return _learn(a, rag)
    rep = rag.calibrate(n=a.prompts or 24, k=a.k, progress=True, save=not a.dry_run)
    for line in rep.lines():
        print(line)
    print(f"\n{rep.prompts} prompts of {rep.k} chunks sampled from the index, {rep.seconds:.0f} s; "
          f"KL(full prefill || cached) of the next token after the question and after 3 forced answer tokens")
    if a.dry_run:
        print(f"chosen: {rep.chosen} (not saved: --dry-run)")
    else:
        print(f"chosen: {rep.chosen}, saved in the index for this model; answers use it by default "
              "(--calibration none turns it off per command)")
    return 0


def _learn(a, rag) -> int:
    """``calibrate --learn``: a learned conditioning prefix for the index (see pcache_rag.rag.learned)."""
    from .rag.learned import learn_index

    n = a.prompts or 48
    was = rag.asm.conditioning
    rep = learn_index(rag, train=n, val=max(4, n // 3), steps=a.steps, k=a.k, progress=True, save=not a.dry_run)
    for line in rep.lines():
        print(line)
    print(f"\n{rep.train_prompts} prompts to learn on and {rep.val_prompts} to choose by, sampled from the index; "
          f"{rep.steps} steps, {rep.seconds:.0f} s; KL(full prefill || cached) of the next token after the question "
          "and after 3 forced answer tokens")
    if not rep.improved:
        print(f"kept: {was} (the learned prefix measured no lower than the neutral passage)")
    elif a.dry_run:
        print(f"learned {rep.prefix.spec} (not saved: --dry-run)")
    else:
        print(f"the index now encodes its chunks after {rep.prefix.spec} (was {was}); every process serving it "
              "switches at its next question. Calibrated attention was reset: run `pcache-rag calibrate` to choose it")
    return 0


def cmd_serve(a) -> int:
    from .rag import Index
    from .recompute import Recompute

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"pcache-rag serve needs the serve extra ({e.name} is missing): pip install 'pcache-rag[serve]'",
              file=sys.stderr)
        return 2
    from .serve import serve

    Recompute.parse(a.recompute)  # a bad policy is refused before the model loads
    new = not Path(a.index).expanduser().exists()
    Index(a.index, create=True)
    rag = _rag(a, create=True)
    import os

    from .serve.guard import allowed_hosts_for

    # one key, or several (one per client: what each one's prompts teach is kept for it alone)
    api_key = [k for k in (a.api_key or os.environ.get("PCACHE_RAG_API_KEY", "").split(",")) if k.strip()] or None
    hosts = allowed_hosts_for(a.host, a.allowed_host or [])
    if a.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"warning: serving on {a.host} without --api-key: anyone who can reach it can read the documents "
              f"and add files", file=sys.stderr)
    if "*" in hosts:
        print("warning: --allowed-host '*': any Host header is accepted (pages on other sites can reach this "
              "server through DNS rebinding)", file=sys.stderr)
    elif a.host in ("0.0.0.0", "::"):
        print(f"note: requests are answered for Host {', '.join(hosts)}; name others with --allowed-host",
              file=sys.stderr)
    n = rag.index.count()
    what = "a new, empty index: add documents on the page" if new or n == 0 else f"{n} chunks indexed"
    print(f"pcache-rag: {what} ({shown(a.index)})\n  web app: http://{a.host}:{a.port}/\n"
          f"  OpenAI-compatible API: http://{a.host}:{a.port}/v1 (model {rag.pc.model_name!r})",
          file=sys.stderr)
    serve(rag, host=a.host, port=a.port, max_queue=a.queue, max_new_tokens=a.max_new_tokens,
          max_batch=a.max_batch, prefill_tokens=a.prefill_tokens, max_upload_mb=a.max_upload_mb, log_level="warning" if a.quiet else "info",
          allowed_hosts=hosts,
          api_key=api_key, max_connections=a.limit_concurrency, header_timeout=a.header_timeout,
          shutdown_timeout=a.shutdown_timeout, stall_timeout=a.stall_timeout)
    rag.close()
    return 0


def cmd_eval(a) -> int:
    from .measure.quality import DEFAULT_MODES, SETS, retrieval_recall, run_eval

    log = (lambda *x: print(*x, file=sys.stderr)) if a.json else print
    if a.what == "compare":
        return _eval_compare(a, log)
    if a.files:
        print(f"pcache-rag: eval {a.what} takes no files (those are for 'eval compare'): {' '.join(a.files)}",
              file=sys.stderr)
        return 2
    if a.what == "retrieval":
        n = 6 if a.quick else a.n
        which = a.sets or ["rag"]
        if len(which) != 1 or which[0] not in ("rag", "lookalike"):
            print("pcache-rag: eval retrieval measures one end-to-end set: --sets rag or --sets lookalike",
                  file=sys.stderr)
            return 2
        res = retrieval_recall(a.model, n=n, doc_tokens=a.doc_tokens, seed=a.seed, split=a.split, log=log,
                               set_name=which[0])
        log(f"inputs (split {a.split}): {which[0]} {res['inputs']}; McNemar p, hybrid vs dense: "
            + ", ".join(f"@{k} {p:.3g}" for k, p in res["mcnemar_p"].items()))
        if a.json:
            print(json.dumps({k: v for k, v in res.items()}, indent=2, default=str))
        return 0
    n, doc_tokens, new = (3, 128, 20) if a.quick else (a.n, a.doc_tokens, a.max_new_tokens)
    summary = run_eval(a.model, n=n, doc_tokens=doc_tokens, k=a.k, modes=a.modes or DEFAULT_MODES,
                       sets=a.sets or SETS, max_new_tokens=new, seed=a.seed, out_dir=a.out, log=log, split=a.split,
                       checkpoint=a.checkpoint, workdir=a.workdir, prefix=a.prefix, learn_steps=a.learn_steps,
                       question_template=a.question_template, decode_weights=a.decode_weights,
                       query_weights=a.query_weights)
    for set_name, rows in summary["sets"].items():
        log(f"\n{set_name}:")
        for m, r in rows.items():
            log(f"  {m:<12} {r['correct']:>3}/{r['n']} = {r['accuracy']:6.1%}  [{r['ci95'][0]:.0%}, {r['ci95'][1]:.0%}]  "
                f"F1 {r['f1']:.2f}  agree {r.get('agreement', 1):.0%}  recomputed {r['recomputed_fraction']:.1%}  "
                f"ttft {r['median_ttft_s'] * 1e3:.0f} ms  x{r.get('speedup', 1):.1f}")
    log("\ninputs (split " + a.split + "): " + ", ".join(f"{s} {h}" for s, h in summary.get("input_hashes", {}).items()))
    if a.out:
        log(f"\nwrote {a.out}/quality.md and {a.out}/quality.png")
    if a.json:
        print(json.dumps(summary, indent=2))
    return 0


def _eval_compare(a, log) -> int:
    from .measure.compare import compare_runs, load_run, markdown

    if len(a.files) < 2:
        print("pcache-rag: eval compare needs two eval checkpoints or more (eval quality --checkpoint FILE)",
              file=sys.stderr)
        return 2
    try:
        result = compare_runs([load_run(f) for f in a.files], modes=a.modes)
    except ValueError as e:
        print(f"pcache-rag: {e}", file=sys.stderr)
        return 1
    text = markdown(result)
    if a.out:
        out = Path(a.out)
        out = out / "quality-compare.md" if out.suffix != ".md" else out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        log(f"wrote {out}")
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        print(text)
    return 0


def cmd_install_prefix(a) -> int:
    from .measure.quality import install_prefix

    try:
        path, rep = install_prefix(a.model, a.out, steps=a.steps, force=a.force)
    except RuntimeError as e:
        print(f"pcache-rag: {e}", file=sys.stderr)
        return 1
    if rep is not None:
        print(f"validation KL (cached to full prefill, lower is closer): no conditioning {rep.kl_none:.4f}, neutral "
              f"passage {rep.kl_init:.4f}, learned {rep.kl_learned:.4f}; {rep.steps} steps in {rep.seconds:.0f} s")
    return 0


def cmd_demo(a) -> int:
    from .demo import run_demo

    return run_demo(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pcache-rag", description="Prompt Cache for retrieval-augmented generation")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="answer a PML prompt against a PML schema")
    r.add_argument("--schema", required=True, help="schema file (- for stdin)")
    r.add_argument("--prompt", required=True, help="prompt file (- for stdin)")
    r.add_argument("--model", default=None, help="local model folder or .gguf (default: embedded SmolLM2)")
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--encoding", choices=("isolated", "preamble"), default="preamble")
    r.add_argument("--stream", action="store_true", help="print tokens as they are decoded")
    r.add_argument("--cache-dir", default=None, help="keep module states on disk here (warm restarts)")
    r.set_defaults(fn=cmd_run)

    b = sub.add_parser("bench", help="benchmarks: all (the report: docs/benchmarks.md with plots), ttft (prompt "
                       "lengths), store (tiers), rag (end to end), quality (accuracy)")
    b.add_argument("what", choices=("all", "ttft", "rag", "decode", "discovery", *RETIRED_BENCHES),
                   help="all: the report; ttft: the length sweep; rag: answers through CachedRAG; decode: ms a "
                        "generated token and whole answers, fp32 and smaller decode weights, against stock "
                        "transformers and the weight-streaming floor; discovery: known chunks found in an "
                        "unmarked ~8K-token prompt (--chunks known) "
                        "(store and quality are retired and say where their numbers are)")
    b.add_argument("--quick", action="store_true", help="all: tiny sizes that check the harness in a few minutes")
    b.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="all: where the model runs")
    b.add_argument("--out", default="docs", help="all: where benchmarks.md, its plots and JSON go")
    b.add_argument("--k", type=_positive, default=4, help="rag: chunks per question")
    b.add_argument("--dir", default=None, help="rag: working directory (default: a temporary one)")
    b.add_argument("--kv-url", default=None, metavar="URL", help="all: also time the Redis tier at this URL")
    b.add_argument("--model", default=None)
    b.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--busy", type=int, default=0, metavar="N",
                   help="decode: time every row again beside N single-threaded busy processes the run starts")
    b.add_argument("--question-tokens", type=int, default=32)
    b.add_argument("--chunks", type=_positive, default=100_000, help="discovery: known chunks")
    b.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    b.set_defaults(fn=cmd_bench)

    def rag_args(x):
        x.add_argument("--index", required=True, help="index directory (chroma + KV store)")
        x.add_argument("--model", default=None, help="local model folder or .gguf (default: embedded SmolLM2)")
        x.add_argument("--chroma-url", default=None, help="use a chroma server instead of the embedded one")
        x.add_argument("--kv-url", default=None, metavar="URL",
                       help="share states through a Redis/Valkey server (redis://host:6379/0)")
        x.add_argument("--encoding", choices=("isolated", "preamble"), default="preamble")
        x.add_argument("--store-dtype", choices=("float16", "int8"), default="float16",
                       help="precision of stored states: int8 (KIVI-style) takes about half the bytes")
        x.add_argument("--decode-weights", choices=("bf16", "int8", "fp32"), default=None,
                       help="the weights generated tokens read (prompt tokens keep fp32; self-checked at load): bf16 "
                            "(the default: 1.7x faster than fp32, the same accuracy on the eval), int8, or fp32")
        x.add_argument("--conditioning", default=None, metavar="SPEC",
                       help="encode chunks after neutral passages as well as the preamble: none, neutral, neutral:N (N up to 4) "
                            "(default: the index's own; for a new index, the RAG default: the learned prefix installed "
                            "for the model where there is one, else neutral)")
        x.add_argument("--retrieval", choices=("hybrid", "dense"), default="hybrid",
                       help="hybrid: BM25 fused with the dense ranking (reciprocal rank fusion); dense: MiniLM alone")
        x.add_argument("--calibration", default="auto", metavar="SPEC",
                       help="calibrated attention for answers: auto (the index's own, from `pcache-rag calibrate`), "
                            "none, or ape:T:S")
        x.add_argument("--disk-budget", type=_positive_float, default=None, metavar="GB",
                       help="KV store disk budget in GiB (default: half the free disk, at most 64)")

    i = sub.add_parser("ingest", help="index documents: chunk, embed into chroma, encode KV states")
    i.add_argument("paths", nargs="*", help="files or directories (.txt, .md, .rst)")
    rag_args(i)
    i.add_argument("--chunk-tokens", type=_positive, default=None,
                   help="chunk size in model tokens (default: the index's own, 512 for a new one)")
    i.add_argument("--encode", choices=("eager", "lazy"), default="eager",
                   help="eager: encode states now (refused above the store budget); lazy: on first use")
    i.add_argument("--prune", action="store_true", help="also remove indexed files that no longer exist")
    i.add_argument("--repair", action="store_true",
                   help="fix what verify finds (ingest always does; this allows running without paths)")
    i.set_defaults(fn=cmd_ingest)

    v = sub.add_parser("verify", help="check an index against its files and its KV store")
    rag_args(v)
    v.set_defaults(fn=cmd_verify)

    f = sub.add_parser("forget", help="remove texts' states (every tier) and their journal entries; --older-than "
                                      "drops journal entries past a retention period")
    f.add_argument("texts", nargs="*", help="texts to forget, as they were encoded")
    rag_args(f)
    f.add_argument("--file", action="append", metavar="FILE", help="a file whose whole text is to be forgotten")
    f.add_argument("--older-than", type=_positive_float, default=None, metavar="DAYS",
                   help="also drop journal entries added more than DAYS days ago")
    f.set_defaults(fn=cmd_forget)

    c = sub.add_parser("calibrate", help="choose calibrated attention, or learn a conditioning prefix (--learn), for an "
                                         "index without labels (KL to full prefill)")
    rag_args(c)
    c.add_argument("--prompts", type=_positive, default=None,
                   help="prompts sampled from the index (default 24; with --learn, 48 to learn on, and a third as many "
                        "more to choose by)")
    c.add_argument("--k", type=_positive, default=4, help="chunks per sampled prompt")
    c.add_argument("--learn", action="store_true",
                   help="learn a conditioning prefix for the index (label-free, about 10 s a step on two cores) and "
                        "re-encode its chunks after it, instead of choosing calibrated attention")
    c.add_argument("--steps", type=_positive, default=96, help="with --learn: training steps (one prompt each)")
    c.add_argument("--dry-run", action="store_true", help="measure and print, keep nothing")
    c.set_defaults(fn=cmd_calibrate)

    q = sub.add_parser("ask", help="answer a question from an index")
    q.add_argument("question")
    rag_args(q)
    q.add_argument("--k", type=_positive, default=4, help="chunks to retrieve")
    q.add_argument("--max-new-tokens", type=int, default=64)
    q.add_argument("--no-cache", action="store_true", help="full prefill of the retrieved text instead")
    q.add_argument("--compare", action="store_true", help="also run full prefill and print both TTFTs")
    q.add_argument("--recompute", default=None, metavar="POLICY",
                   help="recompute context tokens for quality: none, epic:K, blend:R, focus:R, match:N, each:N, alike:N, all "
                        "(default: the RAG default, each:1, unless the index is calibrated)")
    q.set_defaults(fn=cmd_ask)

    v = sub.add_parser("serve", help="the document-QA web app and an OpenAI-compatible API over an index")
    rag_args(v)
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--k", type=_positive, default=4, help="chunks to retrieve per question")
    v.add_argument("--max-new-tokens", type=_positive, default=128, help="default answer length")
    v.add_argument("--queue", type=_positive, default=64, help="questions that may wait; more get 503")
    v.add_argument("--max-batch", type=_positive, default=16, metavar="N",
                   help="answers decoded together in one continuous batch (1: one at a time)")
    # engine.scheduler.DEFAULT_PREFILL_TOKENS, written out: this module imports no torch
    v.add_argument("--prefill-tokens", type=_positive, default=512, metavar="N",
                   help="prompt tokens a batch step computes beside decoding; longer prompts are prefilled in "
                        "chunks (smaller: smoother streams, slower long prompts)")
    v.add_argument("--max-upload-mb", type=float, default=20.0, help="largest uploaded file")
    v.add_argument("--recompute", default=None, metavar="POLICY",
                   help="recompute policy for answers (default: each:1, unless the index is calibrated)")
    v.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 and /api (repeatable: one key per client, and what "
                        "each client's prompts teach is kept for that key alone; default: $PCACHE_RAG_API_KEY, "
                        "comma-separated, or none)")
    v.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="also answer requests whose Host is NAME (repeatable; '*' for any); default: the bound "
                        "address and localhost")
    v.add_argument("--limit-concurrency", type=_positive, default=None, metavar="N",
                   help="connections held at once (default: 1024, or 3/4 of the file descriptor limit)")
    v.add_argument("--header-timeout", type=_positive_float, default=10.0, metavar="S",
                   help="seconds a connection has to send its request headers")
    v.add_argument("--shutdown-timeout", type=_positive_float, default=10.0, metavar="S",
                   help="on SIGTERM or Ctrl-C, seconds to wait for answers in flight before ending them with an error")
    # engine.watchdog.DEFAULT_STALL_S, written out: this module imports no torch
    v.add_argument("--stall-timeout", type=_positive_float, default=120.0, metavar="S",
                   help="answers waiting this long on a batch that makes no step are failed (503 'stalled') and "
                        "their places freed")
    v.add_argument("--learn", action=argparse.BooleanOptionalAction, default=True,
                   help="keep what prompts answered as sent teach, per API key, in memory (the default); "
                        "--no-learn: keep nothing (known documents are still read)")
    v.add_argument("--quiet", action="store_true", help="log warnings only")
    v.set_defaults(fn=cmd_serve)

    e = sub.add_parser("eval", help="evaluations: quality (cached vs full prefill, with recompute policies)")
    e.add_argument("what", choices=("quality", "retrieval", "compare"),
                   help="quality: answers, cached against full prefill; retrieval: the rag set's fact-chunk recall@k, "
                        "dense against hybrid; compare: two or more models' quality checkpoints side by side on the "
                        "questions they share")
    e.add_argument("files", nargs="*", help="compare: the eval checkpoints (eval quality --checkpoint FILE)")
    e.add_argument("--quick", action="store_true", help="a few questions per set (minutes): checks the harness")
    e.add_argument("--n", type=_positive, default=75, help="questions per set (5 sets)")
    e.add_argument("--doc-tokens", type=_positive, default=400, help="tokens per document")
    e.add_argument("--k", type=_positive, default=4, help="documents per question")
    e.add_argument("--max-new-tokens", type=_positive, default=24)
    e.add_argument("--modes", nargs="+", default=None, help="full isolated preamble epic:K blend:R ...")
    e.add_argument("--sets", nargs="+", default=None, choices=("plain", "competing", "cross", "rag", "lookalike"),
                   help="retrieval: the end-to-end set whose recall is measured (rag or lookalike; default rag)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--split", choices=("reporting", "tuning"), default="reporting",
                   help="which draw of questions: choose settings on 'tuning', report on 'reporting' (disjoint)")
    e.add_argument("--question-template", default=None, metavar="TEXT",
                   help="the text after the documents on the synthetic sets, with {question} (default: the RAG "
                        "path's 'Question: {question}'); 'llamaindex' is LlamaIndex's default QA prompt")
    e.add_argument("--workdir", default=None,
                   help="keep the 'rag' set's corpus and indexes here (default: a temporary folder); a resumed run "
                        "reuses them")
    e.add_argument("--model", default=None)
    e.add_argument("--out", default="docs", help="where quality.md and quality.png go ('' for nowhere)")
    e.add_argument("--checkpoint", default=None,
                   help="keep every answered question here (JSON) as it goes; a run with the same settings resumes "
                        "from it, skipping what it holds")
    e.add_argument("--prefix", default=None,
                   help="cond:learned's learned prefix (a .safetensors file); learned first and written there when "
                        "absent (default: next to the checkpoint, or kept in memory)")
    e.add_argument("--learn-steps", type=_positive, default=96, help="steps when cond:learned learns its prefix")
    e.add_argument("--decode-weights", choices=("int8", "bf16"), default=None,
                   help="decode every answer with these weights (prompts keep fp32), against a run without")
    e.add_argument("--query-weights", choices=("bf16",), default=None,
                   help="the cached modes' new and recomputed rows read the bf16 decode weights too (as the RAG default "
                        "does; needs --decode-weights bf16); full prefill keeps fp32")
    e.add_argument("--json", action="store_true")
    e.set_defaults(fn=cmd_eval)

    x = sub.add_parser("install-prefix",
                       help="learn the model's conditioning prefix once (label-free; about 50 minutes on two cores) and "
                            "install it as its RAG default")
    x.add_argument("--model", default=None, help="an embedded model's name, a folder or a .gguf (default: the embedded "
                                                 "default)")
    x.add_argument("--steps", type=_positive, default=96, help="training steps (one prompt each)")
    x.add_argument("--out", default=None, help="write it here instead ($PCACHE_RAG_HOME/learned/<model>.safetensors)")
    x.add_argument("--force", action="store_true", help="learn again although one is installed for the model")
    x.set_defaults(fn=cmd_install_prefix)

    d = sub.add_parser("demo", help="the main job: ingest a sample corpus and answer questions")
    d.add_argument("--model", default=None)
    d.add_argument("--max-new-tokens", type=int, default=48)
    d.add_argument("--index", default=None, help="index directory (default: under ~/.cache/pcache-rag)")
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .pml import PMLError

    from .rag import IndexDamagedError, IngestTooLargeError

    try:
        return a.fn(a)
    except PMLError as e:
        print(f"pcache-rag: PML error: {shown(str(e))}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, IndexDamagedError, IngestTooLargeError) as e:
        print(f"pcache-rag: {shown(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
