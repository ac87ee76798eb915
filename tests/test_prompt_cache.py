"""--prompt-cache: the saved K/V come back bit for bit, a later run evaluates only what the file lacks and
generates what it would have without the file, and a file made for something else is refused untouched."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import SMOL, loaded, model_path
from sharpi_core.errors import SharpiError
from sharpi_core.generate import Generator
from sharpi_core.prompt_cache import PromptCacheFile
from sharpi_core.sampling import SamplingParams
from test_cli import one_error_line, sharpi

PROMPT = "The history of the Roman Empire is long and complicated. In this essay I will describe"


@pytest.mark.parametrize("types", [("f16", "f16"), ("q8_0", "q8_0"), ("q4_1", "bf16")])
def test_restored_positions_are_the_saved_bytes_and_give_the_same_logits(tmp_path, types):
    model, tok = loaded(SMOL)
    ids = tok.encode(PROMPT)
    path = model_path(SMOL)
    cache = model.new_cache(64, *types)
    gen = Generator(model, cache, tok, SamplingParams(temp=0))
    gen.generate(ids, n_predict=4)
    f = tmp_path / "p.cache"
    assert PromptCacheFile(f).save({"target": (cache, gen.history, path)}, ids)
    assert not PromptCacheFile(f).save({"target": (cache, gen.history, path)}, ids)  # nothing new: not rewritten
    fresh, history = model.new_cache(64, *types), []
    n = PromptCacheFile(f).restore("target", fresh, history, path, ids + [13, 14])
    assert n == len(ids) == fresh.length and history == ids
    for name, a in cache.arrays(len(ids)).items():
        assert torch.equal(fresh.arrays(len(ids))[name], a), name
    # the next position's logits read the restored cache exactly as the one that wrote it
    x = torch.tensor([ids[-1]])
    cache.truncate(len(ids) - 1)
    fresh.truncate(len(ids) - 1)
    assert torch.equal(model.forward(x, len(ids) - 1, fresh), model.forward(x, len(ids) - 1, cache))
    # a prompt that shares only a prefix restores that prefix
    other, h2 = model.new_cache(64, *types), []
    assert PromptCacheFile(f).restore("target", other, h2, path, ids[:5] + [7, 7]) == 5 and h2 == ids[:5]
    # other cache types are refused
    with pytest.raises(SharpiError, match="KV cache there is"):
        PromptCacheFile(f).restore("target", model.new_cache(64, "bf16", "q8_0"), [], path, ids)


def test_runs_with_a_prompt_cache(tmp_path):
    smol = str(model_path(SMOL))
    f = tmp_path / "p.cache"
    run = ("-m", smol, "-n", 12, "--temp", 0, "--json", "--prompt-cache", f)
    plain = json.loads(sharpi("-m", smol, "-p", PROMPT, "-n", 12, "--temp", 0, "--json").stdout)
    first = json.loads(sharpi(*run, "-p", PROMPT).stdout)
    assert f.exists() and first["text"] == plain["text"] and first["timings"]["prompt_n"] == plain["timings"]["prompt_n"]
    second = json.loads(sharpi(*run, "-p", PROMPT).stdout)
    assert second["text"] == plain["text"] and second["timings"]["prompt_n"] == 1  # the last token, for its logits
    # a longer prompt evaluates what the file lacks; read-only leaves the file as it is
    before = f.read_bytes()
    longer = json.loads(sharpi(*run, "-p", PROMPT + " the Roman roads", "--prompt-cache-ro").stdout)
    _, tok = loaded(SMOL)
    a, b = tok.encode(PROMPT, add_special=True), tok.encode(PROMPT + " the Roman roads", add_special=True)
    assert b[:len(a)] == a and longer["timings"]["prompt_n"] == len(b) - len(a) > 1
    assert f.read_bytes() == before
    # what a run without the file computes when its prompt batches break where the restored part ends
    split = json.loads(sharpi("-m", smol, "-p", PROMPT + " the Roman roads", "-n", 12, "--temp", 0, "--json",
                              "-b", len(a)).stdout)
    assert longer["tokens"] == split["tokens"]
    # --prompt-cache-all keeps the generated tokens: the prompt plus its continuation is then all there
    r = sharpi(*run, "-p", PROMPT, "--prompt-cache-all", "-md", smol)
    assert json.loads(r.stdout)["text"] == plain["text"]
    entries = PromptCacheFile(f).entries
    assert len(entries["target"]["tokens"]) == plain["timings"]["prompt_n"] + 11 and "draft" in entries
    cont = json.loads(sharpi(*run, "-p", PROMPT + plain["text"]).stdout)
    assert cont["timings"]["prompt_n"] <= 2
    # a draft whose window slid past the prompt's start (-cd 16) holds later positions: it has no entry (its
    # K and V were saved as the prompt's first tokens')
    slid = tmp_path / "slid.cache"
    r = sharpi("-m", smol, "-md", smol, "-cd", 16, "-p", " the" * 40, "-n", 4, "--temp", 0, "--prompt-cache", slid)
    assert r.returncode == 0 and set(PromptCacheFile(slid).entries) == {"target"}


def test_an_empty_prompt_continues_the_saved_session(tmp_path):
    """llama-completion with an empty prompt and a session file takes the session's tokens as its prompt ("using
    full prompt from session file"): a --prompt-cache-all session goes on where it stopped (SmolLM2 adds no BOS:
    -p "" was refused as an empty prompt)."""
    smol = str(model_path(SMOL))
    f = tmp_path / "p.cache"
    run = ("-m", smol, "--temp", 0, "--json", "--prompt-cache", f)
    plain = json.loads(sharpi("-m", smol, "-p", PROMPT, "-n", 12, "--temp", 0, "--json").stdout)
    first = json.loads(sharpi(*run, "-p", PROMPT, "-n", 6, "--prompt-cache-all").stdout)
    assert first["tokens"] == plain["tokens"][:6]
    r = sharpi(*run, "-p", "", "-n", 7)  # (the session holds the prompt and 5 tokens: the 6th is generated again)
    assert r.returncode == 0 and "an empty prompt continues its session" in r.stderr, r.stderr
    assert json.loads(r.stdout)["tokens"] == plain["tokens"][5:12] and json.loads(r.stdout)["timings"]["prompt_n"] == 1
    one_error_line(sharpi(*run, "-p", "", "--prompt-cache", tmp_path / "none.cache"), 2, "empty prompt")


def test_a_draft_entry_made_for_another_draft_is_set_aside_not_fatal(tmp_path):
    """The draft's entry only spares the draft's prompt pass (llama.cpp's session files keep no draft): made with
    another draft cache type it is dropped with a note, the target's still restored, the output the same, and the
    file's draft entry made anew (the run failed)."""
    smol = str(model_path(SMOL))
    f = tmp_path / "p.cache"
    run = ("-m", smol, "-md", smol, "-p", PROMPT, "-n", 8, "--temp", 0, "--json", "--prompt-cache", f)
    first = json.loads(sharpi(*run).stdout)
    assert PromptCacheFile(f).entries["draft"]["type_k"] == "f16"
    r = sharpi(*run, "-ctkd", "q8_0", "-ctvd", "q8_0")
    assert r.returncode == 0 and "its draft entry was made for another draft model or cache" in r.stderr, r.stderr
    assert json.loads(r.stdout)["tokens"] == first["tokens"] and json.loads(r.stdout)["timings"]["prompt_n"] == 1
    assert PromptCacheFile(f).entries["draft"]["type_k"] == "q8_0"
    r = sharpi(*run, "-ctkd", "q8_0", "-ctvd", "q8_0")
    assert r.returncode == 0 and "draft entry" not in r.stderr, r.stderr


def test_prompt_cache_refusals_leave_the_file(tmp_path):
    smol = str(model_path(SMOL))
    f = tmp_path / "p.cache"
    assert sharpi("-m", smol, "-p", "Hi", "-n", 1, "--temp", 0, "--prompt-cache", f).returncode == 0
    made = f.read_bytes()
    one_error_line(sharpi("-m", smol, "-p", "Hi", "-n", 1, "-ctk", "q8_0", "--prompt-cache", f), 1, "KV cache there is")
    one_error_line(sharpi("-m", "gemma3-270m-q4_k_m", "-p", "Hi", "-n", 1, "--prompt-cache", f), 1, "another target model")
    # flags that change K (RoPE) make other caches of the same file: refused both ways
    one_error_line(sharpi("-m", smol, "-p", "Hi", "-n", 1, "--rope-freq-base", 20000, "--prompt-cache", f), 1,
                   "made with other model settings (none) than this run's (rope (20000.0")
    one_error_line(sharpi("-m", smol, "-p", "Hi", "-n", 1, "--override-kv", "llama.rope.freq_base=float:2e4",
                          "--prompt-cache", f), 1, "this run's (llama.rope.freq_base=20000.0)")
    assert f.read_bytes() == made
    g = tmp_path / "rope.cache"
    assert sharpi("-m", smol, "-p", "Hi", "-n", 1, "--temp", 0, "--rope-freq-base", 20000, "--prompt-cache", g).returncode == 0
    one_error_line(sharpi("-m", smol, "-p", "Hi", "-n", 1, "--prompt-cache", g), 1, "other model settings (rope (20000.0")
    assert sharpi("-m", smol, "-p", "Hi", "-n", 1, "--rope-freq-base", 20000, "--prompt-cache", g).returncode == 0
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes")
    one_error_line(sharpi("-m", smol, "-p", "Hi", "-n", 1, "--prompt-cache", mine), 1, "not a sharpi prompt cache")
    assert mine.read_text() == "my notes"
    one_error_line(sharpi("-m", smol, "-cnv", "--prompt-cache", f), 2, "one-shot")
    # damaged: bytes inside the arrays changed (torch reads it without complaint), or an entry malformed
    # (in process from here on: the CLI's one line for these errors is checked above)
    d = torch.load(f, weights_only=True)
    d["entries"]["target"]["arrays"]["k"][0, 0, 0, 0] += 1
    torch.save(d, tmp_path / "damaged")
    d["entries"]["target"]["tokens"] = None
    torch.save(d, tmp_path / "malformed")
    d = torch.load(f, weights_only=True)  # arrays no file of ours has: zero-dimensional, sparse
    d["entries"]["target"]["arrays"] = {"k": torch.tensor(1.0)}
    torch.save(d, tmp_path / "scalar")
    d["entries"]["target"]["arrays"] = {"k": torch.eye(3).to_sparse()}
    torch.save(d, tmp_path / "sparse")
    (tmp_path / "cut").write_bytes(made[:len(made) // 2])  # (a disk that filled, a copy stopped halfway)
    for name in ("damaged", "malformed", "scalar", "sparse", "cut"):
        bad = (tmp_path / name).read_bytes()
        with pytest.raises(SharpiError, match="damaged"):
            PromptCacheFile(tmp_path / name)
        assert (tmp_path / name).read_bytes() == bad
    # token ids outside the vocabulary under a digest made to match (a file edited by hand): damaged, where they
    # were a traceback (IndexError) when embedded or shown
    from sharpi_core.prompt_cache import _digest
    for i, wrong in enumerate((49152, -5, 2 ** 70)):
        d = torch.load(f, weights_only=True)
        e = d["entries"]["target"]
        e["tokens"][-1] = wrong
        e["digest"] = _digest(e["tokens"], e["arrays"])
        torch.save(d, tmp_path / f"vocab{i}")
        with pytest.raises(SharpiError, match="damaged"):
            PromptCacheFile(tmp_path / f"vocab{i}", n_vocab=49152)
        one_error_line(sharpi("-m", smol, "-p", "", "-n", 1, "--prompt-cache", tmp_path / f"vocab{i}"), 1,
                       "damaged (its target entry does not check out")
    e["tokens"][-1] = 49151
    e["digest"] = _digest(e["tokens"], e["arrays"])
    torch.save(d, tmp_path / "edited")
    assert sharpi("-m", smol, "-p", "", "-n", 1, "--prompt-cache", tmp_path / "edited").returncode == 0
    # a symbolic link is written through
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    assert sharpi("-m", smol, "-p", "Hi", "-n", 1, "--temp", 0, "--prompt-cache", link).returncode == 0
    assert link.is_symlink() and PromptCacheFile(tmp_path / "real").entries["target"]["tokens"]
    from sharpi_cli.options import RunOptions
    from sharpi_cli.validate import check_prompt_cache
    from sharpi_core.errors import UsageError
    for opts, why in ((dict(prompt_cache_all=True), "needs --prompt-cache"), (dict(prompt_cache=str(tmp_path)), "is a directory"),
                      (dict(prompt_cache=str(tmp_path / "no" / "p")), "does not exist")):
        with pytest.raises(UsageError, match=why):
            check_prompt_cache(RunOptions(**opts))


def test_a_failed_write_is_one_error_and_leaves_the_old_file(tmp_path, monkeypatch):
    model, tok = loaded(SMOL)
    ids = tok.encode(PROMPT)
    cache = model.new_cache(32)
    Generator(model, cache, tok, SamplingParams(temp=0)).generate(ids, n_predict=1)
    f = tmp_path / "p.cache"
    pc = PromptCacheFile(f)
    f.write_bytes(b"")  # (an old file: replaced only by a whole new one)

    def full_disk(obj, f):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 64\nmore")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(SharpiError, match="cannot write it .*unexpected pos 64"):
        pc.save({"target": (cache, ids, model_path(SMOL))}, ids)
    assert f.read_bytes() == b"" and [p.name for p in tmp_path.iterdir()] == ["p.cache"]


def test_a_full_disk_while_saving_says_so_and_keeps_the_old_file(tmp_path, monkeypatch):
    """torch's writer fails on a full disk with a RuntimeError whose text is its own internals: the error line says
    the disk is full; the old file stays, no partial file is left."""
    import shutil
    import types
    from sharpi_core import prompt_cache
    f = tmp_path / "p.cache"
    f.write_bytes(b"old")

    def full(obj, f):
        f.write(b"part")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    monkeypatch.setattr(prompt_cache.torch, "save", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: types.SimpleNamespace(free=4096))
    pc = prompt_cache.PromptCacheFile.__new__(prompt_cache.PromptCacheFile)
    pc.path, pc._target, pc.entries, pc.settings, pc._fingerprints = f, f, {}, "", {}
    cache = types.SimpleNamespace(length=2, type_k="f16", type_v="f16", rot_k=0, rot_v=0,
                                  arrays=lambda n: {"k": torch.zeros(1, n, 2)})
    monkeypatch.setattr(pc, "_fingerprint", lambda p: "fp")
    with pytest.raises(SharpiError, match=r"cannot write it \(no space left on the device\)"):
        pc.save({"target": (cache, [1, 2], "m.gguf")}, [1, 2])
    assert f.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["p.cache"]
    monkeypatch.setattr(shutil, "disk_usage", lambda p: types.SimpleNamespace(free=1 << 30))
    with pytest.raises(SharpiError, match=r"cannot write it \(\[enforce fail"):
        pc.save({"target": (cache, [1, 2], "m.gguf")}, [1, 2])


def test_a_device_is_written_in_place_and_a_fifo_refused(tmp_path):
    """A cache named by a character device is written into it (a rename put a plain file in the node's place: one
    run replaced /dev/null); a FIFO is refused at once (reading one waits for a writer that never comes)."""
    import os
    import stat
    node = tmp_path / "null"
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot make a device node here ({e})")
    r = sharpi("-m", model_path(SMOL), "-p", PROMPT, "-n", 1, "--temp", 0, "--prompt-cache", node)
    assert r.returncode == 0 and node.is_char_device() and sorted(p.name for p in tmp_path.iterdir()) == ["null"], r.stderr
    os.mkfifo(tmp_path / "fifo")
    one_error_line(sharpi("-m", model_path(SMOL), "-p", PROMPT, "-n", 1, "--prompt-cache", tmp_path / "fifo"), 1,
                   f"--prompt-cache {tmp_path / 'fifo'}: not a file a cache can be kept in (a FIFO, a socket)")


def test_a_replaced_file_keeps_its_permissions(tmp_path):
    """The new contents are written beside the file and renamed over it (a failed write leaves the old one): the
    file keeps its mode, as one written in place does (a private cache stays private, an executable bit stays)."""
    import os
    import stat
    from sharpi_core.files import replaced
    f = tmp_path / "p.cache"
    for mode in (0o600, 0o751):
        f.write_bytes(b"old")
        f.chmod(mode)
        with replaced(f) as out:
            out.write(b"new")
        assert f.read_bytes() == b"new" and stat.S_IMODE(f.stat().st_mode) == mode
    old_umask = os.umask(0o027)
    try:
        fresh = tmp_path / "fresh"
        with replaced(fresh) as out:  # (a new file: the umask's mode, as open makes it)
            out.write(b"x")
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o640
    finally:
        os.umask(old_umask)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "p.cache"]


def test_an_empty_file_starts_a_cache_and_a_shorter_prompt_leaves_it(tmp_path):
    """As llama.cpp's session files: an empty file (mktemp's) is a new cache, written at the end; a prompt that
    goes no further than the saved tokens leaves the file as it is (it was truncated to that prompt)."""
    smol = str(model_path(SMOL))
    f = tmp_path / "p.cache"
    f.write_bytes(b"")
    assert sharpi("-m", smol, "-p", PROMPT, "-n", 2, "--temp", 0, "--prompt-cache", f).returncode == 0
    made = f.read_bytes()
    n = len(PromptCacheFile(f).entries["target"]["tokens"])
    short = PROMPT[:PROMPT.index(" is long")]  # (its tokens begin the prompt's)
    r = sharpi("-m", smol, "-p", short, "-n", 2, "--temp", 0, "--prompt-cache", f, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["timings"]["prompt_n"] == 1 and f.read_bytes() == made
    r = sharpi("-m", smol, "-p", short + " fell", "-n", 2, "--temp", 0, "--prompt-cache", f)
    assert r.returncode == 0 and len(PromptCacheFile(f).entries["target"]["tokens"]) < n  # (another prompt: replaced)


def test_settings_that_change_k_and_v_make_another_cache(tmp_path, monkeypatch):
    """-fa off, the arithmetic's SHARPI_* switches, and an adapter's contents (not only its path) are
    in the settings a prompt cache compares."""
    from sharpi_cli.options import RunOptions
    from sharpi_cli.runner import model_settings
    assert model_settings(RunOptions(model="m"), 30) == model_settings(RunOptions(model="m", flash_attn="on"), 30) == ""
    assert model_settings(RunOptions(model="m", flash_attn="off"), 30) == "-fa off"
    for name in ("SHARPI_ACT_QUANT", "SHARPI_CPU_KERNEL"):
        monkeypatch.setenv(name, "off")
        assert model_settings(RunOptions(model="m"), 30) == f"{name}=0"
        monkeypatch.delenv(name)
    monkeypatch.setenv("SHARPI_AMX", "0")  # (the same bits)
    assert model_settings(RunOptions(model="m"), 30) == ""
    a = tmp_path / "a.gguf"
    a.write_bytes(b"GGUF one adapter")
    first = model_settings(RunOptions(model="m", lora=[str(a)]), 30)
    a.write_bytes(b"GGUF another one")
    assert model_settings(RunOptions(model="m", lora=[str(a)]), 30) != first
    assert model_settings(RunOptions(model="m", control_vector=[str(a)]), 30) != model_settings(RunOptions(model="m"), 30)
    smol = str(model_path(SMOL))
    f = tmp_path / "p.cache"
    assert sharpi("-m", smol, "-p", "Hi", "-n", 1, "--temp", 0, "-fa", "on", "--prompt-cache", f).returncode == 0
    one_error_line(sharpi("-m", smol, "-p", "Hi", "-n", 1, "-fa", "off", "--prompt-cache", f), 1,
                   "made with other model settings (none) than this run's (-fa off)")
