"""The engine's value types: what a prefill and a generation return, and the named strings.

Nothing here computes; every other part of :mod:`pcache_rag.engine` and its callers share
these shapes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from ..models.attention import CalibratedSpan

#: how a module's tokens are encoded: alone (the paper) or after the schema's preamble
Encoding = Literal["isolated", "preamble"]
ENCODINGS: tuple[Encoding, ...] = ("isolated", "preamble")
DEFAULT_ENCODING: Encoding = "preamble"  # measured better than "isolated": `pcache-rag eval quality`, docs/guide.md
#: why a generation ended: ``max_new_tokens`` reached, the model's end token, or a stop string
FinishReason = Literal["length", "eos", "stop"]


class ContextOverflowError(ValueError):
    """A prompt needs more positions than the model takes (not a PML error: no PML may be involved)."""


class StalledError(RuntimeError):
    """A request in the continuous batch was failed by its watchdog: the batch made no step for
    longer than its stall timeout (:mod:`.watchdog`), so its rows and its caller were freed."""


@dataclass(slots=True)
class PrefillResult:
    """The outcome of prefilling one prompt against cached states."""

    logits: torch.Tensor  # (vocab,) next-token logits after the last prompt token
    input_ids: torch.Tensor  # (T,) cache order: imported units, arguments, uncached tokens
    position_ids: torch.Tensor  # (T,) the position id of each of those tokens
    spans: list[tuple[str, int, int]]  # (label, start, end) ranges of input_ids
    cached_tokens: int  # tokens whose states came from the cache
    computed_tokens: int  # tokens computed by this prefill
    copied_tokens: int = 0  # cached tokens copied into the workspace (the rest were resident)
    recomputed_tokens: int = 0  # context tokens recomputed on top of the cache (counted in computed_tokens)
    assemble_s: float = 0.0  # seconds spent placing cached states
    forward_s: float = 0.0  # seconds in the forward pass
    calibrated: CalibratedSpan | None = None  # the keys decoding attends to with a calibration


@dataclass(slots=True)
class GenerationOutput:
    """A finished generation: the one answer record of every path (the engine's own streams, an
    Assembler's prompt of documents, the batch, the connectors, the server). ``cached_tokens`` +
    ``computed_tokens`` is the whole prompt (:attr:`prompt_tokens`); an Assembler answer counts a
    document it encoded for this prompt as computed (and in ``encoded_tokens``), not as cached."""

    text: str  # decoded new text (stop string excluded)
    token_ids: list[int]  # generated token ids
    ttft_s: float  # seconds from the call to the first sampled token
    cached_tokens: int  # prompt tokens read from stored states as they were
    computed_tokens: int  # prompt tokens computed by this call (new, recomputed, encoded now)
    total_s: float = 0.0
    finish_reason: FinishReason = "length"
    recomputed_tokens: int = 0  # context tokens recomputed (included in computed_tokens)
    decode_batch: int = 1  # the most sequences it decoded with in one forward (1: alone)
    unbatched: str = ""  # why it decoded alone with batching on (ALiBi, a model outside pcache_sdpa)
    encoded_tokens: int = 0  # prefix and document tokens encoded by this call, stored for the next prompts
    documents: int = 0  # documents the prompt held (an Assembler's prompt; 0 for an engine prompt)
    uncached: tuple[str, ...] = ()  # why text that could have been a document was computed

    @property
    def prompt_tokens(self) -> int:
        """Every token of the prompt: cached and computed."""
        return self.cached_tokens + self.computed_tokens

    def usage(self) -> dict:
        """What the answer cost, in the keys every answer's usage has (the server's ``usage``)."""
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "computed_tokens": self.computed_tokens, "recomputed_tokens": self.recomputed_tokens,
                "output_tokens": len(self.token_ids), "finish_reason": self.finish_reason,
                "documents": self.documents}

    def stats(self) -> dict:
        """:meth:`usage` with the time to first token, the tokens encoded now and why text was not
        cached (the connectors' response metadata)."""
        return {"ttft_s": self.ttft_s, **self.usage(), "encoded_tokens": self.encoded_tokens,
                "uncached": list(self.uncached)}

    def __getattr__(self, name: str):
        """The names an Assembler answer had as a ``CachedOutput`` (before 0.2), for one release."""
        new = _CACHED_OUTPUT_NAMES.get(name)
        if new is None:
            raise AttributeError(f"'GenerationOutput' object has no attribute {name!r}")
        warnings.warn(f"an answer's {name!r} (CachedOutput, before 0.2) is deprecated: use "
                      f"{'the answer itself' if new == 'self' else repr(new)} (removed in the next release)",
                      DeprecationWarning, stacklevel=2)
        return self if new == "self" else getattr(self, new)


#: a CachedOutput's names and their GenerationOutput fields (``output`` was the inner record)
_CACHED_OUTPUT_NAMES = {"output": "self", "cache_read": "cached_tokens", "computed": "computed_tokens",
                        "encoded": "encoded_tokens"}


@dataclass(slots=True)
class SchemaReport:
    """What ``add_schema`` did: units encoded now vs found in the store."""

    name: str
    encoded: int
    loaded: int
    tokens: int
    seconds: float


_STORE_DTYPES = {"int8": torch.int8, "float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def store_dtype(d: torch.dtype | str | None) -> torch.dtype | None:
    """``None``, a torch dtype or its name, checked against the dtypes states can be stored in."""
    got = d if d is None or isinstance(d, torch.dtype) else _STORE_DTYPES.get(str(d).lower())
    if got is None and d is not None or got is not None and got not in _STORE_DTYPES.values():
        raise ValueError(f"store_dtype must be one of {sorted(set(_STORE_DTYPES))}, not {d!r}")
    return got


def vars_of(obj: object) -> dict:
    """A stats object's fields as a dict (slotted dataclasses have no ``__dict__``)."""
    slots = getattr(obj, "__slots__", None)
    return {k: getattr(obj, k) for k in slots} if slots is not None else dict(vars(obj))
