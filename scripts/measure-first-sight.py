"""Time to first token of a prompt whose documents nobody has seen, against full prefill, in one run.

A stock RAG prompt (the LangChain hub's ``rlm/rag-prompt``, its documents joined by blank lines)
holds documents of ~250 tokens cut from this machine's Python documentation, each prompt its own
never-seen documents, at ~1K and ~2K prompt tokens. For each of ``--prompts`` prompts a size:

* ``full``: ``PromptCache`` with nothing reused: one forward over the chat template's ids;
* ``first (deferred)``: the Assembler's first sight with the default
  (``Assembler.defer_first_sight``): the prompt computed, its documents encoded after the answer;
* ``repeat``: the same prompt again, its documents now read from the cache;
* ``first (inline)``: another never-seen set of documents, encoded before the answer
  (``defer_first_sight = False``), the behaviour before.

Medians over the prompts, each first-token time as a ratio of that prompt's own ``full``.

``--connector`` also measures the way issue 59 did: LangChain's ``ChatPromptCache`` with its
defaults (learning on, states on disk in a fresh ``cache_dir``) against one with
``learn_documents=False`` (nothing reused but the prefix) on the same never-seen prompt, in
the same process, then the learning one again on the repeat; times are the connector's own
``ttft_s``.

    .venv/bin/python scripts/measure-first-sight.py [--prompts 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RAG_PROMPT = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
              "answer the question. If you don't know the answer, just say that you don't know. Use three sentences "
              "maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:")
QUESTION = "Which function of these modules reads a file, and what does it return?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--connector", action="store_true", help="also through LangChain's ChatPromptCache")
    a = ap.parse_args()

    from pcache_rag import Parts, PromptCache
    from pcache_rag.docmodules import Assembler
    from pcache_rag.measure.decode_bench import cpu_line
    from pcache_rag.samples import stdlib_docs

    pc = PromptCache.from_pretrained()
    asm = Assembler(pc)
    tok = pc.tokenizer
    words = " ".join(text for _, text in stdlib_docs(min_chars=4_000_000)).split()
    at = 0

    def docs(n_tokens: int) -> list[str]:  # never-seen documents of ~250 tokens, filling ~n_tokens
        nonlocal at
        out, total = [], 0
        while total < n_tokens - 150:
            text = " ".join(words[at : at + 170])
            at += 170
            out.append(text)
            total += len(tok(text, add_special_tokens=False)["input_ids"])
        return out

    def messages(ds: list[str]) -> list[tuple[str, str]]:
        return [("user", RAG_PROMPT.format(question=QUESTION, context="\n\n".join(ds)))]

    def full(msgs) -> float:
        ids = tok.apply_chat_template([{"role": r, "content": c} for r, c in msgs], add_generation_prompt=True,
                                      tokenize=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids  # a BatchEncoding in newer transformers
        return pc.generate(Parts([], list(ids)), max_new_tokens=1).ttft_s

    def cached(msgs, defer: bool):
        asm.defer_first_sight = defer
        try:
            return asm.generate(asm.message_segments(msgs), max_new_tokens=1)
        finally:
            asm.defer_first_sight = True

    print(cpu_line(), file=sys.stderr)
    full(messages(docs(300)))  # warm-up: the prefix and the kernels
    rows = []
    for size in (1000, 2000):
        r: dict[str, list[float]] = {"full": [], "first (deferred)": [], "repeat": [], "first (inline)": [],
                                     "prompt_tokens": [], "cached share, repeat": []}
        for _ in range(a.prompts):
            m = messages(docs(size))
            base = full(m)
            first = cached(m, True)
            again = cached(m, True)
            other = messages(docs(size))
            base2 = full(other)
            inline = cached(other, False)
            r["full"].append(base)
            r["first (deferred)"].append(first.ttft_s / base)
            r["repeat"].append(again.ttft_s / base)
            r["first (inline)"].append(inline.ttft_s / base2)
            r["prompt_tokens"].append(first.prompt_tokens)
            r["cached share, repeat"].append(again.cached_tokens / again.prompt_tokens)
        row = {"size": size, "prompts": a.prompts, "prompt_tokens": statistics.median(r["prompt_tokens"]),
               "full_ms": 1e3 * statistics.median(r["full"]),
               **{k: statistics.median(r[k]) for k in ("first (deferred)", "repeat", "first (inline)",
                                                        "cached share, repeat")},
               "raw": r}
        rows.append(row)
        print(f"~{row['prompt_tokens']:.0f} tokens: full prefill {row['full_ms']:.0f} ms; first sight, deferred "
              f"{row['first (deferred)']:.2f}x full; repeat {row['repeat']:.3f}x ({1 / row['repeat']:.1f}x faster, "
              f"{row['cached share, repeat']:.1%} of the prompt cached); first sight, inline "
              f"{row['first (inline)']:.2f}x (medians of {a.prompts})")
    if a.connector:
        rows += connector_rows(a.prompts, docs, messages)
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu_line(), "rows": rows}, indent=1))


def connector_rows(n: int, docs, messages) -> list[dict]:
    import tempfile

    from langchain_pcache import ChatPromptCache

    where = tempfile.mkdtemp(prefix="pcache-first-sight-")
    learn = ChatPromptCache(max_tokens=1, cache_dir=where)
    plain = ChatPromptCache(max_tokens=1, cache_dir=where, learn_documents=False)

    def ttft(llm, msgs) -> float:
        return llm.invoke([(("human" if r == "user" else r), c) for r, c in msgs]).response_metadata["ttft_s"]

    ttft(plain, messages(docs(300)))  # warm-up: the engine, its prefix
    rows = []
    for size in (1000, 2000):
        first, again = [], []
        for _ in range(n):
            m = messages(docs(size))
            base = ttft(plain, m)  # learning off: the documents are computed, nothing of them reused
            first.append(ttft(learn, m) / base)
            again.append(ttft(learn, m) / base)
        row = {"size": size, "prompts": n, "path": "ChatPromptCache", "first sight / learning off":
               statistics.median(first), "repeat / learning off": statistics.median(again),
               "raw": {"first": first, "repeat": again}}
        rows.append(row)
        print(f"ChatPromptCache, ~{size} tokens: first sight {row['first sight / learning off']:.2f}x the same "
              f"prompt with learning off; repeat {row['repeat / learning off']:.3f}x (medians of {n})")
    return rows


if __name__ == "__main__":
    main()
