"""Find and read documents, and split them into chunks sized in the LLM's tokens.

Chunks become cached modules, so their size is counted with the tokenizer of
the model that will read them. Paragraphs (blank-line separated) are packed
greedily up to ``chunk_tokens``; a paragraph longer than that is cut at token
boundaries. Text is never dropped or reordered.

Reading never stops a whole run on one bad file: :func:`scan` returns the
files to read plus ``(path, reason)`` for each one skipped (unsupported type,
broken link, unreadable), and :func:`read_document` raises :class:`SkipFile`
for content that is not text. Text is decoded as UTF-8 when it is valid UTF-8,
else with the encoding ``charset-normalizer`` detects (a well-kept detector,
rather than our own guesswork); a file is never stored with replacement
characters in silence.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text")
#: formats read through well-kept parsers: pypdf, beautifulsoup4, python-docx
DOC_SUFFIXES = (".pdf", ".html", ".htm", ".xhtml", ".docx")
SUPPORTED = TEXT_SUFFIXES + DOC_SUFFIXES


class SkipFile(Exception):
    """A file that cannot be ingested; the message is the reason."""


@dataclass(slots=True, frozen=True)
class Chunk:
    text: str
    index: int  # position of the chunk in its document
    n_tokens: int


@dataclass(slots=True, frozen=True)
class Document:
    text: str
    encoding: str  # "utf-8", or the detected one
    note: str = ""  # what a user should know about how it was read (a detected encoding)
    pages: tuple[str, ...] = ()  # a PDF's text per page (``text`` is them joined by blank lines)


def _looks_binary(data: bytes) -> bool:
    head = data[:8192]
    if not head:
        return False
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):  # UTF-16 with a byte-order mark is text
        return False
    if b"\x00" in head:
        return True
    ctrl = sum(1 for b in head if b < 32 and b not in (9, 10, 12, 13, 27, 8))
    return ctrl / len(head) > 0.05


def decode_text(data: bytes, name: str = "") -> Document:
    """Decode ``data`` as text, or raise :class:`SkipFile` if it is not text."""
    if _looks_binary(data):
        raise SkipFile("binary content, not text")
    try:
        return Document(data.decode("utf-8-sig"), "utf-8")
    except UnicodeDecodeError:
        pass
    from charset_normalizer import from_bytes

    matches = list(from_bytes(data))
    if not matches:
        raise SkipFile("not valid UTF-8 and no text encoding fits")
    # Short texts fit several single-byte code pages equally well; among the equally good,
    # prefer the Western ones (the most common non-UTF-8 files) over the detector's order.
    top = min((m.percent_chaos, -m.percent_coherence) for m in matches)
    tied = [m for m in matches if (m.percent_chaos, -m.percent_coherence) == top]
    best = next((m for pref in _WESTERN for m in tied if m.encoding == pref), tied[0])
    return Document(str(best), best.encoding, f"not UTF-8; decoded as {best.encoding} (detected)")


_WESTERN = ("cp1252", "latin_1", "iso8859_15")


def read_document(path: Path) -> Document:
    """The text of a supported file; :class:`SkipFile` says why a file cannot be read."""
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED:
        raise SkipFile(f"unsupported file type {path.suffix or '(none)'!r} (supported: {', '.join(SUPPORTED)})")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SkipFile(f"cannot be read: {e.strerror or e}") from None
    if suffix == ".pdf":
        return read_pdf(data)
    if suffix == ".docx":
        return read_docx(data)
    if suffix in (".html", ".htm", ".xhtml"):
        return read_html(decode_text(data, str(path)))
    return decode_text(data, str(path))


def read_pdf(data: bytes) -> Document:
    """A PDF's text layer, page by page (pypdf). Scanned pages without text are reported."""
    import io

    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            try:
                reader.decrypt("")
            except Exception:  # noqa: BLE001 - pypdf raises several kinds here
                raise SkipFile("encrypted PDF (needs a password)") from None
        pages = tuple(_tidy(p.extract_text() or "") for p in reader.pages)
    except SkipFile:
        raise
    except (PdfReadError, ValueError, KeyError, TypeError, OSError) as e:
        raise SkipFile(f"damaged or unreadable PDF: {e}") from None
    empty = sum(1 for p in pages if not p.strip())
    if pages and empty == len(pages):
        raise SkipFile("the PDF has no text layer (scanned images need OCR, which pcache-rag does not do)")
    note = f"{empty} of {len(pages)} PDF pages have no text (scanned?)" if empty else ""
    return Document("\n\n".join(p for p in pages if p.strip()), "pdf", note, pages)


def read_html(doc: Document) -> Document:
    """The visible text of an HTML page (beautifulsoup4): scripts, styles and markup dropped,
    block elements on their own lines."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(doc.text, "html.parser")
    for tag in soup(["script", "style", "noscript", "template", "head"]):
        tag.decompose()
    title = soup.title.get_text(strip=True) if soup.title else ""
    text = _tidy(soup.get_text("\n"))
    if title and not text.startswith(title):
        text = f"{title}\n\n{text}"
    return Document(text, doc.encoding, doc.note)


def read_docx(data: bytes) -> Document:
    """A Word document's paragraphs and table cells, in order (python-docx)."""
    import io
    import zipfile

    try:
        import docx
        from docx.oxml.ns import qn

        d = docx.Document(io.BytesIO(data))
    except (zipfile.BadZipFile, KeyError, ValueError) as e:
        raise SkipFile(f"damaged or not a .docx file: {e}") from None
    except Exception as e:  # noqa: BLE001 - python-docx raises its own kinds for bad packages
        raise SkipFile(f"unreadable .docx: {e}") from None
    out = []
    for block in d.element.body.iterchildren():
        if block.tag == qn("w:p"):
            out.append("".join(t.text or "" for t in block.iter(qn("w:t"))))
        elif block.tag == qn("w:tbl"):
            for row in block.iter(qn("w:tr")):
                cells = ["".join(t.text or "" for t in c.iter(qn("w:t"))) for c in row.iter(qn("w:tc"))]
                out.append(" | ".join(cells))
    return Document(_tidy("\n".join(out)), "docx")


def _tidy(text: str) -> str:
    """Trim lines and keep at most one blank line between paragraphs."""
    lines = [ln.strip() for ln in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def scan(paths) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Supported files under ``paths`` (files or directories, recursively), resolved and sorted,
    and ``(path, reason)`` for every file skipped. A path that does not exist is an error."""
    out: set[Path] = set()
    skipped: list[tuple[Path, str]] = []
    for p in paths:
        p = Path(p).expanduser()
        if not p.exists() and not p.is_symlink():
            raise FileNotFoundError(f"{p} does not exist")
        if p.is_dir():
            for root, _dirs, files in os.walk(p, followlinks=False):
                for name in sorted(files):
                    _consider(Path(root) / name, out, skipped)
        else:
            _consider(p, out, skipped)
    return sorted(out), skipped


def _consider(f: Path, out: set[Path], skipped: list) -> None:
    # The type is judged by the name as found (a link "notes.md" to a file without an
    # extension is a markdown file); the link's target is what gets read.
    if f.suffix.lower() not in SUPPORTED:
        # named in the report whether given by name or found in a folder: never skipped in silence
        skipped.append((f, f"unsupported file type {f.suffix or '(none)'!r}"))
        return
    try:
        target = f.resolve(strict=True)
    except (OSError, RuntimeError):
        skipped.append((f, "broken link" if f.is_symlink() else "cannot be resolved"))
        return
    if not target.is_file():
        skipped.append((f, "not a regular file"))
        return
    out.add(target if not f.is_symlink() else f.absolute())


def find_files(paths) -> list[Path]:
    """Supported files under ``paths`` (see :func:`scan`, which also says what was skipped)."""
    return scan(paths)[0]


_PARA = re.compile(r"(?<=\n)\s*\n")


def split_tokens(text: str, tokenizer, chunk_tokens: int,
                 progress: Callable[[int], None] | None = None) -> list[Chunk]:
    """Pack paragraphs into chunks of at most ``chunk_tokens`` tokens.

    Each paragraph is tokenized once (linear in the text); ``progress(n_chars)`` is called as
    paragraphs are consumed, so a bar can move during a long file.
    """
    from ..tokens import safe_tokenizer

    if chunk_tokens < 16:
        raise ValueError("chunk_tokens must be at least 16")
    st = safe_tokenizer(tokenizer)
    paras = [p for p in _PARA.split(text) if p.strip()]
    pieces: list[tuple[str, int]] = []
    step = 512
    for i in range(0, len(paras), step):
        batch = paras[i : i + step]
        for para, ids in zip(batch, st.text_many(batch)):
            if len(ids) <= chunk_tokens:
                pieces.append((para, len(ids)))
                continue
            for j in range(0, len(ids), chunk_tokens):
                part = ids[j : j + chunk_tokens]
                pieces.append((tokenizer.decode(part), len(part)))
        if progress is not None:
            progress(sum(len(p) for p in batch))
    chunks: list[Chunk] = []
    cur: list[str] = []
    cur_n = 0
    for piece, n in pieces:
        # joining adds a newline, which may cost a token: count it
        if cur and cur_n + 1 + n > chunk_tokens:
            chunks.append(_chunk(cur, len(chunks), cur_n))
            cur, cur_n = [], 0
        cur_n += n + (1 if cur else 0)
        cur.append(piece)
    if cur:
        chunks.append(_chunk(cur, len(chunks), cur_n))
    return [c for c in chunks if c.text.strip()]


def _chunk(pieces: list[str], index: int, n: int) -> Chunk:
    return Chunk("\n".join(pieces).strip("\n"), index, n)
