#!/usr/bin/env python3
"""How far are sharpi's logits from llama.cpp's, step by step, on the fixture prompts?

    python scripts/compare_llamacpp_logits.py LLAMA_CPP_SRC BIN_DIR [-m NAME ...] [-n 16] [-t 2] [--kv TYPE [--kv-v TYPE]]

Compiles scripts/llamacpp_logits.c against a llama.cpp source tree (its include/ and
ggml/include/) and the libllama in BIN_DIR, lets llama.cpp decode each fixture prompt greedily
while writing every step's logits, then runs sharpi on the same token path (the prompt in one
pass, then llama.cpp's chosen tokens one at a time) and prints per step: the largest logit
difference relative to the largest |logit|, llama.cpp's top-2 margin (relative, as the engine-core
test measures it) and whether the two argmaxes agree. This measures how exactly sharpi reproduces
llama.cpp's arithmetic, below the level of which token wins; it never builds llama.cpp itself.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType as Q  # noqa: E402

from sharpi_core.choices import CACHE_TYPES  # noqa: E402
from sharpi_core.gguf_file import GGUFFile  # noqa: E402
from sharpi_core.models import load_model  # noqa: E402
from sharpi_core.registry import resolve_model  # noqa: E402
from sharpi_core.tokenizer import Tokenizer  # noqa: E402

# the fixtures beside the repository, or where SHARPI_FIXTURES says (as tests/conftest.py reads them)
FIXTURES_DIR = Path(os.environ.get("SHARPI_FIXTURES", ROOT.parent / "shared" / "fixtures"))
FIXTURES = FIXTURES_DIR / "llamacpp_reference.json"


def build(src: Path, bin_dir: Path, dest: Path, program: str = "llamacpp_logits") -> Path:
    """scripts/PROGRAM.c compiled into dest against a llama.cpp tree (its headers) and the libllama in bin_dir."""
    exe = dest / program
    cmd = ["cc", "-O2", "-o", str(exe), str(ROOT / "scripts" / f"{program}.c"),
           f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}", f"-L{bin_dir}", "-lllama", "-lggml", "-lggml-base",
           f"-Wl,-rpath,{bin_dir}"]
    subprocess.run(cmd, check=True)
    return exe


def oracle_args(doc: str, out_name: str, more=None) -> argparse.Namespace:
    """The arguments of the scripts that record a llama.cpp oracle in tests/data: SRC BIN [-o OUT] [-t N], and
    what more(parser) adds."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="llama.cpp source tree")
    ap.add_argument("bin", type=Path, help="llama.cpp build dir holding libllama")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "tests" / "data" / out_name)
    ap.add_argument("-t", type=int, default=2)
    if more is not None:
        more(ap)
    return ap.parse_args()


def fuzz_args(doc: str, lib: str, runs: int, runs_help: str, raw: bool = False) -> argparse.ArgumentParser:
    """The arguments the fuzz_* scripts share: SRC BIN [--seed] [--runs] [--log]; each adds its own."""
    ap = argparse.ArgumentParser(description=doc if raw else doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="llama.cpp source tree")
    ap.add_argument("bin", type=Path, help=f"llama.cpp build dir holding {lib}")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=runs, help=runs_help)
    ap.add_argument("--log", type=Path, help="write what differed here (JSON)")
    return ap


def margin(row: np.ndarray) -> float:
    a, b = np.sort(row)[-2:][::-1]
    return float((a - b) / max(abs(a), 1e-9))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="llama.cpp source tree")
    ap.add_argument("bin", type=Path, help="llama.cpp build dir holding libllama")
    ap.add_argument("-m", "--model", action="append")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--text", type=Path, help="also decode after this file's first --chars characters (a long "
                    "prompt: llama.cpp's tiled flash attention, and two KV chunks per decoding row past 256 tokens; "
                    "past 512 tokens both sides evaluate it in passes of 512, llama.cpp's default -ub)")
    ap.add_argument("--chars", type=int, default=1500)
    ap.add_argument("--kv", choices=CACHE_TYPES, default="f16", help="K and V cache type on both sides (-ctk / -ctv)")
    ap.add_argument("--kv-v", choices=CACHE_TYPES, help="V's cache type if not --kv's")
    ap.add_argument("--fa-off", action="store_true", help="both sides without flash attention (-fa off)")
    args = ap.parse_args()
    import json
    ref = json.loads(FIXTURES.read_text())
    type_v = args.kv_v or args.kv
    torch.set_num_threads(args.t)
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(args.src, args.bin, Path(tmp))
        for name in args.model or list(ref):
            path = resolve_model(name)
            gf = GGUFFile(path)
            model, tok = load_model(gf), Tokenizer.from_gguf(gf)
            model.flash_attn = not args.fa_off
            vocab = model.config.n_vocab
            print(f"## {name}")
            print("| prompt | step | max rel diff | llama.cpp top-2 margin | same argmax |")
            print("|---|---|---|---|---|")
            worst = []
            cases = list(ref[name]["greedy"])
            if args.text:
                cases.append({"prompt": args.text.read_text()[: args.chars]})
            for case in cases:
                ids = tok.encode(case["prompt"])
                n_ctx = max(512, (len(ids) + args.n + 255) // 256 * 256)
                out = subprocess.run([str(exe), str(path), str(args.n), str(args.t), *map(str, ids)],
                                     capture_output=True, check=True,
                                     env={**os.environ, "LCP_N_CTX": str(n_ctx), "LCP_TYPE_K": str(Q[args.kv.upper()].value),
                                          "LCP_TYPE_V": str(Q[type_v.upper()].value),
                                          **({"LCP_FLASH_ATTN": "0"} if args.fa_off else {})}).stdout
                lg = np.frombuffer(out[: (args.n + 1) * vocab * 4], dtype=np.float32).reshape(args.n + 1, -1)
                chosen = np.frombuffer(out[(args.n + 1) * vocab * 4:], dtype=np.int32).tolist()
                cache = model.new_cache(n_ctx, args.kv, type_v)
                for i in range(0, len(ids), 512):  # llama.cpp's ubatches of 512 (its default -ub), as sharpi's -ub splits
                    last = model.forward(torch.tensor(ids[i:i + 512]), i, cache, last_n=1)[-1]
                ours = [last]
                for t in chosen:
                    ours.append(model.forward(torch.tensor([t]), cache.length, cache)[-1])
                for step, (a, b) in enumerate(zip(ours, lg)):
                    a = a.numpy()[: len(b)]
                    rel = float(np.abs(a - b).max() / np.abs(b).max())
                    worst.append(rel)
                    same = int(a.argmax()) == int(b.argmax())
                    if step in (0, args.n) or not same or rel > 1e-3:
                        print(f"| {case['prompt'][:28]!r} | {step} | {rel:.2e} | {margin(b):.2e} | {same} |")
            print(f"median max-rel-diff over all steps: {np.median(worst):.2e}, worst {max(worst):.2e}\n")


if __name__ == "__main__":
    main()
