#!/usr/bin/env python3
"""llama.cpp's greedy tokens on the derived architectures: the oracle of tests/test_archs.py.

    python scripts/llamacpp_archs.py LLAMA_CPP_SRC BIN_DIR [-o tests/data/llamacpp_archs.json] [--variants V,...]

(--variants: record those again, keeping the other variants' cases of the output file.)

No Qwen3, Llama 3.1 or SmolLM3 GGUF can be downloaded here, so scripts/gguf_derive.py makes them from
SmolLM2's weights (qwen3: q/k norms and NeoX RoPE; llama3: rope_freqs; smollm3: NoPE layers; lowbit:
Q3_K / Q2_K / IQ4_XS / Q5_K ffn_down, Q4_0 / IQ4_NL attention weights; phi3: fused attn_qkv and ffn_up,
longrope factors and attention factor; granite: its four scales; mistral3, float, five MoE graphs (gpt-oss: sinks, biases, MXFP4 experts; qwen2moe: a gated shared expert; granitemoe), fused-qkv, exaone; lfm2: short
convolutions between attention layers; qwen35: Gated DeltaNet layers between gated attention layers; mixed: types
mixed within q / k and gate / up) and Gemma 3's (gemma2: softcaps, its sliding-window pattern). libllama (scripts/llamacpp_logits.c, as
compare_llamacpp_logits.py builds it) then decodes each case greedily: the fixture prompts, a prompt of
~300 tokens (prompt batches through llama.cpp's tiled flash attention, positions where rope_freqs'
low-frequency factors matter), and a run through context shifts (the K-shift rotates by the same
factors; LCP_SHIFT_COMPACT keeps the cells in position order, as sharpi does; see
llamacpp_context_shift.py). The derivation is deterministic, so the test derives the same files.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from compare_llamacpp_logits import FIXTURES_DIR, build, oracle_args  # noqa: E402
from gguf_derive import DEFAULT_SOURCE, SOURCE_MODEL, VARIANTS, derive  # noqa: E402
from llamacpp_context_shift import keep_count  # noqa: E402
from sharpi_core.gguf_file import GGUFFile  # noqa: E402
from sharpi_core.registry import resolve_model  # noqa: E402
from sharpi_core.tokenizer import Tokenizer  # noqa: E402

SOURCE = DEFAULT_SOURCE  # the fixture prompts are its (text only: every variant takes them)
TOP_LOGITS = 8  # logits recorded at a few steps of each case without a context shift: ids and values
LONG_CHARS = 1300  # of the Apache license text: ~300 tokens
SHIFT_PROMPTS = {"lowbit": "In the year 1850,"}  # (lowbit ends the Roman Empire's generation before 420 tokens)


def cases(variant: str) -> list[dict]:
    """(kind, prompt, n_ctx, tokens to generate, --keep or None: no context shift). No shift for smollm3:
    llama.cpp's K-shift rotates the K of its NoPE layers too (hparams.has_rope reads a rope_pattern that
    smollm3's loader leaves all ones), which sharpi does not copy (tests/test_archs.py checks its own). Nor
    for lfm2 and qwen35 / qwen35moe (recurrent): LCP_SHIFT_COMPACT's decode-then-take-back goes through a recurrent-state
    rollback that llama.cpp's sequence state does not carry (its convolution state then holds that token twice), and
    without it the tokens after a shift land in the freed cells (another attention order: the logits move
    by ~0.7 on qwen3's derivative too); tests/test_archs.py checks the shift's convolution state. Nor for qwen3vl /
    qwen3vlmoe / qwen2vl: llama.cpp shifts no M-RoPE cache (llama_kv_cache::get_can_shift)."""
    ref = json.loads((FIXTURES_DIR / "llamacpp_reference.json").read_text())[SOURCE]["greedy"]
    out = [dict(kind="fixture", prompt=c["prompt"], n_ctx=512, n_gen=32, keep=None) for c in ref]
    out.append(dict(kind="long", prompt=(FIXTURES_DIR / "apache-2.0.txt").read_text()[:LONG_CHARS], n_ctx=512,
                    n_gen=48, keep=None))
    if variant not in ("smollm3", "lfm2", "qwen35", "qwen35moe", "qwen3vl", "qwen3vlmoe", "qwen2vl"):
        out.append(dict(kind="shift", prompt=SHIFT_PROMPTS.get(variant, "The history of the Roman Empire"), n_ctx=256,
                        n_gen=420, keep=0))
    return out


def main() -> None:
    args = oracle_args(__doc__, "llamacpp_archs.json", lambda ap: ap.add_argument(
        "--variants", help="comma-separated: record only these, keeping the other variants' cases of the output file"))
    only = args.variants.split(",") if args.variants else list(VARIANTS)
    if set(only) - set(VARIANTS):
        raise SystemExit(f"unknown variants: {sorted(set(only) - set(VARIANTS))}")
    kept = json.loads(args.out.read_text())["cases"] if args.variants else []
    out = [c for c in kept if c["variant"] not in only]
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(args.src, args.bin, Path(tmp))
        for variant in only:
            path = Path(tmp) / f"{variant}.gguf"
            derive(variant, str(resolve_model(SOURCE_MODEL.get(variant, SOURCE))), str(path))
            gf = GGUFFile(path)
            tok = Tokenizer.from_gguf(gf)
            n_vocab = len(gf.get("tokenizer.ggml.tokens"))
            for case in cases(variant):
                ids = tok.encode(case["prompt"])
                n_gen = case["n_gen"]
                env = {**os.environ, "LCP_N_CTX": str(case["n_ctx"])}
                if case["keep"] is not None:
                    n_keep = keep_count(case["keep"], len(ids), tok.add_bos, case["n_ctx"])
                    env.update(LCP_SHIFT_KEEP=str(n_keep), LCP_SHIFT_COMPACT="1")
                raw = subprocess.run([str(exe), str(path), str(n_gen), str(args.t), *map(str, ids)],
                                     capture_output=True, check=True, env=env).stdout
                lg = np.frombuffer(raw[: (n_gen + 1) * n_vocab * 4], dtype=np.float32).reshape(n_gen + 1, -1)
                chosen = np.frombuffer(raw[(n_gen + 1) * n_vocab * 4:], dtype=np.int32).tolist()
                # the oracle is the token path while it runs: an end of generation stops sharpi there
                eog = next((i for i, t in enumerate(chosen) if t in tok.eog_ids), None)
                if case["keep"] is not None and eog is not None:
                    raise SystemExit(f"{variant} {case['prompt']!r}: the shift case ends its generation: choose another prompt")
                if eog is not None:  # (sharpi's result holds the tokens before it, as llama.cpp's text does)
                    chosen = chosen[:eog]
                top2 = np.sort(lg[: len(chosen) + (eog is not None)], axis=1)[:, -2:]
                out.append({"variant": variant, **case, "prompt_ids": ids, "tokens": chosen,
                            "min_top2_gap": float((top2[:, 1] - top2[:, 0]).min())})
                if case["keep"] is None:  # the values too (a softcap or a scale changes them, not the order)
                    steps = sorted({0, len(chosen) // 2, len(chosen)})
                    top = [np.argsort(-lg[s], kind="stable")[:TOP_LOGITS] for s in steps]
                    out[-1]["top_logits"] = [[s, t.tolist(), lg[s][t].tolist()] for s, t in zip(steps, top)]
                print(f"{variant} {case['kind']}: {len(ids)} + {len(chosen)} tokens, min top-2 gap "
                      f"{out[-1]['min_top2_gap']:.3g}: {tok.decode(chosen)[:60]!r}", file=sys.stderr)
    args.out.write_text(json.dumps({"llama_cpp": "llama_cpp_python 0.3.36 vendor tree, scripts/llamacpp_logits.c",
                                    "source": SOURCE, "cases": out}, indent=None) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
