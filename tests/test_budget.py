"""
ablate's --budget without a calibration of its own: the plan comes before any run, from a calibration
kept on this machine (scaled to the load, labelled where it is an estimate) or as the smallest plan;
the planned runs' own step records then time it, are kept, add seeds where the budget has room and
refuse a --budget given that cannot fit. Time is a fake clock here, and base_train a fake process
that steps on it: nothing is timed for real.
"""

import json
import math
import re
import threading
import time
from types import SimpleNamespace

import pytest
from test_ablate import T80, T975, TINY

from nanomuon.ablation import budget as planner

# the fake base_train's seconds: a step of one seed, a run's start-up, and its evals, save and report
STEP_S, START_S, REST_S = 1.0, 30.0, 10.0
PROBE_S = 0.8  # what the prior's eager step took, as Fake has it
FLAGS = ["--variants", "muon,adamw", "--sweep", "lr-multiplier=1", "--jobs", "1", *TINY,
         "--total-batch-size", "256", "--no-compile", "--baseline-lengths", "none"]


class Clock:
    """time.monotonic, moved only by the fake runs."""

    def __init__(self):
        self.t, self.lock = 1000.0, threading.Lock()

    def __call__(self):
        with self.lock:
            return self.t

    def advance(self, seconds):
        with self.lock:
            self.t += seconds


def last(cmd, flag):
    return cmd[len(cmd) - cmd[::-1].index(flag)]


class FakeTrain:
    """base_train as ablate launches it, on the clock: START_S to start up, each step of k seeds k * STEP_S
    (its record written before its line, as base_train does), REST_S after the last, then its summary."""

    def __init__(self, cmd, clock, base, said):
        self.cmd, self.clock, self.base, self.returncode = cmd, clock, base, 0
        self.said_before = list(said)  # what ablate had said when this run was launched
        self.stdout = self.lines()

    def lines(self):
        cmd = self.cmd
        steps = int(last(cmd, "--num-iterations"))
        seeds = [int(s) for s in last(cmd, "--seeds").split(",")] if "--seeds" in cmd else [
            int(last(cmd, "--seed"))]
        self.clock.advance(START_S)
        for i in range(1, steps + 1):
            self.clock.advance(len(seeds) * STEP_S)
            line = f"step {i:05d}/{steps:05d} | dt {len(seeds) * STEP_S * 1000:.0f}ms"
            with open(last(cmd, "--step-record"), "a") as f:
                f.write(json.dumps(dict(step=i, steps=steps, dt_ms=len(seeds) * STEP_S * 1000, line=line)) + "\n")
            yield line + "\n"
        self.clock.advance(REST_S)
        self.write_summary(last(cmd, "--run"), last(cmd, "--optimizer"), seeds, steps)
        yield "final val bpb 2.0\n"

    def write_summary(self, run, optimizer, seeds, steps):
        def bpb(seed):  # muon a little better, by a seed's own amount
            return 3.0 - 0.002 * steps + 0.001 * seed - (0.01 + 0.002 * (seed % 3) if optimizer == "muon" else 0)

        one = lambda s: dict(final_val_bpb=bpb(s), min_val_bpb=bpb(s), val_history=[[0, 4.0], [steps, bpb(s)]])
        summary = dict(val_train_time=[0.0, steps * STEP_S], tok_per_s=256.0, num_params=10 ** 6,
                       tokens_per_step=256, run=run)
        summary |= dict(per_seed={str(s): one(s) for s in seeds}) if len(seeds) > 1 else one(seeds[0])
        (self.base / "runs" / run).mkdir(parents=True, exist_ok=True)
        (self.base / "runs" / run / "summary.json").write_text(json.dumps(summary))

    def terminate(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class Fake:
    """The clock and the fake base_train in place, the machine's load a steady 0. runs: each launched run,
    with what ablate had said by then; said(): every line ablate has said."""

    def __init__(self, base, monkeypatch, capsys):
        from scripts import ablate

        self.clock, self.runs, self.lines, self.capsys = Clock(), [], [], capsys
        monkeypatch.setattr(time, "monotonic", self.clock)
        monkeypatch.setattr("nanomuon.ablation.pacing.machine_load", lambda: 0.0)
        # the prior's eager step, as if timed here: PROBE_S (the runs take STEP_S)
        monkeypatch.setattr("nanomuon.ablation.pacing.probe_step", lambda *a, **k: PROBE_S)

        def popen(cmd, **kw):
            assert "scripts.base_train" in cmd, cmd
            self.runs.append(FakeTrain(cmd, self.clock, base, self.said()))
            return self.runs[-1]

        monkeypatch.setattr(ablate.subprocess, "Popen", popen)

    def said(self) -> list[str]:
        self.lines += self.capsys.readouterr().out.splitlines()
        return list(self.lines)


@pytest.fixture
def fake(base, monkeypatch, capsys):
    return Fake(base, monkeypatch, capsys)


def said_plan(lines):
    return [x for x in lines if x.startswith("== plan for --budget")]


def test_a_first_budget_runs_its_plan_at_once_and_its_runs_time_it(base, fake, capsys):
    """Nothing has timed these runs here: the smallest plan (3 seeds of 50 steps) is said before the first run
    starts, and its runs are the calibration. Their records time a seed's step at the fake's STEP_S; the
    start-up, evals and save are what is left of their walls (a run of 3 seeds modeled as it took); the
    budget's room at that pace adds seeds 4-6, a batch of each variant's; every run launched is a result, and
    the ablation ends within its budget on the clock. A second ablate plans at once from the kept calibration."""
    from scripts import ablate

    clock, runs = fake.clock, fake.runs
    t0 = clock()
    results = ablate.main([*FLAGS, "--budget", "15m", "--name", "first"])
    out = "\n".join(fake.said())
    first = runs[0].said_before
    assert said_plan(first) and "nothing has timed these runs here yet" in said_plan(first)[0], first
    assert "50 steps of 256 tokens, 3 seeds" in said_plan(first)[0]
    # the prior times the plan before any run: the probe's step times what runs took over it
    prior_s = PROBE_S * planner.PRIOR_STEP_RATIO
    assert (f"a prior estimate: one eager step of a seed timed now, {PROBE_S:.3f} s, "
            f"x{planner.PRIOR_STEP_RATIO:g} for a run's: {prior_s:.3f} s a step of a seed") in said_plan(first)[0]
    assert re.search(r"min in all by the prior, until the runs' first steps time it", said_plan(first)[0])
    assert f"the runs' own pace: {STEP_S:.3f} s a step of a seed (the prior estimated {prior_s:.3f})" in out
    launched = sorted((last(r.cmd, "--optimizer"), last(r.cmd, "--seeds")) for r in runs)
    assert launched == [("adamw", "1,2,3"), ("adamw", "4,5,6"), ("muon", "1,2,3"), ("muon", "4,5,6")], launched
    assert "the budget has room at the runs' own pace: seeds 4-6 join" in out
    assert sorted(results) == sorted((v, "1", s) for v in ("muon", "adamw") for s in range(1, 7))
    assert clock() - t0 <= 15 * 60 * planner.HEADROOM
    kept = [json.loads(p.read_text()) for p in (base / "ablations" / "cache").glob("calibration-*.json")]
    assert len(kept) == 1
    cal = planner.Calibration(**kept[0]["calibration"])
    assert cal.step_s == STEP_S and cal.fixed_s >= 0
    assert kept[0]["about"]["prior_step_s"] == pytest.approx(PROBE_S * planner.PRIOR_STEP_RATIO)  # its error
    per_seed = planner.EVALS * cal.eval_s + cal.final_s
    assert cal.fixed_s + 3 * (per_seed + 50 * cal.step_s) == pytest.approx(START_S + 3 * 50 * STEP_S + REST_S)
    assert not re.search(r"-\d+ s a run's", out)

    mark = len(fake.said())
    ablate.main([*FLAGS, "--budget", "20m", "--name", "again"])
    again = runs[4].said_before[mark:]
    assert said_plan(again) and "(timed here before (calibration-" in said_plan(again)[0], again
    assert "1.000 s a step of a seed" in said_plan(again)[0]


def test_runs_without_a_budget_are_timed_for_the_next_plan(base, fake):
    """An ablation given its steps plans no budget, yet its runs' step records are kept as a calibration
    (a --published table resumed says its time as measured here, not by the prior), and each run's wall is
    said as it ends: a seed's step at the fake's STEP_S, the start-up, evals and save what is left."""
    from scripts import ablate

    calibrations = lambda: set((base / "ablations" / "cache").glob("calibration-*.json"))
    before = calibrations()
    ablate.main([*FLAGS, "--num-iterations", "50", "--seeds", "3", "--name", "unbudgeted"])
    took = f"took {(START_S + 3 * 50 * STEP_S + REST_S) / 60:.1f} min; the runs so far: 1.000 s a step of a seed"
    assert sum(line.startswith("== muon lr-multiplier 1 seeds 1-3 batched " + took) for line in fake.said()) == 1, [
        line for line in fake.said() if "took" in line]
    kept = calibrations() - before
    assert len(kept) == 1
    cal, about = planner.read_calibration(kept.pop())
    assert cal.step_s == STEP_S and about["load"] == 0.0
    per_seed = planner.EVALS * cal.eval_s + cal.final_s
    assert cal.fixed_s + 3 * (per_seed + 50 * cal.step_s) == pytest.approx(START_S + 3 * 50 * STEP_S + REST_S)


def cache_at(tmp_path, code="c", **more):
    return dict(dir=tmp_path, device="cpu a CPU", code=code, torch="t", **more)


def planned(argv, cache, jobs=2, threads=1):
    """plan_for_budget on these ablate flags, ablate started now: (its flags, its Refiner)."""
    from scripts import ablate

    args, flags = ablate.parse_args(argv)
    args.started = time.monotonic()
    if not argv:  # the default: the CPU's budget
        args.budget, args.budget_default = 900.0, True
    return ablate.plan_for_budget(args, flags, 2, jobs, threads, cache)


def keep(cache, argv, cal, load=0.0, jobs=2, threads=1):
    """A calibration kept for ablate with argv's runs, timed at `load`."""
    from scripts import ablate

    args, flags = ablate.parse_args(argv)
    keys = ablate.cache_keys(args, flags, jobs, threads, cache)
    keys.calibration.write_text(json.dumps(dict(calibration=cal._asdict(),
                                                about=dict(machine=keys.machine, load=load, when=1.0))))


def test_a_kept_calibration_from_another_load_is_scaled_and_called_an_estimate(tmp_path, monkeypatch, capsys):
    """Timed with the 2 runs alone on 2 cores (load 0); now 2 other processes want the cores too: each thread
    gets half a core, so a step takes twice as long, and the plan is the one fit() makes of the doubled
    calibration, said as an estimate. At the same load it is planned as kept, and not called one."""
    from scripts import ablate

    monkeypatch.setattr(ablate.os, "cpu_count", lambda: 2)
    cal = planner.Calibration(step_s=0.5, fixed_s=20.0, eval_s=1.0, seconds=0.0, final_s=2.0)
    for load, factor in [(2.0, 2.0), (0.0, 1.0)]:
        (tmp_path / str(load)).mkdir()
        keep(cache_at(tmp_path / str(load)), ["--budget", "20m"], cal, load=0.0)
        monkeypatch.setattr("nanomuon.ablation.pacing.machine_load", lambda load=load: load)
        _, refiner = planned(["--budget", "20m"], cache_at(tmp_path / str(load)))
        line = said_plan(capsys.readouterr().out.splitlines())[0]
        assert ("at a load of 0.0 (now 2.0: steps x2.00, an estimate)" in line) == (factor == 2), line
        scaled = planner.Calibration(*(v * factor for v in cal[:3]), refiner.seconds, cal.final_s * factor)
        want = planner.fit(1200, scaled, 2, 2, None, 1, True)
        assert refiner.plan[:2] == want[:2], (refiner.plan, want)


def test_a_calibration_of_other_code_here_is_an_estimate_and_another_machines_is_none(tmp_path, monkeypatch, capsys):
    """An ablate of other code on the same runs and machine kept one: it plans, called an estimate. One kept
    for other runs at once (--jobs 1) says nothing of these: the smallest plan, its time left to its runs."""
    monkeypatch.setattr("nanomuon.ablation.pacing.machine_load", lambda: 0.0)
    keep(cache_at(tmp_path, code="old"), ["--budget", "20m"], planner.Calibration(0.5, 20.0, 1.0, 0.0, 2.0))
    _, refiner = planned(["--budget", "20m"], cache_at(tmp_path, code="new"))
    line = said_plan(capsys.readouterr().out.splitlines())[0]
    assert "an estimate: timed here by an ablate of other code, torch or variants" in line, line
    assert refiner.plan.total_s > 0 and refiner.estimate.step_s == 0.5
    _, refiner = planned(["--budget", "20m"], cache_at(tmp_path, code="new"), jobs=1, threads=2)
    line = said_plan(capsys.readouterr().out.splitlines())[0]
    assert "nothing has timed these runs here yet" in line and "its time follows the runs' first steps" in line
    assert refiner.plan[:2] == (planner.MIN_STEPS, 3) and refiner.estimate is None


def projected(seeds, steps):
    """The detectable effect from the spreads measured at the default shape (0.52% of bpb at 64 steps, 0.37%
    at 79, 0.29% at 200, from 5, 10 and 5 seeds) on a line of slope -0.41 in log-log, weighted by degrees
    of freedom, times the t table's (t_0.975 + t_0.80) / sqrt(seeds)."""
    points = [(64, 0.0052, 4), (79, 0.0037, 9), (200, 0.0029, 4)]
    log_scale = sum(df * (math.log(s) + 0.41 * math.log(n)) for n, s, df in points) / sum(p[2] for p in points)
    return (T975[seeds - 1] + T80[seeds - 1]) / seeds ** 0.5 * math.exp(log_scale) * steps ** -0.41


def test_the_default_that_cannot_fit_says_so_with_its_plan_before_any_run(tmp_path, monkeypatch, capsys):
    """A calibration kept here that no 15 minutes hold (50 s steps): before any run starts, the default says
    it does not fit, and the smallest plan it runs instead, 3 seeds of 50 steps: its time as the model
    counts it (2 runs of 3 seeds on two lanes, then the baseline's 2 at 0.8) and its detectable effect at
    the spread measured at this shape. A --budget given is refused in one line instead."""
    monkeypatch.setattr("nanomuon.ablation.pacing.machine_load", lambda: 0.0)
    monkeypatch.setattr("nanomuon.ablation.runs.launch", lambda *a, **k: pytest.fail("a run started"))
    cal = planner.Calibration(step_s=50.0, fixed_s=10.0, eval_s=1.0, seconds=0.0, final_s=0.0)
    keep(cache_at(tmp_path), ["--budget", "15m"], cal)
    with pytest.raises(SystemExit, match=r"^error: --budget 900s fits fewer than 50 steps per run \(timed here"):
        planned(["--budget", "15m"], cache_at(tmp_path))
    keep(cache_at(tmp_path), [], cal)
    flags, refiner = planned([], cache_at(tmp_path))
    out = capsys.readouterr().out.splitlines()
    run = lambda k: cal.fixed_s + k * (planner.EVALS * cal.eval_s + 50 * cal.step_s)
    minutes = (refiner.seconds + run(3) + run(2)) / 60
    assert re.fullmatch(rf"== the default plan does not fit 15 minutes on this machine: the smallest one \(3 "
                        rf"seeds of 50 steps\) takes ~{minutes:.0f} min; detects ~([\d.]+)% of bpb \(projected "
                        r"from the spread measured at this shape\); --budget or --num-iterations chooses "
                        r"another", out[-2]), out
    assert float(re.search(r"detects ~([\d.]+)%", out[-2])[1]) == pytest.approx(100 * projected(3, 50), abs=0.01)
    assert out[-1].startswith("== plan for --budget 15.0 min (timed here before") and "50.000 s a step" in out[-1]
    assert f"~{minutes:.1f} min in all" in out[-1] and flags[-4:] == ["--num-iterations", "50", "--eval-every", "13"]


class Run:
    terminated = False

    def terminate(self):
        self.terminated = True


def records(watch, clock, steps, dt_s):
    for i in range(1, steps + 1):
        clock.advance(dt_s)
        watch.step(dict(step=i, steps=steps, dt_ms=dt_s * 1000))


def test_the_runs_records_time_a_step_and_never_a_negative_start_up(monkeypatch):
    """A seed's step is the warm records' seconds over the seed-steps they hold: a 3-seed run at 1.5 s a
    step and a 1-seed run at 0.7 s make (47 x 1.5 + 47 x 0.7) / (47 x 3 + 47 x 1) s; the first 3 steps of
    each compile and count for nothing. A run whose evals took less than their model (4 s after its last
    step, against 3 seeds' evals) has a start-up of 0 s, not a negative one, and the model gives its wall."""
    clock = Clock()
    monkeypatch.setattr(time, "monotonic", clock)
    evals = lambda step_s: planner.eval_times(step_s, 4096, 8192, 256, True)
    both = planner.Tracker(600, 5.0, evals)
    big = both.watch(3, "a")
    big.step(dict(step=1, steps=50, dt_ms=60_000.0))  # compiling
    records(big, clock, 50, 1.5)
    assert planner.Tracker(600, 5.0, evals).measured() is None  # no records, no pace
    small = both.watch(1, "b")
    records(small, clock, 50, 0.7)
    assert both.measured().step_s == pytest.approx((47 * 1.5 + 47 * 0.7) / (47 * 3 + 47 * 1))
    alone = planner.Tracker(600, 5.0, evals)
    run = alone.watch(3, "a")
    records(run, clock, 50, 1.5)
    clock.advance(4.0)
    run.ended()
    cal = alone.measured()
    per_seed = planner.EVALS * cal.eval_s + cal.final_s
    assert cal.fixed_s == 0 and 0 < cal.eval_s < evals(cal.step_s)[0] and run.wall == 50 * 1.5 + 4
    assert cal.fixed_s + 3 * (per_seed + 50 * cal.step_s) == pytest.approx(run.wall)


def test_a_budget_given_is_refused_from_the_runs_first_steps_and_then_at_once(tmp_path, monkeypatch):
    """With nothing timed here, a --budget 3m runs the smallest plan; its first records at 2 s a step of a
    seed put that plan's steps alone (two lanes: 3 seeds and the baseline's 2, then 3: 250 seed-steps of
    50 at the fullest lane) past the 3 minutes: refused, its runs stopped, and the pace kept. The next
    --budget 3m is refused before any run; --budget 30m is planned; the default never refuses."""
    clock = Clock()
    monkeypatch.setattr(time, "monotonic", clock)
    monkeypatch.setattr("nanomuon.ablation.pacing.machine_load", lambda: 0.0)
    _, refiner = planned(["--budget", "3m"], cache_at(tmp_path))
    run, process = refiner.watch(3, "muon"), Run()
    run.started_process(process)
    records(run, clock, 7, 6.0)
    assert (180 - refiner.seconds) * planner.HEADROOM < (3 + 2) * 50 * 2.0  # the arithmetic relied on
    assert process.terminated and run.refusal.startswith(
        "error: --budget 180s cannot fit: the smallest plan's steps alone take 500 s (2.000 s a step of a seed")
    assert f"--budget {math.ceil((500 / planner.HEADROOM + refiner.seconds) / 60)}m would" in run.refusal
    with pytest.raises(SystemExit, match=r"cannot fit: .* as runs here showed before \(refused-"):
        planned(["--budget", "3m"], cache_at(tmp_path))
    planned(["--budget", "30m"], cache_at(tmp_path))
    (tmp_path / "default").mkdir()
    _, default = planned([], cache_at(tmp_path / "default"))
    run = default.watch(3, "muon")
    records(run, clock, 7, 6.0)
    assert run.refusal is None


def prior_said(monkeypatch, tmp_path, argv, probe_s=20.0, device="cpu"):
    """plan_for_budget of argv with nothing timed here, on 2 cores at load 0, its prior's eager step
    probe_s: (its flags, its Refiner, the probe's calls)."""
    from scripts import ablate

    calls = []
    monkeypatch.setattr("nanomuon.ablation.pacing.machine_load", lambda: 0.0)
    monkeypatch.setattr(ablate.os, "cpu_count", lambda: 2)
    monkeypatch.setattr("nanomuon.ablation.runs.launch", lambda *a, **k: pytest.fail("a run started"))
    monkeypatch.setattr("nanomuon.ablation.pacing.probe_step", lambda *a, **k: calls.append(a) or probe_s)
    flags, refiner = planned(argv, cache_at(tmp_path, device_type=device, dtype="bf16"))
    return flags, refiner, calls


def test_the_first_default_that_cannot_fit_says_so_from_a_prior_before_any_run(base, tmp_path, monkeypatch,
                                                                                 capsys):
    """Nothing has timed these runs here: one eager step of a seed at the runs' own shape (depth 4, 8 rows of
    256 tokens, 2 micro-batches to 4,096 tokens, bf16, 1 thread each, both variants' optimizers) is timed
    before any run, 20 s here. A compiled run's step is PRIOR_STEP_RATIO of it, and its start-up
    PRIOR_START_STEPS; evals at a third of a token's step. At that the smallest plan (2 lanes: a 3-seed run,
    then the baseline's 2 at 0.8; beside it the other 3-seed run) overruns 15 minutes, and the default says so
    with its minutes and its detectable effect, then the plan, whose flags are the smallest plan's."""
    flags, refiner, calls = prior_said(monkeypatch, tmp_path, [])
    out = capsys.readouterr().out.splitlines()
    (config, variants, rows, micro, dtype, threads), = calls
    assert (config.n_layer, config.sequence_len, config.vocab_size) == (4, 256, 512)
    assert (variants, rows, micro, dtype, threads) == (["muon", "adamw"], 8, 2, "bf16", 1)
    step = 20.0 * planner.PRIOR_STEP_RATIO  # 2 runs of 1 thread on 2 idle cores: no contention
    start = 20.0 * planner.PRIOR_START_STEPS[True]
    eval_s = 65536 / 4096 * step / 3
    per_seed = 4 * eval_s + eval_s + 262144 / 4096 * step / 3  # 4 evals, then the last and the final
    run = lambda k: k * (per_seed + 50 * step)  # noqa: E731
    minutes = (refiner.seconds + max(2 * start + run(3) + run(2), start + run(3))) / 60
    assert re.fullmatch(rf"== the default plan does not fit 15 minutes on this machine: the smallest one \(3 "
                        rf"seeds of 50 steps\) takes ~{minutes:.0f} min by the prior; detects ~([\d.]+)% of bpb "
                        r"\(projected from the spread measured at this shape\); --budget or --num-iterations "
                        r"chooses another", out[-2]), out
    assert out[-1].startswith("== plan for --budget 15.0 min (nothing has timed these runs here yet; a prior "
                              f"estimate: one eager step of a seed timed now, 20.000 s, x{planner.PRIOR_STEP_RATIO:g} "
                              f"for a run's: {step:.3f} s a step of a seed, {start:.0f} s a run's start-up")
    assert f"~{minutes:.1f} min in all by the prior" in out[-1]
    assert flags[-4:] == ["--num-iterations", "50", "--eval-every", "13"] and refiner.plan.total_s == 0
    assert not list(tmp_path.glob("plan-*.json"))  # a prior's plan is not kept as one timed


def test_a_budget_given_is_told_by_the_prior_and_refused_only_by_the_runs(base, tmp_path, monkeypatch, capsys):
    """A --budget 3m that the prior's steps alone overrun: said before the runs, not refused (a prior is an
    estimate); the smallest plan starts, and its runs' records refuse it as before. On a GPU no prior is
    timed: its plan waits for the runs' first steps."""
    (tmp_path / "cpu").mkdir()
    _, refiner, _ = prior_said(monkeypatch, tmp_path / "cpu", ["--budget", "3m"])
    out = capsys.readouterr().out
    assert "== by the prior, --budget 3.0m may not fit even the smallest plan's steps; the runs' first steps " \
           "decide, and refuse it then" in out
    assert refiner.plan[:2] == (planner.MIN_STEPS, 3) and refiner.floor is not None
    (tmp_path / "gpu").mkdir()
    _, refiner, calls = prior_said(monkeypatch, tmp_path / "gpu", ["--budget", "3m"], device="cuda")
    out = capsys.readouterr().out
    assert not calls and refiner.guess is None and "its time follows the runs' first steps" in out


def test_the_probe_times_a_step_of_micro_batches_and_the_optimizers(monkeypatch):
    """probe_step on a fake clock that moves 1 s between any two readings: each timed span reads 1 s, so a
    step of 3 micro-batches is 3 s of forward and backward and 1 s of optimizer step, whichever variants
    (Newton-Muon's reads its matrices' inputs first); the threads it took are given back."""
    import torch

    from nanomuon.gpt import config_from_depth

    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(planner.time, "perf_counter", lambda: float(next(ticks)))
    threads = torch.get_num_threads()
    config = config_from_depth(1, 300, 16, 64, 64)
    assert planner.probe_step(config, ["muon", "adamw", "muon-newton"], 2, 3, "fp32", 1) == 3 + 1
    assert torch.get_num_threads() == threads


def run_events(k, n, t0, seed_step_s, slow_windows, start_s=150.0):
    """A run's step records and end on a steady CPU: its start-up, 3 compiling steps of 20 s, then k x
    seed_step_s a step (2x inside another run's compile, which takes the same cores), each eval 8 s a seed
    (the first 30 s more: it compiles), the final eval 25 s a seed and a 5 s save."""
    t, events = t0 + start_s, []
    for i in range(1, n + 1):
        dt = 20.0 if i <= 3 else k * seed_step_s * (2 if any(a <= t < b for a, b in slow_windows) else 1)
        t += dt
        events.append((t, dict(step=i, steps=n, dt_ms=dt * 1000)))
        if i % 13 == 0 or i == n:
            t += k * 8.0 + (30.0 if i == 13 else 0.0)
    return events, t + k * 25.0 + 5.0


def test_the_end_said_as_the_runs_go_stays_within_a_quarter_of_the_end(monkeypatch, tmp_path):
    """The default's shape timed on a fake clock at a steady load: muon and adamw (3 seeds, 50 steps) at
    once, adamw's compile (100 s) done long before muon's (300 s), then the baseline's 2 seeds at 40 steps
    once a lane frees; a compile slows the other run's steps. Every end ablate says (the runs' first pace,
    each run's end) lies within 25% of the real one."""
    from nanomuon.ablation import pacing

    clock, said = Clock(), []
    monkeypatch.setattr(time, "monotonic", clock)
    monkeypatch.setattr(pacing, "tell", lambda line: said.append(line))
    args = SimpleNamespace(budget=1800.0, seeds=None, budget_default=True, started=clock(), batch_seeds=True)
    train = SimpleNamespace(eval_tokens=65536, final_eval_tokens=262144, total_batch_size=4096, depth=4)
    keys = pacing.Keys(tmp_path / "d.json", tmp_path / "c.json", tmp_path / "r.json", "m")
    refiner = pacing.Refiner(args, train, planner.Plan(50, 3, 13, 0.0, 0.0), (2, 2, 1, True), keys, {},
                             None, 25.0, False)
    t0 = clock() + 20.0
    b_events, b_end = run_events(3, 50, t0, 0.8, [(t0, t0 + 360.0)], start_s=100.0)
    c_window = (b_end, b_end + 150.0 + 60.0)
    a_events, a_end = run_events(3, 50, t0, 1.0, [c_window], start_s=300.0)
    c_events, c_end = run_events(2, 40, b_end, 1.0, [])
    clock.t = t0
    a, b = refiner.watch(3, "a"), refiner.watch(3, "b")
    timeline = sorted([(t, a, r) for t, r in a_events] + [(t, b, r) for t, r in b_events]
                      + [(a_end, a, None), (b_end - 1e-6, b, None), (b_end, "c", None)]
                      + [(t, "c", r) for t, r in c_events] + [(c_end, "c", None)], key=lambda e: e[0])
    watches = {}
    for t, run, record in timeline:
        clock.t = t
        if run == "c" and "c" not in watches:
            watches["c"] = refiner.watch(2, "c")
            continue
        watch = watches.get(run, run)
        watch.step(record) if record else watch.ended()
    end = max(a_end, c_end) + planner.WRITE_UP_S - args.started
    ends = [float(m[1]) * 60 for line in said if (m := re.search(r"plan ends ~([\d.]+) min", line))]
    assert len(ends) == 4, said  # the first pace and each of the 3 runs' ends
    assert all(abs(e - end) <= 0.25 * end for e in ends), (ends, end)
