"""Document discovery: the known documents' exact texts inside any prompt, without marks.

A stock pipeline (LangChain's ``create_stuff_documents_chain``, LlamaIndex's chat engines)
pastes retrieved documents into a message as plain text. :class:`KnownTexts` holds the texts
whose states an engine keeps or can encode - ingested chunks, documents seen through a
connector, the documents one of our retrievers returned - and finds them in a prompt, so the
:class:`~pcache_rag.docmodules.Assembler` serves each one from the cache exactly as if it had
been marked.

How it finds them: every known text (stripped of surrounding whitespace) is indexed by its
first :data:`ANCHOR_CHARS` characters in an Aho-Corasick automaton (``pyahocorasick``, a
well-kept C library; an automaton over whole texts would hold the corpus a second time).
A lookup is one pass over the prompt, O(prompt length + anchor hits); each hit is confirmed
by comparing the whole text at that offset, and the longest confirmed text wins, left to
right, without overlaps. Texts shorter than :data:`MIN_CHARS` are not indexed: a short
sentence is too likely to be quoted, and too cheap to be worth a lookup.

Texts that were encoded and kept (a connector's encoder, a document encoded on first use)
are also written to a journal beside the states they name (``known-texts.jsonl`` in the
engine's ``cache_dir``), so another process on the same states finds them too: a server
started after ``PromptCacheDocumentEncoder`` ran, or a second worker. Only texts encoded on
purpose are journalled (``Assembler.ensure``: the user's own documents); what prompts teach is
kept per tenant in memory and written nowhere (:mod:`pcache_rag.store.learned`). The journal is
JSON lines, one ``{"text", "at"}`` object each (``at``: when it was added, Unix seconds; an older
journal's bare strings are read too), appended under a file lock; a reader takes what was
appended since it last looked, at each lookup (one ``stat`` when nothing changed). A line left
without its newline by a crash mid-write is ended by the next writer, so it reads as one damaged
line (skipped, with a warning) and never swallows the entry written after it.
:meth:`KnownTexts.compact` rewrites it without forgotten texts, entries past a retention
period, duplicates and damaged lines (``pcache-rag forget``). JSON, not pickle: the journal is
data, never code.

**Learning documents from prompts** (:func:`document_spans`): a stock pipeline may paste
documents that no component of ours has seen (LangChain's ``create_stuff_documents_chain`` over
any vector store). Such a prompt's messages are split into *blocks* at blank lines; a block of
at least :data:`MIN_CHARS` characters is taken as a document, encoded on first sight and kept,
so the next prompt that holds it (in any order, in any message) reads it from the cache. Two
blocks are never taken: a message's first block (its instructions or a template's header) and
the final user message's last block (the question, which must attend to the documents). What
could not be served from the cache is counted in a :class:`Uncached`, which says why in words.

Texts arrive all the time (every retrieval may add a few), and an automaton must be rebuilt
after words are added. So new anchors go to a small second automaton, rebuilt on the next
lookup (cheap), and are merged into the main one only when they reach a quarter of it:
each anchor is rebuilt into the main automaton O(1) times on average.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import ahocorasick

log = logging.getLogger(__name__)

#: how many leading characters of a known text index it
ANCHOR_CHARS = 48
#: texts shorter than this (after stripping) are not discovered
MIN_CHARS = 64
#: what separates the blocks that documents are learned from: a blank line (spaces allowed on it)
BLOCK_BREAK = re.compile(r"\n[ \t]*\n")
#: the journal's file name in an engine's ``cache_dir``
KNOWN_JOURNAL = "known-texts.jsonl"
#: new documents one prompt may teach (blocks learned on its first sight); beyond it they are computed
MAX_LEARNED_BLOCKS = 32
#: an opening or question piece this long may hold documents: said in ``uncached`` when computed
LONG_CHARS = 512
#: a template's label at the start of a line (``Context:``, ``Question:``, ``Answer:``...): the
#: label is the template's text, and what follows it on the line starts a new piece
LABEL = re.compile(r"(?im)^[ \t]*(context|documents?|sources?|passages?|question|query|input|follow up input|"
                   r"standalone question|chat history|history|answer|helpful answer|response)[ \t]*:[ \t]*")
#: labels whose piece is the question: never learned (it must be computed, after the documents)
QUESTION_LABELS = frozenset({"question", "query", "input", "follow up input", "standalone question"})


class KnownTexts:
    """A set of document texts, and where they occur in a prompt (see the module docstring).
    Thread-safe: one instance is shared by every component on an engine."""

    def __init__(self, journal: str | os.PathLike | None = None) -> None:
        """``journal``: the file that texts added with ``keep=True`` are written to and read
        back from, shared by every process on the same states (None: this process only)."""
        self._journal = Path(journal) if journal is not None else None
        self._read_to = 0  # bytes of the journal taken in so far
        self._by_anchor: dict[str, list[str]] = {}  # anchor -> full texts starting with it, longest first
        self._n = 0
        self._main = ahocorasick.Automaton()  # most anchors, rebuilt rarely
        self._main_size = 0
        self._recent: list[str] = []  # anchors added since the main automaton was built
        self._small = ahocorasick.Automaton()  # the recent anchors, rebuilt on the next lookup
        self._dirty = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        self._catch_up()
        return self._n

    def __contains__(self, text: str) -> bool:
        self._catch_up()
        t = text.strip()
        return t in self._by_anchor.get(t[:ANCHOR_CHARS], ())

    def add(self, texts: str | Iterable[str], keep: bool = False) -> int:
        """Remember ``texts`` (one or many); returns how many were new. Short texts are skipped.
        ``keep``: their states are kept in the store, so the new ones go to the journal too,
        for other processes on the same states."""
        if isinstance(texts, str):
            texts = [texts]
        self._catch_up()
        with self._lock:
            new = self._add_locked(texts)
        if keep and new and self._journal is not None:
            self._append(new)
        return len(new)

    def _add_locked(self, texts: Iterable[str]) -> list[str]:
        """Add ``texts`` to the index (the caller holds the lock); returns the new ones, stripped."""
        added: list[str] = []
        for text in texts:
            t = text.strip()
            if len(t) < MIN_CHARS:
                continue
            anchor = t[:ANCHOR_CHARS]
            same = self._by_anchor.get(anchor)
            if same is None:
                self._by_anchor[anchor] = [t]
                self._recent.append(anchor)
                self._dirty = True
            elif t not in same:
                same.append(t)
                same.sort(key=len, reverse=True)
            else:
                continue
            self._n += 1
            added.append(t)
        return added

    def _append(self, texts: list[str]) -> None:
        """Write ``texts`` to the journal, one JSON line each, under the journal's lock (one
        write per call, so a reader sees whole lines or none of them)."""
        from filelock import FileLock

        assert self._journal is not None
        now = round(time.time())
        data = "".join(json.dumps({"text": t, "at": now}, ensure_ascii=False) + "\n" for t in texts).encode("utf-8")
        try:
            self._journal.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self._journal) + ".lock", timeout=30), open(self._journal, "a+b") as f:
                start = f.seek(0, os.SEEK_END)
                if start:  # under the lock, a last line without its newline was torn by a crash mid-write:
                    f.seek(start - 1)  # end it, so it reads as one damaged line (skipped) and ours stays whole
                    if f.read(1) != b"\n":
                        data = b"\n" + data
                f.write(data)
            with self._lock:
                if start == self._read_to:  # nobody appended since the last look: no need to read our own lines
                    self._read_to = start + len(data)
        except OSError as e:  # a read-only states folder: this process still knows them
            log.warning("could not record %d known document(s) in %s: %s", len(texts), self._journal, e)

    def _catch_up(self) -> None:
        """Take in the journal lines other processes (or this one) appended since the last look."""
        if self._journal is None:
            return
        try:
            size = self._journal.stat().st_size
        except OSError:
            return  # no journal yet
        if size == self._read_to:
            return
        with self._lock:
            if size < self._read_to:  # compacted by another process: read it again from the start
                self._read_to = 0
            if size <= self._read_to:
                return
            with open(self._journal, "rb") as f:
                f.seek(self._read_to)
                chunk = f.read(size - self._read_to)
            whole = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next look
            texts = []
            for line in whole.splitlines():
                entry = _entry(line)
                if entry is not None:
                    texts.append(entry[0])
                else:
                    log.warning("skipping a damaged line in %s", self._journal)
            self._read_to += len(whole)
            self._add_locked(texts)

    def compact(self, forget: Iterable[str] = (), older_than_s: float | None = None) -> tuple[int, int]:
        """Rewrite the journal without the texts in ``forget``, entries added more than
        ``older_than_s`` seconds ago, duplicates and damaged lines (under its lock, atomically:
        a new file renamed over the old); ``forget`` leaves this process's set too. Returns
        ``(entries kept, entries dropped)``. Other processes read the rewritten journal anew
        at their next lookup; texts they already hold stay known to them until they restart."""
        from filelock import FileLock

        gone = {t.strip() for t in forget}
        with self._lock:
            for t in gone:
                same = self._by_anchor.get(t[:ANCHOR_CHARS])
                if same and t in same:
                    same.remove(t)
                    self._n -= 1
                    if not same:  # its anchor may stay in an automaton: a lookup finds no text for it
                        del self._by_anchor[t[:ANCHOR_CHARS]]
        if self._journal is None or not self._journal.exists():
            return 0, 0
        cutoff = None if older_than_s is None else time.time() - older_than_s
        kept: dict[str, float] = {}
        dropped = 0
        with FileLock(str(self._journal) + ".lock", timeout=30):
            for line in self._journal.read_bytes().splitlines():
                entry = _entry(line)
                if entry is None or entry[0] in gone or entry[0] in kept \
                        or (cutoff is not None and entry[1] < cutoff):
                    dropped += 1
                    continue
                kept[entry[0]] = entry[1]
            tmp = self._journal.with_name(self._journal.name + ".compact")
            tmp.write_bytes("".join(json.dumps({"text": t, "at": at}, ensure_ascii=False) + "\n"
                                    for t, at in kept.items()).encode("utf-8"))
            os.replace(tmp, self._journal)
            with self._lock:
                self._read_to = self._journal.stat().st_size
        return len(kept), dropped

    def find(self, text: str, misses: list[int] | None = None) -> list[tuple[int, int]]:
        """Non-overlapping ``(start, end)`` spans of ``text`` that are known texts, in order;
        at each offset the longest known text wins, and an earlier span wins over a later one.
        ``misses``, when given, receives the offsets where a known text's opening occurs but
        the rest differs (a document cut or edited inside)."""
        if len(text) < MIN_CHARS:
            return []
        self._catch_up()
        if not self._by_anchor:
            return []
        with self._lock:
            if self._dirty:
                self._rebuild()
            hits = []
            for automaton in (self._main, self._small):
                if automaton.kind != ahocorasick.AHOCORASICK:
                    continue  # empty
                for end, anchor in automaton.iter(text):
                    start = end - len(anchor) + 1
                    same = self._by_anchor.get(anchor)
                    if not same:  # forgotten (compact): its anchor stays in the automaton until a rebuild
                        continue
                    for full in same:  # longest first
                        if text.startswith(full, start):
                            hits.append((start, start + len(full)))
                            break
                    else:
                        if misses is not None:
                            misses.append(start)
        spans: list[tuple[int, int]] = []  # leftmost first, then longest; no overlaps
        for start, end in sorted(hits, key=lambda h: (h[0], -h[1])):
            if not spans or start >= spans[-1][1]:
                spans.append((start, end))
        return spans

    def _rebuild(self) -> None:
        """Build the small automaton over the recent anchors, or fold them into the main one
        once they are a quarter of it (the caller holds the lock)."""
        if len(self._recent) > max(1024, self._main_size // 4):
            self._main = ahocorasick.Automaton()
            for anchor in self._by_anchor:
                self._main.add_word(anchor, anchor)
            self._main.make_automaton()
            self._main_size = len(self._by_anchor)
            self._recent = []
        self._small = ahocorasick.Automaton()
        for anchor in self._recent:
            self._small.add_word(anchor, anchor)
        if self._recent:
            self._small.make_automaton()
        self._dirty = False


class KnownUnion:
    """Several :class:`KnownTexts` read as one (the shared index's texts and one tenant's
    learned ones): ``find`` merges their spans, leftmost then longest, without overlaps."""

    def __init__(self, *sets: KnownTexts) -> None:
        self.sets = sets

    def __len__(self) -> int:
        return sum(len(s) for s in self.sets)

    def find(self, text: str, misses: list[int] | None = None) -> list[tuple[int, int]]:
        hits = [h for s in self.sets if len(s) for h in s.find(text, misses)]
        spans: list[tuple[int, int]] = []
        for start, end in sorted(hits, key=lambda h: (h[0], -h[1])):
            if not spans or start >= spans[-1][1]:
                spans.append((start, end))
        return spans


def _entry(line: bytes) -> tuple[str, float] | None:
    """A journal line's ``(text, when added)``: an object ``{"text", "at"}``, or an older journal's
    bare string (when: 0, the epoch); None for a damaged line."""
    try:
        v = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if isinstance(v, str):
        return v, 0.0
    if isinstance(v, dict) and isinstance(v.get("text"), str) and isinstance(v.get("at", 0), (int, float)):
        return v["text"], float(v.get("at", 0))
    return None


def blocks(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of ``text``'s blocks: the runs between blank lines (:data:`BLOCK_BREAK`),
    each without the whitespace around it; blank runs give none."""
    out = []
    at = 0
    for m in [*BLOCK_BREAK.finditer(text), None]:
        end = m.start() if m is not None else len(text)
        piece = text[at:end]
        a = at + len(piece) - len(piece.lstrip())
        b = at + len(piece.rstrip())
        if b > a:
            out.append((a, b))
        if m is not None:
            at = m.end()
    return out


def pieces(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, label)`` of ``text``'s pieces: its :func:`blocks`, each cut again where a
    template's label (:data:`LABEL`) opens a line; ``label`` is the lowercased label a piece follows
    ('' for none). The labels themselves and the whitespace around pieces belong to no piece, and
    empty pieces (``Answer:`` at the end) are left out. So the LangChain hub's ``rlm/rag-prompt``
    ("...Question: {question} \\nContext: {context} \\nAnswer:") gives its instructions, the
    question, and each document on its own. A label alone on its block names the next piece.
    (A document of its own with such lines, an FAQ's ``Answer:``, is cut there too when it is
    learned from a prompt; ingested and encoded documents are found whole.)"""
    out = []
    label = ""  # a label alone on its block ("Context:" then a blank line) names the next piece
    for a, b in blocks(text):
        at = a
        for m in [*LABEL.finditer(text, a, b), None]:
            end = m.start() if m is not None else b
            piece = text[at:end]
            x, y = at + len(piece) - len(piece.lstrip()), at + len(piece.rstrip())
            if y > x:
                out.append((x, y, label))
                label = ""
            if m is not None:
                at, label = m.end(), " ".join(m.group(1).lower().split())
    return out


@dataclass(slots=True)
class Uncached:
    """What of a prompt's plain text could have been a document and was computed instead, and
    why: filled by :func:`document_spans`, read by :meth:`reasons`."""

    short: int = 0  # blocks in a document's place under MIN_CHARS characters
    whole: int = 0  # long opening or question pieces (LONG_CHARS or more) that may hold documents inside
    unseen: int = 0  # blocks long enough, not known, with learning off
    cut: int = 0  # a known document's opening found, the rest different
    learned: int = 0  # blocks taken as new documents (encoded on this first sight)
    capped: int = 0  # blocks that could have been learned, beyond one prompt's cap

    def reasons(self) -> list[str]:
        """One sentence per reason that applies (empty when every candidate was cached)."""
        out = []
        if self.short:
            out.append(f"too short: {self.short} block(s) between blank lines under {MIN_CHARS} characters "
                       "were computed, not cached")
        if self.whole:
            out.append(f"one block: {self.whole} long piece(s) that open a message or hold the question ({LONG_CHARS}+ "
                       "characters, no blank line or label inside) were computed; documents in them cannot be told "
                       "apart: put blank lines around the documents")
        if self.capped:
            out.append(f"capped: {self.capped} block(s) beyond this prompt's limit of new documents were computed, "
                       "not learned")
        if self.unseen:
            out.append(f"unseen: {self.unseen} block(s) are not known documents and learning documents from "
                       "prompts is off, so they were computed")
        if self.cut:
            out.append(f"split inside: {self.cut} known document(s) begin here but the text then differs "
                       "(cut or edited inside); what the prompt holds was computed or learned anew")
        return out


def document_spans(text: str, known: KnownTexts | KnownUnion, *, learn: bool, lead: bool, trail: bool,
                   uncached: Uncached | None = None, learn_limit: int | None = None) -> list[tuple[int, int]]:
    """The documents in one piece of a message: known texts found anywhere in it
    (:meth:`KnownTexts.find`), and - with ``learn`` - its other pieces (:func:`pieces`) of at
    least :data:`MIN_CHARS` characters, except:

    * the first piece when ``lead`` (it opens a message: instructions, a header), unless a
      template's label follows it (then it is the template's own text, the same every call);
    * the question: a piece after a question label (``Question:``), or, when ``trail`` (it ends the
      final user message) and no label names one, the last piece.

    At most ``learn_limit`` blocks are learned while ``uncached.learned`` counts them (one
    prompt's cap, :data:`MAX_LEARNED_BLOCKS` in the Assembler); the rest are computed and
    counted as ``capped``. Non-overlapping spans, in order; ``uncached`` counts the rest."""
    misses: list[int] = []
    spans = known.find(text, misses) if len(known) else []
    found = list(spans)
    pcs = pieces(text)
    asked = any(label in QUESTION_LABELS for *_, label in pcs)
    for i, (a, b, label) in enumerate(pcs):
        if any(x < b and a < y for x, y in spans):
            continue  # holds (or is) a known document
        header = lead and i == 0 and not label and not (len(pcs) > 1 and pcs[1][2])
        if header or label in QUESTION_LABELS or (trail and not asked and i == len(pcs) - 1):
            if uncached is not None and b - a >= LONG_CHARS:
                uncached.whole += 1
            continue
        if b - a < MIN_CHARS:
            if uncached is not None:
                uncached.short += 1
        elif learn and (learn_limit is None or uncached is None or uncached.learned < learn_limit):
            found.append((a, b))
            if uncached is not None:
                uncached.learned += 1
        elif learn and uncached is not None:
            uncached.capped += 1
        elif uncached is not None:
            uncached.unseen += 1
    if uncached is not None:
        uncached.cut += sum(1 for m in misses if not any(x <= m < y for x, y in spans))
    return sorted(found)


__all__ = ["ANCHOR_CHARS", "BLOCK_BREAK", "KNOWN_JOURNAL", "LABEL", "LONG_CHARS", "MAX_LEARNED_BLOCKS", "MIN_CHARS",
           "QUESTION_LABELS", "KnownTexts", "KnownUnion", "Uncached", "blocks", "document_spans", "pieces"]
