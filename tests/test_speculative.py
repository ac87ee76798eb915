"""Speculative decoding: lookup matcher, draft-model drafter, and the acceptance rules.

The distribution oracle runs a small speculative engine over toy tables (a context-dependent
target p, a different draft q, the real accept_sampled and LookupDrafter), 20k seeded runs per
configuration, and compares the emitted tokens with the target's exact distribution by chi-square:
the joint of the first three tokens, and the marginals at positions k and k+1 (the last draft row
and the bonus row). Deliberately wrong rules (always accept; resample from p after a rejection)
must fail the same tests, which shows the tests can fail.
"""
from __future__ import annotations

import bisect
import random
import re
import time
from functools import lru_cache

import numpy as np
import pytest
import torch

from sharpi_core.errors import UsageError
from sharpi_core.generate import next_proposal_len
from sharpi_core.sampling import SamplingParams, argmax, draw, filtered_probs
from sharpi_core.speculative import (DraftModelDrafter, LookupDrafter, accept_greedy, accept_sampled,
                                     common_prefix)
from sharpi_core.speculative.draft_model import P_STOP
from toy import ToyModel, _next_hash, chi2_test


# -- lookup -------------------------------------------------------------------------------------------
def ref_lookup(history: list[int], k: int, nmax: int, nmin: int) -> list[int]:
    L = len(history)
    for n in range(nmax, nmin - 1, -1):
        if L <= n:
            continue
        gram = history[L - n:]
        for e in range(L - 1, n - 1, -1):  # most recent earlier occurrence, ending before L
            if history[e - n:e] == gram:
                return history[e:e + k]
    return []


def test_lookup_longest_ngram_first():
    # the 2-gram (2, 3) last occurred before 9, but the 3-gram (1, 2, 3) before 7
    h = [1, 2, 3, 7, 8, 5, 2, 3, 9, 9, 1, 2, 3]
    assert LookupDrafter(3, 2).propose(h, 2) == ([7, 8], None)
    assert LookupDrafter(2, 2).propose(h, 2) == ([9, 9], None)


def test_lookup_most_recent_occurrence_wins():
    h = [4, 5, 1, 4, 5, 2, 0, 4, 5]
    assert LookupDrafter(3, 2).propose(h, 3)[0] == [2, 0, 4]


def test_lookup_caps_at_k_and_history_end():
    h = [1, 2, 3, 4, 5, 6, 1, 2]
    assert LookupDrafter(3, 2).propose(h, 3)[0] == [3, 4, 5]
    assert LookupDrafter(3, 2).propose(h, 10)[0] == [3, 4, 5, 6, 1, 2]
    assert LookupDrafter(3, 2).propose(h, 0)[0] == []
    # the most recent occurrence overlaps the query: its continuation runs to the end of history
    assert LookupDrafter(3, 2).propose([7, 7, 7, 7], 4)[0] == [7]


def test_lookup_no_match():
    assert LookupDrafter(3, 2).propose([1, 2, 3, 4, 5], 4) == ([], None)
    assert LookupDrafter(3, 2).propose([], 4) == ([], None)
    assert LookupDrafter(3, 2).propose([1, 1], 4) == ([], None)


def test_lookup_validates_ngram_sizes():
    with pytest.raises(UsageError):
        LookupDrafter(3, 1)
    with pytest.raises(UsageError):
        LookupDrafter(3, 0)
    with pytest.raises(UsageError):
        LookupDrafter(2, 3)
    LookupDrafter(2, 2)
    LookupDrafter(5, 4)


def test_lookup_incremental_index_equals_rescan():
    rnd = random.Random(0)
    for nmax, nmin in [(3, 2), (4, 2), (2, 2), (5, 3)]:
        d = LookupDrafter(nmax, nmin)
        h: list[int] = []
        for _ in range(400):
            r = rnd.random()
            if r < 0.7:
                h = h + [rnd.randrange(5) for _ in range(rnd.randint(1, 4))]
            elif r < 0.85:
                h = h[: rnd.randint(0, len(h))]  # shrink (rollback / new chat turn)
            else:
                cut = rnd.randint(0, len(h))  # diverge
                h = h[:cut] + [rnd.randrange(5) for _ in range(rnd.randint(1, 5))]
            k = rnd.randint(1, 6)
            assert d.propose(h, k)[0] == ref_lookup(h, k, nmax, nmin)


def test_lookup_is_fast_on_long_histories():
    rnd = random.Random(1)
    h = [rnd.randrange(2000) for _ in range(4096)]
    d = LookupDrafter(3, 2)
    d.propose(h, 8)
    t0 = time.perf_counter()
    for _ in range(300):
        h.append(rnd.randrange(2000))
        d.propose(h, 8)
    per_call = (time.perf_counter() - t0) / 300
    assert per_call < 2e-3, per_call  # ~0.05 ms unloaded: incremental, no rescan


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix([], [1]) == 0
    rnd = random.Random(2)
    for _ in range(200):
        a = [rnd.randrange(3) for _ in range(rnd.randint(0, 40))]
        b = a[: rnd.randint(0, len(a))] + [rnd.randrange(3) for _ in range(rnd.randint(0, 5))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix(a, b) == n


# -- acceptance rules ------------------------------------------------------------------------------------
def test_accept_greedy():
    rows = torch.full((4, 6), -1.0)
    for i, t in enumerate([2, 5, 1, 0]):
        rows[i, t] = 1.0
    assert accept_greedy([2, 5, 1], rows) == (3, 0)   # all accepted: bonus from the last row
    assert accept_greedy([2, 4, 1], rows) == (1, 5)   # first mismatch: the target's token there
    assert accept_greedy([3, 5, 1], rows) == (0, 2)
    assert accept_greedy([], rows[:1]) == (0, 2)
    assert accept_greedy([2, 5, 9], rows[:3]) == (2, 1)  # last draft outside the vocab: k rows suffice


def test_accept_sampled_edge_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.2, 0.8, 0.0], [0.1, 0.1, 0.8]])
    for _ in range(50):
        assert accept_sampled([1, 2], q, p, g) == (2, 0)   # p(d) >= q(d): always accepted
        assert accept_sampled([1, 2], None, p, g) == (2, 0)
        assert accept_sampled([0], q[:1], p[:2], g) == (0, 1)  # p(d) = 0: rejected, residual is p
        n, t = accept_sampled([0], None, p[:2], g)
        assert (n, t) == (0, 1)
    # identical p and q: everything accepted
    pq = torch.softmax(torch.randn(5, 7, generator=g), -1)
    for _ in range(50):
        assert accept_sampled([int(torch.multinomial(pq[i], 1, generator=g)) for i in range(4)], pq[:4], pq, g)[0] == 4
    # vocabularies of different widths: a draft token outside the target's is rejected for sure,
    # and the residual never picks an id the target does not have
    p2 = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    q3 = torch.tensor([[0.1, 0.1, 0.8]])
    for _ in range(50):
        n, t = accept_sampled([2], q3, p2[:1], g)
        assert n == 0 and t in (0, 1)
    # p_min: also accept when the target gives the draft >= p_min
    p3 = torch.tensor([[0.3, 0.7], [0.5, 0.5]])
    q4 = torch.tensor([[0.0, 1.0]])
    assert all(accept_sampled([1], q4, p3, g, p_min=0.6)[0] == 1 for _ in range(50))
    assert any(accept_sampled([1], q4, p3, g)[0] == 0 for _ in range(50))


# -- distribution oracle ---------------------------------------------------------------------------------
V = 8
PARAMS = SamplingParams(temp=0.9, top_k=6, top_p=0.95, min_p=0.02)  # filters: p and q have zeros
TARGET = ToyModel(V, seed=11, scale=1.2)
# mostly agree with the target, so full acceptances (the bonus row) are common, but differ enough
# that the residual matters
DRAFTS = {}
for name, (wt, wd) in {"model": (0.7, 0.6), "close": (0.85, 0.35)}.items():
    d = ToyModel(V, seed=12, scale=1.2)
    d.by_token = wt * TARGET.by_token + wd * d.by_token
    d.by_pos = wt * TARGET.by_pos + wd * d.by_pos
    d.by_hash = wt * TARGET.by_hash + wd * d.by_hash
    DRAFTS[name] = d
PROMPT = [int(t) for t in torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(3))]
# "head": the "model" draft with its output layer cut to ids [0, HEAD_V) (--spec-draft-vocab): its q
# is narrower than p and never proposes the other ids, which the residual must then supply
HEAD_V = 5


@lru_cache(maxsize=None)
def p_row(state: tuple[int, int, int]) -> np.ndarray:
    return filtered_probs(TARGET._row(*state), PARAMS).numpy()


@lru_cache(maxsize=None)
def q_row(state: tuple[int, int, int], draft: str = "model") -> np.ndarray:
    if draft == "head":
        return filtered_probs(DRAFTS["model"]._row(*state)[:HEAD_V], PARAMS).numpy()
    return filtered_probs(DRAFTS[draft]._row(*state), PARAMS).numpy()


def advance(state, tok):
    _, pos, h = state
    return tok, pos + 1, _next_hash(h, tok)


START = TARGET.state_after(PROMPT)


def exact_joint(m: int) -> np.ndarray:
    out = np.zeros((V,) * m)

    def rec(state, prefix, prob):
        if len(prefix) == m:
            out[tuple(prefix)] += prob
            return
        p = p_row(state)
        for t in np.flatnonzero(p):
            rec(advance(state, int(t)), prefix + [int(t)], prob * p[t])
    rec(START, [], 1.0)
    return out


def exact_marginals(m: int) -> list[np.ndarray]:
    """Marginal of the j-th emitted token, j = 1..m, by dynamic programming over toy states."""
    dist = {START: 1.0}
    out = []
    for _ in range(m):
        marg = np.zeros(V)
        nxt: dict = {}
        for st, w in dist.items():
            p = p_row(st)
            marg += w * p
            for t in np.flatnonzero(p):
                s2 = advance(st, int(t))
                nxt[s2] = nxt.get(s2, 0.0) + w * p[t]
        out.append(marg)
        dist = nxt
    return out


@lru_cache(maxsize=None)
def q_cdf(state, draft: str) -> tuple[list[float], float]:
    c = np.cumsum(q_row(state, draft)).tolist()
    return c, c[-1]


def sample_q(state, draft: str, u: float) -> int:
    c, total = q_cdf(state, draft)
    j = min(bisect.bisect_right(c, u * total), len(c) - 1)
    while j > 0 and c[j] == c[j - 1]:  # landed on a zero-probability id: step back
        j -= 1
    return j


def always_accept(draft, q, p, g):
    return len(draft), draw(p[len(draft)], g)


def resample_from_p(draft, q, p, g):
    """Wrong: after a rejection, draw from p instead of the residual max(0, p - q)."""
    n, t = accept_sampled(draft, q, p, g)
    if n < len(draft):
        t = draw(p[n], g)
    return n, t


def simulate(kind: str, k: int, m: int, runs: int, seed: int, rule=accept_sampled, adaptive=False) -> np.ndarray:
    """runs x m emitted tokens from a speculative engine over the toy tables (adaptive: the number
    of proposals follows generate.next_proposal_len, as the Generator does by default)."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    lookup = LookupDrafter(3, 2)
    out = np.zeros((runs, m), dtype=np.int64)
    for r in range(runs):
        state, hist, emitted, kk = START, list(PROMPT), [], k
        while len(emitted) < m:
            if kind in DRAFTS or kind == "head":
                drafts, qs, st = [], [], state
                for _ in range(kk):
                    d = sample_q(st, kind, rnd.random())
                    drafts.append(d)
                    qs.append(q_row(st, kind))
                    st = advance(st, d)
                q_t = torch.from_numpy(np.array(qs))
            else:
                drafts, q_t = lookup.propose(hist, kk)
            if not drafts:  # plain step
                new = [draw(p_row(state), g)]
            else:
                rows, st = [p_row(state)], state
                for d in drafts:
                    st = advance(st, d)
                    rows.append(p_row(st))
                n, nxt = rule(drafts, q_t, torch.from_numpy(np.array(rows)), g)
                new = drafts[:n] + [nxt]
                if adaptive:
                    kk = next_proposal_len(k, len(drafts), n)
            for t in new:
                emitted.append(t)
                hist.append(t)
                state = advance(state, t)
        out[r] = emitted[:m]
    return out


def oracle_pvalues(samples: np.ndarray, k: int) -> dict[str, float]:
    runs = samples.shape[0]
    joint = np.zeros((V,) * 3)
    np.add.at(joint, (samples[:, 0], samples[:, 1], samples[:, 2]), 1)
    res = {"joint(1,2,3)": chi2_test(joint, exact_joint(3))[2]}
    margs = exact_marginals(samples.shape[1])
    for j in sorted({k, k + 1} - {1, 2, 3}):
        res[f"position {j}"] = chi2_test(np.bincount(samples[:, j - 1], minlength=V), margs[j - 1])[2]
    assert runs >= 1
    return res


N_RUNS = 20_000


@pytest.mark.parametrize("kind", ["model", "lookup"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_emitted_tokens_follow_the_target_distribution(kind, k):
    if kind == "model" and k == 8:
        kind = "close"  # a closer draft: full acceptances (the bonus row at position 9) are common
    samples = simulate(kind, k, max(3, k + 1), N_RUNS, seed=100 + k)
    pv = oracle_pvalues(samples, k)
    assert min(pv.values()) > 0.001, pv


@pytest.mark.parametrize("k", [1, 4])
def test_cut_draft_head_keeps_the_target_distribution(k):
    samples = simulate("head", k, max(3, k + 1), N_RUNS, seed=300 + k)
    pv = oracle_pvalues(samples, k)
    assert min(pv.values()) > 0.001, pv
    # the ids past the draft's head do come out (through the residual and the bonus row)
    assert np.isin(samples, np.arange(HEAD_V, V)).mean() > 0.05


@pytest.mark.parametrize("kind", ["model", "lookup"])
def test_adaptive_proposal_counts_keep_the_target_distribution(kind):
    samples = simulate(kind, 6, 7, N_RUNS, seed=200, adaptive=True)
    pv = oracle_pvalues(samples, 6)
    assert min(pv.values()) > 0.001, pv


def test_synthetic_acceptance_rates_are_llama_cpps():
    """--spec-synth-len L: geometric rates p^(i+1) whose mean length 1 + sum is L (llama.cpp's bisection); its
    edges accept nothing or everything; rates become the chances each proposal is taken after the ones before."""
    from sharpi_core.speculative.synthetic import conditional, resolve_rates
    for n_max, length in ((4, 3.0), (1, 1.5), (8, 2.2), (16, 16.9)):
        r = resolve_rates(length, None, n_max)
        assert len(r) == n_max and abs(1 + sum(r) - length) < 1e-6
        assert all(abs(r[i] - r[0] ** (i + 1)) < 1e-12 for i in range(n_max))
        assert all(abs(c - r[0]) < 1e-9 for c in conditional(r))
    assert resolve_rates(5.0, None, 4) == [1.0] * 4 and resolve_rates(1.0, None, 4) == [0.0] * 4
    assert conditional([0.8, 0.4, 0.0, 0.0]) == [0.8, 0.5, 0.0, 0.0]
    for length, rates, n_max, msg in ((2.0, [1.0], 1, "mutually exclusive"), (None, [1.0], 0, "at least one"),
                                      (None, [1.0, float("nan")], 2, "finite"), (None, [1.2], 1, "within [0, 1]"),
                                      (0.5, None, 3, "within [1, 4]"), (float("inf"), None, 3, "finite")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            resolve_rates(length, rates, n_max)


def test_next_proposal_len():
    assert next_proposal_len(4, 4, 4) == 4 and next_proposal_len(8, 2, 2) == 4 and next_proposal_len(8, 1, 1) == 2
    assert next_proposal_len(4, 4, 0) == 1 and next_proposal_len(4, 4, 2) == 3 and next_proposal_len(4, 3, 3) == 4


@pytest.mark.parametrize("rule", [always_accept, resample_from_p], ids=["always_accept", "resample_from_p"])
def test_wrong_acceptance_rules_fail_the_oracle(rule):
    samples = simulate("model", 4, 5, 5000, seed=7, rule=rule)
    pv = oracle_pvalues(samples, 4)
    assert min(pv.values()) < 1e-6, pv


def test_wrong_lookup_rule_fails_the_oracle():
    samples = simulate("lookup", 4, 5, 5000, seed=8, rule=always_accept)
    assert min(oracle_pvalues(samples, 4).values()) < 1e-6


@pytest.mark.parametrize("kind,k", [("lookup", 1), ("lookup", 4), ("lookup", 8), ("model", 4), ("close", 8)])
def test_oracle_exercises_every_path(kind, k):
    # the oracle must see proposals, rejections (residual draws), acceptances after which a later
    # draft is rejected, and full acceptances (bonus row); with random-looking toy text, prompt
    # lookup rarely gets 4 or 8 drafts all accepted, but k = 1 covers its bonus row
    seen = {"steps": 0, "rejected": 0, "partial": 0, "full": 0}

    def counting(draft, q, p, g):
        n, t = accept_sampled(draft, q, p, g)
        seen["steps"] += 1
        seen["rejected" if n < len(draft) else "full"] += 1
        seen["partial"] += 0 < n < len(draft)
        return n, t
    simulate(kind, k, k + 1, 300, seed=5, rule=counting)
    assert seen["steps"] > 200 and seen["rejected"] > 50, seen
    assert seen["full"] > (30 if kind != "lookup" or k == 1 else 0), seen
    assert seen["partial"] > (20 if k > 1 else -1), seen


# -- draft-model drafter -----------------------------------------------------------------------------------
def test_draft_model_greedy_proposals_and_resync():
    model = ToyModel(V, seed=5)
    cache = model.new_cache(256)
    d = DraftModelDrafter(model, cache, SamplingParams(temp=0))
    hist = PROMPT[:20]
    props, q = d.propose(hist, 4)
    assert q is None and len(props) == 4
    ctx = list(hist)
    for t in props:  # the draft's own greedy chain
        assert t == int(argmax(model.logits_after(ctx)))
        ctx.append(t)
    assert d.history == hist + props[:3] and cache.length == 23  # the last proposal is never fed
    # the target accepted 2 drafts, then its own token 7: only the missing suffix is fed
    d.rollback(len(hist) + 2)
    assert cache.length == 22 and d.history == hist + props[:2]
    model.batch_sizes.clear()
    new_hist = hist + props[:2] + [7]
    props2, _ = d.propose(new_hist, 3)
    assert model.batch_sizes == [1, 1, 1]  # [7], then 2 drafts
    assert cache.content == new_hist + props2[:2]
    # all accepted + bonus: the unfed last proposal and the bonus go in one forward
    model.batch_sizes.clear()
    d.propose(new_hist + props2 + [1], 2)
    assert model.batch_sizes[0] == 2
    # a diverging history (new chat turn) reuses the common prefix only
    model.batch_sizes.clear()
    other = (hist[10] + 1) % V
    d.propose(hist[:10] + [other, 3, 3], 1)
    assert model.batch_sizes == [3] and cache.content == hist[:10] + [other, 3, 3]
    # no room left in the draft's context: the window slides to the history's last half-context
    long = list(range(8)) * 32
    props3, _ = d.propose(long, 4)
    assert len(props3) == 4 and d._base == 128 and cache.content[:128] == long[128:]


def test_draft_model_sampled_q_is_what_it_sampled_from():
    model = ToyModel(V, seed=6)
    params = SamplingParams(temp=0.8, top_k=5, top_p=0.9, min_p=0.05, repeat_penalty=1.3)
    d = DraftModelDrafter(model, model.new_cache(256), params, torch.Generator().manual_seed(0))
    from sharpi_core.sampling import apply_penalties
    lengths = []
    for hist, props, q in proposals_after_prompts(d, 4, 20):
        ended_unsure(props, q, 4)
        lengths.append(len(props))
        ctx = list(hist)
        for i, t in enumerate(props):
            want = filtered_probs(apply_penalties(model.logits_after(ctx), ctx, params), params)
            torch.testing.assert_close(q[i], want)
            assert q[i, t] > 0
            ctx.append(t)
    assert min(lengths) < 4 and max(lengths) == 4  # both ends of the rule were met


def proposals_after_prompts(d, k: int, n: int):
    """(history, proposals, q) of d's proposals of k after PROMPT[:10], PROMPT[:11], ... (n of them): q a row of
    V per proposal; d rolled back to the history after each."""
    for j in range(n):
        hist = PROMPT[:10 + j]
        props, q = d.propose(hist, k)
        assert q.shape == (len(props), V)
        yield hist, props, q
        d.rollback(len(hist))


def ended_unsure(props, q, k):
    """A sampled proposal ends at k, or right after the first token drawn from a law whose largest probability
    is under P_STOP (the draft unsure there: what follows is mostly rejected)."""
    tops = q.max(dim=1).values.tolist()
    assert len(props) >= 1
    assert all(p >= P_STOP for p in tops[:-1]), tops
    assert len(props) == k or tops[-1] < P_STOP, tops


def test_a_sampled_proposal_ends_after_an_unsure_token_unless_switched_off(monkeypatch):
    model = ToyModel(V, seed=6, scale=2.0)  # (rows peaked enough that some proposals run to k)
    params = SamplingParams(temp=0.8, top_k=5, top_p=0.9, min_p=0.05)
    for on in (True, False):
        monkeypatch.setenv("SHARPI_SPEC_CONFIDENCE", "1" if on else "0")
        d = DraftModelDrafter(model, model.new_cache(256), params, torch.Generator().manual_seed(1))
        lengths = []
        for _, props, q in proposals_after_prompts(d, 6, 30):
            if on:
                ended_unsure(props, q, 6)
            lengths.append(len(props))
        assert (min(lengths) < 6) == on and max(lengths) == 6, lengths
    # greedy proposals are not cut (the count chosen from measured costs decides there)
    d = DraftModelDrafter(model, model.new_cache(256), SamplingParams(temp=0))
    assert len(d.propose(PROMPT[:39], 6)[0]) == 6


def test_draft_model_cut_head_proposes_and_reports_its_own_q():
    model = ToyModel(V, seed=6)
    params = SamplingParams(temp=0.8, top_k=5, top_p=0.9, min_p=0.05, repeat_penalty=1.3,
                            logit_bias=((1, 0.5), (HEAD_V + 1, 2.0)))  # a bias past the head is ignored
    d = DraftModelDrafter(model, model.new_cache(256), params, torch.Generator().manual_seed(0), head_vocab=HEAD_V)
    hist = PROMPT[:15]
    from sharpi_core.sampling import apply_penalties
    for _ in range(20):
        props, q = d.propose(hist, 4)
        assert q.shape == (len(props), HEAD_V) and all(0 <= t < HEAD_V for t in props)
        ended_unsure(props, q, 4)
        ctx = list(hist)
        for i, t in enumerate(props):
            want = filtered_probs(apply_penalties(model.logits_after(ctx)[:HEAD_V], ctx, params), params)
            torch.testing.assert_close(q[i], want)
            ctx.append(t)
        d.rollback(len(hist))
    greedy = DraftModelDrafter(model, model.new_cache(256), SamplingParams(temp=0), head_vocab=HEAD_V)
    props, _ = greedy.propose(hist, 3)
    ctx = list(hist)
    for t in props:
        assert t == int(argmax(model.logits_after(ctx)[:HEAD_V]))
        ctx.append(t)
    # a head as wide as the vocabulary is no cut
    assert DraftModelDrafter(model, model.new_cache(8), params, head_vocab=V).n_out is None


def test_draft_head_vocab_default():
    from sharpi_core.engine import DRAFT_HEAD_VOCAB, draft_head_vocab

    class Tok:
        def __init__(self, model_type, n_vocab):
            self.model_type, self.n_vocab = model_type, n_vocab
    assert draft_head_vocab(-1, Tok("gpt2", 151936)) == DRAFT_HEAD_VOCAB
    assert draft_head_vocab(-1, Tok("gpt2", 49152)) is None  # smaller than the cut: all
    assert draft_head_vocab(-1, Tok("llama", 262144)) is None  # SentencePiece ids are not in frequency order
    assert draft_head_vocab(0, Tok("gpt2", 151936)) is None
    assert draft_head_vocab(1000, Tok("llama", 262144)) == 1000


def test_draft_model_feeds_foreign_ids_safely():
    small = ToyModel(6, seed=1)  # the target's vocabulary is larger: ids 6, 7 are unknown to it
    d = DraftModelDrafter(small, small.new_cache(64), SamplingParams(temp=0))
    props, _ = d.propose([1, 7, 2, 6], 3)
    assert len(props) == 3 and all(0 <= t < 6 for t in props)
    assert d.history[:4] == [1, 7, 2, 6]


class _Scripted:
    """A drafter that proposes what it is told (a stand-in for lookup or a draft model in HybridDrafter)."""

    def __init__(self):
        self.next: list[int] = []
        self.cache, self.history = None, []

    def propose(self, history, k):
        return list(self.next[:k]), None

    def rollback(self, n_keep):
        pass


def test_hybrid_values_proposals_per_token():
    """HybridDrafter weighs a proposal by the tokens it is expected to bring per cost: a lookup match that can
    offer one token does not take the step from a draft model whose proposals hold, and lookup matches that keep
    proving right (text copied) take the steps from the model, which costs a pass per token."""
    from sharpi_core.speculative import HybridDrafter
    lookup, model = _Scripted(), _Scripted()
    h = HybridDrafter(lookup, model, n_max=4, cost=0.4)
    hist = list(range(100))
    model.next = [1, 2, 3, 4]
    for _ in range(6):  # the model's record: its proposals accepted, step after step
        assert h.propose(hist, 4)[0] == [1, 2, 3, 4] and h.source == "draft"
        h.rollback(len(hist) + 4)
        hist += [1, 2, 3, 4, 9]
    lookup.next = [7]  # a match at the end of the history: one token to offer
    assert h.propose(hist, 4)[0] == [1, 2, 3, 4] and h.source == "draft"
    h.rollback(len(hist))
    for _ in range(8):  # lookup's four-token matches come true at the steps the model takes, then it takes them
        lookup.next = [5, 6, 7, 8]
        props = h.propose(hist, 4)[0]
        h.rollback(len(hist) + 4 if props == [5, 6, 7, 8] else len(hist))
        hist += [5, 6, 7, 8, 0]
    assert h.source == "lookup"


def test_a_hybrid_starts_each_generation_without_the_last_ones_lookup_proposal():
    """Lookup's proposal is judged against the tokens that come after it; at a new generation (another prompt)
    those are another text's: its verdict is not taken (a spurious one before; Generator.generate calls begin)."""
    from sharpi_core.speculative import HybridDrafter
    lookup, model = _Scripted(), _Scripted()
    h = HybridDrafter(lookup, model, n_max=4, cost=0.4)
    lookup.next = [5, 6, 7]
    h.propose(list(range(50)), 4)
    assert h._shadow is not None
    before = (h._seen["lookup"].hits, h._seen["lookup"].judged)
    h.begin([9] * 80)
    lookup.next = []
    h.propose([9] * 81, 4)
    assert (h._seen["lookup"].hits, h._seen["lookup"].judged) == before


def test_verdicts_expected_tokens_and_learning():
    """Verdicts: a + a^2 + ... + a^k expected from k proposals; a step's verdict decays the record before it."""
    from sharpi_core.speculative.util import Verdicts
    v = Verdicts((0.5, 2.0), 0.25)
    assert v.acceptance == 0.5 and v.expected(1) == 0.5 and v.expected(2) == 0.75 and v.expected(3) == 0.875
    v.learn(2, 3)  # two taken, the third rejected
    assert (v.hits, v.judged) == (0.75 * 1.0 + 2, 0.75 * 2.0 + 3)
    assert Verdicts((1.0, 1.0), 0.2).expected(4) == 4.0


def test_hybrid_weighs_the_models_cost_per_proposal():
    """The same record and proposals: a cheap model's four proposals are worth more than lookup's four (its prior is
    better), an expensive model's less (each costs a forward: 0.4 of a target pass)."""
    from sharpi_core.speculative import HybridDrafter
    hist = list(range(50))
    for cost, source in ((0.1, "draft"), (0.4, "lookup")):
        lookup, model = _Scripted(), _Scripted()
        lookup.next, model.next = [5, 6, 7, 8], [1, 2, 3, 4]
        h = HybridDrafter(lookup, model, n_max=4, cost=cost)
        h.propose(hist, 4)
        assert h.source == source, cost


def test_hybrid_judges_lookups_proposal_on_the_tokens_that_decide_it():
    """Lookup's proposal at a step the model took is scored against the tokens that came: the first taken, the
    second not decided yet (one token came) is not counted as rejected."""
    from sharpi_core.speculative import HybridDrafter
    lookup, model = _Scripted(), _Scripted()
    lookup.next, model.next = [5, 6, 7, 8], [1, 2, 3, 4]
    h = HybridDrafter(lookup, model, n_max=4, cost=0.1)
    hist = list(range(50))
    h.propose(hist, 4)
    assert h.source == "draft"
    h.rollback(len(hist))  # the model's first proposal rejected: one token (5) came, lookup's first
    lookup.next = []
    h.propose(hist + [5], 4)
    seen = h._seen["lookup"]  # prior 0.4 of weight 2, decayed by 0.25, then 1 of 1
    assert seen.hits == pytest.approx(0.4 * 2 * 0.75 + 1) and seen.judged == pytest.approx(2 * 0.75 + 1)


def test_spec_stats_add_up_over_calls():
    """A chat's report at the end sums its replies' counts: per position, per source, and the totals."""
    from sharpi_core.generate import SpecStats, Timings
    a, b = SpecStats(), SpecStats()
    a.record(4, 4, "draft")
    a.record(2, 1, "lookup")
    b.record(3, 0, "draft")
    a.target_passes, b.target_passes, a.emitted, b.emitted, b.cost_off = 2, 1, 7, 1, True
    s = a + b
    assert (s.drafted, s.accepted, s.full_accepts, s.target_passes, s.emitted, s.cost_off) == (9, 5, 1, 3, 8, True)
    assert s.per_position_drafted == [3, 3, 2, 1] and s.per_position_accepted == [2, 1, 1, 1]
    assert s.sources == {"draft": {"drafted": 7, "accepted": 4, "steps": 2}, "lookup": {"drafted": 2, "accepted": 1, "steps": 1}}
    assert a.per_position_drafted == [2, 2, 1, 1] and a.sources["draft"]["steps"] == 1  # (the parts unchanged)
    t = Timings(3, 1.5, 4, 2.0) + Timings(1, 0.5, 2, 1.0)
    assert (t.prompt_n, t.prompt_ms, t.eval_n, t.eval_ms) == (4, 2.0, 6, 3.0)


def test_a_prompt_longer_than_the_draft_window_is_prefilled_from_its_tail():
    """The prompt pass evaluates what the first proposal will propose from, also when the prompt overflows the
    draft's context (its tail, the window the first proposal takes): the first proposal then feeds only the
    target's next token, so its measured cost is a proposal's, not the prompt's; its proposals are a fresh
    drafter's from the same tail (at the same positions)."""
    m = ToyModel(8, seed=22)
    greedy = SamplingParams(temp=0)
    d = DraftModelDrafter(m, m.new_cache(64), greedy, n_batch=16)
    prompt = [(5 * i + 3) % 8 for i in range(150)]
    m.batch_sizes.clear()
    d.prefill(prompt)
    assert d._base == 150 - 32 and d.history == prompt[118:] and sum(m.batch_sizes) == 32
    m.batch_sizes.clear()
    props = d.propose(prompt + [4], 3)[0]
    assert m.batch_sizes == [1, 1, 1]  # the target's token, then two proposals: no catch-up
    fresh = DraftModelDrafter(m, m.new_cache(64), greedy).propose(prompt[118:] + [4], 3)[0]
    assert list(props) == list(fresh) and len(props) == 3
    # a prompt that fits is evaluated whole, as before; a second prompt pass reuses what the cache holds
    d2 = DraftModelDrafter(m, m.new_cache(64), greedy)
    d2.prefill(prompt[:40])
    assert d2._base == 0 and d2.history == prompt[:40]
    m.batch_sizes.clear()
    d2.prefill(prompt[:40] + [1, 2])
    assert m.batch_sizes == [2] and d2.history == prompt[:40] + [1, 2]


def test_a_draft_whose_window_slid_starts_over_on_another_history():
    """A draft whose context slid past the start of a long conversation proposes from the right tokens again
    when the target's history starts anew (/clear, another prompt): as a fresh drafter would."""
    m = ToyModel(8, seed=21)
    greedy = SamplingParams(temp=0)
    d = DraftModelDrafter(m, m.new_cache(16), greedy)
    long = [(3 * i + 1) % 8 for i in range(40)]
    d.propose(long, 3)
    assert d._base > 0  # (slid)
    assert d.propose(long + [2, 5], 3)[0]  # (the same conversation goes on from the window)
    short = [1, 2, 3, 4, 5]
    props = d.propose(short, 3)[0]
    fresh = DraftModelDrafter(m, m.new_cache(16), greedy).propose(short, 3)[0]
    assert d._base == 0 and list(props) == list(fresh) and len(fresh) == 3


@pytest.mark.parametrize("cap", [4, 5, 6])
def test_a_tiny_draft_context_proposes_what_fits(cap):
    """-cd 4..6: a history of at most half the draft's context with more proposals asked than fit leaves the window
    where it is and proposes fewer (it did a shift of nothing there, an error); every step proposes at most
    what its context holds."""
    m = ToyModel(8, seed=22)
    for params in (SamplingParams(temp=0), SamplingParams(temp=0.8)):
        d = DraftModelDrafter(m, m.new_cache(cap), params, torch.Generator().manual_seed(1))
        hist = [3]
        for step in range(12):
            props, _ = d.propose(hist, 4)
            assert 1 <= len(props) < cap and d.cache.length <= cap  # (the window and its proposals fit)
            hist = hist + [int(t) for t in props[:1]] + [(step * 5 + 1) % 8]
            d.rollback(len(hist) - 1)


@pytest.mark.parametrize("n_keep,n_discard", [(4, 10), (20, 8), (0, 30)])
def test_a_slid_draft_sees_another_history_right_after_a_context_shift(n_keep, n_discard):
    """A context shift moves the target's first tokens that a slid draft's window left out as it moves the target's
    history (before or across the window's start): a new history right after it (/clear, another prompt; no proposal
    between) is seen as new, and proposed from as a fresh drafter would (it was taken for the conversation going on:
    the window's prefix was read from the new history unchecked, and a short one gave no proposals)."""
    m = ToyModel(8, seed=23)
    greedy = SamplingParams(temp=0)
    d = DraftModelDrafter(m, m.new_cache(16), greedy)
    long = [(3 * i + 1) % 8 for i in range(40)]
    d.propose(long, 3)
    b = d._base
    assert b > 0  # (slid)
    d.shift(n_keep, n_discard)
    shifted = long[:n_keep] + long[n_keep + n_discard:]
    assert d._prefix == shifted[:d._base] and d._base == (b - n_discard if n_keep + n_discard <= b else min(b, n_keep))
    short = [1, 2, 3, 4, 5]
    props = d.propose(short, 3)[0]
    fresh = DraftModelDrafter(m, m.new_cache(16), greedy).propose(short, 3)[0]
    assert d._base == 0 and list(props) == list(fresh) and len(fresh) == 3
