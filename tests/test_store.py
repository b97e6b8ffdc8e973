"""The tiered KV store: budgets, eviction order, promotion/demotion, persistence, fingerprints,
integrity (corrupted, truncated, killed writers), concurrent writers, prefetch."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import adapter_of, tiny_model
from pcache_rag import PromptCache
from pcache_rag.kv import ModuleKV
from pcache_rag.store import DiskTier, LFUPolicy, MemoryTier, TieredStore, unit_key

HERE = Path(__file__).parent


def entry(seed: int, tokens: int = 8, layers: int = 2, heads: int = 2, dim: int = 4) -> ModuleKV:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, heads, tokens, dim, generator=g).half()
    v = torch.randn(layers, heads, tokens, dim, generator=g).half()
    return ModuleKV(k, v, torch.arange(tokens), torch.arange(tokens) + seed)


def same(a: ModuleKV, b: ModuleKV) -> bool:
    return all(torch.equal(x, y) for x, y in ((a.keys, b.keys), (a.values, b.values), (a.position_ids, b.position_ids)))


def test_memory_budget_is_never_exceeded_and_lru_order():
    e = entry(0)
    tier = MemoryTier("cpu", budget_bytes=3 * e.nbytes(), policy="lru")
    for i in range(3):
        assert tier.put(f"k{i}", entry(i)) == []
    tier.get("k0")  # k1 is now the least recent
    evicted = tier.put("k3", entry(3))
    assert [k for k, _ in evicted] == ["k1"]
    for i in range(4, 10):
        tier.put(f"k{i}", entry(i))
        assert tier.stats().bytes <= tier.budget
    assert tier.stats().evictions == 7


def test_lfu_keeps_the_hot_entry():
    e = entry(0)
    tier = MemoryTier("cpu", budget_bytes=2 * e.nbytes(), policy=LFUPolicy())
    tier.put("hot", entry(0))
    for _ in range(5):
        tier.get("hot")
    for i in range(1, 6):
        tier.put(f"cold{i}", entry(i))
    assert tier.contains("hot")


def test_tiers_demote_on_eviction_and_promote_on_read(tmp_path):
    e = entry(0)
    host = MemoryTier("cpu", budget_bytes=2 * e.nbytes())
    store = TieredStore([host, DiskTier(tmp_path / "kv")])
    for i in range(5):
        store.put(f"k{i}", entry(i))
        assert host.stats().bytes <= host.budget
    assert store.where("k0") == "disk" and store.where("k4") == "host"
    got = store.get("k0")
    assert same(got, entry(0))
    assert store.where("k0") == "host", "a read promotes to the fastest tier"
    assert host.stats().bytes <= host.budget
    assert all(store.disk.contains(f"k{i}") for i in range(5)), "disk holds everything (write-through)"


def test_capabilities_are_declared_by_tiers_not_found_by_class(tmp_path):
    """The tiered store finds its persistent and shared tiers by what they declare: a tier of
    the user's own that says it persists gets every write and is the budget RAG checks."""

    class Persisting(MemoryTier):
        persistent = True

        def budget_bytes(self) -> int:
            return 12345

    own = Persisting("cpu", name="own")
    store = TieredStore([MemoryTier("cpu", name="host"), own])
    assert store.persistent_tier() is own and store.shared_tier() is None and store.budget_bytes() == 12345
    store.put("k", entry(1))
    assert own.contains("k"), "written through because it persists"
    alone = MemoryTier("cpu")
    assert alone.persistent_tier() is None and alone.prefetch(["k"]) is None and alone.check() == []
    assert set(alone.tier_stats()) == {"host"} and set(store.tier_stats()) == {"host", "own"}


def test_tiers_are_opened_by_url_scheme(tmp_path):
    from pcache_rag.store import RemoteTier, open_tier

    disk = open_tier(f"file://{tmp_path}/kv dir")
    assert isinstance(disk, DiskTier) and disk.directory == tmp_path / "kv dir" and disk.persistent
    remote = open_tier("redis://127.0.0.1:1/0")  # nothing listens there: built, and down at first use
    assert isinstance(remote, RemoteTier) and remote.shared and remote.get("k") is None
    for bad in ("s3://bucket/kv", "/just/a/path"):
        with pytest.raises(ValueError, match=r"no KV tier serves .*redis://, rediss://, unix://, file://"):
            open_tier(bad)


def test_prefetch_moves_entries_to_the_fast_tier(tmp_path):
    disk = DiskTier(tmp_path / "kv")
    for i in range(4):
        disk.put(f"k{i}", entry(i))
    store = TieredStore([MemoryTier("cpu", budget_bytes=1 << 20), disk])
    assert store.prefetch([f"k{i}" for i in range(4)]).result(timeout=30) == [True] * 4
    assert all(store.where(f"k{i}") == "host" for i in range(4))
    store.close()


def _entry_file(tier: DiskTier, key: str) -> Path:
    import sqlite3

    con = sqlite3.connect(tier.directory / "cache.db")
    (name,) = con.execute("SELECT filename FROM Cache WHERE key = ?", (key,)).fetchone()
    con.close()
    return tier.directory / name


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_entries_are_detected_dropped_and_never_used(tmp_path, damage):
    tier = DiskTier(tmp_path / "kv")
    tier.put("k", entry(1, tokens=64))
    f = _entry_file(tier, "k")
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        data = data[: len(data) // 3]
    f.write_bytes(bytes(data))
    assert tier.get("k") is None
    assert tier.stats().corrupt == 1 and not tier.contains("k")


def test_an_entry_under_another_key_is_refused(tmp_path):
    from pcache_rag.store.codec import decode_entry, encode_entry

    blob = encode_entry("a", entry(1))
    assert same(decode_entry("a", blob), entry(1))
    with pytest.raises(ValueError, match="another key"):
        decode_entry("b", blob)


WRITER = """
import sys, torch
sys.path.insert(0, {here!r})
from test_store import entry
from pcache_rag.store import DiskTier
tier = DiskTier({path!r})
for i in range({start}, {stop}):
    tier.put(f"k{{i % {mod}}}", entry(i % {mod}, tokens={tokens}))
    print(i, flush=True)
"""


def _writer(path, start, stop, mod, tokens=512):
    code = WRITER.format(here=str(HERE), path=str(path), start=start, stop=stop, mod=mod, tokens=tokens)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_kill_9_during_writes_leaves_a_readable_store(tmp_path):
    p = _writer(tmp_path / "kv", 0, 10_000, 10_000, tokens=2048)
    for _ in range(5):  # let it commit a few entries, then kill it mid-stream
        p.stdout.readline()
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    tier = DiskTier(tmp_path / "kv")
    keys = tier.keys()
    assert len(keys) >= 5
    for k in keys:
        got = tier.get(k)
        assert got is not None and same(got, entry(int(k[1:]), tokens=2048))
    tier.put("after", entry(7))
    assert same(tier.get("after"), entry(7))


def test_two_processes_writing_one_directory(tmp_path):
    a = _writer(tmp_path / "kv", 0, 40, 12)
    b = _writer(tmp_path / "kv", 20, 60, 12)
    assert a.wait(timeout=120) == 0 and b.wait(timeout=120) == 0
    tier = DiskTier(tmp_path / "kv")
    assert sorted(tier.keys()) == sorted(f"k{i}" for i in range(12))
    for i in range(12):
        assert same(tier.get(f"k{i}"), entry(i, tokens=512))


PERSIST = """
import sys, json
sys.path.insert(0, {here!r})
from helpers import tiny_model
from transformers import AutoTokenizer
from pcache_rag import PromptCache
tok = AutoTokenizer.from_pretrained({tok!r})
pc = PromptCache(tiny_model("llama", len(tok), seed={seed}), tok, cache_dir={path!r}, encoding={enc!r})
pc.add_schema({schema!r})
r = pc.last_report
out = pc.generate({prompt!r}, max_new_tokens=4)
print(json.dumps([r.encoded, r.loaded, out.token_ids]))
"""
SCHEMA = ('<schema name="p"><system>Be brief.</system><module name="a">Alpha document.</module>'
          '<module name="b">Bravo document text.</module></schema>')
PROMPT = '<prompt schema="p"><a/><b/><user>Which?</user></prompt>'


def _run(tmp_path, smol_dir, seed=0, enc="preamble"):
    import json

    code = PERSIST.format(here=str(HERE), tok=str(smol_dir), seed=seed, path=str(tmp_path / "kv"), enc=enc,
                          schema=SCHEMA, prompt=PROMPT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_persistence_across_processes_and_fingerprint_mismatch(tmp_path, smol_dir):
    enc1, load1, toks1 = _run(tmp_path, smol_dir)
    assert (enc1, load1) == (3, 0)
    enc2, load2, toks2 = _run(tmp_path, smol_dir)
    assert (enc2, load2) == (0, 3), "a warm directory is loaded, not re-encoded"
    assert toks2 == toks1
    # another model (other weights) or another encoding policy never reuses these states
    assert _run(tmp_path, smol_dir, seed=1)[:2] == [3, 0]
    assert _run(tmp_path, smol_dir, enc="isolated")[:2] == [3, 0], "the encoding policy is part of every key"


def test_engine_reencodes_a_damaged_entry(tmp_path, smol_tok):
    pc = PromptCache(tiny_model("llama", len(smol_tok)), smol_tok, cache_dir=tmp_path / "kv")
    pc.add_schema(SCHEMA)
    before = pc.prefill(PROMPT).logits
    key = pc.schemas.unit_key("p", "a")
    host, disk = pc.store.tiers
    host.remove(key)
    f = _entry_file(disk, key)
    f.write_bytes(f.read_bytes()[:100])
    after = pc.prefill(PROMPT).logits
    assert torch.equal(before, after)
    assert disk.stats().corrupt == 1
    s = pc.stats()
    assert set(s["tiers"]) == {"host", "disk"} and s["tiers"]["disk"]["corrupt"] == 1


def test_fp16_storage_bytes_per_token(smol_tok):
    model = tiny_model("llama", len(smol_tok))
    pc = PromptCache(model, smol_tok)
    pc.add_schema(SCHEMA)
    kv = pc.store.get(pc.schemas.unit_key("p", "b"))
    assert kv.keys.dtype == torch.float16
    shape = adapter_of(pc).kv_shape
    assert kv.nbytes() / kv.length == shape.bytes_per_token(2) == 2 * 2 * 2 * 16 * 2


def test_unit_keys_change_with_text_and_position():
    a = unit_key("m", [1, 2], [0, 1])
    assert a != unit_key("m", [1, 3], [0, 1]) and a != unit_key("m", [1, 2], [5, 6]) and a != unit_key("x", [1, 2], [0, 1])
    assert a != unit_key("m", [1, 2], [0, 1], context="pre")


def test_prefetch_brings_union_members_along(tmp_path, smol_tok):
    schema = ('<schema name="u"><system>Hi.</system><union><module name="x">Doc x.</module>'
              '<module name="y">Doc y here.</module><module name="z">Doc z text.</module></union></schema>')
    host = MemoryTier("cpu", budget_bytes=1 << 30)
    store = TieredStore([host, DiskTier(tmp_path / "kv")])
    pc = PromptCache(tiny_model("llama", len(smol_tok)), smol_tok, store=store)
    pc.add_schema(schema)
    keys = pc.schemas.unit_keys("u")
    for k in keys.values():
        host.remove(k)
    prompt = '<prompt schema="u"><x/><user>q</user></prompt>'
    pc.prefetch(prompt).result(timeout=60)
    assert store.where(keys["x"]) == "host" and store.where(keys["y"]) == "disk"
    pc.prefetch(prompt, union_members=True).result(timeout=60)
    assert all(store.where(keys[m]) == "host" for m in "xyz")
    store.close()
