"""Label-free calibration of an index's cached attention (``pcache-rag calibrate``).

Cached chunks were each encoded without the others, so a prompt assembled from them
reads differently from the same text prefilled in full. Calibrated attention
(APE's temperature ``T`` and scale ``S`` on the chunks' keys,
:mod:`pcache_rag.models.attention`) can pull the two back together, and the right
values depend on the model and the corpus. This module chooses them without labels:

1. sample ``n`` prompts from the index itself: ``k`` chunks drawn at random, and a
   question quoting a phrase of one of them;
2. prefill each prompt in full once (the reference), and from the cache under every
   candidate (``none`` and a grid of ``ape:T:S``);
3. score each candidate by the mean KL divergence ``KL(full || cached)`` of the
   next-token distribution at two places: right after the question (the first answer
   token), and after the first ``FORCED`` tokens of full prefill's own greedy answer;
4. choose the lowest. ``none`` wins unless a calibration measures lower.

The choice is kept in the index's manifest with the model's fingerprint, and used by
:class:`~pcache_rag.rag.CachedRAG` by default for that model only.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import torch

from ..engine import Parts
from ..models.attention import Calibration
from .prompt import fit_question

log = logging.getLogger(__name__)

#: candidate (T, S) pairs besides "none"
DEFAULT_GRID = tuple((t, s) for t in (0.7, 0.8, 0.9, 1.0) for s in (0.8, 0.9, 1.0, 1.1))
#: answer tokens forced before the second measured distribution
FORCED = 3


@dataclass(slots=True)
class CalibrationReport:
    """What :func:`calibrate` measured, and its choice."""

    chosen: str  # "none" or "ape:T:S"
    kl: dict[str, float]  # candidate -> mean KL(full || cached), nats
    prompts: int
    k: int
    fingerprint: str
    seconds: float
    top1: dict[str, float] = field(default_factory=dict)  # candidate -> share of argmax equal to full prefill's

    def manifest_entry(self) -> dict:
        return {"attention": self.chosen, "fingerprint": self.fingerprint, "kl": round(self.kl[self.chosen], 5),
                "kl_uncalibrated": round(self.kl["none"], 5), "prompts": self.prompts, "k": self.k}

    def lines(self) -> list[str]:
        out = [f"{'candidate':<14} {'mean KL':>9} {'top-1 agrees':>12}"]
        for c, v in sorted(self.kl.items(), key=lambda kv: kv[1]):
            mark = "  <- chosen" if c == self.chosen else ""
            out.append(f"{c:<14} {v:9.4f} {self.top1.get(c, 0):12.0%}{mark}")
        return out


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp = torch.log_softmax(p_logits.float(), dim=-1)
    lq = torch.log_softmax(q_logits.float(), dim=-1)
    return float((lp.exp() * (lp - lq)).sum())


def quote_question(text: str, r: random.Random) -> str:
    """A question quoting six consecutive words of ``text``, drawn with ``r``."""
    words = text.split()
    at = r.randrange(max(1, len(words) - 6))
    return f'What do the documents say about "{" ".join(words[at:at + 6])}"?'


def cloze_question(text: str, r: random.Random) -> tuple[str, str]:
    """``(question, answer)``: the first part of a line of ``text`` (of ten words or more, where
    there is one) to complete, and the line's own rest, drawn with ``r``. The answer is the
    document's text itself, so a prompt made of it needs no label."""
    lines = [ln.split() for ln in text.splitlines() if len(ln.split()) >= 10] or [text.split()]
    words = lines[r.randrange(len(lines))]
    if len(words) < 6:
        return quote_question(text, r), ""
    cut = max(3, (len(words) * 3) // 5)
    return f'Complete this line from the documents: "{" ".join(words[:cut])} ..."', " ".join(words[cut:])


def sample_prompts(rag, n: int, k: int, seed: int = 0, cloze: bool = False) -> list[tuple[list, str, str]]:
    """``n`` prompts ``(handles, question, answer)`` drawn from ``rag``'s index: ``k`` distinct
    chunks (fewer if the index has fewer), and a question quoting six words of one of them
    (``answer`` empty), or with ``cloze`` a line of one to complete and its rest
    (:func:`cloze_question`)."""
    from .types import ModuleHandle

    ids = sorted(cid for cid, _ in rag.index.chunks())
    if not ids:
        raise ValueError(f"the index {rag.index_dir} has no chunks to calibrate on: ingest documents first")
    r = random.Random(seed)
    out = []
    for _ in range(n):
        pick = r.sample(ids, min(k, len(ids)))
        got = rag.index.get(pick)
        pick = [cid for cid in pick if cid in got]
        if not pick:
            continue
        target = got[pick[r.randrange(len(pick))]][0]
        question, answer = cloze_question(target, r) if cloze else (quote_question(target, r), "")
        handles = [ModuleHandle(id=cid, score=float(len(pick) - j), kv_key=got[cid][1]["kv_key"],
                                source=got[cid][1]["source"], text=got[cid][0],
                                n_tokens=int(got[cid][1].get("n_tokens", 0)), metadata=dict(got[cid][1]))
                   for j, cid in enumerate(pick)]
        out.append((handles, question, answer))
    return out


@torch.no_grad()
def calibrate(rag, n: int = 24, k: int | None = None, grid=DEFAULT_GRID, seed: int = 0,
              progress: bool = True) -> CalibrationReport:
    """Measure every candidate on ``n`` prompts sampled from ``rag``'s index and return the
    report (see the module docstring); :meth:`CachedRAG.save_calibration` keeps its choice."""
    pc = rag.pc
    adapter = pc.adapter
    if adapter.family == "alibi" or adapter.constrained:
        why = "ALiBi" if adapter.family == "alibi" else adapter.constrained
        raise ValueError(f"calibration tunes calibrated attention, which models with {why} cannot use")
    k = rag.k if k is None else k
    t0 = time.perf_counter()
    prompts = sample_prompts(rag, n, k, seed)
    cands = ["none"] + [Calibration(t, s).spec for t, s in grid if (t, s) != (1.0, 1.0)]
    kl = {c: [] for c in cands}
    top1 = {c: [] for c in cands}
    it = prompts
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(prompts, desc="calibrating", unit="prompt")
    for handles, question, _ in it:
        q_ids = fit_question(rag, question, handles, FORCED + 1)
        full_ids = rag.full_prompt_ids(question, handles)
        forced = pc.generate(Parts([], full_ids), max_new_tokens=FORCED).token_ids  # full prefill's own answer
        # one forward gives both references: after the question, and after the forced tokens
        refs = pc.core.full_prefill(torch.tensor(full_ids + forced), last=len(forced) + 1)
        refs = [refs[0], refs[-1]]
        parts = rag.chunks.parts(handles)
        for c in cands:
            cal = None if c == "none" else c
            for new, want in ((q_ids, refs[0]), (q_ids + forced, refs[1])):
                got = pc.prefill(Parts(parts, new, preamble="preamble", calibration=cal)).logits
                kl[c].append(_kl(want, got))
                top1[c].append(float(int(got.argmax()) == int(want.argmax())))
    if not prompts:
        raise ValueError("no prompt could be sampled from the index")
    mean = {c: sum(v) / len(v) for c, v in kl.items()}
    chosen = min(cands, key=lambda c: (mean[c], c != "none"))
    return CalibrationReport(chosen, mean, len(prompts), k, pc.fingerprint, time.perf_counter() - t0,
                             {c: sum(v) / len(v) for c, v in top1.items()})


__all__ = ["calibrate", "CalibrationReport", "cloze_question", "quote_question", "sample_prompts", "DEFAULT_GRID"]


def resolve_calibration(arg: str | None, manifest: dict, fingerprint: str) -> tuple[str | None, str]:
    """``(the calibration answers use, where it comes from)``: ``arg`` (``None``, ``"auto"``
    or a spec), or with ``"auto"`` the index's own when it was chosen for this model."""
    from ..models.attention import Calibration

    if arg not in (None, "auto"):
        c = Calibration.parse(arg)
        return (c.spec if c else None), "given"
    if arg is None:
        return None, "given"
    saved = manifest.get("calibration") or {}
    if not saved:
        return None, "none: the index was not calibrated"
    if saved.get("fingerprint") != fingerprint:
        return None, "none: the index was calibrated for another model or settings"
    att = saved.get("attention", "none")
    return (None if att == "none" else att), (f"the index's (KL {saved.get('kl', 0):.4f} against "
                                              f"{saved.get('kl_uncalibrated', 0):.4f} uncalibrated)")


_warned: set[tuple[str, str]] = set()


def answer_settings(gen: dict, recompute: str | None, calibration: str | None) -> dict:
    """``gen`` with an index's recompute policy and calibration, unless the call sets them. A
    policy that recomputes runs uncalibrated: the two do not combine (said once per pair)."""
    gen.setdefault("recompute", recompute)
    if "calibration" in gen:
        return gen
    from ..recompute import Recompute

    rc = gen.get("recompute")
    if calibration is not None and rc is not None and Recompute.parse(rc).kind != "none":
        if (str(rc), calibration) not in _warned:
            log.warning("recompute %s runs without the index's calibrated attention (%s): they do not combine",
                        rc, calibration)
            _warned.add((str(rc), calibration))
        calibration = None
    gen["calibration"] = calibration
    return gen


def calibrate_index(rag, n: int = 24, k: int | None = None, progress: bool = True, save: bool = True,
                    grid=None) -> CalibrationReport:
    """:func:`calibrate` on ``rag``'s index; with ``save`` the choice goes into its manifest
    (under the ingest lock), where every process serving the index sees it."""
    rag.upkeep.refresh()
    rep = calibrate(rag, n=n, k=k, progress=progress, grid=DEFAULT_GRID if grid is None else grid)
    if save:
        lock = rag.folder.lock()
        try:
            rag.live.manifest = dict(rag.folder.manifest(quiet=True) or rag.manifest)
            rag.manifest["calibration"] = rep.manifest_entry()
            rag.upkeep.commit()
        finally:
            lock.release()
    return rep
