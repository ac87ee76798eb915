"""Verification rules as pure functions.

Greedy: accept the longest prefix where draft == target argmax (so the output is the plain
greedy chain). Sampled (Leviathan et al. / Chen et al.): accept d_i with probability
min(1, p(d_i)/q(d_i)); at the first rejection draw from normalize(max(0, p - q)); after a full
accept draw the bonus token from the last row. Deterministic proposals (prompt lookup) have a
one-hot q: accept with probability p(d), else draw from p with d removed. Either way the emitted
tokens are an exact sample of the target's p.
"""
from __future__ import annotations

import torch


def accept_greedy(draft: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """draft [k], target_logits [k+1, V] (penalties/bias applied) -> (n accepted, next token)."""
    am = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == am[n]:
        n += 1
    return n, am[n]


def accept_sampled(draft: list[int], q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator | None,
                   p_min: float = 0.0) -> tuple[int, int]:
    """draft [k], q [k, V] (None = deterministic proposals), p [k+1, V] -> (n accepted, next token).

    p_min > 0 also accepts d_i whenever p(d_i) >= p_min: NOT distribution-preserving (opt-in)."""
    k = len(draft)
    if k:
        d = torch.tensor(draft)
        pd = p[torch.arange(k), d]
        qd = q[torch.arange(k), d] if q is not None else torch.ones(k)
        u = torch.rand(k, generator=generator)
        ok = (u * qd < pd) | (pd >= p_min if p_min > 0 else torch.zeros(k, dtype=torch.bool))
        rejected = (~ok).nonzero()
        if rejected.numel():
            i = int(rejected[0])
            if q is not None:
                resid = (p[i] - q[i]).clamp_min(0)
            else:
                resid = p[i].clone()
                resid[draft[i]] = 0
            if float(resid.sum()) <= 0:  # p == q on the support: any draw from p is exact
                resid = p[i]
            return i, int(torch.multinomial(resid, 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))
