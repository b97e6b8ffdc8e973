"""Decode-step linear layers in fewer bytes: the generated tokens' projections read int8 or
bf16 copies of the weights, while every prompt token (prefill, encoding, recompute) keeps the
model's own fp32 weights, unless an engine's ``query_weights="bf16"`` gives the rows computed
over cached states the bf16 copies too (:mod:`pcache_rag.engine.prefill`). These layers serve the steps that run through the model's own
forward (a continuous batch of several sequences, models the fused step does not compute);
a stream decoding alone takes :mod:`.decode_step` in the same format, with the same rounding.

Why: on a CPU a decode step is one token, so each linear layer is a matrix-vector product
whose time is the time to stream its weights from memory. The embedded 135M model streams
540 MB of fp32 weights a token; the same weights as int8 with one bf16 scale per output row
are 135 MB, and PyTorch's ``aten._weight_int8pack_mm`` (the weight-only int8 kernel torchao
and gpt-fast use on CPU) reads them directly. Measured on this 2-core machine, every linear
layer of one token: fp32 ``F.linear`` 61 ms, bf16 34 ms, int8 15 ms.

Which rows use them is said by the caller, not guessed from shapes: :func:`decoding` marks a
forward's generated-token rows (all rows of a solo decode step; the first rows of a batch step,
where prompt chunks follow), so a 3-token prompt is still prefilled in fp32 and a request
decodes with the same weights alone or in a batch. Outside :func:`decoding` the layers are
the model's own.

Refused by name, never silently degraded: :func:`use_decode_weights` checks the kernel exists
on the model's device and compares the decode path's logits with the fp32 path's on a fixed
prompt at load (relative error and the top token); a model that fails keeps fp32 and says why.

The replacement layers hold the model's own ``weight`` and ``bias`` parameters (so tied
embeddings stay tied and the state dict, hence the model fingerprint, is unchanged); the small
copies are plain attributes, not buffers.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

#: the decode-weight formats: int8 weight-only (per output row scales), or bf16
DECODE_WEIGHTS = ("int8", "bf16")
#: the RAG stack's default (an index's engine, the connectors' shared engines, the CLI): bf16
#: decodes 1.7x faster than the fp32 step and answered the eval's reporting split as fp32 did
#: (4 sets x 100 questions: accuracy within a point, McNemar p >= 0.5, 90% of answers identical;
#: docs/runs/2026-12-04-fused-decode.md). A bare PromptCache keeps fp32 unless asked.
RAG_DECODE_WEIGHTS = "bf16"
#: the RAG stack's rows computed over cached states (new tokens, recomputed rows) read the same
#: bf16 weights (an engine's ``query_weights``; :mod:`pcache_rag.engine.prefill`)
RAG_QUERY_WEIGHTS = "bf16"
#: the self-check's bounds: the decode path's logits against fp32's on a fixed prompt
MAX_REL_ERROR = 0.05
#: the self-check's prompt
CHECK_TEXT = "The ferry leaves the harbour at dawn, and the archive opens at nine."

_local = threading.local()


@contextmanager
def decoding(rows: int | None = None, head: int | None = None):
    """Inside: the linear layers compute generated-token rows with the decode weights; ``rows``
    is how many leading token rows those are (None: all of them, a solo decode step). ``head``:
    how many leading rows of the output head's product (the logits of each sequence's last token)
    read them, None for the same as ``rows``. The head's product for one sequence is a
    matrix-vector product that streams its weights, so its bf16 copy is faster on any CPU
    (49,152 x 576: 11 ms in fp32 against 2.4 ms in bf16 on this CPU capped to AVX2), where products
    of many rows are compute-bound and 4-5x slower in bf16 without bf16 dot-product instructions."""
    prev = getattr(_local, "rows", False), getattr(_local, "head", None)
    _local.rows, _local.head = rows, head
    try:
        yield
    finally:
        _local.rows, _local.head = prev


class DecodeLinear(torch.nn.Module):
    """An ``nn.Linear`` whose generated-token rows read int8 or bf16 weights (see the module
    docstring); prompt rows read the original fp32 ``weight``."""

    def __init__(self, lin: torch.nn.Linear, fmt: str) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight = lin.weight  # the model's own parameter (tied embeddings stay tied)
        self.bias = lin.bias
        w = lin.weight.detach().float()  # (N, K)
        self.fmt = fmt
        #: the model's output head (:func:`decoding`'s ``head`` rows; set by :func:`use_decode_weights`)
        self.head = False
        self._scale: torch.Tensor | None
        if fmt == "int8":  # symmetric, one scale per output row
            scale = (w.abs().amax(1) / 127).clamp(min=1e-8)
            self._q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
            self._scale = scale.to(torch.bfloat16)  # (N,)
        else:
            self._q = w.to(torch.bfloat16)  # (N, K)
            self._scale = None

    def small(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (M, K) through the decode weights; returns (M, N) in ``x``'s dtype."""
        xb = x.to(torch.bfloat16)
        if self._scale is not None:
            y = torch.ops.aten._weight_int8pack_mm(xb, self._q, self._scale)
        else:
            y = F.linear(xb, self._q)
        y = y.to(x.dtype)
        return y + self.bias if self.bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., T, K)
        rows = getattr(_local, "rows", False)
        if self.head and rows is not False and _local.head is not None:
            rows = _local.head
        if rows is False or rows == 0:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1])  # (M, K)
        if rows is None or rows >= flat.shape[0]:
            return self.small(flat).reshape(*x.shape[:-1], self.out_features)
        out = F.linear(flat[rows:], self.weight, self.bias)
        return torch.cat([self.small(flat[:rows]), out]).reshape(*x.shape[:-1], self.out_features)


@dataclass(frozen=True, slots=True)
class DecodeWeightsReport:
    """What :func:`use_decode_weights` did: the format in force (None: fp32 kept), the layers
    replaced, their bytes before and after, the self-check's error, and why it was refused."""

    fmt: str | None
    layers: int = 0
    fp32_bytes: int = 0
    small_bytes: int = 0
    rel_error: float | None = None
    refused: str = ""


def installed_format(model: torch.nn.Module) -> str | None:
    """The decode-weight format already given to ``model``'s layers (by an earlier
    :func:`use_decode_weights`), or None."""
    return next((m.fmt for m in model.modules() if isinstance(m, DecodeLinear)), None)


def _linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """Every ``nn.Linear`` of the model as ``(parent, attribute, layer)``."""
    out = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is torch.nn.Linear:
                out.append((parent, name, child))
    return out


def use_decode_weights(model: torch.nn.Module, fmt: str, tokenizer) -> DecodeWeightsReport:
    """Give ``model``'s linear layers ``fmt`` (:data:`DECODE_WEIGHTS`) decode weights, after a
    self-check on :data:`CHECK_TEXT` (by ``tokenizer``): the logits of every position computed through
    the decode weights against fp32's, within :data:`MAX_REL_ERROR` and with the same top token
    at the last position. A format the device cannot run, or one that fails the check, is
    refused: the model keeps fp32, the report says why and a warning is logged."""
    if fmt not in DECODE_WEIGHTS:
        raise ValueError(f"decode_weights must be one of {DECODE_WEIGHTS} or None, not {fmt!r}")
    found = _linears(model)
    if (have := installed_format(model)) is not None:
        if have == fmt:
            return DecodeWeightsReport(fmt, refused="")  # an earlier engine gave the model these very layers
        return DecodeWeightsReport(None, refused=f"the model's layers already carry {have} decode weights")
    if not found:
        return DecodeWeightsReport(None, refused="the model has no nn.Linear layers to replace")
    w = found[0][2].weight
    if w.dtype != torch.float32:
        return DecodeWeightsReport(None, refused=f"the model's weights are {w.dtype}, not float32: they are small "
                                                 "already")
    try:
        probe = DecodeLinear(found[0][2], fmt)
        probe.small(torch.zeros(1, probe.in_features, device=w.device))
    except (RuntimeError, NotImplementedError) as e:
        why = f"{fmt} decode weights cannot run on {w.device}: {str(e).splitlines()[0]}"
        log.warning("decode weights refused, fp32 kept: %s", why)
        return DecodeWeightsReport(None, refused=why)
    swapped = []
    get_head = getattr(model, "get_output_embeddings", None)  # a transformers model's; a bare module has none
    out_head = get_head() if callable(get_head) else None
    for parent, name, lin in found:
        new = DecodeLinear(lin, fmt)
        new.head = lin is out_head
        setattr(parent, name, new)
        swapped.append((parent, name, lin, new))
    ids = torch.tensor([tokenizer(CHECK_TEXT)["input_ids"]], dtype=torch.long, device=w.device)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits[0].float()  # (T, vocab)
        with decoding():
            got = model(input_ids=ids, use_cache=False).logits[0].float()
    err = float((got - ref).norm() / ref.norm().clamp(min=1e-12))
    same_top = int(got[-1].argmax()) == int(ref[-1].argmax())
    fp32_bytes = sum(lin.weight.numel() * 4 for _, _, lin, _ in swapped)
    small = sum(n._q.numel() * n._q.element_size() + (0 if n._scale is None else n._scale.numel() * 2)
                for _, _, _, n in swapped)
    if err > MAX_REL_ERROR or not same_top:
        for parent, name, lin, _ in swapped:
            setattr(parent, name, lin)
        why = (f"{fmt} decode weights failed the self-check: logits relative error {err:.4f} (at most "
               f"{MAX_REL_ERROR}), same top token: {same_top}")
        log.warning("decode weights refused, fp32 kept: %s", why)
        return DecodeWeightsReport(None, rel_error=err, refused=why)
    log.info("decode weights: %s for %d linear layers (%.0f MB -> %.0f MB a token), self-check error %.4f",
             fmt, len(swapped), fp32_bytes / 1e6, small / 1e6, err)
    return DecodeWeightsReport(fmt, len(swapped), fp32_bytes, small, err)


__all__ = ["DECODE_WEIGHTS", "RAG_DECODE_WEIGHTS", "RAG_QUERY_WEIGHTS", "DecodeLinear", "DecodeWeightsReport", "decoding", "installed_format",
           "use_decode_weights"]
