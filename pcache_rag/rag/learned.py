"""Learned conditioning (``pcache-rag calibrate --learn``): a prefix trained so that cached
chunks read, to the question, as they do inside a full prefill.

Conditioned encoding (:mod:`pcache_rag.conditioning`) encodes every chunk after the
preamble and a fixed neutral passage. A learned prefix starts from that passage's own
input embeddings and moves them by gradient descent to lower the KL divergence between

* the **teacher**: the model's next-token distributions when the prompt (preamble,
  chunks, question) is prefilled in full, and
* the **student**: the same distributions when the prompt is assembled from chunks
  encoded one by one after the prefix and moved to their slots (the cached path),

at the first answer token and after each of the first :data:`FORCED` tokens of the
teacher's own greedy answer. No labels are needed: the targets are the model's own. Only
the prefix trains; the model's weights never change, so full prefill, the preamble and the
question are computed exactly as before. The cost is paid once, at calibration (about
10 s a step for four 400-token chunks on two CPU cores); query time is unchanged, since the
prefix is never part of a prompt.

The student is differentiable end to end: chunk states are encoded with the engine's own
adapter over explicit masks (which :func:`~pcache_rag.models.attention.pcache_sdpa` serves with
the stock differentiable kernel) and re-rotated with the engine's own RoPE rotation. It
equals the engine's cached path (tested), so what the training lowers is what answers read.

Served for RoPE models whose every layer attends globally; windowed or soft-capped
attention and other position models are refused by name.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from ..conditioning import LearnedPrefix, neutral_text
from ..engine import PromptCache
from ..engine.mask import context_mask
from ..models.rope import RopeAdapter, rerotate

log = logging.getLogger(__name__)

#: answer tokens of the teacher's greedy answer forced before the later measured distributions
FORCED = 3
#: tokens of a cloze prompt's own answer (the rest of the line) forced likewise
FORCED_CLOZE = 6
#: Adam's learning rate on the embeddings (their entries have a standard deviation of ~0.1)
DEFAULT_LR = 1e-3


@dataclass(slots=True)
class Prompt:
    """One training or validation prompt: chunk token ids in slot order, the question's ids
    (the question, the end of the user turn and the generation prompt) and, for a line to
    complete, the line's own rest (``answer``: forced instead of the teacher's greedy answer)."""

    docs: list[list[int]]
    question: list[int]
    answer: list[int] = field(default_factory=list)


@dataclass(slots=True)
class LearnReport:
    """What :func:`learn_prefix` measured, and the prefix it chose."""

    prefix: LearnedPrefix
    kl_init: float  # mean validation KL(full || cached) with the initial prefix (the neutral passage)
    kl_none: float  # ... with no conditioning at all (the paper's semantics)
    kl_learned: float  # ... with the chosen prefix
    improved: bool  # whether the learned prefix measured lower than the initial one
    steps: int
    train_prompts: int
    val_prompts: int
    seconds: float
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, validation KL) after each epoch

    def lines(self) -> list[str]:
        out = [f"{'conditioning':<22} {'validation KL':>13}",
               f"{'none':<22} {self.kl_none:13.4f}",
               f"{'neutral (start)':<22} {self.kl_init:13.4f}",
               f"{self.prefix.spec:<22} {self.kl_learned:13.4f}" + ("  <- chosen" if self.improved else "")]
        out += [f"  after step {s}: {v:.4f}" for s, v in self.curve]
        return out


def check_trainable(pc: PromptCache) -> None:
    """Refuse, by name, a model whose cached path the trainer cannot differentiate exactly."""
    a = pc.adapter
    if a.family != "rope" or not a.rerotatable:
        raise ValueError(f"a learned conditioning prefix is trained on RoPE models whose states move; "
                         f"{pc.model_type} has {a.family} positions"
                         + ("" if a.family != "rope" else f" (rope_type {getattr(a, 'rope_type', '?')})"))
    if a.constrained:
        raise ValueError(f"a learned conditioning prefix is not trained on models with {a.constrained}")
    if pc.encoding != "preamble":
        raise ValueError("a learned conditioning prefix extends the preamble context: it needs encoding='preamble'")


class Student:
    """The cached path, differentiable: ``(k, v)`` pairs per layer, each ``(1, H_kv, T, D)``."""

    def __init__(self, pc: PromptCache, base_ids: Sequence[int]):
        check_trainable(pc)
        self.pc, self.adapter = pc, pc.adapter
        rope = cast(RopeAdapter, pc.adapter)  # check_trainable made sure
        self.inv_freq = rope.inv_freq  # (head_dim/2,)
        self.dev, self.dtype = pc.adapter.device, pc.adapter.dtype
        self.base_ids = list(base_ids)
        self.P = len(self.base_ids)
        with torch.no_grad():
            self.base = self._run(self.base_ids, 0, None)  # the preamble, exactly as the engine encodes it

    def _run(self, ids: Sequence[int], pos0: int, past, embeds: torch.Tensor | None = None, last: int = 0):
        """Forward ``ids`` (or ``embeds``) at ``pos0...`` after ``past``; returns their ``(k, v)``
        per layer, and the logits of the ``last`` rows when ``last`` > 0."""
        T = len(ids)
        ids_t = torch.tensor(list(ids), dtype=torch.long, device=self.dev)
        pos = torch.arange(pos0, pos0 + T, device=self.dev)
        if past is None:
            cache, C, allowed = DynamicCache(), 0, None
        else:
            cache = DynamicCache([(k, v) for k, v in past])
            C = past[0][0].shape[2]
            # An explicit mask keeps pcache_sdpa on the stock (differentiable) kernel.
            allowed = context_mask(T, C, self.dev)
        logits = self.adapter.forward(ids_t, pos, cache, allowed, None, logits_to_keep=max(last, 1),
                                      inputs_embeds=None if embeds is None else embeds.to(self.dtype))
        layers: list[Any] = list(cache.layers)  # DynamicLayer each (transformers types them as a union)
        kv = [(layer.keys[:, :, C:], layer.values[:, :, C:]) for layer in layers]
        return (kv, logits[-last:].float()) if last else kv

    def context(self, embeds: torch.Tensor | None) -> list:
        """The preamble's states, then the prefix's (attending to the preamble)."""
        if embeds is None:
            return self.base
        m = embeds.shape[0]
        kv = self._run([0] * m, self.P, self.base, embeds=embeds)
        return [(torch.cat([bk, k], 2), torch.cat([bv, v], 2)) for (bk, bv), (k, v) in zip(self.base, kv)]

    def log_probs(self, prompt: Prompt, ctx: list, forced: Sequence[int]) -> torch.Tensor:
        """``(len(forced) + 1, vocab)`` log-probabilities after the question and after each forced
        token, with every chunk encoded after ``ctx`` and moved to its slot."""
        C = ctx[0][0].shape[2]
        parts = [self.base]
        slot = self.P
        for ids in prompt.docs:
            kv = self._run(ids, C, ctx)
            shift = torch.tensor(slot - C)  # a tensor shift: rerotate's differentiable form
            parts.append([(rerotate(k, shift, self.inv_freq), v) for k, v in kv])
            slot += len(ids)
        past = [(torch.cat([p[i][0] for p in parts], 2), torch.cat([p[i][1] for p in parts], 2))
                for i in range(len(self.base))]
        tail = list(prompt.question) + list(forced)
        _, logits = self._run(tail, slot, past, last=len(forced) + 1)
        return F.log_softmax(logits, dim=-1)


@torch.no_grad()
def teacher(pc: PromptCache, base_ids: Sequence[int], prompt: Prompt) -> tuple[list[int], torch.Tensor]:
    """``(forced tokens, log-probabilities)`` of full prefill: its greedy first :data:`FORCED`
    tokens (fewer if it ends), or the first :data:`FORCED_CLOZE` of the prompt's own ``answer``,
    and its distributions after the question and after each of those. One prefill, then a
    decode step per greedy token."""
    ids = list(base_ids) + [i for d in prompt.docs for i in d] + list(prompt.question)
    dev, cache = pc.adapter.device, DynamicCache()
    if prompt.answer:
        given = list(prompt.answer[:FORCED_CLOZE])
        full = ids + given
        out = pc.adapter.forward(torch.tensor(full, device=dev), torch.arange(len(full), device=dev), cache, None,
                                 None, logits_to_keep=len(given) + 1).float()
        return given, F.log_softmax(out, dim=-1)
    logits = [pc.adapter.forward(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), cache, None,
                                 None)[-1].float()]
    forced: list[int] = []
    while len(forced) < FORCED and int(logits[-1].argmax()) not in pc.eos_ids:
        forced.append(int(logits[-1].argmax()))
        step = torch.tensor([forced[-1]], device=dev)
        logits.append(pc.adapter.forward(step, torch.tensor([len(ids) + len(forced) - 1], device=dev), cache, None,
                                         None)[-1].float())
    return forced, F.log_softmax(torch.stack(logits), dim=-1)


def kl(teacher_lp: torch.Tensor, student_lp: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student), nats."""
    return (teacher_lp.exp() * (teacher_lp - student_lp)).sum(-1).mean()


def initial_embeds(pc: PromptCache) -> torch.Tensor:
    """The neutral passage's own input embeddings ``(m, hidden)``: where training starts."""
    ids = torch.tensor(pc.safe.text(neutral_text(1)), device=pc.adapter.device)
    model: Any = pc.model  # a transformers model (typed as a plain Module)
    with torch.no_grad():
        return model.get_input_embeddings()(ids).float().cpu()


def _bar(items: list, progress: bool, desc: str):
    if not progress:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="prompt")


def learn_prefix(pc: PromptCache, base_ids: Sequence[int], train: Sequence[Prompt], val: Sequence[Prompt],
                 steps: int = 96, lr: float = DEFAULT_LR, seed: int = 0, progress: bool = True,
                 meta: dict[str, str] | None = None, log_fn: Callable[[str], None] | None = None) -> LearnReport:
    """Train a prefix on ``train`` prompts for ``steps`` steps (one prompt a step, Adam), starting
    from the neutral passage; measure it on ``val`` after every pass over ``train`` and keep the
    best. ``improved`` is False (and the prefix the initial one) when nothing measured lower."""
    if not train or not val:
        raise ValueError("learning a prefix needs training and validation prompts")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, not {steps}")
    t0 = time.perf_counter()
    student = Student(pc, base_ids)
    say = log_fn or log.info
    refs = [teacher(pc, base_ids, p) for p in _bar(list(val) + list(train), progress, "reference (full prefill)")]
    val_refs, train_refs = refs[:len(val)], refs[len(val):]

    def val_kl(embeds: torch.Tensor | None) -> float:
        with torch.no_grad():
            ctx = student.context(embeds)
            vals = [float(kl(lp, student.log_probs(p, ctx, forced))) for p, (forced, lp) in zip(val, val_refs)]
        return sum(vals) / len(vals)

    init = initial_embeds(pc).to(pc.adapter.device)
    kl_none, kl_init = val_kl(None), val_kl(init)
    say(f"validation KL: no conditioning {kl_none:.4f}, neutral passage {kl_init:.4f}")
    embeds = init.clone().requires_grad_(True)
    opt = torch.optim.Adam([embeds], lr=lr)
    best, best_kl, curve = init.clone(), kl_init, []
    r = random.Random(seed)
    order: list[int] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="learning the conditioning prefix", unit="step")
    try:
        for step in range(1, steps + 1):
            if not order:
                order = list(range(len(train)))
                r.shuffle(order)
            i = order.pop()
            forced, tlp = train_refs[i]
            loss = kl(tlp, student.log_probs(train[i], student.context(embeds), forced))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(kl=f"{float(loss.detach()):.4f}")
            if not order or step == steps:  # the end of a pass over the prompts (or of training)
                v = val_kl(embeds.detach())
                curve.append((step, v))
                say(f"step {step}: validation KL {v:.4f}")
                if v < best_kl:
                    best, best_kl = embeds.detach().clone(), v
    finally:
        if bar is not None:
            bar.close()
    info = {"fingerprint": pc.fingerprint, "model": pc.model_type, "init": "neutral:1", "steps": str(steps),
            "lr": str(lr), "train_prompts": str(len(train)), "val_prompts": str(len(val)),
            "kl_none": f"{kl_none:.5f}", "kl_init": f"{kl_init:.5f}", "kl_learned": f"{best_kl:.5f}",
            **(meta or {})}
    prefix = LearnedPrefix(best.cpu(), info)
    return LearnReport(prefix, kl_init, kl_none, best_kl, best_kl < kl_init, steps, len(train), len(val),
                       time.perf_counter() - t0, curve)


# ---------------------------------------------------------------------------- an index's prefix


def index_prompts(rag, n: int, k: int | None = None, seed: int = 0) -> list[Prompt]:
    """``n`` prompts sampled from ``rag``'s index as :func:`~.calibrate.sample_prompts` samples them
    with ``cloze``: ``k`` chunks at random and a line of one to complete, whose own rest is the
    answer (no label is needed), in the ids answers read."""
    from .calibrate import sample_prompts

    out = []
    for handles, question, answer in sample_prompts(rag, n, rag.k if k is None else k, seed, cloze=True):
        docs = [rag.chunks.ids(h.text, h.source) for h in sorted(handles, key=lambda h: h.score)]
        out.append(Prompt(docs, rag.question_ids(question), rag.asm.safe.text(answer) if answer else []))
    return out


def learn_index(rag, train: int = 48, val: int = 16, steps: int = 96, k: int | None = None, lr: float = DEFAULT_LR,
                seed: int = 0, progress: bool = True, save: bool = True) -> LearnReport:
    """Learn a prefix for ``rag``'s index and model from prompts sampled from the index (``train``
    to learn on, ``val`` others to choose by); with ``save``, and where it measured lower than
    the neutral passage, move the index to it (:func:`use_prefix`)."""
    import hashlib

    rag.upkeep.refresh()
    check_trainable(rag.pc)
    prompts = index_prompts(rag, train + val, k, seed)
    if len(prompts) < 2:
        raise ValueError(f"the index {rag.index_dir} has too few chunks to learn a prefix from")
    n_val = max(1, round(len(prompts) * val / (train + val)))
    meta = {"system_prompt_sha256": hashlib.sha256(rag.asm.system_prompt.encode()).hexdigest()[:16],
            "index": str(rag.index_dir)}
    rep = learn_prefix(rag.pc, rag.preamble_ids, prompts[n_val:], prompts[:n_val], steps, lr, seed, progress, meta)
    if save and rep.improved:
        use_prefix(rag, rep.prefix, progress)
    return rep


def use_prefix(rag, prefix: LearnedPrefix, progress: bool = True) -> int:
    """Move ``rag``'s index to ``prefix``: keep the prefix in the index, key every chunk by it and
    encode the states of those that were encoded before (lazy chunks stay lazy), then commit, so
    that every process serving the index switches at its next question. The index's calibrated
    attention was chosen for the old states and is dropped (run ``calibrate`` again). Returns the
    number of chunks encoded. Holds the ingest lock throughout."""
    from .chunks import index_assembler

    lock = rag.folder.lock()
    try:
        rag.upkeep.refresh(force=True)
        prefix.save(rag.folder.prefix_path(prefix.spec))
        asm = index_assembler(rag.pc, rag.folder, rag.asm.system_prompt, prefix.spec)
        chunks = rag.index.chunks()
        texts = dict(rag.index.texts())
        ids, metas, encoded = [], [], 0
        it = chunks
        if progress and len(chunks) > 1:
            from tqdm.auto import tqdm

            it = tqdm(chunks, desc="encoding chunks after the prefix", unit="chunk")
        for cid, m in it:
            if cid not in texts:
                continue
            tok = rag.chunks.ids(texts[cid], m["source"])
            key = asm.key(tok)
            if not m.get("lazy") and not rag.chunks.store.contains(key):
                asm.encode_ids(tok, key)
                encoded += 1
            ids.append(cid)
            metas.append({**m, "kv_key": key})
        rag.chunks.asm = asm
        rag.index.update_metadata(ids, metas)
        rag.live.manifest = dict(rag.folder.manifest(quiet=True) or rag.manifest)
        if rag.manifest.pop("calibration", None):
            log.warning("the index's calibrated attention was chosen for its old states and is dropped: "
                        "run `pcache-rag calibrate` again to choose it for the new ones")
        rag.upkeep.commit()
    finally:
        lock.release()
    return encoded


__all__ = ["FORCED", "FORCED_CLOZE", "LearnReport", "Prompt", "Student", "check_trainable", "index_prompts", "initial_embeds", "kl",
           "learn_index", "learn_prefix", "teacher", "use_prefix"]
