"""Weights as they are stored in the GGUF, and the matmuls that read them.

A `QWeight` keeps the GGUF's quantized blocks (a zero-copy view of the mmap) and multiplies
through the compiled CPU kernel (`kernels.cpu`) when it is available; otherwise it
dequantizes once with `gguf.quants` (the reference) and uses an fp32 matmul.
"""
from __future__ import annotations

import os
import warnings

import gguf
import numpy as np
import torch

from .errors import SharpiError

Q = gguf.GGMLQuantizationType

# Every type the four known models use, plus the neighbours llama.cpp users expect.
SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)


def _kernels():
    """The compiled CPU kernel module, or None (SHARPI_CPU_KERNEL=0 forces the reference path)."""
    if os.environ.get("SHARPI_CPU_KERNEL", "1") == "0":
        return None
    try:
        from .kernels import cpu
    except ImportError:
        return None
    return cpu if cpu.available() else None


# llama.cpp multiplies a quantized weight by activations quantized to its "vec_dot_type"
# (ggml-cpu type traits): 8-bit blocks of 32 with an f16 scale for the legacy quants, blocks of
# 256 with an f32 scale (Q8_K) for the K-quants, and fp16 activations for F16 weights. Rounding
# the activations the same way is what makes greedy output match llama.cpp token for token on
# these small 4-bit models, whose top logits are often within 1-2% of each other.
_ACT_Q8_32 = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0})
_ACT_Q8_K = frozenset({Q.Q4_K, Q.Q5_K, Q.Q6_K})
MATCH_LLAMA_CPP = os.environ.get("SHARPI_ACT_QUANT", "1") != "0"


def quantize_q8_blocks(x: torch.Tensor, block: int, f16_scale: bool) -> torch.Tensor:
    """x [..., K] -> x rounded through 8-bit blocks of `block` (returned dequantized, fp32)."""
    shp = x.shape
    b = x.reshape(*shp[:-1], shp[-1] // block, block)
    d = b.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv)
    if f16_scale:
        d = d.half().float()
    return (q * d).reshape(shp)


def act_kind(qtype: Q) -> str | None:
    """How llama.cpp rounds activations multiplied by a `qtype` weight (None = fp32)."""
    if not MATCH_LLAMA_CPP:
        return None
    if qtype in _ACT_Q8_32:
        return "q8_32"
    if qtype in _ACT_Q8_K:
        return "q8_k"
    return {Q.F16: "f16", Q.BF16: "bf16"}.get(qtype)


_ROUND_Q8: list = []  # [kernels.cpu.round_q8 or None], resolved at the first call


def round_activations(x: torch.Tensor, kind: str | None) -> torch.Tensor:
    if kind is None:
        return x
    if kind in ("q8_32", "q8_k"):
        block, f16_scale = (32, True) if kind == "q8_32" else (256, False)
        if not _ROUND_Q8:
            k = _kernels()
            _ROUND_Q8.append(k.round_q8 if k is not None else None)
        if _ROUND_Q8[0] is not None and x.dtype == torch.float32:  # same bits, one C call
            return _ROUND_Q8[0](x, block, f16_scale)
        return quantize_q8_blocks(x, block, f16_scale)
    return x.half().float() if kind == "f16" else x.bfloat16().float()


def activation_for(x: torch.Tensor, qtype: Q) -> torch.Tensor:
    """The activations as llama.cpp's CPU backend sees them when multiplying by a `qtype` weight."""
    return round_activations(x, act_kind(qtype))


class Activations:
    """One input x [T, K] shared by several weights (q/k/v, gate/up): rounds it once per kind."""

    __slots__ = ("x", "_by_kind")

    def __init__(self, x: torch.Tensor):
        self.x = x.contiguous()
        self._by_kind: dict = {}

    def __call__(self, w: "QWeight") -> torch.Tensor:
        k = w.act_kind
        xa = self._by_kind.get(k)
        if xa is None:
            xa = self._by_kind[k] = round_activations(self.x, k)
        return w.matmul(xa)


def torch_view(a: np.ndarray) -> torch.Tensor:
    """Zero-copy torch view of a (read-only) memmapped array."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable tensor": we never write
        return torch.from_numpy(a)


def reference_dequantize(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """fp32 dequantization through `gguf.quants` (the oracle every fast path is tested against)."""
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))


class QWeight:
    """A 2-D weight W [N, K] (N outputs), used as y = x @ W.T."""

    def __init__(self, name: str, raw: np.ndarray, qtype: Q, n: int, k: int):
        if qtype not in SUPPORTED_TYPES:
            raise SharpiError(f"tensor '{name}' has unsupported quantization type {qtype.name} "
                              f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})")
        self.name, self.qtype, self.n, self.k = name, qtype, n, k
        self.act_kind = act_kind(qtype)
        self.raw = raw  # uint8 [N, row_bytes] (or [N, K] for float types), a view of the mmap
        self._kern = _kernels()
        if self._kern is not None and qtype not in self._kern.SUPPORTED:
            self._kern = None
        self._raw_t = torch_view(raw) if self._kern is not None else None
        self._dense: torch.Tensor | None = None
        if qtype == Q.F32:
            self._dense = torch_view(raw).view(n, k)

    @classmethod
    def concat(cls, name: str, parts: list["QWeight"], row_order: list[np.ndarray | None] | None = None) -> "QWeight":
        """One weight whose output rows are the parts' rows in turn (optionally reordered per part).

        Fusing q/k or gate/up into one matmul halves the per-token calls; the copy lives in RAM
        while the original mmap pages are never touched, so resident memory does not double."""
        qt, k = parts[0].qtype, parts[0].k
        assert all(p.qtype == qt and p.k == k for p in parts)
        order = row_order or [None] * len(parts)
        raw = np.concatenate([p.raw if o is None else p.raw[o] for p, o in zip(parts, order)])
        return cls(name, raw, qt, sum(p.n for p in parts), k)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def dense(self) -> torch.Tensor:
        """fp32 [N, K]; cached, so only the fallback path pays its memory."""
        if self._dense is None:
            self._dense = reference_dequantize(self.raw, self.qtype).view(self.n, self.k)
        return self._dense

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, K] -> [T, N]
        return self.matmul(round_activations(x, self.act_kind))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K], already rounded for this weight's act_kind -> [T, N]."""
        if self._kern is not None:
            if x.shape[0] == 1:
                # The kernel's multi-row path gives each row the same bits whatever T is, but its
                # one-row path sums in another order. A speculative verify pass (T = k+1) must
                # reproduce plain decoding bit for bit (greedy parity), so one row takes the
                # multi-row path too: the weights are still read once, only the FMAs double.
                return self._kern.qmatmul(x.expand(2, -1).contiguous(), self._raw_t, self.qtype, self.n, self.k)[:1]
            return self._kern.qmatmul(x.contiguous(), self._raw_t, self.qtype, self.n, self.k)
        return torch.nn.functional.linear(x, self.dense())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (embedding lookup): ids [T] -> [T, K]."""
        if self._dense is not None:
            return self._dense[ids]
        if self._kern is not None:
            return self._kern.dequant_rows(self._raw_t, self.qtype, ids, self.k)
        sel = self.raw[ids.numpy()]
        return reference_dequantize(sel, self.qtype).view(len(ids), self.k)


def load_vector(t) -> torch.Tensor:
    """A 1-D (norm/bias) tensor as fp32 (small: copied)."""
    if t.tensor_type in (Q.F32, Q.F16):
        return torch.from_numpy(np.array(t.data, dtype=np.float32)).reshape(-1)
    return reference_dequantize(t.data, t.tensor_type).reshape(-1)
