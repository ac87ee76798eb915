"""Reasoning blocks: the chat template's tags, llama.cpp's reasoning budget (a constraint the generator, a draft
model's proposals and the verify rows all follow), and the chat flags around them (--reasoning,
--chat-template-kwargs, --reasoning-effort, --jinja)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import SMOL, loaded, model_path
from sharpi_core.chat import BUILTIN_TEMPLATES
from sharpi_core.reasoning import (COUNTING, DONE, FORCING, IDLE, WAITING_UTF8, Both, ReasoningBudget, ReasoningStream,
                                   opens_block, split_reasoning, thinking_tags, utf8_complete)
from test_cli import sharpi
from test_generate import GREEDY, GREEDY_PEN, PROMPT, SAMPLED, SAMPLED_PEN, drafter_for, make
from test_grammar import martingale_pvalue_grammar, toy_grammar

# chatml whose generation prompt opens a reasoning block, as Qwen3.5's does (closed at once when thinking is off)
THINK_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}{%- endif -%}")


def test_thinking_tags_come_from_the_template():
    assert thinking_tags(THINK_TEMPLATE) == ("<think>", "</think>")
    assert thinking_tags("{{ '<seed:think>' }}x{{ '</seed:think>' }}") == ("<seed:think>", "</seed:think>")
    assert thinking_tags("{{ m.content.split('</think>')[-1] }}") is None  # an end tag alone is no block
    assert thinking_tags(BUILTIN_TEMPLATES["chatml"]) is None
    # Mistral's and Cohere's blocks (Magistral / Ministral reasoning, Command A), as llama.cpp's parsers know them
    assert thinking_tags("{{ '[THINK]' + m.thinking + '[/THINK]' }}") == ("[THINK]", "[/THINK]")
    assert thinking_tags("<|START_THINKING|>{{ t }}<|END_THINKING|>") == ("<|START_THINKING|>", "<|END_THINKING|>")
    assert thinking_tags("[THINK] only opens") is None
    assert split_reasoning(" [THINK]Hmm.\n[/THINK]\n\nYes.", ("[THINK]", "[/THINK]"), False) == ("Hmm.", "Yes.")



def test_harmony_channels_are_gpt_oss_reasoning():
    """gpt-oss's template writes harmony channels: the analysis message is the reasoning, the final one the content
    (a reply without an analysis opens its final channel at once: the content, its header dropped), whole or in pieces."""
    t = "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' -}}<|channel|>final<|message|>"
    tags = thinking_tags(t)
    assert tags == ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>")
    for reply, want in (("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Hi!",
                         ("Hmm.", "Hi!")), ("<|channel|>final<|message|>Hi!", ("", "Hi!")), ("Hi!", None)):
        assert split_reasoning(reply, tags, False) == want
        for n in (1, 3, 7):
            s = ReasoningStream(tags, False)
            parts = [p for i in range(0, len(reply), n) for p in s.feed(reply[i:i + n])] + s.finish()
            got = ("".join(x for k, x in parts if k == "reasoning"), "".join(x for k, x in parts if k == "content"))
            assert got == (want or ("", reply))
    assert thinking_tags(loaded(SMOL)[1].chat_template) is None
    assert thinking_tags(None) is None


def test_utf8_complete_is_llama_cpps_rule():
    for piece, whole in ((b"", True), (b"a", True), (b" caf\xc3\xa9", True), (b"\xc3", False), (b"ab\xe2\x82", False),
                         (b"\xe2\x82\xac", True), (b"\x80", False), (b"\x80\x80\x80\x80", False),
                         (b"\xf0\x9f\x98\x80", True), (b"x\xf0\x9f\x98", False)):
        assert utf8_complete(piece) == whole, piece


def run(rb: ReasoningBudget, tokens, st=None):
    """The state after each token, and which token each state forced before it came."""
    st = rb.initial() if st is None else st
    forced = []
    for t in tokens:
        forced.append(rb.forcing(st))
        st = rb.advance(st, t)
    return st, forced


def test_budget_states_follow_llama_cpps_sampler():
    # start 100, end 101, forced: the message 102 and the end tag 101 (llama.cpp's test vocabulary)
    rb = ReasoningBudget([100], [[101]], [102, 101], 2)
    st, forced = run(rb, [7, 100, 50, 51, 102, 101, 60])
    assert forced == [None, None, None, None, 102, 101, None] and st[0] == DONE
    st, forced = run(rb, [100, 50, 101, 60, 61, 62])  # a natural end within the budget: nothing forced
    assert set(forced) == {None} and st[0] == DONE
    st, forced = run(rb, [100, 50, 101, 60, 100, 70, 71, 102, 101])  # a new block, a new budget
    assert forced == [None] * 7 + [102, 101] and st[0] == DONE
    st, forced = run(ReasoningBudget([100], [[101]], [102, 101], 0), [100, 102, 101, 5])  # budget 0: at once
    assert forced == [None, 102, 101, None]
    # the forced end is seen by the end matcher too, and a forced message may hold the start tag
    assert rb.initial()[0] == IDLE and rb.initial([3, 100])[0] == COUNTING  # a prompt that opens the block
    assert rb.initial([100, 50, 101])[0] == DONE
    # a prompt that spends the budget: forcing starts after it (its own tokens are not forced ones)...
    zero = ReasoningBudget([100], [[101]], [102, 101], 0)
    assert zero.initial([100, 7, 8])[0] == FORCING and zero.forcing(zero.initial([100, 7, 8])) == 102
    assert zero.initial([100, 7, 101])[0] == DONE  # ...unless it ends the block itself
    # where the tokens' bytes are known, a start tag with text after it (a message naming the tag) opens no block:
    # only a prompt ending in the tag, then whitespace, does (llama.cpp arms the budget where thinking is forced open)
    text = ReasoningBudget([100], [[101]], [102, 101], 2, pieces=lambda t: {100: b"<think>", 9: b" \n"}.get(t, b"x"))
    assert text.initial([100, 7, 8, 9])[0] == IDLE and text.initial([3, 100, 7, 100, 9])[:2] == (COUNTING, 1)
    assert text.initial([100, 9, 9])[0] == FORCING and text.initial([100, 7, 101, 3])[0] == IDLE  # (the 9s counted)


def test_budget_matches_tags_of_several_tokens():
    rb = ReasoningBudget([7, 8], [[9, 10], [11]], [12, 9, 10], 3)
    st, forced = run(rb, [7, 7, 8, 1, 9, 2, 12, 9, 10])  # 7 7 8 opens; 9 alone ends nothing
    assert forced == [None] * 6 + [12, 9, 10] and st[0] == DONE
    st, _ = run(rb, [7, 8, 1, 11])  # the other end sequence
    assert st[0] == DONE
    st, _ = run(rb, [7, 1, 8, 2])  # interrupted: no block
    assert st[0] == IDLE


def test_budget_waits_for_a_whole_utf8_character():
    pieces = {1: b"a", 2: b"\xe2", 3: b"\x82", 4: b"\xac", 100: b"<t>", 101: b"</t>", 102: b"!"}
    rb = ReasoningBudget([100], [[101]], [102, 101], 2, pieces=pieces.__getitem__)
    # spent on an open character: forced after the next token whose own bytes end on a whole one (a piece of
    # continuation bytes alone never does, as in llama.cpp)
    st, forced = run(rb, [100, 1, 2, 3, 4, 1, 102, 101])
    assert forced == [None] * 6 + [102, 101] and st[0] == DONE
    st, _ = run(rb, [100, 1, 2])
    assert st[0] == WAITING_UTF8
    st, _ = run(rb, [101], st)  # the end tag still ends it naturally while waiting
    assert st[0] == DONE


def test_split_reasoning():
    tags = ("<think>", "</think>")
    assert split_reasoning(" <think>\nhm, 4.\n</think>\n\nIt is 4.", tags, False) == ("hm, 4.", "It is 4.")
    assert split_reasoning("hm, 4.\n</think>\n\nIt is 4.", tags, True) == ("hm, 4.", "It is 4.")
    assert split_reasoning("still thinking", tags, True) == ("still thinking", "")  # (cut by -n)
    assert split_reasoning("It is 4.", tags, False) is None
    assert opens_block("<|im_start|>assistant\n<think>\n", tags)
    assert not opens_block("<think>a</think><|im_start|>assistant\n", tags) and not opens_block("user: hi", tags)
    # a message that names the tag opens no block: the reply after it is content (it was all "reasoning")
    assert not opens_block("<|im_start|>user\nWhat does <think> do?<|im_end|>\n<|im_start|>assistant\n", tags)


@pytest.mark.parametrize("tags", [("<think>", "</think>"), ("<seed:think>", "</seed:think>")])
def test_reasoning_stream_splits_as_split_reasoning(tags):
    """The terminal chat's view: a reply fed in random pieces comes out as split_reasoning's two parts (or, with no
    block, as the reply itself), in order, a part never before the one it follows; cut tags and whitespace at
    the parts' edges included."""
    rng = np.random.default_rng(0)
    start, end = tags
    atoms = [start, end, start[:3], end[:4], end[:-1], " ", "\n", "\n\n", "hm", "4.", "<", "</", "x y", "é"]
    for _ in range(3000):
        text = "".join(atoms[i] for i in rng.integers(0, len(atoms), rng.integers(0, 12)))
        if rng.random() < 0.3:
            text = " \n" + start + text
        for opened in (False, True):
            cuts = sorted(rng.choice(len(text) + 1, min(len(text) + 1, rng.integers(0, 6)), replace=False))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            st = ReasoningStream(tags, opened)
            parts = [p for piece in pieces for p in st.feed(piece)] + st.finish()
            kinds = [k for k, _ in parts]
            assert kinds == sorted(kinds, key=lambda k: k == "content"), (text, pieces, parts)
            got = ("".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content"))
            want = split_reasoning(text, tags, opened)
            if want is None:
                want = ("", text)
            assert got == want, (text, opened, pieces, parts)


def test_constrain_forces_one_token():
    rb = ReasoningBudget([100], [[101]], [102, 101], 0)
    st = rb.initial([100])
    x = np.arange(200, dtype=np.float32)
    y = rb.constrain(x, st)
    assert np.isfinite(y).sum() == 1 and y[102] == 102
    assert rb.constrain(x[:100], st) is None  # a draft's row cut before the forced id
    x[102] = -np.inf
    assert rb.constrain(x, st) is None
    assert rb.constrain(x, rb.initial()) is x  # not forcing: the row as it is


# -- the generator: toy models --------------------------------------------------------------------------------
# the toy's text often holds 3 (a start) and 5 (an end): blocks of both endings come up
def toy_budget(budget=2):
    return ReasoningBudget([3], [[5]], [1, 2, 5], budget)


def check_blocks(tokens, prompt, budget, forced=(1, 2, 5)):
    """An independent reading of the rule for one-token tags over prompt + tokens: inside a block (3 ... 5) at
    most `budget` tokens, then `forced` (whatever the prompt holds there: only generated tokens are checked);
    returns (blocks ended naturally, blocks forced) in the generated part."""
    inside, n, natural, cut, i = False, 0, 0, 0, 0
    seq, p = list(prompt) + list(tokens), len(prompt)
    while i < len(seq):
        if inside and n == budget:
            for j, f in enumerate(forced):
                if p <= i + j < len(seq):
                    assert seq[i + j] == f, (i + j, seq)
            i, inside, cut = i + len(forced), False, cut + (i >= p)
            continue
        t = seq[i]
        if not inside and t == 3:
            inside, n = True, 0
        elif inside and t == 5:
            inside, natural = False, natural + (i >= p)
        elif inside:
            n += 1
        i += 1
    return natural, cut


@pytest.mark.parametrize("kind", [None, "model", "lookup", "same"])
@pytest.mark.parametrize("params", [GREEDY, GREEDY_PEN], ids=["greedy", "penalties"])
def test_greedy_speculation_under_a_budget_is_plain_greedy(kind, params):
    plain, _ = make(params, grammar=toy_budget())
    ref = plain.generate(PROMPT, n_predict=200)
    natural, cut = check_blocks(ref.tokens, PROMPT, 2)
    assert natural >= 3 and cut >= 10
    free, _ = make(params)
    assert free.generate(PROMPT, n_predict=200).tokens != ref.tokens
    if kind is None:
        return
    gen, _ = make(params, drafter_for(kind, params, make()[1]), spec_n_max=4, grammar=toy_budget())
    res = gen.generate(PROMPT, n_predict=200)
    assert res.tokens == ref.tokens
    if kind == "same":
        assert res.spec.accepted == res.spec.drafted > 0


def test_forced_tokens_are_proposed_and_taken_in_one_pass():
    """Where the budget forces its message and end tag, the speculative step proposes them itself (a drafter that
    proposes nothing is not needed there): one verify pass takes the whole run, and the output stays plain's."""
    class Silent:
        def propose(self, history, k):
            return [], None

        def rollback(self, n_keep):
            pass
    plain, _ = make(GREEDY, grammar=toy_budget())
    ref = plain.generate(PROMPT, n_predict=200)
    _, cut = check_blocks(ref.tokens, PROMPT, 2)
    gen, _ = make(GREEDY, Silent(), spec_n_max=4, grammar=toy_budget())
    res = gen.generate(PROMPT, n_predict=200)
    assert res.tokens == ref.tokens
    s = res.spec
    # (a run cut by the end of the generation may be shorter)
    assert s.accepted == s.drafted and 3 * (cut - 1) <= s.drafted <= 3 * cut and s.verify_passes <= cut
    assert s.target_passes == s.emitted - s.accepted  # (each forced token one pass fewer)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_plain_decoding_takes_forced_tokens_in_one_pass(params):
    """No drafter: the forced run still goes in one verify pass (the same tokens as one pass a token, which
    SHARPI_SPEC_BATCH_VERIFY=0's row-by-row verification gives), and no speculative stats appear."""
    runs = []
    for batch in (True, False):
        gen, model = make(params, grammar=toy_budget())
        gen.batch_verify = batch
        calls = []
        forward = model.forward

        def spy(tokens, *a, **kw):
            calls.append(len(tokens))
            return forward(tokens, *a, **kw)
        model.forward = spy
        res = gen.generate(PROMPT, n_predict=200)
        runs.append((res.tokens, calls))
        assert res.spec is None
    (tokens, calls), (ref, one_by_one) = runs
    assert tokens == ref and max(one_by_one[1:]) == 1
    _, cut = check_blocks(ref, PROMPT, 2)
    assert cut >= 10 and calls.count(4) >= cut - 1  # [t, forced 1, 2, 5] in one pass
    assert len(calls) <= len(one_by_one) - 3 * (cut - 1)


def test_interactive_feed_reads_the_prompt():
    # llama-completion's interactive mode evaluates the prompt (feed) and then generates (resume): a prompt that
    # opens a block starts it there too
    for resume in (False, True):
        gen, _ = make(GREEDY, grammar=toy_budget(0))
        prompt = [0, 1, 2, 3]
        if resume:
            gen.feed(prompt, fresh=True)
            res = gen.generate([], n_predict=5, resume=True)
        else:
            res = gen.generate(prompt, n_predict=5)
        assert res.tokens[:3] == [1, 2, 5]


@pytest.mark.parametrize("kind", [None, "model", "lookup"])
def test_budget_and_grammar_together(kind):
    def both():
        return Both(ReasoningBudget([6], [[3]], [0, 3], 2), toy_grammar())
    plain, _ = make(GREEDY, grammar=both())
    ref = plain.generate(PROMPT, n_predict=80)
    b = both()
    st = b.initial(PROMPT)
    for t in ref.tokens:  # every token passes both
        assert b.constrain(np.zeros(8, dtype=np.float32), st)[t] == 0
        st = b.advance(st, t)
    alone, _ = make(GREEDY, grammar=toy_grammar())
    assert alone.generate(PROMPT, n_predict=80).tokens != ref.tokens
    if kind is not None:
        gen, _ = make(GREEDY, drafter_for(kind, GREEDY, make()[1]), spec_n_max=4, grammar=both())
        res = gen.generate(PROMPT, n_predict=80)
        assert res.tokens == ref.tokens and res.stop_reason == ref.stop_reason


@pytest.mark.parametrize("kind,params", [(None, SAMPLED_PEN), ("model", SAMPLED_PEN), ("lookup", SAMPLED)],
                         ids=["plain", "model-k4", "lookup-k4"])
def test_sampled_speculation_under_a_budget_follows_the_target(kind, params):
    n = 2000
    drafter = drafter_for(kind, params, make()[1], n_ctx=n + 64, seed=41) if kind else None
    gen, _ = make(params, drafter, n_ctx=n + 64, spec_n_max=4, seed=40, grammar=toy_budget())
    res = gen.generate(PROMPT, n_predict=n)
    assert len(res.tokens) == n
    natural, cut = check_blocks(res.tokens, PROMPT, 2)
    assert natural > 10 and cut > 10
    assert martingale_pvalue_grammar(params, res.tokens, toy_budget()) > 0.001


# -- the command line on SmolLM2 ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def think_template(tmp_path_factory):
    p = tmp_path_factory.mktemp("think") / "think.jinja"
    p.write_text(THINK_TEMPLATE)
    return str(p)


def run_json(*args):
    r = sharpi("-m", model_path(SMOL), "--json", "--temp", "0", "-n", "40", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_cli_budget_ends_the_thinking(think_template):
    _, tok = loaded(SMOL)
    base = ["-p", "What is the capital of France?", "--chat-template-file", think_template]
    free = run_json(*base)["tokens"]
    msg = " Time to answer."
    forced = tok.encode(msg, add_special=False) + tok.encode("</think>", add_special=False)
    out = run_json(*base, "--reasoning-budget", "6", "--reasoning-budget-message", msg)
    # the generation prompt's "\n" after <think> is the block's first token (llama.cpp counts it too)
    assert out["tokens"][:5] == free[:5] and out["tokens"][5:5 + len(forced)] == forced
    assert out["tokens"] != free[:len(out["tokens"])]
    # --json: the block's text apart (the prompt opened it), and the rest
    text = out["text"]
    assert "</think>" in text and out["reasoning"] == text.split("</think>")[0].strip() != ""
    assert out["content"] == text.split("</think>", 1)[1].lstrip()
    legacy = run_json(*base, "--reasoning-budget", "6", "--reasoning-budget-message", msg, "--reasoning-format",
                      "deepseek-legacy")
    assert legacy["content"] == text and legacy["reasoning"] == out["reasoning"]
    assert "reasoning" not in run_json(*base, "--reasoning-format", "none") and "reasoning" not in run_json("-p", "Hi")
    zero = run_json(*base, "--reasoning-budget", "0")["tokens"]
    assert zero[:3] == tok.encode("</think>", add_special=False) != free[:3]
    for spec in (["--draft-lookup"], ["-md", model_path(SMOL)]):  # speculation: the same tokens
        r = run_json(*base, "--reasoning-budget", "6", "--reasoning-budget-message", msg, *spec)
        assert r["tokens"] == out["tokens"] and r["speculative"]["drafted"] > 0


def test_cli_reasoning_flags_reach_the_template(think_template):
    base = ["-p", "Hi", "--chat-template-file", think_template, "-n", "1", "--verbose-prompt"]
    on = sharpi("-m", model_path(SMOL), *base, "--temp", "0")
    off = sharpi("-m", model_path(SMOL), *base, "--temp", "0", "-rea", "off")
    kw = sharpi("-m", model_path(SMOL), *base, "--temp", "0", "--chat-template-kwargs", '{"enable_thinking": false}')
    assert on.returncode == off.returncode == kw.returncode == 0
    end = "9617 -> '</'"  # (SmolLM2 spells </think> in three tokens)
    listing = [r.stderr.split("load time")[0] for r in (on, off, kw)]
    assert end not in listing[0] and end in listing[1] and listing[1] == listing[2]
    eff = sharpi("-m", model_path(SMOL), "-p", "Hi", "-n", "1", "--temp", "0", "--verbose-prompt", "--reasoning-effort",
                 "high", "--chat-template", "{{ messages[0].content }} effort={{ reasoning_effort }}")
    assert eff.returncode == 0 and "-> '='\n" in eff.stderr and "-> 'high'\n" in eff.stderr
    ok = sharpi("-m", model_path(SMOL), "--jinja", "-p", "Hi", "-n", "1", "--temp", "0")
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("args,fragment", [
    (["--chat-template-kwargs", "{not json"], "--chat-template-kwargs: not a JSON object"),
    (["--chat-template-kwargs", "[1, 2]"], "--chat-template-kwargs: not a JSON object"),
    (["--chat-template-kwargs", '{"messages": []}'], "'messages'"),
    (["-rea", "maybe"], "invalid -rea/--reasoning 'maybe'"),
    (["--reasoning-budget", "-2"], "invalid --reasoning-budget -2"),
    (["--no-jinja"], "--no-jinja"),
    (["--reasoning-format", "xml"], "invalid --reasoning-format 'xml'"),
])
def test_cli_reasoning_flag_errors(args, fragment):
    r = sharpi("-m", model_path(SMOL), "-p", "Hi", "-n", "1", *args)
    assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_budget_without_a_block_warns(think_template):
    r = sharpi("-m", model_path(SMOL), "-p", "Hi", "-n", "2", "--temp", "0", "--reasoning-budget", "4")
    assert r.returncode == 0 and "--reasoning-budget" in r.stderr and "no reasoning block" in r.stderr


def test_cli_chat_shows_the_reasoning_apart(think_template):
    """Conversation mode shows the block between [Start thinking] and [End thinking] (gray with -co on), without
    its tags, as llama-cli does; the parts are --json's reasoning and content; --reasoning-format none shows the
    reply as it is."""
    args = ["-p", "What is the capital of France?", "--chat-template-file", think_template, "--temp", "0", "-n", "40",
            "--reasoning-budget", "6", "--reasoning-budget-message", " Time to answer."]
    parts = run_json(*args)
    chat = sharpi("-m", model_path(SMOL), "-cnv", "-st", *args)
    assert chat.returncode == 0, chat.stderr
    out = chat.stdout
    assert "<think>" not in out and "</think>" not in out and "\x1b[" not in out  # (-co auto: not a terminal)
    # (llama-cli's spacing: a blank line before and after the header; sharpi wrote none)
    assert f"\n[Start thinking]\n\n{parts['reasoning']}\n[End thinking]\n\n{parts['content']}" in out
    turns = sharpi("-m", model_path(SMOL), "-cnv", *args[2:], input="What is the capital of France?\n")
    assert turns.returncode == 0 and f"\n[Start thinking]\n\n{parts['reasoning']}\n[End thinking]\n\n" in turns.stdout
    gray = sharpi("-m", model_path(SMOL), "-cnv", "-st", *args, "-co", "on").stdout
    assert gray.replace("\x1b[90m", "").replace("\x1b[0m", "") == out
    assert gray.index("\x1b[90m") < gray.index("[Start thinking]") < gray.index("[End thinking]\x1b[0m")
    raw = sharpi("-m", model_path(SMOL), "-cnv", "-st", *args, "--reasoning-format", "none").stdout
    assert "[Start thinking]" not in raw and "</think>" in raw
    bad = sharpi("-m", model_path(SMOL), "-p", "Hi", "-co", "rainbow")
    assert bad.returncode == 2 and "invalid -co/--color 'rainbow'" in bad.stderr


def test_color_auto_is_a_terminal_on_stdout(monkeypatch):
    import io
    import sys

    from sharpi_cli.chat import use_color

    class Tty(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(sys, "stdout", Tty())
    assert use_color("auto") and use_color("on") and not use_color("off")
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color("auto") and use_color("on")
    monkeypatch.setenv("NO_COLOR", "")
    monkeypatch.setenv("TERM", "dumb")
    assert not use_color("auto")
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a pipe or a file: no escape codes in it
    assert not use_color("auto")
