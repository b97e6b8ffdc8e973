"""One small adapter per positional-encoding family (rope, learned, alibi); ``auto`` picks one."""

from .auto import adapter_for
from .base import Adapter, KVShape, UnsupportedModelError

__all__ = ["Adapter", "KVShape", "UnsupportedModelError", "adapter_for"]
