#!/usr/bin/env python3
"""llama.cpp's greedy text with control vectors: the oracle of tests/test_control_vector.py.

    python scripts/llamacpp_control_vector.py BIN_DIR [-o tests/data/llamacpp_control_vector.json]

Writes seeded random control vectors for SmolLM2 (write_vector: the test rebuilds the same files) and
records what llama-completion (BIN_DIR, greedy, -n 24) prints after each prompt with --control-vector,
--control-vector-scaled and --control-vector-layer-range, and without any (the model's own text, which
every case must differ from, or the vectors would test nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from gguf_derive import finish  # noqa: E402

MODEL = "smollm2-135m-instruct-q4_1"
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
N_PREDICT = 24
# name -> (seed, layers, scale of the random directions)
VECTORS = {"a": (1, list(range(1, 30)), 0.6), "b": (2, [3, 7, 12, 40], 1.5)}  # (layer 40: past the model's 30)
# each case: the control-vector flags, as llama-completion and sharpi both take them ({a}, {b}: the files)
CASES = [
    ["--control-vector", "{a}"],
    ["--control-vector-scaled", "{a}:-1.5"],
    ["--control-vector", "{a},{b}"],
    ["--control-vector", "{a}", "--control-vector-scaled", "{b}:0.5", "--control-vector-layer-range", "5", "20"],
]


def write_vector(path: Path, name: str, n_embd: int = 576) -> None:
    """Control vector `name` of VECTORS: direction.<layer> float32 [n_embd], N(0, scale^2) from the seed."""
    seed, layers, scale = VECTORS[name]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "controlvector")
    w.add_string("controlvector.model_hint", "llama")
    w.add_uint32("controlvector.layer_count", len(layers))
    for il in layers:
        w.add_tensor(f"direction.{il}", (rng.standard_normal(n_embd) * scale).astype(np.float32))
    finish(w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bin", type=Path, help="llama.cpp build dir holding llama-completion")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "tests" / "data" / "llamacpp_control_vector.json")
    a = ap.parse_args()
    from sharpi_core.registry import resolve_model
    model = resolve_model(MODEL)
    env = dict(os.environ, LD_LIBRARY_PATH=str(a.bin))
    out = {"llama_cpp": "llama_cpp_python 0.3.36 vendor tree, llama-completion", "model": MODEL,
           "n_predict": N_PREDICT, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        files = {n: Path(tmp) / f"{n}.gguf" for n in VECTORS}
        for n, p in files.items():
            write_vector(p, n)

        def complete(prompt: str, flags: list[str]) -> str:
            cmd = [str(a.bin / "llama-completion"), "-m", str(model), "-p", prompt, "-n", str(N_PREDICT),
                   "--temp", "0", "-t", "2", "--no-warmup", "--no-display-prompt", "-no-cnv", "-c", "256", "-s", "1",
                   *[f.format(**{n: str(p) for n, p in files.items()}) for f in flags]]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
            if r.returncode:
                raise SystemExit(f"{' '.join(cmd)}\n{r.stderr[-2000:]}")
            return r.stdout

        for prompt in PROMPTS:
            plain = complete(prompt, [])
            for flags in CASES:
                text = complete(prompt, flags)
                print(f"{prompt!r} {' '.join(flags)}: {text!r}")
                assert text != plain, f"{flags}: the same text as without control vectors"
                out["cases"].append({"prompt": prompt, "flags": flags, "text": text, "plain": plain})
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
