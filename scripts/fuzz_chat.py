"""Random conversations through real chat templates in sharpi's chat and in llama-cli's (libllama-common's
common_chat_templates_apply, scripts/llamacpp_chat_render.cpp): the prompts must be the same (a tool, not a test).

    python scripts/fuzz_chat.py LLAMA_CPP_SRC BIN_DIR [--templates DIR] [--seed 1] [--runs 40] [--log F]

Each template of DIR (default: the source tree's models/templates) gets --runs conversations: an optional system
message, one to four user turns with the replies between (some with a reasoning block, as the model wrote it), and
contents drawn from pieces that stress a template engine: leading and trailing white space and newlines, CR LF,
tabs, empty contents, quotes and backslashes, Jinja's own delimiters, HTML-like and chat-token-like text,
non-ASCII letters and emoji, long runs; under one of llama.cpp's reasoning settings
(scripts/llamacpp_chat_render.py's SETTINGS). A conversation llama.cpp refuses is skipped; one whose prompts differ is
cut down (messages dropped, contents shortened) to a smallest one that still differs, printed and written to --log.
Templates that differ on scripts/llamacpp_chat_render.py's own fixed conversations (README: what is left) are left
out unless named with --template. Exits 1 if any differed.
"""
from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from llamacpp_chat_render import SETTINGS, build, run, sharpi_render  # noqa: E402
from compare_llamacpp_logits import fuzz_args  # noqa: E402

# the templates whose reasoning or system handling differs for known reasons (README's Correctness section)
KNOWN = {"Apertus-8B-Instruct.jinja", "Kimi-K3.jinja", "NVIDIA-Nemotron-Nano-v2.jinja",
         "fireworks-ai-llama-3-firefunction-v2.jinja", "google-gemma-2-2b-it.jinja", "muse-glimmer.jinja",
         "unsloth-mistral-Devstral-Small-2507.jinja"}
PIECES = ["Hello", "How are you?", "a", "", " ", "  leading", "trailing  ", "\n", "\n\nafter newlines",
          "before newlines\n\n", "line one\nline two", "crlf\r\nline", "\ttab", "it's", "\"quoted\"", "back\\slash",
          "{{ not a variable }}", "{% if x %}y{% endif %}", "{# comment #}", "<b>bold</b>", "<|im_end|>", "</s>",
          "[INST]", "café", "中文字", "🙂👍🏽", "x" * 300, "1 + 1 = 2", "```python\nprint('hi')\n```", "- item\n- item",
          "Ünïcödé", "\u00a0nbsp", "end."]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(1, 4)))


def random_conversation(rng: random.Random) -> list[dict]:
    msgs = [{"role": "system", "content": random_text(rng)}] if rng.random() < 0.5 else []
    turns = rng.randint(1, 4)
    for t in range(turns):
        msgs.append({"role": "user", "content": random_text(rng)})
        if t < turns - 1:
            m = {"role": "assistant", "content": random_text(rng).strip() or "ok"}
            if rng.random() < 0.4:
                m["reasoning_content"] = random_text(rng).strip() or "hm"
            msgs.append(m)
    return msgs


def _case(template: str, msgs: list[dict], setting) -> dict:
    """A conversation as llamacpp_chat_render.cpp reads it."""
    reasoning, preserve, effort, kwargs = setting
    return {"template": template, "messages": msgs, "add_generation_prompt": True, "reasoning": reasoning,
            "preserve": preserve, "effort": effort, "kwargs": kwargs}


def _compare(template: str, msgs: list[dict], setting, got: dict) -> str | None:
    """Why sharpi's prompt differs from llama.cpp's answer `got` (None: the same, or llama.cpp refused it)."""
    if "error" in got:
        return None
    try:
        mine = sharpi_render(template, msgs, *setting)
    except Exception as e:  # noqa: BLE001 - a comparison tool: every failure is reported
        return f"sharpi raised {type(e).__name__}: {e}"
    if mine == got["prompt"]:
        return None
    i = next((k for k, (a, b) in enumerate(zip(mine, got["prompt"])) if a != b), min(len(mine), len(got["prompt"])))
    return f"at {i}: sharpi {mine[max(0, i - 30):i + 40]!r} llama.cpp {got['prompt'][max(0, i - 30):i + 40]!r}"


def differs(exe: Path, template: str, msgs: list[dict], setting) -> str | None:
    return _compare(template, msgs, setting, run(exe, [_case(template, msgs, setting)])[0])


def _chat_shaped(msgs: list[dict]) -> bool:
    """A conversation a chat holds: an optional system message, then user and assistant turns in turn, a user's last."""
    roles = [m["role"] for m in msgs]
    roles = roles[1:] if roles[:1] == ["system"] else roles
    return bool(roles) and all(r == ("user" if k % 2 == 0 else "assistant") for k, r in enumerate(roles)) \
        and roles[-1] == "user"


def shrink(exe: Path, template: str, msgs: list[dict], setting) -> list[dict]:
    """msgs with messages dropped (a user turn with the reply before it) and contents cut while they still differ."""
    changed = True
    while changed:
        changed = False
        for i in range(len(msgs)):
            for drop in ((i,), (i - 1, i)):
                t = [m for k, m in enumerate(msgs) if k not in drop]
                if drop[0] >= 0 and _chat_shaped(t) and differs(exe, template, t, setting):
                    msgs, changed = t, True
                    break
            if changed:
                break
        for i, m in enumerate(msgs):
            for key in ("content", "reasoning_content"):
                v = m.get(key)
                for cut in ([v[: len(v) // 2], v[len(v) // 2:], "x"] if v and len(v) > 1 else []):
                    t = [dict(mm) for mm in msgs]
                    t[i][key] = cut
                    if differs(exe, template, t, setting):
                        msgs, changed = t, True
                        break
    return msgs


def main() -> None:
    ap = fuzz_args(__doc__, "libllama-common", 40, "conversations per template")
    ap.add_argument("--templates", type=Path, help="a directory of *.jinja (default: SRC/models/templates)")
    ap.add_argument("--template", action="append", help="only these file names (KNOWN ones too)")
    a = ap.parse_args()
    files = sorted((a.templates or a.src / "models" / "templates").glob("*.jinja"))
    files = [f for f in files if (f.name in a.template if a.template else f.name not in KNOWN)]
    bad, n = [], 0
    with tempfile.TemporaryDirectory() as d:
        exe = build(a.src, a.bin, Path(d))
        for f in files:
            rng = random.Random(f"{a.seed}:{f.name}")
            template = f.read_text()
            todo = [(random_conversation(rng), rng.choice(SETTINGS)) for _ in range(a.runs)]
            for (msgs, setting), got in zip(todo, run(exe, [_case(template, m, st) for m, st in todo])):
                n += "error" not in got
                if _compare(template, msgs, setting, got) is None:
                    continue
                small = shrink(exe, template, msgs, setting)
                why = differs(exe, template, small, setting)
                print(f"{f.name}, settings {setting}: {why}\n    {json.dumps(small, ensure_ascii=False)}", flush=True)
                bad.append({"template": f.name, "setting": setting, "messages": small, "why": why})
            print(f"{f.name}: done ({n} prompts so far, {len(bad)} differ)", flush=True)
    if a.log:
        a.log.write_text(json.dumps(bad, indent=1, ensure_ascii=False) + "\n")
    print(f"{n} prompts on {len(files)} templates, {len(bad)} differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
