#!/usr/bin/env python3
"""llama.cpp's greedy tokens through context shifts: the oracle of tests/test_context_shift.py.

    python scripts/llamacpp_context_shift.py LLAMA_CPP_SRC BIN_DIR [-o tests/data/llamacpp_context_shift.json]

Builds scripts/llamacpp_logits.c (as compare_llamacpp_logits.py does) and lets libllama decode each
case greedily with LCP_SHIFT_KEEP: before a token that would fill the context, llama-completion's
--context-shift (llama_memory_seq_rm of [keep, keep + n_discard), llama_memory_seq_add of the rest by
-n_discard, n_discard half of what follows keep; the K-shift is llama.cpp's own). With
LCP_SHIFT_COMPACT the shifted sequence is saved and loaded back into an empty cache, so its cells are in
position order as sharpi keeps them: llama.cpp itself writes the next tokens into the freed cells,
which changes the order its flash attention sums in (an fp16 accumulator: ~2% logit noise, see the
README). With the order equal, sharpi's logits equal llama.cpp's bit for bit through the shifts.
Every case's n_ctx is a multiple of 256 (llama.cpp pads smaller contexts up to it). Gemma 3 runs
with full-size sliding-window caches (--swa-full; llama.cpp cannot shift its sliding-window ring).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from compare_llamacpp_logits import build, oracle_args  # noqa: E402
from sharpi_core.gguf_file import GGUFFile  # noqa: E402
from sharpi_core.registry import resolve_model  # noqa: E402
from sharpi_core.tokenizer import Tokenizer  # noqa: E402

# (model, prompt, n_ctx, --keep, KV cache type, tokens to generate)
CASES = [
    ("smollm2-135m-instruct-q4_1", "The history of the Roman Empire", 256, 0, "f16", 420),
    ("smollm2-135m-instruct-q4_1", "The history of the Roman Empire", 256, 4, "q8_0", 420),
    ("smollm2-135m-instruct-q4_1", "Once upon a time, in a small village by the sea,", 256, -1, "f16", 420),
    ("gemma3-270m-q4_k_m", "The history of the Roman Empire", 256, 0, "f16", 420),
    ("qwen2.5-coder-0.5b-instruct-q4_k_m", "The history of the Roman Empire", 256, 4, "q8_0", 400),
]


def keep_count(keep: int, n_prompt: int, add_bos: bool, n_ctx: int) -> int:
    """llama-completion's n_keep (the rule sharpi's Generator follows)."""
    n = n_prompt if keep < 0 or keep > n_prompt else keep + int(add_bos)
    return max(0, min(n, n_ctx - 4))


def main() -> None:
    args = oracle_args(__doc__, "llamacpp_context_shift.json")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(args.src, args.bin, Path(tmp))
        for name, prompt, n_ctx, keep, kv, n_gen in CASES:
            path = resolve_model(name)
            gf = GGUFFile(path)
            tok = Tokenizer.from_gguf(gf)
            n_vocab = len(gf.get("tokenizer.ggml.tokens"))
            ids = tok.encode(prompt)
            n_keep = keep_count(keep, len(ids), tok.add_bos, n_ctx)
            env = {**os.environ, "LCP_N_CTX": str(n_ctx), "LCP_SHIFT_KEEP": str(n_keep), "LCP_SHIFT_COMPACT": "1",
                   "LCP_KV_Q8_0": str(int(kv == "q8_0")), "LCP_SWA_FULL": "1"}
            raw = subprocess.run([str(exe), str(path), str(n_gen), str(args.t), *map(str, ids)],
                                 capture_output=True, check=True, env=env).stdout
            lg = np.frombuffer(raw[: (n_gen + 1) * n_vocab * 4], dtype=np.float32).reshape(n_gen + 1, -1)
            chosen = np.frombuffer(raw[(n_gen + 1) * n_vocab * 4:], dtype=np.int32).tolist()
            if set(chosen) & set(tok.eog_ids):
                raise SystemExit(f"{name} {prompt!r}: llama.cpp's greedy path ends the generation: choose another prompt")
            top2 = np.sort(lg, axis=1)[:, -2:]
            out.append({"model": name, "prompt": prompt, "prompt_ids": ids, "n_ctx": n_ctx, "keep": keep,
                        "n_keep": n_keep, "cache_type": kv, "tokens": chosen,
                        # the smallest top-2 gap on the path: how close a wrong logit would come to flipping a token
                        "min_top2_gap": float((top2[:, 1] - top2[:, 0]).min())})
            print(f"{name} keep {keep} ({n_keep} kept) {kv}: {len(chosen)} tokens, "
                  f"min top-2 gap {out[-1]['min_top2_gap']:.3g}: {tok.decode(chosen)[-60:]!r}", file=sys.stderr)
    args.out.write_text(json.dumps({"llama_cpp": "llama_cpp_python 0.3.36 vendor tree, scripts/llamacpp_logits.c with "
                                    "LCP_SHIFT_KEEP and LCP_SHIFT_COMPACT", "cases": out}, indent=None) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
