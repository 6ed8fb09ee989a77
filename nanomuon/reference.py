"""
The definition of nanomuon's Muon update: one step on one matrix, in float64, in plain loops.

The fused, stacked, sharded and compiled paths (muon.py) must equal it, and the tests hold
them to it. It shares facts with them (coefficient sets, an orthogonalizer's method), never code:
read it to learn what the optimizer does, fork it to state a new idea before making it fast.
muon_step(p, g, state, group) returns the new p; state starts empty and carries over.

Per step, on a (rows, cols) matrix with gradient g:
  1. momentum: buf = m buf + (1 - m) g; Nesterov uses (1 - m) g + m buf ('l2' adds wd p to g)
  2. precondition (none by default): MuonEq divides rows and/or columns by their norms, or
     (nanochat's 'equilibrate_row_mean') scales each row to the mean row norm
  3. orthogonalize: Newton-Schulz on the wide orientation, X / (||X||_F * safety + eps), then
     X <- a X + (b A + c A^2) X with A = X X^T, one (a, b, c) per iteration (Gram's iterates are
     the same); an orthogonalizer of your own is passed in `stages`
  4-5. post-process, in order: Muon+ unit columns and/or rows, or a Frobenius rescale; variance
     reduction (with beta2): an EMA of the mean squared update per row (tall/square) or column
     (wide) divides it, and its Frobenius norm is restored
  6. apply: p <- p - lr' u - decay p [where u p >= 0 when 'cautious'], lr' = lr * factor
"""

import math

import torch
from torch import Tensor

from nanomuon.coefficients import COEFFICIENT_SETS
from nanomuon.stages import orthogonalizer_method

LR_FACTORS = {  # lr_scale: the factor on lr for a (rows, cols) matrix
    "shape": lambda r, c: math.sqrt(max(1.0, r / c)),
    "moonlight": lambda r, c: 0.2 * math.sqrt(max(r, c)),
    "spectral": lambda r, c: math.sqrt(max(r, c)),
    "unit_rms": lambda r, c: math.sqrt(r / c),
}
DEFAULTS = dict(nesterov=True, precondition=(), orthogonalizer="auto",
                ns_coefficients="polar_express", ns_repeat_last=False,
                post_process=("variance_reduction",), apply="cautious", lr_scale="shape",
                extra_scale=1.0, decay_lr="adjusted", weight_decay_mode="decoupled")


def coefficients(group: dict) -> tuple[list, float, float]:
    """(one (a, b, c) per iteration, safety, eps) from ns_coefficients, the last repeating."""
    spec = group["ns_coefficients"]
    if isinstance(spec, str):
        triples, safety, eps = COEFFICIENT_SETS[spec]
    elif isinstance(spec, dict):
        triples, safety, eps = spec["coefficients"], spec.get("safety", 1.0), spec.get("eps", 1e-7)
    else:
        triples, safety, eps = spec, 1.0, 1e-7
    triples = list(triples)
    while len(triples) < group["ns_steps"]:
        triples.append(triples[-1])
    return triples[:group["ns_steps"]], safety, eps


def newton_schulz(u: Tensor, group: dict) -> Tensor:
    """Step 3: Newton-Schulz in float64 on the wide orientation."""
    triples, safety, eps = coefficients(group)
    rows, cols = u.shape
    X = u.T if rows > cols else u
    X = X / (torch.linalg.matrix_norm(X) * safety + eps)
    for a, b, c in triples:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if rows > cols else X


def _builtin(name: str):
    """The float64 definition of a built-in stage name (steps 2, 4, 5 and 6 above)."""
    kind, _, mode = name.partition("_")
    if name == "equilibrate_row_mean":
        def to_mean(u, *_):
            mean_row_norm = torch.linalg.matrix_norm(u) / math.sqrt(u.shape[0])
            return u * mean_row_norm / u.norm(dim=1, keepdim=True).clamp_min(1e-6)
        return to_mean
    if kind == "equilibrate":
        def equilibrate(u, *_):
            r = (u ** 2).sum(dim=1, keepdim=True) + 1e-8 if "row" in mode else 1.0
            c = (u ** 2).sum(dim=0, keepdim=True) + 1e-8 if "col" in mode else 1.0
            return u / r ** 0.5 / c ** 0.5
        return equilibrate
    if kind == "normalize":
        def normalize(o, *_):
            if mode == "fro":
                return o * math.sqrt(min(o.shape)) / torch.linalg.matrix_norm(o)
            for part in mode.split("_"):
                o = o / ((o ** 2).sum(dim=0 if part == "col" else 1, keepdim=True) + 1e-7).sqrt()
            return o
        return normalize
    if name == "variance_reduction":
        return variance_reduction
    raise ValueError(f"reference.muon_step has no float64 definition of stage {name!r}; "
                     "pass one in `stages`")


def variance_reduction(o: Tensor, p, g, state: dict, group: dict, *_) -> Tensor:
    """Step 5, nothing without beta2."""
    if group["beta2"] is None:
        return o
    rows, cols = o.shape
    v = (o ** 2).mean(dim=1 if rows >= cols else 0, keepdim=True)
    state["v"] = group["beta2"] * state.get("v", torch.zeros_like(v)) + (1 - group["beta2"]) * v
    scaled = o * state["v"].clamp_min(1e-10) ** -0.5
    return scaled * (torch.linalg.matrix_norm(o) / torch.linalg.matrix_norm(scaled))


def _stage(stages: dict, slot: str, name: str):
    """Stage `name` in `slot`: stages' 'slot:name', its 'name', or the built-in one."""
    fn = stages.get(f"{slot}:{name}", stages.get(name))
    return fn if fn is not None else _builtin(name)


def _names(value) -> list:
    return [value] if isinstance(value, str) else list(value or ())


def muon_step(p: Tensor, g: Tensor, state: dict, group: dict, stages: dict | None = None) -> Tensor:
    """One Muon step of the (rows, cols) matrix p with gradient g, in float64; returns the new p.
    state (empty at first) keeps the momentum and the stages' state. stages: name (or
    'slot:name' where two slots share a name) -> the float64 definition of a stage not built in:
    precondition f(x, p, g, state, group) (group['inputs']: the input covariance on the steps a
    stage reads it, else None), orthogonalizer f(u, group), post-process f(o, p, g, state, group,
    u) (u: the orthogonalizer's input), apply f(p, o, lr, decay, state, group) -> new p."""
    group = dict(DEFAULTS, **group)
    stages = dict(stages or {})
    name = group["orthogonalizer"]
    if name not in stages and orthogonalizer_method(group) is None:
        raise ValueError(f"reference.muon_step has no float64 definition of orthogonalizer "
                         f"{name!r}; pass one in `stages`")
    # an entry with a Newton-Schulz method, whichever: Gram's iterates are the same in float64
    orthogonalize = stages.get(name, newton_schulz)
    p, g, m = p.double(), g.double(), group["momentum"]
    g_l2 = g + group["weight_decay"] * p if group["weight_decay_mode"] == "l2" else g
    state["buf"] = m * state.get("buf", torch.zeros_like(p)) + (1 - m) * g_l2
    u = (1 - m) * g_l2 + m * state["buf"] if group["nesterov"] else state["buf"]
    for name in _names(group["precondition"]):
        u = _stage(stages, "precondition", name)(u, p, g, state, group)
    o = orthogonalize(u, group).double()
    for name in _names(group["post_process"]):
        o = _stage(stages, "post_process", name)(o, p, g, state, group, u)
    rows, cols = o.shape
    lr = group["lr"] * LR_FACTORS[group["lr_scale"]](rows, cols) * group["extra_scale"]
    decay = (lr if group["decay_lr"] == "adjusted" else group["lr"]) * group["weight_decay"]
    if group["weight_decay_mode"] == "l2":
        decay = 0.0
    if (apply := stages.get(f"apply:{group['apply']}", stages.get(group["apply"]))) is not None:
        return apply(p, o, lr, decay, state, group)
    mask = (o * p >= 0).double() if group["apply"] == "cautious" else 1.0
    if group["apply"] not in ("cautious", "decoupled"):
        raise ValueError(f"reference.muon_step has no float64 definition of apply "
                         f"{group['apply']!r}; pass one in `stages`")
    return p - lr * o - decay * p * mask
