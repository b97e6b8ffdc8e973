"""Learned conditioning (issue 20): a prefix of input embeddings, trained without labels so that
chunks encoded after it read to the question as they do in a full prefill. Checked on tiny
random models: the trainer's differentiable student is the engine's cached path, training
lowers the KL it optimizes, the prefix round-trips through safetensors and keys its states
apart, and what cannot take one is refused by name."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import tiny_model
from pcache_rag import PromptCache
from pcache_rag.conditioning import LearnedPrefix, conditioning_kind
from pcache_rag.docmodules import MIN_CONDITIONED_TOKENS, Assembler
from pcache_rag.rag.learned import Prompt, Student, initial_embeds, kl, learn_prefix, teacher
from pcache_rag.engine import Parts


def _prompts(asm: Assembler, n: int, seed: int, k: int = 3) -> list[Prompt]:
    """``n`` prompts of ``k`` random-word chunks (each long enough to be conditioned) and a question."""
    r = random.Random(seed)
    words = ("copper vault archive river lantern code seven harbour quiet north meadow signal paper "
             "window stone bridge orchard amber market engine").split()
    out = []
    for _ in range(n):
        docs = [asm.doc_ids(" ".join(r.choice(words) for _ in range(MIN_CONDITIONED_TOKENS + 8))) for _ in range(k)]
        q = asm.pc.safe.text(f"Question: what is the {r.choice(words)}?") + asm.pc.safe.text("\nAnswer:")
        out.append(Prompt(docs, q))
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pc(request, smol_tok):
    model = tiny_model(request.param, len(smol_tok), seed=3)
    with torch.no_grad():  # sharper attention: conditioning then moves the logits well above rounding
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(4.0)
    return PromptCache(model, smol_tok, store_dtype=torch.float32)


def test_kind_of_a_spec():
    assert conditioning_kind(None) == conditioning_kind("none") == "none"
    assert conditioning_kind("neutral:2") == "neutral"
    assert conditioning_kind("learned:0123456789ab") == "learned"
    assert conditioning_kind("passage:0123456789ab") == "passage"
    for bad in ("learned:xyz", "learned:", "passage:0123"):
        with pytest.raises(ValueError, match="12 hex digits"):
            conditioning_kind(bad)


def test_cloze_prompts_take_their_answer_from_the_document():
    from pcache_rag.rag.calibrate import cloze_question

    text = "short line\nThe archive keeps records of shipments invoices and letters from many years\nend"
    for seed in range(5):
        q, a = cloze_question(text, random.Random(seed))
        shown = q.split('"')[1].removesuffix(" ...")
        assert f"{shown} {a}" == "The archive keeps records of shipments invoices and letters from many years"
        assert len(shown.split()) >= 3 and a
    q, a = cloze_question("too few words", random.Random(0))
    assert a == "" and "too few words" in q  # falls back to a quoting question, with no answer of its own


def test_a_cloze_prompts_teacher_is_forced_on_its_own_answer(pc):
    from pcache_rag.rag.learned import FORCED_CLOZE

    asm = Assembler(pc, conditioning="none")
    p = _prompts(asm, 1, seed=4)[0]
    p.answer = asm.pc.safe.text("the winter ledgers are kept on shelf nine by the clerks")
    forced, lp = teacher(pc, asm.base_ids, p)
    assert forced == p.answer[:FORCED_CLOZE] and lp.shape[0] == FORCED_CLOZE + 1
    ids = asm.base_ids + [i for d in p.docs for i in d] + p.question + forced
    ref = pc.core.full_prefill(torch.tensor(ids), last=len(forced) + 1).float()
    assert torch.allclose(lp, torch.log_softmax(ref, -1), atol=1e-5)


def test_the_student_is_the_engines_cached_path(pc):
    """The trainer's differentiable assembly gives the logits the engine's cached prefill gives,
    for chunks encoded after the same learned prefix and moved to their slots."""
    torch.manual_seed(0)
    embeds = initial_embeds(pc)[:40] + 0.05 * torch.randn(40, pc.model.config.hidden_size)
    prefix = LearnedPrefix(embeds, {"fingerprint": pc.fingerprint})
    asm = Assembler(pc, prefix=prefix)
    assert asm.conditioning == prefix.spec and asm.conditioned(asm.doc_ids("x " * 80))
    prompt = _prompts(asm, 1, seed=1)[0]
    forced = [5, 17, 9]
    student = Student(pc, asm.base_ids)
    with torch.no_grad():
        got = student.log_probs(prompt, student.context(prefix.embeds), forced)  # (4, vocab)
    parts = [("preamble", asm.base())]
    pos = asm.start
    for j, ids in enumerate(prompt.docs):
        kv = pc.encoder.place(asm.encode_ids(ids, store=False), pos)
        parts.append((f"d{j}", kv))
        pos += kv.length
    for i in range(len(forced) + 1):
        ref = pc.prefill(Parts(parts, prompt.question + forced[:i], preamble="preamble")).logits.float()
        assert torch.allclose(torch.log_softmax(ref, -1), got[i], atol=1e-4), i


def test_training_lowers_the_kl_it_optimizes(pc):
    asm = Assembler(pc, conditioning="none")
    train = val = _prompts(asm, 3, seed=2)  # measured on the prompts it trains on: the objective itself
    rep = learn_prefix(pc, asm.base_ids, train, val, steps=6, progress=False)
    assert [s for s, _ in rep.curve] == [3, 6]
    assert rep.improved and rep.kl_learned < 0.8 * rep.kl_init, rep.lines()
    assert rep.prefix.fingerprint == pc.fingerprint
    assert rep.prefix.embeds.shape == initial_embeds(pc).shape
    # measured again from scratch: the chosen prefix's validation KL is the one reported
    student = Student(pc, asm.base_ids)
    with torch.no_grad():
        ctx = student.context(rep.prefix.embeds)
        again = []
        for p in val:
            forced, lp = teacher(pc, asm.base_ids, p)
            again.append(float(kl(lp, student.log_probs(p, ctx, forced))))
    assert abs(sum(again) / len(again) - rep.kl_learned) < 1e-4


def test_a_prefix_round_trips_and_keys_its_states_apart(pc, tmp_path):
    e = initial_embeds(pc)[:16]
    a = LearnedPrefix(e, {"fingerprint": pc.fingerprint, "steps": "3"})
    b = LearnedPrefix(e + 1e-3, {"fingerprint": pc.fingerprint})
    path = a.save(tmp_path / "p.safetensors")
    back = LearnedPrefix.load(path)
    assert back.spec == a.spec != b.spec and back.meta["steps"] == "3" and torch.equal(back.embeds, a.embeds)
    asms = [Assembler(pc, prefix=a), Assembler(pc, prefix=b), Assembler(pc, conditioning="neutral")]
    ids = asms[0].doc_ids("word " * 80)
    keys = {x.key(ids) for x in asms}
    assert len(keys) == 3, "states encoded after different prefixes never share a key"
    kv_a, kv_b = (x.encode_ids(ids, store=False) for x in asms[:2])
    assert not torch.allclose(kv_a.values, kv_b.values)
    (tmp_path / "bad.safetensors").write_bytes(b"not a prefix")
    with pytest.raises(ValueError, match="not a learned conditioning prefix"):
        LearnedPrefix.load(tmp_path / "bad.safetensors")


def test_refused_by_name(pc, smol_tok):
    e = initial_embeds(pc)[:8]
    with pytest.raises(ValueError, match="trained for another model"):
        Assembler(pc, prefix=LearnedPrefix(e, {"fingerprint": "other"}))
    with pytest.raises(ValueError, match="needs its prefix"):
        Assembler(pc, conditioning="learned:0123456789ab")
    gpt2 = PromptCache(tiny_model("gpt2", len(smol_tok)), smol_tok)
    with pytest.raises(ValueError, match="RoPE"):
        learn_prefix(gpt2, [1, 2], [Prompt([[3]], [4])], [Prompt([[3]], [4])], steps=1, progress=False)


WORDS = ("The archive keeps records of shipments, invoices and letters from many years. Clerks file each "
         "record by date and by the name of the office that sent it. ")


def test_an_index_moves_to_a_learned_prefix(pc, tmp_path):
    """``calibrate --learn``'s last step: the index keeps the prefix, every chunk is keyed and
    encoded after it, the manifest says so, and another instance serving the index switches
    at its next question. A missing prefix file is refused by name."""
    from pcache_rag.rag import CachedRAG
    from pcache_rag.rag.index_dir import prefix_path
    from pcache_rag.rag.learned import index_prompts, learn_index, use_prefix

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"note-{i}.txt").write_text(WORDS * 3 + f"Shelf {i} holds the winter ledgers.")
    rag = CachedRAG(tmp_path / "index", pc=pc, k=2, chunk_tokens=128, conditioning="neutral")
    rag.ingest([docs], progress=False)
    other = CachedRAG(tmp_path / "index", pc=pc, k=2, create=False)  # a second instance serving the index
    old = rag.index.keys()
    prompts = index_prompts(rag, 3, k=2)
    assert all(len(p.docs) == 2 and p.question for p in prompts)
    rep = learn_index(rag, train=2, val=1, steps=1, save=False, progress=False)
    assert rep.train_prompts == 2 and rep.val_prompts == 1 and rag.asm.conditioning == "neutral:1"

    prefix = LearnedPrefix(initial_embeds(pc)[:24] + 0.1, {"fingerprint": pc.fingerprint})
    assert use_prefix(rag, prefix, progress=False) == len(old)
    new = rag.index.keys()
    assert set(new) == set(old) and not set(new.values()) & set(old.values())
    assert rag.manifest["conditioning"] == prefix.spec == rag.asm.conditioning
    assert prefix_path(rag.index_dir, prefix.spec).exists()
    asm = Assembler(pc, prefix=prefix)
    for cid, text in rag.index.texts():
        src = dict(rag.index.chunks())[cid]["source"]
        ids = rag.chunks.ids(text, src)
        assert new[cid] == asm.key(ids)
        assert torch.allclose(pc.store.get(new[cid]).values.float(), asm.encode_ids(ids, store=False).values.float(),
                              atol=1e-5)
    # before its next question the other instance still encodes after the neutral passage: a chunk whose
    # states are gone is encoded and stored under its own key, never under the prefix's
    h = rag.retrieve("Which shelf?", k=1, prefetch=False)[0]
    assert pc.store.remove(h.kv_key)
    kv = other.parts([h])[1][1]
    mine = other.asm.key(other.chunk_ids(h.text, h.source))
    assert other.asm.conditioning == "neutral:1" and pc.store.contains(mine) and not pc.store.contains(h.kv_key)
    assert torch.allclose(kv.values.float(), pc.store.get(mine).values.float())
    q = "Which shelf holds the winter ledgers?"
    other.retrieve(q)
    assert other.asm.conditioning == prefix.spec  # switched at its next question
    assert other.answer(q, max_new_tokens=2).output.cached_tokens > 0
    again = CachedRAG(tmp_path / "index", pc=pc, create=False)
    assert again.asm.conditioning == prefix.spec
    prefix_path(rag.index_dir, prefix.spec).unlink()
    with pytest.raises(FileNotFoundError, match="its prefix .* is missing"):
        CachedRAG(tmp_path / "index", pc=pc, create=False)
    fresh = CachedRAG(tmp_path / "fresh", pc=pc, k=2, chunk_tokens=128, conditioning=prefix)  # learned elsewhere: copied in
    assert fresh.asm.conditioning == prefix.spec and prefix_path(fresh.index_dir, prefix.spec).exists()
