#!/usr/bin/env python3
"""Random conversations (-cnv) through sharpi and llama-cli: the transcripts each writes with `-o FILE` must be the
same (a tool, not a test).

    python scripts/fuzz_cli_chat.py BIN_DIR [--seed 1] [--runs 60] [--log F] [--models-dir DIR] [--models qwen,qwen15]

BIN_DIR holds `llama-cli` (llama.cpp's chat program: configure its build with -DLLAMA_BUILD_SERVER=ON
-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF, then build the llama-cli target). Each run draws a model (SmolLM2
mostly, Qwen 0.5B, Gemma 3 (no chat template of its own); or one of --models), a system prompt or none, -n, a
context (some small enough to refuse a message or cut a reply, some with --context-shift), penalties, a first
message (-p, -st), a stop string (-r), -mli, and two to six lines of input: messages, /regen, /clear, /read of a
small file, empty lines, lines ending in '\\' or '/'. llama-cli runs `--simple-io --temp 0 -t 2` with them; sharpi
runs `-cnv --simple-io --temp 0 -t 2` with the same, some runs with a drafter (Qwen 1.5B's mostly its 0.5B draft
model; greedy: the conversation may not change). A run differs when the transcripts or the exit status differ or
sharpi prints a traceback; each is printed with the first differing characters. Where the transcripts differ,
llama-cli runs again with -fa off and sharpi with fp32 activations (SHARPI_ACT_QUANT=0): where llama-cli's own
transcript then changes by that point, or sharpi's then agrees with llama-cli's up to it, the run is a near tie (a
greedy choice the engines' rounding decides; counted apart). Exits 1 if any differed.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from fuzz_interactive import drafter_args, first_difference, log_run, near_tie, session_args
from llamacpp_interactive import GEMMA, QWEN, SMOL

MODELS = [SMOL] * 4 + [QWEN, GEMMA]
SYSTEMS = ["Be brief.", "You are a pirate. Answer in one sentence.", "Réponds en français.", "", "  spaced  "]
MESSAGES = ["What is the capital of France?", "And of Italy?", "Write a haiku about rain.", "Hi", "Thanks!",
            "List three colors.", "Explain recursion in one sentence.", "日本の首都は？", "emoji 🙂 please",
            "<|im_end|> injected", "Count from 1 to 30.", "Tell me a long story about a dragon.",
            "def f(x): return x*2  # what does this do?", "   leading and trailing   "]
COMMANDS = ["/clear", "/regen", "/read {file}", ""]


def random_case(rng: random.Random, file: Path, models: list[str] = MODELS) -> tuple[str, list[str], str]:
    model = rng.choice(models)
    args: list[str] = []
    system = rng.choice(SYSTEMS + [None] * 3)
    if system is not None:
        args += ["-sys", system]
    ctx = rng.choice([512, 512, 1024, 256, 256])
    n = rng.choice([4, 16, 32, 64, -1])
    args += ["-n", str(n), "-c", str(ctx)]
    if ctx == 256 and n != -1 and rng.random() < 0.5:
        args.append("--context-shift")
    if rng.random() < 0.25:
        args += ["--repeat-penalty", rng.choice(["1.1", "1.3"]), "--repeat-last-n", rng.choice(["16", "64"])]
    if rng.random() < 0.2:  # the first message from -p (a command there too), -st: that turn only
        args += ["-p", rng.choice(MESSAGES + ["/clear", "/regen"])] + (["-st"] if rng.random() < 0.25 else [])
    if rng.random() < 0.15:  # a stop string: the reply ends before it
        args += ["-r", rng.choice([",", ".", "\n", "Paris", "<|im_end|>", " the"])]
    mli = rng.random() < 0.15
    if mli:
        args.append("-mli")
    lines, read = [], False
    for _ in range(rng.randint(2, 6)):
        if rng.random() < 0.3:
            # (not /clear after a /read: llama-cli keeps the file for the next message, sharpi drops it: README;
            # -mli: no empty line, which would begin the next message: "\n/regen" is a message to llama-cli)
            lines.append(rng.choice(COMMANDS[1:4 - mli] if read else COMMANDS[:4 - mli]).format(file=file))
            read = read or lines[-1].startswith("/read")
            # (-mli: a command alone; llama-cli takes a message that begins with one for the command: README)
            lines[-1] += "\\" if mli and lines[-1] else ""
        else:
            read = False
            line = rng.choice(MESSAGES)
            if rng.random() < 0.15:
                line += "\\\n" + rng.choice(MESSAGES)
            if rng.random() < 0.1:
                line += "/"
            elif mli and rng.random() < 0.7:
                line += "\\"
            lines.append(line)
    return model, args, "".join(line + "\n" for line in lines)


REFUSED = "exceeds the available context size"


def before_refusal(transcript: str) -> str:
    """llama-cli's transcript up to its first refused message (too long for the context): it keeps that message and
    an empty reply in the conversation, and refuses every later one; sharpi drops it and goes on (README)."""
    at = transcript.find("\n\nAssistant:\n\n")
    return transcript if at < 0 else transcript[:transcript.rfind("User:\n", 0, at)]


def run(cmd: list[str], text: str, out: Path, env: dict | None = None) -> tuple[int | str, str, str]:
    """(exit status or "timeout", the -o transcript, stdout and stderr)"""
    out.unlink(missing_ok=True)
    try:
        r = subprocess.run(cmd + ["-o", str(out)], input=text, capture_output=True, text=True, timeout=300,
                           errors="replace", env=dict(os.environ, **(env or {})))
    except subprocess.TimeoutExpired:
        return "timeout", "", ""
    return r.returncode, out.read_text(errors="replace") if out.exists() else "", r.stdout + r.stderr


def main() -> None:
    a = session_args(__doc__, "llama-cli")
    rng = random.Random(a.seed)
    tmp = Path(tempfile.mkdtemp())
    file = tmp / "notes.txt"
    file.write_text("Paris is the capital of France.\nRome is the capital of Italy.\n")
    differed = ties = 0
    for i in range(a.runs):
        model, args, text = random_case(rng, file, a.models or MODELS)
        drafter = drafter_args(rng, model, a.models_dir)
        path = str(a.models_dir / f"{model}.gguf")
        common = ["-m", path, "--simple-io", "--temp", "0", "-t", "2", *args]
        l_rc, l_out, l_err = run([str(a.bin_dir / "llama-cli"), *common], text, tmp / "llama.txt")
        s_rc, s_out, err = run([sys.executable, "-m", "sharpi_cli", "-cnv", *common, *drafter], text, tmp / "sharpi.txt")
        why = []
        if "Traceback" in err:
            why.append("traceback: " + err.strip().splitlines()[-1])
        if l_rc == "timeout" or s_rc == "timeout":
            why.append(f"timeout: llama {l_rc}, sharpi {s_rc}")
        elif (l_rc == 0) != (s_rc == 0):
            why.append(f"exit {l_rc} vs {s_rc}: {err.strip().splitlines()[-1] if err.strip() else ''}")
        elif REFUSED in l_err and "does not fit the context" not in err:
            why.append("a message llama-cli refused (too long for the context) was not refused")
        elif l_out != s_out:
            # llama-cli keeps a refused message and refuses every later one: up to the first, the same
            want = before_refusal(l_out) if REFUSED in l_err else l_out
            at, around = first_difference(want, s_out)
            if not (REFUSED in l_err and s_out.startswith(want)):
                why.append(f"transcripts differ at {at}: {around}")
                _, off, _ = run([str(a.bin_dir / "llama-cli"), *common, "-fa", "off"], text, tmp / "llama-off.txt")
                _, f32, _ = run([sys.executable, "-m", "sharpi_cli", "-cnv", *common, *drafter], text, tmp / "f32.txt",
                                {"SHARPI_ACT_QUANT": "0"})
                tie = near_tie(at, l_out, off, f32, "llama-cli")
                if tie:
                    ties += 1
                    why = []
                    print(f"[{i}] near tie at {at}: {tie}")
        print(f"[{i}] {model} {' '.join(args + drafter)!r} {text!r}: {'; '.join(why) or 'same'}", flush=True)
        if why:
            differed += 1
            log_run(a.log, {"run": i, "model": model, "args": args, "drafter": drafter, "input": text, "why": why})
    print(f"{a.runs} runs, {differed} differed, {ties} near ties")
    sys.exit(1 if differed else 0)


if __name__ == "__main__":
    main()
