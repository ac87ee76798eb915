"""GBNF grammars (llama.cpp's `--grammar` syntax) and the token masks they put on sampling.

A grammar constrains generation: a token may be picked only when its text keeps the output a prefix of
a sentence of the grammar, and an end-of-generation token only when the output is a whole sentence.
Semantics are llama.cpp's (src/llama-grammar.cpp), so greedy output matches llama-cli's with the same
grammar:

- syntax: `name ::= alternatives` rules (one per line; inside parentheses and after `|` lines may
  break), "literals" and [character classes] ([^...] negated) with \\x \\u \\U \\t \\r \\n \\\\ \\" \\[ \\]
  \\- escapes, `.` (any character), ( groups ), `*` `+` `?` `{m}` `{m,}` `{m,n}` repetition, `#`
  comments; a `root` rule. As in llama.cpp, `[]` and `[^]` are nothing (the empty text), a repetition
  may not stand for more than 2000 rules (a nested one multiplies), and left recursion is refused where
  llama.cpp's check finds it; where that check misses it, it is taken if the parse stays bounded, as it
  does in llama.cpp, and refused if not (llama.cpp loops there). Token references: `<[id]>`, `<text>`
  (the one token the text gives, special tokens included), `!<...>` (any token but it), see TokenRef;
- a token matches through its text as llama.cpp prints it (special tokens as their text), decoded as
  UTF-8 code points; a token ending inside a multi-byte character is allowed when that character
  could still match (llama.cpp's partial-UTF-8 rule), and after a token that completes no character
  the text may not end (llama.cpp drops the finished parse after every token); tokens with empty text
  never match.

The matcher is a pushdown automaton over code points: a *stack* is a tuple of positions in the
rules' flattened symbol table (the top, last, is a terminal to match next; the empty stack means the
sentence may end); a *state* is the set of live stacks, interned to an int, and transitions (state,
code point) -> state are memoized, so checking a token's text is mostly dict lookups. A full mask
over the vocabulary is computed only when the sampler chain needs it (cached per state); the usual
chains (greedy, top-k first) need only the best few allowed tokens, found in descending logit order.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import SharpiError, UsageError

_END = -1                 # end of an alternative in the flattened table
MAX_REPETITION = 2000    # llama.cpp's MAX_REPETITION_THRESHOLD
_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 3, 4)  # by the lead byte's high nibble (0: continuation)


# the parse stacks one character may lead to: an ambiguous grammar's grow with each character (memory, time)
MAX_STACKS = 200_000


class GrammarError(UsageError):
    """A grammar or schema that cannot be used (exit 2, like a bad flag value); `rule`: the rule it names, if one."""

    def __init__(self, msg: str, rule: str | None = None):
        super().__init__(msg)
        self.rule = rule


class GrammarTooAmbiguous(SharpiError):
    """The text so far parses in more than MAX_STACKS ways (exit 1: found while generating, after output began)."""


@dataclass(frozen=True)
class Terminal:
    """One character: in `ranges` (inclusive code point pairs), or not in them (`negated`), or any."""
    ranges: tuple[tuple[int, int], ...]
    negated: bool = False
    any: bool = False

    def match(self, c: int) -> bool:
        if self.any:
            return True
        return any(lo <= c <= hi for lo, hi in self.ranges) != self.negated

    def match_partial(self, value: int, n_remain: int) -> bool:
        """Whether a character beginning with these UTF-8 bytes (value, n_remain bytes still to come)
        could match (llama.cpp's llama_grammar_match_partial_char, a negated class included)."""
        if n_remain < 0 or (n_remain == 1 and value < 2):  # invalid, or an overlong 7-bit character
            return False
        low = value << (n_remain * 6)
        high = low | ((1 << (n_remain * 6)) - 1)
        if low == 0:
            low = {2: 1 << 11, 3: 1 << 16}.get(n_remain, low)
        if self.any:
            return True
        return any(lo <= high and low <= hi for lo, hi in self.ranges) != self.negated


@dataclass(frozen=True)
class TokenRef:
    """One token: `<[id]>` by its id, `<...>` by its text (the one token the text tokenizes to, found when the
    grammar is bound to a vocabulary), or with `!` any token but it. It matches no character: a token is
    checked against it by id where it is the next thing to match. (llama.cpp's mask also checks a token by
    id where the reference comes after characters the token's own text begins with, a token it then aborts
    on taking; here that token is not allowed.)"""
    id: int | None
    text: str | None = None
    negated: bool = False

    def match(self, c: int) -> bool:
        return False

    def match_partial(self, value: int, n_remain: int) -> bool:
        return False


# -- parsing --------------------------------------------------------------------------------------
def _word(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "-")


class _Parser:
    """GBNF text -> rules: {rule id: [alternative, ...]}, an alternative a list of Terminal or int
    (a rule id). Names and repetition rewrites follow llama.cpp's parser (llama_grammar_parser)."""

    def __init__(self, src: str):
        self.s = src + "\0"
        self.ids: dict[str, int] = {}
        self.rules: dict[int, list[list]] = {}
        self.refs: list[TokenRef] = []  # every token reference written, also one a {0} takes away

    def here(self, pos: int, n: int = 20) -> str:
        """What the text holds at pos, for an error (its '\\0' end, which the parser reads to, named)."""
        text = self.s[pos:pos + n].split("\0")[0]
        return repr(text) if text else "the end of the input"

    def fail(self, msg: str, pos: int) -> None:
        line = self.s.count("\n", 0, pos) + 1
        raise GrammarError(f"grammar: {msg} (line {line})")

    def sym(self, name: str) -> int:
        return self.ids.setdefault(name, len(self.ids))

    def gen(self, base: str) -> int:
        i = len(self.ids)
        self.ids[f"{base}_{i}"] = i
        return i

    def space(self, pos: int, newline_ok: bool) -> int:
        s = self.s
        while s[pos] in " \t#" or (newline_ok and s[pos] in "\r\n"):
            if s[pos] == "#":
                while s[pos] not in "\r\n\0":
                    pos += 1
            else:
                pos += 1
        return pos

    def name(self, pos: int) -> int:
        end = pos
        while _word(self.s[end]):
            end += 1
        if end == pos:
            self.fail(f"expecting a name at {self.here(pos)}", pos)
        return end

    def hex(self, pos: int, n: int) -> tuple[int, int]:
        digits = self.s[pos:pos + n]
        if len(digits) != n or any(c not in "0123456789abcdefABCDEF" for c in digits):
            self.fail(f"expecting {n} hex digits at {self.here(pos, n)}", pos)
        return int(digits, 16), pos + n

    def char(self, pos: int) -> tuple[int, int]:
        s = self.s
        if s[pos] == "\\":
            e = s[pos + 1]
            if e in "xuU":
                return self.hex(pos + 2, {"x": 2, "u": 4, "U": 8}[e])
            if e in "trn":
                return ord({"t": "\t", "r": "\r", "n": "\n"}[e]), pos + 2
            if e in '\\"[]-':
                return ord(e), pos + 2
            self.fail(f"unknown escape \\{e}", pos)
        if s[pos] == "\0" and pos == len(s) - 1:
            self.fail("unexpected end of input", pos)
        return ord(s[pos]), pos + 1

    def parse(self) -> "_Parser":
        pos = self.space(0, True)
        while pos < len(self.s) - 1:
            pos = self.rule(pos)
        for name, i in self.ids.items():
            if i not in self.rules:
                raise GrammarError(f"grammar: undefined rule '{name}'")
        if "root" not in self.ids:
            raise GrammarError("grammar: no 'root' rule")
        return self

    def rule(self, pos: int) -> int:
        end = self.name(pos)
        name = self.s[pos:end]
        rid = self.sym(name)
        pos = self.space(end, False)
        if self.s[pos:pos + 3] != "::=":
            self.fail(f"expecting ::= at {self.here(pos)}", pos)
        pos = self.alternates(self.space(pos + 3, True), name, rid, False)
        if self.s[pos] == "\r":
            pos += 2 if self.s[pos + 1] == "\n" else 1
        elif self.s[pos] == "\n":
            pos += 1
        elif pos < len(self.s) - 1:
            self.fail(f"expecting a newline or the end at {self.here(pos)}", pos)
        return self.space(pos, True)

    def alternates(self, pos: int, name: str, rid: int, nested: bool) -> int:
        alts = []
        pos, seq = self.sequence(pos, name, nested)
        alts.append(seq)
        while self.s[pos] == "|":
            pos, seq = self.sequence(self.space(pos + 1, True), name, nested)
            alts.append(seq)
        self.rules[rid] = alts
        return pos

    def repeat(self, seq: list, start: int, lo: int, hi: int | None, name: str, pos: int, n_prev: int) -> int:
        """seq[start:] (the last item) repeated lo..hi times (hi None: unbounded). n_prev: how many rules the
        item stands for (a group's, multiplied by the repetitions already applied to it); returns it times this
        repetition's count, which llama.cpp caps at MAX_REPETITION (the rules a nested repetition writes)."""
        if start == len(seq):
            self.fail("expecting an item before */+/?/{", pos)
        count = hi if hi is not None and hi > 0 else lo if lo > 0 else 1
        if n_prev * count > MAX_REPETITION:
            self.fail(f"this repetition of a repeated item or group stands for {n_prev * count} rules, more than "
                      f"llama.cpp's limit of {MAX_REPETITION}", pos)
        item = seq[start:]
        del seq[start:]
        seq += item * lo
        if hi is None:  # S' ::= S S' |
            r = self.gen(name)
            self.rules[r] = [item + [r], []]
            seq.append(r)
        elif hi > lo:  # S'(1) ::= S | ; S'(x) ::= S S'(x-1) |
            last = None
            for _ in range(hi - lo):
                r = self.gen(name)
                self.rules[r] = [item + ([last] if last is not None else []), []]
                last = r
            seq.append(last)
        return n_prev * count

    def integer(self, pos: int) -> tuple[int, int]:
        end = pos
        while self.s[end].isascii() and self.s[end].isdigit():
            end += 1
        if end == pos:
            self.fail(f"expecting an integer at {self.here(pos)}", pos)
        return int(self.s[pos:end]), end

    def sequence(self, pos: int, name: str, nested: bool) -> tuple[int, list]:
        s, seq, last, n_prev = self.s, [], 0, 1
        while True:
            c = s[pos]
            if c == '"':
                pos += 1
                last, n_prev = len(seq), 1
                while s[pos] != '"':
                    if pos >= len(s) - 1:
                        self.fail("unexpected end of input in a literal", pos)
                    v, pos = self.char(pos)
                    seq.append(Terminal(((v, v),)))
                pos = self.space(pos + 1, nested)
            elif c == "[":
                pos += 1
                neg = s[pos] == "^"
                pos += neg
                ranges = []
                while s[pos] != "]":
                    if pos >= len(s) - 1:
                        self.fail("unexpected end of input in a character class", pos)
                    lo, pos = self.char(pos)
                    hi = lo
                    if s[pos] == "-" and s[pos + 1] != "]":
                        if pos + 1 >= len(s) - 1:
                            self.fail("unexpected end of input in a character class", pos)
                        hi, pos = self.char(pos + 1)
                    ranges.append((lo, hi))
                last, n_prev = len(seq), 1
                if ranges:  # (llama.cpp writes nothing for [] or [^]: they match the empty text)
                    seq.append(Terminal(tuple(ranges), neg))
                pos = self.space(pos + 1, nested)
            elif c in "<!":
                neg = c == "!"
                pos += neg
                if s[pos] != "<":
                    self.fail(f"expecting '<' at {self.here(pos)}", pos)
                if s[pos + 1] == "[":
                    tid, end = self.integer(pos + 2)
                    if tid > 0xFFFFFFFF:
                        self.fail(f"token id {tid} is too big", pos)
                    if s[end] != "]" or s[end + 1] != ">":
                        self.fail(f"expecting ']>' at {self.here(end)}", end)
                    ref, pos = TokenRef(tid, None, neg), end + 2
                else:
                    end = s.find(">", pos)
                    if end < 0 or "\0" in s[pos:end]:
                        self.fail(f"expecting '>' at {self.here(pos + 1)}", pos)
                    ref, pos = TokenRef(None, s[pos:end + 1], neg), end + 1
                last, n_prev = len(seq), 1
                seq.append(ref)
                self.refs.append(ref)
                pos = self.space(pos, nested)
            elif _word(c):
                end = self.name(pos)
                last, n_prev = len(seq), 1
                seq.append(self.sym(s[pos:end]))
                pos = self.space(end, nested)
            elif c == "(":
                n_before = len(self.ids)
                sub = self.gen(name)
                pos = self.alternates(self.space(pos + 1, True), name, sub, True)
                if s[pos] != ")":
                    self.fail(f"expecting ')' at {self.here(pos)}", pos)
                # the rules the group stands for: its own, its repetitions' and the names it first mentions
                last, n_prev = len(seq), max(1, len(self.ids) - n_before)
                seq.append(sub)
                pos = self.space(pos + 1, nested)
            elif c == ".":
                last, n_prev = len(seq), 1
                seq.append(Terminal((), any=True))
                pos = self.space(pos + 1, nested)
            elif c in "*+?":
                pos = self.space(pos + 1, nested)
                n_prev = self.repeat(seq, last, 1 if c == "+" else 0, 1 if c == "?" else None, name, pos, n_prev)
            elif c == "{":
                pos = self.space(pos + 1, nested)
                lo, pos = self.integer(pos)
                pos = self.space(pos, nested)
                hi: int | None = None
                if s[pos] == "}":
                    hi = lo
                elif s[pos] == ",":
                    pos = self.space(pos + 1, nested)
                    if s[pos].isascii() and s[pos].isdigit():
                        hi, pos = self.integer(pos)
                        pos = self.space(pos, nested)
                    if s[pos] != "}":
                        self.fail(f"expecting '}}' at {self.here(pos)}", pos)
                else:
                    self.fail(f"expecting ',' at {self.here(pos)}", pos)
                pos = self.space(pos + 1, nested)
                if lo > MAX_REPETITION:
                    self.fail(f"{lo} repetitions exceed the limit of {MAX_REPETITION}", pos)
                if hi is not None and hi > MAX_REPETITION:
                    hi = None
                if hi is not None and hi < lo:
                    self.fail(f"repetition {{{lo},{hi}}}: the maximum is below the minimum", pos)
                n_prev = self.repeat(seq, last, lo, hi, name, pos, n_prev)
            else:
                return pos, seq


# -- writing GBNF (sharpi_core.json_schema, sharpi_core.pattern) --------------------------------------
def literal(text: str) -> str:
    """A GBNF literal matching `text` exactly."""
    return '"' + "".join({"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}.get(c, c) for c in text) + '"'


def class_char(c: int) -> str:
    """Code point c inside a GBNF character class: printable ASCII as itself, the rest as hex escapes."""
    if 0x20 < c < 0x7F and chr(c) not in '\\]-^"[':
        return chr(c)
    return f"\\x{c:02X}" if c <= 0xFF else f"\\u{c:04X}" if c <= 0xFFFF else f"\\U{c:08X}"


def repetition(item: str, lo: int, hi: int | None, sep: str = "") -> str:
    """item repeated lo..hi times (hi None: unbounded), `sep` between items."""
    if hi == 0:
        return ""
    if lo == 0 and hi == 1:
        return f"{item}?"
    if not sep:
        if hi is None:
            return f"{item}+" if lo == 1 else f"{item}*" if lo == 0 else f"{item}{{{lo},}}"
        return f"{item}{{{lo},{hi}}}"
    rest = repetition(f"({sep} {item})", max(lo - 1, 0), None if hi is None else hi - 1)
    out = f"{item} {rest}"
    return f"({out})?" if lo == 0 else out


# -- the automaton ----------------------------------------------------------------------------------
class Grammar:
    """A parsed grammar: the rules flattened into one symbol table, and the memoized transitions of
    the pushdown automaton over code points (states are ints; -1 is the dead state)."""

    def __init__(self, text: str):
        p = _Parser(text).parse()
        self.text = text
        self.refs = tuple(dict.fromkeys(p.refs))  # (llama.cpp tokenizes each as it parses it: one not a token is an error)
        self.names = {i: n for n, i in p.ids.items()}
        # flat: >= 0 a terminal index, -1 the end of an alternative, <= -2 rule (-2 - id)
        self.terminals: list[Terminal | TokenRef] = []
        term_ids: dict[Terminal | TokenRef, int] = {}
        self.flat: list[int] = []
        self.alts: dict[int, list[int]] = {}
        for rid in sorted(p.rules):
            starts = []
            for alt in p.rules[rid]:
                starts.append(len(self.flat))
                for sym in alt:
                    if isinstance(sym, (Terminal, TokenRef)):
                        self.flat.append(term_ids.setdefault(sym, len(term_ids)))
                        if len(term_ids) > len(self.terminals):
                            self.terminals.append(sym)
                    else:
                        self.flat.append(-2 - sym)
                self.flat.append(_END)
            self.alts[rid] = starts
        self.start_rule = p.ids["root"]
        self._check_left_recursion()
        self._states: list[frozenset] = []
        self._state_ids: dict[frozenset, int] = {}
        self._trans: dict[int, int] = {}
        self._partial: dict[tuple[int, int, int], bool] = {}
        self._token_tops: dict[int, tuple[int, ...]] = {}
        self._tok_trans: dict[tuple[int, frozenset], int] = {}
        root: set = set()
        self._expand([(-2 - self.start_rule,)], root)
        self.start = self._intern(frozenset(root))

    def _left_refs(self, passable: set[int]) -> dict[int, list[tuple[int, bool]]]:
        """rule id -> the (rule, tail) references it may begin with: an alternative's first reference, and the
        next ones while the rules before them are `passable`; tail: the reference ends its alternative."""
        out: dict[int, list[tuple[int, bool]]] = {}
        for rid, starts in self.alts.items():
            refs = out.setdefault(rid, [])
            for a in starts:
                i = a
                while self.flat[i] <= -2:
                    r = -2 - self.flat[i]
                    refs.append((r, self.flat[i + 1] == _END))
                    if r not in passable:
                        break
                    i += 1
        return out

    def _check_left_recursion(self) -> None:
        """Refuses what llama.cpp refuses (llama_grammar_detect_left_recursion): a rule reaching itself through
        the references it may begin with, where llama.cpp passes over a reference only to a rule with an empty
        alternative of its own, not to one that derives the empty text in a longer way (`x ::= y`, `y ::= ""`).
        A recursion that check misses runs in llama.cpp as here where the parse stacks stay bounded (every
        reference around it ends its alternative: `(x)*` with x deriving the empty text), so it is taken; where
        they would grow with no end (llama.cpp loops there, taking memory) it is refused too."""
        direct = {rid for rid, starts in self.alts.items() if any(self.flat[a] == _END for a in starts)}
        for comp, _ in _cycles(self._left_refs(direct)):
            self._refuse_left(comp)
        nullable: set[int] = set()
        changed = True
        while changed:
            changed = False
            for rid, starts in self.alts.items():
                if rid not in nullable and any(self._nullable_from(a, nullable) for a in starts):
                    nullable.add(rid)
                    changed = True
        reach, todo = {self.start_rule}, [self.start_rule]
        while todo:
            for i in self.alts[todo.pop()]:
                while self.flat[i] != _END:
                    r = -2 - self.flat[i]
                    if r >= 0 and r not in reach:
                        reach.add(r)
                        todo.append(r)
                    i += 1
        left = {r: v for r, v in self._left_refs(nullable).items() if r in reach}
        for comp, refs in _cycles(left):
            if any(not tail for _, tail in refs):
                self._refuse_left(comp)

    def _refuse_left(self, comp: list[int]) -> None:
        rid = min(comp)
        raise GrammarError(f"grammar: left recursion in rule '{self.names[rid]}' (not supported, as in llama.cpp)",
                           rule=self.names[rid])

    def ends(self) -> bool:
        """Whether some finite text matches the root: False where every way through it refers back into itself
        (`root ::= "[" root "]"`), a grammar llama.cpp runs too, generating until -n stops it."""
        done: set[int] = set()  # the rules that match some finite text
        changed = True
        while changed:
            changed = False
            for rid, starts in self.alts.items():
                if rid in done:
                    continue
                for a in starts:
                    i = a
                    while self.flat[i] != _END and (self.flat[i] >= 0 or -2 - self.flat[i] in done):
                        i += 1
                    if self.flat[i] == _END:
                        done.add(rid)
                        changed = True
                        break
        return self.start_rule in done

    def _nullable_from(self, i: int, nullable: set[int]) -> bool:
        while self.flat[i] != _END:
            if self.flat[i] >= 0 or -2 - self.flat[i] not in nullable:
                return False
            i += 1
        return True

    def _expand(self, stacks: list[tuple], out: set) -> None:
        """Adds to `out` the stacks `stacks` stand for: rule references at the top replaced by each of
        their alternatives until a terminal is on top (or the stack is empty)."""
        # a work list, as llama.cpp's advance_stack: a run of optional items (`"a"?` x 800) is as long a chain of
        # empty alternatives, which recursion would follow as deep; one for all the stacks, which share most
        # of what they expand to
        todo, seen = list(stacks), set()
        while todo:
            stack = todo.pop()
            if stack in seen:
                continue
            seen.add(stack)
            if len(seen) > MAX_STACKS:
                raise GrammarTooAmbiguous(f"grammar: more than {MAX_STACKS} ways to parse the text so far (repetitions "
                                          "nested a dozen deep, such as ((((x)+)+)+)+ and deeper, multiply them): "
                                          "write the grammar without them")
            if not stack:
                out.add(stack)
                continue
            p = stack[-1]
            s = self.flat[p] if p >= 0 else p  # a bare rule reference (-2 - id) starts the root
            if s >= 0:
                out.add(stack)
                continue
            rest = stack[:-1]
            if p >= 0 and self.flat[p + 1] != _END:
                rest = rest + (p + 1,)
            todo += [rest + (a,) if self.flat[a] != _END else rest for a in self.alts[-2 - s]]

    def _intern(self, stacks: frozenset) -> int:
        if not stacks:
            return -1
        sid = self._state_ids.get(stacks)
        if sid is None:
            sid = self._state_ids[stacks] = len(self._states)
            self._states.append(stacks)
        return sid

    def step(self, sid: int, c: int) -> int:
        """The state after code point c (-1: not allowed)."""
        if sid < 0:
            return sid
        key = sid * 0x110000 + c
        nxt = self._trans.get(key)
        if nxt is None:
            out: set = set()
            flat, terms = self.flat, self.terminals
            self._expand([st[:-1] + ((st[-1] + 1,) if flat[st[-1] + 1] != _END else ())
                          for st in self._states[sid] if st and terms[flat[st[-1]]].match(c)], out)
            nxt = self._trans[key] = self._intern(frozenset(out))
        return nxt

    def after(self, text: str, sid: int | None = None) -> int:
        """The state after `text` from sid (default: the start; -1: text is no prefix of a sentence)."""
        s = self.start if sid is None else sid
        for c in text:
            s = self.step(s, ord(c))
        return s

    def char_tops(self, sid: int) -> int:
        """State sid with only its stacks that wait for a character (what a token that completes no character
        leaves: llama.cpp drops the finished parse, and the token references it does not match, after any)."""
        if sid < 0:
            return sid
        return self._intern(frozenset(st for st in self._states[sid]
                                      if st and isinstance(self.terminals[self.flat[st[-1]]], Terminal)))

    def union(self, a: int, b: int) -> int:
        if a < 0 or b < 0:
            return max(a, b)
        return self._intern(self._states[a] | self._states[b])

    def token_tops(self, sid: int) -> tuple[int, ...]:
        """The terminal indices of the token references waiting on top of state sid's stacks."""
        tops = self._token_tops.get(sid)
        if tops is None:
            tops = self._token_tops[sid] = tuple(sorted({self.flat[st[-1]] for st in self._states[sid] if st
                                                         and isinstance(self.terminals[self.flat[st[-1]]], TokenRef)}))
        return tops

    def step_token(self, sid: int, matched: frozenset[int]) -> int:
        """The state after a token that the token references `matched` (terminal indices) match, from the
        stacks with one of them on top (-1: none)."""
        key = (sid, matched)
        nxt = self._tok_trans.get(key)
        if nxt is None:
            out: set = set()
            flat = self.flat
            self._expand([st[:-1] + ((st[-1] + 1,) if flat[st[-1] + 1] != _END else ())
                          for st in self._states[sid] if st and flat[st[-1]] in matched], out)
            nxt = self._tok_trans[key] = self._intern(frozenset(out))
        return nxt

    def complete(self, sid: int) -> bool:
        """Whether the text so far is a sentence (an end-of-generation token may come now)."""
        return sid >= 0 and () in self._states[sid]

    def partial_ok(self, sid: int, value: int, n_remain: int) -> bool:
        key = (sid, value, n_remain)
        ok = self._partial.get(key)
        if ok is None:
            ok = self._partial[key] = any(st and self.terminals[self.flat[st[-1]]].match_partial(value, n_remain)
                                          for st in self._states[sid])
        return ok

    def first_bytes(self, sid: int) -> np.ndarray:
        """bool [257]: the first bytes a token may start with in state sid (a necessary condition; index
        256 is never allowed: tokens without text)."""
        ok = np.zeros(257, dtype=bool)
        tops = {self.flat[st[-1]] for st in self._states[sid] if st}
        terms = [self.terminals[t] for t in tops if isinstance(self.terminals[t], Terminal)]
        for b in range(0x80):
            ok[b] = any(t.match(b) for t in terms)
        loose = any(t.any or t.negated for t in terms)
        for b in range(0xC0, 0x100):
            n = _UTF8_LEN[b >> 4] - 1
            ok[b] = loose or any(t.match_partial(b & ((1 << (7 - n)) - 1), n) for t in terms)
        return ok


def _cycles(graph: dict[int, list[tuple[int, bool]]]):
    """The strongly connected components of `graph` (node -> [(node, label)], edges to nodes outside it
    ignored) that hold a cycle, each as (its nodes, the labelled edges inside it); Tarjan's, without recursion."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on: set[int] = set()
    stack: list[int] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on.add(v)
            edges = graph[v]
            while i < len(edges) and (edges[i][0] not in graph or edges[i][0] in index):
                w = edges[i][0]
                if w in on:
                    low[v] = min(low[v], index[w])
                i += 1
            if i < len(edges):
                work += [(v, i + 1), (edges[i][0], 0)]
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                members = set(comp)
                inner = [(w, lab) for u in comp for w, lab in graph[u] if w in members]
                if len(comp) > 1 or inner:
                    yield comp, inner
            if work:  # v is done: its parent, next on the work list, takes its low link
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])


def decode_utf8(data: bytes, value: int = 0, n_remain: int = 0) -> tuple[list[int], int, int]:
    """llama.cpp's decode_utf8: the complete code points of `data` continuing a partial character
    (value, n_remain), and the partial character it ends in. n_remain -1: invalid (nothing matches)."""
    cps: list[int] = []
    i, n = 0, len(data)
    start_remain = n_remain
    while i < n and n_remain > 0:
        b = data[i]
        if b >> 6 != 2:
            return [], 0, -1
        value = (value << 6) + (b & 0x3F)
        i += 1
        n_remain -= 1
    if start_remain > 0 and n_remain == 0:
        cps.append(value)
    while i < n:
        b = data[i]
        n_remain = _UTF8_LEN[b >> 4] - 1
        if n_remain < 0:
            return [], 0, -1
        value = b & ((1 << (7 - n_remain)) - 1)
        i += 1
        while i < n and n_remain > 0:
            value = (value << 6) + (data[i] & 0x3F)
            i += 1
            n_remain -= 1
        if n_remain == 0:
            cps.append(value)
    return cps, value, n_remain


# -- the vocabulary --------------------------------------------------------------------------------
State = tuple[int, int, int]  # (automaton state, partial character value, bytes still to come)


class TokenGrammar:
    """A grammar bound to a vocabulary: which tokens may come next from a state, and the state after
    a token. States are (automaton state, partial UTF-8 character)."""

    def __init__(self, grammar: Grammar, tokenizer, n_vocab: int):
        self.g = grammar
        self.n_vocab = n_vocab
        self.eog = frozenset(t for t in tokenizer.eog_ids if t < n_vocab)
        n_tok = min(n_vocab, tokenizer.n_vocab)  # output rows past the vocabulary (padding) never match
        self.pieces: list[bytes] = [tokenizer.token_bytes(t, special=True) for t in range(n_tok)] + [b""] * (n_vocab - n_tok)
        # each token's code points from a clean start, and the partial character it ends in (decoded when
        # first needed: decoding a 150k vocabulary up front costs 0.2 s a run)
        self._decoded: list = [None] * n_vocab
        # each token reference's id (terminal index -> id; one by text is the one token its text gives)
        ref_id = {}
        for t in grammar.refs:
            ids = [t.id] if t.id is not None else tokenizer.encode(t.text, add_special=False, parse_special=True)
            if len(ids) != 1:
                raise GrammarError(f"grammar: invalid token '{t.text}' (its text is {len(ids)} tokens, not one)")
            ref_id[t] = ids[0]
        self.ref_ids: dict[int, int] = {i: ref_id[t] for i, t in enumerate(grammar.terminals) if isinstance(t, TokenRef)}
        fb = np.array([b[0] if b and b[0] != 0 else 256 for b in self.pieces], dtype=np.int64)
        fb[list(self.eog)] = 256
        self.first_byte = fb
        self._masks: OrderedDict[State, np.ndarray] = OrderedDict()
        self._first: dict[int, np.ndarray] = {}

    def initial(self, prompt: Sequence[int] = ()) -> State:
        """The state a generation starts in (the prompt does not move a grammar)."""
        return (self.g.start, 0, 0)

    def _decode(self, tid: int) -> tuple[list[int], int, int]:
        d = self._decoded[tid]
        if d is None:
            d = self._decoded[tid] = decode_utf8(self.pieces[tid])
        return d

    def _matched(self, sid: int, tid: int) -> frozenset[int]:
        """The token references on top of state sid that token tid matches (terminal indices)."""
        terms, ids = self.g.terminals, self.ref_ids
        return frozenset(t for t in self.g.token_tops(sid) if (ids[t] == tid) != terms[t].negated)

    def allows(self, st: State, tid: int) -> bool:
        """Whether token tid may come next in state st."""
        if tid in self.eog:
            return self.g.complete(st[0])
        piece = self.pieces[tid]
        if not piece or piece[0] == 0:
            return False
        cps, v, n = self._decode(tid) if st[2] == 0 else decode_utf8(piece, st[1], st[2])
        if n < 0:
            return False
        s, step = st[0], self.g.step
        if cps and self.ref_ids and self.g.token_tops(s) and self._matched(s, tid):
            return True  # a token reference on top matches it by id, whatever its text
        for c in cps:
            s = step(s, c)
            if s < 0:
                return False
        return not n or self.g.partial_ok(s, v, n)

    def advance(self, st: State, tid: int) -> State:
        """The state after token tid (which must be allowed; an end-of-generation token changes nothing)."""
        if tid in self.eog:
            return st
        cps, v, n = self._decode(tid) if st[2] == 0 else decode_utf8(self.pieces[tid], st[1], st[2])
        s = st[0]
        for c in cps:
            s = self.g.step(s, c)
        if not cps:  # (llama.cpp drops the finished parse after any token: the text cannot end in a split character)
            s = self.g.char_tops(s)
        if self.ref_ids and self.g.token_tops(st[0]):  # the stacks a token reference on top matches go on by id
            s = self.g.union(s, self.g.step_token(st[0], self._matched(st[0], tid)))
        if s < 0 or n < 0:
            raise ValueError(f"grammar: token {tid} ({self.pieces[tid]!r}) does not fit the grammar here")
        return (s, v, n)

    def advance_all(self, st: State, tids: Sequence[int]) -> State:
        for t in tids:
            st = self.advance(st, t)
        return st

    def mask(self, st: State) -> np.ndarray:
        """bool [V]: every token allowed in state st (cached for the most recent states)."""
        m = self._masks.get(st)
        if m is not None:
            self._masks.move_to_end(st)
            return m
        m = np.zeros(self.n_vocab, dtype=bool)
        cand = np.arange(self.n_vocab) if st[2] else np.flatnonzero(self._prefilter(st[0]))
        allows = self.allows
        m[[t for t in cand.tolist() if allows(st, t)]] = True
        if self.g.complete(st[0]):
            m[list(self.eog)] = True
        self._masks[st] = m
        if len(self._masks) > 64:
            self._masks.popitem(last=False)
        return m

    def _prefilter(self, sid: int) -> np.ndarray:
        """bool [V]: the tokens whose first byte may start the text in state sid (no partial character
        pending): a necessary condition, one table lookup per token."""
        f = self._first.get(sid)
        if f is None:
            f = self.g.first_bytes(sid)[self.first_byte]
            for t in self.g.token_tops(sid):  # (a token reference lets tokens in by id, whatever their text)
                if self.g.terminals[t].negated:
                    f = np.ones_like(f)
                elif self.ref_ids[t] < f.shape[0]:
                    f[self.ref_ids[t]] = True
            self._first[sid] = f
            if len(self._first) > 256:
                self._first.pop(next(iter(self._first)))
        return f

    def constrain(self, x: np.ndarray, st: State, need: int | None) -> np.ndarray | None:
        """Logits x [W] float32 with every token the grammar does not allow at -inf; with `need`, only
        the `need` best allowed tokens (by logit, lowest ids first on ties) keep their logits, which is
        all a greedy pick (need 1) or a chain starting with top-k (need k) looks at. None when no
        allowed token has a finite logit. W may differ from the vocabulary's size (a draft model's
        output layer cut to its first ids, or a few ids wider): ids past the vocabulary never match."""
        from .sampling import _topk_sorted

        V = x.shape[0]
        out = np.full(V, -np.inf, dtype=np.float32)
        if need == 1:
            t = int(np.argmax(x))
            if x[t] > -np.inf and t < self.n_vocab and self.allows(st, t):
                out[t] = x[t]
                return out
        m = max(64, 4 * need) if need is not None else V
        while need is not None and need < V and st not in self._masks and m < V:
            idx = _topk_sorted(x, m)
            cand = idx[idx < self.n_vocab]
            cand = cand if st[2] else cand[self._prefilter(st[0])[cand]]
            ok = np.array([t for t in cand.tolist() if self.allows(st, t)], dtype=np.int64)
            vals = x[ok]
            if ok.shape[0] >= need and vals[np.argsort(-vals, kind="stable")[need - 1]] > x[idx[-1]]:
                o = np.lexsort((ok, -vals))[:need]
                sel = ok[o]
                if not x[sel[0]] > -np.inf:
                    return None
                out[sel] = x[sel]
                return out
            m *= 16
        mask = np.zeros(V, dtype=bool)
        w = min(V, self.n_vocab)
        mask[:w] = self.mask(st)[:w]
        if not (mask & (x > -np.inf)).any():
            return None
        if need is not None and need < int(mask.sum()):
            ids = np.flatnonzero(mask)
            o = np.lexsort((ids, -x[ids]))[:need]
            out[ids[o]] = x[ids[o]]
        else:
            out[mask] = x[mask]
        return out


def grammar_need(params) -> int | None:
    """How many of the best allowed tokens the sampler chain of `params` can look at (None: all):
    one for greedy decoding, k when top-k is the first filter (penalties and DRY, which run before the
    grammar here as in llama.cpp's chain, do not count)."""
    if params.greedy:
        return 1
    if params.mirostat:
        return None
    for stage in params.filters:  # (adaptive-p draws from what the filters keep)
        if stage in ("penalties", "dry"):
            continue
        if stage == "top_n_sigma" and params.top_n_sigma <= 0:
            continue
        if stage == "top_k" and params.top_k > 0:
            return params.top_k
        return None
    return None
