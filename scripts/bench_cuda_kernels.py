#!/usr/bin/env python
"""Benchmark the CUDA quantized matvec kernels (sharpi_core.backends.cuda.CudaQWeight.matmul) on a GPU:
time per call and weight bandwidth (weight bytes / time) against the GPU's peak, for 1..16 activation
rows (the batched variants read each weight block once for all rows, so their GB/s should hold), for
each way of sharing a row between warps (`--splits`; `auto` is what the model uses, qmv_split), and for
the integer (DP4A, q8 rows) and float matvecs of the types that have both (`--kernels int,float`).

Calls are timed as they run in a decoding pass: replayed from a CUDA graph (no Python launch cost in
the time), each on another copy of the weight, enough copies to be several times the GPU's L2 (a
matrix read twice in a row would come from the L2, which a model's next layer does not).

    python scripts/bench_cuda_kernels.py                     # the Qwen 1.5B / 0.5B decode matrices
    python scripts/bench_cuda_kernels.py --mats q4_k:8960:1536,q6_k:1536:8960 --ts 1,2,4,8,16 --splits 1,2,4

Needs cupy and an NVIDIA GPU. (With PYTHONPATH=tests/simt it runs on the CPU emulator of
tests/simt instead, which checks the script, not the speed: try --mats q4_k:64:512 --reps 1 --l2-mb 0.)
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
    if qtype in (Q.Q6_K, Q.Q3_K, Q.IQ4_XS, Q.IQ4_NL):
        o = {Q.Q6_K: 208, Q.Q3_K: 108}.get(qtype, 0)
        raw[:, o:o + 2] = scale
    elif qtype == Q.Q2_K:
        raw[:, 80:82] = raw[:, 82:84] = scale
    else:
        raw[:, 0:2] = scale
        if qtype in (Q.Q4_K, Q.Q5_K, Q.Q4_1, Q.Q5_1):
            raw[:, 2:4] = scale
    return raw.reshape(n, -1)


# Qwen2.5-Coder 1.5B Q4_K_M's matrices (attn q+k, attn_output, ffn gate+up, ffn_down in both types,
# the tied Q6_K output layer), then the 0.5B draft's main ones (Q5_0 / Q8_0)
DEFAULT_MATS = ("q4_k:1792:1536,q4_k:1536:1536,q4_k:17920:1536,q4_k:1536:8960,q6_k:1536:8960,q6_k:151936:1536,"
                "q5_0:1152:896,q5_0:9728:896,q8_0:896:4864")


def replayed(cp, run, stream, reps: int) -> float:
    """Seconds of one replay of run's launches on `stream` (run once eagerly first: compiles, sizes
    nothing), captured as a CUDA graph and replayed `reps` times."""
    run()
    graph = cb.capture(run, stream)
    graph.launch(stream=stream)  # warm-up
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(reps):
        graph.launch(stream=stream)
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / reps


def time_calls(cp, ws, x, out, reps: int, xq=None) -> float:
    """Seconds per call of `reps` passes over the weights ws (one call each), replayed as a CUDA graph
    (xq: the q8 rows of x, for the integer matvecs)."""
    stream = cp.cuda.Stream(non_blocking=True)
    return replayed(cp, lambda: [w.matmul(x, stream=stream, out=out, xq=xq) for w in ws], stream, reps) / len(ws)


def time_attention(cp, spec: str, reps: int, layers: int = 28) -> None:
    """Attention as a decoding step runs it (f16 caches, the splits combined by the launch itself, its
    output rounded for a Q4_K attn_output), per chunk size: `layers` caches in turn (the L2 holds no
    layer's keys when its turn comes), replayed from a CUDA graph. Combined in the launch: with blocks of
    the heads a Q8_K block spans (cuda.attention_heads_per_block, the default) and of a head each
    (SHARPI_CUDA_ATT_UNITS=0)."""
    H, Hkv, D, ctx, T = (int(v) for v in spec.split(":"))
    rng = np.random.default_rng(1)
    cap = ctx + 64
    caches = []
    for _ in range(layers):
        kc, vc = cb.new_kv_cache(cap, Hkv, D), cb.new_kv_cache(cap, Hkv, D)
        kv = cp.asarray(rng.standard_normal((ctx + T, Hkv, D)).astype(np.float32))
        cb.kv_append(kv, kc, np.arange(ctx + T, dtype=np.int32), src2=kv, cache2=vc)
        caches.append((kc, vc))
    q = cp.asarray(rng.standard_normal((T, H, D)).astype(np.float32))
    pos = cp.asarray(np.arange(ctx, ctx + T, dtype=np.int32))
    out = cp.empty((T, H, D), cp.float32)
    cnt = cp.zeros(T * H, cp.int32)
    for chunk in (None, 32, 64, 128, 256, 512, 1024):  # (one split holds up to 1024 keys: no combining at all)
        ch, S = cb.attention_splits(cap, cap, chunk=chunk)
        work = tuple(cp.empty(n, cp.float32) for n in cb.attention_work(T, H, D, S))
        stream = cp.cuda.Stream(non_blocking=True)
        for fused, units in ((True, True), (True, False), (False, False)):
            cb.ATT_UNITS = units
            hpb = cb.attention_heads_per_block(H, D, "q8_k", fused, False)
            run = lambda: [cb.attention(q, kc, vc, pos, cap, 0.1, chunk=chunk, out=out, work=work,  # noqa: E731
                                        rounding="q8_k", counters=cnt if fused else None, stream=stream)
                           for kc, vc in caches]
            us = replayed(cp, run, stream, reps) * 1e6 / layers
            label = f"{ch}{'*' if chunk is None else ''}"
            how = f"combined in the launch, {hpb} head(s) a block" if fused else "combined by a second launch"
            print(f"attention H={H} Hkv={Hkv} D={D} context {ctx} (cache {cap}) T={T}: chunk {label:>5s} "
                  f"({S} splits), {how}: {us:6.1f} us")
        cb.ATT_UNITS = True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mats", default=DEFAULT_MATS, help="type:N:K,... (N rows of K weights)")
    ap.add_argument("--ts", default="1,5,16", help="activation rows")
    ap.add_argument("--splits", default="auto,1,2,4", help="warps per row: auto (the model's choice) or 1, 2, 4")
    ap.add_argument("--kernels", default="int,float",
                    help="int (DP4A on q8 rows, the default where a type has them) and / or float matvecs")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed")
    ap.add_argument("--l2-mb", type=float, default=240, help="copies of a weight fill at least this many MB")
    ap.add_argument("--attn", default="", help="H:Hkv:D:context:T,... time attention instead (e.g. "
                                               "12:2:128:128:1 for Qwen 1.5B at 128 tokens; * = the default chunk)")
    ap.add_argument("--defs", default="",
                    help="builds of qmatvec.cu to compare, ';'-separated, each space-separated -D options "
                         "(-DQMV_MINB_MID=4 ...); the default build first")
    a = ap.parse_args()
    ok, why = cb.cuda_available()
    if not ok:
        print(f"error: {why}", file=sys.stderr)
        return 2
    import cupy as cp  # noqa: PLC0415
    peak = cb.peak_bandwidth()
    print(f"device: {why}; peak {peak / 1e9:.0f} GB/s")
    if a.attn:
        for spec in a.attn.split(","):
            time_attention(cp, spec, a.reps)
        return 0
    ts = [int(t) for t in a.ts.split(",")]
    print(f"{'type':6s} {'N x K':>12s} {'MB':>6s} {'kern':>5s} {'ws':>6s} "
          + " ".join(f"{'T=' + str(t):>26s}" for t in ts))
    rng = np.random.default_rng(0)
    builds = [""] + [d.strip() for d in a.defs.split(";") if d.strip()]
    for spec in a.mats.split(","):
        name, n, k = spec.split(":")
        qtype, n, k = Q[name.upper()], int(n), int(k)
        raw = random_raw(qtype, n, k, rng)
        nbytes = raw.nbytes
        copies = max(1, min(64, int(np.ceil(a.l2_mb * 1e6 / nbytes))))
        ws = [cb.CudaQWeight(raw, qtype, n, k) for _ in range(copies)]
        opts, ikind = ws[0]._opts, cb.int_act_kind(qtype)
        for kern in a.kernels.split(","):
            if kern == "int" and ikind is None:
                continue  # no integer matvecs for this type
            xk = ikind if kern == "int" else None
            auto = cb.qmv_split(qtype, n, k, xk is not None)
            for split in a.splits.split(","):
                v = auto if split == "auto" else int(split)
                for defs in builds:
                    for w in ws:
                        w.split, w._opts, w.xq_kind = v, opts + tuple(defs.split()), xk
                    cells = []
                    for T in ts:
                        x = cb.round_act(cp.asarray(rng.standard_normal((T, k)).astype(np.float32)), xk)  # (None: as is)
                        out = cp.empty((T, n), cp.float32)
                        sec = time_calls(cp, ws, x, out, a.reps, cb.quantize_act(x, xk) if xk else None)
                        gbs = nbytes / sec
                        cells.append(f"{sec * 1e6:8.1f} us {gbs / 1e9:6.0f} GB/s {100 * gbs / peak:3.0f}%")
                    label = f"{v}" + ("*" if split == "auto" else "")
                    print(f"{qtype.name:6s} {f'{n}x{k}':>12s} {nbytes / 1e6:6.1f} {kern:>5s} {label:>6s} "
                          + " ".join(f"{c:>26s}" for c in cells) + (f"  {defs}" if defs else ""))
        del ws
    print("ws: warps sharing a row (* the model's choice); copies of each weight exceed --l2-mb")
    return 0


if __name__ == "__main__":
    sys.exit(main())
