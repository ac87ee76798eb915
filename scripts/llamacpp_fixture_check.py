#!/usr/bin/env python3
"""How well does a llama.cpp build on this machine reproduce the fixtures' greedy continuations?

    python scripts/llamacpp_fixture_check.py BIN_DIR [-- EXTRA_LLAMA_ARGS ...]

Runs BIN_DIR/llama-completion exactly as ../shared/fixtures/README.md says the fixtures were made
(`-p PROMPT -n 32 --temp 0 -no-cnv --no-display-prompt -c 512`, 2 threads) and compares the first
16 generated tokens' text with the fixture, the criterion tests/test_model.py applies to sharpi.
The fixtures' greedy text is an oracle only up to the noise of llama.cpp's own arithmetic: a build
with other kernels (weight repacking on or off, another SIMD path, another version) picks other
tokens at near-ties too. This script measures that noise; it never builds or installs llama.cpp.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compare_llamacpp_logits import FIXTURES  # noqa: E402
from sharpi_core.gguf_file import GGUFFile  # noqa: E402
from sharpi_core.registry import resolve_model  # noqa: E402
from sharpi_core.tokenizer import Tokenizer  # noqa: E402

N_COMPARE = 16


def first_tokens_text(tok: Tokenizer, text: str, n: int) -> str:
    return tok.decode(tok.encode(text, add_special=False, parse_special=False)[:n])


def main() -> None:
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        raise SystemExit(__doc__)
    exe = Path(args[0]) / "llama-completion"
    extra = args[2:] if len(args) > 1 and args[1] == "--" else args[1:]
    if not exe.exists():
        raise SystemExit(f"not available: {exe}")
    ref = json.loads(FIXTURES.read_text())
    total = same = 0
    for name, d in ref.items():
        path = resolve_model(name)
        tok = Tokenizer.from_gguf(GGUFFile(path))
        for case in d["greedy"]:
            r = subprocess.run([str(exe), "-m", str(path), "-p", case["prompt"], "-n", str(case["n"]), "--temp", "0",
                                "-no-cnv", "--no-display-prompt", "-c", "512", "-t", "2", *extra],
                               capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if r.returncode:
                raise SystemExit(f"llama-completion failed ({r.returncode}) on {name}: {r.stderr[-400:]}")
            want = first_tokens_text(tok, case["text"], N_COMPARE)
            ok = r.stdout.startswith(want)
            total += 1
            same += ok
            print(f"{'same' if ok else 'DIFF'}  {name}  {case['prompt'][:32]!r}"
                  + ("" if ok else f"\n      fixture: {want!r}\n      here:    {r.stdout[:len(want) + 20]!r}"), flush=True)
    print(f"{same}/{total} fixture continuations reproduced over their first {N_COMPARE} tokens")


if __name__ == "__main__":
    main()
