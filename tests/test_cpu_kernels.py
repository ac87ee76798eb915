"""The C kernels (sharpi_core.kernels.cpu) against gguf.quants, the reference.

Bounds: dequant_rows is bit-identical to gguf.quants.dequantize. qmatmul keeps activations in fp32
and dequantizes every block exactly, so it differs from x @ W.T only by fp32 summation order:
each output element is checked against a float64 reference with
    |y - y_ref| <= 1e-5 * sum_k |x_k| |W_nk|          (observed: <= ~3e-7)
which is also the distance allowed to torch's fp32 x @ W.T.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import warnings

import gguf
import numpy as np
import pytest
import torch

from sharpi_core.kernels import cpu

Q = gguf.GGMLQuantizationType
REL_TOL = 1e-5
TS = (1, 2, 4, 5, 8, 16, 64)
LEGACY = (Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
KQUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
ALL_TYPES = LEGACY + KQUANTS


def _cpu_can_build() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return shutil.which("gcc") is not None and "avx512bw" in flags and "avx512vl" in flags


def test_builds_where_it_can():
    """Where gcc and AVX-512 exist the library must build (a broken build fails here, not silently)."""
    if not _cpu_can_build():
        pytest.skip("no gcc or no AVX-512 here")
    assert cpu.available(), cpu.unavailable_reason()
    assert cpu.unavailable_reason() is None
    info = cpu.build_info()
    assert info["path"] is not None and info["path"].is_file()
    assert info["path"].parent == cpu.kernel_dir()
    assert cpu.SUPPORTED == frozenset(ALL_TYPES)


needs_kernels = pytest.mark.skipif(not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}")


def torch_view(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def random_raw(qtype, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random weights of type qtype as GGUF blocks [n, row_bytes] (uint8)."""
    rng = np.random.default_rng(seed)
    if qtype in LEGACY:
        w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))).astype(np.float32)
        w[0, :32] = 0.0  # an all-zero block (zero scale)
        raw = gguf.quants.quantize(w, qtype)
        return raw.view(np.uint8).reshape(n, -1)
    # K-quants: random bytes (every bit pattern of codes and 6-bit scales is valid) with sane f16 scales
    be, bb = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // be * bb), dtype=np.uint8)
    blk = raw.reshape(n, k // be, bb)

    def put_f16(off, lo, hi, signed=False):
        v = rng.uniform(lo, hi, blk.shape[:2])
        if signed:
            v *= rng.choice([-1.0, 1.0], blk.shape[:2])
        blk[:, :, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(*blk.shape[:2], 2)

    if qtype == Q.Q6_K:
        put_f16(208, 1e-4, 3e-2, signed=True)
        blk[0, 0, 208:210] = 0  # zero super-block scale
    else:
        put_f16(0, 1e-4, 3e-2, signed=True)
        put_f16(2, 1e-4, 3e-2)
    return raw


def reference(raw: np.ndarray, qtype, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)).reshape(n, k)


def check_matmul(x: torch.Tensor, W: torch.Tensor, y: torch.Tensor, what: str):
    ref64 = x.double() @ W.double().T
    scale = x.double().abs() @ W.double().abs().T
    tol = REL_TOL * scale + 1e-30
    err = (y.double() - ref64).abs()
    bad = err > tol
    assert not bad.any(), f"{what}: max err/scale {float((err / (scale + 1e-30)).max()):.3g}"
    ref32 = x @ W.T  # the contract: torch's fp32 result, within fp32 rounding
    assert ((y.double() - ref32.double()).abs() <= 2 * tol).all(), what


@needs_kernels
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_dequant_rows_bit_exact(qtype):
    n, k = 37, 512
    raw = random_raw(qtype, n, k, seed=1)
    W = reference(raw, qtype, n, k)
    got = cpu.dequant_rows(torch_view(raw), qtype, torch.arange(n), k)
    assert torch.equal(got, W)
    ids = torch.tensor([5, 0, 36, 5, 17])
    assert torch.equal(cpu.dequant_rows(torch_view(raw), qtype, ids, k), W[ids])
    assert cpu.dequant_rows(torch_view(raw), qtype, torch.zeros(0, dtype=torch.int64), k).shape == (0, k)


@needs_kernels
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_qmatmul_random_blocks(qtype):
    n, k = 75, 768  # n: not a multiple of the 4-row tiles
    raw = random_raw(qtype, n, k, seed=2)
    W = reference(raw, qtype, n, k)
    rawt = torch_view(raw)
    g = torch.Generator().manual_seed(0)
    for t in TS + (3, 7, 9, 17, cpu.GEMM_MIN_ROWS - 1, cpu.GEMM_MIN_ROWS):
        x = torch.randn(t, k, generator=g) * 3
        y = cpu.qmatmul(x, rawt, qtype, n, k)
        assert y.shape == (t, n) and y.dtype == torch.float32
        check_matmul(x, W, y, f"{qtype.name} T={t}")


@needs_kernels
@pytest.mark.parametrize("qtype", (Q.Q4_1, Q.Q4_K, Q.Q6_K, Q.Q5_0), ids=lambda q: q.name)
def test_batch_invariant_and_thread_independent(qtype):
    """Below the GEMM threshold the result for a token does not depend on T, its position in the
    batch or the thread count: a speculative verify pass reproduces single-token decoding bit for bit."""
    n, k = 203, 1024
    raw = torch_view(random_raw(qtype, n, k, seed=3))
    x = torch.randn(cpu.GEMM_MIN_ROWS - 1, k, generator=torch.Generator().manual_seed(1))
    nth = torch.get_num_threads()
    try:
        singles = torch.cat([cpu.qmatmul(x[i:i + 1].contiguous(), raw, qtype, n, k) for i in range(len(x))])
        for t in range(2, len(x) + 1):
            assert torch.equal(cpu.qmatmul(x[:t].contiguous(), raw, qtype, n, k), singles[:t]), t
            assert torch.equal(cpu.qmatmul(x[-t:].contiguous(), raw, qtype, n, k), singles[-t:]), t
        torch.set_num_threads(1)
        assert torch.equal(cpu.qmatmul(x, raw, qtype, n, k), singles)
    finally:
        torch.set_num_threads(nth)


@needs_kernels
def test_out_parameter_and_edges():
    qtype, n, k = Q.Q4_K, 16, 256
    raw = torch_view(random_raw(qtype, n, k))
    W = reference(raw.numpy(), qtype, n, k)
    x = torch.randn(3, k)
    out = torch.full((3, n), float("nan"))
    assert cpu.qmatmul(x, raw, qtype, n, k, out=out) is out
    check_matmul(x, W, out, "out=")
    big = torch.randn(cpu.GEMM_MIN_ROWS + 5, k)
    out = torch.empty(len(big), n)
    assert cpu.qmatmul(big, raw, qtype, n, k, out=out) is out
    check_matmul(big, W, out, "out= gemm")
    assert cpu.qmatmul(torch.zeros(0, k), raw, qtype, n, k).shape == (0, n)
    # a single row and a weight with one output
    one = torch_view(np.ascontiguousarray(raw.numpy()[:1]))
    check_matmul(x, W[:1], cpu.qmatmul(x, one, qtype, 1, k), "n=1")


@needs_kernels
def test_rejects_bad_arguments():
    qtype, n, k = Q.Q4_0, 8, 64
    raw = torch_view(random_raw(qtype, n, k))
    x = torch.randn(2, k)
    with pytest.raises(ValueError):
        cpu.qmatmul(x.double(), raw, qtype, n, k)
    with pytest.raises(ValueError):
        cpu.qmatmul(torch.randn(k, 2).t(), raw, qtype, n, k)  # not contiguous
    with pytest.raises(ValueError):
        cpu.qmatmul(torch.randn(2, k + 32), raw, qtype, n, k)
    with pytest.raises(ValueError):
        cpu.qmatmul(x, raw[:4], qtype, n, k)  # wrong byte count
    with pytest.raises(ValueError):
        cpu.qmatmul(x, raw, Q.Q2_K, n, k)
    with pytest.raises(ValueError):
        cpu.qmatmul(x, raw, qtype, n, k, out=torch.empty(n, 2))
    with pytest.raises(ValueError):
        cpu.qmatmul(torch.randn(2, 48), torch.zeros(n, 27, dtype=torch.uint8), qtype, n, 48)  # K % 32
    with pytest.raises(IndexError):
        cpu.dequant_rows(raw, qtype, torch.tensor([0, n]), k)
    with pytest.raises(IndexError):
        cpu.dequant_rows(raw, qtype, torch.tensor([-1]), k)


def test_unavailable_without_compiler(tmp_path):
    """No compiler: available() is False with a reason, never an exception."""
    code = ("from sharpi_core.kernels import cpu; "
            "print(cpu.available()); print(cpu.unavailable_reason())")
    env = dict(os.environ, SHARPI_CC=str(tmp_path / "no-such-cc"), SHARPI_KERNEL_DIR=str(tmp_path / "k"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "False" and lines[1] != "None", r.stdout


# --- real tensors from the registry models (only those already downloaded) ---------------------
# One tensor per quantization type the models use (first tensor of that type in the file).
REAL = [
    ("smollm2-135m-instruct-q4_1", Q.Q4_1),
    ("smollm2-135m-instruct-q4_1", Q.Q8_0),  # token_embd
    ("qwen2.5-coder-0.5b-instruct-q4_k_m", Q.Q5_0),
    ("qwen2.5-coder-1.5b-instruct-q4_k_m", Q.Q4_K),
    ("qwen2.5-coder-1.5b-instruct-q4_k_m", Q.Q6_K),
]


@functools.lru_cache(maxsize=None)
def _reader(name: str):
    from conftest import model_path
    return gguf.GGUFReader(str(model_path(name)), "r")  # fetched through the registry when absent


@needs_kernels
@pytest.mark.parametrize("model,qtype", [
    pytest.param(m, q, id=f"{q.name}-{m.split('-')[0]}", marks=() if m.startswith("smollm2") else (pytest.mark.slow,))
    for m, q in REAL])
def test_real_tensor(model, qtype):
    t = next(t for t in _reader(model).tensors if t.tensor_type == qtype and len(t.shape) == 2)
    k, n_all = int(t.shape[0]), int(t.shape[1])
    data = np.asarray(t.data)
    rows = min(n_all, 384)
    raw = data[:rows]  # a view into the mmap
    W = reference(raw, qtype, rows, k)
    rawt = torch_view(raw)
    assert torch.equal(cpu.dequant_rows(rawt, qtype, torch.arange(rows), k), W)
    # row lookup on the whole tensor (embedding path), far rows included
    ids = torch.tensor([0, n_all - 1, n_all // 2, 3])
    full = torch_view(data)
    assert torch.equal(cpu.dequant_rows(full, qtype, ids, k), reference(data[ids.numpy()], qtype, 4, k))
    g = torch.Generator().manual_seed(7)
    for T in TS:
        x = torch.randn(T, k, generator=g)
        check_matmul(x, W, cpu.qmatmul(x, rawt, qtype, rows, k), f"{t.name} T={T}")
    # the full tensor, decode-sized input
    x = torch.randn(1, k, generator=g)
    y = cpu.qmatmul(x, full, qtype, n_all, k)
    assert torch.equal(y[:, :rows], cpu.qmatmul(x, rawt, qtype, rows, k))
    last = torch.arange(n_all - 64, n_all)
    check_matmul(x, reference(data[n_all - 64:], qtype, 64, k), y[:, last], f"{t.name} tail rows")
