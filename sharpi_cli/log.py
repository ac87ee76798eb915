"""The run's log on stderr (and --log-file), as llama.cpp's log writes it: -lv, --log-disable, --log-prefix."""
from __future__ import annotations

import os
import sys
import time

from .options import FALSEY, TRUTHY


_LOG_ON = [True]  # --log-disable: no information or warnings on stderr (errors still)
_LOG_FILE: list = [None]  # --log-file: the open file the log also goes to
_LOG_LEVEL = [3]  # -lv: llama.cpp's threshold (2: warnings only, 3: information too)
_LOG_FMT: list = [None]  # --log-prefix: (timestamps, colors) for the lines' prefixes; None: no prefix
_T0 = time.perf_counter()  # (--log-timestamps: the time since the start)


def log(msg: str) -> None:
    warning = msg.startswith("warning:")
    if _LOG_ON[0] and (2 if warning else 3) <= _LOG_LEVEL[0]:
        (head, tail), (file_head, _) = log_prefix("W" if warning else "I")
        try:
            print(head + msg + tail, file=sys.stderr, flush=True)
        except OSError:  # stderr unwritable (2>/dev/full): the run goes on without its log, as llama.cpp's
            pass
        log_to_file(file_head + msg)


def log_to_file(line: str) -> None:
    """A line into --log-file's file; one that cannot be written (a full disk) is given up with a warning on
    stderr, and the run goes on."""
    f = _LOG_FILE[0]
    if f is None:
        return
    try:
        f.write(line + "\n")
    except OSError as e:
        _LOG_FILE[0] = None
        try:
            f.close()
        except OSError:
            pass
        log(f"warning: cannot write the log file {f.name}: {e.strerror}; the log goes on without it")


def log_prefix(level: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """What a log line of level I, W or E starts and ends with on stderr (colored) and in --log-file (not), as
    llama.cpp's log writes them: [M.SS.mmm.uuu ]L message."""
    if _LOG_FMT[0] is None:
        return ("", ""), ("", "")
    stamps, colors = _LOG_FMT[0]
    us = int((time.perf_counter() - _T0) * 1e6)
    out = []
    for c in ((lambda code: f"\033[{code}m") if colors else (lambda code: ""), lambda code: ""):
        head = (f"{c(34)}{us // 60_000_000}.{us // 1_000_000 % 60:02d}.{us // 1000 % 1000:03d}.{us % 1000:03d}"
                f"{c(0)} ") if stamps else ""
        out.append((head + f"{c(32)}I {c(0)}", "") if level == "I" else
                   (head + f"{c(35 if level == 'W' else 31)}{level} ", c(0)))
    return out[0], out[1]


def log_colors(value: str) -> bool:
    """--log-colors on / off / auto: auto colors when stdout or stderr is a terminal, unless NO_COLOR or TERM=dumb."""
    if value in TRUTHY or value in FALSEY:
        return value in TRUTHY
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return any(f is not None and hasattr(f, "isatty") and f.isatty() for f in (sys.stdout, sys.stderr))


def configure(on: bool, level: int, prefix: tuple[bool, bool] | None) -> None:
    """A run's --log-disable (on), -lv (level) and --log-prefix ((timestamps, colors), or None: no prefix)."""
    _LOG_ON[0], _LOG_LEVEL[0], _LOG_FMT[0] = on, level, prefix


def write_to(path: str) -> None:
    """--log-file: the log also goes to path, written anew (OSError where it cannot be opened). A file name that is
    not UTF-8 goes in as stderr shows it (`\\udcff`), not as an error while the log reports one."""
    _LOG_FILE[0] = open(path, "w", encoding="utf-8", errors="backslashreplace", buffering=1)


def reset() -> None:
    """The defaults again and the log file closed, at a run's end."""
    configure(True, 3, None)
    f, _LOG_FILE[0] = _LOG_FILE[0], None
    if f is not None:
        try:
            f.close()
        except OSError:  # (what it could not flush: the warning came with the failed line)
            pass


def shown() -> bool:
    """Whether information reaches stderr (--log-disable: no)."""
    return _LOG_ON[0]
