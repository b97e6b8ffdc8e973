"""Read documents and split them into chunks sized in the LLM's tokens.

Chunks become cached modules, so their size is counted with the tokenizer of
the model that will read them. Paragraphs (blank-line separated) are packed
greedily up to ``chunk_tokens``; a paragraph longer than that is cut at token
boundaries. Text is never dropped or reordered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text")


@dataclass(slots=True, frozen=True)
class Chunk:
    text: str
    index: int  # position of the chunk in its document
    n_tokens: int


def read_text(path: Path) -> str:
    """The text of a supported file (UTF-8; undecodable bytes replaced)."""
    if path.suffix.lower() not in TEXT_SUFFIXES:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r} (supported: {', '.join(TEXT_SUFFIXES)})")
    return path.read_text(encoding="utf-8", errors="replace")


def find_files(paths) -> list[Path]:
    """Supported files under ``paths`` (files or directories, recursively), sorted."""
    out: set[Path] = set()
    for p in paths:
        p = Path(p).expanduser()
        if p.is_dir():
            out.update(f.resolve() for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        elif p.is_file():
            out.add(p.resolve())
        else:
            raise FileNotFoundError(f"{p} does not exist")
    return sorted(out)


def split_tokens(text: str, tokenizer, chunk_tokens: int) -> list[Chunk]:
    """Pack paragraphs into chunks of at most ``chunk_tokens`` tokens."""
    if chunk_tokens < 16:
        raise ValueError("chunk_tokens must be at least 16")

    def count(s: str) -> int:
        return len(tokenizer(s, add_special_tokens=False)["input_ids"])

    pieces: list[str] = []
    for para in re.split(r"(?<=\n)\s*\n", text):  # keep each paragraph's own text
        if not para.strip():
            continue
        if count(para) <= chunk_tokens:
            pieces.append(para)
            continue
        ids = tokenizer(para, add_special_tokens=False)["input_ids"]
        for i in range(0, len(ids), chunk_tokens):
            pieces.append(tokenizer.decode(ids[i : i + chunk_tokens]))
    chunks: list[Chunk] = []
    cur, cur_n = "", 0
    for piece in pieces:
        n = count(piece)
        if cur and cur_n + n > chunk_tokens:
            chunks.append(Chunk(cur.strip("\n"), len(chunks), cur_n))
            cur, cur_n = "", 0
        cur = cur + ("\n" if cur else "") + piece
        cur_n = count(cur)
    if cur.strip():
        chunks.append(Chunk(cur.strip("\n"), len(chunks), cur_n))
    return chunks
