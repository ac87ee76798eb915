"""Random GBNF grammars through sharpi and libllama's grammar sampler: whether each accepts the grammar, and the
tokens it allows at each step of a walk, must be the same (a tool, not a test).

    python scripts/fuzz_grammar.py LLAMA_CPP_SRC BIN_DIR [--seed 1] [--runs 500] [-m MODEL ...] [--log F]
                                   [--record OUT [--record-n 30]]

Each case is a random grammar: a root and up to four more rules of literals and character classes (escapes of
every kind, ranges, negation, multi-byte and control characters), `.`, groups, references to rules, token
references (`<[id]>`, `!<[id]>`, special tokens by text, texts of several tokens) and every repetition form,
laid out with random spaces, line breaks inside groups and after `|`, comments and CRLF line ends; now and then a
text edit (a character dropped, inserted or doubled) breaks it. libllama (scripts/llamacpp_grammar_walk.c, one
process per model) says whether llama_sampler_init_grammar takes it, then walks it: at each step the grammar
sampler runs over the whole vocabulary, and the walk picks one of the tokens it leaves (an end-of-generation
token, ending the walk, now and then where allowed). sharpi's side is what the engine uses: Grammar and
TokenGrammar (GrammarError for a refused grammar), TokenGrammar.mask at each step, the state advanced by
llama.cpp's picks; and TokenGrammar.constrain on random logits (the fast path for greedy and top-k chains) must
keep the best allowed tokens of llama.cpp's mask.

A differing case is cut down (characters of its text dropped while it still differs the same way) and printed,
and all are written to --log. Exits 1 if any differed. Counted, not compared: a grammar llama.cpp does not finish
with in --timeout seconds (sharpi refusing it as left recursive, or taking it: parses that multiply), one sharpi
refuses as too ambiguous (GrammarTooAmbiguous), a rule referred to only with {0} (llama.cpp does not check it is
defined), and tokens llama.cpp's mask lets through by a token reference met after characters of the token's own
text, which it then aborts on taking (sharpi does not allow them).

--record OUT: EDGES (what this tool found), then the first --record-n agreeing cases of the first model (a fifth
of them refused grammars) in tests/data/llamacpp_grammar_walks.json's form, which tests/test_grammar.py checks.
"""
from __future__ import annotations

import json
import queue
import random
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from sharpi_core.grammar import Grammar, GrammarError, GrammarTooAmbiguous, TokenGrammar, decode_utf8  # noqa: E402
from compare_llamacpp_logits import build, fuzz_args  # noqa: E402

NAMES = ["a", "b", "item", "x-y", "W2", "ws", "value"]
COMMON = "abcdexyz 0129"
ASCII = "abcxyzABZ019 ,.:;-_'/!?()[]{}<>|*+#=&%$@~`^\"\\"
UNICODE = ["é", "ß", "ñ", "中", "文", "€", "😀", "\u00a0", "Ω", "й", "あ", "\u0301", "\U0001F44D", "\x7f"]
CONTROL = ["\n", "\t", "\r"]
NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\", '"': '\\"', "[": "\\[", "]": "\\]", "-": "\\-"}
# what a text edit inserts: GBNF's punctuation, digits, space
EDIT = "\"[]()|{}*+?:=\\#<!-^.,0123456789 \nax"


def rand_char(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.55:
        return rng.choice(COMMON)
    if r < 0.78:
        return rng.choice(ASCII)
    if r < 0.93:
        return rng.choice(UNICODE)
    return rng.choice(CONTROL)


def enc_char(rng: random.Random, c: str, in_class: bool) -> str:
    """c written in a literal or a class: as itself where the syntax lets it be, or escaped some way."""
    cp, opts = ord(c), []
    special = '\\]' if in_class else '\\"'
    if c not in special and not (in_class and c in "-^["):
        opts += [c] * 6
    if c in NAMED and (c not in "[]-" or in_class or rng.random() < 0.3):
        opts += [NAMED[c]] * 2
    if cp < 0x100:
        opts.append(f"\\x{cp:02x}" if rng.random() < 0.5 else f"\\x{cp:02X}")
    if cp < 0x10000:
        opts.append(f"\\u{cp:04X}")
    opts.append(f"\\U{cp:08x}")
    return rng.choice(opts)


def literal(rng: random.Random) -> str:
    n = rng.choice([0, 1, 1, 1, 2, 2, 3, 4, 6])
    return '"' + "".join(enc_char(rng, rand_char(rng), False) for _ in range(n)) + '"'


def char_class(rng: random.Random) -> str:
    out = "[" + ("^" if rng.random() < 0.3 else "")
    n = rng.choice([0, 1, 1, 2, 2, 3, 4]) if rng.random() < 0.97 else 0
    for _ in range(n):
        if rng.random() < 0.5:
            lo = rand_char(rng)
            if rng.random() < 0.9:  # mostly upward ranges; a reversed one matches nothing
                hi = chr(min(ord(lo) + rng.choice([1, 2, 5, 25, 200, 3000]), 0x10FFFF))
                if 0xD800 <= ord(hi) <= 0xDFFF:
                    hi = "\uE000"
            else:
                hi = chr(max(ord(lo) - 3, 1))
            out += enc_char(rng, lo, True) + "-" + enc_char(rng, hi, True)
        else:
            out += enc_char(rng, rand_char(rng), True)
    if rng.random() < 0.08:  # a '-' as its own item, last
        out += "-"
    return out + "]"


def repeat_op(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.55:
        return ""
    if r < 0.85:
        return rng.choice("*+?")
    sp = (lambda: rng.choice(["", "", " "]))
    lo = rng.choice([0, 0, 1, 1, 2, 3, 5])
    form = rng.random()
    if form < 0.3:
        body = f"{lo}"
    elif form < 0.55:
        body = f"{lo}{sp()},"
    else:
        body = f"{lo}{sp()},{sp()}{lo + rng.choice([0, 1, 1, 2, 4])}"
    if rng.random() < 0.03:  # past llama.cpp's limit on the rules a repetition makes
        body = rng.choice(["45", "0,50", "2001", "0,2001", "1999,"])
    return "{" + sp() + body + sp() + "}"


class Gen:
    """One random grammar's text."""

    def __init__(self, rng: random.Random, refs: list[str] = ()):
        self.rng, self.refs = rng, refs
        self.names = ["root"] + rng.sample(NAMES, rng.choice([0, 1, 1, 2, 2, 3, 4]))

    def item(self, depth: int, rule: int) -> str:
        rng = self.rng
        r = rng.random()
        if self.refs and rng.random() < 0.06:
            s = ("!" if rng.random() < 0.35 else "") + rng.choice(self.refs)
        elif r < 0.32:
            s = literal(rng)
        elif r < 0.58:
            s = char_class(rng)
        elif r < 0.66:
            s = "."
        elif r < 0.82 and depth < 3:
            nl = rng.random() < 0.25
            s = "(" + ("\n  " if nl else rng.choice(["", " "])) + self.alternates(depth + 1, rule, nested=True) + \
                ("\n" if nl else rng.choice(["", " "])) + ")"
        elif len(self.names) > 1:
            # mostly a later rule (no left recursion), now and then any (recursion, sometimes on the left)
            later = self.names[rule + 1:]
            s = rng.choice(later) if later and rng.random() < 0.93 else rng.choice(self.names)
        else:
            s = literal(rng)
        if s in ('""', "[]", "[^]") and rng.random() < 0.95:
            return s  # (a repetition of nothing is an error)
        s += repeat_op(rng)
        if rng.random() < 0.04:
            s += repeat_op(rng) or "?"  # a repetition of a repetition
        return s

    def sequence(self, depth: int, rule: int, nested: bool) -> str:
        rng = self.rng
        n = rng.choice([0, 1, 1, 2, 2, 3, 4]) if rng.random() < 0.97 else 0
        parts = [self.item(depth, rule) for _ in range(n)]
        out = ""
        for i, p in enumerate(parts):
            if i:
                out += rng.choice([" ", " ", "  ", "\t"] + (["\n    "] if nested else []))
            out += p
        if not out and not nested and rng.random() < 0.9:
            out = '""'  # (an empty alternative last in a rule takes the next line's rule in as its own)
        return out

    def alternates(self, depth: int, rule: int, nested: bool = False) -> str:
        rng = self.rng
        alts = [self.sequence(depth, rule, nested) for _ in range(rng.choice([1, 1, 1, 2, 2, 3]))]
        out = alts[0]
        for a in alts[1:]:
            out += rng.choice([" | ", "|", " |\n    ", " | "]) + a
        return out

    def text(self) -> str:
        rng = self.rng
        eol = "\r\n" if rng.random() < 0.1 else "\n"
        lines = []
        if rng.random() < 0.2:
            lines.append("# a grammar")
        for i, name in enumerate(self.names):
            body = self.alternates(0, i)
            line = f"{name}{rng.choice([' ', '', '  '])}::={rng.choice([' ', '', chr(10) + '  '])}{body}"
            if rng.random() < 0.15:
                line += rng.choice([" # comment", "# x \"[", "   "])
            lines.append(line)
            if rng.random() < 0.1:
                lines.append("")
        order = lines[:1] + rng.sample(lines[1:], len(lines) - 1) if rng.random() < 0.3 else lines
        t = eol.join(order) + (eol if rng.random() < 0.7 else "")
        if rng.random() < 0.15:
            t = mutate(rng, t)
        return t


# what this tool found, each with the tokens its walk must begin with (as their text; the first model's ids)
EDGES = [
    ('root ::= "a" []', ()),                                  # [] and [^] are nothing (the empty text)
    ('root ::= [^] ("b" | [^])', ()),
    ('root ::= "x" []*', ()),                                 # ... so a repetition of one has no item
    ('root ::= "a"{50}{50}', ()),                             # a repetition past llama.cpp's limit on the rules
    ('root ::= ("a"{0,40}){0,60}', ()),                       # it writes
    ('root ::= ("a"{0,40} b){0,48}\nb ::= "c"', ()),          # (b first named inside the group counts)
    ('b ::= "c"\nroot ::= ("a"{0,40} b){0,48}', ()),          # (b named before does not: 41 * 48 rules)
    ('root ::= x* "b"\nx ::= y\ny ::= "" | "c"', (b"c", b"c")),  # left recursion llama.cpp's check misses, bounded
    ('root ::= ws* "x"\nws ::= [ ]*', (b" ", b"  ")),
    ('root ::= ("a"?)* "b"', (b"a", b"a")),                   # (a group of a nullable item is missed too)
    ('root ::= x* "b"\nx ::= | "a"', ()),                      # left recursion llama.cpp's check finds
    ('root ::= "a" "\U0001F600"?', (b"a", b"\xf0")),          # a token completing no character ends nothing
    ('root ::= "\u00e9"?', (b"\xc3",)),
    ('root ::= " " | " \u00e9"', (b" \xc3",)),                # (one that completes one may end the text)
    ('root ::= <|im_start|> "a" | "b"', (b"<|im_start|>",)),    # token references: by text, by id, any but
    ('root ::= [a-c]+ <[1]> [a-c]?', (b"b", b"<|im_start|>")),
    ('root ::= <|im_start|> !<|im_start|>{1,2}', (b"<|im_start|>", b"x")),
    ('root ::= !<[49152]> "." | <[49152]>', ()),               # (an id past the vocabulary)
    ('root ::= "a" <hello>', ()),                             # (a text of several tokens)
    ('root ::= "a" <hello>{0}', ()),                          # (... also one a {0} takes away)
]


def mutate(rng: random.Random, t: str) -> str:
    for _ in range(rng.choice([1, 1, 2])):
        i = rng.randrange(len(t) + 1)
        k = rng.random()
        if k < 0.4 and t:
            t = t[:i] + t[i + 1:]
        elif k < 0.8:
            t = t[:i] + rng.choice(EDIT) + t[i:]
        else:
            j = min(len(t), i + rng.randint(1, 6))
            t = t[:j] + t[i:j] + t[j:]
    return t


def token_refs(tok, rng: random.Random) -> list[str]:
    """Token references for the grammars: by id (single characters' tokens, others at random, the first
    past the vocabulary), by text (special tokens; texts of several tokens, an error)."""
    ids = [t for t in (tok.encode(c, add_special=False, parse_special=False) for c in "ax 0\n") if len(t) == 1]
    refs = [f"<[{t[0]}]>" for t in ids] + [f"<[{rng.randrange(tok.n_vocab)}]>" for _ in range(4)]
    refs.append(f"<[{tok.n_vocab}]>")
    specials = [t for t in range(min(tok.n_vocab, 300)) if tok.token_bytes(t).startswith(b"<")
                and t not in tok.eog_ids][:4]
    refs += [tok.token_bytes(t).decode("utf-8", "replace") for t in specials]
    return refs + ["<hello>", "<|nothing|>"]


class Crashed(list):
    """A walk llama.cpp aborted in, taking the token it picked at the last step."""


class Oracle:
    """llamacpp_grammar_walk.c on one model's vocabulary, kept running between cases (restarted after a
    case it did not finish in time)."""

    def __init__(self, exe: Path, path: Path, timeout: float):
        self.exe, self.path, self.timeout = exe, path, timeout
        self.proc = None

    def _start(self) -> None:
        self.proc = subprocess.Popen([str(self.exe), str(self.path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        self.lines: queue.Queue = queue.Queue()
        proc, q = self.proc, self.lines
        threading.Thread(target=lambda: [q.put(ln.decode()) for ln in proc.stdout] + [q.put(None)], daemon=True).start()

    def walk(self, text: str, seed: int, steps: int, eog: int, forced: tuple[int, ...] = ()):
        """None: llama.cpp refused the grammar; "timeout"; or a list of (allowed ids (sorted array), picked)
        (forced: the first picks; -2 where the grammar did not allow one), a Crashed one where llama.cpp
        aborted after its last step (taking the token it picked there)."""
        if self.proc is None:
            self._start()
        data = text.encode()
        head = " ".join(map(str, (seed, steps, eog, len(forced), *forced, len(data))))
        self.proc.stdin.write(f"G {head}\n".encode() + data + b"\n")
        self.proc.stdin.flush()
        out, refused = [], False
        while True:
            try:
                ln = self.lines.get(timeout=self.timeout)
            except queue.Empty:
                self.close()
                return "timeout"
            if ln is None:
                self.close()
                return Crashed(out)
            if ln.startswith("Z"):
                return None if refused else out
            if ln.startswith("E"):
                refused = True
                continue
            if not re.fullmatch(r"S \d+ -?\d+ [\d,-]*\n", ln):  # (an abort's backtrace: accepting a token its mask allowed)
                self.close()
                return Crashed(out)
            _, n, picked, *ranges = ln.split()
            ids = [np.arange(int(lo), int(hi) + 1) for lo, hi in
                   (r.split("-") for r in (ranges[0].split(",") if ranges else []))]
            allowed = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
            assert allowed.shape[0] == int(n)
            out.append((allowed, int(picked)))

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _left_recursive(text: str) -> bool:
    try:
        Grammar(text)
    except GrammarError as e:
        return "left recursion" in str(e)
    except GrammarTooAmbiguous:
        pass
    return False


def _taken_midway(tg: TokenGrammar, st, tid: int) -> bool:
    """Whether llama.cpp's mask lets token tid through by a token reference it meets after characters of
    the token's own text (a token llama.cpp cannot then take: its stacks end there)."""
    piece = tg.pieces[tid]
    if not piece or piece[0] == 0 or tid in tg.eog:
        return False
    cps, _, n = decode_utf8(piece, st[1], st[2]) if st[2] else decode_utf8(piece)
    s = st[0]
    for k, c in enumerate(cps):
        if k and tg.g.token_tops(s) and tg._matched(s, tid):
            return True
        s = tg.g.step(s, c)
        if s < 0:
            return False
    return False


def _top(x: np.ndarray, ids: np.ndarray, need: int | None) -> np.ndarray:
    """The `need` best of ids by logit, lowest ids first on ties (constrain's rule)."""
    ids = ids[x[ids] > -np.inf]
    o = np.lexsort((ids, -x[ids]))
    return np.sort(ids[o] if need is None else ids[o[:need]])


def compare(tok, text: str, res, rng: random.Random) -> tuple[str, str] | None:
    """(kind, why) where sharpi differs from llama.cpp's result `res`, or None. kind: "refused", "accepted",
    "mask", "constrain", "skip-…" (not a difference)."""
    try:
        g = Grammar(text)
    except GrammarError as e:
        if res is None:
            return None
        if res == "timeout" and "left recursion" in str(e):
            return ("skip-left-recursion", str(e))
        m = re.search(r"undefined rule '([\w-]+)'", str(e))
        if m and re.search(rf"(?<![\w-]){m[1]}\s*{{\s*0\s*(,\s*0\s*)?}}", text):
            # llama.cpp looks for undefined rules among the references left, and {0} takes this one's away
            # (past its rule table's end it is not checked; for root, it reads past that end)
            return ("skip-undefined-unused", str(e))
        return ("refused", f"sharpi refuses ({e}), llama.cpp {'loops' if res == 'timeout' else 'takes it'}")
    if res == "timeout":
        return ("skip-timeout", "llama.cpp did not finish")
    try:
        tg = TokenGrammar(g, tok, tok.n_vocab)
    except GrammarError as e:  # (a token reference by a text that is not one token)
        return None if res is None else ("refused", f"sharpi refuses ({e}), llama.cpp takes it")
    if res is None:
        return ("accepted", "llama.cpp refuses the grammar, sharpi takes it")
    st = tg.initial()
    history = []
    try:
        for step, (allowed, picked) in enumerate(res):
            mine = np.flatnonzero(tg.mask(st))
            extra = np.setdiff1d(allowed, mine)
            if np.isin(mine, allowed).all() and extra.shape[0] and all(_taken_midway(tg, st, t) for t in extra.tolist()):
                return ("skip-midway-ref", f"step {step}: llama.cpp allows {len(extra)} tokens only by a token "
                                           "reference after characters of their own text, and aborts taking one")
            if not np.array_equal(mine, allowed):
                only_s, only_l = np.setdiff1d(mine, allowed)[:6].tolist(), extra[:6].tolist()
                show = (lambda ids: [(t, tok.token_bytes(t, special=True)) for t in ids])
                return ("mask", f"step {step} after {history}: {len(mine)} allowed here, {len(allowed)} in llama.cpp; "
                                f"only here {show(only_s)}, only there {show(only_l)}")
            for need in (1, 3, 40, None):
                x = np.round(rng.gauss(0, 1) * 4 + np.random.default_rng(rng.randrange(2**32)).standard_normal(
                    tok.n_vocab).astype(np.float32) * 3, 1).astype(np.float32)
                if rng.random() < 0.3:  # the best tokens masked by a logit bias
                    x[np.argsort(-x)[:rng.choice([1, 50, 5000])]] = -np.inf
                out = tg.constrain(x, st, need)
                want = _top(x, allowed, need)
                got = np.zeros(0, dtype=np.int64) if out is None else np.flatnonzero(out > -np.inf)
                if not np.array_equal(got, want) or (out is not None and not np.array_equal(out[got], x[got])):
                    return ("constrain", f"step {step} after {history}: constrain(need={need}) keeps {got[:8].tolist()}, "
                                         f"the best allowed are {want[:8].tolist()}")
            if picked < 0 or picked in tg.eog:
                break
            if isinstance(res, Crashed) and step == len(res) - 1:
                if not tg.allows(st, picked) and _taken_midway(tg, st, picked):
                    return ("skip-midway-ref", f"step {step}: llama.cpp aborts taking a token it allowed only by a "
                                               "token reference after characters of the token's own text")
                return ("crash", f"step {step}: llama.cpp aborts taking token {picked}")
            st = tg.advance(st, picked)
            history.append(picked)
    except GrammarTooAmbiguous as e:
        return ("skip-ambiguous", str(e))
    return None


def _oracle_case(text: str, seed: int, forced: tuple[int, ...], res, n_vocab: int, origin: str = "random") -> dict:
    """A case of tests/data/llamacpp_grammar_walks.json: the grammar, the picks its walk made, and at each step
    the tokens llama.cpp allowed (as id ranges "lo-hi,...", or "~lo-hi,...": all but those); refused: llama.cpp
    refused the grammar."""
    def ranges(ids: np.ndarray) -> str:
        if not ids.shape[0]:
            return ""
        cut = np.flatnonzero(np.diff(ids) != 1)
        lo, hi = np.r_[ids[0], ids[cut + 1]], np.r_[ids[cut], ids[-1]]
        return ",".join(f"{a}-{b}" for a, b in zip(lo.tolist(), hi.tolist()))

    def allowed_text(ids: np.ndarray) -> str:  # "~ranges": all but those
        rest = np.setdiff1d(np.arange(n_vocab), ids)
        return "~" + ranges(rest) if rest.shape[0] < ids.shape[0] else ranges(ids)
    case = {"origin": origin, "grammar": text, "seed": seed, "refused": res is None}
    if res is not None:
        case["steps"] = [[allowed_text(allowed), picked] for allowed, picked in res]
    return case


def shrink(oracle: Oracle, tok, text: str, seed: int, steps: int, eog: int, kind: str) -> str:
    """text cut down, a character span at a time, while it still differs in the same way."""
    def same(t: str) -> bool:
        res = oracle.walk(t, seed, steps, eog)
        r = compare(tok, t, res, random.Random(seed))
        return r is not None and r[0] == kind

    span = max(1, len(text) // 2)
    while span >= 1:
        i, changed = 0, False
        while i < len(text):
            t = text[:i] + text[i + span:]
            if t.strip() and same(t):
                text, changed = t, True
            else:
                i += span
        if not changed:
            span //= 2
    return text


def main() -> None:
    ap = fuzz_args(__doc__, "libllama", 500, "grammars per model")
    ap.add_argument("--steps", type=int, default=12, help="tokens per walk")
    ap.add_argument("--eog", type=int, default=150, help="per mille: how often a walk ends where it may")
    ap.add_argument("-m", "--model", action="append", help="registry name (default: SmolLM2)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds llama.cpp gets per grammar")
    ap.add_argument("--record", type=Path, help="write EDGES and agreeing cases of the first model to this oracle file")
    ap.add_argument("--record-n", type=int, default=30, help="how many random ones")
    a = ap.parse_args()
    from sharpi_core.gguf_file import GGUFFile
    from sharpi_core.registry import pull
    from sharpi_core.tokenizer import Tokenizer
    bad, skipped, recorded, n_random, n_vocab_rec = [], [], [], 0, 0
    with tempfile.TemporaryDirectory() as d:
        exe = build(a.src, a.bin, Path(d), "llamacpp_grammar_walk")
        for model in a.model or ["smollm2-135m-instruct-q4_1"]:
            path = pull(model)
            tok = Tokenizer.from_gguf(GGUFFile(path))
            oracle = Oracle(exe, path, a.timeout)
            rng = random.Random(f"{a.seed}:{model}")
            refs = token_refs(tok, random.Random(a.seed))
            counts: dict[str, int] = {}
            record = a.record and model == (a.model or ["smollm2-135m-instruct-q4_1"])[0]
            if record:
                n_vocab_rec = tok.n_vocab
                ids = {tok.token_bytes(t, special=True): t for t in range(tok.n_vocab)}
                for text, picks in EDGES:
                    forced = tuple(ids[b] for b in picks)
                    res = oracle.walk(text, 1, a.steps, a.eog, forced)
                    r = compare(tok, text, res, random.Random(1))
                    print(f"edge {text!r}: {r[1] if r else 'agrees'}", flush=True)
                    if r is None:
                        recorded.append(_oracle_case(text, 1, forced, res, tok.n_vocab, "found"))
                    elif not r[0].startswith("skip"):
                        bad.append({"model": model, "seed": 1, "kind": r[0], "why": r[1], "grammar": text})
            for i in range(a.runs):
                text = Gen(rng, refs).text()
                while _left_recursive(text) and rng.random() < 0.75:  # (a third of them are: fewer of those)
                    text = Gen(rng, refs).text()
                seed = rng.randrange(1, 2**31)
                res = oracle.walk(text, seed, a.steps, a.eog)
                r = compare(tok, text, res, random.Random(seed))
                kind = "agree-refused" if r is None and res is None else "agree" if r is None else r[0]
                counts[kind] = counts.get(kind, 0) + 1
                if record and r is None and n_random < a.record_n and (res is not None or n_random % 5 == 4):
                    case = _oracle_case(text, seed, (), res, tok.n_vocab)
                    if len(json.dumps(case)) < 20_000:  # (masks of many short runs of ids: big, and no harder)
                        recorded.append(case)
                        n_random += 1
                if kind.startswith("skip"):
                    skipped.append({"model": model, "seed": seed, "kind": kind, "grammar": text})
                if r is not None and not kind.startswith("skip"):
                    small = shrink(oracle, tok, text, seed, a.steps, a.eog, kind)
                    why = compare(tok, small, oracle.walk(small, seed, a.steps, a.eog), random.Random(seed))
                    print(f"{model} case {i} ({kind}): {why[1] if why else r[1]}\n    grammar {small!r}\n"
                          f"    (from {text!r})", flush=True)
                    bad.append({"model": model, "seed": seed, "kind": kind, "why": why[1] if why else r[1],
                                "grammar": small, "original": text})
                if (i + 1) % 50 == 0 or i + 1 == a.runs:
                    print(f"{model}: {i + 1}/{a.runs} grammars: {counts}", flush=True)
            oracle.close()
    if a.record:
        a.record.write_text(json.dumps({"model": (a.model or ["smollm2-135m-instruct-q4_1"])[0], "steps": a.steps,
                                        "n_vocab": n_vocab_rec, "cases": recorded}, indent=0, ensure_ascii=False) + "\n")
        print(f"wrote {len(recorded)} cases to {a.record}")
    if a.log:
        a.log.write_text(json.dumps({"differ": bad, "not compared": skipped}, indent=1) + "\n")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
