"""Sliding-window layers, per-layer RoPE and soft-capped attention (issue 24), on tiny random
Gemma 2, Gemma 3, Mistral and Qwen2 configs whose windows (16 positions) are smaller than
every prompt here. Prefill exactness for schemas and recompute runs over these families in
test_engine_exactness.py and test_recompute.py; this file covers what is particular to them:
re-rotation with each layer's own RoPE, greedy decoding past the window against a stock
forward, the blocked attention path, and what is refused by name. Batched decoding of Gemma 3
runs with the other families in test_batching.py."""

import copy

import pytest
import torch

from helpers import WINDOW, WINDOWED, adapter_of, contiguous_parts, stock_mask, tiny_model
from pcache_rag import PromptCache
from pcache_rag.models import UnsupportedModelError
from pcache_rag.engine import Parts

TEXTS = ["Alpha document with several words in it and more of them.",
         "Bravo text that follows the alpha one here, a little longer.",
         "Charlie is the third chunk of context in this prompt."]


@pytest.fixture(scope="module", params=WINDOWED)
def pc(request, smol_tok):
    return PromptCache(tiny_model(request.param, len(smol_tok), seed=5), smol_tok, store_dtype=None)


def _stock_greedy(pc, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, n: int) -> list[int]:
    """``n`` greedy tokens from stock eager forwards of the whole sequence (no cache): the prompt
    attends as ``allowed`` says, every generated token to everything before it, windows applied
    over the positions on local layers."""
    model = copy.deepcopy(pc.model)
    model.set_attn_implementation("eager")
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(input_ids=ids[None], position_ids=pos[None],
                           attention_mask=stock_mask(model, allowed, pos, pos)).logits[0, -1]
        t = int(logits.argmax())
        out.append(t)
        ids = torch.cat([ids, torch.tensor([t])])
        pos = torch.cat([pos, pos[-1:] + 1])
        T = ids.shape[0]
        grown = torch.zeros(T, T, dtype=torch.bool)
        grown[:-1, :-1] = allowed
        grown[-1] = True
        allowed = grown
    return out


def test_greedy_decoding_past_the_window_matches_the_stock_model(pc):
    parts, new = contiguous_parts(pc, TEXTS)
    n = 2 * WINDOW  # decode well past the window, so the earliest keys leave it
    got = pc.generate(Parts(parts, new), max_new_tokens=n, stop=[]).token_ids
    kvs = [kv for _, kv in parts]
    C = sum(kv.length for kv in kvs)
    assert C + len(new) > WINDOW
    ids = torch.cat([kv.token_ids for kv in kvs] + [torch.tensor(new)])
    pos = torch.cat([kv.position_ids for kv in kvs] + [torch.arange(C, C + len(new))])
    T = ids.shape[0]
    allowed = torch.zeros(T, T, dtype=torch.bool)
    a = 0
    for kv in kvs:  # each chunk was encoded alone: causal inside itself
        allowed[a:a + kv.length, a:a + kv.length] = torch.ones(kv.length, kv.length, dtype=torch.bool).tril()
        a += kv.length
    allowed[C:, :C] = True
    allowed[C:, C:] = torch.ones(T - C, T - C, dtype=torch.bool).tril()
    ref = _stock_greedy(pc, ids, pos, allowed, len(got))
    assert got == ref, pc.model.config.model_type
    assert len(got) > 4 and T + len(got) > 2 * WINDOW, "decoding must run well past the window"


def test_the_callers_model_still_runs_its_own_stock_forward(pc):
    """The engine switches the model's attention to pcache_sdpa; a plain forward of that model
    afterwards, with no engine in the call, still runs past the window (transformers' own mask
    carries it) and equals the stock eager model's."""
    ids = torch.arange(5, 5 + 3 * WINDOW)[None]
    ref_model = copy.deepcopy(pc.model)
    ref_model.set_attn_implementation("eager")
    with torch.no_grad():
        got, ref = pc.model(input_ids=ids).logits, ref_model(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_each_layer_is_rerotated_with_its_own_rope(smol_tok):
    pc = PromptCache(tiny_model("gemma3", len(smol_tok)), smol_tok, store_dtype=None)
    ad = adapter_of(pc)
    assert ad.rerotatable and not ad.shared_rope
    local, glob = ad.layer_inv_freq  # layer 0 is local (base 10,000), layer 1 global (1,000,000)
    assert not torch.allclose(local, glob)
    assert ad.self_check() < 1e-4
    ids = smol_tok("Move these keys to another place, every layer with its own frequencies, and the text "
                   "longer than the window.")["input_ids"]
    a = pc.encoder.encode(ids, list(range(len(ids))))
    b = pc.encoder.encode(ids, list(range(300, 300 + len(ids))))
    assert len(ids) > WINDOW
    moved = ad.rerotate(a.keys, 300)  # (L, H, T, D)
    assert (moved - b.keys).abs().max().item() < 1e-4
    assert (a.values - b.values).abs().max().item() < 1e-4
    from pcache_rag.models.rope import rerotate

    wrong = rerotate(a.keys[1], 300, local)  # the global layer moved with the local table
    assert (wrong - b.keys[1]).abs().max().item() > 1e-2, "a single table would rotate it wrongly"


def test_long_prompts_attend_in_blocks_exactly(pc, monkeypatch):
    """The blocked path (blocks of query rows over the keys they can see) equals the stock
    forward's own sliding-window mask, for a prompt many blocks long."""
    import pcache_rag.models.attention as attention

    monkeypatch.setattr(attention, "BLOCK", 8)
    ids = torch.tensor(pc.tokenizer(" ".join(TEXTS * 2))["input_ids"])
    assert ids.shape[0] > 4 * 8 and ids.shape[0] > 2 * WINDOW
    got = pc.core.full_prefill(ids, torch.arange(ids.shape[0]))
    model = copy.deepcopy(pc.model)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(input_ids=ids[None]).logits[0, -1]  # transformers' own window mask
    assert (got - ref).abs().max().item() < 1e-4


def test_windows_are_counted_over_positions_not_rows(pc):
    """A unit moved far past the others: the new tokens see none of the earlier units' keys on
    local layers, although every row is in the cache."""
    parts, new = contiguous_parts(pc, TEXTS[:2])
    far = pc.encoder.place(parts[1][1], 500)  # positions 500.. : the first unit is > WINDOW behind
    res = pc.prefill(Parts([parts[0], ("far", far)], new))
    C = parts[0][1].length + far.length
    ids = torch.cat([parts[0][1].token_ids, far.token_ids, torch.tensor(new)])
    pos = torch.cat([parts[0][1].position_ids, far.position_ids,
                     torch.arange(int(far.position_ids[-1]) + 1, int(far.position_ids[-1]) + 1 + len(new))])
    T = ids.shape[0]
    allowed = torch.zeros(T, T, dtype=torch.bool)
    n0 = parts[0][1].length
    allowed[:n0, :n0] = torch.ones(n0, n0, dtype=torch.bool).tril()
    allowed[n0:C, n0:C] = torch.ones(C - n0, C - n0, dtype=torch.bool).tril()
    allowed[C:, :C] = True
    allowed[C:, C:] = torch.ones(T - C, T - C, dtype=torch.bool).tril()
    model = copy.deepcopy(pc.model)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(input_ids=ids[None], position_ids=pos[None],
                    attention_mask=stock_mask(model, allowed, pos, pos)).logits[0, -1]
    assert (ref - res.logits).abs().max().item() < 1e-4


def test_what_windows_cannot_serve_is_refused_by_name(pc):
    parts, new = contiguous_parts(pc, TEXTS)
    why = adapter_of(pc).constrained
    assert why and ("sliding-window" in why or "soft-capped" in why)
    with pytest.raises(UnsupportedModelError, match="calibrated attention"):
        pc.prefill(Parts(parts, new, calibration="ape:0.9:0.9"))
    assert pc.batch_refusal == "", "windowed models batch: each sequence counts its window over its own rows"


def test_a_forwards_record_reaches_its_own_attention_and_no_other_thread():
    """A probe given to one forward (its ``Forward`` record) counts that forward's layers; stock
    forwards of the same model running at the same time in another thread are not probed and
    give the stock logits."""
    import threading

    from pcache_rag.models import attention
    from pcache_rag.models.base import use_fast_attention

    model = tiny_model("llama", 97)
    ids = torch.arange(1, 17)[None]
    with torch.no_grad():
        stock = model(input_ids=ids).logits
        assert use_fast_attention(model)
        others, stop = [], threading.Event()

        def stock_forwards():
            while not stop.is_set():
                others.append(torch.equal(model(input_ids=ids).logits, stock))

        t = threading.Thread(target=stock_forwards)
        t.start()
        try:
            probes = [attention.AttentionProbe(8) for _ in range(20)]
            for p in probes:
                model(input_ids=ids, **{attention.FORWARD: attention.Forward(probe=p)})
        finally:
            stop.set()
            t.join()
    assert [p.calls for p in probes] == [model.config.num_hidden_layers] * 20
    assert others and all(others)
