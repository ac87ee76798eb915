"""Speculate only where it pays, by the costs measured on this machine.

A speculative step of k proposals costs the drafter's k proposals and a verify pass of k + 1 rows and yields
E(a, k) = 1 + a + ... + a^k tokens, a being the chance that a proposal is accepted once the ones before it were;
a plain step costs one pass of one row and yields one token. Which is faster depends on the machine as much as
on the text: on a GPU, or a CPU with AVX-512 VNNI, an extra verify row costs a fraction of a token; on an AVX2
CPU decoding Qwen 1.5B is bound by compute, a 5-row verify pass costs 2.2-3x a token and a 0.5B draft's token
half the target's, so speculating with that pair goes from ~1.05x plain on code (95% accepted) to 0.68x on prose
(48% accepted).

- A draft model (or an MTP head: any drafter that is not `free`) is judged by what it did: the tokens its last
  WINDOW steps in this call emitted per second of proposing and verifying, against the plain steps' tokens per
  second (the last SAMPLES of them: a call starts with 2 plain steps, and one more comes every REFRESH verify
  steps, so that the two are measured close in time on a machine whose speed drifts; the step after a plain
  one is not a measure, the draft catching up on the token it missed), the steps' tokens shrunk toward a prior
  (PRIOR_STEPS). Once a call has WARM such steps and they
  are MARGIN or more slower than plain steps, speculation goes off for RETRY steps, then is judged again (a
  draft model catches up on what it skipped in one batched pass of its window), so that a slow phase of the
  machine costs a stretch of a long call, not the rest of it; a clear loss (CLEAR) turns it off sooner, the steps
  before the decision being the price of measuring. The next call (a chat turn) starts over. While it pays, a
  step proposes the count in [1, cap] (cap: the generator's count, adapted to the last verdict) with the most
  tokens per second expected,
  E(a, k) / (verify(k + 1) + k draft), a draft's proposal costing its measured seconds (steps that follow its own:
  no catching up), a estimated apart after a step whose proposals were all accepted and after one with a
  rejection (a draft's right guesses come in runs). A large --spec-draft-n-max then no longer drafts far past
  what is accepted (scripts/bench_spec_count.py: Qwen 1.5B + 0.5B, 8 code requests at k = 16, 0.94x -> 1.18x plain).
- Prompt lookup (`free`: its proposals cost microseconds and keep no state) is asked each step, and the step
  goes to the choice with the most tokens expected per second: k in [1, cap] maximising E(a, k) / verify(k + 1)
  (verify times per row count measured, interpolated between them and the plain pass) against 1 / plain, or a
  plain step. Where the plain step wins, lookup's proposal is still scored against the tokens that come (a
  "shadow"), so that a text that starts copying itself brings speculation back at once; after EXPLORE such
  steps in a row a proposal goes ahead anyway where the guessed costs say it pays and its verify shape has
  fewer than EXPLORED measures (a shape measured once, in a slow moment, would otherwise never be measured
  again). Plain steps are measured where nothing matched, and forced only every 4 REFRESH verify steps.
- Lookup and a draft model together (speculative.HybridDrafter, which picks each step's source and count itself)
  are judged as a draft model is, on all their steps; where they do not pay, the draft model is set aside for
  RETRY steps (`use_model`) and lookup goes on alone, step by step as above: copied text still speeds up. So do
  llama.cpp's n-gram drafters in front of a draft model (speculative.NgramChain).
  While both go on, the hybrid weighs its sources with this machine's costs (`step_cost`: the verify passes and
  the model's proposals as measured here) instead of its fixed estimates.

On a GPU the first pass of each shape is not taken as a measure (it captures a CUDA graph). Greedy output does
not depend on any of it (every k gives the plain chain). A sampled output keeps its law (the choice depends on the
past only), but which draws a seed gives would depend on timing: in sampled decoding the generator gives SpecCost
`fixed` costs instead (a plain pass 1, a verify pass 1 + verify_row a row after the first, a draft model's proposal
draft_cost, all in plain passes), so the same rules decide from the verdicts alone and a seed's draws stay the
same run after run (SHARPI_SPEC_COST=1: measured there too; SHARPI_SPEC_COST=0: no cost model).
"""
from __future__ import annotations

import bisect
from collections import deque

from .hybrid import DRAFT_COST, VERIFY_ROW
from .util import Verdicts, common_prefix

SAMPLES = 5      # plain step and verify pass times kept per shape
WINDOW = 16      # a draft model's last verify steps, judged together
DECAY = 0.2      # weight of the newest verdict in the acceptance estimate (lookup)
PRIOR = (0.6, 2.0)  # prior acceptance and its weight in verdicts
WARM = 6         # measured verify steps a call makes before a draft model may be turned off
MARGIN = 0.05    # a draft model goes off when its steps are this much slower than plain steps
CLEAR = (4, 0.3)  # or after this many steps, when they are this much slower
# a draft model's judgement starts from PRIOR_STEPS steps of average cost that each gave the tokens their average
# count of proposals accepted with chance PRIOR_ACCEPT gives: a few unlucky first steps (the start of an answer is
# where drafts agree least) do not turn off speculation that pays. (The steps' own count, not n_max: where drafts
# keep failing the generator proposes 1 a step, and the prior's tokens of n_max would keep a useless draft on.)
PRIOR_STEPS, PRIOR_ACCEPT = 2.0, 0.75
REFRESH = 16     # measured verify steps between forced plain steps (lookup: 4x as many, its plain steps come
                 # by themselves where nothing matches, and in a copied text each forced one loses a whole step)
RETRY = 256      # steps after a draft model was turned off (or set aside) before it is tried again: a slow phase
                 # of the machine (or of the text) does not cost the rest of a long call; catching up on what it
                 # missed is one batched pass of its draft window
EXPLORE = 16     # lookup steps declined in a row by the measured costs before one goes ahead anyway, where the
                 # guessed costs say it would pay and its verify shape has fewer than EXPLORED measures: a shape
                 # measured once, in a slow moment, is measured again (where it is slow, 3 measures settle it)
EXPLORED = 3


class _Times:
    """The last SAMPLES times of something: their lower median (lookup's estimates; robust to a slow pass) and
    mean (a draft model's judgement, against the mean of its steps)."""

    __slots__ = ("last",)

    def __init__(self):
        self.last: deque[float] = deque(maxlen=SAMPLES)

    def add(self, s: float) -> None:
        self.last.append(s)

    @property
    def value(self) -> float:
        v = sorted(self.last)
        return v[(len(v) - 1) // 2]

    @property
    def mean(self) -> float:
        return sum(self.last) / len(self.last)


def _estimate(points: dict[int, float], n: int, xs: list[int] | None = None) -> float:
    """The cost at n from the costs measured at other counts (xs: their counts, sorted): linear between the
    nearest on either side, else along the line through the two nearest on one side (never below 0 nor falling
    toward more), or in proportion to the only one."""
    if n in points:
        return points[n]
    xs = sorted(points) if xs is None else xs
    i = bisect.bisect_left(xs, n)  # xs[:i] below n, xs[i:] above
    if 0 < i < len(xs):
        a, b = xs[i - 1], xs[i]
        return points[a] + (points[b] - points[a]) * (n - a) / (b - a)
    if len(xs) == 1:
        return points[xs[0]] * n / xs[0]
    a, b = (xs[i - 2], xs[i - 1]) if i else (xs[0], xs[1])
    slope = max(0.0, (points[b] - points[a]) / (b - a))
    near = b if i else a
    return max(0.0, points[near] + slope * (n - near))


def expected_tokens(a: float, k: int) -> float:
    """1 + a + ... + a^k: the tokens a step of k proposals yields when each is accepted with chance a after the
    ones before it were."""
    return k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


class SpecCost:
    def __init__(self, drafter, warm_up: bool = False, fixed: tuple[float, float] | None = None,
                 guess: tuple[float, float] = (VERIFY_ROW, DRAFT_COST), count: bool = True):
        self.drafter = drafter
        # the first pass of each shape is not a measure (a GPU model captures a CUDA graph there)
        self.warm_up = warm_up and fixed is None
        # (verify_row, draft_cost): costs in plain passes that replace the measured times (see the module's doc)
        self.fixed = fixed
        # the same, until they are measured (verify_time, draft_time)
        self.guess = fixed or guess
        self._free = bool(getattr(drafter, "free", False))
        # a drafter with free sources to fall back on while its model is set aside (use_model; HybridDrafter: its
        # lookup, which proposes the shadows then, and it weighs its sources with the costs measured here, step_cost;
        # NgramChain with a model: its n-gram sources)
        self._fallback = getattr(drafter, "fallback", None)
        self._model_name = drafter.model_source if self._fallback is not None else None
        # a drafter of one source (a draft model, an MTP head) proposes the count chosen here (`best`; count=False:
        # the generator's); one of several (HybridDrafter, NgramChain: `source` names each step's) keeps its sources'
        self._count = count and not hasattr(drafter, "source")
        self._draft = _Times()  # the draft model's seconds per proposed token (steps that follow one of its own)
        self._last_source = None
        if self._fallback is not None:
            drafter.measured = self
        self._plain = _Times()
        self._verify: dict[int, _Times] = {}  # rows -> times (lookup)
        # (tokens, seconds, proposals) of recent verify steps
        self._steps: deque[tuple[int, float, int]] = deque(maxlen=WINDOW)
        self._seen: set = set()  # shapes measured once (the first pass of a shape is not a measure)
        self.verdicts = Verdicts(PRIOR, DECAY)
        # a draft model's verdicts after a step whose proposals were all accepted and after one with a rejection
        # apart: its right guesses come in runs (code), where the chance after a full accept is the higher
        self._after = {True: Verdicts(PRIOR, DECAY), False: Verdicts(PRIOR, DECAY)}
        self._full = False  # the last step's proposals were all accepted
        self._shadow: tuple[int, list[int]] | None = None  # lookup's unverified proposal (at, tokens)
        self._since = 0        # measured verify steps since the last plain sample
        if fixed is not None:  # (a plain step's cost is known: no plain steps to measure it)
            self._plain.add(1.0)
        self.begin()

    def begin(self) -> None:
        """A new generate call."""
        self.off = False       # speculation is off for RETRY steps (not free drafters)
        self.model_off = False  # a HybridDrafter's draft model is set aside for RETRY steps (lookup alone)
        if self._fallback is not None:
            self.drafter.use_model = True
        self.chosen_plain = 0  # plain steps this call took by choice (stats)
        self._plains = 0       # plain samples in this call
        self._steps.clear()
        self._shadow = None
        self._catch_up = False  # the last step was plain or forced (a draft model catches up at its next proposal)
        self._off_steps = 0    # steps since the draft model was turned off or set aside (RETRY)
        self.went_off = False  # it was, in this call (stats)
        self._declined = 0     # lookup proposals the measured costs declined in a row (EXPLORE)

    def shifted(self) -> None:
        """A context shift moved the history: lookup's unverified proposal points at tokens no longer there."""
        self._shadow = None

    @property
    def free(self) -> bool:
        """Proposals cost nothing: lookup's (alone, or a hybrid's once its model is set aside)."""
        return self._free or self.model_off

    # -- estimates ----------------------------------------------------------------------------------
    @property
    def acceptance(self) -> float:
        return self.verdicts.acceptance

    def verify_time(self, rows: int, _points: tuple | None = None) -> float:
        """A verify pass of `rows` rows: measured, else interpolated between the row counts measured, the plain
        pass being one row (none measured yet: the guess's cost a row)."""
        plain = self._plain.value
        if not self._verify:
            return plain * (1 + self.guess[0] * (rows - 1))
        points, xs = _points or self._points()
        return _estimate(points, rows, xs)

    def _points(self) -> tuple[dict[int, float], list[int]]:
        points = {r: v.value for r, v in self._verify.items()}
        points[1] = self._plain.value
        return points, sorted(points)

    def draft_time(self) -> float:
        """A proposal's seconds: measured (a draft model's steps that follow its own), else the guess; 0 for lookup."""
        if self.free:
            return 0.0
        return self._draft.value if self.fixed is None and self._draft.last else self.guess[1] * self._plain.value

    def rate(self, k: int, _points: tuple | None = None, guessed: bool = False) -> float:
        """Expected tokens per second of a step of k proposals (k = 0: a plain step); guessed: with the guess's
        verify cost instead of the measured ones."""
        if k == 0:
            return 1.0 / max(self._plain.value, 1e-9)
        a = self.acceptance if self.free else self._after[self._full].acceptance
        verify = (self._plain.value * (1 + self.guess[0] * k) if guessed or not self._verify
                  else self.verify_time(k + 1, _points))
        return expected_tokens(a, k) / max(verify + k * self.draft_time(), 1e-9)

    def best(self, cap: int, least: int = 1, guessed: bool = False) -> tuple[int, float]:
        """(k in [least, cap] with the highest rate, that rate)."""
        pts = self._points() if self._verify else None  # (once for all k: a cap of 64 is an n-gram drafter's)
        return max(((k, self.rate(k, pts, guessed)) for k in range(min(max(1, least), cap), cap + 1)),
                   key=lambda kv: kv[1])

    def step_cost(self, k: int, model: bool) -> float | None:
        """A hybrid's step of k proposals in plain steps: its verify pass, plus the model's k proposals if it is the
        model's; None until all of those were measured (either source's, so that the two are weighed alike)."""
        if not self._plain.last or not self._verify or not self._draft.last:
            return None
        plain = max(self._plain.value, 1e-9)
        return (self.verify_time(k + 1) + (k * self._draft.value if model else 0.0)) / plain

    def spec_rate(self) -> float:
        """A draft model: tokens per second of its last WINDOW steps (proposing and verifying), with the prior's."""
        n = len(self._steps)
        if not n:
            return 0.0
        secs = sum(s for _, s, _ in self._steps)
        k = sum(p for _, _, p in self._steps) / n  # (a mean count: E(a, k) is smooth in k)
        tokens = sum(t for t, _, _ in self._steps) + PRIOR_STEPS * expected_tokens(PRIOR_ACCEPT, k)
        return tokens / max(secs * (1 + PRIOR_STEPS / n), 1e-9)

    def plain_rate(self) -> float:
        return 1.0 / max(self._plain.mean, 1e-9)

    # -- the choice -----------------------------------------------------------------------------------
    def plan(self, history: list[int], t: int, cap: int, least: int = 1) -> int:
        """Proposals to ask for at the step after history + [t], at most cap and at least `least` (the generator's
        --spec-draft-n-min: fewer would be no proposal); 0 = a plain step."""
        self._judge_shadow(history, t)
        if self.off or self.model_off:
            self._off_steps += 1
            if self._off_steps >= RETRY:  # (tried again: judged anew on WARM steps)
                self._off_steps, self.off = 0, False
                self._steps.clear()
                if self.model_off:
                    self.model_off, self.drafter.use_model = False, True
        if self.off:
            self.chosen_plain += 1
            return 0
        if self.fixed is None and (not self._plain.last or self._since >= REFRESH * (4 if self.free else 1)
                                   or (not self.free and self._plains < 2)):
            return self._choose_plain(history, t, cap)
        if not self.free:
            n, loss = len(self._steps), 1 - self.spec_rate() / self.plain_rate() if self._steps else 0.0
            if not ((n >= WARM and loss > MARGIN) or (n >= CLEAR[0] and loss > CLEAR[1])):
                # the count with the most tokens per second expected: each proposal costs a draft forward and a
                # verify row, and is accepted with the chance the verdicts give
                return self.best(cap, least)[0] if self._count else cap
            if self._fallback is None:
                self.off = self.went_off = True
                return self._choose_plain(history, t, cap)
            # lookup alone from here, from the prior (the verdicts so far were mostly the model's); the verify times
            # measured while both went on stay
            self.model_off = self.went_off = True
            self.drafter.use_model = False
            self.verdicts = Verdicts(PRIOR, DECAY)
        if not self._verify:  # (nothing to compare with yet)
            return cap
        k, r = self.best(cap, least)
        if r >= self.rate(0):
            self._declined = 0
            return k
        self._declined += 1
        if self._declined >= EXPLORE:
            k, r = self.best(cap, least, guessed=True)
            measured = self._verify.get(k + 1)
            if r >= self.rate(0) and (measured is None or len(measured.last) < EXPLORED):
                # (the measures say no, the guess yes, and the shape was measured too few times for its lower
                # median to pass over a slow moment: one step measures it again)
                self._declined = 0
                return k
        return self._choose_plain(history, t, cap)

    def _choose_plain(self, history: list[int], t: int, cap: int) -> int:
        self.chosen_plain += 1
        if self.free and self._shadow is None:
            props, _ = (self.drafter if self._fallback is None else self._fallback).propose(history + [t], cap)
            if props:
                self._shadow = (len(history) + 1, [int(d) for d in props])
        return 0

    def _judge_shadow(self, history: list[int], t: int) -> None:
        """A shadow proposal against the tokens that came after it, once they decide it."""
        if self._shadow is None:
            return
        at, props = self._shadow
        came = history[at:] + [t] if at <= len(history) else []
        if not came:
            return
        n = common_prefix(props, came)
        if n < len(props) and n == len(came):  # (its next proposal is not judged yet)
            return
        self._shadow = None
        self.verdict(len(props), n)

    # -- measurements -------------------------------------------------------------------------------------
    def _first(self, shape) -> bool:
        if not self.warm_up or shape in self._seen:
            return False
        self._seen.add(shape)
        return True

    def verdict(self, proposed: int, accepted: int) -> None:
        """The target kept the first `accepted` of `proposed` proposals (the next one, if any, it rejected)."""
        self.verdicts.learn(accepted, min(proposed, accepted + 1))
        self._after[self._full].learn(accepted, min(proposed, accepted + 1))
        self._full = accepted >= proposed

    def forced(self) -> None:
        """A step fed tokens the constraint forced (no proposals of the drafter's): a draft model catches up on
        them at its next proposal, which is then no measure of its drafting."""
        self._catch_up = True
        self._last_source = None

    def plain(self, seconds: float) -> None:
        """A plain step (forward of one token and its pick) took `seconds`."""
        self._catch_up = True
        if self.fixed is not None:
            return  # (its cost is 1)
        if self._first(1):
            return
        self._plain.add(seconds)
        self._plains += 1
        self._since = 0

    def spec(self, rows: int, verify_s: float, proposed: int, draft_s: float, accepted: int,
             emitted: int) -> None:
        """A verify pass of `rows` rows took verify_s (its pass and verdict) and gave `emitted` tokens, after
        `proposed` proposals that took draft_s."""
        self.verdict(proposed, accepted)
        self._shadow = None
        catch_up, self._catch_up = self._catch_up, False
        source, last = getattr(self.drafter, "source", None), self._last_source
        if self.fixed is not None:  # (lookup's and the n-gram sources' proposals cost nothing)
            row, draft = self.fixed
            verify_s = 1.0 + row * (rows - 1)
            draft_s = proposed * draft if not self.free and source in (None, "draft", "mtp") else 0.0
        self._last_source = source
        if self._first((rows, proposed)):
            return
        self._verify.setdefault(rows, _Times()).add(verify_s)
        if not self.free:
            if catch_up:  # (a draft model's proposal then includes catching up: not a measure of drafting)
                return
            self._steps.append((emitted, draft_s + verify_s, proposed))
            if source == self._model_name and last == source and proposed:  # (no catching up on lookup's tokens)
                self._draft.add(draft_s / proposed)
        self._since += 1
