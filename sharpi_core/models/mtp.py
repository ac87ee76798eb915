"""A model's own next-token-prediction (MTP / NextN) block as a draft head: Qwen3.5 / 3.6 (dense and mixtures of
experts) ship one after the layers the main graph runs (blk.{n_layer}: llama.cpp loads it with --spec-type draft-mtp,
src/models/qwen35.cpp's and qwen35moe.cpp's graph_mtp, which this follows operation for operation).

The head reads a token and a hidden row: at position p, the token x_p and h_{p-1}, the target's final-normed stream
at p - 1 (what its output layer read to predict x_p; zeros before the first). e = embed(x_p) and h are RMS-normed
(enorm, hnorm), concatenated [e, h] and projected back to n_embd (eh_proj), then go through one gated attention
layer of the target's kind (its own one-layer KV cache) and its FFN; the result, normed by shared_head_norm (else
the target's output norm), is both the head's hidden row h' and, through shared_head_head (else the target's output
layer), logits for x_{p+1}. Drafting chains it: (x_{p+1}, h') at p + 1 gives x_{p+2}, and so on.
"""
from __future__ import annotations

import torch

from ..errors import SharpiError
from ..gguf_file import GGUFFile
from ..kv_cache import KVCache
from ..quants import Activations, load_vector
from .config import QWEN35_ARCHS, layer_shapes
from .transformer import Transformer, _weight, check_pass, prompt_pass, rms_norm

# architectures whose MTP block sharpi runs
MTP_ARCHS = QWEN35_ARCHS


def mtp_tensors(target: Transformer):
    """(name, GGUF shape, required) of the MTP block's tensors."""
    c = target.config
    b, D = f"blk.{c.n_layer}.nextn.", c.n_embd
    for name, shape in layer_shapes(c, c.n_layer):
        yield name, shape, True
    yield from ((b + "eh_proj.weight", (2 * D, D), True), (b + "enorm.weight", (D,), True),
                (b + "hnorm.weight", (D,), True), (b + "shared_head_norm.weight", (D,), False),
                (b + "embed_tokens.weight", (D, c.n_vocab), False), (b + "shared_head_head.weight", (D, c.n_vocab), False))


def mtp_unavailable(target: Transformer) -> str | None:
    """Why target has no MTP head sharpi can run (one line), or None."""
    c, gf = target.config, target.gguf
    if c.arch not in MTP_ARCHS:
        return f"{gf.path}: a {c.arch} model has no next-token-prediction head sharpi runs (those of: {', '.join(MTP_ARCHS)})"
    if c.n_layer_nextn < 1:
        return f"{gf.path}: the model has no next-token-prediction (MTP) layer (nextn_predict_layers is 0)"
    if c.n_layer_nextn > 1:
        return f"{gf.path}: {c.n_layer_nextn} next-token-prediction layers (one is supported, as llama.cpp's qwen35)"
    for name, shape, required in mtp_tensors(target):
        t = gf.tensors.get(name)
        if t is None:
            if required:
                return f"{gf.path}: the MTP layer's tensor '{name}' is missing (converted without it?)"
            continue
        if tuple(int(n) for n in t.shape) != shape:
            return f"{gf.path}: tensor '{name}' has shape {tuple(int(n) for n in t.shape)}, not {shape}"
    return None


class MtpHead:
    def __init__(self, target: Transformer):
        why = mtp_unavailable(target)
        if why:
            raise SharpiError(why)
        gf: GGUFFile = target.gguf
        c = target.config
        self.target, self.config = target, c
        self.index = c.n_layer  # (the layer index its RoPE, window and traces go by)
        b = f"blk.{c.n_layer}.nextn."
        opt = lambda name: name in gf.tensors  # noqa: E731
        self.layer = target.attention_layer(gf, c.n_layer)
        self.eh_proj = _weight(gf, b + "eh_proj.weight")  # [D, 2 * D]
        self.enorm, self.hnorm = load_vector(gf.tensor(b + "enorm.weight")), load_vector(gf.tensor(b + "hnorm.weight"))
        self.head_norm = load_vector(gf.tensor(b + "shared_head_norm.weight")) if opt(b + "shared_head_norm.weight") \
            else target.output_norm
        self.embd = _weight(gf, b + "embed_tokens.weight") if opt(b + "embed_tokens.weight") else target.tok_embd
        self.output = _weight(gf, b + "shared_head_head.weight") if opt(b + "shared_head_head.weight") else target.output

    @property
    def weight_bytes(self) -> int:
        ly = self.layer
        own = [ly.wqk, ly.wv, ly.wo, ly.w_gu, ly.w_down, ly.wgate, self.eh_proj, *(ly.experts.weights() if ly.experts else ())]
        own += [w for w in (self.embd, self.output) if w is not self.target.tok_embd and w is not self.target.output]
        return sum(w.nbytes for w in own if w is not None)

    def pack_weights(self) -> None:
        ly = self.layer
        for w in (ly.wqk, ly.wv, ly.wo, ly.w_gu, ly.w_down, ly.wgate, self.eh_proj, self.output,
                  *(ly.experts.weights() if ly.experts else ())):
            if w is not None:
                w.pack()

    def new_cache(self, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> KVCache:
        c = self.config
        return KVCache(1, n_ctx, c.n_head_kv, c.head_dim_k, c.head_dim_v, type_k, type_v)

    @torch.inference_mode()
    def forward(self, tokens, h: torch.Tensor, start_pos: int, cache: KVCache, last_n: int | None = None,
                decode: bool = False, kv_only: bool = False, n_out: int | None = None):
        """tokens [T] at positions start_pos.. with the hidden rows h [T, D] before them -> (logits [T or last_n,
        n_vocab or n_out], the head's hidden rows [T, D]), appending T K/V entries to cache. kv_only: the cache
        entries only (None back): what later positions attend to. decode: as Transformer.forward."""
        t, c = self.target, self.config
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        T = tokens.shape[0]
        check_pass(start_pos, T, cache)
        prompt = prompt_pass(T, decode)
        e = rms_norm(self.embd.rows(tokens), self.enorm, c.norm_eps)  # [T, D]
        hn = rms_norm(h.to(torch.float32).contiguous(), self.hnorm, c.norm_eps)  # [T, D]
        x = Activations(torch.cat((e, hn), dim=1), prompt)(self.eh_proj)  # [T, D] (ggml_concat: e first)
        i, ly, L = self.index, self.layer, start_pos + T
        rope = c.layer_rope(i)
        ropes = {rope: t._rope_table(rope, L)[start_pos:L]}
        window = c.sliding_window if c.is_swa(i) else 0
        a = rms_norm(x, ly.attn_norm, c.norm_eps)
        mask = None if kv_only else t._mask(start_pos, T, window)  # (a catch-up over a prompt attends to nothing)
        o = t._attention_block(ly, i, 0, a, start_pos, cache, ropes, None, window, mask, prompt, kv_only=kv_only)
        cache.length = L
        if kv_only:
            return None
        x = t._ffn_block(ly, i, x + o, prompt)  # (every row, as graph_mtp: its rows are cut after the head norm)
        hout = rms_norm(x, self.head_norm, c.norm_eps)  # [T, D]
        rows = hout if last_n is None else hout[-last_n:]
        head = self.output if n_out is None or n_out >= c.n_vocab else self.output.head(n_out)
        return t.finish_logits(head(rows, prompt)), hout
