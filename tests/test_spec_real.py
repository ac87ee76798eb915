"""Speculative decoding on real models: greedy output is token-for-token the plain greedy output."""
from __future__ import annotations

import pytest
import torch

from conftest import FIXTURES_DIR, QWEN05, QWEN15, SMOL, loaded, model_path
from sharpi_core.generate import Generator
from sharpi_core.sampling import SamplingParams
from sharpi_core.speculative import DraftModelDrafter, LookupDrafter

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
