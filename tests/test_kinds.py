"""
The kinds of update beyond Muon and AdamW (nanomuon/kinds.py): Lion and Adam-mini against float64
re-derivations of their papers' steps, compiled against eager, DistMuonAdamW at 2 and 3 ranks against one
device (rows sharded, small and per-tensor params whole, ranks bitwise equal), on DTensor params (Shard(0),
Shard(1), FSDP2's GPT) against one device, checkpoints in both formats resumed bitwise and at another world
size, a kind registered from outside the library, and a GPT role turned to a kind keeping its own lr.
"""

import pytest
import torch
from test_ablate_ideas import registries  # noqa: F401  (the fixture: the registries restored after)
from test_dist import integer_grads, integer_mean_grads

from nanomuon import checkpoint, kinds
from nanomuon.arch import Variant
from nanomuon.optim import MuonAdamW

# past MuonAdamW.SMALL (1024 elements): sharded by rows at 2 and 3 ranks, 37 and 1500 divide by neither;
# (1500,) under Adam-mini keeps one second moment, so it is updated whole on every rank
SHAPES = [(37, 41), (48, 40), (3, 20, 24), (1500,), (5, 4), (7,), ()]
HYPER = dict(lion=dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1),
             adam_mini=dict(lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1))


def _model(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.5) for s in SHAPES]


def _groups(params, kind):
    return [dict(kind=kind, params=params, **HYPER[kind])]


def _grads(step, rank=0, world=1):
    return integer_grads(SHAPES, step, rank, world)


def _random_grads(step):
    gen = torch.Generator().manual_seed(7 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


# -- float64 re-derivations, from the papers' algorithms -------------------------------------------------------


def lion_reference(w, grads, lrs, beta1, beta2, wd):
    """Lion, Chen et al. 2023 (arXiv 2302.06675), Algorithm 2, in float64: per step
    c = beta1 m + (1 - beta1) g;  w = w - lr (sign(c) + wd w);  m = beta2 m + (1 - beta2) g."""
    w, m = w.double(), torch.zeros_like(w, dtype=torch.float64)
    for g, lr in zip(grads, lrs):
        g = g.double()
        c = beta1 * m + (1 - beta1) * g
        w = w - lr * (torch.sign(c) + wd * w)
        m = beta2 * m + (1 - beta2) * g
    return w


def adam_mini_reference(w, grads, lrs, beta1, beta2, eps, wd):
    """Adam-mini, Zhang et al. 2024 (arXiv 2406.16793), Algorithm 1 with one block per row of a matrix
    (per token of an embedding or head; leading dims a batch of matrices) and one block for a smaller
    tensor, in float64, row by row:
    m = b1 m + (1 - b1) g;  v_b = b2 v_b + (1 - b2) mean(g_b^2);
    w = w - lr wd w - lr (m / (1 - b1^t)) / (sqrt(v_b / (1 - b2^t)) + eps)."""
    w = w.double()
    m = torch.zeros_like(w)
    blocks = list(torch.cartesian_prod(*map(torch.arange, w.shape[:-1])).reshape(-1, w.dim() - 1).tolist()
                  if w.dim() >= 2 else [[...]])
    v = {b: 0.0 for b in range(len(blocks))}
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        g = g.double()
        m = beta1 * m + (1 - beta1) * g
        new = w.clone()
        for b, index in enumerate(blocks):
            index = tuple(index)
            v[b] = beta2 * v[b] + (1 - beta2) * float((g[index] ** 2).mean())
            step = (m[index] / (1 - beta1 ** t)) / ((v[b] / (1 - beta2 ** t)) ** 0.5 + eps)
            new[index] = w[index] - lr * wd * w[index] - lr * step
        w = new
    return w


REFERENCES = dict(lion=lion_reference, adam_mini=adam_mini_reference)


@pytest.mark.parametrize("kind", ["lion", "adam_mini"])
def test_a_kind_equals_its_papers_step_in_float64(kind):
    """Five steps, the lr changed by a schedule after the second, on every shape (a scalar, vectors, matrices, a
    3-D batch): each param as the float64 re-derivation moves it."""
    params = _model()
    start = [p.detach().clone() for p in params]
    opt = MuonAdamW(_groups(params, kind))
    grads = [_random_grads(step) for step in range(5)]
    lrs = [0.01, 0.01, 0.004, 0.004, 0.002]
    for step in range(5):
        opt.param_groups[0]["lr"] = lrs[step]
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()
        opt.step()
    hyper = {k: v for k, v in HYPER[kind].items() if k != "lr"}
    for i, (p, w0) in enumerate(zip(params, start)):
        want = REFERENCES[kind](w0, [g[i] for g in grads], lrs, *hyper["betas"],
                                *([hyper["eps"]] if kind == "adam_mini" else []), hyper["weight_decay"])
        torch.testing.assert_close(p.detach().double(), want, rtol=0, atol=2e-6,
                                   msg=lambda m, i=i: f"{SHAPES[i]}: {m}")
        assert (p.detach() - w0).abs().max() > 1e-3  # it moved
    assert {tuple(v.shape) for v in [opt.state[params[0]]["exp_avg"]]} == {SHAPES[0]}
    if kind == "adam_mini":  # one second moment per row, one per tensor below 2 dims
        assert [tuple(opt.state[p]["exp_avg_sq"].shape) for p in params] == [
            (37, 1), (48, 1), (3, 20, 1), (), (5, 1), (), ()]


def test_the_reference_tells_the_kinds_apart():
    """The float64 references are not each other's (nor plain sign descent): the test above would see a wrong
    kind."""
    w, grads = torch.randn(4, 6), [torch.randn(4, 6) for _ in range(3)]
    lion = lion_reference(w, grads, [0.01] * 3, 0.9, 0.99, 0.1)
    mini = adam_mini_reference(w, grads, [0.01] * 3, 0.9, 0.99, 1e-8, 0.1)
    per_element = adam_mini_reference(w.reshape(-1, 1), [g.reshape(-1, 1) for g in grads], [0.01] * 3, 0.9,
                                      0.99, 1e-8, 0.1).reshape(4, 6)  # Adam: a block per element
    assert (lion - mini).abs().max() > 1e-3 and (mini - per_element).abs().max() > 1e-4


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["lion", "adam_mini"])
def test_compiled_equals_eager(kind):
    """torch.compile'd update (the numbers as 0-D tensors) against eager, over a change of lr."""
    eager, compiled = _model(), _model()
    opts = [MuonAdamW(_groups(eager, kind), compile=False), MuonAdamW(_groups(compiled, kind), compile=True)]
    for step in range(4):
        for params, opt in zip((eager, compiled), opts):
            opt.param_groups[0]["lr"] = 0.01 / (1 + step)
            for p, g in zip(params, _random_grads(step)):
                p.grad = g
            opt.step()
    for p, q in zip(compiled, eager):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["lion", "adam_mini"])
def test_a_resumed_run_is_bitwise_the_uninterrupted_one(kind):
    """state_dict() after 3 steps, loaded into a new optimizer on copies of the params: 3 more steps each
    leave the params and the state bitwise equal."""
    params = _model()
    opt = MuonAdamW(_groups(params, kind))
    for step in range(3):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        opt.step()
    saved = {k: v for k, v in opt.state_dict().items()}
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = MuonAdamW(_groups(copies, kind))
    resumed.load_state_dict(torch.load(_bytes(saved), weights_only=True))
    for step in range(3, 6):
        for ps, o in ((params, opt), (copies, resumed)):
            for p, g in zip(ps, _grads(step)):
                p.grad = g
            o.step()
    for p, q in zip(params, copies):
        assert torch.equal(p, q)
        for name in kinds.KINDS[kind].state:
            assert torch.equal(opt.state[p][name], resumed.state[q][name])


def _bytes(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_a_checkpoint_of_another_kind_or_shape_is_refused_in_one_line():
    params = _model()
    opt = MuonAdamW(_groups(params, "adam_mini"))
    for p, g in zip(params, _grads(0)):
        p.grad = g
    opt.step()
    sd = opt.state_dict()
    lion = MuonAdamW(_groups(_model(), "lion"))
    with pytest.raises(ValueError, match="1 lion params|adam_mini params"):
        lion.load_state_dict(sd)
    sd["state"][0]["exp_avg_sq"] = torch.zeros(37, 41)  # AdamW's full second moment
    with pytest.raises(ValueError, match=r"'exp_avg_sq' is \(37, 41\), a adam_mini group keeps \(37, 1\)"):
        MuonAdamW(_groups(_model(), "adam_mini")).load_state_dict(sd)
    sd["state"][0]["exp_avg_sq"] = -torch.ones(37, 1)
    with pytest.raises(ValueError, match="negative values"):
        MuonAdamW(_groups(_model(), "adam_mini")).load_state_dict(sd)


def test_bad_groups_are_refused_when_added(monkeypatch):
    p = torch.nn.Parameter(torch.randn(4, 4))
    monkeypatch.setitem(kinds.KINDS, "odd", kinds.KINDS["lion"]._replace(state=dict(v=kinds.KindState("column"))))
    with pytest.raises(ValueError, match=r"declares state 'v' per 'column'; give KindState\(per=\) one of"):
        MuonAdamW([dict(kind="odd", params=[p], **HYPER["lion"])])
    with pytest.raises(ValueError, match=r"missing \['weight_decay'\]; a lion group needs"):
        MuonAdamW([dict(kind="lion", params=[p], lr=0.01, betas=(0.9, 0.99))])
    with pytest.raises(ValueError, match=r"unknown keys \['eps'\]; a lion group takes"):
        MuonAdamW([dict(kind="lion", params=[p], eps=1e-8, **HYPER["lion"])])
    with pytest.raises(ValueError, match=r"betas=\(0.9, 1.5\) must be a pair of numbers in \[0, 1\)"):
        MuonAdamW([dict(kind="lion", params=[p], **dict(HYPER["lion"], betas=(0.9, 1.5)))])
    with pytest.raises(ValueError, match="one of kinds.KINDS"):
        MuonAdamW([dict(kind="lino", params=[p], **HYPER["lion"])])
    opt = MuonAdamW([dict(kind="lion", params=[p], **HYPER["lion"])])
    opt.param_groups[0]["lr"] = float("nan")  # a schedule's
    p.grad = torch.ones(4, 4)
    with pytest.raises(ValueError, match="lr=nan must be a finite number >= 0"):
        opt.step()


def test_a_kind_registered_from_outside_the_library_trains(monkeypatch):
    """One entry makes a kind: plain SGD with momentum, as an ideas file would add it, equals
    torch.optim.SGD, data parallel machinery and state included."""
    from collections import namedtuple

    from nanomuon.stages import Option, a_number

    Numbers = namedtuple("Numbers", "lr momentum")

    def sgd(p, grad, state, h):
        buf = state["momentum_buffer"]
        buf.mul_(h.momentum).add_(grad)
        p.sub_(buf * h.lr)

    entry = kinds.Kind(sgd, dict(momentum_buffer=kinds.KindState()),
                       dict(lr=Option(None, a_number, "lr", required=True),
                            sgd_momentum=Option(0.9, a_number, "momentum")),
                       lambda group, step: Numbers(group["lr"], group["sgd_momentum"]))
    monkeypatch.setitem(kinds.KINDS, "sgd", entry)
    ours, theirs = _model(), _model()
    opt = MuonAdamW([dict(kind="sgd", params=ours, lr=0.01)])
    assert opt.param_groups[0]["sgd_momentum"] == 0.9  # filled at its default
    with pytest.raises(ValueError, match=r"missing \['lr'\]; a sgd group needs \['lr'\]"):  # its row's fact
        MuonAdamW([dict(kind="sgd", params=_model())])
    ref = torch.optim.SGD(theirs, lr=0.01, momentum=0.9)
    for step in range(3):
        for ps, o in ((ours, opt), (theirs, ref)):
            for p, g in zip(ps, _random_grads(step)):
                p.grad = g
            o.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    again = MuonAdamW([dict(kind="sgd", params=_model(), lr=0.01)])
    again.load_state_dict(opt.state_dict())  # its declared state, and the group's keys, load back
    assert all(torch.equal(again.state[p]["momentum_buffer"], opt.state[q]["momentum_buffer"])
               for p, q in zip(again.param_groups[0]["params"], ours))


# -- a GPT's roles: a role turned to a kind keeps its own lr -----------------------------------------------------


def _gpt(arch):
    from nanomuon.gpt import GPT, config_from_depth

    torch.manual_seed(0)
    model = GPT(config_from_depth(2, 97, 16, aspect_ratio=32, head_dim=16, arch=arch))
    model.init_weights()
    return model


ROLES = {"classic": ("embedding", "lm_head"),
         "nanochat": ("embedding", "lm_head", "value_embeds", "resid_lambdas", "x0_lambdas", "smear")}


@pytest.mark.parametrize("arch", ["classic", "nanochat"])
@pytest.mark.parametrize("kind", ["lion", "adam_mini"])
def test_a_role_turned_to_a_kind_keeps_its_own_lr(arch, kind):
    """The embedding, the head and (nanochat) the value embeddings and every scalar on the kind: each group's
    lr and decay are its AdamW group's times the role's factors, never the matrices'; Adam-mini keeps AdamW's
    betas and eps, Lion takes its paper's betas. A step moves every one of them."""
    model = _gpt(arch)
    before = {g["name"]: g for g in model.setup_optimizer().param_groups}
    roles = {r: dict(kind=kind, lr_factor=0.5, weight_decay_factor=2.0) for r in ROLES[arch]}
    opt = model.setup_optimizer(Variant(roles=roles))
    after = {g["name"]: g for g in opt.param_groups}
    for role in ROLES[arch]:
        g, was = after[role], before[role]
        assert g["kind"] == kind and g["params"] == was["params"]
        assert g["lr"] == pytest.approx(0.5 * was["lr"]) and g["initial_lr"] == g["lr"]
        assert g["weight_decay"] == pytest.approx(2.0 * was["weight_decay"])
        assert g["betas"] == (was["betas"] if kind == "adam_mini" else (0.9, 0.99))
    assert after["matrices"]["lr"] == before["matrices"]["lr"]
    x = torch.randint(0, 97, (2, 16))
    start = {name: [p.detach().clone() for p in after[name]["params"]] for name in ROLES[arch]}
    model(x, x).backward()
    opt.step()
    for name in ROLES[arch]:
        assert any(not torch.equal(a, p) for a, p in zip(start[name], after[name]["params"])), name


def test_the_variants_put_the_embedding_head_and_scalars_on_the_kinds():
    from nanomuon.variants import OPTIMIZER_VARIANTS

    for variant, kind, arch in (("muon-lion", "lion", "classic"), ("muon-adam-mini", "adam_mini", "classic"),
                                ("muon-lion-nanochat", "lion", "nanochat"),
                                ("muon-adam-mini-nanochat", "adam_mini", "nanochat")):
        opt = _gpt(arch).setup_optimizer(OPTIMIZER_VARIANTS[variant])
        assert {g["name"] for g in opt.param_groups if g["kind"] == kind} == set(ROLES[arch]), variant
    with pytest.raises(ValueError, match="this model's roles are"):  # scalars the classic GPT lacks
        _gpt("classic").setup_optimizer(OPTIMIZER_VARIANTS["muon-lion-nanochat"])
    assert set(OPTIMIZER_VARIANTS["muon-lion-nanochat"].roles) == set(ROLES["nanochat"])


# -- distributed: DistMuonAdamW at 2 and 3 ranks, sharded checkpoints ------------------------------------------


def _mean_grads(step, world):
    return integer_mean_grads(SHAPES, step, world)


def _dist_worker(rank, world, kind):
    from test_dist import steps_beside_one_device

    model, ref, opt, ref_opt = steps_beside_one_device(rank, world, _model, _groups, kind, _grads,
                                                       _mean_grads, 4, 1e-6)
    # the large params' state is this rank's rows only; state_dict() gathers it whole, as one device's
    rows = opt.state[model[0]]["exp_avg"].numel()
    assert rows < 37 * 41, rows
    whole = opt.state_dict()["state"]
    for i, p in enumerate(ref):
        for name in kinds.KINDS[kind].state:
            torch.testing.assert_close(whole[i][name], ref_opt.state[p][name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["lion", "adam_mini"])
def test_dist_equals_single_device(kind, world):
    from test_dist import spawn

    spawn(_dist_worker, world, kind)


@pytest.mark.parametrize("kind", ["lion", "adam_mini"])
def test_a_sharded_checkpoint_resumes_at_another_world_size(tmp_path, kind):
    """Saved at 2 ranks (each its rows of the large params' state), resumed at 3: the run equals an
    uninterrupted one on one device."""
    from test_dist import resumes_at_another_world_size

    resumes_at_another_world_size(tmp_path, _model, _groups, kind, _grads, _mean_grads, 1e-6)


IDEAS = '''
"""A kind of my own: signSGD with decoupled decay, on the embedding and the head."""
from collections import namedtuple

import torch

from nanomuon.arch import Variant
from nanomuon.kinds import KINDS, Kind
from nanomuon.stages import Option, a_number
from nanomuon.variants import OPTIMIZER_VARIANTS

Numbers = namedtuple("Numbers", "lr wd")


def sign_sgd(p, grad, state, h):
    p.mul_(1 - h.lr * h.wd)
    p.sub_(torch.sign(grad) * h.lr)


KINDS["sign_sgd"] = Kind(sign_sgd, {}, dict(lr=Option(None, a_number, "lr", required=True),
                                              weight_decay=Option(0.0, a_number, "decay", required=True)),
                         lambda group, step: Numbers(group["lr"], group["weight_decay"]))
OPTIMIZER_VARIANTS["muon-sign-sgd"] = Variant(roles={"embedding": dict(kind="sign_sgd", lr_factor=0.1)})
'''


@pytest.mark.usefixtures("registries")
def test_an_ideas_file_adds_a_kind_that_a_variant_names(tmp_path):
    """An --ideas file registers a kind and a variant that puts the embedding on it, with no library edit: the
    embedding then steps by its own lr x 0.1 along sign(grad), and the file owns that variant."""
    from nanomuon import ideas
    from nanomuon.variants import OPTIMIZER_VARIANTS

    path = tmp_path / "my_ideas.py"
    path.write_text(IDEAS)
    assert ideas.load(str(path)).variants == {"muon-sign-sgd"}
    model = _gpt("classic")
    adamw_lr = next(g["lr"] for g in model.setup_optimizer().param_groups if g["name"] == "embedding")
    opt = model.setup_optimizer(OPTIMIZER_VARIANTS["muon-sign-sgd"])
    embedding = next(g for g in opt.param_groups if g["name"] == "embedding")
    assert embedding["kind"] == "sign_sgd" and embedding["lr"] == pytest.approx(0.1 * adamw_lr)
    w = model.wte.weight.detach().clone()
    x = torch.randint(0, 97, (2, 16))
    model(x, x).backward()
    g = model.wte.weight.grad.clone()
    opt.step()
    torch.testing.assert_close(model.wte.weight.detach(), w - embedding["lr"] * torch.sign(g))


def test_a_kind_that_lists_its_required_keys_apart_is_refused_in_one_line(monkeypatch):
    """The keys a group must give are facts of their Option rows: an entry written with a separate
    tuple of them is refused, by name where it is made, by position where a group first names it."""
    from nanomuon.stages import Option, a_number

    lion = kinds.KINDS["lion"]
    options = dict(lr=Option(None, a_number, "lr", required=True))
    with pytest.raises(TypeError, match="required"):
        kinds.Kind(lion.update, {}, options, required=("lr",), numbers=lion.numbers)
    monkeypatch.setitem(kinds.KINDS, "old", kinds.Kind(lion.update, {}, options, ("lr",),
                                                       lion.numbers))
    with pytest.raises(ValueError, match=r"kind 'old' has numbers=\('lr',\), not a function: "
                                         r"write Kind\(update, state, options, numbers, keeps\)"):
        MuonAdamW([dict(kind="old", params=[torch.nn.Parameter(torch.ones(2))], lr=0.1)])
    assert lion.required == ("lr", "betas", "weight_decay")
    assert kinds.Kind(lion.update, {}, options, lion.numbers).required == ("lr",)


def _dtensor_worker(rank, world, kind, path, mode, two_dims=False):
    """A kind on DTensor params (FSDP2's Shard(0), tensor parallel's Shard(1), a 3-D param cut across its rows,
    a vector cut in pieces, a replicated one; two_dims: FSDP2 x TP on a 2-D mesh) steps as one device steps
    the whole: Lion on the local shards, Adam-mini's second moment (a row's mean g^2, or the tensor's) summed
    across the ranks that hold pieces of it. Its state_dict() is whole and loads back at this world size;
    mode 'save' then writes a sharded checkpoint, which mode 'load' (at another world size) reads into fresh
    params and steps on from."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, world // 2) if two_dims else (world,))
    placements = [[Shard(0)], [Shard(1)], [Shard(2)], [Shard(0)], [Replicate()], [Shard(0)]]
    if two_dims:  # each param cut along both mesh dims, or along one and replicated along the other
        placements = [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(2)], [Shard(0), Shard(0)],
                      [Replicate(), Shard(1)], [Shard(0), Replicate()]]
    placed = lambda ts: [torch.nn.Parameter(distribute_tensor(t.detach().clone(), mesh, pl))
                         for t, pl in zip(ts, placements)]
    ref = _model()[:6]
    params, ref_opt = placed(ref), MuonAdamW(_groups(ref, kind))
    opt = MuonAdamW(_groups(params, kind))

    def step(params, opt, step):
        for p, q, g, pl in zip(params, ref, _grads(step)[:6], placements):
            p.grad, q.grad = distribute_tensor(g, mesh, pl), g
        opt.step()
        ref_opt.step()
        for i, (p, q) in enumerate(zip(params, ref)):
            torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=0, atol=1e-6,
                                       msg=lambda m, i=i: f"{SHAPES[i]} at step {step}: {m}")

    for s in range(5):
        if s == 3:  # resume from the whole state, at this world size
            params, whole = placed([p.full_tensor() for p in params]), opt.state_dict()
            opt = MuonAdamW(_groups(params, kind))
            opt.load_state_dict(whole)
        step(params, opt, s)
    whole = opt.state_dict()["state"]
    for i, q in enumerate(ref):
        for name in kinds.KINDS[kind].state:
            torch.testing.assert_close(whole[i][name], ref_opt.state[q][name], rtol=0, atol=1e-6)
    if kind == "adam_mini" and two_dims:  # cut as p on each mesh dim where p's rows are cut
        assert [opt.state[p]["exp_avg_sq"].placements for p in params[:3]] == [
            (Shard(0), Replicate()), (Replicate(), Shard(0)), (Shard(0), Replicate())]
    elif kind == "adam_mini":  # a row's value where the rows are cut, whole where a row or the tensor is
        assert [opt.state[p]["exp_avg_sq"].placements for p in params] == [
            (Shard(0),), *[(Replicate(),)] * 5]
        assert opt.state[params[0]]["exp_avg_sq"].to_local().shape == (len(params[0].to_local()), 1)
    if mode == "save":  # each rank writes its blocks
        tensors, files = checkpoint.state_of(torch.nn.ParameterList(params), opt)
        checkpoint.save_checkpoint(path, 5, tensors, dict(step=5), files)
        return
    again = placed([torch.zeros(q.shape) for q in ref])
    resumed = MuonAdamW(_groups(again, kind))
    checkpoint.load_into(path, 5, torch.nn.ParameterList(again), resumed)
    step(again, resumed, 5)


@pytest.mark.parametrize("kind", ["lion", "adam_mini"])
def test_a_kind_runs_on_dtensor_params_and_resumes_at_another_world_size(tmp_path, kind):
    from test_dist import spawn

    spawn(_dtensor_worker, 2, kind, tmp_path, "save")
    spawn(_dtensor_worker, 3, kind, tmp_path, "load")


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["lion", "adam_mini"])
def test_a_kind_runs_on_a_2d_mesh_and_resumes_on_a_1d_one(tmp_path, kind):
    """FSDP2 x tensor parallel: 4 ranks on a 2 x 2 mesh, then its sharded checkpoint read at 2 ranks."""
    from test_dist import spawn

    spawn(_dtensor_worker, 4, kind, tmp_path, "save", True)
    spawn(_dtensor_worker, 2, kind, tmp_path, "load")


@pytest.mark.parametrize("kind", ["lion", "adam_mini"])
def test_a_kind_trains_a_gpt_under_fsdp2_as_one_device(kind):
    """FSDP2 (fully_shard, every param a DTensor cut by rows) on the GPT whose embedding and head are on the
    kind, trained from each rank's batch: equal to the unsharded model on every rank's batches, also after its
    whole state resumes in a fresh sharded model. (The nanochat arch's backout_lambda has a grad of rounding
    noise in this miniature, which Adam's normalization makes a step of lr, AdamW's too: its scalars' state
    per tensor is checked on DTensors above.)"""
    from test_dist import spawn
    from test_sharded import _fsdp_gpt_worker

    spawn(_fsdp_gpt_worker, 2, True, "classic", dict.fromkeys(ROLES["classic"], dict(kind=kind)))


def test_the_run_header_names_the_kind():
    """base_train's header line of a group on a kind: its kind, peak lr, betas and decay (a Muon group's
    momentum schedule would raise there: a kind has none)."""
    from nanomuon.arch import ARCHS
    from scripts.base_train import group_words
    from scripts.train_args import parse_args

    opt = _gpt("classic").setup_optimizer(Variant(roles={"lm_head": dict(kind="lion")}))
    head = next(g for g in opt.param_groups if g["name"] == "lm_head")
    args = parse_args(["--optimizer", "muon", "--arch", "classic"])
    assert group_words(head, ARCHS["classic"], args) == (f"lm_head: lion, peak lr {head['lr']:.3g}, betas (0.9, 0.99), "
                                                   "weight decay 0")
