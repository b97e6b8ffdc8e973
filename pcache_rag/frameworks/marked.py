"""Prompts made of text and documents: the cache inside other frameworks' pipelines.

LlamaIndex and LangChain render a RAG prompt as one string (or a list of chat
messages) with the retrieved documents pasted into it. To reuse cached states
the engine must know where each document starts and ends. pcache-rag marks
them: :func:`mark_document` wraps a document's text in two private-use
characters (U+E000 ... U+E001) that survive every prompt template unchanged,
and :class:`Assembler` splits a rendered prompt at those marks:

* the text before the first document (the chat template's opening, the system
  prompt, the template's preface) is the **prefix**: its states are cached by
  content, so a fixed system prompt is computed once;
* each document is a **module** keyed by its text alone (content addressing;
  encoded with one blank line after it). It is encoded once, at the canonical
  position after the encoding preamble, and re-placed wherever a prompt puts it.
  A document nobody encoded before is encoded on first use and stored, so the
  second time it is a hit. Text between documents (a header written by a
  template) is handled the same way;
* everything after the last document (the question, the chat history, the
  generation prompt) is computed.

Documents are encoded against one fixed preamble (``system_prompt``, the RAG
default) whatever prefix a prompt later puts before them: changing a prompt's
system message re-encodes only the prefix, never the corpus. The cost of that
approximation is measured in docs/guide.md ("Your system prompt").

**Conditioned encoding** (``conditioning="neutral"`` or ``"neutral:N"``, N up to 4): each
document is encoded after the preamble *and* fixed neutral passages
(``pcache_rag/data/neutral*.txt``; or a passage of the caller's, ``conditioning_text``),
which are never part of an assembled prompt, then
moved back to the canonical position. A document encoded alone after the preamble reads
as if it were the first and only thing said; in a prompt it never is, and its states
then pull the question towards it. The conditioning is part of every key, so states
encoded under different conditioning never mix. It needs states that can move (RoPE or
ALiBi), costs encode time at ingest, and nothing at query time.

Marks are only structure: a document is tokenized as plain text
(:mod:`pcache_rag.tokens`), and a stray or forged mark can at most make some
text a module of its own text. A prompt with no marked and no known document is
answered by full prefill, with a :class:`PCacheFallbackWarning` that says so (once per process).

**Discovery** (:mod:`pcache_rag.discovery`): known documents - ingested chunks, documents
encoded before through :meth:`Assembler.ensure` or a marked prompt, chunks one of our
retrievers returned - are found in any message without marks and served from the cache
exactly as marked ones are. Marks stay an explicit override.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine import ContextOverflowError, GenerationOutput, Parts, PromptCache, SamplingParams
from ..kv import ModuleKV
from ..pml import bos_ids
from ..recompute import resolve_auto
from ..conditioning import (LearnedPrefix, conditioning_kind, installed_prefix, neutral_text, parse_conditioning,
                            passage_spec)
from ..store import unit_key
from ..discovery import MIN_CHARS, Uncached, document_spans
from .marks import (DEFAULT_CONDITIONING, DEFAULT_SYSTEM, DOC_SEPARATOR, DOCUMENTS_HEADER, MIN_CONDITIONED_TOKENS,
                    ROLES, PCacheFallbackWarning, Segment, Segments, split_marked, unmark)

log = logging.getLogger(__name__)

def default_conditioning(pc: PromptCache) -> str:
    """:data:`DEFAULT_CONDITIONING` where ``pc`` can use it (``encoding="preamble"`` and states
    that move), else ``"none"`` (logged: a default that does not apply, not an error)."""
    if not parse_conditioning(DEFAULT_CONDITIONING):
        return "none"
    if pc.encoding != "preamble" or pc.adapter.family == "learned":
        log.info("documents are encoded without conditioning: it needs encoding='preamble' and states that move "
                 "(this engine: encoding=%r, %s positions)", pc.encoding, pc.adapter.family)
        return "none"
    return DEFAULT_CONDITIONING


def takes_prefix(pc: PromptCache) -> bool:
    """Whether ``pc`` can encode documents after a learned prefix: ``encoding="preamble"``, RoPE,
    no sliding window or soft-cap (ALiBi's and learned positions' adapters feed token ids only)."""
    return pc.encoding == "preamble" and pc.adapter.family == "rope" and not pc.adapter.constrained


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
    if pc.adapter.family != "rope":
        raise ValueError(f"a learned conditioning prefix needs a RoPE model; {pc.model_type} has "
                         f"{pc.adapter.family} positions")


@dataclass(slots=True)
class CachedOutput:
    """A finished answer and what the prompt cost."""

    output: GenerationOutput
    prompt_tokens: int  # every token of the prompt
    cache_read: int  # tokens whose stored states were used as they were
    computed: int  # prompt tokens computed by this call (new, encoded now, recomputed)
    encoded: int  # prefix/document tokens encoded by this call (and stored for next time)
    documents: int  # documents in the prompt
    uncached: list[str]  # why text that could have been a document was computed (Segments.uncached)

    @property
    def text(self) -> str:
        return self.output.text

    def stats(self) -> dict:
        o = self.output
        return {"ttft_s": o.ttft_s, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cache_read,
                "computed_tokens": self.computed, "encoded_tokens": self.encoded,
                "recomputed_tokens": o.recomputed_tokens, "documents": self.documents,
                "output_tokens": len(o.token_ids), "finish_reason": o.finish_reason, "uncached": self.uncached}


@dataclass(slots=True)
class _Plan:
    parts: list[tuple[str, ModuleKV]]
    new_ids: list[int]
    prompt_tokens: int
    encoded: int
    documents: int
    uncached: list[str]


class Assembler:
    """Content-addressed document states on one :class:`PromptCache`, and prompts built from
    chat messages or plain text with marked documents (see the module docstring).

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
            if pc.encoding != "preamble":
                raise ValueError("conditioned encoding extends the preamble context: it needs encoding='preamble'")
            if pc.adapter.family == "learned":
                raise ValueError(f"conditioned encoding needs states that can move (RoPE or ALiBi); "
                                 f"{pc.model_type}'s learned positions cannot")
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

    def place(self, kv: ModuleKV, pos: int) -> tuple[ModuleKV, bool]:
        """``kv`` moved to start at ``pos``: re-rotated (RoPE), as is (ALiBi), or - for learned
        positions, which cannot move - encoded at that slot and cached. Returns whether it
        was encoded now."""
        try:
            return self.encoder.place(kv, pos), False
        except ValueError:
            ids = kv.token_ids.tolist()
            key = self.key(ids, pos)
            got = self.store.get(key)
            if got is not None:
                return got, False
            return self.encode_ids(ids, key, pos), True

    # ------------------------------------------------------------------ prompts

    def message_segments(self, messages: Sequence[tuple[str, str]], discover: bool = True,
                         learn: bool = True) -> Segments:
        """Chat messages ``(role, content)`` through the model's own chat template, ending with
        the generation prompt. Contents are text; marked documents become documents, and so do
        (unless ``discover`` is False) known documents found in any message and - with ``learn`` -
        the system and user messages' other blocks that can be documents
        (:func:`~pcache_rag.discovery.document_spans`). Only the template's markup may produce
        control tokens. The result's ``uncached`` says why candidate text was computed."""
        chat = self.chat
        segs = Segments()
        why = Uncached()
        for i, (role, content) in enumerate(messages):
            if role not in ROLES:
                raise ValueError(f"unsupported message role {role!r}: pcache-rag renders {', '.join(ROLES)}")
            segs.append(Segment(chat.prefix[role], "markup"))
            final_user = i == len(messages) - 1 and role == "user"
            segs.extend(self._content(content, discover, learn and role != "assistant", final_user,
                                      why if role != "assistant" else None))
            segs.append(Segment(chat.suffix[role], "markup"))
            if i == 0 and role == "system":
                segs.append(Segment("", "cut"))
        segs.append(Segment(chat.generation_prompt, "markup"))
        segs.uncached = why.reasons()
        return segs

    def text_segments(self, prompt: str, discover: bool = True, learn: bool = True) -> Segments:
        """A raw text prompt (no chat template), read as one final user message would be by
        :meth:`message_segments`."""
        why = Uncached()
        segs = Segments(self._content(prompt, discover, learn, True, why))
        segs.uncached = why.reasons()
        return segs

    def _content(self, content: str, discover: bool, learn: bool, final_user: bool,
                 why: Uncached | None) -> list[Segment]:
        """One message's content as segments: marked documents, then the documents found in its
        plain text (its first block and, in the final user message, its last are never learned)."""
        pieces = split_marked(content)
        out: list[Segment] = []
        for j, (text, marked) in enumerate(pieces):
            if marked or not discover:
                out.append(Segment(text, "document" if marked else "text"))
                continue
            spans = document_spans(text, self.known_texts, learn=learn, lead=j == 0,
                                   trail=final_user and j == len(pieces) - 1, uncached=why)
            at = 0
            for a, b in spans:
                if a > at:
                    out.append(Segment(text[at:a], "text"))
                out.append(Segment(text[a:b], "document"))
                at = b
            if at < len(text):
                out.append(Segment(text[at:], "text"))
        return out

    def plan(self, segments: Sequence[Segment], max_new_tokens: int = 64) -> _Plan:
        """Token ids and states for ``segments``: the prefix and the documents from the store
        (encoded now if missing), the rest as new tokens."""
        uncached = list(getattr(segments, "uncached", ()))
        # 1. group: plain runs tokenized together; documents with the separator after them where
        # the prompt has it (else their states without it, and what follows is read as written)
        groups: list[tuple[str, list]] = []  # ("plain", [(text, is_markup)]) | ("document", [text, whole])
        segs = list(segments)
        i = 0
        while i < len(segs):
            s = segs[i]
            if s.kind == "document":
                i += 1
                whole = i < len(segs) and segs[i].kind == "text" and segs[i].text.startswith(DOC_SEPARATOR)
                if whole:  # the separator belongs to the document
                    segs[i] = Segment(segs[i].text[len(DOC_SEPARATOR):], "text")
                groups.append(("document", [s.text, whole]))
                continue
            if s.kind == "cut":
                groups.append(("cut", []))
            elif s.text:
                if not groups or groups[-1][0] != "plain":
                    groups.append(("plain", []))
                groups[-1][1].append((s.text, s.kind == "markup"))
            i += 1
        n_docs = sum(1 for g in groups if g[0] == "document")
        if n_docs:
            groups = [g for g in groups if g[0] != "cut"]
        # 2. ids per group; the prefix is everything before the first document (or the cut).
        # A piece is (kind, ids the prompt reads, ids whose stored states hold them): a document
        # read without its separator reads a head of its stored states.
        pieces: list[tuple[str, list[int], list[int]]] = []
        for kind, body in groups:
            if kind == "document":
                stored = self.doc_ids(body[0])
                read = stored if body[1] else self.doc_body(stored, body[0])
                pieces.append(("document", read, stored if read == stored[: len(read)] else read))
                self.known_texts.add(body[0], keep=True)  # encoded and kept now: found unmarked next time
            elif kind == "cut":
                pieces.append(("cut", [], []))
            else:
                ids = self.safe.segments(body)
                pieces.append(("plain", ids, ids))
        bos = bos_ids(self.tokenizer)
        first = next((j for j, p in enumerate(pieces) if p[0] in ("document", "cut")), len(pieces))
        prefix = bos + [t for _, ids, _ in pieces[:first] for t in ids]
        body = [p for p in pieces[first:] if p[0] != "cut"]
        last = max((j for j, p in enumerate(body) if p[0] == "document"), default=-1)
        tail = [t for _, ids, _ in body[last + 1 :] for t in ids]
        mid = [(ids, stored) for _, ids, stored in body[: last + 1] if ids]
        if not tail:  # a prompt that ends with a document: its last piece is computed
            if mid:
                tail = mid.pop()[0]
            else:
                tail, prefix = prefix, []
        total = len(prefix) + sum(len(ids) for ids, _ in mid) + len(tail)
        if total + max_new_tokens > self.max_positions:
            raise ContextOverflowError(
                f"the prompt is {total} tokens; with {max_new_tokens} new tokens it needs {total + max_new_tokens} "
                f"positions, but the model takes {self.max_positions}: retrieve fewer or shorter documents"
            )
        if n_docs == 0 and total > len(prefix):
            log.info("a %d-token prompt holds no known or marked document: %d of its tokens are computed",
                     total, total - len(prefix))
            # one constant text: the warnings filter shows it once per process, at any prompt length
            warnings.warn(
                "a prompt held no marked document, no known one (ingested, retrieved by a pcache retriever, "
                f"encoded before) and no block that can be learned as one (at least {MIN_CHARS} characters between blank "
                "lines, not a message's first block nor the question's), so only its prefix came from the "
                "cache: put blank lines around the documents, ingest or encode them first, or mark them with "
                "pcache_rag.frameworks.format_documents (LangChain: format_docs; LlamaIndex: PromptCacheSynthesizer)",
                PCacheFallbackWarning, stacklevel=4,
            )
        if not mid and not prefix:  # nothing to reuse: one full prefill
            return _Plan([], tail, total, 0, 0, uncached)
        # 3. states
        parts: list[tuple[str, ModuleKV]] = []
        encoded = 0
        if prefix:  # the RAG preamble itself, or another prefix: both cached by content
            key = (self.base_key if prefix == self.base_ids
                   else unit_key(self.fingerprint, prefix, range(len(prefix)), None, "prefix"))
            kv = self.store.get(key)
            if kv is None:
                kv = self.encoder.encode(prefix, list(range(len(prefix)))).to(dtype=self.store_dtype)
                self.store.put(key, kv)
                encoded += len(prefix)
            parts.append(("prefix", kv))
        pos = len(prefix)
        for j, (ids, stored) in enumerate(mid):
            kv, new = self.states(stored)
            kv = kv.head(len(ids))
            encoded += len(ids) if new else 0
            if pos != self.start:
                kv, new = self.place(kv, pos)
                encoded += len(ids) if new else 0
            parts.append((f"doc{j}", kv))
            pos += len(ids)
        return _Plan(parts, tail, total, encoded, n_docs, uncached)

    def _run(self, segments, recompute, gen: SamplingParams) -> Iterator[str | CachedOutput]:
        t0 = time.perf_counter()
        plan = self.plan(segments, gen.max_new_tokens)
        yield from self._decode(plan, t0, recompute, gen)

    def _decode(self, plan: _Plan, t0: float, recompute, gen: SamplingParams) -> Iterator[str | CachedOutput]:
        prep = time.perf_counter() - t0
        stream = self.pc.stream(Parts(plan.parts, plan.new_ids, preamble="prefix"), recompute=resolve_auto(recompute), params=gen)
        try:
            yield from stream
        finally:
            stream.close()
        item = stream.output
        assert item is not None
        item.ttft_s += prep  # encoding a missing document is part of this answer's wait
        item.total_s += prep
        cached = max(item.cached_tokens - plan.encoded, 0)
        yield CachedOutput(item, plan.prompt_tokens, cached, plan.prompt_tokens - cached, plan.encoded,
                           plan.documents, plan.uncached)

    def generate(self, segments: Sequence[Segment], recompute=None, **gen) -> CachedOutput:
        """Answer a prompt of segments (see :meth:`message_segments`, :meth:`text_segments`).
        ``recompute``: a policy (:mod:`pcache_rag.recompute`), ``"auto"`` (the RAG default,
        ``match:1``) or ``None`` (the engine's own, ``none``).
        ``gen``: ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_p``, ``seed``, ``stop``."""
        out = None
        for item in self._run(segments, recompute, SamplingParams.of(**gen)):
            if isinstance(item, CachedOutput):
                out = item
        assert out is not None
        return out

    def stream(self, segments: Sequence[Segment], recompute=None, **gen) -> Iterator[str | CachedOutput]:
        """Text deltas as they are decoded, then the :class:`CachedOutput` (planned at the first item)."""
        return self._run(segments, recompute, SamplingParams.of(**gen))

    def stream_planned(self, segments: Sequence[Segment], recompute=None, **gen) -> Iterator[str | CachedOutput]:
        """:meth:`stream`, planned now: a prompt too long or unsupported is refused here, and its
        missing documents are encoded here, before the first item is asked for."""
        params = SamplingParams.of(**gen)
        t0 = time.perf_counter()
        return self._decode(self.plan(segments, params.max_new_tokens), t0, recompute, params)


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


__all__ = ["Assembler", "CachedOutput", "check_prefix", "default_conditioning", "preamble_ids", "document_ids"]
