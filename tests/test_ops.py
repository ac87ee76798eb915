"""The C ops besides the matmuls (sharpi_core/kernels/ops.c) against torch references."""
from __future__ import annotations

import math

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
