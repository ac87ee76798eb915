"""The generation loop on toy models: plain vs. speculative, caches, stops, seeds, env switches, and a
distribution test of whole sampled generations."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import sharpi_core.generate as generate_mod
from sharpi_core.errors import SharpiError
from sharpi_core.generate import Generator
from sharpi_core.sampling import (DEFAULT_SAMPLERS, AdaptiveP, InfillVocab, Mirostat, NoDistribution, SamplingParams,
                                  apply_penalties, argmax, draw, filtered_probs)
from sharpi_core.speculative import DraftModelDrafter, HybridDrafter, LookupDrafter
from toy import ChainToy, ToyModel, ToyTokenizer, _next_hash, chi2_sf

V = 8
GREEDY = SamplingParams(temp=0)
GREEDY_PEN = SamplingParams(temp=0, repeat_penalty=1.3, repeat_last_n=12, frequency_penalty=0.1,
                            presence_penalty=0.2, logit_bias=((2, 0.4), (5, -0.3)))
SAMPLED = SamplingParams(temp=0.9, top_k=6, top_p=0.95, min_p=0.03)
SAMPLED_PEN = SamplingParams(temp=0.9, top_k=6, top_p=0.95, min_p=0.03, repeat_penalty=1.2, repeat_last_n=16,
                             frequency_penalty=0.05, presence_penalty=0.1, logit_bias=((1, 0.3),))
# DRY (token 3 a breaker by itself, 6 7 a two-token one) with penalties; the samplers off by default in a
# non-default order, XTC's coin included (the law of each token is the mixture of its two sides)
GREEDY_DRY = SamplingParams(temp=0, dry_multiplier=0.8, dry_allowed_length=1, dry_penalty_last_n=24,
                            dry_breakers=((3, ()), (6, (7,))), repeat_penalty=1.1, logit_bias=((2, 0.4),))
SAMPLED_EXT = SamplingParams(temp=0.9, top_k=0, top_p=1.0, min_p=0.0, typical_p=0.9, top_n_sigma=2.0,
                             xtc_probability=0.3, xtc_threshold=0.2, dynatemp_range=0.3, dry_multiplier=0.5,
                             dry_allowed_length=1, dry_penalty_last_n=24, dry_breakers=((3, ()),),
                             samplers=("dry", "top_n_sigma", "xtc", "typ_p", "temperature"))
# infill between top-k and the temperature: texts where some begin others (merged into the likelier), token 6 an end
# of generation for it (it keeps only such tokens when they are likely enough), 7 what it leaves when nothing is
INFILL = SamplingParams(temp=1.2, top_k=8, top_p=1.0, min_p=0.0, samplers=("top_k", "infill", "temperature"),
                        infill=InfillVocab((b"a", b"ab", b"b", b"abc", b"c", b"ca", b"", b"d").__getitem__,
                                           frozenset({6}), 7))
# repetitive, so prompt lookup finds n-grams
PROMPT = [0, 1, 2, 3, 4, 5, 1, 2, 3, 6, 7, 2, 3, 4, 5, 0, 1, 2, 3, 4]


def target_model() -> ToyModel:
    return ToyModel(V, seed=21)


def drafter_for(kind: str, params: SamplingParams, target: ToyModel | None = None, n_ctx: int = 4096, seed: int = 9):
    g = torch.Generator().manual_seed(seed)
    if kind == "lookup":
        return LookupDrafter(3, 2)
    if kind == "lookup22":
        return LookupDrafter(2, 2)
    if kind == "hybrid":  # lookup first, the related model where lookup finds nothing
        return HybridDrafter(LookupDrafter(3, 2), drafter_for("model", params, target, n_ctx, seed), n_max=8, cost=0.3)
    if kind == "same":  # the target itself, on its own cache
        m = ToyModel(V, seed=21)
    elif kind == "wide":  # a larger vocabulary: its extra ids are sometimes proposed
        m = ToyModel(V + 2, seed=22)
        m.by_token[:, V:] += 1.0
    else:
        m = ToyModel(V, seed=22)
        if target is not None:  # related to the target, like a small model of the same family
            m.by_token = 0.6 * target.by_token + 0.5 * m.by_token
            m.by_hash = 0.6 * target.by_hash + 0.5 * m.by_hash
    d = DraftModelDrafter(m, m.new_cache(n_ctx), params, g)
    if kind == "model-sure":  # sampled proposals run to k, never ended after an unsure token: rows deep in a pass
        d.p_stop = 0.0
    return d


def make(params=GREEDY, drafter=None, n_ctx=512, eog=(), seed=1, **kw):
    model = target_model()
    tok = ToyTokenizer(V, eog=eog)
    gen = Generator(model, model.new_cache(n_ctx), tok, params, seed=seed, drafter=drafter, **kw)
    return gen, model


def ref_greedy(prompt, n, params=GREEDY) -> list[int]:
    model = target_model()
    ctx, out = list(prompt), []
    for _ in range(n):
        t = int(argmax(apply_penalties(model.logits_after(ctx), ctx, params)))
        out.append(t)
        ctx.append(t)
    return out


# -- greedy: exact ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_ctx", [512, 40], ids=["room", "tight"])  # tight: look-aheads that do not fit
def test_greedy_chains_and_the_draft_look_ahead_keep_the_plain_output(n_ctx):
    # a target and draft with the GPU model's greedy interface (device arg-max, chains, a look-ahead
    # queued while the target verifies): the output is the plain greedy one, and the look-ahead changes
    # neither the proposals nor the verdicts (a stale draft cache would change the toy's logits)
    params = SamplingParams(temp=0, logit_bias=((3, -0.5),))
    want = ref_greedy(PROMPT, 18, params)
    runs = []
    for lookahead in (True, False):
        target = ChainToy(V, seed=21)
        d = ChainToy(V, seed=22)
        d.by_token = 0.6 * target.by_token + 0.5 * d.by_token
        d.by_hash = 0.6 * target.by_hash + 0.5 * d.by_hash
        drafter = DraftModelDrafter(d, d.new_cache(n_ctx), params, head_vocab=V - 1)
        drafter.lookahead = lookahead
        gen = Generator(target, target.new_cache(n_ctx), ToyTokenizer(V), params, drafter=drafter, spec_n_max=3)
        assert gen.device_argmax and drafter.chain
        res = gen.generate(PROMPT, n_predict=18)
        assert res.tokens == want[:len(res.tokens)] and len(res.tokens) == min(18, n_ctx - len(PROMPT) - 1)
        st = res.spec
        runs.append((st.drafted, st.accepted, st.per_position_accepted, st.full_accepts))
        assert 0 < st.accepted < st.drafted
        # the drafter's record matches its cache (a queued chain's rows lie past it)
        assert drafter.cache.content[:len(drafter.history)] == drafter.history
        assert (drafter.lookahead_hits > 0) == lookahead
        # a second prompt on the same drafter: whatever it had queued is dropped, nothing stale is used
        res2 = gen.generate(PROMPT[:12], n_predict=6)
        assert res2.tokens == ref_greedy(PROMPT[:12], 6, params)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("params", [GREEDY, GREEDY_PEN, GREEDY_DRY], ids=["plain", "penalties", "dry"])
def test_plain_greedy_matches_cache_free_reference(params):
    gen, model = make(params)
    res = gen.generate(PROMPT, n_predict=50)
    assert res.tokens == ref_greedy(PROMPT, 50, params)
    assert res.stop_reason == "n_predict" and res.spec is None
    assert res.text == "".join(chr(97 + t) for t in res.tokens)
    assert model.batch_sizes == [len(PROMPT)] + [1] * 49  # prefill, then one forward per token


@pytest.mark.parametrize("kind", ["lookup", "lookup22", "model", "same", "wide", "hybrid"])
@pytest.mark.parametrize("n_max", [1, 3, 8])
@pytest.mark.parametrize("params", [GREEDY, GREEDY_PEN, GREEDY_DRY], ids=["plain", "penalties", "dry"])
def test_greedy_speculative_equals_plain_greedy(kind, n_max, params):
    want = ref_greedy(PROMPT, 80, params)
    gen, model = make(params, drafter_for(kind, params), spec_n_max=n_max)
    res = gen.generate(PROMPT, n_predict=80)
    assert res.tokens == want
    s = res.spec
    assert s is not None and s.drafted > 0 and s.verify_passes > 0
    assert s.emitted >= 79 and s.target_passes == model.n_forward - 1  # the first token comes from the prompt pass
    if kind == "same":  # draft == target at temp 0: every proposal is accepted
        assert s.accepted == s.drafted and s.steps_no_proposal == 0
        assert s.tokens_per_pass > min(n_max, 3)
    if kind == "hybrid":  # both sources proposed; the stats per source add up
        assert set(s.sources) == {"lookup", "draft"} and all(v["steps"] > 0 for v in s.sources.values())
        assert sum(v["drafted"] for v in s.sources.values()) == s.drafted
        assert sum(v["accepted"] for v in s.sources.values()) == s.accepted
        assert s.steps_no_proposal == 0


def test_verify_is_one_forward_over_certain_token_and_drafts():
    gen, model = make(GREEDY, drafter_for("same", GREEDY), spec_n_max=4)
    res = gen.generate(PROMPT, n_predict=41)
    assert res.tokens == ref_greedy(PROMPT, 41)
    # prefill; then [t, d1..d4] per step, each fully accepted (5 tokens per pass); the last step is
    # clamped so that it cannot overshoot n_predict
    assert model.batch_sizes[0] == len(PROMPT)
    assert model.batch_sizes[1:] == [5] * 8
    assert gen.history == PROMPT + res.tokens[:-1]  # the last token is emitted, not yet cached
    assert model.n_forward == 9


def test_drafter_cache_follows_target():
    params = GREEDY
    d = drafter_for("model", params)
    gen, _ = make(params, d, spec_n_max=4)
    gen.generate(PROMPT, n_predict=30)
    # whatever the draft holds is a prefix of what the target holds plus pending tokens
    assert d.cache.content == d.history
    full = gen.history
    assert d.history[: len(full)] == full[: len(d.history)]


# -- env switches, seeds ----------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [GREEDY_PEN, SAMPLED_PEN], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["lookup", "model"])
def test_unbatched_verify_gives_identical_output(monkeypatch, params, kind):
    gen, _ = make(params, drafter_for(kind, params), spec_n_max=4, seed=5)
    batched = gen.generate(PROMPT, n_predict=60).tokens
    monkeypatch.setenv("SHARPI_SPEC_BATCH_VERIFY", "0")
    gen, model = make(params, drafter_for(kind, params), spec_n_max=4, seed=5)
    res = gen.generate(PROMPT, n_predict=60)
    assert res.tokens == batched
    assert set(model.batch_sizes[1:]) == {1}
    assert res.spec.verify_passes > 0


@pytest.mark.parametrize("kind", ["lookup", "model", "wide"])
def test_same_seed_same_output(kind):
    runs = []
    for seed in (3, 3, 4):
        gen, _ = make(SAMPLED_PEN, drafter_for(kind, SAMPLED_PEN, seed=seed + 100), spec_n_max=4, seed=seed)
        runs.append(gen.generate(PROMPT, n_predict=60).tokens)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_spec_sample_switch(monkeypatch):
    monkeypatch.setenv("SHARPI_SPEC_SAMPLE", "0")
    gen, model = make(SAMPLED, drafter_for("model", SAMPLED), seed=8)
    assert gen.notes and "SHARPI_SPEC_SAMPLE=0" in gen.notes[0]
    res = gen.generate(PROMPT, n_predict=40)
    assert res.spec is None
    plain, _ = make(SAMPLED, None, seed=8)
    assert res.tokens == plain.generate(PROMPT, n_predict=40).tokens
    # greedy speculation is not affected
    gen, _ = make(GREEDY, drafter_for("model", GREEDY))
    assert not gen.notes and gen.generate(PROMPT, n_predict=10).spec is not None


# -- stops ----------------------------------------------------------------------------------------------
def test_stop_token_inside_an_accepted_run_ends_there():
    chain = ref_greedy(PROMPT, 60)
    # an end-of-generation token first appearing deep in the chain: with draft == target and 8
    # drafts per pass, it sits inside an accepted run, followed by more accepted tokens
    j = next(i for i in range(3, 60) if chain[i] not in chain[:i] and i % 9 not in (0, 8))
    stop = chain[j]
    printed = []
    gen, _ = make(GREEDY, drafter_for("same", GREEDY), eog=(stop,), spec_n_max=8)
    res = gen.generate(PROMPT, n_predict=60, on_text=printed.append)
    assert res.stop_reason == "eos"
    assert res.tokens == chain[:j]
    assert "".join(printed) == res.text == "".join(chr(97 + t) for t in chain[:j])
    assert res.spec.accepted == res.spec.drafted  # the stop token was an accepted draft
    plain, _ = make(GREEDY, None, eog=(stop,))
    assert plain.generate(PROMPT, n_predict=60).tokens == res.tokens


def test_stop_string_and_n_predict_inside_an_accepted_run():
    chain = ref_greedy(PROMPT, 60)
    text = "".join(chr(97 + t) for t in chain)
    stop = text[10:13]
    end = text.index(stop) + len(stop)
    printed = []
    gen, _ = make(GREEDY, drafter_for("same", GREEDY), spec_n_max=8)
    res = gen.generate(PROMPT, n_predict=60, stop_strings=["zz", stop], on_text=printed.append)
    assert res.stop_reason == "stop_string"
    assert res.text == "".join(printed) == text[:end] and res.tokens == chain[:end]  # includes the stop string
    for n in (1, 2, 5, 9, 10, 17):
        gen, _ = make(GREEDY, drafter_for("same", GREEDY), spec_n_max=8)
        res = gen.generate(PROMPT, n_predict=n)
        assert res.tokens == chain[:n] and res.stop_reason == "n_predict"
    gen, model = make(GREEDY, drafter_for("same", GREEDY))
    assert gen.generate(PROMPT, n_predict=0).tokens == [] and model.n_forward == 1


@pytest.mark.parametrize("kind", [None, "lookup", "same", "model"])
def test_context_full(kind):
    n_ctx = len(PROMPT) + 15
    gen, model = make(GREEDY, drafter_for(kind, GREEDY) if kind else None, n_ctx=n_ctx, spec_n_max=8)
    res = gen.generate(PROMPT, n_predict=-1)
    assert res.stop_reason == "ctx_full"
    # like llama.cpp: the last slot stays free
    assert res.tokens == ref_greedy(PROMPT, n_ctx - len(PROMPT))
    assert gen.cache.length <= n_ctx - 1


def test_interrupt():
    calls = []

    def stop():
        calls.append(1)
        return len(calls) >= 3
    gen, _ = make(GREEDY, drafter_for("same", GREEDY), spec_n_max=8)
    res = gen.generate(PROMPT, n_predict=50, should_stop=stop)
    # asked once before the prompt's one batch, then after each token
    assert res.stop_reason == "interrupted" and len(res.tokens) == 2


@pytest.mark.parametrize("kind", [None, "model"])
def test_an_interrupt_during_the_prompt_stops_between_its_batches(kind):
    """Ctrl-C while a long prompt is evaluated stops at the next batch, not after the whole prompt and a token;
    the batches evaluated stay in the cache, and the next generation from the same prompt reuses them."""
    calls = []

    def stop():
        calls.append(1)
        return len(calls) == 3
    gen, model = make(GREEDY, drafter_for(kind, GREEDY, target_model()) if kind else None, n_batch=7)
    res = gen.generate(PROMPT, n_predict=5, should_stop=stop)
    assert res.stop_reason == "interrupted" and res.tokens == [] and res.text == ""
    assert model.batch_sizes == [7, 7] and gen.history == PROMPT[:14] and gen.cache.length == 14
    assert res.timings.prompt_n == 14 and gen.unevaluated == PROMPT[14:]  # (-i puts them before the next input)
    res = gen.generate(PROMPT, n_predict=5)
    assert model.batch_sizes[2] == 6 and res.timings.prompt_n == 6  # (then one-token or verify passes)
    assert res.tokens == ref_greedy(PROMPT, 5)
    # a generation that resumes after the history (llama-completion's -i) stops there too
    calls.clear()
    res = gen.generate(PROMPT[:9], n_predict=5, should_stop=lambda: calls.append(1) or len(calls) == 2, resume=True)
    assert res.stop_reason == "interrupted" and res.tokens == [] and len(gen.history) == len(PROMPT) + 4 + 7
    assert gen.unevaluated == PROMPT[7:9]
    # resumed from the rest, it is the generation of them all (greedy, no penalties: the samplers' start is moot)
    whole = gen.history + gen.unevaluated
    res = gen.generate(gen.unevaluated, n_predict=5, resume=True)
    assert res.tokens == ref_greedy(whole, 5) and gen.unevaluated == []


@pytest.mark.parametrize("kind", [None, "lookup", "model"])
def test_nan_logits_are_an_error_in_greedy_decoding_too(kind):
    """A target row with a NaN (a model whose arithmetic broke down) has no most likely token: one SharpiError at
    the first such row, plain steps and verify passes alike, not the first NaN's id as a token."""
    from sharpi_core.sampling import NoDistribution
    gen, model = make(GREEDY, drafter_for(kind, GREEDY, target_model()) if kind else None, spec_n_max=4)
    model.by_pos[(len(PROMPT) + 2) % model.period, 5] = float("nan")  # (two tokens in: the rows there on)
    with pytest.raises(NoDistribution):
        gen.generate(PROMPT, n_predict=20)
    assert len(gen.history) >= len(PROMPT)


def test_bad_prompts():
    gen, _ = make(GREEDY, n_ctx=16)
    with pytest.raises(SharpiError):
        gen.generate([], n_predict=3)
    with pytest.raises(SharpiError):
        gen.generate(list(range(8)) * 3, n_predict=3)


# -- multi-turn: prefix reuse -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [None, "lookup", "model"])
def test_prompt_prefix_is_reused(kind):
    gen, model = make(GREEDY_PEN, drafter_for(kind, GREEDY_PEN) if kind else None, spec_n_max=4)
    r1 = gen.generate(PROMPT, n_predict=12)
    assert r1.timings.prompt_n == len(PROMPT)
    turn2 = PROMPT + r1.tokens + [3, 1, 4, 1, 5]
    r2 = gen.generate(turn2, n_predict=12)
    # the cache held PROMPT + all but the last generated token
    assert r2.timings.prompt_n == len(turn2) - (len(PROMPT) + len(r1.tokens) - 1)
    fresh, _ = make(GREEDY_PEN, drafter_for(kind, GREEDY_PEN) if kind else None, spec_n_max=4)
    assert r2.tokens == fresh.generate(turn2, n_predict=12).tokens
    # the same prompt again: only its last token is re-evaluated
    r3 = gen.generate(turn2, n_predict=12)
    assert r3.timings.prompt_n == 1 and r3.tokens == r2.tokens
    # an edited conversation: the common prefix is kept
    turn3 = PROMPT[:10] + [5, 5, 5]
    r4 = gen.generate(turn3, n_predict=12)
    assert r4.timings.prompt_n == 3
    fresh, _ = make(GREEDY_PEN, drafter_for(kind, GREEDY_PEN) if kind else None, spec_n_max=4)
    assert r4.tokens == fresh.generate(turn3, n_predict=12).tokens


def test_spec_n_min_drops_short_proposals():
    gen, model = make(GREEDY, drafter_for("lookup", GREEDY), spec_n_max=6, spec_n_min=3)
    res = gen.generate(PROMPT, n_predict=80)
    assert res.tokens == ref_greedy(PROMPT, 80)
    s = res.spec
    assert s.verify_passes > 0 and s.steps_no_proposal > 0
    assert s.per_position_drafted[0] == s.per_position_drafted[2]  # no pass verified fewer than 3
    assert all(b >= 4 or b == 1 for b in model.batch_sizes[1:])


def test_spec_p_min_accepts_more():
    rates = []
    for p_min in (0.0, 0.05):
        gen, _ = make(SAMPLED, drafter_for("model", SAMPLED, target_model()), spec_n_max=4, spec_p_min=p_min, seed=2)
        rates.append(gen.generate(PROMPT, n_predict=400).spec.acceptance)
    assert rates[1] > rates[0]


def test_prefill_chunks_of_n_batch():
    gen, model = make(GREEDY, n_batch=7)
    gen.generate(PROMPT, n_predict=2)
    assert model.batch_sizes == [7, 7, 6, 1]


def test_stats_and_timings():
    gen, _ = make(SAMPLED, drafter_for("model", SAMPLED), spec_n_max=4)
    res = gen.generate(PROMPT, n_predict=60)
    t, s = res.timings, res.spec
    assert t.prompt_n == len(PROMPT) and t.eval_n == 60 and t.prompt_ms > 0 and t.eval_ms > 0
    assert t.eval_tps > 0 and t.prompt_tps > 0
    d = s.as_dict()
    for key in ("drafted", "accepted", "acceptance", "target_passes", "tokens_per_pass", "per_position_acceptance",
                "per_position_drafted", "per_position_accepted", "steps_no_proposal", "draft_ms", "verify_ms",
                "commit_ms"):
        assert key in d
    assert d["drafted"] == sum(d["per_position_drafted"]) and d["accepted"] == sum(d["per_position_accepted"])
    assert 0 < d["full_accepts"] <= d["verify_passes"]
    assert 0 <= d["acceptance"] <= 1 and d["tokens_per_pass"] >= 1
    assert s.emitted >= 59  # the first token comes from the prompt pass


# -- distribution of whole sampled generations ------------------------------------------------------------
def martingale_pvalue(params: SamplingParams, prompt: list[int], tokens: list[int], min_expected=5.0) -> float:
    """Goodness of fit of a generated sequence to the target's conditionals p_t(. | history).

    Whatever the decoding method, if the sequence is an exact sample of the target model, then per
    stratum s (here: the previous token) the counts N_s of each next token minus their predicted
    sums E_s = sum_t p_t form a martingale with covariance C_s = sum_t diag(p_t) - p_t p_t^T, and
    sum_s (N_s - E_s)^T C_s^+ (N_s - E_s) is asymptotically chi-square with sum_s rank(C_s) degrees
    of freedom. Tokens with small expected counts are pooled per stratum."""
    model = target_model()
    tok, pos, h = model.state_after(prompt)
    ctx, steps = list(prompt), []
    for t in tokens:
        p = filtered_probs(apply_penalties(model._row(tok, pos, h), ctx, params), params).numpy().astype(np.float64)
        steps.append((ctx[-1], t, p))
        ctx.append(t)
        tok, pos, h = t, pos + 1, _next_hash(h, t)
    return martingale_test(steps, min_expected)


def martingale_test(steps, min_expected=5.0) -> float:
    """martingale_pvalue's statistic for (stratum, token drawn, its law p [V]) per step."""
    N = np.zeros((V, V))
    E = np.zeros((V, V))
    C = np.zeros((V, V, V))
    for s, t, p in steps:
        N[s, t] += 1
        E[s] += p
        C[s] += np.diag(p) - np.outer(p, p)
    stat, df = 0.0, 0
    for s in range(V):
        if E[s].sum() < min_expected:
            continue
        big = E[s] >= min_expected
        G = np.vstack([np.eye(V)[big], (~big).astype(float)[None]]) if (~big).any() else np.eye(V)[big]
        d = G @ (N[s] - E[s])
        w, U = np.linalg.eigh(G @ C[s] @ G.T)
        keep = w > 1e-9 * w.max()
        stat += float(((U[:, keep].T @ d) ** 2 / w[keep]).sum())
        df += int(keep.sum())
    return chi2_sf(stat, df)


def long_run(kind, params, n, n_max, seed):
    gen, _ = make(params, drafter_for(kind, params, target_model(), n_ctx=n + 64, seed=seed + 1),
                  n_ctx=n + 64, spec_n_max=n_max, seed=seed)
    res = gen.generate(PROMPT, n_predict=n)
    assert len(res.tokens) == n
    return res


N_LONG = 3000


@pytest.mark.parametrize("kind,params,n_max", [("model", SAMPLED_PEN, 4), ("lookup", SAMPLED_PEN, 3),
                                               ("wide", SAMPLED, 3), ("model", SAMPLED, 8), ("model-sure", SAMPLED, 8),
                                               ("model", SAMPLED_EXT, 4), ("lookup", SAMPLED_EXT, 3),
                                               ("hybrid", SAMPLED_PEN, 4), ("model", INFILL, 4), ("lookup", INFILL, 3)],
                         ids=["model-penalties-k4", "lookup-penalties-k3", "wide-vocab-k3", "model-k8",
                              "model-k8-never-unsure", "model-dry-xtc-typical-k4", "lookup-dry-xtc-typical-k3",
                              "hybrid-penalties-k4", "model-infill-k4", "lookup-infill-k3"])
def test_sampled_generation_follows_the_target(kind, params, n_max):
    res = long_run(kind, params, N_LONG, n_max, seed=31)
    s = res.spec
    assert s.verify_passes > N_LONG // 10 and 0 < s.accepted < s.drafted  # speculation really happened
    assert martingale_pvalue(params, PROMPT, res.tokens) > 0.001


@pytest.mark.parametrize("params", [SAMPLED_PEN, SAMPLED_EXT], ids=["penalties", "dry-xtc-typical"])
def test_plain_sampled_generation_follows_the_target(params):
    gen, _ = make(params, None, n_ctx=N_LONG + 64, seed=32)
    assert martingale_pvalue(params, PROMPT, gen.generate(PROMPT, n_predict=N_LONG).tokens) > 0.001


@pytest.mark.parametrize("kind", ["model", "lookup"])
def test_wrong_acceptance_fails_the_generation_test(monkeypatch, kind):
    def always_accept(draft, q, p, g, p_min=0.0):
        return len(draft), draw(p[len(draft)], g)
    monkeypatch.setattr(generate_mod, "accept_sampled", always_accept)
    res = long_run(kind, SAMPLED_PEN, 2000, 4, seed=33)
    assert martingale_pvalue(SAMPLED_PEN, PROMPT, res.tokens) < 1e-6


def test_thread_governor_is_stepped_per_prompt_batch_and_decoding_step():
    class Count:
        n = 0

        def step(self):
            self.n += 1

    c = Count()
    g = Generator(target_model(), target_model().new_cache(64), ToyTokenizer(V), GREEDY, n_batch=4, threads=c)
    g.generate(PROMPT, 0)
    assert c.n == 5  # 20 prompt tokens in batches of 4
    g.generate(PROMPT, 6)  # the prompt is cached now: its last token again (for logits), 5 decoding steps
    assert c.n == 5 + 1 + 5


MIROSTAT = [SamplingParams(temp=0.9, mirostat=2, mirostat_tau=1.5, mirostat_eta=1.0, logit_bias=((1, 0.3),)),
            SamplingParams(temp=0.9, mirostat=1, mirostat_tau=1.5, mirostat_eta=1.0)]
# adaptive-p: its target moves with each pick (decay 0.3: mostly the last one), so a wrong state shows;
# after penalties (their history per verify row) and the default chain with its filters
ADAPTIVE = [SamplingParams(temp=0.9, top_k=0, top_p=1.0, min_p=0.0, samplers=DEFAULT_SAMPLERS + ("adaptive_p",),
                           adaptive_target=0.3, adaptive_decay=0.3),
            SamplingParams(temp=0.9, top_k=6, top_p=0.95, min_p=0.03, repeat_penalty=1.2, repeat_last_n=16,
                           presence_penalty=0.1, samplers=("adaptive_p",) + DEFAULT_SAMPLERS,
                           adaptive_target=0.15, adaptive_decay=0.5)]


def new_picker(params: SamplingParams):
    if params.mirostat:
        return Mirostat(params.mirostat, params.mirostat_tau, params.mirostat_eta, V)
    return AdaptiveP(params.adaptive_target, params.adaptive_decay)


def mirostat_pvalue(params: SamplingParams, tokens: list[int]) -> float:
    """martingale_pvalue for a picker (mirostat, adaptive-p without XTC), whose law at each step comes
    from its state, which follows the tokens before it (recomputed here along the sequence, as plain
    decoding moves it)."""
    model = target_model()
    tok, pos, h = model.state_after(PROMPT)
    m = new_picker(params)
    ctx, steps = list(PROMPT), []
    for t in tokens:
        x = apply_penalties(model._row(tok, pos, h), ctx, params).numpy()
        idx, pr, sides = m.law(x, params)
        assert len(sides) == 1
        p = np.zeros(V)
        p[idx] = pr
        if not p[t] > 0:
            return 0.0  # a token the law cannot draw
        steps.append((ctx[-1], t, p / p.sum()))
        m.state = m.next_state(m.state, sides, t, None)
        ctx.append(t)
        tok, pos, h = t, pos + 1, _next_hash(h, t)
    return martingale_test(steps)


@pytest.mark.parametrize("kind,n_max", [("model", 4), ("model-sure", 4), ("lookup", 3), ("wide", 3)])
@pytest.mark.parametrize("params", MIROSTAT + ADAPTIVE, ids=["v2", "v1", "adaptive", "adaptive-penalties"])
def test_sampled_mirostat_speculation_follows_the_target(kind, n_max, params):
    """Speculating with mirostat: each verify row's law in the state its drafts lead to, the state moved
    past what is accepted. The sequence is a sample of plain mirostat decoding (its tau is low enough here
    that the state cuts the toy's candidates, so a wrong state would show)."""
    res = long_run(kind, params, N_LONG, n_max, seed=41)
    s = res.spec
    assert s.verify_passes > N_LONG // 10 and 0 < s.accepted < s.drafted
    assert mirostat_pvalue(params, res.tokens) > 0.001


@pytest.mark.parametrize("params", MIROSTAT + ADAPTIVE, ids=["v2", "v1", "adaptive", "adaptive-penalties"])
def test_plain_mirostat_follows_the_target_and_a_frozen_state_does_not(monkeypatch, params):
    gen, _ = make(params, None, n_ctx=N_LONG + 64, seed=42)
    assert mirostat_pvalue(params, gen.generate(PROMPT, n_predict=N_LONG).tokens) > 0.001
    if params is ADAPTIVE[1]:
        return  # (its drafts are rarely accepted past the first, whose row has the right state anyway)
    # the test sees the state: speculation whose verify rows all take the state before the drafts fails it
    def stale_rows(self, x, params, drafts, generator):
        p, sides = np.zeros(x.shape, dtype=np.float32), []
        for i in range(x.shape[0]):
            idx, pr, sd = self.law(x[i], params)
            p[i, idx] = pr
            sides.append(sd)
            if i < len(drafts) and not p[i, drafts[i]] > 0:
                return p[: i + 1], [self.state] * (i + 1), sides, False
        return p, [self.state] * x.shape[0], sides, False
    monkeypatch.setattr(type(gen.picker), "rows", stale_rows)
    res = long_run("model-sure", params, N_LONG, 4, seed=43)  # (the stale state shows in rows past the first)
    monkeypatch.undo()
    assert mirostat_pvalue(params, res.tokens) < 1e-6


# XTC before adaptive-p: which side of XTC's coin a token came from moves adaptive-p's state differently,
# and the coin is not seen, so the law of a sequence is a sum over coins (no martingale test): here whole
# sequences of 3 tokens against that sum
XTC_ADAPTIVE = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, xtc_probability=0.5, xtc_threshold=0.12,
                              samplers=DEFAULT_SAMPLERS + ("adaptive_p",), adaptive_target=0.5, adaptive_decay=0.0)


def sequence_law(params: SamplingParams, n: int) -> dict[tuple, float]:
    """The probability of each sequence of n tokens plain decoding draws after PROMPT, summed over the
    picker's sides (XTC's coin)."""
    model, m, law = target_model(), new_picker(params), {}

    def walk(ctx, tok, pos, h, state, prob):
        if len(ctx) == len(PROMPT) + n:
            law[tuple(ctx[len(PROMPT):])] = law.get(tuple(ctx[len(PROMPT):]), 0.0) + prob
            return
        x = apply_penalties(model._row(tok, pos, h), ctx, params).numpy()
        for w, idx, q, u in m.sides(x, params, state):
            for j, t in enumerate(idx.tolist()):
                walk(ctx + [t], t, pos + 1, _next_hash(h, t), m.after(state, u[j]), prob * w * float(q[j]))
    walk(list(PROMPT), *model.state_after(PROMPT), m.initial(), 1.0)
    return law


def sequences_pvalue(params: SamplingParams, kind: str, runs: int, seed: int) -> float:
    """Chi-square of `runs` generations of 3 tokens (speculating with `kind`) against sequence_law."""
    law = sequence_law(params, 3)
    gen, _ = make(params, drafter_for(kind, params, target_model(), n_ctx=64, seed=seed + 1), n_ctx=64,
                  spec_n_max=3, seed=seed)
    seen: dict[tuple, int] = {}
    for _ in range(runs):
        t = tuple(gen.generate(PROMPT, n_predict=3).tokens)
        assert t in law
        seen[t] = seen.get(t, 0) + 1
    big = [c for c, p in law.items() if p * runs >= 5]
    e = np.array([law[c] * runs for c in big] + [runs * (1 - sum(law[c] for c in big))])
    o = np.array([seen.get(c, 0) for c in big] + [runs - sum(seen.get(c, 0) for c in big)])
    return chi2_sf(float(((o - e) ** 2 / e).sum()), len(e) - 1)


def test_xtc_then_adaptive_p_speculation_is_exact_and_a_coin_ignoring_the_token_is_not(monkeypatch):
    assert sequences_pvalue(XTC_ADAPTIVE, "model", 3000, seed=51) > 0.001

    def prior_side(self, state, sides, token, generator):  # the coin's side without looking at the token
        side = sides[draw([w for w, *_ in sides], generator)]
        if not (side[1] == token).any():
            side = sides[0] if side is sides[1] else sides[1]
        return self.after(state, side[3][int(np.flatnonzero(side[1] == token)[0])])
    monkeypatch.setattr(AdaptiveP, "next_state", prior_side)
    assert sequences_pvalue(XTC_ADAPTIVE, "model", 3000, seed=52) < 1e-6


def test_mirostat_at_temp_0_is_greedy_and_speculates():
    g = SamplingParams(temp=0, mirostat=2)
    spec, _ = make(g, drafter_for("lookup", g), n_ctx=256, spec_n_max=4)
    assert spec.picker is None and spec.speculate
    assert spec.generate(PROMPT, n_predict=30).tokens == ref_greedy(PROMPT, 30)


def test_mirostat_state_starts_over_at_each_generation():
    # as llama.cpp's interactive mode resets its samplers at each user input (a chat turn here)
    p = MIROSTAT[0]
    gen, _ = make(p, None, n_ctx=256, seed=5)
    gen.generate(PROMPT, n_predict=40)
    assert gen.picker.mu != np.float32(2 * p.mirostat_tau)
    gen.generate(PROMPT, n_predict=0)
    assert gen.picker.mu == np.float32(2 * p.mirostat_tau)


def test_mirostat_with_a_plus_inf_bias_draws_that_token():
    for version in (1, 2):
        m = Mirostat(version, 5.0, 0.1, V)
        x = np.linspace(-1, 1, V).astype(np.float32)
        x[3] = np.inf
        idx, p = m.candidates(x, 0.8)
        assert idx.tolist() == [3] and p.tolist() == [1.0]
        _, _, sides = m.law(x, SamplingParams(temp=0.8, mirostat=version))
        m.state = m.next_state(m.state, sides, 3, None)
        assert np.isfinite(m.mu)


# -- resumed generation (-i: llama-completion's interactive mode) ----------------------------------------
@pytest.mark.parametrize("kind", [None, "same", "lookup"])
def test_a_stop_inside_accepted_drafts_leaves_the_history_at_the_output(kind):
    """A verify pass accepts several drafts and the output stops at one of them (a one-token reverse
    prompt here): the cache keeps the output up to the pending token, not the drafts after it, so a
    resumed generation goes on from the output itself."""
    ref = ref_greedy(PROMPT, 24)
    stop = ref[5]
    i = ref.index(stop)  # (where it first comes)
    gen, model = make(drafter=drafter_for(kind, GREEDY) if kind else None, spec_n_max=6)
    res = gen.generate(PROMPT, n_predict=24, stop_tokens={stop})
    assert res.tokens == ref[:i + 1] and res.stop_reason == "stop_string"
    assert gen.history == PROMPT + ref[:i] and gen.cache.length == len(gen.history)
    assert gen.feed([res.tokens[-1]])
    res2 = gen.generate([], n_predict=6, resume=True)
    assert res2.tokens == ref[i + 1:i + 7]


def test_an_end_of_generation_among_accepted_drafts_leaves_the_constraint_where_a_plain_step_does():
    """A reasoning budget counts every token in its block, an end of generation too: a plain step's sampling
    advances the state past the token it draws. A stop on an accepted end-of-generation draft left the state a
    token behind (the budget one token larger), and the resumed generation went another way (eog 0, 1, 5, 6)."""
    from sharpi_core.reasoning import ReasoningBudget  # noqa: PLC0415
    drafted = 0
    for eog in range(V):
        runs = []
        for drafter in (None, drafter_for("same", GREEDY)):
            gen, _ = make(GREEDY, drafter, eog=(eog,), spec_n_max=4,
                          grammar=ReasoningBudget([3], [[5]], [1, 2, 5], 6))
            r = gen.generate(PROMPT, n_predict=60)
            state = gen.gstate
            runs.append((r.tokens, r.stop_reason, state, gen.generate([0, 1, 3], resume=True, n_predict=12).tokens))
        drafted += r.spec.accepted > 0
        assert runs[0][1] == "eos" and runs[0] == runs[1], eog
    assert drafted >= 4


class _NanAfter7(ToyModel):
    """A target whose rows after token 7 are NaN (its arithmetic breaks down there)."""

    def forward(self, tokens, *a, **kw):
        out = super().forward(tokens, *a, **kw).clone()
        fed = torch.as_tensor(tokens).reshape(-1).tolist()[-out.shape[0]:]
        out[[i for i, t in enumerate(fed) if t == 7]] = float("nan")
        return out


class _NanDraft(ToyModel):
    def forward(self, *a, **kw):
        return torch.full_like(super().forward(*a, **kw), float("nan"))


class _Proposes7:
    """A drafter proposing a token the logit bias bans (as prompt lookup may: it reads the history, not the bias)."""

    def propose(self, history, k):
        return [7, 1][:k], None

    def rollback(self, n_keep):
        pass


@pytest.mark.parametrize("params", [SamplingParams(temp=0, logit_bias=((7, float("-inf")),)),
                                    SamplingParams(temp=0.9, logit_bias=((7, float("-inf")),))],
                         ids=["greedy", "sampled"])
def test_broken_rows_plain_decoding_never_computes_are_not_an_error(params):
    """Verify rows after a rejected draft, and a draft model's own rows, are rows plain decoding never
    computes: a NaN there (a draft whose arithmetic broke down, a target row after a banned token) costs the
    proposals, not the generation (a NoDistribution error before)."""
    def gen(model, drafter):
        return Generator(model, model.new_cache(256), ToyTokenizer(V), params, seed=1, drafter=drafter, spec_n_max=4)
    plain = gen(_NanAfter7(V, seed=21), None).generate(PROMPT, n_predict=30)
    res = gen(_NanAfter7(V, seed=21), _Proposes7()).generate(PROMPT, n_predict=30)
    assert res.stop_reason == plain.stop_reason == "n_predict" and res.spec.drafted > 0
    if params.greedy:
        assert res.tokens == plain.tokens
    d = _NanDraft(V, seed=22)
    res = gen(target_model(), DraftModelDrafter(d, d.new_cache(256), params, torch.Generator().manual_seed(2))).generate(
        PROMPT, n_predict=30)
    assert len(res.tokens) == 30


@pytest.mark.parametrize("picker", [dict(mirostat=2), dict(mirostat=1),
                                    dict(adaptive_target=0.4, samplers=("adaptive_p",))],
                         ids=["mirostat2", "mirostat1", "adaptive-p"])
def test_a_pickers_broken_row_past_a_rejection_is_not_an_error(picker):
    """Mirostat's and adaptive-p's verify rows: a NaN row after draft d0 is met by plain decoding only when it
    draws d0, so the pass raises NoDistribution exactly as often as d0 is accepted (always, before: the picker
    computed every row's law first)."""
    rows = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    rows[1] = float("nan")
    params = SamplingParams(temp=1.0, **picker)
    gen, _ = make(params)
    pn = gen.picker.rows(rows[:1].numpy(), params, [], None)[0]
    d0 = int(np.argsort(pn[0])[-2])  # a likely draft that is not certain
    raised, n_runs = 0, 400
    for seed in range(n_runs):
        gen, _ = make(params, seed=seed)
        try:
            n, nxt = gen._accept_sampled([d0, 1], None, rows)
            assert n == 0 and pn[0, nxt] > 0 and nxt != d0
        except NoDistribution:
            raised += 1
    assert abs(raised / n_runs - pn[0, d0]) < 4 * (pn[0, d0] * (1 - pn[0, d0]) / n_runs) ** 0.5, (raised, pn[0, d0])
    with pytest.raises(NoDistribution):  # a broken first row is plain decoding's too
        gen._accept_sampled([d0], None, torch.full((2, V), float("nan")))


def test_a_lookup_match_shorter_than_n_min_leaves_the_step_to_the_draft_model():
    """-md with lookup (the default) and --spec-draft-n-min 4: a 3-token lookup match that outscored the model was
    handed back, dropped as too short, and the model never asked (167 target passes against 23 without lookup)."""
    runs = {}
    for kind in ("model", "hybrid"):
        d = drafter_for("same", GREEDY)
        if kind == "hybrid":
            d = HybridDrafter(LookupDrafter(3, 2), d, n_max=8, n_min=4, cost=0.3)
        gen, _ = make(GREEDY, d, spec_n_max=8, spec_n_min=4, n_ctx=1024)
        runs[kind] = gen.generate(PROMPT, n_predict=200)
        assert runs[kind].tokens == ref_greedy(PROMPT, 200)
    assert runs["hybrid"].spec.target_passes <= runs["model"].spec.target_passes + 5
    assert runs["hybrid"].spec.steps_no_proposal <= 2


def test_no_room_for_n_min_proposals_is_a_plain_step_without_drafting():
    """Near the end of -n (or of the context) the room for proposals can fall below --spec-draft-n-min: the
    draft was still asked, and its proposals dropped."""
    asked = []

    class Recorder(DraftModelDrafter):
        def propose(self, history, k):
            asked.append(k)
            return super().propose(history, k)
    m = target_model()
    d = Recorder(m, m.new_cache(512), GREEDY, torch.Generator().manual_seed(9))
    gen, _ = make(GREEDY, d, spec_n_max=4, spec_n_min=3)
    res = gen.generate(PROMPT, n_predict=23)
    assert res.tokens == ref_greedy(PROMPT, 23) and asked and min(asked) >= 3
    assert res.spec.steps_no_proposal == 0


def test_a_draft_on_the_gpu_behind_lookup_or_ngrams_has_its_first_passes_left_out(monkeypatch):
    """The first pass of each shape captures a CUDA graph: not a measure. Behind a HybridDrafter or an NgramChain
    the draft's Transformer is a `.model` further down (it was measured, and a hybrid's model set aside)."""
    from sharpi_core.speculative import NgramChain, ngram_sources  # noqa: PLC0415
    monkeypatch.delenv("SHARPI_SPEC_COST", raising=False)
    for wrap in (lambda d: d, lambda d: HybridDrafter(LookupDrafter(3, 2), d, 4),
                 lambda d: NgramChain(ngram_sources(["ngram-mod"]), d, 4)):
        d = drafter_for("same", GREEDY)
        d.model.use_graphs = True
        gen, _ = make(GREEDY, wrap(d), spec_n_max=4)
        assert gen.cost.warm_up


@pytest.mark.parametrize("kind", [None, "same", "lookup"])
def test_resume_starts_the_samplers_over(kind):
    """generate(tokens, resume=True): tokens follow what was generated, and penalties look back over them
    and what follows only (llama-completion resets its samplers at each input)."""
    params = SamplingParams(temp=0, repeat_penalty=2.0, repeat_last_n=12, presence_penalty=1.5)
    gen, model = make(params, drafter=drafter_for(kind, params) if kind else None, spec_n_max=4)
    a = gen.generate(PROMPT, n_predict=5)
    inp = [3, 4, 5]
    assert gen.feed([a.tokens[-1]])
    b = gen.generate(inp, n_predict=8, resume=True)
    ctx, seen, want = PROMPT + a.tokens + inp, list(inp), []
    for _ in range(8):
        t = int(argmax(apply_penalties(model.logits_after(ctx), seen, params)))
        want.append(t)
        ctx.append(t)
        seen.append(t)
    assert b.tokens == want
    # (and it is not what penalties over the whole sequence give)
    ctx, other = PROMPT + a.tokens + inp, []
    for _ in range(8):
        t = int(argmax(apply_penalties(model.logits_after(ctx), ctx, params)))
        other.append(t)
        ctx.append(t)
    assert other != want


@pytest.mark.parametrize("kind", ["same", "draft"])
def test_a_draft_context_smaller_than_the_history_slides(kind):
    """-cd smaller than the history: the draft proposes from the history's tail (its window slides by
    halves of its context) instead of stopping; the output stays the target's."""
    gen, model = make(drafter=drafter_for(kind, GREEDY, target_model(), n_ctx=24), spec_n_max=4)
    res = gen.generate(PROMPT, n_predict=150)
    assert res.tokens == ref_greedy(PROMPT, 150)
    assert res.spec.steps_no_proposal == 0 and gen.drafter._base > 100
    assert gen.drafter.history == (gen.history + [res.tokens[-1]])[gen.drafter._base:][:len(gen.drafter.history)]


@pytest.mark.parametrize("params", [GREEDY, GREEDY_PEN])
def test_a_slid_draft_window_through_context_shifts(params):
    """The target's context shifts while the draft's window has slid (in front of it, across its start, inside
    it: keep 0 and 20 with a 24-token draft and a 64-token target): the same tokens as plain decoding."""
    for keep in (0, 20):
        plain, _ = make(params, n_ctx=64, context_shift=True, n_keep=keep)
        want = plain.generate(PROMPT, n_predict=200)
        gen, _ = make(params, drafter=drafter_for("same", params, n_ctx=24), n_ctx=64, context_shift=True,
                      n_keep=keep, spec_n_max=4)
        got = gen.generate(PROMPT, n_predict=200)
        assert got.tokens == want.tokens and got.context_shifts == want.context_shifts > 2
        assert got.spec.steps_no_proposal == 0 and got.spec.drafted > 150 and gen.drafter._base > 0


@pytest.mark.parametrize("stop_at_end", [False, True])
def test_resume_goes_on_from_what_feed_left(stop_at_end):
    """feed([last token]) then generate([], resume=True): the model goes on from feed's logits, with stop
    strings looked for either way (the one-shot rule or the interactive one)."""
    ref = ref_greedy(PROMPT, 12)
    gen, model = make()
    a = gen.generate(PROMPT, n_predict=4)
    assert gen.feed([a.tokens[-1]])
    n = model.n_tokens
    b = gen.generate([], n_predict=6, resume=True, stop_strings=["zz"], stop_at_end=stop_at_end)
    assert a.tokens + b.tokens == ref[:10]
    assert model.n_tokens - n == 5  # (the last token is not evaluated again)


def test_synthetic_acceptance_never_takes_a_proposed_end_of_generation():
    """--spec-synth-*: proposals accepted at random, but never a proposed end of generation (it would end the run
    early, as llama.cpp's server also avoids): the step keeps the proposals before it and the target's token
    follows them."""
    class Scripted:
        cache, history = None, []

        def propose(self, history, k):
            return [2, 7, 3][:k], None

        def rollback(self, n_keep):
            pass
    gen, _ = make(drafter=Scripted(), eog=(7,), spec_n_max=3, synth_rates=(1.0, 1.0, 1.0))
    r = gen.generate(PROMPT, n_predict=12)
    assert r.stop_reason == "n_predict" and len(r.tokens) == 12 and 7 not in r.tokens
    assert r.spec.accepted == r.spec.verify_passes > 0  # (one a step: the 2 before the proposed end)
