"""-i/--interactive and -if/--interactive-first: llama-completion's interactive mode on raw text.

No chat template: the prompt, then generation until a reverse prompt (-r) ends the text, an end of
generation or -n tokens; then the user types a line, which goes after what was generated (between
--in-prefix and --in-suffix), and generation goes on from there, the KV cache kept as it is.

The order of things is llama-completion's (tools/completion), so the same inputs give the same text:
- a reverse prompt counts only at the end of the text of the last 32 tokens the samplers have seen
  (the ones generated and, before them, the prompt or the input), or as the last token when it is one
  token; a prompt or input that ends with one hands control back at once, without generating;
- at an end-of-generation token the first reverse prompt is queued (evaluated, not shown) and control
  returns to the user after a newline; the token itself stays in the context;
- -n N: the budget counts generated tokens and the user's input tokens; spent, it is N again and
  control returns to the user (who may be asked twice when the input spent it);
- an empty line hands control back to the model; a line ending in '\\' goes on to the next line
  (with -mli lines go on until one ends in '\\'), one ending in '/' ends the input there;
  Ctrl-D on an empty input quits (so does a "/" with nothing before it), Ctrl-C stops the model's turn (a
  second one, at the prompt, quits);
- each input starts the samplers over (penalties and DRY see the input and what follows it).
The user's lines are not echoed (llama-completion's --simple-io; a terminal shows them as typed).
"""
from __future__ import annotations

import sys
import time

from sharpi_core.generate import STOP_WINDOW, GenerationResult, Timings
from sharpi_core.tokenizer import StreamDecoder


def read_input(multiline: bool, prompt: str = "") -> str | None:
    """llama.cpp's console::readline, repeated while it asks for another line: the lines with their
    newlines (but one ended by "/"), or None at end of input with nothing typed, or when nothing came before a "/"
    (llama-completion's "EOF by user": its buffer is empty then too). The prompt (--in-prefix) is input()'s, so
    that line editing knows it is there."""
    from .chat import signals_seen, typed_line
    buffer = ""
    while True:
        try:
            with signals_seen():
                line = typed_line(prompt)
            prompt = ""
        except EOFError:
            return buffer or None
        if line.endswith("/"):  # always returns control, without a newline of its own (the caller takes one off:
            return buffer + line[:-1] or None  # a line of only "/" after others ends them without their last newline)
        more = multiline
        if line.endswith("\\"):  # the other way from the default
            line, more = line[:-1], not multiline
        buffer += line + "\n"
        if not more:
            return buffer


def _add(total: GenerationResult, res: GenerationResult) -> None:
    """The session's report: one generation's timings and speculative stats added to the others'."""
    total.timings = total.timings + res.timings
    if res.spec is not None:
        total.spec = res.spec if total.spec is None else total.spec + res.spec
    total.stop_reason = res.stop_reason
    total.context_shifts += res.context_shifts


def interactive_loop(o, target, gen, n_ctx: int, prompt_ids: list[int]) -> int:
    from .chat import Interrupt, hidden_typing
    from .inputs import process_escapes, reverse_prompt_tokens
    from .log import log
    from .runner import print_report
    tok = target.tokenizer
    out = sys.stdout
    encode = lambda s: tok.encode(s, add_special=False, parse_special=True) if s else []  # noqa: E731
    anti = [r for r in o.reverse_prompt if r]
    anti_tokens = reverse_prompt_tokens(tok, anti)
    pfx, sfx = encode(o.in_prefix), encode(o.in_suffix)
    first_anti = encode(anti[0]) if anti else []

    # generated text goes through one decoder over the session: a character -n cut goes on after an empty line, as
    # llama-completion's bytes do; anything else written first ends it (U+FFFD, as a terminal shows those bytes)
    dec = StreamDecoder(tok, gen.special)

    def show(s: str) -> None:
        out.write(s)
        out.flush()

    def write(s: str) -> None:
        show(dec.flush() + s)

    def hits(ids: list[int]) -> bool:
        """Reverse prompt at the end of these tokens (the samplers' memory after they were evaluated)."""
        if not anti or not ids:
            return False
        text = tok.decode(ids[-STOP_WINDOW:], skip_special=False)  # (control tokens written out, shown or not)
        return any(text.endswith(a) for a in anti) or ids[-1] in anti_tokens

    log("== interactive mode: Ctrl-C hands control to you, an empty line back to the model; a line ending in \\ "
        "goes on, one ending in / ends your input; Ctrl-D quits ==")
    console = sys.stdin.isatty() and not o.simple_io
    if console:
        try:
            import readline  # noqa: F401  (line editing and history, as llama.cpp's console)
        except ImportError:
            pass
    if not o.no_display_prompt:
        write(tok.decode(prompt_ids, skip_special=not o.special))
    total = GenerationResult([], "", "", Timings())

    def feed(tokens: list[int], fresh: bool = False) -> bool:
        t0 = time.perf_counter()
        ok = gen.feed(tokens, fresh=fresh, n_predict=o.n_predict)
        total.timings.prompt_ms += (time.perf_counter() - t0) * 1000
        total.timings.prompt_n += len(tokens)
        return ok

    queue, pending = list(prompt_ids), None  # pending: generated, not in the cache yet
    fresh, interacting, n_remain = True, o.interactive_first, o.n_predict
    full = False
    while True:
        if queue or not interacting:
            if pending is not None:  # (evaluated alone, as llama-completion does, before what follows it)
                if not feed([pending]):
                    full = True
                    break
            pending = None
            at_eog = bool(queue) and queue[-1] in tok.eog_ids
            if queue and (interacting or at_eog or hits(queue)):
                # evaluated, then control goes to the user before anything is generated
                if not feed(queue, fresh):
                    full = True
                    break
                fresh, interacting = False, True
                queue = list(first_anti) if at_eog else []
                if at_eog:
                    write("\n")
            else:
                # the queue (or, after an empty line, nothing: the model goes on) and a generated stretch
                with Interrupt() as stop, hidden_typing(console):
                    res = gen.generate(queue, n_predict=n_remain if o.n_predict >= 0 else o.n_predict,
                                       stop_strings=anti, on_text=show, should_stop=stop, resume=not fresh,
                                       stop_tokens=anti_tokens, stop_at_end=True, decoder=dec)
                # (a Ctrl-C between the queue's batches: what it left goes before the next input, as
                # llama-completion evaluates all of it, nothing dropped)
                fresh, queue = False, gen.unevaluated
                _add(total, res)
                n_remain -= len(res.tokens) + (res.eog_token is not None)
                pending = res.eog_token if res.eog_token is not None else (res.tokens[-1] if res.tokens else None)
                if res.stop_reason == "ctx_full":
                    full = True
                    break
                if res.stop_reason == "grammar":
                    log("\nsharpi: the grammar allows no further token (and no end of generation): stopped")
                    break
                if res.stop_reason == "eos":
                    queue = list(first_anti)
                    write("\n")
                interacting = res.stop_reason in ("eos", "stop_string", "interrupted")
        if interacting:
            if o.in_prefix_bos and tok.bos_id is not None:
                queue.append(tok.bos_id)
            if o.in_prefix:  # (read_input shows it itself; without one, after an empty line the text goes on)
                write("")
            else:
                out.flush()
            try:
                line = read_input(o.multiline_input, o.in_prefix)
            except KeyboardInterrupt:
                write("\n")
                print_report(target, total, o)
                return 130
            if line is None:  # Ctrl-D
                break
            line = line.removesuffix("\n")
            if line:
                if o.in_suffix:
                    write(o.in_suffix)
                inp = tok.encode(process_escapes(line) if o.escape else line, add_special=False, parse_special=False)
                queue += pfx + inp + sfx
                n_remain -= len(inp)
            interacting = False
        if o.n_predict >= 0 and n_remain <= 0:
            n_remain, interacting = o.n_predict, True
    write("\n")
    if full:
        log(f"sharpi: the context ({n_ctx} tokens) is full: stopped" + ("" if o.context_shift else
            "; raise -c/--ctx-size, or go on past it with --context-shift"))
    print_report(target, total, o)
    return 0
