#!/usr/bin/env python3
"""A model's shape without its weights, and a GGUF of that shape with random weights.

The GPU machine this project borrows takes 64 MiB of files per call and reaches no network, so the
GGUF files (98 MB to 1.1 GB) cannot go there. Decode speed does not depend on the weights' values, so
the GPU benchmarks can run on a stand-in made there:

    python scripts/gguf_synth.py skeleton MODEL.gguf model.json.gz   # here: metadata + tensor list
    python scripts/gguf_synth.py build model.json.gz synth.gguf       # there: same shapes, random blocks

The skeleton keeps every metadata key (tokenizer included, so the stand-in tokenizes like the model)
and each tensor's name, type and shape. `build` writes random quantized blocks whose scale fields are
small finite halves (random bytes there could be inf or NaN), norm weights near 1 and small biases:
the stand-in runs without overflow, its output is noise. Correctness checks need the real files.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType
# byte offsets of the f16 scale fields in one block of each quantized type
SCALE_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
                Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
SKIP = ("GGUF.",)  # the reader's own header fields


def skeleton(src: str, dst: str) -> None:
    r = gguf.GGUFReader(src)
    kv = []
    for key, f in r.fields.items():
        if key.startswith(SKIP):
            continue
        types = [int(t) for t in f.types]
        kv.append({"key": key, "types": types, "value": f.contents()})
    tensors = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(v) for v in t.shape]} for t in r.tensors]
    with gzip.open(dst, "wt") as fh:
        json.dump({"arch": str(r.fields["general.architecture"].contents()), "kv": kv, "tensors": tensors}, fh)


def _blocks(qtype: Q, n_blocks: int, rng) -> np.ndarray:
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    for off in SCALE_FIELDS[qtype]:
        scale = rng.uniform(0.5e-3, 2e-3, size=n_blocks).astype(np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    if qtype == Q.Q6_K:  # int8 sub-block scales: keep them small
        raw[:, 192:208] = rng.integers(-16, 17, size=(n_blocks, 16), dtype=np.int8).view(np.uint8)
    return raw


def build(src: str, dst: str, seed: int = 0) -> None:
    with gzip.open(src, "rt") as fh:
        sk = json.load(fh)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(dst, sk["arch"])
    for item in sk["kv"]:
        key, types, value = item["key"], [VT(t) for t in item["types"]], item["value"]
        if key == "general.architecture":
            continue  # the writer adds it
        w.add_key_value(key, value, types[0], sub_type=types[-1] if types[0] == VT.ARRAY else None)
    for t in sk["tensors"]:
        qtype, shape = Q(t["type"]), t["shape"]  # shape as GGUF lists it: innermost first
        rows, k = int(np.prod(shape[1:])), shape[0]
        name = t["name"]
        if qtype == Q.F32:
            if name.endswith(".bias"):
                data = rng.normal(0, 0.02, size=rows * k)
            else:  # norm weights
                data = 1.0 + rng.normal(0, 0.05, size=rows * k)
            w.add_tensor(name, data.astype(np.float32).reshape(shape[::-1]))
        elif qtype == Q.F16:
            w.add_tensor(name, rng.normal(0, 0.02, size=(rows, k)).astype(np.float16).reshape(shape[::-1]))
        elif qtype in SCALE_FIELDS:
            bs, ts = gguf.GGML_QUANT_SIZES[qtype]
            raw = _blocks(qtype, rows * (k // bs), rng).reshape(*shape[:0:-1], k // bs * ts)  # bytes per row last
            w.add_tensor(name, raw, raw_dtype=qtype)
        else:
            raise SystemExit(f"{name}: type {qtype.name} is not synthesised")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("skeleton", help="MODEL.gguf -> its metadata and tensor list (gzipped JSON)")
    a.add_argument("src")
    a.add_argument("dst")
    b = sub.add_parser("build", help="skeleton -> a GGUF of that shape with random weights")
    b.add_argument("src")
    b.add_argument("dst")
    b.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cmd == "skeleton":
        skeleton(args.src, args.dst)
    else:
        build(args.src, args.dst, args.seed)


if __name__ == "__main__":
    sys.exit(main())
