#!/usr/bin/env python3
"""Random texts through sharpi's tokenizer and libllama's: the ids must be the same (a tool, not a test).

    python scripts/fuzz_tokenizer.py LLAMA_CPP_SRC BIN_DIR [--seed 1] [--runs 2000] [-m MODEL ...] [--log F]
    python scripts/fuzz_tokenizer.py LLAMA_CPP_SRC BIN_DIR --code-points [-m MODEL] [--pre NAME ...]

Each text is a random mix of fragments: words in every case, digit runs, punctuation, contractions,
whitespace runs (tabs, CR LF, no-break and ideographic spaces), letters of many scripts with combining
marks, emoji with ZWJ / skin tones / flags, code, control characters, any code point now and then, and the
model's own special tokens spelled out (whole, cut short, glued to text). Every model's vocabulary (the
four known models by default, cached ones only) tokenizes them twice: as llama-tokenize does by default
(BOS where the model adds it, special tokens parsed) and as plain text (neither). libllama runs them all in
one process per model and mode (scripts/llamacpp_tokenize.c); each text whose ids differ is cut down to a
shortest text that still differs, printed, and written to --log. Exits 1 if any differed.

--code-points: instead, every code point (but NUL and the surrogates) in four short contexts (after a letter
and before a contraction, repeated beside digits, spaces and a newline, after a space before a letter, between a
digit and punctuation), which shows where sharpi's regex engine and llama.cpp's character tables disagree on
a class (letter, digit, mark, space...) or a byte is missing from the vocabulary; the code points whose
contexts differ are printed as ranges (the probes go a thousand to a text, a newline between: about a minute a
vocabulary). --pre NAME: the first model's vocabulary with tokenizer.ggml.pre set to NAME
(scripts/llamacpp_vocab_check.py's copies), once per NAME.

--pieces: instead, every token id's piece (llama.cpp's token_to_piece with special tokens printed and not, by
scripts/llamacpp_tokenize.c) against sharpi's Tokenizer.token_bytes; the ids that differ are printed.

--record OUT: libllama's ids for EDGES (what this tool found) and --runs random texts (--seed), in both modes, for
each model, written to OUT: the oracle of tests/test_tokenizer.py (tests/data/llamacpp_tokenize_fuzz.json).
"""
from __future__ import annotations

import json
import random
import string
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from compare_llamacpp_logits import build, fuzz_args  # noqa: E402
from llamacpp_vocab_check import SEP, with_pre  # noqa: E402
from sharpi_core.gguf_file import GGUFFile  # noqa: E402
from sharpi_core.registry import REGISTRY, cached_path, is_cached  # noqa: E402
from sharpi_core.tokenizer import ATTR_CONTROL, ATTR_USER_DEFINED, Tokenizer  # noqa: E402

# code point ranges of scripts, drawn from uniformly (start, end inclusive)
SCRIPTS = [(0xC0, 0xFF), (0x100, 0x17F), (0x391, 0x3C9), (0x410, 0x44F), (0x5D0, 0x5EA), (0x621, 0x64A),
           (0x905, 0x939), (0xE01, 0xE30), (0x3041, 0x3096), (0x30A1, 0x30FA), (0x4E00, 0x9FFF),
           (0xAC00, 0xD7A3), (0x1E00, 0x1EFF), (0xFF01, 0xFF5E)]
MARKS = [(0x300, 0x36F), (0x93E, 0x94D), (0x64B, 0x652), (0xE31, 0xE3A)]
EMOJI = [(0x1F300, 0x1F5FF), (0x1F600, 0x1F64F), (0x1F900, 0x1F9FF), (0x2600, 0x26FF)]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", "\u00a0", "\u3000", "\u2009", "\u200b", "\x0b",
          "\x0c", "\r", "\u2028", "\u0085"]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'LL", "’s", "'"]
CODE = ["def f(x):\n    return x", "    ", "{", "}", "=>", "!=", "::", "#include <stdio.h>", "i++", "0x1F",
        "a_b_c", "__init__", "//", "/* */", "</s>", "<br/>", "&amp;", "$$", "\\n", "`code`", "```py\n", "...", "--"]
# texts this tool found differing once: a byte the vocabulary lacks between two characters that merge (SmolLM2 has
# no 0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, nor the lead bytes 0xF1 / 0xF2 of U+40000..U+BFFFF), and letters, digits and
# marks that Unicode 16.0 added (llama.cpp's tables are 15.1's: no class at all) before a contraction or beside text
EDGES = [">\x1d<", "a\x04b\x06c\x13d\x14e\x16f \x1d\x1d", "<\U00050000>\U0009ffff! x\U00050000y", "\U00013460're \U00013817'S",
         "\U00010d40\U00010d41 abc\U00010d4a's", "\u1c89\u1c8a're \ua7cb\ua7ccx", "\U00011bf0\U00011bf1 12\U00016d70!",
         "a\u0897b \U000113b8\U00011380", "\U0001fa89\U0001fbcb 3\U0001cc00.", "\U00016100\u2019s&a"]
WORDS = ["the", "hello", "world", "llama", "token", "Straße", "naïve", "café", "über", "ĳ", "ﬁ", "İstanbul", "ǅ",
         "σς", "日本語", "한국어", "ไทย", "नमस्ते", "עברית", "العربية"]


def _cp(r: random.Random, ranges) -> str:
    a, b = r.choice(ranges)
    return chr(r.randint(a, b))


def _any_char(r: random.Random) -> str:
    """Any code point but NUL (the helper's texts are C strings) and the surrogates (not text)."""
    while True:
        c = r.choice((r.randint(1, 0x7F), r.randint(0x80, 0xFFFF), r.randint(0x10000, 0x10FFFF)))
        if not 0xD800 <= c <= 0xDFFF:
            return chr(c)


def fragment(r: random.Random, specials: list[str]) -> str:
    k = r.random()
    if k < 0.14:
        w = "".join(r.choice(string.ascii_lowercase) for _ in range(r.randint(1, 9))) if r.random() < 0.7 else r.choice(WORDS)
        return r.choice([w, w.capitalize(), w.upper(), "".join(c.upper() if r.random() < 0.5 else c for c in w)])
    if k < 0.22:
        return "".join(r.choice(string.digits) for _ in range(r.randint(1, 12)))
    if k < 0.30:
        return "".join(r.choice(string.punctuation) for _ in range(r.randint(1, 4)))
    if k < 0.42:
        return "".join(r.choice(SPACES) for _ in range(r.randint(1, 3)))
    if k < 0.46:
        return r.choice(CONTRACTIONS)
    if k < 0.58:
        s = "".join(_cp(r, SCRIPTS) for _ in range(r.randint(1, 5)))
        return s + (_cp(r, MARKS) if r.random() < 0.3 else "")
    if k < 0.64:
        e = _cp(r, EMOJI)
        e += r.choice(["", "", "\ufe0f", "\U0001F3FD", "\u200d" + _cp(r, EMOJI)])
        if r.random() < 0.2:
            e = chr(0x1F1E6 + r.randrange(26)) + chr(0x1F1E6 + r.randrange(26))
        return e
    if k < 0.72:
        return r.choice(CODE)
    if k < 0.75:
        return chr(r.randint(1, 31)) if r.random() < 0.7 else chr(r.choice([0x7F, 0xFFFD, 0xFEFF, 0x200E, 0xE000]))
    if k < 0.80:
        return _any_char(r)
    if specials:
        s = r.choice(specials)
        return s if r.random() < 0.75 else s[: r.randint(1, max(1, len(s) - 1))]
    return " "


def text(r: random.Random, specials: list[str]) -> str:
    t = "".join(fragment(r, specials) for _ in range(r.randint(1, 24)))
    if r.random() < 0.15:
        t = " " + t
    if r.random() < 0.1:
        t = t + " "
    return t


class Oracle:
    """libllama's ids for many texts of one vocabulary: one process per call."""

    def __init__(self, exe: Path, path: Path):
        self.exe, self.path = exe, path

    def ids(self, texts: list[str], special: bool) -> list[list[int]]:
        flag = "1" if special else "0"
        out = subprocess.run([str(self.exe), str(self.path), flag, flag], input=SEP.join(texts).encode(),
                             capture_output=True, check=True).stdout
        lines = out.decode().split("\n")[: len(texts)]
        return [[int(x) for x in line.split()] for line in lines]


def shrink(t: str, differs) -> str:
    """A shorter text that still differs: drop halves, then runs, then single characters, while it does."""
    n = max(1, len(t) // 2)
    while n >= 1:
        cands = [t[:i] + t[i + n:] for i in range(0, len(t), n)]
        bad = differs(cands)
        hit = next((c for c, b in zip(cands, bad) if b and c), None)
        if hit is not None:
            t = hit
            n = min(n, max(1, len(t) // 2))
        else:
            n //= 2
    return t


def specials_of(tok: Tokenizer) -> set[str]:
    return {tok.token_text(i) for i in range(tok.n_vocab)
            if tok.attrs[i] & (ATTR_CONTROL | ATTR_USER_DEFINED) and tok.token_text(i)}


def code_point_probes(c: str) -> list[str]:
    return [f"x{c}'re", f"{c}{c}1{c} {c}\n{c}", f" {c}a", f"1{c}!"]


def ranges(cps: list[int]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for c in cps:
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return [(a, b) for a, b in out]


# probes in one text, a newline between each two: libllama builds its regex anew for every text it splits (a
# std::wregex for some pre-tokenizers, ~1 ms each), which made a vocabulary's 4.5 million probes take hours alone
JOIN = 1000


def _differ(tok: Tokenizer, oracle: Oracle, groups: list[list[tuple[int, str]]]) -> list[bool]:
    """Whether each group's probes, in one text, tokenize differently; libllama's calls take ~200,000 probes each."""
    flags: list[bool] = []
    i = 0
    while i < len(groups):
        j, size = i, 0
        while j < len(groups) and (j == i or size + len(groups[j]) <= 200_000):
            size += len(groups[j])
            j += 1
        texts = ["\n".join(p for _, p in g) for g in groups[i:j]]
        flags += [tok.encode(t, False, False) != want for t, want in zip(texts, oracle.ids(texts, False))]
        i = j
    return flags


def code_points(tok: Tokenizer, oracle: Oracle) -> list[int]:
    """The code points whose probes tokenize differently (both modes: special tokens play no part here). The
    probes go JOIN to a text; the spaces' and the format and control characters' also one to a text, where a
    probe that ends in one ends the text (white space before the end of a text splits apart). A text that differs
    is halved, level by level, down to the single probes that differ; where neither half of a differing text
    differs alone, all of its code points are blamed."""
    cps = [c for c in range(1, 0x110000) if not 0xD800 <= c <= 0xDFFF]
    probes = [(c, p) for c in cps for p in code_point_probes(chr(c))]
    level = [probes[i:i + JOIN] for i in range(0, len(probes), JOIN)]
    level += [[cp] for cp in probes if chr(cp[0]).isspace() or unicodedata.category(chr(cp[0]))[0] in "ZC"
              and unicodedata.category(chr(cp[0])) not in ("Cn", "Co")]
    bad: set[int] = set()
    parents: list[list[tuple[int, str]]] = []  # below the first level, level[2i] and level[2i + 1] halve parents[i]
    while level:
        flags = _differ(tok, oracle, level)
        for i, parent in enumerate(parents):
            if not flags[2 * i] and not flags[2 * i + 1]:
                bad.update(c for c, _ in parent)
        parents = [g for g, f in zip(level, flags) if f and len(g) > 1]
        bad.update(g[0][0] for g, f in zip(level, flags) if f and len(g) == 1)
        level = [h for g in parents for h in (g[: len(g) // 2], g[len(g) // 2:])]
    return sorted(bad)


def pieces(tok: Tokenizer, exe: Path, path: Path) -> list[dict]:
    """The tokens whose pieces differ from llama.cpp's, with special tokens printed (True) or not (False)."""
    out = subprocess.run([str(exe), str(path), "pieces"], capture_output=True, check=True, text=True).stdout.splitlines()
    bad = []
    for tid, line in enumerate(out):
        for special, h in zip((True, False), line.split(" ")):
            want = b"" if h == "-" else bytes.fromhex(h)
            got = tok.token_bytes(tid, special)
            if got != want:
                bad.append({"id": tid, "special": special, "text": tok.token_text(tid), "llama.cpp": want.hex(),
                            "sharpi": got.hex()})
    if len(out) != tok.n_vocab:
        bad.append({"n_vocab": tok.n_vocab, "llama.cpp": len(out)})
    return bad


def main() -> int:
    ap = fuzz_args(__doc__, "libllama", 2000, "texts per model", raw=True)
    ap.add_argument("-m", "--model", action="append", help="registry names or GGUF paths (default: the cached known ones)")
    ap.add_argument("--pre", action="append", help="the first model's vocabulary with tokenizer.ggml.pre = PRE")
    ap.add_argument("--code-points", action="store_true", help="every code point in four contexts, no random texts")
    ap.add_argument("--pieces", action="store_true", help="every token's piece, no random texts")
    ap.add_argument("--record", type=Path, help="write the oracle of tests/test_tokenizer.py here instead")
    args = ap.parse_args()
    models = args.model or [n for n in REGISTRY if is_cached(n)]
    failed = 0
    log = args.log.open("a") if args.log else None
    with tempfile.TemporaryDirectory() as d:
        exe = build(args.src, args.bin, Path(d), "llamacpp_tokenize")
        paths = [Path(name) if Path(name).is_file() else cached_path(name) for name in models]
        if args.pre:
            src, paths = paths[0], []
            for pre in args.pre:
                paths.append(Path(d) / f"{src.stem}.pre-{pre}.gguf")
                with_pre(src, paths[-1], pre)
        record: dict = {"llama_cpp": "llama_cpp_python 0.3.36 vendor tree, scripts/llamacpp_tokenize.c", "ids": {}}
        if args.record:  # one set of texts for every model, with all of their special tokens spelled out
            r = random.Random(args.seed)
            specials = sorted(set().union(*(specials_of(Tokenizer.from_gguf(GGUFFile(p))) for p in paths)))
            record["texts"] = EDGES + [text(r, specials) for _ in range(args.runs)]
        for path in paths:
            tok = Tokenizer.from_gguf(GGUFFile(path))
            oracle = Oracle(exe, path)
            if args.record:
                record["ids"][path.stem] = {str(int(sp)): oracle.ids(record["texts"], sp) for sp in (True, False)}
                continue
            if args.pieces:
                bad = pieces(tok, exe, path)
                failed += bool(bad)
                print(f"{path.name}: {tok.n_vocab} tokens, {len(bad)} pieces differ", flush=True)
                for rec in bad[:20]:
                    print("  " + json.dumps(rec))
                if log and bad:
                    log.write(json.dumps({"model": path.name, "pieces": bad}) + "\n")
                continue
            if args.code_points:
                bad = code_points(tok, oracle)
                failed += bool(bad)
                print(f"{path.name}: {len(bad)} code points differ: "
                      + " ".join(f"{a:04X}" + (f"-{b:04X}" if b > a else "") for a, b in ranges(bad)), flush=True)
                if log and bad:
                    log.write(json.dumps({"model": path.name, "code_points": ranges(bad)}) + "\n")
                continue
            specials = sorted(specials_of(tok))
            r = random.Random(f"{args.seed}-{path.name}")
            texts = [text(r, specials) for _ in range(args.runs)]
            for special in (True, False):
                def ours(t: str) -> list[int]:
                    return tok.encode(t, add_special=special, parse_special=special)

                def differs(ts: list[str]) -> list[bool]:
                    return [a != ours(t) for a, t in zip(oracle.ids(ts, special), ts)]

                bad = [t for t, want in zip(texts, oracle.ids(texts, special)) if ours(t) != want]
                print(f"{path.name} special={int(special)}: {len(texts)} texts, {len(bad)} differ", flush=True)
                seen: set[str] = set()
                for t in bad[:20]:
                    small = shrink(t, differs)
                    if small in seen:
                        continue
                    seen.add(small)
                    failed += 1
                    want = oracle.ids([small], special)[0]
                    rec = {"model": path.name, "special": special, "text": small, "llama.cpp": want,
                           "sharpi": ours(small), "from": t}
                    print("  " + json.dumps({k: rec[k] for k in ("text", "llama.cpp", "sharpi")}, ensure_ascii=True))
                    if log:
                        log.write(json.dumps(rec) + "\n")
    if args.record:
        args.record.write_text(json.dumps(record, ensure_ascii=True) + "\n")
        print(f"wrote {args.record}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
