"""The fused decode step's CPU kernels (``kernels.c``): compiled once per machine, loaded
with ctypes, called with checked tensors.

Why C: see the top of ``kernels.c`` (the library kernels stream a one-token decode's small
matrices at half this machine's bandwidth). Why ctypes and a plain C file rather than a torch
C++ extension: it needs no torch headers, no ninja and no Python headers, compiles in under a
second, and a call costs about a microsecond.

**Which build.** One variant per instruction set (:data:`VARIANTS`: ``avx512``, ``avx2``
with FMA, ``neon``, ``portable`` C), picked at run time from what the CPU reports
(:func:`cpu_variant`), not from ``-march=native``: a wheel or a shared home directory built on
one machine still runs the right code on the next. ``PCACHE_RAG_KERNELS`` chooses: ``0`` no C
kernels, a variant's name that variant (refused by name if this CPU cannot run it; ``avx2`` on
an AVX-512 machine shows the AVX2 path there), anything else the CPU's best. Every variant sums
in the same fixed lane order, so each computes the same bits (``kernels.c``'s header).

Each variant's shared library is built with the system C compiler (``$CC``, else ``cc``) into
``$PCACHE_RAG_HOME/kernels/``, named by a hash of the source, the variant and its flags. No
compiler, a failed build or a failed load leaves :func:`load` returning ``None`` with the
reason in :func:`why_not`; the fused step then uses oneDNN's kernels (said in its report),
never a silent change of results.

**How many threads.** The kernels' parallel loops run on :func:`threads` threads, refitted at
most every :data:`REFIT_S` seconds to the CPUs this process may use less the CPU time other
processes took over the last interval (``/proc/stat``; :class:`FreeCpus`). On a busy machine a
step then runs on the cores it can actually get instead of waiting at every loop's barrier for
a thread the scheduler has parked; the split of work never depends on the count, so neither
does a result. For the step's duration (:class:`Team`) the count is also the calling thread's
OpenMP team size (torch and these kernels share one libgomp), so the step's torch ops follow
it; on a busy machine they cost more than the kernels when they do not (AVX-512, two busy
processes: 59-67 ms a token with torch's ops on two threads, 24 ms on the fitted one). The team
size is given back after the step: torch's products round differently on another count, and a
prefill in the same thread must not depend on the load. The most it uses is torch's thread
count when this module was imported, and at most the CPUs this process may run on;
``PCACHE_RAG_DECODE_THREADS=N`` fixes the count.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import platform
import tempfile
import threading
import time
from pathlib import Path

import torch

from ..fsutil import cache_home

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
#: flags every variant is built with (-ffp-contract=off: no compiler fuses a multiply-add the
#: source does not, so every variant rounds alike)
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off", "-fno-trapping-math"]
#: each variant's own flags (its -D selects its code in kernels.c)
VARIANTS = {
    "avx512": ["-DPC_AVX512", "-mavx512f", "-mavx2", "-mfma"],
    "avx2": ["-DPC_AVX2", "-mavx2", "-mfma"],
    "neon": ["-DPC_NEON"],
    "portable": [],
}
#: the environment variable that chooses the kernels (module docstring)
ENV = "PCACHE_RAG_KERNELS"
#: how often (seconds) :func:`threads` refits the thread count to the free CPUs
REFIT_S = 0.25
#: the largest head size and query group :func:`scores`/:func:`weighted_sum` take
MAX_HEAD_DIM, MAX_GROUP = 256, 16

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}  # by variant, once tried
_whys: dict[str, str] = {}  # why each variant tried could not be loaded ('' if it could)
_last_why = ""  # why the last load() returned None


def cpu_flags() -> str:
    """This CPU's feature flags as /proc/cpuinfo lists them (the machine's name where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def cpu_variant(flags: str | None = None, machine: str | None = None) -> str:
    """The fastest variant this CPU runs (``flags``: its feature flags, ``machine``: its
    architecture; this machine's when None)."""
    have = set((cpu_flags() if flags is None else flags).split())
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64", "i686", "i386"):
        if {"avx512f", "avx2", "fma"} <= have:
            return "avx512"
        if {"avx2", "fma"} <= have:
            return "avx2"
    elif machine in ("aarch64", "arm64"):
        return "neon"  # Advanced SIMD with fused multiply-add is part of every ARMv8-A CPU
    return "portable"


def runs_here(variant: str) -> str:
    """'' if this CPU runs ``variant``, else why not."""
    best = cpu_variant()
    order = ["portable", "avx2", "avx512"]
    if variant == best or variant == "portable":
        return ""
    if variant in order and best in order and order.index(variant) < order.index(best):
        return ""
    return f"this CPU runs {best!r} kernels, not {variant!r}"


_warned: set[str] = set()


def wanted() -> str | None:
    """The variant :func:`load` loads by default (None: the C kernels are turned off). A value
    of ``PCACHE_RAG_KERNELS`` that names no variant is warned about, by name, once."""
    v = os.environ.get(ENV, "").strip().lower()
    if v == "0":
        return None
    if v in VARIANTS:
        return v
    best = cpu_variant()
    if v not in ("", "1", "auto") and v not in _warned:
        _warned.add(v)
        log.warning("%s=%r names no kernel variant (0, auto, or one of %s); using this CPU's %r", ENV, v,
                    ", ".join(VARIANTS), best)
    return best


def _build(target: Path, cc: str, variant: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, *VARIANTS[variant], str(SOURCE), "-o", tmp, "-lm"], capture_output=True,
                           text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        os.replace(tmp, target)  # atomic: two processes building at once both end with a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(variant: str | None = None) -> ctypes.CDLL | None:
    """The kernels' library of ``variant`` (default: :func:`wanted`), building it on first use;
    None if it cannot be (see :func:`why_not`). ``lib.pc_variant()`` names the variant."""
    global _last_why
    with _lock:
        if variant is None:
            variant = wanted()
            if variant is None:
                _last_why = f"{ENV}=0"
                return None
        if variant not in _libs:
            _libs[variant] = _load(variant)
        _last_why = _whys[variant] if _libs[variant] is None else ""
        return _libs[variant]


def _load(variant: str) -> ctypes.CDLL | None:
    if variant not in VARIANTS:
        _whys[variant] = f"no kernel variant {variant!r} (one of {', '.join(VARIANTS)})"
        return None
    why = runs_here(variant)
    if why:
        _whys[variant] = f"{ENV}={variant}, but {why}"
        log.warning("%s; the fused decode step uses oneDNN's kernels", _whys[variant])
        return None
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        _whys[variant] = f"no C compiler ({cc!r} is not on PATH)"
        return None
    flags = [*FLAGS, *VARIANTS[variant], platform.machine()]
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_home() / "kernels" / f"pcache-kernels-{variant}-{key}.so"
    try:
        if not target.exists():
            _build(target, cc, variant)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _whys[variant] = f"the {variant} decode kernels could not be built or loaded: {e}"
        log.warning("%s; the fused decode step uses oneDNN's kernels", _whys[variant])
        return None
    vp, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.pc_variant.argtypes, lib.pc_variant.restype = [], ctypes.c_char_p
    lib.pc_set_threads.argtypes, lib.pc_set_threads.restype = [i32], None
    lib.pc_team.argtypes, lib.pc_team.restype = [i32], i32
    ip = ctypes.POINTER(ctypes.c_int64)
    lib.pc_attention_scratch.argtypes, lib.pc_attention_scratch.restype = [i64, ip, i64, i64, i64], i64
    lib.pc_gemv_bf16.argtypes = [vp, vp, vp, vp, i64, i64, i32]
    lib.pc_gemv_f32.argtypes = [vp, vp, vp, vp, i64, i64, i32]
    lib.pc_gemv_int8.argtypes = [vp, vp, vp, vp, vp, i64, i64, i32]
    lib.pc_gemm_bf16.argtypes = [vp, vp, vp, vp, i64, i64, i64, i32]
    lib.pc_gemm_f32.argtypes = [vp, vp, vp, vp, i64, i64, i64, i32]
    lib.pc_gemm_int8.argtypes = [vp, vp, vp, vp, vp, i64, i64, i64, i32]
    lib.pc_attention.argtypes = [i64, vp, i64, ip, ip, ip, ip, vp, i64, i64, i64, i64, f32, vp]
    lib.pc_rope_write.argtypes = [vp, vp, vp, i64, i64, i64, vp, vp, vp, i64, i64]
    lib.pc_rmsnorm.argtypes = [vp, vp, vp, i64, f32]
    lib.pc_silu_mul.argtypes = [vp, vp, i64]
    lib.pc_rmsnorm_rows.argtypes = [vp, vp, vp, i64, i64, f32]
    lib.pc_silu_mul_rows.argtypes = [vp, vp, i64, i64]
    lib.pc_decode_layers.argtypes = [ctypes.POINTER(Layer), i64, i32, vp, vp, vp, vp, vp, vp, vp, vp, vp, i64, i64,
                                     i64, i64, i64, f32, f32, i64, vp]
    lib.pc_decode_layers.restype = i32
    for f in (lib.pc_gemv_bf16, lib.pc_gemv_f32, lib.pc_gemv_int8, lib.pc_gemm_bf16, lib.pc_gemm_f32,
              lib.pc_gemm_int8, lib.pc_attention, lib.pc_rmsnorm, lib.pc_silu_mul, lib.pc_rmsnorm_rows,
              lib.pc_silu_mul_rows, lib.pc_rope_write):
        f.restype = None
    built = lib.pc_variant().decode()
    if built != variant:
        _whys[variant] = f"the library built as {variant!r} says it is {built!r}"
        return None
    _whys[variant] = ""
    return lib


def why_not() -> str:
    """Why the last :func:`load` returned None ('' if it did not, or was not called)."""
    return _last_why


class FreeCpus:
    """How many threads the kernels should run on now: the CPUs this process may use, less the
    CPU time other processes took over the last interval, at least one and at most ``cap()``
    (the module docstring). Refitted at most every ``interval`` seconds; thread-safe."""

    def __init__(self, interval: float = REFIT_S, stat: str = "/proc/stat") -> None:
        self.interval, self.stat = interval, stat
        try:
            self.cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = list(range(os.cpu_count() or 1))
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._lock = threading.Lock()
        self._last: tuple[float, float, float] | None = None  # (wall, busy jiffies of our CPUs, our CPU seconds)
        self._n = 0
        # torch's count now, before any decoding thread's team size is changed (see the module docstring)
        self._torch = max(1, torch.get_num_threads())
        #: other processes' load over the last interval, in CPUs (None: not measured yet)
        self.others: float | None = None

    def cap(self) -> int:
        fixed = os.environ.get("PCACHE_RAG_DECODE_THREADS", "")
        if fixed.isdigit() and int(fixed) > 0:
            return int(fixed)
        return max(1, min(self._torch, len(self.cpus)))

    def _busy(self) -> float | None:
        """Busy jiffies of our CPUs since boot (every field but idle and iowait), or None."""
        want, total = {f"cpu{c}" for c in self.cpus}, 0
        try:
            with open(self.stat) as f:
                for line in f:
                    name, *fields = line.split()
                    if name in want:
                        v = [int(x) for x in fields[:8]]
                        total += sum(v) - v[3] - v[4]
        except (OSError, ValueError, IndexError):
            return None
        return float(total)

    def __call__(self) -> int:
        cap = self.cap()
        if os.environ.get("PCACHE_RAG_DECODE_THREADS", "").isdigit() or cap == 1:
            return cap
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last[0] < self.interval and self._n:
                return min(self._n, cap)
            busy, ours = self._busy(), time.process_time()
            if busy is None:
                self._n = cap
                return cap
            if self._last is not None and now > self._last[0]:
                dt = now - self._last[0]
                others = max(0.0, (busy - self._last[1]) / self.hz - (ours - self._last[2])) / dt
                self.others = others
                self._n = max(1, min(cap, int(len(self.cpus) - others + 0.5)))
            else:
                self._n = cap
            self._last = (now, busy, ours)
            return self._n


_free = FreeCpus()


def threads() -> int:
    """How many threads the kernels run on now (:class:`FreeCpus`)."""
    return _free()


class Team:
    """``with Team(lib) as n:`` the kernels of ``lib`` and the calling thread's OpenMP team (torch's
    ops) run on ``n`` = :func:`threads` threads; the team size the thread had comes back after."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib, self.n, self.prev = lib, 0, 0

    def __enter__(self) -> int:
        self.n = _free()
        self.lib.pc_set_threads(self.n)
        self.prev = self.lib.pc_team(self.n)
        return self.n

    def __exit__(self, *exc) -> None:
        self.lib.pc_team(self.prev)


def _check(t: torch.Tensor, dtype: torch.dtype, numel: int, what: str) -> int:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or t.numel() < numel:
        raise ValueError(f"kernel argument {what}: needs a contiguous CPU {dtype} of at least {numel} elements, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    return t.data_ptr()


class Gemv:
    """One weight matrix (N, K) for :func:`pc_gemv_*`: ``fmt`` ``"fp32"``, ``"bf16"`` or
    ``"int8"`` (symmetric, one scale per row). ``gemv(x, y)`` writes ``W x (+ bias)`` into
    ``y`` (N,) and returns it (``add=True``: adds it to ``y``); ``x`` (K,) float32 (bf16 and
    int8 read it rounded to bf16). It holds no scratch: engines over one model share it."""

    def __init__(self, lib: ctypes.CDLL, w: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                 scale: torch.Tensor | None = None) -> None:
        self.N, self.K = w.shape
        if self.K % 16:
            raise ValueError(f"the decode kernels need K a multiple of 16, not {self.K}")
        self.fmt, self.w, self.scale = fmt, w.contiguous(), None if scale is None else scale.float().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        want = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[fmt]
        self._w = _check(self.w, want, self.N * self.K, "weight")
        self._b = None if self.bias is None else _check(self.bias, torch.float32, self.N, "bias")
        self._s = None if self.scale is None else _check(self.scale, torch.float32, self.N, "scale")
        if fmt == "int8" and self._s is None:
            raise ValueError("int8 weights need their row scales")
        self._f = {"fp32": lib.pc_gemv_f32, "bf16": lib.pc_gemv_bf16, "int8": lib.pc_gemv_int8}[fmt]
        self._fm = {"fp32": lib.pc_gemm_f32, "bf16": lib.pc_gemm_bf16, "int8": lib.pc_gemm_int8}[fmt]

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size() + (0 if self.scale is None else self.scale.numel() * 2)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, add: bool = False) -> torch.Tensor:
        self.raw(_check(x, torch.float32, self.K, "x"), _check(y, torch.float32, self.N, "y"), add)
        return y

    def many(self, x: torch.Tensor, y: torch.Tensor, add: bool = False) -> torch.Tensor:
        """``y`` (M, N) = ``x`` (M, K) . W^T (+ bias; ``add``: added to ``y``): every row to the same
        bits as :meth:`__call__` gives it alone, with W read once for all of them."""
        M = x.shape[0]
        self.raw_many(_check(x, torch.float32, M * self.K, "x"), _check(y, torch.float32, M * self.N, "y"), M, add)
        return y

    def raw_many(self, xp: int, yp: int, M: int, add: bool = False) -> None:
        """:meth:`many` on addresses the caller has checked (M rows of K, and of N)."""
        if self._s is not None:
            self._fm(self._w, self._s, xp, yp, self._b, self.N, self.K, M, int(add))
        else:
            self._fm(self._w, xp, yp, self._b, self.N, self.K, M, int(add))

    def raw(self, xp: int, yp: int, add: bool = False) -> None:
        """The product on addresses the caller has checked (buffers it allocated for K and N)."""
        if self._s is not None:
            self._f(self._w, self._s, xp, yp, self._b, self.N, self.K, int(add))
        else:
            self._f(self._w, xp, yp, self._b, self.N, self.K, int(add))


class Layer(ctypes.Structure):
    """One decoder layer for ``pc_decode_layers`` (kernels.c's ``pc_layer``): its four products'
    weights, row scales (int8) and biases (qkv, o, gate_up, down), its two norms, and the cache
    layer the token's key and value go to (keys, values, floats between key heads)."""

    _fields_ = [("w", ctypes.c_void_p * 4), ("s", ctypes.c_void_p * 4), ("b", ctypes.c_void_p * 4),
                ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("k", ctypes.c_void_p),
                ("v", ctypes.c_void_p), ("hs", ctypes.c_int64)]

    def weights(self, products: list[Gemv], norm1: torch.Tensor, norm2: torch.Tensor) -> None:
        """Point this layer at ``products`` (qkv, o, gate_up, down: one format) and its norms."""
        for i, g in enumerate(products):
            self.w[i], self.s[i], self.b[i] = g._w, g._s, g._b
        self.norm1 = _check(norm1, torch.float32, norm1.numel(), "norm1")
        self.norm2 = _check(norm2, torch.float32, norm2.numel(), "norm2")


FORMATS = {"fp32": 0, "bf16": 1, "int8": 2}  # kernels.c's gemm(fmt, ...)


class Attention:
    """One new token's grouped-query attention, for one sequence or several at once, for a fixed
    geometry (``H`` key heads, ``G`` query heads each, head size ``D``), with its scratch:
    ``pc_decode_layers`` attends one sequence's queries with its scratch (:meth:`scratch_for`);
    :meth:`many` attends M sequences' queries, each over its own buffers (H, capacity, D), in one
    kernel call, each to the bits it gets alone."""

    def __init__(self, lib: ctypes.CDLL, H: int, G: int, D: int) -> None:
        if D % 16 or D > MAX_HEAD_DIM or G > MAX_GROUP:
            raise ValueError(f"the attention kernel takes D a multiple of 16 up to {MAX_HEAD_DIM} and groups up to "
                             f"{MAX_GROUP}, not D={D}, G={G}")
        self.lib, self.H, self.G, self.D = lib, H, G, D
        self.scratch = torch.empty(0)  # scores and per-block partials, grown with the keys
        self._cap = 0
        self._grow(8)

    def _grow(self, M: int) -> None:
        """Room for M sequences' addresses (ctypes arrays: written element by element each call)."""
        self._cap = max(M, 2 * self._cap)
        arr = ctypes.c_int64 * self._cap
        self._k, self._v, self._hs, self._n = arr(), arr(), arr(), arr()

    def check(self, keys: torch.Tensor, n: int) -> None:
        """Refuse buffers the kernels cannot read: float32 (H, >= n, D) on the CPU, rows contiguous."""
        H, D = self.H, self.D
        if (keys.dtype != torch.float32 or keys.device.type != "cpu" or keys.dim() != 3 or keys.shape[0] != H
                or keys.shape[1] < n or keys.shape[2] != D or keys.stride(2) != 1 or keys.stride(1) != D):
            raise ValueError(f"attention buffers must be float32 (H={H}, >= {n}, D={D}) with contiguous rows, "
                             f"not {keys.dtype} {tuple(keys.shape)} strides {keys.stride()}")

    def scratch_for(self, n: int) -> int:
        """The scratch's address, grown for one sequence's attention over ``n`` keys
        (``pc_decode_layers`` attends every layer with it)."""
        self._n[0] = n
        need = self.lib.pc_attention_scratch(1, self._n, self.H, self.G, self.D)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(max(2 * need, 1 << 16))
        return self.scratch.data_ptr()

    def many(self, M: int, qp: int, qs: int, kv: list, ns: list[int], scale: float, op: int, os_: int) -> None:
        """Attention of M sequences' queries, sequence i's at ``qp + 4 * i * qs`` (H, G, D), over rows
        ``< ns[i]`` of its ``kv[i]`` = (keys, values) (each checked with :meth:`check`), written to
        ``op + 4 * i * os_`` (H, G, D)."""
        if M > self._cap:
            self._grow(M)
        k, v, hs, n = self._k, self._v, self._hs, self._n
        for i, ((kb, vb), m) in enumerate(zip(kv, ns)):
            k[i], v[i], hs[i], n[i] = kb.data_ptr(), vb.data_ptr(), kb.stride(0), m
        need = self.lib.pc_attention_scratch(M, n, self.H, self.G, self.D)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(max(2 * need, 1 << 16))
        self.lib.pc_attention(M, qp, qs, k, v, hs, n, op, os_, self.H, self.G, self.D, scale, self.scratch.data_ptr())


def rmsnorm(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """``out`` = RMSNorm of ``x`` (K,) with weight ``w`` (K,)."""
    K = w.numel()
    lib.pc_rmsnorm(_check(x, torch.float32, K, "x"), _check(w, torch.float32, K, "w"),
                   _check(out, torch.float32, K, "out"), K, eps)
    return out


def silu_mul(lib: ctypes.CDLL, gu: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (I,) = silu(gu[:I]) * gu[I:] for ``gu`` (2 I,)."""
    inter = out.numel()
    lib.pc_silu_mul(_check(gu, torch.float32, 2 * inter, "gu"), _check(out, torch.float32, inter, "out"), inter)
    return out


__all__ = ["VARIANTS", "FORMATS", "Attention", "Layer", "FreeCpus", "Gemv", "cpu_flags", "cpu_variant", "load", "rmsnorm",
           "runs_here", "silu_mul", "threads", "wanted", "why_not", "Team"]
