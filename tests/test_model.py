"""Engine core against llama.cpp: greedy continuations, perplexity, KV cache truncation."""
from __future__ import annotations

import pytest
import torch

from conftest import FIXTURES_DIR, MODEL_PARAMS, SMOL, loaded, reference
from sharpi_core.perplexity import perplexity

N_COMPARE = 16
NEAR_TIE = 1e-3  # relative gap between the top two logits under which llama.cpp may pick either


def greedy(model, tok, prompt: str, n: int):
    """Plain greedy decode; returns the tokens and the top-2 relative margin at each step."""
    ids = tok.encode(prompt)
    cache = model.new_cache(512)
    logits = model.forward(torch.tensor(ids), 0, cache, last_n=1)[-1]
    out, margins = [], []
    for _ in range(n):
        top = logits.topk(2).values
        margins.append(float((top[0] - top[1]) / top[0].abs().clamp_min(1e-9)))
        t = int(logits.argmax())
        out.append(t)
        if t in tok.eog_ids:
            break
        logits = model.forward(torch.tensor([t]), cache.length, cache)[-1]
    return out, margins


@pytest.mark.parametrize("name", MODEL_PARAMS)
def test_greedy_matches_llama_cpp(name):
    model, tok = loaded(name)
    failures = []
    for case in reference()[name]["greedy"]:
        ids, margins = greedy(model, tok, case["prompt"], N_COMPARE)
        ours = tok.decode(ids)
        want = case["text"]
        if want.startswith(ours) or ours.startswith(want.rstrip("\n")):
            continue
        # find the first diverging token and allow it only at a near tie
        for j in range(len(ids)):
            if not want.startswith(tok.decode(ids[: j + 1])):
                break
        if margins[j] < NEAR_TIE:
            print(f"{name}: near tie at token {j} (relative margin {margins[j]:.2e}) for {case['prompt']!r}")
            continue
        failures.append(f"{case['prompt']!r}: ours {ours!r} vs llama.cpp {want[:len(ours) + 10]!r} "
                        f"(diverges at token {j}, margin {margins[j]:.2e})")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", MODEL_PARAMS)
@pytest.mark.parametrize("cache_type,tol", [("f32", 0.01), ("q8_0", 0.015)])
def test_perplexity_matches_llama_cpp(name, cache_type, tol):
    model, tok = loaded(name)
    ref = reference()[name]["perplexity"]
    text = (FIXTURES_DIR / ref["file"]).read_text()
    ids = tok.encode(text, add_special=True, parse_special=False)
    r = perplexity(model, ids, ref["ctx"], ref["chunks"], bos_id=tok.bos_id if tok.add_bos else None,
                   type_k=cache_type, type_v=cache_type)
    assert r.n_scored == 504
    rel = abs(r.ppl - ref["ppl"]) / ref["ppl"]
    print(f"{name} {cache_type}: ppl {r.ppl:.4f} vs llama.cpp {ref['ppl']:.4f} ({rel:.2%})")
    assert rel < tol, f"ppl {r.ppl:.4f} vs llama.cpp {ref['ppl']:.4f}: {rel:.2%} off (limit {tol:.1%})"


@pytest.mark.parametrize("cache_type", ["f32", "f16", "q8_0"])
def test_truncate_then_refeed_reproduces_logits(cache_type):
    model, tok = loaded(SMOL)
    ids = tok.encode("The quick brown fox jumps over the lazy dog because it wanted to see")
    cache = model.new_cache(64, cache_type, cache_type)
    full = model.forward(torch.tensor(ids), 0, cache)
    assert cache.length == len(ids)
    cut = 5
    cache.truncate(cut)
    assert cache.length == cut
    again = model.forward(torch.tensor(ids[cut:]), cut, cache)
    torch.testing.assert_close(again, full[cut:], rtol=0, atol=1e-4)
    # one token at a time gives the same logits as the batched pass (within fp32 rounding)
    cache.truncate(cut)
    steps = torch.cat([model.forward(torch.tensor([t]), cut + i, cache) for i, t in enumerate(ids[cut:])])
    torch.testing.assert_close(steps, full[cut:], rtol=1e-3, atol=2e-3)


def test_cache_rejects_overflow_and_bad_truncate():
    from sharpi_core.errors import SharpiError
    model, tok = loaded(SMOL)
    cache = model.new_cache(4)
    with pytest.raises(SharpiError, match="context"):
        model.forward(torch.tensor([1, 2, 3, 4, 5]), 0, cache)
    with pytest.raises(ValueError):
        cache.truncate(1)
