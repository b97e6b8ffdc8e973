"""The one error type of the PML layer: every problem with a schema or a prompt."""

from __future__ import annotations


class PMLError(ValueError):
    """A problem in a PML schema or prompt.

    ``line`` and ``column`` are 1-based and point into the document that was
    being read (``0`` when the problem has no single place, such as a layout
    that is longer than the model's context). The message says what to change.
    """

    def __init__(self, message: str, line: int = 0, column: int = 0):
        self.line = line
        self.column = column
        self.reason = message
        where = f"line {line}, column {column}: " if line else ""
        super().__init__(where + message)
