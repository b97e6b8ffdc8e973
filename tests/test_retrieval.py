"""Hybrid retrieval (BM25 fused with the dense ranking) and the index's calibration.

* reciprocal rank fusion on known rankings;
* the dense ranking is exact (every stored vector, in every process alike) up to
  ``EXACT_MAX_CHUNKS``, and chroma's HNSW above it;
* a chunk that only an exact code identifies is found first by hybrid retrieval, and the
  lexical side follows every commit: this process's ingests and another instance's;
* ``calibrate`` measures candidates against full prefill on prompts drawn from the index,
  keeps its choice in the manifest for this model only, and answers use it.
"""

import json

import pytest

from pcache_rag.rag import CachedRAG
from pcache_rag.rag import lexical
from pcache_rag.rag.lexical import RRF_K, BM25Index, ExactDense, rrf

FILLER = ("The archive keeps records of shipments, invoices and letters from many years. Clerks file each "
          "record by date and by the name of the office that sent it.")


def test_rrf_on_known_rankings():
    got = rrf([["a", "b", "c"], ["c", "d"]])
    score = dict(got)
    assert score["c"] == pytest.approx(1 / (RRF_K + 3) + 1 / (RRF_K + 1))
    assert score["a"] == pytest.approx(1 / (RRF_K + 1))
    assert [cid for cid, _ in got][:2] == ["c", "a"]  # in both rankings beats first in one
    assert [cid for cid, _ in rrf([["x", "y"], ["y", "x"]])] == ["x", "y"]  # a tie keeps the first ranking's order


def test_bm25_rebuilds_per_generation():
    idx = BM25Index()
    idx.ensure(1, lambda: [("a", "red apples grow here"), ("b", "blue rivers run far")])
    assert [c for c, _ in idx.search("apples", 5)] == ["a"]
    assert idx.search("nothing matches", 5) == []
    idx.ensure(1, lambda: [("c", "apples")])  # same generation: not rebuilt
    assert [c for c, _ in idx.search("apples", 5)] == ["a"]
    idx.ensure(2, lambda: [("c", "apples")])
    assert [c for c, _ in idx.search("apples", 5)] == ["c"]


class _Vectors:
    """An index stand-in: ``count`` and ``embeddings`` (ids sorted, as ChromaIndex gives them)."""

    def __init__(self, ids, vecs):
        self.ids, self.vecs, self.loads = ids, vecs, 0

    def count(self):
        return len(self.ids)

    def embeddings(self):
        self.loads += 1
        return self.ids, self.vecs


def test_exact_dense_ranks_by_cosine_and_rebuilds_per_generation(monkeypatch):
    import numpy as np

    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((50, 8)).astype(np.float32) * rng.uniform(0.1, 9, (50, 1)).astype(np.float32)
    ids = [f"c{i:02d}" for i in range(50)]
    q = rng.standard_normal(8).astype(np.float32)
    cos = (vecs @ q) / (np.linalg.norm(vecs, axis=1) * np.linalg.norm(q))
    want = [ids[i] for i in np.argsort(-cos)[:7]]
    ex, idx = ExactDense(), _Vectors(ids, vecs)
    assert ex.ensure(1, idx)
    got = ex.search(q * 3.0, 7)  # the query's length does not matter
    assert [c for c, _ in got] == want
    assert [s for _, s in got] == pytest.approx(sorted(cos, reverse=True)[:7], abs=1e-5)
    ex.ensure(1, idx)
    assert idx.loads == 1  # same generation: not loaded again
    tie = ExactDense()
    tie.ensure(0, _Vectors(["a", "b", "c"], np.ones((3, 2), dtype=np.float32)))
    assert [c for c, _ in tie.search([1.0, 1.0], 3)] == ["a", "b", "c"]  # ties in id order
    empty = ExactDense()
    assert empty.ensure(0, _Vectors([], np.zeros((0, 0), dtype=np.float32))) and empty.search(q, 3) == []
    monkeypatch.setattr(lexical, "EXACT_MAX_CHUNKS", 49)
    assert not ex.ensure(2, idx) and ex.search(q, 3) == []  # too many chunks: chroma's HNSW serves them


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(6):
        (d / f"note-{i}.txt").write_text(f"{FILLER} Shelf {i} holds the winter ledgers.")
    (d / "code.txt").write_text(f"{FILLER} The vault code is QX-7741-ZB.")
    return d


def test_hybrid_finds_the_exact_code_and_follows_commits(smol, tmp_path, corpus, monkeypatch):
    rag = CachedRAG(tmp_path / "index", pc=smol, k=2, chunk_tokens=64)
    q = "Which record mentions QX-7741-ZB?"
    assert rag.retrieve(q, k=1) == []  # an empty index: nothing to rank, no error
    rag.ingest([corpus], progress=False, encode="lazy")
    top = rag.retrieve(q, k=1)[0]
    assert top.source.endswith("code.txt") and top.metadata["bm25"] > 0 and rag.retrieval == "hybrid"
    # a request checked at the edge (the server's) brings its own question and k
    from pcache_rag.request import AnswerRequest

    req = AnswerRequest(question=q, k=2)
    assert [h.id for h in rag.retrieve(req)] == [h.id for h in rag.retrieve(q, k=2)]
    with pytest.raises(ValueError, match="give k in it"):
        rag.retrieve(req, k=1)
    # this process's own ingest: the new file is searchable at once
    (corpus / "late.txt").write_text("Inventory number ZZ-0099-KL belongs to the harbour office.")
    rag.ingest([corpus], progress=False, encode="lazy")
    assert rag.retrieve("Who has ZZ-0099-KL?", k=1)[0].source.endswith("late.txt")
    # another instance commits: this one sees it at its next question
    other = CachedRAG(tmp_path / "index", pc=smol, k=2, chunk_tokens=64)
    (corpus / "later.txt").write_text("Crate MM-5512-QA went to the northern depot.")
    other.ingest([corpus], progress=False, encode="lazy")
    assert rag.retrieve("Where did MM-5512-QA go?", k=1)[0].source.endswith("later.txt")
    dense = CachedRAG(tmp_path / "index", pc=smol, k=2, retrieval="dense")
    assert all("bm25" not in h.metadata for h in dense.retrieve(q, k=2))
    # the dense ranking is exact: every stored vector by cosine, the same as brute force
    import numpy as np

    ids, vecs = dense.index.embeddings()
    qv = np.asarray(dense.embedder.embed([q])[0], dtype=np.float32)
    cos = (vecs @ qv) / (np.linalg.norm(vecs, axis=1) * np.linalg.norm(qv))
    got = dense.retrieve(q, k=len(ids))
    assert [h.id for h in got] == [ids[i] for i in np.argsort(-cos, kind="stable")]
    assert [h.score for h in got] == pytest.approx(sorted(cos, reverse=True), abs=1e-5)

    def hnsw(*a, **kw):
        raise AssertionError("chroma's HNSW was asked")

    monkeypatch.setattr(type(dense.index), "query", hnsw)
    assert len(dense.retrieve(q, k=2)) == 2 and len(rag.retrieve(q, k=2)) == 2  # exact: chroma's query unused
    monkeypatch.setattr(lexical, "EXACT_MAX_CHUNKS", 0)
    with pytest.raises(AssertionError, match="HNSW was asked"):  # above the limit, chroma ranks
        CachedRAG(tmp_path / "index", pc=smol, k=2, retrieval="dense").retrieve(q, k=2)
    with pytest.raises(ValueError, match="retrieval must be one of"):
        CachedRAG(tmp_path / "index", pc=smol, retrieval="sparse")


def test_calibrate_saves_for_this_model_and_answers_use_it(smol, tmp_path, corpus, monkeypatch):
    rag = CachedRAG(tmp_path / "index", pc=smol, k=2, chunk_tokens=64)
    rag.ingest([corpus], progress=False)
    assert rag.calibration == (None, "none: the index was not calibrated")
    rep = rag.calibrate(n=2, k=2, progress=False, grid=((0.9, 0.9), (0.7, 1.1)))
    assert rep.prompts == 2 and set(rep.kl) == {"none", "ape:0.9:0.9", "ape:0.7:1.1"}
    assert all(v >= 0 for v in rep.kl.values()) and rep.chosen == min(rep.kl, key=rep.kl.get)
    saved = json.loads((tmp_path / "index" / "pcache-index.json").read_text())["calibration"]
    assert saved["attention"] == rep.chosen and saved["fingerprint"] == smol.fingerprint
    # a fresh instance reads it, and an ingest keeps it
    fresh = CachedRAG(tmp_path / "index", pc=smol, k=2)
    (corpus / "extra.txt").write_text("One more note about the ledgers.")
    fresh.ingest([corpus], progress=False)
    assert json.loads((tmp_path / "index" / "pcache-index.json").read_text())["calibration"] == saved
    want = None if rep.chosen == "none" else rep.chosen
    assert fresh.calibration[0] == want and (want is None or fresh.calibration[1].startswith("the index's"))
    # answers pass it to the engine (forced here to a calibration, whatever was chosen)
    seen = {}
    real = smol.generate

    def spy(prompt, **kw):
        seen.update(kw, calibration=prompt.calibration)
        return real(prompt, **kw)

    monkeypatch.setattr(smol, "generate", spy)
    forced = CachedRAG(tmp_path / "index", pc=smol, k=2, calibration="ape:0.9:0.9")
    assert forced.calibration == ("ape:0.9:0.9", "given")
    forced.answer("What is the vault code?", max_new_tokens=2)
    assert seen["calibration"] == "ape:0.9:0.9"
    forced.answer("What is the vault code?", max_new_tokens=2, recompute="epic:2")  # does not combine: dropped
    assert seen["calibration"] is None and seen["recompute"] == "epic:2"
    # another model's calibration is not used
    data = json.loads((tmp_path / "index" / "pcache-index.json").read_text())
    data["calibration"]["fingerprint"] = "another-model"
    (tmp_path / "index" / "pcache-index.json").write_text(json.dumps(data))
    assert CachedRAG(tmp_path / "index", pc=smol, k=2).calibration == (
        None, "none: the index was calibrated for another model or settings")
    with pytest.raises(ValueError, match="ape:T:S"):
        CachedRAG(tmp_path / "index", pc=smol, calibration="hot")
