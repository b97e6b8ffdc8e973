"""LlamaIndex: the stock pipeline (SimpleDirectoryReader -> IngestionPipeline -> VectorStoreIndex
on ChromaVectorStore or SimpleVectorStore -> query engine and chat engine) hitting the cache."""

from __future__ import annotations

import asyncio

import pytest

from helpers import write_pdf, last_output
from pcache_rag.docmodules import register_engine

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
STATES = "/nonexistent/pcache-llamaindex-tests"


@pytest.fixture(autouse=True)
def _engine(smol):
    register_engine(smol, MODEL, STATES)


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory):
    """A folder of the formats people have: Markdown, PDF, HTML and Word."""
    pytest.importorskip("fpdf")
    import docx

    d = tmp_path_factory.mktemp("docs")
    (d / "france.md").write_text("# France\n\nParis is the capital of France. The Louvre is in Paris.\n")
    write_pdf(d / "codes.pdf", ["Gate codes. The access code for the north gate is 4417.",
                                "The south gate code is 9023."])
    (d / "japan.html").write_text("<html><head><title>Japan</title><script>var x=1;</script></head><body>"
                                  "<p>Tokyo is the capital of Japan.</p><p>Sushi is rice with fish.</p></body></html>")
    w = docx.Document()
    w.add_paragraph("The ferry to the island leaves at 07:45 every morning.")
    w.save(str(d / "ferry.docx"))
    return d


def _read(docs_dir):
    from llama_index.core import SimpleDirectoryReader

    from llama_index.llms.pcache import file_extractor

    return SimpleDirectoryReader(str(docs_dir), file_extractor=file_extractor()).load_data()


def test_readers_keep_source_metadata(docs_dir):
    docs = _read(docs_dir)
    by = {}
    for d in docs:
        by.setdefault(d.metadata["file_name"], []).append(d)
    assert set(by) == {"france.md", "codes.pdf", "japan.html", "ferry.docx"}
    assert [d.metadata["page_label"] for d in by["codes.pdf"]] == ["1", "2"]
    assert "4417" in by["codes.pdf"][0].text and "9023" in by["codes.pdf"][1].text
    assert "Tokyo" in by["japan.html"][0].text and "var x" not in by["japan.html"][0].text
    assert "07:45" in by["ferry.docx"][0].text


def _tail(smol, q):
    from pcache_rag.rag.prompt import question_ids

    return len(question_ids(smol, q))


@pytest.mark.parametrize("store", ["chroma", "simple"])
def test_stock_pipeline_query_and_chat_engine(docs_dir, tmp_path, smol, store):
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter

    from llama_index.llms.pcache import (MiniLMEmbedding, PromptCacheChatEngine, PromptCacheEncoder, PromptCacheLLM,
                                   PromptCacheSynthesizer)

    embed = MiniLMEmbedding()
    encoder = PromptCacheEncoder(model=MODEL, cache_dir=STATES)
    vector_store = None
    if store == "chroma":
        import chromadb
        from llama_index.vector_stores.chroma import ChromaVectorStore

        client = chromadb.PersistentClient(path=str(tmp_path / "chroma"))
        vector_store = ChromaVectorStore(chroma_collection=client.get_or_create_collection("docs"))
    pipeline = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=0), encoder, embed],
                                 vector_store=vector_store)
    nodes = pipeline.run(documents=_read(docs_dir))
    assert nodes and all("pcache_kv_key" in n.metadata for n in nodes)
    if vector_store is not None:
        index = VectorStoreIndex.from_vector_store(vector_store, embed_model=embed)
    else:
        index = VectorStoreIndex(nodes, embed_model=embed, storage_context=StorageContext.from_defaults())

    llm = PromptCacheLLM(model=MODEL, cache_dir=STATES, max_new_tokens=16)
    engine = index.as_query_engine(llm=llm, response_synthesizer=PromptCacheSynthesizer(llm), similarity_top_k=2)
    q = "What is the access code for the north gate?"
    r = engine.query(q)
    assert "4417" in str(r) and r.source_nodes
    assert r.source_nodes[0].node.metadata["file_name"] == "codes.pdf"
    stats = r.metadata["pcache"]
    assert stats["cached_tokens"] > 0 and stats["encoded_tokens"] == 0  # states made at ingest
    # the question part, and the sentence of the documents the default (match:1) reads again
    assert 0 < stats["recomputed_tokens"] <= 40
    assert stats["computed_tokens"] == _tail(smol, q) + stats["recomputed_tokens"]
    assert stats["ttft_s"] > 0

    a = asyncio.run(engine.aquery("What time does the ferry leave?"))
    st = a.metadata["pcache"]
    assert "07:45" in str(a) and st["computed_tokens"] == _tail(smol, "What time does the ferry leave?") + st["recomputed_tokens"]

    from llama_index.core.query_engine import RetrieverQueryEngine

    from_args = RetrieverQueryEngine.from_args(index.as_retriever(similarity_top_k=2), llm=llm,
                                               response_synthesizer=PromptCacheSynthesizer(llm))
    r2 = from_args.query(q)
    assert str(r2) == str(r) and r2.metadata["pcache"]["computed_tokens"] == stats["computed_tokens"]

    streaming = index.as_query_engine(llm=llm, response_synthesizer=PromptCacheSynthesizer(llm, streaming=True),
                                      similarity_top_k=2)
    s = streaming.query(q)
    assert "4417" in "".join(s.response_gen) and last_output(smol).cached_tokens > 0
    assert s.metadata["pcache"]["cached_tokens"] == last_output(smol).cached_tokens > 0  # streamed stats

    async def astreamed():  # async streaming: the statistics join once the answer is read
        resp = await streaming.aquery(q)
        text = "".join([d async for d in resp.async_response_gen()])
        return text, resp.metadata

    text, meta = asyncio.run(astreamed())
    assert "4417" in text and meta["pcache"]["cached_tokens"] == last_output(smol).cached_tokens > 0
    assert meta["pcache"]["computed_tokens"] == stats["computed_tokens"]

    # the cached path emits LlamaIndex's instrumentation and callback events
    from llama_index.core.callbacks import CallbackManager, LlamaDebugHandler
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler

    names: list[str] = []

    class Seen(BaseEventHandler):
        @classmethod
        def class_name(cls) -> str:
            return "Seen"

        def handle(self, event, **kwargs):
            names.append(type(event).__name__)

    seen, root = Seen(), get_dispatcher()
    root.add_event_handler(seen)
    debug = LlamaDebugHandler()
    old_cm, llm.callback_manager = llm.callback_manager, CallbackManager([debug])
    try:
        engine.query(q)
    finally:
        root.event_handlers.remove(seen)
        llm.callback_manager = old_cm
    kinds = {n for n in names if n.startswith("LLM")}
    assert {"LLMChatStartEvent", "LLMChatEndEvent"} <= kinds or {"LLMCompletionStartEvent",
                                                                  "LLMCompletionEndEvent"} <= kinds, kinds
    pairs = debug.get_llm_inputs_outputs()
    assert pairs and "4417" in str(pairs[-1][-1].payload), "LlamaDebugHandler saw the answer"

    chat = PromptCacheChatEngine.from_defaults(retriever=index.as_retriever(similarity_top_k=2), llm=llm)
    first = chat.chat("What is the capital of Japan?")
    assert "Tokyo" in str(first)
    assert last_output(smol).cached_tokens > 0
    chat.chat("And what is sushi?")
    assert last_output(smol).cached_tokens > 0  # the history goes after the cached documents


def test_llm_chat_template_params_and_async(smol):
    from llama_index.core.llms import ChatMessage

    from llama_index.llms.pcache import PromptCacheLLM

    llm = PromptCacheLLM(model=MODEL, cache_dir=STATES, max_new_tokens=6)
    msgs = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi!")]
    r = llm.chat(msgs)
    ref = smol.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hi!"}], add_generation_prompt=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert r.additional_kwargs["prompt_tokens"] == len(ref)
    assert "".join(x.delta for x in llm.stream_chat(msgs)) == r.message.content
    assert asyncio.run(llm.achat(msgs)).message.content == r.message.content

    async def astream():
        return "".join([x.delta async for x in await llm.astream_chat(msgs)])

    assert asyncio.run(astream()) == r.message.content
    assert llm.complete("Count: one, two,", stop=[","]).text.count(",") == 0
    with pytest.raises(TypeError, match="frequency_penalty"):
        llm.complete("hi", frequency_penalty=1.0)
    back = PromptCacheLLM.from_dict(llm.to_dict())
    assert back.max_new_tokens == 6 and back.cache_dir == STATES
    assert PromptCacheLLM.from_json(llm.to_json()).model == MODEL


def test_default_recompute_is_the_rag_default(smol):
    """``PromptCacheLLM``'s answers over documents recompute the question's own sentence
    (``"auto"``: ``match:1``, CachedRAG's default); ``None`` reads the cache alone."""
    from pcache_rag.docmodules import format_documents

    from llama_index.llms.pcache import PromptCacheLLM

    docs = format_documents(["The access code for the north gate is 4417. The south gate code is 9023.",
                             "Tokyo is the capital of Japan. Sushi is rice with fish."])
    prompt = f"Context:\n{docs}\n\nQuestion: What is the access code for the north gate?"
    auto = PromptCacheLLM(model=MODEL, cache_dir=STATES, max_new_tokens=6)
    assert auto.recompute == "auto"
    auto.complete(prompt)  # a first sight computes the documents with the prompt: nothing to recompute yet
    a = auto.complete(prompt).additional_kwargs
    b = PromptCacheLLM(model=MODEL, cache_dir=STATES, max_new_tokens=6, recompute=None).complete(prompt).additional_kwargs
    assert a["documents"] == b["documents"] == 2
    assert 5 <= a["recomputed_tokens"] <= 40 and b["recomputed_tokens"] == 0
    with pytest.raises(ValueError, match="recompute"):
        PromptCacheLLM(model=MODEL, cache_dir=STATES, recompute="sometimes")


def test_synthesizer_prompts_honoured_or_refused(smol):
    from llama_index.core.prompts import PromptTemplate
    from llama_index.core.schema import NodeWithScore, TextNode

    from llama_index.llms.pcache import PromptCacheLLM, PromptCacheSynthesizer

    llm = PromptCacheLLM(model=MODEL, cache_dir=STATES, max_new_tokens=8)
    syn = PromptCacheSynthesizer(llm)
    with pytest.raises(ValueError, match="context_str"):
        syn.update_prompts({"text_qa_template": PromptTemplate("Answer {query_str}")})
    syn.update_prompts({"text_qa_template": PromptTemplate("Facts:\n{context_str}\nQuestion: {query_str}\nShort answer:")})
    assert "Short answer" in syn.get_prompts()["text_qa_template"].get_template()
    nodes = [NodeWithScore(node=TextNode(text="The secret colour is teal."), score=1.0)]
    r = syn.synthesize("What is the secret colour?", nodes)
    assert "teal" in str(r).lower() and r.metadata["pcache"]["documents"] == 1
    with pytest.raises(TypeError, match="PromptCacheLLM"):
        from llama_index.core.llms.mock import MockLLM

        PromptCacheSynthesizer(MockLLM())


def test_missing_index_is_an_error(tmp_path):
    from llama_index.llms.pcache import PromptCacheRetriever

    with pytest.raises(FileNotFoundError, match="ingest"):
        PromptCacheRetriever(str(tmp_path / "typo"))


def test_stock_engines_without_pcache_synthesizers_hit_the_cache(docs_dir, smol):
    """Issue 21: ``as_chat_engine()`` (condense_plus_context and context), the default
    synthesizer of ``as_query_engine(llm=...)`` and ``Settings.llm`` put the retrieved nodes'
    text, unmarked, into their own templates; the engine finds them there."""
    from llama_index.core import Settings, StorageContext, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter

    from llama_index.llms.pcache import MiniLMEmbedding, PromptCacheEncoder, PromptCacheLLM

    embed = MiniLMEmbedding()
    pipeline = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=0),
                                                  PromptCacheEncoder(model=MODEL, cache_dir=STATES), embed])
    nodes = pipeline.run(documents=_read(docs_dir))
    index = VectorStoreIndex(nodes, embed_model=embed, storage_context=StorageContext.from_defaults())
    llm = PromptCacheLLM(model=MODEL, cache_dir=STATES, max_new_tokens=16)
    q = "What is the access code for the north gate?"
    r = index.as_query_engine(llm=llm, similarity_top_k=2).query(q)
    assert "4417" in str(r) and last_output(smol).cached_tokens > 0
    # streaming with the flag set once, on the stock engine and its default synthesizer
    streamed = index.as_query_engine(llm=llm, similarity_top_k=2, streaming=True).query(q)
    assert "".join(streamed.response_gen) == str(r) and last_output(smol).cached_tokens > 0
    chat_stream = index.as_chat_engine(chat_mode="context", llm=llm, similarity_top_k=2).stream_chat(q)
    assert "4417" in "".join(chat_stream.response_gen) and last_output(smol).cached_tokens > 0
    for mode in ("condense_plus_context", "context"):
        chat = index.as_chat_engine(chat_mode=mode, llm=llm, similarity_top_k=2)
        assert "4417" in str(chat.chat(q)), mode
        assert last_output(smol).cached_tokens > 0, mode
    old = Settings._llm  # reading Settings.llm would resolve (and fail to reach) OpenAI
    try:
        Settings.llm = llm
        # (asked "What time does the ferry leave?", the 135M model answers with the gate code from these
        # cached states once the prompt is read exactly as rendered, one newline after the last chunk, where
        # full prefill says 07:45; "When does ..." is answered right by both)
        r = index.as_query_engine(similarity_top_k=2).query("When does the ferry leave?")
        assert "07:45" in str(r) and last_output(smol).cached_tokens > 0
    finally:
        Settings._llm = old


def test_unsupported_constructor_arguments_are_refused_by_name():
    from pydantic import ValidationError

    from llama_index.llms.pcache import PromptCacheLLM

    with pytest.raises(ValidationError, match="context_window") as e:
        PromptCacheLLM(model=MODEL, cache_dir=STATES, context_window=2048, generate_kwargs={"top_k": 5})
    assert "generate_kwargs" in str(e.value)
    llm = PromptCacheLLM(model=MODEL, cache_dir=STATES, max_new_tokens=7)
    assert PromptCacheLLM.from_dict(llm.to_dict()).max_new_tokens == 7


def test_structured_predict_and_response_format(smol):
    """``structured_predict`` (LlamaIndex's own program and prompt, with the schema's grammar
    added), ``as_structured_llm`` and a ``response_format`` on ``chat``."""
    import json

    from llama_index.core.llms import ChatMessage
    from llama_index.core.prompts import PromptTemplate
    from pydantic import BaseModel

    from llama_index.llms.pcache import PromptCacheLLM

    class Capital(BaseModel):
        city: str
        country: str

    llm = PromptCacheLLM(model=MODEL, cache_dir=STATES, max_new_tokens=48)
    got = llm.structured_predict(Capital, PromptTemplate("What is the capital of {country}?"), country="France")
    assert isinstance(got, Capital) and got.country == "France"
    got = asyncio.run(llm.astructured_predict(Capital, PromptTemplate("The capital of {c}?"), c="Japan"))
    assert isinstance(got, Capital)
    parts = list(llm.stream_structured_predict(Capital, PromptTemplate("The capital of {c}?"), c="Italy"))
    assert parts and isinstance(parts[-1], Capital)
    r = llm.as_structured_llm(Capital).chat([ChatMessage(role="user", content="The capital of Spain?")])
    assert isinstance(r.raw, Capital)
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": Capital.model_json_schema()}}
    r = llm.chat([ChatMessage(role="user", content="The capital of Germany?")], response_format=fmt)
    assert set(json.loads(r.message.content)) == {"city", "country"}
    assert r.additional_kwargs["finish_reason"] == "eos"


def test_every_synthesizers_response_carries_cache_statistics(docs_dir, smol):
    """Stock synthesizers (compact, refine, tree_summarize) and the query engine's default, sync and
    async: ``Response.metadata["pcache"]`` holds the LLM calls' statistics summed, read from the
    LLM's own responses (LlamaIndex's instrumentation events; nothing of theirs replaced)."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
    from llama_index.core.node_parser import SentenceSplitter

    from llama_index.llms.pcache import MiniLMEmbedding, PromptCacheEncoder, PromptCacheLLM

    embed = MiniLMEmbedding()
    nodes = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=0),
                                               PromptCacheEncoder(model=MODEL, cache_dir=STATES), embed]).run(
        documents=_read(docs_dir))
    index = VectorStoreIndex(nodes, embed_model=embed)
    llm = PromptCacheLLM(model=MODEL, cache_dir=STATES, max_new_tokens=12)
    seen: list[dict] = []

    class Calls(BaseEventHandler):  # what the LLM itself reported, call by call
        def handle(self, event, **kw):
            if isinstance(event, LLMChatEndEvent) and event.response is not None:
                seen.append(event.response.additional_kwargs)

    get_dispatcher().add_event_handler(Calls())
    q = "What is the access code for the north gate?"
    for mode in ("compact", "refine", "tree_summarize"):
        seen.clear()
        r = index.as_query_engine(llm=llm, similarity_top_k=3, response_mode=mode).query(q)
        st = r.metadata["pcache"]
        assert st["llm_calls"] == len(seen) >= 1, mode
        for k in ("prompt_tokens", "cached_tokens", "computed_tokens", "output_tokens"):
            assert st[k] == sum(s[k] for s in seen), (mode, k)
        assert st["cached_tokens"] > 0 and st["ttft_s"] == seen[0]["ttft_s"], mode
        assert any(k in r.metadata for k in (n.node.node_id for n in r.source_nodes)), "the nodes' metadata stays"
    seen.clear()
    a = asyncio.run(index.as_query_engine(llm=llm, similarity_top_k=2).aquery(q))
    assert a.metadata["pcache"]["llm_calls"] == len(seen) and a.metadata["pcache"]["cached_tokens"] > 0
