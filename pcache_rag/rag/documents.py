"""What reading a file gives: a :class:`Document`, or a :class:`SkipFile` saying why not.

A leaf (standard library only): the reader's child process (:mod:`.extract`) loads it
without the rest of the package.
"""

from __future__ import annotations

from dataclasses import dataclass


class SkipFile(Exception):
    """A file that cannot be ingested; the message is the reason."""


@dataclass(slots=True, frozen=True)
class Document:
    text: str
    encoding: str  # "utf-8", or the detected one
    note: str = ""  # what a user should know about how it was read (a detected encoding)
    pages: tuple[str, ...] = ()  # a PDF's text per page (``text`` is them joined by blank lines)
