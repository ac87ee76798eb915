#!/usr/bin/env python3
"""What speculation with a model's own MTP layer costs per step (--spec-type draft-mtp; a benchmark, not a test).

    python scripts/bench_mtp.py [MODEL.gguf] [--ks 1,2,4] [--reps 15] [--draft-vocab -1] [-t 2]

MODEL: a GGUF with an MTP layer (Qwen3.5 / 3.6); by default scripts/gguf_derive.py's qwen35 variant of SmolLM2 (the
costs do not depend on the weights' values, only on the shapes). In one process, in turns, each timed alone with the
caches cut back after it: a plain step of the target (one token), the same step with its hidden rows handed to the
head (what every target pass costs once the head drafts: the extra rows of the last layer and the head's K / V), the
head's proposal of k tokens, and the target's verify pass of k + 1 rows with its rows observed. Medians, in ms, and:

    break-even = (draft + verify) / plain: the tokens a verify pass must yield for speculation to match plain decoding.

The head's acceptance is the model's (none on the derivative: its text is noise); E tokens per pass give a speed-up of
E / break-even.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_spec_cost import timed  # noqa: E402
from gguf_derive import DEFAULT_SOURCE, derive  # noqa: E402
from machine_load import Load  # noqa: E402
from sharpi_core.engine import draft_head_vocab  # noqa: E402
from sharpi_core.gguf_file import GGUFFile  # noqa: E402
from sharpi_core.models import load_model  # noqa: E402
from sharpi_core.models.mtp import MtpHead  # noqa: E402
from sharpi_core.registry import resolve_model  # noqa: E402
from sharpi_core.sampling import SamplingParams  # noqa: E402
from sharpi_core.speculative import MtpDrafter  # noqa: E402
from sharpi_core.tokenizer import Tokenizer  # noqa: E402

PROMPT = "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a GGUF with an MTP layer (default: the qwen35 derivative)")
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--draft-vocab", type=int, default=-1, help="as --spec-draft-vocab (-1 auto, 0 all)")
    ap.add_argument("-t", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.t)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = str(Path(tmp) / "qwen35.gguf")
            derive("qwen35", str(resolve_model(DEFAULT_SOURCE)), path)
        gf = GGUFFile(path)
        model, tok = load_model(gf), Tokenizer.from_gguf(gf)
        model.pack_weights()
        head = MtpHead(model)
        head.pack_weights()
        ids = tok.encode(PROMPT)
        cut = draft_head_vocab(args.draft_vocab, tok)
        drafter = MtpDrafter(head, head.new_cache(1024), SamplingParams(temp=0), head_vocab=cut)
        cache = model.new_cache(1024)
        lg, h = model.forward(torch.tensor(ids), 0, cache, last_n=1, hidden=True)
        drafter.observe(0, ids, h)
        L, t = len(ids), int(lg[-1].argmax())
        print(f"{Path(path).name}: {model.config.n_layer} layers + MTP, vocab {model.config.n_vocab} (head computes "
              f"{cut or model.config.n_vocab}), prompt {L} tokens, {args.t} threads", file=sys.stderr)

        def plain():
            model.forward(torch.tensor([t]), L, cache)
            cache.truncate(L)

        def plain_observed():
            _, hr = model.forward(torch.tensor([t]), L, cache, hidden=True)
            drafter.observe(L, [t], hr)
            cache.truncate(L)
            drafter.rollback(L)

        rows = {}
        ks = [int(k) for k in args.ks.split(",")]
        cache.keep_states(max(ks) + 1)  # (qwen35's recurrent states before each verify row, for the cut back)
        load = Load()
        for _ in range(2):  # warm-up
            plain(), plain_observed()
        for _ in range(args.reps):
            rows.setdefault("plain", []).append(timed(plain))
            rows.setdefault("plain + observe", []).append(timed(plain_observed))
            for k in ks:
                props = []
                rows.setdefault(f"draft k={k}", []).append(timed(lambda: props.extend(
                    drafter.propose(ids + [t], k)[0])))
                drafter.rollback(L)

                def verify():
                    toks = [t] + props
                    _, hr = model.forward(torch.tensor(toks), L, cache, decode=True, hidden=True)
                    drafter.observe(L, toks, hr)
                    cache.truncate(L)
                    drafter.rollback(L)
                rows.setdefault(f"verify k={k}", []).append(timed(verify))
        med = {name: statistics.median(v) for name, v in rows.items()}
        print(f"{'step':<18}{'median ms':>10}{'/ plain':>9}")
        for name, v in med.items():
            print(f"{name:<18}{v:>10.2f}{v / med['plain']:>9.2f}")
        for k in ks:
            be = (med[f"draft k={k}"] + med[f"verify k={k}"]) / med["plain"]
            print(f"k={k}: break-even {be:.2f} tokens per verify pass (of at most {k + 1})")
        print(f"({load.describe()})", file=sys.stderr)


if __name__ == "__main__":
    main()
