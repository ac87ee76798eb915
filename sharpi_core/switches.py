"""The SHARPI_* environment switches of README's "Environment switches" table, read by one rule.

A switch is off for 0 / off / false / no and on for 1 / on / true / yes (any case, spaces around ignored);
unset or empty keeps its default. Any other value keeps the default too, and `unknown()` lists it so that
the command line can say so (a bisecting run whose switch was silently not taken would mislead)."""
from __future__ import annotations

import os

OFF = ("0", "off", "false", "no")
ON = ("1", "on", "true", "yes")

# name -> default; README's table says what each does
SWITCHES = {
    "SHARPI_SPEC_BATCH_VERIFY": True, "SHARPI_SPEC_SAMPLE": True, "SHARPI_SPEC_ADAPTIVE": True,
    "SHARPI_SPEC_COUNT": True, "SHARPI_SPEC_LOOKAHEAD": True, "SHARPI_SPEC_CONFIDENCE": True,
    "SHARPI_CPU_KERNEL": True, "SHARPI_FAST_DECODE": True,
    "SHARPI_DECODE_C": True, "SHARPI_THREADS_ADAPT": True, "SHARPI_AMX": True, "SHARPI_CPU_REPACK": True,
    "SHARPI_ACT_QUANT": True, "SHARPI_FLASH_ATTN": True, "SHARPI_KV_ROT": True, "SHARPI_CUDA_GRAPH": True,
    "SHARPI_DEVICE_ARGMAX": True, "SHARPI_DEVICE_SAMPLE": True, "SHARPI_CUDA_FUSE": True, "SHARPI_CUDA_FUSE_COMBINE": True, "SHARPI_CUDA_PDL": True,
    "SHARPI_CUDA_DP4A": True, "SHARPI_CUDA_ATT_UNITS": True, "SHARPI_CUDA_AHEAD": True, "SHARPI_KERNEL_LTO": True,
    "SHARPI_KERNEL_AVX2": False, "SHARPI_KERNEL_NO_VNNI": False, "SHARPI_KERNEL_NO_BF16": False,
    "SHARPI_KERNEL_CTYPES": False,
}
# SHARPI_SPEC_COST is three-way: unset (by measured cost in greedy decoding, fixed costs when sampling), off, on
TRI_STATE = ("SHARPI_SPEC_COST",)
# what changes the arithmetic of a CPU model's passes, hence the K and V a prompt cache holds
ARITHMETIC = ("SHARPI_CPU_KERNEL", "SHARPI_ACT_QUANT")


def _value(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def switch(name: str) -> bool:
    """Whether the switch `name` (a key of SWITCHES) is on."""
    v = _value(name)
    return False if v in OFF else True if v in ON else SWITCHES[name]


def tri_state(name: str) -> bool | None:
    """A TRI_STATE switch: True, False, or None (unset, or a value that is neither)."""
    v = _value(name)
    return False if v in OFF else True if v in ON else None


def unknown() -> list[str]:
    """NAME=VALUE of every switch set to a value that is neither on nor off (the default is kept)."""
    return [f"{n}={os.environ[n]}" for n in (*SWITCHES, *TRI_STATE) if _value(n) and _value(n) not in OFF + ON]


def arithmetic() -> list[str]:
    """The ARITHMETIC switches turned away from their defaults, as NAME=0 / NAME=1."""
    return [f"{n}={int(switch(n))}" for n in ARITHMETIC if switch(n) != SWITCHES[n]]
