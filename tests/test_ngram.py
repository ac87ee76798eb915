"""llama.cpp's n-gram drafters (--spec-type ngram-*): sharpi's proposals against libllama-common's, recorded by
scripts/llamacpp_ngram.py (tests/data/llamacpp_ngram.json), and speculation with them through the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sharpi_core.speculative.ngram import NgramChain, NgramMap, NgramMod, NgramSimple, ngram_sources
from test_cli import one_error_line, sharpi, smol  # noqa: F401  (smol: the fixture)

DATA = json.loads((Path(__file__).parent / "data" / "llamacpp_ngram.json").read_text())


def replay(c: dict, seqs: dict) -> list:
    """llamacpp_ngram.cpp's driver with sharpi's chain: begin per turn, a proposal every step after history +
    [sampled], its prefix matching the sequence accepted (rollback), the history moving past it."""
    chain = NgramChain(ngram_sources(c["types"].split(","), tuple(c["simple"]), tuple(c["map_k"]),
                                     tuple(c["map_k4v"]), tuple(c["mod"])))
    out = []
    for turn in seqs[c["turns"]]:
        hist, truth = list(turn["prompt"]), turn["cont"]
        chain.begin(hist)
        out.append("begin")
        pos = 0
        while pos < len(truth):
            props, q = chain.propose(hist + [truth[pos]], c["n_max"])
            assert q is None
            out.append(list(props))
            acc = 0
            while acc < len(props) and pos + 1 + acc < len(truth) and props[acc] == truth[pos + 1 + acc]:
                acc += 1
            if props:
                chain.rollback(len(hist) + 1 + acc)
            hist += truth[pos:pos + 1 + acc]
            pos += 1 + acc
    return out


@pytest.mark.parametrize("c", DATA["cases"], ids=[c["name"] for c in DATA["cases"]])
def test_drafts_are_llamacpps(c):
    got = replay(c, DATA["sequences"])
    want = c["drafts"]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"call {i}: {g} != llama.cpp's {w}"
    assert sum(1 for d in want if d != "begin" and d) > 10  # (the case drafts: it tests something)


def test_sources_follow_llamacpps_order():
    srcs = ngram_sources(["ngram-mod", "ngram-simple", "ngram-map-k4v", "ngram-map-k"])
    assert [s.name for s in srcs] == ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod"]
    assert isinstance(srcs[0], NgramSimple) and isinstance(srcs[1], NgramMap) and isinstance(srcs[3], NgramMod)
    assert srcs[1].key_only and not srcs[2].key_only
    assert [s.name for s in ngram_sources(["ngram-cache", "ngram-simple"])] == ["ngram-simple", "ngram-cache"]


def test_a_key_whose_draft_was_refused_at_once_drafts_no_more():
    """ngram-map-k limits a key's next draft to what was accepted of its last one: 0 accepted, no more drafts."""
    m = NgramMap(2, 3, key_only=True)
    hist = [1, 2, 3, 4, 5, 9, 9, 9, 9, 1, 2, 3, 4, 5, 8, 8, 8, 8, 1]
    m.begin(hist)
    d = m.draft(hist, 2)
    assert d == [3, 4, 5]
    m.accept(0, False)
    assert m.draft(hist + [2, 7, 7, 1], 2) == []


def test_a_context_shift_starts_the_sources_over():
    chain = NgramChain(ngram_sources(["ngram-simple", "ngram-map-k"], simple=(2, 3), map_k=(2, 3)))
    hist = [5, 6, 7, 8, 9] * 6
    chain.begin(hist[:-1])
    assert chain.propose(hist, 3)[0] == [5, 6, 7]
    chain.rollback(len(hist) + 3)
    chain.shift(4, 10)
    shifted = hist[:4] + hist[14:]
    assert chain.propose(shifted, 3)[0] == [5, 6, 7]  # (no stale positions read)


def test_ngram_mod_grades_itself_on_the_proposals_verified():
    """The chain verifies k of ngram-mod's drafts (sharpi's adaptation asks for fewer than its 48-64): its
    accepted fraction is of those k, so five fully accepted steps of 4 do not reset its table (4 of 64 < 1/4)."""
    mod = NgramMod(n_match=2, n_min=8, n_max=64)
    chain = NgramChain([mod])
    hist = list(range(40)) * 3
    chain.begin(hist[:-1])
    props, _ = chain.propose(hist, 4)
    assert len(props) == 4 and mod.n_draft_last == 4
    used = mod.used
    for _ in range(6):
        mod.accept(4, False)
    assert mod.used == used and mod.n_low == 0


# -- through the CLI -----------------------------------------------------------------------------------------------
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\ndef div(a, b):\n"


@pytest.fixture(scope="module")
def plain(smol):
    r = sharpi("-m", smol, "-p", CODE, "-n", 120, "--temp", 0, "-no-cnv", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("flags", [
    ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", 3, "--spec-ngram-simple-size-m", 8),
    ("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", 3),
    ("--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-n", 2, "--spec-ngram-map-k4v-size-m", 6),
    ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", 4, "--spec-ngram-mod-n-min", 1),
    ("--spec-type", "ngram-mod,ngram-simple", "--spec-type", "ngram-map-k", "--spec-ngram-simple-size-n", 4,
     "--spec-ngram-simple-size-m", 6, "--spec-ngram-map-k-size-n", 2, "--spec-ngram-mod-n-match", 3,
     "--spec-ngram-mod-n-min", 2),
])
def test_greedy_speculation_with_them_is_plain_greedy(smol, plain, flags):
    r = sharpi("-m", smol, "-p", CODE, "-n", 120, "--temp", 0, "-no-cnv", "--ignore-eos", "--json", *flags)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["tokens"] == plain["tokens"]
    spec = d["speculative"]
    assert spec["accepted"] > 20 and spec["tokens_per_pass"] > 1.2, spec  # (they drafted, and well, on this text)
    names = [t for f in flags if isinstance(f, str) and f.startswith("ngram") for t in f.split(",")]
    assert set(spec["sources"]) <= set(names) and spec["sources"], spec["sources"]


def test_ngram_cache_drafts_what_the_prompt_holds(smol):
    """ngram-cache learns n-grams from the prompt (and the chunks of accepted drafts: a plain step's one new token
    holds none, as in llama.cpp): on a copy request it drafts the copy."""
    text = "The committee met on Tuesday to review the budget and agreed to fund the new library on Main Street."
    prompt = f"Copy the text exactly.\n\nText: {text}\n\nCopy: {text}\n\nCopy:"
    runs = [sharpi("-m", smol, "-p", prompt, "-n", 40, "--temp", 0, "-no-cnv", "--ignore-eos", "--json", *flags)
            for flags in ((), ("--spec-type", "ngram-cache"))]
    assert all(r.returncode == 0 for r in runs), runs[1].stderr
    plain, spec = (json.loads(r.stdout) for r in runs)
    assert spec["tokens"] == plain["tokens"]
    assert spec["speculative"]["accepted"] > 10 and spec["speculative"]["sources"].keys() == {"ngram-cache"}


def test_a_draft_model_behind_them_proposes_where_they_do_not(smol, plain):
    r = sharpi("-m", smol, "-p", CODE, "-n", 120, "--temp", 0, "-no-cnv", "--ignore-eos", "--json",
               "--spec-type", "ngram-simple,draft-simple", "-md", smol, "--spec-ngram-simple-size-n", 4,
               "--spec-ngram-simple-size-m", 6, "--spec-draft-n-max", 3)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["tokens"] == plain["tokens"]
    src = d["speculative"]["sources"]
    assert src["ngram-simple"]["drafted"] > 0 and src["draft"]["drafted"] > 0, src
    assert src["draft"]["accepted"] == src["draft"]["drafted"]  # (the target drafting for itself)


def test_sampled_speculation_with_them_runs(smol):
    r = sharpi("-m", smol, "-p", CODE, "-n", 60, "--temp", 0.8, "-s", 3, "-no-cnv", "--json", "--spec-type",
               "ngram-simple", "--spec-ngram-simple-size-n", 3)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"]


@pytest.mark.parametrize("args,fragment", [
    (("--spec-type", "ngram-foo"), "invalid --spec-type 'ngram-foo'"),
    (("--spec-type", "draft-dflash"), "--spec-type draft-dflash is not supported"),
    (("--spec-type", "draft-eagle3"), "--spec-type draft-eagle3 is not supported"),
    (("--spec-type", "draft-simple"), "give it with -md"),
    (("--spec-type", "ngram-simple", "--draft-lookup"), "pick one"),
    (("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", 0), "--spec-ngram-simple-size-n 0"),
    (("--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", 1025), "--spec-ngram-mod-n-max 1025"),
    (("--spec-ngram-map-k4v-min-hits", 0), "--spec-ngram-map-k4v-min-hits 0"),
])
def test_bad_flags_one_error_line(smol, args, fragment):
    one_error_line(sharpi("-m", smol, "-p", "hi", *args), 2, fragment)


def test_none_turns_them_off(smol):
    r = sharpi("-m", smol, "-p", "hi", "-n", 4, "--temp", 0, "--json", "--spec-type", "ngram-simple,none")
    assert r.returncode == 0, r.stderr
    assert "speculative" not in json.loads(r.stdout) or not json.loads(r.stdout)["speculative"]


def test_a_step_of_forced_tokens_teaches_the_sources_nothing():
    """Only a verified proposal of the chain's own is a verdict: after a step that fed tokens a constraint forced
    (a reasoning budget's), its last proposal (a shadow a plain step followed) is not judged."""
    chain = NgramChain(ngram_sources(["ngram-map-k"], map_k=(2, 3)))
    hist = [1, 2, 3, 4, 5, 9, 9, 9, 9, 1, 2, 3, 4, 5, 8, 8, 8, 8, 1, 2]
    chain.begin(hist[:-1])
    assert chain.propose(hist, 3)[0] == [3, 4, 5]
    chain.forced()
    chain.rollback(len(hist))  # (as if none of it were kept)
    src = chain.sources[0]
    assert src.keys[src.last_key].values[0].n_accepted == 3
    assert chain.propose(hist, 3)[0] == [3, 4, 5]
    chain.rollback(len(hist))  # (a verdict: none kept; the key drafts no more)
    assert src.keys[src.last_key].values[0].n_accepted == 0


def test_spec_type_from_the_environment_goes_with_md(smol, plain):
    """SHARPI_ARG_SPEC_TYPE with -md on the command line: n-gram types are kept beside the draft model (only
    draft-mtp, which excludes -md, gives way to the command line's -md)."""
    args = ("-m", smol, "-p", CODE, "-n", 120, "--temp", 0, "-no-cnv", "--ignore-eos", "--json", "-md", smol,
            "--spec-ngram-simple-size-n", 4, "--spec-ngram-simple-size-m", 6, "--spec-draft-n-max", 3)
    r = sharpi(*args, env={"SHARPI_ARG_SPEC_TYPE": "ngram-simple,draft-simple"})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["tokens"] == plain["tokens"] and d["speculative"]["sources"]["ngram-simple"]["drafted"] > 0
    r = sharpi(*args, env={"SHARPI_ARG_SPEC_TYPE": "draft-mtp"})
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)["speculative"]
    # (the draft model, with prompt lookup beside it as by default; no MTP head)
    assert spec["drafted"] > 0 and spec["sources"].keys() == {"draft", "lookup"}
