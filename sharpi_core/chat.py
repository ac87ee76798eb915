"""Chat templates from the GGUF, rendered with jinja2 in a sandbox (the GGUF is untrusted input)."""
from __future__ import annotations

from datetime import datetime
from functools import lru_cache

from .errors import SharpiError


def _raise(message: str):
    raise SharpiError(f"chat template: {message}")


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    # Same settings as Hugging Face's apply_chat_template; sandboxed: no attribute access to
    # Python internals, and immutable: templates cannot mutate the messages they are given.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise SharpiError(f"the model's chat template does not parse: {e}") from None


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "") -> str:
    """The conversation as the model expects it.

    For the SmolLM2 and Qwen2.5 templates, rendering a conversation prefix (with the generation
    prompt) is a string prefix of rendering the longer conversation, so the runner's KV-cache
    reuse across turns re-evaluates only the new turn (tested in tests/test_chat.py)."""
    from jinja2 import TemplateError
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token)
    except SharpiError:
        raise
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise SharpiError(f"the model's chat template failed to render: {type(e).__name__}: {e}") from None
