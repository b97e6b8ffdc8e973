import os
import sys

import pytest

import pcache_rag  # noqa: F401  # before torch, as a user would: it sets OpenMP's short spin

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


def pytest_collection_modifyitems(config, items):
    """A test class may run part of an ecosystem's standard suite: ``standard_tests_only``
    (name prefixes to keep) or ``standard_tests_except`` (prefixes to leave out). What is
    left out is deselected (reported as such), not skipped: it runs in the sibling class."""
    keep, drop = [], []
    for item in items:
        cls = getattr(item, "cls", None)
        name = getattr(item, "originalname", item.name)
        only = getattr(cls, "standard_tests_only", None)
        out = getattr(cls, "standard_tests_except", ())
        if (only is not None and not name.startswith(tuple(only))) or (out and name.startswith(tuple(out))):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
