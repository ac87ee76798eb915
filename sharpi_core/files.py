"""Output files written whole or not at all, without replacing what a path names that is not a plain file."""
from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator


def plain_target(path: str | os.PathLike) -> tuple[Path, bool]:
    """(the file a write to `path` reaches: symbolic links followed, whether it is a plain file or is yet to be)."""
    target = Path(os.path.realpath(path))
    try:
        return target, stat.S_ISREG(target.stat().st_mode)
    except FileNotFoundError:
        return target, True


@contextmanager
def replaced(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file for the new contents of `path`. A plain file (or none yet) is written beside it and renamed
    over it at the end, so that a write that fails leaves the old file; a device or FIFO is written in place (as
    llama.cpp's fopen does: a rename would replace the node itself), and a symbolic link's target is written. A
    replaced file keeps its permission bits, as one written in place would."""
    target, plain = plain_target(path)
    if not plain:
        with open(target, "wb") as f:
            yield f
        return
    try:
        old = target.stat()
    except FileNotFoundError:
        old = None
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            if old is not None:  # the new file keeps the old one's permissions (and group, where ours may set it)
                try:
                    os.fchown(f.fileno(), -1, old.st_gid)
                except OSError:
                    pass
                os.fchmod(f.fileno(), stat.S_IMODE(old.st_mode))
            yield f
        os.replace(tmp, target)
    finally:  # (an interrupt too)
        tmp.unlink(missing_ok=True)
