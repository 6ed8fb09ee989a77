"""
Reports: line plots of training curves, written as PNG with matplotlib, for base_train's report
and ablate's comparisons (which tool writes which part of a run's report: nanomuon/run.py). Plots
are optional: matplotlib is imported here only, so the optimizer, the model and training never need
it; without it plot_curves() returns None and the report says in one line that it skipped them and
why (MISSING).
"""

import math
from pathlib import Path

from nanomuon.common import write_atomic

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
