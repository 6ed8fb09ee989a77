"""
How many seeds and steps of an ablation fit a wall time (ablate's --budget): its Plan, refined
from the runs' own steps: no run is spent on calibration alone.

The first plan is fitted from a calibration kept here, or it is the smallest, timed by a prior
(probe_step). A Tracker then reads the runs' step records; the Calibration they measure is kept,
sizes the seeds that join (grow), and refuses a budget not even the smallest plan fits. fit()
trades the seeds' t factor against the spread that longer runs shrink.
"""

import argparse
import math
import os
import re
import statistics
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch

from nanomuon.ablation.stats import detectable_factor
from nanomuon.common import autocast, load_json
from nanomuon.gpt import GPT
from nanomuon.variants import OPTIMIZER_VARIANTS

CPU_BUDGETS = {"bf16": 15 * 60, "fp32": 30 * 60}  # the default's wall time, by training precision
MIN_STEPS = 50  # fewer and every variant is still warming up: a verdict on the start, not training
# A seed's paired difference (muon - adamw at the default shape, data order fixed) spreads 0.52% of
# bpb at 64 steps, 0.37% at 79 and 0.29% at 200 (5, 10 and 5 seeds; docs/research.md): about
# SPREAD_SCALE * steps ** -SPREAD_EXPONENT (fitted in log-log, weighted by degrees of freedom).
SPREAD_EXPONENT, SPREAD_SCALE = 0.41, 0.0243
MAX_SEEDS = 32  # then longer runs: a verdict from more training, at about the same resolution
FIRST_SEEDS = 3  # the fewest a plan takes: the smallest plan's, unless --seeds says
EVALS = 4  # val bpb evals after step 0: the points of the plot's curves
# The baseline's other lengths run on the first LENGTH_SEEDS seeds only: its bpb per doubling of
# the steps barely moves from seed to seed (0.319 +- 0.003 from 3 seeds at 79 steps), so the
# budget buys more seeds of the paired differences instead, whose spread is what limits a verdict.
LENGTH_SEEDS = 2
HEADROOM = 0.9  # of the budget: the plan models the wall time, it does not control it
WRITE_UP_S = 5.0  # the table and the plot at the end
WARM_UP_STEPS = 3  # a run's first steps compile: their time is its start-up, not a step's
PACE_RECORDS = 3  # warm step records before the runs' own pace replaces an estimate
# The prior, where nothing has timed these runs here: a run's step of a seed over probe_step's
# eager one (batched seeds, two runs at once, stepped no faster per seed than one seed eager), and a
# run's start-up (a cold compile, the step-0 eval, the save) in probe steps, compiled or not.
# Measured at ablate's default on a 2-core AMD EPYC with AVX512-BF16 under a load of 4-8, 2026-11-28
# (docs/research.md, "A budget"): the runs stepped 1.02-1.68x the probe (4 first ablates; 1.3 their
# geometric mean); a cold compile's start-up took 161 s, 80 probe steps; an eager run's about 25.
PRIOR_STEP_RATIO = 1.3
PRIOR_START_STEPS = {True: 80.0, False: 25.0}


class Calibration(NamedTuple):
    """What a plan is fitted with, at `jobs` runs at once (their contention), in seconds. A run of
    k seeds (batched; k = 1 alone) takes fixed_s + k (steps step_s + EVALS eval_s + final_s)."""
    step_s: float  # one training step of one seed
    fixed_s: float  # the rest of a run: start-up and compile, the save and the report (alone:
    # and the last eval and the final eval, which final_s holds for a batched run's every seed)
    eval_s: float  # one more eval
    seconds: float  # spent before the runs: since ablate started, and the write-up to come
    final_s: float = 0.0  # a batched seed's last eval and final eval


class Plan(NamedTuple):
    """The seeds and steps of an ablation's runs, fitted to a budget, and their modeled time."""
    steps: int
    seeds: int
    eval_every: int
    run_s: float  # the longest run, modeled (seconds); 0: not timed yet
    total_s: float  # every run, `jobs` at a time, modeled (seconds); 0: not timed yet
    groups: tuple = ()  # the seeds of each batch of a variant's runs, in order; (): one batch


def budget_arg(s: str) -> float:
    """argparse type for --budget: a wall time in seconds, like 600, 90s, 10m or 1.5h."""
    m = re.fullmatch(r"(\d+(?:\.\d*)?)([smh]?)", s.strip())
    if not m or float(m[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{s!r} is not a wall time: give one like 600, 90s, 10m "
                                         "or 1.5h")
    return float(m[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[m[2]]


def eval_times(step_s: float, eval_tokens: int, final_tokens: int, batch: int,
               batched: bool) -> tuple[float, float]:
    """(eval_s, final_s) at step_s: an eval token costs a third of a training token (forward only);
    final_s: a batched seed's last eval and final eval, which grow with the seeds."""
    eval_s = eval_tokens / batch * step_s / 3
    return eval_s, (eval_s + max(0, final_tokens) / batch * step_s / 3 if batched else 0.0)


def run_sizes(runs_per_seed: int, seeds: int, lengths: int = 0, batched: bool = False,
              groups: tuple = ()) -> list:
    """The seeds each run trains: batched, a run per group of seeds per variant-value pair and one
    of LENGTH_SEEDS per other length of the baseline; alone, a run per seed of each."""
    sizes = ([g for g in groups or (seeds,) for _ in range(runs_per_seed)]
             + [min(seeds, LENGTH_SEEDS)] * lengths)
    return sizes if batched else [1] * sum(sizes)


def lanes(sizes: list[int], jobs: int) -> list[tuple[int, int]]:
    """(runs, seeds) of each of `jobs` lanes that run the runs of these sizes, a run at a time:
    the largest first, each to the least loaded lane (their cost grows with the seeds)."""
    loads = [(0, 0)] * jobs
    for size in sorted(sizes, reverse=True):
        i = min(range(jobs), key=lambda j: (loads[j][1], loads[j][0]))
        loads[i] = (loads[i][0] + 1, loads[i][1] + size)
    return loads


def modeled(cal: Calibration, steps: int, seeds: int, runs_per_seed: int, jobs: int,
            lengths: int = 0, batched: bool = False, groups: tuple = ()) -> tuple[float, float]:
    """(the longest run, every run `jobs` at a time) in seconds, as cal models them."""
    per_seed = EVALS * cal.eval_s + cal.final_s
    sizes = run_sizes(runs_per_seed, seeds, lengths, batched, groups)
    total = max(runs * cal.fixed_s + k * (per_seed + steps * cal.step_s)
                for runs, k in lanes(sizes, jobs))
    return cal.fixed_s + max(sizes) * (per_seed + steps * cal.step_s), total


def left_s(cal: Calibration, steps: int, queued: list[int], running: list[tuple], jobs: int) -> float:
    """Seconds until the last run ends at cal: each running run (seeds, steps done, its steps,
    seconds since it began) its modeled rest, at least its steps left; then each queued run (its
    seeds), the largest first, on the lane that frees first."""
    per_seed = EVALS * cal.eval_s + cal.final_s

    def whole(k: int, n: int) -> float:
        return cal.fixed_s + k * (per_seed + n * cal.step_s)

    free = [max(whole(k, n) - since, (n - done) * k * cal.step_s) for k, done, n, since in running]
    free = sorted(free + [0.0] * max(0, jobs - len(free)))
    for k in sorted(queued, reverse=True):
        free[0] += whole(k, steps)
        free.sort()
    return max(free, default=0.0)


def fit(budget_s: float, cal: Calibration, runs_per_seed: int, jobs: int, seeds: int | None,
        lengths: int = 0, batched: bool = False, at_least: bool = False) -> Plan | None:
    """The plan for budget_s seconds (less cal.seconds): the most steps that fit `seeds` seeds,
    or if None the seeds (FIRST_SEEDS to MAX_SEEDS) whose most steps give the smallest projected
    detectable effect. If not even MIN_STEPS fit: None, or with at_least the smallest plan."""
    left = (budget_s - cal.seconds) * HEADROOM
    per_seed = EVALS * cal.eval_s + cal.final_s

    def plan(n: int, steps: int) -> Plan:
        run_s, total = modeled(cal, steps, n, runs_per_seed, jobs, lengths, batched)
        return Plan(steps, n, math.ceil(steps / EVALS), run_s, total)

    plans = []
    for n in [seeds] if seeds else range(FIRST_SEEDS, MAX_SEEDS + 1):
        loads = lanes(run_sizes(runs_per_seed, n, lengths, batched), jobs)
        steps = min(math.floor((left - runs * cal.fixed_s - k * per_seed) / (k * cal.step_s))
                    for runs, k in loads if runs)
        if steps >= MIN_STEPS:
            plans.append(plan(n, steps))
    if not plans and at_least:
        plans.append(plan(seeds or FIRST_SEEDS, MIN_STEPS))
    return min(plans, default=None, key=lambda p: projected_detectable(max(2, p.seeds), p.steps))


def smallest(seeds: int | None) -> Plan:
    """The smallest plan, not yet timed."""
    return Plan(MIN_STEPS, seeds or FIRST_SEEDS, math.ceil(MIN_STEPS / EVALS), 0.0, 0.0)


def grow(budget_s: float, cal: Calibration, plan: Plan, runs_per_seed: int, jobs: int,
         lengths: int = 0, batched: bool = False) -> int:
    """How many seeds can join `plan` as a batch of their own within budget_s at cal; 0: none."""
    left = (budget_s - cal.seconds) * HEADROOM
    groups = plan.groups or (plan.seeds,)
    return next((more for more in range(MAX_SEEDS - plan.seeds, 0, -1)
                 if modeled(cal, plan.steps, plan.seeds + more, runs_per_seed, jobs, lengths,
                            batched, (*groups, more))[1] <= left), 0)


def projected_detectable(seeds: int, steps: int) -> float:
    """The effect (a fraction of bpb) `seeds` seeds of `steps` steps detect, by SPREAD_SCALE."""
    return detectable_factor(seeds) * SPREAD_SCALE * steps ** -SPREAD_EXPONENT


def probe_step(config, variants: list[str], rows: int, micro_batches: int, dtype: str,
               threads: int) -> float:
    """Seconds of one eager step of one seed of a GPT of `config` on this CPU: a micro-batch's
    forward and backward (its second) times micro_batches, and each variant's optimizer step."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(config)
        model.to_empty(device="cpu")
        model.init_weights()
        x, y = torch.randint(config.vocab_size, (2, rows, config.sequence_len))
        cast = autocast(torch.device("cpu"), dtype)

        def micro():
            with cast:
                model(x, y).backward()

        micro()
        t0 = time.perf_counter()
        micro()
        forward_backward = time.perf_counter() - t0
        return micro_batches * forward_backward + statistics.fmean(
            optimizer_step(model, v, x, cast) for v in variants)
    finally:
        torch.set_num_threads(before)


def optimizer_step(model, variant: str, x, cast) -> float:
    """Seconds of variant's second eager optimizer step (the first makes its state); a stage that
    reads its matrices' inputs (Newton-Muon) gets them from a forward of x, timed with the step."""
    opt = model.setup_optimizer(OPTIMIZER_VARIANTS[variant], horizon=MIN_STEPS, compile=False)
    named = {p: name for name, p in model.named_parameters()}
    seconds = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        if opt.wants_inputs():
            with torch.no_grad(), cast:
                stats = model(x, input_stats=True)[1]
            opt.give_inputs({p: stats[name] for p, name in named.items() if name in stats})
        opt.step()
        seconds = time.perf_counter() - t0
    return seconds


def machine_load() -> float:
    """The 1-minute load average (0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def contention(load: float, used: int, cores: int) -> float:
    """How much slower a step runs beside `load` other runnable processes and the runs' own `used`
    threads on `cores` cores: not at all while every thread has a core, then in proportion."""
    return max(1.0, (load + used) / max(1, cores))


def budget_refusal(budget_s: float, floor_s: float, spent_s: float, seen: str) -> str:
    """The line that refuses --budget budget_s: it names a budget that fits floor_s of steps."""
    left = (budget_s - spent_s) * HEADROOM
    need = floor_s / HEADROOM + spent_s
    return (f"error: --budget {budget_s:.0f}s cannot fit: the smallest plan's steps alone take "
            f"{floor_s:.0f} s ({seen}), and {max(0.0, left):.0f} s are left for the runs; "
            f"--budget {math.ceil(need / 60)}m would, or cut --variants, --sweep, --seeds or "
            "--depth")


class RunWatch:
    """One planned run's warm steps' seconds and its wall, as launch() reads them, for a Tracker."""

    def __init__(self, tracker: "Tracker", seeds: int, label: str):
        self.tracker, self.seeds, self.label = tracker, seeds, label
        self.began = time.monotonic()
        self.dts, self.steps, self.at, self.wall = [], 0, (0, self.began), None

    @property
    def refusal(self) -> str | None:
        return self.tracker.refusal

    def started_process(self, p) -> None:
        self.tracker.started_process(p)

    def step(self, record: dict) -> None:
        """A step record (base_train --step-record); the first WARM_UP_STEPS are start-up, and a
        step beside another run's start-up (a compile, on the same cores) is not the runs' pace:
        its wall counts it, in the run's rest."""
        if record["step"] > WARM_UP_STEPS:
            with self.tracker.lock:
                if not any(r.wall is None and not r.at[0] for r in self.tracker.runs):
                    self.dts.append(record["dt_ms"] / 1000)
                self.steps, self.at = record["steps"], (record["step"], time.monotonic())
            self.tracker.stepped()

    def ended(self) -> None:
        with self.tracker.lock:
            self.wall = time.monotonic() - self.began
        if (cal := self.tracker.measured()) is not None:
            self.tracker.finished(self, cal)


class Tracker:
    """The planned runs' pace from their step records, from any lane's thread: the Calibration
    they measure, handed to paced() after PACE_RECORDS warm steps and to finished() as each run
    ends, and the refusal of a budget not even the smallest plan's steps fit (floor: None, no
    refusal)."""

    def __init__(self, budget_s: float, seconds: float, evals, floor=None):
        self.budget_s, self.seconds, self.evals, self.floor = budget_s, seconds, evals, floor
        self.lock = threading.Lock()
        self.runs, self.procs, self.refusal, self.told = [], [], None, False

    def watch(self, seeds: int, label: str) -> RunWatch:
        run = RunWatch(self, seeds, label)
        with self.lock:
            self.runs.append(run)
        return run

    def started_process(self, p) -> None:
        with self.lock:
            self.procs.append(p)
            if self.refusal:
                p.terminate()

    def measured(self) -> Calibration | None:
        """The runs' calibration so far, None before PACE_RECORDS warm step records. A run's rest
        (start-up, evals, save) is its wall less its steps at its own pace; the evals' model shrinks
        where a rest is shorter. A run still going gives its start-up so far."""
        with self.lock:
            runs = [(r.seeds, list(r.dts), r.steps, r.at, r.began, r.wall)
                    for r in self.runs if r.dts]
        if sum(len(dts) for _, dts, *_ in runs) < PACE_RECORDS:
            return None
        step_s = sum(sum(dts) for _, dts, *_ in runs) / sum(k * len(dts) for k, dts, *_ in runs)
        eval_s, final_s = self.evals(step_s)
        per_seed = EVALS * eval_s + final_s
        rests = [(k, max(0.0, wall - steps * sum(dts) / len(dts)))
                 for k, dts, steps, _, _, wall in runs if wall is not None]
        share = min([1.0] + [rest / (k * per_seed) for k, rest in rests if per_seed > 0])
        fixed = (max(rest - k * per_seed * share for k, rest in rests) if rests else
                 max(at - began - step * sum(dts) / len(dts)
                     for _, dts, _, (step, at), began, _ in runs))
        return Calibration(step_s, max(0.0, fixed), eval_s * share, self.seconds, final_s * share)

    def stepped(self) -> None:
        with self.lock:
            if self.told and self.floor is None:  # said, and nothing to refuse: no more to do
                return
        cal = self.measured()
        if cal is None:
            return
        with self.lock:  # the first pace waits for every run to step: one that compiles slows
            starting = any(r.wall is None and not r.at[0] for r in self.runs)  # the others' steps
            first = not self.told and not starting
            self.told = self.told or first
        if first:
            self.paced(cal)
        self.check(cal)

    def overruns(self, cal: Calibration) -> float | None:
        """The smallest plan's steps alone at cal (a lower bound) if they overrun, or None."""
        if self.floor is None:
            return None
        floor = self.floor(cal._replace(fixed_s=0.0, eval_s=0.0, final_s=0.0))
        return floor if floor > (self.budget_s - self.seconds) * HEADROOM else None

    def check(self, cal: Calibration) -> None:
        """Refuse the budget and end the runs once the smallest plan's steps overrun it at cal."""
        if (floor := self.overruns(cal)) is None:
            return
        with self.lock:
            if self.refusal:
                return
            self.refusal = budget_refusal(self.budget_s, floor, self.seconds,
                                          f"{cal.step_s:.3f} s a step of a seed, as the runs' "
                                          "first steps show")
            for p in self.procs:
                p.terminate()
        self.refused(cal)

    def paced(self, cal: Calibration) -> None:
        """The runs' first pace (a subclass says it)."""

    def finished(self, run: RunWatch, cal: Calibration) -> None:
        """A run ended; cal: every run so far (a subclass says and keeps it)."""

    def refused(self, cal: Calibration) -> None:
        """The budget was refused at cal's pace (a subclass keeps it)."""

    def more(self) -> list:
        """The Jobs of seeds to add as runs end: none, but where a budget has room (Refiner)."""
        return []


def read_plan(path: Path) -> Plan | None:
    """A kept plan, or None when there is none or it is not one."""
    try:
        saved = load_json(path, 1 << 16, "a plan ablate wrote")
        plan = Plan(**saved)._replace(groups=tuple(saved.get("groups", ())))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:
        print(f"== {path.name} is not a plan ({e}); planning again", flush=True)
        return None
    ints = [plan.steps, plan.seeds, plan.eval_every, *plan.groups]
    if not (all(type(v) is int and v >= 1 for v in ints)
            and all(isinstance(v, (int, float)) and v > 0 for v in (plan.run_s, plan.total_s))
            and (not plan.groups or sum(plan.groups) == plan.seeds)):
        print(f"== {path.name} holds a plan out of range ({saved}); planning again", flush=True)
        return None
    return plan


def read_calibration(path: Path, complain: bool = True) -> tuple[Calibration, dict] | None:
    """(A kept calibration, `about` it), or None where there is none or it is not one."""
    try:
        kept = load_json(path, 1 << 16, "a calibration ablate kept")
        cal, about = Calibration(**kept["calibration"]), dict(kept["about"])
        ok = (all(type(v) in (int, float) and 0 <= v < math.inf for v in cal) and cal.step_s > 0
              and all(type(about.get(k)) in (int, float) and about[k] >= 0
                      for k in ("load", "when")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        ok = False
    if not ok:
        if complain:
            print(f"== {path.name} is not a calibration ablate kept; planning without it",
                  flush=True)
        return None
    return cal, about
