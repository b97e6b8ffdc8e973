"""Document discovery (issue 21): known documents found in any prompt without marks, and
served from the cache exactly as marked ones are."""

from __future__ import annotations

import time

import pytest

from pcache_rag.discovery import MIN_CHARS, KnownTexts

DOC_A = ("The access code for the copper vault is QX-5521. The archivist keeps the only key, "
         "and the vault opens on the first Monday of every month.")
DOC_B = ("The ferry to the island leaves at 07:45 every morning from the north pier, and the last "
         "one returns at 19:10, weather permitting.")


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


def test_lookup_scales_to_a_large_corpus():
    """100,000 known chunks, one prompt of about 8K tokens (~32K characters): every chunk in
    it found. The time is printed, not asserted (it is a benchmark figure: README)."""
    import random

    r = random.Random(0)
    words = [f"w{r.randrange(50_000)}" for _ in range(400_000)]
    chunks = [" ".join(words[i * 4 : i * 4 + 40]) + f" chunk {i}." for i in range(100_000)]
    kt = KnownTexts()
    kt.add(chunks)
    prompt = "\n\n".join(chunks[i] for i in range(0, 100_000, 10_000)) + "\n\n" + " ".join(words[:5000])
    t0 = time.perf_counter()
    spans = kt.find(prompt)
    first = time.perf_counter() - t0  # includes building the automaton
    t0 = time.perf_counter()
    spans = kt.find(prompt)
    again = time.perf_counter() - t0
    assert [prompt[a:b] for a, b in spans][:10] == [chunks[i] for i in range(0, 100_000, 10_000)]
    kt.add(["A chunk retrieved just now, after the automaton was built: " + chunks[5]])
    t0 = time.perf_counter()
    assert len(kt.find(prompt)) == len(spans), "a few new texts do not disturb the lookup"
    after_add = time.perf_counter() - t0
    print(f"discovery: {len(prompt)} chars against 100,000 chunks: {first * 1e3:.0f} ms with the build, "
          f"{again * 1e3:.1f} ms after, {after_add * 1e3:.1f} ms after adding one text")


@pytest.mark.real_model
def test_an_unmarked_known_document_in_a_system_message_is_read_from_the_cache(smol):
    from pcache_rag.frameworks import Assembler

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
    assert out.documents == 2 and out.encoded < 16, "only the system message's opening was new (the prefix)"
    assert out.cache_read >= n_docs
    again = asm.generate(segs, max_new_tokens=8)
    assert again.encoded == 0 and again.cache_read >= n_docs + out.encoded and again.text == out.text
    off = asm.message_segments([("system", system), ("user", "What is the code?")], discover=False)
    assert not any(s.kind == "document" for s in off), "discover=False keeps the prompt as plain text"


@pytest.mark.real_model
def test_a_document_seen_marked_once_is_found_unmarked_later(smol):
    from pcache_rag.frameworks import Assembler, format_documents

    asm = Assembler(smol, conditioning="none")
    doc = "The harbour master logs every arrival in the blue ledger before noon. " * 3
    first = asm.generate(asm.text_segments(f"Notes:\n{format_documents([doc])}\nWho logs arrivals?"),
                         max_new_tokens=4)
    assert first.documents == 1
    again = asm.generate(asm.text_segments(f"Notes:\n{doc}\n\nWho logs arrivals?"), max_new_tokens=4)
    assert again.documents == 1 and again.encoded == 0 and again.cache_read > len(asm.doc_ids(doc)) - 2


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


@pytest.mark.real_model
def test_documents_encoded_by_one_engine_are_found_by_another_on_the_same_states(tmp_path, smol):
    """The connectors' encoder in one process, a server in another: the second engine (a new
    one on the same ``cache_dir``) finds the unmarked document and reads its stored states."""
    from pcache_rag import PromptCache
    from pcache_rag.frameworks import Assembler

    doc = "The harbour master logs every arrival in the green ledger before noon, and no later. " * 3
    first = Assembler(PromptCache(smol.model, smol.tokenizer, cache_dir=str(tmp_path)), conditioning="none")
    first.ensure([doc])
    other = PromptCache(smol.model, smol.tokenizer, cache_dir=str(tmp_path))
    asm = Assembler(other, conditioning="none")
    out = asm.generate(asm.message_segments([("system", f"Notes:\n\n{doc}"), ("user", "Who logs arrivals?")]),
                       max_new_tokens=4)
    assert out.documents == 1 and out.cache_read >= len(asm.doc_ids(doc)) - 2
    assert out.encoded < 16, "the document's states came from the store, only the prefix was new"
    other.store.close()
    first.pc.store.close()
