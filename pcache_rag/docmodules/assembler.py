"""Prompts made of text and documents: the cache inside other frameworks' pipelines.

:class:`Assembler` is :class:`~.states.DocumentStates` plus the prompt side: it plans a
prompt of segments into cached parts and new tokens, and answers it.

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
  A document nobody encoded before is **encoded after the answer** (first sight):
  the prompt from that document on is computed in the one forward a prompt with
  nothing cached would take, so a first sight costs no more than full prefill
  (:attr:`Assembler.defer_first_sight`; measured in docs/guide.md), and the
  second time it is a hit. Text between documents (a header written by a
  template) is handled the same way;
* everything after the last document (the question, the chat history, the
  generation prompt) is computed.

Documents are encoded against one fixed preamble (``system_prompt``, the RAG
default) whatever prefix a prompt later puts before them: changing a prompt's
system message re-encodes only the prefix, never the corpus. The cost of that
approximation is measured in docs/guide.md ("Your system prompt").

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

import dataclasses
import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..discovery import MAX_LEARNED_BLOCKS, MIN_CHARS, KnownUnion, Uncached, document_spans
from ..engine import ContextOverflowError, Generation, GenerationOutput, Parts, SamplingParams
from ..kv import ModuleKV
from ..pml import bos_ids
from ..recompute import resolve_auto
from ..store import unit_key
from .marks import DOC_SEPARATOR, ROLES, PCacheFallbackWarning, Segment, Segments, split_marked
from .states import DocumentStates
from .turns import extend_prefix, turn_key, turn_states

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Plan:
    parts: list[tuple[str, ModuleKV]]
    new_ids: list[int]
    prompt_tokens: int
    encoded: int
    documents: int
    uncached: list[str]
    #: documents seen for the first time (their stored ids), computed in this prompt and encoded after it
    deferred: list[list[int]] = field(default_factory=list)
    tenant: str = ""  # whose learned states the prompt reads and adds to
    #: its documents' texts: found unmarked in the tenant's next prompts, once this one is answered
    texts: list[str] = field(default_factory=list)


class Assembler(DocumentStates):
    """Prompts built from chat messages or plain text with marked or discovered documents,
    answered from their cached states (see the module docstring); the states side, and the
    arguments, are :class:`~.states.DocumentStates`'."""

    #: a document not yet stored is computed with the prompt and encoded after the answer (True:
    #: its first sight never encodes before the first token), or encoded first and read from the
    #: cache at once (False; docs/runs/2026-12-06-first-sight.md measures both)
    defer_first_sight = True
    #: new documents one prompt may teach (:data:`~pcache_rag.discovery.MAX_LEARNED_BLOCKS`); the rest
    #: of its blocks are computed and said so (``capped``)
    max_learned_blocks = MAX_LEARNED_BLOCKS

    # ------------------------------------------------------------------ prompts

    def message_segments(self, messages: Sequence[tuple[str, str]], discover: bool = True,
                         learn: bool = True, tenant: str = "") -> Segments:
        """Chat messages ``(role, content)`` through the model's own chat template, ending with
        the generation prompt. Contents are text; marked documents become documents, and so do
        (unless ``discover`` is False) known documents found in any message and - with ``learn`` -
        the system and user messages' other blocks that can be documents
        (:func:`~pcache_rag.discovery.document_spans`). Only the template's markup may produce
        control tokens. The result's ``uncached`` says why candidate text was computed. What the
        prompt teaches (its prefix, documents not in the shared store) is kept for ``tenant`` only."""
        chat = self.chat
        segs = Segments(tenant=tenant)
        why = Uncached()
        for i, (role, content) in enumerate(messages):
            if role not in ROLES:
                raise ValueError(f"unsupported message role {role!r}: pcache-rag renders {', '.join(ROLES)}")
            segs.append(Segment(chat.prefix[role], "markup"))
            final_user = i == len(messages) - 1 and role == "user"
            segs.extend(self._content(content, discover, learn and role != "assistant", final_user,
                                      why if role != "assistant" else None, tenant))
            segs.append(Segment(chat.suffix[role], "markup"))
            if i == 0 and role == "system":
                segs.append(Segment("", "cut"))
        segs.append(Segment(chat.generation_prompt, "markup"))
        segs.uncached = why.reasons()
        return segs

    def text_segments(self, prompt: str, discover: bool = True, learn: bool = True, tenant: str = "") -> Segments:
        """A raw text prompt (no chat template), read as one final user message would be by
        :meth:`message_segments`."""
        why = Uncached()
        segs = Segments(self._content(prompt, discover, learn, True, why, tenant), tenant=tenant)
        segs.uncached = why.reasons()
        return segs

    def _content(self, content: str, discover: bool, learn: bool, final_user: bool,
                 why: Uncached | None, tenant: str = "") -> list[Segment]:
        """One message's content as segments: marked documents, then the documents found in its
        plain text (its first block and, in the final user message, its last are never learned):
        the shared known texts and those learned for ``tenant``."""
        pieces = split_marked(content)
        known = KnownUnion(self.known_texts, self.learned.known(tenant))
        out: list[Segment] = []
        for j, (text, marked) in enumerate(pieces):
            if marked or not discover:
                out.append(Segment(text, "document" if marked else "text"))
                continue
            spans = document_spans(text, known, learn=learn, lead=j == 0,
                                   trail=final_user and j == len(pieces) - 1, uncached=why,
                                   learn_limit=self.max_learned_blocks)
            at = 0
            for a, b in spans:
                if a > at:
                    out.append(Segment(text[at:a], "text"))
                out.append(Segment(text[a:b], "document"))
                at = b
            if at < len(text):
                out.append(Segment(text[at:], "text"))
        return out

    def count_tokens(self, segments: Sequence[Segment]) -> int:
        """The prompt tokens ``segments`` make, exactly as :meth:`plan` reads them (and as an
        answer's usage counts them): nothing is encoded or kept."""
        return len(bos_ids(self.tokenizer)) + sum(len(read) for _, read, _ in pieces_of(self, segments))

    def plan(self, segments: Sequence[Segment], max_new_tokens: int = 64) -> _Plan:
        """Token ids and states for ``segments``: the prefix and the documents from the store
        (encoded now if missing), the rest as new tokens."""
        uncached = list(getattr(segments, "uncached", ()))
        tenant = getattr(segments, "tenant", "")
        pieces = pieces_of(self, segments)
        n_docs = sum(1 for p in pieces if p[0] == "document")
        # the prefix is everything before the first document (or the cut)
        bos = bos_ids(self.tokenizer)
        docs_at = [j for j, p in enumerate(pieces) if p[0] == "document"]
        cut_at = next((j for j, p in enumerate(pieces) if p[0] == "cut"), len(pieces))
        first = docs_at[0] if docs_at else cut_at
        prefix = bos + [t for _, ids, _ in pieces[:first] for t in ids]
        # before documents, the text up to the cut (the first system message) is a prefix of its own
        # too: a prompt whose longer prefix is new reads it and computes only the rest (turns.extend_prefix)
        head = bos + [t for _, ids, _ in pieces[:cut_at] for t in ids] if cut_at < first else None
        # a turn between documents (chat markup and what a message says around them) is read in its
        # context (turns.turn_states); plain text between documents is a module like them
        body = [(ids, stored, kind == "document", kind == "turn") for kind, ids, stored in pieces[first:]
                if kind != "cut"]
        last = max((j for j, p in enumerate(body) if p[2]), default=-1)
        tail = [t for ids, *_ in body[last + 1 :] for t in ids]
        mid = [(ids, stored) for ids, stored, _, _ in body[: last + 1] if ids]
        in_context = [turn for ids, _, _, turn in body[: last + 1] if ids]
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
        if n_docs == 0 and total > len(prefix) and uncached:  # text that could have held documents, computed
            log.info("a %d-token prompt holds no known or marked document: %d of its tokens are computed",
                     total, total - len(prefix))
            # one constant text: the warnings filter shows it once per process, at any prompt length
            warnings.warn(
                "a prompt held no marked document, no known one (ingested, retrieved by a pcache retriever, "
                f"encoded before) and no block that can be learned as one (at least {MIN_CHARS} characters between blank "
                "lines, not a message's first block nor the question's), so only its prefix came from the "
                "cache: put blank lines around the documents, ingest or encode them first, or mark them with "
                "pcache_rag.docmodules.format_documents (LangChain: format_docs; LlamaIndex: PromptCacheSynthesizer)",
                PCacheFallbackWarning, stacklevel=4,
            )
        if not mid and not prefix:  # nothing to reuse: one full prefill
            return _Plan([], tail, total, 0, 0, uncached)
        # 3. states
        parts: list[tuple[str, ModuleKV]] = []
        encoded = 0
        if prefix:  # the RAG preamble (shared), or a prompt's own prefix (learned for its tenant): by content
            shared = prefix == self.base_ids
            key = self.base_key if shared else unit_key(self.fingerprint, prefix, range(len(prefix)), None, "prefix")
            kv = self.store.get(key) if shared else self.learned.get(tenant, key)
            if kv is None and not shared and head and len(head) < len(prefix):
                kv = extend_prefix(self, head, prefix, key, tenant)
                encoded += len(prefix) - len(head) if kv is not None else 0
            if kv is None:
                kv = self.encoder.encode(prefix, list(range(len(prefix)))).to(dtype=self.store_dtype)
                if shared:
                    self.store.put(key, kv)
                else:
                    self.learned.put(tenant, key, kv)
                encoded += len(prefix)
            parts.append(("prefix", kv))
        names = [key] if prefix else []  # what each part is (its store key, and where it sits)
        deferred: list[list[int]] = []
        # each document's key hashed once (the look-up and the read share it); a turn's is its context's
        keys = [None if turn else self.key(stored) for (_, stored), turn in zip(mid, in_context)]
        missing = ([j for j, key in enumerate(keys) if key is not None and not self._stored(key, tenant)]
                   if self.defer_first_sight else [])
        if missing:  # from the first unseen document on, the prompt is computed in one forward
            deferred = [mid[j][1] for j in missing]
            tail = [t for ids, _ in mid[missing[0]:] for t in ids] + tail
            mid = mid[: missing[0]]
        pos = len(prefix)
        for j, (ids, stored) in enumerate(mid):
            if in_context[j]:
                name = turn_key(self.fingerprint, ids, pos, names)
                kv, new = turn_states(self, ids, pos, parts, name, tenant)
                encoded += len(ids) if new else 0
                parts.append((f"turn{j}", kv))
                names.append(name)
                pos += len(ids)
                continue
            doc_key = keys[j]
            assert doc_key is not None
            kv, new = self.prompt_states(stored, tenant, doc_key)
            kv = kv.head(len(ids))
            encoded += len(ids) if new else 0
            if pos != self.start:
                kv, new = self.place(kv, pos, tenant)
                encoded += len(ids) if new else 0
            parts.append((f"doc{j}", kv))
            names.append(f"{doc_key}@{pos}")
            pos += len(ids)
        texts = [s.text for s in segments if s.kind == "document"]
        return _Plan(parts, tail, total, encoded, n_docs, uncached, deferred, tenant, texts)

    def _stored(self, key: str, tenant: str = "") -> bool:
        """Whether the states under ``key`` (a document at the canonical position) are among those
        learned for ``tenant`` (memory: asked first) or in the shared store (it may ask a disk or Redis)."""
        return self.learned.contains(tenant, key) or self.store.contains(key)

    def _run(self, segments, recompute, gen: SamplingParams) -> Iterator[str | GenerationOutput]:
        t0 = time.perf_counter()
        plan = self.plan(segments, gen.max_new_tokens)
        yield from self._decode(plan, t0, recompute, gen)

    def _decode(self, plan: _Plan, t0: float, recompute, gen: SamplingParams) -> Iterator[str | GenerationOutput]:
        """Text deltas, then the answer's :class:`GenerationOutput` counted over the whole prompt: the
        documents encoded for it (before, or after the answer: first sight) count as computed."""
        prep = time.perf_counter() - t0
        policy = resolve_auto(recompute, structured=gen.grammar is not None)
        stream = self.pc.stream(Parts(plan.parts, plan.new_ids, preamble="prefix"), recompute=policy, params=gen)
        try:
            yield from stream
        finally:
            stream.close()
        item = stream.output
        assert item is not None
        item.ttft_s += prep  # encoding a missing prefix is part of this answer's wait
        item.total_s += prep
        cached = max(item.cached_tokens - plan.encoded, 0)
        # first sight: the answer is out; now the unseen documents are encoded and stored for the next prompt
        encoded = plan.encoded + sum(len(ids) for ids in plan.deferred if self.prompt_states(ids, plan.tenant)[1])
        # its documents are found unmarked in the tenant's next prompts (this process only: nothing is
        # journalled); the shared index's own texts are known to every tenant already
        known = self.learned.known(plan.tenant)
        known.add(t for t in plan.texts if t not in self.known_texts)
        yield dataclasses.replace(item, cached_tokens=cached, computed_tokens=plan.prompt_tokens - cached,
                                  encoded_tokens=encoded, documents=plan.documents, uncached=tuple(plan.uncached))

    def generate(self, segments: Sequence[Segment], recompute=None, params: SamplingParams | None = None,
                 **gen) -> GenerationOutput:
        """Answer a prompt of segments (see :meth:`message_segments`, :meth:`text_segments`).
        ``recompute``: a policy (:mod:`pcache_rag.recompute`), ``"auto"`` (the RAG default,
        :data:`~pcache_rag.recompute.RAG_RECOMPUTE`) or ``None`` (the engine's own, ``none``). How to decode: ``params`` (a
        :class:`~pcache_rag.request.SamplingParams`) and/or its fields as keywords
        (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``grammar``)."""
        return self.stream(segments, recompute, params, **gen).result()

    def stream(self, segments: Sequence[Segment], recompute=None, params: SamplingParams | None = None,
               **gen) -> Generation:
        """A :class:`~pcache_rag.engine.Generation`, as the engine's streams: text deltas as they are
        decoded (planned at the first), then ``.output``, the :class:`GenerationOutput`."""
        return Generation(self._run(segments, recompute, SamplingParams.of(params, **gen)))

    def stream_planned(self, segments: Sequence[Segment], recompute=None, params: SamplingParams | None = None,
                       **gen) -> Generation:
        """:meth:`stream`, planned now: a prompt too long or unsupported is refused here, and its
        missing documents are encoded here, before the first delta is asked for."""
        params = SamplingParams.of(params, **gen)
        t0 = time.perf_counter()
        return Generation(self._decode(self.plan(segments, params.max_new_tokens), t0, recompute, params))


def pieces_of(states: DocumentStates, segments: Sequence[Segment]) -> list[tuple[str, list[int], list[int]]]:
    """``segments`` as pieces ``(kind, ids the prompt reads, ids whose stored states hold them)``,
    kind ``"plain"`` (``"turn"`` when it holds chat markup), ``"document"`` or ``"cut"``: plain runs
    tokenized together, each document on its own (with its separator where the prompt has it; else
    a head of its stored states)."""
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
    # 2. ids per group. A document read without its separator reads a head of its stored states.
    pieces: list[tuple[str, list[int], list[int]]] = []
    for kind, body in groups:
        if kind == "document":
            stored = states.doc_ids(body[0])
            read = stored if body[1] else states.doc_body(stored, body[0])
            pieces.append(("document", read, stored if read == stored[: len(read)] else read))
        elif kind == "cut":
            pieces.append(("cut", [], []))
        else:  # a run that holds chat markup is part of the conversation: a "turn"
            ids = states.safe.segments(body)
            pieces.append(("turn" if any(markup for _, markup in body) else "plain", ids, ids))
    return pieces


def __getattr__(name: str):
    """``CachedOutput`` (before 0.2): every answer is a :class:`GenerationOutput` now; for one release."""
    if name == "CachedOutput":
        warnings.warn("CachedOutput is deprecated: an Assembler answer is a GenerationOutput (pcache_rag.engine), "
                      "with the same counts (removed in the next release)", DeprecationWarning,
                      stacklevel=3)  # the caller of pcache_rag.docmodules' lazy import
        return GenerationOutput
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Assembler"]
