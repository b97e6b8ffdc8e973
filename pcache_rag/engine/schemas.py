"""The schema registry: PML schemas laid out, their units encoded and keyed, prompts planned.

A :class:`SchemaRegistry` owns every added schema's layout and the store key of each of its
units (what the unit's states depend on: the model, its tokens and positions, and the
context it was encoded after). It encodes the units a store lacks, plans prompts against
the schemas and names the states a prompt needs (re-encoding any the store lost).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ..conditioning import conditioning_refusal, installed_prefix, neutral_text, parse_conditioning
from ..kv import ModuleKV
from ..pml import PMLError, SchemaLayout, layout_schema, parse_prompt, plan_prompt
from ..pml.layout import PromptPlan, Unit
from ..store import KVStore, unit_key
from .encoder import Encoder
from .types import Encoding, SchemaReport

log = logging.getLogger(__name__)

#: ``_conditioning``'s answer for ``<schema conditioning="learned">``: the model's installed prefix
LEARNED = -1


@dataclass(slots=True)
class SchemaState:
    """One added schema: its layout and where its units' states live."""

    layout: SchemaLayout
    keys: dict[str, str] = field(default_factory=dict)  # unit name -> store key
    context: dict[str, str | None] = field(default_factory=dict)  # unit name -> key of what it attended to
    # (preamble key, passage ids, context key, a learned prefix's embeddings (m, hidden) or None)
    conditioning: tuple[str | None, list[int], str, torch.Tensor | None] | None = None


class SchemaRegistry:
    """Added schemas by name. Not locked: :class:`~pcache_rag.engine.PromptCache` calls it
    under its own lock."""

    def __init__(self, tokenizer, chat, max_positions: int, fingerprint: str, encoding: Encoding,
                 encoder: Encoder, store: KVStore, movable: bool, model_type: str) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.max_positions = max_positions
        self.fingerprint = fingerprint
        self.encoding = encoding
        self.encoder = encoder
        self.store = store
        self.movable = movable  # states can move to other positions (RoPE re-rotation, ALiBi)
        self.model_type = model_type
        self._states: dict[str, SchemaState] = {}

    def layout(self, schema_pml: str) -> tuple[SchemaLayout, int]:
        """Parse and lay out a schema, and check its conditioning (how many neutral passages)."""
        layout = layout_schema(schema_pml, self.tokenizer, self.chat, self.max_positions)
        return layout, self._conditioning(layout)

    def add(self, layout: SchemaLayout, n_cond: int, safe_text, progress: bool = False) -> SchemaReport:
        """Key every unit of ``layout`` and encode those the store lacks; replaces a schema of
        the same name. ``safe_text`` tokenizes the conditioning passages."""
        t0 = time.perf_counter()
        state = SchemaState(layout)
        pre = layout.units.get(layout.preamble) if layout.preamble else None
        pre_key = None
        if pre is not None:
            pre_key = unit_key(self.fingerprint, pre.token_ids, pre.position_ids, None, pre.kind)
        unit_ctx = pre_key
        if n_cond and pre is not None:  # modules attend to the preamble and the conditioning after it
            embeds, kind = None, "pml-conditioning"
            if n_cond == LEARNED:  # the prefix's embeddings stand in for tokens (placeholders, never read)
                prefix = installed_prefix(self.fingerprint)
                assert prefix is not None  # _conditioning refused the schema otherwise
                cond_ids, embeds, kind = [0] * prefix.length, prefix.embeds, kind + "|" + prefix.spec
            else:
                cond_ids = safe_text(neutral_text(n_cond))
            P = len(pre.token_ids)
            unit_ctx = unit_key(self.fingerprint, cond_ids, range(P, P + len(cond_ids)), pre_key, kind)
            state.conditioning = (pre_key, cond_ids, unit_ctx, embeds)
        units = list(layout.units.values())
        it = units
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(units, desc=f"encoding {layout.name}", unit="module")
        encoded = 0
        for u in it:
            ctx = unit_ctx if (self.encoding == "preamble" and pre is not None and u is not pre) else None
            key = unit_key(self.fingerprint, u.token_ids, u.position_ids, ctx, u.kind)
            state.keys[u.name] = key
            state.context[u.name] = ctx
            if not self.store.contains(key):
                self._encode_unit(state, u, key, ctx)
                encoded += 1
        self._states[layout.name] = state
        return SchemaReport(layout.name, encoded, len(units) - encoded, sum(len(u.token_ids) for u in units),
                            time.perf_counter() - t0)

    def _conditioning(self, layout: SchemaLayout) -> int:
        """How many neutral passages the schema's modules are encoded after (0: the paper's
        semantics; :data:`LEARNED`: the learned prefix installed for this model); refused by name
        where the states cannot be moved back or have no preamble, or no prefix is installed."""
        learned = layout.conditioning == "learned"
        n = LEARNED if learned else parse_conditioning(layout.conditioning)
        if not n:
            return 0
        adapter = self.encoder.adapter
        why = conditioning_refusal("learned" if learned else "neutral", self.encoding, self.movable, adapter.family,
                                   adapter.constrained, self.model_type)
        if not why and layout.preamble is None:
            why = "the schema has no preamble (text before its first module) to extend"
        elif not why and learned and installed_prefix(self.fingerprint) is None:
            why = (f"no learned prefix is installed for this model ({self.model_type}): install one with "
                   "`pcache-rag install-prefix`, use conditioning='neutral', or a CachedRAG index moved to its own "
                   "prefix (`pcache-rag calibrate --learn`)")
        if why:
            raise PMLError(f"schema {layout.name!r}: conditioning={layout.conditioning!r} cannot be used: {why}", 1, 1)
        return n

    def _encode_unit(self, state: SchemaState, u: Unit, key: str, ctx: str | None) -> ModuleKV:
        layout, enc = state.layout, self.encoder
        cond = state.conditioning
        if ctx is not None and cond is not None and ctx == cond[2]:
            assert layout.preamble is not None and cond[0] is not None
            pre = layout.units[layout.preamble]
            context = enc.conditioned_context(cond[0], pre.token_ids, pre.position_ids, cond[2], cond[1], cond[3])
            kv = enc.encode_moved(u.token_ids, u.position_ids, context)
        else:
            context = None
            if ctx is not None:
                assert layout.preamble is not None
                pre = layout.units[layout.preamble]
                context = enc.context_states(ctx, pre.token_ids, pre.position_ids)
            kv = enc.encode_stored(u.token_ids, u.position_ids, context)
        self.store.put(key, kv)
        return kv

    # ------------------------------------------------------------------ lookups

    def names(self) -> list[str]:
        return list(self._states)

    def state(self, name: str) -> SchemaState:
        try:
            return self._states[name]
        except KeyError:
            raise PMLError(f"no schema named {name!r} was added; call add_schema first") from None

    def unit_keys(self, schema: str) -> dict[str, str]:
        """Unit name -> store key, for every unit of ``schema``."""
        return dict(self.state(schema).keys)

    def unit_key(self, schema: str, unit: str) -> str:
        try:
            return self.state(schema).keys[unit]
        except KeyError:
            raise PMLError(f"schema {schema!r} has no unit named {unit!r}") from None

    def sizes(self) -> dict[str, int]:
        return {n: len(st.keys) for n, st in self._states.items()}

    # ------------------------------------------------------------------ prompts

    def plan(self, prompt_pml: str) -> tuple[PromptPlan, SchemaState]:
        """Parse a prompt and check it against its schema."""
        prompt = parse_prompt(prompt_pml)
        state = self._states.get(prompt.schema)
        if state is None:
            known = ", ".join(repr(n) for n in self._states) or "none"
            raise PMLError(f"unknown schema {prompt.schema!r} (added: {known}); call add_schema first",
                           prompt.line, prompt.column)
        plan = plan_prompt(prompt, state.layout, self.tokenizer, self.max_positions)
        if not plan.uncached_ids:
            raise PMLError("the prompt adds no new text: add a question or a <user> turn after the imports",
                           prompt.line, prompt.column)
        return plan, state

    def rows(self, prompt_pml: str) -> int:
        """The tokens a prompt's cache holds after its prefill: its units, arguments and new
        tokens (raises :class:`PMLError` as :meth:`plan` does)."""
        plan, _ = self.plan(prompt_pml)
        return (sum(len(u.token_ids) for u in plan.units) + sum(len(ids) for *_, ids in plan.args)
                + len(plan.uncached_ids))

    def states(self, plan: PromptPlan, state: SchemaState) -> list[ModuleKV]:
        """The imported units' states, re-encoding any the store lost (evicted or damaged)."""
        keys = [state.keys[u.name] for u in plan.units]
        kvs = self.store.get_many(keys)
        out: list[ModuleKV] = []
        for i, kv in enumerate(kvs):
            if kv is None:
                u = plan.units[i]
                log.info("re-encoding %s: not in the store", u.name)
                kv = self._encode_unit(state, u, keys[i], state.context[u.name])
            out.append(kv)
        return out

    def prefetch_keys(self, prompt_pml: str, union_members: bool = False) -> list[str]:
        """The store keys a prompt imports; with ``union_members`` also the other members of
        each imported module's union (the paper's prefetch hint)."""
        plan, state = self.plan(prompt_pml)
        names = [u.name for u in plan.units]
        if union_members:
            for u in plan.units:
                if u.union is not None:
                    names += [m for m in plan.layout.unions[u.union] if m not in names]
        return [state.keys[n] for n in names]
