"""
scripts/bench_nanochat.py, the head to head with nanochat: end to end on the CPU at a tiny shape
against a real nanochat checkout (NANOCHAT, else /tmp/nanochat; skipped without one), and its
refusals of a missing or wrong checkout, each in one line, before anything is built.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench_nanochat import commit_of, gpt2_estimate, main, parse_args

REPO = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
        "--max-seq-len", "64", "--vocab-size", "512", "--device-batch-size", "2",
        "--total-batch-size", "256", "--steps", "2", "--warmup", "1"]


def checkout() -> Path | None:
    for raw in (os.environ.get("NANOCHAT"), "/tmp/nanochat"):
        if raw and (Path(raw) / "nanochat" / "gpt.py").is_file():
            return Path(raw).resolve()
    return None


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "scripts.bench_nanochat", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)


NUMBERS = (r"([\d,]+) tok/s, MFU n/a, optimizer ([\d.]+) ms, peak n/a, build\+warmup \d+ s, "
           r"attention sdpa")


def test_both_projects_train_side_by_side_on_the_cpu():
    """Both GPTs train 1 + 2 steps of the same random tokens at d2 in bf16, from the same flat
    start (the loss of uniform logits, ln 512); the summary holds each side's tok/s and optimizer
    ms and their ratios, fp8 is n/a on a CPU for both with the reason, and nanochat's commit and
    path are said."""
    root = checkout()
    if root is None:
        pytest.skip("no nanochat checkout: set NANOCHAT=path (or clone it to /tmp/nanochat)")
    p = run("--nanochat", str(root), *TINY, "--precision", "bf16", "fp8")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"h2h nanochat {commit_of(root)} ({root}); " in p.stdout
    m = re.search(rf"^h2h d2 bf16: nanomuon {NUMBERS}; nanochat {NUMBERS}; nanomuon/nanochat "
                  r"tok/s ([\d.]+), optimizer ([\d.]+)$", p.stdout, re.M)
    assert m, p.stdout
    ours, ours_opt, theirs, theirs_opt, ratio, opt_ratio = (
        float(g.replace(",", "")) for g in m.groups())
    assert ratio == pytest.approx(ours / theirs, rel=0.01, abs=0.002)
    assert opt_ratio == pytest.approx(ours_opt / theirs_opt, rel=0.02, abs=0.002)
    starts = re.findall(r"^  nano(?:muon|chat) .*; loss ([\d.]+) -> ([\d.]+)$", p.stdout, re.M)
    assert len(starts) == 2 and all(abs(float(a) - math.log(512)) < 0.05 for a, _ in starts)
    fp8 = re.search(r"^h2h d2 fp8: nanomuon n/a \((.*)\); nanochat n/a \((.*)\)$", p.stdout, re.M)
    assert fp8 and all("fp8 tensor cores" in why for why in fp8.groups()), p.stdout


def test_a_missing_or_wrong_checkout_is_refused_in_one_line(tmp_path, monkeypatch):
    """No --nanochat and no NANOCHAT, a path that does not exist, a folder without nanochat/gpt.py:
    each one line naming what to pass, before any model is built."""
    monkeypatch.delenv("NANOCHAT", raising=False)
    for argv, said in (([], "no nanochat: pass --nanochat PATH or set NANOCHAT=PATH"),
                       (["--nanochat", str(tmp_path / "nosuch")], "holds no nanochat/gpt.py"),
                       (["--nanochat", str(tmp_path)], "holds no nanochat/gpt.py")):
        with pytest.raises(SystemExit) as e:
            main([*argv, *TINY])
        assert said in str(e.value) and "\n" not in str(e.value), argv
    p = run(*TINY, env=dict(os.environ, NANOCHAT=str(tmp_path)))
    assert p.returncode == 1 and p.stdout == "", p.stdout
    assert p.stderr.count("\n") == 1 and "holds no nanochat/gpt.py" in p.stderr, p.stderr


def test_the_commit_is_the_checkouts_own(tmp_path):
    """A COMMIT file (what gpu_check.sh --prepare writes) names the commit; a copy inside another
    repository (the kit lies in nanomuon's) is not given that repository's HEAD."""
    outer = tmp_path / "outer"
    (outer / "kit" / "nanochat").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    assert commit_of(outer / "kit").startswith("unknown")
    (outer / "kit" / "COMMIT").write_text("92d63d4e8bb4df75c3b71618f31ddde2378b2bcd\n")
    assert commit_of(outer / "kit") == "92d63d4e8bb4df75c3b71618f31ddde2378b2bcd"


@pytest.mark.heavy
def test_parity_with_nanochats_own_code():
    """--parity against a real checkout: the forward loss, 20 steps, the d24 table and the sizes
    agree (its last line says so and it exits 0); every printed loss pair is within 1e-4."""
    root = checkout()
    if root is None:
        pytest.skip("no nanochat checkout: set NANOCHAT=path (or clone it to /tmp/nanochat)")
    p = run("--parity", "--nanochat", str(root))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.splitlines()[-1].startswith("parity: nanomuon's arch 'nanochat' equals")
    steps = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+\S+\s+[\d.]+\s+\S+$", p.stdout, re.M)
    assert len(steps) == 20
    assert all(abs(float(a) - float(b)) <= 1e-4 * float(b) for _, a, b in steps)
    assert "DIFFERS" not in p.stdout


def test_parity_takes_no_shape_flags():
    """--parity runs at its own shapes: a shape flag beside it is refused in one line."""
    with pytest.raises(SystemExit):
        main(["--parity", "--depth", "4"])


@pytest.mark.heavy
def test_a_symlink_loop_is_refused_in_one_line(tmp_path):
    """--nanochat through a symlink loop (the folder itself, or a path under it): one line naming
    the loop, no traceback."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for given in (tmp_path / "a", tmp_path / "a" / "nanochat"):
        p = run("--nanochat", str(given), *TINY)
        assert p.returncode == 1 and p.stdout == "", p.stdout
        assert p.stderr.count("\n") == 1 and "symlink loop" in p.stderr, p.stderr


def test_it_says_that_the_checkouts_code_is_imported_and_run(tmp_path):
    """Before nanochat's code is imported, one line says that the named checkout's own code runs
    in this process (here a checkout whose gpt.py fails to import, so nothing else runs)."""
    (tmp_path / "nanochat").mkdir()
    (tmp_path / "nanochat" / "gpt.py").write_text("raise ImportError('stop here')\n")
    p = run("--nanochat", str(tmp_path), *TINY)
    assert p.returncode == 1 and "does not import here" in p.stderr, p.stderr
    said = [line for line in p.stdout.splitlines() if "imported and run" in line]
    assert said == [f"nanochat: the code of {tmp_path.resolve()} is imported and run in this "
                    "process, as it is (its nanochat/*.py)"], p.stdout


def measured_side(tok_s: float, attention: str) -> dict:
    return dict(tok_s=tok_s, mfu=0.4, optimizer=0.05, peak=60 * 2 ** 30, warm=200.0,
                attention=attention)


def test_the_time_to_gpt2_is_nanochats_hours_scaled_by_the_d24_fp8_ratio():
    """At the speedrun's shape with fp8 on both sides: 1.65 h x nanochat's tok/s / nanomuon's, with
    the run's GPU and nanochat's commit; a caveat where nanochat ran without its FA3; no estimate
    where a side failed; nothing at another depth or without fp8."""
    args = parse_args(["--nanochat", "x", "--depth", "24", "--device-batch-size", "16",
                       "--total-batch-size", "262144"])
    header = "nanochat 92d63d4 (kit); NVIDIA H200 (cuda), torch 2.11.0, 16 threads, 2026-11-28"
    pair = dict(nanomuon=measured_side(500_000, "flex"),
                nanochat=measured_side(600_000, "fa3 from the kernel hub"))
    line = gpt2_estimate(args, {"fp8": pair}, header)
    said = ("time to GPT-2 on 8xH100 ≈ 1.65 h × nanochat tok/s ÷ nanomuon tok/s at d24, fp8 = "
            "1.65 h × 600,000 ÷ 500,000 = ")
    assert line.startswith(said + f"{1.65 * 600_000 / 500_000:.2f} h ("), line
    assert "NVIDIA H200" in line and "nanochat 92d63d4" in line and "ran FA3" not in line, line
    pair["nanochat"]["attention"] = "sdpa with windows as a mask"
    line = gpt2_estimate(args, {"fp8": pair}, header)
    assert line.endswith("; nanochat's 1.65 h ran FA3, here it ran sdpa with windows as a mask)")
    pair["nanomuon"] = dict(error="OutOfMemoryError: CUDA out of memory", attention="flex")
    line = gpt2_estimate(args, {"fp8": pair}, header)
    assert "no estimate (nanomuon FAILED (OutOfMemoryError: CUDA out of memory)" in line, line
    assert "\n" not in line
    assert gpt2_estimate(args, {"bf16": pair}, header) is None
    assert gpt2_estimate(parse_args(["--depth", "12"]), {"fp8": pair}, header) is None


def test_parity_against_another_nanochats_api_is_one_line(tmp_path):
    """An older nanochat whose GPTConfig takes other arguments: --parity says it cannot compare,
    where and with which commit it does, not a TypeError's traceback."""
    (tmp_path / "nanochat").mkdir()
    (tmp_path / "nanochat" / "gpt.py").write_text(
        "class GPTConfig:\n    def __init__(self, sequence_len):\n        pass\n\n\n"
        "class GPT:\n    def __init__(self, config):\n        pass\n")
    p = run("--parity", "--nanochat", str(tmp_path))
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("error: parity could not run against this nanochat (TypeError: ") \
        and "check that commit out" in p.stderr, p.stderr
