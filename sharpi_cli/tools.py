"""The other commands: perplexity (and its multiple-choice scores, KL divergence) and tokenize."""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sharpi_core.choices import CACHE_TYPES
from sharpi_core.errors import UsageError
from sharpi_core.text import text_from_bytes

from .inputs import process_escapes, read_bytes, read_stdin, read_text, resolve_with_progress
from .log import log
from .options import RunOptions
from .runner import (apply_adapters, command_log, describe, load_model, lock_or_warn, rope_flags,
                     warn_past_training, warn_switches)
from .validate import (apply_load_mode, check_adapters, check_batch_sizes, check_flash_attn, check_log_colors,
                       check_output_file, check_rope, check_threads, check_v_cache, device_name, set_threads)


@dataclass
class ChoiceScores:
    """perplexity's multiple-choice scores (llama-perplexity's flags): which one, how many tasks, the data file
    (-bf: its bytes as they are), the sequences a batch (-np)."""
    hellaswag: bool = False
    hellaswag_tasks: int = 400
    winogrande: bool = False
    winogrande_tasks: int = 0
    multiple_choice: bool = False
    multiple_choice_tasks: int = 0
    binary_file: str | None = None
    parallel: int = 1

    def kind(self) -> str | None:
        on = [f for f in ("hellaswag", "winogrande", "multiple_choice") if getattr(self, f)]
        if len(on) > 1:
            raise UsageError(f"--{on[0].replace('_', '-')} and --{on[1].replace('_', '-')}: one score at a time")
        return on[0] if on else None


def check_logits_file(path: str | None) -> None:
    """--kl-divergence-base FILE, to be written: a file already there that is not one of log-probabilities (its
    `_logits_` header: an earlier base) is the user's, refused rather than replaced (llama-perplexity replaces it)."""
    from sharpi_core.perplexity import LOGITS_MAGIC
    if path is None:
        return
    p = Path(path).expanduser()
    if not p.is_file():  # (not there yet; a device or FIFO is files.py's to refuse when the write comes)
        return
    try:
        with open(p, "rb") as f:
            head = f.read(len(LOGITS_MAGIC))
    except OSError:  # (not there, or not readable: the write says what goes wrong)
        return
    if head and head != LOGITS_MAGIC:
        raise UsageError(f"--kl-divergence-base {path} exists and is not a file of log-probabilities: it would be "
                         "overwritten; give the output another name")


def perplexity_cmd(model, file, ctx_size, chunks, ctk, ctv, threads, flash_attn="auto",
                   opts: RunOptions | None = None, kld_base: str | None = None, kld: bool = False,
                   output_type: int = 0, scores: ChoiceScores | None = None) -> int:
    """opts: the --lora*, --control-vector*, --rope-*, --yarn-*, --override-kv and log flags, -b, -ub, -tb, -ngl,
    -dev and the load flags (RunOptions' fields); kld_base: --kl-divergence-base's file, written (or read, kld:
    --kl-divergence); scores: --hellaswag, --winogrande or --multiple-choice instead of the perplexity."""
    o = opts or RunOptions(model=model)
    sc = scores or ChoiceScores()
    base = [("--kl-divergence-base", kld_base)]
    with command_log(o, [("--log-file", o.log_file), *([] if kld else base)],
                     also_read=[("-f/--file", file), ("-bf/--binary-file", sc.binary_file), *(base if kld else [])]):
        return _perplexity(model, file, ctx_size, chunks, ctk, ctv, threads, flash_attn, o, kld_base, kld, output_type,
                           sc)


def _perplexity(model, file, ctx_size, chunks, ctk, ctv, threads, flash_attn, o: RunOptions, kld_base: str | None,
                kld: bool, output_type: int, sc: ChoiceScores) -> int:
    from sharpi_core.perplexity import (Passes, chunk_count, kl_divergence, perplexity, read_base_header,
                                        save_logprobs)
    kind = sc.kind()
    if kind is None and sc.binary_file is not None:
        raise UsageError("-bf/--binary-file is the data of --hellaswag, --winogrande or --multiple-choice: give one "
                         "(a text's perplexity: -f)")
    if kind is not None and (kld or kld_base is not None):
        raise UsageError(f"--{kind.replace('_', '-')} and --kl-divergence{'' if kld else '-base'}: one at a time")
    if kind is not None and (file is None) == (sc.binary_file is None):
        raise UsageError(f"--{kind.replace('_', '-')} reads its tasks from one file: -f FILE or -bf FILE")
    if kld and kld_base is None:
        raise UsageError("--kl-divergence compares with the log-probabilities of --kl-divergence-base FILE: give it")
    if not kld and file is None and kind is None:
        raise UsageError("perplexity needs a text: -f/--file")
    if not kld:  # (a base file is written beside its name, then renamed: refused now, not after every chunk)
        check_output_file(kld_base, "--kl-divergence-base", beside=True)
        check_logits_file(kld_base)
    for flag, v in (("-ctk", ctk), ("-ctv", ctv)):
        if v not in CACHE_TYPES:
            raise UsageError(f"invalid {flag} '{v}': choose from {', '.join(CACHE_TYPES)}")
    flash_attn = check_flash_attn(flash_attn)
    check_v_cache(flash_attn, ("-ctv", ctv))
    if ctx_size < 3:  # the second half of each chunk is scored, after the first token of it
        raise UsageError(f"invalid -c/--ctx-size {ctx_size}: must be >= 3")
    if chunks == 0:
        raise UsageError("invalid --chunks 0: must be >= 1 (-1 = all)")
    if output_type not in (0, 1):
        raise UsageError(f"invalid --ppl-output-type {output_type}: 0 or 1")
    threads = check_threads(threads)
    if o.threads_batch != -1:  # (llama.cpp evaluates a batch of several tokens on -tb's threads: all of these)
        threads = check_threads(o.threads_batch, "-tb/--threads-batch")
    check_rope(o)
    check_log_colors(o)
    n_pass = check_perplexity_placement(o, ctx_size)
    warn_switches()
    if kind is not None:
        return choice_scores(model, kind, sc, file, ctx_size, ctk, ctv, threads, flash_attn, o)
    set_threads(threads)
    if kld:
        base_ctx, _, base_chunks = read_base_header(kld_base)[:3]  # (a file that is none is refused before the model loads)
        unused = [f for f, on in ((f"-f {file}", file is not None), (f"--chunks {chunks}", chunks not in (-1, base_chunks)))
                  if on]
        if unused:  # (llama-perplexity reads them from the file too)
            log(f"warning: {', '.join(unused)} not used: --kl-divergence scores the text of {kld_base}, its "
                f"{base_chunks} chunk{'s' * (base_chunks != 1)} of {base_ctx} tokens")
    else:
        text = read_text(file, lenient=True)
        if text.endswith("\n"):  # (llama.cpp's -f drops one trailing newline, as a one-shot prompt's)
            text = text[:-1]
    m = load_scored_model(model, flash_attn, o, base_ctx if kld else ctx_size, ctk, ctv)
    bos = m.tokenizer.bos_id if m.tokenizer.add_bos else None
    if kld:
        warn_past_training(m.model, base_ctx)
        n_pass = Passes.of(o.batch_size, o.ubatch_size, ctx_size, base_ctx)
        kl_divergence(m.model, kld_base, bos, ctk, ctv, info=log, n_pass=n_pass)
        return 0
    t0 = time.perf_counter()
    ids = m.tokenizer.encode(text, add_special=True, parse_special=False)
    n_chunks = chunk_count(len(ids), ctx_size, chunks)
    warn_past_training(m.model, ctx_size)  # (after the text is found long enough: a text too short is one line)
    log(f"perplexity: tokenized {len(ids)} tokens in {(time.perf_counter() - t0) * 1000:.0f} ms; "
        f"calculating over {n_chunks} chunks of {ctx_size}")
    n_seq = max(1, o.batch_size // ctx_size)  # (llama-perplexity's sequences a batch: its type-1 lines count by them)

    def on_chunk(i, nll, nll2, count):  # (the sums so far: llama-perplexity's lines of output type 0 or 1)
        if output_type == 0:
            print(f"[{i + 1}]{math.exp(nll / count):.4f},", end="", flush=True)
            return
        av = nll / count
        av2 = nll2 / count - av * av
        av2 = math.sqrt(av2 / (count - 1)) if av2 > 0 else av2
        print(f"{i // n_seq * n_seq * ctx_size:8d}  {math.exp(av):.4f}  {av:4f}  {av2:4f}", flush=True)

    if kld_base is not None:  # (llama-perplexity's likelihoods in float arithmetic, the file written)
        r = save_logprobs(m.model, ids, ctx_size, chunks, kld_base, bos, ctk, ctv, on_chunk=on_chunk, n_pass=n_pass)
    else:
        r = perplexity(m.model, ids, ctx_size, chunks, bos_id=bos, type_k=ctk, type_v=ctv, on_chunk=on_chunk,
                       n_pass=n_pass)
    print()
    if r.err > 0:
        print(f"Final estimate: PPL = {r.ppl:.4f} +/- {r.err:.5f}")
    else:  # (one scored token, or all alike: llama-perplexity prints no estimate then)
        print("Unexpected negative standard deviation of log(prob)")
    return 0


def choice_scores(model, kind: str, sc: ChoiceScores, file, ctx_size, ctk, ctv, threads, flash_attn,
                  o: RunOptions) -> int:
    """--hellaswag, --winogrande or --multiple-choice: the tasks of -f (which, as llama.cpp reads -f, loses one
    trailing newline) or -bf, in sequences of a context as llama-perplexity sizes it (-c x max(4, -np) positions,
    rounded up to 256) that each task must fit."""
    from sharpi_core import choice
    n_tasks = {"hellaswag": sc.hellaswag_tasks, "winogrande": sc.winogrande_tasks,
               "multiple_choice": sc.multiple_choice_tasks}[kind]
    if n_tasks < 0:
        raise UsageError(f"invalid --{kind.replace('_', '-')}-tasks {n_tasks}: must be >= 0")
    if sc.parallel < 1:
        raise UsageError(f"invalid -np/--parallel {sc.parallel}: must be >= 1")
    data = read_bytes(file if sc.binary_file is None else sc.binary_file)
    if sc.binary_file is None and data.endswith(b"\n"):
        data = data[:-1]
    n_seq = max(4, sc.parallel)
    # (-b at most the sequences' context before llama_context pads it to 256: the main() of llama-perplexity the
    # fixtures come from, llama-cpp-python 0.3.36's, sets n_ctx = n_parallel * -c, then n_batch = min(-b, n_ctx))
    st = choice.Setup(-(-n_seq * ctx_size // 256) * 256, n_seq, min(o.batch_size, n_seq * ctx_size), o.ubatch_size,
                      ctk, ctv)
    set_threads(threads)
    m = load_scored_model(model, flash_attn, o, st.n_ctx, ctk, ctv)

    def encode(text: str) -> list[int]:
        return m.tokenizer.encode(text, add_special=True, parse_special=False)

    warned = []

    def out(line: str) -> None:
        if not warned:  # (once the tasks are read: a file that has none is one error line)
            warn_past_training(m.model, ctx_size)
            warned.append(True)
        print(line, flush=True)

    run = {"hellaswag": choice.run_hellaswag, "winogrande": choice.run_winogrande,
           "multiple_choice": choice.run_multiple_choice}[kind]
    run(m.model, encode, data if kind == "multiple_choice" else text_from_bytes(data)[0], n_tasks, st, out, log)
    return 0


def load_scored_model(model, flash_attn: str, o: RunOptions, n_ctx: int, ctk: str, ctv: str):
    """The model perplexity and the scores evaluate, as run loads it: --rope-*, --override-kv, --check-tensors,
    the load flags, --mlock, then the adapters; -v describes it."""
    check_adapters(o)
    m = load_model(model, flash_attn, rope=rope_flags(o), overrides=o.kv_overrides, mmap=o.mmap, check=o.check_tensors)
    if o.mlock:
        lock_or_warn()
    apply_adapters(o, m.model)
    if o.verbose:
        c = m.model.config
        rope = ""
        if hasattr(c, "rope_base"):
            kind = "no" if c.rope_scaling in (None, "none") else c.rope_scaling
            rope = f", RoPE base {c.rope_base:g} freq scale {c.rope_freq_scale:g} ({kind} scaling)"
        log(f"sharpi: model {describe(m, n_ctx, ctk, ctv)}{rope}")
    return m


def check_perplexity_placement(o: RunOptions, n_ctx: int):
    """perplexity's -b, -ub, -ngl, -dev and load flags -> the rows of a chunk's passes (perplexity.Passes), as
    llama-perplexity evaluates a chunk: in batches of -b rows where -b < -c, each in passes of -ub rows, and where a
    batch holds one chunk in passes of -ub rows; where it holds several, each pass takes -ub / chunks rows of every
    chunk (attention sees a chunk's rows per pass, as llama.cpp's streams do)."""
    from sharpi_core.perplexity import Passes
    check_batch_sizes(o)
    if device_name(o.device) == "cuda":
        raise UsageError("perplexity runs on the CPU: no -dev/--device cuda")
    if o.n_gpu_layers not in (None, 0):
        log("warning: -ngl has no effect: perplexity runs on the CPU")
    apply_load_mode(o)
    return Passes.of(o.batch_size, o.ubatch_size, n_ctx)


def tokenize_cmd(model, prompt, file, ids_only, no_bos, no_parse_special, escape: bool = True, stdin: bool = False,
                 show_count: bool = False) -> int:
    """llama-tokenize: the text of --stdin (read once the model loaded), else -f (read verbatim, a trailing newline
    included; `-` is stdin), else -p; escapes processed in each unless --no-escape. The pieces are written as
    their bytes, as llama-tokenize prints them."""
    given = [f for f, v in (("--stdin", stdin or None), ("-f/--file", file), ("-p/--prompt", prompt)) if v is not None]
    if not given:
        raise UsageError("tokenize needs one of --stdin, -f/--file or -p/--prompt")
    if len(given) > 1:  # (llama-tokenize takes --stdin before -f before -p, without a word)
        log(f"warning: {given[0]} gives the text to tokenize; {' and '.join(given[1:])} not used")
    if not stdin and file is not None:
        prompt = read_stdin() if file == "-" else read_text(file, lenient=True)
    from sharpi_core.gguf_file import GGUFFile
    from sharpi_core.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(GGUFFile(resolve_with_progress(model)))
    if stdin:
        prompt = read_stdin()
    if escape:
        prompt = process_escapes(prompt)
    # (llama-tokenize's add_special: the vocabulary's add_bos and not --no-bos; an EOS only beside a BOS so)
    ids = tok.encode(prompt, add_special=tok.add_bos and not no_bos, parse_special=not no_parse_special)
    if ids_only:
        print("[" + ", ".join(str(i) for i in ids) + "]")
    else:
        out = getattr(sys.stdout, "buffer", None)
        for i in ids:
            if out is None:  # (a text-only stdout)
                print(f"{i:6d} -> '{tok.token_bytes(i).decode('utf-8', errors='replace')}'")
            else:
                sys.stdout.flush()
                out.write(f"{i:6d} -> '".encode() + tok.token_bytes(i) + b"'\n")
        if out is not None:
            out.flush()
    if show_count:
        print(f"Total number of tokens: {len(ids)}")
    return 0
