"""Text from bytes as llama.cpp reads them: UTF-8, where each byte of an invalid sequence becomes one U+FFFD
(its unicode_cpts_from_utf8 steps over one byte at a time), which is what its tokenizer then sees. Python's
own `errors="replace"` replaces a cut-short sequence as one character, so it is not used for prompts. (Not
modelled: llama.cpp's decoder takes overlong forms and surrogates as code points, and its SPM tokenizer reads
the raw bytes, so invalid bytes become byte tokens for Gemma there.)"""
from __future__ import annotations

import re

_SURROGATES = re.compile("[\ud800-\udfff]")


def without_surrogates(text: str) -> str:
    """Lone surrogates (undecodable bytes that Python's surrogateescape kept, from argv, stdin or a file) as U+FFFD."""
    return text if text.isascii() else _SURROGATES.sub("\ufffd", text)


def text_from_bytes(data: bytes) -> tuple[str, int]:
    """(the text, how many bytes were not UTF-8)."""
    text = data.decode("utf-8", "surrogateescape")
    if text.isascii():
        return text, 0
    clean, n = _SURROGATES.subn("\ufffd", text)
    return clean, n
