"""Structured output on the cached path, against its baselines in the same run: TTFT of a
JSON-schema answer over cached documents against full prefill of the same tokens, and the
decode cost per token with the grammar against without it.

``ChatPromptCache.with_structured_output`` over a stock prompt with ``--k`` documents from the
sample corpus (about ``--doc-tokens`` each, encoded before, as ``PromptCacheDocumentEncoder``
does) in the system message. Full prefill is the same prompt's token ids with nothing reused.
The free answer is the same prompt without the grammar. Also prints llguidance's one-time
cost for the tokenizer (paid by the first structured answer in a process). One JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pcache_rag.engine import Parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    print(json.dumps(measure(a)))


def measure(a) -> dict:
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from pydantic import BaseModel, Field

    from langchain_pcache import ChatPromptCache, PromptCacheDocumentEncoder
    from pcache_rag.docmodules import assembler_for, shared_engine
    from pcache_rag.grammar import SCHEMA_INSTRUCTION, json_grammar, warm
    from pcache_rag.pml import bos_ids
    from pcache_rag.samples import stdlib_docs

    class Answer(BaseModel):
        function: str = Field(description="the function's name")
        module: str = Field(description="the module it belongs to")

    states = tempfile.mkdtemp(prefix="pcache-structured-")
    pc = shared_engine("smollm2-135m-instruct", states)
    tok = pc.tokenizer
    texts = []
    for _, page in stdlib_docs():
        ids = tok(page, add_special_tokens=False)["input_ids"][: a.doc_tokens]
        texts.append(tok.decode(ids).strip())
        if len(texts) == a.k:
            break
    docs = [Document(page_content=t) for t in texts]
    PromptCacheDocumentEncoder(cache_dir=states, progress=False).transform_documents(docs)
    warm_s = warm(tok, pc.model.config.vocab_size)

    prompt = ChatPromptTemplate.from_messages([("system", "Answer from these documents:\n\n{context}"),
                                               ("human", "{input}")])
    llm = ChatPromptCache(cache_dir=states, max_tokens=a.max_tokens)
    inputs = {"context": "\n\n".join(texts), "input": "Which function reads a file, and in which module?"}
    structured = prompt | llm.with_structured_output(Answer, include_raw=True)
    free = prompt | llm

    def run(chain):
        t0 = time.perf_counter()
        out = chain.invoke(inputs)
        msg = out["raw"] if isinstance(out, dict) else out
        msg.response_metadata["wall_s"] = time.perf_counter() - t0
        return msg

    run(structured)  # the first call encodes the prompt's prefix
    cached, free_runs = [], []
    for _ in range(a.repeats):
        cached.append(run(structured))
        free_runs.append(run(free))
    meta = cached[-1].response_metadata
    # full prefill: the structured prompt's exact tokens, nothing reused, same grammar
    asm = assembler_for(pc, None)
    msgs = prompt.invoke(inputs).to_messages()
    schema = Answer.model_json_schema()
    turns = [("system", msgs[0].content), ("user", msgs[1].content + SCHEMA_INSTRUCTION + json.dumps(schema))]
    segs = asm.message_segments(turns, discover=False)
    ids = bos_ids(tok) + pc.safe.segments([(s.text, s.kind == "markup") for s in segs if s.kind != "cut" and s.text])
    full = [pc.generate(Parts([], ids), max_new_tokens=a.max_tokens, grammar=json_grammar(schema))
            for _ in range(a.repeats)]

    def per_token(ms):  # the answer's wall time after its first token, per later token
        return statistics.median([(m.response_metadata["wall_s"] - m.response_metadata["ttft_s"])
                                  / max(1, m.usage_metadata["output_tokens"] - 1) * 1e3 for m in ms])

    ttft_c = statistics.median(m.response_metadata["ttft_s"] for m in cached) * 1e3
    ttft_f = statistics.median(o.ttft_s for o in full) * 1e3
    return {
        "prompt_tokens": meta["prompt_tokens"], "cached_tokens": meta["cached_tokens"],
        "ttft_structured_cached_ms": round(ttft_c, 1), "ttft_structured_full_prefill_ms": round(ttft_f, 1),
        "speedup": round(ttft_f / ttft_c, 1),
        "ttft_free_cached_ms": round(statistics.median(m.response_metadata["ttft_s"] for m in free_runs) * 1e3, 1),
        "free_prompt_tokens": free_runs[-1].response_metadata["prompt_tokens"],
        "decode_ms_per_token_grammar": round(per_token(cached), 1),
        "decode_ms_per_token_free": round(per_token(free_runs), 1),
        "same_answer_cached_vs_full": cached[-1].content == full[-1].text,
        "finish_reason": meta["finish_reason"], "answer": cached[-1].content,
        "llguidance_first_use_s": round(warm_s, 2),
    }


if __name__ == "__main__":
    main()
