"""The target's own MTP layer as the drafter (--spec-type draft-mtp): the head against llama.cpp's graph_mtp, and
speculation with it exact.

No Qwen3.5 GGUF can be downloaded here: scripts/gguf_derive.py's qwen35 variant carries an MTP block (SmolLM2's last
layer as a gated attention layer, a fixed eh_proj, enorm, hnorm, shared_head_norm), and the oracle
(tests/data/llamacpp_mtp.json, scripts/llamacpp_mtp.py) is libllama's MTP context on the same file: its logits over a
prompt's (token, previous hidden row) pairs and K greedy draft steps. The derivative writes word salad its head cannot
predict, so speculation tests steer the head's logits toward a known path (accepted and rejected drafts, with the
head's real K / V and hidden rows).
"""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, loaded, model_path
from sharpi_core.generate import Generator
from sharpi_core.models.mtp import MtpHead, mtp_unavailable
from sharpi_core.sampling import SamplingParams
from sharpi_core.speculative import MtpDrafter
from test_cli import one_error_line, sharpi

_spec = importlib.util.spec_from_file_location("gguf_derive", ROOT / "scripts" / "gguf_derive.py")
gguf_derive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gguf_derive)

DATA = Path(__file__).parent / "data"
ORACLE = json.loads((DATA / "llamacpp_mtp.json").read_text())
MOE_ORACLE = json.loads((DATA / "llamacpp_mtp_qwen35moe.json").read_text())  # (its MTP block's FFN: experts)
ARCHS = json.loads((DATA / "llamacpp_archs.json").read_text())
LONG = next(c for c in ARCHS["cases"] if c["variant"] == "qwen35" and c["kind"] == "long")
GREEDY = SamplingParams(temp=0)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp") / "qwen35.gguf"
    gguf_derive.derive("qwen35", str(model_path(gguf_derive.DEFAULT_SOURCE)), str(path))
    return path


@pytest.fixture(scope="module")
def head(qwen35):
    model, _ = loaded(qwen35)
    h = MtpHead(model)
    h.pack_weights()
    return h


@pytest.fixture(scope="module")
def qwen35moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp") / "qwen35moe.gguf"
    gguf_derive.derive("qwen35moe", str(model_path(gguf_derive.DEFAULT_SOURCE)), str(path))
    return path


@pytest.mark.parametrize("case", ORACLE["cases"], ids=lambda c: f"{len(c['prompt_ids'])}")
def test_head_is_llama_cpps(qwen35, head, case):
    """The target's rows over the prompt (all of them, as llama.cpp's target computes them for its MTP context), the
    head over the prompt's pairs (x_p, h_{p-1}), then K greedy steps each fed the head's own row: top logits bit for
    bit libllama's, the drafted ids its."""
    _head_is_llama_cpps(qwen35, head, case)


def test_moe_head_is_llama_cpps(qwen35moe):
    """The same on qwen35moe's derivative (its MTP block's FFN experts and a gated shared expert, as the target's):
    every recorded prompt, one head."""
    model, _ = loaded(qwen35moe)
    h = MtpHead(model)
    h.pack_weights()
    assert h.layer.experts is not None and h.layer.experts.sh_gate is not None
    for case in MOE_ORACLE["cases"]:
        _head_is_llama_cpps(qwen35moe, h, case)
    run = ("-m", qwen35moe, "-p", "The capital of France is", "-n", "16", "--temp", "0", "-c", "256", "--json")
    plain = json.loads(sharpi(*run).stdout)
    r = sharpi(*run, "--spec-type", "mtp")  # (through the CLI: the tokens of plain decoding, with drafts)
    assert r.returncode == 0 and json.loads(r.stdout)["tokens"] == plain["tokens"]
    assert json.loads(r.stdout)["speculative"]["drafted"] > 0


def _head_is_llama_cpps(path, head, case):
    model, _ = loaded(path)
    ids = case["prompt_ids"]
    T = len(ids)
    logits, h = model.forward(torch.tensor(ids), 0, model.new_cache(512), hidden=True)
    assert int(logits[-1].argmax()) == case["next"]
    cache = head.new_cache(512)
    _, hout = head.forward(ids, torch.cat((torch.zeros(1, h.shape[1]), h[:-1])), 0, cache)
    rows = [r[0] for r in case["prompt_rows"]]
    assert rows == [0, T // 2, T - 1]
    got = model.finish_logits(head.output(hout[rows], True))  # (llama.cpp's output rows, in one matmul)
    for (_, top, vals), row in zip(case["prompt_rows"], got):
        assert row[top].tolist() == vals
    x, hr = case["next"], h[-1:]
    for (s, top, vals), want in zip(case["draft_rows"], case["drafts"]):
        lg, ho = head.forward([x], hr, T + s, cache, decode=True)
        assert lg[-1][top].tolist() == vals and int(lg[-1].argmax()) == want
        x, hr = want, ho[-1:]


def test_hidden_rows_leave_the_logits_alone(qwen35):
    """forward(hidden=True) runs the last layer's FFN of the rows before last_n apart: the logits keep their bits (a
    prompt pass, a verify pass, a one-token pass), and the rows are those of a pass computing every row."""
    model, _ = loaded(qwen35)
    ids = torch.tensor(LONG["prompt_ids"][:100])
    a, b = model.new_cache(256), model.new_cache(256)
    plain = model.forward(ids, 0, a, last_n=1)
    lg, h = model.forward(ids, 0, b, last_n=1, hidden=True)
    assert torch.equal(lg, plain) and h.shape == (100, model.config.n_embd)
    _, every = model.forward(ids, 0, model.new_cache(256), hidden=True)
    assert torch.equal(h[:-1], every[:-1]) and torch.allclose(h[-1], every[-1], atol=1e-3)
    for rows in (ids[:5], ids[:1]):
        start = a.length
        lg, hr = model.forward(rows, start, b, decode=True, hidden=True)
        assert torch.equal(lg, model.forward(rows, start, a, decode=True)) and hr.shape == (len(rows), h.shape[1])


class _Steered:
    """The real head, its last row's logits pushed toward `path` on two steps of three: its drafts are accepted and
    rejected, its K / V and hidden rows real."""

    def __init__(self, head, path: list[int]):
        self.head, self.path, self.calls = head, path, 0

    def forward(self, tokens, h, start, cache, **kw):
        out = self.head.forward(tokens, h, start, cache, **kw)
        if out is None:
            return out
        logits, hout = out
        pos = start + len(tokens)  # (the position the last row predicts; the window starts at 0 here)
        self.calls += 1
        if pos < len(self.path) and self.calls % 3:
            logits = logits.clone()
            logits[-1, self.path[pos]] += 1000.0
        return logits, hout

    def __getattr__(self, name):
        return getattr(self.head, name)


def test_mtp_speculation_gives_the_plain_tokens(qwen35, head):
    """Greedy speculation with the MTP drafter emits llama.cpp's plain greedy tokens; the head's cache then holds the
    target's pairs (x_p, h_{p-1}) of the final history, h_{p-1} the row of the last target pass over p - 1: its K / V
    are a fresh pass's over those pairs (up to the rounding of another batching), which an off-by-one pairing or a
    missed rollback would not be. (The derivative's rows themselves move by tens of percent between a prompt pass and
    decoding passes: the reference takes the rows the generation's passes gave.)"""
    model, tok = loaded(qwen35)
    path = LONG["prompt_ids"] + LONG["tokens"]
    drafter = MtpDrafter(_Steered(head, path), head.new_cache(512), GREEDY)
    rows = {}
    observe = drafter.observe

    def record(start, tokens, h):
        rows.update({start + i: h[i] for i in range(len(tokens))})
        observe(start, tokens, h)

    drafter.observe = record
    gen = Generator(model, model.new_cache(512), tok, GREEDY, drafter=drafter, spec_n_max=4)
    res = gen.generate(LONG["prompt_ids"], n_predict=LONG["n_gen"])
    assert res.tokens == LONG["tokens"]
    assert 0 < res.spec.accepted < res.spec.drafted
    hist = gen.history
    n = len(hist)
    assert drafter.history[:n] == hist and drafter.cache.length >= n
    h = torch.stack([rows[p] for p in range(n)])
    fresh, shifted = head.new_cache(512), head.new_cache(512)
    head.forward(hist, torch.cat((torch.zeros(1, h.shape[1]), h[:-1])), 0, fresh, kv_only=True)
    head.forward(hist, h, 0, shifted, kv_only=True)  # (a pairing one row off)
    for read in (lambda c: c.k.read(0, n), lambda c: c.v.read(0, n)):
        ref = read(fresh)
        assert (read(drafter.cache) - ref).abs().max() < 1e-2 * ref.abs().max()
        assert (read(shifted) - ref).abs().amax(dim=(1, 2)).min() > 1e-2 * ref.abs().max()

    # a second call reusing the history's prefix, and an unbatched verify (SHARPI_SPEC_BATCH_VERIFY=0's path)
    more = list(res.tokens[:20])
    plain = Generator(model, model.new_cache(512), tok, GREEDY).generate(LONG["prompt_ids"] + more, n_predict=16)
    gen.batch_verify = False
    again = gen.generate(LONG["prompt_ids"] + more, n_predict=16)
    assert again.tokens == plain.tokens


def test_mtp_speculation_through_context_shifts(qwen35, head):
    """With --context-shift the head's cache shifts as the target's (K re-rotated) and speculation emits the plain
    tokens through the shifts."""
    model, tok = loaded(qwen35)
    ids = LONG["prompt_ids"][:60]
    plain = Generator(model, model.new_cache(128), tok, GREEDY, context_shift=True, n_keep=4)
    want = plain.generate(ids, n_predict=150)
    assert want.context_shifts >= 2
    drafter = MtpDrafter(head, head.new_cache(128), GREEDY)
    gen = Generator(model, model.new_cache(128), tok, GREEDY, drafter=drafter, spec_n_max=3, context_shift=True, n_keep=4)
    res = gen.generate(ids, n_predict=150)
    assert res.tokens == want.tokens and res.context_shifts == want.context_shifts
    assert drafter.history[:len(gen.history)] == gen.history


def test_sampled_mtp_drafts_record_their_law(qwen35, head):
    """At --temp > 0 each draft is drawn from the head's filtered law with the target's params, and q says so."""
    model, tok = loaded(qwen35)
    params = SamplingParams(temp=0.9, top_k=40)
    drafter = MtpDrafter(head, head.new_cache(512), params, torch.Generator().manual_seed(5))
    seen = []
    propose = drafter.propose

    def record(history, k):
        props, q = propose(history, k)
        seen.append((props, q))
        return props, q

    drafter.propose = record
    gen = Generator(model, model.new_cache(512), tok, params, seed=3, drafter=drafter, spec_n_max=3)
    res = gen.generate(LONG["prompt_ids"][:50], n_predict=24)
    assert len(res.tokens) == 24 and res.spec.drafted > 0
    for props, q in seen:
        assert q is not None and q.shape[0] == len(props)
        assert torch.allclose(q.sum(dim=1), torch.ones(len(props)), atol=1e-4)
        assert all(float(q[i, t]) > 0 for i, t in enumerate(props)) and int((q[0] > 0).sum()) <= 40


def test_models_without_a_head_are_refused(qwen35, tmp_path):
    model, _ = loaded(qwen35)
    c = copy.copy(model)
    c.gguf = SimpleNamespace(path="x.gguf", tensors={k: v for k, v in model.gguf.tensors.items() if "eh_proj" not in k})
    assert "nextn.eh_proj" in mtp_unavailable(c)
    c.gguf = SimpleNamespace(path="x.gguf", tensors=dict(model.gguf.tensors))
    c.config = model.config.__class__(**{**model.config.__dict__, "n_layer_nextn": 0})
    assert "no next-token-prediction" in mtp_unavailable(c)
    one_error_line(sharpi("--spec-type", "draft-mtp", "-p", "hi", "-n", "2"), code=1, contains="no next-token-prediction")
    one_error_line(sharpi("-m", qwen35, "--spec-type", "medusa", "-p", "hi"), contains="--spec-type")
    one_error_line(sharpi("-m", qwen35, "--spec-type", "draft-mtp", "-md", qwen35, "-p", "hi"), contains="exclusive")
    run = ("-m", qwen35, "-p", "The capital of France is", "-n", "24", "--temp", "0", "-c", "256", "--json")
    plain = json.loads(sharpi(*run).stdout)
    r = sharpi(*run, "--spec-type", "mtp")
    assert r.returncode == 0 and json.loads(r.stdout)["tokens"] == plain["tokens"]
    assert json.loads(r.stdout)["speculative"]["drafted"] > 0
    # with lookup first (the head then proposes where lookup finds nothing, having seen every target pass)
    r = sharpi(*run, "--spec-type", "mtp", "--draft-lookup")
    assert r.returncode == 0 and json.loads(r.stdout)["tokens"] == plain["tokens"]
    assert json.loads(r.stdout)["speculative"]["sources"]["mtp"]["steps"] > 0
    # by measured cost (greedy's default; the suite turns it off): the head, never right here, may be set aside
    # while lookup goes on; the tokens stay the plain ones
    for extra in ((), ("--draft-lookup",)):
        r = sharpi(*run, "--spec-type", "mtp", *extra, env={"SHARPI_SPEC_COST": "1"})
        assert r.returncode == 0 and json.loads(r.stdout)["tokens"] == plain["tokens"]
