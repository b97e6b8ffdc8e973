"""The three distributions as a user gets them: each built (sdist and wheel) and checked with
``twine check --strict``, each connector declaring its dependency on ``pcache-rag``; the wheels
installed into a clean virtual environment with no checkout on its path; and the README's
LlamaIndex and LangChain quick starts run there, in a folder of their own.

The clean environment takes its third-party dependencies (torch, transformers, the frameworks)
from this one's site-packages, added as a plain path: nothing is downloaded, and the checkout's
editable installs (``.pth`` hooks in that folder) are not read, so ``pcache_rag`` and both
connectors can only come from the wheels just built. The test checks where each one is imported
from.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = {"pcache_rag": ROOT, "langchain_pcache": ROOT / "connectors" / "langchain-pcache",
                 "llama_index_llms_pcache": ROOT / "connectors" / "llama-index-llms-pcache"}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    pytest.importorskip("build", reason="the `build` package (make setup installs it with the dev extra)")
    out = tmp_path_factory.mktemp("dist")
    for src in DISTRIBUTIONS.values():
        r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(out),
                            str(src)], capture_output=True, text=True)
        assert r.returncode == 0, f"building {src.name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return out


def _wheel(dist: Path, name: str) -> Path:
    (whl,) = dist.glob(f"{name}-*.whl")
    return whl


def test_each_distribution_builds_and_passes_twine_check(dist):
    pytest.importorskip("twine", reason="the `twine` package (make setup installs it with the dev extra)")
    for name in DISTRIBUTIONS:
        assert len(list(dist.glob(f"{name}-*.whl"))) == 1 and len(list(dist.glob(f"{name}-*.tar.gz"))) == 1, name
    r = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, sorted(dist.iterdir()))],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("langchain_pcache", "llama_index_llms_pcache"):
        with zipfile.ZipFile(_wheel(dist, name)) as z:
            meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        assert re.search(r"^Requires-Dist: pcache-rag\b", meta, re.M), f"{name} does not declare pcache-rag"
    with zipfile.ZipFile(_wheel(dist, "pcache_rag")) as z:  # what the package needs at run time travels with it
        names = z.namelist()
    assert any(n.endswith("models/kernels.c") for n in names) and any("/data/learned/" in n for n in names)
    assert any(n.endswith("serve/static/index.html") for n in names)


def _block(readme: Path, title: str) -> str:
    text = readme.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(title):], re.S).group(1)


def test_the_wheels_install_into_a_clean_venv_and_the_quick_starts_run(dist, tmp_path, smol_dir):
    venv = tmp_path / "clean"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # a path: its .pth unread
    wheels = [str(_wheel(dist, name)) for name in DISTRIBUTIONS]
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", *wheels],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    work = tmp_path / "work"
    (work / "my-docs").mkdir(parents=True)
    (work / "my-docs" / "gates.md").write_text(
        "The access code for the north gate is 4417.\n\nThe south gate is closed for repairs until May.\n")
    (work / "my-docs" / "ferry.md").write_text("The ferry to the island leaves at 07:45 every morning.\n")
    home = tmp_path / "home"  # its own states; the converted model is this machine's (no second conversion)
    home.mkdir()
    (home / smol_dir.parent.name).symlink_to(smol_dir.parent)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PCACHE_RAG_HOME"] = str(home)

    where = subprocess.run([str(py), "-c", "import pcache_rag, langchain_pcache, llama_index.llms.pcache as li; "
                            "print(pcache_rag.__file__, langchain_pcache.__file__, li.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr
    assert all(p.startswith(str(venv)) for p in where.stdout.split()), where.stdout
    for title in ("## LlamaIndex", "## LangChain"):
        script = work / f"{title[3:].lower()}.py"
        script.write_text(_block(ROOT / "README.md", title))
        r = subprocess.run([str(py), str(script)], cwd=work, env=env, capture_output=True, text=True)
        assert r.returncode == 0, f"{title}: {r.stderr[-3000:]}"
        assert "4417" in r.stdout, (title, r.stdout)
    cli = subprocess.run([str(venv / "bin" / "pcache-rag"), "--help"], cwd=work, env=env, capture_output=True, text=True)
    assert cli.returncode == 0 and "serve" in cli.stdout
