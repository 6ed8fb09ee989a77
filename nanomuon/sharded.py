"""
Muon for sharded parameters: DTensor params from FSDP2, tensor parallelism, or both on a 2-D mesh
(docs/optimizer.md, "Sharded params"). The optimizers hand their DTensor params here, already
reduced; the math is muon.py's, the owners owners.py's, and this file adds the communication.
sharded_mode='owner' (the default, exact): momentum on the local shard; an all_to_all gathers whole
matrices on their owner, which orthogonalizes them stacked by shape; a second returns each rank its
block for the elementwise update. muon_step_modes() has Megatron's alternatives. The momentum
buffer is sharded like its param; the direction stages' state lives on the owner only. full_state()
gathers the whole state_dict() format; state_piece() and kept_direction_state() cut it back.

Where optim.py calls in: MuonAdamW.step runs muon_step_sharded for a group with DTensor params
(after the plain params' buckets), add_param_group runs check_sharded_stages (train_args runs it
on base_train's flags too, before a run starts), state_dict runs full_state, _state_layout runs
kept_direction_state and the loads' _cut runs state_piece. group_owners, full_state and
kept_direction_state are collectives: every rank calls them, in the same order.
"""

import contextlib
import math

import torch
import torch.distributed as dist
from torch import Tensor

from nanomuon.muon import (
    MuonPlan,
    Slices,
    StageContext,
    fresh_state,
    kernel,
    muon_apply,
    muon_direction,
    muon_hparams,
    muon_momentum,
    over_slices,
    scalars,
)
from nanomuon.owners import bucket_by, owner_buckets, update_cost
from nanomuon.param_groups import has_dtensors
from nanomuon.stages import (
    CHAIN_KEYS,
    NS_DTYPES,
    group_stages,
    muon_plan,
    muon_state_layout,
)

try:
    from torch.distributed.tensor import DeviceMesh, DTensor, Shard
    from torch.distributed.tensor._utils import (
        compute_local_shape_and_global_offset,  # private, stable since 2.4
    )
except ImportError:
    # a torch built without distributed support: there are no DTensor params to meet
    DTensor, DeviceMesh, Shard = (), None, None

# matrices each owner orthogonalizes per wave: enough to stack, few enough to overlap
WAVE_PER_RANK = 4


def local(t: Tensor, like: DTensor) -> Tensor:
    """The local shard of t laid out like `like` (redistributed first if placed otherwise)."""
    if not isinstance(t, DTensor):
        return t
    if t.placements != like.placements:
        t = t.redistribute(like.device_mesh, like.placements)
    return t.to_local()


def block_of(p: DTensor) -> tuple:
    """This rank's block of p: (global offset, local shape, whether it sends), the last False for
    every replica but the first along Replicate mesh dims."""
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    coord = p.device_mesh.get_coordinate()
    first = all(c == 0 for c, pl in zip(coord, p.placements) if pl.is_replicate())
    return tuple(offset), tuple(shape), first


def _block_index(offset, shape):
    """The index of the block at `offset` of this shape: one slice per dim."""
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def group_owners(group: dict, owners: dict, muon_plans=None) -> tuple[list[DTensor], dict]:
    """The group's DTensor Muon params and who does what (every rank's block of each, the owners
    and the waves), assigned once (a collective) and kept in `owners` so they stay put; costs
    from the group's MuonPlans (`muon_plans`, the optimizer's cache, else made here)."""
    params = [p for p in group["params"] if isinstance(p, DTensor)]
    key = (id(group), tuple(id(p) for p in params))  # other params: owners planned anew
    if key in owners:
        return params, owners[key]
    muon_plans = {} if muon_plans is None else muon_plans
    world = dist.get_world_size()
    for p in params:
        # owners are ranks of the default group, where the all_to_alls run
        ranks = sorted(p.device_mesh.mesh.flatten().tolist())
        if ranks != list(range(world)):
            raise ValueError(f"a DTensor Muon param of shape {tuple(p.shape)} lives on a mesh of "
                             f"ranks {ranks}; the sharded Muon path needs meshes that span all "
                             f"{world} ranks of the default process group (1-D for FSDP2 or TP, "
                             "2-D for FSDP2 x TP)")
        if any(pl.is_partial() for pl in p.placements):
            raise ValueError(f"a DTensor Muon param of shape {tuple(p.shape)} has a Partial "
                             f"placement {p.placements}; params must be Shard or Replicate")
    # blocks[r][i]: rank r's block of params[i]; known to all, every rank sizes each all_to_all's
    # receives from them, with no exchange of counts at a step
    blocks = [None] * world
    dist.all_gather_object(blocks, [block_of(p) for p in params])
    costs = [update_cost(plan_of(muon_plans, group, p.shape, p), p.shape) for p in params]
    buckets = owner_buckets([(tuple(p.shape), p.dtype) for p in params], costs, world)
    owner, waves = {}, []
    for b in buckets:
        owner.update({b["members"][k]: r for r, slots in enumerate(b["slots"]) for k in slots})
        for start in range(0, b["per_rank"], WAVE_PER_RANK):  # <= WAVE_PER_RANK per rank each
            waves.append(sorted(b["members"][k] for s in b["slots"]
                                for k in s[start:start + WAVE_PER_RANK]))
    owners[key] = dict(blocks=blocks, owner=owner, waves=waves, rank=dist.get_rank(), world=world)
    return params, owners[key]


def _all_to_all(pieces: list[list[Tensor]], recv_counts: list[int], device, comm_dtype):
    """Launch one async all_to_all: pieces[r] (flat tensors) go to rank r, in comm_dtype. Returns
    (work, receive buffer, send buffer); the send buffer must live until the work is done."""
    send_counts = [sum(t.numel() for t in ps) for ps in pieces]
    flat = [t for ps in pieces for t in ps]
    send = (torch.cat(flat).to(comm_dtype) if flat  # comm_precision='bf16' halves the traffic
            else torch.empty(0, dtype=comm_dtype, device=device))
    recv = torch.empty(sum(recv_counts), dtype=comm_dtype, device=device)
    return dist.all_to_all_single(recv, send, recv_counts, send_counts, async_op=True), recv, send


def _gather(assigned, params, wave, g_local, comm_dtype, per: int = 1):
    """Launch the all_to_all that sends every block of the wave's matrices to their owners (`per`
    tensors of each, stacked: the momentum step, and the raw gradient where a stage needs it)."""
    rank, world, blocks, owner = (assigned[k] for k in ("rank", "world", "blocks", "owner"))
    pieces = [[] for _ in range(world)]
    for i in wave:
        offset, shape, sends = blocks[rank][i]
        if sends and math.prod(shape):  # one replica sends; an empty block sends nothing
            pieces[owner[i]].append(g_local[i].reshape(-1))
    recv_counts = [sum(per * math.prod(blocks[src][i][1]) for i in wave
                       if owner[i] == rank and blocks[src][i][2])
                   for src in range(world)]
    return _all_to_all(pieces, recv_counts, params[wave[0]].to_local().device, comm_dtype)


def _assemble(assigned, params, wave, recv, per: int = 1) -> dict:
    """Whole matrices (per > 1: (per, *shape) stacks) of the wave's matrices I own."""
    rank, world, blocks, owner = (assigned[k] for k in ("rank", "world", "blocks", "owner"))
    mine = [i for i in wave if owner[i] == rank]
    lead = (per,) if per > 1 else ()
    full = {i: torch.empty((*lead, *params[i].shape), dtype=params[i].dtype, device=recv.device)
            for i in mine}
    at = 0
    for src in range(world):  # as the senders packed: by rank, then in wave order
        for i in mine:
            offset, shape, sends = blocks[src][i]
            n = per * math.prod(shape)
            if sends and n:
                full[i][(..., *_block_index(offset, shape))] = recv[at:at + n].view(*lead, *shape)
                at += n
    assert at == recv.numel()  # every rank derived the same layout from `assigned`
    return full


def _scatter(assigned, params, wave, updates, comm_dtype):
    """Launch the all_to_all that returns every rank (replicas too) its block of each update."""
    rank, world, blocks, owner = (assigned[k] for k in ("rank", "world", "blocks", "owner"))
    mine = [i for i in wave if owner[i] == rank]
    pieces = [[] for _ in range(world)]
    for dst in range(world):
        for i in mine:
            offset, shape, _ = blocks[dst][i]
            if math.prod(shape):
                pieces[dst].append(updates[i][_block_index(offset, shape)].reshape(-1))
    recv_counts = [sum(math.prod(blocks[rank][i][1]) for i in wave if owner[i] == src)
                   for src in range(world)]
    return _all_to_all(pieces, recv_counts, params[wave[0]].to_local().device, comm_dtype)


def cut_of(p: DTensor):
    """For 'distributed' mode: (the matrix dim p is cut along, -2 or -1, and the process group of
    the ranks holding its slices), or None when every rank holds whole matrices."""
    # Shard and FSDP2's _StridedShard (which is not a Shard subclass) both cut a dim
    mesh_dims = [i for i, pl in enumerate(p.placements)
                 if hasattr(pl, "dim") and not pl.is_partial()]
    cut = {p.placements[i].dim % p.ndim - p.ndim for i in mesh_dims}
    if not mesh_dims or cut <= set(range(-p.ndim, -2)):
        return None
    whole_world = (sorted(p.device_mesh.mesh.flatten().tolist())
                   == list(range(dist.get_world_size())))
    if len(cut) != 1 or (len(mesh_dims) > 1
                         and (len(mesh_dims) != p.device_mesh.ndim or not whole_world)):
        raise ValueError(f"sharded_mode='distributed' needs each matrix cut along one of its dims, "
                         "by one mesh dim or by all dims of a mesh over every rank; a param of "
                         f"shape {tuple(p.shape)} has placements {p.placements}. "
                         "Use sharded_mode='owner' (exact for any placement) for it")
    group = p.device_mesh.get_group(mesh_dims[0]) if len(mesh_dims) == 1 else None  # None: all
    return cut.pop(), group


def plan_of(plans: dict, group: dict, shape, p: DTensor) -> MuonPlan:
    """The group's plan for matrices of `shape` like p's, kept in the optimizer's `plans`
    (Resolved.plans at a step, shared with the group's plain params), keyed as MuonAdamW._plan
    keys them, by the local shard's device, where the math runs."""
    key = (tuple(shape), p.dtype, p.to_local().device)
    return plans.get(key) or plans.setdefault(key, muon_plan(group, *key))


def _momentum_local(group: dict, state: dict, p: DTensor, plans: dict, compiled: bool) -> Tensor:
    """Stage 1 on p's local shard; the momentum buffer is a DTensor sharded like p."""
    st = state[p]
    if "momentum_buffer" not in st:
        st["momentum_buffer"] = torch.zeros_like(p)
    plan = plan_of(plans, group, p.shape, p)
    h = scalars(muon_hparams(group, plan), compiled)
    # clone: muon_momentum overwrites its input, and the DTensor grad is the caller's
    return kernel(muon_momentum, compiled)(local(p.grad, p).clone(), local(
        st["momentum_buffer"], p), p.to_local(), h, plan)


def _apply_local(group: dict, p: DTensor, u: Tensor, matrix_shape, plans: dict,
                 compiled: bool) -> None:
    """Stage 3 on p's local shard (nothing for an empty one); matrix_shape sets the lr factor. A
    split matrix's per-row lr (and decay) is cut to this rank's rows."""
    if not u.numel():
        return
    plan = plan_of(plans, group, matrix_shape, p)
    h = scalars(muon_hparams(group, plan), compiled)
    # a whole matrix's per-row factors; 'blockwise' plans for the block, already its size
    if isinstance(h.lr, Tensor) and tuple(matrix_shape) == tuple(p.shape):
        offset, shape, _ = block_of(p)
        crop = tuple(slice(o, o + n) if full > 1 else slice(None)
                     for o, n, full in zip(offset[-2:], shape[-2:], h.lr.shape))
        h = h._replace(**{k: getattr(h, k)[crop] for k in ("lr", "decay")
                          if isinstance(getattr(h, k), Tensor)})
    ctx = StageContext({}, h, plan)  # apply stages keep no state here (check_sharded_stages)
    kernel(muon_apply, compiled)(p.to_local(), u, ctx)


def muon_step_sharded(group: dict, state: dict, owners: dict, muon_plans: dict,
                      compiled: bool) -> None:
    """One Muon step of `group`'s DTensor params with a grad (DTensor grads are collective
    results, so every rank skips the same ones), given the optimizer's state, owners and plans."""
    check_sharded_stages(group.get("name", "a muon group"), group)  # stages may change after add
    if group["sharded_mode"] != "owner":
        return muon_step_modes(group, state, muon_plans, compiled)
    params, assigned = group_owners(group, owners, muon_plans)
    if not params:
        return
    first = plan_of(muon_plans, group, params[0].shape, params[0])  # the group's facts: any shape
    compiled = compiled and not first.eager
    active = {i for i, p in enumerate(params) if p.grad is not None}
    comm_dtype = NS_DTYPES[group["comm_precision"]]
    per = 2 if "grad" in first.needs else 1  # the raw gradient travels too

    def momentum_stage(wave):
        out = {i: _momentum_local(group, state, params[i], muon_plans, compiled) for i in wave}
        return out if per == 1 else {i: torch.stack([g, local(params[i].grad, params[i])])
                                     for i, g in out.items()}

    def direction_stage(full: dict) -> dict:
        ids, out = list(full), {}
        for bucket in bucket_by([tuple(params[i].shape) for i in ids]):  # stacked by shape
            idx = [ids[k] for k in bucket]
            stacked, raw = torch.stack([full[i] for i in idx]), None
            if per > 1:
                stacked, raw = stacked[:, 0], stacked[:, 1]
            ours = plan_of(muon_plans, group, params[idx[0]].shape, params[idx[0]])
            h = scalars(muon_hparams(group, ours), compiled)
            slots = direction_slots(ours)
            for i in idx:  # on the owner, whole; made once, not every step
                for name, slot in slots.items():
                    if name not in state[params[i]]:
                        state[params[i]][name] = fresh_state(slot, stacked)
            stacks = {name: torch.stack([state[params[i]][name] for i in idx]) for name in slots}
            u = kernel(muon_direction, compiled)(
                stacked, StageContext(stacks, h, ours, raw), stacked.dtype)
            for k, i in enumerate(idx):
                out[i] = u[k]
                for name, t in stacks.items():
                    state[params[i]][name].copy_(t[k])
        return out

    def finish(pending):
        """Wait for a wave's scatter and apply my block of each update."""
        wave, (work, recv, _send) = pending
        work.wait()
        at = 0
        for i in sorted(wave, key=assigned["owner"].get):  # as packed: by sender, then wave order
            shape = assigned["blocks"][assigned["rank"]][i][1]
            u = recv[at:at + math.prod(shape)].view(shape)
            at += u.numel()
            _apply_local(group, params[i], u.to(params[i].dtype), params[i].shape, muon_plans,
                         compiled)

    waves = [w for w in ([i for i in wave if i in active] for wave in assigned["waves"]) if w]
    gather = lambda wave: _gather(assigned, params, wave, momentum_stage(wave), comm_dtype, per)
    pending_gather, pending_scatter = (gather(waves[0]) if waves else None), None
    for c, wave in enumerate(waves):
        work, recv, _send = pending_gather
        if c + 1 < len(waves):  # the next wave's gather travels while this wave computes
            pending_gather = gather(waves[c + 1])
        work.wait()
        updates = direction_stage(_assemble(assigned, params, wave, recv, per))
        scatter = (wave, _scatter(assigned, params, wave, updates, comm_dtype))
        if pending_scatter is not None:  # it finished while this wave computed
            finish(pending_scatter)
        pending_scatter = scatter
    if pending_scatter is not None:
        finish(pending_scatter)


def muon_step_modes(group: dict, state: dict, plans: dict, compiled: bool) -> None:
    """Megatron's tensor-parallel modes: 'duplicated' orthogonalizes the all-gathered matrix on
    every rank; 'distributed' runs the direction stages on slices, sums across them
    (muon.over_slices); 'blockwise' treats each local block as a matrix of its own."""
    mode = group["sharded_mode"]
    for p in group["params"]:
        if not isinstance(p, DTensor) or p.grad is None:
            continue
        g = _momentum_local(group, state, p, plans, compiled)
        raw = local(p.grad, p) if "grad" in plan_of(plans, group, p.shape, p).needs else None
        slices, matrix_shape = contextlib.nullcontext(), p.shape
        if mode == "duplicated":
            g, raw = (None if t is None else DTensor.from_local(
                t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
                for t in (g, raw))
        elif mode == "distributed":
            if (cut := cut_of(p)) is not None:
                dim, pg = cut
                slices = over_slices(Slices(lambda t, pg=pg: dist.all_reduce(t, group=pg), dim,
                                            tuple(p.shape)))
        elif not g.numel():  # blockwise, and this rank's block is empty
            continue
        else:
            matrix_shape = g.shape
        plan = plan_of(plans, group, matrix_shape, p)
        h = scalars(muon_hparams(group, plan), compiled)
        slots = direction_slots(plan)
        for name, slot in slots.items():  # made once, not every step
            if name in state[p]:
                continue
            if mode == "distributed":  # a whole matrix's per-row state, cut like g
                slot = slot._replace(shape=tuple(n if n != whole else cut for n, whole, cut
                                                 in zip(slot.shape, p.shape, g.shape)))
            state[p][name] = fresh_state(slot, g)
        ctx = StageContext({name: state[p][name] for name in slots}, h, plan, raw)
        with slices:
            u = muon_direction(g, ctx, p.dtype)
        if mode == "duplicated":
            u = u[_block_index(*block_of(p)[:2])].clone()  # our block alone: the whole is freed
        _apply_local(group, p, u, matrix_shape, plans, compiled)


def direction_slots(plan: MuonPlan) -> dict:
    """name -> StateSlot of the direction stages' state: a DTensor param's but momentum."""
    return {name: slot for name, slot in plan.state.items() if name != "momentum_buffer"}


def check_sharded_stages(label: str, group: dict) -> None:
    """Refuse the stages the sharded path cannot run, as weights, momentum and apply stages stay
    in blocks: a stage that reads whole weights, owns the momentum or (apply) keeps state. Run
    by add_param_group, the earliest point, and at each sharded step, as a group may change."""
    for key, name, s in group_stages(group):
        why = ("reads whole weight matrices, which sharded (FSDP2, tensor parallel) params keep in "
               "blocks" if "weight" in s.needs
               else "owns the momentum, which the sharded (FSDP2, tensor parallel) path keeps on "
               "each rank's block" if s.flags.owns_momentum
               else "keeps state, which the sharded (FSDP2, tensor parallel) path does not keep "
               "for apply stages (they run on blocks)" if key not in CHAIN_KEYS and s.state
               else None)
        if why:
            raise ValueError(f"{label}: {key} {name!r} {why}; use it with plain (replicated) "
                             "params")


def full_state(param_groups: list[dict], state: dict, owners: dict, sd: dict) -> dict:
    """sd (the optimizer's state_dict()) with every DTensor param's state made whole: sharded
    tensors gathered, direction state broadcast from its holders. A collective."""
    index = {id(p): k for k, p in enumerate(p for g in param_groups for p in g["params"])}
    out = {k: dict(v) for k, v in sd["state"].items()}  # sd shares the live per-param dicts
    for group in param_groups:
        dparams = [p for p in group["params"] if isinstance(p, DTensor)]
        if dparams:
            _check_whole_state_mode(group)
        for p in dparams:
            st = out.get(index[id(p)], {})
            st.update({name: v.full_tensor() for name, v in st.items() if isinstance(v, DTensor)})
        if group["kind"] != "muon" or not dparams:
            continue
        # the rank whose direction state counts: the owner, or rank 0 in 'duplicated' mode
        has = torch.tensor([int(any(n != "momentum_buffer" for n in state.get(p, {})))
                            for p in dparams], device=dparams[0].to_local().device)
        every = [torch.empty_like(has) for _ in range(dist.get_world_size())]
        dist.all_gather(every, has)
        holders = (group_owners(group, owners)[1]["owner"] if group["sharded_mode"] == "owner"
                   else [0] * len(dparams))
        for i, p in enumerate(dparams):
            holder = holders[i]
            if not every[holder][i]:  # none there yet
                continue
            st, mine = out.setdefault(index[id(p)], {}), dist.get_rank() == holder
            # what the holder has (stages named since, or switched off, may differ from the group),
            # sent first so the others can make the tensors the broadcasts fill
            held = [[(n, tuple(v.shape), v.dtype) for n, v in st.items()
                     if n != "momentum_buffer" and isinstance(v, Tensor)] if mine else None]
            dist.broadcast_object_list(held, src=holder)
            for name, shape, dtype in held[0]:
                t = (st[name].clone() if mine
                     else torch.empty(shape, dtype=dtype, device=p.to_local().device))
                dist.broadcast(t, src=holder)
                st[name] = t
    return dict(sd, state=out)


def _check_whole_state_mode(group: dict) -> None:
    """Refuse to gather or cut a group's state where its direction state lives per slice or per
    block ('distributed', 'blockwise'): it has no whole form. A (2, 2) matrix stands in for every
    shape, as only which states the group keeps matters."""
    if (group["kind"] == "muon" and group["sharded_mode"] in ("blockwise", "distributed")
            and (kept := [n for n in muon_state_layout((2, 2), torch.float32, group)
                          if n != "momentum_buffer"])):
        raise ValueError(f"{group.get('name', 'a muon group')}: with sharded_mode="
                         f"{group['sharded_mode']!r} the state {kept} is per slice and has no "
                         "whole form to save or load; to checkpoint, use sharded_mode 'owner' or "
                         "'duplicated' (or stages without state: beta2=None for variance "
                         "reduction)")


def kept_direction_state(param_groups: list[dict], owners: dict) -> set[int]:
    """ids of the DTensor Muon params whose direction state this rank keeps: those it owns in
    'owner' mode, all in 'duplicated'. A collective where groups are not yet planned."""
    kept = set()
    for group in param_groups:
        if group["kind"] != "muon" or not has_dtensors(group["params"]):
            continue
        _check_whole_state_mode(group)
        if group["sharded_mode"] != "owner":  # duplicated: every rank has the whole matrix
            kept |= {id(p) for p in group["params"]}
            continue
        dparams, assigned = group_owners(group, owners)
        kept |= {id(dparams[i]) for i, r in assigned["owner"].items() if r == assigned["rank"]}
    return kept


def state_piece(v, how, p: Tensor):
    """This rank's piece of v, a whole state value of param p, held as `how` says
    (MuonAdamW._state_layout); a meta v gives an empty target to fill. Pieces are copies."""
    if not isinstance(v, Tensor):
        return v
    device = p.to_local().device if isinstance(p, DTensor) else p.device
    empty = lambda shape: torch.empty(shape, dtype=v.dtype, device=device)
    if how == "whole":
        return empty(v.shape) if v.is_meta else v
    if isinstance(how, slice):
        return empty(how.stop - how.start) if v.is_meta else v.reshape(-1)[how].clone()
    mesh, placements = how  # p's, or a kind's state's (kinds.placements): its block of v
    shape, offset = compute_local_shape_and_global_offset(v.shape, mesh, placements)
    block = empty(shape) if v.is_meta else v[_block_index(offset, shape)].to(device).clone()
    # p's stride where the state is shaped like p (momentum, AdamW's moments); else contiguous
    stride = p.stride() if v.shape == p.shape else torch.empty(v.shape, device="meta").stride()
    return DTensor.from_local(block, mesh, placements, shape=v.shape, stride=stride,
                              run_check=False)
