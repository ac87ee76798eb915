"""Random sampler chains through sharpi and libllama: the candidates they keep and their probabilities must be the
same (a tool, not a test).

    python scripts/fuzz_samplers.py LLAMA_CPP_SRC BIN_DIR [--seed 1] [--runs 500] [-m MODEL ...] [--log F]

Each case is a random chain (llama.cpp's stage names, any subset in any order, or the default chain), random
values for every stage (off, usual, at and past the edges llama.cpp's flags accept: top-p <= 0 or >= 1, min-p
> 1, top-k beyond the vocabulary, min-keep above what a stage leaves, dynamic temperature with negative
exponents, penalties below 1, DRY with short windows, logit biases to -inf, a vocabulary all but banned), a
random history (the model's tokens of a repetitive text, or synthetic ids with a period) and synthetic logits at a
random scale (scripts/llamacpp_samplers.py's, in one libllama process per batch: scripts/llamacpp_samplers.c); or
mirostat 1 / 2, or the chain with adaptive-p drawing last, over several logits rows, each row's law in the state
llama.cpp's picks before it lead to (the penalties' and DRY's history growing by them). sharpi's side is what
tests/test_samplers_llamacpp.py checks: apply_penalties then the chain (_chain, with XTC's cut when its
probability is 1, as the oracle's coin always cuts then) and filtered_probs; Mirostat.sides, AdaptiveP.law. A differing case is cut down
(values back to the defaults, stages dropped) to a smallest one that still differs, printed as the dict to add to
llamacpp_samplers.py's CASES, and written to --log. Exits 1 if any differed. Where llama.cpp's own result
is no law (NaN, no candidate) or its unstable sort decides (undefined_in_llama_cpp) a case is counted, not compared.

--record OUT: EDGES (what this tool found), then the first --record-n agreeing cases of the first model that leave
1..300 candidates or all but <= 512, in
tests/data/llamacpp_samplers.json's form: tests/data/llamacpp_samplers_fuzz.json, which
tests/test_samplers_llamacpp.py checks as it checks the hand-made cases.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from typing import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from sharpi_core.choices import HISTORY_SAMPLERS  # noqa: E402
from sharpi_core.libm import logf_array  # noqa: E402
from sharpi_core.sampling import _softmax32  # noqa: E402
from llamacpp_samplers import BASE, CODE, DEFAULT, STORY, case_input, parse_steps, sampling_params  # noqa: E402
from compare_llamacpp_logits import build, fuzz_args  # noqa: E402

BREAKERS = ["\n", ":", "\"", "*", "the", " mat", "en", "def ", "(a", ".\n", "sat on"]
# -1 (the whole context) for the penalties' and DRY's windows: what llama.cpp's common layer turns it into
CONTEXT = 4096


def _pick(rng: random.Random, *choices):
    return rng.choice(choices)


def random_case(rng: random.Random, n_vocab: int, focus: str | None = None, eog: Sequence[int] = ()) -> dict:
    """BASE with random changes: each field left as it is half the time, so the stages mix on and off. focus "dry":
    DRY always on, over histories that repeat (periods, repeats as long as the allowed length and longer,
    sequence breakers of several tokens and inside the repeats). focus "infill": the infill stage somewhere after
    top-k (before it, llama.cpp's merge loop over the whole vocabulary would take hours), end-of-generation tokens
    (`eog`) and short tokens (low ids: prefixes of many) raised by logit biases, so each of its branches is taken."""
    c = dict(BASE)
    r = rng.random
    if r() < 0.4:
        c["samplers"] = list(DEFAULT)
    else:
        chosen = rng.sample(DEFAULT, rng.randint(1, len(DEFAULT)))  # (penalties and DRY first: sampler_order's rule)
        c["samplers"] = [s for s in chosen if s in HISTORY_SAMPLERS] + [s for s in chosen if s not in HISTORY_SAMPLERS]
    vals = {
        "top_k": lambda: _pick(rng, 0, 1, 2, 3, 10, 40, 100, 1000, n_vocab - 1, n_vocab, n_vocab + 7),
        "top_p": lambda: _pick(rng, 1.0, 0.99, 0.95, 0.9, 0.5, 0.2, 0.01, 0.0, -0.5, 1.5, round(r(), 3)),
        "min_p": lambda: _pick(rng, 0.0, 0.01, 0.05, 0.1, 0.3, 0.9, 1.0, 1.5, -0.2, round(r() * 0.5, 3)),
        "typical_p": lambda: _pick(rng, 1.0, 0.99, 0.95, 0.9, 0.7, 0.5, 0.2, 0.05, 0.0, 1.5, round(r(), 3)),
        "top_n_sigma": lambda: _pick(rng, -1.0, 0.0, 0.3, 1.0, 1.5, 2.5, 4.0, 10.0),
        "xtc_probability": lambda: _pick(rng, 0.0, 1.0, 1.0),
        "xtc_threshold": lambda: _pick(rng, 0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.6),
        "temp": lambda: _pick(rng, 0.0, 0.1, 0.5, 0.8, 1.0, 1.3, 2.0, 5.0, round(r() * 2, 3)),
        "dynatemp_range": lambda: _pick(rng, 0.0, 0.1, 0.5, 1.0, 2.0),
        "dynatemp_exponent": lambda: _pick(rng, 1.0, 0.5, 2.0, 4.0, -1.0, 0.0),
        "repeat_last_n": lambda: _pick(rng, 0, 1, 8, 64, 256, -1),
        "repeat_penalty": lambda: _pick(rng, 1.0, 1.05, 1.1, 1.3, 2.0, 0.8, 0.5),
        "frequency_penalty": lambda: _pick(rng, 0.0, 0.1, 0.5, 1.0, -0.3),
        "presence_penalty": lambda: _pick(rng, 0.0, 0.2, 0.6, 1.5, -0.4),
        "dry_multiplier": lambda: _pick(rng, 0.0, 0.3, 0.8, 2.0),
        "dry_base": lambda: _pick(rng, 1.0, 1.1, 1.75, 3.0),
        "dry_allowed_length": lambda: _pick(rng, 0, 1, 2, 3, 5),
        "dry_penalty_last_n": lambda: _pick(rng, -1, 0, 5, 12, 64, 300),
        "dry_sequence_breakers": lambda: rng.sample(BREAKERS, rng.randint(0, 4)),
        "min_keep": lambda: _pick(rng, 0, 1, 2, 5, 30, 200, 5000),
        "scale": lambda: _pick(rng, 0.3, 0.5, 0.8, 1.0, 1.5, 2.5, 4.0),
    }
    for k, f in vals.items():
        if r() < 0.5:
            c[k] = f()
    if r() < 0.3:
        # (no +inf: llama.cpp's softmax is NaN then; sharpi's +inf wins, tests/test_samplers_llamacpp.py)
        c["logit_bias"] = [[rng.randrange(n_vocab), _pick(rng, float("-inf"), -5.0, -1.0, 0.5, 3.0, 10.0)]
                           for _ in range(rng.randint(1, 4))]
        if r() < 0.1:  # all but a few banned: the chain works on what is left
            c["logit_bias"] = [[i, float("-inf")] for i in range(n_vocab) if i % 997]
    kind = r()
    if kind < 0.12:  # mirostat 1 or 2: llama.cpp's chain for --mirostat (bias, temperature, mirostat), several steps
        c.update(samplers=["temperature", _pick(rng, "mirostat", "mirostat_v2")], dynatemp_range=0.0, rows=rng.randint(2, 5),
                 temp=_pick(rng, 0.5, 0.8, 1.0, 1.5, round(0.1 + r() * 2, 3)),
                 mirostat_tau=_pick(rng, 5.0, 3.0, 1.0, 0.5, 8.0, 12.0), mirostat_eta=_pick(rng, 0.1, 0.01, 0.3, 1.0))
    elif kind < 0.3:  # adaptive-p draws last; its state (and the penalties' history) follows each pick
        c.update(samplers=c["samplers"] + ["adaptive_p"], rows=rng.randint(2, 5),
                 adaptive_target=_pick(rng, 0.0, 0.1, 0.3, 0.5, 0.9, 1.0, 1.4),
                 adaptive_decay=_pick(rng, 0.0, 0.5, 0.9, 0.99, 1.5))
        if c["temp"] <= 0:
            c["temp"] = 0.8
    h = r()
    if h < 0.4:
        c["history_text"] = _pick(rng, STORY, CODE, STORY * 3, STORY[: rng.randint(1, len(STORY))])
    elif h < 0.7:
        c["history_text"] = ""
        c["history_ids"] = (rng.randrange(1000), rng.randint(1, 400), rng.randint(2, 12), _pick(rng, 0, 1, 3, 7))
    else:
        c["history_text"] = ""
    if focus == "dry":
        if "dry" not in c["samplers"]:
            c["samplers"] = ["dry"] + c["samplers"]
        c.update(dry_multiplier=_pick(rng, 0.3, 0.8, 2.0, 5.0), dry_base=_pick(rng, 1.1, 1.75, 3.0),
                 dry_allowed_length=_pick(rng, 0, 1, 2, 3, 5, 8), dry_penalty_last_n=_pick(rng, -1, 0, 3, 12, 40, 300),
                 dry_sequence_breakers=rng.sample(BREAKERS + ["t", " ", "at", "on the", "\n\n"], rng.randint(0, 5)))
        if r() < 0.6:
            c["history_text"] = ""
            c["history_ids"] = (rng.randrange(1000), rng.randint(5, 600), _pick(rng, 1, 2, 3, 5, 9, 17, 40),
                                _pick(rng, 0, 0, 1, 3, 7))
        else:
            c["history_text"] = _pick(rng, STORY * 2, CODE * 2, STORY + CODE + STORY)
    if focus == "infill":
        if "mirostat" in c["samplers"] or "mirostat_v2" in c["samplers"]:  # (mirostat replaces the chain)
            c.update(samplers=list(DEFAULT), rows=1)
        chain = [s for s in c["samplers"] if s != "top_k"]
        first = next((i for i, s in enumerate(chain) if s not in HISTORY_SAMPLERS), len(chain))
        chain.insert(first, "top_k")
        chain.insert(rng.randint(first + 1, len(chain) - (chain[-1] == "adaptive_p")), "infill")  # (adaptive-p last)
        c.update(samplers=chain, top_k=_pick(rng, 3, 10, 40, 40, 100, 300))
        c["logit_bias"] = [b for b in c["logit_bias"] if b[1] != float("-inf") or r() < 0.5][:4]
        c["logit_bias"] += [[t, _pick(rng, 2.0, 5.0, 8.0, 11.0, 14.0) * c["scale"]] for t in eog if r() < 0.4]
        c["logit_bias"] += [[rng.randrange(1000), round(r() * 8 * c["scale"], 3)] for _ in range(rng.randint(0, 8))]
    return c


def _llama_view(c: dict) -> dict:
    """The case as llama.cpp's sampler constructors take it: -1 windows are the context."""
    return {**c, "repeat_last_n": CONTEXT if c["repeat_last_n"] == -1 else c["repeat_last_n"],
            "dry_penalty_last_n": CONTEXT if c["dry_penalty_last_n"] == -1 else c["dry_penalty_last_n"]}


def _law(live: list[tuple[int, float]]) -> dict[int, float]:
    """llama.cpp's law: the softmax of the final logits of the candidates it left."""
    v = np.array([w for _, w in live], dtype=np.float64)
    e = np.exp(v - v.max())
    return dict(zip([i for i, _ in live], e / e.sum()))


def _compare(name: str, ids, probs, live: list[tuple[int, float]]) -> str | None:
    want = sorted(i for i, _ in live)
    if sorted(ids.tolist()) != want:
        extra, missing = sorted(set(ids.tolist()) - set(want)), sorted(set(want) - set(ids.tolist()))
        return f"{name}: {len(ids)} kept, llama.cpp {len(want)}; extra {extra[:8]}, missing {missing[:8]}"
    ref = _law(live)
    err = max(abs(float(q) - ref[i]) for i, q in zip(ids.tolist(), probs))
    return None if err < 1e-6 else f"{name}: probabilities differ by {err:.3g}"


def differs(c: dict, tok, hist: list[int], bias: list, xs: list[np.ndarray], steps: list) -> str | None:
    """Why sharpi's candidates differ from llama.cpp's `steps` (per logits row: (id, final logit) left, id it
    picked), or None. Mirostat and adaptive-p: each row in the state the picks before it lead to (llama.cpp's
    picks, fed to sharpi; the penalties' and DRY's history grows by them as llama.cpp's chain accepts them)."""
    import torch

    from sharpi_core.sampling import AdaptiveP, Mirostat, NoDistribution, _chain, apply_penalties, filtered_probs
    p = sampling_params(c, tok, bias)
    try:
        if "mirostat" in c["samplers"] or "mirostat_v2" in c["samplers"]:
            m = Mirostat(2 if "mirostat_v2" in c["samplers"] else 1, c["mirostat_tau"], c["mirostat_eta"], tok.n_vocab)
            for r, ((kept, picked), x) in enumerate(zip(steps, xs)):
                adj = apply_penalties(torch.from_numpy(x), hist, p).numpy()
                ((_, idx, q, u),) = m.sides(adj, p, m.state)
                live = adj[idx] > -np.inf  # (a banned token may stay among its candidates, at probability 0)
                idx, q, u = idx[live], q[live], u[live]
                why = _compare(f"mirostat step {r}", idx, q, [(i, v) for i, v in kept if v != float("-inf")])
                if why:
                    return why
                m.state = m.after(m.state, u[idx.tolist().index(picked)])
            return None
        # the chain's law at each row; adaptive-p's (when on: target >= 0) in the state the picks before lead to
        m, h = (AdaptiveP(p.adaptive_target, p.adaptive_decay) if p.adaptive_on else None), list(hist)
        for r, ((kept, picked), x) in enumerate(zip(steps, xs)):
            live = [(i, v) for i, v in kept if v != float("-inf")]  # masked (top-n-sigma, temperature 0): none
            adj = apply_penalties(torch.from_numpy(x), h, p).numpy()
            if m is not None:
                idx, q, sides = m.law(adj, p)
                why = _compare(f"adaptive-p step {r}", idx, q, live)
                if why:
                    return why
                m.state = m.next_state(m.state, sides, picked, None)
                h.append(picked)
                continue
            try:
                ids, probs = _chain(adj, p, c["xtc_probability"] >= 1.0)  # (the oracle's XTC at 1 always cuts)
            except NoDistribution:
                if live:
                    return f"sharpi: no distribution; llama.cpp kept {len(live)}"
                break
            if not live:
                return f"llama.cpp kept nothing, sharpi {len(ids)}"
            why = _compare(f"_chain step {r}", ids, probs, live)
            if why:
                return why
            if not (c["xtc_probability"] >= 1.0 and p.xtc_on):
                # filtered_probs, the whole row: llama.cpp's law on its candidates, 0 elsewhere (an underflow may
                # zero one)
                fp = filtered_probs(torch.from_numpy(adj), p).numpy().astype(np.float64)
                ref = _law(live)
                outside = np.flatnonzero(fp)
                outside = outside[~np.isin(outside, list(ref))]
                err = max(abs(fp[i] - ref[i]) for i in ref)
                if outside.shape[0] or not err < 1e-6:
                    return (f"filtered_probs step {r}: {outside.shape[0]} ids outside llama.cpp's, probabilities "
                            f"differ by {err:.3g}")
            if picked is None:  # (llama.cpp's chain accepts only adaptive-p's picks)
                break
            h.append(picked)
        return None
    except Exception as e:  # noqa: BLE001 - a crash is a difference too
        return f"sharpi raised {type(e).__name__}: {e}"


def undefined_in_llama_cpp(oracle: "Oracle", c: dict, seed: int) -> str | None:
    """Where llama.cpp's result is not a law to compare with: its own arithmetic is NaN or leaves no finite
    candidate (sharpi does what tests/test_samplers_llamacpp.py's degenerate cases pin), or its unstable sort
    decides. NaN logits out of its chain (dynamic temperature's infinite temperature on -inf logits); XTC
    cutting all but a banned candidate; a typical stage that sees a candidate of probability 0 (a banned or
    masked one, an underflow) and takes the log of 0 in its entropy; typical's cut between two candidates whose
    surprises are as far from the entropy (std::sort keeps either)."""
    hist, _, _, steps = oracle.run([(c, seed)])[0]
    for kept, _ in steps:
        if any(v != v for _, v in kept):
            return "NaN logits out of llama.cpp's chain"
        if all(v == float("-inf") for _, v in kept):
            return "llama.cpp leaves no finite candidate"
    if "typ_p" not in c["samplers"] or c["typical_p"] >= 1.0:
        return None
    before = c["samplers"][: c["samplers"].index("typ_p")]
    # each row's candidates as typical gets them, the picks before it in the penalties' and DRY's history
    picks = [sel for _, sel in steps]
    for r in range(len(steps)):
        if r and picks[r - 1] is None:
            break
        row = {**c, "samplers": before, "rows": 1, "history": hist + picks[:r]}
        first = oracle.run([(row, seed + 1000 * r)])[0][3][0][0]
        v = np.sort(np.array([w for _, w in first], dtype=np.float32))[::-1]
        p = _softmax32(v)
        if (p == 0).any():
            return "llama.cpp's typical sees a probability 0 (NaN entropy)"
        lp = logf_array(p)
        score = np.abs(-lp - (np.float32(0) - np.cumsum(p * lp, dtype=np.float32)[-1]))
        order = np.argsort(score, kind="stable")
        hit = np.flatnonzero(np.cumsum(p[order], dtype=np.float32) > np.float32(c["typical_p"]))
        hit = hit[hit + 1 >= c["min_keep"]]
        if hit.shape[0] and hit[0] + 1 < order.shape[0] and score[order[hit[0]]] == score[order[hit[0] + 1]]:
            return "typical's cut falls in a tie of its order (std::sort's choice)"
    return None


class Oracle:
    """llamacpp_samplers.c on one model's vocabulary: cases in, (history, bias, logits rows, steps) out."""

    def __init__(self, exe: Path, model: str):
        from sharpi_core.gguf_file import GGUFFile
        from sharpi_core.registry import pull
        from sharpi_core.tokenizer import Tokenizer
        self.exe, self.path, self.model = exe, pull(model), model
        self.tok = Tokenizer.from_gguf(GGUFFile(self.path))

    def run(self, cases: list[tuple[dict, int]]) -> list[tuple[list[int], list, list[np.ndarray], list]]:
        """Per case: its history, logit bias, logits rows and llama.cpp's steps (parse_steps')."""
        text, meta = [], []
        for c, seed in cases:
            t, hist, bias, xs = case_input(_llama_view(c), self.tok, seed)
            text.append(t)
            meta.append((hist, bias, xs))
        r = subprocess.run([str(self.exe), str(self.path)], input="".join(text), capture_output=True, text=True)
        out, res = r.stdout, []
        for hist, bias, xs in meta:
            steps, out = parse_steps(out, len(xs))
            if len(steps) < len(xs):
                raise RuntimeError(f"llamacpp_samplers exited {r.returncode}: {r.stderr[-500:]}")
            res.append((hist, bias, xs, steps))
        return res

    def check(self, c: dict, seed: int) -> str | None:
        return differs(c, self.tok, *self.run([(c, seed)])[0])


def shrink(oracle: Oracle, c: dict, seed: int) -> dict:
    """c with as many values back at BASE's (and stages dropped) as keep it differing."""
    changed = True
    while changed:
        changed = False
        for k in [k for k in BASE if k not in ("samplers", "rows", "scale") and c[k] != BASE[k]] + ["history_ids"]:
            if k == "history_ids":
                if "history_ids" not in c:
                    continue
                t = {kk: vv for kk, vv in c.items() if kk != "history_ids"}
            else:
                t = {**c, k: BASE[k]}
            if oracle.check(t, seed) and not undefined_in_llama_cpp(oracle, t, seed):
                c, changed = t, True
        for s in list(c["samplers"]):
            if len(c["samplers"]) > 1 and not ({"mirostat", "mirostat_v2"} & set(c["samplers"])):
                t = {**c, "samplers": [x for x in c["samplers"] if x != s]}
                if oracle.check(t, seed) and not undefined_in_llama_cpp(oracle, t, seed):
                    c, changed = t, True
    return c


# what this tool found (model, seed, changes to BASE): --record writes them first
EDGES = [
    # top-n-sigma's cut in float64 kept two logits beside it that llama.cpp's float mean and deviation drop (found
    # at seed 122830303, 32232 left; these seeds keep few or drop few, and the float64 cut differs there too)
    ("smollm2-135m-instruct-q4_1", 100043, dict(top_n_sigma=4.5, samplers=["top_n_sigma"])),
    ("smollm2-135m-instruct-q4_1", 100089, dict(top_n_sigma=4.0, samplers=["top_n_sigma", "temperature"], scale=1.0)),
    ("smollm2-135m-instruct-q4_1", 100035, dict(top_n_sigma=9.5, samplers=["top_n_sigma"])),
    # the default chain's temperature divided in float64 (llama.cpp's float32 quotient moves a logit of 200 by 1e-5)
    ("smollm2-135m-instruct-q4_1", 900458589, dict(temp=0.049)),
    # typical left its survivors sorted by logit; llama.cpp leaves them by distance, where top-p's float sum runs
    ("smollm2-135m-instruct-q4_1", 23410164, dict(typical_p=0.99, samplers=["typ_p", "top_p"], scale=0.3)),
    # XTC at threshold 0 counts banned tokens in its run, so min-keep refuses the cut (sharpi left them out of it)
    ("smollm2-135m-instruct-q4_1", 332428834, dict(xtc_probability=1.0, xtc_threshold=0.0, samplers=["xtc"], min_keep=3,
                                                   logit_bias=[[5, float("-inf")], [77, float("-inf")],
                                                               [1000, float("-inf")]])),
    # top-k at the vocabulary's size sorts it all, so top-p's float sum runs in that order (sharpi summed by id;
    # found at seed 746448810 with top-p 0.95)
    ("smollm2-135m-instruct-q4_1", 500001, dict(top_k=49152, top_p=0.99, min_p=0.0, scale=0.5)),
]
# (and, in llamacpp_samplers.py's CASES: adaptive-p reshaping a float64 softmax, mirostat's law left unnormalized)


def _oracle_case(oracle: Oracle, c: dict, seed: int, hist: list[int], bias: list, steps: list,
                 name: str = "random", max_dropped: int = 512) -> dict | None:
    """An agreeing case in tests/data/llamacpp_samplers.json's form (test_chain_matches_llama_cpp reads both), if
    llama.cpp's law is defined and the case is small: <= 64 biases, and 1..300 candidates left (their logits), or
    all but <= max_dropped (then as adaptive-p's steps are: the ids left out, the 64 highest logits and the log of
    the sum of exp over all of them)."""
    if c["rows"] > 1:  # (mirostat, adaptive-p: the hand-made cases' form, not recorded here)
        return None
    live = [[i, v] for i, v in steps[0][0] if v != float("-inf")]
    n_vocab = oracle.tok.n_vocab
    if (not (1 <= len(live) <= 300 or n_vocab - len(live) <= max_dropped) or len(bias) > 64
            or undefined_in_llama_cpp(oracle, c, seed)):
        return None
    case = {"name": f"{name} {seed}", "model": oracle.model, "seed": seed,
            **{f: c[f] for f in BASE if f != "history_text"}, "logit_bias": bias, "history": hist}
    if len(live) <= 300:
        return {**case, "kept": live}
    ids = {i for i, _ in live}
    v = np.array([w for _, w in live], dtype=np.float64)
    return {**case, "n": len(live), "dropped": [i for i in range(n_vocab) if i not in ids],
            "top": sorted(live, key=lambda e: -e[1])[:64], "lse": float(v.max() + np.log(np.exp(v - v.max()).sum()))}


def main() -> None:
    ap = fuzz_args(__doc__, "libllama", 500, "cases per model")
    ap.add_argument("-m", "--model", action="append", help="registry name (default: SmolLM2 and Qwen2.5's 1.5B)")
    ap.add_argument("--batch", type=int, default=25, help="cases per libllama process")
    ap.add_argument("--focus", choices=["dry", "infill"],
                    help="every case with DRY on, over repeating histories; or with infill after top-k")
    ap.add_argument("--record", type=Path, help="write agreeing cases of the first model to this oracle file")
    ap.add_argument("--record-n", type=int, default=60, help="how many random ones")
    a = ap.parse_args()
    models = a.model or ["smollm2-135m-instruct-q4_1", "qwen2.5-coder-1.5b-instruct-q4_k_m"]
    bad, recorded = [], []
    with tempfile.TemporaryDirectory() as d:
        exe = build(a.src, a.bin, Path(d), "llamacpp_samplers")
        for model in models:
            oracle = Oracle(exe, model)
            rng = random.Random(f"{a.seed}:{model}")
            eog = sorted(oracle.tok.eog_ids)
            cases = [(random_case(rng, oracle.tok.n_vocab, a.focus, eog), 100_000 + rng.randrange(10**9))
                     for _ in range(a.runs)]
            n_bad = n_undef = n_random = 0
            if a.record and model == models[0]:
                edges = [({**BASE, **ch}, sd) for m, sd, ch in EDGES if m == model]
                for (c, seed), (hist, bias, xs, steps) in zip(edges, oracle.run(edges) if edges else []):
                    why = differs(c, oracle.tok, hist, bias, xs, steps)
                    case = None if why else _oracle_case(oracle, c, seed, hist, bias, steps, "found", 8192)
                    print(f"edge {seed}: {why or ('recorded' if case else 'not recorded (too big or undefined)')}")
                    if case:
                        recorded.append(case)
            for b in range(0, len(cases), a.batch):
                chunk = cases[b:b + a.batch]
                for (c, seed), (hist, bias, xs, steps) in zip(chunk, oracle.run(chunk)):
                    why = differs(c, oracle.tok, hist, bias, xs, steps)
                    if why is None:
                        if a.record and model == models[0] and n_random < a.record_n:
                            case = _oracle_case(oracle, c, seed, hist, bias, steps)
                            if case:
                                recorded.append(case)
                                n_random += 1
                        continue
                    if undefined_in_llama_cpp(oracle, c, seed):
                        n_undef += 1
                        continue
                    n_bad += 1
                    small = shrink(oracle, c, seed)
                    why = oracle.check(small, seed) or why
                    delta = {k: v for k, v in small.items() if k in BASE and v != BASE[k] or k == "history_ids"}
                    if len(json.dumps(delta.get("logit_bias", []))) > 300:
                        delta["logit_bias"] = f"{len(delta['logit_bias'])} entries"
                    print(f"{model} seed {seed}: {why}\n    {delta}", flush=True)
                    bad.append({"model": model, "seed": seed, "why": why, "case": small})
                print(f"{model}: {min(b + a.batch, len(cases))}/{len(cases)} cases, {n_bad} differ, {n_undef} undefined in llama.cpp", flush=True)
    if a.log:
        a.log.write_text(json.dumps(bad, indent=1, default=str) + "\n")
    if a.record:
        a.record.write_text(json.dumps(recorded, indent=0) + "\n")
        print(f"wrote {len(recorded)} cases to {a.record}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
