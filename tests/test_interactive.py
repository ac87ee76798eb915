"""-i/-if: llama-completion's interactive mode, checked against its transcripts (scripts/llamacpp_interactive.py ->
tests/data/llamacpp_interactive.json: `llama-completion -no-cnv --simple-io --temp 0 ARGS` with the user's lines on
stdin, its stdout up to "EOF by user")."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import model_path
from test_cli import one_error_line, sharpi

CASES = json.loads((Path(__file__).parent / "data" / "llamacpp_interactive.json").read_text())
BY_NAME = {c["name"]: c for c in CASES}


def run_case(case, *extra):
    r = sharpi("-m", model_path(case["model"]), "--temp", 0, "-t", 2, *case["args"], *extra, input=case["input"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    return r


@pytest.mark.parametrize("name", list(BY_NAME))
def test_transcript_is_llama_completions(name):
    """Byte for byte llama-completion's text: the prompt, each generated stretch, --in-prefix/--in-suffix as
    printed, the newline after an end of generation; where control changes hands (reverse prompt at the end of
    the text, a one-token reverse prompt, -n spent, an empty line handing it back, '\\' and '/' line endings,
    -mli, --in-prefix-bos) and what the model then sees (the samplers start over at each input: bob-penalties;
    the first reverse prompt queued after an end of generation; a context shift: qwen-shift; a full context
    ends the session: gemma-full; a character -n cuts, which the next stretch finishes after an empty line:
    smol-cut-character)."""
    case = BY_NAME[name]
    r = run_case(case)
    assert r.stdout.removesuffix("\n") == case["transcript"]
    assert ("context" in r.stderr and "is full" in r.stderr) == case["context_full"]


@pytest.mark.parametrize("name,extra", [
    ("bob", ["--draft-lookup"]),
    ("chatml-eog", ["--draft-lookup", "--spec-draft-n-max", "6"]),
    ("qwen-shift", ["-md", "qwen2.5-coder-0.5b-instruct-q4_k_m"]),  # (a draft model through context shifts)
])
def test_speculation_gives_the_same_transcript(name, extra):
    case = BY_NAME[name]
    extra = [str(model_path(e)) if e.startswith("qwen") else e for e in extra]
    r = run_case(case, *extra)
    assert r.stdout.removesuffix("\n") == case["transcript"]
    assert "speculative: drafted" in r.stderr


@pytest.mark.parametrize("args,contains", [
    (["-i", "-cnv"], "-cnv"),
    (["-if", "-sys", "Be brief."], "-sys"),
    (["-i", "--json"], "--json"),
    (["-i", "--prompt-cache", "x.bin"], "--prompt-cache"),
    (["-i", "-f", "-"], "stdin"),
    (["--in-prefix", "Q: "], "add -i"),
    (["--in-suffix", "A: "], "add -i"),
])
def test_invalid_combinations(args, contains):
    r = sharpi("-m", model_path("smollm2-135m-instruct-q4_1"), "-p", "Hi", *args)
    one_error_line(r, contains=contains)


def test_ctrl_d_at_once_and_the_prompt_is_not_read_from_stdin():
    """-if with nothing on stdin: the prompt is evaluated and shown, the session ends at the first read; the
    piped stdin is the user's input, not the prompt."""
    r = sharpi("-m", model_path("smollm2-135m-instruct-q4_1"), "-if", "-p", "Hello", "--temp", 0, input="")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Hello\n"


def test_the_session_report_adds_each_generations_counts():
    """-i's report at the end covers every generation of the session, as the chat's does (SpecStats + SpecStats:
    cost_off stays a flag, `"cost_off": 0` in -v's detail before)."""
    from sharpi_cli.interactive import _add
    from sharpi_core.generate import GenerationResult, SpecStats, Timings
    total = GenerationResult([], "", "", Timings())
    _add(total, GenerationResult([1], "a", "eos", Timings(3, 1.0, 1, 2.0), SpecStats(
        drafted=4, accepted=3, per_position_drafted=[1, 1], per_position_accepted=[1, 0])))
    _add(total, GenerationResult([2, 3], "bc", "n_predict", Timings(2, 1.0, 2, 2.0), None))
    _add(total, GenerationResult([4], "d", "eos", Timings(1, 1.0, 1, 1.0), SpecStats(
        drafted=2, per_position_drafted=[1], per_position_accepted=[1])))
    assert total.timings == Timings(6, 3.0, 4, 5.0) and total.stop_reason == "eos"
    d = total.spec.as_dict()
    assert (d["drafted"], d["accepted"], d["per_position_drafted"], d["per_position_accepted"], d["cost_off"]) == (
        6, 3, [2, 1], [2, 0], False)


@pytest.mark.parametrize("lines,multiline,text", [
    (["hi"], False, "hi"), (["a\\", "b"], False, "a\nb"), (["ab/"], False, "ab"), (["a\\", "b/"], False, "a\nb"),
    (["p1", "p2", "/"], True, "p1\np2"), (["a\\", "/"], False, "a"), (["p1", "p2\\"], True, "p1\np2"), (["/"], False, None),
    (["/"], True, None),
])
def test_an_input_reads_as_llama_completions(monkeypatch, lines, multiline, text):
    """-i's input as llama-completion reads it (console::readline, one trailing newline taken off): a "/" ends it
    with no newline of its own, so a line of only "/" after others leaves none after them ("p1\\np2\\n" before);
    a "/" with nothing before it is its "EOF by user" (an empty buffer), the end of the session as Ctrl-D."""
    import sharpi_cli.chat as chat
    from sharpi_cli.interactive import read_input
    typed = iter(lines)
    monkeypatch.setattr(chat, "typed_line", lambda prompt="": next(typed))
    got = read_input(multiline)
    assert (got if text is None else got.removesuffix("\n")) == text  # (None: nothing before a "/" ends the session)
