"""Control vectors (llama.cpp's --control-vector): a direction added to the residual stream after layers.

A control-vector GGUF holds F32 vectors `direction.N` of n_embd values, N >= 1 the layer whose output
they are added to. Several files (each with its strength) add up, as do several tensors of one layer
in one file; llama.cpp's rules (common_control_vector_load, llama_adapter_cvec): every value is
`src * strength` added in float32, files in the order given; layer 0 never takes one; the layers
applied are those in [start, end] (start <= 0: 1, end <= 0: the model's layer count) that the files
reach, below the layer count.
"""
from __future__ import annotations

import os
import re
from collections.abc import Sequence

import gguf
import numpy as np

from sharpi_core.errors import UsageError
from sharpi_core.gguf_file import BigEndian, Reader

_NAME = re.compile(r"direction\.(-?\d+)")


def open_gguf(path: str, what: str) -> gguf.GGUFReader:
    """A control vector's or adapter's file (what: "control vector", "LoRA"), or one error line saying why not. Read
    by the models' reader (gguf_file.Reader), which bounds its metadata arrays by the file's size."""
    if not os.path.exists(path):
        raise UsageError(f"{what} {path}: no such file")
    if not os.path.isfile(path):  # (a FIFO would wait for a writer)
        raise UsageError(f"{what} {path}: not a regular file")
    try:
        return Reader(path, "r")
    except BigEndian as e:
        raise UsageError(f"{what} {path}: {e}") from None
    except Exception as e:  # noqa: BLE001 (a corrupt file: gguf raises whatever its parser meets)
        raise UsageError(f"{what} {path}: not a readable GGUF file ({e})") from None


def _read_one(path: str, strength: float) -> tuple[int, dict[int, np.ndarray]]:
    """(n_embd, {layer: strength * its directions summed}) of one file."""
    reader = open_gguf(path, "control vector")
    n_embd, layers = -1, {}
    s = np.float32(strength)
    for t in reader.tensors:
        m = _NAME.fullmatch(t.name)
        if m is None:
            raise UsageError(f"control vector {path}: tensor '{t.name}' is not direction.<layer>")
        il = int(m[1])
        if il <= 0:
            raise UsageError(f"control vector {path}: '{t.name}': layer indices start at 1")
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise UsageError(f"control vector {path}: '{t.name}' is {t.tensor_type.name}, not F32")
        if any(int(d) != 1 for d in t.shape[1:]):
            raise UsageError(f"control vector {path}: '{t.name}' is not one-dimensional")
        v = np.asarray(t.data, dtype=np.float32).reshape(-1)
        if n_embd == -1:
            n_embd = v.size
        elif v.size != n_embd:
            raise UsageError(f"control vector {path}: '{t.name}' has {v.size} values, the others {n_embd}")
        prev = layers.get(il)
        layers[il] = v * s if prev is None else prev + v * s
    if n_embd == -1:
        raise UsageError(f"control vector {path}: no direction tensors")
    return n_embd, layers


def load(files: Sequence[tuple[str, float]], n_embd: int, n_layer: int,
         layer_range: tuple[int, int] = (-1, -1)) -> dict:
    """{layer index: float32 tensor [n_embd]} to add to that layer's output, from (path, strength) pairs."""
    import torch  # (parse_scaled runs while the command line is checked, before torch is imported)
    total: dict[int, np.ndarray] = {}
    for path, strength in files:
        n, layers = _read_one(path, strength)
        if n != n_embd:
            raise UsageError(f"control vector {path}: {n} values a direction, the model's embedding has {n_embd}")
        for il, v in layers.items():
            total[il] = v if il not in total else total[il] + v
    start, end = layer_span(layer_range, n_layer)
    return {il: torch.from_numpy(np.ascontiguousarray(v)) for il, v in sorted(total.items()) if start <= il <= end}


def layer_span(layer_range: tuple[int, int] | None, n_layer: int) -> tuple[int, int]:
    """--control-vector-layer-range START END -> the first and last layer whose output a vector is added to
    (llama.cpp's: START <= 0 is 1, END <= 0 the last, and no vector for layer 0 or past the last); empty when
    first > last."""
    start, end = layer_range or (-1, -1)
    return 1 if start <= 0 else start, min(n_layer if end <= 0 else end, n_layer - 1)


FLOAT32_MAX = float(np.finfo(np.float32).max)


def parse_scaled(values: Sequence[str], flag: str = "--control-vector-scaled") -> list[tuple[str, float]]:
    """--control-vector-scaled FNAME:SCALE,... (the flag may repeat; --lora-scaled's format too) -> [(path, scale)]."""
    out = []
    for value in values:
        for item in value.split(","):
            path, sep, scale = item.rpartition(":")
            try:
                number = float(scale)
            except ValueError:
                sep = ""
            if not sep or not path:
                raise UsageError(f"invalid {flag} '{item}': the format is FNAME:SCALE")
            if not abs(number) <= FLOAT32_MAX:  # (applied in float32: inf or nan would make every logit nan)
                raise UsageError(f"invalid {flag} '{item}': the scale must be a finite float32 number")
            out.append((path, number))
    return out
