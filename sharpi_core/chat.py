"""Chat templates from the GGUF (`tokenizer.chat_template`), rendered with jinja2 in a sandbox.

The template is untrusted input, so it runs in jinja2's ImmutableSandboxedEnvironment: no access
to Python internals (`__class__`, `__subclasses__`, ...) and no mutation of the objects passed in.
The environment is set up the way Hugging Face's `apply_chat_template` sets it up (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a non-HTML-escaping `tojson`, and
a pass-through `{% generation %}` tag), so templates written for transformers render the same.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from .errors import SharpiError


class ChatTemplateError(SharpiError):
    """The model's chat template does not parse, fails to render, or raised an error itself."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"the model's chat template refused the conversation: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; chat templates want the plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ChatTemplateError(f"the model's chat template does not parse{where}: {e}") from None


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
        raise ChatTemplateError("the model's chat template failed to render: recursion too deep") from None
    except Exception as e:  # untrusted template code: any failure is the template's, reported as such
        raise ChatTemplateError(f"the model's chat template failed to render: {type(e).__name__}: {e}") from None
