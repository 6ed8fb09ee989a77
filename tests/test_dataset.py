"""
nanomuon.dataset: the embedded stdlib corpus, shard listing and reading, and the FineWeb-Edu downloader
run against a real local HTTP server that fails, drops, cuts short and corrupts responses on demand.
"""

import collections
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanomuon.common import get_base_dir
from nanomuon.dataset import (
    DATASETS,
    MAX_SHARD,
    build_embedded,
    data_dir,
    download,
    ensure_embedded,
    iter_texts,
    list_shards,
    main,
    shard_name,
    stdlib_sources,
)


@pytest.fixture(autouse=True)
def base_dir(tmp_path, monkeypatch):
    """Every test gets its own base dir, so nothing touches ~/.cache."""
    base = tmp_path / "base"
    monkeypatch.setenv("NANOMUON_BASE_DIR", str(base))
    return base


def parquet_bytes(texts, row_group_size=1024):
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": pa.array(texts, type=pa.string())}), buf, row_group_size=row_group_size)
    return buf.getvalue()


def read_texts(path):
    return pq.read_table(path).column("text").to_pylist()


def source_texts(paths):
    texts = (p.read_bytes().decode("utf-8", errors="replace") for p in paths)
    return collections.Counter(t for t in texts if t.strip())


# -- locations ----------------------------------------------------------------------------------------

def test_base_dir_and_data_dir(base_dir):
    assert not base_dir.exists()
    assert get_base_dir() == base_dir and base_dir.is_dir()
    assert data_dir("fineweb-edu") == base_dir / "data" / "fineweb-edu"
    assert DATASETS == ("fineweb-edu", "embedded")
    with pytest.raises(ValueError, match="unknown dataset 'owt'.*fineweb-edu, embedded"):
        data_dir("owt")


# -- embedded corpus -----------------------------------------------------------------------------------

def test_stdlib_sources():
    files = stdlib_sources()
    names = {f.as_posix() for f in files}
    assert len(files) > 500 and files == sorted(files)
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "dist-packages" in f.parts for f in files)
    assert any(n.endswith("/os.py") for n in names) and any(n.endswith("/json/__init__.py") for n in names)


def test_build_embedded_is_deterministic_and_covers_the_stdlib(tmp_path):
    a = build_embedded(tmp_path / "a")
    b = build_embedded(tmp_path / "b")
    assert [p.name for p in a] == [shard_name(i) for i in range(len(a))] and len(a) >= 2
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    # Every non-empty stdlib file is exactly one document, none twice, none altered.
    docs = [t for p in a for t in read_texts(p)]
    assert collections.Counter(docs) == source_texts(stdlib_sources())
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["files"] == len(docs) and manifest["chars"] == sum(map(len, docs))
    assert manifest["shards"] == [p.name for p in a] and manifest["val_shard"] == a[-1].name
    assert "standard library" in (tmp_path / "a" / "README.txt").read_text()
    # Shuffled, so the val shard samples the whole library rather than the last packages in sort order.
    assert docs != sorted(docs)
    assert not list((tmp_path / "a").glob("*.tmp"))


def test_build_embedded_shard_sizes_and_rebuild(tmp_path):
    sources = stdlib_sources()[:150]
    out = tmp_path / "small"
    shards = build_embedded(out, shard_chars=100_000, sources=sources)
    total = sum(source_texts(sources)[t] * len(t) for t in source_texts(sources))
    assert 2 <= len(shards) <= -(-total // 100_000)  # fewer when one long document spans a whole shard
    for p in shards:
        texts = read_texts(p)
        # near-equal shards, cut between documents: over shard_chars by at most one document
        assert sum(map(len, texts)) <= 100_000 + max(map(len, texts))
        assert pq.ParquetFile(p).metadata.num_row_groups == -(-len(texts) // 1024)
    # A rebuild with bigger shards leaves no stale shard of the old build behind.
    fewer = build_embedded(out, shard_chars=400_000, sources=sources)
    assert sorted(out.glob("*.parquet")) == fewer and len(fewer) < len(shards)
    assert collections.Counter(t for p in fewer for t in read_texts(p)) == source_texts(sources)
    with pytest.raises(ValueError, match="at least 2 non-empty documents"):
        build_embedded(tmp_path / "tiny", sources=sources[:1])


def test_ensure_embedded_builds_on_demand_and_redoes_interrupted_builds(base_dir):
    d = base_dir / "data" / "embedded"
    train, val = list_shards("embedded", "train"), list_shards("embedded", "val")  # builds on first use
    assert ensure_embedded() == d
    assert train + val == sorted(d.glob("*.parquet")) and len(val) == 1 and val[0] == max(train + val)
    stamp = [p.stat().st_mtime_ns for p in train + val]
    assert ensure_embedded() == d and [p.stat().st_mtime_ns for p in train + val] == stamp  # no rebuild

    (d / "manifest.json").unlink()  # as if the build died before its last write
    train[0].write_bytes(b"half a shard")
    ensure_embedded()
    assert (d / "manifest.json").exists() and read_texts(train[0])  # rebuilt
    val[0].unlink()  # a shard named in the manifest went missing
    assert list_shards("embedded", "val") == val and val[0].exists()


def test_embedded_cli(base_dir, capsys):
    main(["--embedded", "--shard-chars", "8000000"])
    out = capsys.readouterr().out
    assert "stdlib files" in out and "train + 1 val" in out
    assert len(list(data_dir("embedded").glob("*.parquet"))) == 4


# -- listing and reading -------------------------------------------------------------------------------

def test_list_shards_splits_train_val_and_errors_with_the_fix(base_dir):
    d = base_dir / "data" / "fineweb-edu"
    for name in ("fineweb-edu", "nope"):
        for split in ("train", "val"):
            if name == "nope":
                with pytest.raises(ValueError, match="unknown dataset"):
                    list_shards(name, split)
            else:
                with pytest.raises(FileNotFoundError, match=r"found 0: run `python -m nanomuon.dataset -n 8`.*"
                                                            r"--dataset embedded"):
                    list_shards(name, split)
    d.mkdir(parents=True)
    (d / shard_name(0)).write_bytes(parquet_bytes(["a"]))
    (d / f"{shard_name(1)}.part").write_bytes(b"partial")  # in-flight files are not shards
    (d / f"{shard_name(2)}.123.tmp").write_bytes(b"partial")
    with pytest.raises(FileNotFoundError, match=f"at least 2 shards.*in {d}, found 1"):
        list_shards("fineweb-edu", "train")
    for i in (5, MAX_SHARD, 1):
        (d / shard_name(i)).write_bytes(parquet_bytes([str(i)]))
    assert list_shards("fineweb-edu", "train") == [d / shard_name(i) for i in (0, 1, 5)]
    assert list_shards("fineweb-edu", "val") == [d / shard_name(MAX_SHARD)]
    with pytest.raises(ValueError, match="unknown split 'test'"):
        list_shards("fineweb-edu", "test")


def test_iter_texts_order_row_groups_and_max_chars(base_dir):
    d = base_dir / "data" / "fineweb-edu"
    d.mkdir(parents=True)
    docs = [f"doc{i:02d}-" + "x" * i for i in range(20)]
    (d / shard_name(0)).write_bytes(parquet_bytes(docs[:7], row_group_size=3))
    (d / shard_name(1)).write_bytes(parquet_bytes(docs[7:15], row_group_size=3))
    (d / shard_name(2)).write_bytes(parquet_bytes(docs[15:]))
    assert pq.ParquetFile(d / shard_name(0)).num_row_groups == 3
    assert list(iter_texts("fineweb-edu", "train")) == docs[:15]
    assert list(iter_texts("fineweb-edu", "val")) == docs[15:]
    # max_chars is a hard budget: whole documents, then the last one cut to fit.
    budget = len(docs[0]) + len(docs[1]) + 4
    assert list(iter_texts("fineweb-edu", "train", max_chars=budget)) == [docs[0], docs[1], docs[2][:4]]
    exact = sum(map(len, docs[:8]))
    assert list(iter_texts("fineweb-edu", "train", max_chars=exact)) == docs[:8]
    assert list(iter_texts("fineweb-edu", "train", max_chars=0)) == []
    assert "".join(iter_texts("fineweb-edu", "train", max_chars=10**9)) == "".join(docs[:15])
    with pytest.raises(ValueError, match="max_chars"):
        list(iter_texts("fineweb-edu", "train", max_chars=-1))


# -- download ------------------------------------------------------------------------------------------

class ShardHandler(BaseHTTPRequestHandler):
    """Serves server.files by name. server.plan[name] lists what to do on successive requests:
    ok | 503 | drop (close without answering) | cut (send half the body, then close) | norange (ignore Range)."""

    def do_GET(self):
        srv = self.server
        name = self.path.rsplit("/", 1)[-1]
        rng = self.headers.get("Range")
        with srv.lock:
            srv.log.append((name, rng, self.headers.get("User-Agent")))
            plan = srv.plan.get(name)
            action = plan.pop(0) if plan else "ok"
        if name not in srv.files:
            return self.send_error(404)
        if action == "503":
            return self.send_error(503, "busy")
        if action == "drop":
            self.close_connection = True
            return
        data, start = srv.files[name], 0
        if rng and action != "norange":
            start = int(rng.removeprefix("bytes=").rstrip("-"))
            if start >= len(data):
                return self.send_error(416)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if action == "cut":
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), ShardHandler)
    srv.files, srv.plan, srv.log, srv.lock = {}, {}, [], threading.Lock()
    for i in (0, 1, 2, MAX_SHARD):  # ~30-60 KB each, so a cut lands mid-file
        srv.files[shard_name(i)] = parquet_bytes([f"shard {i} doc {j} " * (i % 7 + 40) for j in range(60)])
    thread = threading.Thread(target=srv.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/files"
    yield srv
    srv.shutdown()
    srv.server_close()


def requests_for(srv, name):
    return [(rng, ua) for n, rng, ua in srv.log if n == name]


def test_download_fetches_train_and_val_shards(server, base_dir, capsys):
    paths = download(2, base_url=server.url, allow_http=True, workers=2, backoff=0)
    d = base_dir / "data" / "fineweb-edu"
    assert paths == [d / shard_name(i) for i in (0, 1, MAX_SHARD)]
    for p in paths:
        assert p.read_bytes() == server.files[p.name]
    assert not list(d.glob("*.part"))
    assert all(ua.startswith("nanomuon") for _, _, ua in server.log) and len(server.log) == 3
    assert list_shards("fineweb-edu", "val") == [d / shard_name(MAX_SHARD)]
    out = capsys.readouterr().out
    assert "[3/3]" in out and "MB" in out and "done: 3 shards" in out


def test_download_retries_503_and_dropped_connections(server, tmp_path):
    server.plan = {shard_name(0): ["503", "drop", "503"], shard_name(MAX_SHARD): ["drop"]}
    paths = download(1, tmp_path, base_url=server.url, allow_http=True, backoff=0)
    assert [p.read_bytes() for p in paths] == [server.files[p.name] for p in paths]
    assert len(requests_for(server, shard_name(0))) == 4
    assert len(requests_for(server, shard_name(MAX_SHARD))) == 2


def test_download_resumes_a_cut_response_with_range(server, tmp_path):
    name = shard_name(0)
    server.plan = {name: ["cut", "cut"]}
    download(1, tmp_path, base_url=server.url, allow_http=True, backoff=0)
    size = len(server.files[name])
    ranges = [rng for rng, _ in requests_for(server, name)]
    # 1st: whole file, cut at half; 2nd: resumes at half, cut at half of the rest; 3rd: resumes and completes.
    assert ranges == [None, f"bytes={size // 2}-", f"bytes={size // 2 + (size - size // 2) // 2}-"]
    assert (tmp_path / name).read_bytes() == server.files[name]
    assert not (tmp_path / f"{name}.part").exists()


def test_download_restarts_when_the_server_ignores_range(server, tmp_path):
    name = shard_name(0)
    server.plan = {name: ["cut", "norange"]}
    download(1, tmp_path, base_url=server.url, allow_http=True, backoff=0)
    assert [rng is not None for rng, _ in requests_for(server, name)] == [False, True]
    assert (tmp_path / name).read_bytes() == server.files[name]  # the 200 overwrote the partial file


def test_download_resumes_a_part_left_by_an_earlier_run(server, tmp_path):
    name, data = shard_name(1), server.files[shard_name(1)]
    (tmp_path / f"{name}.part").write_bytes(data[:1000])
    (tmp_path / f"{shard_name(0)}.part").write_bytes(server.files[shard_name(0)])  # complete but not renamed
    download(2, tmp_path, base_url=server.url, allow_http=True, backoff=0)
    assert requests_for(server, name)[0][0] == "bytes=1000-"
    assert requests_for(server, shard_name(0))[0][0] == f"bytes={len(server.files[shard_name(0)])}-"
    assert (tmp_path / name).read_bytes() == data
    assert (tmp_path / shard_name(0)).read_bytes() == server.files[shard_name(0)]  # via 416, then validated


def test_download_rejects_a_corrupt_file_after_retries(server, tmp_path, capsys):
    name = shard_name(MAX_SHARD)
    server.files[name] = b"<html>rate limited</html>" * 100
    with pytest.raises(RuntimeError) as err:
        download(1, tmp_path, base_url=server.url, allow_http=True, retries=2, backoff=0)
    msg = str(err.value)
    assert name in msg and f"{server.url}/{name}" in msg and "3 attempts" in msg
    assert "corrupt download: the file is not a readable parquet file" in msg
    assert "re-run the same command to resume" in msg
    assert len(requests_for(server, name)) == 3
    assert all(rng is None for rng, _ in requests_for(server, name))  # a corrupt .part is never resumed
    assert not (tmp_path / name).exists() and not (tmp_path / f"{name}.part").exists()
    assert (tmp_path / shard_name(0)).exists()  # the good shard still landed
    # parquet but without a text column is rejected too
    buf = io.BytesIO()
    pq.write_table(pa.table({"content": ["x"]}), buf)
    server.files[name] = buf.getvalue()
    with pytest.raises(RuntimeError, match="no 'text' column"):
        download(1, tmp_path, base_url=server.url, allow_http=True, retries=0, backoff=0)
    buf = io.BytesIO()  # and a text column of numbers
    pq.write_table(pa.table({"text": [1, 2]}), buf)
    server.files[name] = buf.getvalue()
    with pytest.raises(RuntimeError, match="column 'text' holds int64, not strings"):
        download(1, tmp_path, base_url=server.url, allow_http=True, retries=0, backoff=0)


def test_download_skips_shards_already_present(server, tmp_path, capsys):
    kept = parquet_bytes(["already here"])
    (tmp_path / shard_name(0)).write_bytes(kept)
    (tmp_path / shard_name(MAX_SHARD)).write_bytes(kept)
    paths = download(2, tmp_path, base_url=server.url, allow_http=True, backoff=0)
    assert [n for n, _, _ in server.log] == [shard_name(1)]
    assert len(paths) == 3 and (tmp_path / shard_name(0)).read_bytes() == kept
    assert capsys.readouterr().out.count("already present") == 2


def test_download_errors(server, tmp_path):
    for n in (0, MAX_SHARD + 1):
        with pytest.raises(ValueError, match=f"num_shards must be in 1..{MAX_SHARD}"):
            download(n, tmp_path, base_url=server.url, allow_http=True)
    # A 404 will not change on a retry: fail at once, naming the URL.
    with pytest.raises(RuntimeError, match=r"shard_00003.parquet: HTTP 404 .*/files/shard_00003.parquet"):
        download(4, tmp_path, base_url=server.url, allow_http=True, backoff=0)
    assert len(requests_for(server, shard_name(3))) == 1
    # Nothing listening: network errors are retried, then reported.
    with pytest.raises(RuntimeError, match=r"2 attempts, last error: URLError.*re-run"):
        download(1, tmp_path / "x", base_url="http://127.0.0.1:9/files", allow_http=True, retries=1, backoff=0)


def test_download_cli(server, base_dir, capsys):
    with pytest.raises(SystemExit, match="is not https, so the shards could be altered in transit"):
        main(["-n", "2", "--base-url", server.url])
    main(["-n", "2", "--workers", "2", "--base-url", server.url, "--allow-http"])
    assert "done: 3 shards" in capsys.readouterr().out
    assert len(list_shards("fineweb-edu", "train")) == 2
    with pytest.raises(SystemExit, match="error: shard_00003.parquet: HTTP 404"):
        main(["-n", "4", "--base-url", server.url, "--allow-http"])


def test_download_backs_off_exponentially(server, tmp_path):
    server.plan = {shard_name(0): ["503", "503"]}
    t0 = time.perf_counter()
    download(1, tmp_path, base_url=server.url, allow_http=True, retries=2, backoff=0.3)
    assert time.perf_counter() - t0 >= 0.3 + 0.3**2  # waits backoff**1, then backoff**2
    assert (tmp_path / shard_name(0)).read_bytes() == server.files[shard_name(0)]
