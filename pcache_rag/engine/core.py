"""The engine's core: the parts a forward needs, and a prompt's prefill and decode on them.

:class:`EngineCore` owns the model's adapter, the workspace, the prefiller, the decoder, the
engine lock and the output listeners. The continuous batch's :class:`~.scheduler.Scheduler`
and the :class:`~.dispatch.Dispatcher` receive this core, typed, not the facade;
:class:`~.prompt_cache.PromptCache` keeps the schemas, the store and the public API over them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from collections.abc import Callable, Iterator, Sequence

import torch

from ..kv import ModuleKV, Workspace
from ..models import adapter_for
from ..models.attention import Calibration
from ..models.decode_step import fused_step
from ..models.fast_decode import installed_format, use_decode_weights
from ..recompute import Lexicon, Recompute
from .decode import Decoder, SamplingParams, eos_ids
from .listeners import Listeners
from .lock import EngineLock
from .prefill import Prefiller
from .threads import check_spin, release_pool
from .types import ContextOverflowError, GenerationOutput, PrefillResult

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Parts:
    """A prompt of cached states and new tokens: the kind of prompt :meth:`PromptCache.generate`
    takes besides a PML string.

    ``parts``: ``(label, states)`` pairs, each already at its positions (see
    :meth:`PromptCache.place`); ``new_ids``: the token ids computed after them, placed right after
    the last part's last position; ``preamble``: the label of the part the new tokens read as the
    preamble (with ``encoding="preamble"``); ``calibration``: ``"ape:T:S"`` calibrates attention
    to every part after the first (:class:`~pcache_rag.models.attention.Calibration`).
    """

    parts: Sequence[tuple[str, ModuleKV]]
    new_ids: Sequence[int]
    preamble: str | None = None
    calibration: str | Calibration | None = None
#: prefills the prompt into the workspace, leaving room for that many generated tokens
Prepare = Callable[[int], PrefillResult]


class EngineCore:
    """The model side of one engine: ``model`` wrapped by its family's adapter, a workspace of
    ``max_tokens`` rows to start with (it grows), ``decode_weights`` (``"int8"``/``"bf16"``
    copies of the linear weights for generated tokens, self-checked) when asked for, and with
    ``fused_decode`` the fused decode step (:mod:`~pcache_rag.models.decode_step`) in those
    weights (fp32 without them) wherever the model allows it; with ``query_weights="bf16"`` (which
    needs bf16 decode weights) the rows computed over cached states read them too
    (:mod:`.prefill`, "Query weights")."""

    def __init__(self, model: torch.nn.Module, tokenizer, max_tokens: int | None = None,
                 decode_weights: str | None = None, fused_decode: bool = True,
                 query_weights: str | None = None) -> None:
        self.model = model.eval()
        self.adapter = adapter_for(model)
        #: how OpenMP's idle-worker spin was set ("pcache_rag", "user" or "too late": warned once)
        self.openmp_spin = check_spin()
        self.max_positions: int = self.adapter.max_positions
        s = self.adapter.kv_shape
        cap = max_tokens or min(self.max_positions, 1024)
        self.workspace = Workspace(s.n_layers, s.n_kv_heads, s.head_dim, s.head_dim_v, self.adapter.dtype,
                                   self.adapter.device, cap)
        #: serializes the workspace: one prefill or decode step at a time
        self.lock = EngineLock()
        decode_weights = None if decode_weights == "fp32" else decode_weights  # "fp32": the model's own
        #: what ``decode_weights`` did (None: not asked for)
        self.decode_report = None if decode_weights is None else use_decode_weights(model, decode_weights, tokenizer)
        if self.adapter.rerotatable:
            # Start-up self-check of RoPE re-rotation on the live model (as LMCache does):
            # if moved keys do not match keys encoded in place, never move states.
            try:
                self.adapter.self_check()  # type: ignore[attr-defined]  # RoPE adapters (rerotatable) have it
            except RuntimeError as e:
                log.warning("%s; RAG will encode chunks per slot instead of re-rotating", e)
                self.adapter.rerotatable = False
        self.prefiller = Prefiller(self.adapter, self.workspace, Lexicon(tokenizer))
        #: what the rows computed over cached states read: "bf16" (the decode weights), "fp32", or
        #: "fp32, bf16 head" (bf16 asked for on a CPU without bf16 dot products: only the first token's
        #: output head, one row, reads them)
        self.query_weights = self._query_weights(query_weights, decode_weights, model)
        self.prefiller.query_weights = self.query_weights == "bf16"
        self.prefiller.head_weights = self.query_weights == HEAD_ONLY
        step, self.decode_path = None, "stock transformers step (fused_decode=False)"
        if fused_decode:
            # the format asked for, or one an earlier engine gave this model's layers (the batch step reads it)
            fmt = (self.decode_report.fmt if self.decode_report is not None and self.decode_report.fmt
                   else installed_format(model) or "fp32")
            step, why = fused_step(model, self.adapter, tokenizer, fmt)
            if step is not None:
                how = f"C kernels, {step.variant}" if step.kernels == "c" else f"torch kernels: {step.kernels_why_not}"
                #: which step decodes a stream alone, and why (a batch step is always transformers')
                self.decode_path = f"fused {fmt} step ({how})"
            else:
                self.decode_path = f"stock transformers step: {why}"
                (log.warning if decode_weights else log.info)("fused decode step refused, stock step kept: %s", why)
        self.decoder = Decoder(self.adapter, tokenizer, eos_ids(model, tokenizer), step)
        #: called with every finished generation's output
        self.listeners = Listeners()

    def _query_weights(self, asked: str | None, decode_weights: str | None, model: torch.nn.Module) -> str:
        """The weights of the rows computed over cached states: ``asked`` checked against the
        decode weights the model carries (refused by name without bf16 ones; "fp32" kept, with a
        warning, where the bf16 decode weights were refused at load; :data:`HEAD_ONLY` on a CPU
        whose bf16 products of many rows are slow)."""
        if asked in (None, "fp32"):
            return "fp32"
        if asked != "bf16":
            raise ValueError(f"query_weights must be 'bf16', 'fp32' or None, not {asked!r}")
        have = installed_format(model)  # what the model's layers carry after this engine's decode weights
        if decode_weights != "bf16" and have != "bf16":
            raise ValueError("query_weights='bf16' reads the bf16 decode weights: give decode_weights='bf16' too "
                             f"(not {decode_weights!r})")
        if have != "bf16":  # asked for, refused by the self-check: said there already
            log.warning("query_weights='bf16' refused, fp32 kept: the bf16 decode weights were refused (%s)",
                        self.decode_report.refused if self.decode_report is not None else "not installed")
            return "fp32"
        why = slow_bf16_products(self.adapter.device)
        if why:  # fp32 rows where bf16 products of many rows are slower: said, not warned (the RAG default asks);
            # the head's one row streams its weights, so it still reads the bf16 copy (half the bytes)
            log.info("query_weights='bf16': fp32 kept, %s; the first token's output head reads bf16", why)
            return HEAD_ONLY
        return "bf16"

    # ------------------------------------------------------------------ prefill

    def prefill_parts(self, prompt: Parts, reserve: int, policy: Recompute) -> PrefillResult:
        """``prompt``'s cached parts plus its new tokens right after the last part, in one forward
        (the caller holds :attr:`lock`; its preamble and calibration are resolved)."""
        parts, new_ids = prompt.parts, list(prompt.new_ids)
        if not new_ids:
            raise ValueError("there must be at least one new token to compute")
        start = max((int(kv.position_ids[-1]) + 1 for _, kv in parts), default=0)
        pos = list(range(start, start + len(new_ids)))
        if pos[-1] >= self.max_positions:
            raise ContextOverflowError(f"the prompt needs {pos[-1] + 1} positions; the model takes {self.max_positions}")
        return self.prefiller.run([p[0] for p in parts], [p[1] for p in parts], [], new_ids, pos, prompt.preamble,
                                  reserve, policy, Calibration.parse(prompt.calibration))

    @torch.no_grad()
    def full_prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                     last: int = 1) -> torch.Tensor:
        """The baseline: one causal forward over all tokens, nothing reused (:meth:`Prefiller.full`)."""
        return self.prefiller.full(input_ids, position_ids, last)

    def run(self, prepare: Prepare, params: SamplingParams, unbatched: str = "") -> Iterator[str | GenerationOutput]:
        """Prefill with ``prepare(reserve)`` and decode alone over the workspace; yields text
        deltas, then the output. The lock is taken at the first item; TTFT counts from there, so
        planning and fetching states are included."""
        t0 = time.perf_counter()
        with self.lock, torch.no_grad():
            try:
                res = prepare(params.max_new_tokens)
                yield from self.decoder.stream(res, t0, params, self.workspace.cache(), unbatched)
            finally:
                # the next answer may decode in another thread (an executor's, the caller's): an idle pool
                # kept here would make libgomp wake that one's workers from sleep on every kernel
                # (pcache_rag.engine.threads; measured through ChatPromptCache.ainvoke: 21.8 ms a token
                # beside the caller's idle pool)
                release_pool()

    @property
    def batch_refusal(self) -> str:
        """Why this model cannot decode in a batch ('' when it can)."""
        return batch_refusal(self.adapter)


#: ``query_weights`` where bf16 was asked for on a CPU without bf16 dot products: the rows stay fp32,
#: and only the first token's output head (one row) reads the bf16 copy
HEAD_ONLY = "fp32, bf16 head"


def slow_bf16_products(device: torch.device) -> str:
    """Why bf16 products would be no faster than fp32's on ``device`` ('' where they are): on a
    CPU, bf16 runs fast through oneDNN only with bf16 dot-product instructions (x86's
    ``avx512_bf16`` or ``amx_bf16``, Arm's ``bf16``); without them oneDNN converts and computes
    in fp32, or is not used at all (an AVX2 CPU)."""
    if device.type != "cpu":
        return ""
    from ..models.kernels import cpu_flags

    flags = set(cpu_flags().split())
    if not flags & {"avx512_bf16", "amx_bf16", "bf16"}:
        return "this CPU has no bf16 dot-product instructions (avx512_bf16, amx_bf16 or Arm's bf16)"
    if not torch.backends.mkldnn.is_available():
        return "this build of torch has no oneDNN"
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    if not any(word in cap for word in ("ALL", "BF16", "AMX", "FP16", "AVX10")):
        return f"oneDNN is capped below bf16 dot products (ONEDNN_MAX_CPU_ISA={cap})"
    return ""


def batch_refusal(adapter) -> str:
    """Why a model cannot decode in a batch ('' when it can)."""
    if adapter.family == "alibi":
        return "ALiBi models decode alone: their bias needs each request's key positions"
    if not adapter.fast:
        return f"{type(adapter.model).__name__} does not run its attention through pcache_sdpa"
    return ""
