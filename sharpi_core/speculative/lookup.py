"""Prompt lookup: propose the tokens that followed the most recent earlier occurrence of the
history's last n-gram (longest n first). Model-free, so proposals are deterministic."""
from __future__ import annotations

from ..errors import UsageError


class LookupDrafter:
    def __init__(self, ngram_max: int = 3, ngram_min: int = 2):
        if ngram_min < 2:
            raise UsageError(f"--spec-ngram-min must be >= 2 (got {ngram_min})")
        if ngram_max < ngram_min:
            raise UsageError(f"--spec-ngram-max ({ngram_max}) must be >= --spec-ngram-min ({ngram_min})")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self._hist: list[int] = []
        # per n: n-gram -> end position (exclusive) of its most recent occurrence, for every
        # n-gram ending before the last token (the current suffix must not match itself)
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(ngram_min, ngram_max + 1)}

    def _sync(self, history: list[int]) -> None:
        h = self._hist
        if len(history) < len(h) or history[: len(h)] != h:
            self._hist, h = [], []
            for d in self._index.values():
                d.clear()
        start = len(h)
        self._hist = list(history)
        # index n-grams ending at positions [start-1, len-1): the one ending at len is the query
        for end in range(max(start - 1, 1), len(history)):
            for n, d in self._index.items():
                if end >= n:
                    d[tuple(history[end - n:end])] = end

    def propose(self, history: list[int], k: int) -> tuple[list[int], None]:
        self._sync(history)
        if k <= 0:
            return [], None
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(history) <= n:
                continue
            end = self._index[n].get(tuple(history[-n:]))
            if end is not None:
                return list(history[end:end + k]), None
        return [], None

    def rollback(self, n_keep: int) -> None:
        """Nothing to undo: the index is rebuilt from the history it is given."""
