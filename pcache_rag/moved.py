"""Names that moved to another object, still reached at their old place for one release.

``PromptCache`` and ``CachedRAG`` kept one-line methods that only forwarded to their parts;
those moved to the parts (``pc.encoder.encode``, ``rag.upkeep.prune``...). A class lists what
moved and calls :func:`moved` from its ``__getattr__``: the old name answers with the new
home's attribute and a ``DeprecationWarning`` that names it.
"""

from __future__ import annotations

import warnings
from typing import Any


def moved(obj: Any, name: str, homes: dict[str, str], shown: str) -> Any:
    """``obj``'s attribute at ``homes[name]`` (``"part.attribute"``), with a DeprecationWarning
    naming it under ``shown`` (``"pc"``, ``"rag"``); an :class:`AttributeError` for any name
    that did not move."""
    home = homes.get(name)
    if home is None:
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")
    warnings.warn(f"{type(obj).__name__}.{name} moved: use {shown}.{home} (removed in the next release)",
                  DeprecationWarning, stacklevel=3)
    owner, attr = home.split(".")
    return getattr(getattr(obj, owner), attr)
