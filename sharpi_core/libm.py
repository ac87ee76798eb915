"""The C library's float functions, where llama.cpp's arithmetic calls them and one ulp can decide a result (a
rope table, a sampler's cut): numpy's float32 log is not libm's logf (they differ by an ulp for about a fifth of
the floats in (0, 1]), nor its exp libm's expf (for about two fifths)."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math

import numpy as np


def _load(name: str, fallback):
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6"), name)
    except (OSError, AttributeError):
        return lambda x: np.float32(fallback(float(np.float32(x))))
    fn.argtypes, fn.restype = [ctypes.c_float], ctypes.c_float
    return lambda x: np.float32(fn(float(x)))


logf = _load("logf", math.log)  # float -> np.float32
log2f = _load("log2f", math.log2)


@functools.lru_cache(maxsize=None)
def _expf_array():
    """The CPU kernels' sharpi_expf_array (libm's expf over an array, 16 lanes at a time), or None where the library
    is not built."""
    from .kernels import cpu
    if not cpu.available():
        return None
    fn = cpu._symbols().sharpi_expf_array
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p], None
    return fn


def expf(x: np.ndarray) -> np.ndarray:
    """libm's expf of each element of a float32 array (a new array): llama.cpp's samplers call it, and numpy's float32
    exp is an ulp away for a good share of floats. Where the CPU kernels are not built, numpy's exp."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    fn = _expf_array()
    if fn is None:
        return np.exp(x)
    y = np.empty_like(x)
    fn(x.ctypes.data, x.size, y.ctypes.data)
    return y
