"""The C library's float functions, where llama.cpp's arithmetic calls them and one ulp can decide a result (a
rope table, a sampler's cut): numpy's float32 log is not libm's logf (they differ by an ulp for about a fifth of
the floats in (0, 1])."""
from __future__ import annotations

import ctypes
import ctypes.util
import math

import numpy as np


def _load_logf():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6").logf
    except (OSError, AttributeError):
        return lambda x: np.float32(math.log(np.float32(x)))
    fn.argtypes, fn.restype = [ctypes.c_float], ctypes.c_float
    return lambda x: np.float32(fn(float(x)))


logf = _load_logf()  # float -> np.float32
