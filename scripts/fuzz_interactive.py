#!/usr/bin/env python3
"""Random interactive sessions (-i / -if) through sharpi and llama-completion: the transcripts must be the same (a
tool, not a test).

    python scripts/fuzz_interactive.py BIN_DIR [--seed 1] [--runs 60] [--log F] [--models-dir DIR] [--models ...]

Each run draws a model (SmolLM2 mostly, Gemma 3, Qwen 0.5B; or one of --models), a prompt, zero to three reverse
prompts (one-token, control-token, escaped), --in-prefix / --in-suffix / --in-prefix-bos / -mli / -sp, -n, a context
(sometimes small, with or without --context-shift and --keep), penalties, and two to five lines of user input (empty
lines, '\\' and '/' endings, control-token text, non-ASCII). llama-completion runs as
scripts/llamacpp_interactive.py records it (`-no-cnv --simple-io --temp 0 -t 2`, stdout up to "EOF by user"); sharpi
runs the same arguments, some runs with a drafter (Qwen 1.5B's mostly its 0.5B draft model; greedy: the transcript
may not change). A run differs when the transcripts, the "context is full" ending or the exit status differ, or
sharpi prints a traceback; each is printed with its command line and the first differing characters. Where the
transcripts differ, llama-completion runs again with -fa off and sharpi with fp32 activations (SHARPI_ACT_QUANT=0):
where llama-completion's own text then changes by that point, or sharpi's then agrees with it up to there, the run
is a near tie (a greedy choice the engines' rounding decides; counted apart; one after a context shift, where
llama.cpp's cell order moves its sums, may pass neither check). Exits 1 if any differed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from llamacpp_interactive import BOB, CHAT_DONE, CHATML, GEMMA, QWEN, SMOL

MODELS = [SMOL] * 4 + [GEMMA, QWEN]
QWEN15 = "qwen2.5-coder-1.5b-instruct-q4_k_m"  # (with QWEN, its draft model, where a script draws drafters)
MODEL_NAMES = {"smol": SMOL, "gemma": GEMMA, "qwen": QWEN, "qwen15": QWEN15}
PROMPTS = [BOB, CHATML, CHAT_DONE, "Once upon a time", "The capital of France is", "Q: What is 2+2?\nA:",
           "def add(a, b):\n", "Liste des couleurs : rouge, vert,", "1. apples\n2.", "日本の首都は"]
REVERSE = ["User:", "\n", "<|im_start|>user\\n", "<|im_start|>user", "Q:", ".", " the", "\\n\\n", "<|im_end|>",
           "END", ","]
PREFIXES = [" ", "Q: ", "User: ", "<|im_start|>user\\n", "\\n", "« "]
SUFFIXES = ["Bob:", "\\nA:", "<|im_end|>\\n<|im_start|>assistant\\n", " ", "\\n"]
LINES = ["Tell me about Paris.", "", "What else?", "Go on\\", "and on", "stop here/", "<|im_end|>",
         "Écris un poème sur la mer.", "1 2 3 4 5 6 7 8 9 10", "   leading spaces", "trailing spaces   ",
         "日本の首都は？", "emoji 🙂 and more", "tab\tinside", "Write a long story about a dragon and a knight."]
DRAFTERS = [["--draft-lookup"], ["--draft-lookup", "--spec-draft-n-max", "3"], ["--spec-type", "ngram-simple"]]


def random_case(rng: random.Random, models: list[str] = MODELS) -> tuple[str, list[str], str]:
    model = rng.choice(models)
    args = [rng.choice(["-i", "-i", "-if"])]
    for r in rng.sample(REVERSE, rng.choice([0, 1, 1, 1, 2, 3])):
        args += ["-r", r]
    if rng.random() < 0.5:
        args += ["--in-prefix", rng.choice(PREFIXES)]
    if rng.random() < 0.5:
        args += ["--in-suffix", rng.choice(SUFFIXES)]
    for flag, p in (("--in-prefix-bos", 0.15), ("-mli", 0.2), ("-sp", 0.2)):
        if rng.random() < p:
            args.append(flag)
    args += ["-p", rng.choice(PROMPTS)]
    ctx = rng.choice([512, 512, 1024, 256, 256])  # multiples of 256: llama.cpp rounds n_ctx up to one (README, -c)
    n = rng.choice([1, 4, 12, 24, 40, 64, -1] if ctx <= 256 else [1, 4, 12, 24, 40, 64])
    args += ["-n", str(n), "-c", str(ctx)]
    if ctx <= 256 and n != -1 and rng.random() < 0.6:  # (-n -1 through context shifts would never end)
        args.append("--context-shift")
        if rng.random() < 0.6:
            args += ["--keep", str(rng.choice([-1, 0, 4, 16]))]
    if rng.random() < 0.3:
        args += ["--repeat-penalty", rng.choice(["1.1", "1.3"]), "--repeat-last-n", rng.choice(["16", "64"])]
    if rng.random() < 0.2:
        args += ["--presence-penalty", "0.5", "--frequency-penalty", "0.3"]
    text = "".join(rng.choice(LINES) + "\n" for _ in range(rng.randint(2, 5)))
    return model, args, text.replace("\\n", "\n") if rng.random() < 0.1 else text


def drafter_args(rng: random.Random, model: str, models_dir: Path) -> list[str]:
    """A drafter for some runs (greedy: the text may not change); Qwen 1.5B's most often its 0.5B draft model."""
    if model == QWEN15 and rng.random() < 0.6:
        return ["-md", str(models_dir / f"{QWEN}.gguf")] + rng.choice([[], ["--spec-draft-n-max", "3"]])
    return rng.choice(DRAFTERS) if rng.random() < 0.3 else []


def llama(binary: Path, model: Path, args: list[str], text: str) -> tuple[int, str, bool]:
    cmd = [str(binary), "-m", str(model), "-no-cnv", "--simple-io", "--temp", "0", "-t", "2", *args]
    r = subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=600, errors="replace")
    out = r.stdout.removesuffix("\n\n")
    return r.returncode, out.removesuffix("EOF by user\n"), "context full" in r.stderr


def sharpi(model: Path, args: list[str], text: str, env: dict | None = None) -> tuple[int, str, bool, str]:
    cmd = [sys.executable, "-m", "sharpi_cli", "-m", str(model), "--temp", "0", "-t", "2", *args]
    r = subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=600, errors="replace",
                       env=dict(os.environ, **(env or {})))
    return r.returncode, r.stdout.removesuffix("\n"), "context" in r.stderr and "is full" in r.stderr, r.stderr


def session_args(doc: str, program: str) -> argparse.Namespace:
    """The arguments of the fuzz scripts that run llama.cpp's programs: BIN_DIR [--models-dir] [--seed] [--runs]
    [--log] [--models]."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("bin_dir", type=Path, help=f"holds {program}")
    ap.add_argument("--models-dir", type=Path, default=Path.home() / ".cache" / "sharpi" / "models")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--log", type=Path, help="write what differed here (JSON lines)")
    ap.add_argument("--models", type=lambda v: [MODEL_NAMES[m] for m in v.split(",")],
                    help=f"draw the model from these, comma-separated ({', '.join(MODEL_NAMES)}; a name twice is "
                         "drawn twice as often; default: the script's mix)")
    return ap.parse_args()


def first_difference(llama: str, ours: str) -> tuple[int, str]:
    """Where two texts first differ, and both around it."""
    at = next((j for j, (x, y) in enumerate(zip(llama, ours)) if x != y), min(len(llama), len(ours)))
    return at, f"llama {llama[max(0, at - 40):at + 40]!r} sharpi {ours[max(0, at - 40):at + 40]!r}"


def near_tie(at: int, llama: str, llama_off: str, sharpi_f32: str, program: str) -> str | None:
    """Why the first difference, at `at`, is a near tie (None: not shown to be one): llama.cpp's other attention path
    (-fa off) changes its own text by there, or sharpi with fp32 activations agrees with llama.cpp up to there."""
    if llama_off[:at + 1] != llama[:at + 1]:
        return f"{program} -fa off differs from -fa on"
    if sharpi_f32[:at + 1] == llama[:at + 1]:
        return f"sharpi with fp32 activations agrees with {program}"
    return None


def log_run(path: Path | None, record: dict) -> None:
    if path:
        with path.open("a") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def main() -> None:
    a = session_args(__doc__, "llama-completion")
    rng = random.Random(a.seed)
    differed = ties = 0
    for i in range(a.runs):
        model, args, text = random_case(rng, a.models or MODELS)
        drafter = drafter_args(rng, model, a.models_dir)
        path = a.models_dir / f"{model}.gguf"
        l_rc, l_out, l_full = llama(a.bin_dir / "llama-completion", path, args, text)
        s_rc, s_out, s_full, err = sharpi(path, args + drafter, text)
        why = []
        if "Traceback" in err:
            why.append("traceback: " + err.strip().splitlines()[-1])
        if (l_rc == 0) != (s_rc == 0):
            why.append(f"exit {l_rc} vs {s_rc}: {err.strip().splitlines()[-1] if err.strip() else ''}")
        elif l_rc == 0 and l_out != s_out:
            at, around = first_difference(l_out, s_out)
            why.append(f"transcripts differ at {at}: {around}")
            off = llama(a.bin_dir / "llama-completion", path, args + ["-fa", "off"], text)[1]
            f32 = sharpi(path, args + drafter, text, {"SHARPI_ACT_QUANT": "0"})[1]
            tie = near_tie(at, l_out, off, f32, "llama-completion")
            if tie:
                ties += 1
                why = []
                print(f"[{i}] near tie at {at}: {tie}")
        elif l_rc == 0 and l_full != s_full:
            why.append(f"context full: llama {l_full}, sharpi {s_full}")
        print(f"[{i}] {model} {' '.join(args + drafter)!r}: {'; '.join(why) or 'same'}", flush=True)
        if why:
            differed += 1
            log_run(a.log, {"run": i, "model": model, "args": args, "drafter": drafter, "input": text, "why": why})
    print(f"{a.runs} runs, {differed} differed, {ties} near ties")
    sys.exit(1 if differed else 0)


if __name__ == "__main__":
    main()
