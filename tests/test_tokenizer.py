"""Tokenization identical to llama-tokenize; streaming detokenization never splits a character."""
from __future__ import annotations

from functools import lru_cache

import pytest

from conftest import ALL_MODELS, model_path, reference
from sharpi_core.gguf_file import GGUFFile
from sharpi_core.tokenizer import StreamDecoder, Tokenizer


@lru_cache(maxsize=None)
def tok(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(model_path(name)))


# tokenizers are cheap to build (no model weights), so every model runs in the fast tier
@pytest.mark.parametrize("name", ALL_MODELS)
def test_ids_match_llama_tokenize(name):
    t = tok(name)
    bad = [(c["text"], t.encode(c["text"]), c["ids"]) for c in reference()[name]["tokenize"]
           if t.encode(c["text"]) != c["ids"]]
    assert not bad, bad


@pytest.mark.parametrize("name", ALL_MODELS)
def test_round_trip(name):
    t = tok(name)
    for c in reference()[name]["tokenize"]:
        ids = [i for i in c["ids"] if i != t.bos_id or not t.add_bos]
        assert t.decode(ids, skip_special=False) == c["text"]


@pytest.mark.parametrize("name", ALL_MODELS)
def test_stream_decoder_never_emits_half_a_character(name):
    t = tok(name)
    text = "Unicode: café, naïve, 日本語, emoji 🎉🚀, hieroglyphs 𓀀𓀁𓂀 ꙮ — done"
    ids = t.encode(text, add_special=False)
    sd = StreamDecoder(t)
    pieces = [sd.push(i) for i in ids] + [sd.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # at least one multibyte character really was split across tokens (else the test proves nothing)
    assert any(len(t.token_bytes(i)) and not _valid_utf8(t.token_bytes(i)) for i in ids)


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_special_tokens_parsed_or_not():
    t = tok(ALL_MODELS[0])
    with_special = t.encode("<|im_start|>user", add_special=False)
    assert with_special[0] == t.token_to_id["<|im_start|>"]
    plain = t.encode("<|im_start|>user", add_special=False, parse_special=False)
    assert t.token_to_id["<|im_start|>"] not in plain and t.decode(plain) == "<|im_start|>user"


def test_eog_tokens():
    t = tok(ALL_MODELS[0])
    assert t.token_to_id["<|im_end|>"] in t.eog_ids and t.eos_id in t.eog_ids
    g = tok(ALL_MODELS[1])
    assert g.token_to_id["<end_of_turn>"] in g.eog_ids and g.add_bos and g.bos_id == 2
