"""Record llama-completion's interactive-mode transcripts (tests/data/llamacpp_interactive.json): for each
case, what `llama-completion -m M -no-cnv --simple-io --temp 0 -t 2 ARGS` writes on stdout when its stdin
holds INPUT (the user's lines), up to its "EOF by user" line. tests/test_interactive.py runs `sharpi -m M
ARGS` on the same input and wants the same text.

    python scripts/llamacpp_interactive.py BIN_DIR [--models-dir ~/.cache/sharpi/models]

BIN_DIR holds `llama-completion` (built from the llama.cpp in llama-cpp-python, as the fixtures in
../shared/fixtures were). --simple-io: without it llama.cpp's console echoes piped input from another
thread than its log's, so the echo lands anywhere in the text (a terminal shows typed lines anyway).
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from llamacpp_chat_ref import completion_args, save

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "llamacpp_interactive.json"
SMOL, GEMMA, QWEN = "smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m"
BOB = ("Transcript of a dialog between User and Bob, a helpful assistant.\n\n"
       "User: Hello, Bob.\nBob: Hello. How may I help you today?\nUser:")
CHATML = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
CHAT_DONE = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
# (name, model, args after -m, the user's input)
CASES = [
    # a prompt ending in the reverse prompt hands control over at once; an empty line hands it back
    ("bob", SMOL, ["-i", "-r", "User:", "--in-prefix", " ", "--in-suffix", "Bob:", "-p", BOB, "-n", "40", "-c", "512"],
     "Tell me about Paris.\n\nWhat else?\n"),
    # the same with penalties: each input starts the samplers over
    ("bob-penalties", SMOL, ["-i", "-r", "User:", "--in-prefix", " ", "--in-suffix", "Bob:", "-p", BOB, "-n", "40", "-c", "512",
                             "--repeat-penalty", "1.3", "--presence-penalty", "0.5", "--frequency-penalty", "0.2"],
     "Tell me about Paris.\nWhat is the best food there?\n\nOk.\n"),
    # an end of generation queues the first reverse prompt; control tokens in prefix/suffix, escapes in them
    ("chatml-eog", SMOL, ["-i", "-r", "<|im_start|>user\\n", "--in-suffix", "<|im_end|>\\n<|im_start|>assistant\\n",
                          "-p", CHATML, "-n", "64", "-c", "512"],
     "And what is 3+3?\nThanks! Bye.\n"),
    ("chatml-eog-special", SMOL, ["-i", "-sp", "-r", "<|im_start|>user\n", "--in-suffix", "<|im_end|>\n<|im_start|>assistant\n",
                                  "-p", CHATML, "-n", "48", "-c", "512"],
     "And 10 times 10?\n"),
    # a reverse prompt of a control token and text, no -sp: matched in the text with control tokens written out
    # (the model writes `<|im_start|>user` after a finished reply), shown or not
    ("chatml-control-reverse", SMOL, ["-i", "-r", "<|im_start|>user", "--in-suffix", "<|im_end|>\n<|im_start|>assistant\n",
                                      "-p", CHAT_DONE, "-n", "40", "-c", "512"],
     "\nWhat is 2+2?\n"),
    # -if on a base model; -n spent mid-sentence hands control over; '\' goes on to the next line, '/' ends the
    # input without a newline; an input longer than the budget left asks again at once
    ("gemma-first", GEMMA, ["-if", "-p", "The following is a list of facts about the world.\n", "-n", "12", "-c", "512"],
     "1. Paris is the capital of\n\n2. The sun is a\\\nvery/\n3. Water boils at one hundred degrees Celsius at sea level, and freezes at zero\n\n"),
    # an empty first input: the model goes on from the prompt's own logits
    ("smol-first-empty", SMOL, ["-if", "-p", "The capital of France is", "-n", "8", "-c", "512"], "\n Its river is\n\n"),
    # multi-line input, BOS before each input, a reverse prompt that is one token (a newline)
    ("gemma-mli-bos", GEMMA, ["-i", "-mli", "--in-prefix-bos", "--in-prefix", "Q: ", "--in-suffix", "\nA:", "-r", "\n",
                              "-p", "Q: What is the tallest mountain?\nA:", "-n", "24", "-c", "512"],
     "Which river is the longest?\\\n\nWhat is\nthe largest ocean?\\\n"),
    # a small context: the input goes past it and the context shifts (--keep -1: the prompt stays)
    ("qwen-shift", QWEN, ["-i", "-r", "User:", "--in-prefix", " ", "--in-suffix", "Bob:", "-p", BOB, "-n", "96", "-c", "256",
                          "--context-shift", "--keep", "-1"],
     "Write a long poem about the sea.\n\nGo on.\n\nMore.\n"),
    # -n spent inside a character: the next stretch finishes it after an empty line (one byte stream); after an
    # input its bytes are what is left of it (each piece shown as U+FFFD, as the text here is read)
    ("smol-cut-character", SMOL, ["-i", "-p", "日本の首都は", "-n", "4", "-c", "512"], "\n\nHi\n\n"),
    # and without --context-shift the session ends when the context is full
    ("gemma-full", GEMMA, ["-i", "-r", "THE END", "-p", "Once upon a time", "-n", "-1", "-c", "256"], "\n\n"),
]


def record(binary: Path, model: Path, args: list[str], text: str) -> dict:
    cmd = [str(binary), "-m", str(model), "-no-cnv", "--simple-io", "--temp", "0", "-t", "2", *args]
    r = subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=600, errors="replace")
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    out = r.stdout
    if not out.endswith("\n\n"):
        raise SystemExit(f"unexpected output tail: {out[-40:]!r}")
    out = out[:-2]
    eof = out.endswith("EOF by user\n")
    return {"args": args, "input": text, "transcript": out.removesuffix("EOF by user\n"), "eof": eof,
            "context_full": "context full" in r.stderr}


def main() -> None:
    a = completion_args(__doc__)
    out = []
    for name, model, args, text in CASES:
        rec = record(a.bin_dir / "llama-completion", a.models_dir / f"{model}.gguf", args, text)
        out.append({"name": name, "model": model, **rec})
        print(f"{name}: {len(rec['transcript'])} characters, eof {rec['eof']}, context full {rec['context_full']}")
    save(OUT, out)


if __name__ == "__main__":
    main()
