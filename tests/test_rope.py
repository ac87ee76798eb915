"""--rope-freq-base / --rope-freq-scale / --rope-scale / --rope-scaling / --yarn-* and the GGUF's RoPE scaling
(linear, YaRN).

The oracle (tests/data/llamacpp_rope.json, scripts/llamacpp_rope.py) is libllama's greedy path with its
rope_freq_base / rope_freq_scale / rope_scaling_type / yarn_* context parameters; sharpi's logits equal its
bit for bit there.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

import pytest
import torch

from conftest import SMOL, model_path
from sharpi_core.errors import SharpiError
from sharpi_core.gguf_file import GGUFFile
from sharpi_core.models import load_model
from test_cli import one_error_line, sharpi
from test_loading import write_gguf

CASES = json.loads((Path(__file__).parent / "data" / "llamacpp_rope.json").read_text())["cases"]


def greedy(model, ids: list[int], n: int) -> list[int]:
    cache = model.new_cache(512)
    logits = model.forward(torch.tensor(ids), 0, cache, last_n=1)[-1]
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model.forward(torch.tensor(out[-1:]), cache.length, cache)[-1]
    return out


def case_id(c: dict) -> str:
    y = c.get("yarn", {})
    return f"{c['model'].split('-')[0]}-{c['rope_freq_base']:g}-{c['rope_freq_scale']:g}" + (
        f"-{y.get('rope_scaling', 'yarn')}-{len(y)}" if y else "")


def set_rope(model, case: dict) -> None:
    yarn = dict(case.get("yarn", {}))
    model.set_rope(case["rope_freq_base"], case["rope_freq_scale"], yarn.pop("rope_scaling", None), yarn)


@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(c), marks=() if c["model"] == SMOL else (pytest.mark.slow,))
                                  for c in CASES])
def test_greedy_with_rope_overrides_is_llama_cpps(case):
    model = load_model(GGUFFile(model_path(case["model"])))  # (its own: set_rope changes the model)
    first = model.forward(torch.tensor(case["prompt_ids"]), 0, model.new_cache(64), last_n=1)
    set_rope(model, case)
    assert greedy(model, case["prompt_ids"], len(case["tokens"])) == case["tokens"]
    assert not torch.equal(model.forward(torch.tensor(case["prompt_ids"]), 0, model.new_cache(64), last_n=1), first)
    if model.config.sliding_window:  # Gemma 3's sliding layers keep their own RoPE, as llama.cpp's
        assert (10000.0, 1.0) in model._ropes


def test_linear_rope_scaling_from_the_gguf(tmp_path):
    def scale(**kv):
        return load_model(write_gguf(tmp_path / f"m{len(list(tmp_path.iterdir()))}.gguf", kv=kv)).config.rope_freq_scale
    assert scale() == 1.0
    # (an F32 model: its fused q/k and gate/up weights are float views of the file)
    m = load_model(write_gguf(tmp_path / "f32.gguf", kv={"llama.rope.scaling.factor": 2.0}))
    assert m.config.rope_freq_scale == 0.5 and torch.isfinite(m.forward(torch.arange(5), 0, m.new_cache(8))).all()
    assert scale(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}) == 0.25
    assert scale(**{"llama.rope.scaling.factor": 2.0}) == 0.5  # linear is llama.cpp's default type
    assert scale(**{"llama.rope.scale_linear": 8.0}) == 0.125  # the older key
    assert scale(**{"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}) == 1.0
    for kv, msg in (({"llama.rope.scaling.type": "su", "llama.rope.scaling.factor": 4.0}, "RoPE scaling 'su' is not supported"),
                    ({"llama.rope.scaling.attn_factor": 0.0}, "rope_attn_factor is 0.0")):
        with pytest.raises(SharpiError, match=msg):
            scale(**kv)
    # an attention factor (llama.cpp: every graph's rope cache times it) scales cos and sin
    m = load_model(write_gguf(tmp_path / "af.gguf", kv={"llama.rope.scaling.attn_factor": 1.5}))
    assert m.config.rope_attn_factor == 1.5
    tab = torch.view_as_real(m._rope_table(m._ropes[0], 4))
    assert torch.equal(tab, torch.view_as_real(load_model(write_gguf(tmp_path / "af1.gguf"))._rope_table(m._ropes[0], 4)) * 1.5)


def test_yarn_settings_as_llama_cpps_context_resolves_them(tmp_path):
    """YaRN from the GGUF: the mix on, the original context from the GGUF; the magnitude factor as
    llama.cpp's context computes it in float (libm logf), whatever --yarn-attn-factor says while the mix is on."""
    from dataclasses import replace  # noqa: PLC0415
    kv = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}  # (and an integer original context)
    c = load_model(write_gguf(tmp_path / "y.gguf", kv=kv, ints={"llama.rope.scaling.original_context_length": 4096})).config
    assert (c.rope_scaling, c.rope_freq_scale, c.yarn) == ("yarn", 0.25, (1.0, 4096, 32.0, 1.0))
    f = np.float32
    get = f(f(0.1) * f(math.log(4)) + f(1))  # get_mscale(4, 1); logf(4) is ln 4 rounded
    assert c.rope_mscale == float(f(get * (f(1) / (f(1) + f(0.1) * f(math.log(4))))))
    assert replace(c, yarn_attn_factor=1.3).rope_mscale == c.rope_mscale  # replaced by YaRN's
    assert replace(c, yarn_ext_factor=0.0, yarn_attn_factor=1.3).rope_mscale == float(f(1.3))
    assert replace(c, rope_scaling="linear").yarn[0] == 0.0 and replace(c, yarn_orig_ctx=512).yarn[1] == 512
    # with a log multiplier (mistral3's mscale_all_dim) the two get_mscale cancel
    assert replace(c, yarn_log_mul=1.0).rope_mscale == float(f(1) / (f(1) + f(0.1) * f(math.log(4))))
    # the torch fallback (no C kernels) computes the same table without the FMAs
    m = load_model(write_gguf(tmp_path / "y2.gguf", kv=kv, ints={"llama.rope.scaling.original_context_length": 64}))
    rope = m._ropes[0]
    exact = m._rope_table(rope, 300)[:300].clone()
    m._rope_cache.clear()
    m._rope_kernel = None
    torch.testing.assert_close(m._rope_table(rope, 300)[:300], exact, rtol=0, atol=2e-6)
    lin = load_model(write_gguf(tmp_path / "l.gguf", kv={"llama.rope.scaling.factor": 4.0})).config
    assert (lin.rope_scaling, lin.yarn[0], lin.rope_mscale) == ("linear", 0.0, 1.0)


def test_cli_rope_flags():
    smol = str(model_path(SMOL))
    case = CASES[0]
    run = ("-m", smol, "-p", case["prompt"], "-n", 48, "--temp", 0, "--json", "--ignore-eos")
    got = json.loads(sharpi(*run, "--rope-freq-base", case["rope_freq_base"], "--rope-freq-scale", case["rope_freq_scale"]).stdout)
    assert got["tokens"] == case["tokens"]
    plain = json.loads(sharpi(*run).stdout)["tokens"]
    none = json.loads(sharpi(*run, "--rope-scaling", "none", "--rope-freq-scale", 0.5).stdout)["tokens"]
    assert none == plain != case["tokens"]  # scaling 'none' never scales (llama.cpp)
    yarn = next(c for c in CASES if c.get("yarn") == {"rope_scaling": "yarn", "yarn_orig_ctx": 256})
    run = ("-m", smol, "-p", yarn["prompt"], "-n", 48, "--temp", 0, "--json", "--ignore-eos")
    got = json.loads(sharpi(*run, "--rope-scaling", "yarn", "--rope-scale", 1 / yarn["rope_freq_scale"],
                            "--yarn-orig-ctx", 256).stdout)
    assert got["tokens"] == yarn["tokens"]
    one_error_line(sharpi("-m", smol, "-p", "Hi", "--rope-scaling", "su"), 2, "choose none, linear or yarn")


@pytest.mark.parametrize("args, fragment", [
    (dict(rope_scale=2.0, rope_freq_scale=0.5), "give one"), (dict(rope_freq_base=-1.0), "--rope-freq-base"),
    (dict(yarn_beta_fast=0.0), "--yarn-beta-fast 0: must be > 0"), (dict(yarn_beta_slow=0.0), "--yarn-beta-slow 0"),
    (dict(yarn_ext_factor=float("nan")), "--yarn-ext-factor nan: must be a finite number"),
    (dict(yarn_attn_factor=float("inf")), "--yarn-attn-factor"), (dict(yarn_orig_ctx=-1), "--yarn-orig-ctx -1"),
    # below a float's smallest normal number, as std::stof refuses it (1 / 1e-39 overflowed a float: nonsense)
    (dict(rope_freq_scale=1e-39), "--rope-freq-scale 1e-39: must be 0 (the model's) or a float from 1.18e-38"),
    (dict(rope_scale=1e-40), "--rope-scale 1e-40"), (dict(yarn_beta_slow=-1e-40), "--yarn-beta-slow -1e-40")])
def test_rope_flags_are_checked(args, fragment):
    from sharpi_cli.options import RunOptions
    from sharpi_cli.runner import rope_flags
    from sharpi_cli.validate import validate  # noqa: PLC0415
    from sharpi_core.errors import UsageError  # noqa: PLC0415
    with pytest.raises(UsageError, match=re.escape(fragment)):
        validate(RunOptions(**args))
    # given (>= 0; the original context > 0) -> set_rope's yarn settings; negative: the model's
    o = RunOptions(yarn_ext_factor=0.0, yarn_beta_fast=-1.0, yarn_orig_ctx=0, yarn_attn_factor=1.5)
    validate(o)
    assert rope_flags(o) == (0.0, 0.0, None, {"yarn_ext_factor": 0.0, "yarn_attn_factor": 1.5})
    assert rope_flags(RunOptions()) == ()
    assert rope_flags(RunOptions(rope_scale=4.0)) == rope_flags(RunOptions(rope_freq_scale=0.25))  # N = 1 / N
