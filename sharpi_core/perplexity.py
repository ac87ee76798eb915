"""Perplexity the way llama-perplexity computes it (its default, non-strided mode).

The text is tokenized once; chunks of n_ctx tokens are evaluated each in a fresh context (with
the first token replaced by BOS when the model adds BOS); the second half of each chunk is scored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import SharpiError


@dataclass
class PerplexityResult:
    ppl: float
    err: float
    n_chunks: int
    n_scored: int
    chunk_ppl: list[float]


def chunk_count(n_tokens: int, n_ctx: int, n_chunks: int = -1) -> int:
    """The chunks evaluated: all the whole ones the text has (n_chunks < 0), or at most n_chunks."""
    if n_ctx < 3 or n_chunks == 0:  # each chunk scores its second half, after that half's first token
        raise SharpiError(f"perplexity needs a context of 3 tokens or more (not {n_ctx}) and 1 chunk or more")
    available = n_tokens // n_ctx
    if available < 1:
        raise SharpiError(f"need at least {n_ctx} tokens for perplexity at -c {n_ctx}, the text has {n_tokens}")
    return available if n_chunks < 0 else min(n_chunks, available)


def perplexity(model, tokens: list[int], n_ctx: int, n_chunks: int = -1, bos_id: int | None = None,
               type_k: str = "f16", type_v: str = "f16",
               on_chunk: Callable[[int, float], None] | None = None) -> PerplexityResult:
    n = chunk_count(len(tokens), n_ctx, n_chunks)
    first = n_ctx // 2
    cache = model.new_cache(n_ctx, type_k, type_v)
    nll = nll2 = 0.0
    count = 0
    chunk_ppl = []
    for i in range(n):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        cache.truncate(0)
        logits = model.forward(torch.tensor(chunk), 0, cache)  # [n_ctx, V]
        lp = torch.log_softmax(logits[first:n_ctx - 1].double(), dim=-1)
        tgt = torch.tensor(chunk[first + 1:n_ctx])
        tok_nll = -lp.gather(1, tgt[:, None])[:, 0]
        nll += float(tok_nll.sum())
        nll2 += float((tok_nll ** 2).sum())
        count += tok_nll.numel()
        chunk_ppl.append(math.exp(nll / count))
        if on_chunk:
            on_chunk(i, chunk_ppl[-1])
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    err = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0
    return PerplexityResult(ppl, err, n, count, chunk_ppl)
