#!/usr/bin/env python3
"""A draft model's count of proposals by cost against the generator's count, over many requests (a benchmark, not a
test).

    python scripts/bench_spec_count.py [--sets code,prose] [--ks 4,16] [--temps 0,0.7] [-n 96] [--switch NAME]

Qwen2.5-Coder 1.5B decoding plainly, with the 0.5B draft proposing the generator's count (`SHARPI_SPEC_COUNT=0`:
after a rejection one more than were accepted, after a full accept twice as many, up to k) and with the count
speculative.SpecCost chooses (the default: the count in [1, that] with the most tokens per second expected from
the measured costs, fixed ones when sampling), each deciding by cost whether to speculate at all. Which steps a
single request's rejections fall into decides a few percent either way (k = 3 or 4 on one prompt: 3.54 against
4.71 tokens a pass, the same draft), so the table sums many requests: tokens over seconds for each configuration,
and each request's ratios to plain. The configurations alternate within each request (ABC, then CBA).

--switch NAME: the two speculative configurations are another SHARPI_* switch off and on (the count by cost in both),
e.g. SHARPI_SPEC_CONFIDENCE (a draft's proposal ends after a token it gave under 0.75).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec import ignore_eos, load  # noqa: E402
from sharpi_core.engine import draft_head_vocab  # noqa: E402
from sharpi_core.generate import Generator  # noqa: E402
from sharpi_core.sampling import SamplingParams  # noqa: E402
from sharpi_core.speculative import DraftModelDrafter  # noqa: E402


def chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


SETS = {
    "code": [chat(u) for u in (
        "Write a Python function that merges two sorted lists.", "Write a binary search in C.",
        "Implement a stack class in Python with push, pop and peek.",
        "Write a JavaScript function that debounces another function.",
        "Write a SQL query that finds the top 5 customers by total order value.",
        "Write a Python function to check whether a string is a palindrome.",
        "Write a bash script that counts the lines of every .py file in a directory.", "Implement quicksort in Rust.")],
    "prose": [chat(u) for u in (
        "Write a short story about a lighthouse keeper who finds a letter in a bottle.",
        "Explain why the sky is blue to a child.", "Describe a walk through a forest in autumn.",
        "Write a letter thanking a teacher.")],
}
SIDES = ("plain", "generator's count", "count by cost")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="code,prose")
    ap.add_argument("--ks", default="4,16")
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--switch", default="SHARPI_SPEC_COUNT", help="the speculative runs have this switch off, then on")
    a = ap.parse_args()
    sides = SIDES if a.switch == "SHARPI_SPEC_COUNT" else ("plain", f"{a.switch}=0", f"{a.switch}=1")
    torch.set_num_threads(a.t)
    target, tok = load("qwen2.5-coder-1.5b-instruct-q4_k_m")
    draft, dtok = load("qwen2.5-coder-0.5b-instruct-q4_k_m")
    head = draft_head_vocab(-1, dtok)
    os.environ.pop("SHARPI_SPEC_COST", None)  # (sharpi's default: measured when greedy, fixed when sampling)

    def run(prompt: str, params: SamplingParams, k: int, side: str, seed: int) -> tuple[float, int]:
        os.environ[a.switch] = "0" if side == sides[1] else "1"
        d = None if side == sides[0] else DraftModelDrafter(draft, draft.new_cache(2048), ignore_eos(params, tok),
                                                             torch.Generator().manual_seed(seed), head_vocab=head)
        g = Generator(target, target.new_cache(2048), tok, ignore_eos(params, tok), seed=seed, drafter=d, spec_n_max=k)
        r = g.generate(tok.encode(prompt), n_predict=a.n)
        return r.timings.eval_ms / 1000, len(r.tokens)

    print(f"| requests | temp | k | plain t/s | {sides[1]} t/s | ratio | {sides[2]} t/s | ratio | "
          f"each request, {sides[1]} / {sides[2]} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.sets.split(","):
        for temp in (float(x) for x in a.temps.split(",")):
            params = SamplingParams(temp=temp)
            for k in (int(x) for x in a.ks.split(",")):
                total = {s: [0.0, 0] for s in sides}
                each = []
                for i, prompt in enumerate(SETS[name]):
                    tps = {}
                    for side in (sides if i % 2 == 0 else sides[::-1]):
                        secs, n = run(prompt, params, k, side, i)
                        total[side][0] += secs
                        total[side][1] += n
                        tps[side] = n / secs
                    each.append(f"{tps[sides[1]] / tps[sides[0]]:.2f}/{tps[sides[2]] / tps[sides[0]]:.2f}")
                r = {s: n / secs for s, (secs, n) in total.items()}
                p = r[sides[0]]
                print(f"| {name} ({len(SETS[name])}) | {temp:g} | {k} | {p:.1f} | {r[sides[1]]:.1f} | {r[sides[1]] / p:.2f}x | "
                      f"{r[sides[2]]:.1f} | {r[sides[2]] / p:.2f}x | {' '.join(each)} |", flush=True)


if __name__ == "__main__":
    main()
