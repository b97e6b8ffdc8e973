"""Keys that cannot lie: fingerprints of everything a unit's states depend on.

``model_fingerprint`` covers the model (config, parameter names/shapes/dtypes
and a sample of every parameter's values), the compute dtype, the tokenizer
(its full serialized vocabulary/merges and chat template), the positional
configuration, the encoding policy and the storage dtype. ``unit_key`` adds the
unit's token ids, position ids and the key of the context it attended to
(the preamble, in preamble mode). A cache directory written by another model,
dtype, tokenizer or policy therefore never matches, and a changed document
gets a new key.

Hashing every weight would take seconds for a 135M model and minutes for a 7B
one, so values are sampled: 64 evenly spaced elements of every parameter plus
its sum. A fine-tune or a re-quantization changes them; a single-element edit
to a weight could escape the sample, which is accepted and documented.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch


def _h() -> Any:  # a hashlib sha256 object (its type has no public name)
    return hashlib.sha256()


@torch.no_grad()
def model_fingerprint(model, tokenizer, encoding: str, store_dtype, extra: dict | None = None) -> str:
    h = _h()
    cfg = model.config.to_dict()
    for k in ("_name_or_path", "transformers_version", "_attn_implementation", "_attn_implementation_autoset",
              "dtype", "torch_dtype"):
        cfg.pop(k, None)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        n = flat.numel()
        idx = torch.arange(min(64, n)) * (n // min(64, n))  # evenly spaced, integer arithmetic
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(flat[idx].float().cpu().numpy().tobytes())
        h.update(repr(round(float(flat.float().sum()), 3)).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(repr(sorted(tokenizer.get_vocab().items())).encode() if hasattr(tokenizer, "get_vocab") else b"")
    h.update(repr(getattr(tokenizer, "chat_template", None)).encode())
    h.update(f"encoding={encoding};store={store_dtype};extra={json.dumps(extra or {}, sort_keys=True)}".encode())
    return h.hexdigest()


def unit_key(model_fp: str, token_ids, position_ids, context: str | None = None, kind: str = "unit") -> str:
    h = _h()
    h.update(model_fp.encode())
    h.update(kind.encode())
    h.update(torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().tobytes())
    h.update(b"|")
    h.update(torch.as_tensor(list(position_ids), dtype=torch.int64).numpy().tobytes())
    h.update(f"|ctx={context}".encode())
    return h.hexdigest()
