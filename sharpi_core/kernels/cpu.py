"""Quantized GGUF matmuls on the CPU through a small C library compiled on first use.

`qmatmul(x, raw, qtype, n, k)` computes x @ dequant(raw).T with the weight left in its GGUF block
format (a zero-copy view of the mmap), or in one of the CPU layouts `repack` makes (PACKED: Q4_K,
Q4_1 and Q5_0 in groups of 4 rows). With act_quant=False every block is expanded to fp32 in registers and
multiplied with FMAs, so the activations stay fp32 and the result equals the gguf.quants reference
within fp32 rounding; act_quant=True (what the models use) follows llama.cpp's integer arithmetic.
Up to 8 activation rows share each read of a block (decode and speculative verify); on the fp32
path, long inputs (prefill) dequantize tiles of rows into an L2-sized fp32 buffer and hand them to
torch's sgemm.

The library is built with `gcc -O3 -march=native -fopenmp` (and -flto=N on N > 1 cores, for a shorter build) into
`~/.cache/sharpi/kernels/qmatmul-<hash>.so` (hash of source, flags, compiler and CPU; written to a
temporary name and renamed into place, so concurrent processes never load half a file). Without a
compiler, or on a CPU without AVX2 (with FMA, F16C, BMI2), `available()` is False and
`unavailable_reason()` says why; callers then dequantize and use torch. The kernels are written with
AVX-512 intrinsics; on an AVX2 CPU x86simd.h computes each of them on two 256-bit halves with the same
result, so every machine computes the same bits (llama.cpp's AVX-512 arithmetic).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import gguf
import torch

from ..switches import switch

Q = gguf.GGMLQuantizationType

SUPPORTED: frozenset = frozenset(  # (F32: weights whose rows are multiples of 64, see qmatmul)
    {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
     Q.IQ4_XS, Q.MXFP4}
)

SOURCE = Path(__file__).with_name("qmatmul.c")
SOURCES = (SOURCE, Path(__file__).with_name("ops.c"))  # compiled into one library
HEADERS = (Path(__file__).with_name("ggml_order.h"), Path(__file__).with_name("x86simd.h"))  # included by both
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
if switch("SHARPI_KERNEL_NO_VNNI"):  # testing: the exact non-VNNI integer dot products
    CFLAGS += ("-mno-avx512vnni", "-mno-avxvnni")
if switch("SHARPI_KERNEL_NO_BF16"):  # testing: AVX-512 without its bf16 dot products (ggml's AVX512F code)
    CFLAGS += ("-mno-avx512bf16",)
if switch("SHARPI_KERNEL_AVX2"):  # testing: an AVX-512 CPU builds what an AVX2 CPU builds
    CFLAGS += ("-mno-avx512f",)
_ABI = 18
_REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c", "bmi2")
# With these the 512-bit intrinsics are the CPU's own; without, x86simd.h computes each on two 256-bit halves
# (the same bits, slower).
_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl")

# Rows of x at or above which qmatmul dequantizes tiles of rows and uses torch's sgemm (prefill).
# Measured crossover on Qwen2.5-1.5B shapes (2 threads): the register kernel wins up to T ~ 40.
GEMM_MIN_ROWS = 40
# With act_quant=True, quantized weights always take the integer register kernels: measured on the
# four models' shapes (2 threads), they beat dequantize + sgemm 2-6x at T = 8..512.
# fp32 bytes of one dequantized tile (about one L2; fewer Python iterations than smaller tiles).
GEMM_TILE_BYTES = 2 << 20

_BLOCK = {  # type -> (elements, bytes) per block
    Q.F32: (64, 256), Q.F16: (32, 64), Q.BF16: (32, 64), Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q5_0: (32, 22),
    Q.Q5_1: (32, 24), Q.Q8_0: (32, 34), Q.IQ4_NL: (32, 18), Q.Q2_K: (256, 84), Q.Q3_K: (256, 110), Q.Q4_K: (256, 144),
    Q.Q5_K: (256, 176), Q.Q6_K: (256, 210), Q.IQ4_XS: (256, 136), Q.MXFP4: (32, 17),
}

_lock = threading.Lock()
_state: dict = {"tried": False, "lib": None, "reason": None, "path": None, "build_s": None, "note": None}
_qmm = None  # entry points (extension functions or ctypes), bound once loaded
_dqr = None
_att = None
_rms = None
_rq8 = None
_qact = None
_ract = None
_glu = None
_vnni = None
_rope = None
_ropetab = None
_rpk = None
_had = None
_sq8 = None
_kvs = None  # KV cache writes in ggml's block types
_scap = None
_smax = None
_sconv = None
_qid = _mroute = _msum = _shexp = None  # mixture-of-experts entry points
_gdn = _gdng = _sigm = None  # Gated DeltaNet (qwen35)
_dlay = None  # the decoding layer loop (models/fast_decode.py)
_f16mm = None  # f16 matmuls of any width (LoRA adapters)
build_notice = None  # called (no arguments) just before this process compiles the library: a UI's hook


def kernel_dir() -> Path:
    base = os.environ.get("SHARPI_KERNEL_DIR")
    if base:
        return Path(base).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sharpi" / "kernels"


@functools.lru_cache(maxsize=None)
def _cpu_info() -> tuple[str, frozenset[str]]:
    """(identity string, flag set) of this CPU from /proc/cpuinfo (empty flag set if unreadable); read once (every
    Q5_0 weight asks avx512_emulated() at load, through packs)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), frozenset()
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
    return model + "|" + " ".join(sorted(flags)), frozenset(flags)


def _compiler() -> str | None:
    cc = os.environ.get("SHARPI_CC")
    if cc:
        return shutil.which(cc) or (cc if os.path.isfile(cc) else None)
    return shutil.which("gcc") or shutil.which("cc")


def _python_ext_flags() -> tuple[str, ...]:
    """Flags that also make the library a CPython extension module (cheaper calls than ctypes),
    or () when this Python has no development headers."""
    if switch("SHARPI_KERNEL_CTYPES"):
        return ()
    inc = sysconfig.get_paths().get("include")
    if not inc or not os.path.isfile(os.path.join(inc, "Python.h")):
        return ()
    return ("-DSHARPI_PYEXT", f"-I{inc}")


def library_path(extra: tuple[str, ...] = ()) -> Path | None:
    """Where the library for this source, flags, compiler, CPU (and Python, for the extension) lives."""
    cc = _compiler()
    if cc is None:
        return None
    try:  # identify the compiler by its binary (no subprocess at every start)
        real = os.path.realpath(cc)
        st = os.stat(real)
        ver = f"{real}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        ver = cc
    h = hashlib.sha256()
    for part in (*(src.read_bytes() for src in SOURCES + HEADERS), " ".join(CFLAGS + extra).encode(), ver.encode(), _cpu_info()[0].encode(),
                 str(_ABI).encode(), (sys.version + sysconfig.get_config_var("EXT_SUFFIX") if extra else "").encode()):
        h.update(part)
        h.update(b"\0")
    return kernel_dir() / f"qmatmul-{h.hexdigest()[:20]}.so"


def _lto_flags(cc: str) -> tuple[str, ...]:
    """gcc's link-time optimization, for the build's wall time alone. qmatmul.c is one large translation unit, which
    gcc optimizes and compiles on one core (44 s on a slow 2-core machine); with -flto=N that work runs at the link
    in partitions, N at once (N: this process's cores, at most 8; 25 s there). The library computes the same bits
    either way (no fast-math: inlining and partitioning change no floating-point result; the kernel tests compare
    bits), so LTO is no part of the library's name. gcc only: clang's LTO needs a linker plugin that may be
    missing. SHARPI_KERNEL_LTO=0 turns it off."""
    if not switch("SHARPI_KERNEL_LTO") or "gcc" not in os.path.basename(os.path.realpath(cc)):
        return ()
    from ..threads import process_cores
    cores = process_cores()
    return (f"-flto={min(cores, 8)}",) if cores > 1 else ()


def _build(cc: str, dest: Path, extra: tuple[str, ...]) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".qmatmul-", suffix=".so.part", dir=dest.parent)
    os.close(fd)
    try:
        cmd = [cc, *CFLAGS, *extra, *map(str, SOURCES), "-lm", "-o", tmp]
        lto = _lto_flags(cc)
        r = subprocess.run(cmd[:1] + list(lto) + cmd[1:], capture_output=True, text=True, timeout=900)
        if r.returncode != 0 and lto:  # (a gcc without its LTO plugin: the plain build)
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            msg = (r.stderr or r.stdout).strip().splitlines()
            raise RuntimeError(f"{Path(cc).name} failed (exit {r.returncode}): " + " | ".join(msg[-6:]))
        os.chmod(tmp, 0o755)
        try:  # on the disk before its name is: a crash then leaves no file cut short (whole_elf checks it anyway)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        except OSError:  # (a file system without fsync)
            pass
        os.replace(tmp, dest)  # atomic: other processes see no file or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


UNUSED_BUILD_DAYS = 30


def whole_elf(path: Path) -> bool:
    """Whether a built library is all there: a 64-bit ELF file that reaches the end of its section header table
    (which gcc writes last). A file cut short (a damaged disk, a crash before its blocks were written) would map
    pages past its end: loading it kills the process with SIGBUS, at every run."""
    try:
        with open(path, "rb") as f:
            h = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(h) < 64 or h[:5] != b"\x7fELF\x02":
        return False
    shoff = int.from_bytes(h[0x28:0x30], "little")
    shentsize, shnum = int.from_bytes(h[0x3A:0x3C], "little"), int.from_bytes(h[0x3C:0x3E], "little")
    return 0 < shoff and shoff + shentsize * shnum <= size


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # a read-only cache still works


def prune_builds(directory: Path, keep: Path, days: float = UNUSED_BUILD_DAYS) -> list[Path]:
    """Delete this library's builds not loaded for `days` (another source, compiler, CPU or Python
    made them; each load refreshes its file's mtime) and build leftovers a day old; -> the deleted."""
    gone = []
    now = time.time()
    for f in list(directory.glob("qmatmul-*.so")) + list(directory.glob(".qmatmul-*.so.part")):
        try:
            age = now - f.stat().st_mtime
            if f != keep and age > (days if f.suffix == ".so" else 1) * 86400:
                f.unlink()
                gone.append(f)
        except OSError:
            continue  # another process got there first
    return gone


def _bind_ctypes(path: Path) -> None:
    global _qmm, _dqr, _att, _rms, _rq8, _qact, _ract, _glu, _vnni, _rope, _ropetab, _rpk, _had, _sq8, _scap, _smax
    global _sconv, _qid, _mroute, _msum, _shexp, _gdn, _gdng, _sigm, _f16mm, _kvs, _dlay
    lib = ctypes.CDLL(str(path))
    if lib.sharpi_abi_version() != _ABI:
        raise RuntimeError(f"{path}: unexpected ABI version")
    c_long, c_int, c_void_p = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    f = lib.sharpi_qmatmul
    f.argtypes = [c_int, c_void_p, c_long, c_long, c_long, c_void_p, c_long, c_void_p, c_int]
    f.restype = c_int
    g = lib.sharpi_dequant_rows
    g.argtypes = [c_int, c_void_p, c_long, c_void_p, c_long, c_long, c_long, c_void_p, c_int]
    g.restype = c_int
    a = lib.sharpi_attention
    a.argtypes = [c_void_p, *[c_long] * 5, c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_int, c_long, c_long,
                  ctypes.c_float, ctypes.c_float, c_int, c_int, c_long, c_void_p, c_void_p, c_int, c_void_p]
    a.restype = c_int
    r = lib.sharpi_rms_norm
    r.argtypes = [c_void_p, c_void_p, c_long, c_long, ctypes.c_float, c_void_p]
    r.restype = None
    rq = lib.sharpi_round_q8
    rq.argtypes = [c_void_p, c_long, c_int, c_int, c_void_p]
    rq.restype = None
    qa = lib.sharpi_quantize_act
    qa.argtypes = [c_int, c_void_p, c_long, c_long, c_void_p, c_void_p, c_void_p, c_void_p]
    qa.restype = c_int
    ra = lib.sharpi_round_act
    ra.argtypes = [c_void_p, c_long, c_int, c_int, c_void_p]
    ra.restype = None
    gl = lib.sharpi_glu
    gl.argtypes = [c_void_p, c_long, c_long, c_int, c_void_p, c_int]
    gl.restype = c_int
    rt = lib.sharpi_rope_table
    rt.argtypes = [ctypes.c_float, ctypes.c_float, c_long, c_int, c_void_p, ctypes.c_float, ctypes.c_float, c_int,
                   ctypes.c_float, ctypes.c_float, c_void_p]
    rt.restype = None
    ro = lib.sharpi_rope
    ro.argtypes = [c_void_p, c_long, c_long, c_long, c_int, c_void_p]
    ro.restype = None
    hd = lib.sharpi_hadamard
    hd.argtypes = [c_void_p, c_long, c_int]
    hd.restype = None
    sq = lib.sharpi_store_q8_0
    sq.argtypes = [c_void_p, c_long, c_void_p, c_void_p]
    sq.restype = None
    ks = lib.sharpi_kv_store
    ks.argtypes = [c_int, c_void_p, c_long, c_void_p]
    ks.restype = None
    rp = lib.sharpi_repack
    rp.argtypes = [c_int, c_void_p, c_long, c_long, c_void_p, c_int, c_int]
    rp.restype = c_int
    sc = lib.sharpi_softcap
    sc.argtypes = [c_void_p, c_long, ctypes.c_float]
    sc.restype = None
    sm = lib.sharpi_soft_max
    sm.argtypes = [c_void_p, c_long, c_long]
    sm.restype = None
    cv = lib.sharpi_short_conv
    cv.argtypes = [c_void_p, c_void_p, c_void_p, c_long, c_long, c_int]
    cv.restype = None
    fm = lib.sharpi_f16_mm
    fm.argtypes = [c_void_p, c_long, c_long, c_void_p, c_long, c_void_p, c_int]
    fm.restype = None
    qi = lib.sharpi_qmatmul_id
    qi.argtypes = [c_int, c_void_p, *[c_long] * 4, c_void_p, c_long, c_long, c_void_p, c_void_p, c_void_p, c_void_p,
                   c_long, c_int]
    qi.restype = c_int
    mr = lib.sharpi_moe_route
    mr.argtypes = [c_void_p, c_long, c_long, c_int, c_int, c_int, c_void_p, c_void_p, c_void_p]
    mr.restype = None
    ms = lib.sharpi_moe_sum
    ms.argtypes = [c_void_p, c_void_p, c_long, c_int, c_long, c_void_p]
    ms.restype = None
    sx = lib.sharpi_shexp_add
    sx.argtypes = [c_void_p, c_void_p, c_long, c_long, c_void_p, c_int]
    sx.restype = None
    gd = lib.sharpi_gdn
    gd.argtypes = [*[c_void_p] * 6, c_long, c_long, c_void_p, *[c_long] * 4, c_int]
    gd.restype = None
    gg = lib.sharpi_gdn_gates
    gg.argtypes = [*[c_void_p] * 4, c_long, c_long]
    gg.restype = None
    sg = lib.sharpi_sigmoid
    sg.argtypes = [c_void_p, c_long]
    sg.restype = None
    dl = lib.sharpi_decode_layers
    dl.argtypes = [c_void_p, c_long, c_void_p, c_long, c_long, c_long, c_void_p, ctypes.c_float, ctypes.c_float,
                   c_void_p, c_int, c_int, c_int, c_long, c_void_p, c_int]
    dl.restype = c_int
    _dlay = dl
    _qid, _mroute, _msum, _shexp, _gdn, _gdng, _sigm, _f16mm = qi, mr, ms, sx, gd, gg, sg, fm
    _state["lib"] = lib
    _glu, _rope, _ropetab, _rpk, _had, _sq8, _scap, _smax, _sconv = gl, ro, rt, rp, hd, sq, sc, sm, cv
    _kvs = ks
    _qmm, _dqr, _att, _rms, _rq8, _qact, _ract = f, g, a, r, rq, qa, ra
    _vnni = bool(lib.sharpi_has_vnni())


def _bind_module(path: Path) -> None:
    global _qmm, _dqr, _att, _rms, _rq8, _qact, _ract, _glu, _vnni, _rope, _ropetab, _rpk, _had, _sq8, _scap, _smax
    global _sconv, _qid, _mroute, _msum, _shexp, _gdn, _gdng, _sigm, _f16mm, _kvs, _dlay
    spec = importlib.util.spec_from_file_location("_sharpi_qmatmul", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _state["lib"] = mod
    _qmm, _dqr, _att, _rms, _rq8 = mod.qmatmul, mod.dequant_rows, mod.attention, mod.rms_norm, mod.round_q8
    _qact, _ract, _glu, _vnni = mod.quantize_act, mod.round_act, mod.glu, bool(mod.has_vnni())
    _rope, _ropetab, _rpk, _had, _sq8 = mod.rope, mod.rope_table, mod.repack, mod.hadamard, mod.store_q8_0
    _kvs = mod.kv_store
    _scap, _smax, _sconv = mod.softcap, mod.soft_max, mod.short_conv
    _qid, _mroute, _msum, _shexp = mod.qmatmul_id, mod.moe_route, mod.moe_sum, mod.shexp_add
    _gdn, _gdng, _sigm, _f16mm = mod.gdn, mod.gdn_gates, mod.sigmoid, mod.f16_mm
    _dlay = mod.decode_layers


def _load():
    with _lock:
        if _state["tried"]:
            return _state["lib"]
        _state["tried"] = True
        try:
            if platform.machine().lower() not in ("x86_64", "amd64"):
                raise RuntimeError(f"the C kernels need an x86-64 CPU with AVX2 (this is {platform.machine()})")
            flags = _cpu_info()[1]
            missing = [f for f in _REQUIRED_CPU_FLAGS if f not in flags]
            if not flags or missing:
                raise RuntimeError("the C kernels need AVX2, FMA, F16C and BMI2 (CPU lacks "
                                   + (", ".join(missing) or "a readable /proc/cpuinfo") + ")")
            cc = _compiler()
            if cc is None:
                raise RuntimeError("no C compiler found (install gcc, or set SHARPI_CC)")
            ext = _python_ext_flags()
            err, noticed = None, False
            for extra in ((ext, ()) if ext else ((),)):
                private = None
                try:
                    path = library_path(extra)
                    if not whole_elf(path):  # (missing, or damaged: built again in its place)
                        if build_notice is not None and not noticed:
                            build_notice()
                            noticed = True
                        t0 = time.perf_counter()
                        try:
                            _build(cc, path, extra)
                            prune_builds(path.parent, keep=path)
                        except OSError as e:  # the cache cannot be written: a build for this process alone
                            private = Path(tempfile.mkdtemp(prefix="sharpi-kernels-"))
                            path = private / path.name
                            _build(cc, path, extra)
                            _state["note"] = (f"the kernel cache {kernel_dir()} cannot be written ({e.strerror or e}): "
                                              "the kernels were compiled for this run only (SHARPI_KERNEL_DIR names "
                                              "another place to keep them)")
                        _state["build_s"] = time.perf_counter() - t0
                    else:
                        _touch(path)  # in use: kept by prune_builds
                    (_bind_module if extra else _bind_ctypes)(path)
                    _state["path"], _state["reason"] = path, None
                    if not switch("SHARPI_AMX"):
                        amx(False)
                    break
                except Exception as e:  # noqa: BLE001 - try the plain ctypes build next
                    err = e
                finally:
                    if private is not None:  # (a loaded library needs no file)
                        shutil.rmtree(private, ignore_errors=True)
            else:
                raise err
        except Exception as e:  # never raise from available()
            _state["lib"] = None
            _state["reason"] = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
        return _state["lib"]


def available() -> bool:
    """True when the C library is compiled and loaded (builds it on the first call; never raises)."""
    return (_state["lib"] if _state["tried"] else _load()) is not None


def unavailable_reason() -> str | None:
    available()
    return _state["reason"]


def load_warning() -> str | None:
    """What a user should hear once the kernels were wanted: why they are unavailable (torch's matmuls run
    instead, several times slower), or that they could not be kept in the cache; None when all is well or
    nothing asked for them."""
    if not _state["tried"]:
        return None
    if _state["lib"] is None:
        return f"the C kernels are unavailable ({_state['reason']}): torch's matmuls run instead, several times slower"
    return _state["note"]


def avx512_emulated() -> bool:
    """Whether this machine's build computes the 512-bit intrinsics on 256-bit halves (x86simd.h: an AVX2
    CPU, or SHARPI_KERNEL_AVX2=1): the same results as the AVX-512 build, more instructions."""
    return "-mno-avx512f" in CFLAGS or not all(f in _cpu_info()[1] for f in _AVX512_FLAGS)


def simd_level() -> str | None:
    """What the kernels run on here (read from the CPU's flags, nothing is built): "AVX-512", "AVX2,
    AVX-512 emulated" ("AVX2 with AVX-VNNI, ..." where the CPU has it and the compiler emits it), or None on a CPU
    they do not run on."""
    flags = _cpu_info()[1]
    if platform.machine().lower() not in ("x86_64", "amd64") or not all(f in flags for f in _REQUIRED_CPU_FLAGS):
        return None
    if not avx512_emulated():
        return "AVX-512"
    return f"AVX2{' with AVX-VNNI' if avx2_build_takes_avx_vnni() else ''}, AVX-512 emulated"


def avx2_build_takes_avx_vnni() -> bool:
    """Whether the AVX2 build here computes its integer dot products with AVX-VNNI: the CPU has it and the compiler
    emits it (gcc >= 11 defines __AVXVNNI__ under -march=native there; an older one builds the maddubs path)."""
    if "avx_vnni" not in _cpu_info()[1] or "-mno-avxvnni" in CFLAGS:
        return False
    cc = _compiler()
    macros = _compiler_macros(cc, tuple(f for f in CFLAGS if f.startswith("-m")) + ("-mno-avx512f",)) if cc else None
    return macros is None or "__AVXVNNI__" in macros  # (a compiler that cannot say: the CPU's flag)


@functools.lru_cache(maxsize=None)
def _compiler_macros(cc: str, flags: tuple[str, ...]) -> frozenset[str] | None:
    """The macros the compiler predefines under these flags (one preprocessor run, ~20 ms), or None if it fails."""
    try:
        r = subprocess.run([cc, *flags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    return frozenset(line.split()[1] for line in r.stdout.splitlines() if line.startswith("#define ") and len(line.split()) > 1)


def state_text() -> str:
    """What --list-devices says of the CPU's matmuls, without building anything: the SIMD level and whether the
    kernels are compiled (or compiled at first use), else why torch's matmuls would run."""
    if not switch("SHARPI_CPU_KERNEL"):
        return "C kernels off (SHARPI_CPU_KERNEL=0): torch's matmuls"
    simd = simd_level()
    if simd is None:
        return "no AVX2: dequantized torch matmuls"
    if _compiler() is None:
        return f"{simd}; no C compiler (install gcc, or set SHARPI_CC): dequantized torch matmuls"
    ext = _python_ext_flags()
    built = [p for p in {library_path(ext), library_path(())} if p.is_file()]
    return f"{simd}; C kernels " + (f"compiled ({built[0].parent})" if built else "compiled at first use")


def build_info() -> dict:
    """Path of the loaded library, seconds this process spent compiling it (None: it was cached),
    whether calls go through the CPython extension or ctypes, and why it is unavailable if so."""
    available()
    lib = _state["lib"]
    return {"path": _state["path"], "build_s": _state["build_s"], "reason": _state["reason"],
            "binding": None if lib is None else ("ctypes" if isinstance(lib, ctypes.CDLL) else "extension"),
            "simd": None if lib is None else simd_level()}


_F32 = torch.float32


class _PackedType:
    """A CPU-only weight layout that is not a GGML type (stands in for a qtype in qmatmul)."""

    def __init__(self, name: str, code: int):
        self.name, self.code = name, code

    def __int__(self) -> int:
        return self.code

    def __repr__(self) -> str:
        return self.name


# Weights with every 4 consecutive rows interleaved per block (see qmatmul.c, TY_Q4_KR / TY_Q4_1R /
# TY_Q5_0R): the layouts of repack's results. Q4_K_R4 has 148 bytes per row and super-block (4 more than
# Q4_K: the scales and mins unpacked to bytes), Q4_1_R4 Q4_1's 20 per block, Q5_0_R4 Q5_0's 22. Same
# results as the GGUF type, bit for bit.
Q4_K_R4 = _PackedType("Q4_K_R4", 212)
Q4_1_R4 = _PackedType("Q4_1_R4", 203)
Q5_0_R4 = _PackedType("Q5_0_R4", 206)
PACKED = {Q.Q4_K: Q4_K_R4, Q.Q4_1: Q4_1_R4, Q.Q5_0: Q5_0_R4}  # GGUF type -> its CPU layout


def packs(qtype) -> bool:
    """Whether the models repack weights of qtype into PACKED[qtype] here. Q5_0's layout is for the AVX2
    build, where a block takes fewer instructions (its 5th bits spread into bytes without GGUF's 32-bit
    masks, whose expansion the 256-bit halves pay for): 1.5x faster on the Qwen 0.5B draft's FFN weights
    (scripts/bench_kernels.py). Not measured on an AVX-512 machine, which keeps the GGUF blocks."""
    return qtype in PACKED and (qtype is not Q.Q5_0 or avx512_emulated())

# qtype -> (type code for C, elements per block, bytes per block)
_INFO = {qt: (int(qt), be, bb) for qt, (be, bb) in _BLOCK.items()}
_INFO[Q4_K_R4] = (212, 256, 148)
_INFO[Q4_1_R4] = (203, 32, 20)
_INFO[Q5_0_R4] = (206, 32, 22)


def repack(raw: torch.Tensor, qtype, n: int, k: int, inverse: bool = False) -> torch.Tensor:
    """GGUF rows uint8 [N, row bytes] of a Q4_K / Q4_1 / Q5_0 weight -> its PACKED[qtype] layout
    (inverse: back, bit-exact). N must be a multiple of 4."""
    if _rpk is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    if qtype not in PACKED:
        raise ValueError(f"repack: no CPU layout for {getattr(qtype, 'name', qtype)}")
    _, be, bb = _INFO[qtype]
    rb_gguf, rb_packed = k // be * bb, k // be * _INFO[PACKED[qtype]][2]
    rb_in, rb_out = (rb_packed, rb_gguf) if inverse else (rb_gguf, rb_packed)
    if n % 4 or k % be or raw.nbytes != n * rb_in or not raw.is_contiguous() or not raw.is_cpu:
        raise ValueError(f"repack: need N % 4 == 0, K % {be} == 0 and a contiguous [N, {rb_in}] uint8 tensor")
    out = torch.empty((n, rb_out), dtype=torch.uint8)
    if _rpk(int(qtype), raw.data_ptr(), n, k, out.data_ptr(), int(inverse), torch.get_num_threads()):
        raise ValueError("repack: rejected by the kernel")
    return out


def takes(qtype, k: int) -> bool:
    """Whether qmatmul takes rows of k elements of qtype (whole blocks of its kernel)."""
    return qtype in _INFO and k % _INFO[qtype][1] == 0


def _bad_args(x, raw, qtype, n, k, out):
    """The ValueError that explains why qmatmul's arguments were rejected."""
    if qtype not in _INFO:
        return ValueError(f"qmatmul: unsupported type {getattr(qtype, 'name', qtype)} "
                          f"(supported: {', '.join(sorted(t.name for t in SUPPORTED))})")
    _, be, bb = _INFO[qtype]
    if k % be:
        return ValueError(f"{qtype.name}: K={k} is not a multiple of the block size {be}")
    if x.dtype != _F32 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() or not x.is_cpu:
        return ValueError(f"x must be a contiguous float32 CPU [T, {k}] tensor, got {tuple(x.shape)} {x.dtype}")
    rb = k // be * bb
    if not raw.is_cpu or raw.nbytes != n * rb or not raw.is_contiguous():
        return ValueError(f"raw must be a contiguous CPU tensor of {n} rows x {rb} bytes ({qtype.name}, K={k}), "
                          f"got {tuple(raw.shape)} {raw.dtype}")
    return ValueError(f"out must be a contiguous float32 CPU [{x.shape[0]}, {n}] tensor")


def qmatmul(x: torch.Tensor, raw: torch.Tensor, qtype, n: int, k: int,
            out: torch.Tensor | None = None, act_quant: bool = False, prompt: bool = False) -> torch.Tensor:
    """x fp32 [T, K] (contiguous) @ dequant(raw [N, row_bytes]).T -> fp32 [T, N] (into `out` if given).

    act_quant=False: x is used as given (fp32 FMAs against the dequantized blocks).
    act_quant=True: x is first quantized the way llama.cpp's CPU backend quantizes activations for
    this weight type (its ggml vec_dot_type: Q8_0 / Q8_1 / Q8_K blocks, fp16 for F16, bf16 for BF16)
    and the quantized types use integer dot products per block (see qmatmul.c).

    Register kernels (every T with act_quant and a quantized weight; T < GEMM_MIN_ROWS otherwise):
    the result for one (token, output) pair is bitwise the same for every T and thread count, the
    order of llama.cpp's one-token path. prompt=True (with act_quant): the order of its prompt
    processing instead, which differs for Q4_K and Q2_K (repacked by llama.cpp) in the first
    T - T % 4 rows and for Q6_K, Q5_K, Q3_K and IQ4_XS (its tiled matmul) in passes of 8 rows or more.
    Longer inputs otherwise: tiles of weight rows are dequantized exactly and multiplied by torch's
    sgemm. F16 weights, BF16 ones with act_quant, and F32 ones whose rows are multiples of 64, take ggml's
    summation orders at every T: ggml_vec_dot_f16 / _bf16 / _f32 for one-row passes and verify rows, tinyBLAS for prompt passes
    (prompt=True) of 2 rows or more on weights of a multiple of 4 rows (tinyBLAS's tiles; vec_dot for the others)."""
    info = _INFO.get(qtype)
    if info is None or _qmm is None:
        if not available():
            raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
        if info is None:
            raise _bad_args(x, raw, qtype, n, k, out)
    code, be, bb = info
    rb = k // be * bb
    shp = x.shape
    if (x.dtype is not _F32 or len(shp) != 2 or shp[1] != k or k % be or not x.is_contiguous() or not x.is_cpu
            or raw.nbytes != n * rb or not raw.is_contiguous() or not raw.is_cpu):
        raise _bad_args(x, raw, qtype, n, k, out)
    t = shp[0]
    if out is None:
        out = torch.empty((t, n), dtype=_F32)
    elif out.dtype is not _F32 or out.shape != (t, n) or not out.is_contiguous() or not out.is_cpu:
        raise _bad_args(x, raw, qtype, n, k, out)
    # F16, F32 (rows of 64s: _BLOCK) and BF16 on rounded activations: ggml's own summation orders at every T
    # (qmatmul.c, sharpi_float_rows)
    ggml_float = qtype in (Q.F16, Q.F32) or (qtype is Q.BF16 and act_quant)
    if t >= GEMM_MIN_ROWS and n and not (act_quant and qtype in _ACT_Q8) and not ggml_float:
        if act_quant:
            return _gemm_act(x, raw, code, n, k, rb, out, qtype)
        return _gemm(x, raw, code, n, k, rb, out)
    mode = (512 if prompt else 256) if act_quant or qtype is Q.F32 else 0  # (nothing to round for F32)
    rc = _qmm(code | mode, raw.data_ptr(), rb, n, k, x.data_ptr(), t, out.data_ptr(),
              torch.get_num_threads()) if t and n else 0
    if rc == -2:
        raise MemoryError("qmatmul: no memory for the quantized activations")
    if rc:
        raise _bad_args(x, raw, qtype, n, k, out)
    return out


def direct_args(raw: torch.Tensor, qtype, n: int, k: int) -> tuple[int, int, int]:
    """(type code in the decoding order with quantized activations, weight pointer, row bytes): what
    a caller that runs many matmuls on fixed buffers passes to `kernel_fns()["qmatmul"]` itself,
    skipping qmatmul's per-call checks. The same kernel call as qmatmul(..., act_quant=True) for
    T < GEMM_MIN_ROWS."""
    info = _INFO.get(qtype)
    if info is None or not available():
        raise ValueError(f"direct_args: no kernel for {getattr(qtype, 'name', qtype)}")
    code, be, bb = info
    rb = k // be * bb
    if k % be or raw.nbytes != n * rb or not raw.is_contiguous() or not raw.is_cpu:
        raise ValueError(f"direct_args: raw is not [{n}, {rb}] bytes")
    return code | 256, raw.data_ptr(), rb


def kernel_fns() -> dict:
    """The C entry points taking pointers as ints (for fast paths that check their own buffers)."""
    if not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    return {"qmatmul": _qmm, "rms_norm": _rms, "attention": _att, "glu": _glu, "rope": _rope, "hadamard": _had,
            "store_q8_0": _sq8, "kv_store": _kvs, "short_conv": _sconv, "qmatmul_id": _qid, "moe_route": _mroute, "moe_sum": _msum,
            "shexp_add": _shexp, "gdn": _gdn, "gdn_gates": _gdng, "sigmoid": _sigm,
            "decode_layers": _dlay}


def _gemm(x, raw, code, n, k, rb, out):
    """Long inputs: dequantize tiles of weight rows (exactly) into an L2-sized buffer, torch sgemm."""
    tile = max(16, GEMM_TILE_BYTES // (4 * k) // 16 * 16)
    tile = min(tile, n)
    buf = torch.empty((tile, k), dtype=_F32)
    base, nth, bp = raw.data_ptr(), torch.get_num_threads(), buf.data_ptr()
    for n0 in range(0, n, tile):
        m = min(tile, n - n0)
        if _dqr(code, base + n0 * rb, rb, 0, 0, m, k, bp, nth):
            raise ValueError("qmatmul: kernel rejected the weight")
        torch.mm(x, buf[:m].t(), out=out[:, n0:n0 + m])
    return out


def _gemm_act(x, raw, code, n, k, rb, out, qtype):
    """The sgemm path for F16 / BF16 weights against activations rounded to that type (as ggml's
    vec_dot_type); quantized weights never come here (their integer kernels win at every T)."""
    xa = x.half().float() if qtype == Q.F16 else x.bfloat16().float() if qtype == Q.BF16 else x
    return _gemm(xa, raw, code, n, k, rb, out)


_ACT_Q8K = frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS})
_ACT_Q8 = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.MXFP4, Q4_K_R4, Q4_1_R4, Q5_0_R4}) | _ACT_Q8K
_ACT_Q8_1 = frozenset({Q.Q4_1, Q.Q5_1, Q4_1_R4})


def has_vnni() -> bool:
    """Whether the library was built with VNNI integer dot products: AVX512-VNNI, or AVX-VNNI in the AVX2 build
    (else they are computed exactly with vpmaddubsw / vpmaddwd: same results, slower)."""
    return bool(available() and _vnni)


def amx(on: bool | None = None) -> bool:
    """Whether prompt passes on repacked Q4_K weights (from 16 tokens) and on Q6_K ones (from 8) use the CPU's AMX
    tile unit (the same bits, faster); on=False / True turns it off / on where the CPU and the OS allow
    (SHARPI_AMX=0: off from the start)."""
    if not available():
        return False
    f = _symbols().sharpi_amx
    f.argtypes, f.restype = [ctypes.c_int], ctypes.c_int
    return bool(f(-1 if on is None else int(bool(on))))


def amx_passes() -> int:
    """How many matmuls have taken the AMX path in this process."""
    if not available():
        return 0
    f = _symbols().sharpi_amx_passes
    f.argtypes, f.restype = [], ctypes.c_long
    return int(f())


def _symbols() -> ctypes.CDLL:
    """The library's C symbols (either build: the extension module exports them too)."""
    if not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    return ctypes.CDLL(str(_state["path"]))


def expf_vectorized() -> bool:
    """Whether the attention kernel computes libm's expf itself, 4 lanes at a time (ops.c's expf4_glibc): true
    when a check at load found it equal to this libm's expf (glibc 2.27 on); else it calls libm's."""
    return bool(_symbols().sharpi_expf_vec())


def set_expf_vectorized(on: bool) -> None:
    """Tests: make the kernels call libm's expf (False) or their own (True: only where the check at load passed)."""
    _symbols().sharpi_expf_set(int(bool(on)))


def expf_mismatches(lo: int, hi: int, step: int = 1, vectorized: bool = True) -> int:
    """How many floats of bit patterns lo, lo + step, ... < hi the kernel's expf (vectorized: expf4_glibc, with
    libm for |x| >= 88; else libm's own) gives other bits than libm's expf for (tests; all threads)."""
    f = _symbols().sharpi_expf_mismatches
    f.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int, ctypes.c_int]
    f.restype = ctypes.c_long
    return int(f(lo, hi, step, int(vectorized), torch.get_num_threads()))


def quantize_act(x: torch.Tensor, qtype):
    """The activations x fp32 [T, K] quantized the way qmatmul(..., act_quant=True) quantizes them
    for a `qtype` weight (ggml's x86 quantize_row_q8_0 / q8_1 / q8_K): (codes int8 [T, K],
    d fp32 [T, K/B] (Q8_0 / Q8_1: the fp16 scale's value), s fp32 [T, K/32] (Q8_1: fp16(d * sum of
    codes); else None), bsums int16 [T, K/16] (Q8_K; else None)), B = 256 for K-quants, 32 otherwise."""
    if _qact is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    if qtype not in _ACT_Q8:
        raise ValueError(f"quantize_act: {getattr(qtype, 'name', qtype)} weights take no 8-bit activations")
    x = x.contiguous()
    blk = 256 if qtype in _ACT_Q8K else 32
    if x.dtype is not _F32 or x.dim() != 2 or x.shape[1] % blk:
        raise ValueError(f"quantize_act: x must be fp32 [T, K] with K a multiple of {blk}")
    t, k = x.shape
    codes = torch.empty((t, k), dtype=torch.int8)
    d = torch.empty((t, k // blk), dtype=_F32)
    s = torch.empty((t, k // 32), dtype=_F32) if qtype in _ACT_Q8_1 else None
    bs = torch.empty((t, k // 16), dtype=torch.int16) if blk == 256 else None
    rc = _qact(int(qtype), x.data_ptr(), t, k, codes.data_ptr(), d.data_ptr(), 0 if s is None else s.data_ptr(),
               0 if bs is None else bs.data_ptr())
    if rc < 0:
        raise ValueError(f"quantize_act: rejected {qtype.name} K={k}")
    return codes, d, s, bs


def dequant_rows(raw: torch.Tensor, qtype, rows: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 [R, K]: rows `rows` (int64 [R]) of raw [N, row_bytes], dequantized bit-exactly like gguf.quants."""
    if _dqr is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    info = _INFO.get(qtype)
    if info is None:
        raise ValueError(f"dequant_rows: unsupported type {getattr(qtype, 'name', qtype)}")
    code, be, bb = info
    if k % be:
        raise ValueError(f"{qtype.name}: K={k} is not a multiple of the block size {be}")
    rb = k // be * bb
    nbytes = raw.nbytes
    if nbytes % rb or not raw.is_contiguous() or not raw.is_cpu:
        raise ValueError(f"raw must be a contiguous CPU tensor of rows of {rb} bytes ({qtype.name}, K={k})")
    n = nbytes // rb
    rows = rows.reshape(-1)
    if rows.dtype != torch.int64 or not rows.is_contiguous():
        rows = rows.to(torch.int64).contiguous()
    r = rows.numel()
    out = torch.empty((r, k), dtype=_F32)
    if r == 0:
        return out
    lo, hi = torch.aminmax(rows)
    if int(lo) < 0 or int(hi) >= n:
        raise IndexError(f"row index out of range [0, {n}): {int(lo) if int(lo) < 0 else int(hi)}")
    if _dqr(code, raw.data_ptr(), rb, rows.data_ptr(), 0, r, k, out.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"dequant_rows: kernel rejected {qtype.name} K={k}")
    return out


def round_q8(x: torch.Tensor, block: int, f16_scale: bool) -> torch.Tensor:
    """x [..., K] fp32 rounded through 8-bit blocks of `block` (32 or 256) along K, returned
    dequantized, in one call: f16_scale, ggml's Q8_0 rules (code * fp16 scale); otherwise Q8_K's
    (code * 1/iscale). Bit-identical to quants.quantize_q8_blocks and to the codes qmatmul uses."""
    if _ract is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    x = x.contiguous()
    if x.dtype is not _F32 or block not in (32, 256) or x.shape[-1] % block:
        raise ValueError(f"round_q8: x {x.dtype} [..., {x.shape[-1]}] with blocks of {block}")
    y = torch.empty_like(x)
    _ract(x.data_ptr(), x.numel(), block, int(f16_scale), y.data_ptr())
    return y


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D] fp32 -> x / sqrt(mean(x^2) + eps) * w, rounded like ggml's rms_norm (+ mul)."""
    if _rms is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    x = x.contiguous()
    D = x.shape[-1]
    if x.dtype is not _F32 or (w is not None and (w.dtype is not _F32 or w.shape != (D,) or not w.is_contiguous())):
        raise ValueError(f"rms_norm: x {x.dtype} [..., {D}], w {None if w is None else (w.dtype, tuple(w.shape))}")
    y = torch.empty_like(x)
    _rms(x.data_ptr(), 0 if w is None else w.data_ptr(), x.numel() // D if D else 0, D, float(eps), y.data_ptr())
    return y


def rope_table(base: float, freq_scale: float, n: int, n_rot: int, factors: torch.Tensor | None = None,
               mscale: float = 1.0, yarn: tuple = (0.0, 0, 32.0, 1.0)) -> torch.Tensor:
    """(cos, sin) of positions [0, n) as complex64 [n, n_rot / 2], computed as ggml's rope cache
    (float theta multiplied up by powf(base, -2 / n_rot), divided by factors [n_rot / 2] fp32 (a
    model's rope_freqs) when given, times freq_scale, libm cosf / sinf, each times mscale: the
    context's attention factor). yarn: (ext_factor, original context, beta_fast, beta_slow): with an
    ext_factor, YaRN's ramp between extrapolated and interpolated angles and its magnitude factor."""
    if _ropetab is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    if factors is not None and (factors.dtype is not _F32 or factors.shape != (n_rot // 2,) or not factors.is_contiguous()):
        raise ValueError(f"rope_table: factors {factors.dtype} {tuple(factors.shape)}, n_rot {n_rot}")
    ext, orig, beta_fast, beta_slow = yarn
    cs = torch.empty((n, n_rot // 2), dtype=torch.complex64)
    _ropetab(float(base), float(freq_scale), n, n_rot, 0 if factors is None else factors.data_ptr(), float(mscale),
             float(ext), int(orig), float(beta_fast), float(beta_slow), cs.data_ptr())
    return cs


def rope(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """x [T, nh, hd] fp32 with rope pairs adjacent, rotated (in place, returned) by the rope_table
    rows cs [T, n_rot / 2] (contiguous): x0 c - x1 s and x0 s + x1 c rounded as ggml's rotate_pairs."""
    if _rope is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    T, nh, hd = x.shape
    n_rot = 2 * cs.shape[-1]
    if (x.dtype is not _F32 or not x.is_contiguous() or cs.dtype is not torch.complex64 or not cs.is_contiguous()
            or cs.shape[0] != T or n_rot > hd):
        raise ValueError(f"rope: x {x.dtype} {tuple(x.shape)}, cs {cs.dtype} {tuple(cs.shape)}")
    _rope(x.data_ptr(), T, nh, hd, n_rot, cs.data_ptr())
    return x


def hadamard(x: torch.Tensor, n: int) -> torch.Tensor:
    """x fp32, contiguous: every chunk of n (a power of two) along the flattened tensor times the
    orthonormal Hadamard matrix H_n, in place (returned); bit for bit kv_cache.rotate's torch path."""
    if _had is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    if x.dtype is not _F32 or not x.is_contiguous() or not x.is_cpu or n <= 0 or n & (n - 1) or x.numel() % n:
        raise ValueError(f"hadamard: x {x.dtype} {tuple(x.shape)}, n {n}")
    _had(x.data_ptr(), x.numel() // n, n)
    return x


def store_q8_0(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> None:
    """x fp32 [..., K] (K a multiple of 32) quantized as ggml's x86 quantize_row_q8_0 into codes
    (int8, x's element count) and d (fp16, one per block of 32), both contiguous (a KV cache slice)."""
    if _sq8 is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    x = x.contiguous()
    nb = x.numel() // 32
    if (x.dtype is not _F32 or not x.is_cpu or x.numel() % 32 or codes.dtype is not torch.int8
            or codes.numel() != x.numel() or d.dtype is not torch.float16 or d.numel() != nb
            or not codes.is_contiguous() or not d.is_contiguous()):
        raise ValueError(f"store_q8_0: x {x.dtype} {tuple(x.shape)}, codes {codes.dtype} {tuple(codes.shape)}, "
                         f"d {d.dtype} {tuple(d.shape)}")
    _sq8(x.data_ptr(), nb, codes.data_ptr(), d.data_ptr())


def kv_store(kind: str, x: torch.Tensor, dst: torch.Tensor) -> None:
    """x fp32 [..., K] (K a multiple of 32) quantized into dst (uint8, contiguous: K / 32 blocks of `kind`, one of
    the block types of _KV_CODE, per row of x) as llama.cpp's CPU backend writes such a KV cache (ops.c)."""
    if _kvs is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    x = x.contiguous()
    nb = x.numel() // 32
    if (kind not in KV_BLOCK_BYTES or x.dtype is not _F32 or not x.is_cpu or x.numel() % 32
            or dst.dtype is not torch.uint8 or dst.numel() != nb * KV_BLOCK_BYTES[kind] or not dst.is_contiguous()):
        raise ValueError(f"kv_store: {kind}, x {x.dtype} {tuple(x.shape)}, dst {dst.dtype} {tuple(dst.shape)}")
    _kvs(_KV_CODE[kind], x.data_ptr(), nb, dst.data_ptr())


_GLU_ACT = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """x fp32 (contiguous) = tanh(x * (1 / cap)) * cap in place, as llama.cpp caps Gemma 2's final logits
    (libm's tanhf, element by element: torch's vectorized tanh rounds differently)."""
    if _scap is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    if x.dtype is not _F32 or not x.is_contiguous():
        raise ValueError(f"softcap: x {x.dtype}, contiguous {x.is_contiguous()}")
    _scap(x.data_ptr(), x.numel(), float(cap))
    return x


def soft_max(x: torch.Tensor) -> torch.Tensor:
    """x fp32 [T, n] (contiguous) -> the softmax of each row, in place, as ggml_soft_max computes it (MoE
    routing: ggml's vectorized expf by groups of 16, libm's expf for the rest, the sum in double)."""
    if _smax is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    if x.dtype is not _F32 or not x.is_contiguous() or x.dim() != 2:
        raise ValueError(f"soft_max: x {x.dtype} {tuple(x.shape)}, contiguous {x.is_contiguous()}")
    _smax(x.data_ptr(), x.shape[0], x.shape[1])
    return x


_I32 = torch.int32
MOE_GATING = {"softmax": 0, "softmax_weight": 1}


def moe_route(logits: torch.Tensor, k: int, gating: str, bias: torch.Tensor | None = None, norm: bool = True):
    """A router's logits fp32 [T, n_expert] (+ bias [n_expert]) -> (the chosen experts int32 [T, k], their
    weights fp32 [T, k]) as llama.cpp's build_moe_ffn picks them (ops.c sharpi_moe_route; logits is overwritten);
    norm: softmax gating's weights over their sum (build_moe_ffn's norm_w)."""
    if _mroute is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    T, E = logits.shape
    if (logits.dtype is not _F32 or not logits.is_contiguous() or not 0 < k <= E or gating not in MOE_GATING
            or (bias is not None and (bias.dtype is not _F32 or bias.numel() != E or not bias.is_contiguous()))):
        raise ValueError(f"moe_route: logits {logits.dtype} {tuple(logits.shape)}, k {k}, gating {gating}")
    ids, w = torch.empty((T, k), dtype=_I32), torch.empty((T, k), dtype=_F32)
    _mroute(logits.data_ptr(), T, E, k, MOE_GATING[gating], int(norm), 0 if bias is None else bias.data_ptr(),
            ids.data_ptr(), w.data_ptr())
    return ids, w


def qmatmul_id(x: torch.Tensor, code: int, ptrs: torch.Tensor, rb: int, n: int, k: int, ids: torch.Tensor,
               xrow: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """ggml's mul_mat_id in the decoding order: row p of the result [P, n] is row xrow[p] of x fp32 [*, k] times
    expert ids[p]'s weight (ptrs int64 [n_expert]: each expert's [n, k] blocks of type `code`, rows of rb bytes;
    QWeight.kernel_args), plus bias[ids[p]] (fp32 [n_expert, n]) when given; out may be a view with a row
    stride (the gate and up halves of one buffer). Each row has the bits of a one-token qmatmul."""
    if _qid is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    P = ids.numel()
    if out is None:
        out = torch.empty((P, n), dtype=_F32)
    if (x.dtype is not _F32 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or ids.dtype is not _I32
            or xrow.dtype is not _I32 or xrow.numel() != P or not ids.is_contiguous() or not xrow.is_contiguous()
            or ptrs.dtype is not torch.int64 or not ptrs.is_contiguous() or out.dtype is not _F32
            or out.shape != (P, n) or out.stride(1) != 1 or (P and int(xrow.max()) >= x.shape[0])
            or (bias is not None and (bias.dtype is not _F32 or bias.shape != (ptrs.numel(), n) or not bias.is_contiguous()))):
        raise ValueError(f"qmatmul_id: x {x.dtype} {tuple(x.shape)}, ids {ids.dtype} {tuple(ids.shape)}, "
                         f"out {out.dtype} {tuple(out.shape)}")
    rc = _qid(code & 0xFF, ptrs.data_ptr(), ptrs.numel(), rb, n, k, x.data_ptr(), x.stride(0), P, ids.data_ptr(),
              xrow.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
              torch.get_num_threads())
    if rc == -2:
        raise MemoryError("qmatmul_id: no memory for the quantized activations")
    if rc:
        raise ValueError("qmatmul_id: the kernel rejected the weights or an expert id")
    return out


def moe_sum(d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The experts' outputs d fp32 [T * k, D] (token t's k rows in turn) and weights w [T, k] -> [T, D]: each
    output times its weight, added in order (build_moe_ffn)."""
    if _msum is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    T, k = w.shape
    if (d.dtype is not _F32 or w.dtype is not _F32 or not d.is_contiguous() or not w.is_contiguous() or d.dim() != 2
            or d.shape[0] != T * k):
        raise ValueError(f"moe_sum: d {d.dtype} {tuple(d.shape)}, w {w.dtype} {tuple(w.shape)}")
    y = torch.empty((T, d.shape[1]), dtype=_F32)
    _msum(d.data_ptr(), w.data_ptr(), T, k, d.shape[1], y.data_ptr())
    return y


def shexp_add(gx: torch.Tensor, sh: torch.Tensor, y: torch.Tensor, plain: bool = False) -> torch.Tensor:
    """y fp32 [T, D] += sh [T, D] * sigmoid(gx [T]) in place, as qwen2moe's graph gates its shared expert
    (ops.c sharpi_shexp_add: silu(x) / x with libm's expf, the product rounded, then added); plain: as qwen35moe's,
    ggml_sigmoid's 1 / (1 + expf(-x)). Returns y."""
    if _shexp is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    T = y.shape[0]
    if (any(t.dtype is not _F32 or not t.is_contiguous() for t in (gx, sh, y)) or y.dim() != 2 or sh.shape != y.shape
            or gx.numel() != T):
        raise ValueError(f"shexp_add: gx {tuple(gx.shape)}, sh {tuple(sh.shape)}, y {tuple(y.shape)}")
    _shexp(gx.data_ptr(), sh.data_ptr(), T, y.shape[1], y.data_ptr(), int(plain))
    return y


def f16_mm(x: torch.Tensor, w: torch.Tensor, prompt: bool = False) -> torch.Tensor:
    """x fp32 [T, k] @ w.T for w float16 [n, k] of any k (a LoRA adapter's factors), x rounded to fp16 first,
    in ggml's mul_mat order: tinyBLAS for prompt passes it takes, else ggml_vec_dot_f16 row by row."""
    if _f16mm is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    n, k = w.shape
    if x.dtype is not _F32 or x.dim() != 2 or x.shape[1] != k or w.dtype is not torch.float16 or not w.is_contiguous():
        raise ValueError(f"f16_mm: x {x.dtype} {tuple(x.shape)}, w {w.dtype} {tuple(w.shape)}")
    x16 = x.half().float().contiguous()
    y = torch.empty(x.shape[0], n)
    _f16mm(w.data_ptr(), n, k, x16.data_ptr(), x.shape[0], y.data_ptr(), int(prompt))
    return y


def short_conv(ext: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """ext fp32 [T + width - 1, D] (a convolution's state rows, then the pass's), w fp32 [D, width] (taps, the
    oldest position's first) -> [T, D]: LFM2's causal depthwise convolution as ggml_ssm_conv sums it (in
    float, oldest first, each product added with an FMA)."""
    if _sconv is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    D, width = w.shape
    T = ext.shape[0] - width + 1
    if (ext.dtype is not _F32 or w.dtype is not _F32 or not ext.is_contiguous() or not w.is_contiguous()
            or ext.dim() != 2 or ext.shape[1] != D or T < 0):
        raise ValueError(f"short_conv: ext {ext.dtype} {tuple(ext.shape)}, w {w.dtype} {tuple(w.shape)}")
    out = torch.empty(T, D)
    _sconv(ext.data_ptr(), w.data_ptr(), out.data_ptr(), T, D, width)
    return out


def glu(gu: torch.Tensor, n_ff: int, act: str) -> torch.Tensor:
    """gu fp32 [T, 2 * n_ff] (gate then up) -> act(gate) * up [T, n_ff], as llama.cpp's fused ops
    compute it on x86: silu through ggml's vectorized expf, gelu (tanh) through its fp16 table, swiglu_oai
    (gpt-oss) element by element with libm's expf."""
    if _glu is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    gu = gu.contiguous()
    T = gu.shape[0]
    if gu.dtype is not _F32 or gu.dim() != 2 or gu.shape[1] != 2 * n_ff or act not in _GLU_ACT:
        raise ValueError(f"glu: gu {gu.dtype} {tuple(gu.shape)}, n_ff {n_ff}, act {act}")
    y = torch.empty((T, n_ff), dtype=_F32)
    if _glu(gu.data_ptr(), T, n_ff, _GLU_ACT[act], y.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"glu: n_ff {n_ff} is not a multiple of 16")
    return y


_KV_CODE = {"f32": 0, "f16": 1, "q8_0": 2, "bf16": 3, "q4_0": 4, "q4_1": 5, "iq4_nl": 6, "q5_0": 7, "q5_1": 8}
# bytes of a block of 32 in the cache types held as ggml's blocks (ops.c's kv_block_bytes)
KV_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "iq4_nl": 18, "q5_0": 22, "q5_1": 24}


# attention modes (ops.c): llama.cpp without flash attention (prompt / decoding order) and with it
ATTN_TINYBLAS, ATTN_VEC_DOT, ATTN_FA_PROMPT, ATTN_FA_DECODE = 0, 1, 2, 3


def attention(q: torch.Tensor, k_store, v_store, layer: int, start: int, window: int, scale: float,
              mode: int = ATTN_FA_PROMPT, softcap: float = 0.0, sinks: torch.Tensor | None = None,
              vis: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] against one layer of the KV cache -> [T, H, Dv]. Row t is at position start + t and
    sees keys [start + t - window + 1 (or 0), start + t]. k_store / v_store are kv_cache stores: `.q`
    [n_layer, capacity, Hkv, D] in f32 / f16 / int8, `.d` the q8_0 scales, `.kind`. softcap > 0: the
    scores pass through softcap * tanh(score / softcap) where llama.cpp applies it (Gemma 2's attention
    logit softcapping). sinks: fp32 [H], each head's attention sink logit (gpt-oss; one more term in the
    softmax's denominator, with no value), as ggml adds it.

    `mode` is how llama.cpp's CPU backend would compute this pass (see ops.c): without flash
    attention, q must come rounded to the K cache's type for an f32 / f16 K, in fp32 for the other types
    (the kernel quantizes it as ggml does) (ATTN_TINYBLAS for prompt passes,
    ATTN_VEC_DOT for decoding rows; probabilities rounded to fp16 against an f16 V, to bf16 against a bf16 V); with it
    (llama.cpp's default), q comes in fp32 (the kernel rounds it to fp16 for an f16 K, quantizes it to
    q8_0 for a q8_0 K) and ATTN_FA_PROMPT computes a prompt pass, ATTN_FA_DECODE rows that each
    reproduce a one-row pass. Each (row, head) is computed by
    one thread in a fixed order: rows do not depend on T (within a mode) or the thread count.

    vis: int64 [T, 4] (several sequences in one pass, llama.cpp's unified cache): row t sees the cache positions
    [vis[t, 0], vis[t, 1]] but [vis[t, 2], vis[t, 3]) (other sequences' cells, masked as -inf masks them); start
    and window are then unused."""
    if _att is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")
    q = q.contiguous()
    T, H, D = q.shape
    kq, vq = k_store.q[layer], v_store.q[layer]  # [capacity, Hkv, D (or its blocks' bytes)]: contiguous slices
    Hkv, Dv = kq.shape[1], v_store.hd
    if start + T > kq.shape[0] or q.dtype is not _F32 or D != k_store.hd:
        raise ValueError(f"attention: {start + T} positions in a cache of {kq.shape[0]}, q {q.dtype}")
    kd = k_store.d[layer].data_ptr() if k_store.kind == "q8_0" else 0
    vd = v_store.d[layer].data_ptr() if v_store.kind == "q8_0" else 0
    out = torch.empty((T, H, Dv), dtype=_F32)
    if sinks is not None and (sinks.dtype is not _F32 or sinks.shape != (H,) or not sinks.is_contiguous()):
        raise ValueError(f"attention: sinks must be contiguous fp32 [{H}]")
    if vis is not None and (vis.dtype is not torch.int64 or vis.shape != (T, 4) or not vis.is_contiguous()
                            or int(vis[:, 1].max()) >= kq.shape[0] or int(vis[:, 0].min()) < 0):
        raise ValueError(f"attention: vis must be contiguous int64 [{T}, 4] of positions in the cache")
    rc = _att(q.data_ptr(), T, H, Hkv, D, Dv, kq.data_ptr(), kd, _KV_CODE[k_store.kind], vq.data_ptr(), vd,
              _KV_CODE[v_store.kind], start, window, float(scale), float(softcap), int(v_store.kind == "f16"), mode, kq.shape[0],
              0 if sinks is None else sinks.data_ptr(), out.data_ptr(), torch.get_num_threads(),
              0 if vis is None else vis.data_ptr())
    if rc:
        raise ValueError(f"attention: kernel rejected D={D} Dv={Dv} H={H} Hkv={Hkv} ({k_store.kind}/{v_store.kind})")
    return out


def _ready(fn) -> None:
    if fn is None and not available():
        raise RuntimeError(f"sharpi CPU kernels unavailable: {_state['reason']}")


def gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ring: torch.Tensor,
        slot0: int) -> torch.Tensor:
    """The Gated DeltaNet recurrence of one layer over a pass (ggml_gated_delta_net): q, k fp32 [T, Hk, S], v [T, Hv, S],
    g, beta [T, Hv] (decay exponent, sigmoid beta), ring [R, Hv, S, S] (the layer's states: the one before the pass in
    slot slot0, the one after token t written to slot (slot0 + t + 1) % R) -> out [T, Hv, S]."""
    _ready(_gdn)
    T, Hk, S = q.shape
    Hv, R = v.shape[1], ring.shape[0]
    ts = (q, k, v, g, beta, ring)
    if (any(t.dtype is not _F32 or not t.is_contiguous() for t in ts) or k.shape != q.shape or v.shape != (T, Hv, S)
            or g.shape != (T, Hv) or beta.shape != (T, Hv) or ring.shape[1:] != (Hv, S, S) or Hv % Hk or S % 64):
        raise ValueError("gdn: " + ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in ts))
    out = torch.empty(T, Hv, S)
    _gdn(*(t.data_ptr() for t in ts), R, slot0 % R, out.data_ptr(), T, Hv, Hk, S, torch.get_num_threads())
    return out


def gdn_gates(alpha: torch.Tensor, beta: torch.Tensor, dt: torch.Tensor, a: torch.Tensor) -> None:
    """In place on alpha, beta fp32 [T, Hv]: alpha -> softplus(alpha + dt) * a, beta -> sigmoid(beta) (dt, a [Hv])."""
    _ready(_gdng)
    T, Hv = alpha.shape
    if (any(t.dtype is not _F32 or not t.is_contiguous() for t in (alpha, beta, dt, a)) or beta.shape != alpha.shape
            or dt.shape != (Hv,) or a.shape != (Hv,)):
        raise ValueError(f"gdn_gates: alpha {tuple(alpha.shape)}, beta {tuple(beta.shape)}, dt {tuple(dt.shape)}")
    _gdng(alpha.data_ptr(), beta.data_ptr(), dt.data_ptr(), a.data_ptr(), T, Hv)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """x fp32, contiguous -> 1 / (1 + expf(-x)) in place (ggml_sigmoid: libm's expf)."""
    _ready(_sigm)
    if x.dtype is not _F32 or not x.is_contiguous():
        raise ValueError(f"sigmoid: x {x.dtype} {tuple(x.shape)}")
    _sigm(x.data_ptr(), x.numel())
    return x
