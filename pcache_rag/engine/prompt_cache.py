"""PromptCache: encode a schema's modules once, answer prompts by computing only new tokens.

The facade over the engine's parts. The flow of one prompt:

1. plan: parse the prompt and check it against the schema layout (:mod:`.schemas`);
2. assemble and prefill: place the imported units' cached states in the workspace and
   compute the argument and uncached tokens over them in one forward (:mod:`.prefill`,
   with the mask of :mod:`.mask`, following ``docs/pml.md``);
3. decode: ordinary KV-cache decoding after the prefill (:mod:`.decode`).

When a unit is encoded its tokens attend to the unit only (``encoding="isolated"``, the
paper) or also to the schema's preamble (``encoding="preamble"``) (:mod:`.encoder`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from ..discovery import KNOWN_JOURNAL, KnownTexts
from ..kv import ModuleKV, Workspace
from ..models import adapter_for
from ..models.attention import Calibration
from ..models.fast_decode import use_decode_weights
from ..pml import SchemaLayout, chat_format_for
from ..pml.layout import PromptPlan, bos_ids
from ..recompute import Lexicon, Recompute
from ..store import KVStore, default_store, model_fingerprint
from ..tokens import safe_tokenizer
from .decode import Decoder, Generation, SamplingParams, eos_ids
from .encoder import Encoder
from .listeners import Listeners
from .lock import EngineLock
from .prefill import Prefiller
from .scheduler import (DEFAULT_MAX_BATCH, DEFAULT_PREFILL_TOKENS, Request, Scheduler, batch_refusal, parts_request,
                        run_batch, stream_request)
from .schemas import SchemaRegistry, SchemaState
from .types import (
    DEFAULT_ENCODING,
    ENCODINGS,
    ContextOverflowError,
    Encoding,
    GenerationOutput,
    PrefillResult,
    SchemaReport,
    vars_of,
)
from .types import store_dtype as parse_store_dtype

log = logging.getLogger(__name__)

Parts = Sequence[tuple[str, ModuleKV]]


class PromptCache:
    """Modular attention reuse over any supported Hugging Face causal LM.

    ``PromptCache(model, tokenizer)`` switches the model's attention to
    ``pcache_sdpa`` where its family allows (same results as sdpa, without
    repeating grouped key/value heads) and installs the ALiBi position hooks
    for BLOOM/MPT. Calls from several threads are serialized by a lock, or, after
    :meth:`start_batching`, their streams decode together in one continuous batch.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        encoding: Encoding = DEFAULT_ENCODING,
        max_tokens: int | None = None,
        store: KVStore | None = None,
        cache_dir: str | None = None,
        store_dtype: torch.dtype | str | None = torch.float16,
        recompute: str | Recompute = "none",
        kv_url: str | None = None,
        decode_weights: str | None = None,
    ) -> None:
        """Wrap a loaded causal LM.

        ``store``: where module states live (default: a host-memory tier, plus a
        disk tier in ``cache_dir`` when given, plus a device tier on CUDA, plus a
        remote tier shared through the Redis/Valkey server at ``kv_url``, such as
        ``"redis://host:6379/0"``, when given).
        ``store_dtype``: precision of stored states (fp16 by default, as the
        paper; ``None`` keeps the model's dtype; ``"int8"`` or ``torch.int8``
        quantizes as KIVI does, about half of fp16); they are converted to the
        model's dtype while being copied into the workspace.
        ``max_tokens``: initial workspace capacity (it grows on demand).
        ``recompute``: the default policy for prompts that assemble several units
        (:mod:`pcache_rag.recompute`: ``"none"``, ``"epic:K"``, ``"blend:R"``, ``"match:N"``, ``"all"``);
        ``prefill``/``generate``/``stream`` take a per-call ``recompute=`` too.
        ``decode_weights``: ``"int8"`` or ``"bf16"`` copies of the linear weights for generated tokens
        only, self-checked (:mod:`pcache_rag.models.fast_decode`; :attr:`decode_report`).
        """
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, not {encoding!r}")
        if store is not None and kv_url is not None:
            raise ValueError("give either store or kv_url: kv_url adds a remote tier to the default store")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.encoding: Encoding = encoding
        self.recompute = Recompute.parse(recompute)
        self.adapter = adapter_for(model)
        self.chat = chat_format_for(tokenizer)
        #: tokenizes untrusted text without control tokens (see :mod:`pcache_rag.tokens`)
        self.safe = safe_tokenizer(tokenizer)
        self.max_positions = self.adapter.max_positions
        s = self.adapter.kv_shape
        cap = max_tokens or min(self.max_positions, 1024)
        self.workspace = Workspace(
            s.n_layers, s.n_kv_heads, s.head_dim, s.head_dim_v, self.adapter.dtype, self.adapter.device, cap
        )
        self._lock = EngineLock()
        self.store = store if store is not None else default_store(self.adapter.device, cache_dir, kv_url=kv_url)
        self.store_dtype = parse_store_dtype(store_dtype) or self.adapter.dtype
        self.fingerprint = model_fingerprint(
            model, tokenizer, encoding, self.store_dtype, {"family": self.adapter.family}
        )
        #: what ``decode_weights`` did (None: not asked for)
        self.decode_report = None if decode_weights is None else use_decode_weights(model, decode_weights, tokenizer)
        if getattr(self.adapter, "rerotatable", False):
            # Start-up self-check of RoPE re-rotation on the live model (as LMCache does):
            # if moved keys do not match keys encoded in place, never move states.
            try:
                self.adapter.self_check()  # type: ignore[attr-defined]  # RoPE adapters (rerotatable) have it
            except RuntimeError as e:
                log.warning("%s; RAG will encode chunks per slot instead of re-rotating", e)
                self.adapter.rerotatable = False
        self.encoder = Encoder(self.adapter, self.store, self.store_dtype)
        movable = bool(getattr(self.adapter, "rerotatable", False)) or self.adapter.family == "alibi"
        self.schemas = SchemaRegistry(tokenizer, self.chat, self.max_positions, self.fingerprint, encoding,
                                      self.encoder, self.store, movable, self.model_type)
        self.prefiller = Prefiller(self.adapter, self.workspace, Lexicon(tokenizer))
        self.decoder = Decoder(self.adapter, tokenizer, eos_ids(model, tokenizer))
        self.last_report: SchemaReport | None = None
        #: the document texts whose states this engine keeps or can encode: the Assembler finds
        #: them in prompts without marks (:mod:`pcache_rag.discovery`); with a ``cache_dir``, the
        #: kept ones are journalled beside their states, for every process on them
        self.known_texts = KnownTexts(Path(cache_dir).expanduser() / KNOWN_JOURNAL if cache_dir else None)
        self.listeners = Listeners()
        #: the continuous batch every stream joins, once :meth:`start_batching` is called
        self.scheduler: Scheduler | None = None

    @property
    def model_type(self) -> str:
        """The model's ``config.model_type`` (``"llama"``, ``"gpt2"``...)."""
        return str(getattr(getattr(self.model, "config", None), "model_type", "?"))

    @property
    def model_name(self) -> str:
        """The model's folder name (what the OpenAI server calls it)."""
        return Path(str(getattr(self.model.config, "_name_or_path", "") or "model")).name or "model"

    @property
    def eos_ids(self) -> set[int]:
        """The token ids that end a generation."""
        return self.decoder.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.decoder.eos_ids = set(ids)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        **kwargs,
    ) -> PromptCache:
        """Load a model and wrap it (no name: the embedded SmolLM2-135M-Instruct). ``name_or_path`` may be
        a local Hugging Face model folder or a ``.gguf`` file; nothing is ever downloaded."""
        from ..default_model import load_model

        model, tok = load_model(name_or_path, device=device, dtype=dtype)
        return cls(model, tok, **kwargs)

    # ------------------------------------------------------------------ schemas

    def add_schema(self, schema_pml: str, progress: bool = False) -> SchemaLayout:
        """Parse and lay out a schema, and encode every unit not already in the store.

        Units found in the store (a warm cache directory) are not re-encoded;
        ``self.last_report`` says how many were encoded and loaded. Re-adding a
        schema with the same name replaces it. Raises :class:`PMLError` for bad
        markup or a layout longer than the model's context.
        """
        layout, n_cond = self.schemas.layout(schema_pml)
        with self._lock:
            self.last_report = self.schemas.add(layout, n_cond, self.safe.text, progress)
            self.workspace.invalidate()
        return layout

    def schema(self, name: str) -> SchemaLayout:
        """The layout of the added schema ``name``."""
        return self.schemas.state(name).layout

    def unit_key(self, schema: str, unit: str) -> str:
        """The store key of ``unit``'s states in the added ``schema`` (a module's name, or an
        anonymous unit's, such as the preamble ``"#0"``)."""
        return self.schemas.unit_key(schema, unit)

    def unit_keys(self, schema: str) -> dict[str, str]:
        """Unit name -> store key for every unit of the added ``schema``."""
        return self.schemas.unit_keys(schema)

    def plan(self, prompt_pml: str) -> tuple[PromptPlan, SchemaState]:
        """Parse ``prompt_pml`` and check it against its schema (raises :class:`PMLError`)."""
        return self.schemas.plan(prompt_pml)

    def prefetch(self, prompt_pml: str, union_members: bool = False):
        """Start moving a prompt's module states to the fastest tier (returns a future, or None).

        With ``union_members`` the other members of each imported module's union come
        along: the likely next imports of a session (the paper's prefetch hint).
        """
        keys = self.schemas.prefetch_keys(prompt_pml, union_members)
        fn = getattr(self.store, "prefetch", None)
        return fn(keys) if fn else None

    # ------------------------------------------------------------------ states

    def encode(self, token_ids: list[int], position_ids: list[int], context: ModuleKV | None = None) -> ModuleKV:
        """Encode tokens at the given positions; with ``context``, they also attend to it.
        Returns the tokens' own states (not the context's)."""
        return self.encoder.encode(token_ids, position_ids, context)

    def stored_states(self, key: str, token_ids: list[int], position_ids: list[int]) -> ModuleKV:
        """The stored states under ``key``, encoding (and storing) them first if absent."""
        return self.encoder.stored_states(key, token_ids, position_ids)

    @property
    def encoded(self) -> dict[str, int]:
        """Units (modules, chunks, preambles) and tokens this engine has encoded so far."""
        return self.encoder.counts

    def place(self, kv: ModuleKV, start: int) -> ModuleKV:
        """The states of ``kv`` moved so its first token sits at position ``start``.

        RoPE keys are re-rotated (exact up to rounding); ALiBi states carry no
        position and are reused as they are; learned-position models cannot
        move states (encode at the target positions instead).
        """
        delta = start - int(kv.position_ids[0])
        return kv if delta == 0 else self.adapter.move(kv, delta)

    # ------------------------------------------------------------------ prefill

    def prefill(self, prompt_pml: str, reserve: int = 0, recompute: str | Recompute | None = None) -> PrefillResult:
        """Assemble the imported states and compute only the new tokens (plus the context tokens the
        ``recompute`` policy selects; default: the engine's); ``reserve`` leaves room for generated ones."""
        policy = self.policy(recompute)
        with self._lock:
            return self._prefill_prompt(prompt_pml, reserve, policy)

    def prefill_parts(self, parts: Parts, new_ids: list[int], preamble: str | None = None, reserve: int = 0,
                      recompute: str | Recompute | None = None,
                      calibration: str | Calibration | None = None) -> PrefillResult:
        """Prefill cached ``parts`` (label, states already at their positions) plus ``new_ids``,
        which are placed right after the last part's position. ``calibration`` (``"ape:T:S"``)
        calibrates attention to every part after the first."""
        policy = self.policy(recompute)
        with self._lock:
            return self._prefill_parts(parts, new_ids, preamble, reserve, policy, Calibration.parse(calibration))

    def policy(self, recompute: str | Recompute | None) -> Recompute:
        """The recompute policy a call uses: its own, or the engine's default."""
        return self.recompute if recompute is None else Recompute.parse(recompute)

    def _prefill_prompt(self, prompt_pml: str, reserve: int, policy: Recompute) -> PrefillResult:
        plan, state = self.schemas.plan(prompt_pml)
        kvs = self.schemas.states(plan, state)
        pre = plan.layout.preamble if self.encoding == "preamble" else None
        return self.prefiller.run([u.name for u in plan.units], kvs, plan.args, plan.uncached_ids,
                                  plan.uncached_positions, pre, reserve, policy)

    def _prefill_parts(self, parts: Parts, new_ids: list[int], preamble: str | None, reserve: int,
                       policy: Recompute, calibration: Calibration | None = None) -> PrefillResult:
        if not new_ids:
            raise ValueError("there must be at least one new token to compute")
        start = max((int(kv.position_ids[-1]) + 1 for _, kv in parts), default=0)
        pos = list(range(start, start + len(new_ids)))
        if pos[-1] >= self.max_positions:
            raise ContextOverflowError(f"the prompt needs {pos[-1] + 1} positions; the model takes {self.max_positions}")
        pre = preamble if self.encoding == "preamble" else None
        return self.prefiller.run([p[0] for p in parts], [p[1] for p in parts], [], list(new_ids), pos, pre,
                                  reserve, policy, calibration)

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_pml: str, max_new_tokens: int = 64, do_sample: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] | None = None,
                 recompute: str | Recompute | None = None, grammar: str | None = None) -> GenerationOutput:
        """Answer a prompt: prefill from the cache, then decode.

        Greedy by default; ``do_sample=True`` samples with ``temperature`` and
        ``top_p`` (``seed`` makes it repeatable). Stops at EOS, at any string in
        ``stop`` (excluded from the text) or after ``max_new_tokens``.
        ``recompute`` overrides the engine's policy for this call. ``grammar``
        (:func:`pcache_rag.grammar.json_grammar` and its siblings) constrains the answer.
        """
        params = SamplingParams.of(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                                   top_p=top_p, seed=seed, stop=tuple(stop or ()), grammar=grammar)
        return self.stream(prompt_pml, recompute, params=params).result()

    def stream(self, prompt_pml: str, recompute: str | Recompute | None = None,
               params: SamplingParams | None = None, **gen) -> Generation:
        """Text deltas as they are decoded (same arguments as :meth:`generate`, or ``params``);
        the returned :class:`Generation` holds the output once exhausted."""
        policy, sp = self.policy(recompute), SamplingParams.of(params, **gen)
        prepare = lambda r: self._prefill_prompt(prompt_pml, r, policy)  # noqa: E731
        return self._generation(prepare, sp, lambda: Request(sp, self.schemas.rows(prompt_pml) + sp.max_new_tokens,
                                                             prepare=prepare))

    def generate_parts(self, parts: Parts, new_ids: list[int], preamble: str | None = None,
                       recompute: str | Recompute | None = None, calibration: str | Calibration | None = None,
                       params: SamplingParams | None = None, **gen) -> GenerationOutput:
        """:meth:`generate` for cached parts plus new token ids (see :meth:`prefill_parts`)."""
        return self.stream_parts(parts, new_ids, preamble, recompute, calibration, params, **gen).result()

    def stream_parts(self, parts: Parts, new_ids: list[int], preamble: str | None = None,
                     recompute: str | Recompute | None = None, calibration: str | Calibration | None = None,
                     params: SamplingParams | None = None, **gen) -> Generation:
        """:meth:`stream` for cached parts plus new token ids."""
        sp = SamplingParams.of(params, **gen)
        policy, cal = self.policy(recompute), Calibration.parse(calibration)
        return self._generation(self._parts_prepare(parts, new_ids, preamble, policy, cal), sp,
                                lambda: self._request(parts, new_ids, preamble, policy, cal, sp))

    def _parts_prepare(self, parts: Parts, new_ids: list[int], preamble: str | None, policy: Recompute,
                       cal: Calibration | None) -> Callable[[int], PrefillResult]:
        return lambda reserve: self._prefill_parts(parts, new_ids, preamble, reserve, policy, cal)
    def _request(self, parts: Parts, new_ids: list[int], preamble: str | None, policy: Recompute,
                 cal: Calibration | None, params: SamplingParams) -> Request:
        prepare = self._parts_prepare(parts, new_ids, preamble, policy, cal)
        return parts_request(self, parts, new_ids, params, prepare, policy.kind == "none", cal)

    def text_ids(self, text: str) -> list[int]:
        """BOS (if the tokenizer adds one) plus ``text`` tokenized as text: control-token strings
        in it stay characters (:mod:`pcache_rag.tokens`)."""
        return bos_ids(self.tokenizer) + self.safe.text(text)

    def generate_text(self, text: str, **gen) -> GenerationOutput:
        """Generate from plain text with nothing cached (an ordinary LLM call). The text is never
        read as chat markup; use a PML prompt with role tags for a chat turn."""
        return self.generate_parts([], self.text_ids(text), **gen)

    def stream_text(self, text: str, **gen) -> Generation:  # :meth:`generate_text`, streamed
        return self.stream_parts([], self.text_ids(text), **gen)

    def _generation(self, prepare: Callable[[int], PrefillResult], params: SamplingParams,
                    make: Callable[[], Request]) -> Generation:
        """A stream: ``prepare`` then decoding alone over the workspace, or, with batching on, the
        request ``make`` builds, in the scheduler's batch."""
        sched = self.scheduler
        if sched is None or self.batch_refusal:
            return Generation(self._run(prepare, params, self.batch_refusal if sched else ""),
                              on_done=self.listeners.notify)
        return Generation(stream_request(sched, make), on_done=self.listeners.notify)

    def _run(self, prepare: Callable[[int], PrefillResult], params: SamplingParams, unbatched: str = ""):
        """Prefill with ``prepare(reserve)`` and decode; yields text deltas, then the output.
        The lock is taken at the first item; TTFT counts from there, so planning and fetching
        states are included."""
        t0 = time.perf_counter()
        with self._lock, torch.no_grad():
            res = prepare(params.max_new_tokens)
            yield from self.decoder.stream(res, t0, params, self.workspace.cache(), unbatched)

    def generate_parts_batch(self, requests, max_new_tokens: int = 64,
                             stop: Sequence[str] | None = None) -> list[GenerationOutput]:
        """Greedy :meth:`generate_parts` answers to ``(parts, new_ids, preamble, recompute[, calibration])``
        requests, prefilled and decoded together in one batch (:mod:`.scheduler`); batched products
        round differently, so a rare near-tie may resolve otherwise; others decode alone (batch_refusal)."""
        params = SamplingParams.of(max_new_tokens=max_new_tokens, stop=tuple(stop or ()))
        reqs = [tuple(r) + (None,) * (5 - len(r)) for r in requests]
        if why := self.batch_refusal:  # one at a time, and each output says why
            outs = [self.generate_parts(p, ids, pre, rc, cal, params) for p, ids, pre, rc, cal in reqs]
            return [dataclasses.replace(o, unbatched=why) for o in outs]
        batch = [self._request(p, ids, pre, self.policy(rc), Calibration.parse(cal), params)
                 for p, ids, pre, rc, cal in reqs]
        return self.listeners.notify_all(run_batch(Scheduler(self, self._lock, max(1, len(batch)), 4096,
                                                             sum(r.rows for r in batch) or 1), batch))

    # ------------------------------------------------------------------ batching

    @property
    def batch_refusal(self) -> str:
        """Why this model cannot decode in a batch ('' when it can)."""
        return batch_refusal(self.adapter)

    def start_batching(self, max_batch: int = DEFAULT_MAX_BATCH, prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
                       kv_budget: int | None = None) -> Scheduler:
        """Serve every stream of this engine from one continuous batch (:mod:`.scheduler`):
        requests join and leave at token boundaries, up to ``max_batch`` decode together, new
        prompts are prefilled between decode steps ``prefill_tokens`` at a time, and
        ``kv_budget`` bounds their live KV rows. A model that cannot batch (:attr:`batch_refusal`)
        keeps decoding one stream at a time, and its outputs say why (``unbatched``)."""
        if self.scheduler is not None:
            raise RuntimeError("batching is already on: stop_batching() first")
        if self.batch_refusal:
            log.warning("batching is off: %s", self.batch_refusal)
        self.scheduler = Scheduler(self, self._lock, max_batch, prefill_tokens, kv_budget)
        self.scheduler.start()
        return self.scheduler

    def batch_stats(self) -> dict | None:
        """The batch's statistics (None with batching off)."""
        return self.scheduler.stats() if self.scheduler else None

    def stop_batching(self) -> None:
        """Back to one stream at a time; requests still in the batch get an error."""
        sched, self.scheduler = self.scheduler, None
        if sched is not None:
            sched.stop()

    # ------------------------------------------------------------------ observing

    def add_listener(self, fn: Callable[[GenerationOutput], None]) -> None:
        """Call ``fn`` with every finished generation's output (of any call, from any thread)."""
        self.listeners.add(fn)

    def remove_listener(self, fn: Callable[[GenerationOutput], None]) -> None:
        self.listeners.remove(fn)

    def recording(self) -> contextlib.AbstractContextManager[list[GenerationOutput]]:
        """A list that collects every generation finished while the block runs: how a caller
        sees the usage of calls made deep inside a framework's chain."""
        return self.listeners.recording()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[PromptCache]:
        """Hold the engine: every other call waits until the block ends (maintenance, or a test
        that needs the engine busy)."""
        with self._lock:
            yield self

    # ------------------------------------------------------------------ baselines

    def full_prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                     last: int = 1) -> torch.Tensor:
        """The baseline: one causal forward over all tokens, nothing reused (:meth:`Prefiller.full`)."""
        return self.prefiller.full(input_ids, position_ids, last)

    def stats(self) -> dict:
        """Store statistics per tier (hits, misses, bytes, evictions, load time), schemas, what
        this engine encoded (units and tokens) and, with batching on, the batch's."""
        tiers = getattr(self.store, "tier_stats", None)
        return {"tiers": {k: vars_of(v) for k, v in tiers().items()} if tiers else {"store": vars_of(self.store.stats())},
                "schemas": self.schemas.sizes(), "workspace_bytes": self.workspace.nbytes(),
                "encoded": dict(self.encoded), "batch": self.scheduler.stats() if self.scheduler else None}

