"""PromptCache: encode a schema's modules once, answer prompts by computing only new tokens.

The facade over the engine's parts. The flow of one prompt:

1. plan: parse the prompt and check it against the schema layout (:mod:`.schemas`);
2. assemble and prefill: place the imported units' cached states in the workspace and
   compute the argument and uncached tokens over them in one forward (:mod:`.prefill`,
   with the mask of :mod:`.mask`, following ``docs/pml.md``);
3. decode: ordinary KV-cache decoding after the prefill (:mod:`.decode`).

When a unit is encoded its tokens attend to the unit only (``encoding="isolated"``, the
paper) or also to the schema's preamble (``encoding="preamble"``) (:mod:`.encoder`).

The model side (adapter, workspace, prefill, decode, the lock) is the :class:`~.core.EngineCore`,
and where a stream runs (alone or in the continuous batch) is the :class:`~.dispatch.Dispatcher`'s;
this class owns the schemas, the store, the known documents and the public API over them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from ..conditioning import conditioning_refusal
from ..discovery import KNOWN_JOURNAL, KnownTexts
from ..store.learned import LearnedStore
from ..models.attention import Calibration
from ..moved import moved
from ..pml import SchemaLayout, chat_format_for
from ..pml.layout import bos_ids
from ..recompute import Recompute
from ..store import KVStore, default_store, model_fingerprint
from ..tokens import safe_tokenizer
from .core import EngineCore, Parts
from .decode import Generation, SamplingParams
from .dispatch import Dispatcher
from .encoder import Encoder
from .scheduler import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_TOKENS, Request, Scheduler
from .watchdog import DEFAULT_STALL_S
from .schemas import SchemaRegistry
from .types import (
    DEFAULT_ENCODING,
    ENCODINGS,
    Encoding,
    GenerationOutput,
    PrefillResult,
    SchemaReport,
    vars_of,
)
from .types import store_dtype as parse_store_dtype

log = logging.getLogger(__name__)

#: methods that moved from :class:`PromptCache` to its parts after 0.1 (old name -> new home)
MOVED = {"unit_key": "schemas.unit_key", "unit_keys": "schemas.unit_keys", "plan": "schemas.plan",
         "encode": "encoder.encode", "place": "encoder.place", "add_listener": "listeners.add",
         "remove_listener": "listeners.remove", "recording": "listeners.recording", "full_prefill": "core.full_prefill"}

#: what :meth:`PromptCache.generate` answers: a PML prompt over an added schema, or cached parts
Prompt = str | Parts


class PromptCache:
    """Modular attention reuse over any supported Hugging Face causal LM.

    ``PromptCache(model, tokenizer)`` switches the model's attention to
    ``pcache_sdpa`` where its family allows (same results as sdpa, without
    repeating grouped key/value heads) and installs the ALiBi position hooks
    for BLOOM/MPT. Calls from several threads are serialized by a lock, or, after
    :meth:`start_batching`, their streams decode together in one continuous batch.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, encoding: Encoding = DEFAULT_ENCODING,
                 max_tokens: int | None = None, store: KVStore | None = None, cache_dir: str | None = None,
                 store_dtype: torch.dtype | str | None = torch.float16, recompute: str | Recompute = "none",
                 kv_url: str | None = None, decode_weights: str | None = None, fused_decode: bool = True,
                 query_weights: str | None = None) -> None:
        """Wrap a loaded causal LM.

        ``store``: where module states live (default: a host-memory tier, plus a
        disk tier in ``cache_dir`` when given, plus a device tier on CUDA, plus a
        remote tier shared through the Redis/Valkey server at ``kv_url``, such as
        ``"redis://host:6379/0"``, when given).
        ``store_dtype``: precision of stored states (fp16 by default, as the paper; ``None`` keeps the
        model's dtype; ``"int8"`` or ``torch.int8`` quantizes as KIVI does, about half of fp16);
        they are converted to the model's dtype while being copied into the workspace.
        ``max_tokens``: initial workspace capacity (it grows on demand).
        ``recompute``: the default policy for prompts that assemble several units
        (:mod:`pcache_rag.recompute`: ``"none"``, ``"epic:K"``, ``"match:N"``, ``"each:N"``, ``"alike:N"``, ``"all"``...);
        ``prefill``/``generate``/``stream`` take a per-call ``recompute=`` too.
        ``decode_weights``: ``"int8"`` or ``"bf16"`` copies of the linear weights for generated tokens
        only, self-checked (:mod:`pcache_rag.models.fast_decode`; :attr:`decode_report`); None or
        ``"fp32"``: the model's own.
        ``query_weights="bf16"`` (with bf16 ``decode_weights``): rows over cached states read them too.
        ``fused_decode``: decode alone with the fused step (:mod:`pcache_rag.models.decode_step`) where
        the model allows; ``core.decode_path`` says which step runs and why.
        """
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, not {encoding!r}")
        if store is not None and kv_url is not None:
            raise ValueError("give either store or kv_url: kv_url adds a remote tier to the default store")
        self.core = core = EngineCore(model, tokenizer, max_tokens, decode_weights, fused_decode, query_weights)
        # the core's parts, under the names the engine has always had
        self.model, self.adapter, self.workspace, self.max_positions = core.model, core.adapter, core.workspace, \
            core.max_positions
        self.prefiller, self.decoder, self.listeners, self._lock = core.prefiller, core.decoder, core.listeners, core.lock
        #: what ``decode_weights`` did (None: not asked for)
        self.decode_report = core.decode_report
        #: where streams run: alone, or in the continuous batch after :meth:`start_batching`
        self.dispatch = Dispatcher(core)
        self.tokenizer = tokenizer
        self.encoding: Encoding = encoding
        self.recompute = Recompute.parse(recompute)
        self.chat = chat_format_for(tokenizer)
        #: tokenizes untrusted text without control tokens (see :mod:`pcache_rag.tokens`)
        self.safe = safe_tokenizer(tokenizer)
        self.store = store if store is not None else default_store(self.adapter.device, cache_dir, kv_url=kv_url)
        self.store_dtype = parse_store_dtype(store_dtype) or self.adapter.dtype
        self.fingerprint = model_fingerprint(
            model, tokenizer, encoding, self.store_dtype, {"family": self.adapter.family}
        )
        self.encoder = Encoder(self.adapter, self.store, self.store_dtype)
        self.movable = movable = bool(self.adapter.rerotatable) or self.adapter.family == "alibi"
        self.schemas = SchemaRegistry(tokenizer, self.chat, self.max_positions, self.fingerprint, encoding,
                                      self.encoder, self.store, movable, self.model_type)
        self.last_report: SchemaReport | None = None
        #: the document texts whose states this engine keeps or can encode: the Assembler finds
        #: them in prompts without marks (:mod:`pcache_rag.discovery`); with a ``cache_dir``, the
        #: kept ones are journalled beside their states, for every process on them
        self.known_texts = KnownTexts(Path(cache_dir).expanduser() / KNOWN_JOURNAL if cache_dir else None)
        #: states learned from prompts: per tenant, in memory, within their own budget (:mod:`pcache_rag.store.learned`)
        self.learned = LearnedStore()

    @property
    def scheduler(self) -> Scheduler | None:
        """The continuous batch, once :meth:`start_batching` is called."""
        return self.dispatch.scheduler

    @property
    def model_type(self) -> str:
        """The model's ``config.model_type`` (``"llama"``, ``"gpt2"``...)."""
        return str(getattr(getattr(self.model, "config", None), "model_type", "?"))

    def conditioning_refusal(self, kind: str) -> str:
        """Why this engine cannot encode after ``kind`` conditioning ('' when it can; :func:`~pcache_rag.conditioning.conditioning_refusal`)."""
        return conditioning_refusal(kind, self.encoding, self.movable, self.adapter.family, self.adapter.constrained,
                                    self.model_type)

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

    def prefetch(self, prompt_pml: str, union_members: bool = False):
        """Start moving a prompt's module states to the fastest tier (returns a future, or None).

        With ``union_members`` the other members of each imported module's union come
        along: the likely next imports of a session (the paper's prefetch hint).
        """
        return self.store.prefetch(self.schemas.prefetch_keys(prompt_pml, union_members))

    # ------------------------------------------------------------------ states

    @property
    def encoded(self) -> dict[str, int]:
        """Units (modules, chunks, preambles) and tokens this engine has encoded so far."""
        return self.encoder.counts

    # ------------------------------------------------------------------ prompts: a PML string, or Parts

    def prefill(self, prompt: Prompt, reserve: int = 0, recompute: str | Recompute | None = None) -> PrefillResult:
        """Assemble the prompt's cached states and compute only its new tokens (plus the context tokens
        the ``recompute`` policy selects; default: the engine's); ``reserve`` leaves room for generated
        ones. ``prompt``: a PML prompt over an added schema, or :class:`Parts` (cached states and token ids)."""
        policy = self.policy(recompute)
        with self._lock:
            return prepared(self, prompt, policy)(reserve)

    def generate(self, prompt: Prompt, recompute: str | Recompute | None = None, params: SamplingParams | None = None,
                 **gen) -> GenerationOutput:
        """Answer a prompt (see :meth:`prefill`): prefill from the cache, then decode.

        ``gen`` are :class:`SamplingParams` (or give ``params``): greedy by default, ``max_new_tokens``
        64; ``do_sample=True`` samples with ``temperature`` and ``top_p`` (``seed`` makes it repeatable).
        Stops at EOS, at any string in ``stop`` (excluded from the text) or after ``max_new_tokens``.
        ``recompute`` overrides the engine's policy for this call; ``grammar``
        (:func:`pcache_rag.grammar.json_grammar` and its siblings) constrains the answer.
        """
        return self.stream(prompt, recompute, params, **gen).result()

    def stream(self, prompt: Prompt, recompute: str | Recompute | None = None, params: SamplingParams | None = None,
               **gen) -> Generation:
        """Text deltas as they are decoded (same arguments as :meth:`generate`); the returned
        :class:`Generation` holds the output once exhausted."""
        policy, sp = self.policy(recompute), SamplingParams.of(params, **gen)
        if isinstance(prompt, Parts):
            return self.dispatch.parts_generation(resolved(self, prompt), policy, sp)
        prepare = prepared(self, prompt, policy)
        return self.dispatch.generation(prepare, sp, lambda: Request(sp, self.schemas.rows(prompt) + sp.max_new_tokens,
                                                                     prepare=prepare))

    def generate_batch(self, prompts: Sequence[Parts], recompute: str | Recompute | Sequence | None = None,
                       max_new_tokens: int = 64, stop: Sequence[str] | None = None) -> list[GenerationOutput]:
        """Greedy :meth:`generate` answers to ``prompts``, prefilled and decoded together in one batch
        (:mod:`.scheduler`); ``recompute``: one policy, or one per prompt. Batched products round
        differently, so a rare near-tie may resolve otherwise; a model that cannot batch
        (:attr:`batch_refusal`) answers each alone."""
        policies = recompute if isinstance(recompute, (list, tuple)) else [recompute] * len(prompts)
        params = SamplingParams.of(max_new_tokens=max_new_tokens, stop=tuple(stop or ()))
        return self.dispatch.generate_batch([(resolved(self, p), self.policy(rc)) for p, rc in zip(prompts, policies)],
                                            params)

    def text_ids(self, text: str) -> list[int]:
        """BOS (if the tokenizer adds one) plus ``text`` tokenized as text: control-token strings in it
        stay characters (:mod:`pcache_rag.tokens`). ``Parts([], pc.text_ids(text))`` is a plain-text
        prompt with nothing cached (an ordinary LLM call; never read as chat markup)."""
        return bos_ids(self.tokenizer) + self.safe.text(text)

    def policy(self, recompute: str | Recompute | None) -> Recompute:
        """The recompute policy a call uses: its own, or the engine's default."""
        return self.recompute if recompute is None else Recompute.parse(recompute)

    # ------------------------------------------------------------------ batching

    @property
    def batch_refusal(self) -> str:
        """Why this model cannot decode in a batch ('' when it can)."""
        return self.core.batch_refusal

    def start_batching(self, max_batch: int = DEFAULT_MAX_BATCH, prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
                       kv_budget: int | None = None, stall_s: float | None = DEFAULT_STALL_S) -> Scheduler:
        """Serve every stream of this engine from one continuous batch (:mod:`.scheduler`):
        requests join and leave at token boundaries, up to ``max_batch`` decode together, new
        prompts are prefilled between decode steps ``prefill_tokens`` at a time, and
        ``kv_budget`` bounds their live KV rows. A model that cannot batch (:attr:`batch_refusal`)
        keeps decoding one stream at a time, and its outputs say why (``unbatched``). A batch
        that makes no step for ``stall_s`` seconds fails the requests waiting on it with
        :class:`~.types.StalledError` (None: never; :mod:`.watchdog`)."""
        return self.dispatch.start_batching(max_batch, prefill_tokens, kv_budget, stall_s)

    def batch_stats(self) -> dict | None:
        """The batch's statistics (None with batching off)."""
        return self.scheduler.stats() if self.scheduler else None

    def stop_batching(self) -> None:
        """Back to one stream at a time; requests still in the batch get an error."""
        self.dispatch.stop_batching()

    # ------------------------------------------------------------------ observing: :attr:`listeners`

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[PromptCache]:
        """Hold the engine: every other call waits until the block ends (maintenance, or a test
        that needs the engine busy)."""
        with self._lock:
            yield self

    def __getattr__(self, name: str):
        """Methods that moved to the engine's parts after 0.1 (:data:`MOVED`): still reached
        here for one release, with a ``DeprecationWarning`` naming the new home."""
        return moved(self, name, MOVED, "pc")

    def stats(self) -> dict:
        """Store statistics per tier (hits, misses, bytes, evictions, load time), schemas, what
        this engine encoded (units and tokens) and, with batching on, the batch's."""
        return {"tiers": {k: vars_of(v) for k, v in self.store.tier_stats().items()},
                "schemas": self.schemas.sizes(), "workspace_bytes": self.workspace.nbytes(),
                "encoded": dict(self.encoded), "batch": self.scheduler.stats() if self.scheduler else None}


def resolved(pc: PromptCache, prompt: Parts) -> Parts:
    """``prompt`` with its preamble kept only under ``encoding="preamble"``, its calibration parsed."""
    return dataclasses.replace(prompt, preamble=prompt.preamble if pc.encoding == "preamble" else None,
                               calibration=Calibration.parse(prompt.calibration))


def prepared(pc: PromptCache, prompt: Prompt, policy: Recompute) -> Callable[[int], PrefillResult]:
    """``prompt``'s prefill on ``pc``, leaving room for that many generated tokens (run under the lock)."""
    if isinstance(prompt, Parts):
        return pc.dispatch.prepare_parts(resolved(pc, prompt), policy)

    def prefill_pml(reserve: int) -> PrefillResult:
        plan, state = pc.schemas.plan(prompt)
        pre = plan.layout.preamble if pc.encoding == "preamble" else None
        return pc.prefiller.run([u.name for u in plan.units], pc.schemas.states(plan, state), plan.args,
                                plan.uncached_ids, plan.uncached_positions, pre, reserve, policy)
    return prefill_pml
