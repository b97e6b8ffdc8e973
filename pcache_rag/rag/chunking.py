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

from .documents import Document, SkipFile

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text")
#: formats read through well-kept parsers: pypdf, beautifulsoup4, python-docx
DOC_SUFFIXES = (".pdf", ".html", ".htm", ".xhtml", ".docx")
SUPPORTED = TEXT_SUFFIXES + DOC_SUFFIXES


@dataclass(slots=True, frozen=True)
class Chunk:
    text: str
    index: int  # position of the chunk in its document
    n_tokens: int


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


#: the most text one file may give, in characters (about 8M tokens: far more states than a
#: disk holds), and the largest plain-text file read
MAX_TEXT_CHARS = 32_000_000
MAX_TEXT_BYTES = 4 * MAX_TEXT_CHARS
#: a .docx whose XML parts expand to more than this is refused before parsing
MAX_DOCX_XML_BYTES = 64 << 20
#: a .docx part larger than BOMB_MIN_BYTES that compressed better than this ratio is refused
BOMB_RATIO = 200
BOMB_MIN_BYTES = 4 << 20
#: an internal DTD declaring an entity (see :func:`read_html`)
_ENTITY_DECL = re.compile(r"<!DOCTYPE[^>\[]*\[[^\]]*<!ENTITY", re.IGNORECASE)
#: formats whose parsers run in a child process with a memory limit (see :mod:`.extract`)
ISOLATED_SUFFIXES = (".pdf", ".docx", ".html", ".htm", ".xhtml")


def read_document(path: Path, isolate: bool = True) -> Document:
    """The text of a supported file; :class:`SkipFile` says why a file cannot be read.

    PDF, Word and HTML files are parsed in a child process with a memory limit
    (``isolate``; see :mod:`.extract`), so a decompression bomb is a skipped file, never the
    caller's memory. Text beyond :data:`MAX_TEXT_CHARS` is refused by name, never cut."""
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED:
        raise SkipFile(f"unsupported file type {path.suffix or '(none)'!r} (supported: {', '.join(SUPPORTED)})")
    if isolate and suffix in ISOLATED_SUFFIXES:
        from .extract import extract

        return extract(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise SkipFile(f"cannot be read: {e.strerror or e}") from None
    if suffix in TEXT_SUFFIXES + (".html", ".htm", ".xhtml") and size > MAX_TEXT_BYTES:
        raise SkipFile(f"the file is {size / 1e6:.0f} MB; the limit for one text file is {MAX_TEXT_BYTES / 1e6:.0f} MB")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SkipFile(f"cannot be read: {e.strerror or e}") from None
    if suffix == ".pdf":
        doc = read_pdf(data)
    elif suffix == ".docx":
        doc = read_docx(data)
    elif suffix in (".html", ".htm", ".xhtml"):
        doc = read_html(decode_text(data, str(path)))
    else:
        doc = decode_text(data, str(path))
    if len(doc.text) > MAX_TEXT_CHARS:
        raise SkipFile(f"its text is {len(doc.text) / 1e6:.0f}M characters; the limit for one file is "
                       f"{MAX_TEXT_CHARS / 1e6:.0f}M (split the file to ingest it)")
    return doc


def read_pdf(data: bytes) -> Document:
    """A PDF's text layer, page by page (pypdf). Scanned pages without text are reported."""
    import io

    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    from pypdf.errors import LimitReachedError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            try:
                reader.decrypt("")
            except Exception:  # noqa: BLE001 - pypdf raises several kinds here
                raise SkipFile("encrypted PDF (needs a password)") from None
        pages = []
        total = 0
        for p in reader.pages:
            pages.append(_tidy(p.extract_text() or ""))
            total += len(pages[-1])
            if total > MAX_TEXT_CHARS:
                raise SkipFile(f"its text is more than {MAX_TEXT_CHARS / 1e6:.0f}M characters, the limit for one "
                               f"file (split the file to ingest it)")
        pages = tuple(pages)
    except SkipFile:
        raise
    except LimitReachedError as e:  # pypdf's own bound on what a stream may inflate to
        raise SkipFile(f"a stream in the PDF expands past pypdf's limit (a decompression bomb?): {e}") from None
    except (PdfReadError, ValueError, KeyError, TypeError, OSError, AttributeError, IndexError,
            RecursionError) as e:
        raise SkipFile(f"damaged or unreadable PDF: {e}") from None
    empty = sum(1 for p in pages if not p.strip())
    if pages and empty == len(pages):
        raise SkipFile("the PDF has no text layer (scanned images need OCR, which pcache-rag does not do)")
    note = f"{empty} of {len(pages)} PDF pages have no text (scanned?)" if empty else ""
    return Document("\n\n".join(p for p in pages if p.strip()), "pdf", note, pages)


def read_html(doc: Document) -> Document:
    """The visible text of an HTML page (beautifulsoup4): scripts, styles and markup dropped,
    block elements on their own lines. A page whose DOCTYPE declares entities is refused by
    name: no HTML needs them, and the classic "billion laughs" file is built of them (the
    parser would not expand them; it would index the declarations' debris as text)."""
    from bs4 import BeautifulSoup

    if _ENTITY_DECL.search(doc.text[:1 << 20]):
        raise SkipFile("its DOCTYPE declares XML entities (<!ENTITY ...>), as entity-expansion bombs do: not read")
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
        _check_zip(data)
        import docx
        from docx.oxml.ns import qn

        d = docx.Document(io.BytesIO(data))
    except SkipFile:
        raise
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


def _check_zip(data: bytes) -> None:
    """Refuse a .docx whose XML would expand past :data:`MAX_DOCX_XML_BYTES`, or whose large
    parts compressed better than :data:`BOMB_RATIO`, from the zip directory alone (before any
    part is inflated; Python's zipfile never inflates past a part's declared size)."""
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as z:
        total = 0
        for info in z.infolist():
            if not info.filename.endswith((".xml", ".rels")):
                continue
            total += info.file_size
            if info.file_size > BOMB_MIN_BYTES and info.file_size > BOMB_RATIO * max(info.compress_size, 1):
                raise SkipFile(f"{info.filename} expands from {info.compress_size / 1e3:.0f} KB to "
                               f"{info.file_size / 1e6:.0f} MB ({info.file_size // max(info.compress_size, 1)}:1; "
                               f"a decompression bomb?)")
        if total > MAX_DOCX_XML_BYTES:
            raise SkipFile(f"its XML expands to {total / 1e6:.0f} MB, more than the {MAX_DOCX_XML_BYTES / 1e6:.0f} MB "
                           f"limit (a decompression bomb?)")


def _tidy(text: str) -> str:
    """Trim lines and keep at most one blank line between paragraphs."""
    lines = [ln.strip() for ln in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def scan(paths, exclude=()) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Supported files under ``paths`` (files or directories, recursively), resolved and sorted,
    and ``(path, reason)`` for every file skipped. A path that does not exist is an error.

    Directories in ``exclude`` (the index being written, say) are left out of a walk without a
    word: an index inside the folder it indexes never lists its own databases as skipped."""
    out: set[Path] = set()
    skipped: list[tuple[Path, str]] = []
    left_out = {_real(e) for e in exclude}
    for p in paths:
        p = Path(p).expanduser()
        if not p.exists() and not p.is_symlink():
            raise FileNotFoundError(f"{p} does not exist")
        if p.is_dir():
            for root, dirs, files in os.walk(p, followlinks=False):
                if left_out:
                    dirs[:] = [d for d in dirs if _real(Path(root) / d) not in left_out]
                for name in sorted(files):
                    _consider(Path(root) / name, out, skipped)
        else:
            _consider(p, out, skipped)
    return sorted(out), skipped


def _real(p) -> Path:
    try:
        return Path(p).expanduser().resolve()
    except (OSError, RuntimeError):
        return Path(p).expanduser().absolute()


def unencodable_name(f: Path) -> bool:
    """True when the path holds bytes that are not UTF-8 (Python keeps them as lone
    surrogates): such a name cannot go into the tokenizer, chroma or JSON."""
    try:
        str(f).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _consider(f: Path, out: set[Path], skipped: list) -> None:
    # The type is judged by the name as found (a link "notes.md" to a file without an
    # extension is a markdown file); the link's target is what gets read.
    if unencodable_name(f):
        skipped.append((f, "the file name is not valid UTF-8 (shown escaped); rename the file to ingest it"))
        return
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
