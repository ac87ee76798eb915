"""Chat templates from the GGUF (`tokenizer.chat_template`) or named on the command line (llama.cpp's
built-in ones, written as Jinja), rendered with jinja2 in a sandbox.

The template is untrusted input, so it runs in jinja2's ImmutableSandboxedEnvironment: no access
to Python internals (`__class__`, `__subclasses__`, ...) and no mutation of the objects passed in.
The environment is set up the way Hugging Face's `apply_chat_template` sets it up (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a non-HTML-escaping `tojson`, and
a pass-through `{% generation %}` tag), so templates written for transformers render the same.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache, partial
from typing import Any

from .errors import SharpiError
from .libm import C_SPACE  # (C's isspace(): what llama.cpp's trims take off, its Jinja's too)


class ChatTemplateError(SharpiError):
    """The chat template (the model's, or --chat-template's) does not parse, fails to render, or raised
    an error itself."""


# llama.cpp's built-in templates (llama_chat_apply_template: what llama-completion renders for
# `--chat-template NAME` without --jinja), written as Jinja so that one renderer serves them all;
# checked text for text against llama.cpp (tests/data/llamacpp_chat_templates.json). llama.cpp
# trims C's isspace() bytes only, not Python's wider whitespace: hence trim's explicit characters.
_TRIMMED = r"(m.content | trim(' \t\n\v\f\r'))"
_EACH = "{%- for m in messages -%}"


def _then(text: str) -> str:
    """The end of the loop over messages, and the generation prompt."""
    return "{%- endfor -%}{%- if add_generation_prompt -%}{{- '" + text + "' -}}{%- endif -%}"


def _llama2(system: str) -> str:
    # BOS comes from the tokenizer; a turn after an assistant reply opens a new [INST]
    return ("{{- '[INST] ' -}}{%- set ns = namespace(inside=true) -%}" + _EACH
            + "{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- '[INST] ' -}}{%- endif -%}"
            + "{%- if m.role == 'system' -%}{{- " + system + " -}}"
            + r"{%- elif m.role == 'user' -%}{{- m.content + ' [/INST]' -}}"
            + "{%- else -%}{{- m.content + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}{%- endfor -%}")


BUILTIN_TEMPLATES = {
    "chatml": _EACH + r"{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}"
              + _then(r"<|im_start|>assistant\n"),
    # no system role: the system text (trimmed, concatenated) opens the next user turn
    "gemma": ("{%- set ns = namespace(system='') -%}" + _EACH
              + "{%- if m.role == 'system' -%}{%- set ns.system = ns.system + " + _TRIMMED + " -%}{%- else -%}"
              + "{%- set role = 'model' if m.role == 'assistant' else m.role -%}"
              + r"{{- '<start_of_turn>' + role + '\n' -}}"
              + r"{%- if ns.system and role != 'model' -%}{{- ns.system + '\n\n' -}}{%- set ns.system = '' -%}{%- endif -%}"
              + "{{- " + _TRIMMED + r" + '<end_of_turn>\n' -}}{%- endif -%}" + _then(r"<start_of_turn>model\n")),
    "llama2": _llama2(r"m.content + '\n'"),
    "llama2-sys": _llama2(r"'<<SYS>>\n' + m.content + '\n<</SYS>>\n\n'"),
    "llama3": (_EACH + r"{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + " + _TRIMMED
               + " + '<|eot_id|>' -}}" + _then(r"<|start_header_id|>assistant<|end_header_id|>\n\n")),
    "mistral-v7": (_EACH + "{%- if m.role == 'system' -%}{{- '[SYSTEM_PROMPT] ' + m.content + '[/SYSTEM_PROMPT]' -}}"
                   + "{%- elif m.role == 'user' -%}{{- '[INST] ' + m.content + '[/INST]' -}}"
                   + "{%- else -%}{{- ' ' + m.content + '</s>' -}}{%- endif -%}{%- endfor -%}"),
    "phi3": _EACH + r"{{- '<|' + m.role + '|>\n' + m.content + '<|end|>\n' -}}" + _then(r"<|assistant|>\n"),
    "phi4": (_EACH + "{{- '<|im_start|>' + m.role + '<|im_sep|>' + m.content + '<|im_end|>' -}}"
             + _then("<|im_start|>assistant<|im_sep|>")),
    "vicuna": (_EACH + r"{%- if m.role == 'system' -%}{{- m.content + '\n\n' -}}"
               + r"{%- elif m.role == 'user' -%}{{- 'USER: ' + m.content + '\n' -}}"
               + r"{%- elif m.role == 'assistant' -%}{{- 'ASSISTANT: ' + m.content + '</s>\n' -}}{%- endif -%}"
               + _then("ASSISTANT:")),
    "zephyr": _EACH + r"{{- '<|' + m.role + '|>\n' + m.content + '<|endoftext|>\n' -}}" + _then(r"<|assistant|>\n"),
}


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; chat templates want the plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# llama.cpp's Jinja works on C's bytes: it strips C's isspace() bytes where no characters are given (Python's str.strip
# takes Unicode's white space too: a no-break space, U+3000, ...) and changes the case of ASCII letters only (toupper /
# tolower on each byte: "é".upper() stays "é"), and counts a string's length in bytes; the filters and a string's
# methods as it has them
_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_UPPER = str.maketrans("abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _trim(value: Any, chars: str | None = None) -> str:
    return str(value).strip(C_SPACE if chars is None else chars)


def _length(value: Any) -> int:
    """A string's length in UTF-8 bytes (llama.cpp's Jinja counts bytes), anything else's len()."""
    return len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else len(value)


def _title(s: str) -> str:
    """Each character after C's white space (or first) upper-cased, every other one lower-cased (ASCII letters)."""
    out, cap = [], True
    for c in s:
        out.append(c.translate(_UPPER if cap else _LOWER))
        cap = c in C_SPACE
    return "".join(out)


_C_STRING = {"strip": lambda s, chars=None: s.strip(C_SPACE if chars is None else chars),
             "lstrip": lambda s, chars=None: s.lstrip(C_SPACE if chars is None else chars),
             "rstrip": lambda s, chars=None: s.rstrip(C_SPACE if chars is None else chars),
             "lower": lambda s: s.translate(_LOWER), "upper": lambda s: s.translate(_UPPER), "title": _title,
             "capitalize": lambda s: s[:1].translate(_UPPER) + s[1:].translate(_LOWER)}


# llama.cpp's common_chat_templates_init patches two templates' refusals of what its own messages hold: gpt-oss's of
# channel tags in a content, and Mistral's of an assistant message without content or tool calls
_PATCHES = (("<|channel|>", "in message.content or",
             "{%- if \"<|channel|>analysis<|message|>\" in message.content or "
             "\"<|channel|>final<|message|>\" in message.content %}"),
            ("[TOOL_CALLS]", "if (message['content'] is none or",
             "{%- if (message['content'] is none or message['content'] == '' or message['content']|length == 0) and "
             "(message['tool_calls'] is not defined or message['tool_calls'] is none or "
             "message['tool_calls']|length == 0) %}"))


def _patched(template: str) -> str:
    for mark, test, old in _PATCHES:
        if mark in template and test in template:
            template = template.replace(old, "{%- if false %}")
    return template


@lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks in
        transformers); here it just renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    class _Environment(ImmutableSandboxedEnvironment):
        def getattr(self, obj, attribute):
            if isinstance(obj, str) and attribute in _C_STRING:
                return partial(_C_STRING[attribute], obj)
            return super().getattr(obj, attribute)

    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.filters["trim"] = _trim
    for name in ("lower", "upper", "title", "capitalize"):
        env.filters[name] = lambda value, f=_C_STRING[name]: f(str(value))
    env.filters["length"] = env.filters["count"] = _length
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(_patched(template))
    except jinja2.TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ChatTemplateError(f"the chat template does not parse{where}: {e}") from None


def check_chat_template(template: str) -> None:
    """Compile the template now: a broken one fails at load, and the first turn is not delayed."""
    if not isinstance(template, str) or not template:
        raise ChatTemplateError("this model has no chat template")
    _compile(template)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, bos_token: str = "",
                eos_token: str = "", **extra: Any) -> str:
    """The conversation as the model expects it, rendered by the GGUF's chat template.

    `messages` are {"role", "content"} dicts; `extra` goes to the template as further variables
    (e.g. `tools`). Any failure of the template is a SharpiError (ChatTemplateError).

    Prefix property (what the runner's KV-cache reuse across turns relies on): for the SmolLM2 and
    Qwen2.5 templates, render(history + generation prompt) is a *string* prefix of
    render(history + assistant reply + next user turn) (tested in tests/test_chat.py). The generation
    prompt ends in "<|im_start|>assistant\\n", so the prefix's *token ids* are also a prefix of the
    longer rendering's ids as long as the reply does not start with whitespace (a leading newline
    could join the prompt's "\\n" in the BPE pre-tokenizer). The reply's ids as the model generated
    them need not equal its re-tokenization either, so a runner should keep the longest common
    prefix of the cached ids and the new ids rather than assume it. Templates that rewrite earlier
    turns (e.g. dropping past reasoning) break the string prefix too; neither model here does.
    """
    check_chat_template(template)
    compiled = _compile(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **extra)
    except SharpiError:
        raise
    except RecursionError:
        raise ChatTemplateError("the chat template failed to render: recursion too deep") from None
    except Exception as e:  # untrusted template code: any failure is the template's, reported as such
        raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from None


def handed_over(template: str, messages: list[dict]) -> list[dict]:
    """The messages as llama.cpp's specialized paths hand them to a template they recognize: Ministral / Magistral 3's
    ([SYSTEM_PROMPT], [TOOL_CALLS] and [ARGS], no [CALL_ID]) gets system and assistant contents as blocks, a `thinking`
    one from reasoning_content, then the text; LFM2's and LFM2.5's (their tool lists) and gpt-oss's (channels) the
    reasoning as `thinking` too; StepFun 3.5's (its tool prompt) every content and reasoning trimmed of C's white space;
    other templates the messages as they are."""
    if "You have access to the following functions in JSONSchema format" in template:
        messages = [_trimmed(m) for m in messages]
    if "[SYSTEM_PROMPT]" in template and "[TOOL_CALLS]" in template and "[ARGS]" in template and "[CALL_ID]" not in template:
        out = []
        for m in messages:
            if m.get("role") not in ("system", "assistant"):
                out.append(m)
                continue
            blocks = ([{"type": "thinking", "thinking": m["reasoning_content"]}]
                      if isinstance(m.get("reasoning_content"), str) else [])
            if isinstance(m.get("content"), str):
                blocks.append({"type": "text", "text": m["content"]})
            elif isinstance(m.get("content"), list):
                blocks += m["content"]
            out.append({**{k: v for k, v in m.items() if k != "reasoning_content"}, "content": blocks})
        return out
    if (("<|tool_list_start|>" in template and "<|tool_list_end|>" in template) or "List of tools: [" in template
            or "<|channel|>" in template):  # (the last: gpt-oss's harmony template)
        return [{**m, "thinking": m["reasoning_content"]} if isinstance(m.get("reasoning_content"), str) else m
                for m in messages]
    return messages


def _trimmed(m: dict) -> dict:
    out = dict(m)
    for key in ("content", "reasoning_content"):
        if isinstance(m.get(key), str):
            out[key] = m[key].strip(C_SPACE)
    if isinstance(m.get("content"), list):
        out["content"] = [{**b, "text": b["text"].strip(C_SPACE)}
                          if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) else b
                          for b in m["content"]]
    return out


@lru_cache(maxsize=8)
def _supports_thinking(template: str, variables: str) -> bool:
    from .reasoning import thinking_tags
    if thinking_tags(template):
        return True
    one, v = [{"role": "user", "content": "Hi"}], json.loads(variables)
    try:
        return (render_chat(template, one, True, **v, enable_thinking=True)
                != render_chat(template, one, True, **v, enable_thinking=False))
    except SharpiError:
        return False


@lru_cache(maxsize=8)
def _supports_system_role(template: str, variables: str) -> bool:
    mark = "\x02sharpi system message\x03"
    try:
        msgs = handed_over(template, [{"role": "system", "content": mark}, {"role": "user", "content": "Hi"}])
        return mark in render_chat(template, msgs, True, **json.loads(variables))
    except SharpiError:
        return False


def system_role_merged(template: str, messages: list[dict], **variables: Any) -> list[dict]:
    """llama.cpp's way with a template that has no system role (its system message unused, or refused, as Gemma 2's
    raises): a leading system message goes before the next message's content, a newline between (alone, it goes)."""
    if not messages or messages[0].get("role") != "system":
        return messages
    if _supports_system_role(template, json.dumps(variables, sort_keys=True, default=str)):
        return messages
    if len(messages) == 1:
        return []
    return [{**messages[1], "content": f"{messages[0]['content']}\n{messages[1]['content']}"}, *messages[2:]]


def supports_thinking(template: str, **variables: Any) -> bool:
    """Whether a chat template can think, as near as sharpi gets to llama.cpp's test (its parsers' analysis of
    the template), whose answer is the enable_thinking it passes when -rea is auto: the template writes a
    reasoning block's tags (thinking_tags), or its one-turn prompt changes with enable_thinking."""
    v = {k: x for k, x in variables.items() if k != "enable_thinking"}
    return _supports_thinking(template, json.dumps(v, sort_keys=True, default=str))


def chat_template_option(value: str) -> str:
    """--chat-template's value as a template: a built-in's name, or Jinja text, checked the way llama.cpp
    checks it (a one-message conversation must render). A bare word that names no built-in is refused
    rather than taken as a template that renders that word."""
    if value.strip() in BUILTIN_TEMPLATES:
        template = BUILTIN_TEMPLATES[value.strip()]
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ChatTemplateError(f"'{value}' is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
                                "nor a Jinja template")
    render_chat(template, [{"role": "user", "content": "test"}])
    return template
