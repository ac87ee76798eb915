"""GGUF access: a memory-mapped reader with typed metadata lookups.

Everything goes through the `gguf` package's reader; tensors stay views into the mmap
(no copy of the file is made at load).
"""
from __future__ import annotations

import os
from functools import cached_property
from typing import Any

import gguf
import numpy as np

from .errors import SharpiError


class GGUFFile:
    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise SharpiError(f"model file not found: {self.path}")
        try:
            self.reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the gguf package raises ValueError/struct errors/etc.
            raise SharpiError(f"{self.path}: not a valid GGUF file ({type(e).__name__}: {e})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value as a Python object (str, int, float, bool, list)."""
        f = self.reader.fields.get(key)
        if f is None:
            return default
        v = f.contents()
        if isinstance(v, np.generic):
            v = v.item()
        return v

    def require(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise SharpiError(f"{self.path}: missing GGUF metadata key '{key}'")
        return v

    @cached_property
    def arch(self) -> str:
        return str(self.require("general.architecture"))

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """`<arch>.<suffix>`, e.g. arch_get('block_count')."""
        return self.get(f"{self.arch}.{suffix}", default)

    def field_array(self, key: str) -> np.ndarray | None:
        """A numeric array field (token scores/types) as one numpy array, without a Python list."""
        f = self.reader.fields.get(key)
        if f is None:
            return None
        return np.concatenate([f.parts[i] for i in f.data]) if f.data else np.zeros(0)

    def tensor(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise SharpiError(f"{self.path}: tensor '{name}' missing (arch {self.arch})")
        return t
