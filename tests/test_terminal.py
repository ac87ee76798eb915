"""The console script at a terminal (a pseudo-terminal here): what only a terminal shows, and Ctrl-C's timing."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from conftest import SMOL, ctrl_c_default, model_path

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX terminals")

from test_cli import SHARPI  # noqa: E402


def read_until(fd: int, wanted: bytes, seen: bytearray, timeout: float = 120.0) -> bool:
    """Read the terminal's output into seen until it holds `wanted` after what it held before (True) or the child
    closed it / time ran out (False)."""
    start, deadline = len(seen), time.monotonic() + timeout
    while wanted not in seen[start:]:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return False
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # (the child closed its side)
            return False
        if not chunk:
            return False
        seen += chunk
    return True


def chat_on_a_terminal(*args):
    """sharpi -cnv with stdin and stdout on a pseudo-terminal (stderr a pipe) -> (process, the terminal's fd)."""
    import pty
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm")  # (readline turns bracketed paste off on a dumb terminal)
    p = subprocess.Popen(SHARPI.split() + ["-m", model_path(SMOL), "-cnv", "--temp", "0", *map(str, args)],
                         stdin=slave, stdout=slave, stderr=subprocess.PIPE, env=env, close_fds=True)
    os.close(slave)
    return p, master


def test_a_pasted_message_of_several_lines_is_one_message(tmp_path):
    """Readline's bracketed paste is on (CPython turns it off): the terminal marks a paste, and its lines are one
    message with one reply, as in llama-cli, not a message and a reply per line."""
    out = tmp_path / "chat.txt"
    p, fd = chat_on_a_terminal("-n", 4, "--no-show-timings", "-o", out)
    seen = bytearray()
    try:
        assert read_until(fd, b"> ", seen), bytes(seen)
        assert b"\x1b[?2004h" in seen  # (asked of the terminal with the prompt)
        os.write(fd, b"\x1b[200~Say one.\nSay two.\x1b[201~\r")
        assert read_until(fd, b"> ", seen), bytes(seen)
        os.write(fd, b"\x04")  # Ctrl-D at the prompt: the session ends
        p.wait(timeout=120)
    finally:
        p.kill()
        os.close(fd)
    assert p.returncode == 0, p.stderr.read()
    transcript = out.read_text()
    assert transcript.count("User:") == 1 and "User:\nSay one.\nSay two.\n" in transcript, transcript
    assert transcript.count("Assistant:") == 1


def test_what_is_typed_during_a_reply_is_not_echoed_into_it():
    """chat.hidden_typing: the terminal's echo is off while a reply is written and back as it was afterwards,
    also when the block ends in an exception; type-ahead is kept (read at the next prompt)."""
    import pty
    import termios

    from sharpi_cli.chat import hidden_typing
    master, slave = pty.openpty()
    saved = sys.stdin
    try:
        sys.stdin = os.fdopen(os.dup(slave), "r")
        before = termios.tcgetattr(slave)
        assert before[3] & termios.ECHO
        with hidden_typing(True):
            assert not termios.tcgetattr(slave)[3] & (termios.ECHO | termios.ECHONL)
            os.write(master, b"typed ahead\n")
            time.sleep(0.1)
            assert not select.select([master], [], [], 0.2)[0]  # nothing came back to the screen
        assert termios.tcgetattr(slave) == before
        assert os.read(slave, 100) == b"typed ahead\n"  # kept for the next read
        with pytest.raises(KeyboardInterrupt):
            with hidden_typing(True):
                raise KeyboardInterrupt
        assert termios.tcgetattr(slave) == before
        with hidden_typing(False):  # --simple-io: the terminal is left alone
            assert termios.tcgetattr(slave) == before
    finally:
        sys.stdin.close()
        sys.stdin = saved
        os.close(master)
        os.close(slave)


def test_what_is_typed_while_the_model_loads_shows_once(tmp_path):
    """A chat turns the terminal's echo off as the run starts (llama.cpp's console does at its start), not only
    while a reply is written: text typed while the model loads is shown once, by line editing at the prompt (with
    the echo on it showed there and, before that, where the terminal echoed it), and is the first message."""
    import termios
    out = tmp_path / "chat.txt"
    p, fd = chat_on_a_terminal("-n", 4, "--no-show-timings", "-o", out)
    seen = bytearray()
    try:
        deadline = time.monotonic() + 120
        while termios.tcgetattr(fd)[3] & termios.ECHO:  # (the pty's master reads the terminal's settings)
            assert time.monotonic() < deadline and p.poll() is None, bytes(seen)
            if select.select([fd], [], [], 0.01)[0]:
                seen += os.read(fd, 4096)
        assert b"> " not in seen, "the echo went off only at the prompt"
        os.write(fd, b"Say hi")
        assert read_until(fd, b"> ", seen), bytes(seen)
        at, deadline = seen.index(b"> "), time.monotonic() + 10  # (line editing shows what waited for it, in
        while b"Say hi" not in seen[at:]:  # pieces that may come with the prompt's or apart)
            assert time.monotonic() < deadline and select.select([fd], [], [], 1)[0], bytes(seen)
            seen += os.read(fd, 4096)
        time.sleep(0.3)
        if select.select([fd], [], [], 0)[0]:
            seen += os.read(fd, 4096)
        assert seen.count(b"Say hi") == 1 and seen.index(b"Say hi") > seen.index(b"> "), bytes(seen)
        os.write(fd, b"\r")
        assert read_until(fd, b"> ", seen), bytes(seen)
        os.write(fd, b"\x04")
        p.wait(timeout=120)
        assert termios.tcgetattr(fd)[3] & termios.ECHO  # (back as it was)
    finally:
        p.kill()
        os.close(fd)
    assert p.returncode == 0, p.stderr.read()
    assert "User:\nSay hi\n" in out.read_text()


def test_ctrl_c_stops_a_long_prompt_between_its_batches(tmp_path):
    """Ctrl-C while a long prompt is evaluated ends the run at the next batch (exit 130), not after the whole
    prompt and a first token: the result shows fewer prompt tokens evaluated than the prompt has, none generated."""
    f = tmp_path / "long.txt"
    f.write_text(" ".join(["lorem ipsum dolor sit amet"] * 1500))
    args = ["-m", model_path(SMOL), "-f", f, "-c", 16384, "-n", 8, "--temp", 0, "--json", "--verbose", "-b", 256]
    p = subprocess.Popen(SHARPI.split() + [str(a) for a in args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_default)
    try:
        for line in p.stderr:
            if "sampler chain" in line:  # (logged just before the prompt is evaluated)
                break
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 130, err
    d = json.loads(out)
    assert d["stop_reason"] == "interrupted" and d["tokens"] == []
    assert 0 < d["timings"]["prompt_n"] < 7000 and d["timings"]["prompt_n"] % 256 == 0, d["timings"]
