"""
The update math of Muon and AdamW, written once: every optimizer path runs it. Imports only torch
(and hardware.py's one rule).

A Muon step is muon_momentum (elementwise), muon_direction (whole matrices: precondition stages,
orthogonalizer, post-process stages) and muon_apply (weight decay and the step); muon_update() is
the three in a row, sharded.py runs them with communication between, over_slices() on slices.
A group resolves once per matrix shape into a MuonPlan (muon_plan), so a step derives nothing;
per-step numbers travel as MuonScalars (muon_hparams), 0-D tensors when compiled (scalars()), so
LR schedules never recompile. The stages are registries of name -> function or Stage
(docs/optimizer.md, "Stages").
"""

import functools
import math
from collections import namedtuple
from collections.abc import Callable
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor

from nanomuon.hardware import bf16_matmuls_fast

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
NS_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Gram Newton-Schulz recomputes R from X every 3 iterations (newton_schulz; docs/benchmarks.md)
GRAM_RESTART = 3
# Stage.method values: Gram runs the same iterates on the Gram matrix; 'auto': where gram_pays
NS_METHODS = ("standard", "gram", "auto")

# lr_scale modes: the factor on a Muon group's lr for a (rows, cols) matrix (the last two dims).
LR_SCALES = {
    "shape": lambda r, c: max(1.0, r / c) ** 0.5,  # Keller Jordan, nanochat, torch.optim.Muon
    "moonlight": lambda r, c: 0.2 * max(r, c) ** 0.5,  # Moonlight/Motif: matches AdamW's update RMS
    "spectral": lambda r, c: max(r, c) ** 0.5,  # Megatron's 'spectral'
    "unit_rms": lambda r, c: (r / c) ** 0.5,  # unit RMS-to-RMS operator norm
}


# Newton-Schulz's per-iteration (a, b, c), the norm's safety and eps, its compute dtype
NewtonSchulz = namedtuple("NewtonSchulz", "coefficients safety eps dtype")
# A group's storage (muon_layout): row blocks `split` x `groups`, (in, out) if transposed
Layout = namedtuple("Layout", "split groups transposed")


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


def newton_schulz(G: Tensor, ctx: "StageContext", gram: bool | None = None,
                  method: str | None = None) -> Tensor:
    """U V^T of each matrix G = U S V^T, approximately, by Newton-Schulz under ctx.plan.ns (Gram
    as the plan settled it for its method; gram forces). Standard: X <- a X + (b A + c A^2) X,
    A = X X^T, wide side up. Gram (Dao-AILab's): the same iterates on m x m matrices (P = p(R),
    Q <- Q P, R <- P R P), from X = Q X every GRAM_RESTART, as R drifts in low precision. Over
    slices the cut dim goes on the columns, which the Gram matrix and the norm sum over."""
    ns, shape = ctx.plan.ns, G.shape
    if gram is None:
        gram = (tuple(whole_shape(G)[-2:]) in ctx.plan.gram if method in (None, ctx.plan.method)
                else uses_gram(method, whole_shape(G), ns))
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


def newton_schulz_settings(group: dict) -> NewtonSchulz:
    """A group's Newton-Schulz settings, ns_precision resolved (muon_options)."""
    settings = ns_coefficients(group["ns_coefficients"], group["ns_steps"], group["ns_repeat_last"])
    return NewtonSchulz(*settings, NS_DTYPES[group["ns_precision"]])


# An optional group key: default, check(value) -> None or what it must be, a docs line
Option = namedtuple("Option", "default check doc")


def one_of(*choices):
    return lambda v: None if any(v is c or (type(v) is type(c) and v == c) for c in choices) else \
        f"must be one of {list(choices)}"


def a_bool(v):
    return None if isinstance(v, bool) else "must be True or False"


def a_number(v, hi=float("inf")):
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < hi
    return None if ok else f"must be a finite number >= 0{f' and < {hi}' if hi < 1e308 else ''}"


def a_count(v):
    ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
    return None if ok else "must be an int >= 1"


def an_interval(v):
    """Steps (an int >= 1) or a fraction of the run's horizon (0 < f < 1): interval_steps."""
    ok = a_count(v) is None or (isinstance(v, float) and 0 < v < 1)
    return None if ok else ("must be steps (an int >= 1) or a fraction of the run's horizon (a "
                            "float between 0 and 1)")


def interval_steps(value, horizon: int | None) -> int:
    """an_interval's value in steps: an int as given, a fraction of the horizon rounded, >= 1."""
    return value if isinstance(value, int) else max(1, round(value * horizon))


Diagonal = namedtuple("Diagonal", "value")  # a StateSpec init: value x I per matrix


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
    """A registry entry. fn(x, ctx) returns the new x (an apply stage updates ctx.params). state:
    name -> StateSpec; reads: state another stage declares; options: group key -> Option;
    check(group): None or what is wrong; cost(rows, cols, group): FLOPs per matrix and step;
    needs: 'grad', 'weight' or 'inputs'; method (orthogonalizers): its NS_METHODS entry or None."""
    fn: Callable
    state: dict = {}
    reads: tuple = ()
    options: dict = {}
    check: Callable | None = None
    cost: Callable | None = None
    needs: tuple = ()
    flags: Flags = Flags()
    method: str | None = None


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

    def only(self, s: Stage) -> "StageContext":
        return self._replace(state={n: t for n, t in self.state.items()
                                    if n in s.state or n in s.reads})


def sq_sum(x: Tensor, dims: tuple) -> Tensor:
    """x's sum of squares over dims (kept), in at least fp32, with no full-size x**2 (summed)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    s = torch.linalg.vector_norm(x, dim=dims, keepdim=True, dtype=dtype).square()
    return summed(s, dims)


def fp32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def frobenius(x: Tensor) -> Tensor:
    """Each matrix's Frobenius norm in fp32 (or fp64), shaped to broadcast over x."""
    return torch.linalg.matrix_norm(fp32(x), keepdim=True)


def equilibrate(g: Tensor, ctx: StageContext, mode: str) -> Tensor:
    """MuonEq (Chang et al. 2026, arXiv 2603.28254): diag(r) G diag(c) with r_i = (sum_j G_ij^2 +
    1e-8)^-1/2 and c likewise, both from the same G. A new tensor: g may be the momentum buffer."""
    scales = [sq_sum(g, (-1,) if part == "row" else (-2,)).add_(1e-8).rsqrt_().to(g.dtype)
              for part in mode.split("_")]
    for scale in scales:
        g = g * scale
    return g


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


def inputs_due(group: dict) -> bool:
    """Whether a muon group's next step reads its matrices' inputs (every input_interval)."""
    return ("inputs" in stage_needs(group) and (group.get("step", 0) + 1)
            % interval_steps(group["input_interval"], group.get("horizon")) == 0)


def normalize(u: Tensor, ctx: StageContext, mode: str) -> Tensor:
    """Muon+ (Zhang et al. 2026, arXiv 2602.21545), in place: columns or rows to unit norm, in the
    order named. 'fro' (nanochat's): the matrix to Frobenius norm sqrt(min(rows, cols)), U V^T's."""
    if mode == "fro":
        m, n = whole_shape(u)[-2:]
        return u.mul_((min(m, n) ** 0.5 / sq_sum(u, (-2, -1)).sqrt().clamp_min(1e-6)).to(u.dtype))
    for part in mode.split("_"):
        u = u.mul_(sq_sum(u, (-2,) if part == "col" else (-1,)).add_(1e-7).rsqrt_().to(u.dtype))
    return u


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


def pairs(stack: Tensor, params, *states):
    """(stack, params, *states) whole when params is a tensor, else matrix by matrix."""
    return ((stack, params, *states),) if isinstance(params, Tensor) else \
        zip(stack, params, *states)


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


def a_pair_of_betas(v):
    ok = isinstance(v, (tuple, list)) and len(v) == 2 and all(a_number(b, 1.0) is None for b in v)
    return None if ok else "must be a pair of numbers in [0, 1)"


def _row_spec(init=0.0):
    return StateSpec(lambda rows, cols: (rows, 1), init=init)


def _soap_cost(rows: int, cols: int, group: dict) -> float:
    """Rotations and covariances per step; a power iteration and QR per side per refresh."""
    per_step = 6 * rows * cols * (rows + cols)
    every = interval_steps(group["precondition_frequency"], group.get("horizon"))
    return per_step + 4 * (rows ** 3 + cols ** 3) / every


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
        options=dict(soap_beta=Option(0.9, lambda v: a_number(v, 1.0), "SOAP's EMA of the "
                                      "covariances and of the rotated second moment"),
                     precondition_frequency=Option(10, an_interval, "SOAP: steps between "
                                                   "refreshes of the eigenbases, or a fraction "
                                                   "of the run")),
        cost=_soap_cost, needs=("grad",), flags=Flags(eager=True)),
    "newton": Stage(newton, state=dict(
        newton_momentum=StateSpec(lambda rows, cols: (rows, cols), dtype=None),
        newton_cov=StateSpec(input_shape, init=Diagonal(0.001)),
        newton_inv=StateSpec(input_shape, init=Diagonal(1.0))),
        options=dict(input_interval=Option(64, an_interval, "Newton-Muon: steps between "
                                           "refreshes of the inverse input covariance, or a "
                                           "fraction of the run (the record: 64 steps)"),
                     newton_lerp=Option(0.05, lambda v: a_number(v, 1.0), "Newton-Muon: the "
                                        "covariance's EMA weight on a refresh's inputs"),
                     newton_damping=Option(0.2, a_number, "Newton-Muon: the diagonal damping, "
                                           "a share of the covariance's mean eigenvalue")),
        check=_newton_check, needs=("inputs",),
        flags=Flags(eager=True, owns_momentum=True)),
    "muown": Stage(muown_direction, state=dict(
        muown_momentum=StateSpec(lambda rows, cols: (rows, cols), dtype=None),
        muown_gain_grad=_row_spec()), reads=("muown_gain", "muown_v_norm"), needs=("weight",),
        flags=Flags(owns_momentum=True)),
}
ORTHOGONALIZERS = {name: Stage(functools.partial(newton_schulz, method=method), flags=SLICES,
                                method=method)
                   for name, method in (("auto", "auto"), ("newton_schulz", "standard"),
                                        ("gram_newton_schulz", "gram"))}
POST_PROCESSORS = {
    **{f"normalize_{mode}": Stage(functools.partial(normalize, mode=mode), flags=SLICES)
       for mode in ("fro", "col", "row", "col_row", "row_col")},
    "variance_reduction": Stage(variance_reduction, flags=SLICES, state=dict(
        second_momentum_buffer=StateSpec(lambda rows, cols: (rows, 1) if rows >= cols else (1, cols),
                                         kept=lambda group: group["beta2"] is not None,
                                         nonnegative=True))),
    "uw_floor": Stage(uw_floor, options=dict(uw_floor=Option(0.35, a_number, "u/w floor: the "
                                                             "least ||update||_F / ||W||_F")),
                      needs=("weight",)),
    "contra": Stage(contra, options=dict(contra=Option(0.4, a_number, "ContraMuon: twice the "
                                                       "share of the unit-operator-norm "
                                                       "orthogonalizer input subtracted"))),
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
        muown_gain_exp_avg_sq=_row_spec()), reads=("muown_gain_grad",), options=dict(
        muown_betas=Option((0.9, 0.95), a_pair_of_betas, "Muown: Adam's betas on the gains"),
        muown_gain_lr=Option(1.0, a_number, "Muown: the gains' lr as a factor on the group lr"),
        muown_v_norm_target=Option(2.496, lambda v: None if v is None else a_number(v),
                                   "Muown: the row norm of v the schedule ends at (None: no "
                                   "schedule)"),
        muown_v_norm_power=Option(1.2, a_number, "Muown: the schedule's power")),
        check=_muown_check, flags=Flags(logical=True, weight_decay=False)),
}
# group key -> its registry; precondition and post_process take a sequence of names
STAGE_KEYS = {"precondition": PRECONDITIONERS, "orthogonalizer": ORTHOGONALIZERS,
              "post_process": POST_PROCESSORS, "apply": APPLIERS}
CHAIN_KEYS = ("precondition", "post_process")


def names(value) -> tuple:
    return (value,) if isinstance(value, str) else tuple(value or ())


def stage(key: str, name: str) -> Stage:
    entry = STAGE_KEYS[key][name]
    return entry if isinstance(entry, Stage) else Stage(entry)


def group_stages(group: dict) -> list[tuple[str, str, Stage]]:
    """(key, name, Stage) of every stage a muon group runs, in order."""
    return [(key, name, stage(key, name)) for key in STAGE_KEYS for name in names(group[key])]


def stage_needs(group: dict, keys=STAGE_KEYS) -> set:
    """What the group's stages under `keys` read beyond their input (Stage.needs)."""
    return {need for key, _, s in group_stages(group) if key in keys for need in s.needs}


def applies_weight_decay(group: dict) -> bool:
    """Whether the group's weight_decay acts: in 'l2' mode, or by an apply stage that decays."""
    return group["weight_decay_mode"] == "l2" or stage("apply", group["apply"]).flags.weight_decay


def stages_used(group: dict) -> str:
    """What a muon group's update runs, in one line for a run's header."""
    parts = [f"{key} {', '.join(names(group[key])) or 'none'}" for key in STAGE_KEYS]
    owner = next((n for k, n, s in group_stages(group) if s.flags.owns_momentum), None)
    parts.append(f"momentum kept by precondition {owner!r}" if owner else "Muon's momentum")
    if not applies_weight_decay(group):
        parts.append(f"weight decay not applied (apply stage {group['apply']!r})")
    return "; ".join(parts)


def runs_eager(group: dict) -> bool:
    return any(s.flags.eager for _, _, s in group_stages(group))


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
    return grads.lerp_(momentum_buffer, h.momentum) if opts["nesterov"] else momentum_buffer


def block_shapes(shape, layout: Layout | None) -> list[tuple[int, int]]:
    split, groups, transposed = layout or (None, 1, False)
    rows, cols = (shape[-1], shape[-2]) if transposed else (shape[-2], shape[-1])
    return [(n * groups, cols) for n in split] if split else [(rows, cols)]


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


def plain_plan(plan: "MuonPlan", layout: Layout | None = None) -> "MuonPlan":
    """The plan a transposed or split matrix's blocks run under: plain matrices, or `layout`."""
    split, groups = (layout.split, layout.groups) if layout else (None, 1)
    options = dict(plan.options, split=split, qkv_split=None, split_groups=groups,
                   transposed=False)
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


def muon_update(grads, params, state: dict, h: MuonScalars, plan: "MuonPlan",
                inputs: Tensor | None = None) -> None:
    """One Muon step on K same-shape matrices (a stack or a list), in place on params and state
    (MuonPlan.state): momentum, direction, apply. inputs: stacked input covariances, when due."""
    grads = torch.stack(grads) if isinstance(grads, list) else grads  # a slice: small memory
    raw = grads.clone() if "grad" in plan.needs else None  # the momentum step overwrites grads
    out_dtype = grads.dtype  # the params'
    g = muon_momentum(grads, state.get("momentum_buffer"), params, h, plan)
    weight = None  # apply stages have the params themselves
    if "weight" in plan.needs:
        weight = params if isinstance(params, Tensor) else torch.stack(params)
    ctx = StageContext(state, h, plan, raw, weight, inputs=inputs)
    muon_apply(params, muon_direction(g, ctx, out_dtype), ctx)


def adamw_update(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                 h: AdamWScalars) -> None:
    """One AdamW step in place on p, as torch.optim.AdamW's single-tensor path (one temporary)."""
    p.mul_(1 - h.lr * h.wd)
    exp_avg.lerp_(grad, 1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    denom = exp_avg_sq.sqrt().div_((1 - h.beta2 ** h.step) ** 0.5).add_(h.eps)
    p.addcdiv_(exp_avg, denom, value=-h.lr / (1 - h.beta1 ** h.step))


def resolve_ns_precision(precision: str, device) -> str:
    """ns_precision on this device: 'auto' is bf16 where hardware.bf16_matmuls_fast, else fp32."""
    return precision if precision != "auto" else "bf16" if bf16_matmuls_fast(device) else "fp32"


def muon_layout(group: dict) -> Layout | None:
    """How a muon group's matrices are stored: None (plain (out, in)), or a Layout."""
    split = group["split"] or group["qkv_split"]
    if not split and not group["transposed"]:
        return None
    return Layout(tuple(split) if split else None, group["split_groups"], group["transposed"])


class MuonPlan(NamedTuple):
    """A muon group resolved for matrices of one shape, dtype and device (muon_plan)."""
    precondition: tuple  # the Stages, in order
    orthogonalizer: Stage
    post_process: tuple
    apply: Stage
    ns: NewtonSchulz
    method: str  # the orthogonalizer's Newton-Schulz method ('auto' where it names none)
    gram: tuple  # the logical (rows, cols) on which that method runs Gram
    layout: Layout | None
    lr_factor: float | Tensor  # the lr's factor; per row of a split matrix, a tensor there
    options: dict  # the static options (muon_options): what the stages read as ctx.group
    state: dict  # name -> StateSlot (muon_state_layout)
    specs: dict  # name -> StateSpec of all state kept per logical matrix, kept now or not
    needs: tuple  # what the direction stages read beyond their input
    eager: bool  # a stage branches on state values: the group runs uncompiled


def muon_plan(group: dict, shape, dtype: torch.dtype, device) -> MuonPlan:
    """The plan of a checked muon group for matrices of `shape` in `dtype` on `device`."""
    opts = muon_options(group, device)
    ns, layout = newton_schulz_settings(opts), muon_layout(group)
    blocks = block_shapes(shape, layout)
    method = orthogonalizer_method(opts) or "auto"
    factors = [LR_SCALES[group["lr_scale"]](*b) * group["extra_scale"] for b in blocks]
    lr_factor = factors[0]
    if len(factors) > 1:
        rows = (torch.tensor(factors).repeat_interleave(torch.tensor(layout.split))
                .repeat(layout.groups).to(device))
        lr_factor = rows.view(1, -1) if layout.transposed else rows.view(-1, 1)
    chains = {key: tuple(stage(key, name) for name in names(group[key])) for key in CHAIN_KEYS}
    specs = {name: spec for key, _, s in group_stages(group) if key in CHAIN_KEYS or s.flags.logical
             for name, spec in s.state.items()}
    return MuonPlan(chains["precondition"], stage("orthogonalizer", group["orthogonalizer"]),
                    chains["post_process"], stage("apply", group["apply"]), ns, method,
                    tuple(b for b in blocks if uses_gram(method, b, ns)), layout, lr_factor,
                    opts, muon_state_layout(shape, dtype, group), specs,
                    tuple(stage_needs(group, CHAIN_KEYS)), runs_eager(group))


def muon_hparams(group: dict, plan: MuonPlan) -> MuonScalars:
    """A muon group's per-step numbers under its plan ('l2' mode's decay is in the gradient)."""
    lr, opts = group["lr"] * plan.lr_factor, plan.options
    decay = (lr if opts["decay_lr"] == "adjusted" else group["lr"]) * group["weight_decay"]
    decay = 0.0 if opts["weight_decay_mode"] == "l2" else decay
    beta2 = group["beta2"] if group["beta2"] is not None else 0.0
    return MuonScalars(lr=lr, momentum=group["momentum"], wd=group["weight_decay"], decay=decay,
                       beta2=beta2, step=group.get("step", 0), group_lr=group["lr"])


def stage_context(group: dict, like: Tensor, state: dict | None = None, **fields) -> StageContext:
    """A context for calling a stage by hand (tests, benchmarks) on matrices like `like`."""
    plan = muon_plan(group, like.shape, like.dtype, like.device)
    return StageContext(state or {}, muon_hparams(group, plan), plan, **fields)


# What the math does not read of a group (params, per-step numbers, labels, sharded-only
# options), so groups that differ only in those share compiled graphs.
NOT_MATH = ("params", "kind", "name", "initial_lr", "lr", "momentum", "weight_decay", "beta2",
            "step", "sharded_mode", "comm_precision")


def muon_options(group: dict, device) -> dict:
    """The static options the math reads (a compiled graph's constants), ns_precision settled."""
    opts = {k: v for k, v in group.items() if k not in NOT_MATH}
    opts["ns_precision"] = resolve_ns_precision(group["ns_precision"], device)
    return opts


StateSlot = namedtuple("StateSlot", "shape dtype init nonnegative", defaults=(False,))


def muon_state_layout(shape, dtype: torch.dtype, group: dict, declared: bool = False) -> dict:
    """name -> StateSlot of a Muon param: momentum, then its stages' state, per logical matrix
    (blocks flat) for direction and logical apply stages, else per stored one. declared: also
    state the group does not keep now (a checkpoint may carry it)."""
    shape, stages = tuple(shape), group_stages(group)
    check_shared_state(stages)
    owned = any(s.flags.owns_momentum for _, _, s in stages)  # by a precondition
    out = {} if owned else {"momentum_buffer": StateSlot(shape, dtype, 0.0)}
    layout = muon_layout(group)
    blocks = block_shapes(shape, layout)
    for key, stage_name, s in stages:
        for name, spec in s.state.items():
            if spec.kept is not None and not spec.kept(group) and not declared:
                continue
            if name in out:
                raise ValueError(f"stage {stage_name!r} keeps state {name!r}, as another stage of "
                                 "this group does; give one of them another name")
            init = spec.init
            if key not in CHAIN_KEYS and not s.flags.logical:
                per = spec.shape(*shape[-2:])
            elif callable(spec.init) and key in CHAIN_KEYS:
                raise ValueError(f"stage {stage_name!r}: only apply stages may initialize state "
                                 "from the weights; give its StateSpec a number as init")
            else:
                per = ((sum(math.prod(spec.shape(*b)) for b in blocks),) if len(blocks) > 1
                       else spec.shape(*blocks[0]))
                init = LogicalInit(init, layout) if callable(init) and layout else init
            precision = dtype if spec.dtype is None else torch.promote_types(dtype, spec.dtype)
            out[name] = StateSlot((*shape[:-2], *per), precision, init, spec.nonnegative)
    return out


def check_shared_state(stages: list) -> None:
    """Refuse stages that read state no other stage declares, or declares in the other layout
    (stored against logical), and momentum owned by anything but the first precondition."""
    keeper = {name: (stage_name, key in CHAIN_KEYS or s.flags.logical)
              for key, stage_name, s in stages for name in s.state}
    for i, (key, stage_name, s) in enumerate(stages):
        if s.flags.owns_momentum and (key != "precondition" or i != 0):
            raise ValueError(f"{key} {stage_name!r} owns the momentum, which only the first "
                             "precondition may: its input is the gradient")
        for name in s.reads:
            if name not in keeper or name in s.state:
                raise ValueError(f"{key} {stage_name!r} reads state {name!r}, which no other "
                                 "stage of this group declares; name the stage that keeps it")
            if keeper[name][1] != (key in CHAIN_KEYS or s.flags.logical):
                raise ValueError(f"{key} {stage_name!r} reads state {name!r}, which "
                                 f"{keeper[name][0]!r} keeps per stored matrix; a state shared "
                                 "with a direction stage needs a logical apply stage "
                                 "(Flags(logical=True))")


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
    """Whether 'auto' runs Gram: fewer FLOPs, and not bf16, whose 8-bit mantissa lets R drift
    (Polar Express lands 0.47-0.76 from U V^T where standard bf16 lands 0.10)."""
    return dtype != torch.bfloat16 and ns_flops(shape, ns_steps, True) < ns_flops(shape, ns_steps)


def orthogonalizer_method(group: dict) -> str | None:
    """The group's orthogonalizer's Newton-Schulz method (Stage.method), None if it names none."""
    return getattr(ORTHOGONALIZERS.get(group["orthogonalizer"]), "method", None)


def orthogonalizer_running(method: str) -> str:
    """The first registered orthogonalizer whose entry runs `method` ('auto' for none)."""
    return next((name for name, entry in ORTHOGONALIZERS.items()
                 if getattr(entry, "method", None) == method), "auto")


def uses_gram(method: str, shape, ns: NewtonSchulz) -> bool:
    """Whether `method` runs Gram on a matrix of `shape`: 'gram', or 'auto' where gram_pays."""
    return method == "gram" or (
        method == "auto" and gram_pays(shape, len(ns.coefficients), ns.dtype))


def update_cost(group: dict, p: Tensor) -> float:
    """The FLOPs of one Muon param's direction (owner planning): Newton-Schulz plus stage costs."""
    opts = muon_options(group, p.device)
    ns = newton_schulz_settings(opts)
    method = orthogonalizer_method(opts)
    gram = method is not None and uses_gram(method, p.shape, ns)
    flops = ns_flops(p.shape, len(ns.coefficients), gram)
    batch = torch.Size(p.shape[:-2]).numel()
    return flops + sum(batch * s.cost(*p.shape[-2:], opts) for _, _, s in group_stages(opts)
                       if s.cost is not None)


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
