"""Test options (heavy tests run only with --heavy, as CI does; slow ones only with --slow, which
adds the heavy ones), the base dir the training tests share, a fake Hugging Face hub on 127.0.0.1
for the download and hub-source tests, and Ctrl-C for the child processes."""

import hashlib
import json
import os
import re
import shutil
import signal
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


def pytest_configure(config):
    # A suite started in the background (`cmd &`, nohup) ignores SIGINT, and every child it starts
    # would too: the tests that Ctrl-C a training run need it delivered
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run tests marked slow or heavy")
    parser.addoption("--heavy", action="store_true", help="also run tests marked heavy (CI does)")


def pytest_collection_modifyitems(config, items):
    # heavy: too long for the default suite's 10 minutes, so CI runs them in a leg of their own
    run_slow = config.getoption("--slow")
    run_heavy = run_slow or config.getoption("--heavy")
    for item in items:
        if item.get_closest_marker("slow") and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --slow"))
        elif item.get_closest_marker("heavy") and not run_heavy:
            item.add_marker(pytest.mark.skip(reason="heavy: run with --heavy"))


def single_process_in(base) -> pytest.MonkeyPatch:
    """NANOMUON_BASE_DIR set to base and torchrun's variables unset, undone by .undo()."""
    mp = pytest.MonkeyPatch()
    mp.setenv("NANOMUON_BASE_DIR", str(base))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        mp.delenv(key, raising=False)
    return mp


@pytest.fixture(scope="session")
def base_template(tmp_path_factory):
    """The embedded corpus and a small tokenizer trained on it, built once a session: each
    module's base is a copy (the same files a build there would make, in a 14 s build's stead)."""
    from nanomuon.dataset import iter_texts
    from nanomuon.tokenizer import Tokenizer

    template = tmp_path_factory.mktemp("template")
    mp = single_process_in(template)
    Tokenizer.train(iter_texts("embedded", "train", 1_000_000), vocab_size=512).save(
        template / "tokenizer")
    mp.undo()
    return template


@pytest.fixture(scope="module")
def base(tmp_path_factory, base_template):
    """A NANOMUON_BASE_DIR of its module's own with the embedded corpus and the small tokenizer."""
    base = tmp_path_factory.mktemp("nanomuon")
    shutil.copytree(base_template, base, dirs_exist_ok=True)
    mp = single_process_in(base)
    yield base
    mp.undo()


class FakeHub(BaseHTTPRequestHandler):
    """Enough of the Hugging Face hub's HTTP API for huggingface_hub and datasets: repo info, tree listing, file
    resolve with Range. server.files = {repo: {path: bytes}}; server.plan[path] lists what to do on successive
    requests for a file: ok | 429 | 500 | drop (close without answering) | cut (send half the body, then close) |
    truncate (send only the first half, as if the file were shorter). server.tokens[repo] gates a repo."""
    protocol_version = "HTTP/1.1"

    def _send(self, code, body=b"", headers=(), head=False):
        self.send_response(code)
        for k, v in dict(headers).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _route(self, head=False):
        srv, url = self.server, urllib.parse.urlparse(self.path)
        path = urllib.parse.unquote(url.path)
        if self.command == "POST":
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with srv.lock:
            srv.log.append((self.command, path, self.headers.get("Range")))
        m = re.fullmatch(r"/(?:api/)?datasets/([^/]+/[^/]+)(/.*)?", path)
        repo = m and m.group(1)
        if repo not in srv.files:
            return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head)
        if repo in srv.tokens and self.headers.get("Authorization") != f"Bearer {srv.tokens[repo]}":
            return self._send(401, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"}, head)
        files, rest = srv.files[repo], m.group(2) or ""
        if path.startswith("/api/") and (not rest or rest.startswith("/revision/")):
            info = {"id": repo, "sha": srv.sha, "private": False, "siblings": [{"rfilename": f} for f in files]}
            return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
        if tree := re.fullmatch(r"/tree/[^/]+/?(.*)", rest):
            sub = tree.group(1).strip("/")
            recursive = "recursive=true" in url.query.lower()
            entries = {}
            for f, data in sorted(files.items()):
                if sub and not f.startswith(sub + "/"):
                    continue
                parts = f[len(sub) + 1 if sub else 0:].split("/")
                for i in range(1, len(parts) if recursive else min(2, len(parts))):
                    d = "/".join([sub, *parts[:i]] if sub else parts[:i])
                    entries[d] = {"type": "directory", "path": d, "oid": srv.sha, "size": 0}
                if recursive or len(parts) == 1:
                    entries[f] = {"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
            return self._send(200, json.dumps(list(entries.values())).encode(), {"Content-Type": "application/json"})
        resolve = re.fullmatch(r"/resolve/[^/]+/(.+)", rest)
        if not resolve or resolve.group(1) not in files:
            return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
        name, data = resolve.group(1), files[resolve.group(1)]
        headers = {"X-Repo-Commit": srv.sha, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if head:
            return self._send(200, data, headers, head=True)
        with srv.lock:
            plan = srv.plan.get(name)
            action = plan.pop(0) if plan else "ok"
        if action in ("429", "500"):
            return self._send(int(action), b"{}", {"Retry-After": "0"})
        if action == "drop":
            self.close_connection = True
            return
        start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0]) if self.headers.get("Range") else 0
        body = data[start:]
        if action == "truncate":
            body = body[:len(body) // 2]
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self.send_response(206 if start else 200)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[:len(body) // 2] if action == "cut" else body)
        if action == "cut":
            self.close_connection = True

    def do_GET(self):
        self._route()

    def do_HEAD(self):
        self._route(head=True)

    def do_POST(self):
        self._route()

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub(tmp_path):
    """A FakeHub on 127.0.0.1, with .env: this environment with HF_ENDPOINT pointed at it and a fresh HF_HOME,
    for the subprocesses that talk to it (huggingface_hub reads HF_ENDPOINT once, at import)."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    srv.files, srv.plan, srv.tokens, srv.log, srv.lock = {}, {}, {}, [], threading.Lock()
    srv.sha = "c0ffee" * 6 + "c0de"  # the commit every revision resolves to
    thread = threading.Thread(target=srv.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    srv.endpoint = f"http://127.0.0.1:{srv.server_address[1]}"
    srv.env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    srv.env.update(HF_ENDPOINT=srv.endpoint, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1")
    yield srv
    srv.shutdown()
    srv.server_close()
