#!/usr/bin/env python3
"""Where do sharpi's intermediate values leave llama.cpp's? Layer by layer, on one prompt pass.

    # 1. let llama.cpp dump every fp32 tensor of the prompt pass (scripts/llamacpp_logits.c, built
    #    as scripts/compare_llamacpp_logits.py builds it; LCP_FLASH_ATTN=0 for the non-FA path)
    LCP_FLASH_ATTN=0 LCP_DUMP=/tmp/dump ./llamacpp_logits MODEL.gguf 1 2 ID ID ...
    # 2. run sharpi on the same ids and compare
    python scripts/compare_llamacpp_layers.py -m NAME --dump /tmp/dump --ids ID,ID,...

Per layer and llama.cpp graph name (attn_norm, kqv_out, ffn_inp, ffn_norm, ffn_swiglu, ffn_out,
l_out) it prints the largest difference relative to the largest |value| and, in brackets, the
fraction of elements that are bit-identical: 1.00 where sharpi reproduces llama.cpp's arithmetic
exactly. The activations are rounded to 8 bits before every matmul, so one ulp of difference
grows by orders of magnitude within a few layers; the first column below 1.00 is the op to fix.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sharpi_core.gguf_file import GGUFFile  # noqa: E402
from sharpi_core.models import load_model  # noqa: E402
from sharpi_core.registry import resolve_model  # noqa: E402

NAMES = ("attn_norm", "kqv_out", "ffn_inp", "ffn_norm", "ffn_swiglu", "ffn_out", "l_out")


def read_index(dump: Path) -> dict[str, tuple[str, int]]:
    """graph name -> (file stem, row length) of its first plain (not view / reshape) tensor"""
    idx: dict[str, tuple[str, int]] = {}
    for line in (dump / "index.txt").read_text().splitlines():
        parts = line.split()
        if len(parts) < 3 or "(" in line:
            continue
        idx.setdefault(parts[1], (parts[0], int(parts[2])))
    return idx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, help="registry name or GGUF path")
    ap.add_argument("--dump", required=True, type=Path, help="LCP_DUMP directory of llamacpp_logits")
    ap.add_argument("--ids", required=True, help="comma-separated token ids, as given to llamacpp_logits")
    args = ap.parse_args()
    ids = [int(t) for t in args.ids.split(",")]
    idx = read_index(args.dump)
    model = load_model(GGUFFile(resolve_model(args.model)))
    ours: dict[str, np.ndarray] = {}
    model.trace = lambda name, t: ours.setdefault(name, t.detach().reshape(t.shape[0], -1).numpy().copy())
    model.forward(torch.tensor(ids), 0, model.new_cache(max(512, len(ids))), last_n=1)
    for i in range(model.config.n_layer):
        row = []
        for k in NAMES:
            name = f"{k}-{i}"
            if name not in idx or name not in ours:
                row.append(f"{k} -")
                continue
            stem, width = idx[name]
            ref = np.fromfile(args.dump / f"{stem}.bin", dtype=np.float32).reshape(-1, width)
            a = ours[name]
            if a.shape != ref.shape:
                row.append(f"{k} shape {a.shape} vs {ref.shape}")
                continue
            rel = np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-30)
            row.append(f"{k} {rel:.1e} [{(a == ref).mean():.2f}]")
        print(i, "  ".join(row))


if __name__ == "__main__":
    main()
