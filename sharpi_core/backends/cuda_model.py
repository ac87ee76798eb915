"""The decoder of models/transformer.py run on an NVIDIA GPU with the kernels of backends/cuda.py.

`CudaTransformer(cpu_model)` takes a loaded `Transformer` (config, GGUF mmap, the ggml-exact rope
tables) and uploads every weight in its GGUF quantized form; the model has the CPU model's interface,
`forward(tokens, start_pos, cache, last_n=None, decode=False, n_out=None) -> logits [T, n_vocab]`
(a CPU torch tensor: sampling and acceptance stay pure CPU functions), and `new_cache` makes a
`CudaKVCache` (f16 or q8_0 per layer, `length` / `truncate`). Every model runs on its own CUDA
stream, so a target and its draft queue their kernels independently.

Greedy decoding needs only arg-maxes, which are taken here so that 4 bytes a row come back instead of
the logits: `forward_argmax` (a plain step, a verify pass) and `greedy_chain` (a draft's k proposals,
each pass fed the last one's arg-max on the device, one graph). SHARPI_DEVICE_ARGMAX=0 turns them off
(`device_argmax`, which the generator and the drafter look at). A sampling draft (temp > 0, the default
chain) draws its proposals here too: `sample_chain` runs the k passes as one graph, each pass's top-k
law computed and a token drawn from it on the device and fed to the next pass, and brings back the
tokens with each law (k x top-k ids and probabilities: q for the verification) instead of k logits rows
and k round trips; a target's sampled steps and verify passes (`forward_sample`) bring back their draws
and laws the same way. SHARPI_DEVICE_SAMPLE=0 turns it off (`device_sample`, `can_sample`).

Numerics follow llama.cpp's CPU backend where it decides tokens: activations are rounded through the
same 8-bit blocks before every quantized matmul (ops.round_act; fp32 activations would move these
4-bit models' logits by ~1% and flip near-ties), its rope table, q rounded to the K cache's type
before q.k, probabilities rounded to f16 without flash attention, the Hadamard rotation of quantized
caches. Sums run in another order than on the CPU, so logits agree closely, not bit for bit.
SHARPI_ACT_QUANT=0 keeps activations in fp32 (as on the CPU path).

Passes of up to MAX_BATCH (16) tokens, decoding steps and speculative verification, run as CUDA
graphs: their intermediates live in one workspace per model, every step of the pass is a kernel of
cuda/*.cu, and nothing in it depends on the position (attention is launched over the cache's capacity,
the rope table covers it, positions and token ids are read from device memory), so the first pass of
a shape runs eagerly and is captured, and every later one is a graph launch: the 9 launches per
layer cost one CPU call (SHARPI_CUDA_GRAPH=0 launches them one by one; same results bit for bit).
Some steps run inside the kernels around them: the rounding of a matmul's input in the norm, GLU or
attention launch that makes it, RoPE in kv_append (K) and attention (q), the combine of attention's
splits in attention's own launch; SHARPI_CUDA_FUSE=0 launches each alone (same results bit for bit).

`offload(model, ngl)` implements -ngl: all on the GPU, or (0 < ngl < n_layer) a SplitTransformer
that runs the first layers on the CPU model and the rest on the GPU, as llama.cpp splits a model.

`ops` is the kernel module (backends.cuda); tests pass a CPU stand-in with the same functions
(tests/cuda_fake.py) to check this orchestration on machines without a GPU.
"""
from __future__ import annotations

import contextlib
import os
import sys
import weakref

import gguf
import numpy as np
import torch

from ..errors import SharpiError, UsageError
from ..kv_cache import CacheBase
from ..models.config import ROPE_NEOX
from ..models.transformer import (EXACT_ROWS, Transformer, _weight, attention_scales, check_pass, layer_parts,
                                  pass_tokens, prompt_pass, qkv_biases)
from ..quants import MATCH_LLAMA_CPP, act_kind, load_vector, q8_0_blocks
from ..switches import switch
from .cuda import GPU_CACHE_TYPES, MAX_BATCH

MIXED = "mixed"  # a projection whose matmuls round their input differently
GRAPHS = switch("SHARPI_CUDA_GRAPH")
DEVICE_ARGMAX = switch("SHARPI_DEVICE_ARGMAX")
DEVICE_SAMPLE = switch("SHARPI_DEVICE_SAMPLE")
FUSE = switch("SHARPI_CUDA_FUSE")
# attention's splits combined by its own launch's last block per row (a launch a layer less, a serial
# tail in one block: which wins is measured on a GPU by scripts/gpu_session.sh part3)
FUSE_COMBINE = switch("SHARPI_CUDA_FUSE_COMBINE")


class CudaKVCache(CacheBase):
    """Per layer one K and one V array on the device ([capacity, n_kv, hd] f16, or q8_0 blocks)."""

    def __init__(self, ops, n_layer: int, capacity: int, n_kv: int, hd_k: int, hd_v: int,
                 type_k: str = "f16", type_v: str = "f16", stream=None):
        for kv, t in (("K", type_k), ("V", type_v)):  # (the CLI names its flag before it gets here)
            if t not in GPU_CACHE_TYPES:
                raise UsageError(f"{kv} cache type {t}: the CUDA backend keeps the KV cache in "
                                 f"{' or '.join(GPU_CACHE_TYPES)}")
        super().__init__(capacity, hd_k, hd_v, type_k, type_v)
        self.k = [ops.new_kv_cache(capacity, n_kv, hd_k, type_k, stream=stream) for _ in range(n_layer)]
        self.v = [ops.new_kv_cache(capacity, n_kv, hd_v, type_v, stream=stream) for _ in range(n_layer)]
        self.ops, self.stream = ops, stream

    def shift(self, n_keep: int, n_discard: int, shift_k) -> None:
        """As KVCache.shift, K through the host (one shift every few thousand tokens: the CPU model's
        shift_k computes the new rows), V moved on the device."""
        self.check_shift(n_keep, n_discard)
        src, end = n_keep + n_discard, self.length
        q8 = self.type_k == "q8_0"
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            rows = self.ops.to_host(k[src:end], stream=self.stream)  # waits for the stream's work on it
            f32 = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q8_0) if q8 else rows.astype(np.float32)
            new = shift_k(layer, torch.from_numpy(np.ascontiguousarray(f32))).numpy()
            self.ops.upload(k[n_keep:end - n_discard], q8_0_blocks(new) if q8 else new.astype(np.float16),
                            stream=self.stream)
            with self.stream if self.stream is not None else contextlib.nullcontext():
                v[n_keep:end - n_discard] = v[src:end].copy()
        self.length = end - n_discard

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.k + self.v)


class _Proj:
    """Several weights applied to one input: weights of one type and width are fused into one
    matmul on the device (rows concatenated at upload), with their biases (if any) added by the
    matmul's own launch; the outputs are column views, one per part."""

    def __init__(self, ops, parts, name: str, role: str, stream, biases=None):
        groups: list[list] = []
        for p in parts:
            if groups and groups[-1][0].qtype == p.qtype and groups[-1][0].k == p.k:
                groups[-1].append(p)
            else:
                groups.append([p])
        self.mats, self.group_sizes, self.biases, self.where = [], [[p.n for p in g] for g in groups], [], []
        biases = biases or [None] * len(parts)
        i = 0
        for gi, g in enumerate(groups):
            raw = g[0].raw if len(g) == 1 else np.concatenate([np.asarray(p.raw) for p in g])
            self.mats.append(ops.CudaQWeight(raw, g[0].qtype, sum(p.n for p in g), g[0].k, name=name, stream=stream))
            bs = biases[i:i + len(g)]
            if any(b is not None for b in bs):  # a part without a bias adds zeros
                bs = [b if b is not None else np.zeros(p.n, np.float32) for b, p in zip(bs, g)]
                self.biases.append(ops.xp.asarray(np.concatenate([np.asarray(b, dtype=np.float32) for b in bs])))
            else:
                self.biases.append(None)
            off = 0
            for p in g:
                self.where.append((gi, off, p.n))
                off += p.n
            i += len(g)
        self.ops, self.stream, self.role = ops, stream, role  # role: its outputs' workspace name
        kinds = {act_kind(m.qtype) for m in self.mats}
        # the activation rounding all its matmuls take (the step before can do it), else MIXED
        self.kind = kinds.pop() if len(kinds) == 1 else MIXED

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.mats)

    def wants_xq(self, T: int) -> bool:
        """Whether the step that rounds this projection's input should write its q8 rows too (its
        matmuls of T rows all run the integer matvecs on one kind of rounding)."""
        return self.kind != MIXED and all(m.wants_xq(T) and m.xq_kind == self.kind for m in self.mats)

    def q8_buf(self, bufs, T: int, K: int):
        """The workspace's q8 rows for this projection's input of T rows, when wants_xq, else None."""
        return bufs.get(f"q8:{self.role}", (T, self.ops.q8_row_bytes(K)), np.uint8) if self.wants_xq(T) else None

    def __call__(self, x, bufs, rounded: bool = False, xq=None) -> list:
        """x [T, K] -> one [T, n] view per part (outputs in bufs). rounded: x is already rounded as
        self.kind says (by the norm or activation that made it), which also wrote its q8 rows into xq
        if given (q8_buf)."""
        T = x.shape[0]
        q8 = {self.kind: xq} if rounded and xq is not None else {}  # kind -> its q8 rows
        res, rounded = _Views(), ({self.kind: x} if rounded else {})
        q8_rows = lambda kind: bufs.get(f"q8:{kind}", (T, self.ops.q8_row_bytes(x.shape[1])), np.uint8)  # noqa: E731
        for gi, (m, sizes) in enumerate(zip(self.mats, self.group_sizes)):
            kind = act_kind(m.qtype)
            want = m.wants_xq(T)
            if kind not in rounded:
                dst = None if kind is None else bufs.get(f"act:{kind}", x.shape)
                q = q8_rows(kind) if want else None
                rounded[kind] = self.ops.round_act(x, kind, out=dst, q8=q, stream=self.stream)
                if q is not None:
                    q8[kind] = q
            if want and kind not in q8:  # rounded by a step that wrote no q8 rows
                q8[kind] = self.ops.quantize_act(rounded[kind], m.xq_kind, out=q8_rows(kind), stream=self.stream)
            y = m.matmul(rounded[kind], stream=self.stream, out=bufs.get(f"{self.role}:{gi}", (T, m.n)),
                         bias=self.biases[gi], xq=q8.get(kind) if want else None)
            res.groups.append(y)
            off = 0
            for n in sizes:
                res.append(y if n == y.shape[1] else y[:, off:off + n])
                off += n
        return res

    def span(self, views, first: int, last: int):
        """The one column view covering parts first..last, if they are adjacent in one output."""
        (g0, off0, _), (g1, off1, n1) = self.where[first], self.where[last]
        return views.groups[g0][:, off0:off1 + n1] if g0 == g1 else None


class _Views(list):
    """A projection's per-part views, and (`groups`) the group outputs they are columns of."""

    def __init__(self):
        super().__init__()
        self.groups = []


class _Buffers:
    """The device arrays of a pass, by name. With persistent=True (passes of up to MAX_BATCH rows) one
    buffer per name, sized for MAX_BATCH rows and reused by every pass: a graph's capture must not
    allocate, and its launches write where the capture saw. Otherwise fresh arrays."""

    def __init__(self, xp, persistent: bool, rows: int = 0):
        self.xp, self.persistent, self.rows = xp, persistent, rows
        self.arrays: dict = {}

    def get(self, name: str, shape, dtype=np.float32):
        shape = tuple(int(v) for v in shape)
        n = int(np.prod(shape))
        if not self.persistent:
            return self.xp.empty(shape, dtype=dtype)
        buf = self.arrays.get(name)
        if buf is None or buf.size < n or buf.dtype != np.dtype(dtype):
            room = n if not shape or shape[0] == 0 else max(n, n // shape[0] * self.rows)
            buf = self.arrays[name] = self.xp.empty(room, dtype=dtype)
        return buf[:n].reshape(shape)


class _CacheArrays:
    """What a pass needs of a CudaKVCache (not the cache itself: a graph keeps this alive, and the
    cache may go away)."""

    def __init__(self, cache):
        self.k, self.v, self.capacity = cache.k, cache.v, cache.capacity
        self.type_k, self.type_v, self.rot_k, self.rot_v = cache.type_k, cache.type_v, cache.rot_k, cache.rot_v


class _Graph:
    """A captured pass: the graph, its device inputs (token ids or hidden state, positions), its
    result (logits or token ids), and the arrays it reads and writes (kept alive while it lives)."""

    def __init__(self, graph, inputs: tuple, result, keep: list):
        self.graph, self.inputs, self.result, self.keep = graph, inputs, result, keep


class _Layer:
    pass


class Pending:
    """The result of a pass launched without waiting: result() waits for its copy to the host and gives
    convert(the host array)."""

    def __init__(self, copy, convert):
        self._copy, self._convert = copy, convert

    def result(self):
        return self._convert(self._copy.get())


class CudaTransformer:
    """The whole model on the GPU; with first_layer > 0 only layers [first_layer, n_layer) and the
    output layer (the GPU part of SplitTransformer, fed through forward_hidden)."""
    exact_rows = MAX_BATCH  # (longer passes use cuBLAS: see forward)

    def __init__(self, cpu_model: Transformer, ops=None, stream=None, first_layer: int = 0):
        if ops is None:
            from . import cuda as ops
        self.ops = ops
        self.xp = ops.xp
        self.cpu = cpu_model
        self.gguf = gf = cpu_model.gguf
        self.config = c = cpu_model.config
        if c.n_expert or c.recurrent or not c.pre_norms:
            kind = ("a mixture-of-experts model" if c.n_expert else f"an {c.arch} model (recurrent layers)"
                    if c.recurrent else f"an {c.arch} model (post-norms only)")
            raise SharpiError(f"{os.path.basename(gf.path)}: {kind} runs on the CPU only here (--device cpu or -ngl 0)")
        self.stream = stream if stream is not None else ops.new_stream()
        self.flash_attn = cpu_model.flash_attn
        self.trace = None
        self.first_layer = first_layer
        xp, s = self.xp, self.stream
        dev = lambda t: xp.asarray(np.ascontiguousarray(t.numpy(), dtype=np.float32))  # noqa: E731
        vec = lambda name: dev(load_vector(gf.tensor(name))) if name in gf.tensors else None  # noqa: E731
        try:
            with s:
                # the embedding table only where the embedding runs here (or it is the output layer)
                self.tok_embd = (ops.CudaQWeight.from_qweight(cpu_model.tok_embd, stream=s)
                                 if first_layer == 0 or c.tied_output else None)
                self.output = self.tok_embd if c.tied_output else ops.CudaQWeight.from_qweight(cpu_model.output, stream=s)
                self.output_norm = dev(cpu_model.output_norm)
                self.layers = []  # layers first_layer.. (cache layer j = layer first_layer + j)
                for i in range(first_layer, c.n_layer):
                    p = f"blk.{i}."
                    ly = _Layer()
                    # GGUF row order: the rope kernel pairs NEOX dims itself (the CPU path permutes rows)
                    parts = layer_parts(gf, c, i)  # (views of phi3's fused attn_qkv and ffn_up)
                    ly.qkv = _Proj(ops, [parts["q"], parts["k"], parts["v"]], p + "attn_qkv", "qkv", s,
                                   biases=[None if b is None else b.numpy() for b in qkv_biases(gf, c, i)])
                    ly.wo = _Proj(ops, [_weight(gf, p + "attn_output.weight")], p + "attn_output", "wo", s)
                    ly.gu = _Proj(ops, [parts["gate"], parts["up"]], p + "ffn_gate_up", "gu", s)
                    ly.down = _Proj(ops, [_weight(gf, p + "ffn_down.weight")], p + "ffn_down", "down", s)
                    ly.attn_norm, ly.ffn_norm = vec(p + "attn_norm.weight"), vec(p + "ffn_norm.weight")
                    ly.q_norm, ly.k_norm = vec(p + "attn_q_norm.weight"), vec(p + "attn_k_norm.weight")
                    ly.post_attn_norm = vec(p + "post_attention_norm.weight")
                    ly.post_ffn_norm = vec(p + "post_ffw_norm.weight")
                    self.layers.append(ly)
                # each matvec asks the L2 for the next matrix of the pass too (what half the L2 holds), while
                # the kernels before it wait on latency: that matrix's own prefetch starts one kernel ahead only
                mats = [m for ly in self.layers for pr in (ly.qkv, ly.wo, ly.gu, ly.down) for m in pr.mats]
                for m, after in zip(mats, mats[1:] + [self.output]):
                    m.ahead = ops.ahead_ranges([after.data])
        except Exception as e:  # out of device memory, unsupported type / shape
            raise SharpiError(f"cannot put {os.path.basename(gf.path)} on the GPU: {type(e).__name__}: {e}") from None
        self._tables: dict = {}   # (rope base, freq scale) -> device (cos, sin) table; "temps" -> q's temperatures
        self._heads: dict = {}    # n -> the output layer's first n rows
        self.use_graphs = GRAPHS and hasattr(ops, "capture")
        # greedy steps take the arg-max here and bring back 4 bytes a row (forward_argmax, greedy_chain)
        self.device_argmax = DEVICE_ARGMAX
        # sampling (the default chain) draws here and brings back each row's top-k law (forward_sample, sample_chain)
        self.device_sample = DEVICE_SAMPLE
        self._biases: dict = {}   # (logit bias pairs, width) -> dense device bias
        self.graph_launches = 0   # passes run as a graph launch (tests, benchmarks)
        # steps done inside the kernels around them (same bits; SHARPI_CUDA_FUSE=0 launches each alone)
        self.fuse = FUSE
        self.fuse_combine = FUSE_COMBINE
        self._att_cnt = None  # attention's per-row counters (zeros between launches), for this stream only
        self._cv, self._cv_key = {}, ()  # _controls
        self._ws = _Buffers(self.xp, True, ops.MAX_BATCH)
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {shape key: _Graph}
        # llama.cpp's CPU GELU goes through an fp16 table (~1e-3 off the exact one, enough to move
        # these small models' near-ties); SHARPI_ACT_QUANT=0 takes the exact function
        self._act = "gelu_tanh_f16" if c.act == "gelu_tanh" and MATCH_LLAMA_CPP else c.act

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        seen, total = set(), 0
        ws = [self.tok_embd, self.output] + [w for ly in self.layers for w in (ly.qkv, ly.wo, ly.gu, ly.down)]
        for w in ws:
            if w is not None and id(w) not in seen:
                seen.add(id(w))
                total += w.nbytes
        return total

    @property
    def decode_bytes(self) -> int:
        """Weight bytes one decoding step reads: every matrix, and of the embedding table only a row
        unless it doubles as the output layer."""
        return self.weight_bytes - (0 if self.output is self.tok_embd or self.tok_embd is None else self.tok_embd.nbytes)

    def new_cache(self, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> CudaKVCache:
        c = self.config
        if not self.flash_attn and type_v == "f16":  # attention with p_round: one split per query
            most = self.ops.p_round_max_keys(c.head_dim_k, c.head_dim_v)
            if n_ctx > most:
                raise UsageError(f"-fa off on this GPU supports a context of at most {most} tokens (-c {n_ctx}); "
                                 "use -fa on (the default) or a smaller -c")
        if self.cpu.use_context(n_ctx):  # (phi3: the RoPE factors of this context size)
            self._tables.clear()
            self._graphs = weakref.WeakKeyDictionary()  # (their passes hold the other factors' tables)
        with self.stream:
            cache = CudaKVCache(self.ops, len(self.layers), n_ctx, c.n_head_kv, c.head_dim_k, c.head_dim_v,
                                type_k, type_v, stream=self.stream)
        cache.rope_factors = self.cpu.rope_factor_set(n_ctx)
        return cache

    def shift_cache(self, cache: CudaKVCache, n_keep: int, n_discard: int) -> None:
        """Transformer.shift_cache for this model's cache (its K rows have the CPU cache's layout)."""
        self.cpu.shift_cache(cache, n_keep, n_discard, self.first_layer)

    # -- pieces ------------------------------------------------------------------------------------
    def _table(self, rope: tuple[float, float], n_pos: int):
        """The CPU model's ggml-exact rope table of (base, freq scale) for positions [0, n_pos), on the device."""
        tab = self._tables.get(rope)
        if tab is None or tab.shape[0] < n_pos:
            host = self.cpu._rope_table(rope, n_pos)  # complex64 [n, n_rot/2], grown by doubling
            tab = self._tables[rope] = self.xp.asarray(torch.view_as_real(host).contiguous().numpy())
        return tab

    def _temps(self, n_pos: int):
        """The CPU model's attention temperatures (mistral3) for positions [0, n_pos), on the device."""
        tab = self._tables.get("temps")
        if tab is None or tab.shape[0] < n_pos:
            tab = self._tables["temps"] = self.xp.asarray(self.cpu._attn_temps(n_pos).numpy())
        return tab

    def _output_head(self, n: int):
        w = self._heads.get(n)
        if w is None:
            o = self.output
            w = self._heads[n] = self.ops.CudaQWeight(o.data[: n * o.row_bytes], o.qtype, n, o.k,
                                                      name=f"{o.name}[:{n}]", stream=self.stream)
        return w

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, tokens, start_pos: int, cache: CudaKVCache, last_n: int | None = None,
                decode: bool = False, n_out: int | None = None) -> torch.Tensor:
        """As Transformer.forward. `decode` changes nothing here: every row of a pass of up to 16
        tokens goes through the same batched matvec, which sums each row in one order whatever the
        batch size, so verify rows equal one-token passes; longer passes use cuBLAS."""
        return self._pass(self._ids(tokens, start_pos, cache), None, start_pos, cache, last_n, n_out)

    def forward_argmax(self, tokens, start_pos: int, cache: CudaKVCache, bias=(), decode: bool = False,
                       n_out: int | None = None) -> torch.Tensor:
        """As forward, but each row's arg-max of the logits plus `bias` ((token id, value) pairs, ids
        distinct; ids past the row width ignored) taken on the device -> int64 [T], numpy.argmax's
        ties: greedy steps and greedy verification without bringing back the logits (600 KB a row
        for Qwen's vocabulary)."""
        return self._pass(self._ids(tokens, start_pos, cache), None, start_pos, cache, None, n_out,
                          argmax=(tuple(bias), 1))

    def greedy_chain(self, tokens, start_pos: int, cache: CudaKVCache, k: int, bias=(),
                     n_out: int | None = None, wait: bool = True):
        """tokens at start_pos, then k-1 one-token passes, each fed the arg-max (as forward_argmax) of
        the pass before -> the k arg-maxes, int64 [k]: a greedy draft's proposals in one graph launch
        and one 16-byte transfer. The cache then holds tokens + the first k-1 results. wait=False
        returns at once a Pending whose result() gives them (the CPU goes on meanwhile: a draft's
        next proposals computed while the target verifies these)."""
        ids = self._ids(tokens, start_pos, cache)
        if k < 1 or start_pos + ids.shape[0] + k - 1 > cache.capacity:
            raise ValueError(f"a chain of {k} from position {start_pos + ids.shape[0]} does not fit the "
                             f"cache of {cache.capacity}")
        return self._pass(ids, None, start_pos, cache, 1, n_out, argmax=(tuple(bias), k), wait=wait)

    def can_sample(self, params, n_out: int | None = None) -> bool:
        """Whether sample_chain can draw with these params: temp > 0, the default chain (top-k -> top-p -> min-p
        -> temperature) with a top-k of 1..TOPK_MAX that the logits row's width allows on the device, no
        penalties (sampling.SamplingParams.fixed_bias)."""
        n = n_out if n_out is not None and n_out < self.config.n_vocab else self.config.n_vocab
        return (self.device_sample and not params.greedy and params.plain_chain and params.fixed_bias
                and not params.adaptive_on and self.ops.topk_splits(n, int(params.top_k)) is not None)

    def sample_chain(self, tokens, start_pos: int, cache: CudaKVCache, k: int, params, u,
                     n_out: int | None = None, wait: bool = True):
        """tokens at start_pos, then k-1 one-token passes, each fed the token drawn from the pass before by
        the sampler chain on the device (ops.sample_top_k: params' top-k -> top-p -> min-p -> temperature, its
        logit bias added; can_sample(params) must hold), by the uniforms u [k] in [0, 1) -> (the k tokens,
        int64 [k] (-1: that row had nothing to draw, and the passes after it were fed id 0), the top-k's ids
        int64 [k, top_k], the law they were drawn from float32 [k, top_k]): a sampling draft's proposals and
        their q in one graph launch and one transfer. The cache then holds tokens + the first k-1 draws.
        wait=False returns at once a Pending whose result() gives them (as greedy_chain's)."""
        ids = self._ids(tokens, start_pos, cache)
        if k < 1 or start_pos + ids.shape[0] + k - 1 > cache.capacity:
            raise ValueError(f"a chain of {k} from position {start_pos + ids.shape[0]} does not fit the "
                             f"cache of {cache.capacity}")
        u = self._uniforms(u, k)
        return self._pass(ids, None, start_pos, cache, 1, n_out, sample=self._law(params, k), u=u, wait=wait)

    def forward_sample(self, tokens, start_pos: int, cache: CudaKVCache, params, u, decode: bool = False,
                       n_out: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As forward, but each row's law by the sampler chain and a token drawn from it by the uniform u[row]
        on the device, as sample_chain's (tokens [T], ids [T, top_k], probabilities [T, top_k]): a sampled
        step, or a verify pass's laws (p for the acceptance test), without bringing back the logits."""
        ids = self._ids(tokens, start_pos, cache)
        u = self._uniforms(u, ids.shape[0])
        return self._pass(ids, None, start_pos, cache, None, n_out, sample=self._law(params, 1), u=u)

    @staticmethod
    def _uniforms(u, n: int) -> np.ndarray:
        # (a double just under 1 rounds to 1.0 as a float32: the largest float below it instead)
        u = np.minimum(np.asarray(u, dtype=np.float64).reshape(-1), 1.0 - 2.0 ** -24).astype(np.float32)
        if u.shape[0] != n:
            raise ValueError(f"{u.shape[0]} uniforms for {n} draws")
        return u

    @staticmethod
    def _law(params, chain: int) -> tuple:
        """_pass's `sample`: (logit bias pairs, chain length, top-k, temp, top-p, min-p, min-keep)."""
        return (tuple(params.logit_bias), chain, int(params.top_k), float(params.temp), float(params.top_p),
                float(params.min_p), int(params.min_keep))

    @staticmethod
    def _draws(host: np.ndarray, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """sample_top_k's rows (top-k K) -> (tokens int64, top-k ids int64, probabilities float32)."""
        return (torch.from_numpy(host[:, 0].astype(np.int64)), torch.from_numpy(host[:, 1:K + 1].astype(np.int64)),
                torch.from_numpy(np.ascontiguousarray(host[:, K + 1:]).view(np.float32)))

    def forward_hidden(self, x: torch.Tensor, start_pos: int, cache: CudaKVCache, last_n: int | None = None,
                       n_out: int | None = None) -> torch.Tensor:
        """The residual stream x [T, D] (a CPU tensor, after layers [0, first_layer)) through this
        model's layers and the output layer -> logits, as forward."""
        check_pass(start_pos, x.shape[0], cache)
        if x.shape[0] == 0:
            return torch.zeros(0, self.config.n_vocab)
        return self._pass(None, np.ascontiguousarray(x.numpy(), dtype=np.float32), start_pos, cache, last_n, n_out)

    def _ids(self, tokens, start_pos: int, cache) -> np.ndarray:
        if self.first_layer:
            raise ValueError(f"this model holds layers {self.first_layer}.. only: feed it with forward_hidden")
        tokens = pass_tokens(tokens, start_pos, cache)
        return tokens.numpy().astype(np.int32)

    def _pass(self, ids, hidden, start_pos: int, cache: CudaKVCache, last_n: int | None, n_out: int | None,
              argmax: tuple | None = None, wait: bool = True, sample: tuple | None = None, u=None):
        """ids int32 [T] (or hidden float32 [T, D]) at start_pos -> logits, through a graph where it
        can; argmax = (logit bias pairs, chain length): the arg-maxes instead (int64), see greedy_chain;
        wait=False: a Pending of that; sample = (logit bias pairs, chain length, top-k, temp, top-p, min-p,
        min-keep) with the uniforms u float32 [chain]: the draws' rows instead (int32 numpy, see sample_chain)."""
        c, s = self.config, self.stream
        T = ids.shape[0] if ids is not None else hidden.shape[0]
        if T == 0:
            return torch.zeros(0, c.n_vocab) if argmax is None else torch.zeros(0, dtype=torch.long)
        last_n = last_n if last_n is not None and last_n < T else None
        n_out = n_out if n_out is not None and n_out < c.n_vocab else None
        chain = argmax[1] if argmax is not None else sample[1] if sample is not None else 1
        if sample is not None:
            convert = lambda host: self._draws(host, sample[2])  # noqa: E731
        else:
            convert = lambda host: torch.from_numpy(host if argmax is None else host.astype(np.int64))  # noqa: E731
        end = start_pos + T + chain - 1  # a chain's passes after the first add one each
        positions = np.arange(start_pos, end, dtype=np.int32)
        ca = _CacheArrays(cache)
        with s:
            self._controls()
            if T > self.ops.MAX_BATCH or self.trace is not None or not self.use_graphs:
                bufs = _Buffers(self.xp, False)
                inputs = self._inputs(bufs, ids, hidden, positions, u)
                out = self._run(bufs, inputs, ca, end, last_n, n_out, argmax, sample)
            else:
                graphs = self._graphs.setdefault(cache, {})
                key = (T, last_n, n_out, ids is None, self.flash_attn, argmax, sample)
                g = graphs.get(key)
                if g is None:
                    # the first pass of this shape runs eagerly (compiling kernels, sizing the workspace
                    # and the tables), then its launches are captured for the next ones
                    bufs = self._ws
                    inputs = self._inputs(bufs, ids, hidden, positions, u)
                    out = self._run(bufs, inputs, ca, ca.capacity, last_n, n_out, argmax, sample)
                    try:
                        graph = self.ops.capture(
                            lambda: self._run(bufs, inputs, ca, ca.capacity, last_n, n_out, argmax, sample), s)
                    except Exception as e:  # graphs only save launch time: go on without them
                        print(f"warning: CUDA graph capture failed ({type(e).__name__}: {e}); "
                              "launching kernels one by one", file=sys.stderr)
                        self.use_graphs = False
                    else:
                        keep = [*bufs.arrays.values(), *self._tables.values(), *self._heads.values(),
                                *self._biases.values(), *self._cv.values(), self._att_cnt]
                        graphs[key] = _Graph(graph, inputs, out, keep)
                else:
                    self._upload(g.inputs, ids, hidden, positions, u)
                    g.graph.launch(stream=s)
                    self.graph_launches += 1
                    out = g.result
            cache.length = end
            if not wait:
                return Pending(self.ops.to_host_async(out, stream=s), convert)
            return convert(self.ops.to_host(out, stream=s))  # (waits for this stream's work)

    def _inputs(self, bufs, ids, hidden, positions, u=None) -> tuple:
        """The device arrays of the pass's token ids (or hidden state) and positions (and a sampling chain's
        uniforms), uploaded."""
        first = bufs.get("tok", ids.shape, np.int32) if ids is not None else bufs.get("x", hidden.shape)
        inputs = (first, bufs.get("pos", positions.shape, np.int32))
        if u is not None:
            inputs += (bufs.get("u", u.shape),)
        self._upload(inputs, ids, hidden, positions, u)
        return inputs

    def _upload(self, inputs: tuple, ids, hidden, positions, u=None) -> None:
        first, pos = inputs[:2]
        self.ops.upload(first, ids if ids is not None else hidden, stream=self.stream)
        self.ops.upload(pos, positions, stream=self.stream)
        if u is not None:
            self.ops.upload(inputs[2], u, stream=self.stream)

    def _bias(self, pairs: tuple, n: int):
        """The logit bias as a dense device vector of width n (None without one)."""
        if not pairs:
            return None
        key = (pairs, n)
        b = self._biases.get(key)
        if b is None:
            host = np.zeros(n, np.float32)
            for i, v in pairs:
                if 0 <= i < n:
                    host[i] = np.float32(v)
            b = self._biases[key] = self.xp.asarray(host)
        return b

    def _controls(self) -> dict:
        """The CPU model's control vectors ({layer: [D]}, control_vector.load) as device arrays (self._cv), made
        again when they change, which drops the graphs captured before (before a pass, never inside a capture)."""
        key = tuple((i, id(v)) for i, v in sorted(self.cpu.control.items()))
        if self._cv_key != key:
            self._cv = {i: self.xp.asarray(np.ascontiguousarray(v.numpy(), dtype=np.float32))
                        for i, v in self.cpu.control.items()}
            # (the source tensors held too: their ids in the key cannot go to new ones while they live)
            self._cv_key, self._cv_src = key, list(self.cpu.control.values())
            self._graphs = weakref.WeakKeyDictionary()  # (graphs captured with other vectors, or none)
        return self._cv

    def _counters(self, T: int):
        """Zeroed int32 counters for T query rows, a head each (made in an eager pass, so never inside a
        capture)."""
        H = self.config.n_head
        if self._att_cnt is None or self._att_cnt.size < T * H:
            self._att_cnt = self.xp.zeros(max(T, self.ops.MAX_BATCH) * H, dtype=np.int32)
        return self._att_cnt

    def _run(self, b: _Buffers, inputs: tuple, cache: _CacheArrays, n_kv: int, last_n: int | None,
             n_out: int | None, argmax: tuple | None, sample: tuple | None = None):
        """The pass (_body) and, with argmax = (bias pairs, chain), the arg-max of each logits row,
        then chain - 1 one-token passes, each fed the last arg-max -> logits or int32 ids [rows + chain - 1]
        (views in b); with sample (see _pass) a draw instead of each arg-max -> int32 [chain, 1 + 2 top-k]
        (sample_top_k's rows). inputs: (token ids [T], positions [T + chain - 1][, uniforms [chain]])."""
        first, pos = inputs[:2]
        T = int(first.shape[0])
        logits = self._body(b, (first, pos[:T]), cache, n_kv, last_n, n_out)
        if argmax is None and sample is None:
            return logits
        pairs, chain = (argmax or sample)[:2]
        rows, n = logits.shape  # (a chain's first pass keeps its last row)
        bias = self._bias(pairs, n)
        ids = b.get("ids", (rows + chain - 1,), np.int32)  # each row's pick: the next pass's input in a chain
        if sample is None:
            _, splits = self.ops.argmax_splits(n)
            work = (b.get("am_v", (rows * splits,)), b.get("am_i", (rows * splits,), np.int32))

            def pick(x, a: int, z: int) -> None:  # rows a..z-1 of ids: x's arg-maxes
                self.ops.argmax(x, bias, out=ids[a:z], work=work, stream=self.stream)
            result = ids
        else:
            K, law, u = sample[2], sample[2:], inputs[2]
            _, S = self.ops.topk_splits(n, K)
            result = b.get("draws", (rows + chain - 1, self.ops.sample_out_width(K)), np.int32)
            work = b.get("topk_keys", (rows * S * K,), np.uint64)

            def pick(x, a: int, z: int) -> None:  # rows a..z-1: x's laws and draws (the ids into `ids` too)
                self.ops.sample_top_k(x, *law, u[a:z], bias, out=result[a:z], tok=ids[a:z], work=work,
                                      stream=self.stream)
        pick(logits, 0, rows)
        for i in range(rows, rows + chain - 1):  # rows == 1 here: the last pick is the next input
            logits = self._body(b, (ids[i - 1:i], pos[T + i - rows:T + i - rows + 1]), cache, n_kv, None, n_out)
            pick(logits, i, i + 1)
        return result

    def _body(self, b: _Buffers, inputs: tuple, cache: _CacheArrays, n_kv: int, last_n: int | None,
              n_out: int | None):
        """The pass on the device, kernel launches only (no allocation with a persistent `b`, nothing
        that depends on the position but the device arrays `inputs`) -> logits [T', n] (a view in b).
        n_kv: keys attention is launched over, from the pass's end up to the cache's capacity (same
        results). Runs inside `with self.stream`."""
        c, ops, s = self.config, self.ops, self.stream
        first, pos = inputs
        T = int(pos.shape[0])
        H, Hkv, hd, hdv, D = c.n_head, c.n_head_kv, c.head_dim_k, c.head_dim_v, c.n_embd
        scale, kq_scale = attention_scales(c)
        neox = c.rope_style == ROPE_NEOX
        eps = c.norm_eps
        # llama.cpp's CPU rounding of q before q.k, and of P before P.V without flash attention
        q_round = "q8_0" if cache.type_k == "q8_0" else "f16"
        p_round = not self.flash_attn and cache.type_v == "f16"
        tables = {r: self._table(r, cache.capacity) for r in self.cpu._ropes}
        tr = None if self.trace is None else (lambda name, a: self.trace(name, torch.from_numpy(ops.to_host(a, stream=s))))
        if first.dtype == np.int32:
            x = self.tok_embd.rows(first, stream=s, out=b.get("x", (T, D)))  # [T, D]
            if c.embed_scale != 1.0:
                ops.scale(x, c.embed_scale, stream=s)
        else:
            x = first
        # the norms and the GLU write their output already rounded for the matmul that reads it (one
        # launch less each), unless a trace wants the unrounded values
        fused = self.fuse and tr is None
        fuse = lambda proj: fused and proj.kind != MIXED  # noqa: E731
        # kv_append and attention read K and q through RoPE (no launch of its own), unless q is scaled
        # or rotated after RoPE
        fuse_rope = fused and not c.scale_q and not c.attn_temp_scale and cache.rot_k is None
        temps = self._temps(cache.capacity) if c.attn_temp_scale else None
        # attention's launch combines its own splits (its last block per row): one launch a layer less
        counters = self._counters(T) if fused and self.fuse_combine and H * hdv % 32 == 0 else None
        controls = self._cv  # layer -> control vector (the CPU model's, on the device: _controls)
        pending = None  # the last FFN output, added to x by the norm that follows it
        for j, ly in enumerate(self.layers):
            i = self.first_layer + j
            f = fuse(ly.qkv)
            hq = ly.qkv.q8_buf(b, T, D) if f else None  # its q8 rows, for integer matvecs
            h = ops.rms_norm(x, ly.attn_norm, eps, out=b.get("h", (T, D)), add=pending,
                             rounding=ly.qkv.kind if f else None, q8=hq, stream=s)
            if tr is not None:
                if pending is not None:
                    tr(f"l_out-{i - 1}", x)
                tr(f"attn_norm-{i}", h)
            qkv = ly.qkv(h, b, rounded=f, xq=hq)  # [T, H*hd], [T, Hkv*hd], [T, Hkv*hdv]: column views, biases added
            q, k, v = qkv[0].reshape(T, H, hd), qkv[1].reshape(T, Hkv, hd), qkv[2].reshape(T, Hkv, hdv)
            if ly.q_norm is not None:
                ops.rms_norm(q, ly.q_norm, eps, out=q, stream=s)
                ops.rms_norm(k, ly.k_norm, eps, out=k, stream=s)
            tab = tables[c.layer_rope(i)]
            rope = (tab, c.n_rot, neox) if fuse_rope and c.has_rope(i) else None
            if rope is None and c.has_rope(i):
                qk = ly.qkv.span(qkv, 0, 1)  # q and k side by side: one launch turns both
                if qk is not None:
                    ops.rope(qk.reshape(T, H + Hkv, hd), pos, c.n_rot, neox, table=tab, stream=s)
                else:
                    ops.rope(q, pos, c.n_rot, neox, table=tab, stream=s)
                    ops.rope(k, pos, c.n_rot, neox, table=tab, stream=s)
            if temps is not None:  # attention temperatures, after RoPE as llama.cpp's ggml_mul
                ops.scale_rows(q, temps, pos, stream=s)
            if c.scale_q:  # before q is rounded to the K cache's type, as llama.cpp's gemma3 graph
                ops.scale(q, scale, stream=s)
            if cache.rot_k is not None:
                q = ops.hadamard(q, cache.rot_k, out=b.get("q_rot", q.shape), stream=s)
                k = ops.hadamard(k, cache.rot_k, out=b.get("k_rot", k.shape), stream=s)
            if cache.rot_v is not None:
                v = ops.hadamard(v, cache.rot_v, out=b.get("v_rot", v.shape), stream=s)
            ops.kv_append(k, cache.k[j], pos, v, cache.v[j], rope=rope, stream=s)
            window = c.sliding_window if c.is_swa(i) else 0
            work = None
            if b.persistent:
                _, splits = ops.attention_splits(n_kv, cache.capacity, window=window, p_round=p_round)
                n_op, n_ml = ops.attention_work(1, H, hdv, splits)  # per query row
                work = (b.get("att_op", (T, n_op)), b.get("att_ml", (T, n_ml)))
            # the output rounded for wo by the launch combining the splits (not before a V rotation). The
            # kernel caps q.k before its scale, llama.cpp's flash attention after it: the same with Gemma 2's
            # kq_scale of 1 (q is scaled instead)
            f = fuse(ly.wo) and cache.rot_v is None
            oq = ly.wo.q8_buf(b, T, H * hdv) if f else None
            o = ops.attention(q, cache.k[j], cache.v[j], pos, n_kv, kq_scale, window=window, softcap=c.attn_softcap,
                              q_round=q_round, p_round=p_round, out=b.get("att", (T, H, hdv)), work=work, rope=rope,
                              rounding=ly.wo.kind if f else None, counters=counters, q8=oq, stream=s)
            o = o.reshape(T, H * hdv)
            if cache.rot_v is not None:
                o = ops.hadamard(o, cache.rot_v, out=b.get("att_rot", o.shape), stream=s)
            if tr is not None:
                tr(f"kqv_out-{i}", o)
            (o,) = ly.wo(o, b, rounded=f, xq=oq)
            if ly.post_attn_norm is not None:
                ops.rms_norm(o, ly.post_attn_norm, eps, out=o, stream=s)
            if c.residual_scale:
                ops.scale(o, c.residual_scale, stream=s)
            if last_n is not None and i == c.n_layer - 1:  # the last FFN only where logits are wanted
                x, o, T = x[-last_n:], o[-last_n:], last_n
            f = fuse(ly.gu)
            hq = ly.gu.q8_buf(b, T, D) if f else None
            h = ops.rms_norm(x, ly.ffn_norm, eps, out=b.get("h", (T, D)), add=o, rounding=ly.gu.kind if f else None,
                             q8=hq, stream=s)
            g, u = ly.gu(h, b, rounded=f, xq=hq)  # [T, n_ff] each
            f = fuse(ly.down)
            aq = ly.down.q8_buf(b, T, g.shape[1]) if f else None
            a = ops.glu(g, u, self._act, out=b.get("glu", g.shape), rounding=ly.down.kind if f else None, q8=aq,
                        stream=s)
            if tr is not None:
                tr(f"ffn_inp-{i}", x)
                tr(f"ffn_norm-{i}", h)
                tr(f"ffn_swiglu-{i}", a)
            (pending,) = ly.down(a, b, rounded=f, xq=aq)
            if ly.post_ffn_norm is not None:
                ops.rms_norm(pending, ly.post_ffn_norm, eps, out=pending, stream=s)
            if c.residual_scale:
                ops.scale(pending, c.residual_scale, stream=s)
            if tr is not None:
                tr(f"ffn_out-{i}", pending)
            cv = controls.get(i)
            if cv is not None:  # llama.cpp's (x + ffn) + c: the residual add launched alone, then c (not fused)
                ops.rms_norm(x, None, eps, out=b.get("cv_norm", x.shape), add=pending, stream=s)  # (its norm unused)
                ops.add_bias(x, cv, stream=s)
                pending = None
                if tr is not None:
                    tr(f"l_out-{i}", x)
        head = self.output if n_out is None else self._output_head(n_out)
        kind = act_kind(head.qtype)
        xq = b.get("q8:head", (T, ops.q8_row_bytes(D)), np.uint8) if head.wants_xq(T) else None
        xn = ops.rms_norm(x, self.output_norm, eps, out=b.get("h", (T, D)), add=pending, rounding=kind, q8=xq,
                          stream=s)
        if tr is not None:
            tr(f"l_out-{c.n_layer - 1}", x)
        logits = head.matmul(xn, stream=s, out=b.get("logits", (T, head.n)), xq=xq)
        if c.logit_scale:
            ops.scale(logits, c.logit_mul, stream=s)
        if c.final_softcap:
            ops.softcap(logits, c.final_softcap, stream=s)
        return logits


class SplitCache:
    """The KV cache of a SplitTransformer: a CPU KVCache for the CPU layers and a CudaKVCache for the
    GPU ones, one length."""

    def __init__(self, cpu, gpu):
        self.cpu, self.gpu = cpu, gpu
        self.capacity = gpu.capacity
        self.type_k, self.type_v = gpu.type_k, gpu.type_v
        self.rot_k, self.rot_v = gpu.rot_k, gpu.rot_v

    @property
    def length(self) -> int:
        return self.gpu.length

    def reach(self, n: int) -> int:
        return n

    def keep_states(self, n: int) -> None:
        pass  # (no recurrent layers on the GPU)

    def truncate(self, n: int) -> None:
        self.gpu.truncate(n)
        self.cpu.truncate(n)

    def shift(self, n_keep: int, n_discard: int, shift_k) -> None:
        """shift_k(layer, k) with the model's layer numbers: the GPU cache's layer j is layer n_cpu + j."""
        n_cpu = self.cpu.k.q.shape[0]
        self.cpu.shift(n_keep, n_discard, shift_k)
        self.gpu.shift(n_keep, n_discard, lambda j, k: shift_k(n_cpu + j, k))

    @property
    def nbytes(self) -> int:
        return self.gpu.nbytes + self.cpu.nbytes


class SplitTransformer:
    """-ngl N below the layer count: like llama.cpp, the last N layers run on the GPU and the first
    ones on the CPU (the CPU model's own kernels, bit for bit its arithmetic), the embedding on the
    CPU; the output layer runs on the GPU with the last layer. One [T, D] residual stream crosses
    over per pass. Verify rows stay equal to one-token passes on both sides (decode=True on the CPU
    part, the batch-invariant matvecs on the GPU part)."""
    exact_rows = min(EXACT_ROWS, MAX_BATCH)

    def __init__(self, cpu_model: Transformer, n_gpu_layers: int, ops=None, stream=None):
        c = cpu_model.config
        if not 0 < n_gpu_layers < c.n_layer:
            raise ValueError(f"a split needs 0 < n_gpu_layers < {c.n_layer}")
        self.cpu, self.config, self.gguf = cpu_model, c, cpu_model.gguf
        self.n_cpu = c.n_layer - n_gpu_layers
        self.gpu = CudaTransformer(cpu_model, ops, stream, first_layer=self.n_cpu)

    @property
    def flash_attn(self) -> bool:
        return self.cpu.flash_attn

    @flash_attn.setter
    def flash_attn(self, on: bool) -> None:
        self.cpu.flash_attn = self.gpu.flash_attn = on

    @property
    def trace(self):
        return self.cpu.trace

    @trace.setter
    def trace(self, fn) -> None:
        self.cpu.trace = self.gpu.trace = fn

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights this model reads: the CPU layers and the embedding table in the CPU's
        memory, the rest on the GPU."""
        cpu_layers = sum(getattr(ly, f).nbytes for ly in self.cpu.layers[:self.n_cpu]
                         for f in ("wqk", "wv", "wo", "w_gu", "w_down"))
        embd = 0 if self.gpu.tok_embd is not None else self.cpu.tok_embd.nbytes
        return cpu_layers + embd + self.gpu.weight_bytes

    @property
    def decode_bytes(self) -> int:
        """Weight bytes a decoding step reads, in both memories (not a GPU bandwidth figure)."""
        return self.weight_bytes - (0 if self.gpu.tok_embd is not None else self.cpu.tok_embd.nbytes)

    def new_cache(self, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> SplitCache:
        from ..kv_cache import KVCache
        c = self.config
        gpu = self.gpu.new_cache(n_ctx, type_k, type_v)  # refuses types the GPU lacks
        return SplitCache(KVCache(self.n_cpu, n_ctx, c.n_head_kv, c.head_dim_k, c.head_dim_v, type_k, type_v), gpu)

    def shift_cache(self, cache: SplitCache, n_keep: int, n_discard: int) -> None:
        """Transformer.shift_cache over both parts (SplitCache.shift numbers the GPU part's layers)."""
        self.cpu.shift_cache(cache, n_keep, n_discard)

    def forward(self, tokens, start_pos: int, cache: SplitCache, last_n: int | None = None,
                decode: bool = False, n_out: int | None = None) -> torch.Tensor:
        """As Transformer.forward."""
        tokens = pass_tokens(tokens, start_pos, cache)
        if tokens.shape[0] == 0:
            return torch.zeros(0, self.config.n_vocab)
        x = self.cpu.hidden(tokens, start_pos, cache.cpu, self.n_cpu, prompt_pass(tokens.shape[0], decode))
        return self.gpu.forward_hidden(x, start_pos, cache.gpu, last_n, n_out)


def offload(model: Transformer, n_gpu_layers: int, ops=None):
    """-ngl: 0 keeps `model` on the CPU; -1 or at least its layer count puts all of it on the GPU;
    another number N runs the last N layers on the GPU and the rest on the CPU (SplitTransformer)."""
    if n_gpu_layers == 0:
        return model
    if 0 < n_gpu_layers < model.config.n_layer:
        return SplitTransformer(model, n_gpu_layers, ops)
    return CudaTransformer(model, ops)
