"""Learning from prompts, governed (:mod:`pcache_rag.store.learned`): what a prompt teaches is
kept for its tenant alone, in memory, within its own budget, and written nowhere.

The attacker's cases first: a second client guessing a secret inside the first client's
paragraph learns nothing from the cache (same cached tokens, same work for a right guess as for
a wrong one), over the engine and over HTTP with two API keys. Then the bounds: a 7 KB prompt
writes nothing to disk or to the journal, a thousand distinct prompts keep the learned bytes
under their budget without evicting an ingested document, and memory stays flat.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from helpers import Server, tiny_model

from pcache_rag import PromptCache
from pcache_rag.discovery import KNOWN_JOURNAL
from pcache_rag.docmodules import Assembler
from pcache_rag.store.learned import LearnedStore, tenant_id

NOTE = ("Vault note for the night shift: the door code of the archive room is {pin}. Keep it to yourselves, "
        "and change it on the first Monday of every month.")
PIN = "4417"
WRONG = [f"{n:04d}" for n in range(1000, 10000, 450)][:20]


def _messages(pin: str) -> list[tuple[str, str]]:
    return [("system", "Answer from the notes.\n\n" + NOTE.format(pin=pin)),
            ("user", "What is the door code of the archive room?")]


@pytest.fixture(scope="module")
def asm(smol_tok):
    model = tiny_model("llama", len(smol_tok), seed=3)
    return Assembler(PromptCache(model, smol_tok, store_dtype=None), conditioning="none")


def _cost(asm: Assembler, tenant: str, pin: str) -> tuple[int, int, int]:
    """(prompt tokens, tokens read from the cache, tokens encoded) of one answer."""
    out = asm.generate(asm.message_segments(_messages(pin), tenant=tenant), max_new_tokens=1)
    return out.prompt_tokens, out.cached_tokens, out.encoded_tokens


def test_a_right_guess_from_another_tenant_costs_what_a_wrong_one_does(asm):
    """Tenant A's note (with its PIN) is learned. Twenty other tenants each guess the PIN right
    and twenty guess it wrong, once each: every try reads the same number of tokens from the
    cache and encodes the same number, so neither the counts nor the work (the time) tell the
    right guess apart. On the previous main, the right guess read the whole note from the cache."""
    first = _cost(asm, "a", PIN)
    again = _cost(asm, "a", PIN)
    assert again[1] > first[1], "inside one tenant, the repeat reads the note from the cache"
    right = [_cost(asm, f"right-{i}", PIN)[1:] for i in range(20)]
    wrong = [_cost(asm, f"wrong-{i}", pin)[1:] for i, pin in enumerate(WRONG)]
    assert len(set(right)) == 1 and set(right) == set(wrong), (right, wrong)
    assert right[0][0] < again[1], "a guess, right or wrong, is not read from A's states"


@pytest.mark.real_model
def test_two_api_keys_are_two_tenants_over_http(smol, tmp_path):
    """A server with two API keys: what key A's prompt taught is read again by key A, and key B's
    right guess is exactly as cached as its wrong guess."""
    from pcache_rag.rag import CachedRAG
    from pcache_rag.serve import AnswerService, create_app

    pc = PromptCache(smol.model, smol.tokenizer, cache_dir=str(tmp_path / "index" / "kv"))
    rag = CachedRAG(tmp_path / "index", pc=pc, k=2, chunk_tokens=64)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ferry.md").write_text("The ferry to the island leaves at 07:45 every morning.\n")
    rag.ingest([tmp_path / "docs"], progress=False)
    srv = Server(create_app(AnswerService(rag, max_new_tokens=2), api_key=["key-a", "key-b"]))

    def cached(key: str, pin: str) -> int:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {key}"},
                       json={"model": "pcache-rag-plain", "max_tokens": 2, "temperature": 0,
                             "messages": [{"role": r, "content": c} for r, c in _messages(pin)]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        a1, a2 = cached("key-a", PIN), cached("key-a", PIN)
        cached("key-b", WRONG[0])  # B's first prompt teaches B the template's opening, as A's did A
        b_right, b_wrong = cached("key-b", PIN), cached("key-b", WRONG[1])
        assert a2 > a1, "key A's repeat reads its note from the cache"
        assert b_right == b_wrong < a2, (a1, a2, b_right, b_wrong)
        assert rag.pc.learned.stats().tenants == 2
        r = httpx.post(srv.url + "/api/forget", headers={"Authorization": "Bearer key-a"}, timeout=30)
        assert r.status_code == 200 and r.json()["forgotten"] >= 2, r.text
        assert cached("key-a", PIN) == a1, "key A's note and prefix were forgotten"
        assert cached("key-b", PIN) == a2, "key B's own states stay"
    finally:
        srv.stop()
        rag.close()


def test_tenant_ids_are_hashes_of_the_key_never_the_key():
    t = tenant_id("sk-secret-123")
    assert t and "secret" not in t and t == tenant_id("sk-secret-123") != tenant_id("sk-secret-124")
    assert tenant_id(None) == tenant_id("") == ""


def test_a_7kb_prompt_writes_nothing_to_disk_or_the_journal(smol_tok, tmp_path):
    """A never-seen 7 KB prompt on an engine with a disk tier: its documents are learned in
    memory (the repeat reads them), the disk tier and the journal are untouched (the issue's
    server wrote 71.5 MB for one such request)."""
    model = tiny_model("llama", len(smol_tok), seed=5)
    model.config.max_position_embeddings = 4096  # RoPE: room for the 7 KB prompt (~2,300 tokens)
    pc = PromptCache(model, smol_tok, cache_dir=str(tmp_path / "kv"), store_dtype=None)
    a = Assembler(pc, conditioning="none")
    a.ensure(["An ingested document about the harbour cranes and the tonnes they lift on weekdays, long enough."])
    disk = pc.store.tier_stats()["disk"].bytes
    journal = (tmp_path / "kv" / KNOWN_JOURNAL).stat().st_size
    blocks = [" ".join(f"Depot {i} stores {i * 37 + j} crates of tin and {i * 11 + j} barrels on shelf {j}."
                       for j in range(6)) for i in range(20)]  # 20 documents: within one prompt's cap of 32
    prompt = "Answer from the records.\n\n" + "\n\n".join(blocks)
    assert 6_500 <= len(prompt.encode()) <= 7_500
    msgs = [("system", prompt), ("user", "How many crates are in depot 7?")]
    first = a.generate(a.message_segments(msgs), max_new_tokens=1)
    second = a.generate(a.message_segments(msgs), max_new_tokens=1)
    assert second.cached_tokens >= 0.95 * second.prompt_tokens > first.cached_tokens
    assert pc.store.tier_stats()["disk"].bytes == disk, "nothing learned was written to disk"
    assert (tmp_path / "kv" / KNOWN_JOURNAL).stat().st_size == journal, "nor to the journal"
    assert 0 < pc.learned.stats().bytes <= pc.learned.budget


def _rss() -> int:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_thousand_distinct_prompts_stay_within_the_learned_budget(smol_tok, tmp_path):
    """1,000 distinct prompts, each teaching new documents, with a learned budget of 4 MB: the
    learned bytes never pass it (least recently used out), the ingested document stays in the
    shared store, the journal does not grow, and the process's memory after the first hundred
    prompts stays within 10%."""
    model = tiny_model("llama", len(smol_tok), seed=6)
    pc = PromptCache(model, smol_tok, cache_dir=str(tmp_path / "kv"), store_dtype=None)
    pc.learned = LearnedStore(budget_bytes=4 << 20)
    a = Assembler(pc, conditioning="none")
    ingested = "The ingested handbook says the ferry to the island leaves at 07:45 and returns at 18:30 daily."
    (key,) = a.ensure([ingested])
    journal = (tmp_path / "kv" / KNOWN_JOURNAL).stat().st_size
    rss = []
    for i in range(1000):
        docs = [f"Record {i}-{j}: warehouse {i * 7 + j} holds {i * 13 + j} pallets of copper and {j} of tin, "
                "inspected by the night warden." for j in range(3)]
        msgs = [("system", "Records follow.\n\n" + "\n\n".join(docs)), ("user", f"What does warehouse {i * 7} hold?")]
        a.generate(a.message_segments(msgs, tenant=f"t{i % 5}"), max_new_tokens=1)
        assert pc.learned.stats().bytes <= 4 << 20
        if i in (99, 999):
            rss.append(_rss())
    st = pc.learned.stats()
    assert st.evictions > 0 and st.tenants == 5
    assert pc.store.contains(key), "no ingested document was evicted for learned ones"
    assert (tmp_path / "kv" / KNOWN_JOURNAL).stat().st_size == journal
    assert rss[1] <= 1.10 * rss[0], f"memory grew from {rss[0] >> 20} MB to {rss[1] >> 20} MB"


def test_forget_drops_a_tenants_learned_states_only(asm):
    _cost(asm, "x", PIN)
    _cost(asm, "y", PIN)
    kept = _cost(asm, "y", PIN)[1]
    assert asm.learned.forget("x") > 0
    assert _cost(asm, "y", PIN)[1] == kept, "y's states stay"
    assert _cost(asm, "x", PIN)[1] < kept, "x's were dropped"


def test_learned_states_expire_after_the_retention_period(smol_tok):
    model = tiny_model("llama", len(smol_tok), seed=7)
    pc = PromptCache(model, smol_tok, store_dtype=None)
    pc.learned = LearnedStore(retention_s=1e-6)
    a = Assembler(pc, conditioning="none")
    _cost(a, "t", PIN)
    assert _cost(a, "t", PIN)[1] == _cost(a, "t", "0000")[1], "nothing outlived the retention period"
    assert pc.learned.stats().expired > 0


def test_the_journal_keeps_texts_encoded_on_purpose_with_their_time_and_compacts(tmp_path):
    """The journal (texts encoded on purpose, for other processes): entries carry when they were
    added; compact() drops forgotten texts, entries past a retention period, duplicates and
    damaged lines, and another process reading the same journal follows the rewrite. An older
    journal's bare-string lines still read."""
    import json

    from pcache_rag.discovery import KnownTexts

    path = tmp_path / KNOWN_JOURNAL
    texts = [f"Document {i}: the lighthouse on the north cape is painted red and white, and its lamp turns." * 2
             for i in range(3)]
    path.write_text(json.dumps("An older journal wrote bare strings, one per line, and those still read fine.") +
                    "\n{damaged\n")
    mine, other = KnownTexts(path), KnownTexts(path)
    mine.add(texts, keep=True)
    assert len(other) == 4 and all(json.loads(line).get("at") for line in path.read_text().splitlines()[2:])
    assert mine.compact([texts[0]]) == (3, 2)  # the forgotten text and the damaged line
    assert texts[0].strip() not in mine and texts[1].strip() in mine
    assert not mine.find("Say: " + texts[0])
    fresh = KnownTexts(path)
    assert len(fresh) == 3 and texts[0].strip() not in fresh
    other.add([texts[2]], keep=True)  # a process that read the old journal appends after the rewrite
    assert len(KnownTexts(path)) == 3
    assert mine.compact(older_than_s=3600) == (2, 1), "the bare string counts as added at the epoch"


@pytest.mark.real_model
def test_pcache_rag_forget_removes_states_and_journal_entries(smol, smol_dir, tmp_path, capsys):
    """`pcache-rag forget TEXT --index DIR`: the text's states leave every tier of the store and
    its journal line goes; a text that is an indexed chunk is said to be still indexed."""
    from pcache_rag.cli import main
    from pcache_rag.rag import CachedRAG

    index = tmp_path / "index"
    pc = PromptCache(smol.model, smol.tokenizer, cache_dir=str(index / "kv"))
    rag = CachedRAG(index, pc=pc, k=1, chunk_tokens=64)
    (tmp_path / "docs").mkdir()
    chunk = "The ferry to the island leaves at 07:45 every morning and returns at 18:30."
    (tmp_path / "docs" / "ferry.md").write_text(chunk + "\n")
    rag.ingest([tmp_path / "docs"], progress=False)
    secret = "Private memo: the board meets on the third Thursday to decide the harbour budget for next year."
    (key,) = rag.asm.ensure([secret])
    assert pc.store.contains(key) and secret in (index / "kv" / KNOWN_JOURNAL).read_text()
    rag.close()
    assert main(["forget", secret, chunk, "--index", str(index), "--model", str(smol_dir)]) == 0
    out = capsys.readouterr().out
    assert "2 stored state(s) removed" in out and "still indexed" in out and "ferry" in out
    assert secret not in (index / "kv" / KNOWN_JOURNAL).read_text()
    again = PromptCache(smol.model, smol.tokenizer, cache_dir=str(index / "kv"))
    assert not again.store.contains(key) and secret not in again.known_texts


def _states(tokens: int):
    """A unit of ``tokens`` tokens of 1 KB each (float32, one layer, one head, 128 wide, keys and values)."""
    import torch

    from pcache_rag.kv import ModuleKV

    return ModuleKV(torch.zeros(1, 1, tokens, 128), torch.zeros(1, 1, tokens, 128), torch.arange(tokens),
                    torch.arange(tokens))


def test_one_tenant_keeps_at_most_its_share_and_learns_at_most_its_rate():
    """A 100 KB budget, a share of half: a busy tenant's own oldest states make room for its
    new ones, and the quiet tenant's stay. With a rate of 10 KB/s (a bucket of 600 KB), a
    tenant that learned its bucket's worth has its next state refused (computed, not kept)."""
    store = LearnedStore(budget_bytes=100 << 10, tenant_share=0.5)
    assert store.put("quiet", "q", _states(20))  # 20 KB
    for i in range(10):
        assert store.put("busy", f"b{i}", _states(10))  # 10 KB each: 100 KB offered, 50 KB its share
    assert store.get("quiet", "q") is not None, "the quiet tenant's state stayed"
    assert [store.contains("busy", f"b{i}") for i in range(10)] == [False] * 5 + [True] * 5
    assert store.stats().bytes <= 100 << 10 and not store.put("busy", "huge", _states(60)), "over its share"

    slow = LearnedStore(budget_bytes=10 << 20, rate_bytes_per_s=10 << 10)
    kept = [slow.put("t", f"k{i}", _states(100)) for i in range(8)]  # 100 KB each against a 600 KB bucket
    assert kept == [True] * 6 + [False] * 2 and slow.stats().refused == 2
    assert slow.put("other", "k", _states(100)), "another tenant has a bucket of its own"
