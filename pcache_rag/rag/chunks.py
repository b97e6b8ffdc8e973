"""An index's chunk states: how a chunk is tokenized, keyed, encoded, placed and read back.

:class:`ChunkStates` is the part of an index that ingest, maintenance, calibration and
answering share. It holds the :class:`~pcache_rag.docmodules.Assembler` the chunks are encoded
under (swapped when the index moves to another conditioning) and the store their states live
in, handed over directly, so none of them reaches through the engine for either.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..conditioning import conditioning_kind, installed_prefix
from ..engine import PromptCache
from ..docmodules import Assembler
from ..kv import ModuleKV
from ..moved import moved
from ..store import KVStore
from .index_dir import Index, same_conditioning
from .prompt import chunk_text
from .types import ModuleHandle

log = logging.getLogger(__name__)


def index_assembler(pc: PromptCache, index: Index, system_prompt: str, conditioning: str) -> Assembler:
    """The Assembler that encodes an index's chunks under ``conditioning`` (neutral passages, or a
    learned prefix read from the index's own file: ``pcache-rag calibrate --learn`` leaves it there)."""
    if conditioning == "default" or conditioning_kind(conditioning) != "learned":
        asm = Assembler(pc, system_prompt, conditioning=conditioning)
        if asm.prefix is not None:  # the model's installed prefix: the index keeps its own copy, as for a learned one
            path = index.prefix_path(asm.prefix.spec)
            try:
                if not path.exists():
                    asm.prefix.save(path)
            except OSError:  # another process wrote it at the same moment
                if not path.exists():
                    raise
        return asm
    try:
        prefix = index.load_prefix(conditioning)
    except (OSError, ValueError) as e:  # missing or damaged: the installed prefix of the same spec restores it
        installed = installed_prefix(pc.fingerprint)
        if installed is None or installed.spec != conditioning:
            raise
        log.warning("%s; restored from the prefix installed for this model", e)
        prefix = installed
        prefix.save(index.prefix_path(conditioning))
    return Assembler(pc, system_prompt, prefix=prefix)


class ChunkStates:
    """The chunks of one index as states: every chunk is encoded once, at the canonical slot
    right after the preamble (and the conditioning context), and moved to its slot when read."""

    def __init__(self, asm: Assembler, store: KVStore, bytes_per_token: int) -> None:
        #: the Assembler chunks are encoded and keyed under (its conditioning is the index's)
        self.asm = asm
        #: where the states live (the engine's store, the same object)
        self.store = store
        #: bytes of stored states per token (the store's dtype, the model's KV shape)
        self.bytes_per_token = bytes_per_token

    def follow(self, index: Index, manifest: dict) -> None:
        """Where another process moved the index to another conditioning (``calibrate --learn``),
        encode and read under it from now on: chunks are keyed by it."""
        cond = manifest.get("conditioning")
        if cond and not same_conditioning(cond, self.asm.conditioning):
            log.info("the index %s is now encoded with conditioning=%s", index.path, cond)
            self.asm = index_assembler(self.asm.pc, index, self.asm.system_prompt, cond)

    @property
    def preamble_ids(self) -> list[int]:
        """The preamble's token ids: the system prompt and the opening of the user turn."""
        return self.asm.base_ids

    @property
    def canonical_start(self) -> int:
        """The position every chunk is encoded at (right after the preamble)."""
        return len(self.asm.base_ids)

    def preamble(self) -> ModuleKV:
        """The preamble's states (and, with conditioning, the passages' after it), made and
        stored on first use: an ingest or a server's warm-up makes them before any chunk."""
        if self.asm.cond_ids:  # neutral passages or a learned prefix
            self.asm.conditioned_context()
        return self.asm.base()

    @staticmethod
    def text(handle_or_text: ModuleHandle | str, source: str | None = None) -> str:
        """A chunk as the model reads it: a ``[file name]`` header line, then its text."""
        if isinstance(handle_or_text, ModuleHandle):
            return chunk_text(handle_or_text.text, handle_or_text.source)
        return chunk_text(handle_or_text, source)

    def ids(self, text: str, source: str) -> list[int]:
        """A chunk's token ids: file names and documents are text, never markup; the same ids
        as the document marked in a framework's prompt."""
        return self.asm.doc_ids(self.text(text, source))

    def __getattr__(self, name: str):
        """``key``, ``encode`` and ``contains`` only forwarded to the assembler and the store, and
        moved there (:data:`_MOVED`); still reached here for one release, with a ``DeprecationWarning``."""
        return moved(self, name, _MOVED, "chunks")

    def parts(self, handles: Sequence[ModuleHandle]) -> list[tuple[str, ModuleKV]]:
        """The prompt's cached parts for ``handles``: the preamble, then each chunk's states at its
        slot, most relevant last (fetched, or encoded on first use for lazy chunks)."""
        parts = [("preamble", self.preamble())]
        start = pos = self.canonical_start
        for h in sorted(handles, key=lambda h: h.score):  # most relevant last
            kv = self.store.get(h.kv_key)
            if kv is None:  # evicted, damaged or lazy: encode from the stored text, under this process's own key
                ids = self.ids(h.text, h.source)  # (never one keyed for another conditioning: an index moving)
                key = self.asm.key(ids, start)
                kv = (self.store.get(key) if key != h.kv_key else None) or self.asm.encode_ids(ids, key, start)
            if pos != start:
                kv, _ = self.asm.place(kv, pos)
            parts.append((h.id, kv))
            pos += kv.length
        return parts

    def prompt_ids(self, handles: Sequence[ModuleHandle], question_ids: list[int]) -> list[int]:
        """The tokens the cached path reads for ``handles`` and the question, for a full prefill."""
        ids = list(self.preamble_ids)
        for h in sorted(handles, key=lambda h: h.score):
            ids.extend(self.ids(h.text, h.source))
        return ids + question_ids


_MOVED = {"key": "asm.key", "encode": "asm.encode_ids", "contains": "store.contains"}
