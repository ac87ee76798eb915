"""A stand-in for CuPy on machines without a GPU: device arrays are numpy arrays in host memory, and
`RawModule` builds the kernel source with the host C++ compiler against tests/simt/simt.hpp, which
runs every GPU thread as a fiber. The real sharpi_core.backends.cuda and the real cuda/*.cu kernels
run on it unchanged: put tests/simt first on sys.path (tests/test_simt.py does, in a subprocess that
runs the GPU test files).

Only the part of CuPy that sharpi and its GPU tests use is here, and it is stricter than numpy where
CuPy is: a numpy array given to a kernel or mixed into device arithmetic is a TypeError; kernel
arguments are checked against the kernel's C signature (CuPy passes a Python int as int64 and does
not check: a mismatch is garbage on a GPU); a fresh `empty` array holds 0xff bytes (NaN as floats),
as uninitialised device memory would hold something; every allocation has 256 guard bytes of 0xff on
both sides: a write there is an error after each launch that was given the array, a read shows as NaN.

Stream capture (`Stream.begin_capture` / `end_capture` -> `Graph`, `Graph.launch`) records the
RawKernel launches made on the capturing stream, arguments fixed then, and replays them at each
launch. Stricter than CuPy, whose relaxed capture mode would allow them: while a stream captures,
allocating, transferring or computing with device arrays (numpy's operations, which would run now
rather than at replay) is an error, and a replay whose arrays were freed since the capture is one
(a GPU would write into memory the pool may have handed out again).
"""
from __future__ import annotations

import bisect
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path

import numpy as _np

__version__ = "13.0.0+simt"
_SIMT_HPP = Path(__file__).resolve().parents[1] / "simt.hpp"
_GUARD = 256
_ALIGN = 256  # cudaMalloc's alignment
_GUARD_BYTE = 0xFF  # NaN as floats: a read past an allocation shows in the results too
_lock = threading.RLock()
_SMEM_OPTIN = 232448  # an H100's / H200's opt-in shared memory per block

# dtypes and constants, as CuPy re-exports them
float16, float32, float64 = _np.float16, _np.float32, _np.float64
int8, int16, int32, int64 = _np.int8, _np.int16, _np.int32, _np.int64
uint8, uint16, uint32, uint64 = _np.uint8, _np.uint16, _np.uint32, _np.uint64
complex64, complex128, bool_ = _np.complex64, _np.complex128, _np.bool_
nan, inf, pi, newaxis = _np.nan, _np.inf, _np.pi, _np.newaxis
dtype = _np.dtype


class _Pointer:
    def __init__(self, ptr: int):
        self.ptr = ptr


# allocation id -> (buffer, start, nbytes); the buffer is what device arrays are views of
_allocations: "weakref.WeakValueDictionary[int, _np.ndarray]" = weakref.WeakValueDictionary()
_info: dict[int, tuple[int, int, int]] = {}  # allocation id -> (start of the array in it, its bytes, its address)


_capturing: list = []  # the stream capturing now, if any


def _not_capturing(what: str) -> None:
    if _capturing:
        raise RuntimeError(f"{what} while a stream captures a graph (a graph records kernel launches only)")


class ndarray(_np.ndarray):
    """A device array: a numpy array whose memory came from this module's allocator."""

    __array_priority__ = 100.0

    @property
    def data(self):  # CuPy's MemoryPointer, as far as `.ptr` goes
        return _Pointer(self.__array_interface__["data"][0])

    @property
    def device(self):
        return Device()

    def get(self, stream=None, order="C", out=None):
        _not_capturing("a device -> host copy")
        return _np.array(self.view(_np.ndarray), order=order, copy=True)

    def set(self, arr, stream=None):
        _not_capturing("a host -> device copy")
        if isinstance(arr, ndarray):
            raise TypeError("ndarray.set takes a numpy array")
        if not isinstance(arr, _np.ndarray) or arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"ndarray.set: a numpy array of shape {self.shape} and dtype {self.dtype} "
                             f"(got {getattr(arr, 'shape', type(arr))} {getattr(arr, 'dtype', '')})")
        if not self.flags.c_contiguous:
            raise ValueError("ndarray.set: the device array must be contiguous")
        _np.copyto(self.view(_np.ndarray), arr)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _not_capturing(f"numpy's {ufunc.__name__} on a device array")
        _reject_host(inputs, kwargs, ufunc.__name__)
        r = getattr(ufunc, method)(*_unwrap(inputs), **_unwrap(kwargs))
        out = kwargs.get("out")
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(r)

    def __array_function__(self, func, types, args, kwargs):
        _not_capturing(f"numpy's {func.__name__} on a device array")
        _reject_host(args, kwargs, func.__name__)
        return _wrap(func(*_unwrap(args), **_unwrap(kwargs)))

    def view(self, *args, **kwargs):
        # CuPy changes the size of the element type only of a C-contiguous array (numpy, of any array whose
        # last axis is contiguous): a view that numpy takes could fail on a GPU
        dtype = kwargs.get("dtype", args[0] if args else None)
        if (dtype is not None and not (isinstance(dtype, type) and issubclass(dtype, _np.ndarray))
                and _np.dtype(dtype).itemsize != self.dtype.itemsize and not self.flags.c_contiguous):
            raise ValueError("To change to a dtype of a different size, the array must be C-contiguous")
        return super().view(*args, **kwargs)

    def copy(self, order="C"):
        return _copy_to_device(self.view(_np.ndarray))

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        if not copy and _np.dtype(dtype) == self.dtype:
            return self
        return _copy_to_device(self.view(_np.ndarray).astype(dtype, casting=casting))

    def __repr__(self):
        return "device " + repr(self.view(_np.ndarray))

    def __iter__(self):
        raise TypeError("iterating a device array (CuPy arrays are not iterable element by element here)")

    def __float__(self):
        return float(self.view(_np.ndarray))

    def __int__(self):
        return int(self.view(_np.ndarray))

    def __bool__(self):
        return bool(self.view(_np.ndarray))

    def __index__(self):
        return int(self.view(_np.ndarray))

    def tolist(self):
        return self.view(_np.ndarray).tolist()


def _unwrap(x):
    if isinstance(x, ndarray):
        return x.view(_np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def _reject_host(args, kwargs, what: str):
    for v in list(args) + list(kwargs.values()):
        vs = v if isinstance(v, (list, tuple)) else (v,)
        for a in vs:
            if isinstance(a, _np.ndarray) and not isinstance(a, ndarray):
                raise TypeError(f"{what}: Unsupported type {type(a)} (numpy array where CuPy wants a device array)")


_memory = [0]  # a count of allocations made and freed: the kernels' table of live ones is rebuilt when it moved
_lib_memory: dict[int, tuple] = {}  # id(kernel library) -> (the table it reads, the count it was made at)


def _memory_changed() -> None:
    _memory[0] += 1


def _forget(key: int) -> None:
    _info.pop(key, None)
    _memory_changed()


_index: list = [-1, None, None, None]  # (the count it was made at, bases, ends, allocation ids), sorted by base


def _live() -> tuple[list, list, list]:
    """The live allocations' arrays as [base, end) addresses sorted by base, and their allocation ids
    (made again when the count of allocations made and freed moved; a launch looks its pointers up here)."""
    with _lock:
        version = _memory[0]
        if _index[0] != version:
            live = sorted((info[2], info[2] + max(info[1], 1), key) for key, info in list(_info.items())
                          if key in _allocations)
            _index[:] = [version, [b for b, _, _ in live], [e for _, e, _ in live], [k for _, _, k in live]]
        return _index[1], _index[2], _index[3]


def _memory_table() -> _np.ndarray:
    """The live allocations' arrays as sorted [base, end) address pairs, uint64 [n, 2]."""
    bases, ends, _ = _live()
    return _np.array([bases, ends], dtype=_np.uint64).T.copy().reshape(-1, 2)


def _alloc(shape, dt, fill: int | None = 0xFF) -> ndarray:
    _not_capturing("an allocation")
    dt = _np.dtype(dt)
    shape = (int(shape),) if _np.isscalar(shape) else tuple(int(s) for s in shape)
    nbytes = int(_np.prod(shape, dtype=_np.int64)) * dt.itemsize
    # zeros come from calloc: pages nobody touches stay unmapped (a test's KV cache is gigabytes, mostly unused)
    buf = (_np.zeros if fill == 0 else _np.empty)(nbytes + 2 * _GUARD + _ALIGN, dtype=_np.uint8)
    base = buf.ctypes.data
    start = -(-(base + _GUARD) // _ALIGN) * _ALIGN - base
    buf[:start] = _GUARD_BYTE
    buf[start + nbytes:] = _GUARD_BYTE
    if fill is not None and fill != 0:
        buf[start:start + nbytes] = fill
    _allocations[id(buf)] = buf
    _info[id(buf)] = (start, nbytes, base + start)
    _memory_changed()
    weakref.finalize(buf, _forget, id(buf))
    return buf[start:start + nbytes].view(dt).reshape(shape).view(ndarray)


def _root(a: _np.ndarray):
    b = a
    while b is not None:
        if isinstance(b, _np.ndarray) and id(b) in _allocations and _allocations.get(id(b)) is b:
            return b
        b = getattr(b, "base", None)
    return None


def _check_guards(a: ndarray, where: str) -> None:
    buf = _root(a)
    if buf is None:
        return
    start, nbytes, _ = _info[id(buf)]
    head, tail = buf[:start], buf[start + nbytes:]
    if (head != _GUARD_BYTE).any() or (tail != _GUARD_BYTE).any():
        raise RuntimeError(f"{where}: a kernel wrote outside an allocation of {nbytes} bytes")


def _wrap(r):
    if isinstance(r, ndarray):
        return r
    if isinstance(r, _np.ndarray):
        return _copy_to_device(r)
    if isinstance(r, tuple):
        return tuple(_wrap(v) for v in r)
    if isinstance(r, list):
        return [_wrap(v) for v in r]
    return r


def _copy_to_device(a, dt=None) -> ndarray:
    a = _np.asarray(a, dtype=dt)
    out = _alloc(a.shape, a.dtype, fill=None)
    out.view(_np.ndarray)[...] = a
    return out


# ---- array creation / transfer ---------------------------------------------------------------------

def asarray(a, dtype=None, order=None, *, blocking=False) -> ndarray:
    if isinstance(a, ndarray):
        if dtype is None or _np.dtype(dtype) == a.dtype:
            return a
        return a.astype(dtype)
    return _copy_to_device(a, dtype)


def array(a, dtype=None, copy=True, order="K", ndmin=0) -> ndarray:
    if isinstance(a, ndarray) and not copy:
        return asarray(a, dtype)
    return _copy_to_device(a.view(_np.ndarray) if isinstance(a, ndarray) else a, dtype)


def ascontiguousarray(a, dtype=None) -> ndarray:
    if not isinstance(a, ndarray):
        raise TypeError(f"ascontiguousarray: Unsupported type {type(a)}")
    if a.flags.c_contiguous and (dtype is None or _np.dtype(dtype) == a.dtype):
        return a
    return _copy_to_device(a.view(_np.ndarray), dtype)


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True) -> _np.ndarray:
    _not_capturing("a device -> host copy")
    if isinstance(a, ndarray):
        r = _np.array(a.view(_np.ndarray), order=order, copy=True)
    else:
        r = _np.asarray(a, order=order)
    if out is not None:
        out[...] = r
        return out
    return r


def empty(shape, dtype=float, order="C") -> ndarray:
    return _alloc(shape, dtype)


def zeros(shape, dtype=float, order="C") -> ndarray:
    return _alloc(shape, dtype, fill=0)


def ones(shape, dtype=float, order="C") -> ndarray:
    a = _alloc(shape, dtype)
    a.view(_np.ndarray)[...] = 1
    return a


def full(shape, fill_value, dtype=None, order="C") -> ndarray:
    a = _alloc(shape, dtype if dtype is not None else _np.asarray(fill_value).dtype)
    a.view(_np.ndarray)[...] = fill_value
    return a


def empty_like(a, dtype=None) -> ndarray:
    return _alloc(a.shape, dtype or a.dtype)


def zeros_like(a, dtype=None) -> ndarray:
    return _alloc(a.shape, dtype or a.dtype, fill=0)


def arange(*args, dtype=None) -> ndarray:
    return _copy_to_device(_np.arange(*args, dtype=dtype))


def get_array_module(*args):
    import sys  # noqa: PLC0415
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else _np


def __getattr__(name: str):
    # other array functions: numpy's, on device arrays only, results on the device
    f = getattr(_np, name)
    if not callable(f) or isinstance(f, type):
        return f

    def device_fn(*args, **kwargs):
        _reject_host(args, kwargs, name)
        return _wrap(f(*_unwrap(args), **_unwrap(kwargs)))
    device_fn.__name__ = name
    return device_fn


# ---- the cuda namespace ----------------------------------------------------------------------------

class _Runtime:
    class CUDARuntimeError(RuntimeError):
        pass

    @staticmethod
    def getDeviceCount() -> int:
        return 1

    @staticmethod
    def getDeviceProperties(device: int) -> dict:
        return {"name": b"sharpi SIMT emulator (CPU)", "major": 9, "minor": 0,
                "memoryBusWidth": 6144,  # an H200's, for the bandwidth maths (no memoryClockRate: CUDA 13's)
                "sharedMemPerBlock": 48 * 1024, "sharedMemPerBlockOptin": _SMEM_OPTIN,
                "totalGlobalMem": 1 << 34, "multiProcessorCount": 1}


class Device:
    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)
        self.attributes = {"MaxSharedMemoryPerBlockOptin": _SMEM_OPTIN, "MaxSharedMemoryPerBlock": 48 * 1024,
                           "MemoryClockRate": 2_619_000, "GlobalMemoryBusWidth": 6144, "MultiProcessorCount": 1,
                           "L2CacheSize": 50 << 20}
        self.compute_capability = "90"

    def synchronize(self):
        pass

    def use(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_current = threading.local()


class Stream:
    null: "Stream"

    def __init__(self, null=False, non_blocking=False, ptds=False):
        self.ptr = 0 if null else id(self)
        if not null:
            _streams[self.ptr] = self

    def __enter__(self):
        stack = getattr(_current, "streams", None)
        if stack is None:
            stack = _current.streams = []
        stack.append(self)
        return self

    def __exit__(self, *exc):
        _current.streams.pop()
        return False

    def use(self):
        _current.default = self
        return self

    def synchronize(self):
        pass

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event):
        pass

    @property
    def done(self):
        return True

    def begin_capture(self, mode=None):
        if self.ptr == 0:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if _capturing:
            raise RuntimeError("a stream is capturing already")
        self._record = []
        _capturing.append(self)

    def is_capturing(self) -> bool:
        return bool(_capturing) and _capturing[0] is self

    def end_capture(self) -> "Graph":
        if not self.is_capturing():
            raise RuntimeError("cudaErrorIllegalState: the stream is not capturing")
        _capturing.clear()
        return Graph(self._record)


class Graph:
    """Recorded kernel launches: (kernel, ctypes arguments, launch dimensions, weak references to the
    allocations of the array arguments)."""

    def __init__(self, record: list):
        self._record = record

    def launch(self, stream=None):
        _not_capturing("a graph launch")
        for kernel, vals, dims, roots in self._record:
            if any(r() is None for r in roots):
                raise RuntimeError(f"graph launch: kernel {kernel.name} was captured with an array that has "
                                   "been freed since (the graph would write into reused memory)")
            # the kernel's shared-memory limit as it is now, not at the capture: whether the driver checks a
            # replayed launch against a limit lowered since is not documented, so a lowered one is an error
            grid, block, smem, _ = dims
            kernel._run(vals, (grid, block, smem, int(kernel.max_dynamic_shared_size_bytes)), [r() for r in roots])


Stream.null = Stream(null=True)


def _get_current_stream():
    stack = getattr(_current, "streams", None)
    return stack[-1] if stack else getattr(_current, "default", Stream.null)


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    @property
    def done(self):
        return True


def _get_elapsed_time(start: Event, end: Event) -> float:
    return (end.t - start.t) * 1e3


class _Cuda:
    runtime = _Runtime()
    libcuda = None  # the emulated driver (_Driver), set below
    Device = Device
    Stream = Stream
    Event = Event
    Graph = Graph
    get_current_stream = staticmethod(_get_current_stream)
    get_elapsed_time = staticmethod(_get_elapsed_time)

    class Memory:
        pass


cuda = _Cuda()


# ---- kernels ---------------------------------------------------------------------------------------

class _Launch(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("smem", ctypes.c_ulonglong), ("smem_limit", ctypes.c_ulonglong)]


# a string literal (kept) or a comment (dropped)
_COMMENTS = re.compile(r'"(?:\\.|[^"\\\n])*"|//[^\n]*|/\*.*?\*/', re.S)
_SHARED_DYN = re.compile(r"extern\s+__shared__\s+((?:const\s+)?\w+)\s+(\w+)\s*\[\s*\]\s*;")
_SHARED_STATIC = re.compile(r"__shared__\s+((?:const\s+)?\w+)\s+(\w+)\s*\[([^\]]+)\]\s*;")
_KERNEL = re.compile(r'extern\s+"C"\s+__simt_global__\s+void\s+(?:__simt_lb__\s*\((.*?)\)\s+)?(\w+)\s*\(', re.S)


def host_source(code: str) -> str:
    """The kernel source as the host compiler takes it: __shared__ declarations become per-block
    allocations of the emulator (what every thread of a block sees). Comments are dropped first."""
    code = _COMMENTS.sub(lambda m: "" if m[0].startswith("/") else m[0], code)
    code = _SHARED_DYN.sub(lambda m: f"{m[1]}* {m[2]} = ({m[1]}*)::simt::dynamic_shared();", code)
    code = _SHARED_STATIC.sub(lambda m: f"{m[1]}* {m[2]} = ({m[1]}*)::simt::static_shared(sizeof({m[1]}) * ({m[3]}));",
                              code)
    if "__shared__" in code:
        raise ValueError("simt: a __shared__ declaration the emulator does not handle (arrays only)")
    return code


def _first_bound(expr: str | None) -> int:
    if not expr:
        return 0
    depth, cut = 0, len(expr)
    for i, ch in enumerate(expr):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            cut = i
            break
    first = expr[:cut]
    if not re.fullmatch(r"[\d\s()+*/-]+", first):
        raise ValueError(f"simt: cannot read __launch_bounds__({expr})")
    return int(eval(first, {"__builtins__": {}}))  # noqa: S307 (digits and arithmetic only)


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cache_dir() -> Path:
    d = os.environ.get("SHARPI_SIMT_CACHE") or os.path.join(tempfile.gettempdir(), f"sharpi-simt-{os.getuid()}")
    Path(d).mkdir(parents=True, exist_ok=True)
    return Path(d)


_CXXFLAGS = ("-O2", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-strict-aliasing", "-ffp-contract=off",
             "-Wno-unknown-pragmas")


def _build(code: str, options: tuple) -> tuple[Path, dict[str, int]]:
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("simt: no C++ compiler (g++) to build the kernels")
    defines = [o for o in options if o.startswith(("-D", "-U"))]
    if os.environ.get("SHARPI_SIMT_WARP_REDUCE") == "1":  # warp reductions in one exchange (simt.hpp's warp_butterfly)
        defines.append("-DSHARPI_SIMT_WARP_REDUCE")
    src = host_source(code)
    key = hashlib.sha256("\0".join([src, *defines, _SIMT_HPP.read_text(), cxx, *_CXXFLAGS]).encode()).hexdigest()[:24]
    d = _cache_dir()
    lib = d / f"k{key}.so"
    table = d / f"k{key}.kernels"
    if not (lib.exists() and table.exists()):
        pre = subprocess.run([cxx, "-E", "-P", "-x", "c++", "-std=c++17", "-DSHARPI_SIMT_EMU=1", *defines,
                              "-D__global__=__simt_global__", "-D__launch_bounds__(...)=__simt_lb__(__VA_ARGS__)", "-"],
                             input=src, capture_output=True, text=True)
        if pre.returncode:
            raise RuntimeError(f"simt: preprocessing failed:\n{pre.stderr[-4000:]}")
        kernels = {name: _first_bound(lb) for lb, name in _KERNEL.findall(pre.stdout)}
        if not kernels:
            raise RuntimeError("simt: no extern \"C\" __global__ kernels in the source")
        full = (f'#include "{_SIMT_HPP}"\n{src}\n'
                + "".join(f"SIMT_EXPORT({k}, {b})\n" for k, b in kernels.items()))
        tmp = d / f"k{key}.{os.getpid()}.{threading.get_ident()}"
        (tmp.with_suffix(".cpp")).write_text(full)
        cmd = [cxx, *_CXXFLAGS, *defines, "-o", str(tmp.with_suffix(".so")), str(tmp.with_suffix(".cpp"))]
        r = subprocess.run(cmd, capture_output=True, text=True)
        tmp.with_suffix(".cpp").unlink()
        if r.returncode:
            raise RuntimeError(f"simt: {' '.join(cmd)} failed:\n{r.stderr[-6000:]}")
        table.write_text("".join(f"{k} {b}\n" for k, b in kernels.items()))
        os.replace(tmp.with_suffix(".so"), lib)
    kernels = {ln.split()[0]: int(ln.split()[1]) for ln in table.read_text().splitlines() if ln.strip()}
    return lib, kernels


_ARG_CODES = {_np.dtype(_np.int32): "i", _np.dtype(_np.uint32): "I", _np.dtype(_np.int64): "l",
              _np.dtype(_np.uint64): "L", _np.dtype(_np.float32): "f", _np.dtype(_np.float64): "d",
              _np.dtype(_np.bool_): "b"}
_CTYPES = {"i": ctypes.c_int32, "I": ctypes.c_uint32, "l": ctypes.c_int64, "L": ctypes.c_uint64,
           "f": ctypes.c_float, "d": ctypes.c_double, "b": ctypes.c_bool}
_CODE_NAMES = {"i": "int", "I": "unsigned", "l": "int64", "L": "uint64", "f": "float", "d": "double",
               "b": "bool", "F": "float*", "N": "int*", "P": "pointer"}


def _arg(a, i: int, want: str, kernel: str):
    """(ctypes value, device array or None) for argument i, checked against the C type `want`."""
    if isinstance(a, ndarray):
        have = {"float32": "F", "int32": "N"}.get(a.dtype.name, "P")
        if want not in "FNP" or (want != "P" and have != want):
            raise TypeError(f"{kernel}: argument {i} is a {a.dtype} device array, the kernel takes "
                            f"{_CODE_NAMES[want]}")
        return ctypes.c_void_p(a.__array_interface__["data"][0]), a
    if isinstance(a, _np.ndarray):
        raise TypeError(f"{kernel}: argument {i}: Unsupported type {type(a)} (a numpy array)")
    if isinstance(a, _np.generic):
        have = _ARG_CODES.get(a.dtype)
    elif isinstance(a, bool):
        have = "b"
    elif isinstance(a, int):
        have = "l"  # CuPy passes a Python int as a 64-bit integer
    elif isinstance(a, float):
        have = "d"
    else:
        raise TypeError(f"{kernel}: argument {i}: Unsupported type {type(a)}")
    if have != want:
        raise TypeError(f"{kernel}: argument {i} is {_CODE_NAMES.get(have, have)} ({a!r}), the kernel takes "
                        f"{_CODE_NAMES[want]}")
    return _CTYPES[have](a), None


def _dims(v) -> tuple[int, int, int]:
    if not isinstance(v, tuple):  # CuPy's Function.__call__ takes tuples only
        raise TypeError(f"grid and block must be tuples, not {type(v).__name__}")
    if not 1 <= len(v) <= 3:
        raise ValueError(f"grid/block {v}")
    return tuple(int(x) for x in v) + (1,) * (3 - len(v))


class RawKernel:
    """One kernel of a built module (or of its own source, as cupy.RawKernel(code, name))."""

    def __init__(self, code=None, name=None, options=(), *, _lib=None, _bound=0, **kw):
        if _lib is None:
            mod = RawModule(code=code, options=options)
            k = mod.get_function(name)
            _lib, _bound = k._lib, k._bound
        self.name = name
        self._lib = _lib
        self._bound = _bound
        self._fn = getattr(_lib, f"simt_launch_{name}")
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.POINTER(_Launch), ctypes.c_void_p]
        sig = getattr(_lib, f"simt_signature_{name}")
        sig.restype = ctypes.c_char_p
        self.signature = sig().decode()
        self._max_dyn = 0
        self.max_threads_per_block = _bound or 1024

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_dyn

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n: int) -> None:
        if n > _SMEM_OPTIN:  # cuFuncSetAttribute refuses more than the device's opt-in
            raise RuntimeError(f"CUDA_ERROR_INVALID_VALUE: {n} bytes of dynamic shared memory (the "
                               f"device allows {_SMEM_OPTIN})")
        self._max_dyn = int(n)

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        args = tuple(args)
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name}: {len(args)} arguments, the kernel takes {len(self.signature)}")
        vals, arrays = [], []
        for i, (a, want) in enumerate(zip(args, self.signature)):
            v, arr = _arg(a, i, want, self.name)
            vals.append(v)
            if arr is not None:
                arrays.append(arr)
        dims = (_dims(grid), _dims(block), int(shared_mem), int(self.max_dynamic_shared_size_bytes))
        self._launch(vals, dims, arrays, stream if stream is not None else _get_current_stream())

    @property
    def kernel(self):  # CuPy's Function: `.ptr` is the CUfunction handle, here a key of _handles
        h = id(self)
        _handles[h] = self
        return _Pointer(h)

    def _launch(self, vals, dims, arrays, stream) -> None:
        if _capturing and _capturing[0] is stream:
            roots = [_root(a) for a in arrays]
            stream._record.append((self, vals, dims, [weakref.ref(r) for r in roots if r is not None]))
            return
        self._run(vals, dims, arrays)

    def _run(self, vals, dims, arrays) -> None:
        grid, block, smem, smem_limit = dims
        argv = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.addressof(v) for v in vals])
        L = _Launch((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem, smem_limit)
        with _lock:
            version = _memory[0]
            if _lib_memory.get(id(self._lib), (None, -1))[1] != version:  # the live allocations, for prefetches
                table = _memory_table()  # (made after reading the count: a change meanwhile makes it again)
                self._lib.simt_set_memory(ctypes.c_void_p(table.ctypes.data), ctypes.c_int(table.shape[0]))
                _lib_memory[id(self._lib)] = (table, version)  # (kept alive while the library reads it)
            rc = self._fn(ctypes.byref(L), argv)
            if rc:
                get = self._lib.simt_error
                get.restype = ctypes.c_char_p
                raise RuntimeError(f"kernel {self.name} grid {grid} block {block}: {get().decode()}")
        for a in arrays:
            _check_guards(a, f"kernel {self.name}")


# ---- the driver's cuLaunchKernelEx (what sharpi_core/backends/cuda.py calls through ctypes) --------------
_handles: dict[int, RawKernel] = {}  # CUfunction handle -> kernel
_streams: "weakref.WeakValueDictionary[int, Stream]" = weakref.WeakValueDictionary()  # CUstream -> Stream
CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_LAUNCH_FAILED = 1, 400, 719


def _allocation_of(ptr: int):
    """The allocation (buffer) whose array memory holds device address ptr, or None."""
    bases, ends, keys = _live()
    i = bisect.bisect_right(bases, ptr) - 1
    return _allocations.get(keys[i]) if i >= 0 and ptr < ends[i] else None


class _Driver:
    """libcuda, as far as cuLaunchKernelEx goes: the launch reads its arguments the way the driver does
    (each kernelParams entry points at a value of the kernel parameter's C type), refuses pointers that
    are not inside a live allocation and attributes other than programmatic stream serialization, and
    then runs (or records, while its stream captures) like a RawKernel call. The counts are for tests."""

    def __init__(self):
        self.launches = 0
        self.last_error = ""
        self.cuLaunchKernelEx = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                 ctypes.c_void_p, ctypes.c_void_p)(self._launch_ex)

    def _launch_ex(self, cfg_p, fn, params_p, extra) -> int:
        # cuda.h's structs as the backend declares them (tests/test_cuda_compile.py checks those against cuda.h)
        from sharpi_core.backends import cuda as cb  # noqa: PLC0415
        try:
            cfg = cb.CuLaunchConfig.from_address(cfg_p)
            k = _handles.get(fn or 0)
            if k is None or extra:
                return CUDA_ERROR_INVALID_HANDLE if k is None else CUDA_ERROR_INVALID_VALUE
            for i in range(cfg.numAttrs):
                a = cfg.attrs[i]
                value = ctypes.c_int.from_address(ctypes.addressof(a) + cb.CuLaunchAttribute.value.offset).value
                if a.id != cb.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION or value not in (0, 1):
                    self.last_error = f"launch attribute {a.id}"
                    return CUDA_ERROR_INVALID_VALUE
            params = ctypes.cast(params_p, ctypes.POINTER(ctypes.c_void_p))
            vals, arrays = [], []
            for i, code in enumerate(k.signature):
                at = params[i]
                if code in "FNP":
                    ptr = ctypes.c_void_p.from_address(at).value or 0
                    buf = _allocation_of(ptr)
                    if buf is None:
                        self.last_error = f"{k.name}: argument {i} (0x{ptr:x}) is not in a live allocation"
                        return CUDA_ERROR_INVALID_VALUE
                    vals.append(ctypes.c_void_p(ptr))
                    arrays.append(buf)
                else:
                    vals.append(_CTYPES[code](_CTYPES[code].from_address(at).value))
            dims = ((cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ), (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ),
                    int(cfg.sharedMemBytes), int(k.max_dynamic_shared_size_bytes))
            stream = _streams.get(cfg.hStream) if cfg.hStream else Stream.null
            if stream is None:
                self.last_error = f"unknown stream 0x{cfg.hStream:x}"
                return CUDA_ERROR_INVALID_HANDLE
            k._launch(vals, dims, arrays, stream)
            self.launches += 1
            return 0
        except Exception as e:  # an exception cannot cross the C callback: report it as a launch failure
            self.last_error = f"{type(e).__name__}: {e}"
            return CUDA_ERROR_LAUNCH_FAILED


class RawModule:
    def __init__(self, code=None, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=False):
        if code is None:
            code = Path(path).read_text()
        self.code = code
        self.options = tuple(options)
        lib_path, self._bounds = _build(code, self.options)
        self._lib = ctypes.CDLL(str(lib_path))
        self._functions: dict[str, RawKernel] = {}

    def compile(self, log_stream=None):
        pass  # built in __init__

    def get_function(self, name: str) -> RawKernel:
        k = self._functions.get(name)
        if k is None:
            if name not in self._bounds:
                raise RuntimeError(f"CUDA_ERROR_NOT_FOUND: named symbol not found ({name})")
            k = self._functions[name] = RawKernel(name=name, _lib=self._lib, _bound=self._bounds[name])
        return k


cuda.libcuda = _Driver()
