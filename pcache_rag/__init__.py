"""pcache-rag: Prompt Cache (modular attention reuse) for retrieval-augmented generation.

Reusable prompt pieces are declared as modules in a PML schema; their attention
states are computed once; a prompt that imports them computes only its new
tokens. See README.md for the two commands that run everything.
"""

from .engine import ContextOverflowError, GenerationOutput, PrefillResult, PromptCache
from .models import UnsupportedModelError
from .pml import PMLError, escape

__version__ = "0.1.0"
__all__ = ["PromptCache", "PMLError", "PrefillResult", "GenerationOutput", "UnsupportedModelError", "escape",
           "ContextOverflowError"]
