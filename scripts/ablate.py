"""
Compare optimizer variants on identical data, seed and token budget: a table and plots of val bpb.

    python -m scripts.ablate                                   # muon vs adamw vs muon-no-vr, CPU, minutes
    python -m scripts.ablate --variants muon,muon-jordan --num-iterations 300

Each variant (a key of OPTIMIZER_VARIANTS in nanomuon/variants.py) is one scripts.base_train run, named
<name>-<variant>; flags this script does not know go to base_train after the CPU defaults below, so they
override them (GPU runs: README, "Comparing optimizers: ablate", which also describes the outputs).
"""

import argparse
import json
import os
import subprocess
import sys

from nanomuon.common import get_base_dir
from nanomuon.report import MISSING, plot_curves
from nanomuon.tokenizer import tokenizer_dir
from nanomuon.variants import OPTIMIZER_VARIANTS

# A tiny GPT on the embedded corpus: three variants in about 10 minutes on 2 CPU cores. The val set is the
# speedrun's: the first 65,536 tokens of the val split, seven whole files (half that is two, both unusual).
CPU_DEFAULTS = ["--dataset", "embedded", "--device-type", "cpu", "--depth", "4", "--max-seq-len", "256",
                "--device-batch-size", "8", "--total-batch-size", "4096", "--num-iterations", "120",
                "--eval-every", "20", "--eval-tokens", "65536", "--warmdown-ratio", "0.3", "--embedding-lr", "0.3",
                "--unembedding-lr", "0.008", "--matrix-lr", "0.04", "--sample-tokens", "0", "--log-every", "20"]


def run_variant(variant: str, run: str, nproc: int, extra: list[str]) -> dict:
    flags = [*CPU_DEFAULTS, *extra, "--run", run, "--optimizer", variant]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "scripts.base_train", "--", *flags]
    else:
        cmd = [sys.executable, "-m", "scripts.base_train", *flags]
    print(f"== {variant}: {' '.join(cmd[1:])}", flush=True)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as p:
        tail = []
        for line in p.stdout:
            tail = (tail + [line])[-20:]
            if line.startswith(("step ", "error", "warning", "optimizer step", "final val")):
                print(f"  [{variant}] {line}", end="", flush=True)
    if p.returncode != 0:
        raise SystemExit(f"error: variant {variant} failed (exit {p.returncode}); its last lines:\n{''.join(tail)}")
    return json.loads((get_base_dir() / "runs" / run / "summary.json").read_text())


def first_reaching(target: float, record: dict):
    """(step, training seconds) of the first eval at or below target, or (None, None)."""
    return next(((step, t) for (step, bpb), t in zip(record["val_history"], record["val_train_time"])
                 if bpb <= target), (None, None))


def comparison_table(records: dict, baseline: str) -> list[str]:
    target = records[baseline]["final_val_bpb"]
    lines = [f"| variant | final val bpb | best val bpb | steps to {target:.4f} | train time to {target:.4f} | "
             "tok/s | optimizer share |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in records.items():
        step, t = first_reaching(target, r)
        reach = ("not reached", "not reached") if step is None else (f"{step}", f"{t:.1f} s")
        label = f"{name} (baseline)" if name == baseline else name
        share = f"{r['optimizer_share']:.1%}" if "optimizer_share" in r else "-"
        tok_s = f"{r['tok_per_s']:,.0f}" if "tok_per_s" in r else "-"
        lines.append(f"| {label} | {r['final_val_bpb']:.4f} | {r['min_val_bpb']:.4f} | {reach[0]} | {reach[1]} | "
                     f"{tok_s} | {share} |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description="Compare optimizer variants (other flags go to base_train)",
                                allow_abbrev=False, epilog=f"variants: {', '.join(OPTIMIZER_VARIANTS)}")
    p.add_argument("--variants", default="muon,adamw,muon-no-vr", help="comma-separated OPTIMIZER_VARIANTS keys")
    p.add_argument("--baseline", default=None, help="variant whose final val bpb the others race to "
                   "(default: adamw if compared, else the first)")
    p.add_argument("--name", default="ablation", help="names the output directory and prefixes the run names")
    p.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun when > 1)")
    args, extra = p.parse_known_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in OPTIMIZER_VARIANTS]
    if unknown or len(variants) < 2 or len(set(variants)) != len(variants):
        p.error(f"--variants needs two or more distinct names from {', '.join(OPTIMIZER_VARIANTS)}; got "
                f"{args.variants!r}" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    baseline = args.baseline or ("adamw" if "adamw" in variants else variants[0])
    if baseline not in variants:
        p.error(f"--baseline {baseline!r} is not among --variants {args.variants!r}")
    if args.nproc < 1:
        p.error(f"--nproc must be >= 1, got {args.nproc}")
    reserved = ("--run", "--optimizer", "--resume-from-step")  # abbreviations too: base_train would not take them
    if any(len(f) > 2 and any(r.startswith(f.split("=")[0]) for r in reserved) for f in extra if f.startswith("--")):
        p.error("--run, --optimizer and --resume-from-step are set per variant by ablate; use --name and --variants")
    if not os.path.isfile(tokenizer_dir() / "tokenizer.json"):
        if "fineweb-edu" in extra:
            raise SystemExit("error: no tokenizer; train one with `python -m scripts.tok_train --dataset fineweb-edu`")
        print("== no tokenizer yet: training a 4096-token BPE on the embedded corpus", flush=True)
        subprocess.run([sys.executable, "-m", "scripts.tok_train", "--dataset", "embedded", "--vocab-size", "4096",
                        "--max-chars", "8000000"], check=True)

    records = {v: run_variant(v, f"{args.name}-{v}", args.nproc, extra) for v in variants}
    out = get_base_dir() / "ablations" / args.name
    out.mkdir(parents=True, exist_ok=True)
    table = comparison_table(records, baseline)
    series_step = {v: ([s for s, _ in r["val_history"]], [b for _, b in r["val_history"]]) for v, r in records.items()}
    series_time = {v: (r["val_train_time"], [b for _, b in r["val_history"]]) for v, r in records.items()}
    first = records[variants[0]]
    png = plot_curves(out / "val_bpb.png", [
        dict(title="val bpb by step", xlabel="step", ylabel="bits per byte", series=series_step),
        dict(title="val bpb by training time", xlabel="training seconds (no evals)", ylabel="bits per byte",
             series=series_time),
    ], title=f"{args.name}: {first['num_params'] / 1e6:.1f}M params, {first['tokens_per_step']:,} tokens/step")
    cmd = " ".join(["python -m scripts.ablate", *(argv if argv is not None else sys.argv[1:])])
    report = [f"# Ablation: {args.name}", "", f"- command: `{cmd}`",
              f"- runs: {', '.join(r['run'] for r in records.values())} (each run's report.md has its details)",
              f"- baseline: {baseline}; steps and training time (evals excluded) are to the first eval at or below "
              "its final val bpb", "", *table, "",
              "![val bpb by step and by training time](val_bpb.png)" if png else f"({MISSING})", ""]
    (out / "ablation.md").write_text("\n".join(report))
    print("\n".join(table))
    best = min(records, key=lambda v: records[v]["final_val_bpb"])
    print(f"best final val bpb: {best} ({records[best]['final_val_bpb']:.4f}); table and plot in {out}")
    return records


if __name__ == "__main__":
    main()
