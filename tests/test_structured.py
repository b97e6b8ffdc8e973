"""Structured output: grammar-constrained decoding (llguidance) on the cached path, the
response-format parsing every entry point shares, and the refusals.

The engine tests use a tiny random Llama with the embedded model's tokenizer (llguidance
reads a Hugging Face fast tokenizer): a random model follows no instruction, so whatever it
writes under a grammar is the grammar's doing.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

pytest.importorskip("llguidance")

from pcache_rag.grammar import (JSON_INSTRUCTION, SCHEMA_INSTRUCTION, StructuredOutputWarning, closed,  # noqa: E402
                                json_grammar, lark_grammar, regex_grammar, structured, with_instruction)

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["colour", "ok", "n"]}
SCHEMA_PML = ('<schema name="s"><system>Be brief.</system><module name="doc">The harbour light is green and '
              'the ferry leaves at seven in the morning from the north pier.</module></schema>')


@pytest.fixture(scope="module")
def tiny(smol_tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    from pcache_rag import PromptCache

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(smol_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    pc = PromptCache(LlamaForCausalLM(cfg).eval(), smol_tok)
    pc.add_schema(SCHEMA_PML)
    return pc


def _prompt(q: str) -> str:
    return f'<prompt schema="s"><doc/><user>{q}</user></prompt>'


def test_cached_answer_follows_a_json_schema(tiny):
    out = tiny.generate(_prompt("Which colour?"), max_new_tokens=48, grammar=json_grammar(SCHEMA))
    assert out.cached_tokens > 0, "the module came from the cache"
    assert out.finish_reason == "eos", out.text  # the grammar completed: nothing may follow
    obj = json.loads(out.text)
    assert set(obj) == {"colour", "ok", "n"} and obj["colour"] in ("red", "green", "blue")
    assert isinstance(obj["ok"], bool) and 0 <= obj["n"] <= 99
    free = tiny.generate(_prompt("Which colour?"), max_new_tokens=24)
    assert free.text != out.text, "without the grammar the random model writes something else"


def test_regex_and_lark_grammars_and_sampling(tiny):
    out = tiny.generate(_prompt("Code?"), max_new_tokens=12, grammar=regex_grammar(r"[A-Z]{3}-[0-9]{2}"))
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", out.text), out.text
    g = lark_grammar('start: "yes" | "no" | "maybe"')
    for seed in range(4):  # sampled at a high temperature, still inside the grammar
        o = tiny.generate(_prompt("Well?"), max_new_tokens=6, do_sample=True, temperature=1.5, seed=seed, grammar=g)
        assert o.text in ("yes", "no", "maybe"), o.text


def test_streamed_deltas_are_the_constrained_answer(tiny):
    g = json_grammar(SCHEMA)
    stream = tiny.stream(_prompt("Which colour?"), max_new_tokens=48, grammar=g)
    text = "".join(stream)
    assert stream.output is not None and text == stream.output.text
    json.loads(text)


def test_a_grammar_cut_short_warns(tiny):
    with pytest.warns(StructuredOutputWarning, match="max_new_tokens=3"):
        out = tiny.generate(_prompt("Which colour?"), max_new_tokens=3, grammar=json_grammar(SCHEMA))
    assert out.finish_reason == "length"
    with warnings.catch_warnings():
        warnings.simplefilter("error", StructuredOutputWarning)  # a complete one does not
        tiny.generate(_prompt("Which colour?"), max_new_tokens=48, grammar=json_grammar(SCHEMA))


def test_bad_grammars_are_refused_before_any_work(tiny):
    from pcache_rag import SamplingParams

    with pytest.raises(ValueError, match="invalid grammar"):
        SamplingParams(grammar="not a grammar")
    with pytest.raises(ValueError, match="Invalid type"):
        json_grammar({"type": "frobnicated"})
    with pytest.raises(ValueError, match="not valid JSON"):
        json_grammar("{broken")


def test_schemas_beyond_the_limits_are_refused_by_name_before_compiling():
    """Recursive ``$ref`` (to the root, to a definition, mutual), depth, enum size, remote refs
    and size: each refused with the limit it broke, as a ValueError (the server's 400), before
    llguidance sees it; limits can be set per process, and a schema within them compiles."""
    from pcache_rag import grammar

    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}
    deep: dict = {"type": "string"}
    for _ in range(400):
        deep = {"type": "object", "properties": {"x": deep}}
    cases = [({"type": "object", "properties": {"child": {"$ref": "#"}}}, r"recursive \(\$ref '#' reaches itself\)"),
             ({"$defs": {"node": node}, "$ref": "#/$defs/node"}, "recursive"),
             ({"$defs": {"a": {"properties": {"b": {"$ref": "#/$defs/b"}}},
                         "b": {"properties": {"a": {"$ref": "#/$defs/a"}}}}, "$ref": "#/$defs/a"}, "recursive"),
             (deep, "nested deeper than 32 levels"),
             ({"enum": [str(i) for i in range(10_000)]}, "10000 members"),
             ({"$ref": "https://example.com/s.json"}, "only local references"),
             ({"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(3000)}}, "more than 4096 nodes")]
    for schema, words in cases:
        with pytest.raises(grammar.SchemaLimitError, match=words):
            json_grammar(schema)
        with pytest.raises(ValueError, match=words):
            structured({"type": "json_schema", "json_schema": {"schema": schema}})
    fine = {"type": "object", "properties": {"a": {"$ref": "#/$defs/code"}, "b": {"$ref": "#/$defs/code"}},
            "$defs": {"code": {"type": "string", "pattern": "[A-Z]{2}-[0-9]{4}"}}}
    assert json_grammar(fine)
    grammar.check_schema({"enum": list(range(600))}, grammar.SchemaLimits(enum=1000))


def test_response_format_shapes():
    assert structured(None) is None and structured({"type": "text"}) is None
    mode = structured({"type": "json_object"})
    assert mode is not None and mode.schema is None and mode.instruction == JSON_INSTRUCTION
    fmt = structured({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    assert fmt is not None and fmt.schema == SCHEMA and fmt.instruction == SCHEMA_INSTRUCTION + json.dumps(SCHEMA)
    for bad, words in [({"type": "json_schema"}, "needs"), ({"type": "yaml"}, "'yaml' is not supported"),
                       ("json", "must be an object")]:
        with pytest.raises(ValueError, match=words):
            structured(bad)  # type: ignore[arg-type]


def test_closed_objects_and_instructions():
    s = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                                          "c": {"type": "object", "properties": {}, "additionalProperties": True}}}
    c = closed(s)
    assert c["additionalProperties"] is False and c["properties"]["a"]["additionalProperties"] is False
    assert c["properties"]["c"]["additionalProperties"] is True, "an explicit choice is kept"
    assert "additionalProperties" not in s, "the caller's schema is not changed"
    turns = [("system", "S"), ("user", "Q1"), ("assistant", "A"), ("user", "Q2")]
    assert with_instruction(turns, "!") == [("system", "S"), ("user", "Q1"), ("assistant", "A"), ("user", "Q2!")]
    assert with_instruction([("system", "S")], "\n\nDo it.") == [("system", "S"), ("user", "Do it.")]
    assert with_instruction(turns, "") == turns


def test_auto_recomputes_every_documents_sentence_for_a_structured_answer():
    """``"auto"`` is ``each:1`` when a grammar constrains the answer (on look-alike documents
    ``match:1`` changed more structured answers than reordering does:
    docs/runs/2026-12-06-structured-recompute.md), and the same otherwise (issue 56), and nothing
    under a calibration; an explicit policy is itself."""
    from pcache_rag.recompute import RAG_RECOMPUTE, STRUCTURED_RECOMPUTE, resolve_auto

    assert resolve_auto("auto", structured=True) == STRUCTURED_RECOMPUTE == "each:1"
    assert resolve_auto("auto") == RAG_RECOMPUTE == "each:1"
    assert resolve_auto("auto", "ape:1:1", structured=True) is None
    assert resolve_auto("match:2", structured=True) == "match:2"
