"""Models split into several GGUF files (llama-gguf-split, convert_hf_to_gguf.py --split-max-size): loaded from the
first part as llama.cpp's loader does, giving the unsplit file's output."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import gguf
import pytest

from conftest import ROOT, SMOL, model_path
from test_cli import one_error_line, sharpi

from sharpi_core.gguf_file import GGUFFile, split_paths

_spec = importlib.util.spec_from_file_location("gguf_derive", ROOT / "scripts" / "gguf_derive.py")
gguf_derive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gguf_derive)


def write_split(src: Path, dst: Path, max_size: int, small_first: bool = False) -> list[Path]:
    """src's metadata and tensors, byte for byte, into parts of at most max_size bytes of tensors as gguf-py's
    writer splits (the metadata in the first part, split.no / split.count / split.tensors.count in each;
    small_first: no tensor in the first part, as llama-gguf-split --no-tensor-first-split) -> the parts."""
    r = GGUFFile(src)
    w = gguf.GGUFWriter(str(dst), r.arch, split_max_size=max_size, small_first_shard=small_first)
    gguf_derive.copy_kv(r, w)
    for t in r.reader.tensors:
        gguf_derive.add_tensor_as_is(w, t)
    gguf_derive.finish(w)
    n = len(list(dst.parent.glob(dst.stem + "-*-of-*.gguf")))
    return [Path(p) for p in split_paths(str(dst.with_name(f"{dst.stem}-00001-of-{n:05d}.gguf")), n)]


@pytest.fixture(scope="module")
def smol_split(tmp_path_factory):
    d = tmp_path_factory.mktemp("split")
    return write_split(model_path(SMOL), d / "smol.gguf", 40 << 20)


def test_split_model_loads_as_the_whole_file(smol_split, tmp_path):
    assert len(smol_split) == 3
    whole, split = GGUFFile(model_path(SMOL)), GGUFFile(smol_split[0])
    assert split.paths == [str(p) for p in smol_split] and len(split.readers) == 3
    assert set(split.tensors) == set(whole.tensors) and len(set(split.part_of.values())) == 3
    for name, t in whole.tensors.items():  # each tensor's bytes, wherever its part put them
        assert bytes(split.tensors[name].data) == bytes(t.data), name
    args = ("-p", "The capital of France is", "-n", "16", "--temp", "0")
    plain = sharpi("-m", model_path(SMOL), *args)
    assert plain.returncode == 0
    for extra in ((), ("--no-mmap",)):
        got = sharpi("-m", smol_split[0], *extra, *args)
        assert got.returncode == 0 and got.stdout == plain.stdout, got.stderr
    # no tensor in the first part (llama-gguf-split --no-tensor-first-split), as a draft model too
    parts = write_split(model_path(SMOL), tmp_path / "d.gguf", 60 << 20, small_first=True)
    assert not GGUFFile(parts[0]).reader.tensors
    spec = sharpi("-m", smol_split[0], "-md", parts[0], *args)
    assert spec.returncode == 0 and spec.stdout == plain.stdout, spec.stderr


def test_split_model_errors(smol_split, tmp_path):
    one_error_line(sharpi("-m", smol_split[1], "-p", "hi"), 1, "part 2 of a model split in 3 parts: load it from its first")
    renamed = tmp_path / "model.gguf"
    shutil.copy(smol_split[0], renamed)
    one_error_line(sharpi("-m", renamed, "-p", "hi"), 1, "does not end in '-00001-of-00003.gguf'")
    first = tmp_path / "m-00001-of-00003.gguf"
    shutil.copy(smol_split[0], first)
    shutil.copy(smol_split[2], tmp_path / "m-00002-of-00003.gguf")  # the wrong part in part 2's place
    one_error_line(sharpi("-m", first, "-p", "hi"), 1, "not part 2 of")
    shutil.copy(smol_split[1], tmp_path / "m-00002-of-00003.gguf")
    one_error_line(sharpi("-m", first, "-p", "hi"), 1, "part 3 of the split model is missing")


def test_check_tensors_reads_every_part(tmp_path):
    """--check-tensors checked the first part's tensors only: a NaN in a later part's tensor ran (NaN logits)."""
    import numpy as np
    from sharpi_core.errors import SharpiError
    from sharpi_core.gguf_file import check_tensors
    from test_loading import write_gguf
    src = write_gguf(tmp_path / "w.gguf", n_layer=2, qtype=gguf.GGMLQuantizationType.Q8_0)
    parts = write_split(src, tmp_path / "s.gguf", 20 << 10)
    gf = GGUFFile(parts[0])
    name = next(n for n, i in gf.part_of.items() if i > 0 and gf.tensors[n].tensor_type == gguf.GGMLQuantizationType.Q8_0)
    part, t = parts[gf.part_of[name]], gf.tensors[name]
    data = bytearray(part.read_bytes())
    data[t.data_offset + 34:t.data_offset + 36] = np.array([np.nan], np.float16).tobytes()  # block 1's scale
    part.write_bytes(bytes(data))
    with pytest.raises(SharpiError, match=rf"^{part}: tensor '{name}' has invalid data \(found nan value at block 1\)"):
        check_tensors(GGUFFile(parts[0]))
