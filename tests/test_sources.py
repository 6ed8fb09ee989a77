"""
nanomuon.sources: custom training text, checked on what the data loader reads back. Every format returns exactly
its documents; a text folder of mixed encodings decodes or skips with a count; held-out splits and --val-fraction
pick the documents an independent count says; hub sources load through datasets from the fake hub (conftest.FakeHub)
and need no network once prepared; the data loader resumes and reshards exactly on a prepared source.
"""

import csv
import json
import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_dataloader import BOS, SCALE, WordTokenizer, make_docs
from test_dataset import parquet_bytes

from nanomuon import common, sources
from nanomuon.dataloader import DataLoader, reshard_states
from nanomuon.dataset import data_dir, iter_texts, manifest_shards
from nanomuon.sources import decode, prepare

ROOT = Path(__file__).resolve().parents[1]
# commas, quotes, newlines, tabs, non-ASCII and words pandas would read as missing values
DOCS = [f'document {i}: "quoted", commas, a\nnew line,\ttab, naïve café ☃' for i in range(250)]
DOCS[5], DOCS[6], DOCS[7] = "NA", "None", "null"


@pytest.fixture(autouse=True)
def base_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOMUON_BASE_DIR", str(tmp_path / "base"))
    return tmp_path / "base"


def write(fmt: str, folder: Path, docs: list[str]) -> Path:
    """docs as one file of fmt with an id column next to the text (txt: a folder of one file per document)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"id": i, "text": t} for i, t in enumerate(docs)]
    path = folder / f"docs.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=64)
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, ["id", "text"])
            w.writeheader()
            w.writerows(rows)
    else:
        for i, t in enumerate(docs):
            (folder / f"doc_{i:04d}.txt").write_text(t, encoding="utf-8")
        return folder
    return path


def splits(name):
    return list(iter_texts(name, "train")), list(iter_texts(name, "val"))


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "json", "csv", "txt"])
def test_every_format_gives_back_exactly_its_documents(fmt, tmp_path):
    name = prepare(str(write(fmt, tmp_path / fmt, DOCS)))
    train, val = splits(name)
    # the default fraction 0.01: documents 99 and 199 (0-based), the ones whose count reaches a multiple of 100
    assert val == [DOCS[99], DOCS[199]]
    assert train == [t for i, t in enumerate(DOCS) if (i + 1) % 100]
    manifest = json.loads((data_dir(name) / "manifest.json").read_text())
    assert manifest["docs"] == {"train": 248, "val": 2} and manifest["source"] == str(write(fmt, tmp_path / fmt, DOCS))


def test_val_fraction_column_choice_and_tiny_sources(tmp_path):
    path = write("jsonl", tmp_path, DOCS[:100])
    _, val = splits(prepare(str(path), val_fraction=0.25))
    assert val == [DOCS[3], DOCS[7], DOCS[11]] + [DOCS[i] for i in range(15, 100, 4)]  # every 4th: 25 of them
    assert len(val) == 25
    assert splits(prepare(str(write("jsonl", tmp_path / "three", DOCS[:3])))) == (DOCS[:2], DOCS[2:3])  # >= 1 val
    with pytest.raises(ValueError, match="gave 0 documents with text to train on and 1 to validate on"):
        prepare(str(write("jsonl", tmp_path / "one", DOCS[:1])))
    # no `text` column: the only string column is taken, else the user picks
    (tmp_path / "body.jsonl").write_text("".join(json.dumps({"n": i, "body": t}) + "\n" for i, t in enumerate(DOCS)))
    assert sum(splits(prepare(str(tmp_path / "body.jsonl"))), []) == sum(splits(prepare(str(path))), [])[:0] + [
        t for t in DOCS if DOCS.index(t) % 100 != 99] + [DOCS[99], DOCS[199]]
    (tmp_path / "two.jsonl").write_text(json.dumps({"title": "a", "body": "b"}) + "\n")
    with pytest.raises(ValueError, match=r"has no `text` column and 2 string columns \(title, body"):
        prepare(str(tmp_path / "two.jsonl"))
    assert not list((data_dir("source/x").parent).glob("two-*")), "a failed preparation leaves no folder"


def test_text_folder_of_mixed_encodings_decodes_or_skips_with_a_count(tmp_path):
    texts = {"utf8.txt": ("naïve ☃ text", "utf-8"), "bom8.txt": ("with a BOM ☃", "utf-8-sig"),
             "utf16.txt": ("sixteen ☃ bits", "utf-16"), "utf32.txt": ("thirty-two ☃", "utf-32"),
             "win.txt": ("café – “curly” quotes", "cp1252"), "latin.txt": ("\x81 control, then ÿ", "latin-1")}
    folder = tmp_path / "mixed"
    folder.mkdir()
    for name, (text, encoding) in texts.items():
        (folder / name).write_bytes(text.encode(encoding))
    (folder / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (folder / "empty.txt").write_bytes(b"  \n")
    (folder / ".hidden.txt").write_text("never read")
    (folder / "notes.md").write_text("not a format we read")
    name = prepare(str(folder))
    train, val = splits(name)
    assert sorted(train + val) == sorted(t for t, _ in texts.values())
    counts = json.loads((data_dir(name) / "manifest.json").read_text())["counts"]
    assert counts == {"utf-8": 3, "utf-16": 1, "utf-32": 1, "cp1252": 1, "latin-1": 1, "empty": 1,
                      "skipped": [str((folder / "binary.txt").resolve())]}
    assert decode("x".encode("utf-16")[:3]) == (None, "binary")  # a BOM, then bytes that do not decode


def said(capsys, phrase):
    """The one stderr line that holds phrase."""
    lines = [line for line in capsys.readouterr().err.splitlines() if phrase in line]
    assert len(lines) == 1, f"{phrase!r} in {len(lines)} lines"
    return lines[0]


def test_files_left_out_skipped_or_guessed_at_are_named(tmp_path, capsys):
    """Files of other types, empty files (which would stop the read of every file of their format),
    binary text files with or without NULs, and text decoded from a guessed encoding: each said in a line."""
    folder = tmp_path / "mixed"
    write("jsonl", folder, DOCS[:10])
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), folder / "none.parquet")
    write("parquet", folder / "sub", DOCS[10:20])
    (folder / "zero.jsonl").write_bytes(b"")
    (folder / "blank.jsonl").write_text("\n \n")
    (folder / "notes.md").write_text("# not read")
    (folder / "tool.py").write_text("x = 1")
    (folder / "win.txt").write_bytes("café".encode("cp1252"))
    (folder / "noise.txt").write_bytes(bytes(range(1, 256)) * 8)  # no NUL, but a quarter control bytes
    train, val = splits(prepare(str(folder)))
    assert sorted(train + val) == sorted(DOCS[:20] + ["café"])
    err = capsys.readouterr().err
    assert ("left out 2 file(s) of other types (.md, .py; notes.md, tool.py): only .parquet, .jsonl, .json, "
            ".csv, .txt files are read" in err), err
    assert "skipped 3 empty file(s) (blank.jsonl, none.parquet, zero.jsonl): 0 bytes or 0 rows" in err, err
    assert "1 text file(s) not in UTF-8 read as cp1252 (win.txt)" in err, err
    assert "skipped 1 binary .txt file(s) (noise.txt)" in err, err
    (tmp_path / "void").mkdir()
    (tmp_path / "void" / "zero.jsonl").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds no documents: every file is empty \(zero.jsonl\)"):
        prepare(str(tmp_path / "void"))


def test_the_column_read_and_rows_without_it_are_said(tmp_path, capsys):
    (tmp_path / "content.jsonl").write_text("".join(json.dumps({"n": i, "content": t}) + "\n"
                                                    for i, t in enumerate(DOCS[:20])))
    assert sorted(sum(splits(prepare(str(tmp_path / "content.jsonl"))), [])) == sorted(DOCS[:20])
    assert "has no `text` column: reading its only string column 'content'" in said(capsys, "only string column")
    rows = [{"text": t} if i % 2 else {"content": t} for i, t in enumerate(DOCS)]
    (tmp_path / "half.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    name = prepare(str(tmp_path / "half.jsonl"))
    assert sorted(sum(splits(name), [])) == sorted(DOCS[1:250:2])
    line = said(capsys, "rows of")
    assert ("125 of 250 rows of the json files half.jsonl have no 'text' (missing or null) and are left out; "
            "125 of them hold text in 'content': give every row its text in 'text'") in line, line
    assert json.loads((data_dir(name) / "manifest.json").read_text())["counts"] == {"null": 125}


def test_a_sources_own_held_out_split_is_its_val(tmp_path):
    for split, docs in (("train", DOCS[:50]), ("validation", DOCS[50:60]), ("test", DOCS[60:70])):
        write("jsonl", tmp_path / "data" / split, docs)
    write("txt", tmp_path / "data" / "extra", DOCS[70:72])
    assert splits(prepare(str(tmp_path / "data"))) == (DOCS[70:72] + DOCS[:50], DOCS[50:60])  # test: in neither
    with pytest.raises(ValueError, match="has its own 'validation' split, so --val-fraction does not apply"):
        prepare(str(tmp_path / "data"), val_fraction=0.1)
    # names count below the source's folder: data/validation alone is an ordinary source ...
    assert splits(prepare(str(tmp_path / "data" / "validation"))) == (DOCS[50:59], DOCS[59:60])
    (tmp_path / "solo").mkdir()  # ... and so is a single file, whatever its name ...
    (tmp_path / "solo" / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS[:3]))
    assert splits(prepare(str(tmp_path / "solo" / "val.jsonl"))) == (DOCS[:2], DOCS[2:3])
    (tmp_path / "only").mkdir()  # ... but a folder whose every file is held out has nothing to train on
    (tmp_path / "only" / "val.txt").write_text("a")
    (tmp_path / "only" / "test.txt").write_text("b")
    with pytest.raises(ValueError, match="every file is named as held-out"):
        prepare(str(tmp_path / "only"))
    (tmp_path / "g").mkdir()
    for name in ("train-00.jsonl", "val-00.jsonl", "test_results.jsonl"):
        write("jsonl", tmp_path / "g" / name.split(".")[0], DOCS[:4])
    assert splits(prepare(str(tmp_path / "g" / "*" / "*.jsonl")))[1] == DOCS[:4]  # a glob; val- files are val


def test_prepared_once_and_again_after_an_edit(tmp_path):
    path = write("jsonl", tmp_path, DOCS)
    name = prepare(str(path))
    manifest = data_dir(name) / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    assert prepare(str(path)) == name and manifest.stat().st_mtime_ns == stamp  # cached: not converted again
    assert prepare(str(path), val_fraction=0.5) != name
    tok = WordTokenizer()
    path.write_text("".join(json.dumps({"text": f"t{k * SCALE + 1} t{k * SCALE + 2}"}) + "\n" for k in range(40)))
    edited = prepare(str(path))
    assert edited != name and splits(edited)[1] == ["t9900001 t9900002"[:0] + f"t{39 * SCALE + 1} t{39 * SCALE + 2}"]
    path.write_text("".join(json.dumps({"text": f"t{k * SCALE + 1} t{k * SCALE + 2}"}) + "\n" for k in range(41)))
    state = DataLoader(tok, edited, "train", 2, 8).state_dict()
    with pytest.raises(ValueError, match="does not match this loader .*dataset: saved 'source/"):
        DataLoader(tok, prepare(str(path)), "train", 2, 8).load_state_dict(state)  # the data changed under the run


def prepared(slug):
    """The prepared folders of a slug: prepare() names them <slug>-<12 hex>."""
    return sorted(p.name for p in data_dir("source/x").parent.glob(f"{slug}-*"))


def test_a_touch_changes_nothing_and_an_edit_is_seen_whatever_its_stamp(tmp_path, monkeypatch):
    """The preparation is keyed by contents: touching the files keeps the name (a run resumes, no
    second copy is made), and an edit is a new preparation even with size and mtime put back."""
    monkeypatch.setattr(common, "RACY_NS", 0)  # cache hashes of files written just now
    docs = [f"t{k * SCALE + 1} t{k * SCALE + 2}" for k in range(30)]  # doc k: t(k, 1) t(k, 2)
    folder = write("txt", tmp_path / "notes", docs)
    name = prepare(str(folder))
    dl = DataLoader(WordTokenizer(), name, "train", 2, 8)
    dl.next_batch()
    state = json.loads(json.dumps(dl.state_dict()))
    del dl
    for f in folder.iterdir():
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    assert prepare(str(folder)) == name and prepared("notes") == [name.split("/")[1]]
    DataLoader(WordTokenizer(), name, "train", 2, 8).load_state_dict(state)  # resumes
    f = folder / "doc_0003.txt"
    st = f.stat()
    f.write_text(f.read_text().replace("t300001", "t300009"))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    edited = prepare(str(folder))
    assert edited != name and "t300009 t300002" in splits(edited)[0]


def test_a_hash_is_read_once_until_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RACY_NS", 0)
    folder = write("txt", tmp_path / "notes", DOCS[:20])
    hashed = []
    real = sources.hashlib.blake2b
    monkeypatch.setattr(sources.hashlib, "blake2b", lambda **k: hashed.append(1) or real(**k))
    name = prepare(str(folder))
    assert len(hashed) == 20
    assert prepare(str(folder)) == name and len(hashed) == 20  # every file's hash from the cache
    os.utime(folder / "doc_0007.txt")
    assert prepare(str(folder)) == name and len(hashed) == 21  # only the touched one read again


def test_older_preparations_go_and_nothing_else(tmp_path, capsys):
    """An edit's preparation removes the one it replaces, unless a data loader holds it (then the
    next preparation does); other sources' preparations, other settings of this one, and folders
    holding anything prepare() did not write all stay."""
    folder = write("txt", tmp_path / "notes", [f"t{k} t{k + 1}" for k in range(1, 60, 2)])
    first = prepare(str(folder))
    other_setting = prepare(str(folder), val_fraction=0.5)
    other_source = prepare(str(write("txt", tmp_path / "other" / "notes", DOCS[:10])))
    root = data_dir("source/x").parent
    mine = root / "notes-0123456789ab"  # named like ours, this source's slot, one file of its own
    shutil.copytree(data_dir(first), mine)
    (mine / "my-notes.txt").write_text("keep me")
    (root / "unrelated").mkdir()
    manifest = (data_dir(first) / "manifest.json").read_text()
    (root / "unrelated" / "manifest.json").write_text(manifest)  # not a name prepare() gives

    def edit(k):
        (folder / "doc_0000.txt").write_text(f"t{k}0 t{k}1")  # doc 0 was t1 t2
        return prepare(str(folder))

    second = edit(1)
    assert data_dir(second).is_dir() and not data_dir(first).exists()
    assert f"removed {data_dir(first)}" in capsys.readouterr().err
    reader = DataLoader(WordTokenizer(), second, "train", 2, 8)
    third = edit(5)
    assert data_dir(second).is_dir(), "a folder a data loader reads stays"
    reader.next_batch()
    del reader
    assert prepare(str(folder)) == third and not data_dir(second).exists()
    for kept in (other_setting, other_source, third):
        assert manifest_shards(data_dir(kept)) is not None, kept
    assert (mine / "my-notes.txt").is_file() and (mine / "manifest.json").is_file()
    assert (root / "unrelated" / "manifest.json").is_file()


def run_python(code, hub, base, **env):
    return subprocess.run([sys.executable, "-c", code], env=dict(hub.env, NANOMUON_BASE_DIR=str(base), **env),
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_local_sources_make_no_network_call(fake_hub, tmp_path):
    path = write("jsonl", tmp_path, DOCS[:20])
    r = run_python(f"from nanomuon.sources import prepare; print(prepare({str(path)!r}))", fake_hub, tmp_path / "b")
    assert r.returncode == 0 and r.stdout.startswith("source/docs-"), r.stderr
    assert fake_hub.log == []


def test_hub_sources_through_datasets(fake_hub, tmp_path):
    def jsonl(docs):
        return "".join(json.dumps({"text": t, "label": i}) + "\n" for i, t in enumerate(docs)).encode()
    card = ("---\nconfigs:\n- config_name: small\n  data_files:\n  - split: train\n    path: small/train.jsonl\n"
            "  - split: test\n    path: small/test.jsonl\n---\n# a dataset\n")
    fake_hub.files["owner/name"] = {
        "data/train-00000-of-00002.parquet": parquet_bytes(DOCS[:100]),
        "data/train-00001-of-00002.parquet": parquet_bytes(DOCS[100:200]),
        "data/validation-00000-of-00001.parquet": parquet_bytes(DOCS[200:220])}
    fake_hub.files["owner/cards"] = {"README.md": card.encode(), "small/train.jsonl": jsonl(DOCS[:30]),
                                     "small/test.jsonl": jsonl(DOCS[30:35])}
    code = ("import json; from nanomuon.sources import prepare; from nanomuon.dataset import iter_texts\n"
            "names = [prepare(s) for s in ('hf:owner/name', 'hf:owner/cards:small')]\n"
            "print(json.dumps([[n, list(iter_texts(n, 'train')), list(iter_texts(n, 'val'))] for n in names]))")
    r = run_python(code, fake_hub, tmp_path / "b")
    assert r.returncode == 0, r.stderr
    (name, train, val), (_, small_train, small_val) = json.loads(r.stdout)
    assert (train, val) == (DOCS[:200], DOCS[200:220])  # its own validation split
    assert (small_train, small_val) == (DOCS[:30], DOCS[30:35])  # a config, with a test split as val
    manifest = json.loads((tmp_path / "b" / "data" / name / "manifest.json").read_text())
    assert manifest["revision"] == fake_hub.sha and manifest["val_split"] == "its 'validation' split"
    fake_hub.log.clear()  # prepared: no network call the second time
    r = run_python(code, fake_hub, tmp_path / "b")
    assert r.returncode == 0 and json.loads(r.stdout)[0][0] == name and fake_hub.log == [], r.stderr


@pytest.mark.heavy
def test_hub_source_errors_are_one_line(fake_hub, tmp_path):
    fake_hub.files["owner/gated"] = {"data/train.jsonl": b'{"text": "x"}\n{"text": "y"}\n'}
    fake_hub.tokens["owner/gated"] = "sesame"
    cases = [("hf:owner/missing", {}, "check the name and HF_ENDPOINT"),
             ("hf:owner/gated", {}, "set HF_TOKEN to a token that can read it"),
             ("hf:owner/gated", {"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set: unset it, or train offline")]
    for spec, env, fix in cases:
        r = subprocess.run([sys.executable, "-m", "scripts.tok_train", "--dataset", spec],
                           env=dict(fake_hub.env, NANOMUON_BASE_DIR=str(tmp_path / "b"), **env), capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and lines[-1].startswith(f"error: cannot load {spec} from {fake_hub.endpoint}: ")
        assert fix in lines[-1] and "Traceback" not in r.stderr, r.stderr
    r = run_python("from nanomuon.sources import prepare; print(prepare('hf:owner/gated'))", fake_hub,
                   tmp_path / "b", HF_TOKEN="sesame")
    assert r.returncode == 0 and r.stdout.startswith("source/gated-"), r.stderr


def tokens_by_epoch(dl, batches):
    """(doc, position) of every token of `batches` batches, by the epoch of its row."""
    out = {}
    for _ in range(batches):
        x, y = dl.next_batch()
        for row, epoch in zip(torch.cat([x, y[:, -1:]], dim=1).tolist(), dl.batch_epochs):
            out.setdefault(epoch, []).extend(divmod(t, SCALE) for t in row if t not in (BOS, -1))
    return out


def test_exact_resume_and_reshard_on_a_custom_source(tmp_path):
    docs = make_docs(0, 150, seed=3, huge_at=20)
    path = write("jsonl", tmp_path, docs)
    name = prepare(str(path), val_fraction=0.02)  # documents 49, 99 and 149 are val
    train_ids = [k for k in range(150) if k not in (49, 99, 149)]
    tok = WordTokenizer()
    make = lambda rank=0, world=1: DataLoader(tok, name, "train", 2, 48, rank, world, buffer_size=12,
                                              tokenize_batch=16, chunk_chars=500)
    a = make()
    tokens_by_epoch(a, 7)
    b = make()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for _ in range(5):
        assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch()))
    # 2 ranks read unevenly, then 3 ranks go on from their states: epoch 0 trains every token exactly once
    seen, states = [], []
    for rank, n in enumerate((9, 4)):
        dl = make(rank, 2)
        seen += tokens_by_epoch(dl, n).get(0, [])
        states.append(json.loads(json.dumps(dl.state_dict())))
    for rank in range(3):
        dl = make(rank, 3)
        dl.load_state_dict(reshard_states(states, rank, 3))
        while (got := tokens_by_epoch(dl, 1)) and 1 not in got:
            seen += got.get(0, [])
        seen += got.get(0, [])
    expected = Counter((k, p) for k in train_ids for p in range(len(docs[k].split()) + 1))
    assert Counter(seen) == expected, (sorted((expected - Counter(seen)).items())[:5])


def test_base_train_and_base_eval_on_a_custom_source(base, base_dir, tmp_path, capsys):
    """The scripts end to end on a jsonl file: base_eval, named the run's source (it reads no custom
    source a checkpoint names on its own), scores the run's own val documents, and a resume with
    another --val-fraction (other val documents, other training data) is refused."""
    from test_train import TINY

    from scripts.base_eval import main as eval_main
    from scripts.base_train import main as train_main

    base_dir.mkdir(parents=True)
    (base_dir / "tokenizer").symlink_to(base / "tokenizer")
    path = write("jsonl", tmp_path, [d * 3 for d in DOCS])
    flags = [*TINY, "--dataset", str(path), "--val-fraction", "0.1", "--total-batch-size", "256",
             "--num-iterations", "2", "--run", "mine"]
    train_main(flags)
    summary = json.loads((base_dir / "runs" / "mine" / "summary.json").read_text())
    bpb = eval_main(["--run", "mine", "--device-type", "cpu", "--device-batch-size", "4", "--sample-tokens",
                     "0", "--dataset", str(path), "--val-fraction", "0.1"])
    assert bpb == pytest.approx(summary["final_val_bpb"], rel=1e-5)
    assert f"{path} val bpb" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--val-fraction was 0\.1, now 0\.2"):
        train_main([*flags[:-6], "--val-fraction", "0.2", *flags[-6:], "--resume-from-step", "2"])


def test_hub_sources_refuse_plain_http_to_another_host(fake_hub, tmp_path):
    """--dataset hf:owner/name fetches through HF_ENDPOINT, so it passes the same check as the
    shard downloads: plain http to another machine is refused in one line before any request."""
    fake_hub.files["owner/name"] = {"data/train.jsonl": b'{"text": "x"}\n'}
    r = run_python("from nanomuon.sources import prepare; print(prepare('hf:owner/name'))", fake_hub,
                   tmp_path / "b", HF_ENDPOINT="http://hub.example.com")
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith(
        "ValueError: HF_ENDPOINT http://hub.example.com is not https, so the data could be altered"), r.stderr
    assert fake_hub.log == []


def test_a_file_size_limit_while_preparing_is_one_line(tmp_path):
    """Preparing a source that reaches the file-size limit (ulimit -f) stops in one line saying what
    filled up and that nothing half-prepared is kept; the source stays as it was."""
    import resource

    rng = random.Random(0)  # text zstd cannot squeeze under the limit
    docs = [" ".join(f"{rng.getrandbits(32):x}" for _ in range(500)) for _ in range(40)]
    path = write("jsonl", tmp_path / "src", docs)
    before = path.read_bytes()
    limit = 8192  # under one shard of these documents, over the source's hash list

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    r = subprocess.run([sys.executable, "-m", "scripts.tok_train", "--dataset", str(path)], cwd=ROOT,
                       env=dict(os.environ, NANOMUON_BASE_DIR=str(tmp_path / "b")), timeout=300,
                       capture_output=True, text=True, preexec_fn=limited)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot prepare {path}: a file in {tmp_path / 'b'}"), last
    assert f"file-size limit ({limit:,} bytes, ulimit -f); the half-prepared" in last, last
    assert "ulimit -f unlimited" in last and path.read_bytes() == before
    assert not list((tmp_path / "b" / "data" / "source").glob("docs-*"))
