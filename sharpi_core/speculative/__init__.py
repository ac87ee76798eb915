"""Speculative decoding: draft sources behind one interface, and exact acceptance rules.

A drafter proposes up to k tokens that may follow `history` (the target's cached tokens plus the
pending certain token), with the distributions they were drawn from (q [len, V]) or None when the
proposals are deterministic given the history (prompt lookup, greedy drafts). After verification
the generator calls `rollback(n_keep)`: the target kept the first n_keep tokens of history+drafts.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .accept import accept_argmax, accept_greedy, accept_sampled
from .cost import SpecCost
from .draft_model import DraftModelDrafter
from .hybrid import HybridDrafter
from .lookup import LookupDrafter
from .mtp import MtpDrafter
from .ngram import NGRAM_TYPES, NgramChain, ngram_sources
from .util import common_prefix

# Penalties and logit bias are applied row by row with each verify row's own history, and the
# draft records the q it actually sampled from (after the same bias/penalties over its own
# history), so sampled speculation stays exact with them: the CLI need not refuse the combination.
SUPPORTS_PENALTIES = True


class Drafter(Protocol):
    def propose(self, history: list[int], k: int) -> tuple[list[int], torch.Tensor | None]: ...

    def rollback(self, n_keep: int) -> None: ...


__all__ = ["Drafter", "accept_argmax", "accept_greedy", "accept_sampled", "DraftModelDrafter", "HybridDrafter", "LookupDrafter",
           "MtpDrafter", "NGRAM_TYPES", "NgramChain", "ngram_sources", "SpecCost",
           "SUPPORTS_PENALTIES", "common_prefix"]
