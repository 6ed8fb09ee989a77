"""
The Muon update's stage registries (nanomuon/stages.py) and techniques from modded-nanogpt's optimization
track added through them: SOAP-Muon (a stateful precondition stage), the u/w floor and ContraMuon (post-process),
MuonH (a stateful apply stage), Muown (a precondition that owns the momentum and a logical apply stage sharing
state with it, on the step and horizon) and PowerCool (base_train's schedule).

Each update stage is held to a float64 re-derivation written here and run through reference.muon_step (Muown's
on split and transposed layouts too); at 2 and 3 ranks DistMuonAdamW equals one device with bitwise identical
ranks; a sharded checkpoint saved at one world size resumes at another as the run would have gone on; the FSDP2
path runs SOAP and refuses, in one line, the stages that read whole weights, which FSDP2 keeps in blocks."""

import math
from pathlib import Path

import pytest
import torch
from test_dist import (
    integer_grads,
    integer_mean_grads,
    resumes_at_another_world_size,
    spawn,
    steps_beside_one_device,
)
from test_optim import ns_context
from test_optim_edges import f64_run, run_ours

from nanomuon import checkpoint, owners, stages
from nanomuon.optim import DistMuonAdamW, MuonAdamW

BASE = dict(lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.2)


# -- float64 definitions, from the sources' formulas (reference.muon_step's `stages`) ------------------------


def soap64(u, p, g, state, group):
    """SOAP-Muon: Adam on u in the bases of the gradient covariances seen before this step; then this step's
    gradient joins the covariances, and the bases are made (eigh) or refreshed (power step + QR, sorted)."""
    beta, every = group.get("soap_beta", 0.9), group.get("precondition_frequency", 10)
    k = state.get("soap_k", 0)
    out = u
    if k > 0:
        P = state["QL"].T @ u @ state["QR"]
        state["V"] = beta * state["V"] + (1 - beta) * P ** 2
        pre = state["QL"] @ (P / (state["V"].sqrt() + 1e-8)) @ state["QR"].T
        out = pre * torch.linalg.matrix_norm(u) / torch.linalg.matrix_norm(pre).clamp_min(1e-8)
    state["L"] = beta * state.get("L", 0) + (1 - beta) * g @ g.T
    state["R"] = beta * state.get("R", 0) + (1 - beta) * g.T @ g
    if k == 0:
        state["QL"], state["QR"] = (torch.linalg.eigh(state[c])[1].flip(-1) for c in "LR")
        state["V"] = torch.zeros_like(u)
    elif k % every == 0:
        for c, q, dim in (("L", "QL", 0), ("R", "QR", 1)):
            order = torch.argsort(torch.diag(state[q].T @ state[c] @ state[q]), descending=True)
            state["V"] = state["V"].index_select(dim, order)
            state[q] = torch.linalg.qr(state[c] @ state[q][:, order])[0]
    state["soap_k"] = k + 1
    return out


def uw_floor64(o, p, g, state, group, u):
    """The u/w floor: ||o|| lifted to c ||p|| when below it."""
    lift = group.get("uw_floor", 0.35) * torch.linalg.matrix_norm(p).clamp_min(1e-8)
    return o * max(1.0, (lift / torch.linalg.matrix_norm(o).clamp_min(1e-8)).item())


def hyperball64(p, o, lr, decay, state, group):
    """MuonH: a step of relative size lr along o, then back onto the sphere of the first weight's norm
    (sqrt(rows) for a zero matrix)."""
    norm = torch.linalg.matrix_norm(p).item()
    r = state.setdefault("r", norm if norm > 0 else math.sqrt(p.shape[0]))
    q = p - lr * r * o / torch.linalg.matrix_norm(o)
    return q * r / torch.linalg.matrix_norm(q)


def contra64(o, p, g, state, group, u):
    """ContraMuon: o - contra/2 u / sigma(u), sigma by 5 power iterations from the all-ones vector (as
    published), then o's Frobenius norm restored."""
    v = torch.ones(u.shape[1], dtype=torch.float64) / math.sqrt(u.shape[1])
    for _ in range(5):
        w = u @ v
        w = w / w.norm()
        v = u.T @ w
        v = v / v.norm()
    out = o - group.get("contra", 0.4) / 2 * u / (u @ v).norm()
    return out * torch.linalg.matrix_norm(o) / torch.linalg.matrix_norm(out)


def muown_direction64(x, p, g, state, group):
    """Muown as the record writes it: W = gain v / ||v|| row by row (gain and ||v|| start at the row
    norms, 1 for a zero row); the gradient splits into the gain's and the direction's, and the
    direction's gets momentum in the record's form, m = mu m + dv, Nesterov dv + mu m (Muon's EMA
    is this times 1 - mu, which the orthogonalizer's normalization cancels). x is not used: the
    stage owns the momentum."""
    if "gain" not in state:
        norm = p.norm(dim=1, keepdim=True)
        norm = torch.where(norm > 1e-12, norm, torch.ones_like(norm))
        state.update(gain=norm.clone(), v_norm=norm.clone(), start=norm.clone(), m_v=torch.zeros_like(p),
                     m_g=0.0, v_g=0.0, k=0)
    u = p / state["gain"]
    state["dg"] = (g * u).sum(dim=1, keepdim=True)
    dv = state["gain"] / state["v_norm"] * (g - u * state["dg"])
    state["m_v"] = group["momentum"] * state["m_v"] + dv
    return dv + group["momentum"] * state["m_v"]


def muown_apply64(p, o, lr, decay, state, group):
    """v = ||v|| W / gain steps by lr along o, the gain by bias-corrected Adam at the group lr, W = gain v / ||v||;
    then ||v|| goes from its start towards the target as ((k - 1) / (T - 1))^power. No weight decay."""
    state["k"] = k = state["k"] + 1
    v = p / state["gain"] * state["v_norm"] - lr * o
    b1, b2 = group.get("muown_betas", (0.9, 0.95))
    state["m_g"] = b1 * state["m_g"] + (1 - b1) * state["dg"]
    state["v_g"] = b2 * state["v_g"] + (1 - b2) * state["dg"] ** 2
    state["gain"] = state["gain"] - group["lr"] * group.get("muown_gain_lr", 1.0) * (state["m_g"] / (1 - b1 ** k)) / (
        (state["v_g"] / (1 - b2 ** k)).sqrt() + 1e-8)
    target, T = group.get("muown_v_norm_target", 2.496), group["horizon"]
    if target is not None:
        progress = 1.0 if T <= 1 else min(max((k - 1) / (T - 1), 0.0), 1.0) ** group.get("muown_v_norm_power", 1.2)
        state["v_norm"] = state["start"] + (target - state["start"]) * progress
    return state["gain"] * v / v.norm(dim=1, keepdim=True)


STAGES = {"soap": soap64, "uw_floor": uw_floor64, "hyperball": hyperball64, "contra": contra64,
          "precondition:muown": muown_direction64, "apply:muown": muown_apply64}
TECHNIQUES = {  # name -> the muon options of its variant
    "soap": dict(precondition="soap"),
    "uw_floor": dict(post_process=("variance_reduction", "uw_floor")),
    "hyperball": dict(apply="hyperball"),
    "contra": dict(post_process=("contra", "variance_reduction")),
    # the record's step: lr x 0.2 x sqrt(max(rows, cols)); a v-norm target the schedule visibly moves to
    "muown": dict(precondition="muown", post_process=(), apply="muown", lr_scale="spectral", extra_scale=0.2,
                  horizon=8, muown_v_norm_target=6.0, muown_gain_lr=0.5),
}


# SOAP's first bases come from covariances with a null space (a gradient has rank min(rows, cols)), where
# every basis is an eigenbasis and Adam in it depends on which one LAPACK returns: a rounding apart, two runs
# pick different ones. Integer gradients and an EMA of 1/2 keep the covariances exact on every path.
SOAP_EXACT = dict(soap_beta=0.5, precondition_frequency=3)


def grads_for(shape, steps, seed):
    """Integer-valued gradients (SOAP_EXACT)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-4, 5, shape, generator=gen).float() for _ in range(steps)]


@pytest.mark.parametrize("shape", [(24, 24), (32, 16), (16, 32), (2, 20, 12)], ids=str)
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_each_stage_matches_its_float64_definition(technique, shape):
    """Eight steps of each stage on a square, tall, wide and batched matrix (SOAP refreshed every 3 steps) equal
    the float64 definition; the stage changes the trajectory, so the comparison sees it."""
    options = dict(TECHNIQUES[technique], **SOAP_EXACT) if technique == "soap" else TECHNIQUES[technique]
    scale = 1.0 if technique == "uw_floor" else 0.5  # weights large enough for the floor to lift
    start, grads = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * scale, grads_for(shape, 8, 2)
    cfgs = [dict(BASE, **options)] * 8
    ref = f64_run(start, grads, cfgs, stages=STAGES)
    plain = f64_run(start, grads, [BASE] * 8)
    assert (ref - plain).abs().max() > 1e-3
    # SOAP in float64 on our side too: its first bases need the exact covariances (SOAP_EXACT)
    dtype = torch.float64 if technique == "soap" else torch.float32
    ours = run_ours(start.to(dtype), [g.to(dtype) for g in grads], cfgs)
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-5)


def test_an_interval_given_as_a_fraction_of_the_run_is_that_many_steps():
    """SOAP refreshed every 0.3 of a 10-step horizon equals the float64 definition refreshed every 3
    steps (and differs from every 10); a fraction in a group without a horizon, and a value that is
    neither steps nor a fraction, are refused in one line."""
    shape = (24, 16)
    start, grads = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.5, grads_for(shape, 8, 2)
    cfgs = [dict(BASE, precondition="soap", soap_beta=0.5, precondition_frequency=0.3, horizon=10)] * 8
    ours = run_ours(start.double(), [g.double() for g in grads], cfgs)
    every = {n: f64_run(start, grads, [dict(c, precondition_frequency=n) for c in cfgs], stages=STAGES)
             for n in (3, 10)}
    torch.testing.assert_close(ours, every[3], rtol=0, atol=2e-5)
    assert (every[3] - every[10]).abs().max() > 1e-3
    p = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match=r"precondition_frequency=0.3 is a fraction of the run, which this group "
                                         r"does not know: give it horizon="):
        MuonAdamW([dict(BASE, kind="muon", params=[p], precondition="soap", precondition_frequency=0.3)])
    for bad in (0.0, 1.0, 1.5, 0, True, "0.1"):
        with pytest.raises(ValueError, match=r"must be steps \(an int >= 1\) or a fraction of the run's horizon"):
            MuonAdamW([dict(BASE, kind="muon", params=[p], precondition="soap", precondition_frequency=bad,
                            horizon=10)])


def test_the_floor_lifts_only_updates_below_it():
    """With c = 0.35 the floor leaves an update of a small weight alone and lifts that of a large one to c ||W||."""
    small, large = torch.randn(24, 40) * 0.01, torch.randn(24, 40) * 3
    o = torch.linalg.svd(torch.randn(24, 40), full_matrices=False)
    o = (o.U @ o.Vh).float()
    ctx = ns_context(small, post_process=("uw_floor",), uw_floor=0.35)._replace(weight=torch.stack([small, large]))
    out = stages.uw_floor(torch.stack([o, o]).clone(), ctx)
    torch.testing.assert_close(out[0], o)
    torch.testing.assert_close(torch.linalg.matrix_norm(out[1]), 0.35 * torch.linalg.matrix_norm(large))


def test_hyperball_keeps_each_matrix_on_its_initial_sphere():
    """MuonH: after every step each matrix has its initial Frobenius norm; one initialized at zero takes
    sqrt(rows) at its first step and keeps it."""
    ps = [torch.nn.Parameter(torch.randn(24, 40) * 0.3), torch.nn.Parameter(torch.zeros(24, 40))]
    radius = [torch.linalg.matrix_norm(ps[0]).item(), math.sqrt(24)]
    opt = MuonAdamW([dict(kind="muon", params=ps, apply="hyperball", **BASE)])
    for g in grads_for((2, 24, 40), 5, 3):
        ps[0].grad, ps[1].grad = g[0], g[1]
        opt.step()
        for p, r in zip(ps, radius):
            assert abs(torch.linalg.matrix_norm(p).item() / r - 1) < 1e-5


@pytest.mark.parametrize("layout", [dict(split=(8, 8, 8)), dict(transposed=True), dict(qkv_split=(16, 4, 4))],
                         ids=["heads", "transposed", "gqa"])
def test_soap_on_fused_and_transposed_matrices_is_soap_per_block(layout):
    """SOAP's state on a split matrix lives flat in the per-param state, block after block, and each block is
    preconditioned as a matrix of its own; on an (in, out) matrix, in its logical orientation."""
    shape = (32, 24) if layout.get("transposed") else (24, 32)
    start, grads = torch.randn(shape, generator=torch.Generator().manual_seed(4)), grads_for(shape, 6, 5)
    cfgs = [dict(BASE, precondition="soap", **SOAP_EXACT)] * 6
    split = layout.get("split") or layout.get("qkv_split")
    ref = f64_run(start, grads, cfgs, split=split, transposed=layout.get("transposed", False), stages=STAGES)
    ours = run_ours(start.double(), [g.double() for g in grads], cfgs, **layout)
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("layout", [dict(split=(8, 8, 8)), dict(transposed=True), dict(qkv_split=(16, 4, 4)),
                                    dict(split=(8, 4, 4), split_groups=2),
                                    dict(transposed=True, split=(8, 8, 8))],
                         ids=["heads", "transposed", "gqa", "interleaved-groups", "transposed-heads"])
def test_muown_shares_its_state_per_block_on_every_layout(layout):
    """Muown's precondition reads the gain and ||v|| its apply stage keeps, and the apply stage the gain's
    gradient the precondition leaves: each block of a split matrix (of an (in, out) one, by its logical rows)
    keeps its own and moves as a separate param of the float64 record, its zero rows included."""
    split = layout.get("split") or layout.get("qkv_split")
    rows = sum(split) * layout.get("split_groups", 1) if split else 24
    shape = (20, rows) if layout.get("transposed") else (rows, 20)
    start = torch.randn(shape, generator=torch.Generator().manual_seed(8)) * 0.5
    (start.T if layout.get("transposed") else start)[:4] = 0  # a zero row's gain starts at 1
    grads = grads_for(shape, 6, 9)
    cfgs = [dict(BASE, **dict(TECHNIQUES["muown"], horizon=6))] * 6
    ref = f64_run(start, grads, cfgs, split=split, groups=layout.get("split_groups", 1),
                  transposed=layout.get("transposed", False), stages=STAGES)
    ours = run_ours(start.double(), [g.double() for g in grads], cfgs, **layout)
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=1e-5)  # eps of NS: EMA vs sum momentum
    whole = f64_run(start, grads, cfgs, transposed=layout.get("transposed", False), stages=STAGES)
    assert not split or (whole - ref).abs().max() > 1e-3  # per block is not the whole matrix's


def test_muown_keeps_no_momentum_buffer_and_applies_no_weight_decay():
    """The precondition owns the momentum: the optimizer makes no momentum_buffer, so Muown keeps one
    matrix-sized buffer (its direction's momentum, in the param's dtype) and six numbers per row; its apply
    stage says it applies no weight decay, and a weight_decay changes nothing."""
    runs = []
    for wd in (0.0, 0.5):
        p = torch.nn.Parameter(torch.randn(24, 16, generator=torch.Generator().manual_seed(0)).bfloat16())
        opt = MuonAdamW([dict(kind="muon", params=[p], **dict(BASE, weight_decay=wd), **TECHNIQUES["muown"])])
        for g in grads_for((24, 16), 3, 1):
            p.grad = g.bfloat16()
            opt.step()
        runs.append(p.detach().clone())
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in opt.state[p].items()}
    rows = ((24, 1), torch.float32)
    assert shapes == {"muown_momentum": ((24, 16), torch.bfloat16), "muown_gain_grad": rows, "muown_gain": rows,
                      "muown_v_norm": rows, "muown_v_norm_start": rows, "muown_gain_exp_avg": rows,
                      "muown_gain_exp_avg_sq": rows}
    assert torch.equal(runs[0], runs[1])
    group = opt.param_groups[0]
    plan = stages.muon_plan(group, p.shape, p.dtype, p.device)
    assert not plan.decays
    assert "weight decay not applied (apply stage 'muown')" in plan.summary
    assert "momentum kept by precondition 'muown'" in plan.summary
    assert stages.muon_plan(dict(group, precondition=(), apply="cautious"), p.shape, p.dtype, p.device).decays


def test_a_negative_muown_second_moment_is_refused_at_load():
    """Muown's gain steps by Adam, whose second moment's square root is taken: a saved negative one would
    make the gain NaN at the next step, so the load refuses it in one line, as it does AdamW's."""
    p = torch.nn.Parameter(torch.randn(24, 16, generator=torch.Generator().manual_seed(0)))
    group = lambda q: dict(kind="muon", params=[q], **BASE, **TECHNIQUES["muown"])
    opt = MuonAdamW([group(p)])
    p.grad = grads_for((24, 16), 1, 1)[0]
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["muown_gain_exp_avg_sq"] = saved["state"][0]["muown_gain_exp_avg_sq"].clone().fill_(-1.0)
    fresh = MuonAdamW([group(torch.nn.Parameter(p.detach().clone()))])
    with pytest.raises(ValueError, match=r"'muown_gain_exp_avg_sq' holds negative values \(down to -1\)"):
        fresh.load_state_dict(saved)


def test_muowns_schedule_needs_a_horizon():
    p = torch.nn.Parameter(torch.randn(8, 8))
    options = dict(TECHNIQUES["muown"], horizon=None)
    with pytest.raises(ValueError, match=r"apply 'muown': Muown's v-norm schedule needs the run's length"):
        MuonAdamW([dict(kind="muon", params=[p], **BASE, **options)])
    MuonAdamW([dict(kind="muon", params=[p], **BASE, **dict(options, muown_v_norm_target=None))])


def _probe(seen):
    """A precondition that records the step and horizon it sees, and changes nothing."""
    def fn(g, ctx):
        seen.append((float(ctx.step), ctx.horizon))
        return g
    return stages.Stage(fn)


def test_a_stage_sees_the_step_and_the_horizon(monkeypatch):
    """ctx.step counts the group's updates, 1 at the first; it goes on across a state_dict() round trip and
    does not count a step in which none of the group's params had a grad. ctx.horizon is the group's."""
    seen = []
    monkeypatch.setitem(stages.PRECONDITIONERS, "probe", _probe(seen))
    p, q = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))
    groups = lambda: [dict(kind="muon", params=[p], precondition="probe", horizon=40, **BASE),
                      dict(kind="adamw", params=[q], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)]
    opt = MuonAdamW(groups())
    for step in range(3):
        p.grad = torch.randn(8, 8) if step != 1 else None
        q.grad = torch.randn(8)
        opt.step()
    saved = opt.state_dict()
    assert saved["param_groups"][0]["step"] == 2
    fresh = MuonAdamW(groups())
    fresh.load_state_dict(saved)
    p.grad = torch.randn(8, 8)
    fresh.step()
    assert seen == [(1.0, 40), (2.0, 40), (3.0, 40)]
    del saved["param_groups"][0]["step"]  # a checkpoint from before the count
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["step"] == 0


def _step_worker(rank, world):
    """Under DistMuonAdamW every rank's stages see the same step, whichever matrices the rank owns."""
    seen = []
    stages.PRECONDITIONERS["probe"] = _probe(seen)
    model = _model()
    opt = DistMuonAdamW([dict(kind="muon", params=model, precondition="probe", horizon=5, **BASE)])
    for step in range(3):
        for p, g in zip(model, _grads(step, rank, world)):
            p.grad = g
        opt.step()
    assert set(seen) == {(1.0, 5), (2.0, 5), (3.0, 5)} and opt.param_groups[0]["step"] == 3


def test_the_step_is_the_same_on_every_rank():
    spawn(_step_worker, 2)


@pytest.mark.parametrize("chosen,says", [
    (dict(post_process=("reader",)), r"post_process 'reader' reads state 'nowhere', which no other stage"),
    (dict(post_process=("radius_reader",), apply="hyperball"),
     r"post_process 'radius_reader' reads state 'hyperball_radius', which 'hyperball' keeps per stored matrix"),
    (dict(precondition=("equilibrate_row", "muown"), apply="muown", post_process=()),
     r"precondition 'muown' owns the momentum, which only the first precondition may"),
])
def test_shared_state_and_owned_momentum_are_checked(monkeypatch, chosen, says):
    """A stage that reads state no other stage declares, a direction stage that reads state an apply stage
    keeps per stored matrix, and momentum owned by a precondition after another: one line each,
    naming the group, where the group is given (not at its first step)."""
    monkeypatch.setitem(stages.POST_PROCESSORS, "reader", stages.Stage(lambda u, ctx: u,
                                                                                 reads=("nowhere",)))
    monkeypatch.setitem(stages.POST_PROCESSORS, "radius_reader", stages.Stage(
        lambda u, ctx: u, reads=("hyperball_radius",)))
    p = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match=r"param group 0 \(kind='muon'\): " + says):
        MuonAdamW([dict(kind="muon", params=[p], **dict(BASE, horizon=4), **chosen)])


@pytest.mark.parametrize("key,value", [("precondition_frequency", 2 ** 70), ("input_interval", 2 ** 70),
                                       ("horizon", 10 ** 12), ("ns_steps", 10 ** 6)])
def test_a_count_past_any_run_is_refused_where_it_is_given(key, value):
    """An interval or count that no run could reach (2**70 steps overflows int64 at the first step;
    a million Newton-Schulz steps would allocate a million triples) is refused at construction."""
    stage = dict(precondition_frequency="soap", input_interval="newton").get(key)
    extra = dict(precondition=stage) if stage else {}
    p = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match=rf"{key}={value} must be"):
        MuonAdamW([dict(kind="muon", params=[p], **dict(BASE, **{key: value}, **extra))])


# -- what the optimizer does with a stage's declarations -------------------------------------------------------


def test_a_stage_option_is_declared_by_its_stage():
    """A stage's options are group keys with defaults (filled in, checked every step) only where it runs."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = MuonAdamW([dict(kind="muon", params=[p], precondition="soap", **BASE)])
    assert opt.param_groups[0]["precondition_frequency"] == 10 and opt.param_groups[0]["soap_beta"] == 0.9
    with pytest.raises(ValueError, match=r"precondition_frequency is an option of precondition 'soap', which"):
        MuonAdamW([dict(kind="muon", params=[torch.nn.Parameter(torch.randn(8, 8))], precondition_frequency=2,
                        **BASE)])
    opt.param_groups[0]["precondition_frequency"] = 0
    p.grad = torch.randn(8, 8)
    with pytest.raises(ValueError, match=r"precondition_frequency=0 must be steps \(an int >= 1\)"):
        opt.step()


def test_stage_state_follows_its_declaration():
    """The optimizer makes what the StateSpecs say: shapes from the matrix, fp32 beside bf16 params, the
    radius from the weight; saved in fp32 and loaded back as fp32."""
    p = torch.nn.Parameter(torch.randn(24, 16, dtype=torch.bfloat16))
    opt = MuonAdamW([dict(kind="muon", params=[p], precondition="soap", apply="hyperball", **BASE)])
    p.grad = torch.randn(24, 16, dtype=torch.bfloat16)
    opt.step()
    st = opt.state[p]
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in st.items()}
    f32 = torch.float32
    assert shapes == {"momentum_buffer": ((24, 16), torch.bfloat16), "soap_row_cov": ((24, 24), f32),
                      "soap_col_cov": ((16, 16), f32), "soap_row_basis": ((24, 24), f32),
                      "soap_col_basis": ((16, 16), f32), "soap_second_moment": ((24, 16), f32),
                      "soap_step": ((), f32), "second_momentum_buffer": ((24, 1), f32),
                      "hyperball_radius": ((1, 1), f32)}
    fresh = MuonAdamW([dict(kind="muon", params=[p], precondition="soap", apply="hyperball", **BASE)])
    fresh.load_state_dict(opt.state_dict())
    assert all(fresh.state[p][n].dtype == t.dtype and torch.equal(fresh.state[p][n], t) for n, t in st.items())


def test_a_stage_named_mid_run_starts_with_its_defaults():
    """SOAP named after three steps: its options take their defaults at the next step, its state starts then,
    and the run is the float64 definition's with SOAP from step 4 on."""
    start, grads = torch.randn(24, 24, generator=torch.Generator().manual_seed(6)), grads_for((24, 24), 7, 7)
    cfgs = [BASE] * 3 + [dict(BASE, precondition="soap")] * 4
    ref = f64_run(start, grads, cfgs, stages=STAGES)
    torch.testing.assert_close(run_ours(start.double(), [g.double() for g in grads], cfgs).double(), ref,
                               rtol=0, atol=2e-5)


def test_state_a_group_no_longer_keeps_loads_in_its_own_dtype():
    """Variance reduction switched off (beta2=None) keeps its fp32 state for later; a checkpoint of bf16 params
    brings it back in fp32, not rounded to bf16."""
    p = torch.nn.Parameter(torch.randn(16, 8, dtype=torch.bfloat16))
    opt = MuonAdamW([dict(kind="muon", params=[p], **BASE)])
    p.grad = torch.randn(16, 8, dtype=torch.bfloat16)
    opt.step()
    opt.param_groups[0]["beta2"] = None
    saved = opt.state_dict()
    fresh = MuonAdamW([dict(kind="muon", params=[p], **dict(BASE, beta2=None))])
    fresh.load_state_dict(saved)
    got, want = fresh.state[p]["second_momentum_buffer"], opt.state[p]["second_momentum_buffer"]
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_two_stages_may_not_keep_state_of_one_name(monkeypatch):
    spec = stages.StateSpec(lambda rows, cols: (rows, 1))
    clash = stages.Stage(lambda u, ctx: u, state=dict(second_momentum_buffer=spec))
    monkeypatch.setitem(stages.POST_PROCESSORS, "clash", clash)
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = MuonAdamW([dict(kind="muon", params=[p], post_process=("variance_reduction", "clash"), **BASE)])
    p.grad = torch.randn(8, 8)
    with pytest.raises(ValueError, match="keeps state 'second_momentum_buffer', as another stage"):
        opt.step()


def test_the_owner_plan_counts_a_stages_declared_cost():
    p = torch.zeros(24, 16)
    group = dict(BASE, kind="muon", params=[p])
    MuonAdamW([group])  # fills the defaults
    cost = lambda g: owners.update_cost(stages.muon_plan(g, p.shape, p.dtype, p.device), p.shape)
    plain = cost(group)
    group.update(precondition="soap", precondition_frequency=5, soap_beta=0.9)
    assert cost(group) == plain + 6 * 24 * 16 * 40 + 4 * (24 ** 3 + 16 ** 3) / 5


def test_checkpoints_from_before_the_stage_keys_load_as_what_ran():
    """A group saved with equilibrate, post_normalize and cautious_wd loads as the stages they meant."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = MuonAdamW([dict(kind="muon", params=[p], **BASE)])
    sd = opt.state_dict()
    for key in ("precondition", "post_process", "apply"):
        del sd["param_groups"][0][key]
    sd["param_groups"][0].update(equilibrate="row", post_normalize="col", cautious_wd=False)
    opt.load_state_dict(sd)
    group = opt.param_groups[0]
    assert (group["precondition"], group["post_process"], group["apply"]) == (
        ("equilibrate_row",), ("normalize_col", "variance_reduction"), "decoupled")
    assert not {"equilibrate", "post_normalize", "cautious_wd"} & set(group)


# -- PowerCool ---------------------------------------------------------------------------------------------


def test_powercool_is_min_lr0_c_t_minus_step_to_the_1_2():
    """base_train's powercool schedule equals the record's min(lr0, c (T - step)^1.2), with c putting the knee
    --warmdown-ratio of the steps before the end, and the --optimizer muon-powercool variant selects it."""
    from nanomuon.arch import LR_SCHEDULES
    from scripts.base_train import schedule_name
    from scripts.train_args import parse_args

    args = parse_args(["--optimizer", "muon-powercool", "--warmdown-ratio", "0.3", "--warmup-ratio", "0",
                       "--final-lr-frac", "0"])
    assert schedule_name(args) == "powercool" and schedule_name(parse_args([])) == "warmup_warmdown"
    T, lr0 = 400, 0.02
    c = lr0 / (0.3 * T) ** 1.2
    ratios = (args.warmup_ratio, args.warmdown_ratio, args.final_lr_frac)
    got = [lr0 * LR_SCHEDULES["powercool"](s, T, *ratios) for s in range(T)]
    want = [min(lr0, c * (T - s) ** 1.2) for s in range(T)]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-12
    linear = [lr0 * LR_SCHEDULES["warmup_warmdown"](s, T, *ratios) for s in range(T)]
    assert max(abs(a - b) for a, b in zip(got, linear)) > 1e-3


# -- distributed: DistMuonAdamW at 2 and 3 ranks, sharded checkpoints, FSDP2 -----------------------------------

SHAPES = [(24, 24)] * 3 + [(16, 16)] * 2 + [(24, 16)]


def _model(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.5) for s in SHAPES]


def _groups(params, technique):
    return [dict(kind="muon", params=params, ns_precision="fp32", **BASE, **TECHNIQUES[technique],
                 **(SOAP_EXACT if technique == "soap" else {}))]


def _grads(step, rank=0, world=1):
    return integer_grads(SHAPES, step, rank, world)


def _mean_grads(step, world):
    return integer_mean_grads(SHAPES, step, world)


def _dist_worker(rank, world, technique):
    steps_beside_one_device(rank, world, _model, _groups, technique, _grads, _mean_grads, 6, 2e-5)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_dist_equals_single_device(technique, world):
    spawn(_dist_worker, world, technique)


@pytest.mark.parametrize("technique", [  # a stage with state, one owning momentum
    t if t == "soap" else pytest.param(t, marks=pytest.mark.heavy if t == "muown" else pytest.mark.slow)
    for t in TECHNIQUES])
def test_a_checkpoint_resumes_at_another_world_size(tmp_path, technique):
    """Saved at 2 ranks (each its own pieces of the stage state), resumed at 3: the run equals an
    uninterrupted one on one device."""
    resumes_at_another_world_size(tmp_path, _model, _groups, technique, _grads, _mean_grads, 2e-5)


@pytest.mark.heavy
def test_fsdp2_runs_soap_and_refuses_stages_that_read_whole_weights():
    """SOAP on every DTensor placement (FSDP2's Shard(0), tensor parallel's Shard(1), 2-D meshes, experts):
    the raw gradient travels to each matrix's owner with its momentum step; state and resume as the unsharded
    run. The u/w floor and MuonH read whole weights, which stay in blocks: one line says so."""
    from test_sharded import _placements_worker

    spawn(_placements_worker, 2, dict(precondition="soap", **SOAP_EXACT), 1e-5)
    spawn(_refusal_worker, 2)


def _refusal_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]))
    for technique in ("uw_floor", "hyperball", "muown"):
        with pytest.raises(ValueError, match="reads whole weight matrices, which sharded .* keep in blocks"):
            MuonAdamW(_groups([p], technique))
    # state a group keeps no more (beta2=None) is still the holder's, and every rank's state_dict() has it
    opt = MuonAdamW([dict(kind="muon", params=[p], **BASE)])
    p.grad = distribute_tensor(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)])
    opt.step()
    opt.param_groups[0]["beta2"] = None
    second = opt.state_dict()["state"][0]["second_momentum_buffer"]
    everyone = [torch.empty_like(second) for _ in range(world)]
    torch.distributed.all_gather(everyone, second)
    assert all(torch.equal(t, second) for t in everyone) and second.abs().sum() > 0


def _switch_worker(rank, world):
    """MuonH named between steps, saved before the step that makes its radius: the owners save the radius
    the step would make (the weight's norm), not zeros that would wipe the weights on resume."""
    model = _model()
    opt = DistMuonAdamW(_groups(model, "uw_floor"))
    for p, g in zip(model, _grads(0, rank, world)):
        p.grad = g
    opt.step()
    opt.param_groups[0]["apply"] = "hyperball"
    radius = {pid: st["hyperball_radius"] for pid, st in opt.state_dict()["state"].items()}
    for pid, p in enumerate(model):
        torch.testing.assert_close(radius[pid].reshape(()), torch.linalg.matrix_norm(p.detach()))


def test_state_declared_mid_run_is_saved_as_it_will_start():
    spawn(_switch_worker, 2)


def test_the_readme_counts_hold():
    """Each technique is one function, one registry entry and one variants line: the entries exist and name
    their function, and the variants name them."""
    from nanomuon.arch import Variant
    from nanomuon.variants import OPTIMIZER_VARIANTS

    assert stages.PRECONDITIONERS["soap"].fn is stages.soap
    assert stages.POST_PROCESSORS["uw_floor"].fn is stages.uw_floor
    assert stages.APPLIERS["hyperball"].fn is stages.hyperball
    assert stages.POST_PROCESSORS["contra"].fn is stages.contra
    contra = dict(post_process=("contra", "variance_reduction"))
    assert OPTIMIZER_VARIANTS["muon-contra"] == Variant(muon_options=contra)
    assert OPTIMIZER_VARIANTS["muon-soap"] == Variant(muon_options=dict(precondition="soap"))
    assert OPTIMIZER_VARIANTS["muon-powercool"] == Variant(schedule="powercool")
    assert Path(stages.__file__).read_text().count("def soap(") == 1


def test_base_train_refuses_fsdp_with_a_stage_that_reads_whole_weights(capsys):
    from scripts.train_args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--fsdp", "--optimizer", "muon-uw-floor", "--num-iterations", "1"])
    assert "post_process 'uw_floor' reads whole weight matrices" in capsys.readouterr().err


@pytest.mark.parametrize("variant,says", [
    ("muon", "matrices: muon, peak lr 0.02, momentum the arch's schedule, weight decay 0.2"),
    ("muon-muown", "matrices: muon, peak lr 0.02, momentum the arch's schedule, weight decay not applied "
                   "by its apply stage 'muown'"),
    ("muon-hyperball", "weight decay not applied by its apply stage 'hyperball'"),
    ("adamw", "matrices: adamw, peak lr"),
    ("torch-muon", "matrices: muon, peak lr 0.02, momentum the arch's schedule, weight decay 0.2"),
])
def test_the_run_header_says_what_the_stages_use(variant, says):
    """base_train's header names the weight decay only where a stage applies it, and each muon group's
    stages, who keeps the momentum, and the horizon the stages see (the run's steps)."""
    from nanomuon.arch import ARCHS
    from nanomuon.gpt import GPT, config_from_depth
    from scripts.base_train import group_words, optimizer_options
    from scripts.train_args import parse_args

    args = parse_args(["--optimizer", variant, "--weight-decay", "0.2", "--num-iterations", "7", "--arch", "classic",
                       "--total-batch-size", "4096"])
    model = GPT(config_from_depth(2, 64, 16, aspect_ratio=32, head_dim=16))
    opt = model.setup_optimizer(**optimizer_options(args, compiled=False), horizon=7)
    lines = [group_words(g, ARCHS["classic"], args) for g in opt.param_groups]
    assert any(says in line for line in lines), lines
    for group in (g for g in opt.param_groups if g.get("kind") == "muon" and "apply" in g):
        assert group["horizon"] == 7
        first = group["params"][0]
        summary = stages.muon_plan(group, first.shape, first.dtype, first.device).summary
        assert ("momentum kept by precondition 'muown'" in summary) == (
            variant == "muon-muown")


@pytest.mark.slow
def test_compiled_stages_equal_eager():
    """The u/w floor and MuonH under torch.compile (fullgraph, as on GPUs) take the eager steps; SOAP's group
    runs eager even when compile is asked for (it branches on its step count)."""
    torch._dynamo.reset()  # the recompile limit counts every graph this process compiled before
    options = dict(post_process=("variance_reduction", "uw_floor"), apply="hyperball")
    runs = []
    for compiled in (False, True):
        params = _model()
        opts = [MuonAdamW([dict(kind="muon", params=params[:5], ns_precision="fp32", **BASE, **options)],
                          compile=compiled),
                MuonAdamW([dict(kind="muon", params=params[5:], ns_precision="fp32", **BASE, precondition="soap")],
                          compile=compiled)]
        for step in range(3):
            for p, g in zip(params, _mean_grads(step, 1)):
                p.grad = g
            for opt in opts:
                opt.step()
        runs.append(params)
    for p, q in zip(*runs):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_compiled_muown_equals_eager():
    """Muown under torch.compile (its step a 0-D tensor, its apply stage block by block on a split matrix) takes
    the eager steps."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        params = _model()
        opt = MuonAdamW([dict(kind="muon", params=params[:5], ns_precision="fp32", **BASE, **TECHNIQUES["muown"]),
                         dict(kind="muon", params=params[5:], ns_precision="fp32", split=(8, 8, 8), **BASE,
                              **TECHNIQUES["muown"])], compile=compiled)
        for step in range(3):
            for p, g in zip(params, _mean_grads(step, 1)):
                p.grad = g
            opt.step()
        runs.append(params)
    for p, q in zip(*runs):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


def _fsdp_checkpoint_worker(rank, world, path, mode):
    """A GPT under FSDP2 (every param a DTensor) training with SOAP: 'save' after 3 steps writes a sharded
    checkpoint (SOAP's state from each matrix's owner) and the whole state as the reference; 'load' reads it
    at another world size, where the whole state gathers back bitwise, and trains on."""
    from test_sharded import full
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nanomuon.arch import Variant
    from nanomuon.gpt import GPT, config_from_depth

    torch.manual_seed(0)
    model = GPT(config_from_depth(2, 64, 16, aspect_ratio=32, head_dim=16))
    model.init_weights()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = model.setup_optimizer(Variant(muon_options=dict(ns_precision="fp32", precondition="soap", **SOAP_EXACT)))

    def train(steps):
        for step in steps:
            gen = torch.Generator().manual_seed(rank + 10 * step)
            x, y = torch.randint(0, 64, (2, 16), generator=gen), torch.randint(0, 64, (2, 16), generator=gen)
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    if mode == "save":
        train(range(3))
        tensors, files = checkpoint.state_of(model, opt)
        checkpoint.save_checkpoint(path, 3, tensors, dict(step=3), files)
        whole = opt.state_dict()  # a collective, as full() is
        if rank == 0:
            torch.save(dict(opt=whole), path / "ref.pt")
        return
    checkpoint.load_into(path, 3, model, opt)
    ref, again = torch.load(path / "ref.pt"), opt.state_dict()
    names = {name for st in ref["opt"]["state"].values() for name in st}
    assert {"soap_row_cov", "soap_col_basis", "soap_second_moment", "soap_step"} <= names
    assert again["state"].keys() == ref["opt"]["state"].keys()
    for pid, st in ref["opt"]["state"].items():
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(again["state"][pid][name]), torch.as_tensor(v)), (pid, name)
    train(range(3, 5))
    assert all(torch.isfinite(full(p)).all() for p in model.parameters())


@pytest.mark.heavy
def test_fsdp2_soap_state_reshards_from_a_checkpoint(tmp_path):
    spawn(_fsdp_checkpoint_worker, 2, tmp_path, "save")
    spawn(_fsdp_checkpoint_worker, 3, tmp_path, "load")


def soap_optimizer():
    p = torch.nn.Parameter(torch.randn(16, 8))
    opt = MuonAdamW([dict(kind="muon", params=[p], precondition=("soap",), **BASE)])
    p.grad = torch.randn(16, 8)
    opt.step()
    return opt, p


@pytest.mark.parametrize("change,says", [
    (lambda st: st.update(second_momentum_buffer=st["second_momentum_buffer"][:3]),
     "state 'second_momentum_buffer' is (3, 1) torch.float32, this group keeps (16, 1)"),
    (lambda st: st.update(soap_row_cov=st["soap_row_cov"].long()),  # floats cast; ints not
     "state 'soap_row_cov' is (16, 16) torch.int64"),
    (lambda st: st.update(soap_col_basis=st["soap_col_basis"].new_zeros(4, 4)),
     "state 'soap_col_basis' is (4, 4)"),
    (lambda st: st.update(mystery=torch.zeros(2)), "state 'mystery' is not state this group keeps"),
    (lambda st: st.update(momentum_buffer=0.5), "state 'momentum_buffer' is a float, not a tensor"),
])
def test_load_state_dict_is_as_strict_as_the_constructor(change, says):
    """Saved stage state of the wrong shape or kind (an integer tensor: floats are cast, as
    torch casts them), state no stage keeps, or a number where a tensor belongs: one line naming
    the param, the state and what was expected, not fresh state at the next step, a cast of
    integers, or an AttributeError."""
    opt, p = soap_optimizer()
    saved = opt.state_dict()
    change(saved["state"][0])
    fresh = MuonAdamW([dict(kind="muon", params=[p], precondition=("soap",), **BASE)])
    with pytest.raises(ValueError, match=r"optimizer checkpoint: group 0 param 0 " + says.replace(
            "(", r"\(").replace(")", r"\)")):
        fresh.load_state_dict(saved)


def test_a_saved_group_with_an_unknown_key_is_refused_and_missing_stage_state_noted(caplog):
    """A saved group key no group takes is refused, as the constructor refuses it; a stage's
    state missing from the checkpoint (the stage added on resume) loads, with a note, and the
    stage starts it afresh."""
    opt, p = soap_optimizer()
    saved = opt.state_dict()
    saved["param_groups"][0]["wobble"] = 3
    fresh = MuonAdamW([dict(kind="muon", params=[p], precondition=("soap",), **BASE)])
    with pytest.raises(ValueError, match=r"group 0 has unknown keys \['wobble'\]"):
        fresh.load_state_dict(saved)
    saved = opt.state_dict()
    for name in [n for n in saved["state"][0] if n.startswith("soap")]:
        del saved["state"][0][name]
    with caplog.at_level("WARNING", logger="nanomuon"):
        fresh.load_state_dict(saved)
    assert "no saved soap_" in caplog.text and "starts it afresh" in caplog.text
    p.grad = torch.randn(16, 8)
    fresh.step()
    assert fresh.state[p]["soap_row_cov"].shape == (16, 16)
