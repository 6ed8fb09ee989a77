"""
Pretraining text on disk: where it lives, how to get it, and how to read it back.
Every dataset (docs/data.md) is a directory of parquet shards with a string column `text`, a
document per row; the last shard by name is the val split, the others are train.
- fineweb-edu and climbmix (HUB_DATASETS): pre-shuffled shards that download() fetches from the
  Hugging Face hub in parallel, all from the revision pinned at the first download, retried and
  checked, so a rerun resumes. Nothing here touches the network unless a download is asked for.
- embedded: the Python standard library's .py sources, built locally on first use
  (ensure_embedded), so training and tests need no network.
- Custom sources (sources.py) live in source/<name>-<hash>, their shards listed by a manifest.
CLI: `python -m nanomuon.dataset -n 8 [--dataset climbmix]` or `--embedded`.
"""

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import re
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from nanomuon.common import get_base_dir, load_json, one_line, read_regular, write_atomic

DATASETS = ("fineweb-edu", "climbmix", "embedded")
SPLITS = ("train", "val")
# name: (dataset repo on the Hugging Face hub, its last shard, held out as the val shard)
HUB_DATASETS = {"fineweb-edu": ("karpathy/fineweb-edu-100b-shuffle", 1822),
                "climbmix": ("karpathy/climbmix-400b-shuffle", 6542)}
HF_REPO, MAX_SHARD = HUB_DATASETS["fineweb-edu"]
REVISION_FILE = "revision.txt"  # in the download folder: the commit its shards come from
FIX = {"fineweb-edu": "run `python -m nanomuon.dataset -n 8` to download them, or train on the "
                      "embedded corpus with --dataset embedded",
       "climbmix": "run `python -m nanomuon.dataset -n 8 --dataset climbmix` to download them, or "
                   "train on the embedded corpus with --dataset embedded",
       "embedded": "run `python -m nanomuon.dataset --embedded` to rebuild it",
       "source": "run again with the --dataset, --text-column and --val-fraction that prepared it"}
MANIFEST = "manifest.json"  # written last (build_embedded, sources.prepare): the build finished
MANIFEST_BYTES = 1 << 24  # a manifest lists shard names: far less even for 1,823 shards
RETRY_HTTP = (408, 425, 429)  # 4xx codes worth retrying; any other 4xx will not change on a retry


def data_dir(name: str) -> Path:
    """Where a dataset's shards live: one of DATASETS, or source/<name>-<hash> (sources.prepare)."""
    if name not in DATASETS and not re.fullmatch(r"source/[\w.-]+", name):
        raise ValueError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}, or a "
                         "custom source (docs/data.md, 'Your own data')")
    return get_base_dir() / "data" / name


def manifest_shards(d: Path, embedded: bool = False) -> dict | list | None:
    """The shards d's manifest lists, None unless it and they are all there: {split: [names]} of a
    prepared custom source, or with embedded the embedded corpus's [names] (2 at least)."""
    try:
        shards = load_json(d / MANIFEST, MANIFEST_BYTES, "a manifest nanomuon wrote")["shards"]
        names = shards if embedded else [*shards["train"], *shards["val"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    whole = len(names) >= 2 or not embedded
    return shards if whole and all((d / n).is_file() for n in names) else None


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.parquet"


def list_shards(name: str, split: str) -> list[Path]:
    """The parquet shards of one split: val is the last shard by name, train all the others."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
    d = ensure_embedded() if name == "embedded" else data_dir(name)
    if name not in DATASETS:
        if (shards := manifest_shards(d)) is None:
            raise FileNotFoundError(f"{name} is not prepared (or no longer complete) in {d}: "
                                    f"{FIX['source']}")
        return [d / n for n in shards[split]]
    shards = sorted(d.glob("*.parquet")) if d.is_dir() else []  # not in-flight *.parquet.*.tmp
    if len(shards) < 2:
        raise FileNotFoundError(f"{name} needs at least 2 shards (train + val) in {d}, "
                                f"found {len(shards)}: {FIX[name]}")
    return shards[:-1] if split == "train" else shards[-1:]


def read_shard(path: Path, decode: bool = False) -> tuple[pq.ParquetFile | None, str | None]:
    """(the file, None) for parquet with a string `text` column, else (None, what is wrong).
    decode: every row group too (for a fresh download; the loader names one as it reaches it)."""
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        return None, f"is not a readable parquet file ({one_line(e)})"
    if "text" not in pf.schema_arrow.names:
        return None, f"has no 'text' column (columns: {pf.schema_arrow.names})"
    kind = pf.schema_arrow.field("text").type
    if str(kind) not in ("string", "large_string", "string_view"):  # arrow's string types
        return None, (f"is not text: column 'text' holds {kind}, not strings "
                      "(write the documents as strings)")
    for rg in range(pf.num_row_groups if decode else 0):
        try:
            pf.read_row_group(rg, columns=["text"])
        except (pa.ArrowException, OSError) as e:
            return None, f"has a corrupt row group {rg} ({one_line(e)})"
    return pf, None


def open_shard(name: str, path: Path) -> pq.ParquetFile:
    """A shard that read_shard accepts, else a ValueError that says what to do."""
    pf, problem = read_shard(path)
    if problem:
        raise ValueError(f"{path} {problem}: delete it and {FIX.get(name, FIX['source'])}")
    return pf


def iter_texts(name: str, split: str, max_chars: int | None = None, rank: int = 0,
               world_size: int = 1) -> Iterator[str]:
    """Documents of a split in shard order, null ones skipped. max_chars: a hard budget (for
    tokenizer training), the last document cut short. world_size > 1: only documents k with
    k % world_size == rank, k counting every row, null or not (the data loader's split)."""
    if max_chars is not None and max_chars < 0:
        raise ValueError(f"max_chars must be >= 0 or None, got {max_chars}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    left, k = sys.maxsize if max_chars is None else max_chars, -1
    for path in list_shards(name, split):
        pf = open_shard(name, path)
        for rg in range(pf.num_row_groups):  # one row group in memory, not a ~100 MB shard
            for text in pf.read_row_group(rg, columns=["text"]).column("text").to_pylist():
                k += 1
                if text is None or k % world_size != rank:
                    continue
                if left <= 0:
                    return
                yield text[:left]
                left -= len(text)
            if left <= 0:
                return


def stdlib_sources() -> list[Path]:
    """Every .py file of this interpreter's standard library, sorted, without installed packages."""
    files = []
    for d, subdirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subdirs[:] = [s for s in subdirs
                      if s not in ("site-packages", "dist-packages", "__pycache__")]
        files += [Path(d) / n for n in names if n.endswith(".py")]
    return sorted(files)


def build_embedded(out_dir: Path, shard_chars: int = 4_000_000,
                   sources: Sequence[Path] | None = None) -> list[Path]:
    """Pack source files (default: stdlib_sources()) into at least 2 near-equal parquet shards in
    out_dir, a file per document, shuffled with a fixed seed so the val shard (the last) samples
    the whole library, not one package."""
    if shard_chars < 1:
        raise ValueError(f"shard_chars must be >= 1, got {shard_chars}")
    files = sorted(Path(p) for p in (stdlib_sources() if sources is None else sources))
    random.Random(0).shuffle(files)
    docs = [t for t in (p.read_bytes().decode("utf-8", errors="replace") for p in files)
            if t.strip()]
    total = sum(len(t) for t in docs)
    n = max(2, math.ceil(total / shard_chars))
    # a document goes to the shard its midpoint falls in
    groups: list[list[str]] = [[] for _ in range(n)]
    for t, end in zip(docs, itertools.accumulate(map(len, docs))):
        groups[min(n - 1, int((end - len(t) / 2) * n / max(total, 1)))].append(t)
    groups = [g for g in groups if g]
    if len(groups) < 2:
        raise ValueError("the embedded corpus needs at least 2 non-empty documents for train + "
                         f"val, got {len(docs)} from {len(files)} files")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)  # an interrupted build must not look finished
    paths = [out_dir / shard_name(i) for i in range(len(groups))]
    for path, group in zip(paths, groups):
        table = pa.table({"text": pa.array(group, type=pa.string())})
        write_atomic(path, lambda tmp, table=table: pq.write_table(table, tmp, row_group_size=1024,
                                                                   compression="zstd"))
    for stale in set(out_dir.glob("*.parquet")) - set(paths):
        stale.unlink()  # leftovers of an earlier, larger build
    manifest = dict(source="Python standard library .py files, one file per document",
                    python=sys.version.split()[0],
                    stdlib=sysconfig.get_paths()["stdlib"] if sources is None else None,
                    files=len(docs), chars=total, shard_chars=shard_chars, seed=0,
                    shards=[p.name for p in paths], val_shard=paths[-1].name)
    write_atomic(out_dir / "README.txt", (
        f"nanomuon embedded corpus: the .py sources of the Python {manifest['python']} standard "
        f"library,\n{len(docs)} files ({total:,} characters), shuffled with a fixed seed into "
        f"{len(paths)} parquet shards\n(column `text`, one file per row). The last shard, "
        f"{paths[-1].name}, is the val split.\nBuilt by nanomuon/dataset.py; rebuild with "
        "`python -m nanomuon.dataset --embedded`.\n"))
    write_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return paths


@contextlib.contextmanager
def build_lock(d: Path):
    """Serializes builds across processes (every rank of a torchrun job calls list_shards)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): concurrent builds end up identical, just duplicated
        yield
        return
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released as the file closes, however the block ends
        yield


def ensure_embedded() -> Path:
    """The embedded corpus directory, built first if missing or its last build was cut short."""
    d = data_dir("embedded")
    if manifest_shards(d, embedded=True):
        return d
    with build_lock(d):
        if not manifest_shards(d, embedded=True):  # else another process built it meanwhile
            print(f"nanomuon: building the embedded corpus (Python stdlib sources) in {d}",
                  file=sys.stderr)
            build_embedded(d)
    return d


def _hub():
    try:
        # its constants (HF_ENDPOINT, HF_HUB_OFFLINE) are read from the environment at import
        import huggingface_hub
        import huggingface_hub.constants
    except ImportError:
        raise ValueError("downloading a hub dataset needs huggingface_hub: "
                         "pip install huggingface_hub") from None
    return huggingface_hub


def check_endpoint(allow_http: bool = False, dataset: str = "fineweb-edu",
                   offline_too: bool = True) -> str:
    """HF_ENDPOINT, checked before every hub fetch (here and in sources.py): refused unless a plain
    https://host[:port][/path] URL, or plain http to loopback (a local mirror, the tests' fake hub)
    or with allow_http (anyone on the path could swap the files). dataset: whose fix to name;
    offline_too: refuse HF_HUB_OFFLINE here too."""
    import ipaddress
    import urllib.parse

    hub = _hub()
    endpoint = hub.constants.ENDPOINT
    url = urllib.parse.urlsplit(endpoint)
    try:
        port_ok = url.port is None or url.port > 0
    except ValueError:  # not a number in 0..65535
        port_ok = False
    # userinfo can disguise the host (http://127.0.0.1:80@evil.com); parsers differ on backslashes
    if (not port_ok or not url.hostname or "@" in url.netloc or url.query or url.fragment
            or not endpoint.isprintable() or "\\" in endpoint or " " in endpoint):
        raise ValueError(f"HF_ENDPOINT {endpoint!r} is not a URL like https://host[:port][/path]: "
                         "fix or unset it")
    scheme = url.scheme.lower()
    if scheme not in ("https", "http"):
        raise ValueError(f"HF_ENDPOINT {endpoint} is not https: use an https mirror, or unset it "
                         "for the hub")
    try:
        loopback = url.hostname == "localhost" or ipaddress.ip_address(url.hostname).is_loopback
    except ValueError:  # a host name, not an address
        loopback = False
    if scheme == "http" and not loopback and not allow_http:
        raise ValueError(f"HF_ENDPOINT {endpoint} is not https, so the data could be altered in "
                         "transit; use an https mirror" + (", or add --allow-http for a "
                         "plain-http one you trust" if dataset in FIX else ""))
    if offline_too and hub.constants.HF_HUB_OFFLINE:
        raise ValueError("HF_HUB_OFFLINE is set, so nothing can be downloaded: unset it, or train "
                         "offline with --dataset embedded"
                         + (f" ({FIX[dataset]})" if dataset in FIX else ""))
    return endpoint


def hub_problem(e: Exception) -> tuple[int | None, str]:
    """(HTTP status or None, one line on what a hub or network error means and what to do)."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    fix = {401: "set HF_TOKEN to a token that can read it",
           403: "set HF_TOKEN to a token that can read it (and accept the dataset's terms on its "
                "hub page)",
           404: "check the name and HF_ENDPOINT"}.get(status)
    if fix is None and _hub().constants.HF_HUB_OFFLINE:
        fix = "HF_HUB_OFFLINE is set: unset it, or train offline with --dataset embedded"
    return status, f"{one_line(e)}; " + (fix or "check the network and HF_ENDPOINT, or train "
                                                 "offline with --dataset embedded")


def pin_revision(out_dir: Path, revision: str | None, repo: str = HF_REPO) -> str:
    """The commit of `repo` every shard in out_dir comes from, recorded at its first download
    (`revision`, default main), so shards fetched months apart still match."""
    pin = out_dir / REVISION_FILE
    pinned = read_regular(pin, 256, "the commit nanomuon pinned", f"remove {pin}").decode().strip() \
        if pin.exists() else None
    if pinned and revision in (None, pinned):
        return pinned
    try:
        sha = _hub().HfApi().dataset_info(repo, revision=revision).sha
    except Exception as e:  # the hub's errors and network errors alike: one line, with what to do
        raise ValueError(f"cannot reach {repo} on {_hub().constants.ENDPOINT}: "
                         f"{hub_problem(e)[1]}") from None
    if pinned and sha != pinned and any(out_dir.glob("*.parquet")):
        raise ValueError(f"the shards in {out_dir} come from revision {pinned}, not {revision} "
                         f"({sha}); use another --out-dir, or delete them to switch")
    write_atomic(pin, sha + "\n")
    return sha


def _download_shard(index: int, out_dir: Path, revision: str, retries: int, backoff: float,
                    stop: threading.Event, dataset: str = "fineweb-edu") -> tuple[Path, bool]:
    """(path, False if it was there) of a shard downloaded into out_dir by hf_hub_download (which
    resumes cut transfers and retries 429s), retried on other failures, checked to be parquet."""
    name = shard_name(index)
    repo, max_shard = HUB_DATASETS[dataset]
    if (out_dir / name).exists():
        return out_dir / name, False
    last, corrupt = "no attempt made", False
    for attempt in range(retries + 1):
        if attempt:
            stop.wait(backoff ** attempt)  # a sleep that Ctrl-C (stop.set()) cuts short
        if stop.is_set():
            raise RuntimeError(f"{name}: stopped; re-run the same command to resume")
        try:
            path = Path(_hub().hf_hub_download(repo, name, repo_type="dataset",
                                               revision=revision, local_dir=out_dir,
                                               force_download=corrupt))
        except Exception as e:  # HTTP errors past the client's retries, cut links, short files
            status, last = hub_problem(e)
            if status is not None and 400 <= status < 500 and status not in RETRY_HTTP:
                raise RuntimeError(f"{name}: HTTP {status} from {_hub().constants.ENDPOINT}: "
                                   f"{last} (shards are 0..{max_shard})") from None
            continue
        problem = read_shard(path, decode=True)[1]
        if problem is None:
            return path, True
        path.unlink(missing_ok=True)
        last, corrupt = f"corrupt download: the file {problem}", True
    raise RuntimeError(f"{name}: download failed after {retries + 1} attempts, last error: "
                       f"{last}; re-run the same command to resume (finished shards and partial "
                       "downloads are kept)")


def download(num_shards: int, out_dir: Path | None = None, revision: str | None = None,
             workers: int = 4, retries: int = 5, backoff: float = 2.0,
             allow_http: bool = False, dataset: str = "fineweb-edu") -> list[Path]:
    """Download a hub dataset's train shards 0..num_shards-1 plus its last (val) shard, all from
    one pinned revision, skipping those present; returns all their paths, sorted."""
    if dataset not in HUB_DATASETS:
        raise ValueError(f"unknown hub dataset {dataset!r}: choose one of "
                         f"{', '.join(HUB_DATASETS)}")
    repo, max_shard = HUB_DATASETS[dataset]
    if not 1 <= num_shards <= max_shard:
        raise ValueError(f"num_shards must be in 1..{max_shard}, got {num_shards}")
    if workers < 1 or retries < 0:
        raise ValueError(f"need workers >= 1 and retries >= 0, got workers={workers}, "
                         f"retries={retries}")
    endpoint = check_endpoint(allow_http, dataset)
    out_dir = Path(out_dir) if out_dir is not None else data_dir(dataset)
    out_dir.mkdir(parents=True, exist_ok=True)
    revision = pin_revision(out_dir, revision, repo)
    indices = [*range(num_shards), max_shard]
    t0, new_bytes, errors, paths = time.time(), 0, [], []
    print(f"{dataset}: {num_shards} train shards + 1 val shard ({max_shard}) of "
          f"{repo}@{revision[:12]} from {endpoint} into {out_dir}, {workers} workers")
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_download_shard, i, out_dir, revision, retries, backoff, stop,
                               dataset) for i in indices]
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
                print(f"[{done}/{len(indices)}] {path.name} {status}  ({time.time() - t0:.1f} s)",
                      flush=True)
        except BaseException:  # Ctrl-C: no new shards or retries; transfers keep their partial file
            stop.set()
            pool.shutdown(cancel_futures=True)
            raise
    if errors:
        raise RuntimeError(errors[0] + (f" (and {len(errors) - 1} more failed shards)"
                                        if len(errors) > 1 else ""))
    dt = time.time() - t0
    print(f"done: {len(paths)} shards in {out_dir}, {new_bytes / 1e6:.1f} MB downloaded in "
          f"{dt:.1f} s ({new_bytes / 1e6 / max(dt, 1e-9):.1f} MB/s)")
    return sorted(paths)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m nanomuon.dataset",
                                description=__doc__.strip().splitlines()[0], allow_abbrev=False)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("-n", "--num-shards", type=int, help="download train shards 0..N-1 of "
                      f"--dataset (~100 MB each; up to {MAX_SHARD} for fineweb-edu, "
                      f"{HUB_DATASETS['climbmix'][1]} for climbmix) plus its val shard")
    what.add_argument("--embedded", action="store_true", help="build the embedded corpus")
    p.add_argument("--dataset", choices=list(HUB_DATASETS), default="fineweb-edu",
                   help="with -n: the hub dataset to download")
    p.add_argument("--workers", type=int, default=4, help="parallel downloads")
    p.add_argument("--retries", type=int, default=5, help="retries per shard on network errors")
    p.add_argument("--backoff", type=float, default=2.0, help="retry k waits backoff**k seconds")
    p.add_argument("--revision", default=None, help="the dataset commit or branch (default: the "
                   "one this folder's first download pinned, else main's current commit)")
    p.add_argument("--allow-http", action="store_true", help="accept a plain-http HF_ENDPOINT")
    p.add_argument("--out-dir", type=Path, help="default: $NANOMUON_BASE_DIR/data/<dataset>")
    p.add_argument("--shard-chars", type=int, default=4_000_000, help="embedded: chars per shard")
    args = p.parse_args(argv)
    if args.embedded:
        out, t0 = args.out_dir or data_dir("embedded"), time.time()
        with build_lock(out):
            paths = build_embedded(out, shard_chars=args.shard_chars)
        m = load_json(out / MANIFEST, MANIFEST_BYTES, "the manifest just written")
        print(f"embedded: {m['files']} stdlib files, {m['chars'] / 1e6:.1f}M chars -> "
              f"{len(paths)} shards ({len(paths) - 1} train + 1 val) in {out}, "
              f"{time.time() - t0:.1f} s")
    else:
        try:
            download(args.num_shards, args.out_dir, args.revision, args.workers, args.retries,
                     args.backoff, allow_http=args.allow_http, dataset=args.dataset)
        except (RuntimeError, ValueError) as e:
            sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
