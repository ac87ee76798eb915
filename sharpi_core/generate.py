"""The generation loop: prefill, then plain or speculative decoding, streaming text as it comes.

`Generator.history` is the list of tokens whose K/V are in the target cache. A call reuses the
longest common prefix of that history and the new prompt (multi-turn chat re-evaluates only the
new turn) and prefills the rest in chunks of n_batch.

Each step starts from the *certain* token t: sampled already and emitted, not yet in the cache.

- plain step: forward [t], sample the next token with penalties over the history.
- speculative step (llama.cpp's formulation): the drafter proposes d1..dk for history + [t]; ONE
  target forward over [t, d1..dk] gives k+1 rows: row i is the target's distribution after
  d1..di (penalties use exactly that history), so it verifies d_{i+1}, and row k gives the bonus
  token when all k are accepted. Accepted drafts plus the correction/bonus are emitted; rollback is
  `cache.truncate` on the target and `drafter.rollback` on the draft side.

At temp <= 0 the output equals plain greedy decoding token for token (given equal logits); at
temp > 0 it is an exact sample of the same distribution (Leviathan/Chen acceptance), unless
spec_p_min > 0 (opt-in looser acceptance).

With a grammar (grammar.TokenGrammar) every pick is masked in the grammar's state after the tokens
before it: plain steps, and each verify row after its drafts (a draft model proposes under the grammar
too); the law is the chain on the masked logits, so speculation stays exact with it. A reasoning budget
(reasoning.ReasoningBudget, alone or with a grammar: reasoning.Both) is such a constraint too. A picker's law
(mirostat, adaptive-p) depends on its state, which follows each pick: verify row i is computed in the
state drafts d1..di lead to (sampling.Picker.rows), and the state moves past what the step emits.

Environment switches: SHARPI_SPEC_BATCH_VERIFY=0 verifies the same proposals with k+1 single-token
forwards (same output; isolates batched-forward numerics); SHARPI_SPEC_SAMPLE=0 turns speculation
off at temp > 0 (recorded in `Generator.notes`); SHARPI_SPEC_ADAPTIVE=0 proposes n_max tokens at
every step instead of adapting the count to the last step's acceptance; SHARPI_SPEC_COST=0 speculates at
every step instead of where the costs say it pays (speculative.SpecCost: measured in greedy decoding, fixed
estimates when sampling, =1 measured there too); SHARPI_SPEC_COUNT=0 keeps the generator's count of proposals for a
draft model where SpecCost would propose the count with the most tokens per second expected.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

import numpy as np
import torch

from .errors import SharpiError
from .grammar import grammar_need
from .sampling import (AdaptiveP, Mirostat, NoDistribution, SamplingParams, apply_penalties, argmax_on_device,
                       draw, filtered_probs, sample)
from .speculative import SpecCost, accept_argmax, accept_greedy, accept_sampled
from .speculative.hybrid import DRAFT_COST, VERIFY_ROW
from .speculative.synthetic import conditional
from .speculative.util import common_prefix, next_proposal_len
from .switches import switch, tri_state
from .tokenizer import StreamDecoder


@dataclass
class Timings:
    prompt_n: int = 0       # prompt tokens evaluated (the reused cached prefix is not counted)
    prompt_ms: float = 0.0
    eval_n: int = 0         # tokens generated
    eval_ms: float = 0.0

    def __add__(self, other: Timings) -> Timings:  # a chat session's totals over its replies
        return Timings(self.prompt_n + other.prompt_n, self.prompt_ms + other.prompt_ms, self.eval_n + other.eval_n,
                       self.eval_ms + other.eval_ms)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_n / self.prompt_ms * 1000 if self.prompt_ms else 0.0

    @property
    def eval_tps(self) -> float:
        return self.eval_n / self.eval_ms * 1000 if self.eval_ms else 0.0


@dataclass
class SpecStats:
    drafted: int = 0            # draft tokens verified
    accepted: int = 0           # of those, accepted
    target_passes: int = 0      # target decode passes (verify passes + plain steps)
    verify_passes: int = 0      # of those, speculative verify passes
    emitted: int = 0            # tokens produced by those passes (up to the one that stopped generation)
    steps_no_proposal: int = 0  # steps where the drafter proposed nothing usable (plain step)
    full_accepts: int = 0       # verify passes that accepted every proposal
    per_position_drafted: list[int] = field(default_factory=list)
    per_position_accepted: list[int] = field(default_factory=list)
    sources: dict = field(default_factory=dict)  # per draft source of a HybridDrafter: drafted, accepted, steps
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    commit_ms: float = 0.0
    plain_by_cost: int = 0      # plain steps taken because the measured costs favoured them (speculative.SpecCost)
    cost_off: bool = False      # the draft model went off in the call (it did not pay; with --draft-lookup,
                                # lookup goes on alone), for 256 steps at a time

    def record(self, k: int, n: int, source: str | None = None, sign: int = 1) -> None:
        """A verify pass of k proposals that accepted n (sign -1: taken back)."""
        if source is not None:
            s = self.sources.setdefault(source, {"drafted": 0, "accepted": 0, "steps": 0})
            s["drafted"] += sign * k
            s["accepted"] += sign * n
            s["steps"] += sign
        while len(self.per_position_drafted) < k:
            self.per_position_drafted.append(0)
            self.per_position_accepted.append(0)
        for i in range(k):
            self.per_position_drafted[i] += sign
            self.per_position_accepted[i] += sign * (i < n)
        self.drafted += sign * k
        self.accepted += sign * n
        self.full_accepts += sign * (n == k)
        self._last = (k, n, source)

    def stopped_at(self, used: int, produced: int) -> None:
        """Generation stopped at the used-th accepted draft of the last pass (an end of generation, a stop
        string), which had produced `produced` tokens: the pass counts as proposing those `used` drafts, all
        accepted, and producing them alone (what came after the stop was neither shown nor is in the cache)."""
        k, n, source = self._last
        self.record(k, n, source, -1)
        self.record(used, used, source)
        self.emitted -= produced - used
        while self.per_position_drafted and not self.per_position_drafted[-1]:  # (positions only that pass had)
            self.per_position_drafted.pop()
            self.per_position_accepted.pop()

    def __add__(self, other: SpecStats) -> SpecStats:
        """Two calls' counts together (a chat session's totals over its replies)."""
        out = SpecStats(**{f: getattr(self, f) + getattr(other, f) for f in (
            "drafted", "accepted", "target_passes", "verify_passes", "emitted", "steps_no_proposal", "full_accepts",
            "draft_ms", "verify_ms", "commit_ms", "plain_by_cost")}, cost_off=self.cost_off or other.cost_off)
        for a in (self, other):
            for i, (d, n) in enumerate(zip(a.per_position_drafted, a.per_position_accepted)):
                if i == len(out.per_position_drafted):
                    out.per_position_drafted.append(0)
                    out.per_position_accepted.append(0)
                out.per_position_drafted[i] += d
                out.per_position_accepted[i] += n
            for name, v in a.sources.items():
                s = out.sources.setdefault(name, {"drafted": 0, "accepted": 0, "steps": 0})
                for key in s:
                    s[key] += v[key]
        return out

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.emitted / self.target_passes if self.target_passes else 0.0

    def as_dict(self) -> dict:
        return {
            "drafted": self.drafted, "accepted": self.accepted,
            "acceptance": self.acceptance,
            "target_passes": self.target_passes, "verify_passes": self.verify_passes,
            "tokens_per_pass": self.tokens_per_pass,
            "per_position_drafted": list(self.per_position_drafted),
            "per_position_accepted": list(self.per_position_accepted),
            "per_position_acceptance": [a / d if d else 0.0 for a, d in
                                        zip(self.per_position_accepted, self.per_position_drafted)],
            **({"sources": {k: dict(v) for k, v in self.sources.items()}} if self.sources else {}),
            "steps_no_proposal": self.steps_no_proposal, "full_accepts": self.full_accepts,
            "plain_by_cost": self.plain_by_cost, "cost_off": self.cost_off,
            "draft_ms": round(self.draft_ms, 2), "verify_ms": round(self.verify_ms, 2),
            "commit_ms": round(self.commit_ms, 2),
        }


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    stop_reason: str  # eos | n_predict | ctx_full | stop_string | interrupted | grammar (no token allowed)
    timings: Timings
    spec: SpecStats | None = None
    context_shifts: int = 0  # times the context was shifted (--context-shift)
    eog_token: int | None = None  # the end-of-generation token that stopped it (stop_reason eos; not in tokens)


class _Stop(Exception):
    def __init__(self, reason: str):
        self.reason = reason


# llama-completion looks for a reverse prompt in the text of the last 32 tokens its samplers saw
STOP_WINDOW = 32


def _wrapped_models(drafter):
    """What a drafter proposes with, down its `.model`s (a HybridDrafter's DraftModelDrafter's Transformer)."""
    m = getattr(drafter, "model", None)
    for _ in range(4):
        if m is None:
            return
        yield m
        m = getattr(m, "model", None)


def _probs_before_broken(rows: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """filtered_probs of the verify rows [R, V] before the first that has no distribution (NoDistribution when
    the first has none)."""
    good = []
    for r in range(rows.shape[0]):
        try:
            good.append(filtered_probs(rows[r:r + 1], params))
        except NoDistribution:
            break
    if not good:
        raise NoDistribution()
    return torch.cat(good)


class Generator:
    def __init__(self, model, cache, tokenizer, params: SamplingParams, seed: int = 0, drafter=None,
                 spec_n_max: int = 4, spec_n_min: int = 0, spec_p_min: float = 0.0, n_batch: int = 512,
                 threads=None, grammar=None, context_shift: bool = False, n_keep: int = 0, special: bool = False,
                 batch_threads: int | None = None, synth_rates: Sequence[float] | None = None):
        self.model, self.cache, self.tok, self.params = model, cache, tokenizer, params
        self.threads = threads  # a threads.ThreadGovernor, stepped per decoding step / prompt batch (or None)
        # -tb: threads for the prompt's batches of more than one token (evaluating them is bound by compute, where
        # decoding is bound by memory); verify passes are decoding (-t)
        self.batch_threads = batch_threads
        self.rng = torch.Generator().manual_seed(seed)
        self.drafter = drafter
        self.n_max, self.n_min, self.p_min = spec_n_max, spec_n_min, spec_p_min
        # --spec-synth-len / -rates (benchmarking): proposals accepted at random with these chances, not verified
        self.synth = conditional(synth_rates) if synth_rates else None
        self.synth_rng = random.Random(seed)
        self.n_batch = max(1, n_batch)
        self.n_vocab = int(model.config.n_vocab)
        self.history: list[int] = []  # tokens whose K/V are in the cache
        # the prompt's tokens a should_stop() between its batches left out of the cache (the last generate())
        self.unevaluated: list[int] = []
        self.notes: list[str] = []
        self.special = special  # -sp: the text shows control tokens, the end of generation's too (llama-completion)
        # context shift (llama.cpp's --context-shift, --keep): see _shift
        self.context_shift, self.n_keep = context_shift, n_keep
        self.shifts = 0          # context shifts in the last generate() call
        self._kept = 0           # positions a shift keeps in this sequence
        self._dropped: list[int] = []  # the tokens this sequence's shifts took out of the cache, in order
        self._n_dropped = 0      # how many (_dropped keeps only the last history_window of them, none at 0)
        # samplers (penalties, DRY) see the tokens of the sequence from this count on: a resumed
        # generation starts them over (llama-completion's interactive mode resets them at each input)
        self._mark = 0
        self._exact: int | None = None  # after a shift, the positions whose K/V are those of history[:n] alone
        self.batch_verify = switch("SHARPI_SPEC_BATCH_VERIFY")
        # proposals per step adapt to how the last ones fared (SHARPI_SPEC_ADAPTIVE=0: always n_max):
        # a rejected proposal costs verify rows and, with a draft model, draft forwards for nothing,
        # which is what pulls speculation below plain decoding on text the drafter cannot predict
        self.adaptive = switch("SHARPI_SPEC_ADAPTIVE")
        self._k = spec_n_max
        # a drafter of several sources adapts each source's count itself (speculative.HybridDrafter): asked for n_max
        self._own_k = getattr(drafter, "adapts", None) is not None
        if self._own_k:
            drafter.adapts = self.adaptive
        self.speculate = drafter is not None and spec_n_max >= 1
        if self.speculate and not params.greedy and not switch("SHARPI_SPEC_SAMPLE"):
            self.speculate = False
            self.notes.append("SHARPI_SPEC_SAMPLE=0: speculation is off for sampled decoding (--temp > 0, or typical "
                              "or XTC at --temp 0)")
        # speculate only where it pays (speculative.SpecCost): by the measured costs in greedy decoding (and with
        # SHARPI_SPEC_COST=1), by fixed estimates when sampling (a seed's draws must not depend on timing), never
        # with SHARPI_SPEC_COST=0
        mode = tri_state("SHARPI_SPEC_COST")
        self.cost = None
        if self.speculate and mode is not False:
            # (SHARPI_SPEC_COUNT=0: a draft model proposes the generator's count, not the one its costs choose)
            costs, count = (VERIFY_ROW, self._draft_cost(drafter)), switch("SHARPI_SPEC_COUNT")
            if params.greedy or mode:
                warm_up = any(getattr(m, "use_graphs", False) for m in (model, *_wrapped_models(drafter)))
                self.cost = SpecCost(drafter, warm_up, guess=costs, count=count)
            else:
                self.cost = SpecCost(drafter, fixed=costs, count=count)
        # mirostat or adaptive-p draws the token (sampling.Picker): its state follows every token it picks
        # and starts over at each generate() call (llama.cpp's interactive mode resets its samplers at each
        # user input); a verify row's law is computed in the state its drafts lead to (Picker.rows)
        self.picker = None
        if params.mirostat and not params.greedy:
            self.picker = Mirostat(params.mirostat, params.mirostat_tau, params.mirostat_eta, self.n_vocab)
        elif params.adaptive_on:
            self.picker = AdaptiveP(params.adaptive_target, params.adaptive_decay)
        # greedy steps whose arg-max the model takes where its logits are (a GPU: 4 bytes a row come
        # back instead of the logits; SHARPI_DEVICE_ARGMAX=0 turns it off there)
        self.device_argmax = argmax_on_device(model, params) and grammar is None
        # a drafter that reads the target's hidden rows (speculative.MtpDrafter) sees every target pass's
        self._observe = getattr(drafter, "observe", None) if self.speculate else None
        if self._observe is not None:
            self.device_argmax = False
        # sampled steps and verify passes whose law (the default chain's) the model computes where its logits are,
        # drawing a step's token there (a GPU: the top-k law comes back instead of the logits; SHARPI_DEVICE_SAMPLE=0
        # turns it off there): the plain steps and the acceptance test then share that law, so the output is an
        # exact sample of it either way
        self.device_sample = (bool(getattr(model, "can_sample", None)) and model.can_sample(params) and grammar is None
                              and self.picker is None and self._observe is None)
        # a grammar (grammar.TokenGrammar) masks what the chain sees after bias, penalties and DRY; its
        # state follows the picked tokens and starts over at each generate() call
        self.grammar = grammar
        self.gstate = grammar.initial() if grammar is not None else None
        self._need = grammar_need(params) if grammar is not None else None
        self._prefilled = 0
        self._tail = None  # (history length, logits [V] of its last token) after feed()

    # -- prompt --------------------------------------------------------------------------------
    def _prefill(self, prompt: list[int], should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Reuse the cached common prefix, evaluate the rest; logits [V] of the last prompt token. should_stop()
        is asked before each batch (_Stop interrupted: the batches evaluated stay in the cache)."""
        if not prompt:
            raise SharpiError("empty prompt: nothing to generate from")
        if len(prompt) > self.cache.capacity:
            raise SharpiError(f"prompt is {len(prompt)} tokens, which does not fit the context of "
                              f"{self.cache.capacity}")
        # keep at least the last prompt token to evaluate: its logits give the first new token
        n = self.cache.reach(min(common_prefix(self.history, prompt), len(prompt) - 1, self.cache.length,
                                 self.exact_prefix))
        if n < self.cache.length:
            self.cache.truncate(n)
        del self.history[n:]
        self._exact = None
        self._prefilled = len(prompt) - n
        try:
            logits = self._extend(prompt[n:], fits=True, should_stop=should_stop)
        except _Stop:
            self._prefilled = len(self.history) - n
            raise
        prefill = getattr(self.drafter, "prefill", None) if self.speculate else None
        if prefill is not None:  # (a draft model evaluates the prompt too: prompt time, not decoding time)
            prefill(self.history)
        return logits

    def _extend(self, tokens: list[int], n_predict: int = -1, fits: bool = False,
                should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Evaluate tokens after the history in chunks of n_batch; logits [V] of the last. Unless they are
        known to fit (a prompt, checked by _prefill), like llama-completion: a chunk that would fill the
        context shifts it first (--context-shift), else the generation is over (_Stop ctx_full). should_stop()
        is asked before each chunk (a long prompt is seconds to minutes of them: Ctrl-C must not wait for all)."""
        logits = None
        for s in range(0, len(tokens), self.n_batch):
            chunk = tokens[s:s + self.n_batch]
            if should_stop is not None and should_stop():
                self.unevaluated = list(tokens[s:])
                raise _Stop("interrupted")
            if not fits and len(self.history) + len(chunk) >= self.cache.capacity:
                if not self.context_shift or n_predict == -2:
                    raise _Stop("ctx_full")
                self._shift()
                if len(self.history) + len(chunk) >= self.cache.capacity:
                    raise _Stop("ctx_full")
            if self.threads is not None:  # (a long prompt is several batches)
                self.threads.step()
            x = torch.tensor(chunk, dtype=torch.long)
            n_threads = torch.get_num_threads()
            if self.batch_threads is not None and len(chunk) > 1:
                torch.set_num_threads(self.batch_threads)
            try:
                if self._observe is not None:
                    logits, h = self.model.forward(x, len(self.history), self.cache, last_n=1, hidden=True)
                    self._observe(len(self.history), chunk, h)
                else:
                    logits = self.model.forward(x, len(self.history), self.cache, last_n=1)
            finally:
                if torch.get_num_threads() != n_threads:
                    torch.set_num_threads(n_threads)
            self.history += chunk
        self._tail = (len(self.history), logits[-1])
        return logits[-1]

    def feed(self, tokens: Sequence[int], fresh: bool = False, n_predict: int = -1) -> bool:
        """Put tokens in the cache without generating (llama-completion's interactive mode evaluates its
        prompt and each input before it samples, or hands control back to the user first). fresh: a new
        sequence (the prompt: the cache's common prefix is reused); else they follow the history. False
        when the context is full (and cannot shift) before all of them are in."""
        if fresh:
            self._begin(len(tokens))
            if self.grammar is not None:  # (a reasoning budget reads the prompt: it may open a block)
                self.gstate = self.grammar.initial(tokens)
            self._prefill(list(tokens))
            return True
        try:
            self.shifts = 0
            if tokens:
                self._extend(list(tokens), n_predict)
        except _Stop:
            return False
        return True

    def _unfeed(self, n: int) -> None:
        """Take the last n tokens out of the history and the caches."""
        del self.history[len(self.history) - n:]
        self.cache.truncate(len(self.history))
        if self.drafter is not None:
            self.drafter.rollback(len(self.history))

    def _begin(self, n_prompt: int) -> None:
        """A new sequence: no shifts yet, the samplers see all of it."""
        self._dropped, self._n_dropped, self._mark = [], 0, 0
        self._kept = self.keep_count(n_prompt, self.cache.capacity)

    # -- context shift -----------------------------------------------------------------------------
    @property
    def exact_prefix(self) -> int:
        """How many leading history positions hold exactly the K/V of evaluating history[:n] alone: all of
        them, but after a context shift only the kept ones (the later ones were computed with the
        dropped tokens before them). A later prompt reuses, and a prompt cache saves, only those."""
        return len(self.history) if self._exact is None else min(self._exact, len(self.history))

    def _past(self) -> list[int]:
        """The tokens penalties and DRY look back over: the history, with the tokens context shifts took
        out of the cache back in place (llama.cpp's samplers remember every token they accepted), from
        the last sampler reset on (see generate's resume)."""
        past = self.history
        n, k = self.params.history_window, self._kept
        if self._dropped and not 0 <= n <= len(self.history) - k:  # the window reaches the dropped tokens
            past = self.history[:k] + self._dropped + self.history[k:]
        if self._mark:
            seen = max(0, len(self.history) + self._n_dropped - self._mark)
            if seen < len(past):
                past = past[len(past) - seen:]
        return past

    def _shift(self) -> None:
        """llama.cpp's context shift: keep the first _kept positions, drop half of the rest (the oldest),
        move the others down (their K re-rotated for the new positions). The draft model's cache shifts
        alike, so it stays in step with the target's without re-evaluating anything."""
        n_keep = self._kept
        n_discard = (len(self.history) - n_keep) // 2
        if n_discard < 1:  # a context of a few tokens: nothing to drop
            raise _Stop("ctx_full")
        self.model.shift_cache(self.cache, n_keep, n_discard)
        window = self.params.history_window
        if window:  # (no window: nothing looks back at them)
            self._dropped += self.history[n_keep:n_keep + n_discard]
            if window > 0:  # older ones are out of every window: an endless generation stays flat
                del self._dropped[:-window]
        self._n_dropped += n_discard
        del self.history[n_keep:n_keep + n_discard]
        self._exact = n_keep if self._exact is None else min(self._exact, n_keep)
        shift = getattr(self.drafter, "shift", None)
        if shift is not None:
            shift(n_keep, n_discard)
        if self.cost is not None:
            self.cost.shifted()
        self.shifts += 1

    def keep_count(self, n_prompt: int, n_ctx: int) -> int:
        """Positions a context shift keeps: --keep N of the prompt plus its BOS (llama-completion's rule:
        -1, or more than the prompt, keeps all of it), at most n_ctx - 4 so that a shift frees room."""
        if self.n_keep < 0 or self.n_keep > n_prompt:
            keep = n_prompt
        else:
            keep = self.n_keep + int(bool(getattr(self.tok, "add_bos", False)))
        return max(0, min(keep, n_ctx - 4))

    # -- one step of each kind -------------------------------------------------------------------
    def _penalty_rows(self, t: int, props: list[int], n_rows: int) -> list[list[int]] | None:
        """Per verify row, the history its penalties and DRY see: history + [t] + props[:i]."""
        n = self.params.history_window
        if n == 0:
            return None
        past = self._past()
        base = (past[-n:] if n > 0 else list(past)) + [t]
        return [base + props[:i] for i in range(n_rows)]

    def _draft_cost(self, drafter) -> float:
        """A draft model's proposal in target passes, as decoding reads the weights once a token: the draft's
        weight bytes over the target's (a hybrid's own estimate; 0 for free drafters)."""
        if getattr(drafter, "free", False):
            return 0.0
        if getattr(drafter, "cost", None) is not None:  # (HybridDrafter's)
            return float(drafter.cost)
        m = drafter
        while m is not None and not hasattr(m, "weight_bytes"):  # (a drafter's model, or a chain's drafter's)
            m = getattr(m, "model", None)
        if m is None or not hasattr(self.model, "weight_bytes"):
            return DRAFT_COST
        return m.weight_bytes / max(self.model.weight_bytes, 1)

    def _forward(self, tokens: list[int], start: int, u=None, **kw):
        """Logits [T, V] of tokens at start; with device_argmax their rows' arg-maxes [T] (logit bias
        included), taken by the model where the logits are; with device_sample their laws and draws by the
        uniforms u [T] (zeros by default: a verify pass draws nothing), forward_sample's (tokens, ids, probabilities)."""
        x = torch.tensor(tokens, dtype=torch.long)
        if self.device_sample:
            return self.model.forward_sample(x, start, self.cache, self.params,
                                             np.zeros(len(tokens)) if u is None else u, **kw)
        if self.device_argmax:
            return self.model.forward_argmax(x, start, self.cache, self.params.logit_bias, **kw)
        if self._observe is not None:
            logits, h = self.model.forward(x, start, self.cache, hidden=True, **kw)
            self._observe(start, tokens, h)
            return logits
        return self.model.forward(x, start, self.cache, **kw)

    def _forward_rows(self, tokens: list[int]) -> torch.Tensor:
        """_forward of tokens after the history, in one pass or (SHARPI_SPEC_BATCH_VERIFY=0) one by one."""
        start = len(self.history)
        self.cache.keep_states(len(tokens))  # (recurrent layers: their states before each row stay, for the rollback)
        if not self.batch_verify:
            parts = [self._forward([tok], start + i) for i, tok in enumerate(tokens)]
        else:
            # a pass longer than the model's exact_rows would sum in the prompt's order, not the one-token passes':
            # a long proposal (n-gram drafters, --spec-draft-n-max >= 32) is verified in passes of at most that many
            n = self.model.exact_rows
            parts = [self._forward(tokens[i:i + n], start + i, decode=True) for i in range(0, len(tokens), n)]
        return tuple(map(torch.cat, zip(*parts))) if self.device_sample else torch.cat(parts)

    def _plain_step(self, t: int) -> int:
        if self.device_sample:  # (the law and the draw where the logits are)
            u = torch.rand(1, generator=self.rng, dtype=torch.float64).numpy()
            tok = int(self._forward([t], len(self.history), u)[0][-1])
            self.history.append(t)
            if tok < 0:
                raise NoDistribution()
            return tok
        out = self._forward([t], len(self.history))[-1]
        self.history.append(t)
        if self.device_argmax:
            return int(out)
        return self._sample(out)

    def _sample(self, logits: torch.Tensor, after: list[int] | None = None) -> int:
        """The next token from the last position's logits [V] (the grammar's state follows it); after: tokens
        the penalties see past the history (a verify row's)."""
        constrain = None
        if self.grammar is not None:
            st = self.gstate

            def constrain(x):
                kept = self.grammar.constrain(x, st, self._need)
                if kept is None:
                    raise _Stop("grammar")
                return kept
        past = self._past() + after if after else self._past()
        if self.picker is not None:
            t = self.picker.sample(logits, self.params, self.rng, past, constrain)
        else:
            t = sample(logits, self.params, self.rng, past, constrain)
        if self.grammar is not None:
            self.gstate = self.grammar.advance(self.gstate, t)
        return t

    def _grammar_rows(self, rows: torch.Tensor, props: list[int]) -> tuple[np.ndarray, int, int]:
        """The verify rows [R, V] (bias and penalties applied) masked by the grammar, each in the state
        after the drafts before it -> (masked rows [m, V], m, dead): rows stop after the first draft
        the grammar (or the chain's top-k) leaves out, whose rejection is certain; `dead` is the first
        row where no token is allowed (the generation ends there if the drafts before it are
        accepted), or -1."""
        x = rows.detach().to("cpu", torch.float32).numpy()
        st, out, dead = self.gstate, [], -1
        for i in range(x.shape[0]):
            kept = self.grammar.constrain(x[i], st, self._need)
            if kept is None:
                dead = i
                break
            out.append(kept)
            if i >= len(props) or not (props[i] < kept.shape[0] and kept[props[i]] > -np.inf):
                break
            st = self.grammar.advance(st, props[i])
        return (np.stack(out) if out else np.zeros((0, x.shape[1]), dtype=np.float32)), len(out), dead

    def _forced_run(self) -> list[int]:
        """The tokens the constraint forces next (a spent reasoning budget: its message and end tag), or []."""
        run = getattr(self.grammar, "forced_run", None)
        return run(self.gstate) if run is not None else []

    def _spec_step(self, t: int, k: int, stats: SpecStats, room: int,
                   forced: list[int]) -> tuple[list[int], int] | None:
        """Draft, verify [t, d1..dk] in one pass, roll back. None = no usable proposal. Where the constraint
        forces its next tokens (`forced`, from _forced_run) they are the proposals, up to `room` (k's bound before
        adaptation) and n_max, instead of the drafter's: the target's law there is each token alone, so all are
        accepted in one pass (verification still decides)."""
        t_start = time.perf_counter()
        forced = forced[:min(self.n_max, room)]
        if forced:
            props, q = forced, None
        else:
            if self.grammar is not None and hasattr(self.drafter, "constrain_with"):
                self.drafter.constrain_with(self.grammar, self.gstate)
            if self.picker is not None and hasattr(self.drafter, "sample_like"):
                self.drafter.sample_like(self.picker)
            props, q = self.drafter.propose(self.history + [t], k)
            props = [int(d) for d in props[:k]]
        t_drafted = time.perf_counter()
        stats.draft_ms += (t_drafted - t_start) * 1000
        # --spec-draft-n-min: too few proposals make a plain step. Sampled drafts (q given) are judged by what was
        # asked, not by what came: their count can follow their own draws (a grammar ends them early), and
        # verifying only the long ones would bias the acceptance (their law is no longer q)
        short = len(props) < max(1, self.n_min) if q is None else k < self.n_min
        if not props or (not forced and short):
            stats.steps_no_proposal += 1
            return None
        if q is not None:
            q = q[: len(props)]
        # a draft token outside the target's vocabulary is rejected for sure (p = 0): verify up to
        # it without feeding it (its row is the one before it), nothing after it matters
        fed = props
        for i, d in enumerate(props):
            if not 0 <= d < self.n_vocab:
                props, fed = props[: i + 1], props[:i]
                break
        # row i verifies props[i]: logits [len(fed)+1, V], or with device_argmax their arg-maxes
        out = self._forward_rows([t] + fed)
        if self.synth is not None and not forced:
            n, nxt = self._accept_synthetic(fed, out, t)
        elif self.device_argmax:
            n, nxt = accept_argmax(props, out.tolist())
        elif self.device_sample:
            n, nxt = self._accept_laws(props, q, out)
        else:
            rows = apply_penalties(out, self._penalty_rows(t, props, out.shape[0]), self.params)
            if self.grammar is not None:
                n, nxt = self._verify_grammar(props, q, rows)
            elif self.params.greedy:
                n, nxt = accept_greedy(props, rows)
            else:
                n, nxt = self._accept_sampled(props, q, rows)
        t_verified = time.perf_counter()
        stats.verify_ms += (t_verified - t_drafted) * 1000
        keep = len(self.history) + 1 + n
        self.cache.truncate(keep)
        self.history.append(t)
        self.history += props[:n]
        if self.drafter is not None:
            if forced and hasattr(self.drafter, "forced"):  # (what it proposed last, if anything, was not verified)
                self.drafter.forced()
            self.drafter.rollback(keep)
        t_end = time.perf_counter()
        stats.commit_ms += (t_end - t_verified) * 1000
        if self.cost is not None:
            if forced:
                self.cost.forced()
            else:
                self.cost.spec(len(fed) + 1, t_end - t_drafted, len(props), t_drafted - t_start, n,
                               n + (nxt is not None))
        stats.record(len(props), n, None if forced else getattr(self.drafter, "source", None))
        if self.adaptive and not forced:  # (the drafter's record, not the constraint's)
            self._k = next_proposal_len(self.n_max, len(props), n)
        stats.target_passes += 1
        stats.verify_passes += 1
        stats.emitted += n + (nxt is not None)
        return props[:n], nxt

    def _accept_synthetic(self, fed: list[int], out, t: int) -> tuple[int, int]:
        """Synthetic acceptance (benchmarking): the proposals in the cache (fed) accepted one by one with self.synth's
        chances, never an end-of-generation token (it would end the run early), as llama.cpp's server does; then the
        target's token from the row after them (its samplers, penalties and bias applied)."""
        eog, n = self.tok.eog_ids, 0
        while n < min(len(fed), len(self.synth)) and self.synth_rng.random() < self.synth[n] and fed[n] not in eog:
            n += 1
        if self.device_argmax:
            return n, int(out[n])
        if self.device_sample:
            _, ids, probs = out
            return n, int(ids[n][draw(probs[n], self.rng)])
        return n, self._sample(out[n], [t] + fed[:n])

    def _verify_grammar(self, props: list[int], q, rows: torch.Tensor) -> tuple[int, int | None]:
        """accept_argmax / accept_sampled on the grammar-masked rows; the grammar state moves past the
        accepted drafts and the next token. The next token is None when the grammar allows nothing
        after the accepted drafts (plain decoding would stop there too)."""
        masked, m, dead = self._grammar_rows(rows, props)
        if dead == 0:
            return 0, None
        k = min(m, len(props))  # the drafts the masked rows can verify (a cut one is certainly rejected)
        if self.params.greedy:
            # the None stands for the dead row: reached only when every draft before it matched
            n, nxt = accept_argmax(props[:k], np.argmax(masked, axis=1).tolist() + [None])
        else:
            # (after the dead row, if every draft before it is accepted, nothing follows)
            n, nxt = self._accept_sampled(props[:k], q, torch.from_numpy(masked), dead_after=dead > 0)
        self.gstate = self.grammar.advance_all(self.gstate, props[:n])
        if nxt is not None:
            self.gstate = self.grammar.advance(self.gstate, nxt)
        return n, nxt

    def _accept_sampled(self, props: list[int], q, rows: torch.Tensor, dead_after: bool = False) -> tuple[int, int | None]:
        """accept_sampled on verify rows [R, V] (bias, penalties and any grammar mask applied): each row's
        law from the sampler chain, or a picker's (mirostat, adaptive-p) in the state the drafts before it
        lead to (its state then moves past the accepted drafts and the next token). dead_after: every
        draft accepted leaves nothing to draw (the grammar allows no token there), the next token is None."""
        states = sides = None
        broken = False
        if self.picker is None:
            try:
                p = filtered_probs(rows, self.params)
            except NoDistribution:
                # a row past a rejection, which plain decoding never computes, may have broken down (NaN): the rows
                # before the first broken one decide, and getting to it is the error plain decoding meets there
                p, broken = _probs_before_broken(rows, self.params), True
        else:
            pn, states, sides, broken = self.picker.rows(rows.detach().to("cpu", torch.float32).numpy(), self.params,
                                                         props, self.rng)
            p = torch.from_numpy(pn)
        return self._accept_p(props, q, p, broken, dead_after, states, sides)

    def _accept_laws(self, props: list[int], q, laws: tuple) -> tuple[int, int | None]:
        """accept_sampled on the laws the model computed for the verify rows (forward_sample's top-k ids and
        probabilities, made [R, V]); the rows before one with no distribution decide, as in _accept_sampled."""
        _, ids, probs = laws
        live = (probs > 0).any(dim=1)
        r0 = int(live.logical_not().nonzero()[0]) if not bool(live.all()) else int(ids.shape[0])
        if r0 == 0:
            raise NoDistribution()
        keep = probs[:r0] > 0
        p = torch.zeros(r0, self.n_vocab)
        p[torch.arange(r0).unsqueeze(1).expand(-1, ids.shape[1])[keep], ids[:r0][keep]] = probs[:r0][keep]
        return self._accept_p(props, q, p, r0 < ids.shape[0])

    def _accept_p(self, props: list[int], q, p: torch.Tensor, broken: bool, dead_after: bool = False, states=None,
                  sides=None) -> tuple[int, int | None]:
        """accept_sampled with the verify rows' laws p [R, V] (broken: a row after them had none)."""
        # a picker's rows stop at a draft it cannot draw (certain rejection); broken ones before the first broken row
        k = min(len(props), p.shape[0])
        if dead_after or broken:  # a stand-in bonus row, never drawn from
            p = torch.cat([p, p[:1]])
        n, nxt = accept_sampled(props[:k], q[:k] if q is not None else None, p, self.rng, self.p_min)
        if broken and n == k:
            raise NoDistribution()
        if dead_after and n == k:
            return n, None
        if states is not None:
            self.picker.state = self.picker.next_state(states[n], sides[n], nxt, self.rng)
        return n, nxt

    # -- the loop ----------------------------------------------------------------------------------
    def generate(self, prompt_tokens: Sequence[int], n_predict: int = -1, stop_strings: Sequence[str] = (),
                 on_text: Callable[[str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, resume: bool = False,
                 stop_tokens: Collection[int] = (), stop_at_end: bool = False,
                 stops_in_prompt: bool = True, drop_partial_char: bool = False,
                 decoder: StreamDecoder | None = None) -> GenerationResult:
        """Generate after prompt_tokens, streaming text to on_text, until an end of generation, n_predict
        tokens, a stop string (or one of stop_tokens), should_stop(), or a full context.

        resume: prompt_tokens follow the history (llama-completion's interactive mode: each input goes
        after what was generated, the cache kept as it is even after a context shift); the samplers
        start over there (penalties and DRY see the sequence from prompt_tokens on, mirostat and
        adaptive-p restart), the grammar's state goes on. With no prompt_tokens the model goes on from the
        logits feed() left (or the last history token evaluated again). stop_at_end: a stop string counts only at the end of the text of
        the last STOP_WINDOW tokens the samplers have seen (llama-completion's interactive check), not anywhere
        in the text a token completed. stops_in_prompt=False: a stop string must lie in the generated text (a
        chat's reply, where llama-cli's server looks), not begin in the prompt's. drop_partial_char: a character
        the generation stopped inside is left out of the text, not shown as U+FFFD (llama-cli's server never sends
        half a character; llama-completion writes its bytes). decoder: the text goes on from this decoder's state and
        leaves its own there, unflushed (interactive mode: a character one generation ends inside, the next, after
        an empty line, finishes, as llama-completion's byte stream does)."""
        timings = Timings()
        stats = SpecStats() if self.speculate else None
        out: list[int] = []
        text_parts: list[str] = []
        dec = decoder if decoder is not None else StreamDecoder(self.tok, self.special)
        stops = [s for s in stop_strings if s]
        longest_stop = max((len(s) for s in stops), default=0)
        # stop strings are looked for in the text with control tokens written out, whether or not it is shown (-sp),
        # as llama-completion looks for its reverse prompts (a ChatML `-r "<|im_start|>user"`)
        mdec = dec if self.special or not stops else StreamDecoder(self.tok, True)
        tail = ""  # recent text, for stop strings spanning tokens (the prompt's end too: see below)
        n_ctx = self.cache.capacity
        eog = self.tok.eog_ids
        end_token = None

        def show(s: str) -> None:
            text_parts.append(s)
            if on_text is not None:
                on_text(s)

        def emit(tok: int) -> None:
            nonlocal tail, end_token
            if tok in eog:
                s = dec.push(tok) if self.special else ""  # -sp: printed, as llama-completion prints it
                if s:
                    show(s)
                end_token = tok
                raise _Stop("eos")
            out.append(tok)
            s = dec.push(tok)
            if s:
                show(s)
            m = s if mdec is dec else mdec.push(tok)
            if stops and m:
                tail = (tail + m)[-(longest_stop + len(m)):]
                if stop_at_end:
                    if any(tail.endswith(x) for x in stops):
                        raise _Stop("stop_string")
                # a stop string anywhere in the text this token completed (begun in the prompt's text, maybe)
                elif any(x in tail[-(len(x) + len(m) - 1):] for x in stops):
                    raise _Stop("stop_string")
            if tok in stop_tokens:  # (llama-completion: a reverse prompt that is one token is that token)
                raise _Stop("stop_string")
            if 0 <= n_predict <= len(out):
                raise _Stop("n_predict")
            if should_stop is not None and should_stop():
                raise _Stop("interrupted")

        t0 = time.perf_counter()
        self._k = self.n_max
        self.unevaluated = []
        if self.cost is not None:
            self.cost.begin()
        self.shifts = 0
        if self.picker is not None:
            self.picker.reset()
        reason = "n_predict"
        try:
            if resume:
                self._mark = len(self.history) + self._n_dropped
                fed, self._tail = self._tail, None
                if prompt_tokens:
                    logits = self._extend(list(prompt_tokens), n_predict, should_stop=should_stop)
                elif fed is not None and fed[0] == len(self.history):  # what feed() left
                    logits = fed[1]
                else:  # (evaluated again, as the one-token batch it was)
                    if not self.history:
                        raise SharpiError("nothing to resume from")
                    t = self.history.pop()
                    self.cache.truncate(len(self.history))
                    logits = self._extend([t], n_predict)
                self._prefilled = len(prompt_tokens)
            else:
                self._begin(len(prompt_tokens))
                if self.grammar is not None:
                    self.gstate = self.grammar.initial(prompt_tokens)
                logits = self._prefill(list(prompt_tokens), should_stop)
            if stops and stops_in_prompt:  # the samplers' memory: the prompt, or the input after a resume
                tail = self.tok.decode(self._past()[-STOP_WINDOW:], skip_special=False)
        except _Stop as st:
            logits, reason = None, st.reason
        timings.prompt_ms = (time.perf_counter() - t0) * 1000
        timings.prompt_n = self._prefilled
        begin = getattr(self.drafter, "begin", None) if self.speculate and logits is not None else None
        if begin is not None:  # (llama.cpp's n-gram drafters learn the prompt: speculative.NgramChain)
            begin(list(self.history))
        t0 = time.perf_counter()
        try:
            if logits is None:
                raise _Stop(reason)
            if n_predict == 0:
                raise _Stop("n_predict")
            t = self._sample(logits)
            emit(t)
            while True:
                # like llama.cpp: when feeding t would fill the last context slot, stop, or shift the
                # context (-n -2 stops there even so); speculation below never crosses that point, so
                # the shifts happen where plain decoding's do
                if len(self.history) + 1 >= n_ctx:
                    if not self.context_shift or n_predict == -2:
                        raise _Stop("ctx_full")
                    self._shift()
                if self.threads is not None:
                    self.threads.step()
                step = None
                forced = self._forced_run()
                if self.speculate or forced:  # (forced tokens go in one pass without a drafter too)
                    # [t, d1..dk] must leave the last slot free; a step emits up to k+1 tokens
                    room = n_ctx - len(self.history) - 2
                    if n_predict >= 0:
                        room = min(room, n_predict - len(out) - 1)
                    k = min(max(self._k, self.n_min) if self.adaptive and not self._own_k else self.n_max, room)
                    if not forced and k < self.n_min:  # (room for fewer than --spec-draft-n-min: a plain step)
                        k = 0
                    if k >= 1 and self.cost is not None and not forced:
                        k = self.cost.plan(self.history, t, k, self.n_min)
                    if k >= 1:
                        g0 = self.gstate
                        step = self._spec_step(t, k, stats if stats is not None else SpecStats(), room, forced)
                if step is None:
                    t_start = time.perf_counter()
                    t = self._plain_step(t)
                    if self.cost is not None:
                        self.cost.plain(time.perf_counter() - t_start)
                    if stats is not None:
                        stats.target_passes += 1
                        stats.emitted += 1
                    emit(t)
                else:
                    accepted, t = step
                    for j, a in enumerate(accepted):
                        try:
                            emit(a)
                        except _Stop:
                            if stats is not None:
                                stats.stopped_at(j + 1, len(accepted) + (t is not None))
                            # the cache holds every accepted draft; what was not emitted (nor the token
                            # that stopped it, now the pending one) goes, so the history ends where the
                            # output does (a resumed generation, or --prompt-cache-all, goes on from there)
                            self._unfeed(len(accepted) - j)
                            if self.grammar is not None:  # (its state went past all of them)
                                # (through the one that stopped, an end of generation too, as a plain step's
                                # sampling advances it: a resumed generation goes on from the same state)
                                self.gstate = self.grammar.advance_all(g0, accepted[:j + 1])
                            raise
                    if t is None:  # the grammar allows nothing after these
                        raise _Stop("grammar")
                    emit(t)
        except _Stop as s:
            reason = s.reason
        if stats is not None and self.cost is not None:
            stats.plain_by_cost = self.cost.chosen_plain
            stats.cost_off = self.cost.went_off
        rest = "" if decoder is not None else dec.flush(drop_partial_char)
        if rest:
            show(rest)
        timings.eval_ms = (time.perf_counter() - t0) * 1000
        timings.eval_n = len(out)
        return GenerationResult(out, "".join(text_parts), reason, timings, stats, self.shifts, end_token)
