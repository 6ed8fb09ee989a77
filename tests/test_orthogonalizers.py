"""
The orthogonalizer registry as a forker uses it: one function registered in
stages.ORTHOGONALIZERS, from outside the package, and a group naming it trains with it, in
MuonAdamW, in DistMuonAdamW and on DTensor params at world 2, and through a variants.py entry. The
function here is the exact polar factor U V^T (by SVD), so the reference is nanomuon.reference's float64
step with the same exact polar factor, and Newton-Schulz (an approximation of it) must land elsewhere.
"""

import pytest
import torch
import torch.distributed as dist
from test_dist import spawn
from test_optim import ns_context

from nanomuon import muon, owners, stages
from nanomuon.optim import DistMuonAdamW, MuonAdamW
from nanomuon.param_groups import fill_defaults
from nanomuon.reference import muon_step

SHAPES = [(40, 24), (24, 40), (32, 32), (40, 24)]  # tall, wide, square, and a repeat to stack
GROUP = dict(lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.2)
STEPS = 3


def exact_polar(G, group):
    """U V^T of every matrix of the stack, through a float64 SVD."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return (U @ Vh).to(G.dtype)


def register():
    stages.ORTHOGONALIZERS["exact_polar"] = exact_polar


def start_and_grads(seed=0):
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=gen) * 0.5 for s in SHAPES]
    return start, [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(STEPS)]


def reference(start, grads, orthogonalizer):
    """The float64 trajectory with the group's orthogonalizer: 'auto' (Newton-Schulz) or
    exact_polar, plugged into muon_step as a stage."""
    params, states = [p.double() for p in start], [{} for _ in start]
    group = dict(GROUP, orthogonalizer=orthogonalizer)
    for step in grads:
        params = [muon_step(p, g, st, group, stages=dict(exact_polar=exact_polar))
                  for p, g, st in zip(params, step, states)]
    return params


def train(opt_class, start, grads, placements=None, **options):
    """Params trained by opt_class with a muon group of `options`; DTensors when placements (mesh, pl)."""
    from torch.distributed.tensor import distribute_tensor

    wrap = (lambda t: distribute_tensor(t, *placements)) if placements else (lambda t: t)
    params = [torch.nn.Parameter(wrap(p.clone())) for p in start]
    opt = opt_class([dict(kind="muon", params=params, ns_precision="fp32", **GROUP, **options)])
    for step in grads:
        for p, g in zip(params, step):
            p.grad = wrap(g.clone())
        opt.step()
    return [p.full_tensor() if placements else p.detach() for p in params]


def check(ours, start, grads):
    """ours equals the float64 step with the exact polar factor, and Newton-Schulz lands elsewhere."""
    exact = reference(start, grads, "exact_polar")
    approx = reference(start, grads, "auto")
    for p, e, a in zip(ours, exact, approx):
        torch.testing.assert_close(p.double(), e, rtol=0, atol=2e-5)
        assert (e - a).abs().max() > 1e-3  # the registered function is what ran


def test_a_registered_orthogonalizer_runs_in_muon_adamw(monkeypatch):
    monkeypatch.setitem(stages.ORTHOGONALIZERS, "exact_polar", exact_polar)
    start, grads = start_and_grads()
    check(train(MuonAdamW, start, grads, orthogonalizer="exact_polar"), start, grads)


def test_the_owner_plan_costs_an_unknown_orthogonalizer_as_newton_schulz(monkeypatch):
    monkeypatch.setitem(stages.ORTHOGONALIZERS, "exact_polar", exact_polar)
    p = torch.zeros(24, 96)
    group = dict(GROUP, params=[p], orthogonalizer="exact_polar", ns_precision="fp32", ns_coefficients="jordan",
                 ns_repeat_last=False, split=None, qkv_split=None, transposed=False, precondition=(),
                 post_process=(), apply="cautious", kind="muon")
    fill_defaults(group)
    plan = stages.muon_plan(group, p.shape, p.dtype, p.device)
    assert owners.update_cost(plan, p.shape) == owners.ns_flops(p.shape, 5)


def test_an_unregistered_name_is_refused_with_the_registry_named():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"orthogonalizer='exact_polar' is not in stages.ORTHOGONALIZERS: "
                                         r"use one of \['auto', .*register"):
        MuonAdamW([dict(kind="muon", params=[p], orthogonalizer="exact_polar", **GROUP)])


def test_a_variants_entry_names_it(monkeypatch):
    """One line in variants.py: the GPT's optimizer is built with it and steps."""
    from nanomuon.arch import Variant
    from nanomuon.gpt import GPT, GPTConfig
    from nanomuon.variants import OPTIMIZER_VARIANTS

    monkeypatch.setitem(stages.ORTHOGONALIZERS, "exact_polar", exact_polar)
    monkeypatch.setitem(OPTIMIZER_VARIANTS, "muon-exact", Variant(muon_options=dict(orthogonalizer="exact_polar")))
    model = GPT(GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=32))
    model.init_weights()
    opt = model.setup_optimizer(OPTIMIZER_VARIANTS["muon-exact"])
    assert {g.get("orthogonalizer") for g in opt.param_groups if g["kind"] == "muon"} == {"exact_polar"}
    idx = torch.randint(0, 64, (2, 16))
    model(idx, idx).backward()
    opt.step()


def _world_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    register()  # from outside the package, in this process
    start, grads = start_and_grads()
    check(train(DistMuonAdamW, start, grads, orthogonalizer="exact_polar"), start, grads)
    mesh = init_device_mesh("cpu", (world_size,))
    ours = train(MuonAdamW, start, grads, placements=(mesh, [Shard(0)]), orthogonalizer="exact_polar")
    check(ours, start, grads)
    dist.barrier()


def test_a_registered_orthogonalizer_runs_distributed_and_on_dtensors():
    spawn(_world_worker, 2)


def test_an_orthogonalizer_that_calls_newton_schulz_keeps_autos_gram(monkeypatch):
    """A forker's orthogonalizer that calls muon.newton_schulz (group untouched) runs what 'auto' runs:
    Gram Newton-Schulz on a wide fp32 matrix, where it pays, and standard on a square one; gram= forces either."""
    G = torch.randn(3, 24, 96, generator=torch.Generator().manual_seed(0))
    group = dict(ns_coefficients="polar_express", ns_steps=5, ns_repeat_last=False, ns_precision="fp32")

    def run(name, shape_of=G, **kw):
        return muon.newton_schulz(shape_of, ns_context(shape_of, **group,
                                                             orthogonalizer=name), **kw)

    monkeypatch.setitem(stages.ORTHOGONALIZERS, "mine", lambda X, ctx: muon.newton_schulz(X, ctx))
    assert owners.gram_pays(G.shape, 5, torch.float32)
    assert torch.equal(run("mine"), run("gram_newton_schulz"))
    assert not torch.equal(run("mine"), run("newton_schulz"))  # the two differ in rounding: the test sees which
    assert torch.equal(run("mine", gram=False), run("newton_schulz"))
    square = G[:, :, :24]
    assert not owners.gram_pays(square.shape, 5, torch.float32)
    assert torch.equal(run("mine", square), run("newton_schulz", square))


@pytest.mark.parametrize("layout", [{}, dict(split=(8, 8, 8)), dict(transposed=True)],
                         ids=["plain", "heads", "transposed"])
def test_contra_muon_reads_the_input_of_any_orthogonalizer(monkeypatch, layout):
    """ContraMuon after exact_polar, a registered orthogonalizer, equals the float64 step with the same polar
    factor and the same ContraMuon (tests/test_stages.py's contra64) block by block: the post-process stage
    read what went into the registered orthogonalizer, on plain, split and transposed matrices."""
    from test_optim_edges import f64_run, run_ours
    from test_stages import STAGES

    monkeypatch.setitem(stages.ORTHOGONALIZERS, "exact_polar", exact_polar)
    shape = (32, 24) if layout.get("transposed") else (24, 32)
    gen = torch.Generator().manual_seed(3)
    start, grads = torch.randn(shape, generator=gen) * 0.5, [torch.randn(shape, generator=gen) for _ in range(4)]
    cfgs = [dict(GROUP, orthogonalizer="exact_polar", post_process=("contra", "variance_reduction"))] * 4
    ref = f64_run(start, grads, cfgs, split=layout.get("split"), transposed=layout.get("transposed", False),
                  stages=dict(STAGES, exact_polar=exact_polar))
    without = f64_run(start, grads, [dict(c, post_process="variance_reduction") for c in cfgs],
                      split=layout.get("split"), transposed=layout.get("transposed", False),
                      stages=dict(exact_polar=exact_polar))
    assert (ref - without).abs().max() > 1e-3
    torch.testing.assert_close(run_ours(start, grads, cfgs, **layout).double(), ref, rtol=0, atol=2e-5)


def test_a_wrapper_of_newton_schulz_keeps_the_method_it_wraps(monkeypatch):
    """A wrapper of standard Newton-Schulz runs standard Newton-Schulz, not 'auto''s Gram, where Gram pays
    (SHAPES' wide and tall matrices in fp32): registered with the method it wraps, the same params to the bit in
    MuonAdamW and in the float64 reference, and the same owner-plan cost; a bare wrapper of the entry's
    function keeps it too."""
    entry = stages.ORTHOGONALIZERS["newton_schulz"]
    assert entry.method == "standard"
    monkeypatch.setitem(stages.ORTHOGONALIZERS, "my_ns", stages.Stage(
        lambda G, ctx: muon.newton_schulz(G, ctx) * 1.0, flags=stages.SLICES, method="standard"))
    monkeypatch.setitem(stages.ORTHOGONALIZERS, "bare_ns", lambda G, ctx: entry.fn(G, ctx) * 1.0)
    start, grads = start_and_grads()
    standard = train(MuonAdamW, start, grads, orthogonalizer="newton_schulz")
    assert any(not torch.equal(a, s) for a, s in
               zip(train(MuonAdamW, start, grads, orthogonalizer="auto"), standard))  # the test sees which
    for name in ("my_ns", "bare_ns"):
        assert all(map(torch.equal, train(MuonAdamW, start, grads, orthogonalizer=name), standard)), name
    assert all(map(torch.equal, reference(start, grads, "my_ns"), reference(start, grads, "newton_schulz")))

    p = torch.zeros(24, 96)
    group = dict(GROUP, params=[p], ns_precision="fp32", ns_coefficients="jordan", ns_repeat_last=False,
                 split=None, qkv_split=None, transposed=False, precondition=(), post_process=(),
                 apply="cautious", kind="muon")
    fill_defaults(group)
    cost = {name: owners.update_cost(stages.muon_plan(dict(group, orthogonalizer=name), p.shape, p.dtype,
                                                      p.device), p.shape)
            for name in ("my_ns", "newton_schulz", "auto")}
    assert cost["my_ns"] == cost["newton_schulz"] == owners.ns_flops(p.shape, 5) > cost["auto"]


def test_an_orthogonalizer_naming_no_known_method_is_refused_at_construction(monkeypatch):
    """A registered entry's method decides the cost, the reference and old checkpoints' reading:
    one that names no Newton-Schulz method (a typo) is refused where the group is checked."""
    monkeypatch.setitem(stages.ORTHOGONALIZERS, "typo_ns", stages.Stage(
        muon.newton_schulz, flags=stages.Flags(on_slices=True), method="grma"))
    with pytest.raises(ValueError, match="method 'grma' is not one of .'standard', 'gram', 'auto'."):
        MuonAdamW([dict(GROUP, kind="muon", params=[torch.nn.Parameter(torch.zeros(8, 8))],
                        orthogonalizer="typo_ns")])


@pytest.mark.parametrize("method,name", [("standard", "newton_schulz"), ("gram", "gram_newton_schulz"),
                                         ("auto", "auto"), ("unknown", "auto")])
def test_a_checkpoint_from_before_the_registry_loads_its_method(method, name, monkeypatch):
    """A group saved with ns_method (before the orthogonalizer registry) loads as the built-in entry that runs
    that method, a registered wrapper with the same method notwithstanding."""
    monkeypatch.setitem(stages.ORTHOGONALIZERS, "my_ns", stages.Stage(
        lambda G, ctx: muon.newton_schulz(G, ctx), flags=stages.SLICES, method="standard"))
    p = torch.nn.Parameter(torch.zeros(8, 4))
    opt = MuonAdamW([dict(kind="muon", params=[p], **GROUP)])
    sd = opt.state_dict()
    del sd["param_groups"][0]["orthogonalizer"]
    sd["param_groups"][0]["ns_method"] = method
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["orthogonalizer"] == name and "ns_method" not in opt.param_groups[0]
