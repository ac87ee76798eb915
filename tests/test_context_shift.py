"""--context-shift: llama.cpp's K-shift bit for bit, speculation and sampling through shifts, the CLI.

The oracle (tests/data/llamacpp_context_shift.json, scripts/llamacpp_context_shift.py) is libllama
decoding greedily through context shifts with its cells kept in position order, as sharpi keeps them.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import cuda_fake
from conftest import SMOL, loaded, model_path
from sharpi_core.backends.cuda import cuda_available
from sharpi_core.backends.cuda_model import CudaTransformer, SplitTransformer
from sharpi_core.generate import Generator
from sharpi_core.kv_cache import KVCache
from sharpi_core.quants import q8_0_blocks
from sharpi_core.sampling import SamplingParams, apply_penalties, filtered_probs
from sharpi_core.speculative import DraftModelDrafter, HybridDrafter, LookupDrafter
from test_cli import one_error_line, sharpi
from test_cuda_model import KINDS, on
from test_generate import GREEDY_PEN, V, drafter_for, martingale_test, target_model
from toy import ToyTokenizer

CASES = json.loads((Path(__file__).parent / "data" / "llamacpp_context_shift.json").read_text())["cases"]
GREEDY = SamplingParams(temp=0)
HAVE_CUDA, WHY_NO_CUDA = cuda_available()


def case_param(c: dict):
    short = "-".join(c["model"].split("-")[:2])
    return pytest.param(c, id=f"{short}-keep{c['keep']}-{c['cache_type']}",
                        marks=() if c["model"] == SMOL else (pytest.mark.slow,))


def shift_points(n_prompt: int, n_gen: int, n_ctx: int, n_keep: int) -> int:
    """How many shifts llama-completion's rule makes while feeding n_gen - 1 generated tokens."""
    n, shifts = n_prompt, 0
    for _ in range(n_gen - 1):
        if n + 1 >= n_ctx:
            n -= (n - n_keep) // 2
            shifts += 1
        n += 1
    return shifts


def run_greedy(model, tok, case: dict, drafter=None):
    kv = case["cache_type"]
    gen = Generator(model, model.new_cache(case["n_ctx"], kv, kv), tok, GREEDY, drafter=drafter, spec_n_max=4,
                    context_shift=True, n_keep=case["keep"])
    return gen, gen.generate(case["prompt_ids"], n_predict=len(case["tokens"]))


@pytest.mark.parametrize("case", [case_param(c) for c in CASES])
def test_greedy_through_context_shifts_is_llama_cpps(case):
    """Every logit equals libllama's through the shifts (the K-shift is ggml's rope by -n_discard on the
    cache's rounded K, f16 and q8_0 with its Hadamard rotation; Gemma's two rope bases), so the whole
    greedy path is llama.cpp's token for token."""
    model, tok = loaded(case["model"])
    assert tok.encode(case["prompt"]) == case["prompt_ids"]
    gen, res = run_greedy(model, tok, case)
    assert gen._kept == case["n_keep"]  # llama-completion's --keep rule (BOS, -1 = the prompt)
    assert res.context_shifts == shift_points(len(case["prompt_ids"]), len(case["tokens"]), case["n_ctx"],
                                              case["n_keep"]) >= 2
    assert res.tokens == case["tokens"]


@pytest.mark.parametrize("kind", ["lookup", "self-draft", "lookup+self-draft"])
def test_speculation_through_context_shifts_gives_the_plain_tokens(kind):
    """Proposals never cross a shift point (the verify pass must leave the last slot free), so the shifts
    happen where plain decoding's do; the draft model's cache shifts alike: a draft that is the target
    itself then computes the target's logits bit for bit and every proposal is accepted."""
    case = CASES[0]
    model, tok = loaded(case["model"])
    drafter = (LookupDrafter(3, 2) if kind == "lookup" else
               DraftModelDrafter(model, model.new_cache(case["n_ctx"]), GREEDY))
    if kind == "lookup+self-draft":  # (the model's cache shifts at steps lookup takes too)
        drafter = HybridDrafter(LookupDrafter(3, 2), drafter, 4, cost=0.3)
    gen, res = run_greedy(model, tok, case, drafter)
    assert res.tokens == case["tokens"] and res.context_shifts >= 2
    s = res.spec
    assert s.verify_passes > 20
    if kind == "self-draft":
        assert s.accepted == s.drafted
    if kind != "lookup":
        assert drafter.history == gen.history[: len(drafter.history)]
    if kind == "lookup+self-draft":
        assert s.sources["draft"]["accepted"] == s.sources["draft"]["drafted"] > 0 and s.sources["lookup"]["steps"] > 0


@pytest.mark.parametrize("kv", ["f32", "f16", "q8_0", "bf16", "q4_0", "iq4_nl", "q5_1"])
def test_cache_shift_moves_v_and_rerotates_k(kv, monkeypatch):
    model, tok = loaded(SMOL)
    monkeypatch.setattr(model, "flash_attn", False)  # (with flash attention an f32 cache is held in f16)
    ids = tok.encode("The history of the Roman Empire is long and full of wars, emperors and senators who")
    cache = model.new_cache(64, kv, kv)
    assert cache.k.kind == kv
    model.forward(torch.tensor(ids), 0, cache)
    L, keep, d = cache.length, 3, 5
    before = {k: a.clone() for k, a in cache.arrays(L).items()}
    old_k = [cache.k.read(i, L).clone() for i in range(model.config.n_layer)]
    model.shift_cache(cache, keep, d)
    assert cache.length == L - d
    after = cache.arrays(L - d)
    for name in after:
        assert torch.equal(after[name][:, :keep], before[name][:, :keep])  # the kept positions are untouched
        if name.startswith("v"):
            assert torch.equal(after[name][:, keep:], before[name][:, keep + d:])
    ref = KVCache(model.config.n_layer, 64, model.config.n_head_kv, model.config.head_dim_k, model.config.head_dim_v, kv, kv)
    for i in range(model.config.n_layer):  # K: shift_k of the stored rows, stored again in the cache's type
        ref.k.write(i, 0, model.shift_k(i, old_k[i][keep + d:], -d, cache.rot_k))
    assert torch.equal(cache.arrays(L - d)["k"][:, keep:], ref.arrays(L - keep - d)["k"])
    # and what it means: layer 0's K (which depends on its token only) as if computed at the new positions
    fresh = model.new_cache(64, kv, kv)
    model.forward(torch.tensor(ids[:keep] + ids[keep + d:]), 0, fresh)
    a, b = cache.k.read(0, L - d), fresh.k.read(0, L - d)
    step = {"f32": 1e-4, "f16": 4e-3, "q8_0": 0.05, "bf16": 0.01, "q4_0": 0.25, "iq4_nl": 0.25, "q5_1": 0.1}[kv]
    assert (a - b).abs().max() <= step * b.abs().max()  # (about a rounding step of the type)
    with pytest.raises(ValueError):
        model.shift_cache(cache, L - d - 1, 2)


@pytest.mark.parametrize("kind", ["fake", pytest.param("cuda", marks=pytest.mark.skipif(not HAVE_CUDA, reason=f"no GPU: {WHY_NO_CUDA}"))])
@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_gpu_cache_shift_is_the_cpu_caches(kind, kv):
    """The GPU caches (whole and split -ngl models) shift as the CPU cache does, byte for byte, with the
    model's layer numbers (a split's GPU layer j is layer n_cpu + j)."""
    model, tok = loaded(SMOL)
    ops = cuda_fake if kind == "fake" else None
    ids = tok.encode("The history of the Roman Empire is long and full of wars")
    cpu = model.new_cache(64, kv, kv)
    model.forward(torch.tensor(ids), 0, cpu)
    L = cpu.length
    for gm in (CudaTransformer(model, ops=ops), SplitTransformer(model, 10, ops=ops)):
        cache = gm.new_cache(64, kv, kv)
        gpu, dev_ops = getattr(cache, "gpu", cache), getattr(gm, "gpu", gm).ops
        first = model.config.n_layer - len(gpu.k)
        if gpu is not cache:
            cache.cpu.put_arrays({n: a[:first] for n, a in cpu.arrays(L).items()}, L)
        for j in range(len(gpu.k)):  # the CPU cache's bytes in the GPU layout
            for name, dev in (("k", gpu.k[j]), ("v", gpu.v[j])):
                store = getattr(cpu, name)
                host = (store.q[first + j, :L].numpy() if kv == "f16" else
                        q8_0_blocks(store.read(first + j, L).numpy()))
                dev_ops.upload(dev[:L], host)
        gpu.length = L
        gm.shift_cache(cache, 2, 7)
        ref = model.new_cache(64, kv, kv)
        ref.put_arrays({n: a.clone() for n, a in cpu.arrays(L).items()}, L)
        model.shift_cache(ref, 2, 7)
        assert cache.length == ref.length == L - 7
        for j in range(len(gpu.k)):
            for name, dev in (("k", gpu.k[j]), ("v", gpu.v[j])):
                got = dev_ops.to_host(dev[:L - 7])
                store = getattr(ref, name)
                want = store.q[first + j, :L - 7].numpy() if kv == "f16" else q8_0_blocks(store.read(first + j, L - 7).numpy())
                assert np.array_equal(got, want), (type(gm).__name__, name, j)
        if gpu is not cache:
            for name, a in ref.arrays(L - 7).items():
                assert torch.equal(cache.cpu.arrays(L - 7)[name], a[:first])


# -- the generator on the toy model: exact sampling, penalties' memory, -n -2, reuse ---------------------
TOY_PROMPT = [0, 1, 2, 3, 4, 5, 1, 2, 3, 6]
TOY_CTX = 24
# penalties looking back 40 tokens: past what a shift leaves of this 24-token context
LONG_PEN = SamplingParams(temp=0.9, top_k=6, top_p=0.95, min_p=0.03, repeat_penalty=1.2, repeat_last_n=40,
                          frequency_penalty=0.3, presence_penalty=0.1, logit_bias=((1, 0.3),))


def toy_gen(params, kind=None, n_keep=2, n_ctx=TOY_CTX, seed=1, n_max=3):
    model = target_model()
    drafter = drafter_for(kind, params, target_model(), n_ctx=n_ctx, seed=seed + 1) if kind else None
    return Generator(model, model.new_cache(n_ctx), ToyTokenizer(V), params, seed=seed, drafter=drafter,
                     spec_n_max=n_max, context_shift=True, n_keep=n_keep)


def plain_law_steps(params, prompt, tokens, n_keep, n_ctx=TOY_CTX):
    """(previous token, token, its law) along `tokens`, replaying plain decoding with shifts: the model's
    logits from a cache shifted at the same points, penalties over every token so far (llama.cpp's
    samplers remember the tokens a shift took out of the cache)."""
    model = target_model()
    cache = model.new_cache(n_ctx)
    logits = model.forward(torch.tensor(prompt), 0, cache)[-1]
    ctx, steps = list(prompt), []
    for t in tokens:
        p = filtered_probs(apply_penalties(logits, ctx, params), params).numpy().astype(np.float64)
        steps.append((ctx[-1], t, p))
        ctx.append(t)
        if cache.length + 1 >= n_ctx:
            model.shift_cache(cache, n_keep, (cache.length - n_keep) // 2)
        logits = model.forward(torch.tensor([t]), cache.length, cache)[-1]
    return steps


@pytest.mark.parametrize("kind", [None, "model", "lookup", "same"])
def test_greedy_speculation_through_shifts_on_the_toy(kind):
    want = toy_gen(GREEDY_PEN).generate(TOY_PROMPT, n_predict=300)
    got = toy_gen(GREEDY_PEN, kind).generate(TOY_PROMPT, n_predict=300)
    assert want.context_shifts > 20 and got.context_shifts == want.context_shifts
    assert got.tokens == want.tokens


@pytest.mark.parametrize("kind", [None, "model", "lookup"])
def test_sampling_through_shifts_follows_the_target(kind):
    """An exact sample of plain decoding with shifts, penalties looking back past the dropped tokens."""
    gen = toy_gen(LONG_PEN, kind, seed=41)
    res = gen.generate(TOY_PROMPT, n_predict=3000)
    assert res.context_shifts > 200
    if kind:
        assert res.spec.verify_passes > 300 and 0 < res.spec.accepted < res.spec.drafted
    assert martingale_test(plain_law_steps(LONG_PEN, TOY_PROMPT, res.tokens, n_keep=2)) > 0.001


@pytest.mark.parametrize("params,most", [(GREEDY, 0), (LONG_PEN, 40)], ids=["no window", "40 back"])
def test_dropped_tokens_are_kept_only_as_far_as_the_penalties_look(params, most):
    # an endless generation with shifts stays flat: the tokens shifts dropped are kept for the penalties' window only
    gen = toy_gen(params)
    res = gen.generate(TOY_PROMPT, n_predict=2000)
    assert res.context_shifts > 150 and len(gen._dropped) == most and gen._n_dropped > 1000


def test_penalties_forgetting_the_dropped_tokens_fail_that_test(monkeypatch):
    monkeypatch.setattr(Generator, "_past", lambda self: self.history)
    res = toy_gen(LONG_PEN, "model", seed=42).generate(TOY_PROMPT, n_predict=3000)
    assert martingale_test(plain_law_steps(LONG_PEN, TOY_PROMPT, res.tokens, n_keep=2)) < 1e-6


def test_keep_rule_stop_at_full_context_and_reuse():
    gen = toy_gen(GREEDY, n_keep=0)
    gen.tok.add_bos = True
    assert gen.keep_count(10, 64) == 1  # the BOS
    gen.n_keep = 9
    assert [gen.keep_count(10, 64), gen.keep_count(10, 12)] == [10, 8]  # 9 and the BOS; at most n_ctx - 4
    gen.n_keep = -1
    assert [gen.keep_count(10, 64), gen.keep_count(3, 64)] == [10, 3]
    gen.n_keep = 50
    assert gen.keep_count(10, 64) == 10  # more than the prompt: all of it
    # -n -2 stops where the context is full, with --context-shift too
    gen = toy_gen(GREEDY)
    res = gen.generate(TOY_PROMPT, n_predict=-2)
    assert res.stop_reason == "ctx_full" and res.context_shifts == 0 and len(gen.history) == TOY_CTX - 1
    # after a shift only the kept positions are reused: the later ones were computed with dropped tokens
    res = gen.generate(TOY_PROMPT, n_predict=40)
    assert res.context_shifts > 0 and gen.exact_prefix == 2
    again = gen.generate(TOY_PROMPT + res.tokens[:5], n_predict=1)
    assert again.timings.prompt_n == len(TOY_PROMPT) + 5 - 2
    assert gen.exact_prefix == len(gen.history)
    # a context too small to drop anything stops
    assert toy_gen(GREEDY, n_ctx=3, n_keep=0).generate([1, 2], n_predict=10).context_shifts > 0
    assert toy_gen(GREEDY, n_ctx=2, n_keep=0).generate([1], n_predict=10).stop_reason == "ctx_full"


# -- the CLI --------------------------------------------------------------------------------------------
def test_cli_context_shift(tmp_path):
    smol = str(model_path(SMOL))
    case = CASES[0]
    run = ("-m", smol, "-p", case["prompt"], "-c", case["n_ctx"], "--temp", 0, "--json")
    r = sharpi(*run, "-n", 300, "--context-shift")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["tokens"] == case["tokens"][:300] and d["context_shifts"] == 1 and d["stop_reason"] == "n_predict"
    r = sharpi(*run, "-n", 300)  # without it: stops at the full context
    d = json.loads(r.stdout)
    assert d["stop_reason"] == "ctx_full" and d["tokens"] == case["tokens"][:len(d["tokens"])] and "context_shifts" not in d
    r = sharpi(*run, "-n", -2, "--context-shift")
    assert json.loads(r.stdout)["stop_reason"] == "ctx_full"
    # the line that says why it stopped: -n -2, or a context too small for a shift to free room (not -n -2)
    for extra, why in ((run[2:4] + ("-c", case["n_ctx"], "-n", -2), "is full: generation stopped (-n -2)"),
                       (("-p", "Hi", "-c", 2, "-n", 10), "is full and a context shift frees no room in it"),
                       (("-p", "Hi", "-c", 2, "-n", -1), "is full and a context shift frees no room in it")):
        r = sharpi("-m", smol, "--temp", 0, *extra, "--context-shift")
        assert r.returncode == 0 and why in r.stderr and ("-n -2" in r.stderr) == (extra[-1] == -2), r.stderr
    # a prompt cache keeps only what a shift left exact: the kept positions
    f = tmp_path / "p.cache"
    r = sharpi(*run, "-n", 300, "--context-shift", "--keep", 3, "--prompt-cache", f, "--prompt-cache-all")
    assert r.returncode == 0, r.stderr
    from sharpi_core.prompt_cache import PromptCacheFile
    assert PromptCacheFile(str(f)).entries["target"]["tokens"] == case["prompt_ids"][:3]
    one_error_line(sharpi("-m", smol, "-p", "Hi", "--keep", -2), 2, "--keep")
    r = sharpi("-m", smol, "-p", "Hi", "-n", 1, "--keep", 5)
    assert r.returncode == 0 and "--keep 5 does nothing without --context-shift" in r.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_gpu_generation_through_shifts(kind):
    """On the GPU model (its kernels' CPU stand-in here): speculation through shifts gives the plain tokens,
    the draft's device chains and look-ahead included (a queued chain finishes before its cache shifts)."""
    gmodel, _, tok = on(kind, SMOL)
    prompt = tok.encode("Repeat after me: the red fox, the red fox, the red fox, the red fox,")
    greedy = SamplingParams(temp=0, logit_bias=tuple((t, float("-inf")) for t in sorted(tok.eog_ids)))

    def run(drafter=None):
        g = Generator(gmodel, gmodel.new_cache(32), tok, greedy, drafter=drafter, spec_n_max=4, context_shift=True,
                      n_keep=4)
        return g.generate(prompt, n_predict=44)

    plain = run()
    assert plain.context_shifts >= 3 and len(plain.tokens) == 44
    for lookahead in (True, False):
        drafter = DraftModelDrafter(gmodel, gmodel.new_cache(32), greedy)
        drafter.lookahead = lookahead
        spec = run(drafter)
        assert spec.tokens == plain.tokens and spec.context_shifts == plain.context_shifts
        assert spec.spec.accepted == spec.spec.drafted > 0
        assert drafter.lookahead_hits > 0 if lookahead else drafter.lookahead_hits == 0
    assert run(LookupDrafter(3, 2)).tokens == plain.tokens
