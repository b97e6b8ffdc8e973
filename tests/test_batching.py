"""Continuous batching (:mod:`pcache_rag.engine.scheduler`): requests with different
documents, lengths and positions decode together and each gets exactly what it gets alone.

Tiny random models of each family that can batch (RoPE with grouped heads, learned
positions, and Gemma 3's sliding windows and per-layer RoPE, each sequence counting its
window over its own positions); ALiBi decodes alone and says so."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pcache_rag import PromptCache, SamplingParams
from pcache_rag.engine import ContextOverflowError
from pcache_rag.engine.scheduler import Request, Scheduler, parts_request, run_batch
from pcache_rag.kv import RequestKV

from helpers import adapter_of, contiguous_parts, tiny_model, wait_until
from pcache_rag.engine import Parts

TEXTS = [" The gate code of the north door is 4417 and it opens at dawn.",
         " A heron stood in the shallow river, watching the silver fish below.",
         " The library keeps maps of the old harbour in its basement archive.",
         " Copper wire conducts heat and electricity better than most metals."]


def _engine(family: str, tok, seed: int = 4) -> PromptCache:
    model = tiny_model(family, len(tok), seed=seed)
    with torch.no_grad():  # sharper attention: what a token reads changes its logits visibly
        for name, p in model.named_parameters():
            if any(t in name for t in ("q_proj", "k_proj", "c_attn")):
                p.mul_(4.0)
    return PromptCache(model, tok, encoding="isolated", store_dtype=None)


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2", "gemma3"])
def pc(request, smol_tok):
    return _engine(request.param, smol_tok)


def _requests(pc):
    """Five prompts of different lengths, documents and positions (one with nothing cached)."""
    a, qa = contiguous_parts(pc, TEXTS[:3])
    b, qb = contiguous_parts(pc, TEXTS[1:2], " What stood in the river? It was")
    c, qc = contiguous_parts(pc, TEXTS[3:] + TEXTS[:1], " Which metal?")
    plain = pc.safe.text(TEXTS[2] + " Where are the maps?")
    return [(a, qa), (b, qb), (c, qc), ([], plain), (a[:1], qc)]


def test_a_ragged_step_gives_each_sequence_its_solo_logits(pc):
    """One forward for sequences of different lengths, each over its own rows (one decoding a
    token, one prefilling a chunk of four), equals each sequence's own step to 1e-4 (batched
    projections round differently, nothing else)."""
    from pcache_rag.engine.runner import _RaggedLayer
    from pcache_rag.models.attention import Forward, Positions, RaggedStep
    from transformers.cache_utils import Cache

    seqs, solo = [], []
    for j, (parts, new) in enumerate(_requests(pc)):
        res = pc.prefill(Parts(parts, new), reserve=8)
        kv = RequestKV.from_workspace(pc.workspace, 8)
        nxt = int(res.position_ids.max()) + 1
        toks = [int(torch.argmax(res.logits))] if j % 2 == 0 else pc.safe.text(" and then it")[:4]
        one = RequestKV(kv.k.clone(), kv.v.clone(), kv.length)
        pos = torch.arange(nxt, nxt + len(toks))
        key_pos = torch.cat([res.position_ids, pos]) if adapter_of(pc).window else None
        solo.append(adapter_of(pc).forward(torch.tensor(toks), pos, one.cache(), None, key_pos)[-1])
        seqs.append((kv, toks, pos, key_pos))
    assert len({kv.length for kv, *_ in seqs}) == len(seqs), "the lengths must differ, or the step is not ragged"
    step = RaggedStep([kv.k for kv, *_ in seqs], [kv.v for kv, *_ in seqs], [kv.length for kv, *_ in seqs],
                      [len(t) for _, t, *_ in seqs], [None] * len(seqs))
    if adapter_of(pc).window:
        step.positions = [Positions.of(pos, key_pos) for *_, pos, key_pos in seqs]
    like = seqs[0][0].k[0, None, :, :0]
    cache = Cache(layers=[_RaggedLayer(step, i, 0, like) for i in range(seqs[0][0].k.shape[0])])
    ends = torch.tensor(step.counts).cumsum(0) - 1
    got = adapter_of(pc).forward(torch.tensor([t for _, ts, *_ in seqs for t in ts]), torch.cat([p for *_, p, _ in seqs]),
                                 cache, None, None, logits_to_keep=ends, fwd=Forward(step=step))
    assert step.calls == adapter_of(pc).kv_shape.n_layers
    for b, want in enumerate(solo):
        assert (got[b] - want).abs().max() < 1e-4, b
    assert (solo[0] - solo[2]).abs().max() > 1e-2, "different prompts must give different logits"


def test_batched_answers_equal_one_at_a_time(pc):
    """generate_batch: every prompt's greedy tokens, text, counts and finish reason equal its
    generate answer."""
    reqs = _requests(pc)
    batch = pc.generate_batch([Parts(p, n) for p, n in reqs], max_new_tokens=8)
    for (p, n), got in zip(reqs, batch):
        one = pc.generate(Parts(p, n), max_new_tokens=8)
        assert got.token_ids == one.token_ids and got.text == one.text
        assert (got.cached_tokens, got.computed_tokens, got.finish_reason) == (
            one.cached_tokens, one.computed_tokens, one.finish_reason)
        assert got.decode_batch == len(reqs) and one.decode_batch == 1
    assert len({tuple(b.token_ids) for b in batch}) > 2, "the prompts must not all agree, or the check is weak"


def _prep(pc, parts, new):
    """The engine's own prefill in its workspace, as a batch request runs it (the step holds the lock)."""
    return pc.dispatch.prepare_parts(Parts(parts, list(new)), pc.policy(None))


def _direct(pc, parts, new, params):
    """A batch request whose new tokens are prefilled in the batch's own steps."""
    return parts_request(pc.core, parts, list(new), params, _prep(pc, parts, new), True)


def _solo(pc, parts, new, params):
    return pc.generate(Parts(parts, new), params=params)


def test_requests_join_and_leave_a_running_batch(pc):
    """With batching on, streams started from several threads at different times (greedy and
    seeded sampling, stop strings, different lengths) each equal their solo answer, while they
    shared decode steps with others."""
    reqs = _requests(pc)
    solo_txt = _solo(pc, *reqs[0], SamplingParams(max_new_tokens=12)).text
    stop = solo_txt[3:6] if len(solo_txt) > 6 and solo_txt[3:6].strip() else None
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=5),
              SamplingParams(max_new_tokens=10, do_sample=True, temperature=0.9, top_p=0.9, seed=7),
              SamplingParams(max_new_tokens=9), SamplingParams(max_new_tokens=12, stop=(stop,) if stop else ())]
    want = [_solo(pc, p, n, sp) for (p, n), sp in zip(reqs, params)]
    got: list = [None] * len(reqs)
    sched = pc.start_batching(max_batch=8)
    try:
        def run(i):
            time.sleep(0.02 * i)  # arrive one after another: later ones join a running batch
            stream = pc.stream(Parts(*reqs[i]), params=params[i])
            deltas = list(stream)
            got[i] = (stream.output, "".join(deltas))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = sched.stats()
    finally:
        pc.stop_batching()
    for i, (w, g) in enumerate(zip(want, got)):
        assert g is not None, i
        out, text = g
        assert out.token_ids == w.token_ids and out.text == w.text == text, i
        assert out.finish_reason == w.finish_reason, i
    assert stats["max_batch_seen"] >= 2 and stats["steps"] < sum(len(w.token_ids) for w in want)
    assert stats["finished"] == len(reqs) and stats["live"] == 0 and stats["live_rows"] == 0
    assert max(g[0].decode_batch for g in got) >= 2


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(pc):
    """A prompt with more new tokens than the step budget is prefilled in chunks over its own
    rows: the same answer and counts as one prefill, while the stream already running kept
    decoding in the same steps; a prompt prefilled by the engine (recompute) joins as well."""
    parts, q = contiguous_parts(pc, TEXTS[:1])
    long_ids = pc.safe.text(" ".join(TEXTS) * 2)
    assert len(long_ids) > 3 * 16
    want_long = pc.generate(Parts(parts, long_ids), max_new_tokens=6)
    want_short = pc.generate(Parts(parts, q), max_new_tokens=20)
    want_epic = pc.generate(Parts(parts, q), recompute="epic:2", max_new_tokens=6)
    sched = Scheduler(pc.core, max_batch=4, prefill_tokens=16)
    short = sched.submit(_direct(pc, parts, q, SamplingParams(max_new_tokens=20)))
    sched.step()
    sched.step()  # the short one is decoding
    epic = Request(SamplingParams(max_new_tokens=6), 200,
                   prepare=pc.dispatch.prepare_parts(Parts(parts, q), pc.policy("epic:2")))
    outs = run_batch(sched, [_direct(pc, parts, long_ids, SamplingParams(max_new_tokens=6)), epic])
    got_short = list(short.items())[-1]
    assert outs[0].token_ids == want_long.token_ids and outs[1].token_ids == want_epic.token_ids
    assert (outs[0].cached_tokens, outs[0].computed_tokens) == (want_long.cached_tokens, want_long.computed_tokens)
    assert (outs[1].recomputed_tokens, outs[1].computed_tokens) == (want_epic.recomputed_tokens,
                                                                     want_epic.computed_tokens)
    assert got_short.token_ids == want_short.token_ids
    assert sched.counts["chunks"] >= len(long_ids) // 16
    # all three shared the steps; with a fused decode step the decoding rows take it, as alone, and
    # the long prompt's chunks a forward of their own in the same scheduler step
    assert sched.counts["max_batch_seen"] == (2 if pc.core.decoder.step is not None else 3)


def test_prompts_with_nothing_cached_are_prefilled_together_whatever_the_policy(pc):
    """A prompt with no cached part has no context to recompute, so the policy cannot matter:
    under ``epic:2`` too it is prefilled in the batch's steps, several in one forward (a solo
    prefill each cost a whole forward of the model), to the answers each gets alone."""
    plains = [pc.safe.text(t + " Say it again:") for t in TEXTS]
    want = [pc.generate(Parts([], ids), recompute="epic:2", max_new_tokens=8) for ids in plains]
    batch = [pc.dispatch.request(Parts([], list(ids)), pc.policy("epic:2"), SamplingParams(max_new_tokens=8))
             for ids in plains]
    assert all(r.prepare is None for r in batch)  # the steps prefill them, not the engine
    sched = Scheduler(pc.core, 4, 4096, None)
    outs = run_batch(sched, batch)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    assert [(o.cached_tokens, o.computed_tokens) for o in outs] == [(0, len(ids)) for ids in plains]
    assert sched.counts["prefills"] == 0 and sched.counts["chunks"] == len(plains)
    # one forward took every prompt: the first step had all four chunks
    assert sched.counts["max_batch_seen"] == len(plains)
    # with a cached part the policy matters, and the engine prefills it (recomputed rows)
    parts, q = _requests(pc)[0]
    assert pc.dispatch.request(Parts(parts, q), pc.policy("epic:2"), SamplingParams()).prepare is not None


def test_a_cancelled_request_leaves_the_batch_and_frees_its_rows(pc):
    parts, q = _requests(pc)[0]
    sched = pc.start_batching(max_batch=4)
    try:
        keep = pc.stream(Parts(parts, q), max_new_tokens=24)
        gone = pc.stream(Parts(parts, q), max_new_tokens=24)
        next(iter(gone), None)
        gone.close()
        out = keep.result()
        wait_until(lambda: not sched.stats()["live"], "the cancelled request never left the batch")
        st = sched.stats()
    finally:
        pc.stop_batching()
    assert out.token_ids == pc.generate(Parts(parts, q), max_new_tokens=24).token_ids
    assert st["cancelled"] == 1 and st["live"] == 0 and st["live_rows"] == 0


def test_the_first_token_is_sampled_before_the_rows_are_copied(pc, monkeypatch):
    """A request the engine prefills (recomputed rows) takes its first token from the workspace's
    logits before its rows are copied out (the copy is the decode's cost, not TTFT's): an answer
    of one token never copies, and a copy that fails fails that request only."""
    from pcache_rag.engine import runner as sched_mod

    reqs = _requests(pc)[:3]
    real = RequestKV.from_workspace
    seen: list[int] = []

    def spy(ws, extra, positions=None):
        seen.append(extra)
        return real(ws, extra, positions)

    monkeypatch.setattr(sched_mod.RequestKV, "from_workspace", staticmethod(spy))
    one = pc.generate_batch([Parts(p, n) for p, n in reqs], "epic:2", max_new_tokens=1)
    assert seen == [] and all(len(o.token_ids) == 1 for o in one)
    assert [o.token_ids for o in one] == [pc.generate(Parts(p, n), recompute="epic:2", max_new_tokens=1).token_ids
                                          for p, n in reqs]
    pc.generate_batch([Parts(p, n) for p, n in reqs], "epic:2", max_new_tokens=2)
    assert seen == [2, 2, 2]

    calls = {"n": 0}

    def failing_second(ws, extra, positions=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise MemoryError("no room for the copy")
        return real(ws, extra, positions)

    monkeypatch.setattr(sched_mod.RequestKV, "from_workspace", staticmethod(failing_second))
    batch = [pc.dispatch.request(Parts(p, list(n)), pc.policy("epic:2"), SamplingParams(max_new_tokens=6))
             for p, n in reqs]
    sched = Scheduler(pc.core, 4, 4096, None)
    for r in batch:
        sched.submit(r)
    sched.run_until_idle()
    with pytest.raises(MemoryError, match="no room"):
        list(batch[1].items())
    for i in (0, 2):
        *_, out = batch[i].items()
        assert out.token_ids == pc.generate(Parts(*reqs[i]), recompute="epic:2", max_new_tokens=6).token_ids
    assert sched.stats()["live"] == 0


def test_the_row_budget_makes_requests_wait_and_refuses_what_can_never_fit(pc):
    reqs = _requests(pc)
    sizes = [sum(kv.length for _, kv in p) + len(n) + 6 for p, n in reqs[:2]]
    sched = Scheduler(pc.core, max_batch=8, kv_budget=max(sizes))
    batch = [_direct(pc, p, n, SamplingParams(max_new_tokens=6)) for p, n in reqs[:2]]
    assert [r.rows for r in batch] == sizes
    outs = run_batch(sched, batch)
    assert sched.counts["max_batch_seen"] == 1  # the second waited for the first's rows
    for (p, n), o in zip(reqs[:2], outs):
        assert o.token_ids == pc.generate(Parts(p, n), max_new_tokens=6).token_ids
    with pytest.raises(ContextOverflowError, match="KV rows"):
        sched.submit(Request(SamplingParams(), max(sizes) + 1, prepare=_prep(pc, *reqs[0])))


def test_a_grammar_constrained_answer_decodes_in_the_batch(pc):
    from pcache_rag.grammar import regex_grammar

    parts, q = _requests(pc)[0]
    g = regex_grammar(r"[0-9]{4}")
    want = pc.generate(Parts(parts, q), grammar=g, max_new_tokens=8)
    pc.start_batching()
    try:
        other = pc.stream(Parts(parts, q), max_new_tokens=8)
        got = pc.stream(Parts(parts, q), grammar=g, max_new_tokens=8).result()
        other.result()
    finally:
        pc.stop_batching()
    assert got.token_ids == want.token_ids and got.text == want.text
    assert len(got.text) == 4 and got.text.isdigit()


def test_one_failing_request_ends_alone_and_the_others_answer_as_alone(pc, monkeypatch):
    """A batch of 8 where one request's decoding raises at its third token (as a grammar it
    breaks, or a callback of its own, would): it alone gets that error, and the other seven
    finish with exactly their solo answers (before, the whole batch failed with its error)."""
    reqs = [_requests(pc)[i % 5] for i in range(8)]
    want = [pc.generate(Parts(p, n), max_new_tokens=6).token_ids for p, n in reqs]
    start = pc.core.decoder.start
    started = []

    def poisoned_start(*a, **kw):
        seq = start(*a, **kw)
        started.append(seq)
        if len(started) == 4:  # the fourth request to start decoding
            push, calls = seq.push, []

            def push_then_fail(logits):
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("token 39428 violates the grammar")
                return push(logits)
            seq.push = push_then_fail
        return seq

    monkeypatch.setattr(pc.core.decoder, "start", poisoned_start)
    sched = Scheduler(pc.core, max_batch=8)
    handles = [sched.submit(_direct(pc, p, n, SamplingParams(max_new_tokens=6))) for p, n in reqs]
    sched.run_until_idle()
    results = []
    for h in handles:
        try:
            results.append(list(h.items())[-1].token_ids)
        except RuntimeError as e:
            results.append(str(e))
    assert results.count("token 39428 violates the grammar") == 1
    assert [r for r in results if not isinstance(r, str)] == [w for w, r in zip(want, results) if not isinstance(r, str)]
    assert sched.counts["failed"] == 1 and sched.counts["finished"] == 7 and sched.counts["max_batch_seen"] >= 7
    assert sched.stats()["live"] == 0 and sched.live_rows == 0


def test_a_stalled_batch_fails_what_waits_on_it_and_frees_its_rows(pc):
    """The batch makes no step (the engine is held, as a wedged kernel would hold it) for longer
    than the stall limit: the requests waiting on it end with StalledError at once, before the
    engine is free; once it is, their rows are dropped and the next request answers as alone."""
    from pcache_rag.engine import StalledError

    parts, q = _requests(pc)[0]
    want = pc.generate(Parts(parts, q), max_new_tokens=4).token_ids
    sched = Scheduler(pc.core, stall_s=0.3)
    sched.start()
    try:
        with pc.exclusive():
            reqs = [sched.submit(_direct(pc, parts, q, SamplingParams(max_new_tokens=4))) for _ in range(2)]
            for r in reqs:
                with pytest.raises(StalledError, match="made no progress"):
                    list(r.items())
            assert sched.stats()["stalled"] == 2
        wait_until(lambda: not sched.requests() and sched.live_rows == 0, "the stalled rows were never dropped")
        again = sched.submit(_direct(pc, parts, q, SamplingParams(max_new_tokens=4)))
        *_, out = again.items()
        assert out.token_ids == want
        assert sched.watchdog.check() == 0, "a batch that steps stalls nothing"
    finally:
        sched.stop()


def test_alibi_decodes_alone_and_says_so(smol_tok):
    pc = _engine("bloom", smol_tok)
    parts, q = contiguous_parts(pc, TEXTS[:2])
    want = pc.generate(Parts(parts, q), max_new_tokens=5)
    pc.start_batching()
    try:
        got = pc.generate(Parts(parts, q), max_new_tokens=5)
    finally:
        pc.stop_batching()
    assert got.token_ids == want.token_ids
    assert "ALiBi" in got.unbatched and got.decode_batch == 1 and want.unbatched == ""


def test_stopping_the_batch_fails_what_waits_instead_of_hanging(pc):
    parts, q = _requests(pc)[0]
    sched = Scheduler(pc.core)  # never started: requests wait
    req = sched.submit(_direct(pc, parts, q, SamplingParams()))
    sched.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        list(req.items())
    with pytest.raises(RuntimeError, match="stopped"):
        sched.submit(Request(SamplingParams(), 100, prepare=_prep(pc, parts, q)))


def test_release_pool_hands_back_this_threads_openmp_workers():
    """A thread that ran a parallel kernel keeps OpenMP workers (OS threads); release_pool
    ends them, and the thread's next kernel builds a pool again and computes the same."""
    import os

    from pcache_rag.engine.threads import has_pool_release, release_pool

    if not has_pool_release():
        pytest.skip("PyTorch here does not run on a bundled libgomp: release_pool does nothing")
    if torch.get_num_threads() < 2 or not os.path.isdir("/proc/self/task"):
        pytest.skip("needs at least 2 intra-op threads and /proc to count OS threads")

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    a = torch.randn(512, 512)
    first = a @ a  # a parallel region: this thread's pool exists from here on
    with_pool = threads()
    assert release_pool()
    wait_until(lambda: threads() < with_pool, "no worker of the pool ended")
    wait_until(lambda: threads() <= with_pool - (torch.get_num_threads() - 1), "the pool's workers did not all end")
    released = threads()
    assert released <= with_pool - (torch.get_num_threads() - 1), "the pool's workers ended"
    assert torch.equal(a @ a, first)
    assert threads() >= released + torch.get_num_threads() - 1, "the next region built a pool again"


def test_serve_defaults_are_the_engines():
    """`serve --prefill-tokens` and `--stall-timeout` default to the scheduler's own figures
    (the CLI writes them out, since it imports no torch), and so does `serve()`."""
    import inspect

    from pcache_rag.cli import build_parser
    from pcache_rag.engine.scheduler import DEFAULT_PREFILL_TOKENS
    from pcache_rag.engine.watchdog import DEFAULT_STALL_S
    from pcache_rag.serve import serve

    args = build_parser().parse_args(["serve", "--index", "x"])
    assert args.prefill_tokens == DEFAULT_PREFILL_TOKENS
    assert args.stall_timeout == DEFAULT_STALL_S == inspect.signature(serve).parameters["stall_timeout"].default
