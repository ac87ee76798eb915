"""Control vectors (--control-vector, --control-vector-scaled, --control-vector-layer-range) on SmolLM2
against llama.cpp's greedy text (tests/data/llamacpp_control_vector.json, scripts/llamacpp_control_vector.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import SMOL, model_path
from test_cli import sharpi

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from gguf_derive import finish  # noqa: E402
from llamacpp_control_vector import VECTORS, write_vector  # noqa: E402

from sharpi_core import control_vector  # noqa: E402
from sharpi_core.errors import UsageError  # noqa: E402

ORACLE = json.loads((Path(__file__).parent / "data" / "llamacpp_control_vector.json").read_text())


@pytest.fixture(scope="module")
def vectors(tmp_path_factory):
    d = tmp_path_factory.mktemp("cvec")
    files = {n: d / f"{n}.gguf" for n in VECTORS}
    for n, p in files.items():
        write_vector(p, n)
    return {n: str(p) for n, p in files.items()}


def _text(r) -> str:
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.rstrip()


@pytest.mark.parametrize("case", ORACLE["cases"], ids=lambda c: f"{c['prompt'][:12]}|{' '.join(c['flags'])}")
def test_greedy_text_is_llama_cpps(case, vectors):
    smol = model_path(SMOL)
    flags = [f.format(**vectors) for f in case["flags"]]
    want = case["text"].replace(" [end of text]", "").rstrip()  # (llama-completion's marker at an end of text)
    assert want != case["plain"].rstrip()  # the vectors change the text
    got = _text(sharpi("-m", smol, "-p", case["prompt"], "-n", ORACLE["n_predict"], "--temp", "0", "-no-cnv",
                       "--no-display-prompt", *flags))
    assert got == want


def test_speculative_greedy_keeps_the_target_with_its_vectors(vectors):
    # the drafter proposes, the target (with the control vectors) decides: the same text as plain decoding
    smol = model_path(SMOL)
    args = ("-m", smol, "-p", "Repeat: the cat sat on the mat, the cat sat on the mat, the cat", "-n", 32,
            "--temp", "0", "-no-cnv", "--no-display-prompt", "--control-vector", vectors["a"])
    plain = _text(sharpi(*args))
    assert plain == _text(sharpi(*args, "--draft-lookup"))
    assert plain != _text(sharpi(*args[:-2]))


def test_vectors_add_up_in_float32(vectors):
    a = gguf.GGUFReader(vectors["a"])
    b = gguf.GGUFReader(vectors["b"])
    da = {int(t.name.split(".")[1]): np.asarray(t.data, np.float32) for t in a.tensors}
    db = {int(t.name.split(".")[1]): np.asarray(t.data, np.float32) for t in b.tensors}
    got = control_vector.load([(vectors["a"], 0.5), (vectors["b"], -2.0)], 576, 30, (3, 12))
    assert sorted(got) == list(range(3, 13))  # the range, inclusive, and nothing of b's layer 40
    for il, v in got.items():
        want = da[il] * np.float32(0.5)
        if il in db:
            want = want + db[il] * np.float32(-2.0)
        np.testing.assert_array_equal(v.numpy(), want)
    whole = control_vector.load([(vectors["b"], 1.0)], 576, 30)
    assert sorted(whole) == [3, 7, 12]  # layers 1.. below the layer count; no layer 0 ever


def _write(path: Path, tensors: dict[str, np.ndarray]) -> str:
    w = gguf.GGUFWriter(str(path), "controlvector")
    for name, v in tensors.items():
        w.add_tensor(name, v)
    finish(w)
    return str(path)


@pytest.mark.parametrize("tensors,message", [
    ({"direction.1": np.zeros(100, np.float32)}, "100 values a direction, the model's embedding has 576"),
    ({"direction.0": np.zeros(576, np.float32)}, "layer indices start at 1"),
    ({"dir.1": np.zeros(576, np.float32)}, "is not direction.<layer>"),
    ({"direction.1": np.zeros(576, np.float16)}, "is F16, not F32"),
    ({"direction.1": np.zeros((2, 576), np.float32)}, "is not one-dimensional"),
    ({"direction.1": np.zeros(576, np.float32), "direction.2": np.zeros(512, np.float32)}, "has 512 values"),
    ({}, "no direction tensors"),
])
def test_bad_files_are_refused(tmp_path, tensors, message):
    path = _write(tmp_path / "v.gguf", tensors)
    with pytest.raises(UsageError, match=message):
        control_vector.load([(path, 1.0)], 576, 30)


@pytest.mark.parametrize("flags,message", [
    (["--control-vector", "/nonexistent/v.gguf"], "no such file"),
    (["--control-vector-scaled", "v.gguf"], "the format is FNAME:SCALE"),
    (["--control-vector-scaled", "v.gguf:x"], "the format is FNAME:SCALE"),
])
def test_bad_flags_are_one_line_errors(flags, message):
    r = sharpi("-m", model_path(SMOL), "-p", "Hi", "-n", 1, *flags)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_prompt_cache_knows_the_vectors():
    from sharpi_cli import options, runner
    o = options.RunOptions(model="m")
    assert runner.model_settings(o, 30) == ""
    o.control_vector = ["a.gguf"]
    assert "a.gguf" in runner.model_settings(o, 30)
    o2 = options.RunOptions(model="m", control_vector=["a.gguf"], control_vector_layer_range=(2, 5))
    assert runner.model_settings(o2, 30) != runner.model_settings(o, 30)
    # ranges are compared as the layers they give (SmolLM2: 30 layers, vectors for layers 1..29)
    same = [None, (1, 30), (0, 0), (-1, 29), (1, 100)]
    assert len({runner.model_settings(options.RunOptions(model="m", control_vector=["a.gguf"],
                                                         control_vector_layer_range=r), 30) for r in same}) == 1
    assert control_vector.layer_span((5, 2), 30) == (5, 2) and "layers none" in runner.model_settings(
        options.RunOptions(model="m", control_vector=["a.gguf"], control_vector_layer_range=(5, 2)), 30)


def test_a_prompt_cache_reads_the_same_layers_given_otherwise(vectors, tmp_path):
    """A prompt cache made with `--control-vector-layer-range 1 N` (N the layer count) serves a run without the
    flag (the same layers); a run with another range is refused, not fed the other vectors' K and V."""
    f = tmp_path / "p.cache"
    base = ("-m", model_path(SMOL), "-p", "The capital of France is", "-n", 4, "--temp", 0, "--prompt-cache", f,
            "--control-vector", vectors["a"])
    first = sharpi(*base, "--control-vector-layer-range", 1, 30)
    assert first.returncode == 0, first.stderr
    again = sharpi(*base)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    other = sharpi(*base, "--control-vector-layer-range", 2, 30)
    assert other.returncode != 0 and "other model settings" in other.stderr
