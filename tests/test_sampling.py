"""Sampling chain vs. straightforward reference implementations of llama.cpp's samplers."""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import time
from collections import Counter

import numpy as np
import pytest
import torch

from sharpi_core.sampling import (DEFAULT_SAMPLERS, SamplingParams, apply_penalties, argmax, candidates, draw,
                                  filtered_probs,
                                  sample)
from toy import chi2_test


# -- reference: one candidate list, one sampler at a time, like src/llama-sampler.cpp -------------------
def ref_penalized(logits: list[float], params: SamplingParams, history: list[int]) -> list[float]:
    x = list(logits)
    for tok, b in params.logit_bias:
        x[tok] += b
    active = params.repeat_penalty != 1 or params.frequency_penalty or params.presence_penalty
    if params.repeat_last_n != 0 and active:
        window = history[-params.repeat_last_n:] if params.repeat_last_n > 0 else history
        for tok, cnt in Counter(window).items():
            v = x[tok]
            v = v * params.repeat_penalty if v <= 0 else v / params.repeat_penalty
            x[tok] = v - (cnt * params.frequency_penalty + params.presence_penalty)
    return x


def ref_probs(logits: list[float], params: SamplingParams, history: list[int] = ()) -> dict[int, float]:
    x = ref_penalized(logits, params, list(history))
    cand = sorted(range(len(x)), key=lambda i: (-x[i], i))  # sorted, ties by id
    if params.temp <= 0:
        return {cand[0]: 1.0}
    if params.top_k > 0:
        cand = cand[: params.top_k]
    if params.top_p < 1:
        m = max(x[i] for i in cand)
        z = sum(math.exp(x[i] - m) for i in cand)
        cum, keep = 0.0, []
        for i in cand:
            keep.append(i)
            cum += math.exp(x[i] - m) / z
            if cum >= params.top_p:
                break
        cand = keep
    if params.min_p > 0:
        thr = x[cand[0]] + math.log(params.min_p)
        cand = [i for i in cand if x[i] >= thr] or cand[:1]
    m = max(x[i] / params.temp for i in cand)
    w = {i: math.exp(x[i] / params.temp - m) for i in cand}
    z = sum(w.values())
    return {i: v / z for i, v in w.items()}


def dense(d: dict[int, float], V: int) -> np.ndarray:
    out = np.zeros(V)
    for i, v in d.items():
        out[i] = v
    return out


GRID = [SamplingParams(temp=t, top_k=k, top_p=p, min_p=mp)
        for t in (0.5, 1.0, 1.7) for k in (0, 1, 5, 40, 100) for p in (1.0, 0.9, 0.5) for mp in (0.0, 0.05, 0.3)]


@pytest.mark.parametrize("seed", range(3))
def test_filter_chain_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(60, generator=g) * 2.5
    for params in GRID:
        got = filtered_probs(logits, params).numpy()
        want = dense(ref_probs(logits.tolist(), params), 60)
        assert np.array_equal(got > 0, want > 0), params
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=str(params))


def test_defaults_are_llama_cpp():
    p = SamplingParams()
    assert (p.temp, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty) == (1.0, 64, 0.0, 0.0)
    assert not p.greedy and not p.has_penalties and not p.adjusts_logits


def test_top_k_keeps_k_best():
    x = torch.tensor([0.0, 5.0, 1.0, 4.0, 3.0, 2.0])
    p = filtered_probs(x, SamplingParams(temp=1, top_k=3, top_p=1, min_p=0))
    assert set(torch.nonzero(p).flatten().tolist()) == {1, 3, 4}
    # top_k <= 0 or >= V: off
    for k in (0, -1, 6, 100):
        assert (filtered_probs(x, SamplingParams(temp=1, top_k=k, top_p=1, min_p=0)) > 0).all()


def test_top_p_keeps_smallest_prefix_reaching_p():
    x = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    kept = lambda tp: set(torch.nonzero(filtered_probs(x, SamplingParams(temp=1, top_k=0, top_p=tp, min_p=0)))
                          .flatten().tolist())
    assert kept(0.4) == {1}
    assert kept(0.75) == {1, 2}
    assert kept(0.85) == {0, 1, 2}
    assert kept(1.0) == {0, 1, 2}


def test_min_p_is_relative_to_the_max():
    x = torch.log(torch.tensor([0.5, 0.2, 0.1, 0.04, 0.16]))
    p = filtered_probs(x, SamplingParams(temp=1, top_k=0, top_p=1, min_p=0.3))
    assert set(torch.nonzero(p).flatten().tolist()) == {0, 1, 4}  # >= 0.3 * 0.5
    np.testing.assert_allclose(p[[0, 1, 4]].numpy(), np.array([0.5, 0.2, 0.16]) / 0.86, rtol=1e-6)


def test_temperature_after_filters():
    x = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temp=0.5, top_k=0, top_p=1, min_p=0)
    np.testing.assert_allclose(filtered_probs(x, params).numpy(), torch.softmax(x / 0.5, 0).numpy(), rtol=1e-6)
    # min-p looks at the untempered logits: temp 3 flattens, but the same tokens are kept
    p_hot = filtered_probs(x, SamplingParams(temp=3.0, top_k=0, top_p=1, min_p=0.3))
    p_cold = filtered_probs(x, SamplingParams(temp=0.3, top_k=0, top_p=1, min_p=0.3))
    assert torch.equal(p_hot > 0, p_cold > 0)
    assert (p_hot > 0).tolist() == [True, True, False, False]


def test_ties_prefer_lower_id():
    x = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0])
    p = filtered_probs(x, SamplingParams(temp=1, top_k=2, top_p=1, min_p=0))
    assert set(torch.nonzero(p).flatten().tolist()) == {1, 2}
    assert sample(x, SamplingParams(temp=0)) == 1
    assert int(argmax(x)) == 1


def test_ties_at_a_cut_prefer_lower_ids_in_a_large_vocabulary():
    """A run of equal logits straddling the top-k cut gives its places to the lowest ids (llama.cpp's order), in a
    vocabulary large enough that the kernels partition and sort only a part of it, the run scattered over it."""
    g = np.random.default_rng(7)
    V = 50_000
    x = g.standard_normal(V).astype(np.float32) - 10  # the rest far below the run
    run = np.sort(g.choice(V, 400, replace=False))[::-1]  # (written in descending id order)
    x[run] = 2.0
    x[run[:5]] = 3.0  # five above the run of 395: top-k 100 takes 95 of it
    for top_k in (100, 5 + 395 - 1):
        p = filtered_probs(torch.from_numpy(x), SamplingParams(temp=1, top_k=top_k, top_p=1, min_p=0))
        kept = set(torch.nonzero(p).flatten().tolist())
        assert kept == set(run[:5].tolist()) | set(np.sort(run[5:])[: top_k - 5].tolist())
        idx, _ = candidates(torch.from_numpy(x), SamplingParams(temp=1, top_k=top_k, top_p=1, min_p=0))
        assert set(idx.tolist()) == kept


def test_penalties_match_reference():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(30, generator=g) * 2
    history = torch.randint(0, 30, (100,), generator=g).tolist()
    for params in [SamplingParams(repeat_penalty=1.3, repeat_last_n=64),
                   SamplingParams(repeat_penalty=0.8, repeat_last_n=-1),
                   SamplingParams(repeat_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.5, repeat_last_n=16),
                   SamplingParams(frequency_penalty=0.2, repeat_last_n=8),
                   SamplingParams(presence_penalty=-0.4, repeat_last_n=64, logit_bias=((3, 2.0), (5, -1.5)))]:
        got = apply_penalties(logits, history, params).numpy()
        want = np.array(ref_penalized(logits.tolist(), params, history))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=str(params))
        got_p = filtered_probs(apply_penalties(logits, history, params), params).numpy()
        np.testing.assert_allclose(got_p, dense(ref_probs(logits.tolist(), params, history), 30), atol=2e-6)


def test_repeat_penalty_divides_positive_multiplies_negative():
    x = torch.tensor([2.0, -2.0, 1.0, 0.0])
    out = apply_penalties(x, [0, 1, 3, 3], SamplingParams(repeat_penalty=2.0))
    assert out.tolist() == [1.0, -4.0, 1.0, 0.0]
    assert x.tolist() == [2.0, -2.0, 1.0, 0.0]  # input untouched
    # frequency counts occurrences, presence once
    out = apply_penalties(x, [2, 2, 2], SamplingParams(frequency_penalty=0.5, presence_penalty=0.25))
    assert out.tolist() == [2.0, -2.0, 1.0 - 1.5 - 0.25, 0.0]


def test_penalty_window_and_off_switches():
    x = torch.zeros(5) + 1.0
    h = [0, 1, 2, 3]
    assert apply_penalties(x, h, SamplingParams(repeat_penalty=2.0, repeat_last_n=2)).tolist() == [1, 1, .5, .5, 1]
    assert apply_penalties(x, h, SamplingParams(repeat_penalty=2.0, repeat_last_n=-1)).tolist() == [.5, .5, .5, .5, 1]
    assert apply_penalties(x, h, SamplingParams(repeat_penalty=2.0, repeat_last_n=0)) is x
    assert apply_penalties(x, h, SamplingParams()) is x


def test_logit_bias_adds_accumulates_and_bans():
    x = torch.zeros(6)
    out = apply_penalties(x, None, SamplingParams(logit_bias=((1, 1.5), (1, 0.5), (4, -math.inf))))
    assert out.tolist() == [0, 2.0, 0, 0, -math.inf, 0]
    params = SamplingParams(temp=1.0, top_k=0, top_p=1, min_p=0, logit_bias=((4, -math.inf),))
    g = torch.Generator().manual_seed(0)
    assert all(sample(x, params, g) != 4 for _ in range(300))
    assert sample(x, SamplingParams(temp=0, logit_bias=((5, 0.1),))) == 5


def test_bias_comes_before_penalties():
    # llama.cpp: logit bias first, then penalties: (1 + 1) / 2 = 1, not 1/2 + 1
    out = apply_penalties(torch.tensor([1.0, 0.0]), [0], SamplingParams(repeat_penalty=2.0, logit_bias=((0, 1.0),)))
    assert out.tolist() == [1.0, 0.0]


def test_greedy_is_exact_argmax_after_penalties_and_bias():
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        x = torch.randn(1000, generator=g)
        h = torch.randint(0, 1000, (64,), generator=g).tolist()
        params = SamplingParams(temp=0.0, top_k=1, top_p=0.1, min_p=0.9, repeat_penalty=1.5,
                                logit_bias=((int(x.argmin()), 100.0),))
        adj = apply_penalties(x, h, params)
        want = max(range(1000), key=lambda i: (float(adj[i]), -i))
        state = g.get_state()
        assert sample(x, params, g, h) == want
        assert torch.equal(g.get_state(), state)  # greedy draws nothing
        one_hot = filtered_probs(adj, params)
        assert one_hot[want] == 1 and one_hot.sum() == 1
    assert SamplingParams(temp=-1).greedy and SamplingParams(temp=0).greedy


def test_batched_rows_equal_single_rows():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 300, generator=g) * 2
    params = SamplingParams(temp=0.9, top_k=20, top_p=0.9, min_p=0.05, repeat_penalty=1.2, frequency_penalty=0.1)
    base = torch.randint(0, 300, (40,), generator=g).tolist()
    hists = [base + list(range(i)) for i in range(7)]
    rows = apply_penalties(x, hists, params)
    assert torch.equal(rows, torch.stack([apply_penalties(x[i], hists[i], params) for i in range(7)]))
    assert torch.equal(filtered_probs(rows, params), torch.stack([filtered_probs(rows[i], params) for i in range(7)]))
    assert torch.equal(argmax(rows), rows.argmax(dim=-1))


@pytest.mark.parametrize("V", [50_000, 151_936])
def test_large_vocab_paths_match_sort_reference(V):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(V, generator=g) * 3
    flat = torch.randn(V, generator=g) * 0.1  # nucleus wider than 256 tokens: the full-sort fallback
    for logits, params in [(x, SamplingParams()),
                           (x, SamplingParams(temp=1, top_k=0, top_p=0.9, min_p=0)),
                           (flat, SamplingParams(temp=1, top_k=0, top_p=0.5, min_p=0)),
                           (x, SamplingParams(temp=1, top_k=0, top_p=1, min_p=0.1)),
                           (x, SamplingParams(temp=1, top_k=500, top_p=0.99, min_p=0)),
                           (flat, SamplingParams(temp=1, top_k=0, top_p=1, min_p=0))]:
        vals, idx = torch.sort(logits, descending=True, stable=True)
        k = params.top_k if 0 < params.top_k < V else V
        vals, idx = vals[:k].double(), idx[:k]
        n = k
        if params.top_p < 1:  # llama.cpp's float32 softmax: summed in id order without top-k, else sorted
            e = np.exp(logits.numpy() - logits.max().item()) if k == V else np.exp(vals.float().numpy() - vals[0].item())
            p = np.exp(vals.float().numpy() - vals[0].item()) / np.cumsum(e, dtype=np.float32)[-1]
            n = int((np.cumsum(p, dtype=np.float32) < np.float32(params.top_p)).sum()) + 1
        if params.min_p > 0:
            n = min(n, int((vals >= vals[0] + math.log(params.min_p)).sum()))
        got = filtered_probs(logits, params)
        ids, ps = candidates(logits, params)
        m = ids.shape[0]
        assert m == n, (params, m, n)
        assert sorted(ids.tolist()) == sorted(idx[:m].tolist())  # the best m
        want = torch.zeros(V, dtype=torch.float64)
        want[idx[:m]] = torch.softmax(vals[:m] / params.temp, 0)
        assert torch.equal(got > 0, want > 0), params
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(ps, want[ids])


def test_sample_draws_from_filtered_probs():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(12, generator=g)
    h = [1, 1, 2]
    params = SamplingParams(temp=0.7, top_k=8, top_p=0.97, min_p=0.02, repeat_penalty=1.3)
    p = filtered_probs(apply_penalties(x, h, params), params).numpy()
    counts = np.bincount([sample(x, params, g, h) for _ in range(10000)], minlength=12)
    assert chi2_test(counts, p)[2] > 0.001
    # same seed, same tokens
    a = [sample(x, params, torch.Generator().manual_seed(3), h) for _ in range(5)]
    g1, g2 = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    assert [sample(x, params, g1, h) for _ in range(50)] == [sample(x, params, g2, h) for _ in range(50)]
    assert len(set(a)) == 1


def test_draw_never_picks_zero_weight():
    g = torch.Generator().manual_seed(0)
    w = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    got = [draw(w, g) for _ in range(4000)]
    assert set(got) == {1, 3}
    assert abs(got.count(3) / 4000 - 0.75) < 0.03
    from sharpi_core.sampling import NoDistribution
    with pytest.raises(NoDistribution):
        draw(np.zeros(3), g)


def test_sample_is_fast_on_a_real_vocab_size():
    x = torch.randn(151_936) * 3
    g = torch.Generator().manual_seed(0)
    hist = list(range(64))
    for params in (SamplingParams(), SamplingParams(repeat_penalty=1.1), SamplingParams(temp=0)):
        sample(x, params, g, hist)
        t = []
        for _ in range(30):
            t0 = time.perf_counter()
            sample(x, params, g, hist)
            t.append(time.perf_counter() - t0)
        # ~0.1-0.2 ms unloaded; the bound leaves room for a busy machine
        assert sorted(t)[len(t) // 2] < 0.003, (params, sorted(t)[len(t) // 2])


def test_nan_logits_are_one_clear_error():
    """A row with a NaN logit (a damaged model's, or one whose activations overflow) has no distribution: every sampled
    path says so in one SharpiError (numpy's empty-array errors and IndexErrors escaped as tracebacks), not a draw of
    garbage; greedy decoding too (the target's arg-max: llama.cpp's greedy sampler keeps token 0 or skips the NaNs)."""
    from sharpi_core.errors import SharpiError
    from sharpi_core.sampling import Mirostat, NoDistribution
    assert issubclass(NoDistribution, SharpiError)
    row = torch.randn(64)
    row[[3, 10]] = float("nan")
    g = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temp=0.8), SamplingParams(temp=0.8, top_k=0, top_p=1.0, min_p=0.0),
                   SamplingParams(temp=0.8, typical_p=0.5), SamplingParams(temp=0, typical_p=0.5),
                   SamplingParams(temp=0.8, xtc_probability=0.5, xtc_threshold=0.01)):
        with pytest.raises(NoDistribution):
            sample(row, params, g)
        with pytest.raises(NoDistribution):
            candidates(row, params)
        with pytest.raises(NoDistribution):
            filtered_probs(row[None], params)
    with pytest.raises(NoDistribution):
        Mirostat(2, 5.0, 0.1, 64).candidates(row.numpy(), 0.8)
    with pytest.raises(NoDistribution):
        sample(row, SamplingParams(temp=0), g)
    from sharpi_core.sampling import argmax
    from sharpi_core.speculative import accept_greedy
    rows = torch.randn(3, 64)
    ok = argmax(rows, nan_error=True)
    assert torch.equal(ok, argmax(rows)) and accept_greedy([int(ok[0]), 5], rows) == (1 + (int(ok[1]) == 5), ok[1 + (int(ok[1]) == 5)])
    rows[2] = row
    with pytest.raises(NoDistribution):  # (the verdict reads row 2: both drafts match)
        accept_greedy([int(ok[0]), int(ok[1])], rows)
    # a row after the first mismatch is never read (plain decoding never computes it)
    assert accept_greedy([int(ok[0]), (int(ok[1]) + 1) % 64], rows) == (1, int(ok[1]))
    assert int(argmax(row)) == 3  # (the plain arg-max, a draft model's: numpy's, the first NaN)


def test_the_min_p_cut_is_llama_cpps_logf_in_every_path():
    """min-p keeps the logits >= max + logf(min_p), the float's libm logf (llama.cpp's): the fast path took
    float(log(double)), an ulp off for about half the values, so a logit on the cut was dropped there and kept
    by the general chain (min_p 0.0457)."""
    from sharpi_core.libm import logf
    for mp in (0.0457, 0.05, 0.1, 0.0123):
        x = torch.tensor([0.0, float(logf(mp)), -20.0, -21.0])
        for samplers in (DEFAULT_SAMPLERS, ("min_p", "temperature")):
            p = filtered_probs(x, SamplingParams(temp=1, top_k=0, top_p=1, min_p=mp, samplers=samplers))
            assert int((p > 0).sum()) == 2, (mp, samplers)


def test_top_p_without_top_k_is_llama_cpps_float32_softmax_in_every_path():
    """With top-k off, llama.cpp's top-p takes the softmax of the candidates as they stand (in id order: nothing
    sorted them), exp(logit - max) summed one after another in float32, then the running float32 sum of the sorted
    probabilities: over a 152k vocabulary that sum stalls once the tail's probabilities are under half its ulp, so
    the cut lies hundreds of tokens from the float64 one. The fast path (default order) took a float64 softmax and
    the general chain summed after sorting: they kept different sets for the same chain."""
    rng = np.random.default_rng(3)
    V = 151_936
    for scale in (1.5, 3.0, 6.0):
        x = (rng.standard_normal(V) * scale).astype(np.float32)
        e = libm("expf", x - x.max())
        p = e / np.cumsum(e, dtype=np.float32)[-1]  # (numpy's cumsum adds in order: a sequential sum)
        order = np.argsort(-x, kind="stable")
        for top_p in (0.9, 0.95, 0.99):
            hit = np.flatnonzero(np.cumsum(p[order], dtype=np.float32) >= np.float32(top_p))
            want = int(hit[0]) + 1 if hit.shape[0] else V
            params = SamplingParams(temp=0.8, top_k=0, top_p=top_p, min_p=0.0)
            reordered = SamplingParams(temp=0.8, top_k=0, top_p=top_p, min_p=0.0,
                                       samplers=("top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"))
            for ps in (params, reordered):
                got = int((filtered_probs(torch.from_numpy(x), ps) > 0).sum())
                assert got == want, (scale, top_p, ps.samplers, got, want)


_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")


def libm(name: str, a: np.ndarray) -> np.ndarray:
    """libm's float function `name` (expf, log2f) of each element, one call each (a reference, not fast)."""
    fn = getattr(_LIBM, name)
    fn.argtypes, fn.restype = [ctypes.c_float], ctypes.c_float
    return np.array([fn(float(v)) for v in a], dtype=np.float32)


def test_top_p_cut_takes_libm_expf():
    """llama.cpp's softmax calls libm's expf; numpy's float32 exp is an ulp off it for ~40% of values, and where the
    running sum of the sorted probabilities meets top-p exactly, that ulp moves the cut by a token. Each case puts
    top-p on such a sum (from libm's expf), where numpy's exp falls short of it: both paths keep llama.cpp's set."""
    rng = np.random.default_rng(0)
    cases = 0
    for _ in range(400):
        x = (rng.standard_normal(64) * 2).astype(np.float32)
        order = np.argsort(-x, kind="stable")
        sums = []
        for e in (libm("expf", x - x.max()), np.exp(x - x.max())):
            sums.append(np.cumsum((e / np.cumsum(e, dtype=np.float32)[-1])[order], dtype=np.float32))
        ahead = np.flatnonzero((sums[0] > sums[1]) & (sums[0] < 1))
        if not ahead.shape[0]:
            continue
        k = int(ahead[0])
        top_p = float(sums[0][k])
        want = int(np.flatnonzero(sums[0] >= np.float32(top_p))[0]) + 1  # (k + 1 unless an earlier sum equals it)
        if int(np.flatnonzero(sums[1] >= np.float32(top_p))[0]) + 1 == want:
            continue  # numpy's exp would cut there too: no test of the difference
        cases += 1
        for samplers in (DEFAULT_SAMPLERS, ("top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")):
            ps = SamplingParams(temp=0.8, top_k=0, top_p=top_p, min_p=0.0, samplers=samplers)
            got = int((filtered_probs(torch.from_numpy(x), ps) > 0).sum())
            assert got == want, (samplers, top_p, got, want)
    assert cases >= 10


@pytest.mark.parametrize("scale", [2.0, 8.0])
def test_mirostat_v2_cut_is_llama_cpps_float_softmax(scale):
    """Mirostat 2 keeps the leading run of sorted tokens whose surprise -log2f(p) is at most mu, p from llama.cpp's
    sorted softmax: libm's expf, summed in float32 from the largest (sharpi summed numpy's exps in float64 and took
    numpy's log2: a token whose surprise is mu itself was dropped). At scale 8 most terms are under 2^-24: lost in
    the float sum, which sharpi then sorts without them."""
    from sharpi_core.sampling import Mirostat
    rng = np.random.default_rng(1)
    V = 3000
    for _ in range(4):
        x = (rng.standard_normal(V) * scale).astype(np.float32)
        e = libm("expf", x - x.max())
        ps = np.sort(e)[::-1] / np.cumsum(np.sort(e)[::-1], dtype=np.float32)[-1]
        surprise = -libm("log2f", ps)
        for k in (0, 3, 10, 40, 200):
            if k >= V or surprise[k] == np.inf:
                continue
            mu = surprise[k]
            want = int(np.count_nonzero(surprise <= mu))  # (sorted: a prefix, equal surprises all in)
            idx, p = Mirostat(2, 5.0, 0.1, V).candidates(x, 1.0, mu)
            assert len(idx) == want, (k, len(idx), want)
            assert abs(float(p.sum()) - 1) < 1e-5
    lost = np.count_nonzero(libm("expf", x - x.max()) < 2.0 ** -24)
    assert (lost > V // 2) == (scale == 8.0)
