"""Decoding passes through the C kernels with no per-call Python wrappers.

A one-token pass of a small model is mostly glue: SmolLM2's 30 layers make ~500 kernel and torch
calls whose checks, allocations and wrappers cost ~40% of the pass. `DecodePath` runs the layer loop
of `Transformer.hidden` for decoding rows (one-token passes and speculative verify rows) with every
pointer resolved once: the same C functions with the same arguments in the same order, into buffers
allocated once per pass length, so the results are bit-identical to `hidden`'s (tested).

It covers the llama / qwen2 / qwen3 / smollm3 / phi3 / granite / exaone / gemma2 / gemma3 / mistral3 / lfm2 / qwen35 /
olmo2 / exaone4 layers (q/k norms per head or over all heads, post-norms with or without pre-norms, sliding windows,
q scaling, attention softcapping, residual scales, lfm2's short convolutions, qwen35's Gated DeltaNet and gated
attention, attention sinks and output biases) and the mixture-of-experts FFNs of qwen3moe, Mixtral, gpt-oss, qwen2moe,
granitemoe and qwen35moe (routing, one mul_mat_id call per expert matrix kind, the weighted sum: Transformer._experts_c's calls; shared experts),
flash attention (llama.cpp's default) over a cache of any -ctk / -ctv type (with the quantized types' Hadamard rotations),
every matmul in the C kernel with quantized activations.
`DecodePath.for_model` returns None where it does not apply; `Transformer.hidden` then runs its own
loop (SHARPI_FAST_DECODE=0 forces that).

Where every layer is attention and a dense FFN (no short convolutions, DeltaNet, experts or output gate) and a pass
has no attention temperatures, the loop itself is one C call (ops.c's sharpi_decode_layers, given a plan of the
layers' pointers built once): Python between the calls still cost SmolLM2 0.7 of its 3.5 ms of layers a token.
SHARPI_DECODE_C=0 keeps it in run()'s Python loop (same bits, tested).
"""
from __future__ import annotations

import struct

import torch

from ..kernels import cpu
from ..kv_cache import BLOCK_BYTES, KVCache
from ..quants import StackedWeight
from ..switches import switch

ENABLED = switch("SHARPI_FAST_DECODE")
# attention layers with a dense FFN run their whole loop in one C call (ops.c's sharpi_decode_layers); 0: in Python
C_LOOP = switch("SHARPI_DECODE_C")


_MATMULS = ("wqk", "wv", "wo", "w_gu", "w_down", "wgate")
_PAIR_BUFS = ("ids", "tok", "pair", "mgu", "mg", "md")  # one row per (token, chosen expert)
# ops.c's sharpi_decode_layers: its plan's header, a layer's record (fields, then 5 matmul slots of up to 3 parts),
# the pass's int64 array (two rope tables' pointer and n_rot, then K's and V's descriptions, then the buffers)
_DL_HEADER, _DL_PARTS = 14, 3
_DL_KV, _DL_BUF = 4, 18  # offsets in the pass's array
_DL_SLOT = 1 + 5 * _DL_PARTS
_L_MM = 14
_DL_REC = _L_MM + 5 * _DL_SLOT
_DL_MATMULS = ("wqk", "wv", "wo", "w_gu", "w_down")
_DL_BUFS = ("h", "qk", "v", "q", "k", "o", "ao", "gu", "g", "f")


def _f32_bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", v))[0]


def _router_args(w) -> tuple | None:
    """A router's (code, pointer, row bytes) for the kernel's decoding order: its kernel_args, or for an F32 router
    (as converters keep them) the F32 kernel's (ggml's vec_dot_f32 order: what its QWeight call runs)."""
    if w.kernel_args() is not None:
        return w.kernel_args()
    if w._kern is not None and w.qtype == cpu.Q.F32:
        return cpu.direct_args(w._raw_t, w.qtype, w.n, w.k)
    return None


def _direct(w) -> bool:
    """Whether the C kernel multiplies w (each part of a StackedWeight) in the decoding order."""
    return all(p._kern is not None and p.act_kind is not None for p in getattr(w, "parts", [w]))


def _args(w) -> tuple | list:
    """A weight's (code, pointer, row bytes, n, k) for _mm; a StackedWeight's: a list of its parts'."""
    if isinstance(w, StackedWeight):
        return [_args(p) for p in w.parts]
    return (*w.kernel_args(), w.n, w.k)


def _matmuls(ly) -> dict:
    """A layer's weights by name in run()'s terms."""
    if ly.conv is not None:
        return {"in_proj": ly.conv.in_proj, "out_proj": ly.conv.out_proj, "w_gu": ly.w_gu, "w_down": ly.w_down}
    if ly.delta is not None:  # (its beta / alpha projections: _router_args')
        dn = ly.delta
        return {"w_qkv": dn.w_qkv, "w_z": dn.w_z, "out": dn.out, "w_gu": ly.w_gu, "w_down": ly.w_down}
    return {n: getattr(ly, n) for n in _MATMULS}


class DecodePath:
    def __init__(self, model):
        self.model = model
        self.weights: list[dict] = []  # per layer, made at its first pass: name -> (code, pointer, row bytes, n, k)
        self.fns = cpu.kernel_fns()
        self._bufs: dict[str, torch.Tensor] = {}  # for the longest pass so far; shorter ones use leading rows
        self._stacked = torch.empty(0)  # a StackedWeight's part's output rows in a pass of several
        self._plan: torch.Tensor | None = None  # sharpi_decode_layers' plan for its first _plan_layers layers
        self._plan_layers = self._plan_wide = 0
        self._plan_refs: list = []  # tensors whose pointers the plan holds
        self._plan_ok = C_LOOP and self._c_loop_applies()
        self._pass = torch.zeros(_DL_BUF + len(_DL_BUFS) + 2, dtype=torch.int64)  # (+ stacked, qkn)
        self._pass_np = self._pass.numpy()

    @classmethod
    def for_model(cls, model) -> "DecodePath | None":
        c = model.config
        if not ENABLED or model._attn_kernel is None or model._rope_kernel is None or model._glu_kernel is None:
            return None
        for ly in model.layers:
            if any(w is not None and not _direct(w) for w in _matmuls(ly).values()):
                return None
            if ly.delta is not None and (_router_args(ly.delta.w_beta) is None or _router_args(ly.delta.w_alpha) is None
                                         or c.ssm_conv_dim % 16 or (c.ssm_dt_rank * c.ssm_d_state) % 16):
                return None
            ex = ly.experts
            if ex is not None and (_router_args(ex.router) is None or ex.id_args() is None or model.config.n_ff_exp % 16):
                return None
            if ex is not None and ex.sh_gu is not None and (
                    not all(_direct(w) for w in (ex.sh_gu, ex.sh_down))
                    or (ex.sh_gate is not None and _router_args(ex.sh_gate) is None) or model.config.n_ff_shexp % 16):
                return None
        return cls(model)

    def _layer_weights(self, n_layers: int) -> list[dict]:
        # resolved lazily: the layers a CPU/GPU split keeps on the GPU are never repacked for the CPU
        while len(self.weights) < n_layers:
            ly = self.model.layers[len(self.weights)]
            w = {n: _args(w) for n, w in _matmuls(ly).items() if w is not None}
            if ly.delta is not None:
                w["beta"], w["alpha"] = ((*_router_args(x), x.n, x.k) for x in (ly.delta.w_beta, ly.delta.w_alpha))
            ex = ly.experts
            if ex is not None:
                w["router"] = (*_router_args(ex.router), ex.router.n, ex.router.k)
            if ex is not None and ex.sh_gu is not None:
                w["sh_gu"], w["sh_down"] = (_args(x) for x in (ex.sh_gu, ex.sh_down))
                if ex.sh_gate is not None:
                    w["sh_gate"] = (*_router_args(ex.sh_gate), 1, ex.sh_gate.k)
            self.weights.append(w)
        return self.weights

    def applies(self, prompt: bool, cache: KVCache) -> bool:
        """Whether a pass (prompt order or not) over this cache goes through run()."""
        m = self.model
        return (not prompt and m.trace is None and m.flash_attn and cache.k.kind in cpu._KV_CODE
                and cache.v.kind in cpu._KV_CODE)

    def _buffers(self, T: int) -> dict[str, torch.Tensor]:
        if not self._bufs or self._bufs["h"].shape[0] < T:
            c = self.model.config
            H, Hkv, hd, hdv = c.n_head, c.n_head_kv, c.head_dim_k, c.head_dim_v
            e = lambda *shape: torch.empty(shape, dtype=torch.float32)  # noqa: E731
            self._bufs = {
                "h": e(T, c.n_embd), "qk": e(T, H + Hkv, hd), "v": e(T, Hkv * hdv), "q": e(T, H, hd),
                "k": e(T, Hkv, hd), "o": e(T, H * hdv), "ao": e(T, c.n_embd), "gu": e(T, 2 * c.n_ff),
                "g": e(T, c.n_ff), "f": e(T, c.n_embd)}
            if c.qk_norm_full:  # (olmo2) q's and k's heads in GGUF order, normed there, then back
                self._bufs["qkn"] = e(T, 2 * (H + Hkv), hd)
            if c.ssm_d_state:  # (qwen35) the DeltaNet's: see _delta_net
                S, Hk, Hv, n = c.ssm_d_state, c.ssm_n_group, c.ssm_dt_rank, c.ssm_conv_dim
                self._bufs.update(ext=e(T + c.conv_width - 1, n), y=e(T, n), sin=e(T, 2 * n), dq=e(T, Hk, S),
                                  dk=e(T, Hk, S), dv=e(T, Hv, S), beta=e(T, Hv), alpha=e(T, Hv), zo=e(T, 2 * Hv * S),
                                  gz=e(T, Hv * S), gate=e(T, H * hdv))
                self._bufs["sin"][:, n:] = 1.0  # (SiLU as the GLU of x and ones: its second half stays ones)
            elif c.recurrent:  # B, C, x rows; the convolution's input (state rows, then B * x) and output
                self._bufs.update(bcx=e(T, 3 * c.n_embd), ext=e(T + c.conv_width - 1, c.n_embd), y=e(T, c.n_embd))
            elif c.attn_gate:
                self._bufs["gate"] = e(T, H * hdv)
            if c.n_expert:  # router logits, expert weights; per (token, expert) pair: ids, token, index, FFN rows
                P, i32 = T * c.n_expert_used, torch.int32
                self._bufs.update(
                    logits=e(T, c.n_expert), mw=e(T, c.n_expert_used), ids=torch.empty(P, dtype=i32),
                    tok=torch.arange(T, dtype=i32).repeat_interleave(c.n_expert_used), pair=torch.arange(P, dtype=i32),
                    mgu=e(P, 2 * c.n_ff_exp), mg=e(P, c.n_ff_exp), md=e(P, c.n_embd))
            if c.n_ff_shexp:  # the shared expert's gate and up, its GLU, its down rows, its gate's logits
                self._bufs.update(sgu=e(T, 2 * c.n_ff_shexp), sg=e(T, c.n_ff_shexp), sd=e(T, c.n_embd), sx=e(T, 1))
        c = self.model.config
        rows = {"ext": T + c.conv_width - 1, **{n: T * c.n_expert_used for n in _PAIR_BUFS}}
        return {name: buf[:rows.get(name, T)] for name, buf in self._bufs.items()}  # leading rows: contiguous

    def _mm(self, w, x: torch.Tensor, y: torch.Tensor, T: int, nth: int) -> None:
        if w.__class__ is list:  # (a StackedWeight's parts)
            return self._mm_parts(w, x, y, T, nth)
        code, ptr, rb, n, k = w
        if self.fns["qmatmul"](code, ptr, rb, n, k, x.data_ptr(), T, y.data_ptr(), nth):
            raise RuntimeError("qmatmul: the kernel rejected a weight it had accepted")

    def _mm_parts(self, parts: list, x: torch.Tensor, y: torch.Tensor, T: int, nth: int) -> None:
        """A StackedWeight: its parts' outputs side by side in y's rows (one row: written in place; several: each
        part's rows into a buffer, then copied into its columns)."""
        qmatmul, col = self.fns["qmatmul"], 0
        for code, ptr, rb, n, k in parts:
            if T == 1:
                dst = y.data_ptr() + 4 * col
            else:
                if self._stacked.numel() < T * n:
                    self._stacked = torch.empty(T * n)
                dst = self._stacked.data_ptr()
            if qmatmul(code, ptr, rb, n, k, x.data_ptr(), T, dst, nth):
                raise RuntimeError("qmatmul: the kernel rejected a weight it had accepted")
            if T > 1:
                y.view(T, -1)[:, col:col + n].copy_(self._stacked[:T * n].view(T, n))
            col += n

    def _write(self, store, layer: int, start: int, x: torch.Tensor, T: int) -> int:
        """x [T, ...] fp32 into positions [start, start + T) of one layer of a cache store (as
        _Store.write does); returns the layer's q8_0 scale pointer for attention (0 if none)."""
        q = store.q[layer]  # [capacity, Hkv, hd] (a block type: [capacity, Hkv, bytes of hd / 32 blocks])
        if store.kind in BLOCK_BYTES:
            self.fns["kv_store"](cpu._KV_CODE[store.kind], x.data_ptr(), x.numel() // 32, q.data_ptr() + start * q[0].numel())
            return 0
        if store.kind != "q8_0":
            q[start:start + T].copy_(x.view(T, *q.shape[1:]))
            return 0
        d = store.d[layer]  # [capacity, Hkv, hd / 32, 1] fp16
        row_blocks = d[0].numel()
        self.fns["store_q8_0"](x.data_ptr(), T * row_blocks, q.data_ptr() + start * q[0].numel(),
                               d.data_ptr() + start * row_blocks * 2)
        return d.data_ptr()

    def _c_loop_applies(self) -> bool:
        """Whether every layer is attention and a dense FFN without what only the Python loop runs (qwen35's output
        gate) and the model has at most two RoPE tables."""
        m, c = self.model, self.model.config
        if c.recurrent or c.ssm_d_state or len(m._ropes) > 2:
            return False
        return all(ly.conv is None and ly.delta is None and ly.experts is None and ly.wgate is None for ly in m.layers)

    def _c_plan(self, n_layers: int) -> torch.Tensor:
        """The plan of ops.c's sharpi_decode_layers for (at least) layers [0, n_layers)."""
        if self._plan is not None and self._plan_layers >= n_layers:
            return self._plan
        m, c = self.model, self.model.config
        weights = self._layer_weights(n_layers)
        refs = []

        def ptr(t) -> int:
            if t is None:
                return 0
            t = t.contiguous()
            refs.append(t)
            return t.data_ptr()

        plan = torch.zeros(_DL_HEADER + n_layers * _DL_REC, dtype=torch.int64)
        p = plan.numpy()
        p[:_DL_HEADER] = (c.n_layer, c.n_head, c.n_head_kv, c.head_dim_k, c.head_dim_v, c.n_embd, c.n_ff,
                          cpu._GLU_ACT[c.act], int(bool(c.scale_q)), ptr(m._unperm), ptr(m._perm),
                          *(_f32_bits(float(v)) for v in (c.norm_eps, c.residual_scale, c.attn_softcap)))
        for i in range(n_layers):
            ly, w = m.layers[i], weights[i]
            r = _DL_HEADER + i * _DL_REC
            p[r:r + _L_MM] = (
                ptr(ly.attn_norm), ptr(ly.bqk), ptr(ly.bv), ptr(ly.qk_norm),
                *(ptr(t) for t in ly.qk_norm_full or (None, None)),
                m._ropes.index(c.layer_rope(i)) if c.has_rope(i) else -1, m._kv_layer[i],
                c.sliding_window if c.is_swa(i) else 0, ptr(ly.sinks), ptr(ly.bo), ptr(ly.post_attn_norm),
                ptr(ly.ffn_norm), ptr(ly.post_ffn_norm))
            for j, name in enumerate(_DL_MATMULS):
                parts = w[name] if w[name].__class__ is list else [w[name]]
                if len(parts) > _DL_PARTS:
                    raise RuntimeError(f"decode_layers: {len(parts)} parts in one matmul")
                s0 = r + _L_MM + j * _DL_SLOT
                p[s0] = len(parts)
                for k, part in enumerate(parts):
                    p[s0 + 1 + 5 * k:s0 + 6 + 5 * k] = part
        self._plan, self._plan_layers, self._plan_refs = plan, n_layers, refs
        self._plan_wide = max((part[3] for w in weights[:n_layers] for n in _DL_MATMULS if w[n].__class__ is list
                               for part in w[n]), default=0)  # a StackedWeight part's widest output row
        return plan

    def _run_c(self, x: torch.Tensor, start_pos: int, cache: KVCache, n_layers: int, ropes: dict, kq_scale: float,
               last_n: int | None, scale: float) -> torch.Tensor:
        """run()'s loop as one C call (sharpi_decode_layers: the same kernels, arguments and order)."""
        m = self.model
        T = x.shape[0]
        plan = self._c_plan(n_layers)
        if not self._bufs or self._bufs["h"].shape[0] < T:
            self._buffers(T)
        if self._stacked.numel() < T * self._plan_wide:
            self._stacked = torch.empty(T * self._plan_wide)
        vals = []
        for r in m._ropes:
            cs = ropes[r]
            vals += (cs.data_ptr(), 2 * cs.shape[-1])
        vals += [0, 0] * (2 - len(m._ropes))
        for st in (cache.k, cache.v):
            q, d = st.q, getattr(st, "d", None)
            es = q.element_size()
            vals += (cpu._KV_CODE[st.kind], q.data_ptr(), q.stride(0) * es, q.stride(1) * es,
                     *((d.data_ptr(), d.stride(0) * 2, d.stride(1) * 2) if st.kind == "q8_0" else (0, 0, 0)))
        b = self._bufs
        vals += [b[n].data_ptr() for n in _DL_BUFS]
        vals += (self._stacked.data_ptr(), b["qkn"].data_ptr() if "qkn" in b else 0)
        pa = self._pass_np
        pa[:] = vals
        base = self._pass.data_ptr()
        rc = self.fns["decode_layers"](plan.data_ptr(), n_layers, x.data_ptr(), T, start_pos, last_n or 0, base,
                                       float(kq_scale), float(scale), base + 8 * _DL_KV, cache.rot_k or 0,
                                       cache.rot_v or 0, int(cache.v.kind == "f16"), cache.k.q.shape[1],
                                       base + 8 * _DL_BUF, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"decode_layers: a kernel rejected the pass (step {rc // 10})")
        if last_n is not None and last_n < T and n_layers == m.config.n_layer:
            return x[-last_n:]
        return x

    @torch.inference_mode()
    def run(self, x: torch.Tensor, start_pos: int, cache: KVCache, n_layers: int, ropes: dict, kq_scale: float,
            last_n: int | None, scale: float = 1.0, temps: torch.Tensor | None = None) -> torch.Tensor:
        """Transformer.hidden's layer loop for decoding rows: x [T, D] (the embeddings, updated in
        place) -> the residual stream after layers [0, n_layers) ([last_n, D] if the last layer ran
        its FFN on the last rows only). Writes the K/V of the T positions into cache."""
        if self._plan_ok and temps is None:
            return self._run_c(x, start_pos, cache, n_layers, ropes, kq_scale, last_n, scale)
        m, c = self.model, self.model.config
        T, D = x.shape[0], c.n_embd
        b = self._buffers(T)
        nth = torch.get_num_threads()
        rms, glu = self.fns["rms_norm"], self.fns["glu"]
        eps, rs = float(c.norm_eps), float(c.residual_scale)
        glu_act = cpu._GLU_ACT[c.act]
        weights = self._layer_weights(n_layers)
        h, ao = b["h"], b["ao"]
        # the cache's codes, Hadamard sizes (q8_0 caches, or None) and whether V rounds p to f16: per pass
        kv_args = (cpu._KV_CODE[cache.k.kind], cpu._KV_CODE[cache.v.kind], cache.rot_k, cache.rot_v,
                   int(cache.v.kind == "f16"))
        conv = slot0 = None
        if c.recurrent:
            conv = cache.conv_slots(start_pos, T)
        if c.ssm_d_state:
            slot0 = cache.ssm_pass(start_pos, T)
        for i in range(n_layers):
            ly, w = m.layers[i], weights[i]
            if ly.attn_norm is not None:
                rms(x.data_ptr(), ly.attn_norm.data_ptr(), T, D, eps, h.data_ptr())
                hin = h
            else:  # (olmo2, exaone4: the residual stream itself into the matmuls, as hidden's h = x)
                hin = x
            if ly.conv is not None:
                self._short_conv(ly.conv, w, cache, conv, b, h, ao, T, nth)
                x.add_(ao)
            elif ly.delta is not None:
                self._delta_net(ly.delta, w, cache, conv, slot0, b, h, ao, T, nth)
                x.add_(ao)
            else:
                self._attention(i, ly, w, cache, kv_args, start_pos, ropes, kq_scale, scale, temps, b, hin, ao, T, nth)
                if ly.post_attn_norm is not None:
                    rms(ao.data_ptr(), ly.post_attn_norm.data_ptr(), T, D, eps, ao.data_ptr())
                if rs:
                    ao.mul_(rs)
                x.add_(ao)
            Tf = T
            if last_n is not None and last_n < T and i == c.n_layer - 1:
                x, Tf = x[-last_n:], last_n  # like hidden: the last FFN on the output rows only
            hf, gu, g, f = h[:Tf], b["gu"][:Tf], b["g"][:Tf], b["f"][:Tf]
            if ly.ffn_norm is not None:
                rms(x.data_ptr(), ly.ffn_norm.data_ptr(), Tf, D, eps, hf.data_ptr())
            else:
                hf = x
            if ly.experts is not None:
                self._moe(ly.experts, w, b, hf, f, Tf, glu_act, nth)
            else:
                self._mm(w["w_gu"], hf, gu, Tf, nth)
                if glu(gu.data_ptr(), Tf, c.n_ff, glu_act, g.data_ptr(), nth):
                    raise RuntimeError("glu: the kernel rejected the pass")
                self._mm(w["w_down"], g, f, Tf, nth)
            if ly.post_ffn_norm is not None:
                rms(f.data_ptr(), ly.post_ffn_norm.data_ptr(), Tf, D, eps, f.data_ptr())
            if rs:
                f.mul_(rs)
            x.add_(f)
        return x

    def _moe(self, ex, w: dict, b: dict, h: torch.Tensor, out: torch.Tensor, T: int, glu_act: int, nth: int) -> None:
        """Transformer._moe's kernel calls on h [T, D] -> out [T, D]: router logits, moe_route, the gate and up
        mul_mat_id into the halves of one buffer, the GLU, the down mul_mat_id, the weighted sum; then a shared
        expert's matmuls, added under its sigmoid gate (qwen2moe) or as they are (granitemoe)."""
        c = self.model.config
        fns, k, D, nff = self.fns, c.n_expert_used, c.n_embd, c.n_ff_exp
        P = T * k
        logits, mw, ids, gu, g, d = b["logits"][:T], b["mw"][:T], b["ids"][:P], b["mgu"][:P], b["mg"][:P], b["md"][:P]
        tok, pair = b["tok"][:P].data_ptr(), b["pair"][:P].data_ptr()
        bias = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        self._mm(w["router"], h, logits, T, nth)
        fns["moe_route"](logits.data_ptr(), T, c.n_expert, k, cpu.MOE_GATING[c.expert_gating], int(c.expert_weights_norm),
                         bias(ex.router_b), ids.data_ptr(), mw.data_ptr())
        (gcode, gptr, grb, _, _), (ucode, uptr, urb, _, _), (dcode, dptr, drb, _, _) = ex.id_args()
        qid = fns["qmatmul_id"]
        for code, ptrs, rb, bb, y in ((gcode, gptr, grb, ex.gate_b, gu.data_ptr()),
                                      (ucode, uptr, urb, ex.up_b, gu.data_ptr() + 4 * nff)):
            if qid(code & 0xFF, ptrs.data_ptr(), c.n_expert, rb, nff, D, h.data_ptr(), D, P, ids.data_ptr(), tok,
                   bias(bb), y, 2 * nff, nth):
                raise RuntimeError("qmatmul_id: the kernel rejected a weight it had accepted")
        if fns["glu"](gu.data_ptr(), P, nff, glu_act, g.data_ptr(), nth):
            raise RuntimeError("glu: the kernel rejected the pass")
        if qid(dcode & 0xFF, dptr.data_ptr(), c.n_expert, drb, D, nff, g.data_ptr(), nff, P, ids.data_ptr(), pair,
               bias(ex.down_b), d.data_ptr(), D, nth):
            raise RuntimeError("qmatmul_id: the kernel rejected a weight it had accepted")
        fns["moe_sum"](d.data_ptr(), mw.data_ptr(), T, k, D, out.data_ptr())
        if ex.sh_gu is None:
            return
        sgu, sg, sd, sx = b["sgu"][:T], b["sg"][:T], b["sd"][:T], b["sx"][:T]
        self._mm(w["sh_gu"], h, sgu, T, nth)
        if fns["glu"](sgu.data_ptr(), T, c.n_ff_shexp, glu_act, sg.data_ptr(), nth):
            raise RuntimeError("glu: the kernel rejected the pass")
        self._mm(w["sh_down"], sg, sd, T, nth)
        if ex.sh_gate is None:  # (granitemoe: added as it is)
            out.add_(sd)
            return
        self._mm(w["sh_gate"], h, sx, T, nth)
        fns["shexp_add"](sx.data_ptr(), sd.data_ptr(), T, D, out.data_ptr(), int(c.shexp_plain_sigmoid))

    def _short_conv(self, sc, w: dict, cache, slots, b: dict, h: torch.Tensor, out: torch.Tensor, T: int,
                    nth: int) -> None:
        """Transformer._short_conv's steps on h [T, D] -> out [T, D]: in_proj, B * x after the state's rows,
        the convolution, times C, out_proj; the pass's B * x rows into the cache's ring."""
        D = h.shape[1]
        bcx, ext, y = b["bcx"], b["ext"], b["y"]
        d = ext.shape[0] - T
        self._mm(w["in_proj"], h, bcx, T, nth)
        torch.mul(bcx[:, :D], bcx[:, 2 * D:], out=ext[d:])
        cache.conv_fill(sc.index, slots, ext)
        self.fns["short_conv"](ext.data_ptr(), sc.taps.data_ptr(), y.data_ptr(), T, D, d + 1)
        y.mul_(bcx[:, D:2 * D])
        self._mm(w["out_proj"], y, out, T, nth)

    def _delta_net(self, dn, w: dict, cache, slots, slot0: int, b: dict, h: torch.Tensor, out: torch.Tensor, T: int,
                   nth: int) -> None:
        """Transformer._delta_net's steps on h [T, D] -> out [T, D]: the z, beta, alpha and q / k / v projections (the
        last into the convolution's input after the state's rows), the gates, the convolution, SiLU, the q / k
        norms, the recurrence over the cache's ring, the per-head norm, SiLU(z) * o, the out-projection."""
        c, fns = self.model.config, self.fns
        S, Hk, Hv, n = c.ssm_d_state, c.ssm_n_group, c.ssm_dt_rank, c.ssm_conv_dim
        ext, y, sin, q, k, v = b["ext"], b["y"], b["sin"], b["dq"], b["dk"], b["dv"]
        beta, alpha, zo, gz = b["beta"], b["alpha"], b["zo"], b["gz"]
        inner, d = Hv * S, ext.shape[0] - T
        self._mm(w["w_z"], h, gz, T, nth)
        zo[:, :inner].copy_(gz)
        self._mm(w["beta"], h, beta, T, nth)
        self._mm(w["alpha"], h, alpha, T, nth)
        fns["gdn_gates"](alpha.data_ptr(), beta.data_ptr(), dn.dt.data_ptr(), dn.a.data_ptr(), T, Hv)
        self._mm(w["w_qkv"], h, ext[d:], T, nth)
        cache.conv_fill(dn.index, slots, ext)
        fns["short_conv"](ext.data_ptr(), dn.taps.data_ptr(), y.data_ptr(), T, n, d + 1)
        sin[:, :n].copy_(y)
        if fns["glu"](sin.data_ptr(), T, n, cpu._GLU_ACT["silu"], y.data_ptr(), nth):
            raise RuntimeError("glu: the kernel rejected the pass")
        eps, inv = c.gdn_l2_norm
        for dst, lo in ((q, 0), (k, Hk * S)):
            dst.view(T, -1).copy_(y[:, lo:lo + Hk * S])
            fns["rms_norm"](dst.data_ptr(), 0, T * Hk, S, eps, dst.data_ptr())
            dst.mul_(inv)
        v.view(T, -1).copy_(y[:, 2 * Hk * S:])
        ring = cache.ssm[dn.index]
        o = zo[:, inner:]
        fns["gdn"](q.data_ptr(), k.data_ptr(), v.data_ptr(), alpha.data_ptr(), beta.data_ptr(), ring.data_ptr(),
                   ring.shape[0], slot0 % ring.shape[0], gz.data_ptr(), T, Hv, Hk, S, nth)
        fns["rms_norm"](gz.data_ptr(), dn.norm.data_ptr(), T * Hv, S, float(c.norm_eps), gz.data_ptr())
        o.copy_(gz)
        if fns["glu"](zo.data_ptr(), T, inner, cpu._GLU_ACT["silu"], gz.data_ptr(), nth):
            raise RuntimeError("glu: the kernel rejected the pass")
        self._mm(w["out"], gz, out, T, nth)

    def _qk_norm_full(self, weights: tuple, qk: torch.Tensor, tmp: torch.Tensor, T: int, eps: float) -> None:
        """qk [T, H + Hkv, hd] (rope-pair order) in place: q's rows RMS-normed over all H heads times weights[0], k's
        over its Hkv times weights[1], each summed in the GGUF's element order (tmp [T, 2 (H + Hkv), hd]: a part in
        that order, then back in qk's). (The C loop's dl_qk_norm_all; this runs with SHARPI_DECODE_C=0.)"""
        m = self.model
        H, hd = m.config.n_head, qk.shape[2]
        flat = tmp.view(-1)
        for lo, hi, wt in ((0, H, weights[0]), (H, qk.shape[1], weights[1])):
            n = T * (hi - lo) * hd
            part, back = flat[:n].view(T, hi - lo, hd), flat[n:2 * n].view(T, hi - lo, hd)
            if m._unperm is not None:
                torch.index_select(qk[:, lo:hi], 2, m._unperm, out=part)
            else:
                part.copy_(qk[:, lo:hi])
            self.fns["rms_norm"](part.data_ptr(), wt.data_ptr(), T, (hi - lo) * hd, eps, part.data_ptr())
            if m._perm is not None:
                torch.index_select(part, 2, m._perm, out=back)
                part = back
            qk[:, lo:hi].copy_(part)

    def _attention(self, i: int, ly, w: dict, cache, kv_args: tuple, start_pos: int, ropes: dict, kq_scale: float,
                   scale: float, temps, b: dict, h: torch.Tensor, ao: torch.Tensor, T: int, nth: int) -> None:
        """Layer i's attention on h [T, D] -> ao [T, D] (before its post-norm and residual scale): K and V into
        its KV cache layer."""
        m, c = self.model, self.model.config
        H, Hkv, hd, hdv = c.n_head, c.n_head_kv, c.head_dim_k, c.head_dim_v
        rms, att, rope, had = self.fns["rms_norm"], self.fns["attention"], self.fns["rope"], self.fns["hadamard"]
        eps, softcap = float(c.norm_eps), float(c.attn_softcap)
        kcode, vcode, rot_k, rot_v, round_p = kv_args
        unperm = m._unperm
        qk, v, q, k, o = b["qk"], b["v"], b["q"], b["k"], b["o"]
        kv = m._kv_layer[i]
        self._mm(w["wqk"], h, qk, T, nth)
        self._mm(w["wv"], h, v, T, nth)
        if ly.bqk is not None:
            qk.view(T, -1).add_(ly.bqk)
            v.add_(ly.bv)
        if ly.qk_norm is not None:  # hidden's rms_norm(qk, None) * qk_norm: the same two roundings
            rms(qk.data_ptr(), 0, T * (H + Hkv), hd, eps, qk.data_ptr())
            qk.mul_(ly.qk_norm)
        if ly.qk_norm_full is not None:  # hidden's _qk_norm_full: each of q and k normed over all its heads
            self._qk_norm_full(ly.qk_norm_full, qk, b["qkn"], T, eps)
        if c.has_rope(i):
            cs = ropes[c.layer_rope(i)]
            rope(qk.data_ptr(), T, H + Hkv, hd, 2 * cs.shape[-1], cs.data_ptr())
        if unperm is not None:
            torch.index_select(qk[:, :H], 2, unperm, out=q)
            torch.index_select(qk[:, H:], 2, unperm, out=k)
        else:
            q.copy_(qk[:, :H])
            k.copy_(qk[:, H:])
        if temps is not None:  # [T, 1, 1]: attention temperatures
            q.mul_(temps)
        if c.scale_q:
            q.mul_(scale)
        if rot_k:
            had(q.data_ptr(), T * H * hd // rot_k, rot_k)
            had(k.data_ptr(), T * Hkv * hd // rot_k, rot_k)
        if rot_v:
            had(v.data_ptr(), T * Hkv * hdv // rot_v, rot_v)
        kd, vd = self._write(cache.k, kv, start_pos, k, T), self._write(cache.v, kv, start_pos, v, T)
        kq, vq = cache.k.q[kv], cache.v.q[kv]  # [capacity, Hkv, hd]
        window = c.sliding_window if c.is_swa(i) else 0
        if att(q.data_ptr(), T, H, Hkv, hd, hdv, kq.data_ptr(), kd, kcode, vq.data_ptr(), vd, vcode, start_pos,
               window, float(kq_scale), softcap, round_p, cpu.ATTN_FA_DECODE, kq.shape[0],
               0 if ly.sinks is None else ly.sinks.data_ptr(), o.data_ptr(), nth, 0):
            raise RuntimeError("attention: the kernel rejected the pass")
        if rot_v:
            had(o.data_ptr(), T * H * hdv // rot_v, rot_v)  # back (H @ H = I)
        if ly.wgate is not None:  # (qwen35: the output times sigmoid(its gate), ggml_sigmoid's libm expf)
            gate = b["gate"]
            self._mm(w["wgate"], h, gate, T, nth)
            self.fns["sigmoid"](gate.data_ptr(), gate.numel())
            o.mul_(gate)
        self._mm(w["wo"], o, ao, T, nth)
        if ly.bo is not None:
            ao.add_(ly.bo)
