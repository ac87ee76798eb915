"""-hf / -hfd: models from the Hugging Face hub, against a local server that answers as the hub's API does
(refs, recursive tree listing with LFS oids, resolve URLs with Range requests), in the hub cache's layout."""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import SMOL, model_path
from test_cli import one_error_line, sharpi

from sharpi_core import hf_hub
from sharpi_core.errors import SharpiError, UsageError
from sharpi_core.hf_hub import HubFile, HubModel

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "tester/SmolLM2-135M-Instruct-GGUF"


class Hub:
    """A hub serving one repository: files {path: bytes}; `corrupt` paths served with a byte flipped, `cut`
    paths dropped after half their bytes on the first request; every request recorded (method, path, headers)."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.corrupt, self.cut, self.requests = dict(files), set(), set(), []
        self.redirect = set()  # paths whose resolve URL redirects to another host (localhost), as the hub's CDN
        self.status: dict[str, int] = {}  # request path -> forced HTTP status
        self.raw: dict[str, bytes] = {}  # request path -> bytes sent as the whole answer (a malformed one)
        self.commit = COMMIT  # what main names
        self.no_oid = set()  # paths listed without an oid
        self.bad_range = False  # a Range answered 206 from byte 0
        self.slow = 0.0  # seconds a download pauses halfway
        self.no_length = set()  # paths answered with no Content-Length (HEAD and GET) and no ranges
        self.always_cut = set()  # paths whose every download drops halfway
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body=b"", headers=None):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_HEAD(self):
                hub.requests.append(("HEAD", self.path, dict(self.headers)))
                prefix = f"/{REPO}/resolve/{hub.commit}/"
                p = self.path[len(prefix):]
                if not self.path.startswith(prefix) or p not in hub.files:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                if p not in hub.no_length:
                    self.send_header("Content-Length", str(len(hub.files[p])))
                self.send_header("ETag", '"' + hashlib.sha256(hub.files[p]).hexdigest()[:16] + '"')
                self.end_headers()

            def do_GET(self):
                hub.requests.append(("GET", self.path, dict(self.headers)))
                if self.path in hub.status:
                    return self._send(hub.status[self.path], json.dumps({"error": "forced"}).encode())
                if self.path in hub.raw:
                    self.wfile.write(hub.raw[self.path])
                    self.close_connection = True
                    return
                if self.path == f"/api/models/{REPO}/refs":
                    return self._send(200, json.dumps({"branches": [
                        {"name": "dev", "ref": "refs/heads/dev", "targetCommit": "f" * 40},
                        {"name": "main", "ref": "refs/heads/main", "targetCommit": hub.commit}], "tags": []}).encode())
                tree = f"/api/models/{REPO}/tree/{hub.commit}?recursive=true"
                if self.path.startswith(tree):  # two files a page, the next page's URL in a Link header
                    items = [{"type": "directory", "path": "sub", "oid": "1" * 40, "size": 0}]
                    for p, b in hub.files.items():
                        sha1 = hashlib.sha1(b"blob %d\0" % len(b) + b).hexdigest()
                        it = {"type": "file", "path": p, "oid": sha1, "size": len(b)}
                        if p in hub.no_oid:
                            del it["oid"]
                        elif p.endswith(".gguf"):
                            it["lfs"] = {"oid": hashlib.sha256(b).hexdigest(), "size": len(b), "pointerSize": 134}
                        items.append(it)
                    page = int(self.path.rsplit("&cursor=", 1)[1]) if "&cursor=" in self.path else 0
                    more = len(items) > 2 * page + 2
                    return self._send(200, json.dumps(items[2 * page:2 * page + 2]).encode(),
                                      {"Link": f'<{hub.url}{tree[1:]}&cursor={page + 1}>; rel="next"'} if more else {})
                prefix = f"/{REPO}/resolve/{hub.commit}/"
                if self.path.startswith(prefix) and self.path[len(prefix):] in hub.redirect:
                    port = self.server.server_address[1]
                    return self._send(302, b"", {"Location": f"http://localhost:{port}/cdn/{self.path[len(prefix):]}"})
                if self.path.startswith("/cdn/"):
                    prefix = "/cdn/"
                if self.path.startswith(prefix) and self.path[len(prefix):] in hub.files:
                    p = self.path[len(prefix):]
                    body = hub.files[p]
                    if p in hub.corrupt:
                        body = body[:-1] + bytes([body[-1] ^ 1])
                    if p in hub.no_length:  # (HTTP/1.0: the body ends where the connection does)
                        self.send_response(200)
                        self.end_headers()
                        if p in hub.cut or p in hub.always_cut:
                            hub.cut.discard(p)
                            body = body[:len(body) // 2]
                        self.wfile.write(body)
                        return
                    rng = self.headers.get("Range")
                    if rng:
                        start = 0 if hub.bad_range else int(rng.split("=")[1].rstrip("-"))
                        if start >= len(body):
                            return self._send(416)
                        part = body[start:]
                        self.send_response(206)
                        self.send_header("Content-Length", str(len(part)))
                        self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                        self.end_headers()
                        self.wfile.write(part)
                        return
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.send_header("Accept-Ranges", "bytes")
                    self.end_headers()
                    if p in hub.cut:
                        hub.cut.discard(p)
                        self.wfile.write(body[:len(body) // 2])
                        self.wfile.flush()
                        self.connection.shutdown(2)  # the connection drops mid-file
                        return
                    if hub.slow:
                        self.wfile.write(body[:len(body) // 2])
                        self.wfile.flush()
                        time.sleep(hub.slow)
                        body = body[len(body) // 2:]
                    self.wfile.write(body)
                    return
                self._send(404, json.dumps({"error": "Repository not found"}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def downloads(self):
        return [r for r in self.requests if "/resolve/" in r[1] and r[0] == "GET"]


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An empty hub cache (LLAMA_CACHE) for the test, no token from the environment."""
    cache = tmp_path / "hub"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "HF_TOKEN", "MODEL_ENDPOINT", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LLAMA_CACHE", str(cache))
    return cache


def small_repo():
    return {"README.md": b"# a model\n", "model-Q8_0.gguf": b"GGUF q8" * 100, "model-Q4_K_M.gguf": b"GGUF q4km" * 100,
            "mmproj-model-f16.gguf": b"GGUF mm" * 10}


@pytest.fixture
def hub(env, monkeypatch):
    h = Hub(small_repo())
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    yield h
    h.stop()


def test_spec_parsing_and_repository_ids():
    assert hf_hub.parse_spec("ggml-org/gemma-3-270m-GGUF:q8_0") == ("ggml-org/gemma-3-270m-GGUF", "q8_0")
    assert hf_hub.parse_spec("user/model.v1_2") == ("user/model.v1_2", "")
    for bad in ("model", "a/b/c", "user/", "/model", "-user/model", "user/model-", "user/mo..del", "us er/model",
                ":Q4_K_M", "user/mod@l"):
        with pytest.raises(UsageError, match="expected <user>/<model>"):
            hf_hub.parse_spec(bad)


def test_cache_dir_follows_llama_cpp_order(monkeypatch, tmp_path):
    for var in ("LLAMA_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf_hub.cache_dir() == tmp_path / ".cache/huggingface/hub"
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert hf_hub.cache_dir() == Path("/x/huggingface/hub")
    monkeypatch.setenv("HF_HOME", "/h")
    assert hf_hub.cache_dir() == Path("/h/hub")
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", "/hh")
    assert hf_hub.cache_dir() == Path("/hh")
    monkeypatch.setenv("HF_HUB_CACHE", "/c")
    assert hf_hub.cache_dir() == Path("/c")
    monkeypatch.setenv("LLAMA_CACHE", "/l")
    assert hf_hub.cache_dir() == Path("/l")
    assert hf_hub.repo_dir("a/b") == Path("/l/models--a--b")


def test_file_choice_is_llama_cpp_s():
    def names(*paths):
        return [HubFile(p) for p in paths]

    files = names("README.md", "mmproj-x-Q4_K_M.gguf", "x-Q8_0.gguf", "x-q4_k_m.gguf", "imatrix.gguf")
    assert hf_hub.pick(files, "").path == "x-q4_k_m.gguf"  # Q4_K_M first (any case), not the mmproj
    assert hf_hub.pick(files, "q8_0").path == "x-Q8_0.gguf"
    assert hf_hub.pick(files, "Q5_K_M") is None  # a tag asked for and absent: no fallback
    assert hf_hub.pick(names("x-Q8_0.gguf", "x-F16.gguf"), "").path == "x-Q8_0.gguf"
    assert hf_hub.pick(names("x-F16.gguf", "x-BF16.gguf"), "").path == "x-F16.gguf"  # the first model GGUF
    assert hf_hub.pick(names("x-F16.gguf", "x-BF16.gguf"), "bf16").path == "x-BF16.gguf"
    # the tag is searched for followed by . or -, whatever comes before it (llama.cpp's regex_search): F16 finds BF16
    assert hf_hub.pick(names("x-BF16.gguf", "x-F16.gguf"), "f16").path == "x-BF16.gguf"
    assert hf_hub.pick(names("x-F16.gguf"), "F1") is None
    assert hf_hub.pick(names("Q4_K_M/x-Q4_K_M-00002-of-00002.gguf", "Q4_K_M/x-Q4_K_M-00001-of-00002.gguf"),
                       "").path == "Q4_K_M/x-Q4_K_M-00001-of-00002.gguf"  # a split's first part
    assert hf_hub.pick(names("mtp-x-Q4_K_M.gguf", "x-eagle3-Q4_K_M.gguf"), "") is None
    assert hf_hub.pick(files, "Q4_K_M", file="x-Q8_0.gguf").path == "x-Q8_0.gguf"  # -hff wins over the tag
    assert hf_hub.split_info("a/x-Q4_K_M-00002-of-00003.gguf") == ("a/x-Q4_K_M", 2, 3)
    assert hf_hub.split_info("x.gguf") == ("x", 1, 1)


def test_fetch_into_the_hub_cache_layout_and_reuse(hub, env, monkeypatch):
    path = hf_hub.resolve(HubModel(REPO))
    repo = env / "models--tester--SmolLM2-135M-Instruct-GGUF"
    assert path == repo / "snapshots" / COMMIT / "model-Q4_K_M.gguf"
    assert path.read_bytes() == hub.files["model-Q4_K_M.gguf"]
    sha = hashlib.sha256(hub.files["model-Q4_K_M.gguf"]).hexdigest()
    assert path.is_symlink() and os.readlink(path) == f"../../blobs/{sha}"
    assert (repo / "refs" / "main").read_text() == COMMIT  # main's commit, not the first branch's
    assert not list((repo / "blobs").glob("*.downloadInProgress"))
    assert len(hub.downloads()) == 1 and hub.downloads()[0][2].get("Authorization") is None
    # again: listed, not downloaded; another tag of the same repository: one more download
    assert hf_hub.resolve(HubModel(REPO)) == path and len(hub.downloads()) == 1
    q8 = hf_hub.resolve(HubModel(REPO, "Q8_0"))
    assert q8.name == "model-Q8_0.gguf" and len(hub.downloads()) == 2
    # offline, or the hub gone: the cached commit's files, no request
    n = len(hub.requests)
    assert hf_hub.resolve(HubModel(REPO, offline=True)) == path and len(hub.requests) == n
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # (huggingface_hub's switch)
    assert hf_hub.resolve(HubModel(REPO)) == path and len(hub.requests) == n
    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub.stop()
    warned = []
    assert hf_hub.resolve(HubModel(REPO, "q8_0"), warn=warned.append) == q8
    assert len(warned) == 1 and "cached copy" in warned[0]
    with pytest.raises(SharpiError, match="no model GGUF with tag Q6_K .*model-Q8_0.gguf"):
        hf_hub.resolve(HubModel(REPO, "Q6_K", offline=True))


def test_resume_retry_and_damage(hub, env, monkeypatch):
    monkeypatch.setattr(hf_hub.time, "sleep", lambda s: None)
    body = hub.files["model-Q4_K_M.gguf"]
    sha = hashlib.sha256(body).hexdigest()
    blobs = env / "models--tester--SmolLM2-135M-Instruct-GGUF" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{sha}.downloadInProgress").write_bytes(body[:123])  # left by an interrupted run
    assert hf_hub.resolve(HubModel(REPO)).read_bytes() == body
    assert hub.downloads()[-1][2].get("Range") == "bytes=123-"
    # a connection that drops mid-file: the next attempt asks for the rest
    hub.cut.add("model-Q8_0.gguf")
    assert hf_hub.resolve(HubModel(REPO, "Q8_0")).read_bytes() == hub.files["model-Q8_0.gguf"]
    assert hub.downloads()[-1][2].get("Range") == f"bytes={len(hub.files['model-Q8_0.gguf']) // 2}-"
    # bytes that do not hash to the listing's oid: refused, nothing kept, no link in the snapshot
    hub.files["other-Q5_K_M.gguf"] = b"GGUF q5" * 50
    hub.corrupt.add("other-Q5_K_M.gguf")
    with pytest.raises(SharpiError, match="damaged .*sha256"):
        hf_hub.resolve(HubModel(REPO, "Q5_K_M"))
    assert not [p for p in blobs.iterdir() if hashlib.sha256(hub.files["other-Q5_K_M.gguf"]).hexdigest() in p.name]
    assert not (blobs.parent / "snapshots" / COMMIT / "other-Q5_K_M.gguf").exists()


def test_hub_errors(hub, env, monkeypatch, tmp_path):
    with pytest.raises(SharpiError, match="not found"):
        hf_hub.resolve(HubModel("tester/absent"))
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "a-file"))  # a cache that cannot be made: one error
    with pytest.raises(SharpiError, match="cannot use the cache .*a-file: Not a directory"):
        hf_hub.resolve(HubModel(REPO))
    with pytest.raises(SharpiError, match="cannot write .*a-file"):
        hf_hub.fetch_url(f"{hub.url}{REPO}/resolve/{COMMIT}/model-Q8_0.gguf")
    monkeypatch.setenv("LLAMA_CACHE", str(env))
    hub.status[f"/api/models/{REPO}/refs"] = 401
    with pytest.raises(SharpiError, match="token"):
        hf_hub.resolve(HubModel(REPO))
    hub.status.clear()
    hub.files["big-Q4_K_M-00001-of-00003.gguf"] = hub.files.pop("model-Q4_K_M.gguf")
    hub.files["big-Q4_K_M-00003-of-00003.gguf"] = b"GGUF rest"
    with pytest.raises(SharpiError, match="part 1 of 3, but the repository holds parts \\[1, 3\\]"):
        hf_hub.resolve(HubModel(REPO, "Q4_K_M"))
    with pytest.raises(SharpiError, match="no file 'nope.gguf'"):
        hf_hub.resolve(HubModel(REPO, file="nope.gguf"))
    hub.stop()
    with pytest.raises(SharpiError, match="cannot reach .*nothing of it is cached"):
        hf_hub.resolve(HubModel("tester/other"))


def test_token(hub, env, monkeypatch):
    token = "hf_" + "a1" * 17
    hf_hub.resolve(HubModel(REPO, token=token))
    assert all(r[2].get("Authorization") == f"Bearer {token}" for r in hub.requests)
    monkeypatch.setenv("HF_TOKEN", token)
    hf_hub.resolve(HubModel(REPO, "Q8_0"))
    assert hub.requests[-1][2].get("Authorization") == f"Bearer {token}"
    warned = []
    hf_hub.resolve(HubModel(REPO, token="secret"), warn=warned.append)
    assert "not a valid one" in warned[0] and hub.requests[-1][2].get("Authorization") is None
    # a download the hub redirects to another host (its CDN): the token is not sent there
    hub.files["cdn-Q5_K_M.gguf"] = b"GGUF from the cdn" * 30
    hub.redirect.add("cdn-Q5_K_M.gguf")
    assert hf_hub.resolve(HubModel(REPO, "Q5_K_M", token=token)).read_bytes() == hub.files["cdn-Q5_K_M.gguf"]
    asked, served = hub.requests[-2:]
    assert "/resolve/" in asked[1] and asked[2].get("Authorization") == f"Bearer {token}"
    assert served[1] == "/cdn/cdn-Q5_K_M.gguf" and served[2].get("Authorization") is None


def test_two_runs_fetching_one_file_take_turns(hub, env):
    """Two fetches of one blob at once: the second waits on huggingface_hub's lock file and finds the blob there
    (it appended to the first's download before: a blob bigger than the file, kept as complete, or moved away)."""
    body = hub.files["model-Q4_K_M.gguf"] = os.urandom(1 << 20)
    hub.slow = 3.0  # (the second run lists the repository and reaches the lock well within it)
    got, warned = {}, []

    def run(k):
        got[k] = hf_hub.resolve(HubModel(REPO), warn=warned.append)
    first = threading.Thread(target=run, args=("first",))
    first.start()
    while not hub.downloads():  # (the first has the lock once its download began)
        time.sleep(0.01)
    second = threading.Thread(target=run, args=("second",))
    second.start()
    first.join()
    second.join()
    assert got["first"] == got["second"] and got["first"].is_symlink() and got["first"].read_bytes() == body
    assert len(hub.downloads()) == 1 and warned == ["waiting for another download of model-Q4_K_M.gguf to finish"]
    sha = hashlib.sha256(body).hexdigest()
    assert (env / ".locks" / "models--tester--SmolLM2-135M-Instruct-GGUF" / f"{sha}.lock").is_file()


def test_malformed_answers_and_urls_are_one_error(hub, env, monkeypatch):
    monkeypatch.setattr(hf_hub.time, "sleep", lambda s: None)
    hub.raw[f"/api/models/{REPO}/refs"] = b"GARBAGE\r\n\r\n"  # (http.client's BadStatusLine)
    with pytest.raises(SharpiError, match="cannot reach .*nothing of it is cached"):
        hf_hub.resolve(HubModel(REPO))
    hub.raw.clear()
    path, body = f"/{REPO}/resolve/{COMMIT}/model-Q8_0.gguf", hub.files["model-Q8_0.gguf"]
    hub.raw[path] = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n40\r\nGGUF"  # a chunked answer cut short
    with pytest.raises(SharpiError, match="cannot download .*IncompleteRead"):
        hf_hub.resolve(HubModel(REPO, "Q8_0"))
    hub.raw[path] = b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n" + body  # a length that is no number
    assert hf_hub.resolve(HubModel(REPO, "Q8_0")).read_bytes() == body
    for bad in ("http://[::1/x.gguf", "http://127.0.0.1:abc/x.gguf", "file:///x.gguf", "http:///x.gguf"):
        with pytest.raises(UsageError, match="expected an http"):
            hf_hub.fetch_url(bad)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:abc/")
    with pytest.raises(SharpiError, match="invalid URL .*nothing of it is cached"):
        hf_hub.resolve(HubModel("tester/other"))
    # listed without an oid (nothing to check its bytes by): not a file to fetch
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    hub.files["x-Q6_K.gguf"] = b"GGUF q6"
    hub.no_oid.add("x-Q6_K.gguf")
    with pytest.raises(SharpiError, match="no model GGUF with tag Q6_K"):
        hf_hub.resolve(HubModel(REPO, "Q6_K"))


def test_an_update_cut_short_leaves_the_cache_serving_what_it_had(hub, env, monkeypatch):
    """refs/main moves to a new commit only once its file is fetched: a download cut short left it naming a
    snapshot that held nothing, and the old, complete one was lost to --offline and a hub that is down."""
    monkeypatch.setattr(hf_hub.time, "sleep", lambda s: None)
    old = hf_hub.resolve(HubModel(REPO))
    hub.commit = "b" * 40
    new = hub.files["model-Q4_K_M.gguf"] = b"GGUF q4km v2" * 100
    hub.status[f"/{REPO}/resolve/{hub.commit}/model-Q4_K_M.gguf"] = 503
    with pytest.raises(SharpiError, match="cannot download"):
        hf_hub.resolve(HubModel(REPO))
    ref = env / "models--tester--SmolLM2-135M-Instruct-GGUF" / "refs" / "main"
    assert ref.read_text() == COMMIT and hf_hub.resolve(HubModel(REPO, offline=True)) == old
    # a ref naming a snapshot without the file (left by an earlier sharpi): a snapshot that holds it serves
    ref.write_text(hub.commit)
    snap = ref.parent.parent / "snapshots" / hub.commit
    snap.mkdir()
    (snap / "README.md").write_text("# a model\n")
    assert hf_hub.resolve(HubModel(REPO, offline=True)) == old
    assert hf_hub.cached_models() == [f"{REPO}:Q4_K_M"]
    hub.status.clear()
    assert hf_hub.resolve(HubModel(REPO)).read_bytes() == new and ref.read_text() == hub.commit


def test_model_url_resumes_only_the_file_it_began(hub, env, monkeypatch):
    """-mu resumes a download left over only under the ETag it began with (the server's file changed: old bytes
    and new ones were joined into a file of the right size), and only from the byte it asked for."""
    monkeypatch.setattr(hf_hub.time, "sleep", lambda s: None)
    url, body = f"{hub.url}{REPO}/resolve/{COMMIT}/model-Q8_0.gguf", hub.files["model-Q8_0.gguf"]
    etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
    path, tmp = env / "model-Q8_0.gguf", env / "model-Q8_0.gguf.downloadInProgress"
    began = env / "model-Q8_0.gguf.downloadInProgress.etag"
    env.mkdir()
    for left, tag, resumed in ((b"X" * 100, None, False), (b"X" * 100, '"older"', False), (body[:100], etag, True)):
        path.unlink(missing_ok=True)
        tmp.write_bytes(left)
        if tag:
            began.write_text(tag)
        assert hf_hub.fetch_url(url) == path and path.read_bytes() == body
        assert hub.downloads()[-1][2].get("Range") == ("bytes=100-" if resumed else None), (left[:4], tag)
        assert not tmp.exists() and not began.exists() and (env / "model-Q8_0.gguf.etag").read_text() == etag
    hub.bad_range = True  # an answer from byte 0 to a Range from byte 100: started over, not appended
    path.unlink()
    tmp.write_bytes(body[:100])
    began.write_text(etag)
    assert hf_hub.fetch_url(url).read_bytes() == body and hub.downloads()[-1][2].get("Range") is None
    with pytest.raises(UsageError, match="names no file"):  # (it wrote the answer over the cache folder)
        hf_hub.fetch_url(f"{hub.url}{REPO}/resolve/{COMMIT}/")
    # $HF_TOKEN goes to the hub's host only, not to any -mu URL (-hft's token goes where it is told)
    token = "hf_" + "a1" * 17
    monkeypatch.setenv("HF_TOKEN", token)
    hf_hub.fetch_url(url)
    assert hub.requests[-1][0] == "HEAD" and hub.requests[-1][2].get("Authorization") == f"Bearer {token}"
    hf_hub.fetch_url(url.replace("127.0.0.1", "localhost"))
    assert hub.requests[-1][0] == "HEAD" and hub.requests[-1][2].get("Authorization") is None
    hf_hub.fetch_url(url.replace("127.0.0.1", "localhost"), token=token)
    assert hub.requests[-1][2].get("Authorization") == f"Bearer {token}"


def test_model_url_without_a_length_is_checked_as_a_gguf(hub, env, monkeypatch, tmp_path):
    """-mu from a server that gives no length (HEAD or GET): a connection closed early is told by the GGUF itself
    (its tensor data runs past the end of the file), and the download is tried again, never kept as the model."""
    monkeypatch.setattr(hf_hub.time, "sleep", lambda s: None)
    w = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    w.add_tensor("t", np.arange(4096, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    body = (tmp_path / "tiny.gguf").read_bytes()
    hub.files["tiny.gguf"] = body
    hub.no_length |= {"tiny.gguf", "README.md"}
    hub.cut.add("tiny.gguf")
    url = f"{hub.url}{REPO}/resolve/{COMMIT}/tiny.gguf"
    assert hf_hub.fetch_url(url).read_bytes() == body
    assert [r[1].rsplit("/", 1)[1] for r in hub.downloads()] == ["tiny.gguf"] * 2
    hub.files["tiny.gguf"] = body + b"\0" * 32  # (a new ETag: fetched again) cut every time
    hub.always_cut.add("tiny.gguf")
    with pytest.raises(SharpiError, match=r"before the GGUF's end \(.*runs past the end.*\(3 attempts"):
        hf_hub.fetch_url(url)
    assert (env / "tiny.gguf").read_bytes() == body  # (the whole file fetched before is still the model)
    # a file that is no GGUF is taken as it comes (nothing to check it by)
    assert hf_hub.fetch_url(url.replace("tiny.gguf", "README.md")).read_bytes() == hub.files["README.md"]


@pytest.fixture(scope="module")
def smol_hub():
    h = Hub({"SmolLM2-135M-Instruct-Q4_1.gguf": model_path(SMOL).read_bytes(), "README.md": b"SmolLM2\n"})
    yield h
    h.stop()


def test_cli_runs_a_hub_model_as_its_file(smol_hub, env):
    """`sharpi -hf` gives `sharpi -m <the file>`'s output: fetched with a progress bar on stderr, then from the cache
    without the network (--offline), and as the draft model (-hfd)."""
    e = {"HF_ENDPOINT": smol_hub.url, "LLAMA_CACHE": str(env)}
    args = ("-p", "The capital of France is", "-n", "12", "--temp", "0")
    plain = sharpi("-m", model_path(SMOL), *args)
    assert plain.returncode == 0
    got = sharpi("-hf", f"{REPO}:Q4_1", *args, env=e, process=True)
    assert got.returncode == 0 and got.stdout == plain.stdout, got.stderr
    assert "fetching" in got.stderr and "Traceback" not in got.stderr
    smol_hub.stop()
    again = sharpi("-hf", REPO, "--offline", *args, env=e)  # no Q4_K_M or Q8_0 in it: the first model GGUF
    assert again.returncode == 0 and again.stdout == plain.stdout, again.stderr
    pulled = sharpi("models", "pull", f"{REPO}:Q4_1", env=e)  # (the cached copy: the hub is gone)
    assert pulled.returncode == 0 and pulled.stdout.strip().endswith("SmolLM2-135M-Instruct-Q4_1.gguf"), pulled.stderr
    spec = sharpi("-hf", REPO, "-hfd", REPO, "--offline", "--spec-draft-n-max", "3", *args, "--json", env=e)
    assert spec.returncode == 0, spec.stderr
    out = json.loads(spec.stdout)
    assert out["text"] and plain.stdout.startswith(args[1] + out["text"])
    assert out["speculative"]["drafted"] > 0 and out["speculative"]["accepted"] == out["speculative"]["drafted"]


def test_cli_flag_errors(env):
    e = {"HF_ENDPOINT": "http://127.0.0.1:9/", "LLAMA_CACHE": str(env)}
    one_error_line(sharpi("-hf", "nouser", "-p", "hi", env=e), 2, "expected <user>/<model>[:quant]")
    one_error_line(sharpi("-m", "x.gguf", "-hf", REPO, "-p", "hi", env=e), 2, "-m and -hf both name the model")
    one_error_line(sharpi("-md", "x.gguf", "-hfd", REPO, "-p", "hi", env=e), 2, "-md and -hfd")
    one_error_line(sharpi("-hff", "a.gguf", "-p", "hi", env=e), 2, "give -hf too")
    one_error_line(sharpi("-hf", "tester/never-fetched", "-p", "hi", env=e), 1, "nothing of it is cached")


@pytest.fixture(scope="module")
def smol_hub_split(tmp_path_factory):
    """A repository whose quant is split (in a folder of its own, as bigger repositories keep them) -> (its first
    part's URL, the parts, SmolLM2's greedy output)."""
    from test_split import write_split
    parts = write_split(model_path(SMOL), tmp_path_factory.mktemp("parts") / "SmolLM2-Q4_1.gguf", 40 << 20)
    h = Hub({f"Q4_1/{p.name}": p.read_bytes() for p in parts} | {"SmolLM2-F16.gguf": b"GGUF not fetched"})
    plain = sharpi("-m", model_path(SMOL), "-p", "The capital of France is", "-n", "12", "--temp", "0")
    assert plain.returncode == 0
    yield f"{h.url}{REPO}/resolve/{COMMIT}/Q4_1/{parts[0].name}", parts, plain.stdout
    h.stop()


def test_cli_runs_a_split_hub_model(smol_hub_split, env):
    """-hf on a split quant: every part fetched beside the first, the model loaded from it."""
    url, parts, plain = smol_hub_split
    e = {"HF_ENDPOINT": url.split(REPO)[0], "LLAMA_CACHE": str(env)}
    got = sharpi("-hf", f"{REPO}:q4_1", "-p", "The capital of France is", "-n", "12", "--temp", "0", env=e)
    assert got.returncode == 0 and got.stdout == plain, got.stderr
    snap = env / "models--tester--SmolLM2-135M-Instruct-GGUF" / "snapshots" / COMMIT / "Q4_1"
    assert sorted(p.name for p in snap.iterdir()) == [p.name for p in parts]


def test_model_url(hub, env, tmp_path):
    """-mu: the file at a URL into llama.cpp's cache (or -m's path), fetched again only when its ETag changes;
    a file the user had there is never replaced."""
    url = f"{hub.url}{REPO}/resolve/{COMMIT}/model-Q8_0.gguf"
    path = hf_hub.fetch_url(url)
    assert path == env / "model-Q8_0.gguf" and path.read_bytes() == hub.files["model-Q8_0.gguf"]
    assert (env / "model-Q8_0.gguf.etag").read_text().startswith('"') and len(hub.downloads()) == 1
    assert hf_hub.fetch_url(url) == path and len(hub.downloads()) == 1  # the same ETag: a HEAD request only
    hub.files["model-Q8_0.gguf"] = b"GGUF new" * 80  # the server's file changed
    assert hf_hub.fetch_url(url).read_bytes() == hub.files["model-Q8_0.gguf"] and len(hub.downloads()) == 2
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(b"GGUF the user's")
    assert hf_hub.fetch_url(url, str(mine)) == mine and mine.read_bytes() == b"GGUF the user's"
    assert len(hub.downloads()) == 2
    n = len(hub.requests)
    assert hf_hub.fetch_url(url, offline=True) == path and len(hub.requests) == n
    with pytest.raises(SharpiError, match="not in the cache"):
        hf_hub.fetch_url(url.replace("Q8_0", "Q4_K_M"), offline=True)
    with pytest.raises(SharpiError, match="HTTP 404"):
        hf_hub.fetch_url(url.replace("Q8_0", "Q2_K"))
    hub.stop()
    warned = []
    assert hf_hub.fetch_url(url, warn=warned.append) == path and "cannot reach" in warned[0]
    assert hf_hub.url_parts("https://x/a/m-Q4_K_M-00001-of-00003.gguf?download=true") == [
        f"https://x/a/m-Q4_K_M-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    with pytest.raises(UsageError, match="give its first part"):
        hf_hub.url_parts("https://x/m-00002-of-00003.gguf")


def test_cli_model_url_and_cache_list(smol_hub_split, env):
    """-mu of a split model's first part: every part, the model's output; -cl lists what -hf fetched."""
    url, parts, plain = smol_hub_split
    e = {"LLAMA_CACHE": str(env)}
    args = ("-p", "The capital of France is", "-n", "12", "--temp", "0")
    got = sharpi("-mu", url, *args, env=e)
    assert got.returncode == 0 and got.stdout == plain, got.stderr
    assert sorted(p.name for p in env.glob("*.gguf")) == [p.name for p in parts]
    one_error_line(sharpi("-mu", "ftp://x/m.gguf", *args, env=e), 2, "expected an http:// or https:// URL")
    one_error_line(sharpi("-mu", "http://127.0.0.1:abc/m.gguf", *args, env=e), 2, "expected an http:// or https://")
    one_error_line(sharpi("-mu", url, "-hf", REPO, *args, env=e), 2, "-mu and -hf both name the model")
    assert sharpi("-cl", env=e).stdout == "number of models in cache: 0\n"
    assert sharpi("-hf", f"{REPO}:Q4_1", *args, env=dict(e, HF_ENDPOINT=url.split(REPO)[0])).stdout == plain
    assert sharpi("-cl", env=e).stdout == f"number of models in cache: 1\n   1. {REPO}:Q4_1\n"


def test_offline_never_fetches_a_known_model(tmp_path):
    """--offline: a known model that is not cached is an error, not a download from PyPI."""
    e = {"SHARPI_MODELS_DIR": str(tmp_path)}
    one_error_line(sharpi("-p", "hi", "--offline", env=e), 1, "--offline forbids fetching it")
    one_error_line(sharpi("-m", model_path(SMOL), "-md", "qwen2.5-coder-0.5b-instruct-q4_k_m", "-p", "hi", "--offline",
                          env=e), 1, "qwen2.5-coder-0.5b-instruct-q4_k_m is not in the cache")
