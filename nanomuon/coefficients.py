"""
Newton-Schulz's coefficient sets: the per-iteration (a, b, c) of the odd polynomial that pushes
every singular value towards 1, by name, and how a group's ns_coefficients resolves to the
triples muon.newton_schulz iterates (ns_coefficients). ns_growth measures how far a set takes a
singular value, and param_groups.check_group_values refuses one past NS_GROWTH_MAX: a typo in a
hand-written triple must not reach the update. Plain Python, no torch.
"""

import functools
import math

# Polar Express (Amsel, Persson, Musco, Gower 2025, https://arxiv.org/abs/2505.16932): one quintic
# (a, b, c) per iteration, computed for 5 iterations with safety factor 2e-2 and cushion 2.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# Keller Jordan's NS5 triple, used for every iteration (torch.optim.Muon's default, EO's 'simple').
JORDAN_NS5 = (3.4445, -4.7750, 2.0315)
# name -> (coefficients, norm safety factor, eps): X / (||X||_F * safety + eps) is iterated. After
# nanochat's two, NVIDIA Emerging-Optimizers' (EO) sets as EO rounds and names them (fd77292).
COEFFICIENT_SETS = {
    # tuned for 5 steps; the 1.01 cushion is on the norm (nanochat's)
    "polar_express": (POLAR_EXPRESS, 1.01, 1e-6),
    "jordan": ((JORDAN_NS5,), 1.0, 1e-7),
    # leloykun's per-step NS5 (modded-nanogpt); past 5 steps, nanomuon refuses or repeats the last
    "quintic": (((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                 (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)), 1.0, 1e-7),
    # Polar Express as published (8 steps, safety 1.01 folded into all but the last): EO's
    "polar_express_published": (((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                                 (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                                 (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                                 (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)), 1.0, 1e-7),
    # CANS (Chebyshev-accelerated NS, arXiv 2506.10935: Remez with an adaptive interval)
    "cans": (((8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
              (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)), 1.0, 1e-7),
    # tuned for AOL pre-scaling (thib-s/flash-newton-schulz); like EO, used without it
    "aol": (((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
             (2.7215, -3.0494, 1.3169)), 1.0, 1e-7),
    # DeepSeek-V4's hybrid NS (tech report): 8 Jordan steps, then 2 that converge; use ns_steps=10
    "deepseekv4": ((JORDAN_NS5,) * 8 + ((2.0, -1.5, 0.5),) * 2, 1.0, 1e-7),
}


def ns_coefficients(spec, ns_steps: int, repeat_last: bool = False) -> tuple[tuple, float, float]:
    """(per-iteration triples, safety, eps) for ns_steps, or ValueError. A single triple repeats;
    with repeat_last so does a list's last, else the list must be long enough."""
    if isinstance(spec, str) and spec not in COEFFICIENT_SETS:
        raise ValueError(f"ns_coefficients={spec!r} is unknown; use one of "
                         f"{list(COEFFICIENT_SETS)}, a list of (a, b, c) triples or "
                         "dict(coefficients=[...], safety=1.0, eps=1e-7)")
    d = (dict(zip(("coefficients", "safety", "eps"), COEFFICIENT_SETS[spec]))
         if isinstance(spec, str) else spec if isinstance(spec, dict) else dict(coefficients=spec))
    try:
        triples = tuple(tuple(float(x) for x in t) for t in d["coefficients"])
        safety, eps = float(d.get("safety", 1.0)), float(d.get("eps", 1e-7))
        ok = (set(d) <= {"coefficients", "safety", "eps"} and len(triples) >= 1
              and 0 < safety < float("inf") and 0 < eps < float("inf"))
        ok = ok and all(len(t) == 3 and all(abs(x) < float("inf") for x in t) for t in triples)
    except (TypeError, ValueError, KeyError):
        ok = False
    if not ok:
        raise ValueError("ns_coefficients must be a name, a non-empty list of finite (a, b, c) "
                         "triples, or dict(coefficients=<such a list>, safety=<finite number > 0>, "
                         f"eps=<finite number > 0>), got {spec!r}")
    if 1 < len(triples) < ns_steps and not repeat_last:
        raise ValueError(f"ns_steps={ns_steps} but "
                         f"ns_coefficients={spec if isinstance(spec, str) else 'list'} has "
                         f"{len(triples)} per-iteration triples; use ns_steps <= {len(triples)}, "
                         "or ns_repeat_last=True to run the last triple for the steps beyond")
    if len(triples) == 1 or repeat_last:
        triples += triples[-1:] * max(0, ns_steps - len(triples))
    return triples[:ns_steps], safety, eps


NS_GROWTH_MAX = 100.0  # every named set keeps singular values under 2 (docs/optimizer.md)


@functools.lru_cache(maxsize=64)
def ns_growth(triples: tuple, safety: float) -> float:
    """The largest singular value any iterate reaches from a normalized input, in float64 on a
    grid, inf on overflow: finite coefficients can still overflow fp32 (a = 1e30)."""
    xs, peak = [i / (256 * safety) for i in range(257)], 0.0
    for a, b, c in triples:
        xs = [a * x + b * x * x * x + c * x * x * x * x * x for x in xs]
        peak = max(peak, *(abs(x) for x in xs))
        if not math.isfinite(peak) or peak > 1e100:  # inf - inf is nan: stop before it
            return math.inf
    return peak
