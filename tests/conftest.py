import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def smol_dir():
    """The embedded model converted to a plain folder (converted once per machine)."""
    from pcache_rag.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def smol_tok(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def smol(smol_dir):
    from pcache_rag import PromptCache

    from helpers import watch

    return watch(PromptCache.from_pretrained(str(smol_dir)))
