"""Models from the Hugging Face hub: `-hf <user>/<model>[:quant]`, found, fetched and cached as llama.cpp's
downloader (common/download.cpp, common/hf-cache.cpp) does it, in the hub's own cache layout, so that llama.cpp,
huggingface_hub and sharpi share their downloads.

- The repository's files: `GET {endpoint}api/models/<repo>/refs` (the `main` branch's commit, else the first
  branch's), then `GET .../tree/<commit>?recursive=true`. Without a network (or with `--offline`) the files of the
  commit cached under refs/ are used instead.
- Which file: `-hff` names it; else the first model GGUF (not an mmproj, imatrix or MTP / EAGLE3 / DFlash / DSpark
  head, not a later split) whose name holds the tag followed by `.` or `-` (case-insensitive); without a tag
  Q4_K_M, then Q8_0, then the first model GGUF.
- The cache: `$LLAMA_CACHE`, `$HF_HUB_CACHE`, `$HUGGINGFACE_HUB_CACHE`, `$HF_HOME/hub`,
  `$XDG_CACHE_HOME/huggingface/hub` or `~/.cache/huggingface/hub`; in it `models--<user>--<model>/` with `refs/<branch>`
  (the commit), `blobs/<oid>` (the bytes, named by their LFS sha256) and `snapshots/<commit>/<path>` (a relative
  symlink to the blob). A file already there is not fetched again.
- A download goes to `blobs/<oid>.downloadInProgress` (resumed with a Range request when one is left over), its
  sha256 (a git blob's sha1 for a small non-LFS file) and size are checked against the listing, and only then is it
  renamed into place: the cache never holds a file that looks complete and is not (llama.cpp does not check).
  Two downloads of one blob at once (two sharpi runs, or huggingface_hub) take turns: the second waits on
  `.locks/models--<user>--<model>/<oid>.lock`, huggingface_hub's own lock file, and finds the blob there.
- The ref (refs/<branch>) moves to a new commit only once its files are fetched: a download cut short leaves the
  cache serving the files it had; offline, a snapshot that holds the file asked for is used when the ref's does not.
- A model split by llama-gguf-split (`<name>-00001-of-0000N.gguf`, ...): every part is fetched; the first loads.
"""
from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

from .errors import SharpiError, UsageError

try:
    import fcntl
except ImportError:  # (not POSIX: downloads of one file at once are not kept apart)
    fcntl = None

DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
_HEADS = ("mmproj", "mtp-", "eagle3-", "dflash-", "dspark-")  # projectors and draft heads a model repo ships
_NOT_MODELS = _HEADS + ("imatrix",)  # (not a model to run; --cache-list leaves out only the heads, as llama.cpp)
_SPLIT_RE = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.I)
_TIMEOUT = 30.0  # seconds a connection may stay silent
_ATTEMPTS = 3
# what a request can fail with besides an HTTP error: no connection, a malformed answer (a bad status line, a
# chunked reply cut short), a URL urllib cannot send (an invalid port)
_NO_ANSWER = (urllib.error.URLError, OSError, http.client.HTTPException)

# progress(done_bytes, total_bytes, file_name)
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class HubModel:
    """A model named by -hf / -hfd: fetched (or found in the cache) when it is loaded."""
    repo: str
    tag: str = ""
    file: str = ""
    token: str = ""
    offline: bool = False

    def __str__(self) -> str:
        return self.repo + (f":{self.tag}" if self.tag else "") + (f" ({self.file})" if self.file else "")


@dataclass(frozen=True)
class UrlModel:
    """A model named by -mu: its URL, and -m's path if given (where it goes)."""
    url: str
    dest: str | None = None
    token: str = ""
    offline: bool = False

    def __str__(self) -> str:
        return self.url


@dataclass(frozen=True)
class HubFile:
    path: str      # in the repository
    oid: str = ""  # LFS sha256 (64 hex) or git blob sha1 (40 hex)
    size: int = -1
    url: str = ""
    local: Path | None = None  # snapshots/<commit>/<path>


def parse_spec(spec: str, flag: str = "-hf") -> tuple[str, str]:
    """`<user>/<model>[:quant]` -> (repo, tag), as llama.cpp splits it (a valid repository id: letters, digits
    and `_`, with `.`, `-` and exactly one `/` only between them)."""
    parts = spec.split(":")
    repo, tag = parts[0], parts[-1] if len(parts) > 1 else ""
    if not valid_repo(repo):
        raise UsageError(f"invalid {flag} '{spec}': expected <user>/<model>[:quant]")
    return repo, tag


def valid_repo(repo: str) -> bool:
    return (0 < len(repo) <= 256 and repo.count("/") == 1
            and re.fullmatch(r"[A-Za-z0-9_]+(?:[/.-][A-Za-z0-9_]+)*", repo) is not None)


def endpoint() -> str:
    ep = os.environ.get("MODEL_ENDPOINT") or os.environ.get("HF_ENDPOINT") or "https://huggingface.co/"
    return ep if ep.endswith("/") else ep + "/"


def cache_dir() -> Path:
    for var, sub in (("LLAMA_CACHE", ""), ("HF_HUB_CACHE", ""), ("HUGGINGFACE_HUB_CACHE", ""), ("HF_HOME", "hub"),
                     ("XDG_CACHE_HOME", "huggingface/hub")):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser() / sub
    return Path.home() / ".cache" / "huggingface" / "hub"


def repo_dir(repo: str) -> Path:
    return cache_dir() / ("models--" + repo.replace("/", "--"))


def _valid_token(token: str) -> bool:
    return token.startswith("hf_") and 37 <= len(token) <= 256 and token[3:].isalnum() and token.isascii()


def _safe_subpath(p: str) -> bool:
    pp = PurePosixPath(p)
    return bool(p) and not pp.is_absolute() and ".." not in pp.parts and "\\" not in p


def _is_hex(s: str, *lens: int) -> bool:
    return len(s) in lens and all(c in "0123456789abcdefABCDEF" for c in s)


class _Unreachable(Exception):
    """The hub could not be asked (no network, a server error): the cache may still serve."""


def check_url(url: str, what: str) -> None:
    """UsageError unless url is an http(s) URL urllib can send (a host, a numeric port)."""
    try:
        u = urllib.parse.urlsplit(url)
        ok = u.scheme in ("http", "https") and bool(u.hostname)
        _ = u.port
    except ValueError:
        ok = False
    if not ok:
        raise UsageError(f"invalid {what} '{url}': expected an http:// or https:// URL")


def _request(url: str, token: str, extra: dict | None = None) -> urllib.request.Request:
    from importlib.metadata import PackageNotFoundError, version
    try:
        ua = "sharpi/" + version("sharpi")
    except PackageNotFoundError:
        ua = "sharpi"
    headers = {"User-Agent": ua, **(extra or {})}
    if token:
        headers["Authorization"] = "Bearer " + token
    check_url(url, "URL")
    return urllib.request.Request(url, headers=headers)


def _netloc(url: str) -> str:
    try:
        return urllib.parse.urlsplit(url).netloc
    except ValueError:
        return ""


def _why(e: Exception) -> str:
    """One line saying why a request got no answer (a malformed one named by its kind: `BadStatusLine: GARBAGE`)."""
    text = " ".join(str(getattr(e, "reason", e)).split())
    if isinstance(e, http.client.HTTPException):
        return f"a malformed answer ({type(e).__name__}" + (f": {text})" if text else ")")
    return text or type(e).__name__


def _length(headers, name: str = "Content-Length") -> int:
    """A header's byte count, -1 when it is absent or not a count."""
    v = (headers.get(name) or "").strip()
    return int(v) if v.isdigit() else -1


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Redirects followed without the token once they leave the host it was meant for (the hub sends its files
    from a CDN's signed URLs), or https for plain http."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        old, to = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(new.full_url if new else newurl)
        if new is not None and (to.netloc != old.netloc or (old.scheme, to.scheme) == ("https", "http")):
            new.remove_header("Authorization")
        return new


_opener = urllib.request.build_opener(_Redirects)


def _open(req: urllib.request.Request, timeout: float):
    return _opener.open(req, timeout=timeout)


def _http_reason(e: urllib.error.HTTPError) -> str:
    try:
        msg = json.loads(e.read().decode("utf-8", "replace")).get("error", "")
    except (ValueError, AttributeError, OSError):
        msg = ""
    why = {401: "unauthorized: a gated or private repository needs a token (-hft / HF_TOKEN)",
           403: "access denied (a gated repository: accept its terms on the hub; pass a token with -hft / HF_TOKEN)",
           404: "not found"}.get(e.code, e.reason)
    return f"HTTP {e.code} {why}" + (f" ({msg})" if msg and msg not in why else "")


def _get_json(url: str, token: str, pages: bool = False):
    """The JSON at url; pages: a list the hub pages (`Link: <...>; rel="next"`), all its pages joined."""
    out = []
    try:
        while url:
            with _open(_request(url, token, {"Accept": "application/json"}), timeout=_TIMEOUT) as r:
                got = json.loads(r.read().decode("utf-8"))
                if not pages:
                    return got
                if not isinstance(got, list):
                    return got
                out += got
                nxt = re.search(r'<([^>]+)>\s*;\s*rel="next"', r.headers.get("Link") or "")
                url = urllib.parse.urljoin(url, nxt.group(1)) if nxt else ""
        return out
    except urllib.error.HTTPError as e:
        if e.code >= 500:
            raise _Unreachable(_http_reason(e)) from None
        raise SharpiError(f"{url}: {_http_reason(e)}") from None
    except _NO_ANSWER as e:
        raise _Unreachable(_why(e)) from None
    except ValueError:
        raise SharpiError(f"{url}: the hub's answer is not JSON") from None


def remote_files(repo: str, token: str = "") -> tuple[list[HubFile], str, str]:
    """(the files, branch, commit) of the repository's `main` commit (else its first branch's). Files the listing
    gives no oid for (a hash to check them by) are left out."""
    ep = endpoint()
    refs = _get_json(f"{ep}api/models/{repo}/refs", token)
    branches = [b for b in (refs.get("branches") if isinstance(refs, dict) else None) or []
                if isinstance(b, dict) and isinstance(b.get("name"), str) and isinstance(b.get("targetCommit"), str)
                and _is_hex(b["targetCommit"], 40) and _safe_subpath(b["name"])]
    if not branches:
        raise SharpiError(f"{repo}: the hub lists no branch for it")
    branch = next((b for b in branches if b["name"] == "main"), branches[0])
    commit = branch["targetCommit"]
    tree = _get_json(f"{ep}api/models/{repo}/tree/{commit}?recursive=true", token, pages=True)
    if not isinstance(tree, list):
        raise SharpiError(f"{repo}: the hub's file list is not a list")
    snap = repo_dir(repo) / "snapshots" / commit
    files = []
    for it in tree:
        if not (isinstance(it, dict) and it.get("type") == "file" and isinstance(it.get("path"), str)
                and _safe_subpath(it["path"])):
            continue
        lfs = it.get("lfs") if isinstance(it.get("lfs"), dict) else None
        oid = (lfs or it).get("oid") or ""
        size = (lfs or it).get("size")
        if not (isinstance(oid, str) and _is_hex(oid, 40, 64)):
            continue
        files.append(HubFile(it["path"], oid.lower(), size if isinstance(size, int) else -1,
                             f"{ep}{repo}/resolve/{commit}/{urllib.parse.quote(it['path'])}", snap / it["path"]))
    return files, branch["name"], commit


def cached_snapshots(repo: str) -> list[list[HubFile]]:
    """The files of each cached snapshot: the commits refs/ names first (main's first), then the others, newest
    first (a snapshot a newer ref's download left behind)."""
    rdir = repo_dir(repo)
    commits = []
    if (rdir / "refs").is_dir():
        for f in sorted((rdir / "refs").rglob("*"), key=lambda f: f.name != "main"):
            try:
                c = f.read_text().strip() if f.is_file() else ""
            except OSError:
                continue
            if _is_hex(c, 40) and c not in commits:
                commits.append(c)
    snaps = rdir / "snapshots"
    if snaps.is_dir():
        rest = [d for d in snaps.iterdir() if d.is_dir() and _is_hex(d.name, 40) and d.name not in commits]
        commits += [d.name for d in sorted(rest, key=lambda d: d.stat().st_mtime, reverse=True)]
    out = []
    for c in commits:
        snap = snaps / c
        if snap.is_dir():
            files = [HubFile(p.relative_to(snap).as_posix(), local=p) for p in sorted(snap.rglob("*"))
                     if p.is_file() or p.is_symlink()]
            if files:
                out.append(files)
    return out


def cached_files(repo: str) -> list[HubFile]:
    """The files cached for the commit refs/main names (else another ref's, else the newest snapshot's)."""
    return next(iter(cached_snapshots(repo)), [])


def split_info(path: str) -> tuple[str, int, int]:
    """(prefix, index, count) of a GGUF's name: `x-00002-of-00003.gguf` -> ('x', 2, 3); `x.gguf` -> ('x', 1, 1)."""
    stem = path[:-5] if path.lower().endswith(".gguf") else path
    m = _SPLIT_RE.match(stem)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else (stem, 1, 1)


def is_model_gguf(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path.endswith(".gguf") and not any(w in name for w in _NOT_MODELS)


def pick(files: list[HubFile], tag: str, file: str = "") -> HubFile | None:
    """llama.cpp's choice of the model file (find_best_model), or the file -hff names."""
    if file:
        return next((f for f in files if f.path == file), None)
    firsts = [f for f in files if is_model_gguf(f.path) and split_info(f.path)[1] == 1]
    for t in ([tag] if tag else DEFAULT_TAGS):
        pat = re.compile(re.escape(t) + r"[.-]", re.I)
        hit = next((f for f in firsts if pat.search(f.path)), None)
        if hit:
            return hit
    return None if tag else (firsts[0] if firsts else None)


def resolve(m: HubModel, progress: Progress | None = None, warn: Callable[[str], None] | None = None) -> Path:
    """The local path of the model file `m` names, fetched into the hub cache if it is not there yet."""
    try:
        return _resolve(m, progress, warn)
    except OSError as e:  # (the cache: not writable, not a folder, a full disk)
        raise SharpiError(f"{m.repo}: cannot use the cache {cache_dir()}: {e.strerror or e}"
                          + (f" ({e.filename})" if getattr(e, "filename", None) else "")) from None


def _resolve(m: HubModel, progress: Progress | None, warn: Callable[[str], None] | None) -> Path:
    token = m.token or os.environ.get("HF_TOKEN", "")
    if token and not _valid_token(token):
        if warn:
            warn("the Hugging Face token is not a valid one (hf_ and 34+ letters or digits): not sent")
        token = ""
    offline = m.offline or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    files, why, ref = [], "--offline" if m.offline else "HF_HUB_OFFLINE", None
    if not offline:
        try:
            files, branch, commit = remote_files(m.repo, token)
            ref = (repo_dir(m.repo) / "refs" / branch, commit)
        except _Unreachable as e:
            why = f"cannot reach {endpoint()}: {e}"
        except SharpiError as e:
            why = str(e)
    if not files:
        snaps = cached_snapshots(m.repo)
        if not snaps:
            raise SharpiError(f"{m.repo}: {why}; nothing of it is cached in {cache_dir()}")
        files = next((s for s in snaps if pick(s, m.tag, m.file) is not None), snaps[0])
        if warn and not offline:
            warn(f"{why}: using the cached copy of {m.repo}")
    f = pick(files, m.tag, m.file)
    if f is None:
        ggufs = [x.path for x in files if x.path.endswith(".gguf")]
        what = f"no file '{m.file}'" if m.file else (f"no model GGUF with tag {m.tag}" if m.tag else "no model GGUF")
        raise SharpiError(f"{m.repo}: {what}" + (f" (its GGUF files: {', '.join(ggufs)})" if ggufs else
                                                 " (it holds no GGUF file)"))
    prefix, _, count = split_info(f.path)
    parts = [f]
    if count > 1:  # a model split by llama-gguf-split: every part, beside the first (GGUFFile finds them by name)
        parts = sorted((x for x in files if split_info(x.path)[0] == prefix and split_info(x.path)[2] == count),
                       key=lambda x: split_info(x.path)[1])
        if [split_info(x.path)[1] for x in parts] != list(range(1, count + 1)):
            raise SharpiError(f"{m.repo}: {f.path} is part 1 of {count}, but the repository holds parts "
                              f"{[split_info(x.path)[1] for x in parts]}")
    got = [fetch(m.repo, x, token, progress, warn) for x in parts][0]
    if ref is not None:  # (only now: a download cut short leaves the ref at the commit whose files the cache has)
        _write_atomic(*ref)
    return got


@contextlib.contextmanager
def _locked(lock: Path, what: str, warn: Callable[[str], None] | None = None):
    """An exclusive lock on the file `lock` (kept: deleting it would let a third process lock a new file while a
    second waits on the old one) while the block downloads `what`."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # (no lock where none can be made, -mu's to a folder of the user's: the download goes on)
        yield
        return
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if warn:
                    warn(f"waiting for another download of {what} to finish")
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def fetch(repo: str, f: HubFile, token: str = "", progress: Progress | None = None,
          warn: Callable[[str], None] | None = None) -> Path:
    """f's bytes at f.local (snapshots/<commit>/<path>), through blobs/<oid>."""
    final = f.local
    assert final is not None
    if final.exists():
        return final
    if not f.url:
        raise SharpiError(f"{repo}: {f.path} is not in the cache (a broken link: fetch it again without --offline)")
    blob = repo_dir(repo) / "blobs" / f.oid
    with _locked(cache_dir() / ".locks" / repo_dir(repo).name / f"{f.oid}.lock", f.path, warn):
        if final.exists():  # (another run fetched it while this one waited)
            return final
        if final.is_symlink():  # (a link whose blob is gone: made anew below)
            final.unlink()
        if not blob.exists():
            _download(f, blob, token, progress)
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            final.symlink_to(os.path.relpath(blob, final.parent))
        except OSError:  # (no symlinks here: the blob moves into the snapshot, as llama.cpp's degraded mode)
            os.replace(blob, final)
    return final


def _download(f: HubFile, dest: Path, token: str, progress: Progress | None) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".downloadInProgress")
    name = f.path.rsplit("/", 1)[-1]
    err = ""
    for attempt in range(_ATTEMPTS):
        if attempt:
            time.sleep(2 ** attempt)
        have = tmp.stat().st_size if tmp.exists() else 0
        try:
            req = _request(f.url, token, {"Range": f"bytes={have}-"} if have else None)
            with _open(req, timeout=_TIMEOUT) as r:
                if have and r.status != 206:  # the server sends it whole: start over
                    have = 0
                rng = re.match(r"\s*bytes\s+(\d+)-", r.headers.get("Content-Range") or "")
                if have and rng and int(rng.group(1)) != have:  # (not the range asked for: start over next time)
                    tmp.unlink()
                    raise OSError(f"the server sent bytes from {rng.group(1)} where {have} were asked for")
                length = max(_length(r.headers), 0)
                total = f.size if f.size >= 0 else (have + length if length else 0)
                with open(tmp, "ab" if have else "wb") as out:
                    done = have
                    while chunk := r.read(1 << 20):
                        out.write(chunk)
                        done += len(chunk)
                        if progress:
                            progress(done, total, name)
            if length and done < have + length:  # (the connection closed early: the next attempt asks for the rest)
                raise OSError(f"the connection closed after {done} of {have + length} bytes")
            if not total and (why := _gguf_cut(tmp)):  # (no size anywhere: only the file itself tells a cut one)
                raise OSError(f"the connection closed after {done} bytes, before the GGUF's end ({why})")
            break
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:  # (a range past the end: the left-over file is already whole, or longer)
                break
            if e.code < 500:
                raise SharpiError(f"cannot download {f.url}: {_http_reason(e)}") from None
            err = _http_reason(e)
        except _NO_ANSWER as e:
            err = _why(e)
    else:
        raise SharpiError(f"cannot download {f.url}: {err} ({_ATTEMPTS} attempts; what came is kept in {tmp} "
                          "and the next run goes on from there)")
    _verify(f, tmp)
    os.replace(tmp, dest)


def _gguf_cut(path: Path) -> str:
    """Why a file that starts as a GGUF cannot be read as one ('' where it can, or is no GGUF): a download with no
    length given, whose connection closed early, looks complete but for this."""
    from .gguf_file import _open, is_gguf
    if not is_gguf(path):
        return ""
    try:
        _open(str(path))
    except SharpiError as e:
        return str(e).removeprefix(f"{path}: ")
    return ""


def _verify(f: HubFile, tmp: Path) -> None:
    size = tmp.stat().st_size
    bad = ""
    if f.size >= 0 and size != f.size:
        bad = f"{size} bytes where the hub lists {f.size}"
    elif f.oid:
        h = hashlib.sha256() if len(f.oid) == 64 else hashlib.sha1(b"blob %d\0" % size)
        with open(tmp, "rb") as src:
            while chunk := src.read(1 << 22):
                h.update(chunk)
        if h.hexdigest() != f.oid:
            bad = f"{'sha256' if len(f.oid) == 64 else 'git sha1'} {h.hexdigest()} where the hub lists {f.oid}"
    if bad:
        tmp.unlink()
        raise SharpiError(f"download of {f.path} is damaged ({bad}); nothing was kept")


def cached_models() -> list[str]:
    """`<user>/<model>:<TAG>` of every model GGUF cached (first parts of splits, tagged names), as llama.cpp's
    --cache-list shows them."""
    root, out = cache_dir(), []
    if not root.is_dir():
        return out
    for d in sorted(root.glob("models--*")):
        repo = d.name[len("models--"):].replace("--", "/")
        if not valid_repo(repo):
            continue
        for f in (f for snap in cached_snapshots(repo) for f in snap):
            prefix, index, _ = split_info(f.path)
            tag = re.search(r"[-.]([A-Za-z0-9_]+)$", prefix)
            name = prefix.rsplit("/", 1)[-1]
            if (index != 1 or not tag or not f.path.endswith(".gguf")
                    or any(w in name for w in _HEADS)):
                continue
            key = f"{repo}:{tag.group(1).upper()}"
            if key not in out:
                out.append(key)
    return out


# ---- -mu / --model-url: a GGUF at a URL --------------------------------------------------------------------

def url_cache_dir() -> Path:
    """llama.cpp's cache for -mu downloads (fs_get_cache_directory): $LLAMA_CACHE, else
    $XDG_CACHE_HOME/llama.cpp or ~/.cache/llama.cpp."""
    if os.environ.get("LLAMA_CACHE"):
        return Path(os.environ["LLAMA_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "llama.cpp"


def _url_path(url: str) -> str:
    """url without its query and fragment."""
    return url.split("#")[0].split("?")[0]


def url_parts(url: str) -> list[str]:
    """The URLs of every part of a split model from its first part's (`...-00001-of-0000N.gguf`), else [url]."""
    base = _url_path(url)
    prefix, index, count = split_info(base)
    if count <= 1:
        return [url]
    if index != 1:
        raise UsageError(f"-mu {url}: part {index} of a split model: give its first part's URL")
    return [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def fetch_url(url: str, dest: str | None = None, token: str = "", offline: bool = False,
              progress: Progress | None = None, warn: Callable[[str], None] | None = None) -> Path:
    """-mu: the GGUF at url (and the other parts of a split one) at dest (-m's path; its folder for the parts) or in
    url_cache_dir() (with the token given; $HF_TOKEN only to the hub's host, not to any URL as llama.cpp sends it),
    downloaded unless a copy is there whose ETag (kept in `<file>.etag`) the server still gives, as llama.cpp's
    downloader does; the copy is replaced only once a new download is complete (a file there without a .etag, which
    no -mu download wrote, is kept as it is). A download left unfinished goes on only while the ETag it began under
    (`<file>.downloadInProgress.etag`) is still the server's; two runs fetching one path take turns."""
    check_url(url, "-mu/--model-url")
    if not token and _netloc(url) == _netloc(endpoint()):
        token = os.environ.get("HF_TOKEN", "")
        token = token if _valid_token(token) else ""
    try:
        return _fetch_url(url, dest, token, offline, progress, warn)
    except OSError as e:
        raise SharpiError(f"-mu {url}: cannot write {e.filename or dest or url_cache_dir()}: {e.strerror or e}") from None


def _fetch_url(url: str, dest: str | None, token: str, offline: bool, progress: Progress | None,
               warn: Callable[[str], None] | None) -> Path:
    parts = url_parts(url)
    names = [_url_path(p).rsplit("/", 1)[-1] for p in parts]
    if dest is None and not all(names):
        raise UsageError(f"-mu {url}: the URL names no file (give -m the path to write it to)")
    if dest is not None and len(parts) == 1:
        paths = [Path(dest).expanduser()]
    else:
        folder = Path(dest).expanduser().parent if dest is not None else url_cache_dir()
        paths = [folder / n for n in names]
    for u, path in zip(parts, paths):
        etag_file = path.with_name(path.name + ".etag")
        if offline:
            if not path.is_file():
                raise SharpiError(f"-mu: {path} is not in the cache (--offline)")
            continue
        try:
            req = _request(u, token)
            req.method = "HEAD"
            with _open(req, timeout=_TIMEOUT) as r:
                etag, length = r.headers.get("ETag") or "", _length(r.headers)
        except _NO_ANSWER as e:  # (HTTPError is one: an answer; the others none)
            answer = _http_reason(e) if isinstance(e, urllib.error.HTTPError) else None
            reason = _why(e)
            if not path.is_file():
                raise SharpiError(f"cannot download {u}: {answer or reason}") from None
            if warn:
                warn(f"{u}: {answer}: using {path}" if answer else f"cannot reach {u} ({reason}): using {path}")
            continue

        def current() -> bool:
            # (a file there that no -mu download wrote, without its .etag, is the user's: used as it is, never replaced)
            return path.is_file() and (not etag or not etag_file.is_file() or etag_file.read_text().strip() == etag)
        if current():
            continue
        if path.exists() and not path.is_file():
            raise SharpiError(f"-mu: {path} exists and is not a file")
        lock = url_cache_dir() / ".locks" / (hashlib.sha256(str(path.absolute()).encode()).hexdigest() + ".lock")
        with _locked(lock, u, warn):
            if current():  # (another run fetched it while this one waited)
                continue
            tmp = path.with_name(path.name + ".downloadInProgress")
            began = tmp.with_name(tmp.name + ".etag")  # the ETag of the bytes a left-over download holds
            if tmp.exists() and (not etag or not began.is_file() or began.read_text().strip() != etag):
                tmp.unlink()  # (the server's file changed since, or nothing says which it was: start over)
            if etag:
                _write_atomic(began, etag)
            _download(HubFile(path.name, size=length, url=u), path, token, progress)
            if etag:
                _write_atomic(etag_file, etag)
            began.unlink(missing_ok=True)
    return paths[0]


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.{threading.get_ident()}")  # (one per writer)
    tmp.write_text(text)
    os.replace(tmp, path)
