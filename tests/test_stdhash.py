"""sharpi_core.stdhash against libstdc++ (tests/data/libstdcxx_map_order.json, recorded by
scripts/libstdcxx_map_order.py from a g++ program): std::hash<std::string>, the bucket counts a map grows through,
and the order a std::unordered_map<std::string, ...> walks its keys, on key sets across the growth steps (with keys
inserted twice) and on the four models' token texts, which llama.cpp's loader walks to pick special tokens."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import ALL_MODELS, model_param
from sharpi_core.stdhash import buckets, map_order, string_hashes
from test_tokenizer import tok

ROOT = Path(__file__).resolve().parents[1]
DATA = json.loads((ROOT / "tests" / "data" / "libstdcxx_map_order.json").read_text())
_spec = importlib.util.spec_from_file_location("libstdcxx_map_order", ROOT / "scripts" / "libstdcxx_map_order.py")
_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_script)


def test_string_hashes_are_libstdcxx():
    keys = [bytes.fromhex(k) for k in DATA["hashes"]]
    assert [int(h) for h in string_hashes(keys)] == [int(v) for v in DATA["hashes"].values()]


@pytest.mark.parametrize("case", DATA["key_sets"], ids=lambda c: f"{c['n']}-keys-{c['repeats']}-repeated")
def test_walk_is_libstdcxx(case):
    keys = _script.key_set(case["n"], case["repeats"])
    got = map_order(keys)
    assert buckets(case["n"]) == case["buckets"]
    if "walk" in case:
        assert got == case["walk"]
    else:
        assert _script.digest(got) == case["sha256"]


@pytest.mark.parametrize("name", [model_param(n) for n in ALL_MODELS])
def test_vocabulary_walk_is_libstdcxx(name):
    want = DATA["vocabularies"][name]
    t = tok(name)
    assert t.n_vocab == want["n"] and buckets(t.n_vocab) == want["buckets"]
    assert _script.digest(map_order([s.encode() for s in t.tokens])) == want["sha256"]


def test_a_map_past_the_known_sizes_is_refused():
    with pytest.raises(ValueError):
        buckets(712698)
