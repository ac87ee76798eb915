"""Model configuration: one frozen dataclass, filled from GGUF metadata by per-arch tables."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import SharpiError
from ..gguf_file import GGUFFile

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
    post_norms: bool = False        # RMSNorm after attention and after the FFN (gemma3)
    act: str = "silu"               # gated FFN activation: silu (SwiGLU) | gelu_tanh (GeGLU)
    embed_scale: float = 1.0        # gemma multiplies embeddings by sqrt(n_embd)
    attn_scale: float = 0.0         # 0 -> 1/sqrt(head_dim_k)
    scale_q: bool = False           # the scale multiplies q before q.k (gemma3 in llama.cpp), not the scores
    sliding_window: int = 0         # 0 = none
    swa_pattern: int = 0            # every swa_pattern-th layer is global; the others slide
    rope_base_swa: float = 0.0      # rope base of sliding layers (0 -> rope_base)
    tied_output: bool = False       # output.weight absent -> reuse token_embd

    def is_swa(self, layer: int) -> bool:
        return self.sliding_window > 0 and self.swa_pattern > 0 and (layer % self.swa_pattern) < self.swa_pattern - 1

    def layer_rope_base(self, layer: int) -> float:
        return self.rope_base_swa if self.is_swa(layer) and self.rope_base_swa else self.rope_base


def _common(gf: GGUFFile, n_vocab: int) -> dict:
    a = gf.arch_get
    n_embd = int(gf.require(f"{gf.arch}.embedding_length"))
    n_head = int(gf.require(f"{gf.arch}.attention.head_count"))
    hd_k = int(a("attention.key_length", n_embd // n_head))
    return dict(
        arch=gf.arch,
        n_vocab=n_vocab,
        n_ctx_train=int(a("context_length", 2048)),
        n_embd=n_embd,
        n_layer=int(gf.require(f"{gf.arch}.block_count")),
        n_head=n_head,
        n_head_kv=int(a("attention.head_count_kv", n_head)),
        head_dim_k=hd_k,
        head_dim_v=int(a("attention.value_length", hd_k)),
        n_ff=int(gf.require(f"{gf.arch}.feed_forward_length")),
        norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(a("rope.freq_base", 10000.0)),
        n_rot=int(a("rope.dimension_count", hd_k)),
        tied_output="output.weight" not in gf.tensors,
    )


# Per-architecture differences from the llama block, as llama.cpp builds each graph.
ARCH_TABLE = {
    "llama": dict(rope_style=ROPE_NORM),
    "qwen2": dict(rope_style=ROPE_NEOX, qkv_bias=True),
    "gemma3": dict(rope_style=ROPE_NEOX, qk_norm=True, post_norms=True, act="gelu_tanh",
                   swa_pattern=6, rope_base_swa=10000.0, scale_q=True),
}
SUPPORTED_ARCHS = tuple(ARCH_TABLE)


def config_from_gguf(gf: GGUFFile) -> ModelConfig:
    arch = gf.arch
    if arch not in ARCH_TABLE:
        raise SharpiError(f"unsupported model architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHS)})")
    emb = gf.tensor("token_embd.weight")
    n_vocab = int(gf.arch_get("vocab_size", 0) or int(emb.shape[1]) or gf.array_len("tokenizer.ggml.tokens"))
    kw = _common(gf, n_vocab)
    kw.update(ARCH_TABLE[arch])
    if arch == "gemma3":
        kw["embed_scale"] = kw["n_embd"] ** 0.5
        kw["sliding_window"] = int(gf.arch_get("attention.sliding_window", 0) or 0)
        kw["attn_scale"] = 1.0 / kw["head_dim_k"] ** 0.5
    return ModelConfig(**kw)
