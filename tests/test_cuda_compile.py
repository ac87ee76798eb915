"""The CUDA sources build, and their block decoding is right, without a GPU.

- every cuda/*.cu compiles with nvcc to PTX for sm_80 and sm_90, and to an sm_90 cubin with
  qmatvec.cu cut down to one weight type (-DQMV_ONLY), so ptxas checks the inline PTX too while
  the test stays fast; skipped where nvcc is not on PATH;
- the same sources, expanded as sharpi_core.backends.cuda hands them to NVRTC, compile with NVRTC
  (to PTX, compute_90) when a libnvrtc is found (pip's nvidia-cuda-nvrtc-cu12, the toolkit, or
  $SHARPI_NVRTC_LIB), both whole and as the one-type modules the wrapper builds;
The kernels' results are checked without a GPU by tests/test_simt.py (the same sources run in a
CPU emulator of the GPU's threads).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
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


# ---- programmatic dependent launch ------------------------------------------------------------------

_KERNEL_DEF = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s+)?'
                         r'\s*([\w#]+)\s*\(')  # names pasted together in macros (qmv_##tname##...) too


def _body_start(text: str, at: int) -> str:
    """The code after the opening brace of the function whose parameter list starts at `at`."""
    depth, i = 0, at
    while True:  # the parameter list's closing parenthesis
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
        if depth == 0:
            break
    return text[text.index("{", i) + 1:]


def test_every_kernel_waits_for_the_one_before_first():
    # kernels may be launched while the previous one in the stream still runs (cuda.py's PDL): each
    # must begin with KERNEL_BEGIN() (griddepcontrol.wait) before it touches memory; the matvecs may
    # first ask the L2 for their weights (memory no kernel writes)
    seen = []
    for src in SOURCES:
        text = re.sub(r"//[^\n]*", "", src.read_text()).replace("\\\n", "\n")
        for m in _KERNEL_DEF.finditer(text):
            body = re.sub(r"\s+", " ", _body_start(text, text.index("(", m.end() - 1))).lstrip()
            body = re.sub(r"^qmv_prefetch\([^;]*\); ", "", body) if m[1].startswith("qmv_") else body
            assert body.startswith("KERNEL_BEGIN();"), f"{src.name}: {m[1]} starts with {body[:60]!r}"
            seen.append(m[1])
    assert len(seen) >= 18 and any(n.startswith("qmv_") for n in seen) and any(n.startswith("attn_") for n in seen)


def _cuda_h() -> Path | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda.h").is_file():
            return Path(home) / "include"
    return None


def test_launch_structs_match_cuda_h(tmp_path):
    # cuLaunchKernelEx reads these through ctypes: their layout must be the driver's
    inc, cc = _cuda_h(), shutil.which("cc") or shutil.which("gcc")
    if inc is None or cc is None:
        pytest.skip("no cuda.h (CUDA toolkit) or no C compiler")
    (tmp_path / "l.c").write_text(r'''#include <cuda.h>
#include <stddef.h>
#include <stdio.h>
int main(void) {
    printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu %d\n", sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, gridDimZ),
           offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs),
           offsetof(CUlaunchConfig, numAttrs), sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
           offsetof(CUlaunchAttributeValue, programmaticStreamSerializationAllowed),
           (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
    return 0;
}
''')
    r = subprocess.run([cc, "-I", str(inc), "-o", str(tmp_path / "l"), str(tmp_path / "l.c")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    want = [int(v) for v in subprocess.run([str(tmp_path / "l")], capture_output=True, text=True).stdout.split()]
    C, A = cb.CuLaunchConfig, cb.CuLaunchAttribute
    assert want == [ctypes.sizeof(C), C.gridDimZ.offset, C.sharedMemBytes.offset, C.hStream.offset, C.attrs.offset,
                    C.numAttrs.offset, ctypes.sizeof(A), A.value.offset, 0,
                    cb.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]


def test_kernel_params_point_at_each_value_in_its_c_type():
    class Dev:  # a device array, as far as kernel_params goes
        def __init__(self, ptr):
            self.data = type("P", (), {"ptr": ptr})()

    class CP:
        ndarray = Dev
    args = (Dev(0x7F0000001000), np.int32(-5), np.int64(1 << 40), np.float32(0.25), np.uint32(7))
    params, keep = cb.kernel_params(CP, args)
    assert ctypes.c_void_p.from_address(params[0]).value == 0x7F0000001000
    assert ctypes.c_int32.from_address(params[1]).value == -5
    assert ctypes.c_int64.from_address(params[2]).value == 1 << 40
    assert ctypes.c_float.from_address(params[3]).value == 0.25
    assert ctypes.c_uint32.from_address(params[4]).value == 7
    for bad in (5, 0.5, np.zeros(2, np.float32)):  # ambiguous widths, host memory
        with pytest.raises(TypeError):
            cb.kernel_params(CP, (bad,))
