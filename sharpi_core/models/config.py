"""Model configuration: one frozen dataclass, filled from GGUF metadata by per-arch tables."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import SharpiError
from ..gguf_file import GGUFFile
from ..libm import logf

ROPE_NORM, ROPE_NEOX = "norm", "neox"  # adjacent pairs vs. halves (llama.cpp's rope types)


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ff: int
    norm_eps: float
    rope_base: float
    n_rot: int
    rope_style: str
    qkv_bias: bool = False
    qk_norm: bool = False           # per-head RMSNorm of q and k (gemma3)
    post_norms: bool = False        # RMSNorm after attention and after the FFN (gemma2, gemma3, olmo2)
    pre_norms: bool = True          # RMSNorm before attention and before the FFN (olmo2: none, only the post-norms)
    qk_norm_full: bool = False      # (olmo2) q and k RMS-normed over all their heads at once, weights [H * hd] / [Hkv * hd]
    act: str = "silu"               # gated FFN activation: silu (SwiGLU) | gelu_tanh (GeGLU) | swiglu_oai (gpt-oss)
    embed_scale: float = 1.0        # gemma multiplies embeddings by sqrt(n_embd), granite by its embedding_scale
    residual_scale: float = 0.0     # granite: attention and FFN outputs times this before their residual add (0 = none)
    logit_scale: float = 0.0        # granite: logits times 1 / this (0 = none)
    attn_scale: float = 0.0         # 0 -> 1/sqrt(head_dim_k)
    scale_q: bool = False           # the scale multiplies q before q.k (gemma2/3 in llama.cpp), not the scores
    attn_softcap: float = 0.0       # scores through c * tanh(s / c) (gemma2's attention logit softcapping); 0 = none
    final_softcap: float = 0.0      # the same on the output logits (gemma2; gemma3 when its GGUF says so)
    sliding_window: int = 0         # 0 = none
    swa_pattern: int = 0            # every swa_pattern-th layer is global; the others slide (the arch's default)
    swa_layers: tuple = ()          # per layer: does it slide (from swa_pattern or the GGUF's pattern)
    rope_base_swa: float = 0.0      # rope base of sliding layers (0 -> rope_base)
    rope_freq_scale_swa: float = 1.0  # their frequency scale (whatever the context's settings)
    rope_freq_scale: float = 1.0    # positions times this (linear RoPE scaling: 1 / factor), sliding layers excepted
    tied_output: bool = False       # output.weight absent -> reuse token_embd
    rope_freqs: bool = False        # RoPE frequencies divided by rope_freqs.weight (Llama 3.1+ GGUFs)
    rope_long_short: bool = False   # ... or by rope_factors_long / _short.weight (phi3's longrope)
    n_ctx_orig: int = 0             # contexts longer than this take the long factors (rope.scaling.original_context_length)
    rope_attn_factor: float = 1.0   # cos and sin times this (rope.scaling.attn_factor: q.k times its square)
    rope_scaling: str = "linear"    # rope.scaling.type: none | linear | yarn | longrope (--rope-scaling)
    yarn_ext_factor: float = -1.0   # YaRN's extrapolation mix (--yarn-ext-factor; < 0: 1 under yarn scaling, else 0)
    yarn_attn_factor: float = -1.0  # --yarn-attn-factor (< 0: 1); YaRN replaces it while its mix is on (llama.cpp)
    yarn_beta_fast: float = 32.0    # YaRN's correction dims: pairs turning more than beta_fast times in
    yarn_beta_slow: float = 1.0     # yarn_orig_ctx positions extrapolate, fewer than beta_slow interpolate
    yarn_log_mul: float = 0.0       # rope.scaling.yarn_log_multiplier (mistral3: mscale_all_dim)
    yarn_orig_ctx: int = 0          # --yarn-orig-ctx: the correction dims' context (0 -> n_ctx_orig)
    attn_temp_scale: float = 0.0    # mistral3: q times log(floor(pos / n_ctx_orig) + 1) * this + 1 (0 = none)
    rope_fixed_pairs: tuple = ()    # (M-RoPE) the rotated pairs in the fourth section: position 0 for text tokens
    qkv_fused: bool = False         # q, k and v rows in one attn_qkv tensor (phi3; any arch with `--fuse-qkv`)
    qkv_bias_fused: bool = False    # ... their biases in one attn_qkv.bias
    ffn_up_gated: bool = False      # ffn_up holds the gate rows, then the up rows; no ffn_gate (phi3)
    nope_every: int = 0             # every nope_every-th layer has no RoPE at all (smollm3: 4th, 8th, ...)
    n_expert: int = 0               # mixture of experts (Mixtral's llama, qwen3moe): experts per layer, 0 = dense FFN
    n_expert_used: int = 0          # experts each token is routed to
    n_ff_exp: int = 0               # an expert's FFN width
    expert_gating: str = "softmax"  # softmax: the top experts by probability, renormalized; softmax_weight (gpt-oss):
                                    # the top experts by router logit, softmax over theirs
    moe_bias: bool = False          # biases on the router's logits and on each expert's gate, up and down (gpt-oss)
    expert_weights_norm: bool = True  # softmax gating: the used experts' probabilities over their sum (qwen2moe: as they are)
    n_ff_shexp: int = 0             # a shared expert's FFN width (qwen2moe, granitemoe, qwen35moe), added to the routed experts'
                                    # sum; 0 = no shared expert
    shexp_gated: bool = False       # (qwen2moe, qwen35moe) the shared expert's output times a sigmoid gate per token
    shexp_plain_sigmoid: bool = False  # ... computed as ggml_sigmoid (qwen35moe), not as silu(x) / x (qwen2moe)
    gate_up_exps: frozenset = frozenset()  # (qwen35moe) the layers whose experts' gate and up rows are one tensor,
                                    # ffn_gate_up_exps (each expert's gate rows, then its up rows), as converters
                                    # write them with --fuse-gate-up-exps
    attn_out_bias: bool = False     # attn_output.bias (gpt-oss)
    attn_sinks: bool = False        # a learned sink logit per head in the attention softmax (gpt-oss)
    recurrent: tuple = ()           # per layer: a recurrent block instead of attention (lfm2: short convolution;
                                    # qwen35: Gated DeltaNet)
    conv_width: int = 0             # those blocks' convolution width (shortconv.l_cache, ssm.conv_kernel: the state
                                    # holds width - 1 rows)
    attn_gate: bool = False         # (qwen35) attn_q holds each head's q rows then a gate's: output times sigmoid(gate)
    ssm_d_state: int = 0            # (qwen35) Gated DeltaNet head size S (keys and values), 0 = none
    ssm_n_group: int = 0            # its key heads (q and k), shared by
    ssm_dt_rank: int = 0            # its value heads (ssm.time_step_rank)
    n_layer_nextn: int = 0          # next-token-prediction layers after the n_layer the graph runs (not run)

    def is_swa(self, layer: int) -> bool:
        return self.sliding_window > 0 and layer < len(self.swa_layers) and self.swa_layers[layer]

    @property
    def logit_mul(self) -> float:
        """What granite's logits are multiplied by: 1.0f / logit_scale, computed in float (ggml_scale's factor)."""
        return float(np.float32(1) / np.float32(self.logit_scale))

    def is_recurrent(self, layer: int) -> bool:
        return layer < len(self.recurrent) and self.recurrent[layer]

    @property
    def attn_layers(self) -> list[int]:
        """The layers with attention (all but lfm2's convolution blocks): KV cache layer j is layer attn_layers[j]."""
        return [i for i in range(self.n_layer) if not self.is_recurrent(i)]

    @property
    def ssm_conv_dim(self) -> int:
        """(qwen35) the channels of a Gated DeltaNet layer's convolution: q, k (key heads) and v (value heads)."""
        return (2 * self.ssm_n_group + self.ssm_dt_rank) * self.ssm_d_state

    @property
    def gdn_l2_norm(self) -> tuple[float, float]:
        """(qwen35) (eps, scale) of the Gated DeltaNet's q / k L2 norm, as llama.cpp's build_gdn_l2_norm computes them
        in float: rms_norm with eps / S, times 1 / sqrt(S)."""
        S = np.float32(self.ssm_d_state)
        return float(np.float32(self.norm_eps) / S), float(np.float32(1) / np.sqrt(S))

    @property
    def output_norm_name(self) -> str:
        return "token_embd_norm.weight" if self.arch == "lfm2" else "output_norm.weight"  # (LFM2 GGUFs' name)

    @property
    def ffn_norm_name(self) -> str:
        # (gpt-oss and Qwen3.5 GGUFs name the norm before the FFN post_attention_norm)
        return "post_attention_norm.weight" if self.arch == "gpt-oss" or self.arch in QWEN35_ARCHS else "ffn_norm.weight"

    @property
    def can_shift(self) -> bool:
        """Whether llama.cpp shifts this model's cache (llama_kv_cache::get_can_shift): not under M-RoPE, whose
        positions are four a token (llama.cpp then turns --context-shift off with a warning)."""
        return self.arch not in MROPE_ARCHS

    def has_rope(self, layer: int) -> bool:
        return not (self.nope_every and (layer + 1) % self.nope_every == 0)

    @property
    def yarn(self) -> tuple[float, int, float, float]:
        """(ext_factor, original context, beta_fast, beta_slow) of the rope tables, as llama.cpp's context
        resolves them: the mix is 1 under yarn scaling unless given, else 0 (no YaRN)."""
        ext = self.yarn_ext_factor if self.yarn_ext_factor >= 0 else 1.0 if self.rope_scaling == "yarn" else 0.0
        return ext, self.yarn_orig_ctx or self.n_ctx_orig, self.yarn_beta_fast, self.yarn_beta_slow

    @property
    def rope_mscale(self) -> float:
        """What every rope table's cos and sin are multiplied by: llama.cpp's cparams.yarn_attn_factor, in
        float as its context computes it (with YaRN's mix on: get_mscale(factor, 1) (over get_mscale(factor,
        log_mul) when the GGUF gives one) times 1 / (1 + 0.1 ln factor), which the rope cache's own
        1 + 0.1 ln(1 / freq_scale) cancels), times rope.scaling.attn_factor."""
        f = np.float32
        attn = f(self.yarn_attn_factor if self.yarn_attn_factor >= 0 else 1.0)
        if self.yarn[0] != 0:
            factor = f(1) / f(self.rope_freq_scale)

            def mscale(m):
                return f(1) if factor <= 1 else f(f(f(0.1) * f(m)) * logf(factor)) + f(1)
            attn = mscale(1.0) / mscale(self.yarn_log_mul) if self.yarn_log_mul else mscale(1.0)
            attn = f(attn * (f(1) / (f(1) + f(0.1) * logf(factor))))
        return float(f(attn * f(self.rope_attn_factor)))

    def attn_temps(self, n: int) -> np.ndarray:
        """float32 [n]: q's multiplier at positions [0, n) under attention temperature tuning (llama.cpp's
        llm_graph_input_attn_temp: log(floor(pos / n_ctx_orig) + 1) * scale + 1, the floor of a float
        quotient, the rest in double): 1 below the original context."""
        k = np.floor(np.arange(n, dtype=np.float32) / np.float32(self.n_ctx_orig)).astype(np.int64)
        scale = float(np.float32(self.attn_temp_scale))
        per_k = np.array([math.log(j + 1.0) * scale + 1.0 for j in range(int(k[-1]) + 1 if n else 0)])
        return per_k[k].astype(np.float32)

    def layer_rope(self, layer: int) -> tuple[float, float]:
        """(base, frequency scale) of the layer's RoPE: llama.cpp's get_rope_freq_base / _scale, whose
        sliding layers keep their own base and scale 1 whatever the context's settings."""
        if self.is_swa(layer) and self.rope_base_swa:
            return self.rope_base_swa, self.rope_freq_scale_swa
        return self.rope_base, self.rope_freq_scale


def _common(gf: GGUFFile, n_vocab: int) -> dict:
    a = gf.arch_get
    n_embd = int(gf.require(f"{gf.arch}.embedding_length", 0))
    n_head = int(gf.require(f"{gf.arch}.attention.head_count", 0))
    hd_k = int(a("attention.key_length", n_embd // n_head if n_head > 0 else 0))  # 0 heads: check_config says so
    n_ctx_train = int(gf.require(f"{gf.arch}.context_length", 0))  # (llama.cpp's loaders require it too)
    n_layer = int(gf.require(f"{gf.arch}.block_count", 0))
    if not 0 < n_layer <= MAX_LAYERS:  # (before anything is built per layer: 2**32 - 1 of them took minutes)
        raise SharpiError(f"{gf.path}: block_count is {n_layer} in its metadata (1 to {MAX_LAYERS} layers)")
    return dict(
        arch=gf.arch,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=_head_count_kv(gf, n_head, n_layer),
        head_dim_k=hd_k,
        head_dim_v=int(a("attention.value_length", hd_k)),
        # (qwen35moe: optional, as llama.cpp reads it for every graph; its FFNs are all experts, their widths
        # keys of their own, n_ff only those widths' default)
        n_ff=int((a("feed_forward_length", 0) or 0) if gf.arch == "qwen35moe" else gf.require(f"{gf.arch}.feed_forward_length", 0)),
        # every graph here needs it, as llama.cpp's loaders do (no default: a wrong eps moves every norm), except
        # qwen2vl, whose loader in llama.cpp 0.3.36 reads none: its hparams' zero, whatever the GGUF says
        norm_eps=0.0 if gf.arch == "qwen2vl" else float(gf.require(f"{gf.arch}.attention.layer_norm_rms_epsilon", 0.0)),
        rope_base=float(a("rope.freq_base", 10000.0)),
        rope_freq_scale=_rope_freq_scale(gf),
        rope_scaling=str(a("rope.scaling.type", "linear")),
        # llama.cpp multiplies every rope cache by it (yarn_attn_factor *= rope_attn_factor)
        rope_attn_factor=float(a("rope.scaling.attn_factor", 1.0)),
        n_ctx_orig=int(a("rope.scaling.original_context_length", 0) or n_ctx_train),
        n_rot=int(a("rope.dimension_count", hd_k)),
        tied_output=_tied_output(gf),
    )


# graphs whose loaders require output.weight (no fallback to the token embedding)
OWN_OUTPUT_ARCHS = frozenset({"gpt-oss", "qwen2moe", "olmo2"})


def _tied_output(gf: GGUFFile) -> bool:
    """Whether the logits reuse token_embd (output.weight absent); an error where the arch's loader requires it."""
    tied = "output.weight" not in gf.tensors
    if tied and gf.arch in OWN_OUTPUT_ARCHS:
        raise SharpiError(f"{gf.path}: tensor 'output.weight' is missing")
    return tied


def _head_count_kv(gf: GGUFFile, n_head: int, n_layer: int) -> int:
    """attention.head_count_kv: one number, or one per layer (llama.cpp's get_key_or_arr): lfm2's 0 for its
    convolution layers (_lfm2); other graphs here take one count for every layer."""
    v = gf.arch_get("attention.head_count_kv", n_head)
    if not isinstance(v, (list, tuple)):
        return int(v)
    if len(v) != n_layer:  # (llama.cpp's get_key_or_arr: an array has one value a layer)
        raise SharpiError(f"{gf.path}: attention.head_count_kv has {len(v)} values for {n_layer} layers")
    counts = {int(n) for n in v} - ({0} if gf.arch == "lfm2" or gf.arch in QWEN35_ARCHS else set())
    if len(counts) > 1:
        raise SharpiError(f"{gf.path}: KV head counts that differ between layers ({sorted(counts)}) are not supported")
    return counts.pop() if counts else 0


ROPE_SCALINGS = ("none", "linear", "yarn", "longrope")


def _rope_freq_scale(gf: GGUFFile) -> float:
    """llama.cpp's rope_freq_scale_train: 1.0f / rope.scaling.factor (or the older rope.scale_linear) in
    float, under linear scaling (its default type), yarn and longrope (whose factors are tensors); 1 for
    'none'. Other scalings are refused, not run unscaled."""
    a = gf.arch_get
    kind = str(a("rope.scaling.type", "linear"))
    if kind not in ROPE_SCALINGS:
        raise SharpiError(f"{gf.path}: RoPE scaling '{kind}' is not supported (supported: {', '.join(ROPE_SCALINGS)})")
    factor = float(a("rope.scaling.factor", 0.0) or a("rope.scale_linear", 0.0) or 0.0)
    return 1.0 if kind == "none" or factor == 0 else float(np.float32(1) / np.float32(factor))


# Per-architecture differences from the llama block, as llama.cpp builds each graph.
ARCH_TABLE = {
    "llama": dict(rope_style=ROPE_NORM),
    "ernie4_5": dict(rope_style=ROPE_NORM),  # (Baidu's ERNIE 4.5 dense: llama's graph without rope_freqs)
    "qwen2": dict(rope_style=ROPE_NEOX, qkv_bias=True),
    "gemma2": dict(rope_style=ROPE_NEOX, post_norms=True, act="gelu_tanh", swa_pattern=2, scale_q=True),
    "gemma3": dict(rope_style=ROPE_NEOX, qk_norm=True, post_norms=True, act="gelu_tanh",
                   swa_pattern=6, rope_base_swa=10000.0, scale_q=True),
    "qwen3": dict(rope_style=ROPE_NEOX, qk_norm=True),
    "phi3": dict(rope_style=ROPE_NEOX, scale_q=True, ffn_up_gated=True),
    "granite": dict(rope_style=ROPE_NORM),
    "granitemoe": dict(rope_style=ROPE_NORM),
    "exaone": dict(rope_style=ROPE_NEOX),
    "olmo2": dict(rope_style=ROPE_NEOX, post_norms=True, pre_norms=False, qk_norm_full=True),
    "exaone4": dict(rope_style=ROPE_NEOX, post_norms=True, pre_norms=False, qk_norm=True),
    "smollm3": dict(rope_style=ROPE_NORM, nope_every=4),
    "qwen3moe": dict(rope_style=ROPE_NEOX, qk_norm=True),
    "qwen2vl": dict(rope_style=ROPE_NEOX, qkv_bias=True),    # (Qwen2-VL / 2.5-VL's language models, text only)
    "qwen3vl": dict(rope_style=ROPE_NEOX, qk_norm=True),     # (Qwen3-VL's language models, text only: M-RoPE)
    "qwen3vlmoe": dict(rope_style=ROPE_NEOX, qk_norm=True),
    "qwen2moe": dict(rope_style=ROPE_NEOX, qkv_bias=True, expert_weights_norm=False, shexp_gated=True),
    "mistral3": dict(rope_style=ROPE_NORM),
    "lfm2": dict(rope_style=ROPE_NEOX, qk_norm=True),
    "qwen35": dict(rope_style=ROPE_NEOX, qk_norm=True, attn_gate=True),
    "qwen35moe": dict(rope_style=ROPE_NEOX, qk_norm=True, attn_gate=True, shexp_gated=True, shexp_plain_sigmoid=True),
    "gpt-oss": dict(rope_style=ROPE_NEOX, qkv_bias=True, attn_out_bias=True, attn_sinks=True, swa_pattern=2,
                    act="swiglu_oai", expert_gating="softmax_weight", moe_bias=True),
}
# archs whose FFN is a mixture of experts (llama: when the GGUF gives expert_count, as Mixtral's do)
MOE_ARCHS = frozenset({"qwen3moe", "qwen2moe", "gpt-oss", "granitemoe", "qwen35moe", "qwen3vlmoe"})
MOE_MAY = frozenset({"llama", "granite"})  # (granite's graph routes too when its GGUF gives expert_count)
SUPPORTED_ARCHS = tuple(ARCH_TABLE)
# graphs that rotate by M-RoPE sections (llama.cpp's MROPE / IMROPE rope types: four positions a token; text
# tokens' three of them the same, so their RoPE is plain NeoX here)
MROPE_ARCHS = frozenset({"qwen35", "qwen35moe", "qwen3vl", "qwen3vlmoe", "qwen2vl"})
# Qwen3.5 / 3.6's graphs, dense and mixture of experts (_qwen35: Gated DeltaNet layers, an MTP block)
QWEN35_ARCHS = ("qwen35", "qwen35moe")
# graphs that pass a rope_freqs.weight tensor, when the file has one, to their RoPE (llama.cpp's get_rope_factors)
ROPE_FREQS_ARCHS = frozenset({"llama", "granite", "granitemoe", "mistral3", "exaone", "exaone4"})


def config_from_gguf(gf: GGUFFile) -> ModelConfig:
    try:
        return _config_from_gguf(gf)
    except (ValueError, TypeError, OverflowError) as e:  # int("abc"), int(nan), float([..]): a value of the wrong type
        key = getattr(gf, "last_key", None)
        held = repr(gf.get(key))
        held = held if len(held) <= 60 else held[:57] + "..."
        raise SharpiError(f"{gf.path}: metadata key '{key}' holds {held}, which is not a value of the type it needs "
                          f"({e})") from None


def _config_from_gguf(gf: GGUFFile) -> ModelConfig:
    arch = gf.arch
    if arch not in ARCH_TABLE:
        raise SharpiError(f"unsupported model architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHS)})")
    emb = gf.tensor("token_embd.weight")
    if len(emb.shape) != 2:
        raise SharpiError(f"{gf.path}: tensor 'token_embd.weight' has shape {[int(d) for d in emb.shape]}, not "
                          "[n_embd, n_vocab]")
    n_vocab = int(gf.arch_get("vocab_size", 0) or int(emb.shape[1]) or gf.array_len("tokenizer.ggml.tokens"))
    kw = _common(gf, n_vocab)
    kw.update(ARCH_TABLE[arch])
    kw["rope_freqs"] = arch in ROPE_FREQS_ARCHS and "rope_freqs.weight" in gf.tensors
    # q, k, v in one tensor (phi3's converter; others' with --fuse-qkv) or apart: llama.cpp's create_tensor_qkv takes both
    kw["qkv_fused"] = any(n.startswith("blk.") and n.endswith(".attn_qkv.weight") for n in gf.tensors)
    kw["qkv_bias_fused"] = kw["qkv_fused"] and any(n.startswith("blk.") and n.endswith(".attn_qkv.bias") for n in gf.tensors)
    if arch in ("phi3", "granite", "granitemoe", "mistral3"):
        kw["rope_long_short"] = "rope_factors_long.weight" in gf.tensors or "rope_factors_short.weight" in gf.tensors
    if arch in ("granite", "granitemoe"):
        _granite(gf, kw)
    if arch in ("gemma2", "gemma3"):
        _gemma(gf, kw)
    if arch == "mistral3":
        _mistral3(gf, kw)
    if arch == "lfm2":
        _lfm2(gf, kw)
    if arch in QWEN35_ARCHS:
        _qwen35(gf, kw)
    if arch in MROPE_ARCHS:
        _text_mrope(gf, kw)
    if arch == "gpt-oss":
        _gpt_oss(gf, kw)
    if arch == "olmo2":  # (AI2's OLMo 2; OLMo 3's sliding-window layers are another graph)
        if int(gf.arch_get("attention.sliding_window", 0) or 0) > 0:
            raise SharpiError(f"{gf.path}: olmo2 with sliding-window layers (OLMo 3) is not supported")
    if arch == "exaone4":  # (EXAONE 4.0 1.2B; the 32B's 64 layers slide, their global layers without RoPE)
        if kw["n_layer"] == 64 or int(gf.arch_get("attention.sliding_window", 0) or 0) > 0:
            raise SharpiError(f"{gf.path}: exaone4 with sliding-window layers (EXAONE 4.0 32B) is not supported")
        if int(gf.arch_get("nextn_predict_layers", 0) or 0) > 0:
            raise SharpiError(f"{gf.path}: exaone4 with next-token-prediction layers is not supported")
    if arch in MOE_ARCHS or (arch in MOE_MAY and int(gf.arch_get("expert_count", 0) or 0) > 0):
        _experts(gf, kw)
    c = ModelConfig(**kw)
    check_config(c, gf)
    return c


# llama.cpp's LLAMA_MAX_EXPERTS and LLAMA_MAX_LAYERS (its per-layer arrays' size: more layers are refused)
MAX_EXPERTS = 512
MAX_LAYERS = 512


def _experts(gf: GGUFFile, kw: dict) -> None:
    """The mixture of experts as llama.cpp's llama (Mixtral), qwen3moe, qwen2moe and granite graphs run it: softmax
    routing over expert_count experts, the top expert_used_count per token, their weights renormalized to sum 1
    (qwen2moe: not renormalized, and one shared expert for every token under a sigmoid gate; granite: a shared
    expert, ungated, when expert_shared_feed_forward_length is given)."""
    a = gf.arch_get
    kw["n_expert"] = n = int(gf.require(f"{gf.arch}.expert_count", 0))
    kw["n_expert_used"] = used = int(gf.require(f"{gf.arch}.expert_used_count", 0))
    if not 0 < used <= n <= MAX_EXPERTS:
        raise SharpiError(f"{gf.path}: {used} of {n} experts used per token (at most {MAX_EXPERTS} experts)")
    if gf.arch in ("qwen3moe", "qwen2moe", "qwen35moe", "qwen3vlmoe"):  # its own width key, else feed_forward_length / experts used
        kw["n_ff_exp"] = int(a("expert_feed_forward_length", 0) or 0) or kw["n_ff"] // used  # (llama.cpp's)
    elif gf.arch == "gpt-oss":  # required (its graph's gating is its own: expert_gating_func is not read)
        kw["n_ff_exp"] = int(gf.require(f"{gf.arch}.expert_feed_forward_length", 0))
    else:
        kw["n_ff_exp"] = kw["n_ff"]
    if gf.arch in ("qwen2moe", "qwen35moe"):  # (their graphs always have the one shared expert: expert_shared_count
        kw["n_ff_shexp"] = int(a("expert_shared_feed_forward_length", 0) or 0) or kw["n_ff"]  # is not read)
        if kw["n_ff_exp"] < 1 or kw["n_ff_shexp"] < 1:
            raise SharpiError(f"{gf.path}: experts of width {kw['n_ff_exp']} and a shared expert of {kw['n_ff_shexp']} "
                              "(expert_feed_forward_length, expert_shared_feed_forward_length, feed_forward_length)")
    elif gf.arch in ("granite", "granitemoe"):  # (granitemoeshared's converter: the key, or no shared expert)
        kw["n_ff_shexp"] = int(a("expert_shared_feed_forward_length", 0) or 0)
    for key in ("expert_shared_count", "expert_group_count"):
        if int(a(key, 0) or 0) > 0 and not (key == "expert_shared_count" and gf.arch in ("qwen2moe", "qwen35moe")):
            raise SharpiError(f"{gf.path}: {gf.arch}.{key} is not supported (experts without shared experts or groups only)")
    gating = int(a("expert_gating_func", 0) or 0)
    if gf.arch != "gpt-oss" and gating not in (0, 1):  # llama.cpp: 0 = none given (softmax for these graphs), 1 = softmax
        raise SharpiError(f"{gf.path}: expert gating function {gating} is not supported (softmax only)")


def _gpt_oss(gf: GGUFFile, kw: dict) -> None:
    """OpenAI's gpt-oss (src/models/openai-moe.cpp): attention with q / k / v / output biases and a sink logit
    per head, a sliding window on every other layer (the first slides), the same RoPE (YaRN) on every layer
    unless the GGUF gives the sliding layers a base of their own; experts routed by softmax_weight gating with
    biases, SwiGLU-OAI (clamped at 7, sigmoid(1.702 x), up + 1); an output layer of its own (OWN_OUTPUT_ARCHS)."""
    kw["sliding_window"] = int(gf.require(f"{gf.arch}.attention.sliding_window", 0))
    kw["rope_base_swa"] = float(gf.arch_get("rope.freq_base_swa", kw["rope_base"]))
    kw["rope_freq_scale_swa"] = kw["rope_freq_scale"]
    _swa_layers(gf, kw)


def _swa_layers(gf: GGUFFile, kw: dict) -> None:
    """Which layers slide, as llama.cpp's load_swa_pattern reads attention.sliding_window_pattern: one flag
    per layer, or n (every n-th layer is global; 0: every layer slides), else the arch's default n."""
    pattern = gf.arch_get("attention.sliding_window_pattern", kw["swa_pattern"])
    if isinstance(pattern, (list, tuple)):  # one flag per layer
        if len(pattern) != kw["n_layer"]:
            raise SharpiError(f"{gf.path}: a sliding window pattern of {len(pattern)} layers for {kw['n_layer']}")
        kw["swa_layers"] = tuple(bool(v) for v in pattern)
    else:  # every n-th layer is global (llama.cpp's set_swa_pattern; 0: every layer slides)
        n = int(pattern)
        kw["swa_layers"] = tuple(n == 0 or i % n < n - 1 for i in range(kw["n_layer"]))


def _mistral3(gf: GGUFFile, kw: dict) -> None:
    """Ministral 3 (src/models/mistral3.cpp): llama's block with YaRN's betas and log multiplier read from
    the GGUF, and Llama 4's attention temperature tuning past the original context."""
    a = gf.arch_get
    kw["yarn_beta_fast"] = float(a("rope.scaling.yarn_beta_fast", 32.0))
    kw["yarn_beta_slow"] = float(a("rope.scaling.yarn_beta_slow", 1.0))
    kw["yarn_log_mul"] = float(a("rope.scaling.yarn_log_multiplier", 0.0))
    kw["attn_temp_scale"] = float(a("attention.temperature_scale", 0.0))
    if kw["attn_temp_scale"] and kw["n_ctx_orig"] <= 0:
        raise SharpiError(f"{gf.path}: attention temperature scaling without an original context length")
    if int(a("expert_count", 0) or 0) > 0:
        raise SharpiError(f"{gf.path}: a mistral3 mixture of experts is not supported (its dense models are)")


def _lfm2(gf: GGUFFile, kw: dict) -> None:
    """Liquid's LFM2 (src/models/lfm2.cpp): layers whose attention.head_count_kv is 0 are short-convolution
    blocks (in_proj -> B, C, x; C * conv(B * x) over the last shortconv.l_cache positions -> out_proj), the
    others attention with q / k norms; sliding attention when the GGUF gives a window."""
    a = gf.arch_get
    v = a("attention.head_count_kv", kw["n_head"])
    kw["recurrent"] = tuple(int(n) == 0 for n in v) if isinstance(v, (list, tuple)) else (int(v) == 0,) * kw["n_layer"]
    if len(kw["recurrent"]) != kw["n_layer"]:
        raise SharpiError(f"{gf.path}: attention.head_count_kv has {len(kw['recurrent'])} layers, not {kw['n_layer']}")
    kw["conv_width"] = int(gf.require(f"{gf.arch}.shortconv.l_cache", 0))
    if not 1 < kw["conv_width"] <= 64:
        raise SharpiError(f"{gf.path}: a short convolution over {kw['conv_width']} positions")
    if int(a("expert_count", 0) or 0) > 0:
        raise SharpiError(f"{gf.path}: an lfm2 mixture of experts is not supported (its dense models are)")
    if all(kw["recurrent"]):  # (no attention layer: its KV head count is not there to check)
        kw["n_head_kv"] = kw["n_head"]
    kw["sliding_window"] = int(a("attention.sliding_window", 0) or 0)
    kw["swa_layers"] = tuple(not r for r in kw["recurrent"])


def _qwen35(gf: GGUFFile, kw: dict) -> None:
    """Qwen3.5 / 3.6 dense (src/models/qwen35.cpp) and their mixtures of experts (qwen35moe.cpp: the same layers, each
    FFN routed experts and a gated shared expert as qwen2moe's, the routed weights renormalized): Gated DeltaNet layers
    (attention.recurrent_layers, else all but every full_attention_interval-th), the others gated attention with
    q / k norms and M-RoPE (_text_mrope). Next-token-prediction layers are not run (as llama.cpp's main graph)."""
    a, path = gf.arch_get, gf.path
    kw["n_layer_nextn"] = nextn = int(a("nextn_predict_layers", 0) or 0)
    if not 0 <= nextn < kw["n_layer"]:
        raise SharpiError(f"{path}: {nextn} next-token-prediction layers of {kw['n_layer']}")
    n = kw["n_layer"] = kw["n_layer"] - nextn
    rec = a("attention.recurrent_layers", None)
    if isinstance(rec, (list, tuple)):
        if len(rec) < n:
            raise SharpiError(f"{path}: attention.recurrent_layers has {len(rec)} layers, not {n}")
        kw["recurrent"] = tuple(bool(v) for v in rec[:n])
    else:
        every = int(a("full_attention_interval", 4) or 0)
        if every < 1:
            raise SharpiError(f"{path}: full_attention_interval is {every}")
        kw["recurrent"] = tuple((i + 1) % every != 0 for i in range(n))
    kw["conv_width"] = int(gf.require(f"{gf.arch}.ssm.conv_kernel", 0))
    S, Hk, Hv = (int(gf.require(f"{gf.arch}.ssm.{k}", 0)) for k in ("state_size", "group_count", "time_step_rank"))
    inner = int(gf.require(f"{gf.arch}.ssm.inner_size", 0))
    if not (S > 0 and S % 64 == 0 and 0 < Hk and Hv % Hk == 0 and inner == Hv * S and 1 < kw["conv_width"] <= 64):
        raise SharpiError(f"{path}: a Gated DeltaNet of {Hk} key and {Hv} value heads of {S} (inner size {inner}, "
                          f"convolution over {kw['conv_width']}) is not supported (heads of a multiple of 64)")
    kw.update(ssm_d_state=S, ssm_n_group=Hk, ssm_dt_rank=Hv, qkv_fused=False, qkv_bias_fused=False)
    if all(kw["recurrent"]):
        kw["n_head_kv"] = kw["n_head"]
    if gf.arch == "qwen35" and int(a("expert_count", 0) or 0) > 0:  # (the same layers with experts: qwen35moe)
        raise SharpiError(f"{path}: a qwen35 model with experts (expert_count): llama.cpp's qwen35 graph has none "
                          "(its mixtures of experts are qwen35moe)")
    if gf.arch == "qwen35moe":  # (per layer, as llama.cpp's create_tensor_gate_up_exps looks; the MTP block's too)
        kw["gate_up_exps"] = frozenset(int(n.split(".")[1]) for n in gf.tensors
                                       if n.startswith("blk.") and n.endswith(".ffn_gate_up_exps.weight")
                                       and n.split(".")[1].isdigit())


def _text_mrope(gf: GGUFFile, kw: dict) -> None:
    """The M-RoPE of qwen35, qwen35moe, qwen3vl and qwen3vlmoe (interleaved sections: llama.cpp's IMROPE) and qwen2vl
    (consecutive ones: MROPE) over rope.dimension_count dims and its sections (required, as llama.cpp's loaders require
    them), for text tokens: llama.cpp gives the t, h and w sections the token's position, so their pairs turn as NeoX
    RoPE's, and the fourth section position 0, so its pairs (rope_fixed_pairs; Qwen3-VL's last but one and last but two
    of 64) do not turn.
    (qwen3vl's deepstack layers add the input's slices past n_embd: zeros for text tokens, so nothing here.)"""
    v = gf.arch_get("rope.dimension_sections", None)
    if not isinstance(v, (list, tuple)):
        raise SharpiError(f"{gf.path}: missing GGUF metadata key '{gf.arch}.rope.dimension_sections' (M-RoPE)")
    sections = [int(x) for x in v][:4]
    sections += [0] * (4 - len(sections))
    total = sum(sections)
    if min(sections) < 0 or total < 1 or total > kw["head_dim_k"]:  # (ggml: a sector is a pair index mod total)
        raise SharpiError(f"{gf.path}: M-RoPE sections {sections} (each >= 0, 1 to {kw['head_dim_k']} in all)")
    sec = [i % total for i in range(kw["n_rot"] // 2)]  # (ggml_mrope_cache_init: the sector of each rotated pair)
    if gf.arch == "qwen2vl":  # t, h, w, then the fourth section, one after another
        kw["rope_fixed_pairs"] = tuple(i for i, s in enumerate(sec) if s >= sum(sections[:3]))
    else:  # t, h, w in turn while each section lasts, the rest the fourth's
        kw["rope_fixed_pairs"] = tuple(i for i, s in enumerate(sec) if not any(s % 3 == j and s < 3 * sections[j]
                                                                               for j in range(3)))


def _granite(gf: GGUFFile, kw: dict) -> None:
    """Granite's scales as llama.cpp's loader reads them (src/models/granite.cpp): the logit scale is
    required, the others optional (0: not applied; its attention scale replaces 1/sqrt(head_dim))."""
    a = gf.arch_get
    kw["logit_scale"] = float(gf.require(f"{gf.arch}.logit_scale", 0.0))
    kw["residual_scale"] = float(a("residual_scale", 0.0) or 0.0)
    kw["embed_scale"] = float(a("embedding_scale", 0.0) or 0.0) or 1.0
    kw["attn_scale"] = float(a("attention.scale", 0.0) or 0.0)
    if gf.arch == "granite" and not a("rope.scaling.finetuned", True):  # llama.cpp then runs no layer with RoPE
        raise SharpiError(f"{gf.path}: a granite model without RoPE (rope.scaling.finetuned false) is not supported")


def attn_scale_f32(n: int) -> float:
    """1.0f / sqrtf(float(n)) as llama.cpp's graphs compute it: in float (for n = 96, say, one ulp off the
    double 1 / sqrt(n) rounded to float)."""
    return float(np.float32(1) / np.sqrt(np.float32(n))) if n > 0 else 0.0


def _gemma(gf: GGUFFile, kw: dict) -> None:
    """Gemma 2 / 3 hyperparameters as llama.cpp's loaders read them (src/models/gemma2.cpp, gemma3.cpp)."""
    a = gf.arch_get
    kw["embed_scale"] = kw["n_embd"] ** 0.5
    if gf.arch == "gemma2":  # always sliding (4096 by default); sliding layers keep the trained base and scale
        kw["sliding_window"] = int(a("attention.sliding_window", 4096) or 0)
        kw["rope_base_swa"] = float(a("rope.freq_base_swa", kw["rope_base"]))
        kw["rope_freq_scale_swa"] = kw["rope_freq_scale"]
        kw["attn_softcap"] = float(a("attn_logit_softcapping", 50.0))
        kw["final_softcap"] = float(a("final_logit_softcapping", 30.0))
        big = kw["n_layer"] == 46  # Gemma 2 27B
    else:  # sliding only when the GGUF gives a window
        kw["sliding_window"] = int(a("attention.sliding_window", 0) or 0)
        kw["rope_base_swa"] = float(a("rope.freq_base_swa", kw["rope_base_swa"]))
        kw["final_softcap"] = float(a("final_logit_softcapping", 0.0) or 0.0)
        big = kw["n_layer"] == 62  # Gemma 3 27B
    # the 27B models scale q by 1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim) (gemma_pytorch's config)
    kw["attn_scale"] = attn_scale_f32(kw["n_embd"] // kw["n_head"] if big and kw["n_head"] else kw["head_dim_k"])
    _swa_layers(gf, kw)


def expected_shapes(c: ModelConfig):
    """Every tensor the graph reads, with its GGUF shape (ne0 = the input dimension first), layer by layer
    (a generator: a damaged block count of billions fails at its first missing layer, not in memory)."""
    yield "token_embd.weight", (c.n_embd, c.n_vocab)
    yield c.output_norm_name, (c.n_embd,)
    if not c.tied_output:
        yield "output.weight", (c.n_embd, c.n_vocab)
    if c.rope_freqs:
        yield "rope_freqs.weight", (c.n_rot // 2,)
    if c.rope_long_short:
        yield from (("rope_factors_long.weight", (c.n_rot // 2,)), ("rope_factors_short.weight", (c.n_rot // 2,)))
    for i in range(c.n_layer):
        yield from layer_shapes(c, i)


def layer_shapes(c: ModelConfig, i: int):
    """Layer i's tensors with their GGUF shapes (expected_shapes'; i = n_layer: a next-token-prediction block's)."""
    b = f"blk.{i}."
    q, k, v = c.n_head * c.head_dim_k, c.n_head_kv * c.head_dim_k, c.n_head_kv * c.head_dim_v
    ffn = lambda b: (_expert_shapes(c, i, b) if c.n_expert else  # noqa: E731
                     ((b + "ffn_gate.weight", (c.n_embd, c.n_ff)), (b + "ffn_up.weight", (c.n_embd, c.n_ff)),
                      (b + "ffn_down.weight", (c.n_ff, c.n_embd))))
    if c.pre_norms:
        yield b + "attn_norm.weight", (c.n_embd,)
    if c.is_recurrent(i) and c.ssm_d_state:  # (qwen35's Gated DeltaNet)
        Hv, inner = c.ssm_dt_rank, c.ssm_dt_rank * c.ssm_d_state
        yield from ((b + "attn_qkv.weight", (c.n_embd, c.ssm_conv_dim)), (b + "attn_gate.weight", (c.n_embd, inner)),
                    (b + "ssm_conv1d.weight", (c.conv_width, c.ssm_conv_dim)), (b + "ssm_dt.bias", (Hv,)),
                    (b + "ssm_a", (Hv,)), (b + "ssm_beta.weight", (c.n_embd, Hv)),
                    (b + "ssm_alpha.weight", (c.n_embd, Hv)), (b + "ssm_norm.weight", (c.ssm_d_state,)),
                    (b + "ssm_out.weight", (inner, c.n_embd)), (b + c.ffn_norm_name, (c.n_embd,)), *ffn(b))
        return
    if c.is_recurrent(i):
        yield from ((b + "shortconv.in_proj.weight", (c.n_embd, 3 * c.n_embd)),
                    (b + "shortconv.out_proj.weight", (c.n_embd, c.n_embd)),
                    (b + "shortconv.conv.weight", (c.conv_width, c.n_embd)), (b + "ffn_norm.weight", (c.n_embd,)),
                    *ffn(b))
        return
    if c.qkv_fused:
        yield b + "attn_qkv.weight", (c.n_embd, q + k + v)
    else:
        yield from ((b + "attn_q.weight", (c.n_embd, 2 * q if c.attn_gate else q)), (b + "attn_k.weight", (c.n_embd, k)),
                    (b + "attn_v.weight", (c.n_embd, v)))
    yield b + "attn_output.weight", (c.n_head * c.head_dim_v, c.n_embd)
    if c.pre_norms:
        yield b + c.ffn_norm_name, (c.n_embd,)
    if c.attn_out_bias:
        yield b + "attn_output.bias", (c.n_embd,)
    if c.attn_sinks:
        yield b + "attn_sinks.weight", (c.n_head,)
    if c.n_expert:
        yield from _expert_shapes(c, i, b)
    elif c.ffn_up_gated:
        yield b + "ffn_up.weight", (c.n_embd, 2 * c.n_ff)
    else:
        yield from ((b + "ffn_gate.weight", (c.n_embd, c.n_ff)), (b + "ffn_up.weight", (c.n_embd, c.n_ff)))
    if not c.n_expert:
        yield b + "ffn_down.weight", (c.n_ff, c.n_embd)
    if c.qkv_bias_fused:  # (whatever the arch: llama.cpp's build_qkv adds it where it is)
        yield b + "attn_qkv.bias", (q + k + v,)
    elif c.qkv_bias:
        yield from ((b + "attn_q.bias", (q,)), (b + "attn_k.bias", (k,)), (b + "attn_v.bias", (v,)))
    if c.qk_norm:
        yield from ((b + "attn_q_norm.weight", (c.head_dim_k,)), (b + "attn_k_norm.weight", (c.head_dim_k,)))
    if c.qk_norm_full:
        yield from ((b + "attn_q_norm.weight", (q,)), (b + "attn_k_norm.weight", (k,)))
    if c.post_norms:
        yield from ((b + "post_attention_norm.weight", (c.n_embd,)), (b + "post_ffw_norm.weight", (c.n_embd,)))


def _expert_shapes(c: ModelConfig, i: int, b: str):
    """Layer i's mixture of experts (layer_shapes'): the router, the experts' gate and up (apart, or one
    ffn_gate_up_exps: c.gate_up_exps) and down, their biases (gpt-oss), a shared expert and its gate."""
    E, f = c.n_expert, c.n_ff_exp
    yield b + "ffn_gate_inp.weight", (c.n_embd, E)
    if i in c.gate_up_exps:
        yield b + "ffn_gate_up_exps.weight", (c.n_embd, 2 * f, E)
    else:
        yield from ((b + "ffn_gate_exps.weight", (c.n_embd, f, E)), (b + "ffn_up_exps.weight", (c.n_embd, f, E)))
    yield b + "ffn_down_exps.weight", (f, c.n_embd, E)
    if c.moe_bias:
        yield from ((b + "ffn_gate_inp.bias", (E,)), (b + "ffn_gate_exps.bias", (f, E)),
                    (b + "ffn_up_exps.bias", (f, E)), (b + "ffn_down_exps.bias", (c.n_embd, E)))
    if c.n_ff_shexp:
        s = c.n_ff_shexp
        yield from ((b + "ffn_gate_shexp.weight", (c.n_embd, s)), (b + "ffn_up_shexp.weight", (c.n_embd, s)),
                    (b + "ffn_down_shexp.weight", (s, c.n_embd)))
        if c.shexp_gated:
            yield b + "ffn_gate_inp_shexp.weight", (c.n_embd,)


def _nextn_tensor(c: ModelConfig, name: str) -> bool:
    """Whether name is a tensor of the next-token-prediction layers after the graph's (not read)."""
    parts = name.split(".")
    return bool(c.n_layer_nextn) and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= c.n_layer


def check_config(c: ModelConfig, gf: GGUFFile) -> None:
    """Hyperparameters that the kernels can run and tensors of the shapes they imply, checked before any
    weight is read (llama.cpp refuses such a file with "wrong shape" too): a damaged or hand-edited
    GGUF is one error, not a division by zero or a crash inside a kernel."""
    for name in ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim_k", "head_dim_v", "n_ff"):
        if getattr(c, name) < 1 and not (name == "n_ff" and c.n_expert and c.n_ff_exp > 0 and c.arch == "qwen35moe"):
            raise SharpiError(f"{gf.path}: {name} is {getattr(c, name)} in its metadata" + (
                f" ({c.n_embd} embedding dimensions over {c.n_head} heads, unless key_length / value_length say)"
                if name.startswith("head_dim") else ""))
    if c.n_head % c.n_head_kv:
        raise SharpiError(f"{gf.path}: {c.n_head} attention heads do not share {c.n_head_kv} KV heads evenly")
    read = set()
    for name, shape in expected_shapes(c):
        t = gf.tensors.get(name)
        if t is None:
            raise SharpiError(f"{gf.path}: tensor '{name}' is missing")
        if tuple(int(n) for n in t.shape) != shape:
            raise SharpiError(f"{gf.path}: tensor '{name}' has shape {tuple(int(n) for n in t.shape)}, "
                              f"its metadata implies {shape}")
        read.add(name)
    # a tensor the graph would not read (rope_freqs, a fused attn_qkv, biases this arch has none of) is a
    # variant of the architecture sharpi does not compute: refused rather than run without it
    unknown = sorted(n for n in set(gf.tensors) - read if not _nextn_tensor(c, n))
    if unknown:
        raise SharpiError(f"{gf.path}: tensor '{unknown[0]}' is not part of the {c.arch} graph sharpi runs"
                          + (f" ({len(unknown) - 1} more)" if len(unknown) > 1 else "") + ": unsupported model variant")
    n_tokens = gf.array_len("tokenizer.ggml.tokens")  # 0: no vocabulary here (the tokenizer says so)
    if n_tokens and n_tokens != c.n_vocab:
        raise SharpiError(f"{gf.path}: the vocabulary has {n_tokens} tokens, the embedding {c.n_vocab} rows")
    if not 0 < c.n_rot <= c.head_dim_k or c.n_rot % 2 or c.arch in ("llama", "ernie4_5") and c.n_rot != c.head_dim_k:
        # (llama.cpp's loader: a llama graph turns whole heads, "invalid n_rot" otherwise; ernie4_5's asserts it)
        raise SharpiError(f"{gf.path}: RoPE over {c.n_rot} of a head's {c.head_dim_k} dimensions"
                          + (f" (a {c.arch} model turns all of them)" if c.arch in ("llama", "ernie4_5") else ""))
    for name, low in (("norm_eps", 0.0), ("rope_base", 1e-30), ("rope_base_swa", 0.0),  # swa 0 = rope_base
                      ("rope_freq_scale", 1e-30), ("rope_freq_scale_swa", 1e-30), ("attn_softcap", 0.0),
                      ("final_softcap", 0.0), ("rope_attn_factor", 1e-30), ("residual_scale", 0.0),
                      ("logit_scale", 0.0), ("embed_scale", 1e-30), ("yarn_beta_fast", 0.0), ("yarn_beta_slow", 0.0),
                      ("yarn_log_mul", 0.0), ("attn_temp_scale", 0.0)):
        if not math.isfinite(getattr(c, name)) or getattr(c, name) < low:
            raise SharpiError(f"{gf.path}: {name} is {getattr(c, name)} in its metadata")
    for name in ("n_ctx_train", "n_ctx_orig", "sliding_window", "swa_pattern"):  # (u32 in llama.cpp's hparams)
        if not 0 <= getattr(c, name) <= 0xFFFFFFFF:
            raise SharpiError(f"{gf.path}: {name} is {getattr(c, name)} in its metadata (a count of 32 bits)")
