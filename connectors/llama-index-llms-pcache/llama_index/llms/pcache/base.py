"""LlamaIndex classes over pcache-rag's public API.

* :class:`PromptCacheLLM` - an LLM whose ``chat`` goes through the model's own chat
  template; documents marked in a prompt (:func:`pcache_rag.docmodules.format_documents`)
  are read from cached states. Sync, streaming and async (async runs off the event loop).
  Every response carries ``ttft_s``, ``cached_tokens`` and ``computed_tokens`` in
  ``additional_kwargs``, and every ``Response`` a synthesizer makes with it, the stock ones
  included, carries them summed in ``metadata["pcache"]`` (:class:`CacheStatsHandler`). ``structured_predict`` (and ``as_structured_llm``) decode under the
  output class's JSON-schema grammar; ``response_format`` per call does the same for chat
  (a ``formatted=True`` completion is read as written: the grammar applies, no schema is added).
  It is a ``FunctionCallingLLM``: ``chat_with_tools`` and agents (``FunctionAgent``) get tool
  calls whose JSON is decoded under each tool's schema (:mod:`pcache_rag.tools`).
* :class:`PromptCacheEncoder` - a ``TransformComponent`` for ``IngestionPipeline``: encodes
  each node's states and writes the handle (``pcache_kv_key``) into its metadata, for any
  vector store.
* :class:`PromptCacheSynthesizer` - a response synthesizer that hands the retrieved nodes to
  the LLM as cached modules: ``index.as_query_engine(llm=llm, response_synthesizer=...)``.
  Its ``text_qa_template`` (a ``PromptTemplate`` or ``ChatPromptTemplate`` with
  ``{context_str}`` and ``{query_str}``) can be replaced with ``update_prompts``.
* :class:`PromptCacheChatEngine` - ``CondensePlusContextChatEngine`` whose context comes from
  cached states (the chat history goes after the documents).
* :class:`PromptCacheRetriever` - a retriever over an index made by ``pcache-rag ingest``.
* :func:`build_query_engine` - a stock ``RetrieverQueryEngine`` of the retriever and synthesizer.
* :class:`PromptCacheFileReader` / :func:`file_extractor` - PDF, HTML and DOCX for
  ``SimpleDirectoryReader``, with the parsers ``pcache-rag ingest`` uses.

Nodes are keyed by ``node.get_content(metadata_mode=MetadataMode.LLM)``: the text the LLM
would read. A node that nobody encoded is encoded on first use and stored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import warnings
from contextvars import ContextVar
from collections.abc import AsyncGenerator, Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseAsyncGen, ChatResponseGen,
                                              CompletionResponse, CompletionResponseAsyncGen, CompletionResponseGen,
                                              LLMMetadata, MessageRole)
from llama_index.core.base.response.schema import Response
from llama_index.core.chat_engine import CondensePlusContextChatEngine
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.prompts import BasePromptTemplate, ChatPromptTemplate, PromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.readers.base import BaseReader
from llama_index.core.types import PydanticProgramMode
from llama_index.core.schema import (BaseNode, Document, MetadataMode, NodeWithScore, QueryBundle, TextNode,
                                     TransformComponent)
from pydantic import ConfigDict, Field, PrivateAttr

# Only the model-free part of pcache-rag loads with the connector: the engine (torch,
# transformers) loads when the first model is built, so importing this costs what the
# framework costs.
from pcache_rag import connector, tools
from pcache_rag.docmodules import DEFAULT_SYSTEM, format_documents, sampling
from pcache_rag.grammar import json_grammar, resolve, with_instruction
from pcache_rag.request import SamplingParams

if TYPE_CHECKING:
    from pcache_rag.docmodules import Assembler
    from pcache_rag.engine import Generation

DEFAULT_MODEL = "smollm2-135m-instruct"
KEY = "pcache_kv_key"

#: the default question prompt: the system prompt and preface documents are encoded against,
#: so the whole prefix is one cached module and only the question is computed
DEFAULT_QA_TEMPLATE = ChatPromptTemplate.from_messages([
    ("system", DEFAULT_SYSTEM), ("user", "Documents:\n\n{context_str}\n\nQuestion: {query_str}")])


class PromptCacheLLM(FunctionCallingLLM):
    """A LlamaIndex LLM on pcache-rag's engine (see the module docstring).

    ``model``: the embedded ``smollm2-135m-instruct`` or a local folder / ``.gguf``. States live
    in ``index_dir/kv`` (an index made by ``pcache-rag ingest``), else ``cache_dir`` (default
    ``~/.cache/pcache-rag/states``). ``temperature`` 0 is greedy; ``top_p``, ``seed`` and
    ``stop`` are honoured, per instance or per call. ``complete(prompt)`` reads the prompt as
    one user turn of the chat template (``formatted=True``: as raw text). ``tool_plan``: tools
    called in this order after the user's message, before a text answer
    (:func:`pcache_rag.tools.planned`), for models too small to choose a tool themselves.
    """

    # a constructor argument the engine does not take (context_window=, generate_kwargs=) is
    # refused by name, as per-call ones are, instead of being accepted and dropped
    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    model: str = DEFAULT_MODEL
    index_dir: str | None = None
    cache_dir: str | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    recompute: str | None = Field(default="auto", description="quality recovery policy: 'auto' (the RAG default, "
                                  "each:1), None or 'none' (the cache alone), 'match:1', 'epic:16', 'blend:0.15'")
    document_preamble: str = DEFAULT_SYSTEM
    learn_documents: bool = Field(default=True, description="take a prompt's unknown documents from its blocks "
                                  "between blank lines, encoded on first sight and read from the cache next time")
    namespace: str = Field(default="", description="whose prompts these are: what they teach is kept for this "
                           "namespace alone (the ingested index is shared by design)")
    tool_plan: list[str] = Field(default_factory=list, description="tools called in this order after the "
                                 "user's message, then a text answer (for models too small to choose)")
    #: structured_predict writes the schema into the prompt and decodes under its grammar (a
    #: FunctionCallingLLM's default would make the schema a tool and require a call of it)
    pydantic_program_mode: PydanticProgramMode = PydanticProgramMode.LLM
    _assembler: Any = PrivateAttr(default=None)  # an Assembler, once the engine is loaded

    def model_post_init(self, __context: Any) -> None:
        super().model_post_init(__context)
        connector.check_recompute(self.recompute)  # a bad policy is refused here, not at the first call
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        _install_stats_handler()  # cache statistics on every synthesizer's Response

    @classmethod
    def class_name(cls) -> str:
        return "PromptCacheLLM"

    @property
    def assembler(self) -> Assembler:
        if self._assembler is None:
            self._assembler = connector.assembler(self.model, self.index_dir, self.cache_dir, self.document_preamble)
        return self._assembler

    @property
    def metadata(self) -> LLMMetadata:
        # the context window is the loaded model's (reading it loads the engine, once per config)
        return LLMMetadata(context_window=self.assembler.max_positions, num_output=self.max_new_tokens, model_name=self.model,
                           is_chat_model=True, is_function_calling_model=True, system_role=MessageRole.SYSTEM)

    # ------------------------------------------------------------------ internals

    def _gen(self, kwargs: dict, chat: bool = False) -> tuple[SamplingParams, Any, str]:
        """(how to decode, recompute policy, instruction for the prompt), built once from a call's
        keywords; anything the engine cannot honour is refused by name. ``response_format``
        (OpenAI's shapes) or ``grammar`` (:mod:`pcache_rag.grammar`) constrains the answer.
        ``chat`` calls also take ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (read by
        :meth:`_iter`)."""
        kwargs = dict(kwargs)
        kwargs.pop("formatted", None)
        for name in _TOOL_KEYS if chat else ():
            kwargs.pop(name, None)
        unknown = set(kwargs) - {"temperature", "top_p", "seed", "stop", "max_new_tokens", "max_tokens", "recompute",
                                 "response_format", "grammar"}
        if unknown:
            raise TypeError(f"PromptCacheLLM does not support: {', '.join(sorted(unknown))}")
        grammar, instruction = resolve(kwargs.get("response_format"), kwargs.get("grammar"))
        n = kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens))
        gen = sampling(n, kwargs.get("temperature", self.temperature), kwargs.get("top_p", self.top_p),
                       kwargs.get("seed", self.seed), kwargs.get("stop", self.stop), grammar=grammar)
        return gen, kwargs.get("recompute", self.recompute), instruction

    def _iter(self, turns: list[tuple[str, str]] | None, text: str | None, kwargs,
              chat: bool = False) -> tuple[Generation, bool]:
        """Chat ``turns`` (a ``response_format``'s instruction goes after the last user turn; the
        tools' text into the system message), or a formatted ``text`` prompt read exactly as
        written; and whether the answer is read for tool calls (``chat`` calls only)."""
        gen, recompute, instruction = self._gen(kwargs, chat=chat)
        read_calls = False
        if chat and turns is not None:
            use = tools.prepare(turns, kwargs.get("tools"), kwargs.get("tool_choice"), kwargs.get("parallel_tool_calls"),
                                grammar_given=gen.grammar is not None, plan=self.tool_plan)
            turns, read_calls = use.turns, use.parse
            if gen.grammar is None and use.grammar is not None:
                gen = dataclasses.replace(gen, grammar=use.grammar)
        asm = self.assembler
        learn = self.learn_documents
        ns = self.namespace
        segs = asm.message_segments(with_instruction(turns, instruction), learn=learn, tenant=ns) \
            if turns is not None else asm.text_segments(text or "", learn=learn, tenant=ns)
        return asm.stream(segs, recompute=recompute, params=gen), read_calls

    def _complete_iter(self, prompt: str, formatted: bool, kwargs) -> CompletionResponseGen:
        text = ""
        turns, raw = (None, prompt) if formatted else ([("user", prompt)], None)
        stream = self._iter(turns, raw, kwargs)[0]
        for item in stream:  # text deltas; then stream.output
            text += item
            yield CompletionResponse(text=text, delta=item)
        stats = stream.result().stats()  # the stream is drained: its output
        yield CompletionResponse(text=text, delta="", additional_kwargs=stats, raw=stats)

    def _chat_iter(self, messages: Sequence[ChatMessage], kwargs) -> ChatResponseGen:
        """Responses as the answer is decoded. With tools, a call's name and its arguments so far are
        in ``message.additional_kwargs["tool_calls"]`` (OpenAI's shape) as they stream; the text
        outside calls is the content."""
        stream, read_calls = self._iter(_turns(messages), None, kwargs, chat=True)
        reader = tools.CallStream() if read_calls else None
        text = ""
        calls: list[dict] = []
        # the text deltas, then None: the end (stream.output is set), where a call still open is flushed
        for item in itertools.chain(stream, [None]):
            deltas = (reader.feed(item) if reader else [tools.Delta(text=item)]) if item is not None else \
                (reader.flush() if reader else [])
            delta = ""
            for d in deltas:
                if d.index < 0:
                    delta += d.text
                elif d.name is not None:
                    calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
                else:
                    calls[d.index]["function"]["arguments"] += d.arguments
            text += delta
            extra = {"tool_calls": [dict(c, function=dict(c["function"])) for c in calls]} if calls else {}
            if item is not None:
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text,
                                                       additional_kwargs=extra), delta=delta)
            else:
                stats = stream.result().stats()
                calls = _whole(calls)
                extra = {"tool_calls": calls} if calls else {}
                content = text.strip() if calls else text
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=content,
                                                       additional_kwargs=extra), delta=delta,
                                   additional_kwargs=stats, raw=stats)

    # ------------------------------------------------------------------ tools (FunctionCallingLLM)

    def _prepare_chat_with_tools(self, tools: Sequence[Any], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 tool_choice: Any = None, **kwargs: Any) -> dict[str, Any]:
        """``chat`` arguments for a call with ``tools`` (LlamaIndex ``BaseTool`` s): their OpenAI
        specs, ``tool_choice`` (``tool_required`` makes it ``"required"``) and the messages."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str) else user_msg)
        if tool_choice is None and tool_required:
            tool_choice = "required"
        return {"messages": messages, "tools": [t.metadata.to_openai_tool() for t in tools] or None,
                "tool_choice": tool_choice, "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        """The response's tool calls (complete ones; a call still streaming has its arguments so far,
        read leniently)."""
        out = [ToolSelection(tool_id=c.id, tool_name=c.name, tool_kwargs=c.arguments)
               for c in tools.from_openai(response.message.additional_kwargs.get("tool_calls"))]
        if not out and error_on_no_tool_call:
            raise ValueError(f"the model called no tool; it answered: {(response.message.content or '')[:200]!r}")
        return out

    # ------------------------------------------------------------------ sync

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        last = None
        for last in self._complete_iter(prompt, formatted, kwargs):
            pass
        return last

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._complete_iter(prompt, formatted, kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        last = None
        for last in self._chat_iter(messages, kwargs):
            pass
        return last

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._chat_iter(messages, kwargs)

    # ------------------------------------------------------------------ structured output
    # LlamaIndex's own program (LLMTextCompletionProgram) writes the prompt, with the schema in
    # it, and parses the answer; these add the schema's grammar, so the JSON it parses is whole
    # and matches the schema. as_structured_llm() goes through them too.

    def structured_predict(self, output_cls, prompt, llm_kwargs=None, **prompt_args):
        """``output_cls`` from ``prompt``, decoded under the class's JSON-schema grammar."""
        return super().structured_predict(output_cls, prompt, _constrained(output_cls, llm_kwargs),
                                          **prompt_args)

    async def astructured_predict(self, output_cls, prompt, llm_kwargs=None, **prompt_args):
        """:meth:`structured_predict`, async."""
        return await super().astructured_predict(output_cls, prompt, _constrained(output_cls, llm_kwargs),
                                                 **prompt_args)

    def stream_structured_predict(self, output_cls, prompt, llm_kwargs=None, **prompt_args):
        """Partial ``output_cls`` objects as the constrained answer is decoded."""
        return super().stream_structured_predict(output_cls, prompt, _constrained(output_cls, llm_kwargs),
                                                 **prompt_args)

    async def astream_structured_predict(self, output_cls, prompt, llm_kwargs=None, **prompt_args):
        """:meth:`stream_structured_predict`, async."""
        return await super().astream_structured_predict(output_cls, prompt,
                                                        _constrained(output_cls, llm_kwargs), **prompt_args)

    # ------------------------------------------------------------------ async: the engine runs in a worker thread

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        connector.share_batch(self.assembler)  # concurrent calls decode together in the engine's batch
        return await connector.in_thread(lambda: list(self._complete_iter(prompt, formatted, kwargs))[-1])

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        connector.share_batch(self.assembler)
        return _athread(self._complete_iter(prompt, formatted, kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        connector.share_batch(self.assembler)
        return await connector.in_thread(lambda: list(self._chat_iter(messages, kwargs))[-1])

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        connector.share_batch(self.assembler)
        return _athread(self._chat_iter(messages, kwargs))


def _whole(calls: list[dict]) -> list[dict]:
    """The calls whose arguments parse; one cut short by the token limit is dropped, with a warning
    (the engine's ``StructuredOutputWarning`` has said the answer was cut)."""
    out = []
    for c in calls:
        try:
            json.loads(c["function"]["arguments"])
            out.append(c)
        except json.JSONDecodeError:
            warnings.warn(f"PromptCacheLLM: the call of {c['function']['name']!r} was cut short by max_new_tokens "
                          "and is dropped (raise max_new_tokens)", stacklevel=3)
    return out


#: chat keywords read by the tools' path, not by the engine's sampling
_TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")


def _calls_of(m: ChatMessage) -> list[tools.ToolCall]:
    """An assistant message's tool calls: OpenAI's shape in ``additional_kwargs`` (ours, and other
    LLMs' in a shared history) or ``ToolCallBlock`` s."""
    out = tools.from_openai(m.additional_kwargs.get("tool_calls"))
    if not out:
        for b in m.blocks:
            if getattr(b, "block_type", None) == "tool_call":
                args = b.tool_kwargs if isinstance(b.tool_kwargs, dict) else json.loads(b.tool_kwargs or "{}")
                out.append(tools.ToolCall(b.tool_call_id or "", b.tool_name, args))
    return out


# ---------------------------------------------------------------------- cache statistics on stock responses

#: the statistics of the LLM calls inside each synthesis in progress (innermost last), per context
_SYNTHESES: ContextVar[tuple[dict, ...]] = ContextVar("pcache_syntheses", default=())
_TOTALS = ("prompt_tokens", "cached_tokens", "computed_tokens", "encoded_tokens", "recomputed_tokens",
           "output_tokens", "documents")


class CacheStatsHandler(BaseEventHandler):
    """Puts this LLM's cache statistics on every ``Response`` a LlamaIndex synthesizer makes with it
    (``Response.metadata["pcache"]``): the stock ones too (compact, refine, tree_summarize, the query
    engines' defaults), through LlamaIndex's instrumentation events, with no change to them. The
    counts are summed over the synthesis's LLM calls (``llm_calls``); ``ttft_s`` is the first
    call's. A streamed stock response has none (its answer is not decoded when it is returned;
    :class:`PromptCacheSynthesizer` adds them as it streams). Installed once, by the first
    :class:`PromptCacheLLM`."""

    @classmethod
    def class_name(cls) -> str:
        return "PromptCacheStatsHandler"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, SynthesizeStartEvent):
            _SYNTHESES.set((*_SYNTHESES.get(), {}))
        elif isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)):
            open_ = _SYNTHESES.get()
            stats = getattr(event.response, "additional_kwargs", None) or {}
            if open_ and "cached_tokens" in stats:
                _add(open_[-1], stats)
        elif isinstance(event, SynthesizeEndEvent):
            open_ = _SYNTHESES.get()
            if not open_:
                return
            _SYNTHESES.set(open_[:-1])
            totals, response = open_[-1], event.response
            if totals and isinstance(response, Response):
                response.metadata = response.metadata or {}
                response.metadata.setdefault("pcache", totals)


def _add(totals: dict, stats: dict) -> None:
    if not totals:
        totals.update(llm_calls=0, ttft_s=stats.get("ttft_s"), **dict.fromkeys(_TOTALS, 0))
    totals["llm_calls"] += 1
    for k in _TOTALS:
        totals[k] += stats.get(k) or 0


_HANDLER: list[CacheStatsHandler] = []


def _install_stats_handler() -> None:
    if not _HANDLER:
        _HANDLER.append(CacheStatsHandler())
        get_dispatcher().add_event_handler(_HANDLER[0])


async def _athread(it) -> AsyncGenerator:
    """Advance a blocking generator in worker threads (the engine allows that)."""
    while True:
        item = await connector.in_thread(next, it, None)
        if item is None:
            return
        yield item


class PromptCacheEncoder(TransformComponent):
    """Encodes each node's attention states into the store (an ``IngestionPipeline`` step; put it
    after the splitter) and records the handle in ``node.metadata["pcache_kv_key"]`` (hidden from
    embeddings and the LLM). Use the same ``model`` and ``cache_dir`` / ``index_dir`` as the
    :class:`PromptCacheLLM` that answers. Encoding a node twice costs nothing."""

    model: str = DEFAULT_MODEL
    index_dir: str | None = None
    cache_dir: str | None = None
    document_preamble: str = DEFAULT_SYSTEM

    @classmethod
    def class_name(cls) -> str:
        return "PromptCacheEncoder"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[BaseNode]:

        asm = connector.assembler(self.model, self.index_dir, self.cache_dir, self.document_preamble)
        for n in nodes:  # the key stays out of the text the LLM reads, so the key never changes it
            for keys in (n.excluded_llm_metadata_keys, n.excluded_embed_metadata_keys):
                if KEY not in keys:
                    keys.append(KEY)
        texts = [n.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]
        keys = asm.ensure(texts, progress=bool(kwargs.get("show_progress", False)))
        for n, k in zip(nodes, keys):
            n.metadata[KEY] = k
        return list(nodes)


class PromptCacheSynthesizer(BaseSynthesizer):
    """Answers from the retrieved nodes' cached states (sync, streaming, async).

    ``text_qa_template`` needs ``{context_str}`` (the documents) and ``{query_str}``; a
    ``ChatPromptTemplate`` goes through ``llm.chat``, a ``PromptTemplate`` through
    ``llm.complete`` as one user turn. The default puts the question after the documents, so
    only the question is computed."""

    def __init__(self, llm: PromptCacheLLM, text_qa_template: BasePromptTemplate | None = None,
                 streaming: bool = False, **kwargs: Any):
        if not isinstance(llm, PromptCacheLLM):
            raise TypeError(f"PromptCacheSynthesizer needs a PromptCacheLLM, not {type(llm).__name__}: other LLMs "
                            "cannot read cached states")
        super().__init__(llm=llm, streaming=streaming, **kwargs)
        self._qa = _check_template(text_qa_template or DEFAULT_QA_TEMPLATE)

    def _get_prompts(self) -> dict:
        return {"text_qa_template": self._qa}

    def _update_prompts(self, prompts: dict) -> None:
        unknown = set(prompts) - {"text_qa_template"}
        if unknown:
            raise ValueError(f"PromptCacheSynthesizer has only text_qa_template, not {', '.join(sorted(unknown))}")
        if "text_qa_template" in prompts:
            self._qa = _check_template(prompts["text_qa_template"])

    def _responses(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any):
        ctx = format_documents(text_chunks)
        # through the LLM's public streaming methods: their decorators emit LlamaIndex's
        # instrumentation and callback events (LLMChat*/LLMCompletion*, what TokenCountingHandler
        # and LlamaDebugHandler read)
        if isinstance(self._qa, ChatPromptTemplate):
            return self._llm.stream_chat(self._qa.format_messages(context_str=ctx, query_str=query_str), **kwargs)
        return self._llm.stream_complete(self._qa.format(context_str=ctx, query_str=query_str), formatted=False,
                                         **kwargs)

    def synthesize(self, query, nodes, additional_source_nodes=None, **response_kwargs):
        r = super().synthesize(query, nodes, additional_source_nodes, **response_kwargs)
        deltas = getattr(r, "response_gen", None)
        if self._streaming and isinstance(deltas, _Deltas):
            def with_stats():  # this call's statistics join once its answer is decoded
                yield from deltas
                if deltas.stats:
                    r.metadata = {**(r.metadata or {}), "pcache": deltas.stats}

            r.response_gen = with_stats()
        elif getattr(self, "last_stats", None):
            r.metadata = {**(r.metadata or {}), "pcache": self.last_stats}  # TTFT, cached/computed tokens
        return r

    async def asynthesize(self, query, nodes, additional_source_nodes=None, **response_kwargs):
        r = await super().asynthesize(query, nodes, additional_source_nodes, **response_kwargs)
        deltas = getattr(r, "response_gen", None)
        if self._streaming and isinstance(deltas, _AsyncDeltas):
            async def with_stats():  # this call's statistics join once its answer is decoded
                async for d in deltas:
                    yield d
                if deltas.stats:
                    r.metadata = {**(r.metadata or {}), "pcache": deltas.stats}

            r.response_gen = with_stats()
        elif not self._streaming and getattr(self, "last_stats", None):
            r.metadata = {**(r.metadata or {}), "pcache": self.last_stats}
        return r

    def get_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any):
        it = self._responses(query_str, text_chunks, **kwargs)
        self.last_stats = None
        if self._streaming:
            return _Deltas(it, self)
        last = None
        for last in it:
            pass
        self.last_stats = last.additional_kwargs
        return last.message.content if isinstance(last, ChatResponse) else last.text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any):
        it = self._responses(query_str, text_chunks, **kwargs)
        if self._streaming:
            return _AsyncDeltas(it, self)
        last = (await asyncio.to_thread(list, it))[-1]
        self.last_stats = last.additional_kwargs
        return last.message.content if isinstance(last, ChatResponse) else last.text


class _StatsTap:
    """Text deltas of one answer's responses; the last response's statistics are kept in
    ``stats`` (per call, so concurrent streams on one synthesizer do not mix them)."""

    def __init__(self, synth: PromptCacheSynthesizer) -> None:
        self._synth = synth
        self.stats: dict | None = None

    def _take(self, r) -> str | None:
        """``r``'s delta, or None after keeping the statistics the last response carries."""
        if r.delta:
            return r.delta
        if r.additional_kwargs:
            self.stats = self._synth.last_stats = r.additional_kwargs
        return None


class _Deltas(_StatsTap, Generator):
    """A ``Generator`` by its ABC, which is what LlamaIndex checks for a streamed answer."""

    def __init__(self, responses, synth: PromptCacheSynthesizer) -> None:
        super().__init__(synth)
        self._it = iter(responses)

    def send(self, value: None) -> str:
        while (d := self._take(next(self._it))) is None:  # StopIteration ends the answer
            pass
        return d

    def throw(self, typ, val=None, tb=None):
        close = getattr(self._it, "close", None)
        if close is not None:
            close()
        raise val if val is not None else typ()


class _AsyncDeltas(_StatsTap, AsyncGenerator):
    """An ``AsyncGenerator`` by its ABC, advanced in worker threads (the engine allows that)."""

    def __init__(self, responses, synth: PromptCacheSynthesizer) -> None:
        super().__init__(synth)
        self._it = _athread(responses)

    async def asend(self, value: None) -> str:
        while (d := self._take(await self._it.__anext__())) is None:  # StopAsyncIteration ends it
            pass
        return d

    async def athrow(self, typ, val=None, tb=None):
        await self._it.aclose()
        raise val if val is not None else typ()


def _check_template(t) -> BasePromptTemplate:
    if isinstance(t, str):
        t = PromptTemplate(t)
    need = {"context_str", "query_str"} - set(t.template_vars)
    if need:
        raise ValueError(f"the question template lacks {', '.join(sorted(need))}: PromptCacheSynthesizer puts the "
                         "documents in {context_str} and the question in {query_str}")
    return t


class PromptCacheChatEngine(CondensePlusContextChatEngine):
    """``CondensePlusContextChatEngine`` that answers from cached document states: the system
    message holds the context prompt with the documents as modules, then the chat history and
    the new message are computed. Build it like the stock one::

        PromptCacheChatEngine.from_defaults(retriever=index.as_retriever(), llm=PromptCacheLLM())
    """

    def _get_response_synthesizer(self, chat_history: list[ChatMessage], streaming: bool = False):
        if not isinstance(self._llm, PromptCacheLLM):
            raise TypeError(f"PromptCacheChatEngine needs a PromptCacheLLM, not {type(self._llm).__name__}")
        msgs = [ChatMessage(role=MessageRole.SYSTEM,
                            content=self._context_prompt_template.template + (self._system_prompt or "").strip()),
                *chat_history, ChatMessage(role=MessageRole.USER, content="{query_str}")]
        return PromptCacheSynthesizer(self._llm, text_qa_template=ChatPromptTemplate(msgs), streaming=streaming,
                                      callback_manager=self.callback_manager)


class PromptCacheRetriever(BaseRetriever):
    """Retrieves chunks from an index made by ``pcache-rag ingest``. A node's text is the chunk
    exactly as the model reads it, so the synthesizer hits the states encoded at ingest."""

    def __init__(self, index_dir: str, similarity_top_k: int = 4, model: str = DEFAULT_MODEL, **kwargs: Any):
        connector.check_count("similarity_top_k", similarity_top_k)
        connector.check_index(index_dir)
        super().__init__(**kwargs)
        self.index_dir, self.similarity_top_k, self.model = str(index_dir), similarity_top_k, model
        self._rag = None

    @property
    def rag(self):
        if self._rag is None:
            self._rag = connector.index_rag(self.model, self.index_dir, self.similarity_top_k)
        return self._rag

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        out = []
        for h in self.rag.retrieve(query_bundle.query_str, self.similarity_top_k):
            meta = dict(h.metadata)
            meta.update({"module_id": h.id, KEY: h.kv_key, "source": h.source})
            node = TextNode(id_=h.id, text=self.rag.chunk_text(h), metadata=meta,
                            excluded_llm_metadata_keys=list(meta), excluded_embed_metadata_keys=list(meta))
            out.append(NodeWithScore(node=node, score=h.score))
        return out

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


def build_query_engine(index_dir: str, similarity_top_k: int = 4, streaming: bool = False,
                       max_new_tokens: int = 128, **llm_kwargs: Any) -> RetrieverQueryEngine:
    """A stock ``RetrieverQueryEngine`` over a pcache-rag index that answers through the cache."""
    llm = PromptCacheLLM(index_dir=index_dir, max_new_tokens=max_new_tokens, **llm_kwargs)
    return RetrieverQueryEngine(retriever=PromptCacheRetriever(index_dir, similarity_top_k=similarity_top_k),
                                response_synthesizer=PromptCacheSynthesizer(llm, streaming=streaming))


class PromptCacheFileReader(BaseReader):
    """Reads PDF (one ``Document`` per page, with ``page_label``), HTML and DOCX files with the
    same parsers as ``pcache-rag ingest``. Use it in ``SimpleDirectoryReader(...,
    file_extractor=file_extractor())``. An unreadable file raises with the reason (LlamaIndex
    then names it, or skips it with ``raise_on_error=False``)."""

    def load_data(self, file: Path, extra_info: dict | None = None, fs=None) -> list[Document]:
        from pcache_rag.rag.chunking import SkipFile, read_document

        try:
            doc = read_document(Path(file))
        except SkipFile as e:
            raise ValueError(f"{file}: {e}") from None
        meta = dict(extra_info or {})
        if doc.pages:
            return [Document(text=t, metadata={**meta, "page_label": str(i + 1)})
                    for i, t in enumerate(doc.pages) if t.strip()]
        return [Document(text=doc.text, metadata=meta)]


def file_extractor() -> dict[str, BaseReader]:
    """``file_extractor`` for ``SimpleDirectoryReader``: PDF, HTML and DOCX through pcache-rag's parsers."""
    from pcache_rag.rag.chunking import DOC_SUFFIXES

    r = PromptCacheFileReader()
    return {s: r for s in DOC_SUFFIXES}


class MiniLMEmbedding(BaseEmbedding):
    """The packaged all-MiniLM-L6-v2 (384-dim) as a LlamaIndex embedding model: offline, no hub."""

    model_name: str = "all-MiniLM-L6-v2"

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    def _vecs(self, texts: list[str]) -> list[list[float]]:
        return connector.embed(texts)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vecs([query])[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vecs([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._vecs(texts)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return await asyncio.to_thread(self._get_query_embedding, query)


def _turns(messages: Sequence[ChatMessage]) -> list[tuple[str, str]]:
    """LlamaIndex messages as the engine's (role, text) turns; an assistant's tool calls written
    into its text as the chat template shows them."""
    msgs = []
    for m in messages:
        role = {MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant",
                MessageRole.DEVELOPER: "system", MessageRole.TOOL: "tool"}.get(m.role)
        if role is None:
            raise NotImplementedError(f"PromptCacheLLM does not support {m.role.value!r} messages")
        text = m.content or ""
        calls = _calls_of(m) if role == "assistant" else []
        msgs.append((role, tools.render_calls(text, calls) if calls else text))
    return msgs


def _constrained(output_cls: type, llm_kwargs: dict | None) -> dict:
    """A structured call's keywords with ``output_cls``'s JSON-schema grammar, unless the caller
    gave a ``response_format`` or ``grammar`` of its own."""
    kw = dict(llm_kwargs or {})
    if "response_format" not in kw and "grammar" not in kw:
        kw["grammar"] = json_grammar(output_cls.model_json_schema())  # type: ignore[attr-defined]
    return kw
