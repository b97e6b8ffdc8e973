"""``import pcache_rag`` before torch shortens OpenMP's idle spin; after torch, it says it cannot.

Each case runs in a fresh interpreter: libgomp reads ``GOMP_SPINCOUNT`` once, when torch loads it.
"""

import os
import subprocess
import sys

import pytest

PROBE = r"""
import logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
if sys.argv[1] == "torch-first":
    import torch  # noqa: F401
import pcache_rag
from pcache_rag.engine.threads import check_spin
print("HOW", pcache_rag.openmp.SPIN_SET_BY, os.environ.get("GOMP_SPINCOUNT"))
check_spin(); check_spin()
"""


def _probe(order: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", PROBE, order], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_before_torch_sets_the_short_spin():
    out = _probe("pcache-first")
    assert "HOW pcache_rag 1000" in out
    assert "LOG" not in out


@pytest.mark.parametrize("var,value", [("GOMP_SPINCOUNT", "300000"), ("OMP_WAIT_POLICY", "ACTIVE")])
def test_a_users_setting_is_kept(var, value):
    out = _probe("pcache-first", **{var: value})
    assert "HOW user" in out
    if var == "GOMP_SPINCOUNT":
        assert "HOW user 300000" in out
    assert "LOG" not in out


def test_torch_first_is_warned_about_once_by_name():
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("this torch does not run on OpenMP, so its spin count is not ours to set")
    out = _probe("torch-first")
    assert "HOW too late None" in out
    assert out.count("LOG ") == 1 and "GOMP_SPINCOUNT" in out
