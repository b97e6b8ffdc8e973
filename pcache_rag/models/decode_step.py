"""The fused decode step: one generated token through a Llama-style decoder in about ten
kernel calls a layer, instead of through transformers' module tree.

Why our own loop: a decode step on a CPU is one token, so its cost is the time to stream the
linear weights plus a fixed cost per tensor op. Through the stock modules the embedded 135M
model spends ~600 small ops a token (rotary tables, mask checks, cache bookkeeping,
``nn.Linear`` dispatch), and PyTorch's kernels stream a one-token product of its small
matrices at 12-19 GB/s where the machine reads ~30 GB/s: the stock step measured 59-89 ms a
token where its fp32 weights stream in ~16 ms. This step:

* fuses the projections that read the same input (``q|k|v``, ``gate|up``) into one matrix;
* computes each layer with the C kernels of :mod:`.kernels` (RMSNorm, matrix-vector products
  in fp32, bf16 or int8 at the machine's read bandwidth, RoPE written straight into the
  cache's row, attention of the one query over the cache's rows in place, SiLU gate), where
  they can be built; else with oneDNN's prepacked weights (the layout ``torch.compile``
  freezing uses on CPU) or ``aten._weight_int8pack_mm``, and torch ops for the rest;
* groups the query heads of each key head (grouped-query attention), never repeating keys.

``torch.compile`` of the same loop was measured and did not pay: 113 s to compile, and slower
steps (its kernels for a growing key length are generic loops).

What it covers, checked at build, refused by name otherwise (the caller keeps the stock step):
decoder layers with ``self_attn.{q,k,v,o}_proj`` (q/k/v biases allowed; per-head
``q_norm``/``k_norm`` on the torch path), ``mlp.{gate,up,down}_proj`` with SiLU, RMSNorm
``input_layernorm`` and ``post_attention_layernorm`` (``weight * x / rms``, not Gemma's
``1 + weight``), a final ``norm``, ``lm_head``, one RoPE table of fixed frequencies in the HF
half-rotation convention, no sliding window, no soft cap. :meth:`FusedDecodeStep.check`, run at
build, decodes a few tokens beside the model's own forward (fp32 weights): the relative error
of the logits within :data:`MAX_ERROR` and the same top token at every step. Calibrated
attention, windows and ALiBi decode through the model's forward
(:class:`~pcache_rag.engine.decode.Decoder` decides per stream).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import kernels

log = logging.getLogger(__name__)

#: the weight formats of the fused step's linear layers
STEP_FORMATS = ("fp32", "bf16", "int8")
#: the self-check's bound on the relative error of the logits, by format
MAX_ERROR = {"fp32": 1e-3, "bf16": 0.05, "int8": 0.05}
#: the self-check's prompt
CHECK_TEXT = "The ferry leaves the harbour at dawn, and the archive opens at nine."


#: each model's laid-out step weights, by (format, kernels): built once, shared by its engines
#: (weights changed in place after that are not seen: build a new model object instead)
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class UnsupportedStep(ValueError):
    """The model's layers are not the shape the fused step computes."""


def _mkldnn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class Matvec:
    """One linear layer's weights laid out for ``fmt``; ``mv(x, y)`` writes ``W x (+ bias)`` for
    ``x`` (K,) fp32 into ``y`` (N,) fp32 (``add=True``: adds it, a residual connection). With
    the C kernels (``lib``) the weights stay row-major; without, oneDNN's reordered layout (fp32,
    bf16) or ``aten._weight_int8pack_mm`` (int8)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, lib=None) -> None:
        w = weight.detach().float().contiguous()  # (N, K)
        self.fmt, self.out_features = fmt, w.shape[0]
        self.bias = None if bias is None else bias.detach().float()
        self.scale: torch.Tensor | None = None
        self.packed = False
        if fmt == "int8":  # symmetric, one scale per output row
            s = (w.abs().amax(1) / 127).clamp(min=1e-8)
            self.w = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
            self.scale = s.to(torch.bfloat16)  # (N,) (the C kernel reads it widened back to fp32)
        else:
            self.w = w.to(torch.bfloat16 if fmt == "bf16" else torch.float32)  # (N, K)
        self.gemv = None
        if lib is not None:
            self.gemv = kernels.Gemv(lib, self.w, self.bias, fmt, self.scale)
        elif fmt != "int8" and w.device.type == "cpu" and _mkldnn():
            self.w, self.packed = torch.ops.mkldnn._reorder_linear_weight(self.w, 1), True  # batch-size hint 1

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size() + (0 if self.scale is None else self.scale.numel() * 2)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, add: bool = False) -> torch.Tensor:
        if self.gemv is not None:
            return self.gemv(x, y, add)
        xx = x[None].to(torch.bfloat16) if self.fmt in ("bf16", "int8") else x[None]  # (1, K)
        if self.fmt == "int8":
            r = torch.ops.aten._weight_int8pack_mm(xx, self.w, self.scale)
        elif self.packed:
            r = torch.ops.mkldnn._linear_pointwise(xx, self.w, None, "none", [], "")
        else:
            r = F.linear(xx, self.w)
        r = r[0].float()
        if self.bias is not None:
            r = r + self.bias
        return y.add_(r) if add else y.copy_(r)


def _linear_like(mod) -> bool:
    """An ``nn.Linear``, or a layer standing in for one with its ``weight`` (N, K) and ``bias``
    (:class:`~pcache_rag.models.fast_decode.DecodeLinear`)."""
    w = getattr(mod, "weight", None)
    return isinstance(mod, torch.nn.Module) and isinstance(w, torch.Tensor) and w.dim() == 2 and hasattr(mod, "bias")


def _cat_bias(*lins) -> torch.Tensor | None:
    if all(lin.bias is None for lin in lins):
        return None
    return torch.cat([lin.bias if lin.bias is not None else torch.zeros(lin.weight.shape[0], device=lin.weight.device)
                      for lin in lins])


def _norm_weight(norm: torch.nn.Module, what: str) -> tuple[torch.Tensor, float]:
    """An RMSNorm's ``(weight, eps)``, or :class:`UnsupportedStep`."""
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None)
    name = type(norm).__name__
    if w is None or eps is None or "RMSNorm" not in name or "Gemma" in name:
        raise UnsupportedStep(f"{what} is a {name}, not an RMSNorm of weight * x / rms")
    return w.detach().float().contiguous(), float(eps)


@dataclass(frozen=True, slots=True)
class _Layer:
    qkv: Matvec
    o: Matvec
    gate_up: Matvec
    down: Matvec
    norm1: torch.Tensor  # (hidden,)
    norm2: torch.Tensor  # (hidden,)
    q_norm: torch.Tensor | None  # (head_dim,)
    k_norm: torch.Tensor | None


def _layer_parts(base: Any, D: int) -> tuple[list[tuple[Any, ...]], float]:
    """Each decoder layer's ``(attention, mlp, input norm, post-attention norm, q norm, k norm)``,
    and the norms' epsilon; :class:`UnsupportedStep` names a layer the fused step cannot compute."""
    found: list[tuple[Any, ...]] = []
    eps = 0.0
    for i, layer in enumerate(base.layers):
        a: Any = getattr(layer, "self_attn", None)
        m: Any = getattr(layer, "mlp", None)
        need = [(a, "q_proj"), (a, "k_proj"), (a, "v_proj"), (a, "o_proj"), (m, "gate_proj"), (m, "up_proj"),
                (m, "down_proj")]
        missing = [n for o, n in need if not _linear_like(getattr(o, n, None))]
        if missing:
            raise UnsupportedStep(f"layer {i} has no linear {', '.join(missing)}")
        scaling = getattr(a, "scaling", D ** -0.5)
        if abs(scaling - D ** -0.5) > 1e-9:
            raise UnsupportedStep(f"attention scaling {scaling} is not head_dim ** -0.5")
        if m.down_proj.bias is not None or a.o_proj.bias is not None or m.gate_proj.bias is not None:
            raise UnsupportedStep("biases on o_proj or the MLP")
        n1, eps = _norm_weight(layer.input_layernorm, "input_layernorm")
        n2, _ = _norm_weight(layer.post_attention_layernorm, "post_attention_layernorm")
        qn = _norm_weight(a.q_norm, "q_norm")[0] if hasattr(a, "q_norm") else None
        kn = _norm_weight(a.k_norm, "k_norm")[0] if hasattr(a, "k_norm") else None
        found.append((a, m, n1, n2, qn, kn))
    return found, eps


def _laid_out(model: Any, found: list[tuple[Any, ...]], fmt: str, kernel: tuple[str, str], lib) -> tuple[list, Any]:
    """The step's weights in ``fmt`` (each layer's fused q/k/v and gate/up products, and the head).
    They hold no state: every engine over this model shares one set a format and kernel."""
    shared = _SHARED.setdefault(model, {})
    key = (fmt, *kernel)
    if key not in shared:
        layers = []
        for a, m, n1, n2, qn, kn in found:
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])  # ((H + 2 Hkv) D, hidden)
            gu = torch.cat([m.gate_proj.weight, m.up_proj.weight])  # (2 inter, hidden)
            layers.append(_Layer(Matvec(qkv, _cat_bias(a.q_proj, a.k_proj, a.v_proj), fmt, lib),
                                 Matvec(a.o_proj.weight, None, fmt, lib), Matvec(gu, None, fmt, lib),
                                 Matvec(m.down_proj.weight, None, fmt, lib), n1, n2, qn, kn))
        shared[key] = (layers, Matvec(model.lm_head.weight, model.lm_head.bias, fmt, lib))
    return shared[key]


def _c_refusal(model: Any, found: list[tuple[Any, ...]], hidden: int, H: int, Hkv: int, D: int, inter: int) -> str:
    """Why this model's step cannot run on the C kernels ('' if it can)."""
    if model.device.type != "cpu":
        return f"the model is on {model.device}"
    if any(qn is not None for *_, qn, _ in found):
        return "per-head q_norm/k_norm (the kernels path has none)"
    G = H // Hkv
    if hidden % 16 or inter % 16 or D % 16 or D > kernels.MAX_HEAD_DIM or G > kernels.MAX_GROUP:
        return (f"hidden {hidden}, intermediate {inter}, head size {D}, {G} query heads a key head: the "
                f"kernels take multiples of 16, heads up to {kernels.MAX_HEAD_DIM}, groups up to {kernels.MAX_GROUP}")
    return ""


class FusedDecodeStep:
    """One generated token of ``model`` (its family's ``adapter``) with ``fmt`` weights: see the
    module docstring. Raises :class:`UnsupportedStep` naming what it cannot compute."""

    def __init__(self, model: Any, adapter, fmt: str = "fp32") -> None:
        if fmt not in STEP_FORMATS:
            raise ValueError(f"the fused decode step's weights are one of {STEP_FORMATS}, not {fmt!r}")
        if getattr(adapter, "family", "") != "rope" or not getattr(adapter, "shared_rope", False):
            raise UnsupportedStep(f"{getattr(adapter, 'family', '?')} positions: the fused step computes one RoPE table")
        if adapter.window is not None or adapter.softcap is not None:
            raise UnsupportedStep(f"{adapter.constrained}: the fused step attends to every key, uncapped")
        c = model.config
        if getattr(c, "hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedStep(f"hidden_act {c.hidden_act!r}: the fused step's MLP is SiLU-gated")
        if any(t in adapter.rope_type for t in ("dynamic", "longrope")) or adapter.inv_freq.numel() * 2 != adapter.kv_shape.head_dim:
            raise UnsupportedStep(f"rope_type {adapter.rope_type!r} (or a partial rotation): the fused step rotates "
                                  "whole heads by fixed frequencies")
        base = model.model
        s = adapter.kv_shape
        if s.head_dim != s.head_dim_v:
            raise UnsupportedStep("keys and values of different head sizes")
        self.fmt = fmt
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, s.n_kv_heads, s.head_dim
        self.inter = inter = c.intermediate_size
        found, self.eps = _layer_parts(base, D)
        self.norm = _norm_weight(base.norm, "the final norm")[0]
        if getattr(base.embed_tokens, "embed_scale", None) is not None:
            raise UnsupportedStep("scaled token embeddings")
        self.embed = base.embed_tokens.weight.detach()  # (vocab, hidden), fp32
        hidden = self.embed.shape[1]
        self.inv_freq = adapter.inv_freq.detach().double()  # (D/2,)
        self.rope_scale = float(getattr(base.rotary_emb, "attention_scaling", 1.0) or 1.0)

        #: which kernels the step runs: "c" (kernels.c) or "torch" (oneDNN / aten), and why not c
        self.kernels, self.kernels_why_not = "torch", _c_refusal(model, found, hidden, H, Hkv, D, inter)
        lib = None if self.kernels_why_not else kernels.load()
        if lib is None and not self.kernels_why_not:
            self.kernels_why_not = kernels.why_not()
        #: the C kernels' instruction-set variant ("avx512", "avx2", "neon", "portable"; "" on torch's)
        self.variant = ""
        if lib is not None:
            self.kernels, self.variant = "c", lib.pc_variant().decode()
        self._lib: Any = lib
        self.layers, self.head = _laid_out(model, found, fmt, (self.kernels, self.variant), lib)

        dt, dev = torch.float32, self.embed.device
        # the step's scratch, reused every token (one decode at a time: the engine lock)
        self._h = torch.empty(hidden, dtype=dt, device=dev)
        self._x = torch.empty(hidden, dtype=dt, device=dev)
        self._qkv = torch.empty((H + 2 * Hkv) * D, dtype=dt, device=dev)
        self._q = torch.empty(H * D, dtype=dt, device=dev)
        self._att = torch.empty(H * D, dtype=dt, device=dev)
        self._gu = torch.empty(2 * inter, dtype=dt, device=dev)
        self._act = torch.empty(inter, dtype=dt, device=dev)
        self._logits = torch.empty(self.head.out_features, dtype=dt, device=dev)
        self._cos = torch.empty(D // 2, dtype=dt, device=dev)
        self._sin = torch.empty(D // 2, dtype=dt, device=dev)
        self._checked: set[tuple[int, int, int]] = set()  # (keys address, values address, capacity) checked
        self._many: list[torch.Tensor] | None = None  # many()'s scratch, grown to the largest batch seen
        if lib is not None:
            self._attn = kernels.Attention(lib, Hkv, H // Hkv, D)
            # every layer for pc_decode_layers: the weights now, each call's cache rows when it runs
            self._plan = (kernels.Layer * len(self.layers))()
            for lay, row in zip(self.layers, self._plan):
                row.weights([m.gemv for m in (lay.qkv, lay.o, lay.gate_up, lay.down)], lay.norm1, lay.norm2)
        #: the thread count the last token ran on (the C kernels fit it to the free CPUs)
        self.threads = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the step's weights that one token reads."""
        return sum(x.nbytes for lay in self.layers for x in (lay.qkv, lay.o, lay.gate_up, lay.down)) + self.head.nbytes

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    @torch.no_grad()
    def __call__(self, token: int, position: int, layers) -> torch.Tensor:
        """The logits (vocab,) after ``token`` at ``position``; its key and value are written at
        row ``length`` of every layer's buffers (``layers``: a workspace cache's layers, with
        ``buffers``, ``length`` and ``set_length``), whose lengths then grow by one. The logits
        are a scratch buffer: read them before the next call."""
        ang = position * self.inv_freq  # (D/2,) in float64, as the adapter's re-rotation
        torch.mul(ang.cos(), self.rope_scale, out=self._cos)
        torch.mul(ang.sin(), self.rope_scale, out=self._sin)
        self._h.copy_(self.embed[token])
        n = layers[0].length
        bufs = []
        for i, layer in enumerate(layers):
            kb, vb = layer.buffers  # (Hkv, capacity, D) each
            if layer.length != n or n >= kb.shape[1]:
                raise RuntimeError(f"cache layer {i} holds {layer.length} of {kb.shape[1]} rows; the step needs {n} "
                                   "and room for one more")
            bufs.append((kb, vb))
        if self._lib is not None:
            with kernels.Team(self._lib) as self.threads:
                self._step_c(bufs, n)
        else:
            self._step_torch(bufs, n)
        for layer in layers:
            layer.set_length(n + 1)
        return self._logits

    def _readable(self, kb: torch.Tensor, vb: torch.Tensor, n: int) -> None:
        """Refuse a layer's key and value buffers the C kernels cannot read raw; each new buffer
        (a workspace grown, a request's own rows) is checked once."""
        key = (kb.data_ptr(), vb.data_ptr(), kb.shape[1])
        if key not in self._checked:
            self._attn.check(kb, n + 1)
            self._attn.check(vb, n + 1)
            if kb.stride(0) != vb.stride(0):
                raise ValueError("key and value buffers of different layouts")
            self._checked.add(key)

    def _step_c(self, bufs: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        """Every layer in one call of ``pc_decode_layers`` (the calls this loop made one by one in
        Python, in the same order: the same bits), then the final norm and the head."""
        lib, plan = self._lib, self._plan
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        for row, (kb, vb) in zip(plan, bufs):
            self._readable(kb, vb, n)
            row.k, row.v, row.hs = kb.data_ptr(), vb.data_ptr(), kb.stride(0)
        hp, xp = self._h.data_ptr(), self._x.data_ptr()
        rc = lib.pc_decode_layers(plan, len(plan), kernels.FORMATS[self.fmt], hp, xp, self._qkv.data_ptr(),
                                  self._q.data_ptr(), self._att.data_ptr(), self._gu.data_ptr(),
                                  self._act.data_ptr(), self._cos.data_ptr(), self._sin.data_ptr(), self._h.numel(), H,
                                  Hkv, D, self.inter, self.eps, D ** -0.5, n, self._attn.scratch_for(n + 1))
        if rc != 0:
            raise MemoryError("the decode step's kernels could not allocate their scratch (a few KB): out of memory")
        lib.pc_rmsnorm(hp, self.norm.data_ptr(), xp, self._h.numel(), self.eps)
        self.head.gemv.raw(xp, self._logits.data_ptr())  # type: ignore[union-attr]

    @torch.no_grad()
    def many(self, tokens: list[int], positions: list[int], seqs: list) -> torch.Tensor:
        """The logits (M, vocab) after each of M sequences' next token (``tokens[i]`` at
        ``positions[i]``, written into the buffers of ``seqs[i]``, that sequence's layers as in
        :meth:`__call__`): one pass over the weights for all of them, every row computed to the
        same bits as :meth:`__call__` computes it alone. C kernels only (:attr:`kernels`
        ``"c"``). The logits are scratch: read them before the next call."""
        if self._lib is None:
            raise RuntimeError(f"the fused step decodes several sequences on the C kernels only ({self.kernels_why_not})")
        lib, M = self._lib, len(tokens)
        H, Hkv, D, hidden, inter = self.n_heads, self.n_kv, self.head_dim, self._h.numel(), self.inter
        if self._many is None or self._many[0].shape[0] < M:
            dims = (hidden, hidden, (H + 2 * Hkv) * D, H * D, H * D, 2 * inter, inter, self.head.out_features, D // 2,
                    D // 2)
            self._many = [torch.empty(max(M, 4), d) for d in dims]  # (M, d) each
        h, x, qkv, q, att, gu, act, logits, cos, sin = (t[:M] for t in self._many)
        ns = []
        for i, (token, position, layers) in enumerate(zip(tokens, positions, seqs)):
            ang = position * self.inv_freq  # as __call__ computes it, row by row
            torch.mul(ang.cos(), self.rope_scale, out=cos[i])
            torch.mul(ang.sin(), self.rope_scale, out=sin[i])
            h[i].copy_(self.embed[token])
            n = layers[0].length
            for j, layer in enumerate(layers):
                kb, vb = layer.buffers
                if layer.length != n or n >= kb.shape[1]:
                    raise RuntimeError(f"sequence {i}, cache layer {j}: {layer.length} of {kb.shape[1]} rows held; "
                                       f"the step needs {n} and room for one more")
                self._readable(kb, vb, n)
            ns.append(n)
        with kernels.Team(lib) as self.threads:
            self._many_c(M, h, x, qkv, q, att, gu, act, logits, cos, sin, seqs, ns)
        for layers, n in zip(seqs, ns):
            for layer in layers:
                layer.set_length(n + 1)
        return logits

    def _many_c(self, M: int, h, x, qkv, q, att, gu, act, logits, cos, sin, seqs, ns) -> None:
        lib, attn = self._lib, self._attn
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        hidden, eps, inter, scale = self._h.numel(), self.eps, self.inter, D ** -0.5
        qkvp, qp, cosp, sinp = ([t.data_ptr() + i * t.stride(0) * 4 for i in range(M)]
                                for t in (qkv, q, cos, sin))  # each row's address; q: the rotated queries
        hp, xp, gup, actp = h.data_ptr(), x.data_ptr(), gu.data_ptr(), act.data_ptr()
        keys = [n + 1 for n in ns]  # each sequence's keys, with the token's own
        for li, lay in enumerate(self.layers):
            kv = [seqs[i][li].buffers for i in range(M)]
            lib.pc_rmsnorm_rows(hp, lay.norm1.data_ptr(), xp, M, hidden, eps)
            lay.qkv.gemv.raw_many(xp, qkv.data_ptr(), M)  # type: ignore[union-attr]
            for i, (kb, vb) in enumerate(kv):
                lib.pc_rope_write(qkvp[i], cosp[i], sinp[i], H, Hkv, D, qp[i], kb.data_ptr(), vb.data_ptr(),
                                  kb.stride(0), ns[i])
            attn.many(M, q.data_ptr(), q.stride(0), kv, keys, scale, att.data_ptr(), att.stride(0))
            lay.o.gemv.raw_many(att.data_ptr(), hp, M, True)  # type: ignore[union-attr]
            lib.pc_rmsnorm_rows(hp, lay.norm2.data_ptr(), xp, M, hidden, eps)
            lay.gate_up.gemv.raw_many(xp, gup, M)  # type: ignore[union-attr]
            lib.pc_silu_mul_rows(gup, actp, M, inter)
            lay.down.gemv.raw_many(actp, hp, M, True)  # type: ignore[union-attr]
        lib.pc_rmsnorm_rows(hp, self.norm.data_ptr(), xp, M, hidden, eps)
        self.head.gemv.raw_many(xp, logits.data_ptr(), M)  # type: ignore[union-attr]

    def _step_torch(self, bufs: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        G, half, inter = H // Hkv, D // 2, self.inter
        cos, sin, h = self._cos.repeat(2), self._sin.repeat(2), self._h  # (D,)
        for lay, (kb, vb) in zip(self.layers, bufs):
            qkv = lay.qkv(self._rms(h, lay.norm1), self._qkv)
            qk = qkv[: (H + Hkv) * D].view(H + Hkv, D)
            if lay.q_norm is not None:
                qk = torch.cat([self._rms(qk[:H], lay.q_norm), self._rms(qk[H:], lay.k_norm)])  # type: ignore[arg-type]
            qk = qk * cos + torch.cat((-qk[:, half:], qk[:, :half]), 1) * sin  # RoPE, HF half rotation
            kb[:, n].copy_(qk[H:])
            vb[:, n].copy_(qkv[(H + Hkv) * D :].view(Hkv, D))
            q = qk[:H].view(Hkv, G, D)
            p = torch.softmax(torch.matmul(q, kb[:, : n + 1].transpose(1, 2)) * D ** -0.5, -1)  # (Hkv, G, n + 1)
            lay.o(torch.matmul(p, vb[:, : n + 1]).view(H * D), h, add=True)
            gu = lay.gate_up(self._rms(h, lay.norm2), self._gu)  # (2 inter,)
            lay.down(torch.mul(F.silu(gu[:inter]), gu[inter:], out=self._act), h, add=True)
        self.head(self._rms(h, self.norm), self._logits)

    @torch.no_grad()
    def check(self, model: Any, adapter, tokenizer, steps: int = 4) -> float:
        """Decode ``steps`` tokens after :data:`CHECK_TEXT` with this step and with the stock
        step (the model's own fp32 weights), each over its own cache; returns the largest
        relative error of the logits, or raises :class:`UnsupportedStep` if it is over
        :data:`MAX_ERROR` or a top token differs."""
        from transformers.cache_utils import DynamicCache

        from ..kv import Workspace

        dev = self.embed.device
        ids = torch.tensor(tokenizer(CHECK_TEXT)["input_ids"], dtype=torch.long, device=dev)
        pos = torch.arange(ids.numel(), device=dev)
        s = adapter.kv_shape
        ws = Workspace(s.n_layers, s.n_kv_heads, s.head_dim, s.head_dim_v, torch.float32, dev, ids.numel() + steps)
        ours, stock = ws.cache(), DynamicCache()
        tok = int(adapter.forward(ids, pos, stock, None, None)[-1].argmax())
        adapter.forward(ids, pos, ours, None, None)
        worst = 0.0
        for p in range(ids.numel(), ids.numel() + steps):
            ref = adapter.forward(torch.tensor([tok], device=dev), torch.tensor([p], device=dev), stock, None, None)[-1]
            got = self(tok, p, ours.layers)
            err = float((got - ref).norm() / ref.norm().clamp(min=1e-12))
            worst = max(worst, err)
            if err > MAX_ERROR[self.fmt] or int(got.argmax()) != int(ref.argmax()):
                raise UnsupportedStep(f"the fused {self.fmt} step failed its self-check at token {p}: logits relative "
                                      f"error {err:.2e} (at most {MAX_ERROR[self.fmt]:g}), top token "
                                      f"{int(got.argmax())} vs {int(ref.argmax())}")
            tok = int(ref.argmax())
        return worst


def fused_step(model: Any, adapter, tokenizer, fmt: str = "fp32") -> tuple[FusedDecodeStep | None, str]:
    """A self-checked :class:`FusedDecodeStep` for ``model``, or ``(None, why)``."""
    try:
        step = FusedDecodeStep(model, adapter, fmt)
        err = step.check(model, adapter, tokenizer)
    except UnsupportedStep as e:
        return None, str(e)
    saved = share_decode_copies(model, step)
    log.info("fused %s decode step: %d layers, %.0f MB of weights a token, self-check error %.2e, %.0f MB of the "
             "batch step's decode weights shared with it", fmt, len(step.layers), step.nbytes / 1e6, err, saved / 1e6)
    return step, ""


def share_decode_copies(model: Any, step: FusedDecodeStep) -> int:
    """Point the batch step's decode weights (the :class:`~pcache_rag.models.fast_decode.DecodeLinear`
    copies an engine's ``decode_weights`` gave the model) at the fused step's row-major copies of
    the same values, so the model holds one bf16 (or int8) copy of its weights, not two; returns
    the bytes freed. Each layer's rows are compared first, and a layer whose rows differ, or
    whose step weights are prepacked for oneDNN, keeps its own."""
    from .fast_decode import DecodeLinear

    def adopt(mods: list, mv: Matvec) -> int:
        if mv.packed or mv.fmt == "fp32" or not all(isinstance(x, DecodeLinear) and x.fmt == mv.fmt for x in mods):
            return 0
        views, r = [], 0
        for x in mods:  # q|k|v (or gate|up) are consecutive rows of the fused matrix (N, K)
            w = mv.w[r : r + x.out_features]
            s = None if mv.scale is None else mv.scale[r : r + x.out_features]
            if w.shape != x._q.shape or not torch.equal(w, x._q) or (s is not None and not torch.equal(s, x._scale)):
                return 0
            views.append((w, s))
            r += x.out_features
        freed = 0
        for x, (w, s) in zip(mods, views):
            if x._q.data_ptr() != w.data_ptr():
                freed += x._q.numel() * x._q.element_size()
                x._q, x._scale = w, (s if s is not None else x._scale)
        return freed

    freed = 0
    for layer, lay in zip(model.model.layers, step.layers):
        a, m = layer.self_attn, layer.mlp
        freed += adopt([a.q_proj, a.k_proj, a.v_proj], lay.qkv) + adopt([a.o_proj], lay.o)
        freed += adopt([m.gate_proj, m.up_proj], lay.gate_up) + adopt([m.down_proj], lay.down)
    return freed + adopt([model.lm_head], step.head)


__all__ = ["STEP_FORMATS", "FusedDecodeStep", "Matvec", "UnsupportedStep", "fused_step", "share_decode_copies"]
