"""
Batched seeds against a process per seed: the wall time of N seeds trained as one batched
base_train run (--seeds 1,...,N) against N runs, one after another with every core, and two at a
time with a core each. The shape is ablate's default, at --num-iterations steps (other flags go to
every run); each layout runs with its compile cache warm, in a base dir of its own.

    python -m scripts.bench_seeds                      # 3 seeds of 54 steps
    python -m scripts.bench_seeds --seeds 8 --num-iterations 100
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nanomuon.common import get_base_dir
from scripts.ablate import DEFAULT_FLAGS, MOST_SEEDS, ensure_tokenizer, seeds_arg


def train(base: Path, run: str, flags: list[str], threads: int) -> float:
    """One base_train run in `base` with `threads` threads; its wall seconds (it must succeed)."""
    env = dict(os.environ, NANOMUON_BASE_DIR=str(base), OMP_NUM_THREADS=str(threads))
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "scripts.base_train", *flags, "--run", run],
                       env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"error: {run} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return time.monotonic() - t


def layouts(base: Path, flags: list[str], seeds: list[int], cores: int) -> dict:
    """name -> wall seconds of the seeds in each layout."""
    one = [*flags, "--log-every", "1000"]
    walls, n = {}, min(2, cores, len(seeds))
    for jobs, at_once in ((1, "one"), (n, str(n))):  # a seed's threads: the cores its lane has
        t = time.monotonic()
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(lambda s, jobs=jobs, at_once=at_once: train(
                base, f"{at_once}-{s}", [*one, "--seed", str(s)], max(1, cores // jobs)), seeds))
        walls[f"a process per seed, {at_once} at a time"] = time.monotonic() - t
    walls["one batched process (--seeds)"] = train(
        base, "batched", [*one, "--seeds", ",".join(map(str, seeds))], cores)
    return walls


def main(argv=None):
    p = argparse.ArgumentParser(description="batched seeds against a process per seed",
                                allow_abbrev=False)
    p.add_argument("--seeds", type=seeds_arg, default=3, help=f"seeds 1..N, N 2 to {MOST_SEEDS:,}")
    p.add_argument("--num-iterations", type=int, default=54,
                   help="steps per run (54: the default ablate's plan on a bf16 CPU)")
    args, extra = p.parse_known_args(argv)
    if args.seeds < 2 or args.num_iterations < 1:
        p.error("--seeds must be >= 2 and --num-iterations >= 1")
    ensure_tokenizer(DEFAULT_FLAGS)
    flags = [*DEFAULT_FLAGS, "--num-iterations", str(args.num_iterations), "--eval-every",
             str(max(1, args.num_iterations // 4)), *extra]
    seeds, cores = list(range(1, args.seeds + 1)), os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench-seeds-", ignore_cleanup_errors=True) as tmp:
        base = Path(tmp)
        shutil.copytree(get_base_dir() / "tokenizer", base / "tokenizer")
        warm = [*flags, "--num-iterations", "3", "--eval-every", "-1", "--final-eval-tokens", "0"]
        train(base, "warm-alone", warm, cores)  # fill the compile cache, untimed
        train(base, "warm-batched", [*warm, "--seeds", ",".join(map(str, seeds))], cores)
        walls = layouts(base, flags, seeds, cores)
        record = json.loads((base / "runs" / "batched" / "summary.json").read_text())
    batched = walls["one batched process (--seeds)"]
    print(f"{len(seeds)} seeds of {args.num_iterations} steps, {cores} cores "
          f"(batched: {record['median_step_ms']:.0f} ms a step of all seeds):")
    for name, wall in walls.items():
        print(f"  {name:40s} {wall:7.1f} s   batched / this: {batched / wall:.2f}")


if __name__ == "__main__":
    main()
