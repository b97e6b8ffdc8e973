"""LangChain classes over pcache-rag's public API.

* :class:`PromptCacheRetriever` - a ``BaseRetriever`` returning ``Document``s
  whose metadata carries the module id and store key.
* :class:`PromptCacheLLM` - an ``LLM``: ``invoke(question, handles=[...])``
  answers from cached states (``_call``/``_stream``, emitting
  ``on_llm_new_token``); without handles it reads the plain prompt.
* :func:`build_qa_chain` - an LCEL runnable question -> answer supporting
  ``invoke``, ``stream`` and ``ainvoke``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.language_models.llms import LLM
from langchain_core.outputs import GenerationChunk
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableGenerator, RunnableLambda

from pcache_rag.rag import CachedRAG, ModuleHandle


def handles_from_documents(docs: list[Document]) -> list[ModuleHandle]:
    out = []
    for d in docs:
        m = d.metadata
        if "module_id" not in m:
            raise ValueError("document has no module_id in its metadata: retrieve with PromptCacheRetriever")
        out.append(ModuleHandle(id=m["module_id"], score=float(m.get("score", 0.0)), kv_key=m["kv_key"],
                                source=m.get("source", ""), text=d.page_content, n_tokens=int(m.get("n_tokens", 0)),
                                metadata=dict(m)))
    return out


class PromptCacheRetriever(BaseRetriever):
    """Retrieves chunk handles as Documents and starts prefetching their states."""

    rag: Any  # CachedRAG (Any: pydantic need not validate it)
    k: int = 4

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        docs = []
        for h in self.rag.retrieve(query, self.k):
            meta = dict(h.metadata)
            meta.update({"module_id": h.id, "kv_key": h.kv_key, "source": h.source, "score": h.score})
            docs.append(Document(page_content=h.text, metadata=meta, id=h.id))
        return docs


class PromptCacheLLM(LLM):
    """A LangChain LLM that answers from cached module states when given handles."""

    rag: Any  # CachedRAG
    max_new_tokens: int = 128
    recompute: str | None = None  # e.g. "epic:16"; None: the CachedRAG's policy

    @property
    def _llm_type(self) -> str:
        return "pcache-rag"

    @property
    def _identifying_params(self) -> dict:
        return {"model": self.rag.pc.model.config.model_type, "max_new_tokens": self.max_new_tokens}

    def _gen(self, stop, kwargs) -> dict:
        return {"max_new_tokens": kwargs.get("max_new_tokens", self.max_new_tokens), "stop": stop}

    def _call(self, prompt: str, stop: list[str] | None = None,
              run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> str:
        text = ""
        for chunk in self._stream(prompt, stop, run_manager, **kwargs):
            text += chunk.text
        return text

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        handles = kwargs.get("handles")
        gen = self._gen(stop, kwargs)
        recompute = kwargs.get("recompute", self.recompute)
        it = (self.rag.stream(prompt, handles=handles, **({"recompute": recompute} if recompute else {}), **gen)
              if handles else self.rag.pc.stream_text(prompt, **gen))
        for delta in it:
            chunk = GenerationChunk(text=delta)
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk


def build_qa_chain(rag: CachedRAG, k: int = 4, max_new_tokens: int = 128) -> Runnable:
    """question (str) -> answer (str), through the cache: retrieve handles, then generate."""
    retriever = PromptCacheRetriever(rag=rag, k=k)
    llm = PromptCacheLLM(rag=rag, max_new_tokens=max_new_tokens)

    def retrieve(question: str) -> dict:
        return {"question": question, "handles": handles_from_documents(retriever.invoke(question))}

    def answer(inputs: Iterator[dict]) -> Iterator[str]:
        for x in inputs:
            yield from llm.stream(x["question"], handles=x["handles"])

    async def aanswer(inputs: AsyncIterator[dict]) -> AsyncIterator[str]:
        async for x in inputs:
            it = iter(llm.stream(x["question"], handles=x["handles"]))
            while True:
                delta = await asyncio.to_thread(next, it, None)
                if delta is None:
                    return
                yield delta

    return RunnableLambda(retrieve) | RunnableGenerator(answer, aanswer)
