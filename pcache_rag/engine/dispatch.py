"""Where a prepared prompt runs: alone over the workspace, or as a request in the continuous batch.

A :class:`Dispatcher` holds the engine's :class:`~.core.EngineCore` and, once batching is on,
its :class:`~.scheduler.Scheduler`; every stream of the engine goes through it, so a request
decodes the same alone or batched.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from ..models.attention import Calibration
from ..recompute import Recompute
from .core import EngineCore, Parts, Prepare
from .decode import Generation, SamplingParams
from .scheduler import (DEFAULT_MAX_BATCH, DEFAULT_PREFILL_TOKENS, Request, Scheduler, parts_request, run_batch,
                        stream_request)
from .types import GenerationOutput
from .watchdog import DEFAULT_STALL_S

log = logging.getLogger(__name__)


class Dispatcher:
    """Runs the streams of one engine's ``core``: alone, or in the batch once :meth:`start_batching`."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        #: the continuous batch every stream joins, once :meth:`start_batching` is called
        self.scheduler: Scheduler | None = None

    def generation(self, prepare: Prepare, params: SamplingParams, make: Callable[[], Request]) -> Generation:
        """A stream: ``prepare`` then decoding alone over the workspace, or, with batching on, the
        request ``make`` builds, in the scheduler's batch."""
        sched = self.scheduler
        if sched is None or self.core.batch_refusal:
            return Generation(self.core.run(prepare, params, self.core.batch_refusal if sched else ""),
                              on_done=self.core.listeners.notify)
        return Generation(stream_request(sched, make), on_done=self.core.listeners.notify)

    def parts_generation(self, prompt: Parts, policy: Recompute, params: SamplingParams) -> Generation:
        """:meth:`generation` of a :class:`~.core.Parts` prompt (its preamble and calibration resolved)."""
        return self.generation(self.prepare_parts(prompt, policy), params, lambda: self.request(prompt, policy, params))

    def prepare_parts(self, prompt: Parts, policy: Recompute) -> Prepare:
        """Prefills ``prompt`` (called by whoever holds the lock: a solo run, or a batch step)."""
        return lambda reserve: self.core.prefill_parts(prompt, reserve, policy)

    def request(self, prompt: Parts, policy: Recompute, params: SamplingParams) -> Request:
        """The batch request of ``prompt`` (:func:`.scheduler.parts_request`). Its new tokens are
        prefilled in the batch's steps when nothing is recomputed: under ``recompute="none"``, or
        when nothing is cached (no context to recompute, whatever the policy); several such
        prompts then share one forward, where the engine's own prefill costs one forward each.
        torch's products over more rows round differently, so such a prompt's states may differ
        from its solo prefill's in their last bits, and a near-tie in its answer may resolve
        otherwise; the decode step adds no difference of its own."""
        return parts_request(self.core, prompt.parts, list(prompt.new_ids), params, self.prepare_parts(prompt, policy),
                             policy.kind == "none" or not prompt.parts, Calibration.parse(prompt.calibration))

    def generate_batch(self, prompts: list[tuple[Parts, Recompute]], params: SamplingParams) -> list[GenerationOutput]:
        """Greedy answers to ``(prompt, policy)`` pairs, prefilled and decoded together in one batch;
        a model that cannot batch answers each alone, and each output says why (``unbatched``)."""
        if why := self.core.batch_refusal:
            return [dataclasses.replace(self.parts_generation(p, policy, params).result(), unbatched=why)
                    for p, policy in prompts]
        batch = [self.request(p, policy, params) for p, policy in prompts]
        sched = Scheduler(self.core, max(1, len(batch)), 4096, sum(r.rows for r in batch) or 1)
        return self.core.listeners.notify_all(run_batch(sched, batch))

    # ------------------------------------------------------------------ batching

    def start_batching(self, max_batch: int = DEFAULT_MAX_BATCH, prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
                       kv_budget: int | None = None, stall_s: float | None = DEFAULT_STALL_S) -> Scheduler:
        """Serve every stream from one continuous batch (see :meth:`PromptCache.start_batching`)."""
        if self.scheduler is not None:
            raise RuntimeError("batching is already on: stop_batching() first")
        if self.core.batch_refusal:
            log.warning("batching is off: %s", self.core.batch_refusal)
        self.scheduler = Scheduler(self.core, max_batch, prefill_tokens, kv_budget, stall_s)
        self.scheduler.start()
        return self.scheduler

    def stop_batching(self) -> None:
        """Back to one stream at a time; requests still in the batch get an error."""
        sched, self.scheduler = self.scheduler, None
        if sched is not None:
            sched.stop()
