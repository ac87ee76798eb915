"""A smaller model with its own KV cache proposes k tokens, sampled with the target's params.

The drafter keeps `history`: the tokens whose K/V are in its cache. A proposal re-syncs with the
history it is given by reusing the longest common prefix (truncate) and feeding only the missing
suffix in batched forwards, then runs k-1 single-token forwards (the last proposal is never fed:
the next call feeds it if it was accepted). Each proposal is drawn from q = filtered_probs of the
draft's logits after the same bias/penalties (over its own history, i.e. the target's history plus
the drafts so far), and q is returned, so sampled verification is exact. Greedy: argmax, q None; on a
model that takes arg-maxes itself (a GPU: greedy_chain) the catch-up pass and the k-1 steps run as
one chain, each step fed the last one's arg-max on the device, one transfer of k ids at the end.

Look-ahead (chains only, greedy or sampling; SHARPI_SPEC_LOOKAHEAD=0 turns it off): the chain runs one pass further, so
it also yields the draft's guess g of the target's bonus token, and right after returning the
proposals the drafter queues, on its own stream, the next step's chain from g, as if the target will
accept all k and its bonus will be g. The target's verify pass then runs on the GPU beside it. If the
guess holds (the next call's history is exactly the assumed one), the next proposals are already there;
otherwise they are dropped with the cache rows they wrote. Proposals only: the target's verification
decides, so the output does not depend on them (greedy: token for token the plain output; sampling: in
law, each proposal being a draw from the draft's law at its history, with uniforms of its own).

A history longer than the draft's context (-cd smaller than what the target holds) slides through it:
the draft keeps the last half of its context and proposes from those tokens alone, their K moved down
as a context shift moves them (positions from 0; `_base` target tokens are left out), so speculation
goes on however long the generation (llama.cpp's speculative example drafts from the tail too).

head_vocab = N computes the draft's output layer for token ids [0, N) only (a zero-copy view of its
first N rows), like FR-Spec's frequency-ranked draft head: with a byte-level BPE vocabulary the ids
follow merge order, so the first 64k of Qwen2's 152k ids cover ~98% of its tokens on code and prose
while the draft's output matmul (a third of a 0.5B draft's weight bytes) shrinks 2.3x. Exactness does
not depend on it: q is the distribution the proposals were really drawn from (0 past N), and the
target verifies; only the acceptance rate can change.
"""
from __future__ import annotations

import copy

import numpy as np
import torch

from ..sampling import NoDistribution, SamplingParams, apply_penalties, argmax, argmax_on_device, candidates, draw
from ..grammar import grammar_need
from ..threads import using_threads
from .util import common_prefix
from ..switches import switch

LOOKAHEAD = switch("SHARPI_SPEC_LOOKAHEAD")
# When sampling, a proposal ends after a token drawn from a law q whose largest probability is under P_STOP: the
# tokens after an unsure one are mostly rejected, and drafting them costs draft passes and verify rows (llama.cpp's
# draft loop stops so at its --draft-p-min, 0.75). The draft's confidence tells: of the 0.5B Qwen draft's greedy
# tokens, those it gave >= 0.95 were the 1.5B target's 99.6% of the time, 0.5-0.7 74%, under 0.3 21%. Only which
# tokens are proposed, decided by the draft's rows before the target sees any: the output's law is unchanged.
# scripts/bench_spec_count.py --switch SHARPI_SPEC_CONFIDENCE (README, Speed), temp 0.7: about even at k = 4 on
# code requests, 3-7% faster at k = 16 and on prose (one code request alone lost 5%). Greedy proposals go on: there
# the count chosen from measured costs already drafts what pays, and stopping at 0.75 or 0.4 measured 0-3% slower.
P_STOP = 0.75


class DraftModelDrafter:
    def __init__(self, model, cache, params: SamplingParams, generator: torch.Generator | None = None,
                 n_batch: int = 512, head_vocab: int | None = None, threads: tuple = (None, None)):
        self.model, self.cache, self.params = model, cache, params
        # the CPU threads of its passes of one token and of more (-td, -tbd; None: the target's)
        self.threads = threads
        self.generator = generator
        self.n_batch = max(1, n_batch)
        self.n_vocab = int(model.config.n_vocab)
        # rows of the draft's output layer computed (None: all)
        self.n_out = head_vocab if head_vocab and head_vocab < self.n_vocab else None
        self.history: list[int] = []  # tokens whose K/V are in self.cache
        self._base = 0  # the target's first _base history tokens are left out (the window slid past them)
        # those tokens, to see the target's history start anew (/clear, another prompt); a context shift moves
        # them as it moves the target's
        self._prefix: list[int] = []
        self.forwards = 0  # forward passes run (stats/tests)
        self.chain = argmax_on_device(model, params)
        # sampling on a GPU that draws the proposals itself (sample_chain): one launch and one small transfer
        # for k proposals and their laws, as a greedy chain
        self.device_sample = bool(getattr(model, "can_sample", None) and model.can_sample(params, self.n_out))
        self.lookahead = (self.chain or self.device_sample) and LOOKAHEAD
        self._ahead = None  # a Pending chain queued for the history self.history (see the module's doc)
        self.lookahead_hits = 0
        self._k_max = 0  # the most proposals asked for at once
        self._grammar = None  # a grammar.TokenGrammar and its state after the history: see constrain_with
        self._gstate = None
        self._picker = None  # a copy of the target's picker (mirostat, adaptive-p): see sample_like
        self.p_stop = P_STOP if switch("SHARPI_SPEC_CONFIDENCE") else 0.0  # (SHARPI_SPEC_CONFIDENCE=0: never)

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        # a target token outside the draft's vocabulary (vocabularies may differ by a few ids) is
        # fed as id 0: only the draft's guesses suffer, exactness does not depend on them
        return torch.tensor([t if 0 <= t < self.n_vocab else 0 for t in tokens], dtype=torch.long)

    def _feed(self, tokens: list[int], last_n: int | None = None, decode: bool = True) -> torch.Tensor:
        start = len(self.history)
        x = self._ids(tokens)
        # decode=True: a short catch-up (the last proposal and the bonus token) runs as decoding rows,
        # the cheaper order for a few rows (the prompt is prefilled in prompt order, as llama.cpp does);
        # the draft's numerics only change its proposals' q
        with using_threads(self.threads[len(tokens) > 1]):
            if self.n_out is None:
                logits = self.model.forward(x, start, self.cache, last_n=last_n, decode=decode)
            else:
                logits = self.model.forward(x, start, self.cache, last_n=last_n, decode=decode, n_out=self.n_out)
        self.history += tokens
        self.forwards += 1
        return logits[-1]

    def _reuse(self, history: list[int]) -> int:
        """Cut the cache to the longest common prefix with `history` (all but its last token at most)."""
        n = self.cache.reach(min(common_prefix(self.history, history), len(history) - 1, self.cache.length))
        if n < self.cache.length:
            self.cache.truncate(n)
        del self.history[n:]
        return n

    def _sync(self, history: list[int], upto: int | None = None) -> torch.Tensor | None:
        """Make the cache hold history[:upto] (all of it by default) in chunks of n_batch counted from the
        reused prefix; the logits of its last token."""
        n = len(self.history)
        logits = None
        for s in range(n, len(history) if upto is None else upto, self.n_batch):
            logits = self._feed(list(history[s:s + self.n_batch]), last_n=1, decode=n > 0)
        return logits

    def prefill(self, tokens: list[int]) -> None:
        """Evaluate tokens (the prompt, right after the target evaluated it) now: the first proposal then feeds
        only what follows, and the draft's prompt counts as prompt time, not as decoding time (nor as the
        cost of the first proposal, which the cost-aware generator measures). A prompt the draft's context
        cannot hold with proposals is evaluated from its window: its tail, as the first proposal would take it."""
        if not tokens:
            return
        self._drop_ahead()
        window = self._window(list(tokens), 1)
        if not window or len(window) + 2 > self.cache.capacity:
            return
        self._reuse(window + [-1])  # (all of the window may be reused)
        self._sync(window)

    def _run_chain(self, tokens: list[int], start: int, m: int, wait: bool = True):
        """The model's chain of m passes from tokens at start, each fed the last one's pick: greedy_chain's arg-maxes
        int64 [m], or (device_sample) sample_chain's (tokens [m], top-k ids, their law) drawn with uniforms of its
        own; wait=False: a Pending of that."""
        if self.device_sample:
            u = torch.rand(m, generator=self.generator, dtype=torch.float64).numpy()
            return self.model.sample_chain(self._ids(tokens), start, self.cache, m, self.params, u, n_out=self.n_out,
                                           wait=wait)
        return self.model.greedy_chain(self._ids(tokens), start, self.cache, m, self.params.logit_bias,
                                       n_out=self.n_out, wait=wait)

    def _chain_for(self, history: list[int], k: int) -> tuple[int, list[int], object]:
        """The chain's picks for history: the queued look-ahead chain's if its guess held, else a new chain of k
        (and the guess, with look-ahead) -> (k, lowered to the picks a held chain has; the picks' ids; the chain's
        result).
        The cache then holds history and the picks fed: all but the last."""
        ahead, self._ahead = self._ahead, None
        m = k + 1 if self.lookahead else k  # the chain's length: with look-ahead, the bonus guess too
        if ahead is not None and history == self.history:
            # the guess held: the chain queued last time ran from it, its first outputs are in the cache
            out = ahead.result()
            k = min(k, len(out[0] if self.device_sample else out) - 1)
            self.cache.truncate(len(history) + k)
            self.lookahead_hits += 1
        else:  # (a queued chain's cache rows past the common prefix go with the rest)
            n = self._reuse(history)
            last = n + (len(history) - 1 - n) // self.n_batch * self.n_batch  # where _sync's last chunk starts
            self._sync(history, last)
            tail = list(history[last:])
            out = self._run_chain(tail, last, m)
            self.history += tail
            self.forwards += m
        picks = (out[0] if self.device_sample else out).tolist()
        self.history += picks[:k] if m > k else picks[:k - 1]  # what the cache holds: the chain fed all but its last
        return k, picks, out

    def _propose_chain(self, history: list[int], k: int) -> list[int]:
        k, out, _ = self._chain_for(history, k)
        if self.lookahead and len(out) > k:
            # after a full accept the generator asks for twice as many (generate.next_proposal_len)
            self._look_ahead(out[k], min(self._k_max, 2 * k))
        return out[:k]

    def _propose_sampled(self, history: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """The k proposals drawn on the device (sample_chain), each with the law q it was drawn from; as
        propose's loop they end at a row with nothing to draw and after an unsure draw (p_stop). With the
        look-ahead the chain draws one more, the guess of the target's bonus token, and the next chain is
        queued from it (as _propose_chain's): the guess holds when every proposal is accepted and the target
        draws the same bonus token. Either way the proposals for a history are drawn from the draft's law there
        with uniforms of their own, so the verification stays exact."""
        k, toks, (_, ids, probs) = self._chain_for(history, k)
        ids, probs = ids.numpy(), probs.numpy()
        tokens: list[int] = []
        qs = np.zeros((k, self.n_out or self.n_vocab), dtype=np.float32)  # (the rows the draft computes)
        for i, t in enumerate(toks[:k]):
            if t < 0:  # (a draft whose logits broke down costs its proposals, not the generation)
                break
            kept = probs[i] > 0
            qs[i, ids[i][kept]] = probs[i][kept]
            tokens.append(t)
            if self.p_stop > 0 and float(probs[i].max()) < self.p_stop:
                break
        # (proposals cut short: the guess's history cannot come)
        if self.lookahead and len(toks) > k and len(tokens) == k and toks[k] >= 0:
            self._look_ahead(toks[k], min(self._k_max, 2 * k))
        return tokens, (torch.from_numpy(qs[:len(tokens)]) if tokens else None)

    def _look_ahead(self, guess: int, k: int) -> None:
        """Queue the next step's chain (k proposals and a guess) from `guess`, without waiting."""
        start = len(self.history)
        if start + 1 + k > self.cache.capacity:
            return
        self._ahead = self._run_chain([guess], start, k + 1, wait=False)
        self.history.append(guess)
        self.forwards += k + 1

    def constrain_with(self, grammar, state) -> None:
        """The next proposals follow `grammar` from `state` (the target's grammar state after the history
        the next propose() gets): drafts the grammar forbids would be rejected for sure. The proposals'
        q is the masked law they are drawn from, so exactness does not depend on it. (A device chain
        proposes without it.)"""
        self._grammar, self._gstate = grammar, state

    def sample_like(self, picker) -> None:
        """The next proposals are drawn as the target's picker (sampling.Picker: mirostat, adaptive-p)
        would draw them, from its current state, the state following each proposal: the law closest to
        the one the verify rows will have. (Any law is exact, q records it; only the acceptance rate
        depends on it.)"""
        self._picker = copy.copy(picker)

    def _window(self, history: list[int], k: int) -> list[int]:
        """The part of the target's history the draft proposes from: all of it while it fits the draft's
        context with k proposals, then its tail, the window sliding by whole halves of the context."""
        if self._base:
            if history[:self._base] != self._prefix:  # another history (/clear, a new prompt): from position 0
                self._drop_ahead()
                self._base, self._prefix = 0, []
                self.cache.truncate(0)
                del self.history[:]
                return self._window(history, k)
            history = history[self._base:]
        cap = self.cache.capacity
        drop = len(history) - cap // 2
        if len(history) + k + 1 <= cap or cap < 4 or drop <= 0:  # (within half the context: fewer proposals)
            return history
        self._drop_ahead()
        self._reuse(history)  # (the cache holds a prefix of it)
        self._shift(0, drop)
        self._prefix = self._prefix + list(history[:drop])
        self._base += drop
        return history[drop:]

    def _drop_ahead(self) -> None:
        if self._ahead is not None:  # a queued chain writes this cache: let it finish, then drop it
            self._ahead.result()
            self._ahead = None

    @property
    def window_start(self) -> int:
        """Where in the target's history the cache's position 0 is (0 until the window slides)."""
        return self._base

    def propose(self, history: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        history = self._window(history, k)
        k = min(k, self.cache.capacity - len(history))
        if k <= 0 or not history:
            return [], None
        self.cache.keep_states(k + 1)  # (recurrent layers: the rollback after the target's verdict goes k + 1 back)
        if self.chain:
            self._k_max = max(self._k_max, k)
            return self._propose_chain(history, k), None
        if self.device_sample and self._grammar is None and self._picker is None:
            self._k_max = max(self._k_max, k)
            return self._propose_sampled(history, k)
        self._drop_ahead()
        self._reuse(history)
        logits = self._sync(history)
        tokens: list[int] = []
        qs = None
        need = grammar_need(self.params) if self._grammar is not None else None
        for i in range(k):
            x = apply_penalties(logits, self.history, self.params)
            if self._grammar is not None:  # (the draft's row may be narrower or wider than the vocabulary)
                kept = self._grammar.constrain(x.detach().to("cpu", torch.float32).numpy(), self._gstate, need)
                if kept is None:
                    break
                x = torch.from_numpy(kept)
            if self.params.greedy:
                t = int(argmax(x))
                sure = True
            else:
                try:
                    if self._picker is not None:
                        t, idx, p = self._picker.draw_token(x.detach().to("cpu", torch.float32).numpy(), self.params,
                                                            self.generator)
                    else:
                        idx, p = candidates(x, self.params)
                        idx, p = idx.numpy(), p.numpy()
                        t = int(idx[draw(p, self.generator)])
                except NoDistribution:  # (a draft whose logits broke down costs its proposals, not the generation)
                    break
                if qs is None:
                    qs = np.zeros((k, x.shape[-1]), dtype=np.float32)
                qs[i, idx] = p
                sure = self.p_stop <= 0 or float(p.max()) >= self.p_stop
            tokens.append(t)
            if self._grammar is not None:
                self._gstate = self._grammar.advance(self._gstate, t)
            if not sure:  # (decided by the draft's rows alone, before the target sees any: exactness keeps)
                break
            if i + 1 < k:
                logits = self._feed([t])
        if qs is not None:
            qs = qs[: len(tokens)]
        return tokens, (torch.from_numpy(qs) if qs is not None else None)

    def shift(self, n_keep: int, n_discard: int) -> None:
        """The target's context shifted (generate.Generator._shift): positions [n_keep, n_keep + n_discard)
        went and the later ones moved down. The same here keeps the draft's cache in step with the
        target's history (what it holds past the target's is dropped by the next proposal's reuse).
        With a slid window, in its coordinates: what went before the window only moves it down."""
        if self._base:
            b, pre = self._base, self._prefix
            if n_keep + n_discard <= b:  # (the target's first _base tokens, _prefix, shift the same way)
                self._base -= n_discard
                self._prefix = pre[:n_keep] + pre[n_keep + n_discard:]
                return
            self._base = min(b, n_keep)
            self._prefix = pre[:self._base]
            n_keep, n_discard = max(0, n_keep - b), n_keep + n_discard - max(b, n_keep)
        self._shift(n_keep, n_discard)

    def _shift(self, n_keep: int, n_discard: int) -> None:
        """Positions [n_keep, n_keep + n_discard) of the draft's own cache go, the later ones move down."""
        self._drop_ahead()
        n = min(len(self.history), self.cache.length)
        self.cache.truncate(n)
        del self.history[n:]
        if n > n_keep + n_discard:
            self.model.shift_cache(self.cache, n_keep, n_discard)
            del self.history[n_keep:n_keep + n_discard]
        elif n > n_keep:
            n_keep = self.cache.reach(n_keep)  # (a convolution state further back is gone: from the start)
            self.cache.truncate(n_keep)
            del self.history[n_keep:]

    def rollback(self, n_keep: int) -> None:
        """The target kept the first n_keep tokens of the last history + proposals: drop the rest."""
        n_keep = max(0, n_keep - self._base)
        if self._ahead is not None:
            if n_keep >= len(self.history) - 1:
                return  # all accepted: whether the bonus is the guess shows in the next call's history
            self._ahead = None
        if len(self.history) > n_keep:
            n_keep = self.cache.reach(min(n_keep, self.cache.length))  # (a recurrent state further back: from the start)
            self.cache.truncate(n_keep)
            del self.history[n_keep:]
