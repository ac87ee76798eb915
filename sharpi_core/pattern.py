"""A JSON Schema `pattern` (an ECMA-262 regular expression) -> a GBNF expression for the *JSON text* of
the strings it matches, between the quotes.

The regular expression is parsed here (no `re`: its syntax and classes are Python's, not ECMA's) into
character sets, sequences, alternatives and repetitions, then written as GBNF:

- a character of the decoded string is written as JSON writes it: `"` and `\\` and control characters
  escaped (`\\"`, `\\\\`, `\\n`, ..., `\\u001f`), everything else as itself; a set of characters becomes a
  GBNF class of the ones written raw plus the escapes of the others it holds;
- the pattern is a search, as JSON Schema says: unless it begins with `^` any text may come before the
  match, and after it unless it ends with `$` (per top-level alternative: `^a|b$`);
- `.` is any character but the line terminators (\\n \\r U+2028 U+2029); \\d \\w \\s and their negations,
  classes with ranges and negation, groups (capturing, `(?:`, named), `|`, `* + ? {n} {n,} {n,m}`
  (lazy forms too: the language is the same; `{,m}` is text, as ECMA-262 reads it), escapes \\t \\n
  \\r \\f \\v \\0 \\xHH \\uHHHH (a surrogate pair: one character) \\u{H...}.

Refused with one error line (never approximated): lookaround, backreferences, word boundaries, anchors
anywhere but the ends, unicode property escapes, an empty class, repetition counts above 2000, lone
surrogates, groups nested more than 100 deep.

llama.cpp's converter writes the pattern's characters raw (a `"` in a pattern's class or `.` may close
the JSON string early) and accepts any string for what it does not support (\\d, an unanchored pattern);
on the patterns it supports, the languages are the same for every string without `"`, `\\` or control
characters (but for `{,m}`, a repetition to llama.cpp).
"""
from __future__ import annotations

import re
from typing import NoReturn

from .grammar import MAX_REPETITION, class_char, literal, repetition

MAX_CP = 0x10FFFF
Ranges = tuple  # sorted, disjoint, non-adjacent ((lo, hi), ...) of code points


class PatternError(ValueError):
    """A pattern this module does not translate (the message says what and where)."""


def union(*sets) -> Ranges:
    out: list[list[int]] = []
    for lo, hi in sorted(r for s in sets for r in s):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def complement(s: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in s:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CP:
        out.append((nxt, MAX_CP))
    return tuple(out)


def intersect(a: Ranges, b: Ranges) -> Ranges:
    return complement(union(complement(a), complement(b)))


def contains(s: Ranges, c: int) -> bool:
    return any(lo <= c <= hi for lo, hi in s)


def _one(c: str) -> Ranges:
    return ((ord(c), ord(c)),)


DIGIT = ((0x30, 0x39),)
WORD = union(DIGIT, ((0x41, 0x5A),), _one("_"), ((0x61, 0x7A),))
SPACE = union(((0x09, 0x0D),), _one(" "), ((0xA0, 0xA0),), ((0x1680, 0x1680),), ((0x2000, 0x200A),),
              ((0x2028, 0x2029),), ((0x202F, 0x202F),), ((0x205F, 0x205F),), ((0x3000, 0x3000),), ((0xFEFF, 0xFEFF),))
DOT = complement(union(_one("\n"), _one("\r"), ((0x2028, 0x2029),)))
_CLASSES = {"d": DIGIT, "w": WORD, "s": SPACE}
_CONTROL = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13}

# JSON text: these are written escaped, everything else raw
_ESCAPED = union(((0x00, 0x1F),), _one('"'), _one("\\"))
_SHORT = {0x22: '"', 0x5C: "\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}


# -- parsing: nodes are ("set", ranges) | ("seq", [node]) | ("alt", [node]) | ("rep", node, lo, hi) | ("^",) | ("$",)
class _Parser:
    def __init__(self, src: str):
        self.s, self.i, self.depth = src, 0, 0

    def fail(self, what: str) -> NoReturn:
        raise PatternError(f"{what} at offset {self.i} of /{self.s}/")

    def peek(self, k: int = 0) -> str:
        return self.s[self.i + k] if self.i + k < len(self.s) else ""

    def alternatives(self) -> tuple:
        alts = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            alts.append(self.sequence())
        return ("alt", alts)

    def sequence(self) -> tuple:
        seq: list = []
        while self.peek() not in ("", "|", ")"):
            c = self.peek()
            if c in "*+?":
                self.fail("nothing to repeat")
            if c == "{" and self.quantifier() is not None:
                self.fail("nothing to repeat")
            seq.append(self.atom())
            while (q := self.quantifier()) is not None:
                if seq[-1][0] in ("^", "$", "rep"):
                    self.fail("nothing to repeat" if seq[-1][0] != "rep" else "a quantifier after a quantifier")
                seq[-1] = ("rep", seq[-1], *q)
        return ("seq", seq)

    def quantifier(self) -> tuple[int, int | None] | None:
        """(lo, hi) when a quantifier starts here (consumed, with a lazy `?` after it), else None."""
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            q = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{":
            end = self.s.find("}", self.i)
            body = self.s[self.i + 1:end] if end > 0 else ""
            lo_s, comma, hi_s = body.partition(",")
            if not (lo_s.isdigit() and lo_s.isascii() and (hi_s == "" or hi_s.isdigit() and hi_s.isascii())):
                return None  # not {n}, {n,} or {n,m}: `{` is a literal character (ECMA-262 Annex B)
            lo = int(lo_s)
            hi = int(hi_s) if hi_s else (None if comma else lo)
            if hi is not None and hi < lo:
                self.fail(f"repetition {{{body}}} out of order")
            if max(lo, hi or 0) > MAX_REPETITION:  # GBNF's limit: beyond it, no bound could be kept
                self.fail(f"repetition counts above {MAX_REPETITION} are not supported")
            self.i = end + 1
            q = (lo, hi)
        else:
            return None
        if self.peek() == "?":
            self.i += 1
        return q

    def atom(self) -> tuple:
        c = self.peek()
        self.i += 1
        if c == "^" or c == "$":
            return (c,)
        if c == ".":
            return ("set", DOT)
        if c == "[":
            return ("set", self.char_class())
        if c == "(":
            self.depth += 1
            if self.depth > 100:
                self.fail("groups nested more than 100 deep")
            if self.peek() == "?":
                if self.s.startswith("?:", self.i):
                    self.i += 2
                elif self.s.startswith("?<", self.i) and self.peek(2) not in ("=", "!"):
                    end = self.s.find(">", self.i)
                    if end < 0:
                        self.fail("unterminated group name")
                    self.i = end + 1
                else:
                    self.fail("lookaround and inline flags are not supported")
            node = self.alternatives()
            if self.peek() != ")":
                self.fail("missing ')'")
            self.i += 1
            self.depth -= 1
            return node
        if c == ")":
            self.fail("unbalanced ')'")
        if c == "\\":
            return ("set", self.escape(in_class=False))
        return ("set", _one(c))

    def escape(self, in_class: bool) -> Ranges:
        c = self.peek()
        self.i += 1
        if c == "":
            self.fail("trailing backslash")
        if c.lower() in _CLASSES:
            s = _CLASSES[c.lower()]
            return s if c.islower() else complement(s)
        if c in _CONTROL:
            return ((_CONTROL[c], _CONTROL[c]),)
        if c == "b" and in_class:
            return ((8, 8),)
        if c == "0" and not self.peek().isdigit():
            return ((0, 0),)
        if c in "xu":
            if c == "u" and self.peek() == "{":
                end = self.s.find("}", self.i)
                digits = self.s[self.i + 1:end] if end > 0 else ""
                self.i = end + 1 if end > 0 else self.i
            else:
                n = 2 if c == "x" else 4
                digits = self.s[self.i:self.i + n]
                self.i += n
                if len(digits) != n:
                    digits = ""
            if not digits or any(d not in "0123456789abcdefABCDEF" for d in digits) or int(digits, 16) > MAX_CP:
                self.fail(f"bad \\{c} escape")
            v = int(digits, 16)
            if 0xD800 <= v <= 0xDBFF and c == "u" and self.s.startswith("\\u", self.i):  # a pair: one character
                lo_half = self.s[self.i + 2:self.i + 6]
                if len(lo_half) == 4 and all(d in "0123456789abcdefABCDEF" for d in lo_half) \
                        and 0xDC00 <= int(lo_half, 16) <= 0xDFFF:
                    self.i += 6
                    v = 0x10000 + ((v - 0xD800) << 10) + int(lo_half, 16) - 0xDC00
            if 0xD800 <= v <= 0xDFFF:
                self.fail(f"a lone surrogate \\u{v:04X} matches no text")
            return ((v, v),)
        if c in "bB":
            self.fail("word boundaries (\\b, \\B) are not supported")
        if c.isdigit() or c == "k":
            self.fail("backreferences are not supported")
        if c in "pP":
            self.fail("unicode property escapes are not supported")
        if c.isascii() and c.isalnum():
            self.fail(f"unknown escape \\{c}")
        return _one(c)  # an escaped punctuation character is itself

    def char_class(self) -> Ranges:
        neg = self.peek() == "^"
        self.i += neg
        parts: list[Ranges] = []
        while self.peek() != "]":
            if self.peek() == "":
                self.fail("missing ']'")
            lo = self.class_atom()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                hi = self.class_atom()
                if len(lo) == 1 and lo[0][0] == lo[0][1] and len(hi) == 1 and hi[0][0] == hi[0][1]:
                    if hi[0][0] < lo[0][0]:
                        self.fail("class range out of order")
                    parts.append(((lo[0][0], hi[0][0]),))
                    continue
                parts += [lo, _one("-"), hi]  # \d-x: the dash is a character (Annex B)
                continue
            parts.append(lo)
        self.i += 1
        s = union(*parts)
        return complement(s) if neg else s

    def class_atom(self) -> Ranges:
        c = self.peek()
        self.i += 1
        return self.escape(in_class=True) if c == "\\" else _one(c)


def _ends(items: list) -> tuple[bool, list, bool]:
    """(anchored at the start, the items between the anchors, anchored at the end) of a top-level branch."""
    start = items[:1] == [("^",)]
    items = items[start:]
    end = items[-1:] == [("$",)]
    return start, items[:len(items) - end], end


def parse(pattern: str) -> list[tuple[bool, list, bool]]:
    """The pattern's top-level alternatives, each (anchored at the start, its items, anchored at the end)."""
    p = _Parser(pattern)
    node = p.alternatives()
    if p.i != len(pattern):
        p.fail("unbalanced ')'")

    def no_anchors(n) -> None:
        if n[0] in ("^", "$"):
            raise PatternError(f"anchors (^ $) inside the pattern are not supported: /{pattern}/")
        if n[0] in ("seq", "alt"):
            for m in n[1]:
                no_anchors(m)
        elif n[0] == "rep":
            no_anchors(n[1])

    branches = [_ends(list(seq[1])) for seq in node[1]]
    for _, items, _ in branches:
        no_anchors(("seq", items))
    return branches


# -- writing GBNF --------------------------------------------------------------------------------------------
def _class(s: Ranges) -> str:
    """The shorter of the GBNF class of s and the negated class of its complement."""
    neg = complement(s)
    body = lambda rs: "".join(class_char(lo) if lo == hi else f"{class_char(lo)}-{class_char(hi)}" for lo, hi in rs)
    return f"[{body(s)}]" if len(s) <= len(neg) else f"[^{body(neg)}]"


def json_char(c: int) -> str:
    """The JSON text of one character of a string."""
    if c in _SHORT:
        return "\\" + _SHORT[c]
    return f"\\u{c:04x}" if c < 0x20 else chr(c)


def charset(s: Ranges) -> str:
    """GBNF for the JSON text of one character of s: the raw ones as a class, the others escaped."""
    if not s:
        raise PatternError("an empty character class matches nothing")
    if len(s) == 1 and s[0][0] == s[0][1]:
        return literal(json_char(s[0][0]))
    alts = []
    raw = intersect(s, complement(_ESCAPED))
    if raw:
        alts.append(_class(raw))
    short = [v for k, v in _SHORT.items() if contains(s, k)]
    long_ = [c for c in range(0x20) if c not in _SHORT and contains(s, c)]
    esc = []
    if short:
        esc.append(_class(union(*(_one(v) for v in short))))
    for hi in (0, 1):  # \u00xx: the control characters without a short escape
        digits = {"0123456789abcdef"[c & 15] for c in long_ if c >> 4 == hi}
        if digits:
            esc.append(f'"u00{hi}" ' + _class(union(*(_one(d) for d in digits))))
    if esc:
        alts.append('"\\\\" ' + (esc[0] if len(esc) == 1 else "( " + " | ".join(esc) + " )"))
    return alts[0] if len(alts) == 1 else "( " + " | ".join(alts) + " )"


# one GBNF literal or class: a quantifier applies to it as a whole
_ATOM = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')


def _nullable(n) -> bool:
    kind = n[0]
    if kind == "set":
        return False
    if kind == "rep":
        return n[2] == 0 or _nullable(n[1])
    return (all if kind == "seq" else any)(_nullable(m) for m in n[1])


def _nonempty(n):
    """A node for the non-empty strings of n (None: n matches only the empty string)."""
    kind = n[0]
    if kind == "set" or kind == "seq" and not _nullable(n):
        return n
    if kind == "rep":
        _, sub, lo, hi = n
        sub_ne = None if hi == 0 else _nonempty(sub)
        if sub_ne is None:
            return None
        return ("rep", sub_ne, 1, hi) if _nullable(sub) else ("rep", sub, max(lo, 1), hi)
    if kind == "seq":  # every item may be empty: the first non-empty one, then the rest as they are
        alts = [("seq", [ne, *n[1][i + 1:]]) for i, m in enumerate(n[1]) if (ne := _nonempty(m)) is not None]
    else:
        alts = [ne for m in n[1] if (ne := _nonempty(m)) is not None]
    return ("alt", alts) if alts else None


def _inner(n):
    """n without its groups of one item: ((X)) is X."""
    while n[0] in ("alt", "seq") and len(n[1]) == 1:
        n = n[1][0]
    return n


def _flat_rep(n):
    """A repetition of repetitions as one, where the language is the same: (X+)+ is X+; (X*)*, (X+)*, (X?)+,
    (X+)? ... are X*; (X?)? is X?. Nested loops parse ambiguously, and the grammar keeps every parse: 20 nested
    (a+) kept exponentially many stacks (minutes and gigabytes for a few characters)."""
    _, sub, lo, hi = n
    inner = _inner(sub)
    # with counts 0 or 1 below and 1 or unbounded above, k in [lo, hi] parts of [a, b] items each are exactly
    # [lo * a, hi * b] items
    while inner[0] == "rep" and lo in (0, 1) and hi in (1, None) and inner[2] in (0, 1) and inner[3] in (1, None):
        _, sub, a, b = inner
        lo, hi = lo * a, None if hi is None or b is None else 1
        inner = _inner(sub)
    return ("rep", sub, lo, hi)


def _emit(n) -> str:
    kind = n[0]
    if kind == "set":
        return charset(n[1])
    if kind == "rep":
        _, sub, lo, hi = _flat_rep(n)
        if hi != 0 and _nullable(sub):  # B{lo,hi} is B'{0,hi}, B' the non-empty part: no empty loop in GBNF
            sub, lo = _nonempty(sub), 0
            if sub is None:
                return '""'
        item = _emit(sub)
        if not _ATOM.fullmatch(item):
            item = f"({item})"
        return repetition(item, lo, hi) or '""'
    if kind == "seq":
        parts, run = [], ""
        for m in n[1]:
            if m[0] == "set" and len(m[1]) == 1 and m[1][0][0] == m[1][0][1]:
                run += json_char(m[1][0][0])  # consecutive characters: one literal
                continue
            if run:
                parts.append(literal(run))
                run = ""
            if (part := _emit(m)) != '""':
                parts.append(part)
        if run:
            parts.append(literal(run))
        return " ".join(parts) if parts else '""'
    if kind == "alt":
        if len(n[1]) == 1:
            return _emit(n[1][0])
        return "( " + " | ".join(_emit(m) for m in n[1]) + " )"
    raise AssertionError(kind)


def pattern_to_gbnf(pattern: str, any_char: str) -> str:
    """GBNF (an expression) for the JSON text, without the quotes, of the strings in which `pattern`
    finds a match; `any_char` is the expression for one JSON string character (text around an
    unanchored match)."""
    branches = []
    for start, items, end in parse(pattern):
        parts = ["" if start else f"{any_char}*", _emit(("seq", items)), "" if end else f"{any_char}*"]
        branches.append(" ".join(p for p in parts if p and p != '""') or '""')
    return branches[0] if len(branches) == 1 else "( " + " | ".join(branches) + " )"
