"""Flag checks before anything is loaded: one clear error line (UsageError) for what llama-cli refuses, a warning for
what it ignores."""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np

from sharpi_core.choices import CACHE_TYPES, DEFAULT_SAMPLERS, QUANTIZED_CACHE_TYPES, SAMPLER_CHARS, sampler_order
from sharpi_core.errors import UsageError

from .inputs import check_hub_flags, resolve_with_progress
from .log import log
from .options import FALSEY, FLOAT32_MAX, FLOAT32_TINY, ON_OFF_AUTO, RunOptions, TRUTHY, draft_cache_types, lora_files


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
    check_log_colors(o)
    check_output_file(o.output_file)
    if o.n_predict < -2:
        raise UsageError(f"invalid -n/--n-predict {o.n_predict}: must be >= -2 (-1, -2 = until the end of generation "
                         "or a full context)")
    if not o.context_shift:  # -2 (until the context is full) is -1 then
        o.n_predict = max(o.n_predict, -1)
    check_rope(o)
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


def check_log_colors(o: RunOptions) -> None:
    """--log-colors: llama.cpp's words for on, off and auto (a value it does not know is refused, not auto)."""
    if o.log_colors not in TRUTHY + FALSEY + ("auto", "-1"):
        raise UsageError(f"invalid --log-colors '{o.log_colors}': choose {', '.join(TRUTHY + FALSEY + ('auto', '-1'))}")


def check_rope(o: RunOptions) -> None:
    """--rope-* and --yarn-* (run's and perplexity's): values llama.cpp's float and int fields hold."""
    # (llama.cpp reads them with std::stof, which refuses a value beyond a float's range, and one below its smallest
    # normal number, 1.2e-38: a scale of 1e-39 made 1 / scale infinite, NumPy's warnings on stderr, and nonsense)
    for flag, v in (("--rope-freq-base", o.rope_freq_base), ("--rope-freq-scale", o.rope_freq_scale),
                    ("--rope-scale", o.rope_scale)):
        if not (math.isfinite(v) and (v == 0 or FLOAT32_TINY <= v <= FLOAT32_MAX)):
            raise UsageError(f"invalid {flag} {v}: must be 0 (the model's) or a float from 1.18e-38 to 3.4e38")
    if o.rope_scale and o.rope_freq_scale:
        raise UsageError("--rope-scale N and --rope-freq-scale 1/N are the same setting: give one")
    if o.rope_scaling not in (None, "none", "linear", "yarn"):
        raise UsageError(f"invalid --rope-scaling '{o.rope_scaling}': choose none, linear or yarn")
    for flag, v in (("--yarn-ext-factor", o.yarn_ext_factor), ("--yarn-attn-factor", o.yarn_attn_factor),
                    ("--yarn-beta-slow", o.yarn_beta_slow), ("--yarn-beta-fast", o.yarn_beta_fast)):
        if not (math.isfinite(v) and (v == 0 or FLOAT32_TINY <= abs(v) <= FLOAT32_MAX)):
            raise UsageError(f"invalid {flag} {v}: must be a finite number within float range (negative = the "
                             "model's)")
    for flag, v in (("--yarn-beta-slow", o.yarn_beta_slow), ("--yarn-beta-fast", o.yarn_beta_fast)):
        if v == 0:
            raise UsageError(f"invalid {flag} 0: must be > 0 (negative = the model's)")
    if o.yarn_orig_ctx < 0:
        raise UsageError(f"invalid --yarn-orig-ctx {o.yarn_orig_ctx}: must be >= 0 (0 = the model's)")


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
               ("-lzm/--lazy-mode", o.lazy_mode, ("on", "auto", "off")))
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
