"""libstdc++'s hash tables, as far as llama.cpp's results depend on them: where llama.cpp takes the first match while
it walks a std::unordered_map (the end-of-turn token among several spellings, ngram-cache's most frequent follower),
the answer is the first in the order the library keeps the map's keys.

That order: the table is one singly linked list, each bucket a run in it; a key whose bucket is empty goes to the
front of the list, any other to the front of its bucket's run; growing the table (a prime bucket count past each
load of 1) walks the old list and places every key that way anew. std::hash<std::string> is the library's 64-bit
_Hash_bytes (a MurmurHash2 variant, seed 0xc70f6907); an integer key hashes to itself.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

# a std::unordered_map grown from empty: its bucket count once it holds at least this many elements (the prime rehash
# policy, max load factor 1; measured with GCC 12's library)
_GROWTH = ((1, 13), (14, 29), (30, 59), (60, 127), (128, 257), (258, 541), (542, 1109), (1110, 2357), (2358, 5087),
           (5088, 10273), (10274, 20753), (20754, 42043), (42044, 85229), (85230, 172933), (172934, 351061),
           (351062, 712697))


def buckets(n: int) -> int:
    """The bucket count of a std::unordered_map that n insertions of distinct keys grew from empty."""
    if n > _GROWTH[-1][1]:  # (the next growth's bucket count is not known here)
        raise ValueError(f"a hash map of {n} keys is past the bucket counts known here")
    b = 1
    for size, nb in _GROWTH:
        if n < size:
            break
        b = nb
    return b


_MUL = np.uint64(0xC6A4A7935BD1E995)
_SEED = np.uint64(0xC70F6907)


def _shift_mix(v: np.ndarray) -> np.ndarray:
    return v ^ (v >> np.uint64(47))


def string_hashes(keys: Sequence[bytes]) -> np.ndarray:
    """std::hash<std::string> of each key: uint64 [n] (libstdc++'s _Hash_bytes on a 64-bit target)."""
    n = len(keys)
    lens = np.fromiter(map(len, keys), np.int64, n)
    buf = np.frombuffer(b"".join(keys) + bytes(8), np.uint8).astype(np.uint64)
    starts = np.zeros(n, np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    with np.errstate(over="ignore"):
        h = _SEED ^ (lens.astype(np.uint64) * _MUL)
        for w in range(int(lens.max(initial=0)) // 8):  # the whole 8-byte words, little-endian
            on = np.flatnonzero(lens >= 8 * (w + 1))
            at = starts[on] + 8 * w
            word = sum(buf[at + k] << np.uint64(8 * k) for k in range(8))
            h[on] = (h[on] ^ (_shift_mix(word * _MUL) * _MUL)) * _MUL
        tail = lens & 7
        on = np.flatnonzero(tail)
        at = starts[on] + (lens[on] - tail[on])
        word = sum(np.where(k < tail[on], buf[at + k], np.uint64(0)) << np.uint64(8 * k) for k in range(7))
        h[on] = (h[on] ^ word) * _MUL
        return _shift_mix(_shift_mix(h) * _MUL)


def iteration_order(hashes: np.ndarray) -> np.ndarray:
    """The order a std::unordered_map iterates its keys after they were inserted, one by one, into an empty map:
    `hashes` [n] are the distinct keys' hash codes in insertion order; the result lists their indices.

    Simulated a growth step at a time, not a key at a time: a key's place is (the rank of its bucket's run in the
    list, its rank in the run), both lower nearer the front; a growth re-ranks everything from the list order."""
    n = hashes.shape[0]
    buckets(n)  # (a size past the known growth steps is refused)
    brank = np.zeros(n, np.int64)
    wrank = np.zeros(n, np.int64)
    steps = [s for s, _ in _GROWTH if s <= n] + [n + 1]
    for (lo, nb), hi in zip(((s, b) for s, b in _GROWTH if s <= n), steps[1:]):
        m = lo - 1  # keys already in the map: placed anew in list order
        order = np.lexsort((wrank[:m], brank[:m]))
        bk = (hashes[order] % np.uint64(nb)).astype(np.int64)
        first = np.full(nb, -1, np.int64)
        uniq, at = np.unique(bk, return_index=True)
        first[uniq] = at  # each bucket's first key in the walk: its run goes to the front then
        brank[order] = -first[bk]
        wrank[order] = -np.arange(m)  # each later key of a bucket goes to the front of its run
        # then the keys inserted until the next growth: to the front of their bucket's run, or of the list
        t = np.arange(hi - 1 - m)
        bn = (hashes[m:hi - 1] % np.uint64(nb)).astype(np.int64)
        rank_of = np.full(nb, np.iinfo(np.int64).max, np.int64)
        rank_of[uniq] = -at
        uniq_n, at_n = np.unique(bn, return_index=True)
        new = rank_of[uniq_n] == np.iinfo(np.int64).max
        rank_of[uniq_n[new]] = -(m + at_n[new])
        brank[m:hi - 1] = rank_of[bn]
        wrank[m:hi - 1] = -(m + t)
    return np.lexsort((wrank, brank))


def map_order(keys: Sequence[bytes]) -> list[int]:
    """The positions in `keys` of the distinct keys, in the order a std::unordered_map<std::string, ...> filled with
    `keys` in order (`map[key] = ...`: a repeated key keeps its first place) iterates them."""
    first: dict[bytes, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    pos = np.fromiter(first.values(), np.int64, len(first))
    return pos[iteration_order(string_hashes(list(first)))].tolist()
