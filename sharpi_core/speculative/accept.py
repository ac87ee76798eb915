"""Verification rules as pure functions.

Greedy: accept the longest prefix where draft == target argmax, then emit the target's argmax
(so the output is the plain greedy chain, token for token).

Sampled (Leviathan et al. 2023, Chen et al. 2023): accept d_i with probability min(1, p(d_i)/q(d_i));
at the first rejection draw from normalize(max(0, p - q)); when all k are accepted draw the bonus
token from p[k]. Deterministic proposals (prompt lookup; q is None) are the one-hot case: accept
with probability p(d), else draw from p with d removed. Either way the emitted tokens are an exact
sample of the target's p. Randomness: k uniforms up front, then one draw, all from `generator`.

p and q rows may have different widths (draft and target vocabularies may differ by a few
tokens): a missing column is probability 0, so a draft token outside the target's vocabulary is
always rejected and the residual never picks one.
"""
from __future__ import annotations

import numpy as np
import torch

from ..sampling import NoDistribution, argmax, draw


def accept_greedy(draft: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """draft [k], target_logits [k+1, V] (bias/penalties applied; row i predicts the token after
    d_1..d_i) -> (n accepted, next token: the target's argmax after the accepted prefix).

    k rows are enough when d_k cannot be the argmax (a token outside the target's vocabulary). A NaN at a row's
    arg-max is NoDistribution only in the rows the verdict reads (up to the first mismatch): plain decoding never
    computes the rows after it."""
    am = argmax(target_logits)
    n, nxt = accept_argmax(draft, am.tolist())
    if torch.isnan(target_logits[torch.arange(n + 1), am[: n + 1].to(target_logits.device)]).any():
        raise NoDistribution()
    return n, nxt


def accept_argmax(draft: list[int], am: list[int]) -> tuple[int, int]:
    """accept_greedy given the rows' arg-maxes am [k+1] (taken where the logits are)."""
    n, lim = 0, min(len(draft), len(am) - 1)
    while n < lim and draft[n] == am[n]:
        n += 1
    return n, am[n]


def _np(m: torch.Tensor):
    return m.detach().cpu().numpy()


def accept_sampled(draft: list[int], q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator | None,
                   p_min: float = 0.0) -> tuple[int, int]:
    """draft [k]; q [k, Vq] the draft distributions the d_i were drawn from (None = deterministic
    proposals); p [k+1, V] the target's filtered distributions (row i for the token after d_1..d_i)
    -> (n accepted, next token).

    p may have only k rows when the last draft token is certain to be rejected (p(d_k) = 0).
    p_min > 0 also accepts d_i whenever p(d_i) >= p_min: NOT distribution-preserving (opt-in)."""
    k = len(draft)
    pn = _np(p)
    V = pn.shape[1]
    if k:
        qn = _np(q) if q is not None else None
        u = torch.rand(k, generator=generator, dtype=torch.float64).tolist()
        for i, d in enumerate(draft):
            pd = float(pn[i, d]) if 0 <= d < V else 0.0
            qd = (float(qn[i, d]) if d < qn.shape[1] else 0.0) if qn is not None else 1.0
            if u[i] * qd < pd or (p_min > 0 and pd >= p_min):
                continue
            # rejected: draw from the residual (its support is within p's)
            sup = np.flatnonzero(pn[i])
            pi = pn[i, sup].astype(np.float64)
            if qn is not None:
                inq = sup < qn.shape[1]
                qi = np.zeros(sup.shape[0])
                qi[inq] = qn[i, sup[inq]]
                resid = np.maximum(pi - qi, 0.0)
            else:
                resid = np.where(sup == d, 0.0, pi)
            if not resid.sum() > 0:  # p <= q everywhere (rounding): any draw from p is exact
                resid = pi
            return i, int(sup[draw(resid, generator)])
    if pn.shape[0] <= k:
        raise ValueError("accept_sampled: all drafts accepted but p has no bonus row")
    sup = np.flatnonzero(pn[k])
    return k, int(sup[draw(pn[k, sup], generator)])
