#!/usr/bin/env python3
"""Random command lines through the CLI: greedy output with speculation must be the plain output (a tool, not a test).

    python scripts/fuzz_spec_parity.py [--seed 1] [--runs 100] [--log fuzz.jsonl]

Each run draws a model (SmolLM2 mostly, Qwen 0.5B, Gemma 3; cached ones only), a prompt and -n, then flags that
change what is computed but not whether speculation may change it: context and batch sizes, every -ctk / -ctv type,
-fa, repetition / presence / frequency / DRY penalties, a logit bias, --ignore-eos, threads, --context-shift, --keep,
a reverse prompt, a grammar or JSON schema, --top-k 1, conversation mode or not (-cnv: four more turns on stdin,
with /regen and /clear), a system prompt, --special. It runs
`sharpi` with them at --temp 0, then again with a drafter (lookup, the model as its own draft, both, or one of
llama.cpp's n-gram drafters), its sizes and p-min, the draft's cache type and cut vocabulary, and the SHARPI_SPEC_*
/ SHARPI_FAST_DECODE switches; some pairs of runs both go without the C kernels (SHARPI_CPU_KERNEL=0) or with
fp32 activations (SHARPI_ACT_QUANT=0). A failure is a traceback, an exit code other than 0 / 1 / 2, exit codes
that differ, or different text on stdout; each is printed, and every run goes to --log as a JSON line (the command
lines, exit codes, seconds). Invalid combinations
(a -ctv of a block type with -fa off, -sys with -no-cnv) exit 2 in both runs, which counts as agreement. Some runs
add --json (then every field but the timings and the speculation's counts must agree), some a stop string cut from
the plain run's own output (-r: a stop inside an accepted run of drafts).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sharpi_core.registry import cached_path, is_cached  # noqa: E402

MODELS = ["smollm2-135m-instruct-q4_1"] * 3 + ["qwen2.5-coder-0.5b-instruct-q4_k_m", "gemma3-270m-q4_k_m"]
PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.",
    "Write a haiku about rain.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nRewrite fib iteratively.",
    "List the numbers from 1 to 20 separated by commas.",
    "x",
]
# follow-up turns on stdin for a run in conversation mode (-cnv)
TURNS = "Now say it in French.\n/regen\nAnd in German?\n/clear\nWhat is 2+2?\n"


def maybe(r: random.Random, p: float, *flags) -> list[str]:
    return [str(f) for f in flags] if r.random() < p else []


def base_flags(r: random.Random) -> list[str]:
    c = r.choice
    return [*maybe(r, 0.3, "-c", c([64, 128, 200, 256, 512, 1000])), *maybe(r, 0.3, "-b", c([1, 2, 7, 32, 512])),
            *maybe(r, 0.3, "-ub", c([1, 3, 16, 64, 512])),
            *maybe(r, 0.3, "-ctk", c(["f16", "q8_0", "q4_0", "q5_1", "f32", "bf16", "iq4_nl", "q4_1", "q5_0"])),
            *maybe(r, 0.3, "-ctv", c(["f16", "q8_0", "q4_0", "q5_1", "f32", "bf16"])),
            *maybe(r, 0.2, "-fa", c(["on", "off", "auto"])), *maybe(r, 0.3, "--repeat-penalty", c([1.0, 1.1, 1.5])),
            *maybe(r, 0.2, "--repeat-last-n", c([0, -1, 8, 64])), *maybe(r, 0.2, "--presence-penalty", 0.5),
            *maybe(r, 0.2, "--frequency-penalty", 0.3), *maybe(r, 0.15, "--dry-multiplier", 0.8),
            *maybe(r, 0.15, "-l", c(["11+2", "28-1", "198+5"])), *maybe(r, 0.15, "--ignore-eos"),
            *maybe(r, 0.2, "-t", c([1, 2])), *maybe(r, 0.1, "--context-shift"), *maybe(r, 0.1, "--keep", c([0, 4, -1])),
            *maybe(r, 0.1, "-r", "the"), *maybe(r, 0.1, "--grammar", "root ::= [a-z ]+"),
            *maybe(r, 0.1, "-j", '{"type":"object","properties":{"a":{"type":"integer"}}}'),
            *maybe(r, 0.1, "--top-k", 1), *r.choice([[], [], ["-no-cnv"], ["-cnv"]]), *maybe(r, 0.1, "-sys", "Be brief."),
            *maybe(r, 0.1, "--special")]


def spec_flags(r: random.Random, model: str) -> tuple[list[str], dict]:
    kind = r.choice(["lookup", "draft", "both", "ngram", "ngram", "lookup"])
    a = ["--draft-lookup"] if kind in ("lookup", "both") else []
    a += ["-md", model] if kind in ("draft", "both") else []
    if kind == "ngram":
        a += ["--spec-type", r.choice(["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache",
                                       "ngram-simple,ngram-cache"])]
    if r.random() < 0.5:
        hi = r.choice([1, 2, 4, 8, 16])
        a += ["--spec-draft-n-max", str(hi), *maybe(r, 0.5, "--spec-draft-n-min", r.randint(0, hi))]
    a += maybe(r, 0.3, "--spec-draft-p-min", r.choice([0.0, 0.5, 0.9]))
    if kind in ("draft", "both"):
        a += maybe(r, 0.3, "-ctkd", r.choice(["f16", "q8_0", "q4_0"]))
        a += maybe(r, 0.2, "--spec-draft-vocab", r.choice([0, 1000, 30000]))
    env = {k: v for k, v, p in (("SHARPI_SPEC_BATCH_VERIFY", "0", 0.3), ("SHARPI_SPEC_ADAPTIVE", "0", 0.3),
                                ("SHARPI_SPEC_COST", r.choice(["0", "1"]), 0.3), ("SHARPI_FAST_DECODE", "0", 0.2),
                                ("SHARPI_DECODE_C", "0", 0.2)) if r.random() < p}
    return a, env


def run(args: list[str], env: dict) -> tuple[str, str, int, float]:
    t = time.time()
    try:
        p = subprocess.run(["sharpi", *args], capture_output=True, text=True, env={**os.environ, **env}, timeout=300,
                           input=TURNS if "-cnv" in args else "")
    except subprocess.TimeoutExpired:
        return "", "timeout", -9, time.time() - t
    return p.stdout, p.stderr, p.returncode, time.time() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--log", default="fuzz_spec_parity.jsonl")
    a = ap.parse_args()
    models = [m for m in MODELS if is_cached(m)]
    if not models:
        print("no known model is cached (run `sharpi` once to fetch the default)", file=sys.stderr)
        return 2
    failures = 0
    with open(a.log, "a") as log:
        for i in range(a.runs):
            r = random.Random(a.seed * 100000 + i)
            model = str(cached_path(r.choice(models)))
            base = ["-m", model, "-p", r.choice(PROMPTS), "-n", str(r.choice([8, 24, 48])), "--temp", "0", "-s", "1",
                    *base_flags(r)]
            spec, env = spec_flags(r, model)
            # switches that change the arithmetic apply to both runs: speculation must keep parity under them too
            u = r.random()
            arith = {"SHARPI_CPU_KERNEL": "0"} if u < 0.1 else {"SHARPI_ACT_QUANT": "0"} if u < 0.15 else {}
            env = {**arith, **env}
            json_out = "-cnv" not in base and r.random() < 0.3
            base += ["--json"] if json_out else []
            o1, e1, c1, t1 = run(base, arith)
            if c1 == 0 and r.random() < 0.25:  # a stop string from the plain output itself
                text = json.loads(o1)["text"] if json_out else o1
                if len(text) > 6:
                    a0 = r.randrange(1, len(text) - 3)
                    base += ["-r", text[a0:a0 + r.choice([1, 2, 3, 5])]]
                    o1, e1, c1, t1 = run(base, arith)
            o2, e2, c2, t2 = run(base + spec, env)
            bad = [f"crash (exit {c}): {e[-1500:]}" for e, c in ((e1, c1), (e2, c2))
                   if "Traceback" in e or c not in (0, 1, 2)]
            if c1 != c2:
                bad.append(f"exit codes {c1} / {c2}: {e1[-300:]} || {e2[-300:]}")
            elif c1 == 0 and json_out:
                j1, j2 = (json.loads(o) for o in (o1, o2))
                differ = sorted(k for k in set(j1) | set(j2)
                                if k not in ("timings", "speculative") and j1.get(k) != j2.get(k))
                if differ or "speculative" not in j2:
                    bad.append(f"--json fields {differ or ['speculative missing']}\n--- plain\n{o1}\n--- speculative\n{o2}")
            elif c1 == 0 and o1 != o2:
                bad.append(f"different text\n--- plain\n{o1!r}\n--- speculative\n{o2!r}")
            rec = {"i": i, "base": base, "spec": spec, "env": env, "rc": [c1, c2], "s": [round(t1, 1), round(t2, 1)],
                   "bad": bad}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if bad:
                failures += 1
                print(json.dumps(rec, indent=1)[:4000], flush=True)
    print(f"{a.runs} runs, {failures} failing", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
