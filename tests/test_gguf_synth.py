"""scripts/gguf_synth.py: a model's skeleton (metadata + tensor list) and a random-weight GGUF of its
shape, the stand-in the GPU benchmarks run on where the real files cannot travel."""
from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import torch

from conftest import ROOT, SMOL, model_path
from sharpi_core.models import load_model

_spec = importlib.util.spec_from_file_location("gguf_synth", ROOT / "scripts" / "gguf_synth.py")
synth = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(synth)


def test_synthetic_model_has_the_shape_and_metadata_and_runs(tmp_path):
    src = str(model_path(SMOL))
    sk, out = tmp_path / "smol.json.gz", tmp_path / "synth.gguf"
    synth.skeleton(src, str(sk))
    assert sk.stat().st_size < 2 << 20  # what travels to the GPU machine
    synth.build(str(sk), str(out))
    a, b = gguf.GGUFReader(str(out)), gguf.GGUFReader(src)
    assert [(t.name, t.tensor_type, list(t.shape)) for t in a.tensors] == \
           [(t.name, t.tensor_type, list(t.shape)) for t in b.tensors]
    for key in ("llama.block_count", "llama.rope.freq_base", "tokenizer.ggml.tokens", "tokenizer.chat_template"):
        assert a.fields[key].contents() == b.fields[key].contents(), key
    emb = next(t for t in a.tensors if t.name == "token_embd.weight")
    assert not np.array_equal(emb.data, next(t for t in b.tensors if t.name == "token_embd.weight").data)
    model = load_model(str(out))
    cache = model.new_cache(32)
    logits = model.forward(torch.tensor([1, 2, 3, 4]), 0, cache)
    for _ in range(3):
        logits = model.forward(logits[-1:].argmax(-1), cache.length, cache)
    assert torch.isfinite(logits).all()
