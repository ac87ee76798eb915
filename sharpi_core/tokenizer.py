"""Tokenizers built from GGUF metadata, reproducing llama.cpp's token ids and pieces.

- `gpt2` (byte-level BPE; SmolLM2, Qwen2.5): the `tokenizers` library's BPE model with the
  pre-tokenizer regexes llama.cpp uses for the GGUF's `tokenizer.ggml.pre` (a pure-Python BPE
  with llama.cpp's merge loop is the fallback when `tokenizers` rejects the vocabulary).
- `llama` (SentencePiece; Gemma 3): llama.cpp's SPM algorithm, bigram merges by vocab score
  (best score first, leftmost on ties) with byte fallback.

Special (control, user-defined, unknown) tokens are split out of the text first, exactly like
llama.cpp's `tokenizer_st_partition`: longest token text first, every occurrence of it in every
remaining text fragment. Token attributes, end-of-generation ids and the token-text heuristics
behind them follow llama.cpp's vocab loader (src/llama-vocab.cpp).
"""
from __future__ import annotations

import codecs
import gc
import heapq
import re
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable, Iterable

import gguf
import numpy as np

from .errors import SharpiError
from .gguf_file import GGUFFile, get_typed, kv_text
from .libm import C_SPACE, strtol
from .stdhash import map_order
from .text import without_surrogates

# llama.cpp token types (tokenizer.ggml.token_type) ...
TYPE_UNDEFINED, TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = range(7)
# ... and the attribute bit flags llama.cpp turns them into (llama_token_attr)
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8
_TYPE_TO_ATTR = np.array([ATTR_UNDEFINED, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED,
                          ATTR_UNUSED, ATTR_BYTE], dtype=np.int32)
_SPECIAL_ATTRS = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN  # what st_partition splits out
_HIDDEN_ATTRS = ATTR_CONTROL | ATTR_UNKNOWN  # printed only with special=True / parsed only with parse_special

# -- pre-tokenizer regexes (llama.cpp's llm_tokenizer_bpe, per pre-tokenizer type) ---------------
# Each entry is a sequence of regexes applied one after another, each splitting the pieces left by
# the previous one into matches and the gaps between them (llama.cpp's unicode_regex_split).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's stand-in for tokenizer.json's \p{Lu}/\p{Ll} classes: "a letter that is not a-z" / "not A-Z"
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
           r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's (Phi-4-mini, Llama 4): tekken's case classes with contractions after a word, digits in threes
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS
          + r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS
          + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# (escaped: several of these code points change under Unicode normalization, which would break ranges)
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b"
    "\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")
# The code points Unicode 16.0 assigned (unicodedata2 16.0.0 against 15.1.0: a category other than Cn now). llama.cpp's
# character classes are Unicode 15.1's (its unicode-data.cpp: these have no flags, like any unassigned code point),
# while `tokenizers`' regex engine knows 16.0 (Garay, Todhri, Egyptian hieroglyphs extended-A... are letters and
# digits there): _llama_cpp_regex takes them out of every \p{..} class, so they split as llama.cpp splits them.
_UNICODE_16_ADDED = (
    "\u0897\u1b4e\u1b4f\u1b7f\u1c89\u1c8a\u2427-\u2429\u31e4\u31e5\ua7cb-\ua7cd\ua7da-\ua7dc"
    "\U000105c0-\U000105f3\U00010d40-\U00010d65\U00010d69-\U00010d85\U00010d8e\U00010d8f"
    "\U00010ec2-\U00010ec4\U00010efc\U00011380-\U00011389\U0001138b\U0001138e\U00011390-\U000113b5"
    "\U000113b7-\U000113c0\U000113c2\U000113c5\U000113c7-\U000113ca\U000113cc-\U000113d5"
    "\U000113d7\U000113d8\U000113e1\U000113e2\U000116d0-\U000116e3\U00011bc0-\U00011be1"
    "\U00011bf0-\U00011bf9\U00011f5a\U00013460-\U000143fa\U00016100-\U00016139\U00016d40-\U00016d79"
    "\U00018cff\U0001cc00-\U0001ccf9\U0001cd00-\U0001ceb3\U0001e5d0-\U0001e5fa\U0001e5ff"
    "\U0001f8b2-\U0001f8bb\U0001f8c0\U0001f8c1\U0001fa89\U0001fa8f\U0001fabe\U0001fac6\U0001fadc"
    "\U0001fadf\U0001fae9\U0001fbcb-\U0001fbef")


# Unicode's White_Space characters beyond ASCII (llama.cpp's unicode_set_whitespace).
_NON_ASCII_SPACES = "\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


def _llama_cpp_regex(regex: str) -> str:
    """`regex` as llama.cpp's unicode_regex_split matches it, for `tokenizers`' regex engine (Oniguruma):
    - with \\p{X} classes (llama.cpp's "collapsed" text, a byte per character class): each class limited to the
      code points Unicode 15.1 assigned (class intersection, also inside a bracket expression);
    - without (std::wregex on the text with every non-ASCII space replaced by a vertical tab, so that \\s matches
      it): a bracket expression that lists non-ASCII characters never matches those spaces (deepseek's ranges
      U+0800..U+4E00 and U+3000..U+3002: "\\t\\t\\u3000" is "\\t\\t" then "\\u3000" there, not "\\t" and "\\t\\u3000")."""
    if "\\p{" in regex:
        return re.sub(r"\\p\{(\w+)\}", lambda m: f"[\\p{{{m[1]}}}&&[^{_UNICODE_16_ADDED}]]", regex)
    out, i, n = [], 0, len(regex)
    while i < n:
        if regex[i] == "\\":
            out.append(regex[i:i + 2])
            i += 2
        elif regex[i] == "[":
            j = i + 1
            while regex[j] != "]":  # (these regexes have no nested classes)
                j += 2 if regex[j] == "\\" else 1
            body = regex[i + 1:j]
            wide = not body.startswith("^") and any(ord(c) > 0x7F for c in body)
            out.append(f"[{body}&&[^{_NON_ASCII_SPACES}]]" if wide else f"[{body}]")
            i = j + 1
        else:
            out.append(regex[i])
            i += 1
    return "".join(out)


_PRE_GROUPS: list[tuple[tuple[str, ...], list[str], bool]] = [
    # (tokenizer.ggml.pre names, regex sequence, ignore_merges)
    (("default",), [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], False),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "jina-v1-en",
      "jina-v2-code", "roberta-bpe"), [_GPT2], False),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
     [r"\p{N}", _GPT2], False),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
     [_QWEN2], False),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"), [_LLAMA3], True),
    (("dbrx", "smaug-bpe"), [_LLAMA3], False),
    (("falcon",), [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"], False),
    (("deepseek-coder",), [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"], False),
    (("deepseek-llm",), [r"[\r\n]", r"\s?[" + _DEEPSEEK_LLM_LETTERS + r"]+", "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                         r"\s+$", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}+"], False),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"),
     [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                          r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"], False),
    (("qwen35",), [_QWEN35], False),
    (("tekken",), [_TEKKEN], True),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), [_GPT4O], False),
]
PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {n: (rx, im) for names, rx, im in _PRE_GROUPS for n in names}
# pre-tokenizers for which llama.cpp's loader turns add_bos on by default (metadata still overrides)
_PRE_ADD_BOS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                "jina-v5-nano", "tekken"}

# -- token texts llama.cpp's loader recognises (of several present, the first its hash map walks: stdhash) --
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_AUTO_SPECIAL = {  # metadata key suffix -> token texts that stand in for it when the key is missing
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~[")



@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte -> printable-unicode map, inverted (unicode char -> byte)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _byte_value(text: str) -> int:
    """A byte token's byte from its text, `<0xHH>`, as llama.cpp reads it (token_to_byte: strtol of the two
    characters after "<0x", base 16, as a byte): C's white space and a sign allowed, hex digits up to the first
    other character, 0 with none (a damaged vocabulary's token)."""
    v = strtol(text[3:5], 16)
    return 0 if v is None else v & 0xFF


def _bpe_piece(text: str) -> bytes:
    """llama.cpp's llama_decode_text: byte-level BPE token text -> the bytes it stands for."""
    dec = _byte_decoder()
    out = bytearray()
    for ch in text:
        b = dec.get(ch)
        if b is not None:
            out.append(b)
        else:  # not a byte-level character: llama.cpp prints this marker (with the whole token text)
            out += f"[UNK_BYTE_0x{ch.encode('utf-8').hex()}{text}]".encode("utf-8")
    return bytes(out)


@contextmanager
def _gc_paused():
    """Building many small containers triggers full GC passes over everything already loaded
    (a 262k-token vocabulary); pausing the collector makes that 5x faster."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _trie_pattern(strings: Iterable[str]) -> str:
    """A regex matching any of `strings`, longest alternative first at each position (a trie)."""
    trie: dict = {}
    for s in strings:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        chain = ""
        while True:  # collapse single-child chains iteratively (keeps the recursion shallow)
            keys = [k for k in node if k]
            if len(keys) == 1 and "" not in node:
                chain += re.escape(keys[0])
                node = node[keys[0]]
                continue
            break
        alts = [re.escape(k) + build(node[k]) for k in sorted(keys)]
        if not alts:
            return chain
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return chain + ("(?:" + body + ")?" if "" in node else body)

    return build(trie)


class _PyBPE:
    """llama.cpp's BPE merge loop in Python (lowest merge rank first, leftmost on ties), over the
    words of a `tokenizers` pre-tokenizer. Used when the `tokenizers` BPE model cannot be built."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], pre_tokenizer, ignore_merges: bool):
        self.vocab = vocab
        self.ranks: dict[tuple[str, str], int] = {}
        for i, pair in enumerate(merges):
            self.ranks.setdefault(pair, i)  # llama.cpp's bpe_ranks.emplace keeps the first
        self.pre = pre_tokenizer
        self.ignore_merges = ignore_merges
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for word, _ in self.pre.pre_tokenize_str(text):
            ids = self._cache.get(word)
            if ids is None:
                ids = self._word(word)
                if len(self._cache) < 65536:
                    self._cache[word] = ids
            out += ids
        return out

    def _word(self, word: str) -> list[int]:
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        syms = list(word)
        n = len(syms)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        heap: list[tuple[int, int, int, str]] = []

        def push(a: int, b: int) -> None:
            r = self.ranks.get((syms[a], syms[b]))
            if r is not None:
                heapq.heappush(heap, (r, a, b, syms[a] + syms[b]))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, a, b, s = heapq.heappop(heap)
            if not syms[a] or not syms[b] or syms[a] + syms[b] != s:
                continue  # outdated: one side changed since
            syms[a], syms[b] = s, ""
            nxt[a] = nxt[b]
            if nxt[b] < n:
                prv[nxt[b]] = a
            if prv[a] >= 0:
                push(prv[a], a)
            if nxt[a] < n:
                push(a, nxt[a])
        out: list[int] = []
        for s in syms:
            if not s:
                continue
            tid = self.vocab.get(s)
            if tid is not None:
                out.append(tid)
            else:  # llama.cpp looks each raw byte up as a one-byte token (only ASCII can match)
                out += [self.vocab[chr(b)] for b in s.encode("utf-8") if b < 0x80 and chr(b) in self.vocab]
        return out


class Tokenizer:
    """A GGUF vocabulary: encode like llama-tokenize, pieces like llama.cpp's token_to_piece."""

    def __init__(self, *, tokens: list[str], attrs: np.ndarray, scores: np.ndarray | None, model_type: str,
                 pre: str, merges: list[str] | Callable[[], list[str] | None] | None,
                 bos_id: int | None, eos_id: int | None, eot_id: int | None, eom_id: int | None,
                 unk_id: int | None, add_bos: bool, add_eos: bool, add_space_prefix: bool,
                 eog_ids: Iterable[int], chat_template: str | None = None,
                 token_to_id: dict[str, int] | None = None):
        self.tokens = tokens
        self.attrs = attrs
        self.n_vocab = len(tokens)
        self.model_type = model_type
        self.pre = pre
        self.bos_id, self.eos_id, self.eot_id, self.eom_id, self.unk_id = bos_id, eos_id, eot_id, eom_id, unk_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.add_space_prefix = add_space_prefix
        self.eog_ids: frozenset[int] = frozenset(eog_ids)
        self.fim_ids: dict[str, int] = {}  # fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep: those it has
        self.chat_template = chat_template
        self.token_to_id = token_to_id if token_to_id is not None else {t: i for i, t in enumerate(tokens)}
        self._scores = scores
        self._merges = merges
        self._pieces: dict[int, bytes] = {}
        self._finders: dict[bool, tuple] = {}  # parse_special -> _special_finder()
        self._bpe = None  # the gpt2 encoder, built by prepare() or the first encode
        self._spm_scores: list[float] | None = None
        self._byte_ids: list[int | None] | None = None
        self._longest: int | None = None  # the longest token's characters (fewest_tokens)
        self._vanish: tuple[dict, bool] = ({}, False)  # (fewest_tokens)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gf: GGUFFile, lazy: bool = False) -> "Tokenizer":
        """The tokenizer stored in a GGUF's `tokenizer.*` metadata, set up like llama.cpp's loader.

        The encoder's tables (BPE model, special-token matcher) are built here unless `lazy`, in which
        case the first encode builds them (for callers that only compare vocabularies)."""
        model = get_typed(gf, "tokenizer.ggml.model", str)
        if model not in ("gpt2", "llama"):
            what = "no tokenizer model (tokenizer.ggml.model)" if model is None else f"unsupported tokenizer model '{model}'"
            raise SharpiError(f"{gf.path}: {what} (sharpi supports 'gpt2' byte-level BPE and 'llama' SentencePiece "
                              "vocabularies)")
        tokens = gf.get("tokenizer.ggml.tokens")
        if not tokens:
            raise SharpiError(f"{gf.path}: the GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise SharpiError(f"{gf.path}: tokenizer.ggml.tokens is not an array of strings")
        tokens = list(tokens)
        n = len(tokens)
        pre = get_typed(gf, "tokenizer.ggml.pre", str) or "default"
        if model == "gpt2" and pre not in PRE_TOKENIZERS:
            raise SharpiError(f"{gf.path}: unsupported pre-tokenizer '{pre}' for a gpt2 vocabulary "
                              f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")

        token_to_id = dict(zip(tokens, range(n)))  # duplicates: the last id wins, as in older llama.cpp
        if "" in token_to_id:  # llama.cpp renames empty tokens
            for i in [i for i, t in enumerate(tokens) if not t]:
                tokens[i] = f"[EMPTY_{i}]"
                token_to_id[tokens[i]] = i
            token_to_id.pop("", None)

        types = gf.field_array("tokenizer.ggml.token_type", n)
        if types is None:
            attrs = np.full(n, ATTR_NORMAL, dtype=np.int32)
        else:
            t = np.asarray(types[:n], dtype=np.int64)
            attrs = np.where((t >= 0) & (t < len(_TYPE_TO_ATTR)), _TYPE_TO_ATTR[np.clip(t, 0, 6)], ATTR_UNDEFINED)
            attrs = attrs.astype(np.int32)
        scores = gf.field_array("tokenizer.ggml.scores", n) if model == "llama" else None
        if model == "gpt2":  # (the merges are read at the first encode: their type is checked now)
            f = gf.reader.fields.get("tokenizer.ggml.merges")
            if f is not None and list(f.types) != [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]:
                raise SharpiError(f"{gf.path}: tokenizer.ggml.merges is not an array of strings")
        if scores is not None:
            scores = np.asarray(scores[:n], dtype=np.float32)

        # special ids: llama.cpp's per-model defaults, overridden by metadata ids inside the vocab
        special = {"bos": 1, "eos": 2, "unk": 0} if model == "llama" else {"bos": 11, "eos": 11}
        special = {k: v for k, v in special.items() if v < n}
        for key in ("bos", "eos", "eot", "eom", "unk", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep",
                    "fim_sep"):
            # (an id of another type: llama.cpp's gguf_get_val_u32 asserts, here one error line)
            v = get_typed(gf, f"tokenizer.ggml.{key}_token_id", int)
            if v is None and key in ("fim_pre", "fim_suf", "fim_mid"):  # deprecated names
                v = get_typed(gf, f"tokenizer.ggml.{dict(fim_pre='prefix', fim_suf='suffix', fim_mid='middle')[key]}"
                              "_token_id", int)
            if v is not None and 0 <= v < n:
                special[key] = v

        add_bos = model == "llama" or pre in _PRE_ADD_BOS
        add_bos = get_typed(gf, "tokenizer.ggml.add_bos_token", bool, add_bos)
        add_eos = get_typed(gf, "tokenizer.ggml.add_eos_token", bool, False)
        add_space_prefix = get_typed(gf, "tokenizer.ggml.add_space_prefix", bool, model == "llama")
        for flag, key in ((add_bos, "bos"), (add_eos, "eos")):
            if flag and key not in special:
                raise SharpiError(f"{gf.path}: tokenizer.ggml.add_{key}_token is true, but the vocabulary has no "
                                  f"{key.upper()} token (tokenizer.ggml.{key}_token_id)")

        eog = _detect_special_tokens(tokens, token_to_id, attrs, special)
        _apply_model_attr_rules(gf, tokens, token_to_id, attrs)

        template = kv_text(gf, "tokenizer.chat_template")  # (llama.cpp's text of it: an array is none)
        tok = cls(tokens=tokens, attrs=attrs, scores=scores, model_type=model, pre=pre,
                  merges=(lambda: gf.get("tokenizer.ggml.merges")) if model == "gpt2" else None,
                  bos_id=special.get("bos"), eos_id=special.get("eos"), eot_id=special.get("eot"),
                  eom_id=special.get("eom"), unk_id=special.get("unk"), add_bos=add_bos, add_eos=add_eos,
                  add_space_prefix=add_space_prefix, eog_ids=eog, chat_template=template, token_to_id=token_to_id)
        tok.fim_ids = {k: v for k, v in special.items() if k.startswith("fim_")}
        if not lazy:  # pay the one-time costs at load, not in the middle of the first (interactive) turn
            tok.prepare()
        return tok

    def prepare(self) -> None:
        """Build the encoder's tables now (otherwise the first encode does)."""
        self._special_finder(True)
        if self.model_type == "gpt2":
            self._bpe or self._build_bpe()
        elif self._spm_scores is None:
            self._spm_scores = self._scores.tolist() if self._scores is not None else [0.0] * self.n_vocab

    # -- encoding ----------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for `text`, as llama-tokenize gives them.

        add_special: BOS/EOS where the model's metadata asks for them.
        parse_special: control tokens written in the text (e.g. `<|im_start|>`) become one token;
        user-defined tokens are always split out, as in llama.cpp."""
        text = without_surrogates(text)  # (e.g. undecodable argv bytes: U+FFFD each, as llama.cpp reads them)
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        frags = self._partition(text, parse_special) if text else []
        if self.model_type == "llama":
            # llama.cpp: the space prefix goes before text that starts the input or follows a special token
            prev_special = True
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    prev_special = True
                else:
                    if self.add_space_prefix and prev_special:
                        f = " " + f
                    out += self._spm(f.replace(" ", "\u2581"))
                    prev_special = False
        else:
            bpe = self._bpe or self._build_bpe()
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                else:
                    out += bpe(f)
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) found without encoding: every token of either encoder covers at most
        as many characters of the text as its own text has (a gpt2 token's characters are one byte each, a text's
        are 1-4; an SPM token's characters are the text's, with spaces as U+2581; special tokens are spelled out)."""
        if self._longest is None:
            self._longest = max(1, max(map(len, self.tokens), default=1))
            # special tokens that strip the whitespace beside them: a text's whitespace may cost no token
            self._strips = bool((self.attrs & (ATTR_LSTRIP | ATTR_RSTRIP)).any())
            # characters that may give no token at all: the bytes a gpt2 vocabulary lacks (see _build_bpe); a
            # character of several bytes only where a continuation byte is missing too
            missing = self._missing_bytes() if self.model_type == "gpt2" else set()
            self._vanish = ({b: None for b in missing if b < 0x80}, any(0x80 <= b < 0xC0 for b in missing))
        drop, multibyte = self._vanish
        if drop:
            text = text.translate(drop)
        if multibyte:
            text = text.encode("ascii", "ignore").decode("ascii")
        n = len(text) - (sum(map(str.isspace, text)) if self._strips else 0)
        return -(-n // self._longest)

    def _special_finder(self, parse_special: bool) -> tuple:
        """(regex finding the longest special token starting at each position, {text: id}) for
        the special tokens of this mode; compiled on first use (a trie: ~0.15 s for Gemma's 6k)."""
        f = self._finders.get(parse_special)
        if f is None:
            mask = (self.attrs & _SPECIAL_ATTRS) != 0
            if not parse_special:  # control and unknown tokens are then plain text
                mask &= (self.attrs & _HIDDEN_ATTRS) == 0
            table = {self.tokens[i]: i for i in np.nonzero(mask)[0].tolist()}
            with _gc_paused():
                f = (re.compile(f"(?=({_trie_pattern(table)}))") if table else None, table)
            self._finders[parse_special] = f
        return f

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp's tokenizer_st_partition: the text split into raw strings and special-token ids."""
        scan, table = self._special_finder(parse_special)
        if scan is None:
            return [text]
        # every special token occurring in the text: the longest one starting at each position, plus
        # those that are prefixes of it (the only others that can start there)
        cands: set[str] = set()
        for m in scan.finditer(text):
            s = m.group(1)
            if s not in cands:
                cands.add(s)
                cands.update(s[:k] for k in range(1, len(s)) if s[:k] in table)
        if not cands:
            return [text]
        frags: list[tuple[int, int] | int] = [(0, len(text))]
        # longest text first (llama.cpp sorts by its bytes' length; ties here by id), each token split out everywhere
        for s in sorted(cands, key=lambda s: (-len(s.encode("utf-8", "surrogatepass")), table[s])):
            tid = table[s]
            attr = int(self.attrs[tid])
            new: list[tuple[int, int] | int] = []
            for fr in frags:
                if isinstance(fr, int):
                    new.append(fr)
                    continue
                start, end = fr
                while True:
                    m = text.find(s, start, end)
                    if m < 0:
                        break
                    left = m
                    if attr & ATTR_LSTRIP:
                        while left > start and text[left - 1] in C_SPACE:
                            left -= 1
                    if left > start:
                        new.append((start, left))
                    new.append(tid)
                    start = m + len(s)
                    if attr & ATTR_RSTRIP:
                        while start < end and text[start] in C_SPACE:
                            start += 1
                if start < end:
                    new.append((start, end))
            frags = new
        return [f if isinstance(f, int) else text[f[0]:f[1]] for f in frags]

    def _build_bpe(self) -> Callable[[str], list[int]]:
        """The gpt2 BPE encoder: `tokenizers` BPE + llama.cpp's pre-tokenizer regexes."""
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers

        raw = self._merges() if callable(self._merges) else self._merges
        if not raw:
            raise SharpiError("the GGUF's gpt2 vocabulary has no merges (tokenizer.ggml.merges)")
        pairs = []
        for m in raw:
            k = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
            if k > 0:
                pairs.append((m[:k], m[k + 1:]))
        pairs = list(dict.fromkeys(pairs))  # duplicates: the first rank counts (llama.cpp's map emplace)
        regexes, ignore_merges = PRE_TOKENIZERS[self.pre]
        steps = [pre_tokenizers.Split(Regex(_llama_cpp_regex(rx)), behavior="isolated") for rx in regexes]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        pre = pre_tokenizers.Sequence(steps)
        # A byte whose byte-level character the vocabulary lacks (SmolLM2 has no 0x1D) stays a symbol of its own in
        # llama.cpp's merge loop, which no merge joins and which prints nothing: its neighbours never merge across
        # it (">\x1d<" is '>' '<', not '><'). `tokenizers` drops such a character before merging, unless it has
        # an unknown token: one outside the vocabulary's ids stands in for it, and is taken out afterwards.
        vocab, unk, unk_text = self.token_to_id, None, None
        if self._missing_bytes():
            unk, unk_text = self.n_vocab, "\x00sharpi-unknown-byte\x00"
            vocab = {**vocab, unk_text: unk}
        try:
            hf = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges, fuse_unk=False, unk_token=unk_text))
            hf.pre_tokenizer = pre

            if unk is None:
                def enc(text: str) -> list[int]:
                    return hf.encode(text, add_special_tokens=False).ids
            else:
                def enc(text: str) -> list[int]:
                    return [i for i in hf.encode(text, add_special_tokens=False).ids if i != unk]
        except Exception:  # e.g. a merge whose result is not in the vocabulary: llama.cpp's loop in Python
            enc = _PyBPE(self.token_to_id, pairs, pre, ignore_merges).encode
        self._bpe = enc
        return enc

    def _missing_bytes(self) -> set[int]:
        """The bytes whose byte-level character the (gpt2) vocabulary lacks: SmolLM2's 0x04, 0x1D, 0xF1, ..."""
        return {b for ch, b in _byte_decoder().items() if ch not in self.token_to_id}

    def _spm(self, text: str) -> list[int]:
        """llama.cpp's SPM session: repeatedly merge the adjacent pair whose concatenation is the
        vocab token with the best score (leftmost on ties); leftover characters as byte tokens."""
        n = len(text)
        if n == 0:
            return []
        vocab = self.token_to_id
        if self._spm_scores is None:
            self._spm_scores = (self._scores.tolist() if self._scores is not None else [0.0] * self.n_vocab)
        scores = self._spm_scores
        # symbol i always starts at character i (merges absorb the right neighbour), so a symbol is
        # text[i:end[i]] and its right neighbour starts at end[i]
        end = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap = []
        for i in range(n - 1):
            tid = vocab.get(text[i:i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, i + 2))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, i, j, k = pop(heap)
            if not alive[i] or end[i] != j or not alive[j] or end[j] != k:
                continue  # outdated: a side was merged since
            end[i] = k
            alive[j] = False
            if k < n:
                prv[k] = i
            p = prv[i]
            if p >= 0:
                tid = vocab.get(text[p:k])
                if tid is not None:
                    push(heap, (-scores[tid], p, i, k))
            if k < n:
                e = end[k]
                tid = vocab.get(text[i:e])
                if tid is not None:
                    push(heap, (-scores[tid], i, k, e))
        out: list[int] = []
        i = 0
        while i < n:
            e = end[i]
            tid = vocab.get(text[i:e])
            if tid is not None:
                out.append(tid)
            else:  # byte fallback, like llama.cpp's byte_to_token
                out += [self._byte_token(b) for b in text[i:e].encode("utf-8")]
            i = e
        return out

    def _byte_token(self, b: int) -> int:
        if self._byte_ids is None:
            v = self.token_to_id
            self._byte_ids = [v.get(f"<0x{x:02X}>", v.get(chr(x))) for x in range(256)]
        tid = self._byte_ids[b]
        if tid is None:
            tid = self.unk_id if self.unk_id is not None else 0
        return tid

    # -- decoding ----------------------------------------------------------------------------
    def token_text(self, tid: int) -> str:
        """The vocabulary string as stored in the GGUF."""
        return self.tokens[tid]

    def is_control(self, tid: int) -> bool:
        return bool(self.attrs[tid] & ATTR_CONTROL)

    def token_bytes(self, tid: int, special: bool = True) -> bytes:
        """The bytes token `tid` prints as: llama.cpp's token_to_piece. With special=False, control
        and unknown tokens print nothing (what llama-cli shows without --special)."""
        tid = int(tid)
        b = self._pieces.get(tid)
        if b is None:
            b = self._piece(tid)
            self._pieces[tid] = b
        if not special and self.attrs[tid] & _HIDDEN_ATTRS:
            return b""
        return b

    def _piece(self, tid: int) -> bytes:
        text, attr = self.tokens[tid], int(self.attrs[tid])
        if attr & (_HIDDEN_ATTRS | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self.model_type == "gpt2":
                return _bpe_piece(text)
            return text.replace("\u2581", " ").encode("utf-8")
        if attr & ATTR_BYTE:
            return bytes([_byte_value(text)])
        return b""  # unused / undefined tokens print nothing

    def decode(self, ids: Iterable[int], skip_special: bool = False, drop_partial_char: bool = False) -> str:
        """The text of `ids`: their pieces concatenated (invalid UTF-8 replaced). drop_partial_char: a character
        the last pieces only begin (a generation cut inside it) is left out rather than replaced."""
        data = b"".join(self.token_bytes(i, not skip_special) for i in ids)
        if drop_partial_char:  # (not final: the decoder keeps the incomplete end to itself)
            return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data)
        return data.decode("utf-8", errors="replace")


def _detect_special_tokens(tokens: list[str], token_to_id: dict[str, int], attrs: np.ndarray,
                           special: dict[str, int]) -> set[int]:
    """llama.cpp's token-text heuristics: EOT/EOM/FIM ids missing from the metadata, the control
    attribute for tokens that look like control tokens, 'unused' tokens and the end-of-generation set.
    Updates `attrs` and `special` in place; returns the EOG ids."""
    def mark_control(tid: int) -> None:
        attrs[tid] |= ATTR_CONTROL

    ranks: list[np.ndarray] = []  # each token text's place in llama.cpp's token_to_id walk, computed when needed

    def first_present(texts: Iterable[str]) -> int | None:
        present = [t for t in texts if t in token_to_id]
        if len(present) > 1:  # llama.cpp takes the spelling its std::unordered_map walks first
            if not ranks:
                walk = map_order([t.encode() for t in tokens])
                rank = np.zeros(len(tokens), np.int64)
                rank[walk] = np.arange(len(walk))
                ranks.append(rank)
            present.sort(key=lambda t: ranks[0][tokens.index(t)])  # (a repeated text's node: its first id's)
        return token_to_id[present[0]] if present else None

    for key, texts in (("eot", _EOT_TEXTS), *_AUTO_SPECIAL.items()):
        if key not in special:
            tid = first_present(texts)
            if tid is not None:
                special[key] = tid
                mark_control(tid)

    for i in np.nonzero(attrs & ATTR_CONTROL)[0].tolist():  # control tokens named "unused..." are unused
        if "unused" in tokens[i]:
            attrs[i] |= ATTR_UNUSED

    eog = {special[k] for k in ("fim_pad", "fim_rep", "fim_sep") if k in special}
    for t in _EOG_TEXTS:
        tid = token_to_id.get(t)
        if tid is not None:
            eog.add(tid)
            mark_control(tid)
    for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always printed
        if t in token_to_id:
            attrs[token_to_id[t]] = ATTR_USER_DEFINED
    eog |= {special[k] for k in ("eos", "eot", "eom") if k in special}

    texts = {t: token_to_id[t] for t in ("<|return|>", "<|call|>", "<|calls|>", "<|flush|>", "<|end|>",
                                          "<|tool_response>", "</s>") if token_to_id.get(t) in eog}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        eog.discard(texts["<|end|>"])  # harmony / solar-open: <|end|> ends a message, not the generation
        attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
    if "</s>" in texts and ("<|tool_response>" in texts or token_to_id.get("<|plamo:eos|>") in eog):
        # gemma4 / plamo: there </s> is text (an HTML tag), not the end of generation
        eog.discard(texts["</s>"])
        attrs[texts["</s>"]] = ATTR_NORMAL
    return eog


def _apply_model_attr_rules(gf: GGUFFile, tokens: list[str], token_to_id: dict[str, int], attrs: np.ndarray) -> None:
    """llama.cpp's per-model lstrip/rstrip attributes for special tokens (set by pre-tokenizer, architecture or model
    name)."""
    name = str(gf.get("general.name") or "").lower()
    pre, arch = str(gf.get("tokenizer.ggml.pre") or ""), str(gf.get("general.architecture") or "")
    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(a in arch for a in ("nomic-bert-moe",
                                                                                                       "jina-bert-v3")):
        if "<mask>" in token_to_id:
            attrs[token_to_id["<mask>"]] |= ATTR_LSTRIP
    elif "phi-3" in name or "phi3" in name:
        attrs[(attrs & _SPECIAL_ATTRS) != 0] |= ATTR_RSTRIP
        for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if t in token_to_id:
                i = token_to_id[t]
                attrs[i] = (attrs[i] | ATTR_RSTRIP) if on else (attrs[i] & ~ATTR_RSTRIP)
    elif "modern-bert" in name and "[MASK]" in token_to_id:
        attrs[token_to_id["[MASK]"]] |= ATTR_LSTRIP


class StreamDecoder:
    """Token ids in, text out; never half a UTF-8 character: incomplete bytes wait for the next
    token, and `flush` gives what is left (invalid bytes replaced).

    special: print control tokens' text. Off by default, like llama-cli / llama-completion output
    without --special (their pieces are empty then); user-defined tokens always print."""

    def __init__(self, tok: Tokenizer, special: bool = False):
        self.tok = tok
        self.special = special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tid: int) -> str:
        return self._dec.decode(self.tok.token_bytes(tid, self.special))

    def flush(self, drop_partial_char: bool = False) -> str:
        """What is left: the end of a character cut off (U+FFFD), or nothing with drop_partial_char."""
        s = "" if drop_partial_char else self._dec.decode(b"", final=True)
        self._dec.reset()
        return s
