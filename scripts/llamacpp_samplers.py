"""Record llama.cpp's sampler chain on synthetic logits (tests/data/llamacpp_samplers.json): for each
case below, the candidates llama.cpp's samplers leave (top-n-sigma, typical, XTC, dynamic
temperature, DRY with its sequence breakers, penalties, logit bias, infill, orders given by --samplers) and
their logits after the chain, as scripts/llamacpp_samplers.c gets them from libllama.

    python scripts/llamacpp_samplers.py SRC_DIR BIN_DIR

SRC_DIR is a llama.cpp source tree (its include/ and ggml/include/), BIN_DIR holds its libllama
(the llama.cpp in llama-cpp-python, as the fixtures in ../shared/fixtures were built from). The
models' vocabularies come from sharpi's model cache. The logits are `synthetic_logits(seed, V, scale)`
(Gumbel noise from a fixed hash, the same on every machine), so the file stores seeds, not logits.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "llamacpp_samplers.json"
DEFAULT = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
BASE = dict(top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0, top_n_sigma=-1.0, xtc_probability=0.0,
            xtc_threshold=0.1, temp=0.8, dynatemp_range=0.0, dynatemp_exponent=1.0, repeat_last_n=64,
            repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, dry_multiplier=0.0, dry_base=1.75,
            dry_allowed_length=2, dry_penalty_last_n=64, dry_sequence_breakers=["\n", ":", "\"", "*"],
            samplers=DEFAULT, logit_bias=[], history_text="", scale=0.8, mirostat_tau=5.0, mirostat_eta=0.1,
            adaptive_target=-1.0, adaptive_decay=0.9, min_keep=0, rows=1)
SMOL, GEMMA, QWEN = "smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m", "qwen2.5-coder-1.5b-instruct-q4_k_m"
STORY = ("The cat sat on the mat. The cat sat on the mat.\nThe dog: \"sat on the mat\" * the cat sat on the "
         "rug. The cat sat on the mat. The cat sat on the")
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a"
INFILL = DEFAULT[:-1] + ["infill", "temperature"]
THE = [[" t", 6.0], [" th", 5.5], [" the", 7.0], [" them", 5.0], [" then", 4.0], [" there", 6.5], [" therefore", 3.0],
       ["def", 5.0], [" def", 5.2]]
CODE_PIECES = [["return", 5.0], [" return", 6.0], [" ret", 5.5], ["def", 4.0], [" def", 5.0], [" t", 3.0], [" the", 4.5]]
# (name, model, changes to BASE)
CASES = [
    ("typical 0.9, default chain", SMOL, dict(typical_p=0.9)),
    ("typical 0.5 alone", SMOL, dict(typical_p=0.5, samplers=["typ_p", "temperature"], scale=1.0)),
    ("typical 0.95, no top-k", SMOL, dict(typical_p=0.95, top_k=0, top_p=1.0, scale=1.2)),
    ("top-n-sigma 1, default chain", SMOL, dict(top_n_sigma=1.0)),
    ("top-n-sigma 2.5 alone", SMOL, dict(top_n_sigma=2.5, samplers=["top_n_sigma", "temperature"], scale=1.0)),
    ("xtc cut, default chain", SMOL, dict(xtc_probability=1.0, xtc_threshold=0.05, scale=1.0)),
    ("xtc cut, no top-k", SMOL, dict(xtc_probability=1.0, xtc_threshold=0.02, top_k=0, scale=1.0)),
    ("xtc threshold above 0.5 is off", SMOL, dict(xtc_probability=1.0, xtc_threshold=0.6, scale=1.0)),
    ("xtc after temperature", SMOL, dict(xtc_probability=1.0, xtc_threshold=0.1, temp=1.7, scale=1.2,
                                           samplers=["top_k", "temperature", "xtc"])),
    ("dynatemp 0.5", SMOL, dict(dynatemp_range=0.5)),
    ("dynatemp 0.7, exponent 2, no top-k", SMOL, dict(dynatemp_range=0.7, dynatemp_exponent=2.0, top_k=0, min_p=0.1)),
    ("dynatemp around temp 0", SMOL, dict(temp=0.0, dynatemp_range=0.3)),
    # candidates masked to -inf by top-n-sigma still count in dynamic temperature's maximum entropy
    ("top-n-sigma, then dynatemp", SMOL, dict(top_n_sigma=1.2, dynatemp_range=0.5, top_p=1.0, min_p=0.0)),
    ("top-n-sigma alone, then dynatemp", SMOL, dict(top_n_sigma=1.0, dynatemp_range=0.7, samplers=["top_n_sigma", "temperature"])),
    ("dynatemp, one-hot, negative exponent", SMOL, dict(dynatemp_range=0.5, dynatemp_exponent=-1.0, top_p=1.0, min_p=0.0,
                                                        logit_bias=[[28, 1000.0]])),
    ("temperature first", SMOL, dict(temp=1.5, samplers=["temperature", "top_k", "top_p", "min_p"])),
    ("min-p before top-k", SMOL, dict(min_p=0.1, samplers=["min_p", "top_k", "top_p", "temperature"], scale=0.9)),
    ("top-p, typical, top-k", SMOL, dict(typical_p=0.8, top_k=20, samplers=["top_p", "typ_p", "top_k", "temperature"])),
    ("no temperature stage", SMOL, dict(temp=0.0, samplers=["top_k", "min_p"])),
    ("dry alone, default breakers", SMOL, dict(dry_multiplier=0.8, samplers=["dry"], history_text=STORY)),
    ("dry alone, no breakers", SMOL, dict(dry_multiplier=0.8, dry_sequence_breakers=[], samplers=["dry"],
                                          history_text=STORY)),
    ("dry, multi-token breakers, allowed 1", SMOL, dict(dry_multiplier=1.1, dry_allowed_length=1, samplers=["dry"],
                                                        dry_sequence_breakers=["mat.\n", "rug", "dog:"],
                                                        history_text=STORY)),
    ("dry, long window, capped exponent", SMOL, dict(dry_multiplier=2.0, dry_base=5.0, dry_allowed_length=0,
                                                     dry_penalty_last_n=512, samplers=["dry"], history_text=STORY * 3)),
    ("dry, short window", SMOL, dict(dry_multiplier=0.8, dry_penalty_last_n=12, samplers=["dry"], history_text=STORY)),
    ("dry and penalties, bias, default chain", SMOL, dict(dry_multiplier=1.5, dry_base=2.0, dry_allowed_length=3,
                                                          dry_penalty_last_n=128, repeat_penalty=1.2, frequency_penalty=0.1,
                                                          presence_penalty=0.2, history_text=STORY, bias_history=8.0)),
    ("dry before penalties", SMOL, dict(dry_multiplier=1.5, repeat_penalty=1.3, samplers=["dry", "penalties"],
                                        history_text=STORY)),
    ("dry, three tokens at random", SMOL, dict(dry_multiplier=0.5, dry_penalty_last_n=300, samplers=["dry"],
                                               history_ids=(11, 300, 3, 0), dry_sequence_breakers=[])),
    ("dry, periodic, a breaker in it", SMOL, dict(dry_multiplier=0.5, dry_allowed_length=1, dry_penalty_last_n=250,
                                                  samplers=["dry"], history_ids=(12, 400, 6, 17), dry_sequence_breakers=["en"])),
    ("dry, periodic, breakers elsewhere", SMOL, dict(dry_multiplier=0.5, dry_allowed_length=3, dry_penalty_last_n=250,
                                                     samplers=["dry"], history_ids=(13, 400, 4, 11),
                                                     dry_sequence_breakers=["en", "\n"])),
    # mirostat (llama.cpp's chain for --mirostat N: temperature, then mirostat, which picks the token and
    # updates its state): the candidates it keeps at each of several steps, and what it picked
    ("mirostat 2", SMOL, dict(samplers=["temperature", "mirostat_v2"], rows=4, scale=1.0)),
    ("mirostat 2, tau 4, eta 0.3", SMOL, dict(samplers=["temperature", "mirostat_v2"], rows=4, temp=0.7,
                                              mirostat_tau=4.0, mirostat_eta=0.3, scale=1.0)),
    ("mirostat 1", SMOL, dict(samplers=["temperature", "mirostat"], rows=4, scale=1.0)),
    ("mirostat 1, tau 3", SMOL, dict(samplers=["temperature", "mirostat"], rows=4, mirostat_tau=3.0, scale=1.2)),
    ("qwen: mirostat 1", QWEN, dict(samplers=["temperature", "mirostat"], rows=3, scale=1.0)),
    ("gemma: dry, default breakers", GEMMA, dict(dry_multiplier=0.8, samplers=["dry"], history_text=STORY)),
    # (top-n-sigma masks logits to -inf; a typical stage that sees those computes a NaN entropy in llama.cpp)
    ("gemma: typical, no top-k", GEMMA, dict(typical_p=0.7, top_k=0, scale=0.8)),
    ("gemma: top-n-sigma, default chain", GEMMA, dict(top_n_sigma=1.5, scale=0.8)),
    ("qwen: dry, code breakers", QWEN, dict(dry_multiplier=0.8, dry_sequence_breakers=["\n", "def ", "(a"],
                                            samplers=["dry"], history_text=CODE)),
    # adaptive-p (llama.cpp adds it last, in place of dist, when --samplers names it): the logits it
    # draws from at each of several steps (its state moves with each pick) and what it picked
    ("adaptive-p 0.5, default chain", SMOL, dict(samplers=DEFAULT + ["adaptive_p"], adaptive_target=0.5, rows=5,
                                                 scale=1.5)),
    ("adaptive-p 0.2, decay 0.5, min-p", SMOL, dict(samplers=["min_p", "temperature", "adaptive_p"], min_p=0.02,
                                                    adaptive_target=0.2, adaptive_decay=0.5, rows=5, scale=2.0)),
    ("adaptive-p 0.9, no filter, banned tokens", SMOL, dict(samplers=DEFAULT + ["adaptive_p"], temp=1.3, top_k=0,
                                                            top_p=1.0, min_p=0.0,
                                                            adaptive_target=0.9, adaptive_decay=0.99, rows=3,
                                                            logit_bias=[[5, float("-inf")], [77, float("-inf")]])),
    ("adaptive-p, target above 1, decay above 0.99", SMOL, dict(samplers=["top_k", "temperature", "adaptive_p"],
                                                                adaptive_target=1.4, adaptive_decay=1.5, rows=4,
                                                                scale=1.5)),
    ("adaptive-p after xtc's cut", SMOL, dict(samplers=["top_k", "xtc", "temperature", "adaptive_p"],
                                              xtc_probability=1.0, xtc_threshold=0.05, adaptive_target=0.3,
                                              rows=4, scale=1.5)),
    ("adaptive-p 0, top-n-sigma masks", SMOL, dict(samplers=["top_n_sigma", "temperature", "adaptive_p"],
                                                   top_n_sigma=4.0, adaptive_target=0.0, rows=3, scale=1.0)),
    ("qwen: adaptive-p 0.4, typical", QWEN, dict(samplers=["top_k", "typ_p", "temperature", "adaptive_p"],
                                                 typical_p=0.9, adaptive_target=0.4, rows=4, scale=1.5)),
    # llama.cpp's temperature 0 keeps the best of what typical and XTC leave (not the arg-max of all)
    ("typical 0.5 at temp 0", SMOL, dict(typical_p=0.5, temp=0.0, scale=1.0)),
    ("typical 0.3 alone at temp 0", SMOL, dict(typical_p=0.3, temp=0.0, samplers=["typ_p", "temperature"], scale=1.5)),
    ("xtc cut at temp 0", SMOL, dict(xtc_probability=1.0, xtc_threshold=0.05, temp=0.0, scale=1.0)),
    # --min-keep: top-p, min-p, typical and XTC keep at least that many candidates (top-k and top-n-sigma do not)
    ("min-keep 60 over top-k 40, default chain", SMOL, dict(min_keep=60, scale=0.5)),
    ("min-keep 30, top-p and min-p", SMOL, dict(min_keep=30, top_k=100, scale=1.0)),
    ("min-keep 200, no top-k", SMOL, dict(min_keep=200, top_k=0, scale=0.6)),
    ("min-keep 2000, no top-k, top-p widens", SMOL, dict(min_keep=2000, top_k=0, top_p=0.5, scale=0.5)),
    ("min-keep 25, min-p alone", SMOL, dict(min_keep=25, top_k=0, top_p=1.0, min_p=0.3, scale=0.6)),
    ("min-keep 25, min-p before top-k", SMOL, dict(min_keep=25, min_p=0.3, samplers=["min_p", "top_k", "temperature"],
                                                  scale=0.6)),
    ("min-keep 12, typical", SMOL, dict(min_keep=12, typical_p=0.3, top_k=0, top_p=1.0, min_p=0.0, scale=2.0)),
    ("min-keep 6, typical after top-k", SMOL, dict(min_keep=6, typical_p=0.2, scale=1.5)),
    ("min-keep 1, typical", SMOL, dict(min_keep=1, typical_p=0.2, top_k=0, top_p=1.0, min_p=0.0, scale=2.0)),
    ("min-keep 10, xtc's cut refused", SMOL, dict(min_keep=10, xtc_probability=1.0, xtc_threshold=0.02, top_k=12,
                                                  top_p=1.0, min_p=0.0, scale=1.0)),
    ("min-keep 10, xtc's cut kept", SMOL, dict(min_keep=10, xtc_probability=1.0, xtc_threshold=0.02, top_k=40,
                                               top_p=1.0, min_p=0.0, scale=1.0)),
    ("min-keep 50, top-n-sigma masks first", SMOL, dict(min_keep=50, top_n_sigma=1.0, top_k=0, scale=1.0)),
    ("qwen: min-keep 300, no top-k", QWEN, dict(min_keep=300, top_k=0, top_p=0.7, scale=1.0)),
    # values llama.cpp's flags take as they are: top-p <= 0 and min-p > 1 keep the best candidate (and min-keep's),
    # top-p >= 1 and min-p <= 0 are off
    ("top-p 0 keeps the best", SMOL, dict(top_p=0.0, scale=1.0)),
    ("top-p -0.5, min-keep 3", SMOL, dict(top_p=-0.5, min_keep=3, scale=1.0)),
    ("top-p 1.5 is off", SMOL, dict(top_p=1.5, min_p=0.0, scale=1.0)),
    ("min-p 1.5 keeps the best, no top-k", SMOL, dict(min_p=1.5, top_k=0, top_p=1.0, scale=1.0)),
    ("min-p 1.5 after top-k, min-keep 4", SMOL, dict(min_p=1.5, min_keep=4, scale=1.0)),
    ("min-p 1.5 first", SMOL, dict(min_p=1.5, samplers=["min_p", "top_k", "temperature"], scale=1.0)),
    ("min-p -0.2 is off", SMOL, dict(min_p=-0.2, top_p=1.0, scale=1.0)),
    # found by scripts/fuzz_samplers.py (its seeds): adaptive-p over the whole vocabulary reshapes llama.cpp's float
    # softmax, whose float sum is 1e-4 off; mirostat's law is its float probabilities normalized anew
    ("adaptive-p 0.9 alone, whole vocabulary", SMOL, dict(samplers=["adaptive_p"], adaptive_target=0.9, rows=3, scale=1.5,
                                                          seed=968059466)),
    ("mirostat 1, eta 1", SMOL, dict(samplers=["temperature", "mirostat"], mirostat_eta=1.0, rows=4, scale=1.5,
                                     seed=355677154)),
    # infill (fill-in-the-middle): the end-of-generation tokens alone where their mass is large enough, else the
    # prefix merges and two probability cuts; nothing left: the end-of-turn token (bias_texts: single-token texts)
    ("infill, flat: the end token", SMOL, dict(samplers=INFILL, scale=0.8)),
    ("infill, peaked", SMOL, dict(samplers=INFILL, scale=3.0)),
    ("infill merges prefixes", SMOL, dict(samplers=INFILL, scale=0.5, bias_texts=THE)),
    ("infill merges prefixes, flatter", SMOL, dict(samplers=INFILL, scale=0.3, temp=1.3,
                                                   bias_texts=[[t, b - 1.5] for t, b in THE])),
    ("infill: the end-of-generation tokens", SMOL, dict(samplers=INFILL, scale=1.0, logit_bias=[[2, 9.0], [0, 8.0]])),
    ("infill: both end-of-generation tokens", SMOL, dict(samplers=INFILL, scale=1.0, logit_bias=[[2, 11.0], [0, 10.0]])),
    ("top-k, infill: the end-of-generation tokens", SMOL, dict(samplers=["top_k", "infill", "temperature"], scale=1.0,
                                                             logit_bias=[[2, 9.5], [0, 8.5]])),
    ("infill: the second cut", SMOL, dict(samplers=INFILL, scale=0.2, bias_texts=[["def", 8.0], [" return", 7.3],
                                                                                  [" while", 7.1]])),
    ("top-k, infill: the second cut", SMOL, dict(samplers=["top_k", "infill", "temperature"], scale=0.2,
                                                 bias_texts=[["def", 8.0], [" return", 7.5], [" while", 7.3],
                                                             [" for", 7.2]])),
    ("top-k, infill: the second cut of two", SMOL, dict(samplers=["top_k", "infill", "temperature"], scale=0.2,
                                                        bias_texts=[["def", 8.0], [" return", 6.9]])),
    ("infill at temp 0", SMOL, dict(samplers=INFILL, temp=0.0, scale=0.5, bias_texts=THE)),
    ("infill after temperature 0", SMOL, dict(samplers=["top_k", "temperature", "infill"], temp=0.0, scale=0.5,
                                              bias_texts=THE)),
    ("top-k 300, infill, top-p", SMOL, dict(samplers=["top_k", "infill", "top_p", "temperature"], top_k=300,
                                            top_p=0.9, scale=0.4, bias_texts=THE)),
    ("top-n-sigma masks, then infill", SMOL, dict(samplers=["top_k", "top_n_sigma", "infill", "temperature"],
                                                  top_n_sigma=0.5, scale=0.5, bias_texts=THE)),
    ("infill, then xtc's cut", SMOL, dict(samplers=["top_k", "infill", "xtc", "temperature"], xtc_probability=1.0,
                                          xtc_threshold=0.05, scale=0.5, bias_texts=THE)),
    ("gemma: infill, flat: end of turn", GEMMA, dict(samplers=INFILL, scale=0.8)),
    ("gemma: infill, end of turn wins", GEMMA, dict(samplers=INFILL, scale=1.0, logit_bias=[[106, 11.0], [1, 9.0]])),
    ("gemma: infill merges prefixes", GEMMA, dict(samplers=INFILL, scale=0.5, bias_texts=THE)),
    ("qwen: infill merges code", QWEN, dict(samplers=INFILL, scale=0.6, bias_texts=CODE_PIECES)),
    ("qwen: infill, fim end tokens", QWEN, dict(samplers=INFILL, scale=1.0, logit_bias=[[151662, 11.0], [151664, 10.5]])),
]


def synthetic_logits(seed: int, V: int, scale: float) -> np.ndarray:
    """float32 [V]: scale * Gumbel noise from splitmix64 of (seed, id) (no library RNG, so no version drift)."""
    with np.errstate(over="ignore"):
        z = np.arange(V, dtype=np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) / float(2 ** 53)
    return (scale * -np.log(-np.log(u))).astype(np.float32)


def synthetic_history(seed: int, n: int, alphabet: int, period: int) -> list[int]:
    """n token ids among `alphabet` ids from 260 on; with a period, mostly copies of the token that far back."""
    r = [int(v) for v in np.floor(np.abs(synthetic_logits(seed, n, 1.0).astype(np.float64)) * 1000)]
    out: list[int] = []
    for i, v in enumerate(r):
        out.append(out[i - period] if period and i >= period and v % 4 else 260 + v % alphabet)
    return out


def _hex(v: float) -> str:
    return float(np.float32(v)).hex()


def sampling_params(c: dict, tok, bias: list | None = None):
    """sharpi's SamplingParams for a case (BASE's fields; its logit bias unless `bias` is given)."""
    from sharpi_core import dry
    from sharpi_core.sampling import InfillVocab, SamplingParams
    return SamplingParams(
        temp=c["temp"], top_k=c["top_k"], top_p=c["top_p"], min_p=c["min_p"], min_keep=c["min_keep"],
        typical_p=c["typical_p"], top_n_sigma=c["top_n_sigma"], xtc_probability=c["xtc_probability"],
        xtc_threshold=c["xtc_threshold"], dynatemp_range=c["dynatemp_range"], dynatemp_exponent=c["dynatemp_exponent"],
        repeat_penalty=c["repeat_penalty"], repeat_last_n=c["repeat_last_n"], frequency_penalty=c["frequency_penalty"],
        presence_penalty=c["presence_penalty"], dry_multiplier=c["dry_multiplier"], dry_base=c["dry_base"],
        dry_allowed_length=c["dry_allowed_length"], dry_penalty_last_n=c["dry_penalty_last_n"],
        dry_breakers=dry.breakers(tok, c["dry_sequence_breakers"]), samplers=tuple(c["samplers"]),
        logit_bias=tuple((int(t), float(b)) for t, b in (c["logit_bias"] if bias is None else bias)),
        adaptive_target=c["adaptive_target"], adaptive_decay=c["adaptive_decay"],
        infill=InfillVocab.of(tok) if "infill" in c["samplers"] else None)


def case_input(c: dict, tok, seed: int) -> tuple[str, list[int], list, list[np.ndarray]]:
    """A case (BASE's fields, history_text, history_ids or the ids in history, bias_history, bias_texts) as llamacpp_samplers.c
    reads it, with its history, logit bias and logits rows."""
    hist = tok.encode(c["history_text"], add_special=False) if c["history_text"] else []
    if c.get("history_ids"):
        hist = synthetic_history(*c["history_ids"])
    if c.get("history") is not None:
        hist = list(c["history"])
    bias = [[t, c["bias_history"]] for t in sorted(set(hist))] if c.get("bias_history") else c["logit_bias"]
    for text, b in c.get("bias_texts", ()):
        ids = tok.encode(text, add_special=False)
        assert len(ids) == 1, f"{text!r} is not one token"
        bias = bias + [[ids[0], b]]
    xs = [synthetic_logits(seed + 1000 * r, tok.n_vocab, c["scale"]) for r in range(c["rows"])]
    lines = [f"S {len(c['samplers'])} {' '.join(c['samplers'])}",
             "P %d %s %s %s %s %s %s %s %s %s %d %s %s %s %s %s %d %d %d" % (
                 c["top_k"], _hex(c["top_p"]), _hex(c["min_p"]), _hex(c["typical_p"]), _hex(c["top_n_sigma"]),
                 _hex(c["xtc_probability"]), _hex(c["xtc_threshold"]), _hex(c["temp"]), _hex(c["dynatemp_range"]),
                 _hex(c["dynatemp_exponent"]), c["repeat_last_n"], _hex(c["repeat_penalty"]),
                 _hex(c["frequency_penalty"]), _hex(c["presence_penalty"]), _hex(c["dry_multiplier"]),
                 _hex(c["dry_base"]), c["dry_allowed_length"], c["dry_penalty_last_n"], c["min_keep"]),
             f"B {len(c['dry_sequence_breakers'])}"] + [s.encode().hex() for s in c["dry_sequence_breakers"]]
    lines += [f"A {len(bias)} " + " ".join(f"{t} {_hex(b)}" for t, b in bias),
              f"M {_hex(c['mirostat_tau'])} {_hex(c['mirostat_eta'])}",
              f"D {_hex(c['adaptive_target'])} {_hex(c['adaptive_decay'])}",
              f"H {len(hist)} " + " ".join(map(str, hist)), f"R {len(xs)}"]
    lines += [f"L {tok.n_vocab} " + " ".join(float(v).hex() for v in row) for row in xs]
    return "\n".join(lines) + "\n", hist, bias, xs


def parse_steps(out: str, rows: int) -> tuple[list[tuple[list[tuple[int, float]], int | None]], str]:
    """llamacpp_samplers.c's answer to a case of `rows` logits rows: per row the candidates left (id, logit)
    and the id the chain picked (None if it picks none); and the rest of the output (the next cases')."""
    res = out.split("\n")
    steps = []
    while len(steps) < rows and res and res[0].startswith("K "):
        k, sel = map(int, res[0].split()[1:])
        got = [(int(i), float.fromhex(v)) for i, v in (ln.split() for ln in res[1:1 + k])]
        steps.append((got, got[sel][0] if sel >= 0 else None))
        res = res[1 + k:]
    return steps, "\n".join(res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="llama.cpp source tree")
    ap.add_argument("bin", type=Path, help="llama.cpp build dir holding libllama")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    from compare_llamacpp_logits import build
    from sharpi_core.gguf_file import GGUFFile
    from sharpi_core.registry import pull
    from sharpi_core.tokenizer import Tokenizer
    out = []
    with tempfile.TemporaryDirectory() as d:
        exe = build(a.src, a.bin, Path(d), "llamacpp_samplers")
        for seed, (name, model, change) in enumerate(CASES, start=1):
            c = {**BASE, **change}
            seed = c.pop("seed", seed)
            path = pull(model)
            tok = Tokenizer.from_gguf(GGUFFile(path))
            text, hist, bias, xs = case_input(c, tok, seed)
            x = xs[0]
            r = subprocess.run([str(exe), str(path)], input=text, capture_output=True, text=True, check=True)
            steps, _ = parse_steps(r.stdout, c["rows"])
            got = [(i, v) for i, v in steps[0][0] if v != float("-inf")]  # masked (top-n-sigma, temperature 0): not candidates
            case = {"name": name, "model": model, "seed": seed,
                    **{f: c[f] for f in BASE if f not in ("history_text",)}, "logit_bias": bias, "history": hist}
            if c["rows"] > 1:  # mirostat, adaptive-p: each step's kept ids and the id it picked
                case["steps"] = [{"kept": sorted(i for i, v in st if v != float("-inf")), "picked": sel}
                                 for st, sel in steps]
                # and the logits it draws from (or, for most of the vocabulary, their summary)
                for step, (st, _) in zip(case["steps"], steps):
                    live = [[i, v] for i, v in st if v != float("-inf")]
                    if len(live) <= 512:
                        step["logits"] = live
                        continue
                    # most of the vocabulary: its count, the ids left out, the 64 highest logits and
                    # the log of the sum of exp over all of them (what the law's normalization needs)
                    del step["kept"]
                    ids = {i for i, _ in live}
                    assert tok.n_vocab - len(ids) <= 512, "a case for a few hundred candidates or most of them"
                    v = np.array([w for _, w in live], dtype=np.float64)
                    step.update(n=len(live), dropped=[i for i in range(tok.n_vocab) if i not in ids],
                                top=sorted(live, key=lambda e: -e[1])[:64],
                                lse=float(v.max() + np.log(np.exp(v - v.max()).sum())))
                out.append(case)
                print(f"{name}: " + ", ".join(f"{len(st)} kept" for st, _ in steps))
                continue
            if len(got) == tok.n_vocab:  # nothing removed (DRY alone): the logits it changed
                case["changed"] = [[i, v] for i, v in got if v != x[i]]
            else:
                case["kept"] = [[i, v] for i, v in got]
            out.append(case)
            print(f"{name}: {len(got)} candidates" + (f", {len(case['changed'])} changed" if "changed" in case else ""))
    OUT.write_text(json.dumps(out, indent=0) + "\n")
    print(f"wrote {len(out)} cases to {OUT}")


if __name__ == "__main__":
    main()
