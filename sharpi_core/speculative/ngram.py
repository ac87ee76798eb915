"""llama.cpp's n-gram drafters (`--spec-type ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache`): the
same proposals as common/ngram-map.cpp, ngram-mod.cpp, ngram-cache.cpp and the implementations in
common/speculative.cpp, given the same history and the same verdicts (scripts/llamacpp_ngram.cpp drives
libllama-common's; tests/test_ngram.py compares).

Each source sees (prompt, sampled): the target's tokens and the certain next one. `begin(prompt)` is called once a
generation's prompt is evaluated (llama.cpp's server calls it per request; sharpi per generate() call, so also per
chat turn), `draft` every step, `accept(n, is_other)` after a step a draft was verified: n of the last proposal's
tokens were kept, is_other when another source proposed. `NgramChain` runs them as common_speculative_draft does:
in llama.cpp's order (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache), then a draft model if one
is given; the first that drafts proposes, cut to what the step may verify.

- ngram-simple: the last size_n tokens (with the sampled one) searched backwards in the history; the size_m tokens
  after the latest earlier occurrence (if at least size_n of them exist).
- ngram-map-k: the same search through a hash of key positions; a key that was found keeps the count of tokens the
  target accepted the last time it drafted, and drafts no more than that next time (0: never again).
- ngram-map-k4v: also counts up to 4 different m-grams seen after the key; drafts only once the key was seen
  min_hits times and when the most frequent m-gram is at least twice as frequent as the others together (as in
  llama.cpp, the tokens drafted are then those after the latest occurrence of the key).
- ngram-mod: a 4M-entry table from the hash of n_match tokens to the token that followed them last; drafts by
  following it up to n_max tokens, nothing when fewer than n_min come; cleared when a quarter of it is used
  (checked at each begin), or after 5 drafts in a row with under a quarter accepted.
- ngram-cache: counts of the tokens that followed each 1..4-gram; up to 8 tokens drafted one at a time (NgramCache).

Scans of the history are numpy passes (one per n-gram position compared), not loops over positions.
"""
from __future__ import annotations

import numpy as np

from ..errors import UsageError
from ..stdhash import buckets
from .util import WrapsModel, common_prefix

# llama.cpp's names in its priority order (common_speculative_init)
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")

LCG_FACTOR = 2654435761         # ngram-map's 32-bit key hash
HASH_MAP_SIZE = 262144          # COMMON_NGRAM_HASH_MAP_SIZE
MAX_VALUES = 4                  # COMMON_NGRAM_MAX_VALUES
MAX_VALUE_COUNT = 16380         # COMMON_NGRAM_MAX_VALUE_COUNT
MOD_FACTOR = 6364136223846793005  # ngram-mod's 64-bit hash
MOD_SIZE = 4 * 1024 * 1024      # ngram-mod's table (its index is the hash mod 2^22: only the low 22 bits matter)
MOD_MASK = MOD_SIZE - 1
_M32 = np.uint64(0xFFFFFFFF)


class _Tokens:
    """The history as an int64 array, kept in step with the lists the calls bring (only new tokens are written)."""

    def __init__(self):
        self.list: list[int] = []
        self.arr = np.zeros(1024, dtype=np.int64)

    def sync(self, tokens: list[int]) -> np.ndarray:
        p = common_prefix(self.list, tokens)
        if len(tokens) > len(self.arr):
            grown = np.zeros(max(len(tokens), 2 * len(self.arr)), dtype=np.int64)
            grown[:p] = self.arr[:p]
            self.arr = grown
        self.arr[p:len(tokens)] = tokens[p:]
        self.list = list(tokens)
        return self.arr[:len(tokens)]


def _matches(a: np.ndarray, pattern, lo: int, hi: int) -> np.ndarray:
    """The positions j in [lo, hi) where a[j:j+len(pattern)] == pattern (ascending)."""
    if hi <= lo:
        return np.zeros(0, dtype=np.int64)
    eq = np.ones(hi - lo, dtype=bool)
    for k, t in enumerate(pattern):
        eq &= a[lo + k:hi + k] == t
    return np.flatnonzero(eq) + lo


def _last_match(a: np.ndarray, pattern, lo: int, hi: int) -> int:
    """The highest j in [lo, hi) where the pattern starts, or 0 (llama.cpp's 'no match': position 0 is never one)."""
    m = _matches(a, pattern, lo, hi)
    return int(m[-1]) if len(m) else 0


def _hash32(tokens) -> int:
    h = 0
    for t in tokens:
        h = (h * LCG_FACTOR + int(t)) & 0xFFFFFFFF
    return h


def _hashes32(a: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
    h = np.zeros(len(starts), dtype=np.uint64)
    for i in range(n):
        h = (h * np.uint64(LCG_FACTOR) + a[starts + i].astype(np.uint64)) & _M32
    return h


def _first_writes(table: np.ndarray, slots: np.ndarray, values: np.ndarray) -> None:
    """Sequentially `if table[s] == 0: table[s] = v` over (slots, values) in order, at once."""
    free = table[slots] == 0
    slots, values = slots[free], values[free]
    _, first = np.unique(slots, return_index=True)
    table[slots[first]] = values[first]


class NgramSimple:
    """common_ngram_simple_draft (its min_hits is not used, as in llama.cpp)."""

    name = "ngram-simple"

    def __init__(self, size_n: int = 12, size_m: int = 48):
        self.n, self.m = size_n, size_m
        self.n_max = size_m
        self._tok = _Tokens()

    def fresh(self) -> "NgramSimple":
        return NgramSimple(self.n, self.m)

    def begin(self, prompt: list[int]) -> None:
        pass

    def draft(self, prompt: list[int], sampled: int) -> list[int]:
        n, m, L = self.n, self.m, len(prompt)
        if L <= n + m + 1:
            return []
        a = self._tok.sync(prompt)
        pattern = prompt[L - n + 1:] + [sampled]
        j = _last_match(a, pattern, 1, L - n)  # (j = L - n - 1 down to 1)
        if j == 0:
            return []
        copy = min(m, L - (j + n))
        if copy < n:
            return []
        return prompt[j + n:j + n + copy]

    def accept(self, n_accepted: int, is_other: bool) -> None:
        pass


class _Value:
    __slots__ = ("idx", "num", "n_accepted")

    def __init__(self, idx: int = 0, num: int = 0, n_accepted: int = -1):
        self.idx, self.num, self.n_accepted = idx, num, n_accepted


class _Key:
    __slots__ = ("idx", "stat_idx", "num", "values")

    def __init__(self, idx: int, m: int):
        self.idx, self.stat_idx, self.num = idx, 0, 0
        self.values = [_Value(0, 0, m) for _ in range(MAX_VALUES)]


class NgramMap:
    """common_ngram_map (key_only: ngram-map-k, else ngram-map-k4v)."""

    def __init__(self, size_n: int = 12, size_m: int = 48, key_only: bool = True, min_hits: int = 1):
        self.n, self.m, self.key_only, self.min_hits = size_n, size_m, key_only, min_hits
        self.name = "ngram-map-k" if key_only else "ngram-map-k4v"
        self.n_max = size_m
        self.keys: list[_Key] = []
        self.key_map = np.zeros(HASH_MAP_SIZE, dtype=np.int64)  # hash -> key position (0: none)
        self.key_map_last_idx = 0
        self.size_last_begin = 0
        self.idx_last_check = 0
        self.last_created, self.last_key, self.last_value = False, 0, 0
        self._tok = _Tokens()

    def fresh(self) -> "NgramMap":
        return NgramMap(self.n, self.m, self.key_only, self.min_hits)

    def begin(self, tokens: list[int]) -> None:
        size_begin = len(tokens)
        cleanup = self.size_last_begin
        if cleanup > size_begin:  # (a history that shrank: a chat whose reasoning was taken out of it)
            cleanup = size_begin - self.n - self.m if size_begin > self.n + self.m else 0
        if size_begin < self.idx_last_check:
            km = self.key_map
            km[(km != 0) & (km >= cleanup)] = 0
            self.key_map_last_idx = cleanup - 1 if cleanup > 0 else 0
            if self.keys:
                for i in range(len(self.keys) - 1, -1, -1):
                    key = self.keys[i]
                    if key.idx >= cleanup:
                        del self.keys[i]
                        continue
                    if self.key_only:
                        continue
                    for j in range(MAX_VALUES - 1, -1, -1):
                        if key.values[j].idx != 0 and key.values[j].idx >= cleanup:
                            del key.values[j]  # (the later ones move left; the last slot is cleared)
                            last = key.values[-1]
                            key.values.append(_Value(0, 0, last.n_accepted))
                    if key.values[0].idx == 0:
                        del self.keys[i]
        self.idx_last_check = size_begin
        self.size_last_begin = size_begin

    def draft(self, inp: list[int], sampled: int) -> list[int]:
        self.last_created, self.last_key, self.last_value = False, 0, 0
        L, n, m = len(inp), self.n, self.m
        if L < 2 * n + m:
            return []
        if self.idx_last_check > L or self.size_last_begin > L:  # (llama.cpp aborts; a shorter history begins anew)
            self.begin(inp)
        self.idx_last_check = L
        a = self._tok.sync(inp)
        key = inp[L - n + 1:] + [sampled]
        top = L - n - m - 1  # the last key position whose m-gram lies before the query

        match = 0
        idx = int(self.key_map[_hash32(key) % HASH_MAP_SIZE])
        if idx != 0 and idx < top and inp[idx:idx + n] == key:
            match = idx
        low = self.key_map_last_idx + 1
        if match == 0 and self.size_last_begin > n + m + 1:
            match = _last_match(a, key, low, self.size_last_begin - n - m)
        if match == 0:
            match = _last_match(a, key, max(self.size_last_begin + 1, low), top + 1)

        # positions of new keys into the hash map, in the order llama.cpp visits them (descending; first write wins)
        parts = []
        if self.size_last_begin > n + m + 1:
            parts.append(np.arange(self.size_last_begin - n - m - 1, self.key_map_last_idx, -1, dtype=np.int64))
        lo = max(self.size_last_begin, self.key_map_last_idx)
        parts.append(np.arange(top, lo, -1, dtype=np.int64))
        for js in parts:
            if len(js):
                slots = (_hashes32(a, js, n) % np.uint64(HASH_MAP_SIZE)).astype(np.int64)
                _first_writes(self.key_map, slots, js)
        self.key_map_last_idx = max(top, self.key_map_last_idx)

        if match == 0:
            return []
        offset = next((i for i, k in enumerate(self.keys) if inp[k.idx:k.idx + n] == key), None)
        if offset is None:
            offset = len(self.keys)
            self.keys.append(_Key(match, m))
        cur = self.keys[offset]
        cur.num = min(cur.num + 1, MAX_VALUE_COUNT)

        if self.key_only:
            count = min(m, cur.values[0].n_accepted)
            self.last_created, self.last_key, self.last_value = True, offset, 0
            return inp[match + n:match + n + max(count, 0)]

        if cur.num < self.min_hits:
            return []
        # the m-grams after each occurrence of the key up to this one
        for i in _matches(a, key, cur.stat_idx, match + 1).tolist():
            begin = i + n
            found = -1
            for v, val in enumerate(cur.values):
                if val.idx == 0:  # (a new m-gram after the key)
                    val.idx, val.num, val.n_accepted = begin, 0, m
                    found = v
                    break
                if inp[begin:begin + m] == inp[val.idx:val.idx + m]:
                    found = v
                    break
            if found >= 0:
                cur.values[found].num = min(cur.values[found].num + 1, MAX_VALUE_COUNT)
        cur.stat_idx = match
        best, slot = 0, 0
        for v, val in enumerate(cur.values):
            if val.num > best:
                best, slot = val.num, v
        others = sum(val.num for v, val in enumerate(cur.values) if v != slot)
        if others > 0 and best < 2 * others:  # (no m-gram clearly the most frequent)
            return []
        count = min(m, cur.values[slot].n_accepted)
        self.last_created, self.last_key, self.last_value = True, offset, slot
        return inp[match + n:match + n + max(count, 0)]

    def accept(self, n_accepted: int, is_other: bool) -> None:
        if is_other or not self.last_created:
            return
        self.keys[self.last_key].values[self.last_value].n_accepted = n_accepted


class NgramMod:
    """common_ngram_mod and common_speculative_impl_ngram_mod."""

    name = "ngram-mod"

    def __init__(self, n_match: int = 24, n_min: int = 48, n_max: int = 64):
        self.n, self.n_min, self.n_max = n_match, n_min, n_max
        self.entries = np.full(MOD_SIZE, -1, dtype=np.int32)
        self.used = 0
        self.i_last = 0          # the prompt positions whose n-grams are in the table
        self.n_draft_last = 0
        self.n_low = 0
        self._tok = _Tokens()
        self._mul = np.uint64(MOD_FACTOR & MOD_MASK)

    def fresh(self) -> "NgramMod":
        return NgramMod(self.n, self.n_min, self.n_max)

    def reset(self) -> None:
        self.entries.fill(-1)
        self.used = 0

    def _index(self, tokens) -> int:
        h = 0
        for t in tokens:
            h = (h * MOD_FACTOR + int(t)) & MOD_MASK
        return h

    def _add(self, a: np.ndarray, lo: int, hi: int) -> None:
        """add() for the n-grams starting at lo..hi-1 in order: each slot keeps the last token written to it."""
        if hi <= lo:
            return
        starts = np.arange(lo, hi, dtype=np.int64)
        h = np.zeros(len(starts), dtype=np.uint64)
        for i in range(self.n):
            h = (h * self._mul + a[starts + i].astype(np.uint64)) & np.uint64(MOD_MASK)
        slots = h.astype(np.int64)
        vals = a[starts + self.n].astype(np.int32)
        uniq, last = np.unique(slots[::-1], return_index=True)
        self.used += int(np.count_nonzero(self.entries[uniq] == -1))
        self.entries[uniq] = vals[::-1][last]

    def begin(self, prompt: list[int]) -> None:
        self.i_last = 0
        self.n_draft_last = 0
        if len(prompt) < self.n:
            return
        a = self._tok.sync(prompt)
        self._add(a, 0, len(prompt) - self.n)
        self.i_last = len(prompt) - self.n
        if self.used / MOD_SIZE > 0.25:
            self.reset()

    def draft(self, prompt: list[int], sampled: int) -> list[int]:
        self.n_draft_last = 0
        L, n = len(prompt), self.n
        if L < n:
            return []
        if self.i_last + 32 < L:  # (new n-grams go in 32 or more at a time)
            a = self._tok.sync(prompt)
            self._add(a, self.i_last, L - n)
            self.i_last = L - n
        ctx = prompt[L - n + 1:] + [sampled]
        out: list[int] = []
        for i in range(self.n_max):
            t = int(self.entries[self._index(ctx[i:i + n])])
            if t == -1:
                if i < self.n_min:
                    return []
                break
            ctx.append(t)
            out.append(t)
        self.n_draft_last = len(out)
        return out

    def accept(self, n_accepted: int, is_other: bool) -> None:
        if is_other or self.n_draft_last <= 0:
            return
        if n_accepted / self.n_draft_last < 0.25:
            self.n_low += 1
            if self.n_low >= 5:
                self.reset()
                self.n_low = 0
                self.i_last = 0
        else:
            self.n_low = 0


class _Part:
    """A token -> count map that iterates as libstdc++'s std::unordered_map<llama_token, int> does (identity hash):
    ngram-cache's drafts take the first of the most frequent tokens in that order. libstdc++ keeps one list; a new
    key goes in front of its bucket's run of keys, or in front of the list when its bucket is empty, and a rehash
    re-places every key that way in list order (sharpi_core.stdhash; checked against the library on random
    insertions). Kept key by key here: a draft reads the order between insertions."""

    __slots__ = ("counts", "order")

    def __init__(self):
        self.counts: dict[int, int] = {}
        self.order: list[int] = []

    @staticmethod
    def _place(order: list[int], key: int, nb: int) -> None:
        b = key % nb
        i = next((i for i, k in enumerate(order) if k % nb == b), 0)
        order.insert(i, key)

    def add(self, token: int) -> None:
        if token in self.counts:
            self.counts[token] += 1
            return
        nb = buckets(len(self.order) + 1)
        if nb != buckets(len(self.order)):
            old, self.order = self.order, []
            for k in old:
                self._place(self.order, k, nb)
        self._place(self.order, token, nb)
        self.counts[token] = 1


NGRAM_MIN, NGRAM_MAX = 1, 4  # LLAMA_NGRAM_MIN / _MAX: the context cache's n-gram sizes
# (fewest occurrences, least share in percent) for a context n-gram of size 1..4 to draft (draft_min_*_lax)
CACHE_LAX = ((2, 66), (2, 50), (1, 50), (1, 50))


class NgramCache:
    """common_speculative_impl_ngram_cache as llama-cli runs it (no static or dynamic cache files: -lcs / -lcd are
    llama-lookup's and llama-server's): a context cache of the n-grams of sizes 1..4 and the counts of the tokens
    that followed them, updated with the tokens since its last update (the n-grams inside them only, as llama.cpp);
    up to 8 tokens drafted one at a time, each the most frequent follower of the longest n-gram whose counts are
    frequent and dominant enough."""

    name = "ngram-cache"

    def __init__(self, n_draft: int = 8):
        self.n_draft = self.n_max = n_draft
        self.context: dict[tuple, _Part] = {}
        self.cache_size = 0

    def fresh(self) -> "NgramCache":
        return NgramCache(self.n_draft)

    def begin(self, prompt: list[int]) -> None:
        pass

    def _update(self, tokens: list[int]) -> None:
        for size in range(NGRAM_MIN, NGRAM_MAX + 1):
            for i in range(size, len(tokens)):
                key = tuple(tokens[i - size:i])
                part = self.context.get(key)
                if part is None:
                    part = self.context[key] = _Part()
                part.add(tokens[i])

    def _pick(self, seq: list[int]) -> int | None:
        """try_draft over the context cache: the longest n-gram first."""
        for size in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if size > len(seq):
                continue
            part = self.context.get(tuple(seq[len(seq) - size:]))
            if part is None:
                continue
            best, best_n, total = None, 0, 0
            for t in part.order:
                c = part.counts[t]
                if c > best_n:
                    best, best_n = t, c
                total += c
            min_n, min_pct = CACHE_LAX[size - 1]
            if total < min_n or 100 * best_n < min_pct * total:
                continue
            return best
        return None

    def draft(self, prompt: list[int], sampled: int) -> list[int]:
        if self.cache_size < len(prompt) + 1:
            self._update(prompt[self.cache_size:] + [sampled])
            self.cache_size = len(prompt) + 1
        seq = prompt + [sampled]
        if len(seq) < 2:  # (LLAMA_NGRAM_STATIC)
            return []
        out: list[int] = []
        while len(out) < self.n_draft:
            t = self._pick(seq)
            if t is None:
                break
            seq.append(t)
            out.append(t)
        return out

    def accept(self, n_accepted: int, is_other: bool) -> None:
        pass


def ngram_sources(types: list[str], simple=(12, 48), map_k=(12, 48), map_k4v=(12, 48, 1),
                  mod=(24, 48, 64)) -> list:
    """The n-gram sources a --spec-type list names, in llama.cpp's order."""
    made = {"ngram-simple": lambda: NgramSimple(*simple),
            "ngram-map-k": lambda: NgramMap(map_k[0], map_k[1], key_only=True),
            "ngram-map-k4v": lambda: NgramMap(map_k4v[0], map_k4v[1], key_only=False, min_hits=map_k4v[2]),
            "ngram-mod": lambda: NgramMod(*mod),
            "ngram-cache": lambda: NgramCache()}
    return [made[t]() for t in NGRAM_TYPES if t in types]


class NgramChain(WrapsModel):
    """llama.cpp's speculative types in its order: the n-gram sources, then `model` (a DraftModelDrafter or
    MtpDrafter; None: n-gram sources alone). Each step the first source that drafts proposes (cut to k; the model is
    asked for at most model_n_max). Proposals of the n-gram sources are deterministic (q None)."""

    def __init__(self, sources: list, model=None, model_n_max: int = 0, model_n_min: int = 0):
        if not sources and model is None:
            raise UsageError("no speculative source")
        self.sources = sources
        self.model, self.model_n_max, self.model_n_min = model, model_n_max, model_n_min
        # n-gram sources cost microseconds; with a draft model behind them a step may cost a draft's forwards
        self.free = model is None
        # the most tokens a step may verify: the sources' own sizes (llama.cpp's common_speculative_n_max), the
        # model's --spec-draft-n-max
        self.n_max = max([s.n_max for s in sources] + ([model_n_max] if model is not None else []))
        # False: the n-gram sources alone (speculative.SpecCost sets the model aside where its steps do not pay)
        self.use_model = True
        self.model_source = "draft"
        self.source: str | None = None
        self._last = None          # the source of the last proposal (llama.cpp's impl_last)
        self._at = 0               # the history length it proposed after
        self._began = False
        observe = getattr(model, "observe", None)
        if observe is not None:  # (an MTP head sees every target pass, whichever source proposed)
            self.observe = observe

    @property
    def fallback(self):
        """What proposes while speculative.SpecCost sets the model aside: this chain without it (None without one)."""
        return self if self.model is not None and self.sources else None

    def begin(self, prompt: list[int]) -> None:
        """A generation's prompt is in the target's cache (llama.cpp's common_speculative_begin)."""
        for s in self.sources:
            s.begin(list(prompt))
        self._began = True

    def propose(self, history: list[int], k: int):
        self.source = None
        if not self._began:
            self.begin(history[:-1])
        prompt, sampled = history[:-1], history[-1]
        for s in self.sources:
            d = s.draft(prompt, sampled)
            if d:
                self._last, self._at, self.source = s, len(history), s.name
                if getattr(s, "n_draft_last", 0) > k:  # (ngram-mod grades itself on what is verified: k of them)
                    s.n_draft_last = k
                return list(d[:k]), None
        if self.model is not None and self.use_model and k > 0:
            asked = min(k, self.model_n_max)
            props, q = self.model.propose(history, asked)
            # (--spec-draft-n-min: a plain step; sampled drafts by what was asked, see Generator._spec_step)
            if not props or (len(props) if q is None else asked) < self.model_n_min:
                return [], None
            self._last, self._at, self.source = self.model, len(history), "draft"
            return props, q
        return [], None

    def forced(self) -> None:
        """The step verified tokens a constraint forced, not a proposal of this drafter's (its last one may have been
        a speculative.SpecCost shadow that a plain step followed)."""
        self._last = None

    def rollback(self, n_keep: int) -> None:
        """After a verified step: the last proposal's source learns how many of its tokens were kept, the others
        that another source proposed (common_speculative_accept)."""
        last, self._last = self._last, None
        if last is not None:
            n = max(0, n_keep - self._at)
            for s in self.sources:
                s.accept(n, s is not last)
        if self.model is not None:
            self.model.rollback(n_keep)

    def shift(self, n_keep: int, n_discard: int) -> None:
        """A context shift moved the history: the sources' positions mean nothing now; they start over (at the
        next proposal, from the shifted history)."""
        self.sources = [s.fresh() for s in self.sources]
        self._last, self._began = None, False
        super().shift(n_keep, n_discard)
