"""
The Muon update a step runs, written once: every optimizer path (one device, data parallel,
sharded, compiled) calls muon_update or its three parts, and adamw_update for the rest.

Read top-down: muon_update is muon_momentum (elementwise, so it runs on shards), muon_direction
(whole matrices: the precondition stages, the orthogonalizer, the post-process stages) and
muon_apply (weight decay and the step). The default stages are here: Newton-Schulz (its named
coefficient sets: coefficients.py), variance reduction and decoupled or cautious decay. Every other
stage, the registries, every group option and the resolver that turns a group into a MuonPlan
live in stages.py. A plan is made once per matrix shape, so a step derives
nothing; the numbers schedules change travel as MuonScalars, 0-D tensors when compiled (scalars),
so an LR schedule never recompiles. Imports only torch.

The second half holds the helpers, in sections that say which of them the default step runs: a
plain (out, in) matrix with the default options runs the reductions (whole_shape, summed,
gram_matrix, sq_sum) and, on a param's first step, fresh_state. The rest serve other paths: the
'distributed' sharded mode (over_slices), split and transposed layouts (_by_layout and its
helpers), the alternative stages (fp32, frobenius) and compiled runs (kernel, scalars).
"""

import math
from collections import namedtuple
from collections.abc import Callable
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor


class MuonScalars(NamedTuple):
    """The numbers of one Muon step that schedules change (0-D tensors when compiled: scalars())."""
    lr: float | Tensor  # the step, with the group's lr factor (per row of a split matrix: a tensor)
    momentum: float
    wd: float  # weight_decay, for L2 mode's gradient term
    decay: float | Tensor  # lr * weight_decay, with the lr decay_lr names
    beta2: float  # variance reduction's EMA (0 when off)
    step: float  # the group's updates so far, this one included (StageContext.step)
    group_lr: float  # the group's lr, without its factor (an lr of a stage's own Adam, say)


AdamWScalars = namedtuple("AdamWScalars", "step lr beta1 beta2 eps wd")
# Newton-Schulz's per-iteration (a, b, c), the norm's safety and eps, its compute dtype
NewtonSchulz = namedtuple("NewtonSchulz", "coefficients safety eps dtype")
# A group's storage (muon_layout): row blocks `split` x `groups`, (in, out) if transposed
Layout = namedtuple("Layout", "split groups transposed")


class MuonPlan(NamedTuple):
    """A muon group resolved once for matrices of one shape, dtype and device (stages.muon_plan):
    what a step runs and every fact the loop asks, as fields."""
    precondition: tuple  # Stages run in order on the momentum step: () by default
    orthogonalizer: tuple  # a stages.Stage: newton_schulz by default
    post_process: tuple  # Stages run in order on its output: (variance_reduction,) by default
    apply: tuple  # a stages.Stage, the step itself: apply_decoupled, cautious by default
    stages: tuple  # (group key, name, Stage) of all four, in the order they run
    ns: NewtonSchulz
    method: str  # the orthogonalizer's Newton-Schulz method: 'standard', 'gram' or 'auto'
    gram: tuple  # the logical (rows, cols) on which Gram pays (owners.gram_pays): 'auto' runs it
    layout: Layout | None  # None: plain (out, in) matrices
    lr_factor: float | Tensor  # the lr's factor; per row of a split matrix, a tensor there
    options: dict  # the static options (stages.muon_options): what stages read as ctx.group
    state: dict  # name -> StateSlot (stages.muon_state_layout): what this group keeps now
    specs: dict  # name -> StateSpec of all state kept per logical matrix, kept now or not
    needs: tuple  # what the direction stages read beyond their input: 'grad', 'weight', 'inputs'
    input_every: int | None  # steps between reads of the matrices' inputs; None: never
    eager: bool  # a stage branches on state values: the group runs uncompiled
    decays: bool  # the group's weight_decay acts ('l2' mode, or an apply stage that decays)
    summary: str  # what the update runs, in one line for a run's header


class StageContext(NamedTuple):
    """What a stage reads besides the matrices it transforms (a stack: (..., rows, cols))."""
    state: dict  # name -> tensor: the state this stage keeps and reads, stacked like the matrices
    h: MuonScalars  # this step's numbers
    plan: "MuonPlan"  # the group resolved for these matrices (muon_plan)
    grad: Tensor | None = None  # the raw gradients, where a stage needs 'grad'
    weight: Tensor | None = None  # the weights before the step, where a stage needs 'weight'
    ortho_input: Tensor | None = None  # post-process stages: the orthogonalizer's input
    inputs: Tensor | None = None  # 'inputs' when due: input_covariance's, (..., blocks, b, b)
    params: Tensor | list | None = None  # apply stages: updated in place (stacked, or a list)

    @property
    def group(self) -> dict:
        """The group's static options (muon_options), stage options included."""
        return self.plan.options

    @property
    def step(self):
        """The group's updates so far, this one included; a 0-D tensor when compiled."""
        return self.h.step

    @property
    def horizon(self) -> int | None:
        return self.group.get("horizon")

    def only(self, s) -> "StageContext":
        """This context with only the state stage s keeps or reads."""
        return self._replace(state={n: t for n, t in self.state.items()
                                    if n in s.state or n in s.reads})


def muon_update(
    grads: Tensor | list,  # (K, 768, 3072) - K same-shape grads (a list is stacked); overwritten
    params: Tensor | list,  # (K, 768, 3072) - the stacked params, or a list of K; updated in place
    state: dict,  # name -> (K, *its slot's shape): momentum_buffer (K, 768, 3072) and each
    #               stage's state, second_momentum_buffer (K, 1, 3072) here (MuonPlan.state)
    h: MuonScalars,  # this step's lr, momentum, decay...: floats, 0-D CPU tensors when compiled
    plan: "MuonPlan",  # the group resolved for (768, 3072) matrices of this dtype and device
    inputs: Tensor | None = None,  # (K, blocks, b, b) - input covariances, on the steps a stage
    #                                reads them (Newton-Muon), else None
) -> None:
    """One Muon step on K same-shape matrices, in place on params and state: momentum,
    direction, apply. A batched param (experts, out, in) stacks as (K, experts, out, in)."""
    grads = torch.stack(grads) if isinstance(grads, list) else grads  # a slice: small memory
    raw = grads.clone() if "grad" in plan.needs else None  # the momentum step overwrites grads
    g = muon_momentum(grads, state.get("momentum_buffer"), params, h, plan)
    weight = (params if isinstance(params, Tensor) else torch.stack(params)) \
        if "weight" in plan.needs else None  # apply stages have the params themselves
    ctx = StageContext(state, h, plan, raw, weight, inputs=inputs)
    muon_apply(params, muon_direction(g, ctx, grads.dtype), ctx)  # in the params' dtype


def muon_momentum(grads: Tensor, momentum_buffer: Tensor | None, params, h: MuonScalars,
                  plan: "MuonPlan") -> Tensor:
    """Muon's momentum step, elementwise (it runs on shards), overwriting grads ('l2': + wd p)."""
    opts = plan.options
    if opts["weight_decay_mode"] == "l2":
        for g, p in pairs(grads, params):
            g.add_(p * h.wd)
    if momentum_buffer is None:
        return grads
    momentum_buffer.lerp_(grads, 1 - h.momentum)
    if opts["nesterov"]:
        return grads.lerp_(momentum_buffer, h.momentum)
    # plain momentum's step is a copy, not the buffer itself: inductor (torch 2.13) fails to
    # compile the buffer, a mutated input, read through a transposed reduction (a transposed
    # group's col_norm orthogonalizer)
    return grads.copy_(momentum_buffer)


def muon_direction(g: Tensor, ctx: StageContext, out_dtype: torch.dtype) -> Tensor:
    """The update's direction from the momentum step g, in out_dtype: preconditions,
    orthogonalizer, post-processes; transposed or split matrices as plain ones (_by_layout)."""
    plan = ctx.plan
    if plan.layout is not None:
        return _by_layout(g, ctx, out_dtype, plan.layout)
    for s in plan.precondition:
        g = s.fn(g, ctx.only(s))
    u = plan.orthogonalizer.fn(g, ctx).to(out_dtype)  # the norms below would copy bf16 anyway
    ctx = ctx._replace(ortho_input=g)
    for s in plan.post_process:
        u = s.fn(u, ctx.only(s))
    return u


def muon_apply(params, u: Tensor, ctx: StageContext) -> None:
    """The group's apply stage, in place on params (stacked like u, or a list); u may change."""
    s = ctx.plan.apply
    ctx = ctx.only(s)
    if not s.flags.logical:
        return s.fn(u, ctx._replace(params=params))
    W = params if isinstance(params, Tensor) else torch.stack(params)
    layout = ctx.plan.layout
    if layout is None:
        s.fn(u, ctx._replace(params=W))
    else:  # transposed or split W, block by block, written back into W
        plain = plain_plan(ctx.plan)
        states = block_state(ctx.state, ctx.plan.specs, W.shape, layout)
        per_row = {k: logical_blocks(v, layout) for k, v in ctx.h._asdict().items()
                   if isinstance(v, Tensor) and v.dim() == 2}  # a split matrix's lr and decay
        for b, (view, ub) in enumerate(zip(logical_blocks(W, layout), logical_blocks(u, layout))):
            w = view.flatten(-3, -2)  # a copy where the block's rows repeat across groups
            h = ctx.h._replace(**{k: v[b].flatten(-3, -2) for k, v in per_row.items()})
            s.fn(ub.flatten(-3, -2), ctx._replace(plan=plain, state=states[b], h=h, params=w))
            if layout.split and layout.groups > 1:
                view.copy_(w.view_as(view))
    if not isinstance(params, Tensor):
        torch._foreach_copy_(params, list(W.unbind(0)))


def pairs(stack: Tensor, params, *states):
    """(stack, params, *states) whole when params is a tensor, else matrix by matrix."""
    return ((stack, params, *states),) if isinstance(params, Tensor) else zip(stack, params, *states)


# Gram Newton-Schulz recomputes R from X every 3 iterations (newton_schulz; docs/benchmarks.md)
GRAM_RESTART = 3


def newton_schulz(G: Tensor, ctx: "StageContext", gram: bool | None = None,
                  method: str | None = None) -> Tensor:
    """U V^T of each matrix G = U S V^T, approximately, by Newton-Schulz under ctx.plan.ns (Gram
    as the plan settled it for its method; gram forces). Standard: X <- a X + (b A + c A^2) X,
    A = X X^T, wide side up. Gram (Dao-AILab's): the same iterates on m x m matrices (P = p(R),
    Q <- Q P, R <- P R P), from X = Q X every GRAM_RESTART, as R drifts in low precision. Over
    slices the cut dim goes on the columns, which the Gram matrix and the norm sum over."""
    ns, shape, method = ctx.plan.ns, G.shape, method or ctx.plan.method
    if gram is None:  # 'auto' runs Gram where the plan found that it pays
        gram = method == "gram" or (method == "auto"
                                    and tuple(whole_shape(G)[-2:]) in ctx.plan.gram)
    X = G.reshape(shape[:-2].numel(), shape[-2], shape[-1])  # an empty slice keeps its batch
    # bf16 and fp32 cast first, as torch.optim.Muon and nanochat do. fp16 normalizes in fp32
    # first: its 5-bit exponent would flush a tiny momentum to zero, or overflow past 65,504.
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


def variance_reduction(u: Tensor, ctx: StageContext) -> Tensor:
    """NorMuon (arXiv 2510.05491, as nanochat does it), in place: an EMA (beta2) of the mean
    squared update per row (tall) or column (wide) divides it, at the same Frobenius norm."""
    second_moment = ctx.state.get("second_momentum_buffer")
    if second_moment is None:
        return u
    shape = whole_shape(u)
    red_dim = -1 if shape[-2] >= shape[-1] else -2  # per row of a tall or square matrix
    v_mean = sq_sum(u, (red_dim,)) / shape[red_dim]  # u is scaled in place at the end
    other = (-2 if red_dim == -1 else -1,)  # v_mean's sums over the other dim: the whole matrix's
    v_norm = summed((v_mean * shape[red_dim]).sum(dim=(-2, -1), keepdim=True), other).sqrt()
    second_moment.lerp_(v_mean.to(second_moment.dtype), 1 - ctx.h.beta2)
    step_size = second_moment.clamp_min(1e-10).rsqrt()  # fp32 at least: the state's dtype
    v_norm_new = summed((v_mean * shape[red_dim] * step_size.square()).sum(dim=(-2, -1),
                                                                          keepdim=True), other)
    return u.mul_((step_size * (v_norm / v_norm_new.sqrt().clamp_min(1e-10))).to(u.dtype))


def apply_decoupled(u: Tensor, ctx: StageContext, cautious: bool = False) -> None:
    """Decoupled weight decay (h.decay: lr * weight_decay; none in 'l2' mode), then the step;
    cautious (Chen et al. 2025, arXiv 2510.12402): decay only where u and the weight agree."""
    lr, decays = ctx.h.lr, ctx.group["weight_decay_mode"] != "l2"
    if isinstance(lr, Tensor):  # per row, or compiled: u takes it, as alpha takes numbers only
        u, lr = u.mul_(lr), 1.0
    for ui, p in pairs(u, ctx.params):
        if decays and cautious:
            p.addcmul_(p, ((ui * p) >= 0) * ctx.h.decay, value=-1)
        elif decays:
            p.mul_(1 - ctx.h.decay)
        p.add_(ui, alpha=-lr)


def adamw_update(
    p: Tensor,  # (n,) - a param flat, e.g. (32768 * 768,); a rank's rows of it; a CPU slice
    grad: Tensor,  # (n,) - its gradient, shaped as p
    exp_avg: Tensor,  # (n,) - first moment, shaped as p
    exp_avg_sq: Tensor,  # (n,) - second moment, shaped as p
    h: AdamWScalars,  # step (this one counted), lr, beta1, beta2, eps, wd: floats or 0-D tensors
) -> None:
    """One AdamW step in place on p, as torch.optim.AdamW's single-tensor path (one temporary).
    Elementwise, so any shape does: a param that is not contiguous comes whole, unflattened."""
    p.mul_(1 - h.lr * h.wd)  # decoupled weight decay, before the step
    exp_avg.lerp_(grad, 1 - h.beta1)  # the moments' EMAs
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    # bias corrections in torch's order: the second moment's inside the root, eps after it
    denom = exp_avg_sq.sqrt().div_((1 - h.beta2 ** h.step) ** 0.5).add_(h.eps)
    p.addcdiv_(exp_avg, denom, value=-h.lr / (1 - h.beta1 ** h.step))


def muon_hparams(group: dict, plan: MuonPlan) -> MuonScalars:
    """A muon group's per-step numbers under its plan ('l2' mode's decay is in the gradient)."""
    group_lr = float(group["lr"])  # a Tensor lr too (torch.optim's)
    lr, opts = group_lr * plan.lr_factor, plan.options
    decay = (lr if opts["decay_lr"] == "adjusted" else group_lr) * group["weight_decay"]
    decay = 0.0 if opts["weight_decay_mode"] == "l2" else decay
    beta2 = group["beta2"] if group["beta2"] is not None else 0.0
    return MuonScalars(lr=lr, momentum=group["momentum"], wd=group["weight_decay"], decay=decay,
                       beta2=beta2, step=group.get("step", 0), group_lr=group_lr)


# -----------------------------------------------------------------------------------------------
# Reductions: whole_shape, summed, gram_matrix and sq_sum, which the default step runs (Newton-
# Schulz, variance reduction), are plain reductions on whole matrices. Over slices they add up
# across ranks, so a stage written with them runs in the 'distributed' sharded mode unchanged.

# Megatron's 'distributed' mode (sharded.py): each rank holds a slice of every matrix, cut along
# `dim` (-2 or -1) of whole_shape; reduce(t) sums t in place over those ranks.
Slices = namedtuple("Slices", "reduce dim whole_shape")
# what over_slices() set: None (whole matrices) on every path but sharded.py's 'distributed' mode
_slices: Slices | None = None


@contextmanager
def over_slices(slices: Slices):
    """Within, direction stages run on slices: cut-dim sums add up across ranks (summed)."""
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
    """t, a sum over dims of a matrix, added up across ranks in place where slices cut dims."""
    if _slices is not None and _slices.dim in dims:
        _slices.reduce(t)
    return t


def gram_matrix(X: Tensor) -> Tensor:
    """X X^T; over slices the partial products are summed in fp32, whatever X's dtype."""
    A = X @ X.mT
    if _slices is None:
        return A
    A32 = A.float()
    _slices.reduce(A32)
    return A32.to(A.dtype)


def sq_sum(x: Tensor, dims: tuple) -> Tensor:
    """x's sum of squares over dims (kept), in at least fp32, with no full-size x**2 (summed)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    s = torch.linalg.vector_norm(x, dim=dims, keepdim=True, dtype=dtype).square()
    return summed(s, dims)


# Casts and norms for the alternative stages (stages.py); the default step does not call them.

def fp32(x: Tensor) -> Tensor:
    """x in at least fp32 (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def frobenius(x: Tensor) -> Tensor:
    """Each matrix's Frobenius norm in fp32 (or fp64), shaped to broadcast over x."""
    return torch.linalg.matrix_norm(fp32(x), keepdim=True)


# -----------------------------------------------------------------------------------------------
# Layouts: a split or transposed group's matrices (Layout), updated as plain ones. The default
# step's plain matrices skip all of this (plan.layout is None): muon_direction goes to
# _by_layout, and muon_apply to block_state and logical_blocks, only for such groups.
# block_shapes is also read once per plan (stages.muon_plan, the state's layout).

def block_shapes(shape, layout: Layout | None) -> list[tuple[int, int]]:
    """The logical (rows, cols) of each block of matrices of `shape`: one for a plain layout."""
    split, groups, transposed = layout or (None, 1, False)
    rows, cols = (shape[-1], shape[-2]) if transposed else (shape[-2], shape[-1])
    return [(n * groups, cols) for n in split] if split else [(rows, cols)]


def plain_plan(plan: "MuonPlan", layout: Layout | None = None) -> "MuonPlan":
    """The plan a transposed or split matrix's blocks run under: plain matrices, or `layout`."""
    split, groups = (layout.split, layout.groups) if layout else (None, 1)
    options = dict(plan.options, split=split, qkv_split=None, split_groups=groups, transposed=False)
    return plan._replace(layout=layout, options=options)


def _by_layout(g: Tensor, ctx: StageContext, out_dtype, layout: Layout) -> Tensor:
    """muon_direction of a transposed or split matrix, through plain matrices."""
    split, groups, transposed = layout
    mats = {k: getattr(ctx, k) for k in ("grad", "weight") if getattr(ctx, k) is not None}
    specs = ctx.plan.specs
    state = {name: t for name, t in ctx.state.items() if name in specs}
    if transposed:
        inner = layout._replace(transposed=False) if split else None
        sub = ctx._replace(plan=plain_plan(ctx.plan, inner), state=state,
                           **{k: t.mT for k, t in mats.items()})
        return muon_direction(g.mT, sub, out_dtype).mT
    plain = plain_plan(ctx.plan)
    if groups == 1 and len(set(split)) == 1:  # (..., k * n, cols) as a batch of k (n, cols) blocks
        k, n = len(split), split[0]
        sub = ctx._replace(plan=plain, state={name: t.unflatten(-1, (k, *specs[name].shape(
                                                  n, g.shape[-1])))
                                              for name, t in state.items()},
                           **{key: t.unflatten(-2, (k, n)) for key, t in mats.items()})
        return muon_direction(g.unflatten(-2, (k, n)), sub, out_dtype).flatten(-3, -2)
    # the rows are `groups` repeats of the blocks: views (..., groups, n, cols), flattened
    u = torch.empty(g.shape, dtype=out_dtype, device=g.device)
    states = block_state(state, specs, g.shape, layout)
    views = {key: logical_blocks(t, layout) for key, t in dict(mats, g=g, u=u).items()}
    for b in range(len(split)):
        sub = ctx._replace(plan=plain, state=states[b],
                           **{key: views[key][b].flatten(-3, -2) for key in mats})
        m = views["g"][b].flatten(-3, -2)
        views["u"][b].copy_(muon_direction(m, sub, out_dtype).view_as(views["g"][b]))
    return u


def block_state(state: dict, specs: dict, shape, layout: Layout) -> list[dict]:
    """Per-logical-matrix state as one dict per logical block: views of the flat state."""
    blocks = block_shapes(shape, layout)
    if len(blocks) == 1:
        return [dict(state)]
    out = [{} for _ in blocks]
    for name, t in state.items():
        shapes = [specs[name].shape(*b) for b in blocks]
        for b, piece in enumerate(t.split([math.prod(s) for s in shapes], dim=-1)):
            out[b][name] = piece.view(*piece.shape[:-1], *shapes[b])
    return out


def logical_blocks(t: Tensor, layout: Layout) -> list[Tensor]:
    """Views of t's logical blocks, (..., groups, n, cols) each; t may be per-row numbers too."""
    split, groups, transposed = layout
    t = t.mT if transposed else t
    if not split:
        return [t.unsqueeze(-3)]
    return list(t.unflatten(-2, (groups, sum(split))).split(list(split), dim=-2))


# -----------------------------------------------------------------------------------------------
# State: what a Muon param keeps (stages.muon_state_layout's slots), made by fresh_state on the
# param's first step; optim stacks it per shape and keeps it across steps.

Diagonal = namedtuple("Diagonal", "value")  # a StateSpec init: value x I per matrix
StateSlot = namedtuple("StateSlot", "shape dtype init nonnegative", defaults=(False,))


class LogicalInit(NamedTuple):
    """A logical apply stage's init from W, per logical block, flat (a NamedTuple: comparable)."""
    init: Callable
    layout: Layout

    def __call__(self, w: Tensor) -> Tensor:
        parts = [self.init(b.flatten(-3, -2)) for b in logical_blocks(w, self.layout)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([t.reshape(*w.shape[:-2], -1) for t in parts], dim=-1)


def fresh_state(slot: StateSlot, weight: Tensor) -> Tensor:
    """A new state tensor for the param `weight`, from slot.init."""
    if callable(slot.init):
        return slot.init(weight.detach()).to(slot.dtype).reshape(slot.shape)
    if isinstance(slot.init, Diagonal):
        out = torch.zeros(slot.shape, dtype=slot.dtype, device=weight.device)
        out.diagonal(dim1=-2, dim2=-1).fill_(slot.init.value)
        return out
    return torch.full(slot.shape, slot.init, dtype=slot.dtype, device=weight.device)


# -----------------------------------------------------------------------------------------------
# Compiling: where the update runs through torch.compile (CUDA by default; compile=True
# elsewhere), optim calls muon_update and adamw_update as kernel(fn, True) with scalars(h, True).

_compiled: dict = {}
_scalar_tensors: dict = {}
# what each tensor holds: most calls in a step repeat a value, and fill_ is not free
_scalar_values: dict = {}


def kernel(fn, compiled: bool):
    """fn, or its torch.compile'd twin (one per process). Shapes start static and a dim seen to
    change turns dynamic (dynamic=None), so many shapes stay inside dynamo's recompile limit."""
    if compiled and fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=None, fullgraph=True)
    return _compiled[fn] if compiled else fn


def scalars(h, compiled: bool):
    """h (MuonScalars or AdamWScalars) for kernel(fn, compiled): compiled, its numbers become 0-D
    CPU tensors refilled in place, so the graph is reused, not rebuilt."""
    if not compiled:
        return h
    out = {}
    for key, value in h._asdict().items():
        if isinstance(value, Tensor):  # per-row lrs are tensors already
            out[key] = value
            continue
        if key not in _scalar_tensors:
            _scalar_tensors[key] = torch.zeros((), dtype=torch.float32)
        if _scalar_values.get(key) != value:
            _scalar_tensors[key].fill_(value)
            _scalar_values[key] = value
        out[key] = _scalar_tensors[key]
    return type(h)(**out)
