#!/usr/bin/env python
"""Prompt-pass matmuls with and without the AMX tile unit, side by side (sharpi_core.kernels.cpu.qmatmul,
prompt=True, activations quantized as llama.cpp quantizes them).

    python scripts/bench_amx.py                       # Qwen 1.5B's FFN shapes, Q4_K (repacked) and Q6_K
    python scripts/bench_amx.py --shapes 1536x1536 --ts 16,32,64 --reps 5

Each (type, shape, T) is timed with AMX on, then off, alternating --reps times; the figure is the best
of each, so that machine noise hits both alike. The results are the same bits either way (tests check
it); the weights are random blocks of the type (their values do not change the speed).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

from sharpi_core.kernels import cpu  # noqa: E402

# block bytes, and where each block's fp16 scales are (random bytes there could be NaN or huge)
_BLOCK = {Q.Q4_K: (144, (0, 2)), Q.Q6_K: (210, (208,))}


def weight(qtype, n: int, k: int, rng) -> tuple[torch.Tensor, object]:
    size, scales = _BLOCK[qtype]
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    for off in scales:
        raw[:, :, off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    w = torch.from_numpy(raw.reshape(n, -1))
    if qtype == Q.Q4_K:  # as the models run it: repacked in groups of 4 rows at load
        return cpu.repack(w, qtype, n, k), cpu.PACKED[qtype]
    return w, qtype


def best(f, reps: int) -> float:
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8960x1536,1536x8960", help="N x K weight shapes (K a multiple of 256)")
    ap.add_argument("--ts", default="8,16,32,128,512", help="prompt tokens per pass")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    if not cpu.available():
        sys.exit(f"CPU kernels unavailable: {cpu.unavailable_reason()}")
    if not cpu.amx():
        sys.exit("no AMX here (the CPU lacks AMX-INT8, the OS refused the tile state, or SHARPI_AMX=0)")
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    print("| type | N x K | T | AMX ms | vector ms | speed-up | AMX GMAC/s |")
    print("|---|---|---|---|---|---|---|")
    try:
        for tname in a.types.split(","):
            qtype = Q[tname]
            for shape in a.shapes.split(","):
                n, k = map(int, shape.lower().split("x"))
                w, wtype = weight(qtype, n, k, rng)
                for t in map(int, a.ts.split(",")):
                    x = torch.randn(t, k)
                    inner = max(1, 256 // t)

                    def run():
                        for _ in range(inner):
                            cpu.qmatmul(x, w, wtype, n, k, act_quant=True, prompt=True)
                    got = {True: float("inf"), False: float("inf")}
                    for _ in range(a.reps):
                        for on in (True, False):
                            cpu.amx(on)
                            run()  # warm-up: buffers, caches
                            got[on] = min(got[on], best(run, 1) / inner)
                    print(f"| {tname} | {n} x {k} | {t} | {got[True] * 1e3:.2f} | {got[False] * 1e3:.2f} | "
                          f"{got[False] / got[True]:.2f}x | {n * k * t / got[True] / 1e9:.0f} |", flush=True)
    finally:
        cpu.amx(True)


if __name__ == "__main__":
    main()
