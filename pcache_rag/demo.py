"""The main job: ingest a sample corpus and answer questions, cached vs full prefill.

The corpus is built at run time from real text already on the machine: the
plain-text documentation (``pydoc``) of Python standard-library modules, one
file per module. The project ships no third-party prose. The index lives in
``~/.cache/pcache-rag/demo-index`` (or ``--index``), so a second run re-uses
every encoded chunk and only answers.
"""

from __future__ import annotations

import time
from pathlib import Path

from .samples import QUESTIONS, build_corpus


def _say_conditioning(rag) -> None:
    """Which conditioning the index's chunks are encoded under, and where a better one exists."""
    from .conditioning import installed_prefix
    from .docmodules.states import takes_prefix

    cond = rag.asm.conditioning
    print(f"documents are encoded after: {cond}")
    if cond.startswith("learned"):
        print("  the learned conditioning prefix for this model (pcache-rag ships the embedded model's): with the "
              "default recompute, match:1,\n  cached answers stay within 3 points of full prefill's on the eval "
              "(docs/quality.md)")
        return
    if not takes_prefix(rag.pc):
        return
    have = installed_prefix(rag.asm.fingerprint)
    if have is None:
        print("  no learned prefix is installed for this model: `make prefix` (pcache-rag install-prefix) learns one "
              "once,\n  about 50 min on two cores, and brings cached answers closer to full prefill's (README, "
              "'Learned conditioning')")
    else:
        print(f"  this index was built before {have.spec} was installed and keeps {cond}; a new --index uses it")


def _against(per_token: float, floors, positions: int) -> str:
    """How far a token's time is from the weights' floor, and from the floor with the keys and
    values attention reads at this many cached positions, against each of ``floors`` (each a
    :class:`~.measure.decode_bench.Floor`, read just before and just after the answer: this
    machine's read bandwidth moves by half from minute to minute, so a floor read once at start
    can be far from the bandwidth an answer decoded at)."""
    w = " / ".join(f"{per_token / f.weights_ms:.1f}x" for f in floors)
    c = " / ".join(f"{per_token / f.with_cache_ms(positions):.1f}x" for f in floors)
    gb = " / ".join(f"{f.gb_s:.1f}" for f in floors)
    return f" ({w} the weights' floor at {gb} GB/s read before / after it; {c} with the cache it reads)"


def run_demo(a) -> int:
    from .fsutil import cache_home
    from .rag import CachedRAG, Index

    index = Index(Path(a.index) if a.index else cache_home() / "demo-index")
    corpus = build_corpus(cache_home() / "sample-corpus")
    t = time.perf_counter()
    pc = index.engine(a.model)
    print(f"model: {pc.model.config.model_type} ({sum(p.numel() for p in pc.model.parameters()) / 1e6:.0f}M), "
          f"loaded in {time.perf_counter() - t:.1f}s; encoding={pc.encoding}; decoding: {pc.core.decode_path}; "
          f"rows over cached states: {pc.core.query_weights} weights")
    from .measure.decode_bench import step_floor

    floor = step_floor(pc)
    if floor is not None:
        print(f"  the decode step's weight-streaming floor: {floor.weights_ms:.1f} ms a token (its weights at this "
              f"machine's {floor.gb_s:.1f} GB/s read bandwidth, measured now), plus {floor.kv_ms_per_1000:.1f} ms for "
              "every 1,000 cached positions attention reads")
    rag = CachedRAG(index, pc=pc, k=4)
    _say_conditioning(rag)
    rep = rag.ingest([corpus])
    print(f"corpus: {len(list(corpus.glob('*.txt')))} files from the stdlib docs -> {rag.index.count()} chunks; "
          f"{rep.chunks_encoded} encoded now, {rep.unchanged} files unchanged ({rep.seconds:.1f}s)\n")
    for q in QUESTIONS:
        handles = rag.retrieve(q)
        before = step_floor(pc) if floor is not None else None
        cached = rag.answer(q, handles=handles, max_new_tokens=a.max_new_tokens)
        beside = [before, step_floor(pc)] if before is not None else []
        full = rag.answer_full_prefill(q, handles=handles, max_new_tokens=1)
        print(f"Q: {q}\nA: {cached.text.strip()}")
        print("   sources: " + ", ".join(f"{Path(h.source).name}#{h.metadata.get('chunk')}" for h in handles))
        out = cached.output
        per_token = (out.total_s - out.ttft_s) / max(len(out.token_ids) - 1, 1) * 1000
        print(f"   ttft cached {cached.ttft_s * 1000:.0f} ms vs full prefill {full.ttft_s * 1000:.0f} ms "
              f"(x{full.ttft_s / cached.ttft_s:.1f}); {out.cached_tokens} tokens cached, "
              f"{out.computed_tokens} computed; {len(out.token_ids)} tokens decoded at {per_token:.0f} ms a token"
              + (_against(per_token, beside, out.cached_tokens + out.computed_tokens) if beside else "")
              + "\n")
    rag.close()
    return 0
