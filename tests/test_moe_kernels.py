"""The mixture-of-experts C entry points (qmatmul_id, moe_route, moe_sum) against what they replace: one
one-token-order qmatmul per (token, expert) pair, torch's stable sort over ggml_soft_max's output, and the
weighted outputs added one by one. Equality is bitwise: a model's logits stay libllama's."""
from __future__ import annotations

import gguf
import pytest
import torch

from sharpi_core.kernels import cpu
from test_cpu_kernels import KQUANTS, act_test_inputs, needs_kernels, random_raw, torch_view

Q = gguf.GGMLQuantizationType
ID_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.IQ4_NL, Q.MXFP4, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)


def experts(qtype, n_exp: int, n: int, k: int, packed: bool):
    """n_exp random [n, k] weights as (layout code, [raw tensors]): GGUF blocks, or Q4_K / Q4_1 / Q5_0's CPU layout."""
    raws = [torch_view(random_raw(qtype, n, k, seed=30 + e)) for e in range(n_exp)]
    if packed:
        return cpu.PACKED[qtype], [cpu.repack(r, qtype, n, k) for r in raws]
    return qtype, raws


@needs_kernels
@pytest.mark.parametrize("qtype,packed", [(q, False) for q in ID_TYPES] + [(Q.Q4_K, True), (Q.Q4_1, True), (Q.Q5_0, True)],
                         ids=lambda v: getattr(v, "name", "packed" if v else ""))
def test_qmatmul_id_rows_are_one_token_matmuls(qtype, packed):
    """Every (token, expert) row of qmatmul_id equals that token alone through the expert's qmatmul (the
    decoding order), bias added after, for passes whose experts take 1 row to more than 8 (Q4_K's prepared
    path), with 1 or 2 threads, as a view with a row stride."""
    n_exp, n, k = 6, 40, 512 if qtype in KQUANTS else 544
    layout, raws = experts(qtype, n_exp, n, k, packed)
    code, be, bb = cpu._INFO[layout]
    rb = k // be * bb
    ptrs = torch.tensor([r.data_ptr() for r in raws], dtype=torch.int64)
    bias = torch.randn(n_exp, n)
    x = act_test_inputs(24, k, seed=3)
    g = torch.Generator().manual_seed(0)
    nth = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for T, kk in ((1, 1), (1, 4), (3, 2), (24, 2)):  # (24, 2): some expert gets > 8 rows
                ids = torch.stack([torch.randperm(n_exp, generator=g)[:kk] for _ in range(T)]).to(torch.int32).view(-1)
                tok = torch.arange(T, dtype=torch.int32).repeat_interleave(kk)
                buf = torch.full((T * kk, 2 * n), float("nan"))
                y = cpu.qmatmul_id(x[:T], code, ptrs, rb, n, k, ids, tok, None, buf[:, n:])
                yb = cpu.qmatmul_id(x[:T], code, ptrs, rb, n, k, ids, tok, bias)
                for p in range(T * kk):
                    e, t = int(ids[p]), int(tok[p])
                    want = cpu.qmatmul(x[t:t + 1].contiguous(), raws[e], layout, n, k, act_quant=True)[0]
                    assert torch.equal(y[p], want), (threads, T, p)
                    assert torch.equal(yb[p], want + bias[e]), (threads, T, p)
                assert torch.isnan(buf[:, :n]).all()  # only its half of the buffer written
    finally:
        torch.set_num_threads(nth)


@needs_kernels
def test_qmatmul_id_refuses_bad_arguments():
    layout, raws = experts(Q.Q8_0, 2, 8, 64, False)
    code, be, bb = cpu._INFO[layout]
    ptrs = torch.tensor([r.data_ptr() for r in raws], dtype=torch.int64)
    x = torch.randn(2, 64)
    tok = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError):  # an expert id out of range
        cpu.qmatmul_id(x, code, ptrs, 68, 8, 64, torch.tensor([2], dtype=torch.int32), tok)
    with pytest.raises(ValueError):  # an activation row out of range
        cpu.qmatmul_id(x, code, ptrs, 68, 8, 64, torch.tensor([1], dtype=torch.int32), tok + 2)
    with pytest.raises(ValueError):  # float weights have no kernel here
        cpu.qmatmul_id(x, cpu._INFO[Q.F16][0], ptrs, 128, 8, 64, tok, tok)
    assert cpu.qmatmul_id(x, code, ptrs, 68, 8, 64, tok[:0], tok[:0]).shape == (0, 8)


def route_reference(logits: torch.Tensor, k: int, gating: str, bias, norm: bool = True):
    """The torch routing moe_route replaced (ggml_soft_max through cpu.soft_max, a stable descending sort)."""
    if bias is not None:
        logits = logits + bias
    if gating == "softmax_weight":
        top = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
        return top, cpu.soft_max(logits.gather(1, top).contiguous())
    probs = cpu.soft_max(logits.clone())
    top = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    w = probs.gather(1, top)
    if not norm:  # (qwen2moe: the probabilities as they are)
        return top, w
    total = w[:, 0].double()
    for j in range(1, k):
        total = total + w[:, j].double()
    return top, w / total.float().clamp_min(6.103515625e-5)[:, None]


@needs_kernels
@pytest.mark.parametrize("gating,norm", [("softmax", True), ("softmax", False), ("softmax_weight", True)])
def test_moe_route_is_the_stable_sort_over_ggml_soft_max(gating, norm):
    g = torch.Generator().manual_seed(1)
    for (n_exp, k), biased in zip(((8, 2), (32, 4), (128, 8), (4, 4), (64, 4)), (False, True) * 3):
        logits = torch.randn(9, n_exp, generator=g) * 3
        logits[0] = 0.5  # all tied: the lowest indices, in order
        logits[1, 3::2] = logits[1, 1]  # some ties
        logits[2] = -30.0 + torch.arange(n_exp) * 1e-7  # tiny probabilities (the clamped sum)
        bias = torch.randn(n_exp, generator=g) if biased else None
        want_ids, want_w = route_reference(logits, k, gating, bias, norm)
        ids, w = cpu.moe_route(logits.clone(), k, gating, bias, norm)
        assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids), (n_exp, k)
        assert torch.equal(w, want_w), (n_exp, k)
        if not biased:
            assert torch.equal(ids[0].long(), torch.arange(k))
        if gating == "softmax" and k < n_exp:  # the weights sum to 1 only when renormalized
            assert (w.sum(-1) - 1).abs().max() < 1e-6 if norm else w.sum(-1).min() < 0.9


@needs_kernels
def test_shexp_add_is_qwen2moes_gated_sum():
    """y + sh * (silu(x) / x): ggml_silu's x / (1 + expf(-x)) one element per row, divided by x, the product
    rounded, then added (checked in float64 to the last bit's neighbourhood; the bits against llama.cpp by
    test_archs' qwen2moe oracle)."""
    g = torch.Generator().manual_seed(3)
    T, D = 6, 40
    gx, sh, y = torch.randn(T, 1, generator=g) * 3, torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    gx[0] = 30.0  # (sigmoid 1 in float)
    gx[1] = -30.0
    x = gx.double()
    want = (y.double() + (sh.double() * ((x / (1 + torch.exp(-x))) / x)).float().double()).float()
    got = cpu.shexp_add(gx, sh, y.clone())
    torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-7)
    assert torch.equal(got[0], y[0] + sh[0])
    with pytest.raises(ValueError):
        cpu.shexp_add(gx[:3], sh, y)
    # qwen35moe's gate is ggml_sigmoid itself (1 / (1 + expf(-x))): its product and sum, rounded as torch rounds them
    plain = cpu.shexp_add(gx, sh, y.clone(), plain=True)
    assert torch.equal(plain, y + sh * cpu.sigmoid(gx.clone()))
    assert not torch.equal(plain, got)  # (the two formulas round differently on some rows)


@needs_kernels
def test_moe_sum_adds_weighted_outputs_in_order():
    g = torch.Generator().manual_seed(2)
    for T, k in ((1, 1), (3, 4), (5, 8)):
        d, w = torch.randn(T * k, 96, generator=g), torch.rand(T, k, generator=g)
        out = d.view(T, k, 96) * w[:, :, None]
        want = out[:, 0]
        for j in range(1, k):
            want = want + out[:, j]
        assert torch.equal(cpu.moe_sum(d, w), want)
