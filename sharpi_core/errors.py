"""User-facing errors: the CLI prints `error: <message>` and exits with `exit_code`."""
import unicodedata

# what would break an error's one line: control characters (newline, NUL, escape...), line and paragraph separators
_BREAKS = frozenset(("Cc", "Zl", "Zp"))


def one_line(text: str) -> str:
    """text with the characters that would break its line (or drive the terminal) escaped as Python writes them
    ('\\n', '\\x00', '\\u2028'); everything else as it is (an undecodable argument byte, held as a lone surrogate,
    still goes out as the byte it was)."""
    if text.isprintable():
        return text
    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in _BREAKS else c
                   for c in text)


class SharpiError(Exception):
    """A problem with the user's input (file, flag, model) rather than a bug in sharpi."""

    exit_code = 1


class UsageError(SharpiError):
    """Invalid flags or flag combinations (llama.cpp exits 2 for these too)."""

    exit_code = 2
