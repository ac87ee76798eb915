"""The target's own MTP head (models/mtp.py) as the drafter: no second model (llama.cpp's --spec-type draft-mtp).

The head's one-layer cache holds, at position p, the pair (x_p, h_{p-1}) of the target's history: after every target
pass the generator hands the pass's tokens and final-normed rows to `observe`, and the head writes their K / V (only
that: the attention and FFN of those rows are not needed). A proposal for history + [t] runs the head on (t, h_{L-1})
at L, draws d1 from its logits with the target's sampling params (as DraftModelDrafter: same penalties, grammar,
picker; q recorded, so sampled verification stays exact), then (d1, h') at L + 1 with the head's own row h', and so
on. The verify pass's rows are observed like any pass and `rollback` keeps the accepted ones, so the pairs in the
cache are always the target's, as llama.cpp's process() / accept() keep them.

A history the head has not seen from the start (a restored prompt cache) starts the head's window where its
observations start (`_base`: the target position of cache index 0; positions count from there, RoPE being
relative); a missing h (the first position, a reused prefix whose last row is gone) is zeros, as llama.cpp's
first pending row.
"""
from __future__ import annotations

import torch

from ..sampling import SamplingParams
from .draft_model import DraftModelDrafter


class MtpDrafter(DraftModelDrafter):
    def __init__(self, head, cache, params: SamplingParams, generator: torch.Generator | None = None,
                 head_vocab: int | None = None):
        super().__init__(head, cache, params, generator, head_vocab=head_vocab)
        self.chain = self.lookahead = False
        self._obs: tuple[int, torch.Tensor] | None = None  # (start, h [T, D]): the last observed pass's rows
        self._h: torch.Tensor | None = None  # [1, D]: the head's row after the last token it drafted from

    def prefill(self, tokens: list[int]) -> None:
        """Nothing: the head's cache follows the target's passes (observe), the prompt's too."""

    def _row(self, pos: int) -> torch.Tensor:
        """h_pos [1, D]: the target's final-normed row at pos, when the last observed pass has it; else zeros."""
        if self._obs is not None:
            start, h = self._obs
            if 0 <= pos - start < h.shape[0]:
                return h[pos - start:pos - start + 1]
        return torch.zeros(1, self.model.config.n_embd)

    def _restart(self, pos: int) -> None:
        """A new window whose cache index 0 is target position pos."""
        self.cache.truncate(0)
        self.history.clear()
        self._base = pos

    def _cut(self, n: int) -> None:
        """Keep cache indices [0, n)."""
        if n < self.cache.length:
            self.cache.truncate(n)
        del self.history[n:]

    def observe(self, start: int, tokens: list[int], h: torch.Tensor) -> None:
        """The target evaluated tokens at positions start.. and h [T, D] are its final-normed rows there."""
        n = start - self._base
        if not 0 <= n <= self.cache.length:  # (a gap: nothing to pair the missing positions with)
            self._restart(start)
            n = 0
        self._cut(n)
        prev = self._row(start - 1)
        if len(tokens):
            self.model.forward(self._ids(list(tokens)), torch.cat((prev, h[:-1])), n, self.cache, kv_only=True)
            self.history += list(tokens)
        self._obs = (start, h)

    # -- DraftModelDrafter's pieces, on the head ------------------------------------------------------
    def _window(self, history: list[int], k: int) -> list[int]:
        return history  # (the head's cache is as long as the target's context)

    def _reuse(self, history: list[int]) -> int:
        n = len(history) - 1 - self._base  # t's cache index
        if not 0 <= n <= self.cache.length:
            self._restart(len(history) - 1)
            n = 0
        self._cut(n)
        return n

    def _sync(self, history: list[int], upto: int | None = None) -> torch.Tensor:
        self._h = self._row(len(history) - 2)  # h_{L-1}, L = t's position
        return self._feed([history[-1]])

    def _feed(self, tokens: list[int], last_n: int | None = None, decode: bool = True) -> torch.Tensor:
        logits, h = self.model.forward(self._ids(tokens), self._h, len(self.history), self.cache, decode=True,
                                       n_out=self.n_out)
        self._h = h[-1:]
        self.history += tokens
        self.forwards += 1
        return logits[-1]

    def rollback(self, n_keep: int) -> None:
        n = n_keep - self._base
        if n < 0:
            self._restart(n_keep)
        else:
            self._cut(n)

    def shift(self, n_keep: int, n_discard: int) -> None:
        """The target's positions [n_keep, n_keep + n_discard) went, the later ones moved down: the same in the
        head's cache (its K re-rotated as the target's), or only its window's base moves."""
        b = self._base
        lo, hi = max(n_keep, b) - b, max(n_keep + n_discard, b) - b  # the cache indices that go
        self._base = b if b <= n_keep else max(n_keep, b - n_discard)
        m = min(len(self.history), self.cache.length)
        if hi > lo and m > hi:
            t, index = self.model.target, self.model.index
            self._cut(m)
            self.cache.shift(lo, hi - lo, lambda j, k: t.shift_k(index, k, lo - hi, self.cache.rot_k))
            del self.history[lo:hi]
        elif hi > lo:
            self._cut(lo)
        if self._obs is not None:
            start, h = self._obs
            self._obs = (start - n_discard, h) if start >= n_keep + n_discard else None
