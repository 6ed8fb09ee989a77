"""
Training text from anywhere: `--dataset` as a local file, directory or glob of parquet, jsonl,
json, txt or csv files, or any Hugging Face dataset as hf:owner/name[:config][@revision].
prepare() converts a source once into dataset.py's layout (parquet shards of column `text`, listed
by a manifest), so the data loader's exact resume and resharding, which count documents, work
alike for every source. docs/data.md, "Your own data", tells how the text column, the val split,
the cache and the text encodings are chosen.
"""

import argparse
import codecs
import contextlib
import glob
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from nanomuon.common import (
    content_hashes,
    filled,
    get_base_dir,
    load_json,
    one_line,
    shown,
    what_filled,
    write_atomic,
)
from nanomuon.dataset import (
    DATASETS,
    MANIFEST,
    MANIFEST_BYTES,
    build_lock,
    check_endpoint,
    data_dir,
    hub_problem,
    manifest_shards,
)

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".txt": "text"}
HELD_OUT = ("validation", "valid", "val", "dev", "test")  # a source's own val split: the first
DEFAULT_VAL_FRACTION = 0.01
SHARD_CHARS = 32_000_000  # per prepared shard: ~30 MB of parquet, ~100 MB of strings to write
VERSION = 1  # of the prepared layout; part of the cache key
HASHES = ".hashes.json"  # in data/source: path -> [size, mtime, ctime, inode, content hash]
IN_USE = ".in-use"  # in a prepared folder: its data loaders hold a shared flock on it
PREPARED = re.compile(r"[\w.-]+-[0-9a-f]{12}")  # the folders prepare() names
HUB = re.compile(r"hf:([\w.-]+/[\w.-]+)(?::([^@]+))?(?:@(.+))?")
# 32 first: its LE BOM starts like 16's
BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
        (codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"),
        (codecs.BOM_UTF16_BE, "utf-16"))
SPEC_HELP = ("fineweb-edu, climbmix, embedded, a local file, directory or glob of .parquet, .jsonl, "
             ".json, .txt or .csv files, or hf:owner/name[:config][@revision]")
# bytes no text file holds (but \t \n \v \f \r); Latin-1 also decodes C1 controls from 0x80-0x9f
CONTROL = bytes([*range(9), *range(14, 32), 127])
BINARY_SHARE = 0.1  # of control bytes: over it a file is binary, not text


def add_data_args(p, default: str) -> None:
    """--dataset, --text-column and --val-fraction, alike in every script that reads text."""
    p.add_argument("--dataset", type=dataset_arg, default=default,
                   help=f"training text: {SPEC_HELP} (docs/data.md, 'Your own data')")
    p.add_argument("--text-column", default=None, help="custom sources: the column holding the "
                   "documents (default: `text`, else the only string column)")
    p.add_argument("--val-fraction", type=float, default=None,
                   help="custom sources without a validation split: the fraction of documents "
                   f"held out (default {DEFAULT_VAL_FRACTION}, at least one document)")


def spec_problem(spec: str) -> str | None:
    """What makes --dataset name no source before anything reads it, else None."""
    if not spec.strip():  # "$DATA" of an unset variable; as a path it would be the current folder
        return f"an empty value (an unset variable?); expected {SPEC_HELP}"
    if spec.startswith("~"):
        try:
            Path(spec).expanduser()
        except RuntimeError:
            return (f"{spec!r} starts with {spec.split('/')[0]}, but there is no such user (or no "
                    "home directory) to expand it to; write the path out in full")
    return None


def dataset_arg(spec: str) -> str:
    """argparse type of --dataset: refuses spec_problem()s as the flags are read."""
    if problem := spec_problem(spec):
        raise argparse.ArgumentTypeError(problem)
    return spec


def prepare(spec: str, text_column: str | None = None, val_fraction: float | None = None) -> str:
    """The dataset name list_shards takes for the source `spec`, converted first unless an earlier
    run did; bad input is a ValueError or FileNotFoundError that names the fix."""
    if problem := spec_problem(spec):
        raise ValueError(f"--dataset: {problem}")
    if spec in DATASETS:
        if text_column is not None or val_fraction is not None:
            raise ValueError("--text-column and --val-fraction apply to custom sources; "
                             f"{spec} has a `text` column and its own val shard: drop them")
        return spec
    if val_fraction is not None and not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    hub = HUB.fullmatch(spec)
    if spec.startswith("hf:") and not hub:
        raise ValueError(f"--dataset {spec}: write a hub dataset as "
                         "hf:owner/name[:config][@revision]")
    source = ("hub", *hub.groups()) if hub else ("files", *_local_files(spec))
    digest = lambda *v: hashlib.sha256(json.dumps([VERSION, *v]).encode()).hexdigest()[:12]
    # slot: the source apart from its contents, so a new preparation knows its older ones
    where = source if hub else ("files", os.path.abspath(os.path.expanduser(spec)))
    slot = digest(where, text_column, val_fraction)
    slug = (hub.group(1).split("/")[1] if hub else Path(source[1]).name if glob.has_magic(spec) else
            Path(spec.rstrip("/")).stem)
    slug = re.sub(r"[^\w.-]+", "-", slug) or "data"
    folder = get_base_dir() / "data" / "source"
    with contextlib.ExitStack() as held:  # every rank calls this: one hashes and builds
        with contextlib.suppress(OSError):  # a read-only data dir: nothing to build or remove
            held.enter_context(build_lock(folder))
        # (path, size, content hash) of each local file: only new or changed files are read
        ident = source if hub else ("files", source[1], [
            (str(p), p.stat().st_size, h)
            for p, h in zip(source[2], content_hashes(source[2], folder / HASHES))])
        name = f"source/{slug}-{digest(ident, text_column, val_fraction)}"
        d = data_dir(name)
        if manifest_shards(d) is None:
            try:
                _build(spec, source, d, text_column, val_fraction, slot)
            except BaseException as e:  # bad input, Ctrl-C: leave no half-prepared folder behind
                shutil.rmtree(d, ignore_errors=True)
                if isinstance(e, OSError) and (code := filled(e)):
                    what, fix = what_filled(code, d.parent)
                    raise ValueError(f"cannot prepare {spec}: {what}; the half-prepared {d.name} "
                                     f"is removed and the source is untouched: {fix}, then run "
                                     "again") from None
                raise
        _remove_older(folder, d, slot)
    return name


def hold(d: Path):
    """A shared lock on prepared folder d while the returned file stays open (None without flock or
    d), so prepare() does not remove it."""
    try:
        import fcntl
        f = (d / IN_USE).open("a")  # open for as long as the caller reads
    except (ImportError, OSError):
        return None
    fcntl.flock(f, fcntl.LOCK_SH)
    return f


def _remove_older(folder: Path, keep: Path, slot: str) -> None:
    """Delete the other preparations of this slot (older contents of the same source: no run can
    resume from them), except a folder holding anything else or held by a data loader."""
    try:
        import fcntl
    except ImportError:  # no flock: a reader could not say it is reading
        return
    for d in sorted(folder.iterdir()):
        try:
            manifest = load_json(d / MANIFEST, MANIFEST_BYTES, "a manifest nanomuon wrote") \
                if PREPARED.fullmatch(d.name) else {}
            if d == keep or d.is_symlink() or manifest.get("slot") != slot:
                continue
            ours = {MANIFEST, IN_USE, *manifest["shards"]["train"], *manifest["shards"]["val"]}
            files = sorted(d.iterdir(), key=lambda p: p.name == MANIFEST)  # the manifest last
            if any(p.name not in ours or p.is_dir() for p in files):
                continue  # something else is in it: not ours to delete
            with open(d / IN_USE, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a data loader reads it
                for p in [d / IN_USE, *files]:
                    p.unlink(missing_ok=True)
            d.rmdir()
        except (OSError, ValueError, AttributeError, KeyError, TypeError):
            continue  # not a preparation of ours; in use or read-only: the next prepare() retries
        print(f"nanomuon: removed {d}, an older preparation of this source", file=sys.stderr)


def _local_files(spec: str) -> tuple[str, list[Path], list[Path]]:
    """(the folder names are relative to, the source's files, sorted, the files of other types);
    hidden ones are left out unsaid."""
    path = Path(spec).expanduser()
    if path.is_file() or path.is_dir():
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    elif glob.has_magic(spec):
        files = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
    else:
        raise FileNotFoundError(f"--dataset {spec}: no such file or directory, and no glob; "
                                f"expected {SPEC_HELP}")
    files = sorted(p.resolve() for p in files)
    root = (path.resolve() if path.is_dir()
            else Path(os.path.commonpath([p.parent for p in files] or [Path.cwd()])))
    files = [p for p in files if not any(s.startswith(".") for s in p.relative_to(root).parts)]
    other = [p for p in files if p.suffix.lower() not in FORMATS]
    files = [p for p in files if p.suffix.lower() in FORMATS]
    if not files:  # a single file of another type too: it is in `other`
        bad = sorted({p.suffix or p.name for p in other})
        raise FileNotFoundError(f"--dataset {spec}: no {', '.join(FORMATS)} files there" +
                                (f" (found {', '.join(bad[:5])})" if bad else ""))
    return str(root), files, other


def _first_names(paths: list[Path]) -> str:
    """The first three files' names, for a message ('...' where there are more)."""
    return (", ".join(shown(p.name, 100, quote=False) for p in paths[:3])
            + (" ..." if len(paths) > 3 else ""))


def _holds_nothing(p: Path) -> bool:
    """A non-text file of 0 bytes, of only whitespace, or a parquet file of 0 rows: `datasets` fails
    on it (and so on every file read with it) instead of reading no documents."""
    if p.suffix.lower() == ".parquet" and p.stat().st_size:
        try:
            return pq.ParquetFile(p).metadata.num_rows == 0
        except (pa.ArrowException, OSError):
            return False  # not parquet: reading it says so
    with open(p, "rb") as f:
        return not any(block.strip() for block in iter(lambda: f.read(1 << 16), b""))


def _split_word(rel: Path) -> str | None:
    """The held-out word a file's folders or name start with (test/x.txt), else None."""
    return next((word for part in (*rel.parent.parts, rel.name) for word in HELD_OUT
                 if re.match(rf"{word}(?:[-_. 0-9]|$)", part.lower())), None)


def decode(data: bytes) -> tuple[str | None, str]:
    """A text file's text and its encoding: by BOM, else UTF-8, else cp1252, else Latin-1; (None,
    'binary') for NULs without a BOM, or over BINARY_SHARE control bytes."""
    for bom, encoding in BOMS:
        if data.startswith(bom):
            try:
                return data.decode(encoding), encoding.removesuffix("-sig")
            except UnicodeDecodeError:
                return None, "binary"
    if b"\x00" in data:
        return None, "binary"
    for encoding in ("utf-8", "cp1252", "latin-1"):  # latin-1 decodes any bytes: the last resort
        with contextlib.suppress(UnicodeDecodeError):
            text = data.decode(encoding)
            break
    # binary without NULs: it decodes, but into control characters
    control = CONTROL + (bytes(range(0x80, 0xA0)) if encoding == "latin-1" else b"")
    if len(data) - len(data.translate(None, control)) > BINARY_SHARE * len(data):
        return None, "binary"
    return text, encoding


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ValueError("custom sources are read through Hugging Face `datasets`: "
                         "pip install datasets") from None
    datasets.disable_progress_bars()  # a bar per file; our own progress line says more
    return datasets


def _pick_column(batch: dict, text_column: str | None, where: str) -> str:
    texts = [c for c, vs in batch.items() if any(isinstance(v, str) for v in vs)
             and all(v is None or isinstance(v, str) for v in vs)]
    if text_column is not None:
        if text_column not in batch:
            raise ValueError(f"{where} has no column {text_column!r} "
                             f"(columns: {', '.join(batch)}): fix --text-column")
        return text_column
    if "text" in batch:
        return "text"
    if len(texts) == 1:
        print(f"nanomuon: {where} has no `text` column: reading its only string column "
              f"{texts[0]!r} (pick another with --text-column)", file=sys.stderr)
        return texts[0]
    raise ValueError(f"{where} has no `text` column and {len(texts)} string columns "
                     f"({', '.join(texts) or 'none'} of {', '.join(batch)}): "
                     "pick one with --text-column")


def _rows(ds, text_column: str | None, where: str, counts: dict, error) -> Iterator[str]:
    """The non-empty texts of a datasets IterableDataset; empty ones counted, rows without the
    column counted and said, with the column that holds their text instead. error(e) turns what
    reading raised (a parse error, a dropped connection) into a one-line ValueError."""
    column, batches, rows, lacking, elsewhere = None, ds.iter(batch_size=1024), 0, 0, {}
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            break
        except Exception as e:  # pyarrow, datasets, fsspec and network errors: all become one line
            raise error(e) from None
        column = column or _pick_column(batch, text_column, where)
        for i, text in enumerate(batch[column]):
            rows += 1
            if text is None:
                lacking += 1
                for c, vs in batch.items():
                    if c != column and isinstance(vs[i], str) and vs[i].strip():
                        elsewhere[c] = elsewhere.get(c, 0) + 1
            elif not isinstance(text, str):
                raise ValueError(f"{where}: column {column!r} holds {type(text).__name__}, "
                                 "not text: pick the text column with --text-column")
            elif text.strip():
                yield text
            else:
                counts["empty"] = counts.get("empty", 0) + 1
    if lacking:
        counts["null"] = counts.get("null", 0) + lacking
        other = max(elsewhere, key=elsewhere.get) if elsewhere else None
        fix = (f"; {elsewhere[other]:,} of them hold text in {other!r}: give every row its text "
               f"in {column!r}" if other else "")
        print(f"nanomuon: {lacking:,} of {rows:,} rows of {where} have no {column!r} (missing or "
              f"null) and are left out{fix}", file=sys.stderr)


def _read_files(files: list[Path], text_column: str | None, counts: dict) -> Iterator[str]:
    """Documents of local files: a text file each, the others a row each through `datasets`, one
    streaming read per format."""
    for builder in dict.fromkeys(FORMATS[p.suffix.lower()] for p in files):
        group = [p for p in files if FORMATS[p.suffix.lower()] == builder]
        if builder != "text":
            where = f"the {builder} files {_first_names(group)}"
            error = lambda e, where=where: ValueError(f"cannot read {where}: {one_line(e)}")
            try:
                options = dict(keep_default_na=False) if builder == "csv" else {}  # "NA" is text
                ds = _datasets().load_dataset(builder, data_files=[str(p) for p in group],
                                              split="train", streaming=True, **options)
            except Exception as e:
                raise error(e) from None
            yield from _rows(ds, text_column, where, counts, error)
            continue
        yield from _read_texts(group, counts)


def _read_texts(files: list[Path], counts: dict) -> Iterator[str]:
    """Text files as documents; the binary ones skipped and named, as are the ones read in a
    guessed legacy encoding: either may be wrong."""
    guessed, binary = {}, []
    for p in files:
        text, encoding = decode(p.read_bytes())
        if text is None:
            counts.setdefault("skipped", []).append(str(p))
            binary.append(p)
            continue
        counts[encoding] = counts.get(encoding, 0) + 1
        if encoding in ("cp1252", "latin-1"):
            guessed.setdefault(encoding, []).append(p)
        if text.strip():
            yield text
        else:
            counts["empty"] = counts.get("empty", 0) + 1
    for encoding, paths in guessed.items():
        print(f"nanomuon: {len(paths)} text file(s) not in UTF-8 read as {encoding} "
              f"({_first_names(paths)}): re-save them as UTF-8 if that reads wrong", file=sys.stderr)
    if binary:
        print(f"nanomuon: skipped {len(binary)} binary .txt file(s) ({_first_names(binary)}): they hold "
              "NUL or control bytes, not text", file=sys.stderr)


class _ShardWriter:
    """Writes documents into <prefix>_00000.parquet, ..., SHARD_CHARS characters per shard."""

    def __init__(self, folder: Path, prefix: str):
        self.folder, self.prefix, self.names, self.docs, self.chars = folder, prefix, [], 0, 0
        self._texts, self._size = [], 0

    def add(self, text: str) -> None:
        self._texts.append(text)
        self._size += len(text)
        self.docs, self.chars = self.docs + 1, self.chars + len(text)
        if self._size >= SHARD_CHARS:
            self.flush()

    def flush(self) -> None:
        if self._texts:
            path = self.folder / f"{self.prefix}_{len(self.names):05d}.parquet"
            table = pa.table({"text": pa.array(self._texts, type=pa.string())})
            write_atomic(path, lambda tmp: pq.write_table(table, tmp, row_group_size=1024,
                                                          compression="zstd"))
            self.names.append(path.name)
            self._texts, self._size = [], 0


def _open_hub_source(spec: str, source: tuple, text_column: str | None, counts: dict):
    """(train documents, val documents or None, the held-out split or None, the commit), streamed:
    only what is read is downloaded."""
    _, repo, config, revision = source
    # https, or plain http to this machine only (offline: the hub's own error says it)
    check_endpoint(dataset=spec, offline_too=False)
    datasets = _datasets()
    from huggingface_hub import HfApi, constants
    # the hub's and datasets' own errors, network errors: all become one line
    error = lambda e: ValueError(f"cannot load {spec} from {constants.ENDPOINT}: "
                                 f"{hub_problem(e)[1]}")
    try:
        revision = HfApi().dataset_info(repo, revision=revision).sha
        splits = dict(datasets.load_dataset(repo, config, revision=revision, streaming=True))
    except Exception as e:
        raise error(e) from None
    if "train" not in splits and len(splits) != 1:
        raise ValueError(f"{spec} has no train split (splits: {', '.join(splits)}): "
                         f"name the config with hf:{source[1]}:<config>")
    train_split = "train" if "train" in splits else next(iter(splits))
    held = next((w for w in HELD_OUT if w in splits and w != train_split), None)
    read = lambda split: _rows(splits[split], text_column, f"{spec} ({split} split)", counts, error)
    return read(train_split), read(held) if held else None, held, revision


def _open_local_source(spec: str, source: tuple, text_column: str | None, counts: dict):
    """(train documents, val documents or None, the held-out split or None, None), naming the
    files left out."""
    _, root, files, other = source
    if other:
        kinds = sorted({p.suffix.lower() or p.name for p in other})
        print(f"nanomuon: left out {len(other)} file(s) of other types ({', '.join(kinds[:5])}; "
              f"{_first_names(other)}): only {', '.join(FORMATS)} files are read; rename text files to "
              ".txt to train on them", file=sys.stderr)
    empty = [p for p in files if FORMATS[p.suffix.lower()] != "text" and _holds_nothing(p)]
    if empty and len(empty) == len(files):
        raise ValueError(f"--dataset {spec} holds no documents: every file is empty "
                         f"({_first_names(empty)}); point it at files with text")
    if empty:
        print(f"nanomuon: skipped {len(empty)} empty file(s) ({_first_names(empty)}): 0 bytes or 0 rows, "
              "they hold no documents", file=sys.stderr)
        files = [p for p in files if p not in empty]
    # one file: no split
    words = {p: _split_word(p.relative_to(root)) if len(files) > 1 else None for p in files}
    held = next((w for w in HELD_OUT if w in words.values()), None)
    if held and all(words.values()):
        raise ValueError(f"--dataset {spec}: every file is named as held-out ({held}, test, "
                         "...), so none is left to train on")
    read = lambda word: _read_files([p for p in files if words[p] == word], text_column, counts)
    return read(None), read(held) if held else None, held, None


def _write_shards(d: Path, train_docs, val_docs, fraction: float, t0: float):
    """(train, val) _ShardWriters, flushed; without val_docs, val is a fraction of train_docs."""
    train, val = _ShardWriter(d, "train"), _ShardWriter(d, "val")
    last, tick = None, time.time()
    for text in val_docs or ():
        val.add(text)
    for i, text in enumerate(train_docs):
        if val_docs is None and math.floor((i + 1) * fraction) > math.floor(i * fraction):
            val.add(text)
            continue
        if last is not None:  # one document held back, for val in case the fraction picks none
            train.add(last)
        last = text
        if time.time() - tick > 10:
            tick = time.time()
            print(f"nanomuon: {train.docs + val.docs:,} documents, "
                  f"{(train.chars + val.chars) / 1e6:,.0f}M chars, {tick - t0:.0f} s",
                  file=sys.stderr)
    if last is not None:
        (val if val_docs is None and not val.docs else train).add(last)
    train.flush()
    val.flush()
    return train, val


def _build(spec: str, source: tuple, d: Path, text_column: str | None, val_fraction: float | None,
           slot: str) -> None:
    t0, counts = time.time(), {}
    named = shown(spec, 300, quote=False)  # a path may hold newlines or terminal escapes
    print(f"nanomuon: preparing {named} in {d}", file=sys.stderr)
    opener = _open_hub_source if source[0] == "hub" else _open_local_source
    train_docs, val_docs, held, revision = opener(spec, source, text_column, counts)
    if held and val_fraction is not None:
        raise ValueError(f"{named} has its own {held!r} split, so --val-fraction does not apply "
                         "to it: drop it")
    fraction = DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction
    d.mkdir(parents=True, exist_ok=True)
    (d / MANIFEST).unlink(missing_ok=True)  # an interrupted build must not look finished
    train, val = _write_shards(d, train_docs, val_docs, fraction, t0)
    if not train.docs or not val.docs:
        raise ValueError(f"--dataset {named} gave {train.docs} documents with text to train on and "
                         f"{val.docs} to validate on: it needs at least one of each "
                         "(a text file is one document)")
    for stale in set(d.glob("*.parquet")) - {d / n for n in train.names + val.names}:
        stale.unlink()  # shards of an interrupted build that wrote more
    manifest = dict(source=spec, revision=revision, text_column=text_column,
                    val_split=f"its {held!r} split" if held else f"{fraction:g} of the documents",
                    shards=dict(train=train.names, val=val.names),
                    docs=dict(train=train.docs, val=val.docs),
                    chars=dict(train=train.chars, val=val.chars), counts=counts, version=VERSION,
                    slot=slot)
    write_atomic(d / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    print(f"nanomuon: prepared {named}: {train.docs:,} train and {val.docs:,} val documents "
          f"({manifest['val_split']}),"
          f" {(train.chars + val.chars) / 1e6:,.1f}M chars in {time.time() - t0:.1f} s"
          + (f"; {counts['empty']:,} empty documents left out" if counts.get("empty") else ""),
          file=sys.stderr)
