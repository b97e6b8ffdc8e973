"""The ``pcache-rag`` command line: run a PML prompt, benchmark, and the demo job."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def _read(path: str) -> str:
    return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")


def cmd_run(a) -> int:
    from .engine import PromptCache

    pc = PromptCache.from_pretrained(a.model, encoding=a.encoding)
    pc.add_schema(_read(a.schema), progress=True)
    out = None
    prompt = _read(a.prompt)
    if a.stream:
        for delta in pc.stream(prompt, max_new_tokens=a.max_new_tokens):
            print(delta, end="", flush=True)
        print()
        out = pc.last_output
    else:
        out = pc.generate(prompt, max_new_tokens=a.max_new_tokens)
        print(out.text)
    print(
        f"\n[ttft {out.ttft_s * 1000:.1f} ms | cached {out.cached_tokens} tokens | computed {out.computed_tokens} tokens]",
        file=sys.stderr,
    )
    return 0


def cmd_bench(a) -> int:
    from .bench import bench_ttft
    from .engine import PromptCache

    if a.what != "ttft":
        print(f"unknown benchmark {a.what!r}", file=sys.stderr)
        return 2
    pc = PromptCache.from_pretrained(a.model, max_tokens=max(a.lengths) + 64)
    log = (lambda *x: print(*x, file=sys.stderr)) if a.json else print
    log(f"model {pc.model.config.model_type}, {sum(p.numel() for p in pc.model.parameters()) / 1e6:.0f}M params, "
        f"encoding {pc.encoding}; medians of {a.repeats} runs")
    rows = bench_ttft(pc, a.lengths, a.repeats, a.question_tokens, log=log)
    if a.json:
        print(json.dumps({"benchmark": "ttft", "rows": rows}, indent=2))
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
    r.set_defaults(fn=cmd_run)

    b = sub.add_parser("bench", help="benchmarks (ttft)")
    b.add_argument("what", choices=("ttft",))
    b.add_argument("--model", default=None)
    b.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--question-tokens", type=int, default=32)
    b.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    b.set_defaults(fn=cmd_bench)

    d = sub.add_parser("demo", help="the main job: answer questions over a sample corpus")
    d.add_argument("--model", default=None)
    d.add_argument("--max-new-tokens", type=int, default=48)
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .pml import PMLError

    try:
        return a.fn(a)
    except PMLError as e:
        print(f"pcache-rag: PML error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"pcache-rag: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
