"""Listeners: callbacks on every finished generation of an engine, from any thread."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from .types import GenerationOutput


class Listeners:
    """The callbacks an engine calls with each finished :class:`GenerationOutput`."""

    def __init__(self) -> None:
        self._fns: list[Callable[[GenerationOutput], None]] = []

    def add(self, fn: Callable[[GenerationOutput], None]) -> None:
        self._fns.append(fn)

    def remove(self, fn: Callable[[GenerationOutput], None]) -> None:
        self._fns.remove(fn)

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[GenerationOutput]]:
        """A list that collects every output while the block runs."""
        got: list[GenerationOutput] = []
        self.add(got.append)
        try:
            yield got
        finally:
            self.remove(got.append)

    def notify(self, out: GenerationOutput) -> None:
        for fn in list(self._fns):
            fn(out)

    def notify_all(self, outs: list[GenerationOutput]) -> list[GenerationOutput]:
        """:meth:`notify` each of ``outs``; returns them."""
        for out in outs:
            self.notify(out)
        return outs
