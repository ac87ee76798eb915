"""The CUDA kernels (through sharpi_core.backends.cuda) against numpy / gguf.quants references.

Needs cupy and an NVIDIA GPU, or the CPU emulator of tests/simt (tests/test_simt.py runs this file
there); skipped otherwise. tests/test_cuda_compile.py covers what can be checked without either.
Run the GPU part alone with `pytest -q -m cuda tests/test_cuda_kernels.py`. Speed is measured by
scripts/bench_cuda_kernels.py, not here.
"""
from __future__ import annotations

import ctypes
import math
from pathlib import Path

import gguf
import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import torch  # noqa: E402

from sharpi_core.backends import cuda as cb  # noqa: E402
from sharpi_core.quants import q8_0_blocks, q8_parts, quantize_q8_blocks, round_activations  # noqa: E402

_ok, _why = cb.cuda_available()
if not _ok:
    pytest.skip(_why, allow_module_level=True)

pytestmark = pytest.mark.cuda
Q = gguf.GGMLQuantizationType
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]
MODELS_DIR = Path.home() / ".cache" / "sharpi" / "models"


def random_raw(qtype, n: int, k: int, rng) -> np.ndarray:
    """Valid raw GGUF bytes uint8 [n, row_bytes] (K-quants, IQ4_NL: random bytes, sane f16 (super-)block scales)."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    if qtype not in (Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS):
        w = rng.standard_normal((n, k)).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(n, -1)
    nb = n * k // bs
    raw = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    f16 = lambda v: np.asarray(v, np.float16).view(np.uint8).reshape(nb, 2)  # noqa: E731
    if qtype in (Q.Q6_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS):
        o = {Q.Q6_K: 208, Q.Q3_K: 108, Q.IQ4_NL: 0, Q.IQ4_XS: 0}[qtype]
        raw[:, o:o + 2] = f16(rng.uniform(0.002, 0.02, nb))
    elif qtype == Q.Q2_K:
        raw[:, 80:82] = f16(rng.uniform(0.002, 0.02, nb))
        raw[:, 82:84] = f16(rng.uniform(0.002, 0.02, nb))
    else:
        raw[:, 0:2] = f16(rng.uniform(0.002, 0.02, nb))
        raw[:, 2:4] = f16(rng.uniform(0.002, 0.02, nb))
    return raw.reshape(n, -1)


def _k_for(qtype) -> int:
    """A K that is a multiple of the type's granularity (with odd block counts per warp)."""
    return {4: 1444, 8: 1448, 32: 1440, 256: 1280}[cb.K_MULTIPLE[qtype]]


def check_matmul(y, x, w, tol=1e-3):
    """Norm-wise relative error <= tol, and each element within tol of its |W| |x| scale."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    y = np.asarray(y, dtype=np.float64)
    assert y.shape == ref.shape
    assert np.isfinite(y).all()
    rel = np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30)
    assert rel <= tol, f"relative error {rel:.3g}"
    worst = np.max(np.abs(y - ref) / np.maximum(scale, 1e-30))
    assert worst <= tol, f"element error {worst:.3g} of |W||x|"
    return rel


def act(cw, x: np.ndarray) -> np.ndarray:
    """x as a matmul of weight cw takes it: rounded through its 8-bit activation blocks where it runs the
    integer matvecs (whose product is then exact up to fp32 rounding), else as is (fp32 products)."""
    return round_activations(torch.from_numpy(x), cw.xq_kind).numpy() if cw.xq_kind else x


def test_cuda_available_reports_device():
    ok, why = cb.cuda_available()
    assert ok and why


# ---- matvec -------------------------------------------------------------------------------------

# every type, and the float matvecs of the types that have integer ones (SHARPI_CUDA_DP4A=0's)
WEIGHT_CASES = [(t, True) for t in TYPES] + [(t, False) for t in TYPES if t in cb.INT_LANE_SPAN]


@pytest.fixture(scope="module", params=WEIGHT_CASES, ids=lambda c: c[0].name + ("" if c[1] else "-float"))
def random_weight(request):
    qtype, dp4a = request.param
    rng = np.random.default_rng(int(qtype))
    n, k = 300, _k_for(qtype)
    raw = random_raw(qtype, n, k, rng)
    w = gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32)
    keep, cb.DP4A = cb.DP4A, dp4a  # (a weight picks its kernels when made)
    try:
        cw = cb.CudaQWeight(raw, qtype, n, k, name=f"rand_{qtype.name}")
    finally:
        cb.DP4A = keep
    assert (cw.xq_kind is not None) == (dp4a and qtype in cb.INT_LANE_SPAN)
    return qtype, raw, w, cw


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8, 13, 16])
def test_matvec_random(random_weight, T):
    qtype, raw, w, cw = random_weight
    x = act(cw, np.random.default_rng(T).standard_normal((T, cw.k)).astype(np.float32))
    y = cw.matmul(cp.asarray(x))
    check_matmul(cp.asnumpy(y), x, w)


@pytest.mark.parametrize("ws", cb.QMV_SPLITS)
def test_matvec_rows_do_not_depend_on_the_batch_for_every_split(ws):
    """A row of a T-row product is the one-row product's bit for bit (speculative verification relies on
    it) when ws warps share each row, on row counts that leave partial blocks and groups."""
    rng = np.random.default_rng(ws)
    for qtype in TYPES:
        n, k = 37, 2 * _k_for(qtype)
        raw = random_raw(qtype, n, k, rng)
        w = gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32)
        cw = cb.CudaQWeight(raw, qtype, n, k)
        cw.split = ws
        x = act(cw, rng.standard_normal((16, k)).astype(np.float32))
        one = np.stack([cp.asnumpy(cw.matmul(cp.asarray(x[t:t + 1])))[0] for t in range(16)])
        check_matmul(one, x, w)
        for T in (2, 5, 16):
            np.testing.assert_array_equal(cp.asnumpy(cw.matmul(cp.asarray(x[:T]))), one[:T],
                                          err_msg=f"{qtype.name} ws={ws} T={T}")


def test_matvec_rows_per_warp_do_not_change_a_row(monkeypatch):
    """A matrix of many rows (one warp a row group, ws = 1) takes the 4-row variants (QMV_TALL): each
    row the one-row, one-weight-row product's bits, for every type, with a partial group at the end."""
    rng = np.random.default_rng(11)
    for qtype in TYPES:
        n, k = 39, _k_for(qtype)
        raw = random_raw(qtype, n, k, rng)
        cw = cb.CudaQWeight(raw, qtype, n, k)
        cw.split = 1
        x = act(cw, rng.standard_normal((8, k)).astype(np.float32))
        monkeypatch.setattr(cb, "QMV_TALL_ROWS", 10**9)  # one-row products: one weight row a warp
        one = np.stack([cp.asnumpy(cw.matmul(cp.asarray(x[t:t + 1])))[0] for t in range(8)])
        monkeypatch.setattr(cb, "QMV_TALL_ROWS", 0)  # ... four
        for T in (1, 5, 8):
            got = np.concatenate([cp.asnumpy(cw.matmul(cp.asarray(x[t:t + T]))) for t in range(0, 8, T)])
            np.testing.assert_array_equal(got[:8], one, err_msg=f"{qtype.name} T={T}")
        w = gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32)
        check_matmul(one, x, w)


def test_matvec_split_is_a_property_of_the_matrix():
    assert cb.qmv_split(Q.Q4_K, 1536, 8960) == 4     # Qwen 1.5B ffn_down: few long rows
    assert cb.qmv_split(Q.Q4_K, 1536, 1536) == 2     # attn_output: 6 blocks a row, 4 lane groups
    assert cb.qmv_split(Q.Q4_K, 1536, 512) == 1      # 2 blocks: a warp's lanes have one each already
    assert cb.qmv_split(Q.Q6_K, 151936, 1536) == 1   # rows enough
    assert cb.qmv_split(Q.Q4_K, 17920, 8960) == 1
    assert all(cb.qmv_split(t, 1536, 8960) in cb.QMV_SPLITS for t in TYPES)


def test_matvec_1d_and_out(random_weight):
    qtype, raw, w, cw = random_weight
    x = act(cw, np.random.default_rng(7).standard_normal((1, cw.k)).astype(np.float32))[0]
    y = cw.matmul(cp.asarray(x))
    assert y.shape == (cw.n,)
    check_matmul(cp.asnumpy(y)[None], x[None], w)
    out = cp.full((3, cw.n), cp.nan, dtype=cp.float32)
    x3 = act(cw, np.random.default_rng(8).standard_normal((3, cw.k)).astype(np.float32))
    assert cw.matmul(cp.asarray(x3), out=out) is out
    check_matmul(cp.asnumpy(out), x3, w)


@pytest.mark.parametrize("T", [1, 5, 70])  # the matvec variants and the dequantize + cuBLAS path (70)
def test_matmul_bias_is_the_separate_add(random_weight, T):
    # the bias goes in with the matvec's stores: the same bits as adding it after
    qtype, raw, w, cw = random_weight
    x = cp.asarray(np.random.default_rng(T).standard_normal((T, cw.k)).astype(np.float32))
    b = cp.asarray(np.random.default_rng(9).standard_normal(cw.n).astype(np.float32))
    want = cb.add_bias(cw.matmul(x), b)
    np.testing.assert_array_equal(cp.asnumpy(cw.matmul(x, bias=b)), cp.asnumpy(want))
    with pytest.raises(ValueError, match="bias"):
        cw.matmul(x, bias=b[:-1])


@pytest.mark.parametrize("T", [17, 37, 70])  # chunks of 16 (17, 37) and the dequantize + cuBLAS path (70)
def test_matmul_long(random_weight, T):
    qtype, raw, w, cw = random_weight
    x = act(cw, np.random.default_rng(T).standard_normal((T, cw.k)).astype(np.float32))
    check_matmul(cp.asnumpy(cw.matmul(cp.asarray(x))), x, w)


def test_rows_exact(random_weight):
    qtype, raw, w, cw = random_weight
    ids = np.array([0, 299, 5, 5, 150], np.int32)
    got = cp.asnumpy(cw.rows(ids))
    np.testing.assert_array_equal(got, w[ids])
    np.testing.assert_array_equal(cp.asnumpy(cw.dequantize()), w)


def test_matvec_large_k():
    rng = np.random.default_rng(1)
    for qtype, k in [(Q.Q4_K, 8960), (Q.Q6_K, 4096), (Q.Q8_0, 8960), (Q.Q5_0, 4864)]:
        raw = random_raw(qtype, 64, k, rng)
        w = gguf.quants.dequantize(raw, qtype).reshape(64, k)
        cw = cb.CudaQWeight(raw, qtype, 64, k)
        for T in (1, 16):
            x = act(cw, rng.standard_normal((T, k)).astype(np.float32))
            check_matmul(cp.asnumpy(cw.matmul(cp.asarray(x))), x, w)


def test_streams():
    rng = np.random.default_rng(3)
    a_raw, b_raw = random_raw(Q.Q4_K, 512, 1024, rng), random_raw(Q.Q8_0, 256, 1024, rng)
    a = cb.CudaQWeight(a_raw, Q.Q4_K, 512, 1024)
    b = cb.CudaQWeight(b_raw, Q.Q8_0, 256, 1024)
    cp.cuda.Device().synchronize()  # the uploads above went on the default stream
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    x = rng.standard_normal((4, 1024)).astype(np.float32)
    x_a, x_b = act(a, x), act(b, x)  # (each weight's activation rounding)
    with s1:
        xa = cp.asarray(x_a)
    with s2:
        xb = cp.asarray(x_b)
    ya = [a.matmul(xa, stream=s1) for _ in range(3)]
    yb = [b.matmul(xb, stream=s2) for _ in range(3)]
    s1.synchronize()
    s2.synchronize()
    wa = gguf.quants.dequantize(a_raw, Q.Q4_K).reshape(512, 1024)
    wb = gguf.quants.dequantize(b_raw, Q.Q8_0).reshape(256, 1024)
    for y in ya:
        check_matmul(cp.asnumpy(y), x_a, wa)
    for y in yb:
        check_matmul(cp.asnumpy(y), x_b, wb)


# ---- real model tensors ------------------------------------------------------------------------

_MODEL_FILES = sorted(MODELS_DIR.glob("*.gguf"))


@pytest.mark.skipif(not _MODEL_FILES, reason=f"no GGUF models in {MODELS_DIR}")
@pytest.mark.parametrize("path", _MODEL_FILES, ids=lambda p: p.stem)
def test_matvec_real_tensors(path):
    """The first 2-D tensor of each supported type in each cached model (up to 2048 rows of it)."""
    from sharpi_core.gguf_file import GGUFFile
    gf = GGUFFile(path)
    done = set()
    for name, t in gf.tensors.items():
        qt = t.tensor_type
        if qt not in cb.SUPPORTED or qt in done or len(t.shape) != 2:
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        if k % cb.K_MULTIPLE[qt]:
            continue
        done.add(qt)
        rows = min(n, 2048)
        raw = np.ascontiguousarray(np.asarray(t.data)[:rows]).view(np.uint8).reshape(rows, -1)
        w = gguf.quants.dequantize(raw, qt).reshape(rows, k).astype(np.float32)
        cw = cb.CudaQWeight(raw, qt, rows, k, name=name)
        rng = np.random.default_rng(0)
        for T in (1, 2, 16):
            x = act(cw, rng.standard_normal((T, k)).astype(np.float32))
            check_matmul(cp.asnumpy(cw.matmul(cp.asarray(x))), x, w)
        ids = np.array([0, rows - 1, rows // 2], np.int32)
        np.testing.assert_array_equal(cp.asnumpy(cw.rows(ids)), w[ids], err_msg=f"{name} {qt.name}")
    assert done, f"{path.name}: no tensor of a supported type"
    print(f"\n{path.name}: checked {', '.join(sorted(t.name for t in done))}")


# ---- helpers ------------------------------------------------------------------------------------

def test_rms_norm():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 896)).astype(np.float32) * 3
    w = rng.standard_normal(896).astype(np.float32)
    eps = 1e-6

    def ref(x, w):
        x64 = x.astype(np.float64)
        y = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps)
        return y * w if w is not None else y

    np.testing.assert_allclose(cp.asnumpy(cb.rms_norm(cp.asarray(x), cp.asarray(w), eps)), ref(x, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cp.asnumpy(cb.rms_norm(cp.asarray(x), None, eps)), ref(x, None), rtol=1e-5, atol=1e-5)
    # per-head norms: x [T, H, hd] with one weight row per head
    xh = rng.standard_normal((3, 10, 64)).astype(np.float32)
    wh = rng.standard_normal((10, 64)).astype(np.float32)
    got = cb.rms_norm(cp.asarray(xh), cp.asarray(wh), eps)
    np.testing.assert_allclose(cp.asnumpy(got), ref(xh, wh[None]), rtol=1e-5, atol=1e-5)
    # in place, on a strided view (rows of a wider buffer)
    buf = cp.asarray(rng.standard_normal((5, 1024)).astype(np.float32))
    want = ref(cp.asnumpy(buf[:, :896]), w)
    view = buf[:, :896]
    cb.rms_norm(view, cp.asarray(w), eps, out=view)
    np.testing.assert_allclose(cp.asnumpy(buf[:, :896]), want, rtol=1e-5, atol=1e-5)


def test_rms_norm_fused_add_and_head_rows_of_a_wider_buffer():
    rng = np.random.default_rng(1)
    eps = 1e-6
    # the residual add fused in: x += a written back, then the norm of the sum, the bits of the two steps
    x = rng.standard_normal((4, 576)).astype(np.float32)
    a = rng.standard_normal((4, 576)).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    want_sum = cp.asarray(x) + cp.asarray(a)
    want = cp.asnumpy(cb.rms_norm(want_sum, cp.asarray(w), eps))
    dx = cp.asarray(x)
    got = cb.rms_norm(dx, cp.asarray(w), eps, add=cp.asarray(a))
    np.testing.assert_array_equal(cp.asnumpy(dx), cp.asnumpy(want_sum))
    np.testing.assert_array_equal(cp.asnumpy(got), want)
    # per-head norms in place on the q heads of a fused projection's output: [T, H, hd] with the
    # token stride of the whole row, the columns after them untouched
    T, H, hd, W = 3, 4, 64, 4 * 64 + 96
    buf = cp.asarray(rng.standard_normal((T, W)).astype(np.float32))
    before = cp.asnumpy(buf)
    wh = rng.standard_normal((H, hd)).astype(np.float32)
    q = buf[:, :H * hd].reshape(T, H, hd)
    assert q.strides == (4 * W, 4 * hd, 4)
    want = cp.asnumpy(cb.rms_norm(cp.asarray(before[:, :H * hd].reshape(T, H, hd)), cp.asarray(wh), eps))
    cb.rms_norm(q, cp.asarray(wh), eps, out=q)
    got = cp.asnumpy(buf)
    np.testing.assert_array_equal(got[:, :H * hd].reshape(T, H, hd), want)
    np.testing.assert_array_equal(got[:, H * hd:], before[:, H * hd:])


def test_add_bias_and_scale_on_column_views():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 300)).astype(np.float32)
    b = rng.standard_normal(120).astype(np.float32)
    d = cp.asarray(x)
    cb.add_bias(d[:, 100:220], cp.asarray(b))
    want = x.copy()
    want[:, 100:220] += b
    np.testing.assert_array_equal(cp.asnumpy(d), want)
    cb.scale(d[:, :64].reshape(5, 2, 32), 0.125)
    want[:, :64] *= np.float32(0.125)
    np.testing.assert_array_equal(cp.asnumpy(d), want)
    cb.softcap(d[1:4, 10:250], 3.0)  # tanh(x * (1 / 3)) * 3 on a block of rows and columns
    want[1:4, 10:250] = np.tanh(want[1:4, 10:250] * (np.float32(1) / np.float32(3))) * np.float32(3)
    np.testing.assert_allclose(cp.asnumpy(d), want, rtol=1e-6, atol=1e-6)
    assert np.abs(cp.asnumpy(d)[1:4, 10:250]).max() < 3 and (cp.asnumpy(d)[0] == want[0]).all()
    table = np.float32(1) + np.arange(16, dtype=np.float32) / np.float32(7)  # a factor per position
    pos = np.array([3, 9, 0, 15, 9], dtype=np.int32)
    want = cp.asnumpy(d)
    cb.scale_rows(d[:, 200:264].reshape(5, 2, 32), cp.asarray(table), cp.asarray(pos))  # device positions
    want[:, 200:264] *= table[pos][:, None]
    np.testing.assert_array_equal(cp.asnumpy(d), want)
    with pytest.raises(ValueError, match="beyond the table"):
        cb.scale_rows(d, cp.asarray(table), [0, 1, 2, 3, 16])


@pytest.mark.parametrize("n", [7, 2048, 5000, 151936])
def test_argmax_is_numpys_with_ties_nans_infs_and_bias(n):
    rng = np.random.default_rng(n)
    T = 7
    x = rng.standard_normal((T, n + 3)).astype(np.float32)
    x[1, :] = np.float32(-np.inf)                  # all -inf: 0
    x[2, n // 3] = x[2, n - 1] = 50.0              # a tie across chunks: the lower index
    x[3, [n // 2, n // 5]] = np.nan                # NaN beats everything: the first NaN
    x[4, n // 4] = -0.0
    x[4, :n] = np.minimum(x[4, :n], -1.0)
    x[4, n // 4], x[4, n - 1] = -0.0, 0.0          # -0 == +0: the lower index
    x[5, 0] = 9.0
    x[6, :] = 1.0                                  # all equal: 0
    bias = np.zeros(n, np.float32)
    bias[0], bias[n - 2] = -np.inf, 40.0           # a logit bias: bans row 5's maximum, lifts n - 2
    d = cp.asarray(x)[:, :n]                       # a strided view
    got = cp.asnumpy(cb.argmax(d))
    np.testing.assert_array_equal(got, np.argmax(x[:, :n], axis=1).astype(np.int32))
    out = cp.full(T + 2, -1, dtype=cp.int32)
    _, S = cb.argmax_splits(n)
    work = (cp.empty(T * S, cp.float32), cp.empty(T * S, cp.int32))
    cb.argmax(d, cp.asarray(bias), out=out[1:T + 1], work=work)  # into a view, through work buffers
    want = np.argmax(x[:, :n] + bias, axis=1).astype(np.int32)
    np.testing.assert_array_equal(cp.asnumpy(out), np.concatenate([[-1], want, [-1]]))
    assert want[5] != 0 and want[0] == n - 2


@pytest.mark.parametrize("n,k", [(50, 40), (5000, 40), (49152, 64), (151936, 7)])
def test_device_sampling_is_the_sampler_chains_law_and_draws_by_it(n, k):
    """sample_top_k: the top k (ties to the lower id, bias added), the chain's law over them (top-p, min-p,
    temperature: the host chain's candidates, probabilities to float32 rounding) and the token the uniform
    picks by the inverse of its running sum; rows without a distribution give -1."""
    from sharpi_core.sampling import SamplingParams, _plain_candidates
    rng = np.random.default_rng(n + k)
    T = 8
    x = (rng.standard_normal((T, n + 3)) * 2).astype(np.float32)
    x[1, :] = np.float32(-np.inf)                           # nothing to draw: -1
    x[2, [n // 3, n - 1, n // 7]] = 30.0                    # a tie across chunks, all three kept
    x[2, 5] = 29.0
    x[3, [n // 2, n // 5]] = np.nan                         # no distribution: -1
    x[4, :] = np.round(x[4, :])                             # many ties at the cut: the lowest ids
    x[5, 1] = np.inf                                        # a +inf logit: the only token
    x[6, :n // 2] = -np.inf                                 # half banned
    x[7, :] = 0.5
    x[7, 0] = -0.0
    bias = np.zeros(n, np.float32)
    bias[n - 2] = 3.0
    u = rng.random(T).astype(np.float32)
    u[0] = 0.0
    d = cp.asarray(x)[:, :n]                                # a strided view
    for params in (SamplingParams(temp=0.8, top_k=k), SamplingParams(temp=1.3, top_k=k, top_p=0.7, min_p=0.1),
                   SamplingParams(temp=0.5, top_k=k, top_p=1.0, min_p=0.0, min_keep=3)):
        args = (k, params.temp, params.top_p, params.min_p, params.min_keep)
        for b in (None, bias):
            out = cp.full((T + 1, cb.sample_out_width(k)), 7, dtype=cp.int32)
            tok = cp.full(T + 2, -5, dtype=cp.int32)
            _, S = cb.topk_splits(n, k)
            work = cp.empty(T * S * k, cp.uint64)
            cb.sample_top_k(d, *args, cp.asarray(u), bias=None if b is None else cp.asarray(b), out=out[:T],
                            tok=tok[1:T + 1], work=work)
            got = cp.asnumpy(out)
            assert (got[T] == 7).all() and cp.asnumpy(tok)[[0, T + 1]].tolist() == [-5, -5]
            np.testing.assert_array_equal(cp.asnumpy(tok)[1:T + 1], np.maximum(got[:T, 0], 0))
            xb = x[:, :n] + (0 if b is None else b)
            for r in range(T):
                t, ids, p = got[r, 0], got[r, 1:k + 1], got[r, k + 1:].view(np.float32)
                want_t, want_ids, want_p = cb.sample_law(xb[r], *args, float(u[r]))
                if r in (1, 3):
                    assert t == want_t == -1 and not p.any()
                    continue
                assert t == want_t and t >= 0, (r, t, want_t)
                np.testing.assert_array_equal(ids, want_ids)
                np.testing.assert_allclose(p, want_p, rtol=2e-6, atol=1e-9)
                kept = p > 0
                assert kept.any() and t in ids[kept]
                if r == 5:
                    assert ids[kept].tolist() == [1]
                    continue
                idx, q = _plain_candidates(xb[r].copy(), params)  # the host chain (float64 at the end)
                live = q > 0  # (the same set and law; the host orders equal values as its sort leaves them)
                mine, host = np.argsort(ids[kept]), np.argsort(idx[live])
                assert ids[kept][mine].tolist() == idx[live][host].tolist(), r
                np.testing.assert_allclose(p[kept][mine], q[live][host], rtol=2e-5)
                c = np.cumsum(p[kept], dtype=np.float32)          # the draw: the inverse of the running sum
                assert ids[kept][np.searchsorted(c, np.float32(u[r]) * c[-1], side="right")] == t
    with pytest.raises(ValueError, match="cannot be sampled on the device"):
        cb.sample_top_k(d, 65, 0.8, 1.0, 0.0, 0, cp.asarray(u))


@pytest.mark.parametrize("blk", [32, 64, 128, 256])
def test_hadamard_is_the_cpu_rotation_bit_for_bit(blk):
    from sharpi_core.kv_cache import rotate
    rng = np.random.default_rng(blk)
    T, n = 3, 2 * 256
    buf = rng.standard_normal((T, n + 64)).astype(np.float32) * 5
    want = rotate(torch.from_numpy(np.ascontiguousarray(buf[:, :n])), blk).numpy()
    got = cp.asnumpy(cb.hadamard(cp.asarray(buf)[:, :n], blk))  # a strided view in
    np.testing.assert_array_equal(got, want)
    back = cp.asnumpy(cb.hadamard(cp.asarray(got), blk))  # H @ H = I, up to rounding
    np.testing.assert_allclose(back, buf[:, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p_round,kinds", [(False, ("f16", "f16")), (False, ("q8_0", "q8_0")), (True, ("f16", "f16"))])
def test_attention_over_the_capacity_and_in_work_buffers_is_the_same(p_round, kinds):
    # a graph launches attention over the cache's capacity (keys past a query's position are never
    # seen) and into buffers it owns: the same bits as over the pass's own keys
    rng = np.random.default_rng(13)
    T, H, Hkv, D, cap, p0 = 5, 4, 2, 64, 700, 590
    kc, vc = _fill(rng, cap, Hkv, D, kinds[0], cap), _fill(rng, cap, Hkv, D, kinds[1], cap)
    q = cp.asarray(rng.standard_normal((T, H, D)).astype(np.float32))
    pos = cp.asarray(np.arange(p0, p0 + T, dtype=np.int32))
    qr = "q8_0" if kinds[0] == "q8_0" else "f16"
    want = cp.asnumpy(cb.attention(q, kc, vc, pos, p0 + T, 0.125, q_round=qr, p_round=p_round))
    _, S = cb.attention_splits(cap, cap, p_round=p_round)
    n_op, n_ml = cb.attention_work(T, H, D, S)
    work = (cp.empty(n_op + 7, dtype=cp.float32), cp.empty(n_ml + 3, dtype=cp.float32))
    out = cp.empty((T, H, D), dtype=cp.float32)
    got = cb.attention(q, kc, vc, pos, cap, 0.125, q_round=qr, p_round=p_round, out=out, work=work)
    assert got is out
    np.testing.assert_array_equal(cp.asnumpy(got), want)
    with pytest.raises(ValueError):
        cb.attention(q, kc, vc, pos, cap, 0.125, q_round=qr, p_round=p_round, work=(work[0][:10], work[1]))


def _rope_ref(x, pos, n_rot, neox, base, freq_scale=1.0, ff=None, table=None):
    x = x.astype(np.float64).copy()
    half = n_rot // 2
    i = np.arange(half)
    for t, p in enumerate(pos):
        if table is not None:
            c, s = table[p].real.astype(np.float64), table[p].imag.astype(np.float64)
        else:
            th = p * freq_scale * base ** (-2.0 * i / n_rot)
            if ff is not None:
                th = th / ff
            c, s = np.cos(th), np.sin(th)
        i0, i1 = (i, i + half) if neox else (2 * i, 2 * i + 1)
        a, b = x[t, :, i0].copy(), x[t, :, i1].copy()  # [half, nh]
        x[t, :, i0] = a * c[:, None] - b * s[:, None]
        x[t, :, i1] = a * s[:, None] + b * c[:, None]
    return x


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope(neox, n_rot):
    rng = np.random.default_rng(1)
    T, nh, hd = 5, 6, 64
    x = rng.standard_normal((T, nh, hd)).astype(np.float32)
    pos = np.array([0, 1, 17, 300, 4000], np.int32)
    got = cb.rope(cp.asarray(x), cp.asarray(pos), n_rot, neox, theta_base=10000.0)
    np.testing.assert_allclose(cp.asnumpy(got), _rope_ref(x, pos, n_rot, neox, 10000.0), rtol=0, atol=2e-4)
    ff = rng.uniform(1, 8, n_rot // 2).astype(np.float32)
    got = cb.rope(cp.asarray(x), pos, n_rot, neox, theta_base=1e6, freq_scale=0.5, freq_factors=cp.asarray(ff))
    np.testing.assert_allclose(cp.asnumpy(got), _rope_ref(x, pos, n_rot, neox, 1e6, 0.5, ff), rtol=0, atol=2e-4)
    # table path: (cos, sin) per position as complex64, e.g. the CPU path's table
    th = np.arange(4096)[:, None] * 10000.0 ** (-2.0 * np.arange(n_rot // 2) / n_rot)
    table = (np.cos(th) + 1j * np.sin(th)).astype(np.complex64)
    got = cb.rope(cp.asarray(x), pos, n_rot, neox, table=cp.asarray(table))
    np.testing.assert_allclose(cp.asnumpy(got), _rope_ref(x, pos, n_rot, neox, 0, table=table), rtol=0, atol=1e-5)
    # a strided view: the k heads of a fused [T, H + Hkv, hd] buffer
    fused = cp.asarray(rng.standard_normal((T, 8, hd)).astype(np.float32))
    before = cp.asnumpy(fused)
    cb.rope(fused[:, 6:], pos, n_rot, neox, table=cp.asarray(table))
    after = cp.asnumpy(fused)
    np.testing.assert_array_equal(after[:, :6], before[:, :6])
    np.testing.assert_allclose(after[:, 6:], _rope_ref(before[:, 6:], pos, n_rot, neox, 0, table=table), atol=1e-5)


@pytest.mark.parametrize("neox,n_rot", [(True, 64), (False, 64), (True, 32)])
@pytest.mark.parametrize("kinds", [("f16", "f16"), ("q8_0", "q8_0")])
def test_rope_read_by_kv_append_and_attention_is_the_rope_launch(neox, n_rot, kinds):
    """kv_append / attention with rope=(table, n_rot, neox) turn K / q as a launch of rope would
    first, bit for bit (the model's passes then launch no rope), and leave their inputs as they were."""
    rng = np.random.default_rng(n_rot + neox)
    T, H, Hkv, D, cap = 3, 4, 2, 64, 48
    th = np.arange(cap)[:, None] * 10000.0 ** (-2.0 * np.arange(n_rot // 2) / n_rot)
    table = cp.asarray(np.stack([np.cos(th), np.sin(th)], -1).astype(np.float32))  # [cap, n_rot/2, 2]
    # q, k, v as column views of one fused projection output, as in a pass
    qkv = cp.asarray(rng.standard_normal((T, (H + 2 * Hkv) * D)).astype(np.float32))
    q, k, v = (qkv[:, :H * D].reshape(T, H, D), qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D),
               qkv[:, (H + Hkv) * D:].reshape(T, Hkv, D))
    pos = cp.asarray(np.array([20, 21, 22], np.int32))
    before = cp.asnumpy(qkv)
    caches = {}
    for fused in (False, True):
        kc, vc = cb.new_kv_cache(cap, Hkv, D, kinds[0]), cb.new_kv_cache(cap, Hkv, D, kinds[1])
        # earlier positions filled alike, so attention sees old keys and the new ones
        old = cp.asarray(rng.standard_normal((20, Hkv, D)).astype(np.float32)) if not caches else caches["old"]
        caches["old"] = old
        cb.kv_append(old, kc, cp.arange(20, dtype=cp.int32), old, vc)
        if fused:
            cb.kv_append(k, kc, pos, v, vc, rope=(table, n_rot, neox))
            o = cb.attention(q, kc, vc, pos, cap, 0.125, q_round="f16", rope=(table, n_rot, neox))
            np.testing.assert_array_equal(cp.asnumpy(qkv), before)  # inputs untouched
        else:
            qr, kr = q.copy(), k.copy()
            cb.rope(qr, pos, n_rot, neox, table=table)
            cb.rope(kr, pos, n_rot, neox, table=table)
            cb.kv_append(kr, kc, pos, v, vc)
            o = cb.attention(qr, kc, vc, pos, cap, 0.125, q_round="f16")
        caches[fused] = (cp.asnumpy(kc), cp.asnumpy(vc), cp.asnumpy(o))
    for a, b in zip(caches[False], caches[True]):
        np.testing.assert_array_equal(a, b)
    plain = cb.new_kv_cache(cap, Hkv, D, kinds[0])
    cb.kv_append(k, plain, pos)  # K unturned: not what went in
    assert not np.array_equal(cp.asnumpy(plain)[20:23], caches[True][0][20:23])


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_glu(act):
    rng = np.random.default_rng(2)
    T, F = 4, 1000
    gu = rng.standard_normal((T, 2 * F)).astype(np.float32) * 4
    g, u = gu[:, :F].astype(np.float64), gu[:, F:].astype(np.float64)
    if act == "silu":
        ref = g / (1 + np.exp(-g)) * u
    else:
        ref = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * u
    d = cp.asarray(gu)
    got = cb.glu(d[:, :F], d[:, F:], act)
    np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-5, atol=1e-5)


def test_kv_append_f16_and_q8_0():
    rng = np.random.default_rng(4)
    T, nkv, D, cap = 5, 2, 64, 40
    src = rng.standard_normal((T, nkv, D)).astype(np.float32)
    pos = np.array([3, 4, 5, 6, 20], np.int32)
    kf = cb.new_kv_cache(cap, nkv, D, "f16")
    cb.kv_append(cp.asarray(src), kf, pos)
    got = cp.asnumpy(kf)
    np.testing.assert_array_equal(got[pos], src.astype(np.float16))
    assert not got[[0, 1, 2, 7, 39]].any()
    kq = cb.new_kv_cache(cap, nkv, D, "q8_0")
    # blocks whose codes fall on halves (amax 127: x * 127/amax = x), where ggml's x86 rounding
    # (half to even) and gguf.quants' roundf differ: the cache must hold the CPU path's bytes
    src[0, 0, :32] = np.arange(32, dtype=np.float32) - 15.5
    src[0, 0, 31] = 127.0
    # a strided source: the k heads of a fused [T, H + Hkv, D] projection
    fused = np.concatenate([rng.standard_normal((T, 3, D)).astype(np.float32), src], axis=1)
    cb.kv_append(cp.asarray(fused)[:, 3:], kq, cp.asarray(pos))
    got = cp.asnumpy(kq)
    want = q8_0_blocks(src)
    assert not np.array_equal(want[0, 0, :34], gguf.quants.quantize(src[0, 0, :32], Q.Q8_0).view(np.uint8))
    np.testing.assert_array_equal(got[pos], want)
    assert not got[[0, 1, 2, 7, 39]].any()


@pytest.mark.parametrize("kinds", [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "f16")])
def test_kv_append_of_k_and_v_together_is_two_appends(kinds):
    # a layer's K and V in one launch (two when the caches differ in kind), from one fused projection
    # output; V's head size differs from K's
    rng = np.random.default_rng(6)
    T, nkv, Dk, Dv, cap = 3, 2, 64, 96, 16
    qkv = cp.asarray(rng.standard_normal((T, nkv * (Dk + Dv) + 8)).astype(np.float32))
    k, v = qkv[:, 8:8 + nkv * Dk].reshape(T, nkv, Dk), qkv[:, 8 + nkv * Dk:]
    pos = cp.asarray(np.array([2, 9, 15], np.int32))
    want = [cb.new_kv_cache(cap, nkv, Dk, kinds[0]), cb.new_kv_cache(cap, nkv, Dv, kinds[1])]
    cb.kv_append(k, want[0], pos)
    cb.kv_append(v, want[1], pos)
    got = [cb.new_kv_cache(cap, nkv, Dk, kinds[0]), cb.new_kv_cache(cap, nkv, Dv, kinds[1])]
    cb.kv_append(k, got[0], pos, v, got[1])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(cp.asnumpy(g), cp.asnumpy(w))
        assert cp.asnumpy(g).any()


# ---- attention ------------------------------------------------------------------------------------

def _cache_values(cache) -> np.ndarray:
    """float64 [cap, nkv, D] of an f16 or q8_0 device cache."""
    h = cp.asnumpy(cache)
    if h.dtype == np.float16:
        return h.astype(np.float64)
    cap, nkv, rb = h.shape
    return gguf.quants.dequantize(h.reshape(cap * nkv, rb), Q.Q8_0).reshape(cap, nkv, -1).astype(np.float64)


def _attn_ref(q, K, V, pos, n_kv, scale, window=0, softcap=0.0, q_round="f32", p_round=False):
    T, H, Dk = q.shape
    G = H // K.shape[1]
    out = np.zeros((T, H, V.shape[2]))
    q = q.astype(np.float32)
    if q_round == "f16":
        q = q.astype(np.float16).astype(np.float32)
    elif q_round == "q8_0":
        q = quantize_q8_blocks(torch.from_numpy(q), 32, True).numpy()  # as the CPU path rounds q
    q = q.astype(np.float64)
    for t, p in enumerate(pos):
        js = np.array([j for j in range(n_kv) if j <= p and (window <= 0 or p - j < window)])
        for h in range(H):
            g = h // G
            s = K[js, g] @ q[t, h]
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            s = s * scale
            e = np.exp(s - s.max())
            pr = e / e.sum()
            if p_round:
                pr = pr.astype(np.float16).astype(np.float64)
            out[t, h] = pr @ V[js, g]
    return out


def _fill(rng, cap, nkv, D, kind, n):
    c = cb.new_kv_cache(cap, nkv, D, kind)
    cb.kv_append(cp.asarray(rng.standard_normal((n, nkv, D)).astype(np.float32)), c, np.arange(n, dtype=np.int32))
    return c


ATTN_CASES = [
    # T, H, Hkv, Dk, Dv, start, window, chunk, kinds
    (1, 8, 2, 64, 64, 0, 0, None, ("f16", "f16")),
    (1, 8, 2, 64, 64, 700, 0, None, ("f16", "f16")),
    (4, 8, 2, 64, 64, 700, 0, 64, ("f16", "f16")),       # many splits
    (16, 14, 2, 64, 64, 300, 0, None, ("f16", "f16")),   # qwen-like GQA 7:1, speculative verify
    (16, 4, 1, 256, 256, 900, 512, 128, ("f16", "f16")), # gemma-like: head 256, sliding window
    (3, 4, 4, 128, 128, 50, 20, 8, ("f16", "f16")),      # MHA, small window, tiny chunks
    (16, 4, 2, 64, 64, 10, 0, 16, ("f16", "f16")),       # early queries leave the last split empty
    (2, 8, 2, 64, 64, 300, 0, 16, ("f16", "f16")),       # more split weights than the fused combine's shared room
    (5, 4, 2, 64, 32, 100, 0, 64, ("f16", "f16")),       # Dv < Dk (several key groups in PV)
    (2, 4, 2, 96, 80, 100, 0, None, ("f16", "f16")),     # odd dims (Dv = 80: one group)
    (4, 8, 2, 64, 64, 300, 0, 128, ("q8_0", "q8_0")),
    (4, 8, 2, 64, 64, 300, 0, None, ("f16", "q8_0")),
    (4, 8, 2, 64, 64, 300, 0, None, ("q8_0", "f16")),
]


@pytest.mark.parametrize("T,H,Hkv,Dk,Dv,start,window,chunk,kinds", ATTN_CASES)
def test_attention(T, H, Hkv, Dk, Dv, start, window, chunk, kinds):
    rng = np.random.default_rng(T * 1000 + start)
    cap = start + T + 10
    n_kv = start + T
    kc, vc = _fill(rng, cap, Hkv, Dk, kinds[0], n_kv), _fill(rng, cap, Hkv, Dv, kinds[1], n_kv)
    q = (rng.standard_normal((T, H, Dk)) * 2).astype(np.float32)
    pos = np.arange(start, start + T, dtype=np.int32)
    scale = 1 / math.sqrt(Dk)
    got = cb.attention(cp.asarray(q), kc, vc, pos, n_kv, scale, window=window, chunk=chunk)
    ref = _attn_ref(q, _cache_values(kc), _cache_values(vc), pos, n_kv, scale, window)
    np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-4, atol=1e-5)
    if (H * Dv) % 32 == 0:  # the splits combined by the partials' own launch: the same bits
        cnt = cp.zeros(T * H, dtype=cp.int32)
        fused = cb.attention(cp.asarray(q), kc, vc, pos, n_kv, scale, window=window, chunk=chunk, counters=cnt)
        np.testing.assert_array_equal(cp.asnumpy(fused), cp.asnumpy(got))
        assert not cp.asnumpy(cnt).any()  # set back to zero for the next launch


def test_attention_rounding_modes_and_softcap():
    rng = np.random.default_rng(11)
    T, H, Hkv, D, start = 3, 4, 2, 64, 200
    n_kv = start + T
    kc, vc = _fill(rng, n_kv, Hkv, D, "f16", n_kv), _fill(rng, n_kv, Hkv, D, "f16", n_kv)
    K, V = _cache_values(kc), _cache_values(vc)
    q = (rng.standard_normal((T, H, D)) * 2).astype(np.float32)
    pos = np.arange(start, start + T, dtype=np.int32)
    for kw in (dict(q_round="f16"), dict(q_round="q8_0"), dict(softcap=5.0), dict(p_round=True),
               dict(q_round="f16", p_round=True, window=64)):
        got = cp.asnumpy(cb.attention(cp.asarray(q), kc, vc, pos, n_kv, 0.125, **kw))
        ref = _attn_ref(q, K, V, pos, n_kv, 0.125, **kw)
        tol = 2e-3 if kw.get("p_round") else 1e-4  # an f16 rounding boundary may fall either way
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * 0.1, err_msg=str(kw))


def test_attention_matches_cache_positions_not_slots_beyond_n_kv():
    # keys at slots >= n_kv (stale entries after a rollback) must be ignored
    rng = np.random.default_rng(5)
    T, H, Hkv, D = 2, 4, 2, 64
    kc, vc = _fill(rng, 64, Hkv, D, "f16", 64), _fill(rng, 64, Hkv, D, "f16", 64)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    pos = np.array([30, 40], np.int32)  # the second query's own position lies past n_kv
    got = cp.asnumpy(cb.attention(cp.asarray(q), kc, vc, pos, 35, 0.125))
    ref = _attn_ref(q, _cache_values(kc), _cache_values(vc), pos, 35, 0.125)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_attention_rows_do_not_depend_on_the_pass():
    # speculative verification needs a query row to give the same bits in a pass of T rows as in a
    # one-row pass; past 16K keys the default split size grows with the cache, and it must not grow
    # with the pass (the rows here straddle 16384 keys, where a split size taken from n_kv changed)
    rng = np.random.default_rng(11)
    H, Hkv, D, cap, p0, T = 2, 1, 64, 16500, 16380, 10
    kc, vc = _fill(rng, cap, Hkv, D, "f16", cap), _fill(rng, cap, Hkv, D, "f16", cap)
    q = cp.asarray(rng.standard_normal((T, H, D)).astype(np.float32))
    pos = np.arange(p0, p0 + T, dtype=np.int32)
    rows = cp.asnumpy(cb.attention(q, kc, vc, pos, p0 + T, 0.125))
    for t in range(T):
        one = cp.asnumpy(cb.attention(q[t:t + 1], kc, vc, pos[t:t + 1], p0 + t + 1, 0.125))
        np.testing.assert_array_equal(rows[t:t + 1], one, err_msg=f"row {t}")


def test_attention_in_row_groups(monkeypatch):
    # rows go in groups bounded by grid.y and by the partials buffer: the same bits either way
    rng = np.random.default_rng(12)
    T, H, Hkv, D = 9, 4, 2, 64
    kc, vc = _fill(rng, 600, Hkv, D, "f16", 600), _fill(rng, 600, Hkv, D, "q8_0", 600)
    q = cp.asarray(rng.standard_normal((T, H, D)).astype(np.float32))
    pos = np.arange(590, 590 + T, dtype=np.int32) - 5
    whole = cp.asnumpy(cb.attention(q, kc, vc, pos, 594, 0.125, chunk=64))
    monkeypatch.setattr(cb, "ATT_PARTIALS_BYTES", 2 * H * 10 * (D + 2) * 4)  # 2 rows a launch
    np.testing.assert_array_equal(cp.asnumpy(cb.attention(q, kc, vc, pos, 594, 0.125, chunk=64)), whole)
    cnt = cp.zeros(T * H, dtype=cp.int32)  # each group's launch combines its rows, counters reused
    for rounding in (None, "q8_k"):
        want = whole if rounding is None else cp.asnumpy(cb.round_act(cp.asarray(whole).reshape(T, -1), rounding))
        got = cb.attention(q, kc, vc, pos, 594, 0.125, chunk=64, counters=cnt, rounding=rounding)
        np.testing.assert_array_equal(cp.asnumpy(got).reshape(want.shape), want)
        assert not cp.asnumpy(cnt).any()


def test_glu_gelu_through_ggml_fp16_table():
    """act gelu_tanh_f16 equals the CPU path's llama.cpp GELU (sharpi_core/kernels/ops.c glu) up to
    tanhf's last bit before the f16 rounding: nearly always exactly."""
    import torch
    from sharpi_core.kernels import cpu
    if not cpu.available():
        pytest.skip("the CPU kernels are not built here")
    rng = np.random.default_rng(3)
    T, F = 4, 1024
    gu = (rng.standard_normal((T, 2 * F)) * 6).astype(np.float32)
    gu[0, :4] = [-10.5, 10.5, -10.0, 10.0]
    want = cpu.glu(torch.from_numpy(gu), F, "gelu_tanh").numpy()
    d = cp.asarray(gu)
    got = cp.asnumpy(cb.glu(d[:, :F], d[:, F:], "gelu_tanh_f16"))
    assert np.mean(got == want) > 0.999
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("kind", ["q8_32", "q8_k", "f16", "bf16"])
def test_round_act_equals_cpu_rounding(kind):
    """round_act (kernel act_round_q8 for the 8-bit kinds) gives quants.round_activations' bits."""
    import torch
    from sharpi_core.quants import quantize_q8_blocks
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((5, 1536)) * rng.uniform(0.01, 30, (5, 1))).astype(np.float32)
    x[1, :256] = 0.0                      # an all-zero block
    x[2, 7], x[2, 100] = 9.0, -9.0        # Q8_K: the first element of largest magnitude sets the sign
    xt = torch.from_numpy(x)
    if kind in ("q8_32", "q8_k"):
        want = quantize_q8_blocks(xt, 32 if kind == "q8_32" else 256, kind == "q8_32").numpy()
    else:
        want = (xt.half() if kind == "f16" else xt.bfloat16()).float().numpy()
    got = cp.asnumpy(cb.round_act(cp.asarray(x), kind))
    np.testing.assert_array_equal(got, want)
    d = cp.asarray(x)
    assert cb.round_act(d, kind, out=d) is d  # in place
    np.testing.assert_array_equal(cp.asnumpy(d), want)


@pytest.mark.parametrize("kind", ["q8_32", "q8_k", "f16", "bf16"])
def test_norm_and_glu_with_rounding_fused_are_the_two_steps(kind):
    """rms_norm / glu / attention with `rounding` (one launch) give round_act of their plain output bit
    for bit."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3, 1536)) * rng.uniform(0.1, 30, (3, 1))).astype(np.float32)
    add = rng.standard_normal((3, 1536)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, 1536).astype(np.float32)
    x[1, 300] = -40.0  # a block whose largest magnitude is negative
    want = cb.round_act(cb.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6, add=cp.asarray(add)), kind)
    d = cp.asarray(x)
    got = cb.rms_norm(d, cp.asarray(w), 1e-6, add=cp.asarray(add), rounding=kind)
    np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(want))
    np.testing.assert_array_equal(cp.asnumpy(d), x + add)  # the residual stream itself is not rounded
    g = (rng.standard_normal((3, 2 * 1280)) * 4).astype(np.float32)  # gate | up of a fused output
    for act in ("silu", "gelu_tanh_f16"):
        gd = cp.asarray(g)
        want = cb.round_act(cb.glu(gd[:, :1280], gd[:, 1280:], act), kind)
        got = cb.glu(gd[:, :1280], gd[:, 1280:], act, rounding=kind)
        np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(want))
    with pytest.raises(ValueError, match="multiple of"):
        cb.rms_norm(cp.asarray(x[:, :1000]), rounding="q8_k")
    # attention's output rounded by the launch that combines its splits (a q8_k block spans 4 heads)
    T, H, Hkv, D = 3, 8, 2, 64
    kc, vc = _fill(rng, 700, Hkv, D, "f16", 700), _fill(rng, 700, Hkv, D, "f16", 700)
    q = cp.asarray((rng.standard_normal((T, H, D)) * 3).astype(np.float32))
    pos = np.array([5, 400, 699], np.int32)  # one split, several, and a full cache
    for chunk in (64, None):
        plain = cb.attention(q, kc, vc, pos, 700, 0.125, chunk=chunk)
        want = cb.round_act(plain.reshape(T, H * D), kind)
        got = cb.attention(q, kc, vc, pos, 700, 0.125, chunk=chunk, rounding=kind)
        np.testing.assert_array_equal(cp.asnumpy(got).reshape(T, H * D), cp.asnumpy(want), err_msg=f"chunk {chunk}")
        assert not np.array_equal(cp.asnumpy(got), cp.asnumpy(plain))
        got = cb.attention(q, kc, vc, pos, 700, 0.125, chunk=chunk, rounding=kind, counters=cp.zeros(T * H, cp.int32))
        np.testing.assert_array_equal(cp.asnumpy(got).reshape(T, H * D), cp.asnumpy(want), err_msg=f"fused, {chunk}")


# ---- q8 rows: the integer matvecs' activations ----------------------------------------------------

def _q8_split(rows: np.ndarray, K: int, kind: str = "q8_k"):
    """q8 rows uint8 [T, >= q8_row_bytes(K)] -> (codes int8 [T, K], d float32 [T, K/32], s [T, K/32]: int32
    sums of a q8_k row, Q8_1's float32 s of a q8_32 row)."""
    rows = np.ascontiguousarray(rows)
    nb = K // 32
    return (rows[:, :K].view(np.int8), np.ascontiguousarray(rows[:, K:K + 4 * nb]).view(np.float32),
            np.ascontiguousarray(rows[:, K + 4 * nb:K + 8 * nb]).view(np.float32 if kind == "q8_32" else np.int32))


@pytest.mark.parametrize("kind", ["q8_32", "q8_k"])
def test_q8_rows_are_the_cpu_codes(kind):
    """quantize_act's q8 rows hold quants.q8_parts' codes and scales (the CPU path's rounding, so codes *
    d are round_act's values) and s: the codes' sums per 32 (Q8_K), Q8_1's s = f16(amax / 127 * sum),
    the scale before its f16 rounding (Q8_0 / Q8_1); x already rounded gives the same codes."""
    import cuda_fake
    rng = np.random.default_rng(21)
    K = 1536
    x = (rng.standard_normal((5, K)) * rng.uniform(0.01, 30, (5, 1))).astype(np.float32)
    x[1, :256] = 0.0                   # an all-zero block
    x[2, 7], x[2, 100] = 9.0, -9.0     # Q8_K: the first element of largest magnitude sets the sign
    x[3, 32:64] = np.linspace(-127, 127, 32)  # codes on halves
    got = cp.asnumpy(cb.quantize_act(cp.asarray(x), kind))
    assert got.shape == (5, cb.q8_row_bytes(K)) and cb.q8_row_bytes(K) % 16 == 0
    want = cuda_fake.quantize_act(x, kind)
    c, d, s = _q8_split(got, K, kind)
    cw, dw, sw = _q8_split(want, K, kind)
    np.testing.assert_array_equal(c, cw)
    np.testing.assert_array_equal(d, dw)
    np.testing.assert_array_equal(s, sw)
    sums = c.reshape(5, -1, 32).astype(np.int32).sum(axis=2)
    if kind == "q8_k":
        np.testing.assert_array_equal(s, sums)
    else:  # f16(d' * sum), d' = amax / 127 in fp32: not the stored d (its f16), which moves it by up to 2^-11
        raw = np.abs(x.reshape(5, -1, 32)).max(axis=2) / np.float32(127)
        np.testing.assert_array_equal(s, (raw * sums.astype(np.float32)).astype(np.float16).astype(np.float32))
        assert not np.array_equal(s, (d * sums.astype(np.float32)).astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(np.repeat(d, 32, axis=1) * c, cp.asnumpy(cb.round_act(cp.asarray(x), kind)))
    again = cp.asnumpy(cb.quantize_act(cb.round_act(cp.asarray(x), kind), kind))
    c2, d2, s2 = _q8_split(again, K, kind)
    np.testing.assert_array_equal(c2, c)
    np.testing.assert_allclose(d2, d, rtol=2e-7, atol=0)  # (Q8_K's 1 / iscale may move by an ulp)
    if kind == "q8_k":
        np.testing.assert_array_equal(s2, s)
    else:  # (from rounded values d' is the rounded scale: s within an f16 ulp)
        np.testing.assert_allclose(s2, s, rtol=2 ** -10, atol=0)
    with pytest.raises(ValueError, match="uint8"):
        cb.quantize_act(cp.asarray(x), kind, out=cp.zeros((5, 100), cp.uint8))


@pytest.mark.parametrize("kind", ["q8_32", "q8_k"])
def test_rounding_kernels_write_the_q8_rows_of_their_output(kind):
    """rms_norm / glu / attention / round_act with `rounding` and q8 rows: those rows are quantize_act's
    of their unrounded output, byte for byte (in rows of a wider buffer too)."""
    rng = np.random.default_rng(22)
    T, K = 3, 1536
    x = (rng.standard_normal((T, K)) * rng.uniform(0.1, 30, (T, 1))).astype(np.float32)
    w = rng.uniform(0.5, 2.0, K).astype(np.float32)
    rb = cb.q8_row_bytes(K)
    plain = cb.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6)
    q8 = cp.zeros((T, rb + 32), cp.uint8)[:, :rb]  # rows of a wider buffer
    cb.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6, rounding=kind, q8=q8)
    np.testing.assert_array_equal(cp.asnumpy(q8), cp.asnumpy(cb.quantize_act(plain, kind)))
    q8 = cp.zeros((T, rb), cp.uint8)
    cb.round_act(plain, kind, q8=q8)
    np.testing.assert_array_equal(cp.asnumpy(q8), cp.asnumpy(cb.quantize_act(plain, kind)))
    g = (rng.standard_normal((T, 2 * 1280)) * 4).astype(np.float32)
    gd = cp.asarray(g)
    q8 = cp.zeros((T, cb.q8_row_bytes(1280)), cp.uint8)
    cb.glu(gd[:, :1280], gd[:, 1280:], "silu", rounding=kind, q8=q8)
    np.testing.assert_array_equal(cp.asnumpy(q8), cp.asnumpy(cb.quantize_act(cb.glu(gd[:, :1280], gd[:, 1280:]), kind)))
    with pytest.raises(ValueError, match="8-bit"):
        cb.glu(gd[:, :1280], gd[:, 1280:], "silu", rounding="f16", q8=q8)
    H, Hkv, D = 8, 2, 64
    kc, vc = _fill(rng, 700, Hkv, D, "f16", 700), _fill(rng, 700, Hkv, D, "f16", 700)
    q = cp.asarray((rng.standard_normal((T, H, D)) * 3).astype(np.float32))
    pos = np.array([5, 400, 699], np.int32)
    for chunk in (64, None):
        want = cp.asnumpy(cb.quantize_act(cb.attention(q, kc, vc, pos, 700, 0.125, chunk=chunk).reshape(T, H * D), kind))
        for counters in (None, cp.zeros(T * H, cp.int32)):
            q8 = cp.zeros((T, cb.q8_row_bytes(H * D)), cp.uint8)
            cb.attention(q, kc, vc, pos, 700, 0.125, chunk=chunk, rounding=kind, counters=counters, q8=q8)
            np.testing.assert_array_equal(cp.asnumpy(q8), want, err_msg=f"chunk {chunk}, counters {counters is not None}")


def _q8_1_s_error(raw: np.ndarray, qtype, x: np.ndarray, unrounded: np.ndarray | None = None) -> np.ndarray:
    """What taking Q8_1's s (f16) for the sum of a block of activations x [T, K] adds to the product with a
    Q4_1 / Q5_1 weight (zero for the other types): sum over blocks of m_w (s - sum(x)), float64 [T, N]; s
    that of x's rounding, or of `unrounded`'s (the values x was rounded from)."""
    if qtype not in cb.Q8_1_S_TYPES:
        return np.zeros((x.shape[0], raw.shape[0]))
    n, nb = raw.shape[0], x.shape[1] // 32
    m = raw.reshape(n, nb, -1)[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64)  # [N, K/32]
    _, _, s = q8_parts(torch.from_numpy(x if unrounded is None else unrounded), 32, True)
    err = s.numpy().reshape(x.shape[0], nb).astype(np.float64) - x.astype(np.float64).reshape(x.shape[0], nb, 32).sum(2)
    return err @ m.T


@pytest.mark.parametrize("qtype", cb.Q8_1_S_TYPES)
def test_gemm_takes_q8_1_s_as_the_matvecs(qtype):
    """From GEMM_MIN_ROWS rows on (prefill) a Q4_1 / Q5_1 product is a GEMM of the dequantized weight, corrected
    to take Q8_1's s for each activation block's sum as the integer matvecs (and ggml) do: the rows of one GEMM
    equal those of 16-row matvecs to fp32 rounding, given the q8 rows of the unrounded values (the model's
    rounding kernels write them) or made from the rounded ones."""
    rng = np.random.default_rng(24)
    n, k, T = 70, 2 * _k_for(qtype), cb.GEMM_MIN_ROWS + 6
    raw = random_raw(qtype, n, k, rng)
    w = gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32)
    cw = cb.CudaQWeight(raw, qtype, n, k)
    x0 = (rng.standard_normal((T, k)) * rng.uniform(0.1, 10, (T, 1))).astype(np.float32)
    x = act(cw, x0)
    xq = cb.quantize_act(cp.asarray(x0), cw.xq_kind)
    y = cp.asnumpy(cw.matmul(cp.asarray(x), xq=xq))
    rows = np.concatenate([cp.asnumpy(cw.matmul(cp.asarray(x[t:t + 16]), xq=xq[t:t + 16])) for t in range(0, T, 16)])
    np.testing.assert_allclose(y, rows, rtol=1e-5, atol=1e-5 * np.abs(rows).max())
    check_matmul(y - _q8_1_s_error(raw, qtype, x, x0), x, w, tol=1e-5)
    assert check_matmul(y, x, w) > 1e-5  # (the correction is there: s is not the sum)
    made = cp.asnumpy(cw.matmul(cp.asarray(x)))  # q8 rows made from x, already rounded
    check_matmul(made - _q8_1_s_error(raw, qtype, x), x, w, tol=1e-5)


def test_integer_and_float_matvecs_agree(monkeypatch):
    """The integer matvecs (the default for their types) and the float ones (SHARPI_CUDA_DP4A=0) give the
    same products of rounded activations to fp32 rounding; matmul quantizes x itself when no q8 rows
    come with it, and reads only the q8 rows when they do."""
    rng = np.random.default_rng(23)
    for qtype in cb.INT_LANE_SPAN:
        n, k = 45, 2 * _k_for(qtype)
        raw = random_raw(qtype, n, k, rng)
        w = gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32)
        ci = cb.CudaQWeight(raw, qtype, n, k)
        monkeypatch.setattr(cb, "DP4A", False)
        cf = cb.CudaQWeight(raw, qtype, n, k)
        monkeypatch.setattr(cb, "DP4A", True)
        assert ci.xq_kind == ("q8_k" if cb.K_MULTIPLE[qtype] == 256 else "q8_32") and cf.xq_kind is None
        assert ci.wants_xq(16) and not cf.wants_xq(1) and not cf.wants_xq(cb.GEMM_MIN_ROWS)
        assert ci.wants_xq(cb.GEMM_MIN_ROWS) == (qtype in cb.Q8_1_S_TYPES)  # the GEMM's correction to Q8_1's s
        x = act(ci, rng.standard_normal((5, k)).astype(np.float32))
        yi, yf = cp.asnumpy(ci.matmul(cp.asarray(x))), cp.asnumpy(cf.matmul(cp.asarray(x)))
        # exact integer sums: fp32 rounding only (Q4_1 / Q5_1: with the min times Q8_1's s, as ggml's
        # vec_dot_q4_1_q8_1, where the float matvecs take the sum of the values)
        check_matmul(yi - _q8_1_s_error(raw, qtype, x), x, w, tol=2e-6)
        check_matmul(yf, x, w, tol=2e-6)
        xq = cb.quantize_act(cp.asarray(x), ci.xq_kind)
        np.testing.assert_array_equal(cp.asnumpy(ci.matmul(cp.asarray(x), xq=xq)), yi)
        np.testing.assert_array_equal(cp.asnumpy(ci.matmul(cp.zeros((5, k), cp.float32), xq=xq)), yi, err_msg=qtype.name)


def test_attention_loads_in_flight_do_not_change_the_bits(monkeypatch):
    """ops.cu built with the earlier loads in flight (ATT_K_LOADS=8, ATT_V_LOADS=4; benchmarks compare
    them) gives the same attention bits: the sums keep their order."""
    rng = np.random.default_rng(24)
    H, Hkv, D = 8, 2, 128
    kc, vc = _fill(rng, 300, Hkv, D, "f16", 300), _fill(rng, 300, Hkv, D, "f16", 300)
    q = cp.asarray(rng.standard_normal((3, H, D)).astype(np.float32))
    pos = np.array([3, 150, 299], np.int32)
    run = lambda: [cp.asnumpy(cb.attention(q, kc, vc, pos, 300, 0.125, chunk=c)) for c in (None, 64)]  # noqa: E731
    want = run()
    monkeypatch.setattr(cb, "OPS_DEFS", "-DATT_K_LOADS=8 -DATT_V_LOADS=4")
    monkeypatch.setattr(cb, "_modules", {})
    monkeypatch.setattr(cb, "_functions", {})
    for got, w in zip(run(), want):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("D,vkind", [(64, "f16"), (128, "f16"), (256, "f16"), (64, "q8_0"), (128, "q8_0")])
def test_attention_of_one_split_finishes_in_its_own_block(D, vkind, monkeypatch):
    """A fused launch (counters) whose row has its keys in one split (the others empty), with whole rounding
    blocks in its block's heads, writes that row's output from the split's block (no partials, no counter):
    the bits of the launch that combines separately, for every rounding (Q8_K's 256-blocks span heads: a
    block then holds the heads of one, 2 of 128 or a head of 256 (4 of 64: more than ATT_MAX_HPB, through the
    counters); and with a head a block, SHARPI_CUDA_ATT_UNITS=0 or more shared memory than ATT_UNIT_SMEM, through
    the counters), q8 rows included, beside rows of several splits and within a sliding window."""
    rng = np.random.default_rng(25)
    T, H, Hkv, cap = 5, 4, 2, 700  # 3 splits of 256 keys: rows 0, 77, 255 see one, 256 two, 699 three
    assert cb.attention_splits(cap, cap)[1] == 3
    assert cb.attention_heads_per_block(H, D, "q8_k", True, False) == (256 // D if 256 // D <= cb.ATT_MAX_HPB else 1)
    assert cb.attention_heads_per_block(H, D, "q8_k", True, True) == 1  # p_round: one head a block
    assert cb.attention_heads_per_block(H, D, "q8_k", False, False) == cb.attention_heads_per_block(H, D, "q8_32", True, False) == 1
    kc, vc = _fill(rng, cap, Hkv, D, "f16", cap), _fill(rng, cap, Hkv, D, vkind, cap)
    q = cp.asarray((rng.standard_normal((T, H, D)) * 2).astype(np.float32))
    pos = np.array([0, 77, 255, 256, 699], np.int32)
    for rounding in (None, "f16", "bf16", "q8_32", "q8_k"):
        for kw in (dict(), dict(window=100), dict(p_round=True)):
            if kw.get("p_round") and vkind != "f16":
                continue
            kw = dict(kw, rounding=rounding)
            want = cp.asnumpy(cb.attention(q, kc, vc, pos, cap, 0.125, **kw))
            cnt = cp.zeros(T * H, cp.int32)
            q8 = cp.zeros((T, cb.q8_row_bytes(H * D)), cp.uint8) if rounding in ("q8_32", "q8_k") else None
            got = cp.asnumpy(cb.attention(q, kc, vc, pos, cap, 0.125, counters=cnt, q8=q8, **kw))
            np.testing.assert_array_equal(got, want, err_msg=f"{rounding} {kw}")
            assert not cp.asnumpy(cnt).any()
            if rounding == "q8_k" and D < 256:  # a head a block, the Q8_K blocks finished through the counters
                for name, off in (("ATT_UNITS", False), ("ATT_UNIT_SMEM", 0)):
                    monkeypatch.setattr(cb, name, off)
                    q8h = cp.zeros_like(q8)
                    np.testing.assert_array_equal(cp.asnumpy(cb.attention(q, kc, vc, pos, cap, 0.125, counters=cnt,
                                                                          q8=q8h, **kw)), want, err_msg=f"{name} {kw}")
                    np.testing.assert_array_equal(cp.asnumpy(q8h), cp.asnumpy(q8))
                    monkeypatch.undo()
            if q8 is not None:
                plain = cb.attention(q, kc, vc, pos, cap, 0.125, **dict(kw, rounding=None)).reshape(T, H * D)
                np.testing.assert_array_equal(cp.asnumpy(q8), cp.asnumpy(cb.quantize_act(plain, rounding)))


def test_matvecs_ask_the_l2_for_the_weights_ahead_and_change_no_bits():
    # a weight's `ahead` (ahead_ranges: the pass's next matrices, in order, cut at a budget) is asked of the L2
    # by its matvecs' threads too: the same results, float and integer matvecs, one row and a verify pass's;
    # in the emulator (its log of prefetches; it reports one outside every live allocation) every line of
    # every range, by a grid of fewer threads than lines
    rng = np.random.default_rng(33)
    ws = [cp.asarray(rng.integers(0, 256, n, dtype=np.uint8)) for n in (5000, 70000, 1_400_000)]  # ~11k lines
    assert cb.ahead_ranges(ws, 0) is None
    assert cp.asnumpy(cb.ahead_ranges(ws, 75000)).tolist() == [[ws[0].data.ptr, 5000], [ws[1].data.ptr, 70000]]
    assert cp.asnumpy(cb.ahead_ranges(ws, 6000)).tolist() == [[ws[0].data.ptr, 5000], [ws[1].data.ptr, 1000]]
    lines = {w.data.ptr + 128 * i for w in ws for i in range(-(-int(w.nbytes) // 128))}
    n, k = 300, 1024  # 300 rows: 19-75 blocks of 128 threads (fewer than the lines)
    w = cb.CudaQWeight(random_raw(Q.Q4_K, n, k, rng), Q.Q4_K, n, k)
    for T in (1, 5):
        x = cp.asarray(round_activations(torch.from_numpy(rng.standard_normal((T, k)).astype(np.float32)),
                                         Q.Q4_K).numpy())
        for xq in (None, cb.quantize_act(x, w.xq_kind)):
            w.ahead = None
            want = cp.asnumpy(w.matmul(x, xq=xq))
            w.ahead = cb.ahead_ranges(ws, 1 << 30)
            raw = cb.function("qmatvec", f"qmv{'i' if xq is not None else ''}_q4_k_q1_r1", w._opts).raw
            lib = getattr(raw, "_lib", None)  # the emulator's kernel library
            log = np.zeros(1 << 18, np.uint64)
            if lib is not None:
                lib.simt_prefetch_log(ctypes.c_void_p(log.ctypes.data), ctypes.c_int(log.size))
            try:
                got = cp.asnumpy(w.matmul(x, xq=xq))
            finally:
                m = lib.simt_prefetch_log(None, ctypes.c_int(0)) if lib is not None else 0
            np.testing.assert_array_equal(got, want, err_msg=f"T={T} xq={xq is not None}")
            if lib is not None:
                assert 0 < m < log.size and lines <= set(int(a) for a in log[:m])
    with pytest.raises(ValueError, match="ahead must be"):
        w.ahead = cb.ahead_ranges(ws, 1 << 30)[:, :1]


def test_a_host_copy_dropped_unread_keeps_its_pinned_block_until_the_copy_lands():
    # a look-ahead that missed drops its copy unread, maybe still queued behind the draft's chain: the pinned
    # block must not go back to CuPy's pool (which would hand it out again) before the copy's event is done
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        a = cp.arange(7, dtype=cp.int32)
    first = cb.to_host_async(a, s)
    block, event = first._host, first._done
    del first
    assert any(h is block for _, h in cb._copies_in_flight)
    event.synchronize()
    with s:
        b = a * 2
    second = cb.to_host_async(b, s)
    assert not any(h is block for _, h in cb._copies_in_flight)  # done: let go at the next copy
    assert any(h is second._host for _, h in cb._copies_in_flight)
    np.testing.assert_array_equal(second.get(), np.arange(7, dtype=np.int32) * 2)
