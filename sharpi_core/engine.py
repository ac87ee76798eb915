"""Loading what a run needs: target (and draft) model, tokenizer, caches; draft/target vocab checks."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError
from .gguf_file import GGUFFile
from .models import Transformer, load_model
from .registry import Progress, resolve_model
from .tokenizer import Tokenizer

# Draft output layers are cut to this many token ids by default (--spec-draft-vocab -1), for
# byte-level BPE vocabularies larger than it (ids in merge order: the first ids are the common ones).
# Measured on Qwen2.5's 152k vocabulary: the first 64k ids cover 98% of the tokens of code and prose
# (48k: 96%, 32k: 93%), and the 0.5B draft's Q8_0 output matmul takes 1.35 ms instead of 3.5 ms.
DRAFT_HEAD_VOCAB = 65536

# llama.cpp's speculative compatibility rules (common/speculative.cpp)
VOCAB_MAX_SIZE_DIFF = 128
VOCAB_CHECK_START_ID = 5


@dataclass
class Loaded:
    path: Path
    gguf: GGUFFile
    model: Transformer
    tokenizer: Tokenizer
    load_ms: float

    @property
    def name(self) -> str:
        return str(self.gguf.get("general.name") or self.path.name)


def load(spec: str | None, progress: Progress | None = None, encoder: bool = True,
         overrides: dict | None = None, mmap: bool = True) -> Loaded:
    """encoder=False: the tokenizer's encoding tables are built on first use only (a draft model's
    tokenizer is compared with the target's, never asked to encode: ~0.25 s less for a Qwen draft);
    overrides: metadata values (--override-kv, gguf_file.parse_kv_overrides); mmap=False: --no-mmap."""
    path = resolve_model(spec, progress)
    t0 = time.perf_counter()
    gf = GGUFFile(path, overrides, mmap=mmap)
    model = load_model(gf)
    tok = Tokenizer.from_gguf(gf, lazy=not encoder)
    return Loaded(Path(path), gf, model, tok, (time.perf_counter() - t0) * 1000)


def check_draft_compatible(target: Tokenizer, draft: Tokenizer) -> None:
    """Raise UsageError naming the first difference that makes `draft` unusable for `target`."""
    if target.model_type != draft.model_type:
        raise UsageError(f"draft model tokenizer type '{draft.model_type}' differs from the target's "
                         f"'{target.model_type}'")
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos_id != draft.bos_id):
        raise UsageError(f"draft model BOS (add_bos={draft.add_bos}, id {draft.bos_id}) differs from the "
                         f"target's (add_bos={target.add_bos}, id {target.bos_id})")
    if target.add_eos != draft.add_eos or target.eos_id != draft.eos_id:
        raise UsageError(f"draft model EOS (id {draft.eos_id}) differs from the target's (id {target.eos_id})")
    diff = abs(target.n_vocab - draft.n_vocab)
    if diff > VOCAB_MAX_SIZE_DIFF:
        raise UsageError(f"draft vocab size {draft.n_vocab} differs from the target's {target.n_vocab} by {diff} "
                         f"(more than {VOCAB_MAX_SIZE_DIFF})")
    for i in range(VOCAB_CHECK_START_ID, min(target.n_vocab, draft.n_vocab)):
        if target.token_text(i) != draft.token_text(i):
            raise UsageError(f"draft vocab differs from the target's at token {i}: "
                             f"{draft.token_text(i)!r} vs {target.token_text(i)!r}")


def draft_head_vocab(requested: int, draft: Tokenizer) -> int | None:
    """--spec-draft-vocab: the number of token ids the draft's output layer computes (None: all).
    -1 = DRAFT_HEAD_VOCAB for a byte-level BPE ('gpt2') vocabulary larger than that, else all (a
    SentencePiece vocabulary is not ordered by frequency); 0 = all; N > 0 = the first N ids."""
    if requested == -1:
        requested = DRAFT_HEAD_VOCAB if draft.model_type == "gpt2" else 0
    return requested if 0 < requested < draft.n_vocab else None


def mtp_head(model):
    """The target's MTP layer as a draft head (models/mtp.py); one error line when it has none sharpi runs, or the
    model is not a CPU one (a GPU model's hidden rows stay on the device)."""
    from .models.mtp import MtpHead
    if not isinstance(model, Transformer):
        raise UsageError("--spec-type draft-mtp runs on the CPU: drop --device cuda / -ngl for it")
    return MtpHead(model)


def context_size(requested: int, model: Transformer) -> int:
    """-c: 0 means the model's training context."""
    if requested < 0:
        raise UsageError(f"invalid context size {requested}: must be >= 0 (0 = from the model)")
    if not requested and model.config.n_ctx_train < 1:
        raise UsageError("the model states no training context length: give a context size (-c N)")
    return requested or model.config.n_ctx_train


def check_text_fits(text: str, tok: Tokenizer, n_ctx: int) -> None:
    """check_prompt_fits before tokenizing, for a text so long that it cannot fit whatever its tokens (a 16 MB -f
    file took a minute and gigabytes to tokenize only to be refused)."""
    if len(text) >= n_ctx:
        least = tok.fewest_tokens(text)
        check_prompt_fits(least, n_ctx, count=f"at least {least} token{'s' * (least != 1)} ({len(text)} characters)")


def check_prompt_fits(n_prompt: int, n_ctx: int, flag: str = "-c/--ctx-size", count: str | None = None) -> None:
    """Room for the prompt and one generated token (speculation proposes less near a context's end)."""
    if n_prompt + 1 > n_ctx:
        count = count or f"{n_prompt} token{'s' * (n_prompt != 1)}"
        raise UsageError(f"prompt is {count}, which does not fit the context of {n_ctx} (at most "
                         f"{max(n_ctx - 1, 0)}, with room for one generated token); raise {flag}")
