"""Record llama.cpp's chat-mode references (tests/data/llamacpp_chat.json): for each case, the prompt
token ids llama.cpp builds from the GGUF's chat template (`--jinja`: the template itself, like
sharpi, rather than llama.cpp's built-in look-alikes) or from a built-in template named with
`--chat-template NAME`, and its greedy reply.

    python scripts/llamacpp_chat_ref.py BIN_DIR [--models-dir ~/.cache/sharpi/models]

BIN_DIR holds `llama-completion` (built from the llama.cpp in llama-cpp-python, as the fixtures in
../shared/fixtures were). Each case runs
`llama-completion -m M -cnv -st (--jinja | --chat-template NAME) [-sys S] -p USER --temp 0 -n N -c 512 -t 2 --verbose-prompt
--no-display-prompt`; the ids come from the verbose prompt listing on stderr, the reply from stdout
(the tool appends " [end of text]" when the model ended its turn, then blank lines).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "llamacpp_chat.json"
N_PREDICT = 32
# (model, system prompt or None, user message, template): template None is the GGUF's own (`--jinja`;
# chatml for a model without one, llama.cpp's fallback), a name is llama.cpp's built-in template of that
# name (`--chat-template NAME` without --jinja, the only way llama.cpp reads a name)
CASES = [
    ("smollm2-135m-instruct-q4_1", None, "What is the capital of France?", None),
    ("smollm2-135m-instruct-q4_1", "You are a concise assistant. Answer in one sentence.",
     "What is the capital of France?", None),
    ("qwen2.5-coder-1.5b-instruct-q4_k_m", None, "Write a Python function that returns the square of x.", None),
    ("qwen2.5-coder-0.5b-instruct-q4_k_m", "You answer with code only.", "Reverse a string in Python.", None),
    ("gemma3-270m-q4_k_m", "Answer briefly.", "What is the capital of France?", None),
    ("gemma3-270m-q4_k_m", "Answer briefly.", "What is the capital of France?", "gemma"),
    ("smollm2-135m-instruct-q4_1", "Be brief.", "Name a color.", "llama3"),
]
END = " [end of text]\n"


def record(binary: Path, model: Path, system: str | None, user: str, template: str | None) -> dict:
    cmd = [str(binary), "-m", str(model), "-cnv", "-st", *(["--chat-template", template] if template else ["--jinja"]),
           *(["-sys", system] if system else []),
           "-p", user, "--temp", "0", "-n", str(N_PREDICT), "-c", "512", "-t", "2", "--verbose-prompt",
           "--no-display-prompt"]
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    listing = r.stderr.split("number of tokens in prompt", 1)[1].split("sampler seed", 1)[0]
    ids = [int(t) for t in re.findall(r"^\S+ I\s+(\d+) -> ", listing, flags=re.M)]
    if END in r.stdout:
        reply, ended = r.stdout[:r.stdout.rindex(END)], True
    else:
        if not r.stdout.endswith("\n\n"):
            raise SystemExit(f"unexpected output tail: {r.stdout[-40:]!r}")
        reply, ended = r.stdout[:-2], False
    return {"system": system, "user": user, "chat_template": template, "n_predict": N_PREDICT, "prompt_ids": ids, "reply": reply,
            "ended": ended}


def completion_args(doc: str) -> argparse.Namespace:
    """The arguments of the scripts that record llama-completion's output: BIN_DIR [--models-dir DIR]."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("bin_dir", type=Path)
    ap.add_argument("--models-dir", type=Path, default=Path.home() / ".cache" / "sharpi" / "models")
    return ap.parse_args()


def save(path: Path, data) -> None:
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}")


def main() -> None:
    a = completion_args(__doc__)
    out: dict[str, list] = {}
    for model, system, user, template in CASES:
        rec = record(a.bin_dir / "llama-completion", a.models_dir / f"{model}.gguf", system, user, template)
        out.setdefault(model, []).append(rec)
        print(f"{model}: {len(rec['prompt_ids'])} prompt ids, reply {rec['reply'][:40]!r}...")
    save(OUT, out)


if __name__ == "__main__":
    main()
