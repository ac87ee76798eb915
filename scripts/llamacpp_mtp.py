#!/usr/bin/env python3
"""llama.cpp's MTP head on the qwen35 derivative (or qwen35moe's): the oracle of tests/test_mtp.py.

    python scripts/llamacpp_mtp.py LLAMA_CPP_SRC BIN_DIR [--variant qwen35moe] [-o tests/data/llamacpp_mtp.json]

(The default output is tests/data/llamacpp_mtp.json for qwen35, llamacpp_mtp_qwen35moe.json for qwen35moe, whose MTP
block's FFN is experts and a gated shared expert.)

scripts/gguf_derive.py's qwen35 variant carries an MTP block (blk.{n_layer}: a gated attention layer, eh_proj,
enorm, hnorm, shared_head_norm). libllama (scripts/llamacpp_mtp.c) evaluates each prompt on the target with its
next-token-prediction rows on, runs the MTP context over the prompt's (token, previous row) pairs and drafts K tokens
greedily from the target's next token, as common/speculative.cpp's draft-mtp driver does. Recorded per prompt: the
target's next token, the drafted ids, and the top logits (ids and values) of three prompt rows and every draft step.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from compare_llamacpp_logits import FIXTURES_DIR, build, oracle_args  # noqa: E402
from gguf_derive import DEFAULT_SOURCE, derive  # noqa: E402
from sharpi_core.gguf_file import GGUFFile  # noqa: E402
from sharpi_core.registry import resolve_model  # noqa: E402
from sharpi_core.tokenizer import Tokenizer  # noqa: E402


K = 6  # draft steps
TOP = 8  # logits recorded per row


def prompts() -> list[str]:
    ref = json.loads((FIXTURES_DIR / "llamacpp_reference.json").read_text())[DEFAULT_SOURCE]["greedy"]
    return [c["prompt"] for c in ref][:3] + [(FIXTURES_DIR / "apache-2.0.txt").read_text()[:1300]]


def main() -> None:
    args = oracle_args(__doc__, "llamacpp_mtp.json", lambda ap: ap.add_argument(
        "--variant", choices=("qwen35", "qwen35moe"), default="qwen35"))
    if args.variant != "qwen35" and args.out == ROOT / "tests" / "data" / "llamacpp_mtp.json":
        args.out = ROOT / "tests" / "data" / f"llamacpp_mtp_{args.variant}.json"
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(args.src, args.bin, Path(tmp), "llamacpp_mtp")
        path = Path(tmp) / f"{args.variant}.gguf"
        derive(args.variant, str(resolve_model(DEFAULT_SOURCE)), str(path))
        tok = Tokenizer.from_gguf(GGUFFile(path))
        for prompt in prompts():
            ids = tok.encode(prompt)
            raw = subprocess.run([str(exe), str(path), str(K), str(args.t), *map(str, ids)], capture_output=True,
                                 check=True).stdout
            n_vocab, T, k = np.frombuffer(raw[:12], dtype=np.int32).tolist()
            lg = np.frombuffer(raw[12:12 + 4 * n_vocab * (3 + k)], dtype=np.float32).reshape(3 + k, n_vocab)
            chosen = np.frombuffer(raw[12 + 4 * n_vocab * (3 + k):], dtype=np.int32).tolist()
            top = [np.argsort(-row, kind="stable")[:TOP] for row in lg]
            rows = [[i, t.tolist(), lg[r][t].tolist()] for r, (i, t) in enumerate(zip([0, T // 2, T - 1], top))]
            drafts = [[s, t.tolist(), lg[3 + s][t].tolist()] for s, t in enumerate(top[3:])]
            out.append({"prompt_ids": ids, "next": chosen[0], "drafts": chosen[1:], "prompt_rows": rows,
                        "draft_rows": drafts})
            print(f"{T} prompt tokens: next {chosen[0]}, drafts {chosen[1:]}", file=sys.stderr)
    args.out.write_text(json.dumps({"llama_cpp": "llama_cpp_python 0.3.36 vendor tree, scripts/llamacpp_mtp.c",
                                    "source": DEFAULT_SOURCE, "variant": args.variant, "k": K, "cases": out}) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
