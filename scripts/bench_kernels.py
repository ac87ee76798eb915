#!/usr/bin/env python
"""Benchmark sharpi's quantized CPU matmul (sharpi_core.kernels.cpu.qmatmul) on the real weight
shapes of the registry models, against torch f32 and bf16 matmuls of the dequantized weight.

    python scripts/bench_kernels.py                      # all downloaded models, T = 1, 4, 128
    python scripts/bench_kernels.py --models smollm2 --ts 1,2,4,8,16,128

qmatmul runs as the models run it: activations quantized to 8 bits the way llama.cpp does, integer
kernels, and Q4_K / Q4_1 weights in the CPU layout they are repacked into at load (type marked *).
For T=1 it prints the effective bandwidth: weight bytes read per second (quantized bytes for
qmatmul, 4 / 2 bytes per weight for f32 / bf16). Weights are cycled through enough copies to
exceed the last-level cache, so every call streams its weight from DRAM as in real decoding.
At the end: the machine's streaming bandwidth (the ceiling) and, per model, the time of one
decode step's matmuls (sum over all its weight matrices at T=1).
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from sharpi_core.kernels import cpu  # noqa: E402

COLD_BYTES = 320 << 20  # cycle through at least this much weight memory (> L3) per timing


class OtherLoad:
    """CPU time other processes used while a measurement ran (/proc/stat minus this process), in
    cpus; a shared machine makes the 2-thread timings meaningless, so rows measured under load are
    flagged."""

    def __init__(self):
        self.b0, self.s0, self.t0 = self._busy(), self._self(), time.time()

    @staticmethod
    def _busy() -> float:
        try:
            v = list(map(int, open("/proc/stat").readline().split()[1:]))
        except OSError:
            return 0.0
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _self() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def cpus(self) -> float:
        wall = max(1e-9, time.time() - self.t0)
        return max(0.0, (self._busy() - self.b0) - (self._self() - self.s0)) / wall


def torch_view(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def timeit(fn, args_list, min_time=0.25, max_rounds=40) -> float:
    """Median seconds per call, cycling through args_list (one warm-up pass first)."""
    for a in args_list[: min(len(args_list), 3)]:
        fn(*a)
    times, spent, i = [], 0.0, 0
    while (spent < min_time or len(times) < 5) and len(times) < max_rounds * len(args_list):
        a = args_list[i % len(args_list)]
        t0 = time.perf_counter()
        fn(*a)
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
        i += 1
    return float(np.median(times))


def copies(t: torch.Tensor, nbytes_each: int, cold: bool) -> list[torch.Tensor]:
    n = max(1, math.ceil(COLD_BYTES / max(1, nbytes_each))) if cold else 1
    n = min(n, 64)
    return [t] + [t.clone() for _ in range(n - 1)]


def machine_bandwidth() -> dict:
    a = torch.empty(256 << 20, dtype=torch.float32).uniform_()  # 1 GiB
    out = {}
    best = min(timeit(lambda: a.sum(), [()], min_time=0.5) for _ in range(2))
    out["torch sum (GB/s)"] = a.numel() * 4 / best / 1e9
    m = a.view(32768, -1)
    v = torch.randn(m.shape[1])
    best = timeit(lambda: torch.mv(m, v), [()], min_time=0.5)
    out["torch f32 matvec (GB/s)"] = a.numel() * 4 / best / 1e9
    return out  # (a and m are freed here)


def model_shapes(path: str):
    """Unique (type, N, K) of the 2-D weights: (count, example tensor)."""
    r = gguf.GGUFReader(path, "r")
    names = {t.name for t in r.tensors}
    groups: dict = {}
    count: Counter = Counter()
    for t in r.tensors:
        if len(t.shape) != 2:
            continue
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue  # an embedding table, not multiplied (only rows are read)
        key = (t.tensor_type, int(t.shape[1]), int(t.shape[0]))
        count[key] += 1
        groups.setdefault(key, t)
    return [(key, count[key], groups[key]) for key in sorted(groups, key=lambda k: (-k[1] * k[2], k[0].name))]


def bench_shape(t, qtype, n, k, ts, do_torch: bool, rows: list):
    data = np.asarray(t.data)
    nbytes = data.nbytes
    raw = torch_view(data)
    if qtype == gguf.GGMLQuantizationType.F32:
        return
    res = {"name": t.name, "type": qtype.name, "N": n, "K": k, "MB": nbytes / 1e6}
    load = OtherLoad()
    raws = copies(raw, nbytes, cold=True)
    layout = qtype
    if cpu.packs(qtype) and n % 4 == 0:  # what the models multiply by: the CPU layout made at load
        raws = [cpu.repack(w, qtype, n, k) for w in raws]
        layout = cpu.PACKED[qtype]
        res["type"] += "*"
    for T in ts:
        x = torch.randn(T, k)
        out = torch.empty(T, n)
        # the models' path: activations quantized the way llama.cpp quantizes them, integer kernels
        res[f"q{T}"] = timeit(lambda w: cpu.qmatmul(x, w, layout, n, k, out=out, act_quant=True), [(w,) for w in raws],
                              min_time=0.2 if T < 100 else 0.5, max_rounds=3 if T >= 100 else 40)
    del raws
    if do_torch:
        W = cpu.dequant_rows(raw, qtype, torch.arange(n), k)
        for dt_name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
            Ws = copies(W.to(dt), W.numel() * (4 if dt == torch.float32 else 2), cold=True)
            for T in ts:
                x = torch.randn(T, k).to(dt)
                res[f"{dt_name}{T}"] = timeit(lambda w: torch.nn.functional.linear(x, w), [(w,) for w in Ws],
                                              min_time=0.2 if T < 100 else 0.5, max_rounds=3 if T >= 100 else 40)
            del Ws
        del W
    res["others"] = load.cpus()
    rows.append(res)
    return res


def fmt_row(r, ts, do_torch):
    gbs = r["MB"] * 1e6 / r["q1"] / 1e9 if "q1" in r else float("nan")
    cells = [f"{r['type']:6s} {r['N']:>6d}x{r['K']:<5d} {r['MB']:7.1f}MB"]
    for T in ts:
        cells.append(f"{r[f'q{T}'] * 1e3:8.3f}")
    cells.append(f"{gbs:6.1f}")
    if do_torch:
        for name, bpw in (("f32", 4), ("bf16", 2)):
            for T in ts:
                cells.append(f"{r[f'{name}{T}'] * 1e3:8.3f}")
            cells.append(f"{r['N'] * r['K'] * bpw / r[f'{name}1'] / 1e9:6.1f}" if 1 in ts else "")
    return " ".join(cells)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="", help="comma-separated name prefixes (default: all downloaded)")
    ap.add_argument("--ts", default="1,4,128", help="activation rows to time (default 1,4,128)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch f32 / bf16 comparison")
    ap.add_argument("--threads", type=int, default=0, help="torch / kernel threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ts = [int(v) for v in args.ts.split(",") if v]
    do_torch = not args.no_torch

    t0 = time.perf_counter()
    ok = cpu.available()
    info = cpu.build_info()
    print(f"kernels: {'available' if ok else 'UNAVAILABLE: ' + str(info['reason'])}; binding={info['binding']}; "
          f"library={info['path']}; " + (f"built in {info['build_s']:.1f}s" if info["build_s"] else
                                         f"cached (load {time.perf_counter() - t0:.2f}s)"))
    if not ok:
        return 1
    cpuname = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"cpu: {cpuname}; {os.cpu_count()} cpus; torch threads {torch.get_num_threads()}; torch {torch.__version__}")
    bw = machine_bandwidth()
    print("machine streaming bandwidth: " + ", ".join(f"{k} {v:.1f}" for k, v in bw.items()))

    from sharpi_core.registry import REGISTRY, cached_path, is_cached
    wanted = [p for p in args.models.split(",") if p]
    models = [m for m in REGISTRY if is_cached(m) and (not wanted or any(m.startswith(p) for p in wanted))]
    if not models:
        print("no downloaded registry models match", file=sys.stderr)
        return 1

    head = f"{'type':5s} {'N x K':>12s} {'size':>9s} " + " ".join(f"{'T=' + str(T):>8s}" for T in ts) + "   GB/s"
    if do_torch:
        for name in ("f32", "bf16"):
            head += " | " + " ".join(f"{name + ' T=' + str(T):>8s}" for T in ts) + "   GB/s"
    for m in models:
        print(f"\n== {m}  (times in ms per call; GB/s = weight bytes / time at T=1)")
        print(head)
        rows: list = []
        step = {T: 0.0 for T in ts}
        step_t = {(name, T): 0.0 for name in ("f32", "bf16") for T in ts}
        for (qtype, n, k), count, t in model_shapes(str(cached_path(m))):
            if qtype not in cpu.SUPPORTED:
                print(f"{qtype.name:5s} {n:>6d}x{k:<5d} (not supported by the kernels; x{count})")
                continue
            r = bench_shape(t, qtype, n, k, ts, do_torch, rows)
            flag = f"  [other processes used {r['others']:.1f} cpus: timings unreliable]" if r["others"] > 0.1 else ""
            print(fmt_row(r, ts, do_torch) + f"   x{count} {t.name}" + flag, flush=True)
            for T in ts:
                step[T] += count * r[f"q{T}"]
                if do_torch:
                    for name in ("f32", "bf16"):
                        step_t[(name, T)] += count * r[f"{name}{T}"]
        line = "   all matmuls of one forward pass: " + ", ".join(f"T={T}: {step[T] * 1e3:.2f} ms" for T in ts)
        if 1 in step:
            line += f"  (=> at most {1 / step[1]:.0f} tok/s decode from matmuls alone)"
        print(line)
        if do_torch:
            for name in ("f32", "bf16"):
                print(f"   torch {name:4s}: " + ", ".join(f"T={T}: {step_t[(name, T)] * 1e3:.2f} ms" for T in ts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
