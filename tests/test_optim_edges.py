"""
Optimizer edges against independent references: split and transposed layouts (each block moves like a
param of its own), group edits mid-run, Megatron-style decay, named and custom coefficient sets, momentum
cycling schedulers, owners kept by add_param_group at world 2 and 3, and compile across many shapes.

The reference is nanomuon.reference.muon_step, the float64 definition of the update, one logical matrix
at a time; layouts are undone here with index lists, not with the library's views.
"""


import pytest
import torch

from nanomuon.coefficients import COEFFICIENT_SETS, POLAR_EXPRESS
from nanomuon.optim import MuonAdamW
from nanomuon.reference import muon_step

BASE = dict(lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.2, nesterov=True, apply="cautious",
            ns_coefficients="polar_express", ns_repeat_last=False, lr_scale="shape", extra_scale=1.0,
            weight_decay_mode="decoupled", decay_lr="adjusted", precondition=(), post_process=("variance_reduction",))
MUON_REQUIRED = {k: BASE[k] for k in ("lr", "momentum", "ns_steps", "beta2", "weight_decay")}
def block_rows(split, groups):
    """Row indices of each block of a [groups x (n1 + n2 + ...)] interleaved layout."""
    per, out, start = sum(split), [], 0
    for n in split:
        out.append([gi * per + start + j for gi in range(groups) for j in range(n)])
        start += n
    return out


def f64_run(start, grads, cfgs, split=None, groups=1, transposed=False, stages=None):
    """The reference trajectory of one param (any leading batch dims): per step a config, each logical
    block (or the whole logical matrix) updated as a separate float64 param (stages: muon_step's)."""
    p = start.double().clone()
    states = {}
    for g, cfg in zip(grads, cfgs):
        g = g.double()
        batch = p.reshape(-1, *p.shape[-2:])
        gb = g.reshape(-1, *g.shape[-2:])
        for k in range(batch.shape[0]):
            P, G = (batch[k].T, gb[k].T) if transposed else (batch[k], gb[k])
            P = P.clone()
            for bi, rows in enumerate(block_rows(split, groups) if split else [list(range(P.shape[0]))]):
                P[rows] = muon_step(P[rows], G[rows], states.setdefault((k, bi), {}), cfg, stages=stages)
            batch[k] = P.T if transposed else P
        p = batch.reshape(p.shape)
    return p


def run_ours(start, grads, cfgs, **layout):
    """The optimizer's trajectory of one param: per step a config, whose "inputs" (a stage's input
    covariances, where one reads them) go to give_inputs rather than into the group."""
    p = torch.nn.Parameter(start.clone())
    opts = [{k: v for k, v in cfg.items() if k != "inputs"} for cfg in cfgs]
    opt = MuonAdamW([dict(kind="muon", params=[p], ns_precision="fp32", **opts[0], **layout)])
    for g, cfg, options in zip(grads, cfgs, opts):
        opt.param_groups[0].update(options)
        if cfg.get("inputs") is not None:
            opt.give_inputs({p: cfg["inputs"]})
        p.grad = g.clone()
        opt.step()
    return p.detach()


def random_run(shape, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen), [torch.randn(shape, generator=gen) for _ in range(steps)]


# -- split and transposed layouts --------------------------------------------------------------------------

LAYOUTS = {
    "gqa-qkv": ((48, 32), dict(qkv_split=(32, 8, 8)), {}),
    "gqa-qkv-spectral": ((48, 32), dict(qkv_split=(32, 8, 8)), dict(lr_scale="spectral", extra_scale=0.05)),
    "interleaved-groups": ((48, 32), dict(split=(16, 4, 4), split_groups=2), {}),
    "gated-attention-4-blocks": ((40, 24), dict(split=(8, 8, 12, 12)), {}),
    "moe-gate-up": ((3, 48, 16), dict(split=(24, 24)), {}),
    "conv1d-square": ((32, 32), dict(transposed=True), {}),
    "conv1d-wide": ((24, 64), dict(transposed=True), {}),
    "conv1d-qkv": ((16, 48), dict(transposed=True, qkv_split=(16, 16, 16)), dict(decay_lr="group")),
    # per-head orthogonalization (GPT.setup_optimizer(per_head=True)): equal blocks run as one batch
    "per-head-rows": ((32, 24), dict(split=(8, 8, 8, 8)), dict(precondition="equilibrate_row")),
    "per-head-columns": ((24, 32), dict(transposed=True, split=(8, 8, 8, 8)),
                         dict(post_process=("normalize_col_row", "variance_reduction"))),
    "per-head-experts": ((3, 32, 16), dict(split=(8, 8, 8, 8)), {}),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_block_moves_like_a_separate_param(name):
    shape, layout, options = LAYOUTS[name]
    start, grads = random_run(shape, 4)
    cfgs = [dict(BASE, **options)] * 4
    ours = run_ours(start, grads, cfgs, **layout)
    ref = f64_run(start, grads, cfgs, layout.get("split", layout.get("qkv_split")), layout.get("split_groups", 1),
                  layout.get("transposed", False))
    unsplit = f64_run(start, grads, cfgs)
    assert (ref - unsplit).abs().max() > 1e-3  # the layout changes the update
    assert (ref - start.double()).abs().max() > 0.01
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-4)


# -- group edits take effect at the next step ------------------------------------------------------------

EQUILIBRATE = [("precondition", f"equilibrate_{mode}") for mode in ("row", "col", "row_col")]
NORMALIZE = [("post_process", (f"normalize_{mode}", "variance_reduction"))
             for mode in ("fro", "col", "row", "col_row", "row_col")]
EDITS = [("beta2", None), ("beta2", 0.5), ("nesterov", False), ("apply", "decoupled"), ("ns_steps", 3),
         ("ns_coefficients", "jordan"), ("lr_scale", "spectral"), ("extra_scale", 0.3), ("weight_decay_mode", "l2"),
         ("decay_lr", "group"), ("momentum", 0.8), ("lr", 0.05), ("weight_decay", 0.0), *EQUILIBRATE, *NORMALIZE]


@pytest.mark.parametrize("key,value", EDITS, ids=[f"{k}={v}" for k, v in EDITS])
def test_a_group_edit_takes_effect_at_the_next_step(key, value):
    start, grads = random_run((40, 24), 6, seed=3)
    cfgs = [BASE] * 3 + [dict(BASE, **{key: value})] * 3
    ours = run_ours(start, grads, cfgs)
    ref = f64_run(start, grads, cfgs)
    unedited = f64_run(start, grads, [BASE] * 6)
    assert (ref - unedited).abs().max() > 1e-4  # the edit matters
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-4)


def test_beta2_none_then_back_resumes_the_second_moment():
    """beta2 off for two steps keeps the second moment as it was; back on, it continues from there."""
    start, grads = random_run((24, 40), 6, seed=4)
    cfgs = [BASE] * 2 + [dict(BASE, beta2=None)] * 2 + [BASE] * 2
    ref = f64_run(start, grads, cfgs)
    torch.testing.assert_close(run_ours(start, grads, cfgs).double(), ref, rtol=0, atol=2e-4)


# -- Megatron / torch decay, coefficient sets --------------------------------------------------------------


def test_decay_lr_group_matches_torch_muon_on_tall_matrices():
    """torch.optim.Muon (like Megatron) decays by the group lr; decay_lr='group' does too, tall matrices included."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(96, 32), (32, 96), (48, 48)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = MuonAdamW([dict(kind="muon", params=ours, lr=0.02, momentum=0.9, ns_steps=5, beta2=None, weight_decay=0.5,
                          apply="decoupled", ns_coefficients="jordan", ns_precision="bf16", decay_lr="group")])
    torch_opt = torch.optim.Muon(ref, lr=0.02, momentum=0.9, weight_decay=0.5)
    for _ in range(6):
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        torch_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


def test_published_polar_express_folds_the_safety_into_the_coefficients():
    """The paper's first raw triple (arXiv 2505.16932) divided by 1.01, 1.01^3, 1.01^5; the last is raw."""
    first, last = COEFFICIENT_SETS["polar_express_published"][0][0], COEFFICIENT_SETS["polar_express_published"][0][-1]
    raw = (8.28721201814563, -23.595886519098837, 17.300387312530933)
    assert first == pytest.approx([raw[0] / 1.01, raw[1] / 1.01 ** 3, raw[2] / 1.01 ** 5], abs=1e-4)
    assert last == (1.875, -1.25, 0.375)


@pytest.mark.parametrize("name,steps", [("quintic", 5), ("polar_express_published", 8), ("cans", 5), ("aol", 4),
                                        ("deepseekv4", 10)])
def test_named_sets_match_float64_and_orthogonalize(name, steps):
    start, grads = random_run((48, 32), 2, seed=5)
    cfgs = [dict(BASE, ns_coefficients=name, ns_steps=steps, beta2=None)] * 2
    torch.testing.assert_close(run_ours(start, grads, cfgs).double(), f64_run(start, grads, cfgs), rtol=0, atol=2e-4)
    from test_optim import orthogonalize

    from nanomuon.coefficients import ns_coefficients
    from nanomuon.muon import NewtonSchulz

    sv = torch.linalg.svdvals(orthogonalize(grads[0], NewtonSchulz(*ns_coefficients(name, steps), torch.float32)))
    assert sv.min() > 0.6 and sv.max() < 1.3, sv  # a randn matrix's singular values land near 1


def test_repeat_last_and_custom_safety_match_float64():
    start, grads = random_run((32, 48), 3, seed=6)
    cfgs = [dict(BASE, ns_coefficients="quintic", ns_steps=7, ns_repeat_last=True)] * 3
    torch.testing.assert_close(run_ours(start, grads, cfgs).double(), f64_run(start, grads, cfgs), rtol=0, atol=2e-4)
    custom = dict(coefficients=POLAR_EXPRESS, safety=1.01, eps=1e-6)
    cfgs = [dict(BASE, ns_coefficients=custom)] * 3
    ours = run_ours(start, grads, cfgs)
    assert torch.equal(ours, run_ours(start, grads, [BASE] * 3))  # the same numbers as the named set
    bare = run_ours(start, grads, [dict(BASE, ns_coefficients=list(POLAR_EXPRESS))] * 3)  # safety 1, eps 1e-7
    torch.testing.assert_close(bare.double(), f64_run(start, grads, [dict(BASE, ns_coefficients=list(POLAR_EXPRESS))]
                                                      * 3), rtol=0, atol=2e-4)
    with pytest.raises(ValueError, match="ns_repeat_last=True"):
        run_ours(start, grads, [dict(BASE, ns_coefficients="quintic", ns_steps=7)])


# -- schedulers that cycle momentum ------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.03, total_steps=8),
    lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.005, max_lr=0.03, step_size_up=3),
], ids=["OneCycleLR", "CyclicLR"])
def test_momentum_cycling_schedulers_match_stock_torch(make):
    """Muon's momentum and AdamW's betas[0] follow the schedule exactly as in torch.optim.Muon + AdamW."""
    gen = torch.Generator().manual_seed(8)
    mat = torch.nn.Parameter(torch.randn(32, 48, generator=gen))
    vec = torch.nn.Parameter(torch.randn(40, generator=gen))
    ref_mat, ref_vec = torch.nn.Parameter(mat.detach().clone()), torch.nn.Parameter(vec.detach().clone())
    opt = MuonAdamW([dict(kind="muon", params=[mat], lr=0.02, momentum=0.9, ns_steps=5, beta2=None, weight_decay=0.1,
                          apply="decoupled", ns_coefficients="jordan", ns_precision="bf16", decay_lr="group"),
                     dict(kind="adamw", params=[vec], lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)])
    muon = torch.optim.Muon([ref_mat], lr=0.02, momentum=0.9, weight_decay=0.1)
    adamw = torch.optim.AdamW([ref_vec], lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    scheds = [make(o) for o in (opt, muon, adamw)]
    momenta = set()
    for _ in range(8):
        for p, q in ((mat, ref_mat), (vec, ref_vec)):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        for o in (opt, muon, adamw):
            o.step()
        assert opt.param_groups[1]["betas"] == adamw.param_groups[0]["betas"]  # what this step ran with
        for s in scheds:
            s.step()
        momenta.add(round(opt.param_groups[0]["momentum"], 6))
    assert len(momenta) >= 4  # momentum really cycled
    torch.testing.assert_close(mat, ref_mat, rtol=0, atol=1e-5)
    torch.testing.assert_close(vec, ref_vec, rtol=1e-5, atol=1e-6)


# -- DistMuonAdamW.add_param_group keeps the owners that hold state ------------------------------------------


def _add_group_worker(rank, world_size):
    from test_dist import assert_replicated_tensors

    from nanomuon.optim import DistMuonAdamW

    def model(seed):
        gen = torch.Generator().manual_seed(seed)
        return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(24, 16)] * 3 + [(16, 40)] * 2]

    def later(seed):
        gen = torch.Generator().manual_seed(seed)
        return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(24, 16)] * 2 + [(32, 32), (70,)]]

    ours, ref = (model(0), later(1)), (model(0), later(1))
    # cautious decay off: its sign mask is discontinuous where grads averaged in another order could flip it
    muon = dict(MUON_REQUIRED, apply="decoupled")
    opt = DistMuonAdamW([dict(kind="muon", params=ours[0], **muon)])
    ref_opt = MuonAdamW([dict(opt.param_groups[0], params=ref[0])])
    owners_before = [dict(b) for b in opt._owned_buckets()]
    for step in range(6):
        if step == 3:  # two Muon groups (one split into blocks) and an AdamW group arrive once state exists
            for o, ps in ((opt, ours[1]), (ref_opt, ref[1])):
                o.add_param_group(dict(kind="muon", params=ps[:2], **muon))
                o.add_param_group(dict(kind="muon", params=ps[2:3], split=(8, 8, 16), lr_scale="spectral", **muon))
                o.add_param_group(dict(kind="adamw", params=ps[3:], lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                       weight_decay=0.0))
        live = ours[0] + (ours[1] if step >= 3 else [])
        gen = torch.Generator().manual_seed(100 + step)
        for i, p in enumerate(live):
            G, E = torch.randn(p.shape, generator=gen), torch.randn(p.shape, generator=gen)
            p.grad = G + (rank - (world_size - 1) / 2) * E  # the mean over ranks is G
            (ref[0] + ref[1])[i].grad = G.clone()
        opt.step()
        ref_opt.step()
        assert_replicated_tensors(live)
    buckets = opt._owned_buckets()
    assert [b["slots"] for b in buckets[:len(owners_before)]] == [b["slots"] for b in owners_before]
    for p, q in zip(ours[0] + ours[1], ref[0] + ref[1]):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-5)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.heavy)])
def test_add_param_group_keeps_owners_and_state(world_size):
    from test_dist import spawn

    spawn(_add_group_worker, world_size)


# -- compile with many shapes ------------------------------------------------------------------------------


LENGTHS = [10, 37, 64, 100, 129, 256, 333, 4096, 2049, 1366, 513, 1000]  # 4096 / 2 (+1), 4096 / 3, 4096 / 8
MATRICES = [(24, 16)] * 4 + [(16, 24)] * 3 + [(32, 32)] * 2 + [(40, 8), (8, 40), (3, 16, 24)]


def compile_eager_pair(cls, rank=0, world_size=1):
    """The same model and optimizer twice, eager and compiled; 4 steps on grads where a third of the params
    have none, a different third each step (so Muon stacks change size). Returns the graphs compiled."""
    import torch._dynamo

    torch._dynamo.reset()

    def build(compile):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in MATRICES + [(n,) for n in LENGTHS]]
        opt = cls([dict(kind="muon", params=params[:len(MATRICES)], ns_precision="fp32", **MUON_REQUIRED),  # Gram
                   dict(kind="adamw", params=params[len(MATRICES):], lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                        weight_decay=0.01)], compile=compile)
        return params, opt

    (eager, opt_e), (compiled, opt_c) = build(False), build(True)
    torch._dynamo.utils.counters.clear()
    for step in range(4):
        gen = torch.Generator().manual_seed(10 + step)
        for i, (p, q) in enumerate(zip(eager, compiled)):
            g = torch.randn(p.shape, generator=gen) * (1 + rank)
            dropped = (i + step) % 3 == 0
            p.grad, q.grad = (None, None) if dropped else (g, g.clone())
        opt_e.step()
        opt_c.step()
    for p, q in zip(eager, compiled):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.slow
@pytest.mark.compile
def test_compile_survives_many_shapes():
    """24 distinct shapes reach the compiled kernels: 12 AdamW lengths and Muon stacks whose size changes
    as params lose their grads. dynamo's default limit is 8 graphs per function."""
    graphs = compile_eager_pair(MuonAdamW)
    assert graphs <= 12, graphs  # dynamic dims: a few graphs per function, not one per shape


def _compile_dist_worker(rank, world_size):
    from nanomuon.optim import DistMuonAdamW

    torch.set_num_threads(1)
    compile_eager_pair(DistMuonAdamW, rank, world_size)


@pytest.mark.slow
@pytest.mark.compile
def test_compile_survives_dist_shard_lengths():
    """The same under DistMuonAdamW at world 3: the AdamW kernel sees each param's flat shard (lengths
    ceil(n / 3), the last ones short) and the Muon kernel each rank's padded stacks."""
    from test_dist import spawn

    spawn(_compile_dist_worker, 3)
