"""Toy model, cache and tokenizer for fast tests of sampling, speculative decoding and the generator.

ToyModel's logits for the token after position j depend on the token at j, on j mod `period`, and on
a rolling hash of the whole context up to j (the hash is what the cache holds, like K/V): a wrong
cache (stale entries after a rollback, a token fed twice, a wrong position) changes the logits, so
cache bugs show up as different outputs. `logits_after(context)` is the cache-free reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from sharpi_core.kv_cache import CacheBase

HASH_MOD = 61


def _next_hash(h: int, tok: int) -> int:
    return (h * 7 + tok + 1) % HASH_MOD


@dataclass
class ToyConfig:
    n_vocab: int
    n_ctx_train: int = 4096


class ToyCache(CacheBase):
    def __init__(self, capacity: int):
        super().__init__(capacity, 0, 0, "f16", "f16")  # length and truncate as the real caches'
        self.tokens = [0] * capacity
        self.hashes = [0] * capacity

    @property
    def content(self) -> list[int]:
        return self.tokens[: self.length]


class ToyModel:
    exact_rows = 1 << 30  # (a row's logits do not depend on the pass it is in)

    def __init__(self, n_vocab: int = 8, seed: int = 0, scale: float = 1.5, period: int = 3,
                 context_scale: float = 1.0, n_ctx_train: int = 4096):
        g = torch.Generator().manual_seed(seed)
        self.config = ToyConfig(n_vocab, n_ctx_train)
        self.period = period
        self.by_token = torch.randn(n_vocab, n_vocab, generator=g) * scale
        self.by_pos = torch.randn(period, n_vocab, generator=g) * scale * 0.5
        self.by_hash = torch.randn(HASH_MOD, n_vocab, generator=g) * scale * context_scale
        self.n_forward = 0        # forward calls
        self.n_tokens = 0         # tokens fed
        self.batch_sizes: list[int] = []

    def new_cache(self, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> ToyCache:
        return ToyCache(n_ctx)

    def _row(self, tok: int, pos: int, h: int) -> torch.Tensor:
        return self.by_token[tok] + self.by_pos[pos % self.period] + self.by_hash[h]

    def forward(self, tokens, start_pos: int, cache: ToyCache, last_n: int | None = None,
                decode: bool = False, n_out: int | None = None) -> torch.Tensor:
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).tolist()
        if start_pos != cache.length:
            raise ValueError(f"start_pos {start_pos} != cache.length {cache.length}")
        if start_pos + len(tokens) > cache.capacity:
            raise ValueError(f"cache overflow: {start_pos} + {len(tokens)} > {cache.capacity}")
        V = self.config.n_vocab
        h = cache.hashes[start_pos - 1] if start_pos > 0 else 0
        rows = []
        for i, tok in enumerate(tokens):
            if not 0 <= tok < V:
                raise IndexError(f"token {tok} outside the vocabulary of {V}")
            pos = start_pos + i
            h = _next_hash(h, tok)
            cache.tokens[pos], cache.hashes[pos] = tok, h
            rows.append(self._row(tok, pos, h))
        cache.length = start_pos + len(tokens)
        self.n_forward += 1
        self.n_tokens += len(tokens)
        self.batch_sizes.append(len(tokens))
        out = torch.stack(rows)
        if n_out is not None:
            out = out[:, :n_out]
        return out[-last_n:] if last_n is not None else out

    # reference, no cache
    def shift_cache(self, cache: ToyCache, n_keep: int, n_discard: int) -> None:
        """A context shift: entries [n_keep + n_discard, length) move down by n_discard, keeping their hashes
        (the context they were computed in, like K/V) at their new positions (which the logits depend on)."""
        cache.check_shift(n_keep, n_discard)
        L = cache.length
        cache.tokens[n_keep:L - n_discard] = cache.tokens[n_keep + n_discard:L]
        cache.hashes[n_keep:L - n_discard] = cache.hashes[n_keep + n_discard:L]
        cache.length = L - n_discard

    def state_after(self, context: list[int]) -> tuple[int, int, int]:
        h = 0
        for tok in context:
            h = _next_hash(h, tok)
        return context[-1], len(context) - 1, h

    def logits_after(self, context: list[int]) -> torch.Tensor:
        return self._row(*self.state_after(context))


class ToyTokenizer:
    """Token i is the letter chr(ord('a') + i); `eog` ids end generation (not printed)."""

    def __init__(self, n_vocab: int = 8, eog: tuple[int, ...] = (), bos_id: int | None = None):
        self.n_vocab = n_vocab
        self.bos_id = bos_id
        self.eos_id = eog[0] if eog else None
        self.eog_ids = frozenset(eog)
        self.chat_template = None

    def token_bytes(self, tid: int, special: bool = True) -> bytes:
        return chr(ord("a") + tid).encode() if 0 <= tid < 26 else f"<{tid}>".encode()

    def token_text(self, tid: int) -> str:
        return self.token_bytes(tid).decode()

    def decode(self, ids, skip_special: bool = False) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode()

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        ids = [ord(c) - ord("a") for c in text]
        return ([self.bos_id] if add_special and self.bos_id is not None else []) + ids


# -- statistics -------------------------------------------------------------------------------------
def chi2_sf(x: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > x): regularized upper incomplete gamma Q(df/2, x/2)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def chi2_test(counts, probs, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson chi-square goodness of fit of observed `counts` against `probs` (same shape, any
    dims). Cells with expected count < min_expected are pooled into one cell. Observed counts in
    cells of probability 0 make the test fail outright (p = 0). -> (statistic, df, p-value)."""
    c = np.asarray(counts, dtype=np.float64).reshape(-1)
    p = np.asarray(probs, dtype=np.float64).reshape(-1)
    p = p / p.sum()
    N = c.sum()
    if np.any((p == 0) & (c > 0)):
        return math.inf, 0, 0.0
    e = p * N
    big = e >= min_expected
    obs = list(c[big])
    exp = list(e[big])
    if (~big).any() and e[~big].sum() > 0:
        obs.append(c[~big].sum())
        exp.append(e[~big].sum())
    obs, exp = np.array(obs), np.array(exp)
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return stat, df, chi2_sf(stat, df)


class _Done:
    """A finished Pending (backends.cuda_model): the result is there at once."""

    def __init__(self, ids: torch.Tensor):
        self._ids = ids

    def result(self) -> torch.Tensor:
        return self._ids


class ChainToy(ToyModel):
    """A ToyModel with the GPU model's greedy interface (backends.cuda_model.CudaTransformer):
    forward_argmax and greedy_chain (wait=False gives a Pending), so the generator's and the drafter's
    device paths (chains, the draft's look-ahead) run against a model whose logits show cache bugs."""

    device_argmax = True

    @staticmethod
    def _argmax(logits: torch.Tensor, bias) -> torch.Tensor:
        x = logits.clone()
        for i, v in bias:
            if 0 <= i < x.shape[-1]:
                x[:, i] += v
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1).astype(np.int64))

    def forward_argmax(self, tokens, start_pos: int, cache: ToyCache, bias=(), decode: bool = False,
                       n_out: int | None = None) -> torch.Tensor:
        return self._argmax(self.forward(tokens, start_pos, cache, decode=decode, n_out=n_out), bias)

    def greedy_chain(self, tokens, start_pos: int, cache: ToyCache, k: int, bias=(), n_out: int | None = None,
                     wait: bool = True):
        tokens = torch.as_tensor(tokens).reshape(-1)
        if k < 1 or start_pos + tokens.shape[0] + k - 1 > cache.capacity:
            raise ValueError("the chain does not fit the cache")
        out = [int(self._argmax(self.forward(tokens, start_pos, cache, last_n=1, n_out=n_out), bias)[-1])]
        for _ in range(k - 1):
            out.append(int(self._argmax(self.forward([out[-1]], cache.length, cache, n_out=n_out), bias)[-1]))
        ids = torch.tensor(out)
        return ids if wait else _Done(ids)
