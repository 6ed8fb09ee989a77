"""
Newton-Muon (muon-newton; stages.newton), a stage that reads its matrices' inputs: its update
against a float64 re-derivation of the record's, fed the inputs as well as the gradients; data
parallel against one device (the ranks' inputs averaged); a checkpoint resumed at another world
size; the model's input covariances against x^T x / n of each layer's real inputs, compiled and
under batched seeds; base_train collecting them only on the steps the stage asks for, and a resumed
run going on bitwise; what is missing or cannot run refused in one line.
"""

import pytest
import torch
from test_dist import assert_replicated_tensors, spawn
from test_optim_edges import run_ours
from test_train import TINY

from nanomuon import checkpoint
from nanomuon.gpt import GPT, config_from_depth
from nanomuon.optim import DistMuonAdamW, MuonAdamW
from nanomuon.reference import muon_step
from nanomuon.seeds import SeedBatch, seed_model, seeded_gpt

# the variant's stages; a refresh every 2 steps
NEWTON = dict(lr=0.02, momentum=0.95, ns_steps=5, beta2=None, weight_decay=0.1,
              precondition="newton", post_process=(), apply="decoupled", input_interval=2)


def newton64(u, p, g, state, group):
    """The record's step in float64: on a refresh C <- C + 0.05 (X - C), from 0.001 I, and
    K = (C + (0.2 tr(C) / b + 1e-8) I)^-1 (by inv, not Cholesky), from I; the gradient times K,
    each block of b input columns by its own (the record's MLP projection: 4 blocks of its
    output width); then Muon's Nesterov momentum on that, kept here (u, the momentum of the raw
    gradient, is not used)."""
    rows, cols = g.shape
    b = rows if cols > rows and cols % rows == 0 else cols
    eye = torch.eye(b, dtype=torch.float64)
    C = state.setdefault("C", [0.001 * eye for _ in range(cols // b)])
    K = state.setdefault("K", [eye for _ in range(cols // b)])
    if group.get("inputs") is not None:
        for j, X in enumerate(group["inputs"].double()):
            C[j] = C[j] + 0.05 * (X - C[j])
            K[j] = torch.linalg.inv(C[j] + (0.2 * torch.trace(C[j]) / b + 1e-8) * eye)
    pre = torch.cat([g[:, j * b:(j + 1) * b] @ K[j] for j in range(cols // b)], dim=1)
    m = group["momentum"]
    state["m"] = m * state.get("m", torch.zeros_like(pre)) + (1 - m) * pre
    return (1 - m) * pre + m * state["m"]


def covariances(shape, gen) -> torch.Tensor:
    """An input covariance per matrix of `shape`, (..., blocks, b, b): x^T x / n of 48 random
    tokens with features of unequal scales (so the preconditioner is far from a multiple of I)."""
    rows, cols = shape[-2:]
    b = rows if cols > rows and cols % rows == 0 else cols
    x = torch.randn(*shape[:-2], 48, cols, generator=gen) * torch.linspace(0.2, 3.0, cols)
    x = x.unflatten(-1, (cols // b, b)).movedim(-2, -3)  # (..., blocks, tokens, b)
    return x.mT @ x / 48


@pytest.mark.parametrize("shape", [(24, 24), (32, 16), (8, 32), (2, 20, 12)], ids=str)
def test_newton_muon_matches_its_float64_definition(shape):
    """Eight steps with the inputs given on steps 2, 4, 6 and 8 equal the float64 definition, on a
    square, a tall, a 4x wide (four input blocks) and a batched matrix; the preconditioner moves
    the trajectory away from plain Muon's, and each refresh counts."""
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(shape, generator=gen) * 0.5
    grads = [torch.randn(shape, generator=gen) for _ in range(8)]
    inputs = [covariances(shape, gen) if step % 2 == 1 else None for step in range(8)]
    ours = run_ours(start, grads, [dict(NEWTON, inputs=x) for x in inputs])
    flat = start.reshape(-1, *shape[-2:])

    def reference(feed, stage):
        out = []
        for k in range(flat.size(0)):
            p, state = flat[k].double(), {}
            for step, g in enumerate(grads):
                x = feed[step]
                cfg = dict(NEWTON, inputs=None if x is None else x.reshape(-1, *x.shape[-3:])[k])
                p = muon_step(p, g.reshape(-1, *shape[-2:])[k], state, cfg, stages=stage)
            out.append(p)
        return torch.stack(out).reshape(shape)

    want = reference(inputs, {"newton": newton64})
    torch.testing.assert_close(ours.double(), want, rtol=0, atol=2e-5)
    plain = reference([None] * 8, {"newton": lambda u, *_: u})
    fewer = reference([x if step < 4 else None for step, x in enumerate(inputs)],
                      {"newton": newton64})
    assert (want - plain).abs().max() > 1e-3 and (want - fewer).abs().max() > 1e-3


SHAPES = [(24, 24), (24, 24), (16, 64), (64, 16), (16, 16)]


def _model():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.5) for s in SHAPES]


def _step_data(step, rank, world):
    """This step's grads and (on refresh steps) inputs at rank r: G + (r - (N-1)/2) E, whose mean
    over the ranks is G at any world size, for both."""
    gen = torch.Generator().manual_seed(100 + step)
    grads, inputs = [], []
    for s in SHAPES:
        G, E = torch.randn(s, generator=gen), torch.randn(s, generator=gen)
        X, Y = covariances(s, gen), covariances(s, gen)
        grads.append(G + (rank - (world - 1) / 2) * E)
        inputs.append(X + (rank - (world - 1) / 2) * (Y - X) / world)
    return grads, inputs if step % 2 == 1 else None


def _mean_data(step, world):
    data = [_step_data(step, r, world) for r in range(world)]
    grads = [sum(gs) / world for gs in zip(*(d[0] for d in data))]
    inputs = None if data[0][1] is None else [sum(xs) / world for xs in zip(*(d[1] for d in data))]
    return grads, inputs


def _feed(opt, params, grads, inputs):
    if inputs is not None:
        assert opt.wants_inputs()
        opt.give_inputs(dict(zip(params, inputs)))
    else:
        assert not opt.wants_inputs()
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()


def _groups(params):
    return [dict(kind="muon", params=params, ns_precision="fp32", **NEWTON)]


def _dist_worker(rank, world):
    model, ref = _model(), _model()
    opt, ref_opt = DistMuonAdamW(_groups(model)), MuonAdamW(_groups(ref))
    for step in range(6):
        _feed(opt, model, *_step_data(step, rank, world))
        _feed(ref_opt, ref, *_mean_data(step, world))
        assert_replicated_tensors(model)
        for p, q in zip(model, ref):
            torch.testing.assert_close(p, q, rtol=0, atol=2e-5)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_data_parallel_equals_one_device_given_the_mean_inputs(world):
    """Each rank gives its own inputs; the owners read their mean over the ranks, so the run equals
    one device given the mean, and the ranks stay bitwise identical."""
    spawn(_dist_worker, world)


def _resume_worker(rank, world, path, mode):
    """'save': 3 steps, then a sharded checkpoint; 'load': read it at this world size, 3 more."""
    model = _model()
    module = torch.nn.ParameterList(model)
    opt = DistMuonAdamW(_groups(model))
    if mode == "load":
        checkpoint.load_into(path, 3, module, opt)
    for step in range(3) if mode == "save" else range(3, 6):
        _feed(opt, model, *_step_data(step, rank, world))
    if mode == "save":
        tensors, files = checkpoint.state_of(module, opt)
        checkpoint.save_checkpoint(path, 3, tensors, dict(step=3), files)
    elif rank == 0:
        torch.save([p.detach() for p in model], path / "newton.pt")


@pytest.mark.heavy
def test_a_checkpoint_resumes_at_another_world_size(tmp_path):
    """Saved at 2 ranks after a refresh, resumed at 3: the covariances, inverses and momenta come
    back resharded, and the run equals an unbroken one on one device."""
    spawn(_resume_worker, 2, tmp_path, "save")
    spawn(_resume_worker, 3, tmp_path, "load")
    ref = _model()
    opt = MuonAdamW(_groups(ref))
    for step in range(6):
        _feed(opt, ref, *_mean_data(step, 2 if step < 3 else 3))
    for p, q in zip(torch.load(tmp_path / "newton.pt"), ref):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-5)


def test_what_it_cannot_take_is_refused_in_one_line():
    """A due step with no inputs given, inputs for only some of the matrices or of the wrong
    shape, and a split layout are refused, each in one line that says what to do. Inputs given
    to a step that then fails are gone: the next try must give them again."""
    params = _model()
    opt = MuonAdamW(_groups(params))
    grads, inputs = _step_data(1, 0, 1)
    _feed(opt, params, *_step_data(0, 0, 1))
    for p, g in zip(params, grads):
        p.grad = g
    with pytest.raises(ValueError, match=r"reads its matrices' inputs this step .* give_inputs"):
        opt.step()
    with pytest.raises(ValueError, match=r"give_inputs: 1 of the 5 matrices .* have none"):
        opt.give_inputs(dict(zip(params[:4], inputs)))
    wrong = dict(zip(params, inputs))
    wrong[params[2]] = inputs[2][:2]
    with pytest.raises(ValueError, match=r"a \(16, 64\) matrix's inputs are \(2, 16, 16\), not "
                                         r"\(4, 16, 16\)"):
        opt.give_inputs(wrong)
    opt.give_inputs(dict(zip(params, inputs)))
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    opt.param_groups[0]["lr"] = NEWTON["lr"]
    with pytest.raises(ValueError, match=r"reads its matrices' inputs this step"):
        opt.step()
    with pytest.raises(ValueError, match=r"newton.*preconditions whole matrices"):
        MuonAdamW([dict(_groups(params)[0], split=(12, 12), params=params[:2])])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 3e38])
def test_non_finite_or_overflowing_inputs_are_refused_and_skip_base_trains_step(bad):
    """A covariance holding NaN or inf, or finite entries whose trace overflows fp32, is refused
    by give_inputs in one line before it reaches the stage's state (which would otherwise go
    non-finite and make every later checkpoint unloadable), and base_train's finiteness check
    counts it as it counts a non-finite loss: the step is skipped on every rank alike."""
    from scripts.base_train import all_finite

    params = _model()
    opt = MuonAdamW(_groups(params))
    _feed(opt, params, *_step_data(0, 0, 1))
    grads, inputs = _step_data(1, 0, 1)
    inputs = [t.clone() for t in inputs]
    inputs[3].diagonal(dim1=-2, dim2=-1).fill_(bad)
    with pytest.raises(ValueError, match=r"give_inputs: 1 of the 5 input covariances hold NaN, "
                                         r"inf or values whose trace overflows"):
        opt.give_inputs(dict(zip(params, inputs)))
    loss = torch.tensor(2.0)
    for p, g in zip(params, grads):
        p.grad = g
    assert all_finite(loss, params, dict(enumerate(_step_data(1, 0, 1)[1])))
    assert not all_finite(loss, params, dict(enumerate(inputs)))


def layer_inputs(model, x) -> dict:
    """param name -> x^T x / n in float64 of the inputs each block linear really got (hooks on an
    eager forward), cut in blocks of the output width where the input is a whole multiple wider."""
    seen, hooks = {}, []
    for name, mod in model.named_modules():
        if name.startswith("blocks.") and isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_hook(
                lambda m, args, out, name=name: seen.__setitem__(name, args[0].detach())))
    model(x, x)
    for h in hooks:
        h.remove()
    out = {}
    for name, a in seen.items():
        rows, cols = model.get_submodule(name).weight.shape
        b = rows if cols > rows and cols % rows == 0 else cols
        a = a.double().reshape(-1, cols // b, b).transpose(0, 1)
        out[f"{name}.weight"] = a.mT @ a / a.size(1)
    return out


@pytest.mark.parametrize("arch", ["classic", "nanochat"])
def test_the_model_gives_each_matrix_its_input_covariance(arch):
    """GPT.forward(input_stats=True) holds, for every block matrix and nothing else, x^T x / n of
    the inputs it got, eager and compiled alike (its loss unchanged); batched seeds give each
    seed's, seed first."""
    config = config_from_depth(2, 97, 64, aspect_ratio=32, head_dim=16, arch=arch)
    torch.manual_seed(0)
    model, x = GPT(config), torch.randint(0, 97, (2, 64))
    model.init_weights()
    want = layer_inputs(model, x)
    matrices = {n for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2}
    assert set(want) == matrices
    torch._dynamo.reset()
    for forward in (model, torch.compile(model, fullgraph=True, dynamic=False)):
        loss, stats = forward(x, x, input_stats=True)
        torch.testing.assert_close(loss, model(x, x), rtol=1e-5, atol=0)
        assert set(stats) == matrices
        for name, cov in stats.items():
            torch.testing.assert_close(cov.double(), want[name], rtol=1e-5, atol=1e-6, msg=name)
    seeded = seeded_gpt(config, [1, 2], "cpu")
    _, stats = SeedBatch(seeded)(x, x, input_stats=True)
    for i in range(2):
        alone = layer_inputs(seed_model(seeded, i), x)
        for name, cov in stats.items():
            torch.testing.assert_close(cov[i].double(), alone[name], rtol=1e-5, atol=1e-6)


FLAGS = [*TINY, "--total-batch-size", "512", "--num-iterations", "8", "--eval-every", "-1",
         "--optimizer", "muon-newton", "--dtype", "fp32", "--no-compile", "--save-every", "4",
         "--keep-checkpoints", "-1", "--run", "newton"]


@pytest.mark.heavy
def test_base_train_collects_the_inputs_only_when_the_stage_asks(base, monkeypatch):
    """With the interval at 3 steps, the forwards that collect inputs are exactly the 2
    micro-batches of steps 3 and 6 (the stage's refreshes), and give_inputs gets every block
    matrix then. A run resumed at step 4 saves at 8 bitwise what the unbroken run saved: the
    covariances, inverses and momenta come back. muon-newton's own interval is a share of the run:
    0.02 of 8 steps rounds to 1 step, a refresh every step."""
    from test_train import assert_bitwise_equal

    import scripts.base_train as bt
    from nanomuon.checkpoint import load_checkpoint
    from nanomuon.variants import OPTIMIZER_VARIANTS

    variant = OPTIMIZER_VARIANTS["muon-newton"]
    variant = variant._replace(muon_options=dict(variant.muon_options, input_interval=3))
    monkeypatch.setitem(OPTIMIZER_VARIANTS, "muon-newton", variant)
    asked, given = [], []
    real_forward, real_give = GPT.forward, MuonAdamW.give_inputs
    monkeypatch.setattr(GPT, "forward", lambda self, *a, **k: (
        asked.append(k.get("input_stats", False)) or real_forward(self, *a, **k)))
    monkeypatch.setattr(MuonAdamW, "give_inputs", lambda self, inputs: (
        given.append(len(inputs)) or real_give(self, inputs)))
    bt.main(FLAGS)
    assert given == [12, 12], given  # 2 layers of c_q, c_k, c_v, c_proj, c_fc, c_proj
    collecting = [i for i, a in enumerate(asked) if a]
    assert len(collecting) == 4 and sum(asked) == 4, asked
    run_dir, names = base / "runs" / "newton", ("model", "optim")
    whole, _ = load_checkpoint(run_dir, 8, names)
    assert any("newton_inv" in s for s in whole["optim"]["state"].values())
    (run_dir / "step_000008").rename(base / "newton-spare")
    bt.main([*FLAGS, "--resume-from-step", "4"])
    assert_bitwise_equal(whole, load_checkpoint(run_dir, 8, names)[0], "step 8")
