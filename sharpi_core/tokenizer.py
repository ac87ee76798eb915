"""Tokenizers built from GGUF metadata, reproducing llama.cpp's token ids.

- `gpt2` (byte-level BPE; SmolLM2, Qwen2.5): the `tokenizers` library with the pre-tokenizer
  regex of the GGUF's `tokenizer.ggml.pre` variant.
- `llama` (SentencePiece; Gemma 3): llama.cpp's SPM algorithm, bigram merges by vocab score with
  byte fallback.
Special tokens (control and user-defined) are split out of the text first, like llama.cpp.
"""
from __future__ import annotations

import heapq
import re
from functools import lru_cache

import numpy as np

from .errors import SharpiError
from .gguf_file import GGUFFile

# llama.cpp token types (tokenizer.ggml.token_type)
T_NORMAL, T_UNKNOWN, T_CONTROL, T_USER_DEFINED, T_UNUSED, T_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes per `tokenizer.ggml.pre` (llama.cpp's llama-vocab.cpp lists the same).
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS = {
    "qwen2": [("split", _QWEN2_RE)],
    "smollm": [("digits", None), ("split", _GPT2_RE)],
    "gpt2": [("split", _GPT2_RE)],
    "default": [("split", _GPT2_RE)],
}

# Token texts llama.cpp treats as end-of-generation besides the declared EOS/EOT ids.
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>",
              "<｜end▁of▁sentence｜>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>"}


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-unicode map, inverted (unicode char -> byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class Tokenizer:
    def __init__(self, tokens: list[str], types: np.ndarray, scores: np.ndarray | None, model_type: str,
                 pre: str, merges: list[str] | None, bos_id, eos_id, add_bos: bool, add_eos: bool,
                 add_space_prefix: bool, chat_template: str | None, eot_id=None, eom_id=None, unk_id=None):
        self.tokens = tokens
        self.types = types
        self.n_vocab = len(tokens)
        self.model_type = model_type
        self.pre = pre
        self.bos_id, self.eos_id, self.unk_id = bos_id, eos_id, unk_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.add_space_prefix = add_space_prefix
        self.chat_template = chat_template
        self.token_to_id = {t: i for i, t in enumerate(tokens)}
        eog = {i for i in (eos_id, eot_id, eom_id) if i is not None}
        eog |= {self.token_to_id[t] for t in _EOG_TEXTS if t in self.token_to_id}
        self.eog_ids = frozenset(eog)
        # special tokens matched in raw text: control (only when parse_special) and user-defined (always)
        self._control = [i for i in np.nonzero(types == T_CONTROL)[0].tolist() if tokens[i]]
        self._user = [i for i in np.nonzero(types == T_USER_DEFINED)[0].tolist() if tokens[i]]
        self._special_re = {True: self._alternation(self._control + self._user),
                            False: self._alternation(self._user)}
        self._bytes_cache: dict[int, bytes] = {}
        if model_type == "gpt2":
            self._bpe = self._build_bpe(merges or [])
        else:
            self._scores = scores
            self._byte_ids = [self.token_to_id.get(f"<0x{b:02X}>") for b in range(256)]

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> "Tokenizer":
        model = gf.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise SharpiError(f"unsupported tokenizer model '{model}' (supported: gpt2, llama)")
        tokens = gf.require("tokenizer.ggml.tokens")
        types = gf.field_array("tokenizer.ggml.token_type")
        types = np.full(len(tokens), T_NORMAL, dtype=np.int32) if types is None else types.astype(np.int32)
        pre = gf.get("tokenizer.ggml.pre", "default") or "default"
        if model == "gpt2" and pre not in PRE_TOKENIZERS:
            raise SharpiError(f"unsupported pre-tokenizer '{pre}' (supported: {', '.join(PRE_TOKENIZERS)})")
        add_bos = gf.get("tokenizer.ggml.add_bos_token")
        return cls(
            tokens=tokens, types=types, scores=gf.field_array("tokenizer.ggml.scores"), model_type=model, pre=pre,
            merges=gf.get("tokenizer.ggml.merges") if model == "gpt2" else None,
            bos_id=gf.get("tokenizer.ggml.bos_token_id"), eos_id=gf.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(add_bos) if add_bos is not None else model == "llama",
            add_eos=bool(gf.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(gf.get("tokenizer.ggml.add_space_prefix", model == "llama")),
            chat_template=gf.get("tokenizer.chat_template"),
            eot_id=gf.get("tokenizer.ggml.eot_token_id"), eom_id=gf.get("tokenizer.ggml.eom_token_id"),
            unk_id=gf.get("tokenizer.ggml.unknown_token_id"),
        )

    def _alternation(self, ids: list[int]):
        if not ids:
            return None
        texts = sorted({self.tokens[i] for i in ids}, key=len, reverse=True)  # longest first
        return re.compile("|".join(re.escape(t) for t in texts))

    def _build_bpe(self, merges: list[str]):
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers
        vocab = self.token_to_id
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tk = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=False))
        steps = []
        for kind, pattern in PRE_TOKENIZERS[self.pre]:
            if kind == "digits":
                steps.append(pre_tokenizers.Digits(individual_digits=True))
            else:
                steps.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
        return tk

    # -- encoding ----------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        out: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        rx = self._special_re[parse_special]
        pos = 0
        first = True
        if rx is not None:
            for m in rx.finditer(text):
                if m.start() > pos:
                    out += self._encode_plain(text[pos:m.start()], first)
                out.append(self.token_to_id[m.group(0)])
                pos, first = m.end(), False
        if pos < len(text):
            out += self._encode_plain(text[pos:], first)
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _encode_plain(self, text: str, first: bool) -> list[int]:
        if self.model_type == "gpt2":
            return self._bpe.encode(text, add_special_tokens=False).ids
        if self.add_space_prefix and first:
            text = " " + text
        return self._spm(text.replace(" ", "\u2581"))

    def _spm(self, text: str) -> list[int]:
        """llama.cpp's SPM: merge the adjacent pair whose merged text has the best score, leftmost first."""
        if not text:
            return []
        syms = list(text)  # one symbol per code point
        n = len(syms)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        alive = [True] * n
        vocab, scores = self.token_to_id, self._scores
        heap: list[tuple[float, int, int, str]] = []

        def push(i: int, j: int) -> None:
            s = syms[i] + syms[j]
            tid = vocab.get(s)
            if tid is not None:
                heapq.heappush(heap, (-float(scores[tid]), i, j, s))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, i, j, s = heapq.heappop(heap)
            if not (alive[i] and alive[j]) or nxt[i] != j or syms[i] + syms[j] != s:
                continue  # stale: one side was merged since
            syms[i] = s
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] != -1:
                prev[nxt[j]] = i
            if prev[i] != -1:
                push(prev[i], i)
            if nxt[i] != -1:
                push(i, nxt[i])
        out: list[int] = []
        i = 0
        while i != -1:
            tid = vocab.get(syms[i])
            if tid is not None:
                out.append(tid)
            else:  # byte fallback
                for b in syms[i].encode("utf-8"):
                    bid = self._byte_ids[b]
                    out.append(bid if bid is not None else (self.unk_id if self.unk_id is not None else 0))
            i = nxt[i]
        return out

    # -- decoding ----------------------------------------------------------------------------
    def token_text(self, tid: int) -> str:
        return self.tokens[tid]

    def is_control(self, tid: int) -> bool:
        return int(self.types[tid]) == T_CONTROL

    def token_bytes(self, tid: int, special: bool = False) -> bytes:
        """The bytes token `tid` prints as (llama.cpp's token_to_piece); control tokens print
        only with special=True."""
        key = tid if not special else -1 - tid
        b = self._bytes_cache.get(key)
        if b is not None:
            return b
        t, ty = self.tokens[tid], int(self.types[tid])
        if ty == T_CONTROL:
            b = t.encode("utf-8") if special else b""
        elif ty == T_USER_DEFINED or ty == T_UNKNOWN:
            b = t.encode("utf-8")
        elif self.model_type == "gpt2":
            dec = _byte_decoder()
            b = bytes(dec[ch] for ch in t) if all(ch in dec for ch in t) else t.encode("utf-8")
        elif ty == T_BYTE:
            b = bytes([int(t[3:5], 16)])
        else:
            b = t.replace("\u2581", " ").encode("utf-8")
        self._bytes_cache[key] = b
        return b

    def decode(self, ids, skip_special: bool = True) -> str:
        return b"".join(self.token_bytes(int(i), special=not skip_special) for i in ids).decode("utf-8", errors="replace")


class StreamDecoder:
    """Token ids in, text out, never half a UTF-8 character: incomplete bytes wait for the next token."""

    def __init__(self, tok: Tokenizer, special: bool = False):
        self.tok = tok
        self.special = special
        self._pending = b""

    def push(self, tid: int) -> str:
        buf = self._pending + self.tok.token_bytes(tid, self.special)
        cut = _complete_prefix_len(buf)
        self._pending = buf[cut:]
        return buf[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        s, self._pending = self._pending.decode("utf-8", errors="replace"), b""
        return s


def _complete_prefix_len(b: bytes) -> int:
    """Length of the longest prefix of b that does not end inside a UTF-8 sequence."""
    n = len(b)
    for back in range(1, min(4, n) + 1):
        c = b[n - back]
        if c & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        need = 1 if c < 0x80 else 2 if c >> 5 == 0b110 else 3 if c >> 4 == 0b1110 else 4 if c >> 3 == 0b11110 else 1
        return n if back >= need else n - back
    return n
