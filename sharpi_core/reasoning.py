"""Reasoning ("thinking") blocks: which tags a chat template's block has, and llama.cpp's reasoning budget.

The budget (`--reasoning-budget N`) is a token constraint with the grammar's interface (grammar.TokenGrammar:
initial / advance / constrain), so plain steps, verify rows and a draft model's proposals all see it and
speculation stays exact: where it forces a token, the target's law is that token alone.

Its states follow llama.cpp's reasoning-budget sampler (common/reasoning-budget.cpp): idle until a start tag
(`<think>`) is generated, then counting N tokens while watching for the end tag; a token that spends the
budget (or, when it ends inside a UTF-8 character, the token that completes one) starts forcing the budget
message and the end tag token by token; then done, until a new start tag counts again. Tags are matched as
token sequences, each match starting over after it.
"""
from __future__ import annotations

import re
from typing import Sequence

import numpy as np

IDLE, COUNTING, WAITING_UTF8, FORCING, DONE = range(5)

# (mode, tokens left, next forced token's index, the last tokens seen by the start / end matcher)
State = tuple[int, int, int, tuple, tuple]

# a block's end tag as templates write it: `</think>`, `</seed:think>`, ...
_END_TAG = re.compile(r"</([A-Za-z0-9_.:-]*think[A-Za-z0-9_.:-]*)>")


# blocks of other shapes, as llama.cpp's parsers know them: Mistral's (Magistral, Ministral reasoning), Cohere's (Command A),
# gpt-oss's harmony channels (the analysis message, ended where the final one starts: what follows is the content)
_OTHER_TAGS = (("[THINK]", "[/THINK]"), ("<|START_THINKING|>", "<|END_THINKING|>"),
               ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>"))
# what opens a reply's content when it skips the block (gpt-oss's final channel without an analysis one): dropped, as
# llama.cpp's parser drops it
_CONTENT_OPENERS = {_OTHER_TAGS[2][0]: "<|channel|>final<|message|>"}


def thinking_tags(template: str | None) -> tuple[str, str] | None:
    """(start, end) of the reasoning block a chat template writes (its text has both `<X>` and `</X>`
    for a tag name X with "think" in it, or a pair of _OTHER_TAGS), or None."""
    if not template:
        return None
    for m in _END_TAG.finditer(template):
        if f"<{m[1]}>" in template:
            return f"<{m[1]}>", m[0]
    for start, end in _OTHER_TAGS:
        if start in template and end in template:
            return start, end
    if "<|channel|>" in template and "analysis" in template and "final" in template:  # (gpt-oss: tags built in pieces)
        return _OTHER_TAGS[2]
    return None


def split_reasoning(text: str, tags: tuple[str, str], opened: bool) -> tuple[str, str] | None:
    """(reasoning, content) of a reply that starts with a reasoning block (or, `opened`, inside one its prompt
    opened), as llama.cpp's "deepseek" reasoning format returns them: the block's text without its tags, and
    what follows it; a reply cut inside the block is reasoning only. None when the reply has no block, but ("", the
    content) when it opens its content as a block's end would (_CONTENT_OPENERS: gpt-oss's final channel)."""
    start, end = tags
    if not opened:
        body = text.lstrip()
        opener = _CONTENT_OPENERS.get(start)
        if opener and body.startswith(opener):
            return "", body[len(opener):].lstrip()
        if not body.startswith(start):
            return None
        text = body[len(start):]
    i = text.find(end)
    if i < 0:
        return text.strip(), ""
    return text[:i].strip(), text[i + len(end):].lstrip()


def opens_block(prompt: str, tags: tuple[str, str]) -> bool:
    """Whether a prompt's text ends inside a reasoning block its generation prompt opened: it ends in the start tag
    (then whitespace), as llama.cpp's chat code tells "thinking forced open" (a generation prompt ending in
    `<think>\n`). A start tag further back opens nothing: a message that names the tag is text."""
    return prompt.rstrip().endswith(tags[0])


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (a tag cut between two pieces)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """split_reasoning for a reply that arrives in pieces (the terminal chat shows the block apart, as llama-cli
    does): feed(piece) and finish() return [(kind, text)], kind "reasoning" or "content", joined in order they
    are split_reasoning's two parts; the first content part comes as the end tag does (empty if nothing follows).
    Text that may still turn out to be a tag, or whitespace split_reasoning would strip, waits for the next piece."""

    def __init__(self, tags: tuple[str, str], opened: bool):
        self.start, self.end = tags
        self.opener = _CONTENT_OPENERS.get(self.start, "")
        self.mode = "reasoning" if opened else "opening"  # opening: the reply's start, which may open a block
        self._buf = ""
        self._fresh = True  # at the start of the current part: its leading whitespace goes

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self._buf += piece
        out: list[tuple[str, str]] = []
        while True:
            if self.mode == "opening":
                body = self._buf.lstrip()
                if body.startswith(self.start):
                    self.mode, self._buf, self._fresh = "reasoning", body[len(self.start):], True
                    continue
                if self.opener and body.startswith(self.opener):  # no block: the content's opener goes
                    self.mode, self._buf, self._fresh = "content", body[len(self.opener):], True
                    continue
                if self.start.startswith(body) or self.opener.startswith(body):  # (whitespace, or a tag in the making)
                    return out
                self.mode, self._fresh = "content", False  # no block: the reply as it is
            if self._fresh:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return out
                self._fresh = False
            if self.mode == "reasoning":
                i = self._buf.find(self.end)
                if i >= 0:
                    self._emit(out, "reasoning", self._buf[:i].rstrip())
                    out.append(("content", ""))  # (the block ends here, whether or not a text follows)
                    self.mode, self._buf, self._fresh = "content", self._buf[i + len(self.end):], True
                    continue
                keep = partial_tail(self._buf, self.end)
                head = self._buf[:len(self._buf) - keep]
                text = head.rstrip()  # (whitespace before the end tag goes: it waits)
                self._emit(out, "reasoning", text)
                self._buf = head[len(text):] + self._buf[len(head):]
                return out
            self._emit(out, "content", self._buf)
            self._buf = ""
            return out

    def finish(self) -> list[tuple[str, str]]:
        """The text still waiting, at the reply's end: a cut tag stays text, trailing whitespace goes."""
        out: list[tuple[str, str]] = []
        if self.mode == "opening":
            self.mode = "content"
            self._emit(out, "content", self._buf)  # (no block after all: the reply as it is)
        else:
            self._emit(out, self.mode, self._buf.strip() if self._fresh else self._buf.rstrip())
        self._buf = ""
        return out

    @staticmethod
    def _emit(out: list, kind: str, text: str) -> None:
        if text:
            out.append((kind, text))


def utf8_complete(piece: bytes) -> bool:
    """Whether a token's bytes end on a whole UTF-8 character (llama.cpp's common_utf8_is_complete: the
    last lead byte within 4 bytes of the end has its continuation bytes)."""
    if not piece:
        return True
    for i in range(1, min(4, len(piece)) + 1):
        c = piece[-i]
        if c & 0xC0 != 0x80:
            need = 4 if c >= 0xF0 else 3 if c >= 0xE0 else 2 if c >= 0xC0 else 1
            return i >= need
    return False


class _Matcher:
    """Token sequences found as they end: a window of the last tokens since the last match."""

    def __init__(self, seqs: Sequence[Sequence[int]]):
        self.seqs = [tuple(s) for s in seqs if s]
        self.width = max((len(s) for s in self.seqs), default=1)

    def step(self, window: tuple, tok: int) -> tuple[tuple, bool]:
        w = (window + (tok,))[-self.width:]
        if any(w[len(w) - len(s):] == s for s in self.seqs if len(s) <= len(w)):
            return (), True
        return w, False


class ReasoningBudget:
    """At most `budget` tokens inside each reasoning block, then `forced` (the budget message's tokens and
    the end tag's) one token at a time. `pieces(t)` gives a token's bytes (for the UTF-8 rule)."""

    def __init__(self, start: Sequence[int], ends: Sequence[Sequence[int]], forced: Sequence[int], budget: int,
                 pieces=None):
        if not start or not any(ends) or not forced:
            raise ValueError("a reasoning budget needs start, end and forced tokens")
        self.start, self.end = _Matcher([start]), _Matcher(ends)
        self.forced = [int(t) for t in forced]
        self.budget = budget
        self.pieces = pieces

    def _on_start(self) -> State:
        return (COUNTING, self.budget, 0, (), ()) if self.budget > 0 else (FORCING, 0, 0, (), ())

    def initial(self, prompt: Sequence[int] = ()) -> State:
        """The state after the prompt: a prompt that opens a block (a template's generation prompt ending
        in `<think>\n`: only whitespace after the start tag, where `pieces` tells) starts counting in it, its
        tokens in the block counted, as llama.cpp's prefill of the generation prompt does. Where the prompt
        spends the budget, forcing starts after it, unless it ends the block itself: its tokens never stand for
        forced ones (llama.cpp's prefill takes them for forced ones: with --reasoning-budget 0 a generation
        prompt's "\n" after <think> would pass for the first forced token)."""
        st: State = (IDLE, self.budget, 0, (), ())
        if self.pieces is not None:
            # only the generation prompt opens the reply's block: the prompt ends in the start tag, then whitespace
            # (llama.cpp arms the budget where thinking is forced open); a tag further back is a message's text
            tag = self.start.seqs[0]
            at = next((j for j in range(len(prompt) - len(tag), -1, -1) if tuple(prompt[j:j + len(tag)]) == tag), None)
            if at is None or any(self.pieces(t).strip() for t in prompt[at + len(tag):]):
                return st
            prompt = prompt[at:]
        for t in prompt:
            if st[0] == FORCING:
                ew, hit = self.end.step(st[4], t)
                st = (DONE, 0, 0, (), ()) if hit else (FORCING, 0, 0, st[3], ew)
            else:
                st = self.advance(st, t)
        return st

    def advance(self, st: State, tok: int) -> State:
        mode, left, pos, sw, ew = st
        if mode in (IDLE, DONE):
            sw, hit = self.start.step(sw, tok)
            return self._on_start() if hit else (mode, left, pos, sw, ew)
        if mode == FORCING:
            ew, _ = self.end.step(ew, tok)
            return (DONE, left, 0, (), ()) if pos + 1 >= len(self.forced) else (FORCING, left, pos + 1, sw, ew)
        ew, hit = self.end.step(ew, tok)  # COUNTING, WAITING_UTF8: a natural end
        if hit:
            return (DONE, left, 0, (), ())
        whole = self.pieces is None or utf8_complete(self.pieces(tok))
        if mode == WAITING_UTF8:
            return (FORCING, 0, 0, sw, ()) if whole else st
        left -= 1
        if left > 0:
            return (COUNTING, left, pos, sw, ew)
        return (FORCING, 0, 0, sw, ()) if whole else (WAITING_UTF8, 0, 0, sw, ())

    def advance_all(self, st: State, toks: Sequence[int]) -> State:
        for t in toks:
            st = self.advance(st, t)
        return st

    def forcing(self, st: State) -> int | None:
        """The token state st forces, or None."""
        return self.forced[st[2]] if st[0] == FORCING else None

    def forced_run(self, st: State) -> list[int]:
        """The tokens state st forces one after another (the rest of the message and the end tag), or []."""
        return list(self.forced[st[2]:]) if st[0] == FORCING else []

    def constrain(self, x: np.ndarray, st: State, need: int | None = None) -> np.ndarray | None:
        """Logits x [W]: unchanged, or while forcing every token but the forced one at -inf (None when that
        one cannot be picked: outside the row, or at -inf itself)."""
        f = self.forcing(st)
        if f is None:
            return x
        if f >= x.shape[0] or not x[f] > -np.inf:
            return None
        out = np.full_like(x, -np.inf)
        out[f] = x[f]
        return out


class Both:
    """Two constraints at once (the reasoning budget, then a grammar): a token must pass both; each keeps its
    own state."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def initial(self, prompt: Sequence[int] = ()):
        return self.first.initial(prompt), self.second.initial(prompt)

    def advance(self, st, tok: int):
        return self.first.advance(st[0], tok), self.second.advance(st[1], tok)

    def advance_all(self, st, toks: Sequence[int]):
        return self.first.advance_all(st[0], toks), self.second.advance_all(st[1], toks)

    def forced_run(self, st) -> list[int]:
        return self.first.forced_run(st[0])

    def constrain(self, x: np.ndarray, st, need: int | None = None) -> np.ndarray | None:
        y = self.first.constrain(x, st[0], None)
        return None if y is None else self.second.constrain(y, st[1], need)
