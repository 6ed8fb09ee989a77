"""
Single-device MuonAdamW against independent references: torch.optim.AdamW, torch.optim.Muon and a
float64 re-derivation of the full nanochat Muon update written here, plus state, schedules and errors.
"""

import io

import pytest
import torch

from nanomuon.coefficients import ns_coefficients
from nanomuon.muon import NewtonSchulz, newton_schulz
from nanomuon.optim import MuonAdamW
from nanomuon.owners import gram_pays
from nanomuon.param_groups import fill_defaults
from nanomuon.reference import muon_step
from nanomuon.stages import NS_DTYPES, stage_context


def make_params(shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def set_grads(param_lists, step, seed=1):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    grads = [torch.randn(p.shape, generator=g) for p in param_lists[0]]
    for params in param_lists:
        for p, grad in zip(params, grads):
            p.grad = grad.clone()


def muon_group(params, **kw):
    return dict(kind="muon", params=params, lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.2) | kw


def adamw_group(params, **kw):
    return dict(kind="adamw", params=params, lr=3e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1) | kw


# -- AdamW ---------------------------------------------------------------------------------------


def test_adamw_matches_torch_adamw():
    ours = make_params([(37, 40), (16,), (8, 3, 5), ()])
    ref = clone_params(ours)
    opt = MuonAdamW([adamw_group(ours, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)])
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    for step in range(20):
        set_grads([ours, ref], step)
        opt.step()
        torch_opt.step()
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    assert max((p - q).abs().max().item() for p, q in zip(ours, make_params([(37, 40), (16,), (8, 3, 5), ()]))) > 0.05


# -- Muon ----------------------------------------------------------------------------------------


def test_muon_matches_torch_muon():
    """Variance reduction and cautious decay off, Jordan's NS5 in bf16: torch.optim.Muon's exact algorithm.

    Weight decay runs on square and wide matrices only: for tall ones nanochat (and so we) scale decay by the
    shape-adjusted lr, torch by the raw lr; the update itself is compared on a tall matrix with decay off.
    """
    decayed, tall = make_params([(48, 48), (32, 96), (32, 96)]), make_params([(96, 32), (64, 16)], seed=5)
    ref_decayed, ref_tall = clone_params(decayed), clone_params(tall)
    common = dict(beta2=None, apply="decoupled", ns_coefficients="jordan", ns_precision="bf16", momentum=0.9)
    opt = MuonAdamW([muon_group(decayed, weight_decay=0.1, **common), muon_group(tall, weight_decay=0.0, **common)])
    torch_opt = torch.optim.Muon([dict(params=ref_decayed, weight_decay=0.1), dict(params=ref_tall, weight_decay=0.0)],
                                 lr=0.02, momentum=0.9)
    for step in range(10):
        set_grads([decayed + tall, ref_decayed + ref_tall], step)
        opt.step()
        torch_opt.step()
    for p, r in zip(decayed + tall, ref_decayed + ref_tall):
        torch.testing.assert_close(p, r, rtol=0, atol=1e-5)


def reference_muon_f64(params, grads_per_step, lr, momentum, wd, beta2, **options):
    """Every param's trajectory under nanomuon.reference.muon_step, the float64 definition of the update."""
    params = [p.detach().double().clone() for p in params]
    states = [{} for _ in params]
    group = dict(lr=lr, momentum=momentum, weight_decay=wd, beta2=beta2, ns_steps=5, **options)
    for grads in grads_per_step:
        params = [muon_step(p, g, st, group) for p, g, st in zip(params, grads, states)]
    return params


@pytest.mark.parametrize("precision", ["fp32"])
def test_muon_full_update_matches_float64_rederivation(precision):
    shapes = [(40, 24), (24, 40), (32, 32), (40, 24)]  # tall, wide, square, and a repeat to stack
    ours = make_params(shapes)
    start = clone_params(ours)
    opt = MuonAdamW([muon_group(ours, ns_precision=precision)])
    grads_per_step = []
    for step in range(6):
        set_grads([ours], step)
        grads_per_step.append([p.grad.clone() for p in ours])
        opt.step()
    ref = reference_muon_f64(start, grads_per_step, lr=0.02, momentum=0.95, wd=0.2, beta2=0.95)
    for p, r, s in zip(ours, ref, start):
        moved = (r - s.double()).abs().max().item()
        assert moved > 0.05  # the update is large compared with the tolerance below
        torch.testing.assert_close(p.double(), r, rtol=0, atol=2e-4)


@pytest.mark.parametrize("options", [
    dict(lr_scale="moonlight"), dict(lr_scale="spectral", extra_scale=0.5), dict(lr_scale="unit_rms"),
    dict(weight_decay_mode="l2"),
], ids=["moonlight", "spectral-x0.5", "unit_rms", "l2"])
def test_lr_scale_and_weight_decay_modes_match_float64(options):
    shapes = [(64, 16), (16, 64)]  # default factors 2 and 1; moonlight 1.6, spectral 8, unit_rms 2 and 0.5
    ours = make_params(shapes)
    start = clone_params(ours)
    lr = 0.02
    opt = MuonAdamW([muon_group(ours, lr=lr, ns_precision="fp32", **options)])
    grads_per_step = []
    for step in range(4):
        set_grads([ours], step)
        grads_per_step.append([p.grad.clone() for p in ours])
        opt.step()
    ref = reference_muon_f64(start, grads_per_step, lr=lr, momentum=0.95, wd=0.2, beta2=0.95, **options)
    default = reference_muon_f64(start, grads_per_step, lr=lr, momentum=0.95, wd=0.2, beta2=0.95)
    assert max((r - d).abs().max().item() for r, d in zip(ref, default)) > 1e-2  # the option changes the update
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.double(), r, rtol=0, atol=2e-4)


def test_expert_weights_are_a_batch_of_matrices():
    """MoE: a 3-D (experts, out, in) param moves exactly like its experts as separate 2-D params (one
    batched call; the lr factor and variance reduction per expert, from the last two dims)."""
    experts = make_params([(4, 48, 16)])
    parts = [torch.nn.Parameter(t.detach().clone()) for t in experts[0].unbind(0)]
    opt = MuonAdamW([muon_group(experts, ns_precision="fp32")])
    ref = MuonAdamW([muon_group(parts, ns_precision="fp32")])
    for step in range(3):
        set_grads([experts], step)
        for part, g in zip(parts, experts[0].grad.unbind(0)):
            part.grad = g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(experts[0].detach(), torch.stack([p.detach() for p in parts]), rtol=0, atol=1e-6)


def spectral_band_input(m, n, seed):
    """An m x n matrix whose singular values span [1e-2, 1] of its Frobenius norm scale."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    sv = torch.logspace(-2, 0, k, dtype=torch.float64) * 5.0
    return (U * sv) @ V.T


def polynomial_via_svd(G, coeffs, safety, eps):
    """float64: what K Newton-Schulz iterations give exactly, U f(S) V^T with f the composed scalar quintics,
    and the polar factor U V^T."""
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    s = S / (S.square().sum(-1, keepdim=True).sqrt() * safety + eps)
    for a, b, c in coeffs:
        s = a * s + b * s ** 3 + c * s ** 5
    return U @ torch.diag_embed(s) @ Vh, U @ Vh


def ns_group(ns: NewtonSchulz, orthogonalizer: str = "newton_schulz") -> dict:
    """The options muon.newton_schulz reads, for these settings."""
    precision = {dtype: name for name, dtype in NS_DTYPES.items()}[ns.dtype]
    return dict(ns_coefficients=dict(coefficients=ns.coefficients, safety=ns.safety, eps=ns.eps),
                ns_steps=len(ns.coefficients), ns_repeat_last=False, ns_precision=precision,
                orthogonalizer=orthogonalizer)


def ns_context(G, **options):
    """A StageContext for calling muon.newton_schulz by hand on matrices like G: that of a
    muon group of these options, its defaults filled."""
    group = dict(dict(kind="muon", params=[], lr=0.02, momentum=0.95, ns_steps=5, beta2=None,
                      weight_decay=0.0), **options)
    fill_defaults(group)
    return stage_context(group, G)


def orthogonalize(G, ns: NewtonSchulz, gram: bool = False):
    return newton_schulz(G, ns_context(G, **ns_group(ns, "gram_newton_schulz" if gram
                                                      else "newton_schulz")))


def rel_err(X, ref):
    return (torch.linalg.matrix_norm(X.double() - ref) / torch.linalg.matrix_norm(ref)).max().item()


@pytest.mark.parametrize("shape", [(192, 48), (48, 192), (64, 64)])
@pytest.mark.parametrize("coefficients, steps", [("polar_express", 5), ("jordan", 5), ("deepseekv4", 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gram_newton_schulz_against_float64_svd(shape, coefficients, steps, dtype):
    """Gram Newton-Schulz computes the standard iteration's polynomial: in fp32 to ~1e-5 of the float64 SVD
    result, in fp16 as close to U V^T as the standard iteration. In bf16 it is not accurate (Polar Express
    lands 0.47-0.76 from U V^T here, standard bf16 0.10), so 'auto' runs it in fp32 and fp16 only, and only
    where it takes fewer FLOPs."""
    G = torch.stack([spectral_band_input(*shape, seed) for seed in range(3)]).float()
    coeffs, safety, eps = ns_coefficients(coefficients, steps)
    exact, polar = polynomial_via_svd(G, coeffs, safety, eps)
    ns = NewtonSchulz(coeffs, safety, eps, dtype)
    gram, standard = orthogonalize(G, ns, gram=True), orthogonalize(G, ns)
    assert gram.dtype == dtype and gram.shape == G.shape
    if dtype == torch.float32:
        assert rel_err(gram, exact) < 1e-4 and rel_err(standard, exact) < 2e-5
    elif dtype == torch.float16:
        assert rel_err(gram, polar) < 1.05 * rel_err(standard, polar) + 2e-3
    from nanomuon.owners import ns_flops

    cheaper = ns_flops(shape, steps, True) < ns_flops(shape, steps)
    assert cheaper == (max(shape) / min(shape) > 1.5)
    assert gram_pays(shape, steps, dtype) == (cheaper and dtype != torch.bfloat16)


@pytest.mark.parametrize("steps", [1, 3, 5, 7, 10])
def test_ns_flops_counts_the_matmuls_that_run(steps):
    """ns_flops (the Gram formula, restarts included) against torch's own FLOP counter."""
    from torch.utils.flop_counter import FlopCounterMode

    from nanomuon.owners import ns_flops

    G = torch.randn(2, 24, 96)
    for gram in (False, True):
        with FlopCounterMode(display=False) as counter:
            orthogonalize(G, NewtonSchulz(((1.5, -0.5, 0.0),) * steps, 1.0, 1e-7, torch.float32), gram)
        assert counter.get_total_flops() == ns_flops(G.shape, steps, gram=gram), gram


@pytest.mark.parametrize("shape", [(96, 48), (48, 96), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_polar_express_singular_value_band(shape, dtype):
    """Polar Express maps every singular value into a band around 1 (about [0.7, 1.15] after 5 steps).

    Inputs have singular values spread over two decades, the regime Muon's momentum lives in.
    """
    G = torch.stack([spectral_band_input(*shape, seed) for seed in range(3)]).float()
    coeffs, safety, eps = ns_coefficients("polar_express", 5)
    X = orthogonalize(G, NewtonSchulz(coeffs, safety, eps, dtype), gram_pays(shape, 5, dtype))
    assert X.dtype == dtype and X.shape == G.shape
    sv = torch.linalg.svdvals(X.double())
    assert sv.max().item() <= 1.16, sv.max().item()
    assert sv.min().item() >= 0.68, sv.min().item()
    # and it is close to the exact polar factor U V^T
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    rel = torch.linalg.matrix_norm(X.double() - U @ Vh) / torch.linalg.matrix_norm(U @ Vh)
    assert rel.max().item() < 0.2


def test_mixed_shape_group_equals_per_shape_groups():
    shapes = [(24, 16), (16, 24), (24, 16), (8, 4, 6)]  # the 3-D param is a batch of 4 matrices
    mixed = make_params(shapes)
    split = clone_params(mixed)
    opt_mixed = MuonAdamW([muon_group(mixed)])
    opt_split = MuonAdamW([muon_group([split[0], split[2]]), muon_group([split[1]]), muon_group([split[3]])])
    for step in range(5):
        set_grads([mixed, split], step)
        opt_mixed.step()
        opt_split.step()
    for p, q in zip(mixed, split):
        assert torch.equal(p, q)


def test_params_without_grad_are_skipped():
    params = make_params([(16, 8), (16, 8), (16, 8), (5,)])
    ref = clone_params(params)
    opt = MuonAdamW([muon_group(params[:3]), adamw_group(params[3:])])
    opt_ref = MuonAdamW([muon_group([ref[0], ref[2]]), adamw_group([])])
    for step in range(4):
        set_grads([params, ref], step)
        params[1].grad = None
        params[3].grad = None
        opt.step()
        opt_ref.step()
    assert torch.equal(params[1], ref[1]) and torch.equal(params[3], ref[3])  # untouched
    assert torch.equal(params[0], ref[0]) and torch.equal(params[2], ref[2])  # others as if alone
    assert not opt.state[params[3]]
    # the skipped muon param's momentum never moved
    assert torch.count_nonzero(opt.state[params[1]]["momentum_buffer"]) == 0


def run_steps(opt, params, steps, start=0):
    for step in range(start, start + steps):
        set_grads([params], step)
        opt.step()


def build(params):
    return MuonAdamW([muon_group(params[:3]), adamw_group(params[3:])])


def test_state_dict_round_trip_continues_identically():
    shapes = [(16, 24), (16, 24), (24, 8), (50, 20), (7,)]
    a = make_params(shapes)
    b = clone_params(a)
    opt_a = build(a)
    run_steps(opt_a, a, 10)  # uninterrupted
    opt_b = build(b)
    run_steps(opt_b, b, 4)
    buf = io.BytesIO()
    torch.save({"opt": opt_b.state_dict(), "params": [p.detach() for p in b]}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    c = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    opt_c = build(c)
    opt_c.load_state_dict(saved["opt"])
    run_steps(opt_c, c, 6, start=4)
    for p, q in zip(a, c):
        assert torch.equal(p, q)
    assert set(opt_c.state[c[0]]) == {"momentum_buffer", "second_momentum_buffer"}
    assert opt_c.state[c[3]]["step"] == 10


def test_load_keeps_fp32_second_moments_and_this_runs_layout_options():
    """torch's load_state_dict casts state to the param dtype and restores the saved group options; the
    tiny fp32 second moment must come back exact, and how params are sharded stays this run's choice."""
    params = make_params([(16, 8), (16, 8)], dtype=torch.bfloat16)
    opt = MuonAdamW([muon_group(params, sharded_mode="duplicated", comm_precision="bf16")])
    g = torch.Generator().manual_seed(3)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).bfloat16()
    opt.step()
    saved = opt.state_dict()
    assert saved["state"][0]["second_momentum_buffer"].dtype == torch.float32
    fresh = MuonAdamW([muon_group(clone_params(params))])
    fresh.load_state_dict(io_round_trip(saved))
    for p, q in zip(fresh.param_groups[0]["params"], params):
        got, want = fresh.state[p]["second_momentum_buffer"], opt.state[q]["second_momentum_buffer"]
        assert got.dtype == torch.float32 and torch.equal(got, want)
    assert fresh.param_groups[0]["sharded_mode"] == "owner" and fresh.param_groups[0]["comm_precision"] == "fp32"


def io_round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def nan_fill(name):
    return lambda st: st[name].fill_(float("nan"))


# param 0 is Muon's, 3 an AdamW one of 20 values (build: shapes (16, 24), (16, 24), (24, 8), (7,))
DAMAGED = {
    "NaN exp_avg_sq": (3, nan_fill("exp_avg_sq"), r"'exp_avg_sq' holds 7 NaN or infinite values of 7"),
    "negative exp_avg_sq": (3, lambda st: st["exp_avg_sq"].fill_(-1.0),
                            r"'exp_avg_sq' holds negative values \(down to -1\)"),
    "inf exp_avg": (3, lambda st: st["exp_avg"].fill_(float("inf")), r"'exp_avg' holds 7 NaN"),
    "step 'x'": (3, lambda st: st.update(step="x"), r"'step' is 'x', not a step count"),
    "step -5": (3, lambda st: st.update(step=-5), r"'step' is -5, not a step count"),
    "step 2.5": (3, lambda st: st.update(step=2.5), r"'step' is 2.5, not a step count"),
    "NaN momentum": (0, nan_fill("momentum_buffer"), r"param 0: 'momentum_buffer' holds 384 NaN"),
    "negative second moment": (0, lambda st: st["second_momentum_buffer"].fill_(-2.0),
                               r"'second_momentum_buffer' holds negative values"),
}


@pytest.mark.parametrize("name", list(DAMAGED))
def test_damaged_state_is_refused_at_load_and_loads_nothing(name):
    """NaN, inf or a negative second moment would poison every step after the load, and a step count
    that is not one fails inside the math: each is refused in one line naming the value, before the
    optimizer takes any of it."""
    idx, edit, says = DAMAGED[name]
    params = make_params([(16, 24), (16, 24), (24, 8), (7,)])
    opt = build(params)
    run_steps(opt, params, 1)
    saved = io_round_trip(opt.state_dict())
    edit(saved["state"][idx])
    fresh = build(clone_params(params))
    with pytest.raises(ValueError, match="optimizer state: param group .*" + says) as e:
        fresh.load_state_dict(saved)
    assert "\n" not in str(e.value) and "poison the next step" in str(e.value)
    assert not fresh.state


def test_a_saved_torch_style_tensor_step_still_loads():
    params = make_params([(16, 24), (16, 24), (24, 8), (7,)])
    opt = build(params)
    run_steps(opt, params, 1)
    saved = io_round_trip(opt.state_dict())
    saved["state"][3]["step"] = torch.tensor(1.0)
    fresh = build(clone_params(params))
    fresh.load_state_dict(saved)
    run_steps(fresh, fresh.param_groups[1]["params"], 1)


@pytest.mark.parametrize("coefficients", [[(1e308, 0, 0)], [(3.0, -3.0, 1e30)], [(3.0, 0.0, 0.0)]])
def test_coefficients_that_overflow_are_refused_before_the_math(coefficients):
    """Finite coefficients can still overflow at the first step (1e308 is inf in fp32, c = 1e30 squares
    past it by the second iteration); the check follows the singular values through the iterations
    (a = 3 takes them to 243, past the bound of 100), at construction and, for a loaded or edited
    group, before the step changes anything."""
    with pytest.raises(ValueError, match=r"ns_coefficients=.* take a normalized input's singular "
                                         r"values to \S+ within 5 steps, where they must stay near 1"):
        MuonAdamW([muon_group(make_params([(8, 8)]), ns_coefficients=coefficients)])
    params = make_params([(8, 8)])
    opt = MuonAdamW([muon_group(params)])
    saved = opt.state_dict()
    saved["param_groups"][0]["ns_coefficients"] = coefficients
    opt.load_state_dict(saved)
    before = params[0].detach().clone()
    with pytest.raises(ValueError, match="overflow fp32 in the update"):
        run_steps(opt, params, 1)
    assert torch.equal(params[0], before) and not opt.state


def test_lr_scheduler_drives_group_lr():
    a = make_params([(16, 24), (30,)])
    b = clone_params(a)
    opt_a = MuonAdamW([muon_group(a[:1]), adamw_group(a[1:])])
    sched = torch.optim.lr_scheduler.LambdaLR(opt_a, lambda step: 1.0 / (1 + step))
    opt_b = MuonAdamW([muon_group(b[:1]), adamw_group(b[1:])])
    base = [g["lr"] for g in opt_b.param_groups]
    for step in range(5):
        set_grads([a, b], step)
        for g, lr in zip(opt_b.param_groups, base):
            g["lr"] = lr / (1 + step)
        opt_a.step()
        sched.step()
        opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    assert opt_a.param_groups[0]["lr"] == pytest.approx(0.02 / 6)


# -- bad input -----------------------------------------------------------------------------------

P2 = torch.nn.Parameter(torch.randn(4, 4))
P1 = torch.nn.Parameter(torch.randn(4))

BAD_GROUPS = [
    ([dict(params=[P2], lr=0.1)], ValueError, "kind must be 'adamw', 'muon' or one of kinds.KINDS"),
    ([dict(kind="sgd", params=[P2], lr=0.1)], ValueError, "kind must be 'adamw', 'muon' or one of kinds.KINDS"),
    ([dict(kind="adamw", params=[P2], lr=0.1)], ValueError, "missing ['betas', 'eps', 'weight_decay']"),
    ([muon_group([P2], momentun=0.9)], ValueError, "unknown keys ['momentun']"),
    ([muon_group([P1])], ValueError, "param group 0 (kind='muon'), param 0: shape (4,) has 1 dim"),
    ([muon_group([P2], lr=float("nan"))], ValueError, "lr=nan must be a finite number"),
    ([muon_group([P2], lr=-1.0)], ValueError, "lr=-1.0 must be a finite number >= 0"),
    ([adamw_group([P2], betas=(0.9, 1.0))], ValueError, "betas[1]=1.0"),
    ([muon_group([P2], ns_steps=6)], ValueError, "ns_steps=6 but ns_coefficients=polar_express has 5"),
    ([muon_group([P2], ns_coefficients="newton")], ValueError, "ns_coefficients='newton' is unknown"),
    ([muon_group([P2], ns_precision="fp64")], ValueError, "ns_precision='fp64'"),
    ([muon_group([P2], orthogonalizer="svd")], ValueError,
     "orthogonalizer='svd' is not in stages.ORTHOGONALIZERS: use one of ['auto',"),
    ([muon_group([P2], lr_scale="sqrt")], ValueError, "lr_scale='sqrt' must be one of ['shape', 'moonlight'"),
    ([muon_group([P2], weight_decay_mode="l1")], ValueError, "weight_decay_mode='l1' must be one of"),
    ([muon_group([P2], extra_scale=-1.0)], ValueError, "extra_scale=-1.0 must be a finite number >= 0"),
    ([muon_group([P2], comm_precision="fp8")], ValueError, "comm_precision='fp8' must be one of ['bf16', 'fp32']"),
    ([muon_group([P2], qkv_split=(2, 2))], ValueError, "qkv_split=(2, 2) must be three positive row counts"),
    ([muon_group([P2], qkv_split=(1, 1, 1))], ValueError, "4 rows, but the split (1, 1, 1) x split_groups=1 covers 3"),
    ([muon_group([P2], qkv_split=(2, 1, 1), sharded_mode="blockwise")], ValueError, "qkv_split needs whole matrices"),
    ([muon_group([P2], split=(2, 2), qkv_split=(2, 1, 1))], ValueError, "give split or qkv_split, not both"),
    ([muon_group([P2], split=(4,))], ValueError, "split=(4,) must be two or more positive row counts"),
    ([muon_group([P2], split=(1, 1), split_groups=0)], ValueError, "split_groups=0 must be an int >= 1"),
    ([muon_group([P2], split=(1, 1), split_groups=3)], ValueError, "x split_groups=3 covers 6"),
    ([muon_group([P2], transposed=True, sharded_mode="distributed")], ValueError, "transposed needs whole matrices"),
    ([muon_group([P2], transposed="yes")], ValueError, "transposed='yes' must be True or False"),
    ([muon_group([P2], decay_lr="raw")], ValueError, "decay_lr='raw' must be one of ['adjusted', 'group']"),
    ([muon_group([P2], ns_coefficients=dict(coefficients=[(3, -4, 2)], safety=0))], ValueError,
     "dict(coefficients=<such a list>, safety=<finite number > 0>"),
    ([muon_group([P2], ns_coefficients=dict(coefficients=[(3, -4, 2)], safety=float("inf")))],
     ValueError, "safety=<finite number > 0>"),
    ([muon_group([P2], ns_coefficients=dict(coefficients=[(3, -4, 2)], eps=float("inf")))],
     ValueError, "eps=<finite number > 0>"),
    ([muon_group([P2], ns_coefficients=dict(triples=[(3, -4, 2)]))], ValueError, "ns_coefficients must be a name"),
    ([adamw_group([P2], momentum=1.5)], ValueError, "momentum=1.5 must be a finite number in [0.0, 1.0)"),
    ([muon_group([P2]), adamw_group([P2])], ValueError,
     "param group 1 (kind='adamw'), param 0 is already in param group 0"),
    ([muon_group([P2, P2])], ValueError, "param 1 is already in param 0"),
    ([adamw_group([torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))])], TypeError, "complex"),
    ([dict(kind="adamw")], ValueError, "missing 'params'"),
    ([], ValueError, "no param groups"),
    (P2, TypeError, "list of param group dicts"),
]


@pytest.mark.parametrize("groups,exc,message", BAD_GROUPS, ids=[m for _, _, m in BAD_GROUPS])
def test_bad_param_groups_raise_clear_errors(groups, exc, message):
    with pytest.raises(exc) as info:
        MuonAdamW(groups)
    assert message in str(info.value)


def test_bad_values_at_step_time_change_nothing():
    params = make_params([(8, 8), (8,)])
    opt = MuonAdamW([muon_group(params[:1]), adamw_group(params[1:], name="gains")])
    set_grads([params], 0)
    before = [p.detach().clone() for p in params]
    opt.param_groups[1]["lr"] = float("inf")  # e.g. a broken schedule
    with pytest.raises(ValueError, match=r"param group 1 'gains' \(kind='adamw'\): lr=inf"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before))  # checked before any math ran
    opt.param_groups[1]["lr"] = 1e-3
    params[0].grad = params[0].grad.to_sparse()
    with pytest.raises(ValueError, match="param group 0 \\(kind='muon'\\), param 0: sparse gradients"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before))


def test_mismatched_checkpoint_is_refused():
    opt = build(make_params([(16, 24), (16, 24), (24, 8), (50, 20), (7,)]))
    other = make_params([(16, 24), (16, 24), (24, 8), (60, 20), (7,)])
    opt_other = build(other)
    run_steps(opt_other, other, 1)
    with pytest.raises(ValueError, match="group 1 param 0 exp_avg has shape \\(60, 20\\), the param has \\(50, 20\\)"):
        opt.load_state_dict(opt_other.state_dict())
    with pytest.raises(ValueError, match="2 param groups but this optimizer has 1"):
        MuonAdamW([adamw_group(make_params([(3,)]))]).load_state_dict(opt_other.state_dict())


# An AdamW param's saved state (build: param 3, of shape (7,)), edited as a corrupt file might be
BAD_ADAMW_STATE = {
    "unknown state": (lambda st: st.update(mystery=torch.zeros(7)),
                      r"group 1 param 0 state 'mystery' is not state a adamw group keeps "
                      r"\(step, exp_avg, exp_avg_sq\)"),
    "no step": (lambda st: st.pop("step"), r"group 1 param 0 has state but no step; corrupt"),
    "no exp_avg": (lambda st: st.pop("exp_avg"), r"has state but no exp_avg; corrupt"),
    "a number": (lambda st: st.update(exp_avg=0.5), r"state 'exp_avg' is a float, not a tensor"),
    "integers": (lambda st: st.update(exp_avg_sq=st["exp_avg_sq"].long()),  # floats are cast
                 r"group 1 param 0 exp_avg_sq has shape \(7,\) torch.int64, the param has "
                 r"\(7,\) torch.float32"),
}


@pytest.mark.parametrize("name", list(BAD_ADAMW_STATE))
def test_adamw_state_is_checked_as_every_kind_s(name):
    """AdamW's saved state, as Muon's and the registered kinds', holds exactly its step and two
    moment tensors: anything else is refused in one line at load, not loaded to fail in the math
    (a KeyError, an integer lerp) or to ride along unread."""
    params = make_params([(16, 24), (16, 24), (24, 8), (7,)])
    opt = build(params)
    run_steps(opt, params, 1)
    saved = opt.state_dict()
    edit, says = BAD_ADAMW_STATE[name]
    edit(saved["state"][3])
    with pytest.raises(ValueError, match=says):
        build(clone_params(params)).load_state_dict(saved)


def test_distributed_optimizer_without_process_group():
    from nanomuon.optim import DistMuonAdamW

    with pytest.raises(ValueError, match="DistMuonAdamW needs an initialized torch.distributed process group"):
        DistMuonAdamW([muon_group(make_params([(8, 8)]))])


# -- compile -------------------------------------------------------------------------------------


def assert_equal_but_for_cautious_flips(p, q, decay, tol, flips=1e-3):
    """Compiled and eager may round an update element that is ~0 to opposite signs, and cautious weight
    decay then decays the weight in one and not the other: a handful of elements may differ by at most
    the decay they could have missed (`decay`, summed over the steps); every other element within tol."""
    diff = (q - p).abs()
    off = diff > tol + tol * p.abs()
    assert off.sum() <= max(1, flips * p.numel()), f"{int(off.sum())} of {p.numel()} elements differ"
    limit = decay * torch.maximum(p.abs(), q.abs()) + tol
    assert (diff[off] <= limit[off]).all(), f"a differing element is beyond its decay: {diff.max():.2e}"


def scheduled_muon_lr(step):
    """The muon group's lr at `step` under step_under_a_schedule."""
    return 0.02 * (1 - step / 10)


def step_under_a_schedule(opts, param_lists, set_grads, steps=6):
    """Step every optimizer (a muon group 0, an adamw group 1) on the same grads while a schedule changes
    lr and momentum at every step, as base_train's does."""
    for step in range(steps):
        set_grads(param_lists, step)
        for opt in opts:
            opt.param_groups[0]["lr"] = scheduled_muon_lr(step)
            opt.param_groups[0]["momentum"] = 0.85 + 0.01 * step
            opt.param_groups[1]["lr"] = 3e-3 * (1 - step / 10)
        for opt in opts:
            opt.step()


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_equals_eager_and_schedules_do_not_recompile():
    import torch._dynamo

    torch._dynamo.reset()
    shapes = [(32, 16), (32, 16), (16, 48), (40, 30), (9,)]
    eager, compiled = make_params(shapes), make_params(shapes)

    def groups(ps):  # fp32: Gram Newton-Schulz runs on both (non-square) Muon shapes, compiled and eager
        return [muon_group(ps[:3], ns_precision="fp32"), adamw_group(ps[3:])]

    opt_e, opt_c = MuonAdamW(groups(eager), compile=False), MuonAdamW(groups(compiled), compile=True)
    assert opt_c.compiled and not opt_e.compiled
    torch._dynamo.utils.counters.clear()
    step_under_a_schedule([opt_e, opt_c], [eager, compiled], set_grads)
    decay = sum(map(scheduled_muon_lr, range(6))) * 0.2  # lr x weight_decay, over the schedule
    for p, q in zip(eager[:3], compiled[:3]):  # the muon group, under cautious decay
        assert_equal_but_for_cautious_flips(p, q, decay, tol=1e-5)
    for p, q in zip(eager[3:], compiled[3:]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    # one graph per muon shape (2) and per adamw shape (2); lr changes never recompiled
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames <= 4, frames


# -- Muon ownership plan -------------------------------------------------------------------------


def gpt_muon_buckets(depth):
    """(count, Newton-Schulz cost) per Muon shape of a depth-`depth` GPT (width 64*depth, 4x MLP)."""
    from nanomuon.owners import ns_flops

    w = -(-depth * 64 // 128) * 128
    return [(4 * depth, ns_flops((w, w), 5)), (depth, ns_flops((4 * w, w), 5)), (depth, ns_flops((w, 4 * w), 5))]


@pytest.mark.parametrize("depth", [4, 12, 20, 26, 32])
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_owner_plan_is_balanced_and_pads_like_nanochat(depth, world_size):
    from nanomuon.owners import assign_owners

    bucket_list = gpt_muon_buckets(depth) + [(5, 7.0), (3, 11.0)]  # plus odd small buckets
    plan = assign_owners(bucket_list, world_size)
    loads = [0.0] * world_size
    for (count, cost), slots in zip(bucket_list, plan):
        assert sorted(i for s in slots for i in s) == list(range(count))  # each matrix owned exactly once
        assert max(len(s) for s in slots) == -(-count // world_size)  # padding no worse than ceil(K/N)
        for r, s in enumerate(slots):
            loads[r] += cost * len(s)
    mean = sum(loads) / world_size
    assert max(loads) - mean <= max(cost for _, cost in bucket_list) + 1e-6
    if depth in (12, 20) and world_size == 8:
        # The target (d20 on 8 ranks). Not promised everywhere: at d26 the 52 MLP matrices split 7/6 over
        # 8 ranks while all take 13 squares (1.046); evening that out would pad every square-matrix exchange
        # by 8 matrices, far more costly in communication than the Newton-Schulz imbalance it removes.
        assert max(loads) / mean <= 1.03
    assert plan == assign_owners(bucket_list, world_size)  # deterministic: every rank agrees


def test_cpu_chunked_kernels_equal_one_call(monkeypatch):
    """On CPU the kernels run over chunks of the stacks (allocator-friendly); the result must not change."""
    shapes = [(24, 16)] * 5 + [(16, 48)] * 3 + [(40, 30), (50,)]
    whole, chunked = make_params(shapes), make_params(shapes)

    def groups(ps):
        return [muon_group(ps[:8]), adamw_group(ps[8:])]

    opt_whole = MuonAdamW(groups(whole))
    opt_chunked = MuonAdamW(groups(chunked))
    monkeypatch.setattr(opt_chunked, "CPU_SLICE", 700)  # 1-2 matrices and 700-element slices per call
    import nanomuon.muon as muon  # the optimizer calls the update functions through their module

    calls = {"muon": 0, "adamw": 0}
    for name in calls:
        real = getattr(muon, f"{name}_update")
        monkeypatch.setattr(muon, f"{name}_update", lambda *a, real=real, name=name, **kw: (
            calls.__setitem__(name, calls[name] + 1), real(*a, **kw))[1])
    for step in range(4):
        set_grads([whole, chunked], step)
        opt_whole.step()
        opt_chunked.step()
    for p, q in zip(whole, chunked):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    # per step, whole: 2 muon + 2 adamw calls; chunked: 5 + 3 muon (one matrix each), 2 + 1 adamw slices
    assert calls == {"muon": 4 * (2 + 8), "adamw": 4 * (2 + 3)}, calls


@pytest.mark.parametrize("gram", [False, True], ids=["standard", "gram"])
def test_fp16_newton_schulz_keeps_tiny_and_huge_momenta(gram):
    """Momenta of any scale orthogonalize in fp16 as in fp32: the input is normalized in fp32 before the
    cast, so entries of 1e-9 do not flush to zero and norms past fp16's 65,504 do not overflow."""
    coeffs, safety, eps = ns_coefficients("polar_express", 5)
    G = torch.randn(3, 64, 128, generator=torch.Generator().manual_seed(0))
    for scale in (1e-9, 1e-7, 1e-3, 1.0, 1e3, 1e5):
        ref = orthogonalize(G * scale, NewtonSchulz(coeffs, safety, eps, torch.float32), gram)
        X = orthogonalize(G * scale, NewtonSchulz(coeffs, safety, eps, torch.float16), gram).float()
        assert torch.isfinite(X).all(), scale
        assert rel_err(X, ref) < 0.02, (scale, rel_err(X, ref))


def test_a_group_is_resolved_once_and_a_step_checks_what_schedules_edit(monkeypatch):
    """The whole check of a group runs at its first step and again only when a key other than
    what schedules edit changes; an lr a schedule sets is still checked at every step."""
    from nanomuon import optim

    calls = []
    real = optim.check_group_values
    monkeypatch.setattr(optim, "check_group_values", lambda i, g: calls.append(i) or real(i, g))
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = MuonAdamW([dict(kind="muon", params=[p], lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95,
                          weight_decay=0.1)])
    for step in range(3):
        opt.param_groups[0].update(lr=0.01 * (step + 1), momentum=0.9, weight_decay=0.05 * step)
        p.grad = torch.randn(8, 8)
        opt.step()
    assert calls == [0]
    opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match=r"lr=nan must be a finite number"):
        opt.step()
    opt.param_groups[0].update(lr=0.01, nesterov="yes")
    with pytest.raises(ValueError, match=r"nesterov='yes' must be True or False"):
        opt.step()
    assert calls == [0, 0]
