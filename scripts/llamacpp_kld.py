#!/usr/bin/env python3
"""llama-perplexity's --kl-divergence-base files and --kl-divergence reports: the oracle of tests/test_kld.py.

    python scripts/llamacpp_kld.py BIN_DIR [-o tests/data/llamacpp_kld.json]

BIN_DIR holds llama-perplexity (the fixtures' build). For each case: the sha256 and size of the base file
llama-perplexity writes from a text (the file itself is tens of MB: sharpi's must hash the same), and the lines
of its KL-divergence report against that base for other settings (the chunk table and the statistics, from
the line starting "chunk" on); and its --ppl-output-type 1 lines (a line a chunk).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compare_llamacpp_logits import FIXTURES_DIR  # noqa: E402
from sharpi_core.registry import resolve_model  # noqa: E402

TEXT = FIXTURES_DIR / "apache-2.0.txt"
# (model, text, -c, --chunks, [KL-divergence runs' extra flags])
CASES = [
    # (no flags: the model against its own base, whose uncertainties of differences cancel to -nan)
    ("smollm2-135m-instruct-q4_1", "apache-2.0.txt", 128, 8, [["-ctk", "q4_0", "-ctv", "q4_0"], ["-fa", "off"], []]),
]


def run(bin_dir: Path, args: list[str]) -> str:
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))
    r = subprocess.run([str(bin_dir / "llama-perplexity"), "-t", "2", *args], capture_output=True, text=True, env=env,
                       timeout=1200)
    if r.returncode != 0:
        raise SystemExit(f"llama-perplexity {' '.join(args)} failed:\n{r.stderr[-2000:]}")
    return r.stdout + r.stderr


def report_lines(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("chunk "))
    end = next((i for i, ln in enumerate(lines) if ln.startswith("Same top p")), len(lines) - 1)
    return [ln for ln in lines[start:end + 1] if ln.strip()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bin_dir", type=Path)
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "tests" / "data" / "llamacpp_kld.json")
    a = ap.parse_args()
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, text, n_ctx, chunks, klds in CASES:
            path = str(resolve_model(model))
            base = Path(tmp) / "base.kld"
            run(a.bin_dir, ["-m", path, "-f", str(TEXT.parent / text), "-c", str(n_ctx), "--chunks", str(chunks),
                            "--kl-divergence-base", str(base)])
            data = base.read_bytes()
            runs = [{"flags": flags, "report": report_lines(run(a.bin_dir, ["-m", path, "-c", str(n_ctx),
                                                                           "--kl-divergence-base", str(base),
                                                                           "--kl-divergence", *flags]))}
                    for flags in klds]
            out = run(a.bin_dir, ["-m", path, "-f", str(TEXT.parent / text), "-c", str(n_ctx), "--chunks", str(chunks),
                                  "--ppl-output-type", "1"])
            type1 = [ln for ln in out.splitlines() if ln.startswith(" ") and len(ln.split()) == 4]
            cases.append({"model": model, "text": text, "n_ctx": n_ctx, "chunks": chunks, "base_size": len(data),
                          "base_sha256": hashlib.sha256(data).hexdigest(), "kl_divergence": runs,
                          "ppl_output_type_1": type1})
    a.out.write_text(json.dumps({"cases": cases}, indent=1, ensure_ascii=False) + "\n")
    print(f"{a.out}: {len(cases)} cases")


if __name__ == "__main__":
    main()
