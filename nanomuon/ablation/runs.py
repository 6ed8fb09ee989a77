"""
An ablation's runs and their cache: each (variant, swept value, seed) as a scripts.base_train
process (seeds batched where they share a data order), its record kept in ablations/cache/ under a
key of everything that decides it; scripts/noise.py runs through the same cache.
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import NamedTuple

import torch

from nanomuon import common, ideas, reads
from nanomuon.ablation.budget import Tracker
from nanomuon.dataset import SPLITS, list_shards
from nanomuon.run import StepRecords
from nanomuon.sources import add_data_args, prepare
from nanomuon.tokenizer import tokenizer_dir

KEPT = ("final_val_bpb", "min_val_bpb", "final_eval_bpb", "final_eval_tokens", "val_history",
        "val_train_time", "tok_per_s", "optimizer_share", "num_params", "tokens_per_step", "run")
_print_lock = threading.Lock()
RUNNING = {}  # the base_train processes running now -> their labels: a stop ends them
# The code behind a result: the library and all of scripts/. Not a list of base_train's imports:
# it would go stale unnoticed when an import is added, and a needless re-run only costs time.
CODE_DIRS = (Path(__file__).resolve().parents[1], Path(__file__).resolve().parents[2] / "scripts")


def code_hash(dirs=CODE_DIRS) -> str:
    """sha256 over the path (from the package up) and the contents of every .py file under dirs."""
    h = hashlib.sha256()
    for d in dirs:
        for p in sorted(d.rglob("[!.]*.py")):  # not an editor's .#lock files: none is imported
            rel = p.relative_to(d.parent).as_posix()
            h.update(f"{rel} {hashlib.sha256(p.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()


def data_fingerprint(name: str, memo: Path) -> str:
    """sha256 over the names and contents of dataset `name`'s shards, hashed once (memo)."""
    shards = [(split, path) for split in SPLITS for path in list_shards(name, split)]
    hashes = common.content_hashes([path for _, path in shards], memo,
                            f"== hashing the new or changed shards of {name}")
    h = hashlib.sha256()
    for (split, path), digest in zip(shards, hashes):
        h.update(f"{split} {path.name} {digest}\n".encode())
    return h.hexdigest()


def device_name(device: str) -> str:
    """The device as precisely as torch or the OS names it: step times differ across them."""
    if device == "cuda":
        return f"cuda {torch.cuda.get_device_name()}"
    with contextlib.suppress(OSError):
        if m := re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M):
            return f"{device} {m[1].strip()}"
    return f"{device} {platform.processor() or platform.machine()}"


PROGRESS_S = 30  # a run's step lines are echoed this often at most (its evals and the last: all)


def launch(label: str, run_flags: list[str], nproc: int, threads: int, watch=None) -> None:
    """Run scripts.base_train (under torchrun when nproc > 1), echoed; a failure exits with its
    last lines. Its step records feed `watch` (a budget.RunWatch)."""
    launcher = (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [])
    with tempfile.TemporaryDirectory(prefix="ablate-") as tmp:
        records = StepRecords(Path(tmp) / "steps.jsonl")
        cmd = [sys.executable, *launcher, "-m", "scripts.base_train",
               *(["--"] if nproc > 1 else []), *run_flags, "--log-every", "1",
               "--step-record", str(records.path)]
        tell(f"== {label}: {' '.join(cmd[1:])}")
        # the run records the code it ran and what user code read (nanomuon/reads.py)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), NANOMUON_RECORD_READS="1")
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              bufsize=1, env=env) as p:
            if watch:
                watch.started_process(p)
            RUNNING[p] = label
            try:
                tail = echo(label, p.stdout, records, watch)
            finally:
                RUNNING.pop(p, None)
    if watch and watch.refusal:
        raise SystemExit(watch.refusal)
    if p.returncode != 0:
        raise SystemExit(f"error: {label} failed (exit {p.returncode}); its last "
                         f"lines:\n{''.join(tail)}")
    if watch:
        watch.ended()


def echo(label: str, lines, records: StepRecords, watch=None) -> list[str]:
    """Echo a run's evals, warnings and errors, and its step lines (those its records hold)
    PROGRESS_S apart but the last, prefixed by label; returns its last 20 lines."""
    tail, shown, steps = [], -math.inf, {}
    for line in lines:
        tail = (tail + [line])[-20:]
        for record in records.new():
            steps[record["line"]] = record
            if watch:
                watch.step(record)
        step = steps.pop(line.rstrip("\n"), None)
        if step and step["step"] < step["steps"] and time.monotonic() - shown < PROGRESS_S:
            continue
        if step or line.startswith(("step ", "error", "warning", "final val")) or line.endswith(
                "is not used)\n"):  # a flag the variant overrides (base_train.flags_not_used)
            shown = time.monotonic() if step else shown
            tell(f"  [{label}] " + line.rstrip("\n"))
    return tail


def variant_key(variant: str, options: list[str] = ()) -> list:
    """What decides a variant's runs beyond the code: its settings by value (with `options`, the
    KEY=VALUE a swept run overrides) and the ideas files that define it."""
    return [ideas.settings_key(ideas.with_options(variant, list(options))),
            *(i.digest for i in ideas.ideas_of(variant))]


def key_of(parts: list) -> str:
    """A cache file's key: a hash of everything that decides what it holds."""
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


UNSWEPT = "-"  # a variant a --sweep of another's leaves at its own settings: no flag given


class Sweep(NamedTuple):
    """The base_train flag an ablation sweeps (without its dashes) and its values, as given; with
    `variant`, that variant's alone (the others run once, at UNSWEPT), and with `option` the flag
    names one of its settings (base_train --variant-option FLAG=VALUE)."""
    flag: str
    values: list[str]
    variant: str | None = None
    option: bool = False
    fixed: tuple = ()  # variants that run once at their own settings (--published: muon)

    def of(self, variant: str) -> list[str]:
        """The values `variant` runs at."""
        swept = self.variant in (None, variant) and variant not in self.fixed
        return self.values if swept else [UNSWEPT]

    def options(self, value: str) -> list[str]:
        """The variant's settings a run at `value` overrides (KEY=VALUE): none but an option's."""
        return [f"{self.flag}={value}"] if self.option and value != UNSWEPT else []

    def run_flags(self, value: str) -> list[str]:
        """What a run at `value` gives base_train."""
        if value == UNSWEPT:
            return []
        return (["--variant-option", *self.options(value)] if self.option
                else [f"--{self.flag}", value])


def value_tag(value: str) -> str:
    """A swept value as run names hold it: itself when it is a short run name's letters, else
    the end of it in those letters and a hash of the whole (a path has '/', a hub dataset ':')."""
    if re.fullmatch(r"[A-Za-z0-9._-]{1,32}", value):
        return value
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", value)[-24:].strip("-.")
    return f"{slug}-{hashlib.sha256(value.encode()).hexdigest()[:8]}".lstrip("-")


class Job(NamedTuple):
    """One run: a variant at a swept value and a seed (by default the data order's too)."""
    variant: str
    value: str
    seed: int
    steps: int | None = None
    data_seed: int | None = None
    threads: int | None = None  # None: the ablation's
    group: int = 0  # which batch of its variant's seeds: seeds the budget adds train in their own

    def name(self, prefix: str, swept: str, last_seed: int | None = None) -> str:
        """The run's name; last_seed: of a batched run of seeds self.seed..last_seed."""
        seeds = f"{self.seed}-{last_seed}" if last_seed is not None else self.seed
        at = "" if self.value == UNSWEPT else f"{swept}{value_tag(self.value)}-"
        return (f"{prefix}-{self.variant}-{at}s{seeds}"
                + "".join(f"-{tag}{n}" for tag, n in (("d", self.data_seed), ("n", self.steps),
                                                        ("t", self.threads))
                          if n is not None and not (tag == "d" and n == self.seed)))


def run_one(job: Job, flags: list[str], sweep: "Sweep", nproc: int, threads: int, name: str,
            cache: dict, refiner: Tracker | None = None) -> dict:
    """One base_train run, or its cached record."""
    return run_batch([job], flags, sweep, nproc, threads, name, cache, refiner)[job]


RECORD_BYTES = 1 << 26  # a summary.json or cached record of 32 batched seeds holds far less


def read_json(path: Path, what: str):
    """A JSON record read back, bounded (never a FIFO or a link); one not `what` ends ablate."""
    try:
        return common.load_json(path, RECORD_BYTES, what, "remove it, and ablate runs it again")
    except ValueError as e:  # it names the file and what it is
        raise SystemExit(f"error: {e}") from None


def batches(todo: list[Job], batched: bool = True) -> list[list[Job]]:
    """The jobs as base_train runs: with `batched`, a variant's seeds at one value, length, data
    order and group train as one model; a job of --data-order seed runs alone."""
    groups = {}
    for job in todo:
        alone = not batched or job.data_seed is None
        key = (job.variant, job.value, job.steps, job.data_seed, job.threads, job.group,
               job.seed if alone else None)
        groups.setdefault(key, []).append(job)
    return list(groups.values())


def batch_key(jobs: list[Job], flags: list[str], sweep: "Sweep", nproc: int, threads: int,
              cache: dict) -> tuple[str, str, list[str], list[str]]:
    """(the key the cache keeps the record of one base_train run of the jobs' seeds under (cached
    finds it), its label in words, its flags, the flags that pick its variant, value and seeds).
    The key holds the thread count: it decides the order of floating-point sums; the variant's
    settings by value, and the ideas files that define it (and only those)."""
    first, seeds, alone = jobs[0], [job.seed for job in jobs], len(jobs) == 1
    variant, value, seed, steps, data_seed = first[:5]
    threads = first.threads or threads
    if steps is not None:
        flags = [*flags, "--num-iterations", str(steps)]
    data_seed = seed if data_seed is None else data_seed
    given = sweep.run_flags(value)
    parts = [*([] if alone else ["batched"]), variant, variant_key(variant, sweep.options(value)),
             given and sweep.flag, value, seed if alone else seeds, data_seed, flags, nproc,
             threads,
             *(cache[k] for k in ("tokenizer", "device", "dtype", "data", "code", "torch"))]
    who = (f"seed {seed}" + (f" data {data_seed}" if data_seed != seed else "") if alone
           else f"seeds {seeds[0]}-{seeds[-1]} batched")
    label = (f"{variant} " + (f"{sweep.flag} {value} " if given else "") + who
             + (f" at {steps} steps" if steps else ""))
    seed_flags = ["--seed", str(seed)] if alone else ["--seeds", ",".join(map(str, seeds))]
    return key_of(parts), label, flags, ["--optimizer", variant, *given, *seed_flags,
                                         "--data-seed", str(data_seed)]


def run_batch(jobs: list[Job], flags: list[str], sweep: "Sweep", nproc: int, threads: int,
              name: str, cache: dict, refiner: Tracker | None = None) -> dict:
    """job -> record of one base_train run of the jobs' seeds (batched when there are several), or
    its cached records (batch_key, cached), a batched seed's with the run's throughput and
    training time divided by the seeds."""
    first, seeds = jobs[0], [job.seed for job in jobs]
    key, label, flags, picks = batch_key(jobs, flags, sweep, nproc, threads, cache)
    if hit := cached(cache["dir"], key):
        tell(f"== {label}: cached ({hit[0].name})")  # whole among other threads' lines
        return {job: hit[1][str(job.seed)] for job in jobs}
    run = first.name(name, sweep.flag, None if len(jobs) == 1 else seeds[-1])
    # --start-over: what an uncached run of this name left (other code, say) is moved aside, kept
    used = ideas.ideas_of(first.variant)
    launch(label, [*flags, *(f for i in used for f in ("--ideas", str(i.path))), "--run", run,
                   *picks, "--start-over"], nproc, first.threads or threads,
           refiner and refiner.watch(len(seeds), label))
    if code_hash() != cache["code"]:  # the ablation's runs after this one would read other code
        raise SystemExit(f"error: nanomuon/ or scripts/ changed while {label} ran, so it is not "
                         "cached; run ablate again")
    summary = read_json(common.get_base_dir() / "runs" / run / "summary.json",
                        "the summary base_train wrote")
    read = summary.get("read") or dict(sources={}, outside=["code it did not record"])
    if changed := reads.changed(read["sources"]):  # edited, even if put back: it ran the edit
        raise SystemExit(f"error: {', '.join(changed)} changed while {label} ran, so it is not "
                         "cached; run ablate again")
    records = seed_results(summary, seeds, first.variant, first.value)
    if read["outside"]:  # an input no key holds: the result answers for this run alone
        tell(f"== {label}: not cached: it read {'; '.join(read['outside'])}, which no cache "
             "key can hold")
        for record in records.values():
            record["uncached"] = read["outside"]
    else:
        write_json(cache["dir"] / f"{key}-{key_of([read['sources']])}.json",
                   dict(read=read["sources"], records=records))
    return {job: records[str(job.seed)] for job in jobs}


def seed_results(summary: dict, seeds: list[int], variant: str, value: str) -> dict:
    """seed -> what ablate keeps of a run's summary, a batched seed's with the run's throughput
    and training time divided by the seeds."""
    shared = {k: summary[k] for k in KEPT if k in summary}
    if "tok_per_s" in shared:
        shared["tok_per_s"] /= len(seeds)
    shared["val_train_time"] = [t / len(seeds) for t in shared["val_train_time"]]
    per_seed = summary["per_seed"] if len(seeds) > 1 else {str(seeds[0]): {}}
    return {str(s): dict(shared, **{k: v for k, v in per_seed[str(s)].items() if k in KEPT},
                         variant=variant, value=value, seed=s)
            for s in seeds}


def cached(folder: Path, key: str) -> tuple[Path, dict] | None:
    """(file, seed -> record) of the run cached under key whose code is the files' now, or None.
    A key's files differ in the code their runs read: each lists those files with their hashes."""
    for path in sorted(folder.glob(f"{key}-*.json")):
        entry = read_json(path, "a record ablate cached")
        if not (isinstance(entry, dict) and isinstance(entry.get("read"), dict)
                and isinstance(entry.get("records"), dict)):
            raise SystemExit(f"error: {path} is not a record ablate cached; remove it, and "
                             "ablate runs it again")
        if not reads.changed(entry["read"]):
            return path, entry["records"]
    return None


def cache_of(flags: list[str]) -> dict:
    """The run cache for runs with base_train `flags`: its folder and what its keys hold besides
    each run's own settings; the data is prepared here, once."""
    q = argparse.ArgumentParser(add_help=False)
    q.add_argument("--device-type", default="auto")  # the last one given wins, as in base_train
    q.add_argument("--dtype", default="auto", choices=common.DTYPES)
    add_data_args(q, "embedded")
    run_flags = q.parse_known_args(flags)[0]
    device = common.check_device_type(run_flags.device_type)
    cache = dict(dir=common.get_base_dir() / "ablations" / "cache", code=code_hash(),
                 device_type=device, device=device_name(device), torch=torch.__version__,
                 tokenizer=read_json(tokenizer_dir() / "tokenizer.json",
                                     "the tokenizer's record").get("fingerprint"),
                 dtype=common.resolve_dtype(torch.device(device), run_flags.dtype))
    with common.user_errors():
        data = prepare(run_flags.dataset, run_flags.text_column, run_flags.val_fraction)
        cache["data"] = [data, data_fingerprint(data, cache["dir"] / "shards.json")]
    cache["dir"].mkdir(parents=True, exist_ok=True)
    print(f"== cache key: code {cache['code'][:12]}, data {cache['data'][1][:12]} ({data}), "
          f"torch {torch.__version__}", flush=True)
    return cache


def split_runs(results: dict) -> tuple[dict, dict]:
    """(variant, value, seed) -> record, and (seed, steps) -> record of the other lengths."""
    return ({job[:3]: r for job, r in results.items() if job.steps is None},
            {(job.seed, job.steps): r for job, r in results.items() if job.steps is not None})


def run_all(todo: list, flags: list[str], args, jobs: int, threads: int, cache: dict,
            refiner: Tracker | None = None) -> dict:
    """job -> record of every job in todo and of those `refiner` adds as runs end (its more())."""
    with ThreadPoolExecutor(jobs) as pool:
        given = (flags, args.sweep, args.nproc, threads, args.name, cache, refiner)

        def submit(batch: list[Job]):
            if len(batch) == 1:  # through run_one, which a study of made-up runs stands in for
                return pool.submit(lambda job: {job: run_one(job, *given)}, batch[0])
            return pool.submit(run_batch, batch, *given)

        futures = [submit(batch) for batch in batches(todo, args.batch_seeds)]
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    f.result()  # a failed run stops the ablation now
                more = [submit(b) for b in batches(refiner.more() if refiner else [],
                                                   args.batch_seeds)]
                futures, pending = futures + more, pending | set(more)
            return {job: r for f in futures for job, r in f.result().items()}
        # a failed run, or Ctrl-C: finish (and cache) the running ones, start no more
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise


def tell(line: str) -> None:
    """A line of ablate's own, whole among the runs' echoed lines, escaped (a --dataset path, a
    swept value or a run's own output may hold bytes that move the cursor)."""
    with _print_lock:
        print(common.shown(line, 100_000, quote=False), flush=True)


def write_json(path: Path, obj) -> None:
    common.write_atomic(path, json.dumps(obj))
