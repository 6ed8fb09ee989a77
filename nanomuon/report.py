"""
Reports: line plots of training curves, written as PNG with matplotlib, for base_train's report
and ablate's comparisons, and the marks by which base_train and base_eval share a run's report.
Plots are optional: matplotlib is imported here only, so the optimizer, the model and training
never need it; without it plot_curves() returns None and the report says in one line that it
skipped them and why (MISSING).
"""

import math
import re
from pathlib import Path

from nanomuon.common import write_atomic

# base_eval's CORE line under report.md's title, replaced by a later evaluation and kept by a
# resumed base_train, as are the summary.json keys that start with CORE_KEYS (core, core_step, ...)
CORE_HEADLINE = "> CORE: "
REPORT_BYTES = 1 << 30  # a run's report.md read back by the other tool: megabytes at most
SUMMARY_BYTES = 16 << 20  # a run's summary.json read back: base_train writes a few KB
CORE_KEYS = "core"
# the header of each section base_eval appends to report.md: the step it measured
EVAL_SECTION = re.compile(r"## base_eval, step (\d+)")


def eval_heading(step: int) -> str:
    """The header base_eval gives its section of report.md about `step` (EVAL_SECTION's form)."""
    return f"## base_eval, step {step}"


def eval_part(lines: list[str]) -> list[str]:
    """report.md's lines from base_eval's first section on, after a blank line; [] if none."""
    at = next((i for i, x in enumerate(lines) if i and EVAL_SECTION.fullmatch(x)), None)
    return [] if at is None else ["", *lines[at:]]


def split_eval_results(lines: list[str], record: dict, step: int):
    """What base_eval wrote about steps after `step`, apart from the rest, for a rewind to move
    aside: report.md's lines (its sections of those steps, and CORE's headline when the last
    section showing it is one of them) and summary.json's CORE keys (when their core_step is one).
    Returns (report lines kept, report lines of later steps, summary kept, its CORE keys of a
    later step, the later steps measured)."""
    starts = [i for i, x in enumerate(lines) if EVAL_SECTION.fullmatch(x)]
    sections = [(int(EVAL_SECTION.fullmatch(lines[i])[1]), lines[i:j])
                for i, j in zip(starts, [*starts[1:], len(lines)])]
    head = lines[:starts[0]] if starts else lines
    headline = next((x for x in head if x.startswith(CORE_HEADLINE)), None)
    shown = [s for s, body in sections if headline and headline[len(CORE_HEADLINE):] in body]
    headline_later = bool(shown) and shown[-1] > step
    kept = [x for x in head if not (headline_later and x == headline)]
    kept += [x for s, body in sections if s <= step for x in body]
    later = [headline, ""] if headline_later else []
    later += [x for s, body in sections if s > step for x in body]
    core_step = record.get("core_step")
    core = ({k: v for k, v in record.items() if k.startswith(CORE_KEYS)}
            if isinstance(core_step, int) and core_step > step else {})
    steps = sorted({s for s, _ in sections if s > step} | ({core_step} if core else set()))
    return kept, later, {k: v for k, v in record.items() if k not in core}, core, steps

MISSING = ("plots skipped: matplotlib is not installed, and plots are optional "
           "(`pip install matplotlib` draws them)")


def smooth(values: list[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average, as the step lines print it."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** i))
    return out


def plot_curves(path: Path, panels: list[dict], title: str = "") -> Path | None:
    """Draw panels side by side into path (PNG, written atomically). Each panel is a dict with
    title, xlabel, ylabel and series: {label: (xs, ys)} or (xs, ys, lows, highs) to shade a band
    (of one point: an error bar); optional logx, logy, colors ({label: matplotlib color}: one
    thing in one color across panels), dashed (labels drawn dashed, unmarked) and xticks
    ((positions, labels): values that are not numbers, at positions). Returns path, or None when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed, none opened
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
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
        ax.set(title=panel["title"], xlabel=panel["xlabel"], ylabel=panel["ylabel"])
        for axis in ("x", "y"):
            if panel.get(f"log{axis}"):
                getattr(ax, f"set_{axis}scale")("log")
        if "xticks" in panel:
            ax.set_xticks(*panel["xticks"])
        ax.grid(alpha=0.3)
        if len(panel["series"]) > 1:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return path
