"""The chroma side of the index: chunk text, metadata, embeddings and module ids.

Embedded ``PersistentClient`` by default, or a chroma server's URL
(``HttpClient``). Embeddings are computed by pcache-rag and passed in, so
chroma never loads (or downloads) an embedding model of its own.

Chroma holds the index itself (there is nothing to re-encode it from), so a
damaged ``chroma.sqlite3`` is not healed silently: opening it raises
:class:`IndexDamagedError`, which names the file and says to re-ingest; an
ingest moves the damaged folder aside and rebuilds it from the documents.
Chroma rebuilds its HNSW files from its own log when they are damaged, which
``tests/test_index_integrity.py`` checks.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

COLLECTION = "pcache-chunks"


class IndexDamagedError(RuntimeError):
    """The chroma database of an index cannot be read."""

    def __init__(self, path: Path, reason: str):
        self.path = path
        super().__init__(
            f"the index database {path} is damaged ({reason}); rebuild it with "
            f"`pcache-rag ingest PATH... --index {path.parent.parent}` (the damaged copy is kept aside)"
        )


def _check_sqlite(db: Path) -> None:
    """:class:`IndexDamagedError` unless SQLite's quick check says ``ok``. Any failure to open
    or read the file is damage, whatever its message: a flipped byte in the schema text
    makes SQLite's own error text undecodable, so results are read as bytes."""
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    except Exception as e:  # noqa: BLE001 - sqlite3 raises several kinds for a damaged file
        raise IndexDamagedError(db, _reason(e)) from None
    try:
        con.text_factory = bytes
        res = con.execute("PRAGMA quick_check").fetchone()
    except sqlite3.OperationalError as e:
        if "locked" in str(e).lower() or "busy" in str(e).lower():
            raise  # another process is writing: not damage
        raise IndexDamagedError(db, _reason(e)) from None
    except Exception as e:  # noqa: BLE001
        raise IndexDamagedError(db, _reason(e)) from None
    finally:
        con.close()
    if not res or res[0] != b"ok":
        shown = res[0].decode("utf-8", "backslashreplace")[:200] if res else "no answer"
        raise IndexDamagedError(db, f"integrity check: {shown}")


def _reason(e: BaseException) -> str:
    """An exception as text that is always printable (its message may hold damaged bytes)."""
    return f"{type(e).__name__}: {e}".encode("utf-8", "backslashreplace").decode("utf-8")


class ChromaIndex:
    def __init__(self, path: str | Path, url: str | None = None, collection: str = COLLECTION):
        import chromadb

        settings = chromadb.Settings(anonymized_telemetry=False)
        self.path = Path(path)
        self.db = None if url else self.path / "chroma.sqlite3"
        if url:
            from urllib.parse import urlparse

            u = urlparse(url)
            self.client = chromadb.HttpClient(host=u.hostname or "localhost", port=u.port or 8000,
                                              ssl=u.scheme == "https", settings=settings)
        else:
            if self.db.exists():
                _check_sqlite(self.db)
            try:
                # chroma caches one client per path in the process: a folder replaced on disk
                # (rebuilt after damage) must not be served from the old one
                from chromadb.api.shared_system_client import SharedSystemClient

                SharedSystemClient._identifier_to_system.pop(str(self.path), None)
            except Exception:  # noqa: BLE001 - an internal that moved: at worst the cached client is reused
                pass
            try:
                self.client = chromadb.PersistentClient(path=str(path), settings=settings)
            except Exception as e:  # noqa: BLE001 - chroma raises its own InternalError types
                raise IndexDamagedError(self.db, _reason(e)) from None
        try:
            self.col = self.client.get_or_create_collection(
                collection, embedding_function=None, metadata={"hnsw:space": "cosine"}
            )
        except Exception as e:  # noqa: BLE001
            if self.db is None:
                raise
            raise IndexDamagedError(self.db, _reason(e)) from None

    def delete_where_source(self, source: str) -> list[str]:
        """Delete every chunk of ``source`` (whatever version); returns their kv keys."""
        got = self.col.get(where={"source": source}, include=["metadatas"])
        if got["ids"]:
            self.col.delete(ids=got["ids"])
        return [m["kv_key"] for m in got["metadatas"]]

    def referenced(self, kv_keys) -> set[str]:
        """Those of ``kv_keys`` that some chunk still uses."""
        keys = list(set(kv_keys))
        out: set[str] = set()
        for i in range(0, len(keys), 500):
            got = self.col.get(where={"kv_key": {"$in": keys[i : i + 500]}}, include=["metadatas"])
            out.update(m["kv_key"] for m in got["metadatas"])
        return out

    def chunks(self) -> list[tuple[str, dict]]:
        """``[(id, metadata)]`` of every chunk."""
        got = self.col.get(include=["metadatas"])
        return list(zip(got["ids"], got["metadatas"]))

    def add(self, ids, embeddings, documents, metadatas) -> None:
        for i in range(0, len(ids), 1000):  # stay under chroma's batch limit
            s = slice(i, i + 1000)
            self.col.upsert(ids=ids[s], embeddings=embeddings[s], documents=documents[s], metadatas=metadatas[s])

    def update_metadata(self, ids: list[str], metadatas: list[dict]) -> None:
        for i in range(0, len(ids), 1000):
            self.col.update(ids=ids[i : i + 1000], metadatas=metadatas[i : i + 1000])

    def delete(self, ids) -> None:
        if ids:
            self.col.delete(ids=list(ids))

    def sources(self) -> dict[str, tuple[set[str], list[str], list[str]]]:
        """source -> (shas, chunk ids, kv keys) of everything indexed. More than one sha means
        versions of a file were left side by side (an ingest that must reconcile it)."""
        got = self.col.get(include=["metadatas"])
        out: dict[str, tuple[set[str], list[str], list[str]]] = {}
        for cid, m in zip(got["ids"], got["metadatas"]):
            shas, ids, keys = out.setdefault(m["source"], (set(), [], []))
            shas.add(m["sha"])
            ids.append(cid)
            keys.append(m["kv_key"])
        return out

    def keys(self) -> dict[str, str]:
        got = self.col.get(include=["metadatas"])
        return {cid: m["kv_key"] for cid, m in zip(got["ids"], got["metadatas"])}

    def count(self) -> int:
        return self.col.count()

    def texts(self) -> list[tuple[str, str]]:
        """``[(id, text)]`` of every chunk (what the lexical index is built from)."""
        got = self.col.get(include=["documents"])
        return list(zip(got["ids"], got["documents"]))

    def embeddings(self):
        """``(ids, vectors)`` of every chunk: ids sorted, vectors (n, d) float32 in that order
        (what the exact dense ranking is built from)."""
        import numpy as np

        got = self.col.get(include=["embeddings"])
        ids = list(got["ids"])
        if not ids:
            return [], np.zeros((0, 0), dtype=np.float32)
        vecs = np.asarray(got["embeddings"], dtype=np.float32).reshape(len(ids), -1)  # (n, d)
        order = sorted(range(len(ids)), key=ids.__getitem__)
        return [ids[i] for i in order], vecs[order]

    def get(self, ids: list[str]) -> dict[str, tuple[str, dict]]:
        """``{id: (text, metadata)}`` of those of ``ids`` that exist."""
        if not ids:
            return {}
        got = self.col.get(ids=list(ids), include=["documents", "metadatas"])
        return {cid: (doc, meta) for cid, doc, meta in zip(got["ids"], got["documents"], got["metadatas"])
                if doc is not None and meta is not None}

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
