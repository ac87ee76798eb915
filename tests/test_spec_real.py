"""Speculative decoding on real models: greedy output is token-for-token the plain greedy output, and sampled
output is a sample of the target's law (its filtered distributions, step by step)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from conftest import FIXTURES_DIR, QWEN05, QWEN15, SMOL, loaded, model_path
from sharpi_core.generate import Generator
from sharpi_core.sampling import SamplingParams, apply_penalties, filtered_probs
from sharpi_core.speculative import DraftModelDrafter, LookupDrafter
from toy import chi2_sf

GREEDY = SamplingParams(temp=0.0)
ECHO = ("Repeat the list exactly.\nList: apples, bananas, cherries, dates, elderberries, figs, grapes.\n"
        "Repeated list: apples, bananas, cherries, dates, elderberries, figs, grapes.\nRepeated list:")


def run(model, tok, prompt, n, drafter=None, k=4, params=GREEDY, seed=0, kv="f16"):
    g = Generator(model, model.new_cache(1024, kv, kv), tok, params, seed=seed, drafter=drafter, spec_n_max=k)
    return g.generate(tok.encode(prompt), n_predict=n)


@pytest.mark.parametrize("prompt,kv", [(ECHO, "f16"), ("The capital of France is", "f16"), (ECHO, "q8_0")])
def test_lookup_greedy_parity_smollm(prompt, kv):
    # q8_0: the rotated, quantized cache path must be as row-exact as the f16 one
    model, tok = loaded(SMOL)
    plain = run(model, tok, prompt, 48, kv=kv)
    spec = run(model, tok, prompt, 48, LookupDrafter(3, 2), kv=kv)
    assert spec.tokens == plain.tokens
    if prompt is ECHO:  # the echo prompt must actually exercise acceptance
        assert spec.spec.accepted > 0 and spec.spec.target_passes < len(spec.tokens)


def test_typical_at_temp_0_is_the_best_survivor_and_speculation_keeps_it():
    """llama.cpp's temperature 0 keeps the best of what typical leaves (its llama-completion output here
    is " Paris.\n\nIn other words, the sentence \"The", the survivor test being the oracle cases of
    test_samplers_llamacpp): not the arg-max, and deterministic, so speculation gives it token for token."""
    model, tok = loaded(SMOL)
    typ = SamplingParams(temp=0.0, typical_p=0.5)
    assert not typ.greedy
    plain = run(model, tok, "The capital of France is", 12)
    out = run(model, tok, "The capital of France is", 12, params=typ, seed=1)
    assert tok.decode(out.tokens) == ' Paris.\n\nIn other words, the sentence "The'  # (llama-completion's)
    assert out.tokens != plain.tokens
    assert run(model, tok, "The capital of France is", 12, params=typ, seed=2).tokens == out.tokens
    drafter = DraftModelDrafter(model, model.new_cache(1024), typ, torch.Generator().manual_seed(4))
    spec = run(model, tok, "The capital of France is", 12, drafter, params=typ, seed=3)
    assert spec.tokens == out.tokens and spec.spec.accepted > 0


def test_batch_verify_switch_gives_identical_output(monkeypatch):
    model, tok = loaded(SMOL)
    a = run(model, tok, ECHO, 32, LookupDrafter(3, 2), params=SamplingParams(temp=0.8), seed=3)
    monkeypatch.setenv("SHARPI_SPEC_BATCH_VERIFY", "0")
    b = run(model, tok, ECHO, 32, LookupDrafter(3, 2), params=SamplingParams(temp=0.8), seed=3)
    assert a.tokens == b.tokens
    # (both speculated: the switch changes how proposals are verified, not whether they are)
    for r in (a, b):
        assert r.spec.verify_passes > 0 and r.spec.accepted > 0


def test_draft_equal_to_target_accepts_everything():
    model, tok = loaded(SMOL)
    d = DraftModelDrafter(model, model.new_cache(1024), GREEDY)
    r = run(model, tok, "Once upon a time", 24, d, k=4)
    assert r.spec.drafted > 0 and r.spec.accepted == r.spec.drafted
    assert r.tokens == run(model, tok, "Once upon a time", 24).tokens


@pytest.mark.parametrize("flash_attn", [True, False], ids=["fa", "no-fa"])
def test_verify_rows_equal_one_token_passes_past_256_positions(flash_attn):
    # past 256 positions llama.cpp's padded KV length is 512 and its flash attention splits the KV range
    # of a one-token pass in two: verify rows must still be bit for bit one-token passes
    model, tok = loaded(SMOL)
    ids = tok.encode((FIXTURES_DIR / "apache-2.0.txt").read_text())[:300]
    prev, model.flash_attn = model.flash_attn, flash_attn
    try:
        a, b = model.new_cache(1024), model.new_cache(1024)
        model.forward(torch.tensor(ids[:-5]), 0, a)
        model.forward(torch.tensor(ids[:-5]), 0, b)
        rows = model.forward(torch.tensor(ids[-5:]), 295, a, decode=True)
        ones = torch.cat([model.forward(torch.tensor([t]), 295 + i, b) for i, t in enumerate(ids[-5:])])
    finally:
        model.flash_attn = prev
    assert torch.equal(rows, ones)


def test_a_proposal_longer_than_an_exact_pass_is_verified_in_exact_passes(monkeypatch):
    """A pass of more than EXACT_ROWS rows sums Q4_K products in the prompt's order (on Qwen 0.5B up to 0.4 off
    in a logit, which changed greedy output at --spec-draft-n-max 48): the generator verifies a longer
    proposal in passes of at most EXACT_ROWS rows, so each row is still a one-token pass's bits."""
    from sharpi_core.models.transformer import EXACT_ROWS
    model, tok = loaded(QWEN05)
    ids = tok.encode((FIXTURES_DIR / "apache-2.0.txt").read_text())[:140]
    cut, n = 100, EXACT_ROWS + 8
    g = Generator(model, model.new_cache(256), tok, GREEDY)
    model.forward(torch.tensor(ids[:cut]), 0, g.cache)
    g.history = list(ids[:cut])
    passes = []
    forward = g._forward
    monkeypatch.setattr(g, "_forward", lambda t, start, **kw: passes.append(len(t)) or forward(t, start, **kw))
    rows = g._forward_rows(ids[cut:cut + n])
    assert passes == [EXACT_ROWS, 8]
    one = model.new_cache(256)
    model.forward(torch.tensor(ids[:cut]), 0, one)
    ones = torch.cat([model.forward(torch.tensor([t]), cut + i, one) for i, t in enumerate(ids[cut:cut + n])])
    assert torch.equal(rows, ones)
    whole = model.new_cache(256)  # (what one pass of them all gives: not those bits, or this test proves nothing)
    model.forward(torch.tensor(ids[:cut]), 0, whole)
    assert not torch.equal(model.forward(torch.tensor(ids[cut:cut + n]), cut, whole, decode=True), ones)


def test_cut_output_layer_is_the_full_layers_first_columns():
    # --spec-draft-vocab: forward(n_out=N) gives, bit for bit, the first N logits of the full layer
    model, tok = loaded(SMOL)
    ids = torch.tensor(tok.encode("The capital of France is"))
    full = model.forward(ids, 0, model.new_cache(64))
    cut = model.forward(ids, 0, model.new_cache(64), n_out=1000)
    assert cut.shape == (len(ids), 1000) and torch.equal(cut, full[:, :1000])
    one = model.forward(ids[:1], 0, model.new_cache(64), decode=True, n_out=4097)
    assert torch.equal(one, full[:1, :4097])


@pytest.mark.slow
def test_qwen_draft_model_greedy_parity():
    target, tok = loaded(QWEN15)
    from sharpi_core.models import load_model
    draft = load_model(model_path(QWEN05))
    prompt = "def quicksort(arr):\n"
    plain = run(target, tok, prompt, 40)
    spec = run(target, tok, prompt, 40, DraftModelDrafter(draft, draft.new_cache(1024), GREEDY), k=4)
    assert spec.tokens == plain.tokens
    assert spec.spec.accepted > 0
    # the draft's output layer cut to the default 64k ids (what the CLI uses for this vocabulary)
    from sharpi_core.engine import DRAFT_HEAD_VOCAB
    cut = run(target, tok, prompt, 40, DraftModelDrafter(draft, draft.new_cache(1024), GREEDY,
                                                         head_vocab=DRAFT_HEAD_VOCAB), k=4)
    assert cut.tokens == plain.tokens and cut.spec.accepted > 0


def test_verify_rows_are_decoding_rows_without_the_c_kernels(monkeypatch):
    """SHARPI_CPU_KERNEL=0 (torch's matmuls, what a machine without gcc / AVX2 runs): a verify pass's rows
    are bit for bit one-token passes' rows, so greedy self-speculation accepts every proposal and gives
    plain decoding's tokens (torch's matmul of T rows sums in another order than its one-row matmul)."""
    from sharpi_core.gguf_file import GGUFFile
    from sharpi_core.models import load_model
    monkeypatch.setenv("SHARPI_CPU_KERNEL", "0")
    model = load_model(GGUFFile(model_path(SMOL)))
    assert model.output._kern is None
    tok = loaded(SMOL)[1]
    ids = tok.encode(ECHO)
    cache = model.new_cache(256)
    model.forward(ids[:20], 0, cache)
    rows = model.forward(ids[20:28], 20, cache, decode=True)  # [8, V]
    cache.truncate(20)
    assert torch.equal(rows, torch.cat([model.forward(ids[i:i + 1], i, cache) for i in range(20, 28)]))
    prompt = "The history of the Roman empire is"
    plain = run(model, tok, prompt, 40)
    spec = run(model, tok, prompt, 40, DraftModelDrafter(model, model.new_cache(1024), GREEDY), k=8)
    assert spec.tokens == plain.tokens and spec.spec.accepted == spec.spec.drafted > 0


# -- sampled speculation on the real pair: the emitted tokens are a sample of the target ------------------------------
# The CLI's own path (-md puts prompt lookup beside the draft model; the draft's cut output layer, its unsure-token stop,
# the count by cost, penalties over prompt and output), 2 requests of 400 tokens at temp 1. Each emitted token is
# scored against the target's filtered law at its step, computed again here with the passes the generator made (the
# prompt in one pass, then decoding rows: the same bits, so a token outside the law is an outright failure). Under an
# exact sample, for any f_t fixed by the history, sum_t f_t(x_t) - E_p[f_t] is a martingale, over many steps normal
# with variance sum_t Var_p[f_t]: f = log p (a lean toward likely or unlikely tokens) and f = min(1, q / p), q the
# draft's law (the chance that the draft's proposal of x is accepted: a lean toward the draft's tokens).
# Measured power of the second: a residual drawn from p instead of max(0, p - q) gave z 3.2 and 2.5 over these 800
# tokens (two seeds; 5.5 and 2.9 over four requests of 200), a subtle slip that the toy models' longer runs catch surely;
# every proposal accepted (the draft's own sample), 5 tokens out of 200 outside the law. Without a slip, |z| <= 2.3 in
# 10 runs (seeds, samplers: typical, top-n-sigma, presence / frequency penalties, n-max 16, -ctk q8_0, the draft alone).
LAW_FLAGS = ("--temp", "1", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.05", "--repeat-penalty", "1.1",
             "--ignore-eos", "-c", "1024", "--json")
LAW_PROMPTS = ("def parse_config(path):\n",
               "Write a short story about a lighthouse keeper who finds a message in a bottle.\n")


def law_params(tok) -> SamplingParams:
    """LAW_FLAGS' sampler (--ignore-eos: a -inf bias on the end-of-generation tokens)."""
    return SamplingParams(temp=1.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1,
                          logit_bias=tuple((t, float("-inf")) for t in sorted(tok.eog_ids)))


def sampled_runs(seed: int, prompts=LAW_PROMPTS, n: int = 400) -> list[tuple[str, list[int]]]:
    from test_cli import sharpi
    runs = []
    for i, text in enumerate(prompts):
        r = sharpi("-m", model_path(QWEN15), "-md", model_path(QWEN05), *LAW_FLAGS, "-n", n, "-s", seed + i, "-p", text)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["speculative"]["accepted"] > 0 and len(out["tokens"]) == n
        runs.append((text, out["tokens"]))
    return runs


def _laws(model, params: SamplingParams, seq: list[int], n_prompt: int, exact: bool):
    """The filtered law [V] after seq[:a+1], a = n_prompt-1 .. len(seq)-2: a prompt pass, then passes of decoding rows
    (exact: the generator's bits) or one prompt-order pass (the draft: any function of the history serves)."""
    cache = model.new_cache(1024)
    rows = model.forward(torch.tensor(seq[:n_prompt]), 0, cache, last_n=1)
    a, i = n_prompt - 1, n_prompt
    while True:
        for row in rows:
            if a + 1 >= len(seq):
                return
            yield filtered_probs(apply_penalties(row, seq[:a + 1], params), params).double().numpy()
            a += 1
        step = 32 if exact else len(seq)
        rows = model.forward(torch.tensor(seq[i:i + step]), i, cache, decode=exact)
        i += step


def law_scores(runs) -> tuple[int, float, float]:
    """(emitted tokens outside the target's law, z of log p, z of min(1, q / p)) over the runs' tokens."""
    target, tok = loaded(QWEN15)
    draft, _ = loaded(QWEN05)
    params = law_params(tok)
    outside, sums = 0, np.zeros(4)  # sum of f(x) - E_p[f], its variance: f = log p, then f = min(1, q / p)
    for text, tokens in runs:
        prompt = tok.encode(text)
        seq = prompt + tokens
        for x, p, q in zip(tokens, _laws(target, params, seq, len(prompt), True),
                                _laws(draft, params, seq, len(prompt), False)):
            if p[x] == 0:
                outside += 1
                continue
            on = p > 0
            lp = np.log(p[on])
            e = (p[on] * lp).sum()
            f = np.zeros_like(p)
            n = min(len(p), len(q))
            f[:n] = np.minimum(q[:n], p[:n]) / np.where(on[:n], p[:n], 1.0)
            ef = (p * f).sum()
            sums += (math.log(p[x]) - e, (p[on] * lp * lp).sum() - e * e, f[x] - ef, (p * f * f).sum() - ef * ef)
    return outside, sums[0] / math.sqrt(sums[1]), sums[2] / math.sqrt(sums[3])


@pytest.mark.slow
def test_sampled_speculation_on_the_real_pair_is_a_sample_of_the_target():
    outside, z_logp, z_accept = law_scores(sampled_runs(seed=11))
    assert outside == 0
    # (two-sided normal p-values: a z squared is chi-square with one degree of freedom)
    assert chi2_sf(z_logp ** 2, 1) > 1e-3 and chi2_sf(z_accept ** 2, 1) > 1e-3, (z_logp, z_accept)


@pytest.mark.slow
def test_the_law_test_finds_the_drafts_law(monkeypatch):
    """Every proposal accepted (the output is then the draft's sample): tokens outside the target's law come out."""
    import sharpi_core.generate as generate_mod
    from sharpi_core.sampling import draw
    monkeypatch.setattr(generate_mod, "accept_sampled", lambda d, q, p, g, p_min=0.0: (len(d), draw(p[len(d)], g)))
    outside, z_logp, _ = law_scores(sampled_runs(seed=11, prompts=LAW_PROMPTS[:1], n=200))
    assert outside > 0
