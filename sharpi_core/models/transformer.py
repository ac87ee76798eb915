"""The decoder-only transformer shared by llama, qwen2 and gemma3 (differences come from ModelConfig).

`forward(tokens, start_pos, cache) -> logits [T, vocab]`; the model never samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import SharpiError
from ..gguf_file import GGUFFile
from ..kv_cache import KVCache
from ..quants import Activations, QWeight, activation_for, load_vector
from .config import ROPE_NEOX, ModelConfig, config_from_gguf


@dataclass
class Layer:
    attn_norm: torch.Tensor
    wq: QWeight
    wk: QWeight
    wv: QWeight
    wo: QWeight
    ffn_norm: torch.Tensor
    w_gate: QWeight
    w_up: QWeight
    w_down: QWeight
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None


def _weight(gf: GGUFFile, name: str) -> QWeight:
    t = gf.tensor(name)
    k, n = (int(s) for s in t.shape[:2])  # GGUF shapes are [K (fastest), N]
    return QWeight(name, t.data, t.tensor_type, n, k)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


class Transformer:
    def __init__(self, gf: GGUFFile, config: ModelConfig | None = None):
        self.gguf = gf
        self.config = c = config or config_from_gguf(gf)
        self.tok_embd = _weight(gf, "token_embd.weight")
        self.output = self.tok_embd if c.tied_output else _weight(gf, "output.weight")
        self.output_norm = load_vector(gf.tensor("output_norm.weight"))
        opt = lambda name: load_vector(gf.tensors[name]) if name in gf.tensors else None  # noqa: E731
        self.layers: list[Layer] = []
        for i in range(c.n_layer):
            p = f"blk.{i}."
            self.layers.append(Layer(
                attn_norm=load_vector(gf.tensor(p + "attn_norm.weight")),
                wq=_weight(gf, p + "attn_q.weight"), wk=_weight(gf, p + "attn_k.weight"),
                wv=_weight(gf, p + "attn_v.weight"), wo=_weight(gf, p + "attn_output.weight"),
                ffn_norm=load_vector(gf.tensor(p + "ffn_norm.weight")),
                w_gate=_weight(gf, p + "ffn_gate.weight"), w_up=_weight(gf, p + "ffn_up.weight"),
                w_down=_weight(gf, p + "ffn_down.weight"),
                bq=opt(p + "attn_q.bias"), bk=opt(p + "attn_k.bias"), bv=opt(p + "attn_v.bias"),
                q_norm=opt(p + "attn_q_norm.weight"), k_norm=opt(p + "attn_k_norm.weight"),
                post_attn_norm=opt(p + "post_attention_norm.weight"),
                post_ffn_norm=opt(p + "post_ffw_norm.weight"),
            ))
        # inv_freq per distinct rope base: [n_rot/2]
        self._inv_freq = {}
        for i in range(c.n_layer):
            base = c.layer_rope_base(i)
            if base not in self._inv_freq:
                self._inv_freq[base] = 1.0 / (base ** (torch.arange(0, c.n_rot, 2, dtype=torch.float64) / c.n_rot))

    # -- sizes -------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for w in [self.tok_embd, self.output] + [getattr(l, f) for l in self.layers
                                                  for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]:
            if id(w) not in seen:
                seen.add(id(w))
                total += w.nbytes
        return total

    def new_cache(self, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> KVCache:
        c = self.config
        return KVCache(c.n_layer, n_ctx, c.n_head_kv, c.head_dim_k, c.head_dim_v, type_k, type_v)

    # -- pieces --------------------------------------------------------------------------
    def _rope_tables(self, pos: torch.Tensor) -> dict[float, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for base, inv in self._inv_freq.items():
            ang = pos.to(torch.float64)[:, None] * inv[None, :]  # [T, n_rot/2]; f64 keeps long contexts exact
            out[base] = (ang.cos().float()[:, None, :], ang.sin().float()[:, None, :])  # [T, 1, n_rot/2]
        return out

    def _rope(self, x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x [T, H, hd]; rotates the first n_rot dims
        cos, sin = cs
        n_rot = self.config.n_rot
        xr, rest = x[..., :n_rot], x[..., n_rot:]
        if self.config.rope_style == ROPE_NEOX:
            a, b = xr[..., : n_rot // 2], xr[..., n_rot // 2:]
            rot = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
        else:
            a, b = xr[..., 0::2], xr[..., 1::2]
            rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot

    def _mask(self, start: int, T: int, window: int) -> torch.Tensor | None:
        """Boolean [T, start+T] (True = attend), or None when every key is visible."""
        L = start + T
        if T == 1 and (window == 0 or L <= window):
            return None
        qpos = torch.arange(start, L)[:, None]
        kpos = torch.arange(L)[None, :]
        m = kpos <= qpos
        if window:
            m &= (qpos - kpos) < window  # llama.cpp's standard SWA: masked when q - k >= window
        return m

    # -- forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, cache: KVCache, last_n: int | None = None) -> torch.Tensor:
        """tokens [T] at positions start_pos.. -> logits [T, n_vocab] (only the last `last_n` rows if given).

        Appends the T new K/V entries to `cache` (start_pos must equal cache.length)."""
        c = self.config
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        T = tokens.shape[0]
        if start_pos != cache.length:
            raise ValueError(f"forward at position {start_pos} but the cache holds {cache.length}")
        if start_pos + T > cache.capacity:
            raise SharpiError(f"context full: {start_pos + T} tokens > context size {cache.capacity}")
        if T == 0:
            return torch.zeros(0, c.n_vocab)
        L = start_pos + T
        H, Hkv, hd, hdv = c.n_head, c.n_head_kv, c.head_dim_k, c.head_dim_v
        scale = c.attn_scale or 1.0 / math.sqrt(hd)

        x = self.tok_embd.rows(tokens)  # [T, D]
        if c.embed_scale != 1.0:
            x = x * c.embed_scale
        ropes = self._rope_tables(torch.arange(start_pos, L))
        masks = {}
        for i, ly in enumerate(self.layers):
            window = c.sliding_window if c.is_swa(i) else 0
            if window not in masks:
                masks[window] = self._mask(start_pos, T, window)
            h = rms_norm(x, ly.attn_norm, c.norm_eps)
            a = Activations(h)
            q, k, v = a(ly.wq), a(ly.wk), a(ly.wv)
            if ly.bq is not None:
                q, k, v = q + ly.bq, k + ly.bk, v + ly.bv
            q = q.view(T, H, hd)
            k = k.view(T, Hkv, hd)
            v = v.view(T, Hkv, hdv)
            if c.qk_norm:
                q = rms_norm(q, ly.q_norm, c.norm_eps)
                k = rms_norm(k, ly.k_norm, c.norm_eps)
            cs = ropes[c.layer_rope_base(i)]
            q, k = self._rope(q, cs), self._rope(k, cs)
            # llama.cpp dots q with the cached K in K's own type (q8_0 or f16 activations)
            qa = activation_for(q, cache.k.qtype)
            cache.k.write(i, start_pos, k)
            cache.v.write(i, start_pos, v)
            K = cache.k.read(i, L)  # [L, Hkv, hd]
            V = cache.v.read(i, L)
            o = F.scaled_dot_product_attention(
                qa.transpose(0, 1).unsqueeze(0), K.transpose(0, 1).unsqueeze(0), V.transpose(0, 1).unsqueeze(0),
                attn_mask=masks[window], scale=scale, enable_gqa=Hkv != H,
            )  # [1, H, T, hdv]
            o = ly.wo(o[0].transpose(0, 1).reshape(T, H * hdv))
            if ly.post_attn_norm is not None:
                o = rms_norm(o, ly.post_attn_norm, c.norm_eps)
            x = x + o
            h = rms_norm(x, ly.ffn_norm, c.norm_eps)
            a = Activations(h)
            g = a(ly.w_gate)
            g = F.silu(g) if c.act == "silu" else F.gelu(g, approximate="tanh")
            f = ly.w_down(g * a(ly.w_up))
            if ly.post_ffn_norm is not None:
                f = rms_norm(f, ly.post_ffn_norm, c.norm_eps)
            x = x + f
        cache.length = L
        if last_n is not None:
            x = x[-last_n:]
        x = rms_norm(x, self.output_norm, c.norm_eps)
        return self.output(x)
