"""Prompt lookup and a draft model (or MTP head) together (`--draft-lookup` with `-md` / `--spec-type`, as llama.cpp
lists its n-gram types before a draft model): each step one of them proposes.

Lookup costs nothing; where the text copies itself its proposals are as good as a model's, elsewhere its short
n-gram matches are mostly wrong and would take the step from a model that is usually right. So the step goes to the
source with the most tokens per unit of cost expected: (1 + E(a, k)) / (V(k) + c k), where a is the source's
running estimate of the chance that a proposal is accepted once the ones before it were, E(a, k) = a + a^2 + ... +
a^k the tokens k proposals are then expected to bring, c the source's cost per proposed token relative to a target
pass (0 for lookup; the draft's weight bytes over the target's for a model, decoding being bound by memory) and
V(k) a verify pass of 1 + k rows (where speculative.SpecCost measures this machine, greedy decoding by default, the
measured V(k) + c k replace these estimates: `measured`). Per token, not per step: a lookup match that can offer
one token is worth at most a, not a whole step's average. (Estimates per proposal position instead, tried on
scripts/bench_hybrid.py's requests, gave lookup worse steps on the edit request: 40 against 46 t/s.) Lookup's
proposal is computed at every step, so its estimate follows the text even at the steps the model takes (scored
against the tokens that came). The draft model catches up on the tokens it did not see in one batched pass at its
next proposal.

Exactness: the choice depends on the past only (the history, past verdicts and, with `measured`, past timings; without
it no clock, so a fixed seed gives the same output), and each proposal's q is its own source's (None for lookup:
deterministic), so acceptance stays exact.
Each source keeps its own count of proposals, adapted from its own verdicts as generate.next_proposal_len adapts
the generator's; the generator then asks for up to n_max (see `adapts`). `source` names the last proposal's source
(the generator's stats per source).
"""
from __future__ import annotations

from .util import Verdicts, WrapsModel, common_prefix, next_proposal_len

DECAY = 0.25  # weight of the newest step's verdict in a source's running estimate
VERIFY_ROW = 0.09  # a verify pass's cost per extra row, relative to a one-row pass (Qwen 1.5B on the CPU: 5 rows 1.36)
DRAFT_COST = 0.4  # a draft model's proposal relative to a target pass, where their weights' sizes are not known
# prior estimates (chance a proposal is accepted after its prefix was, weight in verdicts): lookup's low, as its
# short matches in new text mostly are, a model's as a related draft's usually is
PRIOR_LOOKUP, PRIOR_MODEL = (0.4, 2.0), (0.75, 4.0)


class HybridDrafter(WrapsModel):
    # the generator leaves the count of proposals to this drafter (and sets it False with
    # SHARPI_SPEC_ADAPTIVE=0: every source then proposes what it is asked)
    adapts = True

    def __init__(self, lookup, model, n_max: int, n_min: int = 0, cost: float = DRAFT_COST, names=("lookup", "draft")):
        self.lookup, self.model = lookup, model
        self.names = names
        self.n_max, self.n_min = n_max, n_min
        self.cost = cost
        self._k = {n: n_max for n in names}
        self._seen = {names[0]: Verdicts(PRIOR_LOOKUP, DECAY), names[1]: Verdicts(PRIOR_MODEL, DECAY)}
        self.source: str | None = None  # the last proposal's source
        # False: lookup alone proposes (speculative.SpecCost sets the model aside where it does not pay; it catches
        # up on the tokens it missed at its next proposal, as after lookup's steps)
        self.use_model = True
        # speculative.SpecCost, where it measures this machine (greedy decoding): its step_cost replaces the fixed
        # estimates below once it has measures
        self.measured = None
        self._last: tuple[str, int, int] | None = None  # (source, history length, proposals) of the last step
        self._shadow: tuple[int, list[int]] | None = None  # lookup's last proposal (history length, tokens)
        observe = getattr(model, "observe", None)
        if observe is not None:  # (the MTP head sees every target pass, whichever source proposed)
            self.observe = observe

    @property
    def fallback(self):
        """What proposes while speculative.SpecCost sets the model aside (use_model False): lookup."""
        return self.lookup

    @property
    def model_source(self) -> str:
        return self.names[1]

    def _count(self, name: str, k: int) -> int:
        return min(k, max(self._k[name], self.n_min)) if self.adapts else k

    def _value(self, name: str, k: int, cost: float) -> float:
        step = self.measured.step_cost(k, name == self.names[1]) if self.measured is not None else None
        return (1 + self._seen[name].expected(k)) / (step if step is not None else 1 + VERIFY_ROW * k + cost * k)

    def propose(self, history: list[int], k: int):
        self.source = self._last = None
        lookup, model = self.names
        if self._shadow is not None:  # lookup's last proposal against what came after it
            n, props = self._shadow
            self._shadow = None
            came = history[n:]
            if came:
                a = common_prefix(props, came)
                self._seen[lookup].learn(a, min(len(props), len(came), a + 1))
        kl, km = self._count(lookup, k), self._count(model, k)
        props, q = self.lookup.propose(history, kl)
        if props:
            self._shadow = (len(history), list(props))
            # (a match shorter than --spec-draft-n-min would be dropped for a plain step: the model's turn)
            if len(props) >= max(1, self.n_min) and \
                    self._value(lookup, len(props), 0.0) >= self._value(model, km, self.cost):
                self.source, self._last = lookup, (lookup, len(history), len(props))
                return props, q
        mprops, mq = self.model.propose(history, km) if self.use_model else ([], None)
        if mprops:
            self.source, self._last = model, (model, len(history), len(mprops))
            return mprops, mq
        if props:
            self.source, self._last = lookup, (lookup, len(history), len(props))
        return props, q

    def rollback(self, n_keep: int) -> None:
        if self._last is not None:  # (the verdict on the last proposals: how many the target kept)
            name, n_hist, n_props = self._last
            self._last = None
            accepted = max(0, min(n_props, n_keep - n_hist))
            self._k[name] = next_proposal_len(self.n_max, n_props, accepted)
            if name == self.names[1]:
                self._seen[name].learn(accepted, min(n_props, accepted + 1))
        self.lookup.rollback(n_keep)
        self.model.rollback(n_keep)

    def begin(self, prompt: list[int]) -> None:
        """A generation starts (Generator.generate, its prompt evaluated): the last one's unjudged lookup proposal
        is not judged against another text's tokens."""
        self._shadow = None
        begin = getattr(self.model, "begin", None)
        if begin is not None:
            begin(prompt)

    def shift(self, n_keep: int, n_discard: int) -> None:
        self._shadow = None
        super().shift(n_keep, n_discard)
