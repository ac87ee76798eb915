"""The `sharpi` console script on SmolLM2: its main() in this process (`sharpi`), or the real script in a
subprocess where the process itself is what is checked (`sharpi(..., process=True)`)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES_DIR, SMOL, ctrl_c_default, loaded, model_path, reference

SHARPI = shutil.which("sharpi") or f"{sys.executable} -m sharpi_cli.main"


def sharpi(*args, input=None, env=None, timeout=300, process=False):
    """The console script on a command line: its entry point's main() in this process by default, with
    sys.argv, stdin (input, else empty as /dev/null is), stdout, stderr and the environment swapped in and
    then restored (a run without the interpreter's start and torch's import: ~2 s less); process=True runs
    the real `sharpi` in a subprocess (signals, exits that end the interpreter, a first use, the imports)."""
    argv = [str(a) for a in args]
    if process:
        e = dict(os.environ, **(env or {}))
        return subprocess.run(SHARPI.split() + argv, input=input, capture_output=True, text=True, env=e,
                              timeout=timeout, stdin=None if input is not None else subprocess.DEVNULL)
    import io

    import torch

    from sharpi_cli.entry import main
    saved = (sys.argv, sys.stdin, sys.stdout, sys.stderr, torch.get_num_threads())
    old_env = {k: os.environ.get(k) for k in env or {}}
    out, err = io.StringIO(), io.StringIO()
    sys.argv, sys.stdin, sys.stdout, sys.stderr = ["sharpi", *argv], io.StringIO(input or ""), out, err
    os.environ.update(env or {})
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    finally:
        sys.argv, sys.stdin, sys.stdout, sys.stderr, threads = saved
        torch.set_num_threads(threads)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["sharpi", *argv], code, out.getvalue(), err.getvalue())


def gguf_derive():
    """scripts/gguf_derive.py as a module (GGUF files made from another's metadata and tensors)."""
    spec = importlib.util.spec_from_file_location("gguf_derive", Path(__file__).parents[1] / "scripts" / "gguf_derive.py")
    derive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(derive)
    return derive


@pytest.fixture(scope="module")
def smol():
    return str(model_path(SMOL))


def one_error_line(r, code=2, contains=None):
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    if contains:
        assert contains in lines[0], lines[0]
    return lines[0]


def chat_replies(stdout: str) -> list[str]:
    """The replies of a chat whose messages were piped in: each line read prints "> " (a command's too) and each
    reply ends in a newline. A reply may hold newlines of its own (the greedy reply of a prompt naming a temporary
    path varies with the path), so a reply ends only where a newline meets the next "> "."""
    parts = re.split(r"\n(?:> )+", stdout)
    return [re.sub(r"^(?:> )+", "", parts[0]), *parts[1:-1]] if len(parts) > 1 else []


def test_one_shot_greedy_is_the_engine_greedy(smol):
    """The console script prints exactly the engine's greedy continuation (the engine itself is
    checked against llama.cpp in test_model.py)."""
    from conftest import loaded
    from sharpi_core.generate import Generator
    from sharpi_core.sampling import SamplingParams
    prompt = reference()[SMOL]["greedy"][1]["prompt"]
    model, tok = loaded(SMOL)
    want = Generator(model, model.new_cache(512), tok, SamplingParams(temp=0)).generate(tok.encode(prompt), 16)
    r = sharpi("-m", smol, "-p", prompt, "-n", 16, "--temp", 0, "--no-display-prompt", process=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == want.text and len(want.tokens) == 16
    assert "eval time" in r.stderr and "prompt eval time" in r.stderr


def test_negative_temperature_is_greedy_as_in_llama_cpp(smol):
    """llama.cpp's --temp clamps a negative value to 0: a llama-cli command line with --temp -1 decodes greedily."""
    runs = [sharpi("-m", smol, "-p", "Once upon a time", "-n", 12, "--temp", t, "-s", 7, "--json") for t in (0, -1)]
    assert all(r.returncode == 0 for r in runs), runs[1].stderr
    assert json.loads(runs[1].stdout)["tokens"] == json.loads(runs[0].stdout)["tokens"]


def test_llama_cpp_values_of_threads_batches_flash_attention_and_biases(smol):
    """Values llama.cpp's parser takes that sharpi refused: a thread count of 0 or less is every core, -ub 0 or less
    is -b, -fa's 1 / true / enabled / 0 / false / disabled / -1, a temperature of -inf is 0, and a logit bias as
    std::stof reads it (an exponent, infinity, a sign of its own: 28+-1 is a bias of -1)."""
    from sharpi_cli.main import parse_logit_bias
    from sharpi_cli.options import RunOptions
    from sharpi_cli.validate import validate
    o = RunOptions(model=smol, prompt="hi", threads=0, threads_batch=-5, threads_draft=0, ubatch_size=-1, batch_size=64,
                   flash_attn="disabled", temp=float("-inf"))
    validate(o)
    cores = len(os.sched_getaffinity(0))
    assert (o.threads, o.threads_batch, o.threads_draft, o.threads_batch_draft) == (-1, cores, cores, -1)
    assert (o.ubatch_size, o.flash_attn, o.temp) == (64, "off", 0.0)
    for words, want in ((("1", "true", "enabled", "on"), "on"), (("0", "false", "disabled", "off"), "off"),
                        (("-1", "auto"), "auto")):
        for w in words:
            o = RunOptions(model=smol, prompt="hi", flash_attn=w)
            validate(o)
            assert o.flash_attn == want, w
    assert parse_logit_bias(["28+1e2", "28-infinity", "28+-1", "28--.5", "28 + 2.5E-1", "5+INF"]) == (
        (28, 100.0), (28, float("-inf")), (28, -1.0), (28, 0.5), (28, 0.25), (5, float("inf")))
    base = ("-m", smol, "-p", "Once upon a time", "-n", 6, "--json")
    want = json.loads(sharpi(*base, "--temp", 0).stdout)["tokens"]
    r = sharpi(*base, "--temp", "-inf", "-t", 0, "-ub", 0, "-fa", "false", "-l", f"{want[0]}-1e3")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"][0] != want[0]


def test_prompt_is_echoed_unless_disabled(smol):
    r = sharpi("-m", smol, "-p", "Hello there", "-n", 2, "--temp", 0)
    assert r.returncode == 0 and r.stdout.startswith("Hello there")


def test_json_output(smol):
    r = sharpi("-m", smol, "-p", "The capital of France is", "-n", 6, "--temp", 0, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["text"].startswith(" Paris") and len(d["tokens"]) == 6
    assert d["stop_reason"] == "n_predict" and "eog_token" not in d
    assert d["timings"]["eval_n"] >= 5 and d["timings"]["prompt_n"] == 5
    # an end of generation: its id apart from the generated tokens; with -sp its text ends `text`
    chat = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
    plain, shown = (json.loads(sharpi("-m", smol, "-p", chat, "--temp", 0, "-n", 64, "--json", *sp).stdout)
                    for sp in ((), ("-sp",)))
    assert plain["stop_reason"] == shown["stop_reason"] == "eos" and plain["eog_token"] == shown["eog_token"] == 2
    assert plain["tokens"] == shown["tokens"] and 2 not in plain["tokens"]
    assert shown["text"] == plain["text"] + "<|im_end|>"


def test_json_is_utf_8_whatever_the_model_path(smol, tmp_path):
    """--json's `model` is the path; one whose bytes are not UTF-8 gives U+FFFD each (its raw bytes made the output
    invalid JSON)."""
    odd = tmp_path / "m\udcff.gguf"
    odd.symlink_to(smol)
    r = sharpi("-m", odd, "-p", "Hi", "-n", 1, "--temp", 0, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.encode("utf-8"))["model"] == f"{tmp_path}/m\ufffd.gguf"


def test_stdin_prompt_and_file(smol, tmp_path):
    r = sharpi("-m", smol, "-n", 4, "--temp", 0, "--json", input="The capital of France is")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"].startswith(" Paris")
    f = tmp_path / "p.txt"
    f.write_text("The capital of France is")
    r2 = sharpi("-m", smol, "-f", f, "-n", 4, "--temp", 0, "--json")
    assert json.loads(r2.stdout)["tokens"] == json.loads(r.stdout)["tokens"]


def test_same_seed_same_sample(smol):
    args = ("-m", smol, "-p", "Once upon a time", "-n", 12, "--temp", 0.9, "-s", 7, "--json")
    a, b = sharpi(*args), sharpi(*args)
    assert a.returncode == 0 and json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]


def test_min_keep_widens_the_filters(smol):
    """--min-p 1 leaves the arg-max alone: the greedy text, whatever the seed; --min-keep 200 keeps 200
    candidates at temperature 3, so some draw of 12 leaves the greedy path."""
    base = ("-m", smol, "-p", "Once upon a time", "-n", 12, "--json", "--top-k", 0, "--top-p", 1, "--min-p", 1)
    greedy = json.loads(sharpi(*base, "--temp", 0).stdout)["tokens"]
    for seed in (1, 2):
        assert json.loads(sharpi(*base, "--temp", 3, "-s", seed).stdout)["tokens"] == greedy
    wide = [json.loads(sharpi(*base, "--temp", 3, "-s", seed, "--min-keep", 200).stdout)["tokens"] for seed in (1, 2)]
    assert all(len(w) == 12 for w in wide) and any(w != greedy for w in wide)


def test_top_p_and_min_p_take_llama_cpps_values_out_of_their_range(smol):
    """llama.cpp's flags take any top-p and min-p: top-p <= 0 and min-p > 1 keep the best candidate (the greedy text
    at temperature 3, whatever the seed), top-p >= 1 and min-p <= 0 turn the filter off (the draws of 1 and 0)."""
    base = ("-m", smol, "-p", "Once upon a time", "-n", 10, "--json", "--top-k", 0)
    toks = lambda *a: json.loads(sharpi(*base, *a).stdout)["tokens"]  # noqa: E731
    greedy = toks("--temp", 0)
    for seed in (1, 2):
        assert toks("--temp", 3, "-s", seed, "--top-p", 0) == greedy
        assert toks("--temp", 3, "-s", seed, "--top-p", -0.5, "--min-p", 0) == greedy
        assert toks("--temp", 3, "-s", seed, "--top-p", 1, "--min-p", 1.5) == greedy
        assert toks("--temp", 1, "-s", seed, "--top-p", 1.5) == toks("--temp", 1, "-s", seed, "--top-p", 1)
        assert toks("--temp", 1, "-s", seed, "--min-p", -1) == toks("--temp", 1, "-s", seed, "--min-p", 0)


def smol_copy(smol, path, values: dict | None = None, keys=()):
    """A copy of SmolLM2 at path with other values of its metadata keys ({key: value}) and keys added
    ((key, value, gguf value type), ...)."""
    import gguf
    derive = gguf_derive()
    r = gguf.GGUFReader(smol)
    w = gguf.GGUFWriter(str(path), "llama")
    derive.copy_kv(r, w, values=values)
    for key, value, vt in keys:
        w.add_key_value(key, value, vt)
    for t in r.tensors:
        derive.add_tensor_as_is(w, t)
    derive.finish(w)
    return path


def smol_with_sampling(smol, path, keys):
    """A copy of SmolLM2 at path with general.sampling.KEY values ((key, value, gguf value type), ...)."""
    return smol_copy(smol, path, keys=[(f"general.sampling.{key}", value, vt) for key, value, vt in keys])


def test_model_sampling_recommendations_fill_the_flags_not_given(smol, tmp_path):
    """A GGUF's general.sampling.* values (convert_hf_to_gguf.py's copy of generation_config.json) replace the defaults
    of the sampling flags not given on the command line or in SHARPI_ARG_*, as llama.cpp's common_init_sampler_from_model
    (llama-completion on this very file: top_k 1 / temp 1.5, --top-k 40: 40 / 1.5, --temp 0.7: 1 / 0.7, LLAMA_ARG_TOP_K=40:
    40 / 1.5); a value the flag would refuse (penalty_repeat 0) is left out with a warning."""
    import gguf
    V = gguf.GGUFValueType
    # (llama.cpp reads each from its text with strtol / strtof: a string's leading number counts, a float's text
    # "nan" is no integer, a float key's nan or inf would be taken: sharpi warns)
    f = smol_with_sampling(smol, tmp_path / "smol-sampling.gguf", (
        ("top_k", 1, V.INT32), ("temp", 1.5, V.FLOAT32), ("penalty_repeat", 0.0, V.FLOAT32),
        ("mirostat", float("nan"), V.FLOAT32),  # (a traceback once: int(nan))
        ("xtc_threshold", float("nan"), V.FLOAT32), ("top_p", "0.5 or so", V.STRING),
        ("min_p", 1e300, V.FLOAT64)))  # (numpy's overflow warning, then refused)
    base = ("-p", "Once upon a time", "-n", 12, "--json", "-s", 5)
    greedy = json.loads(sharpi("-m", smol, *base, "--temp", 0).stdout)["tokens"]
    r1 = sharpi("-m", f, *base)
    assert json.loads(r1.stdout)["tokens"] == greedy  # top-k 1
    assert "(general.sampling.*): --top-k 1, --top-p 0.5, --temp 1.5" in r1.stderr, r1.stderr
    assert "general.sampling.penalty_repeat is not used" in r1.stderr and "mirostat" not in r1.stderr
    assert "general.sampling.xtc_threshold is not used: nan is not a finite number" in r1.stderr
    assert "general.sampling.min_p is not used: inf is not a finite number" in r1.stderr
    assert "RuntimeWarning" not in r1.stderr, r1.stderr
    for args, env in ((("--top-k", 0), None), ((), {"SHARPI_ARG_TOP_K": "0"})):
        r2 = sharpi("-m", f, *base, *args, env=env)
        assert "(general.sampling.*): --top-p 0.5, --temp 1.5\n" in r2.stderr
        assert json.loads(r2.stdout)["tokens"] != greedy  # temperature 1.5 over the whole vocabulary


def test_a_model_sampling_sequence_drops_the_names_llama_cpp_does_not_know(smol, tmp_path):
    """general.sampling.sequence: names llama.cpp does not know are left out with a warning and the others used, as its
    common_sampler_types_from_names does (sharpi used none of them); --samplers keeps the model's out."""
    import gguf
    f = smol_with_sampling(smol, tmp_path / "smol-seq.gguf", (("sequence", "top_k;typical;Temp", gguf.GGUFValueType.STRING),
                                                              ("top_k", 1, gguf.GGUFValueType.INT32)))
    base = ("-p", "Once upon a time", "-n", 8, "--json", "-s", 5)
    greedy = json.loads(sharpi("-m", smol, *base, "--temp", 0).stdout)["tokens"]
    r1 = sharpi("-m", f, *base)
    assert "general.sampling.sequence 'top_k;typical;Temp': no sampler is named 'typical'; the others are used" in r1.stderr
    assert "(general.sampling.*): samplers top_k;temperature, --top-k 1" in r1.stderr, r1.stderr
    assert json.loads(r1.stdout)["tokens"] == greedy
    r2 = sharpi("-m", f, *base, "--samplers", "temperature")
    assert "sequence" not in r2.stderr and "(general.sampling.*): --top-k 1" in r2.stderr
    assert json.loads(r2.stdout)["tokens"] != greedy  # (temperature alone: the whole vocabulary)


def test_env_args_and_flag_precedence(smol):
    env = {"SHARPI_ARG_N_PREDICT": "3", "SHARPI_ARG_TEMP": "0", "SHARPI_ARG_MODEL": smol}
    r = sharpi("-p", "Hello", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 3
    r = sharpi("-p", "Hello", "--json", "-n", 5, env=env)
    assert len(json.loads(r.stdout)["tokens"]) == 5
    # every flag but --version, the subcommands' too (tokenize's switches took none)
    from sharpi_cli.main import app
    import typer.main
    command = typer.main.get_command(app)
    for cmd in [command, *(c for name, c in command.commands.items() if name != "models"),
                *command.commands["models"].commands.values()]:
        for p in cmd.params:
            if getattr(p, "opts", None) and p.opts[0].startswith("-") and p.name not in ("show_version", "help"):
                assert getattr(p, "envvar", None), (cmd.name, p.opts)
    r = sharpi("tokenize", "-m", smol, "-p", "a\\n", env={"SHARPI_ARG_IDS": "1", "SHARPI_ARG_ESCAPE": "0"})
    assert r.returncode == 0 and r.stdout.startswith("[") and r.stdout.count(",") == 2, r.stdout


def test_reverse_prompt_stops(smol):
    args = ("-m", smol, "-p", "Once upon a time, in a small village,", "-n", 24, "--temp", 0, "--json")
    full = json.loads(sharpi(*args).stdout)["text"]
    word = full.split()[len(full.split()) // 2]  # a word from the middle of the greedy reply
    d = json.loads(sharpi(*args, "-r", word).stdout)
    assert d["stop_reason"] == "stop_string" and d["text"].endswith(word)
    assert full.startswith(d["text"]) and len(d["text"]) < len(full)


def test_reverse_prompt_ending_inside_a_token_stops_at_that_token(smol):
    """A reverse prompt is looked for in the text, not at token boundaries (llama-completion's find in its last
    tokens' text): one that ends inside a token stops the run at that token, the whole token printed."""
    tok = loaded(SMOL)[1]
    prompt = "Once upon a time, in a small village,"
    args = ("-m", smol, "-p", prompt, "-n", 24, "--temp", 0, "--json")
    ids = json.loads(sharpi(*args).stdout)["tokens"]
    pieces = [tok.decode([t]) for t in ids]
    i = next(i for i in range(len(ids) // 3, len(ids)) if len(pieces[i].strip()) >= 4)
    rp = pieces[i].strip()[:-1]  # the token's word without its last letter
    assert rp not in prompt
    j = next(j for j in range(len(ids)) if rp in tok.decode(ids[:j + 1]))  # the token that completes it first
    want = tok.decode(ids[:j + 1])
    assert not want.endswith(rp)  # (the match ends inside token j)
    d = json.loads(sharpi(*args, "-r", rp).stdout)
    assert d["stop_reason"] == "stop_string" and d["tokens"] == ids[:j + 1] and d["text"] == want


def test_reverse_prompts_see_control_tokens_and_the_prompts_end(smol):
    """As llama-completion's: a reverse prompt is looked for in the text with control tokens written out (shown
    or not: no -sp here), a one-token one is that token, and a match may begin in the prompt."""
    done = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
    args = ("-m", smol, "-p", done, "-n", 8, "--temp", 0, "--ignore-eos", "--json")
    free = json.loads(sharpi(*args).stdout)["tokens"]
    from conftest import loaded
    tok = loaded(SMOL)[1]
    assert tok.token_text(free[0]) == "<|im_start|>" and tok.decode(free[1:2]) == "user"  # (what is stopped on)
    for r, n in (("<|im_start|>", 1), ("<|im_start|>user", 2), ("user", 2)):
        d = json.loads(sharpi(*args, "-r", r).stdout)
        assert d["stop_reason"] == "stop_string" and d["tokens"] == free[:n], r
    d = json.loads(sharpi("-m", smol, "-p", "The capital of France", "-r", "France is", "-n", 16, "--temp", 0,
                          "--json").stdout)
    assert d["stop_reason"] == "stop_string" and d["text"] == " is"


def test_a_second_bos_is_warned_of(smol):
    from conftest import loaded
    bos = loaded(SMOL)[1].token_text(loaded(SMOL)[1].bos_id)
    args = ("-m", smol, "-n", 1, "--temp", 0, "--override-kv", "tokenizer.ggml.add_bos_token=bool:true")
    warn = "warning: the model adds a BOS token and the prompt starts with one too: it now starts with two"
    assert warn in sharpi(*args, "-p", bos + "Hi").stderr and warn not in sharpi(*args, "-p", "Hi").stderr


def test_first_use_says_it_compiles_the_kernels(smol, tmp_path):
    # the compiler (SHARPI_CC) a stand-in that copies the library this process built: the notice and the cache
    # are what is checked here, not gcc's 20 s (every fresh install, CI's included, compiles for real)
    from sharpi_core.kernels import cpu
    built = cpu.build_info()
    assert built["binding"] == "extension", built
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && exec cp {built["path"]} "$2"; shift; done\nexit 1\n')
    cc.chmod(0o755)
    env = {"SHARPI_KERNEL_DIR": str(tmp_path / "kernels"), "SHARPI_CC": str(cc)}
    r = sharpi("-m", smol, "-p", "Hi", "-n", 1, "--temp", 0, env=env, process=True)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("compiling the CPU kernels") == 1 and any((tmp_path / "kernels").glob("*.so"))
    r = sharpi("-m", smol, "-p", "Hi", "-n", 1, "--temp", 0, env=env, process=True)  # built: nothing said
    assert r.returncode == 0 and "compiling" not in r.stderr


def test_ignore_eos_generates_past_the_end_of_generation(smol):
    args = ("-m", smol, "-p", "What is 2+2?", "-st", "--temp", 0, "--json")
    ended = json.loads(sharpi(*args, "-n", 40).stdout)
    assert ended["stop_reason"] == "eos" and len(ended["tokens"]) < 30
    d = json.loads(sharpi(*args, "-n", 30, "--ignore-eos").stdout)
    assert d["stop_reason"] == "n_predict" and len(d["tokens"]) == 30
    from conftest import loaded
    eog = loaded(SMOL)[1].eog_ids
    n = len(ended["tokens"]) - (ended["tokens"][-1] in eog)  # the reply before its end token
    assert d["tokens"][:n] == ended["tokens"][:n] and not eog & set(d["tokens"])


def test_system_prompt_with_a_prompt_is_one_chat_turn(smol):
    """`-sys S -p U` is llama.cpp's chat turn (`llama-completion -cnv -st --jinja -sys S -p U`, recorded
    in tests/data/llamacpp_chat.json), not a raw completion of U that drops S."""
    from test_chat import CHAT_REF
    case = next(c for c in CHAT_REF[SMOL] if c["system"] and c["chat_template"] is None)
    r = sharpi("-m", smol, "-sys", case["system"], "-p", case["user"], "-n", case["n_predict"], "--temp", 0, "--json")
    check_chat_turn(r, case)


def test_ctrl_c_stops_with_exit_130(smol):
    """Ctrl-C during generation ends the run with llama.cpp's status 130 (the text so far printed, the
    statistics too); during the first imports, quietly (no traceback) all the same."""
    import signal
    import time
    cmd = SHARPI.split() + ["-m", smol, "-p", "Once", "-n", "3000", "--ignore-eos", "--temp", "0"]

    def start():  # in a process group of its own, which Ctrl-C signals as a terminal does: the whole group (the
        # `sharpi` found on PATH may be a launcher script, pyenv's shim: a shell that is signalled alone while it
        # waits for a command of its own takes the signal as the command's to handle and goes on)
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=ctrl_c_default)

    p = start()
    head = p.stdout.read(20)  # the prompt and the first generated tokens: generation is under way
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert len(head + out) > 20 and b"Traceback" not in err and b"eval time" in err
    for delay in (0.1, 0.3, 0.6, 1.0):
        p = start()
        time.sleep(delay)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
        if b"init_import_site" not in err and not re.search(rb'^  File "[^"]*", line 0, in <module>\nKeyboardInterrupt',
                                                              err, re.M):
            break
        # (a loaded machine: the signal came while Python itself started, importing `site`, or as the launcher's
        # first line ran, `line 0` with no frame of sharpi's: before any of sharpi's code ran; later then)
    assert p.returncode in (130, -signal.SIGINT) and b"Traceback" not in err, err


def test_ctrl_c_swallowed_by_an_import_callback_still_stops(smol):
    """A Ctrl-C whose KeyboardInterrupt Python swallows (raised inside a callback: importing torch runs importlib's
    module-lock weakref callbacks) is remembered: the run stops at its first step with status 130, and the
    swallowed exception is not printed with a traceback. Forced here by raising it from a weakref callback."""
    code = f"""
import signal, sys, weakref
sys.argv = ["sharpi", "-m", {smol!r}, "-p", "Once", "-n", "50", "--temp", "0"]
signal.signal(signal.SIGINT, signal.SIG_DFL)  # (as the console script leaves it)
import sharpi_cli.chat as chat
from sharpi_cli.main import main
install = chat.install_startup_handler
class A:
    pass
def installed():
    install()
    a = A()
    r = weakref.ref(a, lambda ref: chat.startup_handler(signal.SIGINT, None))
    del a
chat.install_startup_handler = installed
main()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 130 and "Traceback" not in r.stderr and "eval time" in r.stderr, r.stderr
    assert len(r.stdout) < 20  # (the prompt, and at most a token)


def test_command_line_wins_over_the_environment_for_exclusive_flags(smol, tmp_path):
    (tmp_path / "p.txt").write_text("From the file")
    r = sharpi("-m", smol, "-p", "Hi", "-n", 1, "--temp", 0, env={"SHARPI_ARG_FILE": str(tmp_path / "p.txt")})
    assert r.returncode == 0 and r.stdout.startswith("Hi"), r.stderr
    one_error_line(sharpi("-m", smol, "-n", 1, env={"SHARPI_ARG_FILE": str(tmp_path / "p.txt"), "SHARPI_ARG_PROMPT": "Hi"}),
                   2, "mutually exclusive")  # both from the environment: no command line to prefer


def test_closed_stdout_is_one_error_line(smol):
    r = subprocess.run(["bash", "-c", f"{SHARPI} -m {smol} -p Hi -n 2 >&-"], capture_output=True, text=True, timeout=300)
    one_error_line(r, 1, "standard output is closed")


def test_closed_or_empty_stdin(smol, tmp_path):
    """stdin closed reads as /dev/null: no piped prompt, so a chat that ends at once (it was a traceback); an empty
    pipe or file on stdin is an empty prompt, refused as -p "" and -f of an empty file are (it started a chat)."""
    r = subprocess.run(["bash", "-c", f"{SHARPI} -m {smol} -n 2 <&-"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "conversation mode" in r.stderr, r.stderr
    (tmp_path / "empty.txt").write_text("")
    for cmd in (f"printf '' | {SHARPI} -m {smol} -n 2", f"echo | {SHARPI} -m {smol} -n 2",
                f"{SHARPI} -m {smol} -n 2 < {tmp_path / 'empty.txt'}", f"{SHARPI} -m {smol} -n 2 -f {tmp_path / 'empty.txt'}"):
        one_error_line(subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300), 2,
                       "empty prompt: nothing to generate from")


def test_llama_cpp_default_seed_is_random(smol):
    d = json.loads(sharpi("-m", smol, "-p", "Hi", "-n", 1, "-s", 2**32 - 1, "--json").stdout)
    assert d["seed"] != 2**32 - 1  # LLAMA_DEFAULT_SEED: what llama.cpp's -s -1 stands for


def test_context_beyond_training_is_warned(smol, tmp_path):
    r = sharpi("-m", smol, "-p", "Hi", "-n", 1, "-c", 8200, "--temp", 0)
    assert r.returncode == 0 and "warning: the model was trained on only 8192 context tokens (8200 asked for)" in r.stderr
    assert "trained on only" not in sharpi("-m", smol, "-p", "Hi", "-n", 1, "-c", 8192, "--temp", 0).stderr
    # perplexity's contexts too (llama.cpp warns as any context is made): a copy of SmolLM2 trained on 64 positions
    short = smol_copy(smol, tmp_path / "smol-64.gguf", {"llama.context_length": 64})
    text = FIXTURES_DIR / "apache-2.0.txt"
    for args, warned in ((("-c", 128), True), (("-c", 64), False), (("-c", 128, "--hellaswag"), True)):
        if "--hellaswag" in args:
            text = tmp_path / "hellaswag.txt"
            text.write_text("A man sits\n0\n down.\n up.\n in.\n out.\n")
        r = sharpi("perplexity", "-m", short, "-f", text, "--chunks", 1, *args)
        assert r.returncode == 0, r.stderr
        assert ("warning: the model was trained on only 64 context tokens (128 asked for)" in r.stderr) == warned, args


def test_full_context_stops_with_a_note(smol):
    r = sharpi("-m", smol, "-p", "Hello", "-c", 16, "-n", 100, "--temp", 0)
    assert r.returncode == 0 and "the context (16 tokens) is full" in r.stderr, r.stderr
    assert "is full" not in sharpi("-m", smol, "-p", "Hello", "-c", 64, "-n", 8, "--temp", 0).stderr


def test_conversation_commands(smol, tmp_path):
    """llama-cli's chat commands, turns read from piped stdin: /regen, /read FILE, /clear; a turn that
    does not fit the context is refused with one line and the session goes on."""
    import re
    f = tmp_path / "notes.txt"
    f.write_text("The secret code word of the day is PINEAPPLE, written in capital letters.")
    turns = ["Say hi.", "/regen", f"/read {f}", "What is the code word?", "/read /no/such/file", "/clear",
             "/regen", "Say hi.", "Tell me about dragons. " * 40, "Say hi."]
    r = sharpi("-m", smol, "-cnv", "--temp", 0, "-n", 8, "-c", 200, "--verbose", input="\n".join(turns) + "\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    replies = chat_replies(r.stdout)
    evaluated = [tuple(map(int, m)) for m in re.findall(r"\[turn: (\d+) new prompt tokens evaluated of (\d+)", r.stderr)]
    assert len(replies) == len(evaluated) == 5, (r.stdout, r.stderr)
    # /regen: the same turn again, greedy, from the cached prompt
    assert replies[1] == replies[0] and evaluated[1][1] == evaluated[0][1] and evaluated[1][0] < evaluated[0][0]
    # /read: the file goes with the next message (about 20 tokens more than the question alone)
    from conftest import loaded
    question = len(loaded(SMOL)[1].encode("What is the code word?", add_special=False))
    assert evaluated[2][1] - evaluated[1][1] >= question + 15
    assert f"[{f}: " in r.stderr and "error: /read: cannot read '/no/such/file'" in r.stderr
    # /clear: "Say hi." starts over, as the first turn did; /regen has nothing left to redo
    assert "[chat history cleared]" in r.stderr and "error: /regen: no reply to regenerate" in r.stderr
    assert replies[3] == replies[0] and evaluated[3][1] == evaluated[0][1]
    # the long message does not fit 200 tokens: refused, and the conversation goes on without it
    assert re.search(r"error: the conversation is \d+ tokens, which does not fit the context of 200", r.stderr)
    assert evaluated[4][1] > evaluated[3][1]  # "Say hi." after the history of turn 4, not after the long one
    assert evaluated[4][1] < evaluated[3][1] + 2 * (evaluated[3][1] - evaluated[1][1]) + 100
    # llama-cli's speeds line after each reply, unless --no-show-timings
    assert len(re.findall(r"\[ Prompt: [\d.]+ t/s \| Generation: [\d.]+ t/s \]", r.stderr)) == 5
    # the timings at the end cover the session: every reply's (they were the last reply's)
    generated = [int(n) for n in re.findall(r"of \d+, (\d+) generated", r.stderr)]
    assert re.search(rf"prompt eval time = +[\d.]+ ms / +{sum(e[0] for e in evaluated)} tokens", r.stderr), r.stderr
    assert re.search(rf"eval time = +[\d.]+ ms / +{sum(generated)} runs", r.stderr) and len(generated) == 5
    r = sharpi("-m", smol, "-cnv", "--temp", 0, "-n", 2, "--no-show-timings", input="Hi\n")
    assert r.returncode == 0 and "[ Prompt:" not in r.stderr
    # speculating, the acceptance follows; a reply of one token drafted nothing: no rate (not 0%)
    spec = sharpi("-m", smol, "-cnv", "--temp", 0, "-n", 1, "--draft-lookup", input="Hi\n")
    assert spec.returncode == 0 and re.search(r"Generation: [\d.]+ t/s \]", spec.stderr), spec.stderr
    # ... and no tokens per target pass at the end: there was no pass after the prompt's (not "0.00")
    assert "speculative: drafted 0, accepted 0, 0 steps" in spec.stderr, spec.stderr
    spec = sharpi("-m", smol, "-md", smol, "-cnv", "--temp", 0, "-n", 8, input="Hi\n")  # (itself: it drafts)
    assert re.search(r"Generation: [\d.]+ t/s \| Accepted: \d+% \]", spec.stderr), spec.stderr
    assert re.search(r"speculative: drafted \d+, accepted \d+ \([\d.]+%\), [\d.]+ tokens per target pass", spec.stderr)
    # piped: the last prompt's line "> " is ended, at the end of the input as at /exit (nothing echoes a line)
    ended = sharpi("-m", smol, "-cnv", "--temp", 0, "-n", 2, "--no-show-timings", input="Hi\n/exit\n")
    assert r.stdout.endswith("\n> \n") and ended.stdout == r.stdout, (r.stdout, ended.stdout)


def test_conversation_first_message_and_a_system_prompt_too_long(smol):
    """-cnv -p: the message is shown as if typed at the prompt (llama-cli echoes it), then its reply, as the same
    message piped in gives; a system prompt that leaves no room for a message is refused at the start, one line
    (each message was refused, and /clear keeps the system prompt)."""
    args = ("-m", smol, "-cnv", "--temp", 0, "-n", 8, "--no-show-timings")
    typed = sharpi(*args, input="Say hi.\n")
    given = sharpi(*args, "-p", "Say hi.")
    assert typed.returncode == given.returncode == 0, given.stderr
    assert typed.stdout.startswith("> ") and given.stdout == "> Say hi.\n" + typed.stdout[2:]
    sys_prompt = "Answer in one word. " * 20
    one_error_line(sharpi(*args, "-c", 64, "-sys", sys_prompt),
                   contains="the system prompt makes a conversation of 115 tokens before any message, which leaves no "
                            "room for a message and a reply in the context of 64; raise -c/--ctx-size")
    # at 116 a message would not fit either (each would be refused): refused at the start too; at 117 a one-token
    # message has its reply's first token
    one_error_line(sharpi(*args, "-c", 116, "-sys", sys_prompt), contains="in the context of 116;")
    r = sharpi(*args, "-c", 117, "-sys", sys_prompt, "-n", 1, input="A\n")
    assert r.returncode == 0 and "error" not in r.stderr and r.stdout.startswith("> ") and len(r.stdout) > 3, r.stderr
    assert sharpi(*args, "-c", 160, "-sys", sys_prompt, input="Hi\n").returncode == 0


def test_an_output_that_names_an_input_is_refused(tmp_path):
    """--log-file and -o are written anew: naming a file the run reads (the model, a known model's cached file, the
    prompt, a grammar, an adapter) or each other is one error line, before anything is opened; nothing changes."""
    from sharpi_core.registry import REGISTRY
    models = tmp_path / "models"
    models.mkdir()
    cached = models / REGISTRY[SMOL].filename
    files = {name: tmp_path / name for name in ("m.gguf", "p.txt", "g.gbnf", "lora.gguf")}
    for f in [cached, *files.values()]:
        f.write_bytes(b"precious " + f.name.encode())
    m, p, g, lora = (files[n] for n in ("m.gguf", "p.txt", "g.gbnf", "lora.gguf"))
    cases = [(("-m", m, "-p", "hi", "--log-file", m), "--log-file", "-m/--model"),
             (("-m", m, "-p", "hi", "-st", "-o", m), "-o/--output-file", "-m/--model"),
             (("-m", SMOL, "-p", "hi", "-st", "-o", cached), "-o/--output-file", "-m/--model"),
             (("-m", m, "-f", p, "--log-file", p), "--log-file", "-f/--file"),
             (("-m", m, "-p", "hi", "--grammar-file", g, "--log-file", tmp_path / "." / "g.gbnf"), "--log-file",
              "--grammar-file"),
             (("-m", m, "-p", "hi", "--lora-scaled", f"{lora}:0.5", "--log-file", lora), "--log-file", "--lora-scaled"),
             (("-m", m, "-p", "hi", "-st", "-o", tmp_path / "new.txt", "--log-file", tmp_path / "new.txt"),
              "--log-file", "-o/--output-file")]
    for args, out, src in cases:
        one_error_line(sharpi(*args, env={"SHARPI_MODELS_DIR": str(models)}),
                       contains=f"{out} {args[-1]} is the file {src} names: it would be overwritten")
    for f in [cached, *files.values()]:
        assert f.read_bytes() == b"precious " + f.name.encode()
    assert not (tmp_path / "new.txt").exists()
    other = tmp_path / "other.gguf"  # a model no flag names (another run's, a cached one under another name)
    other.write_bytes(b"GGUF precious")
    for out in ("--log-file", "-o"):
        one_error_line(sharpi("-m", m, "-p", "hi", "-st", out, other),
                       contains=f"{other} is a GGUF model: it would be overwritten")
    assert other.read_bytes() == b"GGUF precious"


def test_a_reader_that_goes_away_ends_the_run_quietly(smol):
    """`sharpi ... | head -c 20`: the reader closes the pipe mid-generation; the run ends at once with exit 0 and
    nothing on stderr (click's own handler exited 1, silently; Python's would print a traceback)."""
    import shlex
    for args in (f"-p hi -n 3000 --ignore-eos --temp {t}" for t in (0, 0.8)):
        cmd = f"{SHARPI} -m {shlex.quote(str(smol))} {args} | head -c 20 >/dev/null; exit ${{PIPESTATUS[0]}}"
        r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and r.stderr == "", (args, r.returncode, r.stderr)


def test_running_out_of_memory_is_one_error_line(smol, monkeypatch):
    """An input with no end (-f /dev/zero) under a memory limit: one error line and exit 1, not MemoryError's
    traceback; in a chat, /read refuses what is not a file (a device, a FIFO) and the chat goes on."""
    import gc
    import shlex
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    # (1.5 GB of address space: a run of -p Hi fits in it; /dev/zero read whole does not, and reaches it 4x sooner
    # than the 3 GB this was)
    # (one OpenBLAS thread: its buffers, one set a core, would take the limit's room on a machine of many cores)
    cmd = f"ulimit -v 1500000; OPENBLAS_NUM_THREADS=1 exec {SHARPI} -m {shlex.quote(str(smol))} -f /dev/zero -n 2"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
    one_error_line(r, code=1, contains="out of memory")
    r = sharpi("-m", smol, "-cnv", "--temp", 0, "-n", 2, "--no-show-timings", input="/read /dev/zero\nHi\n")
    assert r.returncode == 0 and "error: /read: cannot read '/dev/zero'" in r.stderr and r.stdout.count("> ") == 3
    # a transcript that cannot be written (a full disk) names its file
    for args, given in ((("-p", "Hi", "-st"), None), (("-cnv",), "Hi\n")):
        r = sharpi("-m", smol, "--temp", 0, "-n", 2, "--no-show-timings", *args, "-o", "/dev/full", input=given)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1] == "error: cannot write the output file /dev/full: No space left on device"
        # and the file is given up: one left open fails again when collected (Python prints that, traceback and all)
        gc.collect()
        assert not unraisable, (args, [str(u.exc_value) for u in unraisable])


def test_grammars_and_schemas_nested_too_deeply_or_with_huge_bounds_are_one_error_line(smol, tmp_path):
    """Read by recursive descent as llama.cpp reads them: a nesting deeper than Python's stack is one error line
    (not RecursionError's traceback), as is an integer bound too large for a float; a schema's errors name the
    flag that gave it (-jf: and its file)."""
    d = 1000
    (tmp_path / "deep.gbnf").write_text("root ::= " + "(" * d + '"a"' + ")" * d)
    schema = '{"type": "string"}'
    for _ in range(d):
        schema = '{"type": "array", "items": ' + schema + '}'
    (tmp_path / "deep.json").write_text(schema)
    big = "1" + "0" * 400
    for args, contains in ((("--grammar-file", tmp_path / "deep.gbnf"), "--grammar: nested too deeply"),
                           (("-jf", tmp_path / "deep.json"), f"-jf/--json-schema-file {tmp_path / 'deep.json'}: nested too deeply"),
                           (("-jf", tmp_path / "deep.gbnf"), f"-jf/--json-schema-file {tmp_path / 'deep.gbnf'}: not JSON"),
                           (("-j", "root ::= x"), "-j/--json-schema: not JSON"),
                           (("-j", f'{{"type": "integer", "minimum": -{big}, "maximum": {big}}}'),
                            "-j/--json-schema: not JSON: number -1000000000000000000... is out of range")):
        one_error_line(sharpi("-m", smol, "-p", "hi", "-n", 2, *args), contains=contains)


def test_a_chat_stop_string_lies_in_the_reply_and_is_cut_off(smol, tmp_path):
    """-r in a chat, as llama-cli's server: a stop string counts in the reply only (one begun in the template's text,
    "t\nThe" across "assistant\nThe", stopped the reply at its first word), and the reply ends before it, on the
    screen, in the transcript and in the history the next turn sees."""
    args = ("-m", smol, "-cnv", "--temp", 0, "-n", 40, "--no-show-timings")
    full = sharpi(*args, input="What is 2+2?\n")
    assert full.returncode == 0 and "classic" in full.stdout, full.stdout
    r = sharpi(*args, "-r", "t\nThe", input="What is 2+2?\n")
    assert r.stdout == full.stdout
    t = tmp_path / "t.txt"
    r = sharpi(*args, "-r", "classic", "-o", t, input="What is 2+2?\n")
    cut = full.stdout[:full.stdout.index("classic")]
    assert r.stdout == cut + "\n> \n" and "classic" not in t.read_text() and cut[2:] in t.read_text()
    r = sharpi(*args, "-r", "classic", "-st", "-p", "What is 2+2?")  # (one turn: the same)
    assert r.returncode == 0 and r.stdout == cut[2:] + "\n", r.stdout


def test_conversation_multiline_messages(smol, tmp_path):
    """A chat message over lines: `\\` at a line's end continues it; with -mli (llama-cli's multiline input) lines go
    on until one ends in `\\`; a line ending in `/` ends it either way, as llama.cpp's console reads lines (the `/`
    becomes the line's newline and llama-cli cuts one newline off the message: a line of only "/" ends the ones
    before it with a newline, where sharpi had dropped it). The same message gives the same reply either way, and
    one left unfinished at the end of input is sent (llama-cli sends it too), not dropped."""
    args = ("-m", smol, "-cnv", "--temp", 0, "-n", 6, "--no-show-timings")
    ref = sharpi(*args, input="Say\\\nhi.\n")
    assert ref.returncode == 0 and ref.stdout.startswith("> ") and len(ref.stdout) > 4, ref.stderr
    out = tmp_path / "t.txt"
    for flags, typed, message in (((), "Say\\\nhi.\\\n", "Say\nhi."), (("-mli",), "Say\nhi./\n", "Say\nhi."),
                                  (("-mli",), "Say\nhi.\\\n", "Say\nhi."), (("-mli",), "Say\nhi.", "Say\nhi."),
                                  ((), "Say\\\nhi./\n", "Say\nhi."), (("-mli",), "Say\nhi.\n/\n", "Say\nhi.\n"),
                                  ((), "Say\\\nhi.\\\n/\n", "Say\nhi.\n"), ((), "Say\\\nhi.\\\n\\\n", "Say\nhi.\n")):
        r = sharpi(*args, *flags, "-o", out, input=typed)
        assert r.returncode == 0 and out.read_text().startswith(f"User:\n{message}\n\nAssistant:"), (flags, typed)
        if message == "Say\nhi.":
            assert r.stdout == ref.stdout, (flags, typed, r.stdout, r.stderr)
    r = sharpi(*args, input="Say\nhi.\n")  # two messages: two replies
    assert r.returncode == 0 and r.stdout.count("> ") == 3 and r.stdout != ref.stdout
    # -mli outside typed input: a warning, the run goes on
    r = sharpi("-m", smol, "-p", "Hi", "-n", 2, "-mli")
    assert r.returncode == 0 and "warning: -mli/--multiline-input is for typed input" in r.stderr


def check_chat_turn(r, case):
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["text"] == case["reply"] and d["timings"]["prompt_n"] == len(case["prompt_ids"])
    assert d["stop_reason"] == ("eos" if case["ended"] else "n_predict")


@pytest.mark.slow
def test_a_model_without_a_chat_template_chats_in_chatml():
    """Gemma 3 (a base model) has no template: a chat turn is rendered in chatml with a warning, as
    llama-completion -cnv does (its prompt and reply in tests/data/llamacpp_chat.json)."""
    from conftest import GEMMA
    from test_chat import CHAT_REF
    case = next(c for c in CHAT_REF[GEMMA] if c["chat_template"] is None)
    r = sharpi("-m", model_path(GEMMA), "-sys", case["system"], "-p", case["user"], "-n", case["n_predict"],
               "--temp", 0, "--json")
    check_chat_turn(r, case)
    assert "warning: this model has no chat template: using chatml" in r.stderr


def test_chat_template_by_name_or_file_and_system_prompt_file(smol, tmp_path):
    """--chat-template NAME is llama.cpp's built-in template of that name (llama-completion --chat-template
    llama3, recorded), --chat-template-file the same template as Jinja text; -sysf reads the system prompt
    (its trailing newline dropped)."""
    from test_chat import CHAT_REF

    from sharpi_core.chat import BUILTIN_TEMPLATES
    llama3 = next(c for c in CHAT_REF[SMOL] if c["chat_template"] == "llama3")
    own = next(c for c in CHAT_REF[SMOL] if c["system"] and c["chat_template"] is None)
    (tmp_path / "llama3.jinja").write_text(BUILTIN_TEMPLATES["llama3"])
    (tmp_path / "system.txt").write_text(own["system"] + "\n")  # kept, the model's template would see it
    for case, args in ((llama3, ("-sys", llama3["system"], "--chat-template", "llama3")),
                       (llama3, ("-sys", llama3["system"], "--chat-template-file", tmp_path / "llama3.jinja")),
                       (own, ("-sysf", tmp_path / "system.txt", "-cnv", "-st"))):  # --json takes -cnv -st: one turn
        r = sharpi("-m", smol, *args, "-p", case["user"], "-n", case["n_predict"], "--temp", 0, "--json")
        check_chat_turn(r, case)
    # a template alone makes the prompt one chat turn too (like -sys), in that template
    from conftest import loaded
    tok = loaded(SMOL)[1]
    d = json.loads(sharpi("-m", smol, "--chat-template", "zephyr", "-p", "Hi", "-n", 1, "--json").stdout)
    assert d["timings"]["prompt_n"] == len(tok.encode("<|user|>\nHi<|endoftext|>\n<|assistant|>\n", add_special=True,
                                                      parse_special=True))


@pytest.mark.parametrize("args,fragment", [
    (("-n", "-3"), "-n/--n-predict"),
    (("-p", ""), "empty prompt"),
    (("--json", "-cnv"), "--json prints one result and cannot go with -cnv"),
    (("--draft-lookup", "-c", "1"), "a context of 1 token leaves no room to speculate (raise -c/--ctx-size)"),
    (("-s", "99999999999999999999"), "-s/--seed"),
    (("-s", "-2"), "-s/--seed"),
    (("-c", "99999999"), "cannot allocate 2304.0 GB of KV cache (f16) for a context of 99999999 tokens"),
    (("-c", "-1"), "-c/--ctx-size"),
    (("-t", "600"), "invalid -t/--threads 600: at most 512"), (("-tbd", "513"), "-tbd/--threads-batch-draft 513"),
    (("--spec-ngram-max", "1025", "--draft-lookup"), "--spec-ngram-max 1025: must be in [--spec-ngram-min (2), 1024]"),
    (("-l", "15+nan"), "logit-bias"), (("-fa", "yes"), "-fa/--flash-attn"),
    (("--temp", "nan"), "--temp"),
    (("--repeat-penalty", "inf"), "--repeat-penalty"),
    (("--presence-penalty", "nan"), "--presence-penalty"),
    (("--top-p", "nan"), "--top-p"), (("--min-p", "-inf"), "--min-p"),
    (("--prio", "4"), "invalid --prio 4"), (("-C", "0xz1"), "-C/--cpu-mask"), (("-C", "0x"), "-C/--cpu-mask"),
    (("-Cr", "3"), "expected [lo]-[hi]"), (("-Cr", "0-512"), "numbered 0..511"), (("-Cr", "5-2"), "name no CPU"),
    (("-C", "0x8" + "0" * 127), "none of which this process may run on"),  # CPU 511
    (("--min-keep", "-1"), "invalid --min-keep -1: must be >= 0"),
    (("-dev", "Vulkan0"), "invalid -dev/--device 'Vulkan0': choose cpu or cuda"),
    (("-dev", "CUDA1"), "the first GPU only (CUDA0)"), (("-dev", "CUDA0,CUDA1"), "on one GPU"),
    (("-l", "abc"), "logit-bias"),
    (("-l", "15+x"), "logit-bias"),
    (("-l", "1195-inf", "-l", "1195+inf"), "token 1195 gets both +inf and -inf"),
    (("--ignore-eos", "-l", "2+inf"), "token 2 gets both +inf and -inf (--ignore-eos bans it)"),
    (("-l", "12+" + "9" * 40), "out of float range"),
    (("-l", "5+3" + "0" * 38, "-l", "5+3" + "0" * 38, "-l", "5-inf"), "token 5 gets both +inf and -inf"),
    (("--temp", "1e308"), "--temp 1e+308: must be a finite number within float range"),
    (("-ctk", "q4_k"), "cache-type-k"),
    (("-ctvd", "q6_k"), "-ctvd/--spec-draft-type-v"),
    (("--spec-type", "mtp", "-md", "whatever.gguf"), "mutually exclusive"),
    (("--spec-ngram-min", "1", "--draft-lookup"), "--spec-ngram-min"),
    (("--spec-draft-vocab", "-2"), "--spec-draft-vocab"),
    (("-fa", "maybe"), "-fa/--flash-attn"),
    (("--bogus-flag",), "bogus"),
    (("-no-cnv", "-sys", "Be brief."), "-sys/--system-prompt"),
    (("-no-cnv", "-st"), "-st/--single-turn"),
    (("-no-cnv", "-sysf", "system.txt"), "-sysf/--system-prompt-file"),
    (("-sys", "Be brief.", "-sysf", "system.txt"), "mutually exclusive"),
    (("-sysf", "/no/such/file"), "cannot read system prompt file"),
    (("--chat-template", "chatml", "--chat-template-file", "t.jinja"), "mutually exclusive"),
    (("--chat-template", "llama-3"), "--chat-template: 'llama-3' is neither a built-in template"),
    (("--chat-template", "{% for m in messages %}"), "--chat-template: the chat template does not parse"),
    (("--chat-template-file", "/no/such/file"), "cannot read chat template file"),
    (("--samplers", "top_k;penalties"), "penalties must come before the other samplers"),
    (("--dry-penalty-last-n", "-2"), "--dry-penalty-last-n"),
    (("--grammar", "root ::= item"), "grammar: undefined rule 'item'"),
    (("--grammar", 'root ::= x root "a" | "b"\nx ::= y\ny ::= "" | "c"'), "grammar: left recursion in rule 'root'"),
    (("--grammar", 'root ::= "a" <|no such token|>'), "grammar: invalid token '<|no such token|>'"),
    (("--grammar", 'root ::= ("a"{0,40}){0,60}'), "more than llama.cpp's limit of 2000"),
    (("-l", "5+1e999"), "-l/--logit-bias 5+1e999: the bias is out of float range (use inf)"),
    (("-n", "99999999999999999999"), "invalid -n 99999999999999999999: out of range (a 32-bit integer"),
    (("--top-k", str(-2**31 - 1)), f"invalid --top-k {-2**31 - 1}: out of range"),
    (("--yarn-orig-ctx", "3000000000"), "invalid --yarn-orig-ctx 3000000000: out of range (a 32-bit integer"),
    (("--poll", str(2**64)), f"invalid --poll {2**64}: out of range (a 64-bit integer"),
    (("--spec-type", "ngram-mod", "--spec-ngram-mod-n-min", "70"), "-n-min 70 is above --spec-ngram-mod-n-max 64"),
    (("--grammar", 'root ::= "a"', "-j", "{}"), "--grammar and -j/--json-schema are mutually exclusive"),
    (("--grammar-file", "/no/such/file"), "cannot read grammar file"),
    (("-j", '{"type": "string", "pattern": "^(a)\\\\1$"}'), "pattern: backreferences are not supported"),
    # a schema's cycles said in its own words, not in its grammar's rule names
    (("-j", '{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}'),
     "-j/--json-schema: $ref #/$defs/a comes back to itself before any text (left recursion"),
    (("-j", '{"type": "array", "items": {"$ref": "#"}, "minItems": 1}'),
     "-j/--json-schema: no JSON value fits (its $ref recursion never ends)"),
])
def test_invalid_flags_one_line_exit_2(smol, args, fragment):
    r = sharpi("-m", smol, "-p", "hi", *args)
    one_error_line(r, 2, fragment)


def test_an_error_is_one_line_whatever_its_message_carries(capsys):
    # (a damaged file's key name, a path with a newline: scripts/fuzz_bad_input.py found a two-line one)
    import sharpi_cli.main as cli_main
    from sharpi_core.errors import one_line
    cli_main._err("key 'a\nb\x00' in \u2028 x\té", "P ")
    assert capsys.readouterr().err == "P error: key 'a\\nb\\x00' in \\u2028 x\\té\n"
    # an argument's undecodable byte (a lone surrogate) stays, to go out as that byte (test_log_file_gets_the_log_too)
    assert one_line("nope\udcff\n") == "nope\udcff\\n"


def test_a_bad_command_line_is_refused_before_anything_loads(smol):
    """Flag errors come before torch is imported (1-2 s) or the model read: at once, as llama-cli's do."""
    for args in (("--top-p", "nan"), ("-ctk", "q4_k"), ("--samplers", "top_k;penalties"), ("--grammar", "root ::= item"),
                 ("--control-vector-scaled", "v.gguf"), ("--lora-scaled", "a.gguf")):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "sharpi_cli.main", "-m", smol, "-p", "hi", *args],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
        assert r.returncode == 2 and [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")], r.stderr
        imported = {ln.split("|")[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
        assert "sharpi_cli.runner" in imported and not imported & {"torch", "sharpi_core.models"}, args


def test_cpu_masks_and_ranges_are_llama_cpps():
    from sharpi_cli.options import RunOptions
    from sharpi_cli.validate import cpu_set, parse_cpu_mask, parse_cpu_range
    assert parse_cpu_mask("0x3") == {0, 1} and parse_cpu_mask("F0") == {4, 5, 6, 7} and parse_cpu_mask("0") == set()
    assert parse_cpu_mask("1" + "0" * 127) == {508} and parse_cpu_mask("1" + "0" * 130) == {508}  # 128 digits read
    assert parse_cpu_range("2-4") == {2, 3, 4} and parse_cpu_range("-1") == {0, 1} and parse_cpu_range("510-") == {510, 511}
    assert parse_cpu_range("3-1") == set()
    assert cpu_set(RunOptions(cpu_mask="0x1", cpu_range="4-5")) == {0, 4, 5} and cpu_set(RunOptions()) is None


def test_affinity_and_priority_are_the_process_s():
    """-C / -Cr pin the process (its threads, made later, inherit it) and -t -1 becomes their count;
    --prio -1 is llama.cpp's nice 5. In a child process: they would stay with the test's."""
    code = ("import os; from sharpi_cli.runner import RunOptions, apply_cpu_params; "
            "t = apply_cpu_params(RunOptions(cpu_range='0-0', prio=-1)); "
            "print(t, sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    n0 = os.getpriority(os.PRIO_PROCESS, 0)  # the child's before (a test run under `nice` starts above 0)
    if n0 <= 5 or os.geteuid() == 0:  # nice 5, whatever it was (only root may lower it)
        assert r.stdout.split() == ["1", "[0]", "5"], r.stdout
    else:
        assert r.stdout.split() == ["1", "[0]", str(n0)] and "could not be set" in r.stderr, (r.stdout, r.stderr)


def test_log_file_gets_the_log_too(smol, tmp_path):
    """--log-file: the log lines of stderr (and an error line) written to the file as well, anew each run."""
    f = tmp_path / "log.txt"
    f.write_text("old\n")
    r = sharpi("-m", smol, "-p", "Hi", "-n", "2", "--temp", "0", "--log-file", str(f))
    assert r.returncode == 0, r.stderr
    logged = f.read_text().splitlines()
    assert "old" not in logged and any("eval time" in ln for ln in logged)
    assert set(logged) <= set(r.stderr.splitlines())
    r = sharpi("-m", smol, "-p", "Hi", "--top-p", "nan", "--log-file", str(f))
    assert f.read_text() == one_error_line(r, 2, "--top-p") + "\n"
    one_error_line(sharpi("-m", smol, "-p", "Hi", "--log-file", str(tmp_path / "no" / "dir.txt")), 1, "cannot write the log file")
    # a line naming a file whose name is not UTF-8 goes in as stderr shows it (it was a traceback, UnicodeEncodeError,
    # the error being reported lost), an error line and a warning alike
    line = one_error_line(sharpi("-m", "nope\udcff", "-p", "Hi", "--log-file", str(f)), 2, "model not found: 'nope\udcff'")
    assert f.read_text() == line.replace("\udcff", "\\udcff") + "\n"
    odd = tmp_path / "odd\udcfb.txt"
    odd.write_bytes(b"Hi \xff")
    r = sharpi("-m", smol, "-f", odd, "-n", "2", "--temp", "0", "--log-file", str(f))
    assert r.returncode == 0 and "odd\\udcfb.txt is not all UTF-8 text" in f.read_text(), r.stderr
    # a log that cannot be written (a full disk) is given up with one warning, and the run goes on (it was an exit 1
    # after the output, naming no file); so is stderr itself (llama.cpp's log goes on without it)
    plain = sharpi("-m", smol, "-p", "Hi", "-n", "2", "--temp", "0", process=True)
    if os.path.exists("/dev/full"):
        r = sharpi("-m", smol, "-p", "Hi", "-n", "2", "--temp", "0", "--log-file", "/dev/full", process=True)
        assert r.returncode == 0 and r.stdout == plain.stdout, r.stderr
        assert r.stderr.lstrip().startswith("warning: cannot write the log file /dev/full: No space left on device; the log goes "
                                   "on without it\n") and "eval time" in r.stderr
        r = subprocess.run(["bash", "-c", f"{SHARPI} -m {smol} -p Hi -n 2 --temp 0 2>/dev/full"], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0 and r.stdout == plain.stdout


def test_verbosity_threshold_is_llama_cpps(smol):
    """-lv: 3 (the default) information, warnings and timings; 2 warnings only; 1 nothing but an error;
    4 as --verbose (--log-verbose too)."""
    base = ("-m", smol, "-p", "Hi", "-n", "2", "--temp", "0", "--keep", "3")  # (--keep without a shift: a warning)
    lines = lambda r: [ln for ln in r.stderr.splitlines() if ln.strip()]  # noqa: E731
    r3 = sharpi(*base)
    assert any(ln.startswith("warning: --keep") for ln in lines(r3)) and any("eval time" in ln for ln in lines(r3))
    r2 = sharpi(*base, "-lv", "2")
    assert r2.returncode == 0 and lines(r2) == [ln for ln in lines(r3) if ln.startswith("warning:")]
    assert r2.stdout == r3.stdout
    assert lines(sharpi(*base, "-lv", "1")) == [] and lines(sharpi(*base, "-lv", "-5")) == []
    one_error_line(sharpi(*base, "-lv", "0", "--top-p", "nan"), 2, "--top-p")  # (errors always)
    for flag in (("-lv", "4"), ("--log-verbose",)):
        assert any(ln.startswith("sharpi: sampler chain:") for ln in lines(sharpi(*base, *flag))), flag
    assert not any(ln.startswith("sharpi: sampler chain:") for ln in lines(r3))


def test_list_devices():
    r = sharpi("--list-devices")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "Available devices:" and lines[1].startswith("  cpu: ") and lines[2].startswith("  cuda: ")
    from sharpi_core.kernels import cpu
    cpu.available()
    assert lines[1].endswith(f"({len(os.sched_getaffinity(0))} cores, {cpu.simd_level()}; C kernels compiled "
                             f"({cpu.build_info()['path'].parent}))")  # what the kernels run on
    r = sharpi("--list-devices", env={"SHARPI_CC": "/no/such/cc"})
    assert r.stdout.splitlines()[1].endswith("; no C compiler (install gcc, or set SHARPI_CC): dequantized torch matmuls)")


def test_check_tensors_refuses_a_bad_scale_before_loading(tmp_path):
    """--check-tensors: a NaN block scale (which loads, and makes NaN logits) is one error line naming the
    tensor and block, as llama.cpp's loader refuses it; the file is left as it was."""
    import gguf
    from test_loading import write_gguf
    path = write_gguf(tmp_path / "w.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_up.weight")
    data = bytearray(path.read_bytes())
    data[t.data_offset + 3 * 34:t.data_offset + 3 * 34 + 2] = np.array([np.nan], np.float16).tobytes()  # block 3's d
    path.write_bytes(bytes(data))
    one_error_line(sharpi("-m", path, "-p", "hi", "--check-tensors"), 1,
                   "tensor 'blk.0.ffn_up.weight' has invalid data (found nan value at block 3)")
    assert path.read_bytes() == bytes(data)


def test_missing_and_corrupt_model(tmp_path):
    one_error_line(sharpi("-m", tmp_path / "nope.gguf", "-p", "hi"), 2, "not found")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    before = bad.read_bytes()
    r = sharpi("-m", bad, "-p", "hi")
    assert r.returncode != 0
    one_error_line(r, r.returncode, "not a valid GGUF")
    assert bad.read_bytes() == before  # nothing the user had is touched


def test_a_missing_model_file_is_refused_before_anything_loads(tmp_path, smol):
    # -m and -md paths are checked with the flags: no torch import (seconds), and -md's typo is not found only
    # after the target has loaded
    code = ("import sys\nfrom sharpi_cli.entry import main\nsys.argv = sys.argv[1:]\ntry:\n    main()\n"
            "finally:\n    print('torch' in sys.modules, 'sharpi_core.models' in sys.modules, file=sys.stderr)\n")
    for args in (("-m", tmp_path / "nope.gguf"), ("-m", smol, "-md", tmp_path / "typo.gguf")):
        r = subprocess.run([sys.executable, "-c", code, "sharpi", *map(str, args), "-p", "hi"], capture_output=True,
                           text=True, stdin=subprocess.DEVNULL, timeout=300)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 2 and "not found" in lines[0], r.stderr
        assert lines[1] == "False False", r.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("fmt", [(), ("--json",)])
def test_unwritable_output_is_one_error_line(smol, fmt):
    with open("/dev/full", "w") as full:
        r = subprocess.run(SHARPI.split() + ["-m", smol, "-p", "Hi", "-n", "4", "--temp", "0", *fmt], stdout=full,
                           stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.strip() == "error: No space left on device", r.stderr


# llama.cpp's escape processing (string_process_escapes, on by default for -p/-f/-r): SmolLM2 prompt ids
# recorded with the fixtures' build (`llama-completion -p S -n 1 --verbose-prompt -no-cnv`), including
# strtol's quirks for \xHH (a sign or a leading space is read) and lone bytes (\xe9 is not UTF-8)
ESCAPE_CASES = [
    ("a\\nb", [81, 198, 82]), ("x\\\\y", [104, 76, 105]), ('q\\"r', [97, 18, 98]), ("it\\'s", [269, 506]),
    ("\\x41\\x4", [49, 76, 104, 36]), ("\\x-1z", [24211, 106]), ("end\\", [486, 76]), ("\\x c", [200]),
    ("\\q\\x", [76, 97, 76, 104]), ("tab\\there", [15999, 197, 1531]), ("\\xc3\\xa9t\\xe9", [19380, 24211]),
    ("\\x+f\\x 9", [203, 197]), ("\\\\\\\\n", [12332, 94]), ("A\\x0aB", [49, 198, 50]),
    # (bytes that are not UTF-8: one U+FFFD each, a cut-short sequence too; llamacpp_tokenize.c's ids)
    ("Hello \\xe2\\x82a", [19556, 216, 24211, 24211, 81]), ("\\xf0\\x9f\\x98", [24211] * 3),
]
# the same texts as bytes (-f, stdin) and llama.cpp's ids for them
UNDECODABLE = [(b"Hello \xe2\x82a", [19556, 216, 24211, 24211, 81]), (b"ok \xc3", [2231, 216, 24211]),
               (b"Hi \xff\xfe", [26843, 216, 24211, 24211])]


def test_prompt_escapes_are_llama_cpps(tmp_path):
    from conftest import loaded
    from sharpi_cli.options import RunOptions
    from sharpi_cli.inputs import process_escapes, read_prompt
    tok = loaded(SMOL)[1]
    for text, ids in ESCAPE_CASES:
        assert tok.encode(process_escapes(text)) == ids, text
        assert read_prompt(RunOptions(prompt=text, escape=False)) == text
    # -f: one trailing newline goes (llama.cpp's -f handler), then escapes as for -p
    f = tmp_path / "p.txt"
    f.write_text("Hello\\nworld\n\n")
    assert read_prompt(RunOptions(file=str(f))) == "Hello\nworld\n"
    assert read_prompt(RunOptions(file=str(f), escape=False)) == "Hello\\nworld\n"


def test_undecodable_prompt_bytes_are_read_as_llama_cpp_reads_them(smol, tmp_path):
    """-f, stdin and the tokenize command read bytes that are not UTF-8 as llama.cpp does (U+FFFD each), with a
    warning for a file; stdin too where the locale's decoder is strict (it raised a traceback)."""
    for i, (data, ids) in enumerate(UNDECODABLE):
        f = tmp_path / f"p{i}.txt"
        f.write_bytes(data)
        r = sharpi("tokenize", "-m", smol, "-f", f, "--ids", "--no-bos")
        assert r.returncode == 0 and json.loads(r.stdout) == ids, r.stderr
        assert "not all UTF-8 text" in r.stderr
        env = dict(os.environ, PYTHONIOENCODING="utf-8:strict")
        r = subprocess.run(SHARPI.split() + ["tokenize", "-m", smol, "--stdin", "--ids", "--no-bos"], input=data,
                           capture_output=True, env=env, timeout=300)
        assert r.returncode == 0 and json.loads(r.stdout) == ids, r.stderr
    r = subprocess.run(SHARPI.split() + ["-m", smol, "-f", "-", "-n", "2", "--temp", "0", "--json"], input=UNDECODABLE[0][0],
                       capture_output=True, env=env, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout)["timings"]["prompt_n"] == len(UNDECODABLE[0][1]), r.stderr
    r = subprocess.run(SHARPI.split() + ["-m", smol, "-cnv", "-n", "2", "--temp", "0"], input=b"Hi \xff\n",
                       capture_output=True, env=env, timeout=300)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr
    # arguments: the prompt (also without escape processing) and the system prompt reach the transcript as U+FFFD
    raw = os.fsdecode(b"Hi \xff")  # (how Python hands an undecodable argv byte over: a lone surrogate)
    r = sharpi("-m", smol, "-st", "-o", tmp_path / "t.txt", "--no-escape", "-p", raw, "-sys", raw, "-n", 2, "--temp", 0)
    assert r.returncode == 0, r.stderr
    assert "Hi \ufffd" in (tmp_path / "t.txt").read_text()  # (writing the surrogate raised a traceback)


def test_binary_file_prompt_is_llama_cpps(smol, tmp_path):
    """-bf: the file's bytes as the prompt, the trailing newline kept, escapes processed, undecodable bytes U+FFFD
    (llama-completion -bf --verbose-prompt's ids on the same file)."""
    f = tmp_path / "p.bin"
    f.write_bytes(b"Hello\\nthere \xff\n")
    r = sharpi("-m", smol, "-bf", f, "-n", 1, "--temp", 0, "--verbose-prompt")
    assert r.returncode == 0 and "Read 15 bytes from binary file" in r.stderr, r.stderr
    assert [int(m) for m in re.findall(r"^\s*(\d+) -> ", r.stderr, re.M)] == [19556, 198, 11527, 216, 24211, 198]
    one_error_line(sharpi("-m", smol, "-bf", f, "-f", f), 2, "-f/--file and -bf/--binary-file are mutually exclusive")
    one_error_line(sharpi("-m", smol, "-bf", tmp_path / "none"), 2, "cannot read binary file")


def test_llama_cli_flags_for_what_sharpi_does_not_do(smol):
    """--numa, --poll, --poll-batch, -kvo / -nkvo and -dt: llama-cli command lines run, a warning each, the output
    unchanged; their values checked as llama.cpp's parser checks them."""
    plain = sharpi("-m", smol, "-p", "Hi", "-n", 4, "--temp", 0)
    r = sharpi("-m", smol, "-p", "Hi", "-n", 4, "--temp", 0, "--numa", "distribute", "--poll", 5000000000, "--poll-batch", -1,
               "-nkvo", "-dt", "any")  # (llama.cpp: std::stoul reads --poll, std::stoi --poll-batch; -dt's value is never read)
    assert r.returncode == 0 and r.stdout == plain.stdout, r.stderr
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:") and "has no effect" in ln]
    assert len(warnings) == 5, r.stderr
    one_error_line(sharpi("-m", smol, "-p", "Hi", "--numa", "spread"), 2, "invalid --numa 'spread'")
    one_error_line(sharpi("-m", smol, "-p", "Hi", "--poll", "x"), 2, "--poll")


def test_llama_cli_placement_and_batch_flags(smol):
    """llama-cli's GPU placement (-ot, -cmoe, -ncmoe, -sm, -ts, -mg, -fit*), batch / draft CPU placement (-Cb, -Crb,
    -Cd, ..., --prio-batch, --cpu-strict), -np, -ctxcp, -cram, -bs, -lzm, --spec-draft-p-split flags: the output
    unchanged, one warning each, none where the value asks for what sharpi does (-np 1, -sm none, -fit off,
    --no-mmproj, --no-spec-draft-backend-sampling)."""
    plain = sharpi("-m", smol, "-p", "Hi", "-n", 4, "--temp", 0)
    warned = ["-ot", r"blk\.0\..*=CPU,token_embd=CPU", "-otd", "exps=CPU", "-cmoe", "-ncmoe", 2, "-cmoed", "-ncmoed", 1,
              "-ncffn", 3, "-sm", "row", "-ts", "3/1", "-mg", 0, "-fit", "on", "-fitt", "1024,512", "-fitc", 4096,
              "--no-op-offload", "--no-host", "-lzm", "on", "--cpu-strict", 1, "--cpu-strict-batch", 0, "-Cb", "0x3",
              "--prio-batch", 1, "-Cd", "1", "--spec-draft-prio", 2, "--spec-draft-poll", 1, "-np", 4, "-ctxcp", 8,
              "-cram", 0, "-bs", "--spec-draft-p-split", 0.2, "--mmproj-auto"]
    quiet = ["-np", 1, "-sm", "none", "-fit", "off", "--no-mmproj", "--no-spec-draft-backend-sampling", "-ngl", "0",
             "-ngld", "auto", "-devd", "none"]
    r = sharpi("-m", smol, "-p", "Hi", "-n", 4, "--temp", 0, *warned)
    assert r.returncode == 0 and r.stdout == plain.stdout, r.stderr
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:") and "has no effect" in ln]
    assert len(warnings) == 29, r.stderr  # (one a flag: 29 given)
    r = sharpi("-m", smol, "-p", "Hi", "-n", 4, "--temp", 0, *quiet)
    assert r.returncode == 0 and r.stdout == plain.stdout and "warning" not in r.stderr, r.stderr
    for args, msg in ((("-ot", "blk"), "PATTERN=BUFFER_TYPE expected"), (("-ot", "blk(=CPU"), "not a regular expression"),
                      (("-otd", "blk=CUDA7"), "unknown buffer type 'CUDA7'"),
                      (("-ncmoe", -1), "invalid -ncmoe/--n-cpu-moe -1"), (("-sm", "rows"), "invalid -sm/--split-mode"),
                      (("-ts", "1,x"), "invalid -ts/--tensor-split"), (("-ts", ",".join("1" * 16)), "16 values"),
                      (("-fit", "maybe"), "invalid -fit/--fit"), (("-fitt", "1.5"), "invalid -fitt/--fit-target"),
                      (("-lzm", "lazy"), "invalid -lzm/--lazy-mode"), (("-Cb", "xyz"), "invalid -Cb/--cpu-mask-batch"),
                      (("-Crd", "3"), "invalid -Crd/--spec-draft-cpu-range"), (("--prio-batch", 4), "--prio-batch 4"),
                      (("--prio-draft", -1), "--spec-draft-prio -1"), (("-lm", "fast"), "invalid -lm/--load-mode"),
                      (("-devd", "CUDA1"), "invalid -devd/--spec-draft-device"), (("-mm", "p.gguf"), "text models only"),
                      (("--image", "a.png"), "text models only"), (("--log-colors", "maybe"), "invalid --log-colors")):
        one_error_line(sharpi("-m", smol, "-p", "Hi", *args), 2, msg)
    r = sharpi("-m", smol, "-p", "Hi", "-ngl", "most")
    assert r.returncode == 2 and "a number of layers, auto or all" in r.stderr


def test_gpu_layers_without_device(smol, monkeypatch, tmp_path):
    """-ngl / -ngld asking for GPU layers without -dev (-ngld: nor -devd): the GPU where CUDA is usable (llama-cli
    offloads by itself), resolved before the checks that depend on the device, else a warning that they are
    ignored and the CPU run unchanged; -ngl 0, a -dev given, or -ngld beside -devd decide without either. auto and
    all are numbers of layers too."""
    from sharpi_cli import options, validate
    from sharpi_core.backends import cuda
    from sharpi_core.errors import UsageError
    for usable, device in ((True, "cuda"), (False, "cpu")):
        monkeypatch.setattr(cuda, "cuda_available", lambda: (usable, "a test"))
        o = options.RunOptions(gpu_layers_asked=("-ngl",))
        validate.resolve_device(o)
        assert o.device == device
        o = options.RunOptions(device="cpu")  # (-dev cpu, or no -ngl / -ngld other than 0)
        validate.resolve_device(o)
        assert o.device == "cpu"
        # the checks that depend on the device see the one -ngl picked
        o = options.RunOptions(prompt_cache=str(tmp_path / "p.bin"), gpu_layers_asked=("-ngl",))
        if usable:
            with pytest.raises(UsageError, match="--prompt-cache: the CPU's KV caches only"):
                validate.validate(o)
        else:
            validate.validate(o)
        # -devd none -ngl 99: the draft on the CPU, the target where -ngl asks
        o = options.RunOptions(model_draft="d.gguf", device_draft="none", n_gpu_layers=99, gpu_layers_asked=("-ngl",))
        validate.validate(o)
        validate.resolve_device(o)
        assert (o.device, o.n_gpu_layers, o.spec_draft_ngl) == (device, 99, 0)
    # -devd CUDA0 puts the target on the CPU (-ngl 0) unless -ngl asks for its layers
    for asked, ngl in (((), 0), (("-ngl",), 20)):
        o = options.RunOptions(model_draft="d.gguf", device_draft="CUDA0", n_gpu_layers=20, gpu_layers_asked=asked)
        validate.validate(o)
        assert (o.device, o.n_gpu_layers, o.spec_draft_ngl) == ("cuda", ngl, -1)
    monkeypatch.undo()
    if cuda.cuda_available()[0]:
        return  # (on a GPU machine the runs below would run there)
    plain = sharpi("-m", smol, "-p", "Hi", "-n", 4, "--temp", 0)
    r = sharpi("-m", smol, "-p", "Hi", "-n", 4, "--temp", 0, "-ngl", "all", "-ngld", 7)
    warnings = [ln for ln in r.stderr.splitlines() if "warning" in ln]
    assert r.returncode == 0 and r.stdout == plain.stdout, r.stderr
    assert len(warnings) == 1 and warnings[0].startswith("warning: no usable GPU found, -ngl and -ngld ignored"), r.stderr
    r = sharpi("-m", smol, "-p", "Hi", "-n", 4, "--temp", 0, "-ngl", 5, "-ngld", 3, "-devd", "none")
    assert r.returncode == 0 and r.stdout == plain.stdout and "-ngl ignored" in r.stderr, r.stderr
    for args in (("-ngl", 0), ("-ngl", 99, "-dev", "cpu"), ("-ngld", 3, "-devd", "none")):
        r = sharpi("-m", smol, "-p", "Hi", "-n", 4, "--temp", 0, *args)
        assert r.returncode == 0 and r.stdout == plain.stdout and "warning" not in r.stderr, (args, r.stderr)


def test_load_mode_draft_device_and_chat_parsing_flags():
    """-lm sets --mmap / --mlock as llama-cli's load modes mean them (auto leaves them); -devd places the draft:
    none on the CPU (-ngld 0 there), CUDA0 beside a target on the CPU (a GPU run with -ngl 0), a missing GPU named
    under -devd; --skip-chat-parsing is --reasoning-format none."""
    from sharpi_cli.options import RunOptions
    from sharpi_cli.validate import validate
    from sharpi_core.errors import UsageError
    for mode, mmap, mlock in (("auto", False, True), ("mmap", True, False), ("none", False, False),
                              ("mlock", False, True), ("mmap+mlock", True, True), ("dio", False, False)):
        o = RunOptions(load_mode=mode, mmap=False, mlock=True)
        validate(o)
        assert (o.mmap, o.mlock) == (mmap, mlock), mode
    o = RunOptions(device="CUDA0", device_draft="none", model_draft="d.gguf")
    validate(o)
    assert (o.device, o.n_gpu_layers, o.spec_draft_ngl) == ("cuda", -1, 0)
    o = RunOptions(device="none", device_draft="CUDA0", model_draft="d.gguf")
    validate(o)
    assert (o.device, o.n_gpu_layers, o.spec_draft_ngl) == ("cuda", 0, -1)
    pure = RunOptions(skip_chat_parsing=True, reasoning_format="deepseek")  # (llama-cli's pure content parser)
    validate(pure)
    assert pure.reasoning_format == "none"
    from sharpi_core.backends.cuda import cuda_available
    if not cuda_available()[0]:
        from sharpi_cli.validate import check_device
        with pytest.raises(UsageError, match="-devd/--spec-draft-device cuda requested but CUDA is unavailable"):
            check_device(o)


def test_log_prefix_timestamps_and_colors(smol, tmp_path):
    """--log-prefix: each log line starts with its level (I, W; the error line E), as llama.cpp's log writes them;
    --log-timestamps adds M.SS.mmm.uuu (and implies the prefix); --log-colors on colors them on stderr, never in
    --log-file; auto (the default) does not on a pipe."""
    r = sharpi("-m", smol, "-p", "Hi", "-n", 2, "--temp", 0, "--log-prefix", "-np", 2)
    lines = [ln for ln in r.stderr.splitlines() if ln]
    assert r.returncode == 0 and lines and all(ln[:2] in ("I ", "W ") for ln in lines), r.stderr
    assert "W warning: -np/--parallel has no effect" in r.stderr and "I sharpi:       total time" in r.stderr
    log = tmp_path / "log.txt"
    r = sharpi("-m", smol, "-p", "Hi", "-n", 2, "--temp", 0, "--log-timestamps", "--log-colors", "on", "--log-file", log)
    stamp = r"\d+\.\d\d\.\d{3}\.\d{3} "
    assert r.returncode == 0 and re.search(rf"^\x1b\[34m{stamp[:-1]}\x1b\[0m \x1b\[32mI \x1b\[0msharpi:", r.stderr, re.M)
    text = log.read_text()
    assert "\x1b" not in text and all(re.match(stamp + "[IW] ", ln) for ln in text.splitlines() if ln), text
    r = sharpi("-m", smol, "-p", "Hi", "-n", 2, "--log-timestamps", "--no-log-prefix", "--temp", 0)
    assert r.returncode == 0 and "sharpi:       total time" in r.stderr and not re.search(stamp, r.stderr)
    r = sharpi("-m", smol, "-p", "word " * 50, "-c", 16, "--log-prefix")  # (stderr is no terminal: auto, no colors)
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith("E error: prompt is 51 tokens"), r.stderr
    r = sharpi("-m", smol, "-p", "word " * 50, "-c", 16)
    assert r.stderr.splitlines()[-1].startswith("error: "), r.stderr


def test_reverse_prompt_escapes(smol):
    args = ("-m", smol, "-p", "List three colors:\\n1.", "-n", 30, "-r", "\\n", "--temp", 0, "--json")
    d = json.loads(sharpi(*args).stdout)
    assert d["stop_reason"] == "stop_string" and d["text"].endswith("\n") and d["text"].count("\n") == 1
    assert json.loads(sharpi(*args, "--no-escape").stdout)["stop_reason"] == "n_predict"


def test_a_text_too_long_for_any_tokens_is_refused_before_tokenizing(smol, tmp_path, monkeypatch):
    """A -f file that could not fit the context whatever its tokens (each covers at most the longest token's 81
    characters here) is refused before it is tokenized (16 MB took a minute and ~3 GB); one character less and it
    is tokenized, then refused with its real count."""
    from sharpi_core.tokenizer import Tokenizer
    encode = Tokenizer.encode
    sizes = []
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, *a, **k: sizes.append(len(text)) or encode(self, text, *a, **k))
    f = tmp_path / "long.txt"
    f.write_text("x" * (81 * 15 + 1))
    r = sharpi("-m", smol, "-f", f, "-c", 16)
    line = one_error_line(r, 2, "-c/--ctx-size")
    assert "prompt is at least 16 tokens (1216 characters)" in line and "context of 16 (at most 15," in line
    assert 1216 not in sizes
    f.write_text("x" * (81 * 15))
    r = sharpi("-m", smol, "-f", f, "-c", 16)
    assert re.search(r"prompt is \d+ tokens, which", one_error_line(r, 2, "-c/--ctx-size")) and 1215 in sizes
    # a system prompt: with -p its chat turn counts it too; in a chat it must leave room for a message and a reply
    sizes.clear()
    line = one_error_line(sharpi("-m", smol, "-sysf", f, "-p", "hi", "-c", 16), 2, "-c/--ctx-size")
    assert "prompt is at least 16 tokens (1217 characters)" in line and not sizes
    line = one_error_line(sharpi("-m", smol, "-sysf", f, "-cnv", "-c", 16), 2, "-c/--ctx-size")
    assert "the system prompt is at least 15 tokens (1215 characters)" in line and not sizes
    # /read: a file that alone fills the context, or one that is not text, goes no further than its line
    (tmp_path / "bin.dat").write_bytes(b"GGUF\0\0\3" + b"x" * 100)
    r = sharpi("-m", smol, "-cnv", "--temp", 0, "-n", 2, "-c", 16, "--no-show-timings",
               input=f"/read {f}\n/read {tmp_path / 'bin.dat'}\nHi\n")
    assert (f"error: /read: '{f}' (1215 characters) makes the files for your next message at least 15 tokens, more "
            "than the context of 16 holds with a reply") in r.stderr and r.returncode == 0, r.stderr
    assert f"error: /read: cannot read '{tmp_path / 'bin.dat'}' (not a text file: it holds NUL bytes)" in r.stderr
    assert not [n for n in sizes if n > 1000] and r.stdout.count("> ") == 4, (sizes, r.stdout)


def test_prompt_longer_than_context(smol):
    r = sharpi("-m", smol, "-p", "word " * 50, "-c", 16)
    line = one_error_line(r, 2, "-c/--ctx-size")
    assert "prompt is 51 tokens" in line and "context of 16 (at most 15," in line
    # speculation needs no more room than plain decoding (it was refused at -c 53): it proposes fewer
    # tokens near the end of the context, and its output is plain greedy's up to the full context
    for c in (53, 72):
        args = ("-m", smol, "-p", "word " * 50, "-c", c, "--temp", 0, "--json", "--ignore-eos")
        plain = json.loads(sharpi(*args).stdout)
        spec = json.loads(sharpi(*args, "--draft-lookup").stdout)
        assert spec["tokens"] == plain["tokens"] and spec["stop_reason"] == plain["stop_reason"] == "ctx_full"
    assert spec["speculative"]["drafted"] > 0 and len(spec["tokens"]) == 72 - 51  # the last one is never fed


def test_options_before_a_command_name_are_refused(smol):
    """`sharpi -m M tokenize ...` gave -m to the run, not to tokenize, which then used the default model without a
    word: options before a command's name are refused (the command's own ones named with where they go)."""
    one_error_line(sharpi("-m", smol, "tokenize", "-p", "Hi"), 2,
                   "-m before 'tokenize' would be ignored: a command's options go after its name (sharpi tokenize -m ...)")
    one_error_line(sharpi("--temp", 0, "perplexity", "-m", smol, "-f", "x.txt"), 2, "--temp before 'perplexity'")
    one_error_line(sharpi("-m", smol, "models", "list"), 2, "-m before 'models' would be ignored: 'models' takes no -m")
    one_error_line(sharpi("--offline", "models", "list"), 2, "--offline before 'models' would be ignored: 'models' takes "
                   "no --offline")  # (it said "a command's options go after its name": models' commands take none)
    r = sharpi("tokenize", "-m", smol, "-p", "Hi", "--ids", env={"SHARPI_ARG_TEMP": "0"})  # (the environment: not given)
    assert r.returncode == 0 and r.stdout.startswith("["), r.stderr



def test_tokenize_takes_stdin_then_file_then_prompt(smol, tmp_path):
    """Several sources of the text: llama-tokenize (the fixtures' llama.cpp) takes --stdin, else -f, else -p; sharpi
    refused them. It says which it took."""
    f = tmp_path / "x.txt"
    f.write_text("file text")
    want = {src: sharpi("tokenize", "-m", smol, *args, "--ids", input=inp).stdout
            for src, args, inp in (("stdin", ["--stdin"], "stdin text"), ("file", ["-f", f], None),
                                   ("prompt", ["-p", "prompt text"], None))}
    assert len(set(want.values())) == 3
    for args, inp, src, unused in ((["-p", "prompt text", "-f", f], None, "file", "-p/--prompt"),
                                   (["--stdin", "-p", "prompt text"], "stdin text", "stdin", "-p/--prompt"),
                                   (["-f", f, "--stdin", "-p", "a"], "stdin text", "stdin", "-f/--file and -p/--prompt")):
        r = sharpi("tokenize", "-m", smol, *args, "--ids", input=inp)
        assert r.returncode == 0 and r.stdout == want[src], (args, r.stdout, r.stderr)
        assert "not used" in r.stderr and unused in r.stderr


def test_tokenize_command_matches_llama_tokenize(smol):
    case = reference()[SMOL]["tokenize"][3]
    r = sharpi("tokenize", "-m", smol, "-p", case["text"], "--ids")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == case["ids"]


def test_tokenize_adds_special_tokens_as_llama_tokenize(smol, tmp_path):
    """llama-tokenize adds the special tokens only where the vocabulary adds a BOS (add_special = add_bos and not
    --no-bos): a vocabulary with add_eos but not add_bos gets neither (SmolLM2's vocabulary, add_eos_token set)."""
    import gguf
    derive = gguf_derive()
    f = tmp_path / "vocab-eos.gguf"  # (the vocabulary alone: tokenize reads no tensor)
    w = gguf.GGUFWriter(str(f), "llama")
    derive.copy_kv(gguf.GGUFReader(smol), w)
    w.add_key_value("tokenizer.ggml.add_eos_token", True, gguf.GGUFValueType.BOOL)
    derive.finish(w)
    plain = json.loads(sharpi("tokenize", "-m", smol, "-p", "Hello", "--ids").stdout)
    r = sharpi("tokenize", "-m", f, "-p", "Hello", "--ids")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == plain and len(plain) == 1


def test_perplexity_command(smol):
    ref = reference()[SMOL]["perplexity"]
    r = sharpi("perplexity", "-m", smol, "-f", FIXTURES_DIR / ref["file"], "-c", 128, "--chunks", 8)
    assert r.returncode == 0, r.stderr
    last = [ln for ln in r.stdout.splitlines() if ln.startswith("Final estimate")][0]
    # llama-perplexity's line to the last digit: the fixture's numbers
    assert last == f"Final estimate: PPL = {ref['ppl']:.4f} +/- {ref['err']:.5f}"
    r = sharpi("perplexity", "-m", smol, "-f", FIXTURES_DIR / ref["file"], "-c", 128, "--chunks", 8, "-fa", "off")
    assert r.returncode == 0 and "Final estimate: PPL = 17.9203 +/- 2.28299" in r.stdout  # llama.cpp -fa off
    r = sharpi("perplexity", "-m", smol, "-f", FIXTURES_DIR / ref["file"], "-c", 128, "--chunks", 8, "-ctk", "iq4_nl",
               "-ctv", "q5_0")
    assert r.returncode == 0 and "Final estimate: PPL = 18.6871 +/- 2.39274" in r.stdout  # llama-perplexity's, same types
    # one scored token: no spread, so no estimate (llama-perplexity's line instead)
    r = sharpi("perplexity", "-m", smol, "-f", FIXTURES_DIR / ref["file"], "-c", 3, "--chunks", 1)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "Unexpected negative standard deviation of log(prob)"


def test_perplexity_runs_on_threads_batch_threads(smol, monkeypatch):
    """-tb: llama.cpp evaluates a pass of several tokens on -tb's threads (-1: -t's), and every pass of perplexity
    is one."""
    import sharpi_cli.tools as tools
    counts = []
    monkeypatch.setattr(tools, "set_threads", counts.append)
    base = ("perplexity", "-m", smol, "-f", FIXTURES_DIR / "apache-2.0.txt", "-c", 64, "--chunks", 1)
    for args in (("-t", 1), ("-t", 1, "-tb", 2), ("-tb", 1)):
        assert sharpi(*base, *args).returncode == 0
    assert counts == [1, 2, 1]
    one_error_line(sharpi(*base, "-tb", 513), 2, "invalid -tb/--threads-batch 513: at most 512")


def test_perplexity_takes_the_model_and_log_flags(smol, tmp_path):
    """perplexity takes llama-perplexity's common flags for what the model computes (--rope-*, --yarn-*,
    --override-kv, --check-tensors) and for the log (-lv, -v, --log-file, --log-prefix, ...), as run does; they
    were "No such option"."""
    import gguf

    from sharpi_core import engine
    from sharpi_core.perplexity import Passes, perplexity
    from test_loading import write_gguf
    text = FIXTURES_DIR / "apache-2.0.txt"
    base = ("perplexity", "-m", smol, "-f", text, "-c", 128, "--chunks", 2)
    final = lambda r: (r.returncode, r.stdout.splitlines()[-1], r.stderr)  # noqa: E731
    plain = final(sharpi(*base))
    # the base frequency as a flag and as the model's metadata: the same numbers, not the model's own
    by_flag = final(sharpi(*base, "--rope-freq-base", 50000))
    assert by_flag[:2] == final(sharpi(*base, "--override-kv", "llama.rope.freq_base=float:50000"))[:2]
    assert by_flag[0] == 0 and by_flag[1] != plain[1]
    # YaRN: the engine's perplexity on the model set so (its RoPE: tests/test_rope.py's llama.cpp oracle)
    m = engine.load(str(smol))
    m.model.set_rope(0.0, 0.25, "yarn", {"yarn_orig_ctx": 64})
    ids = m.tokenizer.encode(text.read_text()[:-1], add_special=True, parse_special=False)
    r = perplexity(m.model, ids, 128, 2, bos_id=m.tokenizer.bos_id if m.tokenizer.add_bos else None,
                   n_pass=Passes.of(2048, 512, 128))  # (the CLI's -b and -ub: the passes' rows move the last digits)
    yarn = final(sharpi(*base, "--rope-scaling", "yarn", "--rope-freq-scale", 0.25, "--yarn-orig-ctx", 64, "-v"))
    assert yarn[0] == 0 and yarn[1] == f"Final estimate: PPL = {r.ppl:.4f} +/- {r.err:.5f}" != plain[1]
    # a metadata override reaches the tokenizer too: a BOS in front
    r = sharpi(*base, "--override-kv", "tokenizer.ggml.add_bos_token=bool:true")
    assert f"tokenized {len(ids) + 1} tokens" in r.stderr and f"tokenized {len(ids)} tokens" in sharpi(*base).stderr
    one_error_line(sharpi(*base, "--rope-scaling", "wide"), 2, "invalid --rope-scaling 'wide'")
    one_error_line(sharpi(*base, "--yarn-beta-fast", 0), 2, "invalid --yarn-beta-fast 0")
    one_error_line(sharpi(*base, "--override-kv", "x=int"), 2, "--override-kv")
    one_error_line(sharpi(*base, "--chunks", 2**31), 2, "invalid --chunks 2147483648: out of range")
    bad = write_gguf(tmp_path / "w.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    t = next(t for t in gguf.GGUFReader(str(bad)).tensors if t.name == "blk.0.ffn_up.weight")
    data = bytearray(bad.read_bytes())
    data[t.data_offset:t.data_offset + 2] = np.array([np.nan], np.float16).tobytes()  # block 0's d
    bad.write_bytes(bytes(data))
    one_error_line(sharpi("perplexity", "-m", bad, "-f", text, "-c", 16, "--check-tensors"), 1,
                   "tensor 'blk.0.ffn_up.weight' has invalid data (found nan value at block 0)")
    # the log: -v describes the model; -lv 2 only warnings; --log-file and --log-prefix as run's
    assert "KV cache K f16 V f16, RoPE base 100000 freq scale 0.25 (yarn scaling)" in yarn[2]
    quiet = sharpi(*base, "-lv", 2)
    assert quiet.returncode == 0 and quiet.stderr.strip() == "" and quiet.stdout.splitlines()[-1] == plain[1]
    log = tmp_path / "log.txt"
    r = sharpi(*base, "--log-file", log, "--log-prefix")
    assert r.returncode == 0 and "I perplexity: tokenized" in r.stderr
    assert log.read_text().startswith("I perplexity: tokenized") and r.stdout.splitlines()[-1] == plain[1]
    assert one_error_line(sharpi(*base, "--log-file", log, "-c", 99999), 1, "need at least") + "\n" == log.read_text()
    one_error_line(sharpi(*base, "--log-file", text), 2, f"--log-file {text} is the file -f/--file names")
    one_error_line(sharpi(*base, "--log-colors", "maybe"), 2, "invalid --log-colors 'maybe'")
    # the KL divergence's read and the scores load the model the same way (its n_ctx: the base file's)
    kld = tmp_path / "base.kld"
    assert sharpi(*base, "--kl-divergence-base", kld).returncode == 0
    r = sharpi("perplexity", "-m", smol, "--kl-divergence-base", kld, "--kl-divergence", "--rope-scaling", "none",
               "--rope-freq-base", 50000, "-v", "--log-file", log)
    assert r.returncode == 0 and "n_ctx 128, KV cache K f16 V f16, RoPE base 50000 freq scale 1 (no scaling)" in r.stderr
    assert "KLD" in r.stdout and r.stdout != sharpi("perplexity", "-m", smol, "--kl-divergence-base", kld,
                                                     "--kl-divergence").stdout  # (other logits than the base's)
    assert log.read_text().splitlines() == [ln for ln in r.stderr.splitlines() if ln.strip()]
    tasks = tmp_path / "hellaswag.txt"
    tasks.write_text("A man sits\n0\n down.\n up.\n in.\n out.\n")
    r = sharpi("perplexity", "-m", smol, "--hellaswag", "-f", tasks, "--rope-freq-base", 50000, "-v")
    assert r.returncode == 0 and "RoPE base 50000 freq scale 1" in r.stderr, r.stderr


def test_quantized_v_cache_needs_flash_attention(smol):
    # llama.cpp's rule (-fa off refuses a quantized V cache; a quantized K, bf16 or f32 V go)
    one_error_line(sharpi("-m", smol, "-p", "Hi", "-n", 1, "-fa", "off", "-ctv", "q4_0"), 2,
                   "-ctv q4_0: a quantized V cache needs flash attention")
    one_error_line(sharpi("-m", smol, "-p", "Hi", "-n", 1, "-fa", "off", "-md", smol, "-ctvd", "q8_0"), 2,
                   "-ctvd q8_0: a quantized V cache needs flash attention")
    one_error_line(sharpi("perplexity", "-m", smol, "-f", FIXTURES_DIR / "apache-2.0.txt", "-fa", "off", "-ctv", "iq4_nl"),
                   2, "-ctv iq4_nl: a quantized V cache needs flash attention")
    r = sharpi("-m", smol, "-p", "Hi", "-n", 2, "-fa", "off", "-ctk", "q4_1", "-ctv", "bf16", "-v")
    assert r.returncode == 0 and "KV cache K q4_1 V bf16" in r.stderr, r.stderr


@pytest.mark.parametrize("args,code,fragment", [
    (("-c", 64, "--chunks", 0), 2, "invalid --chunks 0"),
    (("-c", 2), 2, "invalid -c/--ctx-size 2: must be >= 3"),
    (("-t", 513), 2, "invalid -t/--threads 513: at most 512"),
    (("-c", 99999), 1, "need at least 99999 tokens for perplexity"),  # and no "calculating over 0 chunks" first
])
def test_perplexity_bad_arguments_are_one_error_line(smol, args, code, fragment):
    one_error_line(sharpi("perplexity", "-m", smol, "-f", FIXTURES_DIR / "apache-2.0.txt", *args), code, fragment)


def test_models_list():
    r = sharpi("models", "list")
    assert r.returncode == 0 and SMOL in r.stdout


def test_models_pull_and_cache_errors(tmp_path):
    one_error_line(sharpi("models", "pull", "../../etc/passwd"), 2, "unknown model '../../etc/passwd'")
    one_error_line(sharpi("-m", "", "-p", "hi"), 2, "the model name is empty")
    (tmp_path / "file").write_text("not a directory")
    r = sharpi("-p", "hi", env={"SHARPI_MODELS_DIR": str(tmp_path / "file")})
    one_error_line(r, 1, "is not a directory (SHARPI_MODELS_DIR)")
    assert "fetching" not in r.stderr


def test_a_damaged_cached_model_and_the_models_commands(smol, tmp_path):
    import shutil
    cache = tmp_path / "models"
    cache.mkdir()
    path = cache / f"{SMOL}.gguf"
    shutil.copyfile(smol, path)
    env = {"SHARPI_MODELS_DIR": str(cache)}
    r = sharpi("models", "list", env=env)
    assert "changed since its sha256 was checked" in r.stdout  # a file no fetch wrote: checked at its next use
    args = ("-m", SMOL.upper() + ".gguf", "--offline", "-p", "Hi", "-n", 2, "--temp", 0)  # any case, with .gguf
    assert sharpi(*args, env=env).returncode == 0
    r = sharpi("models", "list", env=env)
    assert f"cached at {path}]" in r.stdout
    with open(path, "r+b") as f:  # bytes damaged where they lie: the size is right
        f.seek(40_000_000)
        f.write(b"\xff" * 64)
    one_error_line(sharpi(*args, env=env), 1, f"the cached {SMOL} is damaged (its sha256 is wrong) and --offline "
                                              f"forbids fetching it again (`sharpi models pull {SMOL}` will)")
    one_error_line(sharpi("models", "rm", "smollm2", env=env), 2, f"unknown model 'smollm2' (did you mean {SMOL}?")
    r = sharpi("models", "rm", SMOL, env=env)
    assert r.returncode == 0 and r.stdout == f"removed {path}\n" and not any(cache.iterdir())
    assert sharpi("models", "rm", SMOL, env=env).stdout == f"{SMOL}: not in the cache\n"
    r = sharpi("models", env=env)
    assert r.returncode == 2 and "Commands:" in r.stderr and "rm " in r.stderr and "error:" not in r.stderr


def test_kernels_that_cannot_be_kept_or_built_are_said(smol, tmp_path):
    """An unwritable kernel cache: compiled for the run alone, and said once; no compiler: said, torch runs."""
    from sharpi_core.kernels import cpu
    cc = tmp_path / "cc"  # a stand-in compiler copying this process's library (as in the first-use test)
    cc.write_text(f'#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && exec cp {cpu.build_info()["path"]} "$2"; '
                  'shift; done\nexit 1\n')
    cc.chmod(0o755)
    (tmp_path / "file").write_text("")
    args = ("-m", smol, "-p", "Hi", "-n", 2, "--temp", 0, "--json")
    want = json.loads(sharpi(*args).stdout)["tokens"]
    r = sharpi(*args, env={"SHARPI_KERNEL_DIR": str(tmp_path / "file" / "k"), "SHARPI_CC": str(cc)}, process=True)
    assert r.returncode == 0 and json.loads(r.stdout)["tokens"] == want, r.stderr
    assert r.stderr.count("compiling the CPU kernels") == 1
    assert r.stderr.count(f"warning: the kernel cache {tmp_path / 'file' / 'k'} cannot be written (Not a directory): "
                          "the kernels were compiled for this run only") == 1
    r = sharpi(*args, env={"SHARPI_KERNEL_DIR": str(tmp_path / "k"), "SHARPI_CC": str(tmp_path / "none")},
               process=True)
    assert r.returncode == 0 and "warning: the C kernels are unavailable (no C compiler found" in r.stderr
    assert "torch's matmuls run instead, several times slower" in r.stderr


def test_every_environment_switch_is_in_the_readmes_table():
    """Each SHARPI_* name the code reads has its row in README's table of environment variables."""
    root = Path(__file__).resolve().parents[1]
    names = set()
    for f in [*(root / "sharpi_core").rglob("*.py"), *(root / "sharpi_core").rglob("*.c"), *(root / "sharpi_cli").rglob("*.py")]:
        names |= set(re.findall(r"""["'](SHARPI_[A-Z0-9_]*[A-Z0-9])["']""", f.read_text()))
    rows = set(re.findall(r"^\| `(SHARPI_[A-Z0-9_]+)", (root / "README.md").read_text(), re.M))
    assert {"SHARPI_SPEC_SAMPLE", "SHARPI_SPEC_BATCH_VERIFY", "SHARPI_KERNEL_LTO"} <= names
    assert not names - rows, sorted(names - rows)


def test_version():
    r = sharpi("--version", process=True)
    assert r.returncode == 0 and r.stdout.startswith("sharpi ")
    m = subprocess.run([sys.executable, "-m", "sharpi_cli", "--version"], capture_output=True, text=True)
    assert m.returncode == 0 and m.stdout == r.stdout, m.stderr  # python -m sharpi_cli is the same program


def test_draft_lookup_greedy_equals_plain_and_reports_stats(smol):
    prompt = "Copy exactly: one two three four five six seven eight. Copy: one two three four five six seven eight. Copy:"
    plain = json.loads(sharpi("-m", smol, "-p", prompt, "-n", 24, "--temp", 0, "--json").stdout)
    r = sharpi("-m", smol, "-p", prompt, "-n", 24, "--temp", 0, "--json", "--draft-lookup")
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)
    assert spec["tokens"] == plain["tokens"]
    s = spec["speculative"]
    assert s["drafted"] > 0 and 0 <= s["acceptance"] <= 1 and s["tokens_per_pass"] >= 1


def test_a_draft_model_drafts_beside_lookup_from_a_short_window_by_default(smol):
    """-md brings prompt lookup beside the draft model (unless --no-draft-lookup, or llama.cpp's n-gram drafters are
    asked for), and a draft model on the CPU keeps the last DRAFT_CTX_CPU tokens unless -cd says otherwise (a draft
    on the GPU 4096); --draft-lookup given with an n-gram drafter is still refused."""
    from sharpi_cli.runner import DRAFT_CTX_CPU, DRAFT_CTX_GPU, draft_ctx, wants_lookup
    from sharpi_cli.options import RunOptions
    from sharpi_cli.validate import validate
    from sharpi_core.errors import UsageError
    opts = lambda **kw: RunOptions(model=smol, prompt="hi", **kw)  # noqa: E731
    o = opts(model_draft=smol)
    validate(o)
    assert wants_lookup(o) and (DRAFT_CTX_CPU, DRAFT_CTX_GPU) == (256, 4096)
    assert draft_ctx(o, 4096) == 256 and draft_ctx(o, 100) == 100
    o.device = "cuda"
    assert draft_ctx(o, 8192) == 4096 and draft_ctx(o, 1000) == 1000
    o.spec_draft_ngl = 0  # (the draft on the CPU beside a target on the GPU)
    assert draft_ctx(o, 8192) == 256
    o = opts(model_draft=smol, ctx_size_draft=1000)
    validate(o)
    assert draft_ctx(o, 4096) == 1000
    for kw, want in ((dict(model_draft=smol, draft_lookup=False), False), (dict(), False),
                     (dict(draft_lookup=True), True), (dict(model_draft=smol, spec_type=["ngram-simple"]), False),
                     (dict(model_draft=smol, draft_lookup=True), True)):
        o = opts(**kw)
        validate(o)
        assert wants_lookup(o) is want, kw
    with pytest.raises(UsageError, match="both draft from the history's n-grams"):
        validate(opts(model_draft=smol, draft_lookup=True, spec_type=["ngram-simple"]))
    args = ("-m", smol, "-md", smol, "-p", "Copy: one two three four. Copy: one two three four. Copy:", "-n", 12,
            "--temp", 0, "--json")
    plain = json.loads(sharpi(*args[:2], *args[4:]).stdout)["tokens"]
    both, alone = (json.loads(sharpi(*args, *more).stdout) for more in ((), ("--no-draft-lookup",)))
    assert both["tokens"] == alone["tokens"] == plain
    assert set(both["speculative"]["sources"]) == {"lookup", "draft"} and "sources" not in alone["speculative"]
    # sampled too: a hybrid, which reports its sources (the ones that took steps: a self-draft may take them all)
    sampled = json.loads(sharpi(*args[:-3], "--temp", 0.7, "-s", 3, "--json").stdout)
    assert "draft" in sampled["speculative"]["sources"]


def test_speculation_by_measured_cost_keeps_the_greedy_text(smol):
    # greedy sharpi's default (the suite turns it off): plain steps measured, then as the costs say
    args = ("-m", smol, "-p", "Once upon a time", "-n", 40, "--temp", 0, "--json")
    plain = json.loads(sharpi(*args).stdout)
    # (a draft model, alone or with lookup: 2 plain steps measured at the start of a call; lookup: 1, then others
    # where they pay)
    for draft, n_plain in ((("-md", smol), 2), (("--draft-lookup",), 1), (("-md", smol, "--draft-lookup"), 2)):
        r = sharpi(*args, *draft, env={"SHARPI_SPEC_COST": "1"})
        assert r.returncode == 0, r.stderr
        spec = json.loads(r.stdout)
        assert spec["tokens"] == plain["tokens"]
        assert spec["speculative"]["plain_by_cost"] >= n_plain and isinstance(spec["speculative"]["cost_off"], bool)
    r = sharpi(*args[:-1], "-md", smol, env={"SHARPI_SPEC_COST": "1"})
    assert r.returncode == 0 and "plain steps chosen by cost" in r.stderr


def test_self_draft_accepts_everything_and_p_min_warns(smol):
    r = sharpi("-m", smol, "-md", smol, "-p", "Once upon a time", "-n", 16, "--temp", 0, "--json",
               "--spec-draft-n-max", 3, "--no-draft-lookup")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["speculative"]
    assert s["drafted"] > 0 and s["accepted"] == s["drafted"]
    # the draft's output layer cut to 300 ids: still exactly the greedy text, fewer acceptances
    plain = json.loads(sharpi("-m", smol, "-p", "Once upon a time", "-n", 16, "--temp", 0, "--json").stdout)
    r = sharpi("-m", smol, "-md", smol, "-p", "Once upon a time", "-n", 16, "--temp", 0, "--json",
               "--spec-draft-n-max", 3, "--spec-draft-vocab", 300, "--no-draft-lookup")
    assert r.returncode == 0, r.stderr
    cut = json.loads(r.stdout)
    assert cut["tokens"] == plain["tokens"] and cut["speculative"]["accepted"] < cut["speculative"]["drafted"]
    r = sharpi("-m", smol, "-md", smol, "-p", "Hi", "-n", 4, "--spec-draft-p-min", "0.5", "--json")
    assert r.returncode == 0 and "no longer an exact sample" in r.stderr
    r = sharpi("-m", smol, "-md", smol, "-p", "Hi", "-n", 4, "--spec-draft-p-min", "0.5", "--json", "--temp", 0)
    assert r.returncode == 0 and "no longer an exact sample" not in r.stderr  # (greedy: the same tokens either way)


def test_synthetic_acceptance_for_benchmarks(smol):
    """--spec-synth-len / --spec-synth-rates (llama.cpp's, benchmarking): proposals accepted at random with the given
    chances instead of being verified, the target's token after them. A self-draft cut to 300 ids proposes wrong
    tokens: at rates 1, 1, 0 exactly the first two of each step are taken; at length 1 none, which leaves the plain
    output, greedy and sampled alike (the same draws in the same order)."""
    args = ("-m", smol, "-md", smol, "--spec-draft-vocab", 300, "-p", "Once upon a time", "-n", 24, "--spec-draft-n-max", 3)
    r = sharpi(*args, "--temp", 0, "--spec-synth-rates", "1,1,0", "--json")
    assert r.returncode == 0 and "generated output is not valid" in r.stderr, r.stderr
    assert "synthetic acceptance: n_max = 3, mean length = 3.000000, rates = [1, 1, 0]" in r.stderr
    s = json.loads(r.stdout)["speculative"]
    assert s["per_position_acceptance"] == [1.0, 1.0, 0.0] and s["per_position_drafted"][0] > 3, s
    for temp in (0, 0.8):
        plain = sharpi("-m", smol, "-p", "Once upon a time", "-n", 24, "--temp", temp, "-s", 5)
        r = sharpi(*args, "--temp", temp, "-s", 5, "--spec-synth-len", 1, "--json")
        d = json.loads(r.stdout)
        assert d["speculative"]["drafted"] > 0 and d["speculative"]["accepted"] == 0 and plain.stdout.rstrip("\n").endswith(d["text"])
    r = sharpi(*args, "--temp", 0, "--spec-synth-len", 4, "--json", env={"SHARPI_SPEC_COST": "0"})
    s = json.loads(r.stdout)["speculative"]
    assert s["accepted"] == s["drafted"] > 0 and s["tokens_per_pass"] > 3.5, s
    for extra, msg in ((("--spec-synth-len", 2, "--spec-synth-rates", "1,1,1"), "mutually exclusive"),
                       (("--spec-synth-rates", "1,0.5"), "must contain 3 values"),
                       (("--spec-synth-rates", "0.5,1,1"), "monotonically non-increasing"),
                       (("--spec-synth-rates", "1,1,x"), "invalid --spec-synth-rates"),
                       (("--spec-synth-len", 4.5), "within [1, 4]"),
                       (("--spec-synth-len", 2, "-j", "{}"), "not with a grammar")):
        one_error_line(sharpi(*args, *extra), 2, msg)
    one_error_line(sharpi("-m", smol, "-p", "Hi", "--spec-synth-len", 2), 2, "requires at least one speculative token")


def test_speculation_counts_stop_where_the_output_stops(smol):
    """A self-draft accepts everything, also past an end of generation, a stop string or a finished grammar: the
    counts take the pass as far as the output went (they said 32 accepted, 33 tokens a pass for 17 tokens)."""
    args = ("-m", smol, "-md", smol, "--temp", 0, "--spec-draft-n-max", 32, "--json")
    env = {"SHARPI_SPEC_COST": "0", "SHARPI_SPEC_ADAPTIVE": "0"}
    for extra in (("-st", "-p", "Reply with just the word OK.", "-n", 64),
                  ("-p", "List of fruits: apple, banana,", "-n", 40, "-r", " grape"),
                  ("-p", "Is the sky blue? Answer:", "-n", 30, "--grammar", 'root ::= " yes, it is blue." | " no"')):
        r = sharpi(*args, *extra, env=env)
        d = json.loads(r.stdout)
        s, n = d["speculative"], len(d["tokens"]) + (d["stop_reason"] == "eos")  # (the end token came from a pass)
        assert d["stop_reason"] in ("eos", "stop_string") and s["accepted"] == s["drafted"] > 0, (extra, d)
        # the first token comes from the prompt's pass; each pass after it gives its accepted drafts and one more,
        # but the one the output stopped at
        assert s["accepted"] + s["target_passes"] - 1 == n - 1, (extra, s, n)
        assert s["tokens_per_pass"] * s["target_passes"] == pytest.approx(n - 1), (extra, s, n)
        assert len(s["per_position_drafted"]) == max(s["per_position_drafted"] and [s["drafted"]]), s


def test_draft_cache_types(smol):
    # the draft keeps its cache in -ctkd / -ctvd (else the target's -ctk / -ctv); the output stays
    # the target's greedy text whatever the draft's cache holds
    args = ("-m", smol, "-p", "Once upon a time", "-n", 16, "--temp", 0, "--json", "-v")
    plain = json.loads(sharpi(*args, "-ctk", "q8_0").stdout)
    r = sharpi(*args, "-md", smol, "-ctk", "q8_0", "-ctkd", "f32", "-ctvd", "q8_0")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == plain["tokens"]
    lines = [ln for ln in r.stderr.splitlines() if "KV cache" in ln]
    assert lines[0].startswith("sharpi: model ") and "KV cache K q8_0 V f16" in lines[0]
    # (an f32 cache is held in f16 under flash attention, llama.cpp's default: it casts f32 to f16 to attend)
    assert lines[1].startswith("sharpi: draft ") and "KV cache K f16 V q8_0" in lines[1]
    r = sharpi(*args, "-md", smol, "-fa", "off", "-ctkd", "f32")
    assert "KV cache K f32 V f16" in [ln for ln in r.stderr.splitlines() if ln.startswith("sharpi: draft ")][0]
    r = sharpi(*args, "-md", smol, "-ctv", "q8_0")
    assert "KV cache K f16 V q8_0" in [ln for ln in r.stderr.splitlines() if ln.startswith("sharpi: draft ")][0]


@pytest.mark.parametrize("flags,named", [
    ({"cache_type_k": "f32"}, "-ctk f32"),                                         # the target's, on the GPU
    ({"cache_type_v": "f32", "n_gpu_layers": 0}, "-ctv f32"),                     # the draft's, taken from -ctv
    ({"cache_type_k": "q8_0", "cache_type_k_draft": "f32"}, "-ctkd f32"),          # the draft's own
    ({"cache_type_v_draft": "f32", "n_gpu_layers": 0}, "-ctvd f32"),
    ({"cache_type_v": "q4_0"}, "-ctv q4_0"),                                       # the CPU's other types
    ({"cache_type_k_draft": "bf16", "n_gpu_layers": 0}, "-ctkd bf16"),
    ({"cache_type_k": "f32", "n_gpu_layers": 0, "spec_draft_ngl": 0}, None),      # both on the CPU: any type
    ({"cache_type_k_draft": "f32", "spec_draft_ngl": 0}, None),
])
def test_gpu_cache_types_are_refused_under_their_flag(flags, named):
    # the GPU keeps f16 / q8_0 caches; a type it refuses is named by the flag it came from, before loading
    from sharpi_cli import options, validate
    from sharpi_core.errors import UsageError
    o = options.RunOptions(model_draft="draft.gguf", device="cuda", **flags)
    if named is None:
        validate.check_gpu_cache_types(o)
        return
    with pytest.raises(UsageError) as e:
        validate.check_gpu_cache_types(o)
    assert str(e.value).startswith(named + ":")


def test_spec_sample_switch_note(smol):
    r = sharpi("-m", smol, "-p", "Hi", "-n", 4, "--temp", 0.7, "--draft-lookup", "--json",
               env={"SHARPI_SPEC_SAMPLE": "0"})
    assert r.returncode == 0 and "SHARPI_SPEC_SAMPLE=0" in r.stderr and "speculative" not in json.loads(r.stdout)
    r = sharpi("-m", smol, "-cnv", "-n", 4, "--temp", 0.7, "--draft-lookup", input="Hi\n",
               env={"SHARPI_SPEC_SAMPLE": "0"})  # (the chat says it too)
    assert r.returncode == 0 and r.stderr.count("note: SHARPI_SPEC_SAMPLE=0") == 1


@pytest.mark.slow
def test_mismatched_draft_vocab_is_one_error(smol):
    from conftest import GEMMA
    r = sharpi("-m", smol, "-md", model_path(GEMMA), "-p", "hi")
    one_error_line(r, 2, "draft")


@pytest.mark.parametrize("args,fragment", [
    (dict(samplers="top_k;bogus"), "unknown sampler 'bogus'"),
    (dict(samplers="top_k;Top-K"), "top_k is given twice"),
    (dict(samplers="top_k;dry"), "dry must come before the other samplers"),
    (dict(sampling_seq="kq"), "--sampling-seq 'kq': unknown letter 'q'"),
    (dict(samplers="top_k", sampling_seq="k"), "mutually exclusive"),
    (dict(typical_p=float("nan")), "--typical"),
    (dict(xtc_probability=float("inf")), "--xtc-probability"),
    (dict(dynatemp_exponent=1e39), "--dynatemp-exp"),
    (dict(adaptive_target=float("nan")), "--adaptive-target"),
    (dict(samplers="top_k;adaptive_p;Adaptive-P"), "adaptive_p is given twice"),
])
def test_sampler_flags_are_checked(args, fragment):
    from sharpi_cli.options import RunOptions
    from sharpi_cli.validate import validate
    from sharpi_core.errors import UsageError
    with pytest.raises(UsageError, match=re.escape(fragment)):
        validate(RunOptions(**args))


def test_sampler_order_takes_llama_cpps_names_and_letters():
    from sharpi_cli.options import RunOptions
    from sharpi_cli.validate import validate
    o = RunOptions(samplers="Penalties; DRY;top-k;nucleus;typ;TEMP;xtc;minp;top_n_sigma")
    validate(o)
    assert o.samplers == ("penalties", "dry", "top_k", "top_p", "typ_p", "temperature", "xtc", "min_p", "top_n_sigma")
    for name in ("Typ-P", "typp"):  # (llama.cpp's other names of typ_p: kebab-case, dash-less)
        o = RunOptions(samplers=f"top_k;{name};temperature")
        validate(o)
        assert o.samplers == ("top_k", "typ_p", "temperature")
    for name in ("typical", "typical-p"):  # (the flags' names, no sampler's in llama.cpp: it matches no name)
        with pytest.raises(Exception, match="typical"):
            validate(RunOptions(samplers=f"top_k;{name};temperature"))
    o = RunOptions(sampling_seq="edskypmxt")
    validate(o)
    assert o.samplers == ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
    for o in (RunOptions(samplers="top_k;Infill;temperature"), RunOptions(sampling_seq="kit")):
        validate(o)
        assert o.samplers == ("top_k", "infill", "temperature")
    # adaptive-p may be named anywhere (it draws last, as llama.cpp's), so penalties may follow it
    o = RunOptions(samplers="adaptive-p;penalties;min_p;temperature", adaptive_target=0.4)
    validate(o)
    assert o.samplers == ("adaptive_p", "penalties", "min_p", "temperature")


def test_adaptive_p_flags_say_when_they_do_nothing(capsys):
    from sharpi_cli.options import RunOptions
    from sharpi_cli.validate import validate
    from sharpi_core.sampling import SamplingParams, describe_chain
    validate(RunOptions(adaptive_target=0.5))
    assert "--adaptive-target does nothing unless --samplers" in capsys.readouterr().err
    validate(RunOptions(sampling_seq="kmta"))
    assert "adaptive_p draws as dist with a negative --adaptive-target" in capsys.readouterr().err
    validate(RunOptions(sampling_seq="kmta", adaptive_target=0.5))
    assert capsys.readouterr().err == ""
    validate(RunOptions(sampling_seq="kta", adaptive_target=0.5, mirostat=2))
    assert "adaptive_p not used with --mirostat" in capsys.readouterr().err
    validate(RunOptions(adaptive_decay=0.5))
    assert "--adaptive-decay does nothing unless" in capsys.readouterr().err
    validate(RunOptions(sampling_seq="kta", adaptive_target=0.5, adaptive_decay=5))
    assert "--adaptive-decay 5 is taken as 0.99" in capsys.readouterr().err
    validate(RunOptions(sampling_seq="kta", adaptive_target=-1e-50))  # float32 -0.0: on, as SamplingParams reads it
    assert capsys.readouterr().err == ""
    assert SamplingParams(samplers=("adaptive_p",), adaptive_target=-1e-50).adaptive_on
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a huge target overflows to inf as in C, silently (it then aims at 0)
        from sharpi_core.sampling import AdaptiveP
        a = AdaptiveP(3e38, 0.99)
        assert a.aim(a.after(a.state, 0.5)) == 0
    p = SamplingParams(samplers=("min_p", "adaptive_p", "temperature"), adaptive_target=0.5)
    assert describe_chain(p) == "logits -> min-p -> temperature -> adaptive-p"
    assert describe_chain(SamplingParams(samplers=p.samplers)) == "logits -> min-p -> temperature -> dist"


# llama-completion -m SmolLM2 -p PROMPT --samplers "top_k;infill;temperature" --temp 0 -n 40 -no-cnv (the fixtures'
# llama.cpp, 2026-12-07): the text each run generated, ended by the end token infill leaves (temperature 0 then keeps
# the best of what infill leaves, which is not greedy decoding's arg-max: plain greedy goes on for 40 tokens in each)
INFILL_TEXTS = {"The capital of France is": " Paris.", "def fib(n):": "\n   "}


@pytest.mark.parametrize("prompt", list(INFILL_TEXTS))
def test_infill_sampler_ends_where_llama_completion_does(smol, prompt):
    """The infill stage (--samplers ...;infill;...) at temperature 0: llama-completion's text, ended by an
    end-of-generation token, with and without speculation."""
    base = ("-m", smol, "-p", prompt, "-n", "40", "--temp", "0", "--samplers", "top_k;infill;temperature", "--json")
    for extra in ((), ("--draft-lookup",), ("-md", smol, "--spec-draft-n-max", "3")):
        r = sharpi(*base, *extra)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert (out["text"], out["stop_reason"]) == (INFILL_TEXTS[prompt], "eos"), extra
    plain = json.loads(sharpi(*base[:-3], "--json").stdout)
    assert plain["stop_reason"] == "n_predict"


def test_dry_and_the_other_samplers_through_the_cli(smol):
    """DRY changes greedy output on a repetitive prompt, and speculation keeps it token for token;
    llama.cpp's sampler names and letters are taken; sampled speculation runs with every sampler on."""
    base = ("-m", smol, "-p", "one two three one two three one two three one two", "-n", "24", "--temp", "0",
            "--ignore-eos", "--json")
    plain = json.loads(sharpi(*base).stdout)["tokens"]
    dry = ("--dry-multiplier", "1.5", "--dry-allowed-length", "1", "--dry-sequence-breaker", "none")
    r = sharpi(*base, *dry)
    assert r.returncode == 0, r.stderr
    with_dry = json.loads(r.stdout)["tokens"]
    assert with_dry != plain
    assert json.loads(sharpi(*base, *dry, "--draft-lookup").stdout)["tokens"] == with_dry
    r = sharpi("-m", smol, "-p", "The cat sat on the mat. The cat", "-n", "16", "--temp", "0.9", "-s", "7",
               "--samplers", "Penalties;DRY;top-k;nucleus;typ;TEMP;xtc;adaptive_p", "--adaptive-target", "0.4",
               "--typical", "0.95", "--xtc-probability", "0.5",
               "--dry-multiplier", "0.5", "--dynatemp-range", "0.3", "--draft-lookup", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 16


def test_mirostat_says_which_flags_it_does_not_use(capsys):
    from sharpi_cli.options import RunOptions
    from sharpi_cli.validate import validate
    validate(RunOptions(mirostat=2, repeat_penalty=1.2, dry_multiplier=0.5, min_keep=3))
    assert "--repeat-penalty, --dry-multiplier, --min-keep not used with --mirostat" in capsys.readouterr().err
    validate(RunOptions(mirostat=2))
    assert "not used" not in capsys.readouterr().err
    # top-k / top-p / min-p are on by default: named only when given (their defaults said nothing)
    validate(RunOptions(mirostat=1, top_k=1, sampling_given=frozenset({"top_k", "mirostat"})))
    assert "warning: --top-k not used with --mirostat" in capsys.readouterr().err


def test_json_schema_output_is_llama_cpps_with_speculation(smol):
    case = next(c for c in json.loads((Path(__file__).parent / "data" / "llamacpp_grammar.json").read_text())
                if c["model"] == SMOL and c["schema"] is not None and c["eos"])
    r = sharpi("-m", smol, "-p", case["prompt"], "-n", case["n"], "--temp", "0", "-j", json.dumps(case["schema"]),
               "--draft-lookup", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["text"].encode().hex() == case["output_hex"] and d["stop_reason"] == "eos"
    json.loads(d["text"])  # the schema's output is JSON


def test_special_shows_control_tokens_in_the_echo_and_the_output(smol):
    """-sp as llama-completion: the prompt is echoed from its tokens, control tokens only with -sp (so a
    chat-formatted prompt echoes without them by default), and the end of generation prints its text."""
    p = "<|im_start|>user\nWhat is 2+2? Answer with a number.<|im_end|>\n<|im_start|>assistant\n"
    plain = sharpi("-m", smol, "-p", p, "-n", 40, "--temp", 0)
    sp = sharpi("-m", smol, "-p", p, "-n", 40, "--temp", 0, "-sp")
    assert plain.returncode == sp.returncode == 0, (plain.stderr, sp.stderr)
    echo = "user\nWhat is 2+2? Answer with a number.\nassistant\n"
    assert plain.stdout.startswith(echo) and sp.stdout.startswith(p)
    reply = plain.stdout[len(echo):]
    assert reply.strip() and ">" not in reply
    assert sp.stdout[len(p):] == reply.rstrip("\n") + "<|im_end|>\n"
    d = json.loads(sharpi("-m", smol, "-p", p, "-n", 40, "--temp", 0, "-sp", "--json").stdout)
    assert d["stop_reason"] == "eos" and d["text"].endswith("<|im_end|>") and len(d["tokens"]) < 40


def test_verbose_prompt_lists_the_prompt_tokens(smol):
    r = sharpi("-m", smol, "-p", "Hello world", "-n", 1, "--temp", 0, "--verbose-prompt", "-r", "stop here",
               "--context-shift", "--keep", 1)
    assert r.returncode == 0, r.stderr
    ids = [int(t) for t in sharpi("tokenize", "-m", smol, "-p", "Hello world", "--ids").stdout.strip(" []\n").split(",")]
    lines = r.stderr.splitlines()
    i = lines.index("sharpi: number of tokens in prompt = 2")
    assert [int(ln.split(" -> ")[0]) for ln in lines[i + 1:i + 3]] == ids
    assert lines[i + 1].endswith("-> 'Hello'") and lines[i + 2].endswith("-> ' world'")
    assert "sharpi: static prompt based on n_keep: 'Hello'" in lines and "Reverse prompt: 'stop here'" in lines


# llama-completion -m SmolLM2 -p "The capital of France is" -n 8 --temp 0 -no-cnv
#   --override-kv tokenizer.ggml.add_bos_token=bool:true (the fixtures' build): a BOS first, then this text
OVERRIDE_BOS_TEXT = "The capital of France is Paris.\n\nThe French language is"


def test_override_kv(smol):
    """--override-kv reaches what the model and tokenizer read: a BOS (SmolLM2's file says none) gives
    llama.cpp's continuation with the same override; a wrong type or a malformed item is one error line."""
    r = sharpi("-m", smol, "-p", "The capital of France is", "-n", "8", "--temp", "0", "--verbose-prompt",
               "--override-kv", "tokenizer.ggml.add_bos_token=bool:true")
    assert r.returncode == 0, r.stderr
    assert r.stdout == OVERRIDE_BOS_TEXT + "\n"
    assert re.search(r"^\s*1 -> '<\|im_start\|>'$", r.stderr, re.M)
    one_error_line(sharpi("-m", smol, "-p", "x", "--override-kv", "llama.context_length=str:x"), contains="has it as int, not str")
    one_error_line(sharpi("-m", smol, "-p", "x", "--override-kv", "llama.context_length"), contains="malformed --override-kv")


def test_log_disable_perf_and_display_prompt(smol):
    """llama-cli's --log-disable (nothing on stderr but errors), --no-perf (no timings at the end) and the
    --display-prompt / --no-display-prompt pair."""
    base = ["-m", smol, "-p", "The capital of France is", "-n", "4", "--temp", "0", "--reasoning-budget", "4"]  # (a warning)
    plain = sharpi(*base)
    assert plain.returncode == 0 and "eval time" in plain.stderr and "warning" in plain.stderr
    quiet = sharpi(*base, "--log-disable")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == plain.stdout
    noperf = sharpi(*base, "--no-perf")
    assert "eval time" not in noperf.stderr and "warning" in noperf.stderr and noperf.stdout == plain.stdout
    assert "eval time" in sharpi(*base, "--no-perf", "--perf").stderr
    shown = sharpi(*base, "--no-display-prompt", "--display-prompt").stdout
    hidden = sharpi(*base, "--no-display-prompt").stdout
    assert shown == plain.stdout and shown.startswith("The capital of France is") and shown.endswith(hidden)
    bad = sharpi("-m", smol, "-p", "Hi", "--log-disable", "-n", "-7")
    assert bad.returncode == 2 and bad.stderr.startswith("error: invalid -n")  # (errors still)
    assert "eval time" in sharpi(*base).stderr  # (the next run logs again)


def test_threads_batch_evaluates_the_prompt_with_its_threads(smol):
    import torch

    from sharpi_core.generate import Generator
    from sharpi_core.sampling import SamplingParams
    model, tok = loaded(SMOL)
    seen = []
    forward = model.forward

    def spy(tokens, *a, **kw):
        seen.append((len(tokens), torch.get_num_threads()))
        return forward(tokens, *a, **kw)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model.forward = spy
        g = Generator(model, model.new_cache(64), tok, SamplingParams(temp=0), batch_threads=1, n_batch=8)
        res = g.generate(tok.encode("The quick brown fox jumps over the lazy dog and then"), n_predict=3)
    finally:
        del model.forward
        torch.set_num_threads(before)
    assert [n for n, t in seen if n > 1] and all(t == 1 for n, t in seen if n > 1)  # the prompt's batches
    assert all(t == 2 for n, t in seen if n == 1) and len(res.tokens) == 3  # decoding: -t's
    r = sharpi("-m", smol, "-p", "Hi", "-n", "1", "-tb", "9999")
    assert r.returncode == 2 and "invalid -tb/--threads-batch 9999" in r.stderr
    a = sharpi("-m", smol, "-p", "The capital of France is", "-n", "6", "--temp", "0", "-tb", "1", "--json")
    b = sharpi("-m", smol, "-p", "The capital of France is", "-n", "6", "--temp", "0", "--json")
    assert json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]


def test_draft_threads_run_the_draft_s_passes(smol):
    """-td / -tbd: the draft model's passes of one token / of more run with their threads, the target's with
    its own; the tokens stay the plain ones (threads never change a result)."""
    import torch

    from sharpi_core.generate import Generator
    from sharpi_core.sampling import SamplingParams
    from sharpi_core.speculative import DraftModelDrafter
    model, tok = loaded(SMOL)
    draft = loaded(SMOL)[0]  # (the same model as its own draft: every proposal accepted)
    seen = []

    class Spy:  # the draft, recording the threads of each pass
        def __getattr__(self, name):
            return getattr(draft, name)

        def forward(self, tokens, *a, **kw):
            seen.append((len(tokens), torch.get_num_threads()))
            return draft.forward(tokens, *a, **kw)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = SamplingParams(temp=0)
        prompt = tok.encode("The quick brown fox jumps over the lazy dog and then")
        drafter = DraftModelDrafter(Spy(), draft.new_cache(64), params, threads=(1, 2))
        g = Generator(model, model.new_cache(64), tok, params, drafter=drafter, spec_n_max=3)
        res = g.generate(prompt, n_predict=8)
        plain = Generator(model, model.new_cache(64), tok, params).generate(prompt, n_predict=8)
        assert torch.get_num_threads() == 2  # put back after each draft pass
    finally:
        torch.set_num_threads(before)
    assert res.tokens == plain.tokens
    assert [t for n, t in seen if n == 1] and all(t == 1 for n, t in seen if n == 1)
    assert [t for n, t in seen if n > 1] and all(t == 2 for n, t in seen if n > 1)
    for flag in ("-td", "-tbd"):
        r = sharpi("-m", smol, "-p", "Hi", "-n", "1", flag, "9999")
        assert r.returncode == 2 and f"invalid {flag}/" in r.stderr


def test_prompt_passes_are_min_of_batch_and_ubatch(smol, monkeypatch):
    # llama.cpp runs a logical batch (-b) in passes of at most -ub tokens (batched rows' arithmetic depends on
    # the pass): the generator's prompt passes are min(-b, -ub) tokens; --no-warmup is accepted as llama-cli's
    from sharpi_cli import main as cli
    from sharpi_core import generate
    seen = []
    real = generate.Generator.__init__

    def spy(self, *a, **kw):
        seen.append(kw["n_batch"])
        real(self, *a, **kw)
    monkeypatch.setattr(generate.Generator, "__init__", spy)
    for args, want in ((("-b", "2048", "-ub", "8", "--no-warmup"), 8), (("-b", "6"), 6), ((), 512)):
        with pytest.raises(SystemExit) as e:
            cli.app(["-m", str(smol), "-p", "Hi", "-n", "1", "--temp", "0", *args], standalone_mode=True)
        assert e.value.code == 0 and seen[-1] == want, args


def test_mlock_locks_the_process_memory(smol):
    # in a process of its own (locking the test process's memory would lock every model it holds)
    code = ("from sharpi_cli.runner import lock_memory\nwhy = lock_memory()\n"
            "print(why if why else [l for l in open('/proc/self/status') if l.startswith('VmLck')][0])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip()
    if r.stdout.startswith("VmLck"):
        assert int(r.stdout.split()[1]) > 0  # kB locked
    run = sharpi("-m", smol, "-p", "Hi", "-n", "2", "--temp", "0", "--mlock", process=True)
    assert run.returncode == 0 and "Traceback" not in run.stderr


def test_no_mmap_reads_the_file_into_memory(smol):
    from sharpi_core.gguf_file import GGUFFile
    from sharpi_core.quants import _is_file_view
    mapped, read = GGUFFile(smol), GGUFFile(smol, mmap=False)
    assert all(_is_file_view(t.data) for t in mapped.tensors.values())
    assert not any(_is_file_view(t.data) for t in read.tensors.values()) and not _is_file_view(read.reader.data)
    for name, t in mapped.tensors.items():
        u = read.tensors[name]
        assert u.data.dtype == t.data.dtype and u.data.shape == t.data.shape and np.array_equal(u.data, t.data)
    args = ["-m", smol, "-p", "The capital of France is", "-n", "8", "--temp", "0", "--json"]
    a, b = sharpi(*args), sharpi(*args, "--no-mmap")
    assert b.returncode == 0 and json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]


def test_negative_top_k_is_off_as_in_llama_cpp(smol):
    """llama.cpp's top-k sampler does nothing for k <= 0: `--top-k -1` samples as `--top-k 0`."""
    base = ("-m", smol, "-p", "Once upon a time", "-n", "24", "--temp", "1.5", "-s", "7", "--json")
    off, neg, k1 = (json.loads(sharpi(*base, "--top-k", k).stdout)["tokens"] for k in ("0", "-1", "1"))
    assert neg == off and off != k1


def test_no_repack_keeps_the_bits(smol):
    """--no-repack (-nr, llama.cpp's): Q4_1 / Q4_K weights kept in their GGUF blocks, the same tokens."""
    import os
    base = ("-m", smol, "-p", "The capital of France is", "-n", "16", "--temp", "0", "--json")
    default = json.loads(sharpi(*base).stdout)["tokens"]
    assert json.loads(sharpi(*base, "-nr").stdout)["tokens"] == default
    assert json.loads(sharpi(*base, "--no-repack").stdout)["tokens"] == default
    assert "SHARPI_CPU_REPACK" not in os.environ  # (the switch is the run's only)


def test_glob_is_llama_cpps():
    from sharpi_cli.chat import glob_match
    cases = [("*.py", "a.py", True), ("*.py", "d/a.py", False), ("**.py", "d/e/a.py", True), ("**/a.py", "d/a.py", True),
             ("d/*", "d/x", True), ("d/*", "d/e/x", False), ("a?c", "abc", True), ("a?c", "a/c", False),
             ("[a-c]x", "bx", True), ("[!a-c]x", "bx", False), ("[!a-c]x", "dx", True), ("[]]x", "]x", True),
             ("[-a]x", "-x", True), ("[ab", "[ab", True), ("*", "", True), ("", "a", False), ("**", "a/b/c", True)]
    for pattern, name, want in cases:
        assert glob_match(pattern.encode(), name.encode()) is want, (pattern, name)
    # /glob matches through glob_regex (one regular expression, not a recursion per path): the same language
    import random
    from sharpi_cli.chat import glob_regex
    rng = random.Random(3)
    for _ in range(30000):
        pattern = bytes(rng.choice(b"ab/-]![*?c") for _ in range(rng.randint(0, 7)))
        name = bytes(rng.choice(b"ab/-]![c") for _ in range(rng.randint(0, 6)))
        assert (glob_regex(pattern).fullmatch(name) is not None) is glob_match(pattern, name), (pattern, name)


def test_chat_glob_and_transcript(smol, tmp_path, monkeypatch):
    """/glob PATTERN adds the text files it matches (under the folder it names), and -o writes the conversation as
    llama-cli's transcript: User / Assistant turns, the files added (each file's text as it is: llama-cli glues what
    follows to a text without a final newline, where sharpi had added one); -st -p too."""
    d = tmp_path / "notes"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("alpha\n")
    (d / "sub" / "b.txt").write_text("beta")
    (d / "c.md").write_text("gamma\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "chat.txt"
    turns = ["/glob notes/**.txt", "Which words?", "/regen", "/glob nothing*", "word " * 400, "/exit"]
    r = sharpi("-m", smol, "-cnv", "--temp", 0, "-n", 6, "-c", 256, "-o", out, input="\n".join(turns) + "\n")
    assert r.returncode == 0, r.stderr
    assert "error: /glob: no file matches 'nothing*'" in r.stderr
    assert "which does not fit the context of 256: not sent" in r.stderr  # (and not in the transcript)
    replies = chat_replies(r.stdout)
    assert len(replies) == 2 and replies[0].strip(), r.stdout
    a, b = f"{tmp_path}/notes/a.txt", f"{tmp_path}/notes/sub/b.txt"  # (named as llama-cli names them)
    assert out.read_text() == (f"User: Added text file: {a}\nUser: Added text file: {b}\n"
                               f"User:\n--- File: {a} ---\nalpha\n--- File: {b} ---\nbetaWhich words?\n\n"
                               + "".join(f"Assistant:\n{t}" + ("" if t.endswith("\n") else "\n") + "\n" for t in replies))
    r = sharpi("-m", smol, "-st", "-p", "Say hi.", "--temp", 0, "-n", 6, "-o", out)
    assert r.returncode == 0 and out.read_text() == f"User:\nSay hi.\n\nAssistant:\n{r.stdout.strip()}\n\n"
    # a file whose name is not UTF-8 is named in the transcript as the chat shows it (a traceback there before)
    (d / "\udcfe.txt").write_text("delta\n")
    r = sharpi("-m", smol, "-cnv", "--temp", 0, "-n", 2, "-o", out, input="/glob notes/*.txt\nWhich?\n")
    assert r.returncode == 0 and f"[{tmp_path}/notes/\udcfe.txt: 6 characters" in r.stderr, r.stderr
    assert f"User: Added text file: {tmp_path}/notes/\\udcfe.txt\n" in out.read_text()
    one_error_line(sharpi("-m", smol, "-st", "-p", "hi", "-o", tmp_path / "no" / "x.txt"), 2, "cannot be written")
    r = sharpi("-m", smol, "-p", "hi", "-n", 2, "-o", tmp_path / "raw.txt")  # (one-shot raw text: no chat)
    assert r.returncode == 0 and "this run is not a chat, nothing written" in r.stderr
    assert not (tmp_path / "raw.txt").exists()


def test_an_empty_prompt_in_a_chat_is_no_message_and_json_needs_one_given(smol):
    """llama.cpp's chats take an empty -p as no prompt (the first message is read; an empty one is never sent);
    --json's one reply needs its message given (-p, -f, stdin: -cnv -st --json reads it there), never typed."""
    plain = sharpi("-m", smol, "-cnv", "--temp", 0, "-n", 8, input="Hi\n")
    empty = sharpi("-m", smol, "-cnv", "-p", "", "--temp", 0, "-n", 8, input="Hi\n")
    assert plain.returncode == empty.returncode == 0 and empty.stdout == plain.stdout, (plain.stdout, empty.stdout)
    for args in (["-st", "-p", ""], ["-sys", "Be terse.", "-p", ""]):
        r = sharpi("-m", smol, *args, "--temp", 0, "-n", 8)
        assert r.returncode == 0 and r.stdout.strip(" >\n") == "", (args, r.stdout)
    one_error_line(sharpi("-m", smol, "-st", "--json", "-n", 8), 2, "--json prints the reply to one message given")
    r = sharpi("-m", smol, "-cnv", "-st", "--json", "--temp", 0, "-n", 8, input="Hi\n")
    want = sharpi("-m", smol, "-st", "-p", "Hi", "--json", "--temp", 0, "-n", 8)
    assert r.returncode == 0 and json.loads(r.stdout)["tokens"] == json.loads(want.stdout)["tokens"], r.stdout


def test_a_long_first_message_is_shown_cut_at_500_bytes(smol):
    """-cnv shows its -p message after "> " as llama-cli echoes it: past 500 bytes (not characters) cut there (at
    the character boundary before) with " ... (truncated)"."""
    for text, shown in (("é" * 250, "é" * 250), ("é" * 251, "é" * 250 + " ... (truncated)"),
                        ("a" + "é" * 250, "a" + "é" * 249 + " ... (truncated)")):
        r = sharpi("-m", smol, "-cnv", "-p", text, "-n", 1, "--temp", 0, "--no-show-timings", input="")
        assert r.returncode == 0 and r.stdout.startswith(f"> {shown}\n"), r.stdout[:60]


def test_a_chats_first_message_given_with_p_may_be_a_command(smol, tmp_path):
    """llama-cli reads -cnv's -p as a typed line, commands too: -p "/read FILE" adds the file to the first typed
    message, -p "/exit" ends the chat before any reply (sharpi sent them to the model as messages)."""
    f = tmp_path / "notes.txt"
    f.write_text("The code word is PINEAPPLE.\n")
    out = tmp_path / "chat.txt"
    r = sharpi("-m", smol, "-cnv", "-p", f"/read {f}", "--temp", 0, "-n", 4, "-o", out, input="The word?\n")
    assert r.returncode == 0 and f"[{f}: " in r.stderr, r.stderr
    assert out.read_text().startswith(f"User: Added text file: {f}\nUser:\n--- File: {f} ---\n"
                                      "The code word is PINEAPPLE.\nThe word?\n\nAssistant:\n")
    r = sharpi("-m", smol, "-cnv", "-p", "/exit", "--temp", 0, "-n", 4, "-o", out, input="Hi\n")
    assert r.returncode == 0 and r.stdout == "> /exit\n" and out.read_text() == "", (r.stdout, r.stderr)
    # -st too: the command, then the one message is read
    r = sharpi("-m", smol, "-st", "-p", f"/read {f}", "--temp", 0, "-n", 4, "-o", out, input="The word?\n")
    assert r.returncode == 0 and out.read_text().startswith(f"User: Added text file: {f}\nUser:\n--- File: {f} ---\n"
                                                            "The code word is PINEAPPLE.\nThe word?\n\nAssistant:\n")
    r = sharpi("-m", smol, "-st", "-p", "/exit", "--temp", 0, "-n", 4, "-o", out, input="Hi\n")
    assert r.returncode == 0 and r.stdout.strip() == "" and out.read_text() == "", (r.stdout, r.stderr)


def test_glob_names_files_as_llama_cli_does(tmp_path, monkeypatch):
    """llama-cli names a /glob file in the message by `current_path() / folder / relative path` (std::filesystem:
    absolute, the folder as typed, a leading ~ as $HOME, an absolute folder in place of the current one; in the
    vendored llama.cpp of the fixtures and in later ones alike): sharpi had named them by the folder as typed."""
    from sharpi_cli.chat import glob_files
    (tmp_path / "notes" / "sub").mkdir(parents=True)
    for f in ("top.txt", "notes/a.txt", "notes/sub/b.txt", "notes/c.md"):
        (tmp_path / f).write_text("x")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "notes"))
    t = str(tmp_path)
    assert glob_files("notes/**.txt") == [f"{t}/notes/a.txt", f"{t}/notes/sub/b.txt"]
    assert glob_files("**.md") == [f"{t}/notes/c.md"] and glob_files("*.txt") == [f"{t}/top.txt"]
    assert glob_files("./notes/sub/*") == [f"{t}/./notes/sub/b.txt"]
    assert glob_files("notes//sub/*") == [f"{t}/notes//sub/b.txt"]
    assert glob_files("~/*.txt") == [f"{t}/notes/a.txt"]
    assert glob_files(f"{t}/notes/*.md") == [f"{t}/notes/c.md"]
    assert glob_files("/*.txt") == [f"{t}/top.txt"]  # (folder "": the current one, as llama-cli's empty path)


def test_chat_commands_say_why_and_add_all_or_nothing(smol, tmp_path, monkeypatch):
    """/glob matching more than 100 files adds none (it added 100, then said "error"); /read says why it cannot read
    a file, takes a quoted name, warns of bytes that are not UTF-8; a template that refuses a later turn refuses that
    message, and the chat goes on (it ended the session)."""
    from sharpi_cli.chat import GLOB_MAX
    monkeypatch.chdir(tmp_path)
    (tmp_path / "many").mkdir()
    for i in range(GLOB_MAX + 1):
        (tmp_path / "many" / f"f{i}.txt").write_text(f"f{i}\n")
    (tmp_path / "a name.txt").write_bytes(b"caf\xe9\n")
    template = ("{% if messages | length > 2 %}{{ raise_exception('one turn only') }}{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "t.jinja").write_text(template)
    turns = ["/glob many/*.txt", "/read many", "/read \"a name.txt\"", "Hi", "Again", "/clear", "Hi"]
    r = sharpi("-m", smol, "-cnv", "--temp", 0, "-n", 2, "--no-show-timings", "-o", tmp_path / "chat.txt",
               "--chat-template-file", tmp_path / "t.jinja", input="\n".join(turns) + "\n")
    assert r.returncode == 0, r.stderr
    assert f"error: /glob: more than {GLOB_MAX} files match 'many/*.txt' (nothing added: narrow it)" in r.stderr
    assert "error: /read: cannot read 'many' (a directory)" in r.stderr
    assert "warning: /read: 'a name.txt' is not all UTF-8 text: 1 byte read as U+FFFD" in r.stderr
    assert "error: the chat template refused the conversation: one turn only: not sent; /clear starts over" in r.stderr
    chat = (tmp_path / "chat.txt").read_text()
    assert "--- File: a name.txt ---\ncaf\ufffd\nHi" in chat and "many/f" not in chat and chat.count("Assistant:") == 2
    assert r.stdout.count("> ") == len(turns) + 1


def test_tokenize_stdin_count_and_raw_pieces(smol):
    """llama-tokenize's --stdin and --show-count; the pieces written as their bytes (a piece that is part of a UTF-8
    character too, as llama-tokenize prints it on Linux)."""
    from conftest import loaded
    text = "Hi 日本語 there"
    ids = loaded(SMOL)[1].encode(text, add_special=True, parse_special=True)
    r = sharpi("tokenize", "-m", smol, "--stdin", "--ids", "--show-count", input=text)
    assert r.returncode == 0 and r.stdout == f"[{', '.join(map(str, ids))}]\nTotal number of tokens: {len(ids)}\n"
    tok = loaded(SMOL)[1]
    assert any(not tok.token_bytes(i).decode("utf-8", "ignore") for i in ids)  # (a character's bytes split)
    r = subprocess.run(SHARPI.split() + ["tokenize", "-m", str(smol), "-p", text], capture_output=True, timeout=300)
    assert r.returncode == 0 and r.stdout == b"".join(b"%6d -> '" % i + tok.token_bytes(i) + b"'\n" for i in ids)
    one_error_line(sharpi("tokenize", "-m", smol), 2, "one of --stdin, -f/--file or -p/--prompt")


def test_unknown_short_options_are_named(smol):
    """A llama.cpp flag sharpi lacks (llama-server's -nocb, -cb, -to) is named as such, not read as short flags run
    together (-n ocb) with a complaint about -n's value; option values that start with a dash are values."""
    for flag in ("-nocb", "-cb", "-to"):
        one_error_line(sharpi("-m", smol, flag, 4, "-p", "hi"), 2, f"No such option: {flag}")
    r = sharpi("-m", smol, "-p", "-dash prompt", "-n", -1, "-n", 2, "--temp", 0, "-l", "15043-inf")
    assert r.returncode == 0, r.stderr
    one_error_line(sharpi("tokenize", "-m", smol, "-np", "-p", "x"), 2, "No such option: -np")


def test_errors_are_one_line_under_a_typer_without_typer_exception(smol, monkeypatch):
    """typer before 0.27.2 has no TyperException (before 0.26 its usage errors are click's own ClickException):
    main() still makes them, and sharpi's own errors and a plain exit, what they are (it named the missing class
    in an except clause: every run of the declared typer >= 0.15.4 ended in an AttributeError traceback)."""
    import typer
    monkeypatch.delattr(typer, "TyperException", raising=False)
    one_error_line(sharpi("-m", smol, "-n", "abc", "-p", "hi"), 2, "Invalid value for '-n'")
    one_error_line(sharpi("-m", smol, "--no-such-flag"), 2, "No such option: --no-such-flag")
    one_error_line(sharpi("-m", "/nonexistent.gguf", "-p", "hi"), 2, "model not found")
    r = sharpi("-m", smol, "-p", "hi", "-n", 1, "--temp", 0)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_environment_switches_read_alike_and_an_unknown_value_is_said(smol, monkeypatch):
    """Every SHARPI_* switch takes 0/off/false/no and 1/on/true/yes (any case); another value keeps the default,
    and a run says so in one warning line (a bisecting run whose switch was not taken would mislead)."""
    from sharpi_core.switches import SWITCHES, switch, tri_state, unknown
    for name, default in SWITCHES.items():
        for v, want in (("0", False), (" Off", False), ("no", False), ("FALSE", False), ("1", True), ("on", True),
                        ("Yes", True), ("true ", True), ("", default), ("maybe", default)):
            monkeypatch.setenv(name, v)
            assert switch(name) is want, (name, v)
        monkeypatch.delenv(name)
        assert switch(name) is default
    monkeypatch.setenv("SHARPI_SPEC_COST", "off")
    assert tri_state("SHARPI_SPEC_COST") is False and unknown() == []
    monkeypatch.setenv("SHARPI_SPEC_COST", "2")
    assert tri_state("SHARPI_SPEC_COST") is None and unknown() == ["SHARPI_SPEC_COST=2"]
    monkeypatch.delenv("SHARPI_SPEC_COST")
    r = sharpi("-m", smol, "-p", "Hi", "-n", 2, "--temp", 0, env={"SHARPI_SPEC_SAMPLE": "maybe"})
    assert r.returncode == 0 and r.stderr.count("warning: SHARPI_SPEC_SAMPLE=maybe: neither 0/off/false/no") == 1
