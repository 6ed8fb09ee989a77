"""
Pretraining text on disk: where it lives, how to get it, and how to read it back.

Two datasets, both directories of parquet shards with one string column `text` (a document per row),
sorted by name; the last shard is the val split, all the others are train:
- fineweb-edu: Karpathy's pre-shuffled FineWeb-Edu shards from the Hugging Face hub. download() fetches
  them in parallel, resumes partial files with HTTP Range requests, retries network errors with backoff
  and checks each file is parquet before moving it into place, so an interrupted run just resumes.
- embedded: built locally from the Python standard library's own .py sources (about 30 MB of text), so
  training and tests work with no network at all. ensure_embedded() builds it on first use.
CLI: `python -m nanomuon.dataset -n 8` (FineWeb-Edu train shards 0..7 + the val shard), or `--embedded`.
"""

import argparse
import contextlib
import http.client
import json
import math
import os
import random
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from nanomuon.common import get_base_dir, write_atomic

DATASETS = ("fineweb-edu", "embedded")
SPLITS = ("train", "val")
BASE_URL = "https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main"
MAX_SHARD = 1822  # the last shard on the hub; held out as the val shard
USER_AGENT = "nanomuon-dataset/0.1 (+python urllib)"
FIX = {"fineweb-edu": "run `python -m nanomuon.dataset -n 8` to download them, or train on the embedded corpus "
                      "with --dataset embedded",
       "embedded": "run `python -m nanomuon.dataset --embedded` to rebuild it"}
MANIFEST = "manifest.json"  # written last by build_embedded: its presence marks a finished build
RETRY_HTTP = (408, 425, 429)  # 4xx codes worth retrying; any other 4xx will not change on a retry


# -- locations ----------------------------------------------------------------------------------------
def data_dir(name: str) -> Path:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")
    return get_base_dir() / "data" / name


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.parquet"


# -- reading ------------------------------------------------------------------------------------------
def list_shards(name: str, split: str) -> list[Path]:
    """The parquet shards of one split: val is the last shard by name, train all the others."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
    d = ensure_embedded() if name == "embedded" else data_dir(name)
    # `*.parquet` skips in-flight `*.parquet.part` / `*.tmp` files: only complete shards count.
    shards = sorted(d.glob("*.parquet")) if d.is_dir() else []
    if len(shards) < 2:
        raise FileNotFoundError(f"{name} needs at least 2 shards (train + val) in {d}, found {len(shards)}: "
                                f"{FIX[name]}")
    return shards[:-1] if split == "train" else shards[-1:]


def read_shard(path: Path) -> tuple[pq.ParquetFile | None, str | None]:
    """(the file, None) for parquet with the string `text` column every reader needs, else (None, what is wrong)."""
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        return None, f"is not a readable parquet file ({e})"
    if "text" not in pf.schema_arrow.names:
        return None, f"has no 'text' column (columns: {pf.schema_arrow.names})"
    kind = pf.schema_arrow.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
        return None, f"is not text: column 'text' holds {kind}, not strings (write the documents as strings)"
    return pf, None


def open_shard(name: str, path: Path) -> pq.ParquetFile:
    """A shard of dataset `name` that read_shard accepts; a ValueError that says what to do otherwise."""
    pf, problem = read_shard(path)
    if problem:
        raise ValueError(f"{path} {problem}: delete it and {FIX[name]}")
    return pf


def iter_texts(name: str, split: str, max_chars: int | None = None, rank: int = 0,
               world_size: int = 1) -> Iterator[str]:
    """Documents of a split in shard order, null ones skipped. With max_chars, stops after exactly that many
    characters (the last document is cut short), so callers get a hard budget, e.g. for tokenizer training.
    With world_size > 1, only documents k with k % world_size == rank (k counts every row, null or not: the
    data loader's split of the documents between ranks)."""
    if max_chars is not None and max_chars < 0:
        raise ValueError(f"max_chars must be >= 0 or None, got {max_chars}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    left, k = sys.maxsize if max_chars is None else max_chars, -1
    for path in list_shards(name, split):
        pf = open_shard(name, path)
        # Row group by row group keeps memory at one group, not one shard (FineWeb shards are ~100 MB).
        for rg in range(pf.num_row_groups):
            for text in pf.read_row_group(rg, columns=["text"]).column("text").to_pylist():
                k += 1
                if text is None or k % world_size != rank:
                    continue
                if left <= 0:
                    return
                text = text[:left]
                left -= len(text)
                yield text
            if left <= 0:
                return


# -- embedded corpus: the Python standard library ------------------------------------------------------
def stdlib_sources() -> list[Path]:
    """Every .py file of this interpreter's standard library, sorted, without installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for d, subdirs, names in os.walk(root):
        subdirs[:] = [s for s in subdirs if s not in ("site-packages", "dist-packages", "__pycache__")]
        files += [Path(d) / n for n in names if n.endswith(".py")]
    return sorted(files)


def build_embedded(out_dir: Path, shard_chars: int = 4_000_000, sources: Sequence[Path] | None = None) -> list[Path]:
    """Pack source files (default: the stdlib, stdlib_sources()) into parquet shards in out_dir, one file per
    document. Deterministic: files are sorted then shuffled with a fixed seed, so the val shard (the last) is a sample
    of the whole library rather than one package. Shards are cut at document boundaries into ceil(chars / shard_chars)
    near-equal parts (at least 2, for train + val); a shard exceeds shard_chars by at most one document."""
    if shard_chars < 1:
        raise ValueError(f"shard_chars must be >= 1, got {shard_chars}")
    files = sorted(Path(p) for p in (stdlib_sources() if sources is None else sources))
    random.Random(0).shuffle(files)
    docs = [t for t in (p.read_bytes().decode("utf-8", errors="replace") for p in files) if t.strip()]
    total = sum(len(t) for t in docs)
    n = max(2, math.ceil(total / shard_chars))
    # Document i goes to the shard its midpoint falls in: equal-size shards, cut only between documents.
    groups: list[list[str]] = [[] for _ in range(n)]
    pos = 0
    for t in docs:
        groups[min(n - 1, int((pos + len(t) / 2) * n / max(total, 1)))].append(t)
        pos += len(t)
    groups = [g for g in groups if g]
    if len(groups) < 2:
        raise ValueError(f"the embedded corpus needs at least 2 non-empty documents for train + val, got "
                         f"{len(docs)} from {len(files)} files")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)  # an interrupted build must not look finished
    paths = [out_dir / shard_name(i) for i in range(len(groups))]
    for path, group in zip(paths, groups):
        table = pa.table({"text": pa.array(group, type=pa.string())})
        write_atomic(path, lambda tmp, table=table: pq.write_table(table, tmp, row_group_size=1024, compression="zstd"))
    for stale in set(out_dir.glob("*.parquet")) - set(paths):  # leftovers of an earlier, larger build
        stale.unlink()

    manifest = dict(source="Python standard library .py files, one file per document", python=sys.version.split()[0],
                    stdlib=sysconfig.get_paths()["stdlib"] if sources is None else None, files=len(docs), chars=total,
                    shard_chars=shard_chars, seed=0, shards=[p.name for p in paths], val_shard=paths[-1].name)
    readme = (f"nanomuon embedded corpus: the .py sources of the Python {manifest['python']} standard library,\n"
              f"{len(docs)} files ({total:,} characters), shuffled with a fixed seed into {len(paths)} parquet "
              f"shards\n(column `text`, one file per row). The last shard, {paths[-1].name}, is the val split.\n"
              f"Built by nanomuon/dataset.py; rebuild with `python -m nanomuon.dataset --embedded`.\n")
    write_atomic(out_dir / "README.txt", lambda tmp: tmp.write_text(readme))
    write_atomic(out_dir / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=2) + "\n"))
    return paths


def _embedded_complete(d: Path) -> bool:
    try:
        names = json.loads((d / MANIFEST).read_text())["shards"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return len(names) >= 2 and all((d / n).is_file() for n in names)


@contextlib.contextmanager
def _build_lock(d: Path):
    """Serializes builds across processes (every rank of a torchrun job calls list_shards at once)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): concurrent builds still end up identical, just duplicated
        yield
        return
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released as the file closes, however the block ends
        yield


def ensure_embedded() -> Path:
    """The embedded corpus directory, built first if it is missing or its last build was interrupted."""
    d = data_dir("embedded")
    if _embedded_complete(d):
        return d
    with _build_lock(d):
        if not _embedded_complete(d):  # another process may have built it while we waited for the lock
            print(f"nanomuon: building the embedded corpus (Python stdlib sources) in {d}", file=sys.stderr)
            build_embedded(d)
    return d


# -- FineWeb-Edu download -----------------------------------------------------------------------------
def _fetch(url: str, part: Path, timeout: float, stop: threading.Event) -> None:
    """Stream url into part, resuming from part's current size with a Range request.
    Raises ConnectionError if the connection ends before the advertised length."""
    start = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": USER_AGENT}
    if start:
        headers["Range"] = f"bytes={start}-"
    try:
        resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and start:  # nothing left past `start`: part may already be whole; validation decides
            e.close()
            return
        raise
    with resp:
        if resp.status == 206:
            spec = resp.headers.get("Content-Range", "").removeprefix("bytes ")  # FIRST-LAST/TOTAL (TOTAL may be "*")
            first, size = spec.partition("-")[0], spec.rpartition("/")[2]
            if not first.isdigit() or int(first) != start:
                part.unlink(missing_ok=True)
                raise ConnectionError(f"server resumed at {spec!r}, not at byte {start}; restarting the shard")
            mode = "ab"
        else:  # 200: the server ignored the Range header and sends the whole file
            start, mode, size = 0, "wb", resp.headers.get("Content-Length", "")
        total = int(size) if size.isdigit() else None
        got = start
        with open(part, mode) as f:
            # http.client returns b"" rather than raising when a response with a length is cut short,
            # so the byte count below is what catches a dropped connection.
            while chunk := resp.read(1 << 20):
                if stop.is_set():  # Ctrl-C in the main thread: keep the .part, quit
                    raise InterruptedError("download stopped")
                f.write(chunk)
                got += len(chunk)
    if total is not None and got != total:
        raise ConnectionError(f"connection closed after {got:,} of {total:,} bytes")


def _download_shard(index: int, out_dir: Path, base_url: str, retries: int, backoff: float,
                    stop: threading.Event, timeout: float = 60.0) -> tuple[Path, bool]:
    """Download one shard into out_dir; returns (path, False if it was already there)."""
    name = shard_name(index)
    final, part = out_dir / name, out_dir / f"{name}.part"
    if final.exists():
        return final, False
    url = f"{base_url.rstrip('/')}/{name}"
    last = "no attempt made"
    for attempt in range(retries + 1):
        if attempt:
            stop.wait(backoff ** attempt)  # a sleep that Ctrl-C (stop.set()) cuts short
        if stop.is_set():
            raise RuntimeError(f"{name}: stopped; re-run the same command to resume")
        try:
            _fetch(url, part, timeout, stop)
        except urllib.error.HTTPError as e:
            if 400 <= e.code < 500 and e.code not in RETRY_HTTP:
                raise RuntimeError(f"{name}: HTTP {e.code} {e.reason} from {url}: check the base URL and that "
                                   f"the shard exists (0..{MAX_SHARD})") from None
            last = f"HTTP {e.code} {e.reason}"
            continue
        except (OSError, http.client.HTTPException) as e:  # URLError, timeouts, resets, IncompleteRead
            last = f"{type(e).__name__}: {e}"
            continue
        problem = read_shard(part)[1]
        if problem is None:
            os.replace(part, final)
            return final, True
        part.unlink(missing_ok=True)  # resuming a corrupt file would only extend it
        last = f"corrupt download: the file {problem}"
    raise RuntimeError(f"{name}: download from {url} failed after {retries + 1} attempts, last error: {last}; "
                       f"re-run the same command to resume (finished shards and .part files are kept)")


def download(num_shards: int, out_dir: Path | None = None, base_url: str = BASE_URL, workers: int = 4,
             retries: int = 5, backoff: float = 2.0, allow_http: bool = False) -> list[Path]:
    """Download FineWeb-Edu train shards 0..num_shards-1 plus shard MAX_SHARD as the val shard (it sorts
    last, so list_shards calls it val). Shards already present are skipped; returns all their paths, sorted.
    Only https, unless allow_http: anyone on the path could swap the files of a plain-http download."""
    if not 1 <= num_shards <= MAX_SHARD:
        raise ValueError(f"num_shards must be in 1..{MAX_SHARD}, got {num_shards}")
    scheme = base_url.partition("://")[0]
    if scheme != "https" and not (scheme == "http" and allow_http):
        raise ValueError(f"--base-url {base_url} is not https, so the shards could be altered in transit; use an "
                         "https mirror, or add --allow-http for a plain-http one you trust")
    if workers < 1 or retries < 0:
        raise ValueError(f"need workers >= 1 and retries >= 0, got workers={workers}, retries={retries}")
    out_dir = Path(out_dir) if out_dir is not None else data_dir("fineweb-edu")
    out_dir.mkdir(parents=True, exist_ok=True)
    indices = [*range(num_shards), MAX_SHARD]
    t0, new_bytes, errors, paths = time.time(), 0, [], []
    print(f"fineweb-edu: {num_shards} train shards + 1 val shard ({MAX_SHARD}) into {out_dir}, {workers} workers")
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_download_shard, i, out_dir, base_url, retries, backoff, stop=stop) for i in indices]
        try:
            for done, fut in enumerate(as_completed(futures), start=1):
                try:
                    path, fetched = fut.result()
                except RuntimeError as e:
                    errors.append(str(e))
                    print(f"[{done}/{len(indices)}] FAILED {e}", flush=True)
                    continue
                paths.append(path)
                size = path.stat().st_size
                new_bytes += size if fetched else 0
                status = f"{size / 1e6:.1f} MB" if fetched else "already present"
                print(f"[{done}/{len(indices)}] {path.name} {status}  ({time.time() - t0:.1f} s)", flush=True)
        except BaseException:  # Ctrl-C: workers stop at their next chunk (keeping .part files) instead of finishing
            stop.set()
            pool.shutdown(cancel_futures=True)
            raise
    if errors:
        raise RuntimeError(errors[0] + (f" (and {len(errors) - 1} more failed shards)" if len(errors) > 1 else ""))
    dt = time.time() - t0
    print(f"done: {len(paths)} shards in {out_dir}, {new_bytes / 1e6:.1f} MB downloaded in {dt:.1f} s "
          f"({new_bytes / 1e6 / max(dt, 1e-9):.1f} MB/s)")
    return sorted(paths)


# -- CLI ------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m nanomuon.dataset", description=__doc__.strip().splitlines()[0],
                                allow_abbrev=False)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("-n", "--num-shards", type=int, help=f"download FineWeb-Edu train shards 0..N-1 "
                      f"(1..{MAX_SHARD}, ~100 MB each) plus the val shard")
    what.add_argument("--embedded", action="store_true", help="build the embedded corpus from the Python stdlib")
    p.add_argument("--workers", type=int, default=4, help="parallel downloads")
    p.add_argument("--retries", type=int, default=5, help="retries per shard on network errors")
    p.add_argument("--base-url", default=BASE_URL, help="where the shards live (a mirror, say)")
    p.add_argument("--allow-http", action="store_true", help="accept a plain-http --base-url")
    p.add_argument("--out-dir", type=Path, default=None, help="default: $NANOMUON_BASE_DIR/data/<dataset>")
    p.add_argument("--shard-chars", type=int, default=4_000_000, help="embedded: characters per shard")
    args = p.parse_args(argv)
    if args.embedded:
        out, t0 = args.out_dir or data_dir("embedded"), time.time()
        with _build_lock(out):
            paths = build_embedded(out, shard_chars=args.shard_chars)
        m = json.loads((out / MANIFEST).read_text())
        print(f"embedded: {m['files']} stdlib files, {m['chars'] / 1e6:.1f}M chars -> {len(paths)} shards "
              f"({len(paths) - 1} train + 1 val) in {out}, {time.time() - t0:.1f} s")
    else:
        try:
            download(args.num_shards, args.out_dir, args.base_url, args.workers, args.retries,
                     allow_http=args.allow_http)
        except (RuntimeError, ValueError) as e:
            sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
