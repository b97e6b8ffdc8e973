"""LlamaIndex classes over pcache-rag's public API.

* :class:`PromptCacheLLM` - a ``CustomLLM``. ``complete(prompt, handles=[...])``
  answers ``prompt`` (the question) from the handles' cached states; with no
  handles it is an ordinary LLM over the plain text prompt.
* :class:`ModuleRetriever` - a ``BaseRetriever`` returning ``NodeWithScore``
  whose metadata carries the module id and store key (text for display only).
* :class:`ModuleSynthesizer` - hands *handles*, not text, to the LLM; sync,
  streaming and async.
* :func:`build_query_engine` - a stock ``RetrieverQueryEngine`` of the two.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from pydantic import PrivateAttr

from pcache_rag.rag import CachedRAG, ModuleHandle


def handles_from_nodes(nodes: Sequence[NodeWithScore]) -> list[ModuleHandle]:
    """Rebuild module handles from retrieved nodes (their metadata carries the module)."""
    out = []
    for n in nodes:
        m = n.node.metadata
        if "module_id" not in m:
            raise ValueError("node has no module_id in its metadata: retrieve with ModuleRetriever")
        out.append(ModuleHandle(id=m["module_id"], score=float(n.score or 0.0), kv_key=m["kv_key"],
                                source=m.get("source", ""), text=n.node.get_content(),
                                n_tokens=int(m.get("n_tokens", 0)), metadata=dict(m)))
    return out


class PromptCacheLLM(CustomLLM):
    """A LlamaIndex LLM that answers from cached module states when given handles."""

    max_new_tokens: int = 128
    model_name: str = "pcache-rag"
    recompute: str | None = None  # e.g. "epic:16"; None: the CachedRAG's policy
    _rag: CachedRAG = PrivateAttr()

    def __init__(self, rag: CachedRAG, max_new_tokens: int = 128, **kwargs: Any):
        super().__init__(max_new_tokens=max_new_tokens, **kwargs)
        self._rag = rag

    @property
    def rag(self) -> CachedRAG:
        return self._rag

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self._rag.pc.max_positions, num_output=self.max_new_tokens,
                           model_name=self.model_name, is_chat_model=False)

    def _recompute(self, kwargs: dict) -> dict:
        r = kwargs.pop("recompute", self.recompute)
        return {} if r is None else {"recompute": r}

    def _stats(self) -> dict:
        o = self._rag.pc.last_output
        return {} if o is None else {"ttft_s": o.ttft_s, "cached_tokens": o.cached_tokens,
                                     "computed_tokens": o.computed_tokens, "recomputed_tokens": o.recomputed_tokens}

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        handles = kwargs.pop("handles", None)
        gen = {"max_new_tokens": kwargs.pop("max_new_tokens", self.max_new_tokens)}
        if handles:
            text = self._rag.answer(prompt, handles=handles, **self._recompute(kwargs), **gen).text
        else:
            text = self._rag.pc.generate_text(prompt, **gen).text
        return CompletionResponse(text=text, additional_kwargs=self._stats())

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        handles = kwargs.pop("handles", None)
        gen = {"max_new_tokens": kwargs.pop("max_new_tokens", self.max_new_tokens)}
        it = (self._rag.stream(prompt, handles=handles, **self._recompute(kwargs), **gen) if handles
              else self._rag.pc.stream_text(prompt, **gen))

        def responses():
            text = ""
            for delta in it:
                text += delta
                yield CompletionResponse(text=text, delta=delta)

        return responses()


class ModuleRetriever(BaseRetriever):
    """Retrieves chunk handles (as nodes) and starts prefetching their states."""

    def __init__(self, rag: CachedRAG, k: int | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._rag = rag
        self._k = k

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        out = []
        for h in self._rag.retrieve(query_bundle.query_str, self._k):
            meta = dict(h.metadata)
            meta.update({"module_id": h.id, "kv_key": h.kv_key, "source": h.source})
            node = TextNode(id_=h.id, text=h.text, metadata=meta,
                            excluded_llm_metadata_keys=list(meta), excluded_embed_metadata_keys=list(meta))
            out.append(NodeWithScore(node=node, score=h.score))
        return out


class ModuleSynthesizer(BaseSynthesizer):
    """Passes the nodes' module handles (not their text) to :class:`PromptCacheLLM`."""

    def __init__(self, llm: PromptCacheLLM, streaming: bool = False, **kwargs: Any):
        super().__init__(llm=llm, streaming=streaming, **kwargs)

    def _get_prompts(self) -> dict:
        return {}

    def _update_prompts(self, prompts: dict) -> None:
        return None

    def synthesize(self, query, nodes, additional_source_nodes=None, **response_kwargs):
        return super().synthesize(query, nodes, additional_source_nodes, handles=handles_from_nodes(nodes),
                                  **response_kwargs)

    async def asynthesize(self, query, nodes, additional_source_nodes=None, **response_kwargs):
        return await super().asynthesize(query, nodes, additional_source_nodes, handles=handles_from_nodes(nodes),
                                         **response_kwargs)

    def get_response(self, query_str: str, text_chunks: Sequence[str], handles=None, **kwargs: Any):
        if self._streaming:
            def deltas() -> Generator[str, None, None]:
                for r in self._llm.stream_complete(query_str, handles=handles):
                    yield r.delta or ""

            return deltas()
        return self._llm.complete(query_str, handles=handles).text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], handles=None, **kwargs: Any):
        if self._streaming:
            async def adeltas() -> AsyncGenerator[str, None]:
                it = iter(self._llm.stream_complete(query_str, handles=handles))
                while True:
                    r = await asyncio.to_thread(next, it, None)
                    if r is None:
                        return
                    yield r.delta or ""

            return adeltas()
        r = await asyncio.to_thread(self._llm.complete, query_str, handles=handles)
        return r.text


def build_query_engine(rag: CachedRAG, k: int | None = None, streaming: bool = False,
                       max_new_tokens: int = 128) -> RetrieverQueryEngine:
    """A stock ``RetrieverQueryEngine`` that answers through the cache."""
    llm = PromptCacheLLM(rag, max_new_tokens=max_new_tokens)
    return RetrieverQueryEngine(retriever=ModuleRetriever(rag, k=k),
                                response_synthesizer=ModuleSynthesizer(llm=llm, streaming=streaming))
