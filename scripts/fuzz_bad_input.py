#!/usr/bin/env python3
"""Bad input through the CLI: each run ends in output or one clear error line, never a traceback (a tool, not a test).

    python scripts/fuzz_bad_input.py flags [--seed 1] [--runs 200] [--log fuzz.jsonl]
    python scripts/fuzz_bad_input.py gguf  [--seed 1] [--runs 200] [--log fuzz.jsonl]
    python scripts/fuzz_bad_input.py meta  [--seed 1] [--runs 200] [--model gemma3-270m-q4_k_m]

flags: each run gives SmolLM2 (cached) a short prompt and 1-5 options (mostly 1-2) drawn from the run command's own
(those of the network, the terminal, a GPU or output files left out), each with a value drawn for its type: sensible
ones, edge ones (-1, huge, nan, inf) and junk (letters, empty); an option that reads a file gets a text file, an
empty one, a folder, a missing file or /dev/null, and the text file must come out of the run unchanged; a quarter of
the runs add the model as its own draft.
gguf: each run changes 1-4 bytes or 8-byte words of a copy of SmolLM2's GGUF header (counts, types, lengths, the
metadata's and the tensor table's bytes; mostly near its start, where the counts are) and runs the copy.
meta: each run changes 1-2 values of the file's meaning while its layout stays readable: a number of the metadata
(set to 0, 1, one more or less, twice, half, huge, negative, nan or inf), a value's type (to another of its size), a
character of a key, a string or an array's string, an element of a number array, or a tensor's dimension, type,
data offset or name (another tensor's, or one character changed); `--model` picks which cached model is damaged.
A failure is a traceback on stderr, a run killed by a signal or one past its time limit, an exit code other than
0, 1 or 2, or (gguf) an error that is more than one line. Each is printed with its command line or the bytes
changed; every run goes to --log as a JSON line. The model is never written: the damaged copy lives in a temporary
folder. Exit status: 1 when a run failed.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sharpi_core.registry import cached_path, is_cached  # noqa: E402

MODEL = "smollm2-135m-instruct-q4_1"
# options of the network, the terminal, a GPU or output files, or that wait for input: not what this draws
SKIP = {"-m", "-hf", "-hff", "-hft", "-mu", "-cl", "-hfd", "-mm", "-mmu", "--image", "--media", "-cnv", "-i", "-if",
        "--mlock", "--lora-scaled", "--control-vector-scaled", "--log-file", "-o", "--version", "--offline",
        "--list-devices", "-dev", "--device", "-devd", "--device-draft", "-ngl", "-ngld", "--mmproj"}
# options that read (or keep) a file: given files of the run's folder, a folder, a missing one, or /dev/null; the
# text file must come out of every run as it went in (nothing the user had is overwritten)
PATH_OPTS = {"-f", "-bf", "--grammar-file", "-jf", "-sysf", "--chat-template-file", "--lora", "--control-vector",
             "--prompt-cache", "-md"}
PATHS = ["text.txt", "empty.txt", "dir", "missing.gguf", "", "/dev/null"]
TEXT = "Precious text, not a model.\n"
# (numbers: sensible ones half the time, else edge ones, junk a run in ten: so that most runs get past the checks)
VALUES = {
    "int": [["0", "1", "2", "3", "7", "64"], ["-1", "-2", "100000", "999999999999"], ["abc", ""]],
    "float": [["0", "0.5", "1", "1.5", "0.0001"], ["-1", "nan", "inf", "-inf", "1e30"], ["x", ""]],
    "str": ["none", "f16", "q8_0", "bf16", "q4_0", "auto", "on", "off", "yes", "1", "0", "", "x", '{"a":1}',
            "top_k;temp", "kd", "-1", "0-3", "0x3", "[1,2]", "ngram-simple", "draft", "1-2", "high", "deepseek",
            "15+1", "tokenizer.ggml.add_bos_token=bool:true", "a=int:1"],
    "path": PATHS,
}
PROMPTS = ["hi", "The capital of France is"] * 4 + [""]  # (an empty prompt is refused: rarely)
GGUF_RUN = ["-p", "hi", "-n", "4", "--temp", "0", "--offline", "-no-cnv"]


def value(r: random.Random, kind: str) -> str:
    if kind in ("str", "path"):
        return r.choice(VALUES[kind])
    good, edge, junk = VALUES[kind]
    x = r.random()
    return r.choice(good if x < 0.5 else edge if x < 0.9 else junk)


def run_options() -> list[tuple[list[str], str]]:
    """The run command's options as (names, type): type is 'flag', 'int', 'float', 'str', 'pair' (two ints) or
    'path'."""
    from sharpi_cli.main import command
    out = []
    for p in command().params:
        names = [*p.opts, *p.secondary_opts]
        if set(names) & PATH_OPTS:
            out.append((names, "path"))
            continue
        if not names or set(names) & SKIP:
            continue
        t = p.bare_type()
        kind = ("flag" if p.is_flag else "pair" if p.nargs == 2 else "int" if t == "int" else
                "float" if t == "float" else "str")
        out.append((names, kind))
    return out


def sharpi(args: list[str], cwd: str, timeout: float = 120) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `sharpi ARGS`, the console script (-999: past the time limit)."""
    try:
        p = subprocess.run(["sharpi", *args], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL, cwd=cwd, errors="replace")
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        return -999, "", "TIMEOUT"


def verdict(rc: int, err: str, one_line: bool) -> str | None:
    """Why a run failed, or None."""
    if "Traceback" in err:
        return "traceback"
    if rc == -999:
        return "time limit"
    if rc < 0 or rc > 2:
        return f"exit {rc}"
    if one_line and rc:
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("sharpi:", "warning"))]
        if len(lines) != 1:
            return f"{len(lines)} error lines"
    return None


def fuzz_flags(r: random.Random, runs: int, model: Path, cwd: str, log) -> int:
    opts = run_options()
    folder = Path(cwd)
    (folder / "text.txt").write_text(TEXT)
    (folder / "empty.txt").write_text("")
    (folder / "dir").mkdir()
    bad = 0
    for i in range(runs):
        args = ["-m", str(model), "-p", r.choice(PROMPTS), "-n", "3", "--offline"]
        if r.random() < 0.25:
            args += ["-md", str(model)]
        for _ in range(r.choice([1, 1, 2, 2, 3, 5])):  # (more options: more runs refused before they start)
            names, kind = r.choice(opts)
            name = r.choice(names)
            if kind == "flag":
                args.append(name)
            elif kind == "pair":
                args += [name, value(r, "int"), value(r, "int")]
            else:
                args += [name, value(r, kind)]
        rc, _, err = sharpi(args, cwd)
        why = verdict(rc, err, one_line=False)
        if why is None and (folder / "text.txt").read_text() != TEXT:
            why = "text.txt was written"
        (folder / "text.txt").write_text(TEXT)
        (folder / "missing.gguf").unlink(missing_ok=True)
        bad += why is not None
        log({"i": i, "args": args, "rc": rc, "bad": why, "err": err[-2000:] if why else err[-300:] if rc else ""})
        if why:
            print(f"FAIL ({why}): sharpi {' '.join(args)}\n{err[-1500:]}", flush=True)
    return bad


def run_damaged(runs: int, model: Path, cwd: str, log, draw) -> int:
    """`runs` runs of a copy of `model`, each with the changes `draw(f)` picks ([(description, offset, new bytes)],
    f the copy open to read), undone before the next run. Returns how many failed."""
    copy = Path(cwd) / "damaged.gguf"
    shutil.copyfile(model, copy)
    bad = 0
    with open(copy, "r+b") as f:
        for i in range(runs):
            changed = []
            for desc, off, new in draw(f):
                f.seek(off)
                old = f.read(len(new))
                f.seek(off)
                f.write(new[:len(old)])
                changed.append((desc, off, old, new[:len(old)]))
            f.flush()
            rc, _, err = sharpi(["-m", str(copy), *GGUF_RUN], cwd)
            why = verdict(rc, err, one_line=True)
            bad += why is not None
            where = [(desc, off, old.hex(), new.hex()) for desc, off, old, new in changed]
            log({"i": i, "changed": where, "rc": rc, "bad": why, "err": err[-2000:]})
            if why:
                print(f"FAIL ({why}): {where}\n{err[-1500:]}", flush=True)
            for _, off, old, _ in reversed(changed):  # the next run starts from the whole file again
                f.seek(off)
                f.write(old)
    return bad


def fuzz_gguf(r: random.Random, runs: int, model: Path, cwd: str, log) -> int:
    import gguf
    data_off = int(gguf.GGUFReader(model).data_offset)

    def draw(f) -> list:
        out = []
        for _ in range(r.choice([1, 1, 2, 4])):
            off = r.choice([r.randrange(0, 256), r.randrange(0, data_off), r.randrange(max(0, data_off - 20000),
                                                                                         data_off)])
            f.seek(off)
            old = f.read(8)
            x = r.random()
            if x < 0.4:
                new = bytes([r.randrange(256)]) + old[1:]
            elif x < 0.7:
                new = struct.pack("<Q", r.choice([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, r.randrange(2**16)]))
            else:
                new = r.randbytes(8)
            out.append(("bytes", off, new))
        return out
    return run_damaged(runs, model, cwd, log, draw)


def meta_targets(rd) -> dict[str, list[tuple[str, int, str, int]]]:
    """What `meta` may change, by group, as (description, byte offset, what it is, length): what is 'num:<numpy
    dtype>' (a number, or a bool), 'type' (a value's type id), 'char' (a byte of a name or string `length` long),
    'tensor_name' (a whole name), or 'tensor_type' / 'tensor_offset' / 'dim' (a tensor's); rd: the model's
    gguf.GGUFReader."""
    import gguf
    base = rd.data.ctypes.data
    at = lambda part, i=0: int(part.ctypes.data - base + i * part.dtype.itemsize)  # noqa: E731
    out: dict[str, list] = {g: [] for g in ("number", "value type", "key", "string", "array item", "tensor dim",
                                            "tensor type", "tensor offset", "tensor name")}
    for key, f in rd.fields.items():
        if key.startswith("GGUF."):  # (the header's counts: the `gguf` mode's)
            continue
        p = f.parts
        out["key"].append((f"key {key}", at(p[1]), "char", len(p[1])))
        kind = f.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            out["value type"].append((f"{key} item type", at(p[3]), "type", 0))
            for j in f.data:  # (indices into parts of the array's items)
                if f.types[1] == gguf.GGUFValueType.STRING:
                    if len(p[j]):
                        out["array item"].append((f"{key}[{j}]", at(p[j]), "char", len(p[j])))
                else:
                    out["array item"].append((f"{key}[{j}]", at(p[j]), f"num:{p[j].dtype.str}", 0))
        elif kind == gguf.GGUFValueType.STRING:
            if len(p[4]):
                out["string"].append((f"{key} text", at(p[4]), "char", len(p[4])))
        else:
            out["number"].append((f"{key} value", at(p[3]), f"num:{p[3].dtype.str}", 0))
            out["value type"].append((f"{key} type", at(p[2]), "type", 0))
    for t in rd.tensors:
        p = t.field.parts  # [name length, name, n_dims, dims, type, data offset]
        out["tensor name"].append((f"{t.name} name", at(p[1]), "tensor_name", len(p[1])))
        out["tensor name"].append((f"{t.name} name", at(p[1]), "char", len(p[1])))
        out["tensor type"].append((f"{t.name} type", at(p[4]), "tensor_type", 0))
        out["tensor offset"].append((f"{t.name} offset", at(p[5]), "tensor_offset", 0))
        for d in range(len(p[3])):
            out["tensor dim"].append((f"{t.name} dim {d}", at(p[3], d), "dim", 0))
    return {g: v for g, v in out.items() if v}


# type ids of the same size (the file stays readable): uint8 int8 bool / uint16 int16 / uint32 int32 float32 /
# uint64 int64 float64
SAME_SIZE = [[0, 1, 7], [2, 3], [4, 5, 6], [10, 11, 12]]


def meta_change(r: random.Random, f, off: int, what: str, n: int, names: list[bytes]) -> tuple[int, bytes]:
    """(Where, new bytes) for what lies at `off` (read through `f`), for `meta`."""
    import numpy as np
    f.seek(off)
    if what.startswith("num:"):
        dt = np.dtype(what[4:])
        old = np.frombuffer(f.read(dt.itemsize), dt)[0]
        if dt.kind == "f":
            new = r.choice([0.0, -0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e30, 1e-30, old * 2, -old,
                            old / 2])
        elif dt.kind == "b":
            return off, bytes([r.choice([0, 1, 2, 255])])
        else:
            o = int(old)
            hi = np.iinfo(dt).max
            new = r.choice([0, 1, 2, o + 1, o - 1, o * 2, o // 2, hi, hi // 2 + 1, r.randrange(2 ** 16), -1, -o])
            new = new % (1 << (8 * dt.itemsize))  # (wrapped to the field's width, a negative one as its bits)
            return off, int(new).to_bytes(dt.itemsize, "little")
        return off, np.array([new], dt).tobytes()
    if what == "type":
        old = int.from_bytes(f.read(4), "little")
        same = next((g for g in SAME_SIZE if old in g), [old])
        return off, r.choice([x for x in same if x != old] or [8, 9, 13]).to_bytes(4, "little")
    if what == "char":
        return off + r.randrange(n), bytes([r.choice([*b"._ -0aZ", r.randrange(32, 127), r.randrange(256)])])
    if what == "tensor_name":
        own = f.read(n)
        return off, r.choice([x for x in names if len(x) == n and x != own] or [own[::-1]])
    if what == "tensor_type":
        return off, r.choice([0, 1, 2, 3, 6, 7, 8, 10, 12, 13, 14, 30, 4, 5, 39, 40, 255]).to_bytes(4, "little")
    if what == "tensor_offset":
        o = int.from_bytes(f.read(8), "little")
        return off, (r.choice([o + 1, o + 32, o - 32, 0, 2 ** 40, 2 ** 64 - 32, o * 2]) % 2 ** 64).to_bytes(8, "little")
    assert what == "dim", what
    o = int.from_bytes(f.read(8), "little")
    return off, (r.choice([0, 1, o + 1, o - 1, o * 2, o // 2, 32, 2 ** 32, 2 ** 63, 2 ** 64 - 1]) % 2 ** 64).to_bytes(
        8, "little")


def fuzz_meta(r: random.Random, runs: int, model: Path, cwd: str, log) -> int:
    import gguf
    rd = gguf.GGUFReader(model)
    targets = meta_targets(rd)
    names = [t.name.encode() for t in rd.tensors]

    def draw(f) -> list:
        out = []
        for _ in range(r.choice([1, 1, 1, 2])):
            desc, off, what, n = r.choice(targets[r.choice(sorted(targets))])  # (a group, then one of it)
            out.append((desc, *meta_change(r, f, off, what, n, names)))
        return out
    return run_damaged(runs, model, cwd, log, draw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["flags", "gguf", "meta"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--log", type=Path)
    ap.add_argument("--model", default=MODEL, help="the cached model the gguf and meta modes damage a copy of")
    a = ap.parse_args()
    if not is_cached(a.model):
        sys.exit(f"{a.model} is not cached: run `sharpi models pull {a.model}` first")
    out = open(a.log, "w") if a.log else None

    def log(d: dict) -> None:
        if out:
            out.write(json.dumps(d) + "\n")
            out.flush()
    with tempfile.TemporaryDirectory() as cwd:
        rc, text, err = sharpi(["-m", str(cached_path(a.model)), *GGUF_RUN], cwd)  # the runs must be able to pass
        if rc or not text.strip():
            sys.exit(f"the undamaged model gives no output (exit {rc}):\n{err[-1500:]}")
        fuzz = {"flags": fuzz_flags, "gguf": fuzz_gguf, "meta": fuzz_meta}[a.mode]
        bad = fuzz(random.Random(a.seed), a.runs, cached_path(a.model), cwd, log)
    print(f"{a.runs} runs, {bad} failing")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
