"""LangChain classes over pcache-rag's public API.

* :class:`ChatPromptCache` - a ``BaseChatModel``: messages go through the model's own
  chat template; documents marked by :func:`format_docs` (in any prompt template) are read
  from cached states, the rest is computed. ``usage_metadata`` reports cached tokens as
  ``input_token_details.cache_read``; time-to-first-token and computed counts are in
  ``response_metadata``. ``with_structured_output`` decodes under the schema's grammar
  (:mod:`pcache_rag.grammar`), on the cached path.
* :class:`PromptCacheDocumentEncoder` - a document transformer that encodes each
  document's states (for any ``VectorStore``: encode, then ``add_documents``).
* :func:`format_docs` / :func:`create_cached_documents_chain` - the drop-in for
  ``create_stuff_documents_chain`` (use it in ``create_retrieval_chain``) and for the
  tutorial's ``format_docs``.
* :class:`PromptCacheRetriever` - a retriever over a ``pcache-rag ingest`` index.
* :class:`PromptCacheTextLLM` - a text ``LLM`` (a completion prompt, no chat template).
* :func:`build_qa_chain` - retrieval chain over an index: ``{"input", "context", "answer"}``.

Every class is built from plain config (model path, states folder or index folder) and
shares one engine per config in the process (:func:`pcache_rag.docmodules.shared_engine`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.callbacks import (AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun,
                                      CallbackManagerForRetrieverRun)
from langchain_core.documents import BaseDocumentTransformer, Document
from langchain_core.embeddings import Embeddings
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.language_models.llms import LLM
from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, ChatMessage, HumanMessage,
                                     SystemMessage, ToolMessage)
from langchain_core.output_parsers import StrOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, GenerationChunk
from langchain_core.prompts import BasePromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnablePassthrough
from pydantic import ConfigDict, Field, PrivateAttr

# Only the model-free part of pcache-rag loads with the connector: the engine (torch,
# transformers) loads when the first model is built, so importing this costs what the
# framework costs.
from pcache_rag import connector, tools
from pcache_rag.docmodules import DEFAULT_SYSTEM, format_documents, sampling
from pcache_rag.grammar import resolve, with_instruction
from pcache_rag.request import SamplingParams

if TYPE_CHECKING:
    from pcache_rag.docmodules import Assembler
    from pcache_rag.engine import Generation, GenerationOutput

DEFAULT_MODEL = "smollm2-135m-instruct"


def format_docs(docs: Sequence[Document], separator: str = "\n\n") -> str:
    """The documents' text for a prompt's ``{context}``, each marked as a cached module.
    Use it where the LangChain RAG tutorial uses its own ``format_docs``."""
    return format_documents([d.page_content for d in docs], separator)


def create_cached_documents_chain(llm: Runnable, prompt: BasePromptTemplate, *,
                                  document_variable_name: str = "context",
                                  output_parser: Runnable | None = None) -> Runnable:
    """Drop-in for ``create_stuff_documents_chain``: the documents in ``inputs[document_variable_name]``
    reach :class:`ChatPromptCache` as cached modules instead of pasted text. Works inside
    ``create_retrieval_chain``; the prompt's other variables are filled as usual."""
    if document_variable_name not in prompt.input_variables:
        raise ValueError(f"the prompt has no {{{document_variable_name}}} variable: {prompt.input_variables}")

    def fmt(inputs: dict) -> str:
        return format_docs(inputs[document_variable_name])

    return (RunnablePassthrough.assign(**{document_variable_name: fmt}).with_config(run_name="format_inputs")
            | prompt | llm | (output_parser or StrOutputParser())).with_config(run_name="cached_documents_chain")


class _EngineConfig:
    """Shared config fields: which model and where document states live."""

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["langchain_pcache"]

    def _gen(self, stop: list[str] | None, kwargs: dict) -> tuple[SamplingParams, Any, str]:
        """(how to decode, the recompute policy, the instruction for the prompt) from the
        instance's defaults and a call's overrides, built once; anything the engine cannot honour
        is refused by name. ``response_format`` (OpenAI's shapes) or ``grammar``
        (:mod:`pcache_rag.grammar`) constrains the answer; the former's instruction goes into the prompt."""
        name = type(self).__name__
        known = {"temperature", "top_p", "seed", "max_tokens", "recompute", "model", "response_format", "grammar"}
        if isinstance(self, BaseChatModel):  # the chat model reads tools (a text prompt has no system turn)
            known |= {"tools", "tool_choice", "parallel_tool_calls"}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"{name} does not support: {', '.join(sorted(unknown))}")
        if kwargs.get("model", self.model) != self.model:
            raise ValueError(f"this {name} serves {self.model!r}, not {kwargs['model']!r}")
        grammar, instruction = resolve(kwargs.get("response_format"), kwargs.get("grammar"))
        sp = sampling(kwargs.get("max_tokens", self.max_tokens), kwargs.get("temperature", self.temperature),
                      kwargs.get("top_p", self.top_p), kwargs.get("seed", self.seed),
                      stop if stop is not None else self.stop, grammar=grammar)
        return sp, kwargs.get("recompute", self.recompute), instruction

    def _asm(self) -> Assembler:
        if self._assembler is None:  # under the index's own conditioning, when there is an index
            self._assembler = connector.assembler(self.model, self.index_dir, self.cache_dir, self.document_preamble)
        return self._assembler

    def get_token_ids(self, text: str) -> list[int]:
        """``text``'s token ids by the model's own tokenizer, as plain text (what the model reads
        for it in a prompt; LangChain's default would fetch GPT-2's from a model hub)."""
        return list(self._asm().safe.text(text))


def _content(m: BaseMessage) -> str:
    c = m.content
    if isinstance(c, str):
        return c
    parts = []
    for block in c:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
        elif isinstance(m, AIMessage) and isinstance(block, dict) and block.get("type") in _CALL_BLOCKS:
            continue  # a call's block (Anthropic's tool_use, LangChain's tool_call): the message's tool_calls hold it
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"ChatPromptCache reads text only; a {kind!r} content block is not supported")
    return "".join(parts)


#: content blocks of an assistant message that are its tool calls (read from ``AIMessage.tool_calls``)
_CALL_BLOCKS = ("tool_use", "tool_call", "tool_call_chunk", "function_call")


def _role(m: BaseMessage) -> str:
    if isinstance(m, SystemMessage):
        return "system"
    if isinstance(m, HumanMessage):
        return "user"
    if isinstance(m, AIMessage):
        return "assistant"
    if isinstance(m, ToolMessage):
        return "tool"
    if isinstance(m, ChatMessage) and m.role in ("system", "user", "assistant", "tool"):
        return m.role
    raise NotImplementedError(f"ChatPromptCache does not support {type(m).__name__} messages")


def _turn(m: BaseMessage) -> tuple[str, str]:
    """A message as a ``(role, text)`` turn; an assistant's tool calls are written as the model
    writes them (:func:`pcache_rag.tools.render_calls`), so the conversation reads as it was decoded."""
    role, text = _role(m), _content(m)
    if isinstance(m, AIMessage) and m.tool_calls:
        calls = [tools.ToolCall(c.get("id") or "", c["name"], dict(c.get("args") or {})) for c in m.tool_calls]
        text = tools.render_calls(text, calls)
    return role, text


def _tool_calls(text: str) -> dict:
    """The ``content``, ``tool_calls`` and ``invalid_tool_calls`` of an answer read for calls."""
    content, calls, bad = tools.parse(text)
    return {"content": content,
            "tool_calls": [{"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"} for c in calls],
            "invalid_tool_calls": [{"name": b["name"], "args": b["args"], "id": tools.new_id(), "error": b["error"],
                                    "type": "invalid_tool_call"} for b in bad]}


class ChatPromptCache(_EngineConfig, BaseChatModel):
    """A chat model that reads marked documents from cached attention states.

    ``model``: the embedded ``smollm2-135m-instruct`` or a local model folder / ``.gguf``.
    States live in ``index_dir/kv`` (an index made by ``pcache-rag ingest``), else in
    ``cache_dir`` (default ``~/.cache/pcache-rag/states``). Sampling: ``temperature`` 0 is
    greedy; ``top_p``, ``seed`` and ``stop`` are honoured. ``recompute`` sets the quality
    recovery policy: ``"auto"`` (the default) is ``CachedRAG``'s, ``each:1`` (in each document, the
    sentence that shares most words with the question, recomputed in context); ``None`` or
    ``"none"`` reads the cache alone; others: ``"match:1"``, ``"epic:16"``, ``"blend:0.15"`` (see
    :mod:`pcache_rag.recompute`).
    ``document_preamble`` is the system prompt documents are encoded against; the prompt's
    own system message may differ (only its prefix is encoded then). ``learn_documents``
    (default True): documents pasted without marks that nothing has seen are taken from the
    prompt's blocks between blank lines, encoded on first sight and read from the cache next
    time; ``response_metadata["uncached"]`` says why text was computed instead. ``namespace``: what
    this object's prompts teach is kept for it alone (the states learned from prompts are per
    namespace; the ingested index is shared by design): give each user or tenant its own.
    """

    # a constructor argument the engine does not take (device=, top_k=, num_ctx=) is refused by
    # name, as per-call ones are, instead of being accepted and dropped
    model_config = ConfigDict(populate_by_name=True, protected_namespaces=(), extra="forbid")

    model: str = Field(default=DEFAULT_MODEL, alias="model_name")
    index_dir: str | None = None
    cache_dir: str | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    recompute: str | None = "auto"
    document_preamble: str = DEFAULT_SYSTEM
    #: take a prompt's unknown documents from its blocks (README, "Documents in any prompt")
    learn_documents: bool = True
    #: whose prompts these are: what they teach is read for this namespace only
    namespace: str = ""
    #: accepted for drop-in compatibility with hosted models; a local model has no network call
    #: to time out or retry, so setting either warns that it has no effect
    timeout: float | None = None
    max_retries: int | None = None
    #: accepted like hosted models' key, which OpenAI-style code passes; there is nothing to
    #: authenticate against, so setting it warns that it has no effect
    api_key: str | None = None
    #: ``invoke`` streams underneath (LangChain's ``streaming`` convention; callbacks see tokens)
    streaming: bool = False
    #: tools called in this order, one per step after the user's message, before the model answers in
    #: text (:func:`pcache_rag.tools.planned`): for models too small to choose a tool themselves
    tool_plan: list[str] = Field(default_factory=list)
    _assembler: Any = PrivateAttr(default=None)  # an Assembler, once the engine is loaded

    def model_post_init(self, __context: Any) -> None:
        connector.check_recompute(self.recompute)  # a bad policy is refused here, not at the first call
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        for name in ("timeout", "max_retries", "api_key"):
            if getattr(self, name) is not None:
                shown = "..." if name == "api_key" else repr(getattr(self, name))
                warnings.warn(f"ChatPromptCache runs the model in this process: {name}={shown} "
                              "has no effect", stacklevel=3)

    @property
    def _llm_type(self) -> str:
        return "pcache-rag"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "temperature": self.temperature, "top_p": self.top_p,
                "max_tokens": self.max_tokens, "recompute": self.recompute}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any):
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "pcache_rag"
        params["ls_model_name"] = kwargs.get("model", self.model)
        params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        params["ls_max_tokens"] = kwargs.get("max_tokens", self.max_tokens)
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        """Prompt tokens of ``messages`` through the model's own chat template, generation
        prompt included, read as an answer reads them (its documents found and tokenized on their
        own): exactly what the answer's ``usage_metadata["input_tokens"]`` reports.
        ``trim_messages(token_counter=llm)`` uses it."""
        asm = self._asm()
        turns = [_turn(m) for m in messages]
        if tools:  # the tools' text joins the system message, as in an answer
            from langchain_core.utils.function_calling import convert_to_openai_tool

            from pcache_rag.tools import prepare

            turns = prepare(turns, [convert_to_openai_tool(t) for t in tools]).turns
        return asm.count_tokens(asm.message_segments(turns, learn=self.learn_documents, tenant=self.namespace))

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | dict | bool | None = None,
                   parallel_tool_calls: bool | None = None, strict: bool | None = None,
                   **kwargs: Any) -> Runnable:
        """Tools the model may call (pydantic classes, functions, ``@tool`` s or OpenAI specs). The
        tools are listed in the system message and a call's JSON is decoded under its tool's
        parameter schema (:mod:`pcache_rag.tools`): ``AIMessage.tool_calls`` always parse.
        ``tool_choice``: ``"auto"`` (default), ``"any"``/``"required"``/``True`` (a call must be
        made), a tool's name, or ``"none"``. One call an answer unless ``parallel_tool_calls=True``
        (a small model allowed more repeats its call until its token limit).
        ``strict`` is accepted: the grammar is always strict."""
        from langchain_core.utils.function_calling import convert_to_openai_tool

        from pcache_rag.tools import choice_of, tools_of

        specs = [convert_to_openai_tool(t) for t in tools]
        choice_of(tool_choice, tools_of(specs))  # a bad spec or choice is refused here, not at the call
        bound: dict[str, Any] = {"tools": specs, **kwargs}
        if tool_choice is not None:
            bound["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            bound["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(**bound)

    def with_structured_output(self, schema: dict | type | None = None, *, method: str = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable:
        """Answers that are ``schema`` (a pydantic class, a ``TypedDict`` or a JSON schema):
        decoding is constrained by the schema's grammar (llguidance), so the JSON always parses
        once it is complete, and the schema is put after the last user message for the model
        to read. ``method="json_mode"`` without a schema asks for any JSON object (with one, it
        is constrained by the schema as well); ``"function_calling"`` is
        served as ``"json_schema"`` (the same object under the same grammar, without a call
        around it). Documents are read from the cache as in
        any other call. ``strict`` is accepted: the grammar is always strict. ``include_raw``
        returns ``{"raw", "parsed", "parsing_error"}``."""
        from operator import itemgetter

        from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
        from langchain_core.runnables import RunnableMap
        from langchain_core.utils.function_calling import convert_to_json_schema
        from langchain_core.utils.pydantic import is_basemodel_subclass

        if kwargs:
            raise TypeError(f"with_structured_output does not support: {', '.join(sorted(kwargs))}")
        if method not in ("json_schema", "json_mode", "function_calling"):
            raise ValueError(f"method must be 'json_schema', 'json_mode' or 'function_calling', not {method!r}")
        if method == "function_calling":  # no tool calls here: the schema's grammar gives the same object
            method = "json_schema"
        if schema is None and method == "json_schema":
            raise ValueError("method='json_schema' needs a schema (or use method='json_mode')")
        js = convert_to_json_schema(schema) if schema is not None else None
        # json_mode with a schema is constrained by the schema too: any JSON would parse, but a
        # small model left to "any object" nests and repeats keys the schema does not have
        fmt = ({"type": "json_schema", "json_schema": {"name": js.get("title", "output"), "schema": js}}
               if js is not None else {"type": "json_object"})
        bound = {"response_format": fmt}
        if js is not None:
            bound["ls_structured_output_format"] = {"kwargs": {"method": method, "strict": strict}, "schema": js}
        llm = self.bind(**bound)
        is_model = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser: Runnable = PydanticOutputParser(pydantic_object=schema) if is_model else JsonOutputParser()  # type: ignore[arg-type]
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")

    def _run(self, messages: list[BaseMessage], stop, kwargs) -> tuple[Generation, bool]:
        """The answer's stream, and whether it is read for tool calls."""
        asm = self._asm()
        sp, recompute, instruction = self._gen(stop, kwargs)
        use = tools.prepare([_turn(m) for m in messages], kwargs.get("tools"), kwargs.get("tool_choice"),
                            kwargs.get("parallel_tool_calls"), grammar_given=sp.grammar is not None,
                            plan=self.tool_plan)
        if sp.grammar is None and use.grammar is not None:
            sp = dataclasses.replace(sp, grammar=use.grammar)
        turns = with_instruction(use.turns, instruction)
        segs = asm.message_segments(turns, learn=self.learn_documents, tenant=self.namespace)
        return asm.stream(segs, recompute=recompute, params=sp), use.parse

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        """Text deltas; with tools, a call streams as ``tool_call_chunks`` (its name and id first, then
        its arguments' JSON as it is decoded)."""
        stream, read_calls = self._run(messages, stop, kwargs)
        calls = tools.CallStream() if read_calls else None
        for item in stream:  # text deltas; then stream.output
            for d in calls.feed(item) if calls else (tools.Delta(text=item),):
                yield _chunk(d, run_manager)
        out = stream.result()  # the stream is drained: its output
        for d in calls.flush() if calls else ():
            yield _chunk(d, run_manager)
        yield ChatGenerationChunk(message=AIMessageChunk(
            content="", usage_metadata=_usage(out), response_metadata=self._meta(out), chunk_position="last"))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        stream, read_calls = self._run(messages, stop, kwargs)
        for item in stream:
            if run_manager:
                run_manager.on_llm_new_token(item)
        out = stream.result()
        meta = self._meta(out)
        fields = _tool_calls(out.text) if read_calls else {"content": out.text}
        msg = AIMessage(**fields, usage_metadata=_usage(out), response_metadata=meta)
        return ChatResult(generations=[ChatGeneration(message=msg, generation_info=meta)],
                          llm_output={"model_name": self.model, **out.stats()})

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        """:meth:`_generate` in a worker thread; concurrent calls decode together in the engine's
        batch (:func:`pcache_rag.connector.share_batch`)."""
        connector.share_batch(self._asm())
        sync = run_manager.get_sync() if run_manager else None
        return await connector.in_thread(lambda: self._generate(messages, stop, sync, **kwargs))

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        """:meth:`_stream` from worker threads; concurrent streams decode together in the batch."""
        connector.share_batch(self._asm())
        it = self._stream(messages, stop, run_manager.get_sync() if run_manager else None, **kwargs)
        while (chunk := await connector.in_thread(next, it, None)) is not None:
            yield chunk

    def _meta(self, out: GenerationOutput) -> dict:
        return {"model_name": self.model, "model_provider": "pcache_rag", **out.stats()}


def _chunk(d: tools.Delta, run_manager: CallbackManagerForLLMRun | None) -> ChatGenerationChunk:
    """One streamed :class:`~pcache_rag.tools.Delta`: text (callbacks see it) or a tool-call chunk."""
    if d.index < 0:
        chunk = ChatGenerationChunk(message=AIMessageChunk(content=d.text))
        if run_manager:
            run_manager.on_llm_new_token(d.text, chunk=chunk)
        return chunk
    return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[
        {"name": d.name, "args": d.arguments, "id": d.id, "index": d.index, "type": "tool_call_chunk"}]))


def _usage(out: GenerationOutput) -> dict:
    """LangChain's ``usage_metadata`` shape of :func:`pcache_rag.connector.usage`."""
    u = connector.usage(out)
    return {**{k: u[k] for k in ("input_tokens", "output_tokens", "total_tokens")},
            "input_token_details": {"cache_read": u["cache_read"]}}


class PromptCacheTextLLM(_EngineConfig, LLM):
    """A text-completion ``LLM``: the prompt is read as it is (no chat template); marked documents
    in it come from cached states. For chat models and RAG prompts prefer :class:`ChatPromptCache`."""

    model_config = ConfigDict(extra="forbid")  # unsupported constructor arguments are refused by name

    model: str = DEFAULT_MODEL
    index_dir: str | None = None
    cache_dir: str | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    recompute: str | None = "auto"
    document_preamble: str = DEFAULT_SYSTEM
    #: take a prompt's unknown documents from its blocks (README, "Documents in any prompt")
    learn_documents: bool = True
    #: whose prompts these are: what they teach is read for this namespace only
    namespace: str = ""
    _assembler: Any = PrivateAttr(default=None)  # an Assembler, once the engine is loaded

    def model_post_init(self, __context: Any) -> None:
        connector.check_recompute(self.recompute)  # a bad policy is refused here, not at the first call

    @property
    def _llm_type(self) -> str:
        return "pcache-rag-text"

    @property
    def _identifying_params(self) -> dict:
        return {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature}

    def _call(self, prompt: str, stop: list[str] | None = None,
              run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> str:
        return "".join(c.text for c in self._stream(prompt, stop, run_manager, **kwargs))

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        asm = self._asm()
        # a text prompt is read as written: the grammar applies, no schema is added
        sp, recompute, _ = self._gen(stop, kwargs)
        segs = asm.text_segments(prompt, learn=self.learn_documents, tenant=self.namespace)
        stream = asm.stream(segs, recompute=recompute, params=sp)
        for item in stream:
            chunk = GenerationChunk(text=item)
            if run_manager:
                run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=stream.result().stats())


class PromptCacheDocumentEncoder(_EngineConfig, BaseDocumentTransformer):
    """Encodes each document's attention states into the store and records the handle in its
    metadata (``pcache_kv_key``), for any vector store::

        docs = PromptCacheDocumentEncoder().transform_documents(splits)
        vectorstore.add_documents(docs)

    Use the same ``model`` / ``cache_dir`` (or ``index_dir``) as the :class:`ChatPromptCache`
    that answers. Documents are keyed by their text, so encoding twice costs nothing."""

    def __init__(self, model: str = DEFAULT_MODEL, cache_dir: str | None = None, index_dir: str | None = None,
                 document_preamble: str = DEFAULT_SYSTEM, progress: bool = True):
        self.model, self.cache_dir, self.index_dir = model, cache_dir, index_dir
        self.document_preamble, self.progress = document_preamble, progress
        self._assembler = None

    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> list[Document]:
        keys = self._asm().ensure([d.page_content for d in documents], progress=self.progress)
        return [Document(page_content=d.page_content, metadata={**d.metadata, "pcache_kv_key": k}, id=d.id)
                for d, k in zip(documents, keys)]


class MiniLMEmbeddings(Embeddings):
    """The packaged all-MiniLM-L6-v2 (384-dim) as LangChain ``Embeddings``: offline, no hub."""

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return connector.embed(list(texts))

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


class PromptCacheRetriever(BaseRetriever):
    """Retrieves chunks from an index made by ``pcache-rag ingest`` (``index_dir``). Each
    document's text is the chunk exactly as the model reads it, so :func:`format_docs` hits
    the states encoded at ingest. ``k`` is the default; ``invoke(q, k=2)`` overrides it."""

    index_dir: str
    k: int = 4
    model: str = DEFAULT_MODEL
    _rag: Any = PrivateAttr(default=None)

    def model_post_init(self, __context: Any) -> None:
        connector.check_count("k", self.k)
        connector.check_index(self.index_dir)

    @property
    def rag(self):
        if self._rag is None:
            self._rag = connector.index_rag(self.model, self.index_dir, self.k)
        return self._rag

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None) -> list[Document]:
        docs = []
        for h in self.rag.retrieve(query, k or self.k):
            meta = dict(h.metadata)
            meta.update({"module_id": h.id, "kv_key": h.kv_key, "source": h.source, "score": h.score})
            docs.append(Document(page_content=self.rag.chunk_text(h), metadata=meta, id=h.id))
        return docs


def build_qa_chain(index_dir: str, k: int = 4, max_tokens: int = 128, prompt: BasePromptTemplate | None = None,
                   **chat_kwargs: Any) -> Runnable:
    """``create_retrieval_chain`` over a pcache-rag index: ``{"input": q}`` in,
    ``{"input", "context" (the source documents), "answer"}`` out."""
    from langchain_core.prompts import ChatPromptTemplate

    retriever = PromptCacheRetriever(index_dir=index_dir, k=k)
    llm = ChatPromptCache(index_dir=index_dir, max_tokens=max_tokens, **chat_kwargs)
    prompt = prompt or ChatPromptTemplate.from_messages([
        ("system", DEFAULT_SYSTEM), ("human", "Documents:\n\n{context}\n\nQuestion: {input}")])
    docs_chain = create_cached_documents_chain(llm, prompt)
    retrieval = (lambda x: x["input"]) | retriever
    return (RunnablePassthrough.assign(context=retrieval.with_config(run_name="retrieve_documents"))
            .assign(answer=docs_chain).with_config(run_name="retrieval_chain"))
