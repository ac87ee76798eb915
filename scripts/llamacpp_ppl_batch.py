#!/usr/bin/env python3
"""llama-perplexity's output with its batch flags (-b, -ub): the oracle of tests/test_kld.py's batch test.

    python scripts/llamacpp_ppl_batch.py BIN_DIR [-o tests/data/llamacpp_ppl_batch.json]

BIN_DIR holds llama-perplexity (the fixtures' build). A chunk is evaluated in batches of -b rows where -b is below -c,
each in passes of -ub rows (and in passes of -ub rows where a batch holds one chunk), and where a batch holds several
chunks each pass takes -ub / chunks rows of every one: the passes' row counts reach the kernels, so the last digits
move with them. For each case the chunk line ([1]..,[2]..,) or the --ppl-output-type 1
lines, and the final estimate.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compare_llamacpp_logits import FIXTURES_DIR  # noqa: E402
from sharpi_core.registry import resolve_model  # noqa: E402

TEXT = "apache-2.0.txt"  # (in the fixtures)
CASES = [  # (model, flags)
    ("smollm2-135m-instruct-q4_1", ["-c", "512", "-b", "128"]),
    ("smollm2-135m-instruct-q4_1", ["-c", "512", "-b", "512", "-ub", "100"]),
    ("smollm2-135m-instruct-q4_1", ["-c", "512", "-b", "96"]),
    ("smollm2-135m-instruct-q4_1", ["-c", "256", "-b", "512", "--ppl-output-type", "1"]),
    ("qwen2.5-coder-0.5b-instruct-q4_k_m", ["-c", "512", "-b", "200", "-ub", "50"]),
    ("gemma3-270m-q4_k_m", ["-c", "256", "-b", "256", "-ub", "64", "-ctk", "q8_0", "-ctv", "q8_0"]),
    # several chunks a batch: each pass the next -ub / chunks rows of every chunk (21 chunks of 96: 24 rows each)
    ("smollm2-135m-instruct-q4_1", ["-c", "96"]),
    ("qwen2.5-coder-0.5b-instruct-q4_k_m", ["-c", "100"]),  # (20 chunks, 25 rows each: Q4_K's row groups of 4)
    ("gemma3-270m-q4_k_m", ["-c", "300", "-b", "1000", "-ub", "128"]),
    ("qwen2.5-coder-0.5b-instruct-q4_k_m", ["-c", "200", "-b", "1000", "-ub", "70", "-fa", "off"]),
    # -b not a multiple of -ub: a batch's last pass is the rest of it (100, 100, 50 | 50 rows)
    ("qwen2.5-coder-0.5b-instruct-q4_k_m", ["-c", "300", "-b", "250", "-ub", "100", "--chunks", "2"]),
    # -f drops one trailing newline: the text's tokens are 4 chunks of 443, not 5
    ("smollm2-135m-instruct-q4_1", ["-c", "443"]),
]


def results(stdout: str, stderr: str) -> dict:
    """The chunk values (stdout: a line of [i]PPL, or the lines of output type 1) and the final estimate (in the
    log on stderr)."""
    final = re.search(r"Final estimate: PPL = [0-9.]+ \+/- [0-9.]+", stderr).group(0)
    lines = stdout.splitlines()
    chunks = [ln.strip() for ln in lines if ln.startswith("[1]")] or [ln for ln in lines if ln.startswith("   ")]
    return {"chunks": chunks, "final": final}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bin_dir", type=Path)
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "tests" / "data" / "llamacpp_ppl_batch.json")
    a = ap.parse_args()
    text = FIXTURES_DIR / TEXT
    cases = []
    for model, flags in CASES:
        env = dict(os.environ, LD_LIBRARY_PATH=str(a.bin_dir))
        r = subprocess.run([str(a.bin_dir / "llama-perplexity"), "-m", str(resolve_model(model)), "-f", str(text),
                            "-t", "2", *flags], capture_output=True, text=True, env=env, timeout=1200)
        if r.returncode != 0:
            raise SystemExit(f"llama-perplexity {' '.join(flags)} failed:\n{r.stderr[-2000:]}")
        cases.append({"model": model, "text": TEXT, "flags": flags, **results(r.stdout, r.stderr)})
        print(model, " ".join(flags), cases[-1]["final"], flush=True)
    a.out.write_text(json.dumps({"cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
