"""The fused decode step's CPU kernels (``kernels.c``): compiled once per machine, loaded
with ctypes, called with checked tensors.

Why C: see the top of ``kernels.c`` (the library kernels stream a one-token decode's small
matrices at half this machine's bandwidth). Why ctypes and a plain C file rather than a torch
C++ extension: it needs no torch headers, no ninja and no Python headers, compiles in under a
second, and a call costs about a microsecond.

The shared library is built with the system C compiler (``$CC``, else ``cc``) as
``-O3 -march=native -fopenmp`` into ``$PCACHE_RAG_HOME/kernels/``, named by a hash of the
source, the flags and this CPU's feature flags, so a home directory shared by two machines
never loads code built for the other. No compiler, a failed build or a failed load leaves
:func:`load` returning ``None`` with the reason in :func:`why_not`; the fused step then uses
oneDNN's kernels (said in its report), never a silent change of results.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..fsutil import cache_home

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
#: the largest head size and query group :func:`scores`/:func:`weighted_sum` take
MAX_HEAD_DIM, MAX_GROUP = 256, 16

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why = ""
_tried = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def _build(target: Path, cc: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        os.replace(tmp, target)  # atomic: two processes building at once both end with a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The kernels' library, building it on first use; None if it cannot be (see :func:`why_not`)."""
    global _lib, _why, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("PCACHE_RAG_KERNELS", "1") == "0":
            _why = "PCACHE_RAG_KERNELS=0"
            return None
        cc = os.environ.get("CC") or "cc"
        if shutil.which(cc) is None:
            _why = f"no C compiler ({cc!r} is not on PATH)"
            return None
        key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
        target = cache_home() / "kernels" / f"pcache-kernels-{key}.so"
        try:
            if not target.exists():
                _build(target, cc)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _why = f"the decode kernels could not be built or loaded: {e}"
            log.warning("%s; the fused decode step uses oneDNN's kernels", _why)
            return None
        vp, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        lib.pc_gemv_bf16.argtypes = [vp, vp, vp, vp, i64, i64, i32]
        lib.pc_gemv_f32.argtypes = [vp, vp, vp, vp, i64, i64, i32]
        lib.pc_gemv_int8.argtypes = [vp, vp, vp, vp, vp, i64, i64, i32]
        lib.pc_gemm_bf16.argtypes = [vp, vp, vp, vp, i64, i64, i64, i32]
        lib.pc_gemm_f32.argtypes = [vp, vp, vp, vp, i64, i64, i64, i32]
        lib.pc_gemm_int8.argtypes = [vp, vp, vp, vp, vp, i64, i64, i64, i32]
        lib.pc_scores.argtypes = [vp, vp, i64, vp, i64, i64, i64, i64, f32]
        lib.pc_weighted_sum.argtypes = [vp, vp, i64, vp, i64, i64, i64, i64, vp, i64]
        lib.pc_rope_write.argtypes = [vp, vp, vp, i64, i64, i64, vp, vp, vp, i64, i64]
        lib.pc_rmsnorm.argtypes = [vp, vp, vp, i64, f32]
        lib.pc_silu_mul.argtypes = [vp, vp, i64]
        for f in (lib.pc_gemv_bf16, lib.pc_gemv_f32, lib.pc_gemv_int8, lib.pc_gemm_bf16, lib.pc_gemm_f32,
                  lib.pc_gemm_int8, lib.pc_scores, lib.pc_weighted_sum,
                  lib.pc_rmsnorm, lib.pc_silu_mul, lib.pc_rope_write):
            f.restype = None
        _lib = lib
        return lib


def why_not() -> str:
    """Why :func:`load` returned None ('' if it did not, or was not called)."""
    return _why


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


class Attention:
    """One query token's grouped-query attention for a fixed geometry (``H`` key heads, ``G``
    query heads each, head size ``D``), with its scratch: :meth:`__call__` attends the queries
    at ``q`` over the first ``n`` rows of a layer's key and value buffers (H, capacity, D)."""

    def __init__(self, lib: ctypes.CDLL, H: int, G: int, D: int, threads: int) -> None:
        if D % 16 or D > MAX_HEAD_DIM or G > MAX_GROUP:
            raise ValueError(f"the attention kernel takes D a multiple of 16 up to {MAX_HEAD_DIM} and groups up to "
                             f"{MAX_GROUP}, not D={D}, G={G}")
        self.lib, self.H, self.G, self.D, self.threads = lib, H, G, D, max(1, threads)
        self.part = torch.empty(self.threads * H * G * D)
        self.scores = torch.empty(0)

    def check(self, keys: torch.Tensor, n: int) -> None:
        """Refuse buffers the kernels cannot read: float32 (H, >= n, D) on the CPU, rows contiguous."""
        H, D = self.H, self.D
        if (keys.dtype != torch.float32 or keys.device.type != "cpu" or keys.dim() != 3 or keys.shape[0] != H
                or keys.shape[1] < n or keys.shape[2] != D or keys.stride(2) != 1 or keys.stride(1) != D):
            raise ValueError(f"attention buffers must be float32 (H={H}, >= {n}, D={D}) with contiguous rows, "
                             f"not {keys.dtype} {tuple(keys.shape)} strides {keys.stride()}")

    def __call__(self, qp: int, keys: torch.Tensor, values: torch.Tensor, n: int, scale: float, op: int) -> None:
        """Attention of the queries at address ``qp`` (H, G, D) over rows ``< n`` of ``keys`` and
        ``values`` (checked with :meth:`check` for this ``n``), written to ``op`` (H, G, D)."""
        H, G, D = self.H, self.G, self.D
        if self.scores.numel() < H * G * n:
            self.scores = torch.empty(H * G * max(n * 2, 1024))
        sc = self.scores[: H * G * n]
        self.lib.pc_scores(qp, keys.data_ptr(), keys.stride(0), sc.data_ptr(), H, G, D, n, scale)
        p = torch.softmax(sc.view(H * G, n), -1)  # (H G, n), contiguous
        self.lib.pc_weighted_sum(p.data_ptr(), values.data_ptr(), values.stride(0), op, H, G, D, n,
                                 self.part.data_ptr(), self.threads)


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


__all__ = ["Attention", "Gemv", "load", "rmsnorm", "silu_mul", "why_not"]
