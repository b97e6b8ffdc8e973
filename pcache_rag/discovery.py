"""Document discovery: the known documents' exact texts inside any prompt, without marks.

A stock pipeline (LangChain's ``create_stuff_documents_chain``, LlamaIndex's chat engines)
pastes retrieved documents into a message as plain text. :class:`KnownTexts` holds the texts
whose states an engine keeps or can encode - ingested chunks, documents seen through a
connector, the documents one of our retrievers returned - and finds them in a prompt, so the
:class:`~pcache_rag.frameworks.Assembler` serves each one from the cache exactly as if it had
been marked.

How it finds them: every known text (stripped of surrounding whitespace) is indexed by its
first :data:`ANCHOR_CHARS` characters in an Aho-Corasick automaton (``pyahocorasick``, a
well-kept C library; an automaton over whole texts would hold the corpus a second time).
A lookup is one pass over the prompt, O(prompt length + anchor hits); each hit is confirmed
by comparing the whole text at that offset, and the longest confirmed text wins, left to
right, without overlaps. Texts shorter than :data:`MIN_CHARS` are not indexed: a short
sentence is too likely to be quoted, and too cheap to be worth a lookup.

Texts arrive all the time (every retrieval may add a few), and an automaton must be rebuilt
after words are added. So new anchors go to a small second automaton, rebuilt on the next
lookup (cheap), and are merged into the main one only when they reach a quarter of it:
each anchor is rebuilt into the main automaton O(1) times on average.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import ahocorasick

#: how many leading characters of a known text index it
ANCHOR_CHARS = 48
#: texts shorter than this (after stripping) are not discovered
MIN_CHARS = 64


class KnownTexts:
    """A set of document texts, and where they occur in a prompt (see the module docstring).
    Thread-safe: one instance is shared by every component on an engine."""

    def __init__(self) -> None:
        self._by_anchor: dict[str, list[str]] = {}  # anchor -> full texts starting with it, longest first
        self._n = 0
        self._main = ahocorasick.Automaton()  # most anchors, rebuilt rarely
        self._main_size = 0
        self._recent: list[str] = []  # anchors added since the main automaton was built
        self._small = ahocorasick.Automaton()  # the recent anchors, rebuilt on the next lookup
        self._dirty = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._n

    def __contains__(self, text: str) -> bool:
        t = text.strip()
        return t in self._by_anchor.get(t[:ANCHOR_CHARS], ())

    def add(self, texts: str | Iterable[str]) -> int:
        """Remember ``texts`` (one or many); returns how many were new. Short texts are skipped."""
        if isinstance(texts, str):
            texts = [texts]
        added = 0
        with self._lock:
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
                added += 1
        return added

    def find(self, text: str) -> list[tuple[int, int]]:
        """Non-overlapping ``(start, end)`` spans of ``text`` that are known texts, in order;
        at each offset the longest known text wins, and an earlier span wins over a later one."""
        if not self._by_anchor or len(text) < MIN_CHARS:
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
                    for full in self._by_anchor[anchor]:  # longest first
                        if text.startswith(full, start):
                            hits.append((start, start + len(full)))
                            break
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


__all__ = ["ANCHOR_CHARS", "MIN_CHARS", "KnownTexts"]
