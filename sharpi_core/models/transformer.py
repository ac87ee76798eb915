"""The decoder-only transformer shared by llama, qwen2, qwen3, smollm3, phi3, granite, exaone, olmo2 and exaone4
(post-norms only), gemma2, gemma3, mistral3, the mixtures of experts qwen3moe, qwen2moe, granitemoe, gpt-oss and
Mixtral-style llama, lfm2's hybrid of attention and short-convolution layers, and qwen35's of gated attention and
Gated DeltaNet layers (qwen35moe: with experts; differences come from ModelConfig).

`forward(tokens, start_pos, cache) -> logits [T, vocab]`; the model never samples.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

import gguf
import torch
import torch.nn.functional as F

from ..errors import SharpiError
from ..gguf_file import GGUFFile
from ..kernels import cpu
from ..kv_cache import HybridCache, KVCache, rotate
from ..quants import Activations, QWeight, _kernels, activation_for, load_vector
from .config import ROPE_NEOX, ModelConfig, attn_scale_f32, config_from_gguf
from .fast_decode import DecodePath
from ..switches import switch

Q = gguf.GGMLQuantizationType
_FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)

# Like llama.cpp, a pass of several tokens sums some products in another order than a one-token
# pass (Q4_K and Q6_K matmuls, attention; see qmatmul and ops.c). forward(decode=True) on up to this
# many tokens (speculative verification) computes every row in the one-token order instead, so its
# logits are bit-identical to plain decoding's: with activations rounded to 8 bits, a one-ulp
# difference can flip a rounding and move the logits by a few percent, which would break greedy
# parity. Without the C attention kernel, passes up to this long also run attention row by row.
EXACT_ROWS = 32

# llama.cpp's -fa: on (its CPU default, and the build the fixtures come from) or off; the model's
# `flash_attn` attribute (the CLI's -fa) overrides this default (SHARPI_FLASH_ATTN=0: off)
FLASH_ATTN = switch("SHARPI_FLASH_ATTN")
# (flash_attn, prompt pass) -> the attention kernel's mode (kernels/cpu.py)
_ATTN_MODE = {(False, True): cpu.ATTN_TINYBLAS, (False, False): cpu.ATTN_VEC_DOT,
              (True, True): cpu.ATTN_FA_PROMPT, (True, False): cpu.ATTN_FA_DECODE}


@dataclass(frozen=True)
class Sequences:
    """Several sequences in one pass, laid out as llama.cpp's unified cache holds a batch of them (llama-perplexity's
    multiple-choice batches): row t, at cache position start + t, has token position pos[t]; its sequence's cells are
    [lo[t], hole[t]) (a task's shared prefix, positions 0..) and then [own[t], its own cell] (its continuation's;
    own = hole where the row is in the prefix): the cells between, other sequences', are masked."""
    pos: torch.Tensor  # int64 [T]
    lo: torch.Tensor  # int64 [T]
    hole: torch.Tensor  # int64 [T]
    own: torch.Tensor  # int64 [T]
    # int64 [T] or None: each row's cache cell, in runs of consecutive cells (streams: llama.cpp's sequences in
    # caches of their own, here regions of one; None: start + t)
    cells: torch.Tensor | None = None

    def cells_of(self, start: int) -> torch.Tensor:
        T = self.pos.shape[0]
        return self.cells if self.cells is not None else torch.arange(start, start + T, dtype=torch.int64)

    def runs(self, start: int) -> list[tuple[int, int, int]]:
        """(first row, end row, first cell) of each run of rows of one stream written to consecutive cells."""
        if self.cells is None:
            return [(0, self.pos.shape[0], start)]
        c, lo = self.cells.tolist(), self.lo.tolist()
        out, r0 = [], 0
        for r in range(1, len(c) + 1):
            if r == len(c) or c[r] != c[r - 1] + 1 or lo[r] != lo[r - 1]:
                out.append((r0, r, c[r0]))
                r0 = r
        return out

    def visible(self, start: int, window: int) -> torch.Tensor:
        """int64 [T, 4] for the attention kernel: (first visible cell, the row's cell, the hole [a, b))."""
        cell = self.cells_of(start)
        lo = self.lo
        if window:  # (positions pos - window + 1 on: in the prefix's cells or in the row's own)
            first = (self.pos - window + 1).clamp(min=0)
            n_pre = self.hole - self.lo
            lo = torch.where(first < n_pre, self.lo + first, self.own + (first - n_pre))
        return torch.stack((lo, cell, self.hole, self.own), dim=1).contiguous()


@dataclass
class Experts:
    """A mixture-of-experts FFN: the router and each expert's gate, up and down weights (views of the
    GGUF's [n_expert, rows, row bytes] tensors)."""
    router: QWeight           # ffn_gate_inp [n_expert, D]
    gate: list[QWeight]       # [n_ff_exp, D] each
    up: list[QWeight]
    down: list[QWeight]       # [D, n_ff_exp] each
    # (gpt-oss) fp32 biases: the router's [n_expert], each expert's gate / up [n_expert, n_ff_exp], down [n_expert, D]
    router_b: torch.Tensor | None = None
    gate_b: torch.Tensor | None = None
    up_b: torch.Tensor | None = None
    down_b: torch.Tensor | None = None
    # a shared expert every token runs (qwen2moe, granitemoe): its gate and up fused [2 * n_ff_shexp, D], its down
    # [D, n_ff_shexp], and (qwen2moe) the [1, D] row of its sigmoid gate's logit (ffn_gate_inp_shexp)
    sh_gu: QWeight | None = None
    sh_down: QWeight | None = None
    sh_gate: QWeight | None = None

    def weights(self) -> list[QWeight]:
        shared = [w for w in (self.sh_gu, self.sh_down, self.sh_gate) if w is not None]
        return [self.router, *self.gate, *self.up, *self.down, *shared]

    def id_args(self) -> tuple | None:
        """(gate, up, down) as the C mul_mat_id takes them (kernels.cpu.qmatmul_id): each (type code, the experts'
        weight pointers int64 [n_expert], row bytes, n, k); None when the experts' type has no quantized
        kernel there (float types) or there are no C kernels. Made once (repacking the weights first)."""
        if not hasattr(self, "_id_args"):
            self._id_args = None
            if all(w._kern is not None and w.qtype not in _FLOAT_TYPES for w in self.gate + self.up + self.down):
                kinds = []
                for ws in (self.gate, self.up, self.down):
                    ka = [w.kernel_args() for w in ws]
                    if any(a is None or a[0] != ka[0][0] or a[2] != ka[0][2] for a in ka):
                        return None
                    kinds.append((ka[0][0], torch.tensor([a[1] for a in ka], dtype=torch.int64), ka[0][2], ws[0].n, ws[0].k))
                self._id_args = tuple(kinds)
        return self._id_args


@dataclass
class ShortConv:
    """lfm2's short-convolution block, in place of attention: in_proj -> B, C, x; C * conv(B * x) -> out_proj."""
    in_proj: QWeight        # [3 * D, D]: B rows, C rows, x rows
    out_proj: QWeight       # [D, D]
    taps: torch.Tensor      # fp32 [D, width]: the oldest position's tap first
    index: int              # its convolution layer (HybridCache.conv)


@dataclass
class DeltaNet:
    """qwen35's Gated DeltaNet block, in place of attention: q, k, v through a short convolution and SiLU, q and k
    L2-normed, the gated delta rule over a state per value head, RMS-normed per head times SiLU(z), out-projected."""
    w_qkv: QWeight          # attn_qkv [conv_dim, D]: q rows (key heads), k rows, v rows (value heads)
    w_z: QWeight            # attn_gate [Hv * S, D]
    w_beta: QWeight         # ssm_beta [Hv, D]
    w_alpha: QWeight        # ssm_alpha [Hv, D]
    taps: torch.Tensor      # fp32 [conv_dim, width]: the oldest position's tap first
    dt: torch.Tensor        # fp32 [Hv]: ssm_dt.bias
    a: torch.Tensor         # fp32 [Hv]: ssm_a (-exp(A_log))
    norm: torch.Tensor      # fp32 [S]
    out: QWeight            # ssm_out [D, Hv * S]
    index: int              # its recurrent layer (HybridCache)


@dataclass
class Layer:
    attn_norm: torch.Tensor | None  # (None: no pre-norm, olmo2)
    wqk: QWeight | None     # q and k projections fused: [(H + Hkv) * hd, D], rows in rope-pair order (None: conv)
    wv: QWeight | None
    wo: QWeight | None
    ffn_norm: torch.Tensor | None
    w_gu: QWeight | None    # gate and up fused: [2 * n_ff, D] (None: experts)
    w_down: QWeight | None
    experts: Experts | None = None
    bqk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    qk_norm: torch.Tensor | None = None   # [H + Hkv, hd]: q_norm for q heads, k_norm for k heads
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    conv: ShortConv | None = None  # (lfm2) instead of attention
    bo: torch.Tensor | None = None     # attn_output's bias [D] (gpt-oss)
    sinks: torch.Tensor | None = None  # fp32 [H]: each head's attention sink logit (gpt-oss)
    qk_norm_full: tuple | None = None  # (olmo2) fp32 [H * hd], [Hkv * hd]: q's and k's norm weights in GGUF order
    wgate: QWeight | None = None  # (qwen35) the attention output's gate [H * hdv, D]: output times sigmoid(gate)
    delta: DeltaNet | None = None  # (qwen35) instead of attention
    # GGUF weight name -> (attribute, first row, row order or None): where a LoRA adapter's update of that
    # tensor goes (lora.py); only weights multiplied as they are, or as whole parts of a fused one
    lora_rows: dict = field(default_factory=dict)


def _weight(gf: GGUFFile, name: str) -> QWeight:
    t = gf.tensor(name)
    k, n = (int(s) for s in t.shape[:2])  # GGUF shapes are [K (fastest), N]
    return QWeight(name, t.data, t.tensor_type, n, k)


def _row_weight(gf: GGUFFile, name: str) -> QWeight:
    """A one-dimensional tensor [K] as a weight of one row [1, K] (qwen2moe's ffn_gate_inp_shexp)."""
    t = gf.tensor(name)
    return QWeight(name, t.data.reshape(1, -1), t.tensor_type, 1, int(t.shape[0]))


def _expert_weights(gf: GGUFFile, name: str) -> list[QWeight]:
    """Each expert's matrix of a [n_expert, N, K] tensor, as views."""
    t = gf.tensor(name)
    k, n, e = (int(s) for s in t.shape[:3])
    return [QWeight(f"{name}[{i}]", t.data[i], t.tensor_type, n, k) for i in range(e)]


def _row_parts(gf: GGUFFile, name: str, sizes: list[int]) -> list[QWeight]:
    """Consecutive row ranges of one tensor (phi3's attn_qkv, its gate-then-up ffn_up), as views."""
    w = _weight(gf, name)
    if sum(sizes) != w.n:
        raise SharpiError(f"{gf.path}: tensor '{name}' has {w.n} rows, not {sum(sizes)}")
    bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    return [QWeight(f"{name}[{a}:{b}]", w.raw[a:b], w.qtype, b - a, w.k) for a, b in zip(bounds, bounds[1:])]


def layer_parts(gf: GGUFFile, c: ModelConfig, i: int) -> dict[str, QWeight]:
    """Layer i's q, k, v, gate and up weights in GGUF row order, whether the file keeps them apart or
    fused (phi3: attn_qkv; ffn_up = gate rows then up rows)."""
    p = f"blk.{i}."
    if c.qkv_fused:
        q, k, v = _row_parts(gf, p + "attn_qkv.weight", [c.n_head * c.head_dim_k, c.n_head_kv * c.head_dim_k,
                                                         c.n_head_kv * c.head_dim_v])
    else:
        q, k, v = (_weight(gf, p + f"attn_{n}.weight") for n in "qkv")
    if c.ffn_up_gated:
        gate, up = _row_parts(gf, p + "ffn_up.weight", [c.n_ff, c.n_ff])
    else:
        gate, up = _weight(gf, p + "ffn_gate.weight"), _weight(gf, p + "ffn_up.weight")
    return dict(q=q, k=k, v=v, gate=gate, up=up)


def qkv_biases(gf: GGUFFile, c: ModelConfig, i: int) -> tuple:
    """Layer i's q, k and v biases (fp32 tensors; None where absent): attn_q / _k / _v.bias, or attn_qkv.bias cut
    into them (a fused file's, llama.cpp's create_tensor_qkv)."""
    p = f"blk.{i}."
    if c.qkv_bias_fused and p + "attn_qkv.bias" in gf.tensors:
        b = load_vector(gf.tensor(p + "attn_qkv.bias"))
        q, k = c.n_head * c.head_dim_k, c.n_head_kv * c.head_dim_k
        return b[:q], b[q:q + k], b[q + k:]
    return tuple(load_vector(gf.tensor(p + n)) if p + n in gf.tensors else None
                 for n in ("attn_q.bias", "attn_k.bias", "attn_v.bias"))


def _fused(gf: GGUFFile, name: str, parts: list[str], row_order: list | None = None) -> QWeight:
    """One weight whose rows are the parts' rows in turn (one matmul instead of several).

    When the parts lie back to back in the file with the same type and width and keep their row
    order (ffn_gate then ffn_up in most GGUFs), the fused weight is a view of the mmap: no copy,
    so resident memory stays at the file size. Otherwise the rows are copied (QWeight.concat)."""
    ws = [_weight(gf, p) for p in parts]
    ts = [gf.tensor(p) for p in parts]
    adjacent = all(
        a.tensor_type == b.tensor_type and wa.k == wb.k and a.data_offset + a.n_bytes == b.data_offset
        and gf.part_of[pa] == gf.part_of[pb]  # (a split model: in the same file)
        for a, b, wa, wb, pa, pb in zip(ts, ts[1:], ws, ws[1:], parts, parts[1:]))
    if adjacent and row_order is None:
        start, end = ts[0].data_offset, ts[-1].data_offset + ts[-1].n_bytes
        # (float types are [N, K] arrays of their dtype, quantized ones [N, row bytes] of uint8)
        raw = gf.data_of(parts[0])[start:end].view(ts[0].data.dtype).reshape(sum(w.n for w in ws), -1)
        return QWeight(name, raw, ws[0].qtype, sum(w.n for w in ws), ws[0].k)
    return QWeight.concat(name, ws, row_order)


_KERN: list = []  # [kernels module or None], resolved at the first call


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    if not _KERN:
        _KERN.append(_kernels())
    if _KERN[0] is not None:  # one C call instead of torch's several ops, and ggml's rounding
        return _KERN[0].rms_norm(x, w, eps)
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def neox_to_pairs(hd: int, n_rot: int) -> torch.Tensor:
    """Index order that turns NeoX rope (dim i pairs with i + n_rot/2) into adjacent pairs (2i, 2i+1).

    Applied to the rows of Wq/Wk (and their biases and norms) at load, it leaves every q.k dot
    product unchanged, so one rope implementation (complex multiply on adjacent pairs) serves both."""
    half = n_rot // 2
    idx = torch.arange(hd)
    idx[:n_rot] = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).flatten()
    return idx


def check_pass(start_pos: int, T: int, cache) -> None:
    """A pass of T tokens at start_pos must extend the cache and fit in it."""
    if start_pos != cache.length:
        raise ValueError(f"forward at position {start_pos} but the cache holds {cache.length}")
    if start_pos + T > cache.capacity:
        raise SharpiError(f"context full: {start_pos + T} tokens > context size {cache.capacity}")


def pass_tokens(tokens, start_pos: int, cache) -> torch.Tensor:
    """A forward pass's tokens as a 1-D long tensor, after check_pass."""
    tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    check_pass(start_pos, tokens.shape[0], cache)
    return tokens


def prompt_pass(T: int, decode: bool) -> bool:
    """Whether a pass of T tokens runs in llama.cpp's prompt-processing order (matmuls, attention)
    rather than as decoding rows (see EXACT_ROWS)."""
    return T > 1 and not (decode and T <= EXACT_ROWS)


def yarn_corr_dims(n_rot: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the pairs [low, high] over which YaRN ramps from extrapolated to
    interpolated angles (pairs turning beta_fast / beta_slow times in n_ctx_orig positions)."""
    def dim(beta):
        return n_rot * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))
    return max(0.0, math.floor(dim(beta_fast))), min(n_rot - 1.0, math.ceil(dim(beta_slow)))


def attention_scales(c: ModelConfig) -> tuple[float, float]:
    """(the attention scale, what the q.k scores are multiplied by: 1 when q is scaled instead)."""
    scale = c.attn_scale or attn_scale_f32(c.head_dim_k)
    return scale, 1.0 if c.scale_q else scale


class Transformer:
    exact_rows = EXACT_ROWS  # the longest pass whose rows forward(decode=True) computes as one-token passes do

    def __init__(self, gf: GGUFFile, config: ModelConfig | None = None):
        self.gguf = gf
        self.config = c = config or config_from_gguf(gf)
        self.tok_embd = _weight(gf, "token_embd.weight")
        self.output = self.tok_embd if c.tied_output else _weight(gf, "output.weight")
        self.output_norm = load_vector(gf.tensor(c.output_norm_name))
        hd = c.head_dim_k
        perm = neox_to_pairs(hd, c.n_rot) if c.rope_style == ROPE_NEOX else torch.arange(hd)
        vec = lambda name: load_vector(gf.tensor(name))  # noqa: E731
        self.layers: list[Layer] = []
        if c.ssm_d_state and _kernels() is None:  # (no reference path for the Gated DeltaNet in torch)
            why = "SHARPI_CPU_KERNEL=0" if not switch("SHARPI_CPU_KERNEL") else cpu.unavailable_reason()
            raise SharpiError(f"{gf.path}: a {c.arch} model needs sharpi's C kernels, which are unavailable here ({why})")
        for i in range(c.n_layer):
            p = f"blk.{i}."
            if c.is_recurrent(i) and c.ssm_d_state:
                dn = DeltaNet(*(_weight(gf, p + n + ".weight") for n in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")),
                              vec(p + "ssm_conv1d.weight").reshape(c.ssm_conv_dim, c.conv_width).contiguous(),
                              vec(p + "ssm_dt.bias"), vec(p + "ssm_a"), vec(p + "ssm_norm.weight"),
                              _weight(gf, p + "ssm_out.weight"), sum(c.recurrent[:i]))
                w_gu, w_down, experts, _ = self.ffn_weights(gf, i)
                self.layers.append(Layer(
                    attn_norm=vec(p + "attn_norm.weight"), wqk=None, wv=None, wo=None, ffn_norm=vec(p + c.ffn_norm_name),
                    w_gu=w_gu, w_down=w_down, experts=experts, delta=dn))
                continue
            if c.is_recurrent(i):
                taps = vec(p + "shortconv.conv.weight").reshape(c.n_embd, c.conv_width).contiguous()
                conv = ShortConv(_weight(gf, p + "shortconv.in_proj.weight"), _weight(gf, p + "shortconv.out_proj.weight"),
                                 taps, sum(c.recurrent[:i]))
                self.layers.append(Layer(
                    attn_norm=vec(p + "attn_norm.weight"), wqk=None, wv=None, wo=None,
                    ffn_norm=vec(p + "ffn_norm.weight"),
                    w_gu=_fused(gf, p + "ffn_gate_up", [p + "ffn_gate.weight", p + "ffn_up.weight"]),
                    w_down=_weight(gf, p + "ffn_down.weight"), conv=conv))
                continue
            self.layers.append(self.attention_layer(gf, i))
        self._rope_cache: dict[tuple, torch.Tensor] = {}  # (base, freq scale) -> complex64 [n_pos, n_rot/2]
        self._temps: torch.Tensor | None = None  # float32 [n_pos]: attention temperatures (mistral3), grown by doubling
        # [n_rot/2] divisors of the pairs' frequencies (Llama 3.1+; phi3's long or short ones, by the
        # context size: use_context), in every layer's RoPE and K-shift
        self._factor_sets = {}
        for name in (("rope_freqs.weight",) if c.rope_freqs else ("rope_factors_long.weight", "rope_factors_short.weight")
                     if c.rope_long_short else ()):
            f = self._factor_sets[name] = vec(name)
            if not bool(torch.isfinite(f).all() and (f > 0).all()):
                raise SharpiError(f"{gf.path}: {name} holds factors that are not positive finite numbers")
        self._rope_factors = self._factor_sets.get("rope_freqs.weight", self._factor_sets.get("rope_factors_short.weight"))
        self._ropes = sorted({c.layer_rope(i) for i in range(c.n_layer)})  # the layers' (base, freq scale)
        self._kv_layer = {layer: j for j, layer in enumerate(c.attn_layers)}  # model layer -> KV cache layer
        # back to the GGUF's head-dim order: the q.k dot products sum in llama.cpp's element order, and
        # a q8_0 K cache quantizes the same blocks of 32 consecutive dims (which dims share a block
        # decides its error: Qwen2's K has large outlier dims)
        self._unperm = torch.argsort(perm) if c.rope_style == ROPE_NEOX else None
        self._perm = perm if c.rope_style == ROPE_NEOX else None
        kern = _kernels()
        # C attention (sharpi_core/kernels/ops.c); it needs head sizes in multiples of 32, at most 512
        self._attn_kernel = (getattr(kern, "attention", None) if hd % 32 == 0 and c.head_dim_v % 32 == 0
                             and max(hd, c.head_dim_v) <= 512 else None)
        self._rope_kernel = getattr(kern, "rope", None)
        self._glu_kernel = getattr(kern, "glu", None) if (c.n_ff_exp or c.n_ff) % 16 == 0 else None
        # trace(name, tensor) with llama.cpp's graph names ("attn_norm-3", ...): None except when a
        # script compares intermediate values with llama.cpp's (scripts/compare_llamacpp_logits.py)
        self.trace = None
        self._fast: DecodePath | bool | None = None  # the decoding fast path (False: not for this model)
        # flash attention as llama.cpp computes it on the CPU (its default, -fa auto); False: its -fa off path
        self.flash_attn = FLASH_ATTN
        # control vectors (control_vector.load): {layer i: float32 [D] added to its output}
        self.control: dict[int, torch.Tensor] = {}
        self.embd_loras: list = []  # LoRA updates of the token embedding (lora.load; the weights hold theirs)
        self.has_loras = False      # (lora.load: the decoding fast path does not apply them)

    def attention_layer(self, gf: GGUFFile, i: int) -> Layer:
        """Layer i's weights as an attention layer (a next-token-prediction block's at i = n_layer: qwen35's MTP)."""
        c = self.config
        p = f"blk.{i}."
        H, Hkv, hd = c.n_head, c.n_head_kv, c.head_dim_k
        perm = neox_to_pairs(hd, c.n_rot) if c.rope_style == ROPE_NEOX else torch.arange(hd)
        q_rows = (torch.arange(H)[:, None] * hd + perm[None, :]).flatten().numpy()
        k_rows = (torch.arange(Hkv)[:, None] * hd + perm[None, :]).flatten().numpy()
        vec = lambda name: load_vector(gf.tensor(name))  # noqa: E731
        opt = lambda name: vec(name) if name in gf.tensors else None  # noqa: E731
        order = [q_rows, k_rows] if c.rope_style == ROPE_NEOX else None
        bq, bk, bv = qkv_biases(gf, c, i)
        qn, kn = opt(p + "attn_q_norm.weight"), opt(p + "attn_k_norm.weight")
        wgate = None
        lora_rows = {}
        if c.qkv_fused:  # (views of one attn_qkv; q and k rows copied into rope-pair order)
            parts = layer_parts(gf, c, i)
            wqk, wv = QWeight.concat(p + "attn_qk", [parts["q"], parts["k"]], order), parts["v"]
        elif c.attn_gate:  # (each head's q rows, then its gate's: copied apart)
            wq = _weight(gf, p + "attn_q.weight")
            head0 = torch.arange(H)[:, None] * 2 * hd
            wqk = QWeight.concat(p + "attn_qk", [wq, _weight(gf, p + "attn_k.weight")],
                                 [(head0 + perm[None, :]).flatten().numpy(), k_rows])
            wgate = QWeight.concat(p + "attn_q_gate", [wq], [(head0 + hd + torch.arange(hd)).flatten().numpy()])
            wv = _weight(gf, p + "attn_v.weight")
        else:
            wqk = _fused(gf, p + "attn_qk", [p + "attn_q.weight", p + "attn_k.weight"], order)
            wv = _weight(gf, p + "attn_v.weight")
            lora_rows.update({p + "attn_q.weight": ("wqk", 0, order and order[0]),
                              p + "attn_k.weight": ("wqk", H * hd, order and order[1]),
                              p + "attn_v.weight": ("wv", 0, None)})
        w_gu, w_down, experts, ffn_rows = self.ffn_weights(gf, i)
        lora_rows.update(ffn_rows)
        lora_rows[p + "attn_output.weight"] = ("wo", 0, None)
        return Layer(
            attn_norm=vec(p + "attn_norm.weight") if c.pre_norms else None,
            wqk=wqk, wv=wv, wo=_weight(gf, p + "attn_output.weight"),
            ffn_norm=vec(p + c.ffn_norm_name) if c.pre_norms else None, w_gu=w_gu,
            w_down=w_down, experts=experts,
            bqk=torch.cat((bq[q_rows], bk[k_rows])) if bq is not None else None,
            bv=bv,
            qk_norm=torch.cat((qn[perm].expand(H, hd), kn[perm].expand(Hkv, hd))) if qn is not None and c.qk_norm else None,
            qk_norm_full=(qn, kn) if c.qk_norm_full else None,
            post_attn_norm=opt(p + "post_attention_norm.weight") if c.post_norms else None,
            post_ffn_norm=opt(p + "post_ffw_norm.weight"),
            bo=opt(p + "attn_output.bias"), sinks=opt(p + "attn_sinks.weight"), wgate=wgate, lora_rows=lora_rows,
        )

    def ffn_weights(self, gf: GGUFFile, i: int) -> tuple:
        """Layer i's FFN: (w_gu, w_down, experts, LoRA rows): a dense SwiGLU / GeGLU's fused gate and up and its down,
        or (None, None, the mixture of experts)."""
        c, p = self.config, f"blk.{i}."
        if c.n_expert:
            if i in c.gate_up_exps:  # (each expert's gate rows, then its up rows: two views of each)
                gu, f = _expert_weights(gf, p + "ffn_gate_up_exps.weight"), c.n_ff_exp
                gate = [QWeight(w.name + "[gate]", w.raw[:f], w.qtype, f, w.k) for w in gu]
                up = [QWeight(w.name + "[up]", w.raw[f:], w.qtype, f, w.k) for w in gu]
            else:
                gate, up = (_expert_weights(gf, p + f"ffn_{n}_exps.weight") for n in ("gate", "up"))
            experts = Experts(_weight(gf, p + "ffn_gate_inp.weight"), gate, up, _expert_weights(gf, p + "ffn_down_exps.weight"))
            if c.moe_bias:  # (GGUF [n_ff_exp, n_expert] -> one row per expert)
                experts.router_b = load_vector(gf.tensor(p + "ffn_gate_inp.bias"))
                experts.gate_b, experts.up_b, experts.down_b = (
                    load_vector(gf.tensor(p + f"ffn_{n}_exps.bias")).view(c.n_expert, -1) for n in ("gate", "up", "down"))
            if c.n_ff_shexp:
                experts.sh_gu = _fused(gf, p + "ffn_gate_up_shexp", [p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"])
                experts.sh_down = _weight(gf, p + "ffn_down_shexp.weight")
                if c.shexp_gated:
                    experts.sh_gate = _row_weight(gf, p + "ffn_gate_inp_shexp.weight")
            return None, None, experts, {}
        if c.ffn_up_gated:  # (gate rows then up rows: w_gu's own layout)
            return _weight(gf, p + "ffn_up.weight"), _weight(gf, p + "ffn_down.weight"), None, {}
        w_gu = _fused(gf, p + "ffn_gate_up", [p + "ffn_gate.weight", p + "ffn_up.weight"])
        return w_gu, _weight(gf, p + "ffn_down.weight"), None, {
            p + "ffn_gate.weight": ("w_gu", 0, None), p + "ffn_up.weight": ("w_gu", w_gu.n // 2, None),
            p + "ffn_down.weight": ("w_down", 0, None)}

    # -- sizes -------------------------------------------------------------------------
    def _layer_weights(self) -> list[QWeight]:
        return [w for ly in self.layers for w in [ly.wqk, ly.wv, ly.wo, ly.w_gu, ly.w_down, ly.wgate]
                + (ly.experts.weights() if ly.experts else []) + ([ly.conv.in_proj, ly.conv.out_proj] if ly.conv else [])
                + ([ly.delta.w_qkv, ly.delta.w_z, ly.delta.w_beta, ly.delta.w_alpha, ly.delta.out] if ly.delta else [])
                if w is not None]

    @property
    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for w in [self.tok_embd, self.output] + self._layer_weights():
            if id(w) not in seen:
                seen.add(id(w))
                total += w.nbytes
        return total

    def pack_weights(self) -> None:
        """Repack the weights whose CPU kernel takes another layout (Q4_K, Q4_1) now, at load, instead of at
        their first matmul (QWeight.pack): for a model that runs on the CPU."""
        for w in [self.output] + self._layer_weights():
            w.pack()

    def lora_targets(self) -> dict:
        """{GGUF weight name: (QWeight, first output row, row order or None)}: the weights a LoRA adapter
        may update (lora.py), and where their rows went in the fused weights."""
        out = {} if self.config.tied_output else {"output.weight": (self.output, 0, None)}
        for ly in self.layers:
            for name, (attr, off, order) in ly.lora_rows.items():
                out[name] = (getattr(ly, attr), off, order)
        return out

    def use_context(self, n_ctx: int) -> bool:
        """The RoPE factors a context of n_ctx tokens takes (llama.cpp's get_rope_factors: phi3's long
        ones past rope.scaling.original_context_length, else the short ones); new_cache calls it.
        True when that changed them (rope tables made before are stale)."""
        if not self.config.rope_long_short:
            return False
        f = self._factor_sets[f"rope_factors_{self.rope_factor_set(n_ctx)}.weight"]
        if f is self._rope_factors:
            return False
        self._rope_factors = f
        self._rope_cache.clear()
        return True

    def rope_factor_set(self, n_ctx: int) -> str | None:
        """Which RoPE factors a context of n_ctx tokens takes, "long" or "short" (None: the model has one set)."""
        if not self.config.rope_long_short:
            return None
        return "long" if n_ctx > self.config.n_ctx_orig else "short"

    def sequences_ok(self) -> bool:
        """Whether a pass can hold several sequences (forward's seqs): attention by the C kernel, which masks other
        sequences' cells, and no recurrent layers (whose states run along the rows)."""
        return self._attn_kernel is not None and not self.config.recurrent

    def new_cache(self, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> KVCache:
        c = self.config
        self.use_context(n_ctx)
        if self.flash_attn:
            # llama.cpp's flash attention casts an f32 K or V to f16 before attending (llama-graph's build_attn_mha):
            # the numbers of an f16 cache, which is what such a cache holds here then (half the memory)
            type_k, type_v = ("f16" if t == "f32" else t for t in (type_k, type_v))
        if c.recurrent:
            n_conv = sum(c.recurrent)
            ssm = (c.ssm_dt_rank, c.ssm_d_state) if c.ssm_d_state else None
            cache = HybridCache(c.n_layer - n_conv, n_ctx, c.n_head_kv, c.head_dim_k, c.head_dim_v, type_k, type_v,
                                n_conv, c.ssm_conv_dim if ssm else c.n_embd, c.conv_width, ssm)
        else:
            cache = KVCache(c.n_layer, n_ctx, c.n_head_kv, c.head_dim_k, c.head_dim_v, type_k, type_v)
        cache.rope_factors = self.rope_factor_set(n_ctx)
        return cache

    def set_rope(self, base: float = 0.0, freq_scale: float = 0.0, scaling: str | None = None,
                 yarn: dict | None = None) -> None:
        """llama.cpp's --rope-freq-base / --rope-freq-scale / --rope-scaling (0 / None: the model's) and
        --yarn-* (yarn: ModelConfig's yarn_* fields given): the layers' RoPE from now on (sliding layers
        keep theirs, as llama.cpp's). Call before the first pass."""
        c = self.config
        kind = scaling or c.rope_scaling
        scale = 1.0 if kind == "none" else (freq_scale or c.rope_freq_scale)
        self.config = replace(c, rope_base=base or c.rope_base, rope_freq_scale=scale, rope_scaling=kind, **(yarn or {}))
        self._ropes = sorted({self.config.layer_rope(i) for i in range(c.n_layer)})
        self._rope_cache.clear()
        self._fast = None  # (the C layer loop's set-up holds each layer's table by its index in _ropes)

    def shift_k(self, layer: int, k: torch.Tensor, delta: int, rot_k: int | None) -> torch.Tensor:
        """K rows [n, n_kv, hd] fp32 as a cache stores them (GGUF head-dim order; Hadamard-rotated by rot_k)
        for positions moved by delta: RoPE by delta, as llama.cpp's K-shift (rope with the shift as the
        position; the rotation of delta < 0 is the conjugate of |delta|'s, as ggml's float theta and
        libm's cosf/sinf give it). A layer without RoPE keeps its K as it is (llama.cpp's K-shift rotates
        smollm3's too: its rope_pattern does not know them; sharpi does not follow that)."""
        if not self.config.has_rope(layer):
            return k.clone()  # (k may be a view of an f32 cache's rows that are about to move)
        k = rotate(k, rot_k)  # un-rotated (H @ H = I)
        # a copy in rope-pair order (the rope kernel works in place; k may be a view of an f32 cache)
        k = k[..., self._perm] if self._perm is not None else k.clone(memory_format=torch.contiguous_format)
        rot = self._rope_table(self.config.layer_rope(layer), abs(delta) + 1)[abs(delta)]
        rot = (rot.conj() if delta < 0 else rot).resolve_conj()
        k = self._rope(k.contiguous(), rot.expand(k.shape[0], -1).contiguous())
        if self._unperm is not None:
            k = k[..., self._unperm]
        return rotate(k.contiguous(), rot_k)

    def shift_cache(self, cache, n_keep: int, n_discard: int, first_layer: int = 0) -> None:
        """Context shift (llama.cpp's --context-shift): forget positions [n_keep, n_keep + n_discard) and
        move the later ones down, their K re-rotated for the new positions (KVCache.shift; the GPU models'
        caches have the same shift(), cache layer j being model layer first_layer + j)."""
        layers = self.config.attn_layers  # (cache layer j: the j-th layer with attention)
        cache.shift(n_keep, n_discard, lambda j, k: self.shift_k(layers[first_layer + j], k, -n_discard, cache.rot_k))

    # -- pieces --------------------------------------------------------------------------
    def _rope_table(self, rope: tuple[float, float], n_pos: int) -> torch.Tensor:
        """Rotations for positions [0, n_pos) as complex64 [n_pos, n_rot/2], grown by doubling.

        Built the way ggml's rope cache is: theta_i = theta_{i-1} * powf(base, -2/n_rot) multiplied
        in float32 from theta_0 = pos, divided by rope_freqs' factor (if any), times the frequency scale, then cosf / sinf (the C kernels call libm's; without them,
        cos / sin in double rounded to float). The rounding of the activations makes later layers
        sensitive to differences of one ulp here."""
        tab = self._rope_cache.get(rope)
        if tab is not None and tab.shape[0] >= n_pos:
            return tab
        n = max(n_pos, 2 * (tab.shape[0] if tab is not None else 256))
        c = self.config
        if self._rope_kernel is not None:
            tab = _kernels().rope_table(*rope, n, c.n_rot, self._rope_factors, c.rope_mscale, c.yarn)
        else:
            base, freq_scale = rope
            scale = torch.tensor(base, dtype=torch.float64).pow(-2.0 / c.n_rot).float()
            theta = torch.empty(n, c.n_rot // 2, dtype=torch.float32)
            theta[:, 0] = torch.arange(n, dtype=torch.float32)
            for i in range(1, theta.shape[1]):  # once per table, not per token
                theta[:, i] = theta[:, i - 1] * scale
            if self._rope_factors is not None:
                theta = theta / self._rope_factors
            th = theta * torch.tensor(freq_scale, dtype=torch.float32)
            ms = torch.tensor(c.rope_mscale, dtype=torch.float32)
            ext, orig, beta_fast, beta_slow = c.yarn
            if ext:  # YaRN (the C kernel's arithmetic, without its FMAs)
                low, high = yarn_corr_dims(c.n_rot, orig, base, beta_fast, beta_slow)
                y = (torch.arange(c.n_rot // 2, dtype=torch.float32) - low) / max(0.001, high - low)
                mix = (1 - y.clamp(0, 1)) * ext
                th = th * (1 - mix) + theta * mix
                ms = ms * (1 + 0.1 * math.log(1 / freq_scale))
            t64 = th.double()
            tab = torch.complex(t64.cos().float() * ms, t64.sin().float() * ms)
        if c.rope_fixed_pairs:  # (M-RoPE's fourth section: position 0 for text tokens, row 0's rotation everywhere)
            cols = list(c.rope_fixed_pairs)
            tab[:, cols] = tab[0, cols]
        self._rope_cache[rope] = tab
        return tab

    def _attn_temps(self, n_pos: int) -> torch.Tensor:
        """float32 [n] (n >= n_pos): q's attention temperature at each position (ModelConfig.attn_temps)."""
        tab = self._temps
        if tab is None or tab.shape[0] < n_pos:
            n = max(n_pos, 2 * (tab.shape[0] if tab is not None else 256))
            tab = self._temps = torch.from_numpy(self.config.attn_temps(n))
        return tab

    def _rope(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        # x [T, heads, hd] with rope pairs adjacent (see neox_to_pairs); rotates the first n_rot dims
        # by rot [T, n_rot/2]; the C kernel rounds like ggml (FMAs), the complex multiply nearly so
        if self._rope_kernel is not None:
            return self._rope_kernel(x.contiguous(), rot)
        n_rot = self.config.n_rot
        T, nh, hd = x.shape
        rot = rot[:, None, :]
        if n_rot == hd:
            return torch.view_as_real(torch.view_as_complex(x.reshape(T, nh, hd // 2, 2)) * rot).view(T, nh, hd)
        xr = torch.view_as_real(torch.view_as_complex(x[..., :n_rot].reshape(T, nh, n_rot // 2, 2)) * rot)
        return torch.cat((xr.reshape(T, nh, n_rot), x[..., n_rot:]), dim=-1)

    def _attention(self, q: torch.Tensor, cache: KVCache, layer: int, L: int, mask: torch.Tensor | None,
                   scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, hd] against the cache's first L positions -> [T, H * hdv].

        Computed the way llama.cpp's CPU backend does without flash attention: q is rounded to
        K's type for the KQ product, softmax in fp32, and the probabilities are rounded to V's
        type (fp16) for the product with V. Matching this keeps greedy output on llama.cpp's."""
        c = self.config
        T, H, hd = q.shape
        Hkv, hdv = c.n_head_kv, c.head_dim_v
        G = H // Hkv
        qh = activation_for(q, cache.k.qtype).view(T, Hkv, G, hd).permute(1, 2, 0, 3).reshape(Hkv, G * T, hd)
        K = cache.k.read(layer, L)  # [L, Hkv, hd]
        V = cache.v.read(layer, L)  # [L, Hkv, hdv]
        s = torch.bmm(qh, K.permute(1, 2, 0))  # [Hkv, G*T, L]
        if c.attn_softcap:
            s = s.mul_(1.0 / c.attn_softcap).tanh_().mul_(c.attn_softcap)
        s = s.mul_(scale)
        if mask is not None:
            s.view(Hkv, G, T, L).masked_fill_(~mask, float("-inf"))
        if sinks is not None:  # one more logit per head, with no value (gpt-oss)
            sk = sinks.view(Hkv, G, 1, 1).expand(Hkv, G, T, 1).reshape(Hkv, G * T, 1)
            p = torch.softmax(torch.cat((s, sk), dim=-1), dim=-1)[..., :L]
        else:
            p = torch.softmax(s, dim=-1)
        if cache.v.qtype == Q.F16:
            p = p.half().float()
        o = torch.bmm(p, V.permute(1, 0, 2))  # [Hkv, G*T, hdv]
        return o.view(Hkv, G, T, hdv).permute(2, 0, 1, 3).reshape(T, H * hdv)

    def _qk_norm_full(self, qk: torch.Tensor, weights: tuple) -> torch.Tensor:
        """olmo2's q / k norms on qk [T, H + Hkv, hd] (heads' dims in rope-pair order): q's RMS over all its heads,
        k's over all of its, summed in the GGUF's element order as ggml_rms_norm sums them, times the weights."""
        H, T = self.config.n_head, qk.shape[0]
        out = []
        for part, w in ((qk[:, :H], weights[0]), (qk[:, H:], weights[1])):
            if self._unperm is not None:
                part = part[..., self._unperm]
            part = rms_norm(part.reshape(T, -1).contiguous(), w, self.config.norm_eps).view(T, -1, qk.shape[2])
            out.append(part[..., self._perm] if self._perm is not None else part)
        return torch.cat(out, dim=1)

    def _glu(self, gu: torch.Tensor, n_ff: int | None = None) -> torch.Tensor:
        """[T, 2 * n_ff] (gate, up) -> act(gate) * up [T, n_ff]; swiglu_oai (gpt-oss): gate clamped above at
        7 times sigmoid(1.702 gate), times up clamped to [-7, 7] plus 1 (ggml_swiglu_oai)."""
        c = self.config
        n_ff = n_ff or c.n_ff
        if self._glu_kernel is not None and n_ff % 16 == 0:  # llama.cpp's rounding: ggml's / libm's expf, its fp16 GELU table
            return self._glu_kernel(gu, n_ff, c.act)
        g, u = gu.split(n_ff, dim=-1)
        if c.act == "swiglu_oai":
            x = g.clamp(max=7.0)
            return x / (1 + torch.exp(x * -1.702)) * (u.clamp(-7.0, 7.0) + 1)
        return (F.silu(g) if c.act == "silu" else F.gelu(g, approximate="tanh")) * u

    def _moe(self, ex: Experts, h: torch.Tensor, prompt: bool) -> torch.Tensor:
        """The mixture-of-experts FFN of h [T, D] -> [T, D], as llama.cpp's build_moe_ffn computes it: router
        logits, ggml_soft_max, the n_expert_used most probable experts (descending), their probabilities
        over their (double) sum, each expert's SwiGLU FFN times its weight, and the experts' outputs added
        in that order. gpt-oss (softmax_weight gating, biases): the router's bias added to its logits, the
        experts with the largest logits, ggml_soft_max over those; each expert's gate, up and down matmuls
        plus that expert's biases. Expert matmuls are ggml's mul_mat_id: every row in the one-token order,
        whatever T. qwen2moe: the top experts' probabilities as they are (no renormalization), and the shared
        expert's SwiGLU FFN times sigmoid(its gate's logit) added to the experts' sum; granitemoe's shared expert
        is added as it is."""
        c = self.config
        T, k = h.shape[0], c.n_expert_used
        kern = _kernels()
        # (converters keep routers in f32: its kernel sums in ggml's orders, vec_dot / tinyBLAS by `prompt`)
        a = Activations(h, prompt)
        logits = a(ex.router)  # [T, n_expert]
        if kern is not None:
            ids, w = kern.moe_route(logits.contiguous(), k, c.expert_gating, ex.router_b, c.expert_weights_norm)  # [T, k]
            args = ex.id_args()
            if args is not None:  # every expert matmul of the pass in one C call per matrix kind
                return self._shared_expert(ex, a, self._experts_c(ex, args, h, ids, w))
            top = ids.long()
        else:
            top, w = self._route(ex, logits)
        out = torch.zeros(T, k, h.shape[1])
        for e in torch.unique(top).tolist():
            rows, slots = (top == e).nonzero(as_tuple=True)
            a = Activations(h[rows], False)
            g, u = a(ex.gate[e]), a(ex.up[e])  # [n, n_ff_exp] each
            if ex.gate_b is not None:
                g, u = g + ex.gate_b[e], u + ex.up_b[e]
            d = ex.down[e](self._glu(torch.cat((g, u), dim=1), c.n_ff_exp), False)
            if ex.down_b is not None:
                d = d + ex.down_b[e]
            out[rows, slots] = d * w[rows, slots, None]
        y = out[:, 0]
        for j in range(1, k):
            y = y + out[:, j]
        return self._shared_expert(ex, a, y)

    def _shared_expert(self, ex: Experts, a: Activations, y: torch.Tensor) -> torch.Tensor:
        """y [T, D] (the routed experts' sum) plus the shared expert's FFN of a's rows, times its sigmoid gate
        where it has one (qwen2moe's graph: ggml_silu(x) / x of the gate's logit x; qwen35moe's: ggml_sigmoid); y itself
        without a shared expert."""
        if ex.sh_gu is None:
            return y
        sh = ex.sh_down(self._glu(a(ex.sh_gu), self.config.n_ff_shexp), a.prompt)  # [T, D]
        if ex.sh_gate is None:
            return y + sh
        gx = a(ex.sh_gate)  # [T, 1]
        kern, plain = _kernels(), self.config.shexp_plain_sigmoid
        if kern is not None:
            return kern.shexp_add(gx.contiguous(), sh.contiguous(), y.contiguous(), plain)
        return y + sh * (torch.sigmoid(gx) if plain else F.silu(gx) / gx)

    def _route(self, ex: Experts, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Without the C kernels: the experts [T, k] and their weights [T, k], as kernels.cpu.moe_route picks them."""
        c = self.config
        k = c.n_expert_used
        if ex.router_b is not None:
            logits = logits + ex.router_b
        if c.expert_gating == "softmax_weight":
            top = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]  # [T, k]
            return top, torch.softmax(logits.gather(1, top), dim=-1)
        probs = torch.softmax(logits, dim=-1)
        top = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]  # [T, k]
        w = probs.gather(1, top)  # [T, k]
        if not c.expert_weights_norm:
            return top, w
        total = w[:, 0].double()
        for j in range(1, k):  # ggml_vec_sum_f32: in order, in double
            total = total + w[:, j].double()
        return top, w / total.float().clamp_min(6.103515625e-5)[:, None]

    def _experts_c(self, ex: Experts, args: tuple, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The chosen experts' FFNs on h [T, D] (ids, w [T, k]: moe_route's) through the C mul_mat_id, summed."""
        kern = _kernels()
        T, k = ids.shape
        (gcode, gptr, grb, nff, D), (ucode, uptr, urb, _, _), (dcode, dptr, drb, _, _) = args
        ids = ids.view(-1)  # [T * k]: token t's experts in turn
        tok = torch.arange(T, dtype=torch.int32).repeat_interleave(k)
        gu = torch.empty(T * k, 2 * nff)
        kern.qmatmul_id(h, gcode, gptr, grb, nff, D, ids, tok, ex.gate_b, gu[:, :nff])
        kern.qmatmul_id(h, ucode, uptr, urb, nff, D, ids, tok, ex.up_b, gu[:, nff:])
        g = self._glu(gu, nff)  # [T * k, n_ff_exp]
        d = kern.qmatmul_id(g, dcode, dptr, drb, D, nff, ids, torch.arange(T * k, dtype=torch.int32), ex.down_b)
        return kern.moe_sum(d, w)

    def _short_conv(self, sc: ShortConv, h: torch.Tensor, cache: HybridCache, slots: tuple, prompt: bool) -> torch.Tensor:
        """lfm2's convolution block on h [T, D] -> [T, D], as llama.cpp's build_shortconv_block: B * x, the
        causal convolution over the state's rows and the pass's (ggml_ssm_conv), times C, out_proj (slots:
        the pass's HybridCache.conv_slots)."""
        T, D = h.shape[0], self.config.n_embd
        bcx = Activations(h, prompt)(sc.in_proj)  # [T, 3 * D]
        ext = torch.empty(self.config.conv_width - 1 + T, D)  # [d + T, D]: the state's rows, then B * x
        torch.mul(bcx[:, :D], bcx[:, 2 * D:], out=ext[ext.shape[0] - T:])
        cache.conv_fill(sc.index, slots, ext)
        cg = bcx[:, D:2 * D]
        kern = _kernels()
        if kern is not None:
            y = kern.short_conv(ext, sc.taps)
        else:  # the FMAs in double (each product exact, the sum rounded twice: a last-bit difference at most, rarely)
            e64, w64 = ext.double(), sc.taps.double()
            y = torch.zeros(T, D)
            for j in range(sc.taps.shape[1]):  # (the width: 3)
                y = (e64[j:j + T] * w64[:, j] + y.double()).float()
        return sc.out_proj(cg * y, prompt)

    def _delta_net(self, dn: DeltaNet, h: torch.Tensor, cache: HybridCache, slots: tuple, slot0: int,
                   prompt: bool) -> torch.Tensor:
        """qwen35's Gated DeltaNet block on h [T, D] -> [T, D], as llama.cpp's build_layer_attn_linear with its fused
        ggml_gated_delta_net: q, k, v rows convolved over the state's rows and the pass's (ggml_ssm_conv), SiLU, q and
        k L2-normed (ggml_rms_norm with eps / S, times 1 / sqrt(S)), the delta rule with decay exp(softplus(alpha +
        dt) * a) and sigmoid(beta) over the states in the cache's ring (from slot slot0), each head's output
        RMS-normed times the norm weight times SiLU(z), ssm_out. The C kernels only (CPU)."""
        c, kern = self.config, _kernels()
        T, S, Hk, Hv = h.shape[0], c.ssm_d_state, c.ssm_n_group, c.ssm_dt_rank
        a = Activations(h, prompt)
        z, beta, alpha = a(dn.w_z), a(dn.w_beta).contiguous(), a(dn.w_alpha).contiguous()  # [T, Hv * S], [T, Hv] x2
        kern.gdn_gates(alpha, beta, dn.dt, dn.a)
        ext = torch.empty(c.conv_width - 1 + T, c.ssm_conv_dim)  # [d + T, conv_dim]: the state's rows, then the pass's
        ext[c.conv_width - 1:] = a(dn.w_qkv)
        cache.conv_fill(dn.index, slots, ext)
        conv = kern.short_conv(ext, dn.taps)  # [T, conv_dim]
        y = kern.glu(torch.cat((conv, torch.ones_like(conv)), dim=1), c.ssm_conv_dim, "silu")  # SiLU (ggml's)
        eps, inv = c.gdn_l2_norm
        q = rms_norm(y[:, :Hk * S].reshape(T, Hk, S), None, eps) * inv
        k = rms_norm(y[:, Hk * S:2 * Hk * S].reshape(T, Hk, S), None, eps) * inv
        v = y[:, 2 * Hk * S:].reshape(T, Hv, S).contiguous()
        o = kern.gdn(q.contiguous(), k.contiguous(), v, alpha, beta, cache.ssm[dn.index], slot0)  # [T, Hv, S]
        o = rms_norm(o, dn.norm, c.norm_eps).view(T, Hv * S)
        return dn.out(kern.glu(torch.cat((z, o), dim=1), Hv * S, "silu"), prompt)  # SiLU(z) * o

    def _attention_block(self, ly: Layer, i: int, kv: int, h: torch.Tensor, start_pos: int, cache, ropes: dict,
                         temps: torch.Tensor | None, window: int, mask: torch.Tensor | None, prompt: bool,
                         kv_only: bool = False, vis: torch.Tensor | None = None,
                         runs: list | None = None) -> torch.Tensor | None:
        """Layer i's attention on h [T, D] (normed) -> [T, D], its K / V written to cache layer kv (kv_only: only
        that, None back: a draft head catching up on the positions it will attend to); vis: Sequences.visible's
        cells of each row (several sequences in the pass), runs: Sequences.runs, where K and V go."""
        c, tr = self.config, self.trace
        T = h.shape[0]
        L = start_pos + T
        H, Hkv, hd, hdv = c.n_head, c.n_head_kv, c.head_dim_k, c.head_dim_v
        scale, kq_scale = attention_scales(c)
        a = Activations(h, prompt)
        qk, v = a(ly.wqk), a(ly.wv)  # [T, (H + Hkv) * hd], [T, Hkv * hdv]
        if ly.bqk is not None:
            qk = qk + ly.bqk
            v = v + ly.bv
        qk = qk.view(T, H + Hkv, hd)
        if ly.qk_norm is not None:
            qk = rms_norm(qk, None, c.norm_eps) * ly.qk_norm
        if ly.qk_norm_full is not None:
            qk = self._qk_norm_full(qk, ly.qk_norm_full)
        if c.has_rope(i):
            qk = self._rope(qk, ropes[c.layer_rope(i)])
        q, k = qk[:, :H], qk[:, H:]
        if self._unperm is not None:
            q, k = q[..., self._unperm], k[..., self._unperm]
        if temps is not None:  # (llama.cpp: ggml_mul after RoPE)
            q = q * temps
        if c.scale_q:  # before q is rounded to the K cache's type: tiny elements round differently
            q = q * scale
        q, k = rotate(q, cache.rot_k), rotate(k, cache.rot_k)
        v = rotate(v.view(T, Hkv, hdv), cache.rot_v)
        for r0, r1, c0 in runs or [(0, T, start_pos)]:
            cache.k.write(kv, c0, k[r0:r1])
            cache.v.write(kv, c0, v[r0:r1])
        if kv_only:
            return None
        if self._attn_kernel is not None:
            # every (row, head) as llama.cpp computes it: one-token passes and verify rows like its
            # one-row passes (bit-identical to one-token decoding), other passes like its prompt passes
            # (without flash attention q comes rounded to an f32 / f16 K's type; the kernel quantizes it for the others)
            qa = q if self.flash_attn or cache.k.kind not in ("f32", "f16") else activation_for(q, cache.k.qtype)
            mode = _ATTN_MODE[self.flash_attn, prompt]
            if runs is not None and len(runs) > 1:  # (streams: each its own attention, as llama.cpp's per stream)
                o = torch.cat([self._attn_kernel(qa[r0:r1], cache.k, cache.v, kv, c0, window, kq_scale, mode,
                                                 c.attn_softcap, ly.sinks, vis[r0:r1].contiguous())
                               for r0, r1, c0 in runs]).view(T, H * hdv)
            else:
                o = self._attn_kernel(qa, cache.k, cache.v, kv, start_pos, window, kq_scale, mode, c.attn_softcap,
                                      ly.sinks, vis).view(T, H * hdv)
        elif T <= EXACT_ROWS:
            # row by row, exactly as single-token decoding computes it (see EXACT_ROWS)
            o = torch.cat([self._attention(q[r:r + 1], cache, kv, start_pos + r + 1,
                                           self._mask(start_pos + r, 1, window), kq_scale, ly.sinks)
                           for r in range(T)])
        else:
            o = self._attention(q, cache, kv, L, mask, kq_scale, ly.sinks)  # [T, H * hdv]
        if tr is not None:
            tr(f"kqv_out-{i}", o)
        o = rotate(o, cache.rot_v)
        if ly.wgate is not None:  # (qwen35: ggml_sigmoid, then ggml_mul)
            o = o * _kernels().sigmoid(a(ly.wgate).contiguous())
        o = ly.wo(o, prompt)
        if ly.bo is not None:
            o = o + ly.bo
        if ly.post_attn_norm is not None:
            o = rms_norm(o, ly.post_attn_norm, c.norm_eps)
        if c.residual_scale:
            o = o * c.residual_scale
        return o

    def _ffn_block(self, ly: Layer, i: int, x: torch.Tensor, prompt: bool) -> torch.Tensor:
        """The residual stream x [T, D] after layer i's FFN (its norms, experts or SwiGLU / GELU, residual add)."""
        c, tr = self.config, self.trace
        h = rms_norm(x, ly.ffn_norm, c.norm_eps) if ly.ffn_norm is not None else x
        if tr is not None:
            tr(f"ffn_inp-{i}", x)
            tr(f"ffn_norm-{i}", h)
        if ly.experts is not None:
            f = self._moe(ly.experts, h, prompt)
        else:
            gu = self._glu(Activations(h, prompt)(ly.w_gu))  # [T, n_ff]
            if tr is not None:
                tr(f"ffn_swiglu-{i}", gu)
            f = ly.w_down(gu, prompt)
        if ly.post_ffn_norm is not None:
            f = rms_norm(f, ly.post_ffn_norm, c.norm_eps)
        if c.residual_scale:
            f = f * c.residual_scale
        x = x + f
        if tr is not None:
            tr(f"ffn_out-{i}", f)
            tr(f"l_out-{i}", x)
        return x

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
    def forward(self, tokens: torch.Tensor, start_pos: int, cache: KVCache, last_n: int | None = None,
                decode: bool = False, n_out: int | None = None, hidden: bool = False,
                seqs: Sequences | None = None, out_rows: torch.Tensor | None = None):
        """tokens [T] at positions start_pos.. -> logits [T, n_vocab] (only the last `last_n` rows if given).

        Appends the T new K/V entries to `cache` (start_pos must equal cache.length). Like llama.cpp,
        a pass of several tokens sums attention and some matmuls in its prompt-processing order and a
        one-token pass in its decoding order; decode=True makes every row of a short pass
        (T <= EXACT_ROWS) a decoding row, bit for bit what T one-token passes give (speculative
        verification). With last_n, the last layer's FFN runs on those rows only, as in llama.cpp.
        n_out: logits of token ids [0, n_out) only, [T, n_out] (a draft model's cut output layer).
        hidden: (logits, the final-normed stream of all T rows [T, D]) back, what a next-token-prediction head
        reads (models/mtp.py); the logits' bits are those of the same pass without it.
        seqs: the rows are several sequences (Sequences: their positions and cells; prompt passes, attention by the
        C kernel); out_rows: int64 indices of the rows whose logits come back (llama.cpp's output rows: the last
        layer's FFN runs on those), in place of last_n."""
        c = self.config
        if seqs is not None and seqs.cells is not None:  # (rows written where their cells say, not at the end)
            tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
            if int(seqs.cells.max()) >= cache.capacity:
                raise SharpiError(f"context full: cell {int(seqs.cells.max())} of a cache of {cache.capacity}")
        else:
            tokens = pass_tokens(tokens, start_pos, cache)
        if tokens.shape[0] == 0:
            return (torch.zeros(0, c.n_vocab), torch.zeros(0, c.n_embd)) if hidden else torch.zeros(0, c.n_vocab)
        prompt = prompt_pass(tokens.shape[0], decode)
        x = self.hidden(tokens, start_pos, cache, c.n_layer, prompt, last_n, all_rows=hidden, seqs=seqs,
                        out_rows=out_rows)
        h = rms_norm(x, self.output_norm, c.norm_eps) if hidden else None  # (row by row: the same bits as x's last rows')
        if last_n is not None:
            x = x[-last_n:]
        x = h[h.shape[0] - x.shape[0]:] if hidden else rms_norm(x, self.output_norm, c.norm_eps)
        logits = (self.output if n_out is None or n_out >= c.n_vocab else self.output.head(n_out))(x, prompt)
        logits = self.finish_logits(logits)
        return (logits, h) if hidden else logits

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Granite's logit scale and Gemma 2's final logit softcapping, in place (other models: as they are)."""
        c = self.config
        if c.logit_scale:
            logits.mul_(c.logit_mul)
        cap = c.final_softcap
        if not cap:
            return logits
        kern = _kernels()
        if getattr(kern, "softcap", None) is not None and logits.is_contiguous():
            return kern.softcap(logits, cap)  # libm's tanhf, as ggml_tanh
        return logits.mul_(1.0 / cap).tanh_().mul_(cap)

    @torch.inference_mode()
    def hidden(self, tokens: torch.Tensor, start_pos: int, cache: KVCache, n_layers: int, prompt: bool,
               last_n: int | None = None, all_rows: bool = False, seqs: Sequences | None = None,
               out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream [T, D] after layers [0, n_layers) (cache layer i = layer i); advances
        cache.length past the T tokens. forward's body, and the CPU part of a model split between CPU
        and GPU (backends/cuda_model.py). With last_n, the last layer's FFN runs on those rows (their
        stream [last_n, D] back), unless all_rows: then the other rows' too, apart (the rows are all back,
        the last ones' bits unchanged)."""
        c = self.config
        T = tokens.shape[0]
        L = start_pos + T
        scale, kq_scale = attention_scales(c)
        x = self.tok_embd.rows(tokens)  # [T, D]
        for t in self.embd_loras:
            x = t.add_rows(tokens, x, prompt)
        if c.embed_scale != 1.0:
            x = x * c.embed_scale
        if seqs is not None:  # (token positions apart from cache positions)
            if not self.sequences_ok() or all_rows:
                raise ValueError("several sequences in a pass: attention layers by the C kernel only")
            n_pos = int(seqs.pos.max()) + 1
            ropes = {r: self._rope_table(r, n_pos)[seqs.pos] for r in self._ropes}
            temps = self._attn_temps(n_pos)[seqs.pos, None, None] if c.attn_temp_scale else None
        else:
            ropes = {r: self._rope_table(r, L)[start_pos:L] for r in self._ropes}
            temps = self._attn_temps(L)[start_pos:L, None, None] if c.attn_temp_scale else None  # [T, 1, 1]
        if self._fast is None:
            self._fast = DecodePath.for_model(self) or False
        if self._fast and seqs is None and out_rows is None and not self.control and not self.has_loras and self._fast.applies(prompt, cache):
            # decoding rows: the same kernels, called without per-call wrappers (fast_decode.py)
            x = self._fast.run(x, start_pos, cache, n_layers, ropes, kq_scale, None if all_rows else last_n, scale, temps)
            cache.length = L
            return x
        masks = {}
        slots = cache.conv_slots(start_pos, T) if c.recurrent else None  # (lfm2, qwen35: their convolution rings)
        slot0 = cache.ssm_pass(start_pos, T) if c.ssm_d_state else None  # (qwen35: its DeltaNet states)
        vis = {}
        runs = seqs.runs(start_pos) if seqs is not None else None
        for i, ly in enumerate(self.layers[:n_layers]):
            window = c.sliding_window if c.is_swa(i) else 0
            if window not in masks:
                masks[window] = self._mask(start_pos, T, window) if seqs is None else None
                vis[window] = seqs.visible(start_pos, window) if seqs is not None else None
            h = rms_norm(x, ly.attn_norm, c.norm_eps) if ly.attn_norm is not None else x
            tr = self.trace
            if tr is not None:
                tr(f"attn_norm-{i}", h)
            if ly.conv is not None:
                o = self._short_conv(ly.conv, h, cache, slots, prompt)
            elif ly.delta is not None:
                o = self._delta_net(ly.delta, h, cache, slots, slot0, prompt)
            else:
                o = self._attention_block(ly, i, self._kv_layer[i], h, start_pos, cache, ropes, temps,
                                          window, masks[window], prompt, vis=vis[window], runs=runs)
            x = x + o
            rest = None
            if out_rows is not None and i == c.n_layer - 1 and out_rows.shape[0] < x.shape[0]:
                x = x[out_rows]  # (llama.cpp's output rows; its FFN then sees only those, as its matmuls)
            if last_n is not None and last_n < x.shape[0] and i == c.n_layer - 1:
                # like llama.cpp, the last layer's FFN runs on the output rows only (this also
                # decides its matmuls' summation order); all_rows: the other rows' FFN runs apart
                rest, x = (x[:-last_n] if all_rows else None), x[-last_n:]
            x = self._ffn_block(ly, i, x, prompt)
            if rest is not None:
                x = torch.cat((self._ffn_block(ly, i, rest, prompt), x))
            cv = self.control.get(i)
            if cv is not None:  # (llama.cpp: after the FFN's residual add, before the next layer's norm)
                x = x + cv
        cache.length = L if seqs is None or seqs.cells is None else max(cache.length, int(seqs.cells.max()) + 1)
        return x
