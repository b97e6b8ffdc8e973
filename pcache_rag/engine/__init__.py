"""The engine: modular attention reuse over a Hugging Face causal LM.

``prompt_cache`` is the facade over ``core`` (adapter, workspace, prefill, decode) and ``dispatch`` (alone or in the batch); ``schemas`` (registry and planning), ``encoder`` (encoding
and the context memo), ``prefill`` (assembly and the forward), ``mask`` (the pure mask
builder), ``decode`` (sampling, stop strings, :class:`Generation`) and ``types`` are its parts.
"""

from .core import Parts
from .decode import Generation, SamplingParams
from .prompt_cache import PromptCache
from .types import (
    DEFAULT_ENCODING,
    ENCODINGS,
    ContextOverflowError,
    Encoding,
    FinishReason,
    GenerationOutput,
    PrefillResult,
    SchemaReport,
    StalledError,
)

__all__ = ["PromptCache", "Parts", "Generation", "SamplingParams", "GenerationOutput", "PrefillResult", "SchemaReport",
           "ContextOverflowError", "StalledError", "Encoding", "FinishReason", "ENCODINGS", "DEFAULT_ENCODING"]
