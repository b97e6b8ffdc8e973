"""Decoding after a prefill: sampling settings, the sampler, stop strings, and the
:class:`Generation` a stream returns.

A :class:`Generation` is an iterator of text deltas that, once exhausted, holds its
:class:`~pcache_rag.engine.types.GenerationOutput` in ``.output``: the stream's statistics
travel with the stream, not through a field on the engine.
"""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from transformers.cache_utils import Cache

from ..kv import BufferLayer
from ..models.attention import calibrated
from .types import FinishReason, GenerationOutput, PrefillResult


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to decode: greedy by default; ``do_sample=True`` samples with ``temperature`` and
    ``top_p`` (``seed`` makes it repeatable). Decoding stops at the model's end token, at any
    string in ``stop`` (excluded from the text) or after ``max_new_tokens``. ``grammar`` (an
    llguidance grammar from :mod:`pcache_rag.grammar`, e.g. ``json_grammar(schema)``)
    constrains every token to it; the answer then ends where the grammar is complete."""

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        object.__setattr__(self, "stop", tuple(s for s in (self.stop or ()) if s))
        if self.grammar is not None:
            from ..grammar import check

            check(self.grammar)  # a bad grammar is refused here, not after the prefill

    @classmethod
    def of(cls, params: SamplingParams | None = None, **kw: object) -> SamplingParams:
        """``params`` with the keyword settings applied; an unknown name is refused (TypeError)."""
        names = {f.name for f in fields(cls)}
        bad = set(kw) - names
        if bad:
            raise TypeError(f"unexpected arguments: {', '.join(sorted(bad))}")
        base = {f.name: getattr(params, f.name) for f in fields(cls)} if params is not None else {}
        base.update(kw)
        if base.get("stop") is None:
            base["stop"] = ()
        return cls(**base)  # type: ignore[arg-type]


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """The next token from ``logits`` (vocab,): argmax, or a draw with temperature and top-p."""
    if not params.do_sample or params.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < params.top_p  # always keeps the top token
        sp = sp * keep
        return int(si[torch.multinomial(sp / sp.sum(), 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))


def first_stop(text: str, stops: tuple[str, ...] | list[str]) -> int:
    """Where the first of ``stops`` begins in ``text``, or -1."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


def safe_length(text: str, stops: tuple[str, ...]) -> int:
    """How much of ``text`` may be emitted now: a partial character and any tail that may
    begin a stop string are held back."""
    safe = len(text) - (1 if text.endswith("\ufffd") else 0)
    for s in stops:
        for k in range(min(len(s) - 1, safe), 0, -1):
            if text[:safe].endswith(s[:k]):
                safe -= k
                break
    return safe


def eos_ids(model: torch.nn.Module, tokenizer: object) -> set[int]:
    """Every end-of-sequence id the model's generation config, config or tokenizer names."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        v = getattr(src, "eos_token_id", None)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


class Generation(Iterator[str]):
    """Text deltas as they are decoded; afterwards ``output`` holds the finished
    :class:`GenerationOutput`. ``result()`` drains what is left and returns it. ``close()``
    stops early and releases the engine at once (a client that went away)."""

    def __init__(self, items: Iterator[str | GenerationOutput],
                 on_done: Callable[[GenerationOutput], None] | None = None) -> None:
        self._items = items
        self._on_done = on_done
        self.output: GenerationOutput | None = None

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> str:
        item = next(self._items)  # StopIteration ends the stream
        if isinstance(item, GenerationOutput):
            self.output = item
            # the output is the last item: finish the underlying loop so the engine is released,
            # then tell the listeners (one that fails cannot keep the engine locked)
            for _ in self._items:
                pass
            if self._on_done is not None:
                self._on_done(item)
            raise StopIteration
        return item

    def result(self) -> GenerationOutput:
        """Decode to the end and return the output."""
        for _ in self:
            pass
        assert self.output is not None, "the generation loop always ends with its output"
        return self.output

    def close(self) -> None:
        close = getattr(self._items, "close", None)
        if close is not None:
            close()


@dataclass(slots=True)
class Prefilled:
    """One prompt of a batch after its own prefill: its first token and its states."""

    res: PrefillResult
    tok: int  # the first (greedy) token
    ttft: float
    t0: float
    T: int  # cache length after the prefill
    next_pos: int  # the position of the first generated token
    k: torch.Tensor | None = field(default=None, repr=False)  # (L, H, T, D)
    v: torch.Tensor | None = field(default=None, repr=False)  # (L, H, T, Dv)


class Decoder:
    """Continues a prefill token by token over the engine's workspace (one prompt), or over
    a batch of prefilled prompts of equal length (greedy)."""

    def __init__(self, adapter, tokenizer, eos: set[int]) -> None:
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.eos_ids = eos

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    @torch.no_grad()
    def stream(self, res: PrefillResult, t0: float, params: SamplingParams,
               cache: Cache) -> Iterator[str | GenerationOutput]:
        """Sample from ``res.logits`` and continue in ``cache``; yields deltas, then the output."""
        dev = self.adapter.device
        gen = None
        if params.do_sample:
            seed = params.seed if params.seed is not None else random.randrange(1 << 62)
            gen = torch.Generator(device="cpu").manual_seed(seed)
        stops = params.stop
        key_pos = res.position_ids.to(dev) if self.adapter.family == "alibi" else None
        next_pos = int(res.position_ids.max()) + 1
        tokens: list[int] = []
        emitted = ""
        finish: FinishReason = "length"
        ttft = None
        logits = res.logits
        constraint = None
        if params.grammar is not None:
            from ..grammar import Constraint

            constraint = Constraint(self.tokenizer, params.grammar, logits.shape[-1])
        for step in range(params.max_new_tokens):
            if constraint is not None:
                logits = constraint.apply(logits)
            tok = sample(logits, params, gen)
            if ttft is None:
                ttft = time.perf_counter() - t0
            if tok in self.eos_ids:
                finish = "eos"
                break
            if constraint is not None:
                constraint.advance(tok)
            tokens.append(tok)
            text = self._text(tokens)
            cut = first_stop(text, stops)
            if cut >= 0:
                if cut > len(emitted):
                    yield text[len(emitted) : cut]
                emitted = text[:cut]
                finish = "stop"
                break
            safe = safe_length(text, stops)
            if safe > len(emitted):
                yield text[len(emitted) : safe]
                emitted = text[:safe]
            if constraint is not None and constraint.done:  # nothing may follow: the answer is whole
                finish = "eos"
                break
            if step == params.max_new_tokens - 1:
                break
            ids = torch.tensor([tok], dtype=torch.long, device=dev)
            pos = torch.tensor([next_pos], dtype=torch.long, device=dev)
            next_pos += 1
            allowed = None  # one new token attends to everything: no mask needed...
            if key_pos is not None:  # ...except for ALiBi, whose bias comes with its mask
                key_pos = torch.cat([key_pos, pos])
                allowed = torch.ones(1, key_pos.shape[0], dtype=torch.bool, device=dev)
            with calibrated(res.calibrated):
                logits = self.adapter.forward(ids, pos, cache, allowed, key_pos)[-1]
        if constraint is not None and finish == "length" and not constraint.accepting:
            from ..grammar import StructuredOutputWarning

            warnings.warn(f"the answer reached max_new_tokens={params.max_new_tokens} before its grammar was "
                          "complete: it is cut short (raise the token limit)", StructuredOutputWarning, stacklevel=2)
        if finish != "stop":
            text = self._text(tokens)
            if len(text) > len(emitted):
                yield text[len(emitted) :]
            emitted = text
        yield GenerationOutput(
            text=emitted, token_ids=tokens, ttft_s=ttft if ttft is not None else time.perf_counter() - t0,
            cached_tokens=res.cached_tokens, computed_tokens=res.computed_tokens,
            total_s=time.perf_counter() - t0, finish_reason=finish, recomputed_tokens=res.recomputed_tokens,
        )

    @torch.no_grad()
    def greedy_batch(self, firsts: list[Prefilled], max_new_tokens: int,
                     stops: tuple[str, ...]) -> list[GenerationOutput]:
        """Greedy decoding of ``B`` prefilled prompts of one length ``T`` and next position,
        one forward per step for the group."""
        dev = self.adapter.device
        B, T, next_pos = len(firsts), firsts[0].T, firsts[0].next_pos
        k0, v0 = firsts[0].k, firsts[0].v
        assert k0 is not None and v0 is not None
        L, H, _, D = k0.shape
        Dv = v0.shape[-1]
        kb = torch.empty((L, B, H, T + max_new_tokens, D), dtype=self.adapter.dtype, device=dev)
        vb = torch.empty((L, B, H, T + max_new_tokens, Dv), dtype=self.adapter.dtype, device=dev)
        for b, f in enumerate(firsts):
            assert f.k is not None and f.v is not None
            kb[:, b, :, :T] = f.k
            vb[:, b, :, :T] = f.v
            f.k = f.v = None
        layers: list[Any] = [BufferLayer(kb[i], vb[i]) for i in range(L)]  # (B, H, capacity, D) each
        for layer in layers:
            layer.set_length(T)
        cache = Cache(layers=layers)
        tokens: list[list[int]] = [[] for _ in range(B)]
        texts: list[str | None] = [None] * B  # set when a sequence stops on a stop string
        finish: list[FinishReason] = ["length"] * B
        live = [True] * B
        last = [f.tok for f in firsts]
        for step in range(max_new_tokens):
            for b in range(B):
                if not live[b]:
                    continue
                if last[b] in self.eos_ids:
                    finish[b], live[b] = "eos", False
                    continue
                tokens[b].append(last[b])
                if stops:
                    text = self._text(tokens[b])
                    cut = first_stop(text, stops)
                    if cut >= 0:
                        texts[b], finish[b], live[b] = text[:cut], "stop", False
            if not any(live) or step == max_new_tokens - 1:
                break
            ids = torch.tensor(last, dtype=torch.long, device=dev)
            pos = torch.full((B,), next_pos + step, dtype=torch.long, device=dev)
            last = torch.argmax(self.adapter.decode_step(ids, pos, cache), dim=-1).tolist()
        end = time.perf_counter()
        outs = []
        for b, f in enumerate(firsts):
            stopped = texts[b]
            outs.append(GenerationOutput(
                text=stopped if stopped is not None else self._text(tokens[b]), token_ids=tokens[b], ttft_s=f.ttft,
                cached_tokens=f.res.cached_tokens, computed_tokens=f.res.computed_tokens, total_s=end - f.t0,
                finish_reason=finish[b], recomputed_tokens=f.res.recomputed_tokens,
            ))
        return outs
