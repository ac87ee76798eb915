"""KV cache, allocated once per context: `length`, `truncate(n)`, nothing allocated per token.

Types follow llama.cpp's -ctk/-ctv names: f32, f16, bf16; q8_0 (blocks of 32 along head_dim with
one f16 scale each, round-to-nearest like ggml's x86 quantize_row_q8_0, codes and scales kept apart);
q4_0, q4_1, iq4_nl, q5_0, q5_1 as ggml's blocks of 32, byte for byte, written by the quantizers
llama.cpp's CPU backend uses for a cache row (quantize_row_*_ref; `quantize_blocks` here is their
transcription for machines without the C kernels) and read back by gguf's dequantization.

A quantized cache stores rotated vectors, as llama.cpp does (llama-kv-cache.cpp, attn_rot_k/v):
an orthonormal Walsh-Hadamard matrix spreads the few outlier dimensions of K (Qwen2's K has
dims two orders of magnitude above the rest) over whole blocks before 8-bit rounding. q and k
are both rotated (q.k is unchanged), by H_n with n the largest power of two >= 64 dividing the
head size; V by H_64 in chunks of 64, and the attention output is rotated back (H @ H = I).
Without it, q8_0 K costs Qwen2.5-0.5B +12% perplexity instead of llama.cpp's +0.8%.
SHARPI_KV_ROT=0 turns it off (llama.cpp: LLAMA_ATTN_ROT_DISABLE=1).
"""
from __future__ import annotations

import os

import gguf
import numpy as np
import torch

from .choices import CACHE_TYPES, QUANTIZED_CACHE_TYPES as QUANTIZED
from .errors import UsageError
from .kernels import cpu
from .quants import q8_parts
from .switches import switch

_QK8_0 = 32
Q = gguf.GGMLQuantizationType
BLOCK_BYTES = cpu.KV_BLOCK_BYTES  # the types held as ggml's blocks of 32: bytes per block
_ELEM_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, **{k: b / 32 for k, b in BLOCK_BYTES.items()}}
_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def quantize_blocks(kind: str, x: np.ndarray) -> np.ndarray:
    """x float32 [n, 32] -> [n, BLOCK_BYTES[kind]] uint8: ggml's reference quantizer of `kind` (what llama.cpp's
    CPU backend writes into such a cache), in float32 operation for operation (ggml-base is built without FMA, so
    no step is fused); the C kernel (cpu.kv_store) computes the same bytes. iq4_nl: quantize_row_iq4_nl_ref (one
    pass at d = max / -127 with weights x^2; a block below 1e-15 gets d = 0, its codes 0)."""
    f32 = np.float32
    x = np.ascontiguousarray(x, dtype=f32)
    n = x.shape[0]
    m = None
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if kind in ("q4_1", "q5_1"):
            lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
            top = 15 if kind == "q4_1" else 31
            d = (hi - lo) / f32(top)
            inv = np.where(d != 0, f32(1) / d, f32(0)).astype(f32)
            L = np.minimum(np.trunc((x - lo) * inv + f32(0.5)), top).astype(np.uint8)
            m = lo
        else:
            amax_at = np.abs(x).argmax(axis=1)[:, None]  # the first largest |x|, as ggml's strict comparison
            mx = np.take_along_axis(x, amax_at, axis=1)
            if kind == "iq4_nl":
                inv = f32(1) / (mx / _IQ4NL[0])
                al = inv * x
                hi_i = np.clip(np.searchsorted(_IQ4NL, al, side="right"), 1, 15)  # _IQ4NL[hi_i - 1] <= al < [hi_i]
                L = np.where(al - _IQ4NL[hi_i - 1] < _IQ4NL[hi_i] - al, hi_i - 1, hi_i)
                L = np.where(al <= _IQ4NL[0], 0, np.where(al >= _IQ4NL[15], 15, L)).astype(np.uint8)
                q, w = _IQ4NL[L], x * x
                sumqx, sumq2 = np.zeros((n, 1), f32), np.zeros((n, 1), f32)
                for j in range(32):  # summed in element order, as the C loop
                    sumqx = sumqx + w[:, j:j + 1] * q[:, j:j + 1] * x[:, j:j + 1]
                    sumq2 = sumq2 + w[:, j:j + 1] * q[:, j:j + 1] * q[:, j:j + 1]
                d = np.where(sumq2 > 0, sumqx / sumq2, f32(0)).astype(f32)
                small = np.abs(mx) < f32(1e-15)
                d, L = np.where(small, f32(0), d), np.where(small, 0, L).astype(np.uint8)
            else:
                half = 8 if kind == "q4_0" else 16
                d = mx / f32(-half)
                inv = np.where(d != 0, f32(1) / d, f32(0)).astype(f32)
                L = np.minimum(np.trunc(x * inv + f32(half + 0.5)), 2 * half - 1).astype(np.uint8)
    parts = [d.astype(np.float16).view(np.uint8)]
    if m is not None:
        parts.append(m.astype(np.float16).view(np.uint8))
    if kind in ("q5_0", "q5_1"):
        qh = ((L >> 4).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=1).astype(np.uint32)
        parts.append(qh[:, None].view(np.uint8))
    parts.append((L[:, :16] & 15) | ((L[:, 16:] & 15) << 4))
    return np.concatenate(parts, axis=1)


def _physical_memory() -> float:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX sysconf: let the allocator decide
        return float("inf")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def memory_left() -> float:
    """Bytes this process can still fill: Linux's MemAvailable (free memory and the page cache it can drop: a
    model's mapped file among it) plus free swap, within a cgroup v2 memory.max (less what the cgroup uses, its page
    cache not counted: a model file just read fills it, and it is dropped first); elsewhere the physical memory.
    (What the model and the caches already allocated, zeroed, is gone from it.)"""
    info = _read("/proc/meminfo")
    fields = dict(ln.split(":", 1) for ln in info.splitlines() if ":" in ln) if info else {}
    try:
        left = (int(fields["MemAvailable"].split()[0]) + int(fields.get("SwapFree", "0 kB").split()[0])) * 1024
    except (KeyError, ValueError, IndexError):
        return _physical_memory()
    limit, used = _read("/sys/fs/cgroup/memory.max"), _read("/sys/fs/cgroup/memory.current")
    if limit and used and limit.strip().isdigit() and used.strip().isdigit():
        stat = dict(ln.split(None, 1) for ln in (_read("/sys/fs/cgroup/memory.stat") or "").splitlines() if " " in ln)
        cache = int(stat["file"]) if stat.get("file", "").strip().isdigit() else 0
        left = min(left, int(limit) - int(used) + cache)
    return left


class _Store:
    """One tensor kind (K or V) for all layers: [n_layer, capacity, n_kv_head, head_dim]."""

    @staticmethod
    def n_bytes(kind: str, n_layer: int, capacity: int, n_kv: int, hd: int) -> int:
        """The store's size; a type that is none of llama.cpp's cache types, or that the head size does not
        take, is refused."""
        if kind not in CACHE_TYPES:
            raise UsageError(f"unsupported KV cache type '{kind}' (choose from {', '.join(CACHE_TYPES)})")
        if kind in QUANTIZED and hd % _QK8_0:
            raise UsageError(f"KV cache type {kind} needs a head size divisible by 32 (model has {hd})")
        return n_layer * capacity * n_kv * hd * _ELEM_BYTES[kind]

    def __init__(self, kind: str, n_layer: int, capacity: int, n_kv: int, hd: int):
        """Allocated and zeroed at once (KVCache checks first that memory is left for it)."""
        self.n_bytes(kind, n_layer, capacity, n_kv, hd)
        self.kind, self.hd = kind, hd
        self.qtype = Q[kind.upper()]
        shape = (n_layer, capacity, n_kv, hd)
        if kind == "q8_0":
            self.q = torch.zeros(shape, dtype=torch.int8)
            self.d = torch.zeros((n_layer, capacity, n_kv, hd // _QK8_0, 1), dtype=torch.float16)
        elif kind in BLOCK_BYTES:  # [n_layer, capacity, n_kv, bytes of hd / 32 blocks]
            self.q = torch.zeros((*shape[:3], hd // _QK8_0 * BLOCK_BYTES[kind]), dtype=torch.uint8)
        else:
            self.q = torch.zeros(shape, dtype={"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[kind])

    def write(self, layer: int, start: int, x: torch.Tensor) -> None:
        # x [T, n_kv, hd] fp32
        end = start + x.shape[0]
        if self.kind in BLOCK_BYTES:
            dst = self.q[layer, start:end]
            if x.dtype is torch.float32 and cpu.available():
                cpu.kv_store(self.kind, x, dst)
            else:
                dst.copy_(torch.from_numpy(quantize_blocks(self.kind, x.float().reshape(-1, 32).numpy())).view(dst.shape))
            return
        if self.kind != "q8_0":
            self.q[layer, start:end] = x
            return
        # ggml's x86 quantize_row_q8_0 (codes round(x * (127 / amax)), scale fp16(amax / 127))
        if x.dtype is torch.float32 and cpu.available():
            cpu.store_q8_0(x, self.q[layer, start:end], self.d[layer, start:end])  # the same bytes, one call
            return
        q, d, _ = q8_parts(x, _QK8_0, True)  # [T, n_kv, nb, 32], [T, n_kv, nb, 1]
        self.q[layer, start:end] = q.to(torch.int8).reshape(x.shape)
        self.d[layer, start:end] = d.to(torch.float16)

    def read(self, layer: int, end: int, start: int = 0) -> torch.Tensor:
        # -> [end - start, n_kv, hd] fp32
        q = self.q[layer, start:end]
        if self.kind in BLOCK_BYTES:  # ggml's dequantize_row_* (numpy float32, no fused step either)
            return torch.from_numpy(gguf.quants.dequantize(q.numpy(), self.qtype)).view(*q.shape[:2], self.hd)
        if self.kind != "q8_0":
            return q.float()
        shp = q.shape
        return (q.reshape(shp[0], shp[1], -1, _QK8_0).float() * self.d[layer, start:end].float()).reshape(shp)

    def move(self, layer: int, start: int, end: int, to: int) -> None:
        """Positions [start, end) to [to, to + end - start), bytes unchanged (the ranges may overlap)."""
        for a in (self.q, self.d) if self.kind == "q8_0" else (self.q,):
            a[layer, to:to + end - start] = a[layer, start:end].clone()


def _rotation(kind: str, hd: int, largest: bool) -> int | None:
    """Rotation size under llama.cpp's rule (None = no rotation): quantized cache and head size a
    multiple of 64; K uses the largest power of two dividing the head size, V always 64."""
    if kind not in QUANTIZED or hd % 64 or not switch("SHARPI_KV_ROT"):
        return None
    n = 64
    while largest and hd % (2 * n) == 0:
        n *= 2
    return n


def rotate(x: torch.Tensor, n: int | None) -> torch.Tensor:
    """x [..., d]: every chunk of n along the last dim times the orthonormal Hadamard matrix H_n.

    A fast Walsh-Hadamard transform in ggml's order (scale by 1/sqrt(n) first, then butterflies
    of width 1, 2, 4, ...): elementwise ops only, so each row's bits do not depend on how many rows
    are in the pass (a speculative verify reproduces single-token decoding). H_n is symmetric and
    H_n @ H_n = I, so the same call rotates back. The C kernel does the same arithmetic in one call
    (cpu.hadamard, tested bit-equal to rotate_torch)."""
    if n is None:
        return x
    if x.dtype is torch.float32 and x.is_cpu and cpu.available():
        return cpu.hadamard(x.clone(memory_format=torch.contiguous_format), n)
    return rotate_torch(x, n)


def rotate_torch(x: torch.Tensor, n: int) -> torch.Tensor:
    """rotate's arithmetic in torch ops (the reference, and the path without the C kernels)."""
    scale = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(n), dtype=torch.float32).sqrt()
    y = x.reshape(-1, n) * scale
    w = 1
    while w < n:
        y = y.view(-1, n // (2 * w), 2, w)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        w *= 2
    return y.reshape(x.shape)


class CacheBase:
    """What every KV cache (this one, the CUDA backend's) keeps besides its arrays: capacity, the
    number of positions held, the cache types and their rotations, and truncate."""

    def __init__(self, capacity: int, head_dim_k: int, head_dim_v: int, type_k: str, type_v: str):
        self.capacity = capacity
        self.length = 0
        self.type_k, self.type_v = type_k, type_v
        self.rot_k = _rotation(type_k, head_dim_k, largest=True)   # size of the rotation of q and k
        self.rot_v = _rotation(type_v, head_dim_v, largest=False)  # of v, and back on the output
        # the RoPE factors K was turned with where the context size picks them (phi3's "long" / "short": the
        # model's new_cache sets it; None elsewhere): a prompt cache compares it
        self.rope_factors: str | None = None

    def reach(self, n: int) -> int:
        """Where truncate can cut for a cache that should hold the first n positions: n (a HybridCache
        may have to go back to 0)."""
        return n

    def keep_states(self, n: int) -> None:
        """Keep what truncate needs to cut up to n positions back after the next pass (a HybridCache's recurrent
        states; attention's K / V stay anyway): a verify pass of n rows, a draft's k + 1."""

    def truncate(self, n: int) -> None:
        """Forget every position >= n (rollback after rejected drafts, or a changed prompt): attention
        reads positions below the pass's end only, and the next pass overwrites the ones it needs."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate({n}) outside 0..{self.length}")
        self.length = n

    def check_shift(self, n_keep: int, n_discard: int) -> None:
        if not (0 <= n_keep and 0 < n_discard and n_keep + n_discard <= self.length):
            raise ValueError(f"shift(keep {n_keep}, discard {n_discard}) outside 0..{self.length}")


class KVCache(CacheBase):
    def __init__(self, n_layer: int, capacity: int, n_kv_head: int, head_dim_k: int, head_dim_v: int,
                 type_k: str = "f16", type_v: str = "f16"):
        super().__init__(capacity, head_dim_k, head_dim_v, type_k, type_v)
        need = (_Store.n_bytes(type_k, n_layer, capacity, n_kv_head, head_dim_k)
                + _Store.n_bytes(type_v, n_layer, capacity, n_kv_head, head_dim_v))
        left = memory_left()
        kinds = type_k if type_k == type_v else f"{type_k} K, {type_v} V"
        too_big = UsageError(f"cannot allocate {need / 1e9:.1f} GB of KV cache ({kinds}) for a context of {capacity} "
                             f"tokens ({left / 1e9:.1f} GB of memory left): use a smaller context size")
        # K and V together, against what is left now (a target's cache, allocated first, is gone from it for its
        # draft's): with memory overcommit an allocation past it would succeed and zeroing it would bring the OOM
        # killer instead of an error
        if need > left:
            raise too_big
        try:
            self.k = _Store(type_k, n_layer, capacity, n_kv_head, head_dim_k)
            self.v = _Store(type_v, n_layer, capacity, n_kv_head, head_dim_v)
        except (RuntimeError, MemoryError):  # torch: "DefaultCPUAllocator: can't allocate memory: ..."
            raise too_big from None

    def shift(self, n_keep: int, n_discard: int, shift_k) -> None:
        """Context shift: drop positions [n_keep, n_keep + n_discard) and move the later ones down by
        n_discard. V moves as it is; K was rotated for its old position, so each layer's K rows pass
        through shift_k(layer, k [n, n_kv, hd] fp32, as stored) -> K for the new positions, then are
        stored again in the cache's type (llama.cpp's K-shift: f16 rounded once more, quantized types requantized)."""
        self.check_shift(n_keep, n_discard)
        src, end = n_keep + n_discard, self.length
        for layer in range(self.k.q.shape[0]):
            self.k.write(layer, n_keep, shift_k(layer, self.k.read(layer, end, src)))
            self.v.move(layer, src, end, n_keep)
        self.length = end - n_discard

    def arrays(self, n: int) -> dict[str, torch.Tensor]:
        """The arrays at positions [0, n) (views [n_layer, n, ...]), by name: what a prompt cache file keeps."""
        out = {}
        for name, s in (("k", self.k), ("v", self.v)):
            out[name] = s.q[:, :n]
            if s.kind == "q8_0":
                out[name + "_scale"] = s.d[:, :n]
        return out

    def put_arrays(self, arrays: dict[str, torch.Tensor], n: int) -> None:
        """Positions [0, n) from arrays as arrays() gives them; the cache then holds n positions."""
        for name, a in self.arrays(n).items():
            a.copy_(arrays[name])
        self.length = n

    @property
    def nbytes(self) -> int:
        total = 0
        for s in (self.k, self.v):
            total += s.q.numel() * s.q.element_size()
            if s.kind == "q8_0":
                total += s.d.numel() * s.d.element_size()
        return total


# how far back a short-convolution layer's state can be taken (speculative verify rollbacks, a token
# evaluated again): its ring keeps the rows of that many positions beyond the state itself
CONV_ROLLBACK = 64
PROMPT_CACHE_RECURRENT = ("--prompt-cache: not for models with recurrent layers (lfm2, qwen35: their state is not "
                          "kept for every position)")


class HybridCache(KVCache):
    """The cache of a model with recurrent layers (lfm2's short convolutions, qwen35's Gated DeltaNet): K and V of
    its attention layers as KVCache keeps them (cache layer j = the model's j-th attention layer), and per recurrent
    layer the convolution's input rows of the last positions in a ring (position p in slot p % ring), from which
    the state before any of the last CONV_ROLLBACK positions (its width - 1 rows) is read; qwen35's layers also
    keep their DeltaNet state [Hv, S, S] after each of the last few positions (the state after n tokens in slot
    n % R; keep_states(n) makes R > n, 1 by default: speculation asks for more). truncate(n) works back that far
    (and to 0); reach(n) says where a cut at n can go. Like llama.cpp's recurrent memory, which keeps a few states
    back for speculative rollbacks and otherwise evaluates a changed prompt again."""

    recurrent = True

    def __init__(self, n_attn: int, capacity: int, n_kv_head: int, head_dim_k: int, head_dim_v: int,
                 type_k: str, type_v: str, n_conv: int, d_model: int, width: int, ssm: tuple | None = None):
        super().__init__(n_attn, capacity, n_kv_head, head_dim_k, head_dim_v, type_k, type_v)
        self.d = width - 1  # state rows
        self.ring = CONV_ROLLBACK + self.d
        self.conv = torch.zeros(n_conv, self.ring, d_model)  # [n_conv, ring, D] fp32, as ggml's conv states
        self.lo = 0  # the first position whose row the ring still holds
        # (qwen35) [n_conv, R, Hv, S, S] fp32: the DeltaNet states, from position ssm_lo on
        self.ssm = torch.zeros(n_conv, 2, ssm[0], ssm[1], ssm[1]) if ssm else None
        self.ssm_lo = 0

    def reach(self, n: int) -> int:
        """n, or 0 when the state at position n is no longer kept."""
        ok = max(0, n - self.d) >= self.lo and (self.ssm is None or n >= self.ssm_lo)
        return n if ok else 0

    def truncate(self, n: int) -> None:
        if n != self.reach(n):
            raise ValueError(f"truncate({n}): the recurrent state there is gone (positions >= "
                             f"{max(self.lo + self.d, self.ssm_lo)} are kept)")
        super().truncate(n)
        if n == 0:
            self.lo = self.ssm_lo = 0

    def keep_states(self, n: int) -> None:
        """From now on keep the DeltaNet states of the last n positions too (truncate(length - n) stays possible)."""
        if self.ssm is None or self.ssm.shape[1] > n:
            return
        old, R, L = self.ssm, n + 1, self.length
        self.ssm = torch.zeros(old.shape[0], R, *old.shape[2:])
        for p in range(max(self.ssm_lo, L - old.shape[1] + 1), L + 1):
            self.ssm[:, p % R] = old[:, p % old.shape[1]]
        self.ssm_lo = max(self.ssm_lo, L - old.shape[1] + 1)

    def ssm_pass(self, start: int, T: int) -> int:
        """Once per pass of T positions from start: the ring slot of the DeltaNet states before it (zeros at
        position 0); the pass writes the next T slots."""
        R = self.ssm.shape[1]
        if start == 0:
            self.ssm[:, 0].zero_()
        self.ssm_lo = max(self.ssm_lo, start + T - R + 1)
        return start % R

    def conv_slots(self, start: int, T: int) -> tuple[torch.Tensor, int, torch.Tensor, int]:
        """Once per pass of T positions from start, for conv_fill: (the ring slots of the state's rows before
        it, how many of those rows are before position 0 (zeros), the slots its last m rows go to, m); the
        ring then holds them."""
        R = self.ring
        m = min(T, R)
        state = torch.tensor([p % R for p in range(start - self.d, start)], dtype=torch.long)
        write = torch.tensor([p % R for p in range(start + T - m, start + T)], dtype=torch.long)
        self.lo = max(self.lo, start + T - R)
        return state, max(0, self.d - start), write, m

    def conv_fill(self, j: int, slots: tuple, ext: torch.Tensor) -> None:
        """ext [d + T, D], whose last T rows hold the pass's convolution input (conv_slots' pass): its first d rows
        become recurrent layer j's state before the pass (zeros before position 0), and the pass's rows go into
        the layer's ring."""
        state, zeros, write, m = slots
        ring = self.conv[j]  # [ring, D]
        torch.index_select(ring, 0, state, out=ext[:self.d])
        ext[:zeros] = 0
        ring.index_copy_(0, write, ext[ext.shape[0] - m:])

    def shift(self, n_keep: int, n_discard: int, shift_k) -> None:
        """KVCache.shift for the attention layers; each recurrent state stays as it is (llama.cpp's recurrent
        memory keeps it), now the state before the new last position."""
        end = self.length
        super().shift(n_keep, n_discard, shift_k)
        self.conv = torch.roll(self.conv, -n_discard, dims=1)  # slot of p - n_discard <- slot of p
        self.lo = min(max(self.lo, n_keep + n_discard) - n_discard, max(0, end - n_discard - self.d))
        if self.ssm is not None:
            self.ssm = torch.roll(self.ssm, -n_discard, dims=1)
            self.ssm_lo = min(max(self.ssm_lo, n_keep + n_discard) - n_discard, end - n_discard)

    def arrays(self, n: int) -> dict[str, torch.Tensor]:
        raise UsageError(PROMPT_CACHE_RECURRENT)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.conv.numel() * 4 + (self.ssm.numel() * 4 if self.ssm is not None else 0)
