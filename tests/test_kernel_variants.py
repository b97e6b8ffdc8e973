"""The decode kernels on every instruction set: each variant of ``kernels.c`` (AVX-512, AVX2,
NEON, portable C) computes the same bits on the same inputs, at any thread count; the fused
step decodes to the same logits whichever variant runs it; the variant is picked from what the
CPU reports (``PCACHE_RAG_KERNELS`` forces one, refused by name where the CPU lacks it); and the
thread count follows the CPUs that other processes leave free."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pcache_rag import PromptCache
from pcache_rag.models import adapter_for, kernels
from pcache_rag.models.decode_step import fused_step

from helpers import tiny_model

DRIVER = Path(__file__).parent / "native" / "kernels_driver.c"
X86 = [v for v in ("avx512", "avx2", "portable") if not kernels.runs_here(v)]


def _driver(cc: str, variant: str, out: Path) -> Path:
    exe = out / f"driver-{variant}"
    flags = [f for f in kernels.FLAGS if f not in ("-shared", "-fPIC")]  # the library's flags, as an executable
    r = subprocess.run([cc, *flags, *kernels.VARIANTS[variant], str(DRIVER), "-o", str(exe), "-lm"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return exe


def _run(cmd: list[str]) -> list[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("variant ") and len(lines) == 14, lines[:2]
    return lines


@pytest.fixture(scope="module")
def drivers(tmp_path_factory) -> dict[str, Path]:
    """Each variant this CPU runs, built once into a driver (compiles of 8-44 s here, the portable
    one the longest; the thread count is the driver's argument)."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on PATH")
    out = tmp_path_factory.mktemp("drivers")
    with ThreadPoolExecutor(len(X86)) as pool:  # the compiles run side by side (each is one process)
        return dict(zip(X86, pool.map(lambda v: _driver("cc", v, out), X86)))


@pytest.fixture(scope="module")
def reference(drivers) -> list[str]:
    """The first variant's output lines (the CPU's best), at the default thread count."""
    return _run([str(drivers[X86[0]])])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_variant_this_cpu_runs_computes_the_same_bits(drivers, reference, threads):
    assert reference[0] == f"variant {X86[0]}"
    for v in X86:
        got = _run([str(drivers[v]), str(threads)])
        assert got[0] == f"variant {v}"
        diff = [a.split()[0] for a, b in zip(reference[1:], got[1:]) if a != b]
        assert not diff, f"{v} at {threads} threads differs from {X86[0]} in {diff}"


def test_the_neon_variant_computes_the_same_bits_under_qemu(reference, tmp_path):
    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cc is None or qemu is None:
        pytest.skip("no aarch64 cross compiler or qemu-aarch64 (scripts/install-system-deps.sh installs them)")
    got = _run([qemu, "-L", "/usr/aarch64-linux-gnu", str(_driver(cc, "neon", tmp_path)), "2"])
    assert got[0] == "variant neon"
    diff = [a.split()[0] for a, b in zip(reference[1:], got[1:]) if a != b]
    assert not diff, f"neon differs from {X86[0]} in {diff}"


def test_a_variant_can_differ_from_the_reference(reference):
    """The comparison above can fail: one flipped bit in one output is seen."""
    line = reference[1].split()
    line[3] = f"{int(line[3], 16) ^ 1:08x}"
    assert " ".join(line) != reference[1]


def _logits(smol_tok, fmt: str, steps: int = 5) -> list[torch.Tensor]:
    model = tiny_model("qwen2", len(smol_tok), seed=3)
    step, why = fused_step(model, adapter_for(model), smol_tok, fmt)
    assert step is not None and step.kernels == "c", why or step.kernels_why_not
    from test_decode_step import TEXTS, _prefilled

    ids = torch.tensor(smol_tok(TEXTS[1])["input_ids"])
    _, cache, lg = _prefilled(model, ids, steps + 1)
    out, tok = [], int(lg.argmax())
    for p in range(ids.numel(), ids.numel() + steps):
        got = step(tok, p, cache.layers)
        out.append(got.clone())
        tok = int(got.argmax())
    return out


def _fresh(monkeypatch, **env: str) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(kernels, "_libs", {})


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_the_fused_step_decodes_the_same_logits_on_every_variant_and_thread_count(fmt, smol_tok, monkeypatch):
    # each variant's library comes from the user's cache home, kept under the hash of its source and
    # flags: a run builds only the variants whose source changed since the last
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on PATH")
    runs = {}
    for v in X86:
        for n in ("1", "2"):
            _fresh(monkeypatch, PCACHE_RAG_KERNELS=v, PCACHE_RAG_DECODE_THREADS=n)
            runs[v, n] = _logits(smol_tok, fmt)
    first = next(iter(runs.values()))
    for k, got in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(first, got)), k


def test_the_variant_follows_the_cpu_and_is_forced_by_name(smol_tok, monkeypatch, tmp_path, caplog):
    assert kernels.cpu_variant("fpu sse2 avx avx2 fma avx512f avx512bw", "x86_64") == "avx512"
    assert kernels.cpu_variant("fpu sse2 avx avx2 fma", "x86_64") == "avx2"
    assert kernels.cpu_variant("fpu sse2 avx", "x86_64") == "portable"
    assert kernels.cpu_variant("fp asimd evtstrm", "aarch64") == "neon"
    assert kernels.cpu_variant("", "riscv64") == "portable"
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on PATH")
    monkeypatch.setenv("PCACHE_RAG_HOME", str(tmp_path))
    _fresh(monkeypatch, PCACHE_RAG_KERNELS="neon" if X86[0] != "neon" else "avx512")
    assert kernels.load() is None and "this CPU runs" in kernels.why_not()
    model = tiny_model("llama", len(smol_tok), seed=7)
    pc = PromptCache(model, smol_tok, encoding="isolated", store_dtype=None)
    assert "torch kernels" in pc.core.decode_path and "this CPU runs" in pc.core.decode_path
    _fresh(monkeypatch, PCACHE_RAG_KERNELS="avx2")
    if "avx2" in X86:
        pc = PromptCache(tiny_model("llama", len(smol_tok), seed=7), smol_tok, encoding="isolated", store_dtype=None)
        assert pc.core.decode_path == "fused fp32 step (C kernels, avx2)"
        assert list((tmp_path / "kernels").glob("pcache-kernels-avx2-*.so"))
    _fresh(monkeypatch, PCACHE_RAG_KERNELS="avx3")
    with caplog.at_level("WARNING", logger=kernels.__name__):
        assert kernels.wanted() == X86[0]
    assert "'avx3' names no kernel variant" in caplog.text
    _fresh(monkeypatch, PCACHE_RAG_KERNELS="")
    monkeypatch.delenv("PCACHE_RAG_KERNELS")
    lib = kernels.load()
    assert lib is not None and lib.pc_variant().decode() == X86[0]


def _stat(path: Path, busy: list[int], idle: list[int]) -> None:
    total = f"cpu  {sum(busy)} 0 0 {sum(idle)} 0 0 0 0 0 0\n"
    path.write_text(total + "".join(f"cpu{i} {b} 0 0 {d} 0 0 0 0 0 0\n" for i, (b, d) in enumerate(zip(busy, idle))))


def test_the_thread_count_follows_the_cpus_other_processes_leave_free(tmp_path, monkeypatch):
    monkeypatch.delenv("PCACHE_RAG_DECODE_THREADS", raising=False)
    stat, clock, cpu = tmp_path / "stat", [100.0], [5.0]
    monkeypatch.setattr(kernels.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(kernels.time, "process_time", lambda: cpu[0])
    free = kernels.FreeCpus(interval=0.25, stat=str(stat))
    free.cpus, free.hz, free._torch = [0, 1, 2, 3], 100, 4
    _stat(stat, [0, 0, 0, 0], [0, 0, 0, 0])
    assert free() == 4, "no history yet: the cap"
    # one second later: the four CPUs were busy 3.0 s in all, 1.0 s of it ours -> others 2 CPUs
    clock[0], cpu[0] = 101.0, 6.0
    _stat(stat, [75, 75, 75, 75], [25, 25, 25, 25])
    assert free() == 2 and free.others == pytest.approx(2.0)
    clock[0] += 0.1
    _stat(stat, [100, 100, 100, 100], [0, 0, 0, 0])
    assert free() == 2, "within the interval the count is kept"
    # the next second: every CPU busy, none of it ours -> one thread, never none
    clock[0], cpu[0] = 102.0, 6.0
    _stat(stat, [175, 175, 175, 175], [25, 25, 25, 25])
    assert free() == 1
    # quiet again: only our own time
    clock[0], cpu[0] = 103.0, 7.0
    _stat(stat, [200, 200, 200, 200], [100, 100, 100, 100])
    assert free() == 4
    monkeypatch.setenv("PCACHE_RAG_DECODE_THREADS", "3")
    assert free() == 3, "fixed by the environment"
    free.stat = str(tmp_path / "missing")
    monkeypatch.delenv("PCACHE_RAG_DECODE_THREADS")
    clock[0] += 1
    assert free() == 4, "no /proc/stat: the cap"


def test_a_step_gives_the_threads_team_size_back(smol_tok, monkeypatch):
    """The step's own count (here fixed at 1) holds for the step only: a prefill after it in the
    same thread runs on the thread's own team size, since torch's products round differently on
    another count (a (7, 576) x (576, 1536) product differs in its last bits between 1 and 2)."""
    monkeypatch.setenv("PCACHE_RAG_DECODE_THREADS", "1")
    model = tiny_model("llama", len(smol_tok), seed=7)
    step, why = fused_step(model, adapter_for(model), smol_tok, "fp32")
    assert step is not None and step.kernels == "c", why or step.kernels_why_not
    from test_decode_step import TEXTS, _prefilled

    ids = torch.tensor(smol_tok(TEXTS[0])["input_ids"])
    _, cache, lg = _prefilled(model, ids, 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        step(int(lg.argmax()), ids.numel(), cache.layers)
        assert step.threads == 1, "the step ran on the fixed count"
        assert torch.get_num_threads() == 2, "and the thread's team size came back"
    finally:
        torch.set_num_threads(before)
