"""The C ops besides the matmuls (sharpi_core/kernels/ops.c) against torch references."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sharpi_core.kernels import cpu
from sharpi_core.kv_cache import KVCache
from sharpi_core.quants import activation_for, quantize_q8_blocks

pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels unavailable")


def reference(q, cache, start, window, scale):
    T, H, D = q.shape
    L = start + T
    K, V = cache.k.read(0, L), cache.v.read(0, L)  # [L, Hkv, D]
    G = H // K.shape[1]
    out = torch.empty(T, H, V.shape[2])
    for t in range(T):
        pos = start + t
        lo = max(0, pos - window + 1) if window else 0
        for h in range(H):
            p = torch.softmax(K[lo:pos + 1, h // G].double() @ q[t, h].double() * scale, 0).float()
            if cache.v.kind == "f16":
                p = p.half().float()
            out[t, h] = (p.double() @ V[lo:pos + 1, h // G].double()).float()
    return out


@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (12, 2, 128), (4, 1, 256)])
def test_attention_matches_reference_and_rows_are_batch_invariant(kind, window, H, Hkv, D):
    g = torch.Generator().manual_seed(H * D + window)
    L, T = 90, 6
    cache = KVCache(1, 128, Hkv, D, D, kind, kind)
    cache.k.write(0, 0, torch.randn(L, Hkv, D, generator=g) * 3)
    cache.v.write(0, 0, torch.randn(L, Hkv, D, generator=g))
    start = L - T
    q = activation_for(torch.randn(T, H, D, generator=g), cache.k.qtype)
    scale = 1 / math.sqrt(D)
    out = cpu.attention(q, cache.k, cache.v, 0, start, window, scale)
    # fp16 probabilities: a p on a rounding boundary may round either way (one fp16 ulp, ~5e-4 rel.)
    tol = dict(rtol=1e-3, atol=3e-3) if kind == "f16" else dict(rtol=1e-5, atol=6e-5)
    torch.testing.assert_close(out, reference(q, cache, start, window, scale), **tol)
    # each row alone, and with another thread count, gives the same bits as inside the batch
    n = torch.get_num_threads()
    try:
        for threads in {1, n}:
            torch.set_num_threads(threads)
            for t in (0, T - 1):
                one = cpu.attention(q[t:t + 1], cache.k, cache.v, 0, start + t, window, scale)
                assert torch.equal(one[0], out[t])
    finally:
        torch.set_num_threads(n)


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


# -- exact emulations of llama.cpp's x86 AVX2 arithmetic (what ops.c documents) -------------------
# fma(a, b, c) of fp32 values: the product is exact in fp64 and the fp64 sum rounds to fp32 (a
# double rounding could differ from a true fma once in ~2^29 operations; fixed seeds below).

def _fma(a, b, c):
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float32)


def _f(h: str) -> np.float32:
    return np.float32(float.fromhex(h))


def ggml_expf_avx2(x):
    """ggml_v_expf (ggml-cpu/vec.h, the __m256 version), element by element in numpy."""
    x = np.asarray(x, np.float32)
    r = _f("0x1.8p23")
    z = _fma(x, _f("0x1.715476p+0"), r)
    n = (z - r).astype(np.float32)
    b = _fma(-n, _f("0x1.7f7d1cp-20"), _fma(-n, _f("0x1.62e4p-1"), x))
    e = (z.view(np.uint32) << np.uint32(23)).astype(np.uint32)
    k = (e + np.float32(1).view(np.uint32)).astype(np.uint32).view(np.float32)
    u = (b * b).astype(np.float32)
    j = _fma(_fma(_fma(_f("0x1.0e4020p-7"), b, _f("0x1.573e2ep-5")), u, _fma(_f("0x1.555e66p-3"), b, _f("0x1.fffdb6p-2"))),
             u, (_f("0x1.ffffecp-1") * b).astype(np.float32))
    g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0)).astype(np.uint32)
    s1 = (g + np.uint32(0x7f000000)).astype(np.uint32).view(np.float32)
    s2 = (e - g).astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore", under="ignore"):
        out = np.where(np.abs(n) > 126, (_fma(s2, j, s2) * s1).astype(np.float32), _fma(j, k, k))
        return np.where(np.abs(n) > 192, (s1 * s1).astype(np.float32), out)


def hsum8(v):
    """llamafile's hsum(__m256) over the last axis of 8: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))."""
    w = (v[..., 4:] + v[..., :4]).astype(np.float32)
    return ((w[..., 0] + w[..., 2]).astype(np.float32) + (w[..., 1] + w[..., 3]).astype(np.float32)).astype(np.float32)


def test_glu_silu_is_ggml_swiglu_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(3, 2 * 1536, generator=g) * 6
    gu[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0, 1e-30, -1e-30])
    got = cpu.glu(gu, 1536, "silu").numpy()
    x, u = gu[:, :1536].numpy(), gu[:, 1536:].numpy()
    with np.errstate(over="ignore"):
        want = ((x / (np.float32(1) + ggml_expf_avx2(-x))).astype(np.float32) * u).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    torch.testing.assert_close(torch.from_numpy(got), torch.nn.functional.silu(gu[:, :1536]) * gu[:, 1536:],
                               rtol=2e-6, atol=1e-6)


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


def vec_dot_reduce(v):
    """ggml_vec_dot_f16's accumulators [..., 32] (4 x 8 lanes) summed as GGML_F32x8_REDUCE does."""
    x = ((v[..., 0:8] + v[..., 16:24]).astype(np.float32) + (v[..., 8:16] + v[..., 24:32]).astype(np.float32))
    x = x.astype(np.float32)
    t0 = (x[..., :4] + x[..., 4:]).astype(np.float32)
    return ((t0[..., 0] + t0[..., 1]).astype(np.float32) + (t0[..., 2] + t0[..., 3]).astype(np.float32)).astype(np.float32)


def attention_ggml_avx2(q, cache, start, window, scale, decode_order):
    """llama.cpp's non-flash-attention CPU path on an AVX2 build, emulated in numpy for an f16 cache:
    KQ and KQV by tinyBLAS (8 lanes, passes of >= 2 rows) or by ggml_vec_dot_f16 (4 x 8 lanes, one
    row), softmax by ggml_vec_soft_max_f32."""
    nl = 32 if decode_order else 8
    reduce = vec_dot_reduce if decode_order else hsum8
    T, H, D = q.shape
    L = start + T
    K, V = cache.k.read(0, L).numpy(), cache.v.read(0, L).numpy()
    G = H // K.shape[1]
    out = np.empty((T, H, V.shape[2]), np.float32)
    for t in range(T):
        pos = start + t
        lo = max(0, pos - window + 1) if window else 0
        for h in range(H):
            Kh, Vh, qh = K[lo:pos + 1, h // G], V[lo:pos + 1, h // G], q[t, h].numpy()
            acc = np.zeros((Kh.shape[0], nl), np.float32)
            for d in range(0, D, nl):
                acc = _fma(Kh[:, d:d + nl], qh[d:d + nl], acc)
            s = (reduce(acc) * np.float32(scale)).astype(np.float32)
            e = ggml_expf_avx2((s - s.max()).astype(np.float32))
            grp = np.zeros(((lo % 8) + len(e) + 7) // 8 * 8, np.float32)
            grp[lo % 8:lo % 8 + len(e)] = e
            total = sum(float(v) for v in hsum8(grp.reshape(-1, 8)))
            p = (e * np.float32(1.0 / total)).astype(np.float32).astype(np.float16).astype(np.float32)
            lanes = np.zeros((nl, Vh.shape[1]), np.float32)
            for j in range(len(p)):
                r = (lo + j) % nl
                lanes[r] = _fma(Vh[j], p[j], lanes[r])
            out[t, h] = reduce(lanes.T)
    return torch.from_numpy(out)


@pytest.mark.parametrize("decode_order", [False, True])
@pytest.mark.parametrize("window", [0, 37])
def test_attention_is_llamacpp_avx2_non_fa_bit_for_bit(window, decode_order):
    g = torch.Generator().manual_seed(7 + window)
    H, Hkv, D, L, T = 6, 2, 64, 83, 3
    cache = KVCache(1, 128, Hkv, D, D, "f16", "f16")
    cache.k.write(0, 0, torch.randn(L, Hkv, D, generator=g) * 3)
    cache.v.write(0, 0, torch.randn(L, Hkv, D, generator=g))
    q = activation_for(torch.randn(T, H, D, generator=g), cache.k.qtype)
    got = cpu.attention(q, cache.k, cache.v, 0, L - T, window, 0.125, decode_order)
    assert torch.equal(got, attention_ggml_avx2(q, cache, L - T, window, 0.125, decode_order))
    assert not torch.equal(got, cpu.attention(q, cache.k, cache.v, 0, L - T, window, 0.125, not decode_order))


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
