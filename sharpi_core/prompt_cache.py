"""Prompt cache files (`--prompt-cache FILE`, llama.cpp's flag): the K/V of a prompt's tokens, saved by one
run and restored by the next whose prompt starts with the same tokens, which then evaluates only the rest.

A file holds one entry per model ("target"; "draft" for a draft model): the token ids whose K/V it carries,
the model's fingerprint, the cache types and rotations, and the cache's arrays at those positions (f32 /
f16 values, or q8_0 codes and scales), written by torch.save and read back with weights_only=True (no code
runs on load). Restoring copies the arrays in and sets the cache's length: the positions read exactly as the
earlier run wrote them. The generator evaluates the prompt's last token again in any case (its logits give
the first new token), as llama.cpp does with a session file. So a run with the file computes what a run
without it computes when its prompt batches break where the restored positions end (`-b` at that length):
the rest of the prompt is evaluated as a batch of its own, and batched rows take llama.cpp's prompt-pass
arithmetic, which depends on a batch's row count, so at a near-tie the output can differ from an unbroken
prompt pass (llama.cpp's session files behave the same).

Entries carry a sha256 of their tokens and arrays (torch does not check its archive's CRCs): a damaged file
is refused like one made for something else.

The fingerprint is the model file's size and a sha256 of its first MiB (the GGUF header: metadata and tensor
table) and of 16 pieces of 64 KiB spread over the rest (weights): cheap on a GB file, and another model,
quantization or fine-tune differs there. A file made for another model or other cache settings is refused
with one line, never overwritten: it may hold what the user wants to keep.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import torch

from .errors import SharpiError, UsageError
from .files import plain_target, replaced
from .gguf_file import split_paths
from .speculative.util import common_prefix

MAGIC = "sharpi prompt cache"
VERSION = 1
_HEAD = 1 << 20
_PIECE = 1 << 16
_PIECES = 16


def fingerprint(path: str | os.PathLike) -> str:
    """The model's identity: its size, first MiB and 16 pieces spread over the rest (and those of the other
    parts of a split model after the first's)."""
    h = hashlib.sha256()
    paths = [os.fspath(path)]
    m = re.search(r"-00001-of-(\d{5})\.gguf$", paths[0])
    if m and int(m.group(1)) > 1:
        paths = split_paths(paths[0], int(m.group(1)))
    for p in paths:
        size = os.path.getsize(p)
        h.update(str(size).encode())
        with open(p, "rb") as f:
            h.update(f.read(_HEAD))
            if size > _HEAD:
                step = (size - _HEAD) // _PIECES
                for i in range(_PIECES):
                    f.seek(_HEAD + i * step)
                    h.update(f.read(_PIECE))
    return h.hexdigest()


def check_path(path: str | os.PathLike, read_only: bool) -> None:
    """Refuse, before any model loads, a path the run could not read or (unless read_only) write."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"--prompt-cache {p}: is a directory")
    if read_only:
        return
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"--prompt-cache {p}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"--prompt-cache {p}: not writable")


def _digest(tokens: list[int], arrays: dict[str, torch.Tensor]) -> str:
    """sha256 of an entry's tokens and arrays: torch does not check its archive's CRCs on load."""
    h = hashlib.sha256(repr(list(tokens)).encode())
    for k in sorted(arrays):
        h.update(k.encode())
        h.update(arrays[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _entry_ok(e, n_vocab: int | None) -> bool:
    return (isinstance(e, dict) and isinstance(e.get("tokens"), list)
            and all(type(t) is int and 0 <= t < (n_vocab or 1 << 31) for t in e["tokens"])
            and isinstance(e.get("arrays"), dict) and all(isinstance(a, torch.Tensor) for a in e["arrays"].values())
            and isinstance(e.get("digest"), str))


class PromptCacheFile:
    def __init__(self, path: str | os.PathLike, settings: str = "", n_vocab: int | None = None):
        """settings: what else decides the cached K and V besides the model file and the cache types (the
        CLI's --rope-* and --override-kv, as text; "" without them): an entry made under others is refused.
        n_vocab: the target's vocabulary; an entry with a token id outside it is damaged (it would be embedded
        or shown)."""
        self.path = Path(path)
        self.settings = settings
        self.n_vocab = n_vocab
        # written through a symbolic link, as llama.cpp writes its session files (files.replaced)
        self._target, plain = plain_target(self.path)
        if not plain and not self._target.is_char_device():  # (a FIFO would hold the run until someone wrote)
            what = "is a directory" if self._target.is_dir() else "not a file a cache can be kept in (a FIFO, a socket)"
            raise SharpiError(f"--prompt-cache {self.path}: {what}")
        self._fingerprints: dict[str, str] = {}  # model path -> fingerprint: restore() and save() read it once
        self.entries: dict[str, dict] = self._read() if self.path.exists() else {}

    def _read(self) -> dict[str, dict]:
        try:
            with open(self.path, "rb") as f:
                head = f.read(1 << 16)
                if not head:  # (e.g. made by mktemp) llama.cpp starts a new session in it too
                    return {}
        except OSError as e:
            raise SharpiError(f"--prompt-cache {self.path}: cannot read it ({e.strerror or e})") from None
        try:
            d = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception:  # torch raises several kinds for a file that is not its zip archive
            d = None
        if not (isinstance(d, dict) and d.get("magic") == MAGIC and isinstance(d.get("entries"), dict)):
            # (torch's archive begins with its pickle, which names the magic: one of ours that torch cannot read
            # was cut short or damaged)
            ours = d is None and head.startswith(b"PK\x03\x04") and MAGIC.encode() in head
            raise SharpiError(f"--prompt-cache {self.path}: " + ("damaged (cut short? its archive cannot be read; left "
                              "as it is, delete it to start over)" if ours else "not a sharpi prompt cache file (left "
                              "as it is)"))
        if d.get("version") != VERSION:
            raise SharpiError(f"--prompt-cache {self.path}: written by another version of sharpi (format "
                              f"{d.get('version')}, this one reads {VERSION}); delete it to start over")
        entries = d["entries"]
        for name, e in entries.items():
            try:  # (arrays torch cannot view as bytes, zero-dimensional or sparse ones: no file of ours has them)
                ok = _entry_ok(e, self.n_vocab) and _digest(e["tokens"], e["arrays"]) == e["digest"]
            except (RuntimeError, ValueError, TypeError):
                ok = False
            if not ok:
                raise SharpiError(f"--prompt-cache {self.path}: damaged (its {name} entry does not check out; "
                                  "left as it is, delete it to start over)")
        return entries

    def restore(self, name: str, cache, history: list[int], model_path, prompt: list[int],
                optional: bool = False) -> int | None:
        """Put into `cache` (and `history`, the tokens it holds) the saved positions that `prompt` starts
        with; -> how many. A cache must be empty, as after loading. An `optional` entry that does not fit this
        run is set aside (written anew at the next save) instead of refused: -> None."""
        e = self.entries.get(name)
        if e is None:
            return 0
        try:
            self._check(name, e, cache, model_path)
        except SharpiError:
            if not optional:
                raise
            del self.entries[name]
            return None
        n = min(common_prefix(e["tokens"], prompt), cache.capacity)
        if n:
            cache.put_arrays({k: a[:, :n] for k, a in e["arrays"].items()}, n)
            history[:] = list(e["tokens"][:n])
        return n

    def _fingerprint(self, model_path) -> str:
        key = str(model_path)
        if key not in self._fingerprints:
            self._fingerprints[key] = fingerprint(model_path)
        return self._fingerprints[key]

    def _check(self, name: str, e: dict, cache, model_path) -> None:
        what = f"--prompt-cache {self.path}"
        if e.get("model") != self._fingerprint(model_path):
            raise SharpiError(f"{what}: made with another {name} model than {model_path} (left as it is; "
                              "delete it or name another file)")
        if e.get("settings", "") != self.settings:
            raise SharpiError(f"{what}: made with other model settings ({e.get('settings') or 'none'}) than this run's "
                              f"({self.settings or 'none'}) (left as it is; delete it or name another file)")
        if e.get("rope_factors") != getattr(cache, "rope_factors", None):  # (phi3's long / short, by the context size)
            raise SharpiError(f"{what}: the {name}'s K there was turned with the model's {e.get('rope_factors')} RoPE "
                              f"factors, which a context of {cache.capacity} tokens does not take (left as it is; "
                              "delete it, name another file or use the context size it was made with)")
        mine = (cache.type_k, cache.type_v, cache.rot_k, cache.rot_v)
        theirs = (e.get("type_k"), e.get("type_v"), e.get("rot_k"), e.get("rot_v"))
        if mine != theirs:
            raise SharpiError(f"{what}: the {name}'s KV cache there is K {theirs[0]} V {theirs[1]} (rotations "
                              f"{theirs[2]}, {theirs[3]}), this run's K {mine[0]} V {mine[1]} ({mine[2]}, {mine[3]}) "
                              "(left as it is; delete it or name another file)")
        want = cache.arrays(0)
        arrays = e["arrays"]
        if not (set(arrays) == set(want) and all(
                arrays[k].dtype == a.dtype and arrays[k].dim() == a.dim()
                and arrays[k].shape[0] == a.shape[0] and arrays[k].shape[2:] == a.shape[2:]
                and arrays[k].shape[1] == len(e["tokens"]) for k, a in want.items())):
            raise SharpiError(f"{what}: the {name}'s saved cache does not fit this model's (left as it is)")

    def save(self, models: dict[str, tuple], tokens: list[int]) -> bool:
        """Record, per name, the positions of `tokens` that (cache, history, model_path) holds; entries of
        other names stay. Written to a temporary file renamed over the old one (a failed write leaves the
        old file). -> False when the file already held exactly that (nothing written)."""
        entries, changed = dict(self.entries), False
        for name, (cache, history, model_path) in models.items():
            n = min(common_prefix(history, tokens), cache.length)
            old = self.entries.get(name)
            # (a shorter prompt than the saved one leaves it: llama.cpp saves a session only when the prompt
            # goes past what it matched)
            if not n or (old is not None and old["tokens"][:n] == list(tokens[:n])):
                continue
            arrays = {k: a.clone() for k, a in cache.arrays(n).items()}
            entries[name] = {"tokens": list(tokens[:n]), "model": self._fingerprint(model_path), "settings": self.settings,
                             "type_k": cache.type_k, "type_v": cache.type_v, "rot_k": cache.rot_k, "rot_v": cache.rot_v,
                             "rope_factors": getattr(cache, "rope_factors", None), "arrays": arrays,
                             "digest": _digest(tokens[:n], arrays)}
            changed = True
        if not changed:
            return False
        try:
            with replaced(self.path) as f:  # (opened by us: torch's own open loses why it failed)
                try:
                    torch.save({"magic": MAGIC, "version": VERSION, "entries": entries}, f)
                except Exception as e:  # torch's RuntimeError on a full disk ("[enforce fail at ...] unexpected pos")
                    if getattr(e, "strerror", None):
                        raise
                    try:  # (measured while the partial file is still there)
                        full = shutil.disk_usage(self._target.parent).free < (1 << 20)
                    except OSError:
                        full = False
                    raise OSError(0, "no space left on the device" if full else
                                  (str(e).splitlines() or [type(e).__name__])[0]) from None
        except OSError as e:
            raise SharpiError(f"--prompt-cache {self.path}: cannot write it ({e.strerror or e})") from None
        self.entries = entries
        return True
