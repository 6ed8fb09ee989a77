"""
DistMuonAdamW against single-device MuonAdamW, in real gloo process groups of 2, 3, 4 and 8 ranks.

Each rank gets different gradients; the reference is MuonAdamW on one process given their average.
After every step the replicated params must be bitwise identical across ranks. The model mixes the
awkward cases: two Muon shapes in one group (5 and 3 matrices), a second Muon group with other
options, a 1-D param, AdamW params whose sizes do not divide by the world size, a param with no grad
anywhere and a param with a grad on rank 0 only.
"""

import faulthandler
import io
import math
import multiprocessing
import os
import signal
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from nanomuon import checkpoint
from nanomuon.optim import DistMuonAdamW, MuonAdamW

SHAPES = {
    "muon_a": [(24, 40)] * 5 + [(48, 16)] * 3,
    "muon_b": [(32, 32)] * 3,  # the last one never gets a grad
    "adamw": [(37, 41), (40,), (64, 32), (4, 5)],  # (64, 32) has a grad on rank 0 only
    "head": [(37, 41)],
}
NO_GRAD = ("muon_b", 2)
RANK0_ONLY = ("adamw", 2)


def make_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: [torch.nn.Parameter(torch.randn(s, generator=g) * 0.5) for s in shapes] for k, shapes in SHAPES.items()}


def groups(model):
    # fp32 Newton-Schulz: these tests are about the distributed machinery, and ns_precision 'auto' is bf16 on
    # CPUs with bf16 units, where stacks of another size round differently
    return [
        dict(kind="muon", params=model["muon_a"], lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.2,
             ns_precision="fp32"),
        dict(kind="muon", params=model["muon_b"], lr=0.03, momentum=0.9, ns_steps=5, beta2=None, weight_decay=0.1,
             apply="decoupled", ns_coefficients="jordan", ns_precision="fp32"),
        dict(kind="adamw", params=model["adamw"], lr=3e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.01),
        dict(kind="adamw", params=model["head"], lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0),
    ]


def rank_grads(step, rank, world_size):
    """Rank r's grads: G_t + (r - (N-1)/2) E_t, so the mean over ranks is G_t at any world size.

    The rank-0-only param gets N G_t on rank 0 and nothing elsewhere: its mean is G_t too.
    """
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for k, shapes in SHAPES.items():
        out[k] = []
        for i, s in enumerate(shapes):
            G, E = torch.randn(s, generator=g), torch.randn(s, generator=g)
            if (k, i) == NO_GRAD or ((k, i) == RANK0_ONLY and rank != 0):
                out[k].append(None)
            elif (k, i) == RANK0_ONLY:
                out[k].append(G * world_size)
            else:
                out[k].append(G + (rank - (world_size - 1) / 2) * E)
    return out


def mean_grads(step, world_size):
    per_rank = [rank_grads(step, r, world_size) for r in range(world_size)]
    out = {}
    for k in SHAPES:
        out[k] = []
        for i in range(len(SHAPES[k])):
            gs = [pr[k][i] for pr in per_rank if pr[k][i] is not None]
            out[k].append(None if not gs else sum(gs) / world_size)  # a missing grad counts as zeros
    return out


def set_grads(model, grads):
    for k in SHAPES:
        for p, g in zip(model[k], grads[k]):
            p.grad = None if g is None else g.clone()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for k in SHAPES for p in model[k]])


def assert_replicated(model):
    assert_replicated_tensors([p for k in SHAPES for p in model[k]])


def assert_replicated_tensors(params):
    mine = torch.cat([p.detach().reshape(-1) for p in params])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    for r, other in enumerate(everyone):
        assert torch.equal(other, mine), f"rank {dist.get_rank()} params differ bitwise from rank {r}"


def assert_matches(model, ref, atol=2e-5):
    for k in SHAPES:
        for i, (p, q) in enumerate(zip(model[k], ref[k])):
            torch.testing.assert_close(p, q, rtol=0, atol=atol, msg=lambda m, k=k, i=i: f"{k}[{i}]: {m}")


def save_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load_bytes(data):
    return torch.load(io.BytesIO(data))


# -- process plumbing ----------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks fork from a server process that imported these once a session: a spawned rank imports
# torch and nanomuon anew, about 4 s of each distributed test. The server imports and runs nothing
# else (no op starts torch's thread pools), so a fork of it starts as a fresh process would.
multiprocessing.set_forkserver_preload([
    "torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor",
    "nanomuon.checkpoint", "nanomuon.gpt", "nanomuon.optim", "nanomuon.sharded", "nanomuon.seeds"])


def _entry(rank, world_size, port, environ, cwd, fn, args):
    faulthandler.enable()  # a native abort in a worker prints every thread's Python stack
    # the caller's environment and folder, as a spawned rank inherits them (a fork has the server's)
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.chdir(cwd)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # nobody tears down gloo while a peer is still finishing its last collective
    except BaseException:
        dist.destroy_process_group()
        raise  # spawn reports the traceback
    # Destroyed before the interpreter finalizes: a gloo group alive then can abort in its C++ destructors
    # ("terminate called without an active exception", pytorch/pytorch#190489). Workers exit normally, so
    # such an abort would fail the test instead of hiding.
    dist.destroy_process_group()


def spawn(fn, world_size, *args):
    """fn(rank, world_size, *args) on gloo ranks forked from the server above. A worker killed by a signal
    (not a failed assertion, which raises ProcessRaisedException) gets one retry with a warning: gloo's
    teardown aborts rarely ("terminate called without an active exception", then SIGSEGV; seen about once
    per two full suites), and a real crash fails again."""
    for attempt in (1, 2):
        try:
            return mp.start_processes(
                _entry, args=(world_size, _free_port(), dict(os.environ), os.getcwd(), fn, args),
                nprocs=world_size, join=True, start_method="forkserver")
        except mp.ProcessExitedException as e:
            if attempt == 2 or e.signal_name is None:
                raise
            warnings.warn(f"{fn.__name__} at world {world_size}: {e}; retrying once", stacklevel=2)


# -- workers -------------------------------------------------------------------------------------


def integer_grads(shapes, step, rank=0, world=1):
    """Rank r's grads of params of these shapes: G + (r - (N-1)/2) E, whose mean over the ranks is G
    at any world size; integers (and halves), so the mean is G exactly however it is taken (SOAP's
    eigenbases and Adam's normalizations amplify any rounding)."""
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for s in shapes:
        G, E = (torch.randint(-4, 5, s, generator=gen).float() for _ in range(2))
        out.append(G + (rank - (world - 1) / 2) * E)
    return out


def integer_mean_grads(shapes, step, world):
    """The mean over the ranks of integer_grads: G, exactly."""
    return [sum(gs) / world
            for gs in zip(*(integer_grads(shapes, step, r, world) for r in range(world)))]


def steps_beside_one_device(rank, world, model_fn, groups_fn, setting, grads_fn, mean_grads_fn,
                            steps, atol):
    """DistMuonAdamW on this rank's grads_fn(step, rank, world) beside MuonAdamW in one process on
    their mean, mean_grads_fn(step, world): after every step the ranks bitwise alike and each
    param within atol of one device's. Returns (model, ref, opt, ref_opt) for further checks."""
    model, ref = model_fn(), model_fn()
    opt, ref_opt = DistMuonAdamW(groups_fn(model, setting)), MuonAdamW(groups_fn(ref, setting))
    for step in range(steps):
        for p, g in zip(model, grads_fn(step, rank, world)):
            p.grad = g
        for p, g in zip(ref, mean_grads_fn(step, world)):
            p.grad = g
        opt.step()
        ref_opt.step()
        assert_replicated_tensors(model)
        for p, q in zip(model, ref):
            torch.testing.assert_close(p, q, rtol=0, atol=atol)
    return model, ref, opt, ref_opt


def _resume_worker(rank, world, path, mode, model_fn, groups_fn, setting, grads_fn):
    """'save': 3 steps, then a sharded checkpoint; 'load': read it at this world size, 3 more steps."""
    model = model_fn()
    module = torch.nn.ParameterList(model)
    opt = DistMuonAdamW(groups_fn(model, setting))
    if mode == "load":
        checkpoint.load_into(path, 3, module, opt)
    for step in range(3) if mode == "save" else range(3, 6):
        for p, g in zip(model, grads_fn(step, rank, world)):
            p.grad = g
        opt.step()
    if mode == "save":
        tensors, files = checkpoint.state_of(module, opt)
        checkpoint.save_checkpoint(path, 3, tensors, dict(step=3), files)
    elif rank == 0:
        torch.save([p.detach() for p in model], path / "resumed.pt")


def resumes_at_another_world_size(path, model_fn, groups_fn, setting, grads_fn, mean_grads_fn,
                                  atol):
    """Groups groups_fn(model, setting) of model_fn()'s params, saved at 2 ranks (each its own
    pieces of the state), resumed at 3: the run equals an uninterrupted one on one device, fed
    mean_grads_fn(step, world), the mean of the ranks' grads_fn(step, rank, world)."""
    spawn(_resume_worker, 2, path, "save", model_fn, groups_fn, setting, grads_fn)
    spawn(_resume_worker, 3, path, "load", model_fn, groups_fn, setting, grads_fn)
    ref = model_fn()
    opt = MuonAdamW(groups_fn(ref, setting))
    for step in range(6):
        for p, g in zip(ref, mean_grads_fn(step, 2 if step < 3 else 3)):
            p.grad = g
        opt.step()
    for p, q in zip(torch.load(path / "resumed.pt"), ref):
        torch.testing.assert_close(p, q, rtol=0, atol=atol)


def _equivalence_worker(rank, world_size, steps, scatter=None):
    model, ref = make_model(), make_model()
    opt, ref_opt = DistMuonAdamW(groups(model)), MuonAdamW(groups(ref))
    if scatter is not None:  # which collectives: reduce-scatter + all_gather (nccl's) or all_reduce + broadcasts
        opt._scatter = scatter
    untouched = model[NO_GRAD[0]][NO_GRAD[1]].detach().clone()
    for step in range(steps):
        set_grads(model, rank_grads(step, rank, world_size))
        set_grads(ref, mean_grads(step, world_size))
        opt.step()
        ref_opt.step()
        assert_replicated(model)
        assert_matches(model, ref)
        assert all(p.grad is None for k in SHAPES for p in model[k]), "step() leaves the grads it reduced as None"
    assert torch.equal(model[NO_GRAD[0]][NO_GRAD[1]], untouched)
    moved = (flat(model) - flat(make_model())).abs().max().item()
    assert moved > 0.05, moved
    # Each Muon matrix with grads has state on exactly one rank, its owner; none on two.
    muon = [p for k in ("muon_a", "muon_b") for p in model[k]]
    holders = torch.tensor([int(bool(opt.state.get(p))) for p in muon])
    dist.all_reduce(holders)
    no_grad = len(SHAPES["muon_a"]) + NO_GRAD[1]  # may hold zero state if its owner stacks its shape anyway
    assert holders.max() == 1 and all(h == 1 for i, h in enumerate(holders.tolist()) if i != no_grad), holders
    # the whole state_dict round trip (a collective) at the same world size continues bitwise identically
    sd = save_bytes(opt.state_dict())
    saved_params = {k: [p.detach().clone() for p in ps] for k, ps in model.items()}
    for step in range(steps, steps + 3):
        set_grads(model, rank_grads(step, rank, world_size))
        opt.step()
    resumed = {k: [torch.nn.Parameter(t.clone()) for t in ts] for k, ts in saved_params.items()}
    opt2 = DistMuonAdamW(groups(resumed))
    opt2._scatter = opt._scatter
    opt2.load_state_dict(load_bytes(sd))
    for step in range(steps, steps + 3):
        set_grads(resumed, rank_grads(step, rank, world_size))
        opt2.step()
    assert torch.equal(flat(resumed), flat(model))


@pytest.mark.parametrize("world_size", [2, *(pytest.param(n, marks=pytest.mark.heavy) for n in (3, 4)),
                                        pytest.param(8, marks=pytest.mark.slow)])
def test_dist_equals_single_device(world_size):
    spawn(_equivalence_worker, world_size, 8)


@pytest.mark.parametrize("world_size", [3, pytest.param(4, marks=pytest.mark.heavy)])
def test_dist_equals_single_device_with_nccl_collectives(world_size):
    """nccl's in-place reduce-scatter and all_gather (gloo runs all_reduce and broadcasts), run here on gloo."""
    spawn(_equivalence_worker, world_size, 4, True)


def _presence_worker(rank, world_size):
    model, ref = make_model(), make_model()
    opt, ref_opt = DistMuonAdamW(groups(model)), MuonAdamW(groups(ref))
    reads, any_rank = [], opt._any_rank  # the flags' all_reduce, waited for and read back on the host
    opt._any_rank = lambda flags: reads.append(len(reads)) or any_rank(flags)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        grads = {k: [torch.randn(s, generator=g) for s in shapes] for k, shapes in SHAPES.items()}
        set_grads(ref, grads)
        if step == 2:  # the last rank has no grad for one matrix; the others make up its share of the mean
            grads["muon_a"][0] = None if rank == world_size - 1 else grads["muon_a"][0] * world_size / (world_size - 1)
        set_grads(model, grads)
        opt.step()
        ref_opt.step()
        assert_replicated(model)
        assert_matches(model, ref)
    assert len(reads) == (1 if rank == world_size - 1 else 0), reads


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.heavy)])
def test_grad_presence_needs_no_host_sync_when_every_grad_is_there(world_size):
    """DistMuonAdamW learns which params have a grad on some rank without reading anything back on a rank
    that holds every grad; a rank missing one reads the flags, and the update still matches MuonAdamW."""
    spawn(_presence_worker, world_size)


def _checkpoint_worker(rank, world_size, mode, path, steps):
    """mode 'save': run `steps` steps, save full state. 'resume': load it and run to 2*steps. 'straight': 2*steps."""
    model = make_model()
    opt = DistMuonAdamW(groups(model))
    first = 0
    if mode == "resume":
        saved = torch.load(path + ".ckpt")
        for k in SHAPES:
            for p, t in zip(model[k], saved["params"][k]):
                p.data.copy_(t)
        opt.load_state_dict(saved["opt"])
        # resharding is lossless: gathering right after loading gives back exactly what was saved
        again = opt.state_dict()
        for pid, st in saved["opt"]["state"].items():
            for name, v in st.items():
                assert torch.equal(torch.as_tensor(again["state"][pid][name]), torch.as_tensor(v)), (pid, name)
        first = steps
    last = steps if mode == "save" else 2 * steps
    for step in range(first, last):
        set_grads(model, rank_grads(step, rank, world_size))
        opt.step()
    full = opt.state_dict()  # a collective: every rank takes part
    if rank == 0:
        params = {k: [p.detach().clone() for p in ps] for k, ps in model.items()}
        torch.save(dict(params=params, opt=full), path + (".ckpt" if mode == "save" else f".{mode}"))


@pytest.mark.heavy
def test_full_state_saved_at_world_2_resumes_at_world_3(tmp_path):
    path = str(tmp_path / "run")
    spawn(_checkpoint_worker, 2, "save", path, 4)
    spawn(_checkpoint_worker, 3, "resume", path, 4)
    spawn(_checkpoint_worker, 3, "straight", path, 4)
    resumed, straight = torch.load(path + ".resume"), torch.load(path + ".straight")
    # The first 4 steps averaged over 2 ranks instead of 3: equal up to fp32 rounding of the mean.
    for k in SHAPES:
        for p, q in zip(resumed["params"][k], straight["params"][k]):
            torch.testing.assert_close(p, q, rtol=0, atol=2e-5)
    # The full state is MuonAdamW's format: a single process continues from it too.
    saved = torch.load(path + ".ckpt")
    model = {k: [torch.nn.Parameter(t.clone()) for t in ts] for k, ts in saved["params"].items()}
    single = MuonAdamW(groups(model))
    single.load_state_dict(saved["opt"])
    for step in range(4, 8):
        set_grads(model, mean_grads(step, 3))
        single.step()
    for k in SHAPES:
        for p, q in zip(model[k], straight["params"][k]):
            torch.testing.assert_close(p, q, rtol=0, atol=2e-5)


def _module_and_optimizer(cls):
    """The test model as a Module (checkpoints save its state_dict) with a 3-row AdamW param added, whose rows some
    ranks of 4 or 8 do not get (empty shards), and its optimizer."""
    model = make_model()
    model["adamw"].append(torch.nn.Parameter(torch.randn(3, 700, generator=torch.Generator().manual_seed(5))))
    module = torch.nn.Module()
    for k, ps in model.items():
        setattr(module, k, torch.nn.ParameterList(ps))
    return model, module, cls(groups(model))


def _take_steps(model, opt, steps, rank, world_size):
    for step in steps:
        set_grads(model, rank_grads(step, rank, world_size))
        model["adamw"][-1].grad = torch.randn(3, 700, generator=torch.Generator().manual_seed(step))  # the same on all
        opt.step()


def _sharded_checkpoint_worker(rank, world_size, mode, path):
    """'save': 4 steps, a sharded checkpoint, and the full state gathered the way checkpoints were made before
    (state_dict) as the reference. 'load': read the checkpoint at this world size; gathering it gives the
    reference back bitwise, the params are the saved ones on every rank, and training goes on."""
    model, module, opt = _module_and_optimizer(DistMuonAdamW)
    if mode == "save":
        _take_steps(model, opt, range(4), rank, world_size)
        tensors, files = checkpoint.state_of(module, opt)
        checkpoint.save_checkpoint(path, 4, tensors, dict(step=4), files)
        full = opt.state_dict()
        if rank == 0:
            torch.save(dict(params=module.state_dict(), opt=full), path / "reference.pt")
        return
    checkpoint.load_into(path, 4, module, opt)
    ref = torch.load(path / "reference.pt")
    assert all(torch.equal(v, ref["params"][k]) for k, v in module.state_dict().items())
    again = opt.state_dict()
    assert again["state"].keys() == ref["opt"]["state"].keys()
    for pid, st in ref["opt"]["state"].items():
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(again["state"][pid][name]), torch.as_tensor(v)), (pid, name)
    _take_steps(model, opt, range(4, 6), rank, world_size)
    assert_replicated(model)


@pytest.mark.parametrize("saved_at, loaded_at", [(3, 2), pytest.param(8, 3, marks=pytest.mark.slow),
                                               pytest.param(2, 8, marks=pytest.mark.slow)])
def test_sharded_checkpoint_loads_at_any_world_size(tmp_path, saved_at, loaded_at):
    """Each rank writes only its pieces (DistMuonAdamW's owned Muon state, its rows of each large AdamW param; at 8
    ranks, some hold no rows of the 3-row param) and reads back only its new pieces at another world size, or all
    of it in one process: the same state either way as the full state gathered at save time."""
    spawn(_sharded_checkpoint_worker, saved_at, "save", tmp_path)
    saved = dcp.FileSystemReader(tmp_path / "step_000004").read_metadata().state_dict_metadata
    large = [(k, m) for k, m in saved.items() if k.endswith(".exp_avg") and math.prod(m.size) >= DistMuonAdamW.SMALL]
    assert len(large) == 4
    for k, m in large:  # one block of rows from each rank that holds rows
        rows = -(-m.size[0] // saved_at)
        starts = [r * rows for r in range(saved_at) if r * rows < m.size[0]]
        assert sorted(c.offsets[0] for c in m.chunks if c.sizes[0]) == starts, k
    spawn(_sharded_checkpoint_worker, loaded_at, "load", tmp_path)
    model, module, single = _module_and_optimizer(MuonAdamW)
    checkpoint.load_into(tmp_path, 4, module, single)
    ref = torch.load(tmp_path / "reference.pt")
    for pid, st in ref["opt"]["state"].items():
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(single.state_dict()["state"][pid][name]), torch.as_tensor(v))


@pytest.mark.heavy
def test_step_memory_is_below_ddp_style_and_copies_no_muon_grads(capsys):
    """scripts/bench_memory at world 2: a DistMuonAdamW step (state + temporaries) peaks below all_reduce + stock
    torch Muon + AdamW, and its temporaries stay under the size of the Muon grads: a full-size stack of them, or
    gloo's copy of a reduce-scatter's input, would not fit."""
    from scripts.bench_memory import SETUPS, main, param_counts, parse_args, run_world

    args = parse_args(["--depth", "4", "--world-sizes", "2"])
    res = run_world(args, 2)
    (ours_state, ours_temps), (base_state, base_temps) = (res[name] for name in SETUPS)
    assert ours_state + ours_temps <= base_state + base_temps, res
    assert ours_state < 0.6 * base_state, res  # Muon and AdamW state halved (variance reduction's rows on top)
    assert ours_temps < 4 * param_counts(args)[0], res
    main(["--depth", "1", "--world-sizes", "2", "--steps", "2"])
    assert "DistMuonAdamW" in capsys.readouterr().out


def _killed_worker(rank, world_size, marker, always):
    if rank == 1 and (always or not marker.exists()):
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_spawn_retries_a_worker_killed_by_a_signal_once(tmp_path):
    with pytest.warns(UserWarning, match="retrying once"):
        spawn(_killed_worker, 2, tmp_path / "died", False)
    with pytest.warns(UserWarning), pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        spawn(_killed_worker, 2, tmp_path / "died", True)
