"""Tokenization identical to llama-tokenize; pieces like llama.cpp's token_to_piece; streaming
detokenization never splits a character.

The vocabularies load in well under a second each (no weights), so every model runs in the fast
tier; a model whose GGUF is not in the local cache is skipped (nothing is downloaded here).
"""
from __future__ import annotations

import json
import random
import re
import sys
import time
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from conftest import ALL_MODELS, GEMMA, QWEN05, QWEN15, SMOL, model_path, reference
from sharpi_core.errors import SharpiError
from sharpi_core.gguf_file import GGUFFile
from sharpi_core.tokenizer import (_PRE_GROUPS, ATTR_CONTROL, ATTR_NORMAL, ATTR_USER_DEFINED, PRE_TOKENIZERS,
                                   StreamDecoder, Tokenizer, _byte_decoder, _PyBPE)

_TOKS: dict[str, Tokenizer] = {}


def tok(name: str) -> Tokenizer:
    """The model's tokenizer, built once per test session (the GGUF is fetched when absent)."""
    if name not in _TOKS:
        from conftest import model_path
        _TOKS[name] = Tokenizer.from_gguf(GGUFFile(model_path(name)))
    return _TOKS[name]


@pytest.mark.parametrize("name", ALL_MODELS)
def test_ids_match_llama_tokenize(name):
    t = tok(name)
    cases = reference()[name]["tokenize"]
    bad = [(c["text"], got, c["ids"]) for c in cases if (got := t.encode(c["text"])) != c["ids"]]
    assert not bad, bad


@pytest.mark.parametrize("name", ALL_MODELS)
def test_round_trip(name):
    t = tok(name)
    ref = reference()[name]
    texts = [c["text"] for c in ref["tokenize"]] + [g["prompt"] + g["text"] for g in ref["greedy"]]
    for text in texts:
        ids = t.encode(text, add_special=False)
        assert t.decode(ids) == text
    for c in ref["tokenize"]:  # llama.cpp's ids decode back too (control tokens print their text)
        ids = c["ids"][1:] if t.add_bos else c["ids"]
        assert t.decode(ids) == c["text"]


@pytest.mark.parametrize("name", ALL_MODELS)
def test_stream_decoder_never_emits_half_a_character(name):
    t = tok(name)
    text = "café, naïve, 日本語, emoji 🎉🚀, hieroglyphs 𓀀𓀁𓂀 ꙮ — done"
    ids = t.encode(text, add_special=False)
    sd = StreamDecoder(t)
    pieces = [sd.push(i) for i in ids] + [sd.flush()]
    assert "".join(pieces) == t.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    # a multibyte character really was split across tokens (else the test proves nothing)
    assert any(not _valid_utf8(t.token_bytes(i)) for i in ids)


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_stream_decoder_flushes_invalid_bytes():
    t = tok(SMOL)
    byte_tok = t.token_to_id[next(c for c, b in _byte_decoder().items() if b == 0xE6)]  # lead byte of 日
    sd = StreamDecoder(t)
    assert sd.push(byte_tok) == ""
    assert sd.flush() == "\ufffd"
    assert sd.push(t.encode("a", add_special=False)[0]) == "a"  # usable after a flush
    # control tokens print only when asked for (llama-cli's --special)
    im_end = t.token_to_id["<|im_end|>"]
    assert sd.push(im_end) == "" and StreamDecoder(t, special=True).push(im_end) == "<|im_end|>"


def test_special_tokens_parsed_or_not():
    t = tok(SMOL)
    im_start = t.token_to_id["<|im_start|>"]
    assert t.encode("<|im_start|>user", add_special=False)[0] == im_start
    plain = t.encode("<|im_start|>user", add_special=False, parse_special=False)
    assert im_start not in plain and t.decode(plain) == "<|im_start|>user"


def test_user_defined_tokens_split_even_without_parse_special():
    t = tok(QWEN05)
    tc = t.token_to_id["<tool_call>"]
    assert t.attrs[tc] & ATTR_USER_DEFINED
    assert t.encode("x<tool_call>y", parse_special=False) == t.encode("x") + [tc] + t.encode("y")


def test_eog_sets_follow_llama_cpp_rules():
    # eos/eot ids, the end-of-turn spellings and (Qwen, SmolLM2) the FIM pad/repo/file-sep tokens
    s = tok(SMOL)
    assert s.eog_ids == {s.token_to_id[x] for x in ("<|endoftext|>", "<|im_end|>", "<reponame>")}
    q = tok(QWEN05)
    assert q.eog_ids == {q.token_to_id[x] for x in ("<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>",
                                                    "<|file_sep|>", "</s>")}
    assert q.is_control(q.token_to_id["</s>"])  # llama.cpp forces EOG spellings to control
    g = tok(GEMMA)
    assert g.eog_ids == {g.token_to_id[x] for x in ("<eos>", "<end_of_turn>", "</s>")}
    assert g.add_bos and g.bos_id == 2 and g.eos_id == 1 and not g.add_space_prefix


def test_pieces():
    q = tok(QWEN05)
    im_end = q.token_to_id["<|im_end|>"]
    assert q.token_bytes(im_end) == b"<|im_end|>" and q.token_bytes(im_end, special=False) == b""
    assert q.decode([im_end], skip_special=True) == ""
    assert q.token_bytes(q.token_to_id["[PAD151665]"]) == b""  # unused tokens print nothing
    assert q.token_bytes(q.token_to_id["Ġworld"]) == b" world"
    assert q.token_text(q.token_to_id["Ġworld"]) == "Ġworld"
    g = tok(GEMMA)
    assert g.token_bytes(g.token_to_id["<0x41>"]) == b"A"
    assert g.token_bytes(g.token_to_id["\u2581the"]) == b" the"
    assert g.token_bytes(g.token_to_id["<start_of_image>"], special=False) == b"<start_of_image>"  # user-defined


def test_encode_speed():
    text = " ".join(c["text"] for c in reference()[GEMMA]["tokenize"]) * 8
    for name in (SMOL, GEMMA):
        t = tok(name)
        t.encode("warm up <|im_start|>")
        t0 = time.perf_counter()
        n = len(t.encode(text))
        dt = time.perf_counter() - t0
        assert n > 1500 and dt < 0.5, (name, n, dt)


def test_same_vocab_for_both_qwen_sizes():
    a, b = tok(QWEN05), tok(QWEN15)
    assert a.n_vocab == b.n_vocab and all(a.token_text(i) == b.token_text(i) for i in range(0, a.n_vocab, 997))


# -- llama.cpp's special-token partition, on a small synthetic vocabulary -------------------------
def _tiny_spm(extra: dict[str, int], add_space_prefix: bool = False) -> Tokenizer:
    """A SentencePiece vocabulary: the control tokens, single characters, and `extra` (text -> attr)."""
    tokens = ["<unk>", "<s>", "</s>"] + list("abcdxyz\u2581") + list(extra)
    attrs = np.array([1, 8, 8] + [ATTR_NORMAL] * 8 + list(extra.values()), dtype=np.int32)
    return Tokenizer(tokens=tokens, attrs=attrs, scores=np.zeros(len(tokens), np.float32), model_type="llama",
                     pre="default", merges=None, bos_id=1, eos_id=2, eot_id=None, eom_id=None, unk_id=0,
                     add_bos=True, add_eos=False, add_space_prefix=add_space_prefix, eog_ids={2})


def test_partition_takes_longest_special_token_first_like_llama_cpp():
    # llama.cpp splits out the longest special text first, everywhere: "abcd" -> a [bcd], where a
    # leftmost-first regex would give [ab] c d
    t = _tiny_spm({"ab": ATTR_USER_DEFINED, "bcd": ATTR_USER_DEFINED})
    ab, bcd = t.token_to_id["ab"], t.token_to_id["bcd"]
    assert t.encode("abcd", add_special=False) == [t.token_to_id["a"], bcd]
    x, y, a = (t.token_to_id[c] for c in "xya")
    assert t.encode("xabyabcdab", add_special=False) == [x, ab, y, a, bcd, ab]


def test_partition_orders_special_tokens_by_their_bytes():
    """llama.cpp sorts its special tokens by the length of their text in bytes: "ééé" (6 bytes) goes before
    "éabc" (5 bytes, 4 characters), so "éééabc" is ééé a b c, not é é éabc (the order by characters)."""
    t = _tiny_spm({"ééé": ATTR_USER_DEFINED, "éabc": ATTR_USER_DEFINED, "é": ATTR_NORMAL})
    assert t.encode("éééabc", add_special=False) == [t.token_to_id[s] for s in ("ééé", "a", "b", "c")]


def test_fewest_tokens_is_a_lower_bound_when_special_tokens_strip_whitespace():
    """A phi-3 vocabulary's special tokens strip the whitespace after them: 20000 spaces cost no token there,
    and the bound (248 tokens for a 2-token text) refused prompts that fit."""
    gf = GGUFFile(model_path(SMOL))
    t = Tokenizer.from_gguf(_WithKeys(gf, {"general.name": "Phi-3 mini"}))
    text = "<|im_start|>" + " " * 20000 + "hi"
    assert t.fewest_tokens(text) <= len(t.encode(text)) == 2
    plain = Tokenizer.from_gguf(gf)
    assert 1 < plain.fewest_tokens(text) <= len(plain.encode(text))


def test_partition_control_tokens_only_with_parse_special():
    t = _tiny_spm({"<c>": ATTR_CONTROL, "bcd": ATTR_USER_DEFINED})
    c = t.token_to_id["<c>"]
    assert t.encode("a<c>a") == [1, t.token_to_id["a"], c, t.token_to_id["a"]]
    assert c not in t.encode("a<c>a", parse_special=False)


def test_spm_space_prefix_after_every_special_token():
    # llama.cpp adds the SentencePiece space prefix to text at the start and after each special token
    t = _tiny_spm({"<c>": ATTR_CONTROL}, add_space_prefix=True)
    sp, a = t.token_to_id["\u2581"], t.token_to_id["a"]
    assert t.encode("a<c>a", add_special=False) == [sp, a, t.token_to_id["<c>"], sp, a]


# -- errors -----------------------------------------------------------------------------------------
class _FakeGGUF:
    path = "fake.gguf"

    def __init__(self, **meta):
        self.meta = meta

    def get(self, key, default=None):
        return self.meta.get(key, default)

    def field_array(self, key):
        return None


def test_unsupported_tokenizers_are_user_errors():
    with pytest.raises(SharpiError, match="unsupported tokenizer model 'bert'"):
        Tokenizer.from_gguf(_FakeGGUF(**{"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}))
    with pytest.raises(SharpiError, match="unsupported pre-tokenizer 'nope'"):
        Tokenizer.from_gguf(_FakeGGUF(**{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "nope",
                                         "tokenizer.ggml.tokens": ["a"]}))


def test_tokenizer_keys_of_the_wrong_type_are_one_error():
    """A damaged file's text keys (a list of pre-tokenizers, a string for a flag) are refused as llama.cpp's typed
    reads refuse them (they were tracebacks in the chat or at load), and so are special ids that are no integers
    (llama.cpp's gguf_get_val_u32 asserts; here they were ignored). The chat template is read as llama.cpp reads it,
    as the text of its value (gguf_kv_to_str: a number as std::to_string writes it, an array as no template): it was
    refused, and a raw one-shot run needs none."""
    gf = GGUFFile(model_path(SMOL))
    for key, value, kind in (("tokenizer.ggml.pre", ["smollm"], "a str"), ("tokenizer.ggml.model", 7, "a str"),
                             ("tokenizer.ggml.add_bos_token", "no", "a bool"),
                             ("tokenizer.ggml.eos_token_id", 2.0, "an int"), ("tokenizer.ggml.prefix_token_id", "1", "an int")):
        with pytest.raises(SharpiError, match=rf"metadata '{key}' holds .*, not {kind} \(a damaged file\?\)"):
            Tokenizer.from_gguf(_WithKeys(gf, {key: value}), lazy=True)
    assert Tokenizer.from_gguf(_WithKeys(gf, {}), lazy=True).chat_template == gf.get("tokenizer.chat_template")
    for value, text in ((5, "5"), (True, "true"), (1.5, "1.500000"), (["a"], None)):
        tok = Tokenizer.from_gguf(_WithKeys(gf, {"tokenizer.chat_template": value}), lazy=True)
        assert tok.chat_template == text, value


def test_a_byte_token_s_text_is_read_as_llama_cpp_reads_it():
    """A byte token is `<0xHH>`; a damaged one reads as llama.cpp's token_to_byte reads it (strtol, base 16, of the
    two characters after "<0x": white space and a sign allowed, hex digits up to the first other character, 0 with
    none), not a traceback when it is printed."""
    from sharpi_core.tokenizer import _byte_value
    texts = ("<0x41>", "<0x0a>", "<0xZZ>", "<0x4>", "<0x1FF>", "<0x-1>", "<0x 9>", "<0x+A>", "<0x0x>", "<0x")
    assert [_byte_value(t) for t in texts] == [0x41, 0x0A, 0, 4, 0x1F, 0xFF, 9, 0xA, 0, 0]


# -- differential check of the byte-level BPE path against a model of llama.cpp ------------------
# llama.cpp pre-tokenizes SmolLM2 with a hand-written GPT-2 splitter (after isolating \p{N}) and
# Qwen2 with std::regex over a "collapsed" string (non-ASCII characters replaced by one byte per
# Unicode category, C-locale \s), then runs its own BPE merge loop. Below is that procedure in
# Python; random strings full of category edge cases must tokenize the same way through
# `tokenizers`.
_WS = {0x9, 0xA, 0xB, 0xC, 0xD, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F,
       0x3000}
_COLLAPSE = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_CS, _CNS = r"[\t\n\x0b\x0c\r ]", r"[^\t\n\x0b\x0c\r ]"  # std::regex \s in the C locale
_CL, _CN = r"\xd2A-Za-z", r"\xd10-9"
_QWEN2_COLLAPSED = re.compile(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n" + _CL + _CN + r"]?[" + _CL + r"]+|[" + _CN
    + r"]| ?[^\t\n\x0b\x0c\r " + _CL + _CN + r"]+[\r\n]*|" + _CS + r"*[\r\n]+|" + _CS + r"+(?!" + _CNS + r")|"
    + _CS + "+")


def _kind(c: str) -> str:
    return "W" if ord(c) in _WS else unicodedata.category(c)[0]


def _collapse(text: str) -> str:
    return "".join(c if ord(c) < 128 else "\x0b" if ord(c) in _WS else _COLLAPSE.get(_kind(c), "\xd0") for c in text)


def _regex_split(pattern: re.Pattern, collapsed: str, pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for a, b in pieces:  # matches and the gaps between them, like unicode_regex_split_stl
        pos = a
        for m in pattern.finditer(collapsed, a, b):
            out += [(pos, m.start())] if m.start() > pos else []
            out += [(m.start(), m.end())] if m.end() > m.start() else []
            pos = m.end()
        out += [(pos, b)] if pos < b else []
    return out


def _gpt2_split(text: str, pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """llama.cpp's unicode_regex_split_custom_gpt2."""
    out = []
    for a, b in pieces:
        kind = lambda p: _kind(text[p]) if a <= p < b else None  # noqa: E731
        pos = prev = a
        while pos < b:
            c = text[pos]
            if c == "'" and pos + 1 < b:
                if text[pos + 1] in "stmd":
                    out.append((prev, pos + 2)); pos = prev = pos + 2; continue  # noqa: E702
                if pos + 2 < b and text[pos + 1:pos + 3] in ("re", "ve", "ll"):
                    out.append((prev, pos + 3)); pos = prev = pos + 3; continue  # noqa: E702
            k = kind(pos + 1) if c == " " else kind(pos)
            for want in ("L", "N", "O"):
                test = (lambda x: x is not None and x not in "WLN") if want == "O" else (lambda x, w=want: x == w)
                if test(k):
                    pos += c == " "
                    while test(kind(pos)):
                        pos += 1
                    break
            else:
                nw = 0
                while kind(pos + nw) == "W":
                    nw += 1
                pos += nw - 1 if nw > 1 and pos + nw < b else max(nw, 1)
            out.append((prev, pos))
            prev = pos
    return out


def _llama_cpp_ids(t: Tokenizer, bpe: _PyBPE, text: str) -> list[int]:
    enc = {b: c for c, b in _byte_decoder().items()}
    whole = [(0, len(text))]
    if t.pre == "qwen2":
        words = _regex_split(_QWEN2_COLLAPSED, _collapse(text), whole)
    else:
        words = _gpt2_split(text, _regex_split(re.compile("[" + _CN + "]"), _collapse(text), whole))
    return [i for a, b in words for i in bpe._word("".join(enc[x] for x in text[a:b].encode("utf-8")))]


# (\x04, \x16 and \x1d: bytes SmolLM2's vocabulary lacks, which llama.cpp's merges do not reach across)
_POOL = (list("abcXYZ 019'sStTreVElLdD.,!?-_()[]{}<>/\\\"#$%&*+=^`|~@;:\t\n\r\x0b\x0c\x1c\x1f\x00\x04\x16\x1d")
         + list("\x85\xa0\u2000\u3000\u2028éßЖ東ｶ한ا٣²½Ⅻ\u0301\u093f€©😀—«。")
         + list("\u200b\ufeff\ue000ſK")
         + ["'s", "'S", " '", "  ", "\r\n", "12345", " 3.14"])


@pytest.mark.parametrize("name", [SMOL, QWEN05])
def test_bpe_matches_model_of_llama_cpp_on_random_text(name):
    t = tok(name)
    t.encode("x")  # builds the BPE
    pairs = [(m[:k], m[k + 1:]) for m in t._merges() if (k := m.find(" ", 1)) > 0]
    ref = _PyBPE(t.token_to_id, pairs, None, ignore_merges=False)
    rnd = random.Random(1234)
    for _ in range(1500):
        s = "".join(rnd.choice(_POOL) for _ in range(rnd.randint(1, 30)))
        assert t.encode(s, add_special=False, parse_special=False) == _llama_cpp_ids(t, ref, s), repr(s)


# -- every pre-tokenizer name against libllama ------------------------------------------------------
PRETOK = json.loads((Path(__file__).parent / "data" / "llamacpp_pretok.json").read_text())


class _WithKeys:
    """A GGUF whose metadata reads as `keys` where it has them."""

    def __init__(self, gf, keys: dict):
        self._gf, self._keys = gf, keys

    def get(self, key, default=None):
        return self._keys[key] if key in self._keys else self._gf.get(key, default)

    def __getattr__(self, name):
        return getattr(self._gf, name)


def _WithPre(gf, pre: str) -> _WithKeys:
    """A GGUF whose tokenizer.ggml.pre reads as `pre`."""
    return _WithKeys(gf, {"tokenizer.ggml.pre": pre})


def test_every_pre_tokenizer_name_is_recorded():
    assert sorted(PRETOK["ids"]) == sorted(PRE_TOKENIZERS)


@pytest.mark.parametrize("names", [names for names, _, _ in _PRE_GROUPS], ids=lambda names: names[0])
def test_pre_tokenizers_split_as_llama_cpp(names):
    """Each group's regexes (llama.cpp's per pre-tokenizer type: tekken's case classes, deepseek's explicit
    letter ranges, marks in qwen35's words, ...) on Qwen2.5's BPE vocabulary give libllama's ids for
    every text, under every name of the group (the oracle of scripts/llamacpp_pretok.py: libllama with
    tokenizer.ggml.pre set to each name). The names of a group share one tokenizer, built once."""
    t = Tokenizer.from_gguf(_WithPre(GGUFFile(model_path(PRETOK["vocabulary"])), names[0]))
    got = [t.encode(text, add_special=False, parse_special=False) for text in PRETOK["texts"]]
    for pre in names:
        for text, ours, want in zip(PRETOK["texts"], got, PRETOK["ids"][pre]):
            assert ours == want, (pre, text)


# -- random texts against libllama -----------------------------------------------------------------
FUZZ = json.loads((Path(__file__).parent / "data" / "llamacpp_tokenize_fuzz.json").read_text())


@pytest.mark.parametrize("name", ALL_MODELS)
def test_random_texts_tokenize_as_llama_cpp(name):
    """libllama's ids (scripts/fuzz_tokenizer.py --record) for random texts of every kind (scripts, marks, emoji,
    control characters, any code point, the models' special tokens whole and cut short), special tokens parsed and
    BOS added or neither, and for what that tool found differing: a byte the vocabulary lacks stays a symbol between
    its neighbours, which no merge joins and which prints nothing (SmolLM2 has no 0x1D: ">\\x1d<" is '>' '<', not
    '><'), and letters and digits Unicode 16.0 added are in no class (llama.cpp's tables are Unicode 15.1's)."""
    t = tok(name)
    for special in (True, False):
        for text, want in zip(FUZZ["texts"], FUZZ["ids"][name][str(int(special))]):
            assert t.encode(text, add_special=special, parse_special=special) == want, (special, text)


# -- special tokens that strip spaces, add_bos / add_eos, against libllama ---------------------------------------
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from llamacpp_special_attrs import changed_keys  # noqa: E402

ATTRS = json.loads((Path(__file__).parent / "data" / "llamacpp_special_attrs.json").read_text())


def _variant_tokenizer(variant: str) -> Tokenizer:
    """The tokenizer of one of scripts/llamacpp_special_attrs.py's vocabulary variants (a model's metadata changed)."""
    model, keys, renames = ATTRS["variants"][variant]
    gf = GGUFFile(model_path(model))
    return Tokenizer.from_gguf(_WithKeys(gf, changed_keys(gf, keys, renames)))


@pytest.mark.parametrize("variant", sorted(ATTRS["ids"]))
def test_special_token_strip_rules_and_added_tokens_are_llama_cpps(variant):
    """llama.cpp strips the spaces after every special token of a "phi-3" model (but <unk>, <s>, <|endoftext|>), before
    "[MASK]" of a "modern-bert" one and "<mask>" of the jina-v2 pre-tokenizers, and appends EOS where add_eos_token is
    set: the same metadata (SmolLM2's and Gemma 3's vocabularies renamed, scripts/llamacpp_special_attrs.py) gives
    libllama's ids, special tokens parsed and added."""
    t = _variant_tokenizer(variant)
    for text, want in zip(ATTRS["texts"], ATTRS["ids"][variant]):
        assert t.encode(text, add_special=True, parse_special=True) == want, text


@pytest.mark.parametrize("variant", sorted(ATTRS["specials"]))
def test_special_ids_are_llama_cpps(variant):
    """The end-of-turn, FIM and end-of-generation ids libllama gives each variant: where several spellings of one are
    in the vocabulary (SmolLM2's <|endoftext|> and <|im_end|>; the *-spellings variants rename tokens to more),
    llama.cpp takes the first its std::unordered_map of the texts walks (sharpi_core.stdhash), not the first of its
    list of spellings (which gives another id in 14 of the variants' 18 such choices, SmolLM2's <|im_end|> among
    them)."""
    t = _variant_tokenizer(variant)
    want = ATTRS["specials"][variant]
    got = {"bos": t.bos_id, "eos": t.eos_id, "eot": t.eot_id, **t.fim_ids}
    assert {k: v for k, v in got.items() if v is not None} == {k: v for k, v in want.items() if k != "eog"}
    assert sorted(t.eog_ids) == want["eog"]


@pytest.mark.parametrize("name", ALL_MODELS)
def test_fewest_tokens_is_a_lower_bound(name):
    """fewest_tokens (what refuses a prompt too long for any context before tokenizing it) never exceeds the real
    count: not on texts made of the vocabulary's longest tokens (where it is tightest), not with special tokens,
    multibyte characters or spaces (an SPM token's U+2581 stands for one)."""
    t = tok(name)
    longest = max(range(t.n_vocab), key=lambda i: len(t.tokens[i]))
    assert t.fewest_tokens("a" * len(t.tokens[longest])) == 1 and t.fewest_tokens("a" * (len(t.tokens[longest]) + 1)) == 2
    rng = random.Random(5)
    long_ones = sorted(range(t.n_vocab), key=lambda i: -len(t.tokens[i]))[:200]
    # (bytes a vocabulary lacks give no token: SmolLM2 has no 0x1D, 0x04 or 0xF1, U+50000's first byte)
    texts = [t.decode([longest] * 7), t.decode(long_ones), " " * 3000, "\n" * 999 + "日本語🎉" * 50,
             "\x1d" * 3000 + "a\x04", "\U00050000" * 99]
    for _ in range(30):
        texts.append(t.decode(rng.sample(long_ones, 40) + [rng.randrange(t.n_vocab) for _ in range(20)]))
    for text in texts:
        assert t.fewest_tokens(text) <= len(t.encode(text, add_special=False)), text[:80]
    # and it is tight: in each of these vocabularies seven longest tokens' text encodes as those seven
    assert t.fewest_tokens(texts[0]) == len(t.encode(texts[0], add_special=False)) == 7
