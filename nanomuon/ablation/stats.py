"""
The statistics of a paired comparison over seeds: a mean and its 95% interval, the smallest effect
a design detects, and the verdicts ablate and noise print, in bpb and in steps. Seeds pair the runs
(one seed gives a variant and its baseline the same init and data order), so what is judged is the
per-seed difference, whose spread is far smaller than the seeds' own.
"""

import functools
import math
import statistics


@functools.cache  # 100k density evaluations; a table asks for the same few df many times
def t_quantile(df: int, p: float = 0.975) -> float:
    """Student's t quantile (p = 0.975: the half-width factor of a 95% interval), by bisection on
    the CDF, integrated with Simpson's rule; the standard library has no t distribution."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def mass(x, n=2000):  # P(0 <= T <= x)
        f = [c * (1 + (x * i / n) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        return x / n / 3 * (f[0] + f[n] + 4 * sum(f[1:n:2]) + 2 * sum(f[2:n:2]))

    lo, hi = 0.0, 1000.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mass(mid) < p - 0.5 else (lo, mid)
    return (lo + hi) / 2


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """(mean, sample std, half-width of the 95% interval of the mean); nan spreads for one value."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, math.nan, math.nan
    sd = statistics.stdev(values)
    return m, sd, t_quantile(len(values) - 1) * sd / math.sqrt(len(values))


def detectable_factor(n: int) -> float:
    """(t_0.975 + t_0.80) / sqrt(n): times the sd of n paired differences, the smallest true
    difference a 95% interval excludes zero for in 80% of repeats."""
    return (t_quantile(n - 1) + t_quantile(n - 1, 0.80)) / math.sqrt(n)


def paired(diffs: list[float]) -> dict:
    """The paired comparison of per-seed differences (variant minus baseline): their mean, its
    95% interval [lo, hi], and the smallest effect this design detects (detectable_factor's)."""
    m, sd, hw = mean_ci(diffs)
    detectable = detectable_factor(len(diffs)) * sd if len(diffs) > 1 else math.nan
    return dict(mean=m, lo=m - hw, hi=m + hw, sd=sd, detectable=detectable)


# The effects that separate track 3's optimizer records: 0.1-0.3% of the loss at equal steps.
RECORD_EFFECT = 0.0025
MOST_SEEDS = 10_000  # past this, "more seeds" is no answer: the spread itself must shrink


def seeds_to_detect(sd: float, effect: float) -> int | None:
    """The fewest seeds whose paired differences, spreading sd, detect `effect` (80% power at 95%
    confidence, as paired() reckons), or None past MOST_SEEDS. Bisection: the factor only falls."""
    lo, hi = 1, 2  # lo does not detect it (one seed detects nothing); hi is tried next
    while detectable_factor(hi) * sd > effect:
        if hi >= MOST_SEEDS:
            return None
        lo, hi = hi, min(2 * hi, MOST_SEEDS)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if detectable_factor(mid) * sd <= effect else (mid, hi)
    return hi


def verdict(diffs: list[float], base: float) -> str:
    """'better by X [lo, hi]', 'worse by X [lo, hi]', or 'no difference larger than D' (the farther end
    of the interval), in bpb and as a share of base, with the smallest effect the design detects and,
    when that is above a record-sized effect, the seeds one would take at the spread seen."""
    if len(diffs) < 2:
        return "one seed: no verdict (use --seeds 2 or more)"
    c = paired(diffs)
    seen = f"detectable: {c['detectable']:.4f} ({c['detectable'] / base:.2%})"
    if c["detectable"] > RECORD_EFFECT * base:
        n = seeds_to_detect(c["sd"], RECORD_EFFECT * base)
        seen += (f"; {RECORD_EFFECT:.2%} would take {n} seeds at this spread" if n else
                 f"; {RECORD_EFFECT:.2%} would take over {MOST_SEEDS:,} seeds at this spread")
    if c["hi"] < 0 or c["lo"] > 0:
        word = "better" if c["hi"] < 0 else "worse"
        return (f"{word} by {abs(c['mean']):.4f} bpb ({abs(c['mean']) / base:.2%}) "
                f"[{c['lo']:+.4f}, {c['hi']:+.4f}]; {seen}")
    bound = max(abs(c["lo"]), abs(c["hi"]))
    return (f"no difference larger than {bound:.4f} bpb ({bound / base:.2%}): {c['mean']:+.4f} "
            f"[{c['lo']:+.4f}, {c['hi']:+.4f}]; {seen}")


def bpb_per_log_step(finals: dict) -> tuple[float, float, int]:
    """(slope, its standard error, degrees of freedom) of final bpb against ln(steps) over the
    baseline's lengths (finals: steps -> per-seed final bpbs), with an intercept per seed: the
    seeds pair the lengths, so init and data order drop out of the slope."""
    lengths = sorted(finals)
    n = len(finals[lengths[0]])
    x = {steps: math.log(steps) for steps in lengths}
    x_mean = statistics.fmean(x.values())
    sxx = n * sum((x[k] - x_mean) ** 2 for k in lengths)
    seed_mean = [statistics.fmean(finals[k][s] for k in lengths) for s in range(n)]
    slope = sum((x[k] - x_mean) * (finals[k][s] - seed_mean[s])
                for k in lengths for s in range(n)) / sxx
    df = n * (len(lengths) - 1) - 1
    rss = sum((finals[k][s] - seed_mean[s] - slope * (x[k] - x_mean)) ** 2
              for k in lengths for s in range(n))
    return slope, math.sqrt(rss / df / sxx) if df > 0 else math.nan, df


def steps_verdict(diffs: list[float], slope: tuple, steps: int) -> dict | None:
    """Track 3's currency: the share of its steps a variant saves to reach the baseline's final bpb.
    The variant's curve is the baseline's stretched in steps: it reaches the baseline's bpb at
    steps * exp(-diff / slope) (slope: bpb_per_log_step's), so share = 1 - exp(-mean diff / slope),
    with a 95% interval from the differences' spread and the slope's error (delta method); None
    without a slope that falls."""
    b, b_se, b_df = slope
    if len(diffs) < 2 or not b < 0:
        return None
    m, sd, _ = mean_ci(diffs)
    n = len(diffs)
    r = -m / b
    # the variances of r and their degrees of freedom: Welch-Satterthwaite's for the sum, rounded
    # down (the slope may come from fewer seeds than the differences)
    parts = [(sd ** 2 / n / b ** 2, n - 1)]
    if b_df > 0:  # a slope with an error of its own
        parts.append((m ** 2 * b_se ** 2 / b ** 4, b_df))
    r_var = sum(v for v, _ in parts)
    df = r_var ** 2 / sum(v ** 2 / d for v, d in parts) if r_var > 0 else n - 1
    hw = t_quantile(max(1, math.floor(df))) * math.sqrt(r_var)
    share = [1 - math.exp(v) for v in (r, r + hw, r - hw)]  # exp(r) of the steps are needed
    return dict(share=share[0], lo=share[1], hi=share[2], steps=steps,
                fewer=share[0] * steps, fewer_lo=share[1] * steps, fewer_hi=share[2] * steps)


def steps_words(v: dict | None) -> str:
    """'reaches the baseline's final bpb in N fewer steps of S (X%) [a to b fewer]', or why not."""
    if v is None:
        return "in steps: none (no baseline run at other lengths, or it did not gain from them)"
    lo, hi = round(v["fewer_lo"]), round(v["fewer_hi"])
    span = (f"{lo} to {hi} fewer" if lo >= 0 else f"{-hi} to {-lo} more" if hi <= 0
            else f"{-lo} more to {hi} fewer")
    word = "fewer" if v["fewer"] >= 0 else "more"
    return (f"reaches the baseline's final bpb in {abs(v['fewer']):.0f} {word} steps of "
            f"{v['steps']} ({abs(v['share']):.1%}) [{span}]")


def fmt(values: list[float], digits: int = 4) -> str:
    """mean ± std [95% CI], or the one value."""
    m, sd, hw = mean_ci(values)
    d = digits
    return f"{m:.{d}f}" + ("" if math.isnan(sd) else f" ± {sd:.{d}f} [{m - hw:.{d}f}, "
                           f"{m + hw:.{d}f}]")
