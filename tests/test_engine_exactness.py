"""Cached prefill equals one full forward of the stock model with the pml.md mask (float32, 1e-4),
for every positional-encoding family and both encodings."""

import copy

import pytest
import torch

from helpers import WINDOWED, adapter_of, reference_logits, tiny_model
from pcache_rag import PMLError, PromptCache
from pcache_rag.models import UnsupportedModelError, adapter_for

FAMILIES = ["llama", "qwen2", "mistral", "gpt2", "bloom", "mpt"] + WINDOWED
SCHEMA = """<schema name="s">
  <system>You are a helpful assistant.</system>
  <module name="a">Alpha document with several words in it.</module>
  <module name="skip">This module is usually skipped, leaving a gap.</module>
  <union>
    <module name="b">Bravo text.</module>
    <module name="c">Charlie is the longer member of the union here.</module>
  </union>
  <module name="plan">Plan a trip lasting <param name="days" len="5"/> with a small budget.</module>
  <scaffold name="pair">
    <module name="p1">Ada Ferrell is a structural engineer.</module>
    <module name="p2">The bridge collapse of 1931 surprised everyone.</module>
  </scaffold>
</schema>"""

CASES = {
    "two_modules": '<prompt schema="s"><a/><skip/><user>What is alpha?</user></prompt>',
    "gap": '<prompt schema="s"><a/><c/><user>Compare them.</user></prompt>',
    "union_member": '<prompt schema="s"><b/><user>Bravo?</user></prompt>',
    "param": '<prompt schema="s"><a/><plan days="three days"/><user>Plan it.</user></prompt>',
    "scaffold": '<prompt schema="s"><pair/><user>Who and what?</user></prompt>',
    "scaffold_by_members": '<prompt schema="s"><p1/><p2/><user>Who?</user></prompt>',
    "scaffold_partial": '<prompt schema="s"><p2/><user>When?</user></prompt>',
}


@pytest.fixture(scope="module")
def tok(smol_tok):
    return smol_tok


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tok):
    return request.param, tiny_model(request.param, len(tok))


@pytest.mark.parametrize("encoding", ["isolated", "preamble"])
def test_cached_prefill_equals_full_forward_with_mask(family_model, tok, encoding):
    fam, model = family_model
    pc = PromptCache(model, tok, encoding=encoding, store_dtype=None)
    pc.add_schema(SCHEMA)
    for name, prompt in CASES.items():
        res = pc.prefill(prompt)
        ref = reference_logits(pc, res, encoding)
        err = (ref - res.logits).abs().max().item()
        assert err < 1e-4, f"{fam}/{encoding}/{name}: max abs error {err}"
        assert res.cached_tokens + res.computed_tokens == res.input_ids.shape[0]
        assert [s[0] for s in res.spans][-1] == "uncached"
    # the param case computed exactly the argument and the new text
    res = pc.prefill(CASES["param"])
    arg = [s for s in res.spans if s[0] == "plan.days"][0]
    assert res.computed_tokens == (arg[2] - arg[1]) + (res.spans[-1][2] - res.spans[-1][1])
    assert res.position_ids[arg[1]].item() == pc.schema("s").units["plan"].params[0].start


def test_single_module_prefix_equals_plain_forward(family_model, tok):
    """With one module as the whole prefix the cached path is ordinary prefix caching."""
    fam, model = family_model
    pc = PromptCache(model, tok, encoding="isolated", store_dtype=None)
    # longer than the windowed families' window (16), so their windows bite
    pc.add_schema('<schema name="one"><module name="doc">A single document as the prefix of the prompt, long '
                  'enough that a sliding window of sixteen positions leaves its first words behind.</module></schema>')
    res = pc.prefill('<prompt schema="one"><doc/>And a question about it?</prompt>')
    ref_model = copy.deepcopy(model)
    ref_model.set_attn_implementation("eager")
    with torch.no_grad():
        plain = ref_model(input_ids=res.input_ids[None]).logits[0, -1]
    assert torch.equal(res.position_ids, torch.arange(res.input_ids.shape[0]))
    assert res.input_ids.shape[0] > 16 + 8
    assert (plain - res.logits).abs().max().item() < 1e-4


def test_repeated_prompts_are_identical_and_states_untouched(tok):
    model = tiny_model("llama", len(tok))
    pc = PromptCache(model, tok, store_dtype=None)
    pc.add_schema(SCHEMA)
    st = pc.store.get(pc.schemas.unit_key("s", "a"))
    before = st.keys.clone()
    first = pc.generate(CASES["gap"], max_new_tokens=6)
    pc.prefill(CASES["param"])  # a different prompt in between changes the buffers
    second = pc.generate(CASES["gap"], max_new_tokens=6)
    assert first.token_ids == second.token_ids
    assert torch.equal(before, st.keys)
    r1, r2 = pc.prefill(CASES["two_modules"]), pc.prefill(CASES["two_modules"])
    assert torch.equal(r1.logits, r2.logits)
    assert r2.copied_tokens == 0, "the same units stay resident in the workspace"


@pytest.mark.parametrize("fam", ["bloom", "mpt"])
def test_alibi_override_matches_stock_on_contiguous_positions(fam, tok):
    """The position-id bias equals the stock bias when there are no gaps."""
    model = tiny_model(fam, len(tok))
    ids = torch.tensor(tok("A sentence of a few words for the check.")["input_ids"])
    with torch.no_grad():
        stock = model(input_ids=ids[None]).logits[0, -1]
        ad = adapter_for(model)
        from transformers.cache_utils import DynamicCache

        ours = ad.forward(ids, torch.arange(len(ids)), DynamicCache(), None, None)[-1]
        after = model(input_ids=ids[None]).logits[0, -1]
    assert (stock - ours).abs().max().item() < 1e-4
    assert torch.equal(stock, after), "outside an adapter call the hooks change nothing"


@pytest.mark.parametrize("fam", ["bloom", "mpt"])
def test_a_stock_forward_in_another_thread_during_an_alibi_forward_is_stock(fam, tok):
    """The adapter's bias and mask are its own forward's, by thread: a stock forward of the same
    model that runs in another thread while an adapter forward is between its blocks (here: run
    from the adapter's first block, in a second thread) computes stock logits, and the adapter's
    own forward still reads the gapped positions it was given."""
    import threading

    from transformers.cache_utils import DynamicCache

    model = tiny_model(fam, len(tok))
    ids = torch.tensor(tok("A sentence of a few words for the check.")["input_ids"])
    gapped = torch.cat([torch.arange(4), torch.arange(4, len(ids)) + 9])  # a gap: not stock's positions
    ad = adapter_for(model)
    with torch.no_grad():
        stock = model(input_ids=ids[None]).logits[0, -1]
        alone = ad.forward(ids, gapped, DynamicCache(), None, gapped)[-1]
    seen: list[torch.Tensor] = []
    started = threading.Event()

    def beside(module, args, kwargs):
        if not started.is_set():  # once, while the adapter's forward is in its first block
            started.set()
            t = threading.Thread(target=lambda: seen.append(model(input_ids=ids[None]).logits[0, -1].detach()))
            t.start()
            t.join(60)
        return None

    h = ad.blocks[0].register_forward_pre_hook(beside, with_kwargs=True)
    try:
        with torch.no_grad():
            during = ad.forward(ids, gapped, DynamicCache(), None, gapped)[-1]
    finally:
        h.remove()
    assert torch.equal(seen[0], stock), "the other thread's forward is stock"
    assert torch.equal(during, alone) and (alone - stock).abs().max() > 1e-4, "the gap is read, by its own thread"


def test_rope_rerotation_is_exact(tok):
    model = tiny_model("llama", len(tok))
    pc = PromptCache(model, tok, store_dtype=None)
    err = adapter_of(pc).self_check()
    assert err < 1e-5
    ids = tok("Move these keys to another place.")["input_ids"]
    a = pc.encoder.encode(ids, list(range(len(ids))))
    b = pc.encoder.encode(ids, list(range(300, 300 + len(ids))))
    moved = adapter_of(pc).rerotate(a.keys, 300)
    assert (moved - b.keys).abs().max().item() < 1e-4
    assert torch.equal(a.values, b.values) or (a.values - b.values).abs().max().item() < 1e-5


def test_length_dependent_rope_is_refused_for_rerotation(tok):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    pc = PromptCache(tf.LlamaForCausalLM(cfg).eval(), tok)
    assert not adapter_of(pc).rerotatable
    with pytest.raises(UnsupportedModelError, match="re-rotated"):
        adapter_of(pc).rerotate(torch.zeros(1, 2, 3, 16), 4)


def test_unserved_attention_and_unknown_families_are_refused(tok):
    import transformers as tf

    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    cfg = tf.Gemma3TextConfig(use_bidirectional_attention=True, **common)
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        PromptCache(tf.Gemma3ForCausalLM(cfg).eval(), tok)
    cfg = tf.Gemma3TextConfig(**common)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    model.config.layer_types = ["sliding_attention", "linear_attention"]
    with pytest.raises(UnsupportedModelError, match="linear_attention"):
        adapter_for(model)

    class Weird(torch.nn.Module):
        config = tf.PretrainedConfig()

    with pytest.raises(UnsupportedModelError, match="supports rotary"):
        adapter_for(Weird())


def test_prompt_without_new_text_and_unknown_schema(tok):
    pc = PromptCache(tiny_model("llama", len(tok)), tok)
    pc.add_schema(SCHEMA)
    with pytest.raises(PMLError, match="adds no new text"):
        pc.prefill('<prompt schema="s"><a/></prompt>')
    with pytest.raises(PMLError, match="unknown schema 'nope'"):
        pc.prefill('<prompt schema="nope"><a/>q</prompt>')


def test_startup_self_check_disables_a_broken_rotation(tok, monkeypatch):
    from pcache_rag.models import rope

    pc = PromptCache(tiny_model("llama", len(tok)), tok)
    assert adapter_of(pc).rerotatable, "a healthy model passes the start-up check"
    monkeypatch.setattr(rope, "rerotate", lambda keys, delta, inv_freq, out_dtype=None: keys)  # a wrong rotation
    bad = PromptCache(tiny_model("llama", len(tok)), tok)
    assert not adapter_of(bad).rerotatable
    with pytest.raises(UnsupportedModelError):
        bad.encoder.place(bad.encoder.encode([5, 6, 7], [0, 1, 2]), 10)
