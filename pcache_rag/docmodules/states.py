"""Documents as cached modules: content-addressed states on one engine.

:class:`DocumentStates` turns a document's text into token ids (its text without surrounding
whitespace, then one blank line), a store key (model, conditioning, tokens, positions), and
states encoded once at the canonical position right after the encoding preamble, then moved
wherever a prompt puts them. The conditioning rules of documents live here (which conditioning
applies by default, and whether a learned prefix fits the engine), on the engine's own rule
(:func:`pcache_rag.conditioning.conditioning_refusal`).

**Conditioned encoding** (``conditioning="neutral"`` or ``"neutral:N"``, N up to 4): each
document is encoded after the preamble *and* fixed neutral passages
(``pcache_rag/data/neutral*.txt``; or a passage of the caller's, ``conditioning_text``),
which are never part of an assembled prompt, then
moved back to the canonical position. A document encoded alone after the preamble reads
as if it were the first and only thing said; in a prompt it never is, and its states
then pull the question towards it. The conditioning is part of every key, so states
encoded under different conditioning never mix. It needs states that can move (RoPE or
ALiBi), costs encode time at ingest, and nothing at query time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from ..conditioning import (LearnedPrefix, conditioning_kind, installed_prefix, neutral_text, parse_conditioning,
                            passage_spec)
from ..engine import PromptCache
from ..kv import ModuleKV
from ..pml import bos_ids
from ..store import unit_key
from .marks import DEFAULT_CONDITIONING, DEFAULT_SYSTEM, DOC_SEPARATOR, DOCUMENTS_HEADER, MIN_CONDITIONED_TOKENS, unmark

log = logging.getLogger(__name__)

def default_conditioning(pc: PromptCache) -> str:
    """:data:`DEFAULT_CONDITIONING` where ``pc`` can use it (``encoding="preamble"`` and states
    that move), else ``"none"`` (logged: a default that does not apply, not an error)."""
    if not parse_conditioning(DEFAULT_CONDITIONING):
        return "none"
    if why := pc.conditioning_refusal("neutral"):
        log.info("documents are encoded without conditioning: %s", why)
        return "none"
    return DEFAULT_CONDITIONING


def takes_prefix(pc: PromptCache) -> bool:
    """Whether ``pc`` can encode documents after a learned prefix: ``encoding="preamble"``, RoPE,
    no sliding window or soft-cap (ALiBi's and learned positions' adapters feed token ids only)."""
    return not pc.conditioning_refusal("learned")


def default_prefix(pc: PromptCache) -> LearnedPrefix | None:
    """The learned prefix installed for ``pc``'s model (:func:`~pcache_rag.conditioning.installed_prefix`),
    where this engine can encode after one (``encoding="preamble"``, RoPE, no sliding window or
    soft-cap); else None, and the default is the neutral passage (:func:`default_conditioning`)."""
    if not takes_prefix(pc):
        return None
    prefix = installed_prefix(pc.fingerprint)
    if prefix is not None:
        log.info("documents are encoded after the learned prefix installed for this model (%s)", prefix.spec)
    return prefix


def check_prefix(pc: PromptCache, prefix: LearnedPrefix) -> None:
    """Refuse, by name, a learned prefix this engine cannot encode after: trained for another
    model, of another width, or on a model whose states cannot take it (ALiBi's adapter feeds
    token ids only)."""
    model: Any = pc.model  # a transformers model (typed as a plain Module)
    hidden = model.get_input_embeddings().weight.shape[1]
    if prefix.fingerprint and prefix.fingerprint != pc.fingerprint:
        raise ValueError(f"the learned conditioning prefix {prefix.spec} was trained for another model "
                         f"({prefix.meta.get('model', prefix.fingerprint[:12])}); learn one for this model with "
                         "`pcache-rag calibrate --learn`")
    if prefix.embeds.shape[1] != hidden:
        raise ValueError(f"the learned conditioning prefix is {prefix.embeds.shape[1]} wide, the model's embeddings "
                         f"{hidden}")
    if why := pc.conditioning_refusal("learned"):
        raise ValueError(f"a learned conditioning prefix cannot be used: {why}")



class DocumentStates:
    """Content-addressed document states on one :class:`PromptCache` (see the module docstring).

    ``system_prompt`` is the preamble documents are encoded against (``encoding="preamble"``);
    :class:`pcache_rag.rag.CachedRAG` uses the same one, so both share states.
    ``conditioning`` adds neutral passages to that context (see the module docstring):
    ``"default"`` is the learned prefix installed for the model where there is one
    (:func:`default_prefix`), else :func:`default_conditioning`; ``None`` or ``"none"`` is the
    paper's semantics.
    ``conditioning_text`` conditions on that passage instead of the neutral ones (a passage
    drawn from the corpus, say); :attr:`conditioning` is then ``"passage:<hash of it>"``.
    ``prefix`` conditions on a learned prefix (:class:`~pcache_rag.conditioning.LearnedPrefix`,
    made by ``pcache-rag calibrate --learn``); :attr:`conditioning` is then its ``"learned:<hash>"``.
    """

    def __init__(self, pc: PromptCache, system_prompt: str = DEFAULT_SYSTEM, conditioning: str | None = "default",
                 conditioning_text: str | None = None, prefix: LearnedPrefix | None = None):
        self.pc = pc
        # the engine's parts this class reads, handed over once: nothing here reaches through the engine
        self.store, self.known_texts, self.encoder = pc.store, pc.known_texts, pc.encoder
        #: what prompts taught, per tenant (:mod:`pcache_rag.store.learned`); the shared ``store`` holds only
        #: what was ingested or encoded on purpose (:meth:`ensure`)
        self.learned = pc.learned
        self.safe, self.tokenizer, self.chat = pc.safe, pc.tokenizer, pc.chat
        self.fingerprint, self.encoding, self.max_positions = pc.fingerprint, pc.encoding, pc.max_positions
        self.store_dtype = pc.store_dtype
        if conditioning == "default":  # the model's installed learned prefix, else the neutral passage
            if prefix is None and conditioning_text is None:
                prefix = default_prefix(pc)
            conditioning = None if prefix is not None else default_conditioning(pc)
        self.system_prompt = system_prompt
        self.base_ids = preamble_ids(pc, system_prompt)
        self.base_key = unit_key(pc.fingerprint, self.base_ids, range(len(self.base_ids)), None, "rag-preamble")
        #: a learned conditioning prefix (its embeddings take the passage's place), or None
        self.prefix = prefix
        if prefix is not None:
            if conditioning_text is not None:
                raise ValueError("give a learned prefix or a conditioning_text, not both")
            check_prefix(pc, prefix)
            n = -1
            self.conditioning = prefix.spec
        elif conditioning_text is not None:
            if not conditioning_text.strip():
                raise ValueError("conditioning_text is empty: give a passage, or conditioning='none'")
            n = -1  # the caller's passage, not the neutral ones
            self.conditioning = passage_spec(conditioning_text)
        else:
            if conditioning_kind(conditioning) == "learned":
                raise ValueError(f"conditioning={conditioning!r} needs its prefix: Assembler(prefix=LearnedPrefix.load(...))"
                                 " (an index loads its own)")
            n = parse_conditioning(conditioning)
            self.conditioning = f"neutral:{n}" if n else "none"
        #: the context a document is encoded after: the preamble, then the conditioning passages
        self.ctx_key = self.base_key
        #: the conditioning's token ids (a learned prefix: placeholders, one per embedding)
        self.cond_ids: list[int] = []
        if n:
            if why := pc.conditioning_refusal("learned" if prefix is not None else "neutral"):
                raise ValueError(f"conditioned encoding cannot be used: {why}")
            P = len(self.base_ids)
            if prefix is not None:
                self.cond_ids = [0] * prefix.length  # never read as tokens: the embeddings are encoded
                kind = "rag-conditioning|" + prefix.spec
            else:
                text = neutral_text(n) if n > 0 else str(conditioning_text).strip() + DOC_SEPARATOR
                self.cond_ids = pc.safe.text(text)
                kind = "rag-conditioning"
            self.ctx_key = unit_key(pc.fingerprint, self.cond_ids, range(P, P + len(self.cond_ids)), self.base_key,
                                    kind)

    # ------------------------------------------------------------------ states

    @property
    def start(self) -> int:
        """The canonical position of a document's first token (right after the preamble)."""
        return len(self.base_ids)

    def base(self) -> ModuleKV:
        """The encoding preamble's states (encoded and stored on first use)."""
        return self.encoder.stored_states(self.base_key, self.base_ids, list(range(len(self.base_ids))))

    def doc_ids(self, text: str) -> list[int]:
        """A document's token ids: its text without surrounding whitespace, then one blank line
        (:data:`DOC_SEPARATOR`), as plain text. Prompts are normalized the same way, so a
        document's key never depends on the whitespace a template puts after it."""
        return document_ids(self.pc, text)

    def doc_body(self, ids: list[int], text: str) -> list[int]:
        """A document's ids without its separator, where the prompt has none after it: a head of
        ``ids`` (its :meth:`doc_ids`, whose stored states are then read in part) when the text
        tokenizes the same with and without it, else the text's own ids (a unit of their own)."""
        body = self.safe.text(unmark(text).strip())
        return ids[: len(body)] if ids[: len(body)] == body else body

    def conditioned(self, ids: Sequence[int]) -> bool:
        """Whether ``ids`` are encoded after the conditioning passages: with conditioning set,
        every document of at least :data:`MIN_CONDITIONED_TOKENS` tokens."""
        return bool(self.cond_ids) and len(ids) >= MIN_CONDITIONED_TOKENS

    def key(self, ids: Sequence[int], start: int | None = None) -> str:
        """The store key of ``ids`` encoded at ``start`` (default: the canonical position)."""
        s = self.start if start is None else start
        ctx = (self.ctx_key if self.conditioned(ids) else self.base_key) if self.encoding == "preamble" else None
        return unit_key(self.fingerprint, list(ids), range(s, s + len(ids)), ctx, "rag-chunk")

    def conditioned_context(self) -> ModuleKV:
        """The preamble's states followed by the conditioning passages' (which attend to the
        preamble), in the model's dtype; both stored, the pair memoized."""
        return self.encoder.conditioned_context(self.base_key, self.base_ids, list(range(len(self.base_ids))),
                                                   self.ctx_key, self.cond_ids,
                                                   None if self.prefix is None else self.prefix.embeds)

    def encode_ids(self, ids: Sequence[int], key: str | None = None, start: int | None = None,
                   store: bool = True) -> ModuleKV:
        """Encode ``ids`` at ``start`` (attending to the preamble in ``encoding="preamble"``, and to
        the conditioning passages after it when set) and store them (unless ``store`` is False)."""
        s = self.start if start is None else start
        key = key or self.key(ids, s)
        if self.conditioned(ids):
            ctx = self.conditioned_context()
            C = ctx.length
            kv = self.encoder.encode(list(ids), list(range(C, C + len(ids))), context=ctx)
            kv = self.encoder.place(kv, s).to(dtype=self.store_dtype)  # back to its canonical slot
        else:
            ctx = None
            if self.encoding == "preamble":
                ctx = self.encoder.context_states(self.base_key, self.base_ids, list(range(len(self.base_ids))))
            kv = self.encoder.encode(list(ids), list(range(s, s + len(ids))), context=ctx).to(dtype=self.store_dtype)
        if store:
            self.store.put(key, kv)
        return kv

    def states(self, ids: Sequence[int], key: str | None = None) -> tuple[ModuleKV, bool]:
        """``(states at the canonical position, whether they were encoded now)``."""
        key = key or self.key(ids)
        kv = self.store.get(key)
        if kv is not None:
            return kv, False
        return self.encode_ids(ids, key), True

    def ensure(self, texts: Sequence[str], progress: bool = False) -> list[str]:
        """Encode (and store) every text not already stored; return their keys, in order.
        This is what the frameworks' ingestion components call."""
        keys = []
        it: Iterable[str] = texts
        if progress and len(texts) > 1:
            from tqdm.auto import tqdm

            it = tqdm(texts, desc="encoding states", unit="chunk")
        for t in it:
            ids = self.doc_ids(t)
            k = self.key(ids)
            if not self.store.contains(k):
                self.encode_ids(ids, k)
            keys.append(k)
        # found in later prompts without marks, in this process and (journalled) in others
        self.known_texts.add((unmark(t) for t in texts), keep=True)
        return keys

    def place(self, kv: ModuleKV, pos: int, tenant: str | None = None) -> tuple[ModuleKV, bool]:
        """``kv`` moved to start at ``pos``: re-rotated (RoPE), as is (ALiBi), or - for learned
        positions, which cannot move - encoded at that slot and cached (in the shared store, or
        with ``tenant`` among that tenant's learned states). Returns whether it was encoded now."""
        try:
            return self.encoder.place(kv, pos), False
        except ValueError:
            ids = kv.token_ids.tolist()
            key = self.key(ids, pos)
            got = self.store.get(key) if tenant is None else self.learned.get(tenant, key)
            if got is not None:
                return got, False
            if tenant is None:
                return self.encode_ids(ids, key, pos), True
            got = self.encode_ids(ids, key, pos, store=False)
            self.learned.put(tenant, key, got)
            return got, True

    def prompt_states(self, ids: Sequence[int], tenant: str, key: str | None = None) -> tuple[ModuleKV, bool]:
        """A document from a prompt at the canonical position (``key``: its :meth:`key`, when known):
        the states learned for ``tenant`` (memory, asked first: a miss costs nothing), else the shared
        store's (ingested, or encoded on purpose), else encoded now and kept among ``tenant``'s
        learned states (never in the shared store). ``(states, encoded now)``."""
        key = key or self.key(ids)
        kv = self.learned.get(tenant, key)
        if kv is None:
            kv = self.store.get(key)
        if kv is not None:
            return kv, False
        kv = self.encode_ids(ids, key, store=False)
        self.learned.put(tenant, key, kv)
        return kv, True


def document_ids(pc: PromptCache, text: str) -> list[int]:
    """A document's token ids as every prompt path reads it (the RAG pipeline, the connectors,
    the quality eval): its text without marks or surrounding whitespace, then one blank line
    (:data:`DOC_SEPARATOR`), as plain text."""
    return pc.safe.text(unmark(text).strip() + DOC_SEPARATOR)


def preamble_ids(pc: PromptCache, system_prompt: str) -> list[int]:
    """The RAG preamble: BOS, the system turn, and the opening of the user turn. The system
    prompt is text like any other: only the chat template's markup is markup."""
    chat = pc.chat
    return bos_ids(pc.tokenizer) + pc.safe.segments([
        (chat.prefix["system"], True), (system_prompt, False), (chat.suffix["system"], True),
        (chat.prefix["user"], True), (DOCUMENTS_HEADER, False),
    ])



__all__ = ["DocumentStates", "check_prefix", "default_conditioning", "default_prefix", "takes_prefix", "preamble_ids",
           "document_ids"]
