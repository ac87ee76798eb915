"""Prompt lookup: propose the tokens that followed the most recent earlier occurrence of the
history's last n-gram, longest n first (ngram_max down to ngram_min). Model-free, so proposals are
deterministic functions of the history (q is None: verification treats them as one-hot).

The index maps, per n, each n-gram to the end positions (exclusive) of its occurrences, in
increasing order; it is kept in step with the history incrementally: a call whose history extends
the previous one indexes only the new positions, and a history that diverges (a new chat turn)
unindexes the positions past the common prefix. A 4k-token history costs microseconds per call.
"""
from __future__ import annotations

from ..errors import UsageError
from .util import common_prefix


class LookupDrafter:
    # proposing costs microseconds and keeps no state a skipped step would leave behind: a generator that takes
    # plain steps by cost (speculative.SpecCost) can still ask for proposals and score them against what came
    free = True

    def __init__(self, ngram_max: int = 3, ngram_min: int = 2):
        if ngram_min < 2:
            raise UsageError(f"--spec-ngram-min must be >= 2 (got {ngram_min})")
        if ngram_max < ngram_min:
            raise UsageError(f"--spec-ngram-max ({ngram_max}) must be >= --spec-ngram-min ({ngram_min})")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self._hist: list[int] = []
        # n -> n-gram -> end positions e (gram = hist[e-n:e], continuation hist[e:]) for every e < _top;
        # the n-gram ending at len(hist) is the query and is never indexed against itself
        self._index: dict[int, dict[tuple, list[int]]] = {n: {} for n in range(ngram_min, ngram_max + 1)}
        self._top = 0

    def _sync(self, history: list[int]) -> None:
        old = self._hist
        # ends e <= m only read positions < m: still valid; drop the later ones (and the one at
        # len(history), the query's own end, when the history shrank to a prefix)
        m = min(common_prefix(old, history), len(history) - 1)
        for e in range(self._top - 1, m, -1):
            for n, d in self._index.items():
                if e >= n:
                    g = tuple(old[e - n:e])
                    lst = d[g]
                    lst.pop()
                    if not lst:
                        del d[g]
        self._top = min(self._top, m + 1)
        self._hist = list(history)
        for e in range(self._top, len(history)):
            for n, d in self._index.items():
                if e >= n:
                    d.setdefault(tuple(history[e - n:e]), []).append(e)
        self._top = max(self._top, len(history))

    def propose(self, history: list[int], k: int) -> tuple[list[int], None]:
        self._sync(history)
        if k <= 0:
            return [], None
        L = len(history)
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if L <= n:
                continue
            ends = self._index[n].get(tuple(history[L - n:]))
            if ends:
                e = ends[-1]
                return list(history[e:e + k]), None
        return [], None

    def rollback(self, n_keep: int) -> None:
        """Nothing to undo: the index follows the history each call is given."""
