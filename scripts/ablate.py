"""
Compare optimizer variants on identical data and token budget, over seeds and the values of one
swept base_train flag (an lr, usually): a table of means and 95% intervals, a verdict per variant
against the baseline, and plots of val bpb.

    python -m scripts.ablate   # muon vs adamw: planned to 15 min on 2 CPU cores (30 without bf16)
    python -m scripts.ablate --variants muon,muon-plus --budget 20m
    python -m scripts.ablate --variants muon,adamw --sweep lr-multiplier=0.5,1,2 --num-iterations 300
    python -m scripts.ablate --variants muon --sweep matrix-lr=0.005,0.01,0.02 --seeds 3

Each (variant, swept value, seed) is a scripts.base_train run with --optimizer, the swept flag,
--seed set to the seed (the init) and --data-seed to 1 (--data-order fixed, the default: one
order of the documents for every run, as track 3 reads its data) or to the seed. On one data
order a variant's seeds at a value train as one batched model in one process (base_train
--seeds; --no-batch-seeds: a process each). Flags this script does not know go to base_train
after the defaults below, so they override them (GPU runs: docs/research.md). Finished runs are
cached in ablations/cache/, keyed by everything that decides
them (the variant's definition, seeds, swept flag and value, base_train flags, processes,
tokenizer, the device and the precision --dtype resolves to, the contents of the train and val
shards and of every .py file in nanomuon/ and scripts/, the torch version), so a re-run or an
interrupted ablation skips them, and an edit of code or data reruns. The baseline also runs at
--baseline-lengths of the steps (on the first 2 seeds), which turn each verdict into steps saved.
"""

import argparse
import contextlib
import functools
import hashlib
import io
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import NamedTuple

import torch

import nanomuon
from nanomuon.budget import (
    CPU_BUDGETS,
    FIRST_SEEDS,
    HEADROOM,
    LENGTH_SEEDS,
    MIN_STEPS,
    PRIOR_STEP_RATIO,
    WRITE_UP_S,
    Calibration,
    Plan,
    Tracker,
    at_load,
    budget_arg,
    budget_refusal,
    contention,
    eval_times,
    fit,
    grow,
    machine_load,
    modeled,
    prior,
    probe_step,
    projected_detectable,
    read_calibration,
    read_plan,
    smallest,
)
from nanomuon.common import (
    DTYPES,
    check_device_type,
    content_hashes,
    get_base_dir,
    load_json,
    resolve_compile,
    resolve_dtype,
    user_errors,
    write_atomic,
)
from nanomuon.dataset import SPLITS, list_shards
from nanomuon.gpt import config_from_depth
from nanomuon.recipe import (
    NANOCHAT_BATCH,
    RULE_STEPS,
    SHORT_RUN_EXPONENT,
    SHORT_RUN_FLOOR,
    rule_lrs,
    short_run_matrix_lr,
)
from nanomuon.report import MISSING, plot_curves
from nanomuon.run import StepRecords, lock_run_dir, run_arg, unlock_run_dir
from nanomuon.sources import add_data_args, prepare
from nanomuon.stats import (
    RECORD_EFFECT,
    bpb_per_log_step,
    detectable_factor,  # noqa: F401 (scripts/noise.py reads it here)
    fmt,
    mean_ci,
    paired,
    steps_verdict,
    steps_words,
    verdict,
)
from nanomuon.tokenizer import tokenizer_dir
from nanomuon.variants import OPTIMIZER_VARIANTS
from scripts.base_train import parse_args as train_args

# A tiny GPT (depth 4, 5M params) on the embedded corpus in speedrun.sh's CPU shape (200 steps of
# 4,096 tokens, where the lr rule's lrs were tuned: docs/lr_rule.md), compiled (1.4x the eager
# steps here), 5 seeds; on a CPU, the seeds and steps fit() plans to CPU_BUDGETS. The curves' val
# set is the speedrun's, the first 65,536 tokens; the verdicts read the final weights over 4x as
# many (at 200 steps and 5 seeds that halved the paired spread, as much as the whole split).
DEFAULT_STEPS, DEFAULT_SEEDS = RULE_STEPS, 5
# On a GPU a batched run of the default shape's seeds fills the device where one seed's 4,096
# tokens a step leave it idle: 64 seeds, each variant's in one process (scripts/gpu_check.sh's
# ablate step measures what they resolve and how long they take)
GPU_SEEDS = 64
DEFAULT_SWEEP, DEFAULT_LENGTHS = "lr-multiplier=1", "0.8"
# --arch classic: the model ablate's defaults and the lr rule were measured on, on a GPU too
# (base_train's auto would train arch 'nanochat' there); give --arch nanochat to ablate that one
DEFAULT_FLAGS = ["--arch", "classic", "--dataset", "embedded", "--depth", "4", "--max-seq-len", "256",
                 "--device-batch-size", "8", "--total-batch-size", "4096",
                 "--num-iterations", str(DEFAULT_STEPS), "--eval-every", "50",
                 "--eval-tokens", "65536", "--final-eval-tokens", "262144", "--warmdown-ratio",
                 "0.3", "--sample-tokens", "0", "--compile"]


class Preset(NamedTuple):
    """A named shape for ablate: base_train flags (after the defaults, before yours) and the vocab
    of its own tokenizer; it lives in a base dir of its own (presets/<name>), runs and all."""
    flags: list
    vocab: int
    about: str


PRESETS = {
    # The regime the published optimizer results come from (track 3 trains ~20 tokens per param,
    # most in matrices): 524,288 params, 75% in Muon's block matrices (a 512-token vocab keeps the
    # embedding and head small), 640 steps of 8,192 tokens = 10.0 tokens per param.
    "regime": Preset(["--depth", "2", "--aspect-ratio", "64", "--head-dim", "64",
                      "--max-seq-len", "256", "--device-batch-size", "16", "--total-batch-size", "8192",
                      "--num-iterations", "640", "--eval-every", "160",
                      "--final-eval-tokens", "0"], 512,  # a larger val set did not help here
                     "depth 2, width 128 (2 heads), vocab 512: 524,288 params, 75% in Muon matrices, "
                     "10.0 tokens per param"),
}


class Published(NamedTuple):
    """What a source reported for a variant against Muon: the sign of variant minus Muon (in loss
    or steps: -1 better, 0 no difference, +1 worse) and where, in words."""
    sign: int
    source: str


# The published sign of each technique against Muon, from modded-nanogpt's optimization track
# (track 3: steps to 3.28 val loss, a 124M GPT on FineWeb; records/track_3_optimization/README.md),
# each against the Muon it was run beside. ablation.md says whether each verdict agrees.
PUBLISHED = {
    "adamw": Published(+1, "track 3: Adam 5625 steps (record 2) against Muon's 3600 (record 1)"),
    "muon-soap": Published(-1, "track 3 record 14: 3150 steps against 3225 (record 11)"),
    "muon-uw-floor": Published(0, "track 3 record 9: 3250 steps, as NorMuon alone (record 10)"),
    "muon-hyperball": Published(0, "track 3 record 37: 3250 steps, as the tuned Muon (record 36); "
                                "better only than an untuned one (record 5: 3325 against 3500)"),
    "muon-powercool": Published(-1, "track 3 record 20: 3030 steps against 3125 (record 16), "
                                "with Soft-Muon"),
    "muon-contra": Published(-1, "track 3 record 11: 3225 steps against 3250 (record 9); "
                             "p = 0.69, not significant"),
    "muon-muown": Published(-1, "track 3 record 23: 3075 steps against Muon's 3325 (record 12), "
                            "with PowerCool"),
    "muon-newton": Published(-1, "track 3 record 15: 3275 steps against Muon's 3325 (record 12)"),
}
SIGN_WORDS = {-1: "better", 0: "no difference", +1: "worse"}


def published_sign(variant: str, baseline: str) -> Published | None:
    """What was published for variant against baseline: PUBLISHED's entry against muon, or an
    entry's sign turned round for muon against it; None where nothing was."""
    if baseline == "muon":
        return PUBLISHED.get(variant)
    if variant == "muon" and baseline in PUBLISHED:
        return PUBLISHED[baseline]._replace(sign=-PUBLISHED[baseline].sign)
    return None


def against_published(diffs: list[float], published: Published) -> str:
    """Whether the paired differences' 95% interval agrees with the published sign, disagrees,
    or cannot tell (it holds zero where a difference was published)."""
    c = paired(diffs) if len(diffs) > 1 else dict(lo=-math.inf, hi=math.inf)
    seen = -1 if c["hi"] < 0 else 1 if c["lo"] > 0 else 0
    word = ("agrees" if seen == published.sign else "disagrees" if seen
            else "cannot tell (the interval holds zero)")
    return f"{word}; published: {SIGN_WORDS[published.sign]} ({published.source})"


KEPT = ("final_val_bpb", "min_val_bpb", "final_eval_bpb", "final_eval_tokens", "val_history",
        "val_train_time", "tok_per_s", "optimizer_share", "num_params", "tokens_per_step", "run")
_print_lock = threading.Lock()
RUNNING = {}  # the base_train processes running now -> their labels: a stop ends them
# The code behind a result: the library and all of scripts/ (base_train, what it imports, and
# ablate, which decides what a record holds). Not a list of base_train's imports: it would go stale
# unnoticed when an import is added, and a needless re-run only costs time.
CODE_DIRS = (Path(nanomuon.__file__).resolve().parent, Path(__file__).resolve().parent)


def name_arg(s: str) -> str:
    """argparse type for --name: it prefixes run names and names a folder in ablations/."""
    if run_arg(s) == "cache":
        raise argparse.ArgumentTypeError("'cache' holds the finished runs: pick another --name")
    return s


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


def first_reaching(target: float, record: dict):
    """(step, training seconds) of the first eval at or below target, or None."""
    return next(((step, t)
                 for (step, bpb), t in zip(record["val_history"], record["val_train_time"])
                 if bpb <= target), None)


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
    """One base_train run, or its cached record. The key holds the thread count: it decides the
    order of floating-point sums, so a run at other threads is another run. A run trained is
    followed by `refiner` (a budget's)."""
    variant, value, seed, steps, data_seed = job[:5]
    threads = job.threads or threads
    if steps is not None:
        flags = [*flags, "--num-iterations", str(steps)]
    data_seed = seed if data_seed is None else data_seed
    parts = [variant, repr(OPTIMIZER_VARIANTS[variant]), swept, value, seed, data_seed, flags,
             nproc, threads,
             *(cache[k] for k in ("tokenizer", "device", "dtype", "data", "code", "torch"))]
    path = cache["dir"] / f"{key_of(parts)}.json"
    label = (f"{variant} {swept} {value} seed {seed}" + (f" data {data_seed}" if data_seed != seed
                                                         else "")
             + (f" at {steps} steps" if steps else ""))
    if path.exists():
        print(f"== {label}: cached ({path.name})", flush=True)
        return read_json(path, "a record ablate cached")
    run = job.name(name, swept)
    summary = trained(label, flags, run, ["--optimizer", variant, f"--{swept}", value, "--seed",
                                          str(seed), "--data-seed", str(data_seed)],
                      nproc, threads, cache, refiner and refiner.watch(1, label))
    record = dict({k: summary[k] for k in KEPT if k in summary}, variant=variant, value=value,
                  seed=seed)
    write_json(path, record)
    return record


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
    records; one job is run_one's. A seed's record is what its own run would record (base_train's
    per_seed), with the run's throughput and training time as the seed's share: divided by the
    seeds. A run trained is followed by `refiner` (a budget's)."""
    if len(jobs) == 1:
        return {jobs[0]: run_one(jobs[0], flags, swept, nproc, threads, name, cache, refiner)}
    first, seeds = jobs[0], [job.seed for job in jobs]
    variant, value, _, steps, data_seed = first[:5]
    threads = first.threads or threads
    if steps is not None:
        flags = [*flags, "--num-iterations", str(steps)]
    parts = ["batched", variant, repr(OPTIMIZER_VARIANTS[variant]), swept, value, seeds,
             data_seed, flags, nproc, threads,
             *(cache[k] for k in ("tokenizer", "device", "dtype", "data", "code", "torch"))]
    path = cache["dir"] / f"{key_of(parts)}.json"
    label = (f"{variant} {swept} {value} seeds {seeds[0]}-{seeds[-1]} batched"
             + (f" at {steps} steps" if steps else ""))
    if path.exists():
        print(f"== {label}: cached ({path.name})", flush=True)
        records = read_json(path, "a record ablate cached")
        return {job: records[str(job.seed)] for job in jobs}
    run = first.name(name, swept, seeds[-1])
    summary = trained(label, flags, run, ["--optimizer", variant, f"--{swept}", value, "--seeds",
                                          ",".join(map(str, seeds)), "--data-seed",
                                          str(data_seed)], nproc, threads, cache,
                      refiner and refiner.watch(len(seeds), label))
    shared = {k: summary[k] for k in KEPT if k in summary}
    if "tok_per_s" in shared:
        shared["tok_per_s"] /= len(seeds)
    shared["val_train_time"] = [t / len(seeds) for t in shared["val_train_time"]]
    records = {str(seed): dict(shared, **{k: v for k, v in summary["per_seed"][str(seed)].items()
                                          if k in KEPT}, variant=variant, value=value, seed=seed)
               for seed in seeds}
    write_json(path, records)
    return {job: records[str(job.seed)] for job in jobs}


class Sweep(NamedTuple):
    """The base_train flag an ablation sweeps (without its dashes) and its values, as given."""
    flag: str
    values: list[str]


def sweep_table(final: dict, variants: list[str], sweep: Sweep, seeds: list[int],
                best: dict) -> list[str]:
    """Markdown: final val bpb at each swept value, and each value minus the variant's best,
    paired by seed, with its 95% interval: whether the best is better than its neighbours."""
    heads = [f"{sweep.flag} {v}" for v in sweep.values]
    lines = ["Final val bpb per swept value (mean ± std [95% CI]); the best per variant in bold:",
             "", "| variant | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for v in variants:
        cells = [f"**{fmt(final[v, x])}**" if x == best[v] else fmt(final[v, x])
                 for x in sweep.values]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    if len(seeds) > 1:
        lines += ["", "Each value minus the variant's best, paired by seed (mean [95% CI]):", "",
                  "| variant | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
        for v in variants:
            cells = []
            for x in sweep.values:
                c = paired([a - b for a, b in zip(final[v, x], final[v, best[v]])])
                cells.append("(best)" if x == best[v] else
                             f"{c['mean']:+.4f} [{c['lo']:+.4f}, {c['hi']:+.4f}]")
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
    edge = [f"{v} ({best[v]})" for v in variants if best[v] in (sweep.values[0], sweep.values[-1])]
    return lines + ["", f"At the edge of the sweep: {', '.join(edge)}; widen --sweep to find "
                    "their best." if edge else "Every best lies inside the sweep.", ""]


def final_bpb(record: dict) -> float:
    """What a verdict compares: the run's final weights over base_train's --final-eval-tokens
    when it scored them (a larger val set), else its last eval."""
    return record.get("final_eval_bpb", record["final_val_bpb"])


def own_steps(results: dict, variant: str, value: str, seeds: list[int]) -> int:
    """The steps the runs trained for (their last eval's), as the baseline's first seed ran."""
    return results[variant, value, seeds[0]]["val_history"][-1][0]


def baseline_finals(results: dict, lengths: dict, seeds: list[int], baseline: str,
                    value: str) -> dict:
    """steps -> the baseline's per-seed final bpbs at each length it ran (its own and `lengths`:
    (seed, steps) -> record), over the seeds that ran every length (the first LENGTH_SEEDS); its
    own length alone, over every seed, when there are none."""
    own = own_steps(results, baseline, value, seeds)
    others = sorted({n for _, n in lengths})
    ran = [s for s in seeds if all((s, n) in lengths for n in others)] if others else []
    finals = {own: [final_bpb(results[baseline, value, s]) for s in ran or seeds]}
    return finals | {n: [final_bpb(lengths[s, n]) for s in ran] for n in others if ran}


def report(results: dict, variants: list[str], sweep: Sweep, seeds: list[int],
           baseline: str, lengths: dict | None = None) -> tuple:
    """(markdown lines, the best swept value per variant): the sweep, the comparison and the
    verdicts, in bpb and (with the baseline at other lengths: (seed, steps) -> record) in steps."""
    final = {(v, x): [final_bpb(results[v, x, s]) for s in seeds]
             for v in variants for x in sweep.values}
    best = {v: min(sweep.values, key=lambda x: statistics.fmean(final[v, x])) for v in variants}
    lines = sweep_table(final, variants, sweep, seeds, best) if len(sweep.values) > 1 else []
    base_runs = [results[baseline, best[baseline], s] for s in seeds]
    target = statistics.fmean(final_bpb(r) for r in base_runs)
    # the curves' set: the steps and seconds to the baseline's last eval on it
    curve_target = statistics.fmean(r["final_val_bpb"] for r in base_runs)
    finals = baseline_finals(results, lengths or {}, seeds, baseline, best[baseline])
    slope = bpb_per_log_step(finals) if len(finals) > 1 else (math.nan, math.nan, 0)
    own = own_steps(results, baseline, best[baseline], seeds)
    # a new idea judged at the baseline's tuned lrs may lose for its lr alone: say so where it is
    untuned = ("" if len(sweep.values) > 1 else f"; each variant at {sweep.flag} "
               f"{sweep.values[0]} only, not at its own best (--sweep {sweep.flag}=a,b,c)")
    known = {v: published_sign(v, baseline) for v in variants if v != baseline}
    extra = (" against the published sign |", "---|") if any(known.values()) else ("", "")
    lines += [f"| variant | {sweep.flag} | final val bpb (mean ± std [95% CI]) | steps to "
              f"{curve_target:.4f} | train seconds to {curve_target:.4f} | tok/s | vs {baseline} "
              f"|{extra[0]}", "|---|---:|---:|---:|---:|---:|---|" + extra[1]]
    for v in variants:
        runs = [results[v, best[v], s] for s in seeds]
        reached = [x for x in (first_reaching(curve_target, r) for r in runs) if x is not None]
        count = "" if len(reached) == len(runs) else f" ({len(reached)}/{len(runs)} reached)"
        steps = fmt([float(x[0]) for x in reached], 1) + count if reached else "not reached"
        secs = fmt([x[1] for x in reached], 1) + count if reached else "not reached"
        diffs = [final_bpb(r) - final_bpb(b) for r, b in zip(runs, base_runs)]
        tok_s = statistics.fmean(r.get("tok_per_s", math.nan) for r in runs)
        vs = ("(baseline)" if v == baseline else
              f"{verdict(diffs, target)}; {steps_words(steps_verdict(diffs, slope, own))}"
              + untuned)
        if extra[0]:
            vs += " | " + (against_published(diffs, known[v]) if known.get(v) else
                           "(baseline)" if v == baseline else "nothing published")
        lines.append(f"| {v} | {best[v]} | {fmt([final_bpb(r) for r in runs])} | {steps} | "
                     f"{secs} | {tok_s:,.0f} | {vs} |")
    if "final_eval_bpb" in base_runs[0]:
        lines += ["", f"Final val bpb and the verdicts: each run's final weights over "
                  f"{base_runs[0]['final_eval_tokens']:,} val tokens (base_train "
                  "--final-eval-tokens); the steps and seconds columns and the curves: the evals "
                  "of --eval-tokens."]
    if len(finals) > 1:
        b, b_se, _ = slope
        lines += ["", f"Steps: {baseline} also ran {', '.join(str(n) for n in finals if n != own)} "
                  f"steps (each with its own schedule, on the first {len(finals[own])} seeds); its "
                  f"final bpb falls by {-b * math.log(2):.4f} ± {b_se * math.log(2):.4f} per "
                  "doubling of the steps (a line in ln(steps), an intercept per seed), which turns "
                  "each difference into steps."]
    return lines, best


def difference_panel(results: dict, variants: list[str], seeds: list[int], best: dict,
                     baseline: str) -> dict:
    """The paired differences in val bpb (variant minus baseline, seed by seed) at each eval, their
    mean with its 95% interval as a band, around zero a band of +- the smallest final effect this
    design detects, and at the last step the verdict's own difference with its interval (the
    final weights over the larger val set, where the runs scored one): the panel agrees with the
    table beside it."""
    series, colors, dashed = {}, {}, []
    for v in (v for v in variants if v != baseline):
        pairs = [(results[v, best[v], s], results[baseline, best[baseline], s]) for s in seeds]
        n = min(len(r["val_history"]) for pair in pairs for r in pair)
        steps = [pairs[0][0]["val_history"][i][0] for i in range(n)]
        stats = [mean_ci([r["val_history"][i][1] - b["val_history"][i][1] for r, b in pairs])
                 for i in range(n)]
        series[f"{v} - {baseline}"] = (steps, [m for m, _, _ in stats],
                                       [m - hw for m, _, hw in stats],
                                       [m + hw for m, _, hw in stats])
        c = paired([final_bpb(r) - final_bpb(b) for r, b in pairs])
        d = c["detectable"]
        series[f"{v}: detectable +-{d:.4f}"] = (steps, [0.0] * n, [-d] * n, [d] * n)
        # the verdict's own numbers: the final weights over --final-eval-tokens, at the last step
        verdict_label = f"{v} - {baseline}: the verdict's final eval"
        series[verdict_label] = ([steps[-1]], [c["mean"]], [c["lo"]], [c["hi"]])
        # the variant's color in every panel; its detectable band dashed in the same color
        colors.update({f"{v} - {baseline}": f"C{variants.index(v)}",
                       f"{v}: detectable +-{d:.4f}": f"C{variants.index(v)}",
                       verdict_label: f"C{variants.index(v)}"})
        dashed.append(f"{v}: detectable +-{d:.4f}")
    return dict(title="variant - baseline, paired by seed (band: 95% CI)", xlabel="step",
                ylabel="val bpb difference (< 0: better)", series=series, colors=colors,
                dashed=dashed)


def steps_panel(results: dict, variants: list[str], seeds: list[int], best: dict, baseline: str,
                finals: dict) -> dict:
    """The baseline's final bpb by its length (each with its own schedule; band: seeds' min to
    max), and each variant's mean final bpb drawn from its own steps back to where the
    baseline's line reaches it: the gap is the steps it saves."""
    lengths = sorted(finals)
    slope = bpb_per_log_step(finals)[0]
    own = own_steps(results, baseline, best[baseline], seeds)
    series = {f"{baseline} at each length": (
        lengths, [statistics.fmean(finals[n]) for n in lengths], [min(finals[n]) for n in lengths],
        [max(finals[n]) for n in lengths])}
    colors, dashed = {f"{baseline} at each length": f"C{variants.index(baseline)}"}, []
    for v in (v for v in variants if v != baseline):
        diff = statistics.fmean(final_bpb(results[v, best[v], s]) -
                                final_bpb(results[baseline, best[baseline], s]) for s in seeds)
        bpb = statistics.fmean(finals[own]) + diff
        reached = own * math.exp(diff / slope) if slope < 0 else math.nan
        series[v] = ([own, reached], [bpb, bpb])
        colors[v] = f"C{variants.index(v)}"
        dashed.append(v)
    return dict(title="steps: the baseline at other lengths", xlabel="steps (log)",
                ylabel="final val bpb", series=series, colors=colors, dashed=dashed, logx=True)


def plot(out, results: dict, variants: list[str], sweep: Sweep, seeds: list[int], best: dict,
         baseline: str, title: str, lengths: dict):
    """Each variant minus the baseline, paired by seed, with its interval and the smallest effect
    the design detects; val bpb by step and by training time at each variant's best value (mean
    over seeds, band: min to max); final val bpb against the swept value when there are several."""
    by_step, by_time, by_value = {}, {}, {}
    for v in variants:
        runs = [results[v, best[v], s] for s in seeds]
        n = min(len(r["val_history"]) for r in runs)
        bpb = [[r["val_history"][i][1] for r in runs] for i in range(n)]
        band = ([statistics.fmean(b) for b in bpb], [min(b) for b in bpb], [max(b) for b in bpb])
        by_step[v] = ([runs[0]["val_history"][i][0] for i in range(n)], *band)
        by_time[v] = ([statistics.fmean(r["val_train_time"][i] for r in runs) for i in range(n)],
                      *band)
        finals = [[final_bpb(results[v, x, s]) for s in seeds] for x in sweep.values]
        by_value[v] = (value_axis(sweep.values)[0], [statistics.fmean(f) for f in finals],
                       [min(f) for f in finals], [max(f) for f in finals])
    panels = [difference_panel(results, variants, seeds, best, baseline)] if len(seeds) > 1 else []
    finals = baseline_finals(results, lengths, seeds, baseline, best[baseline])
    if len(finals) > 1:
        panels.append(steps_panel(results, variants, seeds, best, baseline, finals))
    panels += [dict(title="val bpb by step (band: seeds' min to max)", xlabel="step",
                   ylabel="bits per byte",
                   series=by_step),
              dict(title="val bpb by training time", xlabel="training seconds (no evals)",
                   ylabel="bits per byte",
                   series=by_time)]
    if len(sweep.values) > 1:
        panels.append(dict(title=f"final val bpb by {sweep.flag}", xlabel=sweep.flag,
                           ylabel="bits per byte", series=by_value,
                           **value_axis(sweep.values)[1]))
    return plot_curves(out / "val_bpb.png", panels, title=title)


def value_axis(values: list[str]) -> tuple[list[float], dict]:
    """The swept values' x positions and the panel's axis options: numbers where they are (log
    when all are > 0), else one place each, labelled as run names hold them (a dataset's path)."""
    try:
        xs = [float(x) for x in values]
    except ValueError:
        return list(range(len(values))), dict(xticks=(list(range(len(values))),
                                                      [value_tag(x) for x in values]))
    return xs, dict(logx=all(x > 0 for x in xs))


def sweep_arg(s: str) -> Sweep:
    """argparse type for --sweep FLAG=V1,V2,...: the values distinct, in numeric order."""
    flag, _, given = s.partition("=")
    flag = flag.strip().removeprefix("--")
    values = [v.strip() for v in given.split(",")] if given.strip() else []
    if empty := [i for i, v in enumerate(values, 1) if not v]:
        raise argparse.ArgumentTypeError(f"{s!r}: value {empty[0]} is empty; give each value "
                                         "between commas, like lr-multiplier=0.5,1,2")
    if not re.fullmatch(r"[a-z][a-z0-9-]*", flag) or not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{s!r}: give a base_train flag and distinct values, "
                                         "like lr-multiplier=0.5,1,2 or matrix-lr=0.01,0.02")
    with contextlib.suppress(ValueError):  # not all numbers (a choice flag): the order given
        values = sorted(values, key=float)
        same = [f"{a} and {b}" for a, b in zip(values, values[1:]) if float(a) == float(b)]
        if same:
            raise argparse.ArgumentTypeError(f"{s!r}: {same[0]} are the same value (two identical "
                                             "runs); give each value once")
    return Sweep(flag, values)


def lengths_arg(s: str) -> list[float]:
    """argparse type for --baseline-lengths: distinct fractions of the steps, each > 0 and not 1."""
    if s.strip() == "none":
        return []
    try:
        values = [float(v) for v in s.split(",")]
    except ValueError:
        values = []
    if not values or len(set(values)) != len(values) or not all(0 < v < 10 and v != 1
                                                                 for v in values):
        raise argparse.ArgumentTypeError(f"{s!r}: give distinct fractions of the steps other than "
                                         "1, like 0.8 or 0.7,1.4, or 'none'")
    return values


RESERVED = ("run", "optimizer", "resume-from-step", "seed", "data-seed")  # set per run
DATA_FLAGS = ("dataset", "text-column", "val-fraction")  # base_train's flags that pick the data


def parse_args(argv):
    """(args, flags for base_train): args.variants, args.baseline and args.sweep checked and
    resolved; every run's flags parsed by base_train once here, so a bad one stops ablate now."""
    p = argparse.ArgumentParser(description="Compare optimizer variants (other flags go to "
                                "base_train)",
                                allow_abbrev=False,
                                epilog=f"variants: {', '.join(OPTIMIZER_VARIANTS)}")
    p.add_argument("--variants", default="muon,adamw",
                   help="comma-separated OPTIMIZER_VARIANTS keys (one is enough for a --sweep)")
    p.add_argument("--baseline", default=None, help="variant the others are judged against and "
                   "race to (default: adamw if compared, else the first)")
    p.add_argument("--seeds", type=int, default=None,
                   help=f"runs per variant and value, seeds 1..N of the init (default "
                   f"{DEFAULT_SEEDS}, or --budget's choice; {GPU_SEEDS} on a GPU, batched)")
    p.add_argument("--data-order", choices=("fixed", "seed"), default="fixed",
                   help="fixed: every run reads the documents in one order (data seed 1), as "
                   "track 3 does, so the verdict is at that order and the seeds vary the init "
                   "alone (at the default shape ~20x less variance: docs/research.md); seed: "
                   "each seed sets the data order too, a verdict across orders (default: fixed)")
    p.add_argument("--budget", type=budget_arg, default=None,
                   help="wall time for the whole ablation (600, 90s, 10m, 1.5h): --num-iterations "
                   "(and --seeds, unless given) are planned to fit it from the runs' times kept "
                   "on this machine, or the smallest plan runs first and its own steps time it; "
                   "the plan is printed before the runs start and refined as they go")
    p.add_argument("--sweep", type=sweep_arg, default=sweep_arg(DEFAULT_SWEEP),
                   help="a base_train flag and the values to try, e.g. lr-multiplier=0.5,1,2 or "
                   "embedding-lr=0.1,0.2; each variant is compared at its best value (default: "
                   "lr-multiplier=1: the lrs tuned for the default shape)")
    p.add_argument("--baseline-lengths", type=lengths_arg, default=lengths_arg(DEFAULT_LENGTHS),
                   help="the baseline also runs these fractions of the steps, each with its own "
                   "schedule, per seed, to turn each verdict into steps saved (track 3's currency; "
                   f"default {DEFAULT_LENGTHS}; 'none' to skip)")
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="a named shape with a tokenizer of its own, in a base dir of its own "
                   "(<base>/presets/NAME): " + "; ".join(f"{k}: {v.about}" for k, v in PRESETS.items())
                   .replace("%", "%%"))  # argparse formats help with %
    p.add_argument("--jobs", type=int, default=0,
                   help="runs at a time (0: one per CPU core for CPU runs of one process, else 1)")
    p.add_argument("--batch-seeds", action=argparse.BooleanOptionalAction, default=True,
                   help="train each variant's seeds as one batched model in one process "
                   "(base_train --seeds); --no-batch-seeds: a process per seed")
    p.add_argument("--name", type=name_arg, default="ablation",
                   help="names the output directory and prefixes the run names")
    p.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun when > 1)")
    args, extra = p.parse_known_args(argv)
    args.budget_default = False  # default_budget's: a budget that plans but never refuses
    spec, args.variants = args.variants, [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in OPTIMIZER_VARIANTS]
    fewest = 1 if len(args.sweep.values) > 1 else 2
    if unknown or len(args.variants) < fewest or len(set(args.variants)) != len(args.variants):
        p.error(f"--variants needs {'one' if fewest == 1 else 'two'} or more distinct names from "
                f"{', '.join(OPTIMIZER_VARIANTS)}; got {spec!r}"
                + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    args.baseline = args.baseline or ("adamw" if "adamw" in args.variants else args.variants[0])
    if args.baseline not in args.variants:
        p.error(f"--baseline {args.baseline!r} is not among --variants {spec!r}")
    if args.nproc < 1 or (args.seeds is not None and args.seeds < 1) or args.jobs < 0:
        p.error(f"--nproc and --seeds must be >= 1 and --jobs >= 0; got {args.nproc}, {args.seeds} "
                f"and {args.jobs}")
    given = {f.split("=")[0] for f in extra if f.startswith("--") and len(f) > 2}
    if any(f"--{r}".startswith(f) for f in given for r in RESERVED):
        p.error(f"{', '.join('--' + r for r in RESERVED)} are set per run by ablate; use --name, "
                "--variants, --seeds and --sweep")
    if args.sweep.flag in DATA_FLAGS:
        p.error(f"--sweep {args.sweep.flag}: each value would be judged on its own val set, so "
                "their val bpb cannot name a winner; run one ablation per dataset (--dataset X)")
    if args.sweep.flag in RESERVED or f"--{args.sweep.flag}" in given:
        p.error(f"--sweep {args.sweep.flag} sets --{args.sweep.flag} per run: "
                + ("ablate sets it" if args.sweep.flag in RESERVED else "do not give it as well"))
    flags = [*DEFAULT_FLAGS, *(PRESETS[args.preset].flags if args.preset else []), *extra]
    for value in args.sweep.values:
        if problem := sweep_value_problem(flags, args.sweep.flag, value):
            p.error(problem)
    return args, flags


def sweep_value_problem(flags: list[str], flag: str, value: str) -> str | None:
    """What base_train would refuse in this --sweep value, said before any run starts."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            train_args([*flags, f"--{flag}", value])
    except SystemExit:
        why = said.getvalue().strip().splitlines()[-1].split("error: ", 1)[-1]
        if why.startswith("unrecognized arguments") and takes_no_value(flags, flag):
            return (f"--sweep {flag}=...: --{flag} is a switch, it takes no value; run one "
                    f"ablation with --{flag} and one without it")
        if why.startswith("unrecognized arguments"):
            return (f"--sweep {flag}=...: base_train has no --{flag} (its flags: python -m "
                    "scripts.base_train --help)")
        return f"--sweep {flag}={value}: {why}"
    return None


def takes_no_value(flags: list[str], flag: str) -> bool:
    """Whether base_train's --flag is a switch (--fp8, --compile): given alone, it parses."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            train_args([*flags, f"--{flag}"])
    except SystemExit:
        return False
    return True


def ensure_tokenizer(flags: list[str], vocab: int = 4096) -> None:
    """A tokenizer for the runs: the base dir's, or a BPE of `vocab` tokens trained now on the
    embedded corpus."""
    if os.path.isfile(tokenizer_dir() / "tokenizer.json"):
        return
    if "fineweb-edu" in flags[len(DEFAULT_FLAGS):]:
        raise SystemExit("error: no tokenizer; train one with `python -m scripts.tok_train "
                         "--dataset fineweb-edu`")
    print(f"== no tokenizer yet: training a {vocab}-token BPE on the embedded corpus", flush=True)
    subprocess.run([sys.executable, "-m", "scripts.tok_train", "--dataset", "embedded",
                    "--vocab-size", str(vocab), "--max-chars", "8000000"], check=True)


def default_budget(args, flags: list[str], cache: dict) -> None:
    """On a CPU, an ablation given neither --budget nor --num-iterations is planned to a budget for
    the CPU it finds, and says so: CPU_BUDGETS's, by whether it has bf16 units (the default
    shape's steps are several times slower in fp32)."""
    if (args.budget is not None or cache["device_type"] != "cpu"
            or "--num-iterations" in given_flags(flags)):
        return
    kind = "bf16" if cache["dtype"] == "bf16" else "fp32"
    args.budget, args.budget_default = CPU_BUDGETS[kind], True
    print(f"== this CPU trains in {kind} ({'with' if kind == 'bf16' else 'without'} bf16 units): "
          f"the ablation is planned to --budget {args.budget / 60:.0f}m (give --budget or "
          "--num-iterations to choose)", flush=True)


def default_seeds(args, cache: dict) -> int:
    """The seeds when --seeds is not given: GPU_SEEDS on a GPU with batched seeds (said in a
    line), else DEFAULT_SEEDS (a --budget plans its own)."""
    if cache["device_type"] != "cuda" or not args.batch_seeds or args.budget is not None:
        return DEFAULT_SEEDS
    print(f"== on a GPU: {GPU_SEEDS} seeds, each variant's batched in one process (--seeds "
          "chooses)", flush=True)
    return GPU_SEEDS


def given_flags(flags: list[str]) -> set[str]:
    """The base_train flags given beyond DEFAULT_FLAGS (a preset's or the user's), by name."""
    return {f.split("=")[0] for f in flags[len(DEFAULT_FLAGS):]}


def short_run_lrs(args, flags: list[str], train) -> list[str]:
    """flags, with Muon's matrix lr for runs of train.num_iterations steps (train: the flags
    parsed; recipe.short_run_matrix_lr) when they are fewer than the lr rule was tuned at, said in a
    line. Unchanged where that rule does not speak: --matrix-lr given or swept, a preset (its lrs
    were swept at its own steps), GPU-sized steps."""
    steps, batch = train.num_iterations, train.total_batch_size
    if (steps >= RULE_STEPS or args.preset or "--matrix-lr" in given_flags(flags)
            or args.sweep.flag == "matrix-lr" or not 0 < batch < NANOCHAT_BATCH):
        return flags
    lr = short_run_matrix_lr(steps, batch)
    print(f"== Muon's matrix lr {lr:.4g} for {steps}-step runs: the lr rule's "
          f"{rule_lrs(batch)['matrix_lr']:g}, tuned at {RULE_STEPS} steps, x ({RULE_STEPS} / "
          f"{max(steps, SHORT_RUN_FLOOR)})^{SHORT_RUN_EXPONENT}, since in shorter runs its best "
          "lr was higher and AdamW's was not (docs/research.md); --matrix-lr chooses another",
          flush=True)
    return [*flags, "--matrix-lr", f"{lr:.4g}"]


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


def main(argv=None):
    """ablate, stoppable: Ctrl-C or SIGTERM ends the runs it started (a run's newest checkpoint is
    whole) and says in one line what is kept; finished runs are cached, so the same command goes
    on from them."""
    ended = []

    def stop(signum, frame):
        ended.extend(RUNNING.values())
        for p in list(RUNNING):
            p.terminate()
        raise KeyboardInterrupt(128 + signum)

    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return run_ablation(argv)
    except KeyboardInterrupt as e:
        print(f"== ablate stopped; the runs it was training, ended: {', '.join(ended) or 'none'}. "
              f"Finished runs are cached in {get_base_dir() / 'ablations' / 'cache'}: the same "
              "command goes on from them", flush=True)
        raise SystemExit(e.args[0] if e.args else 130) from None
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def run_ablation(argv=None):
    """Parse, then plan, run and write up the ablation under its name's lock."""
    started = time.monotonic()
    args, flags = parse_args(argv)
    args.started = started
    if args.preset:  # every run, the tokenizer and the results live in the preset's base dir
        base = get_base_dir() / "presets" / args.preset
        os.environ["NANOMUON_BASE_DIR"] = str(base)
        print(f"== preset {args.preset} ({PRESETS[args.preset].about}), in {base}", flush=True)
    out = get_base_dir() / "ablations" / args.name
    try:  # two ablations of one name would train the same runs, each stopped by the other's locks
        note = lock_run_dir(out, "another --name")
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None
    if note:
        print(f"== {note}", flush=True)
    try:
        return ablation(args, flags, argv)
    finally:
        unlock_run_dir(out)


def ablation(args, flags: list[str], argv):
    """The ablation itself: its runs planned (--budget), run (cached) and written up."""
    ensure_tokenizer(flags, PRESETS[args.preset].vocab if args.preset else 4096)
    cores = os.cpu_count() or 1
    cache = cache_of(flags)
    jobs = args.jobs or (max(1, cores // args.nproc) if cache["device_type"] == "cpu" else 1)
    runs_per_seed = len(args.variants) * len(args.sweep.values)
    # a batched run trains all of a variant's seeds: a process per variant-value pair and length
    args.batch_seeds = args.batch_seeds and args.data_order == "fixed"
    jobs = min(jobs, runs_per_seed + len(args.baseline_lengths) if args.batch_seeds
               else runs_per_seed * (args.seeds or DEFAULT_SEEDS))
    threads = max(1, cores // (jobs * args.nproc))
    n_seeds, refiner = args.seeds or default_seeds(args, cache), None
    default_budget(args, flags, cache)
    if args.budget is not None:
        flags, refiner = plan_runs(args, flags, runs_per_seed, jobs, threads, cache)
        n_seeds = refiner.plan.seeds
    seeds = list(range(1, n_seeds + 1))
    train = train_args(flags)
    steps = train.num_iterations
    flags = short_run_lrs(args, flags, train)
    others = sorted({round(f * steps) for f in args.baseline_lengths})
    if args.baseline_lengths and (steps < 1 or len(others) < len(args.baseline_lengths)
                                  or not all(1 <= n != steps for n in others)):
        raise SystemExit(f"error: --baseline-lengths {args.baseline_lengths} of --num-iterations "
                         f"{steps} are not distinct step counts other than {steps}; give "
                         "--num-iterations, other fractions, or --baseline-lengths none")
    data = 1 if args.data_order == "fixed" else None  # None: the seed's
    main_jobs = functools.partial(jobs_of, args, data)
    todo = [job for group, of_seeds in enumerate(seed_groups(refiner.plan if refiner else None,
                                                             n_seeds))
            for job in main_jobs(of_seeds, group)]
    if refiner:
        refiner.make_jobs = main_jobs
    # the baseline's other lengths: with it now when it runs at one value, else at its best, after
    shorter = [Job(args.baseline, args.sweep.values[0], s, n, data) for n in others
               for s in seeds[:LENGTH_SEEDS]]
    processes = len(batches(todo + shorter, args.batch_seeds))
    print(f"== {len(todo)} runs ({len(args.variants)} variants x {len(args.sweep.values)} values x "
          f"{len(seeds)} seeds) and {len(shorter)} of the baseline at other lengths"
          + (f", each variant's seeds batched: {processes} processes" if args.batch_seeds else "")
          + f", {jobs} at a time, {threads} thread(s) each", flush=True)
    started = time.monotonic()
    one_value = len(args.sweep.values) == 1
    results = run_all(todo + shorter if one_value else todo, flags, args, jobs, threads, cache,
                      refiner)
    seeds = list(range(1, (refiner.plan.seeds if refiner else n_seeds) + 1))  # with any added
    if not one_value and shorter:
        best = report(split_runs(results)[0], args.variants, args.sweep, seeds,
                      args.baseline)[1][args.baseline]
        results |= run_all([job._replace(value=best) for job in shorter], flags, args, jobs,
                           threads, cache, refiner)
    main_runs, lengths = split_runs(results)
    write_ablation(args, argv, flags, main_runs, lengths, seeds)
    print(f"== {len(results)} runs took {(time.monotonic() - started) / 60:.1f} min", flush=True)
    return main_runs


def jobs_of(args, data_seed: int | None, seeds: list[int], group: int = 0) -> list[Job]:
    """The runs at their own steps of these seeds, a batch `group` of each variant's."""
    return [Job(v, x, s, data_seed=data_seed, group=group) for v in args.variants
            for x in args.sweep.values for s in seeds]


def seed_groups(plan: Plan | None, seeds: int) -> list[list[int]]:
    """The seeds of each batch of a variant's runs: the plan's groups, else one of all."""
    groups, first = (plan.groups if plan else ()) or (seeds,), 1
    out = []
    for n in groups:
        out.append(list(range(first, first + n)))
        first += n
    return out


def split_runs(results: dict) -> tuple[dict, dict]:
    """(variant, value, seed) -> record of the runs at their own steps; (seed, steps) -> record of
    the baseline's runs at other lengths."""
    return ({job[:3]: r for job, r in results.items() if job.steps is None},
            {(job.seed, job.steps): r for job, r in results.items() if job.steps is not None})


def run_all(todo: list, flags: list[str], args, jobs: int, threads: int, cache: dict,
            refiner: "Refiner | None" = None) -> dict:
    """job -> record of every job in todo, batched (run_batch's), `jobs` runs at a time, and of
    the jobs `refiner` adds as runs end (Refiner.more), in the order they were asked for."""
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


class Keys(NamedTuple):
    """Where a budget's plan, the runs' calibration and a refusal's pace are kept, each keyed by
    what decides it; `machine`: the key of everything but the code, torch and the variants."""
    plan: Path
    calibration: Path
    refused: Path
    machine: str


def plan_keys(args, flags: list[str], jobs: int, threads: int, cache: dict) -> Keys:
    """The files plan_runs reads and the Refiner keeps. A calibration is the runs' flags, their
    processes and threads, `jobs` at once (their contention), the device and CPU model, the
    batching, the variants, the code and torch; a plan is that and the budget, sweep, seeds and
    lengths it was fitted to."""
    machine = key_of([flags, jobs, threads, args.nproc, cache["device"], os.cpu_count(),
                      args.batch_seeds])
    exact = key_of([machine, args.variants, cache["code"], cache["torch"]])
    plan = key_of([args.budget, args.sweep, args.seeds, args.baseline_lengths, exact])
    return Keys(cache["dir"] / f"plan-{plan}.json", cache["dir"] / f"calibration-{exact}.json",
                cache["dir"] / f"refused-{exact}.json", machine)


def kept_estimate(keys: Keys, used: int) -> tuple[Calibration | None, dict, str]:
    """(the calibration kept for these runs, else the newest an ablate of other code, torch or
    variants kept on this machine, scaled to the load now, or None; what the runs' own is kept
    with; how it was had, in words). used: the threads the runs take (0: none scales)."""
    kept, how = read_calibration(keys.calibration), f"timed here before ({keys.calibration.name})"
    if kept is None:
        found = [(k, p) for p in sorted(keys.calibration.parent.glob("calibration-*.json"))
                 if (k := read_calibration(p, complain=False))
                 and k[1].get("machine") == keys.machine]
        if found:
            kept, path = max(found, key=lambda kp: kp[0][1]["when"])
            how = (f"an estimate: timed here by an ablate of other code, torch or variants "
                   f"({path.name})")
    load, cores = machine_load(), os.cpu_count() or 1
    about = dict(machine=keys.machine, load=load, cores=cores, used=used)
    if kept is None:
        return None, about, "nothing has timed these runs here yet"
    cal, factor = at_load(kept[0], kept[1]["load"], load, used, cores) if used else (kept[0], 1)
    if abs(factor - 1) >= 0.05:
        how += (f", at a load of {kept[1]['load']:.1f} (now {load:.1f}: steps x{factor:.2f}, an "
                "estimate)")
    return cal, about, how


def plan_runs(args, flags: list[str], runs_per_seed: int, jobs: int, threads: int,
              cache: dict) -> tuple[list[str], "Refiner"]:
    """--budget: the plan, printed before any run starts: kept from before, fitted to the
    calibration kept on this machine (kept_estimate), or, with none, the smallest plan, which its
    runs' own steps then time. (flags with its steps and evals, the Refiner that follows the runs
    and refines the plan.) What is kept is keyed by what decides it, so a re-run (or an
    interrupted one) plans the same runs and finds them cached."""
    train, layout = train_args(flags), (runs_per_seed, jobs, len(args.baseline_lengths),
                                        args.batch_seeds)
    keys = plan_keys(args, flags, jobs, threads, cache)
    # a GPU's steps do not wait on the CPU's other processes: no load to scale by
    used = jobs * threads * args.nproc if cache["device"].startswith("cpu") else 0
    estimate, about, how = kept_estimate(keys, used)
    evals = functools.partial(eval_times, eval_tokens=train.eval_tokens,
                              final_tokens=train.final_eval_tokens,
                              batch=train.total_batch_size, batched=args.batch_seeds)
    guess, plan = None, read_plan(keys.plan)
    if estimate is None and plan is None:
        guess, how = prior_estimate(args, train, jobs, threads, cache, evals)
    seconds = time.monotonic() - args.started + WRITE_UP_S
    estimate = estimate and estimate._replace(seconds=seconds)
    guess = guess and guess._replace(seconds=seconds)
    if plan is not None:
        how = f"planned before ({keys.plan.name}); {how}"
    elif estimate is None:
        plan = smallest(args.seeds)
        refuse_at_once(args, keys, layout, seconds)
    else:
        plan = fit(args.budget, estimate, runs_per_seed, jobs, args.seeds, *layout[2:],
                   at_least=args.budget_default)
        if plan is None:  # only a --budget given: the default plans its smallest instead
            raise SystemExit(f"error: --budget {args.budget:.0f}s fits fewer than {MIN_STEPS} "
                             f"steps per run ({how}: {in_words(estimate)}; {jobs} at a time); "
                             "raise --budget, or cut --variants, --sweep, --seeds or --depth")
    shape = not args.preset and not given_flags(flags) and args.data_order == "fixed"
    refiner = Refiner(args, train, plan, layout, keys, about, estimate, seconds, shape, guess)
    refiner.say(how + (f": {in_words(estimate)}; the runs' own steps correct it" if estimate
                       else ""))
    return [*flags, "--num-iterations", str(plan.steps), "--eval-every",
            str(plan.eval_every)], refiner


def prior_estimate(args, train, jobs: int, threads: int, cache: dict,
                   evals) -> tuple[Calibration | None, str]:
    """(The prior, how it was had, in words) where nothing has timed these runs here: one eager
    step of a seed at their shape timed now (budget.probe_step, a few seconds on a CPU), scaled
    by what compiled runs took against it and by the load the runs add. None on a GPU, or where
    the probe cannot run; then the runs' first steps time the plan alone."""
    none = "nothing has timed these runs here yet"
    if cache.get("device_type") != "cpu" or not isinstance(train.device_batch_size, int):
        return None, none
    vocab = read_json(tokenizer_dir() / "tokenizer.json", "the tokenizer's record")["vocab_size"]
    micro = max(1, train.total_batch_size // (train.device_batch_size * train.max_seq_len
                                              * args.nproc))
    try:
        config = config_from_depth(train.depth, vocab, train.max_seq_len, train.aspect_ratio,
                                   train.head_dim, qk_norm=train.qk_norm, window_pattern=
                                   train.window_pattern, arch="classic" if train.arch == "auto"
                                   else train.arch)
        probe_s = probe_step(config, args.variants, train.device_batch_size, micro,
                             cache["dtype"], threads)
    except (RuntimeError, ValueError, TypeError, MemoryError) as e:
        return None, f"{none}; no prior ({type(e).__name__}: {str(e)[:120]})"
    load, cores = machine_load(), os.cpu_count() or 1
    factor = (contention(load, jobs * threads * args.nproc, cores)
              / contention(load, threads, cores))
    compiled = resolve_compile(train.compile, torch.device("cpu"))
    guess = prior(probe_s, compiled, evals, factor, 0.0)
    return guess, (f"{none}; a prior estimate: one eager step of a seed timed now, {probe_s:.3f} "
                   f"s, x{PRIOR_STEP_RATIO:g} for a run's"
                   + (f", x{factor:.2f} for the load {jobs} runs add" if factor > 1.01 else "")
                   + f": {in_words(guess, spent=False)}")


def in_words(cal: Calibration, spent: bool = True) -> str:
    """A calibration's numbers, each with its unit."""
    return (f"{cal.step_s:.3f} s a step of a seed, {cal.fixed_s:.0f} s a run's start-up, save and "
            "report" + (f", {cal.seconds - WRITE_UP_S:.0f} s spent before the runs" if spent
                        else ""))


def refuse_at_once(args, keys: Keys, layout: tuple, seconds: float) -> None:
    """A --budget given that runs here showed too short before (their pace is kept) and that is
    no longer: refused now, before any run starts."""
    if args.budget_default:
        return
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        step_s = float(load_json(keys.refused, RECORD_BYTES)["step_s"])
        floor = modeled(Calibration(step_s, 0.0, 0.0, seconds), MIN_STEPS,
                        args.seeds or FIRST_SEEDS, *layout)[1]
        if 0 < step_s < math.inf and floor > (args.budget - seconds) * HEADROOM:
            raise SystemExit(budget_refusal(args.budget, floor, seconds,
                                            f"{step_s:.3f} s a step of a seed, as runs here "
                                            f"showed before ({keys.refused.name})"))


class Refiner(Tracker):
    """A budget's plan as its runs go (budget.Tracker reads their step records). It says their
    first pace and each run's end, with the plan's end at the pace measured so far. It keeps that
    calibration and the timed plan for the next ablate, and the pace that refused a --budget
    given. At the first run's end it adds the seeds the budget has room for (more())."""

    def __init__(self, args, train, plan: Plan, layout: tuple, keys: Keys, about: dict,
                 estimate: Calibration | None, seconds: float, shape: bool,
                 guess: Calibration | None = None):
        def evals(step_s: float) -> tuple[float, float]:
            return eval_times(step_s, train.eval_tokens, train.final_eval_tokens,
                              train.total_batch_size, args.batch_seeds)

        def floor(cal: Calibration) -> float:  # the smallest plan, the fewest seconds at cal
            return modeled(cal, MIN_STEPS, args.seeds or FIRST_SEEDS, *layout)[1]

        super().__init__(args.budget, seconds, evals, None if args.budget_default else floor)
        self.args, self.train, self.plan, self.layout, self.keys = args, train, plan, layout, keys
        self.about, self.estimate, self.shape = about, estimate, shape
        self.guess = guess  # the prior (prior_estimate), where nothing has timed these runs
        self.make_jobs, self.grown = None, False  # make_jobs(seeds, group): ablation()'s Jobs

    def words(self, plan: Plan) -> str:
        """The plan in words, each number with its unit."""
        runs_per_seed, jobs = self.layout[:2]
        if plan.total_s:
            timed = (f"each run ~{plan.run_s:.0f} s, ~{(self.seconds + plan.total_s) / 60:.1f} "
                     "min in all")
        elif self.guess is not None:
            run_s, total = modeled(self.guess, plan.steps, plan.seeds, *self.layout, plan.groups)
            timed = (f"each run ~{run_s:.0f} s, ~{(self.seconds + total) / 60:.1f} min in all by "
                     "the prior, until the runs' first steps time it")
        else:
            timed = "its time follows the runs' first steps"
        return (f"depth {self.train.depth}, {plan.steps} steps of "
                f"{self.train.total_batch_size:,} tokens, {plan.seeds} seeds, {runs_per_seed} "
                f"variant-value pairs, {jobs} runs at a time; {timed}{self.detects(plan)}")

    def detects(self, plan: Plan) -> str:
        """The effect the plan detects, projected where the spread at its shape was measured."""
        return (f"; detects ~{projected_detectable(max(2, plan.seeds), plan.steps):.2%} of bpb "
                "(projected from the spread measured at this shape)" if self.shape else "")

    def say(self, how: str) -> None:
        """The plan, said before any run starts: first whether the default's fits."""
        if self.estimate is not None or self.guess is not None:
            self.overrun(self.estimate or self.guess, "" if self.estimate else " by the prior")
        tell(f"== plan for --budget {self.budget_s / 60:.1f} min ({how}): {self.words(self.plan)}")
        if self.plan.total_s:
            write_json(self.keys.plan, self.plan._asdict())

    def ends(self, cal: Calibration) -> tuple[float, bool]:
        """(seconds after ablate began that the plan ends at cal, whether that fits the budget)."""
        p = self.plan
        total = modeled(cal, p.steps, p.seeds, *self.layout, p.groups)[1]
        return self.seconds + total, total <= (self.budget_s - self.seconds) * HEADROOM

    def overrun(self, cal: Calibration, by: str = "") -> None:
        """The default's plan that cannot fit its budget at cal, said with its time; by: what
        timed cal, where it is the prior. A --budget given whose smallest plan's steps alone
        overrun it by the prior: said, as the runs' first steps will refuse it."""
        end, fits = self.ends(cal)
        p = self.plan
        which = ("the smallest one" if (p.steps, p.seeds) == (MIN_STEPS, self.args.seeds
                                                               or FIRST_SEEDS) else "its plan")
        if self.args.budget_default and not fits:
            tell(f"== the default plan does not fit {self.budget_s / 60:.0f} minutes on this "
                 f"machine: {which} ({p.seeds} seeds of {p.steps} steps) takes ~{end / 60:.0f} "
                 f"min{by}{self.detects(p)}; --budget or --num-iterations chooses another")
        elif by and self.floor is not None and self.floor(cal._replace(
                fixed_s=0.0, eval_s=0.0, final_s=0.0)) > (self.budget_s - self.seconds) * HEADROOM:
            tell(f"== by the prior, --budget {self.budget_s / 60:.1f}m may not fit even the "
                 "smallest plan's steps; the runs' first steps decide, and refuse it then")

    def end_words(self, cal: Calibration) -> str:
        end, fits = self.ends(cal)
        return (f"the plan ends ~{end / 60:.1f} min after ablate began, of a "
                f"{self.budget_s / 60:.1f}-minute budget" + ("" if fits else ", past it"))

    def paced(self, cal: Calibration) -> None:
        assumed = (f"the plan assumed {self.estimate.step_s:.3f}" if self.estimate else
                   f"the prior estimated {self.guess.step_s:.3f}" if self.guess else
                   "the first timing of these runs here")
        tell(f"== the runs' own pace: {cal.step_s:.3f} s a step of a seed ({assumed}); "
             f"{self.end_words(cal)}")
        if self.estimate is None:
            self.overrun(cal)

    def finished(self, run, cal: Calibration) -> None:
        self.replan(cal)
        prior_s = {} if self.guess is None else dict(prior_step_s=self.guess.step_s)
        write_json(self.keys.calibration, dict(calibration=cal._asdict(),
                                               about=dict(self.about, when=time.time(), **prior_s)))
        tell(f"== {run.label} took {run.wall:.0f} s; the runs so far: {in_words(cal)}; "
             f"{self.end_words(cal)}")

    def replan(self, cal: Calibration, added: int = 0) -> Plan:
        """The plan timed at cal, with `added` seeds as a batch of their own, kept; under the lock,
        so a run's end and the seeds added, in two threads, keep the plan both made. Returns the
        plan before."""
        with self.lock:
            p = self.plan
            groups = (*(p.groups or (p.seeds,)), added) if added else p.groups
            run_s, total = modeled(cal, p.steps, p.seeds + added, *self.layout, groups)
            self.plan = p._replace(seeds=p.seeds + added, groups=groups, run_s=run_s,
                                   total_s=total)
            write_json(self.keys.plan, self.plan._asdict())
        return p

    def refused(self, cal: Calibration) -> None:
        write_json(self.keys.refused, dict(step_s=cal.step_s))

    def more(self) -> list:
        """At the first run's end, once: the Jobs of the seeds the budget has room for at the
        runs' own pace (budget.grow), a batch of each variant's; none where --seeds is given."""
        if self.grown or not self.done():
            return []
        self.grown, cal = True, self.measured()
        if self.args.seeds or cal is None or len(self.plan.groups) > 1:
            return []
        if not (added := grow(self.budget_s, cal, self.plan, *self.layout)):
            return []
        before, plan = self.replan(cal, added), self.plan
        tell(f"== the budget has room at the runs' own pace: seeds {before.seeds + 1}-"
             f"{plan.seeds} join, a batch of each variant's; the plan now: {self.words(plan)}")
        return self.make_jobs(list(range(before.seeds + 1, plan.seeds + 1)), len(plan.groups) - 1)


def tell(line: str) -> None:
    """A line of ablate's own, whole among the runs' echoed lines."""
    with _print_lock:
        print(line, flush=True)


def write_json(path: Path, obj) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj)))


def renamed(sweep: Sweep) -> str:
    """The swept values that run names hold as value_tag's slug and hash, each with its tag."""
    tags = [f"`{v}` as {value_tag(v)}" for v in sweep.values if value_tag(v) != v]
    return f"; in the names, {', '.join(tags)}" if tags else ""


def write_ablation(args, argv, flags: list[str], results: dict, lengths: dict,
                   seeds: list) -> None:
    """The table (printed too), the plot and ablation.md in ablations/<name>. flags: base_train's,
    as every run got them; results: (variant, value, seed) -> record; lengths: the baseline's
    other lengths, (seed, steps) -> record."""
    out = get_base_dir() / "ablations" / args.name
    out.mkdir(parents=True, exist_ok=True)
    table, best = report(results, args.variants, args.sweep, seeds, args.baseline, lengths)
    first = next(iter(results.values()))
    png = plot(out, results, args.variants, args.sweep, seeds, best, args.baseline,
               f"{args.name}: {first['num_params'] / 1e6:.1f}M params, "
               f"{first['tokens_per_step']:,} tokens/step, {len(seeds)} seeds", lengths)
    cmd = " ".join(["python -m scripts.ablate", *(argv if argv is not None else sys.argv[1:])])
    doc = [f"# Ablation: {args.name}", "", f"- command: `{cmd}`",
           f"- runs: {len(results)}, named {args.name}-<variant>-{args.sweep.flag}<value>-s<seed> "
           "(each has a report.md)" + (f", and {len(lengths)} of the baseline at other lengths "
                                       "(-n<steps>)" if lengths else "") + renamed(args.sweep),
           f"- every run: `python -m scripts.base_train {' '.join(flags)}`, then its own --run, "
           f"--optimizer, --{args.sweep.flag}, --seed and --data-seed (the last of a flag given "
           "twice wins)",
           f"- seeds {seeds[0]}..{seeds[-1]}: each sets the init"
           + (", on one data order (data seed 1) for every run: the verdict is at that order"
              if args.data_order == "fixed" else " and the data order")
           + ", the same for every variant",
           f"- baseline: {args.baseline} at its best {args.sweep.flag}; steps and training time "
           "(evals excluded) are to the first eval at or below its mean final val bpb; verdicts are paired by seed, "
           "at 95% confidence; 'detectable' is the smallest effect this design sees 80% of the time, "
           f"and where that is above {RECORD_EFFECT:.2%} of bpb (a record-sized effect) the seeds "
           "of these steps that would detect one, at the spread these seeds show",
           "", *table,
           "", "![val bpb by step, by training time and by swept value](val_bpb.png)" if png
           else f"({MISSING})", ""]
    write_atomic(out / "ablation.md", lambda tmp: tmp.write_text("\n".join(doc)))
    print("\n".join(table))
    print(f"table and plot in {out}")


if __name__ == "__main__":
    main()
