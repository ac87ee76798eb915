"""What each command does once its flags are parsed: validate, load, call the engine, report."""
from __future__ import annotations

import json
import os
import random
import sys
import time
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from sharpi_core.errors import SharpiError, UsageError
from sharpi_core.text import without_surrogates

from . import log as logs
from .inputs import (chat_template_for, check_outputs, process_escapes, read_chat_options, read_grammar, read_prompt,
                     reasoning_budget, resolve_with_progress, reverse_prompt_tokens)
from .log import log, log_colors, log_prefix, log_to_file
from .options import RunOptions, control_files, draft_cache_types, lora_files
from .validate import apply_cpu_params, check_device, check_model_files, model_sampling_defaults, set_threads, validate


def warn_past_training(model, n_ctx: int) -> None:
    """llama.cpp says so too as it makes a context (llama-perplexity's included): positions past it are untrained."""
    if n_ctx > model.config.n_ctx_train > 0:
        log(f"warning: the model was trained on only {model.config.n_ctx_train} context tokens ({n_ctx} asked for)")


def reads_typed_lines(o: RunOptions) -> bool:
    """The run may read lines typed at the terminal with line editing (a chat or -i; known for sure only once the
    model's template is read; --simple-io leaves the terminal alone)."""
    return not o.simple_io and not o.json_out and (o.interactive or o.conversation is not False)


@contextmanager
def command_log(o: RunOptions, outputs: list[tuple[str, str | None]] | None = None,
                also_read: list[tuple[str, str | None]] = ()):
    """A command's log as -lv, --log-disable, --log-prefix, --log-timestamps, --log-colors and --log-file set it
    (run's and perplexity's): the log file opened once check_outputs (outputs, also_read: its) finds it is no file
    the command reads, an error inside written to it too, everything back to the defaults at the end."""
    prefixed = o.log_prefix if o.log_prefix is not None else o.log_timestamps
    logs.configure(not o.log_disable and o.verbosity >= 2, o.verbosity,
                   (bool(o.log_timestamps), log_colors(o.log_colors)) if prefixed else None)
    if o.verbosity >= 4:
        o.verbose = True
    try:
        check_outputs(o, outputs, also_read)
        if o.log_file is not None:  # (llama.cpp's --log-file: the log also goes there, the file written anew)
            try:
                logs.write_to(o.log_file)
            except OSError as e:
                raise SharpiError(f"cannot write the log file {o.log_file}: {e.strerror}") from None
        try:
            yield
        except SharpiError as e:
            (e.log_head, e.log_tail), (file_head, _) = log_prefix("E")  # (main prints the line: after this run's log)
            log_to_file(f"{file_head}error: {e}")
            raise
    finally:
        logs.reset()


def run(o: RunOptions) -> int:
    repack = os.environ.get("SHARPI_CPU_REPACK")
    if not o.repack:  # --no-repack: SHARPI_CPU_REPACK=0 while this run makes its weights
        os.environ["SHARPI_CPU_REPACK"] = "0"
    from contextlib import nullcontext
    from sharpi_core.registry import exit_on_termination
    from .chat import hidden_typing
    typed = reads_typed_lines(o)
    try:
        # a run that reads typed lines keeps the terminal's echo off from here on, as llama.cpp's console does from
        # its start: text typed while the model loads or a prompt is evaluated is shown once, by line editing at
        # the prompt, not also where the terminal's echo put it then; SIGTERM / SIGHUP exit through Python, which
        # turns the echo back on (their default action would leave it off)
        with command_log(o), exit_on_termination() if typed else nullcontext(), hidden_typing(typed):
            return _run(o)
    finally:
        if repack is None:
            os.environ.pop("SHARPI_CPU_REPACK", None)
        else:
            os.environ["SHARPI_CPU_REPACK"] = repack


def synthetic_rates(o: RunOptions, n_max: int) -> list[float] | None:
    """--spec-synth-len / --spec-synth-rates for proposals of up to n_max tokens (0: no speculation) -> the rates,
    announced as llama.cpp announces them, or None."""
    if o.spec_synth_len is None and o.spec_synth_rates is None:
        return None
    if any(v is not None for v in (o.grammar, o.grammar_file, o.json_schema, o.json_schema_file)) or \
            o.reasoning_budget >= 0:  # (their state follows the tokens the model chose; accepted proposals are not)
        raise UsageError("--spec-synth-len/--spec-synth-rates: not with a grammar, JSON schema or reasoning budget")
    from sharpi_core.speculative.synthetic import parse_rates, resolve_rates
    try:
        rates = resolve_rates(o.spec_synth_len, parse_rates(o.spec_synth_rates) if o.spec_synth_rates else None,
                              n_max)
    except ValueError as e:
        hint = " (-md, --draft-lookup or --spec-type)" if n_max == 0 else ""
        raise UsageError(f"--spec-synth-len/--spec-synth-rates: {e}{hint}") from None
    log("warning: synthetic speculative acceptance is enabled for benchmarking; generated output is not valid")
    log(f"sharpi: synthetic acceptance: n_max = {len(rates)}, mean length = {1 + sum(rates):.6f}, rates = "
        f"[{', '.join(f'{r:.6g}' for r in rates)}]")
    return rates


def lock_memory() -> str | None:
    """--mlock: every page the process has mapped (the models' weights: the GGUF's mapping and the repacked
    ones) locked in memory, so none is paged out (llama.cpp's --mlock). None, or why it could not be done."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mlockall(1) == 0:  # MCL_CURRENT
            return None
        return os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as e:  # (no mlockall on this system)
        return str(e)


def lock_or_warn() -> None:
    """lock_memory for --mlock (run and perplexity), a warning where the system refuses."""
    if (why := lock_memory()) is not None:
        log(f"warning: --mlock: the model could not be locked in memory ({why}); raise the limit (ulimit -l) or "
            "run without --mlock")


def warn_switches() -> None:
    """A SHARPI_* switch set to neither on nor off keeps its default: say so (a bisecting run would mislead)."""
    from sharpi_core.switches import unknown
    for item in unknown():
        log(f"warning: {item}: neither 0/off/false/no nor 1/on/true/yes; the switch keeps its default")


def _run(o: RunOptions) -> int:
    validate(o)
    warn_switches()
    check_model_files(o)
    check_device(o)
    prompt = read_prompt(o)
    read_chat_options(o)
    grammar = read_grammar(o)
    set_threads(apply_cpu_params(o))  # (torch's first import: a bad command line is refused without it)
    as_text = process_escapes if o.escape else without_surrogates  # (argv's undecodable bytes: U+FFFD, as llama.cpp)
    o.reverse_prompt = [as_text(r) for r in o.reverse_prompt]
    o.in_prefix, o.in_suffix = as_text(o.in_prefix), as_text(o.in_suffix)

    from sharpi_core import engine
    from sharpi_core.generate import Generator
    from sharpi_core.sampling import SamplingParams, describe_chain

    target = load_model(o.model, o.flash_attn, o.n_gpu_layers if o.device == "cuda" else 0, rope=rope_flags(o),
                   overrides=o.kv_overrides, mmap=o.mmap, check=o.check_tensors)
    apply_adapters(o, target.model)
    model_sampling_defaults(o, target.gguf)
    if o.context_shift and not target.model.config.can_shift:  # (llama.cpp's common_init_from_params, its server)
        log(f"warning: KV cache shifting is not supported for a {target.model.config.arch} model (M-RoPE), disabling "
            "KV cache shifting: generation stops at a full context")
        o.context_shift = False
        o.n_predict = max(o.n_predict, -1)
    tok = target.tokenizer
    n_ctx = engine.context_size(o.ctx_size, target.model)
    if prompt == "" and not o.interactive and (o.conversation or o.single_turn or o.system_prompt or o.chat_template):
        prompt = None  # (llama.cpp's chats: an empty prompt is no message; the first one is read)
    if (o.system_prompt or o.chat_template) and prompt is not None and o.conversation is None:
        o.single_turn = True  # a system prompt or a template asks for a chat: the prompt is one user turn
    o.chat_template = None if o.interactive else chat_template_for(o, tok)
    chat = o.chat_template is not None and o.conversation is not False
    interactive = (o.conversation is True or (prompt is None and chat)) and not o.json_out
    if o.single_turn:  # (-st -p "/read FILE": llama-cli runs the command, then reads the message)
        from .chat import parse_command
        interactive = prompt is None or parse_command(prompt) is not None
    if interactive and o.json_out:  # (-st with no message given: it would be typed, and a typed chat prints text)
        raise UsageError("--json prints the reply to one message given with -p, -f or on stdin, not typed")
    if o.interactive:
        interactive, prompt = False, prompt or ""
    if o.output_file and not (interactive or o.single_turn):
        log(f"warning: -o {o.output_file}: a chat's transcript (-cnv, -st); this run is not a chat, nothing written")
    if o.multiline_input and not (interactive or o.interactive):
        log("warning: -mli/--multiline-input is for typed input (-cnv, -i); this run reads none")
    if prompt is None and not interactive:
        raise UsageError("no prompt: pass -p/--prompt, -f/--file, or pipe text on stdin"
                         + ("" if o.chat_template else " (this model has no chat template: -cnv chats in chatml, "
                            "--chat-template in another)"))

    for tid, _ in o.logit_bias:
        if not 0 <= tid < tok.n_vocab:
            raise UsageError(f"-l/--logit-bias token id {tid} is outside the vocabulary (0..{tok.n_vocab - 1})")
    if o.ignore_eos:  # llama.cpp: a -inf logit bias on every end-of-generation token
        o.logit_bias = tuple(o.logit_bias) + tuple((t, float("-inf")) for t in sorted(tok.eog_ids))
    total: dict[int, np.float32] = {}
    for tid, b in o.logit_bias:
        with np.errstate(over="ignore", invalid="ignore"):  # added in float32, as the sampler adds them
            total[tid] = total.get(tid, np.float32(0)) + np.float32(b)
        if np.isnan(total[tid]):  # +inf and -inf: a NaN logit, which no sampler can order
            raise UsageError(f"-l/--logit-bias: token {tid} gets both +inf and -inf"
                             + (" (--ignore-eos bans it)" if o.ignore_eos and tid in tok.eog_ids else ""))
    # -1, and llama.cpp's LLAMA_DEFAULT_SEED (0xFFFFFFFF, what -1 becomes there), mean a random seed
    seed = o.seed if 0 <= o.seed < 2**32 - 1 else random.SystemRandom().randrange(2**31)
    params = SamplingParams(temp=o.temp, top_k=o.top_k, top_p=o.top_p, min_p=o.min_p, min_keep=o.min_keep,
                            repeat_penalty=o.repeat_penalty,
                            repeat_last_n=n_ctx if o.repeat_last_n == -1 else o.repeat_last_n,
                            presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty,
                            logit_bias=o.logit_bias, top_n_sigma=o.top_n_sigma, typical_p=o.typical_p,
                            xtc_probability=o.xtc_probability, xtc_threshold=o.xtc_threshold,
                            dynatemp_range=o.dynatemp_range, dynatemp_exponent=o.dynatemp_exponent,
                            dry_multiplier=o.dry_multiplier, dry_base=o.dry_base, dry_allowed_length=o.dry_allowed_length,
                            dry_penalty_last_n=n_ctx if o.dry_penalty_last_n == -1 else o.dry_penalty_last_n,
                            samplers=o.samplers, mirostat=o.mirostat, mirostat_tau=o.mirostat_ent,
                            mirostat_eta=o.mirostat_lr, adaptive_target=o.adaptive_target,
                            adaptive_decay=o.adaptive_decay)
    if params.has_dry:  # the breakers as llama.cpp tokenizes them (a pass over the vocabulary)
        from sharpi_core import dry
        strings = list(dry.DEFAULT_BREAKERS)
        if o.dry_sequence_breaker:  # llama.cpp: the first one replaces the defaults, 'none' drops those before it
            strings = []
            for v in o.dry_sequence_breaker:
                strings = [] if v == "none" else strings + [process_escapes(v) if o.escape else v]
        params = replace(params, dry_breakers=dry.breakers(tok, strings))
    if "infill" in params.samplers:
        from sharpi_core.sampling import InfillVocab
        params = replace(params, infill=InfillVocab.of(tok))

    drafter, draft = None, None
    n_max, n_min = o.spec_draft_n_max, o.spec_draft_n_min
    o.draft_lookup = wants_lookup(o)
    if o.model_draft or o.draft_lookup or o.spec_type or o.spec_ngram:
        n_ctx_d = draft_ctx(o, n_ctx) if o.model_draft else n_ctx
        window = min(n_ctx, n_ctx_d)
        if window < 2:
            flag = "-cd/--ctx-size-draft" if n_ctx_d < n_ctx else "-c/--ctx-size"
            raise UsageError(f"a context of {window} token{'s' * (window != 1)} leaves no room to speculate (raise {flag})")
        if o.spec_draft_n_max > window // 2:
            log(f"warning: --spec-draft-n-max {o.spec_draft_n_max} does not fit the context windows "
                f"({window} tokens); clamped to {window // 2}")
            o.spec_draft_n_max = window // 2
            o.spec_draft_n_min = min(o.spec_draft_n_min, o.spec_draft_n_max)
        drafter, draft = _make_drafter(o, target, params, seed, n_ctx)
        # (llama.cpp's n-gram drafters: a step verifies what they draft, up to their own sizes; a draft model behind
        # them keeps --spec-draft-n-min / -n-max, which the chain applies)
        n_max, n_min = (min(drafter.n_max, window // 2), 0) if o.spec_ngram else (o.spec_draft_n_max, o.spec_draft_n_min)
    synth = synthetic_rates(o, n_max if drafter is not None else 0)
    if not interactive:  # (before the cache is allocated, and before a text no context could hold is tokenized)
        engine.check_text_fits((o.system_prompt or "") + prompt if o.single_turn else prompt, tok, n_ctx)

    cache = target.model.new_cache(n_ctx, o.cache_type_k, o.cache_type_v)
    if o.mlock:
        lock_or_warn()
    warn_past_training(target.model, n_ctx)
    from sharpi_core.threads import ThreadGovernor
    if grammar is not None:
        from sharpi_core.grammar import TokenGrammar
        grammar = TokenGrammar(grammar, tok, int(target.model.config.n_vocab))
    budget = reasoning_budget(o, tok, o.chat_template or tok.chat_template)
    if budget is not None:  # (both constrain each token: the budget's forcing, then the grammar)
        from sharpi_core.reasoning import Both
        grammar = budget if grammar is None else Both(budget, grammar)
    gen = Generator(target.model, cache, tok, params, seed=seed, drafter=drafter,
                    spec_n_max=n_max, spec_n_min=n_min,
                    spec_p_min=o.spec_draft_p_min, n_batch=min(o.batch_size, o.ubatch_size),
                    batch_threads=o.threads_batch if o.threads_batch > 0 else None,
                    threads=ThreadGovernor.for_this_process() if o.threads == -1 else None, grammar=grammar,
                    context_shift=o.context_shift, n_keep=o.keep, special=o.special, synth_rates=synth)
    if o.spec_draft_p_min > 0 and drafter is not None and not params.greedy:  # (greedy acceptance never reads it)
        log("warning: --spec-draft-p-min > 0 also accepts tokens the exact rule would reject: "
            "the output is no longer an exact sample of the target model")
    if o.verbose:
        log(f"sharpi: model {describe(target, cache.capacity, cache.type_k, cache.type_v)}, seed {seed}")
        log(f"sharpi: sampler chain: {describe_chain(params)}")
        if draft is not None:
            dc = drafter.cache
            log(f"sharpi: draft {describe(draft, dc.capacity, dc.type_k, dc.type_v)}")

    if interactive:
        if o.prompt_cache:
            raise UsageError("--prompt-cache is for one-shot prompts (-p, -f, stdin, -st), not conversation mode")
        from sharpi_core.registry import exit_on_termination
        from .chat import chat_loop
        for note in gen.notes:
            log(f"note: {note}")
        with exit_on_termination():
            return chat_loop(o, target, gen, n_ctx, first_message=prompt)
    view = None  # a chat's reply is shown as the terminal chat shows it (a reasoning block apart)
    if o.single_turn:
        from .chat import ReplyView, encode_chat, render_messages, reply_tags, use_color
        text = render_messages(o, tok, [{"role": "user", "content": prompt}])
        ids = encode_chat(tok, text)
        if not o.json_out:
            view = ReplyView(sys.stdout, reply_tags(o, tok), text, use_color(o.color), o.reverse_prompt)
    else:
        ids = tok.encode(prompt, add_special=True, parse_special=True)
        if tok.add_bos and ids[1:2] == ids[:1] == [tok.bos_id]:  # (llama.cpp's tokenizer warns alike)
            log("warning: the model adds a BOS token and the prompt starts with one too: it now starts with two")
    pcache = None
    if o.prompt_cache and not o.interactive:
        from sharpi_core.prompt_cache import PromptCacheFile
        pcache = PromptCacheFile(o.prompt_cache, model_settings(o, target.model.config.n_layer),
                                 n_vocab=target.model.config.n_vocab)
        if prompt == "" and not o.single_turn and "target" in pcache.entries:
            ids = list(pcache.entries["target"]["tokens"])  # (llama-completion: "using full prompt from session file")
            log(f"note: --prompt-cache {o.prompt_cache}: an empty prompt continues its session ({len(ids)} tokens)")
    if not ids:  # -p "" (a model that adds no BOS): llama.cpp refuses it too
        raise UsageError("empty prompt: nothing to generate from")
    # speculation proposes fewer tokens near the end of a context (the generator), so a prompt that
    # leaves room for one generated token runs, as it does without speculation
    # (a draft model with a smaller context drafts from the history's tail: speculative/draft_model.py)
    engine.check_prompt_fits(len(ids), n_ctx)
    for note in gen.notes:
        log(f"note: {note}")
    if o.interactive:
        if o.verbose_prompt:
            print_prompt_tokens(tok, prompt, ids, o, gen.keep_count(len(ids), n_ctx))
        from sharpi_core.registry import exit_on_termination
        from .interactive import interactive_loop
        with exit_on_termination():
            return interactive_loop(o, target, gen, n_ctx, ids)
    if pcache is not None:
        from sharpi_core.kv_cache import PROMPT_CACHE_RECURRENT
        cached = {"target": (cache, gen.history, target.path)}
        if draft is not None:
            cached["draft"] = (drafter.cache, drafter.history, draft.path)
        if any(getattr(c[0], "recurrent", False) for c in cached.values()):
            raise UsageError(PROMPT_CACHE_RECURRENT)
        # (the draft's entry only spares its prompt pass: the output is the same without it; llama.cpp keeps none)
        n = {name: pcache.restore(name, *c, ids, optional=name == "draft") for name, c in cached.items()}
        if "draft" in n and n["draft"] is None:
            n["draft"] = 0
            log(f"note: --prompt-cache {o.prompt_cache}: its draft entry was made for another draft model or "
                "cache: the draft starts without it")
        if o.verbose:
            log(f"sharpi: prompt cache {o.prompt_cache}: " + ", ".join(f"{name} {k} of {len(ids)} prompt tokens restored"
                                                                     for name, k in n.items()))

    if o.verbose_prompt:
        print_prompt_tokens(tok, prompt, ids, o, gen.keep_count(len(ids), n_ctx))
    out = sys.stdout
    if not o.json_out and not o.no_display_prompt and not o.single_turn:
        # the prompt's tokens as text, as llama-completion echoes it (control tokens only with -sp)
        out.write(tok.decode(ids, skip_special=not o.special))
        out.flush()

    def on_text(s: str) -> None:
        if view is not None:
            view.write(s)
        elif not o.json_out:
            out.write(s)
            out.flush()

    from .chat import Interrupt
    res = None
    with Interrupt() as stop:
        try:
            # (a chat turn's stop strings lie in the reply, not begun in the template's text: llama-cli's)
            res = gen.generate(ids, n_predict=o.n_predict, stop_strings=list(o.reverse_prompt), on_text=on_text,
                               should_stop=stop, stop_tokens=reverse_prompt_tokens(tok, o.reverse_prompt),
                               stops_in_prompt=not o.single_turn)
        finally:
            if view is not None:
                view.close(res is not None and res.stop_reason == "eos")
    if o.single_turn and o.output_file:  # -o: the turn as llama-cli's transcript has it
        from .chat import assistant_message, open_transcript, reply_tags, reply_text, transcript_reply
        with open_transcript(o) as t:
            t.write(f"User:\n{prompt}\n\n")
            t.write(transcript_reply(assistant_message(reply_text(tok, res, o.reverse_prompt),
                                                       reply_tags(o, tok), text)))
    if o.json_out:
        d = result_json(res, target, seed)
        d.update(reasoning_fields(o, tok, ids, res.text))
        print(json.dumps(d, ensure_ascii=False))
    else:
        out.write("\n")
        out.flush()
        if res.stop_reason == "ctx_full":
            if not o.context_shift:
                log(f"sharpi: the context ({n_ctx} tokens) is full: generation stopped; raise -c/--ctx-size for "
                    "more, or go on past it with --context-shift")
            elif o.n_predict == -2:
                log(f"sharpi: the context ({n_ctx} tokens) is full: generation stopped (-n -2)")
            else:  # a shift keeps --keep's positions and frees half the rest: here that is nothing
                log(f"sharpi: the context ({n_ctx} tokens) is full and a context shift frees no room in it: "
                    "generation stopped; raise -c/--ctx-size (or lower --keep)")
        elif res.stop_reason == "grammar":
            log("sharpi: the grammar allows no further token (and no end of generation): generation stopped")
        print_report(target, res, o)
    if pcache is not None and not o.prompt_cache_ro:
        # the prompt's positions (with --prompt-cache-all, every token the target's cache holds); after a
        # context shift only the kept ones hold what evaluating their tokens alone gives
        # (a draft whose window slid holds later positions than the prompt's first: no entry of it)
        exact = {name: (c, h[:gen.exact_prefix], path) for name, (c, h, path) in cached.items()
                 if name == "target" or not getattr(drafter, "window_start", 0)}
        if pcache.save(exact, list(gen.history if o.prompt_cache_all else ids)) and o.verbose:
            log(f"sharpi: prompt cache {o.prompt_cache} saved")
    return 130 if res.stop_reason == "interrupted" else 0


def print_prompt_tokens(tok, prompt: str, ids: list[int], o: RunOptions, n_keep: int) -> None:
    """--verbose-prompt: llama-completion's listing of the prompt's tokens (and of the -r strings')."""
    log(f"sharpi: prompt: '{prompt}'")
    log(f"sharpi: number of tokens in prompt = {len(ids)}")
    for t in ids:
        log(f"{t:6d} -> '{tok.decode([t])}'")
    if n_keep > int(tok.add_bos):
        log(f"sharpi: static prompt based on n_keep: '{tok.decode(ids[:n_keep])}'")
    for r in o.reverse_prompt:
        log(f"Reverse prompt: '{r}'")
        for t in tok.encode(r, add_special=False, parse_special=True):
            log(f"{t:6d} -> '{tok.decode([t])}'")
    log("")


def describe(m, n_ctx: int, type_k: str, type_v: str) -> str:
    """A loaded model and its context for -v (run's target and draft, perplexity's model)."""
    c = m.model.config
    return (f"{m.path} ({c.arch}, {c.n_layer} layers, {m.model.weight_bytes / 1e6:.0f} MB weights), "
            f"n_ctx {n_ctx}, KV cache K {type_k} V {type_v}")


# The draft model's context when -cd is not given: on the CPU the tail of the history, where a long prompt costs the
# draft little to evaluate and a draft token's attention stays short (prompt lookup beside it copies from the whole
# history); a draft on the GPU evaluates a prompt in milliseconds and keeps a longer one.
DRAFT_CTX_CPU = 256
DRAFT_CTX_GPU = 4096


def wants_lookup(o: RunOptions) -> bool:
    """--draft-lookup / --no-draft-lookup as given; by default, prompt lookup beside a draft model (-md): it copies
    from the whole history at no cost, where the draft sees its window (measured: a request whose answer copies its
    prompt 1.3-1.45x the draft alone, new text within 0-3%). Not beside llama.cpp's n-gram drafters, which draft
    from the same n-grams, nor the target's MTP layer."""
    if o.draft_lookup is not None:
        return o.draft_lookup
    return bool(o.model_draft) and not o.spec_ngram and not o.spec_type


def draft_ctx(o: RunOptions, n_ctx: int) -> int:
    on_gpu = o.device == "cuda" and o.spec_draft_ngl != 0
    return o.ctx_size_draft or min(n_ctx, DRAFT_CTX_GPU if on_gpu else DRAFT_CTX_CPU)


_WARNED: set[str] = set()


def load_model(spec, flash_attn: str = "auto", gpu_layers: int = 0, encoder: bool = True, rope: tuple = (),
          overrides: dict | None = None, mmap: bool = True, check: bool = False):
    """Resolve and load a model; -fa off computes attention like llama.cpp's -fa off (auto = on, as
    llama.cpp resolves it on the CPU); gpu_layers != 0 moves it to the GPU (-ngl); encoder: see engine.load;
    rope: Transformer.set_rope's (base, freq scale, scaling) from the --rope-* flags; overrides: --override-kv;
    mmap=False: --no-mmap; check: --check-tensors."""
    from sharpi_core import engine
    from sharpi_core.kernels import cpu
    path = resolve_with_progress(spec)
    if check:
        from sharpi_core.gguf_file import GGUFFile, check_tensors
        check_tensors(GGUFFile(path))
    cpu.build_notice = lambda: log("sharpi: compiling the CPU kernels for this machine (once per CPU and sharpi "
                                   f"version, {'~20-60 s on AVX2' if cpu.avx512_emulated() else '~10-30 s'}; "
                                   f"cached in {cpu.kernel_dir()})")
    m = engine.load(str(path), encoder=encoder, overrides=overrides, mmap=mmap)
    m.model.flash_attn = flash_attn != "off"
    if rope:
        m.model.set_rope(*rope)
    if gpu_layers:
        from sharpi_core.backends.cuda_model import offload
        m.model = offload(m.model, gpu_layers)
    else:  # the CPU kernels' own weight layouts are made now, as part of loading
        t0 = time.perf_counter()
        m.model.pack_weights()
        m.load_ms += (time.perf_counter() - t0) * 1000
    if (why := cpu.load_warning()) and why not in _WARNED:  # (once a process: a draft model loads after the target)
        _WARNED.add(why)
        log(f"warning: {why}")
    return m


def model_settings(o: RunOptions, n_layer: int) -> str:
    """What changes a loaded model's K and V besides the file and the cache types (--rope-*, --override-kv,
    control vectors and LoRA adapters by their contents, -fa off, the SHARPI_* switches of the arithmetic),
    as text for a prompt cache to compare; "" when none is given. n_layer: the model's (the control vectors'
    layers as they apply: no range and `1 N` are the same)."""
    from sharpi_core import control_vector
    from sharpi_core.prompt_cache import fingerprint
    from sharpi_core.switches import arithmetic

    def files(given: list[tuple[str, float]]) -> list:  # (an adapter rewritten at the same path is another)
        return [(os.path.abspath(p), fingerprint(p) if os.path.isfile(p) else None, s) for p, s in given]
    parts = ([f"rope {rope_flags(o)}"] if rope_flags(o) else []) + [f"{k}={v!r}" for k, v in sorted(o.kv_overrides.items())]
    if control_files(o):
        first, last = control_vector.layer_span(o.control_vector_layer_range, n_layer)
        parts.append(f"control vectors {files(control_files(o))} layers {f'{first}-{last}' if first <= last else 'none'}")
    if any(s != 0 for _, s in lora_files(o)):  # (an adapter at scale 0 is checked, not applied: lora.load)
        parts.append(f"LoRA {files([(p, s) for p, s in lora_files(o) if s != 0])}")
    if o.flash_attn == "off":  # (-fa on / auto: the default)
        parts.append("-fa off")
    return "; ".join(parts + arithmetic())


def apply_adapters(o: RunOptions, model) -> None:
    """The control vectors and LoRA adapters given, loaded into the model (control vectors into a GPU model's
    CPU model, which it reads them from; LoRA adapters only on the CPU): llama.cpp's --control-vector and --lora."""
    if control_files(o):
        from sharpi_core import control_vector
        c = model.config
        cpu = getattr(model, "cpu", model)  # (a model on the GPU reads its CPU model's vectors)
        cpu.control = control_vector.load(control_files(o), c.n_embd, c.n_layer, o.control_vector_layer_range or (-1, -1))
    if lora_files(o):
        from sharpi_core import lora
        lora.load(lora_files(o), model)


def rope_flags(o: RunOptions) -> tuple:
    """The --rope-* flags as Transformer.set_rope's arguments, () when none is given (llama.cpp passes its
    context parameters to the draft model too)."""
    # given: the factors and betas when >= 0 (llama.cpp's test), the original context when > 0
    yarn = {k: v for k, v in (("yarn_ext_factor", o.yarn_ext_factor), ("yarn_attn_factor", o.yarn_attn_factor),
                              ("yarn_beta_fast", o.yarn_beta_fast), ("yarn_beta_slow", o.yarn_beta_slow)) if v >= 0}
    if o.yarn_orig_ctx > 0:
        yarn["yarn_orig_ctx"] = o.yarn_orig_ctx
    if not (o.rope_freq_base or o.rope_freq_scale or o.rope_scale or o.rope_scaling or yarn):
        return ()
    return o.rope_freq_base, o.rope_freq_scale or (1.0 / o.rope_scale if o.rope_scale else 0.0), o.rope_scaling, yarn


def _make_drafter(o: RunOptions, target, params, seed: int, n_ctx: int):
    """The drafter of -md / --draft-lookup / --spec-type, and the draft model (or None); --draft-lookup with one of
    the others: both, each step to the one expected to bring more tokens per cost (speculative.HybridDrafter)."""
    from sharpi_core import speculative as spec
    if o.spec_ngram:  # llama.cpp's n-gram drafters, then the draft model (or MTP head) if there is one
        sources = spec.ngram_sources(o.spec_ngram, (o.spec_ngram_simple_size_n, o.spec_ngram_simple_size_m),
                                     (o.spec_ngram_map_k_size_n, o.spec_ngram_map_k_size_m),
                                     (o.spec_ngram_map_k4v_size_n, o.spec_ngram_map_k4v_size_m,
                                      o.spec_ngram_map_k4v_min_hits),
                                     (o.spec_ngram_mod_n_match, o.spec_ngram_mod_n_min, o.spec_ngram_mod_n_max))
        model, draft = _model_drafter(o, target, params, seed, n_ctx) if (o.model_draft or o.spec_type) else (None, None)
        return spec.NgramChain(sources, model, o.spec_draft_n_max, o.spec_draft_n_min), draft
    lookup = spec.LookupDrafter(ngram_max=o.spec_ngram_max, ngram_min=o.spec_ngram_min) if o.draft_lookup else None
    if not (o.model_draft or o.spec_type):
        return lookup, None
    model, draft = _model_drafter(o, target, params, seed, n_ctx)
    if lookup is None:
        return model, draft
    # a model's cost per proposed token, relative to a target pass: decoding reads the weights once a token
    cost = model.model.weight_bytes / target.model.weight_bytes  # (the draft model's, or the MTP head's)
    return spec.HybridDrafter(lookup, model, o.spec_draft_n_max, o.spec_draft_n_min, cost=cost,
                              names=("lookup", "mtp" if o.spec_type else "draft")), draft


def _model_drafter(o: RunOptions, target, params, seed: int, n_ctx: int):
    from sharpi_core import engine
    from sharpi_core import speculative as spec
    if o.spec_type:  # (the target's own MTP layer)
        import torch
        head = engine.mtp_head(target.model)
        g = torch.Generator().manual_seed(seed + 1)
        cut = engine.draft_head_vocab(o.spec_draft_vocab, target.tokenizer)
        return spec.MtpDrafter(head, head.new_cache(n_ctx, *draft_cache_types(o)), params, g, head_vocab=cut), None
    draft = load_model(o.model_draft, o.flash_attn, o.spec_draft_ngl if o.device == "cuda" else 0, encoder=False,
                  rope=rope_flags(o), overrides=o.kv_overrides, mmap=o.mmap, check=o.check_tensors)
    engine.check_draft_compatible(target.tokenizer, draft.tokenizer)
    n_ctx_d = draft_ctx(o, n_ctx)
    dcache = draft.model.new_cache(n_ctx_d, *draft_cache_types(o))
    import torch
    g = torch.Generator().manual_seed(seed + 1)
    head = engine.draft_head_vocab(o.spec_draft_vocab, draft.tokenizer)
    td = o.threads_draft if o.threads_draft > 0 else None
    tbd = o.threads_batch_draft if o.threads_batch_draft > 0 else td
    return spec.DraftModelDrafter(draft.model, dcache, params, g, head_vocab=head, threads=(td, tbd)), draft


def result_json(res, target, seed: int) -> dict:
    t = res.timings
    d = {
        "text": res.text,
        "tokens": list(res.tokens),
        "stop_reason": res.stop_reason,
        "model": without_surrogates(str(target.path)),  # (JSON is UTF-8: a path's undecodable bytes U+FFFD)
        "seed": seed,
        "timings": {
            "load_ms": round(target.load_ms, 2),
            "prompt_n": t.prompt_n, "prompt_ms": round(t.prompt_ms, 2),
            "eval_n": t.eval_n, "eval_ms": round(t.eval_ms, 2),
            "prompt_per_second": round(t.prompt_n / t.prompt_ms * 1000, 2) if t.prompt_ms else None,
            "eval_per_second": round(t.eval_n / t.eval_ms * 1000, 2) if t.eval_ms else None,
        },
    }
    if res.spec is not None:
        d["speculative"] = res.spec.as_dict()
    if res.context_shifts:
        d["context_shifts"] = res.context_shifts
    if res.eog_token is not None:  # (not in tokens: generated text; with -sp its piece ends text)
        d["eog_token"] = res.eog_token
    return d


def reasoning_fields(o: RunOptions, tok, ids: list[int], text: str) -> dict:
    """--json: the reply's reasoning block apart from the rest (--reasoning-format deepseek, the default), or as
    well as in it (deepseek-legacy); nothing with none, or when the reply has no block."""
    from sharpi_core.reasoning import opens_block, split_reasoning

    from .chat import reply_tags
    tags = reply_tags(o, tok)
    if tags is None:
        return {}
    parts = split_reasoning(text, tags, opens_block(tok.decode(ids[-64:], skip_special=False), tags))
    if parts is None:
        return {}
    return {"reasoning": parts[0], "content": text if o.reasoning_format == "deepseek-legacy" else parts[1]}


def print_report(target, res, o: RunOptions) -> None:
    """llama.cpp's timings at the end of a run (none with --no-perf)."""
    if not o.perf:
        return
    verbose = o.verbose
    t = res.timings
    per = lambda ms, n: f" ({ms / n:8.2f} ms per token, {n / ms * 1000:8.2f} tokens per second)" if n and ms else ""  # noqa: E731
    log("")
    log(f"sharpi:        load time = {target.load_ms:10.2f} ms")
    log(f"sharpi: prompt eval time = {t.prompt_ms:10.2f} ms / {t.prompt_n:5d} tokens{per(t.prompt_ms, t.prompt_n)}")
    log(f"sharpi:        eval time = {t.eval_ms:10.2f} ms / {t.eval_n:5d} runs  {per(t.eval_ms, t.eval_n)}".rstrip())
    log(f"sharpi:       total time = {target.load_ms + t.prompt_ms + t.eval_ms:10.2f} ms / {t.prompt_n + t.eval_n:5d} tokens")
    if res.spec is not None:
        s = res.spec.as_dict()
        # (what drafts on without the model: lookup, or llama.cpp's n-gram drafters in front of it)
        free = (", ".join(o.spec_ngram) + (" go" if len(o.spec_ngram) > 1 else " goes")) if o.spec_ngram else "lookup goes"
        log(f"sharpi: speculative: drafted {s.get('drafted')}, accepted {s.get('accepted')}"
            + (f" ({100 * s['acceptance']:.1f}%)" if s.get("drafted") else "")
            + (f", {s['tokens_per_pass']:.2f} tokens per target pass" if s.get("target_passes") else "")
            + f", {s.get('steps_no_proposal', 0)} steps without a proposal"
            + (f", {s['plain_by_cost']} plain steps chosen by cost" if s.get("plain_by_cost") else "")
            + ((f" (the draft model off: slower than plain decoding here; {free} on)" if s.get("sources")
                else " (speculation off: slower than plain decoding here)") if s.get("cost_off") else ""))
        for name, v in s.get("sources", {}).items():
            log(f"sharpi: speculative, {name}: {v['steps']} steps, drafted {v['drafted']}, accepted {v['accepted']}"
                + (f" ({100 * v['accepted'] / v['drafted']:.1f}%)" if v["drafted"] else ""))
        if verbose:
            log(f"sharpi: speculative detail: {json.dumps(s)}")
    if verbose:
        log(f"sharpi: stop reason: {res.stop_reason}")
        if res.context_shifts:
            log(f"sharpi: context shifts: {res.context_shifts}")
