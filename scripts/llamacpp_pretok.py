#!/usr/bin/env python3
"""libllama's ids for every pre-tokenizer name sharpi accepts: the oracle of tests/test_tokenizer.py.

    python scripts/llamacpp_pretok.py LLAMA_CPP_SRC BIN_DIR [-o tests/data/llamacpp_pretok.json]

The pre-tokenizer (tokenizer.ggml.pre) picks the regexes that split text before BPE. Only a few
names come with a model here, so each is tried on Qwen2.5's byte-level BPE vocabulary with its
tokenizer.ggml.pre set to that name (a vocabulary-only copy of the GGUF, as
scripts/llamacpp_vocab_check.py makes them): libllama (scripts/llamacpp_tokenize.c) tokenizes TEXTS,
and the test expects sharpi's ids to be the same for every name and text.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from compare_llamacpp_logits import build  # noqa: E402
from llamacpp_vocab_check import EXTRA, llama_cpp_ids, with_pre  # noqa: E402
from sharpi_core.registry import resolve_model  # noqa: E402
from sharpi_core.tokenizer import PRE_TOKENIZERS  # noqa: E402

SOURCE = "qwen2.5-coder-0.5b-instruct-q4_k_m"
TEXTS = EXTRA + ["Hello world", " Hello World!", "\n\n\n \t\t x", "1 12 123 1234 12345 3.14159", "🦙🦙 llama.cpp 🤗",
                 "int main() {\n    return a->b[i] != c;\n}\n", "'s 're 'VE 'll", "a\u00a0b\u3000c", "Ünïcödé ẞ ǅ ǈ",
                 "`ls -la` a=`b`+c|d^e~f x=12345678901", "हिन्दी भाषा ภาษาไทย مَرْحَبًا", "abc123def 4567ghi",
                 # letters, digits, marks and symbols Unicode 16.0 added (no class in llama.cpp's 15.1 tables)
                 "\U00013460're \U00010d40\U00010d41's x\u1c89y \U00011bf0\U00011bf1 12 a\u0897b \U000113b8 \U0001fa89!",
                 # non-ASCII spaces beside characters that deepseek's literal ranges list (U+3000, U+0800..U+4E00)
                 "\t\t\u3000 x\u3000\u3001 \u6771\u2009\u4eac\u3000\u3000\ud55c \u2028\u26ce \u00a0\u2003\u0915"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="llama.cpp source tree")
    ap.add_argument("bin", type=Path, help="llama.cpp build dir holding libllama")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "tests" / "data" / "llamacpp_pretok.json")
    args = ap.parse_args()
    ids = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(args.src, args.bin, Path(tmp), "llamacpp_tokenize")
        for pre in sorted(PRE_TOKENIZERS):
            path = Path(tmp) / "vocab.gguf"
            with_pre(resolve_model(SOURCE), path, pre)
            ids[pre] = llama_cpp_ids(exe, path, TEXTS)
            print(f"{pre}: {sum(map(len, ids[pre]))} ids", file=sys.stderr)
    args.out.write_text(json.dumps({"llama_cpp": "llama_cpp_python 0.3.36 vendor tree, scripts/llamacpp_tokenize.c",
                                    "vocabulary": SOURCE, "texts": TEXTS, "ids": ids}, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
