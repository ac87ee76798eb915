"""-cnv against llama-cli's own conversations (scripts/llamacpp_cli_chat.py -> tests/data/llamacpp_cli_chat.json:
the transcript `llama-cli --simple-io --temp 0 ARGS -o FILE` writes with the user's lines on stdin)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import model_path
from test_cli import sharpi

CASES = {c["name"]: c for c in json.loads((Path(__file__).parent / "data" / "llamacpp_cli_chat.json").read_text())}


@pytest.mark.parametrize("name", list(CASES))
def test_transcript_is_llama_clis(name, tmp_path):
    """Byte for byte llama-cli's -o transcript: the turns, /regen's second reply to the same conversation, /clear
    (the system prompt kept), messages over lines ('\\', '/', -mli), penalties, the Qwen template over turns, and a
    reply -n cuts inside a character, which ends before it (llama-cli's server never sends half a character)."""
    case = CASES[name]
    out = tmp_path / "chat.txt"
    r = sharpi("-m", model_path(case["model"]), "-cnv", "--simple-io", "--temp", 0, "-t", 2, *case["args"],
               "-o", out, input=case["input"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.read_text() == case["transcript"]
    assert "\ufffd" not in r.stdout


def test_a_cut_character_is_left_out_not_replaced():
    """Tokenizer.decode / StreamDecoder.flush with drop_partial_char: the bytes of a character the last token only
    begins go (what llama-cli's server does at the end of a reply); invalid bytes before the end stay U+FFFD."""
    from sharpi_core.gguf_file import GGUFFile
    from sharpi_core.tokenizer import StreamDecoder, Tokenizer
    tok = Tokenizer.from_gguf(GGUFFile(model_path("qwen2.5-coder-0.5b-instruct-q4_k_m")))
    by_bytes = {tok.token_bytes(i): i for i in range(tok.n_vocab)}
    lead, cont = by_bytes[b"\xe6"], by_bytes[b"\x97"]  # byte tokens: the start of 日 (e6 97 a5), no end
    ids = tok.encode("Hello") + [lead, cont]
    assert tok.decode(ids) == "Hello\ufffd"
    assert tok.decode(ids, drop_partial_char=True) == "Hello"
    assert tok.decode([cont] + ids, drop_partial_char=True) == "\ufffdHello"  # a stray continuation byte: replaced
    dec = StreamDecoder(tok)
    assert "".join(dec.push(i) for i in ids) == "Hello" and dec.flush(drop_partial_char=True) == ""
    assert "".join(dec.push(i) for i in ids) == "Hello" and dec.flush() == "\ufffd"  # (the reset above: fresh)
