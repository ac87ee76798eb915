"""Weights as they are stored in the GGUF, and the matmuls that read them.

A `QWeight` keeps the GGUF's quantized blocks (a zero-copy view of the mmap) and multiplies
through the compiled CPU kernel (`kernels.cpu`) when it is available (Q4_K and Q4_1 repacked in
groups of 4 rows for it, same results); otherwise it dequantizes once with `gguf.quants` (the
reference) and uses an fp32 matmul.
"""
from __future__ import annotations

import warnings

import gguf
import numpy as np
import torch

from .errors import SharpiError
from .switches import switch

Q = gguf.GGMLQuantizationType

# Every type the four known models use, plus the neighbours llama.cpp users expect.
SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
     Q.Q6_K, Q.IQ4_XS, Q.MXFP4}
)


def _kernels():
    """The compiled CPU kernel module, or None (SHARPI_CPU_KERNEL=0 forces the reference path)."""
    if not switch("SHARPI_CPU_KERNEL"):
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
_ACT_Q8_32 = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.MXFP4})
_ACT_Q8_K = frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS})
MATCH_LLAMA_CPP = switch("SHARPI_ACT_QUANT")

# Whether a weight of this process is multiplied by torch's matmuls (the reference path; fp32 activations, whose
# long passes take torch's sgemm on dequantized tiles): torch gives a Linear of some row counts other bits on
# another thread count (5-11 rows of 576 on 1 and 2 threads, measured), where the compiled kernels compute each
# output in one thread in a fixed order. threads.ThreadGovernor must not change the count under those.
_TORCH_MATMULS = [False]


def thread_count_changes_bits() -> bool:
    """Whether a weight loaded so far is multiplied by torch (see _TORCH_MATMULS)."""
    return _TORCH_MATMULS[0]


def q8_parts(x: torch.Tensor, block: int, f16_scale: bool):
    """ggml's x86 activation quantization in torch, x [..., K] -> (codes, d, s) as fp32 tensors
    [..., K/block, block], [..., K/block, 1], [..., K/block, 1].

    f16_scale (Q8_0 / Q8_1, quantize_row_q8_0/q8_1): amax = max|x|, d = amax/127, codes =
    round-half-even(x * (127/amax)), the stored d is fp16(d), s = fp16(d * sum(codes)) (Q8_1).
    Otherwise (Q8_K, quantize_row_q8_K_ref): max = the element of largest magnitude (the first),
    iscale = -127/max, codes = min(127, round-half-even(iscale * x)), d = 1/iscale (fp32), s = None."""
    # (scalar / tensor is computed by torch as scalar * reciprocal(tensor), two roundings: every
    # division here is tensor / tensor or tensor / scalar, one correctly rounded fp32 division)
    shp = x.shape
    b = x.reshape(*shp[:-1], shp[-1] // block, block)
    ab = b.abs()
    amax = ab.amax(dim=-1, keepdim=True)
    zero = amax == 0
    one = torch.ones_like(amax)
    if f16_scale:
        d = amax / 127.0
        iscale = torch.where(zero, torch.zeros_like(amax), torch.full_like(amax, 127.0) / torch.where(zero, one, amax))
        q = torch.round(b * iscale)
        s = (d * q.sum(dim=-1, keepdim=True)).half().float()
        return q, d.half().float(), s
    mx = torch.gather(b, -1, ab.argmax(dim=-1, keepdim=True))  # argmax: the first maximal element
    iscale = torch.full_like(mx, -127.0) / torch.where(zero, one, mx)
    q = torch.where(zero, torch.zeros_like(b), torch.round(iscale * b).clamp_(max=127.0))
    d = torch.where(zero, torch.zeros_like(mx), one / iscale)
    return q, d, None


def quantize_q8_blocks(x: torch.Tensor, block: int, f16_scale: bool) -> torch.Tensor:
    """x [..., K] -> x rounded through 8-bit blocks of `block` (returned dequantized, fp32): ggml's
    Q8_0 rules with f16_scale, Q8_K's without (see q8_parts)."""
    q, d, _ = q8_parts(x, block, f16_scale)
    return (q * d).reshape(x.shape)


def q8_0_blocks(x: np.ndarray) -> np.ndarray:
    """float32 [..., K] -> ggml Q8_0 blocks uint8 [..., K/32*34] (fp16 d, then 32 int8 codes) quantized
    as ggml's x86 quantize_row_q8_0 does (q8_parts; gguf.quants.quantize rounds half away from zero
    and through 1/d, which differs on a few codes): the bytes of the CPU path's q8_0 KV cache."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    q, d, _ = q8_parts(torch.from_numpy(x), 32, True)  # [..., nb, 32], [..., nb, 1]
    blocks = np.concatenate([d.numpy().astype(np.float16).view(np.uint8),
                             q.numpy().astype(np.int8).view(np.uint8)], axis=-1)  # [..., nb, 34]
    return blocks.reshape(*x.shape[:-1], -1)


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
    """One input x [T, K] shared by several weights (q/k/v, gate/up).

    Weights whose compiled kernel quantizes the activations itself get the raw fp32 x; on the
    reference path the rounded activations are computed once per kind and shared."""

    __slots__ = ("x", "prompt", "_by_kind")

    def __init__(self, x: torch.Tensor, prompt: bool = False):
        self.x = x.contiguous()
        self.prompt = prompt
        self._by_kind: dict = {}

    def __call__(self, w: "QWeight") -> torch.Tensor:
        if w.kernel_rounds:  # the kernel rounds x itself
            return w(self.x, self.prompt)
        key = (w.act_kind, w.needs_s)
        xa = self._by_kind.get(key)
        if xa is None:
            xa = self._by_kind[key] = w.reference_activations(self.x)
        return w.add_loras(self.x, w.reference_matmul(*xa, prompt=self.prompt), self.prompt)


def decoding_rows(mm, prompt: bool, x: torch.Tensor, *more):
    """mm(x, *more) for rows x [T, K] (more: per-row tensors [T, ...] or None). A decoding pass of several rows
    (prompt=False: a verify pass) goes one row at a time: torch's matmul of T rows may sum in another order than
    its one-row matmul, and greedy speculation must give plain decoding's bits."""
    if prompt or x.dim() != 2 or x.shape[0] == 1:
        return mm(x, *more)
    return torch.cat([mm(x[r:r + 1], *(None if m is None else m[r:r + 1] for m in more)) for r in range(x.shape[0])])


def torch_view(a: np.ndarray) -> torch.Tensor:
    """Zero-copy torch view of a (read-only) memmapped array."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable tensor": we never write
        return torch.from_numpy(a)


def reference_dequantize(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """fp32 dequantization through `gguf.quants` (the oracle every fast path is tested against)."""
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))


def _is_file_view(a: np.ndarray) -> bool:
    """Whether `a` is a view of a memory-mapped file (np.memmap somewhere up its base chain)."""
    while a is not None:
        if isinstance(a, np.memmap):
            return True
        a = getattr(a, "base", None) if isinstance(a, np.ndarray) else None
    return False


def _release_pages(a: np.ndarray) -> None:
    """madvise(MADV_DONTNEED) the whole pages inside a's bytes: a read-only file mapping drops them
    from this process (a later read faults them in again from the page cache)."""
    try:
        import ctypes
        import mmap
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        start = a.ctypes.data
        lo, hi = -(-start // page) * page, (start + a.nbytes) // page * page
        if hi > lo:
            libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED
    except (OSError, AttributeError):
        pass  # only resident memory is at stake


class QWeight:
    """A 2-D weight W [N, K] (N outputs), used as y = x @ W.T.

    With the compiled kernel, x goes to it in fp32 and the kernel quantizes it to the weight's
    ggml vec_dot_type (act_quant) and uses integer dot products, as llama.cpp's CPU backend does.
    Without it (the reference): the same activation rounding in torch (q8_parts), the weight
    dequantized by gguf.quants and an fp32 matmul; for Q4_1 / Q5_1 the m_w * s_x term uses the fp16
    s of the Q8_1 activation blocks, like ggml's vec_dot_q4_1_q8_1."""

    def __init__(self, name: str, raw: np.ndarray, qtype: Q, n: int, k: int):
        if qtype not in SUPPORTED_TYPES:
            raise SharpiError(f"tensor '{name}' has unsupported quantization type {qtype.name} "
                              f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})")
        self.name, self.qtype, self.n, self.k = name, qtype, n, k
        self.act_kind = act_kind(qtype)
        self.needs_s = self.act_kind == "q8_32" and qtype in (Q.Q4_1, Q.Q5_1)
        self._raw = raw  # uint8 [N, row_bytes] (or [N, K] for float types), a view of the mmap
        self._kern = _kernels()
        if self._kern is not None and (qtype not in self._kern.SUPPORTED or (qtype == Q.F32 and k % 64)
                                       or not self._kern.takes(qtype, k)):
            self._kern = None  # (F32: the kernel takes rows of 64s, in ggml's orders; a LoRA factor's width may be any)
        if self._kern is None or (self.act_kind is None and qtype not in (Q.F16, Q.F32)):
            _TORCH_MATMULS[0] = True
        self.kernel_rounds = self._kern is not None  # the kernel takes raw fp32 activations
        self._raw_t = torch_view(raw) if self._kern is not None else None
        # Q4_K and Q4_1 (and Q5_0 on AVX2 CPUs) go to the kernel repacked in groups of 4 rows
        # (kernels.cpu.PACKED: less work per row than unpacking the GGUF blocks, same results), made at
        # the first matmul; those layouts have integer kernels only (8-bit activations, so not with
        # SHARPI_ACT_QUANT=0)
        self._packable = (self._kern is not None and self._kern.packs(qtype) and n % 4 == 0
                          and self.act_kind is not None and switch("SHARPI_CPU_REPACK"))
        self._packed: torch.Tensor | None = None
        self._heads: dict[int, QWeight] = {}  # n -> head(n), made once
        self._dense: torch.Tensor | None = None
        self._dense_nomin: tuple | None = None
        self.loras: list = []  # LoRA adapters' updates of its rows (lora.LoraTerm), added after each product
        if qtype == Q.F32:
            self._dense = torch_view(raw).view(n, k)

    @classmethod
    def concat(cls, name: str, parts: list["QWeight"], row_order: list[np.ndarray | None] | None = None):
        """One weight whose output rows are the parts' rows in turn (optionally reordered per part).

        Fusing q/k or gate/up into one matmul halves the per-token calls; the copy lives in RAM
        while the original mmap pages are never touched, so resident memory does not double. Parts of
        different types (a quantization that mixes them) stay apart: a StackedWeight."""
        qt, k = parts[0].qtype, parts[0].k
        order = row_order or [None] * len(parts)
        if any(p.qtype != qt or p.k != k for p in parts):
            return StackedWeight(name, [p if o is None else cls(f"{p.name}[order]", p.raw[o], p.qtype, len(o), p.k)
                                        for p, o in zip(parts, order)])
        raw = np.concatenate([p.raw if o is None else p.raw[o] for p, o in zip(parts, order)])
        return cls(name, raw, qt, raw.shape[0], k)  # (an order may take some of a part's rows)

    def head(self, n: int) -> "QWeight":
        """The first n output rows: a view of the same blocks, no copy; made once per n (a draft model's cut output
        layer, an MTP head sharing the target's)."""
        w = self._heads.get(n)
        if w is not None:
            return w
        if self._raw is None and n % 4 == 0:  # only the repacked rows exist: share them
            w = QWeight(f"{self.name}[:{n}]", self._kern.repack(self._packed[:n], self.qtype, n, self.k, inverse=True).numpy(),
                        self.qtype, n, self.k)
            w._packed, w._raw, w._raw_t = self._packed[:n], None, None
        else:
            w = QWeight(f"{self.name}[:{n}]", self.raw[:n], self.qtype, n, self.k)
            if self._packed is not None and w._packable:
                w._packed = self._packed[:n]
        w.loras = [h for h in (t.head(n) for t in self.loras) if h is not None]
        self._heads[n] = w
        return w

    def set_loras(self, terms: list) -> None:
        """The LoRA updates (lora.LoraTerm) every product with this weight gets from now on (its heads too)."""
        self.loras = list(terms)
        self._heads.clear()

    def add_loras(self, x: torch.Tensor, y: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        """y = x's product with this weight, plus the LoRA updates (llama.cpp's build_lora_mm)."""
        for t in self.loras:
            y = t.add(x, y, prompt)
        return y

    @property
    def raw(self) -> np.ndarray:
        """The GGUF blocks uint8 [N, row_bytes] (rebuilt from the repacked copy if that is all there is)."""
        if self._raw is None:
            return self._kern.repack(self._packed, self.qtype, self.n, self.k, inverse=True).numpy()
        return self._raw

    @property
    def nbytes(self) -> int:
        return self.n * (self.k // gguf.GGML_QUANT_SIZES[self.qtype][0]) * gguf.GGML_QUANT_SIZES[self.qtype][1]

    def pack(self) -> None:
        """Repack for the CPU kernel now (Q4_K, Q4_1; else nothing). The GGUF blocks are let go: a copy of
        ours is freed (`raw` rebuilds it on demand), pages of the file's mapping are returned to the
        page cache, so resident memory does not grow by the copy."""
        if not self._packable or self._packed is not None:
            return
        self._packed = self._kern.repack(self._raw_t, self.qtype, self.n, self.k)
        if _is_file_view(self._raw):
            _release_pages(self._raw)
        else:
            self._raw = None
            self._raw_t = None

    def kernel_args(self) -> tuple[int, int, int] | None:
        """(code, weight pointer, row bytes) for calling the C kernel directly in the decoding order
        with quantized activations (kernels.cpu.direct_args), or None when this weight does not go
        through it that way. Repacks first where the kernel takes another layout."""
        if self._kern is None or self.act_kind is None:
            return None
        if self._packable:
            self.pack()
            return self._kern.direct_args(self._packed, self._kern.PACKED[self.qtype], self.n, self.k)
        return self._kern.direct_args(self._raw_t, self.qtype, self.n, self.k)

    def dense(self) -> torch.Tensor:
        """fp32 [N, K]; cached, so only the fallback path pays its memory."""
        if self._dense is None:
            self._dense = reference_dequantize(self.raw, self.qtype).view(self.n, self.k)
        return self._dense

    def dense_without_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Q4_1 / Q5_1: (d * q as fp32 [N, K], the mins m fp32 [N, K/32]); cached."""
        if self._dense_nomin is None:
            bb = gguf.GGML_QUANT_SIZES[self.qtype][1]
            blocks = np.array(self.raw, dtype=np.uint8).reshape(self.n, self.k // 32, bb)
            mins = blocks[:, :, 2:4].copy().view(np.float16).astype(np.float32).reshape(self.n, self.k // 32)
            blocks[:, :, 2:4] = 0
            wd = reference_dequantize(blocks.reshape(self.n, -1), self.qtype).view(self.n, self.k)
            self._dense_nomin = (wd, torch.from_numpy(mins))
        return self._dense_nomin

    def __call__(self, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        # x [T, K] fp32 -> [T, N]. The kernel gives each row the same bits whatever T is (T = 1 too):
        # a speculative verify pass reproduces single-token decoding bit for bit. prompt=True sums in
        # llama.cpp's prompt-processing order instead (kernels/cpu.py qmatmul).
        if self._kern is not None:
            if self._packable:
                if self._packed is None:
                    self.pack()
                y = self._kern.qmatmul(x.contiguous(), self._packed, self._kern.PACKED[self.qtype], self.n, self.k,
                                       act_quant=True, prompt=prompt)
                return self.add_loras(x, y, prompt) if self.loras else y
            y = self._kern.qmatmul(x.contiguous(), self._raw_t, self.qtype, self.n, self.k,
                                   act_quant=self.act_kind is not None, prompt=prompt)
        else:
            y = self.reference_matmul(*self.reference_activations(x), prompt=prompt)
        return self.add_loras(x, y, prompt) if self.loras else y

    def reference_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x rounded as llama.cpp rounds it for this weight (fp32), Q8_1's s [T, K/32] or None)."""
        if self.needs_s:
            q, d, s = q8_parts(x, 32, True)
            return (q * d).reshape(x.shape), s.reshape(*x.shape[:-1], x.shape[-1] // 32)
        return round_activations(x, self.act_kind), None

    def reference_matmul(self, xa: torch.Tensor, s: torch.Tensor | None = None, prompt: bool = False) -> torch.Tensor:
        return decoding_rows(self._reference_mm, prompt, xa, s)

    def _reference_mm(self, xa: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        if s is None:
            return torch.nn.functional.linear(xa, self.dense())
        wd, mins = self.dense_without_mins()
        return torch.nn.functional.linear(xa, wd) + s @ mins.T

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (embedding lookup): ids [T] -> [T, K]."""
        if self._dense is not None:
            return self._dense[ids]
        if self._kern is not None and self._raw_t is not None:
            return self._kern.dequant_rows(self._raw_t, self.qtype, ids, self.k)
        sel = self.raw[ids.numpy()]
        return reference_dequantize(sel, self.qtype).view(len(ids), self.k)


class StackedWeight:
    """Weights of different types over one input, their outputs side by side ([T, sum of n]): what a fused
    pair (q and k, gate and up) is where the quantization mixed types, as llama.cpp's Q4_K_M does for
    an 8-expert model (attn_k Q8_0 beside a Q4_K attn_q) and per-tensor type choices (llama-quantize's
    --tensor-type) may anywhere. Each part is multiplied by its own kernel, as llama.cpp multiplies them apart."""

    kernel_rounds = True  # (each part rounds the activations its own way: called with the raw x)

    def __init__(self, name: str, parts: list[QWeight]):
        self.name, self.parts = name, list(parts)
        self.n, self.k = sum(p.n for p in parts), parts[0].k
        self.loras: list = []

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def pack(self) -> None:
        for p in self.parts:
            p.pack()

    def set_loras(self, terms: list) -> None:
        self.loras = list(terms)

    add_loras = QWeight.add_loras

    def __call__(self, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        y = torch.cat([p(x, prompt) for p in self.parts], dim=-1)  # [T, n]
        return self.add_loras(x, y, prompt) if self.loras else y


def load_vector(t) -> torch.Tensor:
    """A 1-D (norm/bias) tensor as fp32 (small: copied)."""
    if t.tensor_type in (Q.F32, Q.F16):
        return torch.from_numpy(np.array(t.data, dtype=np.float32)).reshape(-1)
    if t.tensor_type not in SUPPORTED_TYPES:
        raise SharpiError(f"tensor '{t.name}' has unsupported type {t.tensor_type.name} "
                          f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})")
    return reference_dequantize(t.data, t.tensor_type).reshape(-1)
