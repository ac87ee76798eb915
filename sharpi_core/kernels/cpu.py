"""Quantized GGUF matmuls on the CPU through a small C library compiled on first use.

`qmatmul(x, raw, qtype, n, k)` computes x @ dequant(raw).T with the weight left in its GGUF block
format (a zero-copy view of the mmap): every block is expanded to fp32 in registers and multiplied
with FMAs, so the activations stay fp32 and the result equals the gguf.quants reference within fp32
rounding. Up to 8 activation rows share each read of a block (decode and speculative verify); long
inputs (prefill) dequantize tiles of rows into an L2-sized fp32 buffer and hand them to torch's
sgemm.

The library is built with `gcc -O3 -march=native -fopenmp` into
`~/.cache/sharpi/kernels/qmatmul-<hash>.so` (hash of source, flags, compiler and CPU; written to a
temporary name and renamed into place, so concurrent processes never load half a file). Without a
compiler, or on a CPU without AVX-512, `available()` is False and `unavailable_reason()` says why;
callers then dequantize and use torch.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import gguf
import torch

Q = gguf.GGMLQuantizationType

SUPPORTED: frozenset = frozenset(
    {Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)

SOURCE = Path(__file__).with_name("qmatmul.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
_ABI = 1
_REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl")

# Rows of x at or above which qmatmul dequantizes tiles and uses torch's sgemm (prefill).
GEMM_MIN_ROWS = 24
# fp32 bytes of one dequantized tile (kept within the L2 of the cores running the sgemm).
GEMM_TILE_BYTES = 1 << 20

_BLOCK = {  # type -> (elements, bytes) per block
    Q.F16: (32, 64), Q.BF16: (32, 64), Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q5_0: (32, 22),
    Q.Q5_1: (32, 24), Q.Q8_0: (32, 34), Q.Q4_K: (256, 144), Q.Q5_K: (256, 176), Q.Q6_K: (256, 210),
}

_lock = threading.Lock()
_state: dict = {"tried": False, "lib": None, "reason": None, "path": None, "build_s": None}
_qmm = None  # ctypes functions, bound once loaded
_dqr = None


def kernel_dir() -> Path:
    base = os.environ.get("SHARPI_KERNEL_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sharpi" / "kernels"


def _cpu_info() -> tuple[str, set[str]]:
    """(identity string, flag set) of this CPU from /proc/cpuinfo ('' and empty set if unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = val.strip()
        elif key == "flags" and not flags:
            flags = set(val.split())
        if model and flags:
            break
    return model + "|" + " ".join(sorted(flags)), flags


def _compiler() -> str | None:
    cc = os.environ.get("SHARPI_CC")
    if cc:
        return shutil.which(cc) or (cc if os.path.isfile(cc) else None)
    return shutil.which("gcc") or shutil.which("cc")


def library_path() -> Path | None:
    """Where the compiled library for this source/CPU/compiler lives (None without a compiler)."""
    cc = _compiler()
    if cc is None:
        return None
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        ver = cc
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), ver.encode(), _cpu_info()[0].encode(),
                 str(_ABI).encode()):
        h.update(part)
        h.update(b"\0")
    return kernel_dir() / f"qmatmul-{h.hexdigest()[:20]}.so"


def _build(cc: str, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".qmatmul-", suffix=".so.part", dir=dest.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            msg = (r.stderr or r.stdout).strip().splitlines()
            raise RuntimeError(f"{Path(cc).name} failed (exit {r.returncode}): " + " | ".join(msg[-6:]))
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)  # atomic: other processes see no file or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(lib) -> None:
    global _qmm, _dqr
    c_long, c_int, c_void_p = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    f = lib.sharpi_qmatmul
    f.argtypes = [c_int, c_void_p, c_long, c_long, c_long, c_void_p, c_long, c_void_p, c_int]
    f.restype = c_int
    g = lib.sharpi_dequant_rows
    g.argtypes = [c_int, c_void_p, c_long, c_void_p, c_long, c_long, c_long, c_void_p, c_int]
    g.restype = c_int
    _qmm, _dqr = f, g


def _load():
    with _lock:
        if _state["tried"]:
            return _state["lib"]
        _state["tried"] = True
        try:
            if platform.machine().lower() not in ("x86_64", "amd64"):
                raise RuntimeError(f"the C kernels need an x86-64 CPU with AVX-512 (this is {platform.machine()})")
            flags = _cpu_info()[1]
            missing = [f for f in _REQUIRED_CPU_FLAGS if f not in flags]
            if not flags or missing:
                raise RuntimeError("the C kernels need AVX-512 (CPU lacks " + (", ".join(missing) or "a readable /proc/cpuinfo") + ")")
            cc = _compiler()
            if cc is None:
                raise RuntimeError("no C compiler found (install gcc, or set SHARPI_CC)")
            path = library_path()
            if not path.is_file():
                t0 = time.perf_counter()
                _build(cc, path)
                _state["build_s"] = time.perf_counter() - t0
            lib = ctypes.CDLL(str(path))
            if lib.sharpi_abi_version() != _ABI:
                raise RuntimeError(f"{path}: unexpected ABI version")
            _bind(lib)
            _state["lib"], _state["path"] = lib, path
        except Exception as e:  # never raise from available()
            _state["reason"] = f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)
        return _state["lib"]


def available() -> bool:
    """True when the C library is compiled and loaded (builds it on the first call; never raises)."""
    return (_state["lib"] if _state["tried"] else _load()) is not None


def unavailable_reason() -> str | None:
    available()
    return _state["reason"]


def build_info() -> dict:
    """Path of the loaded library and how long this process spent compiling it (None: cached)."""
    available()
    return {"path": _state["path"], "build_s": _state["build_s"], "reason": _state["reason"]}


def _row_bytes(raw: torch.Tensor, qtype, n: int, k: int) -> int:
    be, bb = _BLOCK[qtype]
    if k % be:
        raise ValueError(f"{qtype.name}: K={k} is not a multiple of the block size {be}")
    rb = k // be * bb
    if raw.numel() * raw.element_size() != n * rb or not raw.is_contiguous():
        raise ValueError(f"raw weight must be a contiguous [{n}, {rb}]-byte {qtype.name} tensor, "
                         f"got {tuple(raw.shape)} {raw.dtype}")
    return rb


def qmatmul(x: torch.Tensor, raw: torch.Tensor, qtype, n: int, k: int,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """x fp32 [T, K] (contiguous) @ dequant(raw [N, row_bytes]).T -> fp32 [T, N] (written into `out` if given)."""
    if _qmm is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    if qtype not in _BLOCK:
        raise ValueError(f"qmatmul: unsupported type {getattr(qtype, 'name', qtype)}")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous float32 [T, {k}] tensor, got {tuple(x.shape)} {x.dtype}")
    rb = _row_bytes(raw, qtype, n, k)
    t = x.shape[0]
    if out is None:
        out = torch.empty((t, n), dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (t, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 [{t}, {n}] tensor")
    if t == 0:
        return out
    if t >= GEMM_MIN_ROWS:
        return _gemm(x, raw, qtype, n, k, rb, out)
    if _qmm(int(qtype), raw.data_ptr(), rb, n, k, x.data_ptr(), t, out.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"qmatmul: kernel rejected {qtype.name} [{n}, {k}]")
    return out


def _gemm(x, raw, qtype, n, k, rb, out):
    """Long inputs: dequantize tiles of weight rows (exact) and let torch's sgemm multiply them."""
    tile = max(16, GEMM_TILE_BYTES // (4 * k) // 16 * 16)
    tile = min(tile, n)
    buf = torch.empty((tile, k), dtype=torch.float32)
    base, code, nth = raw.data_ptr(), int(qtype), torch.get_num_threads()
    for n0 in range(0, n, tile):
        m = min(tile, n - n0)
        if _dqr(code, base + n0 * rb, rb, None, 0, m, k, buf.data_ptr(), nth):
            raise ValueError(f"qmatmul: kernel rejected {qtype.name} [{n}, {k}]")
        torch.mm(x, buf[:m].t(), out=out[:, n0:n0 + m])
    return out


def dequant_rows(raw: torch.Tensor, qtype, rows: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 [R, K]: rows `rows` (int64 [R]) of raw [N, row_bytes], dequantized exactly like gguf.quants."""
    if _dqr is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    if qtype not in _BLOCK:
        raise ValueError(f"dequant_rows: unsupported type {getattr(qtype, 'name', qtype)}")
    n = raw.shape[0]
    rb = _row_bytes(raw, qtype, n, k)
    rows = rows.reshape(-1).to(torch.int64).contiguous()
    r = rows.numel()
    out = torch.empty((r, k), dtype=torch.float32)
    if r == 0:
        return out
    lo, hi = int(rows.min()), int(rows.max())
    if lo < 0 or hi >= n:
        raise IndexError(f"row index out of range [0, {n}): {lo if lo < 0 else hi}")
    if _dqr(int(qtype), raw.data_ptr(), rb, rows.data_ptr(), 0, r, k, out.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"dequant_rows: kernel rejected {qtype.name} [{n}, {k}]")
    return out
