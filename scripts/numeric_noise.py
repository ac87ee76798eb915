#!/usr/bin/env python3
"""How far one float rounding moves the logits, with and without llama.cpp's activation rounding.

    python scripts/numeric_noise.py [-m MODEL] [--eps 1e-7]

Perturbs the token embeddings by a relative `eps` (about one float32 ulp) and reports the largest
relative change of the logits over a short prompt. With activations rounded to 8 bits before every
matmul (as llama.cpp's CPU backend does, SHARPI_ACT_QUANT=1) a one-ulp change flips some roundings
and moves logits by percents; with fp32 activations it stays far smaller. This is the noise floor
any comparison of greedy text with llama.cpp has to live with.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(model: str, eps: float) -> float:
    sys.path.insert(0, str(ROOT))
    import torch

    from sharpi_core import quants
    from sharpi_core.gguf_file import GGUFFile
    from sharpi_core.models import load_model
    from sharpi_core.registry import resolve_model
    from sharpi_core.tokenizer import Tokenizer

    gf = GGUFFile(resolve_model(model))
    m, tok = load_model(gf), Tokenizer.from_gguf(gf)
    ids = torch.tensor(tok.encode("The capital of France is Paris. The United States has a population of"))
    orig = quants.QWeight.rows
    outs = []
    for e in (0.0, eps):
        g = torch.Generator().manual_seed(1)
        quants.QWeight.rows = lambda self, i, e=e, g=g: (lambda r: r * (1 + e * torch.randn(r.shape, generator=g)))(orig(self, i))
        outs.append(m.forward(ids, 0, m.new_cache(len(ids))))
    quants.QWeight.rows = orig
    a, b = outs
    return float(((a - b).abs().amax(-1) / a.abs().amax(-1)).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct-q4_1")
    ap.add_argument("--eps", type=float, default=1e-7)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(measure(a.model, a.eps))
        return
    for aq in ("1", "0"):  # the switch is read at import, so each setting runs in its own process
        out = subprocess.run([sys.executable, __file__, "--child", "-m", a.model, "--eps", str(a.eps)],
                             capture_output=True, text=True, env=dict(os.environ, SHARPI_ACT_QUANT=aq), check=True)
        label = "8-bit activation rounding (llama.cpp)" if aq == "1" else "fp32 activations"
        print(f"{a.model}: {label}: a {a.eps:g} relative input change moves logits by up to "
              f"{100 * float(out.stdout.strip()):.3f}%")


if __name__ == "__main__":
    main()
