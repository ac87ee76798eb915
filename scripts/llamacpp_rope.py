#!/usr/bin/env python3
"""llama.cpp's greedy tokens under --rope-freq-base / --rope-freq-scale / --rope-scaling / --yarn-*: the oracle
of tests/test_rope.py.

    python scripts/llamacpp_rope.py LLAMA_CPP_SRC BIN_DIR [-o tests/data/llamacpp_rope.json]

Builds scripts/llamacpp_logits.c (as compare_llamacpp_logits.py does) and lets libllama decode each case
greedily with LCP_ROPE_FREQ_BASE / LCP_ROPE_FREQ_SCALE (its context parameters rope_freq_base and
rope_freq_scale; 0 = the model's), LCP_ROPE_SCALING and LCP_YARN_* (rope_scaling_type, yarn_ext_factor,
yarn_attn_factor, yarn_beta_fast, yarn_beta_slow, yarn_orig_ctx). sharpi's logits equal llama.cpp's bit for
bit there (Gemma 3's sliding layers keep their own base and scale in both), so the greedy tokens must match
exactly.
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

# (model, prompt, --rope-freq-base, --rope-freq-scale, tokens, YaRN settings: ModelConfig's names)
CASES = [
    ("smollm2-135m-instruct-q4_1", "The history of the Roman Empire", 50000.0, 0.5, 48, {}),
    ("smollm2-135m-instruct-q4_1", "Once upon a time, in a small village by the sea,", 0.0, 0.25, 48, {}),
    ("gemma3-270m-q4_k_m", "The history of the Roman Empire", 500000.0, 0.25, 48, {}),
    ("qwen2.5-coder-0.5b-instruct-q4_k_m", "def quicksort(arr):", 0.0, 0.5, 48, {}),
    # YaRN: the ramp over the pairs that turn 1-32 times in 256 positions, its magnitude factor
    ("smollm2-135m-instruct-q4_1", "The history of the Roman Empire", 0.0, 0.25, 48,
     {"rope_scaling": "yarn", "yarn_orig_ctx": 256}),
    # every setting given: a partial mix (the attention factor then YaRN's own, as llama.cpp's context)
    ("smollm2-135m-instruct-q4_1", "Once upon a time, in a small village by the sea,", 0.0, 0.3, 48,
     {"rope_scaling": "yarn", "yarn_orig_ctx": 256, "yarn_beta_fast": 8.0, "yarn_beta_slow": 0.5,
      "yarn_ext_factor": 0.7, "yarn_attn_factor": 1.3}),
    # no YaRN mix: the attention factor scales the tables as it is
    ("smollm2-135m-instruct-q4_1", "The history of the Roman Empire", 0.0, 0.0, 48, {"yarn_attn_factor": 1.3}),
    # Qwen2.5's published YaRN setting (factor 4 over 32768 positions), NeoX pairs
    ("qwen2.5-coder-0.5b-instruct-q4_k_m", "def quicksort(arr):", 0.0, 0.25, 48,
     {"rope_scaling": "yarn", "yarn_orig_ctx": 32768}),
]
ENV = {"rope_scaling": "LCP_ROPE_SCALING", "yarn_ext_factor": "LCP_YARN_EXT_FACTOR", "yarn_attn_factor": "LCP_YARN_ATTN_FACTOR",
       "yarn_beta_fast": "LCP_YARN_BETA_FAST", "yarn_beta_slow": "LCP_YARN_BETA_SLOW", "yarn_orig_ctx": "LCP_YARN_ORIG_CTX"}


def main() -> None:
    args = oracle_args(__doc__, "llamacpp_rope.json")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(args.src, args.bin, Path(tmp))
        for name, prompt, base, scale, n_gen, yarn in CASES:
            path = resolve_model(name)
            gf = GGUFFile(path)
            tok = Tokenizer.from_gguf(gf)
            n_vocab = len(gf.get("tokenizer.ggml.tokens"))
            ids = tok.encode(prompt)
            env = {**os.environ, "LCP_N_CTX": "512", "LCP_ROPE_FREQ_BASE": str(base), "LCP_ROPE_FREQ_SCALE": str(scale),
                   **{ENV[k]: str(v) for k, v in yarn.items()}}
            raw = subprocess.run([str(exe), str(path), str(n_gen), str(args.t), *map(str, ids)],
                                 capture_output=True, check=True, env=env).stdout
            chosen = list(int(x) for x in memoryview(raw[(n_gen + 1) * n_vocab * 4:]).cast("i"))
            out.append({"model": name, "prompt": prompt, "prompt_ids": ids, "rope_freq_base": base,
                        "rope_freq_scale": scale, **({"yarn": yarn} if yarn else {}), "tokens": chosen})
            print(f"{name} base {base:g} scale {scale:g} {yarn}: {tok.decode(chosen)[:70]!r}", file=sys.stderr)
    args.out.write_text(json.dumps({"llama_cpp": "llama_cpp_python 0.3.36 vendor tree, scripts/llamacpp_logits.c with "
                                    "LCP_ROPE_FREQ_BASE / LCP_ROPE_FREQ_SCALE / LCP_ROPE_SCALING / LCP_YARN_*", "cases": out}) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
