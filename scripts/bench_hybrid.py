#!/usr/bin/env python3
"""Draft sources side by side (a benchmark, not a test): Qwen2.5-Coder 1.5B decoding plainly, with the 0.5B draft,
with prompt lookup, and with both, each step going to the source expected to bring more tokens per cost
(`-md ... --draft-lookup`, speculative/hybrid.py).

    python scripts/bench_hybrid.py [-n 128] [-k 4] [--temps 0,0.7] [--reps 3] [--cost off|on|both]
                                   [--requests scratch,edit,prose]

Requests: code written from scratch (little to copy), an edit of code given in the prompt (most of the answer
copies it), and prose (where the 0.5B draft is right about half the time). The configurations rotate within each
repetition (a drifting machine favours none); the table has medians, the ratio to plain, acceptance, tokens per
target pass and, for the hybrid, the share of steps lookup proposed. --cost: the speculative configurations
speculate at every step (off), by measured cost (on: speculative.SpecCost, greedy sharpi's default), or both (the
draft and the hybrid again, by cost; with the plain steps they chose and whether the draft model went off).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec import CODE_PROMPT, PROSE_PROMPT, decode_tps, ignore_eos, load  # noqa: E402
from machine_load import Load  # noqa: E402
from sharpi_core.engine import draft_head_vocab  # noqa: E402
from sharpi_core.sampling import SamplingParams  # noqa: E402
from sharpi_core.speculative import DraftModelDrafter, HybridDrafter, LookupDrafter  # noqa: E402

CODE = '''def merge(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out


def merge_all(lists):
    result = []
    for lst in lists:
        result = merge(result, lst)
    return result
'''
EDIT_PROMPT = ("<|im_start|>user\nRename `merge` to `merge_sorted` everywhere in this code and add type hints; "
               "answer with the whole code.\n\n```python\n" + CODE + "```<|im_end|>\n<|im_start|>assistant\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--cost", default="off", choices=["off", "on", "both"])
    ap.add_argument("--requests", default="scratch,edit", help="scratch, edit, prose")
    a = ap.parse_args()
    torch.set_num_threads(a.t)
    target, tok = load("qwen2.5-coder-1.5b-instruct-q4_k_m")
    draft, dtok = load("qwen2.5-coder-0.5b-instruct-q4_k_m")
    head = draft_head_vocab(-1, dtok)
    cost = draft.weight_bytes / target.weight_bytes  # (as the CLI reckons it)
    print("| request | temp | config | t/s | vs plain | accepted | tokens/pass | lookup's share of steps "
          "| plain steps by cost | draft model off | lost CPU (steal, others) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    requests = {"scratch": ("from scratch", CODE_PROMPT), "edit": ("edit given code", EDIT_PROMPT),
                "prose": ("prose", PROSE_PROMPT)}
    for label, prompt in (requests[r] for r in a.requests.split(",")):
        for temp in (float(x) for x in a.temps.split(",")):
            params = SamplingParams(temp=temp)

            def model():
                return DraftModelDrafter(draft, draft.new_cache(2048), ignore_eos(params, tok),
                                         torch.Generator().manual_seed(1), head_vocab=head)
            def hybrid():
                return HybridDrafter(LookupDrafter(3, 2), model(), a.k, cost=cost)
            configs = {"plain": (lambda: None, False)}
            for by_cost in {"off": (False,), "on": (True,), "both": (False, True)}[a.cost]:
                tail = ", by cost" if by_cost else ""
                configs.update({"draft" + tail: (model, by_cost),
                                "lookup" + tail: (lambda: LookupDrafter(3, 2), by_cost),
                                "lookup+draft" + tail: (hybrid, by_cost)})
            decode_tps(target, tok, prompt, 8, params)  # warm-up
            tps = {c: [] for c in configs}
            last = {}
            load_ = Load()
            for rep in range(a.reps):
                names = list(configs)
                for c in names[rep % len(names):] + names[:rep % len(names)]:
                    make, by_cost = configs[c]
                    t, r = decode_tps(target, tok, prompt, a.n, params, make(), a.k, seed=rep, cost=by_cost)
                    tps[c].append(t)
                    last[c] = r
            steal, others = load_.report()
            plain = statistics.median(tps["plain"])
            for c in configs:
                m = statistics.median(tps[c])
                s = last[c].spec
                if s is None:
                    cols = "| | |"
                    share = by = ""
                else:
                    cols = f"| {100 * s.acceptance:.0f}% | {s.tokens_per_pass:.2f} |"
                    src = s.sources
                    share = (f"{100 * src.get('lookup', {}).get('steps', 0) / max(1, sum(v['steps'] for v in src.values())):.0f}%"
                             if src else "")
                    by = f"{s.plain_by_cost} | {'yes' if s.cost_off else 'no'}" if configs[c][1] else " | "
                print(f"| {label} | {temp:g} | {c} | {m:.1f} | {m / plain:.2f}x {cols} {share} | {by} | {steal:.2f}, "
                      f"{others:.2f} |", flush=True)


if __name__ == "__main__":
    main()
