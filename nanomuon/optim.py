"""
Muon + AdamW in one optimizer, MuonAdamW, on one device or data parallel over a process group.

Background. Muon (Keller Jordan, 2024: https://kellerjordan.github.io/posts/muon/, first used
in modded-nanogpt) trains the hidden matrices of a network with SGD momentum whose update is
replaced by the nearest semi-orthogonal matrix: with momentum M = U S V^T, the step is along
U V^T. Why: the gradient of a weight matrix is nearly low rank, so a plain step moves a few
directions a lot and the rest hardly at all; setting every singular value to 1 gives each
direction the same step size: steepest descent under the spectral norm, the norm that bounds how
much a layer's output can change (Jeremy Bernstein:
https://jeremybernste.in/writing/deriving-muon). U V^T is approximated by a few Newton-Schulz
iterations, odd matrix polynomials that push every singular value towards 1 using matmuls only,
stable in bf16. Embeddings, the output head and vectors (gains) train with AdamW, as in Jordan's
Muon: an embedding is a lookup table, not a map between hidden states, and the head trained
better with AdamW there.

The defaults are those of nanochat's late-2025 Muon (Andrej Karpathy,
https://github.com/karpathy/nanochat), one muon-group key each: stages.MUON_OPTIONS holds the
options' defaults, while momentum, ns_steps and beta2 have none and come from the caller
(arch.param_groups gives them). arch.ARCHS['nanochat'] adds what nanochat 92d63d4 runs on top:
MuonEq's rows scaled to their mean norm before orthogonalizing ('equilibrate_row_mean'), Muon+'s
Frobenius rescale after it ('normalize_fro') and beta2=0.9:
- nesterov=True: Nesterov momentum (momentum=0.95 in nanochat's groups), as in Jordan's Muon.
- ns_coefficients='polar_express', ns_steps=5: Polar Express's quintic per iteration (Amsel et
  al. 2025, https://arxiv.org/abs/2505.16932), nearer U V^T in 5 steps than Jordan's one triple.
- ns_precision='auto': bf16 where bf16 matmuls are fast (CUDA, CPUs with AVX512-BF16 or AMX).
- post_process=('variance_reduction',), beta2=0.95: NorMuon's neuron-wise normalization (Li et
  al. 2025, https://arxiv.org/abs/2510.05491) in nanochat's form, after orthogonalizing.
- apply='cautious': Cautious Weight Decay (Chen et al. 2025, https://arxiv.org/abs/2510.12402),
  only where update and weight agree in sign, by the lr with its factor (decay_lr='adjusted').
- lr_scale='shape': the lr times sqrt(max(1, rows/cols)), Jordan's and torch.optim.Muon's factor.
The update runs in stages (precondition, orthogonalize, post-process, apply): muon.py writes the
update a step runs once for every path, with the default stages; stages.py holds the registries
a group picks the alternatives from by name (docs/optimizer.md has their sources) and resolves a
group into the MuonPlan a step runs. reference.py defines the update in float64; this file runs
it: phases, communication and state. MuonAdamW's docstring maps its methods: the step's, in the
order they run, and the copy and checkpoint contract's.

Groups follow nanochat's `kind` convention ('muon' for matrices, 'adamw' for the rest), checked
whole when added and when a key changes; a step checks only what schedules edit (check_numbers).
With a process group (DistMuonAdamW: the default one) the step is ZeRO-1: 1. every grad is averaged
over the ranks in place; 2. each Muon matrix is updated by its owner (owners.py), each large AdamW
param by rows across the ranks, small ones everywhere; 3. every rank gathers every updated param
back, bitwise identical. DTensor params (FSDP2, tensor parallel) go through sharded.py.
"""

import copy
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from nanomuon import kinds, muon, stages
from nanomuon.owners import owner_buckets, update_cost
from nanomuon.param_groups import (
    ADDED,
    NAMES,
    DamagedState,
    added_keys,
    cast_state,
    check_group,
    check_group_values,
    check_state_dict,
    fill_defaults,
    given_groups,
    group_label,
    has_dtensors,
    saved_params,
    split_names,
    state_values_problem,
)
from nanomuon.sharded import (
    DeviceMesh,
    DTensor,
    Shard,
    check_sharded_stages,
    full_state,
    kept_direction_state,
    local,
    muon_step_sharded,
    state_piece,
)


def flat_shard(numel: int, rank: int, world_size: int, row: int = 1) -> tuple[int, int, int]:
    """(shard size, lo, hi): rank's piece [lo, hi) of a flat tensor of rows of `row` elements, cut
    in equal shards of whole rows as DTensor's Shard(0) cuts dim 0; the last may be short. Whole
    rows, so a rank's piece of a large AdamW param is one block of a sharded checkpoint. Called by
    MuonAdamW._rows and _gather."""
    shard = -(-(numel // row) // world_size) * row  # ceil(rows / N) rows: only the tail is short
    lo = min(numel, rank * shard)
    return shard, lo, min(numel, lo + shard)


class Resolved(NamedTuple):
    """What a param group's static keys (all but params and NUMBERS) resolve to: made by
    MuonAdamW._resolve, kept per group index until the group's signature changes."""
    signature: str  # group_signature at the time
    # (shape, dtype, device) -> muon.MuonPlan, made on first use: each decides part of a plan (the
    # lr factor and Gram by shape, the state's dtype by dtype, ns_precision 'auto' by device)
    plans: dict
    input_every: int | None  # steps between reads of its matrices' inputs; None: never
    sharded: bool  # it holds DTensor params (sharded.py)

    def inputs_due(self, group: dict) -> bool:  # at the group's next step
        return self.input_every is not None and (group["step"] + 1) % self.input_every == 0


# What schedules edit, checked at every step; a change of any other key resolves the group again.
NUMBERS = stages.keys_with("scheduled")  # the rows that say so (stages.GROUP_KEYS, OPTIONS)


def group_signature(group: dict) -> str:
    """The group's keys, and their values but its params' and NUMBERS', and whether beta2 is set
    (it decides a state): groups of one signature resolve alike (options, stages, state). NUMBERS'
    values change every step and stay out; which of them a group has stays in. A repr, as values
    may be unhashable lists. _resolve compares it at every step, _muon_stacks keys stacks by it."""
    static = sorted((k, v) for k, v in group.items() if k not in (*NUMBERS, "params", NAMES))
    return repr((static, sorted(k for k in group if k in NUMBERS), group.get("beta2") is None))


def check_numbers(i: int, group: dict) -> None:
    """What schedules edit (lr, weight decay, momentum, beta2, betas, eps) and step. Run when a
    group is added and at every step (_begin_step): a schedule may write any of them between
    steps, and a bad value must stop the step before any param moves."""
    if group["kind"] in kinds.KINDS:
        return kinds.check_kind_numbers(group_label(i, group), group, NUMBERS)
    adamw = group["kind"] == "adamw"
    betas = group["betas"] if adamw else (0.0, 0.0)  # a muon group has none: a pair that passes
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{group_label(i, group)}: betas={betas!r} must be a pair (beta1, beta2), "
                         "e.g. betas=(0.9, 0.95)")
    # (key, value, exclusive upper bound or None)
    numbers = [("lr", group["lr"], None), ("weight_decay", group["weight_decay"], None)]
    if adamw:
        numbers += [("betas[0]", betas[0], 1.0), ("betas[1]", betas[1], 1.0),
                    ("eps", group["eps"], None)]
    # None is allowed where it means off (beta2: no variance reduction) or unset (AdamW's
    # momentum, which only a scheduler sets); a muon group's momentum is always checked
    numbers += [(k, group[k], 1.0) for k in ("momentum", "beta2")
                if group.get(k) is not None or (k == "momentum" and not adamw)]
    for key, value, hi in numbers:
        if key == "lr" and isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()  # a Tensor lr, as torch.optim takes: the step reads it anyway
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and value >= 0 and (hi is None or value < hi)):
            raise ValueError(f"{group_label(i, group)}: {key}={value!r} must be a finite number "
                             f"{'in [0.0, 1.0)' if hi else '>= 0.0'}; fix the value you pass (or "
                             f"your LR schedule, if it sets {key})")
    step = group.get("step", 0)  # the updates so far, which the optimizer counts
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        raise ValueError(f"{group_label(i, group)}: step={step!r} must be an int >= 0 (the "
                         "updates so far)")


class MuonAdamW(torch.optim.Optimizer):
    """Muon for matrices, AdamW for the rest (docs/optimizer.md); with process_group, data
    parallel with no DDP wrapper: step() reduces the grads itself and frees them (None on return).
    Muon state is one stacked buffer per bucket (the same-shape matrices a rank updates), which
    each param's state views (_muon_stacks). compile: run the update through torch.compile; None:
    on for CUDA params.

    The methods, in file order:
    - Making and copying: __init__, _forget_caches; the copy contract (deepcopy, pickle,
      torch.save): __getstate__, __deepcopy__ and __setstate__ over _copied_state; then
      add_param_group, which checks a group whole before torch takes it.
    - Stages that read a layer's inputs: wants_inputs, give_inputs (before step()).
    - The step. On one device, step() runs: _begin_step (check_numbers, and _resolve with _plan,
      which call stages.muon_plan once per group and shape), _owned_buckets (_group_buckets on
      the first step), then group by group _update_adamw_group (_adamw_step into
      muon.adamw_update, or _kind_step into kinds.run) or _update_muon_bucket (_muon_stacks, then
      muon.muon_update once per _cpu_slices slice). Data parallel adds _has_grad,
      _launch_reductions (phase 1), _update_adamw_shard, _write_back (phase 3) and the
      communication helpers after _muon_stacks; DTensor Muon params go to
      sharded.muon_step_sharded.
    - The checkpoint contract, last: state_dict (_gather_state) and load_state_dict
      (_pre_hooked, _state_layout, _cut, _torch_load) in torch's whole format, any world size;
      sharded_state_dict and load_sharded_state_dict (_dcp_form) for torch.distributed.checkpoint,
      each rank its own pieces."""

    SMALL = 1024  # data parallel: params with fewer elements are all_reduced, updated everywhere
    CPU_SLICE = 4 * 1024 * 1024  # elements per fused kernel call on CPU (see _cpu_slices)
    # How params are laid out and sharded is this run's choice, not the checkpoint's.
    STRUCTURAL_KEYS = stages.keys_with("structural")

    def __init__(self, param_groups, compile: bool | None = None, process_group=None,
                 **defaults):
        groups = given_groups(param_groups, defaults)
        # a 'momentum' default lets OneCycleLR and CyclicLR cycle it (AdamW's beta1: _begin_step)
        super().__init__(groups, defaults={"momentum": None})
        params = [p for g in self.param_groups for p in g["params"]]
        self.compiled = any(p.is_cuda for p in params) if compile is None else bool(compile)
        # per group: (param ids, buckets), plain Muon params' owners; the ids tell
        # _owned_buckets that a group's params changed
        self._buckets = []
        self._inputs = {}  # param -> its input covariance, for this step only (give_inputs)
        self._forget_caches()
        self.pg, self.rank, self.world_size = process_group, 0, 1
        if process_group is None:
            return
        # flat sharding views each param as p.view(-1): refused here, not midway through a step
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if not isinstance(p, DTensor) and not p.is_contiguous():
                    raise ValueError(f"{group_label(i, group)}, param {j}: DistMuonAdamW shards "
                                     "params as flat memory and needs contiguous params; use "
                                     "p.data = p.data.contiguous()")
        self.rank, self.world_size = (dist.get_rank(process_group),
                                      dist.get_world_size(process_group))
        # gloo in older torch lacks ReduceOp.AVG: there the sum is taken, the reduced shard scaled
        self._use_avg = dist.get_backend(process_group) == "nccl"
        self._scatter = self._use_avg  # reduce-scatter and all_gather on nccl, else broadcasts

    def _forget_caches(self) -> None:
        """Drop what is made again on use: stacked state, resolved groups, flags, the mesh, the
        DTensor params' owners. At construction and after a copy or unpickle, whose params are
        new tensors with new ids."""
        # a bucket's owned params' ids, in order -> (group signature, name -> (K, *slot) stack)
        self._stacks = {}
        self._resolved = {}  # group index -> Resolved, made again when its keys change
        self._ones = None  # grad-presence flags of a rank that has every grad (_has_grad)
        self._mesh = None  # a DeviceMesh of the process group, for sharded checkpoints (_dcp_form)
        self._sharded_owners = {}  # DTensor Muon params' owners and blocks (sharded.py)

    # Copies: deepcopy, pickle and torch.save of the optimizer. The caches are made again; the
    # process group, a live handle, is shared by a copy in this process and re-bound on unpickle.
    CACHES = ("_stacks", "_resolved", "_ones", "_mesh", "_sharded_owners", "pg")

    def _copied_state(self) -> dict:
        """What a copy keeps: torch's (defaults, state, groups; hooks dropped, as torch does) and
        this optimizer's settings and owners, with the owners' param ids noted by position."""
        state = {k: v for k, v in self.__dict__.items()
                 if k not in self.CACHES and not k.startswith("_optimizer_")}
        return dict(state, _buckets=[bs for _, bs in self._buckets])

    def __getstate__(self) -> dict:
        """pickle's and torch.save's: the copied state, the process group by name, as a live
        handle cannot travel; only the default group can be found again on unpickle."""
        if self.pg is not None and self.pg != dist.group.WORLD:
            raise TypeError("a DistMuonAdamW over a process group other than the default one "
                            "cannot be pickled (a live handle); save optimizer.state_dict() "
                            "and load it into a new DistMuonAdamW instead")
        return dict(self._copied_state(), pg="default" if self.pg is not None else None)

    def __deepcopy__(self, memo: dict):
        """copy.deepcopy's: state, groups and owners copied, the process group shared."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied  # before copying: a reference back to self resolves to the copy
        copied.__setstate__(dict(copy.deepcopy(self._copied_state(), memo), pg=self.pg))
        return copied

    def __setstate__(self, state: dict) -> None:
        """Two callers: torch's load_state_dict, with state and groups alone, and unpickle or
        __deepcopy__, with a whole _copied_state. The owners' param ids are re-keyed by
        position: a copy's params are new tensors."""
        if "pg" not in state:  # torch's load_state_dict, setting state and groups alone
            super().__setstate__(state)
            # torch adds it, and its add_param_group would copy it into a new group, which
            # refuses keys no group takes
            self.defaults.pop("differentiable", None)
            return
        pg = state.pop("pg")
        if pg == "default":  # unpickled: this process's default group, of the same rank and size
            where = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None
            if where != (state["rank"], state["world_size"]):
                raise ValueError(f"this DistMuonAdamW was pickled on rank {state['rank']} of "
                                 f"{state['world_size']}; unpickle it there (init_process_group "
                                 "first), or load its state_dict() at any world size")
            pg = dist.group.WORLD
        self.__setstate__(state)  # torch's part, as on a load
        self.pg = pg
        self._buckets = [(tuple(id(p) for p in g["params"]), bs)
                         for g, bs in zip(self.param_groups, self._buckets)]
        self._forget_caches()

    def add_param_group(self, group: dict) -> None:
        """Check the group completely (structure, keys, values, params) before torch sees it."""
        i = len(self.param_groups)
        if isinstance(group, dict) and "params" in group:
            params = group["params"]
            # listed once: a generator would be spent by the checks before torch reads it
            group["params"] = [params] if isinstance(params, Tensor) else list(params)
            split_names(i, group)  # (name, tensor) pairs, as torch.optim takes them
        check_group(i, group)
        check_numbers(i, group)
        seen = {p: (gi, j) for gi, g in enumerate(self.param_groups)
                for j, p in enumerate(g["params"])}
        for j, p in enumerate(group["params"]):  # torch refuses these too, naming neither
            if p in seen:
                where = (f"param group {seen[p][0]} (param {seen[p][1]})" if seen[p][0] != i
                         else f"param {seen[p][1]}")
                raise ValueError(f"{group_label(i, group)}, param {j} is already in {where}; "
                                 "each parameter must appear exactly once across all groups")
            seen[p] = (i, j)
        super().add_param_group(group)
        fill_defaults(self.param_groups[-1])  # state_dict() records what actually ran
        if group["kind"] == "muon" and has_dtensors(group["params"]):  # here, not at step 1
            check_sharded_stages(group_label(i, group), self.param_groups[-1])

    def wants_inputs(self) -> bool:
        """Whether the next step has a stage that reads its matrices' inputs (Newton-Muon): the
        loop then collects them (GPT.forward(input_stats=True)) for give_inputs() before step()."""
        return any(self._resolve(i, g).inputs_due(g) for i, g in enumerate(self.param_groups))

    @torch.no_grad()
    def give_inputs(self, inputs: dict) -> None:
        """This step's input covariances, param -> (..., blocks, b, b), each this rank's mean over
        its tokens (stages.input_covariance); averaged over the ranks here for the owners."""
        params = [p for i, g in enumerate(self.param_groups) if self._resolve(i, g).inputs_due(g)
                  for p in g["params"]]
        if missing := [i for i, p in enumerate(params) if p not in inputs]:
            raise ValueError(f"give_inputs: {len(missing)} of the {len(params)} matrices whose "
                             "stage reads its inputs this step have none; collect every "
                             "matrix's (GPT.forward(input_stats=True))")
        for p in params:
            if tuple(inputs[p].shape) != (want := (*p.shape[:-2], *stages.input_shape(*p.shape[-2:]))):
                raise ValueError(f"give_inputs: a {tuple(p.shape)} matrix's inputs are "
                                 f"{tuple(inputs[p].shape)}, not {want} "
                                 "(stages.input_covariance of this model's own inputs)")
        stats = [inputs[p].detach().float() for p in params]  # fp32: the stage inverts them
        if self.world_size > 1:  # one all_reduce for all of them
            flat = torch.cat([t.flatten() for t in stats])
            self._all_reduce(flat).wait()
            self._finish_mean(flat)
            stats = [t.view_as(s) for t, s in zip(flat.split([s.numel() for s in stats]), stats)]
        # a covariance's trace bounds its entries: finite traces keep the stage's damping finite.
        # Checked after the mean, so every rank sees the same values and refuses alike
        if bad := sum(not bool(t.diagonal(dim1=-2, dim2=-1).sum(-1).isfinite().all()) for t in stats):
            raise ValueError(f"give_inputs: {bad} of the {len(stats)} input covariances hold NaN, "
                             "inf or values whose trace overflows fp32; skip this step's refresh "
                             "(as a non-finite loss is skipped) or look for overflowing activations")
        self._inputs = dict(zip(params, stats))

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every param with a grad (on any rank), in three phases: 1. start every
        grad reduction; 2. group by group, wait for its grads, update what this rank updates and
        start its gathers, so earlier groups' gathers travel while later groups compute; 3. wait
        for the gathers and copy in what arrived. One device runs phase 2 alone."""
        inputs, self._inputs = self._inputs, {}  # this step's alone, used or not
        loss = self._begin_step(closure, inputs)
        buckets = self._owned_buckets()  # planned at the first step, then kept with the state
        params = [p for g in self.param_groups for p in g["params"]]
        # a grad on any rank makes a param active; a missing grad elsewhere counts as zeros (as DDP)
        single = self.world_size == 1
        active = dict(zip(params, [p.grad is not None for p in params] if single
                          else self._has_grad(params)))
        # counted before the update, as stages read this step's count (StageContext.step), and
        # over all ranks' grads, so it is the same on every rank. AdamW and the other kinds count
        # per param, as torch.optim.AdamW does
        for group in self.param_groups:
            if group["kind"] == "muon" and any(active[p] for p in group["params"]):
                group["step"] += 1
        reductions = dict(muon={}) if single else self._launch_reductions(buckets, active)  # 1
        gathers = []  # 2: group by group, wait, update what this rank owns, start the gathers
        for gi, group in enumerate(self.param_groups):
            if group["kind"] != "muon":  # AdamW's and the other kinds' routes
                gathers += self._update_adamw_group(group, active, reductions)
                continue
            for bi, b in enumerate(buckets):
                # a bucket with no grad on any rank started no reduction and takes no step
                if b["group"] == gi and (bi in reductions["muon"] or single):
                    gathers.append(self._update_muon_bucket(group, b, active,
                                                            reductions["muon"].get(bi), inputs))
            if self._resolved[gi].sharded:  # FSDP2 / TP params
                muon_step_sharded(group, self.state, self._sharded_owners,
                                  self._resolved[gi].plans, self.compiled)
        if not single:
            self._write_back(gathers, active)  # 3: wait for the gathers, copy in what arrived
        return loss

    def _begin_step(self, closure, inputs: dict):
        """The closure's loss, then every check that can fail, before any math runs."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, group in enumerate(self.param_groups):
            every = self._resolve(i, group).input_every
            check_numbers(i, group)
            # a scheduler that cycles momentum (OneCycleLR, CyclicLR) sets AdamW's beta1 through it
            if group.get("momentum") is not None and "betas" in group:
                group["betas"] = (group["momentum"], group["betas"][1])
            for j, p in enumerate(group["params"]):
                g = p.grad
                if g is not None and (g.is_sparse or g.is_complex() or g.shape != p.shape):
                    wrong = ("sparse gradients are not supported; use a dense nn.Embedding "
                             "(sparse=False)" if g.is_sparse
                             else "complex gradients are not supported" if g.is_complex()
                             else f"grad shape {tuple(g.shape)} differs from param shape "
                             f"{tuple(p.shape)}")
                    raise ValueError(f"{group_label(i, group)}, param {j}: {wrong}")
            due = every is not None and (group["step"] + 1) % every == 0
            if due and group["params"][0] not in inputs:
                raise ValueError(f"{group_label(i, group)}: a stage reads its matrices' inputs "
                                 "this step (input_interval); collect them with GPT.forward("
                                 "input_stats=True) and pass them to give_inputs() before step()")
        return loss

    def _resolve(self, i: int, group: dict) -> Resolved:
        """The group's Resolved, made again (the group checked whole) when a static key changed.
        Called at every step (_begin_step): the signature's compare is all a step pays."""
        kept = self._resolved.get(i)
        if kept is None or kept.signature != group_signature(group):
            # edited since add_param_group (a stage switched on, a key deleted): its defaults
            fill_defaults(group)
            check_group_values(i, group)
            kept = self._resolved[i] = Resolved(group_signature(group), {}, None,
                                                has_dtensors(group["params"]))
            if group["kind"] == "muon" and group["params"]:
                # input_interval is a group option, alike for every shape: one plan answers
                every = self._plan(i, group, group["params"][0]).input_every
                kept = self._resolved[i] = kept._replace(input_every=every)
        return kept

    def _plan(self, i: int, group: dict, p: Tensor) -> muon.MuonPlan:
        """The group's MuonPlan for matrices like p, made on first use."""
        plans, key = self._resolve(i, group).plans, (tuple(p.shape), p.dtype, p.device)
        # not setdefault alone: its argument, a whole plan, would be made at every call
        return plans.get(key) or plans.setdefault(key, stages.muon_plan(group, *key))

    def _owned_buckets(self) -> list[dict]:
        """The Muon buckets of plain (non-DTensor) params with their owners, planned group by group
        and kept: a group added later leaves the others' owners, and their state, in place."""
        loads = [0.0] * self.world_size  # each rank's cost so far, over all groups' buckets
        for gi, group in enumerate(self.param_groups):
            ids = tuple(id(p) for p in group["params"])
            if gi == len(self._buckets) or self._buckets[gi][0] != ids:
                if gi < len(self._buckets) and any(self.state.get(p) for b in self._buckets[gi][1]
                                                for p in b["params"]):
                    raise ValueError(f"{group_label(gi, group)}: its params changed after "
                                     "DistMuonAdamW made state for them; add new params in a new "
                                     "group with add_param_group()")
                self._buckets[gi:gi + 1] = [(ids, self._group_buckets(gi, group, loads))]
            for b in self._buckets[gi][1]:
                loads = [load + len(slots) * b["cost"] for load, slots in zip(loads, b["slots"])]
        return [b for _, buckets in self._buckets for b in buckets]

    def _group_buckets(self, gi: int, group: dict, loads: list[float]) -> list[dict]:
        """One group's buckets, with owners balanced against `loads` (what each rank owns). Each
        is owner_buckets' dict plus: group, params (its members), mine (this rank's positions in
        them), rows ((position, row) in the (N * per_rank, *shape) buffer of the reductions),
        theirs (the rows other ranks update) and padding (the rows no matrix fills)."""
        matrices = ([p for p in group["params"] if not isinstance(p, DTensor)]
                    if group["kind"] == "muon" else [])  # DTensors: sharded.py's owners
        # a bucket is one stacked tensor: one shape, dtype and device
        keys = [(tuple(p.shape), p.dtype, p.device) for p in matrices]
        costs = [update_cost(self._plan(gi, group, p), p.shape) for p in matrices]
        buckets = []
        for b in owner_buckets(keys, costs, self.world_size, loads):
            # every rank's stack pads to per_rank: rows are (position, row of the gathered stack)
            rows = [(i, r * b["per_rank"] + j) for r, slots in enumerate(b["slots"])
                    for j, i in enumerate(slots)]
            theirs = [(i, row) for i, row in rows if row // b["per_rank"] != self.rank]
            padding = sorted(set(range(self.world_size * b["per_rank"])) - {row for _, row in rows})
            buckets.append(dict(b, group=gi, params=[matrices[i] for i in b["members"]],
                                mine=b["slots"][self.rank], rows=rows, theirs=theirs,
                                padding=padding))
        return buckets

    def _adamw_route(self, p: Tensor, kind: str = "adamw") -> str:
        """How an AdamW (or other kind's) param's grad is reduced: 'dtensor', 'local', 'small' or
        'sharded'; a param whose kind keeps a per-tensor state is updated whole, as a small one.
        The step, _gather_state and _state_layout all ask here, so state lives where each looks."""
        return ("dtensor" if isinstance(p, DTensor) else "local" if self.world_size == 1
                else "small" if p.numel() < self.SMALL
                or (kind != "adamw" and not kinds.by_rows(kind, p.shape))
                else "sharded")

    def _launch_reductions(self, buckets: list[dict], active: dict) -> dict:
        """Phase 1: start every grad reduction, in place; a Muon bucket's into one buffer.
        Returns small [(params, flat buffer, work)], sharded {param: (work, flat grad)} and muon
        {bucket index: (work, (N * per_rank, *shape) buffer)}, for phase 2 to wait on."""
        N = self.world_size
        # active on another rank but without a grad here: zeros, so every rank joins (as DDP)
        grad_or_zeros = lambda p: p.grad if p.grad is not None else torch.zeros_like(p)
        adamw = [(p, g["kind"]) for g in self.param_groups if g["kind"] != "muon"
                 for p in g["params"] if active[p]]  # AdamW's, and the other kinds'
        small, by_dtype = [], {}  # (params, flat buffer, work): one coalesced all_reduce per dtype
        for p in (p for p, kind in adamw if self._adamw_route(p, kind) == "small"):
            by_dtype.setdefault(p.dtype, []).append(p)
        for ps in by_dtype.values():
            buf = torch.cat([grad_or_zeros(p).reshape(-1) for p in ps])
            small.append((ps, buf, self._all_reduce(buf)))
        sharded = {}  # param -> (work, flat grad: reduced in place)
        for p in (p for p, kind in adamw if self._adamw_route(p, kind) == "sharded"):
            flat = grad_or_zeros(p).reshape(-1)
            # reduce_scatter_tensor cuts N equal chunks: pad (a copy of this grad)
            if self._scatter and (pad := N * self._rows(p)[0] - p.numel()):
                flat = torch.cat([flat, flat.new_zeros(pad)])
            sharded[p] = (self._reduce(flat), flat)
        muon = {}  # bucket index -> (work, buffer of the bucket's grads)
        for bi, b in enumerate(buckets):
            if not any(active[p] for p in b["params"]):
                continue
            # rank r's matrices at rows r * per_rank on: the reduce-scatter leaves each owner
            # exactly its own grads, and the same buffer takes the gathered params back
            buf = b["params"][0].new_empty((N * b["per_rank"], *b["params"][0].shape))
            for row in b["padding"]:  # new_empty's garbage would be reduced and gathered
                buf[row].zero_()
            for i, row in b["rows"]:
                p = b["params"][i]
                buf[row].copy_(grad_or_zeros(p))  # no grad on this rank counts as zeros (as in DDP)
                p.grad = None  # freed as packed: the buffer takes the memory it gives back
            muon[bi] = (self._reduce(buf), buf)
        return dict(small=small, sharded=sharded, muon=muon)

    def _update_adamw_group(self, group: dict, active: dict, reductions: dict) -> list:
        """AdamW (or a kind of kinds.py) on what this rank updates of the group's active params;
        returns the gathers, as (works, target, buffer): target None (gathered in place) or a
        padded param."""
        gathers = []
        step = self._adamw_step if group["kind"] == "adamw" else self._kind_step
        for p in (p for p in group["params"] if active[p]):
            route = "local" if self.world_size == 1 else self._adamw_route(p, group["kind"])
            if route in ("dtensor", "local"):  # reduced already, or nothing to reduce
                step(group, p, p.grad, self.state[p])
            elif route == "small":
                if "small_grads" not in reductions:  # the first small param waits for all of them
                    reductions["small_grads"] = {}
                    for ps, buf, work in reductions["small"]:
                        work.wait()
                        self._finish_mean(buf)
                        reductions["small_grads"].update(
                            zip(ps, torch.split(buf, [q.numel() for q in ps])))
                step(group, p, reductions["small_grads"][p].view_as(p), self.state[p])
            else:
                gathers.append(self._update_adamw_shard(group, p, *reductions["sharded"][p]))
        return gathers

    def _update_adamw_shard(self, group: dict, p: Tensor, work, flat: Tensor):
        """AdamW on this rank's flat shard of p, then the gather that rebuilds p on every rank."""
        work.wait()
        _, lo, hi = self._rows(p)
        self._finish_mean(flat[lo:hi])
        p_flat = p.view(-1)
        if group["kind"] == "adamw":
            self._adamw_step(group, p_flat[lo:hi], flat[lo:hi], self.state[p])
        else:  # rows of p, flat: the kind's state flat too
            self._kind_step(group, p_flat[lo:hi], flat[lo:hi], self.state[p], p.shape)
        if len(flat) == p.numel():  # gather straight into the param; our shard is in place
            return self._gather(p_flat, p.numel(), p), None, None
        flat[lo:hi].copy_(p_flat[lo:hi])  # through the padded buffer
        return self._gather(flat, p.numel(), p), p, flat

    def _update_muon_bucket(self, group: dict, b: dict, active: dict, reduced,
                            inputs: dict) -> tuple | None:
        """Muon on the bucket's matrices this rank owns, in place. b: a bucket of _group_buckets.
        reduced: None on one rank, else (work, buffer) of the reduction: the new values go into
        this rank's chunk, then gathered. Returns None or (gather works, b, buffer)."""
        mine = [b["params"][i] for i in b["mine"]]
        idx = [k for k, p in enumerate(mine) if active[p]]  # those with a grad on some rank
        if reduced is not None:
            work, buf = reduced
            work.wait()  # even with nothing to update: the gather below reuses buf
        if idx:
            # _begin_step resolved the group: read its plans with no signature compare (_plan's)
            p0, plans = mine[0], self._resolved[b["group"]].plans
            key = (tuple(p0.shape), p0.dtype, p0.device)
            plan = plans.get(key) or plans.setdefault(key, stages.muon_plan(group, *key))
            compiled = self.compiled and not plan.eager  # eager: a stage branches on state values
            if reduced is None:  # eager: a list, stacked slice by slice in small memory
                grads = [mine[k].grad for k in idx]
                grads = torch.stack(grads) if compiled else grads
            else:
                rows = self._own_chunk(buf)[:len(mine)]  # our chunk: our matrices, then padding
                self._finish_mean(rows)
                grads = rows if len(idx) == len(mine) else rows[idx]  # rows[idx]: a copy
            params = [mine[k] for k in idx]
            # compiled: a stack (a list would recompile per length), copied back below
            stacked = torch.stack(params) if compiled else params
            everyone = len(idx) == len(mine)
            state = self._muon_stacks(plan, mine, self._resolved[b["group"]].signature)
            if not everyone:  # index_select copies: the moved state is written back below
                sel = torch.tensor(idx, device=p0.device)
                whole, state = state, {name: t[sel] for name, t in state.items()}
            h = muon.muon_hparams(group, plan)
            update = muon.kernel(muon.muon_update, True) if compiled else muon.muon_update
            h = muon.scalars(h, True) if compiled else h  # 0-D tensors: a new lr keeps the graph
            # Newton-Muon's covariances, stacked like the params; None on the steps between reads
            inputs = torch.stack([inputs[p] for p in params]) if params[0] in inputs else None
            # on CPU, slices keep the update's temporaries small (_cpu_slices); on GPUs, one call
            for sl in self._cpu_slices(len(idx), p0):
                update(grads[sl], stacked[sl], {name: t[sl] for name, t in state.items()}, h, plan,
                       None if inputs is None else inputs[sl])
            if not everyone:
                for name, t in state.items():
                    whole[name][sel] = t
            if compiled:  # the stack was a copy
                torch._foreach_copy_(params, list(stacked.unbind(0)))
            if reduced is not None:  # into our chunk, which the in-place gather sends everyone
                torch._foreach_copy_([rows[k] for k in idx], params)
        return None if reduced is None else (self._gather(buf, len(buf)), b, buf)

    def _write_back(self, gathers: list, active: dict) -> None:
        """Phase 3: wait for the gathers, copy what arrived into the params, drop the grads."""
        for works, target, buf in (g for g in gathers if g is not None):
            for work in works:
                work.wait()
            if isinstance(target, Tensor):  # a padded AdamW param (None: gathered in place)
                target.view(-1).copy_(buf[:target.numel()])
            elif target is not None:  # a Muon bucket: the other ranks' matrices (ours are updated)
                rows = [(target["params"][i], row) for i, row in target["theirs"]
                        if active[target["params"][i]]]
                if rows:
                    torch._foreach_copy_([p for p, _ in rows], [buf[row] for _, row in rows])
        # step() consumes the grads it reduced: None, as after zero_grad()
        for p in (p for g in self.param_groups for p in g["params"] if not isinstance(p, DTensor)):
            p.grad = None

    def _kind_step(self, group: dict, p: Tensor, grad: Tensor, state: dict, shape=None) -> None:
        """A registered kind's step (kinds.KINDS) on p: a whole param, a DTensor, or a flat shard
        of whole rows of a param of `shape`; its state made as declared at the first."""
        shape = p.shape if shape is None else shape
        if not state:
            state.update(kinds.fresh_state(group["kind"], p, shape), step=0)
        state["step"] += 1
        tensors = [p, grad, *(state[name] for name in kinds.KINDS[group["kind"]].state)]
        if isinstance(p, DTensor) and kinds.per_element(group["kind"]):  # on the local shards
            tensors = [local(t, p) for t in tensors]
            shape = tensors[0].shape
        kinds.run(group, tensors, shape, state["step"], self.compiled, self._cpu_slices)

    def _adamw_step(self, group: dict, p: Tensor, grad: Tensor, state: dict) -> None:
        """AdamW on p (a whole param, or this rank's flat shard of one)."""
        if not state:  # zeros_like of a DTensor param is a DTensor sharded like it
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"] += 1
        tensors = (p, grad, state["exp_avg"], state["exp_avg_sq"])
        if isinstance(p, DTensor):  # elementwise: run on the local shards
            tensors = tuple(local(t, p) for t in tensors)
        if tensors[0].numel() == 0:  # an empty shard: a rank past a short param's last row
            return
        if all(t.is_contiguous() for t in tensors):  # elementwise: flat views slice exactly
            tensors = tuple(t.view(-1) for t in tensors)
        # float(): a Tensor lr too, as torch.optim takes one
        h = muon.AdamWScalars(state["step"], float(group["lr"]), *group["betas"], group["eps"],
                         group["weight_decay"])
        update = muon.kernel(muon.adamw_update, True) if self.compiled else muon.adamw_update
        h = muon.scalars(h, True) if self.compiled else h
        for sl in self._cpu_slices(len(tensors[0]), tensors[0][0]):
            update(*(t[sl] for t in tensors), h)

    def _cpu_slices(self, count: int, like: Tensor) -> list[slice]:
        """The dim-0 slices an update of `count` tensors like `like` runs in: one on GPUs, of <=
        CPU_SLICE elements on CPU, as glibc page-faults temporaries over 32 MB on every call."""
        if like.is_cuda or count * like.numel() <= self.CPU_SLICE:
            return [slice(None)]
        per = max(1, self.CPU_SLICE // like.numel())
        return [slice(i, i + per) for i in range(0, count, per)]

    def _muon_stacks(self, plan, params: list[Tensor], signature: str) -> dict:
        """name -> one stacked buffer per state these same-shape params keep, as the group's
        signature now asks; per-param state views them. A state of another shape starts afresh.
        Stacked so the update runs one batched call with no stack or unstack of state per step,
        while self.state[p][name] stays a tensor of p's own (a view), as torch's state_dict()
        and load_state_dict() expect. Kept until the group's signature or the params change."""
        key = tuple(id(p) for p in params)  # this rank's matrices of the bucket, in order
        if key in self._stacks and self._stacks[key][0] == signature:
            return self._stacks[key][1]
        p0, stacks = params[0], {}
        for name, slot in plan.state.items():
            out = torch.empty((len(params), *slot.shape), dtype=slot.dtype, device=p0.device)
            for i, p in enumerate(params):
                old = self.state[p].get(name)
                # a loaded or unstacked tensor's values move into the stack; then p's state
                # becomes the stack's row
                out[i].copy_(old if old is not None and tuple(old.shape) == slot.shape
                             else muon.fresh_state(slot, p))
                self.state[p][name] = out[i]
            stacks[name] = out
        self._stacks[key] = (signature, stacks)
        return stacks

    # Communication (data parallel only). This rank's chunk of buf's dim 0, cut in N equal chunks:
    def _own_chunk(self, buf: Tensor) -> Tensor:
        return buf.chunk(self.world_size)[self.rank]

    def _reduce(self, buf: Tensor):
        """Start the mean over the ranks of buf, in place, at least of _own_chunk(buf): a
        reduce-scatter on nccl; elsewhere an all_reduce, faster than gloo's reduce-scatter."""
        if self._scatter:  # on nccl, which averages (_use_avg)
            return dist.reduce_scatter_tensor(self._own_chunk(buf), buf, op=dist.ReduceOp.AVG,
                                              group=self.pg, async_op=True)
        return self._all_reduce(buf)

    def _rows(self, p: Tensor, rank: int | None = None, shape=None) -> tuple[int, int, int]:
        """flat_shard of an AdamW param: (shard size, lo, hi) of rank's whole rows of p, flat;
        shape: of a state with p's rows (another kind's), its own piece of those rows."""
        shape = tuple(p.shape if shape is None else shape)
        numel = math.prod(shape)
        row = numel // shape[0] if shape and shape[0] else 1
        return flat_shard(numel, self.rank if rank is None else rank, self.world_size, row)

    def _gather(self, buf: Tensor, n: int, p: Tensor | None = None) -> list:
        """Start giving every rank each rank's piece of buf's first n elements (p's rows, or
        single elements), in place: an all_gather on nccl, elsewhere one broadcast per rank, as
        gloo's all_gather copies its whole input and runs slower (docs/optimizer.md)."""
        if self._scatter:
            return [dist.all_gather_into_tensor(buf, self._own_chunk(buf), group=self.pg,
                                                async_op=True)]
        cuts = [(self._rows(p, r) if p is not None else flat_shard(n, r, self.world_size))[1:]
                for r in range(self.world_size)]
        return [dist.broadcast(buf[lo:hi], group=self.pg, group_src=r, async_op=True)
                for r, (lo, hi) in enumerate(cuts) if hi > lo]

    def _all_reduce(self, t, op=None):
        """Start an all_reduce of t in place: the mean over the ranks (on gloo their sum, which
        _finish_mean divides), or op's."""
        if op is None:  # a MuonAdamW over DTensors asks only op's: it has no _use_avg
            op = dist.ReduceOp.AVG if self._use_avg else dist.ReduceOp.SUM
        return dist.all_reduce(t, op=op, group=self.pg, async_op=True)

    def _finish_mean(self, t: Tensor) -> None:
        """The mean of a reduced t, in place: a division where the backend summed (gloo)."""
        if not self._use_avg:
            t.mul_(1.0 / self.world_size)

    def _any_rank(self, flags: list[bool]) -> list[bool]:
        """flags OR-ed over the ranks (a MAX all_reduce): a collective, so every rank must call
        it with as many flags, and reads the result back to the host."""
        device = next(p for g in self.param_groups for p in g["params"]).device
        t = torch.tensor(flags, dtype=torch.int32, device=device)
        self._all_reduce(t, op=dist.ReduceOp.MAX).wait()
        return [bool(f) for f in t.tolist()]

    def _has_grad(self, params: list[Tensor]) -> list[bool]:
        """Whether each param has a grad on some rank. A rank holding every grad reads nothing
        back to the host: it joins the flags' all_reduce with a cached all-ones tensor."""
        mine = [p.grad is not None for p in params]
        if not all(mine):
            return self._any_rank(mine)
        if self._ones is None or len(self._ones) != len(params):
            self._ones = torch.ones(len(params), dtype=torch.int32, device=params[0].device)
        self._all_reduce(self._ones, op=dist.ReduceOp.MAX).wait()
        return mine

    # State: torch's format of the whole state (export, tools), and a sharded checkpoint's.
    def state_dict(self) -> dict:
        """The whole optimizer state in torch's format, on every rank, for load_state_dict() at
        any world size. Data parallel or with DTensor params, a collective: call it on all ranks.
        Training checkpoints use sharded_state_dict(), where each rank writes only its pieces."""
        N, sd = self.world_size, self._marked(super().state_dict())
        params = [p for g in self.param_groups for p in g["params"]]
        if N > 1:
            index = {id(p): k for k, p in enumerate(params)}
            # keys a state_dict hook added beside the params' indices, kept as they are
            others = {k: v for k, v in sd["state"].items() if not isinstance(k, int)}
            sd["state"] = {**others, **{index[id(p)]: st
                                        for p, st in self._gather_state(params).items()}}
        return (full_state(self.param_groups, self.state, self._sharded_owners, sd)
                if has_dtensors(params) else sd)

    def _gather_state(self, params: list[Tensor]) -> dict:
        """Data parallel: param -> its whole state (DTensor params' as this rank holds it). Every
        rank runs every collective here in the same order, so the loops follow params and
        buckets, which all ranks list alike, never what this rank happens to hold."""
        N, kind_of = self.world_size, [g["kind"] for g in self.param_groups for _ in g["params"]]
        # a param has state if any rank made it: its holder may be another rank
        has = dict(zip(params, self._any_rank([bool(self.state.get(p)) for p in params])))
        full = {p: {} for p in params if has[p]}
        for p, kind in zip(params, kind_of):
            if not has[p] or (kind == "muon" and not isinstance(p, DTensor)):
                continue  # plain Muon params: gathered per bucket below
            st = self.state[p]
            if isinstance(p, DTensor):  # sharded.full_state gathers these
                full[p] = dict(st)
            elif self._adamw_route(p, kind) == "small":  # whole on every rank
                full[p] = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in st.items()}
            else:
                full[p]["step"] = st["step"]
                # every rank's rows of each state
                for name, (shape, *_) in kinds.state_slots(kind, p.shape, p.dtype).items():
                    shard, lo, hi = self._rows(p, shape=shape)
                    out = st[name].new_empty(shard * N)  # every rank's shard, padded alike
                    dist.all_gather_into_tensor(out, torch.nn.functional.pad(
                        st[name], (0, shard - (hi - lo))), group=self.pg, async_op=True).wait()
                    full[p][name] = out[:math.prod(shape)].view(shape).clone()
        for b in self._owned_buckets():
            if not any(has[p] for p in b["params"]):
                continue
            p0, mine = b["params"][0], [b["params"][i] for i in b["mine"]]
            group = self.param_groups[b["group"]]
            for name, slot in self._plan(b["group"], group, p0).state.items():  # as all ranks
                stack = torch.zeros((b["per_rank"], *slot.shape), dtype=slot.dtype,
                                    device=p0.device)
                for k, p in enumerate(mine):  # state not made yet: what the next step makes
                    stack[k].copy_(self.state[p][name] if name in self.state[p]
                                   else muon.fresh_state(slot, p))
                out = stack.new_empty((b["per_rank"] * N, *slot.shape))
                dist.all_gather_into_tensor(out, stack, group=self.pg, async_op=True).wait()
                for i, row in b["rows"]:
                    if has[b["params"][i]]:
                        full[b["params"][i]][name] = out[row].clone()
        return full

    def _torch_load(self, state_dict: dict) -> None:
        """torch's load_state_dict, keeping this run's structural options, filling defaults newer
        than the checkpoint, and stage state back in its own dtype (torch casts it), then the
        post-hooks. The last part of both loads, given a state already cut to this rank's pieces."""
        keep = [{k: g[k] for k in self.STRUCTURAL_KEYS if k in g} for g in self.param_groups]
        pre, post = (self._optimizer_load_state_dict_pre_hooks,
                     self._optimizer_load_state_dict_post_hooks)
        self._optimizer_load_state_dict_pre_hooks = self._optimizer_load_state_dict_post_hooks = {}
        # the hooks run in our load_state_dict(), around the checks: torch's must not run them
        # again, so they are set aside for its call
        try:
            torch.optim.Optimizer.load_state_dict(self, state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre
            self._optimizer_load_state_dict_post_hooks = post
        for group, kept in zip(self.param_groups, keep):
            group.pop(ADDED, None)  # the saved list of other code's keys, not a key itself
            group.update(kept)
            if (method := group.pop("ns_method", None)) is not None:  # before orthogonalizer
                group.setdefault("orthogonalizer", stages.orthogonalizer_running(method))
            fill_defaults(group)
        by_id = saved_params(self.param_groups, state_dict)
        # torch casts floating state to the param's dtype: right for AdamW's moments and Muon's
        # momentum, which are kept in it, wrong for a stage's or kind's state kept in its own
        own_dtype = {p for g in self.param_groups if g["kind"] != "adamw" for p in g["params"]}
        for pid, st in state_dict["state"].items():
            p = by_id[pid]
            for name, v in st.items():  # the saved dtype (fp32), not torch's cast copy
                if (p in own_dtype and name != "momentum_buffer" and isinstance(v, Tensor)
                        and v.dtype != p.dtype):
                    self.state[p][name] = v.to(p.device, v.dtype, copy=True)
        # per-param states are fresh tensors now, views of no stack: re-stack on next use
        self._stacks.clear()
        self._resolved.clear()  # the groups are the checkpoint's now: check them whole
        for hook in self._optimizer_load_state_dict_post_hooks.values():  # as torch's, last
            hook(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (state_dict(), saved at any world size): each rank keeps its own
        pieces. A collective where DTensor Muon params have owners. As torch's: the pre-hooks
        first (they may adapt the checkpoint), floating state cast, the post-hooks last."""
        state_dict = check_state_dict(self.param_groups, self._pre_hooked(state_dict))
        # every rank holds the whole state: all find the same problem, and none waits in a
        # collective for one that raised
        if problem := state_values_problem(self.param_groups, state_dict):
            raise DamagedState(problem)
        self._torch_load(self._cut(state_dict, self._state_layout()))

    def _pre_hooked(self, state_dict: dict) -> dict:
        """A shallow copy of state_dict through the load pre-hooks, as torch runs them."""
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            if (result := hook(self, state_dict)) is not None:
                state_dict = result
        return state_dict

    def _marked(self, sd: dict) -> dict:
        """A state_dict whose groups list the keys other code added to them (ADDED), so a load
        keeps them while refusing keys no group takes."""
        for saved, group in zip(sd["param_groups"], self.param_groups):
            if keys := added_keys(group):
                saved[ADDED] = keys
        return sd

    def _state_layout(self):
        """where(p, name, shape): how this rank holds state `name` of p: None, 'whole', a DTensor
        block (mesh, placements) or a slice of the flat param. A collective (DTensor owners).
        The one rule for both loads and sharded_state_dict: what a rank saves is what it reads."""
        kept = kept_direction_state(self.param_groups, self._sharded_owners)
        kind_of = self._kind_of()
        owned = {b["params"][i] for b in self._owned_buckets() for i in b["mine"]}

        def where(p, name, shape):
            if isinstance(p, DTensor):
                if kind_of[p] == "muon" and name != "momentum_buffer":  # whole, on p's owner
                    return "whole" if id(p) in kept else None
                return p.device_mesh, kinds.placements(p, shape)  # p's, or a row's or tensor's
            if kind_of[p] == "muon":
                return "whole" if p in owned else None
            if (self._adamw_route(p, kind_of[p]) == "sharded" and len(shape)
                    and shape[0] == p.shape[0]):  # a state with p's rows: this rank's rows of it
                return slice(*self._rows(p, shape=shape)[1:])
            return "whole"
        return where

    def _cut(self, sd: dict, where) -> dict:
        """A whole state (state_dict() format) cut down to what this rank holds, as where() says;
        meta tensors become empty pieces, the targets a sharded checkpoint is read into."""
        by_id, state = saved_params(self.param_groups, sd), {}
        for pid, st in sd["state"].items():
            p = by_id[pid]
            hows = {name: where(p, name, v.shape) if isinstance(v, Tensor) else "whole"
                    for name, v in st.items()}
            if mine := {name: state_piece(v, hows[name], p) for name, v in st.items()
                        if hows[name] is not None}:
                state[pid] = mine
        return dict(sd, state=state)

    def _kind_of(self) -> dict:
        """param -> its group's kind."""
        return {p: g["kind"] for g in self.param_groups for p in g["params"]}

    def _dcp_form(self, v: Tensor, shape, how, device) -> Tensor:
        """v as a sharded checkpoint stores it: a flat shard of rows as a DTensor block of the
        whole state, of `shape`, so torch.distributed.checkpoint can reshard it to any world
        size on load; other pieces are stored as they are."""
        if not isinstance(how, slice):
            return v
        if self._mesh is None:  # over this optimizer's ranks; made only for checkpoints
            self._mesh = DeviceMesh.from_group(self.pg or dist.group.WORLD, device.type)
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))  # contiguous
        return DTensor.from_local(v.view(-1, *shape[1:]), self._mesh, (Shard(0),),
                                  shape=torch.Size(shape), stride=stride, run_check=False)

    def sharded_state_dict(self) -> tuple[dict, dict]:
        """This rank's state for a sharded checkpoint: (tensors['<index>.<name>'], each state tensor
        it holds, a DTensor block where so; the rest). A collective (DTensor owners)."""
        # torch's state_dict, not ours: no gather, each rank saves what it holds
        where, sd = self._state_layout(), self._marked(torch.optim.Optimizer.state_dict(self))
        params, kind_of = [p for g in self.param_groups for p in g["params"]], self._kind_of()
        tensors, rest = {}, {}
        for idx, st in sd["state"].items():
            p = params[idx]
            for name, v in st.items():
                if isinstance(v, Tensor):
                    # the whole state's shape: p's, or as another kind declares it
                    shape = (tuple(p.shape) if kind_of[p] == "muon"
                             else kinds.state_slots(kind_of[p], p.shape, p.dtype)[name].shape)
                    tensors[f"{idx}.{name}"] = self._dcp_form(v, shape, where(p, name, shape),
                                                              p.device)
                else:
                    rest.setdefault(idx, {})[name] = v
        return tensors, dict(sd, state=rest)

    def load_sharded_state_dict(self, shapes: dict, rest: dict, read) -> None:
        """Load what sharded_state_dict() saved, at any world size: shapes['<index>.<name>'] =
        (shape, dtype) of each tensor; read(targets) fills this rank's pieces (DCP's load)."""
        state = {idx: dict(st) for idx, st in rest.get("state", {}).items()}
        for key, (shape, dtype) in shapes.items():
            idx, name = key.split(".", 1)
            # meta: shapes and dtypes for the hooks, the checks and the cut, with no memory
            state.setdefault(int(idx), {})[name] = torch.empty(shape, dtype=dtype, device="meta")
        like = self._pre_hooked(dict(rest, state=state))
        check_state_dict(self.param_groups, like)  # read as saved, then cast below
        where, by_id = self._state_layout(), saved_params(self.param_groups, like)
        cut = self._cut(like, where)
        whole = {pid: {name: v.shape for name, v in st.items() if isinstance(v, Tensor)}
                 for pid, st in like["state"].items()}  # as saved, after the hooks
        read({f"{pid}.{name}": self._dcp_form(v, whole[pid][name],
                                              where(by_id[pid], name, whole[pid][name]),
                                              by_id[pid].device)
              for pid, st in cut["state"].items() for name, v in st.items()
              if isinstance(v, Tensor)})
        cut = cast_state(self.param_groups, cut)
        # each rank read its own pieces: one that finds a bad value stops them all
        problem = state_values_problem(self.param_groups, cut)
        shared = self.world_size > 1 or has_dtensors(by_id.values())
        if shared and self._any_rank([problem is not None])[0] and problem is None:
            problem = "optimizer state: another process's piece of it is damaged"
        if problem:
            raise DamagedState(problem)
        self._torch_load(cut)


class DistMuonAdamW(MuonAdamW):
    """MuonAdamW, data parallel over the default process group (or process_group)."""

    def __init__(self, param_groups, compile: bool | None = None, process_group=None,
                 **defaults):
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("DistMuonAdamW needs an initialized torch.distributed process group: "
                             "launch with torchrun and call torch.distributed.init_process_group() "
                             "first, or use MuonAdamW on a single device")
        super().__init__(param_groups, compile, process_group or dist.group.WORLD, **defaults)
