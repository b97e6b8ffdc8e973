"""A learned prefix installed for a model (``$PCACHE_RAG_HOME/learned``, where
``pcache-rag install-prefix`` writes it, or bundled in ``pcache_rag/data/learned``) is the RAG
default for that model: the content-addressed path, a new CachedRAG index (which keeps its own copy) and a
PML schema that opts in with ``conditioning="learned"``. Other models keep the neutral passage;
a schema that asks for a prefix its model has none of is refused by name. Checked on a tiny
random model with a prefix written to a temporary ``$PCACHE_RAG_HOME``."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from helpers import tiny_model
from pcache_rag import PromptCache
from pcache_rag import conditioning
from pcache_rag.conditioning import LearnedPrefix, installed_dir, installed_prefix
from pcache_rag.docmodules import MIN_CONDITIONED_TOKENS, Assembler
from pcache_rag.pml import PMLError, escape
from pcache_rag.rag.learned import initial_embeds


@pytest.fixture(scope="module")
def pc(smol_tok):
    model = tiny_model("llama", len(smol_tok), seed=5)
    with torch.no_grad():  # sharper attention: what a module is encoded after shows in its states
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(4.0)
    return PromptCache(model, smol_tok, store_dtype=torch.float32)


def _nothing_installed(monkeypatch, tmp_path):
    monkeypatch.setenv("PCACHE_RAG_HOME", str(tmp_path / "a home with nothing installed"))
    monkeypatch.setattr(conditioning, "PACKAGED_DIR", tmp_path / "nothing bundled")


@pytest.fixture
def installed(pc, tmp_path, monkeypatch):
    """A prefix installed for ``pc``'s model (and one for another model beside it)."""
    monkeypatch.setenv("PCACHE_RAG_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(conditioning, "PACKAGED_DIR", tmp_path / "nothing bundled")
    folder = installed_dir()
    assert folder == tmp_path / "home" / "learned"
    prefix = LearnedPrefix(initial_embeds(pc)[:20] + 0.05, {"fingerprint": pc.fingerprint, "model": "tiny"})
    prefix.save(folder / "tiny.safetensors")
    LearnedPrefix(initial_embeds(pc)[:20], {"fingerprint": "another model"}).save(folder / "another.safetensors")
    return prefix


DOC = "The north gate opens at dawn and the archive keeps its maps in the basement. " * 4


def test_an_installed_prefix_is_found_by_its_models_fingerprint(pc, installed, tmp_path, monkeypatch, caplog):
    got = installed_prefix(pc.fingerprint)
    assert got is not None and got.spec == installed.spec and torch.equal(got.embeds, installed.embeds)
    assert installed_prefix("no such model") is None
    assert installed_prefix(pc.fingerprint, tmp_path / "empty") is None
    # a prefix a distribution bundles in the package is found too
    _nothing_installed(monkeypatch, tmp_path)
    assert installed_prefix(pc.fingerprint) is None
    bundled = tmp_path / "bundled"
    installed.save(bundled / "tiny.safetensors")
    monkeypatch.setattr(conditioning, "PACKAGED_DIR", bundled)
    assert installed_prefix(pc.fingerprint).spec == installed.spec
    # a damaged file beside it is skipped with a warning that names it, not an error at every default
    (bundled / "a-broken.safetensors").write_bytes(b"not a tensor file")
    conditioning._installed.cache_clear()
    with caplog.at_level(logging.WARNING, logger="pcache_rag.conditioning"):
        assert installed_prefix(pc.fingerprint).spec == installed.spec
    assert "a-broken.safetensors" in caplog.text and "not a readable learned prefix" in caplog.text


def test_the_default_conditioning_is_the_installed_prefix(pc, installed, smol_tok):
    asm = Assembler(pc)
    assert asm.prefix is not None and asm.conditioning == installed.spec
    explicit = Assembler(pc, prefix=installed)
    ids = asm.doc_ids(DOC)
    assert len(ids) >= MIN_CONDITIONED_TOKENS
    assert asm.key(ids) == explicit.key(ids)
    assert torch.equal(asm.encode_ids(ids, store=False).values, explicit.encode_ids(ids, store=False).values)
    neutral = Assembler(pc, conditioning="neutral")
    assert neutral.key(ids) != asm.key(ids)
    # asked for by name, a neutral passage or none is still what is used
    assert Assembler(pc, conditioning="none").conditioning == "none" and neutral.conditioning == "neutral:1"
    # another model (no prefix installed for it) keeps the neutral passage
    other = PromptCache(tiny_model("qwen2", len(smol_tok), seed=6), smol_tok, store_dtype=torch.float32)
    assert Assembler(other).conditioning == "neutral:1"
    # an engine that cannot encode after a prefix keeps the neutral passage (ALiBi: token ids only)
    bloom = PromptCache(tiny_model("bloom", len(smol_tok)), smol_tok, store_dtype=torch.float32)
    assert Assembler(bloom).conditioning == "neutral:1"


def test_a_new_index_keeps_a_copy_of_the_installed_prefix(pc, installed, tmp_path, monkeypatch, caplog):
    from pcache_rag.rag import CachedRAG
    from pcache_rag.rag.index_dir import prefix_path

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "gate.txt").write_text(DOC + "The winter ledgers are on shelf four.")
    rag = CachedRAG(tmp_path / "index", pc=pc, k=1, chunk_tokens=128)
    rag.ingest([docs], progress=False)
    assert rag.manifest["conditioning"] == installed.spec == rag.asm.conditioning
    assert prefix_path(rag.index_dir, installed.spec).exists()
    # the index reads its own copy: installing another prefix later does not move it
    home = os.environ["PCACHE_RAG_HOME"]
    _nothing_installed(monkeypatch, tmp_path)
    again = CachedRAG(tmp_path / "index", pc=pc, k=1, create=False)
    assert again.asm.conditioning == installed.spec
    h = again.retrieve("Which shelf holds the winter ledgers?", prefetch=False)[0]
    assert h.kv_key == Assembler(pc, prefix=installed).key(again.chunks.ids(h.text, h.source))
    # a damaged or missing copy of an installed prefix is restored from the installed file, with a warning
    monkeypatch.setenv("PCACHE_RAG_HOME", home)
    copy = prefix_path(rag.index_dir, installed.spec)
    for damage in ("flip", "delete"):
        if damage == "flip":
            data = bytearray(copy.read_bytes())
            data[len(data) // 2] ^= 0xFF
            copy.write_bytes(bytes(data))
        else:
            copy.unlink()
        with caplog.at_level(logging.WARNING, logger="pcache_rag.rag.pipeline"):
            back = CachedRAG(tmp_path / "index", pc=pc, k=1, create=False)
        assert back.asm.conditioning == installed.spec and "restored from the prefix installed" in caplog.text
        assert LearnedPrefix.load(copy).spec == installed.spec
        caplog.clear()
    # a prefix that is not installed stays a clear error when its copy is gone
    _nothing_installed(monkeypatch, tmp_path)
    copy.unlink()
    with pytest.raises(FileNotFoundError, match="its prefix"):
        CachedRAG(tmp_path / "index", pc=pc, k=1, create=False)


def _schema(pc, cond: str) -> str:
    attr = f' conditioning="{cond}"' if cond else ""
    return (f'<schema name="s{abs(hash(cond)) % 1000}"{attr}><system>Answer from the documents.</system>'
            f'<module name="doc">{escape(DOC)}</module></schema>')


def test_a_schema_opts_in_to_the_installed_prefix(pc, installed):
    states = {}
    for cond in ("", "neutral", "learned"):
        schema = _schema(pc, cond)
        pc.add_schema(schema)
        name = schema.split('"')[1]
        states[cond] = pc.store.get(pc.schemas.state(name).keys["doc"])
        out = pc.generate(f'<prompt schema="{name}"><doc/><user>When does the gate open?</user></prompt>',
                          max_new_tokens=2)
        assert out.cached_tokens > 0
    assert not torch.allclose(states["learned"].values, states["neutral"].values)
    assert not torch.allclose(states["learned"].values, states[""].values)
    # the module's values are those of one plain forward over the preamble, the prefix's
    # embeddings and the module (values carry no position, so the move back leaves them alone)
    layout = pc.schemas.state(_schema(pc, "learned").split('"')[1]).layout
    pre, doc = list(layout.units[layout.preamble].token_ids), list(layout.units["doc"].token_ids)
    emb = pc.model.get_input_embeddings()
    with torch.no_grad():
        x = torch.cat([emb(torch.tensor(pre)), installed.embeds, emb(torch.tensor(doc))])[None]
        out = pc.model(inputs_embeds=x, position_ids=torch.arange(x.shape[1])[None], use_cache=True)
    want = torch.stack([layer.values[0, :, -len(doc):] for layer in out.past_key_values.layers])
    assert torch.allclose(states["learned"].values, want, atol=1e-4)


def test_a_schema_asking_for_a_prefix_its_model_lacks_is_refused(pc, tmp_path, monkeypatch):
    _nothing_installed(monkeypatch, tmp_path)
    with pytest.raises(PMLError, match="no learned prefix is installed for this model.*pcache-rag install-prefix"):
        pc.add_schema(_schema(pc, "learned").replace('name="s', 'name="t'))


def test_components_answering_from_an_index_read_it_under_its_conditioning(pc, tmp_path):
    """A LlamaIndex or LangChain component given ``index_dir`` encodes and reads documents under
    the index's own conditioning (here a learned prefix the index was built with), so the
    index's chunk states are hits, not documents encoded again under the engine's default."""
    from langchain_pcache import ChatPromptCache
    from llama_index.llms.pcache import PromptCacheLLM

    from pcache_rag.docmodules import assembler_for, register_engine
    from pcache_rag.rag import CachedRAG, index_conditioning

    prefix = LearnedPrefix(initial_embeds(pc)[:16] - 0.05, {"fingerprint": pc.fingerprint})
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "gate.txt").write_text(DOC + "The winter ledgers are on shelf four.")
    rag = CachedRAG(tmp_path / "index", pc=pc, k=1, chunk_tokens=128, conditioning=prefix)
    rag.ingest([docs], progress=False)
    h = rag.retrieve("Which shelf holds the winter ledgers?", prefetch=False)[0]
    ids = rag.chunks.ids(h.text, h.source)
    got = index_conditioning(tmp_path / "index")
    assert isinstance(got, LearnedPrefix) and got.spec == prefix.spec
    assert index_conditioning(tmp_path / "empty") == "default"
    register_engine(pc, "tiny-installed-test", str(tmp_path / "index" / "kv"))
    llm = PromptCacheLLM(model="tiny-installed-test", index_dir=str(tmp_path / "index"))
    chat = ChatPromptCache(model_name="tiny-installed-test", index_dir=str(tmp_path / "index"))
    for asm in (llm.assembler, chat._asm()):
        assert asm.conditioning == prefix.spec and asm.key(ids) == h.kv_key
    assert assembler_for(pc).key(ids) != h.kv_key  # the engine's default would have missed


def test_the_demo_says_which_conditioning_and_how_to_install_a_prefix(pc, tmp_path, monkeypatch, capsys):
    from pcache_rag.conditioning import install
    from pcache_rag.demo import _say_conditioning
    from pcache_rag.rag import CachedRAG

    _nothing_installed(monkeypatch, tmp_path)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "gate.txt").write_text(DOC)
    rag = CachedRAG(tmp_path / "index", pc=pc, k=1, chunk_tokens=128)
    rag.ingest([docs], progress=False)
    _say_conditioning(rag)
    out = capsys.readouterr().out
    assert "encoded after: neutral:1" in out and "pcache-rag install-prefix" in out
    prefix = LearnedPrefix(initial_embeds(pc)[:20] + 0.03, {"fingerprint": pc.fingerprint})
    install(prefix, installed_dir() / "tiny.safetensors")
    _say_conditioning(CachedRAG(tmp_path / "index", pc=pc, k=1, create=False))
    out = capsys.readouterr().out
    assert f"built before {prefix.spec} was installed and keeps neutral:1" in out
    _say_conditioning(CachedRAG(tmp_path / "new index", pc=pc, k=1))
    out = capsys.readouterr().out
    assert out.startswith(f"documents are encoded after: {prefix.spec}\n") and "within 3 points" in out


@pytest.mark.real_model
def test_the_embedded_models_prefix_ships_and_is_the_default_on_a_fresh_home(smol, tmp_path, monkeypatch):
    """A fresh install (nothing in ``$PCACHE_RAG_HOME``) answers under the packaged prefix: the
    Assembler and a new CachedRAG index both take it, with no step of their own."""
    from pcache_rag.rag import CachedRAG

    monkeypatch.setenv("PCACHE_RAG_HOME", str(tmp_path / "a fresh home"))
    files = sorted(conditioning.PACKAGED_DIR.glob("*.safetensors"))
    assert [f.name for f in files] == ["smollm2-135m-instruct.safetensors"]
    shipped = LearnedPrefix.load(files[0])
    assert shipped.fingerprint == smol.fingerprint, "learned for the embedded model as the engine loads it"
    assert installed_prefix(smol.fingerprint).spec == shipped.spec
    assert Assembler(smol).conditioning == shipped.spec
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "gate.txt").write_text(DOC)
    rag = CachedRAG(tmp_path / "index", pc=smol, k=1, chunk_tokens=64)
    rag.ingest([docs], progress=False)
    assert rag.asm.conditioning == shipped.spec and rag.manifest["conditioning"] == shipped.spec
    rag.close()
