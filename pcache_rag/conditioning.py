"""Conditioned encoding's specs, passages and learned prefixes (low in the stack: the
engine and the RAG path use them).

A unit encoded right after the preamble reads as if it were the first and only thing
said; in an assembled prompt it never is. Conditioned encoding encodes it after the
preamble *and* fixed neutral passages (``pcache_rag/data/neutral*.txt``), which are
never part of a prompt, then moves its states back to their own positions. The spec
is ``"none"`` (the paper's semantics), ``"neutral"`` (one passage) or ``"neutral:N"``.
A caller may instead give its own passage (``Assembler(conditioning_text=...)``, for
instance one drawn from the corpus); its spec is then ``"passage:<hash>"``.

A **learned prefix** (:class:`LearnedPrefix`, spec ``"learned:<hash>"``) replaces the
passage's tokens by input embeddings trained so that chunks encoded after it read, to
the question, as they do inside a full prefill (``pcache-rag calibrate --learn``; see
:mod:`pcache_rag.rag.learned`). It starts from the neutral passage's own embeddings and
is stored as safetensors with what it was trained for.

**Installed prefixes** (``$PCACHE_RAG_HOME/learned/*.safetensors``, or bundled by a
distribution in ``pcache_rag/data/learned/``): a prefix learned once for a model
(``pcache-rag install-prefix``). It is the RAG default wherever its model fingerprint equals
the engine's (:func:`installed_prefix`); other models keep the neutral passage. The embedded
model's ships in :data:`PACKAGED_DIR` (its README there says how it was made and how to make it
again), so a fresh install answers under it with no step of its own.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the connectors import this module without it
    import torch

from .fsutil import cache_home

log = logging.getLogger(__name__)

#: where a distribution may bundle prefixes (one file per model; matched by model fingerprint)
PACKAGED_DIR = Path(__file__).parent / "data" / "learned"
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


def conditioning_refusal(kind: str, encoding: str, movable: bool, family: str, constrained: str,
                         model_type: str) -> str:
    """Why an engine cannot encode units after ``kind`` conditioning (``"neutral"``, a passage, or
    ``"learned"``); ``''`` when it can. The one rule the PML schemas and the document states both
    apply: conditioning extends the preamble context (``encoding="preamble"``), states encoded after
    it must move back (RoPE or ALiBi), and a learned prefix's embeddings need a RoPE model without
    sliding windows or soft-capping (the other adapters feed token ids only)."""
    if encoding != "preamble":
        return "it extends the preamble context, so it needs encoding='preamble'"
    if not movable:
        return f"it needs states that can move (RoPE or ALiBi); {model_type}'s {family} positions cannot"
    if kind == "learned" and (family != "rope" or constrained):
        return (f"a learned prefix needs a RoPE model without sliding windows or soft-capping; {model_type} has "
                f"{constrained or family + ' positions'}")
    return ""


def neutral_text(n: int) -> str:
    """The first ``n`` neutral passages, each ending with a blank line (as a document does)."""
    folder = Path(__file__).parent / "data"
    return "".join((folder / name).read_text(encoding="utf-8").strip() + SEPARATOR
                   for name in NEUTRAL_PASSAGES[:n])

def conditioning_kind(spec: str | None) -> str:
    """``"none"``, ``"neutral"``, ``"passage"`` or ``"learned"``: the kind of a conditioning spec
    (a neutral spec is checked as :func:`parse_conditioning` does; others by their form)."""
    for kind in ("passage", "learned"):
        if str(spec).startswith(kind + ":"):
            tail = str(spec)[len(kind) + 1:]
            if len(tail) == 12 and all(c in "0123456789abcdef" for c in tail):
                return kind
            raise ValueError(f"a {kind} conditioning spec is '{kind}:' and 12 hex digits, not {spec!r}")
    return "neutral" if parse_conditioning(spec) else "none"


def passage_spec(text: str) -> str:
    """The conditioning spec of a caller's own passage: ``"passage:"`` and a hash of its text."""
    return "passage:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


#: what a learned prefix's file says it is (safetensors metadata ``format``)
LEARNED_FORMAT = "pcache-rag learned conditioning 1"


@dataclass(frozen=True, eq=False)
class LearnedPrefix:
    """Input embeddings that documents are encoded after, in place of a neutral passage's tokens.

    ``embeds`` is ``(m, hidden_size)`` float32; ``meta`` says what it was trained for and how
    (``fingerprint``: the model's; ``init``, ``steps``, the KL it measured...). The spec is a hash
    of the embeddings and the model fingerprint, so states encoded after two different
    prefixes (or for two models) never share a key.
    """

    embeds: torch.Tensor  # (m, hidden) float32 (torch is imported lazily, see above)
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        return self.meta.get("fingerprint", "")

    @property
    def spec(self) -> str:
        import torch

        h = hashlib.sha256(self.fingerprint.encode())
        h.update(self.embeds.detach().to(torch.float32).contiguous().numpy().tobytes())
        return "learned:" + h.hexdigest()[:12]

    @property
    def length(self) -> int:
        return int(self.embeds.shape[0])

    def save(self, path: str | Path) -> Path:
        """Write the prefix as safetensors (atomically); returns the path."""
        import torch
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        meta = {**{k: str(v) for k, v in self.meta.items()}, "format": LEARNED_FORMAT}
        save_file({"embeds": self.embeds.detach().to(torch.float32).contiguous()}, str(tmp), metadata=meta)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> LearnedPrefix:
        """Read a prefix written by :meth:`save`; a file that is not one is refused by name."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = dict(f.metadata() or {})
                embeds = f.get_tensor("embeds")
        except (OSError, ValueError, KeyError, SafetensorError) as e:
            raise ValueError(f"{path} is not a learned conditioning prefix ({e})") from None
        if meta.pop("format", None) != LEARNED_FORMAT or embeds.ndim != 2 or not embeds.is_floating_point():
            raise ValueError(f"{path} is not a learned conditioning prefix (format {LEARNED_FORMAT!r})")
        return cls(embeds.float(), meta)


def installed_dir() -> Path:
    """Where ``pcache-rag install-prefix`` writes a model's learned prefix
    (``$PCACHE_RAG_HOME/learned``)."""
    return cache_home() / "learned"


def install(prefix: LearnedPrefix, path: str | Path) -> Path:
    """Write ``prefix`` to ``path`` (atomically) where :func:`installed_prefix` finds it, and
    forget what this process had read, so it is the default here from now on too."""
    out = prefix.save(path)
    _installed.cache_clear()
    return out


def installed_prefix(fingerprint: str, folder: str | Path | None = None) -> LearnedPrefix | None:
    """The learned prefix installed for the model of ``fingerprint`` (in ``folder``; by default
    :func:`installed_dir`, then :data:`PACKAGED_DIR`), or None; where a folder holds several
    for the model, the one installed last. Only the files' metadata is read until one matches;
    a file that cannot be read is skipped with a warning that names it. Read once per process
    and folder."""
    folders = (str(folder),) if folder is not None else (str(installed_dir()), str(PACKAGED_DIR))
    return _installed(fingerprint, folders)


@functools.lru_cache(maxsize=16)
def _installed(fingerprint: str, folders: tuple[str, ...]) -> LearnedPrefix | None:
    from safetensors import SafetensorError, safe_open

    for folder in folders:  # the first folder with one wins; in it, the file installed last
        paths = sorted(Path(folder).glob("*.safetensors"), key=lambda p: (-p.stat().st_mtime, p.name))
        for path in paths:
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                if meta.get("format") == LEARNED_FORMAT and meta.get("fingerprint") == fingerprint:
                    return LearnedPrefix.load(path)
            except (OSError, ValueError, SafetensorError) as e:  # a damaged file must not stop every default
                log.warning("skipping %s: not a readable learned prefix (%s)", path, e)
    return None


__all__ = ["NEUTRAL_PASSAGES", "PACKAGED_DIR", "LearnedPrefix", "conditioning_kind", "install",
           "installed_dir", "installed_prefix", "neutral_text", "parse_conditioning", "passage_spec"]
