"""`pcache-rag eval quality` at a tiny size: every set and mode runs on the same questions, the
numbers are finite and consistent, and the Markdown table and PNG plot are written."""

import json
import math
import re

import pytest

from pcache_rag.cli import main
from pcache_rag.measure.quality import DEFAULT_MODES, SETS, build_sets, contains, inputs_hash, mcnemar_p, token_f1, wilson
from pcache_rag.engine import Parts


def test_metrics():
    lo, hi = wilson(17, 24)
    assert 0.5 < lo < 17 / 24 < hi < 0.9
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0
    assert contains("The code is MY-7890.", "MY-7890") and not contains("The code is MY-7891.", "MY-7890")
    assert token_f1("born in Oslo", "Oslo") == 0.5 and token_f1("Lima", "Oslo") == 0.0


def test_the_answer_is_the_first_line_with_text():
    """A model without a chat template often starts its answer with a line break: it decodes
    all its tokens and the first line with text is scored; chat models stop at a line break."""
    from types import SimpleNamespace

    from pcache_rag.measure.quality import answer_line, answer_stop

    assert answer_line("\n The code is ZJ-8808.\nUser: and more") == "The code is ZJ-8808."
    assert answer_line("Paris") == "Paris" and answer_line(" \n\n") == ""
    assert answer_stop(SimpleNamespace(chat=SimpleNamespace(source="plain"))) == []
    assert answer_stop(SimpleNamespace(chat=SimpleNamespace(source="template"))) == ["\n"]


def test_mcnemar_exact_on_known_counts():
    # 6 questions only the first gets right, none only the second: 2 * 0.5**6
    a = [True] * 6 + [True, False] * 5
    b = [False] * 6 + [True, False] * 5
    assert math.isclose(mcnemar_p(a, b), 2 / 64) and math.isclose(mcnemar_p(b, a), 2 / 64)
    assert mcnemar_p(a, a) == 1.0
    # 5 against 3 discordant: 2 * P(X <= 3), X ~ Bin(8, 1/2) = 2 * 93/256
    a = [True] * 5 + [False] * 3
    b = [False] * 5 + [True] * 3
    assert math.isclose(mcnemar_p(a, b), 2 * 93 / 256)


def test_inputs_are_identical_across_processes_and_the_splits_are_disjoint(smol_tok, smol_dir):
    """The filler text holds nothing process-specific (pydoc prints memory addresses and the
    logging module's live handlers), so another process builds byte-identical sets."""
    import subprocess
    import sys

    here = {name: inputs_hash(qs) for name, qs in build_sets(smol_tok, 3, 64, seed=5).items()}
    code = ("import json, logging, sys; from transformers import AutoTokenizer; "
            "from pcache_rag.measure.quality import build_sets, inputs_hash; logging.getLogger('x').addHandler(logging.StreamHandler()); "
            f"tok = AutoTokenizer.from_pretrained({str(smol_dir)!r}); "
            "print(json.dumps({n: inputs_hash(q) for n, q in build_sets(tok, 3, 64, seed=5).items()}))")
    there = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1])
    assert here == there
    rep = build_sets(smol_tok, 6, 64, seed=5)
    tune = build_sets(smol_tok, 6, 64, seed=5, split="tuning")
    for name in rep:
        a = {(q.question, q.answer, tuple(q.docs)) for q in rep[name]}
        b = {(q.question, q.answer, tuple(q.docs)) for q in tune[name]}
        assert not a & b, name
        assert not {d for q in rep[name] for d in q.docs} & {d for q in tune[name] for d in q.docs}, name
    assert all("0x7" not in d for q in rep["plain"] for d in q.docs)


def test_sets_are_seeded_and_plant_their_answers(smol_tok):
    a = build_sets(smol_tok, 4, 64, seed=1)
    b = build_sets(smol_tok, 4, 64, seed=1)
    assert [q.question for q in a["plain"]] == [q.question for q in b["plain"]]
    for name in ("plain", "competing"):
        for q in a[name]:
            assert len(q.docs) == 4 and sum(q.answer in d for d in q.docs) >= 1
    for q in a["cross"]:
        assert any(q.answer in d for d in q.docs) and len(q.docs) == 4


@pytest.mark.slow  # ~40 s: the whole eval command end to end (as bench all --quick); `make test-slow`
def test_quick_eval_writes_a_finite_report(smol_dir, tmp_path, capsys):
    out = tmp_path / "docs"
    rc = main(["eval", "quality", "--n", "1", "--doc-tokens", "48", "--max-new-tokens", "6", "--model", str(smol_dir),
               "--out", str(out), "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["sets"]) == set(SETS)
    for rows in summary["sets"].values():
        assert list(rows) == list(DEFAULT_MODES)
        for mode, r in rows.items():
            assert r["n"] == 1 and 0 <= r["accuracy"] <= 1 and r["ci95"][0] <= r["accuracy"] <= r["ci95"][1]
            for key in ("f1", "recomputed_fraction", "median_ttft_s", "speedup", "agreement"):
                assert math.isfinite(r[key]), (mode, key)
        assert rows["full"]["agreement"] == 1.0 and rows["preamble"]["recomputed_fraction"] == 0.0
        assert 0 < rows["epic:8"]["recomputed_fraction"] < rows["epic:32"]["recomputed_fraction"] < 1
    assert (out / "quality.md").read_text().count("| mode |") == len(SETS)
    assert (out / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoint_resumes_and_refuses_other_settings(smol_dir, tmp_path):
    """A run cut short resumes from its checkpoint: only the missing questions are answered,
    and the result equals an uninterrupted run's. Other settings are refused by name."""
    import pytest

    from pcache_rag.measure.quality import run_eval

    ck = tmp_path / "ck.json"
    kw = dict(model_path=smol_dir, n=2, doc_tokens=48, max_new_tokens=4, modes=("full", "preamble", "epic:2"),
              sets=("plain",), out_dir=None, log=lambda *a: None)
    whole = run_eval(checkpoint=ck, **kw)
    body = json.loads(ck.read_text())
    for r in body["records"]["plain"].values():  # cut the run short after its first question
        for field in r:
            r[field] = r[field][:1]
    ck.write_text(json.dumps(body))
    lines = []
    resumed = run_eval(checkpoint=ck, **{**kw, "log": lines.append})
    assert any("plain 1 answered" in line for line in lines)
    for m in kw["modes"]:
        a, b = whole["sets"]["plain"][m], resumed["sets"]["plain"][m]
        assert (a["n"], a["correct"], a["f1"]) == (b["n"], b["correct"], b["f1"]), m
    assert len(json.loads(ck.read_text())["records"]["plain"]["full"]["answers"]) == 2
    # the report times only this run's questions, and says how many it took over
    assert whole["config"]["resumed_questions"] == 0 and resumed["config"]["resumed_questions"] == 1
    from pcache_rag.measure.quality import _run_time

    assert "in one run" in _run_time(whole["config"])
    assert "holding 1 answered question (" in _run_time(resumed["config"])
    with pytest.raises(ValueError, match="modes"):
        run_eval(checkpoint=ck, **{**kw, "modes": ("full", "preamble")})
    # the checkpoint keeps each set's input hash: a resumed report states it, and other inputs are refused
    saved = json.loads(ck.read_text())
    assert saved["input_hashes"] == whole["input_hashes"] == resumed["input_hashes"]
    saved["input_hashes"]["plain"] = "0" * 16
    ck.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="other inputs for plain"):
        run_eval(checkpoint=ck, **kw)


def test_oracle_modes_recompute_the_rows_that_hold_the_answer(smol_tok):
    """The diagnostic modes pick their rows from the planted facts: ``oracle:fact`` decodes to
    the fact sentences, ``oracle:answer`` and ``oracle:others`` split the documents between
    them; the rag set refuses them by name."""
    import pytest

    from helpers import tiny_model
    from pcache_rag.measure.quality import ORACLE_MODES, _Synthetic, run_eval

    syn = _Synthetic(tiny_model("llama", len(smol_tok), seed=0), smol_tok)
    sets = build_sets(smol_tok, 3, 80, seed=2)
    for name in ("plain", "cross"):
        for q in sets[name]:
            prompt, policy = syn.request("oracle:fact", q)
            parts = prompt.parts
            lengths = [kv.length for _, kv in parts]
            ids = [int(i) for _, kv in parts for i in kv.token_ids]
            text = smol_tok.decode([ids[r] for r in policy.rows])
            assert len(q.facts) == (2 if name == "cross" else 1)
            for f in q.facts:
                assert f in text.replace("\n", " "), (f, text)
            assert len(policy.rows) < 0.15 * sum(lengths[1:])
            answer = set(syn.request("oracle:answer", q)[1].rows)
            others = set(syn.request("oracle:others", q)[1].rows)
            assert set(policy.rows) <= answer and not answer & others
            assert answer | others == set(range(lengths[0], sum(lengths)))
            holders = sum(any(f in d for f in q.facts) for d in q.docs)
            assert holders == len(q.facts) and len(answer) == sum(
                n for d, n in zip(q.docs, lengths[1:]) if any(f in d for f in q.facts))
    with pytest.raises(ValueError, match="oracle:facts.*end-to-end sets only"):
        run_eval(model_path=None, modes=("full",) + ORACLE_MODES, sets=("plain", "rag"), out_dir=None)


def test_oracle_modes_run_and_report_as_an_appendix(smol_dir, tmp_path, monkeypatch):
    """The oracle modes report as an appendix; the report names the machine and the instruction-set
    caps the run ran under."""
    from pcache_rag.measure.quality import run_eval, write_report

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # read for the report only: oneDNN is loaded already

    ORACLE_MODES = ("oracle:fact", "oracle:answer", "oracle:others")  # oracle:facts: the end-to-end sets only
    modes = ("full", "preamble") + ORACLE_MODES
    s = run_eval(model_path=smol_dir, n=1, doc_tokens=48, max_new_tokens=2, modes=modes, sets=("cross",),
                 out_dir=None, log=lambda *a: None)
    rows = s["sets"]["cross"]
    fact, answer, others = (rows[m]["recomputed_fraction"] for m in ORACLE_MODES)
    assert 0 < fact < answer and 0.5 < answer + others < 1  # the preamble is never recomputed
    md, _ = write_report(s, tmp_path, notes=["A note."], appendix=[("Where the loss comes from", "Oracles.", s)])
    text = md.read_text()
    assert "A note." in text and "## Where the loss comes from" in text and "### Where the loss comes from: cross" in text
    assert text.count("| oracle:fact") == 2  # the main table and the appendix's
    assert s["machine"]["isa_caps"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"} and "capped by ONEDNN_MAX_CPU_ISA=AVX2" in text
    assert "Machine: CPU: " in text


def test_the_agreement_floor_is_full_prefill_with_the_documents_reordered(smol_dir, smol_tok, tmp_path):
    """``full-reordered`` prefills the same documents in the reverse order: the same tokens in
    another order (synthetic and rag sets), decoded apart from ``full``; its agreement with full
    prefill is printed under each table as the floor of every agreement figure."""
    from pcache_rag.measure.quality import REORDERED, _Synthetic, build_sets, run_eval, write_report
    from pcache_rag.default_model import load_model

    m, tok = load_model(str(smol_dir))
    syn = _Synthetic(m, tok)
    q = build_sets(tok, 1, 48)["plain"][0]
    full, again = (list(syn.request(mode, q)[0].new_ids) for mode in ("full", REORDERED))
    assert sorted(full) == sorted(again) and full != again, "the same tokens, the documents in another order"
    s = run_eval(model_path=smol_dir, n=1, doc_tokens=48, max_new_tokens=2, modes=("full", REORDERED, "preamble"),
                 sets=("plain", "rag"), out_dir=None, log=lambda *a: None)
    for rows in s["sets"].values():
        assert rows[REORDERED]["median_prompt_tokens"] == rows["full"]["median_prompt_tokens"]
        assert rows[REORDERED]["recomputed_fraction"] == 1.0 and 0 <= rows[REORDERED]["agreement"] <= 1
    md, _ = write_report(s, tmp_path)
    assert md.read_text().count("Agreement floor: full prefill agrees with itself on") == 2


def test_int8_modes_read_the_same_states_quantized(smol_tok):
    """``MODE@int8`` reads the documents of ``MODE`` quantized as the int8 store keeps them (the
    comparison `bench quality` used to make): same prompts, states within int8's rounding,
    answers in the same batch; full prefill and the rag set refuse it by name."""
    import pytest
    import torch

    from helpers import tiny_model
    from pcache_rag.measure.quality import _Synthetic, encoding_of, run_eval, split_mode, store_of

    assert split_mode("cond:1+epic:16@int8") == ("cond:1+epic:16", None)
    assert encoding_of("cond:1+epic:16@int8") == "cond:1@int8" and encoding_of("preamble") == "preamble"
    with pytest.raises(ValueError, match="full prefill keeps no states"):
        store_of("full@int8")
    syn = _Synthetic(tiny_model("llama", len(smol_tok), seed=0), smol_tok)
    q = build_sets(smol_tok, 1, 48, seed=3)["plain"][0]
    fp, q8 = syn._doc_kv("preamble", q.docs[0]), syn._doc_kv("preamble@int8", q.docs[0])
    assert q8.quantized and not fp.quantized and q8.nbytes() < fp.nbytes()
    back = q8.to(dtype=torch.float32)
    assert torch.equal(back.token_ids, fp.token_ids) and torch.equal(back.position_ids, fp.position_ids)
    err = (back.values - fp.values.float()).abs().max() / fp.values.float().abs().max()
    assert 0 < err < 0.05, err  # quantized for real, and close
    a, _ = syn.request("preamble", q)
    b, _ = syn.request("preamble@int8", q)
    assert a.new_ids == b.new_ids and [kv.length for _, kv in a.parts] == [kv.length for _, kv in b.parts]
    outs = syn.answers(("preamble", "preamble@int8"), q, 4)
    assert len(outs) == 2 and all(o.token_ids for o in outs)
    with pytest.raises(ValueError, match="preamble@int8.*synthetic sets only"):
        run_eval(model_path=None, modes=("full", "preamble@int8"), sets=("plain", "rag"), out_dir=None)


def test_the_sample_corpus_is_the_same_text_in_every_process():
    """pydoc prints memory addresses and file paths; the sample corpus (the demo's files, the
    benchmarks' documents) holds neither, so a demo corpus written once is never rewritten."""
    import subprocess
    import sys

    from pcache_rag.samples import MODULES, stdlib_docs

    code = ("import hashlib; from pcache_rag.samples import MODULES, stdlib_docs; "
            "print(hashlib.sha256(''.join(t for _, t in stdlib_docs(modules=MODULES)).encode()).hexdigest())")
    import hashlib

    here = hashlib.sha256("".join(t for _, t in stdlib_docs(modules=MODULES)).encode()).hexdigest()
    there = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert here == there
    assert not any(" at 0x" in t for _, t in stdlib_docs(modules=MODULES))


@pytest.mark.slow  # two eval runs on the embedded model (about a minute alone); `make test-slow`
def test_learned_mode_reads_its_prefix_and_keys_the_checkpoint(smol_dir, tmp_path):
    """``cond:learned`` encodes the documents after the prefix it is given (learning one only
    where none is), and the prefix is part of the checkpoint's settings: a run with another
    prefix is refused by name instead of mixing answers."""
    from pcache_rag.conditioning import LearnedPrefix
    from pcache_rag.default_model import load_model
    from pcache_rag.engine import PromptCache
    from pcache_rag.measure.quality import run_eval, write_report
    from pcache_rag.rag.learned import initial_embeds

    model, tok = load_model(smol_dir)
    pc = PromptCache(model, tok)
    paths = []
    for shift in (0.0, 0.01):
        p = tmp_path / f"p{shift}.safetensors"
        LearnedPrefix(initial_embeds(pc)[:32] + shift, {"fingerprint": pc.fingerprint}).save(p)
        paths.append(p)
    ck = tmp_path / "ck.json"
    kw = dict(model_path=smol_dir, n=1, doc_tokens=72, max_new_tokens=3, modes=("full", "cond:1", "cond:learned"),
              sets=("plain",), out_dir=None, log=lambda *a: None, checkpoint=ck)
    out = run_eval(prefix=paths[0], **kw)
    spec = LearnedPrefix.load(paths[0]).spec
    assert out["prefix"]["spec"] == spec and out["config"]["prefix"] == spec
    rows = out["sets"]["plain"]
    assert rows["cond:learned"]["recomputed_fraction"] == 0.0 and rows["cond:learned"]["n"] == 1
    assert json.loads(ck.read_text())["config"]["prefix"] == spec
    md, _ = write_report(out, tmp_path / "report")
    assert f"learned prefix `{spec}`" in md.read_text(), "the report says which prefix cond:learned read"
    with pytest.raises(ValueError, match="prefix"):
        run_eval(prefix=paths[1], **kw)


def test_ttft_is_each_requests_alone_where_a_batch_holds_several(smol_tok):
    """In a batch every first token waits for the whole batch's rows and questions, so the
    eval prefills each request of a batch of several again by itself and reports that TTFT;
    the answers stay the batch's. A batch of one is already alone."""
    import torch

    from helpers import tiny_model
    from pcache_rag import PromptCache
    from pcache_rag.measure.quality import _decode_apart, answer_stop

    pc = PromptCache(tiny_model("llama", len(smol_tok), seed=2), smol_tok, store_dtype=torch.float32)
    ids = pc.safe.text("The gate opens at dawn. " * 8)
    doc = pc.encoder.encode(ids, list(range(len(ids))))
    q = pc.safe.text("When does it open?")
    reqs = [(Parts([], ids + q), None), (Parts([("d", doc)], q), None), (Parts([("d", doc)], q), None)]
    alone: list = []
    real = pc.generate

    def spy(prompt, **kw):
        out = real(prompt, **kw)
        alone.append((list(prompt.new_ids), kw))
        return out

    pc.generate = spy
    outs = _decode_apart(pc, ["full", "cond:1", "cond:2"], reqs, max_new_tokens=3)
    assert [n for n, _ in alone] == [q, q] and all(kw == {"recompute": None, "max_new_tokens": 1} for _, kw in alone)
    batch = pc.generate_batch([p for p, _ in reqs[1:]], max_new_tokens=3, stop=answer_stop(pc))
    assert [o.text for o in outs[1:]] == [o.text for o in batch]  # the answers are the batch's
    assert all(o.ttft_s > 0 for o in outs)


def test_question_template_replaces_the_text_after_the_documents(smol_dir, smol_tok, tmp_path):
    """``--question-template``: a framework's own words around the question, on every mode's
    prompt alike (full prefill included); recorded in the config, so a checkpoint never mixes
    prompts; refused on the rag set and without a ``{question}``."""
    import pytest

    from pcache_rag.measure.quality import QUESTION_TEMPLATES, run_eval

    ck = tmp_path / "ck.json"
    kw = dict(model_path=smol_dir, n=1, doc_tokens=48, max_new_tokens=2, modes=("full", "preamble"),
              sets=("plain",), out_dir=None, log=lambda *a: None, checkpoint=ck)
    plain = run_eval(**{**kw, "checkpoint": tmp_path / "plain.json"})
    got = run_eval(question_template="llamaindex", **kw)
    assert got["config"]["question_template"] == QUESTION_TEMPLATES["llamaindex"]
    assert "question_template" not in plain["config"]
    # the template's words are in every prompt: each is longer than the plain "Question: " one
    n_extra = len(smol_tok(QUESTION_TEMPLATES["llamaindex"].replace("{question}", ""))["input_ids"]) - 3
    for m in kw["modes"]:
        assert got["sets"]["plain"][m]["median_prompt_tokens"] >= plain["sets"]["plain"][m]["median_prompt_tokens"] + n_extra, m
    with pytest.raises(ValueError, match="settings|question_template"):  # another prompt: not resumed
        run_eval(**kw)
    with pytest.raises(ValueError, match="rag"):
        run_eval(**{**kw, "sets": ("plain", "rag"), "question_template": "llamaindex"})
    with pytest.raises(ValueError, match="placeholder"):
        run_eval(**{**kw, "question_template": "Query: "})


def test_the_lookalike_set_tells_one_sentence_shape_of_many_places(smol_tok, tmp_path):
    """Issue 56's corpus: every file holds one planted fact, each of the four sentence shapes is a
    quarter of the files, so a question's place has look-alikes about other places; the filler
    comes from two styles; the set is seeded and its splits share no place and no text."""
    from pcache_rag.measure.quality import FILLERS, Filler, lookalike_corpus

    qs, files, corpus = lookalike_corpus(smol_tok, tmp_path / "a", 8, 96, seed=0)
    again, files2, _ = lookalike_corpus(smol_tok, tmp_path / "b", 8, 96, seed=0)
    assert inputs_hash(qs, files) == inputs_hash(again, files2)
    assert sorted(p.name for p in corpus.iterdir()) == sorted(files) and len(files) == 8
    shapes = [q.kind for q in qs]
    assert shapes == ["time", "count", "code", "year"] * 2
    for i, q in enumerate(qs):
        text = files[f"facts-{i:04d}.txt"]
        assert len(q.facts) == 1 and q.facts[0] in text and q.answer in q.facts[0]
        assert sum(f in text for qq in qs for f in qq.facts) == 1  # one planted fact a file
        twin = qs[(i + 4) % 8]  # the same shape about another place: only the place and the value differ
        assert twin.kind == q.kind and twin.question != q.question
    styles = {src: smol_tok.decode(Filler(smol_tok, 96, src).ids) for src in FILLERS}
    assert "License" in styles["legal"] and "License" not in styles["docs"][:20000]
    for i, q in enumerate(qs):  # files 0-3 cut from the documentation, 4-7 from the legal prose
        longest = max(files[f"facts-{i:04d}.txt"].replace(q.facts[0], "").split("\n"), key=len)
        assert len(longest) > 20
        assert (longest in styles["legal"]) == (i >= 4) and (longest in styles["docs"]) == (i < 4), i
    tune, tfiles, _ = lookalike_corpus(smol_tok, tmp_path / "t", 8, 96, seed=0, split="tuning")
    places = lambda qq: {re.findall(r"\b[A-Z][a-z]+\b", q.question)[1] for q in qq}  # noqa: E731
    assert not {q.question for q in qs} & {q.question for q in tune}
    assert not set(files.values()) & set(tfiles.values())
    assert len(places(qs)) == 8 and not places(qs) & places(tune)


def test_rag_oracle_rows_are_the_planted_sentences_of_the_retrieved_chunks(smol_tok):
    """On an end-to-end set an oracle finds its rows in each chunk's own tokens: ``oracle:fact``
    the question's sentence, ``oracle:facts`` every planted sentence of every chunk."""
    from types import SimpleNamespace

    import torch

    from pcache_rag.measure.quality import Question, rag_oracle_rows

    def unit(text):
        ids = smol_tok(text, add_special_tokens=False)["input_ids"]
        return ("u", SimpleNamespace(length=len(ids), token_ids=torch.tensor(ids)))

    facts = ["The last ferry from Ashford leaves at 17:30.", "The last ferry from Penwick leaves at 09:05."]
    parts = [unit("System: answer.\n"), unit("Some filler about modules.\n" + facts[1] + "\nMore filler."),
             unit("Other text.\n" + facts[0] + "\nThe end.")]
    q = Question([], "At what time does the last ferry from Ashford leave?", "17:30", "time", [facts[0]])
    ids = [int(i) for _, kv in parts for i in kv.token_ids]
    one = rag_oracle_rows(smol_tok, "oracle:fact", parts, q, set(facts))
    every = rag_oracle_rows(smol_tok, "oracle:facts", parts, q, set(facts))
    assert facts[0] in smol_tok.decode([ids[r] for r in one]) and facts[1] not in smol_tok.decode([ids[r] for r in one])
    text = smol_tok.decode([ids[r] for r in every])
    assert all(f in text for f in facts) and set(one) < set(every)
    assert min(every) >= parts[0][1].length and len(every) < 0.8 * (len(ids) - parts[0][1].length)
    answer = rag_oracle_rows(smol_tok, "oracle:answer", parts, q, set(facts))
    assert answer == list(range(len(ids) - parts[2][1].length, len(ids)))


def test_the_lookalike_set_runs_end_to_end_with_its_oracles(smol_dir, tmp_path):
    from pcache_rag.measure.quality import run_eval

    modes = ("full", "preamble", "oracle:facts", "match:1")
    s = run_eval(model_path=smol_dir, n=2, doc_tokens=48, k=2, max_new_tokens=2, modes=modes, sets=("lookalike",),
                 out_dir=None, log=lambda *a: None, workdir=tmp_path)
    rows = s["sets"]["lookalike"]
    assert set(rows) == set(modes) and all(r["n"] == 2 for r in rows.values())
    assert rows["preamble"]["recomputed_fraction"] == 0.0
    assert 0 < rows["oracle:facts"]["recomputed_fraction"] < 0.6
    assert (tmp_path / "lookalike" / "corpus").is_dir() and s["input_hashes"]["lookalike"]
