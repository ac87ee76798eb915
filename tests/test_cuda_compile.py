"""The CUDA sources build, and their block decoding is right, without a GPU.

- every cuda/*.cu compiles with nvcc to PTX for sm_80 and sm_90, and to an sm_90 cubin with
  qmatvec.cu cut down to one weight type (-DQMV_ONLY), so ptxas checks the inline PTX too while
  the test stays fast; skipped where nvcc is not on PATH;
- the same sources, expanded as sharpi_core.backends.cuda hands them to NVRTC, compile with NVRTC
  and CuPy's options to cubins, every module the wrapper builds, each holding the kernels the wrapper
  launches from it, when a libnvrtc is found (pip's nvidia-cuda-nvrtc, which the test extra
  installs on Linux x86-64; the toolkit's; or $SHARPI_NVRTC_LIB);
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
import struct
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


# What ptxas may put in local memory (a thread's stack, slow as global memory) in the sm_90 cubins below:
# sincosf's reduction of large angles (rope_f32 without a table; CUDA's own), and the 8-row Q4_K integer matvec
# at the 168 registers its launch bounds leave (one 8-byte spill).
LOCAL_OK = {"rope_f32": 32, "qmvi_q4_k_q8_r4": 8}


def ptxas_usage(log: str) -> dict[str, dict[str, int]]:
    """nvcc --resource-usage's log -> {kernel: {"stack": bytes, "spill": bytes stored, "regs": registers}}."""
    out: dict[str, dict[str, int]] = {}
    for m in re.finditer(r"Function properties for (\w+)\s+(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads\s+ptxas info\s+: Used (\d+) registers", log):
        out[m[1]] = {"stack": int(m[2]), "spill": max(int(m[3]), int(m[4])), "regs": int(m[5])}
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_nvcc_compiles(tmp_path):
    # Whole sources to PTX for both archs (the front end: every kernel of every weight type), and a
    # cubin with qmatvec.cu cut down to one weight type (Q4_K, the known models' most used) so that ptxas
    # checks the inline PTX too; full cubins for both archs would take about twice as long and check
    # nothing more. The cubins' resource usage: no kernel keeps anything in local memory (stack frames,
    # spills) beyond LOCAL_OK, where README's GPU section says ptxas gave the attention kernels 64-112 bytes
    # of stack once, and the rounding kernels 32-64, until they kept their values in registers.
    jobs = [(s, a, "-ptx", ()) for s in SOURCES for a in ARCHS]
    jobs += [(s, "sm_90", "-cubin", ("-DQMV_ONLY=12", "--resource-usage")) for s in SOURCES]
    with ThreadPoolExecutor(max_workers=min(len(jobs), max(2, os.cpu_count() or 2))) as ex:
        results = list(ex.map(lambda j: _nvcc(*j, tmp_path), jobs))
    failed = [f"{cmd}\nexit {rc}:\n{log}" for cmd, rc, log in results if rc != 0]
    assert not failed, "\n\n".join(failed)
    usage = {k: v for cmd, _, log in results if "--resource-usage" in cmd for k, v in ptxas_usage(log).items()}
    assert {"rms_norm_f32", "attn_partial_f16_f16", "qmvi_q4_k_q1_r1", "qmv_q4_k_q16_r4"} <= set(usage), sorted(usage)
    local = {k: max(v["stack"], v["spill"]) for k, v in usage.items() if v["stack"] or v["spill"]}
    over = {k: b for k, b in local.items() if b > LOCAL_OK.get(k, 0)}
    assert not over, f"kernels using local memory (bytes; allowed: {LOCAL_OK}): {over}"


# ---- NVRTC (the path CuPy takes) -------------------------------------------------------------------

def _find_nvrtc() -> str | None:
    env = os.environ.get("SHARPI_NVRTC_LIB")
    if env:
        return env
    cands = []
    try:  # pip's nvidia-cuda-nvrtc (the test extra): nvidia/cu13/lib, or nvidia/cuda_nvrtc/lib for -cu12
        import nvidia  # noqa: PLC0415
        for base in nvidia.__path__:
            cands += sorted(glob.glob(os.path.join(base, "*", "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    cands = [c for c in cands if "alt" not in os.path.basename(c) and "builtins" not in os.path.basename(c)]
    return cands[0] if cands else ctypes.util.find_library("nvrtc")


def _nvrtc_compile(lib, source: str, name: str, options: list[str]) -> tuple[int, str, bytes]:
    """-> (nvrtc status, log, cubin)."""
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
        cubin = b""
        if rc == 0:
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            out = ctypes.create_string_buffer(size.value)
            assert lib.nvrtcGetCUBIN(prog, out) == 0
            cubin = out.raw
        return rc, buf.value.decode(errors="replace"), cubin
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _elf_functions(elf: bytes) -> set[str]:
    """The global function symbols of an ELF64 little-endian object (a cubin's kernels)."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        str_off = sections[link][4]
        for j in range(size // entsize):
            st_name, st_info = struct.unpack_from("<IB", elf, off + j * entsize)
            if st_info >> 4 == 1 and st_info & 0xF == 2:  # STB_GLOBAL, STT_FUNC
                end = elf.index(b"\0", str_off + st_name)
                names.add(elf[str_off + st_name:end].decode())
    return names


def _launched_kernels(module_options: tuple) -> set[str]:
    """The kernel names sharpi_core.backends.cuda asks a module built with these options for."""
    if module_options:  # a qmatvec module of one weight type
        t = Q(int(module_options[0].split("=")[1]))
        tn = cb.TYPE_NAMES[t]
        variants = set(cb.QMV_VARIANTS) | set(cb.QMV_TALL.items())
        kinds = ("qmv", "qmvi") if t in cb.INT_LANE_SPAN else ("qmv",)  # the integer matvecs too
        return {f"deq_rows_{tn}"} | {f"{kind}_{tn}_q{nq}_r{r}" for kind in kinds for nq, r in variants}
    text = Path(cb.__file__).read_text()
    names = set(re.findall(r'function\("ops", "(\w+)"\)', text))
    # the two names built at run time: kv_append's cache type, attention's (K, V) cache types
    assert len(re.findall(r'function\("ops", [^"]', text)) == 2, "a new computed kernel name: list it here"
    kinds = ("f16", "q8_0")
    return names | {f"kv_append_{k}" for k in kinds} | {f"attn_partial_{k}_{v}" for k in kinds for v in kinds}


# Options CuPy (13, 14) adds to every RawModule compile with NVRTC (and "--pch" from NVRTC 12.8 on).
CUPY_ADDS = ("-ftz=true", "--device-as-default-execution-space")


def test_nvrtc_compiles():
    # Every module the wrapper builds (ops.cu; qmatvec.cu once per weight type), compiled the way
    # CuPy's RawModule does (its options, -arch=sm_XX: a cubin, so ptxas checks the inline PTX too),
    # holds every kernel the wrapper launches from it.
    path = _find_nvrtc()
    if not path:
        pytest.skip("no libnvrtc found (pip install nvidia-cuda-nvrtc, or set SHARPI_NVRTC_LIB)")
    # libnvrtc dlopens its builtins library by name: pip's nvidia-cuda-nvrtc 13.0 has no $ORIGIN rpath to find it
    # beside itself (13.5 has; a CUDA torch preloads it), so it is loaded first, as CuPy does for pip's wheels
    for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
        try:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        pytest.skip(f"cannot load {path}: {e}")
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.nvrtcVersion.argtypes = [ctypes.POINTER(I), ctypes.POINTER(I)]
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(P), ctypes.c_char_p, ctypes.c_char_p, I, P, P]
    lib.nvrtcCompileProgram.argtypes = [P, I, ctypes.POINTER(ctypes.c_char_p)]
    lib.nvrtcGetProgramLogSize.argtypes = lib.nvrtcGetCUBINSize.argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
    lib.nvrtcGetProgramLog.argtypes = lib.nvrtcGetCUBIN.argtypes = [P, ctypes.c_char_p]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(P)]
    major, minor = I(), I()
    assert lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0
    adds = CUPY_ADDS + (("--pch",) if (major.value, minor.value) >= (12, 8) else ())
    modules = [("ops", ())] + [("qmatvec", cb.qmv_options(t)) for t in cb.TYPE_NAMES]
    jobs = [(name, extra, "sm_90") for name, extra in modules] + [("ops", (), "sm_80"),
                                                                   ("qmatvec", cb.qmv_options(Q.Q6_K), "sm_80")]

    def one(job):
        name, extra, arch = job
        rc, log, cubin = _nvrtc_compile(lib, cb.kernel_source(name), f"{name}.cu",
                                        [*cb.NVRTC_OPTIONS, *extra, *adds, f"-arch={arch}"])
        if rc != 0:
            return f"{name} {extra} {arch}: nvrtc error {rc}:\n{log}"
        # --pch logs its header files (there are none to precompile: it only talks)
        said = [ln for ln in log.splitlines() if ln.strip() and "precompiled header" not in ln
                and "-diag-suppress" not in ln]
        if said:
            return f"{name} {extra} {arch}: warnings:\n{log}"
        missing = _launched_kernels(extra) - _elf_functions(cubin)
        return f"{name} {extra} {arch}: no kernel {sorted(missing)}" if missing else None
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
        failed = [r for r in ex.map(one, jobs) if r]
    assert not failed, f"NVRTC {major.value}.{minor.value}:\n" + "\n\n".join(failed)


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
    # first ask the L2 for their weights and the next matrices' (memory no kernel writes; the RMSNorm too),
    # attention for its cache rows (a prefetch reads nothing into the SM) from the pass's positions (an input
    # no kernel writes)
    seen = []
    for src in SOURCES:
        text = re.sub(r"//[^\n]*", "", src.read_text()).replace("\\\n", "\n")
        for m in _KERNEL_DEF.finditer(text):
            body = re.sub(r"\s+", " ", _body_start(text, text.index("(", m.end() - 1))).lstrip()
            # (the matvecs: qmv_ / qmvi_ kernels, named as kind##_##tname... in qmatvec.cu's QMV_KERNEL)
            matvec = m[1].startswith(("qmv_", "qmvi_", "kind##_"))
            body = re.sub(r"^qmv_prefetch\([^;]*\); prefetch_ranges\([^;]*\); ", "", body) if matvec else body
            body = re.sub(r"^(attn|rms)_prefetch\([^;]*\); ", "", body)
            assert body.startswith("KERNEL_BEGIN();"), f"{src.name}: {m[1]} starts with {body[:60]!r}"
            seen.append(m[1])
    assert len(seen) >= 18 and any(n.startswith("kind##_") for n in seen) and any(n.startswith("attn_") for n in seen)


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
