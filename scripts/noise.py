"""
Where the noise in an ablation's verdict comes from: a paired difference (variant minus baseline)
moves with the init, the data order, which val documents score it and the rounding of the sums
that trained it. This varies one at a time and prints each source's share of its variance.

    python -m scripts.noise                     # muon vs adamw at ablate's default shape, 3 seeds
    python -m scripts.noise --seeds 4 --depth 6 # other base_train flags as in ablate

Runs (through ablate's cache): init and data order both 1..N; init 2..N with data order 1; data
order 2..N with init 1; seed 1 at other threads; then val slices. docs/research.md has the table.
"""

import argparse
import contextlib
import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from nanomuon.ablation.runs import Sweep, run_one, write_json
from nanomuon.ablation.stats import detectable_factor
from nanomuon.checkpoint import load_model
from nanomuon.common import evaluate_bpb, get_base_dir, shown, user_errors, write_atomic
from nanomuon.dataloader import val_rows
from nanomuon.sources import prepare
from nanomuon.tokenizer import get_tokenizer
from scripts import ablate


def design(variants: list[str], seeds: int, threads: int) -> list[ablate.Job]:
    """Every run the design needs (see the docstring)."""
    pairs = [(s, s) for s in range(1, seeds + 1)]
    pairs += [(s, 1) for s in range(2, seeds + 1)] + [(1, d) for d in range(2, seeds + 1)]
    jobs = [ablate.Job(v, "1", i, data_seed=d) for i, d in pairs for v in variants]
    return jobs + [ablate.Job(v, "1", 1, data_seed=1, threads=threads % 2 + 1) for v in variants]


def variance(xs: list[float]) -> float:
    return statistics.variance(xs) if len(xs) > 1 else math.nan


def sources(records: dict, variant: str, baseline: str, seeds: int, threads: int) -> dict:
    """Name -> variance of the final paired difference, from the runs' records (job -> record)."""
    def diff(i, d, t=None, k=1):  # of the mean of the last k evals
        v, b = (records[ablate.Job(x, "1", i, data_seed=d, threads=t)]["val_history"][-k:]
                for x in (variant, baseline))
        return statistics.fmean(bpb for _, bpb in v) - statistics.fmean(bpb for _, bpb in b)

    n = range(1, seeds + 1)
    out = {"seed (init and data order)": variance([diff(s, s) for s in n]),
           "init alone": variance([diff(s, 1) for s in n]),
           "data order alone": variance([diff(1, d) for d in n]),
           "rounding (other thread count)": (diff(1, 1) - diff(1, 1, threads % 2 + 1)) ** 2 / 2}
    return out | {f"seed, mean of the last {k} evals": variance([diff(s, s, k=k) for s in n])
                  for k in (2, 3)}


def val_slices(variant: str, baseline: str, seeds: int, flags, name: str,
               max_slices: int = 0) -> tuple[float, int, float]:
    """(variance of the paired difference over val slices, averaged over the seeds; slices; the
    difference between two scorings of one slice, 0 when the eval is deterministic)."""
    train = ablate.train_args(flags)
    tokenizer = get_tokenizer()
    with user_errors():
        data = prepare(train.dataset, train.text_column, train.val_fraction)
    rows = val_rows(tokenizer, data, train.max_seq_len, -1)
    per = max(1, train.eval_tokens // train.max_seq_len)
    slices = [rows[i:i + per] for i in range(0, len(rows) - per + 1, per)][:max_slices or None]
    token_bytes = tokenizer.token_bytes()
    per_seed, repeat = [], math.nan
    for s in range(1, seeds + 1):
        scores = {}
        for v in (variant, baseline):
            run = ablate.Job(v, "1", s, data_seed=s).name(name, "lr-multiplier")
            model, _ = load_model(get_base_dir() / "runs" / run, "latest", "cpu")  # in eval mode
            scores[v] = [evaluate_bpb(model, x, train.device_batch_size, token_bytes,
                                      train.dtype) for x in slices]
            if s == 1 and v == variant:
                repeat = evaluate_bpb(model, slices[0], train.device_batch_size, token_bytes,
                                      train.dtype) - scores[v][0]
        per_seed.append(variance([a - b for a, b in zip(scores[variant], scores[baseline])]))
        print(f"== seed {s}: {len(slices)} val slices scored", flush=True)
    return statistics.fmean(per_seed), len(slices), repeat


def table(found: dict, val: tuple, base_bpb: float, seeds: int) -> list[str]:
    """Markdown: each source's sd of the paired difference, as bpb and as a share of the bpb."""
    var_total = found["seed (init and data order)"]
    lines = ["| source | sd of the paired difference (bpb) | % of bpb | share of the seed "
             "variance |", "|---|---:|---:|---:|"]
    rows = dict(found, **{f"which val documents ({val[1]} slices)": val[0],
                          "the eval's own sampling (one slice scored twice)": val[2] ** 2})
    for name, var in rows.items():
        sd = math.sqrt(var)  # nan where a source could not be measured
        lines.append(f"| {name} | {sd:.4f} | {sd / base_bpb:.2%} | {var / var_total:.0%} |")
    d = detectable_factor(seeds) * math.sqrt(var_total)
    lines += ["", f"At {seeds} seeds a paired design detects (80% power) {d:.4f} bpb "
              f"({d / base_bpb:.2%}); each source's variance is measured from {seeds} values, so "
              "it is rough."]
    return lines


def slices_arg(s: str) -> int:
    """argparse type for --val-slices: 0 (all) or a count of 2 or more (a variance needs two)."""
    with contextlib.suppress(ValueError):
        if (n := int(s)) == 0 or 2 <= n <= 10 ** 9:
            return n
    raise argparse.ArgumentTypeError(f"{shown(s, 24)}: give 0 (the whole val split) or a count of "
                                     "val slices from 2 up")


def main(argv=None):
    p = argparse.ArgumentParser(description="Where an ablation's noise comes from (other flags go "
                                "to base_train, as in ablate)")
    p.add_argument("--variants", default="muon,adamw", help="the variant and the baseline")
    p.add_argument("--seeds", type=ablate.seeds_arg, default=3,
                   help=f"values per source (2 to {ablate.MOST_SEEDS:,})")
    p.add_argument("--name", default="noise", type=ablate.name_arg)
    p.add_argument("--val-slices", type=slices_arg, default=0,
                   help="score at most this many val slices, 2 or more (default 0: the whole val "
                   "split)")
    args, extra = p.parse_known_args(argv)
    variants = [v.strip() for v in args.variants.split(",")]
    if len(variants) != 2 or any(v not in ablate.OPTIMIZER_VARIANTS for v in variants):
        p.error(f"--variants takes two of {', '.join(ablate.OPTIMIZER_VARIANTS)}")
    if args.seeds < 2:
        p.error(f"--seeds must be >= 2, got {args.seeds}")
    # no final eval: the val slices below score the whole split
    flags = [*ablate.DEFAULT_FLAGS, "--final-eval-tokens", "0", "--eval-every", "25", *extra]
    ablate.train_args(flags)  # a bad flag stops here
    ablate.ensure_tokenizer(flags)
    cache = ablate.cache_of(flags)
    threads = max(1, (os.cpu_count() or 1) // 2)
    started = time.monotonic()
    todo = design(variants, args.seeds, threads)
    with ThreadPoolExecutor(2) as pool:
        records = dict(zip(todo, pool.map(lambda job: run_one(
            job, flags, Sweep("lr-multiplier", ["1"]), 1, threads, args.name, cache), todo)))
    found = sources(records, *variants, args.seeds, threads)
    val = val_slices(*variants, args.seeds, flags, args.name, args.val_slices)
    base_bpb = statistics.fmean(r["final_val_bpb"] for job, r in records.items()
                                if job.variant == variants[1])
    lines = table(found, val, base_bpb, args.seeds)
    out = get_base_dir() / "ablations" / args.name
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "noise.md", "\n".join(lines) + "\n")
    write_json(out / "noise.json", dict(found, val=val))
    print("\n".join(lines))
    print(f"== {len(todo)} runs and the val slices took {(time.monotonic() - started) / 60:.1f} "
          f"min; {out / 'noise.md'}")


if __name__ == "__main__":
    main()
