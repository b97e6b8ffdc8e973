"""Decoding after a prefill: sampling settings, the sampler, stop strings, one sequence's
decoding state (:class:`Decoding`, which the solo loop and the batch scheduler both drive),
and the :class:`Generation` a stream returns.

A :class:`Generation` is an iterator of text deltas that, once exhausted, holds its
:class:`~pcache_rag.engine.types.GenerationOutput` in ``.output``: the stream's statistics
travel with the stream, not through a field on the engine.
"""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Callable, Iterator

import torch
from transformers.cache_utils import Cache

from ..models.attention import Forward
from ..models.fast_decode import decoding
from ..request import SamplingParams
from .types import FinishReason, GenerationOutput, PrefillResult


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


class Decoding:
    """One sequence's decoding state. :meth:`push` takes the logits after the last token,
    samples the next one (greedy, or seeded sampling; a grammar masks the logits first),
    decides whether the answer ended (the model's end token, a stop string, the grammar
    complete, ``max_new_tokens``) and returns the text that may be emitted now. The solo loop
    (:meth:`Decoder.stream`) and the batch scheduler (:mod:`.scheduler`) both drive it, so a
    request decodes the same way alone or in a batch."""

    def __init__(self, tokenizer, eos: set[int], params: SamplingParams, vocab: int, t0: float) -> None:
        self.tokenizer = tokenizer
        self.eos = eos
        self.params = params
        self.t0 = t0
        self.gen: torch.Generator | None = None
        if params.do_sample:
            seed = params.seed if params.seed is not None else random.randrange(1 << 62)
            self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.constraint = None
        if params.grammar is not None:
            from ..grammar import Constraint

            self.constraint = Constraint(tokenizer, params.grammar, vocab)
        self.tokens: list[int] = []
        self.emitted = ""
        self.finish: FinishReason = "length"
        self.ttft: float | None = None
        self.last = -1  # the token just sampled: the next step's input
        self.done = False

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def push(self, logits: torch.Tensor) -> str:
        """Sample from ``logits`` (vocab,); returns the text delta that may be emitted now
        (maybe empty). Afterwards ``done`` says whether the answer ended."""
        p, c = self.params, self.constraint
        if c is not None:
            logits = c.apply(logits)
        tok = sample(logits, p, self.gen)
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.t0
        self.last = tok
        if tok in self.eos:
            self.finish, self.done = "eos", True
            return self._flush()
        if c is not None:
            c.advance(tok)
        self.tokens.append(tok)
        text = self._text()
        cut = first_stop(text, p.stop)
        if cut >= 0:
            delta = text[len(self.emitted) : cut] if cut > len(self.emitted) else ""
            self.emitted = text[:cut]
            self.finish, self.done = "stop", True
            return delta
        safe = safe_length(text, p.stop)
        delta = ""
        if safe > len(self.emitted):
            delta, self.emitted = text[len(self.emitted) : safe], text[:safe]
        if c is not None and c.done:  # nothing may follow: the answer is whole
            self.finish, self.done = "eos", True
        elif len(self.tokens) >= p.max_new_tokens:
            self.done = True
        return delta + self._flush(text) if self.done else delta

    def _flush(self, text: str | None = None) -> str:
        """At the end (not on a stop string): the text held back so far (``text``: the tokens'
        text, when already decoded)."""
        text = self._text() if text is None else text
        delta = text[len(self.emitted) :] if len(text) > len(self.emitted) else ""
        self.emitted = text
        return delta

    @property
    def cut_short(self) -> bool:
        """A grammar-constrained answer that reached ``max_new_tokens`` before it was complete."""
        return self.constraint is not None and self.finish == "length" and not self.constraint.accepting

    def warn_if_cut(self, stacklevel: int = 3) -> None:
        """Raise :class:`~pcache_rag.grammar.StructuredOutputWarning` in the caller's thread if
        :attr:`cut_short`."""
        if self.cut_short:
            from ..grammar import StructuredOutputWarning

            warnings.warn(f"the answer reached max_new_tokens={self.params.max_new_tokens} before its grammar was "
                          "complete: it is cut short (raise the token limit)", StructuredOutputWarning,
                          stacklevel=stacklevel)

    def output(self, cached: int, computed: int, recomputed: int = 0, decode_batch: int = 1,
               unbatched: str = "") -> GenerationOutput:
        """The finished :class:`GenerationOutput`, with its prompt's token counts."""
        now = time.perf_counter()
        return GenerationOutput(
            text=self.emitted, token_ids=self.tokens, ttft_s=self.ttft if self.ttft is not None else now - self.t0,
            cached_tokens=cached, computed_tokens=computed, total_s=now - self.t0, finish_reason=self.finish,
            recomputed_tokens=recomputed, decode_batch=decode_batch, unbatched=unbatched,
        )


class Decoder:
    """Continues a prefill token by token over one cache (the engine's workspace): through the
    fused ``step`` (:class:`~pcache_rag.models.decode_step.FusedDecodeStep`) when there is one and
    the stream allows it, else through the model's own forward."""

    def __init__(self, adapter, tokenizer, eos: set[int], step=None) -> None:
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.eos_ids = eos
        self.step = step

    def start(self, params: SamplingParams, vocab: int, t0: float) -> Decoding:
        """A fresh :class:`Decoding` for one sequence."""
        return Decoding(self.tokenizer, self.eos_ids, params, vocab, t0)

    @torch.no_grad()
    def stream(self, res: PrefillResult, t0: float, params: SamplingParams, cache: Cache,
               unbatched: str = "") -> Iterator[str | GenerationOutput]:
        """Sample from ``res.logits`` and continue in ``cache``; yields deltas, then the output."""
        dev = self.adapter.device
        key_pos = res.position_ids.to(dev) if self.adapter.needs_key_positions else None
        next_pos = int(res.position_ids.max()) + 1
        seq = self.start(params, res.logits.shape[-1], t0)
        logits = res.logits
        # the fused step attends to every key with plain softmax: not calibrated spans, not ALiBi or windows
        fused = self.step if (key_pos is None and res.calibrated is None
                              and all(hasattr(layer, "buffers") for layer in cache.layers)) else None
        while True:
            delta = seq.push(logits)
            if delta:
                yield delta
            if seq.done:
                break
            if fused is not None:
                logits = fused(seq.last, next_pos, cache.layers)
                next_pos += 1
                continue
            ids = torch.tensor([seq.last], dtype=torch.long, device=dev)
            pos = torch.tensor([next_pos], dtype=torch.long, device=dev)
            next_pos += 1
            allowed = None  # one new token attends to everything: no mask needed...
            if key_pos is not None:  # ...but ALiBi's bias and sliding windows need the keys' positions,
                key_pos = torch.cat([key_pos, pos])
                if self.adapter.family == "alibi":  # and ALiBi's bias comes with its mask
                    allowed = torch.ones(1, key_pos.shape[0], dtype=torch.bool, device=dev)
            fwd = Forward(span=res.calibrated) if res.calibrated is not None else None
            with decoding():  # a generated token: the decode weights, if any
                logits = self.adapter.forward(ids, pos, cache, allowed, key_pos, fwd=fwd)[-1]
        seq.warn_if_cut()
        yield seq.output(res.cached_tokens, res.computed_tokens, res.recomputed_tokens, unbatched=unbatched)
