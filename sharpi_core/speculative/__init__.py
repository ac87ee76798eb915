"""Speculative decoding: draft sources behind one interface, and exact acceptance rules."""
from .accept import accept_greedy, accept_sampled
from .draft_model import DraftModelDrafter
from .lookup import LookupDrafter

# Penalties and logit bias are applied row by row with each verify row's own history, and the
# draft records the q it actually sampled from, so sampled speculation stays exact with them.
SUPPORTS_PENALTIES = True

__all__ = ["accept_greedy", "accept_sampled", "DraftModelDrafter", "LookupDrafter", "SUPPORTS_PENALTIES"]
