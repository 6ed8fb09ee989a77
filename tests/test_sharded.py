"""
MuonAdamW on DTensor params (nanomuon/sharded.py) against MuonAdamW on the same params unsharded, in
gloo process groups of 2, 3, 4 and 8 ranks: every placement on 1-D and 2-D meshes (Shard on either
dim, Replicate, uneven shards with empty ones, 3-D MoE expert weights), bf16 communication, and real
FSDP2 (fully_shard) and tensor-parallel models trained from each rank's own data.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from test_dist import spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import nanomuon.sharded as sharded_module
from nanomuon.arch import Variant
from nanomuon.gpt import GPT, config_from_depth
from nanomuon.optim import DistMuonAdamW, MuonAdamW
from nanomuon.recipe import peak_lrs


def specs(world_size):
    """(name, shape, mesh dims or None for 1-D, placements); 2-D specs need an even world of >= 4."""
    out = [
        ("rows", (24, 40), None, [Shard(0)]),
        ("cols", (40, 24), None, [Shard(1)]),
        ("uneven", (5, 16), None, [Shard(0)]),  # 5 rows over 4+ ranks: some shards are empty
        ("replicated", (24, 40), None, [Replicate()]),
        ("experts", (4, 16, 24), None, [Shard(0)]),  # MoE: (experts, out, in), each expert orthogonalized
        ("rows-again", (24, 40), None, [Shard(1)]),  # same shape as "rows", other placement: one stack
    ]
    if world_size % 2 == 0 and world_size >= 4:
        out += [
            ("2d", (24, 40), (2, world_size // 2), [Shard(0), Shard(1)]),
            ("2d-replica", (40, 24), (2, world_size // 2), [Replicate(), Shard(0)]),
            ("2d-same-dim", (32, 16), (2, world_size // 2), [Shard(0), Shard(0)]),
        ]
    return out


ADAMW_SPECS = [("vector", (19,), [Shard(0)]), ("head", (37, 41), [Shard(0)])]


def full_values(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_same(name, sharded, plain, atol):
    torch.testing.assert_close(full(sharded).detach(), plain.detach(), rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_state_matches(full, ref_state, atol):
    assert full["state"].keys() == ref_state["state"].keys()
    for k, st in ref_state["state"].items():
        assert full["state"][k].keys() == st.keys()
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(full["state"][k][name], v, rtol=0, atol=atol)
            else:
                assert full["state"][k][name] == v


def groups(muon, adamw, **muon_options):
    # fp32 Newton-Schulz unless a test asks otherwise ('auto' is bf16 on CPUs with bf16 units; see test_dist.groups)
    return [dict(kind="muon", params=muon, lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.2,
                 **{"ns_precision": "fp32", **muon_options}),
            dict(kind="adamw", params=adamw, lr=3e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)]


def _placements_worker(rank, world_size, muon_options, atol, chunk_per_rank=4):
    sharded_module.WAVE_PER_RANK = chunk_per_rank  # 1: every matrix its own wave, so waves overlap
    meshes = {None: init_device_mesh("cpu", (world_size,))}
    muon_specs = specs(world_size)
    for _, _, dims, _ in muon_specs:
        if dims is not None and dims not in meshes:
            meshes[dims] = init_device_mesh("cpu", dims)
    shapes = [s for _, s, _, _ in muon_specs] + [s for _, s, _ in ADAMW_SPECS]
    placements = [(meshes[d], pl) for _, _, d, pl in muon_specs] + [(meshes[None], pl) for _, _, pl in ADAMW_SPECS]
    start = full_values(shapes, 0)
    sharded = [torch.nn.Parameter(distribute_tensor(t.clone(), m, pl)) for t, (m, pl) in zip(start, placements)]
    plain = [torch.nn.Parameter(t.clone()) for t in start]
    n = len(muon_specs)
    opt = MuonAdamW(groups(sharded[:n], sharded[n:], **muon_options))
    ref = MuonAdamW(groups(plain[:n], plain[n:], **muon_options))
    for step in range(3):
        for p, q, g, (m, pl) in zip(sharded, plain, full_values(shapes, 100 + step), placements):
            p.grad = distribute_tensor(g.clone(), m, pl)
            q.grad = g.clone()
        opt.step()
        ref.step()
    for (name, *_), p, q, s, (_, pl) in zip(muon_specs + ADAMW_SPECS, sharded, plain, start, placements):
        assert isinstance(p, DTensor) and p.placements == tuple(pl)
        assert (q - s).abs().max() > 0.005, name  # it trained
        assert_same(name, p, q, atol)
    # State: momentum sharded like its param; the second moment on exactly one rank, the owner.
    holders = torch.tensor([int("second_momentum_buffer" in opt.state[p]) for p in sharded[:n]])
    dist.all_reduce(holders)
    assert holders.tolist() == [1] * n, holders
    for p in sharded[:n]:
        assert opt.state[p]["momentum_buffer"].placements == p.placements

    # state_dict() is MuonAdamW.state_dict() of the unsharded run; loaded into a fresh sharded optimizer,
    # the run continues as the unsharded one does
    full = opt.state_dict()
    assert_state_matches(full, ref.state_dict(), atol)
    again = [torch.nn.Parameter(distribute_tensor(q.detach().clone(), m, pl)) for q, (m, pl) in zip(plain, placements)]
    resumed = MuonAdamW(groups(again[:n], again[n:], **muon_options))
    resumed.load_state_dict(copy.deepcopy(full))
    for step in range(3, 5):
        for p, q, g, (m, pl) in zip(again, plain, full_values(shapes, 100 + step), placements):
            p.grad = distribute_tensor(g.clone(), m, pl)
            q.grad = g.clone()
        resumed.step()
        ref.step()
    for (name, *_), p, q in zip(muon_specs + ADAMW_SPECS, again, plain):
        assert_same(name, p, q, atol)


@pytest.mark.parametrize("world_size", [2, *(pytest.param(n, marks=pytest.mark.heavy) for n in (3, 4)),
                                        pytest.param(8, marks=pytest.mark.slow)])
def test_every_placement_equals_unsharded(world_size):
    spawn(_placements_worker, world_size, {}, 1e-6)


@pytest.mark.heavy
def test_bf16_communication_and_options():
    """The group's other options (coefficients, lr scale, L2 decay, no Nesterov) reach the sharded path, also
    with one matrix per chunk (many chunks in flight); comm_precision='bf16' ships bf16 shards (close to fp32)."""
    options = dict(comm_precision="bf16", ns_coefficients="jordan", lr_scale="moonlight", weight_decay_mode="l2",
                   nesterov=False)
    spawn(_placements_worker, 4, dict(options, comm_precision="fp32"), 1e-6, 1)
    spawn(_placements_worker, 4, options, 3e-3)


def _modes_worker(rank, world_size, mode, options=None):
    """Exact modes against unsharded MuonAdamW; blockwise against MuonAdamW treating every block of every
    matrix as a param of its own."""
    mesh1 = init_device_mesh("cpu", (world_size,))
    mesh2 = init_device_mesh("cpu", (2, world_size // 2)) if world_size % 2 == 0 else None
    layout = [((24, 40), mesh1, [Shard(0)]), ((40, 24), mesh1, [Shard(0)]), ((24, 40), mesh1, [Shard(1)]),
              ((5, 16), mesh1, [Shard(0)]), ((4, 16, 24), mesh1, [Shard(0)]), ((4, 16, 24), mesh1, [Shard(2)]),
              ((24, 40), mesh1, [Replicate()])]
    if mesh2 is not None:
        layout += [((24, 40), mesh2, [Replicate(), Shard(1)]), ((32, 16), mesh2, [Shard(0), Shard(0)])]
    start = full_values([s for s, _, _ in layout], 0)
    sharded = [torch.nn.Parameter(distribute_tensor(t.clone(), m, pl)) for t, (_, m, pl) in zip(start, layout)]
    options = options or {}
    opt = MuonAdamW(groups(sharded, [], sharded_mode=mode, **options))
    if mode == "blockwise":  # the reference: each rank's blocks as separate plain params
        plain = [torch.nn.Parameter(p.to_local().clone()) for p in sharded]
        ref = MuonAdamW(groups([q for q in plain if q.numel()], [], **options))
    else:
        plain = [torch.nn.Parameter(t.clone()) for t in start]
        ref = MuonAdamW(groups(plain, [], **options))
    for step in range(3):
        for p, q, g, (_, m, pl) in zip(sharded, plain, full_values([s for s, _, _ in layout], 100 + step), layout):
            p.grad = distribute_tensor(g.clone(), m, pl)
            q.grad = p.grad.to_local().clone() if mode == "blockwise" else g.clone()
        opt.step()
        ref.step()
    for k, (p, q) in enumerate(zip(sharded, plain)):
        got = p.to_local() if mode == "blockwise" else p.full_tensor()
        torch.testing.assert_close(got, q.detach(), rtol=0, atol=2e-5, msg=lambda m, k=k: f"{mode} {layout[k]}: {m}")
    if mode != "duplicated" or options:  # per-slice variance-reduction state has no whole form
        with pytest.raises(ValueError, match="has no whole form"):
            opt.state_dict()
        return
    full = opt.state_dict()
    assert_state_matches(full, ref.state_dict(), 2e-5)
    again = [torch.nn.Parameter(distribute_tensor(q.detach().clone(), m, pl)) for q, (_, m, pl) in zip(plain, layout)]
    resumed = MuonAdamW(groups(again, [], sharded_mode=mode))
    resumed.load_state_dict(copy.deepcopy(full))
    for step in range(3, 5):
        for p, q, g, (_, m, pl) in zip(again, plain, full_values([s for s, _, _ in layout], 100 + step), layout):
            p.grad = distribute_tensor(g.clone(), m, pl)
            q.grad = g.clone()
        resumed.step()
        ref.step()
    for k, (p, q) in enumerate(zip(again, plain)):
        assert_same(f"resumed {layout[k]}", p, q, 2e-5)


@pytest.mark.parametrize("mode", ["duplicated", "distributed", "blockwise"])
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tensor_parallel_modes(mode, world_size):
    spawn(_modes_worker, world_size, mode)


@pytest.mark.parametrize("options", [
    pytest.param(dict(precondition="equilibrate_row_col", post_process=("normalize_col_row", "variance_reduction")),
                 marks=pytest.mark.heavy),
    dict(precondition="equilibrate_col", post_process=("normalize_fro", "variance_reduction"))],
    ids=["rc-colrow", "c-fro"])
def test_distributed_mode_sums_the_norms_of_equilibrate_and_post_normalize(options):
    """MuonEq's and Muon+'s row, column and whole-matrix norms on slices cut either way equal the unsharded ones."""
    spawn(_modes_worker, 3, "distributed", options)


@pytest.mark.heavy
def test_blockwise_changes_the_math():
    """Blockwise is not Muon of the whole matrix: with 4 ranks its result differs from the exact modes."""
    spawn(_blockwise_differs_worker, 4)


def _blockwise_differs_worker(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    start, grad = full_values([(24, 40)], 0)[0], full_values([(24, 40)], 1)[0]
    results = {}
    for mode in ("owner", "blockwise"):
        p = torch.nn.Parameter(distribute_tensor(start.clone(), mesh, [Shard(0)]))
        p.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
        MuonAdamW(groups([p], [], sharded_mode=mode)).step()
        results[mode] = p.full_tensor()
    assert (results["owner"] - results["blockwise"]).abs().max() > 1e-3


def _qkv_worker(rank, world_size, mode, layout):
    """A fused weight whose blocks get different lr factors, sharded so shard edges cut through the blocks
    (by rows, or by the logical rows of a transposed (in, out) weight)."""
    mesh = init_device_mesh("cpu", (world_size,))
    shape = (16, 40) if layout.get("transposed") else (40, 16)
    start = full_values([shape], 0)[0]
    placement = [Shard(1 if layout.get("transposed") else 0)]
    p = torch.nn.Parameter(distribute_tensor(start.clone(), mesh, placement))
    q = torch.nn.Parameter(start.clone())
    opt = MuonAdamW(groups([p], [], sharded_mode=mode, lr_scale="spectral", **layout))
    ref = MuonAdamW(groups([q], [], lr_scale="spectral", **layout))
    for step in range(3):
        g = full_values([shape], 100 + step)[0]
        p.grad, q.grad = distribute_tensor(g.clone(), mesh, placement), g.clone()
        opt.step()
        ref.step()
    assert_same(f"split {mode} {layout}", p, q, 2e-5)


@pytest.mark.parametrize("layout", [dict(qkv_split=(24, 8, 8)),
                                    dict(split=(12, 4, 4), split_groups=2, transposed=True)],
                         ids=["qkv", "interleaved-transposed"])
@pytest.mark.parametrize("mode", ["owner", pytest.param("duplicated", marks=pytest.mark.heavy)])
def test_split_sharded(mode, layout):
    spawn(_qkv_worker, 3, mode, layout)


def rank_batch(rank, vocab, seq):
    g = torch.Generator().manual_seed(500 + rank)
    return torch.randint(0, vocab, (2, seq), generator=g), torch.randint(0, vocab, (2, seq), generator=g)


def _fsdp_gpt_worker(rank, world_size, shard_root, arch="classic", roles=None):
    """shard_root: every param is a DTensor (MuonAdamW); else the blocks are FSDP2 DTensors next to a
    replicated embedding and head whose per-rank grads DistMuonAdamW must average. roles: the variant's
    (tests/test_kinds.py puts the embedding, head and scalars on a kind)."""
    vocab, seq = 64, 16
    config = config_from_depth(2, vocab, seq, aspect_ratio=32, head_dim=16, arch=arch)
    torch.manual_seed(0)
    model, ref = GPT(config), GPT(config)
    model.init_weights()
    ref.load_state_dict(model.state_dict())
    start = {k: v.clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (world_size,))

    def shard(m):
        for block in m.blocks:
            fully_shard(block, mesh=mesh)
        if shard_root:
            fully_shard(m, mesh=mesh)
        return m

    # the reference's grads are the same on every rank, so its DistMuonAdamW is the single-device update
    # Grads differ from the reference in summation order only. Two things amplify that: AdamW turns near-zero
    # grads into near-sign steps (so keep its lrs small), and cautious decay's mask flips where the update is
    # near zero (so decay is off here; the placement tests above cover it with identical inputs).
    def optimizer(m):
        return m.setup_optimizer(Variant(weight_decay=0.0, muon_options=dict(ns_precision="fp32"),
                                         roles=roles or {}),
                                 peak_lrs(2 ** 19, embedding_lr=0.01, unembedding_lr=0.004))

    model = shard(model)
    opt, ref_opt = optimizer(model), optimizer(ref)
    assert type(opt) is (MuonAdamW if shard_root else DistMuonAdamW) and type(ref_opt) is DistMuonAdamW
    assert all(isinstance(p, DTensor) for p in model.parameters()) == shard_root

    def train(m, o, steps):
        for step in steps:
            x, y = rank_batch(rank + 10 * step, vocab, seq)
            m(x, y).backward()  # FSDP2 reduce-scatters the mean grad of its params
            o.step()
            o.zero_grad(set_to_none=True)
            for r in range(world_size):  # the reference sees every rank's batch: the same mean grad
                x, y = rank_batch(r + 10 * step, vocab, seq)
                (ref(x, y) / world_size).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)

    # A mean over 3 ranks rounds differently from the reference's (halving and quartering are
    # exact), and AdamW scales an element whose grad nearly cancels up to its lr: 4e-5 seen after
    # 5 steps, against the 1e-2 a wrong shard's update would move an element by.
    atol = 1e-4 if world_size == 3 else 2e-5
    train(model, opt, range(3))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(name, p, q, atol)
    if not shard_root:  # replicated params stay bitwise identical across ranks
        every = [torch.empty_like(model.wte.weight) for _ in range(world_size)]
        dist.all_gather(every, model.wte.weight.detach())
        assert all(torch.equal(e, every[0]) for e in every)
    # the whole state is the unsharded one; a fresh sharded model resumes from it (and from its weights)
    saved = opt.state_dict()
    assert_state_matches(saved, ref_opt.state_dict(), atol)
    weights = {k: full(v).clone() for k, v in model.state_dict().items()}
    again = GPT(config)
    again.load_state_dict(start)
    again.load_state_dict(weights)
    again = shard(again)
    opt2 = optimizer(again)
    opt2.load_state_dict(copy.deepcopy(saved))
    train(again, opt2, range(3, 5))
    for (name, p), q in zip(again.named_parameters(), ref.parameters()):
        assert_same(f"resumed {name}", p, q, atol)


@pytest.mark.parametrize("shard_root", [True, False], ids=["all-fsdp", "fsdp-blocks-replicated-rest"])
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.heavy),
                                        pytest.param(4, marks=pytest.mark.slow)])
def test_fsdp2_gpt_equals_unsharded(world_size, shard_root):
    spawn(_fsdp_gpt_worker, world_size, shard_root)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.up = torch.nn.Linear(16, 64, bias=False)
        self.down = torch.nn.Linear(64, 16, bias=False)
        self.head = torch.nn.Linear(16, 32, bias=False)

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(self.embed(x)))))


def _tp_worker(rank, world_size, mode):
    torch.manual_seed(0)
    model, ref = MLP(), MLP()
    ref.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])  # FSDP2 x TP: "up" ends up (_StridedShard, Shard) on the 2-D mesh
    assert model.up.weight.device_mesh.ndim == 2 and len(model.down.weight.placements) == 2

    def make(m, mode="owner"):
        # "down" is cut along both dims ((Shard(0), Shard(1))), which 'distributed' refuses: it stays 'owner'
        down_mode = "owner" if mode == "distributed" else mode
        muon_up, adamw = groups([m.up.weight], [m.embed.weight, m.head.weight], sharded_mode=mode)
        muon_down, _ = groups([m.down.weight], [], sharded_mode=down_mode)
        return MuonAdamW([muon_up, muon_down, adamw])

    opt, ref_opt = make(model, mode), make(ref)
    dp = mesh["dp"].get_local_rank()
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + dp)
        x = torch.randint(0, 32, (4, 8), generator=g)  # each dp rank its own batch; tp ranks share it
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for d in range(2):
            g = torch.Generator().manual_seed(step * 10 + d)
            x = torch.randint(0, 32, (4, 8), generator=g)
            (torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), x.flatten()) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(name, p, q, 2e-5)


@pytest.mark.parametrize("world_size, mode", [pytest.param(4, "owner", marks=pytest.mark.slow),
                                              pytest.param(4, "distributed", marks=pytest.mark.heavy),
                                              pytest.param(4, "duplicated", marks=pytest.mark.slow),
                                              pytest.param(8, "owner", marks=pytest.mark.slow)])
def test_fsdp2_x_tensor_parallel_equals_unsharded(world_size, mode):
    """FSDP2 over TP: "up" is (_StridedShard(0), Shard(0)) on the 2-D mesh, so 'distributed' must sum
    over both mesh dims."""
    spawn(_tp_worker, world_size, mode)


def _refuse_worker(rank, world_size):
    mesh2 = init_device_mesh("cpu", (2, world_size // 2))
    q = torch.nn.Parameter(distribute_tensor(torch.ones(8, 8), mesh2, [Shard(0), Shard(1)]))
    q.grad = distribute_tensor(torch.ones(8, 8), mesh2, [Shard(0), Shard(1)])
    with pytest.raises(ValueError, match="needs each matrix cut along one of its dims"):
        MuonAdamW(groups([q], [], sharded_mode="distributed")).step()


@pytest.mark.heavy
def test_refusals():
    """'distributed' refuses a matrix cut along both dims."""
    spawn(_refuse_worker, 4)


def test_bench_sharded_runs_every_mode(capfd):
    """The benchmark script works end to end (1 step, depth 1, 2 spawned ranks) and prints a row per mode."""
    from scripts.bench_sharded import MODES, main

    main(["--world-size", "2", "--depth", "1", "--steps", "1", "--warmup", "0"])
    out = capfd.readouterr().out  # printed by spawned rank 0
    assert all(any(line.split()[:1] == [mode] for line in out.splitlines()) for mode in MODES), out
