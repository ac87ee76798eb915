"""Shared test fixtures: llama.cpp's reference outputs and the real models (fetched via the registry)."""
from __future__ import annotations

import json
import os
import signal
from functools import lru_cache
from pathlib import Path

import pytest

# speculation by measured cost (speculative.SpecCost) makes which steps speculate depend on timing: the tests that
# count passes and proposals (and the CLI runs they start) run without it; tests/test_spec_cost.py turns it on
os.environ["SHARPI_SPEC_COST"] = "0"

ROOT = Path(__file__).resolve().parents[1]
FIXTURES_DIR = Path(os.environ.get("SHARPI_FIXTURES", ROOT.parent / "shared" / "fixtures"))

SMOL = "smollm2-135m-instruct-q4_1"
GEMMA = "gemma3-270m-q4_k_m"
QWEN05 = "qwen2.5-coder-0.5b-instruct-q4_k_m"
QWEN15 = "qwen2.5-coder-1.5b-instruct-q4_k_m"
ALL_MODELS = [SMOL, GEMMA, QWEN05, QWEN15]


def model_param(name: str):
    """pytest.param for a model name: SmolLM2 always runs, the bigger ones are marked slow."""
    return pytest.param(name, id=name.split("-")[0] + "-" + name.split("-")[1],
                        marks=() if name == SMOL else (pytest.mark.slow,))


MODEL_PARAMS = [model_param(n) for n in ALL_MODELS]


@lru_cache(maxsize=None)
def reference() -> dict:
    p = FIXTURES_DIR / "llamacpp_reference.json"
    if not p.is_file():
        if os.environ.get("CI"):  # CI has shared/ beside the clone: a missing oracle is a failure
            pytest.fail(f"llama.cpp fixtures not found at {FIXTURES_DIR}")
        pytest.skip(f"llama.cpp fixtures not found at {FIXTURES_DIR}")
    return json.loads(p.read_text())


@lru_cache(maxsize=None)
def model_path(name: str) -> Path:
    from sharpi_core.registry import pull
    return pull(name)


_loaded: dict[str, object] = {}  # least recently used first
LOADED_MAX = 4  # the four real models at once (~2 GB): the suite alternates between them; derived files come and go


def loaded(name: str | Path):
    """(model, tokenizer) for a registry model (or a GGUF at a Path), the LOADED_MAX most recently used
    kept (Qwen 1.5B takes 3-5 s to load and repack). Tests that change a model load their own copy."""
    if name in _loaded:
        _loaded[name] = _loaded.pop(name)
    else:
        while len(_loaded) >= LOADED_MAX:
            _loaded.pop(next(iter(_loaded)))
        from sharpi_core.gguf_file import GGUFFile
        from sharpi_core.models import load_model
        from sharpi_core.tokenizer import Tokenizer
        gf = GGUFFile(name if isinstance(name, Path) else model_path(name))
        _loaded[name] = (load_model(gf), Tokenizer.from_gguf(gf))
    return _loaded[name]


def ctrl_c_default() -> None:
    """preexec_fn for a child that a test sends Ctrl-C: SIGINT's default disposition, a terminal user's. A process
    inherits an ignored SIGINT (a suite started as `cmd &` by a shell without job control ignores it, and so would
    every sharpi it starts, keeping the ignore through startup as a background job's should)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# test_simt.py's tests that wait for the GPU's kernels run in the emulator, in processes of their own
EMULATED = ("test_kernel_tests_pass_on_the_emulated_gpu", "test_model_tests_pass_on_the_emulated_gpu")


def pytest_collection_modifyitems(session, config, items):
    """The emulated GPU's kernel and model tests (in the background, at the lowest priority) are waited for
    last, after every other test, not in the middle of the run."""
    last = [i for i in items if i.name.startswith(EMULATED)]
    items[:] = [i for i in items if i not in last] + last


def pytest_collection_finish(session):
    """The emulated GPU's tests (test_simt.py's kernel and model runs) start in the background as soon as they
    are selected: see test_simt.start_early. Not in a pytest-xdist worker: every worker collects every test, so
    each would start them, and only the one that runs a test waits for its own."""
    if session.config.option.collectonly or hasattr(session.config, "workerinput"):
        return
    for item in session.items:
        if item.name.startswith(EMULATED):
            item.module.start_early({i.name for i in session.items})
            break
