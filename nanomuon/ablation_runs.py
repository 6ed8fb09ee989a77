"""
An ablation's runs and their cache: each (variant, swept value, seed) as a scripts.base_train
process (seeds batched into one where they share a data order), its progress echoed, and its
record kept in ablations/cache/ under a key of everything that decides it: the variant, flags,
processes, threads, tokenizer, device, precision, data contents, code and torch. It lives apart
from ablate's command line so that a study of its own (scripts/noise.py) runs through the same
cache, and apart from the plan and the verdicts, which only read what the runs record.
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

from nanomuon.budget import Tracker
from nanomuon.common import (
    DTYPES,
    check_device_type,
    content_hashes,
    get_base_dir,
    load_json,
    resolve_dtype,
    user_errors,
    write_atomic,
)
from nanomuon.dataset import SPLITS, list_shards
from nanomuon.run import StepRecords
from nanomuon.sources import add_data_args, prepare
from nanomuon.tokenizer import tokenizer_dir
from nanomuon.variants import OPTIMIZER_VARIANTS

KEPT = ("final_val_bpb", "min_val_bpb", "final_eval_bpb", "final_eval_tokens", "val_history",
        "val_train_time", "tok_per_s", "optimizer_share", "num_params", "tokens_per_step", "run")
_print_lock = threading.Lock()
RUNNING = {}  # the base_train processes running now -> their labels: a stop ends them
# The code behind a result: the library (this file decides what a record holds) and all of
# scripts/ (base_train, what it imports, and ablate, which decides the runs' flags). Not a list
# of base_train's imports: it would go stale unnoticed when an import is added, and a needless
# re-run only costs time.
CODE_DIRS = (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1] / "scripts")


def code_hash(dirs=CODE_DIRS) -> str:
    """sha256 over the path (from the package up) and the contents of every .py file under dirs."""
    h = hashlib.sha256()
    for d in dirs:
        for p in sorted(d.rglob("[!.]*.py")):  # not an editor's .#lock files: none is imported
            rel = p.relative_to(d.parent).as_posix()
            h.update(f"{rel} {hashlib.sha256(p.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()


def data_fingerprint(name: str, memo: Path) -> str:
    """sha256 over the names and content hashes of dataset `name`'s train and val shards; the
    hashes are cached in `memo` (common.content_hashes), so GB-sized FineWeb shards are read once,
    not by every ablate."""
    shards = [(split, path) for split in SPLITS for path in list_shards(name, split)]
    hashes = content_hashes([path for _, path in shards], memo,
                            f"== hashing the new or changed shards of {name}")
    h = hashlib.sha256()
    for (split, path), digest in zip(shards, hashes):
        h.update(f"{split} {path.name} {digest}\n".encode())
    return h.hexdigest()


def device_name(device: str) -> str:
    """The device a run trains on, as precisely as torch or the OS names it: results and step
    times differ across them."""
    return f"{device} {torch.cuda.get_device_name() if device == 'cuda' else cpu_model()}"


def cpu_model() -> str:
    """This CPU's model as Linux names it (/proc/cpuinfo), else as platform guesses it."""
    with contextlib.suppress(OSError):
        if m := re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M):
            return m[1].strip()
    return platform.processor() or platform.machine()


PROGRESS_S = 30  # a run's step lines are echoed this often at most (its evals and the last: all)


def launch(label: str, run_flags: list[str], nproc: int, threads: int, watch=None) -> None:
    """Run scripts.base_train with run_flags (under torchrun when nproc > 1), echoing its progress
    lines prefixed by label: a step line every PROGRESS_S seconds at most (base_train prints each,
    so a batched run of slow steps still shows progress), every eval, warning and error; a failure
    exits with its last lines. base_train's step records (--step-record) say which lines are step
    lines and feed `watch` (a budget.RunWatch: the plan's Refiner), told of the process and of
    the run's end too."""
    launcher = (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [])
    with tempfile.TemporaryDirectory(prefix="ablate-") as tmp:
        records = StepRecords(Path(tmp) / "steps.jsonl")
        cmd = [sys.executable, *launcher, "-m", "scripts.base_train",
               *(["--"] if nproc > 1 else []), *run_flags, "--log-every", "1",
               "--step-record", str(records.path)]
        tell(f"== {label}: {' '.join(cmd[1:])}")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
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
    """Echo a run's lines as launch() says, its step lines (those its records hold, written before
    each is printed) PROGRESS_S apart but the last; returns its last 20 lines."""
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
        if step or line.startswith(("step ", "error", "warning", "final val")):
            shown = time.monotonic() if step else shown
            with _print_lock:
                print(f"  [{label}] {line}", end="", flush=True)
    return tail


def key_of(parts: list) -> str:
    """A cache file's key: a hash of everything that decides what it holds."""
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def value_tag(value: str) -> str:
    """A swept value as run names hold it: itself when it is a short run name's letters (0.02,
    1e-3, embedded); else (a local path has '/', a hub dataset ':') the end of it in those letters,
    at most 24, and a hash of the whole, so two values never share a run."""
    if re.fullmatch(r"[A-Za-z0-9._-]{1,32}", value):
        return value
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", value)[-24:].strip("-.")
    return f"{slug}-{hashlib.sha256(value.encode()).hexdigest()[:8]}".lstrip("-")


class Job(NamedTuple):
    """One run of an ablation: a variant at a value of the swept flag and a seed (the init's and,
    unless data_seed says otherwise, the data order's), for the runs' own steps unless `steps`
    gives other ones (then with a schedule of their own)."""
    variant: str
    value: str
    seed: int
    steps: int | None = None
    data_seed: int | None = None
    threads: int | None = None  # None: the ablation's
    group: int = 0  # which batch of its variant's seeds: seeds a plan adds train in their own

    def name(self, prefix: str, swept: str, last_seed: int | None = None) -> str:
        """The run's name; last_seed: of a batched run of seeds self.seed..last_seed."""
        seeds = f"{self.seed}-{last_seed}" if last_seed is not None else self.seed
        return (f"{prefix}-{self.variant}-{swept}{value_tag(self.value)}-s{seeds}"
                + "".join(f"-{tag}{n}" for tag, n in (("d", self.data_seed), ("n", self.steps),
                                                        ("t", self.threads))
                          if n is not None and not (tag == "d" and n == self.seed)))


def run_one(job: Job, flags: list[str], swept: str, nproc: int, threads: int, name: str,
            cache: dict, refiner: Tracker | None = None) -> dict:
    """One base_train run, or its cached record: _run_seeds of one job."""
    return _run_seeds([job], flags, swept, nproc, threads, name, cache, refiner)[job]


RECORD_BYTES = 1 << 26  # a summary.json or cached record of 32 batched seeds holds far less


def read_json(path: Path, what: str):
    """A JSON record read back, bounded (never a FIFO or a link): one that is not `what` ends
    ablate in one line naming it."""
    try:
        return load_json(path, RECORD_BYTES, what, "remove it, and ablate runs it again")
    except ValueError as e:  # it names the file and what it is
        raise SystemExit(f"error: {e}") from None


def trained(label: str, flags: list[str], run: str, run_flags: list[str], nproc: int,
            threads: int, cache: dict, watch=None) -> dict:
    """The summary.json of base_train with flags, --run `run` and run_flags, trained afresh (under
    launch's `watch`): an uncached run over an earlier one of the same name (other code, say)
    keeps the earlier one."""
    launch(label, [*flags, "--run", run, *run_flags, "--start-over"], nproc, threads, watch)
    if code_hash() != cache["code"]:  # the run may have imported other code than its key says
        raise SystemExit(f"error: nanomuon/ or scripts/ changed while {label} ran, so it is not "
                         "cached; run ablate again")
    return read_json(get_base_dir() / "runs" / run / "summary.json", "the summary base_train wrote")


def batches(todo: list[Job], batched: bool = True) -> list[list[Job]]:
    """The jobs as base_train runs: with `batched`, a variant's seeds at one value, length and data
    order train as one model in one process (base_train --seeds), on the same batches (those of
    one group: seeds a plan adds are a batch of their own); a job whose data order is its seed's
    own (--data-order seed) reads other batches and runs alone."""
    groups = {}
    for job in todo:
        alone = not batched or job.data_seed is None
        key = (job.variant, job.value, job.steps, job.data_seed, job.threads, job.group,
               job.seed if alone else None)
        groups.setdefault(key, []).append(job)
    return list(groups.values())


def run_batch(jobs: list[Job], flags: list[str], swept: str, nproc: int, threads: int, name: str,
              cache: dict, refiner: Tracker | None = None) -> dict:
    """job -> record of seeds trained as one batched base_train run (batches()), or its cached
    records; one job is run_one's."""
    if len(jobs) == 1:
        return {jobs[0]: run_one(jobs[0], flags, swept, nproc, threads, name, cache, refiner)}
    return _run_seeds(jobs, flags, swept, nproc, threads, name, cache, refiner)


def _run_seeds(jobs: list[Job], flags: list[str], swept: str, nproc: int, threads: int, name: str,
               cache: dict, refiner: Tracker | None = None) -> dict:
    """job -> record of one base_train run of the jobs' seeds (batched when there are several), or
    its cached records. The key holds the thread count: it decides the order of floating-point
    sums, so a run at other threads is another run. A batched seed's record is what its own run
    would record (base_train's per_seed), with the run's throughput and training time as the
    seed's share: divided by the seeds. A run trained is followed by `refiner` (a budget's)."""
    first, seeds, alone = jobs[0], [job.seed for job in jobs], len(jobs) == 1
    variant, value, seed, steps, data_seed = first[:5]
    threads = first.threads or threads
    if steps is not None:
        flags = [*flags, "--num-iterations", str(steps)]
    data_seed = seed if data_seed is None else data_seed
    parts = [*([] if alone else ["batched"]), variant, repr(OPTIMIZER_VARIANTS[variant]), swept,
             value, seed if alone else seeds, data_seed, flags, nproc, threads,
             *(cache[k] for k in ("tokenizer", "device", "dtype", "data", "code", "torch"))]
    path = cache["dir"] / f"{key_of(parts)}.json"
    who = (f"seed {seed}" + (f" data {data_seed}" if data_seed != seed else "") if alone
           else f"seeds {seeds[0]}-{seeds[-1]} batched")
    label = f"{variant} {swept} {value} {who}" + (f" at {steps} steps" if steps else "")
    if path.exists():
        print(f"== {label}: cached ({path.name})", flush=True)
        records = read_json(path, "a record ablate cached")
        return {first: records} if alone else {job: records[str(job.seed)] for job in jobs}
    seed_flags = ["--seed", str(seed)] if alone else ["--seeds", ",".join(map(str, seeds))]
    summary = trained(label, flags, first.name(name, swept, None if alone else seeds[-1]),
                      ["--optimizer", variant, f"--{swept}", value, *seed_flags, "--data-seed",
                       str(data_seed)], nproc, threads, cache,
                      refiner and refiner.watch(len(seeds), label))
    shared = {k: summary[k] for k in KEPT if k in summary}
    if alone:
        write_json(path, record := dict(shared, variant=variant, value=value, seed=seed))
        return {first: record}
    if "tok_per_s" in shared:
        shared["tok_per_s"] /= len(seeds)
    shared["val_train_time"] = [t / len(seeds) for t in shared["val_train_time"]]
    records = {str(seed): dict(shared, **{k: v for k, v in summary["per_seed"][str(seed)].items()
                                          if k in KEPT}, variant=variant, value=value, seed=seed)
               for seed in seeds}
    write_json(path, records)
    return {job: records[str(job.seed)] for job in jobs}


def cache_of(flags: list[str]) -> dict:
    """The run cache for runs with base_train `flags`: its folder and what its keys hold besides
    each run's own settings (the code, the data's contents, tokenizer, device, precision, torch);
    the data is prepared here, once, not by every run at once."""
    q = argparse.ArgumentParser(add_help=False)
    q.add_argument("--device-type", default="auto")  # the last one given wins, as in base_train
    q.add_argument("--dtype", default="auto", choices=DTYPES)
    add_data_args(q, "embedded")
    run_flags = q.parse_known_args(flags)[0]
    device = check_device_type(run_flags.device_type)
    cache = dict(dir=get_base_dir() / "ablations" / "cache", code=code_hash(), device_type=device,
                 device=device_name(device), torch=torch.__version__,
                 tokenizer=read_json(tokenizer_dir() / "tokenizer.json",
                                     "the tokenizer's record").get("fingerprint"),
                 dtype=resolve_dtype(torch.device(device), run_flags.dtype))
    with user_errors():
        data = prepare(run_flags.dataset, run_flags.text_column, run_flags.val_fraction)
        cache["data"] = [data, data_fingerprint(data, cache["dir"] / "shards.json")]
    cache["dir"].mkdir(parents=True, exist_ok=True)
    print(f"== cache key: code {cache['code'][:12]}, data {cache['data'][1][:12]} ({data}), "
          f"torch {torch.__version__}", flush=True)
    return cache


def split_runs(results: dict) -> tuple[dict, dict]:
    """(variant, value, seed) -> record of the runs at their own steps; (seed, steps) -> record of
    the baseline's runs at other lengths."""
    return ({job[:3]: r for job, r in results.items() if job.steps is None},
            {(job.seed, job.steps): r for job, r in results.items() if job.steps is not None})


def run_all(todo: list, flags: list[str], args, jobs: int, threads: int, cache: dict,
            refiner: Tracker | None = None) -> dict:
    """job -> record of every job in todo, batched (run_batch's), `jobs` runs at a time, and of
    the jobs `refiner` (an ablation_plan.Refiner) adds as runs end (its more()), in the order
    they were asked for."""
    with ThreadPoolExecutor(jobs) as pool:
        def submit(batch: list[Job]):
            return pool.submit(run_batch, batch, flags, args.sweep.flag, args.nproc, threads,
                               args.name, cache, refiner)

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
    """A line of ablate's own, whole among the runs' echoed lines."""
    with _print_lock:
        print(line, flush=True)


def write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj))
