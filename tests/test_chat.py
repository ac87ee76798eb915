"""Chat template rendering (sandboxed) for the models that have one."""
from __future__ import annotations

import pytest

from conftest import QWEN05, SMOL, model_path
from sharpi_core.chat import render_chat
from sharpi_core.errors import SharpiError
from sharpi_core.gguf_file import GGUFFile


def template(name):
    return GGUFFile(model_path(name)).get("tokenizer.chat_template")


@pytest.mark.parametrize("name", [SMOL, pytest.param(QWEN05, marks=pytest.mark.slow)])
def test_render_and_prefix_property(name):
    t = template(name)
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    a = render_chat(t, turn1)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in a and a.endswith("<|im_start|>assistant\n")
    turn2 = turn1 + [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    b = render_chat(t, turn2)
    assert b.startswith(a) and b.endswith("<|im_start|>assistant\n") and "Bye" in b


def test_smollm_default_system_prompt():
    a = render_chat(template(SMOL), [{"role": "user", "content": "Hi"}])
    assert a.startswith("<|im_start|>system\n") and "<|im_start|>user\nHi<|im_end|>" in a


def test_sandbox_blocks_python_internals():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(SharpiError):
        render_chat(evil, [{"role": "user", "content": "x"}])


def test_template_errors_are_user_errors():
    with pytest.raises(SharpiError, match="does not parse"):
        render_chat("{% for %}", [])
    with pytest.raises(SharpiError, match="chat template: nope"):
        render_chat("{{ raise_exception('nope') }}", [])
