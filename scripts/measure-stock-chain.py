"""TTFT of LangChain's stock ``create_stuff_documents_chain`` on ChatPromptCache, against full
prefill of the same prompt tokens in the same run (issue 21's measurement).

The documents (k of them, from the sample corpus, about ``--doc-tokens`` each) go unmarked
into the system message, as the stock chain puts them. Two cases, each in its own state folder:
``unknown`` (nobody encoded the documents: call 1 encodes the system message as a prefix,
cached by content, and later calls with the same documents read it) and ``known`` (the
documents were encoded before, as ``PromptCacheDocumentEncoder`` does at ingest: they are
found in the message and read from the cache whatever else the prompt holds). Full prefill is
the same token ids with nothing reused, in the same run. Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pcache_rag.engine import Parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    for case in ("unknown", "known"):
        print(json.dumps(measure(case, a)))


def measure(case: str, a) -> dict:
    import torch
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_pcache import ChatPromptCache

    from pcache_rag.docmodules import assembler_for, shared_engine
    from pcache_rag.samples import stdlib_docs

    states = tempfile.mkdtemp(prefix=f"pcache-stock-chain-{case}-")
    llm = ChatPromptCache(cache_dir=states, max_tokens=8)
    asm = assembler_for(shared_engine(None, states), llm.document_preamble)
    tok = asm.pc.tokenizer
    docs = []
    for name, text in stdlib_docs(modules=("json", "csv", "textwrap", "heapq", "bisect", "shutil")):
        ids = tok(text, add_special_tokens=False)["input_ids"][200 : 200 + a.doc_tokens]
        docs.append(Document(page_content=tok.decode(ids).strip(), metadata={"source": name}))
        if len(docs) == a.k:
            break
    if case == "known":  # encoded before the question, as the connector's document encoder does at ingest
        asm.ensure([d.page_content for d in docs])
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question using only these documents:\n\n{context}"), ("human", "{input}")])
    chain = create_stuff_documents_chain(llm, prompt)
    question = "Which module reads and writes CSV files?"
    seen: list = []

    class Meta(BaseCallbackHandler):
        def on_llm_end(self, response, **kw):
            seen.append(response.generations[0][0].message.response_metadata)

    runs = []
    for _ in range(1 + a.repeats):
        chain.invoke({"context": docs, "input": question}, config={"callbacks": [Meta()]})
        runs.append(seen[-1])
    # the same prompt as token ids, prefilled in full with nothing reused
    msgs = prompt.invoke({"context": "\n\n".join(d.page_content for d in docs), "input": question}).to_messages()
    roles = {"system": "system", "human": "user", "ai": "assistant"}
    plan = asm.plan(asm.message_segments([(roles[m.type], m.content) for m in msgs]), 8)
    ids = torch.cat([kv.token_ids for _, kv in plan.parts] + [torch.tensor(plan.new_ids)]).tolist()
    full = [asm.pc.generate(Parts([], ids), max_new_tokens=1).ttft_s for _ in range(a.repeats)]
    cached = [r["ttft_s"] for r in runs[1:]]
    out = {"case": case, "k": a.k, "doc_tokens": a.doc_tokens, "prompt_tokens": runs[-1]["prompt_tokens"],
           "full_prefill_tokens": len(ids), "cached_tokens": runs[-1]["cached_tokens"],
           "documents_found": runs[-1]["documents"], "first_call_ttft_ms": round(runs[0]["ttft_s"] * 1e3, 1),
           "first_call_encoded_tokens": runs[0]["encoded_tokens"],
           "cached_ttft_ms": round(statistics.median(cached) * 1e3, 1),
           "full_prefill_ttft_ms": round(statistics.median(full) * 1e3, 1)}
    out["speedup"] = round(out["full_prefill_ttft_ms"] / out["cached_ttft_ms"], 1)
    return out


if __name__ == "__main__":
    main()
