"""The C library's functions where llama.cpp calls them and their exact results matter: its float functions, where
one ulp can decide a result (a rope table, a sampler's cut): numpy's float32 log is not libm's logf (they differ by
an ulp for about a fifth of the floats in (0, 1]), nor its exp libm's expf (for about two fifths); and strtol /
strtof, which read a number at a text's start (metadata read from its text, byte tokens)."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import re

import numpy as np


def _load(name: str, fallback, nargs: int = 1):
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6"), name)
    except (OSError, AttributeError):
        return lambda *x: np.float32(fallback(*(float(np.float32(v)) for v in x)))
    fn.argtypes, fn.restype = [ctypes.c_float] * nargs, ctypes.c_float
    return lambda *x: np.float32(fn(*(float(v) for v in x)))


def _pow(x: float, y: float) -> float:
    try:
        return math.pow(x, y)
    except (OverflowError, ValueError):  # (C's powf gives inf or NaN there)
        return float(np.power(np.float32(x), np.float32(y)))


logf = _load("logf", math.log)  # float -> np.float32
log2f = _load("log2f", math.log2)
powf = _load("powf", _pow, 2)  # (float, float) -> np.float32: dynamic temperature's normalized entropy ** exponent


@functools.lru_cache(maxsize=None)
def _array_fn(name: str, argtypes=(ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p), restype=None):
    """A CPU kernels' function over a float32 array (by default (x, n, y)), or None where the library is not built."""
    from .kernels import cpu
    if not cpu.available():
        return None
    fn = getattr(cpu._symbols(), name)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def _each(name: str, x: np.ndarray, fallback) -> np.ndarray:
    """The kernels' `name` over each element of a float32 array (a new array), or numpy's `fallback`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    fn = _array_fn(name)
    if fn is None:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return fallback(x)
    y = np.empty_like(x)
    fn(x.ctypes.data, x.size, y.ctypes.data)
    return y


def expf(x: np.ndarray) -> np.ndarray:
    """libm's expf of each element of a float32 array (a new array): llama.cpp's samplers call it, and numpy's float32
    exp is an ulp away for a good share of floats. Where the CPU kernels are not built, numpy's exp."""
    return _each("sharpi_expf_array", x, np.exp)


def logf_array(x: np.ndarray) -> np.ndarray:
    """libm's logf of each element of a float32 array (typical's surprises: numpy's float32 log is an ulp off it for a
    fifth of the floats in (0, 1]). Where the CPU kernels are not built, numpy's log."""
    return _each("sharpi_logf_array", x, np.log)


def top_n_sigma_cut(vals: np.ndarray, n_sigma: float) -> np.float32:
    """max - n_sigma * std over the finite float32 logits `vals` (in the candidates' order), as llama.cpp's top-n-sigma
    computes it: a float sum one logit after another, float mean and deviation (ops.c's sharpi_top_n_sigma_cut); a
    float64 mean and deviation move the cut by ~1e-4 at n = 10, enough to keep or drop a logit beside it. Where the
    CPU kernels are not built, numpy's float32 running sums (the squares rounded to float before they are added: an
    ulp off now and then). -inf when no logit is finite (nothing is cut)."""
    x = np.ascontiguousarray(vals, dtype=np.float32)
    fn = _array_fn("sharpi_top_n_sigma_cut", (ctypes.c_void_p, ctypes.c_long, ctypes.c_float), ctypes.c_float)
    if fn is not None:
        return np.float32(fn(x.ctypes.data, x.size, float(np.float32(n_sigma))))
    live = x[x != -np.inf]
    if not live.shape[0]:
        return np.float32(-np.inf)
    n = np.float32(live.shape[0])
    mean = np.cumsum(live, dtype=np.float32)[-1] / n
    acc = np.cumsum(np.square((live - mean).astype(np.float64)).astype(np.float32), dtype=np.float32)[-1]
    return live.max() - np.float32(n_sigma) * np.sqrt(acc / n)


C_SPACE = " \t\n\v\f\r"  # C's isspace()
_C_INT = {10: re.compile(r"[+-]?[0-9]+"), 16: re.compile(r"[+-]?(?:0[xX](?=[0-9a-fA-F]))?[0-9a-fA-F]+")}
_C_FLOAT = re.compile(r"[+-]?(?:(?P<hex>0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?)|"
                      r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf(?:inity)?|nan(?:\([0-9A-Za-z_]*\))?)",
                      re.IGNORECASE)


def strtol(text: str, base: int = 10) -> int | None:
    """strtol(text, &end, base) for base 10 or 16: the number at the text's start (after C's white space; base 16
    with an optional 0x), clamped to a long; None where none begins it."""
    m = _C_INT[base].match(text.lstrip(C_SPACE))
    if not m:
        return None
    digits = m.group()
    magnitude = int(digits.lstrip("+-"), base)
    return min(max(-magnitude if digits[0] == "-" else magnitude, -(1 << 63)), (1 << 63) - 1)


def strtol32(text: str) -> int | None:
    """int32_t v = strtol(text, &end, 10), as llama.cpp's get_int32 reads a number from its text: cut to 32 bits."""
    v = strtol(text)
    return None if v is None else (v + (1 << 31)) % (1 << 32) - (1 << 31)


def strtof(text: str) -> float | None:
    """strtof(text, &end) as a float32 value (a Python float), or None where no number begins the text."""
    m = _C_FLOAT.match(text.lstrip(C_SPACE))
    if not m:
        return None
    t = m.group()
    if t.lstrip("+-")[:3].lower() == "nan":
        return float("nan")
    with np.errstate(over="ignore"):
        return float(np.float32(float.fromhex(t) if m.group("hex") else float(t)))
