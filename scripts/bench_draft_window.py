#!/usr/bin/env python3
"""A draft model's window and prompt lookup beside it, end to end through the CLI (a benchmark, not a test).

    python scripts/bench_draft_window.py [--prompts deep,explain,edit,summ,code,prose] [-n 200] [--reps 2]
                                         [--temp 0] [--configs plain,md,md512,md256,hyb,hyb512,hyb256,default]

Runs `sharpi -m <Qwen 1.5B> [-md <Qwen 0.5B> ...] -no-cnv -f PROMPT -n N --temp T -s 7 --json` for each
configuration, alternating their order (ABBA) over the repetitions, and prints the medians of the prompt time (the
target's prompt pass and the draft's), the decoding time and their sum, the sum's speed-up against plain decoding,
the acceptance and whether every run of a configuration gave one text. What a long prompt costs a draft model shows
only in the sum: the draft evaluates its part of the prompt in the prompt pass.

Configurations: plain; md / md512 / md256: the draft alone with -cd 4096 / 512 / 256; hyb / hyb512 / hyb256 the same
with --draft-lookup beside it; default: `-md` with no other flag (sharpi's defaults). Prompts (chat-formatted, as
the model's template writes them): deep, code, prose: bench_spec.py's; edit: a module of this repository
(sharpi_core/dry.py's first 4500 characters, ~1200 tokens) to give back with better variable names, most of the answer
a copy; explain: the same module to explain; summ: ~1700 tokens of README.md's Speed section to summarize.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from sharpi_core.registry import resolve_model  # noqa: E402

import bench_spec  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m"


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def prompts() -> dict[str, str]:
    module = (ROOT / "sharpi_core" / "dry.py").read_text()[:4500]
    readme = (ROOT / "README.md").read_text()
    speed = readme[readme.find("## Speed"):][:4500]
    return {"deep": bench_spec.DEEP_PROMPT, "code": bench_spec.CODE_PROMPT, "prose": bench_spec.PROSE_PROMPT,
            "edit": _chat(f"Here is my module:\n```python\n{module}\n```\nRename the variable names to be more "
                          "descriptive and give me the whole module back."),
            "explain": _chat(f"Here is my module:\n```python\n{module}\n```\nExplain what each function in this "
                             "module does and how they work together."),
            "summ": _chat(f"{speed}\n\nSummarize the text above in a few paragraphs, with its main numbers.")}


def configs(draft: str) -> dict[str, list[str]]:
    md = ["-md", draft]
    return {"plain": [], "md": [*md, "-cd", "4096", "--no-draft-lookup"], "md512": [*md, "-cd", "512", "--no-draft-lookup"],
            "md256": [*md, "-cd", "256", "--no-draft-lookup"], "hyb": [*md, "-cd", "4096", "--draft-lookup"],
            "hyb512": [*md, "-cd", "512", "--draft-lookup"], "hyb256": [*md, "-cd", "256", "--draft-lookup"],
            "default": md}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default="deep,explain,edit,summ,code,prose")
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--temp", default="0")
    ap.add_argument("--configs", default="plain,md,md512,md256,hyb,hyb512,hyb256,default")
    a = ap.parse_args()
    target, draft = str(resolve_model(TARGET)), str(resolve_model(DRAFT))
    texts = prompts()
    names = a.prompts.split(",")
    cfgs = {k: v for k, v in configs(draft).items() if k in a.configs.split(",")}
    res: dict[tuple[str, str], list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = {p: Path(tmp) / f"{p}.txt" for p in names}
        for p, f in files.items():
            f.write_text(texts[p])
        for rep in range(a.reps):
            for p, f in files.items():
                for c in (list(cfgs) if rep % 2 == 0 else list(cfgs)[::-1]):
                    cmd = ["sharpi", "-m", target, *cfgs[c], "-no-cnv", "-f", str(f), "-n", str(a.n), "--temp", a.temp,
                           "-s", "7", "--json"]
                    r = subprocess.run(cmd, capture_output=True, text=True)
                    if r.returncode != 0:
                        sys.exit(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stderr[-2000:]}")
                    d = json.loads(r.stdout)
                    t, s = d["timings"], d.get("speculative") or {}
                    res.setdefault((p, c), []).append((t["prompt_ms"], t["eval_ms"], t["eval_n"], s.get("acceptance"),
                                                       d["text"]))
                    print(f"{p} {c} rep {rep}: prompt {t['prompt_ms']:.0f} ms, decoding {t['eval_ms']:.0f} ms / "
                          f"{t['eval_n']} tokens, accepted {s.get('acceptance')}", file=sys.stderr, flush=True)
    print(f"\n-n {a.n} --temp {a.temp}, medians of {a.reps}: prompt ms, decoding ms (tokens), sum, against plain; acceptance")
    for p in names:
        base = statistics.median(x[0] + x[1] for x in res[(p, "plain")]) if (p, "plain") in res else None
        for c in cfgs:
            v = res[(p, c)]
            pm, em = statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)
            sm = statistics.median(x[0] + x[1] for x in v)
            acc = "/".join(f"{x[3]:.0%}" for x in v if x[3] is not None)
            ratio = f"{base / sm:5.2f}x" if base else ""
            one = "" if len({x[4] for x in v}) == 1 else " (texts differ)"
            print(f"{p:8s} {c:8s} prompt {pm:7.0f} decoding {em:7.0f} ({v[0][2]}) sum {sm:7.0f} {ratio} {acc}{one}")


if __name__ == "__main__":
    main()
