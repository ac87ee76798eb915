"""GGUF access: a memory-mapped reader with typed metadata lookups.

Everything goes through the `gguf` package's reader; tensors stay views into the mmap
(no copy of the file is made at load).
"""
from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import gguf
import numpy as np

from .errors import SharpiError, UsageError, one_line


_ARRAY, _STRING = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING


class _StringArrayParts(Sequence):
    """The `parts` of a string-array field, made on demand: [*head, len0, str0, len1, str1, ...].

    The stock reader keeps two numpy views per string; two memoryviews per string still cost
    ~35 MB for a 49k-token vocabulary (+ merges) and stay alive as long as the model's mmap. Here
    only the start offset and length of each string are stored (16 bytes a string)."""

    def __init__(self, mv: memoryview, head: list, starts: np.ndarray, lens: np.ndarray):
        self.mv, self.head, self.starts, self.lens = mv, head, starts, lens

    def __len__(self) -> int:
        return len(self.head) + 2 * len(self.starts)

    def strings(self, path: str, key: str) -> list[str]:
        """All the array's strings, decoded from one copy of the bytes they span (what
        `ReaderField.contents()` gives, without two memoryview slices and a lambda per string)."""
        if not len(self.starts):
            return []
        lo = int(self.starts[0])
        blob = bytes(self.mv[lo:int(self.starts[-1] + self.lens[-1])])
        ends = (self.starts + self.lens - lo).tolist()
        try:
            return [blob[a:b].decode() for a, b in zip((self.starts - lo).tolist(), ends)]
        except UnicodeDecodeError as e:
            raise SharpiError(f"{path}: metadata '{key}' holds a string that is not UTF-8 ({e.reason})") from None

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i < len(self.head):
            return self.head[i]
        s, is_text = divmod(i - len(self.head), 2)
        a = int(self.starts[s])
        return self.mv[a:a + int(self.lens[s])] if is_text else self.mv[a - 8:a]


class _Damaged(ValueError):
    """What Reader says of metadata it finds impossible (said as it is, without the exception's name)."""


def _said(name: str, limit: int = 64) -> str:
    """A name read from a damaged file, as an error line shows it: at most `limit` characters, then how many there
    are, those that would break the line escaped (errors.one_line)."""
    out = one_line(name[:limit])
    return out if len(name) <= limit else f"{out}... ({len(name)} characters)"


class BigEndian(_Damaged):
    """A GGUF file of the other byte order (llama.cpp refuses them too: its tensors are read as they lie)."""


# what one file may hold (llama.cpp sets no bound; real models have under 100 keys and a few thousand tensors, the
# largest with their experts unmerged tens of thousands)
MAX_KV, MAX_TENSORS = 1 << 16, 1 << 17
_U64 = struct.Struct("<Q")
_VALUE_TYPES = frozenset(int(t) for t in gguf.GGUFValueType)
_TENSOR_TYPES = frozenset(int(t) for t in gguf.GGMLQuantizationType if t in gguf.GGML_QUANT_SIZES)
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64  # a tensor's name is shorter (llama.cpp's gguf_init refuses the file otherwise)
_CHUNK = 1 << 16  # strings whose offsets are gathered in Python lists at once


class Reader(gguf.GGUFReader):
    """gguf's reader, with large metadata arrays parsed in bulk.

    The stock reader makes two numpy views per array element; for a 150k-262k token vocabulary
    that is 5-18 s per file open and tens of MB that live as long as the mmap. Here an array of
    scalars is one view, and an array of strings is a table of offsets whose parts are memoryview
    slices made when asked for (same `.tobytes()`/`.nbytes` interface), so `ReaderField.contents()`
    still works."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        """The stock _get, from a plain-ndarray view of the mapping: a slice of np.memmap is a memmap again, whose
        __array_finalize__ made a table of 500k tiny tensors cost 35 s and 2.5 GB (views of this one still keep
        the mapping alive, and quants.is_mmapped finds the memmap among their bases)."""
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        dt = np.dtype(dtype)
        raw = plain[offset:offset + dt.itemsize * count]
        arr = raw[:len(raw) - len(raw) % dt.itemsize].view(dt)[:count]  # (the mapping's end may cut a value: short)
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I":  # (before its metadata: the stock reader walks a big-endian array element by element)
            raise BigEndian("a big-endian GGUF file; sharpi reads little-endian ones only (as this CPU)")
        if count > MAX_KV:  # (each costs Python objects: a damaged count, or a crafted file, would take gigabytes)
            raise _Damaged(f"{count} metadata keys, more than any model has ({MAX_KV} at most)")
        end = len(self.data)
        for i in range(count):
            orig_offs = offs
            # (said in the file's terms: the stock reader's short reads surface later as index or overflow errors)
            where = f"metadata key {i + 1} of {count} at offset {orig_offs}"
            if offs + 12 > end:
                raise _Damaged(f"{where} lies past the end of the file")
            key, _ = self._name(offs, where, room=4)  # (then its 4-byte value type)
            klen, kdata = self._get_str(offs)
            offs += int(klen.nbytes + kdata.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            if int(raw_type[0]) not in _VALUE_TYPES:
                raise _Damaged(f"metadata key '{_said(key)}' has an unknown value type {int(raw_type[0])}")
            head = [klen, kdata, raw_type]
            try:
                size, parts, idxs, types = self._get_field_parts(offs, raw_type[0])
            except _Damaged as e:
                raise _Damaged(f"metadata key '{_said(key)}': {e}") from None
            except (IndexError, OverflowError, ValueError) as e:
                raise _Damaged(f"metadata key '{_said(key)}' at offset {orig_offs}: its value is damaged "
                               f"({type(e).__name__}: {e})") from None
            if isinstance(parts, _StringArrayParts):
                parts.head = head + parts.head
                data = range(len(parts.head) + 1, len(parts), 2)
            else:
                data = [i + len(head) for i in idxs]
                parts = head + parts
            self._push_field(gguf.ReaderField(orig_offs, key, parts, data, types), skip_sum=True)
            offs += size
        return offs

    def _name(self, offs: int, where: str, room: int = 0) -> tuple[str, int]:
        """The name (a key's, a tensor's) at offs, an 8-byte length and its UTF-8 bytes with `room` bytes of the entry
        after them, and that length; or _Damaged saying why not (`where`: the entry)."""
        end = len(self.data)
        n = int(self._get(offs, np.uint64)[0]) if offs + 8 <= end else end
        if n > end - offs - 8 - room:
            raise _Damaged(f"{where}: its name of {n} bytes runs past the end of the file")
        try:
            return str(bytes(self._get(offs + 8, np.uint8, n)), encoding="utf-8"), n
        except UnicodeDecodeError as e:
            raise _Damaged(f"{where}: its name is not UTF-8 ({e.reason})") from None

    def _build_tensor_info(self, offs: int, count: int):
        if count > MAX_TENSORS:
            raise _Damaged(f"{count} tensors, more than any model has ({MAX_TENSORS} at most)")
        fields, end = [], len(self.data)
        for i in range(count):
            # what llama.cpp's gguf_init checks of each entry, said before the stock reader meets it as an index error
            where = f"tensor {i + 1} of {count} at offset {offs}"
            name, n_name = self._name(offs, where)
            shown = _said(name)
            if n_name >= GGML_MAX_NAME:
                raise _Damaged(f"{where}: its name '{shown}' is {n_name} bytes long (at most {GGML_MAX_NAME - 1}, "
                               "as llama.cpp takes it)")
            at = offs + 8 + n_name
            n_dims = int(self._get(at, np.uint32)[0]) if at + 4 <= end else -1
            if n_dims < 0 or at + 4 + 8 * n_dims + 12 > end:
                raise _Damaged(f"tensor '{shown}' (at offset {offs}): its entry runs past the end of the file")
            if n_dims > GGML_MAX_DIMS:
                raise _Damaged(f"tensor '{shown}' has {n_dims} dimensions (at most {GGML_MAX_DIMS})")
            dims = [int(d) for d in self._get(at + 4, np.uint64, n_dims)]
            ttype = int(self._get(at + 4 + 8 * n_dims, np.uint32)[0])
            if ttype not in _TENSOR_TYPES:
                raise _Damaged(f"tensor '{shown}' has an unknown type {ttype}")
            if any(d >= 1 << 63 for d in dims) or math.prod(dims) >= 1 << 63:
                raise _Damaged(f"tensor '{shown}' has too many elements ({' x '.join(map(str, dims))})")
            qtype = gguf.GGMLQuantizationType(ttype)
            block = gguf.GGML_QUANT_SIZES[qtype][0]
            if dims and dims[0] % block:
                raise _Damaged(f"tensor '{shown}' of type {qtype.name} has rows of {dims[0]} values, not a multiple of "
                               f"its block size {block}")
            field = self._get_tensor_info_field(offs)
            offs += sum(int(part.nbytes) for part in field.parts)
            fields.append(field)
        return offs, fields

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type != _ARRAY or self.byte_order != "I":
            if raw_type == _STRING and orig_offs + 8 <= len(self.data):
                n = int(self._get(orig_offs, np.uint64)[0])
                if n > len(self.data) - orig_offs - 8:
                    raise _Damaged(f"a string of {n} bytes at offset {orig_offs} runs past the end of the file")
            size, parts, idxs, types = super()._get_field_parts(orig_offs, raw_type)
            if raw_type != _ARRAY and len(parts[0]) != 1:  # (a value past the end of the mapping comes back empty)
                raise _Damaged(f"its value at offset {orig_offs} runs past the end of the file")
            return size, parts, idxs, types
        offs = orig_offs
        if offs + 12 > len(self.data):
            raise _Damaged(f"an array at offset {orig_offs} runs past the end of the file")
        raw_itype = self._get(offs, np.uint32)
        alen = self._get(offs + 4, np.uint64)
        offs += 12
        if int(raw_itype[0]) not in _VALUE_TYPES:
            raise _Damaged(f"an array of unknown element type {int(raw_itype[0])} at offset {orig_offs}")
        itype, n = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0])
        if itype == _STRING:
            buf = getattr(self, "_mv", None)
            if buf is None:
                buf = self._mv = memoryview(self.data)
            if n > (len(buf) - offs) // 8:  # (each string has its 8-byte length: nothing to allocate for a bad count)
                raise _Damaged(f"an array of {n} strings at offset {orig_offs} is longer than the file")
            starts = np.empty(n, dtype=np.int64)
            lens = np.empty(n, dtype=np.int64)
            # (a vocabulary and its merges are ~300k strings: lengths read by struct into Python lists, a chunk at a
            # time, ~3x faster than numpy item stores of int.from_bytes slices)
            length, size = _U64.unpack_from, len(buf)
            for c0 in range(0, n, _CHUNK):
                m = min(_CHUNK, n - c0)
                st, ls = [0] * m, [0] * m
                try:
                    for i in range(m):
                        (ln,) = length(buf, offs)
                        offs += 8
                        st[i], ls[i] = offs, ln
                        offs += ln
                except (struct.error, OverflowError):  # a length field past the end (a damaged count, or a length before it)
                    offs = size + 1
                if offs > size:  # (a damaged count or length: stop where the file does)
                    raise _Damaged(f"an array of {n} strings at offset {orig_offs} runs past the end of the file")
                starts[c0:c0 + m], lens[c0:c0 + m] = st, ls
            return offs - orig_offs, _StringArrayParts(buf, [raw_itype, alen], starts, lens), None, [_ARRAY, _STRING]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:
            return super()._get_field_parts(orig_offs, raw_type)
        arr = self._get(offs, nptype, n)
        if arr.shape[0] != n:  # (the mapping ends first: a damaged count)
            raise _Damaged(f"an array of {n} values at offset {orig_offs} runs past the end of the file")
        return 12 + int(arr.nbytes), [raw_itype, alen, arr], [2], [_ARRAY, itype]


_OVERRIDE_TYPES = {"int": int, "float": float, "bool": bool, "str": str}
_INT_TYPES = frozenset({gguf.GGUFValueType.UINT8, gguf.GGUFValueType.INT8, gguf.GGUFValueType.UINT16,
                        gguf.GGUFValueType.INT16, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32,
                        gguf.GGUFValueType.UINT64, gguf.GGUFValueType.INT64})
_FILE_TYPE_NAME = {**{t: "int" for t in _INT_TYPES}, gguf.GGUFValueType.FLOAT32: "float",
                   gguf.GGUFValueType.FLOAT64: "float", gguf.GGUFValueType.BOOL: "bool", _STRING: "str"}


def parse_kv_overrides(items: Sequence[str]) -> dict[str, Any]:
    """llama.cpp's --override-kv KEY=TYPE:VALUE[,...] (TYPE int, float, bool (true / false), str; a str is at
    most 127 characters) -> {key: Python value}; the first override of a key wins, as llama.cpp's model loader keeps
    it (its map's insert leaves a key's first entry)."""
    out: dict[str, Any] = {}
    for item in (part for arg in items for part in arg.split(",")):
        key, eq, rest = item.partition("=")
        kind, colon, text = rest.partition(":")
        if not eq or not key or len(key) >= 128 or not colon or kind not in _OVERRIDE_TYPES:
            raise UsageError(f"malformed --override-kv '{item}': expected KEY=TYPE:VALUE with TYPE int, float, bool or str")
        try:
            if kind == "bool":
                if text not in ("true", "false"):
                    raise ValueError
                value: Any = text == "true"
            elif kind == "str":
                if len(text) > 127:
                    raise ValueError
                value = text
            elif kind == "float":  # (llama.cpp's loader puts it in a float field: 1e39 is inf there, 1e-46 is 0)
                with np.errstate(over="ignore"):
                    value = float(np.float32(float(text)))
            else:
                value = int(text)
        except ValueError:
            raise UsageError(f"invalid --override-kv '{item}': '{text}' is not a {kind} value"
                             + (" (at most 127 characters)" if kind == "str" else "")) from None
        out.setdefault(key, value)
    return out


MAGIC = b"GGUF"


def is_gguf(path) -> bool:
    """path is a regular file that starts as a GGUF does (not a FIFO: opening one to read it waits for a writer)."""
    try:
        if not os.path.isfile(path):
            return False
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def _open(path: str) -> Reader:
    if not os.path.isfile(path):
        raise SharpiError(f"model file not found: {path}")
    try:
        with open(path, "rb") as f:
            magic, version = f.read(4), f.read(4)
    except OSError as e:
        raise SharpiError(f"cannot read model file {path}: {e.strerror}") from None
    if magic != MAGIC:
        raise SharpiError(f"{path}: not a valid GGUF file (it does not start with the 'GGUF' magic bytes)")
    v = int.from_bytes(version, "little") if len(version) == 4 else 0
    if v & 0xFFFF and v not in gguf.gguf_reader.READER_SUPPORTED_VERSIONS:  # (a big-endian file's low half is 0)
        raise SharpiError(f"{path}: a GGUF file of version {v}, which sharpi cannot read (it reads versions 2 and 3"
                          + (", as llama.cpp does: version 1 files need converting again)" if v == 1 else ")"))
    try:
        with np.errstate(over="ignore"):  # (a damaged offset near 2**64 wraps in the stock reader's sum, said below)
            reader = Reader(path, "r")
    except Exception as e:  # the gguf package raises ValueError/struct errors/etc.
        # (reads past the end of the mapping come back short: an index or a view of them fails)
        if isinstance(e, BigEndian):
            raise SharpiError(f"{path}: {e}") from None
        if isinstance(e, _Damaged):
            raise SharpiError(f"{path}: not a valid GGUF file ({e})") from None
        import traceback
        in_data = any(fr.name == "_build_tensors" for fr in traceback.extract_tb(e.__traceback__))
        if "cannot reshape array" in str(e) or in_data and "a divisor of the total size" in str(e):
            why = f"its tensor data runs past the end of the file, {os.path.getsize(path)} bytes: cut short? "
        elif isinstance(e, IndexError) or "a divisor of the total size" in str(e):
            why = "its metadata ends early or is damaged: "
        else:
            why = ""
        raise SharpiError(f"{path}: not a valid GGUF file ({why}{type(e).__name__}: {e})") from None
    # the tensors' data lie one after the other, each padded to the alignment, as llama.cpp's gguf_init requires:
    # an offset elsewhere (misaligned, overlapping) is a damaged tensor table, not data to compute with
    # (offsets from the data's start, as the file has them: the reader's absolute data_offset may have wrapped)
    expected, align = 0, int(reader.alignment)  # (a numpy integer when read from the file)
    for t in reader.tensors:
        offset = int(t.field.parts[-1][0])
        if offset != expected:
            raise SharpiError(f"{path}: not a valid GGUF file (tensor '{t.name}' has offset {offset}, expected {expected})")
        expected += -(-int(t.n_bytes) // align) * align
    return reader


def _int_field(reader: Reader, key: str) -> int | None:
    f = reader.fields.get(key)
    if f is None or not f.types or f.types[0] not in _INT_TYPES:
        return None
    return int(f.contents())


def split_paths(path: str, n_split: int) -> list[str]:
    """The parts of a model split by llama-gguf-split, from its first part's path `<prefix>-00001-of-0000N.gguf`
    (llama.cpp's llama_split_prefix / llama_split_path)."""
    first = f"-{1:05d}-of-{n_split:05d}.gguf"
    if len(path) <= len(first) or not path.endswith(first):
        raise SharpiError(f"{path}: a model split in {n_split} parts, but its name does not end in '{first}' "
                          "(llama.cpp finds the other parts by that name)")
    prefix = path[:-len(first)]
    return [f"{prefix}-{i + 1:05d}-of-{n_split:05d}.gguf" for i in range(n_split)]  # (n_split <= 65535: GGUFFile)


def get_typed(gf, key: str, kind: type, default: Any = None) -> Any:
    """gf.get(key), refusing a value of another type than `kind` (str or bool) as llama.cpp's typed reads refuse it
    (a damaged or hand-made file: an int chat template, a list of pre-tokenizers, a string for a flag)."""
    v = gf.get(key)
    return default if v is None else _of_kind(gf.path, key, v, kind)


def _of_kind(path: str, key: str, v: Any, kind: type) -> Any:
    """v, if it is a `kind` (str, bool, int or float; a bool is not an int); else one error line. llama.cpp's typed
    reads refuse a value of another type: a float's bits read as an integer (or the reverse) would be a wrong
    number, not a converted one."""
    if isinstance(v, kind) if kind is bool else isinstance(v, kind) and not isinstance(v, bool):
        return v
    shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
    raise SharpiError(f"{path}: metadata '{key}' holds {shown}, not a{'n' if kind is int else ''} {kind.__name__} "
                      "(a damaged file?)")


def kv_text(gf, key: str) -> str | None:
    """A metadata value as llama.cpp's model keeps it for its string lookups (llama_model_meta_val_str, the chat
    template): the text gguf_kv_to_str writes (a number as std::to_string writes it, a float with "%f"'s six
    decimals; a bool as true / false), None for an array (left out of that table) or a missing key."""
    v = gf.get(key)
    if v is None or isinstance(v, (list, tuple, np.ndarray)):
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "%f" % v
    return v if isinstance(v, str) else str(v)


class GGUFFile:
    def __init__(self, path: str | os.PathLike, overrides: dict[str, Any] | None = None, mmap: bool = True):
        """overrides: metadata values that replace (or add) the file's, as parse_kv_overrides gives them;
        an override of a key the file has must have its type (llama.cpp's rule). mmap=False (--no-mmap): the
        file is read into memory and the tensors are views of that copy, not of the file's mapping.

        A model split by llama-gguf-split loads from its first part (the metadata and some tensors; `split.count`
        > 1): the other parts are found by name, as llama.cpp's loader finds them, and their tensors join the
        first's (`readers`: one reader a part; `part_of`: a tensor's part)."""
        self.path = os.fspath(path)
        self.reader = _open(self.path)
        self.readers, self.paths = [self.reader], [self.path]
        n_split = _int_field(self.reader, "split.count") or 0
        if n_split > 0xFFFF:  # (llama.cpp's split.count is a u16)
            raise SharpiError(f"{self.path}: split.count {n_split} is damaged (at most 65535 parts)")
        if n_split > 1:
            idx = _int_field(self.reader, "split.no") or 0
            if idx != 0:
                raise SharpiError(f"{self.path}: part {idx + 1} of a model split in {n_split} parts: load it from "
                                  "its first part (-00001-of-...)")
            for i, p in enumerate(split_paths(self.path, n_split)[1:], 1):
                if not os.path.isfile(p):
                    raise SharpiError(f"{self.path}: part {i + 1} of the split model is missing: {p}")
                r = _open(p)
                if _int_field(r, "split.no") != i:
                    raise SharpiError(f"{p}: not part {i + 1} of {self.path}'s split (split.no "
                                      f"{_int_field(r, 'split.no')})")
                self.readers.append(r)
                self.paths.append(p)
        if not mmap:
            for r in self.readers:
                self._read_into_memory(r)
        self.tensors, self.part_of = {}, {}
        for i, r in enumerate(self.readers):
            for t in r.tensors:
                if t.name in self.tensors:
                    raise SharpiError(f"{self.paths[i]}: tensor '{t.name}' is duplicated")
                self.tensors[t.name], self.part_of[t.name] = t, i
        expected = _int_field(self.reader, "split.tensors.count") if n_split > 1 else None
        if expected is not None and expected != len(self.tensors):
            raise SharpiError(f"{self.path}: corrupted split model: {expected} tensors expected, {len(self.tensors)} found")
        self.overrides = dict(overrides or {})
        for key, value in self.overrides.items():
            f = self.reader.fields.get(key)
            if f is None:
                continue
            have = _FILE_TYPE_NAME.get(f.types[0]) if f.types else None
            want = next(n for n, t in _OVERRIDE_TYPES.items() if type(value) is t)
            if have != want:
                raise UsageError(f"--override-kv {key}: {self.path} has it as "
                                 f"{'an array' if f.types and f.types[0] == _ARRAY else have or 'another type'}, not {want}")

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value as a Python object (str, int, float, bool, list); --override-kv's if given."""
        self.last_key = key  # (for a reader's error about a value of the wrong type: models/config.py)
        if key in self.overrides:
            return self.overrides[key]
        f = self.reader.fields.get(key)
        if f is None:
            return default
        if isinstance(f.parts, _StringArrayParts):
            return f.parts.strings(self.path, key)
        try:
            v = f.contents()
        except UnicodeDecodeError as e:
            raise SharpiError(f"{self.path}: metadata '{key}' holds a string that is not UTF-8 ({e.reason})") from None
        if isinstance(v, np.generic):
            v = v.item()
        return v

    def require(self, key: str, like: Any = None) -> Any:
        """The key's value; one error line where it is missing, or (`like` given: a str, bool, int or float) not
        of like's type. An array passes: its reader checks it."""
        v = self.get(key)
        if v is None:
            raise SharpiError(f"{self.path}: missing GGUF metadata key '{key}'")
        return self._like(key, v, like)

    @cached_property
    def arch(self) -> str:
        return str(self.require("general.architecture", ""))

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """`<arch>.<suffix>`, e.g. arch_get('block_count'); a value of another type than a str, bool, int or float
        default is one error line (an array passes: its reader checks it)."""
        key = f"{self.arch}.{suffix}"
        v = self.get(key)
        return default if v is None else self._like(key, v, default)

    def _like(self, key: str, v: Any, like: Any) -> Any:
        if like is None or isinstance(v, (list, tuple, np.ndarray)):
            return v
        kind = next((t for t in (bool, str, int, float) if isinstance(like, t)), None)
        return v if kind is None else _of_kind(self.path, key, v, kind)

    def field_array(self, key: str, n: int | None = None) -> np.ndarray | None:
        """A numeric array field (token scores/types) as one numpy array, without a Python list; None if absent.
        Anything else (a scalar, strings, fewer than n elements) is a damaged file: one error line."""
        f = self.reader.fields.get(key)
        if f is None:
            return None
        numeric = len(f.types) == 2 and f.types[0] == _ARRAY and f.types[1] in _FILE_TYPE_NAME and f.types[1] != _STRING
        out = np.concatenate([f.parts[i] for i in f.data]) if numeric and f.data else np.zeros(0)
        if not numeric or (n is not None and len(out) < n):
            raise SharpiError(f"{self.path}: {key} is not an array of {n if n is not None else 'some'} numbers "
                              f"({'an array of ' + str(len(out)) if numeric else 'another type'})")
        return out

    def array_len(self, key: str) -> int:
        """Element count of an array field (0 if absent), without reading the elements."""
        f = self.reader.fields.get(key)
        # parts: key length, key, value type, element type, element count, ...
        return int(f.parts[4][0]) if f is not None and f.types and f.types[0] == _ARRAY else 0

    @staticmethod
    def _read_into_memory(reader: Reader) -> None:
        """The whole file in memory (the metadata's small views stay on the mapping); every tensor and the
        reader's data (transformer.py takes fused weights from it) point into the copy."""
        mapped = reader.data
        try:
            copy = np.fromfile(mapped.filename, dtype=np.uint8)
        except OSError as e:
            raise SharpiError(f"cannot read model file {mapped.filename}: {e.strerror}") from None
        base = mapped.ctypes.data
        tensors = []
        for t in reader.tensors:
            off = t.data.ctypes.data - base
            tensors.append(t._replace(data=copy[off:off + t.data.nbytes].view(t.data.dtype).reshape(t.data.shape)))
        reader.tensors, reader.data = tensors, copy

    def data_of(self, name: str) -> np.ndarray:
        """The bytes of the file (part) tensor `name` lies in: its data_offset counts from their start."""
        return self.readers[self.part_of[name]].data

    def tensor(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise SharpiError(f"{self.path}: tensor '{name}' missing (arch {self.arch})")
        return t


# ---- --check-tensors: llama.cpp's ggml_validate_row_data --------------------------------------------
# What it checks of each type's blocks: float tensors' values, and quantized blocks' scales: the byte
# offsets of their f16 scales (d, and the min / dmin where the type has one) in a block.
_Q = gguf.GGMLQuantizationType
_F16_SCALES = {
    _Q.Q4_0: (0,), _Q.Q4_1: (0, 2), _Q.Q5_0: (0,), _Q.Q5_1: (0, 2), _Q.Q8_0: (0,), _Q.Q2_K: (80, 82),
    _Q.Q3_K: (108,), _Q.Q4_K: (0, 2), _Q.Q5_K: (0, 2), _Q.Q6_K: (208,), _Q.TQ1_0: (52,), _Q.TQ2_0: (64,),
    _Q.IQ1_S: (0,), _Q.IQ2_XXS: (0,), _Q.IQ2_XS: (0,), _Q.IQ2_S: (0,), _Q.IQ3_XXS: (0,), _Q.IQ3_S: (0,),
    _Q.IQ4_NL: (0,), _Q.IQ4_XS: (0,),
}
# (unsigned view, exponent mask, mantissa mask) of the float types: all exponent bits set = inf or nan
_FLOAT_BITS = {_Q.F32: (np.uint32, 0x7F800000, 0x007FFFFF), _Q.F16: (np.uint16, 0x7C00, 0x03FF),
               _Q.BF16: (np.uint16, 0x7F80, 0x007F), _Q.F64: (np.uint64, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF)}


def _first_nonfinite(bits: np.ndarray, exp: int, mant: int) -> tuple[int, str] | None:
    """(index, 'inf value' / 'nan value') of the first inf or nan among IEEE values given as their bits."""
    special = (bits & exp) == exp
    if not special.any():
        return None
    i = int(np.argmax(special))
    return i, "nan value" if int(bits[i]) & mant else "inf value"


def tensor_data_error(name: str, qtype, data: np.ndarray) -> str | None:
    """Why llama.cpp's --check-tensors refuses this tensor's data (its first inf or nan value or scale, or
    an MXFP4 scale of 0xFF, by block), or None."""
    qtype = _Q(qtype)
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if qtype in _FLOAT_BITS:
        dt, exp, mant = _FLOAT_BITS[qtype]
        found = [_first_nonfinite(raw.view(dt), exp, mant)]
    elif qtype in _F16_SCALES or qtype in (_Q.MXFP4, _Q.IQ1_M, _Q.Q8_K):
        ts = gguf.GGML_QUANT_SIZES[qtype][1]
        if qtype == _Q.MXFP4:  # e8m0 exponent: 0xFF is no value
            e = raw.reshape(-1, ts)[:, 0] == 0xFF
            found = [(int(np.argmax(e)), "invalid e value 255") if e.any() else None]
        elif qtype == _Q.Q8_K:  # float d
            found = [_first_nonfinite(raw.view(np.uint32).reshape(-1, ts // 4)[:, 0], 0x7F800000, 0x007FFFFF)]
        elif qtype == _Q.IQ1_M:  # the f16 scale spread over the top nibbles of its 4 scale words
            sc = raw.view(np.uint16).reshape(-1, ts // 2)[:, 24:28]
            f = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
            found = [_first_nonfinite(f, 0x7C00, 0x03FF)]
        else:  # (every scale offset is even, every block size too: one 16-bit column each)
            words = raw.view(np.uint16).reshape(-1, ts // 2)
            found = [_first_nonfinite(words[:, o // 2], 0x7C00, 0x03FF) for o in _F16_SCALES[qtype]]
    else:
        return None  # integer tensors: nothing to check (and types sharpi does not load)
    found = [f for f in found if f is not None]
    if not found:
        return None
    block, what = min(found)
    return f"tensor '{name}' has invalid data (found {what} at block {block})"


def check_tensors(gf: GGUFFile) -> None:
    """--check-tensors: every tensor's data as llama.cpp's loader validates it; raises SharpiError at the
    first tensor it refuses."""
    for t in gf.tensors.values():  # (every part of a split model)
        why = tensor_data_error(t.name, t.tensor_type, t.data)
        if why:
            raise SharpiError(f"{gf.paths[gf.part_of[t.name]]}: {why}")
