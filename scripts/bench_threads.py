"""Decode speed under settings of the CPU threads (by default the thread governor of sharpi_core/threads.py on
and off), on an idle machine and beside busy background processes, side by side in one run.

    python scripts/bench_threads.py [-m NAME_OR_PATH ...] [-n 256] [--reps 3] [--busy 0,1] [--load spin|omp]
                                    [--variant ENV ...] [--prompt TEXT]

Each cell is the median of `sharpi -p ... -n N --temp 0 --ignore-eos` runs (default -t, i.e. all cores), the
variants alternating: decode t/s, and the prompt's time (its first kernel calls, before the governor has seen
anything). A variant is a list of NAME=VALUE environment settings, comma-separated; the default pair is
SHARPI_THREADS_ADAPT=1 and =0. The background load is that many processes started before and stopped after each
cell: `spin`, a Python loop on one core; `omp`, torch matrix products on every core (OpenMP threads that spin at
their barriers, as another torch program does); `reduce`, torch sums of 2M floats on every core (short parallel
regions back to back, each thread spinning between them: a torch test suite's load).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys

PROMPT = "Write a long story about a dog"
LOADS = {"spin": "while True: pass",
         "omp": "import torch\na = torch.randn(256, 256)\nwhile True: a @ a",
         "reduce": "import torch\na = torch.randn(2_000_000)\nwhile True: a.sum()"}


def run_once(model: str, n: int, env: dict, prompt: str = PROMPT) -> tuple[float, float]:
    """(decode t/s, prompt ms) of one run."""
    cmd = (shutil.which("sharpi") or f"{sys.executable} -m sharpi_cli.main").split()
    r = subprocess.run([*cmd, "-m", model, "-p", prompt, "-n", str(n), "--temp", "0", "--ignore-eos"],
                       capture_output=True, text=True, env=dict(os.environ, **env), stdin=subprocess.DEVNULL,
                       timeout=1800)
    p = re.search(r"prompt eval time = +([\d.]+) ms", r.stderr)
    m = re.search(r" eval time =.*?([\d.]+) tokens per second", r.stderr.split("prompt eval time")[-1])
    if r.returncode or not m or not p:
        raise SystemExit(f"sharpi failed: {r.stderr[-2000:]}")
    return float(m[1]), float(p[1])


def parse_variant(text: str) -> dict:
    return dict(kv.split("=", 1) for kv in text.split(",") if kv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", help="model name or path (repeatable)")
    ap.add_argument("-n", type=int, default=256, help="tokens generated per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt", default=PROMPT, help="(a one-token prompt, e.g. Hello, is evaluated by the decoding "
                    "path: its time is a decoding step's before the governor has seen anything)")
    ap.add_argument("--busy", default="0,1", help="background processes per cell, comma-separated")
    ap.add_argument("--load", choices=sorted(LOADS), default="spin", help="what each background process runs")
    ap.add_argument("--variant", action="append", help="NAME=VALUE[,NAME=VALUE...] (repeatable; default: the "
                    "governor on, then off)")
    a = ap.parse_args()
    models = a.model or ["smollm2-135m-instruct-q4_1"]
    variants = a.variant or ["SHARPI_THREADS_ADAPT=1", "SHARPI_THREADS_ADAPT=0"]
    print(f"cores: {len(os.sched_getaffinity(0))}; -n {a.n}, median of {a.reps}; background: {a.load}")
    print("| model | busy | " + " | ".join(f"{v} t/s, prompt ms" for v in variants) + " | first / last t/s |")
    print("|---|---|" + "---|" * (len(variants) + 1))
    for model in models:
        for busy in (int(b) for b in a.busy.split(",")):
            load = [subprocess.Popen([sys.executable, "-c", LOADS[a.load]]) for _ in range(busy)]
            try:
                got: list[list[tuple[float, float]]] = [[] for _ in variants]
                for _ in range(a.reps):
                    for i, v in enumerate(variants):
                        got[i].append(run_once(model, a.n, parse_variant(v), a.prompt))
            finally:
                for p in load:
                    p.kill()
                    p.wait()
            tps = [statistics.median(t for t, _ in g) for g in got]
            ms = [statistics.median(m for _, m in g) for g in got]
            cells = " | ".join(f"{t:.1f}, {m:.0f}" for t, m in zip(tps, ms))
            print(f"| {model} | {busy} | {cells} | {tps[0] / tps[-1]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
