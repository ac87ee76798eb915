"""The options of a generation run (sharpi's flags, llama-cli's names), as main.py parses them."""
from __future__ import annotations

from dataclasses import dataclass, field


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
FLOAT32_TINY = 1.1754943508222875e-38  # FLT_MIN, the smallest normal float


# -rea/--reasoning and -co/--color: llama.cpp's words for on, off and auto
ON_OFF_AUTO = {"on": True, "enabled": True, "true": True, "1": True,
               "off": False, "disabled": False, "false": False, "0": False, "auto": None, "-1": None}


TRUTHY, FALSEY = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0")  # (llama.cpp's is_truthy / falsey)


def draft_cache_types(o: RunOptions) -> tuple[str, str]:
    """The draft's KV cache types: -ctkd / -ctvd, else the target's -ctk / -ctv."""
    return o.cache_type_k_draft or o.cache_type_k, o.cache_type_v_draft or o.cache_type_v


def _files(plain: list[str], scaled: list) -> list[tuple[str, float]]:
    """(path, scale) of FNAME[,...] flags (scale 1) then of their -scaled flags' (path, scale) pairs."""
    return [(p, 1.0) for v in plain for p in v.split(",")] + list(scaled)


def lora_files(o: RunOptions) -> list[tuple[str, float]]:
    """(path, scale) of every LoRA adapter given, in order (--lora's at 1)."""
    return _files(o.lora, o.lora_scaled)


def control_files(o: RunOptions) -> list[tuple[str, float]]:
    """(path, strength) of every control vector given, in order (--control-vector's at 1)."""
    return _files(o.control_vector, o.control_vector_scaled)
