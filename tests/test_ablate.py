"""
scripts.ablate: its statistics against the t table and against sums redone here, its run cache (a re-run
launches nothing; an edit of the code, even in a copy of the package, or a rebuild of the data runs
again), and --name, which must not write outside ablations/.
"""

import bisect
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
from test_train import REPO, child_env
from test_train import TINY as TRAIN_TINY

from nanomuon.ablation import budget as planner
from nanomuon.dataset import build_embedded, data_dir

# ablate's default final eval (262,144 val tokens) off: slow at this size; test_train tests it
TINY = [*TRAIN_TINY, "--final-eval-tokens", "0"]
SMALL = ["--variants", "muon,adamw", "--seeds", "1", "--sweep", "lr-multiplier=1", "--jobs", "2", *TINY,
         "--total-batch-size", "256", "--num-iterations", "4", "--eval-every", "2", "--log-every", "4",
         "--no-compile", "--baseline-lengths", "none"]
T975 = {1: 12.706, 2: 4.303, 4: 2.776, 10: 2.228, 30: 2.042}  # the t table: 95% two-sided, by df


def test_t_quantile_matches_the_t_table():
    from nanomuon.ablation.stats import t_quantile

    for df, t in T975.items():
        assert abs(t_quantile(df) - t) < 1e-3, df


def mean_sd_hw(xs):
    m = sum(xs) / len(xs)
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
    return m, sd, T975[len(xs) - 1] * sd / len(xs) ** 0.5


@pytest.mark.slow
def test_ablate_seeds_lr_sweep_verdict_and_cache(base, monkeypatch):
    """Two variants x two lrs x two seeds, two at a time. Each seed sets the init (and data order) for every
    variant; the table's best lr, mean ± std [95% CI] and paired verdict are recomputed here from the runs'
    own summaries; a re-run launches nothing, and a wider sweep launches only its new runs."""
    from scripts import ablate

    args = ["--variants", "muon,adamw", "--name", "abl", "--seeds", "2", "--sweep", "lr-multiplier=1,0.5",
            "--jobs", "2", "--data-order", "seed",
            *TINY,
            "--total-batch-size", "256", "--num-iterations", "8", "--eval-every", "4", "--log-every", "8",
            "--no-compile"]
    results = ablate.main(args)
    out = base / "ablations" / "abl"
    table = (out / "ablation.md").read_text()
    assert (out / "val_bpb.png").read_bytes().startswith(b"\x89PNG") and "](val_bpb.png)" in table
    assert sorted(results) == sorted((v, m, s) for v in ("muon", "adamw") for m in ("0.5", "1") for s in (1, 2))
    short_lr = 0.02 * (200 / 50) ** 0.7  # 8 steps: below the 200 the rule was tuned at, and below 50
    for (v, m, s), r in results.items():
        run = json.loads((base / "runs" / f"abl-{v}-lr-multiplier{m}-s{s}" / "summary.json").read_text())
        assert run["optimizer"] == v and run["final_val_bpb"] == r["final_val_bpb"]
        meta = json.loads((base / "runs" / f"abl-{v}-lr-multiplier{m}-s{s}" / "step_000008" / "meta.json").read_text())
        assert abs(meta["args"]["matrix_lr"] - short_lr) < 1e-4, meta["args"]["matrix_lr"]
        assert [step for step, _ in run["val_history"]] == [0, 4, 8]
    assert f"--num-iterations 8 --eval-every 4 --log-every 8 --no-compile --matrix-lr {short_lr:.4g}`, then" in table
    step0 = {k: r["val_history"][0][1] for k, r in results.items()}
    assert len({b for (_, _, s), b in step0.items() if s == 1}) == 1  # one init per seed, whatever the variant
    assert step0["muon", "1", 1] != step0["muon", "1", 2]
    assert results["muon", "0.5", 1]["final_val_bpb"] != results["muon", "1", 1]["final_val_bpb"]
    finals = {(v, m): [results[v, m, s]["final_val_bpb"] for s in (1, 2)] for v, m, _ in results}
    best = {v: min(("0.5", "1"), key=lambda m: sum(finals[v, m])) for v in ("muon", "adamw")}
    rows = {}
    for v in ("muon", "adamw"):
        m, sd, hw = mean_sd_hw(finals[v, best[v]])
        rows[v] = next(line for line in table.splitlines() if line.startswith(f"| {v} | {best[v]} |"))
        shown = [float(x) for x in re.search(r"\| ([\d.]+) ± ([\d.]+) \[([-\d.]+), ([-\d.]+)\]", rows[v]).groups()]
        assert shown == pytest.approx([m, sd, m - hw, m + hw], abs=2e-4)  # the table's t has 3 decimals
    d, _, hw = mean_sd_hw([a - b for a, b in zip(finals["muon", best["muon"]], finals["adamw", best["adamw"]])])
    said = (f"better by {-d:.4f} bpb" if d + hw < 0 else f"worse by {d:.4f} bpb" if d - hw > 0
            else f"no difference larger than {max(abs(d - hw), abs(d + hw)):.4f} bpb")
    assert said in rows["muon"] and "(baseline)" in rows["adamw"]
    assert "At the edge of the sweep" in table  # a best of two lrs is always at an edge
    check_steps_verdict(base, table, finals, best, rows["muon"])
    for v in ("muon", "adamw"):  # the other value minus the best, paired by seed
        other = ({"0.5", "1"} - {best[v]}).pop()
        d, _, hw = mean_sd_hw([a - b for a, b in zip(finals[v, other], finals[v, best[v]])])
        cells = {"0.5": "", "1": ""} | {best[v]: "(best)", other: f"{d:+.4f} [{d - hw:+.4f}, {d + hw:+.4f}]"}
        assert f"| {v} | {cells['0.5']} | {cells['1']} |" in table

    launched = []
    popen = ablate.subprocess.Popen
    monkeypatch.setattr(ablate.subprocess, "Popen", lambda cmd, **kw: launched.append(cmd) or popen(cmd, **kw))
    assert ablate.main(args) == results and not launched
    ablate.main([*args[:7], "lr-multiplier=0.5,1,2", *args[8:], "--baseline-lengths", "none"])
    assert len(launched) == 4 and all(c[c.index("--lr-multiplier") + 1] == "2" for c in launched)


def check_steps_verdict(base, table, finals, best, row):
    """The verdict in steps, redone here in closed form: with the baseline at two lengths (8 steps and
    round(0.8 * 8) = 6, each its own schedule) the fitted slope is the mean per-seed drop over ln(8/6), its
    error their spread / (ln(8/6) sqrt(seeds)); the variant saves 1 - exp(-diff / slope) of the steps."""
    short = [json.loads((base / "runs" / f"abl-adamw-lr-multiplier{best['adamw']}-s{s}-n6" / "summary.json")
                        .read_text())["final_val_bpb"] for s in (1, 2)]
    drops = [b8 - b6 for b8, b6 in zip(finals["adamw", best["adamw"]], short)]
    gap = math.log(8 / 6)
    slope, slope_se = sum(drops) / 2 / gap, mean_sd_hw(drops)[1] / gap / 2 ** 0.5
    assert f"falls by {-slope * math.log(2):.4f} ± {slope_se * math.log(2):.4f} per doubling" in table
    if slope >= 0:
        assert "in steps: none" in row
        return
    d, sd, _ = mean_sd_hw([a - b for a, b in zip(finals["muon", best["muon"]], finals["adamw", best["adamw"]])])
    share = 1 - math.exp(-d / slope)  # the baseline reaches the variant's bpb at 8 exp(d / slope) steps
    r_se = (sd ** 2 / 2 / slope ** 2 + d ** 2 * slope_se ** 2 / slope ** 4) ** 0.5
    lo, hi = (8 * (1 - math.exp(-d / slope + k * T975[1] * r_se)) for k in (1, -1))
    word = "fewer" if share >= 0 else "more"
    assert (f"reaches the baseline's final bpb in {abs(8 * share):.0f} {word} steps of 8 ({abs(share):.1%}) "
            f"[{in_words(round(lo), round(hi))}]") in row, row


def in_words(lo: int, hi: int) -> str:
    """An interval of steps saved, lo <= hi (negative: more steps), as the verdict words it."""
    if lo >= 0:
        return f"{lo} to {hi} fewer"
    return f"{-hi} to {-lo} more" if hi <= 0 else f"{-lo} more to {hi} fewer"


@pytest.fixture(scope="module")
def small(base):
    """SMALL's two runs, finished and cached in base."""
    from scripts import ablate

    return ablate.main([*SMALL, "--name", "small"])


def files(*roots):
    return {p for r in roots for p in r.rglob("*") if p.is_file() and p.name != ".build.lock"}


@pytest.mark.parametrize("bad", ["../x", "/abs", "", "cache", ".."])
def test_bad_name_is_refused_in_one_line_before_anything_is_written(base, small, tmp_path, capsys, bad):
    """With every run cached, nothing else looks at the name: ablation.md and val_bpb.png went where
    it pointed (base/x, /abs, ablations/ itself, the cache folder)."""
    from scripts import ablate

    bad = str(tmp_path / "abs") if bad == "/abs" else bad
    before = files(base, tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ablate.main([*SMALL, "--name", bad])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and f"error: argument --name: {bad!r}" in err[-1], err
    assert "Traceback" not in "".join(err) and files(base, tmp_path) == before


def test_code_hash_covers_every_file_by_contents(tmp_path):
    from nanomuon.ablation.runs import code_hash

    dirs = [tmp_path / "nanomuon", tmp_path / "scripts"]
    for d in dirs:
        shutil.copytree(REPO / d.name, d, ignore=shutil.ignore_patterns("__pycache__"))
    math_py = dirs[0] / "coefficients.py"
    text, h = math_py.read_text(), code_hash(dirs)
    math_py.write_text(text.replace("8.156554524902461", "8.0", 1))
    assert code_hash(dirs) != h
    math_py.write_text(text)
    assert code_hash(dirs) == h
    (dirs[1] / "new.py").write_text('"""a new script"""\n')
    assert code_hash(dirs) != h


def key_line(out: str) -> tuple[str, str]:
    return re.search(r"^== cache key: code ([0-9a-f]{12}), data ([0-9a-f]{12}) ", out, re.M).groups()


@pytest.mark.heavy
def test_a_code_edit_reruns_what_was_cached(base, small, tmp_path):
    """ablate from a copy of the package: unedited, its runs are cached; with one Polar Express
    coefficient changed, they run again (muon's result moves, so the edited copy ran)."""
    for d in ("nanomuon", "scripts"):
        shutil.copytree(REPO / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "scripts.ablate", *SMALL, "--name", "edit"]
    summary = base / "runs" / "edit-muon-lr-multiplier1-s1" / "summary.json"

    def ablate():
        p = subprocess.run(cmd, cwd=tmp_path, env=child_env(base), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p.stdout

    ablate()  # cached unless the checkout changed since `small` ran
    first = ablate()
    assert first.count(": cached (") == 2
    math_py = tmp_path / "nanomuon" / "coefficients.py"
    text = math_py.read_text()
    assert text.count("(8.156554524902461, ") == 1
    math_py.write_text(text.replace("(8.156554524902461, ", "(8.0, "))
    edited = ablate()
    assert "cached" not in edited and edited.count("-m scripts.base_train") == 2, edited
    assert key_line(edited)[0] != key_line(first)[0] and key_line(edited)[1] == key_line(first)[1]
    bpb = json.loads(summary.read_text())["final_val_bpb"]
    before = base / "runs" / "small-muon-lr-multiplier1-s1" / "summary.json"
    assert bpb != json.loads(before.read_text())["final_val_bpb"]


@pytest.fixture
def base_copy(base, small, tmp_path, monkeypatch):
    """A base dir with base's data, tokenizer and ablate cache, at other paths."""
    copy = tmp_path / "base"
    for sub in ("data", "tokenizer", "ablations/cache"):
        shutil.copytree(base / sub, copy / sub)
    monkeypatch.setenv("NANOMUON_BASE_DIR", str(copy))
    return copy


@pytest.mark.heavy
def test_another_split_of_the_data_reruns(base_copy, monkeypatch, capsys):
    """The embedded corpus rebuilt with another --shard-chars (another train/val split) is other data."""
    from scripts import ablate

    launched = []
    popen = ablate.subprocess.Popen
    monkeypatch.setattr(ablate.subprocess, "Popen", lambda cmd, **kw: launched.append(cmd) or popen(cmd, **kw))
    ablate.main([*SMALL, "--name", "split"])  # cached unless the checkout changed since `small` ran
    launched.clear()
    ablate.main([*SMALL, "--name", "split"])
    assert not launched
    before = capsys.readouterr().out
    build_embedded(data_dir("embedded"), shard_chars=2_000_000)
    ablate.main([*SMALL, "--name", "split"])
    assert len(launched) == 2, "results of the old split answered for the new one"
    (code, data), after = key_line(before), key_line(capsys.readouterr().out)
    assert after[0] == code and after[1] != data


def test_the_data_fingerprint_reads_contents(base, base_copy, monkeypatch):
    """The same shards at other paths are the same data; a byte changed in place, with the size and
    mtime kept, is other data; an unchanged shard is not read again, unless it changed so recently
    that it could change again with the same timestamps."""
    from nanomuon import common
    from nanomuon.ablation import runs as ablation_runs

    monkeypatch.setattr(common, "RACY_NS", -1)  # every shard's last change is long past
    memo = base_copy / "memo.json"
    first = ablation_runs.data_fingerprint("embedded", memo)
    monkeypatch.setenv("NANOMUON_BASE_DIR", str(base))
    assert ablation_runs.data_fingerprint("embedded", base_copy / "other.json") == first
    monkeypatch.setenv("NANOMUON_BASE_DIR", str(base_copy))
    val = data_dir("embedded") / json.loads((data_dir("embedded") / "manifest.json").read_text())["val_shard"]
    st, data = val.stat(), bytearray(val.read_bytes())
    data[len(data) // 2] ^= 1
    with open(val, "r+b") as f:
        f.write(data)
    os.utime(val, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert val.stat().st_size == st.st_size and val.stat().st_mtime_ns == st.st_mtime_ns
    hashed = []
    file_hash = common.file_hash
    monkeypatch.setattr(common, "file_hash", lambda p: hashed.append(p) or file_hash(p))
    changed = ablation_runs.data_fingerprint("embedded", memo)
    assert changed != first and hashed == [val]
    assert ablation_runs.data_fingerprint("embedded", memo) == changed and hashed == [val]
    monkeypatch.setattr(common, "RACY_NS", 10**18)  # every shard changed a moment ago
    hashed.clear()
    for _ in range(2):
        assert ablation_runs.data_fingerprint("embedded", base_copy / "racy.json") == changed
    assert len(hashed) == 2 * len(list(data_dir("embedded").glob("*.parquet")))
    assert not (base_copy / "racy.json").exists()


class Finished:
    """A run that succeeds at once (it stands in for base_train: only what ablate does after counts)."""
    stdout, returncode = (), 0

    def __init__(self, cmd, **kw):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_code_edit_during_the_runs_caches_nothing(base_copy, monkeypatch):
    """Runs launched after an edit import the new code: their results must not go under the old key."""
    from scripts import ablate

    hashes = iter(["before"] + ["after"] * 10)
    monkeypatch.setattr("nanomuon.ablation.runs.code_hash", lambda: next(hashes))
    monkeypatch.setattr(ablate.subprocess, "Popen", Finished)
    cached = files(base_copy / "ablations" / "cache")
    with pytest.raises(SystemExit, match="changed while .* ran, so it is not cached; run ablate again"):
        ablate.main([*SMALL, "--name", "mid"])
    assert files(base_copy / "ablations" / "cache") == cached


T80 = {1: 1.376, 2: 1.061, 4: 0.941, 9: 0.883, 30: 0.854}  # the t table: one-sided 80%, by degrees of freedom


def test_t_quantile_matches_the_80_percent_t_table():
    from nanomuon.ablation.stats import t_quantile

    for df, t in T80.items():
        assert abs(t_quantile(df, 0.80) - t) < 1e-3, df


def test_the_paired_verdict_by_hand():
    """Three seeds whose differences are -0.01, -0.02, -0.03 bpb: mean -0.02, sd 0.01, so the 95%
    interval is -0.02 ± 4.303 * 0.01 / sqrt(3) = [-0.04484, +0.00484] (it holds zero), and the design
    detects (4.303 + 1.061) * 0.01 / sqrt(3) = 0.03097; a third seed at -0.021 makes it 'better'."""
    from nanomuon.ablation.stats import paired, verdict

    c = paired([-0.01, -0.02, -0.03])
    assert c["mean"] == pytest.approx(-0.02) and c["detectable"] == pytest.approx(0.030969, abs=2e-5)
    assert (c["lo"], c["hi"]) == pytest.approx((-0.044843, 0.004843), abs=2e-5)
    said = verdict([-0.01, -0.02, -0.03], 2.0)
    assert said.startswith("no difference larger than 0.0448 bpb (2.24%): -0.0200 [-0.0448, +0.0048]"), said
    assert "; detectable: 0.0310 (1.55%); 0.25% would take 34 seeds at this spread" in said, said
    assert verdict([-0.020, -0.021, -0.022], 2.0).startswith("better by 0.0210 bpb (1.05%) [-0.0235, -0.0185]")
    assert verdict([0.020, 0.021, 0.022], 2.0).startswith("worse by 0.0210 bpb")


def test_a_verdict_coarser_than_a_record_says_the_seeds_one_would_take():
    """From the t table: differences spreading 0.01 detect (t_.975 + t_.80) / sqrt(n) * 0.01, at
    34 seeds (2.0345 + 0.8526) / sqrt(34) * 0.01 = 0.00495, within 0.25% of 2.0 = 0.005, and at 33
    (2.0369 + 0.8530) / sqrt(33) * 0.01 = 0.00503, not; of 2.1 (0.00525) 31 seeds reach 0.00520
    and 30 only 0.00529 (2.0452 + 0.8542 at 29 df). A verdict that already detects 0.25% says
    nothing more, and a spread no number of seeds brings there says so."""
    from nanomuon.ablation.stats import MOST_SEEDS, seeds_to_detect, verdict

    assert seeds_to_detect(0.01, 0.005) == 34
    assert seeds_to_detect(0.01, 0.0025 * 2.1) == 31
    assert verdict([-0.01, -0.02, -0.03], 2.1).endswith("; 0.25% would take 31 seeds at this spread")
    assert verdict([-0.020, -0.0201, -0.0202], 2.0).endswith("detectable: 0.0003 (0.02%)")
    assert seeds_to_detect(1.0, 0.001) is None
    assert verdict([-1.0, 1.0, 0.5], 0.01).endswith(f"would take over {MOST_SEEDS:,} seeds at this spread")


def test_the_planner_fits_steps_and_seeds_to_the_budget():
    """fit() against the wall-time model redone here: the plan's runs (and the baseline's runs at other
    lengths on the first 2 seeds) fit the budget left after calibrating (with its headroom), one more step
    would not, and the seeds are the caller's, or of 3 to MAX_SEEDS those whose most steps give the
    smallest (t_0.975 + t_0.80) / sqrt(seeds) * steps ** -SPREAD_EXPONENT, found here by trying each."""
    from nanomuon.ablation.budget import Calibration, fit
    from nanomuon.ablation.stats import detectable_factor

    EVALS, HEADROOM, MAX_SEEDS, MIN_STEPS = planner.EVALS, planner.HEADROOM, planner.MAX_SEEDS, planner.MIN_STEPS

    cal = Calibration(step_s=0.5, fixed_s=10.0, eval_s=2.0, seconds=30.0)

    def total(steps, seeds, lengths, runs_per_seed=2, jobs=2):
        rounds = -(-(runs_per_seed * seeds + lengths * min(seeds, 2)) // jobs)
        return rounds * (cal.fixed_s + EVALS * cal.eval_s + steps * cal.step_s)

    def most_steps(budget, seeds, lengths):  # total() grows with steps: how many fit is the most
        left = (budget - cal.seconds) * HEADROOM
        return bisect.bisect_right(range(1, 100_000), left, key=lambda n: total(n, seeds, lengths))

    for budget, seeds, lengths in [(600, None, 1), (600, 3, 0), (1800, None, 1), (1800, None, 0),
                                   (3 * 3600, None, 1), (300, 1, 1), (400, None, 2)]:
        plan = fit(budget, cal, 2, 2, seeds, lengths)
        assert plan.steps == most_steps(budget, plan.seeds, lengths) >= MIN_STEPS, (budget, plan)
        assert abs(plan.total_s - total(plan.steps, plan.seeds, lengths)) < 1e-9
        assert plan.eval_every == -(-plan.steps // EVALS)  # evals at 0, 4 more and the end at most
        if seeds:
            assert plan.seeds == seeds
            continue
        projected = {n: detectable_factor(n) * most_steps(budget, n, lengths) ** -planner.SPREAD_EXPONENT
                     for n in range(3, MAX_SEEDS + 1) if most_steps(budget, n, lengths) >= MIN_STEPS}
        assert plan.seeds == min(projected, key=projected.get), (budget, plan, projected)
    assert fit(200, cal, 2, 2, None).seeds == 3  # the fewest seeds, at fewer steps
    big = fit(3 * 3600, cal, 2, 2, None)
    assert big.seeds == MAX_SEEDS and big.steps > 500  # then longer runs
    with_lengths, without = fit(600, cal, 2, 2, None, 2), fit(600, cal, 2, 2, None, 0)
    assert (with_lengths.seeds, with_lengths.steps) < (without.seeds, without.steps)  # the lengths cost
    assert fit(60, cal, 2, 2, None) is None  # not even MIN_STEPS fit


def test_the_planner_fits_batched_seeds_to_the_budget():
    """Batched, each variant's seeds are one run: two variants on two lanes, and the baseline's other
    length (2 seeds) after one of them. fit() against that model written out: a run of k seeds takes
    fixed_s + k (steps step_s + EVALS eval_s + final_s); the plan fits, one more step would not, and at
    the same budget it holds more seeds than one process per seed can."""
    from nanomuon.ablation.budget import Calibration, fit

    EVALS, HEADROOM = planner.EVALS, planner.HEADROOM
    cal = Calibration(step_s=0.5, fixed_s=30.0, eval_s=2.0, seconds=30.0, final_s=5.0)

    def total(steps, seeds, lengths):
        run = lambda k: cal.fixed_s + k * (steps * cal.step_s + EVALS * cal.eval_s + cal.final_s)
        return run(seeds) + (run(2) if lengths else 0)  # the longer lane: a variant, then the length

    for budget, seeds, lengths in [(900, None, 1), (900, 16, 0), (1800, None, 1), (600, 4, 1)]:
        plan = fit(budget, cal, 2, 2, seeds, lengths, batched=True)
        left = (budget - cal.seconds) * HEADROOM
        assert total(plan.steps, plan.seeds, lengths) <= left < total(plan.steps + 1, plan.seeds, lengths)
        assert abs(plan.total_s - total(plan.steps, plan.seeds, lengths)) < 1e-9, plan
        assert seeds is None or plan.seeds == seeds
    alone = fit(900, cal._replace(final_s=0.0), 2, 2, None, 1)
    batched = fit(900, cal, 2, 2, None, 1, batched=True)
    assert batched.seeds > alone.seeds, (batched, alone)


def test_a_run_shows_progress_every_30_seconds_and_every_eval(monkeypatch, capsys):
    """launch() asks base_train for every step line and echoes one each PROGRESS_S seconds at most,
    so a batched run of slow steps still says where it is; evals, the last step and errors always.
    A process stands in for base_train here, its lines 10 s apart."""
    from nanomuon.ablation import runs as ablation_runs

    lines = [f"step {i:05d}/00010 ( 10.0%) | loss 5.0 | dt 10000ms\n" for i in range(1, 11)]
    lines[5:5] = ["step 00005 | val bpb 2.5000\n"]
    lines += ["step 00010 | val bpb 2.0000\n", "final val bpb 2.0000\n"]
    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(ablation_runs.time, "monotonic", lambda: next(clock))

    class Process:  # writes each step line's record before the line, as base_train does
        def __init__(self, cmd, **kw):
            self.cmd, self.stdout, self.returncode = cmd, self.printed(cmd[-1]), 0

        def printed(self, record_path):
            for line in lines:
                if "/" in line:
                    step, steps = map(int, line.split()[1].split("/"))
                    with open(record_path, "a") as f:
                        f.write(json.dumps(dict(step=step, steps=steps, line=line.rstrip("\n"))) + "\n")
                yield line

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    launched = []
    monkeypatch.setattr(ablation_runs.subprocess, "Popen", lambda cmd, **kw: launched.append(cmd) or Process(cmd))
    ablation_runs.launch("run", ["--num-iterations", "10"], 1, 1)
    echoed = [x.split("] ", 1)[1] for x in capsys.readouterr().out.splitlines() if x.startswith("  [run]")]
    assert launched[0][-4:-1] == ["--log-every", "1", "--step-record"]
    want = [lines[0], lines[3], lines[5], lines[7], lines[10], *lines[11:]]
    assert echoed == [x.rstrip("\n") for x in want], echoed
    assert ablation_runs.PROGRESS_S == 30


@pytest.mark.parametrize("bad", ["", "ten", "-5m", "0", "5d"])
def test_a_budget_that_is_not_a_wall_time_is_refused(bad, capsys):
    from scripts import ablate

    with pytest.raises(SystemExit):
        ablate.parse_args([f"--budget={bad}"])
    assert "is not a wall time: give one like 600, 90s, 10m or 1.5h" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["ablate", "noise", "bench_seeds"])
@pytest.mark.parametrize("count", ["100000000", "99999999999999999999", "10001", "0",
                                   pytest.param("1" * 5000, id="5000-digits")])
def test_a_seed_count_past_the_most_is_refused_in_one_line(script, count, capsys):
    """--seeds counts seeds 1..N, each a run or a batched model's copy: a count past 10,000 (where
    more seeds stop being an answer) is refused as an argument, before anything is listed. The
    other flag here is one each script refuses only after parsing --seeds, so a count that gets
    through reaches that refusal instead."""
    import importlib

    module = importlib.import_module(f"scripts.{script}")
    after = {"ablate": ["--variants", "nope"], "noise": ["--variants", "muon"],
             "bench_seeds": ["--num-iterations", "0"]}[script]
    with pytest.raises(SystemExit) as e:
        (module.parse_args if script == "ablate" else module.main)(["--seeds", count, *after])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].endswith(
        f": error: argument --seeds: {count[:24]!r}: give a count of seeds from 1 to 10,000 (past "
        "that, more seeds is no answer: the spread must shrink)"), err
    assert "Traceback" not in "\n".join(err)


def test_the_most_seeds_are_taken():
    from scripts import ablate

    assert ablate.parse_args(["--seeds", "10000"])[0].seeds == 10_000


def test_a_huge_seed_count_is_refused_at_once_before_anything_is_written(base):
    """The command a user types, in its own process, its heap capped at 2 GiB (where a list of
    10**8 runs is a MemoryError, not the machine's memory): one error line, exit 2, in seconds, and
    nothing written in the base dir (no lock, no cache)."""
    import resource
    import time

    def cap():
        resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))

    before = files(base)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "scripts.ablate", "--variants", "muon,adamw", "--seeds",
                        "100000000", "--name", "huge"], cwd=REPO, env=child_env(base), capture_output=True,
                       text=True, timeout=120, preexec_fn=cap)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert [line for line in err if "error" in line.lower()] == [err[-1]], err
    assert "argument --seeds: '100000000': give a count of seeds from 1 to 10,000" in err[-1]
    assert time.monotonic() - t0 < 60 and files(base) == before and not p.stdout


@pytest.mark.slow
def test_a_budgeted_ablation_finishes_within_its_budget(base, capsys):
    """On a tiny model, --budget 70s with one seed: the plan is said before any run starts, and its runs end
    within 70 s of wall time, training the steps the plan says; they are the only runs launched."""
    import time

    from scripts import ablate

    start = time.monotonic()
    results = ablate.main(["--variants", "muon,adamw", "--name", "budget", "--jobs", "2", *TINY,
                           "--total-batch-size", "256", "--seeds", "1", "--budget", "70s", "--no-compile"])
    wall = time.monotonic() - start
    out = capsys.readouterr().out
    plan = re.search(r"== plan for --budget 1.2 min \(.*\): depth 2, (\d+) steps of 256 tokens, (\d) seeds", out)
    assert plan and out.index("== plan for") < out.index("scripts.base_train"), out
    steps, seeds = int(plan[1]), int(plan[2])
    assert wall <= 70, (wall, out)
    assert steps >= planner.MIN_STEPS and sorted({s for _, _, s in results}) == list(range(1, seeds + 1))
    assert all(r["val_history"][-1][0] == steps for r in results.values())
    assert out.count("-m scripts.base_train") == 3  # muon, adamw and adamw at 0.8: no calibration runs


@pytest.mark.parametrize("text", ["{", "[]", '{"steps": 5}', '{"steps": -1, "seeds": 3, "eval_every": 1, '
                                  '"run_s": 1.0, "total_s": 1.0}', '{"steps": "5", "seeds": 3, "eval_every": 1, '
                                  '"run_s": 1.0, "total_s": 1.0}'])
def test_a_kept_plan_that_is_not_one_is_planned_again(tmp_path, text, capsys):
    """The cache is a file like any other: a damaged plan is planned again, never trusted or a traceback."""
    from nanomuon.ablation.budget import Plan, read_plan

    path = tmp_path / "plan-x.json"
    assert read_plan(path) is None
    path.write_text(text)
    assert read_plan(path) is None and "planning again" in capsys.readouterr().out
    path.write_text(json.dumps(Plan(200, 4, 50, 150.0, 600.0)._asdict()))
    assert read_plan(path) == Plan(200, 4, 50, 150.0, 600.0)


def test_sweep_takes_any_base_train_flag_and_one_variant():
    """--sweep FLAG=values: numeric values in numeric order, as given (the run gets the string); one
    variant is enough when there is something to sweep, two are needed when there is not."""
    from scripts.ablate import parse_args

    args, flags = parse_args(["--variants", "muon", "--sweep", "matrix-lr=0.02,0.005,1e-2"])
    assert args.variants == ["muon"] and args.sweep[:2] == ("matrix-lr", ["0.005", "1e-2", "0.02"])
    with pytest.raises(SystemExit):
        parse_args(["--variants", "muon", "--sweep", "matrix-lr=0.02"])


@pytest.mark.parametrize("sweep,says", [
    ("name=a,b", "--sweep name=...: base_train has no --name"),
    ("dataset=a b,embedded", "--sweep dataset: each value would be judged on its own val set"),
    ("val-fraction=0.1,0.2", "--sweep val-fraction: each value would be judged on its own val set"),
    ("lr-multiplier=1,1.0", "1 and 1.0 are the same value (two identical runs)"),
    ("depth=2,x", "--sweep depth=x: argument --depth: invalid int value: 'x'"),
    ("lr-multiplier=1,", "'lr-multiplier=1,': value 2 is empty"),
    ("fp8=1,2", "--sweep fp8=...: --fp8 is a switch, it takes no value"),
    ("compile=1,2", "--sweep compile=...: --compile is a switch, it takes no value"),
    ("lr-multiplier=1,1e308", "--sweep lr-multiplier=1e308: --lr-multiplier 1e+308 is over 1,000"),
])
def test_every_sweep_value_is_checked_before_anything_runs(capsys, sweep, says):
    """A sweep base_train would refuse, in any of its values, is one line naming --sweep when
    ablate starts: not base_train's own words after another value has trained."""
    from scripts.ablate import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--variants", "muon", "--sweep", sweep])
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and "usage: base_train" not in "\n".join(err), err


@pytest.mark.parametrize("variants,sweep,says", [
    ("muon,scion", "scion:weight-decay=0.05,0.2", "--sweep weight-decay: --optimizer scion sets "
     "weight_decay itself, so base_train does not use --weight-decay in its runs"),
    ("muon,scion", "weight-decay=0.05,0.2", "--optimizer scion sets weight_decay itself"),
    ("muon,muon-powercool", "schedule=warmup_warmdown,powercool", "--sweep schedule: --optimizer "
     "muon-powercool sets schedule itself"),
    ("muon,adamw", "final-eval-tokens=1024,16384", "--sweep final-eval-tokens: each value would "
     "be judged on its own val set"),
    ("muon,adamw", "eval-tokens=1024,16384", "--sweep eval-tokens: each value would be judged"),
])
def test_a_sweep_whose_values_cannot_differ_or_change_the_val_set_is_refused(capsys, variants,
                                                                              sweep, says):
    """A flag a variant overrides would train its values alike, and an eval flag would judge each
    value on its own val set: either is one line when ablate starts, before any run."""
    from scripts.ablate import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--variants", variants, "--sweep", sweep])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and says in err[-1], err
    args, _ = parse_args(["--variants", "muon,scion", "--sweep", "muon:weight-decay=0.05,0.2"])
    assert args.sweep.run_flags("0.2") == ["--weight-decay", "0.2"]  # muon's own: it is used


def test_a_flag_the_variant_overrides_is_said_by_ablate_and_in_the_report(base, capsys):
    """base_train's 'is not used' line reaches ablate's output (echo) and the run's report.md."""
    from nanomuon.ablation import runs as ablation_runs
    from nanomuon.run import StepRecords
    from scripts import base_train

    base_train.main([*TINY, "--total-batch-size", "256", "--num-iterations", "2",
                     "--eval-every", "-1", "--optimizer", "scion", "--weight-decay", "0.1",
                     "--run", "not-used"])
    said = "--optimizer scion sets weight_decay 0.0 (--weight-decay 0.1 is not used)"
    out = capsys.readouterr().out
    assert said in out
    report = (base / "runs" / "not-used" / "report.md").read_text()
    assert f"- {said}" in report
    lines = [line + "\n" for line in out.splitlines()]
    ablation_runs.echo("scion", lines, StepRecords(base / "none.jsonl"))
    assert f"  [scion] {said}" in capsys.readouterr().out.splitlines()


def test_a_wandb_sweep_without_a_key_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    """wandb=off,online with no API key: refused when ablate starts, not by wandb's traceback after
    the first value has trained."""
    from scripts.ablate import parse_args

    for key in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(SystemExit):
        parse_args(["--variants", "muon", "--sweep", "wandb=off,online"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "--sweep wandb=online: --wandb online needs a W&B API key" in err[-1], err
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert parse_args(["--variants", "muon", "--sweep", "wandb=off,online"])[0].sweep.values == ["off", "online"]


def test_a_swept_value_that_is_no_run_name_is_named_by_a_slug_and_a_hash():
    """Run names are built from the swept values: a value a run name cannot hold (every local path
    has '/', a hub dataset ':') goes in as a bounded slug and a hash of the whole; a value that can
    goes in as itself."""
    from nanomuon.run import run_arg
    from scripts.ablate import Job

    values = ["my data", "/corpora/my data", "/other/my data", "hf:owner/name@main", "x" * 500,
              "embedded", "0.02", "1e-3"]
    names = [Job("muon", v, 1).name("abl", "dataset") for v in values]
    assert all(run_arg(n) == n and len(n) <= 64 for n in names) and len(set(names)) == len(names)
    assert re.fullmatch(r"abl-muon-datasetmy-data-[0-9a-f]{8}-s1", names[0]), names[0]
    assert re.fullmatch(r"abl-muon-datasetcorpora-my-data-[0-9a-f]{8}-s1", names[1]), names[1]
    assert names[5:] == ["abl-muon-datasetembedded-s1", "abl-muon-dataset0.02-s1", "abl-muon-dataset1e-3-s1"]


@pytest.mark.heavy
def test_a_local_dataset_trains_and_its_contents_key_the_cache(base, tmp_path, monkeypatch):
    """--dataset <a local folder>: its runs train and are compared; run again unedited, they are
    cached; with a file of the folder edited, they train again (the data's contents are in the key).
    A sweep of the dataset itself is refused: each value would be judged on its own val set."""
    from scripts import ablate

    folder = tmp_path / "my data"
    folder.mkdir()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly box".split()
    for i in range(40):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(words[(i * j) % len(words)] for j in range(300)))
    flags = [f for f in TINY if f not in ("--dataset", "embedded")]
    args = ["--variants", "muon", "--seeds", "1", "--sweep", "lr-multiplier=1,2", "--jobs", "2",
            "--name", "local", *flags, "--dataset", str(folder), "--total-batch-size", "256",
            "--num-iterations", "2", "--eval-every", "-1", "--no-compile", "--baseline-lengths", "none"]
    results = ablate.main(args)
    assert sorted(results) == [("muon", "1", 1), ("muon", "2", 1)]
    run = ablate.Job("muon", "1", 1).name("local", "lr-multiplier")
    meta = json.loads((base / "runs" / run / "step_000002" / "meta.json").read_text())
    assert meta["args"]["dataset"] == str(folder)
    assert (base / "ablations" / "local" / "val_bpb.png").read_bytes().startswith(b"\x89PNG")
    launched = []
    popen = ablate.subprocess.Popen
    monkeypatch.setattr(ablate.subprocess, "Popen", lambda cmd, **kw: launched.append(cmd) or popen(cmd, **kw))
    ablate.main(args)
    assert not [c for c in launched if "scripts.base_train" in c], launched
    (folder / "doc00.txt").write_text("an edited document " * 100)
    ablate.main(args)
    assert len([c for c in launched if "scripts.base_train" in c]) == 2, launched


def cache_at(tmp_path, code="c"):
    """What plan_for_budget reads of a run cache, in tmp_path."""
    return dict(dir=tmp_path, device="cpu a CPU", code=code, torch="t")


def keep(cache, argv, cal, load=0.0, jobs=2, threads=1):
    """A calibration kept for the runs of ablate argv, as if they had run here at `load`."""
    from scripts import ablate

    args, flags = ablate.parse_args(argv)
    keys = ablate.cache_keys(args, flags, jobs, threads, cache)
    keys.calibration.write_text(json.dumps(dict(calibration=cal._asdict(),
                                                about=dict(machine=keys.machine, load=load, when=1.0))))


def planned(argv, cache, jobs=2, threads=1):
    """plan_for_budget on ablate argv, started now (no argv: the default's CPU budget): (flags, Refiner)."""
    import time

    from scripts import ablate

    args, flags = ablate.parse_args(argv)
    args.started = time.monotonic()
    if not argv:
        args.budget, args.budget_default = 900.0, True
    return ablate.plan_for_budget(args, flags, 2, jobs, threads, cache)


def test_a_kept_plan_answers_only_for_the_same_baseline_lengths(tmp_path, monkeypatch, capsys):
    """The baseline's other lengths cost runs, so a plan kept for --baseline-lengths none is not the
    plan for 0.8: that one is fitted again (from the kept calibration) to fewer seeds or steps."""
    monkeypatch.setattr("nanomuon.ablation.pacing.machine_load", lambda: 0.0)
    cal = planner.Calibration(1.0, 10.0, 0.5, 3.0)
    plans = []
    for lengths in ("none", "0.8", "none"):
        argv = ["--budget", "20m", "--baseline-lengths", lengths]
        keep(cache_at(tmp_path), argv, cal)
        plans.append(planned(argv, cache_at(tmp_path))[1].plan)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("== plan for")]
    assert ["timed here before" in said[0], "planned before" in said[2]] == [True] * 2
    assert "planned before" not in said[1]
    assert plans[2] == plans[0] and plans[1] != plans[0] and plans[1].seeds <= plans[0].seeds


def test_runs_shorter_than_the_lrs_tuning_train_muons_matrices_higher(tmp_path, monkeypatch, capsys):
    """The rule's lrs were tuned at 200 steps, where Muon's matrix lr is 0.02; at 76 its best was 2x
    (docs/research.md). A budget's plan of fewer steps runs Muon's matrices at 0.02 x (200 / steps)^0.7,
    and says so; one that runs the 200, a preset, a given or swept --matrix-lr and GPU-sized steps keep
    the flags they had."""
    import time

    from scripts import ablate

    monkeypatch.setattr("nanomuon.ablation.pacing.machine_load", lambda: 0.0)
    for step_s, extra, raised in [(1.0, [], True), (1.0, ["--sweep", "lr-multiplier=1,2"], True),
                                  (0.05, [], False), (1.0, ["--matrix-lr", "0.01"], False),
                                  (1.0, ["--variants", "muon", "--sweep", "matrix-lr=0.01,0.02"], False)]:
        cache = cache_at(tmp_path / f"{step_s}{extra}")
        cache["dir"].mkdir()
        keep(cache, ["--budget", "15m", *extra], planner.Calibration(step_s, 10.0, 0.1, 3.0))
        args, flags = ablate.parse_args(["--budget", "15m", *extra])
        args.started = time.monotonic()
        got_flags, _ = ablate.plan_for_budget(args, flags, 2, 2, 1, cache)
        steps = int(got_flags[got_flags.index("--num-iterations", len(ablate.DEFAULT_FLAGS)) + 1])
        got = ablate.short_run_lrs(args, got_flags, ablate.train_args(got_flags))
        out = capsys.readouterr().out
        assert (steps < 200) == (step_s == 1.0), (steps, out)
        if raised:
            lr = 0.02 * (200 / steps) ** 0.7
            assert got == [*got_flags, "--matrix-lr", f"{lr:.4g}"] and 0.02 < lr < 0.06, (steps, got[-2:])
            assert f"== Muon's matrix lr {lr:.4g} for {steps}-step runs: the lr rule's 0.02, tuned at 200" in out
            assert ablate.train_args(got).matrix_lr == float(f"{lr:.4g}")
        else:
            assert got == got_flags and "Muon's matrix lr" not in out, out
    args, flags = ablate.parse_args(["--num-iterations", "4"])  # not measured below 50: 50's
    assert ablate.short_run_lrs(args, flags, ablate.train_args(flags))[-2:] == ["--matrix-lr", f"{0.02 * 4 ** 0.7:.4g}"]
    args, flags = ablate.parse_args(["--preset", "regime", "--num-iterations", "100"])
    assert ablate.short_run_lrs(args, flags, ablate.train_args(flags)) == flags
    args, flags = ablate.parse_args(["--total-batch-size", str(2 ** 19), "--num-iterations", "100"])
    assert ablate.short_run_lrs(args, flags, ablate.train_args(flags)) == flags
    with pytest.raises(ValueError, match="short_run_matrix_lr is the CPU rule's"):
        ablate.short_run_matrix_lr(100, 2 ** 19)


def test_a_kept_calibration_refuses_at_once(base, small, monkeypatch, capsys):
    """A calibration kept here for these runs, whatever budget they ran under: a --budget it cannot fit is
    refused before any run starts, naming it; a damaged one is said, and planned without (the smallest
    plan's runs start at once)."""
    from scripts import ablate

    monkeypatch.setattr("nanomuon.ablation.pacing.machine_load", lambda: 0.0)
    keys, launched = [], []
    cache_keys = ablate.cache_keys
    monkeypatch.setattr(ablate, "cache_keys", lambda *a: keys.append(cache_keys(*a)) or keys[-1])

    def launch(label, flags, *a, **k):
        launched.append(flags)
        raise SystemExit("no runs here")

    monkeypatch.setattr("nanomuon.ablation.runs.launch", launch)
    args = ["--name", "kept", *SMALL]
    with pytest.raises(SystemExit, match="no runs here"):  # nothing kept: the smallest plan runs
        ablate.main([*args, "--budget", "20s"])
    assert launched[0][len(launched[0]) - launched[0][::-1].index("--num-iterations")] == "50"  # the last
    ran = len(launched)  # muon's and adamw's, started at once
    cal = planner.Calibration(step_s=1.0, fixed_s=10.0, eval_s=0.5, seconds=0.0)
    keys[0].calibration.write_text(json.dumps(dict(calibration=cal._asdict(), about=dict(
        machine=keys[0].machine, load=0.0, when=1.0))))
    with pytest.raises(SystemExit, match=r"--budget 30s fits fewer than 50 steps per run \(timed here before "
                                         r"\(calibration-.*: 1.000 s a step of a seed, 10 s a run's start-up"):
        ablate.main([*args, "--budget", "30s"])
    assert len(launched) == ran
    keys[0].calibration.write_text('{"calibration": {"step_s": "fast"}}')
    assert planner.read_calibration(keys[0].calibration) is None
    assert "is not a calibration ablate kept; planning without it" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no runs here"):
        ablate.main([*args, "--budget", "40s"])
    assert len(launched) > ran


def test_a_variant_that_is_the_baseline_stretched_in_steps_saves_what_it_stretches():
    """The baseline's bpb is a_s - 0.1 ln(steps) per seed (each seed its own a_s); a variant that reaches at
    200 steps what the baseline reaches at 250 saves 1 - 200/250 = 20% of the steps: 40 fewer of 200, with
    no spread and an exact slope, so a zero-width interval; a variant as far the other way needs 25% more."""
    from nanomuon.ablation.stats import bpb_per_log_step, steps_verdict, steps_words

    a = [2.0, 2.3, 1.9]
    finals = {n: [x - 0.1 * math.log(n) for x in a] for n in (160, 200)}
    slope = bpb_per_log_step(finals)
    assert slope[0] == pytest.approx(-0.1) and slope[1] == pytest.approx(0, abs=1e-12) and slope[2] == 2
    diff = -0.1 * math.log(250 / 200)
    v = steps_verdict([diff] * 3, slope, 200)
    assert (v["share"], v["lo"], v["hi"], v["fewer"]) == pytest.approx((0.2, 0.2, 0.2, 40))
    assert steps_words(v) == "reaches the baseline's final bpb in 40 fewer steps of 200 (20.0%) [40 to 40 fewer]"
    worse = steps_verdict([-diff] * 3, slope, 200)
    assert worse["share"] == pytest.approx(1 - 250 / 200)
    assert "50 more steps of 200 (25.0%) [50 to 50 more]" in steps_words(worse)
    both = dict(v, fewer=-9, share=-9 / 50, steps=50, fewer_lo=-13.2, fewer_hi=4.6)
    assert steps_words(both).endswith("in 9 more steps of 50 (18.0%) [13 more to 5 fewer]")
    assert steps_words(dict(both, fewer_hi=-5.4)).endswith("(18.0%) [5 to 13 more]")
    assert steps_verdict([diff] * 3, (0.01, 0.0, 2), 200) is None  # a baseline that did not gain: no steps


def test_verdicts_compare_the_final_eval_where_the_runs_scored_one():
    """Runs with a final eval over a larger val set (base_train --final-eval-tokens) are judged by
    it, not by their last eval on --eval-tokens: here the last evals say the variant is worse by
    0.01 and the whole split says better by 0.02, 0.03, 0.04 (mean 0.03, sd 0.01: 95% interval
    0.03 ± 4.303 * 0.01 / sqrt(3)); the steps-to column still reads the curves."""
    from scripts.ablate import Sweep, report

    def record(last, whole):
        return dict(final_val_bpb=last, final_eval_bpb=whole, final_eval_tokens=123_456,
                    val_history=[[0, 5.0], [100, last]], val_train_time=[0.0, 10.0], tok_per_s=1.0)

    results = {}
    for s, gain in zip((1, 2, 3), (0.02, 0.03, 0.04)):
        results["muon", "1", s] = record(2.00, 2.10)
        results["adamw", "1", s] = record(2.01, 2.10 - gain)
    lines, _ = report(results, ["muon", "adamw"], Sweep("lr-multiplier", ["1"]), [1, 2, 3], "muon")
    row = next(line for line in lines if line.startswith("| adamw"))
    hw = 4.302653 * 0.01 / math.sqrt(3)
    assert f"better by 0.0300 bpb (1.43%) [{-0.03 - hw:+.4f}, {-0.03 + hw:+.4f}]" in row, row
    assert "| 2.0700 ± 0.0100 [" in row and "not reached" in row, row  # 2.01 never reaches 2.00
    assert any("over 123,456 val tokens" in line for line in lines), lines


def test_the_baseline_runs_other_lengths_on_the_first_2_seeds_and_the_steps_verdict_reads_them(
        base, monkeypatch):
    """With 5 seeds the baseline runs its other length (200 of 400 steps) on seeds 1-2 only; made-up runs:
    adamw's bpb is a_s - 0.1 ln(steps) + e_s ln(steps), e_s = 0, 0.001 on the seeds that ran both
    lengths (a slope of about -0.1 with an error), and muon is better by 0.01 + 0.002 s. The steps
    verdict is redone here: the share 1 - exp(-diff / slope) and an interval whose t has the
    Welch-Satterthwaite degrees of freedom of its two variances (the differences' from 5 seeds, the
    slope's from 2), rounded down: 4 here, where the smaller of the two would give 1."""
    from scripts import ablate

    jobs = []

    def run_one(job, *a, **k):
        jobs.append(job)
        steps = job.steps or 400
        tilt = {1: 0.0, 2: 0.001}.get(job.seed, 0.0)
        bpb = 2 + 0.05 * job.seed - (0.1 - tilt) * math.log(steps)
        bpb -= (0.01 + 0.002 * job.seed) if job.variant == "muon" else 0.0
        return dict(final_val_bpb=bpb, val_history=[[0, 4.0], [steps, bpb]], val_train_time=[0.0, 1.0],
                    tok_per_s=1.0, num_params=1, tokens_per_step=256)

    monkeypatch.setattr("nanomuon.ablation.runs.run_one", run_one)
    ablate.main(["--seeds", "5", "--jobs", "2", *TINY, "--total-batch-size", "256", "--num-iterations",
                 "400", "--no-compile", "--baseline-lengths", "0.5", "--name", "lengths-on-2",
                 "--no-batch-seeds"])  # a run per seed: made up by run_one
    assert sorted((j.seed, j.steps) for j in jobs if j.steps) == [(1, 200), (2, 200)]
    assert sorted(j.seed for j in jobs if not j.steps) == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    table = (base / "ablations" / "lengths-on-2" / "ablation.md").read_text()
    slopes = [-(0.1 - t) for t in (0.0, 0.001)]  # per seed: two lengths, an intercept each
    b = sum(slopes) / 2
    b_se = math.sqrt(sum((x - b) ** 2 for x in slopes) / 1 / 2)
    assert "also ran 200 steps (each with its own schedule, on the first 2 seeds)" in table
    assert f"falls by {-b * math.log(2):.4f} ± {b_se * math.log(2):.4f} per doubling" in table
    diffs = [-(0.01 + 0.002 * s) for s in range(1, 6)]
    m = sum(diffs) / 5
    v1 = sum((d - m) ** 2 for d in diffs) / 4 / 5 / b ** 2
    v2 = m ** 2 * b_se ** 2 / b ** 4
    df = (v1 + v2) ** 2 / (v1 ** 2 / 4 + v2 ** 2 / 1)
    assert 4 <= df < 5
    r, hw = -m / b, T975[4] * math.sqrt(v1 + v2)
    lo, hi = (400 * (1 - math.exp(r + k * hw)) for k in (1, -1))
    share = 1 - math.exp(r)
    assert (f"reaches the baseline's final bpb in {400 * share:.0f} fewer steps of 400 ({share:.1%}) "
            f"[{in_words(round(lo), round(hi))}]") in table, table


def test_the_steps_interval_widens_with_the_slopes_error():
    from nanomuon.ablation.stats import steps_verdict

    diffs = [-0.02, -0.03, -0.025, -0.015]
    sure, unsure = (steps_verdict(diffs, (-0.1, se, 3), 200) for se in (0.0, 0.03))
    assert sure["lo"] < sure["share"] < sure["hi"] or sure["hi"] < sure["share"] < sure["lo"]
    assert abs(unsure["hi"] - unsure["lo"]) > abs(sure["hi"] - sure["lo"])


def test_noise_sources_are_the_variances_of_the_paired_differences():
    """scripts.noise on made-up records: each source's variance is that of the paired differences across the
    runs that vary only it, redone here with statistics.variance; the thread row is half the squared change."""
    import statistics

    from scripts import noise
    from scripts.ablate import Job

    final = {}
    for i, d, t, v, b in [(1, 1, None, 2.00, 2.10), (2, 2, None, 2.05, 2.11), (3, 3, None, 1.90, 2.02),
                          (2, 1, None, 2.01, 2.08), (3, 1, None, 2.02, 2.12), (1, 2, None, 1.99, 2.10),
                          (1, 3, None, 2.03, 2.10), (1, 1, 2, 2.004, 2.10)]:
        for variant, bpb in (("muon", v), ("adamw", b)):
            final[Job(variant, "1", i, data_seed=d, threads=t)] = dict(val_history=[(100, bpb + 0.5), (200, bpb)])
    got = noise.sources(final, "muon", "adamw", 3, 1)
    assert got["seed (init and data order)"] == pytest.approx(statistics.variance([-0.10, -0.06, -0.12]))
    assert got["init alone"] == pytest.approx(statistics.variance([-0.10, -0.07, -0.10]))
    assert got["data order alone"] == pytest.approx(statistics.variance([-0.10, -0.11, -0.07]))
    assert got["rounding (other thread count)"] == pytest.approx(0.004 ** 2 / 2)
    assert got["seed, mean of the last 2 evals"] == pytest.approx(got["seed (init and data order)"])


def test_the_default_is_planned_to_the_cpus_budget(capsys):
    """No --budget and no --num-iterations on a CPU: 15 minutes where it trains in bf16, 30 where it has no
    bf16 units, said at the start, with short runs' evals (given eval flags win, said flags untouched);
    given either flag, or on a GPU, nothing is planned for the user and the flags are as given."""
    from argparse import Namespace

    from scripts.ablate import DEFAULT_FLAGS, default_budget, given_flags, train_args

    for dtype, minutes in [("bf16", 15), ("fp32", 30)]:
        args = Namespace(budget=None)
        flags = default_budget(args, list(DEFAULT_FLAGS), dict(device_type="cpu", dtype=dtype))
        assert args.budget == minutes * 60
        assert f"trains in {dtype}" in capsys.readouterr().out
        train = train_args(flags)
        assert (train.eval_tokens, train.final_eval_tokens) == (16384, 65536)
        assert not given_flags(flags) and len(flags) == len(DEFAULT_FLAGS)
    mine = ["--final-eval-tokens", "262144", "--depth", "2"]
    flags = default_budget(Namespace(budget=None), [*DEFAULT_FLAGS, *mine],
                           dict(device_type="cpu", dtype="bf16"))
    assert flags[len(DEFAULT_FLAGS):] == mine and train_args(flags).final_eval_tokens == 262144
    assert train_args(flags).eval_tokens == 16384
    for flags, device, budget in [(["--num-iterations", "300"], "cpu", None), (["--num-iterations=300"], "cpu", None),
                                  ([], "cuda", None), ([], "cpu", 60.0)]:
        args = Namespace(budget=budget)
        given = [*DEFAULT_FLAGS, *flags]
        assert default_budget(args, given, dict(device_type=device, dtype="bf16")) == given
        assert args.budget == budget


def test_a_presets_base_dir_with_a_tokenizer_of_another_vocab_is_refused(tmp_path, monkeypatch):
    """A preset's shape fixes its vocab: a tokenizer an earlier shape left in its base dir is named and
    refused, never read (its runs would train the wrong embedding); one of the right vocab is used."""
    from nanomuon.tokenizer import Tokenizer
    from scripts.ablate import DEFAULT_FLAGS, ensure_tokenizer

    monkeypatch.setenv("NANOMUON_BASE_DIR", str(tmp_path))
    held = Tokenizer.train(["def f(x):\n    return x + 1\n" * 50], 300)  # a small text: fewer merges
    held.save(tmp_path / "tokenizer")
    with pytest.raises(SystemExit, match=rf"holds a {held.vocab_size}-token tokenizer, and this shape "
                                         rf"trains a {held.vocab_size + 1}-token one: move that folder away"):
        ensure_tokenizer(DEFAULT_FLAGS, held.vocab_size + 1, exact=True)
    ensure_tokenizer(DEFAULT_FLAGS, held.vocab_size, exact=True)
    ensure_tokenizer(DEFAULT_FLAGS)  # no preset: the base dir's own, whatever its vocab


@pytest.mark.parametrize("name", ["regime", "regime-d2"])
def test_the_regime_preset_is_in_the_published_regime(name):
    """The preset's model, built from its flags as base_train builds it: at least 75% of its params in Muon
    matrices and at least 10 training tokens per param, as its description says."""
    import torch

    from nanomuon.gpt import GPT, config_from_depth
    from scripts.ablate import DEFAULT_FLAGS, PRESETS, train_args

    preset = PRESETS[name]
    args = train_args([*DEFAULT_FLAGS, *preset.flags])
    with torch.device("meta"):
        model = GPT(config_from_depth(args.depth, preset.vocab, args.max_seq_len, args.aspect_ratio, args.head_dim))
    groups = model.setup_optimizer().param_groups
    total = sum(p.numel() for p in model.parameters())
    muon = sum(p.numel() for g in groups if g["kind"] == "muon" for p in g["params"])
    tokens = args.num_iterations * args.total_batch_size
    assert muon / total >= 0.75 and tokens / total >= 10
    said = f"{total:,} params, {muon / total:.0%} in Muon matrices, {tokens / total:.1f} tokens per param"
    assert said in preset.about


@pytest.mark.heavy
def test_the_default_reads_one_data_order_and_seeds_the_init(base, monkeypatch):
    """--data-order fixed (the default): every run reads the documents in data seed 1's order and the seeds
    set the init alone, as track 3 runs; ablation.md says the verdict is at that order."""
    from scripts import ablate

    launched = []
    popen = ablate.subprocess.Popen
    monkeypatch.setattr(ablate.subprocess, "Popen", lambda cmd, **kw: launched.append(cmd) or popen(cmd, **kw))
    ablate.main(["--name", "fixed", *SMALL[:2], "--seeds", "2", *SMALL[4:]])
    got = sorted((c[c.index("--seeds") + 1], c[c.index("--data-seed") + 1]) for c in launched
                 if "scripts.base_train" in c)
    # each variant's seeds 1 and 2 as one batched run, on data seed 1
    assert got == [("1,2", "1"), ("1,2", "1")], got
    assert "on one data order (data seed 1) for every run" in (base / "ablations" / "fixed" / "ablation.md").read_text()


def test_the_difference_panel_shows_the_verdicts_own_interval(tmp_path):
    """The curves compare the evals of --eval-tokens, the verdict the final weights over more tokens: the
    first panel also draws the verdict's difference and 95% interval at the last step, worked out here
    (t_0.975 at 2 degrees of freedom), so it cannot disagree with the table; the plot draws it."""
    from nanomuon.ablation.verdicts import difference_panel
    from nanomuon.report import plot_curves

    def record(last, final):
        return dict(val_history=[[0, 4.0], [50, last]], final_val_bpb=last, final_eval_bpb=final)

    finals = {"muon": [2.00, 2.02, 2.01], "adamw": [2.05, 2.06, 2.07]}
    results = {(v, "1", s): record(2.03, finals[v][s - 1]) for v in finals for s in (1, 2, 3)}
    panel = difference_panel(results, ["muon", "adamw"], [1, 2, 3], {"muon": "1", "adamw": "1"}, "adamw")
    xs, ys, lo, hi = panel["series"]["muon - adamw: the verdict's final eval"]
    diffs = [a - b for a, b in zip(finals["muon"], finals["adamw"])]
    m = sum(diffs) / 3
    hw = T975[2] * math.sqrt(sum((d - m) ** 2 for d in diffs) / 2 / 3)
    assert xs == [50] and ys == [pytest.approx(m)]
    assert lo == [pytest.approx(m - hw, rel=1e-4)] and hi == [pytest.approx(m + hw, rel=1e-4)]  # a 4-digit t
    assert panel["series"]["muon - adamw"][1] == [0.0, 0.0]  # the curves' evals: no difference there
    assert plot_curves(tmp_path / "p.png", [panel]).stat().st_size > 0


def test_the_verdict_panel_draws_each_variant_at_its_best_in_percent(tmp_path):
    """The verdicts at a glance: each variant's final bpb minus the baseline's, paired by seed, at its
    own best swept value, in % of the baseline's mean, with the t interval worked out here (t_0.975 at
    2 df); a five-panel plot lays them out as two rows of three, not one row of five."""
    import struct

    from nanomuon.ablation.runs import Sweep
    from nanomuon.ablation.verdicts import verdict_panel
    from nanomuon.report import plot_curves

    finals = {("muon", "-"): [2.00, 2.02, 2.01], ("adamw", "1"): [2.05, 2.06, 2.08],
              ("adamw", "2"): [2.10, 2.11, 2.12]}
    results = {(v, x, s): dict(final_eval_bpb=f[s - 1], final_val_bpb=f[s - 1])
               for (v, x), f in finals.items() for s in (1, 2, 3)}
    sweep = Sweep("lr-multiplier", ["1", "2"], fixed=("muon",))
    panel = verdict_panel(results, ["muon", "adamw"], sweep, [1, 2, 3], {"muon": "-", "adamw": "1"},
                          "muon")
    diffs = [a - b for a, b in zip(finals["adamw", "1"], finals["muon", "-"])]
    m, base = sum(diffs) / 3, sum(finals["muon", "-"]) / 3
    hw = T975[2] * math.sqrt(sum((d - m) ** 2 for d in diffs) / 2 / 3)
    xs, ys, lo, hi = panel["series"]["adamw at 1"]  # its best of 1 and 2
    assert xs == [0] and ys == [pytest.approx(100 * m / base)]
    for half_width in (ys[0] - lo[0], hi[0] - ys[0]):  # a 4-digit t
        assert half_width == pytest.approx(100 * hw / base, rel=1e-3)
    assert panel["xticks"] == ([0], ["adamw at 1"])
    png = plot_curves(tmp_path / "p.png", [panel] * 5).read_bytes()
    width, height = struct.unpack(">II", png[16:24])  # the PNG's IHDR
    assert 1.5 < width / height < 3, (width, height)  # one row of five would be about 7


def children_of(pid):
    """The pids of pid's child processes (Linux /proc)."""
    from pathlib import Path

    return {int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()}


@pytest.mark.parametrize("sig", [pytest.param("SIGTERM", marks=pytest.mark.heavy),
                                 pytest.param("SIGINT", marks=pytest.mark.slow)])
def test_a_stopped_ablate_ends_its_runs_and_says_what_is_kept(base, sig):
    """SIGTERM, or SIGINT sent to ablate alone (not its process group), ends the base_train run it
    launched (never left training, holding the run's lock) and ablate says in one line what is kept,
    no traceback; its exit status is 128 + the signal's."""
    import signal
    import time

    sig = getattr(signal, sig)
    cmd = [sys.executable, "-m", "scripts.ablate", *SMALL, "--jobs", "1", "--num-iterations", "5000",
           "--name", f"stop{int(sig)}"]
    p = subprocess.Popen(cmd, cwd=REPO, env=child_env(base), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    out = []
    for line in p.stdout:
        out.append(line)
        if line.startswith("  [") and "step 0" in line:  # a run is training
            break
    runs = children_of(p.pid)
    assert len(runs) == 1, "".join(out)
    p.send_signal(sig)
    out += p.stdout.readlines()
    assert p.wait(timeout=60) == 128 + sig, "".join(out)
    assert out[-1].startswith("== ablate stopped; the runs it was training, ended: muon lr-multiplier 1 seed 1")
    assert "Traceback" not in "".join(out)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in runs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in runs), "its run trains on"


def test_two_ablates_of_one_name_do_not_run_at_once(base):
    """ablate holds ablations/<name>: a second one of that name is refused in one line before it
    trains anything (its runs would hit the first's run locks)."""
    from nanomuon.run import lock_run_dir, unlock_run_dir
    from scripts import ablate

    held = base / "ablations" / "twice"
    lock_run_dir(held)  # as a running ablate holds it
    try:
        with pytest.raises(SystemExit, match=r"^error: .*ablations/twice is in use by pid \d+ .*; wait for "
                                             r"that run to end \(or stop it\), or pick another --name$"):
            ablate.main([*SMALL, "--name", "twice"])
    finally:
        unlock_run_dir(held)
    assert not list((base / "runs").glob("twice-*"))


# modded-nanogpt's optimization track (records/track_3_optimization/README.md): steps to 3.28 val loss
TRACK_3 = {1: 3600, 2: 5625, 5: 3325, 3: 3500, 9: 3250, 10: 3250, 11: 3225, 12: 3325, 14: 3150, 15: 3275,
           16: 3125, 20: 3030, 23: 3075, 36: 3250, 37: 3250}
# each technique's record and the Muon record it was run beside; the u/w floor's and MuonH's read 0:
# the floor adds nothing to NorMuon (9 vs 10), MuonH ties a tuned Muon (37 vs 36)
BESIDE = {"adamw": (2, 1), "muon-soap": (14, 11), "muon-uw-floor": (9, 10), "muon-hyperball": (37, 36),
          "muon-powercool": (20, 16), "muon-contra": (11, 9), "muon-muown": (23, 12), "muon-newton": (15, 12)}


def test_the_published_signs_are_track_3s():
    """Every published technique's sign is that of its record's steps minus the Muon record's it was run
    beside, and its source names both records' steps."""
    from nanomuon.ablation.verdicts import PUBLISHED

    assert set(PUBLISHED) == set(BESIDE)
    for variant, (record, muon) in BESIDE.items():
        steps = TRACK_3[record] - TRACK_3[muon]
        assert PUBLISHED[variant].sign == (steps > 0) - (steps < 0), variant
        source = PUBLISHED[variant].source
        assert str(TRACK_3[record]) in source and str(TRACK_3[muon]) in source, source
        assert f"record {record}" in source and f"record {muon})" in source, source


def test_ablation_md_says_whether_each_verdict_agrees_with_the_published_sign():
    """Made-up runs against muon, 3 seeds each: SOAP-Muon better by 0.05 +- 0.01 (published better:
    agrees), MuonH worse by 0.05 (published no difference against a tuned Muon: disagrees), ContraMuon
    by +-0.05 around zero (published better: cannot tell), the u/w floor by the same (published no
    difference: agrees), adamw worse (published worse: agrees), muon-plus nothing published. Judged
    against adamw instead, muon's published sign is turned round and the others have none."""
    from scripts.ablate import Sweep, report

    offsets = {"muon": [0.0] * 3, "muon-soap": [-0.04, -0.05, -0.06], "muon-hyperball": [0.04, 0.05, 0.06],
               "muon-contra": [-0.05, 0.0, 0.05], "muon-uw-floor": [-0.05, 0.0, 0.05],
               "adamw": [0.09, 0.10, 0.11], "muon-plus": [-0.01, 0.0, 0.01]}
    results = {(v, "1", s): dict(final_val_bpb=2.0 + 0.1 * s + d, val_history=[[0, 5.0], [100, 2.0 + d]],
                                 val_train_time=[0.0, 1.0], tok_per_s=1.0)
               for v, ds in offsets.items() for s, d in zip((1, 2, 3), ds)}
    variants = list(offsets)

    def column(baseline):
        lines, _ = report(results, variants, Sweep("lr-multiplier", ["1"]), [1, 2, 3], baseline)
        head = next(line for line in lines if line.startswith("| variant |"))
        assert head.endswith("| against the published sign |"), head
        return {line.split(" | ")[0][2:]: line.rstrip(" |").split(" | ")[-1] for line in lines
                if line.startswith("| ") and not line.startswith(("| variant", "|---"))}

    said = column("muon")
    want = {"muon-soap": "agrees; published: better", "muon-hyperball": "disagrees; published: no difference",
            "muon-contra": "cannot tell (the interval holds zero); published: better",
            "muon-uw-floor": "agrees; published: no difference", "adamw": "agrees; published: worse",
            "muon-plus": "nothing published", "muon": "(baseline)"}
    for v, words in want.items():
        assert said[v].startswith(words), (v, said[v])
    assert "record 14: 3150 steps" in said["muon-soap"] and "p = 0.69" in said["muon-contra"]
    said = column("adamw")
    assert said["muon"].startswith("agrees; published: better (track 3: Adam 5625"), said["muon"]
    assert all(said[v] == "nothing published" for v in variants if v not in ("muon", "adamw")), said


@pytest.mark.parametrize("script,argv,says", [
    ("scripts.ablate", ["--sweep", "lr-multiplier=" + ",".join(map(str, range(1, 10001)))],
     "10,000 values; give at most 64"),
    ("scripts.noise", ["--val-slices", "-100000"], "give 0 (the whole val split) or a count"),
    ("scripts.noise", ["--val-slices", "1"], "give 0 (the whole val split) or a count"),
])
def test_counts_that_cannot_finish_are_refused_before_any_run(script, argv, says, capsys):
    """10,000 sweep values, or val slices below two, are one line when the script starts."""
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(script).main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err.strip().splitlines()[-1]


def test_published_plans_every_ported_technique_at_three_lrs_against_muon_once(tmp_path, monkeypatch, capsys):
    """--published: muon against adamw and the seven techniques ported from track 3, each at lr-multiplier
    0.5, 1 and 2, muon once; the baseline's shorter runs at 0.8 of the steps on 2 seeds. Its plan names each
    run, cached or to train, and the time of those to train at a kept calibration, summed by hand here:
    runs of 5 seeds, 2 at a time, the largest first to the freest lane. Given with --variants, it is refused."""
    from scripts import ablate

    ported = {"adamw", "muon-soap", "muon-uw-floor", "muon-hyperball", "muon-powercool", "muon-contra",
              "muon-muown", "muon-newton"}
    args, flags = ablate.parse_args(["--published", "--preset", "regime"])
    assert args.variants[0] == "muon" and set(args.variants) == {"muon", *ported} and args.baseline == "muon"
    assert args.sweep.of("muon") == ["-"] and args.sweep.flag == "lr-multiplier"
    assert all(args.sweep.of(v) == ["0.5", "1", "2"] for v in ported)
    with pytest.raises(SystemExit):
        ablate.parse_args(["--published", "--variants", "muon,adamw"])
    assert "--published chooses --variants itself" in capsys.readouterr().err

    monkeypatch.setattr("nanomuon.ablation.pacing.machine_load", lambda: 0.0)
    cache = dict(cache_at(tmp_path), tokenizer="k", dtype="bf16", data=["d", "f"])
    keep(cache, ["--published", "--preset", "regime"], planner.Calibration(1.0, 10.0, 0.1, 3.0))
    steps = ablate.train_args(flags).num_iterations
    todo = [ablate.Job(v, x, s, data_seed=1) for v in args.variants for x in args.sweep.of(v) for s in range(1, 6)]
    todo += [ablate.Job("muon", "-", s, round(0.8 * steps), 1) for s in (1, 2)]
    key = ablate.batch_key(todo[:5], flags, args.sweep, 1, 1, cache)[0]  # muon's: cached, no file read
    (cache["dir"] / f"{key}-x.json").write_text(json.dumps(dict(read={}, records={})))
    ablate.say_plan(args, todo, flags, 2, 1, cache)
    out = capsys.readouterr().out
    assert "==   muon seeds 1-5 batched: cached" in out
    assert "==   muon-newton lr-multiplier 0.5 seeds 1-5 batched: to train" in out
    assert f"==   muon seeds 1-2 batched at {round(0.8 * steps)} steps: to train" in out
    assert len(re.findall(r"^==   .*: to train$", out, re.M)) == 8 * 3 + 1
    five, two = 10 + 5 * (0.4 + steps), 10 + 2 * (0.4 + round(0.8 * steps))
    minutes = (12 * five + two) / 60
    assert f"== plan: 25 of 26 runs to train, 122 seeds in all, 2 at a time: about {minutes:.0f} min" in out


def test_a_technique_swept_alone_trains_the_runs_published_reads(tmp_path):
    """The GPU kit's regime steps sweep one technique at a time (--sweep T:lr-multiplier=0.5,1,2, muon once);
    their runs must be the very runs --published reads from the cache: the same keys, muon's too. A sweep of
    every variant would run muon at lr-multiplier 1 instead: another run, another key."""
    from scripts import ablate

    cache = dict(cache_at(tmp_path), tokenizer="k", dtype="bf16", data=["d", "f"])
    args, flags = ablate.parse_args(["--published", "--preset", "regime"])
    alone, _ = ablate.parse_args(["--preset", "regime", "--variants", "muon,muon-soap", "--baseline", "muon",
                                  "--sweep", "muon-soap:lr-multiplier=0.5,1,2"])
    everyone, _ = ablate.parse_args(["--preset", "regime", "--variants", "muon,muon-soap",
                                     "--sweep", "lr-multiplier=0.5,1,2"])

    def key(sweep, variant, value):
        jobs = [ablate.Job(variant, value, s, data_seed=1) for s in range(1, 6)]
        return ablate.batch_key(jobs, flags, sweep, 1, 1, cache)[0]

    for value in ("0.5", "1", "2"):
        assert key(args.sweep, "muon-soap", value) == key(alone.sweep, "muon-soap", value)
    assert key(args.sweep, "muon", "-") == key(alone.sweep, "muon", "-") != key(everyone.sweep, "muon", "1")
    assert alone.sweep.of("muon") == args.sweep.of("muon") == ["-"]
