"""One step of the continuous batch: the forward that moves every admitted request on by a
token (or a chunk of its prompt), and what each request gets from it.

:class:`StepRunner` executes; what a batch holds is the scheduler's decision (:mod:`.scheduler`),
and the requests and their rows are :mod:`.batch`'s records. The decoding requests take the
engine's fused decode step (:func:`fused_forward`: its one-token form for a request alone, its
many-sequence form on the C kernels for several, each to the bits it would get alone), and the
chunks of prompts being filled one ragged forward of the model over each sequence's own rows
(:func:`ragged_forward`); without a fused step, that forward takes the decoding rows too.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..kv import RequestKV
from ..models import UnsupportedModelError
from ..models.attention import Forward, Positions, RaggedStep
from ..models.fast_decode import decoding as generated_rows
from .batch import Batch, Request
from .core import EngineCore

log = logging.getLogger(__name__)


class _RaggedLayer(DynamicLayer):
    """One layer of a ragged decode step's cache: writes each sequence's new key and value
    into that sequence's own rows (:meth:`RaggedStep.write`) and hands the attention the new
    rows only; ``pcache_sdpa`` reads each sequence's keys from the step."""

    def __init__(self, step: RaggedStep, index: int, longest: int, like: torch.Tensor) -> None:
        super().__init__()
        self.step, self.index, self.longest = step, index, longest
        self.is_initialized = True
        self.device = like.device
        self.keys = like[:0]
        self.values = like[:0]

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.step.write(self.index, key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.longest

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.longest + query_length, 0


class StepRunner:
    """Runs steps of a :class:`~.batch.Batch` on one engine's :class:`~.core.EngineCore` (the caller
    holds the engine's lock): :meth:`admit` a request, :meth:`forward` one step. ``prefill_tokens``:
    the most prompt tokens one step prefills across the filling requests."""

    def __init__(self, core: EngineCore, prefill_tokens: int) -> None:
        self.core = core
        self.prefill_tokens = prefill_tokens

    def admit(self, batch: Batch, req: Request) -> int:
        """Take ``req`` into ``batch``: its cached units copied into rows of its own (its new tokens are
        prefilled by the steps), or the engine's own prefill, whose first token streams at once.
        Returns the tokens this computed now (against the step's prefill budget); a request's own
        error ends it alone."""
        if req.t0 is None:
            req.t0 = time.perf_counter()
        core = self.core
        try:
            if req.prepare is None:
                req.kv = RequestKV.assemble(req.units, len(req.new_ids) + req.params.max_new_tokens,
                                            core.workspace.shape, core.adapter.dtype, core.adapter.device)
                req.units = []  # the rows hold them now
                req.next_pos = req.start
                req.counts = (req.kv.length, len(req.new_ids), 0)
                batch.filling.append(req)
                return 0
            res = req.prepare(0)
            batch.counts["prefills"] += 1
            req.next_pos = int(res.position_ids.max()) + 1
            req.span = res.calibrated
            req.counts = (res.cached_tokens, res.computed_tokens, res.recomputed_tokens)
            # The first token is sampled (and streams) before the request's rows are copied out
            # of the workspace: that copy (every cached row, ~80 MB at 1,700 float32 tokens on
            # the embedded model) is the decode's cost, not the time to the first token.
            self.begin(batch, req, res.logits)
            if not req.seq.done:  # type: ignore[union-attr]
                req.kv = RequestKV.from_workspace(core.workspace, req.params.max_new_tokens, res.position_ids)
            return res.computed_tokens
        except Exception as e:  # noqa: BLE001 - the request's own error (a bad prompt, no room)
            if req in batch.live:
                batch.live.remove(req)
            req.kv = None
            req.out.put(e)
            return 0

    def forward(self, batch: Batch) -> None:
        """One forward: a token of each running request, and the next chunks of the prompts
        being prefilled (at most ``prefill_tokens`` of them, oldest first). The decoding requests
        (no calibrated span) take the fused decode step, as a request alone would: its one-token
        form for one, its many-sequence form on the C kernels for several, each to the same bits
        as alone, whether or not prompts are filling; the chunks then take a ragged forward of
        their own. Without a fused step, one ragged forward takes every row."""
        step = self.core.decoder.step
        fused = bool(step is not None and batch.live and all(r.span is None for r in batch.live)
                     and (len(batch.live) == 1 or step.kernels == "c"))
        if fused:
            # the decoding requests take the fused step even while prompts fill: a token's bits
            # never depend on what else is in the batch; the chunks then take a forward of their own
            self.fused(batch, list(batch.live))
            if not batch.filling:
                return
        live = [] if fused else batch.live
        seqs: list[tuple[Request, list[int]]] = [(r, [r.seq.last]) for r in live]  # type: ignore[union-attr]
        budget = self.prefill_tokens
        over_cache: list[tuple[Request, list[int]]] = []  # chunks of prompts with cached parts
        plain: list[tuple[Request, list[int]]] = []  # chunks of prompts with nothing cached
        for r in batch.filling:
            if budget <= 0:
                break
            chunk = r.new_ids[r.fed : r.fed + budget]
            (over_cache if r.counts[0] > 0 else plain).append((r, chunk))
            budget -= len(chunk)
        seqs += over_cache + plain
        if not seqs:
            return
        # the leading rows read the decode weights: the generated tokens, and with the engine's
        # query weights the chunks computed over cached states (as a solo prefill computes them)
        pf = self.core.prefiller
        small = len(live) + (sum(len(c) for _, c in over_cache) if pf.query_weights else 0)
        # the head's rows (each sequence's last token): the generated ones, and those over cached states
        # where a solo prefill reads the decode weights for its head; never a prompt with nothing cached
        head = len(live) + (len(over_cache) if pf.query_weights or pf.head_weights else 0)
        logits = ragged_forward(self.core, seqs, small, head)  # (B, vocab)
        B = len(seqs)
        decoding = len(live)
        batch.counts["steps"] += 1
        batch.counts["decoded"] += decoding
        batch.counts["chunks"] += B - decoding
        batch.counts["max_batch_seen"] = max(batch.counts["max_batch_seen"], B)
        for b, (r, chunk) in enumerate(seqs):
            r.kv.length += len(chunk)  # type: ignore[union-attr]
            r.next_pos += len(chunk)
            r.batch = max(r.batch, B)
            if b < decoding:
                self.emit(batch, r, logits[b])
                continue
            r.fed += len(chunk)
            if r.fed == len(r.new_ids):  # its prompt is in: the first token, as in a solo prefill
                r.new_ids = []
                batch.filling.remove(r)
                self.begin(batch, r, logits[b])

    def fused(self, batch: Batch, reqs: list[Request]) -> None:
        """One token of each running request through the engine's fused decode step."""
        logits = fused_forward(self.core, reqs)  # (B, vocab)
        batch.counts["steps"] += 1
        batch.counts["decoded"] += len(reqs)
        batch.counts["max_batch_seen"] = max(batch.counts["max_batch_seen"], len(reqs))
        for r, row in zip(list(reqs), logits):
            r.kv.length = r.rows_view[0].length  # type: ignore[union-attr,index]
            r.next_pos += 1
            r.batch = max(r.batch, len(reqs))
            self.emit(batch, r, row)

    def begin(self, batch: Batch, req: Request, logits: torch.Tensor) -> None:
        """The first token, from the prefill's logits; then it decodes with the others."""
        assert req.t0 is not None
        try:
            req.seq = self.core.decoder.start(req.params, logits.shape[-1], req.t0)
        except Exception as e:  # noqa: BLE001 - its own parameters (a grammar that will not compile)
            self.fail(batch, req, e)
            return
        if self.emit(batch, req, logits) and not req.seq.done:
            batch.live.append(req)

    def fail(self, batch: Batch, req: Request, err: BaseException) -> None:
        """End ``req`` alone with ``err`` (its grammar, its sampling, a callback of its own): its
        rows are freed and the other requests of the batch go on as if it had never joined."""
        log.warning("a request in the batch failed alone: %s: %s", type(err).__name__, str(err)[:200])
        batch.drop(req)
        batch.counts["failed"] += 1
        req.out.put(err)

    def emit(self, batch: Batch, req: Request, logits: torch.Tensor) -> bool:
        """Take ``req``'s next token from ``logits`` and send what it adds; False if that failed
        (the request has then ended alone, with its error)."""
        assert req.seq is not None
        try:
            delta = req.seq.push(logits)
        except Exception as e:  # noqa: BLE001 - this request's fault, not the batch's
            self.fail(batch, req, e)
            return False
        if delta:
            req.out.put(delta)
        if req.seq.done:  # out of the batch before its output is seen, so stats() never lag it
            if req in batch.live:
                batch.live.remove(req)
            req.kv, req.rows_view = None, None
            batch.counts["finished"] += 1
            req.out.put(req.seq.output(*req.counts, decode_batch=req.batch))
        return True


def fused_forward(core: EngineCore, reqs: list[Request]) -> torch.Tensor:
    """One token of each of ``reqs`` (each decoding, with its rows) through the engine's fused
    decode step: its one-token form for a request alone, else its many-sequence form; the
    logits (B, vocab). Each request's rows move on by one token."""
    for r in reqs:
        assert r.kv is not None and r.seq is not None
        if r.rows_view is None:
            r.rows_view = r.kv.buffer_layers()
        if r.rows_view[0].length != r.kv.length:  # the batch moved it on
            for layer in r.rows_view:
                layer.set_length(r.kv.length)
    step = core.decoder.step
    assert step is not None
    if len(reqs) == 1:
        return step(reqs[0].seq.last, reqs[0].next_pos, reqs[0].rows_view)[None]  # type: ignore[union-attr]
    return step.many([r.seq.last for r in reqs], [r.next_pos for r in reqs],  # type: ignore[union-attr]
                     [r.rows_view for r in reqs])


def ragged_forward(core: EngineCore, seqs: list, small: int, head: int) -> torch.Tensor:
    """One forward of the model over ``seqs`` (``(request, token ids)`` each: a generated token,
    or a chunk of a prompt), each over its own rows (:class:`RaggedStep`); the logits (B, vocab)
    at each sequence's last token. The first ``small`` token rows read the decode weights, if any, and
    the first ``head`` rows of the output head."""
    dev = core.adapter.device
    kvs = [r.kv for r, _ in seqs]
    step = RaggedStep([kv.k for kv in kvs], [kv.v for kv in kvs], [kv.length for kv in kvs],  # type: ignore[union-attr]
                      [len(ids) for _, ids in seqs], [r.span for r, _ in seqs])
    if core.adapter.window is not None:  # each sequence's window, over its own rows' positions
        step.positions = []
        for r, chunk in seqs:
            kv = r.kv
            assert kv is not None
            n, c = kv.length, len(chunk)
            kv.pos[n : n + c] = torch.arange(r.next_pos, r.next_pos + c, device=kv.pos.device)
            step.positions.append(Positions.of(kv.pos[n : n + c], kv.pos[: n + c]))
    like = kvs[0].k[0, None, :, :0]  # type: ignore[union-attr]  # (1, H, 0, D)
    longest = max(n + c for n, c in zip(step.lengths, step.counts))
    n_layers = kvs[0].k.shape[0]  # type: ignore[union-attr]
    cache = Cache(layers=[_RaggedLayer(step, i, longest, like) for i in range(n_layers)])
    ids = torch.tensor([t for _, chunk in seqs for t in chunk], dtype=torch.long, device=dev)  # (N,)
    pos = torch.tensor([p for r, chunk in seqs for p in range(r.next_pos, r.next_pos + len(chunk))],
                       dtype=torch.long, device=dev)
    ends = torch.tensor(list(itertools.accumulate(step.counts)), dtype=torch.long, device=dev) - 1
    with generated_rows(small, head):
        logits = core.adapter.forward(ids, pos, cache, None, None, logits_to_keep=ends,
                                      fwd=Forward(step=step))  # (B, vocab)
    if step.calls == 0:
        raise UnsupportedModelError(f"{type(core.model).__name__} does not run its attention through "
                                    "pcache_sdpa: it cannot decode in a batch")
    return logits


__all__ = ["StepRunner", "fused_forward", "ragged_forward"]
