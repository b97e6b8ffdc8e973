"""One small adapter per positional-encoding family (rope, learned, alibi)."""

from .base import Adapter, KVShape, UnsupportedModelError, adapter_for

__all__ = ["Adapter", "KVShape", "UnsupportedModelError", "adapter_for"]
