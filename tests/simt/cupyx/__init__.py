"""The part of cupyx that sharpi uses, over the emulated CuPy of tests/simt/cupy: pinned host memory
(plain numpy memory here: the emulated streams run their work at once, so nothing is asynchronous)."""
from __future__ import annotations

import numpy as _np


def empty_pinned(shape, dtype=_np.float32, order="C") -> _np.ndarray:
    return _np.empty(shape, dtype=dtype, order=order)
