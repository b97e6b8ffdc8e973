"""One answer record and one stream shape on every path (issue 58): an Assembler's prompt of
documents streams as the engine's own prompts do (a ``Generation``: text deltas, then
``.output``), and answers with the same ``GenerationOutput``, counted over the whole prompt. The
Assembler's record before 0.2 (``CachedOutput``) and its names answer for one release, with a
DeprecationWarning."""

from __future__ import annotations

import pytest
from helpers import tiny_model

from pcache_rag import PromptCache
from pcache_rag.docmodules import Assembler, format_documents
from pcache_rag.engine import Generation, GenerationOutput, Parts

DOC = "The harbour master logs every arrival in the blue ledger before noon, and no later. " * 3


@pytest.fixture(scope="module")
def asm(smol_tok):
    model = tiny_model("llama", len(smol_tok), seed=5)
    return Assembler(PromptCache(model, smol_tok, store_dtype=None), conditioning="none")


def test_an_assembler_prompt_streams_as_the_engine_does_and_counts_the_whole_prompt(asm):
    segs = asm.text_segments(f"Notes:\n{format_documents([DOC])}\nWho logs arrivals?")
    plan = asm.plan(segs, 6)
    stream = asm.stream(segs, max_new_tokens=6)
    assert isinstance(stream, Generation)
    deltas = list(stream)
    assert all(isinstance(d, str) for d in deltas), "only text: the record is stream.output"
    out = stream.output
    assert isinstance(out, GenerationOutput) and out.text == "".join(deltas) and len(out.token_ids) == 6
    assert out.documents == 1 and out.prompt_tokens == plan.prompt_tokens == out.cached_tokens + out.computed_tokens
    assert out.encoded_tokens >= len(asm.doc_ids(DOC)) - 2, "the marked document was encoded for this prompt"
    engine_out = asm.pc.generate(Parts([], asm.pc.tokenizer("Who logs arrivals?")["input_ids"]), max_new_tokens=1)
    assert set(out.usage()) == set(engine_out.usage()), "the engine's own answers report the same keys"
    assert set(out.usage()) <= set(out.stats()) and out.stats()["uncached"] == list(out.uncached)
    again = asm.generate(segs, max_new_tokens=6)
    # the repeat reads the document's stored states (the first answer computed them in the prompt, at
    # first sight): on this random model its tokens may differ from the first's, its counts may not
    assert isinstance(again, GenerationOutput) and again.prompt_tokens == out.prompt_tokens
    assert again.encoded_tokens == 0 and again.cached_tokens > out.cached_tokens, "read from the cache the second time"


def test_a_stream_closed_early_has_no_output_and_releases_the_engine(asm):
    segs = asm.text_segments(f"Notes:\n{format_documents([DOC])}\nWho keeps the ledger?")
    stream = asm.stream(segs, max_new_tokens=8)
    next(stream)
    stream.close()
    assert stream.output is None
    assert len(asm.generate(segs, max_new_tokens=2).token_ids) == 2, "the engine is free again"


def test_the_names_before_0_2_answer_with_a_deprecation_warning(asm):
    out = asm.generate(asm.text_segments(f"Notes:\n{format_documents([DOC])}\nWhen?"), max_new_tokens=2)
    with pytest.warns(DeprecationWarning, match="CachedOutput is deprecated"):
        from pcache_rag.docmodules import CachedOutput
    assert CachedOutput is GenerationOutput
    with pytest.warns(DeprecationWarning, match="'cache_read'"):
        assert out.cache_read == out.cached_tokens
    with pytest.warns(DeprecationWarning, match="'encoded'"):
        assert out.encoded == out.encoded_tokens
    with pytest.warns(DeprecationWarning, match="'computed'"):
        assert out.computed == out.computed_tokens
    with pytest.warns(DeprecationWarning, match="'output'"):
        assert out.output is out
    with pytest.raises(AttributeError, match="no attribute 'cache_hits'"):
        out.cache_hits  # noqa: B018 - only names that existed answer

