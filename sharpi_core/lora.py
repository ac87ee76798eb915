"""LoRA adapters (llama.cpp's --lora / --lora-scaled): low-rank updates of a model's weights at run time.

An adapter GGUF (general.type "adapter", adapter.type "lora", general.architecture the model's) holds
pairs `<weight name>.lora_a` [r, K] and `<weight name>.lora_b` [N, r] (numpy shapes) for weights
W [N, K] of the base model. A weight with a pair computes W x + s * B (A x), s = scale * alpha / r
(alpha: adapter.lora.alpha; 0 or absent: s = scale), after its own matmul and before its bias, one
adapter after another in the order given (llama.cpp's build_lora_mm). As on llama.cpp's CPU backend,
A's input and B's input are rounded to the types A and B multiply in (f16 for F16 tensors, q8_0 blocks
for Q8_0 ones, none for F32). For the token embedding the pair is flipped, A [n_vocab, r] and
B [n_embd, r]: the rows of A of the pass's tokens times B, added to the embedding rows (build_inp_embd).

llama.cpp's rules (llama_adapter_lora_init_impl): tensors named `*_norm.weight` are skipped, any other
name must end in .lora_a / .lora_b; each pair needs both halves, a weight of the base model, and shapes
that fit it. Here the weights an adapter may touch are those the CPU model multiplies one by one: q, k,
v, output projections, gate, up and down of attention layers with separate tensors, and the output
layer and token embedding of a model that does not tie them (llama.cpp fails on a tied one).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import gguf
import numpy as np

from sharpi_core.control_vector import open_gguf
from sharpi_core.control_vector import parse_scaled as _parse_scaled
from sharpi_core.errors import UsageError

Q = gguf.GGMLQuantizationType
TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0)  # what convert_lora_to_gguf.py writes (--outtype)


def parse_scaled(values: Sequence[str]) -> list[tuple[str, float]]:
    """--lora-scaled FNAME:SCALE,... (the flag may repeat) -> [(path, scale)]."""
    return _parse_scaled(values, "--lora-scaled")


class Factor:
    """One factor of a pair (A or B) as a weight [n, k], multiplied as llama.cpp's CPU backend multiplies it:
    f16 ones by kernels.cpu.f16_mm (ggml's orders at any width: ranks are often 8 or 16), the other types as
    any weight of theirs (quants.QWeight: the input rounded to the type's vec_dot type, ggml's orders where
    the kernels take the shape)."""

    def __init__(self, name: str, qtype, raw: np.ndarray, rows=None):
        from sharpi_core.quants import QWeight
        if rows is not None:
            raw = raw[np.asarray(rows)]
        raw = np.ascontiguousarray(raw)
        self.qtype, self.n = qtype, int(raw.shape[0])
        bs, bb = gguf.GGML_QUANT_SIZES[qtype]
        self.k = int(raw.shape[1]) // bb * bs if raw.dtype == np.uint8 else int(raw.shape[1])  # (blocks as bytes)
        if qtype == Q.F16:
            import torch
            self.w16, self.qw = torch.from_numpy(raw.view(np.float16)), None  # [n, k]
        else:
            self.w16, self.qw = None, QWeight(name, raw, qtype, self.n, self.k)

    def __call__(self, x, prompt: bool = False):
        """x fp32 [T, k] -> [T, n]."""
        if self.qw is not None:
            return self.qw(x, prompt)
        from sharpi_core.kernels import cpu
        if cpu.available():
            return cpu.f16_mm(x.contiguous(), self.w16, prompt)
        from sharpi_core.quants import decoding_rows
        w = self.w16.float()  # (no compiled kernels: close, not ggml's bits)
        return decoding_rows(lambda v: v.half().float() @ w.T, prompt, x)

    def rows(self, ids):
        """Rows ids as fp32 (ggml_get_rows: the token embedding's A)."""
        from sharpi_core.quants import reference_dequantize
        if self.qw is None:
            return self.w16[ids].float()
        return reference_dequantize(np.asarray(self.qw.raw)[ids.numpy()], self.qtype).view(len(ids), self.k)

    def head(self, m: int) -> Factor:
        """The first m rows."""
        f = object.__new__(Factor)
        f.qtype, f.n, f.k = self.qtype, m, self.k
        f.w16 = None if self.w16 is None else self.w16[:m]
        f.qw = None if self.qw is None else self.qw.head(m)
        return f


class LoraTerm:
    """One adapter's update of output rows [off, off + b.n) of a weight: y[..., off:off+n] += s * B (A x)
    (Factors a [r, K] and b [n, r], b's rows in the weight's row order)."""

    __slots__ = ("a", "b", "off", "scale")

    def __init__(self, a: Factor, b: Factor, off: int, scale: float):
        self.a, self.b, self.off, self.scale = a, b, off, scale

    def add(self, x, y, prompt: bool = False):
        """y (x's product with the weight, [T, N]) plus this update, in place."""
        d = self.b(self.a(x, prompt), prompt)  # [T, n]
        y[..., self.off:self.off + self.b.n] += d * self.scale  # (ggml_scale, then ggml_add)
        return y

    def head(self, n: int) -> LoraTerm | None:
        """The update of the weight's first n rows (its cut output layer), None if it has none there."""
        m = min(n - self.off, self.b.n)
        return None if m <= 0 else LoraTerm(self.a, self.b.head(m), self.off, self.scale)

    def add_rows(self, tokens, x, prompt: bool = False):
        """The embedding rows x [T, D] of tokens plus this update (a: A [n_vocab, r], b: B [D, r])."""
        return x + self.b(self.a.rows(tokens), prompt) * self.scale


def _factor(t, path: str, rows=None) -> Factor:
    if t.tensor_type not in TYPES:
        raise UsageError(f"LoRA {path}: '{t.name}' is {t.tensor_type.name} (supported: "
                         f"{', '.join(q.name for q in TYPES)})")
    return Factor(t.name, t.tensor_type, np.asarray(t.data), rows)


def _read(path: str, arch: str):
    """(alpha, {weight name: (lora_a tensor, lora_b tensor)}) of one adapter file, its metadata checked."""
    reader = open_gguf(path, "LoRA")

    def field(key: str):
        f = reader.fields.get(key)
        try:
            return None if f is None else f.contents()
        except UnicodeDecodeError as e:
            raise UsageError(f"LoRA {path}: metadata '{key}' holds a string that is not UTF-8 ({e.reason})") from None

    if field("general.type") != "adapter":
        raise UsageError(f"LoRA {path}: general.type is {field('general.type')!r}, not 'adapter'")
    if field("general.architecture") != arch:
        raise UsageError(f"LoRA {path}: an adapter for {field('general.architecture')!r}, the model is {arch!r}")
    if field(gguf.Keys.Adapter.TYPE) != "lora":
        raise UsageError(f"LoRA {path}: adapter.type is {field(gguf.Keys.Adapter.TYPE)!r}, not 'lora'")
    if field(gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS) is not None:
        raise UsageError(f"LoRA {path}: an activated LoRA (adapter.alora.invocation_tokens) is not supported")
    alpha = field(gguf.Keys.Adapter.LORA_ALPHA)
    if alpha is not None and (isinstance(alpha, (bool, np.bool_)) or not isinstance(alpha, numbers.Real)):
        raise UsageError(f"LoRA {path}: adapter.lora.alpha holds {str(alpha)[:40]!r}, not a number")
    alpha = float(alpha or 0.0)
    if not math.isfinite(alpha):  # (every product with it would be nan)
        raise UsageError(f"LoRA {path}: adapter.lora.alpha is {alpha}")
    pairs: dict[str, list] = {}
    for t in reader.tensors:
        for i, suffix in enumerate((".lora_a", ".lora_b")):
            if t.name.endswith(suffix):
                pairs.setdefault(t.name[:-len(suffix)], [None, None])[i] = t
                break
        else:
            if not t.name.endswith("_norm.weight"):  # (llama.cpp skips norms)
                raise UsageError(f"LoRA {path}: tensor '{t.name}' has an unexpected suffix")
    for name, (a, b) in pairs.items():
        if a is None or b is None:
            raise UsageError(f"LoRA {path}: the pair for '{name}' is missing its lora_{'a' if a is None else 'b'}")
        for t in (a, b):
            if len(t.shape) != 2:
                raise UsageError(f"LoRA {path}: '{t.name}' is not a matrix")
            if not all(int(d) for d in t.shape):  # (scale * alpha / rank: a rank of 0 divides by it)
                raise UsageError(f"LoRA {path}: '{t.name}' is empty (shape {[int(d) for d in t.shape]})")
    return alpha, pairs


def load(files: Sequence[tuple[str, float]], model) -> None:
    """The adapters of (path, scale) pairs, in order, put on the CPU model's weights (QWeight.loras and
    Transformer.embd_loras) instead of any loaded before (no files: none). A bad file raises UsageError
    before anything changes."""
    c = model.config
    targets = model.lora_targets()  # {weight name: (QWeight, first output row, row order or None)}
    terms: dict[int, list] = {}     # id(QWeight) -> [LoraTerm]
    embd = []
    for path, scale in files:
        alpha, pairs = _read(path, c.arch)
        for name, (ta, tb) in sorted(pairs.items()):
            (ka, ra), (kb, rb) = (int(s) for s in ta.shape[:2]), (int(s) for s in tb.shape[:2])  # GGUF [K, N] shapes
            if name == "token_embd.weight":  # A [n_vocab, r], B [D, r] (flipped)
                if c.tied_output:
                    raise UsageError(f"LoRA {path}: '{name}' on a model whose output layer shares it is not supported")
                if ra != c.n_vocab or rb != c.n_embd or ka != kb:
                    raise UsageError(f"LoRA {path}: '{name}' has incorrect shape (maybe another base model?)")
                if scale != 0:  # (checked, not applied: llama.cpp's common_set_adapter_lora skips scale 0)
                    embd.append(LoraTerm(_factor(ta, path), _factor(tb, path), 0, _scale(scale, alpha, kb)))
                continue
            if name not in targets:
                if name in model.gguf.tensors:
                    raise UsageError(f"LoRA {path}: '{name}' is a weight sharpi does not apply LoRA to")
                raise UsageError(f"LoRA {path}: '{name}' does not exist in the model (maybe another base model?)")
            w, off, rows = targets[name]
            if ka != w.k or rb != int(model.gguf.tensor(name).shape[1]):  # A [r, K], B [N, r]
                raise UsageError(f"LoRA {path}: '{name}' has incorrect shape (maybe another base model?)")
            if ra != kb:
                raise UsageError(f"LoRA {path}: '{name}': lora_a is not transposed (its rank is not lora_b's)")
            if scale != 0:
                terms.setdefault(id(w), []).append(LoraTerm(_factor(ta, path), _factor(tb, path, rows), off,
                                                            _scale(scale, alpha, kb)))
    for w, _, _ in targets.values():  # (the adapters given replace those loaded before)
        w.set_loras(terms.get(id(w), []))
    model.embd_loras = embd
    model.has_loras = bool(embd or terms)


def _scale(scale: float, alpha: float, rank: int) -> float:
    """llama.cpp's get_scale, in float32 arithmetic: scale * alpha / rank (alpha 0: scale)."""
    f = np.float32
    return float(f(f(scale) * f(alpha)) / f(rank)) if alpha else float(f(scale))
