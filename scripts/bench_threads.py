"""Decode speed with the thread governor (sharpi_core/threads.py) on and off, on an idle machine and
with busy background processes, side by side in one run.

    python scripts/bench_threads.py [-m NAME_OR_PATH ...] [-n 256] [--reps 3] [--busy 0,1]

Each cell is the median decode t/s of `sharpi -p ... -n N --temp 0 --ignore-eos` (default -t, i.e.
all cores), runs alternating governor on / off (SHARPI_THREADS_ADAPT=1 / 0). The background load is
that many processes spinning on the CPU, started before and stopped after each cell.
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


def decode_tps(model: str, n: int, adapt: bool) -> float:
    cmd = (shutil.which("sharpi") or f"{sys.executable} -m sharpi_cli.main").split()
    env = dict(os.environ, SHARPI_THREADS_ADAPT="1" if adapt else "0")
    r = subprocess.run([*cmd, "-m", model, "-p", PROMPT, "-n", str(n), "--temp", "0", "--ignore-eos"],
                       capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=1800)
    m = re.search(r" eval time =.*?([\d.]+) tokens per second", r.stderr.split("prompt eval time")[-1])
    if r.returncode or not m:
        raise SystemExit(f"sharpi failed: {r.stderr[-2000:]}")
    return float(m[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", help="model name or path (repeatable)")
    ap.add_argument("-n", type=int, default=256, help="tokens generated per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--busy", default="0,1", help="background busy processes per cell, comma-separated")
    a = ap.parse_args()
    models = a.model or ["smollm2-135m-instruct-q4_1"]
    print(f"cores: {len(os.sched_getaffinity(0))}; -n {a.n}, median of {a.reps}")
    print("| model | busy processes | governor on t/s | off t/s | on/off |")
    print("|---|---|---|---|---|")
    for model in models:
        for busy in (int(b) for b in a.busy.split(",")):
            spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
            try:
                on, off = [], []
                for _ in range(a.reps):
                    on.append(decode_tps(model, a.n, True))
                    off.append(decode_tps(model, a.n, False))
            finally:
                for p in spin:
                    p.kill()
                    p.wait()
            mon, moff = statistics.median(on), statistics.median(off)
            print(f"| {model} | {busy} | {mon:.1f} | {moff:.1f} | {mon / moff:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
