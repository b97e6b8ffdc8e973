"""LangChain: the standard conformance suites (langchain-tests) against ChatPromptCache and
PromptCacheRetriever, and the stock user flows hitting the cache."""

from __future__ import annotations

import asyncio
import tempfile
import warnings
from pathlib import Path

import pytest

pytest.importorskip("langchain_tests")

from langchain_core.documents import Document  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from langchain_pcache import ChatPromptCache, PromptCacheRetriever  # noqa: E402
from pcache_rag.docmodules import PCacheFallbackWarning, register_engine  # noqa: E402
from helpers import last_output

pytestmark = pytest.mark.real_model

# A fixed (never created) states folder: the engine registered for it is the session's model
# with an in-memory store, so the suites' own constructors find it.
STATES = "/nonexistent/pcache-langchain-tests"
MODEL = "smollm2-135m-instruct"
IDX = Path(tempfile.mkdtemp(prefix="pcache-lc-idx-"))

FACTS = {
    "france.md": "Paris is the capital of France. The Louvre is the largest art museum in Paris.",
    "japan.md": "Tokyo is the capital of Japan. Sushi is a Japanese dish of rice with fish.",
    "codes.md": "The access code for the north gate is 4417. The south gate code is 9023.",
}


@pytest.fixture(autouse=True)
def _engine(smol):
    register_engine(smol, MODEL, STATES)
    register_engine(smol, MODEL, str(IDX / "kv"))


@pytest.fixture(scope="module")
def index(smol, tmp_path_factory):
    from pcache_rag.rag import CachedRAG

    src = tmp_path_factory.mktemp("docs")
    for name, text in FACTS.items():
        (src / name).write_text(text)
    rag = CachedRAG(IDX, pc=smol, k=2, chunk_tokens=64)
    rag.ingest([src], progress=False)
    return IDX


class TestChatUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self):
        return ChatPromptCache

    @property
    def chat_model_params(self):
        return {"model": MODEL, "cache_dir": STATES}

    @property
    def supports_model_override(self):
        return False  # one local model per instance

    @pytest.mark.xfail(reason="load(allowed_objects='all') admits only classes in langchain-core's own partner "
                              "mapping; ChatPromptCache round-trips with allowed_objects=[ChatPromptCache], "
                              "see test_serialization_round_trip", strict=True)
    def test_serdes(self, model, snapshot):
        super().test_serdes(model, snapshot)


# The standard structured-output tests run in their own class, with room for a whole JSON
# object (a joke takes 30-36 tokens here): at 16 tokens LangChain's parser would complete a
# cut-off object and the tests would pass on half an answer. Each standard test runs once,
# in one of the two classes (conftest.py deselects it from the other).
STRUCTURED = ("test_structured_output", "test_json_mode")
# The tool-calling tests likewise run in their own class, with room for a whole call (96 tokens).
TOOLS = ("test_tool_", "test_bind_runnables_as_tools", "test_agent_loop", "test_unicode_tool_call",
         "test_structured_few_shot_examples")


class TestChatIntegration(ChatModelIntegrationTests):
    standard_tests_except = STRUCTURED + TOOLS
    max_tokens = 16  # the suite's own tests; the structured and tool-calling classes need room

    @property
    def chat_model_class(self):
        return ChatPromptCache

    @property
    def chat_model_params(self):
        return {"model": MODEL, "cache_dir": STATES, "max_tokens": self.max_tokens}

    @property
    def standard_chat_model_params(self):
        return {"temperature": 0, "max_tokens": self.max_tokens, "stop": []}

    @property
    def supports_model_override(self):
        return False

    @property
    def supported_usage_metadata_details(self):
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False):
        from langchain_pcache import format_docs

        llm = ChatPromptCache(**self.chat_model_params)
        doc = Document(page_content="The lighthouse on Skerry Island was built in 1872 by the Stevensons.")
        msgs = [("system", "Answer from the documents.\n\n" + format_docs([doc])), ("human", "When was it built?")]
        llm.invoke(msgs)  # the first call encodes the document
        if stream:
            out = None
            for c in llm.stream(msgs):
                out = c if out is None else out + c
            return out
        return llm.invoke(msgs)


class TestRetriever(RetrieversIntegrationTests):
    @pytest.fixture
    def retriever(self, index):
        return PromptCacheRetriever(index_dir=str(index), k=3)

    @property
    def retriever_constructor(self):
        return PromptCacheRetriever

    @property
    def retriever_constructor_params(self):
        return {"index_dir": str(IDX), "k": 3}

    @property
    def retriever_query_example(self):
        return "What is the capital of France?"

    @pytest.fixture(autouse=True)
    def _built(self, index):
        return index


class TestChatStructuredOutput(TestChatIntegration):
    standard_tests_except = ()
    standard_tests_only = STRUCTURED
    max_tokens = 48

    @property
    def supports_json_mode(self):
        return True


class TestChatToolCalling(TestChatIntegration):
    """The suite's tool-calling tests. ``tool_choice_value="any"``: the suite forces a call where
    the model may not choose one itself; SmolLM2-135M never opens a call under ``"auto"``
    (docs/guide.md, "Tool calling"), so every call the suite checks is one the grammar required
    and the model wrote the arguments of."""

    standard_tests_except = ()
    standard_tests_only = TOOLS
    max_tokens = 96

    @property
    def tool_choice_value(self):
        return "any"

    @pytest.mark.xfail(reason="the suite binds its tool with tool_choice 'auto', and SmolLM2-135M never opens a call "
                              "by itself (0 of 6 prompts that asked for a tool); forced calls and tool_plan agents are "
                              "tested in test_agents.py", strict=True)
    def test_agent_loop(self, model):
        super().test_agent_loop(model)


def test_missing_index_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="ingest"):
        PromptCacheRetriever(index_dir=str(tmp_path / "typo"))


def test_chat_params_refused_or_honoured(smol):
    llm = ChatPromptCache(model=MODEL, cache_dir=STATES, max_tokens=8)
    with pytest.raises(TypeError, match="frequency_penalty"):
        llm.invoke("hi", frequency_penalty=0.5)
    with pytest.raises(ValueError, match="recompute"):
        ChatPromptCache(model=MODEL, cache_dir=STATES, recompute="sometimes")
    a = llm.invoke("Name a colour.", temperature=1.5, seed=3).content
    b = llm.invoke("Name a colour.", temperature=1.5, seed=3).content
    assert a == b  # a seed makes sampling repeatable
    greedy = llm.invoke("Count: one, two, three,")
    stopped = llm.invoke("Count: one, two, three,", stop=[","])
    assert "," not in stopped.content and len(stopped.content) <= len(greedy.content)
    assert greedy.response_metadata["ttft_s"] > 0 and greedy.usage_metadata["output_tokens"] >= 1
    from langchain_core.messages import FunctionMessage

    with pytest.raises(NotImplementedError, match="FunctionMessage"):  # the legacy form; ToolMessage is read
        llm.invoke([FunctionMessage(content="3", name="f")])


def test_default_recompute_is_the_rag_default(smol):
    """Answers over documents recompute the question's sentence in each document (``"auto"``:
    ``each:1``, CachedRAG's default), as the server and ``pcache-rag ask`` do; ``None`` reads the
    cache alone."""
    from pcache_rag.recompute import RAG_RECOMPUTE

    from langchain_pcache import PromptCacheTextLLM, format_docs

    docs = [Document(page_content=FACTS["codes.md"]), Document(page_content=FACTS["japan.md"])]
    prompt = f"Context:\n{format_docs(docs)}\n\nQuestion: What is the access code for the north gate?"
    llm = ChatPromptCache(model=MODEL, cache_dir=STATES, max_tokens=6)
    assert llm.recompute == "auto" and RAG_RECOMPUTE == "each:1"
    llm.invoke(prompt)  # the documents' first sight: computed with the prompt, encoded after the answer
    auto = llm.invoke(prompt)
    plain = ChatPromptCache(model=MODEL, cache_dir=STATES, max_tokens=6, recompute=None).invoke(prompt)
    named = ChatPromptCache(model=MODEL, cache_dir=STATES, max_tokens=6, recompute="each:1").invoke(prompt)
    assert auto.response_metadata["documents"] == 2
    # in each document, the sentence that shares most of the question's words ("access code north
    # gate"): ~15 tokens each, at most 64 a document
    assert 10 <= auto.response_metadata["recomputed_tokens"] <= 2 * 64
    assert plain.response_metadata["recomputed_tokens"] == 0
    assert named.response_metadata["recomputed_tokens"] == auto.response_metadata["recomputed_tokens"]
    assert named.content == auto.content
    text = PromptCacheTextLLM(model=MODEL, cache_dir=STATES, max_tokens=4)
    assert text.recompute == "auto"
    text.invoke(prompt)
    assert last_output(smol).recomputed_tokens > 0
    with pytest.raises(ValueError, match="recompute"):
        PromptCacheTextLLM(model=MODEL, cache_dir=STATES, recompute="sometimes")


def test_chat_template_applied(smol):
    """The chat model reads the same ids as the tokenizer's own chat template."""
    llm = ChatPromptCache(model=MODEL, cache_dir=STATES, max_tokens=4)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ref = smol.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    out = llm.invoke([("system", "Be brief."), ("human", "Hi!")])
    assert out.usage_metadata["input_tokens"] == len(ref)
    # token counting uses the model's own tokenizer (LangChain's default would fetch GPT-2's)
    from langchain_core.messages import HumanMessage, SystemMessage, trim_messages

    msgs = [SystemMessage("Be brief."), HumanMessage("Hi!")]
    assert llm.get_num_tokens_from_messages(msgs) == len(ref)
    assert llm.get_token_ids("Tokyo is the capital of Japan.") == smol.safe.text("Tokyo is the capital of Japan.")
    assert llm.get_num_tokens("Tokyo is the capital of Japan.") > 0
    history = msgs + [HumanMessage("Tell me about Paris. " * 20), HumanMessage("And Tokyo?")]
    kept = trim_messages(history, max_tokens=len(ref) + 20, token_counter=llm, strategy="last", include_system=True)
    assert kept[0].content == "Be brief." and kept[-1].content == "And Tokyo?" and len(kept) < len(history)


def _own_chroma(tmp_path, smol, kind: str = "chroma"):
    """The user's own vector store (langchain-chroma, or langchain-core's InMemoryVectorStore)
    over their own documents, encoded on the way in."""
    from langchain_pcache import MiniLMEmbeddings, PromptCacheDocumentEncoder

    docs = [Document(page_content=t, metadata={"source": n}) for n, t in FACTS.items()]
    enc = PromptCacheDocumentEncoder(model=MODEL, cache_dir=STATES, progress=False)
    encoded = enc.transform_documents(docs)
    assert all("pcache_kv_key" in d.metadata for d in encoded)
    if kind == "memory":
        from langchain_core.vectorstores import InMemoryVectorStore

        vs = InMemoryVectorStore(embedding=MiniLMEmbeddings())
    else:
        lc_chroma = pytest.importorskip("langchain_chroma")
        vs = lc_chroma.Chroma(collection_name="mine", embedding_function=MiniLMEmbeddings(),
                              persist_directory=str(tmp_path / "chroma"))
    vs.add_documents(encoded)
    return vs


@pytest.mark.parametrize("kind", ["chroma", "memory"])
def test_create_retrieval_chain_on_users_store(tmp_path, smol, kind):
    classic = pytest.importorskip("langchain_classic.chains")
    from langchain_core.prompts import ChatPromptTemplate

    from langchain_pcache import create_cached_documents_chain

    vs = _own_chroma(tmp_path, smol, kind)
    llm = ChatPromptCache(model=MODEL, cache_dir=STATES, max_tokens=16)
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer from the documents.\n\n{context}"), ("human", "{input}")])
    chain = classic.create_retrieval_chain(vs.as_retriever(search_kwargs={"k": 2}),
                                           create_cached_documents_chain(llm, prompt))
    q = "What is the access code for the north gate?"
    out = chain.invoke({"input": q})
    assert "4417" in out["answer"] and len(out["context"]) == 2  # sources come back with the answer
    tail = smol.safe.segments([(q, False), (smol.chat.suffix["user"], True), (smol.chat.generation_prompt, True)])
    tail = smol.safe.segments([(smol.chat.suffix["system"], True), (smol.chat.prefix["user"], True)]) + tail

    seen = []

    from langchain_core.callbacks import BaseCallbackHandler

    class Usage(BaseCallbackHandler):
        def on_llm_end(self, response, **kw):
            seen.append(response.generations[0][0].message)

    out = chain.invoke({"input": q}, config={"callbacks": [Usage()]})
    u, meta = seen[-1].usage_metadata, seen[-1].response_metadata
    assert u["input_token_details"]["cache_read"] > 0
    # only the question part, and the documents' sentence the default (match:1) reads again
    assert 0 < meta["recomputed_tokens"] <= 40
    assert u["input_tokens"] - u["input_token_details"]["cache_read"] == len(tail) + meta["recomputed_tokens"]

    streamed = [c for c in chain.stream({"input": q}) if "answer" in c]
    assert "".join(c["answer"] for c in streamed) == out["answer"] and len(streamed) >= 2
    batch = chain.batch([{"input": q}, {"input": "What is the capital of Japan?"}])
    assert "4417" in batch[0]["answer"] and "Tokyo" in batch[1]["answer"]
    assert asyncio.run(chain.ainvoke({"input": q}))["answer"] == out["answer"]

    async def events():
        return [e async for e in chain.astream_events({"input": q}, version="v2")]

    ev = asyncio.run(events())
    ends = [e for e in ev if e["event"] == "on_chat_model_end"]
    assert ends and ends[0]["data"]["output"].usage_metadata["input_token_details"]["cache_read"] > 0
    assert ends[0]["data"]["output"].response_metadata["ttft_s"] > 0


def test_tutorial_chain_with_format_docs(tmp_path, smol):
    """The RAG tutorial's LCEL chain, with pcache's format_docs in place of its own."""
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    from langchain_pcache import format_docs

    retriever = _own_chroma(tmp_path, smol).as_retriever(search_kwargs={"k": 2})
    prompt = ChatPromptTemplate.from_template("Context:\n{context}\n\nQuestion: {question}\nAnswer briefly.")
    llm = ChatPromptCache(model=MODEL, cache_dir=STATES, max_tokens=12)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    msg = chain.invoke("What is the capital of Japan?")
    assert "Tokyo" in msg.content and msg.usage_metadata["input_token_details"]["cache_read"] > 0
    # the tutorial's own format_docs pastes unmarked text: the documents are known (encoded on
    # the way into the store), so they are found in the prompt and read from the cache
    own = lambda d: "\n\n".join(x.page_content for x in d)  # noqa: E731
    plain = {"context": retriever | own, "question": RunnablePassthrough()} | prompt | llm
    msg = plain.invoke("What is the capital of Japan?")
    assert "Tokyo" in msg.content and msg.usage_metadata["input_token_details"]["cache_read"] > 0
    assert msg.response_metadata["documents"] == 2
    # text nobody has encoded, after a "Context:" label, is learned on first sight...
    unknown = ("The lighthouse keeper winds the clock at dusk and logs the passing ships by name. " * 3)
    out = llm.invoke(f"Context:\n{unknown}\n\nQuestion: who winds the clock?")
    assert out.response_metadata["documents"] == 1 and out.response_metadata["uncached"] == []
    # ...and with learning off it is answered by full prefill, and a warning says why
    off = ChatPromptCache(model=MODEL, cache_dir=STATES, max_tokens=12, learn_documents=False)
    with pytest.warns(PCacheFallbackWarning, match="no marked document, no known one"):
        out = off.invoke(f"Context:\n{unknown.replace('clock', 'bell')}\n\nQuestion: who winds the bell?")
    assert out.response_metadata["documents"] == 0 and out.response_metadata["uncached"][0].startswith("unseen: 1")
    # a plain question holds no documents: nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error", PCacheFallbackWarning)
        off.invoke("Rephrase as one standalone question: who winds it?")


def test_stock_stuff_documents_chain_with_documents_in_the_system_message(tmp_path, smol):
    """LangChain's own ``create_stuff_documents_chain`` puts the documents, unmarked, into the
    system message: the known ones are found there and read from the cache."""
    classic = pytest.importorskip("langchain_classic.chains.combine_documents")
    from langchain_core.prompts import ChatPromptTemplate

    vs = _own_chroma(tmp_path, smol)
    llm = ChatPromptCache(model=MODEL, cache_dir=STATES, max_tokens=20)
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question using only these documents:\n\n{context}"), ("human", "{input}")])
    chain = classic.create_stuff_documents_chain(llm, prompt)
    docs = vs.as_retriever(search_kwargs={"k": 2}).invoke("What is the access code for the north gate?")
    seen = []

    from langchain_core.callbacks import BaseCallbackHandler

    class Usage(BaseCallbackHandler):
        def on_llm_end(self, response, **kw):
            seen.append(response.generations[0][0].message)

    for _ in range(2):
        answer = chain.invoke({"context": docs, "input": "What is the access code for the north gate?"},
                              config={"callbacks": [Usage()]})
    assert "4417" in answer
    msg = seen[-1]
    assert msg.usage_metadata["input_token_details"]["cache_read"] > 0
    assert msg.response_metadata["documents"] == 2


def test_build_qa_chain_returns_sources(index, smol):
    from langchain_pcache import build_qa_chain

    chain = build_qa_chain(str(index), k=2, max_tokens=12)
    out = chain.invoke({"input": "What is the south gate code?"})
    assert "9023" in out["answer"] and out["context"] and "module_id" in out["context"][0].metadata
    # the retriever's documents are the ingested chunks: their states were encoded at ingest
    assert last_output(smol).cached_tokens > 0


def test_serialization_round_trip():
    from langchain_core.load import dumpd, load

    llm = ChatPromptCache(model=MODEL, cache_dir=STATES, max_tokens=7, recompute="epic:8")
    back = load(dumpd(llm), valid_namespaces=["langchain_pcache"], allowed_objects=[ChatPromptCache])
    assert isinstance(back, ChatPromptCache) and back.max_tokens == 7 and back.recompute == "epic:8"


def test_unsupported_constructor_arguments_are_refused_by_name():
    from pydantic import ValidationError

    from langchain_pcache import PromptCacheTextLLM

    for cls in (ChatPromptCache, PromptCacheTextLLM):
        with pytest.raises(ValidationError, match="top_k") as e:
            cls(model=MODEL, cache_dir=STATES, device="cuda", top_k=5, num_ctx=4096)
        assert "device" in str(e.value) and "num_ctx" in str(e.value)
    assert ChatPromptCache(model=MODEL, cache_dir=STATES, max_tokens=3).max_tokens == 3


def test_structured_output_reads_the_documents_from_the_cache(smol):
    """``with_structured_output`` over a stock prompt with documents in the system message:
    the known documents come from the cache, and the answer is the schema's object."""
    from langchain_core.prompts import ChatPromptTemplate
    from pydantic import BaseModel, Field

    from langchain_pcache import PromptCacheDocumentEncoder

    class Gate(BaseModel):
        gate: str = Field(description="which gate")
        code: int = Field(description="the gate's access code")

    docs = [Document(page_content=FACTS["codes.md"])]
    PromptCacheDocumentEncoder(model=MODEL, cache_dir=STATES, progress=False).transform_documents(docs)
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer from this document:\n\n{context}"), ("human", "{input}")])
    llm = ChatPromptCache(model=MODEL, cache_dir=STATES, max_tokens=48)
    chain = prompt | llm.with_structured_output(Gate, include_raw=True)
    out = chain.invoke({"context": docs[0].page_content, "input": "What is the access code for the north gate?"})
    assert out["parsing_error"] is None and isinstance(out["parsed"], Gate)
    assert out["parsed"].code in (4417, 9023), out["raw"].content  # a code the document holds
    raw = out["raw"]
    assert raw.usage_metadata["input_token_details"]["cache_read"] > 0 and raw.response_metadata["documents"] == 1
    assert raw.response_metadata["finish_reason"] == "eos"  # the grammar completed the object
    # JSON mode without a schema; bad requests refused by name
    any_json = llm.with_structured_output(method="json_mode").invoke("Give a JSON object with a key 'city'.")
    assert isinstance(any_json, dict)
    with pytest.raises(ValueError, match="needs a schema"):
        llm.with_structured_output(None)
    with pytest.raises(ValueError, match="'yaml' is not supported"):
        llm.invoke("hi", response_format={"type": "yaml"})


def test_concurrent_ainvoke_calls_decode_together_and_answer_as_alone(smol, tmp_path):
    """Eight ``ainvoke`` calls at once on one ChatPromptCache join the engine's continuous batch
    (before, each ran alone in its thread, one after another): they decode together, and each
    answer is exactly the one ``invoke`` gave alone. (Time: scripts/measure-async.py.)"""
    from pcache_rag import PromptCache

    pc = PromptCache(smol.model, smol.tokenizer)  # an engine of its own: the batch started here ends here
    register_engine(pc, MODEL, str(tmp_path / "states"))
    llm = ChatPromptCache(model=MODEL, cache_dir=str(tmp_path / "states"), max_tokens=12)
    questions = [f"Say one short sentence about {w}." for w in
                 ("rivers", "bread", "copper", "owls", "trains", "snow", "violins", "maps")]
    alone = [llm.invoke(q).content for q in questions]
    assert pc.batch_stats() is None

    async def together():
        return await asyncio.gather(*(llm.ainvoke(q) for q in questions))

    try:
        got = asyncio.run(together())
        assert [m.content for m in got] == alone
        assert pc.batch_stats()["max_batch_seen"] >= 2, pc.batch_stats()
    finally:
        pc.stop_batching()


def test_token_counts_agree_with_the_answers_usage_when_documents_are_in_the_prompt(smol):
    """Documents pasted into a message are tokenized on their own (each with its blank line), so
    a count of the whole message as one text was off (88 against the answer's 86 in the issue):
    get_num_tokens_from_messages now reads the prompt as the answer does, to the token."""
    from langchain_core.messages import HumanMessage, SystemMessage

    llm = ChatPromptCache(model=MODEL, cache_dir=STATES, max_tokens=2)
    docs = "\n\n".join(f"{name}: {text}" for name, text in FACTS.items())
    for msgs in ([SystemMessage(f"Answer from the documents.\n\n{docs}"), HumanMessage("What is the north gate code?")],
                 [HumanMessage(f"Context:\n{docs}\n\nQuestion: What is the capital of Japan?\nAnswer:")]):
        out = llm.invoke(msgs)
        assert out.response_metadata["documents"] >= 1, out.response_metadata
        assert llm.get_num_tokens_from_messages(msgs) == out.usage_metadata["input_tokens"]
