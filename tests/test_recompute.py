"""Selective recomputation (issue 9): the invariants on tiny random models of every family.

* ``all`` equals one stock forward over the same tokens and positions, full causal mask;
* ``none`` is the cached path unchanged (bit-identical);
* a selected set equals a reference forward in which the selected rows attend causally to
  everything before them and the other rows keep their cached states. The reference is
  built independently: a stock (eager) forward whose past holds only the unselected cached
  rows and whose query is the selected rows followed by the new tokens.
"""

import copy

import pytest
import torch
from transformers.cache_utils import DynamicCache

from helpers import WINDOWED, adapter_of, contiguous_parts, stock_mask, tiny_model
from pcache_rag import PromptCache
from pcache_rag.models import UnsupportedModelError
from pcache_rag.recompute import (MATCH_MAX_TOKENS, Lexicon, Recompute, contrast_rows, each_rows, epic_rows, focus_scores, match_rows,
                                  question_attention, recompute_mask, select_rows)
from pcache_rag.engine import Parts

FAMILIES = ["llama", "qwen2", "gpt2", "bloom", "mpt"] + WINDOWED
TEXTS = ["Alpha document with several words in it and more.", "Bravo text that follows the alpha one here.",
         "Charlie is the third chunk of context in this prompt."]


def sharp_model(family: str, vocab: int, seed: int):
    """A tiny random model with sharper attention (query/key weights scaled up), so that what a
    token attends to changes its logits well above float32 rounding: a test that compares
    recomputed and cached logits can then tell them apart."""
    model = tiny_model(family, vocab, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(t in name for t in ("q_proj", "k_proj", "c_attn", "query_key_value", "Wqkv")):
                p.mul_(4.0)
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def pc(request, smol_tok):
    model = sharp_model(request.param, len(smol_tok), seed=3)
    return PromptCache(model, smol_tok, encoding="isolated", store_dtype=None)


def _parts(pc):
    """Three chunks encoded apart, at contiguous positions (as RAG places them)."""
    return contiguous_parts(pc, TEXTS)


def _reference(pc, parts, new_ids, rows):
    """Logits (T, vocab) of the new tokens: past = unselected cached rows, query = selected rows +
    new tokens, each attending causally (cache order) to what precedes it."""
    kvs = [kv for _, kv in parts]
    ids = torch.cat([kv.token_ids for kv in kvs])
    pos = torch.cat([kv.position_ids for kv in kvs])
    C = ids.shape[0]
    keep = [j for j in range(C) if j not in set(rows)]
    K = torch.cat([kv.keys for kv in kvs], dim=2)  # (L, H, C, D)
    V = torch.cat([kv.values for kv in kvs], dim=2)
    cache = DynamicCache([(K[i][None][:, :, keep], V[i][None][:, :, keep]) for i in range(K.shape[0])])
    new_pos = torch.arange(int(pos[-1]) + 1, int(pos[-1]) + 1 + len(new_ids))
    q_ids = torch.cat([ids[rows], torch.tensor(new_ids)])
    q_pos = torch.cat([pos[rows], new_pos])
    q_logical = torch.cat([torch.tensor(rows, dtype=torch.long), torch.arange(C, C + len(new_ids))])
    k_logical = torch.cat([torch.tensor(keep, dtype=torch.long), q_logical])
    allowed = k_logical[None, :] <= q_logical[:, None]  # (nq, nkeep + nq)
    model = copy.deepcopy(pc.model)
    model.set_attn_implementation("eager")
    from pcache_rag.models import adapter_for

    key_pos = torch.cat([pos[keep], q_pos])
    if adapter_of(pc).family == "alibi":  # (an adapter switches the copy to pcache_sdpa: only ALiBi needs one)
        ad = adapter_for(model)
        return ad.forward(q_ids, q_pos, cache, allowed, key_pos, logits_to_keep=len(new_ids))
    mask = stock_mask(model, allowed, q_pos, key_pos)
    with torch.no_grad():
        out = model(input_ids=q_ids[None], position_ids=q_pos[None], attention_mask=mask, past_key_values=cache)
    return out.logits[0, -len(new_ids):]


def test_all_equals_one_causal_forward(pc):
    parts, new = _parts(pc)
    res = pc.prefill(Parts(parts, new), recompute="all")
    C = sum(kv.length for _, kv in parts)
    assert res.recomputed_tokens == C and res.cached_tokens == 0 and res.computed_tokens == C + len(new)
    model = copy.deepcopy(pc.model)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        if adapter_of(pc).family == "alibi":
            ref = pc.core.full_prefill(res.input_ids, res.position_ids)
        else:
            ref = model(input_ids=res.input_ids[None], position_ids=res.position_ids[None]).logits[0, -1]
    assert (ref - res.logits).abs().max().item() < 1e-4


def test_none_is_the_cached_path_unchanged(pc):
    parts, new = _parts(pc)
    plain = pc.prefill(Parts(parts, new))
    none = pc.prefill(Parts(parts, new), recompute="none")
    assert torch.equal(plain.logits, none.logits) and none.recomputed_tokens == 0
    ref = _reference(pc, parts, new, [])[-1]
    assert (ref - none.logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("spec", ["epic:2", "epic:5", "blend:0.3", "blend:0.2@0", "focus:0.3", "match:1", "rows"])
def test_selected_set_equals_the_masked_reference(pc, spec):
    parts, new = _parts(pc)
    kvs = [kv for _, kv in parts]
    if spec == "rows":  # explicit rows (the eval's oracle): two of the second chunk, all of the third
        a, b = kvs[0].length, kvs[0].length + kvs[1].length
        spec = Recompute.explicit([a + 3, a + 1] + list(range(b, b + kvs[2].length)))
    policy = Recompute.parse(spec)
    new_pos = list(range(sum(kv.length for kv in kvs), sum(kv.length for kv in kvs) + len(new)))
    if policy.kind == "focus" and adapter_of(pc).family == "alibi":
        with pytest.raises(UnsupportedModelError, match="focus"):
            pc.prefill(Parts(parts, new), recompute=spec)
        return
    rows = select_rows(adapter_of(pc), pc.workspace, kvs, policy, new, new_pos, pc.prefiller.lexicon)
    if policy.kind == "match":  # the question ("Which chunk is third?") names the third chunk's words
        b = kvs[0].length + kvs[1].length
        assert rows == list(range(b, b + kvs[2].length))
    if policy.kind == "epic":
        assert rows == epic_rows([kv.length for _, kv in parts], policy.k)
    if policy.kind == "rows":
        assert rows == list(policy.rows) and rows[:2] == [kvs[0].length + 1, kvs[0].length + 3]
    first = parts[0][1].length
    assert rows and min(rows) >= first, "the first unit is never recomputed"
    res = pc.prefill(Parts(parts, new), recompute=spec)
    assert res.recomputed_tokens == len(rows) and res.computed_tokens == len(new) + len(rows)
    ref = _reference(pc, parts, new, rows)
    err = (ref[-1] - res.logits).abs().max().item()
    assert err < 1e-4, spec
    cached = pc.prefill(Parts(parts, new), recompute="none").logits
    diff = (cached - res.logits).abs().max().item()
    assert diff > 100 * max(err, 1e-7), f"{spec}: recomputing must change the logits ({diff} vs error {err})"


def test_decoding_after_recompute_reads_the_fresh_rows(pc):
    """Greedy tokens generated after a recompute equal the reference continued token by token."""
    parts, new = _parts(pc)
    out = pc.generate(Parts(parts, new), recompute="epic:3", max_new_tokens=4)
    rows = epic_rows([kv.length for _, kv in parts], 3)
    seq = list(new)
    for tok in out.token_ids:
        ref = _reference(pc, parts, seq, rows)[-1]
        assert int(torch.argmax(ref)) == tok
        seq.append(tok)
    assert out.recomputed_tokens == len(rows)
    # the workspace is not left holding recomputed rows as if they were the stored states
    again = pc.prefill(Parts(parts, new))
    assert (again.logits - pc.prefill(Parts(parts, new), recompute="none").logits).abs().max() == 0
    assert (again.logits - _reference(pc, parts, new, [])[-1]).abs().max().item() < 1e-4


def test_pml_prompts_take_the_policy(smol_tok):
    model = sharp_model("llama", len(smol_tok), seed=4)
    pc = PromptCache(model, smol_tok, recompute="epic:2", store_dtype=None)
    pc.add_schema('<schema name="s"><system>Be brief.</system><module name="a">Alpha text here.</module>'
                  '<module name="b">Bravo text follows.</module></schema>')
    p = '<prompt schema="s"><a/><b/><user>Which?</user></prompt>'
    res = pc.prefill(p)
    assert res.recomputed_tokens == 4  # two units after the preamble, two tokens each
    assert pc.prefill(p, recompute="none").recomputed_tokens == 0
    out = pc.generate(p, max_new_tokens=2, recompute="all")
    assert out.recomputed_tokens == res.cached_tokens + res.recomputed_tokens


def test_mask_redirects_selected_columns_to_their_fresh_rows():
    base = torch.ones(2, 5 + 2, dtype=torch.bool)
    base[:, 5:] = torch.ones(2, 2, dtype=torch.bool).tril()
    m = recompute_mask(base, 5, torch.tensor([1, 3]))
    assert m.shape == (4, 9)
    assert not m[:, 1].any() and not m[:, 3].any(), "stale rows are never attended"
    assert m[0].tolist() == [1, 0, 0, 0, 0, 1, 0, 0, 0]  # row 1: row 0, itself (fresh)
    assert m[1].tolist() == [1, 0, 1, 0, 0, 1, 1, 0, 0]  # row 3: rows 0, 2, fresh 1, itself
    assert m[3].tolist() == [1, 0, 1, 0, 1, 1, 1, 1, 1]


def test_bad_policies_are_refused():
    for bad in ["epic", "epic:0", "blend:0", "blend:1.5", "focus", "focus:0", "focus:2", "sometimes", "all:3",
                "match", "match:0", "match:0.5"]:
        with pytest.raises(ValueError, match="recompute must be"):
            Recompute.parse(bad)
    assert str(Recompute.parse("blend:0.15@3")) == "blend:0.15@3" and str(Recompute.parse(" EPIC:8 ")) == "epic:8"
    assert str(Recompute.parse("focus:0.1")) == "focus:0.1" and str(Recompute.parse("MATCH:2")) == "match:2"
    assert str(Recompute.explicit([5, 3, 5])) == "rows(2)" and Recompute.explicit([5, 3, 5]).rows == (3, 5)
    with pytest.raises(ValueError, match=">= 0"):
        Recompute.explicit([-1])


def test_explicit_rows_outside_the_prompt_are_refused(smol_tok):
    pc = PromptCache(sharp_model("llama", len(smol_tok), seed=3), smol_tok, encoding="isolated", store_dtype=None)
    parts, new = _parts(pc)
    first, C = parts[0][1].length, sum(kv.length for _, kv in parts)
    for bad in ([0], [C]):  # the first unit's rows are exact already; C is past the context
        with pytest.raises(ValueError, match="outside the rows after the first unit"):
            pc.prefill(Parts(parts, new), recompute=Recompute.explicit(bad + [first]))
    with pytest.raises(ValueError, match="outside the rows after the first unit"):  # one unit: not dropped
        pc.prefill(Parts(parts[:1], new), recompute=Recompute.explicit([1]))


def test_focus_ranks_by_the_questions_attention(smol_tok):
    """``focus`` scores equal the attention the question gives each context row in an eager
    forward (summed over layers and heads), and the window carries a peak to its neighbours."""
    model = sharp_model("llama", len(smol_tok), seed=3)
    pc = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None)
    parts, new = _parts(pc)
    kvs = [kv for _, kv in parts]
    C = sum(kv.length for kv in kvs)
    got = question_attention(adapter_of(pc), pc.workspace, kvs, new, list(range(C, C + len(new))))
    # reference: eager attention weights over a past of the same cached rows
    K = torch.cat([kv.keys for kv in kvs], dim=2)
    V = torch.cat([kv.values for kv in kvs], dim=2)
    cache = DynamicCache([(K[i][None], V[i][None]) for i in range(K.shape[0])])
    ref_model = copy.deepcopy(model)
    ref_model.set_attn_implementation("eager")
    allowed = torch.ones(len(new), C + len(new), dtype=torch.bool)
    allowed[:, C:] = torch.ones(len(new), len(new), dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, *allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        out = ref_model(input_ids=torch.tensor(new)[None], position_ids=torch.arange(C, C + len(new))[None],
                        attention_mask=mask, past_key_values=cache, output_attentions=True)
    ref = sum(a[0, :, :, :C].sum(dim=(0, 1)) for a in out.attentions)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    spike = torch.zeros(20)
    spike[10] = 1.0
    assert focus_scores(spike, window=2).nonzero().flatten().tolist() == [8, 9, 10, 11, 12]


def test_batched_decoding_equals_one_at_a_time(smol_tok):
    """``generate_batch``: the same tokens, text and counts as ``generate`` for
    each request (several policies, plus a full prefill of another length)."""
    model = sharp_model("llama", len(smol_tok), seed=5)
    pc = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None)
    parts, new = _parts(pc)
    full = [i for _, kv in parts for i in kv.token_ids.tolist()] + new
    reqs = [(parts, new, rc) for rc in ("none", "epic:2", "focus:0.3", "all")] + [([], full[3:], None)]
    batch = pc.generate_batch([Parts(p, ids) for p, ids, _ in reqs], [rc for *_, rc in reqs], max_new_tokens=6)
    for (p, ids, rc), got in zip(reqs, batch):
        one = pc.generate(Parts(p, ids), recompute=rc, max_new_tokens=6)
        assert got.token_ids == one.token_ids and got.text == one.text, rc
        assert (got.cached_tokens, got.computed_tokens, got.recomputed_tokens) == (
            one.cached_tokens, one.computed_tokens, one.recomputed_tokens)
        assert got.finish_reason == one.finish_reason and 0 < got.ttft_s <= got.total_s
    assert len({tuple(b.token_ids) for b in batch}) > 1, "the prompts must not all agree, or the check is weak"


@pytest.mark.parametrize("max_runs,block,one_call", [(8, 48, 1 << 20), (8, 48, 0), (0, 48, 1 << 20), (0, 3, 1 << 20)])
@pytest.mark.parametrize("spec", ["epic:2", "blend:0.3", "focus:0.3", "match:1", "all", "rows"])
def test_split_path_equals_the_masked_path(pc, spec, max_runs, block, one_call, monkeypatch):
    """Recomputed rows on the split path (no dense mask: pcache_sdpa reads the rows) give the
    logits of the dense-mask path they replace, to 1e-5, and the same decoded tokens; both
    for runs of consecutive rows (max_runs=8) and as a scattered selection (0), in one block
    of rows or in blocks of 3 (each over the keys before it unmasked, and its own span masked);
    a run and the new tokens each in one call through a small mask (the default), or in
    unmasked calls merged by log-sum-exp (ONE_CALL_MASK = 0)."""
    import pcache_rag.models.attention as attention

    monkeypatch.setattr(attention, "MAX_RUNS", max_runs)
    monkeypatch.setattr(attention, "SCATTERED_BLOCK", block)
    monkeypatch.setattr(attention, "ONE_CALL_MASK", one_call)

    parts, new = _parts(pc)
    kvs = [kv for _, kv in parts]
    if spec == "rows":
        a = kvs[0].length
        spec = Recompute.explicit([a + 1, a + 4] + list(range(a + kvs[1].length, a + kvs[1].length + 3)))
    if adapter_of(pc).family == "alibi" and str(spec).startswith("focus"):
        return  # refused by name for ALiBi (test_selected_set_equals_the_masked_reference)
    calls = []
    real = attention.recompute_attention
    monkeypatch.setattr(attention, "recompute_attention", lambda *a: calls.append(1) or real(*a))
    split = pc.prefill(Parts(parts, new), recompute=spec)
    if adapter_of(pc).family == "alibi" or adapter_of(pc).constrained:  # ALiBi's bias comes with its mask, and
        # windows and soft-capping are applied to the dense mask: the dense path stays
        assert not calls and split.recomputed_tokens > 0
        return
    split_tokens = pc.generate(Parts(parts, new), recompute=spec, max_new_tokens=4).token_ids
    assert calls, "the split path ran"
    monkeypatch.setattr(pc.prefiller, "split_recompute", False)  # the dense-mask path
    calls.clear()
    masked = pc.prefill(Parts(parts, new), recompute=spec)
    assert not calls and masked.recomputed_tokens == split.recomputed_tokens > 0
    assert (split.logits - masked.logits).abs().max().item() < 1e-5
    assert pc.generate(Parts(parts, new), recompute=spec, max_new_tokens=4).token_ids == split_tokens


def test_lexicon_cuts_sentences_and_lines_on_token_boundaries(smol_tok):
    """``match``'s pieces: cut after a newline and after a sentence's end before a space (not
    inside ``os.path`` or before a newline's own token), long ones into pieces of at most
    MATCH_MAX_TOKENS; each piece's words are stemmed with stopwords dropped."""
    lx = Lexicon(smol_tok)
    text = ("Dr Smith works for Acme Corp. He likes tea!\nos.path.join(x) is code\n"
            + "word " * (MATCH_MAX_TOKENS + 10) + "end.")
    ids = smol_tok(text)["input_ids"]
    segs = lx.segments(ids)
    assert segs[0][0] == 0 and segs[-1][1] == len(ids)
    assert all(a[1] == b[0] for a, b in zip(segs, segs[1:])), "the pieces tile the unit"
    texts = [smol_tok.decode(ids[s:e]) for s, e, _ in segs]
    assert texts[:3] == ["Dr Smith works for Acme Corp.", " He likes tea!\n", "os.path.join(x) is code\n"]
    assert segs[0][2] == frozenset({"dr", "smith", "work", "acm", "corp"})
    assert max(e - s for s, e, _ in segs) == MATCH_MAX_TOKENS and len(segs) == 5
    assert lx.segments(torch.tensor(ids)) is segs, "a unit's pieces are kept, whichever form its ids take"


def _sentences(tok, texts: list[str], question: str):
    """An engine, the contiguous parts of ``texts`` with ``question``, their states, and each
    cut sentence's text (after the first unit) -> its (first, end) rows in the assembled context."""
    pc = PromptCache(sharp_model("llama", len(tok), seed=3), tok, encoding="isolated", store_dtype=None)
    parts, new = contiguous_parts(pc, texts, question)
    kvs = [kv for _, kv in parts]
    seg = {tok.decode(kv.token_ids[s:e].tolist()).strip(): (sum(k.length for k in kvs[:i]) + s,
                                                            sum(k.length for k in kvs[:i]) + e)
           for i, kv in enumerate(kvs) if i for s, e, _ in pc.prefiller.lexicon.segments(kv.token_ids)}
    return pc, parts, new, kvs, seg


#: units stating one fact of the same shape about two places, one unit sharing nothing, and the question
LOOK_ALIKES = (["You answer questions.",
                "Tea is hot. The last ferry from Penwick leaves at 09:05. Time is short.",
                "Maps are old. The last ferry from Ashford leaves at 17:30. Snow is cold.",
                "Nothing here is shared at all."], " At what time does the last ferry from Ashford leave?")


def test_each_reads_every_units_look_alike_sentence_in_context(smol_tok):
    """``each:1`` takes, in every unit after the first, its sentence sharing the most words with
    the question: the asked sentence and its look-alikes about other places; a unit sharing no
    word gives nothing; it parses, prints and recomputes exactly those rows; ``each:1@2`` starts a
    unit later."""
    pc, parts, new, kvs, seg = _sentences(smol_tok, *LOOK_ALIKES)
    twin, asked = seg["The last ferry from Penwick leaves at 09:05."], seg["The last ferry from Ashford leaves at 17:30."]
    assert each_rows(pc.prefiller.lexicon, kvs, new, 1) == list(range(*twin)) + list(range(*asked))
    assert match_rows(pc.prefiller.lexicon, kvs, new, 1) == list(range(*asked)), "match:1 reads the asked one alone"
    assert each_rows(pc.prefiller.lexicon, kvs, new, 2) == list(range(*twin)) + list(range(*seg["Time is short."])) \
        + list(range(*asked)), "each:2 adds a unit's next sentence that shares a word (time), in cache order"
    assert str(Recompute.parse("each:2")) == "each:2"
    with pytest.raises(ValueError, match="each:N"):
        Recompute.parse("each:0")
    res = pc.prefill(Parts(parts, new), recompute="each:1")
    assert res.recomputed_tokens == (twin[1] - twin[0]) + (asked[1] - asked[0])
    # each:1@2: from the second unit after the first on (the unit after the preamble keeps its cached states)
    assert each_rows(pc.prefiller.lexicon, kvs, new, 1, first=2) == list(range(*asked))
    assert str(Recompute.parse("each:1@2")) == "each:1@2" and Recompute.parse("alike:1@3").first_unit == 3
    with pytest.raises(ValueError, match="from unit U"):
        Recompute.parse("each:1@0")
    assert pc.prefill(Parts(parts, new), recompute="each:1@2").recomputed_tokens == asked[1] - asked[0]


def test_alike_reads_the_look_alikes_and_not_a_line_sharing_one_word(smol_tok):
    """``alike:1`` is ``each:1`` less the sentences that share fewer than half as many of the
    question's words as the best one: a unit whose best line shares only "time" with a question
    whose own sentence shares four gives nothing. Where the best shares two words or fewer, it is
    ``each``. It parses, prints and recomputes exactly those rows."""
    texts = LOOK_ALIKES[0][:3] + ["Maps are old. Time flies when tea is hot."]
    pc, parts, new, kvs, seg = _sentences(smol_tok, texts, LOOK_ALIKES[1])
    lx = pc.prefiller.lexicon
    twin = list(range(*seg["The last ferry from Penwick leaves at 09:05."]))
    asked = list(range(*seg["The last ferry from Ashford leaves at 17:30."]))
    filler = list(range(*seg["Time flies when tea is hot."]))
    assert each_rows(lx, kvs, new, 1) == twin + asked + filler, "each:1 reads the line sharing 'time'"
    assert each_rows(lx, kvs, new, 1, alike=True) == twin + asked
    assert each_rows(lx, kvs, new, 2, alike=True) == twin + asked, "'Time is short.' shares one word of five"
    assert str(Recompute.parse("alike:2")) == "alike:2"
    with pytest.raises(ValueError, match="alike:N"):
        Recompute.parse("alike:0")
    res = pc.prefill(Parts(parts, new), recompute="alike:1")
    assert res.recomputed_tokens == len(twin) + len(asked)
    pc, parts, new, kvs, seg = _sentences(smol_tok, texts, " Is the time short?")  # best: 'Time is short.', two words
    assert each_rows(pc.prefiller.lexicon, kvs, new, 1, alike=True) == each_rows(pc.prefiller.lexicon, kvs, new, 1) \
        == list(range(*seg["Time is short."])) + list(range(*seg["Time flies when tea is hot."]))


def test_contrast_reads_the_asked_sentence_and_what_sets_its_look_alikes_apart(smol_tok):
    """``contrast:1``: match:1's sentence whole, and in every other unit only the tokens of its
    look-alike sentence that the question does not name (the other place, its time); it parses,
    prints and recomputes exactly those rows."""
    pc, parts, new, kvs, seg = _sentences(smol_tok, *LOOK_ALIKES)
    twin, asked = seg["The last ferry from Penwick leaves at 09:05."], seg["The last ferry from Ashford leaves at 17:30."]
    rows = contrast_rows(pc.prefiller.lexicon, kvs, new, 1)
    ids = torch.cat([kv.token_ids for kv in kvs])
    picked = smol_tok.decode(ids[[r for r in rows if twin[0] <= r < twin[1]]].tolist())
    assert set(range(*asked)) <= set(rows) and set(rows) <= set(range(*twin)) | set(range(*asked))
    assert "Penwick" in picked.replace(" ", "") and "09" in picked and "ferry" not in picked, picked
    assert str(Recompute.parse("contrast:1")) == "contrast:1"
    res = pc.prefill(Parts(parts, new), recompute="contrast:1")
    assert res.recomputed_tokens == len(rows) < (twin[1] - twin[0]) + (asked[1] - asked[0])


def test_match_chains_to_the_sentence_the_first_one_names(smol_tok):
    """``match:2`` takes the sentence richest in the question's words, then the one that shares
    most with the question and that sentence (the second hop); a question sharing no word
    recomputes nothing, and ``match`` without new tokens or a lexicon is refused by name."""
    pc, parts, new, kvs, seg = _sentences(smol_tok, [
        "You answer questions.", "Weather is mild. Mira Holt works for Zentrix Labs. Tea is hot.",
        "Zentrix Labs is based in Oslo. Brightway is based in Lima. Mira Holt likes rain."],
        " Where is the company that Mira Holt works for based?")
    first, hop = seg["Mira Holt works for Zentrix Labs."], seg["Zentrix Labs is based in Oslo."]
    assert match_rows(pc.prefiller.lexicon, kvs, new, 1) == list(range(*first))
    assert match_rows(pc.prefiller.lexicon, kvs, new, 2) == list(range(*first)) + list(range(*hop))
    res = pc.prefill(Parts(parts, new), recompute="match:2")
    assert res.recomputed_tokens == (first[1] - first[0]) + (hop[1] - hop[0])
    assert pc.prefill(Parts(parts, pc.safe.text(" Unrelated?")), recompute="match:3").recomputed_tokens == 0
    with pytest.raises(ValueError, match="match"):
        select_rows(adapter_of(pc), pc.workspace, kvs, Recompute.parse("match:1"), new, [], None)
    with pytest.raises(ValueError, match="new tokens"):
        select_rows(adapter_of(pc), pc.workspace, kvs, Recompute.parse("match:1"), [], [], pc.prefiller.lexicon)
