"""Sampling as pure functions of (logits, params, generator), in llama.cpp's chain order:

    logit bias -> penalties (repeat/frequency/presence) -> top-k -> top-p -> min-p -> temperature -> draw

(llama.cpp's common_sampler_init puts the logit-bias sampler first, then its default sampler list
`penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature`, then `dist`; DRY, top-n-sigma,
typical and XTC are off by default and not implemented here.)

Semantics, each as llama.cpp's src/llama-sampler.cpp:
- logit bias adds to the logit (several entries for one token add up; -inf bans it);
- penalties look at the last `repeat_last_n` tokens of the history (prompt included, 0 = off,
  -1 is turned into n_ctx by the CLI): a seen token's logit is multiplied by `repeat_penalty`
  when <= 0 and divided by it when > 0, then `count * frequency_penalty + presence_penalty`
  is subtracted;
- top-k (k <= 0: off) keeps the k highest logits;
- top-p (p >= 1: off) keeps the smallest prefix of the sorted candidates whose probability mass
  (softmax of the current candidates, before temperature) reaches p;
- min-p (p <= 0: off) keeps logits >= max logit + log(p), i.e. probability >= p * max probability;
- temperature divides the logits; temp <= 0 is greedy: an exact argmax of the biased/penalized
  logits (top-k/p and min-p always keep the argmax, so they cannot change it);
- at least one candidate is always kept (min_keep).

`filtered_probs` returns the final distribution itself ([V] or batched [T, V], zeros outside the
kept candidates), because speculative sampling needs the target's p and the draft's q after the
same chain. The vocabulary-wide work (top-k selection, argmax) runs in numpy on the logits' own
memory: on CPU it is several times faster than torch.topk/argmax for 50k-262k vocabularies, and
needs no thread pool. Randomness always comes from the caller's torch.Generator.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np
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

    @property
    def adjusts_logits(self) -> bool:
        """True when logit bias or penalties change the logits (they then depend on the history)."""
        return bool(self.logit_bias) or self.has_penalties


def argmax_on_device(model, params: SamplingParams) -> bool:
    """Whether `model` takes its greedy steps' arg-max where its logits are (a GPU model offering
    forward_argmax / greedy_chain, see backends.cuda_model) for these params: greedy decoding that needs
    of each logits row only the arg-max of row + a fixed logit bias, i.e. no penalties (they depend on
    the history) and bias ids distinct (one addition per logit, as apply_penalties)."""
    ids = [i for i, _ in params.logit_bias]
    return (bool(getattr(model, "device_argmax", False)) and params.greedy and not params.has_penalties
            and len(set(ids)) == len(ids))


def penalty_window(history: Sequence[int] | None, params: SamplingParams) -> list[int]:
    """The part of `history` the penalties look at (the last repeat_last_n tokens; all if < 0)."""
    if not history or not params.has_penalties:
        return []
    n = params.repeat_last_n
    return list(history[-n:]) if n > 0 else list(history)


# -- logit bias and penalties ------------------------------------------------------------------------
def _penalize_row(row: np.ndarray, window: Sequence[int], params: SamplingParams) -> None:
    if not window:
        return
    counts = Counter(window)
    V = row.shape[0]
    ids = np.fromiter((t for t in counts if 0 <= t < V), dtype=np.int64)
    if not ids.shape[0]:
        return
    cnt = np.fromiter((counts[t] for t in ids.tolist()), dtype=np.float32, count=ids.shape[0])
    v = row[ids]
    rp = np.float32(params.repeat_penalty)
    v = np.where(v <= 0, v * rp, v / rp)
    row[ids] = v - (cnt * np.float32(params.frequency_penalty) + np.float32(params.presence_penalty))


def apply_penalties(logits: torch.Tensor, history, params: SamplingParams) -> torch.Tensor:
    """Logit bias, then repeat/frequency/presence penalties (llama.cpp's order).

    logits [V] with `history` a list of token ids, or [T, V] with `history` one list per row (row i
    of a speculative verify pass sees the drafts before it; a flat list is shared by all rows).
    Returns a new float32 tensor when something applies, else `logits` itself (never modified)."""
    if not params.adjusts_logits:
        return logits
    one = logits.dim() == 1
    x = logits.detach().to("cpu", torch.float32).reshape(-1, logits.shape[-1]).numpy().copy()
    if params.logit_bias:
        # ids past the row's width (a draft head cut to the first N tokens) are not there to bias
        V = x.shape[1]
        ids = np.array([i for i, _ in params.logit_bias if i < V], dtype=np.int64)
        bias = np.array([b for i, b in params.logit_bias if i < V], dtype=np.float32)
        for r in range(x.shape[0]):
            np.add.at(x[r], ids, bias)
    if params.has_penalties and history:
        if one or (len(history) and not isinstance(history[0], (list, tuple))):
            rows = [history] * x.shape[0]
        else:
            rows = history
        with np.errstate(over="ignore"):  # huge penalties saturate to inf in float32, as in llama.cpp
            for r in range(x.shape[0]):
                _penalize_row(x[r], penalty_window(rows[r], params), params)
    out = torch.from_numpy(x)
    return out[0] if one else out


def adjust_logits(logits: torch.Tensor, params: SamplingParams, histories) -> torch.Tensor:
    """Same as apply_penalties, arguments in the older order."""
    return apply_penalties(logits, histories, params)


# -- the filter chain ---------------------------------------------------------------------------------
_SORT_SAMPLE_STRIDE = 64


def _desc(ids: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """`ids` reordered by `vals` descending (quicksort: deterministic; the order of equal values is
    settled by `_cut` where it matters, at a cut)."""
    return ids[np.argsort(-vals)]


def _cut(idx: np.ndarray, vals: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first n of candidates sorted by value; a run of equal values straddling the cut gives
    its places to the lowest ids (the run must be complete in idx)."""
    if n < vals.shape[0] and vals[n - 1] == vals[n]:
        b = vals[n - 1]
        hi = vals[:n] > b
        tied = np.sort(idx[vals == b])[: n - int(hi.sum())]
        return (np.concatenate([idx[:n][hi], tied]),
                np.concatenate([vals[:n][hi], np.full(tied.shape[0], b, dtype=vals.dtype)]))
    return idx[:n], vals[:n]


def _topk_sorted(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of x [V], sorted by value, descending (ties at the k-th
    value: lower ids first).

    A strided sample gives a threshold that lets through a few hundred values; only those are
    sorted. Otherwise argpartition finds the k-th value, and everything >= it is sorted."""
    V = x.shape[0]
    k = min(k, V)
    if k >= V or V <= 1024:
        order = _desc(np.arange(V), x)
        return _cut(order, x[order], k)[0]
    cand = None
    if V >= 8 * _SORT_SAMPLE_STRIDE and k <= V // (4 * _SORT_SAMPLE_STRIDE):
        sub = x[::_SORT_SAMPLE_STRIDE]
        j = min(sub.shape[0], k // 16 + 4)
        thr = np.partition(sub, sub.shape[0] - j)[sub.shape[0] - j]
        cand = np.flatnonzero(x >= thr)
        if cand.shape[0] < k:
            cand = None
    if cand is None:
        kth = x[np.argpartition(x, V - k)[V - k]]
        cand = np.flatnonzero(x >= kth)  # every tie of the k-th value
    cand = _desc(cand, x[cand])
    return _cut(cand, x[cand], k)[0]


def _logsumexp(v: np.ndarray) -> float:
    m = float(v.max())
    if not math.isfinite(m):
        return m
    return m + math.log(float(np.exp(v - np.float32(m)).sum(dtype=np.float64)))


def _nucleus(vals: np.ndarray, lse: float, top_p: float) -> int | None:
    """How many of the sorted `vals` top-p keeps: up to and including the first where the running
    probability mass (float32, like llama.cpp) reaches top_p; None if it never does."""
    p1 = np.exp(vals - np.float32(lse))
    cum = np.cumsum(p1, dtype=np.float32)
    reached = np.flatnonzero(cum >= np.float32(top_p))
    return int(reached[0]) + 1 if reached.shape[0] else None


def _row_candidates(x: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """One row of (penalized) float32 logits -> (token ids, probabilities float64) it is drawn from.

    Not for greedy (temp <= 0): that is an argmax."""
    V = x.shape[0]
    k = params.top_k if 0 < params.top_k < V else V
    use_p = params.top_p < 1.0
    use_min_p = params.min_p > 0.0
    if k < V:
        idx = _topk_sorted(x, k)
        vals = x[idx]
        lse = _logsumexp(vals)  # top-p's softmax runs over what top-k kept
    elif use_p:  # top-k off: the nucleus is usually within the best few hundred; widen until it fits
        lse = _logsumexp(x)
        for m in (256, 4096, 32768, V):
            idx = _topk_sorted(x, min(m, V))
            if m >= V or _nucleus(x[idx], lse, params.top_p) is not None:
                break
        vals = x[idx]
    elif use_min_p:
        thr = np.float32(x.max()) + np.float32(math.log(params.min_p))
        idx = np.flatnonzero(x >= thr)
        idx = _desc(idx, x[idx])
        vals = x[idx]
        lse = 0.0
    else:  # no filter at all: every token, unsorted
        z = np.exp((x - x.max()) / np.float32(params.temp))
        return np.arange(V), z / z.sum(dtype=np.float64)
    n = vals.shape[0]
    if use_p and n > 1:
        m = _nucleus(vals, lse, params.top_p)
        if m is not None:
            n = m
    if use_min_p and n > 1:
        thr = vals[0] + np.float32(math.log(params.min_p))
        n = max(1, min(n, int(np.count_nonzero(vals[:n] >= thr))))  # sorted: a prefix
    idx, vals = _cut(idx, vals, n)
    z = vals.astype(np.float64) / float(np.float32(params.temp))
    z = np.exp(z - z.max())
    return idx, z / z.sum()


def candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [m], probabilities [m] float64) a token is drawn from, for one row of logits [V]
    already passed through apply_penalties. Greedy: the argmax with probability 1."""
    x = logits.detach().to("cpu", torch.float32).reshape(-1).numpy()
    if params.greedy:
        return torch.tensor([int(np.argmax(x))]), torch.ones(1, dtype=torch.float64)
    idx, p = _row_candidates(x, params)
    return torch.from_numpy(idx), torch.from_numpy(p)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from, float32 [V] or [T, V] (zeros outside the kept
    candidates). Pass logits through apply_penalties first where bias/penalties apply.
    Greedy gives a one-hot at the argmax."""
    one = logits.dim() == 1
    x = logits.detach().to("cpu", torch.float32).reshape(-1, logits.shape[-1]).numpy()
    out = np.zeros(x.shape, dtype=np.float32)
    for r in range(x.shape[0]):
        if params.greedy:
            out[r, int(np.argmax(x[r]))] = 1.0
        else:
            idx, p = _row_candidates(x[r], params)
            out[r, idx] = p
    t = torch.from_numpy(out)
    return t[0] if one else t


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax ([V] -> scalar, [T, V] -> [T]), lowest id on ties, like torch.argmax."""
    x = logits.detach().to("cpu", torch.float32).numpy()
    return torch.from_numpy(np.asarray(np.argmax(x, axis=-1), dtype=np.int64))


# -- drawing -------------------------------------------------------------------------------------------
def draw(weights, generator: torch.Generator | None) -> int:
    """Index drawn with probability proportional to `weights` (1-D, non-negative, numpy or torch):
    one uniform double from `generator`, inverse CDF in float64. Never returns a zero-weight index."""
    w = weights.detach().cpu().numpy() if isinstance(weights, torch.Tensor) else np.asarray(weights)
    c = np.cumsum(w, dtype=np.float64)
    total = c[-1]
    if not total > 0:
        raise ValueError("cannot sample from an all-zero distribution")
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    j = int(np.searchsorted(c, u * total, side="right"))
    j = min(j, c.shape[0] - 1)
    while w[j] <= 0:  # u * total rounded up to the total: step back to the last real entry
        j -= 1
    return j


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           history: Sequence[int] | None = None) -> int:
    """One token from logits [V]: bias and penalties over `history`, then the filter chain and a draw
    (greedy: exact argmax, no randomness used)."""
    x = apply_penalties(logits, history, params)
    xn = x.detach().to("cpu", torch.float32).reshape(-1).numpy()
    if params.greedy:
        return int(np.argmax(xn))
    idx, p = _row_candidates(xn, params)
    return int(idx[draw(p, generator)])


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index from a distribution [V] (e.g. a row of filtered_probs)."""
    return draw(probs, generator)
