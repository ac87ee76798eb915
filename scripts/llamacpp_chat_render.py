"""llama-cli's chat prompts against sharpi's: libllama-common's common_chat_templates_apply (llama-cli's server path,
--jinja) through scripts/llamacpp_chat_render.cpp, on conversations whose replies carry a reasoning block.

    python scripts/llamacpp_chat_render.py SRC_DIR BIN_DIR                  # record tests/data/llamacpp_chat_render.json
    python scripts/llamacpp_chat_render.py SRC_DIR BIN_DIR --templates DIR  # compare on every DIR/*.jinja, print a summary

SRC_DIR is a llama.cpp source tree (common/, include/, ggml/include/, vendor/), BIN_DIR holds its libllama-common (the
llama.cpp in llama-cpp-python, as the fixtures in ../shared/fixtures were built from). The recorded cases use the small
templates below (written for this test: today's date, enable_thinking's default, earlier reasoning kept or dropped by
preserve_thinking / clear_thinking, reasoning_effort / reasoning_strength, templates without a system role); with
--templates, a directory of real models' templates (llama.cpp's models/templates, say) is compared instead, nothing
written. Each case is a conversation as llama-cli holds it (a reply's reasoning in `reasoning_content`) and, for sharpi,
the reply as the model wrote it (`raw`), which sharpi's chat splits (sharpi_cli.chat.assistant_message).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "llamacpp_chat_render.json"

_TURNS = ("{%- for m in messages -%}"
          "{%- if m.role == 'assistant' -%}<|assistant|>"
          "{%- if m.reasoning_content and (preserve_thinking or loop.index0 > ns.last_user) -%}"
          "<think>{{ m.reasoning_content }}</think>{%- endif -%}{{ m.content }}<|end|>\n"
          "{%- else -%}<|{{ m.role }}|>{{ m.content }}<|end|>\n{%- endif -%}{%- endfor -%}")
_LAST_USER = ("{%- set ns = namespace(last_user=-1) -%}{%- for m in messages -%}"
              "{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}")
TEMPLATES = {
    # today's date in the system header (Llama 3.x: "Today Date: {{ date_string }}")
    "date": ("{{- bos_token -}}<|system|>Today: {{ date_string }} / {{ datetime }}<|end|>\n"
             "{%- for m in messages -%}<|{{ m.role }}|>{{ m.content }}<|end|>\n{%- endfor -%}"
             "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"),
    # thinks only when enable_thinking is passed (llama.cpp passes it where a template can think); earlier
    # replies' reasoning kept with preserve_thinking; the flags llama.cpp sets for that shown
    "think": (_LAST_USER + "{%- if clear_thinking is defined -%}[clear {{ clear_thinking }}, drop {{ drop_thinking }}, "
              "truncate {{ truncate_history_thinking }}, preserve {{ preserve_reasoning }}]{%- endif -%}"
              "{%- if reasoning_effort is defined -%}[effort {{ reasoning_effort }} / {{ reasoning_strength }}]{%- endif -%}"
              + _TURNS + "{%- if add_generation_prompt -%}<|assistant|>"
              "{%- if enable_thinking is defined and enable_thinking -%}<think>\n{%- else -%}<think></think>{%- endif -%}"
              "{%- endif -%}"),
    # thinks unless enable_thinking is false; earlier reasoning dropped when clear_thinking is true (GLM's way)
    "think-clear": (_LAST_USER + "{%- for m in messages -%}"
                    "{%- if m.role == 'assistant' -%}<|assistant|>"
                    "{%- if m.reasoning_content and not clear_thinking -%}<think>{{ m.reasoning_content }}</think>"
                    "{%- else -%}</think>{%- endif -%}{{ m.content }}\n"
                    "{%- else -%}<|{{ m.role }}|>{{ m.content }}\n{%- endif -%}{%- endfor -%}"
                    "{%- if add_generation_prompt -%}<|assistant|>"
                    "{%- if enable_thinking is defined and not enable_thinking -%}</think>{%- else -%}<think>{%- endif -%}"
                    "{%- endif -%}"),
    # Ministral / Magistral 3's shape (llama.cpp finds it by [SYSTEM_PROMPT], [TOOL_CALLS] and [ARGS]): contents as blocks
    "mistral-blocks": ("{#- [TOOL_CALLS] and [ARGS] would mark tool calls -#}"
                       "{%- for m in messages -%}{%- if m.role == 'user' -%}[INST]{{ m.content }}[/INST]"
                       "{%- else -%}{%- if m.role == 'system' -%}[SYSTEM_PROMPT]{%- endif -%}"
                       "{%- for b in m.content -%}{%- if b.type == 'thinking' -%}[THINK]{{ b.thinking }}[/THINK]"
                       "{%- elif b.type == 'text' -%}{{ b.text }}{%- endif -%}{%- endfor -%}"
                       "{%- if m.role == 'system' -%}[/SYSTEM_PROMPT]{%- else -%}{{ eos_token }}{%- endif -%}"
                       "{%- endif -%}{%- endfor -%}"),
    # LFM2.5's shape (llama.cpp finds it by its tool list's wording): the reasoning read as `thinking`
    "lfm-thinking": ("{#- List of tools: [ ... ] -#}{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
                     "{%- if m.thinking is defined -%}<think>{{ m.thinking }}</think>{%- endif -%}{{ m.content }}<|im_end|>\n"
                     "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"),
    # gpt-oss's harmony shape: the reasoning in an analysis channel, read as `thinking` (llama.cpp's gpt-oss path)
    "harmony": (_LAST_USER + "{%- for message in messages -%}"
                "{%- if message.role == 'assistant' -%}<|start|>assistant"
                "{%- if message.thinking is defined and (preserve_thinking or loop.index0 > ns.last_user) -%}"
                "<|channel|>analysis<|message|>{{ message.thinking }}<|end|><|start|>assistant{%- endif -%}"
                "<|channel|>final<|message|>{{ message.content }}<|end|>"
                "{%- else -%}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{%- endif -%}"
                "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"),
    # no system role: refuses it (Gemma 2's way) or never reads it
    "no-system-raise": ("{%- for m in messages -%}{%- if m.role == 'system' -%}{{ raise_exception('System role not "
                        "supported') }}{%- endif -%}<turn {{ m.role }}>{{ m.content }}</turn>\n{%- endfor -%}"
                        "{%- if add_generation_prompt -%}<turn assistant>{%- endif -%}"),
    # llama.cpp's Jinja trims C's white space only (not a no-break space, U+3000): the trim filter, the strip methods
    "trim": ("{%- for m in messages -%}<|{{ m.role }}|>[{{ m.content | trim }}][{{ m.content.strip() }}]"
             "[{{ m.content.lstrip() }}][{{ m.content.rstrip() }}][{{ m.content.strip(' .') }}]<|end|>\n{%- endfor -%}"
             "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"),
    # and changes the case of ASCII letters only, counts a string's length in bytes
    "case": ("{%- for m in messages -%}<|{{ m.role | upper }}|>[{{ m.content | lower }}][{{ m.content.upper() }}]"
             "[{{ m.content | title }}][{{ m.content.capitalize() }}][{{ m.content | length }}]<|end|>\n{%- endfor -%}"
             "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"),
    # StepFun 3.5's tool prompt (by which llama.cpp knows it): every content and reasoning trimmed before rendering
    "stepfun-trim": ("{#- You have access to the following functions in JSONSchema format -#}" + _LAST_USER + _TURNS +
                     "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"),
    "no-system-unread": ("{%- for m in messages -%}{%- if m.role != 'system' -%}<turn {{ m.role }}>{{ m.content }}</turn>\n"
                         "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}<turn assistant>{%- endif -%}"),
}
REASONING, CONTENT = "The user greets me.\nI should greet back.", "Hello! How can I help?"
CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "Hi"}],
    "system": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    "system alone": [{"role": "system", "content": "Be terse."}],
    "reasoned reply": [{"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING},
                       {"role": "user", "content": "Bye"}],
    "plain reply": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": CONTENT},
                    {"role": "user", "content": "Bye"}],
    "white space": [{"role": "system", "content": "\u00a0 Sé bref. \t"}, {"role": "user", "content": "  Hé, ça va\u3000\n"},
                    {"role": "assistant", "content": CONTENT + " \u00a0", "reasoning_content": REASONING},
                    {"role": "user", "content": "\tÀ bientôt, ÉLÉONORE.\r\n"}],
}
# (reasoning, preserve, effort, kwargs): -rea, --reasoning-preserve, --reasoning-effort, --chat-template-kwargs
SETTINGS = [("auto", None, None, {}), ("off", None, None, {}), ("on", None, None, {}), ("auto", False, None, {}),
            ("auto", True, "high", {}), ("auto", None, None, {"reasoning_effort": "low", "preserve_reasoning": False}),
            ("auto", None, None, {"enable_thinking": False}), ("on", None, None, {"clear_thinking": True})]


class _Tok:
    """bos_token / eos_token as the harness passes them."""
    bos_id, eos_id = 1, 2

    def token_text(self, i: int) -> str:
        return {1: "<BOS>", 2: "<EOS>"}[i]


def sharpi_render(template: str, conversation: list[dict], reasoning: str, preserve, effort, kwargs: dict) -> str:
    """The prompt sharpi's chat renders for the conversation: its replies as the model wrote them (a reasoning block
    in the template's tags, or none) kept as sharpi_cli.chat.assistant_message keeps them."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from sharpi_cli.chat import assistant_message, render_messages
    from sharpi_cli.options import RunOptions
    from sharpi_cli.inputs import template_vars
    from sharpi_core.reasoning import opens_block, thinking_tags
    o = RunOptions(reasoning=reasoning, reasoning_preserve=preserve, reasoning_effort=effort or "default",
                   chat_template_kwargs=json.dumps(kwargs) if kwargs else None)
    o.chat_template, o.template_vars, o.system_prompt = template, template_vars(o), None
    tags = thinking_tags(template)
    msgs: list[dict] = []
    for m in conversation:
        if m["role"] == "assistant":
            prompt = render_messages(o, _Tok(), msgs)
            raw, opened = m["content"], tags and opens_block(prompt, tags)
            if m.get("reasoning_content") and tags:  # (a template without tags: a model that writes no block)
                raw = ("" if opened else tags[0] + "\n") + m["reasoning_content"] + "\n" + tags[1] + "\n\n" + m["content"]
            elif opened:  # a block the prompt opened, closed at once
                raw = tags[1] + "\n\n" + m["content"]
            m = assistant_message(raw, tags, prompt)
        msgs.append(m)
    return render_messages(o, _Tok(), msgs)


def build(src: Path, lib: Path, dest: Path) -> Path:
    exe = dest / "llamacpp_chat_render"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{src / 'common'}", f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}",
                    f"-I{src / 'vendor'}", str(ROOT / "scripts" / "llamacpp_chat_render.cpp"), "-o", str(exe), f"-L{lib}",
                    "-lllama-common", "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}"], check=True)
    return exe


def cases(templates: dict) -> list[dict]:
    out = []
    for tname, src in templates.items():
        for cname, conv in CONVERSATIONS.items():
            for reasoning, preserve, effort, kwargs in SETTINGS:
                out.append({"template_name": tname, "template": src, "conversation": cname, "messages": conv,
                            "add_generation_prompt": True, "reasoning": reasoning, "preserve": preserve, "effort": effort,
                            "kwargs": kwargs})
    return out


def run(exe: Path, todo: list[dict]) -> list[dict]:
    keys = ("template", "messages", "add_generation_prompt", "reasoning", "preserve", "effort", "kwargs")
    lines = [json.dumps({k: c[k] for k in keys}) for c in todo]
    r = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    return [json.loads(line) for line in r.stdout.splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="llama.cpp source tree")
    ap.add_argument("bin", type=Path, help="llama.cpp build dir holding libllama-common")
    ap.add_argument("--templates", type=Path, help="compare on this directory's *.jinja instead of recording")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        exe = build(a.src, a.bin, Path(d))
        if a.templates:
            files = sorted(a.templates.glob("*.jinja"))
            todo = cases({f.name: f.read_text() for f in files})
            differ: dict[str, list[str]] = {}
            n = 0
            for c, got in zip(todo, run(exe, todo)):
                try:  # (a reasoned reply needs a template with reasoning tags; llama.cpp may refuse a conversation)
                    mine = sharpi_render(c["template"], c["messages"], c["reasoning"], c["preserve"], c["effort"], c["kwargs"])
                except Exception as e:  # noqa: BLE001 (a comparison tool: every failure is reported)
                    mine = f"error: {e}"
                if "error" in got:
                    continue
                n += 1
                if mine != got["prompt"]:
                    differ.setdefault(c["template_name"], []).append(
                        f"{c['conversation']}, -rea {c['reasoning']}, preserve {c['preserve']}, effort {c['effort']}, "
                        f"kwargs {c['kwargs']} (llama.cpp's enable_thinking {got['enable_thinking']})")
            print(f"{n} prompts, {sum(map(len, differ.values()))} differ; {len(files) - len(differ)} of {len(files)} "
                  "templates give llama.cpp's prompt in every case")
            for name, lines in differ.items():
                print(f"{name}: {len(lines)}\n  " + "\n  ".join(lines[:3]))
            return
        todo = cases(TEMPLATES)
        got = run(exe, todo)
    import time
    out = []
    for c, g in zip(todo, got):
        if "error" in g:
            c["error"] = g["error"]
        else:
            c["prompt"], c["enable_thinking"] = g["prompt"], g["enable_thinking"]
        del c["template"]
        out.append(c)
    OUT.write_text(json.dumps({"date_string": time.strftime("%d %b %Y"), "datetime": time.strftime("%b %d %Y"),
                               "templates": TEMPLATES, "cases": out}, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(out)} cases to {OUT}")


if __name__ == "__main__":
    main()
