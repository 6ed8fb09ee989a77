"""
The definition of nanomuon's Muon update: one step on one matrix, in float64, in plain loops.

This is what the fused, stacked, sharded and compiled paths (update_math.py and its callers) must
equal; the tests hold every path to it. It shares only facts with them (the coefficient sets), never
code: read it to learn what the optimizer does, fork it to state a new idea before making it fast.

    from nanomuon.reference import muon_step
    state = {}
    for g in grads:
        p = muon_step(p, g, state, group)   # group: a muon param group's keys (lr, momentum, ...)

Per step, on a (rows, cols) matrix with gradient g:
  1. momentum: buf = m buf + (1 - m) g; Nesterov uses (1 - m) g + m buf (L2 mode adds wd p to
     g first)
  2. MuonEq (equilibrate): divide rows and/or columns by their norms, both taken from the same
     matrix
  3. orthogonalize: Newton-Schulz on the wide orientation, X / (||X||_F * safety + eps) first, then
     X <- a X + (b A + c A^2) X with A = X X^T, one (a, b, c) per iteration
  4. Muon+ (post_normalize): unit columns and/or rows, or nanochat's Frobenius rescale
  5. variance reduction (beta2): an EMA of the mean squared update per row (tall/square) or column
     (wide) divides it, and the Frobenius norm from step 4 is restored
  6. p <- p - lr' u - decay p [where u p >= 0 when cautious], lr' = lr * factor(rows, cols)
"""

import math

import torch
from torch import Tensor

from nanomuon.update_math import COEFFICIENT_SETS

LR_FACTORS = {  # lr_scale: the factor on lr for a (rows, cols) matrix
    "shape": lambda r, c: math.sqrt(max(1.0, r / c)),
    "moonlight": lambda r, c: 0.2 * math.sqrt(max(r, c)),
    "spectral": lambda r, c: math.sqrt(max(r, c)),
    "unit_rms": lambda r, c: math.sqrt(r / c),
}
DEFAULTS = dict(nesterov=True, cautious_wd=True, ns_coefficients="polar_express",
                ns_repeat_last=False, equilibrate=None, post_normalize=None, lr_scale="shape",
                extra_scale=1.0, decay_lr="adjusted", weight_decay_mode="decoupled")


def coefficients(group: dict) -> tuple[list, float, float]:
    """(one (a, b, c) per iteration, norm safety, eps) from ns_coefficients and ns_steps: a single
    triple, or the last of a list with ns_repeat_last, repeats."""
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


def muon_step(p: Tensor, g: Tensor, state: dict, group: dict,
              orthogonalize=newton_schulz) -> Tensor:
    """One Muon step of the (rows, cols) matrix p with gradient g, in float64; returns the new p.
    state (a dict, empty at first) keeps the momentum and second moment. orthogonalize(u, group):
    step 3."""
    group = dict(DEFAULTS, **group)
    p, g, m = p.double(), g.double(), group["momentum"]
    if group["weight_decay_mode"] == "l2":
        g = g + group["weight_decay"] * p
    state["buf"] = m * state.get("buf", torch.zeros_like(p)) + (1 - m) * g
    u = (1 - m) * g + m * state["buf"] if group["nesterov"] else state["buf"]
    rows, cols = u.shape
    eq = group["equilibrate"] or ""
    r = ((u ** 2).sum(dim=1, keepdim=True) + 1e-8 if "row" in eq
         else torch.ones(rows, 1, dtype=u.dtype))
    c = ((u ** 2).sum(dim=0, keepdim=True) + 1e-8 if "col" in eq
         else torch.ones(1, cols, dtype=u.dtype))
    o = orthogonalize(u / r.sqrt() / c.sqrt(), group).double()
    if group["post_normalize"] == "fro":
        o = o * math.sqrt(min(rows, cols)) / torch.linalg.matrix_norm(o)
    elif group["post_normalize"]:
        for part in group["post_normalize"].split("_"):
            o = o / ((o ** 2).sum(dim=0 if part == "col" else 1, keepdim=True) + 1e-7).sqrt()
    if group["beta2"] is not None:
        v = (o ** 2).mean(dim=1 if rows >= cols else 0, keepdim=True)
        state["v"] = group["beta2"] * state.get("v", torch.zeros_like(v)) + (1 - group["beta2"]) * v
        scaled = o * state["v"].clamp_min(1e-10) ** -0.5
        o = scaled * (torch.linalg.matrix_norm(o) / torch.linalg.matrix_norm(scaled))
    lr = group["lr"] * LR_FACTORS[group["lr_scale"]](rows, cols) * group["extra_scale"]
    decay = (lr if group["decay_lr"] == "adjusted" else group["lr"]) * group["weight_decay"]
    if group["weight_decay_mode"] == "l2":
        decay = 0.0
    mask = (o * p >= 0).double() if group["cautious_wd"] else 1.0
    return p - lr * o - decay * p * mask
