"""Document discovery: known documents found in any prompt without marks and served from the
cache exactly as marked ones are; documents no component has seen, learned from a prompt's
blocks on first sight; and why the rest was computed."""

from __future__ import annotations

import pytest

from pcache_rag.discovery import MIN_CHARS, KnownTexts, Uncached, blocks, document_spans

DOC_A = ("The access code for the copper vault is QX-5521. The archivist keeps the only key, "
         "and the vault opens on the first Monday of every month.")
DOC_B = ("The ferry to the island leaves at 07:45 every morning from the north pier, and the last "
         "one returns at 19:10, weather permitting.")
DOC_C = ("The harbour master keeps the tide tables in the blue cabinet and updates them every Sunday "
         "before the first boat goes out.")
#: the LangChain hub's ``rlm/rag-prompt`` (the RAG tutorial's prompt), as published
RAG_PROMPT = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
              "to answer the question. If you don't know the answer, just say that you don't know. Use three "
              "sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:")


def test_known_texts_find_exact_spans_longest_first():
    kt = KnownTexts()
    assert kt.add([DOC_A, DOC_B, "too short to matter"]) == 2 and len(kt) == 2
    assert kt.add("  " + DOC_A + "\n") == 0, "stripped texts are the same text"
    prompt = f"Context:\n{DOC_B}\n\n{DOC_A}\n---\nQuestion: when does the ferry leave?"
    spans = kt.find(prompt)
    assert [prompt[a:b] for a, b in spans] == [DOC_B, DOC_A]
    # a longer text with the same opening wins where it occurs, the shorter one elsewhere
    longer = DOC_A + " Visitors sign the ledger by the door."
    kt.add(longer)
    p2 = f"{longer}\n\n{DOC_A}"
    assert [p2[a:b] for a, b in kt.find(p2)] == [longer, DOC_A]
    # a text cut short is not the document; nor is a near copy
    assert kt.find(DOC_A[:-1]) == [] and kt.find(DOC_A.replace("QX", "QY")) == []
    assert DOC_B in kt and "x" * MIN_CHARS not in kt


def test_texts_added_after_a_lookup_are_found():
    kt = KnownTexts()
    kt.add(DOC_A)
    assert kt.find(DOC_B) == []
    kt.add(DOC_B)
    assert kt.find("Note: " + DOC_B) == [(6, 6 + len(DOC_B))]


def test_lookup_finds_every_quoted_chunk_among_many():
    """5,000 known chunks, one ~32K-character prompt quoting ten of them: each found, in order,
    also after a text is added. The 100,000-chunk timing is a benchmark: `bench discovery`."""
    from pcache_rag.measure.bench import bench_discovery, discovery_corpus

    chunks, prompt, quoted = discovery_corpus(5_000)
    kt = KnownTexts()
    kt.add(chunks)
    spans = kt.find(prompt)
    assert [prompt[a:b] for a, b in spans] == quoted
    kt.add(["A chunk retrieved just now, after the automaton was built: " + chunks[5]])
    assert kt.find(prompt) == spans, "a few new texts do not disturb the lookup"
    row = bench_discovery(2_000, log=lambda *_: None)  # the benchmark checks its own lookups
    assert row["chunks"] == 2_000 and row["prompt_chars"] > 30_000


def test_blocks_are_the_runs_between_blank_lines_without_their_whitespace():
    text = "Head line\nsecond line\n\n  first doc  \n \t\nsecond doc\n\n\n\nlast\n"
    assert [text[a:b] for a, b in blocks(text)] == ["Head line\nsecond line", "first doc", "second doc", "last"]
    assert blocks("") == [] and blocks("\n\n  \n\n") == []


def test_document_spans_learn_blocks_except_a_messages_opening_and_the_question():
    d = [f"Document number {i} holds a sentence long enough to be worth a module of its own." for i in range(3)]
    assert all(len(x) >= MIN_CHARS for x in d)
    text = f"{d[0]}\n\n{d[1]}\n\nshort block\n\n{d[2]}"
    why = Uncached()
    spans = document_spans(text, KnownTexts(), learn=True, lead=True, trail=True, uncached=why)
    # the first block opens the message (instructions) and the last ends the final user message (the question)
    assert [text[a:b] for a, b in spans] == [d[1]]
    assert (why.learned, why.short, why.unseen) == (1, 1, 0)
    assert why.reasons() == [f"too short: 1 block(s) between blank lines under {MIN_CHARS} characters were "
                             "computed, not cached"]
    spans = document_spans(text, KnownTexts(), learn=True, lead=False, trail=False)
    assert [text[a:b] for a, b in spans] == [d[0], d[1], d[2]]
    # learning off: the long blocks are unseen, said so; a known one is still found, anywhere
    known = KnownTexts()
    known.add(d[0])
    why = Uncached()
    spans = document_spans(text, known, learn=False, lead=True, trail=False, uncached=why)
    assert [text[a:b] for a, b in spans] == [d[0]] and (why.unseen, why.learned) == (2, 0)
    assert any(r.startswith("unseen: 2 block(s)") for r in why.reasons())


def test_a_known_document_cut_inside_is_said_so():
    known = KnownTexts()
    known.add(DOC_A)
    cut = DOC_A[:70] + " and then something else entirely, which nobody has seen."
    why = Uncached()
    spans = document_spans(f"Context:\n\n{cut}\n\n{DOC_B}", known, learn=True, lead=True, trail=False,
                           uncached=why)
    assert why.cut == 1 and why.learned == 2 and len(spans) == 2, "the cut copy is learned as a text of its own"
    assert any(r.startswith("split inside: 1 known document(s)") for r in why.reasons())
    # the whole text found is no miss
    why = Uncached()
    document_spans(f"Context:\n\n{DOC_A}", known, learn=True, lead=True, trail=False, uncached=why)
    assert why.cut == 0 and why.reasons() == []


@pytest.mark.real_model
def test_stock_chain_reads_documents_first_seen_in_its_own_system_message(smol):
    """The stock LangChain flow: three retrieved documents pasted into a system message by a
    plain prompt template (no marks, a vector store of LangChain's own), then two of them in
    another order with another question. The first call learns them; the second reads both
    from the cache, and the model reads exactly the text the template rendered."""
    pytest.importorskip("langchain_pcache")
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.vectorstores import InMemoryVectorStore

    from langchain_pcache import ChatPromptCache, MiniLMEmbeddings
    from pcache_rag import PromptCache
    from pcache_rag.docmodules import Assembler, register_engine

    pc = PromptCache(smol.model, smol.tokenizer)  # its own known texts and states
    register_engine(pc, "smollm2-135m-instruct", "/nonexistent/pcache-discovery-stock-chain")
    texts = ["The night ferry from Quellmoor to Astbury departs at 23:40 from pier nine. " * 6,
             "The Astbury archive holds 412 sea charts, most of them drawn before 1850. " * 6,
             "Pier nine is the northernmost pier of Quellmoor harbour and has a green light. " * 6]
    vs = InMemoryVectorStore.from_documents([Document(page_content=t) for t in texts], MiniLMEmbeddings())
    llm = ChatPromptCache(max_tokens=16, cache_dir="/nonexistent/pcache-discovery-stock-chain")
    prompt = ChatPromptTemplate.from_messages([("system", "Answer from the documents.\n\n{context}"),
                                               ("human", "{input}")])
    q = "When does the night ferry from Quellmoor depart?"
    docs = vs.as_retriever(search_kwargs={"k": 3}).invoke(q)
    assert sorted(d.page_content for d in docs) == sorted(texts)
    asm = Assembler(pc)
    doc_tokens = {d.page_content: len(asm.doc_ids(d.page_content)) for d in docs}
    msgs = []
    for order, question in (((0, 1, 2), q), ((2, 0), "Which pier does the night ferry leave from?")):
        ctx = "\n\n".join(docs[i].page_content for i in order)
        rendered = prompt.invoke({"context": ctx, "input": question})
        msg = (prompt | llm).invoke({"context": ctx, "input": question})
        msgs.append(msg)
        assert msg.response_metadata["documents"] == len(order)
        assert msg.response_metadata["uncached"] == [], "every document was found or learned"
        # the model read exactly what the template rendered: the assembled ids decode to it
        turns = [({"system": "system", "human": "user"}[m.type], m.content) for m in rendered.to_messages()]
        plan = asm.plan(asm.message_segments(turns))
        ids = [t for _, kv in plan.parts for t in kv.token_ids.tolist()] + plan.new_ids
        chat = [{"role": r, "content": c} for r, c in turns]
        assert smol.tokenizer.decode(ids) == smol.tokenizer.apply_chat_template(chat, tokenize=False,
                                                                                add_generation_prompt=True)
    first, second = (m.usage_metadata["input_token_details"]["cache_read"] for m in msgs)
    assert first == 0, "first sight: the documents were encoded by this call, not read"
    assert msgs[0].response_metadata["encoded_tokens"] >= sum(doc_tokens.values()) - 3
    reread = doc_tokens[docs[2].page_content] + doc_tokens[docs[0].page_content] - 2  # less their separators
    recomputed = msgs[1].response_metadata["recomputed_tokens"]  # the question's sentence (match:1), read anew
    assert second >= 150 and second + recomputed >= reread, "the second call reads both documents from the cache"
    assert msgs[1].response_metadata["encoded_tokens"] == 0
    assert msgs[1].content.strip()


@pytest.mark.real_model
def test_documents_too_short_to_learn_are_said_so_in_the_response(smol):
    pytest.importorskip("langchain_pcache")
    from langchain_pcache import ChatPromptCache
    from pcache_rag import PromptCache
    from pcache_rag.docmodules import PCacheFallbackWarning, register_engine

    register_engine(PromptCache(smol.model, smol.tokenizer), "smollm2-135m-instruct", "/nonexistent/pcache-short")
    llm = ChatPromptCache(max_tokens=4, cache_dir="/nonexistent/pcache-short")
    system = "Answer from the documents.\n\nThe ferry leaves at nine.\n\nThe archive has 412 charts."
    with pytest.warns(PCacheFallbackWarning, match="blank lines"):
        msg = llm.invoke([("system", system), ("human", "When does the ferry leave?")])
    assert msg.response_metadata["documents"] == 0
    assert msg.response_metadata["uncached"] == [
        f"too short: 2 block(s) between blank lines under {MIN_CHARS} characters were computed, not cached"]
    off = ChatPromptCache(max_tokens=4, cache_dir="/nonexistent/pcache-short", learn_documents=False)
    long_system = "Answer from the documents.\n\n" + DOC_A + "\n\n" + DOC_B.replace("ferry", "boat")
    with pytest.warns(PCacheFallbackWarning):
        msg = off.invoke([("system", long_system), ("human", "When does the boat leave?")])
    assert msg.response_metadata["documents"] == 0
    assert msg.response_metadata["uncached"][0].startswith("unseen: 2 block(s)")


@pytest.mark.real_model
def test_an_unmarked_known_document_in_a_system_message_is_read_from_the_cache(smol):
    from pcache_rag.docmodules import Assembler

    asm = Assembler(smol, conditioning="none")
    doc_a, doc_b = (d * 2 for d in (DOC_A, DOC_B))  # long enough to be worth a module
    asm.ensure([doc_a, doc_b])
    system = f"Use the following context to answer.\n\n{doc_b}\n\n{doc_a}\n\nBe brief."
    segs = asm.message_segments([("system", system), ("user", "What is the access code for the copper vault?")])
    docs = [s.text for s in segs if s.kind == "document"]
    assert docs == [doc_b, doc_a], "both documents found in the system message, in order"
    # the documents' text in the assembled prompt is exactly what the template rendered
    assert "".join(s.text for s in segs if s.kind != "markup") .count(doc_a) == 1
    out = asm.generate(segs, max_new_tokens=8)
    n_docs = len(asm.doc_ids(doc_a)) + len(asm.doc_ids(doc_b))
    assert out.documents == 2 and out.encoded_tokens < 16, "only the system message's opening was new (the prefix)"
    assert out.cached_tokens >= n_docs
    again = asm.generate(segs, max_new_tokens=8)
    assert again.encoded_tokens == 0 and again.cached_tokens >= n_docs + out.encoded_tokens and again.text == out.text
    off = asm.message_segments([("system", system), ("user", "What is the code?")], discover=False)
    assert not any(s.kind == "document" for s in off), "discover=False keeps the prompt as plain text"


@pytest.mark.real_model
def test_a_document_seen_marked_once_is_found_unmarked_later(smol):
    from pcache_rag.docmodules import Assembler, format_documents

    asm = Assembler(smol, conditioning="none")
    doc = "The harbour master logs every arrival in the blue ledger before noon. " * 3
    first = asm.generate(asm.text_segments(f"Notes:\n{format_documents([doc])}\nWho logs arrivals?"),
                         max_new_tokens=4)
    assert first.documents == 1
    again = asm.generate(asm.text_segments(f"Notes:\n{doc}\n\nWho logs arrivals?"), max_new_tokens=4)
    assert again.documents == 1 and again.encoded_tokens == 0 and again.cached_tokens > len(asm.doc_ids(doc)) - 2


@pytest.mark.real_model
def test_a_first_sight_computes_the_prompt_and_encodes_its_documents_after_the_answer(smol):
    """Documents nobody has seen: the prompt from the first of them on is computed in the answer's
    one forward (no encoding before the first token), and they are encoded after the answer, so
    the repeat reads them from the cache. With ``defer_first_sight`` off they are encoded first."""
    from pcache_rag.docmodules import Assembler

    asm = Assembler(smol, conditioning="none")
    docs = [" ".join([d] * 3) for d in (DOC_A, DOC_B, DOC_C)]
    msgs = [("system", "Answer from the documents.\n\n" + "\n\n".join(docs)),
            ("user", "What is the access code for the copper vault?")]
    n_docs = sum(len(asm.doc_ids(d)) for d in docs)
    plan = asm.plan(asm.message_segments(msgs), 8)
    assert len(plan.deferred) == 3 and not any(asm._stored(asm.key(ids)) for ids in plan.deferred)
    assert [name for name, _ in plan.parts] == ["prefix"] and len(plan.new_ids) > n_docs, "computed, not encoded"
    first = asm.generate(asm.message_segments(msgs), max_new_tokens=8)
    assert first.documents == 3 and first.encoded_tokens >= n_docs and first.cached_tokens <= plan.parts[0][1].length, \
        "only the prefix came from the cache"
    assert all(asm._stored(asm.key(ids)) for ids in plan.deferred), "encoded after the answer"
    again = asm.generate(asm.message_segments(msgs), max_new_tokens=8)
    assert again.encoded_tokens == 0 and again.cached_tokens >= n_docs
    asm.defer_first_sight = False
    other = [("system", msgs[0][1].replace("copper", "silver")), msgs[1]]
    inline = asm.plan(asm.message_segments(other), 8)
    assert inline.deferred == [] and inline.encoded >= len(asm.doc_ids(docs[0].replace("copper", "silver")))


def test_kept_texts_are_journalled_for_other_processes(tmp_path, caplog):
    """A text added with ``keep=True`` is written to the journal; a KnownTexts in another
    process reads it back and finds it, and takes later lines as they are appended. Texts
    added without ``keep`` (retrieved chunks, recoverable from the index) stay in memory."""
    import subprocess
    import sys

    journal = tmp_path / "kv" / "known-texts.jsonl"
    here = KnownTexts(journal)
    assert here.add(DOC_A, keep=True) == 1 and here.add(DOC_B) == 1
    code = ("import sys; from pcache_rag.discovery import KnownTexts; k = KnownTexts(sys.argv[1]); "
            "print(len(k), bool(k.find(sys.argv[2])), bool(k.find(sys.argv[3]))); "
            "k.add(sys.argv[4], keep=True)")
    doc_c = "The lighthouse keeper winds the clock at dusk and logs every passing ship by its name."
    out = subprocess.run([sys.executable, "-c", code, str(journal), "Q: " + DOC_A, DOC_B, doc_c],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "True", "False"], "the other process knows the kept text only"
    assert here.find("Notes: " + doc_c) == [(7, 7 + len(doc_c))], "its addition reached this process"
    later = DOC_B.replace("07:45", "08:15")
    with open(journal, "ab") as f:  # a damaged line is skipped, with a warning, and the rest read
        f.write(b"{not json\n" + ('"' + later + '"\n').encode())
    with caplog.at_level("WARNING", logger="pcache_rag.discovery"):
        fresh = KnownTexts(journal)
        assert len(fresh) == 3 and later in fresh
    assert "damaged line" in caplog.text


def test_a_torn_last_line_never_swallows_the_next_entry(tmp_path, caplog):
    """A crash mid-write leaves the journal's last line without its newline. The next writers
    (two, one after the other, from separate KnownTexts) end it first: the torn line reads as
    one damaged line, skipped with a warning, and both of their entries are kept."""
    import json

    journal = tmp_path / "known-texts.jsonl"
    journal.write_bytes((json.dumps(DOC_A) + "\n" + json.dumps(DOC_B)[:30]).encode())  # torn after 30 bytes
    later = [DOC_B.replace("07:45", f"0{h}:15") for h in (8, 9)]
    for text in later:
        assert KnownTexts(journal).add(text, keep=True) == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="pcache_rag.discovery"):
        fresh = KnownTexts(journal)
        assert len(fresh) == 3 and DOC_A in fresh and all(t in fresh for t in later) and DOC_B not in fresh
    assert caplog.text.count("damaged line") == 1
    lines = journal.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 5, "every line ends; the torn one stands alone"


def test_template_labels_cut_pieces_and_name_the_question():
    """LangChain hub's ``rlm/rag-prompt`` puts its documents after ``Context:`` and before
    ``Answer:``, in the block of its instructions: each document is a piece of its own, the
    instructions (a header the labels follow) are template text worth keeping, and the piece
    after ``Question:`` is the question, never learned."""
    from pcache_rag.discovery import pieces

    q = "When does the ferry to the island leave in the morning, and from which pier does it go?"
    text = RAG_PROMPT.format(question=q, context="\n\n".join([DOC_A, DOC_B, DOC_C]))
    assert [(text[a:b], label) for a, b, label in pieces(text)] == [
        (RAG_PROMPT.split("\n")[0], ""), (q, "question"), (DOC_A, "context"), (DOC_B, ""), (DOC_C, "")]
    why = Uncached()
    spans = document_spans(text, KnownTexts(), learn=True, lead=True, trail=True, uncached=why)
    assert [text[a:b] for a, b in spans] == [RAG_PROMPT.split("\n")[0], DOC_A, DOC_B, DOC_C]
    assert why.learned == 4 and why.reasons() == []
    # a label alone on its line names the next block; a plain first block is still the message's header
    text = f"Read these.\n\nSources:\n\n{DOC_A}\n\n{DOC_B}"
    assert [text[a:b] for a, b in document_spans(text, KnownTexts(), learn=True, lead=True, trail=False)] == \
        [DOC_A, DOC_B]
    text = f"{DOC_C}\n\n{DOC_A}"
    assert [text[a:b] for a, b in document_spans(text, KnownTexts(), learn=True, lead=True, trail=False)] == [DOC_A]


def test_one_prompt_teaches_at_most_its_cap_of_new_documents():
    """A prompt of 40 learnable blocks learns the first 32 (the Assembler's cap), computes the
    rest and says so, in words; known documents are found whatever the cap."""
    from pcache_rag.discovery import MAX_LEARNED_BLOCKS

    docs = [f"Block {i}: the depot at Yarford {i} keeps {i * 7} crates of copper wire in its north hall." for i in range(40)]
    text = "Read these.\n\n" + "\n\n".join(docs)
    why = Uncached()
    spans = document_spans(text, KnownTexts(), learn=True, lead=True, trail=False, uncached=why,
                           learn_limit=MAX_LEARNED_BLOCKS)
    assert [text[a:b] for a, b in spans] == docs[:32] and (why.learned, why.capped) == (32, 8)
    assert any(r.startswith("capped: 8 block(s) beyond this prompt's limit") for r in why.reasons())
    known = KnownTexts()
    known.add(docs[35])
    spans = document_spans(text, known, learn=True, lead=True, trail=False, uncached=Uncached(), learn_limit=0)
    assert [text[a:b] for a, b in spans] == [docs[35]]


@pytest.mark.real_model
@pytest.mark.parametrize("n_docs", [3, 4])
def test_the_rag_prompt_layout_reads_its_documents_from_the_cache_on_repeat(smol, n_docs):
    """The stock ``rlm/rag-prompt`` template (built with LangChain's ChatPromptTemplate, its
    documents joined as the tutorial's ``format_docs`` joins them) through ``ChatPromptCache``:
    the second identical call reads at least 95% of its prompt from the cache."""
    pytest.importorskip("langchain_pcache")
    from langchain_core.prompts import ChatPromptTemplate

    from langchain_pcache import ChatPromptCache
    from pcache_rag import PromptCache
    from pcache_rag.docmodules import register_engine

    where = f"/nonexistent/pcache-rag-prompt-{n_docs}"
    register_engine(PromptCache(smol.model, smol.tokenizer), "smollm2-135m-instruct", where)
    llm = ChatPromptCache(max_tokens=8, cache_dir=where)
    prompt = ChatPromptTemplate.from_messages([("human", RAG_PROMPT)])
    docs = [(d + " ") * 4 for d in (DOC_A, DOC_B, DOC_C, DOC_A.replace("copper", "silver"))][:n_docs]
    inputs = {"question": "What is the access code for the copper vault?", "context": "\n\n".join(docs)}
    first, second = ((prompt | llm).invoke(inputs) for _ in range(2))
    assert first.usage_metadata["input_token_details"]["cache_read"] < first.usage_metadata["input_tokens"] / 2
    read, total = second.usage_metadata["input_token_details"]["cache_read"], second.usage_metadata["input_tokens"]
    assert read >= 0.95 * total, (read, total, second.response_metadata["uncached"])
    assert second.response_metadata["encoded_tokens"] == 0 and second.content.strip()


@pytest.mark.real_model
def test_documents_encoded_by_one_engine_are_found_by_another_on_the_same_states(tmp_path, smol):
    """The connectors' encoder in one process, a server in another: the second engine (a new
    one on the same ``cache_dir``) finds the unmarked document and reads its stored states."""
    from pcache_rag import PromptCache
    from pcache_rag.docmodules import Assembler

    doc = "The harbour master logs every arrival in the green ledger before noon, and no later. " * 3
    first = Assembler(PromptCache(smol.model, smol.tokenizer, cache_dir=str(tmp_path)), conditioning="none")
    first.ensure([doc])
    other = PromptCache(smol.model, smol.tokenizer, cache_dir=str(tmp_path))
    asm = Assembler(other, conditioning="none")
    out = asm.generate(asm.message_segments([("system", f"Notes:\n\n{doc}"), ("user", "Who logs arrivals?")]),
                       max_new_tokens=4)
    assert out.documents == 1 and out.cached_tokens >= len(asm.doc_ids(doc)) - 2
    assert out.encoded_tokens < 16, "the document's states came from the store, only the prefix was new"
    other.store.close()
    first.pc.store.close()
