"""
What a run says of itself, kept here so base_train reads as its loop: report.md, curves.png and
summary.json, written whole when training ends and keeping what other tools added (read back
through run.py, which owns the run dir); what a user typed or named is escaped (common.shown).
Line plots (plot_curves), for the report and ablate's comparisons: matplotlib is optional, imported
here only; without it plot_curves() returns None and the report says so (MISSING).
"""

import json
import math
import platform
import statistics
import sys
from pathlib import Path

import torch

from nanomuon.common import numbers_text, per_seed, print0, shown, write_atomic
from nanomuon.fp8 import RECIPES, plain_linears
from nanomuon.run import others_report, others_summary
from nanomuon.seeds import seed_model, seed_records

MISSING = ("plots skipped: matplotlib is not installed, and plots are optional "
           "(`pip install matplotlib` draws them)")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "import os\n", "In the beginning"]


def smooth(values: list[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average, as the step lines print it."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** i))
    return out


def plot_curves(path: Path, panels: list[dict], title: str = "") -> Path | None:
    """Draw panels side by side into path (PNG, written atomically); None without matplotlib. Each
    panel is a dict with title, xlabel, ylabel and series: {label: (xs, ys)} or (xs, ys, lows,
    highs) to shade a band (of one point: an error bar); optional logx, logy, colors ({label:
    color}, across panels), dashed (labels drawn dashed, unmarked), xticks (positions, labels)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed, none opened
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cols = min(len(panels), 3)  # rows of three: a wide row of five shrinks every panel
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        for label, (xs, ys, *band) in panel["series"].items():
            points = [pt for pt in zip(xs, ys, *band) if all(math.isfinite(v) for v in pt[1:])]
            if not points:
                continue
            xs, ys, *band = zip(*points)
            dashed = label in panel.get("dashed", ())
            line, = ax.plot(xs, ys, label=label, linewidth=1.5, linestyle="--" if dashed else "-",
                            marker="o" if len(xs) <= 30 and not dashed else None, markersize=3,
                            color=panel.get("colors", {}).get(label))
            if band and len(xs) == 1:  # one point: its interval as an error bar
                line.set_marker("s")
                ax.errorbar(xs, ys, yerr=[[ys[0] - band[0][0]], [band[1][0] - ys[0]]],
                            color=line.get_color(), capsize=4, linewidth=1.5)
            elif band:
                ax.fill_between(xs, *band, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set(title=panel["title"], xlabel=panel["xlabel"], ylabel=panel["ylabel"],
               xscale="log" if panel.get("logx") else "linear",
               yscale="log" if panel.get("logy") else "linear")
        if "xticks" in panel:
            ax.set_xticks(*panel["xticks"], rotation=20, ha="right")  # long names must not overlap
        ax.grid(alpha=0.3)
        if len(panel["series"]) > 6:  # a table's many runs: beside the axes, not over the curves
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="x-small")
        elif len(panel["series"]) > 1:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return path


def start_wandb(mode: str, name: str, run_dir: Path, **init):
    """wandb.init of a nanomuon run (init: its config, or the id of one to resume); wandb, slow to
    import, is imported only on request."""
    try:
        import wandb
    except ImportError:
        raise SystemExit(f"error: --wandb {mode} needs the wandb package: `pip install "
                         "wandb`, or drop --wandb") from None
    return wandb.init(project="nanomuon", name=name, mode=mode, dir=str(run_dir), **init)


def precision_of(args) -> list:
    """[dtype, fp8 recipe or None] of a run's flags, or of a checkpoint's saved ones (a dict)."""
    get = (args if isinstance(args, dict) else vars(args)).get
    return [get("dtype", None), get("fp8_recipe", "tensorwise") if get("fp8", False) else None]


def precision_problems(loop: dict, step: int) -> list[str]:
    """A hand edit of a checkpoint's loop.precision ([from step, dtype, fp8 recipe or None], oldest
    first; older checkpoints have none), which the report would quote."""
    if "precision" not in loop:
        return []
    history = loop["precision"]
    ok = isinstance(history, list) and history and all(
        isinstance(h, list) and len(h) == 3 and type(h[0]) is int and 0 <= h[0] <= step
        and h[1] in ("bf16", "fp32") and h[2] in (None, *RECIPES) for h in history)
    return [] if ok else [f"loop.precision is {shown(repr(history), 120, quote=False)} in its "
                          "meta.json"]


def resumed_precision(loop: dict, saved_args: dict, args, step: int) -> list:
    """loop.precision of a run resumed at `step`: the checkpoint's (or its flags'), then this
    resume's if it is another, said in a line: allowed, but the curves change there."""
    history = loop.get("precision") or [[0, *precision_of(saved_args)]]
    now = precision_of(args)
    if history[-1][1:] != now:
        print0(f"note: resume: the run trained in {precision_words(*history[-1][1:])} to step "
               f"{step} and goes on in {precision_words(*now)} (--dtype, --fp8 and --fp8-recipe "
               "as given now); the report says both")
        history = [*history, [step, *now]]
    return history


def precision_words(dtype, recipe) -> str:
    """A precision_of in words, as the step lines and the report say it."""
    words = {"bf16": "bf16 autocast", "fp32": "fp32"}.get(dtype, "an unrecorded dtype")
    return words + (f" with fp8 matmuls ({recipe} scales)" if recipe else "")


def summarize(run) -> dict:
    """A base_train Run's numbers from its loop state, printed: val bpb (each seed's), the final
    eval, step time medians, throughput (every seed's tokens) and MFU (where the peak is known)."""
    loop, peak = run.loop, run.peak_flops
    summary = dict(final_val_bpb=loop["val_history"][-1][1],  # batched seeds: each seed's
                   min_val_bpb=per_seed(lambda *vs: min(vs), *(v for _, v in loop["val_history"])),
                   packing=run.train_loader.packing())
    if "final_eval" in loop:
        summary.update(zip(("final_eval_tokens", "final_eval_bpb"), loop["final_eval"]))
    print0(f"data (rank 0, this process): {summary['packing']}")
    if times := loop["step_times"]:  # the run's timed steps, those before a resume too
        med_dt, med_opt = statistics.median(times), statistics.median(loop["optim_times"])
        summary.update(median_step_ms=1000 * med_dt, median_optimizer_ms=1000 * med_opt,
                       mean_step_ms=1000 * statistics.fmean(times),  # the wall's pace
                       optimizer_share=med_opt / med_dt,
                       tok_per_s=run.args.total_batch_size * run.copies / med_dt)
        if peak:
            summary["mfu"] = run.flops_per_token * summary["tok_per_s"] / (peak * run.world_size)
        print0(f"optimizer step: {1000 * med_opt:.1f} ms of a {1000 * med_dt:.1f} ms step "
               f"({100 * med_opt / med_dt:.1f}%), medians over {len(times)} steps")
        print0(f"throughput: {summary['tok_per_s']:,.0f} tok/s" +
               (f", mfu {100 * summary['mfu']:.1f}%" if peak else ""))
    print0(f"final val bpb {numbers_text(summary['final_val_bpb'])} (min "
           f"{numbers_text(summary['min_val_bpb'])})"
           + (f"; over {summary['final_eval_tokens']:,} val tokens "
              f"{numbers_text(summary['final_eval_bpb'])}" if "final_eval" in loop else ""))
    return summary


def greedy_samples(model, tokenizer, tokens: int, seeds: list[int] | None) -> list[tuple[str, str]]:
    """Greedy continuations of PROMPTS (fp8 layers in bf16), printed; a sharded model generates on
    every rank, in step; of batched seeds, the first seed's model speaks."""
    samples = []
    model = seed_model(model, 0) if seeds else model
    with plain_linears(model):
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt, prepend_bos=True)
            out = tokenizer.decode(list(model.generate(ids, tokens, temperature=0.0)))
            samples.append((prompt, out))
            print0(f"sample{f' (seed {seeds[0]})' if seeds else ''}: {prompt!r} -> {out!r}")
    return samples


def write_report(run, summary: dict, samples: list) -> None:
    """A base_train Run's report.md and curves.png, then summary.json (which scripts.ablate reads),
    into its run dir: written whole, keeping what other writers added (run.py)."""
    args, config, loop, run_dir, device = run.args, run.config, run.loop, run.run_dir, run.device
    num_params, world_size = run.num_params, run.world_size
    gpu = (torch.cuda.get_device_name(device) if device.type == "cuda"
           else platform.processor() or platform.machine())
    headlines, sections = others_report(run_dir / "report.md")
    history, tokens = loop["precision"], run.num_iterations * args.total_batch_size
    # each precision, to the step the next took over
    precision = ", then ".join(precision_words(*h[1:]) + (f" to step {after[0]}" if after else "")
                               for h, after in zip(history, [*history[1:], None]))
    lines = [f"# nanomuon base_train report: {args.run}", *headlines, "",
             f"- command: `{shown(' '.join(sys.argv), 2000, quote=False)}`",
             f"- hardware: {world_size} x {device.type} ({gpu}), torch {torch.__version__}, python "
             f"{platform.python_version()}; {precision}, fp32 params; attention {args.attention}",
             f"- model: {json.dumps(config.to_dict())}, {num_params:,} params, "
             f"optimizer {args.optimizer}",
             *(f"- {line}" for line in summary.get("not_used", [])),
             f"- data: {shown(args.dataset, 500, quote=False)}, {tokens:,} tokens in "
             f"{run.num_iterations} steps of {args.total_batch_size:,}; rank 0 packed "
             f"{summary['packing']}",
             f"- training time: {loop['train_time'] / 60:.2f} min (excluding evals and the first "
             "steps)"]
    if args.seeds:
        lines.append(f"- seeds: {', '.join(map(str, args.seeds))}, trained as one batched model "
                     "on the same batches (tok/s counts every seed's tokens)")
    lines += result_lines(summary, args.seeds)
    png = plot_curves(run_dir / "curves.png", curve_panels(loop, args.seeds),
                      title=f"{args.run}: d{config.n_layer}, {num_params / 1e6:.1f}M params, "
                            f"{shown(args.dataset, 80, quote=False)}")
    lines += ["", "## Curves", "",
              "![train loss and val bpb](curves.png)" if png else f"({MISSING})"]
    names = [f"seed {seed}" for seed in args.seeds] if args.seeds else ["val bpb"]
    lines += ["", "## Validation bits per byte", "", f"| step | {' | '.join(names)} |",
              "|---:|" + "---:|" * len(names)]
    lines += [f"| {s} | {' | '.join(f'{x:.4f}' for x in (v if args.seeds else [v]))} |"
              for s, v in loop["val_history"]]
    if samples:
        lines += ["", "## Samples (greedy)" + (f", seed {args.seeds[0]}" if args.seeds else ""), ""]
        lines += [f"- `{p!r}` -> `{o!r}`" for p, o in samples]
    lines += sections
    write_atomic(run_dir / "report.md", "\n".join(lines) + "\n")
    # the same numbers and curves for programs (scripts.ablate reads them)
    record = dict(others_summary(run_dir / "summary.json"), **summary, run=args.run,
                  optimizer=args.optimizer, num_params=num_params, world_size=world_size,
                  tokens_per_step=args.total_batch_size, val_history=loop["val_history"],
                  val_train_time=loop["val_train_time"], history=loop["history"])
    if args.seeds:  # each seed's numbers as its own run records them
        record = {k: v for k, v in record.items() if k not in PER_SEED}
        record.update(seeds=args.seeds, per_seed=seed_records(args.seeds, summary, loop))
    write_atomic(run_dir / "summary.json", json.dumps(record) + "\n")
    print0(f"report: {run_dir / 'report.md'}")


# a batched run's summary.json holds these per seed (seeds.seed_records), not as lists
PER_SEED = ("final_val_bpb", "min_val_bpb", "final_eval_bpb", "val_history", "history")
RESULTS = (("tok_per_s", "{:,.0f}"), ("mfu", "{:.1%}"), ("optimizer_share", "{:.1%}"),
           ("final_val_bpb", "{:.4f}"), ("min_val_bpb", "{:.4f}"), ("final_eval_bpb", "{:.4f}"),
           ("final_eval_tokens", "{:,}"))


def result_lines(summary: dict, seeds: list[int] | None) -> list[str]:
    """The report's result lines; batched seeds get a line each for their own numbers."""
    shared = [(k, f) for k, f in RESULTS if k in summary and not (seeds and k in PER_SEED)]
    lines = [f"- {key.replace('_', ' ')}: {fmt.format(summary[key])}" for key, fmt in shared]
    for i, seed in enumerate(seeds or []):
        lines.append(f"- seed {seed}: " + ", ".join(
            f"{key.replace('_', ' ')} {fmt.format(summary[key][i])}" for key, fmt in RESULTS
            if key in summary and key in PER_SEED))
    return lines


def curve_panels(loop: dict, seeds: list[int] | None) -> list[dict]:
    """The report's two panels, train loss and val bpb: a series per seed when batched."""
    steps, losses = zip(*loop["history"]) if loop["history"] else ((), ())
    val_steps, bpbs = zip(*loop["val_history"])
    if seeds:
        train = {f"seed {s}": (steps, smooth([v[i] for v in losses])) for i, s in enumerate(seeds)}
        val = {f"seed {s}": (val_steps, [v[i] for v in bpbs]) for i, s in enumerate(seeds)}
    else:
        train = {"per step": (steps, losses), "smoothed": (steps, smooth(list(losses)))}
        val = {"val bpb": (val_steps, bpbs)}
    return [dict(title="train loss" + (", smoothed" if seeds else ""), xlabel="step",
                 ylabel="loss (nats/token)", series=train),
            dict(title="validation", xlabel="step", ylabel="bits per byte", series=val)]
