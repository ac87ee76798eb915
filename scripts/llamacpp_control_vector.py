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


def bin_args(doc: str, out_name: str) -> argparse.Namespace:
    """BIN [-o OUT]: these oracle scripts' arguments (the llama.cpp build dir, the JSON in tests/data)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bin", type=Path, help="llama.cpp build dir holding llama-completion")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "tests" / "data" / out_name)
    return ap.parse_args()


def fill(flags: list[str], files: dict) -> list[str]:
    """The flags with {name} put in for the files written (name -> path)."""
    return [f.format(**{n: str(p) for n, p in files.items()}) for f in flags]


def run(bin_dir: Path, tool: str, args: list) -> subprocess.CompletedProcess:
    """llama.cpp's `tool` from bin_dir (its libraries there too); its exit status not 0: the script stops."""
    cmd = [str(bin_dir / tool), *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, LD_LIBRARY_PATH=str(bin_dir)),
                       stdin=subprocess.DEVNULL)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)}\n{r.stderr[-2000:]}")
    return r


def complete(bin_dir: Path, model, prompt: str, flags: list[str]) -> str:
    """llama-completion's greedy text (N_PREDICT tokens) after the prompt, with flags."""
    return run(bin_dir, "llama-completion", ["-m", model, "-p", prompt, "-n", N_PREDICT, "--temp", "0", "-t", "2",
                                             "--no-warmup", "--no-display-prompt", "-no-cnv", "-c", "256", "-s", "1",
                                             *flags]).stdout


def main() -> None:
    a = bin_args(__doc__, "llamacpp_control_vector.json")
    from sharpi_core.registry import resolve_model
    model = resolve_model(MODEL)
    out = {"llama_cpp": "llama_cpp_python 0.3.36 vendor tree, llama-completion", "model": MODEL,
           "n_predict": N_PREDICT, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        files = {n: Path(tmp) / f"{n}.gguf" for n in VECTORS}
        for n, p in files.items():
            write_vector(p, n)
        for prompt in PROMPTS:
            plain = complete(a.bin, model, prompt, [])
            for flags in CASES:
                text = complete(a.bin, model, prompt, fill(flags, files))
                print(f"{prompt!r} {' '.join(flags)}: {text!r}")
                assert text != plain, f"{flags}: the same text as without control vectors"
                out["cases"].append({"prompt": prompt, "flags": flags, "text": text, "plain": plain})
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
