#!/usr/bin/env python3
"""llama.cpp's greedy tokens under --rope-freq-base / --rope-freq-scale: the oracle of tests/test_rope.py.

    python scripts/llamacpp_rope.py LLAMA_CPP_SRC BIN_DIR [-o tests/data/llamacpp_rope.json]

Builds scripts/llamacpp_logits.c (as compare_llamacpp_logits.py does) and lets libllama decode each case
greedily with LCP_ROPE_FREQ_BASE / LCP_ROPE_FREQ_SCALE (its context parameters rope_freq_base and
rope_freq_scale; 0 = the model's). sharpi's logits equal llama.cpp's bit for bit there (Gemma 3's
sliding layers keep their own base and scale in both), so the greedy tokens must match exactly.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from compare_llamacpp_logits import build, oracle_args  # noqa: E402
from sharpi_core.gguf_file import GGUFFile  # noqa: E402
from sharpi_core.registry import resolve_model  # noqa: E402
from sharpi_core.tokenizer import Tokenizer  # noqa: E402

# (model, prompt, --rope-freq-base, --rope-freq-scale, tokens)
CASES = [
    ("smollm2-135m-instruct-q4_1", "The history of the Roman Empire", 50000.0, 0.5, 48),
    ("smollm2-135m-instruct-q4_1", "Once upon a time, in a small village by the sea,", 0.0, 0.25, 48),
    ("gemma3-270m-q4_k_m", "The history of the Roman Empire", 500000.0, 0.25, 48),
    ("qwen2.5-coder-0.5b-instruct-q4_k_m", "def quicksort(arr):", 0.0, 0.5, 48),
]


def main() -> None:
    args = oracle_args(__doc__, "llamacpp_rope.json")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(args.src, args.bin, Path(tmp))
        for name, prompt, base, scale, n_gen in CASES:
            path = resolve_model(name)
            gf = GGUFFile(path)
            tok = Tokenizer.from_gguf(gf)
            n_vocab = len(gf.get("tokenizer.ggml.tokens"))
            ids = tok.encode(prompt)
            env = {**os.environ, "LCP_N_CTX": "512", "LCP_ROPE_FREQ_BASE": str(base), "LCP_ROPE_FREQ_SCALE": str(scale)}
            raw = subprocess.run([str(exe), str(path), str(n_gen), str(args.t), *map(str, ids)],
                                 capture_output=True, check=True, env=env).stdout
            chosen = list(int(x) for x in memoryview(raw[(n_gen + 1) * n_vocab * 4:]).cast("i"))
            out.append({"model": name, "prompt": prompt, "prompt_ids": ids, "rope_freq_base": base,
                        "rope_freq_scale": scale, "tokens": chosen})
            print(f"{name} base {base:g} scale {scale:g}: {tok.decode(chosen)[:70]!r}", file=sys.stderr)
    args.out.write_text(json.dumps({"llama_cpp": "llama_cpp_python 0.3.36 vendor tree, scripts/llamacpp_logits.c with "
                                    "LCP_ROPE_FREQ_BASE / LCP_ROPE_FREQ_SCALE", "cases": out}) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
