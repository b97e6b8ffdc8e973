"""The fused decode step of the embedded model on 1 to M sequences at once, and its parts.

For each batch size: ms a step (best of 5 runs of 20 tokens), the products alone (the step's
121 weight matrices, through the same kernels), and the step without its products (everything
else: norms, RoPE, attention, the per-sequence calls). Each sequence attends ``--ctx`` cached
positions of random keys and values (the step's cost does not depend on their values).

    .venv/bin/python scripts/measure-batch-step.py [--fmt bf16] [--ctx 60] [--sizes 1,2,4,8]
    PCACHE_RAG_KERNELS=avx2 .venv/bin/python scripts/measure-batch-step.py   # the AVX2 build
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", default="bf16", choices=("fp32", "bf16", "int8"))
    ap.add_argument("--ctx", type=int, default=60)
    ap.add_argument("--sizes", default="1,2,4,8")
    a = ap.parse_args()

    import torch

    from pcache_rag.default_model import load_model
    from pcache_rag.models import adapter_for, kernels
    from pcache_rag.models.decode_step import FusedDecodeStep

    model, _ = load_model()
    step = FusedDecodeStep(model, adapter_for(model), a.fmt)
    if step.kernels != "c":
        sys.exit(f"the C kernels are not in use: {step.kernels_why_not}")
    n_kv, head_dim = step.n_kv, step.head_dim

    class Layer:  # one layer's key and value buffers, as a workspace cache's layer
        def __init__(self) -> None:
            self.buffers = (torch.randn(n_kv, a.ctx + 400, head_dim), torch.randn(n_kv, a.ctx + 400, head_dim))
            self.length = a.ctx

        def set_length(self, n: int) -> None:
            self.length = n

    sizes = [int(m) for m in a.sizes.split(",")]
    seqs = [[Layer() for _ in step.layers] for _ in range(max(sizes))]

    def timed(M: int) -> float:
        best = float("inf")
        for _ in range(5):
            for s in seqs[:M]:
                for layer in s:
                    layer.length = a.ctx
            t = time.perf_counter()
            for i in range(20):
                if M == 1:
                    step(100 + i, a.ctx + i, seqs[0])
                else:
                    step.many([100 + i] * M, [a.ctx + i] * M, seqs[:M])
            best = min(best, (time.perf_counter() - t) / 20)
        return best * 1e3

    gemvs = [g for lay in step.layers for g in (lay.qkv.gemv, lay.o.gemv, lay.gate_up.gemv, lay.down.gemv)]
    gemvs.append(step.head.gemv)
    print(f"{step.variant} kernels, {a.fmt} weights, {a.ctx} cached positions a sequence")
    rows = []
    for M in sizes:
        full = timed(M)
        bufs = [(torch.randn(M, g.K), torch.zeros(M, g.N)) for g in gemvs]
        prod = float("inf")
        with kernels.Team(step._lib):
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(20):
                    for g, (x, y) in zip(gemvs, bufs):
                        g.raw_many(x.data_ptr(), y.data_ptr(), M)
                prod = min(prod, (time.perf_counter() - t) / 20 * 1e3)
        rows.append((M, full, prod))
    # the step without its products: the same calls, the products made no-ops. One sequence runs its
    # layers inside one C call (pc_decode_layers), which no Python patch reaches: there the rest is the
    # step less its products, timed apart
    saved = kernels.Gemv.raw_many, kernels.Gemv.raw
    kernels.Gemv.raw_many = lambda self, xp, yp, M, add=False: None  # type: ignore[method-assign]
    kernels.Gemv.raw = lambda self, xp, yp, add=False: None  # type: ignore[method-assign]
    try:
        rest = {M: timed(M) for M in sizes if M > 1}
    finally:
        kernels.Gemv.raw_many, kernels.Gemv.raw = saved  # type: ignore[method-assign]
    for M, full, prod in rows:
        without = f"{rest[M]:.1f} ms" if M > 1 else f"{full - prod:.1f} ms (the step less its products)"
        print(f"{M} sequences: step {full:.1f} ms; products alone {prod:.1f} ms; the step without them {without}")


if __name__ == "__main__":
    main()
