"""Tool calling's model-free parts (pcache_rag.tools): specs, tool_choice, the call grammar
(checked token by token with the embedded model's tokenizer), the parser, the stream reader,
tool plans, and the chat template's tool turn."""

from __future__ import annotations

import json
import warnings

import pytest

from pcache_rag import tools as T

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
TOOLS = T.tools_of([ADD, SEARCH])

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
CALL2 = '<tool_call>{"name": "search", "arguments": {"query": "north gate"}}</tool_call>'


def accepts(tok, grammar: str, text: str) -> bool:
    """Whether ``grammar`` admits ``text`` in full, fed as the model's tokens (every token, as the
    decoding mask does, and the whole at its end)."""
    import llguidance

    from pcache_rag.grammar import ll_tokenizer

    m = llguidance.LLMatcher(ll_tokenizer(tok, len(tok)), grammar)
    with warnings.catch_warnings():
        ok = all(m.consume_token(i) for i in tok(text, add_special_tokens=False)["input_ids"])
    return ok and m.is_accepting()


def prefix_allowed(tok, grammar: str, text: str) -> bool:
    """Whether every token of ``text`` is allowed as it comes (what the decoding mask enforces)."""
    import llguidance

    from pcache_rag.grammar import ll_tokenizer

    m = llguidance.LLMatcher(ll_tokenizer(tok, len(tok)), grammar)
    return all(m.consume_token(i) for i in tok(text, add_special_tokens=False)["input_ids"])


def test_specs_are_checked_by_name():
    with pytest.raises(T.ToolError, match="only function tools"):
        T.tools_of([{"type": "retrieval"}])
    with pytest.raises(T.ToolError, match="the name must be"):
        T.tools_of([{"type": "function", "function": {"name": "bad name!"}}])
    with pytest.raises(T.ToolError, match=r"tools\[0\] \(x\): parameters must be"):
        T.tools_of([{"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}])
    assert T.tools_of([{"type": "function", "function": {"name": "x"}}])[0].parameters["type"] == "object"
    # the same tool given twice is one tool; the same name with other parameters warns and keeps the first
    assert len(T.tools_of([ADD, ADD])) == 1
    other = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    with pytest.warns(T.ToolWarning, match="repeats the name 'add'"):
        assert T.tools_of([ADD, other])[0].parameters == ADD["function"]["parameters"]


def test_tool_choice_forms():
    assert T.choice_of(None, TOOLS) == "auto"
    assert T.choice_of(None, []) == "none"
    assert T.choice_of("any", TOOLS) == T.choice_of(True, TOOLS) == "required"
    assert T.choice_of({"type": "function", "function": {"name": "add"}}, TOOLS) == "add"
    assert T.choice_of("search", TOOLS) == "search"
    with pytest.raises(T.ToolError, match="'mul' is not"):
        T.choice_of("mul", TOOLS)
    with pytest.raises(T.ToolError, match="needs tools"):
        T.choice_of("required", [])


def test_grammar_by_choice(smol_tok):
    auto, required, named = T.grammar(TOOLS, "auto"), T.grammar(TOOLS, "required"), T.grammar(TOOLS, "add")
    assert T.grammar([], "auto") is None
    none = T.grammar(TOOLS, "none")  # text, never a call: a model that saw calls would write one as text
    assert accepts(smol_tok, none, "The north gate has 14 guards; 14 * 3 is 42.")
    assert not accepts(smol_tok, none, CALL) and not accepts(smol_tok, none, "So: " + CALL)
    assert accepts(smol_tok, none, "a < b, <tab> and <<too x <too")  # only "<tool" is kept out
    assert not prefix_allowed(smol_tok, none, "<tool_call_2>"), "nor a look-alike of it"
    assert not prefix_allowed(smol_tok, none, '<tool_call>{"name"'), "the mask stops the tag as it is decoded"
    assert accepts(smol_tok, auto, "Twelve plus thirty is 42.")  # auto: free text
    assert accepts(smol_tok, auto, "Let me add. " + CALL)  # or a call after text
    assert not accepts(smol_tok, auto, '<tool_call>{"name": "mul", "arguments": {}}</tool_call>')  # unknown tool
    assert not accepts(smol_tok, auto, '<tool_call>{"name": "add", "arguments": {"a": "one"}}</tool_call>')
    assert not accepts(smol_tok, required, "Hello")  # required: a call, nothing else
    assert accepts(smol_tok, required, CALL) and accepts(smol_tok, required, CALL2)
    assert not accepts(smol_tok, required, CALL + "\n" + CALL2)  # one call unless parallel
    assert accepts(smol_tok, T.grammar(TOOLS, "required", parallel=True), CALL + "\n" + CALL2)
    assert accepts(smol_tok, named, CALL) and not accepts(smol_tok, named, CALL2)
    # arguments are closed objects: a key the schema does not name is refused
    assert not accepts(smol_tok, named, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}</tool_call>')


def test_parse_reads_calls_content_and_cut_calls():
    content, calls, bad = T.parse("Sure. " + CALL + "\n" + CALL2)
    assert content == "Sure."
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2}), ("search", {"query": "north gate"})]
    assert not bad and calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    content, calls, bad = T.parse(CALL + '\n<tool_call>{"name": "add", "argu')
    assert len(calls) == 1 and bad[0]["error"] == "the call was cut off"
    assert T.parse("<tool_call>not json</tool_call>")[2][0]["error"].startswith("not JSON")


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_stream_reader_gives_what_parse_reads(step):
    text = "Sure. " + CALL + "\n" + '<tool_call>{"name": "search", "arguments": {"query": "}</tool_call"}}</tool_call>'
    reader, out = T.CallStream(), []
    for i in range(0, len(text), step):
        out += list(reader.feed(text[i:i + step]))
    out += list(reader.flush())
    assert "".join(d.text for d in out) == "Sure. "
    names = [d.name for d in out if d.name]
    assert names == ["add", "search"] and len({d.id for d in out if d.name}) == 2
    for i, (_, args) in enumerate([("add", {"a": 1, "b": 2}), ("search", {"query": "}</tool_call"})]):
        assert json.loads("".join(d.arguments for d in out if d.index == i)) == args
    # text that only looks like the start of a call is given back as text
    reader = T.CallStream()
    assert "".join(d.text for d in [*reader.feed("a <tool"), *reader.feed("box> b"), *reader.flush()]) == "a <toolbox> b"


def test_with_tools_puts_them_in_the_system_message():
    turns = T.with_tools([("system", "Be brief."), ("user", "hi")], TOOLS)
    assert turns[0][0] == "system" and turns[0][1].endswith("\n\nBe brief.") and '"name": "add"' in turns[0][1]
    assert T.with_tools([("user", "hi")], TOOLS)[0][1].endswith(T.DEFAULT_SYSTEM)
    assert T.render_calls("", [T.ToolCall("x", "add", {"a": 1, "b": 2})]) == CALL  # as the model writes it


def test_a_plan_fixes_the_order_then_answers_in_text():
    turns = [("user", "q")]
    assert T.planned(turns, ["search", "add"], TOOLS) == "search"
    turns += [("assistant", CALL2), ("tool", "found")]
    assert T.planned(turns, ["search", "add"], TOOLS) == "add"
    turns += [("assistant", CALL), ("tool", "3")]
    assert T.planned(turns, ["search", "add"], TOOLS) == "none"
    assert T.planned(turns + [("user", "again")], ["search", "add"], TOOLS) == "search"  # a new question
    assert T.planned(turns, [], TOOLS) is None
    with pytest.raises(T.ToolError, match="tool_plan names 'mul'"):
        T.planned(turns, ["mul"], TOOLS)
    use = T.prepare([("user", "q")], [ADD, SEARCH], "auto", plan=["add"])
    assert use.parse and use.grammar == T.grammar(TOOLS, "add")


def test_tools_and_a_response_format_are_not_both_served():
    with pytest.raises(T.ToolError, match="not both"):
        T.prepare([("user", "q")], [ADD], None, grammar_given=True)
    assert T.prepare([("user", "q")], None).turns == [("user", "q")]


def test_chat_format_has_a_tool_turn(smol_tok):
    from transformers import AutoTokenizer

    from pcache_rag.pml.chat import PLAIN, TOOL_OPEN, chat_format_for

    fmt = chat_format_for(smol_tok)  # SmolLM2's template renders any role: its own tool turn
    assert fmt.prefix["tool"] == "<|im_start|>tool\n" and fmt.suffix["tool"] == "<|im_end|>\n"
    assert PLAIN.prefix["tool"] == "Tool: "
    # a template that refuses the role: the result goes in a user turn, in <tool_response> tags
    strict = AutoTokenizer.from_pretrained(smol_tok.name_or_path)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                            "{{ raise_exception('bad role') }}{% endif %}<{{ m['role'] }}>{{ m['content'] }}</s>"
                            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    fmt = chat_format_for(strict)
    assert fmt.prefix["tool"] == "<user>" + TOOL_OPEN and fmt.suffix["tool"].endswith("</s>")
