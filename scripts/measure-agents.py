"""Agents on the embedded model: each step's prompt, how much of it came from the cache, and its
time to first token beside full prefill of the same prompt, in one run.

A LangGraph ReAct agent and a LlamaIndex ``FunctionAgent`` answer the same two-tool task as
tests/test_agents.py (a retrieval tool over a freshly ingested two-document index, then a
calculator that returns directly), with ``tool_plan`` (SmolLM2-135M does not choose tools by
itself). Every step's messages are then replayed through the same LLM class with
``recompute="all"`` (every prompt token computed: full prefill's work and answer) and the two
times to first token are put side by side. Repeats ``--runs`` times with fresh namespaces and
prints medians.

    .venv/bin/python scripts/measure-agents.py [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the task: its documents, question, tools and models (test_agents.py)


def langgraph_steps(index: str, ns: str) -> list[tuple[dict, dict]]:
    """The ReAct agent's steps: (the step's statistics, full prefill's of the same prompt) each."""
    from langchain_core.messages import AIMessage, SystemMessage
    from langgraph.prebuilt import create_react_agent

    from test_agents import QUESTION, SYSTEM, langchain_parts

    tools, llm = langchain_parts(index, ns)
    messages = create_react_agent(llm, tools, prompt=SYSTEM).invoke({"messages": [("user", QUESTION)]})["messages"]
    full = langchain_parts(index, ns + "-full", max_tokens=1, recompute="all")[1].bind_tools(tools)
    return [(m.response_metadata, full.invoke([SystemMessage(SYSTEM), *messages[:i]]).response_metadata)
            for i, m in enumerate(messages) if isinstance(m, AIMessage)]


def llamaindex_steps(index: str, ns: str) -> list[tuple[dict, dict]]:
    """The FunctionAgent's steps, as :func:`langgraph_steps`."""
    from llama_index.core.agent.workflow import AgentInput, AgentOutput, FunctionAgent

    from test_agents import QUESTION, SYSTEM, llamaindex_parts

    tools, llm = llamaindex_parts(index, ns)
    agent = FunctionAgent(tools=tools, llm=llm, system_prompt=SYSTEM)

    async def run():
        handler = agent.run(QUESTION)
        events = [ev async for ev in handler.stream_events()]
        await handler
        return events

    events = asyncio.run(run())
    inputs = [e.input for e in events if isinstance(e, AgentInput)]
    outputs = [e.raw for e in events if isinstance(e, AgentOutput) and e.raw]
    full = llamaindex_parts(index, ns + "-full", max_new_tokens=1, recompute="all")[1]
    specs = [t.metadata.to_openai_tool() for t in tools]
    return [(meta, dict(full.chat(sent, tools=specs).additional_kwargs)) for sent, meta in zip(inputs, outputs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from pcache_rag.rag import CachedRAG
    from test_agents import DOCS

    idx = Path(tempfile.mkdtemp(prefix="pcache-agents-")) / "index"
    src = idx.parent / "docs"
    src.mkdir()
    for name, text in DOCS.items():
        (src / name).write_text(text)
    CachedRAG(idx, k=2, chunk_tokens=256).ingest([src], progress=False)

    report: dict = {}
    for name, fn in (("langgraph", langgraph_steps), ("llamaindex", llamaindex_steps)):
        runs = [fn(str(idx), f"{name}-{r}") for r in range(a.runs)]
        n = min(len(r) for r in runs)
        rows = []
        for i in range(n):
            cached = [r[i][0] for r in runs]
            full = [r[i][1] for r in runs]
            row = {"step": i + 1, "prompt_tokens": cached[0]["prompt_tokens"],
                   "cached_share": statistics.median(c["cached_tokens"] / c["prompt_tokens"] for c in cached),
                   "ttft_ms": 1000 * statistics.median(c["ttft_s"] for c in cached),
                   "full_prefill_ttft_ms": 1000 * statistics.median(f["ttft_s"] for f in full)}
            row["speedup"] = row["full_prefill_ttft_ms"] / row["ttft_ms"]
            rows.append(row)
            print(f"{name:10s} step {i + 1}: {row['prompt_tokens']} prompt tokens, {row['cached_share']:.0%} cached, "
                  f"TTFT {row['ttft_ms']:.0f} ms against {row['full_prefill_ttft_ms']:.0f} ms full prefill "
                  f"({row['speedup']:.1f}x)")
        report[name] = rows
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": a.runs, **report}, indent=1) + "\n")


if __name__ == "__main__":
    main()
