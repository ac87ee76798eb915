"""Architectures and weight types without a downloadable model here (Qwen3, Llama 3.1's rope_freqs, SmolLM3,
Gemma 2, Phi-3 with longrope, Granite, Ministral 3, LFM2, Qwen3.5's Gated DeltaNet (dense and MoE), Qwen3-VL's M-RoPE, MoE graphs (gpt-oss among them), Q2_K / Q3_K / Q5_K /
Q4_0 / IQ4_NL / IQ4_XS / MXFP4, F32 / F16 / BF16, types mixed within q / k and gate / up), against llama.cpp.

scripts/gguf_derive.py makes them from SmolLM2's weights (Gemma 2 from Gemma 3 270M's), deterministically;
the oracle (tests/data/llamacpp_archs.json, scripts/llamacpp_archs.py) is libllama decoding the same files
greedily: fixture prompts, a ~300-token prompt, and a run through context shifts (not for smollm3, lfm2, qwen35[moe],
qwen3vl[moe], qwen2vl), with
the top logits' values at a few steps of the runs without a shift.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import cuda_fake
from conftest import ROOT, SMOL, loaded, model_path
from sharpi_core.backends.cuda import cuda_available
from sharpi_core.errors import SharpiError
from sharpi_core.generate import Generator
from sharpi_core.kernels import cpu as cpu_kernels
from sharpi_core.gguf_file import GGUFFile
from sharpi_core.models import config_from_gguf, load_model
from sharpi_core.sampling import SamplingParams
from sharpi_core.quants import Activations
from test_cli import one_error_line, sharpi

_spec = importlib.util.spec_from_file_location("gguf_derive", ROOT / "scripts" / "gguf_derive.py")
gguf_derive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gguf_derive)

MOE_VARIANTS = ("qwen3moe", "mixtral", "gpt-oss", "qwen2moe", "granitemoe", "qwen35moe", "qwen3vlmoe")
CPU_ONLY = MOE_VARIANTS + ("lfm2", "olmo2", "exaone4", "qwen35")  # (the GPU backend refuses them)
ORACLE = json.loads((Path(__file__).parent / "data" / "llamacpp_archs.json").read_text())
GREEDY = SamplingParams(temp=0)


@pytest.fixture(scope="module")
def derived(tmp_path_factory):
    """variant -> path of its GGUF, made from the cached SmolLM2 or Gemma 3 (100-300 MB each, a few seconds)."""
    d = tmp_path_factory.mktemp("archs")
    paths = {}
    for v in gguf_derive.VARIANTS:
        paths[v] = d / f"{v}.gguf"
        src = model_path(gguf_derive.SOURCE_MODEL.get(v, gguf_derive.DEFAULT_SOURCE))
        gguf_derive.derive(v, str(src), str(paths[v]))
    return paths


def case_id(c: dict) -> str:
    return f"{c['variant']}-{c['kind']}-{c['prompt_ids'][1] if len(c['prompt_ids']) > 1 else 0}"


# Variants whose run through context shifts adds nothing to another's: the K-shift re-ropes K, and these
# rope as one of the variants kept does (plain NORM RoPE like SmolLM2's own shift tests, or NeoX like qwen3),
# their differences (weight types, experts, norms, scales, fused tensors) being checked on the logits paths
SHIFT_AS_ANOTHER = {"lowbit", "mixed", "granite", "float", "mixtral", "granitemoe", "fused-qkv", "qwen3moe", "qwen2moe", "olmo2",
                    "ernie4_5"}


@pytest.mark.parametrize("case", [c for c in ORACLE["cases"] if "top_logits" not in c
                                  and not (c["kind"] == "shift" and c["variant"] in SHIFT_AS_ANOTHER)], ids=case_id)
def test_greedy_is_llama_cpps(derived, case):
    """Every token of llama.cpp's greedy path, as the generator runs it (sharpi computes its arithmetic bit for
    bit, so no near-tie allowance: the smallest top-2 gap on these paths is 1.8e-4 of a logit); the paths with
    top logits are checked token by token in test_logits_are_llama_cpps."""
    model, tok = loaded(derived[case["variant"]])
    assert tok.encode(case["prompt"]) == case["prompt_ids"]
    shift = case["keep"] is not None
    gen = Generator(model, model.new_cache(case["n_ctx"]), tok, GREEDY, context_shift=shift, n_keep=case["keep"] or 0)
    res = gen.generate(case["prompt_ids"], n_predict=case["n_gen"])
    assert res.tokens == case["tokens"]
    if shift:
        assert res.context_shifts >= 2


@pytest.mark.parametrize("case", [c for c in ORACLE["cases"] if "top_logits" in c], ids=case_id)
def test_logits_are_llama_cpps(derived, case):
    """Every token of llama.cpp's greedy path (the arg-max at every step: the prompt pass, then one-token
    passes as generation runs them), and the values, not only the order: its top logits at a few steps, bit
    for bit (a softcap or scale that keeps the arg-max fails here)."""
    model, _ = loaded(derived[case["variant"]])
    cache = model.new_cache(case["n_ctx"])
    path = case["prompt_ids"] + case["tokens"]
    steps = {s: (ids, values) for s, ids, values in case["top_logits"]}
    n = len(case["prompt_ids"])
    logits = model.forward(torch.tensor(path[:n]), 0, cache, last_n=1)[-1]
    for s in range(max(steps) + 1):
        if s:
            logits = model.forward(torch.tensor(path[n + s - 1:n + s]), n + s - 1, cache)[-1]
        if n + s < len(path):
            assert int(logits.argmax()) == path[n + s], s
        if s in steps:
            ids, values = steps[s]
            assert logits[ids].tolist() == values, s
            assert logits.topk(len(ids)).values[-1] == values[-1], s  # and no other logit above them


class _PathDrafter:
    """Proposes the oracle path's next tokens after the history (a drafter that is always right), with
    the last of every third proposal made wrong: verify passes accept rows and reject them."""

    def __init__(self, path: list[int], n_vocab: int):
        self.path, self.n_vocab, self.calls = path, n_vocab, 0

    def propose(self, history: list[int], k: int):
        n = len(history)
        assert history == self.path[:n]  # (the generation so far is the oracle's)
        props = list(self.path[n:n + k])
        self.calls += 1
        if props and self.calls % 3 == 0:
            props[-1] = (props[-1] + 1) % self.n_vocab
        return props, None

    def rollback(self, n_keep: int) -> None:
        pass


@pytest.mark.parametrize("variant", gguf_derive.VARIANTS)
def test_greedy_speculation_gives_the_plain_tokens(derived, variant):
    """Batched verify rows on the new graphs equal one-token passes (q/k norms per row, factors in the
    rope table, softcaps), so speculation changes nothing: on the long prompt's path, with proposals
    that are accepted and rejected."""
    case = next(c for c in ORACLE["cases"] if c["variant"] == variant and c["kind"] == "long")
    model, tok = loaded(derived[variant])
    drafter = _PathDrafter(case["prompt_ids"] + case["tokens"], model.config.n_vocab)
    gen = Generator(model, model.new_cache(case["n_ctx"]), tok, GREEDY, drafter=drafter, spec_n_max=4)
    res = gen.generate(case["prompt_ids"], n_predict=case["n_gen"])
    assert res.tokens == case["tokens"]
    assert 0 < res.spec.accepted < res.spec.drafted


@pytest.mark.parametrize("kind", ["fake", pytest.param("cuda", marks=pytest.mark.skipif(not cuda_available()[0],
                                                                                reason="no GPU"))])
@pytest.mark.parametrize("variant", [v for v in gguf_derive.VARIANTS if v not in CPU_ONLY])
def test_gpu_model_follows_the_cpu(derived, variant, kind):
    """The CUDA model reads the same things (the CPU model's rope table, factors included; q/k norms by
    presence; no RoPE where the layer has none): a fixture prompt in one pass, then 16 of llama.cpp's tokens
    one at a time, agree with the CPU's logits as test_cuda_model's do (longer paths drift further apart
    on the real SmolLM2 too: other summation orders, amplified by the 8-bit activation rounding)."""
    from sharpi_core.backends.cuda_model import CudaTransformer
    model, _ = loaded(derived[variant])
    gmodel = CudaTransformer(model, ops=cuda_fake if kind == "fake" else None)
    case = next(c for c in ORACLE["cases"] if c["variant"] == variant and c["kind"] == "fixture")
    n = len(case["prompt_ids"])
    ids = torch.tensor(case["prompt_ids"] + case["tokens"][:16])
    want = model.forward(ids, 0, model.new_cache(64))
    gcache = gmodel.new_cache(64)
    got = torch.cat([gmodel.forward(ids[:n], 0, gcache)] + [gmodel.forward(ids[j:j + 1], j, gcache)
                                                            for j in range(n, len(ids))])
    # (0.04-0.07 on the real SmolLM2 over the same paths, these models alike; a missing or extra rotation fails)
    # (phi3's attention factor of 1.1 sharpens its attention, q.k times 1.21: 0.115 on this path; 0.086 at 1.0)
    assert (got.softmax(-1) - want.softmax(-1)).abs().max() < (0.15 if variant == "phi3" else 0.1)
    top2 = want.topk(2).values
    # gemma2's derived weights (q / k norms folded in as constants) are touchy: fp32 activations move
    # its logits by up to ~0.5 where the 8-bit ones decide ties; its final softcap (15) squeezes the gaps
    margin, share = (0.03, 4) if variant == "gemma2" else (0.02, 2)
    clear = (top2[:, 0] - top2[:, 1]) > margin * top2[:, 0].abs()
    assert clear.sum() >= len(clear) // share
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_derived_configs(derived):
    q = config_from_gguf(GGUFFile(derived["qwen3"]))
    assert (q.arch, q.rope_style, q.qk_norm, q.qkv_bias, q.post_norms, q.rope_freqs) == ("qwen3", "neox", True, False, False, False)
    ex = config_from_gguf(GGUFFile(derived["exaone"]))
    assert (ex.arch, ex.rope_style, ex.rope_freqs, ex.qk_norm, ex.qkv_bias) == ("exaone", "neox", True, False, False)
    ll = config_from_gguf(GGUFFile(derived["llama3"]))
    assert (ll.arch, ll.rope_style, ll.rope_freqs) == ("llama", "norm", True)
    er = config_from_gguf(GGUFFile(derived["ernie4_5"]))
    assert (er.arch, er.rope_style, er.rope_freqs, er.qkv_bias, er.can_shift) == ("ernie4_5", "norm", False, False, True)
    with pytest.raises(SharpiError, match="a ernie4_5 model turns all of them"):  # (its graph asserts n_rot = head size)
        config_from_gguf(GGUFFile(derived["ernie4_5"], overrides={"ernie4_5.rope.dimension_count": 32}))
    model, _ = loaded(derived["llama3"])
    want = gguf_derive.llama3_rope_factors(ll.n_rot, ll.rope_base)
    assert torch.equal(model._rope_factors, torch.from_numpy(want))
    assert model._rope_factors.min() == 1 and model._rope_factors.max() == 8  # all three regimes present
    model, _ = loaded(derived["lowbit"])
    Q = gguf_derive.Q
    cycle = [qt for qt, _ in gguf_derive.LOWBIT_FFN_DOWN]
    assert [ly.w_down.qtype for ly in model.layers] == [cycle[i % len(cycle)] for i in range(len(model.layers))]
    assert set(cycle) == {Q.Q3_K, Q.Q2_K, Q.IQ4_XS, Q.Q5_K}
    assert [ly.wo.qtype for ly in model.layers] == [Q.Q4_0, Q.IQ4_NL] * (len(model.layers) // 2)
    assert all(ly.w_down.kernel_rounds and ly.wo.kernel_rounds for ly in model.layers) == cpu_kernels.available()  # not a fallback
    model, _ = loaded(derived["float"])  # F32 attention, F16 / BF16 FFN: the C kernel in ggml's orders (test_ops)
    assert {(ly.wqk.qtype, ly.wo.qtype, ly.w_gu.qtype, ly.w_down.qtype) for ly in model.layers} == {(Q.F32, Q.F32, Q.F16, Q.BF16)}
    assert all(w._kern is not None for ly in model.layers for w in (ly.wqk, ly.wv, ly.wo, ly.w_gu, ly.w_down)) == cpu_kernels.available()


def test_mistral3_yarn_and_attention_temperatures(derived):
    """mistral3 as llama.cpp reads it: YaRN's betas and log multiplier from the GGUF, q's temperature 1 below
    the original context and 1 + 0.1 ln(k + 1) in its k-th multiple, on the CPU and the GPU models alike."""
    from sharpi_core.backends.cuda_model import CudaTransformer  # noqa: PLC0415
    from sharpi_core.libm import logf  # noqa: PLC0415
    c = config_from_gguf(GGUFFile(derived["mistral3"]))
    kv = gguf_derive.MISTRAL3_KV
    f32 = lambda v: float(np.float32(v))  # noqa: E731
    assert (c.arch, c.rope_style, c.rope_scaling, c.rope_freq_scale, c.yarn_log_mul, c.attn_temp_scale) == (
        "mistral3", "norm", "yarn", 0.25, 1.0, f32(kv["attention.temperature_scale"]))
    assert c.yarn == (1.0, 128, 24.0, 2.0)
    model, _ = loaded(derived["mistral3"])
    t = model._attn_temps(300)
    assert (t[:128] == 1).all() and (t[128:256] == f32(1 + 0.1 * np.log(2))).all() and t[256] == f32(1 + 0.1 * np.log(3))
    g = CudaTransformer(model, ops=cuda_fake)
    assert np.array_equal(g._temps(300)[:300], t[:300].numpy())
    # the long prompt's pass reaches position 280: the temperatures move its last logits' softmax by ~0.11;
    # the GPU stand-in's (its own rounding) stays within 0.044 of the CPU's (its attention sums in float64,
    # whatever numpy's BLAS kernel; through fp32 BLAS it was 0.007 or 0.054, by the kernel the CPU got)
    ids = torch.tensor(next(cs for cs in ORACLE["cases"] if cs["variant"] == "mistral3" and cs["kind"] == "long")["prompt_ids"])
    want = model.forward(ids, 0, model.new_cache(300), last_n=1).softmax(-1)
    got = g.forward(ids, 0, g.new_cache(300), last_n=1).softmax(-1)
    cold = load_model(GGUFFile(derived["mistral3"]))  # (its own: the config changes)
    cold.config = replace(cold.config, attn_temp_scale=0.0)
    off = cold.forward(ids, 0, cold.new_cache(300), last_n=1).softmax(-1)
    assert (got - want).abs().max() < 0.05 < 0.08 < (off - want).abs().max()
    # YaRN's tables: the first pair extrapolates (the plain angle), the last ones interpolate (a quarter of it)
    tab = model._rope_table(c.layer_rope(0), 200)[:200]
    # (times YaRN's magnitude: fmaf(0.1f, logf(4), 1), exact in double)
    ms = f32(c.rope_mscale * f32(f32(0.1) * float(logf(4.0)) + 1.0))
    plain = cpu_kernels.rope_table(c.rope_base, 1.0, 200, c.n_rot, mscale=ms)
    quarter = cpu_kernels.rope_table(c.rope_base, 0.25, 200, c.n_rot, mscale=ms)
    assert torch.equal(tab[:, 0], plain[:, 0]) and torch.equal(tab[:, -8:], quarter[:, -8:])
    assert not torch.allclose(tab[:, 3], plain[:, 3]) and not torch.allclose(tab[:, 3], quarter[:, 3])


def _recurrent_model_checks(path, case, other: list[int]) -> Generator:
    """A model with recurrent layers runs on the CPU only; a generator that ran the long case's first 200 tokens
    evaluates `other`, whose common prefix with them ends further back than the states kept, again from the start
    (a fresh run's tokens); that generator is returned."""
    from sharpi_core.backends.cuda_model import CudaTransformer
    model, tok = loaded(path)
    with pytest.raises(SharpiError, match="CPU only"):
        CudaTransformer(model, ops=cuda_fake)
    gen = Generator(model, model.new_cache(512), tok, GREEDY)
    gen.generate(case["prompt_ids"][:200], n_predict=6)
    fresh = Generator(model, model.new_cache(512), tok, GREEDY).generate(other, n_predict=6).tokens
    assert gen.generate(other, n_predict=6).tokens == fresh and gen._prefilled == len(other)
    return gen


def _recurrent_shifts_and_prompt_cache(path, case, tmp_path) -> None:
    """A model with recurrent layers generates and speculates (its own draft) through context shifts alike;
    --prompt-cache refuses it in one line, writing nothing."""
    from sharpi_core.speculative import DraftModelDrafter
    model, tok = loaded(path)

    def shifting(drafter=None):
        g = Generator(model, model.new_cache(96), tok, GREEDY, drafter=drafter, spec_n_max=4, context_shift=True)
        return g.generate(case["prompt_ids"][:40], n_predict=150)
    plain = shifting()
    assert plain.context_shifts >= 2 and len(plain.tokens) == 150
    assert shifting(DraftModelDrafter(model, model.new_cache(96), GREEDY)).tokens == plain.tokens
    r = sharpi("-m", path, "-p", "Hello", "-n", 2, "--prompt-cache", tmp_path / "p.bin")
    one_error_line(r, contains="recurrent layers")
    assert not (tmp_path / "p.bin").exists()


def test_lfm2_convolution_state(derived, tmp_path):
    """lfm2's convolution layers keep no K / V: the cache holds its attention layers' K and V and, per
    convolution layer, the B*x rows of the last positions in a ring. A cut back within HybridCache's reach
    (speculative rollbacks) goes on exactly; further back the state is gone: reach() says 0, truncate
    refuses, and a generator evaluates such a prompt again from the start (the logits of a fresh cache).
    A draft model's window sliding through its cache keeps it too (greedy speculation: the plain tokens)."""
    from sharpi_core.kv_cache import CONV_ROLLBACK
    from sharpi_core.speculative import DraftModelDrafter
    c = config_from_gguf(GGUFFile(derived["lfm2"]))
    every = gguf_derive.LFM2_CONV_EVERY
    assert c.recurrent == tuple(i % every == every - 1 for i in range(c.n_layer)) and c.n_head_kv == 3
    assert c.conv_width == gguf_derive.LFM2_L_CACHE and c.attn_layers == [i for i in range(c.n_layer) if i % every < every - 1]
    model, tok = loaded(derived["lfm2"])
    case = next(cs for cs in ORACLE["cases"] if cs["variant"] == "lfm2" and cs["kind"] == "long")
    ids = torch.tensor(case["prompt_ids"])
    cache = model.new_cache(512)
    assert cache.k.q.shape[0] == len(c.attn_layers) and cache.conv.shape[0] == sum(c.recurrent)
    model.forward(ids[:200], 0, cache, last_n=1)
    rows = model.forward(ids[200:210], 200, cache, decode=True)  # verify rows [10, V]
    cache.truncate(200)
    assert torch.equal(model.forward(ids[200:210], 200, cache, decode=True), rows)
    assert cache.reach(210 - CONV_ROLLBACK) == 210 - CONV_ROLLBACK and cache.reach(100) == 0
    with pytest.raises(ValueError):
        cache.truncate(100)
    other = case["prompt_ids"][:120] + case["prompt_ids"][150:200]  # shares 120 tokens, 86 back
    gen = _recurrent_model_checks(derived["lfm2"], case, other)
    more = other + gen.history[len(other):] + case["prompt_ids"][200:220]  # goes on from the last: reused
    gen.generate(more, n_predict=6)  # (its batches break elsewhere than a fresh run's: other last bits)
    assert gen._prefilled == 20

    drafter = DraftModelDrafter(model, model.new_cache(64), GREEDY)  # the target's history slides through it
    spec = Generator(model, model.new_cache(512), tok, GREEDY, drafter=drafter, spec_n_max=4)
    res = spec.generate(case["prompt_ids"], n_predict=case["n_gen"])
    assert res.tokens == case["tokens"] and res.spec.accepted > 0
    # a context shift keeps each convolution state as it is (llama.cpp's recurrent memory does): the rows
    # before the new last position are the old last ones; generation and speculation go on through shifts
    cache = model.new_cache(256)
    model.forward(ids[:200], 0, cache, last_n=1)

    def states(pos):  # each convolution layer's state rows before position pos
        out = [torch.empty(cache.d, c.n_embd) for _ in range(sum(c.recurrent))]
        for j, ext in enumerate(out):
            cache.conv_fill(j, cache.conv_slots(pos, 0), ext)
        return out
    before = states(200)
    model.shift_cache(cache, 10, 90)
    assert cache.length == 110 and cache.reach(100) == 100
    assert all(torch.equal(a, b) for a, b in zip(states(110), before))

    _recurrent_shifts_and_prompt_cache(derived["lfm2"], case, tmp_path)


def test_m_rope_models_stop_at_a_full_context(derived):
    """llama.cpp shifts no M-RoPE model's cache (four positions a token: llama_kv_cache::get_can_shift) and turns
    --context-shift off with a warning; so does sharpi's CLI for qwen35 (and qwen35moe): the generation stops where the
    context is full, its tokens those of a run without the flag (checked against llama-completion's text by hand)."""
    run = ("-m", derived["qwen35"], "-p", "Once upon a time", "-c", "64", "-n", "100", "--temp", "0", "--json")
    plain = sharpi(*run)
    r = sharpi(*run, "--context-shift")
    assert r.returncode == 0 and "KV cache shifting is not supported" in r.stderr
    got = json.loads(r.stdout)
    assert got["stop_reason"] == "ctx_full" and "context_shifts" not in got
    assert got["tokens"] == json.loads(plain.stdout)["tokens"] and "not supported" not in plain.stderr
    assert not any(config_from_gguf(GGUFFile(derived[v])).can_shift for v in ("qwen35moe", "qwen3vl", "qwen3vlmoe", "qwen2vl"))
    c = config_from_gguf(GGUFFile(derived["qwen2vl"]))  # (sections one after another: the last pair in the fourth;
    assert c.rope_fixed_pairs == (31,) and c.norm_eps == 0.0  # llama.cpp 0.3.36's qwen2vl loader reads no epsilon)
    assert config_from_gguf(GGUFFile(derived["lfm2"])).can_shift  # (recurrent, but plain RoPE: llama.cpp shifts it)


def test_qwen35_gated_deltanet(derived, tmp_path, monkeypatch):
    """qwen35's Gated DeltaNet layers keep no K / V: the cache holds its attention layers' K and V, per DeltaNet
    layer the convolution's input rows (the lfm2 ring) and its state [Hv, S, S] after each of the last positions
    (keep_states(n): n back; a speculating generator and draft model ask for their k). A verify pass's rows cut
    anywhere within that go on exactly; further back reach() says 0 and a generator evaluates the prompt again.
    Greedy speculation with the model as its own draft (DraftModelDrafter: truncations, reach) gives the plain
    tokens, through context shifts too (each state stays as it is). Metadata as llama.cpp's loader reads it."""
    from sharpi_core.models.config import _qwen35
    from sharpi_core.speculative import DraftModelDrafter
    c = config_from_gguf(GGUFFile(derived["qwen35"]))
    every = gguf_derive.QWEN35_ATTN_EVERY
    assert c.recurrent == tuple(i % every != every - 1 for i in range(c.n_layer))
    assert (c.ssm_d_state, c.ssm_n_group, c.ssm_dt_rank, c.conv_width, c.ssm_conv_dim, c.n_rot) == (64, 3, 9, 4, 960, 32)
    assert c.attn_gate and c.qk_norm and c.ffn_norm_name == "post_attention_norm.weight" and not c.qkv_fused
    model, tok = loaded(derived["qwen35"])
    case = next(cs for cs in ORACLE["cases"] if cs["variant"] == "qwen35" and cs["kind"] == "long")
    ids = torch.tensor(case["prompt_ids"])
    cache = model.new_cache(512)
    assert cache.ssm.shape == (sum(c.recurrent), 2, 9, 64, 64) and cache.k.q.shape[0] == len(c.attn_layers)
    model.forward(ids[:200], 0, cache, last_n=1)
    cache.keep_states(10)
    rows = model.forward(ids[200:210], 200, cache, decode=True)  # verify rows [10, V]
    cache.truncate(203)  # three accepted
    assert torch.equal(model.forward(ids[203:210], 203, cache, decode=True), rows[3:])
    cache.truncate(200)
    assert torch.equal(model.forward(ids[200:210], 200, cache, decode=True), rows)
    assert cache.reach(200) == 200 and cache.reach(199) == 0  # (11 states: after 200 .. 210)
    with pytest.raises(ValueError):
        cache.truncate(199)
    _recurrent_model_checks(derived["qwen35"], case, case["prompt_ids"][:190] + case["prompt_ids"][195:200])  # 16 back
    with monkeypatch.context() as m:  # (no torch reference of its recurrence: one clear line without the C kernels)
        m.setenv("SHARPI_CPU_KERNEL", "0")
        with pytest.raises(SharpiError, match="needs sharpi's C kernels"):
            load_model(GGUFFile(derived["qwen35"]))

    drafter = DraftModelDrafter(model, model.new_cache(512), GREEDY)
    spec = Generator(model, model.new_cache(512), tok, GREEDY, drafter=drafter, spec_n_max=6)
    res = spec.generate(case["prompt_ids"], n_predict=case["n_gen"])
    assert res.tokens == case["tokens"] and res.spec.accepted > 0

    cache = model.new_cache(256)  # a context shift keeps each state as it is (llama.cpp's recurrent memory)
    model.forward(ids[:200], 0, cache, last_n=1)
    before = cache.ssm[:, 200 % cache.ssm.shape[1]].clone()
    model.shift_cache(cache, 10, 90)
    assert cache.length == 110 and torch.equal(cache.ssm[:, 110 % cache.ssm.shape[1]], before)

    _recurrent_shifts_and_prompt_cache(derived["qwen35"], case, tmp_path)

    meta = {"block_count": 8, "ssm.conv_kernel": 4, "ssm.state_size": 128, "ssm.group_count": 16,
            "ssm.time_step_rank": 32, "ssm.inner_size": 4096, "rope.dimension_sections": [11, 11, 10, 0]}
    kw = {"n_layer": 8, "n_rot": 64, "n_head": 16}
    _qwen35(_Meta("qwen35", {**meta, "nextn_predict_layers": 1, "full_attention_interval": 2}), kw)
    assert kw["n_layer"] == 7 and kw["recurrent"] == (True, False) * 3 + (True,)  # (the MTP layer not run)
    from sharpi_core.models.config import _text_mrope  # noqa: PLC0415
    kw = {"n_rot": 64, "head_dim_k": 256}
    _text_mrope(_Meta("qwen35", meta), kw)  # (Qwen3.5's sections: every pair a text position)
    assert kw["rope_fixed_pairs"] == ()
    _text_mrope(_Meta("qwen35", {**meta, "rope.dimension_sections": [11, 11, 0, 10]}), kw)
    assert kw["rope_fixed_pairs"] == tuple(range(2, 32, 3))  # (the w pairs: in the fourth section, at position 0)
    kw = {"n_rot": 128, "head_dim_k": 128}
    _text_mrope(_Meta("qwen3vl", {"rope.dimension_sections": [24, 20, 20, 0]}), kw)  # (Qwen3-VL's: ggml's sectors
    assert kw["rope_fixed_pairs"] == (61, 62)  # 61 and 62 fall past the h and w sections, into the fourth)
    for bad, msg in (({"rope.dimension_sections": [11, -11, 0, 10]}, "M-RoPE sections"),
                     ({"rope.dimension_sections": [0, 0, 0, 0]}, "M-RoPE sections"),
                     ({"rope.dimension_sections": None}, "dimension_sections")):
        with pytest.raises(SharpiError, match=msg):
            _text_mrope(_Meta("qwen3vl", {**meta, **bad}), {"n_rot": 64, "head_dim_k": 256})
    for bad, msg in (({"ssm.inner_size": 4000}, "not supported"), ({"ssm.state_size": 96, "ssm.inner_size": 3072}, "not supported"),
                     ({"ssm.group_count": 12}, "not supported"), ({"expert_count": 8}, "qwen35moe")):
        with pytest.raises(SharpiError, match=msg):
            _qwen35(_Meta("qwen35", {**meta, **bad}), {"n_layer": 8, "n_rot": 64, "n_head": 16})


@pytest.mark.parametrize("variant,types", [("lfm2", ("f16", "f16")), ("lfm2", ("q8_0", "q8_0")),
                                           ("qwen35", ("f16", "f16")), ("qwen35", ("q8_0", "q8_0"))])
def test_recurrent_fast_decode_is_bit_identical(derived, variant, types, monkeypatch):
    """lfm2's and qwen35's layers through models/fast_decode.py (the short convolutions, the Gated DeltaNet's
    gates, convolution, norms and recurrence, the gated attention) give the general loop's bits."""
    from test_model import fast_path_is_hidden
    fast_path_is_hidden(*loaded(derived[variant]), types, monkeypatch)


@pytest.mark.parametrize("variant", ["qwen3", "llama3", "smollm3", "gemma2", "phi3", "granite", "mistral3", "exaone",
                                     "lowbit", "fused-qkv", "mixed"])
def test_dense_fast_decode_is_bit_identical(derived, variant, monkeypatch):
    """The dense variants' layers (q/k norms, softcapping, residual and attention scales, layers without RoPE, Llama
    3's rope_freqs, low-bit weights, fused and mixed-type q/k/v) through models/fast_decode.py, its layer
    loop in C (sharpi_decode_layers) and in Python, give the general loop's bits."""
    from test_model import fast_path_is_hidden
    from sharpi_core.models import fast_decode
    model, tok = loaded(derived[variant])
    assert fast_decode.DecodePath(model)._c_loop_applies()
    fast_path_is_hidden(model, tok, ("f16", "f16"), monkeypatch)


@pytest.mark.parametrize("variant,types", [("olmo2", ("f16", "f16")), ("olmo2", ("q8_0", "q4_0")),
                                           ("exaone4", ("f16", "f16")), ("exaone4", ("q8_0", "q8_0"))])
def test_post_norm_only_fast_decode_is_bit_identical(derived, variant, types, monkeypatch):
    """olmo2's and exaone4's layers (no pre-norms: the residual stream itself into the matmuls; olmo2's q and k normed
    over all their heads in the GGUF's element order, exaone4's per head) through models/fast_decode.py give the
    general loop's bits (the layer loop in C and in Python)."""
    from test_model import fast_path_is_hidden
    from sharpi_core.models import fast_decode
    model, tok = loaded(derived[variant])
    assert fast_decode.DecodePath(model)._c_loop_applies()
    fast_path_is_hidden(model, tok, types, monkeypatch)


@pytest.mark.parametrize("types", [("f16", "f16"), ("q8_0", "q8_0")])
def test_fast_decode_with_sinks_and_output_biases(derived, types, monkeypatch):
    """Attention sinks and attn_output biases (gpt-oss's) on a dense model's layers: models/fast_decode.py gives the
    general loop's bits, and they change the logits."""
    from test_model import fast_path_is_hidden
    from sharpi_core.tokenizer import Tokenizer  # noqa: PLC0415
    gf = GGUFFile(derived["qwen3"])
    model, tok = load_model(gf), Tokenizer.from_gguf(gf)  # (its own copy: the layers are changed below)
    ids = torch.tensor(tok.encode("The quick brown fox")[:4])
    plain = model.forward(ids, 0, model.new_cache(16))
    g = torch.Generator().manual_seed(3)
    for ly in model.layers:
        ly.sinks = torch.randn(model.config.n_head, generator=g) * 2
        ly.bo = torch.randn(model.config.n_embd, generator=g) * 0.02
    assert (model.forward(ids, 0, model.new_cache(16)) - plain).abs().max() > 0.1
    fast_path_is_hidden(model, tok, types, monkeypatch)


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_moe_fast_decode_is_bit_identical(derived, variant, monkeypatch):
    """The mixture-of-experts layers through models/fast_decode.py (routing, mul_mat_id, the weighted sum on
    fixed buffers; verify rows and last_n too) give the general loop's bits."""
    from test_model import fast_path_is_hidden
    fast_path_is_hidden(*loaded(derived[variant]), ("f16", "f16"), monkeypatch)


def test_mixed_types_in_fused_pairs(derived, monkeypatch):
    """Where q and k (gate and up) have different types, each is multiplied apart, side by side in the pair's output
    (a StackedWeight, not a fused copy): every row is the part's own product, through the general loop and the
    decoding fast path alike (llama.cpp's logits: test_logits_are_llama_cpps)."""
    from test_model import fast_path_is_hidden
    Q = gguf_derive.Q
    model, tok = loaded(derived["mixed"])
    assert [[p.qtype for p in ly.wqk.parts] for ly in model.layers] == [[Q.Q4_1, Q.Q8_0]] * len(model.layers)
    assert [[p.qtype for p in ly.w_gu.parts] for ly in model.layers] == [[Q.Q4_1, Q.Q5_0], [Q.Q8_0, Q.Q4_1]] * (
        len(model.layers) // 2)
    ly = model.layers[1]
    x = torch.randn(3, model.config.n_embd, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ly.w_gu(x), torch.cat([p(x) for p in ly.w_gu.parts], -1))
    assert ly.w_gu(x).shape == (3, 2 * model.config.n_ff)
    fast_path_is_hidden(model, tok, ("f16", "f16"), monkeypatch)


def test_fused_qkv_is_the_separate_weights(derived):
    """A `--fuse-qkv` file (attn_qkv, attn_qkv.bias) is cut back into q, k and v: without its biases the derivative
    is SmolLM2 with its own weights, so the logits are SmolLM2's bit for bit; the biases are added where
    llama.cpp's build_qkv adds them (its oracle paths check that)."""
    c = config_from_gguf(GGUFFile(derived["fused-qkv"]))
    assert (c.arch, c.qkv_fused, c.qkv_bias_fused, c.qkv_bias) == ("llama", True, True, False)
    src, _ = loaded(gguf_derive.DEFAULT_SOURCE)
    gf = GGUFFile(derived["fused-qkv"])
    model = load_model(gf)  # (its own copy: its biases are removed below)
    bias = np.asarray(gf.tensor("blk.4.attn_qkv.bias").data)
    q, k = c.n_head * c.head_dim_k, c.n_head_kv * c.head_dim_k
    assert torch.equal(model.layers[4].bv, torch.from_numpy(bias[q + k:]))
    assert torch.equal(model.layers[4].bqk, torch.from_numpy(bias[:q + k]))  # (llama's RoPE: rows in GGUF order)
    ids = torch.tensor([1, 504, 3458, 282, 4649, 314, 253, 2])
    biased = model.forward(ids, 0, model.new_cache(16))
    for ly in model.layers:
        ly.bqk = ly.bv = None
    plain = model.forward(ids, 0, model.new_cache(16))
    assert torch.equal(plain, src.forward(ids, 0, src.new_cache(16)))
    assert (biased - plain).abs().max() > 0.1


def test_mixture_of_experts(derived):
    """qwen3moe and Mixtral's llama with experts: the config as llama.cpp reads it, each expert a view of its
    rows of the stacked tensors (ffn_down: its columns), and the GPU backend refusing them in one line."""
    from sharpi_core.backends.cuda_model import CudaTransformer  # noqa: PLC0415
    src = GGUFFile(model_path(gguf_derive.DEFAULT_SOURCE))
    E, used, f = gguf_derive.MOE_EXPERTS, gguf_derive.MOE_USED, gguf_derive.MOE_FF
    for variant, arch in (("qwen3moe", "qwen3moe"), ("mixtral", "llama")):
        c = config_from_gguf(GGUFFile(derived[variant]))
        assert (c.arch, c.n_expert, c.n_expert_used, c.n_ff_exp, c.qk_norm) == (arch, E, used, f, arch == "qwen3moe")
        model, _ = loaded(derived[variant])
        assert all(ly.w_gu is None and ly.w_down is None for ly in model.layers)
        ex = model.layers[3].experts
        gate = np.asarray(src.tensor("blk.3.ffn_gate.weight").data)
        down = gguf_derive.gguf.quants.dequantize(np.asarray(src.tensor("blk.3.ffn_down.weight").data), gguf_derive.Q.Q4_1)
        for e in (0, 5):
            assert np.array_equal(ex.gate[e].raw, gate[e * f:(e + 1) * f])
            got = gguf_derive.gguf.quants.dequantize(np.asarray(ex.down[e].raw), ex.down[e].qtype)
            assert np.array_equal(got, down[:, e * f:(e + 1) * f] * gguf_derive.MOE_DOWN_SCALE)
        assert ex.router.qtype == gguf_derive.Q.F32 and (ex.router.n, ex.router.k) == (E, c.n_embd)
        with pytest.raises(SharpiError, match="mixture-of-experts model runs on the CPU only"):
            CudaTransformer(model, ops=cuda_fake)


def test_gpt_oss(derived):
    """gpt-oss as llama.cpp's openai-moe loader reads it: the even layers slide, YaRN on every layer, biases and
    sinks where its graph adds them, the FFN norm from post_attention_norm, MXFP4 experts with their biases
    (rows of the stacked tensors), softmax_weight gating and SwiGLU-OAI; a file without its window refused."""
    Q = gguf_derive.Q
    c = config_from_gguf(GGUFFile(derived["gpt-oss"]))
    kv = gguf_derive.GPT_OSS_KV
    assert (c.arch, c.rope_style, c.qkv_bias, c.attn_out_bias, c.attn_sinks, c.post_norms) == ("gpt-oss", "neox", True, True, True, False)
    assert (c.act, c.expert_gating, c.moe_bias, c.n_expert, c.n_expert_used, c.n_ff_exp) == (
        "swiglu_oai", "softmax_weight", True, gguf_derive.MOE_EXPERTS, gguf_derive.MOE_USED, gguf_derive.MOE_FF)
    assert c.sliding_window == kv["attention.sliding_window"] and c.swa_layers == tuple(i % 2 == 0 for i in range(c.n_layer))
    assert c.rope_scaling == "yarn" and c.yarn[0] == 1.0 and c.layer_rope(0) == c.layer_rope(1) == (c.rope_base, 0.25)
    model, _ = loaded(derived["gpt-oss"])
    gf = GGUFFile(derived["gpt-oss"])
    ly, ex = model.layers[3], model.layers[3].experts
    assert torch.equal(ly.ffn_norm, torch.from_numpy(np.asarray(gf.tensor("blk.3.post_attention_norm.weight").data)))
    assert ly.post_attn_norm is None and ly.sinks.shape == (c.n_head,) and ly.bo.shape == (c.n_embd,)
    assert {w.qtype for w in ex.gate + ex.up + ex.down} == {Q.MXFP4} and ex.router.qtype == Q.F32
    up_b = np.asarray(gf.tensor("blk.3.ffn_up_exps.bias").data).reshape(c.n_expert, c.n_ff_exp)
    assert torch.equal(ex.up_b[5], torch.from_numpy(up_b[5])) and ex.down_b.shape == (c.n_expert, c.n_embd)
    assert np.array_equal(ex.down[2].raw, np.asarray(gf.tensor("blk.3.ffn_down_exps.weight").data)[2])
    # SwiGLU-OAI: x = min(g, 7), x * sigmoid(1.702 x) * (clamp(u, -7, 7) + 1), with or without the kernel
    gu = torch.tensor([[9.0, -3.0, 0.5, 2.0, 8.0, -9.0]])
    x, u = torch.tensor([7.0, -3.0, 0.5]), torch.tensor([2.0, 7.0, -7.0])
    want = x * torch.sigmoid(1.702 * x) * (u + 1)
    torch.testing.assert_close(model._glu(gu, 3), want[None])  # (3 columns: the torch path; test_ops: the kernel)
    from sharpi_core.models.config import _gpt_oss  # noqa: PLC0415
    with pytest.raises(SharpiError, match="attention.sliding_window"):
        _gpt_oss(_Meta("gpt-oss", {}), {"n_layer": 2, "rope_base": 1e4, "rope_freq_scale": 1.0, "swa_pattern": 2})
    from sharpi_core.models.config import _tied_output  # noqa: PLC0415
    with pytest.raises(SharpiError, match="output.weight. is missing"):
        _tied_output(_Meta("gpt-oss", {"attention.sliding_window": 128}))


def test_qwen2moe(derived):
    """qwen2moe as llama.cpp's loader reads it: the experts' width and the shared expert's from their own keys
    (not feed_forward_length), q / k / v biases, the experts' weights not renormalized; the shared expert's
    gate, up and down as the file holds them, its gate's logit row f32 [1, D], its sigmoid gate ggml's
    silu(x) / x; a file without output.weight refused (its loader requires one)."""
    Q = gguf_derive.Q
    c = config_from_gguf(GGUFFile(derived["qwen2moe"]))
    assert (c.arch, c.rope_style, c.qkv_bias, c.expert_gating, c.expert_weights_norm) == (
        "qwen2moe", "neox", True, "softmax", False)
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_ff_shexp, c.n_ff) == (
        gguf_derive.MOE_EXPERTS, gguf_derive.MOE_USED, gguf_derive.MOE_FF, gguf_derive.QWEN2MOE_SHEXP_FF, 768)
    model, _ = loaded(derived["qwen2moe"])
    gf = GGUFFile(derived["qwen2moe"])
    ex = model.layers[3].experts
    dense = lambda n: np.asarray(gf.tensor(f"blk.3.ffn_{n}_shexp.weight").data)  # noqa: E731
    assert np.array_equal(np.asarray(ex.sh_gu.raw), np.concatenate((dense("gate"), dense("up"))))
    assert np.array_equal(np.asarray(ex.sh_down.raw), dense("down"))
    assert ex.sh_gate.qtype == Q.F32 and (ex.sh_gate.n, ex.sh_gate.k) == (1, c.n_embd)
    g = torch.Generator().manual_seed(0)
    T, D = 5, c.n_embd
    h, y = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    a = Activations(h, False)
    got = model._shared_expert(ex, a, y.clone())
    x = a(ex.sh_gate)  # [T, 1]
    sh = ex.sh_down(model._glu(a(ex.sh_gu), c.n_ff_shexp))
    torch.testing.assert_close(got, y + sh * torch.sigmoid(x), rtol=1e-6, atol=1e-6)
    assert (got - y).abs().max() > 0.1
    from sharpi_core.models.config import _experts  # noqa: PLC0415
    meta = _Meta("qwen2moe", {"expert_count": 8, "expert_used_count": 2, "expert_shared_count": 1})
    kw = {"n_ff": 768}
    _experts(meta, kw)  # (the one shared expert its graph always has: expert_shared_count is not read)
    assert (kw["n_ff_exp"], kw["n_ff_shexp"]) == (384, 768)  # llama.cpp's defaults: n_ff / n_expert_used, n_ff
    from sharpi_core.models.config import _tied_output  # noqa: PLC0415
    for arch in ("qwen2moe", "olmo2"):
        with pytest.raises(SharpiError, match="output.weight. is missing"):
            _tied_output(_Meta(arch, {}))
    assert _tied_output(_Meta("qwen3moe", {}))  # (llama.cpp's other loaders take the embedding)


def test_granitemoe(derived):
    """granitemoe as llama.cpp's granite graph reads it: granite's scales, the experts' width from
    feed_forward_length, renormalized weights, a shared expert (granitemoeshared's) added without a gate
    when expert_shared_feed_forward_length is given, none without it; granite with expert_count routes too."""
    kv = gguf_derive.GRANITEMOE_KV
    c = config_from_gguf(GGUFFile(derived["granitemoe"]))
    assert (c.arch, c.rope_style, c.expert_gating, c.expert_weights_norm, c.shexp_gated) == (
        "granitemoe", "norm", "softmax", True, False)
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_ff, c.n_ff_shexp) == (
        gguf_derive.MOE_EXPERTS, gguf_derive.MOE_USED, gguf_derive.MOE_FF, gguf_derive.MOE_FF,
        kv["expert_shared_feed_forward_length"])
    assert (c.logit_scale, c.residual_scale, c.embed_scale, c.attn_scale) == tuple(
        pytest.approx(kv[k]) for k in ("logit_scale", "residual_scale", "embedding_scale", "attention.scale"))
    model, _ = loaded(derived["granitemoe"])
    ex = model.layers[3].experts
    assert ex.sh_gate is None and (ex.sh_gu.n, ex.sh_down.k) == (2 * c.n_ff_shexp, c.n_ff_shexp)
    g = torch.Generator().manual_seed(0)
    h, y = torch.randn(5, c.n_embd, generator=g), torch.randn(5, c.n_embd, generator=g)
    a = Activations(h, False)
    sh = ex.sh_down(model._glu(a(ex.sh_gu), c.n_ff_shexp))
    assert torch.equal(model._shared_expert(ex, a, y.clone()), y + sh)
    from sharpi_core.models.config import _experts  # noqa: PLC0415
    for arch in ("granite", "granitemoe"):
        kw = {"n_ff": 512}
        _experts(_Meta(arch, {"expert_count": 8, "expert_used_count": 2}), kw)
        assert (kw["n_ff_exp"], kw["n_ff_shexp"]) == (512, 0)


def test_qwen35moe(derived):
    """qwen35moe as llama.cpp's loader reads it: qwen35's layers, each FFN renormalized experts beside a shared expert
    under ggml_sigmoid (not qwen2moe's silu(x) / x), widths from their own keys (no feed_forward_length needed), the
    experts' gate and up apart or in one ffn_gate_up_exps per layer (each expert's gate rows first)."""
    c = config_from_gguf(GGUFFile(derived["qwen35moe"]))
    assert (c.arch, c.expert_gating, c.expert_weights_norm, c.shexp_gated, c.shexp_plain_sigmoid, c.attn_gate) == (
        "qwen35moe", "softmax", True, True, True, True)
    assert (c.n_ff, c.n_ff_exp, c.n_ff_shexp, c.n_expert, c.n_layer_nextn) == (
        0, gguf_derive.MOE_FF, gguf_derive.QWEN2MOE_SHEXP_FF, gguf_derive.MOE_EXPERTS, 1)
    assert c.gate_up_exps == frozenset(range(0, c.n_layer, 2)) and any(c.recurrent) and not all(c.recurrent)
    model, _ = loaded(derived["qwen35moe"])
    src = GGUFFile(model_path(SMOL))
    f = c.n_ff_exp
    for i in (0, 1, 3):  # (fused DeltaNet, apart DeltaNet, apart attention layers): expert e's rows are the source's
        ex = model.layers[i].experts
        for name, ws in (("ffn_gate", ex.gate), ("ffn_up", ex.up)):
            dense = np.asarray(src.tensor(f"blk.{i}.{name}.weight").data)
            assert all(np.array_equal(np.asarray(w.raw), dense[e * f:(e + 1) * f]) for e, w in enumerate(ws)), (i, name)
    ex = model.layers[2].experts
    g = torch.Generator().manual_seed(0)
    h, y = torch.randn(5, c.n_embd, generator=g), torch.randn(5, c.n_embd, generator=g)
    a = Activations(h, False)
    sh = ex.sh_down(model._glu(a(ex.sh_gu), c.n_ff_shexp))
    assert torch.equal(model._shared_expert(ex, a, y.clone()), y + sh * cpu_kernels.sigmoid(a(ex.sh_gate).contiguous()))
    from sharpi_core.models.config import _experts  # noqa: PLC0415
    kw = {"n_ff": 0}
    with pytest.raises(SharpiError, match="experts of width 0"):  # (no width key and no feed_forward_length)
        _experts(_Meta("qwen35moe", {"expert_count": 8, "expert_used_count": 2}), kw)
    kw = {"n_ff": 768}
    _experts(_Meta("qwen35moe", {"expert_count": 8, "expert_used_count": 2, "expert_shared_count": 1}), kw)
    assert (kw["n_ff_exp"], kw["n_ff_shexp"]) == (384, 768)  # llama.cpp's defaults: n_ff / n_expert_used, n_ff


def test_olmo2(derived):
    """olmo2 as llama.cpp's loader reads it: no pre-norms, post-norms on the attention and FFN outputs, q and k
    RMS-normed over all their heads (summed in the GGUF's element order, though sharpi keeps NeoX heads' dims in
    rope-pair order), its own output layer; OLMo 3's sliding windows and the GPU backend refused in one line."""
    from sharpi_core.backends.cuda_model import CudaTransformer  # noqa: PLC0415
    c = config_from_gguf(GGUFFile(derived["olmo2"]))
    assert (c.arch, c.rope_style, c.pre_norms, c.post_norms, c.qk_norm, c.qk_norm_full) == (
        "olmo2", "neox", False, True, False, True)
    model, _ = loaded(derived["olmo2"])
    ly = model.layers[2]
    H, Hkv, hd = c.n_head, c.n_head_kv, c.head_dim_k
    assert ly.attn_norm is None and ly.ffn_norm is None and ly.post_attn_norm is not None
    wq, wk = ly.qk_norm_full
    assert wq.shape == (H * hd,) and wk.shape == (Hkv * hd,)
    qk = torch.randn(3, H + Hkv, hd, generator=torch.Generator().manual_seed(0))  # heads' dims in rope-pair order
    got = model._qk_norm_full(qk, ly.qk_norm_full)
    for part, w, rows in ((qk[:, :H], wq, slice(0, H)), (qk[:, H:], wk, slice(H, H + Hkv))):
        flat = part[..., model._unperm].reshape(3, -1).double()  # GGUF order
        want = (flat / (flat.pow(2).mean(-1, keepdim=True) + c.norm_eps).sqrt() * w.double()).view(3, -1, hd)
        torch.testing.assert_close(got[:, rows].double(), want[..., model._perm], rtol=1e-6, atol=1e-6)
    with pytest.raises(SharpiError, match="post-norms only.* runs on the CPU only"):
        CudaTransformer(model, ops=cuda_fake)
    from sharpi_core.models.config import config_from_gguf as cfg  # noqa: PLC0415

    class Swa(GGUFFile):
        def arch_get(self, key, default=None):
            return 4096 if key == "attention.sliding_window" else super().arch_get(key, default)
    with pytest.raises(SharpiError, match="sliding-window layers .OLMo 3. is not supported"):
        cfg(Swa(derived["olmo2"]))
    # exaone4: the same post-norms-only layer with per-head q / k norms; the 32B's sliding windows refused
    e = config_from_gguf(GGUFFile(derived["exaone4"]))
    assert (e.arch, e.pre_norms, e.post_norms, e.qk_norm, e.qk_norm_full, e.rope_freqs, e.tied_output) == (
        "exaone4", False, True, True, False, True, True)
    with pytest.raises(SharpiError, match="exaone4 with sliding-window layers"):
        cfg(Swa(derived["exaone4"]))


def test_expert_metadata_is_checked():
    from sharpi_core.models.config import _experts  # noqa: PLC0415
    base = {"feed_forward_length": 768}
    for kv, msg in (({"expert_count": 8, "expert_used_count": 9}, "9 of 8 experts"),
                    ({"expert_count": 8, "expert_used_count": 0}, "0 of 8 experts"),
                    ({"expert_count": 8, "expert_used_count": 2, "expert_shared_count": 1}, "expert_shared_count"),
                    ({"expert_count": 8, "expert_used_count": 2, "expert_gating_func": 2}, "gating function 2"),
                    ({"expert_count": 8}, "expert_used_count")):
        with pytest.raises(SharpiError, match=msg):
            _experts(_Meta("qwen3moe", {**base, **kv}), {"n_ff": 768})
    kw = {"n_ff": 768}
    _experts(_Meta("qwen3moe", {"expert_count": 128, "expert_used_count": 8}), kw)
    assert (kw["n_expert"], kw["n_expert_used"], kw["n_ff_exp"]) == (128, 8, 96)  # llama.cpp's n_ff / n_expert_used


class _Meta:
    """The metadata reads of config._gemma, from a dict."""

    def __init__(self, arch: str, kv: dict):
        self.arch, self.kv, self.path = arch, kv, "test.gguf"
        self.tensors = {}

    def arch_get(self, key, default=None):
        return self.kv.get(key, default)

    def require(self, key, like=None):
        if key.removeprefix(self.arch + ".") not in self.kv:
            raise SharpiError(f"{self.path}: missing GGUF metadata key '{key}'")
        return self.kv[key.removeprefix(self.arch + ".")]


def test_gemma_hyperparameters_as_llama_cpp_reads_them(derived):
    from sharpi_core.models.config import ARCH_TABLE, _gemma  # noqa: PLC0415
    c = config_from_gguf(GGUFFile(derived["gemma2"]))
    kv = gguf_derive.GEMMA2_KV
    assert (c.arch, c.qk_norm, c.post_norms, c.scale_q, c.act) == ("gemma2", False, True, True, "gelu_tanh")
    assert (c.attn_softcap, c.final_softcap, c.sliding_window) == (kv["attn_logit_softcapping"],
                                                                   kv["final_logit_softcapping"], 128)
    assert [c.is_swa(i) for i in range(4)] == [True, False, True, False]
    assert c.layer_rope(0) == (10000.0, 1.0) and c.layer_rope(1) == (c.rope_base, 1.0) and c.rope_base == 1e6

    def gemma(arch, n_layer=26, n_embd=2304, n_head=8, head_dim=256, **meta):
        kw = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, head_dim_k=head_dim, rope_base=10000.0,
                  rope_freq_scale=0.5, swa_pattern=ARCH_TABLE[arch]["swa_pattern"],
                  rope_base_swa=10000.0)
        _gemma(_Meta(arch, meta), kw)
        return kw

    d = gemma("gemma2")  # Gemma 2 2B without the optional keys: llama.cpp's defaults
    assert (d["sliding_window"], d["attn_softcap"], d["final_softcap"], d["attn_scale"]) == (4096, 50.0, 30.0, 1 / 16)
    assert d["swa_layers"] == tuple(i % 2 == 0 for i in range(26))
    assert (d["rope_base_swa"], d["rope_freq_scale_swa"]) == (10000.0, 0.5)  # the trained ones, not 1.0
    f32 = lambda v: float(np.float32(v))  # noqa: E731 (llama.cpp computes the scales in float)
    assert gemma("gemma2", n_layer=46, n_embd=4608, n_head=32, head_dim=128)["attn_scale"] == f32(1 / 12)  # 27B
    assert gemma("gemma3", n_layer=62, n_embd=5376, n_head=32, head_dim=128)["attn_scale"] == f32(
        np.float32(1) / np.sqrt(np.float32(168)))
    g3 = gemma("gemma3", n_layer=12)
    assert (g3["sliding_window"], g3["final_softcap"], "attn_softcap" in g3) == (0, 0.0, False)
    assert g3["swa_layers"] == tuple(i % 6 < 5 for i in range(12))
    assert gemma("gemma3", n_layer=4, **{"final_logit_softcapping": 30.0})["final_softcap"] == 30.0
    assert gemma("gemma2", n_layer=3, **{"attention.sliding_window_pattern": 0})["swa_layers"] == (True,) * 3
    flags = [True, False, False]
    assert gemma("gemma2", n_layer=3, **{"attention.sliding_window_pattern": flags})["swa_layers"] == tuple(flags)
    with pytest.raises(SharpiError, match="pattern of 2 layers for 3"):
        gemma("gemma2", n_layer=3, **{"attention.sliding_window_pattern": [True, False]})

    class Huge(GGUFFile):  # (a u64 window: llama.cpp's u32 read refuses it; sharpi's attention kernel overflowed)
        def arch_get(self, key, default=None):
            return 1 << 63 if key == "attention.sliding_window" else super().arch_get(key, default)
    with pytest.raises(SharpiError, match=r"sliding_window is 9223372036854775808 in its metadata \(a count of 32"):
        config_from_gguf(Huge(derived["gemma2"]))


def test_granite_scales(derived):
    """Granite's embedding, residual, attention and logit scales, read as llama.cpp reads them."""
    from sharpi_core.models.config import _granite  # noqa: PLC0415
    from sharpi_core.models.transformer import attention_scales  # noqa: PLC0415
    c = config_from_gguf(GGUFFile(derived["granite"]))
    kv = gguf_derive.GRANITE_KV
    f32 = lambda v: float(np.float32(v))  # noqa: E731
    assert (c.arch, c.rope_style, c.embed_scale, c.residual_scale, c.attn_scale, c.logit_scale) == (
        "granite", "norm", *(f32(kv[k]) for k in ("embedding_scale", "residual_scale", "attention.scale", "logit_scale")))
    assert attention_scales(c) == (c.attn_scale, c.attn_scale)  # on the scores, as llama.cpp's kq_scale
    kw = {}
    _granite(_Meta("granite", {"logit_scale": 8.0}), kw)  # the others optional: not applied
    assert (kw["embed_scale"], kw["residual_scale"], kw["attn_scale"]) == (1.0, 0.0, 0.0)
    with pytest.raises(SharpiError, match="missing GGUF metadata key 'granite.logit_scale'"):
        _granite(_Meta("granite", {}), {})
    with pytest.raises(SharpiError, match="without RoPE"):
        _granite(_Meta("granite", {"logit_scale": 8.0, "rope.scaling.finetuned": False}), {})


def test_smollm3_layers_without_rope(derived):
    """Every 4th layer (3, 7, ...) has no RoPE: a context shift moves its K as it is and re-rotates the
    others (llama.cpp rotates those too, see scripts/llamacpp_archs.py; not followed)."""
    c = config_from_gguf(GGUFFile(derived["smollm3"]))
    assert (c.arch, c.rope_style, c.nope_every) == ("smollm3", "norm", 4)
    assert [i for i in range(c.n_layer) if not c.has_rope(i)] == list(range(3, c.n_layer, 4))
    model, tok = loaded(derived["smollm3"])
    cache = model.new_cache(64, "f32", "f32")
    model.forward(torch.tensor(tok.encode("The history of the Roman Empire is long and")), 0, cache)
    n = cache.length
    before = [cache.k.read(i, n).clone() for i in range(c.n_layer)]
    model.shift_cache(cache, 1, 3)
    assert cache.length == n - 3
    for i in range(c.n_layer):
        moved = cache.k.read(i, n - 3)
        assert torch.equal(moved[:1], before[i][:1])
        assert torch.equal(moved[1:], before[i][4:]) == (not c.has_rope(i)), i


def test_rope_table_divides_by_the_factors():
    """The C table (libm cosf / sinf of theta / factor * freq scale) against the same float32 theta in
    torch, cos / sin in double: equal to an ulp or two; factors of 1 change no bit."""
    from sharpi_core.kernels import cpu
    if not cpu.available():
        pytest.skip("no CPU kernels")
    n, n_rot, base, fs = 600, 64, 100000.0, 0.5
    ff = torch.from_numpy(gguf_derive.llama3_rope_factors(n_rot, base))
    tab = cpu.rope_table(base, fs, n, n_rot, ff)
    assert torch.equal(cpu.rope_table(base, fs, n, n_rot, torch.ones(n_rot // 2)), cpu.rope_table(base, fs, n, n_rot))
    theta = torch.empty(n, n_rot // 2)
    theta[:, 0] = torch.arange(n, dtype=torch.float32)
    ts = torch.tensor(base, dtype=torch.float64).pow(-2.0 / n_rot).float()
    for i in range(1, n_rot // 2):
        theta[:, i] = theta[:, i - 1] * ts
    t = (theta / ff * torch.tensor(fs)).double()
    torch.testing.assert_close(tab, torch.complex(t.cos().float(), t.sin().float()), rtol=0, atol=3e-7)
    # the last pairs turn 8x slower than without factors
    plain = cpu.rope_table(base, fs, n, n_rot)
    assert not torch.equal(tab[:, -1], plain[:, -1]) and torch.equal(tab[:, 0], plain[:, 0])
    with pytest.raises(ValueError):
        cpu.rope_table(base, fs, n, n_rot, torch.ones(n_rot))
    # an attention factor multiplies each cos and sin in float (ggml's rope_yarn: cosf(theta) * mscale)
    ms = np.float32(1.1)
    assert torch.equal(torch.view_as_real(cpu.rope_table(base, fs, n, n_rot, ff, float(ms))),
                       torch.view_as_real(tab) * torch.tensor(ms))


def test_phi3_fused_weights_and_longrope(derived):
    """phi3's attn_qkv and gate-then-up ffn_up read as the parts they hold; the long RoPE factors past
    the original context, the short ones up to it (chosen by the cache's size, as llama.cpp by n_ctx),
    both scaled by the attention factor; q scaled by 1 / sqrtf(head_dim) in float."""
    from sharpi_core.models.transformer import attention_scales, layer_parts  # noqa: PLC0415
    gf = GGUFFile(derived["phi3"])
    c = config_from_gguf(gf)
    kv = gguf_derive.PHI3_KV
    assert (c.arch, c.rope_style, c.qkv_fused, c.ffn_up_gated, c.rope_long_short, c.scale_q) == (
        "phi3", "neox", True, True, True, True)
    assert (c.n_ctx_orig, c.rope_attn_factor) == (kv["rope.scaling.original_context_length"],
                                                   float(np.float32(kv["rope.scaling.attn_factor"])))
    src = GGUFFile(model_path(gguf_derive.DEFAULT_SOURCE))
    parts = layer_parts(gf, c, 3)
    for name, part in parts.items():  # v, gate and up are the source's blocks; q and k reordered rows
        want = np.asarray(src.tensor(f"blk.3.{'attn_' if name in 'qkv' else 'ffn_'}{name}.weight").data)
        assert np.array_equal(part.raw, want) == (name not in "qk"), name
        assert sorted(map(bytes, part.raw)) == sorted(map(bytes, want)), name
    model, _ = loaded(derived["phi3"])
    model.new_cache(c.n_ctx_orig)
    short = model._rope_table(c.layer_rope(0), 8).clone()
    assert torch.equal(model._rope_factors, model._factor_sets["rope_factors_short.weight"])
    model.new_cache(c.n_ctx_orig + 1)
    assert torch.equal(model._rope_factors, model._factor_sets["rope_factors_long.weight"])
    long = model._rope_table(c.layer_rope(0), 8)
    assert not torch.equal(short, long) and torch.equal(short[:, 0], long[:, 0])  # factor 1 on the first pair
    assert torch.equal(torch.view_as_real(long[1:2, :1]), torch.view_as_real(
        cpu_kernels.rope_table(c.rope_base, 1.0, 2, c.n_rot)[1:2, :1]) * torch.tensor(np.float32(c.rope_attn_factor)))
    assert attention_scales(replace(c, head_dim_k=96))[0] == float(np.float32(1) / np.sqrt(np.float32(96)))
    # on the GPU a cache on the other side of the original context drops the passes captured with the other
    # factors' table (a captured pass reads the table it was captured with, not the CPU model's new one)
    from sharpi_core.backends.cuda_model import CudaTransformer  # noqa: PLC0415
    gmodel = CudaTransformer(model, ops=cuda_fake)
    gcache = gmodel.new_cache(c.n_ctx_orig)
    gmodel.forward(torch.tensor([1]), 0, gcache)
    assert gmodel.use_graphs and gcache in gmodel._graphs
    gmodel.new_cache(c.n_ctx_orig)
    assert gcache in gmodel._graphs  # (the same factors: kept)
    gmodel.new_cache(c.n_ctx_orig + 1)
    assert gcache not in gmodel._graphs


def test_a_prompt_cache_keeps_the_rope_factors_k_was_turned_with(derived, tmp_path):
    """phi3's context size picks its RoPE factors: a prompt cache made at the original context (short factors)
    is refused past it (long ones), where it was restored and gave that context's text (another one from the
    13th token on), and the reverse; at the same side it is restored."""
    from sharpi_core.backends.cuda_model import CudaTransformer  # noqa: PLC0415
    from sharpi_core.prompt_cache import PromptCacheFile  # noqa: PLC0415
    model, _ = loaded(derived["phi3"])
    n_orig, path, ids = model.config.n_ctx_orig, derived["phi3"], [1, 2, 3]
    for made, other in ((n_orig, n_orig + 1), (n_orig + 1, n_orig)):
        cache = model.new_cache(made)
        model.forward(torch.tensor(ids), 0, cache)
        f = tmp_path / f"p{made}.cache"
        assert PromptCacheFile(f).save({"target": (cache, list(ids), path)}, ids)
        with pytest.raises(SharpiError, match="RoPE factors"):
            PromptCacheFile(f).restore("target", model.new_cache(other), [], path, ids)
        assert PromptCacheFile(f).restore("target", model.new_cache(made), [], path, ids) == 3
    assert [model.new_cache(n).rope_factors for n in (n_orig, n_orig + 1)] == ["short", "long"]
    gmodel = CudaTransformer(model, ops=cuda_fake)
    assert [gmodel.new_cache(n).rope_factors for n in (n_orig, n_orig + 1)] == ["short", "long"]
    assert loaded(SMOL)[0].new_cache(64).rope_factors is None


def test_rope_freqs_outside_llama_is_refused(tmp_path):
    """llama.cpp's qwen3 graph reads no rope_freqs: a file carrying one is a variant sharpi does not run."""
    from test_loading import write_gguf
    p = write_gguf(tmp_path / "bad.gguf", arch="qwen3", extra=[("blk.0.attn_q_norm.weight", (8,)),
                                                              ("blk.0.attn_k_norm.weight", (8,)), ("rope_freqs.weight", (4,))])
    with pytest.raises(SharpiError, match="rope_freqs.weight.*not part of the qwen3 graph"):
        config_from_gguf(GGUFFile(p))
    one_error_line(sharpi("-m", str(p), "-p", "Hi", "-n", "2"), code=1, contains="unsupported model variant")


def test_cli_runs_a_qwen3_file(derived):
    case = next(c for c in ORACLE["cases"] if c["variant"] == "qwen3" and c["kind"] == "fixture")
    r = sharpi("-m", str(derived["qwen3"]), "-p", case["prompt"], "-n", "8", "--temp", "0", "--no-display-prompt")
    assert r.returncode == 0, r.stderr
    _, tok = loaded(derived["qwen3"])
    assert r.stdout.rstrip("\n") == tok.decode(case["tokens"][:8])
