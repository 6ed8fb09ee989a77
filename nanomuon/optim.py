"""
Fused Muon + AdamW: MuonAdamW on one device, DistMuonAdamW for data parallel training (ZeRO-2).

Muon (https://kellerjordan.github.io/posts/muon/) trains weight matrices with an orthogonalized
momentum; embeddings, the output head and gains train with AdamW. Param groups say which with
`kind`, nanochat's convention, so nanochat-style groups work unchanged:

    dict(kind='adamw', params=[...], lr=3e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
    dict(kind='muon',  params=[...], lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.2)

Optional muon keys; their defaults reproduce nanochat:
    nesterov=True           Nesterov momentum (False: plain heavy-ball momentum).
    cautious_wd=True        decay only where update and weight agree in sign (False: plain decoupled decay).
    ns_coefficients='polar_express'   'polar_express', 'jordan' (Keller Jordan's NS5 triple), or a list of (a, b, c).
    ns_precision='auto'     'bf16' | 'fp32' | 'auto': bf16 on CUDA as nanochat does, fp32 elsewhere, because
                            CPUs without bf16 matrix units run bf16 matmuls ~100x slower than fp32.
    lr_scale='shape'        the lr factor of a (rows, cols) matrix: 'shape' sqrt(max(1, rows/cols)); 'moonlight'
                            0.2 sqrt(max(rows, cols)), which matches AdamW's update RMS; 'spectral'
                            sqrt(max(rows, cols)); 'unit_rms' sqrt(rows/cols).
    extra_scale=1.0         one more factor on the lr.
    weight_decay_mode='decoupled'   or 'l2': add weight_decay * param to the gradient before momentum.
    comm_precision='fp32'   'bf16' halves the all_to_all traffic of sharded_mode 'owner' (DTensor params).
    qkv_split=None          (q, k, v) row counts: the group's params are fused [Q; K; V] weights, each block
                            orthogonalized on its own (Megatron's split_qkv).
    sharded_mode='owner'    how DTensor params are orthogonalized: 'owner' (exact: whole matrices on one rank),
                            'duplicated', 'distributed' or 'blockwise' (Megatron's TP modes; see sharded.py).
Any optional group key may be 'name', a label used in error messages.

The update math is written once, in adamw_update() and muon_update() (itself muon_momentum ->
muon_direction -> muon_apply); both classes call those same functions, eagerly or through
torch.compile, so the single-device and distributed paths cannot drift. Hyperparameters reach the
compiled functions as 0-D CPU tensors so LR schedules never recompile.

DTensor params (FSDP2, tensor parallel) are updated in place, sharded, by either class: sharded.py
runs the same three Muon stages with all_to_all (or Megatron's modes) between them.
"""

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed support: no DTensor params to meet
    DTensor = ()

# -----------------------------------------------------------------------------
# The math. Every function here takes hyperparameters as Python floats (eager) or as 0-D CPU tensors
# (compiled), and uses only operations that accept both.

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
COEFFICIENT_SETS = {
    "polar_express": (POLAR_EXPRESS, 1.02, 1e-6),
    "jordan": ((JORDAN_NS5,), 1.0, 1e-7),
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
    X = G.to(dtype).reshape(math.prod(shape[:-2]), shape[-2], shape[-1])  # an empty slice keeps its batch
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


def muon_red_dim(shape) -> int:
    """The dim variance reduction averages over: columns (per-row stats) for tall or square matrices."""
    return -1 if shape[-2] >= shape[-1] else -2


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


def muon_apply(params: Tensor, u: Tensor, lr, wd, cautious_wd: bool, decoupled_wd: bool) -> None:
    """Muon stage 3, elementwise: weight decay and the update, in place on params; `u` is overwritten.

    `lr` already includes the shape multiplier; decay is scaled by that same lr (nanochat's convention;
    torch.optim.Muon scales decay by the unadjusted lr)."""
    u.mul_(lr)  # u is a fresh buffer: scale and combine in place to spare full-size temporaries
    if decoupled_wd and cautious_wd:  # decay only where the update and the weight agree in sign
        decay = torch.where((u * params) >= 0, params, 0.0)
        u.add_(decay.mul_(lr * wd))
    elif decoupled_wd:
        params.mul_(1 - lr * wd)
    params.sub_(u)


def muon_update(grads: Tensor, params: Tensor, momentum_buffer: Tensor, second_moment: Tensor | None,
                momentum, lr, wd, beta2, coeffs, safety: float, eps: float, ns_dtype: torch.dtype,
                nesterov: bool, cautious_wd: bool, l2_wd: bool = False, qkv_split=None) -> None:
    """One Muon step on a stack of same-shape matrices (K, ..., rows, cols), in place on params: the three
    stages in a row. The sharded path (sharded.py) runs the same stages with communication between."""
    g = muon_momentum(grads, momentum_buffer, params, momentum, wd, nesterov, l2_wd)
    u = muon_direction(g, second_moment, beta2, coeffs, safety, eps, ns_dtype, params.dtype, qkv_split=qkv_split)
    muon_apply(params, u, lr, wd, cautious_wd, not l2_wd)


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


def muon_state_layout(p: Tensor) -> dict:
    """Per-param Muon state, name -> (shape, dtype). The second moment holds one value per row (rows >= cols)
    or per column, kept in fp32 whatever the param dtype: it is tiny."""
    second = list(p.shape)
    second[muon_red_dim(p.shape)] = 1
    second = tuple(second)
    return {"momentum_buffer": (tuple(p.shape), p.dtype), "second_momentum_buffer": (second, torch.float32)}


# lr_scale modes: the factor on a Muon group's lr for a (rows, cols) matrix (the last two dims).
LR_SCALES = {
    "shape": lambda r, c: max(1.0, r / c) ** 0.5,  # Keller Jordan, nanochat, torch.optim.Muon's default
    "moonlight": lambda r, c: 0.2 * max(r, c) ** 0.5,  # Moonlight/Motif: matches AdamW's update RMS
    "spectral": lambda r, c: max(r, c) ** 0.5,  # Megatron's 'spectral'
    "unit_rms": lambda r, c: (r / c) ** 0.5,  # unit RMS-to-RMS operator norm
}


def muon_lr_multiplier(shape, lr_scale: str = "shape", extra_scale: float = 1.0) -> float:
    """The lr factor of one matrix of `shape`: LR_SCALES[lr_scale] times extra_scale."""
    return LR_SCALES[lr_scale](shape[-2], shape[-1]) * extra_scale


def ns_flops(shape, ns_steps: int) -> float:
    """Newton-Schulz FLOPs for one param: 4 m^2 n + 2 m^3 per iteration and matrix, m <= n."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * ns_steps * (4 * m * m * n + 2 * m ** 3)


def assign_owners(buckets: list[tuple[int, float]], world_size: int) -> list[list[list[int]]]:
    """Split each bucket of same-shape matrices, given as (count, cost of one), over the ranks.

    Every rank gets floor(count / N) matrices of every bucket, so a bucket's stacks pad to ceil(count / N)
    per rank, as little as possible; the remainders go, costliest bucket first, one each to the least
    loaded ranks (ties to the lower rank). The result, slots[bucket][rank] = matrix indices, depends on
    the shapes alone, so every rank computes the same plan. The busiest rank exceeds the mean by at most
    one matrix's cost.
    """
    loads = [sum(count // world_size * cost for count, cost in buckets)] * world_size
    extra = [[] for _ in buckets]  # extra[b]: ranks that get one more matrix of bucket b
    for b in sorted(range(len(buckets)), key=lambda b: (-buckets[b][1], b)):
        count, cost = buckets[b]
        for r in sorted(range(world_size), key=lambda r: (loads[r], r))[:count % world_size]:
            extra[b].append(r)
            loads[r] += cost
    plan = []
    for (count, _), ranks in zip(buckets, extra):
        sizes = [count // world_size + (r in ranks) for r in range(world_size)]
        starts = [sum(sizes[:r]) for r in range(world_size)]
        plan.append([list(range(starts[r], starts[r] + sizes[r])) for r in range(world_size)])
    return plan


_compiled: dict = {}


def _kernel(fn, compiled: bool):
    """fn itself, or its torch.compile'd twin (built once per process)."""
    if not compiled:
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False, fullgraph=True)
    return _compiled[fn]


# -----------------------------------------------------------------------------
# Param group checks. Every message names the group, the parameter and the fix.

REQUIRED_KEYS = {
    "adamw": ("lr", "betas", "eps", "weight_decay"),
    "muon": ("lr", "momentum", "ns_steps", "beta2", "weight_decay"),
}
OPTIONAL_KEYS = {
    "adamw": {},
    "muon": {"nesterov": True, "cautious_wd": True, "ns_coefficients": "polar_express", "ns_precision": "auto",
             "lr_scale": "shape", "extra_scale": 1.0, "weight_decay_mode": "decoupled", "comm_precision": "fp32",
             "sharded_mode": "owner", "qkv_split": None},
}
# Keys other code legitimately adds to groups: LR schedulers write initial_lr; 'name' labels a group.
PASSIVE_KEYS = {"params", "kind", "name", "initial_lr"}
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHARDED_MODES = ("owner", "duplicated", "distributed", "blockwise")  # DTensor params: see sharded.py


def _group_label(i: int, group: dict) -> str:
    name = f" '{group['name']}'" if "name" in group else ""
    return f"param group {i}{name} (kind={group.get('kind')!r})"


def _check_number(label, key, value, lo=0.0, hi=math.inf, hi_open=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and lo <= value and (value < hi if hi_open else value <= hi)
    if not ok:
        bound = f"in [{lo}, {hi})" if hi_open else (f"in [{lo}, {hi}]" if hi != math.inf else f">= {lo}")
        raise ValueError(f"{label}: {key}={value!r} must be a finite number {bound}; fix the value you pass "
                         f"(or your LR schedule, if it sets {key})")


def check_group_values(i: int, group: dict) -> None:
    """Hyperparameter checks; cheap, so they also run at every step (schedules edit groups)."""
    label = _group_label(i, group)
    kind = group.get("kind")
    if kind not in REQUIRED_KEYS:
        raise ValueError(f"{label}: kind must be 'adamw' or 'muon'; add kind='adamw' or kind='muon' to the group")
    missing = [k for k in REQUIRED_KEYS[kind] if k not in group]
    if missing:
        raise ValueError(f"{label}: missing {missing}; a {kind} group needs {list(REQUIRED_KEYS[kind])}")
    _check_number(label, "lr", group["lr"])
    _check_number(label, "weight_decay", group["weight_decay"])
    if kind == "adamw":
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"{label}: betas={betas!r} must be a pair (beta1, beta2), e.g. betas=(0.9, 0.95)")
        _check_number(label, "betas[0]", betas[0], 0.0, 1.0, hi_open=True)
        _check_number(label, "betas[1]", betas[1], 0.0, 1.0, hi_open=True)
        _check_number(label, "eps", group["eps"])
        return
    _check_number(label, "momentum", group["momentum"], 0.0, 1.0, hi_open=True)
    if group["beta2"] is not None:
        _check_number(label, "beta2", group["beta2"], 0.0, 1.0, hi_open=True)
    steps = group["ns_steps"]
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        raise ValueError(f"{label}: ns_steps={steps!r} must be an int >= 1 (5 is standard)")
    spec = group.get("ns_coefficients", "polar_express")
    if isinstance(spec, str):
        if spec not in COEFFICIENT_SETS:
            raise ValueError(f"{label}: ns_coefficients={spec!r} is unknown; use one of {list(COEFFICIENT_SETS)} "
                             "or a list of (a, b, c) triples")
        available = len(COEFFICIENT_SETS[spec][0])
    else:
        try:
            available = len(spec)
            ok = available >= 1 and all(len(t) == 3 and all(math.isfinite(float(x)) for x in t) for t in spec)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{label}: ns_coefficients must be a name or a non-empty list of finite (a, b, c) "
                             f"triples, got {spec!r}")
    if available > 1 and steps > available:
        raise ValueError(f"{label}: ns_steps={steps} but ns_coefficients={spec if isinstance(spec, str) else 'list'} "
                         f"has {available} per-iteration triples; use ns_steps <= {available}")
    if group.get("ns_precision", "auto") not in ("auto", *NS_DTYPES):
        raise ValueError(f"{label}: ns_precision={group['ns_precision']!r} must be 'auto', 'bf16' or 'fp32'")
    for key in ("nesterov", "cautious_wd"):
        if not isinstance(group.get(key, True), bool):
            raise ValueError(f"{label}: {key}={group[key]!r} must be True or False")
    for key, choices in (("lr_scale", LR_SCALES), ("weight_decay_mode", ("decoupled", "l2")),
                         ("comm_precision", NS_DTYPES), ("sharded_mode", SHARDED_MODES)):
        if key in group and group[key] not in choices:
            raise ValueError(f"{label}: {key}={group[key]!r} must be one of {list(choices)}")
    if "extra_scale" in group:
        _check_number(label, "extra_scale", group["extra_scale"])
    split = group.get("qkv_split")
    if split is not None:
        if not (isinstance(split, (tuple, list)) and len(split) == 3
                and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in split)):
            raise ValueError(f"{label}: qkv_split={split!r} must be three positive row counts (q, k, v)")
        if group.get("sharded_mode", "owner") in ("distributed", "blockwise"):
            raise ValueError(f"{label}: qkv_split needs whole matrices: use sharded_mode 'owner' or 'duplicated'")


def check_group(i: int, group: dict) -> None:
    """Full check of a new group: structure, keys, values and every parameter."""
    if not isinstance(group, dict):
        raise TypeError(f"param group {i}: expected a dict with 'kind' and 'params', got {type(group).__name__}")
    label = _group_label(i, group)
    if "params" not in group:
        raise ValueError(f"{label}: missing 'params'; give the list of parameters this group trains")
    check_group_values(i, group)
    kind = group["kind"]
    unknown = set(group) - PASSIVE_KEYS - set(REQUIRED_KEYS[kind]) - set(OPTIONAL_KEYS[kind])
    if unknown:
        allowed = sorted(set(REQUIRED_KEYS[kind]) | set(OPTIONAL_KEYS[kind]) | {"name"})
        raise ValueError(f"{label}: unknown keys {sorted(unknown)}; a {kind} group takes {allowed}")
    for j, p in enumerate(group["params"]):
        where = f"{label}, param {j}"
        if not isinstance(p, Tensor):
            raise TypeError(f"{where}: expected a torch.Tensor (nn.Parameter), got {type(p).__name__}")
        if not p.is_floating_point():
            raise TypeError(f"{where}: dtype {p.dtype} is not supported; parameters must be real floating point "
                            "(complex and integer tensors cannot be trained here)")
        if kind == "muon" and p.ndim < 2:
            raise ValueError(f"{where}: shape {tuple(p.shape)} has {p.ndim} dim(s); Muon needs matrices "
                             "(>= 2 dims; extra leading dims are a batch). Move it to an adamw group.")
        split = group.get("qkv_split") if kind == "muon" else None
        if split is not None and p.shape[-2] != sum(split):
            raise ValueError(f"{where}: shape {tuple(p.shape)} has {p.shape[-2]} rows, but qkv_split={tuple(split)} "
                             f"sums to {sum(split)}; put only fused QKV weights of that layout in this group")


def check_grad(i: int, group: dict, j: int, p: Tensor) -> None:
    g = p.grad
    where = f"{_group_label(i, group)}, param {j}"
    if g.is_sparse:
        raise ValueError(f"{where}: sparse gradients are not supported; use a dense nn.Embedding (sparse=False)")
    if g.is_complex():
        raise ValueError(f"{where}: complex gradients are not supported")
    if g.shape != p.shape:
        raise ValueError(f"{where}: grad shape {tuple(g.shape)} differs from param shape {tuple(p.shape)}")


def has_dtensors(params) -> bool:
    """Whether any of these params is a DTensor (FSDP2, tensor parallel): those go through sharded.py."""
    return any(isinstance(p, DTensor) for p in params)


def saved_params(param_groups: list[dict], state_dict: dict) -> dict:
    """Saved param id -> this optimizer's param, matched by position across the groups."""
    saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
    return dict(zip(saved_ids, (p for g in param_groups for p in g["params"])))


def buckets(params: list[Tensor]) -> list[list[int]]:
    """Indices of params grouped by (shape, dtype, device), in order of first appearance."""
    by_key = defaultdict(list)
    for i, p in enumerate(params):
        by_key[(tuple(p.shape), p.dtype, p.device)].append(i)
    return list(by_key.values())


# -----------------------------------------------------------------------------


class MuonAdamW(torch.optim.Optimizer):
    """Muon for matrices, AdamW for the rest, on one device. See the module docstring for the groups.

    Same-shape Muon params are stacked and updated by one fused call; a group may hold any mix of
    shapes. Params whose .grad is None are skipped (their state does not move). State is created on
    first use and kept per parameter, so state_dict() is the usual torch format, loadable at any
    world size by DistMuonAdamW.load_full_state_dict(). Muon buffers are views into one stacked
    buffer per shape, which is how the fused update avoids re-stacking its state every step.

    compile: run the update through torch.compile. None (default): on for CUDA params, off otherwise.
    """

    CPU_CHUNK = 4 * 1024 * 1024  # elements per fused kernel call on CPU (see _in_chunks)

    def __init__(self, param_groups, compile: bool | None = None):
        if isinstance(param_groups, Tensor) or not isinstance(param_groups, (list, tuple)):
            raise TypeError("MuonAdamW takes a list of param group dicts, each with kind='adamw' or kind='muon', "
                            "e.g. [dict(kind='muon', params=..., lr=..., momentum=..., ns_steps=..., beta2=..., "
                            "weight_decay=...), dict(kind='adamw', ...)]")
        if len(param_groups) == 0:
            raise ValueError("MuonAdamW got no param groups; pass at least one group")
        super().__init__(list(param_groups), defaults={})  # each group goes through add_param_group
        params = [p for g in self.param_groups for p in g["params"]]
        self.compiled = any(p.is_cuda for p in params) if compile is None else bool(compile)
        self._scalar_t = {}  # 0-D CPU tensors handed to compiled kernels
        self._stacks = {}  # tuple of param ids -> (momentum stack, second-moment stack or None)
        self._sharded_plans = {}  # DTensor Muon params: owners and blocks (sharded.py)

    def add_param_group(self, group: dict) -> None:
        """Check the group completely (structure, keys, values, params) before torch sees it."""
        i = len(self.param_groups)
        if isinstance(group, dict) and "params" in group:
            params = group["params"]
            group["params"] = [params] if isinstance(params, Tensor) else list(params)
        check_group(i, group)
        seen = {p: (gi, j) for gi, g in enumerate(self.param_groups) for j, p in enumerate(g["params"])}
        for j, p in enumerate(group["params"]):
            if p in seen:
                where = f"param group {seen[p][0]} (param {seen[p][1]})" if seen[p][0] != i else f"param {seen[p][1]}"
                raise ValueError(f"{_group_label(i, group)}, param {j} is already in {where}; each parameter "
                                 "must appear exactly once across all groups")
            seen[p] = (i, j)
        super().add_param_group(group)
        for key, default in OPTIONAL_KEYS[group["kind"]].items():  # state_dict() records what actually ran
            self.param_groups[-1].setdefault(key, default)

    # -- hyperparameters ------------------------------------------------------------------------
    def _scalars(self, **values):
        """Floats for eager kernels; refilled 0-D CPU tensors for compiled ones (no recompiles)."""
        if not self.compiled:
            return values
        out = {}
        for k, v in values.items():
            t = self._scalar_t.get(k)
            if t is None:
                t = self._scalar_t[k] = torch.tensor(0.0, dtype=torch.float32)
            t.fill_(v)
            out[k] = t
        return out

    # -- state ----------------------------------------------------------------------------------
    def _muon_stacks(self, group: dict, params: list[Tensor]):
        """Stacked (momentum, second moment) buffers for these same-shape params; per-param state views them."""
        key = tuple(id(p) for p in params)
        stacks = self._stacks.get(key)
        want_second = group["beta2"] is not None
        if stacks is not None and (stacks[1] is not None or not want_second):
            return stacks
        p0 = params[0]
        layout = muon_state_layout(p0)

        def stacked(name):
            shape, dtype = layout[name]
            parts = [self.state[p].get(name) for p in params]
            out = torch.zeros((len(params), *shape), dtype=dtype, device=p0.device)
            for i, t in enumerate(parts):
                if t is not None:
                    out[i].copy_(t)
            for i, p in enumerate(params):
                self.state[p][name] = out[i]
            return out

        momentum = stacked("momentum_buffer")
        second = stacked("second_momentum_buffer") if want_second else None
        self._stacks[key] = (momentum, second)
        return momentum, second

    def _muon_math(self, group: dict, params: list[Tensor], grads: Tensor, idx: list[int]) -> Tensor:
        """Update params[i] for i in idx (grads stacked in that order); return their new values, stacked.

        `params` is every param of one shape bucket that this process keeps state for; the caller writes
        the returned stack back (single device) or all_gathers it (distributed).
        """
        momentum, second = self._muon_stacks(group, params)
        everyone = len(idx) == len(params)
        if not everyone:
            sel = torch.tensor(idx, device=momentum.device)
            momentum, second = momentum[sel], (second[sel] if second is not None else None)
        stacked = torch.stack([params[i] for i in idx])
        coeffs, safety, eps = ns_coefficients(group["ns_coefficients"], group["ns_steps"])
        precision = resolve_ns_precision(group["ns_precision"], stacked.device)
        beta2 = group["beta2"] if group["beta2"] is not None else 0.0
        lr = group["lr"] * muon_lr_multiplier(stacked.shape, group["lr_scale"], group["extra_scale"])
        s = self._scalars(momentum=group["momentum"], lr=lr, wd=group["weight_decay"], beta2=beta2)
        self._in_chunks(_kernel(muon_update, self.compiled), (grads, stacked, momentum, second),
                        s["momentum"], s["lr"], s["wd"], s["beta2"], coeffs, safety, eps, NS_DTYPES[precision],
                        group["nesterov"], group["cautious_wd"], group["weight_decay_mode"] == "l2",
                        group["qkv_split"])
        if not everyone:  # index_select made copies: write the moved state back
            m_all, s_all = self._muon_stacks(group, params)
            m_all[sel] = momentum
            if second is not None:
                s_all[sel] = second
        return stacked

    def _adamw_math(self, group: dict, p: Tensor, grad: Tensor, state: dict) -> None:
        """AdamW on p (a whole param, or this rank's flat shard of one), creating state on first use."""
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)  # a DTensor for a DTensor param: sharded like it
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        tensors = (p, grad, state["exp_avg"], state["exp_avg_sq"])
        if isinstance(p, DTensor):  # elementwise: run on the local shards
            from nanomuon.sharded import local
            tensors = tuple(local(t, p) for t in tensors)
        if tensors[0].numel() == 0:
            return
        beta1, beta2 = group["betas"]
        s = self._scalars(step=state["step"], lr=group["lr"], beta1=beta1, beta2=beta2,
                          eps=group["eps"], wd=group["weight_decay"])
        if all(t.is_contiguous() for t in tensors):  # elementwise: flat views chunk exactly
            tensors = tuple(t.view(-1) for t in tensors)
        self._in_chunks(_kernel(adamw_update, self.compiled), tensors,
                        s["step"], s["lr"], s["beta1"], s["beta2"], s["eps"], s["wd"])

    def _in_chunks(self, kernel, tensors, *args) -> None:
        """kernel(*tensors, *args) in dim-0 chunks of <= CPU_CHUNK elements on CPU, in one call on GPUs.

        On CPU the update is compute- or bandwidth-bound either way, but temporaries above glibc's 32 MB mmap
        threshold are page-faulted afresh on every call (13% of a d12 Muon step on a 2-core VM); small chunks
        keep them in reusable heap memory. CUDA's caching allocator has no such cost.
        """
        lead = tensors[0]
        if lead.is_cuda or lead.ndim == 0 or lead.numel() <= self.CPU_CHUNK:
            return kernel(*tensors, *args)
        n, per = len(lead), max(1, self.CPU_CHUNK // lead[0].numel())
        for i in range(0, n, per):
            kernel(*(t[i:i + per] if t is not None else None for t in tensors), *args)

    def _check_step(self) -> None:
        """Every check that can fail, before any math runs, so a bad step changes nothing."""
        for i, group in enumerate(self.param_groups):
            check_group_values(i, group)
            for j, p in enumerate(group["params"]):
                if p.grad is not None:
                    check_grad(i, group, j, p)

    def load_state_dict(self, state_dict: dict) -> None:
        if "nanomuon_shard" in state_dict:
            shard = state_dict["nanomuon_shard"]
            raise ValueError(f"this optimizer state is one rank's shard (rank {shard['rank']} of "
                             f"{shard['world_size']}) from DistMuonAdamW; save it with full_state_dict() to load it "
                             "into MuonAdamW or at another world size")
        _check_state_shapes(self.param_groups, state_dict)
        self._torch_load(state_dict)

    # How params are laid out and sharded is this run's choice, not the checkpoint's.
    STRUCTURAL_KEYS = ("sharded_mode", "comm_precision", "qkv_split")

    def _torch_load(self, state_dict: dict) -> None:
        """torch's load_state_dict, then: this run's structural options kept (torch restores the saved
        group values), defaults for options newer than the checkpoint, and second moments back in fp32
        (torch casts state to the param dtype)."""
        keep = [{k: g[k] for k in self.STRUCTURAL_KEYS if k in g} for g in self.param_groups]
        torch.optim.Optimizer.load_state_dict(self, state_dict)
        for group, kept in zip(self.param_groups, keep):
            group.update(kept)
            for key, default in OPTIONAL_KEYS[group["kind"]].items():
                group.setdefault(key, default)
        by_id = saved_params(self.param_groups, state_dict)
        for pid, st in state_dict["state"].items():
            second = st.get("second_momentum_buffer")
            if second is not None:  # the saved fp32 values, not torch's copy cast to the param dtype
                p = by_id[pid]
                self.state[p]["second_momentum_buffer"] = second.to(p.device, torch.float32, copy=True)
        self._stacks.clear()  # per-param states are fresh tensors now; re-stack on next use

    def full_state_dict(self) -> dict:
        """The whole, world-size-independent state: state_dict() for plain params; with DTensor params
        (FSDP2, tensor parallel) their state is gathered, a collective to call on every rank. The same
        format as DistMuonAdamW.full_state_dict(), so checkpoints move between the three setups."""
        sd = self.state_dict()
        if not has_dtensors(p for g in self.param_groups for p in g["params"]):
            return sd
        from nanomuon.sharded import full_state
        return full_state(self, sd)

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load a full state (full_state_dict() of any of the optimizers, at any world size)."""
        if has_dtensors(p for g in self.param_groups for p in g["params"]):
            from nanomuon.sharded import shard_state
            _check_state_shapes(self.param_groups, state_dict)
            state_dict = shard_state(self, state_dict)
        self.load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_step()
        self._update()
        return loss

    def _update(self) -> None:
        """The single-device update; DistMuonAdamW replaces this with its communicating version."""
        for group in self.param_groups:
            params = group["params"]
            if group["kind"] == "adamw":
                for p in params:
                    if p.grad is not None:
                        self._adamw_math(group, p, p.grad, self.state[p])
                continue
            if has_dtensors(params):
                from nanomuon.sharded import muon_step_sharded
                muon_step_sharded(self, group)
            params = [p for p in params if not isinstance(p, DTensor)]
            for bucket in buckets(params):
                bucket_params = [params[i] for i in bucket]
                idx = [k for k, p in enumerate(bucket_params) if p.grad is not None]
                if not idx:
                    continue
                grads = torch.stack([bucket_params[k].grad for k in idx])
                updated = self._muon_math(group, bucket_params, grads, idx)
                torch._foreach_copy_([bucket_params[k] for k in idx], list(updated.unbind(0)))


def _check_state_shapes(param_groups: list[dict], state_dict: dict) -> None:
    """Refuse a checkpoint whose groups or state shapes do not fit these params, naming the first misfit."""
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or not isinstance(state_dict.get("state"), dict):
        raise ValueError("optimizer state_dict must have 'state' and 'param_groups'; the file is not an optimizer "
                         "checkpoint or is corrupt")
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"optimizer checkpoint has {len(saved_groups)} param groups but this optimizer has "
                         f"{len(param_groups)}; it was saved from a different model or optimizer setup")
    params = []
    for i, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]) or saved.get("kind") != group["kind"]:
            raise ValueError(f"optimizer checkpoint group {i} has {len(saved['params'])} {saved.get('kind')} params, "
                             f"this optimizer's has {len(group['params'])} {group['kind']} params; it was saved from a "
                             "different model or optimizer setup")
        params += [(i, j, p, group["kind"]) for j, p in enumerate(group["params"])]
    ids = [pid for g in saved_groups for pid in g["params"]]
    where = dict(zip(ids, params))
    for pid, st in state_dict["state"].items():
        if pid not in where:
            raise ValueError(f"optimizer checkpoint has state for param id {pid}, which no group lists; corrupt file?")
        i, j, p, kind = where[pid]
        names = ("exp_avg", "exp_avg_sq") if kind == "adamw" else ("momentum_buffer",)
        for name in names:
            if name in st and tuple(st[name].shape) != tuple(p.shape):
                raise ValueError(f"optimizer checkpoint: group {i} param {j} {name} has shape {tuple(st[name].shape)}, "
                                 f"the param has {tuple(p.shape)}; the checkpoint is from a different model size")


# -----------------------------------------------------------------------------


class DistMuonAdamW(MuonAdamW):
    """MuonAdamW for data parallel training under torch.distributed (gloo on CPU, nccl on GPU), ZeRO-2.

    Every rank holds the full params and computes full local grads; no DDP wrapper is needed, this
    optimizer averages the gradients. step() runs in three phases so communication overlaps compute:
      1. launch every gradient reduction asynchronously: AdamW params of >= 1024 elements are
         reduce_scattered as flat shards, smaller ones are all_reduced together in one buffer, and each
         Muon shape bucket is reduce_scattered so each matrix lands whole on its owner rank;
      2. group by group: wait for its reduction, update what this rank owns, launch the all_gather of
         the result;
      3. wait for the gathers and copy the Muon matrices back into the params.
    Each rank keeps AdamW state only for its flat shard of each large param, and Muon state only for
    the matrices it owns. Nothing needs to divide by the world size (shards and stacks are padded), and
    Muon matrices are assigned to owners by Newton-Schulz cost across all groups (assign_owners).

    state_dict() is this rank's shard; full_state_dict() gathers the world-size-independent form (the
    same format as MuonAdamW.state_dict()), which load_full_state_dict() loads at any world size.

    DTensor params (FSDP2, tensor parallel) may sit in the same groups, say FSDP2 blocks next to a
    replicated embedding: their grads arrive reduced, so they skip the reductions above and are
    updated sharded, as MuonAdamW does (sharded.py).
    """

    SMALL = 1024  # params with fewer elements are all_reduced and updated redundantly on every rank

    def __init__(self, param_groups, compile: bool | None = None, process_group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("DistMuonAdamW needs an initialized torch.distributed process group: launch with "
                             "torchrun and call torch.distributed.init_process_group() first, or use MuonAdamW "
                             "on a single device")
        super().__init__(param_groups, compile=compile)
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if not isinstance(p, DTensor) and not p.is_contiguous():
                    raise ValueError(f"{_group_label(i, group)}, param {j}: DistMuonAdamW shards params as flat "
                                     "memory and needs contiguous params; use p.data = p.data.contiguous()")
        self.pg = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        # gloo in older torch lacks ReduceOp.AVG; sum there and scale the (smaller) reduced shard instead.
        self._use_avg = dist.get_backend(process_group) == "nccl"
        self._plan = None

    # -- communication helpers -------------------------------------------------------------------
    def _reduce_scatter(self, out, inp):
        op = dist.ReduceOp.AVG if self._use_avg else dist.ReduceOp.SUM
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return fn(out, inp, op=op, group=self.pg, async_op=True)

    def _all_gather(self, out, inp):
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return fn(out, inp, group=self.pg, async_op=True)

    def _all_reduce(self, t, op=None):
        if op is None:
            op = dist.ReduceOp.AVG if self._use_avg else dist.ReduceOp.SUM
        return dist.all_reduce(t, op=op, group=self.pg, async_op=True)

    def _finish_mean(self, t: Tensor) -> None:
        if not self._use_avg:
            t.mul_(1.0 / self.world_size)

    # -- the static plan: who owns what ----------------------------------------------------------
    def _get_plan(self) -> dict:
        """Shard sizes and Muon owners, computed from shapes alone so every rank agrees."""
        key = tuple(tuple(id(p) for p in g["params"]) for g in self.param_groups)
        if self._plan is not None and self._plan["key"] == key:
            return self._plan
        muon_buckets = []
        for gi, group in enumerate(self.param_groups):
            if group["kind"] != "muon":
                continue
            plain = [p for p in group["params"] if not isinstance(p, DTensor)]
            for bucket in buckets(plain):
                params = [plain[i] for i in bucket]
                muon_buckets.append(dict(group=gi, params=params, cost=ns_flops(params[0].shape, group["ns_steps"])))
        plan = assign_owners([(len(b["params"]), b["cost"]) for b in muon_buckets], self.world_size)
        for b, slots in zip(muon_buckets, plan):
            b["slots"] = slots  # slots[r]: indices into b["params"] that rank r owns
            b["chunk"] = max(len(s) for s in slots)
            b["mine"] = slots[self.rank]
        self._plan = dict(key=key, muon=muon_buckets)
        return self._plan

    def _shard_range(self, numel: int) -> tuple[int, int, int]:
        shard = -(-numel // self.world_size)
        lo = min(numel, self.rank * shard)
        return shard, lo, min(numel, lo + shard)

    def _active(self) -> dict:
        """Params whose grad exists on any rank (a missing grad elsewhere counts as zeros, as in DDP)."""
        params = [p for g in self.param_groups for p in g["params"]]
        device = params[0].device
        flags = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
        self._all_reduce(flags, op=dist.ReduceOp.MAX).wait()
        return {p: bool(f) for p, f in zip(params, flags.tolist())}

    # -- step -------------------------------------------------------------------------------------
    def _update(self) -> None:
        plan = self._get_plan()
        active = self._active()
        N = self.world_size

        def grad_or_zeros(p):
            return p.grad if p.grad is not None else torch.zeros_like(p)

        # Phase 1: launch every reduction.
        small_by_dtype = defaultdict(list)
        for g in self.param_groups:
            for p in g["params"]:
                if g["kind"] == "adamw" and active[p] and p.numel() < self.SMALL and not isinstance(p, DTensor):
                    small_by_dtype[p.dtype].append(p)
        small = []  # (params, flat buffer, work): one coalesced all_reduce per dtype
        for ps in small_by_dtype.values():
            buf = torch.cat([grad_or_zeros(p).reshape(-1) for p in ps])
            small.append((ps, buf, self._all_reduce(buf)))
        large = {}  # param -> (work, grad shard, padded flat buffer or None)
        for g in self.param_groups:
            if g["kind"] != "adamw":
                continue
            for p in g["params"]:
                if not active[p] or p.numel() < self.SMALL or isinstance(p, DTensor):
                    continue
                shard, _, _ = self._shard_range(p.numel())
                flat = grad_or_zeros(p).reshape(-1)
                if shard * N != p.numel():
                    flat = torch.cat([flat, flat.new_zeros(shard * N - p.numel())])
                out = flat.new_empty(shard)
                large[p] = (self._reduce_scatter(out, flat), out, flat)
        muon = {}  # bucket index -> (work, my reduced chunk, send buffer)
        for bi, b in enumerate(plan["muon"]):
            if not any(active[p] for p in b["params"]):
                continue
            p0 = b["params"][0]
            zeros = None
            parts = []
            for slots in b["slots"]:
                parts += [grad_or_zeros(b["params"][i]) for i in slots]
                if len(slots) < b["chunk"]:
                    zeros = zeros if zeros is not None else torch.zeros_like(p0)
                    parts += [zeros] * (b["chunk"] - len(slots))
            send = torch.stack(parts)
            chunk = send.new_empty((b["chunk"], *p0.shape))
            muon[bi] = (self._reduce_scatter(chunk, send), chunk, send)

        # Phase 2: per group, wait, update what this rank owns, launch the gather.
        gathers = []
        small_grads = None
        for gi, group in enumerate(self.param_groups):
            if group["kind"] == "adamw":
                for p in group["params"]:
                    if not active[p]:
                        continue
                    if isinstance(p, DTensor):  # already reduced and sharded: update the local shard
                        self._adamw_math(group, p, p.grad, self.state[p])
                        continue
                    if p.numel() < self.SMALL:
                        if small_grads is None:
                            small_grads = {}
                            for ps, buf, work in small:
                                work.wait()
                                self._finish_mean(buf)
                                small_grads.update(zip(ps, torch.split(buf, [q.numel() for q in ps])))
                        self._adamw_math(group, p, small_grads[p].view_as(p), self.state[p])
                        continue
                    work, grad_shard, flat = large[p]
                    work.wait()
                    self._finish_mean(grad_shard)
                    shard, lo, hi = self._shard_range(p.numel())
                    p_flat = p.view(-1)
                    self._adamw_math(group, p_flat[lo:hi], grad_shard[:hi - lo], self.state[p])
                    if shard * N == p.numel():  # gather straight into the param; our shard is already in place
                        gathers.append((self._all_gather(p_flat, p_flat[lo:hi]), None))
                    else:
                        mine = flat[self.rank * shard:(self.rank + 1) * shard]
                        mine[:hi - lo].copy_(p_flat[lo:hi])
                        gathers.append((self._all_gather(flat, mine), (p, flat)))
                continue
            for bi, b in enumerate(plan["muon"]):
                if b["group"] != gi or bi not in muon:
                    continue
                work, chunk, send = muon[bi]
                work.wait()
                mine = [b["params"][i] for i in b["mine"]]
                idx = [k for k, p in enumerate(mine) if active[p]]
                if idx:
                    self._finish_mean(chunk[:len(mine)])
                    grads = chunk[:len(mine)] if len(idx) == len(mine) else chunk[idx]
                    # Slots of params without grads (and padding) carry junk; phase 3 never copies them.
                    chunk[idx] = self._muon_math(group, mine, grads, idx)
                gathers.append((self._all_gather(send, chunk), (b, send)))
            if has_dtensors(group["params"]):  # FSDP2 / TP params: sharded.py
                from nanomuon.sharded import muon_step_sharded
                muon_step_sharded(self, group)

        # Phase 3: wait for the gathers and write results into the params.
        for work, target in gathers:
            work.wait()
            if target is None:
                continue
            owner, buf = target
            if isinstance(owner, Tensor):  # padded AdamW param
                owner.view(-1).copy_(buf[:owner.numel()])
                continue
            b = owner
            params, views = [], []
            for r, slots in enumerate(b["slots"]):
                for j, i in enumerate(slots):
                    if active[b["params"][i]]:
                        params.append(b["params"][i])
                        views.append(buf[r * b["chunk"] + j])
            if params:
                torch._foreach_copy_(params, views)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["nanomuon_shard"] = dict(rank=self.rank, world_size=self.world_size)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load this rank's own shard, saved by state_dict() at the same rank and world size."""
        shard = state_dict.get("nanomuon_shard")
        if shard is None:
            raise ValueError("this optimizer state is not a DistMuonAdamW shard; load a full (world-size-independent) "
                             "state with load_full_state_dict()")
        if shard != dict(rank=self.rank, world_size=self.world_size):
            raise ValueError(f"this shard was saved by rank {shard['rank']} of {shard['world_size']}, but this is rank "
                             f"{self.rank} of {self.world_size}; to change world size, save with full_state_dict() "
                             "and load with load_full_state_dict()")
        state_dict = {k: v for k, v in state_dict.items() if k != "nanomuon_shard"}
        self._torch_load(state_dict)

    def full_state_dict(self) -> dict:
        """The whole optimizer state, gathered on every rank, in MuonAdamW.state_dict() format.

        A collective: call it on all ranks (then save from one). Loadable by load_full_state_dict() at
        any world size, and by MuonAdamW.load_state_dict().
        """
        plan = self._get_plan()
        N = self.world_size
        params = [p for g in self.param_groups for p in g["params"]]
        kinds = [g["kind"] for g in self.param_groups for _ in g["params"]]
        device = params[0].device
        has = torch.tensor([bool(self.state.get(p)) for p in params], dtype=torch.int32, device=device)
        self._all_reduce(has, op=dist.ReduceOp.MAX).wait()
        has = dict(zip(params, has.tolist()))
        full = {p: {} for p in params if has[p]}
        for p, kind in zip(params, kinds):
            if isinstance(p, DTensor) and has[p]:  # sharded.full_state gathers these below
                full[p] = dict(self.state[p])
                continue
            if kind != "adamw" or not has[p]:
                continue
            st = self.state[p]
            if p.numel() < self.SMALL:
                full[p] = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in st.items()}
                continue
            shard, lo, hi = self._shard_range(p.numel())
            full[p]["step"] = st["step"]
            for name in ("exp_avg", "exp_avg_sq"):
                mine = p.new_zeros(shard)
                mine[:hi - lo].copy_(st[name])
                out = p.new_empty(shard * N)
                self._all_gather(out, mine).wait()
                full[p][name] = out[:p.numel()].view_as(p).clone()
        for b in plan["muon"]:
            if not any(has[p] for p in b["params"]):
                continue
            group = self.param_groups[b["group"]]
            mine = [b["params"][i] for i in b["mine"]]
            layout = muon_state_layout(b["params"][0])  # every rank agrees on it, owner of state or not
            names = ["momentum_buffer"] + (["second_momentum_buffer"] if group["beta2"] is not None else [])
            for name in names:
                shape, dtype = layout[name]
                chunk = torch.zeros((b["chunk"], *shape), dtype=dtype, device=device)
                for k, p in enumerate(mine):
                    if name in self.state[p]:
                        chunk[k].copy_(self.state[p][name])
                out = chunk.new_empty((b["chunk"] * N, *shape))
                self._all_gather(out, chunk).wait()
                for r, slots in enumerate(b["slots"]):
                    for j, i in enumerate(slots):
                        if has[b["params"][i]]:
                            full[b["params"][i]][name] = out[r * b["chunk"] + j].clone()
        sd = torch.optim.Optimizer.state_dict(self)
        index = {id(p): k for k, p in enumerate(params)}
        sd["state"] = {index[id(p)]: st for p, st in full.items()}
        if has_dtensors(params):
            from nanomuon.sharded import full_state
            sd = full_state(self, sd)
        return sd

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load a full state (from full_state_dict() or MuonAdamW.state_dict()) at this world size."""
        if "nanomuon_shard" in state_dict:
            raise ValueError("this is one rank's shard, not a full optimizer state; save with full_state_dict()")
        _check_state_shapes(self.param_groups, state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        if has_dtensors(params):  # their entries become this rank's DTensor shards
            from nanomuon.sharded import shard_state
            state_dict = shard_state(self, state_dict)
        plan = self._get_plan()
        kinds = {p: g["kind"] for g in self.param_groups for p in g["params"]}
        owned = {p for b in plan["muon"] for i in b["mine"] for p in [b["params"][i]]}
        by_id = saved_params(self.param_groups, state_dict)
        mine = {}
        for pid, st in state_dict["state"].items():
            p = by_id[pid]
            if isinstance(p, DTensor):
                mine[pid] = st
                continue
            if kinds[p] == "muon":
                if p in owned:
                    mine[pid] = dict(st)
                continue
            if p.numel() < self.SMALL:
                mine[pid] = dict(st)
                continue
            _, lo, hi = self._shard_range(p.numel())
            mine[pid] = {k: (v.reshape(-1)[lo:hi].clone() if isinstance(v, Tensor) and v.dim() > 0 else v)
                         for k, v in st.items()}
        sharded = {"state": mine, "param_groups": state_dict["param_groups"]}
        self._torch_load(sharded)
