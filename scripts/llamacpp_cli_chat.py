"""Record llama-cli's conversations (tests/data/llamacpp_cli_chat.json): for each case, the transcript
`llama-cli -m M --simple-io --temp 0 -t 2 ARGS -o FILE` writes with the user's lines on stdin (messages, /regen,
/clear, lines ending in '\\'). tests/test_cli_chat.py runs `sharpi -cnv` on the same input and wants the same file.

    python scripts/llamacpp_cli_chat.py BIN_DIR [--models-dir ~/.cache/sharpi/models]

BIN_DIR holds `llama-cli`, built from the llama.cpp in llama-cpp-python (as the fixtures in ../shared/fixtures
were) with -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF (its chat runs on the server's
code, which the UI assets are not needed for). scripts/fuzz_cli_chat.py draws random conversations the same way.
"""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from llamacpp_chat_ref import completion_args, save
from llamacpp_interactive import QWEN, SMOL

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "llamacpp_cli_chat.json"
# (name, model, args after -m, the user's input)
CASES = [
    # /regen answers the same conversation again; /clear starts over (the system prompt stays)
    ("regen-clear", SMOL, ["-sys", "Be brief.", "-n", "32", "-c", "512"],
     "What is the capital of France?\n/regen\nAnd of Italy?\n/clear\nHi\n"),
    # a reply -n cuts inside a character ends before it: in the transcript and in the next turn's prompt
    ("cut-character", SMOL, ["-sys", "Réponds en français.", "-n", "32", "-c", "512"], "日本の首都は？\nThanks!\n"),
    # a message over two lines ('\'), one ended by '/', the samplers' penalties over the turns
    ("lines-penalties", SMOL, ["-n", "24", "-c", "512", "--repeat-penalty", "1.3", "--repeat-last-n", "64"],
     "List three colors.\\\nThen three fruits.\nThanks!/\n"),
    # -mli: lines go on until one ends in '\'
    ("multiline", SMOL, ["-mli", "-n", "24", "-c", "512"], "Write a haiku\nabout rain.\\\nAnother one.\\\n"),
    # -r: a reply -n ends while its text may be beginning the stop string loses the text held back for it (from the
    # token that began it: " France is" here); one an end-of-generation token ends shows it ("Paris." of "Paris.\n")
    ("stop-held-at-limit", SMOL, ["-sys", "Be brief.", "-n", "5", "-c", "512", "-r", " France is Paris!"],
     "What is the capital of France?\nAnd of Italy?\n"),
    ("stop-held-at-end", SMOL, ["-sys", "Be brief.", "-n", "32", "-c", "512", "-r", "Paris.\n"],
     "What is the capital of France?\nAnd of Italy?\n"),
    # the Qwen template over two turns and a /regen of the second
    ("qwen-turns", QWEN, ["-sys", "You answer with code only.", "-n", "48", "-c", "512"],
     "Reverse a string in Python.\nNow in C.\n/regen\n"),
]


def record(binary: Path, model: Path, args: list[str], text: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "chat.txt"
        cmd = [str(binary), "-m", str(model), "--simple-io", "--temp", "0", "-t", "2", *args, "-o", str(out)]
        r = subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        return {"args": args, "input": text, "transcript": out.read_text()}


def main() -> None:
    a = completion_args(__doc__)
    out = []
    for name, model, args, text in CASES:
        rec = record(a.bin_dir / "llama-cli", a.models_dir / f"{model}.gguf", args, text)
        out.append({"name": name, "model": model, **rec})
        print(f"{name}: {len(rec['transcript'])} characters")
    save(OUT, out)


if __name__ == "__main__":
    main()
