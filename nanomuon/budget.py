"""
How many seeds and steps of an ablation fit a wall time (ablate's --budget), and the early
refusal of one that cannot fit.

ablate times a few steps of the runs as they will run (calibrate, in scripts/ablate.py) and hands
the measures here as a Calibration; fit() then picks the plan whose projected detectable effect
is smallest, trading the seeds' t factor against the spread that longer runs shrink. A Watch
follows the calibration runs' step records and refuses an explicit budget as soon as the runs it
would need cannot fit.
"""

import argparse
import math
import re
import threading
import time
from pathlib import Path
from typing import NamedTuple

from nanomuon.common import load_json
from nanomuon.stats import detectable_factor

# The budget planner (--budget): time a few steps as the runs will see them, then fit the plan.
CALIBRATION_STEPS = 12
WARM_UP_STEPS = 3  # compiled runs' first, untimed round: it fills the compile cache
CPU_BUDGETS = {"bf16": 15 * 60, "fp32": 30 * 60}  # the default's wall time, by training precision
MIN_STEPS = 50  # fewer and every variant is still warming up: a verdict on the start, not training
# A seed's paired difference (muon - adamw at the default shape, data order fixed) spreads 0.52% of
# bpb at 64 steps, 0.37% at 79 and 0.29% at 200 (5, 10 and 5 seeds; docs/research.md): about
# steps ** -0.41 (fitted in log-log, weighted by degrees of freedom), which the planner weighs
# against the t factor of fewer seeds.
SPREAD_EXPONENT = 0.41
MAX_SEEDS = 32  # then longer runs: a verdict from more training, at about the same resolution
CALIBRATION_SEEDS = 2  # batched: the seeds of a calibration run (a planned run has 2 or more)
EVALS = 4  # val bpb evals after step 0: the points of the plot's curves
# The baseline's other lengths run on the first LENGTH_SEEDS seeds only: its bpb per doubling of
# the steps barely moves from seed to seed (0.319 +- 0.003 from 3 seeds at 79 steps), so the
# budget buys more seeds of the paired differences instead, whose spread is what limits a verdict.
LENGTH_SEEDS = 2
HEADROOM = 0.9  # of the budget: the plan models the wall time, it does not control it
WRITE_UP_S = 5.0  # the table and the plot at the end


class Calibration(NamedTuple):
    """What --budget plans with, measured with `jobs` runs at once (their contention). A run of k
    seeds (batched; k = 1 alone) takes fixed_s + k (steps step_s + EVALS eval_s + final_s)."""
    step_s: float  # one training step of one seed (the slowest calibration run's mean)
    fixed_s: float  # the rest of a run: start-up, building, the save and the report (alone: and
    # the last eval and the final eval, which final_s holds for a batched run's every seed)
    eval_s: float  # one more eval: eval tokens at a third of a training token's time (forward)
    seconds: float  # spent before the runs: since ablate started, calibrating, the write-up to come
    final_s: float = 0.0  # a batched seed's last eval and final eval


class Plan(NamedTuple):
    steps: int
    seeds: int
    eval_every: int
    run_s: float  # one run, modeled
    total_s: float  # every run, `jobs` at a time


def budget_arg(s: str) -> float:
    """argparse type for --budget: a wall time in seconds, like 600, 90s, 10m or 1.5h."""
    m = re.fullmatch(r"(\d+(?:\.\d*)?)([smh]?)", s.strip())
    if not m or float(m[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{s!r} is not a wall time: give one like 600, 90s, 10m "
                                         "or 1.5h")
    return float(m[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[m[2]]


class Watch:
    """Early refusal while calibrating: from the first seconds, a lower bound on each planned run's
    wall time (it starts up as a calibration run does and then trains MIN_STEPS steps or more, so
    it takes at least as long as a calibration run has so far, and at least the time to a step
    plus the steps left at that step's time). When `rounds` such runs cannot fit what is left
    of the budget, the calibration runs are stopped and the budget refused (with `refuse`; the
    default budget is never refused, its calibration runs to the end). A round that may compile
    cold (not `warm`) bounds nothing but the time it spends: the planned runs find its compile
    cache, and its steps are slowed by the other runs' compiling."""

    def __init__(self, budget_s: float, rounds: int, started: float, warm: bool = True,
                 refuse: bool = True):
        self.budget_s, self.rounds, self.started, self.warm = budget_s, rounds, started, warm
        self.refuse, self.bound_s = refuse, 0.0  # bound_s: the run wall time that refused
        self.began = self.first = time.monotonic()  # began: this round's
        self.procs, self.refusal, self.run_s = [], None, 0.0  # run_s: from the step records
        self.lock = threading.Lock()

    def started_process(self, p) -> None:
        with self.lock:
            self.procs.append(p)
            if self.refusal:
                p.terminate()

    def step(self, record: dict) -> None:
        """A calibration run's step record (base_train --step-record)."""
        if record["step"] >= 3:  # the first steps compile
            if self.warm:
                took = time.monotonic() - self.began
                left = (MIN_STEPS - record["step"]) * record["dt_ms"] / 1000
                self.run_s = max(self.run_s, took + left)
            self.check()

    def rewarm(self) -> None:
        """The next round of calibration runs starts now, with the compile cache warm."""
        self.warm, self.began = True, time.monotonic()

    def check(self) -> None:
        """Refuse (and stop the calibration runs) once the bound passes the budget."""
        now = time.monotonic()
        run_s = max(now - self.began if self.warm else 0.0, self.run_s)
        left = (self.budget_s - (now - self.started) - WRITE_UP_S) * HEADROOM
        with self.lock:
            if self.refusal or not self.refuse or self.rounds * run_s <= left:
                return
            self.bound_s = run_s
            self.refusal = budget_refusal(self.budget_s, self.rounds, run_s, now - self.started,
                                          f"as calibrating shows after {now - self.first:.0f} s")
            for p in self.procs:
                p.terminate()


def budget_refusal(budget_s: float, n_rounds: int, run_s: float, spent_s: float,
                   seen: str) -> str:
    """The line that refuses --budget budget_s: n_rounds rounds of runs of run_s seconds at least
    do not fit it, with spent_s gone before the runs; it names a budget that fits them."""
    left = (budget_s - spent_s - WRITE_UP_S) * HEADROOM
    need = n_rounds * run_s / HEADROOM + spent_s + WRITE_UP_S
    why = (f"{n_rounds} rounds of runs of at least {run_s:.0f} s each (start-up and {MIN_STEPS} "
           f"steps, {seen}) do not fit the {left:.0f} s left" if left > 0 else
           f"the time before the runs has spent it ({spent_s:.0f} s so far)")
    return (f"error: --budget {budget_s:.0f}s cannot fit: {why}; --budget "
            f"{math.ceil(need / 60)}m would, or cut --variants, --sweep, --seeds or --depth")


def run_sizes(runs_per_seed: int, seeds: int, lengths: int = 0, batched: bool = False) -> list:
    """The seeds each run trains: batched, one run of `seeds` per variant-value pair and one of the
    first LENGTH_SEEDS per other length of the baseline; alone, a run per seed of each."""
    sizes = [seeds] * runs_per_seed + [min(seeds, LENGTH_SEEDS)] * lengths
    return sizes if batched else [1] * sum(sizes)


def lanes(sizes: list[int], jobs: int) -> list[tuple[int, int]]:
    """(runs, seeds) of each of `jobs` lanes that run the runs of these sizes, a run at a time:
    the largest first, each to the least loaded lane (their cost grows with the seeds)."""
    loads = [(0, 0)] * jobs
    for size in sorted(sizes, reverse=True):
        i = min(range(jobs), key=lambda j: (loads[j][1], loads[j][0]))
        loads[i] = (loads[i][0] + 1, loads[i][1] + size)
    return loads


def rounds(runs_per_seed: int, seeds: int, jobs: int, lengths: int = 0,
           batched: bool = False) -> int:
    """The most runs one of `jobs` lanes runs, one after another (lanes())."""
    return max(runs for runs, _ in lanes(run_sizes(runs_per_seed, seeds, lengths, batched), jobs))


def fit(budget_s: float, cal: Calibration, runs_per_seed: int, jobs: int, seeds: int | None,
        lengths: int = 0, batched: bool = False, at_least: bool = False) -> Plan | None:
    """The plan for budget_s seconds (less cal.seconds), with the baseline at `lengths` other
    lengths: the most steps that fit `seeds` seeds, or if None the seeds (3 to MAX_SEEDS) whose
    most steps give the smallest projected detectable effect, detectable_factor(seeds) *
    steps ** -SPREAD_EXPONENT. If not even MIN_STEPS fit: None, or with at_least the smallest
    plan (MIN_STEPS, `seeds` or 3), however long. A run of k seeds (batched) takes fixed_s +
    k (steps step_s + EVALS eval_s + final_s): evals at step 0, every ceil(steps / EVALS) and at
    the end are EVALS more than calibrated."""
    left = (budget_s - cal.seconds) * HEADROOM
    per_seed = EVALS * cal.eval_s + cal.final_s

    def plan(n: int, steps: int) -> Plan:
        loads = lanes(run_sizes(runs_per_seed, n, lengths, batched), jobs)
        total = max(runs * cal.fixed_s + k * (per_seed + steps * cal.step_s) for runs, k in loads)
        run_s = cal.fixed_s + (n if batched else 1) * (per_seed + steps * cal.step_s)
        return Plan(steps, n, math.ceil(steps / EVALS), run_s, total)

    plans = []
    for n in [seeds] if seeds else range(3, MAX_SEEDS + 1):
        loads = lanes(run_sizes(runs_per_seed, n, lengths, batched), jobs)
        steps = min(math.floor((left - runs * cal.fixed_s - k * per_seed) / (k * cal.step_s))
                    for runs, k in loads if runs)
        if steps >= MIN_STEPS:
            plans.append(plan(n, steps))
    if not plans and at_least:
        plans.append(plan(seeds or 3, MIN_STEPS))
    return min(plans, default=None, key=lambda p: detectable_factor(max(2, p.seeds))
               * p.steps ** -SPREAD_EXPONENT)


def read_plan(path: Path) -> Plan | None:
    """A kept plan, or None when there is none or it is not one (then it is planned again)."""
    try:
        saved = load_json(path, 1 << 16, "a plan ablate wrote")
        plan = Plan(**saved)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:
        print(f"== {path.name} is not a plan ({e}); planning again", flush=True)
        return None
    ints = [plan.steps, plan.seeds, plan.eval_every]
    if not (all(type(v) is int and v >= 1 for v in ints)
            and all(isinstance(v, (int, float)) and v > 0 for v in (plan.run_s, plan.total_s))):
        print(f"== {path.name} holds a plan out of range ({saved}); planning again", flush=True)
        return None
    return plan


def read_calibration(path: Path, started: float) -> Calibration | None:
    """A kept calibration of the same runs and code (its time before the runs is this ablate's),
    or None when there is none or it is not one."""
    try:
        cal = Calibration(**load_json(path, 1 << 16, "a calibration ablate wrote"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:
        print(f"== {path.name} is not a calibration ({e}); calibrating again", flush=True)
        return None
    if not all(isinstance(v, (int, float)) and 0 <= v < math.inf for v in cal):
        print(f"== {path.name} holds numbers out of range; calibrating again", flush=True)
        return None
    return cal._replace(seconds=time.monotonic() - started + WRITE_UP_S)
