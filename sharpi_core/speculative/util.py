"""Small helpers shared by the generator and the drafters."""
from __future__ import annotations

from typing import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists.

    The usual case (one list extends the other) is one C-level slice compare; otherwise a binary
    search over slice compares, so a 4k-token history costs microseconds, not a Python loop."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[lo:mid]) == list(b[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def next_proposal_len(n_max: int, proposed: int, accepted: int) -> int:
    """How many tokens to propose next after `accepted` of `proposed` were taken: one more than were
    accepted after a rejection, twice as many after a full accept, within [1, n_max]. Chosen from
    the past only, so the emitted tokens keep their exact law (greedy chain / target samples)."""
    return min(n_max, 2 * proposed) if accepted == proposed else max(1, min(n_max, accepted + 1))


class Verdicts:
    """A drafter's verdicts: decayed counts of proposals accepted and proposals judged, from a prior (the chance a
    proposal is accepted once the ones before it were, its weight in verdicts); `decay` is the weight of the newest
    step's verdict."""

    def __init__(self, prior: tuple[float, float], decay: float):
        a, w = prior
        self.hits, self.judged = a * w, w
        self.decay = decay

    @property
    def acceptance(self) -> float:
        return self.hits / self.judged

    def expected(self, k: int) -> float:
        """a + a^2 + ... + a^k."""
        a = self.acceptance
        return float(k) if a >= 1 else a * (1 - a ** k) / (1 - a)

    def learn(self, accepted: int, judged: int) -> None:
        """A step's verdict on its first `judged` proposals: the first `accepted` of them taken (the next one,
        if judged, rejected)."""
        self.hits = (1 - self.decay) * self.hits + accepted
        self.judged = (1 - self.decay) * self.judged + judged


class WrapsModel:
    """What a drafter that puts other sources in front of a model drafter (`self.model`: a DraftModelDrafter or
    MtpDrafter, or None) passes on to it: its cache and history (prompt cache files), its prompt pass, a context
    shift, a grammar to propose under and a picker to sample like."""

    model = None

    @property
    def cache(self):
        return self.model.cache

    @property
    def history(self) -> list[int]:
        return self.model.history

    @property
    def window_start(self) -> int:
        return getattr(self.model, "window_start", 0)

    def prefill(self, tokens: list[int]) -> None:
        prefill = getattr(self.model, "prefill", None)
        if prefill is not None:
            prefill(tokens)

    def shift(self, n_keep: int, n_discard: int) -> None:
        shift = getattr(self.model, "shift", None)
        if shift is not None:
            shift(n_keep, n_discard)

    def constrain_with(self, grammar, state) -> None:
        if hasattr(self.model, "constrain_with"):
            self.model.constrain_with(grammar, state)

    def sample_like(self, picker) -> None:
        if hasattr(self.model, "sample_like"):
            self.model.sample_like(picker)
