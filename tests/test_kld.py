"""`sharpi perplexity --kl-divergence-base / --kl-divergence` against llama-perplexity's (scripts/llamacpp_kld.py):
the base file byte for byte (its sha256), the KL-divergence report line for line."""
from __future__ import annotations

import hashlib
import json

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
    data = bytearray(path.read_bytes())
    data[24:28] = (60000).to_bytes(4, "little")  # (the second token id)
    bad.write_bytes(data)
    one_error_line(sharpi("perplexity", "-m", smol, "--kl-divergence-base", bad, "--kl-divergence"), 1,
                   "damaged (token id 60000 outside its vocabulary of 49152)")
    one_error_line(sharpi("perplexity", "-m", smol, "--kl-divergence-base", tmp_path / "none.kld", "--kl-divergence"),
                   1, "cannot read")
    one_error_line(sharpi("perplexity", "-m", model_path("gemma3-270m-q4_k_m"), "--kl-divergence-base", path,
                          "--kl-divergence"), 1, "made with a vocabulary of 49152 tokens")


def test_ppl_output_type_1_is_llama_perplexity_s():
    c = ORACLE[0]
    r = sharpi("perplexity", "-m", model_path(c["model"]), "-f", FIXTURES_DIR / c["text"], "-c", c["n_ctx"],
               "--chunks", c["chunks"], "--ppl-output-type", 1)
    assert r.returncode == 0, r.stderr
    assert [ln for ln in r.stdout.splitlines() if ln.startswith(" ")] == c["ppl_output_type_1"]
    one_error_line(sharpi("perplexity", "-m", model_path(c["model"]), "-f", FIXTURES_DIR / c["text"],
                          "--ppl-output-type", 2), 2, "invalid --ppl-output-type 2")
