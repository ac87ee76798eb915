"""The KV cache types beyond f32 / f16 / q8_0 (llama.cpp's -ctk / -ctv bf16, q4_0, q4_1, iq4_nl, q5_0, q5_1):
the cache writes against ggml's reference quantizers, flash attention over them against a transcription of
llama.cpp's one-chunk kernel with each type's vec_dot, bit for bit. (Whole models against llama.cpp's own
perplexities: test_model.py; the CLI's rules: test_cli.py.)"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from sharpi_core.kernels import cpu
from sharpi_core.kv_cache import BLOCK_BYTES, KVCache, quantize_blocks
from test_cpu_kernels import IQ4NL_VALUES, ggml_quantize_q8_0, hsum_float_8, legacy_codes
from test_ops import _fma, libm_expf

F32 = np.float32
BLOCK_KINDS = list(BLOCK_BYTES)
needs_kernels = pytest.mark.skipif(not cpu.available(), reason="CPU kernels unavailable")
IQ4NL = IQ4NL_VALUES.tolist()


def blocks_under_test(n: int = 3000, seed: int = 0) -> np.ndarray:
    """[n, 32] float32: normal rows at three scales, and the edges (all zero, constant, one outlier, tiny, signs
    alternating, the largest |x| twice with both signs)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, 32)) * rng.choice([1e-3, 1.0, 30.0], (n, 1))).astype(F32)
    x[0] = 0
    x[1] = 5
    x[2, 3] = -70
    x[3] = 1e-20
    x[4] = np.where(np.arange(32) % 2, 1, -1)
    x[5, 7], x[5, 20] = 9, -9
    return x


def iq4_nl_scalar(x: np.ndarray) -> tuple[float, list[int]]:
    """quantize_row_iq4_nl_impl for one block as ggml's reference quantizer calls it (ntry = -1, no importance
    weights), line by line in float32 scalars: (d, codes)."""
    amax, mx = F32(0), F32(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < F32(1e-15):
        return 0.0, [0] * 32
    d = mx / F32(IQ4NL[0])
    inv = F32(1) / d
    sumqx = sumq2 = F32(0)
    codes = []
    for v in x:
        al = inv * v
        if al <= IQ4NL[0]:
            i = 0
        elif al >= IQ4NL[15]:
            i = 15
        else:
            lo, hi = 0, 15
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if al < IQ4NL[mid]:
                    hi = mid
                else:
                    lo = mid
            i = hi - 1 if al - F32(IQ4NL[hi - 1]) < F32(IQ4NL[hi]) - al else hi
        codes.append(i)
        q, w = F32(IQ4NL[i]), v * v
        sumqx = sumqx + w * q * v
        sumq2 = sumq2 + w * q * q
    return float(sumqx / sumq2 if sumq2 > 0 else F32(0)), codes


def block_parts(blk: np.ndarray, kind: str):
    """[n, bytes] blocks -> (vec_dot codes [n, 32] int64: signed, or unsigned for q4_1 / q5_1; d; m or None)."""
    c, d, m = legacy_codes(blk[:, None], Q[kind.upper()])
    return c[:, 0], d[:, 0], None if m is None else m[:, 0]


@needs_kernels
@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_cache_writes_are_ggml_reference_quantizers(kind):
    """The C write (cpu.kv_store: _Store.write and the fast decode path) stores the bytes of quantize_blocks, the
    numpy transcription of ggml's reference quantizer that machines without the kernels use; both are gguf's
    quantizer where gguf has one (q4_1 / q5_1 computed alike; q4_0 / q5_0 in float64 there, which rounds a code
    differently only in rare ties that this data does not hold), and iq4_nl's is a line-by-line scalar one."""
    x = blocks_under_test()
    want = quantize_blocks(kind, x)
    assert want.shape == (len(x), BLOCK_BYTES[kind]) and want.dtype == np.uint8
    got = torch.zeros(want.shape, dtype=torch.uint8)
    cpu.kv_store(kind, torch.from_numpy(x), got)
    assert np.array_equal(got.numpy(), want)
    if kind == "iq4_nl":
        for i in range(60):
            d, codes = iq4_nl_scalar(x[i])
            c, dq, _ = block_parts(want[i:i + 1], kind)
            assert dq[0] == np.float16(d).astype(F32), i
            if d:
                assert c[0].tolist() == [IQ4NL[j] for j in codes], i
    else:
        assert np.array_equal(gguf.quants.quantize(x, Q[kind.upper()]), want)
    # and they round-trip as a 4- / 5-bit code can: within a step of the block's range
    back = gguf.quants.dequantize(want, Q[kind.upper()])
    rng = np.maximum(np.abs(x).max(axis=1), 1e-30)
    rel = (np.abs(back - x).max(axis=1) / rng)[6:]  # (row 3 underflows to 0; the edge rows above vary)
    assert rel.max() < {"q4_0": 0.13, "q4_1": 0.07, "iq4_nl": 0.13, "q5_0": 0.07, "q5_1": 0.04}[kind]
    with pytest.raises(ValueError):
        cpu.kv_store(kind, torch.from_numpy(x), got[:-1])


@pytest.mark.parametrize("kind", [*BLOCK_KINDS, "bf16"])
def test_store_layout_and_the_path_without_kernels(kind, monkeypatch):
    """A block type's store holds [n_layer, capacity, n_kv, bytes] of ggml's blocks, bf16 torch's bfloat16 (round to
    nearest even like GGML_FP32_TO_BF16); a write touches its positions only; without the kernels the same bytes."""
    x = torch.from_numpy(blocks_under_test(40, seed=3).reshape(5, 2, 128))  # [T, n_kv, hd]
    cache = KVCache(2, 9, 2, 128, 128, kind, "f16")
    cache.k.write(1, 3, x)
    s = cache.k
    if kind == "bf16":
        assert s.q.dtype is torch.bfloat16 and torch.equal(s.q[1, 3:8], x.bfloat16())
    else:
        assert s.q.shape == (2, 9, 2, 4 * BLOCK_BYTES[kind]) and s.q.dtype is torch.uint8
        assert np.array_equal(s.q[1, 3:8].reshape(-1, BLOCK_BYTES[kind]).numpy(), quantize_blocks(kind, x.reshape(-1, 32).numpy()))
        assert torch.equal(s.read(1, 8, 3), torch.from_numpy(gguf.quants.dequantize(s.q[1, 3:8].numpy(), Q[kind.upper()])))
    assert not s.q[0].any() and not s.q[1, :3].any() and not s.q[1, 8:].any()
    monkeypatch.setattr(cpu, "available", lambda: False)
    other = KVCache(2, 9, 2, 128, 128, kind, "f16")
    other.k.write(1, 3, x)
    assert torch.equal(other.k.q, s.q)
    assert cache.nbytes == 2 * 9 * 2 * 128 * (2 if kind == "bf16" else BLOCK_BYTES[kind] / 32) + 2 * 9 * 2 * 128 * 2


def vec_dot_blocks(kind: str, kc, kd, km, qc, qd, qs) -> F32:
    """ggml_vec_dot_{kind}_q8_0 / _q8_1 (AVX2 code): per block 8 lanes of 4 exact products, acc = fma(d_k * d_q,
    lane, acc), hsum_float_8 (+ the fma sum of m_k * s_q for q4_1 / q5_1); iq4_nl: two accumulators for the even
    and odd blocks of each pair, added before the hsum, an odd last block as fma(d, its sum, total)."""
    nb = len(kd)
    acc, summs = np.zeros((2, 8), F32), F32(0)
    paired = nb & ~1 if kind == "iq4_nl" else nb
    for b in range(paired):
        lanes = (kc[32 * b:32 * b + 32] * qc[32 * b:32 * b + 32]).reshape(8, 4).sum(1).astype(F32)
        a = b & 1 if kind == "iq4_nl" else 0
        acc[a] = _fma(F32(kd[b] * qd[b]), lanes, acc[a])
        if km is not None:
            summs = _fma(km[b], qs[b], summs)
    if kind != "iq4_nl":
        return F32(hsum_float_8(acc[0]) + summs) if km is not None else hsum_float_8(acc[0])
    s = hsum_float_8((acc[0] + acc[1]).astype(F32))
    if paired < nb:
        b = nb - 1
        s = _fma(F32(qd[b] * kd[b]), F32((kc[32 * b:] * qc[32 * b:]).sum()), s)
    return F32(s)


def fa_chunk_ggml(kind, qh, K, V, scale):
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk for one row and head against a `kind` K (its raw blocks
    [n, bytes], or its bf16 values as fp32) and V (fp32, as its to_float gives it): q in K's vec_dot type, scores by
    its vec_dot, online softmax with libm's expf, an fp32 accumulator (V is not f16)."""
    if kind == "bf16":  # ggml_vec_dot_bf16 of K's rows and q rounded to bf16: the bf16 weights' one-row product
        raw = torch.from_numpy(K).bfloat16().view(torch.int16).contiguous()  # (checked against libllama elsewhere)
        scores = cpu.qmatmul(torch.from_numpy(qh)[None].contiguous(), raw, Q.BF16, len(K), len(qh), act_quant=True)[0]
        dot = lambda j: scores[j].numpy()  # noqa: E731
    else:
        qc, qd, qs = ggml_quantize_q8_0(qh[None], kind in ("q4_1", "q5_1"))
        qc = qc[0].astype(np.int64)
        kc, kd, km = block_parts(K.reshape(-1, BLOCK_BYTES[kind]), kind)
        nb = len(qh) // 32
        kc, kd = kc.reshape(len(K), -1), kd.reshape(len(K), nb)
        km = km.reshape(len(K), nb) if km is not None else None
        dot = lambda j: vec_dot_blocks(kind, kc[j], kd[j], None if km is None else km[j], qc, qd[0],  # noqa: E731
                                       None if qs is None else qs[0])
    M, S = F32(-np.inf), F32(0)
    acc = np.zeros(V.shape[1], F32)
    for j in range(len(K)):
        s = F32(dot(j) * F32(scale))
        ms, vs = F32(1), F32(1)
        if s > M:
            ms, M = libm_expf(M - s), s
            acc = (acc * ms).astype(F32)
        else:
            vs = libm_expf(s - M)
        acc = _fma(V[j], vs, acc)
        S = _fma(S, ms, vs)
    return (acc * (F32(1) / S)).astype(F32)


@needs_kernels
@pytest.mark.parametrize("kind", [*BLOCK_KINDS, "bf16"])
@pytest.mark.parametrize("D", [64, 96])
@pytest.mark.parametrize("H,window", [(4, 0), (6, 50)])
def test_flash_attention_over_the_type_is_llamacpp_bit_for_bit(kind, D, H, window):
    """Prompt and decoding rows (verify rows and one-token passes alike) against the one-chunk kernel with the
    type's own vec_dot and to_float, also past 512 positions, where f16 caches split the KV range in two and these
    types do not (ggml splits f32 / f16 only). D = 96: an odd number of blocks (iq4_nl's last block alone). 6 heads
    and a sliding window: the kernel's runs of 4 (row, head) pairs mix KV heads and rows of other ranges (each
    block of V rows is decoded once per KV head for the run)."""
    g = torch.Generator().manual_seed(D + len(kind))
    Hkv, T = 2, 3
    cache = KVCache(1, 640, Hkv, D, D, kind, kind)
    for L in (70, 600):
        cache.k.write(0, 0, torch.randn(L, Hkv, D, generator=g) * 3)
        cache.v.write(0, 0, torch.randn(L, Hkv, D, generator=g))
        q = torch.randn(T, H, D, generator=g)
        K = cache.k.q[0].float().numpy() if kind == "bf16" else cache.k.q[0].numpy()
        V = cache.v.read(0, L).numpy()
        for mode in (cpu.ATTN_FA_PROMPT, cpu.ATTN_FA_DECODE):
            got = cpu.attention(q, cache.k, cache.v, 0, L - T, window, 0.125, mode).numpy()
            for t in range(T):
                for h in (0, H - 1):
                    gk, n = h // (H // Hkv), L - T + t + 1
                    lo = max(0, n - window) if window else 0
                    want = fa_chunk_ggml(kind, q[t, h].numpy(), K[lo:n, gk], V[lo:n, gk], 0.125)
                    assert np.array_equal(got[t, h], want), (L, mode, t, h)


def test_a_cache_that_memory_cannot_hold_is_refused_k_and_v_together(monkeypatch):
    """K and V are zeroed as they are allocated: together they must fit in the memory left (each alone fitting is
    not enough: under overcommit the second one's zeroing brought the OOM killer, not an error line)."""
    from sharpi_core import kv_cache
    from sharpi_core.errors import UsageError
    k_bytes = kv_cache._Store.n_bytes("f16", 2, 64, 2, 128)
    v_bytes = kv_cache._Store.n_bytes("q8_0", 2, 64, 2, 128)
    for left in (max(k_bytes, v_bytes) + 1, k_bytes + v_bytes - 1):
        monkeypatch.setattr(kv_cache, "memory_left", lambda: left)
        with pytest.raises(UsageError, match=rf"cannot allocate 0\.0 GB of KV cache \(f16 K, q8_0 V\) for a context "
                                             rf"of 64 tokens \(0\.0 GB of memory left\)"):
            KVCache(2, 64, 2, 128, 128, "f16", "q8_0")
    monkeypatch.setattr(kv_cache, "memory_left", lambda: k_bytes + v_bytes)
    assert KVCache(2, 64, 2, 128, 128, "f16", "q8_0").k.q.shape == (2, 64, 2, 128)


def test_memory_left_is_what_linux_says_is_available(monkeypatch):
    from sharpi_core import kv_cache
    files = {"/proc/meminfo": "MemTotal: 100 kB\nMemAvailable:    40 kB\nSwapFree: 2 kB\n"}
    monkeypatch.setattr(kv_cache, "_read", files.get)
    assert kv_cache.memory_left() == 42 * 1024
    files.update({"/sys/fs/cgroup/memory.max": "30720\n", "/sys/fs/cgroup/memory.current": "10240\n"})
    assert kv_cache.memory_left() == 20480  # within the cgroup's limit
    files["/sys/fs/cgroup/memory.stat"] = "anon 6144\nfile 4096\nkernel 0\n"
    assert kv_cache.memory_left() == 24576  # its page cache (a model file read) is dropped before it fails
    files["/sys/fs/cgroup/memory.max"] = "max\n"
    assert kv_cache.memory_left() == 42 * 1024
    del files["/proc/meminfo"]  # (not Linux)
    assert kv_cache.memory_left() == kv_cache._physical_memory()
