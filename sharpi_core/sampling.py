"""Sampling as pure functions of (logits, params, generator), in llama.cpp's order:
logit bias -> penalties -> top-k -> top-p -> min-p -> temperature -> draw.

`filtered_probs` exposes the final distribution itself, because speculative sampling needs the
target's p and the draft's q after the same filters. Greedy (temp <= 0) is an exact argmax.
Everything works on one row [V] or a batch of rows [T, V].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temp <= 0

    @property
    def has_penalties(self) -> bool:
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                            or self.frequency_penalty != 0.0)


def adjust_logits(logits: torch.Tensor, params: SamplingParams, histories: list[list[int]] | None) -> torch.Tensor:
    """Logit bias, then repeat/presence/frequency penalties over each row's own history.

    logits [T, V] with one history per row (row i of a speculative verify pass sees the drafts
    before it), or [V] with one history. Returns a new tensor; the input is left untouched."""
    one = logits.dim() == 1
    x = logits.unsqueeze(0) if one else logits
    if not params.logit_bias and not params.has_penalties:
        return logits
    x = x.clone()
    if params.logit_bias:
        ids = torch.tensor([i for i, _ in params.logit_bias])
        x[:, ids] += torch.tensor([b for _, b in params.logit_bias], dtype=x.dtype)
    if params.has_penalties and histories:
        hs = [histories] if one else histories
        for r, h in enumerate(hs):
            window = h[-params.repeat_last_n:] if params.repeat_last_n > 0 else h
            if not window:
                continue
            counts = torch.bincount(torch.tensor(window), minlength=x.shape[1])[: x.shape[1]]
            seen = counts > 0
            row = x[r]
            pen = torch.where(row > 0, row / params.repeat_penalty, row * params.repeat_penalty)
            row = torch.where(seen, pen, row)
            row = row - counts.to(row.dtype) * params.frequency_penalty - seen.to(row.dtype) * params.presence_penalty
            x[r] = row
    return x[0] if one else x


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from, [.., V] (zeros outside the kept candidates).

    Greedy gives a one-hot at the argmax. Apply `adjust_logits` first where penalties/bias apply."""
    one = logits.dim() == 1
    x = (logits.unsqueeze(0) if one else logits).float()
    V = x.shape[-1]
    if params.greedy:
        out = torch.zeros_like(x)
        out.scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
        return out[0] if one else out
    k = params.top_k if 0 < params.top_k < V else V
    vals, idx = torch.topk(x, k, dim=-1)  # sorted, descending: [T, k]
    keep = torch.ones_like(vals, dtype=torch.bool)
    if params.top_p < 1.0:
        p1 = torch.softmax(vals, dim=-1)
        before = torch.cumsum(p1, dim=-1) - p1  # mass of the better candidates
        keep &= before < params.top_p
    if params.min_p > 0.0:
        keep &= vals >= vals[:, :1] + math.log(params.min_p)
    keep[:, 0] = True  # min_keep = 1
    scaled = torch.where(keep, vals / params.temp, torch.full_like(vals, float("-inf")))
    p = torch.softmax(scaled, dim=-1)
    out = torch.zeros_like(x).scatter_(1, idx, p)
    return out[0] if one else out


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           history: list[int] | None = None) -> int:
    """One token from logits [V]."""
    x = adjust_logits(logits, params, history)
    if params.greedy:
        return int(torch.argmax(x))
    p = filtered_probs(x, params)
    return int(torch.multinomial(p, 1, generator=generator))


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))
