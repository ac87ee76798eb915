"""--rope-freq-base / --rope-freq-scale / --rope-scale / --rope-scaling and the GGUF's linear RoPE scaling.

The oracle (tests/data/llamacpp_rope.json, scripts/llamacpp_rope.py) is libllama's greedy path with its
rope_freq_base / rope_freq_scale context parameters; sharpi's logits equal its bit for bit there.
"""
from __future__ import annotations

import json
from pathlib import Path

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


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c['model'].split('-')[0]}-{c['rope_freq_base']:g}-{c['rope_freq_scale']:g}",
                                               marks=() if c["model"] == SMOL else (pytest.mark.slow,)) for c in CASES])
def test_greedy_with_rope_overrides_is_llama_cpps(case):
    model = load_model(GGUFFile(model_path(case["model"])))  # (its own: set_rope changes the model)
    first = model.forward(torch.tensor(case["prompt_ids"]), 0, model.new_cache(64), last_n=1)
    model.set_rope(case["rope_freq_base"], case["rope_freq_scale"])
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
    for kv, msg in (({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "RoPE scaling 'yarn' is not supported"),
                    ({"llama.rope.scaling.attn_factor": 0.0}, "rope_attn_factor is 0.0")):
        with pytest.raises(SharpiError, match=msg):
            scale(**kv)
    # an attention factor (llama.cpp: every graph's rope cache times it) scales cos and sin
    m = load_model(write_gguf(tmp_path / "af.gguf", kv={"llama.rope.scaling.attn_factor": 1.5}))
    assert m.config.rope_attn_factor == 1.5
    tab = torch.view_as_real(m._rope_table(m._ropes[0], 4))
    assert torch.equal(tab, torch.view_as_real(load_model(write_gguf(tmp_path / "af1.gguf"))._rope_table(m._ropes[0], 4)) * 1.5)


def test_cli_rope_flags():
    smol = str(model_path(SMOL))
    case = CASES[0]
    run = ("-m", smol, "-p", case["prompt"], "-n", 48, "--temp", 0, "--json", "--ignore-eos")
    got = json.loads(sharpi(*run, "--rope-freq-base", case["rope_freq_base"], "--rope-freq-scale", case["rope_freq_scale"]).stdout)
    assert got["tokens"] == case["tokens"]
    same = json.loads(sharpi(*run, "--rope-freq-base", case["rope_freq_base"], "--rope-scale", 1 / case["rope_freq_scale"]).stdout)
    assert same["tokens"] == case["tokens"]
    plain = json.loads(sharpi(*run).stdout)["tokens"]
    none = json.loads(sharpi(*run, "--rope-scaling", "none", "--rope-freq-scale", 0.5).stdout)["tokens"]
    assert none == plain != case["tokens"]  # scaling 'none' never scales (llama.cpp)
    one_error_line(sharpi("-m", smol, "-p", "Hi", "--rope-scaling", "yarn"), 2, "yarn is not supported")
    one_error_line(sharpi("-m", smol, "-p", "Hi", "--rope-scale", 2, "--rope-freq-scale", 0.5), 2, "give one")
    one_error_line(sharpi("-m", smol, "-p", "Hi", "--rope-freq-base", -1), 2, "--rope-freq-base")
