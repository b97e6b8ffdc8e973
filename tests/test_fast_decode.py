"""Decode weights (:mod:`pcache_rag.models.fast_decode`): generated tokens read int8 or bf16
copies of the linear weights, prompt tokens the model's own fp32 ones; a request decodes the
same alone or in a batch; a format that cannot run or fails its self-check is refused by name.
An engine's query weights give the rows computed over cached states the bf16 copies too."""

from __future__ import annotations

import copy

import pytest
import torch

from pcache_rag import PromptCache
from pcache_rag.models.fast_decode import DecodeLinear, decoding, use_decode_weights

from helpers import contiguous_parts, tiny_model
from pcache_rag.engine import Parts

TEXTS = [" The gate code of the north door is 4417 and it opens at dawn.",
         " A heron stood in the shallow river, watching the silver fish below.",
         " The library keeps maps of the old harbour in its basement archive."]


@pytest.fixture(scope="module", params=["int8", "bf16"])
def fast(request, smol_tok):
    """(an engine with decode weights, the same model without them)."""
    model = tiny_model("llama", len(smol_tok), seed=3)
    plain = copy.deepcopy(model)
    pc = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None, decode_weights=request.param)
    return pc, plain


def test_only_generated_rows_read_the_decode_weights(fast):
    pc, plain = fast
    rep = pc.decode_report
    assert rep.fmt in ("int8", "bf16") and rep.layers == 2 * 7 + 1 and rep.refused == ""
    assert rep.small_bytes * (4 if rep.fmt == "int8" else 2) == pytest.approx(rep.fp32_bytes, rel=0.05)  # int8: + one scale a row
    assert all(isinstance(m, DecodeLinear) for m in (pc.model.lm_head, pc.model.model.layers[0].mlp.down_proj))
    assert pc.model.lm_head.weight is pc.model.model.embed_tokens.weight or not pc.model.config.tie_word_embeddings
    ids = torch.tensor([[5, 17, 99, 4, 250]])
    with torch.no_grad():
        want = plain(input_ids=ids, use_cache=False).logits[0]
        prompt = pc.model(input_ids=ids, use_cache=False).logits[0]
        with decoding():
            small = pc.model(input_ids=ids, use_cache=False).logits[0]
    assert torch.equal(prompt, want), "outside decoding() the model is its fp32 self, bit for bit"
    assert 0 < float((small - want).norm() / want.norm()) < 0.05
    # a batch step: the leading rows are generated tokens, the rest prompt rows
    lin = pc.model.model.layers[1].mlp.up_proj
    x = torch.randn(1, 5, lin.in_features)
    with decoding(2):
        mixed = lin(x)
    with decoding():
        all_small = lin(x)
    assert torch.equal(mixed[0, :2], all_small[0, :2])
    assert torch.equal(mixed[0, 2:], torch.nn.functional.linear(x[0, 2:], lin.weight))


def test_a_request_decodes_the_same_alone_and_in_a_batch(fast, smol_tok):
    pc, _ = fast
    # alone: the fused step in the same weights (its own kernels); in a batch: the decode linears
    assert pc.core.decode_path.startswith(f"fused {pc.decode_report.fmt} step")
    reqs = [contiguous_parts(pc, TEXTS[i:] + TEXTS[:i], q) for i, q in
            enumerate([" Which code opens it?", " What did the heron watch?", " Where are the maps?"])]
    batch = pc.generate_batch([Parts(p, n) for p, n in reqs], max_new_tokens=8)
    for (p, n), got in zip(reqs, batch):
        one = pc.generate(Parts(p, n), max_new_tokens=8)
        assert got.token_ids == one.token_ids and got.decode_batch == len(reqs)
    assert len({tuple(b.token_ids) for b in batch}) > 1


def test_decode_weights_are_refused_by_name(smol_tok, monkeypatch, caplog):
    import pcache_rag.models.fast_decode as fd

    model = tiny_model("llama", len(smol_tok), seed=3)
    with pytest.raises(ValueError, match="decode_weights must be one of"):
        use_decode_weights(model, "int4", smol_tok)
    monkeypatch.setattr(fd, "MAX_REL_ERROR", 0.0)  # nothing passes: the model must keep fp32
    with caplog.at_level("WARNING", logger="pcache_rag.models.fast_decode"):
        rep = use_decode_weights(model, "int8", smol_tok)
    assert rep.fmt is None and "failed the self-check" in rep.refused and rep.rel_error > 0
    assert "decode weights refused" in caplog.text
    assert not any(isinstance(m, DecodeLinear) for m in model.modules()), "the fp32 layers are back"
    half = tiny_model("llama", len(smol_tok), seed=3).to(torch.bfloat16)
    rep = use_decode_weights(half, "int8", smol_tok)
    assert rep.fmt is None and "not float32" in rep.refused


@pytest.fixture
def bf16_fast(monkeypatch):
    """bf16 products taken as fast on this CPU, whatever it has: the mechanism is tested everywhere
    (without bf16 instructions they are merely slow)."""
    monkeypatch.setattr("pcache_rag.engine.core.slow_bf16_products", lambda device: "")


def _fp32_and_bf16_query_engines(smol_tok):
    """Two engines on one tiny model with bf16 decode weights: query weights as asked by default
    (fp32), and ``query_weights="bf16"``."""
    model = tiny_model("llama", len(smol_tok), seed=5)
    pc = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None, decode_weights="bf16")
    pq = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None, decode_weights="bf16",
                     query_weights="bf16")
    return pc, pq


def test_query_weights_compute_only_rows_over_cached_states_in_bf16(smol_tok, bf16_fast):
    """``query_weights="bf16"``: a cached prompt's new and recomputed rows read the bf16 decode
    weights; a prompt with nothing cached, and the states an engine encodes, stay fp32 bit for bit."""
    pc, pq = _fp32_and_bf16_query_engines(smol_tok)
    assert (pc.core.query_weights, pq.core.query_weights) == ("fp32", "bf16")
    parts, q = contiguous_parts(pc, TEXTS, " Which code opens the north door?")
    for recompute in ("none", "match:1"):
        want = pc.prefill(Parts(parts, q), recompute=recompute)
        got = pq.prefill(Parts(parts, q), recompute=recompute)
        assert got.computed_tokens == want.computed_tokens and got.recomputed_tokens == want.recomputed_tokens
        err = float((got.logits - want.logits).norm() / want.logits.norm())
        assert 0 < err < 0.05, f"{recompute}: the query rows must read bf16 weights, and stay close ({err})"
    ids = pc.safe.text(TEXTS[0] + TEXTS[1])
    assert torch.equal(pq.prefill(Parts([], ids)).logits, pc.prefill(Parts([], ids)).logits), \
        "nothing cached: the model's own weights"
    pos = list(range(len(ids)))
    a, b = pc.encoder.encode(ids, pos), pq.encoder.encode(ids, pos)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), "stored states are never computed in bf16"


def test_query_weights_match_alone_and_in_a_batch(smol_tok, bf16_fast):
    model = tiny_model("llama", len(smol_tok), seed=5)
    pq = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None, decode_weights="bf16",
                     query_weights="bf16")
    reqs = [contiguous_parts(pq, TEXTS[i:] + TEXTS[:i], q) for i, q in
            enumerate([" Which code opens it?", " What did the heron watch?", " Where are the maps?"])]
    plain = Parts([], pq.safe.text(TEXTS[2] + " Where are the maps?"))
    prompts = [Parts(p, n) for p, n in reqs] + [plain]
    batch = pq.generate_batch(prompts, max_new_tokens=8)
    for prompt, got in zip(prompts, batch):
        assert got.token_ids == pq.generate(prompt, max_new_tokens=8).token_ids


def test_query_weights_are_refused_by_name(smol_tok):
    for decode in (None, "int8"):
        model = tiny_model("llama", len(smol_tok), seed=3)
        with pytest.raises(ValueError, match="query_weights='bf16' reads the bf16 decode weights"):
            PromptCache(model, smol_tok, decode_weights=decode, query_weights="bf16")
    with pytest.raises(ValueError, match="query_weights must be"):
        PromptCache(tiny_model("llama", len(smol_tok), seed=3), smol_tok, decode_weights="bf16", query_weights="int8")


def test_query_weights_stay_fp32_where_bf16_products_are_slow(smol_tok, monkeypatch, caplog):
    """A CPU without bf16 dot-product instructions (an AVX2 one) keeps the exact fp32 rows, and says so."""
    from pcache_rag.engine.core import slow_bf16_products

    monkeypatch.setattr("pcache_rag.models.kernels.cpu_flags", lambda: "sse4_2 avx avx2 fma f16c")
    assert "no bf16 dot-product instructions" in slow_bf16_products(torch.device("cpu"))
    assert slow_bf16_products(torch.device("cuda")) == ""
    monkeypatch.setattr("pcache_rag.models.kernels.cpu_flags", lambda: "avx2 avx512f avx512_bf16")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert "capped below bf16" in slow_bf16_products(torch.device("cpu"))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert slow_bf16_products(torch.device("cpu")) == ""
    monkeypatch.setattr("pcache_rag.models.kernels.cpu_flags", lambda: "sse4_2 avx avx2 fma f16c")
    with caplog.at_level("INFO", logger="pcache_rag.engine.core"):
        pc = PromptCache(tiny_model("llama", len(smol_tok), seed=3), smol_tok, decode_weights="bf16",
                         query_weights="bf16")
    assert pc.core.query_weights == "fp32, bf16 head" and not pc.prefiller.query_weights
    assert "fp32 kept, this CPU has no bf16 dot-product instructions" in caplog.text


def test_without_bf16_products_only_the_first_tokens_head_reads_bf16(smol_tok, monkeypatch):
    """On a CPU without bf16 dot products, ``query_weights="bf16"`` keeps every row over cached states
    in fp32 but the output head's (one row, a product that streams its weights): the logits move by
    bf16 rounding, a prompt with nothing cached stays bit for bit, and a request gets the same tokens
    alone and in a batch beside a decoding one and a plain one."""
    monkeypatch.setattr("pcache_rag.models.kernels.cpu_flags", lambda: "sse4_2 avx avx2 fma f16c")
    pc, pq = _fp32_and_bf16_query_engines(smol_tok)
    assert (pc.core.query_weights, pq.core.query_weights) == ("fp32", "fp32, bf16 head")
    parts, q = contiguous_parts(pc, TEXTS, " Which code opens the north door?")
    heads: list[torch.dtype] = []  # the output head's rows, by the weights they read
    real = torch.nn.functional.linear

    def spy(x, w, b=None):
        if w.shape[0] == len(smol_tok):
            heads.extend([w.dtype] * x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    for recompute in ("none", "match:1"):
        want = pc.prefill(Parts(parts, q), recompute=recompute)
        heads.clear()
        got = pq.prefill(Parts(parts, q), recompute=recompute)
        assert heads == [torch.bfloat16], heads
        err = float((got.logits - want.logits).norm() / want.logits.norm())
        assert 0 < err < 0.05, f"{recompute}: the head reads bf16 weights, and stays close ({err})"
    ids = pc.safe.text(TEXTS[0] + TEXTS[1])
    assert torch.equal(pq.prefill(Parts([], ids)).logits, pc.prefill(Parts([], ids)).logits)
    reqs = [contiguous_parts(pq, TEXTS[i:] + TEXTS[:i], q) for i, q in
            enumerate([" Which code opens it?", " What did the heron watch?"])]
    prompts = [Parts(p, n) for p, n in reqs] + [Parts([], pq.safe.text(TEXTS[2] + " Where are the maps?"))]
    heads.clear()
    batch = pq.generate_batch(prompts, max_new_tokens=8)
    assert heads.count(torch.float32) == 1, "in a batch, only the plain prompt's first token reads the fp32 head"
    monkeypatch.setattr(torch.nn.functional, "linear", real)
    for prompt, got in zip(prompts, batch):
        assert got.token_ids == pq.generate(prompt, max_new_tokens=8).token_ids
