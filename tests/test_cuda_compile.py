"""The CUDA sources build, and their block decoding is right, without a GPU.

- every cuda/*.cu compiles with nvcc to PTX for sm_80 and sm_90, and to an sm_90 cubin with
  qmatvec.cu cut down to one weight type (-DQMV_ONLY), so ptxas checks the inline PTX too while
  the test stays fast; skipped where nvcc is not on PATH;
- the same sources, expanded as sharpi_core.backends.cuda hands them to NVRTC, compile with NVRTC
  (to PTX, compute_90) when a libnvrtc is found (pip's nvidia-cuda-nvrtc-cu12, the toolkit, or
  $SHARPI_NVRTC_LIB), both whole and as the one-type modules the wrapper builds;
- cuda/host_emu.cpp (plain C++: the kernels' per-lane code run lane by lane on the CPU) is built
  with the C++ compiler and checked against gguf.quants for every weight type: block layouts,
  lane/group coverage, row clamping, the activation-row guard of the batched variants.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest

from sharpi_core.backends import cuda as cb

Q = gguf.GGMLQuantizationType
CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"
SOURCES = sorted(CUDA_DIR.glob("*.cu"))
ARCHS = ("sm_80", "sm_90")


def test_sources_present():
    names = {p.stem for p in SOURCES}
    assert {"qmatvec", "ops"} <= names
    assert set(cb.SOURCES) <= names


# ---- nvcc ------------------------------------------------------------------------------------------

def _nvcc(src: Path, arch: str, kind: str, defines: tuple, out_dir: Path) -> tuple[str, int, str]:
    out = out_dir / f"{src.stem}.{arch}{''.join(defines)}.{kind[1:]}"
    cmd = ["nvcc", f"-arch={arch}", kind, "-Werror=all-warnings", *defines, "-I", str(CUDA_DIR),
           "-o", str(out), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return " ".join(cmd), r.returncode, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_nvcc_compiles(tmp_path):
    # Whole sources to PTX for both archs (the front end: every kernel of every weight type), and a
    # cubin with qmatvec.cu cut down to one weight type so that ptxas checks the inline PTX too;
    # full cubins for both archs would take about twice as long and check nothing more.
    jobs = [(s, a, "-ptx", ()) for s in SOURCES for a in ARCHS]
    jobs += [(s, "sm_90", "-cubin", ("-DQMV_ONLY=14",)) for s in SOURCES]
    with ThreadPoolExecutor(max_workers=min(len(jobs), max(2, os.cpu_count() or 2))) as ex:
        results = list(ex.map(lambda j: _nvcc(*j, tmp_path), jobs))
    failed = [f"{cmd}\nexit {rc}:\n{log}" for cmd, rc, log in results if rc != 0]
    assert not failed, "\n\n".join(failed)


# ---- NVRTC (the path CuPy takes) -------------------------------------------------------------------

def _find_nvrtc() -> str | None:
    env = os.environ.get("SHARPI_NVRTC_LIB")
    if env:
        return env
    cands = []
    try:
        import nvidia.cuda_nvrtc  # noqa: PLC0415 (pip's nvidia-cuda-nvrtc-cu12)
        for base in nvidia.cuda_nvrtc.__path__:
            cands += sorted(glob.glob(os.path.join(base, "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    cands = [c for c in cands if "alt" not in os.path.basename(c) and "builtins" not in os.path.basename(c)]
    return cands[0] if cands else ctypes.util.find_library("nvrtc")


def _nvrtc_compile(lib, source: str, name: str, options: list[str]) -> tuple[int, str]:
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram: {rc}"
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        return rc, buf.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# Options CuPy (13, 14) adds to every RawModule compile with NVRTC.
CUPY_ADDS = ("-ftz=true", "--device-as-default-execution-space")


def test_nvrtc_compiles():
    path = _find_nvrtc()
    if not path:
        pytest.skip("no libnvrtc found (pip install nvidia-cuda-nvrtc-cu12, or set SHARPI_NVRTC_LIB)")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        pytest.skip(f"cannot load {path}: {e}")
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p,
                                       ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.nvrtcGetProgramLogSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    lib.nvrtcGetProgramLog.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    jobs = [(name, ()) for name in cb.SOURCES] + [("qmatvec", cb.qmv_options(Q.Q4_K))]

    def one(job):
        name, extra = job
        return name, extra, *_nvrtc_compile(lib, cb.kernel_source(name), f"{name}.cu",
                                            [*cb.NVRTC_OPTIONS, *extra, *CUPY_ADDS, "-arch=compute_90"])
    with ThreadPoolExecutor(max_workers=len(jobs)) as ex:
        results = list(ex.map(one, jobs))
    failed = [f"{name} {extra} nvrtc error {rc}:\n{log}" for name, extra, rc, log in results if rc != 0]
    assert not failed, "\n\n".join(failed)


# ---- CPU emulation of the per-lane kernel code ------------------------------------------------------

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def random_raw(qtype, n: int, k: int, rng) -> np.ndarray:
    """Valid raw GGUF bytes uint8 [n, row_bytes] of a random weight of type qtype.

    Types gguf.quants can quantize go through it; for the K-quants (no quantizer in gguf-py) the
    bytes are random with the f16 super-block scales overwritten by small positive values."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    if qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        w = rng.standard_normal((n, k)).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(n, -1)
    nb = n * k // bs
    raw = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    f16 = lambda v: np.asarray(v, np.float16).view(np.uint8).reshape(nb, 2)  # noqa: E731
    if qtype == Q.Q6_K:
        raw[:, 208:210] = f16(rng.uniform(0.002, 0.02, nb))
    else:
        raw[:, 0:2] = f16(rng.uniform(0.002, 0.02, nb))  # d
        raw[:, 2:4] = f16(rng.uniform(0.002, 0.02, nb))  # dmin
    return raw.reshape(n, -1)


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        pytest.skip("no C++ compiler")
    so = tmp_path_factory.mktemp("emu") / "host_emu.so"
    cmd = [cxx, "-O1", "-std=c++17", "-fno-strict-aliasing", "-Wno-unknown-pragmas", "-shared", "-fPIC",
           str(CUDA_DIR / "host_emu.cpp"), "-o", str(so)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, " ".join(cmd) + "\n" + r.stdout + r.stderr
    lib = ctypes.CDLL(str(so))
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.emu_qmv.argtypes = [I, I, P, L, I, I, P, L, I, P, L]
    lib.emu_deq_rows.argtypes = [I, P, L, P, I, I, P, L]
    lib.emu_layout.argtypes = [I, P, I]
    return lib


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_emulated_lane_layout_covers_block(emu, qtype):
    e = np.zeros(1024, np.int32)
    n = emu.emu_layout(int(qtype), e.ctypes.data, e.size)
    assert n == cb.K_MULTIPLE[qtype]
    assert sorted(e[:n].tolist()) == list(range(n))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_emulated_kernels_match_gguf(emu, qtype):
    rng = np.random.default_rng(int(qtype) + 1)
    n = 37  # not a multiple of any rows-per-warp: exercises the clamped tail rows
    k = 768 if cb.K_MULTIPLE[qtype] == 256 else 288
    raw = random_raw(qtype, n, k, rng)
    assert raw.shape[1] == cb.row_bytes(qtype, k)
    W = gguf.quants.dequantize(raw, qtype).reshape(n, k)
    ids = np.array([3, 0, 36, 3], np.int32)
    out = np.full((4, k), np.nan, np.float32)
    assert emu.emu_deq_rows(int(qtype), raw.ctypes.data, raw.shape[1], ids.ctypes.data, 4, k, out.ctypes.data, k) == 0
    np.testing.assert_array_equal(out, W[ids])  # dequantization is exact
    W64 = W.astype(np.float64)
    for nqt, nq in [(1, 1), (2, 1), (2, 2), (4, 3), (4, 4), (8, 5), (8, 8), (16, 9), (16, 16)]:
        X = rng.standard_normal((nq, k)).astype(np.float32)
        Y = np.full((nq, n + 3), np.nan, np.float32)  # ldy > n: the padding must stay untouched
        rc = emu.emu_qmv(int(qtype), nqt, raw.ctypes.data, raw.shape[1], n, k, X.ctypes.data, k, nq,
                         Y.ctypes.data, n + 3)
        assert rc == 0
        assert np.isnan(Y[:, n:]).all()
        ref = X.astype(np.float64) @ W64.T
        err = np.linalg.norm(Y[:, :n] - ref) / np.linalg.norm(ref)
        assert err < 1e-5, (nqt, nq, err)
