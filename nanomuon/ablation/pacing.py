"""
An ablation's plan to a --budget as its runs go: where it is kept, the calibration found for these
runs (or a prior from one probed step), and the Refiner, which follows the runs' pace and adds the
seeds the budget has room for. budget.py holds the model of an ablation's time and the fit.
"""

import contextlib
import functools
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch

from nanomuon.ablation import budget
from nanomuon.ablation.budget import Calibration, Plan, Tracker, machine_load, modeled, probe_step
from nanomuon.ablation.runs import RECORD_BYTES, key_of, read_json, tell, variant_key, write_json
from nanomuon.common import load_json, resolve_compile
from nanomuon.gpt import config_from_depth
from nanomuon.tokenizer import tokenizer_dir


class Keys(NamedTuple):
    """Where a plan, a calibration and a refusing pace are kept; `machine`: the machine's key."""
    plan: Path
    calibration: Path
    refused: Path
    machine: str


def cache_keys(args, flags: list[str], jobs: int, threads: int, cache: dict) -> Keys:
    """The files plan_for_budget reads and the Refiner keeps: a calibration keyed by all that
    decides the runs' pace, a plan by that and the budget, sweep, seeds and lengths it fits."""
    machine = key_of([flags, jobs, threads, args.nproc, cache["device"], os.cpu_count(),
                      args.batch_seeds])
    exact = key_of([machine, args.variants, [variant_key(v) for v in args.variants],
                    cache["code"], cache["torch"]])
    plan = key_of([args.budget, args.sweep, args.seeds, args.baseline_lengths, exact])
    return Keys(cache["dir"] / f"plan-{plan}.json", cache["dir"] / f"calibration-{exact}.json",
                cache["dir"] / f"refused-{exact}.json", machine)


def kept_estimate(keys: Keys, used: int) -> tuple[Calibration | None, dict, str]:
    """(the calibration kept for these runs, else the newest of other code here, scaled to the
    load now, or None; the `about` to keep theirs with; how it was had, in words)."""
    kept = budget.read_calibration(keys.calibration)
    how = f"timed here before ({keys.calibration.name})"
    if kept is None:
        found = [(k, p) for p in sorted(keys.calibration.parent.glob("calibration-*.json"))
                 if (k := budget.read_calibration(p, complain=False))
                 and k[1].get("machine") == keys.machine]
        if found:
            kept, path = max(found, key=lambda kp: kp[0][1]["when"])
            how = (f"an estimate: timed here by an ablate of other code, torch or variants "
                   f"({path.name})")
    load, cores = machine_load(), os.cpu_count() or 1
    about = dict(machine=keys.machine, load=load, cores=cores, used=used)
    if kept is None:
        return None, about, "nothing has timed these runs here yet"
    cal, factor = kept[0], 1.0
    if used:  # all of a run is CPU time: all but the seconds before the runs scale with the load
        then = budget.contention(kept[1]["load"], used, cores)
        factor = budget.contention(load, used, cores) / then
        cal = cal._replace(step_s=cal.step_s * factor, fixed_s=cal.fixed_s * factor,
                           eval_s=cal.eval_s * factor, final_s=cal.final_s * factor)
    if abs(factor - 1) >= 0.05:
        how += (f", at a load of {kept[1]['load']:.1f} (now {load:.1f}: steps x{factor:.2f}, an "
                "estimate)")
    return cal, about, how


def evals_of(args, train):
    """step_s -> (eval_s, final_s) of these runs (budget.eval_times)."""
    return functools.partial(budget.eval_times, eval_tokens=train.eval_tokens,
                             final_tokens=train.final_eval_tokens, batch=train.total_batch_size,
                             batched=args.batch_seeds)


def prior_estimate(args, train, jobs: int, threads: int,
                   cache: dict) -> tuple[Calibration | None, str]:
    """(The prior, how it was had, in words): one eager step of a seed timed now (probe_step),
    scaled by PRIOR_STEP_RATIO and the load the runs add; None on a GPU or where it cannot run."""
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
    factor = (budget.contention(load, jobs * threads * args.nproc, cores)
              / budget.contention(load, threads, cores))
    step_s = probe_s * budget.PRIOR_STEP_RATIO * factor
    eval_s, final_s = evals_of(args, train)(step_s)
    compiled = resolve_compile(train.compile, torch.device("cpu"))
    start_s = budget.PRIOR_START_STEPS[compiled] * probe_s
    guess = Calibration(step_s, start_s * factor, eval_s, 0.0, final_s)
    return guess, (f"{none}; a prior estimate: one eager step of a seed timed now, {probe_s:.3f} "
                   f"s, x{budget.PRIOR_STEP_RATIO:g} for a run's"
                   + (f", x{factor:.2f} for the load {jobs} runs add" if factor > 1.01 else "")
                   + f": {in_words(guess, spent=False)}")


def in_words(cal: Calibration, spent: bool = True) -> str:
    """A calibration's numbers, each with its unit."""
    return (f"{cal.step_s:.3f} s a step of a seed, {cal.fixed_s:.0f} s a run's start-up, save and "
            "report" + (f", {cal.seconds - budget.WRITE_UP_S:.0f} s spent before the runs" if spent
                        else ""))


class Timer(Tracker):
    """Runs not planned to a budget, timed all the same: their calibration is kept as each ends,
    so the next ablate of these runs (--published resumed) says its plan's time as measured here,
    not by the prior."""

    def __init__(self, args, train, keys: Keys, used: int):
        super().__init__(math.inf, 0.0, evals_of(args, train))
        self.keys, self.about = keys, kept_estimate(keys, used)[1]  # the load the runs start at

    def finished(self, run, cal: Calibration) -> None:
        write_json(self.keys.calibration, dict(calibration=cal._asdict(),
                                               about=dict(self.about, when=time.time())))
        tell(f"== {run.label} took {run.wall / 60:.1f} min; the runs so far: {in_words(cal)}")


class Refiner(Tracker):
    """A budget's plan as its runs go: it says their first pace and each run's end with the
    plan's end at that pace, keeps the calibration, the timed plan and a refusing pace for the
    next ablate, and at the first run's end adds the seeds the budget has room for (more())."""

    def __init__(self, args, train, plan: Plan, layout: tuple, keys: Keys, about: dict,
                 estimate: Calibration | None, seconds: float, shape: bool,
                 guess: Calibration | None = None):
        def floor(cal: Calibration) -> float:  # the smallest plan, the fewest seconds at cal
            return modeled(cal, budget.MIN_STEPS, args.seeds or budget.FIRST_SEEDS, *layout)[1]

        super().__init__(args.budget, seconds, evals_of(args, train),
                         None if args.budget_default else floor)
        self.args, self.train, self.plan, self.layout = args, train, plan, layout
        self.keys, self.about, self.estimate, self.shape = keys, about, estimate, shape
        self.guess = guess  # the prior (prior_estimate), where nothing has timed these runs
        self.make_jobs, self.grown = None, False  # make_jobs(seeds, group): ablation()'s Jobs

    def refuse_kept(self) -> None:
        """A --budget that runs here showed too short before: refused before any run starts."""
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            step_s = float(load_json(self.keys.refused, RECORD_BYTES)["step_s"])
            cal = Calibration(step_s, 0.0, 0.0, self.seconds)
            if 0 < step_s < math.inf and (floor := self.overruns(cal)) is not None:
                seen = (f"{step_s:.3f} s a step of a seed, as runs here showed before "
                        f"({self.keys.refused.name})")
                raise SystemExit(budget.budget_refusal(self.budget_s, floor, self.seconds, seen))

    def words(self, d: Plan) -> str:
        runs_per_seed, jobs = self.layout[:2]
        run_s, total, by = d.run_s, d.total_s, ""
        if not total and self.guess is not None:  # not timed yet: the prior's time
            run_s, total = modeled(self.guess, d.steps, d.seeds, *self.layout, d.groups)
            by = " by the prior, until the runs' first steps time it"
        timed = (f"each run ~{run_s:.0f} s, ~{(self.seconds + total) / 60:.1f} min in all{by}"
                 if total else "its time follows the runs' first steps")
        return (f"depth {self.train.depth}, {d.steps} steps of "
                f"{self.train.total_batch_size:,} tokens, {d.seeds} seeds, {runs_per_seed} "
                f"variant-value pairs, {jobs} runs at a time; {timed}{self.detects(d)}")

    def detects(self, plan: Plan) -> str:
        """The effect the plan detects, projected where the spread at its shape was measured."""
        detects = budget.projected_detectable(max(2, plan.seeds), plan.steps)
        return (f"; detects ~{detects:.2%} of bpb (projected from the spread measured at this "
                "shape)" if self.shape else "")

    def say(self, how: str) -> None:
        """The plan, said before any run starts, after whether the default's fits."""
        if self.estimate is not None or self.guess is not None:
            self.overrun(self.estimate or self.guess, "" if self.estimate else " by the prior")
        tell(f"== plan for --budget {self.budget_s / 60:.1f} min ({how}): {self.words(self.plan)}")
        if self.plan.total_s:
            write_json(self.keys.plan, self.plan._asdict())

    def overrun(self, cal: Calibration, by: str = "") -> None:
        """Say the default's plan that cannot fit at cal, or a --budget the prior finds short."""
        p = self.plan
        total = modeled(cal, p.steps, p.seeds, *self.layout, p.groups)[1]  # its runs at cal
        smallest = (budget.MIN_STEPS, self.args.seeds or budget.FIRST_SEEDS)
        which = "the smallest one" if (p.steps, p.seeds) == smallest else "its plan"
        if self.args.budget_default and total > (self.budget_s - self.seconds) * budget.HEADROOM:
            end = self.seconds + total  # seconds after ablate began
            tell(f"== the default plan does not fit {self.budget_s / 60:.0f} minutes on this "
                 f"machine: {which} ({p.seeds} seeds of {p.steps} steps) takes ~{end / 60:.0f} "
                 f"min{by}{self.detects(p)}; --budget or --num-iterations chooses another")
        elif by and self.overruns(cal) is not None:
            tell(f"== by the prior, --budget {self.budget_s / 60:.1f}m may not fit even the "
                 "smallest plan's steps; the runs' first steps decide, and refuse it then")

    def eta(self, cal: Calibration) -> float:
        """Seconds after ablate began that its runs end, as they go: now, and at cal what the
        running runs have left and the runs not started yet take. Not the whole plan redone at
        cal: the time already spent is spent, so the estimate closes in on the end."""
        p, (runs_per_seed, jobs, lengths, batched) = self.plan, self.layout
        planned = Counter(budget.run_sizes(runs_per_seed, p.seeds, lengths, batched, p.groups))
        now = time.monotonic()
        with self.lock:
            started = [(r.seeds, r.at[0], r.steps or p.steps, now - r.began, r.wall)
                       for r in self.runs]
        queued = planned - Counter(run[0] for run in started)  # the sizes of the runs not started
        running = [run[:4] for run in started if run[4] is None]
        left = budget.left_s(cal, p.steps, list(queued.elements()), running, jobs)
        return now - self.args.started + budget.WRITE_UP_S + left

    def end_words(self, cal: Calibration) -> str:
        end = self.eta(cal)
        return (f"the plan ends ~{end / 60:.1f} min after ablate began, of a "
                f"{self.budget_s / 60:.1f}-minute budget" + ("" if end <= self.budget_s
                                                             else ", past it"))

    def paced(self, cal: Calibration) -> None:
        assumed = (f"the plan assumed {self.estimate.step_s:.3f}" if self.estimate else
                   f"the prior estimated {self.guess.step_s:.3f}" if self.guess else
                   "the first timing of these runs here")
        tell(f"== the runs' own pace: {cal.step_s:.3f} s a step of a seed ({assumed}); "
             f"{self.end_words(cal)}")
        if self.estimate is None:
            self.overrun(cal)

    def finished(self, run, cal: Calibration) -> None:
        self.retime(cal)
        prior_s = {} if self.guess is None else dict(prior_step_s=self.guess.step_s)
        write_json(self.keys.calibration, dict(calibration=cal._asdict(),
                                               about=dict(self.about, when=time.time(), **prior_s)))
        tell(f"== {run.label} took {run.wall:.0f} s; the runs so far: {in_words(cal)}; "
             f"{self.end_words(cal)}")

    def retime(self, cal: Calibration, added: int = 0) -> Plan:
        """The plan timed at cal, with `added` seeds as a batch of their own, kept under the lock
        (a run's end and the seeds added come from two threads). Returns the plan before."""
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
        """At the first run's end, once: the Jobs of the seeds the budget has room for."""
        with self.lock:  # a run has ended, so its rest is measured too
            ended = any(r.wall is not None for r in self.runs)
        if self.grown or not ended:
            return []
        self.grown, cal = True, self.measured()
        if self.args.seeds or cal is None or len(self.plan.groups) > 1:
            return []
        if not (added := budget.grow(self.budget_s, cal, self.plan, *self.layout)):
            return []
        before, now = self.retime(cal, added), self.plan
        tell(f"== the budget has room at the runs' own pace: seeds {before.seeds + 1}-"
             f"{now.seeds} join, a batch of each variant's; the plan now: {self.words(now)}")
        return self.make_jobs(list(range(before.seeds + 1, now.seeds + 1)), len(now.groups) - 1)
