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
LEGACY = (Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.MXFP4)
KQUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)  # (IQ4_XS: super-blocks and Q8_K too)
ALL_TYPES = LEGACY + KQUANTS


def _cpu_can_build() -> bool:
    return shutil.which("gcc") is not None and cpu.simd_level() is not None  # cpu.py's CPU flag check


def test_builds_where_it_can():
    """Where gcc and AVX2 exist the library must build (a broken build fails here, not silently)."""
    if not _cpu_can_build():
        pytest.skip("no gcc or no AVX2 here")
    assert cpu.available(), cpu.unavailable_reason()
    assert cpu.unavailable_reason() is None
    info = cpu.build_info()
    assert info["path"] is not None and info["path"].is_file()
    assert info["path"].parent == cpu.kernel_dir()
    assert cpu.SUPPORTED == frozenset(ALL_TYPES) | {Q.F32}  # (F32: rows of 64s, ggml's orders; test_ops)


def test_a_cached_library_cut_short_is_built_again_not_loaded(tmp_path):
    """A library file cut short (a damaged disk, a crash before its blocks reached it) would be mapped past its
    end and kill every run with SIGBUS: cpu.whole_elf tells it from a whole one, and _load builds those again."""
    if not cpu.available():
        pytest.skip(f"C kernels unavailable: {cpu.unavailable_reason()}")
    data = cpu.build_info()["path"].read_bytes()
    whole = tmp_path / "whole.so"
    whole.write_bytes(data)
    assert cpu.whole_elf(whole)
    for n in (0, 10, 64, 4096, len(data) // 2, len(data) - 1):
        cut = tmp_path / f"cut{n}.so"
        cut.write_bytes(data[:n])
        assert not cpu.whole_elf(cut), n
    (tmp_path / "text.so").write_bytes(b"not a library" * 100)
    assert not cpu.whole_elf(tmp_path / "text.so") and not cpu.whole_elf(tmp_path / "missing.so")
    assert "whole_elf" in cpu._load.__code__.co_names  # (_load asks it, where it asked whether the file exists)


needs_kernels = pytest.mark.skipif(not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}")


def torch_view(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def random_raw(qtype, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random weights of type qtype as GGUF blocks [n, row_bytes] (uint8)."""
    rng = np.random.default_rng(seed)
    if qtype == Q.IQ4_NL:  # no quantizer in gguf.quants: random codes, sane f16 scales, one zero block
        raw = rng.integers(0, 256, (n, k // 32, 18), dtype=np.uint8)
        raw[..., :2] = rng.uniform(1e-4, 3e-2, (n, k // 32)).astype(np.float16).view(np.uint8).reshape(n, k // 32, 2)
        raw[0, 0, :2] = 0
        return raw.reshape(n, -1)
    if qtype == Q.MXFP4:  # gguf's quantizer, then every exponent (2^-128 .. 2^127 times the codes) somewhere
        w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))).astype(np.float32)
        raw = gguf.quants.quantize(w, qtype).view(np.uint8).reshape(n, k // 32, 17)
        raw[0, 0, 0] = 0  # 2^-128: a denormal scale
        raw[1, 0, 0] = 1
        raw[2, 0, 0] = 140  # large, finite products
        return raw.reshape(n, -1)
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

    if qtype in (Q.Q6_K, Q.Q3_K):
        o = 208 if qtype == Q.Q6_K else 108
        put_f16(o, 1e-4, 3e-2, signed=True)
        blk[0, 0, o:o + 2] = 0  # zero super-block scale
    elif qtype == Q.Q2_K:
        put_f16(80, 1e-4, 3e-2, signed=True)
        put_f16(82, 1e-4, 3e-2)
    elif qtype == Q.IQ4_XS:
        put_f16(0, 1e-4, 3e-2, signed=True)
        blk[0, 0, 0:2] = 0
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


def test_the_build_uses_gccs_lto_on_several_cores_and_the_plain_build_where_that_fails(tmp_path, monkeypatch):
    """-flto=N (N = this process's cores, at most 8) only shortens gcc's build; a gcc whose LTO fails gets the plain
    command line, and the library is the plain build's."""
    if not cpu.available():
        pytest.skip(f"C kernels unavailable: {cpu.unavailable_reason()}")
    built = cpu.build_info()["path"]
    log = tmp_path / "args"
    gcc = tmp_path / "gcc"  # a stand-in: records its arguments, fails with -flto, else copies this process's library
    gcc.write_text(f'#!/bin/sh\necho "$@" >> {log}\ncase " $* " in *" -flto="*) exit 1;; esac\n'
                   f'while [ $# -gt 0 ]; do [ "$1" = -o ] && exec cp {built} "$2"; shift; done\nexit 1\n')
    gcc.chmod(0o755)
    monkeypatch.delenv("SHARPI_KERNEL_LTO", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    dest = tmp_path / "k" / "lib.so"
    cpu._build(str(gcc), dest, ())
    calls = [c.split() for c in log.read_text().splitlines()]
    assert len(calls) == 2 and "-flto=8" in calls[0] and not any(a.startswith("-flto") for a in calls[1]), calls
    assert calls[0][1:] == calls[1]
    assert dest.read_bytes() == built.read_bytes() and not list(dest.parent.glob(".qmatmul-*"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert cpu._lto_flags(str(gcc)) == ("-flto=2",)
    assert cpu._lto_flags(str(tmp_path / "clang")) == ()  # not gcc
    monkeypatch.setenv("SHARPI_KERNEL_LTO", "0")
    assert cpu._lto_flags(str(gcc)) == ()
    monkeypatch.delenv("SHARPI_KERNEL_LTO")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert cpu._lto_flags(str(gcc)) == ()  # one core: LTO would only add work


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


REAL_PARAMS = [pytest.param(m, q, id=f"{q.name}-{m.split('-')[0]}",
                           marks=() if m.startswith("smollm2") else (pytest.mark.slow,)) for m, q in REAL]


def _real_tensor(model: str, qtype):
    """(tensor, data [N, row_bytes] a view into the mmap, K, N): the model's first 2-D `qtype` tensor."""
    t = next(t for t in _reader(model).tensors if t.tensor_type == qtype and len(t.shape) == 2)
    return t, np.asarray(t.data), int(t.shape[0]), int(t.shape[1])


@needs_kernels
@pytest.mark.parametrize("model,qtype", REAL_PARAMS)
def test_real_tensor(model, qtype):
    t, data, k, n_all = _real_tensor(model, qtype)
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


# --- activations quantized like llama.cpp's CPU backend (qmatmul(..., act_quant=True)) ------------
# ggml (ggml-cpu.c type_traits_cpu) multiplies a weight by activations quantized to its vec_dot_type.
# Below, a plain transcription of ggml's x86 quantizers (quantize_row_q8_0 / q8_1 in
# ggml-cpu/arch/x86/quants.c, quantize_row_q8_K_ref in ggml-quants.c) in numpy float32 arithmetic:
# the kernel's codes and scales must equal it exactly, and its matmul must equal
# dequant(codes) @ dequant(W) (+ the Q8_1 s term) within fp32 accumulation error.
Q8_1_WEIGHTS = (Q.Q4_1, Q.Q5_1)
F32 = np.float32


def ggml_quantize_q8_0(x: np.ndarray, q8_1: bool):
    """quantize_row_q8_0 / q8_1 (AVX2 branch): d = amax / 127 stored as fp16, id = 127 / amax,
    codes = round-half-even(x * id) (_mm256_round_ps); q8_1: s = fp16(d * sum(codes)), fp32 d."""
    t, k = x.shape
    b = x.astype(F32).reshape(t, k // 32, 32)
    amax = np.abs(b).max(axis=-1)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    codes = np.rint((b * idv[..., None]).astype(F32))
    s = (d * codes.sum(axis=-1, dtype=F32)).astype(F32).astype(np.float16).astype(F32) if q8_1 else None
    return codes.astype(np.int8).reshape(t, k), d.astype(np.float16).astype(F32), s


def ggml_quantize_q8_k(x: np.ndarray):
    """quantize_row_q8_K_ref: max = the first element of largest magnitude, iscale = -127 / max,
    codes = MIN(127, nearest_int(iscale * x)) (the 12582912 trick), d = 1 / iscale, bsums per 16."""
    t, k = x.shape
    codes = np.zeros((t, k), np.int8)
    d = np.zeros((t, k // 256), F32)
    bsums = np.zeros((t, k // 16), np.int16)
    for r in range(t):
        for i in range(k // 256):
            blk = x[r, 256 * i:256 * (i + 1)].astype(F32)
            amax, mx = F32(0), F32(0)
            for v in blk:
                if abs(v) > amax:
                    amax, mx = abs(v), v
            if not amax:
                continue
            iscale = F32(F32(-127) / mx)
            val = ((iscale * blk).astype(F32) + F32(12582912)).astype(F32)
            q = np.minimum(127, (val.view(np.int32) & 0x007FFFFF) - 0x00400000)
            codes[r, 256 * i:256 * (i + 1)] = q
            bsums[r, 16 * i:16 * (i + 1)] = q.reshape(16, 16).sum(axis=-1)
            d[r, i] = F32(1) / iscale
    return codes, d, bsums


def act_test_inputs(t: int, k: int, seed: int) -> torch.Tensor:
    """Activations with the edge cases of the quantizers: an all-zero block, exact .5 ties, equal
    magnitudes of both signs (Q8_K picks the first), a negative extreme, tiny values, outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.rand(t, 1, generator=g) * 4
    x[0, :256] = 0
    if t > 1:
        x[1, :32] = torch.arange(32) - 15.5  # amax 16.5 ... scaled: many halves
        x[1, 32:64] = torch.linspace(-127, 127, 32).round() / 127 * 3  # amax 3 -> codes on the grid
        x[1, 256] = -70.0
        x[1, 300] = 70.0  # the same magnitude later, other sign
        if k > 1024:
            x[1, 1024 + 5] = -1e4
    if t > 2:
        x[2] *= 1e-30
        x[2, 64:96] = torch.tensor([1.0, -0.5, 0.25, 0.0] * 8)  # ties after * 127
    return x.contiguous()


def ggml_act_reference(x: torch.Tensor, qtype):
    """(x as the kernel sees it (fp64), Q8_1 s [T, K/32] (fp64) or None) by the transcription above."""
    xn = x.numpy()
    t, k = xn.shape
    if qtype in KQUANTS:
        codes, d, _ = ggml_quantize_q8_k(xn)
        return torch.from_numpy(codes.reshape(t, -1, 256) * d[..., None].astype(np.float64)).reshape(t, k), None
    if qtype == Q.F16:
        return x.half().double(), None
    if qtype == Q.BF16:
        return x.bfloat16().double(), None
    codes, d, s = ggml_quantize_q8_0(xn, qtype in Q8_1_WEIGHTS)
    xd = torch.from_numpy(codes.reshape(t, -1, 32) * d[..., None].astype(np.float64)).reshape(t, k)
    return xd, (None if s is None else torch.from_numpy(s.astype(np.float64)))


def split_mins(raw: np.ndarray, qtype, n: int, k: int):
    """Q4_1 / Q5_1: (dequant with zeroed mins = d * q, the mins [n, k/32]) through gguf.quants."""
    bb = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = np.array(raw, dtype=np.uint8).reshape(n, k // 32, bb)
    mins = blocks[:, :, 2:4].copy().view(np.float16).astype(np.float64).reshape(n, k // 32)
    blocks[:, :, 2:4] = 0
    return reference(blocks.reshape(n, -1), qtype, n, k).double(), torch.from_numpy(mins)


def check_act_matmul(x: torch.Tensor, raw: np.ndarray, qtype, n: int, k: int, y: torch.Tensor, what: str):
    xd, s = ggml_act_reference(x, qtype)
    W = reference(raw, qtype, n, k).double()
    if s is not None:
        wd, mins = split_mins(raw, qtype, n, k)
        ref = xd @ wd.T + s @ mins.T
        scale = xd.abs() @ wd.abs().T + s.abs() @ mins.abs().T
    else:
        ref = xd @ W.T
        scale = xd.abs() @ W.abs().T
    err = (y.double() - ref).abs()
    bad = err > REL_TOL * scale + 1e-30
    assert not bad.any(), f"{what}: max err/scale {float((err / (scale + 1e-30)).max()):.3g}"


@needs_kernels
@pytest.mark.parametrize("qtype", KQUANTS + (Q.Q4_0, Q.Q4_1), ids=lambda q: q.name)
def test_activation_codes_equal_ggml_transcription(qtype):
    """The kernel's quantized activations (codes, scales, s, bsums) bit for bit like ggml's x86
    build, and quants.q8_parts (the torch reference path) and cpu.round_q8 agree with them."""
    from sharpi_core.quants import q8_parts
    x = act_test_inputs(5, 1024, seed=int(qtype))
    codes, d, s, bs = cpu.quantize_act(x, qtype)
    if qtype in KQUANTS:
        rc, rd, rbs = ggml_quantize_q8_k(x.numpy())
        assert s is None and torch.equal(bs, torch.from_numpy(rbs))
        tq, td, ts = q8_parts(x, 256, False)
        assert ts is None
        assert torch.equal(cpu.round_q8(x, 256, False), torch.from_numpy((rc.reshape(5, -1, 256) * rd[..., None]).reshape(5, -1)))
    else:
        rc, rd, rs = ggml_quantize_q8_0(x.numpy(), qtype in Q8_1_WEIGHTS)
        assert bs is None and (s is None) == (rs is None)
        if rs is not None:
            assert torch.equal(s, torch.from_numpy(rs))
        tq, td, ts = q8_parts(x, 32, True)
        if rs is not None:
            assert torch.equal(ts.reshape(5, -1), torch.from_numpy(rs))
        assert torch.equal(cpu.round_q8(x, 32, True), torch.from_numpy((rc.reshape(5, -1, 32) * rd[..., None]).reshape(5, -1)))
    assert torch.equal(codes, torch.from_numpy(rc))
    assert torch.equal(d, torch.from_numpy(rd))
    assert torch.equal(tq.reshape(5, -1), torch.from_numpy(rc).float())
    assert torch.equal(td.reshape(5, -1), torch.from_numpy(rd))
    assert codes.abs().max() == 127 and (codes[0, :256] == 0).all()


def test_q8_0_cache_write_equals_ggml_transcription():
    """A q8_0 KV cache write in C (cpu.store_q8_0, what _Store.write and the fast decode path call)
    stores ggml's quantize_row_q8_0 codes and fp16 scales, and the torch path (q8_parts) the same."""
    from sharpi_core.kv_cache import KVCache
    from sharpi_core.quants import q8_parts
    x = act_test_inputs(5, 1024, seed=7).view(5, 8, 128)  # [T, Hkv, hd]
    rc, rd, _ = ggml_quantize_q8_0(x.reshape(5, -1).numpy(), False)
    codes, d = torch.empty(5, 8, 128, dtype=torch.int8), torch.empty(5, 8, 4, 1, dtype=torch.float16)
    cpu.store_q8_0(x, codes, d)
    assert torch.equal(codes.reshape(5, -1), torch.from_numpy(rc))
    assert torch.equal(d.float().reshape(5, -1), torch.from_numpy(rd))
    tq, td, _ = q8_parts(x, 32, True)
    assert torch.equal(tq.to(torch.int8).reshape(x.shape), codes) and torch.equal(td.half(), d)
    cache = KVCache(2, 9, 8, 128, 128, "q8_0", "f16")
    cache.k.write(1, 3, x)  # into positions 3..7 of layer 1, nothing else touched
    assert torch.equal(cache.k.q[1, 3:8], codes) and torch.equal(cache.k.d[1, 3:8], d)
    assert not cache.k.q[0].any() and not cache.k.q[1, :3].any() and not cache.k.q[1, 8:].any()
    assert not cache.k.d[1, 8:].any()
    with pytest.raises(ValueError):
        cpu.store_q8_0(x, codes[:4], d)


@needs_kernels
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_qmatmul_act_quant_random_blocks(qtype):
    n, k = 75, 1024 if qtype in KQUANTS else 1056  # 1056 = 33 blocks: a partial step of 4 blocks
    raw = random_raw(qtype, n, k, seed=4)
    rawt = torch_view(raw)
    thr = cpu.GEMM_MIN_ROWS  # float weights switch to sgemm there; quantized ones never do
    for t in (1, 2, 3, 5, 8, 9, 17, thr - 1, thr, 3 * thr):
        x = act_test_inputs(t, k, seed=t)
        y = cpu.qmatmul(x, rawt, qtype, n, k, act_quant=True)
        assert y.shape == (t, n) and y.dtype == torch.float32
        check_act_matmul(x, raw, qtype, n, k, y, f"{qtype.name} T={t}")


@needs_kernels
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_act_quant_batch_invariant_and_thread_independent(qtype):
    """Each row of T = 1..17 equals that row computed alone (T = 1), bit for bit, with 1 or 2
    threads: a speculative verify pass reproduces single-token decoding exactly."""
    n, k = 203, 1536 if qtype in KQUANTS else 1120
    raw = torch_view(random_raw(qtype, n, k, seed=5))
    x = act_test_inputs(17, k, seed=6)
    assert len(x) < cpu.GEMM_MIN_ROWS
    nth = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            singles = torch.cat([cpu.qmatmul(x[i:i + 1].contiguous(), raw, qtype, n, k, act_quant=True) for i in range(len(x))])
            if threads == 1:
                ref = singles
            assert torch.equal(singles, ref), threads
            for t in range(2, len(x) + 1):
                assert torch.equal(cpu.qmatmul(x[:t].contiguous(), raw, qtype, n, k, act_quant=True), ref[:t]), (threads, t)
            assert torch.equal(cpu.qmatmul(x[5:].contiguous(), raw, qtype, n, k, act_quant=True), ref[5:])
            if qtype not in (Q.F16, Q.BF16):  # quantized weights: a prefill-sized T gives the same rows
                long_x = torch.cat([x] * 4)
                assert len(long_x) >= cpu.GEMM_MIN_ROWS
                assert torch.equal(cpu.qmatmul(long_x, raw, qtype, n, k, act_quant=True), torch.cat([ref] * 4))
    finally:
        torch.set_num_threads(nth)


@needs_kernels
def test_quantize_act_rejects_float_weights():
    with pytest.raises(ValueError):
        cpu.quantize_act(torch.randn(2, 64), Q.F16)
    with pytest.raises(ValueError):
        cpu.quantize_act(torch.randn(2, 128), Q.Q4_K)  # K % 256


@needs_kernels
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_qweight_kernel_matches_reference_path(qtype, monkeypatch):
    """quants.QWeight through the kernel (raw fp32 x in) and through the reference path
    (SHARPI_CPU_KERNEL=0: torch rounding, gguf.quants dequantization, fp32 matmul, Q8_1's fp16 s
    term) agree within fp32 rounding; one row alone gives the same bits as inside a batch."""
    from sharpi_core import quants
    n, k = 96, 512
    raw = random_raw(qtype, n, k, seed=7)
    x = act_test_inputs(6, k, seed=8)
    w = quants.QWeight("w", raw, qtype, n, k)
    assert w._kern is not None
    y = w(x)
    assert torch.equal(w(x[3:4]), y[3:4])
    monkeypatch.setattr(quants, "_kernels", lambda: None)
    wr = quants.QWeight("w", raw, qtype, n, k)
    assert wr._kern is None
    yr = wr(x)
    assert torch.equal(quants.Activations(x)(wr), yr)
    xd, s = ggml_act_reference(x, qtype)
    W = reference(raw, qtype, n, k).double()
    scale = xd.abs() @ W.abs().T + (0 if s is None else s.abs() @ split_mins(raw, qtype, n, k)[1].abs().T)
    assert ((y.double() - yr.double()).abs() <= 2 * REL_TOL * scale + 1e-30).all()
    check_act_matmul(x, raw, qtype, n, k, yr, f"reference path {qtype.name}")


@needs_kernels
@pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q4_1, Q.Q5_0), ids=lambda q: q.name)
def test_repacked_layout_gives_the_same_bits(qtype):
    """Q4_K / Q4_1 / Q5_0 repacked in groups of 4 rows (cpu.PACKED) goes back to the same bytes, and its
    matmul gives the bits of the GGUF layout's kernels for every T, both summation orders and 1 or 2
    threads."""
    n, k = 204, 1536
    raw = torch_view(random_raw(qtype, n, k, seed=12))
    packed, layout = cpu.repack(raw, qtype, n, k), cpu.PACKED[qtype]
    assert packed.shape == (n, k // cpu._INFO[layout][1] * cpu._INFO[layout][2]) and packed.dtype == torch.uint8
    assert torch.equal(cpu.repack(packed, qtype, n, k, inverse=True), raw)
    assert not torch.equal(packed[:, :raw.shape[1]], raw)  # really another layout
    x = act_test_inputs(100, k, seed=13)
    nth = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for t in (1, 2, 3, 4, 5, 7, 8, 9, 13, 17, cpu.GEMM_MIN_ROWS, 100):
                for prompt in (False, True):
                    want = cpu.qmatmul(x[:t].contiguous(), raw, qtype, n, k, act_quant=True, prompt=prompt)
                    got = cpu.qmatmul(x[:t].contiguous(), packed, layout, n, k, act_quant=True, prompt=prompt)
                    assert torch.equal(got, want), (threads, t, prompt)
    finally:
        torch.set_num_threads(nth)
    # a view of the first groups is the first rows' weight
    assert torch.equal(cpu.qmatmul(x[:3].contiguous(), packed[:40], layout, 40, k, act_quant=True),
                       cpu.qmatmul(x[:3].contiguous(), raw[:40].contiguous(), qtype, 40, k, act_quant=True))


@needs_kernels
def test_repack_rejects_bad_shapes():
    raw = torch_view(random_raw(Q.Q4_K, 6, 512, seed=14))
    with pytest.raises(ValueError):
        cpu.repack(raw, Q.Q4_K, 6, 512)  # N % 4
    with pytest.raises(ValueError):
        cpu.repack(raw[:4].contiguous(), Q.Q6_K, 4, 512)  # no CPU layout for it
    packed = cpu.repack(raw[:4].contiguous(), Q.Q4_K, 4, 512)
    with pytest.raises(ValueError):
        cpu.repack(packed, Q.Q4_K, 4, 256)  # wrong size
    with pytest.raises(ValueError):  # the repacked layouts have integer kernels only
        cpu.qmatmul(torch.randn(1, 512), packed, cpu.Q4_K_R4, 4, 512, act_quant=False)


@needs_kernels
def test_qweight_repacks_and_lets_the_blocks_go(monkeypatch):
    """A Q4_K QWeight repacks at its first matmul; a copy it owned (fused weights) is freed and `raw`
    rebuilds it; heads share the repacked rows; SHARPI_CPU_REPACK=0 keeps the GGUF blocks."""
    from sharpi_core import quants
    n, k = 64, 1024
    raw = random_raw(Q.Q4_K, n, k, seed=15)
    parts = [quants.QWeight("a", raw[:40], Q.Q4_K, 40, k), quants.QWeight("b", raw[40:], Q.Q4_K, 24, k)]
    w = quants.QWeight.concat("ab", parts)
    x = act_test_inputs(3, k, seed=16)
    want = cpu.qmatmul(x, torch_view(raw), Q.Q4_K, n, k, act_quant=True)
    assert w._packed is None
    assert torch.equal(w(x), want)
    assert w._packed is not None and w._raw is None  # the concatenated copy is gone
    assert np.array_equal(w.raw, raw) and w.nbytes == raw.nbytes
    h = w.head(16)
    assert h._packed is not None and h._packed.data_ptr() == w._packed.data_ptr() and h._raw is None
    assert torch.equal(h(x), want[:, :16]) and np.array_equal(h.raw, raw[:16])
    h6 = w.head(6)  # not a whole group: its GGUF rows
    assert h6._packed is None and np.array_equal(h6.raw, raw[:6]) and torch.equal(h6(x), want[:, :6])
    assert torch.equal(w.rows(torch.tensor([3, 50])), torch.from_numpy(
        gguf.quants.dequantize(raw[[3, 50]], Q.Q4_K)).reshape(2, k))
    odd = quants.QWeight("odd", raw[:6], Q.Q4_K, 6, k)  # N % 4: the GGUF blocks as they are
    assert torch.equal(odd(x), want[:, :6]) and odd._packed is None
    monkeypatch.setenv("SHARPI_CPU_REPACK", "0")
    plain = quants.QWeight("plain", raw, Q.Q4_K, n, k)
    assert torch.equal(plain(x), want) and plain._packed is None and plain._raw is raw
    monkeypatch.delenv("SHARPI_CPU_REPACK")
    monkeypatch.setattr(quants, "MATCH_LLAMA_CPP", False)  # SHARPI_ACT_QUANT=0: fp32 activations, GGUF blocks
    f32 = quants.QWeight("f32", raw, Q.Q4_K, n, k)
    assert f32.act_kind is None and not f32._packable
    assert torch.equal(f32(x), cpu.qmatmul(x, torch_view(raw), Q.Q4_K, n, k, act_quant=False))


@needs_kernels
def test_q5_0_weights_repack_on_avx2_builds():
    """A Q5_0 QWeight takes the repacked layout where the build is AVX2 (cpu.packs: measured faster there) and
    keeps the GGUF blocks on an AVX-512 one; the products are the same bits either way."""
    from sharpi_core import quants
    n, k = 64, 896
    raw = random_raw(Q.Q5_0, n, k, seed=17)
    x = act_test_inputs(5, k, seed=18)
    w = quants.QWeight("q50", raw, Q.Q5_0, n, k)
    assert torch.equal(w(x), cpu.qmatmul(x, torch_view(raw), Q.Q5_0, n, k, act_quant=True))
    assert (w._packed is not None) == cpu.avx512_emulated() == cpu.packs(Q.Q5_0)
    assert cpu.packs(Q.Q4_K) and not cpu.packs(Q.Q8_0)


@needs_kernels
def test_non_vnni_build_gives_the_same_bits(tmp_path):
    """A build without AVX512-VNNI computes vpdpbusd / vpdpwssd's integers otherwise (vpmaddubsw where the
    codes cannot saturate it, an exact emulation elsewhere): identical results, one-token rows and prompt passes."""
    if not cpu.has_vnni():
        pytest.skip("this build has no VNNI to compare with")
    types = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)
    n, k = 37, 1280
    x = act_test_inputs(9, k, seed=9)
    torch.save(x, tmp_path / "x.pt")
    want = {}
    for qt in types:
        raw = random_raw(qt, n, k, seed=10)
        np.save(tmp_path / f"{qt.name}.npy", raw)
        want[qt.name] = cpu.qmatmul(x[:3], torch_view(raw), qt, n, k, act_quant=True)
        want[qt.name + "_pp"] = cpu.qmatmul(x, torch_view(raw), qt, n, k, act_quant=True, prompt=True)
    code = ("import sys, numpy as np, torch, gguf; from sharpi_core.kernels import cpu; d = sys.argv[1]; "
            "assert cpu.available() and not cpu.has_vnni(), cpu.unavailable_reason(); x = torch.load(d + '/x.pt'); "
            "W = lambda t: torch.from_numpy(np.load(d + '/' + t + '.npy')); Q = gguf.GGMLQuantizationType; out = {}\n"
            f"for t in {[q.name for q in types]!r}:\n"
            f" out[t] = cpu.qmatmul(x[:3], W(t), Q[t], {n}, {k}, act_quant=True)\n"
            f" out[t + '_pp'] = cpu.qmatmul(x, W(t), Q[t], {n}, {k}, act_quant=True, prompt=True)\n"
            "for t in ('Q4_K', 'Q4_1', 'Q5_0'):\n"
            f" w4 = cpu.repack(W(t)[:36].contiguous(), Q[t], 36, {k})\n"
            f" out[t + '_R4'] = cpu.qmatmul(x[:3], w4, cpu.PACKED[Q[t]], 36, {k}, act_quant=True)\n"
            f" out[t + '_R4_pp'] = cpu.qmatmul(x, w4, cpu.PACKED[Q[t]], 36, {k}, act_quant=True, prompt=True)\n"
            "torch.save(out, d + '/y.pt')")
    env = dict(os.environ, SHARPI_KERNEL_NO_VNNI="1")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    got = torch.load(tmp_path / "y.pt")
    for name, y in want.items():
        assert torch.equal(got[name], y), name
    for name in ("Q4_K", "Q4_1", "Q5_0"):  # the repacked layouts' kernels
        assert torch.equal(got[name + "_R4"], want[name][:, :36]), name
        assert torch.equal(got[name + "_R4_pp"], want[name + "_pp"][:, :36]), name


@needs_kernels
def test_simd_level_names_avx_vnni_where_the_compiler_emits_it(monkeypatch):
    """An AVX2 CPU with AVX-VNNI is said to take it only where the compiler emits it (gcc < 11 cannot: that build
    takes vpmaddubsw); the probe reads the compiler's predefined macros (real gcc: Alder Lake's -march has it,
    Haswell's not)."""
    monkeypatch.setattr(cpu, "_cpu_info", lambda: ("test", frozenset(cpu._REQUIRED_CPU_FLAGS + ("avx_vnni",))))
    monkeypatch.setattr(cpu, "_compiler", lambda: "cc")
    for macros, said in ((frozenset({"__AVX2__"}), "AVX2, AVX-512 emulated"),
                         (frozenset({"__AVX2__", "__AVXVNNI__"}), "AVX2 with AVX-VNNI, AVX-512 emulated"),
                         (None, "AVX2 with AVX-VNNI, AVX-512 emulated")):  # a compiler that cannot say: the CPU's flag
        monkeypatch.setattr(cpu, "_compiler_macros", lambda cc, flags, m=macros: m)
        assert cpu.simd_level() == said
    monkeypatch.undo()
    gcc = shutil.which("gcc")
    if gcc is None:
        return
    assert "__AVXVNNI__" not in cpu._compiler_macros(gcc, ("-march=haswell",))
    assert "__AVX2__" in cpu._compiler_macros(gcc, ("-march=haswell",))
    version = int(subprocess.run([gcc, "-dumpversion"], capture_output=True, text=True).stdout.split(".")[0])
    assert ("__AVXVNNI__" in (cpu._compiler_macros(gcc, ("-march=alderlake",)) or ())) == (version >= 11)
    assert cpu._compiler_macros(gcc, ("-mno-such-flag",)) is None


@needs_kernels
def test_avx2_build_gives_the_same_bits(tmp_path):
    """The AVX2 build (x86simd.h: each 512-bit intrinsic on two 256-bit halves) computes what the AVX-512
    build computes: every weight type's products (8-bit and fp32 activations, one and two rows, a verify pass,
    a prompt tile; Q4_0 / IQ4_NL / MXFP4 in llama.cpp's repacked order too), the repacked layouts, and SmolLM2's
    logits over a prompt pass and two one-token passes (attention, norms, RoPE, GLU, the wrapper-free decoding
    loop; with q8_0 and q4_1 K / V too). Where the CPU has AVX-VNNI the AVX2 build uses it, and the AVX2 build
    without it is compared too. Runs where the CPU has AVX-512; on an AVX2 CPU the llama.cpp oracles check the
    same build."""
    if cpu.avx512_emulated():
        pytest.skip("this CPU has no AVX-512 build to compare with")
    from conftest import SMOL, model_path
    types = (Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.MXFP4, Q.Q2_K, Q.Q3_K, Q.Q4_K,
             Q.Q5_K, Q.Q6_K, Q.IQ4_XS)
    n, k = 37, 1280
    x = act_test_inputs(9, k, seed=12)
    torch.save(x, tmp_path / "x.pt")
    code = ("import sys, numpy as np, torch, gguf; from sharpi_core.kernels import cpu; "
            "from sharpi_core.models import load_model; d, qs, smol = sys.argv[1], sys.argv[2].split(','), sys.argv[3]; "
            "assert cpu.available(), cpu.unavailable_reason(); x = torch.load(d + '/x.pt'); out = {}\n"
            "for t in qs:\n"
            " qt = gguf.GGMLQuantizationType[t]; raw = torch.from_numpy(np.load(d + '/' + t + '.npy'))\n"
            " for aq in (True, False):\n"
            "  for T in (1, 2, 5, 9):\n"
            f"   out[t, aq, T] = cpu.qmatmul(x[:T].contiguous(), raw, qt, {n}, {k}, act_quant=aq)\n"
            "   if t in ('Q4_0', 'IQ4_NL', 'MXFP4') and aq:  # 32 rows: llama.cpp's repacked order (the AVX2 chain)\n"
            f"    out[t, 'R8', T] = cpu.qmatmul(x[:T].contiguous(), raw[:32].contiguous(), qt, 32, {k}, act_quant=True)\n"
            " if qt in cpu.PACKED:\n"
            f"  out[t, 'R4'] = cpu.qmatmul(x, cpu.repack(raw[:36].contiguous(), qt, 36, {k}), cpu.PACKED[qt], 36, {k}, act_quant=True)\n"
            "m = load_model(smol); m.pack_weights(); c = m.new_cache(64); p = torch.tensor([1, 504, 3458, 282, 4649, 314, 253])\n"
            "out['prompt'] = m.forward(p, 0, c); out['t1'] = m.forward(torch.tensor([30]), 7, c)\n"
            "out['t2'] = m.forward(torch.tensor([2177]), 8, c)\n"
            "for kv in ('q8_0', 'q4_1'):\n"
            " c = m.new_cache(64, kv, kv); out[kv] = m.forward(p, 0, c); out[kv, 't1'] = m.forward(torch.tensor([30]), 7, c)\n"
            "out['vnni'] = cpu.has_vnni(); torch.save(out, d + '/y.pt')")
    for qt in types:
        np.save(tmp_path / f"{qt.name}.npy", random_raw(qt, n, k, seed=13))
    smol = str(model_path(SMOL))
    outs = []
    builds = [{"SHARPI_KERNEL_AVX2": "0", "SHARPI_KERNEL_NO_VNNI": "0"}, {"SHARPI_KERNEL_AVX2": "1", "SHARPI_KERNEL_NO_VNNI": "0"}]
    avx_vnni = cpu.avx2_build_takes_avx_vnni()
    if avx_vnni:  # the AVX2 build with AVX-VNNI, then without any VNNI
        builds.append({"SHARPI_KERNEL_AVX2": "1", "SHARPI_KERNEL_NO_VNNI": "1"})
    for build in builds:
        env = dict(os.environ, **build)
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path), ",".join(q.name for q in types), smol],
                           capture_output=True, text=True, env=env, timeout=1200,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(torch.load(tmp_path / "y.pt"))
    assert [o.pop("vnni") for o in outs][1:] == [avx_vnni, False][:len(outs) - 1]  # which the AVX2 builds used
    for out in outs[1:]:
        assert out.keys() == outs[0].keys()
        for key, y in outs[0].items():
            assert torch.equal(out[key], y), key


@needs_kernels
@pytest.mark.parametrize("model,qtype", REAL_PARAMS)
def test_real_tensor_act_quant(model, qtype):
    t, data, k, n_all = _real_tensor(model, qtype)
    rows = min(n_all, 256)
    raw = data[:rows]
    rawt = torch_view(raw)
    g = torch.Generator().manual_seed(11)
    for T in (1, 2, 5, 9):
        x = torch.randn(T, k, generator=g) * torch.rand(T, k, generator=g).pow(4) * 3  # a few outliers
        y = cpu.qmatmul(x, rawt, qtype, rows, k, act_quant=True)
        check_act_matmul(x, raw, qtype, rows, k, y, f"{t.name} T={T}")
        assert torch.equal(cpu.qmatmul(x[-1:].contiguous(), rawt, qtype, rows, k, act_quant=True), y[-1:])
    # the whole tensor at decode size, its tail rows against the reference
    x = torch.randn(1, k, generator=g)
    y = cpu.qmatmul(x, torch_view(data), qtype, n_all, k, act_quant=True)
    assert torch.equal(y[:, :rows], cpu.qmatmul(x, rawt, qtype, rows, k, act_quant=True))
    check_act_matmul(x, np.ascontiguousarray(data[n_all - 64:]), qtype, 64, k, y[:, n_all - 64:], f"{t.name} tail rows")


# --- llama.cpp's float summation orders (its AVX2 code, which AVX-512 builds run too), in numpy --------------------------
# The integer dot products per block are exact; what decides the last bits is how ggml turns them
# into floats and accumulates them. fma() below rounds a*b + c once (a*b is exact in float64).
def fma(a, b, c):
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(F32)


def hsum_float_8(acc):
    """ggml's hsum_float_8 / tinyBLAS hsum over the last axis (8 lanes)."""
    w = (acc[..., 4:] + acc[..., :4]).astype(F32)
    return ((w[..., 0] + w[..., 2]).astype(F32) + (w[..., 1] + w[..., 3]).astype(F32)).astype(F32)


def f16(raw, off):
    return raw[..., off:off + 2].copy().view(np.float16)[..., 0].astype(F32)


def e8m0_half(e):
    """MXFP4's block scale 2^(e - 128) (exact in fp32, denormal for e < 2)"""
    return np.ldexp(np.float64(1.0), e.astype(np.int64) - 128).astype(F32)


def legacy_codes(blk, qtype):
    """[n, nb, bytes] blocks -> (weight codes [n, nb, 32] (int64: signed, unsigned for Q4_1 / Q5_1), d_w, m_w or None)"""
    if qtype == Q.MXFP4:
        qs = blk[:, :, 1:17].astype(np.int64)
        return MXFP4_VALUES[np.concatenate([qs & 15, qs >> 4], axis=-1)], e8m0_half(blk[:, :, 0]), None
    d = f16(blk, 0)
    if qtype == Q.Q8_0:
        return blk[:, :, 2:34].view(np.int8).astype(np.int64), d, None
    qo = {Q.Q4_0: 2, Q.IQ4_NL: 2, Q.Q4_1: 4, Q.Q5_0: 6, Q.Q5_1: 8}[qtype]
    qs = blk[:, :, qo:qo + 16].astype(np.int64)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if qtype == Q.IQ4_NL:
        return IQ4NL_VALUES[q], d, None
    if qtype in (Q.Q5_0, Q.Q5_1):
        qh = blk[:, :, qo - 4:qo].copy().view(np.uint32).astype(np.int64)  # [n, nb, 1]
        q = q | (((qh >> np.arange(32)) & 1) << 4)
        return (q - 16, d, None) if qtype == Q.Q5_0 else (q, d, f16(blk, 2))
    return (q - 8, d, None) if qtype == Q.Q4_0 else (q, d, f16(blk, 2))


IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int64)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)  # twice E2M1's values


def ggml_legacy_order(x, raw, qtype, n, k):
    """ggml_vec_dot_*_q8_0 / q8_1 (AVX2) and tinyBLAS_Q0_AVX: per block 8 lanes of 4 products,
    acc = fma(d_w * d_x, lane, acc), hsum_float_8, + the fp32 fma sum of m_w * s_x (Q4_1).
    Q4_0 / IQ4_NL with rows a multiple of 8 (repacked by llama.cpp: q4_0_8x8, iq4_nl_8x8): one chain
    y = fma(float(I_b), d_w * d_x, y) per block, I_b the block's exact sum, for every T."""
    codes, dx, s, _ = cpu.quantize_act(x, qtype)
    t, nb = x.shape[0], k // 32
    w, dw, mw = legacy_codes(np.asarray(raw).reshape(n, nb, -1), qtype)
    c = codes.numpy().astype(np.int64).reshape(t, nb, 32)
    if qtype in (Q.Q4_0, Q.IQ4_NL, Q.MXFP4) and n % 8 == 0:
        I = np.einsum("nbe,tbe->ntb", w, c).astype(F32)
        y = np.zeros((n, t), F32)
        for b in range(nb):
            y = fma(I[:, :, b], (dw[:, b, None] * dx.numpy().reshape(t, nb)[None, :, b]).astype(F32), y)
        return y.T
    lanes = np.einsum("nbe,tbe->ntbe", w, c).reshape(n, t, nb, 8, 4).sum(-1).astype(F32)
    dx = dx.numpy().reshape(t, nb)
    acc = np.zeros((n, t, 8), F32)
    summs = np.zeros((n, t), F32)
    for b in range(nb):
        acc = fma((dw[:, b, None] * dx[None, :, b]).astype(F32)[..., None], lanes[:, :, b], acc)
        if mw is not None:
            summs = fma(mw[:, b, None], s.numpy().reshape(t, nb)[None, :, b], summs)
    return (hsum_float_8(acc) + summs).astype(F32).T


def q4k_parts(blk):
    """Q4_K blocks [n, nu, 144] -> codes [n, nu, 256], scales and mins [n, nu, 8] (int64), d, dmin"""
    s = blk[:, :, 4:16].astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = blk[:, :, 16:144].astype(np.int64).reshape(*blk.shape[:2], 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(*blk.shape[:2], 256)
    return q, sc, mn, f16(blk, 0), f16(blk, 2)


def ggml_q4k_order(x, raw, n, k, gemm: bool):
    """Repacked Q4_K (ggml_gemv / gemm_q4_K_8x8_q8_K, AVX2): exact I = sum_j sc_j S_j and
    M = sum_j m_j bsum_j, accumulated per super-block (gemv) or per pair of sub-blocks (gemm) as
    acc = fma(float(I), d_w * d_x, acc), accm = fma(float(M), dmin_w * d_x, accm); acc - accm."""
    codes, dx, _, _ = cpu.quantize_act(x, Q.Q4_K)
    t, nu = x.shape[0], k // 256
    q, sc, mn, d, dmin = q4k_parts(np.asarray(raw).reshape(n, nu, 144))
    c = codes.numpy().astype(np.int64).reshape(t, nu, 8, 32)
    S = np.einsum("nujl,tujl->ntuj", q.reshape(n, nu, 8, 32), c)
    I = S * sc[:, None]                                         # [n, t, nu, 8]
    Mj = c.sum(-1)[None] * mn[:, None]
    if gemm:
        I, Mj = I.reshape(n, t, nu, 4, 2).sum(-1), Mj.reshape(n, t, nu, 4, 2).sum(-1)
    else:
        I, Mj = I.sum(-1, keepdims=True), Mj.sum(-1, keepdims=True)
    dx = dx.numpy().reshape(t, nu)
    acc = np.zeros((n, t), F32)
    accm = np.zeros((n, t), F32)
    for u in range(nu):
        dd = (d[:, u, None] * dx[None, :, u]).astype(F32)
        dm = (dmin[:, u, None] * dx[None, :, u]).astype(F32)
        for i in range(I.shape[-1]):
            acc = fma(I[:, :, u, i].astype(F32), dd, acc)
            accm = fma(Mj[:, :, u, i].astype(F32), dm, accm)
    return (acc - accm).astype(F32).T


def q6k_parts(blk):
    """Q6_K blocks [n, nu, 210] -> unsigned codes [n, nu, 256], scales [n, nu, 16] (int64), d"""
    ql, qh = blk[:, :, :128].astype(np.int64), blk[:, :, 128:192].astype(np.int64)
    q = np.zeros((*blk.shape[:2], 256), np.int64)
    for hf in range(2):
        a, b, h = ql[..., 64 * hf:64 * hf + 32], ql[..., 64 * hf + 32:64 * hf + 64], qh[..., 32 * hf:32 * hf + 32]
        base = 128 * hf
        q[..., base:base + 32] = (a & 15) | ((h & 3) << 4)
        q[..., base + 32:base + 64] = (b & 15) | (((h >> 2) & 3) << 4)
        q[..., base + 64:base + 96] = (a >> 4) | (((h >> 4) & 3) << 4)
        q[..., base + 96:base + 128] = (b >> 4) | (((h >> 6) & 3) << 4)
    return q, blk[:, :, 192:208].view(np.int8).astype(np.int64), f16(blk, 208)


def ggml_q6k_order(x, raw, n, k, tiled: bool):
    """ggml_vec_dot_q6_K_q8_K (AVX2): lane j = sum over the elements 4j..4j+3 of each 32-element chunk
    of sc * q * x minus 32 (bsum_2j sc_2j + bsum_2j+1 sc_2j+1), acc = fma(d_x * d_w, lane, acc),
    hsum_float_8. The tiled matmul (>= 8 tokens): y = fma(d_w * float(I), d_x, y), I the whole sum."""
    codes, dx, _, bsums = cpu.quantize_act(x, Q.Q6_K)
    t, nu = x.shape[0], k // 256
    q, sc, d = q6k_parts(np.asarray(raw).reshape(n, nu, 210))
    c = codes.numpy().astype(np.int64).reshape(t, nu, 256)
    prod = np.einsum("nue,tue->ntue", q * np.repeat(sc, 16, axis=-1), c).reshape(n, t, nu, 8, 8, 4)
    bs = bsums.numpy().astype(np.int64).reshape(t, nu, 16)[None]
    lanes = prod.sum(axis=(3, 5)) - 32 * (bs[..., 0::2] * sc[:, None, :, 0::2] + bs[..., 1::2] * sc[:, None, :, 1::2])
    return lanes_to_floats(lanes, d, dx.numpy().reshape(t, nu), tiled)


def lanes_to_floats(lanes, d, dx, tiled: bool):
    """Exact integer lanes [n, t, nu, 8] of a super-block -> y [t, n]: vec_dot's
    acc = fma(d_x * d_w, lane, acc) then hsum_float_8, or the tiled matmul's y = fma(d_w * float(I), d_x, y)."""
    n, t, nu, _ = lanes.shape
    if tiled:
        y = np.zeros((n, t), F32)
        for u in range(nu):
            y = fma((d[:, u, None] * lanes[:, :, u].sum(-1).astype(F32)).astype(F32), dx[None, :, u], y)
        return y.T
    acc = np.zeros((n, t, 8), F32)
    for u in range(nu):
        acc = fma((dx[None, :, u] * d[:, u, None]).astype(F32)[..., None], lanes[:, :, u].astype(F32), acc)
    return hsum_float_8(acc).T


def k2bit_parts(blk, qtype):
    """Q3_K [n, nu, 110] / Q2_K [n, nu, 84] blocks -> codes [n, nu, 256] (Q3_K: signed, q - 4;
    Q2_K: 0..3), scales [n, nu, 16] (Q3_K: 6-bit - 32; Q2_K: low nibbles), mins (Q2_K), d, dmin"""
    q3 = qtype == Q.Q3_K
    qs = blk[:, :, 32:96] if q3 else blk[:, :, 16:80]
    e = np.arange(256)
    half, j, lane = e >> 7, (e >> 5) & 3, e & 31
    q = (qs[..., 32 * half + lane].astype(np.int64) >> (2 * j)) & 3
    if not q3:
        s = blk[:, :, :16].astype(np.int64)
        return q, s & 15, s >> 4, f16(blk, 80), f16(blk, 82)
    q = q + 4 * ((blk[..., lane].astype(np.int64) >> (4 * half + j)) & 1) - 4
    b = blk[:, :, 96:108].astype(np.int64)
    i = np.arange(16)
    lo = np.where(i < 8, b[..., i % 8] & 15, b[..., i % 8] >> 4)
    hi = (b[..., 8 + i % 4] >> (2 * (i // 4))) & 3
    return q, (lo | (hi << 4)) - 32, None, f16(blk, 108), None


def iq4xs_parts(blk):
    """IQ4_XS blocks [n, nu, 136] -> table values [n, nu, 256], scales per 16 weights [n, nu, 16] (ls - 32, each
    sub-block's twice), d"""
    qs = blk[:, :, 8:].astype(np.int64).reshape(*blk.shape[:2], 8, 16)
    q = IQ4NL_VALUES[np.concatenate([qs & 15, qs >> 4], axis=-1)].reshape(*blk.shape[:2], 256)
    h = blk[:, :, 2].astype(np.int64) | (blk[:, :, 3].astype(np.int64) << 8)
    j = np.arange(8)
    ls = ((blk[:, :, 4 + j // 2].astype(np.int64) >> (4 * (j & 1))) & 15) | (((h[..., None] >> (2 * j)) & 3) << 4)
    return q, np.repeat(ls - 32, 2, axis=-1), None, f16(blk, 0), None


def q5k_parts(blk):
    """Q5_K blocks [n, nu, 176] -> codes [n, nu, 256], scales and mins per 16 weights [n, nu, 16] (each
    sub-block's twice), d, dmin"""
    q4, sc, mn, d, dmin = q4k_parts(np.concatenate([blk[:, :, :16], blk[:, :, 48:]], axis=-1))
    qh = blk[:, :, 16:48].astype(np.int64)                             # bit j of qh[l]: sub-block j
    q = q4 + 16 * ((qh[:, :, None, :] >> np.arange(8)[:, None]) & 1).reshape(*blk.shape[:2], 256)
    return q, np.repeat(sc, 2, axis=-1), np.repeat(mn, 2, axis=-1), d, dmin


def ggml_q5k_order(x, raw, n, k, tiled: bool):
    """ggml_vec_dot_q5_K_q8_K (AVX2): the 8 lanes of sc * q * x as for Q6_K, acc = fma(d_x * d_w, lane,
    acc), summs = fma(-(d_x * dmin_w), float(M), summs) per super-block; hsum_float_8(acc) + summs. The
    tiled matmul: y = fma(fma(-dmin_w, float(M), d_w * float(I)), d_x, y)."""
    codes, dx, _, bsums = cpu.quantize_act(x, Q.Q5_K)
    t, nu = x.shape[0], k // 256
    q, sc, mn, d, dmin = q5k_parts(np.asarray(raw).reshape(n, nu, 176))
    c = codes.numpy().astype(np.int64).reshape(t, nu, 256)
    lanes = np.einsum("nue,tue->ntue", q * np.repeat(sc, 16, axis=-1), c).reshape(n, t, nu, 8, 8, 4).sum(axis=(3, 5))
    M = (bsums.numpy().astype(np.int64).reshape(t, nu, 16)[None] * mn[:, None]).sum(-1).astype(F32)  # [n, t, nu]
    dx = dx.numpy().reshape(t, nu)
    if tiled:
        y = np.zeros((n, t), F32)
        for u in range(nu):
            res = fma(-dmin[:, u, None], M[:, :, u], (d[:, u, None] * lanes[:, :, u].sum(-1).astype(F32)).astype(F32))
            y = fma(res, dx[None, :, u], y)
        return y.T
    summs = np.zeros((n, t), F32)
    for u in range(nu):
        summs = fma(-(dx[None, :, u] * dmin[:, u, None]).astype(F32), M[:, :, u], summs)
    return (lanes_to_floats(lanes, d, dx, False).T + summs).astype(F32).T


def ggml_k2bit_order(x, raw, qtype, n, k, mode: str):
    """Q3_K, IQ4_XS: ggml_vec_dot_q3_K_q8_K / iq4_xs_q8_K (AVX2), 8 lanes as for Q6_K but with Q3_K's
    -4 offset in each product, acc = fma(d_x * d_w, lane, acc), hsum_float_8; the tiled matmul (mode "tiled"):
    y = fma(d_w * float(I), d_x, y). Q2_K repacked (ggml_gemv / gemm_q2_K_8x8_q8_K, AVX-512 builds):
    exact I = sum_j sc_j S_j and M = sum_j m_j bsum_j per super-block ("gemv") or per half of 128
    ("gemm"), acc = fma(float(I), d_w * d_x, acc), accm = fma(float(M), dmin_w * d_x, accm); acc - accm."""
    codes, dx, _, bsums = cpu.quantize_act(x, qtype)
    t, nu = x.shape[0], k // 256
    blk = np.asarray(raw).reshape(n, nu, -1)
    q, sc, mn, d, dmin = iq4xs_parts(blk) if qtype == Q.IQ4_XS else k2bit_parts(blk, qtype)
    c = codes.numpy().astype(np.int64).reshape(t, nu, 256)
    dx = dx.numpy().reshape(t, nu)
    prod = np.einsum("nue,tue->ntue", q * np.repeat(sc, 16, axis=-1), c)  # [n, t, nu, 256]
    if qtype in (Q.Q3_K, Q.IQ4_XS):
        return lanes_to_floats(prod.reshape(n, t, nu, 8, 8, 4).sum(axis=(3, 5)), d, dx, mode == "tiled")
    parts = 2 if mode == "gemm" else 1
    I = prod.reshape(n, t, nu, parts, -1).sum(-1)
    bs = bsums.numpy().astype(np.int64).reshape(t, nu, 16)
    M = (bs[None] * mn[:, None]).reshape(n, t, nu, parts, -1).sum(-1)
    acc, accm = np.zeros((n, t), F32), np.zeros((n, t), F32)
    for u in range(nu):
        dd = (d[:, u, None] * dx[None, :, u]).astype(F32)
        dm = (dmin[:, u, None] * dx[None, :, u]).astype(F32)
        for h in range(parts):
            acc = fma(I[:, :, u, h].astype(F32), dd, acc)
            accm = fma(M[:, :, u, h].astype(F32), dm, accm)
    return (acc - accm).astype(F32).T


@needs_kernels
@pytest.mark.parametrize("qtype", (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.IQ4_NL, Q.MXFP4, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
                                   Q.Q6_K, Q.IQ4_XS), ids=lambda q: q.name)
def test_act_quant_sums_in_llama_cpp_order(qtype):
    """Bit for bit the floats of llama.cpp's AVX2 CPU backend: decoding rows (prompt=False) in its
    one-token order, prompt=True in its prompt-processing order (Q4_K, Q2_K: gemm on the first
    T - T % 4 rows, gemv on the rest; Q6_K, Q5_K, Q3_K, IQ4_XS: the tiled matmul from 8 rows on; the legacy
    types: one order; Q4_0 / IQ4_NL / MXFP4: the repacked one for 24 rows, vec_dot's for 22)."""
    n, k = 24, 768 if qtype in KQUANTS else 544
    raw = random_raw(qtype, n, k, seed=11)
    rawt = torch_view(raw)
    for t in (1, 2, 3, 6, 9, 13):  # 2: the AVX2 chain (Q4_0, IQ4_NL) up to 2 tokens; 13: the prepared-weights path
        x = act_test_inputs(t, k, seed=20 + t)
        for prompt in (False, True):
            y = cpu.qmatmul(x, rawt, qtype, n, k, act_quant=True, prompt=prompt).numpy()
            if qtype == Q.Q4_K:
                g = t - t % 4 if prompt else 0
                want = np.concatenate([ggml_q4k_order(x[:g], raw, n, k, True) if g else np.zeros((0, n), F32),
                                       ggml_q4k_order(x[g:], raw, n, k, False) if g < t else np.zeros((0, n), F32)])
            elif qtype == Q.Q6_K:
                want = ggml_q6k_order(x, raw, n, k, tiled=prompt and t >= 8)
            elif qtype == Q.Q5_K:
                want = ggml_q5k_order(x, raw, n, k, tiled=prompt and t >= 8)
            elif qtype in (Q.Q3_K, Q.IQ4_XS):
                want = ggml_k2bit_order(x, raw, qtype, n, k, "tiled" if prompt and t >= 8 else "vec_dot")
            elif qtype == Q.Q2_K:
                g = t - t % 4 if prompt else 0
                want = np.concatenate([ggml_k2bit_order(x[:g], raw, qtype, n, k, "gemm") if g else np.zeros((0, n), F32),
                                       ggml_k2bit_order(x[g:], raw, qtype, n, k, "gemv") if g < t else np.zeros((0, n), F32)])
            else:
                want = ggml_legacy_order(x, raw, qtype, n, k)
                if qtype == Q.Q4_0:  # a tensor llama.cpp does not repack (rows not a multiple of 8)
                    y22 = cpu.qmatmul(x, rawt[:22].contiguous(), qtype, 22, k, act_quant=True, prompt=prompt).numpy()
                    assert np.array_equal(y22, ggml_legacy_order(x, raw[:22], qtype, 22, k))
            assert np.array_equal(y, want), (qtype.name, t, prompt, float(np.abs(y - want).max()))


@needs_kernels
@pytest.mark.skipif(not cpu.amx(), reason="no AMX tile unit here (or SHARPI_AMX=0)")
@pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q6_K), ids=lambda q: q.name)
def test_amx_prompt_passes_are_llama_cpps_order_bit_for_bit(qtype):
    """The AMX paths (whole groups of 16 rows; repacked Q4_K in the gemm order on the first T - T % 4 tokens from
    16 of them, Q6_K in the tiled matmul's from 8) give the numpy oracle's bits and the vector kernels' ones: 52
    rows (3 groups of 16 and 4 rows left to the vector kernels), token counts below, past and between groups of 16."""
    n, k = 52, 768
    raw = random_raw(qtype, n, k, seed=5)
    w, wtype = (cpu.repack(torch_view(raw), qtype, n, k), cpu.PACKED[qtype]) if qtype == Q.Q4_K else (torch_view(raw), qtype)
    try:
        for t in (8, 13, 16, 23, 40, 67):
            x = act_test_inputs(t, k, seed=40 + t)
            if qtype == Q.Q4_K:
                g = t - t % 4
                want = np.concatenate([ggml_q4k_order(x[:g], raw, n, k, True),
                                       ggml_q4k_order(x[g:], raw, n, k, False) if g < t else np.zeros((0, n), F32)])
            else:
                want = ggml_q6k_order(x, raw, n, k, tiled=True)
            got = {}
            for on in (True, False):
                assert cpu.amx(on) == on
                before = cpu.amx_passes()
                got[on] = cpu.qmatmul(x, w, wtype, n, k, act_quant=True, prompt=True).numpy()
                assert cpu.amx_passes() == before + (on and t >= (16 if qtype == Q.Q4_K else 8))
            assert np.array_equal(got[True], want), (t, float(np.abs(got[True] - want).max()))
            assert np.array_equal(got[False], want), t
    finally:
        cpu.amx(True)



@needs_kernels
@pytest.mark.skipif(not cpu.amx(), reason="no AMX tile unit here (or SHARPI_AMX=0)")
def test_amx_switch_is_read_by_the_switches_rule():
    """SHARPI_AMX takes the words every switch takes (off / no / 0 turn it off from the load; an unknown word keeps
    it on), read once in Python rather than by the C library's own getenv."""
    code = "from sharpi_core.kernels import cpu; print(cpu.available(), cpu.amx())"
    for value, on in (("0", False), ("off", False), ("no", False), ("1", True), ("maybe", True)):
        env = {**os.environ, "SHARPI_AMX": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        assert out.split() == ["True", str(on)], (value, out)

def test_prune_builds_deletes_only_long_unused_builds_and_leftovers(tmp_path):
    import os
    import time
    now = time.time()

    def made(name, days):
        f = tmp_path / name
        f.write_bytes(b"x")
        os.utime(f, (now - days * 86400, now - days * 86400))
        return f

    old, recent, keep = made("qmatmul-aaaa.so", 40), made("qmatmul-bbbb.so", 5), made("qmatmul-cccc.so", 90)
    part_old, part_new = made(".qmatmul-x1.so.part", 2), made(".qmatmul-x2.so.part", 0.01)
    other = made("other-lib.so", 400)  # not ours
    gone = cpu.prune_builds(tmp_path, keep=keep)
    assert sorted(gone) == sorted([old, part_old])
    assert all(f.exists() for f in (recent, keep, part_new, other)) and not old.exists()
