"""The chroma side of the index: chunk text, metadata, embeddings and module ids.

Embedded ``PersistentClient`` by default, or a chroma server's URL
(``HttpClient``). Embeddings are computed by pcache-rag and passed in, so
chroma never loads (or downloads) an embedding model of its own.
"""

from __future__ import annotations

from pathlib import Path

COLLECTION = "pcache-chunks"


class ChromaIndex:
    def __init__(self, path: str | Path, url: str | None = None, collection: str = COLLECTION):
        import chromadb

        settings = chromadb.Settings(anonymized_telemetry=False)
        if url:
            from urllib.parse import urlparse

            u = urlparse(url)
            self.client = chromadb.HttpClient(host=u.hostname or "localhost", port=u.port or 8000,
                                              ssl=u.scheme == "https", settings=settings)
        else:
            self.client = chromadb.PersistentClient(path=str(path), settings=settings)
        self.col = self.client.get_or_create_collection(
            collection, embedding_function=None, metadata={"hnsw:space": "cosine"}
        )

    def add(self, ids, embeddings, documents, metadatas) -> None:
        for i in range(0, len(ids), 1000):  # stay under chroma's batch limit
            s = slice(i, i + 1000)
            self.col.upsert(ids=ids[s], embeddings=embeddings[s], documents=documents[s], metadatas=metadatas[s])

    def delete(self, ids) -> None:
        if ids:
            self.col.delete(ids=list(ids))

    def sources(self) -> dict[str, tuple[str, list[str], list[str]]]:
        """source -> (sha, chunk ids, kv keys) of everything indexed."""
        got = self.col.get(include=["metadatas"])
        out: dict[str, tuple[str, list[str], list[str]]] = {}
        for cid, m in zip(got["ids"], got["metadatas"]):
            sha, ids, keys = out.setdefault(m["source"], (m["sha"], [], []))
            ids.append(cid)
            keys.append(m["kv_key"])
        return out

    def keys(self) -> dict[str, str]:
        got = self.col.get(include=["metadatas"])
        return {cid: m["kv_key"] for cid, m in zip(got["ids"], got["metadatas"])}

    def count(self) -> int:
        return self.col.count()

    def query(self, embedding, k: int):
        """``[(id, similarity, document, metadata)]``, closest first."""
        n = min(k, self.count())
        if n == 0:
            return []
        r = self.col.query(query_embeddings=[embedding], n_results=n, include=["documents", "metadatas", "distances"])
        return [
            (cid, 1.0 - float(d), doc, meta)
            for cid, d, doc, meta in zip(r["ids"][0], r["distances"][0], r["documents"][0], r["metadatas"][0])
        ]
