"""
An ablation's verdicts and write-up, from its runs' records alone: the sweep table, each variant
against the baseline in bpb and in steps (with the sign track 3 published, where it did), the plot
and ablations/<name>/ablation.md. The statistics behind each verdict are stats.py's.
"""

import math
import statistics
import sys
from typing import NamedTuple

from nanomuon.ablation import stats
from nanomuon.ablation.runs import Sweep, value_tag
from nanomuon.common import get_base_dir, shown, write_atomic
from nanomuon.report import MISSING, plot_curves


class Published(NamedTuple):
    """A source's sign of a variant minus Muon (-1 better, 0 no difference, +1 worse), in words."""
    sign: int
    source: str


# The published sign of each technique against Muon, from modded-nanogpt's optimization track
# (track 3: steps to 3.28 val loss, a 124M GPT on FineWeb; records/track_3_optimization/README.md),
# each against the Muon it was run beside. ablation.md says whether each verdict agrees.
PUBLISHED = {
    "adamw": Published(+1, "track 3: Adam 5625 steps (record 2) against Muon's 3600 (record 1)"),
    "muon-soap": Published(-1, "track 3 record 14: 3150 steps against 3225 (record 11)"),
    "muon-uw-floor": Published(0, "track 3 record 9: 3250 steps, as NorMuon alone (record 10)"),
    "muon-hyperball": Published(0, "track 3 record 37: 3250 steps, as the tuned Muon (record 36); "
                                "better only than an untuned one (record 5: 3325 against 3500)"),
    "muon-powercool": Published(-1, "track 3 record 20: 3030 steps against 3125 (record 16), "
                                "with Soft-Muon"),
    "muon-contra": Published(-1, "track 3 record 11: 3225 steps against 3250 (record 9); "
                             "p = 0.69, not significant"),
    "muon-muown": Published(-1, "track 3 record 23: 3075 steps against Muon's 3325 (record 12), "
                            "with PowerCool"),
    "muon-newton": Published(-1, "track 3 record 15: 3275 steps against Muon's 3325 (record 12)"),
}
SIGN_WORDS = {-1: "better", 0: "no difference", +1: "worse"}


def published_sign(variant: str, baseline: str) -> Published | None:
    """What was published for variant against baseline (either way round), or None."""
    if baseline == "muon":
        return PUBLISHED.get(variant)
    if variant == "muon" and baseline in PUBLISHED:
        return PUBLISHED[baseline]._replace(sign=-PUBLISHED[baseline].sign)
    return None


def against_published(diffs: list[float], published: Published) -> str:
    """Whether the paired 95% interval agrees with the published sign, or cannot tell."""
    c = stats.paired(diffs) if len(diffs) > 1 else dict(lo=-math.inf, hi=math.inf)
    seen = -1 if c["hi"] < 0 else 1 if c["lo"] > 0 else 0
    word = ("agrees" if seen == published.sign else "disagrees" if seen
            else "cannot tell (the interval holds zero)")
    return f"{word}; published: {SIGN_WORDS[published.sign]} ({published.source})"


def first_reaching(target: float, record: dict):
    """(step, training seconds) of the first eval at or below target, or None."""
    return next(((step, t)
                 for (step, bpb), t in zip(record["val_history"], record["val_train_time"])
                 if bpb <= target), None)


def sweep_table(final: dict, variants: list[str], sweep: Sweep, seeds: list[int],
                best: dict) -> list[str]:
    """Markdown: final val bpb at each swept value, and each minus the variant's best, paired."""
    def row(first: str, cells: list[str]) -> str:
        return f"| {first} | " + " | ".join(cells) + " |"

    head = [row("variant", [f"{sweep.flag} {v}" for v in sweep.values]),
            "|---|" + "---:|" * len(sweep.values)]
    lines = ["Final val bpb per swept value (mean ± std [95% CI]); the best per variant in bold:",
             "", *head]
    variants = [v for v in variants if sweep.of(v) == sweep.values]  # the swept ones
    lines += [row(v, [f"**{stats.fmt(final[v, x])}**" if x == best[v] else stats.fmt(final[v, x])
                      for x in sweep.values]) for v in variants]
    if len(seeds) > 1:
        lines += ["", "Each value minus the variant's best, paired by seed (mean [95% CI]):", "",
                  *head]
        for v in variants:
            diffs = {x: stats.paired([a - b for a, b in zip(final[v, x], final[v, best[v]])])
                     for x in sweep.values if x != best[v]}
            lines.append(row(v, ["(best)" if x == best[v] else
                                 "{mean:+.4f} [{lo:+.4f}, {hi:+.4f}]".format(**diffs[x])
                                 for x in sweep.values]))
    edge = [f"{v} ({best[v]})" for v in variants if best[v] in (sweep.values[0], sweep.values[-1])]
    return lines + ["", f"At the edge of the sweep: {', '.join(edge)}; widen --sweep to find "
                    "their best." if edge else "Every best lies inside the sweep.", ""]


def final_bpb(record: dict) -> float:
    """What a verdict compares: the final eval over --final-eval-tokens, else the last eval."""
    return record.get("final_eval_bpb", record["final_val_bpb"])


def own_steps(results: dict, variant: str, value: str, seeds: list[int]) -> int:
    """The steps the runs trained for (their last eval's), as the baseline's first seed ran."""
    return results[variant, value, seeds[0]]["val_history"][-1][0]


def baseline_finals(results: dict, lengths: dict, seeds: list[int], baseline: str,
                    value: str) -> dict:
    """steps -> the baseline's per-seed final bpbs at each length it ran (`lengths`: (seed, steps)
    -> record), over the seeds that ran every length; its own alone, over every seed, without."""
    own = own_steps(results, baseline, value, seeds)
    others = sorted({n for _, n in lengths})
    ran = [s for s in seeds if all((s, n) in lengths for n in others)] if others else []
    finals = {own: [final_bpb(results[baseline, value, s]) for s in ran or seeds]}
    return finals | {n: [final_bpb(lengths[s, n]) for s in ran] for n in others if ran}


def report(results: dict, variants: list[str], sweep: Sweep, seeds: list[int],
           baseline: str, lengths: dict | None = None) -> tuple:
    """(markdown lines, the best swept value per variant): the sweep, the comparison and the
    verdicts, in bpb and (with the baseline at other lengths: (seed, steps) -> record) in steps."""
    final = {(v, x): [final_bpb(results[v, x, s]) for s in seeds]
             for v in variants for x in sweep.of(v)}
    best = {v: min(sweep.of(v), key=lambda x: statistics.fmean(final[v, x])) for v in variants}
    lines = sweep_table(final, variants, sweep, seeds, best) if len(sweep.values) > 1 else []
    base_runs = [results[baseline, best[baseline], s] for s in seeds]
    target = statistics.fmean(final_bpb(r) for r in base_runs)
    # the curves' set: the steps and seconds to the baseline's last eval on it
    curve_target = statistics.fmean(r["final_val_bpb"] for r in base_runs)
    finals = baseline_finals(results, lengths or {}, seeds, baseline, best[baseline])
    slope = stats.bpb_per_log_step(finals) if len(finals) > 1 else (math.nan, math.nan, 0)
    own = own_steps(results, baseline, best[baseline], seeds)
    # a new idea judged at the baseline's tuned lrs may lose for its lr alone: say so where it is
    untuned = ("" if len(sweep.values) > 1 else f"; each variant at {sweep.flag} "
               f"{sweep.values[0]} only, not at its own best (--sweep {sweep.flag}=a,b,c)")
    known = {v: published_sign(v, baseline) for v in variants if v != baseline}
    extra = (" against the published sign |", "---|") if any(known.values()) else ("", "")
    lines += [f"| variant | {sweep.flag} | final val bpb (mean ± std [95% CI]) | steps to "
              f"{curve_target:.4f} | train seconds to {curve_target:.4f} | tok/s | vs {baseline} "
              f"|{extra[0]}", "|---|---:|---:|---:|---:|---:|---|" + extra[1]]
    for v in variants:
        runs = [results[v, best[v], s] for s in seeds]
        reached = [x for x in (first_reaching(curve_target, r) for r in runs) if x is not None]
        count = "" if len(reached) == len(runs) else f" ({len(reached)}/{len(runs)} reached)"
        steps = stats.fmt([float(x[0]) for x in reached], 1) + count if reached else "not reached"
        secs = stats.fmt([x[1] for x in reached], 1) + count if reached else "not reached"
        diffs = [final_bpb(r) - final_bpb(b) for r, b in zip(runs, base_runs)]
        tok_s = statistics.fmean(r.get("tok_per_s", math.nan) for r in runs)
        in_steps = stats.steps_words(stats.steps_verdict(diffs, slope, own))
        vs = ("(baseline)" if v == baseline else
              f"{stats.verdict(diffs, target)}; {in_steps}{untuned}")
        if extra[0]:
            vs += " | " + (against_published(diffs, known[v]) if known.get(v) else
                           "(baseline)" if v == baseline else "nothing published")
        lines.append(f"| {v} | {best[v]} | {stats.fmt([final_bpb(r) for r in runs])} | {steps} | "
                     f"{secs} | {tok_s:,.0f} | {vs} |")
    if "final_eval_bpb" in base_runs[0]:
        lines += ["", f"Final val bpb and the verdicts: each run's final weights over "
                  f"{base_runs[0]['final_eval_tokens']:,} val tokens (base_train "
                  "--final-eval-tokens); the steps and seconds columns and the curves: the evals "
                  "of --eval-tokens."]
    if len(finals) > 1:
        b, b_se, _ = slope
        lines += ["", f"Steps: {baseline} also ran {', '.join(str(n) for n in finals if n != own)} "
                  f"steps (each with its own schedule, on the first {len(finals[own])} seeds); its "
                  f"final bpb falls by {-b * math.log(2):.4f} ± {b_se * math.log(2):.4f} per "
                  "doubling of the steps (a line in ln(steps), an intercept per seed), which turns "
                  "each difference into steps."]
    return lines, best


def difference_panel(results: dict, variants: list[str], seeds: list[int], best: dict,
                     baseline: str) -> dict:
    """The paired differences in val bpb (variant minus baseline) at each eval with their 95%
    interval, around zero a band of +- the smallest effect this design detects, and at the last
    step the verdict's own difference and interval, so the panel agrees with the table."""
    series, colors, dashed = {}, {}, []
    for v in (v for v in variants if v != baseline):
        pairs = [(results[v, best[v], s], results[baseline, best[baseline], s]) for s in seeds]
        n = min(len(r["val_history"]) for pair in pairs for r in pair)
        steps = [pairs[0][0]["val_history"][i][0] for i in range(n)]
        cis = [stats.mean_ci([r["val_history"][i][1] - b["val_history"][i][1] for r, b in pairs])
                 for i in range(n)]
        series[f"{v} - {baseline}"] = (steps, [m for m, _, _ in cis],
                                       [m - hw for m, _, hw in cis],
                                       [m + hw for m, _, hw in cis])
        c = stats.paired([final_bpb(r) - final_bpb(b) for r, b in pairs])
        d, band = c["detectable"], f"{v}: detectable +-{c['detectable']:.4f}"
        series[band] = (steps, [0.0] * n, [-d] * n, [d] * n)
        # the verdict's own numbers: the final weights over --final-eval-tokens, at the last step
        last = f"{v} - {baseline}: the verdict's final eval"
        series[last] = ([steps[-1]], [c["mean"]], [c["lo"]], [c["hi"]])
        colors.update(dict.fromkeys((f"{v} - {baseline}", band, last), f"C{variants.index(v)}"))
        dashed.append(band)
    return dict(title="variant - baseline, paired by seed (band: 95% CI)", xlabel="step",
                ylabel="val bpb difference (< 0: better)", series=series, colors=colors,
                dashed=dashed)


def verdict_panel(results: dict, variants: list[str], sweep: Sweep, seeds: list[int],
                  best: dict, baseline: str) -> dict:
    """Each variant's verdict at a glance, as the table reads it: its final bpb minus the
    baseline's, paired by seed, in % of the baseline's, with the 95% interval as an error bar."""
    others = [v for v in variants if v != baseline]
    base = statistics.fmean(final_bpb(results[baseline, best[baseline], s]) for s in seeds)
    series = {"no difference": ([-0.5, len(others) - 0.5], [0.0, 0.0])}
    colors, labels = {"no difference": "gray"}, []
    for i, v in enumerate(others):
        c = stats.paired([final_bpb(results[v, best[v], s]) -
                          final_bpb(results[baseline, best[baseline], s]) for s in seeds])
        label = f"{v} at {best[v]}" if len(sweep.of(v)) > 1 else v  # at its best swept value
        series[label] = ([i], *([100 * c[k] / base] for k in ("mean", "lo", "hi")))
        colors[label] = f"C{variants.index(v)}"
        labels.append(label)
    return dict(title=f"the verdicts: final val bpb minus {baseline}'s (95% CI)",
                xlabel=f"each at its best {sweep.flag}" if len(sweep.values) > 1 else "",
                ylabel=f"% of {baseline}'s bpb (< 0: better)", series=series, colors=colors,
                dashed=["no difference"], xticks=(list(range(len(others))), labels))


def steps_panel(results: dict, variants: list[str], seeds: list[int], best: dict, baseline: str,
                finals: dict) -> dict:
    """The baseline's final bpb by its length, and each variant's mean final bpb drawn back to
    where the baseline's line reaches it: the steps saved."""
    lengths = sorted(finals)
    slope = stats.bpb_per_log_step(finals)[0]
    own = own_steps(results, baseline, best[baseline], seeds)
    series = {f"{baseline} at each length": (lengths, *spread([finals[n] for n in lengths]))}
    colors, dashed = {f"{baseline} at each length": f"C{variants.index(baseline)}"}, []
    for v in (v for v in variants if v != baseline):
        diff = statistics.fmean(final_bpb(results[v, best[v], s]) -
                                final_bpb(results[baseline, best[baseline], s]) for s in seeds)
        bpb = statistics.fmean(finals[own]) + diff
        reached = own * math.exp(diff / slope) if slope < 0 else math.nan
        series[v] = ([own, reached], [bpb, bpb])
        colors[v] = f"C{variants.index(v)}"
        dashed.append(v)
    return dict(title="steps: the baseline at other lengths", xlabel="steps (log)",
                ylabel="final val bpb", series=series, colors=colors, dashed=dashed, logx=True)


def plot(out, results: dict, variants: list[str], sweep: Sweep, seeds: list[int], best: dict,
         baseline: str, title: str, lengths: dict):
    """The panels: the paired differences, the steps, val bpb by step and by training time at each
    variant's best value (band: seeds' min to max), and final val bpb by swept value."""
    by_step, by_time, by_value = {}, {}, {}
    for v in variants:
        runs = [results[v, best[v], s] for s in seeds]
        n = min(len(r["val_history"]) for r in runs)
        band = spread([[r["val_history"][i][1] for r in runs] for i in range(n)])
        by_step[v] = ([runs[0]["val_history"][i][0] for i in range(n)], *band)
        by_time[v] = ([statistics.fmean(r["val_train_time"][i] for r in runs) for i in range(n)],
                      *band)
        if sweep.of(v) == sweep.values:
            finals = [[final_bpb(results[v, x, s]) for s in seeds] for x in sweep.values]
            by_value[v] = (value_axis(sweep.values)[0], *spread(finals))
    panels = []
    if len(seeds) > 1:  # a paired verdict needs seeds; a sweep of one variant has none to judge
        if len(variants) > 1:
            panels.append(verdict_panel(results, variants, sweep, seeds, best, baseline))
        panels.append(difference_panel(results, variants, seeds, best, baseline))
    finals = baseline_finals(results, lengths, seeds, baseline, best[baseline])
    if len(finals) > 1:
        panels.append(steps_panel(results, variants, seeds, best, baseline, finals))
    panels += [dict(title="val bpb by step (band: seeds' min to max)", xlabel="step",
                    ylabel="bits per byte", series=by_step),
               dict(title="val bpb by training time", xlabel="training seconds (no evals)",
                    ylabel="bits per byte", series=by_time)]
    if len(sweep.values) > 1:
        panels.append(dict(title=f"final val bpb by {sweep.flag}", xlabel=sweep.flag,
                           ylabel="bits per byte", series=by_value,
                           colors={v: f"C{variants.index(v)}" for v in by_value},  # as above
                           **value_axis(sweep.values)[1]))
    return plot_curves(out / "val_bpb.png", panels, title=title)


def spread(groups: list[list[float]]) -> tuple[list, list, list]:
    """Each group's mean, min and max: a curve and its band."""
    return ([statistics.fmean(g) for g in groups], [min(g) for g in groups],
            [max(g) for g in groups])


def value_axis(values: list[str]) -> tuple[list[float], dict]:
    """The swept values' x positions and axis options: numbers where they are, else labels."""
    try:
        xs = [float(x) for x in values]
    except ValueError:
        return list(range(len(values))), dict(xticks=(list(range(len(values))),
                                                      [value_tag(x) for x in values]))
    return xs, dict(logx=all(x > 0 for x in xs))


def not_cached(records: list[dict]) -> list[str]:
    """A line for each variant and value whose runs read what no cache key holds (run_batch)."""
    reads = {(r["variant"], r["value"]): r["uncached"] for r in records if r.get("uncached")}
    return ["", *(f"Not cached: {v} at {x} read {'; '.join(why)}, which no cache key can hold; "
                  "its runs train again each time" for (v, x), why in sorted(reads.items()))
            ] if reads else []


def write_ablation(args, argv, flags: list[str], results: dict, lengths: dict,
                   seeds: list) -> None:
    """The table (printed too), the plot and ablation.md in ablations/<name>."""
    out = get_base_dir() / "ablations" / args.name
    out.mkdir(parents=True, exist_ok=True)
    table, best = report(results, args.variants, args.sweep, seeds, args.baseline, lengths)
    table += not_cached([*results.values(), *lengths.values()])
    first = next(iter(results.values()))
    png = plot(out, results, args.variants, args.sweep, seeds, best, args.baseline,
               f"{args.name}: {first['num_params'] / 1e6:.1f}M params, "
               f"{first['tokens_per_step']:,} tokens/step, {len(seeds)} seeds", lengths)
    cmd = " ".join(["python -m scripts.ablate", *(argv if argv is not None else sys.argv[1:])])
    # swept values that run names hold as value_tag's slug and hash
    tags = [f"`{v}` as {value_tag(v)}" for v in args.sweep.values if value_tag(v) != v]
    sweep = args.sweep
    swept = (f"{'--variant-option ' if sweep.option else '--'}{sweep.flag}"
             + (f" ({sweep.variant} alone: the others run at their own settings, named without "
                "it)" if sweep.variant else "")
             + (f" (but {', '.join(sweep.fixed)}: once, at its own settings, named without it)"
                if sweep.fixed else ""))
    doc = [f"# Ablation: {args.name}", "", f"- command: `{cmd}`",
           f"- runs: {len(results)}, named {args.name}-<variant>-{args.sweep.flag}<value>-s<seed> "
           "(each has a report.md)" + (f", and {len(lengths)} of the baseline at other lengths "
                                       "(-n<steps>)" if lengths else "")
           + (f"; in the names, {', '.join(tags)}" if tags else ""),
           f"- every run: `python -m scripts.base_train {' '.join(flags)}`, then its own --run, "
           f"--optimizer, {swept}, --seed and --data-seed (the last of a flag given "
           "twice wins)",
           f"- seeds {seeds[0]}..{seeds[-1]}: each sets the init"
           + (", on one data order (data seed 1) for every run: the verdict is at that order"
              if args.data_order == "fixed" else " and the data order")
           + ", the same for every variant",
           f"- baseline: {args.baseline} at its best {args.sweep.flag}; steps and training time "
           "(evals excluded) are to the first eval at or below its mean final val bpb; verdicts "
           "are paired by seed, at 95% confidence; 'detectable' is the smallest effect this "
           f"design sees 80% of the time, and where that is above {stats.RECORD_EFFECT:.2%} of "
           "bpb (a record-sized effect) the seeds of these steps that would detect one, at the "
           "spread these seeds show",
           "", *table,
           "", "![val bpb by step, by training time and by swept value](val_bpb.png)" if png
           else f"({MISSING})", ""]
    # the command, the flags and the swept values are the user's text: escaped, as printed
    write_atomic(out / "ablation.md", "\n".join(shown(line, 100_000, quote=False) for line in doc))
    print("\n".join(shown(line, 100_000, quote=False) for line in table))
    print(f"table and plot in {out}")
