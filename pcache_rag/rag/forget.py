"""``pcache-rag forget``: a text's states and its journal entries removed, on request.

What a prompt taught lives only in a running process's memory, per tenant
(:mod:`pcache_rag.store.learned`): a server's ``POST /api/forget`` drops the caller's, and a
restart drops everyone's. What is on disk is what was encoded on purpose (``ingest``,
``Assembler.ensure``, a connector's document encoder): its states, in every tier of the store
(memory, disk, Redis), and the journal line that lets other processes find the text
(:mod:`pcache_rag.discovery`). :func:`forget` removes both for the texts named, and can drop
journal entries past a retention period. A text that is part of an indexed file is said so:
its states come back the next time it is retrieved, until its file is removed and
``pcache-rag ingest --prune`` runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class ForgetReport:
    """What :func:`forget` removed."""

    states: int = 0  # store entries removed (every tier that held one counts once)
    journal_kept: int = 0
    journal_dropped: int = 0  # journal entries removed: the texts named, past retention, duplicates, damaged
    indexed: list[str] = field(default_factory=list)  # texts named that are chunks of indexed files

    def lines(self) -> list[str]:
        out = [f"{self.states} stored state(s) removed; journal: {self.journal_dropped} entr(ies) removed, "
               f"{self.journal_kept} kept"]
        for t in self.indexed:
            out.append(f"still indexed (its states return when it is retrieved; remove its file and run "
                       f"`pcache-rag ingest --prune`): {t[:60]!r}")
        return out


def forget(rag, texts: Sequence[str] = (), older_than_days: float | None = None) -> ForgetReport:
    """Remove ``texts``' states (at the canonical position, under the index's conditioning) from
    every tier of ``rag``'s store, and their journal entries; with ``older_than_days``, also the
    journal entries added longer ago than that. ``rag`` is a :class:`~pcache_rag.rag.CachedRAG`."""
    asm = rag.asm
    rep = ForgetReport()
    for t in texts:
        if asm.store.remove(asm.key(asm.doc_ids(t))):
            rep.states += 1
    if texts:  # chunks of indexed files that hold a text: their states go too (they return on use)
        chunks, keys = rag.index.texts(), rag.index.keys()
        for t in texts:
            hits = [cid for cid, body in chunks if t.strip() and t.strip() in body]
            if hits:
                rep.indexed.append(t)
                rep.states += sum(1 for cid in hits if asm.store.remove(keys[cid]))
    older = None if older_than_days is None else older_than_days * 86400.0
    rep.journal_kept, rep.journal_dropped = asm.known_texts.compact(texts, older)
    return rep


__all__ = ["ForgetReport", "forget"]
