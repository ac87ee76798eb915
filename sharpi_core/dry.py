"""DRY ("don't repeat yourself"), llama.cpp's repetition penalty for sequences (src/llama-sampler.cpp,
ported there from koboldcpp): a token that would extend a sequence already seen in the last
`dry_penalty_last_n` tokens loses `multiplier * base ^ (length - allowed_length)` from its logit, when
that length reaches `allowed_length`. Sequence breakers (text such as "\\n" or ":") cut the sequences:
no repetition is counted across one, and a token that is a breaker by itself is never penalized.

`breakers(tokenizer, strings)` turns breaker strings into llama.cpp's (head token, tail tokens)
pairs once; `penalize_row` applies DRY to one logits row given the window of history it sees.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

DEFAULT_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's common_params_sampling defaults
MAX_CHAR_LEN = 40  # llama.cpp truncates a breaker to 40 bytes
MAX_SEQ_LEN = 20   # and its tail to 20 tokens
FLOAT_MAX_LOG = np.float32(88.7228391)


def _token_text(tok, tid: int) -> bytes:
    """llama_vocab::detokenize({tid}, special=true): the token's piece, one leading space dropped
    where the vocabulary adds a space prefix."""
    b = tok.token_bytes(tid, special=True)
    if getattr(tok, "add_space_prefix", False) and b[:1] == b" ":
        b = b[1:]
    return b


def breakers(tok, strings: Sequence[str]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(head token, tail tokens) pairs of llama.cpp's get_overlapping_token_sequences: every token
    whose text contains a breaker is a breaker by itself (empty tail); a token whose text ends in the
    start of a breaker heads the tokenized rest of it. Runs over the vocabulary once, at start-up."""
    seqs: dict[int, list[tuple[int, ...]]] = {}
    words = None
    for s in strings:
        b = s.encode("utf-8")[:MAX_CHAR_LEN]
        if not b:
            continue
        if words is None:
            words = [_token_text(tok, t) for t in range(tok.n_vocab)]
        first = b[:1]
        for tid, word in enumerate(words):
            if first not in word:
                continue
            if b in word:
                seqs.setdefault(tid, []).append(())
                continue
            pos = word.find(first)
            while pos >= 0:
                i = 1
                while i < len(b) and pos + i < len(word) and word[pos + i] == b[i]:
                    i += 1
                if pos + i == len(word):  # the word ends inside the breaker: the rest follows as tokens
                    rest = b[i:].decode("utf-8", errors="replace")
                    tail = tuple(tok.encode(rest, add_special=False, parse_special=False)[:MAX_SEQ_LEN])
                    if tail not in seqs.setdefault(tid, []):
                        seqs[tid].append(tail)
                pos = word.find(first, pos + 1)
    return tuple((h, t) for h, tails in seqs.items() for t in tails)


def penalize_row(row: np.ndarray, window: Sequence[int], multiplier: float, base: float, allowed: int,
                 brk: dict[int, list[tuple[int, ...]]]) -> None:
    """DRY on one float32 logits row [V], in place; `window` = the last dry_penalty_last_n tokens,
    oldest first; `brk` = head -> tails of the sequence breakers. llama.cpp's algorithm step for step
    (its clamped Z-algorithm included), so the same tokens get the same penalties."""
    n = len(window)
    if n <= allowed:
        return

    def rat(i: int) -> int:  # i tokens back from the last
        return window[n - 1 - i]

    # 1. the closest breaker limits how long a repetition can be
    rep_limit = n
    for i in range(n):
        tails = brk.get(rat(i))
        if not tails:
            continue
        longest = -1
        for tail in tails:
            ln = len(tail)
            if longest < ln <= i and all(tail[o] == rat(i - o - 1) for o in range(ln)):
                longest = ln
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return
    # 2. for every earlier position, how many tokens before it equal the last ones (Z-algorithm, reversed)
    count = [0] * n
    last, lt, rt = n - 1, 0, 0
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and rat(m) == rat(m + k):
                m += 1
            count[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            p = k - lt
            if count[last - p] < rt - k + 1:
                count[last - k] = min(count[last - p], rep_limit)
            else:
                i = rt + 1
                while i < n and rat(i) == rat(i - k):
                    i += 1
                count[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    # 3. the token after each such repetition would extend it
    longest_for: dict[int, int] = {}
    for i in range(n - 1):
        r = count[i]
        if r >= allowed:
            t = rat(n - 2 - i)
            if longest_for.get(t, -1) < r:
                longest_for[t] = r
    if not longest_for:
        return
    # 4. penalties; the exponent is capped where base ** exp would overflow a float
    base32 = np.float32(base)
    max_exp = int(FLOAT_MAX_LOG / np.log(base32)) if base32 > np.float32(1.000001) else 0
    V = row.shape[0]
    for t, r in longest_for.items():
        if not 0 <= t < V or () in brk.get(t, ()):
            continue
        e = r - allowed
        if max_exp > 0 and e > max_exp:
            e = max_exp
        try:
            pw = math.pow(float(base32), e)  # std::pow(float, int): double
        except OverflowError:  # (a base within 1e-6 of 1 has no cap) C gives inf
            pw = math.inf
        with np.errstate(over="ignore", invalid="ignore"):
            pen = np.float32(float(np.float32(multiplier)) * pw)
        row[t] = row[t] - pen
