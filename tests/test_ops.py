"""The C ops besides the matmuls (sharpi_core/kernels/ops.c) against torch references."""
from __future__ import annotations

import ctypes
import ctypes.util
import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from sharpi_core.kernels import cpu
from test_cpu_kernels import ggml_quantize_q8_0, hsum_float_8
from sharpi_core.kv_cache import KVCache
from sharpi_core.quants import activation_for, quantize_q8_blocks

pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels unavailable")


def reference(q, cache, start, window, scale, softcap=0.0, fa=False, sinks=None):
    """softcap: on the scaled scores with flash attention (llama.cpp folds 1/softcap into its scale), on the
    raw ones without it (then the softmax's scale). sinks [H]: one more logit per head in the softmax, with
    no value (gpt-oss)."""
    T, H, D = q.shape
    L = start + T
    K, V = cache.k.read(0, L), cache.v.read(0, L)  # [L, Hkv, D]
    G = H // K.shape[1]
    out = torch.empty(T, H, V.shape[2])
    for t in range(T):
        pos = start + t
        lo = max(0, pos - window + 1) if window else 0
        for h in range(H):
            sc = K[lo:pos + 1, h // G].double() @ q[t, h].double()
            if softcap and fa:
                sc = softcap * torch.tanh(sc * scale / softcap) / scale
            elif softcap:
                sc = softcap * torch.tanh(sc / softcap)
            p = torch.softmax(sc * scale if sinks is None else torch.cat((sc * scale, sinks[h:h + 1].double())), 0)
            p = p[:pos + 1 - lo].float()
            if cache.v.kind == "f16":
                p = p.half().float()
            elif cache.v.kind == "bf16" and not fa:  # (-fa off: llama.cpp's P V in bf16 dot products)
                p = p.bfloat16().float()
            out[t, h] = (p.double() @ V[lo:pos + 1, h // G].double()).float()
    return out


MODES = {"tinyblas": cpu.ATTN_TINYBLAS, "vec_dot": cpu.ATTN_VEC_DOT, "fa_prompt": cpu.ATTN_FA_PROMPT,
         "fa_decode": cpu.ATTN_FA_DECODE}


def q_for(q, cache, mode):
    """What the model hands the kernel: q rounded to an f32 / f16 K's type without flash attention, fp32
    otherwise (the kernel rounds or quantizes it where llama.cpp does)."""
    fa = mode in (cpu.ATTN_FA_PROMPT, cpu.ATTN_FA_DECODE)
    return q if fa or cache.k.kind not in ("f32", "f16") else activation_for(q, cache.k.qtype)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0", "bf16", "q4_1", "iq4_nl"])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (12, 2, 128), (4, 1, 256)])
def test_attention_matches_reference_and_rows_are_batch_invariant(mode, kind, window, H, Hkv, D):
    mode = MODES[mode]
    g = torch.Generator().manual_seed(H * D + window)
    L, T = 90, 6
    cache = KVCache(1, 128, Hkv, D, D, kind, kind)
    cache.k.write(0, 0, torch.randn(L, Hkv, D, generator=g) * 3)
    cache.v.write(0, 0, torch.randn(L, Hkv, D, generator=g))
    start = L - T
    q = q_for(torch.randn(T, H, D, generator=g), cache, mode)
    scale = 1 / math.sqrt(D)
    out = cpu.attention(q, cache.k, cache.v, 0, start, window, scale, mode)
    # f16 V: fp16 probabilities (a p on a rounding boundary may round either way, ~5e-4 rel.), or
    # with flash attention an accumulator rounded to fp16 at every position
    fa = mode in (cpu.ATTN_FA_PROMPT, cpu.ATTN_FA_DECODE)
    tol = (dict(rtol=1e-2, atol=1e-2) if fa else dict(rtol=1e-3, atol=3e-3)) if kind == "f16" else dict(rtol=1e-5, atol=6e-5)
    q_ref = q
    if kind not in ("f32", "f16"):  # the kernel rounds q to K's vec_dot type (q8_0 / q8_1 blocks, bf16)
        q_ref, tol = activation_for(q, cache.k.qtype), dict(rtol=1e-3, atol=1e-3)  # (a code may round the other way)
        if kind == "q4_1":  # and q8_1 keeps each block's sum of q as fp16 for the min term (ggml's vec_dot)
            tol = dict(rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(out, reference(q_ref, cache, start, window, scale, fa=fa), **tol)
    # each row alone, and with another thread count, gives the same bits as inside the batch (passes
    # of fewer than 64 rows: llama.cpp's tiled flash attention starts at 64)
    n = torch.get_num_threads()
    try:
        for threads in {1, n}:
            torch.set_num_threads(threads)
            for t in (0, T - 1):
                one = cpu.attention(q[t:t + 1], cache.k, cache.v, 0, start + t, window, scale, mode)
                assert torch.equal(one[0], out[t])
    finally:
        torch.set_num_threads(n)


def pass_case(mode, kind, seed, H, Hkv, D, q_scale):
    """A 100-position cache of `kind` and a pass's q for `mode` (70 rows for a prompt pass: the tiled kernel,
    else 5), the q the reference takes, its tolerance -> (cache, q, q_ref, tol, T, L, fa, generator)."""
    g = torch.Generator().manual_seed(seed)
    L = 100
    cache = KVCache(1, 128, Hkv, D, D, kind, kind)
    cache.k.write(0, 0, torch.randn(L, Hkv, D, generator=g) * 3)
    cache.v.write(0, 0, torch.randn(L, Hkv, D, generator=g))
    T = 70 if mode == cpu.ATTN_FA_PROMPT else 5
    q = q_for(torch.randn(T, H, D, generator=g) * q_scale, cache, mode)
    fa = mode in (cpu.ATTN_FA_PROMPT, cpu.ATTN_FA_DECODE)
    q_ref = activation_for(q, cache.k.qtype) if kind not in ("f32", "f16") else q
    tol = (dict(rtol=1e-2, atol=1e-2) if fa else dict(rtol=1e-3, atol=3e-3)) if kind == "f16" else dict(rtol=1e-3, atol=1e-3)
    return cache, q, q_ref, tol, T, L, fa, g


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0", "q5_0"])
def test_attention_softcap(mode, kind):
    """Gemma 2's attention logit softcapping, softcap * tanh(s / softcap), in every mode, including a
    prompt pass long enough for the tiled kernel (>= 64 rows), against the reference; the cap changes
    the result (the scores reach past it)."""
    mode = MODES[mode]
    cache, q, q_ref, tol, T, L, fa, _ = pass_case(mode, kind, 7, 4, 1, 256, 0.5)
    for scale in (1.0, 0.0625):
        out = cpu.attention(q, cache.k, cache.v, 0, L - T, 37, scale, mode, softcap=10.0)
        torch.testing.assert_close(out, reference(q_ref, cache, L - T, 37, scale, softcap=10.0, fa=fa), **tol)
        plain = cpu.attention(q, cache.k, cache.v, 0, L - T, 37, scale, mode)
        assert (out - plain).abs().max() > 0.05
        if mode != cpu.ATTN_FA_PROMPT:  # rows alone are the rows of the pass
            assert torch.equal(cpu.attention(q[2:3], cache.k, cache.v, 0, L - T + 2, 37, scale, mode, softcap=10.0)[0], out[2])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0", "q4_0"])
def test_attention_sinks(mode, kind):
    """gpt-oss's attention sinks (one logit per head in the softmax's denominator) in every mode and cache
    type, a tiled prompt pass (>= 64 rows) included, against the reference; rows alone are the pass's."""
    mode = MODES[mode]
    H = 8
    cache, q, q_ref, tol, T, L, fa, g = pass_case(mode, kind, 17, H, 2, 64, 1.0)
    sk = sink_logits(H, g)
    out = cpu.attention(q, cache.k, cache.v, 0, L - T, 37, 0.125, mode, sinks=sk)
    torch.testing.assert_close(out, reference(q_ref, cache, L - T, 37, 0.125, sinks=sk), **tol)
    assert (out - cpu.attention(q, cache.k, cache.v, 0, L - T, 37, 0.125, mode)).abs().max() > 0.05
    if mode != cpu.ATTN_FA_PROMPT:
        assert torch.equal(cpu.attention(q[2:3], cache.k, cache.v, 0, L - T + 2, 37, 0.125, mode, sinks=sk)[0], out[2])
    with pytest.raises(ValueError):
        cpu.attention(q, cache.k, cache.v, 0, L - T, 37, 0.125, mode, sinks=sk[:4])


def test_softcap_is_libm_tanhf_in_float_steps():
    """Final logit softcapping as ggml computes it: x * (1 / cap) in float, libm's tanhf, times cap."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.tanhf.restype, libm.tanhf.argtypes = ctypes.c_float, [ctypes.c_float]
    x = torch.randn(3000, generator=torch.Generator().manual_seed(3)) * 40
    x[:4] = torch.tensor([0.0, -0.0, 1e-30, 500.0])
    inv = np.float32(1) / np.float32(30)
    want = [np.float32(libm.tanhf(float(np.float32(v) * inv))) * np.float32(30) for v in x.numpy()]
    got = cpu.softcap(x.clone(), 30.0)
    assert got.numpy().tobytes() == np.array(want, np.float32).tobytes()


def test_short_conv_is_ggml_ssm_conv_with_fmas():
    """LFM2's convolution as ggml_ssm_conv sums it in a native build (GCC contracts `sumf += s * c` into FMAs):
    per channel, the taps times the last 3 positions, oldest first, each product added with libm's fmaf. The
    same values with a plain multiply-then-add differ in some elements: the test tells the two apart."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.fmaf.restype, libm.fmaf.argtypes = ctypes.c_float, [ctypes.c_float] * 3
    g = torch.Generator().manual_seed(5)
    T, D, width = 5, 48, 3
    ext, w = torch.randn(T + width - 1, D, generator=g), torch.randn(D, width, generator=g)
    got = cpu.short_conv(ext, w)
    want = np.zeros((T, D), np.float32)
    plain = np.zeros((T, D), np.float32)
    e, ww = ext.numpy(), w.numpy()
    for t in range(T):
        for c in range(D):
            s = p = np.float32(0)
            for j in range(width):
                s = np.float32(libm.fmaf(float(e[t + j, c]), float(ww[c, j]), float(s)))
                p = np.float32(p + e[t + j, c] * ww[c, j])
            want[t, c], plain[t, c] = s, p
    assert got.numpy().tobytes() == want.tobytes()
    assert not np.array_equal(plain, want)
    with pytest.raises(ValueError):
        cpu.short_conv(ext[:, :10], w)


def test_gated_delta_net_recurrence():
    """sharpi_gdn is the gated delta rule (ggml_gated_delta_net): per value head, S <- S * exp(g), S += k outer
    (v - S^T k) * beta, out = S^T q / sqrt(S) (a float64 reference within float error), value head h on key head
    h % Hk; each token's state lands in the next ring slot, so running a pass token by token from the same ring gives
    the same bits and the same states. gdn_gates: softplus(alpha + dt) * a (x itself above 20) and sigmoid(beta) with
    libm's expf / logf, as ggml's scalar ops."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    libm.logf.restype, libm.logf.argtypes = ctypes.c_float, [ctypes.c_float]
    g = torch.Generator().manual_seed(7)
    T, Hk, Hv, S, R = 5, 2, 4, 64, 8
    q, k = torch.randn(T, Hk, S, generator=g) / 8, torch.randn(T, Hk, S, generator=g) / 8
    v = torch.randn(T, Hv, S, generator=g)
    decay, beta = -torch.rand(T, Hv, generator=g), torch.rand(T, Hv, generator=g)
    ring = torch.zeros(R, Hv, S, S)
    ring[6] = torch.randn(Hv, S, S, generator=g) / 4  # the state before the pass, in slot 6
    out = cpu.gdn(q, k, v, decay, beta, ring, 6)
    st = ring[6].double().transpose(1, 2)  # [Hv, S (k), S (v)]: the kernel's rows are the columns
    for t in range(T):
        kk, qq = k[t].double()[torch.arange(Hv) % Hk], q[t].double()[torch.arange(Hv) % Hk]  # [Hv, S]
        st = st * decay[t].double().exp()[:, None, None]
        delta = (v[t].double() - torch.einsum("hij,hi->hj", st, kk)) * beta[t].double()[:, None]
        st = st + kk[:, :, None] * delta[:, None, :]
        want = torch.einsum("hij,hi->hj", st, qq) / math.sqrt(S)
        assert torch.allclose(out[t].double(), want, rtol=1e-4, atol=1e-5), t
        assert torch.allclose(ring[(6 + t + 1) % R].double().transpose(1, 2), st, rtol=1e-4, atol=1e-5), t
    ring2 = ring.clone()
    ring2[(6 + 1) % R:].zero_()
    ring2[:(6 + T + 1) % R].zero_()
    steps = torch.cat([cpu.gdn(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1].contiguous(),
                               beta[t:t + 1].contiguous(), ring2, 6 + t) for t in range(T)])
    assert torch.equal(steps, out) and torch.equal(ring2, ring)
    with pytest.raises(ValueError):
        cpu.gdn(q, k, v[:, :3].contiguous(), decay, beta, ring, 0)  # 3 value heads on 2 key heads

    alpha = torch.tensor([[-3.0, 0.5, 19.0, 25.0]])
    b = torch.tensor([[-2.0, 0.0, 1.5, 30.0]])
    dt, a = torch.tensor([0.25, -0.5, 1.5, 0.0]), torch.tensor([-1.0, -2.5, -0.75, -4.0])
    want_g = [np.float32((x if x > 20 else libm.logf(float(np.float32(1) + np.float32(libm.expf(float(x)))))) * aa)
              for x, aa in zip((alpha[0] + dt).numpy(), a.numpy())]
    want_b = [np.float32(1) / (np.float32(1) + np.float32(libm.expf(float(-x)))) for x in b[0].numpy()]
    cpu.gdn_gates(alpha, b, dt, a)
    assert alpha[0].numpy().tobytes() == np.array(want_g, np.float32).tobytes()
    assert b[0].numpy().tobytes() == np.array(want_b, np.float32).tobytes()
    assert cpu.sigmoid(torch.tensor([-2.0, 0.0, 1.5, 30.0])).numpy().tobytes() == np.array(want_b, np.float32).tobytes()


def test_attention_rejects_bad_shapes():
    cache = KVCache(1, 8, 1, 40, 40, "f32", "f32")  # head size not a multiple of 16
    with pytest.raises(ValueError, match="rejected"):
        cpu.attention(torch.zeros(1, 1, 40), cache.k, cache.v, 0, 0, 0, 1.0)


@pytest.mark.parametrize("shape,block,f16_scale", [((5, 576), 32, True), ((3, 1536), 256, False),
                                                   ((2, 9, 64), 32, True), ((1, 8960), 256, False)])
def test_round_q8_is_bit_identical_to_the_torch_expression(shape, block, f16_scale):
    g = torch.Generator().manual_seed(block + shape[-1])
    x = torch.randn(*shape, generator=g) * torch.rand(*shape, generator=g) * 10
    x[0, ..., :block] = 0  # an all-zero block (d = 0)
    x.view(-1)[-1] = 1e-30  # tiny values next to large ones
    assert torch.equal(cpu.round_q8(x, block, f16_scale), quantize_q8_blocks(x, block, f16_scale))


def test_rms_norm_matches_torch():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 576, generator=g) * 3, torch.randn(576, generator=g)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (576,), w, 1e-5),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cpu.rms_norm(x.view(4, 9, 64), None, 1e-6),
                               torch.nn.functional.rms_norm(x.view(4, 9, 64), (64,), None, 1e-6), rtol=1e-5, atol=1e-6)


# -- exact emulations of llama.cpp's x86 arithmetic in its AVX-512 builds (what ops.c documents) --------
# fma(a, b, c) of fp32 values: the product is exact in fp64 and the fp64 sum rounds to fp32 (a
# double rounding could differ from a true fma once in ~2^29 operations; fixed seeds below).

def _fma(a, b, c):
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float32)


def _f(h: str) -> np.float32:
    return np.float32(float.fromhex(h))


def ggml_expf_avx512(x):
    """ggml_v_expf (ggml-cpu/vec.h, the __m512 version), element by element in numpy."""
    with np.errstate(all="ignore"):  # -inf inputs: NaN in b, replaced by the |n| > 192 branch
        return _expf_avx512(np.asarray(x, np.float32))


def _expf_avx512(x):
    r = _f("0x1.8p23")
    z = _fma(x, _f("0x1.715476p+0"), r)
    n = (z - r).astype(np.float32)
    b = _fma(-n, _f("0x1.7f7d1cp-20"), _fma(-n, _f("0x1.62e4p-1"), x))
    u = (b * b).astype(np.float32)
    j = _fma(_fma(_fma(_f("0x1.0e4020p-7"), b, _f("0x1.573e2ep-5")), u, _fma(_f("0x1.555e66p-3"), b, _f("0x1.fffdb6p-2"))),
             u, _fma(_f("0x1.ffffecp-1"), b, np.float32(1)))
    res = np.ldexp(j, np.nan_to_num(np.clip(n, -300, 300)).astype(np.int32)).astype(np.float32)  # vscalefps
    return np.where(np.abs(n) > 192, np.where(n <= 0, np.float32(0), np.float32(np.inf)), res).astype(np.float32)


def reduce16(v):
    """_mm512_reduce_add_ps as GCC computes it, over the last axis of 16."""
    t3 = (v[..., 8:16] + v[..., 0:8]).astype(np.float32)
    t6 = (t3[..., 4:8] + t3[..., 0:4]).astype(np.float32)
    return ((t6[..., 0] + t6[..., 2]).astype(np.float32) + (t6[..., 1] + t6[..., 3]).astype(np.float32)).astype(np.float32)


def vec_dot_reduce(v):
    """ggml_vec_dot_f16's accumulators [..., 64] (4 x 16 lanes) summed as GGML_F32x16_REDUCE does."""
    x = ((v[..., 0:16] + v[..., 32:48]).astype(np.float32) + (v[..., 16:32] + v[..., 48:64]).astype(np.float32))
    return reduce16(x.astype(np.float32))


_LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
_LIBM.expf.restype, _LIBM.expf.argtypes = ctypes.c_float, [ctypes.c_float]


def libm_expf(x) -> np.float32:
    """The C library's expf (ggml's scalar code calls it; numpy's exp is another implementation)."""
    return np.float32(_LIBM.expf(float(x)))


def test_glu_silu_is_ggml_swiglu_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(3, 2 * 1536, generator=g) * 6
    gu[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0, 1e-30, -1e-30])
    got = cpu.glu(gu, 1536, "silu").numpy()
    x, u = gu[:, :1536].numpy(), gu[:, 1536:].numpy()
    with np.errstate(over="ignore"):
        want = ((x / (np.float32(1) + ggml_expf_avx512(-x))).astype(np.float32) * u).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    torch.testing.assert_close(torch.from_numpy(got), torch.nn.functional.silu(gu[:, :1536]) * gu[:, 1536:],
                               rtol=2e-6, atol=1e-6)


def test_glu_swiglu_oai_is_ggml_bit_for_bit():
    """gpt-oss's activation as ggml_swiglu_oai computes it: x = min(g, 7), x / (1 + expf(1.702f * -x)) with
    libm's expf, times clamp(u, -7, 7) + 1, each in float; the clamps bite (values past +-7 on both sides)."""
    g = torch.Generator().manual_seed(5)
    n = 96
    gu = torch.randn(3, 2 * n, generator=g) * 5
    gu[0, :4] = torch.tensor([7.0, 9.5, -60.0, 0.0])
    got = cpu.glu(gu, n, "swiglu_oai").numpy()
    x, u = np.minimum(gu[:, :n].numpy(), np.float32(7)), np.clip(gu[:, n:].numpy(), np.float32(-7), np.float32(7))
    e = np.array([libm_expf(np.float32(1.702) * np.float32(-v)) for v in x.ravel()], np.float32).reshape(x.shape)
    want = ((x / (np.float32(1) + e)).astype(np.float32) * (u + np.float32(1))).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert (np.abs(gu[:, n:].numpy()) > 7).any() and (gu[:, :n].numpy() > 7).any()


def test_glu_gelu_uses_ggml_fp16_table():
    g = torch.Generator().manual_seed(4)
    n = 2048
    gu = torch.randn(2, 2 * n, generator=g) * 4
    gu[0, :4] = torch.tensor([-10.0, 10.0, -12.0, 15.0])
    got = cpu.glu(gu, n, "gelu_tanh")
    x, u = gu[:, :n], gu[:, n:]
    xh = x.half().float()  # the table's argument, then ggml_gelu_f32 in fp32, rounded to fp16
    inner = torch.tensor(math.sqrt(2 / math.pi), dtype=torch.float32) * xh * (1 + 0.044715 * xh * xh)
    table = (0.5 * xh * (1 + torch.tanh(inner))).half().float()
    want = torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x * u, table * u))
    # fp32 tanh implementations differ by an ulp, and 1 + tanh cancels for x < -2 (values < 0.05):
    # equal bits elsewhere but for a rare fp16 rounding tie, close everywhere
    body = x > -2
    assert (got == want)[body].float().mean() > 0.999
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert torch.equal(got[0, :4], torch.stack([torch.tensor(0.0), 10 * u[0, 1], torch.tensor(0.0), 15 * u[0, 3]]))


def each_row_head(q, cache, start, window):
    """(t, h, lo, pos, K, V, q[t, h]) for every row and head of a pass: the row's position, the first
    position it sees, and the cache's K / V [positions, dims] of the head's KV group as numpy."""
    T, H, _ = q.shape
    K, V = cache.k.read(0, start + T).numpy(), cache.v.read(0, start + T).numpy()
    G = H // K.shape[1]
    for t in range(T):
        pos = start + t
        lo = max(0, pos - window + 1) if window else 0
        for h in range(H):
            yield t, h, lo, pos, K[:, h // G], V[:, h // G], q[t, h].numpy()


def attention_ggml_non_fa(q, cache, start, window, scale, decode_order, sinks=None):
    """llama.cpp's non-flash-attention CPU path (-fa off) on an AVX-512 build, emulated in numpy for an
    f16 cache: KQ and KQV by tinyBLAS (16 lanes, passes of >= 2 rows) or by ggml_vec_dot_f16 (4 x 16
    lanes, one row), softmax by ggml_vec_soft_max_f32 (groups of 16 counted from position 0); with sinks,
    ggml_soft_max_ext's: the head's sink joins the max, libm's expf of it the double sum."""
    nl = 64 if decode_order else 16
    reduce = vec_dot_reduce if decode_order else reduce16
    out = np.empty((*q.shape[:2], cache.v.q.shape[-1]), np.float32)
    for t, h, lo, pos, Kh, Vh, qh in each_row_head(q, cache, start, window):
        Kh, Vh = Kh[lo:pos + 1], Vh[lo:pos + 1]
        acc = np.zeros((Kh.shape[0], nl), np.float32)
        for d in range(0, len(qh), nl):
            acc = _fma(Kh[:, d:d + nl], qh[d:d + nl], acc)
        s = (reduce(acc) * np.float32(scale)).astype(np.float32)
        mx = s.max() if sinks is None else max(s.max(), sinks[h])
        e = ggml_expf_avx512((s - mx).astype(np.float32))
        grp = np.zeros(((lo % 16) + len(e) + 15) // 16 * 16, np.float32)
        grp[lo % 16:lo % 16 + len(e)] = e
        total = sum(float(v) for v in reduce16(grp.reshape(-1, 16)))
        if sinks is not None:
            total += float(libm_expf(np.float32(sinks[h]) - mx))
        p = (e * np.float32(1.0 / total)).astype(np.float32).astype(np.float16).astype(np.float32)
        lanes = np.zeros((nl, Vh.shape[1]), np.float32)
        for j in range(len(p)):
            r = (lo + j) % nl
            lanes[r] = _fma(Vh[j], p[j], lanes[r])
        out[t, h] = reduce(lanes.T)
    return torch.from_numpy(out)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("decode_order", [False, True])
@pytest.mark.parametrize("window", [0, 37])
def test_attention_is_llamacpp_non_fa_bit_for_bit(window, decode_order, sinks):
    g = torch.Generator().manual_seed(7 + window)
    H, Hkv, D, L, T = 6, 2, 64, 83, 3
    cache = KVCache(1, 128, Hkv, D, D, "f16", "f16")
    cache.k.write(0, 0, torch.randn(L, Hkv, D, generator=g) * 3)
    cache.v.write(0, 0, torch.randn(L, Hkv, D, generator=g))
    q = activation_for(torch.randn(T, H, D, generator=g), cache.k.qtype)
    sk = sink_logits(H, g) if sinks else None
    modes = (cpu.ATTN_TINYBLAS, cpu.ATTN_VEC_DOT)
    got = cpu.attention(q, cache.k, cache.v, 0, L - T, window, 0.125, modes[decode_order], sinks=sk)
    assert torch.equal(got, attention_ggml_non_fa(q, cache, L - T, window, 0.125, decode_order,
                                                  None if sk is None else sk.numpy()))
    assert not torch.equal(got, cpu.attention(q, cache.k, cache.v, 0, L - T, window, 0.125, modes[not decode_order],
                                              sinks=sk))


def fa_chunk_ggml(qh, Kh, Vh, scale):
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk for one row over the visible positions of a
    chunk (f16 K and V): q rounded to fp16, ggml_vec_dot_f16 scores, online softmax with libm's expf,
    the V accumulator rounded to fp16 at every step, S = fma(S, ms, vs) (GCC contracts it).
    -> (M, S, accumulator as fp32)."""
    q16 = qh.astype(np.float16).astype(np.float32)
    M, S = np.float32(-np.inf), np.float32(0)
    acc = np.zeros(Vh.shape[1], np.float16)
    for j in range(Kh.shape[0]):
        s = (_dot_vec_dot(Kh[j], q16) * np.float32(scale)).astype(np.float32)
        ms, vs = np.float32(1), np.float32(1)
        if s > M:
            ms, M = libm_expf(M - s), s
            acc = (acc.astype(np.float32) * ms).astype(np.float32).astype(np.float16)
        else:
            vs = libm_expf(s - M)
        acc = _fma(Vh[j], vs, acc.astype(np.float32)).astype(np.float16)
        S = _fma(S, ms, vs)
    return M, S, acc.astype(np.float32)


def fa_chunk_ggml_q8_0(qh, Kc, Kd, V, scale):
    """The one-chunk kernel against a q8_0 K and V: q quantized by quantize_row_q8_0, scores by
    ggml_vec_dot_q8_0_q8_0 (per block 8 lanes of 4 exact products, fma(d_k * d_q, lane, acc),
    hsum_float_8), V dequantized (code * d) into an fp32 accumulator. Kc int8 [n, D], Kd [n, D/32]."""
    qc, qd, _ = ggml_quantize_q8_0(qh[None], False)
    qc, qd = qc[0].astype(np.int64), qd[0]
    M, S = np.float32(-np.inf), np.float32(0)
    acc = np.zeros(V.shape[1], np.float32)
    for j in range(Kc.shape[0]):
        a = np.zeros(8, np.float32)
        for b in range(Kc.shape[1] // 32):
            lanes = (Kc[j, 32 * b:32 * b + 32].astype(np.int64) * qc[32 * b:32 * b + 32]).reshape(8, 4).sum(1)
            a = _fma(np.float32(Kd[j, b] * qd[b]), lanes.astype(np.float32), a)
        s = np.float32(hsum_float_8(a) * np.float32(scale))
        ms, vs = np.float32(1), np.float32(1)
        if s > M:
            ms, M = libm_expf(M - s), s
            acc = (acc * ms).astype(np.float32)
        else:
            vs = libm_expf(s - M)
        acc = _fma(V[j], vs, acc)
        S = _fma(S, ms, vs)
    return (acc * (np.float32(1) / S)).astype(np.float32)


def test_attention_flash_q8_0_cache_is_llamacpp_bit_for_bit():
    g = torch.Generator().manual_seed(13)
    H, Hkv, D, L, T = 4, 2, 64, 70, 3
    cache = KVCache(1, 256, Hkv, D, D, "q8_0", "q8_0")
    cache.k.write(0, 0, torch.randn(L, Hkv, D, generator=g) * 3)
    cache.v.write(0, 0, torch.randn(L, Hkv, D, generator=g))
    # the cache's codes are ggml's quantize_row_q8_0 of what was written
    x = (torch.randn(5, Hkv, D, generator=g) * 2)
    cache.k.write(0, L, x)
    codes, d, _ = ggml_quantize_q8_0(x.reshape(-1, D).numpy(), False)
    assert np.array_equal(cache.k.q[0, L:L + 5].reshape(-1, D).numpy(), codes)
    assert np.array_equal(cache.k.d[0, L:L + 5].float().reshape(-1, D // 32).numpy(), d)
    q = torch.randn(T, H, D, generator=g)
    for mode in (cpu.ATTN_FA_PROMPT, cpu.ATTN_FA_DECODE):
        got = cpu.attention(q, cache.k, cache.v, 0, L - T, 0, 0.125, mode).numpy()
        Kc, Kd = cache.k.q[0].numpy(), cache.k.d[0, ..., 0].float().numpy()
        V = cache.v.read(0, L).numpy()
        for t in range(T):
            for h in range(H):
                gk = h // (H // Hkv)
                want = fa_chunk_ggml_q8_0(q[t, h].numpy(), Kc[:L - T + t + 1, gk], Kd[:L - T + t + 1, gk],
                                          V[:L - T + t + 1, gk], 0.125)
                assert np.array_equal(got[t, h], want), (mode, t, h)


def _dot_vec_dot(k, q):
    """ggml_vec_dot_f16 of an AVX-512 build for a length multiple of 64: 4 x 16 lanes, 64 a step."""
    acc = np.zeros(64, np.float32)
    for d in range(0, len(k), 64):
        acc = _fma(k[d:d + 64], q[d:d + 64], acc)
    return vec_dot_reduce(acc)


def fa_sink_ggml(s, M, S, acc, fused):
    """ggml's attention sink after a row's first KV chunk (fp32 accumulator): a new max rescales, else the
    sum gains expf(s - M); S * ms + vs one FMA in the tiled kernel (fused), a multiply and an add in the
    one-chunk kernel, as GCC compiled the fixtures' build."""
    s, ms, vs = np.float32(s), np.float32(1), np.float32(1)
    if s > M:
        ms, M = libm_expf(M - s), s
        acc = (acc * ms).astype(np.float32)
    else:
        vs = libm_expf(s - M)
    return M, _fma(S, ms, vs) if fused else np.float32(np.float32(S * ms) + vs), acc


def fa_tiled_ggml(qh, K, V, lo, pos, scale, sink=None):
    """ggml_compute_forward_flash_attn_ext_tiled for one row: KV tiles of 64 from position 0, scores as
    one fp32 FMA chain over the head dims (q in fp32), per tile max / expf rescale / the tile's exps
    (ggml_v_expf) summed in groups of 16 into the float S, V accumulated in fp32 position by position."""
    M, S = np.float32(-np.inf), np.float32(0)
    acc = np.zeros(V.shape[1], np.float32)
    for t0 in range(lo // 64 * 64, pos + 1, 64):
        idx = [i for i in range(t0, t0 + 64) if lo <= i <= pos]
        p = np.full(64, -np.inf, np.float32)
        for i in idx:
            sc = np.float32(0)
            for d in range(K.shape[1]):
                sc = _fma(K[i, d], qh[d], sc)
            p[i - t0] = np.float32(sc * np.float32(scale))
        mn = np.float32(max(M, p.max()))
        if mn > M:
            ms = libm_expf(M - mn)
            acc = (acc * ms).astype(np.float32)
            S = np.float32(S * ms)
        M = mn
        e = ggml_expf_avx512((p - mn).astype(np.float32))
        S = np.float32(float(S) + sum(float(v) for v in reduce16(e.reshape(4, 16))))
        for i in idx:
            acc = _fma(V[i], e[i - t0], acc)
    if sink is not None:
        M, S, acc = fa_sink_ggml(sink, M, S, acc, True)
    return (acc * np.float32(0 if S == 0 else np.float32(1) / S)).astype(np.float32)


def attention_ggml_fa(q, cache, start, window, scale, mode, n_ctx, sinks=None):
    """llama.cpp's flash attention on an AVX-512 build with 2 threads (the fixtures' build), f16 cache:
    a prompt pass of >= 64 rows tiled, shorter passes one chunk per row; a decoding row one chunk, or
    two (the KV range padded to 256 positions split in halves) merged as ggml_flash_attn_ext_reduce_
    partials does once that padded length reaches 512. sinks [H]: each head's sink, added to the state of
    the first chunk (computed even when none of its positions is visible)."""
    T = q.shape[0]
    out = np.empty((*q.shape[:2], cache.v.q.shape[-1]), np.float32)
    for t, h, lo, pos, Kh, Vh, qh in each_row_head(q, cache, start, window):
        sink = None if sinks is None else sinks[h]
        if mode == cpu.ATTN_FA_PROMPT and T >= 64:
            out[t, h] = fa_tiled_ggml(qh, Kh, Vh, lo, pos, scale, sink)
            continue
        n_kv = min(n_ctx, (pos + 1 + 255) // 256 * 256)
        chunks = [(lo, pos + 1)]
        if mode == cpu.ATTN_FA_DECODE and n_kv >= 512:
            cs = n_kv // 2
            chunks = [(max(lo, c * cs), min((c + 1) * cs, pos + 1)) for c in range(2)]
        M, S, acc = np.float32(-np.inf), np.float32(0), np.zeros(Vh.shape[1], np.float32)
        for c, (a, b) in enumerate(chunks):
            if a >= b and not (c == 0 and sink is not None):
                continue
            mc, sc, part = fa_chunk_ggml(qh, Kh[a:b], Vh[a:b], scale)
            if c == 0 and sink is not None:
                mc, sc, part = fa_sink_ggml(sink, mc, sc, part, False)
            if len(chunks) == 1:
                M, S, acc = mc, sc, part
                continue
            mn = np.float32(max(M, mc))
            so, sn = libm_expf(M - mn), libm_expf(mc - mn)
            acc = _fma(acc, so, (part * sn).astype(np.float32))
            S = _fma(S, so, np.float32(sc * sn))
            M = mn
        out[t, h] = (acc * np.float32(0 if S == 0 else np.float32(1) / S)).astype(np.float32)
    return torch.from_numpy(out)


FA_CASES = {  # L, T, mode, window, H, Hkv[, D (64)]
    "short prompt": (40, 5, cpu.ATTN_FA_PROMPT, 0, 4, 2),
    "tiled prompt": (100, 70, cpu.ATTN_FA_PROMPT, 37, 4, 2),
    # the kernel runs 4 (row, head) pairs of a KV head together: runs across rows, a last run of one pair,
    # rows of one head (no GQA), and head dims past a multiple of 64 (80: V in blocks of 64, then 16)
    "tiled prompt, 3 heads a KV head": (100, 67, cpu.ATTN_FA_PROMPT, 0, 3, 1),
    "tiled prompt, a head a KV head": (140, 65, cpu.ATTN_FA_PROMPT, 50, 5, 5),
    "tiled prompt, 80 dims": (90, 64, cpu.ATTN_FA_PROMPT, 0, 6, 2, 80),
    "decode": (90, 2, cpu.ATTN_FA_DECODE, 0, 4, 2),
    "decode, two chunks": (300, 2, cpu.ATTN_FA_DECODE, 0, 4, 2),
    # rows padded to 256 and to 512 positions (one chunk, two) in one run of tasks a thread takes
    "decode, one and two chunks": (259, 5, cpu.ATTN_FA_DECODE, 0, 3, 1),
    # a window that leaves the first of two chunks empty
    "decode, window past the first chunk": (600, 3, cpu.ATTN_FA_DECODE, 200, 6, 2),
    "decode, odd head count": (50, 3, cpu.ATTN_FA_DECODE, 0, 5, 5),
}


def sink_logits(H, g):
    """Sink logits [H] around the scaled scores' range (some above every score of a row, some far below)."""
    s = torch.randn(H, generator=g) * 2
    s[0], s[-1] = 8.0, -30.0
    return s


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("case", list(FA_CASES))
def test_attention_is_llamacpp_flash_attention_bit_for_bit(case, sinks):
    g = torch.Generator().manual_seed(11)
    L, T, mode, window, H, Hkv, D = (*FA_CASES[case], 64)[:7]
    cache = KVCache(1, 1024, Hkv, D, D, "f16", "f16")
    cache.k.write(0, 0, torch.randn(L, Hkv, D, generator=g) * 3)
    cache.v.write(0, 0, torch.randn(L, Hkv, D, generator=g))
    q = torch.randn(T, H, D, generator=g)
    sk = sink_logits(H, g) if sinks else None
    got = cpu.attention(q, cache.k, cache.v, 0, L - T, window, 0.125, mode, sinks=sk)
    assert torch.equal(got, attention_ggml_fa(q, cache, L - T, window, 0.125, mode, 1024, None if sk is None else sk.numpy()))
    n = torch.get_num_threads()
    try:  # whichever thread takes a run
        torch.set_num_threads(1)
        assert torch.equal(got, cpu.attention(q, cache.k, cache.v, 0, L - T, window, 0.125, mode, sinks=sk))
    finally:
        torch.set_num_threads(n)
    if sinks:  # (they take weight from every row)
        assert not torch.equal(got, cpu.attention(q, cache.k, cache.v, 0, L - T, window, 0.125, mode))


def test_rope_is_ggml_rope_bit_for_bit():
    """ggml's rope cache (theta multiplied up in float by powf(base, -2/n_rot), libm cosf / sinf) and
    rotate_pairs as GCC contracts it: x0 c - x1 s = fma(x0, c, -(x1 s)), x0 s + x1 c = fma(x0, s, x1 c)."""
    import ctypes
    import ctypes.util
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    for f in ("powf", "cosf", "sinf"):
        getattr(libm, f).restype = ctypes.c_float
    libm.powf.argtypes = [ctypes.c_float, ctypes.c_float]
    libm.cosf.argtypes = libm.sinf.argtypes = [ctypes.c_float]
    f32 = np.float32
    for base, n_rot in ((10000.0, 64), (1e6, 128), (100000.0, 32)):
        n = 40
        tab = cpu.rope_table(base, 1.0, n, n_rot)
        ts = f32(libm.powf(base, f32(-2.0) / f32(n_rot)))
        want = np.zeros((n, n_rot // 2), np.complex64)
        for p in range(n):
            th = f32(p)
            for i in range(n_rot // 2):
                want[p, i] = complex(libm.cosf(th), libm.sinf(th))
                th = f32(th * ts)
        assert np.array_equal(tab.numpy(), want), base
        g = torch.Generator().manual_seed(n_rot)
        x = torch.randn(n, 3, n_rot + 16, generator=g) * 10
        y = cpu.rope(x.clone(), tab)
        x0, x1 = x[..., 0:n_rot:2].double().numpy(), x[..., 1:n_rot:2].double().numpy()
        c, s = tab.real.double().numpy()[:, None], tab.imag.double().numpy()[:, None]
        r0 = (x0 * c - (x1 * s).astype(f32)).astype(f32)  # x0 * c exact in double: one rounding
        r1 = (x0 * s + (x1 * c).astype(f32)).astype(f32)
        assert np.array_equal(y[..., 0:n_rot:2].numpy(), r0) and np.array_equal(y[..., 1:n_rot:2].numpy(), r1)
        assert torch.equal(y[..., n_rot:], x[..., n_rot:])  # dims past n_rot untouched


@pytest.mark.parametrize("qtype, k", [(Q.F32, 1088), (Q.F16, 1056)], ids=["F32", "F16"])
def test_float_weights_take_ggml_orders(qtype, k):
    """F32 / F16 weights (F16: the activations rounded to fp16 first, ggml's vec_dot type) summed as
    ggml's mul_mat sums them: ggml_vec_dot_f32 / _f16 for one-row passes and verify rows (4 x 16 lanes
    over 64 a step, GGML_F32x16_REDUCE, the f16 tail in double), tinyBLAS for prompt passes of >= 2
    rows (one 16-lane accumulator, _mm512_reduce_add_ps) of a weight whose rows are a multiple of 4 (tinyBLAS's
    tiles; ggml's vec_dot for the others), at any T (no sgemm for long prompts)."""
    g = torch.Generator().manual_seed(11)
    for n, T in ((36, 1), (36, 3), (36, 5), (36, cpu.GEMM_MIN_ROWS + 1), (37, 5), (1, 3)):
        w = (torch.randn(n, k, generator=g) * 0.05).numpy()
        raw = w.astype(np.float16) if qtype == Q.F16 else w
        wf = raw.astype(np.float32)
        x = torch.randn(T, k, generator=g) * 2
        xf = x.numpy().astype(np.float16).astype(np.float32) if qtype == Q.F16 else x.numpy()
        for prompt in (False, True):
            got = cpu.qmatmul(x, torch.from_numpy(raw.copy()), qtype, n, k, act_quant=qtype == Q.F16, prompt=prompt)
            if prompt and T >= 2 and n % 4 == 0:
                acc = np.zeros((T, n, 16), np.float32)
                for d in range(0, k, 16):
                    acc = _fma(xf[:, None, d:d + 16], wf[None, :, d:d + 16], acc)
                want = reduce16(acc)
            else:
                np_ = k // 64 * 64
                acc = np.zeros((T, n, 64), np.float32)
                for d in range(0, np_, 64):
                    acc = _fma(xf[:, None, d:d + 64], wf[None, :, d:d + 64], acc)
                want = vec_dot_reduce(acc)
                if np_ < k:  # ggml_vec_dot_f16's tail: float products added one by one in double
                    tail = (xf[:, None, np_:] * wf[None, :, np_:]).astype(np.float32).astype(np.float64)
                    sd = want.astype(np.float64)
                    for i in range(k - np_):
                        sd = sd + tail[..., i]
                    want = sd.astype(np.float32)
            np.testing.assert_array_equal(got.numpy(), want, err_msg=f"n={n} T={T} prompt={prompt}")


def test_bf16_weights_take_ggml_orders():
    """BF16 weights: ggml_vec_dot_bf16 / tinyBLAS with the CPU's AVX512-BF16 dot products where it has them
    (as llama.cpp built natively; the bits are that instruction's, checked against libllama in test_archs'
    float derivative), else their AVX512F code. Here: close to the exact sums of the bf16-rounded operands,
    verify rows equal one-row passes, and prompt rows computed in 4 x 4 tiles equal those computed alone."""
    g = torch.Generator().manual_seed(12)
    n, k = 37, 1056  # a tail past the 64-element steps; rows past the 4-row tiles
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    raw = w.view(torch.int16).numpy().view(np.uint16)
    x = torch.randn(9, k, generator=g) * 2
    exact = x.bfloat16().double() @ w.double().T
    rw = torch.from_numpy(raw.copy())
    one = torch.cat([cpu.qmatmul(x[t:t + 1].contiguous(), rw, Q.BF16, n, k, act_quant=True) for t in range(9)])
    torch.testing.assert_close(one.double(), exact, rtol=1e-4, atol=1e-4)
    assert torch.equal(cpu.qmatmul(x, rw, Q.BF16, n, k, act_quant=True), one)  # decoding rows at any T
    tiled = cpu.qmatmul(x, rw, Q.BF16, n, k, act_quant=True, prompt=True)
    torch.testing.assert_close(tiled.double(), exact, rtol=1e-4, atol=1e-4)
    alone = torch.cat([cpu.qmatmul(x[t:t + 2].contiguous(), rw, Q.BF16, n, k, act_quant=True, prompt=True)
                       for t in (0, 2, 4, 6)] + [cpu.qmatmul(x[7:9].contiguous(), rw, Q.BF16, n, k, act_quant=True,
                                                             prompt=True)[1:]])
    assert torch.equal(tiled, alone)


_BF16_V_CASES = [(kk, mode, window, H, Hkv, D) for kk in ("bf16", "f16", "q8_0") for mode in ("tinyblas", "vec_dot")
                 for window in (0, 100) for H, Hkv, D in ((9, 3, 64), (4, 1, 256))]


def bf16_v_rows_and_pass(cases) -> dict:
    """-fa off with a bf16 V: a 20-row pass (V transposed once, as llama.cpp's cache holds it) and each of its rows
    as a one-row pass (V read row by row: pv_bf16_rows), 270..289 positions deep (blocks of 64 positions cut
    by the window and the pass) -> {case: (pass, rows)}."""
    out = {}
    for kk, mode, window, H, Hkv, D in cases:
        g = torch.Generator().manual_seed(H * D + window)
        L, T = 290, 20
        cache = KVCache(1, 320, Hkv, D, D, kk, "bf16")
        cache.k.write(0, 0, torch.randn(L, Hkv, D, generator=g) * 3)
        cache.v.write(0, 0, torch.randn(L, Hkv, D, generator=g))
        m = MODES[mode]
        q = q_for(torch.randn(T, H, D, generator=g), cache, m)
        whole = cpu.attention(q, cache.k, cache.v, 0, L - T, window, 1 / math.sqrt(D), m)
        rows = torch.cat([cpu.attention(q[t:t + 1], cache.k, cache.v, 0, L - T + t, window, 1 / math.sqrt(D), m)
                          for t in range(T)])
        out[kk, mode, window, H, Hkv, D] = (whole, rows, q, cache)
    return out


def test_bf16_v_rows_read_as_they_are_give_the_transposed_copys_bits():
    """One-row passes read a bf16 V's rows as they are (each accumulator lane of ggml's bf16 dot
    products a vector of output elements); longer passes transpose V once, as before. The same operations: a
    pass's rows equal one-row passes bit for bit, both close to the float64 reference."""
    for (kk, mode, window, H, Hkv, D), (whole, rows, q, cache) in bf16_v_rows_and_pass(_BF16_V_CASES).items():
        assert torch.equal(whole, rows), (kk, mode, window, H, D)
        q_ref = q if kk in ("f32", "f16") else activation_for(q, cache.k.qtype)
        torch.testing.assert_close(rows, reference(q_ref, cache, 270, window, 1 / math.sqrt(D)), rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_bf16_v_rows_without_avx512_bf16(tmp_path):
    """The same where the CPU has AVX-512 but not its bf16 dot products (ggml's AVX512F code: mul then add per
    lane; a build with -mno-avx512bf16) and in the AVX2 build (x86simd.h's vdpbf16ps). A flag that changes nothing
    on this CPU is not built again (on an AVX2 CPU its own build is the AVX2 build, which the test above ran; the two
    identical builds took this test 70 s there after each change to the kernels' sources)."""
    import os
    import subprocess
    import sys
    flags = [flag for flag, differs in (("SHARPI_KERNEL_NO_BF16", not cpu.avx512_emulated() and "avx512_bf16" in
                                         cpu._cpu_info()[1] and "-mno-avx512bf16" not in cpu.CFLAGS),
                                        ("SHARPI_KERNEL_AVX2", not cpu.avx512_emulated())) if differs]
    if not flags:
        pytest.skip("this CPU's own build is the AVX2 build without AVX512-BF16 (the test above)")
    code = ("import sys, torch; sys.path.insert(0, 'tests'); from sharpi_core.kernels import cpu; import test_ops as t; "
            "assert cpu.available(), cpu.unavailable_reason(); "
            "bad = [c for c, (w, r, *_) in t.bf16_v_rows_and_pass(t._BF16_V_CASES).items() if not torch.equal(w, r)]; "
            "print(bad); sys.exit(bool(bad))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for flag in flags:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=1200,
                           env=dict(os.environ, **{flag: "1"}))
        assert r.returncode == 0, (flag, r.stdout[-2000:], r.stderr[-2000:])


def _glibc_at_least(major: int, minor: int) -> bool:
    import platform
    libc, ver = platform.libc_ver()
    try:
        return libc == "glibc" and tuple(int(v) for v in ver.split(".")[:2]) >= (major, minor)
    except ValueError:
        return False


@pytest.mark.skipif(not _glibc_at_least(2, 27), reason="ops.c's own expf is glibc's (2.27 on); elsewhere libm's is called")
def test_kernel_expf_is_libm_expf_for_every_float():
    """The attention kernel's exps (one per cache position and head, x <= 0) come from ops.c's 4-lane transcription of
    glibc's expf, which a check at load must find equal to libm's here; then every float of [-104, 0] (all of the
    range where expf is not 0 or libm's special cases), and samples of the rest (|x| >= 88, infinities, NaN: libm's
    own answers), give libm's bits."""
    assert cpu.expf_vectorized()
    assert cpu.expf_mismatches(0x80000000, 0xC2D00000) == 0  # -0 .. -104, every float
    assert cpu.expf_mismatches(0xC2D00000, 0xFFFFFFFF, 997) == 0  # below -104, -inf, the negative NaNs
    assert cpu.expf_mismatches(0x00000000, 0x80000000, 1009) == 0  # +0 .. +inf, the positive NaNs


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_1"])
def test_attention_exps_from_libm_or_the_kernel_are_the_same_bits(kind):
    """Flash attention's one-chunk kernel (decoding rows, short prompts, quantized caches) with libm's expf and with
    the kernel's own (where the load check passed): the same outputs, split rows (past 512 positions) included."""
    g = torch.Generator().manual_seed(5)
    H, Hkv, D, L, T = 6, 2, 64, 600, 3
    cache = KVCache(1, 1024, Hkv, D, D, kind, kind)
    cache.k.write(0, 0, torch.randn(L, Hkv, D, generator=g) * 3)
    cache.v.write(0, 0, torch.randn(L, Hkv, D, generator=g))
    q = torch.randn(T, H, D, generator=g)
    mine = cpu.expf_vectorized()
    outs = []
    try:
        for on in (False, mine):
            cpu.set_expf_vectorized(on)
            outs.append([cpu.attention(q, cache.k, cache.v, 0, L - T, 0, 0.125, mode) for mode in (cpu.ATTN_FA_DECODE, cpu.ATTN_FA_PROMPT)])
    finally:
        cpu.set_expf_vectorized(mine)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
