"""`sharpi perplexity --hellaswag / --winogrande / --multiple-choice` against llama-perplexity's
(scripts/llamacpp_choice.py, on tests/data/choice): every running line, the closing lines and the errors; and the
task draws against std::mt19937 with libstdc++'s distributions."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from conftest import ROOT, SMOL, loaded, model_path
from test_cli import one_error_line, sharpi

from sharpi_core import choice

DATA = ROOT / "tests" / "data" / "choice"
ORACLE = json.loads((ROOT / "tests" / "data" / "llamacpp_choice.json").read_text())


def _args(flags):
    return [DATA / f if i and flags[i - 1] in ("-f", "-bf") else f for i, f in enumerate(flags)]


@pytest.mark.parametrize("case", ORACLE["cases"], ids=lambda c: f"{c['model'].split('-')[0]} {' '.join(c['flags'])}")
def test_scores_are_llama_perplexity_s(case):
    """Each task's line (hellaswag: running acc_norm and its Wilson interval; winogrande: running accuracy, both
    sentences' scores to 6 decimals, the pick and the answer; multiple choice: running acc_norm) as llama-perplexity
    prints it, in its order of tasks (all, or a random subset), and its closing lines; where it stops with an error
    (a task that does not fit the context, answers beyond -np), one error line saying so."""
    r = sharpi("perplexity", "-m", model_path(case["model"]), *_args(case["flags"]))
    if case["errors"] and not case["lines"]:
        one_error_line(r, 1, "does not fit" if "fit" in case["errors"][0] else "-np/--parallel 5")
        return
    assert r.returncode == 0, r.stderr
    got = [ln for ln in r.stdout.splitlines() if ln[:1].isdigit()]
    assert got == case["lines"]
    assert [ln for ln in r.stderr.splitlines() if ln.startswith(("Final", "Random"))] == case["final"]
    for e in case["errors"]:  # (winogrande's rows left out, each with a warning)
        assert e.split(": ", 1)[1] in r.stderr


@pytest.mark.parametrize("n", list(ORACLE["draws"]["uniform"]))
def test_uniform_draws_are_libstdcxx_s(n):
    rng = choice.Mt19937(1)
    assert [choice.uniform_index(rng, int(n)) for _ in range(20)] == ORACLE["draws"]["uniform"][n]


@pytest.mark.parametrize("n", list(ORACLE["draws"]["scaled"]))
def test_scaled_draws_are_llama_perplexity_s(n):
    rng = choice.Mt19937(1)
    assert [choice.scaled_index(rng, int(n)) for _ in range(20)] == ORACLE["draws"]["scaled"][n]


def test_continuations_after_the_prefix_are_whole_sequences():
    """A continuation evaluated after the shared prefix (the cache cut back to it) has the logits of the whole
    sequence in one pass, row for row, on the rows that are scored."""
    model, tok = loaded(SMOL)
    seqs = [tok.encode(f"The cat sat on the {w} and looked out.", add_special=True, parse_special=False)
            for w in ("mat", "windowsill", "roof")]
    t = choice.Task(seqs, choice.shared_prefix(seqs))
    cache = model.new_cache(64)
    first, rows = choice.sequence_logits(model, cache, t)
    for s, r in zip(seqs, rows):
        cache.truncate(0)
        whole = model.forward(torch.tensor(s[:-1]), 0, cache).float()
        assert r.shape[0] == len(s) - 1 - t.prefix
        assert torch.allclose(r, whole[t.prefix:], atol=1e-4, rtol=0)
        assert torch.allclose(first, whole[t.prefix - 1], atol=1e-4, rtol=0)


def test_data_files_read_as_llama_perplexity_reads_them():
    """hellaswag: 6 lines a task (a file of other line counts is one error); winogrande: rows without 4 commas, a '_'
    or an answer of 1 / 2 left out, a quoted sentence unquoted, and a last line without its newline left out (as
    std::getline's loop there leaves it); the binary format read from offsets when tasks are drawn."""
    with pytest.raises(choice.SharpiError, match="not a multiple of 6"):
        choice.hellaswag_tasks("a\n0\nb\nc\nd\n", 10)
    # a bad gold index named by its task's line in the file, whichever tasks were drawn (and dropped) before it
    tasks = [f"ctx {i}\n{9 if i == 3 else 0}\na\nb\nc\nd\n" for i in range(5)]
    drawn = choice.hellaswag_tasks("".join(t for i, t in enumerate(tasks) if i != 3), 4)
    assert drawn[0][0] != "ctx 3" and len(drawn) == 4  # (the draw takes another task first)
    with pytest.raises(choice.SharpiError, match="task at line 19 is '9'"):
        choice.hellaswag_tasks("".join(tasks), 5)
    warned = []
    rows = choice.winogrande_rows('h,e,a,d,e\n0,"A, _ b",x,y,2\n1,no comma\n2,C _ d,x,y,3\n3,E _ f,x,y,1', warned.append)
    assert rows == [("A, ", " b", "x", "y", 2)] and len(warned) == 3
    assert choice.winogrande_rows("0,E _ f,x,y,1\n", print) == [("E ", " f", "x", "y", 1)]
    # the answer as istream >> int reads it: after C's blanks (\v among them), in ASCII digits (not Arabic-Indic "1")
    assert choice.winogrande_rows("0,E _ f,x,y,\u0661\n1,G _ h,x,y, \v2\n", warned.append) == [("G ", " h", "x", "y", 2)]
    assert len(warned) == 4
    data = (DATA / "mc.bin").read_bytes()
    every = choice.multiple_choice_items(data, 0)
    assert len(every) == struct.unpack_from("<I", data)[0] == 12
    drawn = choice.multiple_choice_items(data, 5)
    assert drawn == [every[i] for i in choice.pick(12, 5)] and len(set(q for q, _, _ in drawn)) == 5
    with pytest.raises(choice.SharpiError, match="cannot read task"):
        choice.multiple_choice_items(data[:-3], 0)
    # a byte that is not UTF-8 is one U+FFFD, as the tokenizer reads -f's text (Python's "replace" gave one a run)
    text = b"Caf\xe2\x82 is"
    one = struct.pack("<II", 1, 8) + struct.pack("<I", len(text)) + text + struct.pack("<I", 1) + struct.pack(
        "<I", 1) + b"a" + struct.pack("<i", 1) + struct.pack("<I", 0)
    assert choice.multiple_choice_items(one, 0) == [("Caf\ufffd\ufffd is", ["a"], [1])]


def test_one_multiple_choice_task_has_no_spread():
    """One task: p (1 - p) / 0, the x86 default NaN (sign bit set), which llama-perplexity prints as -nan."""
    r = sharpi("perplexity", "-m", model_path(SMOL), "--multiple-choice", "-bf", DATA / "mc.bin",
               "--multiple-choice-tasks", 1)
    assert r.returncode == 0 and [ln for ln in r.stderr.splitlines() if ln.startswith("Final result")][0].endswith(
        " +/- -nan"), r.stderr


def test_choice_flags_are_checked(tmp_path):
    m = model_path(SMOL)
    hs = DATA / "hellaswag.txt"
    one_error_line(sharpi("perplexity", "-m", m, "--hellaswag", "--winogrande", "-f", hs), 2, "one score at a time")
    one_error_line(sharpi("perplexity", "-m", m, "--hellaswag"), 2, "-f FILE or -bf FILE")
    one_error_line(sharpi("perplexity", "-m", m, "--hellaswag", "-f", hs, "-bf", hs), 2, "-f FILE or -bf FILE")
    one_error_line(sharpi("perplexity", "-m", m, "-bf", hs), 2, "-bf/--binary-file is the data of")
    one_error_line(sharpi("perplexity", "-m", m, "--hellaswag", "-f", hs, "--hellaswag-tasks", -1), 2,
                   "invalid --hellaswag-tasks -1")
    one_error_line(sharpi("perplexity", "-m", m, "--multiple-choice", "-bf", DATA / "mc.bin", "-np", 0), 2,
                   "invalid -np/--parallel 0")
    one_error_line(sharpi("perplexity", "-m", m, "--winogrande", "-f", hs, "--kl-divergence-base", tmp_path / "b"),
                   2, "one at a time")
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x00\x00")
    one_error_line(sharpi("perplexity", "-m", m, "--multiple-choice", "-bf", bad), 1, "no tasks")
    r = sharpi("perplexity", "-m", m, "--winogrande", "-f", hs)  # (each of its lines left out with a warning)
    lines = r.stderr.splitlines()
    assert r.returncode == 1 and "winogrande: no tasks" in lines[-1] and "Traceback" not in r.stderr
    assert all(ln.startswith("warning: winogrande: no 4 comma") for ln in lines[:-1])
    assert len(lines) == 84  # (83 of its 84 lines read: the last, its newline dropped by -f, is left out)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("T", [20, 80])
def test_one_sequence_as_sequences_is_the_plain_pass(T):
    """A pass given as Sequences of one sequence (no hole, positions = cells) is the plain pass bit for bit, in the
    one-chunk (20 rows) and the tiled (80) flash attention, with output rows picked as llama.cpp's output rows."""
    from sharpi_core.models.transformer import Sequences
    model, tok = loaded(SMOL)
    ids = torch.tensor((tok.encode("One two three four five six seven eight nine ten. " * 12))[:T])
    cache = model.new_cache(128)
    plain = model.forward(ids, 0, cache)
    cache.truncate(0)
    z = torch.zeros(T, dtype=torch.int64)
    rows = torch.arange(0, T, 3)
    seq = model.forward(ids, 0, cache, seqs=Sequences(torch.arange(T), z, z, z), out_rows=rows)
    cache.truncate(0)
    picked = model.forward(ids, 0, cache, out_rows=rows)
    assert torch.equal(seq, picked)
    cache.truncate(0)
    every = model.forward(ids, 0, cache, seqs=Sequences(torch.arange(T), z, z, z), out_rows=torch.arange(T))
    assert torch.equal(every, plain)


def test_a_hole_is_skipped_as_the_cells_were_absent():
    """Flash attention's one-chunk kernel skips another sequence's cells (a hole) as ggml skips a -inf mask: the rows
    equal those of the same cells without the hole, bit for bit; the tiled kernel and -fa off within fp32 noise of a
    float64 reference."""
    from sharpi_core.kernels import cpu
    from sharpi_core.kv_cache import KVCache
    g = torch.Generator().manual_seed(3)
    H, Hkv, D, n = 4, 2, 64, 150
    kv = KVCache(1, 256, Hkv, D, D)
    k, v = torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, D, generator=g)
    kv.k.write(0, 0, k), kv.v.write(0, 0, v)
    keep = torch.cat((torch.arange(0, 20), torch.arange(70, 150)))  # cells [20, 70): another sequence's
    dense = KVCache(1, 256, Hkv, D, D)
    dense.k.write(0, 0, k[keep]), dense.v.write(0, 0, v[keep])
    for T, mode in ((10, cpu.ATTN_FA_PROMPT), (70, cpu.ATTN_FA_PROMPT), (10, cpu.ATTN_TINYBLAS)):
        q = torch.randn(T, H, D, generator=g)
        cells = torch.arange(150 - T, 150)
        vis = torch.stack((torch.zeros(T, dtype=torch.int64), cells, torch.full((T,), 20), torch.full((T,), 70)), 1)
        got = cpu.attention(q, kv.k, kv.v, 0, 150 - T, 0, 0.125, mode, vis=vis.contiguous())
        if mode == cpu.ATTN_FA_PROMPT and T < 64:
            want = cpu.attention(q, dense.k, dense.v, 0, 100 - T, 0, 0.125, mode)
            assert torch.equal(got, want)
        kf, vf = dense.k.q[0, :100].double(), dense.v.q[0, :100].double()  # [100, Hkv, D] as the cache holds them
        s = torch.einsum("thd,nhd->thn", q.double(), kf.repeat_interleave(H // Hkv, 1)) * 0.125
        s = s.masked_fill(torch.arange(100)[None, None, :] > torch.arange(100 - T, 100)[:, None, None], float("-inf"))
        ref = torch.einsum("thn,nhd->thd", s.softmax(-1), vf.repeat_interleave(H // Hkv, 1))
        assert torch.allclose(got.double(), ref, atol=5e-3), (T, mode, float((got.double() - ref).abs().max()))


def test_scores_without_several_sequences_a_pass():
    """A model whose passes cannot hold several sequences (here: told so) scores each continuation after its
    prefix, with a warning: llama-perplexity's task lines but for the scores' last digits."""
    model, tok = loaded(SMOL)
    case = next(c for c in ORACLE["cases"] if c["model"] == SMOL and c["flags"][:3] == ["--winogrande", "-f",
                                                                                       "winogrande.csv"])
    lines, log = [], []
    enc = lambda s: tok.encode(s, add_special=True, parse_special=False)  # noqa: E731
    model.sequences_ok = lambda: False
    try:
        choice.run_winogrande(model, enc, (DATA / "winogrande.csv").read_text()[:-1], 0, choice.Setup(2048, 4),
                              lines.append, log.append)
    finally:
        del model.sequences_ok
    assert any("cannot hold several sequences" in m for m in log)
    got = [ln.split("\t") for ln in lines if ln[:1].isdigit()]
    want = [ln.split("\t") for ln in case["lines"]]
    assert len(got) == len(want) == 15
    for g, w in zip(got, want):
        gs, ws = [float(x) for x in g[2].split()[:2]], [float(x) for x in w[2].split()[:2]]
        assert max(abs(a - b) for a, b in zip(gs, ws)) < 0.1


def test_passes_hold_at_most_the_sequences_context(monkeypatch):
    """The main() of the llama-perplexity the oracles come from (llama-cpp-python 0.3.36's) sets n_ctx = n_parallel *
    -c, then caps -b at it (ggml-org's later main() caps -b at -c itself, which sharpi took: at -c 40 a winogrande
    score moved by 6e-5): the context padded to 256 as llama_context pads it, the batch not."""
    seen = []
    real = choice.Setup
    monkeypatch.setattr(choice, "Setup", lambda *a: seen.append(a[:3]) or real(*a))
    m = model_path(SMOL)
    for c, n_par, b in ((128, 16, 2048), (100, 1, 4096), (64, 4, 128)):
        r = sharpi("perplexity", "-m", m, "--winogrande", "-f", DATA / "winogrande.csv", "-c", c, "-np", n_par, "-b", b,
                   "--winogrande-tasks", 2)
        assert r.returncode == 0, r.stderr
    assert seen == [(2048, 16, 2048), (512, 4, 400), (256, 4, 128)]
