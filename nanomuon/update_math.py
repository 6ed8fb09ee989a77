"""
The update math of Muon and AdamW, written once. Imports only torch.

Every optimizer path runs these functions: MuonAdamW, DistMuonAdamW on the matrices each rank
owns, and sharded.py on DTensor params, which runs the three Muon stages with communication
between them: muon_momentum (elementwise), muon_direction (whole matrices: the group's
orthogonalizer between the optional norms, then variance reduction) and muon_apply
(elementwise: weight decay and the step); muon_update() is the three in a row. Megatron's
'distributed' mode runs muon_direction on slices of each matrix inside over_slices(), the one
seam it needs: sums over the cut dim (summed) then add up across ranks. The per-step
numbers travel as MuonScalars (muon_hparams), the group's static options as a plain dict
(muon_options); both are read from a param group in one place, so no path can disagree on an lr
factor or a precision. Compiled (kernel()), the scalars are 0-D CPU tensors refilled every step
(scalars()), so LR schedules never recompile.

ORTHOGONALIZERS maps a group's `orthogonalizer` to f(G, group) -> a tensor shaped like G: G is a
stack of momentum matrices (..., rows, cols), group the options dict (ns_steps, ns_coefficients,
...). Register a function there and any group, DistMuonAdamW and the FSDP2 path can use it by name.
"""

from collections.abc import Callable
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor

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

# name -> (coefficients, norm safety factor, eps): the input is scaled by 1 / (||X||_F * safety +
# eps) before iterating. After nanochat's two, NVIDIA Emerging-Optimizers' (EO) sets, as EO rounds
# and names them (muon_utils.py at fd77292), with plain Frobenius normalization as in EO.
COEFFICIENT_SETS = {
    # tuned for 5 steps; the 1.02 cushion is on the norm
    "polar_express": (POLAR_EXPRESS, 1.02, 1e-6),
    "jordan": ((JORDAN_NS5,), 1.0, 1e-7),
    # leloykun's per-step NS5 (modded-nanogpt); EO cycles
    # it past 5 steps, nanomuon refuses or repeats the last
    "quintic": (((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                 (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)), 1.0, 1e-7),
    # Polar Express as published (arXiv 2505.16932, 8 steps), safety 1.01 folded into all but the
    # last triple; this is EO's 'polar_express'
    "polar_express_published": (((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                                 (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                                 (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                                 (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)), 1.0, 1e-7),
    # CANS (Chebyshev-accelerated NS, arXiv 2506.10935: Remez with an adaptive interval)
    "cans": (((8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
              (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)), 1.0, 1e-7),
    # tuned for AOL pre-scaling (thib-s/flash-newton-schulz,
    # arXiv 2208.03160); like EO, used without it
    "aol": (((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
             (2.7215, -3.0494, 1.3169)), 1.0, 1e-7),
    # DeepSeek-V4's hybrid NS (tech report): 8 Jordan steps, then 2 that converge; use ns_steps=10
    "deepseekv4": ((JORDAN_NS5,) * 8 + ((2.0, -1.5, 0.5),) * 2, 1.0, 1e-7),
}
NS_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EQUILIBRATE_MODES = (None, "row", "col", "row_col")  # MuonEq, before orthogonalizing (equilibrate)
# Muon+, after it (post_normalize)
POST_NORMALIZE_MODES = (None, "fro", "col", "row", "col_row", "row_col")
# Gram Newton-Schulz recomputes R from X every 3 iterations (newton_schulz; docs/benchmarks.md)
GRAM_RESTART = 3
# torch.cpu's probes of the CPU
CPU_BF16_FLAGS = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")

# lr_scale modes: the factor on a Muon group's lr for a (rows, cols) matrix (the last two dims).
LR_SCALES = {
    # Keller Jordan, nanochat, torch.optim.Muon's default
    "shape": lambda r, c: max(1.0, r / c) ** 0.5,
    "moonlight": lambda r, c: 0.2 * max(r, c) ** 0.5,  # Moonlight/Motif: matches AdamW's update RMS
    "spectral": lambda r, c: max(r, c) ** 0.5,  # Megatron's 'spectral'
    "unit_rms": lambda r, c: (r / c) ** 0.5,  # unit RMS-to-RMS operator norm
}


class NewtonSchulz(NamedTuple):
    """How Newton-Schulz runs: per-iteration (a, b, c) triples, the input norm's safety factor and
    eps (X / (||X||_F * safety + eps)), and the dtype the iteration computes in."""
    coefficients: tuple
    safety: float
    eps: float
    dtype: torch.dtype


class Layout(NamedTuple):
    """How a muon group stores its matrices (muon_layout): fused row blocks (split, repeated
    `groups` times: Megatron's per-query-group QKV), and/or (in, out) storage (transposed)."""
    split: tuple | None
    groups: int
    transposed: bool


class MuonScalars(NamedTuple):
    """The numbers of one Muon step that schedules change (0-D tensors when compiled: scalars())."""
    lr: float | Tensor  # the step, with the group's lr factor (per row of a split matrix: a tensor)
    momentum: float
    wd: float  # weight_decay, for L2 mode's gradient term
    decay: float | Tensor  # lr * weight_decay, with the lr decay_lr names
    beta2: float  # variance reduction's EMA (0 when off)


class AdamWScalars(NamedTuple):
    step: float
    lr: float
    beta1: float
    beta2: float
    eps: float
    wd: float


def ns_coefficients(spec, ns_steps: int, repeat_last: bool = False) -> tuple[tuple, float, float]:
    """Resolve a group's ns_coefficients and ns_steps into (per-iteration triples, safety, eps), or
    raise ValueError saying what is wrong. spec: a name, a list of (a, b, c) triples (safety 1, eps
    1e-7), or dict(coefficients=[...], safety=, eps=). A single triple runs at every iteration;
    with repeat_last, so does the last of a list that runs out (Emerging-Optimizers' rule); else
    the list must be long enough."""
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
              and safety > 0 and eps > 0)
        ok = ok and all(len(t) == 3 and all(abs(x) < float("inf") for x in t) for t in triples)
    except (TypeError, ValueError, KeyError):
        ok = False
    if not ok:
        raise ValueError("ns_coefficients must be a name, a non-empty list of finite (a, b, c) "
                         "triples, or dict(coefficients=<such a list>, safety=<number > 0>, "
                         f"eps=<number > 0>), got {spec!r}")
    if 1 < len(triples) < ns_steps and not repeat_last:
        raise ValueError(f"ns_steps={ns_steps} but "
                         f"ns_coefficients={spec if isinstance(spec, str) else 'list'} has "
                         f"{len(triples)} per-iteration triples; use ns_steps <= {len(triples)}, "
                         "or ns_repeat_last=True to run the last triple for the steps beyond")
    if len(triples) == 1 or repeat_last:
        triples += triples[-1:] * max(0, ns_steps - len(triples))
    return triples[:ns_steps], safety, eps


class Slices(NamedTuple):
    """Megatron's 'distributed' mode (sharded.py): each rank holds a slice of every matrix, cut along
    `dim` (-2 or -1) of whole_shape; reduce(t) sums t in place over the ranks holding the slices."""
    reduce: Callable
    dim: int
    whole_shape: tuple


# what over_slices() set: None (whole matrices) on every path but sharded.py's 'distributed' mode
_slices: Slices | None = None


@contextmanager
def over_slices(slices: Slices):
    """Within, the direction stage runs on slices: sums over the cut dim add up across the ranks
    (summed) and whole_shape() is the whole matrix's, so every rank computes exactly its slice of
    the whole result. The one seam the Megatron mode needs; nothing else reads it."""
    global _slices
    before, _slices = _slices, slices
    try:
        yield
    finally:
        _slices = before


def whole_shape(t: Tensor) -> tuple:
    """t's shape, or over slices the whole matrix's (the last two dims)."""
    return tuple(t.shape) if _slices is None else (*t.shape[:-2], *_slices.whole_shape[-2:])


def summed(t: Tensor, dims: tuple) -> Tensor:
    """t, a sum over dims of a matrix: over slices cut along one of dims, a partial sum, which is
    added up across the ranks in place."""
    if _slices is not None and _slices.dim in dims:
        _slices.reduce(t)
    return t


def gram_matrix(X: Tensor) -> Tensor:
    """X X^T. Over slices (newton_schulz puts the cut dim on the columns) the partial products are
    summed in fp32, whatever X's dtype."""
    A = X @ X.mT
    if _slices is None:
        return A
    A32 = A.float()
    _slices.reduce(A32)
    return A32.to(A.dtype)


def newton_schulz(G: Tensor, group: dict) -> Tensor:
    """Approximate U V^T of G = U S V^T for every matrix in the last two dims, by Newton-Schulz with
    the group's ns_coefficients, ns_steps and ns_precision. The registry's 'newton_schulz',
    'gram_newton_schulz' and 'auto' (Gram where gram_pays) are this one function, which reads
    which it is from group['orthogonalizer'].

    Standard: each iteration maps X -> a X + (b A + c A^2) X with A = X X^T, an odd quintic in the
    singular values; the two baddbmm calls fold the scale-and-add into the matmuls (three matmuls).
    Both methods work on the wide orientation (rows <= cols) so the Gram matrix is the smaller one.
    Gram (Dao-AILab's Gram Newton-Schulz): the same iterates, written as X_k = Q_k X_0 with Q_k a
    polynomial in R = X X^T, so the iteration runs on m x m matrices: P = p(R), Q <- Q P,
    R <- P R P, and one final Q X. In low precision R drifts (spurious negative eigenvalues that
    the polynomials amplify), so it restarts from X = Q X every GRAM_RESTART iterations.
    Over slices (over_slices) the cut dim goes on the columns, where the Gram matrix and the norm
    sum over it (with Gram, one reduction per restart instead of one per iteration)."""
    ns = newton_schulz_settings(group)
    gram = uses_gram(group, whole_shape(G), ns)
    shape = G.shape
    X = G.reshape(shape[:-2].numel(), shape[-2], shape[-1])  # an empty slice keeps its batch
    # bf16 and fp32 cast first, as torch.optim.Muon and nanochat do (and match them). fp16 normalizes
    # in fp32 first: its 5-bit exponent would flush a tiny momentum to zero, or overflow past 65,504.
    X = X if ns.dtype == torch.float16 else X.to(ns.dtype)
    norm = (X.norm(dim=(-2, -1), keepdim=True, dtype=torch.float32) if _slices is None
            else sq_sum(X, (-2, -1)).sqrt())
    norm = norm if ns.dtype == torch.float16 else norm.to(X.dtype)
    X = (X / (norm * ns.safety + ns.eps)).to(ns.dtype)
    tall = shape[-2] > shape[-1] if _slices is None else _slices.dim == -2
    if tall:
        X = X.mT.contiguous()  # a transposed view would be copied by every baddbmm that reads it
    if gram:
        R, Q = gram_matrix(X), None
        for i, (a, b, c) in enumerate(ns.coefficients):
            if i and i % GRAM_RESTART == 0:
                X, Q = Q @ X, None
                R = gram_matrix(X)
            P = torch.baddbmm(R, R, R, beta=b, alpha=c)
            P.diagonal(dim1=-2, dim2=-1).add_(a)  # p(R) = a I + b R + c R^2
            Q = P if Q is None else Q @ P
            if i + 1 < len(ns.coefficients) and (i + 1) % GRAM_RESTART:
                R = P @ (R @ P)
        X = Q @ X
    else:
        for a, b, c in ns.coefficients:
            A = gram_matrix(X)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)
    if tall:
        X = X.mT
    return X.reshape(shape)


def newton_schulz_settings(group: dict) -> NewtonSchulz:
    """A group's Newton-Schulz settings (its ns_precision already resolved: muon_options)."""
    coeffs, safety, eps = ns_coefficients(group["ns_coefficients"], group["ns_steps"],
                                          group["ns_repeat_last"])
    return NewtonSchulz(coeffs, safety, eps, NS_DTYPES[group["ns_precision"]])


# name -> f(G, group): a group's `orthogonalizer`. Add
# an entry to try another (docs: the option table).
ORTHOGONALIZERS = {
    "auto": newton_schulz,
    "newton_schulz": newton_schulz,
    "gram_newton_schulz": newton_schulz,
}


def sq_sum(x: Tensor, dims: tuple) -> Tensor:
    """The sum of squares of x over dims (kept), in fp32 without a full-size x**2 (over slices,
    the whole matrix's: summed)."""
    s = torch.linalg.vector_norm(x, dim=dims, keepdim=True, dtype=torch.float32).square()
    return summed(s, dims)


def equilibrate(g: Tensor, mode) -> Tensor:
    """MuonEq (Chang et al. 2026, arXiv 2603.28254; nanochat always applies 'row'): balance the
    momentum's rows and/or columns before orthogonalizing: diag(r) G diag(c),
    r_i = (sum_j G_ij^2 + 1e-8)^-1/2 and c likewise, both from the same G. Returns a new tensor:
    g may be the momentum buffer."""
    parts = mode.split("_") if mode else ()
    scales = [sq_sum(g, (-1,) if part == "row" else (-2,)).add_(1e-8).rsqrt_().to(g.dtype)
              for part in parts]
    for scale in scales:
        g = g * scale
    return g


def post_normalize(u: Tensor, mode) -> Tensor:
    """Muon+ (Zhang et al. 2026, arXiv 2602.21545): normalize the orthogonalized update's
    columns ('col') or rows ('row') to unit norm, x / sqrt(sum x^2 + 1e-7), one after the other
    in the order named ('col_row'), in place. 'fro' is nanochat's variant: rescale the whole
    matrix to Frobenius norm sqrt(min(rows, cols)), the norm of an exact U V^T, which
    Newton-Schulz only approximates."""
    if mode == "fro":
        m, n = whole_shape(u)[-2:]
        return u.mul_((min(m, n) ** 0.5 / sq_sum(u, (-2, -1)).sqrt().clamp_min(1e-6)).to(u.dtype))
    for part in mode.split("_") if mode else ():
        u = u.mul_(sq_sum(u, (-2,) if part == "col" else (-1,)).add_(1e-7).rsqrt_().to(u.dtype))
    return u


def muon_red_dim(shape) -> int:
    """The dim variance reduction averages over: columns
    (per-row stats) for tall or square matrices."""
    return -1 if shape[-2] >= shape[-1] else -2


def variance_reduction(g: Tensor, second_moment: Tensor, beta2, red_dim: int) -> Tensor:
    """Factored second-moment normalization (NorMuon-style), as nanochat does it.

    Keeps an EMA of the mean squared update along `red_dim` (per row for tall/square matrices, per
    column for wide ones), divides by its square root, then rescales so the update keeps the
    Frobenius norm it had after orthogonalization. Scales g in place and returns it."""
    red_size = whole_shape(g)[red_dim]
    v_mean = sq_sum(g, (red_dim,)) / red_size  # g is scaled in place at the end
    other = (-2 if red_dim == -1 else -1,)  # v_mean's sums over the other dim: the whole matrix's

    def total(t):
        return summed(t.sum(dim=(-2, -1), keepdim=True), other)

    v_norm = total(v_mean * red_size).sqrt()
    second_moment.lerp_(v_mean.to(second_moment.dtype), 1 - beta2)
    step_size = second_moment.clamp_min(1e-10).rsqrt()
    v_norm_new = total((v_mean * red_size) * step_size.float().square()).sqrt()
    return g.mul_((step_size * (v_norm / v_norm_new.clamp_min(1e-10))).to(g.dtype))


def pairs(stack: Tensor, params):
    """(stack, params) whole when params is a tensor
    like it, else row by row with a list of matrices."""
    return ((stack, params),) if isinstance(params, Tensor) else zip(stack, params)


def muon_momentum(grads: Tensor, momentum_buffer: Tensor, params, h: MuonScalars,
                  opts: dict) -> Tensor:
    """Muon stage 1, elementwise (so it runs on shards too): the momentum step; returns what to
    orthogonalize. weight_decay_mode 'l2' adds wd * params to the gradient first (L2 regularization)
    instead of decaying the weights after the update. `grads` may be overwritten. params: stacked
    like grads, or a list of its matrices."""
    if opts["weight_decay_mode"] == "l2":
        for g, p in pairs(grads, params):
            g.add_(p * h.wd)
    momentum_buffer.lerp_(grads, 1 - h.momentum)
    return grads.lerp_(momentum_buffer, h.momentum) if opts["nesterov"] else momentum_buffer


def block_shapes(shape, layout: Layout | None) -> list[tuple[int, int]]:
    """The logical (rows, cols) of each matrix a param
    of `shape` is updated as (see muon_layout)."""
    split, groups, transposed = layout or (None, 1, False)
    rows, cols = (shape[-1], shape[-2]) if transposed else (shape[-2], shape[-1])
    return [(n * groups, cols) for n in split] if split else [(rows, cols)]


def muon_direction(g: Tensor, second_moment: Tensor | None, beta2, opts: dict,
                   out_dtype: torch.dtype) -> Tensor:
    """Muon stage 2, on whole matrices: equilibrate, the group's orthogonalizer, post_normalize,
    then variance reduction if second_moment is given.

    Matrices stored (in, out) are worked on transposed; a split matrix is updated block by block,
    each exactly as a param of its own, its second moment a slice of the flat per-matrix state
    (Megatron's per-query-group QKV layout when split_groups > 1: block i is rows n_i of every
    group). Equal blocks (attention heads) run as one batch."""
    layout = muon_layout(opts)
    if layout is not None:
        return _by_layout(g, second_moment, beta2, opts, out_dtype, layout)
    g = equilibrate(g, opts["equilibrate"])
    u = ORTHOGONALIZERS[opts["orthogonalizer"]](g, opts)
    u = post_normalize(u.to(out_dtype), opts["post_normalize"])  # bf16 norms would copy to fp32
    if second_moment is not None:
        u = variance_reduction(u, second_moment, beta2, muon_red_dim(whole_shape(u)))
    return u


def _by_layout(g: Tensor, second_moment, beta2, opts: dict, out_dtype, layout: Layout) -> Tensor:
    """muon_direction of a transposed or split matrix, through plain matrices (see there)."""
    split, groups, transposed = layout
    plain = dict(opts, split=None, qkv_split=None, transposed=False)
    if transposed:
        return muon_direction(g.mT, second_moment, beta2,
                              dict(plain, split=split, split_groups=groups), out_dtype).mT
    if groups == 1 and len(set(split)) == 1:  # (..., k * n, cols) as a batch of k (n, cols) blocks
        k, n = len(split), split[0]
        sm = None if second_moment is None else \
            second_moment.unflatten(-1, (k, *second_moment_shape((n, g.shape[-1]))))
        return muon_direction(g.unflatten(-2, (k, n)), sm, beta2, plain, out_dtype).flatten(-3, -2)
    # the rows are `groups` repeats of the blocks: views
    # (..., groups, n, cols), as matrices flattened
    u = torch.empty(g.shape, dtype=out_dtype, device=g.device)
    sizes = [torch.Size(second_moment_shape(b)).numel() for b in block_shapes(g.shape, layout)]
    seconds = (second_moment.split(sizes, dim=-1) if second_moment is not None
               else [None] * len(split))
    views = [t.unflatten(-2, (groups, sum(split))).split(list(split), dim=-2) for t in (g, u)]
    for gb, ub, sb in zip(*views, seconds):
        m = gb.flatten(-3, -2)
        sb = sb.unflatten(-1, second_moment_shape(m.shape)[-2:]) if sb is not None else None
        ub.copy_(muon_direction(m, sb, beta2, plain, out_dtype).view_as(gb))
    return u


def muon_apply(params, u: Tensor, h: MuonScalars, opts: dict) -> None:
    """Muon stage 3, elementwise: weight decay and the update, in place on params (stacked like
    u, or a list of its matrices: the model's own params, sparing a stack and a copy back); `u`
    may be overwritten. h.lr: the step (a number, or per row of a split matrix: see
    muon_hparams); h.decay: lr * weight_decay with the lr decay_lr names. In 'l2' mode the decay
    went into the gradient instead."""
    lr, decoupled = h.lr, opts["weight_decay_mode"] == "decoupled"
    if isinstance(lr, Tensor):  # per-row, or compiled: u is a fresh buffer, scaled in place
        u.mul_(lr)
    for ui, p in pairs(u, params):
        # decay only where the update and the weight agree in sign
        if decoupled and opts["cautious_wd"]:
            p.addcmul_(p, ((ui * p) >= 0) * h.decay, value=-1)
        elif decoupled:
            p.mul_(1 - h.decay)
        if isinstance(lr, Tensor):
            p.sub_(ui)
        else:
            p.add_(ui, alpha=-lr)  # the lr folds into the add: no pass to scale u


def muon_update(grads, params, momentum_buffer: Tensor, second_moment: Tensor | None,
                h: MuonScalars, opts: dict) -> None:
    """One Muon step on a stack of same-shape matrices (K, ..., rows, cols), in place on params (the
    stack, or a list of its K matrices; grads likewise): the three stages in a row. The sharded path
    (sharded.py) runs the same stages with communication between."""
    # a slice's worth: small, reused memory
    grads = torch.stack(grads) if isinstance(grads, list) else grads
    g = muon_momentum(grads, momentum_buffer, params, h, opts)
    # in the params' dtype
    u = muon_direction(g, second_moment, h.beta2, opts, momentum_buffer.dtype)
    muon_apply(params, u, h, opts)


def adamw_update(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                 h: AdamWScalars) -> None:
    """One AdamW step (decoupled weight decay, bias-corrected moments), in place on p, written as
    torch.optim.AdamW's single-tensor path: one temporary (denom), the size of p."""
    p.mul_(1 - h.lr * h.wd)
    exp_avg.lerp_(grad, 1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    bias1 = 1 - h.beta1 ** h.step
    bias2_sqrt = (1 - h.beta2 ** h.step) ** 0.5
    denom = exp_avg_sq.sqrt().div_(bias2_sqrt).add_(h.eps)
    p.addcdiv_(exp_avg, denom, value=-h.lr / bias1)


def bf16_matmuls_fast(device) -> bool:
    """Whether bf16 matmuls beat fp32 here: on CUDA, and on CPUs with AVX512-BF16 or AMX (2-5x their
    fp32 rate); not on CPUs without them (20-100x slower than fp32), nor on MPS (not measured).
    Hardware flags, not a timing probe, so every rank agrees. The one rule for Newton-Schulz's
    'auto' precision and for training's autocast."""
    kind = torch.device(device).type
    return kind == "cuda" or kind == "cpu" and any(getattr(torch.cpu, f, lambda: False)()
                                                   for f in CPU_BF16_FLAGS)


def resolve_ns_precision(precision: str, device) -> str:
    """A group's ns_precision on this device: 'auto'
    is bf16 where bf16 matmuls are fast, else fp32."""
    if precision != "auto":
        return precision
    return "bf16" if bf16_matmuls_fast(device) else "fp32"


def muon_layout(group: dict) -> Layout | None:
    """How a muon group's matrices are stored: None (plain (out, in) matrices), or a Layout for
    fused or (in, out) weights (docs/optimizer.md)."""
    split = group["split"] or group["qkv_split"]
    if not split and not group["transposed"]:
        return None
    return Layout(tuple(split) if split else None, group["split_groups"], group["transposed"])


# (factors, layout, device) -> a split matrix's lr factor per logical row, shaped to broadcast over
# the stored matrix; built once, as a host-to-device copy every step would stall CUDA
_row_factors: dict = {}


def muon_hparams(group: dict, matrix_shape, device) -> MuonScalars:
    """A muon group's per-step numbers for matrices of matrix_shape on `device`. The lr factor (per
    row of a split matrix: per block) follows the logical shape; decay uses that lr, or the group lr
    with decay_lr='group' (torch.optim.Muon, Megatron)."""
    layout = muon_layout(group)
    factors = tuple(LR_SCALES[group["lr_scale"]](*b) * group["extra_scale"]
                    for b in block_shapes(matrix_shape, layout))
    lr = group["lr"] * factors[0]
    if len(factors) > 1:
        key = (factors, layout, torch.device(device))
        if key not in _row_factors:
            rows = (torch.tensor(factors).repeat_interleave(torch.tensor(layout.split))
                    .repeat(layout.groups))
            rows = rows.to(device)
            _row_factors[key] = rows.view(1, -1) if layout.transposed else rows.view(-1, 1)
        lr = group["lr"] * _row_factors[key]
    decay = (lr if group["decay_lr"] == "adjusted" else group["lr"]) * group["weight_decay"]
    beta2 = group["beta2"] if group["beta2"] is not None else 0.0
    return MuonScalars(lr=lr, momentum=group["momentum"], wd=group["weight_decay"], decay=decay,
                       beta2=beta2)


# What the math reads of a group: everything but the params, the per-step numbers
# (MuonScalars), labels and the options only the sharded path reads, so groups that differ
# in those share compiled graphs.
NOT_MATH = ("params", "kind", "name", "initial_lr", "lr", "momentum", "weight_decay", "beta2",
            "sharded_mode", "comm_precision")


def muon_options(group: dict, device) -> dict:
    """The static options the math reads from a muon group, as a plain dict (a compiled graph's
    constants), with ns_precision 'auto' settled for `device`."""
    opts = {k: v for k, v in group.items() if k not in NOT_MATH}
    opts["ns_precision"] = resolve_ns_precision(group["ns_precision"], device)
    return opts


def adamw_hparams(group: dict, step: int) -> AdamWScalars:
    """An adamw group's numbers, at the param's step count."""
    beta1, beta2 = group["betas"]
    return AdamWScalars(step=step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                        wd=group["weight_decay"])


def second_moment_shape(shape, layout=None) -> tuple:
    """The variance-reduction state of a matrix (or stack) of `shape`: one value per row (tall
    or square) or per column (wide). A split matrix keeps its blocks' states flat, one after
    another; a transposed one the state of its logical shape."""
    if layout is not None and layout.split:
        return (*shape[:-2], sum(torch.Size(second_moment_shape(b)).numel()
                                 for b in block_shapes(shape, layout)))
    if layout is not None:
        return second_moment_shape((*shape[:-2], shape[-1], shape[-2]))
    out = list(shape)
    out[muon_red_dim(shape)] = 1
    return tuple(out)


def muon_state_layout(p: Tensor, group: dict) -> dict:
    """A Muon param's state, name -> (shape, dtype): the momentum like the param, and (with beta2)
    the second moment of second_moment_shape in fp32."""
    layout = {"momentum_buffer": (tuple(p.shape), p.dtype)}
    if group["beta2"] is not None:
        layout["second_momentum_buffer"] = (second_moment_shape(p.shape, layout=muon_layout(group)),
                                            torch.float32)
    return layout


def new_second_moment(shape, device, layout=None) -> Tensor:
    """Zeros of second_moment_shape, in fp32 whatever the param dtype: the state is tiny."""
    return torch.zeros(second_moment_shape(shape, layout), dtype=torch.float32, device=device)


def ns_flops(shape, ns_steps: int, gram: bool = False) -> float:
    """Newton-Schulz FLOPs for one param, m <= n: K (4 m^2 n + 2 m^3) standard; Gram with r
    restarts, (4 + 4 r) m^2 n + (8 K - 6 (r + 1)) m^3 (fewer from aspect n / m > 1.5, at K = 5)."""
    # not sorted(): SymInts
    m, n = (shape[-2], shape[-1]) if shape[-2] <= shape[-1] else (shape[-1], shape[-2])
    r = (ns_steps - 1) // GRAM_RESTART
    per = ((4 + 4 * r) * m * m * n + (8 * ns_steps - 6 * (r + 1)) * m ** 3 if gram
           else ns_steps * (4 * m * m * n + 2 * m ** 3))
    return torch.Size(shape[:-2]).numel() * per


def gram_pays(shape, ns_steps: int, dtype: torch.dtype) -> bool:
    """Whether Gram Newton-Schulz suits a matrix of `shape` (the 'auto' orthogonalizer's rule): it
    takes fewer FLOPs, and the precision is fp32 or fp16, not bf16, whose 8-bit mantissa lets R
    drift (Polar Express lands 0.47-0.76 from U V^T where standard bf16 lands 0.10;
    tests/test_optim.py, docs)."""
    return dtype != torch.bfloat16 and ns_flops(shape, ns_steps, True) < ns_flops(shape, ns_steps)


def uses_gram(opts: dict, shape, ns: NewtonSchulz) -> bool:
    """Whether the group's orthogonalizer runs Gram Newton-Schulz on a matrix of `shape`."""
    name = opts["orthogonalizer"]
    return name == "gram_newton_schulz" or name == "auto" and gram_pays(shape, len(ns.coefficients),
                                                                        ns.dtype)


def ns_cost(group: dict, p: Tensor) -> float:
    """The orthogonalizer FLOPs of one Muon param under its group's settings (owner planning). An
    orthogonalizer the estimate does not know counts as standard Newton-Schulz."""
    opts = muon_options(group, p.device)
    ns = newton_schulz_settings(opts)
    return ns_flops(p.shape, len(ns.coefficients), uses_gram(opts, p.shape, ns))


# Eager or compiled.

_compiled: dict = {}
_scalar_tensors: dict = {}
# what each tensor holds: most calls in a step repeat a value, and fill_ is not free
_scalar_values: dict = {}


def kernel(fn, compiled: bool):
    """fn itself, or its torch.compile'd twin (built once per process). Shapes start static; a dim
    seen to change is made dynamic (dynamic=None), so a model with any number of shapes stays well
    inside dynamo's recompile limit instead of failing on its ninth."""
    if not compiled:
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=None, fullgraph=True)
    return _compiled[fn]


def scalars(h, compiled: bool):
    """h (MuonScalars or AdamWScalars) for kernel(fn, compiled): as it is eager;
    compiled, its numbers become 0-D CPU tensors, refilled in place, so the compiled
    graph is reused instead of rebuilt."""
    if not compiled:
        return h
    out = {}
    for key, value in h._asdict().items():
        if isinstance(value, Tensor):  # per-row lrs are tensors already
            out[key] = value
            continue
        t = _scalar_tensors.get(key)
        if t is None:
            t = _scalar_tensors[key] = torch.zeros((), dtype=torch.float32)
        if _scalar_values.get(key) != value:
            t.fill_(value)
            _scalar_values[key] = value
        out[key] = t
    return type(h)(**out)
