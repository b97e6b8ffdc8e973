"""Learned absolute positions (GPT-2): ``position_ids`` index the position table.

Gaps need nothing: a position id looks up its own row. The table's size
(``n_positions``) is the context limit the layout checks against.
"""

from __future__ import annotations

from .base import Adapter, use_fast_attention


class LearnedAdapter(Adapter):
    family = "learned"

    @staticmethod
    def matches(model) -> bool:
        base = getattr(model, "transformer", None)
        return base is not None and hasattr(base, "wpe")

    def __init__(self, model):
        super().__init__(model)
        self.max_positions = model.transformer.wpe.num_embeddings
        self.fast = use_fast_attention(model)
