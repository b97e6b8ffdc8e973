"""Property-based: nothing but PMLError ever escapes the PML layer, and escape round-trips."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import WordTokenizer
from pcache_rag.pml import PMLError, chat_format_for, escape, layout_schema, parse_prompt, parse_schema, plan_prompt

PIECES = ["<schema name=\"s\">", "</schema>", "<prompt schema=\"s\">", "</prompt>", "<module name=\"m\">",
          "<module name=\"n\">", "</module>", "<union>", "</union>", "<param name=\"p\" len=\"2\"/>",
          "<param name=\"q\" len=\"-1\"/>", "<scaffold name=\"sc\">", "</scaffold>", "<system>", "</system>",
          "<user>", "</user>", "<assistant>", "<m/>", "<n p=\"a b\"/>", "<sc/>", "<![CDATA[", "]]>", "<!--", "-->",
          "&amp;", "&#0;", "&#x110000;", "&lt;", "&", "<", ">", "\"", "'", "=", "/", " ", "\n", "text", "a<b", "<?x",
          "<!DOCTYPE", "&#55296;"]

VALID_SCHEMA = ('<schema name="s"><system>sys</system><union><module name="m">a b</module>'
                '<module name="n">c <param name="p" len="2"/> d</module></union>'
                '<scaffold name="sc"><module name="x">e</module><module name="y">f</module></scaffold></schema>')

docs = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)


def mutate(s: str, data) -> str:
    for _ in range(data.draw(st.integers(0, 4))):
        if not s:
            break
        i = data.draw(st.integers(0, len(s) - 1))
        op = data.draw(st.sampled_from(["del", "dup", "ins"]))
        if op == "del":
            s = s[:i] + s[i + 1:]
        elif op == "dup":
            s = s[:i] + s[i] + s[i:]
        else:
            s = s[:i] + data.draw(st.sampled_from(PIECES + [chr(c) for c in range(32, 127)])) + s[i:]
    return s


def exercise(doc: str) -> None:
    tok = WordTokenizer()
    cf = chat_format_for(tok)
    try:
        L = layout_schema(doc, tok, cf, max_positions=64)
    except PMLError:
        L = layout_schema(VALID_SCHEMA, tok, cf)
    for p in (doc, doc.replace("schema name", "prompt schema")):
        try:
            plan_prompt(p, L, tok, max_positions=64)
        except PMLError:
            pass


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs)
def test_random_documents_raise_only_pml_errors(doc):
    exercise(doc)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_valid_documents_raise_only_pml_errors(data):
    base = data.draw(st.sampled_from([VALID_SCHEMA, '<prompt schema="s"><n p="x y"/><sc/><user>q &amp; a</user></prompt>']))
    exercise(mutate(base, data))


@settings(max_examples=1000, deadline=None)
@given(st.text())
def test_escape_round_trips_any_text(text):
    p = parse_prompt(f'<prompt schema="s"><user>{escape(text)}</user></prompt>')
    got = "".join(t.text for t in p.body[0].body) if p.body else ""
    assert got == text
    s = parse_schema(f'<schema name="s"><module name="m">{escape(text)}</module></schema>')
    assert "".join(t.text for t in s.body[0].body) == text
