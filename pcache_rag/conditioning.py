"""Conditioned encoding's specs and passages (low in the stack: the engine and the RAG path use them).

A unit encoded right after the preamble reads as if it were the first and only thing
said; in an assembled prompt it never is. Conditioned encoding encodes it after the
preamble *and* fixed neutral passages (``pcache_rag/data/neutral*.txt``), which are
never part of a prompt, then moves its states back to their own positions. The spec
is ``"none"`` (the paper's semantics), ``"neutral"`` (one passage) or ``"neutral:N"``.
A caller may instead give its own passage (``Assembler(conditioning_text=...)``, for
instance one drawn from the corpus); its spec is then ``"passage:<hash>"``.
"""

from __future__ import annotations

from pathlib import Path

#: the neutral passages of conditioned encoding, in order
NEUTRAL_PASSAGES = ("neutral.txt", "neutral2.txt", "neutral3.txt", "neutral4.txt")
#: what follows each passage (a blank line, as after a document)
SEPARATOR = "\n\n"


def parse_conditioning(spec: str | None) -> int:
    """How many neutral passages a conditioning spec puts before each document: ``None`` or
    ``"none"`` (0: the paper's semantics), ``"neutral"`` (1) or ``"neutral:N"`` (N)."""
    if spec in (None, "", "none"):
        return 0
    name, _, n = str(spec).partition(":")
    if name == "neutral" and (not n or n.isdigit()):
        k = int(n or 1)
        if 1 <= k <= len(NEUTRAL_PASSAGES):
            return k
    raise ValueError(f"conditioning must be 'none', 'neutral' or 'neutral:N' with N from 1 to "
                     f"{len(NEUTRAL_PASSAGES)}, not {spec!r}")


def neutral_text(n: int) -> str:
    """The first ``n`` neutral passages, each ending with a blank line (as a document does)."""
    folder = Path(__file__).parent / "data"
    return "".join((folder / name).read_text(encoding="utf-8").strip() + SEPARATOR
                   for name in NEUTRAL_PASSAGES[:n])

def passage_spec(text: str) -> str:
    """The conditioning spec of a caller's own passage: ``"passage:"`` and a hash of its text."""
    import hashlib

    return "passage:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


__all__ = ["NEUTRAL_PASSAGES", "neutral_text", "parse_conditioning", "passage_spec"]
