#!/usr/bin/env python3
"""What a speculative step costs against a plain step, per k (a benchmark, not a test).

    python scripts/bench_spec_cost.py [--device cpu|cuda] [--ks 1,2,4,6] [--reps 15] [--depth N]
                                      [--tokens-per-pass 2:2.86,4:4.50,6:5.73 | auto]

Qwen2.5-Coder 1.5B target, 0.5B draft (its output layer cut as sharpi's default --spec-draft-vocab),
greedy. In one process, in turns: a plain step of the target (one token; on a GPU its arg-max taken
there, as sharpi decodes), the draft's proposal of k tokens after one new token (DraftModelDrafter:
on a GPU one chain of k passes), and the target's verify pass of k+1 rows. Each is timed alone with
the caches cut back after it, so the positions stay put; the table has medians.

break-even = (draft + verify) / plain: the tokens a verify pass must yield for speculation to match
plain decoding. None of these costs depends on the weights' values, so they can be measured on the
random-weight stand-ins of scripts/gguf_synth.py (the GPU machine, which the model files cannot reach;
put them under SHARPI_MODELS_DIR with the registry's file names). The projected speed-up is
E / break-even, E the tokens per verify pass the real models reach: by default those scripts/bench_spec.py
measured on the CPU (greedy proposals and verdicts are the same tokens on any device, up to
near-ties); `auto` measures them here with the Generator (real weights only), and also prints the
speed-up measured end to end next to the projection.

On a GPU the draft looks ahead (DraftModelDrafter's module doc): while the target verifies, the draft
computes the next step's proposals (a chain of k+1 passes, d' ~ d (k+1)/k) from its guess of the bonus
token. "draft || verify" (B) times the two launched together: a step whose guess holds costs B. One
whose guess fails waits for the stale chain, then drafts anew: max(d', verify) + d. With the hit rate
h (all k accepted and the bonus guessed; from the same CPU runs, or measured with `auto`) the
projection is E / (h B + (1 - h) (max(d', v) + d)) in plain steps. With perfect overlap and d' >= v
the look-ahead pays while d < v / (1 + 1/k - h) (k = 4, h = 0.8: the draft's 4 tokens cost less than
2.2 verify passes), about the regime where speculation pays at all.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec import CODE_PROMPT, decode_tps, ignore_eos, load  # noqa: E402
from sharpi_core.engine import draft_head_vocab  # noqa: E402
from sharpi_core.sampling import SamplingParams, argmax  # noqa: E402
from sharpi_core.speculative import DraftModelDrafter  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m"
# tokens per verify pass, Qwen 1.5B + 0.5B, greedy, code prompt, 64 tokens: scripts/bench_spec.py on
# the CPU (README, "Speculative decoding")
CPU_TOKENS_PER_PASS = "2:2.86,4:4.50,6:5.73"
CPU_HIT_RATE = "2:0.80,4:0.79,6:0.73"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--ks", default="1,2,4,6")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tokens-per-pass", default=CPU_TOKENS_PER_PASS,
                    help="k:E,... (E = tokens per verify pass at k) or 'auto' (measured here)")
    ap.add_argument("--hit-rate", default=CPU_HIT_RATE,
                    help="k:h,... (h = share of steps whose look-ahead holds); ignored with --tokens-per-pass auto")
    ap.add_argument("-t", type=int, default=2, help="CPU threads")
    ap.add_argument("--target", default=TARGET, help="the target's GGUF (a path, or a known model's name)")
    ap.add_argument("--draft", default=DRAFT, help="the draft's GGUF (same)")
    ap.add_argument("--depth", type=int, default=0,
                    help="tokens of context before the prompt (the code prompt's tokens repeated): every pass then "
                         "attends over that many more positions, as deep in a conversation (the step costs; "
                         "`--tokens-per-pass auto` measures E on the prompt alone)")
    a = ap.parse_args()
    torch.set_num_threads(a.t)
    ks = [int(x) for x in a.ks.split(",")]
    target, tok = load(a.target, a.device)
    draft, dtok = load(a.draft, a.device)
    params = ignore_eos(SamplingParams(temp=0.0), tok)
    bias = params.logit_bias
    on_device = bool(getattr(target, "device_argmax", False))
    prompt = tok.encode(CODE_PROMPT)
    prompt = (prompt * (a.depth // len(prompt) + 1))[:a.depth] + prompt
    T0 = len(prompt)
    tcache = target.new_cache(T0 + 64)
    first = int(argmax(target.forward(torch.tensor(prompt), 0, tcache, last_n=1)[-1]))
    head = draft_head_vocab(-1, dtok)
    drafter = DraftModelDrafter(draft, draft.new_cache(T0 + 64), params, head_vocab=head)
    drafter.lookahead = False  # costs measured one by one; the overlap is timed below
    chain = getattr(draft, "greedy_chain", None) if on_device else None
    dcache = draft.new_cache(T0 + 64)
    if chain is not None:
        draft.forward(torch.tensor(prompt), 0, dcache, last_n=1)

    def rows(tokens: list[int]) -> list[int]:  # the target's greedy ids after T0 (Generator's path)
        x = torch.tensor(tokens)
        if on_device:
            out = target.forward_argmax(x, T0, tcache, bias, decode=True).tolist()
        else:
            out = argmax(target.forward(x, T0, tcache, decode=True)).tolist()
        tcache.truncate(T0)
        return out

    def propose(k: int) -> list[int]:
        props, _ = drafter.propose(prompt + [first], k)
        drafter.rollback(T0)
        return props

    def overlapped(k: int) -> None:  # a look-ahead chain on the draft's stream beside a verify pass
        ahead = chain(torch.tensor([first]), T0, dcache, k + 1, bias, n_out=head, wait=False)
        rows([first] * (k + 1))
        ahead.result()
        dcache.truncate(T0)

    for k in ks:  # warm-up: kernels, buffers, every shape's graph
        rows([first] * (k + 1))
        propose(k)
        if chain is not None:
            overlapped(k)
    rows([first])
    times: dict = {("plain", 0): []}
    for _ in range(a.reps):
        times[("plain", 0)].append(timed(lambda: rows([first])))
        for k in ks:
            props: list[int] = []
            times.setdefault(("draft", k), []).append(timed(lambda: props.extend(propose(k))))
            times.setdefault(("verify", k), []).append(timed(lambda: rows([first] + props)))
            if chain is not None:
                times.setdefault(("both", k), []).append(timed(lambda: overlapped(k)))
    med = {key: statistics.median(v) for key, v in times.items()}
    plain = med[("plain", 0)]

    if a.tokens_per_pass == "auto":
        tpp, measured, hit = {}, {}, {}
        for k in ks:
            p_tps, _ = decode_tps(target, tok, CODE_PROMPT, 64, SamplingParams(temp=0.0))
            s_tps, r = decode_tps(target, tok, CODE_PROMPT, 64, SamplingParams(temp=0.0),
                                  DraftModelDrafter(draft, draft.new_cache(2048), params, head_vocab=head), k)
            st = r.spec
            tpp[k], measured[k] = st.tokens_per_pass, s_tps / p_tps
            # steps that accepted every proposal, times the chance to guess the bonus
            hit[k] = st.full_accepts / max(1, st.verify_passes) * st.acceptance
    else:
        parse = lambda text: {int(k): float(v) for k, v in (kv.split(":") for kv in text.split(","))}  # noqa: E731
        tpp, hit, measured = parse(a.tokens_per_pass), parse(a.hit_rate), {}

    print(f"Qwen 1.5B target + 0.5B draft on {a.device}, {T0} positions cached: plain step {plain:.2f} ms "
          f"({1000 / plain:.1f} t/s), median of {a.reps}; E = tokens per verify pass ({'measured here' if measured else 'given'})")
    print("| k | draft k tokens ms | per draft token / plain step | verify k+1 rows ms | verify / plain step "
          "| break-even tokens/pass | E | projected spec/plain | measured spec/plain "
          "| draft \\|\\| verify ms | h | projected with look-ahead |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k in ks:
        d, v = med[("draft", k)], med[("verify", k)]
        even = (d + v) / plain
        e = tpp.get(k)
        proj = f"{e:.2f} | {e / even:.2f}x" if e else "n/a | n/a"
        meas = f"{measured[k]:.2f}x" if k in measured else "n/a"
        both, h = med.get(("both", k)), hit.get(k)
        if both is not None and e and h is not None:
            miss = max(d * (k + 1) / k, v) + d  # the stale chain, then a fresh one, then the verify
            ahead = f"{both:.2f} | {h:.2f} | {e / ((h * both + (1 - h) * miss) / plain):.2f}x"
        else:
            ahead = f"n/a | {h:.2f} | n/a" if h is not None else "n/a | n/a | n/a"
        print(f"| {k} | {d:.2f} | {d / k / plain:.2f} | {v:.2f} | {v / plain:.2f} | {even:.2f} | {proj} | {meas} "
              f"| {ahead} |", flush=True)


if __name__ == "__main__":
    main()
