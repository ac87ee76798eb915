"""A CPU stand-in for sharpi_core.backends.cuda: the same public functions, numpy arrays for cupy ones.

It lets code written against the CUDA backend's API (the GPU model runner) run and be tested on a
machine without a GPU: pass it as the kernel module (`CudaTransformer(model, ops=cuda_fake)`) and
every "device" array becomes a numpy array.

What it reproduces, and what it does not:
  * Signatures, argument checks and error types follow the real module, so a call the GPU would
    reject is rejected here too (rope's, attention's and the caches' checks are the real module's
    own functions). Bounds the kernels do not check (row ids, cache positions) raise here.
  * The arithmetic follows the kernels' definitions in cuda/ops.cu, including the places where the
    kernel rounds (f16 / q8_0 KV caches, q_round, p_round), the order softcap and scale are applied
    in, and the masks. Summation order is numpy's/BLAS's, so results agree with the GPU to float32
    rounding, not bit for bit.
  * Weights are multiplied in float32 (sharpi's CPU kernels on fp32 activations, or their dequantization by
    gguf.quants, the reference, for a GEMM or where the kernels are missing); the GPU matvec uses fp32
    activations too, so no activation quantization happens on either side.
  * Batch invariance, which speculative verification relies on: like the GPU's matvec (T < 64) and
    attention kernels, every output row here is computed by the same operations in the same order
    whatever else is in the batch, so a row of a T-token pass equals a one-token pass bit for bit.
    From GEMM_MIN_ROWS rows on, matmul uses a GEMM, as the real one switches to cuBLAS.
  * Streams are accepted and ignored: everything runs synchronously. A "graph" (`capture`) is the
    captured function itself, run again at each launch (tests/simt's cupy records real launches).
"""
from __future__ import annotations

import gguf
import numpy as np
import torch

# Pure-Python parts of the real module (it imports cupy lazily, so this works without a GPU).
from sharpi_core.backends.cuda import (  # noqa: F401 (re-exported for code that reads them)
    ACT_GELU_F16,
    ACT_GELU_TANH,
    ACT_SILU,
    ACTIVATIONS,
    ATT_MAX_SPLITS,
    GEMM_MIN_ROWS,
    K_MULTIPLE,
    MAX_BATCH,
    Q8_BLOCKS,
    Q_ROUND,
    SUPPORTED,
    TOPK_MAX,
    TYPE_NAMES,
    WeightBase,
    _attention_shapes,
    _check_weight_bytes,
    _matmul_rows,
    _cache_kind,
    _rope_shape,
    _weight_type,
    ahead_pairs,
    attention_splits,
    attention_work,
    hadamard_scale,
    p_round_keys_within,
    q8_0_row_bytes,
    q8_row_bytes,
    row_bytes,
    sample_out_width,
    topk_splits,
)
from sharpi_core.kernels import cpu
from sharpi_core.quants import q8_0_blocks, q8_parts, quantize_q8_blocks

Q = gguf.GGMLQuantizationType
xp = np  # the array module "device" arrays come from


H200_SMEM_OPTIN = 232448  # bytes of opt-in shared memory per block


def p_round_max_keys(head_dim_k: int, head_dim_v: int) -> int:
    """As backends.cuda's, for an H200."""
    return p_round_keys_within(H200_SMEM_OPTIN, head_dim_k, head_dim_v)


def cuda_available() -> tuple[bool, str]:
    return True, "cuda_fake (numpy on the CPU)"


def to_host(a, stream=None) -> np.ndarray:
    """A copy, as the real device -> host transfer makes: a caller that keeps the result must not
    see later in-place writes to the "device" array (and cannot come to rely on seeing them)."""
    return np.array(a, copy=True)


class _HostCopy:
    def __init__(self, a):
        self._a = np.array(a, copy=True)  # all work is done by now: the copy sees what the stream would

    def get(self) -> np.ndarray:
        return self._a


def to_host_async(a, stream=None) -> _HostCopy:
    return _HostCopy(a)


def upload(dst, host: np.ndarray, stream=None) -> None:
    if dst.shape != host.shape:
        raise ValueError(f"upload of {host.shape} into {dst.shape}")
    dst[...] = host


def peak_bandwidth() -> float:
    """A nominal figure (bytes/s) for code that reports a fraction of peak; nothing is measured."""
    return 100e9


def ahead_ranges(arrays, budget: int | None = None):
    """The real module's (address, bytes) ranges of the arrays cut at `budget` (default: half of an H200's
    50 MiB L2), int64 [n, 2], or None."""
    pairs = ahead_pairs(arrays, lambda a: a.ctypes.data, (25 << 20) if budget is None else budget)
    return np.array(pairs, dtype=np.int64) if pairs else None


class _Stream:
    """Stands in for cupy.cuda.Stream: a context manager that changes nothing (all work is synchronous)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self) -> None:
        pass


def new_stream():
    return _Stream()


class _Graph:
    def __init__(self, fn):
        self._fn = fn

    def launch(self, stream=None) -> None:
        self._fn()


def capture(fn, stream):
    """As backends.cuda.capture: nothing runs now; each launch runs fn."""
    return _Graph(fn)


def _positions(positions) -> np.ndarray:
    """int, sequence or array -> int64 vector (the real module accepts all of them)."""
    return np.asarray(positions, dtype=np.int64).reshape(-1)


def _rows2d(x, n: int, what: str) -> np.ndarray:
    """x [..., n] float32 -> 2-D [rows, n] (a view where numpy can, else a copy), checked like the real one."""
    if x.dtype != np.float32:
        raise ValueError(f"{what} must be float32, got {x.dtype}")
    x2 = x if x.ndim == 2 else x.reshape(-1, n)
    if x2.shape[1] != n:
        raise ValueError(f"{what}: last dimension {x2.shape[1]} != {n}")
    return x2


def _check_writable_2d(out, n: int, what: str) -> np.ndarray:
    """The 2-D view of `out` that writes land in. The real module's kernels write through such a
    view; where it would be a temporary copy instead, the GPU result would be silently lost, so
    refuse it here."""
    o2 = _rows2d(out, n, what)
    if o2.size and (not np.shares_memory(o2, out) or o2.strides[1] != 4 or o2.strides[0] % 4):
        raise ValueError(f"{what} must be writable in place (unit stride in the last dimension)")
    return o2


# ---- quantized weights --------------------------------------------------------------------------

class CudaQWeight(WeightBase):
    """A 2-D GGUF weight W [N, K] kept as its raw blocks, used as y = x @ W.T.

    The float32 dequantization is built at first use and kept (a torch tensor, for torch's fast
    fp32 matvec / GEMM on the CPU). `rows` before that dequantizes only the rows it is asked for,
    so an embedding table that is only looked up never costs N x K floats."""

    def __init__(self, raw, qtype, n: int, k: int, *, name: str = "", stream=None):
        self._set_shape(qtype, n, k, name)
        # Any dtype / any contiguous slice of another weight's bytes: only the byte count matters.
        # No copy: a numpy input is already a "device" array, which the real module keeps as is too.
        self._keep(np.ascontiguousarray(raw).view(np.uint8).reshape(-1))
        self._dense: torch.Tensor | None = None
        self.xq_kind = None  # no integer matvecs here: fp32 activations, as the float kernels
        self.ahead = None  # (the real matvecs' L2 prefetches: nothing to do here)

    def wants_xq(self, T: int) -> bool:
        return False

    def _deq(self, blocks: np.ndarray) -> np.ndarray:
        """Raw rows uint8 [m, row_bytes] -> float32 [m, K] (gguf.quants, the reference)."""
        w = gguf.quants.dequantize(blocks, self.qtype)
        return np.ascontiguousarray(w, dtype=np.float32).reshape(blocks.shape[0], self.k)

    def _weights(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = torch.from_numpy(self._deq(self.data.reshape(self.n, self.row_bytes)))
        return self._dense

    def matmul(self, x, stream=None, out=None, bias=None, xq=None):
        """x float32 [T, K] (or [K]) -> x @ W.T (+ bias [N]), float32 [T, N] (or [N]) (xq: unused, as
        the real one's float matvecs)."""
        x = np.asarray(x, dtype=np.float32)
        squeeze = x.ndim == 1
        x = np.ascontiguousarray(x.reshape(1, -1) if squeeze else x)
        T = _matmul_rows(x, out, self.n, self.k, self.name)
        if out is None:
            out = np.empty((T, self.n), dtype=np.float32)
        xt, ot = torch.from_numpy(x), torch.from_numpy(out)
        if T >= GEMM_MIN_ROWS:
            torch.matmul(xt, self._weights().T, out=ot)
        elif cpu.available() and cpu.takes(self.qtype, self.k) and out.flags.c_contiguous:
            # sharpi's CPU kernels on fp32 activations (no rounding: mode 0): the dequantized weights times x
            # with one FMA chain per (row, token), so a row's result does not depend on the others; reading
            # the blocks, ~6x less memory than the fp32 copy
            cpu.qmatmul(xt, torch.from_numpy(self.data.reshape(self.n, self.row_bytes)), self.qtype, self.n,
                        self.k, out=ot)
        else:
            W = self._weights()
            # One matvec per row, each on a fresh (64-byte aligned) copy: MKL's result for a row
            # then depends on nothing but that row, as with the GPU's batched matvec.
            for t in range(T):
                torch.mv(W, xt[t].clone(), out=ot[t])
        if bias is not None:
            out += np.asarray(bias, dtype=np.float32).reshape(-1)
        return out[0] if squeeze else out

    def rows(self, ids, stream=None, out=None):
        """Dequantized rows (embedding lookup): ids [n] -> float32 [n, K]."""
        ids = _positions(ids)
        n = ids.size
        if out is None:
            out = np.empty((n, self.k), dtype=np.float32)
        elif out.dtype != np.float32 or tuple(out.shape) != (n, self.k) or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous, 16-byte aligned float32 [{n}, {self.k}] array")
        if n:
            # The kernel reads whatever lies at a bad row index; numpy would wrap negative ones.
            if ids.min() < 0 or ids.max() >= self.n:
                raise IndexError(f"{self.name or 'weight'}: row ids must lie in [0, {self.n})")
            if self._dense is not None:
                out[...] = self._dense.numpy()[ids]
            else:
                out[...] = self._deq(self.data.reshape(self.n, self.row_bytes)[ids])
        return out

    def dequantize(self, stream=None):
        """The whole weight as float32 [N, K] (a fresh array: writing to it leaves the weight alone)."""
        return self._weights().numpy().copy()


def quantize_act(x, kind, out=None, stream=None):
    """The reference for the q8 rows of x float32 [T, K] (cuda/ops.cu's layout: int8 codes [K] | float d
    [K/32] | s [K/32], a Q8_K scale repeated for its blocks of 32; s the int32 sums of the codes in a Q8_K
    row, Q8_1's float s in a Q8_0 / Q8_1 row) from quants.q8_parts."""
    if kind not in Q8_BLOCKS:
        raise ValueError(f"quantize_act: {kind!r} is not an 8-bit activation kind")
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    T, K = x2.shape
    block, f16_scale = Q8_BLOCKS[kind]
    if K % block:
        raise ValueError(f"{kind} rounding needs K % {block} == 0 (K={K})")
    q, d, s = q8_parts(torch.from_numpy(x2), block, f16_scale)  # [T, K/block, block], [T, K/block, 1] x 2
    codes = q.numpy().astype(np.int8).reshape(T, K)
    d32 = np.repeat(d.numpy().reshape(T, -1), block // 32, axis=1).astype(np.float32)
    sums = (s.numpy().astype(np.float32).reshape(T, K // 32) if f16_scale
            else codes.reshape(T, K // 32, 32).astype(np.int32).sum(axis=2, dtype=np.int32))
    if out is None:
        out = np.zeros((T, q8_row_bytes(K)), dtype=np.uint8)
    elif out.dtype != np.uint8 or out.ndim != 2 or out.shape[0] != T or out.shape[1] < q8_row_bytes(K):
        raise ValueError(f"q8 rows must be a uint8 [{T}, >= {q8_row_bytes(K)}] array")
    out[:, :K] = codes.view(np.uint8)
    out[:, K:K + 4 * (K // 32)] = d32.view(np.uint8)
    out[:, K + 4 * (K // 32):K + 8 * (K // 32)] = sums.view(np.uint8)
    return out


def round_act(x, kind, out=None, q8=None, stream=None):
    """The reference for the kernel act_round_q8 and its f16 / bf16 siblings: quants.round_activations
    (q8: the q8 rows too, quantize_act's)."""
    if q8 is not None:
        quantize_act(x, kind, out=q8)
    if kind is None:
        return x
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    if kind in ("q8_32", "q8_k"):
        block, f16_scale = (32, True) if kind == "q8_32" else (256, False)
        if x.shape[-1] % block:
            raise ValueError(f"{kind} rounding needs K % {block} == 0 (K={x.shape[-1]})")
        y = quantize_q8_blocks(xt, block, f16_scale)
    elif kind == "f16":
        y = xt.half().float()
    elif kind == "bf16":
        y = xt.bfloat16().float()
    else:
        raise ValueError(f"unknown activation kind {kind!r}")
    if out is None:
        return y.numpy()
    out[...] = y.numpy()
    return out


# ---- decode helpers -------------------------------------------------------------------------------

def rms_norm(x, w=None, eps: float = 1e-6, out=None, add=None, rounding=None, q8=None, stream=None):
    """RMSNorm over the last dimension: x [..., n] -> same shape. w: None, [n], or [w_rows, n]
    (row r of x, flattened to 2-D, uses w[r % w_rows]: per-head q/k norms). out may be x.
    add: first x += add in place (x must be writable in place). rounding: then round_act's."""
    n = x.shape[-1]
    if add is not None:
        if tuple(add.shape) != tuple(x.shape):
            raise ValueError(f"add {tuple(add.shape)} must have x's shape {tuple(x.shape)}")
        if not x.flags.writeable:
            raise ValueError("x must be writable in place to add to it")
        x += add
    x2 = _rows2d(x, n, "x")
    if out is None:
        out = np.empty(x.shape, dtype=np.float32)
    elif out.dtype != np.float32 or tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out must be float32 {tuple(x.shape)}")
    if not x2.shape[0]:
        return out
    # accumulated in float64 along each row on its own (numpy reduces rows independently)
    ms = np.square(x2, dtype=np.float64).sum(axis=1) / n
    scale = (np.float32(1.0) / np.sqrt(ms.astype(np.float32) + np.float32(eps)))[:, None]
    y = x2 * scale  # a new array: reading x before writing out, which may be x
    if w is not None:
        wd = np.asarray(w, dtype=np.float32).reshape(-1, n)
        y *= wd[np.arange(x2.shape[0]) % wd.shape[0]]
    out[...] = y.reshape(out.shape)  # into out itself (any view), as the kernel writes
    if rounding is not None:
        round_act(out, rounding, out=out, q8=q8)
    return out


def add_bias(x, b, stream=None):
    """x [T, n] += b [n] in place."""
    b = np.asarray(b, dtype=np.float32).reshape(-1)
    if b.size != x.shape[-1] or x.ndim != 2:
        raise ValueError(f"bias of {b.size} values for rows of shape {x.shape}")
    x += b
    return x


def scale(x, alpha: float, stream=None):
    """x *= alpha in place."""
    x *= np.float32(alpha)
    return x


def scale_rows(x, table, positions, stream=None):
    """x[t] *= table[positions[t]] in place."""
    f = np.asarray(table, dtype=np.float32)[np.asarray(positions, dtype=np.int64).reshape(-1)]
    x *= f.reshape((-1,) + (1,) * (x.ndim - 1))
    return x


def softcap(x, cap: float, stream=None):
    """x = tanh(x * (1 / cap)) * cap in place (float32 steps, as softcap_f32)."""
    x *= np.float32(1) / np.float32(cap)
    np.tanh(x, out=x)
    x *= np.float32(cap)
    return x


def hadamard(x, blk: int, out=None, stream=None):
    """kv_cache.rotate (the reference the kernel hadamard_f32 follows bit for bit)."""
    from sharpi_core.kv_cache import rotate  # noqa: PLC0415
    if blk < 2 or blk & (blk - 1):
        raise ValueError(f"Hadamard block {blk} must be a power of two")
    y = rotate(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), blk).numpy()
    if out is None:
        return y
    out[...] = y
    return out


def rope(x, positions, n_rot: int, neox: bool, theta_base: float = 10000.0, freq_scale: float = 1.0,
         freq_factors=None, table=None, stream=None):
    """Rotate x [T, n_heads, head_dim] (float32, heads contiguous) in place; returns x.

    neox=False: llama.cpp's NORM style (pairs 2i, 2i+1); True: NEOX (pairs i, i + n_rot/2). Only the
    first n_rot dims of each head turn. `table` (complex64 [n_pos, n_rot/2] or float32 [.., 2]) gives
    (cos, sin) per position and pair, e.g. the CPU path's ggml-exact table; otherwise the angle is
    pos * freq_scale * theta_base^(-2i/n_rot) / freq_factors[i]."""
    pos = _positions(positions)
    T, nh, hd = _rope_shape(x, n_rot, pos.size)
    half = n_rot // 2
    if not T or not nh:
        return x
    if table is not None:
        tab = np.asarray(table)
        # complex tables of any precision are (cos, sin) pairs, as the real module takes them
        cs = (np.ascontiguousarray(tab.astype(np.complex64, copy=False)).view(np.float32) if np.iscomplexobj(tab)
              else tab.astype(np.float32, copy=False))
        if cs.size % n_rot:
            raise ValueError("rope table must hold n_rot/2 (cos, sin) pairs per position")
        cs = cs.reshape(-1, half, 2)  # the kernel indexes the flattened table: [p][i][cos, sin]
        if pos.max() >= cs.shape[0] or pos.min() < 0:
            raise ValueError("position beyond the rope table")
        c, s = cs[pos, :, 0], cs[pos, :, 1]
    else:
        # float32 throughout, in the kernel's order: p * freq_scale * base^(-2i/n_rot) / ff[i]
        i = np.arange(half, dtype=np.float32)
        inv_freq = np.power(np.float32(theta_base), np.float32(-2.0) * i / np.float32(n_rot))
        theta = (pos.astype(np.float32)[:, None] * np.float32(freq_scale)) * inv_freq[None, :]
        if freq_factors is not None:
            theta = theta / np.asarray(freq_factors, dtype=np.float32).reshape(-1)[:half]
        c, s = np.cos(theta), np.sin(theta)
    c, s = c[:, None, :], s[:, None, :]  # broadcast over heads
    idx = np.arange(half)
    i0, i1 = (idx, idx + half) if neox else (2 * idx, 2 * idx + 1)
    a, b = x[:, :, i0], x[:, :, i1]  # fancy indexing copies: both read before either is written
    x[:, :, i0] = a * c - b * s
    x[:, :, i1] = a * s + b * c
    return x


def glu(gate, up, act: str = "silu", out=None, rounding=None, q8=None, stream=None):
    """act(gate) * up for gate, up float32 [T, F] (row strides free: e.g. halves of a fused output),
    then round_act's `rounding`."""
    F = gate.shape[-1]
    g2 = _rows2d(gate, F, "gate")
    u2 = _rows2d(up, F, "up")
    if g2.shape != u2.shape:
        raise ValueError(f"gate {tuple(g2.shape)} and up {tuple(u2.shape)} differ")
    T = g2.shape[0]
    if out is None:
        out = np.empty((T, F), dtype=np.float32)
    o2 = _check_writable_2d(out, F, "out")
    if o2.shape != g2.shape:
        raise ValueError(f"out {tuple(o2.shape)} does not match gate {tuple(g2.shape)}")
    a = ACTIVATIONS[act]
    if T * F:
        with np.errstate(over="ignore"):  # exp(-x) overflowing to inf gives silu's correct limit, -0
            if a == ACT_SILU:
                g = g2 / (np.float32(1.0) + np.exp(-g2))
            elif a == ACT_GELU_F16:
                xh = g2.astype(np.float16).astype(np.float32)
                inner = np.float32(0.044715) * xh * xh + np.float32(1.0)
                y = np.float32(0.5) * xh * (np.float32(1.0) + np.tanh(np.float32(0.7978845608028654) * xh * inner))
                g = np.where(g2 <= -10, np.float32(0.0),
                             np.where(g2 >= 10, g2, y.astype(np.float16).astype(np.float32)))
            else:
                g = np.float32(0.5) * g2 * (np.float32(1.0) + np.tanh(
                    np.float32(0.7978845608028654) * (g2 + np.float32(0.044715) * g2 * g2 * g2)))
        o2[...] = g * u2
        if rounding is not None:
            round_act(o2, rounding, out=o2, q8=q8)
    return out


def new_kv_cache(capacity: int, n_kv_head: int, head_dim: int, kind: str = "f16", stream=None):
    """A zeroed cache for one layer's K or V: f16 [cap, n_kv, D] or q8_0 uint8 [cap, n_kv, D/32*34]."""
    if kind == "f16":
        return np.zeros((capacity, n_kv_head, head_dim), dtype=np.float16)
    if kind == "q8_0":
        return np.zeros((capacity, n_kv_head, q8_0_row_bytes(head_dim)), dtype=np.uint8)
    raise ValueError(f"unsupported CUDA KV cache type {kind!r} (f16, q8_0)")


def _cache_f32(cache, kind: str, lo: int, hi: int) -> np.ndarray:
    """Cache rows lo..hi-1 as float32 [hi-lo, n_kv, D], the values the kernels read."""
    rows = cache[lo:hi]
    if kind == "f16":
        return rows.astype(np.float32)
    m, nkv, rb = rows.shape
    deq = gguf.quants.dequantize(np.ascontiguousarray(rows).reshape(m * nkv, rb), Q.Q8_0)
    return deq.reshape(m, nkv, rb // 34 * 32)


def _q8_0_round(x2: np.ndarray) -> np.ndarray:
    """float32 [m, D] through q8_0 blocks and back. The kernels' q8_0 (cache writes and q_round) is
    ggml's x86 quantize_row_q8_0, the CPU path's: codes rint(x * (127/amax)), fp16 d = amax/127."""
    return gguf.quants.dequantize(q8_0_blocks(x2).reshape(-1, q8_0_row_bytes(32)), Q.Q8_0).reshape(x2.shape)


def _roped(x, positions, rope):
    """A copy of x [T, nh, hd] turned by `rope` with the given (table, n_rot, neox)."""
    table, n_rot, neox = rope
    if not 0 < n_rot <= x.shape[-1]:
        raise ValueError(f"n_rot={n_rot} must lie in 1..{x.shape[-1]}")
    return rope_(np.array(x, dtype=np.float32), positions, n_rot, neox, table=table)


rope_ = rope  # the module's rope, for functions whose `rope` argument shadows it


def kv_append(src, cache, positions, src2=None, cache2=None, rope=None, stream=None):
    """Write src float32 [T, n_kv, D] (or [T, n_kv*D]; token stride free) into cache rows `positions`
    (f16: rounded to nearest even; q8_0: ggml's x86 blocks, quants.q8_0_blocks); src2 into cache2 too.
    rope=(table, n_rot, neox): src's heads turned first (src unchanged)."""
    if cache2 is not None:
        kv_append(src2, cache2, positions)
    n_kv = cache.shape[1]
    kind, D = _cache_kind(cache, n_kv, None, "cache")
    s2 = _rows2d(src.reshape(src.shape[0], -1) if src.ndim == 3 else src, n_kv * D, "src")
    if rope is not None:
        s2 = _roped(s2.reshape(-1, n_kv, D), positions, rope).reshape(-1, n_kv * D)
    T = s2.shape[0]
    pos = _positions(positions)
    if pos.size != T:
        raise ValueError(f"{pos.size} positions for {T} rows")
    if not T * n_kv * D:
        return cache
    if pos.min() < 0 or pos.max() >= cache.shape[0]:  # the kernel would write out of bounds
        raise IndexError(f"positions must lie in [0, {cache.shape[0]})")
    if kind == "f16":
        cache[pos] = s2.reshape(T, n_kv, D).astype(np.float16)  # numpy's cast rounds to nearest even
    else:
        cache[pos] = q8_0_blocks(s2.reshape(T, n_kv, D))
    return cache


def attention(q, k_cache, v_cache, positions, n_kv: int, scale: float, *, window: int = 0,
              softcap: float = 0.0, q_round="f32", p_round: bool = False, chunk: int | None = None,
              out=None, work=None, rope=None, rounding=None, counters=None, q8=None, stream=None):
    """Attention of q float32 [T, H, Dk] (roped) over the first n_kv cache rows -> float32 [T, H, Dv].
    rope=(table, n_rot, neox): q is turned first (a copy). rounding: the output then round_act's (q8: its
    q8 rows too).
    counters (the kernel's combine in the partials' launch) change nothing in the values: checked only.

    As cuda/ops.cu's attn_partial + attn_combine: query t at p = positions[t] sees keys
    max(0, p - window + 1) (window > 0) .. min(p, n_kv - 1); query head h reads kv head h // (H/Hkv);
    score = scale * (softcap > 0 ? softcap * tanh(q.k / softcap) : q.k) (softcap on the raw dot
    product, then the scale); a query that sees no key gets 0. q_round: 'f16' rounds q to fp16,
    'q8_0' through q8_0 blocks of 32. p_round: probabilities e_j * (1/sum e) rounded to fp16, and
    P V not renormalised. The key split (`chunk`) changes only float rounding, so it is checked
    and otherwise ignored, and so are the `work` buffers."""
    if counters is not None and (counters.dtype != np.int32 or counters.size < q.shape[0] * q.shape[1]
                                 or counters.any()):
        raise ValueError("counters must be an int32 array of zeros, n_head per query row at least")
    if rounding is not None:
        out = attention(q, k_cache, v_cache, positions, n_kv, scale, window=window, softcap=softcap,
                        q_round=q_round, p_round=p_round, chunk=chunk, out=out, rope=rope)
        T, H, Dv = out.shape
        round_act(out.reshape(T, H * Dv), rounding, out=out.reshape(T, H * Dv), q8=q8)
        return out
    pos = _positions(positions)
    T, H, Dk, Hkv, kk, vk, Dv, qr = _attention_shapes(q, k_cache, v_cache, q_round, pos.size)
    if rope is not None:
        q = _roped(q, positions, rope)
    if out is None:
        out = np.empty((T, H, Dv), dtype=np.float32)
    elif out.dtype != np.float32 or tuple(out.shape) != (T, H, Dv) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous float32 [{T}, {H}, {Dv}] array")
    if T == 0:
        return out
    if not p_round and chunk is not None and chunk < 1:  # a valid split changes only float rounding
        raise ValueError(f"chunk={chunk}")
    if n_kv > min(k_cache.shape[0], v_cache.shape[0]):  # the kernel would read past the caches
        raise ValueError(f"n_kv={n_kv} exceeds the cache capacity")

    # Visible keys per query, exactly the kernel's lo / hi.
    hi = np.minimum(pos, n_kv - 1)
    lo = np.maximum(0, pos - window + 1) if window > 0 else np.zeros_like(pos)
    out[...] = 0.0
    seen = lo <= hi
    if not seen.any():
        return out
    k0, k1 = int(lo[seen].min()), int(hi[seen].max()) + 1  # only these cache rows are ever read
    K = _cache_f32(k_cache, kk, k0, k1).transpose(1, 2, 0)  # [Hkv, Dk, L]
    V = _cache_f32(v_cache, vk, k0, k1).transpose(1, 0, 2)  # [Hkv, L, Dv]
    G = H // Hkv

    qf = np.ascontiguousarray(q, dtype=np.float32)
    if qr == 1:
        qf = qf.astype(np.float16).astype(np.float32)
    elif qr == 2:
        qf = _q8_0_round(qf.reshape(-1, Dk)).reshape(T, H, Dk)
    qf = qf.reshape(T, Hkv, G, Dk)  # head h = g * G + r reads kv head g

    # One query at a time over exactly its visible keys, each step on fresh contiguous copies: the
    # result for a query depends only on it and its keys (batch invariance, as the kernel's).
    sc_cap, sc_scale = np.float32(softcap), np.float32(scale)
    for t in np.flatnonzero(seen):
        a, b = int(lo[t]) - k0, int(hi[t]) + 1 - k0
        # products summed in float64, then rounded: the same fp32 scores whatever BLAS kernel this CPU gets
        s = np.matmul(qf[t].astype(np.float64), K[:, :, a:b].astype(np.float64)).astype(np.float32)  # [Hkv, G, n]
        if softcap > 0.0:
            s = sc_cap * np.tanh(s / sc_cap)
        s *= sc_scale
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        inv = np.float32(1.0) / e.sum(axis=-1, keepdims=True, dtype=np.float32)
        Vt = np.ascontiguousarray(V[:, a:b])  # [Hkv, n, Dv]
        if p_round:
            o = np.matmul((e * inv).astype(np.float16).astype(np.float64), Vt.astype(np.float64)).astype(np.float32)
        else:
            o = np.matmul(e.astype(np.float64), Vt.astype(np.float64)).astype(np.float32) * inv
        out[t] = o.reshape(H, Dv)
    return out


def argmax_splits(n: int) -> tuple[int, int]:
    return 1, 1


def argmax(x, bias=None, out=None, work=None, stream=None):
    """Row-wise numpy.argmax of x [T, n] (+ bias [n]) -> int32 [T], into out if given."""
    v = x if bias is None else x + bias
    ids = np.argmax(v, axis=-1).astype(np.int32)
    if out is None:
        return ids
    if out.dtype != np.int32 or out.shape != ids.shape:
        raise ValueError(f"out must be int32 {ids.shape}")
    out[...] = ids
    return out


def sample_top_k(x, k: int, temp: float, top_p: float, min_p: float, min_keep: int, u, bias=None, out=None,
                 tok=None, work=None, stream=None):
    """The real sample_top_k's rows ([token, k ids, k probabilities' bits]), by its host twin sample_law."""
    from sharpi_core.backends.cuda import sample_law
    T, n = x.shape
    if topk_splits(n, k) is None:
        raise ValueError(f"a top-k of {k} over {n} values cannot be sampled on the device")
    v = x if bias is None else x + bias
    rows = np.zeros((T, sample_out_width(k)), np.int32)
    for r in range(T):
        t, ids, p = sample_law(v[r], k, temp, top_p, min_p, min_keep, float(u[r]))
        rows[r, 0], rows[r, 1:k + 1], rows[r, k + 1:] = t, ids, p.view(np.int32)
    if out is None:
        out = rows
    else:
        out[...] = rows
    if tok is not None:
        tok[...] = np.maximum(rows[:, 0], 0)
    return out
