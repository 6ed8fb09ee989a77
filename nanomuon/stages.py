"""
Everything a forker edits to try an idea on the Muon update, and what turns a group into a plan.

muon.py runs the update; this file says what it may run. In reading order: the stage contract
(Stage, StateSpec, Flags, Option); the alternative stages, each with its paper; the four
registries a muon group names its stages from (precondition, orthogonalizer, post_process,
apply); the values a few options take (NS_DTYPES, NS_METHODS, LR_SCALES, SHARDED_MODES);
MUON_OPTIONS, every optional key of a muon group declared once (default, check, meaning, and the
stage that reads it), and GROUP_KEYS, each kind's other keys, whose rows say what the optimizer's
lists of keys hold; and the resolver, muon_plan, which resolves a checked group once per matrix
shape into a muon.MuonPlan with the state it keeps. Elsewhere: the coefficient sets
(coefficients.py) and the cost model that decides Gram Newton-Schulz and which rank owns a
matrix (owners.py), which a plan and a Stage's cost feed. To add a stage: write f(x, ctx),
register it, declare its options in MUON_OPTIONS (docs/optimizer.md, "Stages").
"""

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from nanomuon.coefficients import ns_coefficients
from nanomuon.hardware import bf16_matmuls_fast
from nanomuon.muon import (
    Diagonal,
    Layout,
    LogicalInit,
    MuonPlan,
    NewtonSchulz,
    StageContext,
    StateSlot,
    apply_decoupled,
    block_shapes,
    fp32,
    frobenius,
    muon_hparams,
    newton_schulz,
    pairs,
    sq_sum,
    variance_reduction,
    whole_shape,
)
from nanomuon.owners import gram_pays


class _NoDefault:
    """The default of a key never filled in: one a group must give, or bookkeeping."""

    def __repr__(self):
        return "NO_DEFAULT"


NO_DEFAULT = _NoDefault()


class Option(NamedTuple):
    """One key of a param group, every fact of it in one row: an option of its kind
    (MUON_OPTIONS, ADAMW_OPTIONS) or one of the kind's own keys (GROUP_KEYS). The lists the
    optimizer asks (what a group must give, what schedules edit, what a load keeps, what the
    math reads) are derived from these rows (keys_with), never written again."""
    default: Any  # filled in where a group lacks the key; NO_DEFAULT: never filled in
    check: Callable | None  # check(value): None or what the value must be; None: checked elsewhere
    doc: str  # its meaning in one line (docs/optimizer.md's tables)
    stage: tuple | None = None  # (key, name) of the one stage that reads it; None: the group's own
    required: bool = False  # a group of its kind must give it: REQUIRED_KEYS, Kind.required
    scheduled: bool = False  # schedules set or edit it between steps: checked at every step,
    #                          it never resolves the group again (optim.NUMBERS)
    structural: bool = False  # this run's layout and sharding: a loaded checkpoint's value gives
    #                           way to this run's (MuonAdamW.STRUCTURAL_KEYS)
    passive: bool = False  # bookkeeping other code adds (a label, a schedule's start): PASSIVE_KEYS
    sharded_only: bool = False  # only sharded.py's communication reads it, never the update
    legacy: bool = False  # an older checkpoint's key, read as stage names (fill_defaults)


def one_of(*choices):
    return lambda v: None if any(v is c or (type(v) is type(c) and v == c) for c in choices) else \
        f"must be one of {list(choices)}"


def a_bool(v):
    return None if isinstance(v, bool) else "must be True or False"


def a_number(v, hi=float("inf")):
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < hi
    return None if ok else f"must be a finite number >= 0{f' and < {hi}' if hi < 1e308 else ''}"


def a_count(v, hi=10 ** 9):  # a billion steps: a year of the CPU miniature's, past any real run
    ok = isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= hi
    return None if ok else f"must be an int >= 1 and <= {hi:,}"


def an_interval(v):
    """Steps (an int >= 1) or a fraction of the run's horizon (0 < f < 1): interval_steps."""
    ok = a_count(v) is None or (isinstance(v, float) and 0 < v < 1)
    return None if ok else ("must be steps (an int >= 1) or a fraction of the run's horizon (a "
                            "float between 0 and 1), at most 1,000,000,000 steps")


def a_pair_of_betas(v):
    ok = isinstance(v, (tuple, list)) and len(v) == 2 and all(a_number(b, 1.0) is None for b in v)
    return None if ok else "must be a pair of numbers in [0, 1)"


def interval_steps(value, horizon: int | None) -> int:
    """an_interval's value in steps: an int as given, a fraction of the horizon rounded, >= 1."""
    return value if isinstance(value, int) else max(1, round(value * horizon))


class StateSpec(NamedTuple):
    """Per-matrix state a stage keeps: shape(rows, cols) of one matrix (logical, or stored for a
    non-logical apply stage); dtype: at least this, None for the param's; init: a number, a
    Diagonal, or (apply stages) f(W); kept(group): whether this group keeps it (None: always)."""
    shape: Callable
    dtype: torch.dtype | None = torch.float32
    init: float | Diagonal | Callable = 0.0
    kept: Callable | None = None
    nonnegative: bool = False  # a second moment, a count: a loaded negative value is refused


class Flags(NamedTuple):
    """A stage's yes-or-no facts (most stages keep the defaults)."""
    on_slices: bool = False  # right on sharded_mode='distributed' slices (sums via sq_sum, summed)
    eager: bool = False  # it branches on state values: its group runs uncompiled
    owns_momentum: bool = False  # a precondition keeping its own momentum: its input is the grad
    logical: bool = False  # an apply stage on logical matrices: direction stages may share state
    weight_decay: bool = True  # an apply stage that applies the group's weight_decay


class Stage(NamedTuple):
    """A registry entry. fn(x, ctx) returns the new x (an apply stage updates ctx.params); its
    options are the MUON_OPTIONS entries that name it."""
    fn: Callable
    state: dict = {}  # name -> StateSpec: the state it keeps
    reads: tuple = ()  # names of state another stage of the group keeps
    check: Callable | None = None  # check(group): None, or what is wrong with the group
    cost: Callable | None = None  # cost(rows, cols, group): FLOPs per matrix and step
    needs: tuple = ()  # what it reads beyond its input: 'grad', 'weight' or 'inputs'
    flags: Flags = Flags()
    method: str | None = None  # an orthogonalizer's Newton-Schulz: an NS_METHODS entry, or None


# The alternative stages, each with its source; the defaults a step runs are muon.py's.


def equilibrate(g: Tensor, ctx: StageContext, mode: str) -> Tensor:
    """MuonEq (Chang et al. 2026, arXiv 2603.28254): diag(r) G diag(c) with r_i = (sum_j G_ij^2 +
    1e-8)^-1/2 and c likewise, both from the same G. A new tensor: g may be the momentum buffer."""
    scales = [sq_sum(g, (-1,) if part == "row" else (-2,)).add_(1e-8).rsqrt_().to(g.dtype)
              for part in mode.split("_")]
    return math.prod(scales, start=g)


def equilibrate_to_mean(g: Tensor, ctx: StageContext) -> Tensor:
    """MuonEq as nanochat runs it: every row scaled to the mean row norm ||G||_F / sqrt(rows)
    (row norms floored at 1e-6), the scale Polar Express's eps was tuned for. A new tensor."""
    target = sq_sum(g, (-2, -1)).sqrt() / whole_shape(g)[-2] ** 0.5
    return g * (target / sq_sum(g, (-1,)).sqrt().clamp_min(1e-6)).to(g.dtype)


def soap(g: Tensor, ctx: StageContext) -> Tensor:
    """SOAP-Muon (modded-nanogpt record 14; arXiv 2409.11321): Adam in the eigenbases of the
    gradient's covariances, P = Q_L^T U Q_R, V <- b V + (1 - b) P^2, U' = Q_L (P / (sqrt(V) +
    1e-8)) Q_R^T at ||U||_F (the first step passes U); then covariances and bases update: by eigh
    (descending) where a matrix has none yet; every precondition_frequency steps, columns sorted
    by Rayleigh quotient (V permuted alike), then Q <- qr(C Q). Per matrix."""
    st, beta = ctx.state, ctx.group["soap_beta"]
    step = st["soap_step"][..., None, None]  # a view: counted up at the end
    frequency = interval_steps(ctx.group["precondition_frequency"], ctx.horizon)
    first, started = step == 0, step > 0
    due = started & (step % frequency == 0)
    x = fp32(g)
    P = st["soap_row_basis"].mT @ x @ st["soap_col_basis"]
    V = st["soap_second_moment"]
    V.copy_(torch.where(started, V * beta + (1 - beta) * P.square(), V))
    pre = st["soap_row_basis"] @ (P / (V.sqrt() + 1e-8)) @ st["soap_col_basis"].mT
    out = torch.where(started, pre * (frobenius(x) / frobenius(pre).clamp_min(1e-8)), x)
    G = fp32(ctx.grad)
    st["soap_row_cov"].lerp_(G @ G.mT, 1 - beta)
    st["soap_col_cov"].lerp_(G.mT @ G, 1 - beta)
    for side, dim in (("row", -2), ("col", -1)):
        cov, Q = st[f"soap_{side}_cov"], st[f"soap_{side}_basis"]
        if first.any():
            eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
            Q.copy_(torch.where(first, torch.linalg.eigh(cov + 1e-30 * eye)[1].flip(-1), Q))
        if due.any():
            order = torch.diagonal(Q.mT @ cov @ Q, dim1=-2, dim2=-1).argsort(-1, descending=True)
            index = (order.unsqueeze(-1) if dim == -2 else order.unsqueeze(-2)).expand_as(V)
            V.copy_(torch.where(due, V.gather(dim, index), V))
            sorted_Q = Q.gather(-1, order.unsqueeze(-2).expand_as(Q))
            Q.copy_(torch.where(due, torch.linalg.qr(cov @ sorted_Q)[0], Q))
    st["soap_step"].add_(1)
    return out.to(g.dtype)


def _soap_cost(rows: int, cols: int, group: dict) -> float:
    """Rotations and covariances per step; a power iteration and QR per side per refresh."""
    per_step = 6 * rows * cols * (rows + cols)
    every = interval_steps(group["precondition_frequency"], group.get("horizon"))
    return per_step + 4 * (rows ** 3 + cols ** 3) / every


def input_block(rows: int, cols: int) -> int:
    """Input covariance blocks: the output width where inputs are a multiple wider, else whole."""
    return rows if cols > rows and cols % rows == 0 else cols


def input_shape(rows: int, cols: int) -> tuple[int, int, int]:
    b = input_block(rows, cols)
    return cols // b, b, b


def input_covariance(x: Tensor, rows: int, cols: int) -> Tensor:
    """x^T x / tokens of a matrix's inputs x (..., cols), in fp32, shaped input_shape."""
    blocks, b, _ = input_shape(rows, cols)
    x = x.detach().reshape(-1, blocks, b).float().transpose(0, 1)  # (blocks, tokens, b)
    with torch.autocast(x.device.type, enabled=False):
        return x.mT @ x / x.size(1)


def newton(grad: Tensor, ctx: StageContext) -> Tensor:
    """Newton-Muon (arXiv 2604.01472; modded-nanogpt record 15), owning the momentum: the gradient
    times K, blockwise, then Muon's momentum. When inputs come, C <- lerp(C, inputs, newton_lerp),
    K = (C + r I)^-1 by Cholesky (I where it fails), r = newton_damping trace(C) / b + 1e-8."""
    st, opts = ctx.state, ctx.group
    cov, inv, m = st["newton_cov"], st["newton_inv"], st["newton_momentum"]
    if ctx.inputs is not None:
        cov.lerp_(ctx.inputs.to(cov.dtype), opts["newton_lerp"])
        eye = torch.eye(cov.size(-1), dtype=cov.dtype, device=cov.device)
        trace = cov.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True).unsqueeze(-1)
        damped = cov + (trace / cov.size(-1) * opts["newton_damping"] + 1e-8) * eye
        L, info = torch.linalg.cholesky_ex(damped)
        inv.copy_(torch.where((info == 0)[..., None, None], torch.cholesky_inverse(L), eye))
    blocks = fp32(grad).unflatten(-1, inv.shape[-3:-2] + inv.shape[-1:]).transpose(-3, -2)
    pre = (blocks @ inv).transpose(-3, -2).flatten(-2).to(m.dtype)
    m.lerp_(pre, 1 - ctx.h.momentum)
    return pre.lerp_(m, ctx.h.momentum) if opts["nesterov"] else m


def _newton_check(group: dict) -> str | None:
    if muon_layout(group) is not None:
        return ("preconditions whole matrices by their inputs: not split or transposed "
                "(per_head, split, qkv_split, transposed)")


def normalize(u: Tensor, ctx: StageContext, mode: str) -> Tensor:
    """Muon+ (Zhang et al. 2026, arXiv 2602.21545), in place: columns or rows to unit norm, in the
    order named. 'fro' (nanochat's): the matrix to Frobenius norm sqrt(min(rows, cols)), U V^T's."""
    if mode == "fro":
        m, n = whole_shape(u)[-2:]
        return u.mul_((min(m, n) ** 0.5 / sq_sum(u, (-2, -1)).sqrt().clamp_min(1e-6)).to(u.dtype))
    for part in mode.split("_"):
        u = u.mul_(sq_sum(u, (-2,) if part == "col" else (-1,)).add_(1e-7).rsqrt_().to(u.dtype))
    return u


def uw_floor(u: Tensor, ctx: StageContext) -> Tensor:
    """The u/w floor (modded-nanogpt record 9): ||u||_F lifted to at least uw_floor ||W||_F."""
    ratio = ctx.group["uw_floor"] * frobenius(ctx.weight).clamp_min(1e-8)
    return u.mul_((ratio / frobenius(u).clamp_min(1e-8)).clamp_min(1.0).to(u.dtype))


def op_norm_estimate(G: Tensor, iterations: int = 5, eps: float = 1e-10) -> Tensor:
    """Each matrix's largest singular value by power iteration from the ones vector (fp32)."""
    X = fp32(G)
    v = X.new_ones(*X.shape[:-2], X.shape[-1], 1)
    v = v / v.norm(dim=-2, keepdim=True)
    for _ in range(iterations):
        w = X @ v
        w = w / w.norm(dim=-2, keepdim=True).clamp_min(eps)
        v = X.mT @ w
        v = v / v.norm(dim=-2, keepdim=True).clamp_min(eps)
    return (X @ v).norm(dim=(-2, -1), keepdim=True).clamp_min(eps)


def contra(u: Tensor, ctx: StageContext) -> Tensor:
    """ContraMuon (nilin/contra-muon; modded-nanogpt record 11): subtract contra / 2 times the
    orthogonalizer's input at unit operator norm, then restore u's Frobenius norm."""
    G = ctx.ortho_input
    norm = frobenius(u)
    u = u.sub_((ctx.group["contra"] / 2 * fp32(G) / op_norm_estimate(G)).to(u.dtype))
    return u.mul_((norm / frobenius(u).clamp_min(1e-10)).to(u.dtype))


def scion_lmo(g: Tensor, ctx: StageContext, norm: str) -> Tensor:
    """Scion's LMOs (Pethick et al. 2025, arXiv 2502.07529) but Spectral (Newton-Schulz at
    lr_scale 'unit_rms'), as their defaults scale them: 'sign', sign(G) / cols; 'col_norm', each
    column to RMS 1 (an embedding's, logically (dim, vocab): each token's); 'row_norm', each row
    to norm 1 / sqrt(cols). Their eps is on the norm. Use lr_scale 'one'. A new tensor."""
    cols = whole_shape(g)[-1]
    if norm == "sign":
        return torch.sign(g) / cols
    if norm == "col_norm":  # each column's RMS, ||col|| / sqrt(rows)
        scale = (sq_sum(g, (-2,)) / whole_shape(g)[-2]).sqrt()
    else:  # each row's norm times sqrt(cols)
        scale = (sq_sum(g, (-1,)) * cols).sqrt()
    return fp32(g) / (scale + 1e-8)


def hyperball_radius(w: Tensor) -> Tensor:
    """MuonH's radius: each matrix's initial Frobenius norm, sqrt(rows) for one initialized at 0."""
    norm = frobenius(w)
    return torch.where(norm > 0, norm, torch.full_like(norm, w.shape[-2] ** 0.5))


def hyperball(u: Tensor, ctx: StageContext) -> None:
    """MuonH (modded-nanogpt record 5; arXiv 2606.16899): W' = W - lr r u / ||u||_F, then
    W <- W' r / ||W'||_F, so each matrix stays on its sphere (hyperball_radius). No decay."""
    for ui, p, r in pairs(u, ctx.params, ctx.state["hyperball_radius"]):
        p.sub_((fp32(ui) * (ctx.h.lr * r / frobenius(ui).clamp_min(1e-10))).to(p.dtype))
        p.mul_((r / frobenius(p).clamp_min(1e-10)).to(p.dtype))


def muown_row_norms(w: Tensor) -> Tensor:
    """Muown's starting gain and ||v||: row norms (fp32), 1 for a zero row (nanomuon's init's)."""
    norm = torch.linalg.vector_norm(fp32(w), dim=-1, keepdim=True)
    return torch.where(norm > 1e-12, norm, torch.ones_like(norm))


def muown_direction(grad: Tensor, ctx: StageContext) -> Tensor:
    """Muown (arXiv 2605.10797; modded-nanogpt record 23), owning the momentum: rows W = g v / ||v||
    with unit rows u = W / g. The gain's gradient sum_j dL/dW_ij u_ij waits for muown_apply; the
    direction's, (g / ||v||) (dL/dW - u dL/dg), takes Muon's momentum and goes on."""
    st = ctx.state
    gain, v_norm, m = st["muown_gain"], st["muown_v_norm"], st["muown_momentum"]
    u, G = fp32(ctx.weight) / gain, fp32(grad)
    grad_gain = (G * u).sum(dim=-1, keepdim=True)
    st["muown_gain_grad"].copy_(grad_gain)
    grad_v = ((gain / v_norm) * (G - u * grad_gain)).to(m.dtype)
    m.lerp_(grad_v, 1 - ctx.h.momentum)
    return grad_v.lerp_(m, ctx.h.momentum) if ctx.group["nesterov"] else m


def muown_apply(u: Tensor, ctx: StageContext) -> None:
    """Muown's apply stage, on logical matrices: v steps along u by ctx.h.lr, the gain by Adam
    (muown_betas, eps 1e-8, lr x muown_gain_lr), W = g v / ||v||; then ||v|| goes from its start
    to muown_v_norm_target as ((step - 1) / (horizon - 1))^muown_v_norm_power. No weight decay."""
    st, (beta1, beta2), W = ctx.state, ctx.group["muown_betas"], ctx.params
    gain, v_norm = st["muown_gain"], st["muown_v_norm"]
    v = fp32(W) / gain * v_norm - fp32(u) * ctx.h.lr
    grad_gain, m, s2 = st["muown_gain_grad"], st["muown_gain_exp_avg"], st["muown_gain_exp_avg_sq"]
    m.lerp_(grad_gain, 1 - beta1)
    s2.mul_(beta2).addcmul_(grad_gain, grad_gain, value=1 - beta2)
    bias1, bias2 = 1 - beta1 ** ctx.step, 1 - beta2 ** ctx.step
    lr = ctx.h.group_lr * ctx.group["muown_gain_lr"]
    gain.sub_(lr * (m / bias1) / ((s2 / bias2).sqrt() + 1e-8))
    norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True).clamp_min(1e-12)
    W.copy_((gain * v / norm).to(W.dtype))
    target = ctx.group["muown_v_norm_target"]
    if target is not None:
        span = ctx.horizon - 1
        t = torch.as_tensor(1.0 if span < 1 else (ctx.step - 1) / span, dtype=torch.float64)
        t = t.clamp(0, 1) ** ctx.group["muown_v_norm_power"]
        start = st["muown_v_norm_start"]
        v_norm.copy_(start + (target - start) * t.to(start.dtype))


def _muown_check(group: dict) -> str | None:
    if group["muown_v_norm_target"] is not None and group["horizon"] is None:
        return ("Muown's v-norm schedule needs the run's length: set the group's horizon (steps; "
                "GPT.setup_optimizer(horizon=), base_train sets it), or muown_v_norm_target=None")


def _row_spec(init=0.0, nonnegative=False):
    return StateSpec(lambda rows, cols: (rows, 1), init=init, nonnegative=nonnegative)


# The registries a group names its stages from (docs/optimizer.md, "Stages").


SLICES = Flags(on_slices=True)  # a stage whose sums go through sq_sum or summed
PRECONDITIONERS = {
    **{f"equilibrate_{mode}": Stage(functools.partial(equilibrate, mode=mode), flags=SLICES)
       for mode in ("row", "col", "row_col")},
    "equilibrate_row_mean": Stage(equilibrate_to_mean, flags=SLICES),
    "soap": Stage(soap, state=dict(
        soap_row_cov=StateSpec(lambda rows, cols: (rows, rows)),
        soap_col_cov=StateSpec(lambda rows, cols: (cols, cols)),
        soap_row_basis=StateSpec(lambda rows, cols: (rows, rows)),
        soap_col_basis=StateSpec(lambda rows, cols: (cols, cols)),
        soap_second_moment=StateSpec(lambda rows, cols: (rows, cols), nonnegative=True),
        soap_step=StateSpec(lambda rows, cols: (), nonnegative=True)),
        cost=_soap_cost, needs=("grad",), flags=Flags(eager=True)),
    "newton": Stage(newton, state=dict(
        newton_momentum=StateSpec(lambda rows, cols: (rows, cols), dtype=None),
        newton_cov=StateSpec(input_shape, init=Diagonal(0.001)),
        newton_inv=StateSpec(input_shape, init=Diagonal(1.0))),
        check=_newton_check, needs=("inputs",), flags=Flags(eager=True, owns_momentum=True)),
    "muown": Stage(muown_direction, state=dict(
        muown_momentum=StateSpec(lambda rows, cols: (rows, cols), dtype=None),
        muown_gain_grad=_row_spec()), reads=("muown_gain", "muown_v_norm"), needs=("weight",),
        flags=Flags(owns_momentum=True)),
}
ORTHOGONALIZERS = {name: Stage(functools.partial(newton_schulz, method=method), flags=SLICES,
                               method=method)
                   for name, method in (("auto", "auto"), ("newton_schulz", "standard"),
                                        ("gram_newton_schulz", "gram"))}
ORTHOGONALIZERS.update({name: Stage(functools.partial(scion_lmo, norm=name), flags=SLICES)
                        for name in ("sign", "col_norm", "row_norm")})  # Scion's
POST_PROCESSORS = {
    **{f"normalize_{mode}": Stage(functools.partial(normalize, mode=mode), flags=SLICES)
       for mode in ("fro", "col", "row", "col_row", "row_col")},
    "variance_reduction": Stage(variance_reduction, flags=SLICES, state=dict(
        second_momentum_buffer=StateSpec(lambda rows, cols: (rows, 1) if rows >= cols else (1, cols),
                                         kept=lambda group: group["beta2"] is not None,
                                         nonnegative=True))),
    "uw_floor": Stage(uw_floor, needs=("weight",)),
    "contra": Stage(contra),
}
APPLIERS = {
    "decoupled": apply_decoupled,
    "cautious": functools.partial(apply_decoupled, cautious=True),
    "hyperball": Stage(hyperball, state=dict(hyperball_radius=StateSpec(
        lambda rows, cols: (1, 1), init=hyperball_radius, nonnegative=True)),
        needs=("weight",), flags=Flags(weight_decay=False)),
    "muown": Stage(muown_apply, state=dict(
        muown_gain=_row_spec(muown_row_norms), muown_v_norm=_row_spec(muown_row_norms),
        muown_v_norm_start=_row_spec(muown_row_norms), muown_gain_exp_avg=_row_spec(),
        muown_gain_exp_avg_sq=_row_spec(nonnegative=True)), reads=("muown_gain_grad",),
        check=_muown_check, flags=Flags(logical=True, weight_decay=False)),
}
# group key -> its registry; precondition and post_process take a sequence of names
STAGE_KEYS = {"precondition": PRECONDITIONERS, "orthogonalizer": ORTHOGONALIZERS,
              "post_process": POST_PROCESSORS, "apply": APPLIERS}
CHAIN_KEYS = ("precondition", "post_process")


NS_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Stage.method values: Gram runs the same iterates on the Gram matrix; 'auto': where
# owners.gram_pays finds it cheaper
NS_METHODS = ("standard", "gram", "auto")
# lr_scale modes: the factor on a Muon group's lr for a (rows, cols) matrix (the last two dims).
LR_SCALES = {
    "shape": lambda r, c: max(1.0, r / c) ** 0.5,  # Keller Jordan, nanochat, torch.optim.Muon
    "moonlight": lambda r, c: 0.2 * max(r, c) ** 0.5,  # Moonlight/Motif: matches AdamW's update RMS
    "spectral": lambda r, c: max(r, c) ** 0.5,  # Megatron's 'spectral'
    "unit_rms": lambda r, c: (r / c) ** 0.5,  # unit RMS-to-RMS operator norm
    "one": lambda r, c: 1.0,  # the orthogonalizer's own scale (Scion's LMOs)
}
SHARDED_MODES = ("owner", "duplicated", "distributed", "blockwise")


def stage_names(key: str):
    """The check of a stage key: names in its registry (one, or a sequence for a chain)."""
    registry, chain = STAGE_KEYS[key], key in CHAIN_KEYS
    where = "stages." + next(n for n, v in globals().items() if v is registry)

    def check(v):
        if chain and not isinstance(v, (str, tuple, list)):
            return "must be a name or a sequence of names"
        bad = [n for n in (_names(v) if chain else (v,))
               if not isinstance(n, str) or n not in registry]
        if bad:
            return (f"{'names ' + repr(bad) if chain else 'is'} not in {where}: use one of "
                    f"{list(registry)}, or register yours there")
        if key != "orthogonalizer":
            return None
        if (s := _stage(key, v)).state or s.needs:
            return ("names an orthogonalizer that declares state or needs; an orthogonalizer is "
                    "f(G, ctx): give those to a precondition or post-process stage")
        if s.method not in (None, *NS_METHODS):
            return (f"names an orthogonalizer whose method {s.method!r} is not one of "
                    f"{NS_METHODS}: name the Newton-Schulz it runs, or None for another "
                    "orthogonalizer")
        return None
    return check


def _any_value(v):  # checked with the keys it goes with (param_groups.check_group_values)
    return None


def _row_counts(n: int | None):
    """The check of a split: n positive row counts (None: two or more)."""
    def check(v):
        ok = v is None or (isinstance(v, (tuple, list)) and len(v) == (n or len(v)) >= 2 and all(
            isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in v))
        return None if ok else ("must be three positive row counts (q, k, v)" if n
                                else "must be two or more positive row counts, one per block")
    return check


def _an_optional(check):
    return lambda v: None if v is None else check(v)


# Every optional key of a muon group, declared once: its default (late-2025 nanochat's Muon), its
# check, its meaning (docs/optimizer.md's option table is options_table()), for a key only one
# stage reads, that stage (a group takes the key only when it runs the stage), and whether it is
# this run's layout (structural) or read by sharded.py alone.
MUON_OPTIONS = {
    "nesterov": Option(True, a_bool, "Nesterov momentum; `False`: plain momentum"),
    "precondition": Option((), stage_names("precondition"), "stages run in order on the "
                           "momentum step before orthogonalizing (`PRECONDITIONERS`)"),
    "orthogonalizer": Option("auto", stage_names("orthogonalizer"), "the stage that maps the "
                             "matrix to about U V^T (`ORTHOGONALIZERS`); `'auto'`: Gram "
                             "Newton-Schulz where it is cheaper, in fp32 and fp16 only"),
    "ns_coefficients": Option("polar_express", _any_value, "a name in `COEFFICIENT_SETS`, a list "
                              "of per-iteration `(a, b, c)`, or `dict(coefficients=, safety=, "
                              "eps=)`"),
    "ns_repeat_last": Option(False, a_bool, "`True`: past the end of the list, run its last "
                             "triple (Emerging-Optimizers' rule); else `ns_steps` may not exceed it"),
    "ns_precision": Option("auto", one_of("auto", *NS_DTYPES), "`'bf16'`, `'fp16'`, `'fp32'`; "
                           "`'auto'`: bf16 on CUDA and CPUs with AVX512-BF16 or AMX, else fp32"),
    "post_process": Option(("variance_reduction",), stage_names("post_process"), "stages run in "
                           "order on the orthogonalized update (`POST_PROCESSORS`)"),
    "apply": Option("cautious", stage_names("apply"), "the stage that decays and steps the "
                    "weight (`APPLIERS`): `'cautious'` decays only where update and weight agree"),
    "lr_scale": Option("shape", one_of(*LR_SCALES), "the lr's factor for a `(rows, cols)` "
                       "matrix (`LR_SCALES`): `'shape'` is sqrt(max(1, rows/cols))"),
    "extra_scale": Option(1.0, lambda v: a_number(v, 1e3), "a further factor on the lr"),
    "decay_lr": Option("adjusted", one_of("adjusted", "group"), "`'adjusted'`: decay by the lr "
                       "with its factor (nanochat); `'group'`: by the group lr (torch.optim.Muon)"),
    "weight_decay_mode": Option("decoupled", one_of("decoupled", "l2"), "`'l2'`: add "
                                "`weight_decay * p` to the gradient before momentum"),
    "comm_precision": Option("fp32", one_of("bf16", "fp32"), "DTensor params: the dtype whole "
                             "matrices travel in to their owner and back",
                             structural=True, sharded_only=True),
    "sharded_mode": Option("owner", one_of(*SHARDED_MODES), "DTensor params: `'owner'`, "
                           "`'duplicated'`, `'distributed'` (all exact) or `'blockwise'`",
                           structural=True, sharded_only=True),
    "qkv_split": Option(None, _row_counts(3), "`(q, k, v)` row counts: split's 3-block case",
                        structural=True),
    "split": Option(None, _row_counts(None), "row counts of fused blocks, e.g. `(I, I)` for "
                    "`[gate; up]`: each block updated as a param of its own", structural=True),
    "split_groups": Option(1, a_count, "the rows are this many repeats of the blocks (Megatron's "
                           "per-query-group QKV)", structural=True),
    "transposed": Option(False, a_bool, "matrices stored `(in, out)`, as GPT-2's Conv1D: lr "
                         "factor and statistics follow the logical `(out, in)`", structural=True),
    "horizon": Option(None, _an_optional(a_count), "the steps the run plans, which stages read "
                      "as `ctx.horizon`; `GPT.setup_optimizer(horizon=)` and base_train set it"),
    "soap_beta": Option(0.9, lambda v: a_number(v, 1.0), "SOAP's EMA of the covariances and of "
                        "the rotated second moment", ("precondition", "soap")),
    "precondition_frequency": Option(10, an_interval, "SOAP: steps between refreshes of the "
                                     "eigenbases, or a fraction of the run",
                                     ("precondition", "soap")),
    "input_interval": Option(64, an_interval, "Newton-Muon: steps between refreshes of the "
                             "inverse input covariance, or a fraction of the run",
                             ("precondition", "newton")),
    "newton_lerp": Option(0.05, lambda v: a_number(v, 1.0), "Newton-Muon: the covariance's EMA "
                          "weight on a refresh's inputs", ("precondition", "newton")),
    "newton_damping": Option(0.2, a_number, "Newton-Muon: the diagonal damping, a share of the "
                             "covariance's mean eigenvalue", ("precondition", "newton")),
    "uw_floor": Option(0.35, a_number, "the least ||update||_F / ||W||_F",
                       ("post_process", "uw_floor")),
    "contra": Option(0.4, a_number, "ContraMuon: twice the share of the unit-operator-norm "
                     "orthogonalizer input subtracted", ("post_process", "contra")),
    "muown_betas": Option((0.9, 0.95), a_pair_of_betas, "Muown: Adam's betas on the gains",
                          ("apply", "muown")),
    "muown_gain_lr": Option(1.0, a_number, "Muown: the gains' lr as a factor on the group lr",
                            ("apply", "muown")),
    "muown_v_norm_target": Option(2.496, _an_optional(a_number), "Muown: the row norm of v the "
                                  "schedule ends at (None: no schedule)", ("apply", "muown")),
    "muown_v_norm_power": Option(1.2, a_number, "Muown: the schedule's power", ("apply", "muown")),
}
ADAMW_OPTIONS = {
    "momentum": Option(None, _any_value, "set (by OneCycleLR or CyclicLR, say), it becomes "
                       "`betas[0]` at the next step", scheduled=True),
}
OPTIONS = {"muon": MUON_OPTIONS, "adamw": ADAMW_OPTIONS}

# A kind's own keys, the rest of what its groups take: the numbers a group must give (checked at
# every step by optim.check_numbers, as schedules edit most), the update count, older
# checkpoints' names, and the bookkeeping any group may carry. docs/optimizer.md: keys_table().
def _own(doc: str, default=NO_DEFAULT, **facts) -> Option:
    """A row of GROUP_KEYS: no check of its own (optim.check_numbers, or its group's checks)."""
    return Option(default, None, doc, **facts)


BOOKKEEPING = {
    "params": _own("the tensors the group trains", passive=True),
    "kind": _own("`'muon'` or `'adamw'`: the update its params take", passive=True),
    "name": _own("a label, for messages and the run's header", passive=True),
    "initial_lr": _own("an LR scheduler's start, which it sets", passive=True, scheduled=True),
    "initial_weight_decay": _own("base_train's weight decay schedule's start", passive=True,
                                 scheduled=True),
    "initial_momentum": _own("base_train's momentum schedule's start", passive=True,
                             scheduled=True),
}
GROUP_KEYS = {
    "muon": {
        "lr": _own("the step size, before `lr_scale`'s factor", required=True, scheduled=True),
        "momentum": _own("the momentum's EMA weight, in [0, 1)", required=True, scheduled=True),
        "ns_steps": _own("Newton-Schulz iterations (5 is standard)", required=True),
        "beta2": _own("variance reduction's EMA weight, in [0, 1); `None` turns it off",
                      required=True, scheduled=True),
        "weight_decay": _own("the decay per unit of the lr `decay_lr` names", required=True,
                             scheduled=True),
        "step": _own("the group's updates so far, which the optimizer counts", 0, passive=True,
                     scheduled=True),
        "equilibrate": _own("older checkpoints': `'row'` is `precondition=('equilibrate_row',)`",
                            legacy=True),
        "post_normalize": _own("older checkpoints': `'col'` is `post_process=('normalize_col', "
                               "'variance_reduction')`", legacy=True),
        "cautious_wd": _own("older checkpoints': `False` is `apply='decoupled'`", True,
                            legacy=True),
        **BOOKKEEPING,
    },
    "adamw": {
        "lr": _own("the step size", required=True, scheduled=True),
        "betas": _own("`(beta1, beta2)`: the moments' EMA weights, each in [0, 1)", required=True,
                      scheduled=True),
        "eps": _own("added to the second moment's root", required=True, scheduled=True),
        "weight_decay": _own("decoupled decay, times the lr", required=True, scheduled=True),
        **BOOKKEEPING,
    },
}


def group_keys(kind: str) -> dict:
    """key -> Option of every key a group of `kind` takes: its own keys, then its options."""
    return {**GROUP_KEYS.get(kind, {}), **OPTIONS.get(kind, {})}


def keys_with(fact: str, kinds=tuple(OPTIONS)) -> tuple:
    """The keys whose row says `fact` ('required', 'scheduled', ...) in any of `kinds`' groups."""
    return tuple(dict.fromkeys(k for kind in kinds for k, o in group_keys(kind).items()
                               if getattr(o, fact)))


def muon_option(group: dict, key: str):
    """A muon group's value of an option, or its default where the group has not been filled."""
    return group[key] if key in group else MUON_OPTIONS[key].default


def group_options(group: dict) -> dict:
    """key -> Option of a group's optional keys: its kind's, less those of stages it does not
    run (a muon group whose stage keys are wrong takes none: its check says so first)."""
    options = OPTIONS.get(group.get("kind"), {})
    if group.get("kind") != "muon":
        return dict(options)
    running = set()
    for key in STAGE_KEYS:
        value = group.get(key, MUON_OPTIONS[key].default)
        if MUON_OPTIONS[key].check(value) is None:
            running.update((key, name) for name in _names(value))
    return {k: o for k, o in options.items() if o.stage is None or o.stage in running}


def options_table(kind: str = "muon") -> str:
    """The markdown table of a kind's optional keys (docs/optimizer.md holds it)."""
    rows = [f"| `{k}` | `{o.default!r}` | {o.doc}"
            f"{f' ({o.stage[0]} `{o.stage[1]!r}` only)' if o.stage else ''}"
            f"{' (structural)' if o.structural else ''} |"
            for k, o in OPTIONS[kind].items()]
    return "\n".join(["| key | default | what it does |", "|---|---|---|", *rows])


def keys_table() -> str:
    """The markdown table of GROUP_KEYS: each kind's own keys, then the bookkeeping of any."""
    rows = [(k, kind, o) for kind, keys in GROUP_KEYS.items() for k, o in keys.items()
            if k not in BOOKKEEPING] + [(k, "any", o) for k, o in BOOKKEEPING.items()]
    facts = ("required", "scheduled", "passive", "legacy")
    lines = [f"| `{k}` | {kind} | {', '.join(f for f in facts if getattr(o, f))} | "
             f"{'' if o.default is NO_DEFAULT else f'`{o.default!r}`'} | {o.doc} |"
             for k, kind, o in rows]
    return "\n".join(["| key | kind | what it is | default | what it does |",
                      "|---|---|---|---|---|", *lines])



# The resolver: a checked group, once per matrix shape, into the muon.MuonPlan a step runs.
# Callers: MuonAdamW._plan and sharded.plan_of, which keep plans by (shape, dtype, device), and
# stage_context, for tests. The checkpoint checks of param_groups.py read muon_state_layout for
# the state a param may carry. A step reads the plans made here and calls none of it.

def _names(value) -> tuple:
    """A stage key's value as a tuple of names: one name, or a chain's sequence."""
    return (value,) if isinstance(value, str) else tuple(value or ())


def _stage(key: str, name: str) -> Stage:
    """The registered entry of `name` under `key`, as a Stage (a bare function is one)."""
    entry = STAGE_KEYS[key][name]
    return entry if isinstance(entry, Stage) else Stage(entry)


def group_stages(group: dict) -> list[tuple[str, str, Stage]]:
    """(key, name, Stage) of every stage a muon group runs, in order: STAGE_KEYS' order is the
    order they run, and a chain's names run as listed."""
    return [(key, name, _stage(key, name)) for key in STAGE_KEYS for name in _names(group[key])]


# What the math does not read of a muon group (params, per-step numbers, labels, sharded-only
# options), so groups that differ only in those share compiled graphs.
NOT_MATH = tuple(k for k, o in group_keys("muon").items()
                 if o.scheduled or o.passive or o.sharded_only)


def resolve_ns_precision(precision: str, device) -> str:
    """ns_precision on this device: 'auto' is bf16 where hardware.bf16_matmuls_fast, else fp32."""
    return precision if precision != "auto" else "bf16" if bf16_matmuls_fast(device) else "fp32"


def muon_options(group: dict, device) -> dict:
    """The static options the math reads (a compiled graph's constants), ns_precision settled."""
    opts = {k: v for k, v in group.items() if k not in NOT_MATH}
    opts["ns_precision"] = resolve_ns_precision(group["ns_precision"], device)
    return opts


def muon_layout(group: dict) -> Layout | None:
    """How a muon group's matrices are stored: None (plain (out, in)), or a Layout."""
    split = group["split"] or group["qkv_split"]
    if not split and not group["transposed"]:
        return None
    return Layout(tuple(split) if split else None, group["split_groups"], group["transposed"])


def newton_schulz_settings(group: dict) -> NewtonSchulz:
    """A group's Newton-Schulz settings, ns_precision resolved (muon_options)."""
    settings = ns_coefficients(group["ns_coefficients"], group["ns_steps"], group["ns_repeat_last"])
    return NewtonSchulz(*settings, NS_DTYPES[group["ns_precision"]])


def muon_plan(group: dict, shape, dtype: torch.dtype, device) -> MuonPlan:
    """The plan of a checked muon group for matrices of `shape` in `dtype` on `device`. The
    group must have passed check_group_values, filled (fill_defaults): nothing is checked again.
    Everything a step asks is settled here, once per group and key, so a step derives nothing:
    stages, Newton-Schulz settings, the lr factor, the state to keep, what the direction reads."""
    opts = muon_options(group, device)
    ns, layout, chosen = newton_schulz_settings(opts), muon_layout(group), group_stages(group)
    blocks = block_shapes(shape, layout)  # logical (rows, cols): one, or a split's blocks
    # each block's own shape sets its lr factor: a fused q, k, v matrix's blocks step as three
    factors = [LR_SCALES[group["lr_scale"]](*b) * group["extra_scale"] for b in blocks]
    lr_factor = factors[0]  # one block: a float
    if len(factors) > 1:
        # one factor per stored row: each block's rows within a group of blocks, tiled over the
        # groups; laid along the columns where storage is transposed (in, out)
        rows = (torch.tensor(factors).repeat_interleave(torch.tensor(layout.split))
                .repeat(layout.groups).to(device))
        lr_factor = rows.view(1, -1) if layout.transposed else rows.view(-1, 1)
    # what the precondition and post-process stages read beyond their input: the step gives
    # them the raw grad, the weights or the inputs only where one asks
    needs = tuple(sorted({need for key, _, s in chosen if key in CHAIN_KEYS for need in s.needs}))
    apply = _stage("apply", group["apply"])
    decays = group["weight_decay_mode"] == "l2" or apply.flags.weight_decay
    # get: a group is filled only with the options of stages it runs (group_options)
    every = group.get("input_interval", MUON_OPTIONS["input_interval"].default)
    return MuonPlan(
        precondition=tuple(s for key, _, s in chosen if key == "precondition"),
        orthogonalizer=_stage("orthogonalizer", group["orthogonalizer"]),
        post_process=tuple(s for key, _, s in chosen if key == "post_process"),
        apply=apply, stages=tuple(chosen), ns=ns, method=orthogonalizer_method(opts) or "auto",
        gram=tuple(b for b in blocks if gram_pays(b, len(ns.coefficients), ns.dtype)),
        layout=layout, lr_factor=lr_factor, options=opts,
        state=muon_state_layout(shape, dtype, group),
        specs={name: spec for key, _, s in chosen if key in CHAIN_KEYS or s.flags.logical
               for name, spec in s.state.items()},
        needs=needs,
        input_every=interval_steps(every, group.get("horizon")) if "inputs" in needs else None,
        eager=any(s.flags.eager for _, _, s in chosen), decays=decays,
        summary=_summary(group, chosen, decays))


def _summary(group: dict, chosen: list, decays: bool) -> str:
    """What a muon group's update runs, in one line for a run's header (MuonPlan.summary)."""
    parts = [f"{key} {', '.join(_names(group[key])) or 'none'}" for key in STAGE_KEYS]
    owner = next((n for k, n, s in chosen if s.flags.owns_momentum), None)
    parts.append(f"momentum kept by precondition {owner!r}" if owner else "Muon's momentum")
    if not decays:
        parts.append(f"weight decay not applied (apply stage {group['apply']!r})")
    return "; ".join(parts)


def stage_context(group: dict, like: Tensor, state: dict | None = None, **fields) -> StageContext:
    """A context for calling a stage by hand (tests, benchmarks) on matrices like `like`."""
    plan = muon_plan(group, like.shape, like.dtype, like.device)
    return StageContext(state or {}, muon_hparams(group, plan), plan, **fields)



def muon_state_layout(shape, dtype: torch.dtype, group: dict, declared: bool = False) -> dict:
    """name -> StateSlot of a Muon param: momentum, then its stages' state, per logical matrix
    (blocks flat) for direction and logical apply stages, else per stored one. declared: also
    state the group does not keep now (a checkpoint may carry it)."""
    shape, stages = tuple(shape), group_stages(group)
    # state is laid out only here: a plan and the checkpoint checks alike meet the refusal
    check_shared_state(stages)
    owned = any(s.flags.owns_momentum for _, _, s in stages)  # by a precondition
    out = {} if owned else {"momentum_buffer": StateSlot(shape, dtype, 0.0)}
    layout = muon_layout(group)
    blocks = block_shapes(shape, layout)
    for key, stage_name, s in stages:
        for name, spec in s.state.items():
            # turned off by an option (variance reduction's with beta2=None): not kept, though
            # a checkpoint of a run that kept it may carry it (declared)
            if spec.kept is not None and not spec.kept(group) and not declared:
                continue
            if name in out:
                raise ValueError(f"stage {stage_name!r} keeps state {name!r}, as another stage of "
                                 "this group does; give one of them another name")
            init = spec.init
            if key not in CHAIN_KEYS and not s.flags.logical:  # an apply stage on stored ones
                per = spec.shape(*shape[-2:])
            # direction stages see logical blocks, never W's stored form: W cannot init them
            elif callable(spec.init) and key in CHAIN_KEYS:
                raise ValueError(f"stage {stage_name!r}: only apply stages may initialize state "
                                 "from the weights; give its StateSpec a number as init")
            else:  # per logical matrix; a split's blocks flat, end to end in one dim
                per = ((sum(math.prod(spec.shape(*b)) for b in blocks),) if len(blocks) > 1
                       else spec.shape(*blocks[0]))
                init = LogicalInit(init, layout) if callable(init) and layout else init
            # at least the spec's dtype (fp32 state for a bf16 param), the param's where wider
            precision = dtype if spec.dtype is None else torch.promote_types(dtype, spec.dtype)
            # a batched param's leading dims (experts) lead its state too
            out[name] = StateSlot((*shape[:-2], *per), precision, init, spec.nonnegative)
    return out


def check_shared_state(stages: list) -> None:
    """Refuse stages that read state no other stage declares, or declares in the other layout
    (stored against logical), and momentum owned by anything but the first precondition. Why:
    a stage reads another's state by name from the one dict the step passes (StageContext.only),
    so a name no stage keeps would fail mid-step, and a state shaped per stored matrix does not
    fit a stage that sees logical blocks. Momentum: only the first precondition's input is the
    gradient; every later stage's is the momentum step's output. Called by check_group, as a group
    is given, and by muon_state_layout."""
    # state name -> (the stage that keeps it, whether per logical matrix)
    keeper = {name: (stage_name, key in CHAIN_KEYS or s.flags.logical)
              for key, stage_name, s in stages for name in s.state}
    for i, (key, stage_name, s) in enumerate(stages):
        if s.flags.owns_momentum and (key != "precondition" or i != 0):
            raise ValueError(f"{key} {stage_name!r} owns the momentum, which only the first "
                             "precondition may: its input is the gradient")
        for name in s.reads:  # reads names another stage's state; its own is in s.state
            if name not in keeper or name in s.state:
                raise ValueError(f"{key} {stage_name!r} reads state {name!r}, which no other "
                                 "stage of this group declares; name the stage that keeps it")
            if keeper[name][1] != (key in CHAIN_KEYS or s.flags.logical):
                raise ValueError(f"{key} {stage_name!r} reads state {name!r}, which "
                                 f"{keeper[name][0]!r} keeps per stored matrix; a state shared "
                                 "with a direction stage needs a logical apply stage "
                                 "(Flags(logical=True))")


def orthogonalizer_method(group: dict) -> str | None:
    """The group's orthogonalizer's Newton-Schulz method (Stage.method), None if it names none."""
    return getattr(ORTHOGONALIZERS.get(group["orthogonalizer"]), "method", None)


def orthogonalizer_running(method: str) -> str:
    """The first registered orthogonalizer whose entry runs `method` ('auto' for none)."""
    return next((name for name, entry in ORTHOGONALIZERS.items()
                 if getattr(entry, "method", None) == method), "auto")
