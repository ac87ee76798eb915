#!/usr/bin/env python
"""Where a GPU decoding step's time goes: every kernel of the step, its share and its calls (a diagnostic,
not a test). Needs cupy, an NVIDIA GPU and torch's profiler (CUPTI, which also sees CuPy's kernels and
those a CUDA graph replays).

    python scripts/profile_cuda.py -m qwen2.5-coder-1.5b-instruct-q4_k_m -p 128 --rows 1,5

For each --rows T (1 = a plain greedy step; T > 1 = a verify pass of T tokens, as speculation runs it):
the wall time of a step (timed without the profiler), the kernels' time summed, and the difference,
which is the GPU waiting between kernels (launch latency, dependencies) or on the CPU; then the kernels
grouped by name, most time first.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    ap.add_argument("-p", type=int, default=128, help="prompt tokens before the timed steps (context)")
    ap.add_argument("-n", type=int, default=32, help="steps timed and profiled")
    ap.add_argument("--rows", default="1,5", help="tokens a step: 1 = decode, T > 1 = a verify pass")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from sharpi_core.backends.cuda import cuda_available
    from sharpi_core.backends.cuda_model import CudaTransformer
    from sharpi_core.models import load_model
    from sharpi_core.registry import resolve_model

    ok, why = cuda_available()
    if not ok:
        print(f"error: {why}", file=sys.stderr)
        return 2
    import cupy as cp

    model = CudaTransformer(load_model(resolve_model(a.model)))
    cache = model.new_cache(a.p + 64)
    prompt = torch.randint(0, model.config.n_vocab, (a.p,), generator=torch.Generator().manual_seed(0))
    print(f"{a.model} on {why}; context {a.p}")
    for T in [int(t) for t in a.rows.split(",")]:
        toks = torch.tensor([1] * T)

        def step() -> None:
            cache.truncate(a.p)
            model.forward_argmax(toks, a.p, cache, decode=T > 1).tolist()  # .tolist(): waits for the GPU

        cache.truncate(0)
        model.forward(prompt, 0, cache, last_n=1)
        for _ in range(5):  # compiles, captures the graphs
            step()
        t0 = time.perf_counter()
        for _ in range(a.n):
            step()
        wall = (time.perf_counter() - t0) / a.n * 1e6
        if not torch.cuda.is_available():  # a CPU build of torch: its profiler sees no GPU kernels
            print(f"\nT={T}: step {wall:.0f} us wall (kernel times need a CUDA build of torch)")
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.n):
                step()
            cp.cuda.Device().synchronize()
        per = defaultdict(lambda: [0, 0.0])  # name -> [calls, us]
        for e in prof.key_averages():
            us = getattr(e, "device_time_total", None)
            if us is None:
                us = e.cuda_time_total
            if us <= 0:
                continue
            per[e.key][0] += e.count
            per[e.key][1] += us
        busy = sum(v[1] for v in per.values()) / a.n
        calls = sum(v[0] for v in per.values()) / a.n
        print(f"\nT={T}: step {wall:.0f} us wall; kernels {busy:.0f} us ({calls:.0f} launches), "
              f"between and around them {wall - busy:.0f} us ({100 * (wall - busy) / wall:.0f}%)")
        print("| kernel | calls/step | us/step | % of kernels | us/call |\n|---|---|---|---|---|")
        for name, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:a.top]:
            print(f"| {name[:60]} | {n / a.n:.0f} | {us / a.n:.1f} | {100 * us / a.n / busy:.1f} | {us / n:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
