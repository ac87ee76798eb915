#!/usr/bin/env python3
"""Prompt-eval and decode speed of sharpi per model, side by side with peers, in one run.

    python scripts/bench.py [-m NAME_OR_PATH ...] [--runs 3] [-p 128] [-n 128] [-t 2] [-ctk T] [-ctv T] [-d N]
                            [--vs-llama-cpp BIN_DIR] [--vs-transformers] [--device cpu|cuda]

Each measurement runs in a fresh subprocess (so peak resident memory is per model), after a
warm-up, and the figure is the median of --runs. Peers run alternately with sharpi, so machine
noise hits both alike: llama.cpp's `llama-bench -p P -n N -t T` from BIN_DIR, and Hugging Face
transformers loading the same GGUF. This script never installs or builds a peer: it reports
"not available" when one is not given or not installed.

--device cuda runs the models on the GPU (backends/cuda_model.py) and adds the weight bandwidth
decoding achieves (bytes of the weights one token reads x tokens/s) next to the GPU's peak. Decode
there is the product's greedy step (forward_argmax: the arg-max taken on the GPU, CUDA graphs); the
same worker also decodes with the logits brought back and argmax'd on the CPU, and with the kernels
launched one by one, for the two speed-ups; and samples with llama.cpp's default chain (temp 0.8, top-k 40,
top-p 0.95, min-p 0.05), drawn on the GPU (forward_sample) and by the CPU from the logits brought back.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODELS = ["smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m", "qwen2.5-coder-1.5b-instruct-q4_k_m"]


def worker(spec: str, n_prompt: int, n_gen: int, threads: int, device: str = "cpu", types: tuple = ("f16", "f16"),
           depth: int = 0) -> dict:
    """One measurement in this process: load, warm up, time prompt eval and decode (KV cache types `types`; the
    prompt after `depth` tokens already in the context)."""
    import resource
    import time

    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    from sharpi_core.registry import resolve_model
    from sharpi_core.models import load_model

    torch.set_num_threads(threads)
    path = resolve_model(spec)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # interpreter + torch
    t0 = time.perf_counter()
    model = load_model(path)
    if device == "cuda":
        from sharpi_core.backends.cuda_model import CudaTransformer
        model = CudaTransformer(model)
    load_s = time.perf_counter() - t0
    cache = model.new_cache(depth + n_prompt + n_gen + 8, *types)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.n_vocab, (n_prompt,), generator=g)
    before = torch.randint(0, model.config.n_vocab, (depth,), generator=g)
    def host_step(t: int) -> int:  # the logits come back, argmax on the CPU
        return int(model.forward(torch.tensor([t]), cache.length, cache)[-1].argmax())

    def device_step(t: int) -> int:  # the product's greedy step on a GPU
        return int(model.forward_argmax(torch.tensor([t]), cache.length, cache)[-1])

    step = device_step if device == "cuda" else host_step
    model.forward(prompt[:16], 0, cache, last_n=1)  # warm-up (kernels, lazy buffers, graph captures)
    for _ in range(4):
        host_step(1)
        step(1)
    cache.truncate(0)
    for i in range(0, depth, 512):
        model.forward(before[i:i + 512], i, cache, last_n=1)
    t0 = time.perf_counter()
    logits = model.forward(prompt, depth, cache, last_n=1)
    pp_s = time.perf_counter() - t0
    first = int(logits[-1].argmax())

    def decode(step) -> float:
        cache.truncate(depth + n_prompt)
        tok = first
        t0 = time.perf_counter()
        for _ in range(n_gen):
            tok = step(tok)
        return n_gen / (time.perf_counter() - t0)

    tg = decode(step)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    r = {"pp": n_prompt / pp_s, "tg": tg, "rss": rss, "base_rss": base_rss, "load_s": load_s,
         "file": os.path.getsize(path), "kv": cache.nbytes}
    if device == "cuda":
        from sharpi_core.backends.cuda import peak_bandwidth
        r["weight_gbs"] = model.decode_bytes * r["tg"] / 1e9
        r["peak_gbs"] = peak_bandwidth() / 1e9
        from sharpi_core.backends.cuda import pdl_status
        r["pdl"] = pdl_status()[1]  # programmatic dependent launch: on, or off and why
        r["tg_logits"] = decode(host_step)  # the whole logits row copied back every step
        from sharpi_core.sampling import SamplingParams, sample
        params, rng = SamplingParams(), torch.Generator().manual_seed(1)  # (llama.cpp's default chain)

        def sample_device(t: int) -> int:  # the law and the draw on the GPU (a product's sampled step)
            u = torch.rand(1, generator=rng, dtype=torch.float64).numpy()
            return max(0, int(model.forward_sample(torch.tensor([t]), cache.length, cache, params, u)[0][-1]))

        def sample_host(t: int) -> int:  # the logits come back, the CPU's chain draws
            return sample(model.forward(torch.tensor([t]), cache.length, cache)[-1], params, rng)

        for step_fn in (sample_device, sample_host):  # (warm-up: the sampled step's graph capture)
            cache.truncate(depth + n_prompt)
            step_fn(first)
        r["tg_sample"], r["tg_sample_host"] = decode(sample_device), decode(sample_host)
        model.use_graphs = False  # the kernels launched one by one (no CUDA graph)
        r["tg_eager"] = decode(device_step)
    return r


def run_sharpi(spec, args) -> dict:
    r = subprocess.run([sys.executable, __file__, "--worker", spec, "-p", str(args.p), "-n", str(args.n),
                        "-t", str(args.t), "--device", args.device, "-ctk", args.ctk, "-ctv", args.ctv, "-d", str(args.d)],
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"sharpi worker failed for {spec}:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_llama_bench(bin_dir: str, path: str, args) -> dict | None:
    exe = Path(bin_dir) / "llama-bench"
    if not exe.exists():
        return None
    r = subprocess.run([str(exe), "-m", path, "-p", str(args.p), "-n", str(args.n), "-t", str(args.t),
                        "-ctk", args.ctk, "-ctv", args.ctv, "-d", str(args.d), "-r", "1", "-o", "json"],
                       capture_output=True, text=True)
    if r.returncode:
        return None
    out = {}
    for row in json.loads(r.stdout):
        if row.get("n_prompt"):
            out["pp"] = row["avg_ts"]
        elif row.get("n_gen"):
            out["tg"] = row["avg_ts"]
    return out


def transformers_worker(path: str, n_prompt: int, n_gen: int, threads: int) -> dict:
    import time

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    p = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, torch_dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, n_prompt))
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        pp_s = time.perf_counter() - t0
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(n_gen):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        tg_s = time.perf_counter() - t0
    return {"pp": n_prompt / pp_s, "tg": n_gen / tg_s}


def run_transformers(path: str, args) -> dict | None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    r = subprocess.run([sys.executable, __file__, "--transformers-worker", path, "-p", str(args.p),
                        "-n", str(args.n), "-t", str(args.t)], capture_output=True, text=True)
    if r.returncode:
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def med(rows, key):
    vals = [r[key] for r in rows if r and key in r]
    return statistics.median(vals) if vals else None


def fmt(x, spec=".1f"):
    return "n/a" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", help="model name or path (repeatable)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-p", type=int, default=128, help="prompt tokens")
    ap.add_argument("-n", type=int, default=128, help="generated tokens")
    ap.add_argument("-t", type=int, default=2, help="threads")
    ap.add_argument("--vs-llama-cpp", metavar="BIN_DIR", help="directory holding llama.cpp's llama-bench")
    ap.add_argument("--vs-transformers", action="store_true", help="also time HF transformers on the same GGUF")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("-ctk", default="f16", help="K cache type (both sides)")
    ap.add_argument("-ctv", default="f16", help="V cache type (both sides)")
    ap.add_argument("-d", type=int, default=0, help="tokens already in the context before the prompt (llama-bench's "
                    "-d; its tg then starts at that depth, sharpi's after the prompt too: P tokens deeper)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--transformers-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.p, args.n, args.t, args.device, (args.ctk, args.ctv), args.d)))
        return
    if args.transformers_worker:
        print(json.dumps(transformers_worker(args.transformers_worker, args.p, args.n, args.t)))
        return

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    from machine_load import Load
    from sharpi_core.registry import resolve_model
    print(f"sharpi bench: pp{args.p} / tg{args.n}, {args.t} threads, median of {args.runs} runs, KV cache K {args.ctk} "
          f"V {args.ctv}" + (f", after {args.d} tokens" if args.d else ""), file=sys.stderr)
    if args.device == "cuda":
        return cuda_table(args)
    header = ("| model | lost CPU (steal, others) | sharpi pp t/s | sharpi tg t/s | peak RSS MB | of which python+torch | (file+KV) MB | "
              "RSS ratio | ratio w/o python+torch | "
              "llama.cpp pp | llama.cpp tg | pp ratio | tg ratio | transformers pp | transformers tg |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for spec in args.model or DEFAULT_MODELS:
        path = str(resolve_model(spec))
        ours, peer, hf = [], [], []
        load = Load()
        for _ in range(args.runs):  # alternate: sharpi, llama.cpp, transformers, sharpi, ...
            ours.append(run_sharpi(spec, args))
            if args.vs_llama_cpp:
                peer.append(run_llama_bench(args.vs_llama_cpp, path, args))
            if args.vs_transformers:
                hf.append(run_transformers(path, args))
        pp, tg = med(ours, "pp"), med(ours, "tg")
        rss = med(ours, "rss") / 1e6
        base_rss = med(ours, "base_rss") / 1e6
        base = (ours[0]["file"] + ours[0]["kv"]) / 1e6
        lpp, ltg = med(peer, "pp"), med(peer, "tg")
        hpp, htg = med(hf, "pp"), med(hf, "tg")
        steal, others = load.report()
        print(f"| {Path(path).stem} | {steal:.2f}, {others:.2f} | {fmt(pp)} | {fmt(tg)} | {rss:.0f} | {base_rss:.0f} | {base:.0f} | "
              f"{rss / base:.2f}x | {(rss - base_rss) / base:.2f}x | "
              f"{fmt(lpp) if args.vs_llama_cpp else 'not available'} | {fmt(ltg) if args.vs_llama_cpp else 'not available'} | "
              f"{fmt(pp / lpp, '.2f') + 'x' if lpp else 'n/a'} | {fmt(tg / ltg, '.2f') + 'x' if ltg else 'n/a'} | "
              f"{fmt(hpp) if args.vs_transformers else 'not available'} | {fmt(htg) if args.vs_transformers else 'not available'} |",
              flush=True)


def cuda_table(args) -> None:
    from sharpi_core.registry import resolve_model
    print("| model | sharpi pp t/s | sharpi tg t/s | weight GB/s in decode | GPU peak GB/s | of peak "
          "| tg t/s, logits to the CPU | device arg-max speed-up | tg t/s without CUDA graphs | graph speed-up "
          "| programmatic launch | sampling tg t/s, drawn on the GPU | sampling, logits to the CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for spec in args.model or DEFAULT_MODELS:
        rows = [run_sharpi(spec, args) for _ in range(args.runs)]
        bw, peak, tg, eager = med(rows, "weight_gbs"), med(rows, "peak_gbs"), med(rows, "tg"), med(rows, "tg_eager")
        host = med(rows, "tg_logits")
        print(f"| {Path(str(resolve_model(spec))).stem} | {fmt(med(rows, 'pp'))} | {fmt(tg)} | {fmt(bw)} | "
              f"{fmt(peak)} | {100 * bw / peak:.0f}% | {fmt(host)} | {tg / host:.2f}x | {fmt(eager)} | "
              f"{tg / eager:.2f}x | {rows[0].get('pdl', '')} | {fmt(med(rows, 'tg_sample'))} | "
              f"{fmt(med(rows, 'tg_sample_host'))} |", flush=True)


if __name__ == "__main__":
    main()
