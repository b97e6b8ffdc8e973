"""Text to token ids, with control tokens only where the chat template put them.

A tokenizer called on a string turns every occurrence of a special or added
token's text (``<|im_end|>``, ``<s>``, ``[INST]``...) into that token's id. For
text that a user, a document or a file name supplied, that is an injection
hole: a question could close the user turn and open a system turn. So
pcache-rag tokenizes in *segments*:

* **markup** (trusted): the role prefixes/suffixes and generation prompt read
  from the model's chat template (:mod:`pcache_rag.pml.chat`). Occurrences of
  the tokenizer's added tokens inside markup become their ids.
* **text** (everything else: PML text, arguments, questions, documents, file
  names, connector messages): tokenized by a private copy of the tokenizer
  from which every added token was removed (but runs of whitespace, which some
  vocabularies add as tokens and which control nothing), so ``<|im_end|>`` typed by a user
  is the characters ``<``, ``|``, ``im``... and never id 2. The result is
  checked: if a control id ever came out of text, :class:`UnsafeTextError` is
  raised instead of returning it.

For benign text the ids are exactly what the tokenizer gives for the joined
string (the tokenizer itself splits the string at added tokens and encodes the
pieces apart), which ``tests/test_security.py`` checks across tokenizers.

The text-only copy is built from the fast tokenizer's JSON (``tokenizers``),
not by toggling ``split_special_tokens``: that flag is shared mutable state on
the backend in transformers 5, so one thread's call could switch it off under
another's, and it does not cover added tokens that are not marked special.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Iterable

Segment = tuple[str, bool]  # (text, is_markup)


class UnsafeTextError(ValueError):
    """Text would have produced a control token and no text-only tokenizer is available."""


class SafeTokenizer:
    """Tokenize markup and text segments of one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        added = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})  # id -> AddedToken
        # Added tokens made only of whitespace (Gemma's runs of newlines, tabs and spaces) are
        # ordinary text: they control nothing, and text must produce them as the model saw them.
        self._added = {str(getattr(t, "content", t)): (int(i), t) for i, t in added.items()
                       if not _whitespace(str(getattr(t, "content", t)))}
        ctrl = set(self._added[c][0] for c in self._added)
        ctrl.update(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(tokenizer, name, None)
            if isinstance(v, int):
                ctrl.add(v)
        unk = getattr(tokenizer, "unk_token_id", None)
        ctrl.discard(unk)  # the model's own "unknown character": text may produce it, it controls nothing
        #: ids that text must never produce
        self.control_ids = frozenset(ctrl)
        words = sorted((c for c in self._added if c), key=len, reverse=True)
        self._markup_re = re.compile("|".join(re.escape(w) for w in words)) if words else None
        self._first, self._rest = _text_only_backends(tokenizer)

    # ------------------------------------------------------------------ text

    def text(self, s: str, first: bool = True) -> list[int]:
        """Ids of untrusted text: never a control token. ``first``: the text starts the sequence
        (matters only for SentencePiece-style tokenizers that mark the first word)."""
        if not s:
            return []
        if self._first is not None:
            enc = (self._first if first else self._rest).encode(s, add_special_tokens=False)
            ids = enc.ids
            if not self.control_ids.isdisjoint(ids):
                ids = self._spell_out(s, enc)
        else:
            ids = self._call_plain(s)
        bad = self.control_ids.intersection(ids)
        if bad:
            raise UnsafeTextError(
                f"text tokenized to control token ids {sorted(bad)} (e.g. {s[:40]!r}); "
                "this tokenizer has no text-only mode, so the text is refused"
            )
        return list(ids)

    def text_many(self, texts: list[str]) -> list[list[int]]:
        """:meth:`text` of many strings (batched in the fast backend)."""
        if self._first is None or not texts:
            return [self.text(t) for t in texts]
        out = []
        for s, enc in zip(texts, self._first.encode_batch(list(texts), add_special_tokens=False)):
            ids = enc.ids
            if not self.control_ids.isdisjoint(ids):
                ids = self.text(s)
            out.append(list(ids))
        return out

    def _spell_out(self, s: str, enc) -> list[int]:
        """The vocabulary itself merged text into a control token (its BPE merges reach it):
        encode that token's characters one by one instead."""
        out: list[int] = []
        for tid, (a, b) in zip(enc.ids, enc.offsets):
            if tid not in self.control_ids:
                out.append(tid)
                continue
            for ch in s[a:b]:
                out.extend(self._rest.encode(ch, add_special_tokens=False).ids)
        return out

    def _call_plain(self, s: str) -> list[int]:
        try:
            out = self.tokenizer(s, add_special_tokens=False, split_special_tokens=True)
        except TypeError:  # a tokenizer without that option (tests' word tokenizer)
            out = self.tokenizer(s, add_special_tokens=False)
        return list(out["input_ids"])

    # ------------------------------------------------------------------ segments

    def segments(self, segs: Iterable[Segment]) -> list[int]:
        """Ids of a sequence of ``(text, is_markup)`` segments.

        Added tokens are recognised in markup only; the text between them (markup and
        untrusted text alike) is joined and tokenized as text, as the tokenizer would.
        """
        out: list[int] = []
        run: list[str] = []

        def flush() -> None:
            if run:
                out.extend(self.text("".join(run), first=not out))
                run.clear()

        for s, markup in segs:
            if not s:
                continue
            if not markup or self._markup_re is None:
                run.append(s)
                continue
            pos = 0
            for m in self._markup_re.finditer(s):
                tid, tok = self._added[m.group(0)]
                before = s[pos : m.start()]
                if getattr(tok, "lstrip", False):
                    before = before.rstrip()
                    if not before and run:
                        run[-1] = run[-1].rstrip()
                run.append(before)
                flush()
                out.append(tid)
                pos = m.end()
                if getattr(tok, "rstrip", False):
                    while pos < len(s) and s[pos].isspace():
                        pos += 1
            run.append(s[pos:])
        flush()
        return out

    def markup(self, s: str) -> list[int]:
        """Ids of trusted markup alone."""
        return self.segments([(s, True)])


def _text_only_backends(tokenizer):
    """``(first, rest)`` copies of the fast backend with no added tokens, or ``(None, None)``.

    ``rest`` differs only for Metaspace pre-tokenizers that mark the first word
    (``prepend_scheme="first"``): text that follows an added token is not first.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None, None
    try:
        from tokenizers import Tokenizer

        spec = json.loads(backend.to_str())
        # Whitespace added tokens stay (see SafeTokenizer), but only those whose ids survive:
        # an added token outside the model's vocabulary is numbered by its place in the list,
        # which removing the others would shift.
        vocab = (spec.get("model") or {}).get("vocab")
        spec["added_tokens"] = [t for t in spec.get("added_tokens") or [] if _whitespace(t.get("content", ""))
                                and isinstance(vocab, dict) and vocab.get(t["content"]) == t.get("id")]
        spec["truncation"] = None
        spec["padding"] = None
        first = Tokenizer.from_str(json.dumps(spec))
        changed = _no_first_prepend(spec.get("pre_tokenizer"))
        rest = Tokenizer.from_str(json.dumps(spec)) if changed else first
        return first, rest
    except Exception:  # noqa: BLE001 - an unreadable backend: the plain call plus the id check
        return None, None


def _whitespace(content: str) -> bool:
    """An added token of whitespace only (kept as text; see :class:`SafeTokenizer`)."""
    return bool(content) and not content.strip()


def _no_first_prepend(node) -> bool:
    changed = False
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            node["prepend_scheme"] = "never"
            changed = True
        for v in node.values():
            changed |= _no_first_prepend(v)
    elif isinstance(node, list):
        for v in node:
            changed |= _no_first_prepend(v)
    return changed


_CACHE: weakref.WeakKeyDictionary[object, SafeTokenizer] = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def safe_tokenizer(tokenizer) -> SafeTokenizer:
    """The (memoized) :class:`SafeTokenizer` of ``tokenizer``."""
    if isinstance(tokenizer, SafeTokenizer):
        return tokenizer
    with _CACHE_LOCK:
        try:
            st = _CACHE.get(tokenizer)
        except TypeError:  # not weak-referenceable
            return SafeTokenizer(tokenizer)
        if st is None:
            st = _CACHE[tokenizer] = SafeTokenizer(tokenizer)
        return st


def text_ids(tokenizer, text: str) -> list[int]:
    """Ids of untrusted ``text`` (no special tokens added, none produced)."""
    return safe_tokenizer(tokenizer).text(text)
