"""Record llama.cpp's n-gram drafters (tests/data/llamacpp_ngram.json): scripts/llamacpp_ngram.cpp drives
libllama-common's common_speculative_* with --spec-type ngram-simple / ngram-map-k / ngram-map-k4v / ngram-mod / ngram-cache (and
lists of them) over token sequences, as its server drives them: a begin per turn, a draft every step, the accepted
count of each draft (its prefix that matches the sequence's next tokens) passed back. The file keeps the
sequences and each case's drafts; tests/test_ngram.py replays them through sharpi's NgramChain.

    python scripts/llamacpp_ngram.py SRC_DIR BIN_DIR

SRC_DIR is a llama.cpp source tree (common/, include/, ggml/include/), BIN_DIR holds its libllama-common (the
llama.cpp in llama-cpp-python, as ../shared/fixtures were built from). The sequences come from a fixed-seed
generator of copy-heavy text: runs of new tokens, copies of earlier stretches (some with a token changed), as
generated code and edits repeat what came before.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "llamacpp_ngram.json"
DEFAULTS = dict(n_max=1000, simple=(12, 48), map_k=(12, 48), map_k4v=(12, 48, 1), mod=(24, 48, 64))


def copy_heavy(rng: np.random.Generator, n: int, vocab: int, p_copy: float = 0.6, p_mutate: float = 0.02,
               span=(4, 80)) -> list[int]:
    out: list[int] = list(rng.integers(0, vocab, 8))
    while len(out) < n:
        if rng.random() < p_copy and len(out) > span[0]:
            ln = int(rng.integers(span[0], span[1]))
            s = int(rng.integers(0, max(1, len(out) - ln)))
            seg = out[s:s + ln]
            seg = [int(rng.integers(0, vocab)) if rng.random() < p_mutate else t for t in seg]
            out += seg
        else:
            out += [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 12)))]
    return [int(t) for t in out[:n]]


def turns(seed: int, vocab: int, sizes: list[tuple[int, int, str]], **kw) -> list[dict]:
    """Turns over one copy-heavy stream: (prompt tokens added, tokens generated, how) where how is 'extend' (the
    prompt continues the history) or 'shrink' (the history cut to 60% and new tokens after it)."""
    rng = np.random.default_rng(seed)
    stream = copy_heavy(rng, sum(a + b for a, b, _ in sizes) * 2, vocab, **kw)
    hist: list[int] = []
    at = 0
    out = []
    for add, gen, how in sizes:
        if how == "shrink":
            hist = hist[:len(hist) * 6 // 10]
        prompt = hist + stream[at:at + add]
        at += add
        cont = stream[at:at + gen]
        at += gen
        out.append({"prompt": prompt, "cont": cont})
        hist = prompt + cont
    return out


def case(name: str, types: str, seq: str, **over) -> dict:
    c = dict(DEFAULTS, name=name, types=types, turns=seq)
    c.update(over)
    return c


def sequences() -> dict[str, list[dict]]:
    big = 50000
    return {
        "long_code": turns(1, big, [(3000, 1500, "extend"), (200, 800, "extend")]),
        "small": turns(2, 8, [(300, 300, "extend"), (50, 200, "extend"), (40, 200, "shrink")], p_mutate=0.1,
                       span=(3, 20)),
        "tiny": turns(3, 5, [(200, 300, "extend"), (30, 200, "shrink"), (30, 150, "extend")], p_mutate=0.15,
                      span=(2, 12)),
        "edits": turns(4, big, [(1500, 800, "extend"), (100, 500, "shrink"), (100, 500, "extend")], p_copy=0.8,
                       p_mutate=0.01, span=(20, 200)),
    }


def cases() -> list[dict]:
    long_code, small, tiny, edits = "long_code", "small", "tiny", "edits"
    return [
        case("simple, defaults, copy-heavy", "ngram-simple", long_code),
        case("simple 2/5, 8 tokens", "ngram-simple", small, simple=(2, 5)),
        case("simple 3/8, edits, n_max 4", "ngram-simple", edits, simple=(3, 8), n_max=4),
        case("map-k, defaults, copy-heavy", "ngram-map-k", long_code),
        case("map-k 2/4, 8 tokens", "ngram-map-k", small, map_k=(2, 4)),
        case("map-k 3/6, edits", "ngram-map-k", edits, map_k=(3, 6)),
        case("map-k 2/5, 5 tokens, n_max 3", "ngram-map-k", tiny, map_k=(2, 5), n_max=3),
        case("map-k4v 2/3 hits 1, 5 tokens", "ngram-map-k4v", tiny, map_k4v=(2, 3, 1)),
        case("map-k4v 2/4 hits 2, 8 tokens", "ngram-map-k4v", small, map_k4v=(2, 4, 2)),
        case("map-k4v 4/8 hits 1, edits", "ngram-map-k4v", edits, map_k4v=(4, 8, 1)),
        case("map-k4v, defaults, copy-heavy", "ngram-map-k4v", long_code),
        case("mod, defaults, edits", "ngram-mod", edits),
        case("mod 3/2/8, 8 tokens", "ngram-mod", small, mod=(3, 2, 8)),
        case("mod 4/0/16, copy-heavy", "ngram-mod", long_code, mod=(4, 0, 16)),
        case("mod 2/1/6, 5 tokens", "ngram-mod", tiny, mod=(2, 1, 6)),
        case("all four, small", "ngram-mod,ngram-map-k4v,ngram-simple,ngram-map-k", small, simple=(3, 6),
             map_k=(2, 4), map_k4v=(2, 3, 1), mod=(3, 2, 8)),
        case("simple + mod, edits, n_max 6", "ngram-simple,ngram-mod", edits, simple=(6, 12), mod=(4, 1, 10),
             n_max=6),
        case("map-k + map-k4v, tiny", "ngram-map-k,ngram-map-k4v", tiny, map_k=(3, 4), map_k4v=(2, 4, 1)),
        case("cache, copy-heavy", "ngram-cache", long_code),
        case("cache, 8 tokens", "ngram-cache", small),
        case("cache, 5 tokens, n_max 3", "ngram-cache", tiny, n_max=3),
        case("cache, edits", "ngram-cache", edits),
        case("simple + cache, 8 tokens", "ngram-simple,ngram-cache", small, simple=(3, 6)),
    ]


def run(exe: Path, c: dict, seqs: dict) -> list:
    args = [str(exe), c["types"], str(c["n_max"]), *map(str, c["simple"]), *map(str, c["map_k"]),
            *map(str, c["map_k4v"]), *map(str, c["mod"])]
    stdin = "".join(f"P {' '.join(map(str, t['prompt']))}\nC {' '.join(map(str, t['cont']))}\n" for t in seqs[c["turns"]])
    res = subprocess.run(args, input=stdin, capture_output=True, text=True, check=True)
    out = []
    for line in res.stdout.splitlines():
        if line == "B":
            out.append("begin")
        elif line.startswith("D"):
            out.append([int(t) for t in line[1:].split()])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("bin")
    a = ap.parse_args()
    src, lib = Path(a.src), Path(a.bin)
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "llamacpp_ngram"
        subprocess.run(["g++", "-std=c++17", "-O1", f"-I{src / 'common'}", f"-I{src / 'include'}",
                        f"-I{src / 'ggml' / 'include'}", f"-I{src / 'vendor'}", str(ROOT / "scripts" / "llamacpp_ngram.cpp"),
                        "-o", str(exe), f"-L{lib}", "-lllama-common", "-lllama", "-lggml", "-lggml-base",
                        f"-Wl,-rpath,{lib}"], check=True)
        out = []
        seqs = sequences()
        for c in cases():
            c["drafts"] = run(exe, c, seqs)
            n = sum(1 for d in c["drafts"] if d != "begin" and d)
            print(f"{c['name']}: {len(c['drafts'])} calls, {n} drafts")
            out.append(c)
    OUT.write_text(json.dumps({"llama.cpp": "llama-cpp-python 0.3.36's vendor/llama.cpp", "sequences": seqs, "cases": out},
                              separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
