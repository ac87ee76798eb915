"""Synthetic acceptance, for benchmarking (llama.cpp's --spec-synth-len / --spec-synth-rates): each step accepts
the first proposals at random with given chances instead of verifying them, so a run's speed can be measured at an
acceptance rate the drafter would not reach on its own. The output is not the target's: the verify pass runs as it
always does (its rows' costs are what is measured), then the target's token follows the last accepted proposal.

rates[i] is the unconditional chance that the proposals up to i are all accepted (non-increasing); a mean
acceptance length L (tokens a step emits, the target's token included) gives rates[i] = p^(i+1) with p chosen so
that 1 + p + ... + p^n_max = L, as llama.cpp's common_speculative_synth_rates_resolve does."""
from __future__ import annotations

import math


def resolve_rates(length: float | None, rates: list[float] | None, n_max: int) -> list[float]:
    """--spec-synth-len or --spec-synth-rates for proposals of up to n_max tokens -> rates [n_max]. ValueError
    (llama.cpp's checks and messages) on what cannot be used."""
    if length is not None and rates is not None:
        raise ValueError("synthetic acceptance length and rates are mutually exclusive")
    if n_max <= 0:
        raise ValueError("synthetic acceptance requires at least one speculative token")
    if rates is not None:
        if len(rates) != n_max:
            raise ValueError(f"synthetic acceptance rates must contain {n_max} values (one a proposal, "
                             f"--spec-draft-n-max), got {len(rates)}")
        for i, r in enumerate(rates):
            if not (math.isfinite(r) and 0.0 <= r <= 1.0):
                raise ValueError("synthetic acceptance rates must be finite and within [0, 1]")
            if i > 0 and r > rates[i - 1]:
                raise ValueError("synthetic acceptance rates must be monotonically non-increasing")
        return list(rates)
    top = n_max + 1.0
    if not (math.isfinite(length) and 1.0 <= length <= top):
        raise ValueError(f"synthetic acceptance length must be finite and within [1, {top:.0f}]")
    p = 1.0 if length == top else 0.0
    if 1.0 < length < top:  # (bisection: the sum grows with p)
        lo, hi = 0.0, 1.0
        for _ in range(32):
            mid = 0.5 * (lo + hi)
            s = sum(mid ** (j + 1) for j in range(n_max))
            lo, hi = (mid, hi) if s < length - 1.0 else (lo, mid)
        p = 0.5 * (lo + hi)
    return [p ** (i + 1) for i in range(n_max)]


def conditional(rates: list[float]) -> list[float]:
    """rates -> the chance of accepting proposal i once the ones before it are accepted."""
    out, prev = [], 1.0
    for r in rates:
        out.append(r / prev if prev > 0.0 else 0.0)
        prev = r
    return out


def parse_rates(value: str) -> list[float]:
    """--spec-synth-rates P0,P1,...: each value read whole, nothing left over (as llama.cpp's std::stod check)."""
    try:
        return [float(v.strip()) for v in value.split(",")]
    except ValueError:
        raise ValueError(f"invalid --spec-synth-rates '{value}': comma-separated probabilities expected") from None
