"""The fused decode step (:mod:`pcache_rag.models.decode_step`) and its C kernels
(:mod:`pcache_rag.models.kernels`): the same logits, cache rows and greedy answers as the
model's own forward, on both kernel paths and every family it takes; refused by name where it
cannot compute the model, and the engine then decodes through transformers as before."""

from __future__ import annotations

import pytest
import torch

from pcache_rag import PromptCache
from pcache_rag.engine import Parts
from pcache_rag.kv import Workspace
from pcache_rag.models import adapter_for, kernels
from pcache_rag.models.decode_step import FusedDecodeStep, UnsupportedStep, fused_step

from helpers import contiguous_parts, tiny_model

TEXTS = [" The gate code of the north door is 4417 and it opens at dawn.",
         " A heron stood in the shallow river, watching the silver fish below."]


def _no_kernels(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "why_not", lambda: "disabled by the test")


def _prefilled(model, ids: torch.Tensor, extra: int):
    """(adapter, a workspace cache holding ``ids``' states, the last logits)."""
    ad = adapter_for(model)
    s = ad.kv_shape
    ws = Workspace(s.n_layers, s.n_kv_heads, s.head_dim, s.head_dim_v, torch.float32, torch.device("cpu"),
                   ids.numel() + extra)
    cache = ws.cache()
    with torch.no_grad():
        logits = ad.forward(ids, torch.arange(ids.numel()), cache, None, None)[-1]
    return ad, cache, logits


@pytest.mark.parametrize("kernel_path", ["c", "torch"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_fp32_step_matches_the_models_own_forward(family, kernel_path, smol_tok, monkeypatch):
    if kernel_path == "torch":
        _no_kernels(monkeypatch)
    elif kernels.load() is None:
        pytest.skip(f"the C kernels cannot be built here: {kernels.why_not()}")
    model = tiny_model(family, len(smol_tok), seed=7)
    ids = torch.tensor(smol_tok(TEXTS[0])["input_ids"])
    ad, ours, logits = _prefilled(model, ids, 8)
    _, stock, _ = _prefilled(model, ids, 8)
    step = FusedDecodeStep(model, ad, "fp32")
    assert step.kernels == kernel_path
    tok, n = int(logits.argmax()), ids.numel()
    for p in range(n, n + 6):
        with torch.no_grad():
            want = ad.forward(torch.tensor([tok]), torch.tensor([p]), stock, None, None)[-1]
        got = step(tok, p, ours.layers)
        assert float((got - want).norm() / want.norm()) < 1e-5
        assert int(got.argmax()) == int(want.argmax())
        tok = int(want.argmax())
    assert all(a.length == b.length == n + 6 for a, b in zip(ours.layers, stock.layers))
    for a, b in zip(ours.layers, stock.layers):  # the rows it wrote are the rows the model writes
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_small_weight_steps_pass_their_self_check(fmt, smol_tok):
    model = tiny_model("llama", len(smol_tok), seed=7)
    step, why = fused_step(model, adapter_for(model), smol_tok, fmt)
    assert why == "" and step is not None and step.fmt == fmt
    fp32 = FusedDecodeStep(model, adapter_for(model), "fp32")
    assert step.nbytes * (2 if fmt == "bf16" else 4) == pytest.approx(fp32.nbytes, rel=0.05)


def test_the_engine_decodes_the_same_tokens_fused_or_not(smol_tok):
    model = tiny_model("llama", len(smol_tok), seed=7)
    fused = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None)
    stock = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None, fused_decode=False)
    assert fused.core.decode_path.startswith("fused fp32 step")
    assert stock.core.decode_path == "stock transformers step (fused_decode=False)"
    calls = []
    real = fused.core.decoder.step
    fused.core.decoder.step = lambda *a: calls.append(a[1]) or real(*a)
    for pc in (fused, stock):
        pc.eos_ids = set()
    parts, q = contiguous_parts(fused, TEXTS, " Which code opens the door?")
    a = fused.generate(Parts(parts, q), max_new_tokens=16)
    b = stock.generate(Parts(parts, q), max_new_tokens=16)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    assert len(calls) == 15 and calls == sorted(calls), "every token after the first went through the fused step"
    # a calibrated prompt attends with its calibration: the stock step decodes it
    calls.clear()
    c = fused.generate(Parts(parts, q, calibration="ape:0.9:0.9"), max_new_tokens=4)
    d = stock.generate(Parts(parts, q, calibration="ape:0.9:0.9"), max_new_tokens=4)
    assert calls == [] and c.token_ids == d.token_ids


@pytest.mark.parametrize("family,why", [("gpt2", "positions"), ("bloom", "alibi"), ("mistral_sw", "sliding-window"),
                                        ("gemma3", "")])
def test_models_it_cannot_compute_keep_the_stock_step(family, why, smol_tok):
    model = tiny_model(family, len(smol_tok), seed=1)
    pc = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None)
    assert pc.core.decode_path.startswith("stock transformers step: ") and why in pc.core.decode_path
    assert pc.core.decoder.step is None
    out = pc.generate(Parts([], pc.text_ids(" The heron")), max_new_tokens=3)
    assert len(out.token_ids) >= 1


def test_a_failed_self_check_is_refused_by_name(smol_tok, monkeypatch, caplog):
    import pcache_rag.models.decode_step as ds

    monkeypatch.setitem(ds.MAX_ERROR, "bf16", 0.0)
    model = tiny_model("llama", len(smol_tok), seed=7)
    with caplog.at_level("WARNING", logger="pcache_rag.engine.core"):
        pc = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None, decode_weights="bf16")
    assert "failed its self-check" in pc.core.decode_path and pc.core.decoder.step is None
    assert "fused decode step refused" in caplog.text
    assert pc.decode_report.fmt == "bf16", "the batch path's decode weights stand on their own check"


def test_the_step_refuses_a_full_cache(smol_tok):
    model = tiny_model("llama", len(smol_tok), seed=7)
    ids = torch.tensor(smol_tok(TEXTS[0])["input_ids"])
    ad, cache, logits = _prefilled(model, ids, 0)
    step = FusedDecodeStep(model, ad, "fp32")
    with pytest.raises(RuntimeError, match="room for one more"):
        step(int(logits.argmax()), ids.numel(), cache.layers)
    with pytest.raises(ValueError, match="weights are one of"):
        FusedDecodeStep(model, ad, "int4")
    with pytest.raises(UnsupportedStep, match="rope_type"):
        ad.rope_type = "dynamic"
        FusedDecodeStep(model, ad, "fp32")


def test_no_compiler_means_torch_kernels_said_by_name(smol_tok, monkeypatch):
    monkeypatch.setattr(kernels, "_libs", {})
    monkeypatch.setenv("CC", "/nonexistent/cc")
    model = tiny_model("llama", len(smol_tok), seed=7)
    step = FusedDecodeStep(model, adapter_for(model), "fp32")
    assert step.kernels == "torch" and "no C compiler" in step.kernels_why_not
    pc = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None)
    assert "torch kernels: no C compiler" in pc.core.decode_path


def test_kernels_refuse_buffers_they_cannot_read():
    lib = kernels.load()
    if lib is None:
        pytest.skip(f"the C kernels cannot be built here: {kernels.why_not()}")
    w = torch.randn(32, 48)
    g = kernels.Gemv(lib, w, None, "fp32")
    x = torch.randn(48)
    torch.testing.assert_close(g(x, torch.empty(32)), w @ x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g(x, torch.ones(32), add=True), w @ x + 1, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="contiguous CPU torch.float32"):
        g(x.double(), torch.empty(32))
    with pytest.raises(ValueError, match="at least 48"):
        g(torch.randn(40), torch.empty(32))
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.Gemv(lib, torch.randn(8, 20), None, "fp32")
    att = kernels.Attention(lib, 2, 2, 16)
    good = torch.zeros(2, 10, 16)
    att.check(good, 10)
    with pytest.raises(ValueError, match="contiguous rows"):
        att.check(torch.zeros(2, 16, 10).transpose(1, 2), 10)
    with pytest.raises(ValueError, match=">= 11"):
        att.check(good, 11)


def test_requests_in_the_batch_take_the_fused_step(smol_tok):
    """Alone in the batch, or several decoding together with nothing filling: the fused step
    (its many-sequence form for several), each request to the same tokens as decoded alone."""
    model = tiny_model("llama", len(smol_tok), seed=7)
    pc = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None)
    pc.eos_ids = set()
    parts, q = contiguous_parts(pc, TEXTS, " Which code opens the door?")
    other = contiguous_parts(pc, TEXTS[::-1], " What did the heron watch?")
    solo = [pc.generate(Parts(p, n), max_new_tokens=10).token_ids for p, n in ((parts, q), other)]
    step = pc.core.decoder.step
    assert step.kernels == "c", step.kernels_why_not
    calls: list[int] = []
    real_call, real_many = type(step).__call__, type(step).many

    class Counting(type(step)):  # the engine's step, counting the sequences of each call
        def __call__(self, *a):
            calls.append(1)
            return real_call(self, *a)

        def many(self, tokens, *a):
            calls.append(len(tokens))
            return real_many(self, tokens, *a)

    step.__class__ = Counting
    pc.start_batching(max_batch=4)
    try:
        one = pc.generate(Parts(parts, q), max_new_tokens=10)
    finally:
        pc.stop_batching()
    assert one.token_ids == solo[0] and calls == [1] * 9, "alone in the batch: every token after the first fused"
    calls.clear()
    both = pc.generate_batch([Parts(parts, q), Parts(*other)], max_new_tokens=10)
    assert [b.token_ids for b in both] == solo
    assert calls and set(calls) <= {1, 2} and 2 in calls, "together: one fused step for both"
    assert all(b.decode_batch == 2 for b in both)


def test_many_sequences_compute_each_as_alone(smol_tok):
    """:meth:`FusedDecodeStep.many` against :meth:`__call__`: the same logits, bit for bit, in every format."""
    model = tiny_model("qwen2", len(smol_tok), seed=3)
    ids = [torch.tensor(smol_tok(t)["input_ids"]) for t in TEXTS + [" Short."]]
    for fmt in ("fp32", "bf16", "int8"):
        step, why = fused_step(model, adapter_for(model), smol_tok, fmt)
        assert step is not None and step.kernels == "c", why or step.kernels_why_not
        alone, together = [_prefilled(model, i, 8) for i in ids], [_prefilled(model, i, 8) for i in ids]
        want = []
        for (_, cache, logits), i in zip(alone, ids):
            tok, pos = int(logits.argmax()), i.numel()
            for _ in range(6):
                out = step(tok, pos, cache.layers)
                tok, pos = int(out.argmax()), pos + 1
            want.append(out.clone())
        toks, poss = [int(lg.argmax()) for _, _, lg in together], [i.numel() for i in ids]
        for _ in range(6):
            out = step.many(toks, poss, [c.layers for _, c, _ in together])
            toks, poss = [int(r.argmax()) for r in out], [p + 1 for p in poss]
        assert all(torch.equal(w, g) for w, g in zip(want, out)), fmt
        assert [c.layers[0].length for _, c, _ in together] == [c.layers[0].length for _, c, _ in alone]


def test_a_second_engine_on_the_model_decodes_with_its_decode_weights(smol_tok):
    """The eval and a server build several engines over one model: the decode weights an earlier
    one installed stay in force in the fused step of the next."""
    model = tiny_model("llama", len(smol_tok), seed=7)
    first = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None, decode_weights="bf16")
    second = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None)
    assert first.core.decode_path.startswith("fused bf16") and second.core.decode_path.startswith("fused bf16")
    again = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None, decode_weights="bf16")
    assert again.decode_report.fmt == "bf16"
    other = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None, decode_weights="int8")
    assert other.decode_report.fmt is None and "already carry bf16" in other.decode_report.refused


def test_engines_over_one_model_share_the_step_weights(smol_tok):
    model = tiny_model("llama", len(smol_tok), seed=7)
    a = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None)
    b = PromptCache(model, smol_tok, encoding="preamble", store_dtype=None)
    sa, sb = a.core.decoder.step, b.core.decoder.step
    assert sa is not sb and sa.layers is sb.layers and sa.head is sb.head, "weights shared, scratch not"
    assert sa._h is not sb._h


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_the_batch_steps_decode_weights_are_the_fused_steps(fmt, smol_tok):
    """One small copy of the weights, not two: the batch step's decode layers read the fused
    step's rows, and a batch decodes as it does over layers that kept their own copies."""
    from pcache_rag.models.fast_decode import DecodeLinear

    shared = tiny_model("llama", len(smol_tok), seed=7)
    pc = PromptCache(shared, smol_tok, encoding="isolated", store_dtype=None, decode_weights=fmt)
    assert pc.core.decode_path.startswith(f"fused {fmt}")
    step = pc.core.decoder.step
    q = shared.model.layers[0].self_attn.q_proj
    assert isinstance(q, DecodeLinear)
    assert q._q.untyped_storage().data_ptr() == step.layers[0].qkv.w.untyped_storage().data_ptr()
    down = shared.model.layers[-1].mlp.down_proj
    assert down._q.data_ptr() == step.layers[-1].down.w.data_ptr()
    own = tiny_model("llama", len(smol_tok), seed=7)
    ref = PromptCache(own, smol_tok, encoding="isolated", store_dtype=None, decode_weights=fmt, fused_decode=False)
    assert own.model.layers[0].self_attn.q_proj._q.untyped_storage().data_ptr() != \
        step.layers[0].qkv.w.untyped_storage().data_ptr()
    outs = []
    for eng in (pc, ref):
        eng.eos_ids = set()
        reqs = [Parts(*contiguous_parts(eng, TEXTS, " Which code opens the door?")),
                Parts(*contiguous_parts(eng, TEXTS[::-1], " What did the heron watch?"))]
        outs.append([o.token_ids for o in eng.generate_batch(reqs, max_new_tokens=8)])
    assert outs[0] == outs[1]
