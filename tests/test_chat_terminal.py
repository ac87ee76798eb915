"""Conversation mode in a real pseudo-terminal (pexpect): turns, Ctrl-C stops a reply, /exit and Ctrl-D quit."""
from __future__ import annotations

import shutil
import sys

import pytest

from conftest import SMOL, ctrl_c_default, model_path

pexpect = pytest.importorskip("pexpect")
SHARPI = shutil.which("sharpi") or f"{sys.executable} -m sharpi_cli.main"


def spawn(*args):
    cmd = SHARPI.split() + ["-m", str(model_path(SMOL))] + list(args)
    return pexpect.spawn(cmd[0], cmd[1:], encoding="utf-8", timeout=120, dimensions=(40, 200),
                         preexec_fn=ctrl_c_default)


def test_chat_two_turns_then_exit():
    p = spawn("--temp", "0", "-n", "24", "-sys", "You are a helpful assistant.", "--verbose")
    p.expect("conversation mode")
    p.expect("> ")
    p.sendline("What is the capital of France?")
    p.expect(r"\[turn: (\d+) new prompt tokens evaluated of (\d+), (\d+) generated")
    first_new, first_total = int(p.match.group(1)), int(p.match.group(2))
    assert first_new == first_total and int(p.match.group(3)) > 0
    p.expect("> ")
    p.sendline("And of Germany?")
    p.expect(r"\[turn: (\d+) new prompt tokens evaluated of (\d+)")
    # the second turn reuses the KV cache of the first: only the new part is evaluated
    assert int(p.match.group(1)) < int(p.match.group(2)) - first_total + 10
    p.expect("> ")
    p.sendline("/exit")
    p.expect(pexpect.EOF)
    p.close()
    assert p.exitstatus == 0


def test_ctrl_c_stops_reply_not_session_and_ctrl_d_quits():
    p = spawn("--temp", "0", "-n", "-1", "-c", "2048")
    p.expect("> ")
    p.sendline("Write a very long story about a dragon, with many chapters.")
    p.expect("chapters.\r\n")  # the terminal's echo of the line
    p.expect(r"\w+ \w+ \w+")  # the reply has started streaming
    p.sendintr()
    p.expect(r"\[reply stopped\]")
    p.expect("> ")
    p.sendline("Say hi.")
    p.expect("> ")
    p.sendeof()
    p.expect(pexpect.EOF)
    p.close()
    assert p.exitstatus == 0


def test_line_editing_history_and_continued_lines():
    # readline: the up arrow brings the last message back; a trailing backslash continues a message
    p = spawn("--temp", "0", "-n", "6", "--verbose")
    p.expect("> ")
    p.sendline("Say hi.")
    p.expect(r"\[turn: \d+ new prompt tokens evaluated of (\d+)")
    first = int(p.match.group(1))
    p.expect("> ")
    p.send("\x1b[A")  # up arrow: readline puts "Say hi." back on the line (no readline: "^[[A")
    p.expect(r"Say hi\.", timeout=30)
    p.send("\r")
    p.expect(r"\[turn: \d+ new prompt tokens evaluated of (\d+)")
    second = int(p.match.group(1))
    assert second > first + 5
    p.expect("> ")
    p.sendline("Say\\")
    p.sendline("hi.")
    p.expect(r"\[turn: \d+ new prompt tokens evaluated of (\d+)")
    third = int(p.match.group(1))
    # one message "Say\nhi." (one turn, as long as "Say hi." give or take the newline's token)
    assert abs((third - second) - (second - first)) <= 2
    p.expect("> ")
    p.sendline("/exit")
    p.expect(pexpect.EOF)
    assert "[turn:" not in p.before  # "hi." was not a turn of its own
    p.close()
    assert p.exitstatus == 0


def test_interactive_ctrl_c_hands_control_over_and_quits_at_the_input():
    """-i: Ctrl-C while the model writes hands control to the user (--in-prefix shows it), the line goes on
    the text (--in-suffix after it) and the model goes on; Ctrl-C at the input quits (130, as llama.cpp)."""
    p = spawn("-i", "--temp", "0", "-n", "-1", "-c", "2048", "--in-prefix", "[you]", "--in-suffix", "[model]",
              "-p", "Once upon a time")
    p.expect("Once upon a time")
    p.expect(r"\w+ \w+ \w+")  # generated
    p.sendintr()
    p.expect(r"\[you\]")
    p.sendline("The dragon said")
    p.expect(r"\[model\]")
    p.expect(r"\w+ \w+")
    p.sendintr()
    p.expect(r"\[you\]")
    p.sendintr()
    p.expect(pexpect.EOF)
    p.close()
    assert p.exitstatus == 130


@pytest.mark.parametrize("line_editing", [True, False])
def test_ctrl_c_pending_before_the_input_wait_is_not_lost(line_editing):
    """A Ctrl-C whose handler is pending when the input wait starts (here: taken by another thread, so the main
    thread's select() is never interrupted by it; in a run, one that lands between the prompt and the wait) still
    stops the input, within a fraction of a second: not only when a key is pressed."""
    script = f"""
import signal, sys, threading, time
{"import readline" if line_editing else ""}
from sharpi_cli.interactive import read_input
def handler(signum, frame):
    raise KeyboardInterrupt
signal.signal(signal.SIGINT, handler)
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # SIGINT unblocked here
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])  # ... not in the main thread
try:
    read_input(False, "[you]")
    print("READ")
except KeyboardInterrupt:
    print("STOPPED")
"""
    p = pexpect.spawn(sys.executable, ["-c", script], encoding="utf-8", timeout=20, preexec_fn=ctrl_c_default)
    p.expect(r"\[you\]")
    p.sendintr()
    assert p.expect(["STOPPED", pexpect.TIMEOUT], timeout=5) == 0, "the Ctrl-C waited for a key"
    p.expect(pexpect.EOF)


@pytest.mark.parametrize("mode", ["-cnv", "-i"])
def test_simple_io_prompts_go_to_stdout(tmp_path, mode):
    # without readline (--simple-io) CPython's input() at a terminal writes its prompt to stderr: the "> " of a chat
    # (and -i's --in-prefix) must still be on stdout, none of it in what 2> takes
    err = tmp_path / "err.txt"
    cmd = " ".join(SHARPI.split() + ["-m", str(model_path(SMOL)), "--temp", "0", "-n", "4", "--simple-io", mode,
                                     *(("--in-prefix", "'IN: '", "-p", "'Hi'") if mode == "-i" else ())])
    p = pexpect.spawn("bash", ["-c", f"{cmd} 2>{err}"], encoding="utf-8", timeout=120, dimensions=(40, 200))
    p.expect("> " if mode == "-cnv" else "IN: ")
    p.sendline("Say hi.")
    p.expect("> " if mode == "-cnv" else "IN: ")
    p.sendeof()
    p.expect(pexpect.EOF)
    p.close()
    assert p.exitstatus == 0
    said = err.read_text()
    assert "> " not in said and "IN: " not in said, said


def test_sigterm_at_the_prompt_restores_the_terminal():
    """SIGTERM (or SIGHUP) exits through Python, 128 + the signal: readline turns bracketed paste off again (the
    signal's default action left the terminal in that mode)."""
    import signal
    p = spawn("--temp", "0", "-n", "8")
    p.expect("\x1b\\[\\?2004h")  # (readline's bracketed paste: on while it reads)
    p.expect("> ")
    p.kill(signal.SIGTERM)
    p.expect(pexpect.EOF)
    p.close()
    assert "\x1b[?2004l" in p.before and "Traceback" not in p.before
    assert p.exitstatus == 128 + signal.SIGTERM and p.signalstatus is None


def test_sigterm_while_the_model_loads_turns_the_echo_back_on():
    """The echo goes off as the run starts (so that typing ahead shows once, at the prompt); a SIGTERM before the
    prompt (the model still loading) exits through Python, which puts the terminal's settings back."""
    import signal
    import time
    p = spawn("--temp", "0", "-n", "8")
    deadline = time.monotonic() + 60
    while p.getecho() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not p.getecho()
    p.kill(signal.SIGTERM)
    p.expect(pexpect.EOF)
    assert p.getecho()  # (the master side reads the terminal's settings as the run left them)
    p.close()
    assert "Traceback" not in p.before
    assert p.exitstatus == 128 + signal.SIGTERM and p.signalstatus is None
