"""
nanomuon.dataset: the embedded stdlib corpus, shard listing and reading, and the FineWeb-Edu downloader run
through huggingface_hub against a fake hub (conftest.FakeHub) that fails, drops, cuts short, truncates and
corrupts responses on demand.
"""

import base64
import collections
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanomuon.common import get_base_dir
from nanomuon.dataset import (
    DATASETS,
    HF_REPO,
    HUB_DATASETS,
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
    assert DATASETS == ("fineweb-edu", "climbmix", "embedded")
    assert data_dir("climbmix") == base_dir / "data" / "climbmix"
    with pytest.raises(ValueError, match="unknown dataset 'owt'.*fineweb-edu, climbmix, embedded"):
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


# -- download: through huggingface_hub, against a fake hub that fails on demand ---------------------------

@pytest.fixture
def hub(fake_hub):
    fake_hub.files[HF_REPO] = {shard_name(i): parquet_bytes([f"shard {i} doc {j} " * (i % 7 + 40) for j in range(60)])
                               for i in (0, 1, 2, MAX_SHARD)}  # ~30-60 KB each, so a cut lands mid-file
    return fake_hub


def fetch(hub, out, n=2, *flags, env=()):
    """python -m nanomuon.dataset in a subprocess: huggingface_hub reads HF_ENDPOINT once, at import."""
    return subprocess.run([sys.executable, "-m", "nanomuon.dataset", "-n", str(n), "--out-dir", str(out),
                           "--backoff", "0.01", *flags], env=dict(hub.env, **dict(env)), capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])


def gets(hub, name):
    return [rng for method, path, rng in hub.log if method == "GET" and path.endswith("/" + name)]


def test_download_fetches_train_and_val_shards_from_a_pinned_revision(hub, tmp_path):
    out = tmp_path / "fw"
    r = fetch(hub, out)
    assert r.returncode == 0, r.stderr
    files = hub.files[HF_REPO]
    assert sorted(out.glob("*.parquet")) == [out / shard_name(i) for i in (0, 1, MAX_SHARD)]
    assert all(p.read_bytes() == files[p.name] for p in out.glob("*.parquet"))
    assert (out / "revision.txt").read_text().strip() == hub.sha  # main, resolved once and recorded
    assert all(f"/resolve/{hub.sha}/" in path for method, path, _ in hub.log if "/resolve/" in path)
    assert "[3/3]" in r.stdout and "done: 3 shards" in r.stdout and hub.sha[:12] in r.stdout
    hub.log.clear()
    r = fetch(hub, out, 3)  # the revision comes from revision.txt: no repo-info call, only the new shard
    assert r.returncode == 0 and r.stdout.count("already present") == 3
    assert {path for _, path, _ in hub.log} == {f"/datasets/{HF_REPO}/resolve/{hub.sha}/{shard_name(2)}"}


def test_download_survives_429_500_drops_cuts_and_truncated_transfers(hub, tmp_path):
    a, b = shard_name(0), shard_name(MAX_SHARD)
    # over 10 MB, huggingface_hub's write chunk, so that a cut at half leaves bytes on disk to resume from
    hub.files[HF_REPO][a] = parquet_bytes([base64.b64encode(os.urandom(1 << 20)).decode() for _ in range(16)])
    hub.plan = {a: ["429", "500", "cut"], b: ["drop", "truncate"]}
    r = fetch(hub, tmp_path, 1)
    assert r.returncode == 0, r.stderr
    assert all((tmp_path / n).read_bytes() == hub.files[HF_REPO][n] for n in (a, b))
    assert gets(hub, a) == [None, None, None, f"bytes={10 << 20}-"]  # the cut transfer resumed where it broke
    assert len(gets(hub, b)) >= 3 and not hub.plan[a] and not hub.plan[b]


@pytest.mark.heavy
def test_download_rejects_a_corrupt_file_after_retries(hub, tmp_path):
    name = shard_name(MAX_SHARD)
    hub.files[HF_REPO][name] = b"<html>rate limited</html>" * 100
    r = fetch(hub, tmp_path, 1, "--retries", "2")
    assert r.returncode != 0
    msg = r.stderr.strip().splitlines()[-1]
    assert msg.startswith(f"error: {name}: download failed after 3 attempts") and "re-run the same command" in msg
    assert "corrupt download: the file is not a readable parquet file" in msg
    assert len(gets(hub, name)) == 3 and not (tmp_path / name).exists()
    assert (tmp_path / shard_name(0)).read_bytes() == hub.files[HF_REPO][shard_name(0)]  # the good shard landed
    buf = io.BytesIO()  # parquet whose text column holds numbers: rejected too
    pq.write_table(pa.table({"text": [1, 2]}), buf)
    hub.files[HF_REPO][name] = buf.getvalue()
    r = fetch(hub, tmp_path, 1, "--retries", "0")
    assert "column 'text' holds int64, not strings" in r.stderr


@pytest.mark.heavy
def test_download_errors_name_the_fix(hub, tmp_path):
    r = fetch(hub, tmp_path, 4)  # shard 3 is not on this hub: a 404 fails at once
    assert r.returncode != 0 and "error: shard_00003.parquet: HTTP 404" in r.stderr
    assert "check the name and HF_ENDPOINT (shards are 0..1822)" in r.stderr and len(gets(hub, shard_name(3))) == 0
    hub.tokens[HF_REPO] = "sesame"  # gated: HF_TOKEN is honoured
    r = fetch(hub, tmp_path / "gated", 1)
    assert r.returncode != 0 and "HF_TOKEN" in r.stderr.strip().splitlines()[-1]
    r = fetch(hub, tmp_path / "gated", 1, env={"HF_TOKEN": "sesame"})
    assert r.returncode == 0, r.stderr
    r = fetch(hub, tmp_path / "offline", 1, env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        "error: HF_HUB_OFFLINE is set, so nothing can be downloaded: unset it, or train offline with --dataset "
        "embedded (run `python -m nanomuon.dataset -n 8` to download them, or train on the embedded corpus with "
        "--dataset embedded)"]
    r = fetch(hub, tmp_path / "plain", 1, env={"HF_ENDPOINT": "http://mirror.example"})
    assert "HF_ENDPOINT http://mirror.example is not https" in r.stderr and "--allow-http" in r.stderr
    r = fetch(hub, tmp_path / "dead", 1, env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "cannot reach karpathy/fineweb-edu-100b-shuffle on http://127.0.0.1:9" in r.stderr
    for n in (0, MAX_SHARD + 1):
        with pytest.raises(ValueError, match=f"num_shards must be in 1..{MAX_SHARD}"):
            download(n, tmp_path)


def test_no_network_unless_a_download_is_asked_for(hub, tmp_path):
    r = subprocess.run([sys.executable, "-c", "from nanomuon.dataset import iter_texts, list_shards; "
                        "print(len(list(iter_texts('embedded', 'val'))))"], env=dict(hub.env, NANOMUON_BASE_DIR=str(
                            tmp_path)), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and int(r.stdout) > 0, r.stderr
    assert hub.log == []


@pytest.mark.heavy
def test_climbmix_downloads_like_fineweb_edu_from_its_own_repo(fake_hub, tmp_path):
    """nanochat's current data: karpathy/climbmix-400b-shuffle, shards 0..6542, the last one val,
    through the same pinned, resumable, parallel path as fineweb-edu."""
    repo, last = HUB_DATASETS["climbmix"]
    assert (repo, last) == ("karpathy/climbmix-400b-shuffle", 6542)
    fake_hub.files[repo] = {shard_name(i): parquet_bytes([f"climbmix {i} doc {j}" for j in range(50)])
                            for i in (0, 1, last)}
    out = tmp_path / "cm"
    r = fetch(fake_hub, out, 2, "--dataset", "climbmix")
    assert r.returncode == 0, r.stderr
    assert sorted(out.glob("*.parquet")) == [out / shard_name(i) for i in (0, 1, last)]
    assert all(p.read_bytes() == fake_hub.files[repo][p.name] for p in out.glob("*.parquet"))
    assert (out / "revision.txt").read_text().strip() == fake_hub.sha
    assert f"climbmix: 2 train shards + 1 val shard ({last}) of {repo}@" in r.stdout
    assert all(repo in path for _, path, _ in fake_hub.log), fake_hub.log
    r = fetch(fake_hub, tmp_path / "cm2", 3, "--dataset", "climbmix")  # shard 2 is not there
    assert r.returncode != 0 and f"(shards are 0..{last})" in r.stderr
    r = fetch(fake_hub, tmp_path / "off", 1, "--dataset", "climbmix", env={"HF_HUB_OFFLINE": "1"})
    assert "`python -m nanomuon.dataset -n 8 --dataset climbmix`" in r.stderr
    with pytest.raises(ValueError, match=f"num_shards must be in 1..{last}"):
        download(last + 1, tmp_path, dataset="climbmix")
    with pytest.raises(ValueError, match="unknown hub dataset 'embedded'"):
        download(1, tmp_path, dataset="embedded")


def test_climbmix_missing_names_its_download(base_dir):
    with pytest.raises(FileNotFoundError, match="python -m nanomuon.dataset -n 8 --dataset climbmix"):
        list_shards("climbmix", "train")
