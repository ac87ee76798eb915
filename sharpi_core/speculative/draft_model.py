"""A smaller model with its own KV cache proposes k tokens, sampled with the target's params."""
from __future__ import annotations

import torch

from ..sampling import SamplingParams, adjust_logits, filtered_probs


class DraftModelDrafter:
    def __init__(self, model, cache, params: SamplingParams, generator: torch.Generator | None = None,
                 n_batch: int = 512):
        self.model, self.cache, self.params = model, cache, params
        self.generator = generator
        self.n_batch = n_batch
        self.history: list[int] = []  # tokens whose K/V are in self.cache

    def _sync(self, history: list[int]) -> torch.Tensor:
        """Make the cache hold `history`, reusing the longest common prefix; logits of its last token."""
        n = 0
        h = self.history
        lim = min(len(h), len(history))
        while n < lim and h[n] == history[n]:
            n += 1
        n = min(n, len(history) - 1)  # the last token is always re-fed: its logits are needed
        self.cache.truncate(n)
        self.history = list(history[:n])
        logits = None
        for s in range(n, len(history), self.n_batch):
            chunk = history[s:s + self.n_batch]
            logits = self.model.forward(torch.tensor(chunk), s, self.cache, last_n=1)
            self.history += chunk
        return logits[-1]

    def propose(self, history: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        k = min(k, self.cache.capacity - len(history))
        if k <= 0:
            return [], None
        logits = self._sync(history)
        tokens: list[int] = []
        qs = []
        for i in range(k):
            x = adjust_logits(logits, self.params, self.history)
            if self.params.greedy:
                t = int(x.argmax())
            else:
                q = filtered_probs(x, self.params)
                t = int(torch.multinomial(q, 1, generator=self.generator))
                qs.append(q)
            tokens.append(t)
            if i + 1 < k:
                logits = self.model.forward(torch.tensor([t]), len(self.history), self.cache)[-1]
                self.history.append(t)
        return tokens, (torch.stack(qs) if qs else None)

    def rollback(self, n_keep: int) -> None:
        if len(self.history) > n_keep:
            self.cache.truncate(n_keep)
            self.history = self.history[:n_keep]
