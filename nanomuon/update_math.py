"""
The update math of Muon and AdamW, written once. Imports only torch.

Every optimizer path runs these functions: MuonAdamW, DistMuonAdamW on the matrices each rank owns,
and sharded.py on DTensor params, which runs the three Muon stages with communication between them:
muon_momentum (elementwise), muon_direction (whole matrices or slices: orthogonalize, then variance
reduction) and muon_apply (elementwise: weight decay and the step); muon_update() is the three in a
row. muon_hparams() and adamw_hparams() read a param group for every path, so none can disagree on an
lr factor or a precision. Compiled (kernel()), the hyperparameters are 0-D CPU tensors refilled every
step (scalars()), so LR schedules never recompile.
"""

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
# Keller Jordan's NS5 triple, used for every iteration (torch.optim.Muon's default).
JORDAN_NS5 = (3.4445, -4.7750, 2.0315)

# name -> (coefficients, norm safety factor, eps). The input is scaled by 1 / (||X||_F * safety + eps)
# so its spectral norm is below 1 before iterating; Polar Express was tuned with a 1.02 cushion.
COEFFICIENT_SETS = {"polar_express": (POLAR_EXPRESS, 1.02, 1e-6), "jordan": ((JORDAN_NS5,), 1.0, 1e-7)}
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# lr_scale modes: the factor on a Muon group's lr for a (rows, cols) matrix (the last two dims).
LR_SCALES = {
    "shape": lambda r, c: max(1.0, r / c) ** 0.5,  # Keller Jordan, nanochat, torch.optim.Muon's default
    "moonlight": lambda r, c: 0.2 * max(r, c) ** 0.5,  # Moonlight/Motif: matches AdamW's update RMS
    "spectral": lambda r, c: max(r, c) ** 0.5,  # Megatron's 'spectral'
    "unit_rms": lambda r, c: (r / c) ** 0.5,  # unit RMS-to-RMS operator norm
}


def ns_coefficients(spec, ns_steps: int) -> tuple[tuple[tuple[float, float, float], ...], float, float]:
    """Resolve a group's ns_coefficients and ns_steps into (per-iteration triples, safety, eps)."""
    if isinstance(spec, str):
        triples, safety, eps = COEFFICIENT_SETS[spec]
    else:
        triples, safety, eps = tuple(tuple(float(x) for x in t) for t in spec), 1.0, 1e-7
    if len(triples) == 1:  # a single triple is applied at every iteration
        triples = triples * ns_steps
    return tuple(triples[:ns_steps]), safety, eps


def orthogonalize(G: Tensor, coeffs, safety: float, eps: float, dtype: torch.dtype, shard=None) -> Tensor:
    """Approximate U V^T of G = U S V^T for every matrix in the last two dims, computed in `dtype`.

    Each iteration maps X -> a X + (b A + c A^2) X with A = X X^T, an odd quintic in the singular
    values. Work on the wide orientation (rows <= cols) so A is the smaller Gram matrix; the two
    baddbmm calls fold the scale-and-add into the matmuls, so an iteration is exactly three matmuls.

    shard=(reduce, cut_dim, full_shape): G is this rank's slice of each matrix, cut along cut_dim (-2 or
    -1), and reduce(t) sums t in place over the ranks holding the other slices. The cut dim is put on the
    columns, so the Gram matrix is a sum over slices, as is the norm: every rank computes exactly its
    slice of the whole result (Megatron's 'distributed' mode).
    """
    shape = G.shape
    X = G.to(dtype).reshape(shape[:-2].numel(), shape[-2], shape[-1])  # an empty slice keeps its batch
    tall = shape[-2] > shape[-1] if shard is None else shard[1] == -2
    if tall:
        X = X.mT
    if shard is None:
        norm = X.norm(dim=(-2, -1), keepdim=True)
    else:
        sq = X.float().square().sum(dim=(-2, -1), keepdim=True)
        shard[0](sq)
        norm = sq.sqrt().to(X.dtype)
    X = X / (norm * safety + eps)
    for a, b, c in coeffs:
        A = X @ X.mT
        if shard is not None:  # sum the partial Grams in fp32, whatever the iteration's dtype
            A32 = A.float()
            shard[0](A32)
            A = A32.to(A.dtype)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)
    if tall:
        X = X.mT
    return X.reshape(shape)


def muon_red_dim(shape) -> int:
    """The dim variance reduction averages over: columns (per-row stats) for tall or square matrices."""
    return -1 if shape[-2] >= shape[-1] else -2


def variance_reduction(g: Tensor, second_moment: Tensor, beta2, red_dim: int, shard=None) -> Tensor:
    """Factored second-moment normalization (NorMuon-style), as nanochat does it.

    Keeps an EMA of the mean squared update along `red_dim` (per row for tall/square matrices, per
    column for wide ones), divides by its square root, then rescales so the update keeps the
    Frobenius norm it had after orthogonalization. Scales g in place and returns it. With `shard`
    (see orthogonalize) g is a slice: the partial sums along the cut dim are summed across ranks.
    """
    reduce, cut_dim, full_shape = shard if shard is not None else (None, None, g.shape)
    red_size = full_shape[red_dim]
    # mean of squares via a norm, so no full-size g**2 is materialized; g is scaled in place at the end
    v_sum = torch.linalg.vector_norm(g, dim=red_dim, keepdim=True, dtype=torch.float32).square()
    if reduce is not None and cut_dim == red_dim:
        reduce(v_sum)
    v_mean = v_sum / red_size

    def total(t):  # the sum over each whole matrix; with the other dim cut, partial sums add up across ranks
        t = t.sum(dim=(-2, -1), keepdim=True)
        if reduce is not None and cut_dim != red_dim:
            reduce(t)
        return t

    v_norm = total(v_mean * red_size).sqrt()
    second_moment.lerp_(v_mean.to(second_moment.dtype), 1 - beta2)
    step_size = second_moment.clamp_min(1e-10).rsqrt()
    v_norm_new = total((v_mean * red_size) * step_size.float().square()).sqrt()
    return g.mul_((step_size * (v_norm / v_norm_new.clamp_min(1e-10))).to(g.dtype))


def muon_momentum(grads: Tensor, momentum_buffer: Tensor, params: Tensor, momentum, wd, nesterov: bool,
                  l2_wd: bool) -> Tensor:
    """Muon stage 1, elementwise (so it runs on shards too): the momentum step; returns what to orthogonalize.
    l2_wd adds wd * params to the gradient first (L2 regularization) instead of decaying the weights
    after the update. `grads` may be overwritten."""
    if l2_wd:
        grads = grads.add_(params * wd)
    momentum_buffer.lerp_(grads, 1 - momentum)
    return grads.lerp_(momentum_buffer, momentum) if nesterov else momentum_buffer


def muon_direction(g: Tensor, second_moment: Tensor | None, beta2, coeffs, safety: float, eps: float,
                   ns_dtype: torch.dtype, out_dtype: torch.dtype, shard=None, qkv_split=None) -> Tensor:
    """Muon stage 2, on whole matrices (or slices, with `shard`: see orthogonalize): orthogonalize, then
    variance reduction if second_moment is given. qkv_split=(q, k, v) row counts: a fused QKV weight is
    orthogonalized as three matrices; variance reduction and the lr factor still see the fused matrix."""
    if qkv_split:
        u = torch.cat([orthogonalize(b, coeffs, safety, eps, ns_dtype) for b in g.split(list(qkv_split), dim=-2)],
                      dim=-2).to(out_dtype)
    else:
        u = orthogonalize(g, coeffs, safety, eps, ns_dtype, shard).to(out_dtype)
    if second_moment is not None:
        u = variance_reduction(u, second_moment, beta2, muon_red_dim(shard[2] if shard else u.shape), shard)
    return u


def muon_apply(params: Tensor, u: Tensor, lr, wd, cautious_wd: bool, l2_wd: bool) -> None:
    """Muon stage 3, elementwise: weight decay and the update, in place on params; `u` is overwritten.
    `lr` already includes the shape multiplier; decay is scaled by that same lr (nanochat's convention;
    torch.optim.Muon scales decay by the unadjusted lr). With l2_wd the decay went into the gradient."""
    u.mul_(lr)  # u is a fresh buffer: scale and combine in place to spare full-size temporaries
    if not l2_wd and cautious_wd:  # decay only where the update and the weight agree in sign
        decay = torch.where((u * params) >= 0, params, 0.0)
        u.add_(decay.mul_(lr * wd))
    elif not l2_wd:
        params.mul_(1 - lr * wd)
    params.sub_(u)


def muon_update(grads: Tensor, params: Tensor, momentum_buffer: Tensor, second_moment: Tensor | None,
                momentum, lr, wd, beta2, coeffs, safety: float, eps: float, ns_dtype: torch.dtype,
                nesterov: bool, cautious_wd: bool, l2_wd: bool = False, qkv_split=None) -> None:
    """One Muon step on a stack of same-shape matrices (K, ..., rows, cols), in place on params: the three
    stages in a row. The sharded path (sharded.py) runs the same stages with communication between."""
    g = muon_momentum(grads, momentum_buffer, params, momentum, wd, nesterov, l2_wd)
    u = muon_direction(g, second_moment, beta2, coeffs, safety, eps, ns_dtype, params.dtype, qkv_split=qkv_split)
    muon_apply(params, u, lr, wd, cautious_wd, l2_wd)


def adamw_update(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                 step, lr, beta1, beta2, eps, wd) -> None:
    """One AdamW step (decoupled weight decay, bias-corrected moments), in place on p."""
    p.mul_(1 - lr * wd)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.lerp_(grad.square(), 1 - beta2)
    bias1 = 1 - beta1 ** step
    bias2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = exp_avg_sq.sqrt().div_(bias2_sqrt).add_(eps)
    p.sub_(exp_avg.div(denom).mul_(lr / bias1))


def resolve_ns_precision(precision: str, device) -> str:
    """A group's ns_precision on this device: 'auto' is bf16 on CUDA (as nanochat) and fp32 elsewhere,
    since CPUs without bf16 matrix units run bf16 matmuls ~100x slower than fp32."""
    if precision == "auto":
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    return precision


def muon_hparams(group: dict, matrix_shape, device) -> dict:
    """muon_update()'s keyword arguments from a muon group, for matrices of matrix_shape (which sets the
    lr factor, LR_SCALES[lr_scale] times extra_scale) on `device` (which settles ns_precision 'auto')."""
    coeffs, safety, eps = ns_coefficients(group["ns_coefficients"], group["ns_steps"])
    lr_factor = LR_SCALES[group["lr_scale"]](matrix_shape[-2], matrix_shape[-1]) * group["extra_scale"]
    return dict(momentum=group["momentum"], wd=group["weight_decay"], lr=group["lr"] * lr_factor,
                beta2=group["beta2"] if group["beta2"] is not None else 0.0, coeffs=coeffs, safety=safety, eps=eps,
                ns_dtype=NS_DTYPES[resolve_ns_precision(group["ns_precision"], device)], nesterov=group["nesterov"],
                cautious_wd=group["cautious_wd"], l2_wd=group["weight_decay_mode"] == "l2",
                qkv_split=group["qkv_split"])


def adamw_hparams(group: dict, step: int) -> dict:
    """adamw_update()'s keyword arguments from an adamw group, at the param's step count."""
    beta1, beta2 = group["betas"]
    return dict(step=step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], wd=group["weight_decay"])


def second_moment_shape(shape, full_shape=None) -> tuple:
    """The variance-reduction state of a matrix (or stack) of `shape`: one value per row (tall or square)
    or per column (wide). full_shape: the whole matrix when `shape` is a slice of it."""
    out = list(shape)
    out[muon_red_dim(full_shape if full_shape is not None else shape)] = 1
    return tuple(out)


def muon_state_layout(p: Tensor, second_moment: bool = True) -> dict:
    """A Muon param's state, name -> (shape, dtype): the momentum like the param, and (if asked) the
    second moment of second_moment_shape in fp32."""
    layout = {"momentum_buffer": (tuple(p.shape), p.dtype)}
    if second_moment:
        layout["second_momentum_buffer"] = (second_moment_shape(p.shape), torch.float32)
    return layout


def new_second_moment(shape, device, full_shape=None) -> Tensor:
    """Zeros of second_moment_shape, in fp32 whatever the param dtype: the state is tiny."""
    return torch.zeros(second_moment_shape(shape, full_shape), dtype=torch.float32, device=device)


def ns_flops(shape, ns_steps: int) -> float:
    """Newton-Schulz FLOPs for one param: 4 m^2 n + 2 m^3 per iteration and matrix, m <= n."""
    m, n = sorted(shape[-2:])
    return torch.Size(shape[:-2]).numel() * ns_steps * (4 * m * m * n + 2 * m ** 3)


# Eager or compiled.

_compiled: dict = {}
_scalar_tensors: dict = {}
_scalar_values: dict = {}  # what each tensor holds: most calls in a step repeat a value, and fill_ is not free
RUNTIME_SCALARS = ("momentum", "lr", "wd", "beta2", "step", "beta1")  # what schedules and steps change


def kernel(fn, compiled: bool):
    """fn itself, or its torch.compile'd twin (built once per process)."""
    if not compiled:
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False, fullgraph=True)
    return _compiled[fn]


def scalars(hparams: dict, compiled: bool) -> dict:
    """hparams for kernel(fn, compiled): as they are eager; compiled, the values that change from step to
    step become 0-D CPU tensors, refilled in place, so the compiled graph is reused instead of rebuilt."""
    if not compiled:
        return hparams
    out = dict(hparams)
    for key in RUNTIME_SCALARS:
        if key in out:
            t = _scalar_tensors.get(key)
            if t is None:
                t = _scalar_tensors[key] = torch.zeros((), dtype=torch.float32)
            if _scalar_values.get(key) != out[key]:
                t.fill_(out[key])
                _scalar_values[key] = out[key]
            out[key] = t
    return out
