#!/usr/bin/env python3
"""Plain vs speculative decoding, side by side in one run (a benchmark, not a test).

    python scripts/bench_spec.py [--which all|qwen|lookup|ngram] [-n 128] [--ks 2,4,6] [--temps 0,0.7]
                                 [--vs-llama-cpp BIN_DIR] [--device cpu|cuda] [--cost off|on|both]
                                 [--qwen-prompts code,prose,deep] [--synth-lens 1,3,5]

(a) Qwen2.5-Coder-1.5B target + 0.5B draft, k in --ks, greedy and sampled, on a code prompt (and prose, and "deep":
the code request after ~1000 tokens of a module pasted into the conversation);
(b) SmolLM2 with --draft-lookup on echo-heavy prompts and on a no-copy prompt: "echo-heavy" asks
to copy a passage longer than the generation (-n 128 at most: every generated token can be copied), "partial echo"
a passage two thirds as long (the model goes on with text of its own after copying it);
(c) `--which ngram`: llama.cpp's n-gram drafters (--spec-type ngram-simple, ngram-map-k, ngram-mod as --spec-default
sets it, ngram-cache; their default sizes, a step verifying up to their 48 / 64 / 8 tokens) beside --draft-lookup (k 4), SmolLM2 and
Qwen 1.5B on the echo prompts (and Qwen on "deep"). SHARPI_SPEC_ADAPTIVE=0 in the environment verifies every token
they draft, as llama.cpp does (with --cost off).
Each configuration runs after a warm-up; plain and speculative alternate (ABBA) and the
table reports medians and their ratio, plus acceptance and tokens per target pass. With
--vs-llama-cpp, llama.cpp's plain decode (`llama-bench -p 0 -n N`) of the same target runs in
the same repetitions, and the last columns compare sharpi's speculative speed with it.

--synth-lens: the Qwen pair's speculative runs accept their proposals at random (--spec-synth-len L: L tokens a step on
average, the target's included), not by verifying them: the speed the verify and draft costs allow at an acceptance the
draft does not choose (1 = nothing accepted, k + 1 = everything); their output is not the model's. With
SHARPI_SPEC_ADAPTIVE=0 every step proposes k, as llama.cpp's.

--cost: the speculative runs speculate at every step (off, the mechanism alone), or where the measured
costs say it pays (on: speculative.SpecCost, what greedy sharpi does by default), or both side by side
(the cost-aware runs in the last columns, with the plain steps they chose and whether they turned
speculation off).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine_load import Load  # noqa: E402
from sharpi_core.engine import draft_head_vocab  # noqa: E402
from sharpi_core.generate import Generator  # noqa: E402
from sharpi_core.gguf_file import GGUFFile  # noqa: E402
from sharpi_core.models import load_model  # noqa: E402
from sharpi_core.registry import resolve_model  # noqa: E402
from sharpi_core.sampling import SamplingParams  # noqa: E402
from sharpi_core.speculative import DraftModelDrafter, LookupDrafter, NgramChain, ngram_sources  # noqa: E402
from sharpi_core.speculative.synthetic import resolve_rates  # noqa: E402
from sharpi_core.tokenizer import Tokenizer  # noqa: E402

CODE_PROMPT = "<|im_start|>user\nWrite a Python function that merges two sorted lists.<|im_end|>\n<|im_start|>assistant\n"
PASSAGE = ("The committee met on Tuesday to review the budget. After a long discussion, the members agreed to fund "
           "the new library, repair the bridge on Main Street, and hire two more teachers for the primary school. "
           "The mayor thanked the volunteers who had collected signatures all summer, and the treasurer promised a "
           "full report on the costs by the end of the month. The next meeting will be held in the town hall on "
           "the first Monday of March. Residents who wish to speak at that meeting should write to the clerk at least "
           "one week in advance, and written comments will be read aloud if the author cannot attend. Copies of the "
           "draft budget are available at the library and at the post office.")
ECHO_PROMPT = "Copy the following text exactly.\n\nText: " + PASSAGE + ("\n\nCopy: " + PASSAGE) + "\n\nCopy:"
PARTIAL_ECHO_PROMPT = ("Copy the following text exactly.\n\nText: The committee met on Tuesday to review the budget. "
               "After a long discussion, the members agreed to fund the new library, repair the bridge on "
               "Main Street, and hire two more teachers for the primary school.\n\nCopy: The committee met on "
               "Tuesday to review the budget. After a long discussion, the members agreed to fund the new "
               "library, repair the bridge on Main Street, and hire two more teachers for the primary school."
               "\n\nCopy:")
# prose from a code model: its draft agrees less often than on code
PROSE_PROMPT = ("<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a letter in a bottle."
                "<|im_end|>\n<|im_start|>assistant\n")


def _module(n: int = 20) -> str:
    """~1000 tokens of Python (small helpers of one module) for the deep prompt."""
    ops = [("scale", "v * factor", "times factor"), ("shift", "v + factor", "plus factor"),
           ("clamp", "min(max(v, -factor), factor)", "clamped to [-factor, factor]"),
           ("square", "v * v + factor", "squared, plus factor")]
    parts = []
    for i in range(n):
        name, expr, doc = ops[i % len(ops)]
        parts.append(f"def {name}_{i}(values, factor={i + 2}):\n    \"\"\"Each value {doc}, None skipped.\"\"\"\n"
                     f"    out = []\n    for v in values:\n        if v is not None:\n            out.append({expr})\n"
                     f"    return out\n")
    return "\n".join(parts)


# the code request after ~1000 tokens of conversation (a module pasted in): every pass attends over them, the verify
# pass's rows each as a one-token pass does (what speculation costs deep in a chat)
DEEP_PROMPT = ("<|im_start|>user\nHere is my module:\n```python\n" + _module() + "```\nThanks. Now, separately, write a "
               "Python function that merges two sorted lists.<|im_end|>\n<|im_start|>assistant\n")
QWEN_PROMPTS = {"code": CODE_PROMPT, "prose": PROSE_PROMPT, "deep": DEEP_PROMPT}
NOCOPY_PROMPT = "Once upon a time, in a kingdom far away, there lived a"


def load(name, device="cpu"):
    path = resolve_model(name)
    gf = GGUFFile(path)
    model = load_model(gf)
    if device == "cuda":
        from sharpi_core.backends.cuda_model import CudaTransformer
        model = CudaTransformer(model)
    return model, Tokenizer.from_gguf(gf)


def ignore_eos(params: SamplingParams, tok) -> SamplingParams:
    """The same sampling with end-of-generation tokens banned (llama.cpp's --ignore-eos): every run
    generates exactly n tokens, so speeds compare equal amounts of work."""
    return replace(params, logit_bias=tuple(params.logit_bias) + tuple((t, float("-inf")) for t in sorted(tok.eog_ids)))


def decode_tps(model, tok, prompt, n, params, drafter=None, k=4, seed=0, cost=False, synth=None):
    """cost: speculation by measured cost (SHARPI_SPEC_COST, read when the Generator is made); synth: a mean
    synthetic acceptance length (speculative.synthetic)."""
    saved = os.environ.get("SHARPI_SPEC_COST")
    os.environ["SHARPI_SPEC_COST"] = "1" if cost else "0"
    try:
        rates = resolve_rates(synth, None, k) if synth is not None and drafter is not None else None
        g = Generator(model, model.new_cache(2048), tok, ignore_eos(params, tok), seed=seed, drafter=drafter,
                      spec_n_max=k, synth_rates=rates)
    finally:
        if saved is None:
            del os.environ["SHARPI_SPEC_COST"]
        else:
            os.environ["SHARPI_SPEC_COST"] = saved
    r = g.generate(tok.encode(prompt), n_predict=n)
    return r.timings.eval_tps, r


def llama_bench_tg(bin_dir: str | None, model_name: str, n: int, threads: int) -> float | None:
    """llama.cpp's plain decode speed for the same GGUF (None when no binary was given)."""
    if not bin_dir:
        return None
    exe = Path(bin_dir) / "llama-bench"
    if not exe.exists():
        return None
    r = subprocess.run([str(exe), "-m", str(resolve_model(model_name)), "-p", "0", "-n", str(n), "-t", str(threads),
                        "-r", "1", "-o", "json"], capture_output=True, text=True)
    if r.returncode:
        return None
    rows = [row for row in json.loads(r.stdout) if row.get("n_gen")]
    return rows[0]["avg_ts"] if rows else None


def compare(label, model, tok, prompt, n, params, make_drafter, k, reps, peer=None, cost="off", synth=None):
    """peer: () -> llama.cpp plain t/s or None, run between sharpi's runs. cost: speculation always ("off"), by
    measured cost ("on"), or both side by side ("both": the last columns)."""
    decode_tps(model, tok, prompt, 8, params)  # warm-up
    sides = ["plain"] + (["spec"] if cost != "on" else []) + (["cost"] if cost != "off" else [])
    tps = {side: [] for side in sides}
    last = {}
    ref = []
    load = Load()
    for rep in range(reps):
        # the sides in turn, the order reversed in odd repetitions: a machine whose speed drifts during a
        # repetition favours none of them
        for side in (sides if rep % 2 == 0 else sides[::-1]):
            if side == "plain":
                tps[side].append(decode_tps(model, tok, prompt, n, params, seed=rep)[0])
            else:
                v, last[side] = decode_tps(model, tok, prompt, n, params, make_drafter(), k, seed=rep,
                                           cost=side == "cost", synth=synth)
                tps[side].append(v)
        if peer is not None:
            ref.append(peer())
    med = {side: statistics.median(v) for side, v in tps.items()}
    p = med["plain"]
    first = sides[1]
    s = med[first]
    st = last[first].spec.as_dict()
    ref = [r for r in ref if r]
    lc = statistics.median(ref) if ref else None
    peer_cols = f" {lc:.1f} | {s / lc:.2f}x |" if lc else " n/a | n/a |"
    steal, others = load.report()
    peer_cols += f" {steal:.2f}, {others:.2f} |"
    if cost == "both":
        c = last["cost"].spec.as_dict()
        peer_cols += (f" {med['cost']:.1f} | {med['cost'] / p:.2f}x | {c['plain_by_cost']}"
                      f"{' (off)' if c['cost_off'] else ''} |")
    print(f"| {label} | {k} | {params.temp:g} | {p:.1f} | {s:.1f} | {s / p:.2f}x | {100 * st['acceptance']:.0f}% | "
          f"{st['tokens_per_pass']:.2f} |{peer_cols}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--which", default="all", choices=["all", "qwen", "lookup", "ngram"])
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=-1,
                    help="token ids the draft's output layer computes, as sharpi's --spec-draft-vocab (-1 = auto, 0 = all)")
    ap.add_argument("--vs-llama-cpp", metavar="BIN_DIR", help="directory holding llama.cpp's llama-bench")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the models run")
    ap.add_argument("--cost", default="off", choices=["off", "on", "both"],
                    help="speculate at every step (off), by measured cost (on: the spec columns; greedy sharpi's "
                         "default), or both, the cost-aware runs in the last columns")
    ap.add_argument("--qwen-prompts", default="code", help="the Qwen pair's prompts: code, prose, deep, or several (code,prose)")
    ap.add_argument("--synth-lens", default="",
                    help="the Qwen pair at these synthetic acceptance lengths too (1,3,5; those above k + 1 skipped at k)")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct-q4_k_m",
                    help="the Qwen pair's target: a known model's name or a GGUF path (a stand-in of scripts/gguf_synth.py, "
                         "with --synth-lens: its proposals are the draft's, their acceptance synthetic)")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct-q4_k_m", help="the Qwen pair's draft (same)")
    a = ap.parse_args()
    torch.set_num_threads(a.t)
    ks = [int(x) for x in a.ks.split(",")]
    temps = [float(x) for x in a.temps.split(",")]
    print("| configuration | k | temp | plain t/s | spec t/s | spec/plain | accepted | tokens/pass | "
          "llama.cpp plain t/s | spec/llama.cpp | lost CPU (steal, others) |"
          + (" by cost t/s | by cost/plain | plain steps by cost |" if a.cost == "both" else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if a.cost == "both" else ""))
    peer_of = lambda name: (lambda: llama_bench_tg(a.vs_llama_cpp, name, a.n, a.t)) if a.vs_llama_cpp else None  # noqa: E731
    if a.which in ("all", "lookup"):
        model, tok = load("smollm2-135m-instruct-q4_1", a.device)
        for temp in temps:
            params = SamplingParams(temp=temp)
            compare("SmolLM2 lookup, echo-heavy", model, tok, ECHO_PROMPT, a.n, params, lambda: LookupDrafter(3, 2), 4, a.reps,
                    peer_of("smollm2-135m-instruct-q4_1"), a.cost)
            compare("SmolLM2 lookup, partial echo", model, tok, PARTIAL_ECHO_PROMPT, a.n, params, lambda: LookupDrafter(3, 2), 4,
                    a.reps, peer_of("smollm2-135m-instruct-q4_1"), a.cost)
            compare("SmolLM2 lookup, no-copy", model, tok, NOCOPY_PROMPT, a.n, params, lambda: LookupDrafter(3, 2), 4, a.reps,
                    peer_of("smollm2-135m-instruct-q4_1"), a.cost)
        del model
    if a.which == "ngram":
        for name, prompts in (("smollm2-135m-instruct-q4_1", ("echo-heavy", "partial echo")),
                              ("qwen2.5-coder-1.5b-instruct-q4_k_m", ("echo-heavy", "partial echo", "deep"))):
            model, tok = load(name, a.device)
            texts = {"echo-heavy": ECHO_PROMPT, "partial echo": PARTIAL_ECHO_PROMPT, "deep": DEEP_PROMPT}
            for temp in temps:
                params = SamplingParams(temp=temp)
                for which in prompts:
                    label = f"{name.split('-')[0]} {which}"
                    compare(f"{label}, --draft-lookup", model, tok, texts[which], a.n, params,
                            lambda: LookupDrafter(3, 2), 4, a.reps, cost=a.cost)
                    for t, k in (("ngram-simple", 48), ("ngram-map-k", 48), ("ngram-mod", 64), ("ngram-cache", 8)):
                        compare(f"{label}, --spec-type {t}", model, tok, texts[which], a.n, params,
                                lambda t=t: NgramChain(ngram_sources([t])), k, a.reps, cost=a.cost)
            del model
    if a.which in ("all", "qwen"):
        target, tok = load(a.target, a.device)
        draft, dtok = load(a.draft, a.device)
        head = draft_head_vocab(a.draft_vocab, dtok)
        for temp in temps:
            params = SamplingParams(temp=temp)
            for k in ks:
                for which in a.qwen_prompts.split(","):
                    for synth in [None] + [float(x) for x in a.synth_lens.split(",") if x and float(x) <= k + 1]:
                        label = f"Qwen 1.5B + 0.5B draft, {which}" + (f", synthetic L = {synth:g}" if synth else "")
                        compare(label, target, tok, QWEN_PROMPTS[which], a.n, params,
                                lambda: DraftModelDrafter(draft, draft.new_cache(2048), ignore_eos(params, tok),
                                                          torch.Generator().manual_seed(1), head_vocab=head), k, a.reps,
                                peer_of("qwen2.5-coder-1.5b-instruct-q4_k_m"), a.cost, synth)


if __name__ == "__main__":
    main()
