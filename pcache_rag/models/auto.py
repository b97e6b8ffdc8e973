"""Choosing the adapter for a model: the one place that knows every family, so the
families import only ``base`` and nothing imports back (no cycle)."""

from __future__ import annotations

from .alibi import AlibiAdapter
from .base import Adapter, UnsupportedModelError
from .learned import LearnedAdapter
from .rope import RopeAdapter


def adapter_for(model) -> Adapter:
    """Pick the adapter for ``model`` by its positional encoding, or refuse clearly."""
    c = model.config
    mt = getattr(c, "model_type", "?")
    if has_sliding_window(c):
        raise UnsupportedModelError(
            f"{mt}: sliding-window attention layers are not supported (cached modules would be attended "
            "beyond the window). If every prompt fits in the window, load the model with "
            "sliding_window=None / use_sliding_window=False."
        )
    for cls in (RopeAdapter, LearnedAdapter, AlibiAdapter):
        if cls.matches(model):
            return cls(model)
    raise UnsupportedModelError(
        f"model type {mt!r} is not supported. pcache-rag supports rotary position models (Llama, Qwen2, "
        "Mistral, ...), learned absolute positions (GPT-2) and ALiBi (BLOOM, MPT)."
    )


def has_sliding_window(config) -> bool:
    """Whether the config has sliding-window (local) attention layers."""
    types = getattr(config, "layer_types", None)
    if types and any("sliding" in str(t) for t in types):
        return True
    sw = getattr(config, "sliding_window", None)
    if sw and getattr(config, "use_sliding_window", True):
        return True
    return False
