#!/usr/bin/env python
"""Benchmark the CUDA quantized matvec kernels (sharpi_core.backends.cuda.CudaQWeight.matmul) on a GPU:
time per call and weight bandwidth (weight bytes / time) against the GPU's peak, for 1..16 activation
rows (the batched variants read each weight block once for all rows, so their GB/s should hold).

    python scripts/bench_cuda_kernels.py                       # Q4_K Q6_K Q8_0 Q4_0 F16, 8192 x 4096
    python scripts/bench_cuda_kernels.py --types q4_k --n 8960 --k 1536 --ts 1,2,4,8,16

Needs cupy and an NVIDIA GPU. (With PYTHONPATH=tests/simt it runs on the CPU emulator of
tests/simt instead, which checks the script, not the speed.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402
import numpy as np  # noqa: E402

from sharpi_core.backends import cuda as cb  # noqa: E402

Q = gguf.GGMLQuantizationType


def random_raw(qtype, n: int, k: int, rng) -> np.ndarray:
    """Raw GGUF bytes [n, row_bytes]: random codes with sane f16 scales (the values do not matter for
    timing, only that no NaN / inf slows anything down)."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
    if qtype in (Q.F16, Q.F32, Q.BF16):
        w = rng.standard_normal((n, k)).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(n, -1)
    scale = np.full((raw.shape[0],), 0.01, np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == Q.Q6_K:
        raw[:, 208:210] = scale
    else:
        raw[:, 0:2] = scale
        if qtype in (Q.Q4_K, Q.Q5_K, Q.Q4_1, Q.Q5_1):
            raw[:, 2:4] = scale
    return raw.reshape(n, -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="q4_k,q6_k,q8_0,q4_0,f16")
    ap.add_argument("--n", type=int, default=8192, help="weight rows")
    ap.add_argument("--k", type=int, default=4096, help="weight columns (a multiple of 256)")
    ap.add_argument("--ts", default="1,4,16", help="activation rows")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    ok, why = cb.cuda_available()
    if not ok:
        print(f"error: {why}", file=sys.stderr)
        return 2
    import cupy as cp  # noqa: PLC0415
    peak = cb.peak_bandwidth()
    print(f"device: {why}; peak {peak / 1e9:.0f} GB/s")
    ts = [int(t) for t in a.ts.split(",")]
    print(f"{'type':6s} {'N x K':>12s} {'MB':>7s} " + " ".join(f"{'T=' + str(t):>22s}" for t in ts))
    rng = np.random.default_rng(0)
    for name in a.types.split(","):
        qtype = Q[name.upper()]
        cw = cb.CudaQWeight(random_raw(qtype, a.n, a.k, rng), qtype, a.n, a.k)
        cells = []
        for T in ts:
            x = cp.asarray(rng.standard_normal((T, a.k)).astype(np.float32))
            out = cp.empty((T, a.n), cp.float32)
            for _ in range(3):
                cw.matmul(x, out=out)
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(a.reps):
                cw.matmul(x, out=out)
            end.record()
            end.synchronize()
            s = cp.cuda.get_elapsed_time(start, end) / a.reps / 1e3
            gbs = cw.nbytes / s
            cells.append(f"{s * 1e6:8.1f} us {gbs / 1e9:5.0f} GB/s {100 * gbs / peak:3.0f}%")
        print(f"{qtype.name:6s} {f'{a.n}x{a.k}':>12s} {cw.nbytes / 1e6:7.1f} " + " ".join(f"{c:>22s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
