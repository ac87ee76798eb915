"""Chat template rendering (sandboxed jinja2) with the templates stored in the GGUFs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import QWEN05, SMOL, model_path
from sharpi_core.chat import ChatTemplateError, render_chat
from sharpi_core.errors import SharpiError
from sharpi_core.gguf_file import GGUFFile
from sharpi_core.tokenizer import Tokenizer

_GGUF: dict[str, GGUFFile] = {}


def gguf(name: str) -> GGUFFile:
    if name not in _GGUF:
        _GGUF[name] = GGUFFile(model_path(name))  # fetched through the registry when absent
    return _GGUF[name]


SYS = {"role": "system", "content": "Be brief."}
U1 = {"role": "user", "content": "Hi"}
A1 = {"role": "assistant", "content": "Hello! How can I help?"}
U2 = {"role": "user", "content": "Bye"}


@pytest.mark.parametrize("name", [SMOL, QWEN05])
def test_render_system_user_assistant(name):
    t = gguf(name).get("tokenizer.chat_template")
    out = render_chat(t, [SYS, U1, A1, U2])
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                   "<|im_start|>assistant\n")
    assert not render_chat(t, [SYS, U1], add_generation_prompt=False).endswith("assistant\n")


@pytest.mark.parametrize("name", [SMOL, QWEN05])
def test_prefix_property_for_kv_cache_reuse(name):
    """Turn 1's prompt is a string prefix of turn 2's, and (reply not starting with whitespace)
    its token ids are a prefix of turn 2's ids."""
    g = gguf(name)
    t = g.get("tokenizer.chat_template")
    tok = Tokenizer.from_gguf(g)
    for history in ([SYS, U1], [U1]):  # with and without a system prompt (default one inserted)
        first = render_chat(t, history)
        second = render_chat(t, history + [A1, U2])
        assert second.startswith(first)
        a, b = tok.encode(first), tok.encode(second)
        assert b[:len(a)] == a


def test_default_system_prompts():
    s = render_chat(gguf(SMOL).get("tokenizer.chat_template"), [U1])
    assert s.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "<|im_start|>user\nHi" in s
    q = render_chat(gguf(QWEN05).get("tokenizer.chat_template"), [U1])
    assert q.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


def test_hf_environment_features():
    t = ("{{ bos_token }}{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}"
         "{% if loop.index == 2 %}{% break %}{% endif %}{% endfor %}\n  {% if true %}\n{{ messages[0] | tojson }}"
         "{% endif %}|{{ strftime_now('%Y')|length }}")
    msgs = [{"role": "user", "content": "<a&b>"}, {"role": "user", "content": "é"}, {"role": "user", "content": "z"}]
    # loop controls, the generation tag, trim/lstrip blocks, non-HTML-escaping unicode tojson
    assert render_chat(t, msgs, bos_token="<s>") == '<s>[<a&b>][é]{"role": "user", "content": "<a&b>"}|4'
    assert render_chat("{{ tools[0] }}", [], tools=["t"]) == "t"


def test_sandbox_blocks_python_internals_and_mutation():
    with pytest.raises(SharpiError, match="unsafe"):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [U1])
    with pytest.raises(SharpiError, match="unsafe"):
        render_chat("{% set x = messages.append(1) %}", [U1])


def test_template_errors_are_user_errors():
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat("{% for %}", [])
    with pytest.raises(ChatTemplateError, match="refused the conversation: nope"):
        render_chat("{{ raise_exception('nope') }}", [])
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        render_chat("{{ 1 / 0 }}", [])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(None, [U1])


# llama.cpp's chat turns (`llama-completion -cnv -st --jinja`), recorded by scripts/llamacpp_chat_ref.py
CHAT_REF = json.loads((Path(__file__).parent / "data" / "llamacpp_chat.json").read_text())
CHAT_CASES = [pytest.param(name, i, id=f"{name.split('-')[0]}-{name.split('-')[-3]}-{i}",
                           marks=() if name == SMOL else (pytest.mark.slow,))
              for name, cases in CHAT_REF.items() for i in range(len(cases))]


@pytest.mark.parametrize("name,i", CHAT_CASES)
def test_chat_turn_is_llama_cpp_s(name, i):
    """The GGUF's template renders to llama.cpp's prompt ids (default system prompts included), and the
    greedy reply is llama.cpp's, text and end of turn."""
    from types import SimpleNamespace

    from conftest import loaded
    from sharpi_cli.chat import encode_chat, render_messages
    from sharpi_core.generate import Generator
    from sharpi_core.sampling import SamplingParams
    case = CHAT_REF[name][i]
    model, tok = loaded(name)
    o = SimpleNamespace(system_prompt=case["system"])
    ids = encode_chat(tok, render_messages(o, tok, [{"role": "user", "content": case["user"]}]))
    assert ids == case["prompt_ids"]
    res = Generator(model, model.new_cache(512), tok, SamplingParams(temp=0)).generate(ids, case["n_predict"])
    assert res.text == case["reply"]
    assert res.stop_reason == ("eos" if case["ended"] else "n_predict")
