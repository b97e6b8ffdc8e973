"""The split attention path and calibrated attention (APE), on random tensors and tiny models.

* the split path (earlier keys unmasked, the new block causally, merged by log-sum-exp)
  equals one masked softmax over the same keys, with grouped heads, on the flash kernel
  and on the math path used off the CPU;
* a calibrated range equals APE's formula written out on explicit logits;
* on tiny Llama and Qwen2 models, a calibrated prefill and its greedy decoding equal an
  independent reference: the stock model with an eager attention function that applies
  the formula on dense logits; ``ape:1:1`` is the uncalibrated path;
* what cannot be calibrated is refused by name.
"""

import copy

import pytest
import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache

from helpers import contiguous_parts, tiny_model
from pcache_rag import PromptCache
from pcache_rag.models import UnsupportedModelError
from pcache_rag.models import attention as A
from pcache_rag.models.attention import CalibratedSpan, Calibration
from pcache_rag.engine import Parts


def _dense(query, key, value, scaling, span=None):
    """Explicit float64 logits: every earlier key visible, the block causal, APE on ``span``."""
    B, H, q, D = query.shape
    G = H // key.shape[1]
    k = key.double().repeat_interleave(G, dim=1)
    v = value.double().repeat_interleave(G, dim=1)
    s = (query.double() @ k.transpose(-1, -2)) * scaling  # (B, H, q, kv)
    kv = s.shape[-1]
    allowed = torch.arange(kv)[None, :] <= torch.arange(kv - q, kv)[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    if span is not None:
        T, S = span.calibration.temperature, span.calibration.scale
        c = s[..., span.start:span.end] / T
        s[..., span.start:span.end] = c + (S * T - 1) * torch.logsumexp(c, dim=-1, keepdim=True)
    return (torch.softmax(s, dim=-1) @ v).transpose(1, 2)  # (B, q, H, Dv)


@pytest.mark.parametrize("one_call", [True, False])
@pytest.mark.parametrize("q,kv,groups,batch", [(5, 40, 2, 2), (5, 40, 2, 1), (1, 33, 3, 1), (7, 7, 1, 1), (4, 20, 1, 2),
                                               (4, 20, 3, 1)])
def test_split_equals_one_masked_softmax(q, kv, groups, batch, one_call, monkeypatch):
    """The split path, as one masked call (a small mask) and as unmasked calls merged by
    log-sum-exp (ONE_CALL_MASK = 0), equals one dense causal softmax."""
    if not one_call:
        monkeypatch.setattr(A, "ONE_CALL_MASK", 0)
    torch.manual_seed(q * kv)
    query = torch.randn(batch, 2 * groups, q, 16)
    key, value = torch.randn(batch, 2, kv, 16), torch.randn(batch, 2, kv, 16)
    masks: dict = {}
    got = A.split_attention(query, key, value, 0.25, masks=masks)
    assert got.shape == (batch, q, 2 * groups, 16)
    assert (got.double() - _dense(query, key, value, 0.25)).abs().max() < 1e-5
    assert len(masks) == (1 if one_call and batch == 1 and q > 1 else 0)  # built once, kept for the other layers
    if masks:
        assert (A.split_attention(query, key, value, 0.25, masks=masks) - got).abs().max() == 0


def test_math_path_equals_the_flash_kernel():
    torch.manual_seed(1)
    query, key, value = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)
    for causal in (False, True):
        o1, l1 = A._attend(query, key, value, 0.3, causal)
        o2, l2 = A._attend_math(query, key, value, 0.3, causal)
        assert (o1 - o2).abs().max() < 1e-5 and (l1 - l2).abs().max() < 1e-5


@pytest.mark.parametrize("T,S", [(0.9, 0.9), (0.5, 1.3), (1.0, 1.0)])
def test_calibrated_range_is_apes_formula(T, S):
    torch.manual_seed(7)
    query, key, value = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 50, 16), torch.randn(1, 2, 50, 16)
    span = CalibratedSpan(10, 40, Calibration(T, S))
    got = A.split_attention(query, key, value, 0.25, span)
    assert (got.double() - _dense(query, key, value, 0.25, span)).abs().max() < 1e-5
    if (T, S) != (1.0, 1.0):  # a calibration changes the output, far above rounding
        assert (got - A.split_attention(query, key, value, 0.25)).abs().max() > 1e-3


def test_parse():
    assert Calibration.parse("ape:0.9:0.8") == Calibration(0.9, 0.8)
    assert Calibration.parse("none") is None and Calibration.parse(None) is None
    assert Calibration(0.9, 0.8).spec == "ape:0.9:0.8"
    for bad in ("ape:0.9", "ape:x:1", "temp:1:1", "ape:0:1"):
        with pytest.raises(ValueError):
            Calibration.parse(bad)


REF = "pcache_test_ape_reference"


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
    out = _dense(query, key, value, scaling if scaling is not None else query.shape[-1] ** -0.5, _REF_SPAN[0])
    return out.to(query.dtype).contiguous(), None


_REF_SPAN: list = [None]
AttentionInterface.register(REF, _reference_attention)


def _parts(pc):
    return contiguous_parts(pc, ["System words at the start of it all.", "Alpha document with several words in it.",
                                 "Bravo text that follows the alpha one.", "Charlie is the third chunk of context."])


def _reference_greedy(pc, parts, new_ids, cal, steps):
    """Greedy tokens and first logits of the stock model, attention replaced by the dense formula."""
    kvs = [kv for _, kv in parts]
    K = torch.cat([kv.keys for kv in kvs], dim=2)  # (L, H, C, D)
    V = torch.cat([kv.values for kv in kvs], dim=2)
    C = K.shape[2]
    cache = DynamicCache([(K[i][None].clone(), V[i][None].clone()) for i in range(K.shape[0])])
    model = copy.deepcopy(pc.model)
    model.set_attn_implementation(REF)
    _REF_SPAN[0] = None if cal is None else CalibratedSpan(kvs[0].length, C, cal)
    pos0 = int(kvs[-1].position_ids[-1]) + 1
    ids, pos = torch.tensor(new_ids), torch.arange(pos0, pos0 + len(new_ids))
    toks, first = [], None
    try:
        with torch.no_grad():
            for _ in range(steps):
                logits = model(input_ids=ids[None], position_ids=pos[None], cache=cache,
                               use_cache=True).logits[0, -1]
                first = logits if first is None else first
                toks.append(int(logits.argmax()))
                ids, pos = torch.tensor([toks[-1]]), torch.tensor([int(pos[-1]) + 1])
    finally:
        _REF_SPAN[0] = None
    return toks, first


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pc(request, smol_tok):
    model = tiny_model(request.param, len(smol_tok), seed=5)
    with torch.no_grad():  # sharper attention, so that a calibration moves logits well above rounding
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(4.0)
    return PromptCache(model, smol_tok, encoding="isolated", store_dtype=None)


@pytest.mark.parametrize("spec", ["ape:0.9:0.9", "ape:0.6:1.2"])
def test_calibrated_generation_equals_the_reference(pc, spec):
    parts, new = _parts(pc)
    cal = Calibration.parse(spec)
    res = pc.prefill(Parts(parts, new, calibration=spec))
    assert res.calibrated == CalibratedSpan(parts[0][1].length, sum(kv.length for _, kv in parts), cal)
    toks, first = _reference_greedy(pc, parts, new, cal, 6)
    assert (res.logits - first).abs().max() < 1e-4
    plain = pc.prefill(Parts(parts, new))
    assert (res.logits - plain.logits).abs().max() > 1e-3  # the calibration is not a no-op here
    out = pc.generate(Parts(parts, new, calibration=spec), max_new_tokens=6)
    assert out.token_ids[: len(toks)] == toks[: len(out.token_ids)] and out.token_ids
    batch = pc.generate_batch([Parts(parts, new, calibration=spec), Parts(parts, new)], max_new_tokens=6)
    assert batch[0].token_ids == out.token_ids
    assert batch[1].token_ids == pc.generate(Parts(parts, new), max_new_tokens=6).token_ids


def test_identity_calibration_and_the_uncalibrated_split(pc):
    parts, new = _parts(pc)
    plain = pc.prefill(Parts(parts, new))
    one = pc.prefill(Parts(parts, new, calibration="ape:1:1"))
    assert (plain.logits - one.logits).abs().max() < 1e-5
    _, first = _reference_greedy(pc, parts, new, None, 1)
    assert (plain.logits - first).abs().max() < 1e-4


def test_refused_by_name(pc, smol_tok):
    parts, new = _parts(pc)
    with pytest.raises(ValueError, match="does not combine with recompute"):
        pc.prefill(Parts(parts, new, calibration="ape:0.9:0.9"), recompute="epic:2")
    with pytest.raises(ValueError, match="ape:T:S"):
        pc.prefill(Parts(parts, new, calibration="0.9"))
    bloom = PromptCache(tiny_model("bloom", len(smol_tok)), smol_tok, encoding="isolated", store_dtype=None)
    bp, bn = _parts(bloom)
    with pytest.raises(UnsupportedModelError, match="ALiBi"):
        bloom.prefill(Parts(bp, bn, calibration="ape:0.9:0.9"))
