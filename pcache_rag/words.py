"""Text to words for lexical matching, one definition for the whole package.

BM25 retrieval (:mod:`pcache_rag.rag.lexical`) and the ``match`` recompute policy
(:mod:`pcache_rag.recompute`) both compare a question's words with a text's. Both use
``bm25s``'s tokenizer: lower case, English stopwords dropped, and the Snowball English
stemmer from PyStemmer where it is installed (a dependency; without it, words match
unstemmed and the log says so once).
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)


def bm25s():
    """The ``bm25s`` module, its logger quietened (it sets itself to DEBUG on import)."""
    import bm25s as module

    logging.getLogger("bm25s").setLevel(logging.WARNING)
    return module


@functools.cache
def stemmer():
    """The Snowball English stemmer, or ``None`` where PyStemmer is not installed."""
    try:
        import Stemmer  # PyStemmer
    except ImportError:
        log.info("PyStemmer is not installed: lexical matching compares words unstemmed")
        return None
    return Stemmer.Stemmer("english")


def tokenize(texts: list[str]) -> list[list[str]]:
    """Each text's words (stemmed, stopwords dropped), in order."""
    if not texts:
        return []
    return bm25s().tokenize(texts, stopwords="en", stemmer=stemmer(), show_progress=False, return_ids=False)
