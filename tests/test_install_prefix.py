"""``pcache-rag install-prefix``: a model's conditioning prefix is learned once by the eval's
label-free procedure and installed in ``$PCACHE_RAG_HOME/learned``, where it becomes that
model's RAG default; a second run keeps it. On a tiny random model saved as a local folder,
with few prompts and steps (the real one takes about 50 minutes on two cores)."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import tiny_model
from pcache_rag import PromptCache
from pcache_rag.cli import main
from pcache_rag.conditioning import LearnedPrefix, install, installed_dir, installed_prefix
from pcache_rag.docmodules import Assembler
from pcache_rag.measure.quality import install_prefix


@pytest.fixture(scope="module")
def model_dir(smol_tok, tmp_path_factory):
    model = tiny_model("llama", len(smol_tok), seed=9)
    with torch.no_grad():  # sharper attention and logits: conditioning moves the next-token law measurably
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(4.0)
        model.lm_head.weight.mul_(30.0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    smol_tok.save_pretrained(folder)
    return folder


def test_install_prefix_learns_once_and_it_becomes_the_default(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PCACHE_RAG_HOME", str(tmp_path / "home"))
    logged: list[str] = []
    path, rep = install_prefix(str(model_dir), steps=16, train=4, val=4, progress=False, log=logged.append)
    assert rep is not None and rep.improved and rep.kl_learned < 0.7 * rep.kl_init, rep.lines()
    assert path == installed_dir() / f"{model_dir.name}.safetensors" and path.exists()
    assert LearnedPrefix.load(path).spec == rep.prefix.spec
    assert any(f"installed {rep.prefix.spec}" in line for line in logged)
    # another process loading the same folder finds it by the model's fingerprint, as its default
    from pcache_rag.default_model import load_model

    m, tok = load_model(model_dir)
    pc = PromptCache(m, tok)
    assert installed_prefix(pc.fingerprint).spec == rep.prefix.spec
    assert Assembler(pc).conditioning == rep.prefix.spec
    # a second run keeps the installed one, from the command line too
    assert main(["install-prefix", "--model", str(model_dir), "--steps", "4"]) == 0
    assert f"{rep.prefix.spec} is already installed" in capsys.readouterr().out
    assert LearnedPrefix.load(path).spec == rep.prefix.spec
    # several files for one model (a prefix installed again, under another name): the one
    # installed last is in force, whatever the names' order
    other = LearnedPrefix(rep.prefix.embeds + 0.01, {"fingerprint": pc.fingerprint})
    install(other, installed_dir() / "zz-older.safetensors")
    os.utime(installed_dir() / "zz-older.safetensors", (1, 1))  # installed long ago
    install(LearnedPrefix.load(path), path)
    assert installed_prefix(pc.fingerprint).spec == rep.prefix.spec
    install(other, installed_dir() / "aa-newer.safetensors")
    assert installed_prefix(pc.fingerprint).spec == other.spec
