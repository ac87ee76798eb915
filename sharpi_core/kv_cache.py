"""KV cache, allocated once per context: `length`, `truncate(n)`, nothing allocated per token.

Types follow llama.cpp's -ctk/-ctv names: f32, f16, q8_0 (blocks of 32 along head_dim with
one f16 scale each, round-to-nearest like ggml's quantize_row_q8_0).
"""
from __future__ import annotations

import gguf
import torch

from .errors import UsageError

CACHE_TYPES = ("f32", "f16", "q8_0")
_QK8_0 = 32
Q = gguf.GGMLQuantizationType


class _Store:
    """One tensor kind (K or V) for all layers: [n_layer, capacity, n_kv_head, head_dim]."""

    def __init__(self, kind: str, n_layer: int, capacity: int, n_kv: int, hd: int):
        if kind not in CACHE_TYPES:
            raise UsageError(f"unsupported KV cache type '{kind}' (choose from {', '.join(CACHE_TYPES)})")
        self.kind = kind
        self.qtype = {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0}[kind]
        shape = (n_layer, capacity, n_kv, hd)
        if kind == "q8_0":
            if hd % _QK8_0:
                raise UsageError(f"KV cache type q8_0 needs a head size divisible by 32 (model has {hd})")
            self.q = torch.zeros(shape, dtype=torch.int8)
            self.d = torch.zeros((n_layer, capacity, n_kv, hd // _QK8_0, 1), dtype=torch.float16)
        else:
            self.q = torch.zeros(shape, dtype=torch.float32 if kind == "f32" else torch.float16)

    def write(self, layer: int, start: int, x: torch.Tensor) -> None:
        # x [T, n_kv, hd] fp32
        end = start + x.shape[0]
        if self.kind != "q8_0":
            self.q[layer, start:end] = x
            return
        blocks = x.reshape(x.shape[0], x.shape[1], -1, _QK8_0)  # [T, n_kv, nb, 32]
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        self.q[layer, start:end] = torch.round(blocks * inv).to(torch.int8).reshape(x.shape)
        self.d[layer, start:end] = d.to(torch.float16)

    def read(self, layer: int, end: int) -> torch.Tensor:
        # -> [end, n_kv, hd] fp32
        q = self.q[layer, :end]
        if self.kind != "q8_0":
            return q.float()
        shp = q.shape
        return (q.reshape(shp[0], shp[1], -1, _QK8_0).float() * self.d[layer, :end].float()).reshape(shp)


class KVCache:
    def __init__(self, n_layer: int, capacity: int, n_kv_head: int, head_dim_k: int, head_dim_v: int,
                 type_k: str = "f16", type_v: str = "f16"):
        self.capacity = capacity
        self.length = 0
        self.type_k, self.type_v = type_k, type_v
        self.k = _Store(type_k, n_layer, capacity, n_kv_head, head_dim_k)
        self.v = _Store(type_v, n_layer, capacity, n_kv_head, head_dim_v)

    def truncate(self, n: int) -> None:
        """Forget every position >= n (rollback after rejected drafts, or a changed prompt)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate({n}) outside 0..{self.length}")
        self.length = n

    @property
    def nbytes(self) -> int:
        total = 0
        for s in (self.k, self.v):
            total += s.q.numel() * s.q.element_size()
            if s.kind == "q8_0":
                total += s.d.numel() * s.d.element_size()
        return total
