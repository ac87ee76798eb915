#!/usr/bin/env python3
"""Models of other architectures made from a real GGUF's weights, for checking sharpi against llama.cpp.

    python scripts/gguf_derive.py VARIANT SRC.gguf DST.gguf

No model of these architectures can be downloaded here, so each variant takes a llama-architecture
GGUF (SmolLM2; gemma2: the Gemma 3 270M GGUF) and writes what the other architecture's GGUF holds, keeping every weight as it is
(the quantized blocks are copied byte for byte, except in lowbit) and adding the tensors the architecture needs with
fixed, smooth values (no random generator: the same file on every machine):

  qwen3   general.architecture qwen3 (keys renamed), per-head RMSNorm weights attn_q_norm /
          attn_k_norm of head_dim, NeoX RoPE (what llama.cpp's qwen3 graph does with them); the q and
          k rows are reordered so that NeoX RoPE pairs the dimensions llama's RoPE paired
  llama3  still llama, plus rope_freqs.weight: the per-dimension RoPE frequency divisors Llama 3.1
          and 3.2 GGUFs carry (computed as convert_hf_to_gguf.py does for rope_type llama3:
          factor 8, low / high frequency factors 1 / 4, original context 8192)
  smollm3 general.architecture smollm3 (keys renamed), nothing added: its graph is llama's without
          RoPE in every 4th layer (NoPE)
  lowbit  still llama, the ffn_down weights requantized to Q3_K, Q2_K, IQ4_XS and Q5_K (layer % 4 = 0..3),
          as in llama.cpp's Q3_K_S / Q2_K / IQ4_XS / Q5_K_M files (only ffn_down: SmolLM2's other matrices have
          rows of 576, not a multiple of the super-blocks' 256), and the attention weights to Q4_0 (even
          layers; gguf.quants' quantizer) and IQ4_NL (odd). The other quantizers are plain ones
          (the largest value of a sub-block on the end of the code range, nearest codes; not ggml's
          search), so the values differ from a llama-quantize run, not the format
  phi3    general.architecture phi3 (keys renamed): q, k and v in one attn_qkv tensor (rows reordered for
          NeoX RoPE as in qwen3), ffn_gate and ffn_up in one ffn_up (gate rows first), blocks copied byte for
          byte; longrope: rope_factors_long.weight (Llama 3.1's factors) and rope_factors_short.weight
          (1 to 1.1), with PHI3_KV's original context and attention factor; RoPE on the first 48 of each
          head's 64 dims (the others keep their trained values unrotated), as Phi-4-mini's partial rotation
  granite general.architecture granite (keys renamed), weights as they are, GRANITE_KV's scales
  gemma2  from gemma3 (Gemma 3 270M): general.architecture gemma2 (keys renamed), no q / k norms (Gemma 2 has
          none: their weights and a typical per-head RMS are folded into attn_q / attn_k, requantized to
          Q8_0), attention and final logit softcapping (GEMMA2_KV: caps low enough that tanh bends the
          scores and logits), a sliding window of 128 tokens on every other layer (Gemma 2's default
          pattern) so that the long prompts cross it, and rope.freq_base_swa for those layers. Without
          per-token q / k norms these weights only repeat a few words: the oracle's logit values
          (top_logits) carry most of its checking here

  qwen3moe qwen3's changes (general.architecture qwen3moe) and its FFN cut into MOE_EXPERTS experts of
          MOE_FF rows each, MOE_USED of them used per token: expert e is rows [e * MOE_FF, (e + 1) * MOE_FF)
          of ffn_gate / ffn_up and those columns of ffn_down (Q4_1 blocks copied byte for byte: 192 is
          six blocks of 32; ffn_down's scales times MOE_DOWN_SCALE, exactly), stacked into ffn_gate_exps /
          ffn_up_exps / ffn_down_exps; the router
          ffn_gate_inp (f32, as converters keep it) of smooth fixed values (_router_weight)
  mistral3 general.architecture mistral3 (keys renamed), weights as they are: llama's block with YaRN RoPE
          scaling (MISTRAL3_KV: factor 4 over an original context of 128, its betas and log multiplier) and
          attention temperature tuning (q scaled by 1 + 0.1 ln(floor(pos / 128) + 1))
  float   still llama, its matrices in float types as F16 / BF16 / F32 GGUFs (and quantizations that keep a
          tensor in one) carry them: the attention weights F32, ffn_gate / ffn_up F16, ffn_down BF16 (the
          Q4_1 values dequantized, exactly representable in f32, rounded to f16 / bf16); the embedding (and
          tied output) stays as it is
  lfm2    general.architecture lfm2 (keys renamed): a hybrid of attention and short-convolution layers (Liquid's
          LFM2). Layers 2, 5, 8, ... (i % LFM2_CONV_EVERY == 2) are convolution blocks: shortconv.in_proj's
          B, C and x rows are that layer's first 576 ffn_gate rows, first 576 ffn_up rows and attn_q (Q4_1
          blocks copied byte for byte), shortconv.out_proj its attn_output, shortconv.conv fixed smooth f32
          taps over 3 positions (_conv_taps, small: larger ones leave no text); attention.head_count_kv an array, 0 for those layers. The
          others are qwen3's attention (q / k norms, NeoX RoPE); the output norm is named token_embd_norm
          (as LFM2 GGUFs name it)
  mixtral still llama, with the same experts (llama.expert_count: llama.cpp's llama graph then routes,
          as for Mixtral) and feed_forward_length the experts' MOE_FF
  gpt-oss general.architecture gpt-oss (keys renamed; OpenAI's gpt-oss): NeoX RoPE (q / k rows reordered as in
          qwen3) with YaRN (GPT_OSS_KV), small fixed biases on q, k, v and attn_output, a sink logit per head
          (attn_sinks), a 128-token window on the even layers; ffn_norm renamed post_attention_norm (gpt-oss
          GGUFs' name); qwen3moe's experts, their weights requantized to MXFP4 (as gpt-oss files hold them;
          gguf.quants' quantizer), with biases: the up bias near -1, so that SwiGLU-OAI's (up + 1) gives back
          about the trained up, and a router bias; output.weight a copy of the tied embedding (the graph needs one)
  qwen2moe general.architecture qwen2moe (keys renamed; Qwen1.5-MoE, Qwen2-57B-A14B): NeoX RoPE (q / k rows
          reordered as in qwen3), small fixed q / k / v biases (as Qwen2's attention has), qwen3moe's experts
          (their weights not renormalized in this graph; ffn_down times QWEN2MOE_DOWN_SCALE) and a shared
          expert, the dense FFN as it is, under a sigmoid gate whose logit is a fixed smooth f32 row
          (ffn_gate_inp_shexp, one-dimensional as converters write it); see QWEN2MOE_KV; output.weight a copy
          of the tied embedding (the graph needs one)
  granitemoe general.architecture granitemoe (keys renamed; Granite 3.x MoE, granitemoeshared as newer converters
          write it): granite's graph and scales (GRANITE_KV) with qwen3moe's experts (their width in
          feed_forward_length, as granite reads it; renormalized weights) and an ungated shared expert; see
          GRANITEMOE_KV
  exaone  general.architecture exaone (keys renamed; LG's EXAONE 3.0 / 3.5): llama's block with NeoX RoPE (q / k rows
          reordered as in qwen3) and llama3's rope_freqs (EXAONE 3.5's llama3 RoPE scaling)
  olmo2   general.architecture olmo2 (keys renamed; AI2's OLMo 2): no pre-norms, the attention and FFN outputs
          RMS-normed before their residual adds (post_attention_norm / post_ffw_norm: the pre-norms' weights times
          OLMO2_POST_NORM), q and k RMS-normed over all their heads (attn_q_norm [n_embd] / attn_k_norm, fixed
          smooth weights), NeoX RoPE (q / k rows reordered as in qwen3), output.weight copied
  exaone4 general.architecture exaone4 (keys renamed; EXAONE 4.0 1.2B): olmo2's post-norms-only layers with per-head
          q / k norms (as qwen3's), llama3's rope_freqs, the tied output kept
  qwen35  general.architecture qwen35 (keys renamed; Qwen3.5 / 3.6 dense): every QWEN35_ATTN_EVERY-th layer gated
          attention (attn_q holds each head's q rows, then as many gate rows: another head's q rows; per-head q / k
          norms; NeoX RoPE on QWEN35_KV's 32 of 64 dims in interleaved M-RoPE sections), the others Gated DeltaNet
          layers (_qwen35_linear_tensors: attn_qkv = attn_k, attn_v, attn_q rows as q, k, v; attn_gate the first
          ffn_gate rows; ssm_out = attn_output, Q4_1 blocks copied; fixed smooth f32 convolution taps, beta / alpha
          projections, dt bias, A and norm); 3 key heads shared by 9 value heads; ffn_norm renamed
          post_attention_norm (Qwen3.5 GGUFs' name); one more block, the MTP layer (_qwen35_mtp_tensors,
          nextn_predict_layers 1): the source's last layer as a gated attention layer, a fixed Q8_0 eh_proj mixing
          the normed embedding (0.4) and hidden row (0.8), enorm, hnorm, shared_head_norm
  qwen35moe general.architecture qwen35moe (keys renamed; Qwen3.5 / 3.6 mixtures of experts): qwen35's layers and MTP
          block, each FFN qwen3moe's experts (renormalized weights; ffn_down times QWEN35MOE_DOWN_SCALE) beside
          qwen2moe's gated shared expert; the even layers' expert gate and up rows fused (ffn_gate_up_exps); no
          feed_forward_length (see QWEN35MOE_KV)
  qwen3vl general.architecture qwen3vl (Qwen3-VL's language model, text only): the qwen3 variant's tensors with
          interleaved M-RoPE sections (QWEN3VL_SECTIONS: the last rotated pair falls in the fourth section, unturned
          for text, as two of Qwen3-VL's 64 do) and deepstack layers
          (n_deepstack_layers: their inputs are zeros for text tokens)
  qwen3vlmoe general.architecture qwen3vlmoe (Qwen3-VL-30B-A3B's): the qwen3moe variant's tensors, qwen3vl's keys
  qwen2vl general.architecture qwen2vl (Qwen2-VL / 2.5-VL's language model, text only): Qwen2's attention as the
          qwen2moe variant has it (NeoX RoPE, small fixed q / k / v biases), SmolLM2's dense FFN, M-RoPE sections
          QWEN2VL_SECTIONS one after another (the last pair in the fourth section)
  ernie4_5 general.architecture ernie4_5 (keys renamed; Baidu's ERNIE 4.5 dense, 0.3B): llama's graph as it is
  mixed   still llama, types mixed within the pairs sharpi multiplies as one (q and k, gate and up): attn_k requantized
          to Q8_0 beside the Q4_1 attn_q (llama.cpp's Q4_K_M does so for an 8-expert model), ffn_up to Q5_0 on the even
          layers and ffn_gate to Q8_0 on the odd ones (gguf.quants' quantizers, from the Q4_1 values)
  fused-qkv still llama, as `convert_hf_to_gguf.py --fuse-qkv` writes a model: each layer's attn_q, attn_k and
          attn_v in one attn_qkv (blocks copied byte for byte, back to back) with small fixed biases in one
          attn_qkv.bias (the converter fuses the biases of models that have them, such as Qwen2's)

The results are not good language models (the weights were trained for the llama graph), but their
activations are a trained model's, not noise: greedy continuations compared with llama.cpp's on the
same file check the graph, token for token (scripts/llamacpp_archs.py, tests/test_archs.py).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sharpi_core.gguf_file import GGUFFile  # noqa: E402

VT = gguf.GGUFValueType
VARIANTS = ("qwen3", "llama3", "smollm3", "lowbit", "gemma2", "phi3", "granite", "qwen3moe", "mixtral", "mistral3",
            "float", "lfm2", "gpt-oss", "fused-qkv", "qwen2moe", "granitemoe", "exaone", "olmo2", "exaone4", "qwen35", "mixed",
            "qwen35moe", "qwen3vl", "qwen3vlmoe", "qwen2vl", "ernie4_5")
SOURCE_ARCH = {"gemma2": "gemma3"}  # the architecture each variant is made from (others: llama)
# the registry model each is made from (scripts/llamacpp_archs.py, tests/test_archs.py)
SOURCE_MODEL = {"gemma2": "gemma3-270m-q4_k_m"}
DEFAULT_SOURCE = "smollm2-135m-instruct-q4_1"
# phi3's longrope: the long factors past this context (the tests' 512-token contexts), the short ones up to it
# (their 256-token shift runs); cos and sin times the attention factor
# (RoPE on 48 of the 64 head dims, as Phi-4-mini turns 96 of 128: partial NeoX rotation)
PHI3_KV = {"rope.scaling.original_context_length": 384, "rope.scaling.attn_factor": 1.1, "rope.dimension_count": 48}
# granite's scales: embeddings and residual branches scaled unequally (equal scales would leave the trained
# model's function), attention scale above 1/sqrt(64), logits divided
GRANITE_KV = {"embedding_scale": 1.5, "residual_scale": 1.25, "attention.scale": 0.14, "logit_scale": 4.0}
# the experts of qwen3moe / mixtral: SmolLM2's 1536 FFN rows in 8 experts of 192, 4 used per token, their
# ffn_down times 8 (the weights of the used experts sum to 1; the trained FFN sums all 8 parts). Half of the
# FFN missing, the model writes word salad, but words of every kind: the routing varies from token to token
MOE_EXPERTS, MOE_USED, MOE_FF, MOE_DOWN_SCALE = 8, 4, 192, 8.0
MOE_KV = {"expert_count": MOE_EXPERTS, "expert_used_count": MOE_USED}
# qwen2moe: the shared expert is SmolLM2's whole FFN, its sigmoid gate's logits spread about +-0.5 (so the gate
# moves between ~0.3 and ~0.7), and the experts' ffn_down times QWEN2MOE_DOWN_SCALE only (they add to the shared
# expert): a model that still writes sentences. feed_forward_length is given a width no tensor has, so that
# llama.cpp's n_ff_shexp comes from expert_shared_feed_forward_length, not from its default n_ff
QWEN2MOE_DOWN_SCALE, QWEN2MOE_GATE_AMP, QWEN2MOE_SHEXP_FF = 2.0, 0.2, 1536
QWEN2MOE_KV = {**MOE_KV, "expert_shared_feed_forward_length": QWEN2MOE_SHEXP_FF, "feed_forward_length": 768}
# olmo2 / exaone4: their post-norms' weights are SmolLM2's pre-norm weights times these (without pre-norms these
# models only repeat words; at these scales they do not end at once: exaone4 at 0.5 writes its end token first)
OLMO2_POST_NORM, EXAONE4_POST_NORM = 0.5, 0.25
# granitemoe (granitemoeshared's converter writes the same arch with expert_shared_feed_forward_length): granite's
# scales, the experts' width as feed_forward_length, their ffn_down times 2 and the (ungated) shared expert's, the
# whole dense FFN, times 1/2: it still writes sentences (x4 / x8 for the experts: word salad)
GRANITEMOE_DOWN_SCALE, GRANITEMOE_SHEXP_DOWN_SCALE = 2.0, 0.5
GRANITEMOE_KV = {**GRANITE_KV, **MOE_KV, "expert_shared_feed_forward_length": 1536}
# mistral3 (Ministral 3): YaRN (its log multiplier as Ministral's mscale_all_dim, betas other than the defaults, an
# original context short enough that the tests' prompts cross it twice) and Llama 4's attention temperature
# tuning, which scales q past that context
MISTRAL3_KV = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 128,
               "rope.scaling.yarn_beta_fast": 24.0, "rope.scaling.yarn_beta_slow": 2.0,
               "rope.scaling.yarn_log_multiplier": 1.0, "attention.temperature_scale": 0.1}
GEMMA2_KV = {"attn_logit_softcapping": 20.0, "final_logit_softcapping": 15.0, "attention.sliding_window": 128,
             "rope.freq_base_swa": 10000.0}
# gpt-oss: YaRN over a short original context (the tests' prompts reach past it), a window on every other layer
GPT_OSS_KV = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 256,
              "attention.sliding_window": 128}
# qwen35: attention on layers 3, 7, ... (the others Gated DeltaNet), RoPE on 32 of 64 dims in M-RoPE sections (text:
# every section at the token's position), the DeltaNet's 3 key heads of 64 (SmolLM2's KV heads' rows) and 9 value
# heads (its q heads' rows) over a 4-tap convolution
QWEN35_ATTN_EVERY = 4
QWEN35_KV = {"full_attention_interval": QWEN35_ATTN_EVERY, "rope.dimension_count": 32, "ssm.conv_kernel": 4,
             "ssm.state_size": 64, "ssm.group_count": 3, "ssm.time_step_rank": 9, "ssm.inner_size": 576}
QWEN35_SECTIONS = [6, 5, 5, 0]
# qwen35moe: qwen35's layers with qwen3moe's experts (renormalized weights: ffn_down times QWEN35MOE_DOWN_SCALE) and
# qwen2moe's gated shared expert (the whole dense FFN); no feed_forward_length (optional in llama.cpp: the widths
# have keys of their own); the even layers' expert gate and up rows in one ffn_gate_up_exps, as
# `convert_hf_to_gguf.py --fuse-gate-up-exps` writes them (the MTP block's apart)
QWEN35MOE_DOWN_SCALE = 2.0
QWEN35MOE_KV = {**QWEN35_KV, **MOE_KV, "expert_feed_forward_length": MOE_FF,
                "expert_shared_feed_forward_length": QWEN2MOE_SHEXP_FF, "feed_forward_length": None}
# qwen3vl / qwen3vlmoe: Qwen3-VL's 24 / 20 / 20 sections of 64 rotated pairs, scaled to these 32, and its 3 deepstack
# layers
QWEN3VL_SECTIONS = [12, 10, 10, 0]
QWEN3VL_KV = {"n_deepstack_layers": 3}
# qwen2vl: Qwen2-VL's 16 / 24 / 24 sections of 64 pairs scaled to 32, one pair moved to the fourth section (text
# tokens' position 0 there: the pair does not turn)
QWEN2VL_SECTIONS = [8, 12, 11, 1]
# the variant whose tensors each of these takes (its keys are its own)
TENSORS_AS = {"qwen3vl": "qwen3", "qwen3vlmoe": "qwen3moe"}
# lfm2: the layers that are short-convolution blocks (i % LFM2_CONV_EVERY == LFM2_CONV_EVERY - 1), the convolution's width
LFM2_CONV_EVERY, LFM2_L_CACHE = 3, 3
Q = gguf.GGMLQuantizationType


def llama3_rope_factors(n_rot: int, base: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0,
                        orig_ctx: int = 8192) -> np.ndarray:
    """rope_freqs.weight of a Llama 3.1 conversion: [n_rot / 2] float32 divisors of each pair's frequency."""
    freqs = base ** -(np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    wavelen = 2 * math.pi / freqs
    smooth = (orig_ctx / wavelen - low) / (high - low)
    out = np.where(wavelen < orig_ctx / high, 1.0,
                   np.where(wavelen > orig_ctx / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def _norm_weight(n: int, layer: int, phase: float) -> np.ndarray:
    # different per dimension and layer, so a permuted or misplaced weight changes the logits; about 2:
    # unit-RMS q and k heads (weights near 1) leave SmolLM2's attention nearly uniform (it then writes
    # only newlines), at about twice that it writes text again
    i = np.arange(n, dtype=np.float64)
    return (2.0 * (1.0 + 0.3 * np.cos(0.37 * i + 1.3 * layer + phase))).astype(np.float32)


def _pairs_to_halves(rows: np.ndarray, head_dim: int, n_rot: int) -> np.ndarray:
    """q or k projection rows [n_heads * head_dim, ...] reordered within each head from llama's rope
    pairs (2i, 2i + 1) to NeoX's (i, i + n_rot / 2): NeoX RoPE then rotates each pair as llama's did,
    so the attention scores stay those of the trained model (q and k move alike)."""
    half = n_rot // 2
    order = np.concatenate((np.arange(0, n_rot, 2), np.arange(1, n_rot, 2), np.arange(n_rot, head_dim)))
    assert order.size == head_dim and half * 2 == n_rot
    heads = rows.reshape(-1, head_dim, *rows.shape[1:])
    return heads[:, order].reshape(rows.shape)


# Gemma 3 270M's q heads' (4) and k head's RMS before their norms, per layer: medians over the tokens of
# the first 1500 characters of the Apache license (sharpi's forward pass on the original GGUF, measured
# once; two significant digits). Fixed numbers, so that the derived file is the same on every machine.
GEMMA3_270M_HEAD_RMS = [
    (33.0, 16.0, 21.0, 22.0, 20.0), (11.0, 8.1, 18.0, 8.4, 9.2), (1.8, 1.5, 4.3, 2.6, 2.2), (1.6, 1.8, 1.3, 1.1, 1.4),
    (1.4, 1.8, 1.8, 3.1, 2.1), (1.5, 1.1, 1.3, 1.3, 1.2), (1.5, 2.3, 2.0, 1.6, 1.7), (2.6, 3.5, 2.7, 2.7, 2.6),
    (3.0, 2.7, 2.9, 3.4, 2.5), (3.1, 3.4, 2.6, 2.7, 2.4), (3.0, 3.2, 2.6, 4.0, 2.6), (0.79, 0.7, 1.1, 0.96, 0.62),
    (2.1, 2.2, 2.2, 2.1, 2.3), (2.5, 2.6, 2.7, 2.0, 1.9), (2.9, 2.7, 2.9, 2.8, 3.0), (2.9, 3.3, 2.7, 2.9, 3.2),
    (4.8, 4.4, 4.7, 4.7, 4.9), (1.9, 1.4, 1.2, 1.8, 1.3)]


def _fold_head_norm(tensors: dict, t, head_dim: int) -> np.ndarray:
    """Gemma 3's attn_q / attn_k weight with its per-head RMSNorm folded in as a constant, as Q8_0 blocks:
    row i of head h times norm[i % head_dim] / GEMMA3_270M_HEAD_RMS (the head's typical RMS). Without
    the norm the trained projections give scores far off their scale (the model then repeats one
    word); with a fixed typical RMS in place of each token's own it still writes text."""
    layer = int(t.name.split(".")[1])
    n, k = int(t.shape[1]), int(t.shape[0])
    x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(n, k).astype(np.float64)
    norm = np.asarray(tensors[t.name.replace(".weight", "_norm.weight")].data, np.float64)
    table = GEMMA3_270M_HEAD_RMS[layer]
    rms = np.array(table[:-1] if ".attn_q." in t.name else table[-1:])  # [heads]
    if rms.size * head_dim != n:
        raise SystemExit(f"{t.name}: not Gemma 3 270M's shape (the RMS table is that model's)")
    folded = x.reshape(-1, head_dim, k) * (norm[:, None] / rms[:, None, None])
    return gguf.quants.quantize(folded.reshape(n, k).astype(np.float32), Q.Q8_0)


def _conv_taps(n_embd: int, layer: int) -> np.ndarray:
    """shortconv.conv.weight [n_embd, LFM2_L_CACHE] f32: per channel, the oldest position's tap first and the
    current token's last (about 0.2, 0.5, 1: a fading window), varied by channel and layer."""
    i = np.arange(n_embd, dtype=np.float64)[:, None]
    j = np.arange(LFM2_L_CACHE, dtype=np.float64)[None, :]
    return (0.05 * 0.5 ** (LFM2_L_CACHE - 1 - j) * (1.0 + 0.4 * np.sin(0.29 * i + 0.8 * j + 1.1 * layer))).astype(np.float32)


def _lfm2_conv_tensors(w: gguf.GGUFWriter, tensors: dict, layer: int, n_embd: int) -> None:
    """Layer `layer`'s short-convolution block from its llama weights (see the lfm2 variant)."""
    p = f"blk.{layer}."
    parts = [tensors[p + "ffn_gate.weight"], tensors[p + "ffn_up.weight"], tensors[p + "attn_q.weight"]]
    if len({t.tensor_type for t in parts}) != 1 or parts[0].tensor_type in (Q.F32, Q.F16):
        raise SystemExit(f"{p}: parts of one quantized type are needed to make shortconv.in_proj")
    rows = [np.asarray(t.data)[:n_embd] for t in parts]
    w.add_tensor(p + "shortconv.in_proj.weight", np.concatenate(rows), raw_dtype=parts[0].tensor_type)
    out = tensors[p + "attn_output.weight"]
    w.add_tensor(p + "shortconv.out_proj.weight", np.asarray(out.data), raw_dtype=out.tensor_type)
    w.add_tensor(p + "shortconv.conv.weight", _conv_taps(n_embd, layer))


def _router_weight(n_embd: int, layer: int) -> np.ndarray:
    """ffn_gate_inp [MOE_EXPERTS, n_embd]: a fixed smooth pattern per expert and layer, large enough that
    tokens prefer different experts (the logits' spread is a few units) and no two experts tie."""
    d = np.arange(n_embd, dtype=np.float64)[None, :]
    e = np.arange(MOE_EXPERTS, dtype=np.float64)[:, None]
    return (0.1 * np.sin(0.173 * (e + 1) * d + 0.7 * e + 0.31 * layer)).astype(np.float32)


def _moe_tensors(w: gguf.GGUFWriter, tensors: dict, layer: int, down_scale: float = MOE_DOWN_SCALE,
                 dst: int | None = None, fused: bool = False) -> None:
    """Layer `layer`'s dense FFN as MOE_EXPERTS experts of layer `dst` (default the same; rows / columns of whole
    blocks, bytes as they are; ffn_down's block scales times down_scale, a power of two); fused: each expert's gate
    rows then its up rows in one ffn_gate_up_exps."""
    p, d = f"blk.{layer}.", f"blk.{layer if dst is None else dst}."
    gate, up, down = (tensors[p + n] for n in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))
    n_ff, n_embd = int(gate.shape[1]), int(gate.shape[0])
    if n_ff != MOE_EXPERTS * MOE_FF:
        raise SystemExit(f"{p}ffn_gate: {n_ff} rows, not {MOE_EXPERTS} experts of {MOE_FF}")
    per_expert = [np.asarray(t.data).reshape(MOE_EXPERTS, MOE_FF, -1) for t in (gate, up)]  # [E, MOE_FF, row bytes]
    if fused:
        if gate.tensor_type != up.tensor_type:
            raise SystemExit(f"{p}: gate and up of one type are needed to fuse them as they are")
        w.add_tensor(d + "ffn_gate_up_exps.weight", np.concatenate(per_expert, axis=1), raw_dtype=gate.tensor_type)
    else:
        for t, raw, name in zip((gate, up), per_expert, ("ffn_gate_exps", "ffn_up_exps")):
            w.add_tensor(d + name + ".weight", raw, raw_dtype=t.tensor_type)
    raw = np.asarray(down.data)  # [n_embd, row bytes]: expert e's columns are a run of whole blocks of each row
    block, size = gguf.GGML_QUANT_SIZES[down.tensor_type]
    if MOE_FF % block:
        raise SystemExit(f"{p}ffn_down: {MOE_FF} columns are not whole blocks of {block}")
    per = MOE_FF // block * size
    if down.tensor_type != Q.Q4_1:
        raise SystemExit(f"{p}ffn_down: Q4_1 blocks are needed (their scales are rescaled in place)")
    blocks = raw.reshape(n_embd, MOE_EXPERTS, per // size, size).transpose(1, 0, 2, 3)
    w.add_tensor(d + "ffn_down_exps.weight", _scale_q4_1(blocks, down_scale, p + "ffn_down").reshape(
        MOE_EXPERTS, n_embd, per), raw_dtype=down.tensor_type)
    w.add_tensor(d + "ffn_gate_inp.weight", _router_weight(n_embd, layer if dst is None else dst))


def _scale_q4_1(blocks: np.ndarray, scale: float, name: str) -> np.ndarray:
    """Q4_1 blocks [..., 20 bytes] with d and m (their first two f16) times scale, a power of two: exactly."""
    blocks = blocks.copy()
    dm = blocks[..., :4].copy().view(np.float16) * np.float16(scale)
    if not np.isfinite(dm).all():
        raise SystemExit(f"{name}: a block scale overflows f16 times {scale}")
    blocks[..., :4] = dm.view(np.uint8)
    return blocks


def _shared_expert_tensors(w: gguf.GGUFWriter, tensors: dict, layer: int, down_scale: float = 1.0,
                           gate_amp: float | None = None, dst: int | None = None) -> None:
    """A shared expert for layer `dst` (default `layer`; see the qwen2moe and granitemoe variants): layer `layer`'s
    dense FFN tensors (ffn_down's Q4_1 block scales times down_scale), and the logit row of its sigmoid gate when
    gate_amp is given."""
    p, d = f"blk.{layer}.", f"blk.{layer if dst is None else dst}."
    for name in ("ffn_gate", "ffn_up", "ffn_down"):
        t = tensors[p + name + ".weight"]
        raw = np.asarray(t.data)
        if name == "ffn_down" and down_scale != 1.0:
            if t.tensor_type != Q.Q4_1:
                raise SystemExit(f"{p}ffn_down: Q4_1 blocks are needed (their scales are rescaled in place)")
            raw = _scale_q4_1(raw.reshape(raw.shape[0], -1, 20), down_scale, p + name).reshape(raw.shape)
        w.add_tensor(d + name + "_shexp.weight", raw, raw_dtype=t.tensor_type)
    if gate_amp is not None:
        n_embd = int(tensors[p + "ffn_gate.weight"].shape[0])
        w.add_tensor(d + "ffn_gate_inp_shexp.weight", _smooth(n_embd, layer if dst is None else dst, 9.0, gate_amp))


def _smooth(n: int, layer: int, phase: float, amp: float, offset: float = 0.0) -> np.ndarray:
    """f32 [n]: offset + amp * a fixed smooth pattern varied by index and layer (biases, sinks)."""
    i = np.arange(n, dtype=np.float64)
    return (offset + amp * np.sin(0.71 * i + 0.53 * layer + phase)).astype(np.float32)


def _gpt_oss_tensors(w: gguf.GGUFWriter, tensors: dict, layer: int, n_embd: int, n_head: int, head_dim: int,
                     n_head_kv: int) -> None:
    """gpt-oss's additions to layer `layer` (see the variant): biases, sinks, MXFP4 experts and their biases."""
    p = f"blk.{layer}."
    w.add_tensor(p + "attn_q.bias", _smooth(n_head * head_dim, layer, 0.0, 0.05))
    w.add_tensor(p + "attn_k.bias", _smooth(n_head_kv * head_dim, layer, 1.0, 0.05))
    w.add_tensor(p + "attn_v.bias", _smooth(n_head_kv * head_dim, layer, 2.0, 0.02))
    w.add_tensor(p + "attn_output.bias", _smooth(n_embd, layer, 3.0, 0.02))
    w.add_tensor(p + "attn_sinks.weight", _smooth(n_head, layer, 4.0, 1.5, 0.5))  # about the scores' range
    gate, up, down = (tensors[p + n] for n in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))
    dense = lambda t: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(  # noqa: E731
        int(t.shape[1]), int(t.shape[0])).astype(np.float32)
    for t, name in ((gate, "ffn_gate_exps"), (up, "ffn_up_exps")):  # expert e: rows [e * MOE_FF, (e + 1) * MOE_FF)
        blocks = gguf.quants.quantize(dense(t), Q.MXFP4)
        w.add_tensor(p + name + ".weight", blocks.reshape(MOE_EXPERTS, MOE_FF, -1), raw_dtype=Q.MXFP4)
    d = dense(down) * MOE_DOWN_SCALE  # [n_embd, n_ff]: expert e's columns [e * MOE_FF, (e + 1) * MOE_FF)
    cols = d.reshape(n_embd, MOE_EXPERTS, MOE_FF).transpose(1, 0, 2).reshape(MOE_EXPERTS * n_embd, MOE_FF)
    w.add_tensor(p + "ffn_down_exps.weight", gguf.quants.quantize(np.ascontiguousarray(cols), Q.MXFP4).reshape(
        MOE_EXPERTS, n_embd, -1), raw_dtype=Q.MXFP4)
    w.add_tensor(p + "ffn_gate_inp.weight", _router_weight(n_embd, layer))
    w.add_tensor(p + "ffn_gate_inp.bias", _smooth(MOE_EXPERTS, layer, 5.0, 0.3))
    w.add_tensor(p + "ffn_gate_exps.bias", _smooth(MOE_EXPERTS * MOE_FF, layer, 6.0, 0.05).reshape(MOE_EXPERTS, MOE_FF))
    w.add_tensor(p + "ffn_up_exps.bias", _smooth(MOE_EXPERTS * MOE_FF, layer, 7.0, 0.05, -1.0).reshape(MOE_EXPERTS, MOE_FF))
    w.add_tensor(p + "ffn_down_exps.bias", _smooth(MOE_EXPERTS * n_embd, layer, 8.0, 0.02).reshape(MOE_EXPERTS, n_embd))


def _f16(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float16)


def _pack_2bit(codes: np.ndarray) -> np.ndarray:
    """codes [nb, 256] (0..3) -> the 64 qs bytes of Q2_K / Q3_K: element 128h + 32j + l is bits 2j, 2j+1
    of byte 32h + l"""
    c = codes.reshape(-1, 2, 4, 32).astype(np.uint8)  # [nb, h, j, l]
    return (c << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8).reshape(-1, 64)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k % 256 == 0) -> Q3_K blocks uint8 [n, k / 256 * 110] (hmask | qs | scales | d):
    w = d * (sc - 32) * (q - 4). Per 16 weights the value of largest magnitude gets code -4 (as ggml's
    make_q3_quants), the 16 scales of a super-block are 6-bit multiples of d (the largest at -32)."""
    n, k = x.shape
    xb = x.reshape(-1, 16, 16).astype(np.float32)                   # [nb, sub-block, 16]
    big = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)[..., 0]
    s = -big / 4                                                     # [nb, 16]
    smax = np.take_along_axis(s, np.abs(s).argmax(-1)[..., None], -1)  # [nb, 1]
    d = _f16(np.where(smax != 0, -smax / 32, 0)).astype(np.float32)
    ls = np.clip(np.round(np.divide(s, d, out=np.zeros_like(s), where=d != 0)), -32, 31).astype(np.int64)
    sc = (d * ls)[..., None]                                         # [nb, 16, 1]
    q = np.clip(np.round(np.divide(xb, sc, out=np.zeros_like(xb), where=sc != 0)), -4, 3).astype(np.int64) + 4
    q = q.reshape(-1, 256)
    e = np.arange(256)
    hmask = np.zeros((q.shape[0], 32), np.uint8)
    np.bitwise_or.at(hmask, (slice(None), e & 31), ((q >> 2) << (e >> 5)).astype(np.uint8))
    u = (ls + 32).astype(np.uint8)                                   # [nb, 16] 6-bit
    scales = np.zeros((q.shape[0], 12), np.uint8)
    scales[:, :8] = (u[:, :8] & 15) | ((u[:, 8:] & 15) << 4)
    for i in range(16):
        scales[:, 8 + i % 4] |= (u[:, i] >> 4) << (2 * (i // 4))
    out = np.concatenate([hmask, _pack_2bit(q & 3), scales, d.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)
    return out.reshape(n, -1)


def _min_max_codes(x: np.ndarray, sub: int, qmax: int, smax: int):
    """Weights [n, k] in super-blocks of 256 with sub-blocks of `sub` -> (d, dmin [nb, 1] fp16 values, sc, m
    [nb, 256 / sub] integers in 0..smax, codes q [nb, 256 / sub, sub] in 0..qmax) of w = d * sc * q - dmin * m:
    per sub-block the range [min(x, 0), max(x)] over the codes, scales and mins multiples of d and dmin."""
    xb = x.reshape(-1, 256 // sub, sub).astype(np.float32)
    lo, hi = np.minimum(xb.min(-1), 0), np.maximum(xb.max(-1), 0)
    scale, mn = (hi - lo) / qmax, -lo                                # [nb, 256 / sub], >= 0
    d = _f16(scale.max(-1, keepdims=True) / smax).astype(np.float32)
    dmin = _f16(mn.max(-1, keepdims=True) / smax).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d, out=np.zeros_like(scale), where=d != 0)), 0, smax).astype(np.int64)
    m = np.clip(np.round(np.divide(mn, dmin, out=np.zeros_like(mn), where=dmin != 0)), 0, smax).astype(np.int64)
    step = (d * sc)[..., None]
    q = np.clip(np.round(np.divide(xb + (dmin * m)[..., None], step, out=np.zeros_like(xb), where=step != 0)), 0, qmax)
    return d, dmin, sc, m, q.astype(np.int64)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k % 256 == 0) -> Q2_K blocks uint8 [n, k / 256 * 84] (scales | qs | d | dmin):
    w = d * sc * q - dmin * m, per 16 weights the range [min(x, 0), max(x)] over the codes 0..3, the
    16 scales and mins 4-bit multiples of d and dmin."""
    n, k = x.shape
    d, dmin, sc, m, q = _min_max_codes(x, 16, 3, 15)
    out = np.concatenate([(sc | (m << 4)).astype(np.uint8), _pack_2bit(q.reshape(-1, 256)),
                          d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                          dmin.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)
    return out.reshape(n, -1)


KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k % 32 == 0) -> IQ4_NL blocks uint8 [n, k / 32 * 18] (d | qs as Q4_0's nibbles):
    w = d * KVALUES_IQ4NL[q]; the value of largest magnitude of a block gets -127, every weight the
    nearest table value."""
    n, k = x.shape
    xb = x.reshape(-1, 32).astype(np.float32)
    big = np.take_along_axis(xb, np.abs(xb).argmax(-1)[:, None], -1)
    d = _f16(-big / 127).astype(np.float32)                         # [nb, 1]
    q = np.abs(xb[..., None] - d[..., None] * KVALUES_IQ4NL).argmin(-1).astype(np.uint8)  # [nb, 32]
    out = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), q[:, :16] | (q[:, 16:] << 4)], axis=1)
    return out.reshape(n, -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k % 256 == 0) -> Q5_K blocks uint8 [n, k / 256 * 176] (d | dmin | scales | qh | qs):
    w = d * sc * q - dmin * m, per 32 weights the range [min(x, 0), max(x)] over the codes 0..31, the 8
    scales and mins 6-bit multiples of d and dmin."""
    n, k = x.shape
    d, dmin, sc, m, q = _min_max_codes(x, 32, 31, 63)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)                      # [nb, chunk i, sub-block 2i + h, l]
    qs = (q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)                 # [nb, 4, 32]
    qh = ((q >> 4).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8)  # [nb, 32]
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    out = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), dmin.astype(np.float16).view(np.uint8).reshape(-1, 2),
                          scales, qh, qs.reshape(-1, 128)], axis=1)
    return out.reshape(n, -1)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k % 256 == 0) -> IQ4_XS blocks uint8 [n, k / 256 * 136] (d | scales_h | scales_l |
    qs): w = d * (ls - 32) * KVALUES_IQ4NL[q] with a 6-bit ls per 32 weights (the largest value of a
    sub-block on -127, the 8 scales multiples of d with the largest at -32, nearest table values)."""
    n, k = x.shape
    xb = x.reshape(-1, 8, 32).astype(np.float32)                     # [nb, sub-block, 32]
    big = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)[..., 0]
    s = -big / 127                                                     # [nb, 8]
    smax = np.take_along_axis(s, np.abs(s).argmax(-1)[..., None], -1)
    d = _f16(np.where(smax != 0, -smax / 32, 0)).astype(np.float32)  # [nb, 1]
    ls = np.clip(np.round(np.divide(s, d, out=np.zeros_like(s), where=d != 0)), -32, 31).astype(np.int64)
    step = (d * ls)[..., None, None]                                  # [nb, 8, 1, 1]
    q = np.abs(xb[..., None] - step * KVALUES_IQ4NL).argmin(-1).astype(np.uint8)  # [nb, 8, 32]
    u = (ls + 32).astype(np.uint16)
    scales_h = ((u >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1, dtype=np.uint16)
    scales_l = ((u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)).astype(np.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(-1, 128)
    out = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), scales_h[:, None].view(np.uint8),
                          scales_l, qs], axis=1)
    return out.reshape(n, -1)


LOWBIT_FFN_DOWN = [(Q.Q3_K, quantize_q3_k), (Q.Q2_K, quantize_q2_k), (Q.IQ4_XS, quantize_iq4_xs), (Q.Q5_K, quantize_q5_k)]


def copy_kv(r, w: gguf.GGUFWriter, rename=lambda key: key, values: dict | None = None) -> dict:
    """Every metadata key of r (a gguf.GGUFReader, or sharpi's GGUFFile: its reader decodes a 262k-token
    vocabulary in a fraction of a second, the stock one in ~9 s) into w (the writer's own GGUF.* and
    architecture excepted), under rename(key), with values[new key] instead of the value where given;
    returns {new key: value}. A value of None leaves the key out."""
    out, values = {}, values or {}
    fields = r.reader.fields if hasattr(r, "reader") else r.fields
    get = r.get if hasattr(r, "reader") else (lambda key: fields[key].contents())
    for key, f in fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        types, name = list(f.types), rename(key)
        if name in values and values[name] is None:
            continue
        value = out[name] = values[name] if name in values else get(key)
        if isinstance(value, list) and types[0] != VT.ARRAY:  # (lfm2: a per-layer array for a scalar)
            types = [VT.ARRAY, VT.UINT32]
        w.add_key_value(name, value, types[0], sub_type=types[-1] if types[0] == VT.ARRAY else None)
    return out


def add_tensor_as_is(w: gguf.GGUFWriter, t, name: str | None = None) -> None:
    """A tensor of a GGUFReader into w unchanged (quantized blocks byte for byte), under its name or `name`."""
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        w.add_tensor(name or t.name, np.asarray(t.data).reshape([int(v) for v in t.shape[::-1]]))
    else:
        w.add_tensor(name or t.name, np.asarray(t.data), raw_dtype=t.tensor_type)


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _qwen35_tensors(w: gguf.GGUFWriter, r: gguf.GGUFReader, head_dim: int, n_rot: int, n_head: int,
                    moe: bool = False) -> None:
    """qwen35's tensors from a llama GGUF's (see the qwen35 variant; moe: qwen35moe's)."""
    tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
        if not t.name.startswith("blk."):
            add_tensor_as_is(w, t)
            continue
        layer, kind = int(t.name.split(".")[1]), t.name.split(".", 2)[2]
        p = f"blk.{layer}."
        if kind == "ffn_norm.weight":
            w.add_tensor(p + "post_attention_norm.weight", np.asarray(t.data))
        elif moe and kind in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
            if kind == "ffn_down.weight":
                _qwen35moe_ffn(w, tensors, layer, layer, fused=layer % 2 == 0)
        elif kind.startswith(("ffn_", "attn_norm.")):
            add_tensor_as_is(w, t)
        elif layer % QWEN35_ATTN_EVERY != QWEN35_ATTN_EVERY - 1:
            if kind == "attn_q.weight":
                _qwen35_linear_tensors(w, tensors, layer)
        elif kind == "attn_q.weight":
            _gated_q(w, p, t, layer, head_dim, n_rot, n_head)
        elif kind == "attn_k.weight":
            w.add_tensor(t.name, _pairs_to_halves(np.asarray(t.data), head_dim, n_rot), raw_dtype=t.tensor_type)
        else:
            add_tensor_as_is(w, t)


def _gated_q(w: gguf.GGUFWriter, p: str, t, layer: int, head_dim: int, n_rot: int, n_head: int) -> None:
    """A gated attention layer's attn_q under prefix p from a llama attn_q t (each head's q rows in NeoX order, then
    its gate's: the next head's q rows), and its per-head q / k norms."""
    q = _pairs_to_halves(np.asarray(t.data), head_dim, n_rot).reshape(n_head, head_dim, -1)
    gate = np.roll(np.asarray(t.data).reshape(n_head, head_dim, -1), -1, axis=0)
    w.add_tensor(p + "attn_q.weight", np.concatenate((q, gate), axis=1).reshape(2 * n_head * head_dim, -1),
                 raw_dtype=t.tensor_type)
    w.add_tensor(p + "attn_q_norm.weight", _norm_weight(head_dim, layer, 0.0))
    w.add_tensor(p + "attn_k_norm.weight", _norm_weight(head_dim, layer, 2.0))


def _qwen35moe_ffn(w: gguf.GGUFWriter, tensors: dict, layer: int, dst: int, fused: bool) -> None:
    """Layer `dst`'s qwen35moe FFN from layer `layer`'s dense one: experts and a gated shared expert."""
    _moe_tensors(w, tensors, layer, QWEN35MOE_DOWN_SCALE, dst=dst, fused=fused)
    _shared_expert_tensors(w, tensors, layer, gate_amp=QWEN2MOE_GATE_AMP, dst=dst)


def _qwen35_mtp_tensors(w: gguf.GGUFWriter, r: gguf.GGUFReader, head_dim: int, n_rot: int, n_head: int,
                        moe: bool = False) -> None:
    """The MTP block after the qwen35 derivative's layers (see the qwen35 variant): the source's last layer as a gated
    attention layer, eh_proj mixing the normed embedding and hidden row (Q8_0), enorm, hnorm, shared_head_norm;
    moe: its FFN as qwen35moe's."""
    tensors = {t.name: t for t in r.tensors}
    last = max(int(t.name.split(".")[1]) for t in r.tensors if t.name.startswith("blk."))
    p, b = f"blk.{last}.", f"blk.{last + 1}."
    _gated_q(w, b, tensors[p + "attn_q.weight"], last + 1, head_dim, n_rot, n_head)
    t = tensors[p + "attn_k.weight"]
    w.add_tensor(b + "attn_k.weight", _pairs_to_halves(np.asarray(t.data), head_dim, n_rot), raw_dtype=t.tensor_type)
    ffn = () if moe else (("ffn_gate", "ffn_gate"), ("ffn_up", "ffn_up"), ("ffn_down", "ffn_down"))
    for src, dst in (("attn_v", "attn_v"), ("attn_output", "attn_output"), *ffn, ("attn_norm", "attn_norm"),
                     ("ffn_norm", "post_attention_norm")):
        add_tensor_as_is(w, tensors[p + src + ".weight"], b + dst + ".weight")
    if moe:
        _qwen35moe_ffn(w, tensors, last, last + 1, fused=False)
    n_embd = int(tensors[p + "attn_norm.weight"].shape[0])
    i = np.arange(n_embd, dtype=np.float64)[:, None]
    j = np.arange(2 * n_embd, dtype=np.float64)[None, :]
    eh = 0.02 * np.sin(0.37 * i + 0.11 * j)
    eh[:, :n_embd] += 0.4 * np.eye(n_embd)  # (the embedding's share, then the hidden row's)
    eh[:, n_embd:] += 0.8 * np.eye(n_embd)
    w.add_tensor(b + "nextn.eh_proj.weight", gguf.quants.quantize(eh.astype(np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor(b + "nextn.enorm.weight", _norm_weight(n_embd, last + 1, 1.0))
    w.add_tensor(b + "nextn.hnorm.weight", _norm_weight(n_embd, last + 1, 3.0))
    w.add_tensor(b + "nextn.shared_head_norm.weight", np.asarray(tensors["output_norm.weight"].data) * np.float32(0.9))


def _qwen35_linear_tensors(w: gguf.GGUFWriter, tensors: dict, layer: int) -> None:
    """Layer `layer`'s Gated DeltaNet tensors from its llama weights (see the qwen35 variant)."""
    p = f"blk.{layer}."
    parts = [tensors[p + n] for n in ("attn_k.weight", "attn_v.weight", "attn_q.weight")]
    if len({t.tensor_type for t in parts}) != 1 or parts[0].tensor_type in (Q.F32, Q.F16):
        raise SystemExit(f"{p}: parts of one quantized type are needed to make attn_qkv")
    w.add_tensor(p + "attn_qkv.weight", np.concatenate([np.asarray(t.data) for t in parts]), raw_dtype=parts[0].tensor_type)
    n_embd = int(parts[2].shape[0])
    gate = tensors[p + "ffn_gate.weight"]
    w.add_tensor(p + "attn_gate.weight", np.asarray(gate.data)[:int(QWEN35_KV["ssm.inner_size"])], raw_dtype=gate.tensor_type)
    out = tensors[p + "attn_output.weight"]
    w.add_tensor(p + "ssm_out.weight", np.asarray(out.data), raw_dtype=out.tensor_type)
    n_conv = sum(int(t.shape[1]) for t in parts)
    width = int(QWEN35_KV["ssm.conv_kernel"])
    i = np.arange(n_conv, dtype=np.float64)[:, None]
    j = np.arange(width, dtype=np.float64)[None, :]
    taps = 0.5 ** (2 * (width - 1 - j)) * (1.0 + 0.4 * np.sin(0.29 * i + 0.8 * j + 1.1 * layer))  # the current token's last
    w.add_tensor(p + "ssm_conv1d.weight", taps.astype(np.float32))
    n_v = int(QWEN35_KV["ssm.time_step_rank"])
    w.add_tensor(p + "ssm_dt.bias", _smooth(n_v, layer, 0.3, 0.5))
    w.add_tensor(p + "ssm_a", _smooth(n_v, layer, 1.7, 0.6, -1.2))  # (-exp(A_log): negative)
    rows = np.arange(n_v, dtype=np.float64)[:, None] + 1.0
    cols = np.arange(n_embd, dtype=np.float64)[None, :]
    w.add_tensor(p + "ssm_beta.weight", (0.03 * np.sin(0.61 * rows * cols + 0.3 * layer)).astype(np.float32))
    w.add_tensor(p + "ssm_alpha.weight", (0.03 * np.cos(0.43 * rows * cols + 0.7 * layer)).astype(np.float32))
    w.add_tensor(p + "ssm_norm.weight", _norm_weight(int(QWEN35_KV["ssm.state_size"]), layer, 1.0) / 2)


def _phi3_tensors(w: gguf.GGUFWriter, r: gguf.GGUFReader, head_dim: int, n_rot: int, base: float) -> None:
    """phi3's tensors from a llama GGUF's: attn_qkv (q and k rows in NeoX order) and a gate-then-up ffn_up,
    each the parts' blocks back to back (one type), and the longrope factors."""
    tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
        name = t.name
        if name.endswith((".attn_k.weight", ".attn_v.weight", ".ffn_gate.weight")):
            continue
        if name.endswith((".attn_q.weight", ".ffn_up.weight")):
            p = name.rsplit(".", 2)[0] + "."
            if name.endswith(".attn_q.weight"):
                parts, fused = [tensors[p + n] for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")], p + "attn_qkv.weight"
            else:
                parts, fused = [tensors[p + "ffn_gate.weight"], t], p + "ffn_up.weight"
            if len({q.tensor_type for q in parts}) != 1 or parts[0].tensor_type in (Q.F32, Q.F16):
                raise SystemExit(f"{name}: parts of one quantized type are needed to fuse them as they are")
            rows = [np.asarray(q.data) for q in parts]
            if name.endswith(".attn_q.weight"):
                rows[0], rows[1] = _pairs_to_halves(rows[0], head_dim, n_rot), _pairs_to_halves(rows[1], head_dim, n_rot)
            w.add_tensor(fused, np.concatenate(rows), raw_dtype=parts[0].tensor_type)
        else:
            add_tensor_as_is(w, t)
    long = llama3_rope_factors(n_rot, base)
    w.add_tensor("rope_factors_long.weight", long)
    w.add_tensor("rope_factors_short.weight", (1 + (long - 1) / 70).astype(np.float32))


def derive(variant: str, src: str, dst: str) -> None:
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant '{variant}' (known: {', '.join(VARIANTS)})")
    gf = GGUFFile(src)
    r = gf.reader
    arch = str(gf.get("general.architecture"))
    if arch != SOURCE_ARCH.get(variant, "llama"):
        raise SystemExit(f"{src}: a {SOURCE_ARCH.get(variant, 'llama')}-architecture GGUF is needed, not '{arch}'")
    new_arch = {"qwen3": "qwen3", "smollm3": "smollm3", "gemma2": "gemma2", "phi3": "phi3", "granite": "granite",
                "granitemoe": "granitemoe", "exaone": "exaone", "olmo2": "olmo2", "exaone4": "exaone4",
                "qwen3moe": "qwen3moe", "mistral3": "mistral3", "lfm2": "lfm2", "gpt-oss": "gpt-oss",
                "qwen2moe": "qwen2moe", "qwen35": "qwen35", "qwen35moe": "qwen35moe", "qwen3vl": "qwen3vl",
                "qwen3vlmoe": "qwen3vlmoe", "qwen2vl": "qwen2vl", "ernie4_5": "ernie4_5"}.get(variant, arch)
    own_keys, variant = variant, TENSORS_AS.get(variant, variant)  # (from here on: the tensors' variant)
    moe = variant in ("qwen3moe", "mixtral", "gpt-oss", "qwen2moe", "granitemoe")
    w = gguf.GGUFWriter(dst, new_arch)
    rename = lambda key: new_arch + key[len(arch):] if key.startswith(arch + ".") else key  # noqa: E731
    # (not "phi3" in the name: llama.cpp's vocabulary would then give Phi-3's special tokens their attributes,
    # and fail on the missing </s>)
    label = {"phi3": "fused-qkv longrope"}.get(own_keys, own_keys)
    name = f"{gf.get('general.name')} ({label} derivative, for tests)" if "general.name" in r.fields else None
    values = {"general.name": name} if name else {}
    extra = {"gemma2": GEMMA2_KV, "phi3": PHI3_KV, "granite": GRANITE_KV, "qwen3moe": MOE_KV, "mixtral": MOE_KV,
             "mistral3": MISTRAL3_KV, "gpt-oss": {**MOE_KV, **GPT_OSS_KV}, "qwen2moe": QWEN2MOE_KV,
             "granitemoe": GRANITEMOE_KV, "qwen35": QWEN35_KV, "qwen35moe": QWEN35MOE_KV, "qwen3vl": QWEN3VL_KV,
             "qwen3vlmoe": {**MOE_KV, **QWEN3VL_KV}}.get(own_keys, {})
    values.update({f"{new_arch}.{k}": v for k, v in extra.items()})
    if moe:  # (qwen3moe and gpt-oss read their own key; llama's experts have feed_forward_length rows)
        key = "expert_feed_forward_length" if variant in ("qwen3moe", "gpt-oss", "qwen2moe") else "feed_forward_length"
        values[f"{new_arch}.{key}"] = MOE_FF
    if variant in ("qwen35", "qwen35moe"):  # (one more block: the MTP layer, _qwen35_mtp_tensors)
        values[f"{new_arch}.block_count"] = int(gf.arch_get("block_count")) + 1
        values[f"{new_arch}.nextn_predict_layers"] = 1
    if variant == "lfm2":
        n_layer, n_kv = int(gf.arch_get("block_count")), int(gf.arch_get("attention.head_count_kv"))
        values["lfm2.attention.head_count_kv"] = [0 if i % LFM2_CONV_EVERY == LFM2_CONV_EVERY - 1 else n_kv for i in range(n_layer)]
        values["lfm2.shortconv.l_cache"] = LFM2_L_CACHE
    kv = copy_kv(gf, w, rename, values)
    if variant in ("qwen35", "qwen35moe"):
        w.add_key_value(f"{new_arch}.rope.dimension_sections", QWEN35_SECTIONS, VT.ARRAY, sub_type=VT.INT32)
    if own_keys in ("qwen3vl", "qwen3vlmoe", "qwen2vl"):
        w.add_key_value(f"{new_arch}.rope.dimension_sections",
                        QWEN2VL_SECTIONS if own_keys == "qwen2vl" else QWEN3VL_SECTIONS, VT.ARRAY, sub_type=VT.INT32)
    for key, value in values.items():  # the ones the source does not have
        if key not in kv and value is not None:
            w.add_key_value(key, value, VT.FLOAT32 if isinstance(value, float) else VT.STRING if isinstance(value, str)
                            else VT.ARRAY if isinstance(value, list) else VT.UINT32,
                            sub_type=VT.UINT32 if isinstance(value, list) else None)
    n_head = int(kv[f"{new_arch}.attention.head_count"])
    head_dim = int(kv.get(f"{new_arch}.attention.key_length", int(kv[f"{new_arch}.embedding_length"]) // n_head))
    n_rot = int(kv.get(f"{new_arch}.rope.dimension_count", head_dim))
    tensors = {t.name: t for t in r.tensors}
    if variant == "phi3":
        _phi3_tensors(w, r, head_dim, n_rot, float(kv[f"{new_arch}.rope.freq_base"]))
        finish(w)
        return
    if variant in ("qwen35", "qwen35moe"):
        _qwen35_tensors(w, r, head_dim, n_rot, n_head, moe=variant == "qwen35moe")
        _qwen35_mtp_tensors(w, r, head_dim, n_rot, n_head, moe=variant == "qwen35moe")
        finish(w)
        return
    n_embd = int(kv[f"{new_arch}.embedding_length"])
    conv_layer = lambda name: (variant == "lfm2" and name.startswith("blk.")  # noqa: E731
                               and int(name.split(".")[1]) % LFM2_CONV_EVERY == LFM2_CONV_EVERY - 1)
    for t in r.tensors:
        if conv_layer(t.name) and t.name.endswith((".attn_q.weight", ".attn_k.weight", ".attn_v.weight",
                                                   ".attn_output.weight")):
            continue
        if conv_layer(t.name) and t.name.endswith(".attn_norm.weight"):
            add_tensor_as_is(w, t)
            _lfm2_conv_tensors(w, tensors, int(t.name.split(".")[1]), n_embd)
            continue
        if variant == "lfm2" and t.name == "output_norm.weight":
            w.add_tensor("token_embd_norm.weight", np.asarray(t.data))
            continue
        if variant == "gemma2" and t.name.endswith((".attn_q_norm.weight", ".attn_k_norm.weight")):
            continue
        if variant == "gemma2" and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            w.add_tensor(t.name, _fold_head_norm(tensors, t, head_dim), raw_dtype=Q.Q8_0)
            continue
        if moe and t.name.endswith((".ffn_gate.weight", ".ffn_up.weight")):
            continue
        if moe and t.name.endswith(".ffn_down.weight"):
            layer = int(t.name.split(".")[1])
            if variant == "gpt-oss":
                _gpt_oss_tensors(w, tensors, layer, n_embd, n_head, head_dim, int(kv[f"{new_arch}.attention.head_count_kv"]))
            elif variant == "qwen2moe":
                _moe_tensors(w, tensors, layer, QWEN2MOE_DOWN_SCALE)
                _shared_expert_tensors(w, tensors, layer, gate_amp=QWEN2MOE_GATE_AMP)
            elif variant == "granitemoe":
                _moe_tensors(w, tensors, layer, GRANITEMOE_DOWN_SCALE)
                _shared_expert_tensors(w, tensors, layer, down_scale=GRANITEMOE_SHEXP_DOWN_SCALE)
            else:
                _moe_tensors(w, tensors, layer)
            continue
        if variant == "fused-qkv" and t.name.endswith((".attn_q.weight", ".attn_k.weight", ".attn_v.weight")):
            if t.name.endswith(".attn_q.weight"):
                p, layer = t.name[:-len("attn_q.weight")], int(t.name.split(".")[1])
                parts = [tensors[p + f"attn_{n}.weight"] for n in "qkv"]
                if len({q.tensor_type for q in parts}) != 1 or parts[0].tensor_type in (Q.F32, Q.F16):
                    raise SystemExit(f"{t.name}: parts of one quantized type are needed to fuse them as they are")
                rows = [np.asarray(q.data) for q in parts]
                w.add_tensor(p + "attn_qkv.weight", np.concatenate(rows), raw_dtype=t.tensor_type)
                w.add_tensor(p + "attn_qkv.bias", _smooth(sum(len(r) for r in rows), layer, 0.5, 0.05))
            continue
        if variant in ("olmo2", "exaone4") and t.name.endswith((".attn_norm.weight", ".ffn_norm.weight")):  # post-norms
            layer = int(t.name.split(".")[1])
            if t.name.endswith(".attn_norm.weight"):  # (olmo2's over all heads, exaone4's per head)
                n_q, n_k = ((n_head * head_dim, int(kv[f"{new_arch}.attention.head_count_kv"]) * head_dim)
                            if variant == "olmo2" else (head_dim, head_dim))
                w.add_tensor(f"blk.{layer}.attn_q_norm.weight", _norm_weight(n_q, layer, 0.0))
                w.add_tensor(f"blk.{layer}.attn_k_norm.weight", _norm_weight(n_k, layer, 2.0))
            name = "post_attention_norm" if t.name.endswith(".attn_norm.weight") else "post_ffw_norm"
            scale = OLMO2_POST_NORM if variant == "olmo2" else EXAONE4_POST_NORM
            w.add_tensor(f"blk.{layer}.{name}.weight", (np.asarray(t.data) * scale).astype(np.float32))
            continue
        if variant == "gpt-oss" and t.name.endswith(".ffn_norm.weight"):
            w.add_tensor(t.name.replace(".ffn_norm.", ".post_attention_norm."), np.asarray(t.data))
            continue
        if variant in ("qwen3", "qwen3moe", "lfm2", "gpt-oss", "qwen2moe", "exaone", "olmo2", "exaone4", "qwen2vl") and t.name.endswith(
                (".attn_q.weight", ".attn_k.weight")):  # Q4_1 rows of blocks
            w.add_tensor(t.name, _pairs_to_halves(np.asarray(t.data), head_dim, n_rot), raw_dtype=t.tensor_type)
        elif variant == "float" and t.name.endswith((".weight")) and t.name.startswith("blk.") and len(t.shape) == 2:
            n, k = int(t.shape[1]), int(t.shape[0])
            x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(n, k).astype(np.float32)
            if ".attn_" in t.name:
                w.add_tensor(t.name, x)
            elif t.name.endswith(".ffn_down.weight"):
                w.add_tensor(t.name, gguf.quants.quantize(x, Q.BF16), raw_dtype=Q.BF16)
            else:
                w.add_tensor(t.name, x.astype(np.float16))
        elif variant == "lowbit" and t.name.endswith((".ffn_down.weight", ".attn_q.weight", ".attn_k.weight",
                                                       ".attn_v.weight", ".attn_output.weight")):
            n, k = int(t.shape[1]), int(t.shape[0])
            x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(n, k)
            layer = int(t.name.split(".")[1])
            even = layer % 2 == 0
            if t.name.endswith(".ffn_down.weight"):
                qt, quantize = LOWBIT_FFN_DOWN[layer % len(LOWBIT_FFN_DOWN)]
                blocks = quantize(x)
            else:
                qt, blocks = (Q.Q4_0, gguf.quants.quantize(x, Q.Q4_0)) if even else (Q.IQ4_NL, quantize_iq4_nl(x))
            w.add_tensor(t.name, blocks, raw_dtype=qt)
        elif variant == "mixed" and t.name.startswith("blk.") and (t.name.endswith(".attn_k.weight") or t.name.endswith(
                (".ffn_up.weight", ".ffn_gate.weight")[int(t.name.split(".")[1]) % 2])):
            n, k = int(t.shape[1]), int(t.shape[0])
            x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(n, k)
            qt = Q.Q5_0 if t.name.endswith(".ffn_up.weight") else Q.Q8_0
            w.add_tensor(t.name, gguf.quants.quantize(x, qt), raw_dtype=qt)
        else:
            add_tensor_as_is(w, t)
        if variant in ("qwen2moe", "qwen2vl") and t.name.endswith(".attn_norm.weight"):  # (q / k biases: halves' order too)
            layer = int(t.name.split(".")[1])
            n_kv = int(kv[f"{new_arch}.attention.head_count_kv"])
            w.add_tensor(f"blk.{layer}.attn_q.bias", _smooth(n_head * head_dim, layer, 0.0, 0.05))
            w.add_tensor(f"blk.{layer}.attn_k.bias", _smooth(n_kv * head_dim, layer, 1.0, 0.05))
            w.add_tensor(f"blk.{layer}.attn_v.bias", _smooth(n_kv * head_dim, layer, 2.0, 0.02))
        if variant in ("qwen3", "qwen3moe", "lfm2") and t.name.endswith(".attn_norm.weight"):
            layer = int(t.name.split(".")[1])
            w.add_tensor(f"blk.{layer}.attn_q_norm.weight", _norm_weight(head_dim, layer, 0.0))
            w.add_tensor(f"blk.{layer}.attn_k_norm.weight", _norm_weight(head_dim, layer, 2.0))
    if variant in ("llama3", "exaone", "exaone4"):
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(n_rot, float(kv[f"{new_arch}.rope.freq_base"])))
    if variant in ("gpt-oss", "qwen2moe", "olmo2") and "output.weight" not in tensors:  # (no tied output in their graphs: a copy)
        emb = tensors["token_embd.weight"]
        w.add_tensor("output.weight", np.asarray(emb.data), raw_dtype=emb.tensor_type)
    finish(w)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variant", choices=VARIANTS)
    ap.add_argument("src")
    ap.add_argument("dst")
    args = ap.parse_args(argv)
    derive(args.variant, args.src, args.dst)


if __name__ == "__main__":
    sys.exit(main())
