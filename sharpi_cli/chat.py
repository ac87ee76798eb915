"""Conversation mode: a terminal REPL over the GGUF's chat template, reusing the KV cache across turns."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from dataclasses import replace
from typing import NoReturn

from sharpi_core.errors import SharpiError
from sharpi_core.text import text_from_bytes, without_surrogates


_early = [False]  # a Ctrl-C before the first reply, under startup_handler


def startup_handler(signum, frame):
    """Python's own handler (KeyboardInterrupt) from the start of main until the first reply, remembering the signal:
    Python swallows a KeyboardInterrupt raised inside a callback (importing torch runs importlib's module-lock
    weakref callbacks) and prints it with a traceback as "ignored"; the run would go on as if never interrupted.
    Here the first Interrupt then stops at once, and the swallowed one is not printed."""
    _early[0] = True
    raise KeyboardInterrupt


def install_startup_handler() -> None:
    signal.signal(signal.SIGINT, startup_handler)

    def unraisable(u):
        if not isinstance(u.exc_value, KeyboardInterrupt):
            sys.__unraisablehook__(u)
    sys.unraisablehook = unraisable


class signals_seen:
    """While waiting at input(): a Ctrl-C is acted on even when it came between the prompt and the wait.

    CPython's readline shows the prompt, then waits in select() with no timeout and runs Python's signal handlers
    only when that select() is interrupted: a SIGINT that lands after the prompt is out but before select() starts
    (a loaded machine, the process preempted there) only marks the handler as pending, and nothing runs it until a
    key is pressed. A no-op SIGALRM every 0.1 s interrupts the wait, and the pending handler runs then."""

    PERIOD = 0.1

    def __enter__(self):
        self._prev = None
        if hasattr(signal, "setitimer") and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0):
            self._prev = signal.signal(signal.SIGALRM, lambda signum, frame: None)
            signal.setitimer(signal.ITIMER_REAL, self.PERIOD, self.PERIOD)
        return self

    def __exit__(self, *exc):
        if self._prev is not None:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
            signal.signal(signal.SIGALRM, self._prev)
        return False


class Interrupt:
    """Ctrl-C stops the current reply (not the session); a second Ctrl-C in the same reply quits."""

    def __init__(self):
        self.flag = False
        self._prev = None

    def __enter__(self):
        self.flag, _early[0] = _early[0], False  # (one lost before: this reply stops at its first step)

        def handler(signum, frame):
            if self.flag:
                raise KeyboardInterrupt
            self.flag = True

        self._prev = signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._prev)
        return False

    def __call__(self) -> bool:
        return self.flag


def typed_line(prompt: str = "") -> str:
    """input(prompt) with the prompt on stdout: without the readline module (--simple-io) CPython's input() at a
    terminal writes its prompt to stderr, where `2>file` would take it, mixed with the stats."""
    if prompt and "readline" not in sys.modules:
        sys.stdout.write(prompt)
        sys.stdout.flush()
        prompt = ""
    with typing_shown():
        return without_surrogates(input(prompt))


def read_message(multiline: bool) -> str:
    """A chat message typed at "> ": lines go on while one ends in \\ (with -mli, llama-cli's multiline input: until
    one ends in \\); one ending in / ends it in either mode, as llama.cpp's console reads lines (a line of only "/"
    ends the lines before it, the message then ending in a newline). The marker is dropped, the lines are joined by
    newlines. At the end of input (Ctrl-D) what was typed so far is the message (llama-cli sends it too); EOFError
    when nothing was."""
    lines: list[str] = []
    while True:
        try:
            with signals_seen():
                line = typed_line("" if lines else "> ")
        except EOFError:
            if lines:
                return "\n".join(lines)
            raise
        if line.endswith("/"):  # (llama.cpp's console: the / becomes the line's newline, one is cut off the message)
            lines.append(line[:-1])
            return "\n".join(lines)
        more = line.endswith("\\")
        lines.append(line[:-1] if more else line)
        if more == multiline:  # (a \\ continues a plain message and ends a multiline one)
            return "\n".join(lines)


def bracketed_paste(readline) -> None:
    """A multi-line paste is one message, not one per line: GNU readline's bracketed paste, which CPython turns off
    (for its own REPL). A terminal without it ignores the request; libedit has no such setting."""
    if getattr(readline, "backend", "editline" if "libedit" in (readline.__doc__ or "") else "readline") == "readline":
        readline.parse_and_bind("set enable-bracketed-paste on")


_HIDDEN: list[tuple] = []  # (stdin's fd, its settings before) of each hidden_typing block in force, outermost first


@contextlib.contextmanager
def typing_shown():
    """At a prompt inside hidden_typing blocks: the terminal's settings from before them (the echo on) until the line
    is read. GNU readline echoes what it reads only where the terminal echoed when it started reading (as for a
    password), and input() without readline relies on the terminal's echo; what waited unseen is shown then."""
    if not _HIDDEN:
        yield
        return
    import termios
    fd, before = _HIDDEN[0]
    try:
        now = termios.tcgetattr(fd)
        termios.tcsetattr(fd, termios.TCSANOW, before)
    except (termios.error, OSError):
        yield
        return
    try:
        yield
    finally:
        try:
            termios.tcsetattr(fd, termios.TCSANOW, now)
        except (termios.error, OSError):
            pass


class hidden_typing:
    """While a reply is written: what is typed at the terminal is not echoed into it (it waits unseen for the next
    prompt, where line editing shows it), as llama-cli's console, which keeps the terminal's echo off. The
    terminal's settings come back on every way out of the block (a process killed by a signal leaves them to the
    shell, which restores its own). At a prompt typing_shown puts the echo back."""

    def __init__(self, on: bool):
        self.on = on
        self._saved = None

    def __enter__(self):
        if not self.on:
            return self
        try:
            import termios
        except ImportError:
            return self
        try:
            fd = sys.stdin.fileno()
            if not os.isatty(fd):
                return self
            saved = termios.tcgetattr(fd)
            quiet = termios.tcgetattr(fd)
            quiet[3] &= ~(termios.ECHO | termios.ECHONL)
            termios.tcsetattr(fd, termios.TCSANOW, quiet)  # (not TCSAFLUSH: what was typed is kept)
            self._saved = (fd, saved)
            _HIDDEN.append(self._saved)
        except (termios.error, OSError, ValueError, AttributeError):  # (termios.error is no OSError)
            pass
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            import termios
            fd, saved = self._saved
            _HIDDEN.remove(self._saved)
            self._saved = None
            try:
                termios.tcsetattr(fd, termios.TCSANOW, saved)
            except (termios.error, OSError):
                pass
        return False


def use_color(setting: str) -> bool:
    """-co/--color: on, off, or auto = llama.cpp's rule (NO_COLOR unset or empty, TERM not dumb) with stdout a
    terminal (llama.cpp's takes stderr's too, for its colored logs; colors here go to stdout only, and a reply
    redirected to a file keeps no escape codes)."""
    import os
    from .options import ON_OFF_AUTO
    on = ON_OFF_AUTO[setting]
    if on is not None:
        return on
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return sys.stdout is not None and sys.stdout.isatty()


def reply_tags(o, tok) -> tuple[str, str] | None:
    """The tags of the reasoning block a reply may have, from the template used (or the model's): None with
    --reasoning-format none (the reply as it is)."""
    from sharpi_core.reasoning import thinking_tags
    return thinking_tags(o.chat_template or tok.chat_template) if o.reasoning_format != "none" else None


GRAY, RESET = "\x1b[90m", "\x1b[0m"


class ReplyView:
    """A chat reply on the terminal: its reasoning block apart, between [Start thinking] and [End thinking] (gray
    with colors), as llama-cli shows it; the tags themselves not shown. Without tags (a template with no block,
    --reasoning-format none) the reply as it comes."""

    def __init__(self, out, tags: tuple[str, str] | None, prompt: str, color: bool, stops=()):
        """prompt: the rendered conversation the reply follows (its generation prompt may open the block);
        stops: -r's strings, where the reply ends unshown (StopScan: llama-cli's server's rules)."""
        from sharpi_core.reasoning import ReasoningStream, opens_block
        self.out, self.color = out, color
        self.stream = ReasoningStream(tags, opens_block(prompt, tags)) if tags else None
        self.kind = "content"
        self.newline = True  # whether what is shown ends a line
        self.scan = StopScan(stops)

    def write(self, piece: str) -> None:
        self._content(self.scan.feed(piece))

    def _content(self, text: str) -> None:
        if text:
            self._show(self.stream.feed(text) if self.stream else [("content", text)])

    def close(self, end_of_generation: bool = False) -> None:
        """The reply's end (or its interruption), the colors reset; text held back for a stop string that may have
        begun is shown only where an end-of-generation token ended the reply (llama-cli's server sends it then; a
        reply -n, the context or Ctrl-C ends never sends it)."""
        if end_of_generation:
            self._content(self.scan.feed("", end_of_generation=True))
        if self.stream:
            self._show(self.stream.finish())
        if self.kind == "reasoning" and self.color:
            self.out.write(RESET)
            self.out.flush()

    def _show(self, parts) -> None:
        for kind, text in parts:
            if kind != self.kind:
                if not self.newline:
                    self.out.write("\n")
                if kind == "reasoning":
                    self.out.write((GRAY if self.color else "") + "\n[Start thinking]\n\n")  # (llama-cli's spacing)
                else:
                    self.out.write("[End thinking]" + (RESET if self.color else "") + "\n\n")
                self.kind, self.newline = kind, True
            if text:
                self.out.write(text)
                self.newline = text.endswith("\n")
        if parts:
            self.out.flush()


def render_messages(o, tok, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The conversation (after -sys's system message) in the template run() chose: o.chat_template. With -rea
    auto (and no enable_thinking kwarg) enable_thinking is what llama.cpp passes: on where the template can think."""
    from sharpi_core.chat import handed_over, render_chat, supports_thinking, system_role_merged
    msgs = ([{"role": "system", "content": o.system_prompt}] if o.system_prompt else []) + messages
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
    # (--chat-template-kwargs may set any other variable, bos_token and eos_token too, as llama.cpp's may)
    tv = {"bos_token": bos, "eos_token": eos, **o.template_vars}
    if "enable_thinking" not in tv:
        tv["enable_thinking"] = supports_thinking(o.chat_template, **tv)
    msgs = handed_over(o.chat_template, system_role_merged(o.chat_template, msgs, **tv))
    return render_chat(o.chat_template, msgs, add_generation_prompt, **tv)


def assistant_message(reply: str, tags: tuple[str, str] | None, prompt: str) -> dict:
    """A reply as the conversation keeps it, as llama-cli does: its reasoning block (the template's tags; none
    with --reasoning-format none) apart as `reasoning_content`, the rest as `content` (the chat template then
    renders or drops earlier reasoning, see --reasoning-preserve)."""
    from sharpi_core.reasoning import opens_block, split_reasoning
    parts = split_reasoning(reply, tags, opens_block(prompt, tags)) if tags else None
    if parts is None:
        return {"role": "assistant", "content": reply}
    reasoning, content = parts
    return {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}


def encode_chat(tok, text: str) -> list[int]:
    """Rendered chat -> ids; BOS is added only when the template did not already write it."""
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
    add = tok.add_bos and not (bos and text.startswith(bos))
    ids = tok.encode(text, add_special=False, parse_special=True)
    return ([tok.bos_id] if add else []) + ids


COMMANDS = ("/exit or Ctrl-D quits, /regen regenerates the last reply, /clear clears the history, "
            "/read FILE adds a text file to your next message, /glob PATTERN the files it matches")
GLOB_MAX = 100  # files one /glob adds at most (llama-cli's)


def glob_match(pattern: bytes, name: bytes) -> bool:
    """llama.cpp's glob (common.cpp glob_match): `*` any run of characters but `/`, `**` any run, `?` one character
    but `/`, `[...]` a class (ranges `a-z`, `!` negates, a first `]` or `-` literal); on the bytes, as there."""
    if not pattern:
        return not name
    if pattern[:2] == b"**":
        return glob_match(pattern[2:], name) or (bool(name) and glob_match(pattern, name[1:]))
    if pattern[:1] == b"*":
        for i in range(len(name) + 1):
            if glob_match(pattern[1:], name[i:]):
                return True
            if i < len(name) and name[i:i + 1] == b"/":
                return False
        return False
    if pattern[:1] == b"?":
        return bool(name) and name[:1] != b"/" and glob_match(pattern[1:], name[1:])
    if pattern[:1] == b"[":
        end = 1 + (pattern[1:2] in (b"]", b"-"))
        while end < len(pattern) and pattern[end:end + 1] != b"]":
            end += 1
        if end < len(pattern):
            return bool(name) and _class_match(name[0], pattern[1:end]) and glob_match(pattern[end + 1:], name[1:])
        return name[:1] == b"[" and glob_match(pattern[1:], name[1:])
    return pattern[:1] == name[:1] and glob_match(pattern[1:], name[1:])


def _class_match(c: int, cls: bytes) -> bool:
    negated = cls[:1] == b"!"
    cls = cls[1:] if negated else cls
    if cls[:1] in (b"]", b"-"):
        if cls[0] == c:
            return not negated
        cls = cls[1:]
    i, matched = 0, False
    while i < len(cls):
        if i + 2 < len(cls) and cls[i + 1:i + 2] == b"-" and cls[i + 2:i + 3] != b"]":
            if cls[i] <= c <= cls[i + 2]:
                matched = True
                break
            i += 3
        else:
            if cls[i] == c:
                matched = True
                break
            i += 1
    return matched != negated


def glob_regex(pattern: bytes) -> re.Pattern:
    """glob_match's language as one compiled regular expression (fullmatch on the bytes): a /glob over a large tree
    matched each path by recursion in Python (15 s for 117k files)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i:i + 1]
        if pattern[i:i + 2] == b"**":
            out.append(b".*")
            i += 2
            continue
        if c == b"*":
            out.append(b"[^/]*")
        elif c == b"?":
            out.append(b"[^/]")
        elif c == b"[":
            end = i + 1 + (pattern[i + 1:i + 2] in (b"]", b"-"))
            while end < len(pattern) and pattern[end:end + 1] != b"]":
                end += 1
            if end >= len(pattern):  # (no end: a literal "[")
                out.append(re.escape(c))
            else:
                out.append(_class_regex(pattern[i + 1:end]))
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile(b"".join(out), re.DOTALL)


def _class_regex(cls: bytes) -> bytes:
    """_class_match's set as a regex class: a first `]` or `-` literal, ranges a-z (a reversed one matches nothing)."""
    negated = cls[:1] == b"!"
    cls = cls[1:] if negated else cls
    items, i = [], 0
    if cls[:1] in (b"]", b"-"):
        items.append(re.escape(cls[:1]))
        i = 1
    while i < len(cls):
        if i + 2 < len(cls) and cls[i + 1:i + 2] == b"-" and cls[i + 2:i + 3] != b"]":
            if cls[i] <= cls[i + 2]:
                items.append(re.escape(cls[i:i + 1]) + b"-" + re.escape(cls[i + 2:i + 3]))
            i += 3
        else:
            items.append(re.escape(cls[i:i + 1]))
            i += 1
    if not items:
        return b"." if negated else b"(?!)"
    return b"[" + (b"^" if negated else b"") + b"".join(items) + b"]"


def glob_files(pattern: str) -> list[str]:
    """/glob PATTERN: the files it matches, as llama-cli finds them: under the folder the pattern names before its
    first glob character (`~` for the home folder), else the current one, at any depth, the pattern matched against
    paths relative to that folder; sorted, at most GLOB_MAX + 1 (more than GLOB_MAX: too many). A file is named as
    llama-cli names it in the message (`current_path() / folder / relative path`, std::filesystem's `/`): the current
    folder, the folder as typed (`~` expanded; an absolute one replaces the current folder) and its path under it,
    joined as strings (`./` and `..` kept)."""
    from pathlib import Path
    base, folder = Path.cwd(), ""
    start = min((pattern.find(c) for c in "![*?" if c in pattern), default=-1)
    if start > 0 and "/" in pattern[:start]:
        cut = pattern[:start].rfind("/")
        folder = pattern[:cut]
        if folder.startswith("~"):
            folder = os.path.expanduser("~") + folder[1:]  # (llama-cli: $HOME in place of the ~, whatever follows)
        base = base / folder
        pattern = pattern[cut + 1:]
    found, match = [], glob_regex(os.fsencode(pattern)).fullmatch
    for root, dirs, names in os.walk(base, onerror=lambda e: None):
        dirs.sort()
        rel = os.path.relpath(root, base)
        prefix = b"" if rel == "." else os.fsencode(Path(rel).as_posix()) + b"/"
        for n in sorted(names):
            if match(prefix + os.fsencode(n)) and (Path(root) / n).is_file():
                found.append(os.path.join(os.getcwd(), folder, os.fsdecode(prefix) + n))
                if len(found) > GLOB_MAX:
                    return found
    return found


def parse_command(line: str) -> tuple[str, str] | None:
    """A typed line that is one of the chat's commands -> (its name, its argument); None for a message."""
    cmd = line.strip()
    name, _, arg = cmd.partition(" ")
    if cmd in ("/exit", "/quit", "/clear", "/regen") or name in ("/read", "/glob"):
        return name, arg.strip()
    return None


def chat_loop(o, target, gen, n_ctx: int, first_message: str | None = None) -> int:
    """llama-cli's conversation loop and commands; a turn that does not fit the context is refused
    with one line and the session goes on (only -st, one turn, exits on it)."""
    from .inputs import reverse_prompt_tokens
    from .log import log
    from .runner import print_report
    tok = target.tokenizer
    tags = reply_tags(o, tok)
    color = use_color(o.color)
    stop_tokens = reverse_prompt_tokens(tok, o.reverse_prompt)
    messages: list[dict] = []
    if o.system_prompt and not o.single_turn:  # (-st's one turn is refused by the turn's own check below)
        check_system_prompt_fits(o, tok, n_ctx)
    log(f"== conversation mode: Ctrl-C stops a reply; {COMMANDS}; "
        + ("a message goes on over lines until one ends in \\ or / ==" if o.multiline_input
           else "a line ending in \\ continues on the next =="))
    console = sys.stdin.isatty() and not o.simple_io
    if console:
        try:  # input() then edits lines and keeps a history (arrow keys), as llama-cli's console does
            import readline
            bracketed_paste(readline)
        except ImportError:
            pass
    pending = first_message
    files = ""  # /read: text that goes before the next message
    last = None
    out = open_transcript(o)

    def add_file(name: str, cmd: str) -> bool:
        nonlocal files
        try:
            text, bad = read_text_file(name)
        except ValueError as e:
            log(f"error: {cmd}: cannot read '{name}' ({e})")
            return False
        if bad:  # (as -f says it)
            log(f"warning: {cmd}: '{name}' is not all UTF-8 text: {bad} byte{'s' * (bad > 1)} read as U+FFFD")
        least = tok.fewest_tokens(files + text)  # (refused before a long text is tokenized, at every message)
        if least + 2 > n_ctx:
            log(f"error: {cmd}: '{name}' ({len(text)} characters) makes the files for your next message at least "
                f"{least} tokens, more than the context of {n_ctx} holds with a reply")
            return False
        files += f"--- File: {name} ---\n{text}"  # (as llama-cli: what follows is glued to a text without a newline)
        log(f"[{name}: {len(text)} characters, sent with your next message]")
        if out:
            out.write(f"User: Added text file: {name}\n")
        return True
    while True:
        typed = pending is None  # (-p's message is read as a typed line, its commands too: llama-cli's)
        if not typed:
            line, pending = pending, None
            if not o.single_turn:  # -cnv -p: shown as a message typed at the prompt (llama-cli echoes it)
                data = line.encode()  # (llama-cli cuts at 500 bytes; here at the character boundary before)
                sys.stdout.write(f"> {data[:500].decode(errors='ignore')} ... (truncated)\n" if len(data) > 500
                                 else f"> {line}\n")
        else:
            try:
                line = read_message(o.multiline_input)
            except (EOFError, KeyboardInterrupt):
                sys.stdout.write("\n")  # ends the line "> " began (piped output too: it ends in a newline)
                break
        if not line.strip():
            continue
        cmd, arg = parse_command(line) or (None, "")
        if cmd in ("/exit", "/quit"):
            if typed and not sys.stdin.isatty():  # (no echo of the typed line ended the line "> " began)
                sys.stdout.write("\n")
            break
        if cmd == "/clear":
            messages.clear()
            files = ""
            log("[chat history cleared]")
            continue
        if cmd == "/read":
            name = arg
            if len(name) > 1 and name[0] == name[-1] and name[0] in "'\"":  # (a quoted name: a shell habit)
                name = name[1:-1]
            if not name:
                log("error: /read needs a file name")
            else:
                add_file(name, "/read")
            continue
        if cmd == "/glob":
            pattern = arg
            try:  # (a search through a large tree takes a while: Ctrl-C ends it, not the chat)
                found = glob_files(pattern) if pattern else []
            except KeyboardInterrupt:
                log("\n[/glob stopped: nothing added]")
                continue
            if not pattern:
                log("error: /glob needs a pattern (e.g. /glob src/**.py)")
            elif not found:
                log(f"error: /glob: no file matches '{pattern}'")
            elif len(found) > GLOB_MAX:
                log(f"error: /glob: more than {GLOB_MAX} files match '{pattern}' (nothing added: narrow it)")
            else:
                for name in found:
                    add_file(name, "/glob")
            continue
        if cmd == "/regen":
            if not messages or messages[-1]["role"] != "assistant":
                log("error: /regen: no reply to regenerate")
                continue
            line = None
        # the conversation this reply answers; `messages` takes it only once the reply is made
        if line is None:  # /regen: the last reply goes
            turn = messages[:-1]
        else:
            turn = [*messages, {"role": "user", "content": files + line}]
            files = ""
        # Ctrl-C from here on stops this reply (rendering and prefill included), not the session
        with Interrupt() as stop, hidden_typing(console):
            try:
                text = render_messages(o, tok, turn)
            except SharpiError as e:  # (a template may refuse a later turn: that message, not the session)
                if o.single_turn:
                    raise
                log(f"error: {e}: not sent; /clear starts over")
                continue
            ids = encode_chat(tok, text)
            if len(ids) + 1 > n_ctx:
                msg = f"the conversation is {len(ids)} tokens, which does not fit the context of {n_ctx}"
                if o.single_turn:
                    raise SharpiError(f"{msg}; raise -c/--ctx-size")
                log(f"error: {msg}: not sent; /clear starts over (or raise -c/--ctx-size)")
                continue
            if out and line is not None:  # (a message refused above was not sent: not in the transcript)
                out.write(f"User:\n{turn[-1]['content']}\n\n")
            view, res = ReplyView(sys.stdout, tags, text, color, o.reverse_prompt), None
            try:  # (stop strings in the reply only, not begun in the template's text before it)
                res = gen.generate(ids, n_predict=o.n_predict, stop_strings=list(o.reverse_prompt),
                                   on_text=view.write, should_stop=stop, stop_tokens=stop_tokens, stops_in_prompt=False,
                                   drop_partial_char=True)
            finally:
                view.close(res is not None and res.stop_reason == "eos")
        sys.stdout.write("\n")
        sys.stdout.flush()
        if res.stop_reason == "interrupted":
            log("[reply stopped]")
        elif res.stop_reason == "ctx_full":
            log(f"[the context ({n_ctx} tokens) is full: the reply was cut; /clear starts over]")
        # (with -sp the shown text has the control tokens; the conversation keeps the reply's own text)
        reply = reply_text(tok, res, o.reverse_prompt)
        messages = [*turn, assistant_message(reply, tags, text)]
        if out:
            out.write(transcript_reply(messages[-1]))
        if o.show_timings:  # llama-cli's line after each reply
            t = res.timings
            # (no rate where nothing was drafted: 0% would read as every draft rejected)
            spec = "" if res.spec is None or not res.spec.drafted else f" | Accepted: {100 * res.spec.acceptance:.0f}%"
            log(f"[ Prompt: {t.prompt_tps:.1f} t/s | Generation: {t.eval_tps:.1f} t/s{spec} ]")
        if o.verbose:
            log(f"[turn: {res.timings.prompt_n} new prompt tokens evaluated of {len(ids)}, "
                f"{len(res.tokens)} generated, {res.timings.eval_tps:.1f} t/s]")
        if last is not None:  # the report at the end covers the session: every reply's timings and drafts
            res = replace(res, timings=last.timings + res.timings,
                          spec=res.spec if last.spec is None else last.spec if res.spec is None else last.spec + res.spec,
                          context_shifts=last.context_shifts + res.context_shifts)
        last = res
        if o.single_turn:
            break
    if out:
        out.close()
    if last is not None:
        print_report(target, last, o)
    return 0


def check_system_prompt_fits(o, tok, n_ctx: int) -> None:
    """A system prompt that leaves no room for a message in the context is refused at the start (else every
    message would be refused, and /clear keeps the system prompt)."""
    from sharpi_core.errors import UsageError
    least = tok.fewest_tokens(o.system_prompt or "")  # (before a long text is tokenized: minutes for 100 MB)
    if least + 2 > n_ctx:
        raise UsageError(f"the system prompt is at least {least} tokens ({len(o.system_prompt)} characters), which "
                         f"leaves no room for a message and a reply in the context of {n_ctx}; raise -c/--ctx-size")
    try:
        n = len(encode_chat(tok, render_messages(o, tok, [{"role": "user", "content": ""}])))
    except SharpiError:  # a template that refuses an empty message: each turn's own check is left
        return
    if n + 2 > n_ctx:  # (a message is a token at least, and the reply's first token needs its slot)
        raise UsageError(f"the system prompt makes a conversation of {n} tokens before any message, which leaves no "
                         f"room for a message and a reply in the context of {n_ctx}; raise -c/--ctx-size")


class StopScan:
    """-r's stop strings on a reply's text as llama-cli's server applies them, token by token: it sends a token's
    text, and what it held back before, unless that text ends with the beginning of a stop string (then it holds it
    all back, to see what the next token brings); a stop string within the text not sent, starting within its last
    token's and the string's length, cuts the text there and ends it; an end-of-generation token sends what was held
    back, but a reply that -n (or the context) ends never sends it. feed() returns the text sent; a piece is the text
    one token completes ("" inside a character: the server waits for the whole character)."""

    def __init__(self, stops=()):
        self.stops = [s for s in stops if s]
        self.held, self.stopped = "", False

    def feed(self, piece: str, end_of_generation: bool = False) -> str:
        from sharpi_core.reasoning import partial_tail  # (llama.cpp's string_find_partial_stop)
        if self.stopped:
            return ""
        text = self.held + piece
        found = [i for i in (text.find(s, max(0, len(text) - len(s) - len(piece))) for s in self.stops) if i >= 0]
        if found:
            self.held, self.stopped = "", True
            return text[:min(found)]
        if not end_of_generation and any(partial_tail(text, s) for s in self.stops):
            self.held = text
            return ""
        self.held = ""
        return text


def reply_text(tok, res, stops=()) -> str:
    """A reply as the conversation keeps it: the text llama-cli's server sent (StopScan: a stop string and what
    follows it cut off, text held back for one that may have begun dropped unless an end-of-generation token ended
    the reply; a character the reply ended inside dropped), without control tokens (which -sp shows)."""
    from sharpi_core.tokenizer import StreamDecoder
    scan, dec = StopScan(stops), StreamDecoder(tok, False)
    parts = [scan.feed(dec.push(t)) for t in res.tokens]
    if res.stop_reason == "eos" and not dec.flush():  # (inside a character the server sends nothing)
        parts.append(scan.feed("", end_of_generation=True))
    return "".join(parts)


class Transcript:
    """-o's file, line-buffered (each turn as it ends); a write that fails (a full disk) is one error line naming it.
    A file name that is not UTF-8 (one /glob found) is written as the chat shows it (`\\udcfe`)."""

    def __init__(self, name: str):
        self.name = name
        try:
            self.f = open(name, "w", encoding="utf-8", errors="backslashreplace", buffering=1)
        except OSError as e:
            raise SharpiError(f"cannot write the output file {name}: {e.strerror}") from None

    def write(self, text: str) -> None:
        try:
            self.f.write(text)
        except OSError as e:
            self._failed(e)

    def close(self) -> None:
        try:
            self.f.close()
        except OSError as e:  # (what the line buffer still held)
            self._failed(e)

    def _failed(self, e: OSError) -> NoReturn:
        """The file given up, closed at once: what its buffer holds cannot be written, and a file object left open
        would try again when collected (Python then prints the failure, traceback and all, on stderr)."""
        try:
            self.f.close()
        except OSError:
            pass
        raise SharpiError(f"cannot write the output file {self.name}: {e.strerror}") from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def open_transcript(o):
    """-o FILE: the conversation written there as llama-cli writes it."""
    return Transcript(o.output_file) if o.output_file else None


def transcript_reply(message: dict) -> str:
    """A reply (assistant_message's) in -o's transcript: its reasoning between [Start thinking] and [End thinking]
    (llama-cli's lines)."""
    reasoning, content = message.get("reasoning_content", ""), message["content"]
    text = "Assistant:\n" + (f"[Start thinking]\n\n{reasoning}[End thinking]\n\n" if reasoning else "") + content
    return text + ("" if text.endswith("\n") else "\n") + "\n"


def read_text_file(name: str) -> tuple[str, int]:
    """A file's text for /read (undecodable bytes replaced) and how many bytes were not UTF-8; ValueError saying why
    it cannot be read, is not a file (a device such as /dev/zero, a FIFO: no end to read to) or is no text (NUL bytes:
    a model, an image)."""
    from pathlib import Path
    path = Path(name).expanduser()
    try:
        if path.is_dir():
            raise ValueError("a directory")
        if path.exists() and not path.is_file():
            raise ValueError("not a regular file")
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(e.strerror or str(e)) from None
    except MemoryError:
        raise ValueError("too large for this machine's memory") from None
    if b"\0" in data:
        raise ValueError("not a text file: it holds NUL bytes")
    return text_from_bytes(data)
