"""The index directory, owned by :class:`Index`: where its parts live (``kv/``, ``chroma/``,
``uploads/``, ``conditioning/``), its manifest (what the index was built with, and the commit
counter every process watches), the check that a path may hold an index, the ingest lock, and
the settings an index decides for whoever answers from it (conditioning, calibration, the
recompute default). Every layer that opens an index (the CLI, the server, the demo,
``measure/`` and both connectors) goes through :class:`Index`, so no one else builds its paths."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the classes are imported where they are used (this module stays light)
    from ..conditioning import LearnedPrefix
    from ..engine import PromptCache

log = logging.getLogger(__name__)

MANIFEST = "pcache-index.json"
FORMAT = "pcache-index-1"
#: the folder of an index's learned conditioning prefixes (``<hash>.safetensors``)
PREFIXES = "conditioning"
#: the index's folders: module states (the disk tier), the chroma database, the web app's uploads
KV, CHROMA, UPLOADS = "kv", "chroma", "uploads"


def check_index_dir(path: str | Path, create: bool = True) -> Path:
    """Validate an index directory before anything is loaded: it may be new, empty, or an
    index; never a file or a folder of other things (documents would get chroma/ and kv/)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"the index must be a directory, but {p} is a file")
    if p.is_dir():
        names = {c.name for c in p.iterdir()}
        ours = {MANIFEST, CHROMA, KV, ".ingest.lock", PREFIXES}
        if names and not (names & ours):
            raise ValueError(
                f"{p} holds other files and is not a pcache-rag index; point the index at a new or empty "
                f"directory (documents are given to ingest separately)"
            )
        if not create and not (names & {MANIFEST, CHROMA}):
            raise FileNotFoundError(f"{p} is not an index yet: run `pcache-rag ingest PATH... --index {p}` first")
    elif not create:
        raise FileNotFoundError(f"no index at {p}: run `pcache-rag ingest PATH... --index {p}` first")
    p.mkdir(parents=True, exist_ok=True)
    return p


def read_manifest(index_dir: Path, quiet: bool = False) -> dict:
    """The manifest of the index at ``index_dir`` (``{}`` if none, or unreadable: a warning
    unless ``quiet``)."""
    f = index_dir / MANIFEST
    if not f.exists():
        return {}
    try:
        m = json.loads(f.read_text(encoding="utf-8"))
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise ValueError("unknown format")
        return m
    except (ValueError, UnicodeDecodeError, OSError) as e:
        if not quiet:
            log.warning("index manifest %s is unreadable (%s); it is rewritten at the next ingest", f, e)
        return {}


class ManifestWatch:
    """Tells when any process committed to the index: every commit bumps the manifest's
    ``generation``. One ``stat`` per call; the file is parsed only when it changed."""

    def __init__(self, index_dir: Path, generation: int) -> None:
        self.index_dir = index_dir
        self.generation = generation  # the commit counter this process has seen
        self._stamp: tuple | None = None  # (mtime, size, inode) of the manifest last read

    def changed(self, force: bool = False) -> dict | None:
        """The manifest when its generation moved since last seen (or with ``force``), else None."""
        try:
            st = (self.index_dir / MANIFEST).stat()
            stamp: tuple | None = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = None
        if stamp == self._stamp and not force:
            return None  # the file is as last read: no JSON parse per question
        self._stamp = stamp
        m = read_manifest(self.index_dir, quiet=True)
        gen = int(m.get("generation", 0))
        if gen == self.generation and not force:
            return None
        self.generation = gen
        return m


def write_manifest(index_dir: Path, manifest: dict) -> None:
    """Replace the manifest atomically (readers see the old file or the new one, never half)."""
    tmp = index_dir / (MANIFEST + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, index_dir / MANIFEST)


def same_conditioning(a: str, b: str) -> bool:
    """Whether two conditioning specs encode alike (``"neutral"`` is ``"neutral:1"``)."""
    from ..conditioning import conditioning_kind, parse_conditioning

    ka, kb = conditioning_kind(a), conditioning_kind(b)
    if ka == kb == "neutral" or ka == kb == "none":
        return parse_conditioning(a) == parse_conditioning(b)
    return ka == kb and a == b


def prefix_path(index_dir: Path, spec: str) -> Path:
    """Where an index keeps the learned prefix of ``spec`` (``"learned:<hash>"``)."""
    return index_dir / PREFIXES / (spec.partition(":")[2] + ".safetensors")


def load_prefix(index_dir: Path, spec: str):
    """The index's learned prefix of ``spec``; a missing or damaged file is refused by name."""
    from ..conditioning import LearnedPrefix

    path = prefix_path(index_dir, spec)
    if not path.exists():
        raise FileNotFoundError(f"the index {index_dir} is encoded with conditioning={spec!r}, but its prefix "
                                f"{path} is missing; restore it, or re-run `pcache-rag calibrate --learn --index "
                                f"{index_dir}`")
    prefix = LearnedPrefix.load(path)
    if prefix.spec != spec:
        raise ValueError(f"{path} holds the prefix {prefix.spec}, not {spec}: the file was changed")
    return prefix


def ingest_lock(index_dir: Path):
    """An exclusive lock on the index for the length of an ingest (other processes wait);
    returns the held :class:`filelock.FileLock`."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(index_dir / ".ingest.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("another ingest holds %s; waiting for it", index_dir)
        lock.acquire()
    return lock


def built_settings(index_dir: Path, manifest: dict, chunk_tokens: int | None,
                   conditioning: str | LearnedPrefix | None) -> tuple[int, str]:
    """``(chunk_tokens, conditioning)`` for an index: what it was built with, or the asked or
    default ones for a new index; a different one for an index with chunks is refused.
    ``conditioning`` is a spec, None, or a :class:`~pcache_rag.conditioning.LearnedPrefix` learned
    elsewhere, which is copied into the index once accepted (its spec is returned)."""
    from ..conditioning import LearnedPrefix

    prefix = conditioning if isinstance(conditioning, LearnedPrefix) else None
    spec = conditioning.spec if isinstance(conditioning, LearnedPrefix) else conditioning
    built = manifest.get("chunk_tokens")
    if chunk_tokens is not None and built and manifest.get("chunks") and chunk_tokens != built:
        raise ValueError(
            f"the index {index_dir} was built with chunk_tokens={built}; ingest with "
            f"--chunk-tokens {built}, or use a new index directory for chunk_tokens={chunk_tokens}"
        )
    chunk_tokens = int(chunk_tokens or built or 512)
    # conditioned encoding: the index's own (an index from before it existed: none), or the
    # default for a new one; another one for an index with chunks is refused
    had = manifest.get("conditioning", "none" if manifest.get("chunks") else None)
    if spec is not None and had is not None and manifest.get("chunks") and \
            not same_conditioning(spec, had):
        raise ValueError(f"the index {index_dir} was encoded with conditioning={had!r}; use it, or a new "
                         f"index directory for conditioning={spec!r}")
    cond = spec if spec is not None else (had if had is not None else "default")
    if chunk_tokens < 16:
        raise ValueError("chunk_tokens must be at least 16")
    if prefix is not None:
        prefix.save(prefix_path(index_dir, prefix.spec))
    return chunk_tokens, cond


class Index:
    """An index directory: its paths, its manifest, and what it decides for an answer.

    ``Index(path)`` validates the path (:func:`check_index_dir`; ``create=False``: it must be an
    index already) and loads nothing. :meth:`engine` builds the :class:`~pcache_rag.PromptCache`
    whose disk tier is this index's ``kv/`` folder; :class:`~pcache_rag.CachedRAG` and the
    connectors take an ``Index`` (or its path) and ask it for the rest.
    """

    def __init__(self, path: str | Path | Index, create: bool = True) -> None:
        #: the index directory (absolute, ``~`` expanded)
        self.path: Path = path.path if isinstance(path, Index) else check_index_dir(path, create).absolute()

    def __repr__(self) -> str:
        return f"Index({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    # ------------------------------------------------------------------ where its parts live

    @property
    def kv_dir(self) -> Path:
        """The disk tier of the module states (``<index>/kv``)."""
        return self.path / KV

    @property
    def chroma_dir(self) -> Path:
        """The chroma database (``<index>/chroma``)."""
        return self.path / CHROMA

    @property
    def upload_dir(self) -> Path:
        """Where the web app keeps uploaded files (``<index>/uploads``)."""
        return self.path / UPLOADS

    def prefix_path(self, spec: str) -> Path:
        """Where the index keeps the learned prefix of ``spec`` (``"learned:<hash>"``)."""
        return prefix_path(self.path, spec)

    # ------------------------------------------------------------------ the manifest

    def manifest(self, quiet: bool = False) -> dict:
        """The manifest as on disk now (``{}`` if none; see :func:`read_manifest`)."""
        return read_manifest(self.path, quiet)

    def write_manifest(self, manifest: dict) -> None:
        """Replace the manifest atomically."""
        write_manifest(self.path, manifest)

    def watch(self, generation: int) -> ManifestWatch:
        """A watch on the manifest's commit counter, from ``generation`` on."""
        return ManifestWatch(self.path, generation)

    def lock(self):
        """The ingest lock, held (see :func:`ingest_lock`)."""
        return ingest_lock(self.path)

    # ------------------------------------------------------------------ what it decides

    def settings(self, manifest: dict, chunk_tokens: int | None,
                 conditioning: str | LearnedPrefix | None) -> tuple[int, str]:
        """``(chunk_tokens, conditioning)`` for this index (see :func:`built_settings`)."""
        return built_settings(self.path, manifest, chunk_tokens, conditioning)

    def load_prefix(self, spec: str) -> LearnedPrefix:
        """The index's learned prefix of ``spec``; a missing or damaged file is refused by name."""
        return load_prefix(self.path, spec)

    def conditioning(self) -> str | LearnedPrefix:
        """The conditioning the index's chunks are encoded under, for a component that answers
        from it: its learned prefix (read from its own file), its spec, ``"none"`` for an index
        from before conditioning, or ``"default"`` for one with nothing in it yet."""
        from ..conditioning import conditioning_kind

        m = self.manifest()
        cond = m.get("conditioning") or ("none" if m.get("chunks") else "default")
        return self.load_prefix(cond) if cond != "default" and conditioning_kind(cond) == "learned" else cond

    @staticmethod
    def calibration(asked: str | None, manifest: dict, fingerprint: str) -> tuple[str | None, str]:
        """``(the calibration answers use, where it comes from)``: ``asked``, or with ``"auto"``
        the manifest's own when it was chosen for the model of ``fingerprint``."""
        from .calibrate import resolve_calibration

        return resolve_calibration(asked, manifest, fingerprint)

    @staticmethod
    def recompute(asked: str | None, calibration: str | None, structured: bool = False) -> str | None:
        """The recompute policy answers use (None: the engine's default); ``"auto"`` resolves
        against the calibration in force, and for ``structured`` answers
        (:func:`pcache_rag.recompute.resolve_auto`)."""
        from ..recompute import resolve_auto

        rc = resolve_auto(asked, calibration, structured)
        return None if rc is None else str(rc)

    # ------------------------------------------------------------------ the engine over its states

    def engine(self, model=None, tokenizer=None, *, disk_budget: int | None = None, kv_url: str | None = None,
               **engine_args) -> PromptCache:
        """A :class:`~pcache_rag.PromptCache` whose states live in this index: host memory, then
        ``kv/`` on disk (bounded by ``disk_budget`` bytes), then the Redis/Valkey server at
        ``kv_url`` when given. ``model``: a loaded model (with its ``tokenizer``), or a model
        folder or ``.gguf`` file, or None for the embedded default; ``engine_args`` go to
        :class:`~pcache_rag.PromptCache` (``encoding``, ``store_dtype``, ``decode_weights``...).
        Generated tokens read bf16 decode weights unless ``decode_weights`` says otherwise
        (:data:`~pcache_rag.models.fast_decode.RAG_DECODE_WEIGHTS`; ``"fp32"`` keeps the model's),
        and so do the rows computed over cached states unless ``query_weights="fp32"``."""
        from ..default_model import load_model
        from ..engine import PromptCache
        from ..store import default_store

        if model is None or isinstance(model, (str, Path)):
            if tokenizer is not None:
                raise ValueError("a tokenizer goes with a loaded model, not with a model path")
            model, tokenizer = load_model(None if model is None else str(model),
                                          device=engine_args.pop("device", None), dtype=engine_args.pop("dtype", None))
        device = next(model.parameters()).device
        store = default_store(device, self.kv_dir, disk_budget=disk_budget, kv_url=kv_url)
        from ..models.fast_decode import RAG_DECODE_WEIGHTS, RAG_QUERY_WEIGHTS

        if engine_args.get("decode_weights") is None:
            engine_args["decode_weights"] = RAG_DECODE_WEIGHTS
        if engine_args.get("query_weights") is None and engine_args["decode_weights"] == "bf16":
            engine_args["query_weights"] = RAG_QUERY_WEIGHTS
        return PromptCache(model, tokenizer, store=store, cache_dir=str(self.kv_dir), **engine_args)
