"""LoRA adapters (--lora, --lora-scaled) against llama.cpp's greedy text (tests/data/llamacpp_lora.json,
scripts/llamacpp_lora.py): SmolLM2 (F16, F32, Q8_0 factors, alpha or none, two adapters at once), Qwen2.5
0.5B (q and k rows reordered for RoPE, biases after the update) and the olmo2 model gguf_derive makes from
SmolLM2 (the token embedding's and the output layer's adapters)."""
from __future__ import annotations

import json
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from conftest import QWEN05, SMOL, loaded, model_path
from test_cli import sharpi

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from gguf_derive import derive, finish  # noqa: E402
from llamacpp_control_vector import write_vector  # noqa: E402
from llamacpp_lora import ADAPTERS, OLMO2, PPL_TEXT, write_adapter  # noqa: E402

from sharpi_core import lora  # noqa: E402
from sharpi_core.errors import SharpiError  # noqa: E402
from sharpi_core.errors import UsageError  # noqa: E402
from sharpi_core.gguf_file import GGUFFile  # noqa: E402
from sharpi_core.kernels import cpu  # noqa: E402
from sharpi_core.models import load_model  # noqa: E402

ORACLE = json.loads((Path(__file__).parent / "data" / "llamacpp_lora.json").read_text())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    out = {n: d / f"{n}.gguf" for n in ADAPTERS}
    for n, p in out.items():
        write_adapter(p, n)
    out["v"] = d / "v.gguf"  # (a control vector: perplexity's case with both)
    write_vector(out["v"], "a")
    return {n: str(p) for n, p in out.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> a model's GGUF path (olmo2 derived here, as the oracle script derives it)."""
    olmo2 = tmp_path_factory.mktemp("olmo2") / "olmo2.gguf"
    derive("olmo2", str(model_path(SMOL)), str(olmo2))
    return {SMOL: model_path(SMOL), QWEN05: model_path(QWEN05), OLMO2: olmo2}


@contextmanager
def adapted(model, pairs):
    """The model with the adapters (path, scale) for the block, its own weights after."""
    lora.load(pairs, model)
    try:
        yield model
    finally:
        lora.load([], model)
        assert not model.has_loras


def flag_pairs(flags: list[str]) -> list[tuple[str, float]]:
    """The (path, scale) pairs of --lora / --lora-scaled flags, as the command line orders them."""
    plain = [(p, 1.0) for f, v in zip(flags, flags[1:]) if f == "--lora" for p in v.split(",")]
    return plain + lora.parse_scaled([v for f, v in zip(flags, flags[1:]) if f == "--lora-scaled"])


def greedy_text(model, tok, prompt: str, n: int) -> str:
    """llama-completion's greedy continuation (stopping at an end of generation)."""
    cache = model.new_cache(128)
    logits = model.forward(torch.tensor(tok.encode(prompt)), 0, cache, last_n=1)[-1]
    out = []
    for _ in range(n):
        t = int(logits.argmax())
        if t in tok.eog_ids:
            break
        out.append(t)
        logits = model.forward(torch.tensor([t]), cache.length, cache)[-1]
    return tok.decode(out)


@pytest.mark.parametrize("case", ORACLE["cases"], ids=lambda c: f"{c['model'][:6]}|{c['prompt'][:10]}|{' '.join(c['flags'])}")
def test_greedy_text_is_llama_cpps(case, files, models):
    model, tok = loaded(models[case["model"]])
    want = case["text"].replace(" [end of text]", "").rstrip()
    assert want != case["plain"].replace(" [end of text]", "").rstrip()  # the adapters change the text
    pairs = flag_pairs([f.format(**files) for f in case["flags"]])
    with adapted(model, pairs):
        got = greedy_text(model, tok, case["prompt"], ORACLE["n_predict"])
    assert got.rstrip() == want


def test_command_line_applies_adapters_in_order(files):
    case = next(c for c in ORACLE["cases"] if "--lora-scaled" in c["flags"] and "--lora" in c["flags"])
    flags = [f.format(**files) for f in case["flags"]]
    r = sharpi("-m", model_path(SMOL), "-p", case["prompt"], "-n", ORACLE["n_predict"], "--temp", "0", "-no-cnv",
               "--no-display-prompt", *flags)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.rstrip() == case["text"].replace(" [end of text]", "").rstrip()


def _verify_rows_are_one_token_rows(model, tok, files):
    ids = torch.tensor(tok.encode("Repeat: the cat sat on the mat, the cat sat on the mat, the cat"))
    with adapted(model, [(files["a"], 1.0), (files["c"], 0.5)]):
        c1, c2 = model.new_cache(64), model.new_cache(64)
        model.forward(ids[:-5], 0, c1)
        model.forward(ids[:-5], 0, c2)
        rows = model.forward(ids[-5:], c1.length, c1, decode=True)
        one = torch.cat([model.forward(ids[i:i + 1], c2.length, c2) for i in range(len(ids) - 5, len(ids))])
        assert torch.equal(rows, one)


def test_verify_rows_are_one_token_rows_and_speculation_keeps_the_text(files, monkeypatch):
    # a verify pass (decode=True) gives each row the bits of a one-token pass, with the adapters' products too
    # (F16 and Q8_0 factors), and so without the C kernels (torch's matmuls, one row at a time there); so
    # speculative greedy decoding (the lookup drafter) emits the plain greedy text of the adapted model
    model, tok = loaded(SMOL)
    _verify_rows_are_one_token_rows(model, tok, files)
    with monkeypatch.context() as m:
        m.setenv("SHARPI_CPU_KERNEL", "0")
        bare = load_model(GGUFFile(model_path(SMOL)))
        assert bare.output._kern is None
        _verify_rows_are_one_token_rows(bare, tok, files)
    args = ("-m", model_path(SMOL), "-p", "Repeat: the cat sat on the mat, the cat sat on the mat, the cat", "-n", 24,
            "--temp", "0", "-no-cnv", "--no-display-prompt", "--lora", files["a"])
    plain = sharpi(*args)
    spec = sharpi(*args, "--draft-lookup")
    assert plain.returncode == spec.returncode == 0 and plain.stdout == spec.stdout
    assert "speculative: drafted" in spec.stderr and "accepted 0 " not in spec.stderr  # (it did speculate)


def test_speculation_keeps_the_text_on_a_machine_without_a_compiler(files, tmp_path):
    # no C kernels at all (no compiler): torch's matmuls, the F16 factors' too, multiply a verify pass's rows one
    # at a time, so the model as its own draft gives the adapted model's plain greedy text (it did not: F16 factors
    # took T rows at once, in another order than one row's)
    env = {"SHARPI_KERNEL_DIR": str(tmp_path / "k"), "SHARPI_CC": str(tmp_path / "none"),
           "SHARPI_SPEC_COST": "0", "SHARPI_SPEC_ADAPTIVE": "0"}
    args = ("-m", model_path(SMOL), "-p", "The history of the Roman empire is", "-n", 40, "--temp", "0", "-no-cnv",
            "--lora", files["a"])
    plain = sharpi(*args, env=env, process=True)
    spec = sharpi(*args, "-md", model_path(SMOL), "--spec-draft-n-max", 8, env=env, process=True)
    assert "the C kernels are unavailable (no C compiler found" in spec.stderr
    assert plain.returncode == spec.returncode == 0 and plain.stdout == spec.stdout
    assert re.search(r"speculative, draft: \d+ steps, drafted \d+, accepted [1-9]", spec.stderr), spec.stderr


@pytest.mark.parametrize("case", ORACLE["perplexity"], ids=lambda c: " ".join(c["flags"]))
def test_perplexity_is_llama_perplexitys(case, files):
    # sharpi perplexity with adapters (and a control vector) on the fixtures' text: llama-perplexity's numbers
    if not PPL_TEXT.is_file():
        pytest.skip(f"no {PPL_TEXT}")
    r = sharpi("perplexity", "-m", model_path(SMOL), "-f", PPL_TEXT, "-c", 128, "--chunks", 8,
               *[f.format(**files) for f in case["flags"]])
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"Final estimate: PPL = {case['ppl']:.4f} +/- {case['err']:.5f}" in r.stdout


def test_f16_products_are_ggmls_at_any_width():
    # ggml_vec_dot_f16: 64 elements a step in 4 accumulators, then the rest one by one in double; tinyBLAS for
    # prompt passes of widths in 16s (one 16-lane accumulator): checked against those definitions in numpy
    if not cpu.available():
        pytest.skip("no compiled CPU kernels")
    rng = np.random.default_rng(0)
    for n, k, T, prompt in ((12, 8, 3, False), (12, 100, 2, False), (8, 48, 5, True), (6, 48, 5, True), (4, 72, 1, True)):
        w = rng.standard_normal((n, k)).astype(np.float16)
        x = rng.standard_normal((T, k)).astype(np.float32)
        got = cpu.f16_mm(torch.from_numpy(x), torch.from_numpy(w), prompt).numpy()
        xh, wf = x.astype(np.float16).astype(np.float32), w.astype(np.float32)
        tiny = prompt and T >= 2 and k % 16 == 0 and n % 4 == 0
        for t in range(T):
            for r in range(n):
                p = (xh[t].astype(np.float64) * wf[r]).astype(np.float32)  # (exact products, rounded to float)
                if tiny:
                    lanes = np.zeros(16, np.float32)
                    for d in range(0, k, 16):
                        lanes = (lanes.astype(np.float64) + p[d:d + 16]).astype(np.float32)
                    want = _reduce16(lanes)
                else:
                    np_ = k - k % 64
                    acc = np.zeros((4, 16), np.float32)
                    for d in range(0, np_, 64):
                        acc = (acc.astype(np.float64) + p[d:d + 64].reshape(4, 16)).astype(np.float32)
                    s = np.float64(_reduce16((acc[0] + acc[2]) + (acc[1] + acc[3])))
                    for d in range(np_, k):
                        s += np.float64(p[d])
                    want = np.float32(s)
                assert got[t, r] == want, (n, k, T, prompt, t, r)


def _reduce16(v: np.ndarray) -> np.float32:
    """_mm512_reduce_add_ps as GCC computes it (ggml_order.h's reduce16)."""
    h = v[8:] + v[:8]
    q = h[4:] + h[:4]
    q = q + q[[2, 3, 0, 1]]
    return np.float32(q[0] + q[1])


def _adapter(path: Path, arch="llama", tensors=None, kv=None) -> str:
    w = gguf.GGUFWriter(str(path), arch)
    for key, val in ({"general.type": "adapter", "adapter.type": "lora"} if kv is None else kv).items():
        w.add_string(key, val) if isinstance(val, str) else w.add_float32(key, val)
    for name, a in (tensors or {}).items():
        w.add_tensor(name, a)
    finish(w)
    return str(path)


A, B = np.zeros((8, 576), np.float16), np.zeros((576, 8), np.float16)


@pytest.mark.parametrize("kw,message", [
    ({"kv": {"general.type": "model", "adapter.type": "lora"}}, "general.type is 'model', not 'adapter'"),
    ({"kv": {"general.type": "adapter", "adapter.type": "cvec"}}, "adapter.type is 'cvec', not 'lora'"),
    ({"arch": "qwen2"}, "an adapter for 'qwen2', the model is 'llama'"),
    ({"kv": {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": float("nan")}},
     "adapter.lora.alpha is nan"),
    ({"tensors": {"blk.0.attn_q.weight.lora_a": A}}, "missing its lora_b"),
    ({"tensors": {"blk.0.attn_q.weight.lora_x": A}}, "unexpected suffix"),
    ({"tensors": {"blk.0.attn_q.weight.lora_a": A[:, :500], "blk.0.attn_q.weight.lora_b": B}}, "incorrect shape"),
    ({"tensors": {"blk.0.attn_q.weight.lora_a": A, "blk.0.attn_q.weight.lora_b": B[:, :4]}}, "is not transposed"),
    ({"tensors": {"blk.0.attn_q.weight.lora_a": A.astype(np.float64), "blk.0.attn_q.weight.lora_b": B}}, "F64"),
    ({"tensors": {"blk.99.attn_q.weight.lora_a": A, "blk.99.attn_q.weight.lora_b": B}}, "does not exist in the model"),
    ({"tensors": {"token_embd.weight.lora_a": np.zeros((49152, 8), np.float16),
                  "token_embd.weight.lora_b": B}}, "whose output layer shares it"),
    ({"tensors": {"blk.0.attn_q.weight.lora_a": A[0], "blk.0.attn_q.weight.lora_b": B[:, 0]}}, "lora_a' is not a matrix"),
    ({"tensors": {"blk.0.attn_q.weight.lora_a": A, "blk.0.attn_q.weight.lora_b": B[None]}}, "lora_b' is not a matrix"),
    ({"kv": {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": 16.0},
      "tensors": {"blk.0.attn_q.weight.lora_a": A[:0], "blk.0.attn_q.weight.lora_b": B[:, :0]}}, "is empty"),
    ({"kv": {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": "x"}},  # (a traceback before)
     "adapter.lora.alpha holds 'x', not a number"),
])
def test_bad_adapters_are_refused_and_leave_the_model(tmp_path, files, kw, message):
    model, _ = loaded(SMOL)
    path = _adapter(tmp_path / "l.gguf", **kw)
    with adapted(model, [(files["c"], 1.0)]):
        before = [list(w.loras) for w in model._layer_weights()]
        with pytest.raises(UsageError, match=message):
            lora.load([(files["a"], 1.0), (path, 1.0)], model)
        assert [list(w.loras) for w in model._layer_weights()] == before  # nothing of the good file's either


def test_an_adapter_that_is_no_regular_file_is_refused(tmp_path):
    """A FIFO given as --lora / --control-vector waited for a writer forever (-m's says so at once)."""
    import os
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for flag, what in (("--lora", "LoRA"), ("--control-vector", "control vector")):
        r = sharpi("-m", model_path(SMOL), "-p", "Hi", "-n", 1, flag, fifo, timeout=60)
        assert r.returncode == 2 and r.stderr.strip() == f"error: {what} {fifo}: not a regular file", r.stderr


@pytest.mark.parametrize("flags,message", [
    (["--lora", "/nonexistent/a.gguf"], "no such file"),
    (["--lora-scaled", "a.gguf"], "invalid --lora-scaled 'a.gguf': the format is FNAME:SCALE"),
    (["--lora", "a.gguf", "--device", "cuda", "-ngl", "-1"], "applied on the CPU only"),
    (["--lora-scaled", "a.gguf:1e39"], "invalid --lora-scaled 'a.gguf:1e39': the scale must be a finite float32"),
    (["--lora-scaled", "a.gguf:nan"], "the scale must be a finite float32"),
    (["--control-vector-scaled", "c.gguf:-inf"], "invalid --control-vector-scaled 'c.gguf:-inf': the scale must"),
])
def test_bad_flags_are_one_line_errors(flags, message):
    r = sharpi("-m", model_path(SMOL), "-p", "Hi", "-n", 1, *flags)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_prompt_cache_knows_the_adapters():
    from sharpi_cli import options, runner
    o = options.RunOptions(model="m", lora=["a.gguf"])
    assert "a.gguf" in runner.model_settings(o, 30)
    half = options.RunOptions(model="m", lora_scaled=[("a.gguf", 0.5)])
    assert runner.model_settings(o, 30) != runner.model_settings(half, 30)
    # an adapter at scale 0 is not applied (llama.cpp's common_set_adapter_lora skips it): no adapter to a cache
    assert runner.model_settings(options.RunOptions(model="m", lora_scaled=[("a.gguf", 0.0)]), 30) == ""


def test_an_adapter_at_scale_0_is_checked_and_not_applied(files, tmp_path):
    """llama.cpp loads (checks) every adapter and applies those whose scale is not 0: no products computed for
    nothing, the model's own logits."""
    model, tok = loaded(SMOL)
    ids = torch.tensor(tok.encode("The capital of France is"))
    plain = model.forward(ids, 0, model.new_cache(32))
    with adapted(model, [(files["a"], 0.0), (files["c"], 0.0)]):
        assert not model.has_loras
        assert torch.equal(model.forward(ids, 0, model.new_cache(32)), plain)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF")
    with pytest.raises(SharpiError):
        lora.load([(str(bad), 0.0)], model)
