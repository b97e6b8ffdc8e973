"""int8 states (``store_dtype="int8"``): KIVI-style quantization, keys per channel and
values per token, dequantized while copied into the workspace."""

from __future__ import annotations

import pytest
import torch
from helpers import adapter_of, tiny_model

from pcache_rag import PromptCache
from pcache_rag.kv import ModuleKV, Workspace
from pcache_rag.store import DiskTier
from pcache_rag.store.disk import decode_entry, encode_entry

SCHEMA = ("<schema name='s'><system>Be brief.</system><module name='a'>Alpha document text about the north gate "
          "and its code.</module><module name='b'>Beta document about ferries, boats and the harbour.</module></schema>")
PROMPT = "<prompt schema='s'><a/><b/>What time does the ferry leave?</prompt>"


def _kv(T=12, L=3, H=2, D=8, seed=0) -> ModuleKV:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, H, T, D, generator=g)
    k[:, :, :, 1] *= 20  # an outlier channel, as real keys have
    return ModuleKV(k, torch.randn(L, H, T, D, generator=g), torch.arange(T), torch.arange(T))


def test_quantization_error_is_within_half_a_step_per_channel_and_token():
    kv = _kv()
    q = kv.to(dtype=torch.int8)
    assert q.quantized and q.keys.dtype == torch.int8 and q.values.dtype == torch.int8
    assert q.k_scale.shape == (3, 2, 1, 8) and q.v_scale.shape == (3, 2, 12, 1)
    back = q.to(dtype=torch.float32)
    k_step = q.k_scale.float()  # per channel: the outlier channel gets its own step
    v_step = q.v_scale.float()  # per token
    assert ((back.keys - kv.keys).abs() <= k_step / 2 + 1e-3 * kv.keys.abs()).all()
    assert ((back.values - kv.values).abs() <= v_step / 2 + 1e-3 * kv.values.abs()).all()
    L, H, T, D = kv.keys.shape  # int8 data, fp16 key scales per channel, fp16 value scales per token
    assert q.nbytes() == L * H * T * 2 * D + L * H * D * 2 + L * H * T * 2
    assert q.to(dtype=torch.int8) is q, "quantizing twice is a no-op"


def test_workspace_dequantizes_in_place_exactly_like_to():
    q = _kv().to(dtype=torch.int8)
    ws = Workspace(3, 2, 8, 8, torch.float32, "cpu", 64)
    ws.assemble([q], 0)
    ref = q.to(dtype=torch.float32)
    assert torch.equal(ws.k[:, 0, :, :12], ref.keys) and torch.equal(ws.v[:, 0, :, :12], ref.values)


def test_int8_entries_round_trip_on_disk_and_damage_is_detected(tmp_path):
    q = _kv().to(dtype=torch.int8)
    disk = DiskTier(tmp_path)
    disk.put("k", q)
    back = disk.get("k")
    assert back.quantized and all(torch.equal(a, b) for a, b in zip(back.tensors().values(), q.tensors().values()))
    stripped = ModuleKV(q.keys, q.values, q.token_ids, q.position_ids)  # int8 without scales
    with pytest.raises(ValueError, match="scales"):
        decode_entry("k", encode_entry("k", stripped))


@pytest.mark.parametrize("family", ["llama", "gpt2", "bloom"])
def test_int8_cached_logits_stay_close_to_fp32(family, smol_tok):
    model = tiny_model(family, len(smol_tok))
    logits = {}
    for dtype in ("float32", "int8"):
        pc = PromptCache(model, smol_tok, store_dtype=dtype)
        pc.add_schema(SCHEMA)
        logits[dtype] = pc.prefill(PROMPT).logits
        if dtype == "int8":
            kv = pc.store.get(pc.schemas.unit_key("s", "a"))
            assert kv.quantized
            bpt = kv.nbytes() / kv.length
    err = (logits["int8"] - logits["float32"]).abs().max().item()
    assert err < 0.02 * logits["float32"].abs().max().item(), err
    s = model.config
    fp16_bpt = adapter_of(PromptCache(model, smol_tok)).kv_shape.bytes_per_token(2)
    assert bpt < 0.6 * fp16_bpt, (bpt, fp16_bpt, s.model_type)


def test_int8_chunks_move_like_fp16_chunks(smol_tok):
    """A RoPE chunk placed at another position: dequantized, then re-rotated."""
    pc = PromptCache(tiny_model("llama", len(smol_tok)), smol_tok, store_dtype="int8")
    kv = pc.encoder.encode(list(range(5, 25)), list(range(3, 23))).to(dtype=torch.int8)
    moved = pc.encoder.place(kv, 40)
    ref = pc.encoder.place(kv.to(dtype=adapter_of(pc).dtype), 40)
    assert not moved.quantized and torch.equal(moved.keys, ref.keys) and torch.equal(moved.values, ref.values)


def test_store_dtype_is_checked_by_name(smol_tok):
    with pytest.raises(ValueError, match="store_dtype"):
        PromptCache(tiny_model("llama", len(smol_tok)), smol_tok, store_dtype="int4")
