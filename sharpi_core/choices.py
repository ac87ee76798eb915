"""The values llama.cpp's flags take that the engine names too: KV cache types and sampler stages (with
llama.cpp's spellings). Torch-free, so the CLI checks a command line before it imports or loads anything.
"""
from __future__ import annotations

from typing import Sequence

CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")  # -ctk / -ctv (kv_cache.py)
QUANTIZED_CACHE_TYPES = ("q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")  # ggml_is_quantized: rotated; as V, flash attention only

DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
# --sampling-seq letters (llama.cpp's common_sampler_type_to_chr)
SAMPLER_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                 "m": "min_p", "x": "xtc", "t": "temperature", "a": "adaptive_p", "i": "infill"}
# the stages that change logits from the history; they come before every filter here
HISTORY_SAMPLERS = ("penalties", "dry")


_NAMES = {"penalties": "penalties", "dry": "dry", "top_n_sigma": "top_n_sigma", "top_k": "top_k", "typ_p": "typ_p",
          "top_p": "top_p", "min_p": "min_p", "xtc": "xtc", "temperature": "temperature", "adaptive_p": "adaptive_p",
          "infill": "infill", "nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}
_NAMES.update({a: c for c in list(_NAMES) if "_" in c for a in (c.replace("_", "-"), c.replace("_", ""))})


def is_sampler_name(name: str) -> bool:
    """Whether llama.cpp knows `name` as a sampler's (any case; sharpi also takes surrounding white space)."""
    return name.strip().lower() in _NAMES


def sampler_order(names: Sequence[str]) -> tuple[str, ...]:
    """llama.cpp's --samplers / --sampling-seq entries (its names, kebab-case and dash-less aliases,
    `nucleus`, `temp`, `typ`; any case) -> the chain's stage names. ValueError for a name llama.cpp
    does not know, for a stage given twice, and for penalties or DRY
    after a filter (they run on the whole vocabulary before the filters here). `adaptive_p` may stand
    anywhere: it always picks the token at the end of the chain (llama.cpp's rule)."""
    out: list[str] = []
    for n in names:
        key = n.strip().lower()
        if key not in _NAMES:
            raise ValueError(f"unknown sampler '{n}' (known: {', '.join(DEFAULT_SAMPLERS)}, adaptive_p, infill)")
        if _NAMES[key] in out:
            raise ValueError(f"{_NAMES[key]} is given twice")
        out.append(_NAMES[key])
    filters = [i for i, n in enumerate(out) if n not in HISTORY_SAMPLERS and n != "adaptive_p"]
    late = [n for i, n in enumerate(out) if n in HISTORY_SAMPLERS and filters and i > filters[0]]
    if late:
        raise ValueError(f"{late[0]} must come before the other samplers (it sees the whole vocabulary)")
    return tuple(out)
