"""A conversation's turns read in their context (pcache_rag/docmodules/turns.py): a turn's states
equal a full forward's over the same tokens (to the store's fp16), are learned under a key of
their context (another context is another key), and a new prefix after a learned system message
reads that message and computes only the rest."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.real_model

SYSTEM = "<|im_start|>system\nYou are a helpful assistant who answers questions about the site.<|im_end|>\n"
TURN = "<|im_start|>user\nHow many guards are there at the north gate today?<|im_end|>\n"


@pytest.fixture()
def asm(smol):
    from pcache_rag.docmodules import Assembler

    return Assembler(smol)


def _full_keys(pc, ids: list[int]) -> list[torch.Tensor]:
    """Each layer's keys of a plain causal forward of ``ids`` (H, T, D)."""
    with torch.no_grad():
        out = pc.model(torch.tensor([ids]), use_cache=True)
    return [layer.keys[0] for layer in out.past_key_values.layers]


def test_a_turn_is_read_as_a_full_forward_reads_it(asm, smol):
    from pcache_rag.docmodules.turns import turn_key, turn_states

    tok = smol.tokenizer
    head, turn = tok(SYSTEM)["input_ids"], tok(TURN)["input_ids"]
    head_kv = asm.encoder.encode(head, list(range(len(head))))
    key = turn_key(asm.fingerprint, turn, len(head), ["head"])
    kv, new = turn_states(asm, turn, len(head), [("prefix", head_kv)], key, "t")
    assert new and kv.position_ids.tolist() == list(range(len(head), len(head) + len(turn)))
    full = _full_keys(smol, head + turn)
    for layer in range(len(full)):
        ref = full[layer][:, len(head):]
        assert torch.allclose(kv.keys[layer].float(), ref, rtol=0, atol=2e-2 * ref.abs().max().item() / 10), layer
    again, new = turn_states(asm, turn, len(head), [("prefix", head_kv)], key, "t")
    assert not new and again is kv, "the next step reads it"
    # another context, or another tenant, is another key: never the states computed after other parts
    assert turn_key(asm.fingerprint, turn, len(head), ["other head"]) != key
    assert asm.learned.get("someone else", key) is None


def test_a_new_prefix_after_a_learned_system_message_computes_only_the_rest(asm, smol):
    from pcache_rag.docmodules.turns import extend_prefix
    from pcache_rag.store import unit_key

    tok = smol.tokenizer
    head, turn = tok(SYSTEM)["input_ids"], tok(TURN)["input_ids"]
    prefix = head + turn
    key = unit_key(asm.fingerprint, prefix, range(len(prefix)), None, "prefix")
    assert extend_prefix(asm, head, prefix, key, "t2") is None, "nothing learned yet: the whole prefix is computed"
    head_key = unit_key(asm.fingerprint, head, range(len(head)), None, "prefix")
    asm.learned.put("t2", head_key, asm.encoder.encode(head, list(range(len(head)))).to(dtype=asm.store_dtype))
    before = asm.encoder.counts["tokens"]
    kv = extend_prefix(asm, head, prefix, key, "t2")
    assert kv is not None and kv.length == len(prefix)
    assert asm.encoder.counts["tokens"] - before == len(turn), "only the turn is computed"
    assert asm.learned.get("t2", key) is kv, "the whole prefix is learned for the next prompt"
    full = _full_keys(smol, prefix)
    for layer in (0, len(full) - 1):
        ref = full[layer]
        assert torch.allclose(kv.keys[layer].float(), ref, rtol=0, atol=2e-2 * ref.abs().max().item() / 10), layer
