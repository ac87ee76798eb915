#!/usr/bin/env python3
"""llama-perplexity's multiple-choice scores (--hellaswag, --winogrande, --multiple-choice): the oracle of
tests/test_choice.py.

    python scripts/llamacpp_choice.py BIN_DIR [-o tests/data/llamacpp_choice.json]

BIN_DIR holds llama-perplexity (the fixtures' build, with libstdc++: its random task draws are libstdc++'s). The
data are tests/data/choice/: a HellaSwag file (6 lines a task), a Winogrande CSV (a header, a quoted sentence with a
comma, a row without '_', short rests after the choice), and the binary multiple-choice format, written here from
mc.json / mc5.json (mc5 has tasks of 5 answers, which need -np 5). For each case llama-perplexity's stdout lines
(the running scores) and its closing lines on stderr (Final ..., Random chance ...), or its error line. Also the
task draws of std::mt19937(1) with libstdc++'s uniform_int_distribution and of llama-perplexity's float scaling, from
a C++ program built here with g++, for the draws' own test.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sharpi_core.registry import resolve_model  # noqa: E402

DATA = ROOT / "tests" / "data" / "choice"
SMOL, QWEN, GEMMA = "smollm2-135m-instruct-q4_1", "qwen2.5-coder-0.5b-instruct-q4_k_m", "gemma3-270m-q4_k_m"
CASES = [  # (model, flags)
    (SMOL, ["--hellaswag", "-f", "hellaswag.txt"]),
    (SMOL, ["--hellaswag", "-f", "hellaswag.txt", "--hellaswag-tasks", "9"]),
    (QWEN, ["--hellaswag", "-f", "hellaswag.txt"]),
    (GEMMA, ["--hellaswag", "-f", "hellaswag.txt", "-ctk", "q8_0", "-ctv", "q8_0"]),
    (SMOL, ["--winogrande", "-f", "winogrande.csv"]),
    (SMOL, ["--winogrande", "-f", "winogrande.csv", "--winogrande-tasks", "6"]),
    (QWEN, ["--winogrande", "-f", "winogrande.csv"]),
    (GEMMA, ["--winogrande", "-f", "winogrande.csv"]),
    (SMOL, ["--multiple-choice", "-bf", "mc.bin"]),
    (SMOL, ["--multiple-choice", "-bf", "mc.bin", "--multiple-choice-tasks", "5"]),
    (QWEN, ["--multiple-choice", "-bf", "mc.bin"]),
    (GEMMA, ["--multiple-choice", "-bf", "mc.bin"]),
    (SMOL, ["--multiple-choice", "-bf", "mc5.bin", "-np", "5"]),
    (SMOL, ["--multiple-choice", "-bf", "mc5.bin"]),
    (SMOL, ["--winogrande", "-f", "winogrande.csv", "-fa", "off"]),
    (QWEN, ["--winogrande", "-f", "winogrande.csv", "-b", "64", "-ub", "16"]),  # (a batch in 16-row passes)
    (SMOL, ["--hellaswag", "-f", "hellaswag.txt", "-np", "8", "-ub", "100"]),  # (2 tasks a batch, 100-row passes)
    (SMOL, ["--winogrande", "-f", "winogrande.csv", "-np", "16"]),  # (8 tasks a batch: passes of >= 64 rows, tiled)
    (QWEN, ["--winogrande", "-f", "winogrande.csv", "-np", "16"]),
    (GEMMA, ["--winogrande", "-f", "winogrande.csv", "-np", "16", "-fa", "off"]),
    (GEMMA, ["--multiple-choice", "-bf", "mc.bin", "-ub", "64", "-fa", "off", "-ctk", "q8_0"]),
    (SMOL, ["--hellaswag", "-f", "hellaswag_long.txt", "-c", "64"]),  # (4 x 64 rows, padded to 256: too few)
    (SMOL, ["--hellaswag", "-f", "hellaswag_long.txt", "-c", "65"]),  # (260, padded to 512)
]
DRAWS_CPP = r"""
#include <cstdio>
#include <random>
#include <vector>
int main() {
    const size_t ns[] = {1, 2, 3, 7, 14, 1000, 10042, 4000000000u};
    for (size_t n : ns) {  // uniform_int_distribution<size_t>(0, n - 1)
        std::mt19937 rng(1);
        std::printf("u %zu", n);
        for (int i = 0; i < 20; ++i) { std::uniform_int_distribution<size_t> d(0, n - 1); std::printf(" %zu", d(rng)); }
        std::printf("\n");
    }
    const size_t ms[] = {2, 5, 13, 1267, 100000};
    for (size_t n : ms) {  // llama-perplexity's float scaling, as winogrande draws
        std::mt19937 rng(1);
        float scale = 1/(1.f + (float)rng.max());
        std::printf("s %zu", n);
        for (int i = 0; i < 20; ++i) { int j = int(scale*rng()*n); std::printf(" %d", j); }
        std::printf("\n");
    }
}
"""


def write_mc(src: Path, dst: Path) -> None:
    """The binary multiple-choice format: uint32 count, each task's offset, then per task the question and two
    answer sets (uint32 count, uint32-length strings, int32 labels; the second empty)."""
    def string(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<I", len(b)) + b

    tasks = [string(q) + struct.pack("<I", len(a)) + b"".join(map(string, a)) + struct.pack(f"<{len(l)}i", *l)
             + struct.pack("<I", 0) for q, a, l in json.loads(src.read_text())]
    pos, offsets = 4 + 4 * len(tasks), []
    for t in tasks:
        offsets.append(pos)
        pos += len(t)
    dst.write_bytes(struct.pack(f"<I{len(tasks)}I", len(tasks), *offsets) + b"".join(tasks))


def draws() -> dict:
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "draws"
        subprocess.run(["g++", "-O1", "-x", "c++", "-", "-o", str(exe)], input=DRAWS_CPP, text=True, check=True)
        out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    res = {"uniform": {}, "scaled": {}}
    for line in out.splitlines():
        kind, n, *v = line.split()
        res["uniform" if kind == "u" else "scaled"][n] = [int(x) for x in v]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bin_dir", type=Path)
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "tests" / "data" / "llamacpp_choice.json")
    a = ap.parse_args()
    write_mc(DATA / "mc.json", DATA / "mc.bin")
    write_mc(DATA / "mc5.json", DATA / "mc5.bin")
    cases = []
    for model, flags in CASES:
        env = dict(os.environ, LD_LIBRARY_PATH=str(a.bin_dir))
        args = [str(DATA / f) if i and flags[i - 1] in ("-f", "-bf") else f for i, f in enumerate(flags)]
        r = subprocess.run([str(a.bin_dir / "llama-perplexity"), "-m", str(resolve_model(model)), "-t", "2", *args],
                           capture_output=True, text=True, env=env, timeout=1200)
        if r.returncode != 0:
            raise SystemExit(f"llama-perplexity {' '.join(flags)} failed:\n{r.stderr[-2000:]}")
        body = r.stdout.split("\nllama_perf")[0]  # (the perf report follows the scores)
        lines = [ln for ln in body.splitlines() if re.match(r"\d+\t", ln)]
        log = [re.sub(r"^[0-9.]+ [IWE] ", "", ln) for ln in r.stderr.splitlines()]  # (its timestamps off)
        final = [ln for ln in log if re.match(r"Final |Random chance", ln)]
        errors = [ln for ln in log if re.search(r"does not fit|requires a higher|failed to|no _ in", ln)]
        cases.append({"model": model, "flags": flags, "lines": lines, "final": final, "errors": errors})
        print(model, " ".join(flags), len(lines), final, errors, flush=True)
    a.out.write_text(json.dumps({"cases": cases, "draws": draws()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
