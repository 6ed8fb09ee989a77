"""
Compare optimizer variants on identical data and token budget, over seeds and the values of one
swept base_train flag (an lr, usually): a table of means and 95% intervals, a verdict per variant
against the baseline, and plots of val bpb.

    python -m scripts.ablate   # muon vs adamw: planned to 15 min on 2 CPU cores (30 without bf16)
    python -m scripts.ablate --variants muon,muon-plus --budget 20m
    python -m scripts.ablate --variants muon,adamw --sweep lr-multiplier=0.5,1,2 --num-iterations 300
    python -m scripts.ablate --variants muon --sweep matrix-lr=0.005,0.01,0.02 --seeds 3

Each (variant, swept value, seed) is a scripts.base_train run with --seed (the init) and
--data-seed 1 (one document order for every run, as track 3 reads its data) or the seed; a
variant's seeds on one order train as one batched model. Flags this script does not know go to
base_train after the defaults below (GPU runs: docs/research.md). Finished runs are cached under
everything that decides them. The baseline also runs at --baseline-lengths of the steps, which
turn each verdict into steps saved. The runs are nanomuon/ablation/runs.py's, the --budget plan
nanomuon/ablation/pacing.py's, the write-up nanomuon/ablation/verdicts.py's.
"""

import argparse
import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from itertools import accumulate
from typing import NamedTuple

from nanomuon import recipe
from nanomuon.ablation import budget
from nanomuon.ablation.pacing import (
    Refiner,
    Timer,
    cache_keys,
    in_words,
    kept_estimate,
    prior_estimate,
)
from nanomuon.ablation.runs import (
    RUNNING,
    UNSWEPT,
    Job,
    Sweep,
    batch_key,
    batches,
    cache_of,
    cached,
    run_all,
    split_runs,
)
from nanomuon.ablation.stats import MOST_SEEDS
from nanomuon.ablation.verdicts import PUBLISHED, report, write_ablation
from nanomuon.common import get_base_dir, shown
from nanomuon.recipe import short_run_matrix_lr
from nanomuon.run import lock_run_dir, run_arg, unlock_run_dir
from nanomuon.tokenizer import Tokenizer, tokenizer_dir
from nanomuon.variants import OPTIMIZER_VARIANTS
from scripts.train_args import LR_FLAGS, load_ideas
from scripts.train_args import parse_args as train_args

# A tiny GPT (depth 4, 5M params) on the embedded corpus in speedrun.sh's CPU shape (200 steps of
# 4,096 tokens, where the lr rule's lrs were tuned: docs/lr_rule.md), compiled (1.4x the eager
# steps here), 5 seeds; on a CPU, the seeds and steps fit() plans to CPU_BUDGETS. The curves' val
# set is the speedrun's, the first 65,536 tokens; the verdicts read the final weights over 4x as
# many (at 200 steps and 5 seeds that halved the paired spread, as much as the whole split).
DEFAULT_STEPS, DEFAULT_SEEDS = recipe.RULE_STEPS, 5
# On a GPU one seed's 4,096 tokens a step leave the device idle; 64 batched seeds fill it
# (scripts/gpu_check.sh's ablate step measures what they resolve and how long they take)
GPU_SEEDS = 64
# The default budget's runs are short: 50 to about 80 steps on the 2-core CPUs measured. There a val
# set past 65,536 tokens did not narrow a seed's spread (79 steps, 10 seeds; 54 steps, 6), and the
# 4 curve evals and the final one cost 43 steps of a seed at 50 (an eval token costs a third of a
# training one). So the verdicts read 65,536 tokens and the curves 16,384: 11 steps, the rest seeds
SHORT_RUN_EVALS = {"--eval-tokens": "16384", "--final-eval-tokens": "65536"}
DEFAULT_SWEEP, DEFAULT_LENGTHS = "lr-multiplier=1", "0.8"
# --published: each technique at its best of these, muon once at its own lrs (research.md's table)
PUBLISHED_SWEEP = Sweep("lr-multiplier", ["0.5", "1", "2"], fixed=("muon",))
# --arch classic: the model ablate's defaults and the lr rule were measured on, on a GPU too
# (base_train's auto would train arch 'nanochat' there); give --arch nanochat to ablate that one
DEFAULT_FLAGS = ["--arch", "classic", "--dataset", "embedded", "--depth", "4",
                 "--max-seq-len", "256", "--device-batch-size", "8", "--total-batch-size", "4096",
                 "--num-iterations", str(DEFAULT_STEPS), "--eval-every", "50",
                 "--eval-tokens", "65536", "--final-eval-tokens", "262144", "--warmdown-ratio",
                 "0.3", "--sample-tokens", "0", "--compile"]


class Preset(NamedTuple):
    """A named shape: base_train flags and the vocab of its tokenizer, in presets/<name>."""
    flags: list
    vocab: int
    about: str


# the final weights read over the whole val split: at depth 1 the seeds' train losses differ by
# 0.01 bpb, and over 65,536 val tokens they spread three times that (docs/research.md)
REGIME_FLAGS = ["--max-seq-len", "256", "--device-batch-size", "16", "--total-batch-size", "8192",
                "--head-dim", "64", "--eval-every", "160", "--final-eval-tokens", "-1"]
PRESETS = {
    # The regime the published optimizer results come from (track 3 trains ~20 tokens per param,
    # most in matrices), in one layer: at depth 2 a seed's loss falls 0.3-0.4 nats at a step its
    # init decides (400 to past 1,000), so Muon's seeds ended bimodal (docs/research.md). Width
    # 192 (3 heads of 64), a 320-token vocab: 565,248 params, 78% in Muon's block matrices, 700
    # steps of 8,192 tokens = 10.1 tokens per param
    "regime": Preset([*REGIME_FLAGS, "--depth", "1", "--aspect-ratio", "192",
                      "--num-iterations", "700"], 320,
                     "depth 1, width 192 (3 heads), vocab 320: 565,248 params, 78% in Muon "
                     "matrices, 10.1 tokens per param"),
    # the earlier preset, for its measurements: Muon's seeds end bimodal there (docs/research.md)
    "regime-d2": Preset([*REGIME_FLAGS, "--depth", "2", "--aspect-ratio", "64",
                         "--num-iterations", "640"], 512,
                        "depth 2, width 128 (2 heads), vocab 512: 524,288 params, 75% in Muon "
                        "matrices, 10.0 tokens per param"),
}


def name_arg(s: str) -> str:
    """argparse type for --name: it prefixes run names and names a folder in ablations/."""
    if run_arg(s) == "cache":
        raise argparse.ArgumentTypeError("'cache' holds the finished runs: pick another --name")
    return s


def seeds_arg(s: str) -> int:
    """argparse type for a count of seeds, 1 to MOST_SEEDS: refused before the runs are listed, a
    Job a seed (10**8 seeds would fill gigabytes first)."""
    with contextlib.suppress(ValueError):  # int() refuses over 4,300 digits too
        if 1 <= (n := int(s)) <= MOST_SEEDS:
            return n
    raise argparse.ArgumentTypeError(f"{s[:24]!r}: give a count of seeds from 1 to {MOST_SEEDS:,} "
                                     "(past that, more seeds is no answer: the spread must shrink)")


MOST_VALUES = 64  # swept values: each is a run per variant and seed, checked by base_train's parser


def sweep_arg(s: str) -> Sweep:
    """argparse type for --sweep [VARIANT:]FLAG=V1,V2,...: the values distinct, in numeric order;
    with VARIANT, its alone, and FLAG may name one of its settings (parse_args decides)."""
    flag, _, given = s.partition("=")
    variant, _, flag = flag.rpartition(":")
    flag, variant = flag.strip().removeprefix("--"), variant.strip() or None
    name = r"[A-Za-z_][\w.-]*" if variant else r"[a-z][a-z0-9-]*"
    values = [v.strip() for v in given.split(",")] if given.strip() else []
    if empty := [i for i, v in enumerate(values, 1) if not v]:
        raise argparse.ArgumentTypeError(f"{s!r}: value {empty[0]} is empty; give each value "
                                         "between commas, like lr-multiplier=0.5,1,2")
    if not re.fullmatch(name, flag) or not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{s!r}: give a base_train flag and distinct values, "
                                         "like lr-multiplier=0.5,1,2 or matrix-lr=0.01,0.02, or a "
                                         "variant's own: muon-soap:precondition_frequency=5,10")
    if len(values) > MOST_VALUES:  # each value is a run per variant and seed: refused unlisted
        raise argparse.ArgumentTypeError(f"{shown(s, 80)}: {len(values):,} values; give at most "
                                         f"{MOST_VALUES} (an ablation per range, or a coarser grid)")
    if UNSWEPT in values:
        raise argparse.ArgumentTypeError(f"{s!r}: {UNSWEPT!r} stands for a variant's own "
                                         "settings here; give values")
    with contextlib.suppress(ValueError):  # not all numbers (a choice flag): the order given
        values = sorted(values, key=float)
        same = [f"{a} and {b}" for a, b in zip(values, values[1:]) if float(a) == float(b)]
        if same:
            raise argparse.ArgumentTypeError(f"{s!r}: {same[0]} are the same value (two identical "
                                             "runs); give each value once")
    return Sweep(flag, values, variant)


def lengths_arg(s: str) -> list[float]:
    """argparse type for --baseline-lengths: distinct fractions of the steps, each > 0 and not 1."""
    if s.strip() == "none":
        return []
    with contextlib.suppress(ValueError):
        values = [float(v) for v in s.split(",")]
        if len(set(values)) == len(values) and all(0 < v < 10 and v != 1 for v in values):
            return values
    raise argparse.ArgumentTypeError(f"{s!r}: give distinct fractions of the steps other than 1, "
                                     "like 0.8 or 0.7,1.4, or 'none'")


RESERVED = ("run", "optimizer", "resume-from-step", "seed", "data-seed")  # set per run
DATA_FLAGS = ("dataset", "text-column", "val-fraction")  # base_train's flags that pick the data
EVAL_FLAGS = ("eval-tokens", "final-eval-tokens")  # and those that pick the val set a run is read on


def parse_args(argv):
    """(args, flags for base_train), checked: a bad base_train flag stops ablate now."""
    load_ideas(argv)  # first: the variants an ideas file adds are --variants' to take
    p = argparse.ArgumentParser(description="Compare optimizer variants (other flags go to "
                                "base_train)", allow_abbrev=False,
                                epilog=f"variants: {', '.join(OPTIMIZER_VARIANTS)}")
    p.add_argument("--variants", default="muon,adamw",
                   help="comma-separated OPTIMIZER_VARIANTS keys (one is enough for a --sweep)")
    p.add_argument("--baseline", default=None, help="variant the others are judged against "
                   "(default: adamw if compared, else the first)")
    p.add_argument("--seeds", type=seeds_arg, default=None,
                   help=f"runs per variant and value, seeds 1..N of the init (default "
                   f"{DEFAULT_SEEDS}, or --budget's choice; {GPU_SEEDS} on a GPU, batched; at "
                   f"most {MOST_SEEDS:,}: past that, more seeds is no answer, the spread must "
                   "shrink)")
    p.add_argument("--data-order", choices=("fixed", "seed"), default="fixed",
                   help="fixed: every run reads the documents in one order (data seed 1), as "
                   "track 3 does: the seeds vary the init alone (~20x less variance: "
                   "docs/research.md); seed: each seed sets the data order too (default: fixed)")
    p.add_argument("--budget", type=budget.budget_arg, default=None,
                   help="wall time for the whole ablation (600, 90s, 10m, 1.5h): --num-iterations "
                   "(and --seeds, unless given) are planned to fit it from the runs' times kept "
                   "here, else from the smallest plan's own steps, and refined as the runs go")
    p.add_argument("--sweep", type=sweep_arg, default=sweep_arg(DEFAULT_SWEEP),
                   help="a base_train flag and the values to try, e.g. lr-multiplier=0.5,1,2; each "
                   "variant is compared at its best value. VARIANT:FLAG=... sweeps that variant "
                   "alone (the others run once, at their own settings), FLAG a base_train flag or "
                   "one of the variant's settings (base_train --variant-option): "
                   "scion:lr-multiplier=1,4,16, muon-soap:precondition_frequency=5,10,20, "
                   "muon-newton:roles.mlp.fc.lr_factor=1,2 (default: lr-multiplier=1)")
    p.add_argument("--ideas", action="append", default=[], metavar="FILE",
                   help="a Python file of yours that registers stages and variants, run as your "
                   "code (nanomuon/ideas.py); only the runs of the variants it defines load it, "
                   "and only their cache keys hold it")
    p.add_argument("--baseline-lengths", type=lengths_arg, default=lengths_arg(DEFAULT_LENGTHS),
                   help="the baseline also runs these fractions of the steps, to turn each "
                   f"verdict into steps saved (default {DEFAULT_LENGTHS}; 'none' skips them)")
    p.add_argument("--published", action="store_true",
                   help="muon against adamw and every technique ported from track 3 (verdicts."
                   "PUBLISHED), each at its best of lr-multiplier 0.5, 1 and 2, muon once; its "
                   "own --variants, --baseline and --sweep")
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="a named shape with a tokenizer of its own, in a base dir of its own "
                   "(<base>/presets/NAME): " + "; ".join(f"{k}: {v.about}" for k, v in PRESETS.items())
                   .replace("%", "%%"))  # argparse formats help with %
    p.add_argument("--jobs", type=int, default=0,
                   help="runs at a time (0: one per CPU core for CPU runs of one process, else 1)")
    p.add_argument("--batch-seeds", action=argparse.BooleanOptionalAction, default=True,
                   help="train each variant's seeds as one batched model (base_train --seeds)")
    p.add_argument("--name", type=name_arg, default="ablation",
                   help="names the output directory and prefixes the run names")
    p.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun when > 1)")
    args, extra = p.parse_known_args(argv)
    args.budget_default = False  # default_budget's: a budget that plans but never refuses
    if args.published:
        published_plan(p, args, sys.argv[1:] if argv is None else argv)
    spec, args.variants = args.variants, [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in OPTIMIZER_VARIANTS]
    fewest = 1 if len(args.sweep.values) > 1 else 2
    if unknown or len(args.variants) < fewest or len(set(args.variants)) != len(args.variants):
        p.error(f"--variants needs {'one' if fewest == 1 else 'two'} or more distinct names from "
                f"{', '.join(OPTIMIZER_VARIANTS)}; got {spec!r}"
                + (f" (unknown: {shown(', '.join(unknown), 300, quote=False)})" if unknown
                   else ""))
    args.baseline = args.baseline or ("adamw" if "adamw" in args.variants else args.variants[0])
    if args.baseline not in args.variants:
        p.error(f"--baseline {args.baseline!r} is not among --variants {spec!r}")
    if args.nproc < 1 or args.jobs < 0:
        p.error(f"--nproc must be >= 1 and --jobs >= 0; got {args.nproc} and {args.jobs}")
    given = {f.split("=")[0] for f in extra if f.startswith("--") and len(f) > 2}
    if any(f"--{r}".startswith(f) for f in given for r in RESERVED):
        p.error(f"{', '.join('--' + r for r in RESERVED)} are set per run by ablate; use --name, "
                "--variants, --seeds and --sweep")
    flags = [*DEFAULT_FLAGS, *(PRESETS[args.preset].flags if args.preset else []), *extra]
    check_sweep(p, args, flags, given, spec)
    return args, flags


def published_plan(p: argparse.ArgumentParser, args, argv: list[str]) -> None:
    """--published: args' variants, baseline and sweep become muon and every published one's."""
    if clash := sorted({a.split("=")[0] for a in argv} & {"--variants", "--baseline", "--sweep"}):
        p.error(f"--published chooses {', '.join(clash)} itself (muon against every technique of "
                "verdicts.PUBLISHED, each at lr-multiplier 0.5, 1, 2); give one or the other")
    args.variants, args.baseline = ",".join(["muon", *PUBLISHED]), "muon"
    args.sweep = PUBLISHED_SWEEP


def check_sweep(p: argparse.ArgumentParser, args, flags: list[str], given: set, spec: str) -> None:
    """--sweep's variant, its flag (or, for one variant alone, its setting) and every value, each
    refused in one line before any run starts."""
    sweep = args.sweep
    if sweep.variant not in (None, *args.variants):
        p.error(f"--sweep {shown(sweep.variant, 80, quote=False)}:{sweep.flag}=...: "
                f"{shown(sweep.variant, 80)} is not among "
                f"--variants {spec!r}")
    if sweep.variant and (not re.fullmatch(r"[a-z][a-z0-9-]*", sweep.flag) or "has no --" in (
            sweep_value_problem(flags, sweep, sweep.values[0]) or "")):
        args.sweep = sweep = sweep._replace(option=True)  # not a base_train flag: a setting
    elif sweep.flag in DATA_FLAGS + EVAL_FLAGS:
        p.error(f"--sweep {sweep.flag}: each value would be judged on its own val set, so "
                "their val bpb cannot name a winner; run one ablation per "
                + ("dataset (--dataset X)" if sweep.flag in DATA_FLAGS else f"--{sweep.flag}"))
    elif overrides := overridden(args.variants if sweep.variant is None else [sweep.variant],
                                 sweep.flag):
        variant, key = overrides[0]
        p.error(f"--sweep {sweep.flag}: --optimizer {variant} sets {key} itself, so base_train "
                f"does not use --{sweep.flag} in its runs and every value would train alike; "
                + (f"sweep its own setting ({variant}:{key}=...)" if key != "schedule" else
                   "sweep a variant without a schedule of its own") + " or another's alone")
    if not sweep.option and (sweep.flag in RESERVED or f"--{sweep.flag}" in given):
        p.error(f"--sweep {sweep.flag} sets --{sweep.flag} per run: "
                + ("ablate sets it" if sweep.flag in RESERVED else "do not give it as well"))
    for value in sweep.values:
        if problem := sweep_value_problem(flags, sweep, value):
            p.error(problem)


def overridden(variants: list[str], flag: str) -> list[tuple[str, str]]:
    """(variant, setting) for each variant whose own setting base_train uses in --flag's place
    (base_train.optimizer_options: an lr, the weight decay, the schedule)."""
    key = flag.replace("-", "_")  # own_flags may hold scalar_lr, which no flag sets
    return [(v, key) for v in variants if key in (*LR_FLAGS, "weight_decay", "schedule")
            and key in OPTIMIZER_VARIANTS[v].own_flags()]


def sweep_value_problem(flags: list[str], sweep: Sweep, value: str) -> str | None:
    """What base_train would refuse in this --sweep value, said before any run starts."""
    said, flag = io.StringIO(), sweep.flag
    try:
        with contextlib.redirect_stderr(said):
            train_args([*flags, *(["--optimizer", sweep.variant] if sweep.variant else []),
                        *sweep.run_flags(value)])
        return None
    except SystemExit:
        why = said.getvalue().strip().splitlines()[-1].split("error: ", 1)[-1]
    if not why.startswith("unrecognized arguments"):
        return shown(f"--sweep {sweep.variant + ':' if sweep.variant else ''}{flag}={value}: "
                     f"{why}", 1000, quote=False)
    try:  # a switch (--fp8, --compile) parses given alone
        with contextlib.redirect_stderr(io.StringIO()):
            train_args([*flags, f"--{flag}"])
    except SystemExit:
        return (f"--sweep {flag}=...: base_train has no --{flag} (its flags: python -m "
                "scripts.base_train --help)")
    return (f"--sweep {flag}=...: --{flag} is a switch, it takes no value; run one ablation "
            f"with --{flag} and one without it")


def ensure_tokenizer(flags: list[str], vocab: int = 4096, exact: bool = False) -> None:
    """The base dir's tokenizer, or a BPE of `vocab` tokens trained now on the embedded corpus;
    exact (a preset's base dir, its shape fixed): one of another vocab is refused."""
    if os.path.isfile(tokenizer_dir() / "tokenizer.json"):
        held = Tokenizer.load(tokenizer_dir()).vocab_size if exact else vocab
        if held != vocab:  # a preset whose shape changed: its runs would read the wrong vocab
            raise SystemExit(f"error: {tokenizer_dir()} holds a {held}-token tokenizer, and "
                             f"this shape trains a {vocab}-token one: move that folder away "
                             "(its runs stay in their cache) or give another NANOMUON_BASE_DIR")
        return
    if "fineweb-edu" in flags[len(DEFAULT_FLAGS):]:
        raise SystemExit("error: no tokenizer; train one with `python -m scripts.tok_train "
                         "--dataset fineweb-edu`")
    print(f"== no tokenizer yet: training a {vocab}-token BPE on the embedded corpus", flush=True)
    subprocess.run([sys.executable, "-m", "scripts.tok_train", "--dataset", "embedded",
                    "--vocab-size", str(vocab), "--max-chars", "8000000"], check=True)


def default_budget(args, flags: list[str], cache: dict) -> list[str]:
    """flags: on a CPU, an ablation given neither --budget nor --num-iterations is planned to
    budget.CPU_BUDGETS by whether the CPU has bf16 units (fp32 steps are several times slower),
    with SHORT_RUN_EVALS unless the eval flags are given."""
    if (args.budget is not None or cache["device_type"] != "cpu"
            or "--num-iterations" in given_flags(flags)):
        return flags
    kind = "bf16" if cache["dtype"] == "bf16" else "fp32"
    args.budget, args.budget_default = budget.CPU_BUDGETS[kind], True
    evals = {k: v for k, v in SHORT_RUN_EVALS.items() if k not in given_flags(flags)}
    print(f"== this CPU trains in {kind} ({'with' if kind == 'bf16' else 'without'} bf16 units): "
          f"the ablation is planned to --budget {args.budget / 60:.0f}m (give --budget or "
          "--num-iterations to choose)" + "".join(f", {k} {v}" for k, v in evals.items())
          + (" (short runs: more seeds, not more val tokens)" if evals else ""), flush=True)
    default = [evals.get(key, value) for key, value in zip([None, *flags], flags)]
    return default[:len(DEFAULT_FLAGS)] + flags[len(DEFAULT_FLAGS):]


def given_flags(flags: list[str]) -> set[str]:
    """The base_train flags given beyond DEFAULT_FLAGS (a preset's or the user's), by name."""
    return {f.split("=")[0] for f in flags[len(DEFAULT_FLAGS):]}


def short_run_lrs(args, flags: list[str], train) -> list[str]:
    """flags, with recipe.short_run_matrix_lr for runs shorter than the lr rule was tuned at,
    unless --matrix-lr is given or swept, a preset (tuned at its steps) or GPU-sized steps."""
    steps, batch = train.num_iterations, train.total_batch_size
    if (steps >= recipe.RULE_STEPS or args.preset or "--matrix-lr" in given_flags(flags)
            or (args.sweep.flag, args.sweep.variant) == ("matrix-lr", None)
            or not 0 < batch < recipe.NANOCHAT_BATCH):
        return flags
    lr = short_run_matrix_lr(steps, batch)
    print(f"== Muon's matrix lr {lr:.4g} for {steps}-step runs: the lr rule's "
          f"{recipe.rule_lrs(batch)['matrix_lr']:g}, tuned at {recipe.RULE_STEPS} steps, x "
          f"({recipe.RULE_STEPS} / {max(steps, recipe.SHORT_RUN_FLOOR)})^"
          f"{recipe.SHORT_RUN_EXPONENT}, since in shorter runs its best lr was higher and AdamW's "
          "was not (docs/research.md); --matrix-lr chooses another",
          flush=True)
    return [*flags, "--matrix-lr", f"{lr:.4g}"]


def main(argv=None):
    """ablate under its name's lock; Ctrl-C or SIGTERM ends its runs and says what is cached."""
    started, ended = time.monotonic(), []

    def stop(signum, frame):
        ended.extend(RUNNING.values())
        for p in list(RUNNING):
            p.terminate()
        raise KeyboardInterrupt(128 + signum)

    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        args, flags = parse_args(argv)
        args.started = started
        if args.preset:  # every run, the tokenizer and the results live in the preset's base dir
            base = get_base_dir() / "presets" / args.preset
            os.environ["NANOMUON_BASE_DIR"] = str(base)
            print(f"== preset {args.preset} ({PRESETS[args.preset].about}), in {base}", flush=True)
        out = get_base_dir() / "ablations" / args.name
        try:  # two ablations of one name would train the same runs, each stopping the other's
            note = lock_run_dir(out, "another --name")
        except RuntimeError as e:
            raise SystemExit(f"error: {e}") from None
        if note:
            print(f"== {note}", flush=True)
        try:
            return ablation(args, flags, argv)
        finally:
            unlock_run_dir(out)
    except KeyboardInterrupt as e:
        print(f"== ablate stopped; the runs it was training, ended: {', '.join(ended) or 'none'}. "
              f"Finished runs are cached in {get_base_dir() / 'ablations' / 'cache'}: the same "
              "command goes on from them", flush=True)
        raise SystemExit(e.args[0] if e.args else 130) from None
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def ablation(args, flags: list[str], argv):
    """The ablation's runs planned (--budget), run (cached) and written up."""
    if args.preset:
        ensure_tokenizer(flags, PRESETS[args.preset].vocab, exact=True)
    else:
        ensure_tokenizer(flags)
    cores = os.cpu_count() or 1
    cache = cache_of(flags)
    jobs = args.jobs or (max(1, cores // args.nproc) if cache["device_type"] == "cpu" else 1)
    runs_per_seed = sum(len(args.sweep.of(v)) for v in args.variants)  # variant-value pairs
    # a batched run trains all of a variant's seeds: a process per variant-value pair and length
    args.batch_seeds = args.batch_seeds and args.data_order == "fixed"
    jobs = min(jobs, runs_per_seed + len(args.baseline_lengths) if args.batch_seeds
               else runs_per_seed * (args.seeds or DEFAULT_SEEDS))
    threads = max(1, cores // (jobs * args.nproc))
    n_seeds, refiner = args.seeds or DEFAULT_SEEDS, None
    if not args.seeds and cache["device_type"] == "cuda" and args.batch_seeds and not args.budget:
        n_seeds = GPU_SEEDS
        print(f"== on a GPU: {GPU_SEEDS} seeds, each variant's batched in one process (--seeds "
              "chooses)", flush=True)
    flags = default_budget(args, flags, cache)
    if args.budget is not None:
        flags, refiner = plan_for_budget(args, flags, runs_per_seed, jobs, threads, cache)
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

    def main_jobs(seeds: list[int], group: int = 0) -> list[Job]:  # a batch of each variant's
        return [Job(v, x, s, data_seed=data, group=group) for v in args.variants
                for x in args.sweep.of(v) for s in seeds]

    groups = (refiner.plan.groups if refiner else ()) or (n_seeds,)  # the seeds of each batch
    todo = [job for group, (n, end) in enumerate(zip(groups, accumulate(groups)))
            for job in main_jobs(list(range(end - n + 1, end + 1)), group)]
    if refiner:
        refiner.make_jobs = main_jobs
    # the baseline's other lengths: with it now when it runs at one value, else at its best, after
    shorter = [Job(args.baseline, args.sweep.of(args.baseline)[0], s, n, data) for n in others
               for s in seeds[:budget.LENGTH_SEEDS]]
    processes = len(batches(todo + shorter, args.batch_seeds))
    if args.published:
        say_plan(args, todo + shorter, flags, jobs, threads, cache)
    print(f"== {len(todo)} runs ({runs_per_seed} variant-value pairs x {len(seeds)} seeds) and "
          f"{len(shorter)} of the baseline at other lengths"
          + (f", each variant's seeds batched: {processes} processes" if args.batch_seeds else "")
          + f", {jobs} at a time, {threads} thread(s) each", flush=True)
    started = time.monotonic()
    one_value = len(args.sweep.of(args.baseline)) == 1  # the baseline's lengths run at it now
    pace = refiner or Timer(args, train, cache_keys(args, flags, jobs, threads, cache),
                            cpu_used(args, jobs, threads, cache))  # timed for the next plan
    results = run_all(todo + shorter if one_value else todo, flags, args, jobs, threads, cache,
                      pace)
    seeds = list(range(1, (refiner.plan.seeds if refiner else n_seeds) + 1))  # with any added
    if not one_value and shorter:
        best = report(split_runs(results)[0], args.variants, args.sweep, seeds,
                      args.baseline)[1][args.baseline]
        results |= run_all([job._replace(value=best) for job in shorter], flags, args, jobs,
                           threads, cache, pace)
    main_runs, lengths = split_runs(results)
    write_ablation(args, argv, flags, main_runs, lengths, seeds)
    print(f"== {len(results)} runs took {(time.monotonic() - started) / 60:.1f} min", flush=True)
    return main_runs


def say_plan(args, todo: list[Job], flags: list[str], jobs: int, threads: int,
             cache: dict) -> None:
    """Each run of the plan, cached or to train, and the time those to train take, `jobs` at a
    time: from the runs' times kept here, else a prior timed now (pacing), else unknown."""
    runs = [(len(b), b[0].steps or train_args(flags).num_iterations,
             *batch_key(b, flags, args.sweep, args.nproc, threads, cache)[:2])
            for b in batches(todo, args.batch_seeds)]
    hits = [cached(cache["dir"], key) is not None for *_, key, _ in runs]
    for (*_, label), hit in zip(runs, hits):
        print(f"==   {label}: {'cached' if hit else 'to train'}", flush=True)
    left = [(seeds, steps) for (seeds, steps, *_), hit in zip(runs, hits) if not hit]
    cal, _, how = kept_estimate(cache_keys(args, flags, jobs, threads, cache),
                                cpu_used(args, jobs, threads, cache))
    if cal is None and left:
        cal, how = prior_estimate(args, train_args(flags), jobs, threads, cache)
    lanes = [0.0] * jobs
    for seeds, steps in sorted(left, reverse=True):  # the largest first, to the freest lane
        if cal:
            seed_s = budget.EVALS * cal.eval_s + cal.final_s + steps * cal.step_s
            lanes[lanes.index(min(lanes))] += cal.fixed_s + seeds * seed_s
    took = f"about {max(lanes) / 60:.0f} min" if cal else "a time not known here yet"
    print(f"== plan: {len(left)} of {len(runs)} runs to train, {sum(s for s, _ in left)} seeds in "
          f"all, {jobs} at a time: {took if left else 'none'} ({how})", flush=True)


def cpu_used(args, jobs: int, threads: int, cache: dict) -> int:
    """The cores the runs keep busy, by which a kept pace scales to the load now (0 on a GPU,
    whose steps do not wait on the CPU's other processes)."""
    return jobs * threads * args.nproc if cache["device"].startswith("cpu") else 0


def plan_for_budget(args, flags: list[str], runs_per_seed: int, jobs: int, threads: int,
                      cache: dict) -> tuple[list[str], "Refiner"]:
    """--budget: (flags with the plan's steps and evals, the Refiner that follows the runs); the
    plan kept before, fitted to a calibration kept here, or the smallest, timed by its runs."""
    train, layout = train_args(flags), (runs_per_seed, jobs, len(args.baseline_lengths),
                                        args.batch_seeds)
    keys = cache_keys(args, flags, jobs, threads, cache)
    estimate, about, how = kept_estimate(keys, cpu_used(args, jobs, threads, cache))
    guess, plan = None, budget.read_plan(keys.plan)
    fresh = estimate is None and plan is None
    if fresh:
        guess, how = prior_estimate(args, train, jobs, threads, cache)
    seconds = time.monotonic() - args.started + budget.WRITE_UP_S
    estimate = estimate and estimate._replace(seconds=seconds)
    guess = guess and guess._replace(seconds=seconds)
    if plan is not None:
        how = f"planned before ({keys.plan.name}); {how}"
    elif fresh:
        plan = budget.smallest(args.seeds)
    else:
        plan = budget.fit(args.budget, estimate, runs_per_seed, jobs, args.seeds, *layout[2:],
                            at_least=args.budget_default)
        if plan is None:  # only a --budget given: the default plans its smallest instead
            raise SystemExit(f"error: --budget {args.budget:.0f}s fits fewer than "
                             f"{budget.MIN_STEPS} steps per run ({how}: {in_words(estimate)}; "
                             f"{jobs} at a time); raise --budget, or cut --variants, --sweep, "
                             "--seeds or --depth")
    shape = not args.preset and not given_flags(flags) and args.data_order == "fixed"
    refiner = Refiner(args, train, plan, layout, keys, about, estimate, seconds, shape, guess)
    if fresh:
        refiner.refuse_kept()
    refiner.say(how + (f": {in_words(estimate)}; the runs' own steps correct it" if estimate
                       else ""))
    return [*flags, "--num-iterations", str(plan.steps), "--eval-every",
            str(plan.eval_every)], refiner


if __name__ == "__main__":
    main()
