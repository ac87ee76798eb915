"""Record llama.cpp's built-in chat templates (tests/data/llamacpp_chat_templates.json): for each
template name sharpi knows (sharpi_core.chat.BUILTIN_TEMPLATES) and each conversation below, the
text llama.cpp's llama_chat_apply_template renders (the templates llama-completion uses for
`--chat-template NAME` without --jinja).

    python scripts/llamacpp_chat_templates.py SRC_DIR BIN_DIR

SRC_DIR is a llama.cpp source tree (its include/ and ggml/include/), BIN_DIR holds its libllama
(the llama.cpp in llama-cpp-python, as the fixtures in ../shared/fixtures were built from).
Compiles scripts/llamacpp_chat_template.c into a temporary directory and runs it once per case.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from compare_llamacpp_logits import build  # noqa: E402
from sharpi_core.chat import BUILTIN_TEMPLATES  # noqa: E402

OUT = ROOT / "tests" / "data" / "llamacpp_chat_templates.json"
# (messages, add_generation_prompt): system and user turns, whitespace some templates trim (C's isspace),
# non-ASCII text, two system messages, a conversation ending on the assistant's turn
CONVERSATIONS = [
    ([("user", "Hello")], True),
    ([("system", "You are terse."), ("user", "What is 2+2?")], True),
    ([("system", "  Be brief.\n"), ("user", " Hi there \n"), ("assistant", "Hello! How can I help?"),
      ("user", "Tell me a joke.")], True),
    ([("system", "  Be brief.\n"), ("user", " Hi there \n"), ("assistant", "Hello! How can I help?"),
      ("user", "Tell me a joke.")], False),
    ([("user", "Line one\nLine two\t"), ("assistant", " ok \x0b"), ("user", "más café ☕\u00a0")], True),
    ([("system", "A."), ("system", " B."), ("user", "x")], True),
    ([("user", "first"), ("assistant", "reply"), ("user", "second"), ("assistant", "reply two")], False),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="llama.cpp source tree")
    ap.add_argument("bin", type=Path, help="llama.cpp build dir holding libllama")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        exe = build(a.src, a.bin, Path(d), "llamacpp_chat_template")
        cases = []
        for name in BUILTIN_TEMPLATES:
            for messages, add in CONVERSATIONS:
                args = [str(exe), name, str(int(add))] + [s for m in messages for s in m]
                text = subprocess.run(args, check=True, capture_output=True).stdout.decode("utf-8")
                cases.append({"name": name, "add_generation_prompt": add,
                              "messages": [{"role": r, "content": c} for r, c in messages], "text": text})
    OUT.write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
