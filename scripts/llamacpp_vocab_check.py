#!/usr/bin/env python3
"""sharpi's tokenizer against llama.cpp's on vocabularies beyond the four models (a check, not a test).

    python scripts/llamacpp_vocab_check.py LLAMA_CPP_SRC [BIN_DIR]

1. llama.cpp's own vocabulary tests: every models/ggml-vocab-*.gguf of its source tree with its .inp
   (texts) and .out (llama.cpp's ids) files, tokenized by sharpi without special tokens.
2. With BIN_DIR (holding libllama): every pre-tokenizer name sharpi accepts, and every one llama.cpp
   knows, on one byte-level BPE vocabulary (ggml-vocab-qwen2.gguf, the largest merge list there) whose
   tokenizer.ggml.pre is set to that name: all the test texts of step 1 through libllama's tokenizer
   (scripts/llamacpp_tokenize.c) and sharpi's. The regexes are what differs between pre-tokenizers, so
   this checks each one sharpi claims, most of which have no test vocabulary of their own.
Prints a line per vocabulary / name; exits 1 if any text's ids differ.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from compare_llamacpp_logits import build  # noqa: E402
from gguf_derive import copy_kv, finish  # noqa: E402
from sharpi_core.errors import SharpiError  # noqa: E402
from sharpi_core.gguf_file import GGUFFile  # noqa: E402
from sharpi_core.tokenizer import PRE_TOKENIZERS, Tokenizer  # noqa: E402

SEP = "\n__ggml_vocab_test__\n"
# step 2's texts beyond llama.cpp's tests: case changes inside words (tekken's and youtu-like classes),
# non-ASCII letters of both cases, marks, contractions in capitals, paths, CJK and kana, digits runs
EXTRA = ["HelloWorld camelCaseWord XMLHttpRequest iPhone McDonald's ÉCOLE école ÀÉÎõü ñandú",
         "ΑΒΓ αβγ Ωmega ДОМ дом Straße STRASSE e\u0301te\u0301 नमस्ते", "DON'T Won'T we'LL they'Re I'M",
         "path/to/file.txt\n/usr/bin/env  python3\r\n\tx = 12345678 + 0.5e-3", "東京タワーとひらがな한국어 テスト123",
         "  leading and trailing   \n\n\n", "¿Qué? ¡Sí! «quotes» “curly” — dash… 100% $5 #tag @user"]


def texts_of(inp: Path) -> list[str]:
    parts = inp.read_text(encoding="utf-8").split(SEP)
    return parts[:-1] if parts and parts[-1] == "" else parts


def encode_all(path: Path, texts: list[str]) -> list[list[int]] | str:
    try:
        tok = Tokenizer.from_gguf(GGUFFile(path))
    except SharpiError as e:
        return f"refused: {str(e).split(': ', 1)[-1][:90]}"
    return [tok.encode(t, add_special=False, parse_special=False) for t in texts]


def with_pre(src: Path, dst: Path, pre: str) -> None:
    """A vocabulary-only copy of the GGUF src (its metadata, no tensors) with tokenizer.ggml.pre = pre."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, str(r.fields["general.architecture"].contents()))
    copy_kv(r, w, values={"tokenizer.ggml.pre": pre})
    finish(w)


def llama_cpp_ids(exe: Path, vocab: Path, texts: list[str]) -> list[list[int]]:
    out = subprocess.run([str(exe), str(vocab)], input=SEP.join(texts).encode(), capture_output=True, check=True).stdout
    return [[int(x) for x in line.split()] for line in out.decode().split("\n")[: len(texts)]]


def llama_cpp_pre_names(src: Path) -> set[str]:
    text = (src / "src" / "llama-vocab.cpp").read_text(encoding="utf-8")
    return set(re.findall(r'tokenizer_pre == "([^"]+)"', text))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="llama.cpp source tree")
    ap.add_argument("bin", type=Path, nargs="?", help="llama.cpp build dir holding libllama (step 2)")
    ap.add_argument("--pre", action="append", help="step 2 for these names only (~6 s each)")
    args = ap.parse_args()
    models = args.src / "models"
    failed = False
    all_texts: list[str] = []
    print("## llama.cpp's vocabulary tests")
    for inp in sorted(models.glob("ggml-vocab-*.gguf.inp")):
        path = inp.with_suffix("")
        texts = texts_of(inp)
        all_texts += [t for t in texts if t not in all_texts]
        want = [[int(x) for x in line.split()] for line in path.with_suffix(".gguf.out").read_text().split("\n")[: len(texts)]]
        got = encode_all(path, texts)
        if isinstance(got, str):
            print(f"{path.name}: {got}")
            continue
        bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        failed |= bool(bad)
        print(f"{path.name}: {len(texts) - len(bad)}/{len(texts)}" + (f", first wrong: {texts[bad[0]][:40]!r}" if bad else ""))
    if args.bin is None:
        return int(failed)
    print("\n## pre-tokenizers on the qwen2 vocabulary, against libllama")
    known = llama_cpp_pre_names(args.src)
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(args.src, args.bin, Path(tmp), "llamacpp_tokenize")
        all_texts += EXTRA
        for pre in args.pre or sorted(known | set(PRE_TOKENIZERS)):
            path = Path(tmp) / "vocab.gguf"
            with_pre(models / "ggml-vocab-qwen2.gguf", path, pre)
            got = encode_all(path, all_texts)
            if isinstance(got, str):
                print(f"{pre}: {got}")
                continue
            if pre not in known:
                print(f"{pre}: accepted by sharpi, unknown to this llama.cpp")
                continue
            want = llama_cpp_ids(exe, path, all_texts)
            bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
            failed |= bool(bad)
            print(f"{pre}: {len(all_texts) - len(bad)}/{len(all_texts)}"
                  + (f", first wrong: {all_texts[bad[0]][:40]!r} {got[bad[0]][:8]} vs {want[bad[0]][:8]}" if bad else ""))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
