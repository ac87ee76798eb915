"""Speculation by measured cost (speculative.SpecCost): the choice each step, and that it keeps the output.

The suite runs with SHARPI_SPEC_COST=0 (conftest: the other tests count passes and proposals); these tests turn
it on. Costs are synthetic where a test needs a given machine (a SpecCost whose measurements are replaced by a
cost model's), so the choices are deterministic; the greedy output must be the plain one whatever they are, and
sampled generations under changing choices must still follow the target's law.
"""
from __future__ import annotations

from collections import deque

import pytest

from sharpi_core.generate import Generator
from sharpi_core.sampling import SamplingParams
from sharpi_core.speculative import HybridDrafter, LookupDrafter, SpecCost
from sharpi_core.speculative import cost as cost_mod
from test_generate import (GREEDY, GREEDY_PEN, PROMPT, SAMPLED_PEN, V, drafter_for, make, martingale_pvalue,
                           ref_greedy, target_model)
from toy import ToyTokenizer


class Synthetic(SpecCost):
    """SpecCost on a machine with these costs, in units of a plain step: a verify pass of r rows costs
    1 + row (r - 1), a proposal of k tokens draft k."""

    def __init__(self, drafter, row: float, draft: float):
        super().__init__(drafter)
        self.row, self.per = row, draft

    def plain(self, seconds):
        super().plain(1.0)

    def spec(self, rows, verify_s, proposed, draft_s, accepted, emitted):
        per = 0.0 if getattr(self.drafter, "source", None) == "lookup" else self.per  # (lookup costs nothing)
        super().spec(rows, 1.0 + self.row * (rows - 1), proposed, per * proposed, accepted, emitted)


class _Props:
    """A drafter proposing fixed tokens (for SpecCost's own calls)."""

    def __init__(self, props, free=True):
        self.props, self.free, self.calls = props, free, 0

    def propose(self, history, k):
        self.calls += 1
        return self.props[:k], None


def test_expected_tokens():
    assert cost_mod.expected_tokens(0.0, 4) == 1.0
    assert cost_mod.expected_tokens(1.0, 4) == 5.0
    assert cost_mod.expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_estimates_between_and_beyond_the_measured_counts():
    e = cost_mod._estimate
    assert e({1: 1.0, 5: 3.0}, 2) == pytest.approx(1.5)  # between
    assert e({1: 1.0, 5: 3.0}, 7) == pytest.approx(4.0)  # beyond: the line through the nearest two
    assert e({2: 1.4, 4: 2.4}, 1) == pytest.approx(0.9)  # below
    assert e({4: 2.0}, 1) == pytest.approx(0.5)  # one count: in proportion
    assert e({3: 1.0, 4: 0.5}, 1) == pytest.approx(1.0)  # never cheaper toward fewer than the nearest


def test_lower_median_ignores_a_slow_pass():
    t = cost_mod._Times()
    for s in (50.0, 1.0):
        t.add(s)
    assert t.value == 1.0
    for s in (1.2, 0.9, 1.1, 30.0):  # the oldest go; one slow pass among five does not move it
        t.add(s)
    assert list(t.last) == [1.0, 1.2, 0.9, 1.1, 30.0] and t.value == 1.1


def run_steps(c, n, tokens, seconds, cap=4, proposed=4):
    """n steps of SpecCost c: a plain one takes 1.0, a verify step `seconds` for `tokens` tokens."""
    kinds = []
    for _ in range(n):
        k = c.plan([], 0, cap)
        if k == 0:
            c.plain(1.0)
        else:
            c.spec(proposed + 1, seconds / 2, proposed, seconds / 2, min(tokens - 1, proposed), tokens)
        kinds.append(k)
    return kinds


def test_a_draft_model_is_measured_against_plain_steps_close_in_time():
    c = SpecCost(_Props([1], free=False), guess=(0.0, 0.0))  # (free rows and proposals until measured: k = cap)
    kinds = run_steps(c, 12, 4, 2.0)  # 2 tokens per plain-step time: speculation pays
    # a call starts with 2 plain steps; the step after a plain one is the draft catching up: not a measure
    assert kinds[:3] == [0, 0, 4] and kinds.count(0) == 2
    assert not c.off and c.plain_rate() == 1.0 and len(c._steps) == 9
    prior = cost_mod.PRIOR_STEPS
    assert c.spec_rate() == pytest.approx((9 * 4 + prior * cost_mod.expected_tokens(cost_mod.PRIOR_ACCEPT, 4))
                                          / ((9 + prior) * 2.0))  # (the prior's steps at the steps' mean cost)
    kinds = run_steps(c, 40, 4, 2.0)
    assert not c.off and 2 <= kinds.count(0) <= 3  # then one every REFRESH measured verify steps


@pytest.mark.parametrize("fixed", [False, True], ids=["measured", "fixed"])
def test_a_draft_model_proposes_the_count_with_the_most_tokens_per_second(fixed):
    """Each proposal costs a draft forward and a verify row: where the draft is right 1 time in 3 (matches of 0 or 1
    token) a step proposes 1 or 2 however many are allowed, where it is always right all 16. By the measured costs,
    or by the fixed ones (sampling) alike."""
    def run(matches, n=60, least=1):
        c = SpecCost(_Props([1], free=False), fixed=(0.05, 0.1)) if fixed else Synthetic(_Props([1], free=False), 0.05, 0.1)
        ks = []
        for i in range(n):
            k = c.plan([], 0, 16, least)
            if k == 0:
                c.plain(1.0)
            else:
                a = min(k, matches[i % len(matches)])
                c.spec(k + 1, 1.0 + 0.05 * k, k, 0.1 * k, a, a + 1)
            ks.append(k)
        assert not c.off
        return ks[-20:]
    assert set(run([0, 1, 0, 1, 0, 0])) - {0} <= {1, 2}
    assert set(run([99])) - {0} == {16}
    # never below --spec-draft-n-min (fewer proposals would make the step a plain one, its drafting wasted)
    assert min(set(run([0, 1, 0, 1, 0, 0], least=3)) - {0}) == 3


def test_on_a_gpu_the_first_pass_of_a_shape_is_not_a_measure():
    c = SpecCost(_Props([1], free=False), warm_up=True, guess=(0.0, 0.0))
    kinds = run_steps(c, 4, 4, 2.0)
    assert kinds == [0, 0, 0, 4] and c._plain.last == deque([1.0, 1.0]) and not c._steps  # (a graph captured)
    run_steps(c, 1, 4, 2.0)
    assert len(c._steps) == 1
    c.plain(1.0)
    c.spec(3, 1.0, 2, 1.0, 2, 3)  # a new shape after a plain step: neither measure counts
    c.spec(3, 1.0, 2, 1.0, 2, 3)
    assert len(c._steps) == 2


def test_a_draft_model_that_does_not_pay_goes_off_and_is_judged_again_after_retry_steps():
    c = SpecCost(_Props([1], free=False))
    kinds = run_steps(c, 30, 4, 4.4)  # 4 tokens in 4.4 plain steps' time
    assert c.off and kinds[-1] == 0
    assert sum(k > 0 for k in kinds) == cost_mod.WARM + 1  # (the step after the plain ones is not a measure)
    assert run_steps(c, 100, 4, 4.4) == [0] * 100  # not probed at every step: it would have to catch up each time
    kinds = run_steps(c, cost_mod.RETRY, 4, 4.4)  # then judged again: it still does not pay
    assert c.off and sum(k > 0 for k in kinds) == cost_mod.WARM + 1 and kinds[-1] == 0
    c.begin()  # the next call (a chat turn) starts over: 2 plain steps, the verify steps, off
    kinds = run_steps(c, 30, 4, 4.4)
    assert kinds[:2] == [0, 0] and kinds[2] > 0 and c.off and sum(k > 0 for k in kinds) == cost_mod.WARM + 1


def test_a_slow_phase_of_the_machine_costs_a_stretch_not_the_rest_of_the_call():
    """The target slowed down while the first verify steps were measured (4.4 plain steps for 4 tokens): off, and
    off for good before; judged again after RETRY steps, at the machine's usual speed (2.0) it pays and stays on."""
    c = SpecCost(_Props([1], free=False))
    run_steps(c, 30, 4, 4.4)
    assert c.off
    kinds = run_steps(c, cost_mod.RETRY + 40, 4, 2.0)
    assert not c.off and kinds[-1] > 0 and sum(k > 0 for k in kinds) > 30


def test_a_few_unlucky_first_steps_do_not_turn_it_off():
    # a machine where speculation pays (4 tokens in 2 plain steps' time), but the answer starts with rejections
    c = SpecCost(_Props([1], free=False))
    run_steps(c, 3, 4, 2.0)
    for tokens in (1, 2, 2, 2):  # (adaptive counts would make these steps cheaper: not here)
        run_steps(c, 1, tokens, 3.0)
    assert not c.off and c.plan([], 0, 4) > 0
    run_steps(c, 20, 4, 2.0)
    assert not c.off


def test_a_clear_loss_turns_it_off_sooner():
    c = SpecCost(_Props([1], free=False))
    kinds = run_steps(c, 30, 2, 4.0)  # 2 tokens in 4 plain steps' time: half as fast
    assert c.off and sum(k > 0 for k in kinds) == cost_mod.CLEAR[0] + 1


def test_the_prior_is_for_the_count_the_steps_propose():
    # a useless draft (an MTP head that is never right): the generator proposes 1 token a step, each step costs
    # 1.15 plain steps for its 1 token; a prior of n_max = 4 proposals' tokens would keep it on for good
    c = SpecCost(_Props([1], free=False))
    run_steps(c, 40, 1, 1.15, cap=4, proposed=1)
    assert c.off
    c = SpecCost(_Props([1], free=False))  # the prior still carries steps that propose many
    run_steps(c, 3, 4, 2.0, cap=16, proposed=8)
    for tokens in (1, 2, 2, 2):
        run_steps(c, 1, tokens, 3.0, cap=16, proposed=8)
    assert not c.off


def test_within_the_margin_a_draft_model_stays_on():
    c = SpecCost(_Props([1], free=False))
    run_steps(c, 60, 3, 3.0 * (1 + cost_mod.MARGIN / 2))
    assert not c.off


class _Hybrid:
    """A drafter of two sources (as HybridDrafter): the model's proposals unless set aside."""

    model_source = "draft"

    def __init__(self, model_props, lookup_props):
        self.model, self.lookup = _Props(model_props, free=False), _Props(lookup_props)
        self.fallback = self.lookup
        self.use_model = True
        self.source = self.measured = None

    def propose(self, history, k):
        return (self.model if self.use_model else self.lookup).propose(history, k)


def test_a_hybrid_that_does_not_pay_sets_its_model_aside_and_lookup_goes_on():
    d = _Hybrid([1], [7, 7, 7, 7])
    c = SpecCost(d)
    kinds = []
    while not c.model_off and len(kinds) < 30:  # 2 tokens in 4 plain steps' time: the model's steps do not pay
        kinds += run_steps(c, 1, 2, 4.0)
    assert c.model_off and not c.off and c.free and not d.use_model
    # (as a draft model alone: the step after the plain ones is not a measure) and that step was lookup's, its
    # count by the verify passes measured while both went on
    assert sum(k > 0 for k in kinds) == cost_mod.CLEAR[0] + 2 and 1 <= kinds[-1] < 4
    # lookup's acceptance starts from the prior, not the model's verdicts (then its one step: 1 of 4 accepted)
    (a, w), keep = cost_mod.PRIOR, 1 - cost_mod.DECAY
    assert c.acceptance == pytest.approx((keep * a * w + 1) / (keep * w + 2))
    # lookup alone, step by step: its verify passes are measured; proposals that are never right give plain steps
    for _ in range(3):
        c.spec(5, 3.0, 4, 0.0, 0, 1)
    assert c.plan([1, 2], 3, 4) == 0 and c._shadow == (3, [7, 7, 7, 7])
    assert d.lookup.calls == 1 and d.model.calls == 0  # (the shadow is lookup's own proposal)
    assert c.plan([1, 2, 3], 7, 4) == 0
    assert c.plan([1, 2, 3, 7], 7, 4) == 0
    assert c.plan([1, 2, 3, 7, 7], 7, 4) == 0
    assert c.plan([1, 2, 3, 7, 7, 7], 7, 4) >= 1  # the text copies itself: lookup's steps come back
    c.begin()  # the next call starts with the model again
    assert d.use_model and not c.model_off and not c.free and c.plan([], 0, 4) == 0


class _Source:
    """An n-gram source as NgramChain holds them: drafts `props` (none while empty)."""

    name, n_max = "ngram-simple", 4

    def __init__(self):
        self.props, self.calls = [], 0

    def begin(self, prompt):
        pass

    def draft(self, prompt, sampled):
        self.calls += 1
        return list(self.props)

    def accept(self, n, other):
        pass


def test_ngram_drafters_before_a_draft_model_go_on_when_it_is_set_aside():
    """--spec-type ngram-* with -md: a draft model whose steps do not pay is set aside as a hybrid's is, and the
    n-gram drafters go on alone (speculation went off as a whole, n-gram drafters and all)."""
    from sharpi_core.speculative import NgramChain  # noqa: PLC0415
    src, model = _Source(), _Props([1], free=False)
    d = NgramChain([src], model, 4)
    c = SpecCost(d)
    while not c.model_off and not c.off and len(c._steps) < 30:
        run_steps(c, 1, 2, 4.0)  # 2 tokens in 4 plain steps' time: the model's steps do not pay
    assert c.model_off and not c.off and c.free and not d.use_model
    assert d.propose([1, 2, 3], 4) == ([], None) and model.calls == 0  # (the model is not asked)
    src.props = [7, 7, 7, 7]
    assert d.propose([1, 2, 3], 4) == ([7, 7, 7, 7], None) and d.source == "ngram-simple"
    for _ in range(3):  # n-gram proposals that are never right: plain steps, their shadows the chain's, not the model's
        c.spec(5, 3.0, 4, 0.0, 0, 1)
    assert c.plan([1, 2], 3, 4) == 0 and c._shadow == (3, [7, 7, 7, 7]) and model.calls == 0
    c.begin()  # the next call starts with the model again
    assert d.use_model and not c.model_off and not c.free
    src.props = []
    assert d.propose([1, 2, 3], 4) == ([1], None) and d.source == "draft"


def test_a_hybrid_is_given_the_step_costs_measured_here():
    d = _Hybrid([1], [7])
    c = SpecCost(d)
    assert d.measured is c and c.step_cost(4, True) is None  # (nothing measured yet: the hybrid's own estimates)
    c.plain(2.0)
    c.plain(2.0)

    def step(source, rows, verify_s, proposed, draft_s):
        d.source = source
        c.spec(rows, verify_s, proposed, draft_s, proposed, proposed + 1)

    step("draft", 5, 3.0, 4, 1.6)  # (after a plain step: the model catches up, not a measure of its proposals)
    step("lookup", 3, 2.5, 2, 0.0)
    step("draft", 5, 3.0, 4, 2.4)  # (after lookup's step: catching up again)
    assert c.step_cost(2, False) is None and c.step_cost(4, True) is None  # (both measured, or neither)
    step("draft", 5, 3.0, 4, 1.2)  # 0.3 s a proposal
    assert c.step_cost(4, True) == pytest.approx((3.0 + 4 * 0.3) / 2.0)
    assert c.step_cost(2, False) == pytest.approx(2.5 / 2.0)
    assert c.step_cost(3, False) == pytest.approx(2.75 / 2.0)  # (between the passes of 3 and 5 rows)
    n = len(c._steps)
    c.forced()  # tokens the constraint forced: the model catches up on them next, not a measure either
    step("draft", 5, 3.0, 4, 4.0)
    assert len(c._steps) == n and list(c._draft.last) == [0.3]
    step("draft", 5, 3.0, 4, 1.2)
    assert len(c._steps) == n + 1 and list(c._draft.last) == [0.3, 0.3]


def test_a_hybrid_weighs_its_sources_with_the_measured_costs():
    class Measured:
        def __init__(self, model_cost):
            self.model_cost = model_cost

        def step_cost(self, k, model):
            if self.model_cost is None:
                return None
            return 1 + 0.1 * k + (self.model_cost * k if model else 0.0)

    history = [1, 2, 3, 9, 1, 2, 3]  # lookup proposes 9 ...
    h = HybridDrafter(LookupDrafter(3, 2), _Props([5, 5, 5, 5], free=False), n_max=4, cost=0.3)
    h._seen["lookup"].hits, h._seen["lookup"].judged = 0.3, 1.0  # a poor lookup, a good model
    h._seen["draft"].hits, h._seen["draft"].judged = 0.9, 1.0
    h.propose(history, 4)
    assert h.source == "draft"  # (the fixed estimates: the model costs 0.3 of a pass a token)
    h.measured = Measured(None)  # (no measures yet: the same)
    h.propose(history, 4)
    assert h.source == "draft"
    h.measured = Measured(3.0)  # here the model's proposals cost 3 passes each: lookup's step is worth more
    h.propose(history, 4)
    assert h.source == "lookup"
    h.measured = Measured(0.05)
    h.propose(history, 4)
    assert h.source == "draft"


def test_lookup_picks_the_count_with_the_most_tokens_per_second():
    c = SpecCost(_Props([1, 2, 3, 4, 5, 6, 7, 8]))
    c.plain(1.0)
    for k in (2, 4, 8):
        c.spec(k + 1, 1.0 + 0.3 * k, k, 0.0, 1, 2)
    c.verdicts.hits, c.verdicts.judged = 0.5, 1.0
    k, r = c.best(8)
    rates = [c.rate(j) for j in range(1, 9)]
    assert rates.index(max(rates)) + 1 == k and 1 <= k <= 2 and r > c.rate(0)
    assert c.plan([], 0, 8) == k
    c.verdicts.hits = 0.05  # hardly ever right: a plain step
    assert c.plan([], 0, 8) == 0


def test_a_free_drafter_shadows_plain_steps_and_comes_back_when_the_text_copies():
    # lookup whose matches were all wrong: plain steps; its proposals are still scored (shadow)
    d = _Props([7, 7, 7])
    c = SpecCost(d)
    c.plain(1.0)
    for _ in range(4):
        c.spec(4, 1.6, 3, 0.0, 0, 1)
    assert c.plan([1, 2], 3, 3) == 0 and c._shadow == (3, [7, 7, 7]) and d.calls == 1
    # the text now goes on as proposed
    assert c.plan([1, 2, 3], 7, 3) == 0 and d.calls == 1  # (the shadow waits for its verdict)
    assert c.plan([1, 2, 3, 7], 7, 3) == 0
    assert c.plan([1, 2, 3, 7, 7], 7, 3) >= 1 and c._shadow is None  # 3 of 3 would have been accepted
    assert c.acceptance > 0.5


def test_a_verify_shape_measured_once_in_a_slow_moment_is_measured_again():
    """Lookup on a copied text (every proposal right), whose only 5-row pass was measured at twice its cost: plain
    steps won by the measures for good before (the shape never ran again); after EXPLORE declined proposals one
    goes ahead where the guessed costs say it pays, and its measure brings speculation back."""
    c = SpecCost(_Props([7, 7, 7, 7]), guess=(0.25, 0.0))
    c.plain(1.0)
    c.spec(5, 6.0, 4, 0.0, 4, 5)  # (usually 2.0 here)
    c.verdicts.hits, c.verdicts.judged = 1.0, 1.0
    ks = []
    for _ in range(cost_mod.EXPLORE + 3):
        k = c.plan([], 0, 4)
        if k:
            c.spec(k + 1, 1.0 + 0.25 * k, k, 0.0, k, k + 1)
        else:
            c.plain(1.0)
        c.verdicts.hits, c.verdicts.judged = 1.0, 1.0
        ks.append(k)
    assert ks[:cost_mod.EXPLORE - 1] == [0] * (cost_mod.EXPLORE - 1) and ks[cost_mod.EXPLORE - 1] == 4
    assert all(k == 4 for k in ks[cost_mod.EXPLORE:])
    # where the shape really is slow, its measures settle it: no more than EXPLORED of them, then plain steps
    c = SpecCost(_Props([7, 7, 7, 7]), guess=(0.25, 0.0))
    c.plain(1.0)
    ks = []
    for _ in range(10 * cost_mod.EXPLORE):
        c.verdicts.hits, c.verdicts.judged = 0.7, 1.0
        k = c.plan([], 0, 4)
        c.spec(k + 1, 6.0, k, 0.0, 2, 3) if k else c.plain(1.0)
        ks.append(k)
    # (the first step, with nothing measured, takes the cap; then the shape the guess likes best, 3 times)
    explored = [k for k in ks[1:] if k]
    assert ks[0] == 4 and len(explored) == cost_mod.EXPLORED and len(c._verify[explored[0] + 1].last) == cost_mod.EXPLORED
    assert set(explored) == {explored[0]} and ks[-5 * cost_mod.EXPLORE:] == [0] * (5 * cost_mod.EXPLORE)


def test_a_context_shift_drops_lookups_shadow():
    """A shadow proposal is at a place in the history: after a shift that place holds other tokens (it waited
    there for half a context of steps, then was judged against the wrong ones)."""
    gen, _ = make(GREEDY, LookupDrafter(3, 2), n_ctx=64, spec_n_max=4)
    gen.cost = SpecCost(gen.drafter)
    gen.generate(PROMPT, n_predict=4)
    gen.cost._shadow = (len(gen.history), [1, 2, 3])
    gen._kept = 1
    gen._shift()
    assert gen.cost._shadow is None


def test_shadow_waits_for_the_tokens_that_judge_it():
    c = SpecCost(_Props([5, 6, 7]))
    c._shadow = (3, [5, 6, 7])
    hits = c.verdicts.hits
    c._judge_shadow([1, 2, 3], 5)  # one token came, it matches: not judged yet
    assert c._shadow is not None
    c._judge_shadow([1, 2, 3, 5], 6)
    assert c._shadow is not None
    c._judge_shadow([1, 2, 3, 5, 6], 0)  # the third is wrong: 2 of 3 accepted
    assert c._shadow is None and c.verdicts.hits == pytest.approx((1 - cost_mod.DECAY) * hits + 2)


# -- in the generator -----------------------------------------------------------------------------------------
@pytest.fixture
def cost_on(monkeypatch):
    monkeypatch.delenv("SHARPI_SPEC_COST", raising=False)


def with_cost(gen, row, draft):
    gen.cost = Synthetic(gen.drafter, row, draft)
    return gen


def test_greedy_measures_sampling_estimates_and_zero_turns_it_off(monkeypatch):
    monkeypatch.delenv("SHARPI_SPEC_COST", raising=False)
    assert make(GREEDY, drafter_for("model", GREEDY), spec_n_max=3)[0].cost.fixed is None
    sampled = make(SAMPLED_PEN, drafter_for("model", SAMPLED_PEN), spec_n_max=3)[0].cost
    assert sampled.fixed == (0.09, 0.4)  # (toy models state no weight sizes: the default draft cost)
    assert make(SAMPLED_PEN, drafter_for("lookup", SAMPLED_PEN), spec_n_max=3)[0].cost.fixed == (0.09, 0.0)
    assert make(SAMPLED_PEN, drafter_for("hybrid", SAMPLED_PEN), spec_n_max=3)[0].cost.fixed == (0.09, 0.3)
    assert make(GREEDY, drafter_for("hybrid", GREEDY), spec_n_max=3)[0].cost is not None
    monkeypatch.setenv("SHARPI_SPEC_COST", "1")
    assert make(SAMPLED_PEN, drafter_for("model", SAMPLED_PEN), spec_n_max=3)[0].cost.fixed is None
    monkeypatch.setenv("SHARPI_SPEC_COST", "0")
    assert make(GREEDY, drafter_for("model", GREEDY), spec_n_max=3)[0].cost is None
    assert make(SAMPLED_PEN, drafter_for("model", SAMPLED_PEN), spec_n_max=3)[0].cost is None


def test_sampling_by_fixed_costs_a_seed_gives_the_same_draws_at_any_speed(monkeypatch):
    """When sampling, which steps speculate follows the verdicts alone (fixed costs): the same seed gives the same
    tokens and the same choices however long each pass took; a draft that does not pay goes off."""
    monkeypatch.delenv("SHARPI_SPEC_COST", raising=False)
    import random

    import sharpi_core.generate as generate_mod
    params = SamplingParams(temp=1.5)
    runs = []
    for speed in (0, 1, 2):
        clock, rnd = [0.0], random.Random(speed)

        def perf_counter():  # a machine whose passes take anything from 1 us to 50 ms
            clock[0] += rnd.uniform(1e-6, 0.05) if speed else 1e-3
            return clock[0]
        monkeypatch.setattr(generate_mod.time, "perf_counter", perf_counter)
        gen, _ = make(params, drafter_for("same", params), spec_n_max=4, seed=3)
        gen.drafter.model.by_token = -gen.drafter.model.by_token  # (a draft that is mostly wrong)
        r = gen.generate(PROMPT, n_predict=60)
        runs.append((r.tokens, r.spec.plain_by_cost, r.spec.cost_off, r.spec.drafted))
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][2] and runs[0][1] > 30  # (off: at 1.5 times a plain pass for 1 + a tokens, a < 0.5 does not pay)


@pytest.mark.parametrize("kind", ["lookup", "model", "same", "wide", "hybrid"])
@pytest.mark.parametrize("row,draft", [(0.05, 0.1), (0.6, 0.6), (1.0, 0.0), (0.2, 0.2)],
                         ids=["gpu", "avx2", "rows-dear", "edge"])
@pytest.mark.parametrize("params", [GREEDY, GREEDY_PEN], ids=["plain", "penalties"])
def test_greedy_output_is_the_plain_output_whatever_is_chosen(cost_on, kind, row, draft, params):
    want = ref_greedy(PROMPT, 80, params)
    gen, model = make(params, drafter_for(kind, params), spec_n_max=4)
    with_cost(gen, row, draft)
    res = gen.generate(PROMPT, n_predict=80)
    assert res.tokens == want
    s = res.spec
    assert s.target_passes == model.n_forward - 1 and s.emitted >= 79
    assert s.plain_by_cost == gen.cost.chosen_plain >= 1  # (at least the first step: measuring a plain pass)
    if row + draft > 1 and kind in ("model", "wide"):
        assert s.cost_off  # a draft that costs this much does not pay (the target itself drafting might)
        assert s.verify_passes <= 2 * cost_mod.WARM
    if row <= 0.05 and kind == "same":
        assert not s.cost_off and s.accepted == s.drafted and s.tokens_per_pass > 3
    # a second call (a chat turn, the prompt extended) starts over and keeps the output exact
    res2 = gen.generate(PROMPT + res.tokens[:5], n_predict=20)
    assert res2.tokens == ref_greedy(PROMPT + res.tokens[:5], 20, params)


@pytest.mark.parametrize("params", [GREEDY, GREEDY_PEN], ids=["plain", "penalties"])
def test_a_hybrid_whose_model_does_not_pay_goes_on_with_lookup(cost_on, params):
    want = ref_greedy(PROMPT, 120, params)
    gen, model = make(params, drafter_for("hybrid", params), spec_n_max=4)
    with_cost(gen, 0.6, 1.0)  # (a draft as dear as the target: the steps with its proposals lose)
    res = gen.generate(PROMPT, n_predict=120)
    assert res.tokens == want
    s = res.spec
    assert s.cost_off and gen.cost.model_off and not gen.cost.off and not gen.drafter.use_model
    assert s.target_passes == model.n_forward - 1
    assert s.sources["draft"]["steps"] <= 2 * cost_mod.WARM
    # the toy's text repeats itself: lookup's steps went on after the model was set aside
    assert s.sources["lookup"]["steps"] > 0 and s.verify_passes > s.sources["draft"]["steps"]
    d = s.as_dict()
    assert d["cost_off"] is True
    # the next call (a chat turn) starts with the model again (it catches up on what it missed), output exact
    res2 = gen.generate(PROMPT + res.tokens[:5], n_predict=30)
    assert res2.tokens == ref_greedy(PROMPT + res.tokens[:5], 30, params)
    assert gen.drafter.use_model == (not gen.cost.model_off) and res2.spec.cost_off == gen.cost.model_off


def test_a_hybrid_whose_model_pays_keeps_it(cost_on):
    gen, _ = make(GREEDY, drafter_for("hybrid", GREEDY), spec_n_max=4)
    with_cost(gen, 0.05, 0.05)
    res = gen.generate(PROMPT, n_predict=120)
    assert res.tokens == ref_greedy(PROMPT, 120) and not res.spec.cost_off and gen.drafter.use_model


@pytest.mark.parametrize("kind", ["model", "hybrid"])
def test_forced_runs_keep_the_output_and_are_not_measures_of_drafting(cost_on, kind):
    from test_reasoning import toy_budget
    want = make(GREEDY, grammar=toy_budget())[0].generate(PROMPT, n_predict=200).tokens
    gen, _ = make(GREEDY, drafter_for(kind, GREEDY, make()[1]), spec_n_max=4, grammar=toy_budget())
    calls = []

    class Spy(Synthetic):
        def forced(self):
            calls.append(len(self._steps))
            super().forced()

    gen.cost = Spy(gen.drafter, 0.05, 0.1)
    assert gen.generate(PROMPT, n_predict=200).tokens == want
    assert calls and not gen.cost.off  # (the budget forced its message and end tag)


def test_measured_costs_keep_the_greedy_output(cost_on):
    # real timings on the toys (whatever the machine makes of them)
    for kind in ("lookup", "model", "hybrid"):
        gen, _ = make(GREEDY, drafter_for(kind, GREEDY), spec_n_max=4)
        assert isinstance(gen.cost, SpecCost) and not isinstance(gen.cost, Synthetic)
        assert gen.generate(PROMPT, n_predict=60).tokens == ref_greedy(PROMPT, 60)


def test_a_draft_model_catching_up_is_not_taken_for_its_drafting_cost(cost_on, monkeypatch):
    monkeypatch.setattr(cost_mod, "WINDOW", 1000)  # (every measured step stays in the window)
    seen = []  # per verify step: (after a plain step, taken as a measure)

    class Spy(Synthetic):
        def spec(self, rows, verify_s, proposed, draft_s, accepted, emitted):
            after, n = self._catch_up, len(self._steps)
            super().spec(rows, verify_s, proposed, draft_s, accepted, emitted)
            seen.append((after, len(self._steps) > n))

    gen, _ = make(GREEDY, drafter_for("model", GREEDY), spec_n_max=4)
    gen.cost = Spy(gen.drafter, 0.05, 0.1)
    gen.generate(PROMPT, n_predict=60)
    assert seen[0] == (True, False)  # after the first (plain) steps the draft catches up on them
    assert all(not taken for after, taken in seen if after) and any(taken for _, taken in seen)


def test_sampled_generation_under_changing_choices_follows_the_target(monkeypatch):
    # SHARPI_SPEC_COST=1 at temp > 0: lookup's proposals taken or shadowed as its acceptance moves, the rows
    # dear enough that the choice flips often; k comes from the past only, so the law stays the target's
    monkeypatch.setenv("SHARPI_SPEC_COST", "1")
    n = 3000
    gen, _ = make(SAMPLED_PEN, drafter_for("lookup", SAMPLED_PEN), n_ctx=n + 64, spec_n_max=3, seed=41)
    with_cost(gen, 0.3, 0.0)
    res = gen.generate(PROMPT, n_predict=n)
    s = res.spec
    assert len(res.tokens) == n
    assert s.verify_passes > 100 and s.plain_by_cost > 100 and 0 < s.accepted < s.drafted  # both kinds of step
    assert martingale_pvalue(SAMPLED_PEN, PROMPT, res.tokens) > 0.001


def test_json_stats_say_what_the_cost_model_did(cost_on):
    gen, _ = make(GREEDY, drafter_for("model", GREEDY), spec_n_max=4)
    with_cost(gen, 0.6, 0.6)
    d = gen.generate(PROMPT, n_predict=40).spec.as_dict()
    assert d["cost_off"] is True and d["plain_by_cost"] > 20


def test_lookup_is_free():
    assert LookupDrafter.free and not getattr(drafter_for("model", GREEDY), "free", False)


def test_generator_without_a_drafter_has_no_cost_model(cost_on):
    gen = Generator(target_model(), target_model().new_cache(64), ToyTokenizer(V), GREEDY)
    assert gen.cost is None
    assert gen.generate(PROMPT, n_predict=5).tokens == ref_greedy(PROMPT, 5)


def test_params_sampled_at_temp_0_with_xtc_is_not_greedy(cost_on):
    p = SamplingParams(temp=0, xtc_probability=0.5, xtc_threshold=0.1)
    assert not p.greedy
    assert make(p, drafter_for("lookup", p), spec_n_max=3)[0].cost.fixed is not None  # (sampled: fixed costs)
