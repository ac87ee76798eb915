#!/usr/bin/env python3
"""llama.cpp's greedy text with LoRA adapters: the oracle of tests/test_lora.py.

    python scripts/llamacpp_lora.py BIN_DIR [-o tests/data/llamacpp_lora.json]

Writes seeded random LoRA adapters (write_adapter: the test rebuilds the same files) for SmolLM2 (llama)
Qwen2.5-Coder 0.5B (qwen2: q and k rows in RoPE-pair order on the CPU path, biases after the update) and
the olmo2 model scripts/gguf_derive.py makes from SmolLM2 (an output layer of its own: adapters on the token
embedding and the output layer) and records what llama-completion (BIN_DIR, greedy, -n 24) prints after each prompt with --lora and
--lora-scaled, and without any (the model's own text, which every case must differ from); and
llama-perplexity's result with adapters on the fixtures' text (sharpi perplexity --lora).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from compare_llamacpp_logits import FIXTURES_DIR  # noqa: E402
from gguf_derive import finish  # noqa: E402
from llamacpp_control_vector import N_PREDICT, bin_args, complete, fill, run, write_vector  # noqa: E402

SMOL, QWEN, OLMO2 = "smollm2-135m-instruct-q4_1", "qwen2.5-coder-0.5b-instruct-q4_k_m", "olmo2"
PROMPTS = {SMOL: ["The capital of France is", "Once upon a time, in a small village by the sea,"],
           QWEN: ["def fibonacci(n):"], OLMO2: ["The capital of France is"]}
ALL = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# name -> (arch, seed, GGUF type of A and B, rank, alpha (0: none), weights, layers, std of B, extra tensors)
ADAPTERS = {
    "a": ("llama", 1, "F16", 8, 16.0, ALL, range(30), 0.05, ()),
    "b": ("llama", 2, "F32", 4, 0.0, ("attn_q", "attn_v"), range(0, 30, 3), 0.08, ("blk.0.attn_norm.weight",)),
    "c": ("llama", 3, "Q8_0", 32, 32.0, ("attn_output", "ffn_down"), range(5, 25), 0.02, ()),
    "f": ("llama", 9, "BF16", 8, 16.0, ("attn_q", "ffn_down"), range(30), 0.05, ()),
    "q": ("qwen2", 4, "F16", 8, 8.0, ("attn_q", "attn_k", "attn_v"), range(24), 0.1, ()),
    # (token_embd and output: whole-model pairs; the embedding's flipped, A [n_vocab, r] and B [n_embd, r])
    "e": ("olmo2", 5, "F16", 16, 16.0, ("attn_v", "ffn_up"), range(0, 30, 2), 0.05, ("token_embd", "output")),
}
SHAPES = {"llama": dict(D=576, F=1536, H=9, Hkv=3, hd=64, V=49152), "qwen2": dict(D=896, F=4864, H=14, Hkv=2, hd=64, V=151936)}
SHAPES["olmo2"] = SHAPES["llama"]
# (model, the LoRA flags as llama-completion and sharpi both take them ({a}, ...: the files))
CASES = [
    (SMOL, ["--lora", "{a}"]),
    (SMOL, ["--lora-scaled", "{a}:0.5"]),
    (SMOL, ["--lora", "{a},{b}"]),
    (SMOL, ["--lora", "{b}", "--lora-scaled", "{c}:-1.5"]),
    (SMOL, ["--lora", "{f}"]),
    (QWEN, ["--lora", "{q}"]),
    (OLMO2, ["--lora-scaled", "{e}:0.75"]),
]
# llama-perplexity on SmolLM2 with the fixtures' text and arguments (-c 128 --chunks 8 -b 128)
# ({v}: llamacpp_control_vector.py's vector "a": perplexity takes control vectors too)
PPL_CASES = [["--lora", "{a}"], ["--lora-scaled", "{b}:2,{c}:-1"], ["--lora", "{c}", "--control-vector-scaled", "{v}:0.5"]]
PPL_TEXT = FIXTURES_DIR / "apache-2.0.txt"


def _dims(arch: str, weight: str) -> tuple[int, int]:
    """(N, K) of a layer weight."""
    s = SHAPES[arch]
    D, F, q, kv = s["D"], s["F"], s["H"] * s["hd"], s["Hkv"] * s["hd"]
    return {"attn_q": (q, D), "attn_k": (kv, D), "attn_v": (kv, D), "attn_output": (D, q),
            "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}[weight]


def write_adapter(path: Path, name: str) -> None:
    """Adapter `name` of ADAPTERS: A ~ N(0, 1/K) [r, K], B ~ N(0, std^2) [N, r] per weight and layer."""
    arch, seed, qt, r, alpha, weights, layers, std, extra = ADAPTERS[name]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", "adapter")
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    if alpha:
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    qtype = gguf.GGMLQuantizationType[qt]

    def add(tname: str, a: np.ndarray) -> None:
        a = a.astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(tname, a)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(tname, a.astype(np.float16))
        else:
            w.add_tensor(tname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    for il in layers:
        for wn in weights:
            n, k = _dims(arch, wn)
            add(f"blk.{il}.{wn}.weight.lora_a", rng.standard_normal((r, k)) / np.sqrt(k))
            add(f"blk.{il}.{wn}.weight.lora_b", rng.standard_normal((n, r)) * std)
    D, V = SHAPES[arch]["D"], SHAPES[arch]["V"]
    for tname in extra:
        if tname == "token_embd":
            add("token_embd.weight.lora_a", rng.standard_normal((V, r)))  # (rows taken by token id)
            add("token_embd.weight.lora_b", rng.standard_normal((D, r)) * std * 0.1)
        elif tname == "output":
            add("output.weight.lora_a", rng.standard_normal((r, D)) / np.sqrt(D))
            add("output.weight.lora_b", rng.standard_normal((V, r)) * std)
        else:  # (norms in an adapter: llama.cpp skips them)
            w.add_tensor(tname, np.ones(D, np.float32))
    finish(w)


def main() -> None:
    a = bin_args(__doc__, "llamacpp_lora.json")
    from gguf_derive import derive

    from sharpi_core.registry import resolve_model
    out = {"llama_cpp": "llama_cpp_python 0.3.36 vendor tree, llama-completion", "n_predict": N_PREDICT, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        models = {SMOL: resolve_model(SMOL), QWEN: resolve_model(QWEN), OLMO2: Path(tmp) / "olmo2.gguf"}
        derive("olmo2", str(models[SMOL]), str(models[OLMO2]))
        files = {n: Path(tmp) / f"{n}.gguf" for n in ADAPTERS}
        for n, p in files.items():
            write_adapter(p, n)
        files["v"] = Path(tmp) / "v.gguf"
        write_vector(files["v"], "a")
        for model, flags in CASES:
            for prompt in PROMPTS[model]:
                plain = complete(a.bin, models[model], prompt, [])
                text = complete(a.bin, models[model], prompt, fill(flags, files))
                print(f"{model} {prompt!r} {' '.join(flags)}: {text!r}")
                assert text != plain, f"{flags}: the same text as without adapters"
                out["cases"].append({"model": model, "prompt": prompt, "flags": flags, "text": text, "plain": plain})
        out["perplexity"] = []
        for flags in PPL_CASES:
            r = run(a.bin, "llama-perplexity", ["-m", models[SMOL], "-f", PPL_TEXT, "-c", "128", "--chunks", "8",
                                                "-b", "128", "-t", "2", *fill(flags, files)])
            line = [ln for ln in r.stderr.splitlines() + r.stdout.splitlines() if "Final estimate: PPL = " in ln]
            if not line:
                raise SystemExit(f"llama-perplexity {' '.join(flags)}: no final estimate\n{r.stderr[-2000:]}")
            ppl, err = line[-1].split("PPL = ")[1].split(" +/- ")
            print(f"perplexity {' '.join(flags)}: {ppl} +/- {err}")
            out["perplexity"].append({"flags": flags, "ppl": float(ppl), "err": float(err)})
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
