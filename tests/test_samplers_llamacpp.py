"""The sampler chain against llama.cpp's own (libllama's samplers on synthetic logits, recorded by
scripts/llamacpp_samplers.py into tests/data/llamacpp_samplers.json): top-n-sigma, typical, XTC's
cut, dynamic temperature, DRY with its sequence breakers, penalties and logit bias, in the default
order and in orders given by --samplers; and random chains with random values (scripts/fuzz_samplers.py
--record: tests/data/llamacpp_samplers_fuzz.json). Each case's kept candidates must be llama.cpp's and their
probabilities llama.cpp's softmax of its final logits; DRY's changed logits must be bit for bit."""
from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from sharpi_core import dry
from sharpi_core.sampling import SamplingParams, _chain, apply_penalties, filtered_probs
from sharpi_core.tokenizer import Tokenizer
from test_tokenizer import tok as vocab_of

ROOT = Path(__file__).resolve().parents[1]
CASES = json.loads((ROOT / "tests" / "data" / "llamacpp_samplers.json").read_text())
# random chains and values (scripts/fuzz_samplers.py --record): the same check as the hand-made cases
RANDOM = json.loads((ROOT / "tests" / "data" / "llamacpp_samplers_fuzz.json").read_text())
_spec = importlib.util.spec_from_file_location("llamacpp_samplers", ROOT / "scripts" / "llamacpp_samplers.py")
_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_script)



def _params(c: dict, tok: Tokenizer) -> SamplingParams:
    return _script.sampling_params(c, tok)


def _needs(c: dict) -> bool:
    return c["model"] == "smollm2-135m-instruct-q4_1"


@pytest.mark.parametrize("case", [pytest.param(c, id=c["name"], marks=() if _needs(c) else pytest.mark.slow)
                                  for c in CASES + RANDOM if "steps" not in c])
def test_chain_matches_llama_cpp(case):
    tok = vocab_of(case["model"])
    p = _params(case, tok)
    x = torch.from_numpy(_script.synthetic_logits(case["seed"], tok.n_vocab, case["scale"]))
    adj = apply_penalties(x, case["history"], p).numpy()
    if "changed" in case:  # DRY / penalties alone: the same logits changed, to the same float32 values
        diff = np.flatnonzero(adj != x.numpy())
        want = {i: v for i, v in case["changed"]}
        assert sorted(diff.tolist()) == sorted(want), (diff.tolist(), sorted(want))
        assert all(np.float32(want[i]) == adj[i] for i in want)
        return
    xtc_cut = case["xtc_probability"] >= 1.0  # the oracle's XTC always cuts; the mixture's cut side
    ids, probs = _chain(adj, p, xtc_cut)
    want_ids, ref = _reference(case, "kept", tok.n_vocab)
    assert sorted(ids.tolist()) == want_ids
    got = dict(zip(ids.tolist(), probs.tolist()))
    assert max(abs(got[i] - ref[i]) for i in ref) < 1e-6
    if not xtc_cut or not p.xtc_on:  # filtered_probs is the same distribution (XTC: the mixture, at P = 1 the cut)
        fp = filtered_probs(torch.from_numpy(adj), p).numpy()
        assert np.count_nonzero(fp) == len(want_ids)
        assert max(abs(float(fp[i]) - ref[i]) for i in ref) < 1e-6


def test_xtc_mixture_is_the_coin_of_each_draw():
    """XTC at probability P: the distribution is (1 - P) * chain without the cut + P * chain with it."""
    x = torch.from_numpy(_script.synthetic_logits(7, 5000, 1.0))
    p = SamplingParams(temp=0.9, xtc_probability=0.3, xtc_threshold=0.05)
    i0, p0 = _chain(x.numpy(), p, False)
    i1, p1 = _chain(x.numpy(), p, True)
    assert set(i1.tolist()) < set(i0.tolist())  # the cut removed the most likely tokens
    want = np.zeros(5000)
    want[i0] += 0.7 * p0
    want[i1] += 0.3 * p1
    got = filtered_probs(x, p).numpy().astype(np.float64)
    assert np.abs(got - want).max() < 1e-6


def test_dry_breakers_like_llama_cpp():
    """A breaker inside a token's text makes that token a breaker by itself; a token ending in the
    breaker's start heads the tokenized rest."""
    tok = vocab_of("smollm2-135m-instruct-q4_1")
    b = dry.breakers(tok, ["\n", "mat.\n"])
    heads = {h for h, t in b if t == ()}
    nl = tok.encode("\n", add_special=False)[0]
    assert nl in heads and all(b"\n" in tok.token_bytes(h) for h in heads)
    mat = tok.encode(" mat", add_special=False)
    assert len(mat) == 1 and (mat[0], tuple(tok.encode(".\n", add_special=False))) in b


def _dry_brute_force(window, multiplier, base, allowed, V):
    """DRY without breakers from its definition: the token after each earlier place where the last L
    tokens also end (L >= allowed, the longest per token) loses multiplier * base ** (L - allowed)."""
    n, best = len(window), {}
    for j in range(n - 1):
        L = 0
        while L <= j and window[j - L] == window[n - 1 - L]:
            L += 1
        if L >= allowed:
            t = window[j + 1]
            best[t] = max(best.get(t, -1), L)
    out = np.zeros(V, dtype=np.float32)
    for t, L in best.items():
        out[t] -= np.float32(multiplier * base ** (L - allowed))
    return out


@pytest.mark.parametrize("alphabet", [2, 3, 5])
def test_dry_equals_its_definition_without_breakers(alphabet):
    rng = np.random.default_rng(alphabet)
    for _ in range(60):
        n = int(rng.integers(1, 90))
        window = rng.integers(0, alphabet, size=n).tolist()
        if rng.random() < 0.5:  # long copies: repetitions longer than the Z-boxes
            p = int(rng.integers(1, 9))
            for i in range(p, n):
                if rng.random() < 0.9:
                    window[i] = window[i - p]
        allowed = int(rng.integers(0, 4))
        row = np.zeros(8, dtype=np.float32)
        dry.penalize_row(row, window, 0.75, 1.5, allowed, {})
        np.testing.assert_allclose(row, _dry_brute_force(window, 0.75, 1.5, allowed, 8), rtol=1e-6, err_msg=str(window))


def test_dry_changes_the_greedy_toy_chain():
    """The greedy DRY parameters of test_generate do penalize there (the parity tests are not vacuous)."""
    from test_generate import GREEDY_DRY, PROMPT, ref_greedy
    plain = ref_greedy(PROMPT, 40, SamplingParams(temp=0, repeat_penalty=1.1, logit_bias=((2, 0.4),)))
    assert ref_greedy(PROMPT, 40, GREEDY_DRY) != plain


def _reference(rec: dict, key: str, n_vocab: int) -> tuple[list[int], dict[int, float]]:
    """llama.cpp's candidates (sorted ids) and law as recorded: rec[key], each candidate's final logit (the law their
    softmax); or for most of the vocabulary, the ids left out, the highest final logits and the normalization (the
    law of those)."""
    if key in rec:
        ids = [i for i, _ in rec[key]]
        v = np.array([w for _, w in rec[key]], dtype=np.float64)
        return sorted(ids), dict(zip(ids, np.exp(v - v.max()) / np.exp(v - v.max()).sum()))
    ids = sorted(set(range(n_vocab)) - set(rec["dropped"]))
    assert len(ids) == rec["n"]
    return ids, {i: float(np.exp(w - rec["lse"])) for i, w in rec["top"]}


def _check_law(got: dict[int, float], step: dict, r: int, n_vocab: int) -> None:
    """A step's law (id -> probability) against llama.cpp's (_reference of its logits)."""
    ids, want = _reference(step, "logits", n_vocab)
    assert sorted(got) == ids, r
    assert max(abs(got[i] - want[i]) for i in want) < 1e-6, r


@pytest.mark.parametrize("case", [pytest.param(c, id=c["name"], marks=() if _needs(c) else pytest.mark.slow)
                                  for c in CASES if "steps" in c and "adaptive_p" not in c["samplers"]])
def test_mirostat_matches_llama_cpp(case):
    """Mirostat 1 and 2: at each step the candidates llama.cpp keeps for its state mu and the law it draws from
    (its float probabilities normalized anew), mu then moving with the token llama.cpp picked (fed to ours)."""
    from sharpi_core.sampling import Mirostat
    tok = vocab_of(case["model"])
    version = 2 if "mirostat_v2" in case["samplers"] else 1
    m = Mirostat(version, case["mirostat_tau"], case["mirostat_eta"], tok.n_vocab)
    params = SamplingParams(temp=case["temp"], mirostat=version)
    for r, step in enumerate(case["steps"]):
        x = _script.synthetic_logits(case["seed"] + 1000 * r, tok.n_vocab, case["scale"])
        ((_, idx, law, u),) = m.sides(x, params, m.state)
        if "kept" in step:
            assert sorted(idx.tolist()) == step["kept"], r
        if "logits" in step or "top" in step:
            _check_law(dict(zip(idx.tolist(), law.tolist())), step, r, tok.n_vocab)
        m.state = m.after(m.state, u[idx.tolist().index(step["picked"])])


@pytest.mark.parametrize("case", [pytest.param(c, id=c["name"], marks=() if _needs(c) else pytest.mark.slow)
                                  for c in CASES if "adaptive_p" in c["samplers"]])
def test_adaptive_p_matches_llama_cpp(case):
    """Adaptive-p after the chain: at each step the law it draws from is llama.cpp's (the softmax of the
    logits it leaves), in the state the tokens llama.cpp picked before lead to (fed to ours)."""
    from sharpi_core.sampling import AdaptiveP
    tok = vocab_of(case["model"])
    p = _params(case, tok)
    assert p.adaptive_on
    m = AdaptiveP(p.adaptive_target, p.adaptive_decay)
    for r, step in enumerate(case["steps"]):
        x = torch.from_numpy(_script.synthetic_logits(case["seed"] + 1000 * r, tok.n_vocab, case["scale"]))
        x = apply_penalties(x, case["history"], p).numpy()
        idx, q, sides = m.law(x, p)
        _check_law(dict(zip(idx.tolist(), q.tolist())), step, r, tok.n_vocab)
        m.state = m.next_state(m.state, sides, step["picked"], None)


def test_degenerate_values_give_a_distribution():
    """Values llama.cpp turns into NaN or crashes on: a banned token never becomes XTC's survivor, a tiny
    or infinite temperature and an overflowing exponent give a distribution, a +inf logit wins."""
    x = _script.synthetic_logits(5, 3000, 1.0)
    banned = x.copy()
    banned[[7, 8, 9]] = -np.inf
    cases = [(banned, SamplingParams(top_k=0, top_p=1.0, min_p=0.0, xtc_probability=1.0, xtc_threshold=0.0)),
             (banned, SamplingParams(samplers=("xtc", "temperature"), xtc_probability=0.5, xtc_threshold=0.0)),
             (x, SamplingParams(temp=1e-38, typical_p=0.9)),
             (x, SamplingParams(dynatemp_range=0.8, dynatemp_exponent=75.0)),
             (x, SamplingParams(temp=1e8, dynatemp_range=1.0, dynatemp_exponent=-1e30)),
             (x, SamplingParams(top_n_sigma=1.0, top_k=0, dynatemp_range=0.5, dynatemp_exponent=-1e30)),
             # top-n-sigma's -inf logits kept by min_keep, an entropy of 0: an infinite temperature, NaN on them
             (x, SamplingParams(temp=0.5, top_n_sigma=0.01, min_keep=30, dynatemp_range=2.0, dynatemp_exponent=-1.0))]
    for row, p in cases:
        with warnings.catch_warnings():  # (numpy's warnings reach a user's terminal: fuzz_samplers found one)
            warnings.simplefilter("error")
            fp = filtered_probs(torch.from_numpy(row), p).numpy()
        assert np.isfinite(fp).all() and abs(float(fp.sum()) - 1) < 1e-5 and fp[[7, 8, 9]].sum() == 0, p
    assert filtered_probs(torch.from_numpy(x), SamplingParams(temp=1e-38, typical_p=0.9)).numpy()[np.argmax(x)] == 1
    inf = x.copy()
    inf[28] = np.inf
    for p in (SamplingParams(), SamplingParams(typical_p=0.5, top_k=0), SamplingParams(top_n_sigma=1.0)):
        assert filtered_probs(torch.from_numpy(inf), p).numpy()[28] == 1
    row = np.zeros(8, dtype=np.float32)  # an exponent past what a double holds: the token is banned, as in C
    dry.penalize_row(row, [1, 2, 1, 2, 1, 2], 1.0, 1.0000005, -2_000_000_000, {})
    assert row[1] == -np.inf
