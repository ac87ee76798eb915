"""Conversation mode: a terminal REPL over the GGUF's chat template, reusing the KV cache across turns."""
from __future__ import annotations

import signal
import sys

from sharpi_core.errors import SharpiError


class Interrupt:
    """Ctrl-C stops the current reply (not the session); a second Ctrl-C in the same reply quits."""

    def __init__(self):
        self.flag = False
        self._prev = None

    def __enter__(self):
        self.flag = False

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


def render_messages(o, tok, messages: list[dict], add_generation_prompt: bool = True) -> str:
    from sharpi_core.chat import render_chat
    msgs = ([{"role": "system", "content": o.system_prompt}] if o.system_prompt else []) + messages
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
    return render_chat(tok.chat_template, msgs, add_generation_prompt, bos_token=bos, eos_token=eos)


def encode_chat(tok, text: str) -> list[int]:
    """Rendered chat -> ids; BOS is added only when the template did not already write it."""
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
    add = tok.add_bos and not (bos and text.startswith(bos))
    ids = tok.encode(text, add_special=False, parse_special=True)
    return ([tok.bos_id] if add else []) + ids


def chat_loop(o, target, gen, n_ctx: int, first_message: str | None = None) -> int:
    from .runner import log, print_report
    tok = target.tokenizer
    messages: list[dict] = []
    log("== conversation mode: Ctrl-C stops a reply, Ctrl-D or /exit quits ==")
    pending = first_message
    last = None
    while True:
        if pending is not None:
            line, pending = pending, None
        else:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                break
            except KeyboardInterrupt:
                print(file=sys.stderr)
                break
            if line.strip() in ("/exit", "/quit"):
                break
            if not line.strip():
                continue
        messages.append({"role": "user", "content": line})
        # Ctrl-C from here on stops this reply (rendering and prefill included), not the session
        with Interrupt() as stop:
            ids = encode_chat(tok, render_messages(o, tok, messages))
            if len(ids) + 1 > n_ctx:
                raise SharpiError(f"the conversation is {len(ids)} tokens, which does not fit the context of "
                                  f"{n_ctx}; raise -c/--ctx-size")
            res = gen.generate(ids, n_predict=o.n_predict, stop_strings=list(o.reverse_prompt),
                               on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()), should_stop=stop)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if res.stop_reason == "interrupted":
            log("[reply stopped]")
        messages.append({"role": "assistant", "content": res.text})
        if o.verbose:
            log(f"[turn: {res.timings.prompt_n} new prompt tokens evaluated of {len(ids)}, "
                f"{len(res.tokens)} generated, {res.timings.eval_tps:.1f} t/s]")
        last = res
        if o.single_turn:
            break
    if last is not None:
        print_report(target, last, o.verbose)
    return 0
