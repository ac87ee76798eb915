"""CUDA backend through CuPy: matvecs on raw GGUF blocks and the decode-step helpers.

The kernels live in the repository's `cuda/` directory (`qmatvec.cu`, `ops.cu`; their headers say
what each kernel computes and how it is launched). Each .cu is compiled once per process and device
with NVRTC (`cupy.RawModule`; CuPy also keeps compiled binaries in its on-disk cache), after this
module pastes in the `#include "*.cuh"` files so the cache key covers the whole source. qmatvec.cu
is built as one module per weight type in use (-DQMV_ONLY=<type>): a few seconds each, the first
time only.

Nothing here imports cupy at module import time: `cuda_available()` says whether the backend can
run and why not, and never raises.

    ok, why = cuda_available()
    w = CudaQWeight.from_qweight(qweight)          # or CudaQWeight(raw_uint8, qtype, n, k)
    y = w.matmul(x)                                 # x cupy float32 [T, K] -> [T, N]

`matmul` runs the batched matvec (each weight block read once for up to 16 activation rows) for
T <= 16, chunks of 16 beyond that, and for T >= GEMM_MIN_ROWS (prefill) dequantizes tiles of weight
rows and multiplies them with cuBLAS (a Q4_1 / Q5_1 product then corrected to take Q8_1's s for each
activation block's sum, as the integer matvecs and ggml do). Every call takes an optional `stream` (a cupy.cuda.Stream)
so that target and draft models can run on separate streams; outputs are allocated on that stream.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import math
import os
import re
import sys
import threading
from pathlib import Path

import gguf
import numpy as np

from ..errors import UsageError
from ..switches import switch

Q = gguf.GGMLQuantizationType

TYPE_NAMES = {
    Q.F32: "f32", Q.F16: "f16", Q.BF16: "bf16", Q.Q4_0: "q4_0", Q.Q4_1: "q4_1", Q.Q5_0: "q5_0",
    Q.Q5_1: "q5_1", Q.Q8_0: "q8_0", Q.IQ4_NL: "iq4_nl", Q.Q2_K: "q2_k", Q.Q3_K: "q3_k", Q.Q4_K: "q4_k", Q.Q5_K: "q5_k",
    Q.Q6_K: "q6_k", Q.IQ4_XS: "iq4_xs",
}
SUPPORTED = frozenset(TYPE_NAMES)
# K must be a multiple of this: the quant block, or the per-lane vector of the float kernels.
K_MULTIPLE = {Q.F32: 4, Q.F16: 8, Q.BF16: 8, **{t: gguf.GGML_QUANT_SIZES[t][0] for t in SUPPORTED
                                               if t not in (Q.F32, Q.F16, Q.BF16)}}

GPU_CACHE_TYPES = ("f16", "q8_0")  # the KV cache types the device kernels read and write
QMV_VARIANTS = ((1, 1), (2, 2), (4, 2), (8, 2), (16, 4))  # (NQ, rows per warp R) in qmatvec.cu
# R instead for a matrix whose rows are not split between warps (ws = 1): 4 rows' loads in flight a warp
# (H200: Qwen 1.5B's ffn gate+up 16.4 -> 14.0 us, its output layer 125 -> 107 us a token; 5 rows 39 -> 35,
# 299 -> 252 us); the one-row product only from QMV_TALL_ROWS rows (Qwen 0.5B's 9728: 7.0 -> 7.7 us)
QMV_TALL = {1: 4, 8: 4}
QMV_TALL_ROWS = 16384
QMV_WARPS = 4          # warps per block of the matvec kernels
QMV_SPLITS = (1, 2, 4)  # warps sharing a row group (each a slice of K): `ws` of the qmv kernels
QMV_SPLIT_WARPS = 6144  # a matrix with fewer rows than this shares its rows between warps (qmv_split)
QMV_SPLIT = os.environ.get("SHARPI_QMV_SPLIT", "")  # 1, 2 or 4 for every matrix (benchmarks), else chosen
# weights a lane of the qmv kernels decodes per block: the block size over its lanes per block (LPB)
_LANE_SPAN = {Q.F32: 4, Q.F16: 8, Q.BF16: 8, Q.Q4_0: 8, Q.Q4_1: 8, Q.Q5_0: 8, Q.Q5_1: 8, Q.Q8_0: 8, Q.IQ4_NL: 8,
              Q.Q2_K: 16, Q.Q3_K: 16, Q.Q4_K: 16, Q.Q5_K: 16, Q.Q6_K: 16, Q.IQ4_XS: 16}
# Weight types with integer matvecs (qmvi_*: weight codes times the activations' 8-bit codes with DP4A,
# the sums exact, scaled once a block; cuda/quant_blocks.cuh) and the weights a lane of them owns per
# block. They take the activations as q8 rows (quantize_act, or the q8 rows the rounding kernels write
# beside their output); the float matvecs (qmv_*) multiply the rounded activations in fp32 instead.
# SHARPI_CUDA_DP4A=0 uses the float ones for every type (benchmarks, bisecting).
INT_LANE_SPAN = {Q.Q4_0: 16, Q.Q4_1: 16, Q.Q5_0: 16, Q.Q5_1: 16, Q.Q8_0: 16, Q.Q4_K: 32, Q.Q5_K: 32, Q.Q6_K: 32}
DP4A = switch("SHARPI_CUDA_DP4A")
# weight types whose products take the activations' Q8_1 s (f16(amax/127 * sum of codes)) for a block's sum,
# times the block's min (ggml's vec_dot_q4_1_q8_1 / q5_1): the integer matvecs read it from the q8 rows, and a
# GEMM of these types reads the q8 rows too, for that correction
Q8_1_S_TYPES = (Q.Q4_1, Q.Q5_1)
MAX_BATCH = 16         # activation rows one matvec launch handles
GEMM_MIN_ROWS = 64     # from this many rows on, matmul dequantizes tiles and uses cuBLAS
GEMM_TILE_BYTES = 64 << 20
ATT_THREADS = 128      # must match ops.cu
ATT_MAX_HPB = 2        # heads an attention block at most (ops.cu's)
AHEAD = switch("SHARPI_CUDA_AHEAD")  # ahead_ranges' default budget: half the L2; off: none (benchmarks)
ATT_UNITS = switch("SHARPI_CUDA_ATT_UNITS")  # attention_heads_per_block; off: a head a block (benchmarks)
ATT_UNIT_SMEM = 48 * 1024  # shared memory a block of several heads may take (any GPU's, without opting in)
ATT_MAX_SPLITS = 64
# keys a split at least: fewer splits cost less to combine than more blocks save (H200, Qwen 1.5B's heads,
# one layer: 14.7 / 16.3 / 18.0 / 17.4 us at 128 keys in chunks of 256 / 128 / 64 / 32; 19.3 / 21.0 /
# 30.0 / 48.6 us at 1000 keys; bench_cuda_kernels.py --attn)
ATT_MIN_CHUNK = 256
ATT_MAX_ROWS = 65535   # attention puts query rows in grid.y
ATT_PARTIALS_BYTES = 256 << 20  # split-attention partials of one launch, at most
ARGMAX_MIN_CHUNK = 2048  # values one block of argmax_part_f32 scans, at least
ARGMAX_MAX_SPLITS = 64
TOPK_SORT = 4096  # keys one block of topk_part_f32 / topk_sample sorts (ops.cu's)
TOPK_MAX = 64     # the largest top-k sampled on the device (ops.cu's)
# No contraction of a*b+c into fused multiply-adds beyond the kernels' explicit ones (sh_fma): the
# arithmetic is then the one tests/simt's emulator (and the host compiler) does, up to the math
# library's expf / tanhf / sincosf, so emulated results predict the GPU's.
NVRTC_OPTIONS = ("--std=c++17", "--fmad=false")
# the shared memory / L1 split every kernel asks for, in percent of the most shared memory (benchmarks: whether
# an SM reconfigured between kernels of different needs costs; unset: each kernel's default, the driver's choice)
CARVEOUT = os.environ.get("SHARPI_CUDA_CARVEOUT", "")
# -D options for ops.cu's build (benchmarks: e.g. SHARPI_CUDA_OPS_DEFS="-DATT_K_LOADS=8 -DATT_V_LOADS=4")
OPS_DEFS = os.environ.get("SHARPI_CUDA_OPS_DEFS", "")
SOURCES = ("qmatvec", "ops")

ACT_SILU, ACT_GELU_TANH, ACT_GELU_F16 = 0, 1, 2
ACTIVATIONS = {"silu": ACT_SILU, "gelu_tanh": ACT_GELU_TANH, "gelu": ACT_GELU_TANH, "gelu_tanh_f16": ACT_GELU_F16}
Q_ROUND = {"f32": 0, "f16": 1, "q8_0": 2}
# activation kinds (sharpi_core.quants.act_kind) -> rms_norm_f32's rmode; the 8-bit ones' (block, f16 scale)
ACT_ROUND = {None: 0, "f16": 1, "bf16": 2, "q8_32": 3, "q8_k": 4}
Q8_BLOCKS = {"q8_32": (32, 1), "q8_k": (256, 0)}


# ---- availability and sources ---------------------------------------------------------------------

def _cupy():
    import cupy  # noqa: PLC0415 (lazy on purpose)
    return cupy


def cuda_available() -> tuple[bool, str]:
    """(True, device description) or (False, why not). Never raises."""
    try:
        cp = _cupy()
    except Exception as e:  # ImportError, or a broken install
        return False, f"cupy is not installed ({type(e).__name__}: {e})"
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"no CUDA device ({type(e).__name__}: {e})"
    if n < 1:
        return False, "no CUDA device"
    try:
        dev = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return True, f"{name} (sm_{props['major']}{props['minor']}), {n} device(s)"
    except Exception as e:
        return True, f"{n} CUDA device(s) ({type(e).__name__} reading properties: {e})"


def new_stream():
    """A CUDA stream of its own for one model (target and draft queue their kernels independently)."""
    return _cupy().cuda.Stream(non_blocking=True)


def capture(fn, stream):
    """fn's work on `stream` recorded as a CUDA graph (nothing runs now) -> a graph whose
    `launch(stream)` replays it. fn must launch kernels only: no allocation (the graph would keep
    pointers the memory pool may hand out again), no transfer; arguments are fixed at capture."""
    _pdl.status()  # decided before: the probe allocates and synchronises, which a capture forbids
    with stream:
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
    return graph


def upload(dst, host: np.ndarray, stream=None) -> None:
    """Copy a numpy array into the device array dst (same shape and dtype), in `stream`'s order."""
    dst.set(np.ascontiguousarray(host, dtype=dst.dtype), stream=stream)


def to_host(a, stream=None) -> np.ndarray:
    """Copy a device array to a numpy array, waiting for `stream`'s work on it."""
    return _cupy().asnumpy(a, stream=stream)


# (event, pinned block) of the HostCopy copies not seen done: a copy dropped unread (a look-ahead that missed)
# may still be queued behind the draft's chain, and CuPy's pinned pool hands a freed block out again without
# waiting for the copies into it, so each block stays referenced here until its event says the copy landed
_copies_in_flight: list = []
atexit.register(_copies_in_flight.clear)  # (let go while CuPy and its pools are whole, not at module teardown)


class HostCopy:
    """A device -> host copy queued on a stream, into pinned memory, so the CPU does not wait for it
    (nor for the work before it): `get()` waits and returns the numpy array."""

    def __init__(self, a, stream):
        import cupyx  # noqa: PLC0415 (lazy, as cupy)
        cp = _cupy()
        self._host = cupyx.empty_pinned(a.shape, a.dtype)
        try:
            cp.asnumpy(a, stream=stream, out=self._host, blocking=False)
        except TypeError:  # CuPy < 13: no `blocking`; a copy given a stream runs asynchronously there
            cp.asnumpy(a, stream=stream, out=self._host)
        self._done = stream.record()
        _copies_in_flight[:] = [c for c in _copies_in_flight if not c[0].done]
        _copies_in_flight.append((self._done, self._host))

    def get(self) -> np.ndarray:
        self._done.synchronize()
        return np.array(self._host)  # its own memory: the pinned block goes back to the pool


def to_host_async(a, stream) -> HostCopy:
    """Copy a device array to the host after `stream`'s work so far, without waiting (HostCopy.get)."""
    return HostCopy(a, stream)


def __getattr__(name: str):
    # `xp`: the array module of this backend (cupy), imported on first use like everything here
    if name == "xp":
        return _cupy()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def peak_bandwidth() -> float:
    """The current GPU's peak memory bandwidth in bytes/s: 2 transfers per memory clock times the bus
    width (what the vendors quote, within a few percent); SHARPI_PEAK_GBS overrides it; NaN when the
    driver tells neither. The clock comes from the device attributes: CUDA 13 dropped it from
    cudaDeviceProp (so from CuPy's getDeviceProperties there)."""
    if os.environ.get("SHARPI_PEAK_GBS"):
        return float(os.environ["SHARPI_PEAK_GBS"]) * 1e9
    cp = _cupy()
    dev = cp.cuda.Device()
    clock = width = None
    try:
        attrs = dev.attributes
        clock, width = attrs.get("MemoryClockRate"), attrs.get("GlobalMemoryBusWidth")
    except Exception:
        pass
    if not clock or not width:
        try:
            props = cp.cuda.runtime.getDeviceProperties(dev.id)
            clock, width = props.get("memoryClockRate"), props.get("memoryBusWidth")
        except Exception:
            pass
    return 2.0 * clock * 1e3 * width / 8 if clock and width else float("nan")


def l2_bytes() -> int:
    """The current GPU's L2 cache in bytes (0 where the driver does not say)."""
    try:
        return int(_cupy().cuda.Device().attributes.get("L2CacheSize", 0))
    except Exception:
        return 0


def ahead_ranges(arrays, budget: int | None = None):
    """The (address, bytes) ranges of flat device arrays, in their order, cut where they pass `budget`
    bytes (by default half the L2, none with SHARPI_CUDA_AHEAD=0), as the int64 device array [n, 2] of a
    CudaQWeight's `ahead`, or None when nothing is left: what its matvecs ask the L2 for besides their own
    rows (common.cuh's prefetch_ranges), before they wait on the kernel before them. A decoding step's
    kernels mostly wait on latency (attention, the norms) while DRAM idles; asked for a matmul earlier, the
    next one finds its weights in the L2. At most half of it, so that those lines stay there until read."""
    cp = _cupy()
    pairs = ahead_pairs(arrays, lambda a: a.data.ptr, (l2_bytes() // 2 if AHEAD else 0) if budget is None else budget)
    return cp.asarray(np.array(pairs, dtype=np.int64)) if pairs else None


def ahead_pairs(arrays, ptr, budget: int) -> list[tuple[int, int]]:
    """ahead_ranges' (address, bytes) pairs, the address of an array given by ptr(array)."""
    pairs, left = [], int(budget)
    for a in arrays:
        n = min(int(a.nbytes), left)
        if n <= 0:
            break
        pairs.append((int(ptr(a)), n))
        left -= n
    return pairs


def attention_smem(head_dim_k: int, chunk: int, head_dim_v: int, heads: int = 1) -> int:
    """Dynamic shared memory (bytes) of one attn_partial block of `heads` heads: each head's q, a chunk
    of scores and reductions, then its finished output."""
    return 4 * heads * (head_dim_k + chunk + 8 * ATT_THREADS + 32 + head_dim_v)


def p_round_keys_within(smem_bytes: int, head_dim_k: int, head_dim_v: int) -> int:
    """Most keys a query may see in attention with p_round (llama.cpp's -fa off arithmetic) when a
    block may use smem_bytes of shared memory: its one split keeps all of the row's scores there."""
    return (smem_bytes // 4 - head_dim_k - 8 * ATT_THREADS - 32 - head_dim_v) // 32 * 32


def p_round_max_keys(head_dim_k: int, head_dim_v: int) -> int:
    """p_round_keys_within the current GPU's opt-in shared memory per block."""
    cp = _cupy()
    optin = int(cp.cuda.Device().attributes.get("MaxSharedMemoryPerBlockOptin", 48 * 1024))
    return p_round_keys_within(optin, head_dim_k, head_dim_v)


def attention_heads_per_block(n_head: int, head_dim_v: int, rounding, fused: bool, p_round: bool) -> int:
    """Heads one attention block computes (ops.cu's hpb): the heads of a Q8_K rounding block (256 values,
    which span heads where a head has fewer) when the launch combines its own splits, so that a row whose
    keys lie in one split is finished and rounded by that split's block, with no partials, counters or
    combining block; otherwise 1. (Each head computes as alone: the same bits either way.)"""
    if not ATT_UNITS or not fused or p_round or rounding != "q8_k" or head_dim_v % 32:
        return 1
    hpu = 256 // math.gcd(head_dim_v, 256)
    return hpu if hpu <= ATT_MAX_HPB and n_head % hpu == 0 else 1


def cuda_source_dir() -> Path:
    """The directory holding the .cu sources: $SHARPI_CUDA_DIR, else the repository's cuda/ (a
    source checkout), else <prefix>/share/sharpi/cuda (where a wheel installs them)."""
    env = os.environ.get("SHARPI_CUDA_DIR")
    here = Path(__file__).resolve()
    candidates = ([Path(env)] if env else []) + [here.parents[2] / "cuda", Path(sys.prefix) / "share" / "sharpi" / "cuda"]
    for c in candidates:
        if (c / "qmatvec.cu").is_file():
            return c
    raise FileNotFoundError("sharpi CUDA sources not found (looked in "
                            + ", ".join(str(c) for c in candidates) + "; set SHARPI_CUDA_DIR)")


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.M)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.M)


def _expand(path: Path, seen: set) -> str:
    def sub(m):
        inc = (path.parent / m.group(1)).resolve()
        if inc in seen:
            return f"// (already included: {m.group(1)})"
        seen.add(inc)
        return f"// ---- begin {m.group(1)}\n{_expand(inc, seen)}\n// ---- end {m.group(1)}"
    return _INCLUDE.sub(sub, _PRAGMA_ONCE.sub("", path.read_text()))


def kernel_source(name: str) -> str:
    """The full text of cuda/<name>.cu with its local includes pasted in (what NVRTC compiles)."""
    path = (cuda_source_dir() / f"{name}.cu").resolve()
    return _expand(path, {path})


_lock = threading.Lock()
_modules: dict = {}    # (source name, extra options, device id) -> cupy.RawModule
_functions: dict = {}  # (source name, extra options, device id, kernel name) -> cupy.RawKernel
_dummies: dict = {}    # (device id, dtype name) -> a one-element array for unused pointer arguments


def module(name: str, options: tuple = ()):
    """The compiled RawModule of cuda/<name>.cu (+ extra NVRTC options, e.g. -DQMV_ONLY=12) for the
    current device, compiled once per process."""
    cp = _cupy()
    key = (name, tuple(options), cp.cuda.Device().id)
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            extra = tuple(OPS_DEFS.split()) if name == "ops" else ()
            mod = cp.RawModule(code=kernel_source(name), options=NVRTC_OPTIONS + tuple(options) + extra)
            mod.compile()
            _modules[key] = mod
        return mod


def function(src: str, kernel: str, options: tuple = ()) -> "Kernel":
    """A kernel of cuda/<src>.cu (compiling the module on first use)."""
    cp = _cupy()
    key = (src, tuple(options), cp.cuda.Device().id, kernel)
    fn = _functions.get(key)
    if fn is None:
        mod = module(src, options)
        with _lock:
            fn = _functions.setdefault(key, Kernel(mod.get_function(kernel)))
    return fn


# ---- launches: programmatic dependent launch ---------------------------------------------------------
# A decoding step is a chain of a few hundred small kernels, each waiting for the one before: on a GPU
# much of a step is launch latency, not memory traffic. With CUDA's programmatic stream serialization
# (sm_90+, launched through the driver's cuLaunchKernelEx) the next kernel is launched while this one
# runs: its blocks become resident, prefetch their weights into the L2 and wait in griddepcontrol.wait
# (KERNEL_BEGIN in cuda/common.cuh, which every kernel starts with). Inside CUDA graphs this becomes a
# programmatic edge. SHARPI_CUDA_PDL=0 launches every kernel the plain way (same results).
PDL = switch("SHARPI_CUDA_PDL")
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # cuda.h's CUlaunchAttributeID


class CuLaunchAttribute(ctypes.Structure):  # cuda.h's CUlaunchAttribute: an id, then a 64-byte value union at 8
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class CuLaunchConfig(ctypes.Structure):  # cuda.h's CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(CuLaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def kernel_params(cp, args) -> tuple[ctypes.Array, list]:
    """cuLaunchKernelEx's kernelParams for `args` (what a RawKernel call takes: device arrays, numpy
    scalars): an array of pointers, one to each argument's value, and the objects holding those values
    (alive until the launch returns; the driver copies them)."""
    params = (ctypes.c_void_p * max(1, len(args)))()
    keep = []
    for i, a in enumerate(args):
        if isinstance(a, cp.ndarray):  # a pointer argument: the array's device address, by value
            v = ctypes.c_void_p(a.data.ptr)
            params[i] = ctypes.addressof(v)
        elif isinstance(a, np.generic) and a.dtype.kind in "iuf":  # the scalar in its own C type
            v = np.array(a)
            params[i] = v.ctypes.data
        else:  # a Python int would be ambiguous (CuPy passes it as 64 bits)
            raise TypeError(f"kernel argument {i}: {type(a).__name__}; pass device arrays or numpy scalars")
        keep.append(v)
    return params, keep


def _dim3(v) -> tuple[int, int, int]:
    v = tuple(int(x) for x in v)
    return v + (1,) * (3 - len(v))


class _Pdl:
    """Whether kernels go out with programmatic dependent launch: decided once per process, the first
    time it is asked (at the first kernel launch, or by capture() before it begins: never inside a
    capture) by a launch and a captured pair of launches that must give the right value."""

    def __init__(self):
        self.on: bool | None = None
        self.why = ""
        self.launch_ex = None  # cuLaunchKernelEx
        self._lock = threading.Lock()
        self._probing = False

    def status(self) -> tuple[bool, str]:
        if self.on is None:
            if self._probing:  # the probe's own capture asking
                return False, "being probed"
            with self._lock:  # not the module's _lock: the probe compiles a module under that one
                if self.on is None:
                    self._probing = True
                    try:
                        self.on, self.why = self._probe()
                    finally:
                        self._probing = False
        return self.on, self.why

    def _probe(self) -> tuple[bool, str]:
        if not PDL:
            return False, "off (SHARPI_CUDA_PDL=0)"
        cp = _cupy()
        try:
            cc = int(cp.cuda.Device().compute_capability)
        except Exception as e:
            return False, f"off (compute capability unknown: {e})"
        if cc < 90:
            return False, f"off (sm_{cc}; programmatic launches need sm_90)"
        try:
            lib = getattr(cp.cuda, "libcuda", None) or ctypes.CDLL("libcuda.so.1")  # the emulator brings its own
            fn = lib.cuLaunchKernelEx
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 4
        except (OSError, AttributeError) as e:
            return False, f"off (no cuLaunchKernelEx in the driver: {e})"
        self.launch_ex = fn
        try:  # x = 1, then x *= 2 eagerly and x *= 3 twice from a captured graph: 18
            k = function("ops", "scale_f32")
            s = new_stream()
            with s:
                x = cp.ones(1, dtype=cp.float32)
                args = lambda f: (x, _i64(1), _i32(1), _i32(1), _f32(f))  # noqa: E731
                self.launch(k.raw, (1,), (32,), args(2.0), 0)
            g = capture(lambda: [self.launch(k.raw, (1,), (32,), args(3.0), 0) for _ in range(2)], s)
            g.launch(s)
            s.synchronize()
            got = float(x.get()[0])
        except Exception as e:
            self.launch_ex = None
            return False, f"off (the probe launch failed: {type(e).__name__}: {e})"
        if got != 18.0:
            self.launch_ex = None
            return False, f"off (the probe launches gave {got}, not 18)"
        return True, "on"

    def launch(self, raw, grid, block, args, shared_mem: int) -> None:
        cp = _cupy()
        params, keep = kernel_params(cp, args)
        attr = CuLaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        ctypes.c_int.from_buffer(attr, CuLaunchAttribute.value.offset).value = 1  # programmaticStreamSerializationAllowed
        cfg = CuLaunchConfig(*_dim3(grid), *_dim3(block), int(shared_mem), cp.cuda.get_current_stream().ptr,
                             ctypes.pointer(attr), 1)
        rc = self.launch_ex(ctypes.addressof(cfg), raw.kernel.ptr, ctypes.addressof(params), None)
        if rc:
            raise RuntimeError(f"cuLaunchKernelEx: CUDA error {rc} launching {getattr(raw, 'name', raw)} "
                               f"grid {grid} block {block}")


_pdl = _Pdl()


def pdl_status() -> tuple[bool, str]:
    """(whether kernels are launched with programmatic dependent launch, a word on why)."""
    return _pdl.status()


class Kernel:
    """A kernel of cuda/*.cu, called like cupy.RawKernel: `k(grid, block, args, shared_mem=0)` on the
    current stream; with programmatic dependent launch where it is on (not on the legacy default
    stream, whose implicit synchronisation it would not keep)."""

    def __init__(self, raw):
        self.raw = raw
        self.smem_limit = 48 * 1024  # dynamic shared memory a launch may use without the opt-in
        if CARVEOUT:
            if not CARVEOUT.strip().lstrip("-").isdigit() or not -1 <= int(CARVEOUT) <= 100:
                raise ValueError(f"SHARPI_CUDA_CARVEOUT={CARVEOUT}: a percent of the most shared memory, 0..100 (-1: none)")
            raw.preferred_shared_memory_carveout = int(CARVEOUT)

    def allow_shared(self, n: int) -> None:
        """Let launches use n bytes of dynamic shared memory. The limit belongs to the function, which every
        model and captured graph shares, so it only ever rises: a graph captured with a larger launch must
        not find it lowered by a smaller one since."""
        if n > self.smem_limit:
            self.raw.max_dynamic_shared_size_bytes = n
            self.smem_limit = n

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        if _pdl.status()[0] and _cupy().cuda.get_current_stream().ptr:
            _pdl.launch(self.raw, grid, block, args, shared_mem)
        else:
            self.raw(grid, block, args, shared_mem=shared_mem)


def qmv_options(qtype) -> tuple:
    """NVRTC options building only `qtype`'s kernels of qmatvec.cu (one small module per type)."""
    return (f"-DQMV_ONLY={int(Q(qtype))}",)


def qmv_split(qtype, n: int, k: int, integer: bool = False) -> int:
    """Warps sharing each row of W [n, k] in the qmv kernels (`ws`: 1, 2 or 4), from the matrix alone,
    so that a verify pass's rows equal one-token passes. A warp per row keeps few loads in flight when
    the rows are few (Qwen 1.5B's ffn_down: 1536 rows of 8960, ~12 warps per SM of an H100), so rows
    are split while there are under QMV_SPLIT_WARPS warps and every lane still gets a block of its
    own (llama.cpp's CUDA matvec has 4 warps share a row whatever its length; measure with
    scripts/bench_cuda_kernels.py). SHARPI_QMV_SPLIT=1|2|4 forces one value (benchmarks)."""
    if QMV_SPLIT:
        ws = int(QMV_SPLIT)
        if ws not in QMV_SPLITS:
            raise ValueError(f"SHARPI_QMV_SPLIT={QMV_SPLIT}: must be one of {', '.join(map(str, QMV_SPLITS))}")
        return ws
    per_iter = 32 * (INT_LANE_SPAN if integer else _LANE_SPAN)[Q(qtype)]  # weights of a row one warp iteration covers
    ws = 1
    while 2 * ws <= QMV_SPLITS[-1] and n * ws < QMV_SPLIT_WARPS and k >= per_iter * 2 * ws:
        ws *= 2
    return ws


def _on(stream):
    return stream if stream is not None else contextlib.nullcontext()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _i32(v) -> np.int32:
    return np.int32(v)


def _i64(v) -> np.int64:
    return np.int64(v)


def _f32(v) -> np.float32:
    return np.float32(v)


def _dev_int32(cp, a):
    """A device int32 vector from a cupy array, numpy array, sequence or int."""
    if isinstance(a, cp.ndarray):
        return cp.ascontiguousarray(a.reshape(-1), dtype=cp.int32)
    return cp.asarray(np.asarray(a, dtype=np.int32).reshape(-1))


def _rows2d(cp, x, n: int, what: str):
    """x [..., n] float32 with unit stride in the last dim -> (2-D view/copy, row stride in elements)."""
    if x.dtype != cp.float32:
        raise ValueError(f"{what} must be float32, got {x.dtype}")
    if x.ndim != 2:
        x = x.reshape(-1, n)
    if x.shape[1] != n:
        raise ValueError(f"{what}: last dimension {x.shape[1]} != {n}")
    if x.strides[1] != 4 or x.strides[0] % 4:
        x = cp.ascontiguousarray(x)
    return x, x.strides[0] // 4


# ---- quantized weights --------------------------------------------------------------------------

def row_bytes(qtype, k: int) -> int:
    bs, ts = gguf.GGML_QUANT_SIZES[Q(qtype)]
    if k % bs:
        raise ValueError(f"{Q(qtype).name}: K={k} is not a multiple of the block size {bs}")
    return k // bs * ts


def _weight_type(qtype, k: int):
    """The checked GGML type of a CUDA weight with rows of K values (here and in tests/cuda_fake.py)."""
    qtype = Q(qtype)
    if qtype not in SUPPORTED:
        raise ValueError(f"CUDA backend: unsupported weight type {qtype.name} "
                         f"(supported: {', '.join(sorted(t.name for t in SUPPORTED))})")
    if k % K_MULTIPLE[qtype]:
        raise ValueError(f"CUDA backend: {qtype.name} needs K % {K_MULTIPLE[qtype]} == 0 (K={k})")
    return qtype


def _check_weight_bytes(size: int, n: int, rb: int) -> None:
    if size != n * rb:
        raise ValueError(f"raw weight has {size} bytes, expected {n} rows x {rb}")


def _matmul_rows(x, out, n: int, k: int, name: str) -> int:
    """T of a matmul input x [T, K] (any array type), after checking x and a given out [T, N]."""
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"{name or 'weight'}: x must be [T, {k}], got {tuple(x.shape)}")
    T = x.shape[0]
    if out is not None and (out.dtype != np.float32 or tuple(out.shape) != (T, n) or not out.flags.c_contiguous):
        raise ValueError(f"out must be a contiguous float32 [{T}, {n}] array")
    return T


class WeightBase:
    """What a device weight and its CPU stand-in (tests/cuda_fake.py) share: the checked type and
    shape, the bytes it keeps (`data`, flat uint8), and wrapping a sharpi_core.quants.QWeight."""

    def _set_shape(self, qtype, n: int, k: int, name: str) -> None:
        self.name, self.qtype, self.n, self.k = name, _weight_type(qtype, k), int(n), int(k)
        self.row_bytes = row_bytes(self.qtype, k)

    def _keep(self, data) -> None:
        _check_weight_bytes(data.size, self.n, self.row_bytes)
        self.data = data

    @classmethod
    def from_qweight(cls, w, stream=None):
        """The weight of a sharpi_core.quants.QWeight (its raw GGUF blocks)."""
        return cls(w.raw, w.qtype, w.n, w.k, name=w.name, stream=stream)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class CudaQWeight(WeightBase):
    """A 2-D GGUF weight W [N, K] as raw blocks on the device, used as y = x @ W.T."""

    def __init__(self, raw, qtype, n: int, k: int, *, name: str = "", stream=None):
        cp = _cupy()
        self._set_shape(qtype, n, k, name)
        with _on(stream):
            if isinstance(raw, cp.ndarray):
                data = cp.ascontiguousarray(raw).view(cp.uint8).reshape(-1)
                if data.data.ptr % 16:
                    data = data.copy()
            else:
                data = cp.asarray(np.ascontiguousarray(raw).view(np.uint8).reshape(-1))
        self._keep(data)  # its own allocation: 256-byte aligned, as the kernels' vector loads need
        self._tname = TYPE_NAMES[self.qtype]
        self._opts = qmv_options(self.qtype)
        self.xq_kind = int_act_kind(self.qtype)  # the integer matvecs' activation rounding, or None
        self._mins = None  # Q8_1_S_TYPES: the blocks' mins, float32 [N, K/32], made by the first GEMM
        self.split = qmv_split(self.qtype, self.n, self.k, self.xq_kind is not None)  # the same for every batch size
        self._ahead = None  # `ahead`

    @property
    def ahead(self):
        """What its matvecs ask the L2 for besides their own rows: ahead_ranges' int64 device array of
        (address, bytes) pairs, or None (set by the model: the pass's next matrix)."""
        return self._ahead

    @ahead.setter
    def ahead(self, a) -> None:
        if a is not None and (a.dtype != np.int64 or a.ndim != 2 or a.shape[1] != 2 or not a.flags.c_contiguous):
            raise ValueError("ahead must be a contiguous int64 [n, 2] device array of (address, bytes) pairs")
        self._ahead = a

    def wants_xq(self, T: int) -> bool:
        """Whether a matmul of T rows reads q8 rows (matmul's xq): the integer matvecs' (T < GEMM_MIN_ROWS),
        and a Q4_1 / Q5_1 GEMM's (Q8_1's s, Q8_1_S_TYPES)."""
        return self.xq_kind is not None and T > 0 and (T < GEMM_MIN_ROWS or self.qtype in Q8_1_S_TYPES)

    def matmul(self, x, stream=None, out=None, bias=None, xq=None):
        """x float32 [T, K] (or [K]) -> x @ W.T (+ bias, a float32 [N] device array), float32 [T, N]
        (or [N]); the bias is added in the matvec's own launch. With the integer matvecs (wants_xq) x
        must be rounded as xq_kind says, and xq may give its q8 rows (uint8 [T, q8_row_bytes(K)], as
        quantize_act or a rounding kernel's q8 output writes them; else made here): then only xq is read."""
        cp = _cupy()
        with _on(stream):
            x = cp.asarray(x, dtype=cp.float32)
            squeeze = x.ndim == 1
            x = cp.ascontiguousarray(x.reshape(1, -1) if squeeze else x)
            if x.data.ptr % 16:  # the kernels load activations as float4
                x = x.copy()
            T = _matmul_rows(x, out, self.n, self.k, self.name)
            if out is None:
                out = cp.empty((T, self.n), dtype=cp.float32)
            if bias is not None and (bias.dtype != cp.float32 or bias.size != self.n or not bias.flags.c_contiguous):
                raise ValueError(f"bias must be a contiguous float32 [{self.n}] device array")
            if T >= GEMM_MIN_ROWS:
                self._gemm(cp, x, out)
                if self.wants_xq(T):
                    self._q8_1_s(cp, x, quantize_act(x, self.xq_kind) if xq is None else xq, out)
                if bias is not None:
                    add_bias(out, bias)
            else:
                if self.wants_xq(T):
                    if xq is None:
                        xq = quantize_act(x, self.xq_kind)
                    xq, _ = _q8_rows(cp, xq, T, self.k)
                else:
                    xq = None
                for t0 in range(0, T, MAX_BATCH):
                    self._matvec(x[t0:t0 + MAX_BATCH], out[t0:t0 + MAX_BATCH], bias,
                                 None if xq is None else xq[t0:t0 + MAX_BATCH])
        return out[0] if squeeze else out

    def _matvec(self, x, out, bias=None, xq=None) -> None:
        nq = x.shape[0]
        NQ, R = next(v for v in QMV_VARIANTS if v[0] >= nq)
        ws = self.split
        if ws not in QMV_SPLITS:
            raise ValueError(f"split must be one of {QMV_SPLITS}, got {ws}")
        if ws == 1 and NQ in QMV_TALL and (NQ > 1 or self.n >= QMV_TALL_ROWS):
            R = QMV_TALL[NQ]  # (R never changes a row's sums)
        fn = function("qmatvec", f"qmv{'i' if xq is not None else ''}_{self._tname}_q{NQ}_r{R}", self._opts)
        grid = (-(-self.n // (QMV_WARPS // ws * R)),)
        xs = (x, _i64(self.k)) if xq is None else (xq, _i64(xq.strides[0]))
        a = self._ahead
        ahead = (a, _i32(a.shape[0])) if a is not None else (_dummy(_cupy(), np.int64), _i32(0))
        fn(grid, (QMV_WARPS * 32,), (self.data, _i64(self.row_bytes), _i32(self.n), _i32(self.k),
                                     *xs, out, _i64(self.n), _i32(nq),
                                     _dummy(_cupy()) if bias is None else bias, _i32(bias is not None), _i32(ws),
                                     *ahead))

    def _gemm(self, cp, x, out) -> None:
        tile = max(256, GEMM_TILE_BYTES // (4 * self.k))
        for r0 in range(0, self.n, tile):
            r1 = min(self.n, r0 + tile)
            w = self.rows(cp.arange(r0, r1, dtype=cp.int32))
            out[:, r0:r1] = x @ w.T

    def _q8_1_s(self, cp, x, xq, out) -> None:
        """out += sum over blocks b of m_w[n, b] * (s[t, b] - sum of x[t, block b]): the GEMM of the
        dequantized Q4_1 / Q5_1 weight (d * q + m) took each block's sum of the (rounded) activations
        times its min, where ggml and the integer matvecs take Q8_1's s, that sum's f16 rounding (from
        the unrounded scale; the q8 rows xq carry it)."""
        T, nb = x.shape[0], self.k // 32
        xq, _ = _q8_rows(cp, xq, T, self.k)
        s = cp.ascontiguousarray(xq[:, self.k + 4 * nb:self.k + 8 * nb]).view(cp.float32)  # [T, nb]
        if self._mins is None:  # [N, nb]: each block's m (bytes 2-3 of its d | m | ... header), once
            blocks = self.data[:self.n * self.row_bytes].reshape(self.n, nb, self.row_bytes // nb)
            self._mins = cp.ascontiguousarray(blocks[:, :, 2:4]).view(cp.float16)[:, :, 0].astype(cp.float32)
        out += (s - x.reshape(T, nb, 32).sum(axis=2)) @ self._mins.T

    def rows(self, ids, stream=None, out=None):
        """Dequantized rows (embedding lookup): ids [n] -> float32 [n, K]."""
        cp = _cupy()
        with _on(stream):
            ids = _dev_int32(cp, ids)
            n = ids.size
            if out is None:
                out = cp.empty((n, self.k), dtype=cp.float32)
            elif (out.dtype != cp.float32 or tuple(out.shape) != (n, self.k) or not out.flags.c_contiguous
                  or out.data.ptr % 16):
                raise ValueError(f"out must be a contiguous, 16-byte aligned float32 [{n}, {self.k}] array")
            if n:
                fn = function("qmatvec", f"deq_rows_{self._tname}", self._opts)
                fn((n,), (128,), (self.data, _i64(self.row_bytes), ids, _i32(self.k), out, _i64(self.k)))
        return out

    def dequantize(self, stream=None):
        """The whole weight as float32 [N, K] (tests, debugging)."""
        cp = _cupy()
        with _on(stream):
            return self.rows(cp.arange(self.n, dtype=cp.int32))


# ---- decode helpers -------------------------------------------------------------------------------

def _dummy(cp, dtype=np.float32):
    """A one-element device array (float32, or `dtype`) for a kernel's unused pointer argument
    (allocated once per device and type, so that no call allocates: a CUDA graph's capture must not)."""
    key = (cp.cuda.Device().id, np.dtype(dtype).name)
    d = _dummies.get(key)
    if d is None:
        d = _dummies[key] = cp.zeros(1, dtype=dtype)
    return d


def _token_rows(cp, x, n: int, what: str):
    """x [T, nh, n] with its rows of n contiguous one after another within a token (any token stride)
    -> (x, token stride, nh); any other x is taken as 2-D rows of n (_rows2d), nh = 1."""
    if (x.ndim == 3 and x.dtype == cp.float32 and x.shape[2] == n and x.strides[2] == 4
            and x.strides[1] == 4 * n and x.strides[0] % 4 == 0):
        return x, x.strides[0] // 4, x.shape[1]
    x2, st = _rows2d(cp, x, n, what)
    return x2, st, 1


def _round_mode(kind, n: int) -> int:
    if kind not in ACT_ROUND:
        raise ValueError(f"unknown activation rounding {kind!r}")
    if kind in Q8_BLOCKS and n % Q8_BLOCKS[kind][0]:
        raise ValueError(f"{kind} rounding needs rows of a multiple of {Q8_BLOCKS[kind][0]} (got {n})")
    return ACT_ROUND[kind]


def int_act_kind(qtype) -> str | None:
    """The 8-bit activation kind the integer matvecs of a `qtype` weight read (its act_kind, when that is
    one of llama.cpp's 8-bit blocks and the type has integer kernels; None: the float matvecs)."""
    from ..quants import act_kind

    kind = act_kind(Q(qtype))
    return kind if DP4A and Q(qtype) in INT_LANE_SPAN and kind in Q8_BLOCKS else None


def q8_row_bytes(k: int) -> int:
    """Bytes of a q8 row of K activations (int8 codes [K] | float d [K/32] | 32-bit s [K/32]: a Q8_K row's
    int32 sums of codes, a Q8_0 / Q8_1 row's float Q8_1 s; cuda/ops.cu), rounded up to 16 so that rows one
    after another stay 16-byte aligned."""
    if k % 32:
        raise ValueError(f"q8 rows need a multiple of 32 values (got {k})")
    return -(-(k + 8 * (k // 32)) // 16) * 16


def _q8_rows(cp, q8, T: int, K: int):
    """(q8 rows, row stride in bytes) for a kernel's q8 output / input of T rows of K values; a dummy and
    stride 0 (none) for q8=None."""
    if q8 is None:
        return _dummy(cp, np.uint8), _i64(0)
    rb = q8_row_bytes(K)
    if (q8.dtype != cp.uint8 or q8.ndim != 2 or q8.shape[0] != T or q8.shape[1] < rb or q8.strides[1] != 1
            or q8.strides[0] % 16 or q8.data.ptr % 16):
        raise ValueError(f"q8 rows must be a uint8 [{T}, >= {rb}] array, 16-byte aligned rows")
    return q8, _i64(q8.strides[0])


def quantize_act(x, kind: str, out=None, stream=None):
    """The q8 rows (uint8 [T, q8_row_bytes(K)]) of x float32 [T, K] rounded through `kind`'s 8-bit blocks
    ('q8_32' / 'q8_k'): the codes and scales round_act's rounding gives (also those of x already rounded
    so; a q8_32 row's s, f16(amax / 127 * sum), may then move by an f16 ulp), what the integer matvecs read."""
    cp = _cupy()
    if kind not in Q8_BLOCKS:
        raise ValueError(f"quantize_act: {kind!r} is not an 8-bit activation kind")
    with _on(stream):
        K = x.shape[-1]
        x2, x_st = _rows2d(cp, x, K, "x")
        T = x2.shape[0]
        if out is None:
            out = cp.empty((T, q8_row_bytes(K)), dtype=cp.uint8)
        q8, q_st = _q8_rows(cp, out, T, K)
        block, f16_scale = Q8_BLOCKS[kind]
        if K % block:
            raise ValueError(f"{kind} rounding needs K % {block} == 0 (K={K})")
        warps = T * (K // block)
        if warps:
            function("ops", "act_round_q8")((-(-warps // 4),), (128,), (
                x2, _i64(x_st), _i32(T), _i32(K), _i32(block), _i32(f16_scale), _dummy(cp), _i64(0), q8, q_st))
    return out


def rms_norm(x, w=None, eps: float = 1e-6, out=None, add=None, rounding=None, q8=None, stream=None):
    """RMSNorm over the last dimension: x [..., n] -> same shape. w: None, [n], or [w_rows, n]
    (row r of x, flattened to 2-D, uses w[r % w_rows]: per-head q/k norms). out may be x.
    add (x's shape): first x += add in place (the residual add fused into the norm that follows it);
    x must then be writable in place. x [T, nh, n] may have any token stride (a column view of a fused
    projection): the kernel addresses rows as token * stride + head * n. rounding: an activation kind
    (round_act's): the output rounded as the next matmul's input, in the same launch; with an 8-bit kind,
    q8 (uint8 [T, >= q8_row_bytes(n)]) receives its q8 rows too (quantize_act's, for the integer matvecs)."""
    cp = _cupy()
    with _on(stream):
        n = x.shape[-1]
        rmode = _round_mode(rounding, n)
        if q8 is not None and rounding not in Q8_BLOCKS:
            raise ValueError("q8 rows come with an 8-bit rounding")
        x2, x_st, nh = _token_rows(cp, x, n, "x")
        if rmode and nh > 1:
            raise ValueError("rounding is for whole rows (nh == 1)")
        rows = x2.shape[0] * nh if nh > 1 else x2.shape[0]
        if w is None:
            wd, w_rows, has_w = _dummy(cp), 1, 0
        else:
            wd = cp.ascontiguousarray(cp.asarray(w, dtype=cp.float32)).reshape(-1, n)
            w_rows, has_w = wd.shape[0], 1
        if out is None:
            out = cp.empty(x.shape, dtype=cp.float32)
        elif out.dtype != cp.float32 or tuple(out.shape) != tuple(x.shape):
            raise ValueError(f"out must be float32 {tuple(x.shape)}")
        y2, y_st, y_nh = _token_rows(cp, out, n, "out")
        if y2.data.ptr != out.data.ptr or y_nh != nh:
            raise ValueError("out must be writable in place (unit stride in the last dimension)")
        if add is None:
            a2, a_st, has_a = _dummy(cp), 0, 0
        else:
            if tuple(add.shape) != tuple(x.shape):
                raise ValueError(f"add {tuple(add.shape)} must have x's shape {tuple(x.shape)}")
            if x2.data.ptr != x.data.ptr:
                raise ValueError("x must be writable in place to add to it")
            a2, a_st, a_nh = _token_rows(cp, add, n, "add")
            if a_nh != nh:
                raise ValueError("add must have x's layout")
            has_a = 1
        q8, q_st = _q8_rows(cp, q8, rows, n)
        if rows:
            threads = 256 if n >= 256 else max(32, -(-n // 32) * 32)
            function("ops", "rms_norm_f32")((rows,), (threads,), (
                x2, _i64(x_st), _i32(nh), a2, _i64(a_st), _i32(has_a), wd, _i32(w_rows), _i32(has_w),
                y2, _i64(y_st), _i32(n), _f32(eps), _i32(rmode), q8, q_st))
    return out


def _per_token(cp, x, what: str):
    """x [T, ...] float32 (a vector: one token) -> (2-D [T, values per token], row stride): a view where
    each token's values are contiguous, else a contiguous copy."""
    x2 = x.reshape(1, -1) if x.ndim == 1 else (x.reshape(x.shape[0], -1) if x.ndim > 2 else x)
    return _rows2d(cp, x2, x2.shape[1], what)


def _rows_inplace(cp, x, what: str):
    """x [T, ...] float32 to change in place, each token's values contiguous -> (2-D view, row stride)."""
    x2, st = _per_token(cp, x, what)
    if x2.data.ptr != x.data.ptr:
        raise ValueError(f"{what} must be writable in place (each token's values contiguous)")
    return x2, st


def add_bias(x, b, stream=None):
    """x [T, n] += b [n] in place (any row stride: e.g. a group of a fused projection's output)."""
    cp = _cupy()
    with _on(stream):
        x2, st = _rows_inplace(cp, x, "x")
        T, n = x2.shape
        bd = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32)).reshape(-1)
        if bd.size != n:
            raise ValueError(f"bias of {bd.size} values for rows of {n}")
        if T * n:
            function("ops", "add_bias_f32")((-(-(T * n) // 256),), (256,), (x2, _i64(st), _i32(T), _i32(n), bd))
    return x


def _elementwise(fn, x, *args, stream=None):
    """One of ops.cu's in-place element kernels fn(x, x_st, T, n, *args) over x [T, ...] (each token's
    values contiguous, any token stride)."""
    cp = _cupy()
    with _on(stream):
        x2, st = _rows_inplace(cp, x, "x")
        T, n = x2.shape
        if T * n:
            fn((-(-(T * n) // 256),), (256,), (x2, _i64(st), _i32(T), _i32(n), *args))
    return x


def scale(x, alpha: float, stream=None):
    """x [T, ...] *= alpha in place."""
    return _elementwise(function("ops", "scale_f32"), x, _f32(alpha), stream=stream)


def scale_rows(x, table, positions, stream=None):
    """x [T, ...] *= table[positions[t]] row by row, in place: table float32 [n_pos] on the device,
    positions (device or host) [T]."""
    cp = _cupy()
    with _on(stream):
        pos = _dev_int32(cp, positions)
        if table.dtype != cp.float32 or not table.flags.c_contiguous:
            raise ValueError("table must be a contiguous float32 array")
        if pos.size != x.shape[0]:
            raise ValueError(f"{pos.size} positions for {x.shape[0]} rows")
        if not isinstance(positions, cp.ndarray) and pos.size and int(np.max(positions)) >= table.size:
            raise ValueError("position beyond the table")
        return _elementwise(function("ops", "scale_rows_f32"), x, table, pos, stream=stream)


def softcap(x, cap: float, stream=None):
    """x [T, ...] = tanh(x * (1 / cap)) * cap in place (Gemma 2's final logit softcapping)."""
    return _elementwise(function("ops", "softcap_f32"), x, _f32(np.float32(1) / np.float32(cap)), _f32(cap), stream=stream)


def hadamard_scale(blk: int) -> np.float32:
    """1/sqrt(blk) rounded as kv_cache.rotate's float32 arithmetic rounds it."""
    return np.float32(1.0) / np.sqrt(np.float32(blk))


def hadamard(x, blk: int, out=None, stream=None):
    """kv_cache.rotate on the device, bit for bit: every chunk of blk values along the last dim of
    x [T, ...] (each token's values contiguous, any token stride) times H_blk -> a new array
    (or out, not overlapping x)."""
    cp = _cupy()
    if blk < 2 or blk & (blk - 1) or blk > 2048:
        raise ValueError(f"Hadamard block {blk} must be a power of two in 2..2048")
    with _on(stream):
        x2, x_st = _per_token(cp, x, "x")
        T, n = x2.shape
        if n % blk:
            raise ValueError(f"{n} values per token are not whole Hadamard blocks of {blk}")
        if out is None:
            out = cp.empty(x.shape, dtype=cp.float32)
        elif out.dtype != cp.float32 or out.shape != x.shape or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous float32 {tuple(x.shape)} array")
        if T * n:
            function("ops", "hadamard_f32")((T * (n // blk),), (max(1, blk // 2),), (
                x2, _i64(x_st), _i32(T), _i32(n), _i32(blk), hadamard_scale(blk), out, _i64(n)), shared_mem=4 * blk)
    return out


def _rope_shape(x, n_rot: int, n_pos: int) -> tuple[int, int, int]:
    """Checks rope's arguments (cupy or numpy x) -> (T, n_heads, head_dim)."""
    if x.dtype != np.float32 or x.ndim != 3:
        raise ValueError("x must be float32 [T, n_heads, head_dim]")
    T, nh, hd = x.shape
    if x.strides[2] != 4 or x.strides[1] != 4 * hd or x.strides[0] % 4:
        raise ValueError("x: heads must be contiguous within a token (strides [*, 4*hd, 4])")
    if n_rot % 2 or not 0 < n_rot <= hd:
        raise ValueError(f"n_rot={n_rot} must be even and within head_dim={hd}")
    if n_pos != T:
        raise ValueError(f"{n_pos} positions for {T} tokens")
    return T, nh, hd


def _rope_table(cp, table, n_rot: int, positions, T: int):
    """A rope table (complex [n_pos, n_rot/2] or float32 [..., 2] (cos, sin) pairs) as the kernels'
    flat float32 [p][i][cos, sin], after checking host positions against it."""
    cs = cp.ascontiguousarray(table)
    if cs.dtype.kind == "c":  # (cos, sin) pairs: keep both parts whatever the precision
        cs = cp.ascontiguousarray(cs.astype(cp.complex64, copy=False)).view(cp.float32)
    else:
        cs = cs.astype(cp.float32, copy=False)
    if not n_rot or n_rot % 2 or cs.size % n_rot:
        raise ValueError("rope table must hold n_rot/2 (cos, sin) pairs per position")
    if not isinstance(positions, cp.ndarray) and T and int(np.max(positions)) >= cs.size // n_rot:
        raise ValueError("position beyond the rope table")
    return cs


def _rope_args(cp, rope, positions, T: int, hd: int) -> tuple:
    """The (rcs, n_rot, neox) kernel arguments of a `rope=(table, n_rot, neox)` option (or None)."""
    if rope is None:
        return _dummy(cp), _i32(0), _i32(0)
    table, n_rot, neox = rope
    if not 0 < n_rot <= hd:
        raise ValueError(f"n_rot={n_rot} must lie in 1..{hd}")
    return _rope_table(cp, table, n_rot, positions, T), _i32(n_rot), _i32(1 if neox else 0)


def rope(x, positions, n_rot: int, neox: bool, theta_base: float = 10000.0, freq_scale: float = 1.0,
         freq_factors=None, table=None, stream=None):
    """Rotate x [T, n_heads, head_dim] (float32, heads contiguous) in place; returns x.

    neox=False: llama.cpp's NORM style (pairs 2i, 2i+1); True: NEOX (pairs i, i + n_rot/2). Only the
    first n_rot dims of each head turn. `table` (complex64 [n_pos, n_rot/2] or float32 [.., 2]) gives
    (cos, sin) per position and pair, e.g. the CPU path's ggml-exact table; otherwise the angle is
    pos * freq_scale * theta_base^(-2i/n_rot) / freq_factors[i]."""
    cp = _cupy()
    with _on(stream):
        pos = _dev_int32(cp, positions)
        T, nh, hd = _rope_shape(x, n_rot, pos.size)
        if table is not None:
            cs = _rope_table(cp, table, n_rot, positions, T)
            has_cs = 1
        else:
            cs, has_cs = _dummy(cp), 0
        if freq_factors is not None:
            ff, has_ff = cp.ascontiguousarray(cp.asarray(freq_factors, dtype=cp.float32)), 1
        else:
            ff, has_ff = _dummy(cp), 0
        total = T * nh * (n_rot // 2)
        if total:
            function("ops", "rope_f32")((-(-total // 256),), (256,), (
                x, _i64(x.strides[0] // 4), _i32(T), _i32(nh), _i32(hd), pos, _i32(n_rot), _i32(1 if neox else 0),
                cs, _i32(has_cs), _f32(theta_base), _f32(freq_scale), ff, _i32(has_ff)))
    return x


def glu(gate, up, act: str = "silu", out=None, rounding=None, q8=None, stream=None):
    """act(gate) * up for gate, up float32 [T, F] (row strides free: e.g. halves of a fused output).
    act: silu, gelu_tanh (= gelu), or gelu_tanh_f16 (through ggml's fp16 GELU table, like llama.cpp's CPU).
    rounding: an activation kind (round_act's): the output rounded as the next matmul's input (the 8-bit
    kinds in the same launch, with their q8 rows into q8 if given, as rms_norm)."""
    cp = _cupy()
    if q8 is not None and rounding not in Q8_BLOCKS:
        raise ValueError("q8 rows come with an 8-bit rounding")
    with _on(stream):
        F = gate.shape[-1]
        g2, g_st = _rows2d(cp, gate, F, "gate")
        u2, u_st = _rows2d(cp, up, F, "up")
        if g2.shape != u2.shape:
            raise ValueError(f"gate {tuple(g2.shape)} and up {tuple(u2.shape)} differ")
        T = g2.shape[0]
        if out is None:
            out = cp.empty((T, F), dtype=cp.float32)
        o2, o_st = _rows2d(cp, out, F, "out")
        if o2.data.ptr != out.data.ptr or o2.shape != g2.shape:
            raise ValueError(f"out must be a writable float32 [{T}, {F}] array with unit stride in the last dimension")
        a = ACTIVATIONS[act]
        _round_mode(rounding, F)
        if T * F and rounding in Q8_BLOCKS:
            block, f16_scale = Q8_BLOCKS[rounding]
            warps = T * (F // block)
            q8, q_st = _q8_rows(cp, q8, T, F)
            function("ops", "glu_q8_f32")((-(-warps // 4),), (128,), (
                g2, _i64(g_st), u2, _i64(u_st), o2, _i64(o_st), _i32(T), _i32(F), _i32(a), _i32(block),
                _i32(f16_scale), q8, q_st))
        elif T * F:
            function("ops", "glu_f32")((-(-(T * F) // 256),), (256,), (
                g2, _i64(g_st), u2, _i64(u_st), o2, _i64(o_st), _i32(T), _i32(F), _i32(a)))
            if rounding is not None:
                round_act(o2, rounding, out=o2)
    return out


def round_act(x, kind: str | None, out=None, q8=None, stream=None):
    """x float32 [T, K] as llama.cpp's CPU backend rounds activations before multiplying them by a
    weight of activation kind `kind` (sharpi_core.quants.act_kind): 'q8_32' / 'q8_k' through 8-bit
    blocks of 32 / 256 (kernel act_round_q8, the rules of quants.q8_parts), 'f16' / 'bf16' through
    those types, None unchanged. A new array unless `out` is given (out may be x). q8: with an 8-bit
    kind, the q8 rows too (quantize_act's), in the same launch."""
    cp = _cupy()
    if q8 is not None and kind not in Q8_BLOCKS:
        raise ValueError("q8 rows come with an 8-bit rounding")
    if kind is None:
        return x
    with _on(stream):
        K = x.shape[-1]
        x2, x_st = _rows2d(cp, x, K, "x")
        if out is None:
            out = cp.empty(x2.shape, dtype=cp.float32)
        o2, o_st = _rows2d(cp, out, K, "out")
        if o2.data.ptr != out.data.ptr:
            raise ValueError("out must be writable in place (unit stride in the last dimension)")
        if kind in ("f16", "bf16"):
            T = x2.shape[0]
            if T * K:
                function("ops", "round_half_f32")((-(-(T * K) // 256),), (256,), (
                    x2, _i64(x_st), _i32(T), _i32(K), _i32(kind == "bf16"), o2, _i64(o_st)))
        else:
            block, f16_scale = Q8_BLOCKS[kind]
            if K % block:
                raise ValueError(f"{kind} rounding needs K % {block} == 0 (K={K})")
            T = x2.shape[0]
            warps = T * (K // block)
            q8, q_st = _q8_rows(cp, q8, T, K)
            if warps:
                function("ops", "act_round_q8")((-(-warps // 4),), (128,), (
                    x2, _i64(x_st), _i32(T), _i32(K), _i32(block), _i32(f16_scale), o2, _i64(max(o_st, 1)),
                    q8, q_st))
    return out.reshape(x.shape) if out.shape != x.shape else out


def q8_0_row_bytes(d: int) -> int:
    if d % 32:
        raise ValueError(f"q8_0 needs a multiple of 32 values (got {d})")
    return d // 32 * 34


def new_kv_cache(capacity: int, n_kv_head: int, head_dim: int, kind: str = "f16", stream=None):
    """A zeroed cache for one layer's K or V: f16 [cap, n_kv, D] or q8_0 uint8 [cap, n_kv, D/32*34]."""
    cp = _cupy()
    if kind not in ("f16", "q8_0"):
        raise ValueError(f"unsupported CUDA KV cache type {kind!r} (f16, q8_0)")
    shape = (capacity, n_kv_head, head_dim) if kind == "f16" else (capacity, n_kv_head, q8_0_row_bytes(head_dim))
    try:
        with _on(stream):
            return cp.zeros(shape, dtype=cp.float16 if kind == "f16" else cp.uint8)
    except cp.cuda.memory.OutOfMemoryError:
        raise UsageError(f"the GPU has no room for a {kind} KV cache of {capacity} tokens: use a smaller context "
                         "size (or fewer layers on the GPU, -ngl)") from None


def _cache_kind(cache, n_kv: int, d: int | None, what: str) -> tuple[str, int]:
    """('f16'|'q8_0', head_dim) of a [cap, n_kv, D] f16 or [cap, n_kv, D/32*34] uint8 cache (a cupy
    or numpy array: tests/cuda_fake.py checks its arguments with this too)."""
    if cache.ndim != 3 or cache.shape[1] != n_kv:
        raise ValueError(f"{what} must be [capacity, {n_kv}, ...], got {tuple(cache.shape)}")
    if cache.strides[2] != cache.itemsize:
        raise ValueError(f"{what}: the last dimension must be contiguous")
    if cache.dtype == np.float16:
        kind, hd = "f16", cache.shape[2]
    elif cache.dtype == np.uint8:
        if cache.shape[2] % 34:
            raise ValueError(f"{what}: q8_0 rows must be whole 34-byte blocks")
        kind, hd = "q8_0", cache.shape[2] // 34 * 32
        ptr = cache.data.ptr if hasattr(cache.data, "ptr") else cache.ctypes.data
        if ptr % 2 or cache.strides[0] % 2 or cache.strides[1] % 2:
            raise ValueError(f"{what}: q8_0 blocks must be 2-byte aligned")
    else:
        raise ValueError(f"{what}: dtype {cache.dtype} is neither float16 nor uint8 (q8_0 blocks)")
    if d is not None and hd != d:
        raise ValueError(f"{what}: head dim {hd} != {d}")
    return kind, hd


def _attention_shapes(q, k_cache, v_cache, q_round, n_pos: int):
    """Checks attention's arguments (cupy or numpy arrays) -> (T, H, Dk, Hkv, K kind, V kind, Dv, q_round code)."""
    if q.dtype != np.float32 or q.ndim != 3:
        raise ValueError("q must be float32 [T, H, Dk]")
    T, H, Dk = q.shape
    Hkv = k_cache.shape[1]
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"n_head {H} is not a multiple of n_head_kv {Hkv}")
    kk, _ = _cache_kind(k_cache, Hkv, Dk, "k_cache")
    vk, Dv = _cache_kind(v_cache, Hkv, None, "v_cache")
    qr = Q_ROUND[q_round] if isinstance(q_round, str) else int(q_round)
    if qr == 2 and Dk % 32:
        raise ValueError("q_round='q8_0' needs head_dim % 32 == 0")
    if n_pos != T:
        raise ValueError(f"{n_pos} positions for {T} queries")
    return T, H, Dk, Hkv, kk, vk, Dv, qr


def kv_append(src, cache, positions, src2=None, cache2=None, rope=None, stream=None):
    """Write src float32 [T, n_kv, D] (or [T, n_kv*D]; token stride free) into cache rows `positions`
    (f16: rounded to nearest even; q8_0: ggml blocks, as gguf.quants.quantize); with src2 / cache2 (a
    layer's V beside its K), those too, in the same launch when both caches are of one kind.
    rope=(table, n_rot, neox): src's heads go in turned by RoPE at their positions, as `rope` with
    that table would turn them (src itself is left as it is; src2 is not turned)."""
    cp = _cupy()
    with _on(stream):
        pos = _dev_int32(cp, positions)
        sets = []
        for sr, ca in ((src, cache), (src2, cache2)) if cache2 is not None else ((src, cache),):
            n_kv = ca.shape[1]
            kind, D = _cache_kind(ca, n_kv, None, "cache")
            s2, s_st = _rows2d(cp, sr.reshape(sr.shape[0], -1) if sr.ndim == 3 else sr, n_kv * D, "src")
            if pos.size != s2.shape[0] or n_kv != cache.shape[1]:
                raise ValueError(f"{pos.size} positions for {s2.shape[0]} rows of {n_kv} heads")
            sets.append((kind, D, (s2, _i64(s_st), _i32(D), ca, _i64(ca.strides[0]), _i64(ca.strides[1]))))
        groups = [sets] if len(sets) == 1 or sets[0][0] == sets[1][0] else [[x] for x in sets]
        T, n_kv = pos.size, cache.shape[1]
        # RoPE turns set 0 of the first group (src), none of a second launch's (src2)
        rargs = [_rope_args(cp, rope if gi == 0 else None, positions, T, sets[0][1]) for gi in range(len(groups))]
        for gi, g in enumerate(groups):
            total = T * n_kv * max(D for _, D, _ in g)
            if total:
                # one set: set 1 unused (grid.y = 1)
                args = (_i32(T), _i32(n_kv), pos, *g[0][2], *g[-1][2], *rargs[gi])
                name = "kv_append_f16" if g[0][0] == "f16" else "kv_append_q8_0"
                function("ops", name)((-(-total // 256), len(g)), (256,), args)
    return cache


def _keys_seen(n_kv: int, window: int) -> int:
    """The most keys one query sees among n_kv cache rows (at least 1)."""
    return max(1, min(n_kv, window) if window > 0 else n_kv)


def attention_splits(n_kv: int, capacity: int, *, window: int = 0, p_round: bool = False,
                     chunk: int | None = None) -> tuple[int, int]:
    """(chunk, splits) of an attention call over n_kv rows of caches of `capacity` rows (see attention)."""
    maxlen = _keys_seen(n_kv, window)  # most keys any query of this pass sees
    if p_round:
        chunk = _ceil_div(maxlen, 32) * 32
    elif chunk is None:
        cap = _keys_seen(capacity, window)  # ... of any pass
        chunk = max(ATT_MIN_CHUNK, _ceil_div(_ceil_div(cap, ATT_MAX_SPLITS), 32) * 32)
    if chunk < 1:
        raise ValueError(f"chunk={chunk}")
    return chunk, _ceil_div(maxlen, chunk)


def attention_work(rows: int, n_head: int, head_dim_v: int, splits: int) -> tuple[int, int]:
    """Floats of the two work buffers of an attention call over `rows` query rows."""
    n = rows * n_head * splits
    return n * head_dim_v, n * 2


def attention(q, k_cache, v_cache, positions, n_kv: int, scale: float, *, window: int = 0,
              softcap: float = 0.0, q_round="f32", p_round: bool = False, chunk: int | None = None,
              out=None, work=None, rope=None, rounding=None, counters=None, q8=None, stream=None):
    """Attention of q float32 [T, H, Dk] (roped) over the first n_kv cache rows -> float32 [T, H, Dv].
    rope=(table, n_rot, neox): q is not roped yet, the kernel reads it through RoPE (as kv_append).
    rounding: an activation kind (round_act's): the output rounded as the next matmul's input, by the
    launch that combines the splits; with an 8-bit kind, q8 receives its q8 rows too (as rms_norm).
    counters: an int32 device array of zeros, n_head per query row at least, owned by one stream: the
    splits are then combined by the partials' launch itself (the last block of each group of heads that
    holds whole rounding blocks; one launch instead of two, the same bits), which leaves the counters at
    zero again; a row whose keys lie in one split is finished by that split's block, which then holds
    the heads of a rounding block (attention_heads_per_block), without partials or counters.

    Query t is at positions[t] and sees keys j <= positions[t] (j < n_kv), within `window` if > 0
    (masked when pos - j >= window, llama.cpp's standard SWA); query head h uses kv head
    h // (H // H_kv). Caches as made by `new_kv_cache` (f16 or q8_0, any of the four K/V mixes).
    q_round ('f32'|'f16'|'q8_0') rounds q the way llama.cpp's CPU backend does before the KQ
    product; p_round rounds the normalised probabilities to f16 before PV (CPU backend with an f16
    V cache) and forces a single split. Keys are split into chunks of `chunk` processed in parallel,
    then combined; the default depends on the cache's capacity, not on n_kv (at least ATT_MIN_CHUNK keys,
    at most ATT_MAX_SPLITS splits of a full cache), so that a query's splits, and so its result bit for
    bit, do not depend on how many other rows its pass holds (speculative verification relies on it).
    Rows go in groups of at most ATT_MAX_ROWS (grid.y's limit) and ATT_PARTIALS_BYTES of partials.
    work: (partial outputs, (max, sum) pairs), flat float32 device arrays of at least
    attention_work(rows, H, Dv, splits) floats each, for a call that must not allocate (a graph's
    capture). n_kv may be any count from the pass's end (start + T) up to the caches' capacity: keys
    past a query's position are never seen, so the result is the same bit for bit (only empty splits
    are added); a graph passes the capacity, so that its launches do not depend on the position."""
    cp = _cupy()
    with _on(stream):
        pos = _dev_int32(cp, positions)
        T, H, Dk, Hkv, kk, vk, Dv, qr = _attention_shapes(q, k_cache, v_cache, q_round, pos.size)
        if q.strides[2] != 4 or q.strides[1] != 4 * Dk or q.strides[0] % 4:
            q = cp.ascontiguousarray(q)
        if out is None:
            out = cp.empty((T, H, Dv), dtype=cp.float32)
        elif out.dtype != cp.float32 or tuple(out.shape) != (T, H, Dv) or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous float32 [{T}, {H}, {Dv}] array")
        if T == 0:
            return out
        if not 0 < n_kv <= min(k_cache.shape[0], v_cache.shape[0]):
            raise ValueError(f"n_kv={n_kv} outside the caches' 1..{min(k_cache.shape[0], v_cache.shape[0])} rows")
        rargs = _rope_args(cp, rope, positions, T, Dk)
        rmode = _round_mode(rounding, H * Dv)
        if q8 is not None and rounding not in Q8_BLOCKS:
            raise ValueError("q8 rows come with an 8-bit rounding")
        q8, q_st = _q8_rows(cp, q8, T, H * Dv)
        chunk, S = attention_splits(n_kv, min(k_cache.shape[0], v_cache.shape[0]), window=window,
                                    p_round=p_round, chunk=chunk)
        if p_round and S != 1:
            raise ValueError("p_round needs a single split")
        hpb = attention_heads_per_block(H, Dv, rounding, counters is not None, p_round)
        if hpb > 1 and attention_smem(Dk, chunk, Dv, hpb) > ATT_UNIT_SMEM:  # (splits of very many keys)
            hpb = 1
        smem = attention_smem(Dk, chunk, Dv, hpb)
        fn = function("ops", f"attn_partial_{kk}_{vk}")
        fn.allow_shared(smem)
        # each (row, head) is computed on its own, so grouping rows changes nothing in the results
        rows = max(1, min(T, ATT_MAX_ROWS, ATT_PARTIALS_BYTES // (H * S * (Dv + 2) * 4)))
        if work is None:
            op = cp.empty((rows * H * S, Dv), dtype=cp.float32)
            ml = cp.empty((rows * H * S, 2), dtype=cp.float32)
        else:
            need = attention_work(rows, H, Dv, S)
            op, ml = (w.reshape(-1) for w in work)
            if op.dtype != cp.float32 or ml.dtype != cp.float32 or op.size < need[0] or ml.size < need[1]:
                raise ValueError(f"attention work buffers must hold {need} float32 values")
            op, ml = op[:need[0]].reshape(-1, Dv), ml[:need[1]].reshape(-1, 2)
        if counters is not None and (counters.dtype != cp.int32 or counters.size < rows * H or (H * Dv) % 32):
            raise ValueError(f"counters must be an int32 device array of at least {rows * H} zeros "
                             f"(and H*Dv={H * Dv} a multiple of 32)")
        combine, combine_r = function("ops", "attn_combine"), function("ops", "attn_combine_r")
        for t0 in range(0, T, rows):
            n = min(rows, T - t0)
            qt = (q8[t0:], q_st) if q_st else (q8, q_st)  # this group's q8 rows
            fused = (counters, out[t0:], _i64(H * Dv), _i32(rmode), *qt) if counters is not None else (
                _dummy(cp, np.int32), _dummy(cp), _i64(0), _i32(-1), _dummy(cp, np.uint8), _i64(0))
            fn((H // hpb, n, S), (hpb * ATT_THREADS,), (
                q[t0:], _i64(q.strides[0] // 4), k_cache, _i64(k_cache.strides[0]), _i64(k_cache.strides[1]),
                v_cache, _i64(v_cache.strides[0]), _i64(v_cache.strides[1]), pos[t0:], _i32(n_kv), _i32(H),
                _i32(Hkv), _i32(Dk), _i32(Dv), _f32(scale), _f32(softcap), _i32(window), _i32(chunk), _i32(qr),
                _i32(1 if p_round else 0), op, ml, *rargs, *fused), shared_mem=smem)
            if counters is not None:
                continue
            splits = (pos[t0:], _i32(n_kv), _i32(window), _i32(chunk))  # which of a row's splits hold keys
            if rmode:
                block = Q8_BLOCKS["q8_k"][0] if rounding == "q8_k" else 32
                threads = n * (H * Dv // block) * 32
                combine_r((-(-threads // 256),), (256,), (op, ml, _i32(S), _i32(H), _i32(Dv), out[t0:],
                                                          _i64(H * Dv), _i32(n), _i32(rmode), *splits, *qt))
            else:
                combine((H, n), (128,), (op, ml, _i32(S), _i32(H), _i32(Dv), out[t0:], _i64(H * Dv), *splits))
    return out


# ---- greedy decoding on the device --------------------------------------------------------------

def _bias_arg(cp, bias, n: int) -> tuple:
    """(the device array, has_bias) of a logit bias float32 [n] or None."""
    if bias is None:
        return _dummy(cp), 0
    if bias.dtype != cp.float32 or bias.size != n or not bias.flags.c_contiguous:
        raise ValueError(f"bias must be a contiguous float32 [{n}] device array")
    return bias, 1


def _int32_out(cp, a, shape: tuple, what: str):
    """a (a new array if None), checked to be a contiguous int32 array of that shape."""
    if a is None:
        return cp.empty(shape, dtype=cp.int32)
    if a.dtype != cp.int32 or tuple(a.shape) != shape or not a.flags.c_contiguous:
        raise ValueError(f"{what} must be a contiguous int32 {list(shape)} array")
    return a


def argmax_splits(n: int) -> tuple[int, int]:
    """(chunk, splits) of a row of n values: one block per chunk, then one combining block per row."""
    S = max(1, min(ARGMAX_MAX_SPLITS, _ceil_div(n, ARGMAX_MIN_CHUNK)))
    chunk = _ceil_div(n, S)
    return chunk, _ceil_div(n, chunk)


def argmax(x, bias=None, out=None, work=None, stream=None):
    """Row-wise arg-max of x float32 [T, n] (+ bias float32 [n], e.g. a logit bias) -> int32 [T]:
    numpy.argmax's answer (lowest index on ties, the first NaN above everything). out: int32 [T] (a
    view of a longer array is fine: the next pass of a greedy chain reads its token from it); work:
    (float32, int32) flat device arrays of at least T * splits values, for a call that must not
    allocate (a graph's capture)."""
    cp = _cupy()
    with _on(stream):
        T, n = x.shape
        x2, x_st = _rows2d(cp, x, n, "x")
        chunk, S = argmax_splits(n)
        bd, has_b = _bias_arg(cp, bias, n)
        out = _int32_out(cp, out, (T,), "out")
        if work is None:
            pv, pi = cp.empty(T * S, dtype=cp.float32), cp.empty(T * S, dtype=cp.int32)
        else:
            pv, pi = (w.reshape(-1) for w in work)
            if pv.dtype != cp.float32 or pi.dtype != cp.int32 or pv.size < T * S or pi.size < T * S:
                raise ValueError(f"argmax work buffers must hold {T * S} float32 and int32 values")
        if T and n:
            function("ops", "argmax_part_f32")((S, T), (256,), (
                x2, _i64(x_st), _i32(n), bd, _i32(has_b), _i32(chunk), pv, pi))
            function("ops", "argmax_comb")((T,), (64,), (pv, pi, _i32(S), out))
    return out


# ---- sampling on the device (a draft model's proposals at temp > 0) -----------------------------------

def topk_splits(n: int, k: int) -> tuple[int, int] | None:
    """(chunk, splits) of a row of n values for a top-k of k on the device, or None where it cannot be
    done there (k outside 1..TOPK_MAX, or a row so long that its splits' k keys each exceed TOPK_SORT)."""
    if not 0 < k <= TOPK_MAX or n < 1:
        return None
    S = _ceil_div(n, TOPK_SORT)
    chunk = _ceil_div(n, S)
    S = _ceil_div(n, chunk)
    return (chunk, S) if S * k <= TOPK_SORT else None


def sample_out_width(k: int) -> int:
    """int32 values a row of sample_top_k's output takes: the token, k ids, k probabilities' bits."""
    return 1 + 2 * k


def sample_top_k(x, k: int, temp: float, top_p: float, min_p: float, min_keep: int, u, bias=None, out=None,
                 tok=None, work=None, stream=None):
    """A token drawn from each row of x float32 [T, n] (+ bias float32 [n]) by the default sampler chain,
    top-k (k <= TOPK_MAX) -> top-p -> min-p -> temperature, on the device: int32 [T, 1 + 2k] rows of the
    token's id (-1: the row has no distribution), the top k's ids (-1 past the row) and their
    probabilities (float32 bits; 0 where the chain cut them), the draw by the uniforms u float32 [T] in
    [0, 1). The law is the chain's as sampling._plain_candidates computes it, but in float32 (the probabilities
    as written are the law the token was drawn from, to float32 rounding: what a draft's q must be; see
    sample_law for the same on the host). tok: int32 [T], the ids (0 for -1), e.g. a chain's next input;
    work: a uint64 device array of T * splits * k keys, for a call that must not allocate."""
    cp = _cupy()
    with _on(stream):
        T, n = x.shape
        x2, x_st = _rows2d(cp, x, n, "x")
        sp = topk_splits(n, k)
        if sp is None:
            raise ValueError(f"a top-k of {k} over {n} values cannot be sampled on the device")
        chunk, S = sp
        bd, has_b = _bias_arg(cp, bias, n)
        if u.dtype != cp.float32 or u.size != T or not u.flags.c_contiguous:
            raise ValueError(f"u must be a contiguous float32 [{T}] device array")
        w = sample_out_width(k)
        out, tok = _int32_out(cp, out, (T, w), "out"), _int32_out(cp, tok, (T,), "tok")
        if work is None:
            keys = cp.empty(T * S * k, dtype=cp.uint64)
        else:
            keys = work.reshape(-1)
            if keys.dtype != cp.uint64 or keys.size < T * S * k:
                raise ValueError(f"sample work buffer must hold {T * S * k} uint64 values")
        if T and n:
            function("ops", "topk_part_f32")((S, T), (256,), (
                x2, _i64(x_st), _i32(n), bd, _i32(has_b), _i32(chunk), _i32(k), keys))
            function("ops", "topk_sample")((T,), (256,), (
                keys, _i32(S), _i32(k), _f32(temp), _f32(top_p), _f32(min_p), _i32(min_keep), u, out, _i64(w), tok))
    return out


def sample_law(row: np.ndarray, k: int, temp: float, top_p: float, min_p: float, min_keep: int,
               u: float) -> tuple[int, np.ndarray, np.ndarray]:
    """topk_sample's arithmetic on the host for one row float32 [n] (bias added): (token id or -1, the top k's
    ids [k] (-1 past the row), their float32 probabilities [k]). The kernel's float32 operations in its
    order (running sums as float32 cumsums), with the C library's expf / logf, as the emulator computes them
    (a GPU's math library may differ in a last bit)."""
    from ..libm import expf, logf
    f = np.float32
    x = np.asarray(row, dtype=f)
    x = np.where(x == 0, f(0), x)  # (-0 as +0)
    nan = np.flatnonzero(np.isnan(x))
    order = nan[:k] if nan.shape[0] else np.lexsort((np.arange(x.shape[0]), -x.astype(np.float64)))[:k]
    ids = np.full(k, -1, np.int64)
    ids[:order.shape[0]] = order
    p = np.zeros(k, f)
    vals = x[order]
    if nan.shape[0] or not vals.shape[0] or vals[0] == -np.inf:
        return -1, ids, p
    v0, m = vals[0], vals.shape[0]
    if v0 == np.inf:
        m = int(np.count_nonzero(vals == np.inf))
        p[:m] = f(1) / f(m)
    else:
        if top_p < 1.0 and m > 1:
            e = expf(vals - v0)
            reached = np.flatnonzero(np.cumsum(e / np.cumsum(e, dtype=f)[-1], dtype=f) >= f(top_p))
            if reached.shape[0]:
                m = max(int(reached[0]) + 1, min(min_keep, m))
        if min_p > 0.0 and m > 1:
            thr = f(v0 + logf(f(min_p)))
            m = max(1, min(m, max(min_keep, int(np.count_nonzero(vals[:m] >= thr)))))
        z = expf((vals[:m] - v0) / f(temp))
        p[:m] = z / np.cumsum(z, dtype=f)[-1]
    c = np.cumsum(p[:m], dtype=f)
    target = f(f(u) * c[-1])
    live = np.flatnonzero(p[:m] > 0)
    hit = live[c[live] > target]
    pick = int(hit[0]) if hit.shape[0] else int(live[-1])
    return int(ids[pick]), ids, p
