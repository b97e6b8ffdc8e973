"""Choosing the adapter for a model: the one place that knows every family, so the
families import only ``base`` and nothing imports back (no cycle)."""

from __future__ import annotations

from .alibi import AlibiAdapter
from .base import Adapter, UnsupportedModelError, sliding_window
from .learned import LearnedAdapter
from .rope import RopeAdapter


def adapter_for(model) -> Adapter:
    """Pick the adapter for ``model`` by its positional encoding, or refuse clearly."""
    c = model.config
    mt = getattr(c, "model_type", "?")
    refusal = attention_refusal(c)
    if refusal:
        raise UnsupportedModelError(f"{mt}: {refusal}")
    for cls in (RopeAdapter, LearnedAdapter, AlibiAdapter):
        if cls.matches(model):
            if sliding_window(c) is not None and cls is not RopeAdapter:
                raise UnsupportedModelError(f"{mt}: sliding-window layers are served for rotary models only")
            return cls(model)
    raise UnsupportedModelError(
        f"model type {mt!r} is not supported. pcache-rag supports rotary position models (Llama, Qwen2, "
        "Mistral, ...), learned absolute positions (GPT-2) and ALiBi (BLOOM, MPT)."
    )


#: the layer types pcache_sdpa serves exactly (global causal, and local with a window)
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_refusal(config) -> str:
    """Why the config's attention cannot be cached exactly ('' when it can): layer kinds other
    than global and sliding-window attention, or attention that sees later tokens."""
    types = getattr(config, "layer_types", None) or ()
    odd = sorted({str(t) for t in types} - set(SERVED_LAYER_TYPES))
    if odd:
        return (f"layer types {odd} are not supported (pcache-rag serves {', '.join(SERVED_LAYER_TYPES)}); "
                "their states cannot be cached and assembled exactly")
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (an encoder) sees later tokens, so no unit's states can be cached alone"
    if getattr(config, "attention_chunk_size", None):
        return "chunked attention is not supported (its chunks are counted over absolute positions)"
    return ""
