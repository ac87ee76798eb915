"""Chat template rendering (sandboxed jinja2) with the templates stored in the GGUFs and llama.cpp's built-in ones."""
from __future__ import annotations

import importlib.util
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


# llama.cpp's built-in templates on 7 conversations each, recorded by scripts/llamacpp_chat_templates.py
BUILTIN_REF = json.loads((Path(__file__).parent / "data" / "llamacpp_chat_templates.json").read_text())


def test_builtin_templates_render_as_llama_cpp_s():
    """sharpi's Jinja versions of llama.cpp's named templates render its text exactly: trims, system
    prompts folded into a user turn (gemma, llama2), roles without a case (vicuna), no generation prompt."""
    from sharpi_core.chat import BUILTIN_TEMPLATES
    assert {c["name"] for c in BUILTIN_REF} == set(BUILTIN_TEMPLATES)
    for c in BUILTIN_REF:
        got = render_chat(BUILTIN_TEMPLATES[c["name"]], c["messages"], c["add_generation_prompt"])
        assert got == c["text"], (c["name"], c["messages"], c["add_generation_prompt"])


def test_chat_template_option_takes_names_and_jinja():
    from sharpi_core.chat import BUILTIN_TEMPLATES, chat_template_option
    assert chat_template_option("gemma") == BUILTIN_TEMPLATES["gemma"]
    own = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert chat_template_option(own) == own
    with pytest.raises(ChatTemplateError, match="neither a built-in template"):
        chat_template_option("llama-3")  # a misspelt name would otherwise be a template that renders "llama-3"
    with pytest.raises(ChatTemplateError, match="does not parse"):
        chat_template_option("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="refused the conversation"):
        chat_template_option("{{ raise_exception('system messages only') }}")


# llama.cpp's chat turns (`llama-completion -cnv -st`, the GGUF's template with --jinja or a built-in
# one), recorded by scripts/llamacpp_chat_ref.py
CHAT_REF = json.loads((Path(__file__).parent / "data" / "llamacpp_chat.json").read_text())
CHAT_CASES = [pytest.param(name, i, id=f"{name.split('-')[0]}-{name.split('-')[-3]}-{i}",
                           marks=() if name == SMOL else (pytest.mark.slow,))
              for name, cases in CHAT_REF.items() for i in range(len(cases))]


@pytest.mark.parametrize("name,i", CHAT_CASES)
def test_chat_turn_is_llama_cpp_s(name, i):
    """The GGUF's template (or a named built-in one, or chatml for Gemma, which has none) renders to
    llama.cpp's prompt ids (default system prompts included), and the greedy reply is llama.cpp's, text
    and end of turn."""
    from conftest import loaded
    from sharpi_cli.chat import encode_chat, render_messages
    from sharpi_cli.options import RunOptions
    from sharpi_cli.inputs import chat_template_for, read_chat_options
    from sharpi_core.generate import Generator
    from sharpi_core.sampling import SamplingParams
    case = CHAT_REF[name][i]
    model, tok = loaded(name)
    o = RunOptions(system_prompt=case["system"], chat_template=case["chat_template"], single_turn=True)
    read_chat_options(o)
    o.chat_template = chat_template_for(o, tok)
    ids = encode_chat(tok, render_messages(o, tok, [{"role": "user", "content": case["user"]}]))
    assert ids == case["prompt_ids"]
    res = Generator(model, model.new_cache(512), tok, SamplingParams(temp=0)).generate(ids, case["n_predict"])
    assert res.text == case["reply"]
    assert res.stop_reason == ("eos" if case["ended"] else "n_predict")


_RENDER = json.loads((Path(__file__).parent / "data" / "llamacpp_chat_render.json").read_text())
_render_spec = importlib.util.spec_from_file_location("llamacpp_chat_render", Path(__file__).parents[1] / "scripts" / "llamacpp_chat_render.py")
_render_script = importlib.util.module_from_spec(_render_spec)
_render_spec.loader.exec_module(_render_script)


@pytest.mark.parametrize("case", _RENDER["cases"], ids=lambda c: f"{c['template_name']}: {c['conversation']}, -rea {c['reasoning']}, "
                         f"preserve {c['preserve']}, effort {c['effort']}, {c['kwargs']}")
def test_chat_prompt_is_llama_clis(case, monkeypatch):
    """The prompt of a conversation is llama-cli's (libllama-common's rendering, scripts/llamacpp_chat_render.py): today's
    date, enable_thinking passed where the template can think (-rea auto), earlier replies' reasoning kept apart and
    kept or dropped as --reasoning-preserve says, reasoning_strength beside reasoning_effort, a system message merged
    into the next one where the template has no system role; the replies as the model wrote them, split by the chat."""
    import time
    real = time.strftime
    dates = {"%d %b %Y": _RENDER["date_string"], "%b %d %Y": _RENDER["datetime"]}  # the day it was recorded
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: dates[fmt] if fmt in dates and not a else real(fmt, *a))
    got = _render_script.sharpi_render(_RENDER["templates"][case["template_name"]], case["messages"], case["reasoning"],
                                       case["preserve"], case["effort"], case["kwargs"])
    assert got == case["prompt"]


def test_templates_are_patched_as_llama_cpp_patches_them():
    """llama.cpp's common_chat_templates_init turns two refusals of gpt-oss's and Mistral's templates into `if false`:
    gpt-oss's of channel tags in a message's content (a reply kept as it came, --reasoning-format none)."""
    refusal = ("{%- if \"<|channel|>analysis<|message|>\" in message.content or "
               "\"<|channel|>final<|message|>\" in message.content %}{{ raise_exception('no channels in content') }}{%- endif -%}")
    t = "{%- for message in messages -%}" + refusal + "<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{%- endfor -%}"
    reply = "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
    assert render_chat(t, msgs, False) == f"<|start|>user<|message|>Hi<|end|><|start|>assistant<|message|>{reply}<|end|>"
    other = t.replace("{%- for message in messages -%}", "{%- for message in messages -%}{%- set c = message.content -%}").replace(
        "in message.content or", "in c or")  # the same refusal in other words: not llama.cpp's text, not patched
    with pytest.raises(ChatTemplateError, match="no channels in content"):
        render_chat(other, msgs, False)


def test_a_reply_view_ends_where_a_stop_string_begins():
    """-r in a chat (llama-cli's server cuts its stop words off): the reply is shown up to where a stop string
    begins, however the pieces cut it; text that only began like one is held back from the piece that began it, and
    shown if an end-of-generation token ends the reply, not if -n (or the context) does."""
    import io
    import random
    from sharpi_cli.chat import ReplyView
    reply = "The answer to this classic math problem is 4."
    rng = random.Random(0)
    for stops, shown in ((["classic"], "The answer to this "), (["clash", "is 4"], "The answer to this classic math problem "),
                         (["cla", "answer"], "The "), (["zzz", "4.!"], None)):
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(reply)), 6))
            for end_of_generation in (False, True):
                out = io.StringIO()
                view = ReplyView(out, None, "", False, stops)
                for a, b in zip([0, *cuts], [*cuts, len(reply)]):
                    view.write(reply[a:b])
                view.close(end_of_generation)
                if shown is not None:
                    want = shown
                elif end_of_generation:
                    want = reply
                else:  # (up to the piece that holds the "4" that may begin "4.!")
                    want = reply[:max(c for c in [0, *cuts] if c <= reply.index("4."))]
                assert out.getvalue() == want, (stops, cuts, end_of_generation)


def test_stop_scan_holds_back_by_tokens_as_llama_cli_s_server():
    """StopScan on a reply's token pieces: what llama-cli's server sends (server-context.cpp's process_token)."""
    from sharpi_cli.chat import StopScan
    s = StopScan(["<|im_end|>"])
    # the whole piece "!<" is held once its text ends like the stop string's beginning, not just "<"
    assert [s.feed(p) for p in ("Thanks", "!<", "|", "im")] == ["Thanks", "", "", ""]
    assert s.feed("", end_of_generation=True) == "!<|im"  # (an end of generation sends it)
    s = StopScan(["<|im_end|>", "sun"])
    assert [s.feed(p) for p in ("a <", "|x", " su", "nny")] == ["", "a <|x", "", " "] and s.stopped
    assert s.feed("more") == "" and s.feed("", end_of_generation=True) == ""
    # a stop string is looked for within the text not yet sent, from its last piece's and the string's length back
    s = StopScan(["ab"])
    assert [s.feed(p) for p in ("xa", "yab")] == ["", "xay"] and s.stopped
    assert StopScan([""]).feed("text") == "text" and StopScan().feed("x", end_of_generation=True) == "x"
