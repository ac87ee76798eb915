#!/usr/bin/env python3
"""Record libstdc++'s std::unordered_map walk and std::hash<std::string> (tests/data/libstdcxx_map_order.json): the
oracle of sharpi_core/stdhash.py, which tells which of several spellings of a special token llama.cpp's loader
takes (the first its token_to_id map walks).

    python scripts/libstdcxx_map_order.py [-o tests/data/libstdcxx_map_order.json]

Compiles scripts/libstdcxx_map_order.cpp with g++ and feeds it key sets: KEY_SETS (made by `key_set`, so the file
stores their recipe and the walk, not the keys) and the token texts of the four models' vocabularies, in id order
as llama.cpp inserts them (their walks stored as a SHA-256 of the ids, 49k-262k keys each).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m",
          "qwen2.5-coder-1.5b-instruct-q4_k_m"]
# (n keys, repeats): sizes around the growth steps (13 -> 29 buckets at the 14th key, ...), one past the largest
# vocabulary's (351,062 keys: 712,697 buckets), and keys inserted more than once
KEY_SETS = [(1, 0), (13, 0), (14, 0), (30, 0), (200, 40), (1110, 0), (5000, 500), (400000, 0)]
HASHED = [b"", b"a", b"ab", b"abcdefg", b"abcdefgh", b"abcdefghi", b"<|im_end|>", b"<|endoftext|>", "日本語".encode(),
          bytes(range(256)), b"\x00" * 17, b"\xff" * 15]


def key_set(n: int, repeats: int) -> list[bytes]:
    """n distinct keys of 0-31 bytes (from SHA-256), then `repeats` of them again, in a fixed order."""
    keys = [hashlib.sha256(f"{n}-{i}".encode()).digest()[: (i * 7) % 32] + i.to_bytes(3, "little") for i in range(n)]
    return keys + [keys[(i * 7919) % n] for i in range(repeats)]


def digest(ids: list[int]) -> str:
    return hashlib.sha256(" ".join(map(str, ids)).encode()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "tests" / "data" / "libstdcxx_map_order.json")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from sharpi_core.gguf_file import GGUFFile
    from sharpi_core.registry import pull
    from sharpi_core.tokenizer import Tokenizer
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "order"
        subprocess.run(["g++", "-O2", "-std=c++17", "-o", str(exe), str(ROOT / "scripts" / "libstdcxx_map_order.cpp")],
                       check=True)

        def walk(keys: list[bytes]) -> tuple[list[int], list[int], int]:
            out = subprocess.run([str(exe)], input="".join(k.hex() + "\n" for k in keys), capture_output=True,
                                 text=True, check=True).stdout.split("\n")
            rows = [ln.split() for ln in out if ln and not ln.startswith("buckets")]
            n_buckets = int(next(ln for ln in out if ln.startswith("buckets")).split()[1])
            return [int(i) for i, _ in rows], [int(h) for _, h in rows], n_buckets

        sets = []
        for n, repeats in KEY_SETS:
            ids, _, nb = walk(key_set(n, repeats))
            entry = {"n": n, "repeats": repeats, "buckets": nb}
            entry.update({"walk": ids} if n <= 1200 else {"sha256": digest(ids)})
            sets.append(entry)
            print(f"{n} keys, {repeats} repeated: {nb} buckets", file=sys.stderr)
        ids, hashes, _ = walk(HASHED)
        hashed = {HASHED[i].hex(): str(h) for i, h in zip(ids, hashes)}
        vocabs = {}
        for m in MODELS:
            tok = Tokenizer.from_gguf(GGUFFile(pull(m)), lazy=True)
            ids, _, nb = walk([t.encode() for t in tok.tokens])
            vocabs[m] = {"n": tok.n_vocab, "buckets": nb, "sha256": digest(ids)}
            print(f"{m}: {tok.n_vocab} texts, {nb} buckets", file=sys.stderr)
    a.out.write_text(json.dumps({"compiler": subprocess.run(["g++", "--version"], capture_output=True, text=True)
                                 .stdout.split("\n")[0], "key_sets": sets, "hashes": hashed, "vocabularies": vocabs},
                                indent=0) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
