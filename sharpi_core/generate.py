"""The generation loop: prefill, then plain or speculative decoding, streaming text as it comes.

Speculative step (llama.cpp's formulation): the *certain* token t (last step's correction or
bonus, already emitted, not yet in the cache) and the k proposals go through ONE target forward
[t, d1..dk]; row i verifies d_{i+1}, row k gives the bonus. Rollback is `truncate`.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .sampling import SamplingParams, adjust_logits, filtered_probs, sample
from .speculative import accept_greedy, accept_sampled
from .tokenizer import StreamDecoder


@dataclass
class Timings:
    prompt_n: int = 0
    prompt_ms: float = 0.0
    eval_n: int = 0
    eval_ms: float = 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_n / self.prompt_ms * 1000 if self.prompt_ms else 0.0

    @property
    def eval_tps(self) -> float:
        return self.eval_n / self.eval_ms * 1000 if self.eval_ms else 0.0


@dataclass
class SpecStats:
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0
    emitted: int = 0
    steps_no_proposal: int = 0
    per_position_drafted: list[int] = field(default_factory=list)
    per_position_accepted: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    commit_ms: float = 0.0

    def record(self, k: int, n: int) -> None:
        while len(self.per_position_drafted) < k:
            self.per_position_drafted.append(0)
            self.per_position_accepted.append(0)
        for i in range(k):
            self.per_position_drafted[i] += 1
            self.per_position_accepted[i] += i < n
        self.drafted += k
        self.accepted += n

    def as_dict(self) -> dict:
        return {
            "drafted": self.drafted, "accepted": self.accepted,
            "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
            "target_passes": self.target_passes,
            "tokens_per_pass": self.emitted / self.target_passes if self.target_passes else 0.0,
            "per_position_acceptance": [a / d if d else 0.0 for a, d in
                                        zip(self.per_position_accepted, self.per_position_drafted)],
            "steps_no_proposal": self.steps_no_proposal,
            "draft_ms": round(self.draft_ms, 2), "verify_ms": round(self.verify_ms, 2),
            "commit_ms": round(self.commit_ms, 2),
        }


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    stop_reason: str  # eos | n_predict | ctx_full | stop_string | interrupted
    timings: Timings
    spec: SpecStats | None = None


class _Stop(Exception):
    def __init__(self, reason: str):
        self.reason = reason


class Generator:
    def __init__(self, model, cache, tokenizer, params: SamplingParams, seed: int = 0, drafter=None,
                 spec_n_max: int = 4, spec_n_min: int = 0, spec_p_min: float = 0.0, n_batch: int = 512):
        self.model, self.cache, self.tok, self.params = model, cache, tokenizer, params
        self.rng = torch.Generator().manual_seed(seed)
        self.drafter = drafter
        self.n_max, self.n_min, self.p_min = spec_n_max, spec_n_min, spec_p_min
        self.n_batch = n_batch
        self.history: list[int] = []  # tokens whose K/V are in the cache
        self.notes: list[str] = []
        self.batch_verify = os.environ.get("SHARPI_SPEC_BATCH_VERIFY", "1") != "0"
        self.speculate = drafter is not None
        if drafter is not None and not params.greedy and os.environ.get("SHARPI_SPEC_SAMPLE", "1") == "0":
            self.speculate = False
            self.notes.append("SHARPI_SPEC_SAMPLE=0: speculation is off at --temp > 0 (plain sampled decoding)")

    # -- prompt ------------------------------------------------------------------------------
    def _prefill(self, prompt: list[int]) -> torch.Tensor:
        """Reuse the cached common prefix, evaluate the rest; logits [V] of the last prompt token."""
        n, lim = 0, min(len(self.history), len(prompt))
        while n < lim and self.history[n] == prompt[n]:
            n += 1
        n = min(n, len(prompt) - 1)
        self.cache.truncate(n)
        self.history = list(prompt[:n])
        self._prefilled = len(prompt) - n
        logits = None
        for s in range(n, len(prompt), self.n_batch):
            chunk = prompt[s:s + self.n_batch]
            logits = self.model.forward(torch.tensor(chunk), s, self.cache, last_n=1)
            self.history += chunk
        return logits[-1]

    # -- one step of each kind -------------------------------------------------------------------
    def _forward_rows(self, tokens: list[int]) -> torch.Tensor:
        start = len(self.history)
        if self.batch_verify or len(tokens) == 1:
            return self.model.forward(torch.tensor(tokens), start, self.cache)
        return torch.cat([self.model.forward(torch.tensor([t]), start + i, self.cache) for i, t in enumerate(tokens)])

    def _spec_step(self, t: int, room: int, stats: SpecStats) -> tuple[list[int], int] | None:
        """Draft, verify [t, d1..dk] in one pass, roll back. None = no usable proposal."""
        k = min(self.n_max, room)
        if k < 1:
            return None
        t0 = time.perf_counter()
        props, q = self.drafter.propose(self.history + [t], k)
        props = props[:k]
        stats.draft_ms += (time.perf_counter() - t0) * 1000
        if not props or len(props) < max(1, self.n_min):
            stats.steps_no_proposal += 1
            return None
        if q is not None:
            q = q[: len(props)]
        t0 = time.perf_counter()
        base = self.history + [t]
        logits = self._forward_rows([t] + props)  # [k+1, V]
        rows = adjust_logits(logits, self.params, [base + props[:i] for i in range(len(props) + 1)])
        if self.params.greedy:
            n, nxt = accept_greedy(props, rows)
        else:
            n, nxt = accept_sampled(props, q, filtered_probs(rows, self.params), self.rng, self.p_min)
        stats.verify_ms += (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        keep = len(self.history) + 1 + n
        self.cache.truncate(keep)
        self.history = base + props[:n]
        self.drafter.rollback(keep)
        stats.commit_ms += (time.perf_counter() - t0) * 1000
        stats.record(len(props), n)
        stats.target_passes += 1
        stats.emitted += n + 1
        return props[:n], nxt

    # -- the loop ----------------------------------------------------------------------------------
    def generate(self, prompt_tokens: list[int], n_predict: int = -1, stop_strings=(),
                 on_text: Callable[[str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerationResult:
        timings = Timings()
        stats = SpecStats() if self.speculate else None
        out: list[int] = []
        text_parts: list[str] = []
        dec = StreamDecoder(self.tok)
        stops = [s for s in stop_strings if s]
        tail = ""  # recent text, for stop strings spanning tokens
        n_ctx = self.cache.capacity

        def emit(tok: int) -> None:
            nonlocal tail
            if tok in self.tok.eog_ids:
                raise _Stop("eos")
            out.append(tok)
            s = dec.push(tok)
            if s:
                text_parts.append(s)
                if on_text:
                    on_text(s)
                if stops:
                    tail = (tail + s)[-4096:]
                    if any(tail.endswith(x) or x in tail[-(len(x) + len(s)):] for x in stops):
                        raise _Stop("stop_string")
            if 0 <= n_predict <= len(out):
                raise _Stop("n_predict")
            if should_stop is not None and should_stop():
                raise _Stop("interrupted")

        t0 = time.perf_counter()
        logits = self._prefill(list(prompt_tokens))
        timings.prompt_ms = (time.perf_counter() - t0) * 1000
        timings.prompt_n = self._prefilled
        t0 = time.perf_counter()
        reason = "n_predict"
        try:
            if n_predict == 0:
                raise _Stop("n_predict")
            t = sample(logits, self.params, self.rng, self.history)
            emit(t)
            while True:
                if len(self.history) + 1 >= n_ctx:
                    raise _Stop("ctx_full")
                step = None
                if self.speculate:
                    room = n_ctx - len(self.history) - 2
                    if n_predict >= 0:
                        room = min(room, n_predict - len(out))
                    step = self._spec_step(t, room, stats)
                if step is None:
                    logits = self.model.forward(torch.tensor([t]), len(self.history), self.cache)[-1]
                    self.history.append(t)
                    if stats is not None:
                        stats.target_passes += 1
                        stats.emitted += 1
                    t = sample(logits, self.params, self.rng, self.history)
                    emit(t)
                else:
                    accepted, t = step
                    for a in accepted:
                        emit(a)
                    emit(t)
        except _Stop as s:
            reason = s.reason
        rest = dec.flush()
        if rest:
            text_parts.append(rest)
            if on_text:
                on_text(rest)
        timings.eval_ms = (time.perf_counter() - t0) * 1000
        timings.eval_n = len(out)
        return GenerationResult(out, "".join(text_parts), reason, timings, stats)
