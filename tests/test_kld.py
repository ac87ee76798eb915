"""`sharpi perplexity --kl-divergence-base / --kl-divergence` against llama-perplexity's (scripts/llamacpp_kld.py):
the base file byte for byte (its sha256), the KL-divergence report line for line."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from conftest import FIXTURES_DIR, ROOT, model_path
from test_cli import one_error_line, sharpi

ORACLE = json.loads((ROOT / "tests" / "data" / "llamacpp_kld.json").read_text())["cases"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(case, the base file sharpi writes for it, its perplexity run)."""
    c = ORACLE[0]
    path = tmp_path_factory.mktemp("kld") / "base.kld"
    r = sharpi("perplexity", "-m", model_path(c["model"]), "-f", FIXTURES_DIR / c["text"], "-c", c["n_ctx"],
               "--chunks", c["chunks"], "--kl-divergence-base", path)
    assert r.returncode == 0, r.stderr
    return c, path, r


def test_base_file_is_llama_perplexity_s(base):
    c, path, r = base
    data = path.read_bytes()
    assert len(data) == c["base_size"] and hashlib.sha256(data).hexdigest() == c["base_sha256"]
    assert "Final estimate: PPL = " in r.stdout and not list(path.parent.glob("*.tmp*"))


@pytest.mark.parametrize("run", range(len(ORACLE[0]["kl_divergence"])), ids=lambda i: " ".join(ORACLE[0]["kl_divergence"][i]["flags"]) or "itself")
def test_kl_divergence_report_is_llama_perplexity_s(base, run):
    c, path, _ = base
    want = c["kl_divergence"][run]
    r = sharpi("perplexity", "-m", model_path(c["model"]), "--kl-divergence-base", path, "--kl-divergence", *want["flags"])
    assert r.returncode == 0, r.stderr
    assert [ln for ln in r.stdout.splitlines() if ln.strip()] == want["report"]


def test_flags_the_base_file_decides_are_named_as_unused(base):
    """-f and --chunks do nothing with --kl-divergence (the base file holds the text, its chunks): a warning says so,
    and the report is the one without them."""
    c, path, _ = base
    want = next(k for k in c["kl_divergence"] if not k["flags"])
    r = sharpi("perplexity", "-m", model_path(c["model"]), "--kl-divergence-base", path, "--kl-divergence",
               "-f", FIXTURES_DIR / c["text"], "--chunks", 99)
    assert r.returncode == 0 and [ln for ln in r.stdout.splitlines() if ln.strip()] == want["report"], r.stderr
    assert (f"warning: -f {FIXTURES_DIR / c['text']}, --chunks 99 not used: --kl-divergence scores the text of {path}, "
            f"its {c['chunks']} chunks of {c['n_ctx']} tokens") in r.stderr, r.stderr


def test_kl_divergence_errors(base, tmp_path):
    c, path, _ = base
    smol = model_path(c["model"])
    one_error_line(sharpi("perplexity", "-m", smol, "--kl-divergence"), 2, "give it")
    one_error_line(sharpi("perplexity", "-m", smol), 2, "-f/--file")
    bad = tmp_path / "bad.kld"
    bad.write_bytes(b"not logits at all")
    one_error_line(sharpi("perplexity", "-m", smol, "--kl-divergence-base", bad, "--kl-divergence"), 1,
                   "does not look like a file of log-probabilities")
    bad.write_bytes(path.read_bytes()[:1_000_000])
    one_error_line(sharpi("perplexity", "-m", smol, "--kl-divergence-base", bad, "--kl-divergence"), 1, "cut short")
    for n_chunk in (2**16, 2**31 - 1):  # a header that asks for terabytes of tokens: refused before they are read
        bad.write_bytes(path.read_bytes()[:8] + np.array([2**31 - 1, 49152, n_chunk], np.int32).tobytes() + bytes(1024))
        one_error_line(sharpi("perplexity", "-m", smol, "--kl-divergence-base", bad, "--kl-divergence"), 1, "cut short")
    data = bytearray(path.read_bytes())
    data[24:28] = (60000).to_bytes(4, "little")  # (the second token id)
    bad.write_bytes(data)
    one_error_line(sharpi("perplexity", "-m", smol, "--kl-divergence-base", bad, "--kl-divergence"), 1,
                   "damaged (token id 60000 outside its vocabulary of 49152)")
    one_error_line(sharpi("perplexity", "-m", smol, "--kl-divergence-base", tmp_path / "none.kld", "--kl-divergence"),
                   1, "cannot read")
    for where in (tmp_path, tmp_path / "no" / "dir.kld"):  # (refused before the model loads, not after every chunk)
        one_error_line(sharpi("perplexity", "-m", smol, "-f", FIXTURES_DIR / "apache-2.0.txt", "--kl-divergence-base",
                              where), 2, "--kl-divergence-base")
    one_error_line(sharpi("perplexity", "-m", model_path("gemma3-270m-q4_k_m"), "--kl-divergence-base", path,
                          "--kl-divergence"), 1, "made with a vocabulary of 49152 tokens")


def test_a_base_file_that_names_an_input_or_a_model_is_refused(tmp_path):
    """--kl-divergence-base FILE is written (log-probabilities replace what it held): the model, the text or any other
    GGUF model is refused in one line before anything loads, and stays as it was."""
    smol = model_path("smollm2-135m-instruct-q4_1")
    text, other = tmp_path / "t.txt", tmp_path / "other.gguf"
    text.write_text("precious text " * 50)
    before = smol.stat()
    other.write_bytes(b"GGUF precious")
    cases = [(smol, "is the file -m/--model names"), (text, "is the file -f/--file names"),
             (tmp_path / "." / "t.txt", "is the file -f/--file names"), (other, "is a GGUF model")]
    for base, says in cases:
        one_error_line(sharpi("perplexity", "-m", smol, "-f", text, "-c", 16, "--kl-divergence-base", base), 2,
                       f"--kl-divergence-base {base} {says}: it would be overwritten")
    assert text.read_text() == "precious text " * 50 and other.read_bytes() == b"GGUF precious"
    notes = tmp_path / "notes.md"  # any file that is not an earlier base (llama-perplexity replaces it)
    notes.write_text("mine")
    one_error_line(sharpi("perplexity", "-m", smol, "-f", text, "-c", 16, "--kl-divergence-base", notes), 2,
                   f"--kl-divergence-base {notes} exists and is not a file of log-probabilities")
    assert notes.read_text() == "mine"
    after = smol.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


def test_ppl_output_type_1_is_llama_perplexity_s():
    c = ORACLE[0]
    r = sharpi("perplexity", "-m", model_path(c["model"]), "-f", FIXTURES_DIR / c["text"], "-c", c["n_ctx"],
               "--chunks", c["chunks"], "--ppl-output-type", 1)
    assert r.returncode == 0, r.stderr
    assert [ln for ln in r.stdout.splitlines() if ln.startswith(" ")] == c["ppl_output_type_1"]
    one_error_line(sharpi("perplexity", "-m", model_path(c["model"]), "-f", FIXTURES_DIR / c["text"],
                          "--ppl-output-type", 2), 2, "invalid --ppl-output-type 2")


BATCH_ORACLE = json.loads((ROOT / "tests" / "data" / "llamacpp_ppl_batch.json").read_text())["cases"]


@pytest.mark.parametrize("case", BATCH_ORACLE, ids=lambda c: f"{c['model'].split('-')[0]} {' '.join(c['flags'])}")
def test_batch_flags_are_llama_perplexity_s(case):
    """-b / -ub as llama-perplexity takes them (scripts/llamacpp_ppl_batch.py): a chunk in batches of -b rows below
    -c, each in passes of -ub rows; the passes' row counts reach the kernels, so each chunk's value and the final
    estimate are its to the last digit (-ub 100 and -b 96 move them against one 512-row pass); -b above -c sets the
    sequences a batch that --ppl-output-type 1 counts by."""
    r = sharpi("perplexity", "-m", model_path(case["model"]), "-f", FIXTURES_DIR / case["text"], *case["flags"],
               "-ngl", 99)
    assert r.returncode == 0, r.stderr
    assert "-ngl has no effect" in r.stderr
    lines = r.stdout.splitlines()
    assert case["final"] in lines
    got = [ln.strip() for ln in lines if ln.startswith("[1]")] or [ln for ln in lines if ln.startswith("   ")]
    assert got == case["chunks"]


def test_perplexity_placement_flags(tmp_path):
    """perplexity takes -b / -ub values llama-perplexity takes, -ngl and -dev none (it runs on the CPU: -dev cuda is
    one error line), and the load flags; bad values are one error line."""
    c = BATCH_ORACLE[0]
    args = ("perplexity", "-m", model_path(c["model"]), "-f", FIXTURES_DIR / c["text"], "-c", 128, "--chunks", 1)
    r = sharpi(*args, "-b", 1000, "-dev", "none", "--no-mmap", "-lm", "none", "-ngl", 0)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    one_error_line(sharpi(*args, "-dev", "CUDA0"), 2, "perplexity runs on the CPU")
    one_error_line(sharpi(*args, "-b", 0), 2, "invalid -b/--batch-size 0")
    r = sharpi(*args, "-b", 1000, "-ub", -1, "-dev", "none")  # (llama.cpp's -ub 0 or less is -b)
    assert r.returncode == 0, r.stderr
    one_error_line(sharpi(*args, "-lm", "fast"), 2, "invalid -lm/--load-mode")


def test_passes_are_llama_perplexity_s():
    """The rows of a chunk's passes as llama-perplexity's batches and ubatches give them: below -c, -b rows in -ub
    passes; several chunks a batch (-b >= 2 -c): -ub / chunks rows of each a pass (split_equal), the last batch with the
    chunks left; --kl-divergence: its base file's chunks, as many a batch as -c allows."""
    from sharpi_core.perplexity import Passes
    p = Passes.of(2048, 512, 96)  # 21 chunks of 96 a batch
    assert (p.n_seq, [p.for_chunk(i, 23) for i in (0, 20, 21, 22)]) == (21, [24, 24, 256, 256])
    assert Passes.of(512, 100, 512) == Passes(100) and Passes.of(96, 512, 512) == Passes(96, batch=96)
    assert Passes.of(250, 100, 300) == Passes(100, batch=250)  # (passes of 100, 100, 50 | 50 rows)
    assert Passes.of(2048, 512, 512) == Passes(0, 4, 512) and Passes.of(2048, 4096, 2048) == Passes(0)
    kld = Passes.of(2048, 512, 512, 128)  # (a base file of 128-token chunks read with -c 512: 4 a batch)
    assert (kld.n_seq, kld.for_chunk(0, 8)) == (4, 128)


def test_a_base_file_named_by_a_fifo_or_a_link_is_written_through_it(base, tmp_path):
    """The base file goes into what the path names, as llama-perplexity's ofstream writes it: a FIFO's reader
    gets the bytes (a rename put a plain file in the FIFO's place), a symbolic link's target is written."""
    import os
    import threading
    c, path, _ = base
    args = ("perplexity", "-m", model_path(c["model"]), "-f", FIXTURES_DIR / c["text"], "-c", c["n_ctx"],
            "--chunks", c["chunks"], "--kl-divergence-base")
    fifo, got = tmp_path / "fifo", []
    os.mkfifo(fifo)
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    r = sharpi(*args, fifo)
    reader.join(timeout=60)
    assert r.returncode == 0 and got == [path.read_bytes()] and fifo.is_fifo(), r.stderr
    (tmp_path / "real.kld").write_bytes(b"_logits_ of an earlier run")  # (one of another kind is refused)
    (tmp_path / "link.kld").symlink_to("real.kld")
    assert sharpi(*args, tmp_path / "link.kld").returncode == 0
    assert (tmp_path / "link.kld").is_symlink() and (tmp_path / "real.kld").read_bytes() == path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.kld", "real.kld"]
