"""Layout positions and prompt plans, with a one-token-per-word tokenizer for exact arithmetic,
and role tags with the embedded model's real chat template."""

import pytest

from helpers import WordTokenizer, words
from pcache_rag.pml import PLAIN, PMLError, chat_format_for, layout_schema, plan_prompt


def lay(schema, max_positions=None):
    tok = WordTokenizer()
    return layout_schema(schema, tok, chat_format_for(tok), max_positions), tok


def test_paper_example_50_and_60_put_the_next_module_at_110():
    L, _ = lay(f'<schema name="s"><module name="a">{words(50)}</module><module name="b">{words(60)}</module>'
               f'<module name="c">{words(5)}</module></schema>')
    assert (L.units["a"].start, L.units["b"].start, L.units["c"].start) == (0, 50, 110)
    assert L.units["c"].position_ids == list(range(110, 115))
    assert L.length == 115


def test_union_members_share_start_and_reserve_the_longest():
    L, _ = lay(f'<schema name="s">{words(3)}<union><module name="x">{words(4)}</module>'
               f'<module name="y">{words(9)}</module></union><module name="z">{words(2)}</module></schema>')
    assert L.units["x"].start == L.units["y"].start == 3
    assert L.units["z"].start == 3 + 9
    assert L.unions == [["x", "y"]]
    assert L.preamble == "#0" and L.units["#0"].token_ids and L.units["#0"].kind == "anonymous"


def test_param_reserves_len_positions_and_holds_no_tokens():
    L, _ = lay('<schema name="s"><module name="m">a b <param name="p" len="4"/> c d</module></schema>')
    m = L.units["m"]
    assert m.position_ids == [0, 1, 6, 7]
    assert m.params[0].start == 2 and m.params[0].length == 4 and m.params[0].offset == 2
    assert m.end == 8


def test_nested_module_inside_parent_range():
    L, _ = lay('<schema name="s"><module name="p">a b <module name="c">x y z</module> d</module>'
               '<module name="n">q</module></schema>')
    p, c = L.units["p"], L.units["c"]
    assert c.parent == "p" and c.position_ids == [2, 3, 4]
    assert p.position_ids == [0, 1, 5] and p.end == 6
    assert L.units["n"].start == 6


def test_scaffold_joint_unit_covers_members():
    L, _ = lay('<schema name="s"><scaffold name="sc"><module name="a">x y</module><module name="b">z</module>'
               '</scaffold></schema>')
    sc = L.units["sc"]
    assert sc.kind == "scaffold" and sc.members == ("a", "b")
    assert sc.position_ids == [0, 1, 2]
    assert L.units["a"].scaffold == "sc"


def test_uncached_text_goes_after_the_schema_in_prompt_order():
    L, tok = lay(f'<schema name="s"><module name="a">{words(5)}</module><module name="b">{words(7)}</module></schema>')
    p = plan_prompt('<prompt schema="s">first <b/> second</prompt>', L, tok)
    assert [u.name for u in p.units] == ["b"]
    assert p.uncached_positions == [12, 13]
    assert tok.decode(p.uncached_ids) == "first second"


def test_layout_is_deterministic():
    s = '<schema name="s"><system>be brief</system><module name="a">one two</module></schema>'
    a, _ = lay(s)
    b, _ = lay(s)
    assert [(u.name, u.token_ids, u.position_ids) for u in a.units.values()] == \
           [(u.name, u.token_ids, u.position_ids) for u in b.units.values()]


def test_plain_role_fallback_without_chat_template():
    L, tok = lay('<schema name="s"><system>be brief</system><module name="a">x</module></schema>')
    assert L.chat is PLAIN
    assert tok.decode(L.units["#0"].token_ids) == "System: be brief"
    p = plan_prompt('<prompt schema="s"><a/><user>why?</user></prompt>', L, tok)
    assert tok.decode(p.uncached_ids) == "User: why? Assistant:"


def test_roles_use_the_real_chat_template(smol_tok):
    cf = chat_format_for(smol_tok)
    assert cf.source == "template"
    assert cf.prefix["user"] == "<|im_start|>user\n" and cf.suffix["user"] == "<|im_end|>\n"
    L = layout_schema('<schema name="s"><system>Be brief.</system><module name="d">Doc.</module></schema>', smol_tok, cf)
    p = plan_prompt('<prompt schema="s"><d/><user>Why?</user></prompt>', L, smol_tok)
    whole = smol_tok.decode(L.units["#0"].token_ids + L.units["d"].token_ids + p.uncached_ids)
    expect = smol_tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}],
        tokenize=False, add_generation_prompt=True)
    assert whole == expect.replace("<|im_end|>\n<|im_start|>user", "<|im_end|>\nDoc.<|im_start|>user")


def test_final_assistant_turn_stays_open(smol_tok):
    cf = chat_format_for(smol_tok)
    L = layout_schema('<schema name="s"><module name="d">Doc.</module></schema>', smol_tok, cf)
    p = plan_prompt('<prompt schema="s"><d/><user>Hi</user><assistant>Sure,</assistant></prompt>', L, smol_tok)
    assert smol_tok.decode(p.uncached_ids).endswith("<|im_start|>assistant\nSure,")


SCHEMA = ('<schema name="s"><union><module name="x">a</module><module name="y">b</module></union>'
          '<module name="t">go <param name="d" len="2"/> now</module>'
          '<module name="p">q <module name="c">r</module></module></schema>')


@pytest.mark.parametrize("prompt, fragment", [
    ('<prompt schema="s"><z/>q</prompt>', "has no module 'z'"),
    ('<prompt schema="s"><xx/>q</prompt>', "did you mean 'x'"),
    ('<prompt schema="s"><x/><y/>q</prompt>', "same <union>"),
    ('<prompt schema="s"><t/>q</prompt>', "needs the argument d="),
    ('<prompt schema="s"><t d="1" e="2"/>q</prompt>', "no parameter 'e'"),
    ('<prompt schema="s"><t d="one two three"/>q</prompt>', "is 3 tokens; the param allows 2"),
    ('<prompt schema="s"><c/>q</prompt>', "import <p/> too"),
    ('<prompt schema="other"><x/>q</prompt>', "schema 'other'"),
])
def test_plan_errors(prompt, fragment):
    L, tok = lay(SCHEMA)
    with pytest.raises(PMLError) as e:
        plan_prompt(prompt, L, tok)
    assert fragment in str(e.value)
    assert e.value.line == 1 and e.value.column > 0


def test_context_overflow_is_a_pml_error():
    with pytest.raises(PMLError, match="at most 10"):
        lay(f'<schema name="s"><module name="a">{words(11)}</module></schema>', max_positions=10)
    L, tok = lay(f'<schema name="s"><module name="a">{words(8)}</module></schema>', max_positions=10)
    with pytest.raises(PMLError, match="shorten the prompt"):
        plan_prompt('<prompt schema="s"><a/>one two three</prompt>', L, tok, max_positions=10)


def test_plan_args_and_scaffold_substitution():
    L, tok = lay('<schema name="s"><module name="t">go <param name="d" len="3"/> now</module>'
                 '<scaffold name="sc"><module name="a">x</module><module name="b">y</module></scaffold></schema>')
    p = plan_prompt('<prompt schema="s"><t d="two words"/><sc/>q</prompt>', L, tok)
    assert [u.name for u in p.units] == ["t", "sc"]
    (_, slot, ids), = p.args
    assert slot.start == 1 and len(ids) == 2
    p2 = plan_prompt('<prompt schema="s"><t d="x"/><a/><b/>q</prompt>', L, tok)
    assert [u.name for u in p2.units] == ["t", "sc"], "importing every member uses the joint states"
    p3 = plan_prompt('<prompt schema="s"><t d="x"/><a/>q</prompt>', L, tok)
    assert [u.name for u in p3.units] == ["t", "a"]
