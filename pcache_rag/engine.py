"""PromptCache: encode a schema's modules once, answer prompts by computing only new tokens.

The flow of one prompt:

1. plan: parse the prompt and check it against the schema layout
   (:func:`pcache_rag.pml.plan_prompt`);
2. assemble: place the imported units' cached states in the workspace
   buffers (:class:`pcache_rag.kv.Workspace`), copying only what the previous
   prompt did not leave there;
3. prefill: one forward of the stock model over the argument and uncached
   tokens, with their schema positions and a mask that says what each may
   attend to;
4. decode: ordinary KV-cache decoding after the prefill.

Masks follow ``docs/pml.md``. When a unit is encoded its tokens attend to the
unit only (``encoding="isolated"``, the paper) or also to the schema's
preamble (``encoding="preamble"``). A param argument attends to its module's
tokens before the slot (and the preamble in preamble mode); uncached tokens
attend to everything before them.

When nothing needs a mask beyond "every earlier key, and the new tokens causally" (no
arguments, no recomputed rows), no mask is built: the attention's split path
(:mod:`pcache_rag.models.attention`) serves the cache unmasked and the new tokens
causally. The same path carries **calibrated attention** (``calibration="ape:T:S"`` on
the parts API): the documents' keys, everything cached after the first part, get APE's
temperature and scale on the question's and the answer's rows.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicCache

from .kv import BufferLayer, ModuleKV, Workspace
from .models import UnsupportedModelError, adapter_for
from .models.attention import CalibratedSpan, Calibration, calibrated
from .conditioning import neutral_text, parse_conditioning
from .discovery import KnownTexts
from .store import KVStore, default_store, model_fingerprint, unit_key
from .pml import PMLError, SchemaLayout, chat_format_for, layout_schema, parse_prompt, plan_prompt
from .pml.layout import PromptPlan, Unit, bos_ids
from .recompute import Recompute, blend_rows, epic_rows, first_layers_keys, focus_scores, recompute_mask
from .tokens import safe_tokenizer

log = logging.getLogger(__name__)

ENCODINGS = ("isolated", "preamble")
DEFAULT_ENCODING = "preamble"  # measured better than "isolated": `pcache-rag bench quality`, README


class ContextOverflowError(ValueError):
    """A prompt needs more positions than the model takes (not a PML error: no PML may be involved)."""


@dataclass(slots=True)
class PrefillResult:
    """The outcome of prefilling one prompt against cached states."""

    logits: torch.Tensor  # (vocab,) next-token logits after the last prompt token
    input_ids: torch.Tensor  # (T,) cache order: imported units, arguments, uncached tokens
    position_ids: torch.Tensor  # (T,) the position id of each of those tokens
    spans: list[tuple[str, int, int]]  # (label, start, end) ranges of input_ids
    cached_tokens: int  # tokens whose states came from the cache
    computed_tokens: int  # tokens computed by this prefill
    copied_tokens: int = 0  # cached tokens copied into the workspace (the rest were resident)
    recomputed_tokens: int = 0  # context tokens recomputed on top of the cache (counted in computed_tokens)
    assemble_s: float = 0.0  # seconds spent placing cached states
    forward_s: float = 0.0  # seconds in the forward pass
    calibrated: CalibratedSpan | None = None  # the keys decoding attends to with a calibration


@dataclass(slots=True)
class GenerationOutput:
    """A finished generation."""

    text: str  # decoded new text (stop string excluded)
    token_ids: list[int]  # generated token ids
    ttft_s: float  # seconds from the call to the first sampled token
    cached_tokens: int
    computed_tokens: int
    total_s: float = 0.0
    finish_reason: str = "length"  # "length" | "eos" | "stop"
    recomputed_tokens: int = 0  # context tokens recomputed (included in computed_tokens)


class _EngineLock:
    """Serializes engine calls. Unlike an ``RLock`` it may be released by another thread:
    a stream started in one thread and resumed in others (``asyncio.to_thread(next, it)``)
    releases it wherever it finishes. A thread that calls the engine while its own
    stream is still open gets an error instead of a deadlock or a clobbered workspace."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self):
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError(
                "PromptCache is busy in this thread: finish (or close) the running stream before another call"
            )
        self._lock.acquire()
        self._owner = me
        return self

    def __exit__(self, *exc) -> None:
        self._owner = None
        self._lock.release()


@dataclass(slots=True)
class _SchemaState:
    layout: SchemaLayout
    keys: dict[str, str] = field(default_factory=dict)  # unit name -> store key
    context: dict[str, str | None] = field(default_factory=dict)  # unit name -> key of what it attended to
    conditioning: tuple | None = None  # (preamble key, passage ids, context key) of a conditioned schema


@dataclass(slots=True)
class SchemaReport:
    """What ``add_schema`` did: units encoded now vs found in the store."""

    name: str
    encoded: int
    loaded: int
    tokens: int
    seconds: float


class PromptCache:
    """Modular attention reuse over any supported Hugging Face causal LM.

    ``PromptCache(model, tokenizer)`` switches the model's attention to
    ``pcache_sdpa`` where its family allows (same results as sdpa, without
    repeating grouped key/value heads) and installs the ALiBi position hooks
    for BLOOM/MPT. Not thread-safe for concurrent prompts: calls are
    serialized by a lock.
    """

    def __init__(
        self,
        model,
        tokenizer,
        encoding: str = DEFAULT_ENCODING,
        max_tokens: int | None = None,
        store: KVStore | None = None,
        cache_dir: str | None = None,
        store_dtype: torch.dtype | str | None = torch.float16,
        recompute: "str | Recompute" = "none",
        kv_url: str | None = None,
    ):
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
        (:mod:`pcache_rag.recompute`: ``"none"``, ``"epic:K"``, ``"blend:R"``, ``"all"``);
        ``prefill``/``generate``/``stream`` take a per-call ``recompute=`` too.
        """
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, not {encoding!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.encoding = encoding
        self.recompute = Recompute.parse(recompute)
        self.adapter = adapter_for(model)
        self.chat = chat_format_for(tokenizer)
        #: tokenizes untrusted text without control tokens (see :mod:`pcache_rag.tokens`)
        self.safe = safe_tokenizer(tokenizer)
        self.max_positions = self.adapter.max_positions
        self._schemas: dict[str, _SchemaState] = {}
        s = self.adapter.kv_shape
        cap = max_tokens or min(self.max_positions, 1024)
        self.workspace = Workspace(
            s.n_layers, s.n_kv_heads, s.head_dim, s.head_dim_v, self.adapter.dtype, self.adapter.device, cap
        )
        self._lock = _EngineLock()
        self.eos_ids = _eos_ids(model, tokenizer)
        if store is not None and kv_url is not None:
            raise ValueError("give either store or kv_url: kv_url adds a remote tier to the default store")
        self.store = store if store is not None else default_store(self.adapter.device, cache_dir, kv_url=kv_url)
        self.store_dtype = _store_dtype(store_dtype) or self.adapter.dtype
        self.fingerprint = model_fingerprint(
            model, tokenizer, encoding, self.store_dtype, {"family": self.adapter.family}
        )
        self.last_report: SchemaReport | None = None
        #: the document texts whose states this engine keeps or can encode: the Assembler finds
        #: them in prompts without marks (:mod:`pcache_rag.discovery`)
        self.known_texts = KnownTexts()
        self._context_memo: tuple[str, ModuleKV] | None = None
        self._cond_memo: tuple[str, ModuleKV] | None = None  # see conditioned_context
        if getattr(self.adapter, "rerotatable", False):
            # Start-up self-check of RoPE re-rotation on the live model (as LMCache does):
            # if moved keys do not match keys encoded in place, never move states.
            try:
                self.adapter.self_check()
            except RuntimeError as e:
                log.warning("%s; RAG will encode chunks per slot instead of re-rotating", e)
                self.adapter.rerotatable = False
        #: the output of the most recent generate()/stream() call (stream users read stats here)
        self.last_output: GenerationOutput | None = None
        #: units (modules, chunks, preambles) and tokens encoded by this engine so far
        self.encoded = {"units": 0, "tokens": 0}

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        **kwargs,
    ) -> "PromptCache":
        """Load a model and wrap it. With no name: the embedded SmolLM2-135M-Instruct.

        ``name_or_path`` may be a local Hugging Face model folder or a ``.gguf``
        file. Nothing is ever downloaded.
        """
        from .default_model import load_model

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
        t0 = time.perf_counter()
        layout = layout_schema(schema_pml, self.tokenizer, self.chat, self.max_positions)
        n_cond = self._check_schema_conditioning(layout)
        with self._lock:
            state = _SchemaState(layout)
            pre = layout.units.get(layout.preamble) if layout.preamble else None
            pre_key = None
            if pre is not None:
                pre_key = unit_key(self.fingerprint, pre.token_ids, pre.position_ids, None, pre.kind)
            unit_ctx = pre_key
            if n_cond and pre is not None:  # modules attend to the preamble and the neutral passages
                cond_ids = self.safe.text(neutral_text(n_cond))
                P = len(pre.token_ids)
                unit_ctx = unit_key(self.fingerprint, cond_ids, range(P, P + len(cond_ids)), pre_key,
                                    "pml-conditioning")
                state.conditioning = (pre_key, cond_ids, unit_ctx)
            units = list(layout.units.values())
            encoded = 0
            it = units
            if progress:
                from tqdm.auto import tqdm

                it = tqdm(units, desc=f"encoding {layout.name}", unit="module")
            for u in it:
                ctx = unit_ctx if (self.encoding == "preamble" and pre is not None and u is not pre) else None
                key = unit_key(self.fingerprint, u.token_ids, u.position_ids, ctx, u.kind)
                state.keys[u.name] = key
                state.context[u.name] = ctx
                if not self.store.contains(key):
                    self._encode_unit(state, u, key, ctx)
                    encoded += 1
            self._schemas[layout.name] = state
            self.workspace.invalidate()
            self.last_report = SchemaReport(
                layout.name, encoded, len(units) - encoded, sum(len(u.token_ids) for u in units),
                time.perf_counter() - t0,
            )
            return layout

    def _check_schema_conditioning(self, layout: SchemaLayout) -> int:
        """How many neutral passages the schema's modules are encoded after (0: the paper's
        semantics); refused by name where the states cannot be moved back or have no preamble."""
        n = parse_conditioning(layout.conditioning)
        if not n:
            return 0
        why = None
        if self.encoding != "preamble":
            why = "it extends the preamble context, so it needs encoding='preamble'"
        elif layout.preamble is None:
            why = "the schema has no preamble (text before its first module) to extend"
        elif not (getattr(self.adapter, "rerotatable", False) or self.adapter.family == "alibi"):
            why = f"it needs states that can move (RoPE or ALiBi); {self.model.config.model_type}'s cannot"
        if why:
            raise PMLError(f"schema {layout.name!r}: conditioning={layout.conditioning!r} cannot be used: {why}", 1, 1)
        return n

    def _encode_unit(self, state: _SchemaState, u: Unit, key: str, ctx: str | None) -> ModuleKV:
        layout = state.layout
        context = None
        if ctx is not None and state.conditioning is not None and ctx == state.conditioning[2]:
            kv = self._encode_conditioned(state, u)
        else:
            if ctx is not None:
                pre = layout.units[layout.preamble]
                context = self.context_states(ctx, pre.token_ids, pre.position_ids)
            kv = self.encode(u.token_ids, u.position_ids, context=context).to(dtype=self.store_dtype)
        self.store.put(key, kv)
        return kv

    def _encode_conditioned(self, state: _SchemaState, u: Unit) -> ModuleKV:
        """``u`` encoded after the preamble and the neutral passages, then moved back to its
        own positions (a schema with ``conditioning=``)."""
        pre_key, cond_ids, cond_key = state.conditioning
        pre = state.layout.units[state.layout.preamble]
        ctx = self.conditioned_context(pre_key, pre.token_ids, pre.position_ids, cond_key, cond_ids)
        shift = ctx.length - u.position_ids[0]  # the unit right after the passages, its gaps kept
        kv = self.encode(u.token_ids, [p + shift for p in u.position_ids], context=ctx)
        return self.adapter.move(kv, -shift).to(dtype=self.store_dtype)

    def stored_states(self, key: str, token_ids: list[int], position_ids: list[int]) -> ModuleKV:
        """The stored states under ``key``, encoding (and storing) them first if absent."""
        kv = self.store.get(key)
        if kv is None:
            kv = self.encode(token_ids, position_ids).to(dtype=self.store_dtype)
            self.store.put(key, kv)
        return kv

    def conditioned_context(self, base_key: str, base_ids: list[int], base_pos: list[int], cond_key: str,
                            cond_ids: list[int]) -> ModuleKV:
        """A preamble's states followed by conditioning passages' (which attend to it, at the
        positions after it), in the model's dtype: both stored, the last pair memoized, so a
        corpus or a schema encoded after the same context fetches and joins it once."""
        memo = self._cond_memo
        if memo is None or memo[0] != cond_key:
            base = self.context_states(base_key, base_ids, base_pos)
            P = int(base.position_ids[-1]) + 1
            cond = self.store.get(cond_key)
            if cond is None:
                cond = self.encode(cond_ids, list(range(P, P + len(cond_ids))), context=base)
                cond = cond.to(dtype=self.store_dtype)
                self.store.put(cond_key, cond)
            cond = cond.to(device=self.adapter.device, dtype=self.adapter.dtype)
            memo = self._cond_memo = (cond_key, ModuleKV.concat([base, cond]))
        return memo[1]

    def context_states(self, key: str, token_ids: list[int], position_ids: list[int]) -> ModuleKV:
        """A context (the preamble) in the model's dtype, for encoding units that attend to it.

        The last one is memoized: encoding a schema or ingesting a corpus attends to the same
        preamble for every unit, and it is fetched and converted once, not per unit.
        """
        memo = self._context_memo
        if memo is None or memo[0] != key:
            kv = self.stored_states(key, token_ids, position_ids)
            memo = self._context_memo = (key, kv.to(dtype=self.adapter.dtype, device=self.adapter.device))
        return memo[1]

    def _states(self, plan: PromptPlan, state: _SchemaState) -> list[ModuleKV]:
        """The imported units' states, re-encoding any the store lost (evicted or damaged)."""
        keys = [state.keys[u.name] for u in plan.units]
        kvs = self.store.get_many(keys)
        for i, kv in enumerate(kvs):
            if kv is None:
                u = plan.units[i]
                log.info("re-encoding %s: not in the store", u.name)
                kvs[i] = self._encode_unit(state, u, keys[i], state.context[u.name])
        return kvs

    def prefetch(self, prompt_pml: str, union_members: bool = False):
        """Start moving a prompt's module states to the fastest tier (returns a future, or None).

        With ``union_members`` the other members of each imported module's union come
        along: the likely next imports of a session (the paper's prefetch hint).
        """
        plan, state = self.plan(prompt_pml)
        names = [u.name for u in plan.units]
        if union_members:
            for u in plan.units:
                if u.union is not None:
                    names += [m for m in plan.layout.unions[u.union] if m not in names]
        fn = getattr(self.store, "prefetch", None)
        return fn([state.keys[n] for n in names]) if fn else None

    def schema(self, name: str) -> SchemaLayout:
        try:
            return self._schemas[name].layout
        except KeyError:
            raise PMLError(f"no schema named {name!r} was added; call add_schema first") from None

    def unit_key(self, schema: str, unit: str) -> str:
        """The store key of ``unit``'s states in the added ``schema`` (a module's name, or an
        anonymous unit's, such as the preamble ``"#0"``)."""
        self.schema(schema)
        try:
            return self._schemas[schema].keys[unit]
        except KeyError:
            raise PMLError(f"schema {schema!r} has no unit named {unit!r}") from None

    @torch.no_grad()
    def encode(
        self, token_ids: list[int], position_ids: list[int], context: ModuleKV | None = None
    ) -> ModuleKV:
        """Encode tokens at the given positions; with ``context``, they also attend to it.

        Returns the tokens' own states (not the context's).
        """
        dev = self.adapter.device
        ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(position_ids, dtype=torch.long, device=dev)
        T = ids.shape[0]
        self.encoded["units"] += 1
        self.encoded["tokens"] += T
        if context is None:
            cache = DynamicCache()
            self.adapter.forward(ids, pos, cache, None, None)
            keys = torch.stack([layer.keys[0] for layer in cache.layers])  # (L, H, T, D)
            values = torch.stack([layer.values[0] for layer in cache.layers])
        else:
            P = context.length
            # DynamicCache concatenates on update, so the context tensors are never written.
            cache = DynamicCache([(context.keys[i][None], context.values[i][None]) for i in range(context.keys.shape[0])])
            allowed = torch.ones(T, P + T, dtype=torch.bool, device=dev)
            allowed[:, P:] = torch.ones(T, T, dtype=torch.bool, device=dev).tril_()
            kpos = torch.cat([context.position_ids.to(dev), pos])
            self.adapter.forward(ids, pos, cache, allowed, kpos)
            keys = torch.stack([layer.keys[0, :, P:] for layer in cache.layers])
            values = torch.stack([layer.values[0, :, P:] for layer in cache.layers])
        return ModuleKV(keys.contiguous(), values.contiguous(), ids.cpu(), pos.cpu())

    # ------------------------------------------------------------------ prefill

    def plan(self, prompt_pml: str) -> tuple[PromptPlan, _SchemaState]:
        prompt = parse_prompt(prompt_pml)
        state = self._schemas.get(prompt.schema)
        if state is None:
            known = ", ".join(repr(n) for n in self._schemas) or "none"
            raise PMLError(
                f"unknown schema {prompt.schema!r} (added: {known}); call add_schema first",
                prompt.line,
                prompt.column,
            )
        plan = plan_prompt(prompt, state.layout, self.tokenizer, self.max_positions)
        if not plan.uncached_ids:
            raise PMLError(
                "the prompt adds no new text: add a question or a <user> turn after the imports",
                prompt.line,
                prompt.column,
            )
        return plan, state

    @torch.no_grad()
    def prefill(self, prompt_pml: str, reserve: int = 0, recompute: "str | Recompute | None" = None) -> PrefillResult:
        """Assemble the imported states and compute only the new tokens (plus the context
        tokens the ``recompute`` policy selects; default: the engine's).

        ``reserve`` leaves room in the workspace for that many generated tokens.
        """
        policy = self._policy(recompute)
        with self._lock:
            plan, state = self.plan(prompt_pml)
            return self._prefill(plan, self._states(plan, state), reserve, policy)

    def _policy(self, recompute) -> Recompute:
        return self.recompute if recompute is None else Recompute.parse(recompute)

    def _prefill(self, plan: PromptPlan, kvs: list[ModuleKV], reserve: int, policy: Recompute) -> PrefillResult:
        pre = plan.layout.preamble if self.encoding == "preamble" else None
        return self._prefill_parts(
            [u.name for u in plan.units], kvs, plan.args, plan.uncached_ids, plan.uncached_positions, pre, reserve,
            policy,
        )

    def _prefill_parts(
        self,
        labels: list[str],
        kvs: list[ModuleKV],
        args: list,
        uncached_ids: list[int],
        uncached_positions: list[int],
        preamble: str | None,
        reserve: int,
        policy: Recompute = Recompute(),
        calibration: Calibration | None = None,
    ) -> PrefillResult:
        """Assemble ``kvs`` (labelled), compute arguments and uncached tokens (and the context
        rows ``policy`` selects), return logits. ``calibration`` applies to the cached keys
        after the first unit (see the module docstring)."""
        dev = self.adapter.device
        t0 = time.perf_counter()
        n_args = sum(len(ids) for _, _, ids in args)
        q = n_args + len(uncached_ids)
        rows = self._select(kvs, policy, uncached_ids, uncached_positions)
        C, copied = self.workspace.assemble(kvs, extra=q + len(rows) + reserve)
        t1 = time.perf_counter()

        # Query tokens: arguments at their reserved positions, then the uncached text.
        q_ids: list[int] = []
        q_pos: list[int] = []
        spans: list[tuple[str, int, int]] = []
        offsets: dict[str, int] = {}
        lengths: dict[str, int] = {}
        off = 0
        for name, kv in zip(labels, kvs):
            offsets[name] = off
            lengths[name] = kv.length
            spans.append((name, off, off + kv.length))
            off += kv.length
        # (q, C+q): arguments attend to their module's tokens before the slot (and the
        # preamble), then themselves causally; uncached tokens attend to everything before them.
        plain = C == 0 and not args  # nothing cached: an ordinary causal prefill
        # every earlier key and the new tokens causally: the attention's split path, no mask
        split = not args and not rows and self.adapter.family != "alibi"
        span = self._calibrated_span(kvs, calibration, bool(args), policy if rows else None)
        allowed = None if plain or split else torch.zeros(q, C + q, dtype=torch.bool)
        row = 0
        for u, slot, ids in args:
            n, a = len(ids), C + row
            spans.append((f"{u.name}.{slot.name}", a, a + n))
            m0 = offsets[u.name]
            allowed[row : row + n, m0 : m0 + slot.offset] = True
            if preamble is not None and preamble in offsets:
                allowed[row : row + n, offsets[preamble] : offsets[preamble] + lengths[preamble]] = True
            allowed[row : row + n, a : a + n] = torch.ones(n, n, dtype=torch.bool).tril_()
            q_ids.extend(ids)
            q_pos.extend(range(slot.start, slot.start + n))
            row += n
        U = len(uncached_ids)
        spans.append(("uncached", C + row, C + row + U))
        if allowed is not None:
            allowed[row:, : C + row] = True
            allowed[row:, C + row :] = torch.ones(U, U, dtype=torch.bool).tril_()
            if policy.kind == "all" and rows:  # the anchor: one causal prefill of every token
                allowed[:, :C] = True
                allowed[:, C:] = torch.ones(q, q, dtype=torch.bool).tril_()
        q_ids.extend(uncached_ids)
        q_pos.extend(uncached_positions)

        new_ids = torch.tensor(q_ids, dtype=torch.long)
        new_pos = torch.tensor(q_pos, dtype=torch.long)
        cached_pos = [kv.position_ids for kv in kvs]
        ids_t, pos_t = new_ids, new_pos
        nS = len(rows)
        if nS:
            # Selected context rows join the query, before the new tokens (recompute.py).
            rows_t = torch.tensor(rows, dtype=torch.long)
            ids_t = torch.cat([torch.cat([kv.token_ids for kv in kvs])[rows_t], new_ids])
            pos_t = torch.cat([torch.cat(cached_pos)[rows_t], new_pos])
            allowed = recompute_mask(allowed, C, rows_t)
        if allowed is not None:
            allowed = allowed.to(dev)
        key_pos = None
        if self.adapter.family == "alibi" and not plain:
            key_pos = torch.cat(cached_pos + [pos_t]).to(dev)
        t2 = time.perf_counter()
        with calibrated(span) as counter:
            logits = self.adapter.forward(ids_t.to(dev), pos_t.to(dev), self.workspace.cache(), allowed, key_pos)[-1]
        if span is not None and counter.calls == 0:
            raise UnsupportedModelError(f"calibrated attention: {type(self.model).__name__} does not run its "
                                        "attention through pcache_sdpa")
        if nS:
            self.workspace.replace_rows(rows_t.to(dev), C, nS, q)
        t3 = time.perf_counter()
        input_ids = torch.cat([kv.token_ids for kv in kvs] + [new_ids])
        position_ids = torch.cat(cached_pos + [new_pos])
        return PrefillResult(
            logits=logits,
            input_ids=input_ids,
            position_ids=position_ids,
            spans=spans,
            cached_tokens=C - nS,
            computed_tokens=q + nS,
            copied_tokens=copied,
            assemble_s=t1 - t0,
            forward_s=t3 - t2,
            recomputed_tokens=nS,
            calibrated=span,
        )

    def _calibrated_span(self, kvs: list[ModuleKV], calibration: Calibration | None, args: bool,
                         recompute: Recompute | None) -> CalibratedSpan | None:
        """The keys ``calibration`` applies to: every cached key after the first unit (the
        shared preamble); ``None`` without a calibration or with fewer than two units.
        Refused by name where the split path cannot run."""
        if calibration is None or len(kvs) < 2:
            return None
        if self.adapter.family == "alibi":
            raise UnsupportedModelError("calibrated attention runs through pcache_sdpa's split path; ALiBi models "
                                        "attend with their own bias")
        if args or recompute is not None:
            what = "PML parameters" if args else f"recompute {recompute}"
            raise ValueError(f"calibrated attention ({calibration.spec}) does not combine with {what}: choose one")
        P = kvs[0].length
        return CalibratedSpan(P, sum(kv.length for kv in kvs), calibration)

    def _select(self, kvs: list[ModuleKV], policy: Recompute, new_ids=(), new_pos=()) -> list[int]:
        """Cache rows to recompute under ``policy`` (only when several units are assembled);
        ``focus`` ranks them by the attention of ``new_ids`` at ``new_pos`` (the question)."""
        lengths = [kv.length for kv in kvs]
        if policy.kind == "rows":  # checked even for one unit: explicit rows are never dropped in silence
            C = sum(lengths)
            bad = [r for r in policy.rows if not (lengths[0] if lengths else 0) <= r < C]
            if bad:
                raise ValueError(f"recompute rows {bad[:5]} are outside the rows after the first unit "
                                 f"({lengths[0] if lengths else 0}..{C - 1}) of this prompt")
            return list(policy.rows)
        if policy.kind == "none" or len(kvs) < 2:
            return []
        if policy.kind == "all":
            return list(range(sum(lengths)))
        if policy.kind == "epic":
            return epic_rows(lengths, policy.k)
        if policy.kind == "focus":
            return blend_rows(focus_scores(self._question_attention(kvs, list(new_ids), list(new_pos))),
                              lengths, policy.ratio)
        # blend: score every context token by its key deviation at the check layer
        dev = self.adapter.device
        ids = torch.cat([kv.token_ids for kv in kvs]).to(dev)
        pos = torch.cat([kv.position_ids for kv in kvs]).to(dev)
        fresh = first_layers_keys(self.adapter, ids, pos, policy.check_layer)  # (H, C, D)
        cached = torch.cat([kv.layer_keys(policy.check_layer, dev, fresh.dtype) for kv in kvs], dim=1)
        scores = (fresh - cached).pow(2).sum(dim=(0, 2))  # (C,)
        return blend_rows(scores, lengths, policy.ratio)

    def _question_attention(self, kvs: list[ModuleKV], new_ids: list[int], new_pos: list[int]) -> torch.Tensor:
        """Attention (C,) that ``new_ids`` give each assembled row, summed over layers and heads:
        one forward of the new tokens over the cached states, whose rows are then dropped."""
        from .models import attention

        if self.adapter.family == "alibi":
            raise UnsupportedModelError("recompute 'focus' reads attention through pcache_sdpa; ALiBi models "
                                        "do not use it: choose 'epic' or 'blend'")
        if not new_ids:
            raise ValueError("recompute 'focus' ranks context by the new tokens' attention; this prompt has none")
        dev = self.adapter.device
        C, _ = self.workspace.assemble(kvs, extra=len(new_ids))
        U = len(new_ids)
        allowed = torch.ones(U, C + U, dtype=torch.bool)
        allowed[:, C:] = torch.ones(U, U, dtype=torch.bool).tril_()
        try:
            with attention.AttentionProbe(C) as probe:
                self.adapter.forward(torch.tensor(new_ids, device=dev), torch.tensor(new_pos, device=dev),
                                     self.workspace.cache(), allowed.to(dev), None)
        finally:
            for layer in self.workspace.layers:
                layer.set_length(C)
        if probe.calls == 0 or probe.scores is None:
            raise UnsupportedModelError(f"recompute 'focus': {type(self.model).__name__} does not run its "
                                        "attention through pcache_sdpa; choose 'epic' or 'blend'")
        return probe.scores

    # ------------------------------------------------------------------ parts (RAG)

    def place(self, kv: ModuleKV, start: int) -> ModuleKV:
        """The states of ``kv`` moved so its first token sits at position ``start``.

        RoPE keys are re-rotated (exact up to rounding); ALiBi states carry no
        position and are reused as they are; learned-position models cannot
        move states (encode at the target positions instead).
        """
        delta = start - int(kv.position_ids[0])
        if delta == 0:
            return kv
        return self.adapter.move(kv, delta)

    @torch.no_grad()
    def prefill_parts(
        self, parts: list[tuple[str, ModuleKV]], new_ids: list[int], preamble: str | None = None, reserve: int = 0,
        recompute: "str | Recompute | None" = None, calibration: "str | Calibration | None" = None,
    ) -> PrefillResult:
        """Prefill cached ``parts`` (label, states already at their positions) plus ``new_ids``,
        which are placed right after the last part's position. ``calibration`` (``"ape:T:S"``)
        calibrates attention to every part after the first (see the module docstring)."""
        policy = self._policy(recompute)
        with self._lock, torch.no_grad():
            return self._prefill_new(parts, new_ids, preamble, reserve, policy, Calibration.parse(calibration))

    def _prefill_new(self, parts, new_ids, preamble, reserve, policy: Recompute = Recompute(),
                     calibration: Calibration | None = None):
        if not new_ids:
            raise ValueError("there must be at least one new token to compute")
        start = max((int(kv.position_ids[-1]) + 1 for _, kv in parts), default=0)
        pos = list(range(start, start + len(new_ids)))
        if pos[-1] >= self.max_positions:
            raise ContextOverflowError(f"the prompt needs {pos[-1] + 1} positions; the model takes {self.max_positions}")
        pre = preamble if self.encoding == "preamble" else None
        return self._prefill_parts(
            [p[0] for p in parts], [p[1] for p in parts], [], list(new_ids), pos, pre, reserve, policy, calibration
        )

    def generate_parts(self, parts, new_ids, preamble=None, recompute=None, calibration=None,
                       **gen) -> GenerationOutput:
        """:meth:`generate` for cached parts plus new token ids (see :meth:`prefill_parts`)."""
        gen = _gen_kwargs(gen)
        policy, cal = self._policy(recompute), Calibration.parse(calibration)
        return _final(self._generation(lambda r: self._prefill_new(parts, new_ids, preamble, r, policy, cal), **gen))

    def stream_parts(self, parts, new_ids, preamble=None, recompute=None, calibration=None,
                     **gen) -> Iterator[str]:
        """:meth:`stream` for cached parts plus new token ids."""
        gen = _gen_kwargs(gen)
        policy, cal = self._policy(recompute), Calibration.parse(calibration)
        return _deltas(self._generation(lambda r: self._prefill_new(parts, new_ids, preamble, r, policy, cal), **gen))

    @torch.no_grad()
    def generate_parts_batch(self, requests, max_new_tokens: int = 64, stop=None) -> list[GenerationOutput]:
        """Greedy answers to several :meth:`generate_parts` requests, decoded together.

        ``requests``: ``(parts, new_ids, preamble, recompute[, calibration])`` tuples. Each prompt is prefilled
        on its own, exactly as :meth:`generate_parts` does (its ``ttft_s`` is timed the same way:
        from the start of its prefill to its first token). Then prompts of equal length decode
        together, one forward per step for the group, which reads the weights once instead of
        once per prompt: on a CPU, where decoding is bound by memory bandwidth, that is most of
        its cost. Batched matrix products round differently from single ones, so a rare greedy
        near-tie may resolve differently than in :meth:`generate_parts`. Each output's
        ``total_s`` counts the shared decode. ALiBi models decode one prompt at a time.
        """
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        reqs = [tuple(r) + (None,) * (5 - len(r)) for r in requests]
        if self.adapter.family == "alibi":  # its bias needs key positions and a mask per step
            return [self.generate_parts(p, ids, pre, rc, cal, max_new_tokens=max_new_tokens, stop=stop)
                    for p, ids, pre, rc, cal in reqs]
        stops = [s for s in (stop or []) if s]
        firsts: list[dict] = []
        with self._lock:
            for parts, new_ids, preamble, rc, cal in reqs:
                t0 = time.perf_counter()
                res = self._prefill_new(parts, new_ids, preamble, max_new_tokens, self._policy(rc),
                                        Calibration.parse(cal))
                tok = int(torch.argmax(res.logits))
                ttft = time.perf_counter() - t0
                T = self.workspace.layers[0].length
                firsts.append({"res": res, "tok": tok, "ttft": ttft, "t0": t0, "T": T,
                               "next_pos": int(res.position_ids.max()) + 1,
                               "k": self.workspace.k[:, 0, :, :T].clone(),  # (L, H, T, D)
                               "v": self.workspace.v[:, 0, :, :T].clone()})
            # The workspace no longer holds what it says it holds.
            self.workspace.invalidate()
            groups: dict[tuple, list[int]] = {}
            for i, f in enumerate(firsts):  # one batch per length, next position and calibrated span
                groups.setdefault((f["T"], f["next_pos"], f["res"].calibrated), []).append(i)
            outs: list[GenerationOutput | None] = [None] * len(firsts)
            for (T, next_pos, span), idx in groups.items():
                with calibrated(span):
                    decoded = self._decode_group([firsts[i] for i in idx], T, next_pos, max_new_tokens, stops)
                for i, out in zip(idx, decoded):
                    outs[i] = out
        return outs  # type: ignore[return-value]

    def _decode_group(self, firsts: list[dict], T: int, next_pos: int, max_new_tokens: int, stops):
        """Greedy decoding of ``B`` prefilled prompts of length ``T`` in one batch."""
        dev = self.adapter.device
        B = len(firsts)
        L, H, _, D = firsts[0]["k"].shape
        Dv = firsts[0]["v"].shape[-1]
        kb = torch.empty((L, B, H, T + max_new_tokens, D), dtype=self.adapter.dtype, device=dev)
        vb = torch.empty((L, B, H, T + max_new_tokens, Dv), dtype=self.adapter.dtype, device=dev)
        for b, f in enumerate(firsts):
            kb[:, b, :, :T] = f.pop("k")
            vb[:, b, :, :T] = f.pop("v")
        layers = [BufferLayer(kb[i], vb[i]) for i in range(L)]  # (B, H, capacity, D) each
        for layer in layers:
            layer.set_length(T)
        cache = Cache(layers=layers)
        tokens: list[list[int]] = [[] for _ in range(B)]
        texts: list[str | None] = [None] * B  # set when a sequence stops on a stop string
        finish = ["length"] * B
        live = [True] * B
        last = [f["tok"] for f in firsts]
        for step in range(max_new_tokens):
            for b in range(B):
                if not live[b]:
                    continue
                if last[b] in self.eos_ids:
                    finish[b], live[b] = "eos", False
                    continue
                tokens[b].append(last[b])
                if stops:
                    text = self.tokenizer.decode(tokens[b], skip_special_tokens=True)
                    cut = _first_stop(text, stops)
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
            res = f["res"]
            text = texts[b] if texts[b] is not None else self.tokenizer.decode(tokens[b], skip_special_tokens=True)
            outs.append(GenerationOutput(
                text=text, token_ids=tokens[b], ttft_s=f["ttft"], cached_tokens=res.cached_tokens,
                computed_tokens=res.computed_tokens, total_s=end - f["t0"], finish_reason=finish[b],
                recomputed_tokens=res.recomputed_tokens,
            ))
        return outs

    def text_ids(self, text: str) -> list[int]:
        """BOS (if the tokenizer adds one) plus ``text`` tokenized as text: control-token strings
        in it stay characters (:mod:`pcache_rag.tokens`)."""
        return bos_ids(self.tokenizer) + self.safe.text(text)

    def generate_text(self, text: str, **gen) -> GenerationOutput:
        """Generate from plain text with nothing cached (an ordinary LLM call). The text is never
        read as chat markup; use a PML prompt with role tags for a chat turn."""
        return self.generate_parts([], self.text_ids(text), **gen)

    def stream_text(self, text: str, **gen) -> Iterator[str]:
        return self.stream_parts([], self.text_ids(text), **gen)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompt_pml: str,
        max_new_tokens: int = 64,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[str] | tuple[str, ...] | None = None,
        recompute: "str | Recompute | None" = None,
    ) -> GenerationOutput:
        """Answer a prompt: prefill from the cache, then decode.

        Greedy by default; ``do_sample=True`` samples with ``temperature`` and
        ``top_p`` (``seed`` makes it repeatable). Stops at EOS, at any string in
        ``stop`` (excluded from the text) or after ``max_new_tokens``.
        ``recompute`` overrides the engine's policy for this call.
        """
        return _final(self._generation(self._prompt_prefill(prompt_pml, recompute), max_new_tokens, do_sample,
                                       temperature, top_p, seed, stop))

    def stream(self, prompt_pml: str, recompute=None, **kwargs) -> Iterator[str]:
        """Yield text deltas as they are decoded (same arguments as :meth:`generate`)."""
        return _deltas(self._generation(self._prompt_prefill(prompt_pml, recompute), **_gen_kwargs(kwargs)))

    def _prompt_prefill(self, prompt_pml: str, recompute=None):
        policy = self._policy(recompute)

        def prepare(reserve: int) -> PrefillResult:
            plan, state = self.plan(prompt_pml)
            return self._prefill(plan, self._states(plan, state), reserve, policy)

        return prepare

    def _generation(self, prepare, max_new_tokens: int = 64, do_sample: bool = False, temperature: float = 1.0,
                    top_p: float = 1.0, seed: int | None = None, stop=None):
        """Prefill with ``prepare(reserve)`` and decode; yields text deltas, then the output.
        TTFT counts from here, so planning and fetching states are included."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        t0 = time.perf_counter()
        with self._lock, torch.no_grad():
            res = prepare(max_new_tokens)
            yield from self._decode(res, t0, max_new_tokens, do_sample, temperature, top_p, seed, stop)

    @torch.no_grad()
    def _decode(self, res: PrefillResult, t0, max_new_tokens, do_sample, temperature, top_p, seed, stop):
        """Sample from ``res.logits`` and continue in the workspace; yields deltas, then the output."""
        dev = self.adapter.device
        gen = None
        if do_sample:
            gen = torch.Generator(device="cpu").manual_seed(seed if seed is not None else random.randrange(1 << 62))
        stops = [s for s in (stop or []) if s]
        key_pos = res.position_ids.to(dev) if self.adapter.family == "alibi" else None
        next_pos = int(res.position_ids.max()) + 1
        tokens: list[int] = []
        emitted = ""
        finish = "length"
        ttft = None
        logits = res.logits
        cache = self.workspace.cache()
        for step in range(max_new_tokens):
            tok = _sample(logits, do_sample, temperature, top_p, gen)
            if ttft is None:
                ttft = time.perf_counter() - t0
            if tok in self.eos_ids:
                finish = "eos"
                break
            tokens.append(tok)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            cut = _first_stop(text, stops)
            if cut >= 0:
                if cut > len(emitted):
                    yield text[len(emitted) : cut]
                emitted = text[:cut]
                finish = "stop"
                break
            # Hold back a partial character and any tail that may begin a stop string.
            safe = len(text) - (1 if text.endswith("\ufffd") else 0)
            for s in stops:
                for k in range(min(len(s) - 1, safe), 0, -1):
                    if text[:safe].endswith(s[:k]):
                        safe -= k
                        break
            if safe > len(emitted):
                yield text[len(emitted) : safe]
                emitted = text[:safe]
            if step == max_new_tokens - 1:
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
        if finish != "stop":
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if len(text) > len(emitted):
                yield text[len(emitted) :]
            emitted = text
        self.last_output = GenerationOutput(
            text=emitted,
            token_ids=tokens,
            ttft_s=ttft if ttft is not None else time.perf_counter() - t0,
            cached_tokens=res.cached_tokens,
            computed_tokens=res.computed_tokens,
            total_s=time.perf_counter() - t0,
            finish_reason=finish,
            recomputed_tokens=res.recomputed_tokens,
        )
        yield self.last_output

    # ------------------------------------------------------------------ baselines

    @torch.no_grad()
    def full_prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                     last: int = 1) -> torch.Tensor:
        """The baseline: one causal forward over all tokens, nothing reused. Returns the last
        logits (vocab,), or those of the ``last`` positions (last, vocab) when ``last > 1``."""
        dev = self.adapter.device
        ids = input_ids.to(dev)
        pos = position_ids.to(dev) if position_ids is not None else torch.arange(ids.shape[0], device=dev)
        out = self.adapter.forward(ids, pos, DynamicCache(), None, None, logits_to_keep=last)
        return out[-1] if last == 1 else out[-last:]

    def stats(self) -> dict:
        """Store statistics per tier (hits, misses, bytes, evictions, load time), schemas, and
        what this engine encoded (units and tokens)."""
        tiers = getattr(self.store, "tier_stats", None)
        return {
            "tiers": {k: vars_of(v) for k, v in tiers().items()} if tiers else {"store": vars_of(self.store.stats())},
            "schemas": {n: len(st.keys) for n, st in self._schemas.items()},
            "workspace_bytes": self.workspace.nbytes(),
            "encoded": dict(self.encoded),
        }


def vars_of(obj) -> dict:
    return {k: getattr(obj, k) for k in obj.__slots__} if hasattr(obj, "__slots__") else dict(vars(obj))


def _final(items) -> GenerationOutput:
    out = None
    for item in items:
        if isinstance(item, GenerationOutput):
            out = item
    assert out is not None, "the generation loop always ends with its output"
    return out


def _deltas(items) -> Iterator[str]:
    for item in items:
        if isinstance(item, str):
            yield item


_STORE_DTYPES = {"int8": torch.int8, "float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def _store_dtype(d) -> torch.dtype | None:
    """``None``, a torch dtype or its name, checked against the dtypes states can be stored in."""
    got = d if d is None or isinstance(d, torch.dtype) else _STORE_DTYPES.get(str(d).lower())
    if got is None and d is not None or got is not None and got not in _STORE_DTYPES.values():
        raise ValueError(f"store_dtype must be one of {sorted(set(_STORE_DTYPES))}, not {d!r}")
    return got


def _gen_kwargs(kw: dict) -> dict:
    allowed = {"max_new_tokens", "do_sample", "temperature", "top_p", "seed", "stop"}
    bad = set(kw) - allowed
    if bad:
        raise TypeError(f"unexpected arguments: {', '.join(sorted(bad))}")
    return kw


def _first_stop(text: str, stops: list[str]) -> int:
    """Where the first of ``stops`` begins in ``text``, or -1."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        v = getattr(src, "eos_token_id", None)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


def _sample(logits: torch.Tensor, do_sample: bool, temperature: float, top_p: float, gen) -> int:
    if not do_sample or temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < top_p  # always keeps the top token
        sp = sp * keep
        return int(si[torch.multinomial(sp / sp.sum(), 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))
