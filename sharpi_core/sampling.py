"""Sampling as pure functions of (logits, params, generator), in llama.cpp's chain order:

    logit bias -> penalties -> DRY -> top-n-sigma -> top-k -> typical -> top-p -> min-p -> XTC
    -> temperature -> draw

(llama.cpp's common_sampler_init puts the logit-bias sampler first, then its sampler list, by default
`penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature` (`--samplers` reorders it), then
`dist`.) With `--mirostat` the chain is logit bias -> temperature -> mirostat instead (class Mirostat:
its state follows the tokens it picks). `adaptive_p` in `--samplers` (with `--adaptive-target` >= 0)
replaces `dist` at the end of the chain, wherever the list names it, as llama.cpp does (class
AdaptiveP: it reshapes the chain's distribution around a target probability its state adapts).

Semantics, each as llama.cpp's src/llama-sampler.cpp:
- logit bias adds to the logit (several entries for one token add up; -inf bans it);
- penalties look at the last `repeat_last_n` tokens of the history (prompt included, 0 = off,
  -1 is turned into n_ctx by the CLI): a seen token's logit is multiplied by `repeat_penalty`
  when <= 0 and divided by it when > 0, then `count * frequency_penalty + presence_penalty`
  is subtracted;
- DRY (sharpi_core.dry) penalizes tokens that would extend a repeated sequence;
- top-n-sigma (n <= 0: off) keeps logits >= max - n * std (over the finite logits);
- top-k (k <= 0: off) keeps the k highest logits;
- typical (p >= 1: off) keeps the tokens whose surprise -log p is closest to the entropy, until
  their mass exceeds p;
- top-p (p >= 1: off) keeps the smallest prefix of the sorted candidates whose probability mass
  (softmax of the current candidates, before temperature) reaches p;
- min-p (p <= 0: off) keeps logits >= max logit + log(p), i.e. probability >= p * max probability;
- XTC removes, with probability `xtc_probability`, every token with probability >= `xtc_threshold`
  but the least likely of them. Its coin is part of the law: the distribution returned here is the
  mixture (1 - P) * chain(without the cut) + P * chain(with it), which is what a fresh coin per token
  draws from, and what speculative acceptance needs;
- temperature divides the logits (dynamic temperature, `dynatemp_range` > 0: a temperature in
  temp +- range from the candidates' normalized entropy); temp <= 0 keeps the first of the highest
  logits left: greedy, an exact argmax of the biased/penalized logits, when only top-k/p, min-p and
  top-n-sigma (which always keep the argmax) come before it; after typical or XTC, which may not,
  the law of that one survivor (XTC: a mixture of two), as llama.cpp's chain draws it;
- infill (`infill` in `--samplers`, for fill-in-the-middle): sees the candidates' softmax; where the
  end-of-generation tokens' mass is large against the rest's (3 * p_eog * n > p_text) it keeps only them;
  otherwise each token whose text is a prefix of another's absorbs the other's probability (or is
  absorbed, whichever is the less likely), then a text token stays only if its probability is >= 0.2
  and, renormalized, >= 1 / (number of them + 1) (end-of-generation tokens always stay); none left:
  the end-of-turn token (else end-of-sequence) alone. The probabilities it adds up decide only which
  tokens stay: the draw is the softmax of their logits, as llama.cpp's `dist` recomputes it;
- at least one candidate is always kept; `min_keep` (`--min-keep`, 0 = off) makes top-p, min-p, typical
  and XTC keep at least that many (top-k and top-n-sigma ignore it, as in llama.cpp).

`filtered_probs` returns the final distribution itself ([V] or batched [T, V], zeros outside the
kept candidates), because speculative sampling needs the target's p and the draft's q after the
same chain. The vocabulary-wide work (top-k selection, argmax) runs in numpy on the logits' own
memory: on CPU it is several times faster than torch.topk/argmax for 50k-262k vocabularies, and
needs no thread pool. Randomness always comes from the caller's torch.Generator.
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Sequence

import numpy as np
import torch

from . import dry as _dry
from .choices import DEFAULT_SAMPLERS
from .errors import SharpiError
from .libm import expf, log2f, logf, logf_array, powf, top_n_sigma_cut


@dataclass(frozen=True)
class InfillVocab:
    """What llama.cpp's infill sampler asks of the vocabulary: a token's text (token_to_piece without special
    tokens' text: control tokens print nothing, so they prefix nothing), the end-of-generation ids, and the token
    it leaves when no text is likely enough (end of turn, else end of sequence; None: neither)."""
    piece: Callable[[int], bytes]
    eog: frozenset[int]
    end: int | None

    @classmethod
    def of(cls, tok) -> "InfillVocab":
        n = tok.n_vocab  # (a model's output rows past its vocabulary are no text)
        return cls(lambda t: tok.token_bytes(t, special=False) if t < n else b"", frozenset(tok.eog_ids),
                   tok.eot_id if tok.eot_id is not None else tok.eos_id)


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
    top_n_sigma: float = -1.0
    typical_p: float = 1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_breakers: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (head, tail) pairs: sharpi_core.dry.breakers
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    mirostat: int = 0  # 1, 2: Mirostat replaces the chain (bias -> temperature -> mirostat)
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    adaptive_target: float = -1.0  # adaptive-p (with "adaptive_p" in samplers): < 0 = off
    adaptive_decay: float = 0.9
    min_keep: int = 0  # top-p, min-p, typical and XTC keep at least this many candidates (llama.cpp's min_keep)
    infill: InfillVocab | None = field(default=None, compare=False, repr=False)  # for "infill" in samplers

    @property
    def greedy(self) -> bool:
        """An exact arg-max of the biased/penalized logits: temp <= 0, unless typical, XTC or infill run before
        the temperature stage (llama.cpp's temperature 0 keeps the best of what they leave: typical may leave
        out the most likely token, XTC's coin cuts it at random, infill may leave end-of-generation tokens only)
        or dynamic temperature is on."""
        if self.temp > 0:
            return False
        if self.mirostat:
            return True
        if self.dynatemp_range > 0 or "temperature" not in self.samplers:
            return False
        before = self.samplers[: self.samplers.index("temperature")]
        return not (("typ_p" in before and self.typical_p < 1.0) or ("xtc" in before and self.xtc_on)
                    or "infill" in before)

    @property
    def has_penalties(self) -> bool:
        return not self.mirostat and "penalties" in self.samplers and self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

    @property
    def has_dry(self) -> bool:
        return (not self.mirostat and "dry" in self.samplers and self.dry_multiplier != 0.0 and self.dry_base >= 1.0
                and self.dry_penalty_last_n != 0)

    @property
    def history_dependent(self) -> bool:
        """True when penalties or DRY change the logits according to the history."""
        return self.has_penalties or self.has_dry

    @property
    def fixed_bias(self) -> bool:
        """A step's logits are the model's plus the logit bias alone: no penalties (they depend on the history), the
        bias ids distinct (one addition per logit, as apply_penalties), so a model can add it where its logits are."""
        ids = [i for i, _ in self.logit_bias]
        return not self.history_dependent and len(set(ids)) == len(ids)

    @property
    def adjusts_logits(self) -> bool:
        """True when logit bias, penalties or DRY change the logits."""
        return bool(self.logit_bias) or self.history_dependent

    @property
    def history_window(self) -> int:
        """How many of the last history tokens the penalties and DRY look at (-1 = all, 0 = none)."""
        ns = ([self.repeat_last_n] if self.has_penalties else []) + ([self.dry_penalty_last_n] if self.has_dry else [])
        return -1 if any(n < 0 for n in ns) else max(ns, default=0)

    @property
    def plain_chain(self) -> bool:
        """The default order with top-n-sigma, typical, XTC and dynamic temperature off: the fast path."""
        return (not self.mirostat and self.filters == DEFAULT_SAMPLERS and self.top_n_sigma <= 0
                and self.typical_p >= 1.0 and not self.xtc_on and self.dynatemp_range <= 0)

    @property
    def filters(self) -> tuple[str, ...]:
        """The chain's stages before the draw (samplers without adaptive_p, which is the draw)."""
        return tuple(s for s in self.samplers if s != "adaptive_p")

    @property
    def adaptive_on(self) -> bool:
        """Adaptive-p draws the token (llama.cpp: adaptive_p in the samplers, target >= 0, no mirostat)."""
        return (not self.mirostat and not self.greedy and "adaptive_p" in self.samplers
                and float(np.float32(self.adaptive_target)) >= 0)

    @cached_property
    def dry_heads(self) -> dict[int, list[tuple[int, ...]]]:
        """dry_breakers as head -> tails, built once per params (thousands of heads on a 150k vocabulary)."""
        heads: dict[int, list[tuple[int, ...]]] = {}
        for h, tail in self.dry_breakers:
            heads.setdefault(h, []).append(tail)
        return heads

    @property
    def xtc_on(self) -> bool:
        return "xtc" in self.samplers and self.xtc_probability > 0 and self.xtc_threshold <= 0.5


def describe_chain(params: SamplingParams) -> str:
    """The stages that act, in order, as llama.cpp's "sampler chain: logits -> ... -> dist" line."""
    if params.mirostat and not params.greedy:
        return " -> ".join(["logits"] + ["logit-bias"] * bool(params.logit_bias)
                           + ["temperature", "mirostat" + "-v2" * (params.mirostat == 2)])
    if params.greedy:
        on = ["logit-bias"] * bool(params.logit_bias) + [s for s in params.samplers
                                                         if (s == "penalties" and params.has_penalties)
                                                         or (s == "dry" and params.has_dry)]
        return " -> ".join(["logits"] + on + ["argmax"])
    act = {"penalties": params.has_penalties, "dry": params.has_dry, "top_n_sigma": params.top_n_sigma > 0,
           "top_k": params.top_k > 0, "typ_p": params.typical_p < 1, "top_p": params.top_p < 1,
           "min_p": params.min_p > 0, "xtc": params.xtc_on, "temperature": True, "infill": True}
    on = ["logit-bias"] * bool(params.logit_bias) + [s.replace("_", "-") for s in params.filters if act[s]]
    return " -> ".join(["logits"] + on + ["adaptive-p" if params.adaptive_on else "dist"])


def argmax_on_device(model, params: SamplingParams) -> bool:
    """Whether `model` takes its greedy steps' arg-max where its logits are (a GPU model offering
    forward_argmax / greedy_chain, see backends.cuda_model) for these params: greedy decoding that needs
    of each logits row only the arg-max of row + a fixed logit bias, i.e. no penalties (they depend on
    the history) and bias ids distinct (one addition per logit, as apply_penalties): SamplingParams.fixed_bias."""
    return bool(getattr(model, "device_argmax", False)) and params.greedy and params.fixed_bias


def penalty_window(history: Sequence[int] | None, params: SamplingParams) -> list[int]:
    """The part of `history` the penalties look at (the last repeat_last_n tokens; all if < 0)."""
    if not history or not params.has_penalties:
        return []
    n = params.repeat_last_n
    return list(history[-n:]) if n > 0 else list(history)


def _dry_row(row: np.ndarray, history: Sequence[int], params: SamplingParams) -> None:
    if history:
        n = params.dry_penalty_last_n
        _dry.penalize_row(row, list(history[-n:]) if n > 0 else list(history), params.dry_multiplier,
                          params.dry_base, params.dry_allowed_length, params.dry_heads)


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
    """Logit bias, then repeat/frequency/presence penalties and DRY (in `params.samplers`' order).

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
    if params.history_dependent and history:
        if one or (len(history) and not isinstance(history[0], (list, tuple))):
            rows = [history] * x.shape[0]
        else:
            rows = history
        with np.errstate(over="ignore"):  # huge penalties saturate to inf in float32, as in llama.cpp
            for stage in params.samplers:  # penalties and DRY in the chain's order
                for r in range(x.shape[0]):
                    if stage == "penalties" and params.has_penalties:
                        _penalize_row(x[r], penalty_window(rows[r], params), params)
                    elif stage == "dry" and params.has_dry:
                        _dry_row(x[r], rows[r], params)
    out = torch.from_numpy(x)
    return out[0] if one else out


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


class NoDistribution(SharpiError):
    """Nothing to sample from: a NaN logit (a damaged model's, or one whose activations overflow: its arithmetic broke
    down, and llama.cpp's samplers then draw garbage) or no candidate left with a weight."""

    def __init__(self):
        super().__init__("the model's logits leave no token to sample from (not finite numbers: a damaged model, or "
                         "one whose activations overflow? --check-tensors checks its weights)")


def _forced(x: np.ndarray) -> np.ndarray | None:
    """The ids of a row's +inf logits (a bias: nothing else can be drawn; llama.cpp's softmax would be NaN), or None;
    a NaN logit (the model's arithmetic broke down: llama.cpp's samplers draw garbage) is NoDistribution."""
    m = x.max()
    if m != m:
        raise NoDistribution()
    return np.flatnonzero(x == np.inf) if m == np.inf else None


def _nucleus(p: np.ndarray, top_p: float) -> int | None:
    """How many of the sorted candidates of probabilities `p` (float32, llama.cpp's softmax) top-p keeps: up to and
    including the first where the running mass (a float32 sum in order, as llama.cpp's) reaches top_p; None if it
    never does (the float32 sum stalls below it once the tail's probabilities are under half its ulp)."""
    reached = np.flatnonzero(np.cumsum(p, dtype=np.float32) >= np.float32(top_p))
    return int(reached[0]) + 1 if reached.shape[0] else None


def _plain_candidates(x: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """_row_candidates for the default chain (top-k -> top-p -> min-p -> temperature), without
    sorting the vocabulary."""
    V = x.shape[0]
    k = params.top_k if 0 < params.top_k < V else V
    use_p = params.top_p < 1.0
    use_min_p = params.min_p > 0.0
    if k < V:
        idx = _topk_sorted(x, k)
        vals = x[idx]
        total = None  # top-p's softmax runs over what top-k kept, sorted
    elif use_p:  # top-k off: the nucleus is usually within the best few hundred; widen until it fits
        # (llama.cpp's softmax sums the candidates as they stand: in id order, or sorted where a top-k at or past the
        # vocabulary sorted them all)
        total = _exp_total(x if params.top_k <= 0 else np.sort(x)[::-1])
        for m in (256, 4096, 32768, V):
            idx = _topk_sorted(x, min(m, V))
            if m >= V or (m >= params.min_keep and _nucleus(_softmax32(x[idx], total), params.top_p) is not None):
                break
        vals = x[idx]
    elif use_min_p:
        thr = np.float32(x.max()) + logf(params.min_p)  # (libm's logf of the float, as llama.cpp's)
        idx = np.flatnonzero(x >= thr)
        if idx.shape[0] < max(params.min_keep, 1):  # (none above the cut: min-p > 1 keeps the best, as llama.cpp)
            idx = _topk_sorted(x, max(params.min_keep, 1))
        idx = _desc(idx, x[idx])
        vals = x[idx]
    else:  # no filter at all: every token, unsorted
        z = _over_temp(x, params.temp).astype(np.float64)
        z = np.exp(z - z.max())
        return np.arange(V), z / z.sum()
    n = vals.shape[0]
    if use_p and n > 1:
        m = _nucleus(_softmax32(vals, total), params.top_p)
        if m is not None:
            n = max(m, min(params.min_keep, n))  # the first prefix that reaches top_p and min_keep
    if use_min_p and n > 1:
        thr = vals[0] + logf(params.min_p)
        n = max(1, min(n, max(params.min_keep, int(np.count_nonzero(vals[:n] >= thr)))))  # sorted: a prefix
    idx, vals = _cut(idx, vals, n)
    z = _over_temp(vals, params.temp).astype(np.float64)
    z = np.exp(z - z.max())
    return idx, z / z.sum()


def _over_temp(vals: np.ndarray, temp: float) -> np.ndarray:
    """Logits divided by the temperature: in float32 as llama.cpp divides (its law is the softmax of those float32
    logits; a float64 quotient moves a logit of 200 by 1e-5), unless that overflows (a tiny temperature): float64.
    Dynamic temperature's infinite one (a normalized entropy of 0 to a negative exponent) makes a masked -inf logit
    NaN, as in llama.cpp; _chain keeps only the logits above -inf after it, which leaves that one out."""
    t = np.float32(temp)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = vals / t
    return scaled if not np.isposinf(scaled).any() else vals.astype(np.float64) / float(t)


def _sorted(idx: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidates by value, descending, equal values lowest id first (quicksort, then the runs of equal
    values put in id order: a third of a stable sort's time on a 150k vocabulary)."""
    o = np.argsort(-vals)
    idx, vals = idx[o], vals[o]
    eq = np.flatnonzero(vals[1:] == vals[:-1])
    if eq.shape[0]:
        starts = eq[np.r_[True, eq[1:] != eq[:-1] + 1]]
        for a in starts.tolist():
            b = a + 1
            while b < vals.shape[0] and vals[b] == vals[a]:
                b += 1
            idx[a:b] = np.sort(idx[a:b])
    return idx, vals


def _exp_total(vals: np.ndarray) -> np.float32:
    """The denominator of llama_sampler_softmax_impl over candidates in the order they stand: exp(logit - max) in
    float32 (libm's expf), summed one after another in float32 (not numpy's pairwise sum, nor float64: over a 150k
    vocabulary they move top-p's cut by hundreds of tail tokens)."""
    return np.cumsum(expf(vals - vals.max()), dtype=np.float32)[-1]


def _softmax32(vals: np.ndarray, total: np.float32 | None = None) -> np.ndarray:
    """llama_sampler_softmax_impl on candidates sorted descending: float32, summed in order; total: _exp_total of
    the candidates as they stood before they were sorted (top-p's softmax, which does not sort first)."""
    e = expf(vals - vals[0])
    return e / (np.cumsum(e, dtype=np.float32)[-1] if total is None else total)


def _infill(idx: np.ndarray, vals: np.ndarray, vocab: InfillVocab) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's infill sampler on candidates sorted by logit (module docstring), in its float32 arithmetic and
    order: the prefix merges run pair by pair (i0, then i1, ascending) as its double loop does, a merged-away
    token's logit -inf; only the pairs where one text starts the other are visited (the loop's other pairs change
    nothing), so a whole vocabulary costs the sum of its texts' lengths, not its size squared."""
    n = vals.shape[0]
    if n == 0 or not vals[0] > -np.inf:
        return idx, vals
    p = _softmax32(vals)
    eog = np.isin(idx, np.fromiter(vocab.eog, np.int64, len(vocab.eog)))
    p_eog = np.cumsum(p[eog], dtype=np.float32)[-1] if eog.any() else np.float32(0)
    p_txt = np.cumsum(p[~eog], dtype=np.float32)[-1] if not eog.all() else np.float32(0)
    if np.float32(3) * p_eog * np.float32(n) > p_txt:
        return idx[eog], vals[eog]
    pieces = [vocab.piece(t) for t in idx.tolist()]
    at: dict[bytes, list[int]] = {}
    for i, b in enumerate(pieces):
        if b:
            at.setdefault(b, []).append(i)
    starts: dict[int, list[int]] = {}  # i0 -> the i1 whose text begins with i0's, ascending
    for i1, b in enumerate(pieces):
        for n_b in range(1, len(b) + 1):
            for i0 in at.get(b[:n_b], ()):
                if i0 != i1:
                    starts.setdefault(i0, []).append(i1)
    if starts:
        vals, dead = vals.copy(), (vals == -np.inf).tolist()
        for i0 in sorted(starts):
            for i1 in starts[i0]:
                if dead[i0]:
                    break
                if dead[i1]:
                    continue
                dst, src = (i1, i0) if p[i1] > p[i0] else (i0, i1)  # into the more likely one
                p[dst] += p[src]
                p[src], vals[src], dead[src] = 0, -np.inf, True
    keep = (p >= np.float32(0.2)) | eog
    n_txt = int(np.count_nonzero(keep & ~eog))
    if n_txt == 0:
        if vocab.end is None:  # (llama.cpp asserts)
            raise NoDistribution()
        return np.array([vocab.end], dtype=idx.dtype), np.array([1.0], dtype=np.float32)
    idx, vals, eog = idx[keep], vals[keep], eog[keep]
    p = p[keep] / np.cumsum(p[keep], dtype=np.float32)[-1]
    keep = (p >= np.float32(1.0 / (n_txt + 1))) | eog
    return idx[keep], vals[keep]


def _chain(x: np.ndarray, params: SamplingParams, xtc_cut: bool) -> tuple[np.ndarray, np.ndarray]:
    """The filters and the temperature in `params.samplers`' order, on one row of (penalized) float32
    logits -> (token ids, probabilities float64); XTC cuts when `xtc_cut` (one side of its coin).
    Candidates are kept in llama.cpp's order: by id until a stage sorts them by logit, by typical's distance
    after typical (the float sums of a later softmax, top-n-sigma or adaptive-p run in that order). As in llama.cpp, a
    candidate whose logit is -inf (banned, or masked by top-n-sigma) stays in the list until the end:
    it counts in dynamic temperature's maximum entropy; it never counts as likely."""
    idx, vals = np.arange(x.shape[0]), x
    srt = False
    for stage in params.samplers:
        n = vals.shape[0]
        if stage == "top_n_sigma" and params.top_n_sigma > 0 and n > 1:
            vals = np.where(vals >= top_n_sigma_cut(vals, params.top_n_sigma), vals, np.float32(-np.inf))
        elif stage == "top_k" and params.top_k > 0:
            if params.top_k < n:
                o = _topk_sorted(vals, params.top_k)
                idx, vals = idx[o], vals[o]
            elif not srt:
                idx, vals = _sorted(idx, vals)
            srt = True
        elif stage == "typ_p" and params.typical_p < 1.0:
            if not srt:
                idx, vals, srt = *_sorted(idx, vals), True
            p = _softmax32(vals)
            lp = logf_array(p)
            live = p > 0  # a candidate of probability 0 is no candidate (llama.cpp's entropy would be NaN)
            ent = np.float32(0) - np.cumsum(p[live] * lp[live], dtype=np.float32)[-1]
            order = np.argsort(np.abs(-lp - ent), kind="stable")
            hit = np.flatnonzero(np.cumsum(p[order], dtype=np.float32) > np.float32(params.typical_p))
            hit = hit[hit + 1 >= params.min_keep]
            # in llama.cpp's new order, by that distance, cut or not (later stages' float sums run in it)
            keep = order[: hit[0] + 1] if hit.shape[0] else order
            idx, vals, srt = idx[keep], vals[keep], False
        elif stage == "top_p" and params.top_p < 1.0:
            total = None if srt else _exp_total(vals)  # (llama.cpp's top-p sums the softmax before it sorts)
            if not srt:
                idx, vals, srt = *_sorted(idx, vals), True
            hit = np.flatnonzero(np.cumsum(_softmax32(vals, total), dtype=np.float32) >= np.float32(params.top_p))
            hit = hit[hit + 1 >= params.min_keep]
            if hit.shape[0]:
                idx, vals = idx[: hit[0] + 1], vals[: hit[0] + 1]
        elif stage == "min_p" and params.min_p > 0.0:
            keep = vals >= vals.max() + logf(params.min_p)
            if np.count_nonzero(keep) >= max(params.min_keep, 1):
                idx, vals = idx[keep], vals[keep]
            else:  # the best min_keep of them, at least one (llama.cpp's sorted path; those above the cut are among
                if not srt:  # them; none is above it where min-p > 1)
                    idx, vals, srt = *_sorted(idx, vals), True
                idx, vals = idx[: max(params.min_keep, 1)], vals[: max(params.min_keep, 1)]
        elif stage == "xtc" and xtc_cut and params.xtc_on and n >= 2:
            if not srt:
                idx, vals, srt = *_sorted(idx, vals), True
            p = _softmax32(vals)
            # the leading run at or above the threshold: all of it goes but its least likely, at `last`
            hi = p >= np.float32(params.xtc_threshold)
            last = (n if hi.all() else int(np.argmin(hi))) - 1
            if last > 0 and n - last >= params.min_keep:
                if vals[last] == -np.inf:  # (a threshold <= 0 takes banned and masked tokens in: llama.cpp would
                    last = int(np.count_nonzero(vals > -np.inf)) - 1  # leave only those, no law; the last finite)
                idx, vals = idx[last:], vals[last:]
        elif stage == "temperature":
            t = np.float32(params.temp)
            if params.dynatemp_range > 0:
                if n <= 1:
                    continue
                lo = max(np.float32(0), t - np.float32(params.dynatemp_range))
                hi = t + np.float32(params.dynatemp_range)
                if not srt:
                    idx, vals, srt = *_sorted(idx, vals), True
                p = _softmax32(vals)
                live = p > 0
                ent = np.float32(0) - np.cumsum(p[live] * logf_array(p[live]), dtype=np.float32)[-1]
                norm = ent / -logf(np.float32(1.0) / np.float32(n))
                with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
                    pw = powf(norm, params.dynatemp_exponent)
                    t = lo if hi == lo else np.float32(lo + (hi - lo) * pw)
                if np.isnan(t):
                    t = lo
            if t <= 0:  # llama.cpp's temperature 0: the first of the highest logits stays
                j = int(np.argmax(vals))
                idx, vals = idx[j:j + 1], vals[j:j + 1]
            else:
                vals = _over_temp(vals, t)
        elif stage == "infill":
            if params.infill is None:
                raise ValueError("the infill stage needs the vocabulary: SamplingParams.infill = InfillVocab.of(tok)")
            if not srt:
                idx, vals, srt = *_sorted(idx, vals), True
            idx, vals = _infill(idx, vals, params.infill)
    live = vals > -np.inf
    idx, vals = idx[live], vals[live].astype(np.float64)
    z = np.exp(vals - vals.max())
    return idx, z / z.sum()


def _chain_sides(x: np.ndarray, params: SamplingParams) -> list[tuple[float, tuple[np.ndarray, np.ndarray]]]:
    """One row of (penalized) float32 logits -> the chain's law as the sides of XTC's coin: [(weight,
    (token ids, probabilities float64))], one side unless XTC may cut (its no-cut side, then its cut)."""
    top = _forced(x)
    if top is not None:
        return [(1.0, (top, np.full(top.shape[0], 1.0 / top.shape[0])))]
    if params.plain_chain:
        return [(1.0, _plain_candidates(x, params))]
    if not params.xtc_on:
        return [(1.0, _chain(x, params, False))]
    cut_p = min(1.0, float(np.float32(params.xtc_probability)))
    if cut_p >= 1.0:
        return [(1.0, _chain(x, params, True))]
    return [(w, c) for w, c in ((1.0 - cut_p, _chain(x, params, False)), (cut_p, _chain(x, params, True))) if w > 0]


def _mix(sides, n: int) -> tuple[np.ndarray, np.ndarray]:
    """[(weight, (ids, probabilities))] over n ids -> (ids, probabilities float64) of the mixture."""
    p = np.zeros(n)
    for w, (idx, q) in sides:
        p[idx] += w * q
    idx = np.flatnonzero(p)
    return idx, p[idx]


def _row_candidates(x: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """One row of (penalized) float32 logits -> (token ids, probabilities float64) it is drawn from.

    Not for greedy (temp <= 0): that is an argmax. With XTC the law of one draw, coin included."""
    sides = _chain_sides(x, params)
    return sides[0][1] if len(sides) == 1 else _mix(sides, x.shape[0])


class Picker:
    """A last stage that draws the token itself and whose state follows each token it draws (mirostat,
    adaptive-p): the law of the next token depends on the tokens before it through `state`, which
    starts over at reset() (each generate() call: llama.cpp resets its samplers at each user input).

    Subclasses give sides(x, params, state) -> [(weight, ids, law, u)]: the law of one draw as a mixture
    (one side, or XTC's coin: its no-cut and cut sides), each side's law over `ids` and the value `u`
    per id that after(state, u) moves the state by when that id is drawn on that side. A drawn token's
    side is drawn from its posterior (weight * law of the token), so that (token, state) pairs keep
    plain decoding's joint law; with one side no randomness is used for it."""

    def reset(self) -> None:
        self.state = self.initial()

    def law(self, x: np.ndarray, params: SamplingParams, state=None) -> tuple[np.ndarray, np.ndarray, list]:
        """(ids, float64 probabilities, sides) of one draw from logits x [V] (after bias, penalties and
        any grammar mask) in `state` (default: the current one)."""
        sides = self.sides(x, params, self.state if state is None else state)
        if len(sides) == 1:
            return sides[0][1], sides[0][2].astype(np.float64), sides
        return *_mix([(w, (idx, q)) for w, idx, q, _ in sides], x.shape[0]), sides

    def next_state(self, state, sides: list, token: int, generator: torch.Generator | None):
        """The state after drawing `token` from `sides` (law()'s) in `state`."""
        if len(sides) > 1:
            w = [float(wt * q[np.flatnonzero(idx == token)].sum()) for wt, idx, q, _ in sides]
            sides = [sides[draw(w, generator)]]
        _, idx, _, u = sides[0]
        return self.after(state, u[int(np.flatnonzero(idx == token)[0])])

    def draw_token(self, x: np.ndarray, params: SamplingParams,
                   generator: torch.Generator | None) -> tuple[int, np.ndarray, np.ndarray]:
        """One token from logits x [V] (after bias, penalties and any grammar mask), the state following
        it -> (token, the law's ids, its probabilities)."""
        idx, p, sides = self.law(x, params)
        t = int(idx[draw(p, generator)])
        self.state = self.next_state(self.state, sides, t, generator)
        return t, idx, p

    def rows(self, x: np.ndarray, params: SamplingParams, drafts: Sequence[int],
             generator: torch.Generator | None) -> tuple[np.ndarray, list, list, bool]:
        """A speculative verify pass's distributions: x [R, V] its rows after bias, penalties and any
        grammar mask (row i follows drafts[:i]) -> (p [m, V] float32, zero outside the candidates; the
        states [m] they were computed in; their sides [m] for next_state; broken). Row i's state is the
        one drawing drafts[:i] leads to, so each row is the law plain decoding would draw from after
        accepting the drafts before it. The rows stop at the first draft of probability 0: its
        rejection is certain, and no state follows it. They stop before a row past the first that has
        no distribution (NaN logits), broken True: plain decoding meets that row only if every draft
        before it is accepted (NoDistribution when the first row has none)."""
        state, p, states, sides_of = self.state, np.zeros(x.shape, dtype=np.float32), [], []
        for i in range(x.shape[0]):
            try:
                idx, pr, sides = self.law(x[i], params, state)
            except NoDistribution:
                if i == 0:
                    raise
                return p[:i], states, sides_of, True
            p[i, idx] = pr
            states.append(state)
            sides_of.append(sides)
            d = drafts[i] if i < len(drafts) else -1
            if not (0 <= d < x.shape[1] and p[i, d] > 0):
                return p[: i + 1], states, sides_of, False
            state = self.next_state(state, sides, d, generator)
        return p, states, sides_of, False

    def sample(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
               history: Sequence[int] | None = None, constrain=None) -> int:
        """One token from logits [V] (bias and penalties over `history`, then `constrain`, as in
        sample()), the state updated."""
        x = apply_penalties(logits, history, params).detach().to("cpu", torch.float32).reshape(-1).numpy()
        if constrain is not None:
            x = constrain(x)
        if params.greedy:
            return int(np.argmax(x))
        return self.draw_token(x, params, generator)[0]


_LOST = np.float32(2.0 ** -24)  # half an ulp of 1.0f


class Mirostat(Picker):
    """llama.cpp's mirostat samplers (`--mirostat 1|2`), whose state `mu` (the surprise a token may
    have, in bits) follows every token it picks. Its chain is logit bias -> temperature -> mirostat:
    penalties, DRY and the filters do not apply, as in llama.cpp. Version 2 keeps the tokens whose
    surprise -log2 p is at most mu; version 1 keeps the top k, k from a Zipf exponent fitted to the 100
    most likely tokens. After each pick mu -= eta * (surprise of the pick - tau)."""

    def __init__(self, version: int, tau: float, eta: float, n_vocab: int):
        self.version, self.n_vocab = version, n_vocab
        self.tau, self.eta = np.float32(tau), np.float32(eta)
        self.reset()

    def initial(self):
        return np.float32(2) * self.tau

    @property
    def mu(self):
        return self.state

    def candidates(self, x: np.ndarray, temp: float, mu=None) -> tuple[np.ndarray, np.ndarray]:
        """(ids, float32 probabilities) the next token is drawn from, for logits x [V] after bias, in
        the state mu (default: the current one)."""
        mu = self.state if mu is None else mu
        top = _forced(x)
        if top is not None:
            return top, np.full(top.shape[0], 1 / np.float32(top.shape[0]), dtype=np.float32)
        v = x / np.float32(temp)
        # llama.cpp's softmax sorts first: libm's expf, summed in float32 from the largest. The sum starts at 1 (the
        # max's term), so terms under 2^-24 are lost in its rounding wherever they come: only the others are sorted.
        e = expf(v - v.max())
        es = np.sort(e[e >= _LOST])[::-1]
        total = np.cumsum(es, dtype=np.float32)[-1]
        if self.version == 2:
            def surprising(ps):  # sorted probabilities -> where the leading run of surprise -log2f(p) <= mu ends
                return bisect.bisect_left(range(ps.shape[0]), True, key=lambda i: bool(-log2f(ps[i]) > mu))
            ps = es / total
            n = surprising(ps)
            if n == ps.shape[0] < e.shape[0]:  # (the cut lies among the lost terms: all of them sorted)
                ps = np.sort(e)[::-1] / total
                n = surprising(ps)
            keep = np.flatnonzero(e / total >= ps[n - 1]) if n else np.array([int(np.argmax(v))])
            idx, vals = _sorted(keep, v[keep])
        else:
            top = _topk_sorted(v, min(100, v.shape[0]))
            p = e[top] / total
            n = min(99, p.shape[0] - 1)
            i = np.arange(n, dtype=np.float32)
            t = logf_array((i + np.float32(2)) / (i + np.float32(1)))  # (libm's logf and powf, as llama.cpp's)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # C float: inf, NaN
                b = logf_array(p[:n] / p[1:n + 1])
                s_hat = np.cumsum(t * b, dtype=np.float32)[-1] / np.cumsum(t * t, dtype=np.float32)[-1] if n else np.float32(0)
                eps = s_hat - np.float32(1)
                k = powf((eps * powf(2, mu)) / (np.float32(1) - powf(self.n_vocab, -eps)), np.float32(1) / s_hat)
            # C's int(k) on x86: NaN, infinities and |k| >= 2^31 become INT_MIN, so one token
            k = int(k) if np.isfinite(k) and abs(float(k)) < 2.0 ** 31 else 1
            sel = _topk_sorted(v, min(max(k, 1), v.shape[0]))
            idx, vals = sel, v[sel]
        z = expf(vals - vals[0])
        return idx, z / np.cumsum(z, dtype=np.float32)[-1]

    def sides(self, x: np.ndarray, params: SamplingParams, state) -> list:
        # the law llama.cpp draws from is its float probabilities normalized anew (std::discrete_distribution sums
        # them in double; their float sum is 1e-4 off 1 over many candidates); mu moves by the float one
        idx, p = self.candidates(x, params.temp, state)
        return [(1.0, idx, p / p.sum(dtype=np.float64), p)]

    def after(self, mu, p):
        """The state after drawing, in state mu, a token of (float32) probability p."""
        return mu - self.eta * (-log2f(p) - self.tau)


class AdaptiveP(Picker):
    """llama.cpp's adaptive-p sampler (`adaptive_p` in `--samplers`, `--adaptive-target T`,
    `--adaptive-decay D`): it draws from the chain's distribution p reshaped around a target
    probability, logit 5 - 10 d^2 / (1 + d) with d = |p - target'| / 0.3 for each candidate the chain
    kept (banned and masked tokens stay out), so tokens near target' are favoured. target' = 2 T - the
    decayed average of the chain's probabilities of the tokens drawn so far (clamped to [0, 1]): when
    recent picks were likelier than T it aims lower, and the reverse. Its state is that average's
    (weighted sum, total weight), float32 as llama.cpp keeps them; with XTC's coin the drawn side's
    probability moves it (Picker's posterior side)."""

    _INV_WIDTH = np.float32(1.0) / np.float32(0.3)

    def __init__(self, target: float, decay: float):
        self.target = np.float32(target)
        self.decay = np.float32(min(max(float(np.float32(decay)), 0.0), float(np.float32(0.99))))
        self.reset()

    def initial(self):
        one = np.float32(1)
        with np.errstate(over="ignore"):  # a huge target: inf, as C's float division gives (then it aims at 0)
            return (self.target / (one - self.decay), one / (one - self.decay))

    def after(self, state, u):
        ws, tw = state
        with np.errstate(over="ignore"):
            return (np.float32(u) + self.decay * ws, np.float32(1) + self.decay * tw)

    def aim(self, state) -> np.float32:
        """target' for the next draw in `state`."""
        ws, tw = state
        t = np.float32(min(max(float(self.target), 0.0), 1.0))
        a = t if tw == 0 else np.float32(2) * t - ws / tw
        return np.float32(min(max(float(a), 0.0), 1.0))

    def reshape(self, p: np.ndarray, state) -> np.ndarray:
        """The chain's probabilities p (float32) of its candidates -> the law drawn from (float64)."""
        d = np.abs((p - self.aim(state)) * self._INV_WIDTH)
        v = np.float32(5) - np.float32(10) * d * d / (np.float32(1) + d)
        z = np.exp(v.astype(np.float64) - float(v.max()))
        return z / z.sum()

    def sides(self, x: np.ndarray, params: SamplingParams, state) -> list:
        out = []
        for w, (idx, p) in _chain_sides(x, params):
            live = x[idx] > -np.inf  # (the fast path keeps banned tokens at probability 0)
            idx, p = idx[live], p[live]
            # the chain's probabilities as llama.cpp's float softmax has them (each exp over the largest, their float
            # sum in the candidates' order): over a whole vocabulary that sum is 1e-4 off, which moves the reshaped
            # law by as much
            e = (p / p.max()).astype(np.float32)
            p = e / np.cumsum(e, dtype=np.float32)[-1]
            out.append((w, idx, self.reshape(p, state), p))
        return out


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


def argmax(logits: torch.Tensor, nan_error: bool = False) -> torch.Tensor:
    """Row-wise argmax ([V] -> scalar, [T, V] -> [T]), lowest id on ties, like torch.argmax; a NaN is numpy's
    arg-max (the first), or with nan_error NoDistribution (the target's rows, as when sampling: a model whose
    arithmetic broke down has no most likely token; llama.cpp's greedy sampler keeps token 0, or skips the NaNs)."""
    x = logits.detach().to("cpu", torch.float32).numpy()
    am = np.asarray(np.argmax(x, axis=-1), dtype=np.int64)
    if nan_error and np.isnan(np.take_along_axis(x, am[..., None], axis=-1)).any():
        raise NoDistribution()
    return torch.from_numpy(am)


# -- drawing -------------------------------------------------------------------------------------------
def draw(weights, generator: torch.Generator | None) -> int:
    """Index drawn with probability proportional to `weights` (1-D, non-negative, numpy or torch):
    one uniform double from `generator`, inverse CDF in float64. Never returns a zero-weight index."""
    w = weights.detach().cpu().numpy() if isinstance(weights, torch.Tensor) else np.asarray(weights)
    c = np.cumsum(w, dtype=np.float64)
    total = c[-1]
    if not total > 0:
        raise NoDistribution()
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    j = int(np.searchsorted(c, u * total, side="right"))
    j = min(j, c.shape[0] - 1)
    while w[j] <= 0:  # u * total rounded up to the total: step back to the last real entry
        j -= 1
    return j


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           history: Sequence[int] | None = None, constrain=None) -> int:
    """One token from logits [V]: bias and penalties over `history`, then `constrain` (a grammar's
    mask: float32 row -> row), the filter chain and a draw (greedy: exact argmax, no randomness used)."""
    x = apply_penalties(logits, history, params)
    xn = x.detach().to("cpu", torch.float32).reshape(-1).numpy()
    if constrain is not None:
        xn = constrain(xn)
    if params.greedy:
        i = int(np.argmax(xn))
        if xn[i] != xn[i]:  # a NaN (the first, as numpy's arg-max takes it): no token is the most likely
            raise NoDistribution()
        return i
    idx, p = _row_candidates(xn, params)
    return int(idx[draw(p, generator)])
