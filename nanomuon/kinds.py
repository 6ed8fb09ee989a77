"""
Kinds of update beyond Muon and AdamW, each one registry entry: its update, its state, its options.

A group's `kind` names how its params train: 'muon' and 'adamw' (nanochat's convention, written
in muon.py and run by optim.py's own paths), or a name in KINDS. An entry here is all a new kind
needs: `update(p, grad, state, h)` in place, the state it keeps per param as KindState rows (per
element, per row or per tensor), and its group keys as stages.Option rows (required=True where a
group must give the key), checked when a group is added. From the declaration alone MuonAdamW
makes the state, runs the update compiled or eager, shards it ZeRO-1 by whole rows data parallel
(as AdamW's large params; small params, and those with a per-tensor state, are updated on every
rank), runs it on DTensor params (FSDP2, tensor parallel), and saves and reshards the state in
both checkpoint formats. On a DTensor param, state per element is cut as the param and the
update runs on the local shards; state per row or per tensor is a DTensor too, cut where the
param's rows are (FSDP2's Shard(0)) and whole elsewhere, and the update runs eager on the
DTensors, whose ops sum a row's or the tensor's g^2 across the ranks that hold its pieces. Any
role can name the kind (arch.Variant's roles: it keeps its own lr and decay), from the
library or an --ideas file: `from nanomuon.kinds import KINDS, Kind, KindState`, then
`KINDS["mine"] = Kind(...)`.

Built in: Lion (Chen et al. 2023, arXiv 2302.06675) and Adam-mini (Zhang et al. 2024, arXiv
2406.16793), each tested against a float64 re-derivation (tests/test_kinds.py).
"""

import math
from collections import namedtuple
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from nanomuon.common import DTensor
from nanomuon.muon import StateSlot, kernel, scalars
from nanomuon.stages import ADAMW_OPTIONS, Option, a_number, a_pair_of_betas


class KindState(NamedTuple):
    """State a kind keeps per param, zeros at the first step. per: 'element' (the param's shape),
    'row' (one value per row of a param of 2 dims or more, shaped (..., rows, 1): leading dims are
    a batch, as Muon's and batched seeds' are; one value for fewer dims) or 'tensor' (one value).
    dtype: at least this, None for the param's."""
    per: str = "element"
    dtype: torch.dtype | None = None
    nonnegative: bool = False  # a second moment: a loaded negative value is refused


class Kind(NamedTuple):
    """A registry entry. update(p, grad, state, h) steps p (rows first: (rows, ...)) and its state
    (name -> tensor, shaped as declared) in place; numbers(group, step) gives h, the step's numbers,
    a NamedTuple of floats (0-D tensors when compiled, so schedules never recompile)."""
    update: Callable
    state: dict  # name -> KindState
    # key -> stages.Option: every key its groups take, lr and weight_decay included; a row with
    # required=True is a key a group must give (a role turned this kind takes its default)
    options: dict
    numbers: Callable
    keeps: tuple = ()  # keys a role turned this kind keeps from its group, where it has them

    @property
    def required(self) -> tuple:
        """The keys a group must give: those whose Option row says required=True."""
        return tuple(key for key, o in self.options.items() if o.required)


# The built-in kinds: each its numbers, its update and its paper.

LionNumbers = namedtuple("LionNumbers", "lr beta1 beta2 wd")


def lion_numbers(group: dict, step: int) -> LionNumbers:
    return LionNumbers(group["lr"], *group["betas"], group["weight_decay"])


def lion_update(p: Tensor, grad: Tensor, state: dict, h: LionNumbers) -> None:
    """Lion (Chen et al. 2023, arXiv 2302.06675, Algorithm 2), in place: decoupled decay p *= 1 -
    lr wd; p -= lr sign(beta1 m + (1 - beta1) g); then m <- beta2 m + (1 - beta2) g."""
    m = state["exp_avg"]
    p.mul_(1 - h.lr * h.wd)
    p.sub_(torch.sign(m.lerp(grad, 1 - h.beta1)) * h.lr)  # sign: a new tensor, m kept
    m.lerp_(grad, 1 - h.beta2)


AdamMiniNumbers = namedtuple("AdamMiniNumbers", "step lr beta1 beta2 eps wd")


def adam_mini_numbers(group: dict, step: int) -> AdamMiniNumbers:
    return AdamMiniNumbers(step, group["lr"], *group["betas"], group["eps"], group["weight_decay"])


def adam_mini_update(p: Tensor, grad: Tensor, state: dict, h: AdamMiniNumbers) -> None:
    """Adam-mini (Zhang et al. 2024, arXiv 2406.16793), in place: AdamW whose second moment v is
    one value per block, the mean of g^2 over each row of a param of 2 dims or more (a token of an
    embedding or head, as the authors' code has it), over the whole of a smaller one."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    p.mul_(1 - h.lr * h.wd)
    m.lerp_(grad, 1 - h.beta1)
    dims = (-1,) if v.dim() else tuple(range(grad.dim()))  # v: (..., rows, 1), or one value
    count = grad.shape[-1] if v.dim() else grad.numel()
    # a sum, then / count: on a DTensor cut across a row, one all_reduce of v's size (a mean of
    # uneven shards would gather the whole grad)
    mean_sq = grad.square().sum(dim=dims, keepdim=v.dim() > 0, dtype=v.dtype) / count
    v.mul_(h.beta2).add_(mean_sq * (1 - h.beta2))
    denom = (v / (1 - h.beta2 ** h.step)).sqrt_().add_(h.eps)
    p.sub_((m / denom * (h.lr / (1 - h.beta1 ** h.step))).to(p.dtype))


def _positive(v):
    return None if a_number(v) is None and v > 0 else "must be a finite number > 0"


def _options(betas: tuple, what: str, **more) -> dict:
    """The keys of an Adam-like kind: lr, betas (the paper's default), weight_decay, then more."""
    return {"lr": Option(None, a_number, "the step size; a role keeps its group's", required=True),
            "betas": Option(betas, a_pair_of_betas, f"`(beta1, beta2)`: {what}", required=True),
            "weight_decay": Option(None, a_number, "decoupled, `p *= 1 - lr weight_decay`; a role "
                                   "keeps its group's", required=True),
            **more}


KINDS = {
    "lion": Kind(
        update=lion_update, state=dict(exp_avg=KindState()),
        options=_options((0.9, 0.99), "the sign's interpolation, the momentum's EMA"),
        numbers=lion_numbers),
    "adam_mini": Kind(
        update=adam_mini_update,
        state=dict(exp_avg=KindState(),
                   exp_avg_sq=KindState("row", torch.float32, nonnegative=True)),
        options=_options((0.9, 0.999), "the EMAs of the gradient and of its per-row mean square; "
                         "a role from AdamW keeps its group's",
                         eps=Option(1e-8, _positive, "added to sqrt(v); a role from AdamW keeps "
                                    "its group's", required=True)),
        numbers=adam_mini_numbers,
        keeps=("betas", "eps")),  # AdamW's, with fewer second moments
}
PERS = ("element", "row", "tensor")
ADAMW_STATE = dict(exp_avg=KindState(), exp_avg_sq=KindState(nonnegative=True))  # optim.py's


# What the optimizer asks of a kind: its keys, its state's shapes, whether rows shard it.

def optional(kind: str) -> dict:
    """key -> Option of the keys a group of this kind may leave out, filled at their defaults;
    every group may hold `momentum`, MuonAdamW's default, which OneCycleLR and CyclicLR cycle (it
    becomes betas[0] where the kind has betas)."""
    return {"momentum": ADAMW_OPTIONS["momentum"],
            **{key: o for key, o in KINDS[kind].options.items() if not o.required}}


def state_shape(spec: KindState, shape) -> tuple:
    """The whole shape of a state of a param of `shape`."""
    shape = tuple(shape)
    if spec.per == "element":
        return shape
    if spec.per == "row" and len(shape) >= 2:
        return (*shape[:-1], 1)
    return ()


def state_slots(kind: str, shape, dtype: torch.dtype) -> dict:
    """name -> muon.StateSlot (zeros) of each state a param of `shape` and `dtype` keeps under
    `kind`, AdamW's included (Muon's stages declare theirs in stages.py): at least its dtype."""
    specs = ADAMW_STATE if kind == "adamw" else KINDS[kind].state
    return {name: StateSlot(state_shape(s, shape), dtype if s.dtype is None
                            else torch.promote_types(dtype, s.dtype), 0.0, s.nonnegative)
            for name, s in specs.items()}


def by_rows(kind: str, shape) -> bool:
    """Whether a param of `shape` updates row by row under `kind`: each state has its rows, so
    ZeRO-1 may shard it by whole rows (AdamW's always does)."""
    return kind == "adamw" or (len(shape) >= 1 and all(
        state_shape(s, shape)[:1] == tuple(shape)[:1] for s in KINDS[kind].state.values()))


def per_element(kind: str) -> bool:
    """Whether every state of `kind` is per element: on a DTensor param it then runs on the local
    shards alone (compiled where asked), as AdamW does."""
    return all(s.per == "element" for s in KINDS[kind].state.values())


def placements(p: DTensor, shape) -> tuple:
    """How a state of `shape` of DTensor param p is placed: cut as p on each dim it shares with p
    (a row's value where p's rows are cut: FSDP2's Shard(0)), else whole on every rank (a row's
    value where p's columns are cut, one value per tensor)."""
    from torch.distributed.tensor import Replicate  # only met with DTensor params

    return tuple(pl if pl.is_shard() and pl.dim < len(shape) and shape[pl.dim] == p.shape[pl.dim]
                 else Replicate() for pl in p.placements)


def fresh_state(kind: str, p: Tensor, shape) -> dict:
    """A param's new state: p is whole, a DTensor, or a flat shard of whole rows of `shape`
    (its state then flat too, as AdamW's shard is)."""
    out = {}
    for name, (whole, dtype, *_) in state_slots(kind, shape, p.dtype).items():
        if isinstance(p, DTensor):  # a DTensor too, placed as placements() says
            out[name] = torch.distributed.tensor.zeros(
                whole, dtype=dtype, device_mesh=p.device_mesh, placements=placements(p, whole))
        elif tuple(p.shape) == tuple(shape):
            out[name] = torch.zeros(whole, dtype=dtype, device=p.device)
        else:
            row = math.prod(shape[1:])
            out[name] = torch.zeros(p.numel() // row * math.prod(whole[1:]), dtype=dtype,
                                    device=p.device)
    return out


def as_rows(tensors: list[Tensor], shape, names) -> tuple[list[Tensor], bool]:
    """p, grad and the states `names` of a kind (KINDS[...].state) as views with rows first, and
    whether they can be cut by rows (CPU slices): p may be a flat shard of whole rows of `shape`."""
    p, grad, *states = tensors
    if len(shape) == 0:
        return tensors, False
    rows = p.numel() // max(1, math.prod(shape[1:]))
    out = [p.view(rows, *shape[1:]), grad.view(rows, *shape[1:])]
    for t, spec in zip(states, names.values()):
        whole = state_shape(spec, shape)
        out.append(t.view(rows, *whole[1:]) if whole else t)
    return out, all(t.dim() for t in out)


def run(group: dict, tensors: list[Tensor], shape, step: int, compiled: bool, slices) -> None:
    """One step of the group's kind on [p, grad, *state]: plain tensors (a param, its local
    shard, or a flat shard of whole rows of a param of `shape`) compiled through muon.kernel, its
    numbers muon.scalars, on CPU in slices(count, like) of whole rows where all cut by rows; or
    DTensors (a kind with a row or tensor state), eager."""
    kind = KINDS[group["kind"]]
    if tensors[0].numel() == 0:
        return
    if isinstance(tensors[0], DTensor):  # a row or tensor state: DTensor ops sum g^2 across the
        # ranks that hold pieces of it (eager: a compiled graph would hold the collectives)
        p, grad, *rest = tensors
        return kind.update(p, grad, dict(zip(kind.state, rest)), kind.numbers(group, step))
    tensors, cut = as_rows(tensors, shape, kind.state)
    h = kind.numbers(group, step)
    update = kernel(kind.update, True) if compiled else kind.update
    h = scalars(h, True) if compiled else h
    for sl in slices(len(tensors[0]), tensors[0][0]) if cut else [None]:
        p_rows, g_rows, *rest = (t if sl is None else t[sl] for t in tensors)
        update(p_rows, g_rows, dict(zip(kind.state, rest)), h)


def check_entry(label: str, name: str) -> None:
    """A registered kind's entry as a group names it: numbers a function, each state per one of
    PERS (param_groups.check_group_values checks the group's keys against its options)."""
    kind = KINDS[name]
    if not callable(kind.numbers):  # an entry written with a tuple of required keys before it
        raise ValueError(f"{label}: kind {name!r} has numbers={kind.numbers!r}, not a "
                         "function: write Kind(update, state, options, numbers, keeps), and "
                         "mark each key a group must give required=True in its Option row")
    if bad := [n for n, s in kind.state.items() if s.per not in PERS]:
        raise ValueError(f"{label}: kind {name!r} declares state {bad[0]!r} per "
                         f"{kind.state[bad[0]].per!r}; give KindState(per=) one of {PERS}")


def check_kind_numbers(label: str, group: dict, numbers: tuple) -> None:
    """What schedules edit, at every step: the kind's rows of those keys."""
    for key, option in KINDS[group["kind"]].options.items():
        if key in numbers and key in group and (wrong := option.check(group[key])):
            raise ValueError(f"{label}: {key}={group[key]!r} {wrong}; fix the value you pass (or "
                             f"your LR schedule, if it sets {key})")


def role_start(kind: str, source: dict) -> dict:
    """A role turned to `kind`: its own lr and weight decay (those of the group it leaves) and the
    keys the kind keeps (Kind.keeps) where that group has them, else the kind's defaults."""
    k = KINDS[kind]
    start = {key: source[key] if key in k.keeps and key in source else k.options[key].default
             for key in k.required}
    return dict(start, kind=kind, lr=source["lr"], weight_decay=source["weight_decay"])


def options_table(kind: str) -> str:
    """The markdown table of a registered kind's keys (docs/optimizer.md holds them): the default
    is what a group that may leave the key out gets, or a role turned this kind."""
    rows = [f"| `{key}` | {'yes' if o.required else 'no'} | "
            f"{'' if o.default is None and o.required else f'`{o.default!r}`'} | {o.doc} |"
            for key, o in {**KINDS[kind].options, **optional(kind)}.items()]
    return "\n".join(["| key | required | default | what it does |", "|---|---|---|---|", *rows])
