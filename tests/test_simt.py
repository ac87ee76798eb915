"""The SIMT emulator (tests/simt) that runs cuda/*.cu on the CPU, and the GPU tests run through it.

tests/simt/simt.hpp compiles the real kernel sources with the host C++ compiler and runs every GPU
thread as a fiber (barriers and warp shuffles interleave them); tests/simt/cupy puts CuPy's API in
front of it, over numpy arrays, so sharpi_core.backends.cuda runs on it unchanged. This file checks
the emulator itself (results, and the errors it must raise where a GPU would hang or compute
garbage), then runs the GPU test files in a subprocess with the stand-in first on sys.path: the
kernel tests in full, and the model-level ones that are quick enough emulated (a SmolLM2 token is
about a second there). What emulation cannot tell (speed, the GPU's memory model, concurrency
between blocks and streams, NVRTC itself) stays with a GPU machine.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sharpi_core.backends import cuda as cb

SIMT_DIR = Path(__file__).resolve().parent / "simt"
ROOT = Path(__file__).resolve().parents[1]

_spec = importlib.util.spec_from_file_location("simt_cupy", SIMT_DIR / "cupy" / "__init__.py")
cp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cp)

pytestmark = pytest.mark.skipif(cp.compiler() is None, reason="no C++ compiler for the SIMT emulator")

SRC = (cb.cuda_source_dir() / "common.cuh").read_text().replace("#pragma once", "") + r'''
extern "C" __global__ void __launch_bounds__(256) row_sum(const float* x, int n, float* out) {
    __shared__ float red[32];
    float v = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) v += x[(i64)blockIdx.x * n + i];
    v = block_sum(v, red);
    if (threadIdx.x == 0) out[blockIdx.x] = v;
}
// every lane gets lane src's value (broadcast) and its xor-partner's
extern "C" __global__ void shuffles(const int* in, int src, int* bcast, int* xored, int mask) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int v = in[i];
    bcast[i] = __shfl_sync(0xffffffffu, v, src);
    xored[i] = __shfl_xor_sync(0xffffffffu, v, mask);
}
// 3-D indices: out[z][y][x] over grid x block
extern "C" __global__ void coords(int* out) {
    const int X = gridDim.x * blockDim.x, Y = gridDim.y * blockDim.y;
    const int x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y * blockDim.y + threadIdx.y;
    const int z = blockIdx.z * blockDim.z + threadIdx.z;
    out[((i64)z * Y + y) * X + x] = x + 100 * y + 10000 * z;
}
// block b reads what block b - 1 of the same launch wrote (a race on a GPU, which runs them in any order)
extern "C" __global__ void after_the_block_before(float* a) {
    if (threadIdx.x == 0 && blockIdx.x > 0) a[blockIdx.x] = a[blockIdx.x - 1] + 1.0f;
}
// thread t reads what thread (t + 1) wrote to dynamic shared memory before the barrier
extern "C" __global__ void rotate_smem(float* out) {
    extern __shared__ float sm[];
    sm[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = sm[(threadIdx.x + 1) % blockDim.x];
}
extern "C" __global__ void read_unwritten_shared(float* out) {
    __shared__ float s[4];
    out[threadIdx.x] = s[threadIdx.x % 4];
}
extern "C" __global__ void half_round(const float* x, u16* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f2h(x[i]);
}
extern "C" __global__ void sync_after_return(float* out) {
    if (threadIdx.x < 32) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}
extern "C" __global__ void shuffle_vs_barrier(float* out) {
    if ((threadIdx.x & 31) < 16) out[threadIdx.x] = warp_sum(1.0f);  // half of each warp
    else __syncthreads();
}
extern "C" __global__ void load4(const float* x, int off, float* out) {
    out[threadIdx.x] = ld_f4(x + off + 4 * threadIdx.x).y;
}
extern "C" __global__ void warp_sum_all(float* out) { out[threadIdx.x] = warp_sum(1.0f); }
extern "C" __global__ void warp_reductions(const float* x, float* sums, float* maxes, float* block) {
    __shared__ float red[32];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    sums[i] = warp_sum(x[i]);
    maxes[i] = warp_max(x[i]);
    const float b = block_sum(x[i], red);
    if (threadIdx.x == 0) block[blockIdx.x] = b;
}
extern "C" __global__ void write_n(float* out, int n) {
    if (threadIdx.x == 0) for (int i = 0; i < n; i++) out[i] = 1.0f;
}
extern "C" __global__ void prefetch_all(const i64* ranges, int n) {
    prefetch_ranges(ranges, n, (i64)blockIdx.x * blockDim.x + threadIdx.x, (i64)gridDim.x * blockDim.x);
}
'''


@pytest.fixture(scope="module")
def mod():
    return cp.RawModule(code=SRC, options=("--std=c++17",))


def test_block_reduction(mod):
    x = np.random.default_rng(0).standard_normal((5, 1000)).astype(np.float32)
    out = cp.empty(5, cp.float32)
    mod.get_function("row_sum")((5,), (256,), (cp.asarray(x), np.int32(1000), out))
    np.testing.assert_allclose(cp.asnumpy(out), x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("src,mask", [(0, 1), (7, 16), (31, 5)])
def test_warp_shuffles(mod, src, mask):
    n = 128
    vals = np.random.default_rng(src).integers(-1000, 1000, n).astype(np.int32)
    b, x = cp.empty(n, cp.int32), cp.empty(n, cp.int32)
    mod.get_function("shuffles")((2,), (64,), (cp.asarray(vals), np.int32(src), b, x, np.int32(mask)))
    lanes = np.arange(n)
    np.testing.assert_array_equal(cp.asnumpy(b), vals[(lanes // 32) * 32 + src])
    np.testing.assert_array_equal(cp.asnumpy(x), vals[(lanes // 32) * 32 + ((lanes % 32) ^ mask)])


def test_one_exchange_warp_reductions_are_the_shuffles(mod):
    # SHARPI_SIMT_WARP_REDUCE (the model-level tests' shortcut) must give every lane the bits of the five
    # shuffles: values of mixed magnitude (a different order of additions rounds differently), and
    # warps with a NaN, infinities and signed zeros
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(8 * 128) * 10.0 ** rng.integers(-6, 7, 8 * 128)).astype(np.float32)
    x[5], x[200], x[201], x[300:310], x[700] = np.nan, np.inf, -np.inf, -0.0, -np.inf
    fast = cp.RawModule(code=SRC, options=("--std=c++17", "-DSHARPI_SIMT_WARP_REDUCE"))
    outs = []
    for m in (mod, fast):
        o = [cp.empty(8 * 128, cp.float32), cp.empty(8 * 128, cp.float32), cp.empty(8, cp.float32)]
        m.get_function("warp_reductions")((8,), (128,), (cp.asarray(x), *o))
        outs.append([cp.asnumpy(a).view(np.uint32) for a in o])
    for shuffled, one_exchange in zip(*outs):
        np.testing.assert_array_equal(one_exchange, shuffled)
    # the data tells orders apart: a left-to-right sum differs from the butterfly's in some finite warp
    warps, sums = x.reshape(32, 32), outs[0][0].view(np.float32).reshape(32, 32)[:, 0]
    finite = np.isfinite(warps).all(1)
    in_order = np.array([np.add.accumulate(w, dtype=np.float32)[-1] for w in warps[finite]])
    assert np.any(in_order != sums[finite])


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_three_dimensional_grid_and_block(mod, order, monkeypatch):
    monkeypatch.setenv("SHARPI_SIMT_ORDER", order)
    grid, block = (3, 2, 2), (8, 4, 2)
    X, Y, Z = (g * b for g, b in zip(grid, block))
    out = cp.full((Z, Y, X), -1, cp.int32)
    mod.get_function("coords")(grid, block, (out,))
    z, y, x = np.meshgrid(np.arange(Z), np.arange(Y), np.arange(X), indexing="ij")
    np.testing.assert_array_equal(cp.asnumpy(out), x + 100 * y + 10000 * z)


def test_block_order_exposes_a_read_of_another_block(mod, monkeypatch):
    # blocks run first to last, then (reverse) last to first: a block that reads what another block of the
    # launch writes sees it in one order only
    results = {}
    for order in ("forward", "reverse"):
        monkeypatch.setenv("SHARPI_SIMT_ORDER", order)
        a = cp.zeros(6, cp.float32)
        mod.get_function("after_the_block_before")((6,), (32,), (a,))
        results[order] = cp.asnumpy(a)
    np.testing.assert_array_equal(results["forward"], np.arange(6))
    np.testing.assert_array_equal(results["reverse"], [0, 1, 1, 1, 1, 1])


def test_dynamic_shared_memory_is_shared_by_the_block(mod):
    out = cp.empty(96, cp.float32)
    mod.get_function("rotate_smem")((1,), (96,), (out,), shared_mem=96 * 4)
    np.testing.assert_array_equal(cp.asnumpy(out), (np.arange(96) + 1) % 96)


def test_thread_order_exposes_a_missing_barrier(mod, monkeypatch):
    # rotate_smem without its __syncthreads: thread t reads thread t+1's slot, which the forward
    # order has not written yet (NaN) and the reverse order has
    m = cp.RawModule(code=SRC.replace("sm[threadIdx.x] = (float)threadIdx.x;\n    __syncthreads();",
                                      "sm[threadIdx.x] = (float)threadIdx.x;"))
    results = {}
    for order in ("forward", "reverse"):
        monkeypatch.setenv("SHARPI_SIMT_ORDER", order)
        out = cp.zeros(64, cp.float32)
        m.get_function("rotate_smem")((1,), (64,), (out,), shared_mem=256)
        results[order] = cp.asnumpy(out)
    assert np.isnan(results["forward"][:63]).all()
    np.testing.assert_array_equal(results["reverse"][:63], np.arange(1, 64))


def test_warp_skew_exposes_a_missing_trailing_barrier(monkeypatch):
    # block_max then block_sum share `red`: without block_max's trailing barrier a fast warp writes
    # its partial sum over red[] before a slow warp has read the maximum (a GPU may do that)
    kernel = r"""
extern "C" __global__ void max_then_sum(const float* x, float* out) {
    __shared__ float red[32];
    const float v = x[threadIdx.x];
    const float m = block_max(v, red);
    const float s = block_sum(v, red);
    out[threadIdx.x] = m + 1000.0f * s;
}
"""
    x = np.arange(128, dtype=np.float32) / 64.0
    want = x.max() + 1000.0 * x.sum()
    common = (cb.cuda_source_dir() / "common.cuh").read_text().replace("#pragma once", "")
    trailing = "    for (int i = 1; i < nw; i++) r = fmaxf(r, red[i]);\n    __syncthreads();\n"
    assert trailing in common
    broken = common.replace(trailing, "    for (int i = 1; i < nw; i++) r = fmaxf(r, red[i]);\n")
    for src, ok in ((common, True), (broken, False)):
        fn = cp.RawModule(code=src + kernel).get_function("max_then_sum")
        for order in ("forward", "reverse"):
            monkeypatch.setenv("SHARPI_SIMT_ORDER", order)
            out = cp.empty(128, cp.float32)
            fn((1,), (128,), (cp.asarray(x), out))
            assert np.allclose(cp.asnumpy(out), want) == ok, (order, ok)


def test_shared_memory_starts_as_garbage(mod):
    out = cp.zeros(32, cp.float32)
    mod.get_function("read_unwritten_shared")((1,), (32,), (out,))
    assert np.isnan(cp.asnumpy(out)).all()  # 0xff bytes: a read before any write shows


def test_host_half_rounding_is_numpys():
    # f2h's host branch (used by the emulator) against numpy's float16 conversion (round to nearest
    # even), on every special value and on random bit patterns around the half range
    m = cp.RawModule(code=SRC)
    rng = np.random.default_rng(1)
    bits = np.concatenate([rng.integers(0x30000000, 0x48000000, 200_000, dtype=np.uint32),
                           rng.integers(0, 1 << 32, 50_000, dtype=np.uint64).astype(np.uint32)])
    special = np.array([0, 0.5 ** 25, 0.5 ** 24, 1.5 * 0.5 ** 25, 65504, 65519.99, 65520, 1e9, np.inf,
                        6.1e-5, 6.0e-5, 5.96e-8, 2.98e-8, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11], np.float32)
    x = np.concatenate([bits.view(np.float32), special, -special])
    x = x[~np.isnan(x)]
    y = cp.empty(x.size, cp.uint16)
    m.get_function("half_round")((-(-x.size // 256),), (256,), (cp.asarray(x), y, np.int32(x.size)))
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(cp.asnumpy(y), want)


@pytest.mark.parametrize("kernel,block,message", [
    ("sync_after_return", 64, "__syncthreads in block (0,0,0) after 32 of its 64 threads returned"),
    ("shuffle_vs_barrier", 64, "deadlock"),
    ("warp_sum_all", 48, "full-mask shuffle in a warp of 16 threads"),
])
def test_divergence_is_an_error(mod, kernel, block, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        mod.get_function(kernel)((1,), (block,), (cp.empty(64, cp.float32),))


def test_launch_limits(mod):
    x, out = cp.zeros((1, 8), cp.float32), cp.empty(1, cp.float32)
    k = mod.get_function("row_sum")
    with pytest.raises(RuntimeError, match=r"__launch_bounds__\(256\)"):
        k((1,), (512,), (x, np.int32(8), out))
    r = mod.get_function("rotate_smem")
    o = cp.empty(64, cp.float32)
    with pytest.raises(RuntimeError, match="max_dynamic_shared_size_bytes"):
        r((1,), (64,), (o,), shared_mem=64 * 1024)
    r.max_dynamic_shared_size_bytes = 64 * 1024
    r((1,), (64,), (o,), shared_mem=64 * 1024)
    with pytest.raises(RuntimeError, match="wrote outside its 128 bytes of dynamic shared memory"):
        r((1,), (64,), (o,), shared_mem=128)
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_VALUE"):
        r.max_dynamic_shared_size_bytes = 400 * 1024
    with pytest.raises(TypeError, match="tuples"):
        r(1, (64,), (o,))
    with pytest.raises(RuntimeError, match="more than a GPU block"):
        mod.get_function("warp_sum_all")((1,), (2048,), (o,))


def test_misaligned_vector_loads_are_errors(mod):
    x, out = cp.asarray(np.arange(64, dtype=np.float32)), cp.empty(8, cp.float32)
    k = mod.get_function("load4")
    k((1,), (8,), (x, np.int32(4), out))
    np.testing.assert_array_equal(cp.asnumpy(out), 4 + 4 * np.arange(8) + 1)
    with pytest.raises(RuntimeError, match="misaligned address: a 16-byte access"):
        k((1,), (8,), (x, np.int32(1), out))


def test_kernel_arguments_are_checked_against_the_signature(mod):
    x, out = cp.zeros((1, 8), cp.float32), cp.empty(1, cp.float32)
    k = mod.get_function("row_sum")
    assert k.signature == "FiF"
    with pytest.raises(TypeError, match="argument 1 is int64"):
        k((1,), (32,), (x, 8, out))  # a Python int travels as 64 bits
    with pytest.raises(TypeError, match="argument 1 is float"):
        k((1,), (32,), (x, np.float32(8), out))
    with pytest.raises(TypeError, match="float16 device array"):
        k((1,), (32,), (x.astype(cp.float16), np.int32(8), out))
    with pytest.raises(TypeError, match="numpy array"):
        k((1,), (32,), (np.zeros((1, 8), np.float32), np.int32(8), out))
    with pytest.raises(TypeError, match="2 arguments"):
        k((1,), (32,), (x, np.int32(8)))


def test_writes_outside_an_allocation_are_caught(mod):
    k = mod.get_function("write_n")
    out = cp.empty(10, cp.float32)
    k((1,), (32,), (out, np.int32(10)))
    with pytest.raises(RuntimeError, match="outside an allocation of 40 bytes"):
        k((1,), (32,), (out, np.int32(11)))
    copied = out.copy()  # copies are device allocations with guards too
    with pytest.raises(RuntimeError, match="outside an allocation of 40 bytes"):
        k((1,), (32,), (copied, np.int32(11)))


def test_driver_launches_take_pointers_into_live_allocations_only(mod):
    # the emulated cuLaunchKernelEx (what sharpi_core.backends.cuda's programmatic launches call) looks each
    # pointer argument up among the live allocations: inside one (a view's offset too) it runs the kernel,
    # past the end of one or into a freed one it refuses the launch, as a GPU would fault there
    k = mod.get_function("write_n")
    drv = cp.cuda.libcuda

    def launch(ptr: int, n: int) -> int:
        v, count = ctypes.c_void_p(ptr), np.array(np.int32(n))
        params = (ctypes.c_void_p * 2)(ctypes.addressof(v), count.ctypes.data)
        cfg = cb.CuLaunchConfig(1, 1, 1, 32, 1, 1, 0, None, None, 0)
        return drv.cuLaunchKernelEx(ctypes.addressof(cfg), k.kernel.ptr, ctypes.addressof(params), None)

    a, b = cp.zeros(16, cp.float32), cp.zeros(16, cp.float32)
    assert launch(a[4:].data.ptr, 3) == 0 and launch(b.data.ptr, 1) == 0
    assert a.get().tolist() == [0.0] * 4 + [1.0] * 3 + [0.0] * 9 and b.get()[0] == 1.0
    assert launch(a.data.ptr + 16 * 4, 1) == cp.CUDA_ERROR_INVALID_VALUE
    assert "not in a live allocation" in drv.last_error
    gone = b.data.ptr
    del b
    assert launch(gone, 1) == cp.CUDA_ERROR_INVALID_VALUE
    assert launch(a.data.ptr, 1) == 0  # the table follows the allocations


def _prefetched(mod, launch) -> list[int]:
    """The addresses the kernels of `launch()` prefetched, in order (the emulator's log)."""
    log = np.zeros(1 << 16, np.uint64)
    mod._lib.simt_prefetch_log(ctypes.c_void_p(log.ctypes.data), ctypes.c_int(log.size))
    try:
        launch()
    finally:
        n = mod._lib.simt_prefetch_log(None, ctypes.c_int(0))
    assert n < log.size
    return [int(a) for a in log[:n]]


@pytest.mark.parametrize("grid,block", [((1,), (32,)), ((3,), (64,)), ((7,), (96,)), ((40,), (256,))])
def test_prefetch_ranges_asks_for_every_line_once(mod, grid, block):
    # common.cuh's prefetch_ranges (a weight's `ahead`, asked for by its matvecs): the workers of a launch
    # together ask for each 128-byte line of each range exactly once, from the range's address, whatever their count
    arrays = [cp.zeros(n, cp.uint8) for n in (1, 127, 128, 129, 5000, 300)]
    sizes = [1, 127, 128, 129, 5000, 200]  # (the last range is a part of its array)
    ranges = cp.asarray(np.array([(a.data.ptr, n) for a, n in zip(arrays, sizes)], np.int64))
    k = mod.get_function("prefetch_all")
    got = _prefetched(mod, lambda: k(grid, block, (ranges, np.int32(len(sizes)))))
    want = [a.data.ptr + 128 * i for a, n in zip(arrays, sizes) for i in range(-(-n // 128))]
    assert sorted(got) == sorted(want)
    assert _prefetched(mod, lambda: k(grid, block, (ranges, np.int32(0)))) == []


def test_prefetches_outside_an_allocation_are_caught(mod):
    a = cp.zeros(1000, cp.uint8)
    k = mod.get_function("prefetch_all")
    k((2,), (32,), (cp.asarray(np.array([(a.data.ptr, 1000)], np.int64)), np.int32(1)))
    with pytest.raises(RuntimeError, match="outside every live allocation"):
        k((2,), (32,), (cp.asarray(np.array([(a.data.ptr, 1000 + 128)], np.int64)), np.int32(1)))
    with pytest.raises(RuntimeError, match="outside every live allocation"):
        k((2,), (32,), (cp.asarray(np.array([(a.data.ptr - 256, 100)], np.int64)), np.int32(1)))


def test_device_arrays_do_not_mix_with_host_arrays():
    a = cp.zeros(4, cp.float32)
    with pytest.raises(TypeError):
        a + np.ones(4, np.float32)
    with pytest.raises(TypeError):
        cp.ascontiguousarray(np.ones(4, np.float32))
    assert isinstance(a + 1, cp.ndarray) and isinstance(cp.asnumpy(a), np.ndarray)


def test_graph_capture_records_launches_and_replays_them(mod):
    k = mod.get_function("row_sum")
    x = cp.asarray(np.ones((2, 100), np.float32))
    out = cp.zeros(2, cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        assert s.is_capturing()
        k((2,), (64,), (x, np.int32(100), out))  # recorded, not run
        for what, call in (("allocation", lambda: cp.empty(3, cp.float32)),
                           ("numpy's add", lambda: x + x),
                           ("host -> device copy", lambda: x.set(np.zeros((2, 100), np.float32))),
                           ("device -> host copy", lambda: cp.asnumpy(out))):
            with pytest.raises(RuntimeError, match=what):
                call()
        g = s.end_capture()
    assert not s.is_capturing()
    np.testing.assert_array_equal(cp.asnumpy(out), [0, 0])
    x.set(np.full((2, 100), 2.0, np.float32))  # a replay reads the memory as it is then
    g.launch(stream=s)
    np.testing.assert_array_equal(cp.asnumpy(out), [200, 200])
    with pytest.raises(RuntimeError, match="default"):
        cp.cuda.Stream.null.begin_capture()


def test_shared_memory_limit_lowered_under_a_graph(mod):
    """A replay checks a launch's dynamic shared memory against the function's limit as it is then (a lowered
    one is an error: the driver's behaviour there is not documented); sharpi's Kernel only ever raises it, so
    a smaller launch after a capture leaves the graph's launch valid."""
    r = mod.get_function("rotate_smem")
    o = cp.empty(64, cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        r.max_dynamic_shared_size_bytes = 64 * 1024
        s.begin_capture()
        r((1,), (64,), (o,), shared_mem=64 * 1024)
        g = s.end_capture()
        r.max_dynamic_shared_size_bytes = 50 * 1024
        with pytest.raises(RuntimeError, match="max_dynamic_shared_size_bytes"):
            g.launch(stream=s)
        k = cb.Kernel(r)
        for n in (60 * 1024, 40 * 1024, 56 * 1024):  # (what attention() asks for, launch by launch)
            k.allow_shared(n)
        assert r.max_dynamic_shared_size_bytes == 60 * 1024 == k.smem_limit
        k.allow_shared(64 * 1024)
        g.launch(stream=s)
        assert r.max_dynamic_shared_size_bytes == 64 * 1024


def test_graph_replay_into_freed_memory_is_an_error(mod):
    k = mod.get_function("row_sum")
    x, out = cp.asarray(np.ones((1, 10), np.float32)), cp.zeros(1, cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        k((1,), (32,), (x, np.int32(10), out))
        g = s.end_capture()
    g.launch(stream=s)
    assert float(out[0]) == 10.0
    del x  # the graph holds a pointer, not the array
    with pytest.raises(RuntimeError, match="freed"):
        g.launch(stream=s)


# ---- the GPU test files, emulated ---------------------------------------------------------------------

# Model-level GPU tests quick enough emulated (SmolLM2: about half a second a token there; the Gemma and
# Qwen ones take minutes each and run by hand:
#   PYTHONPATH=tests/simt python3 -m pytest tests/test_cuda_model.py)
# Two groups of about equal time, run at once in two processes (seconds measured with --durations,
# both groups running and nothing else, 2 cores, MODEL_TEST_ENV, 2026-12-06; the whole groups 128 and 145 s;
# re-balance when a test is added).
# (test_device_argmax_and_greedy_chain_are_the_host_argmax[cuda] is left to a GPU: its kernel is
# checked emulated in test_cuda_kernels.py, its host logic by the [fake] variant, and the speculative parity
# test below runs the device arg-max chains; so is test_graph_launches_equal_eager_passes_bit_for_bit[q8_0-cuda]
# (38 s here): graph replays run emulated with f16 caches and split, the q8_0 cache's kernels in the q8_0 tests)
MODEL_TEST_GROUPS = tuple([f"tests/test_cuda_model.py::{t}" for t in group] for group in ((
    "test_gpu_greedy_matches_llama_cpp[smollm2-135m]",    # 54 s (3 of the 5 prompts): llama.cpp's fixtures
    "test_graph_launches_equal_eager_passes_bit_for_bit[f16-cuda]",  # 23
    "test_gpu_cache_truncate_last_n_and_cut_head[cuda]",  # 23
    "test_gpu_q8_0_cache_follows_cpu[cuda]",              # 5
    "test_control_vectors_on_the_gpu_follow_the_cpu[cuda]",  # 20: the residual add and vector on the real kernels
), (
    "test_gpu_speculative_greedy_parity[cuda]",            # 69 (16 tokens): lookup, self-draft (device arg-max)
    "test_fused_launches_equal_separate_ones_bit_for_bit[f16-cuda-smollm2-135m]",  # 22: RoPE, rounding in kernels
    "test_graph_launches_equal_eager_passes_bit_for_bit[split-cuda]",  # 11
    "test_gpu_verify_rows_equal_one_token_passes",         # 9: bit for bit, what speculation relies on
    "test_gpu_split_model_verify_rows_and_logits",         # 5: -ngl below the layer count
    "test_sampled_draft_chains_draw_each_token_by_the_law_they_bring_back[cuda]",  # 21: replays read new uniforms, a pass of 3 rows
    "test_split_cache_truncate_last_n_and_cut_head[cuda]",  # 3
    "test_logits_close_to_cpu[cuda-smollm2-135m]",         # 2
    "test_gpu_q8_0_cache_bytes_are_the_cpu_cache_bytes[cuda]",
)))


# The model-level tests reduce across a warp in one exchange rather than five (simt.hpp's warp_butterfly,
# the same bits: test_one_exchange_warp_reductions_are_the_shuffles): those exchanges were about half of
# the emulator's time there. The kernel tests run the shuffles.
MODEL_TEST_ENV = {"SHARPI_SIMT_WARP_REDUCE": "1", "SHARPI_SIMT_QUICK": "1"}  # (QUICK: see test_cuda_model.py)


def start_emulated(*args: str, order: str = "forward", env: dict | None = None, nice: int = 0) -> subprocess.Popen:
    # (no third-party pytest plugins: a machine's hypothesis, anyio, pytest-benchmark cost each run ~1.7 s to import
    # and assertion-rewrite, every time where PYTHONDONTWRITEBYTECODE keeps pytest from caching that)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SIMT_DIR), os.environ.get("PYTHONPATH", "")]),
               SHARPI_SIMT_ORDER=order, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)


# The emulated runs started when the session has collected them (conftest.pytest_collection_finish),
# at the lowest priority, beside the other tests rather than alone at the end (the kernel tests' two
# orders took a minute there, one after the other, a core idle). They do not only fill idle time: on
# 2026-12-06 a whole run took 25:14 with them and 18:26 without (README, the test command).
_EARLY: list[subprocess.Popen] = []
_EARLY_KERNELS: dict[str, subprocess.Popen] = {}
KERNEL_ORDERS = ("forward", "reverse")


def kernel_run(order: str, nice: int = 0) -> subprocess.Popen:
    # the emulated GPU is an sm_90, so launches on a stream go through cuLaunchKernelEx (programmatic
    # dependent launch); the reverse run launches them the plain way (RawKernel, whose argument types
    # the emulator checks against the kernel's C signature)
    return start_emulated("tests/test_cuda_kernels.py", order=order, nice=nice,
                          env={"SHARPI_CUDA_PDL": "0"} if order == "reverse" else None)


def start_early(names: set[str]) -> None:
    """Start the emulated runs of the selected tests (names: the session's test names)."""
    if cp.compiler() is None or _EARLY or _EARLY_KERNELS:
        return
    if "test_model_tests_pass_on_the_emulated_gpu" in names:
        _EARLY.extend(start_emulated(*g, env=MODEL_TEST_ENV, nice=19) for g in MODEL_TEST_GROUPS)
    _EARLY_KERNELS.update({o: kernel_run(o, nice=19) for o in KERNEL_ORDERS
                           if f"test_kernel_tests_pass_on_the_emulated_gpu[{o}]" in names})
    procs = [*_EARLY, *_EARLY_KERNELS.values()]
    atexit.register(lambda: [p.kill() for p in procs if p.poll() is None])  # an interrupted session


def finish(p: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = p.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def check_run(r: subprocess.CompletedProcess, min_passed: int) -> None:
    tail = r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, tail
    m = re.search(r"(\d+) passed", r.stdout)
    assert m and int(m[1]) >= min_passed, tail
    assert "skipped" not in r.stdout.splitlines()[-1], tail  # nothing skipped for want of a GPU


@pytest.mark.parametrize("order", KERNEL_ORDERS)
def test_kernel_tests_pass_on_the_emulated_gpu(order):
    # threads between two barriers, and a launch's blocks, run in increasing, then decreasing order: a missing
    # barrier (a thread reading what another writes before they synchronise), or a block reading what another
    # block of its launch writes, fails one of the two
    p = _EARLY_KERNELS.pop(order, None) or kernel_run(order)
    check_run(finish(p), 170)


def test_model_tests_pass_on_the_emulated_gpu():
    # in two processes at once: the emulator runs on one core, and these machines have two
    procs = _EARLY or [start_emulated(*g, env=MODEL_TEST_ENV) for g in MODEL_TEST_GROUPS]
    results = [finish(p) for p in procs]
    for h, r in zip(MODEL_TEST_GROUPS, results):
        check_run(r, len(h))
