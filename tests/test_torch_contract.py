"""
MuonAdamW and DistMuonAdamW held to PyTorch's generic optimizer contract: the checks of
TestOptimRenewed (pytorch's test/test_optim.py, with common_optimizers.py's inputs), written here
from what they assert, on a small model of an embedding, a gain vector, two matrices and a head.
Each check runs beside torch.optim.Muon (the model's 2-D params) and torch.optim.AdamW (all of
them), so a check torch's own optimizers fail is never held against ours. Then what a user's own
loop needs: copies (deepcopy, pickle, torch.save) that train on bitwise equal, every LR scheduler
and SWALR resumed bitwise mid-schedule in both checkpoint formats, GradScaler, torch.compile.

A check returns None when it holds, or "refused" where ours refuses on purpose, in one line
(docs/optimizer.md, "Using it in your own loop"); NotApplicable where it does not apply.
DistMuonAdamW runs every check in gloo ranks (world 1 here, world 2 with --heavy).
"""

import copy
import functools
import io
import json
import math
import pickle
from pathlib import Path

import pytest
import torch
from torch.optim import lr_scheduler as ls
from torch.optim.swa_utils import SWALR

from nanomuon import checkpoint
from nanomuon.optim import DistMuonAdamW, MuonAdamW
from nanomuon.param_groups import muon_param_groups

MUON = dict(lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.1, ns_precision="fp32")
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


class NotApplicable(Exception):
    """The check does not apply to this optimizer (as torch's OptimizerInfo skips it)."""


class Tiny(torch.nn.Module):
    """An embedding, a gain, two matrices and a head: both kinds of param, as a GPT has."""

    def __init__(self, seed=0, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.wte = torch.nn.Embedding(11, 8)
        self.gain = torch.nn.Parameter(torch.ones(8) + 0.1 * torch.randn(8))
        self.fc = torch.nn.Linear(8, 16, bias=False)
        self.proj = torch.nn.Linear(16, 8, bias=False)
        self.lm_head = torch.nn.Linear(8, 11, bias=False)
        self.to(dtype)

    def forward(self, x):
        h = self.wte(x) * self.gain
        h = h + self.proj(torch.relu(self.fc(h)))
        logits = self.lm_head(h).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.roll(1, 1).flatten())


def batch(step=0):
    return torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(100 + step))


def backward(model, step=0):
    loss = model(batch(step))
    loss.backward()
    return loss


def fwd_bwd(opt, model, step=0):
    opt.zero_grad()
    return backward(model, step)


def _named(params, named, names):
    return [(names[id(p)], p) for p in params] if named else list(params)


def _ours(cls, model, named=False, tensor_lr=False, weight_decay=None, reverse=False):
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [g for g in muon_param_groups(model, MUON, ADAMW) if g["params"]]
    for g in groups:
        g["params"] = _named(g["params"], named, names)
        if tensor_lr:
            g["lr"] = torch.tensor(g["lr"])
        if weight_decay is not None:
            g["weight_decay"] = weight_decay
    return cls(groups[::-1] if reverse else groups)


def _torch(cls, kw, model, named=False, tensor_lr=False, weight_decay=None, reverse=False):
    """torch.optim.Muon (2-D params only) or AdamW (all) in two groups: the matrices and the
    embedding and head, then (AdamW) the gain."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for p in model.parameters() if cls is not torch.optim.Muon or p.ndim == 2]
    inner = {id(model.fc.weight), id(model.proj.weight)}
    groups = [[p for p in params if id(p) in inner], [p for p in params if id(p) not in inner]]
    kw = dict(kw, lr=torch.tensor(kw["lr"]) if tensor_lr else kw["lr"])
    if weight_decay is not None:
        kw["weight_decay"] = weight_decay
    groups = [dict(params=_named(g, named, names)) for g in groups]
    return cls(groups[::-1] if reverse else groups, **kw)


OPTIMIZERS = {
    "MuonAdamW": functools.partial(_ours, MuonAdamW),
    "torch.Muon": functools.partial(_torch, torch.optim.Muon, dict(lr=0.02, weight_decay=0.1)),
    "torch.AdamW": functools.partial(_torch, torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.01)),
}
DIST = functools.partial(_ours, DistMuonAdamW)
OURS = {"MuonAdamW", "DistMuonAdamW"}


def name_of(make) -> str:
    return next((k for k, v in {**OPTIMIZERS, "DistMuonAdamW": DIST}.items() if v is make), "?")


def params_of(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def train(model, opt, steps, start=0, scheds=(), closure=False):
    for s in range(start, start + steps):
        opt.zero_grad()
        if closure:
            loss = opt.step(functools.partial(fwd_bwd, opt, model, s))
        else:
            loss = backward(model, s)
            opt.step()
        for sched in scheds:
            sched.step(loss.item()) if isinstance(sched, ls.ReduceLROnPlateau) else sched.step()
    return loss


def equal_models(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def assert_same_training(model_a, opt_a, model_b, opt_b, steps=3, start=10):
    for s in range(start, start + steps):
        for m, o in ((model_a, opt_a), (model_b, opt_b)):
            o.zero_grad()
            backward(m, s)
            o.step()
        assert equal_models(model_a, model_b), f"models differ after step {s}"


def without_names(sd):
    sd = copy.deepcopy(sd)
    for g in sd["param_groups"]:
        g.pop("param_names", None)
    return sd


def same(a, b) -> bool:
    """Nested state dicts equal, tensors bitwise."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# -- the checks: TestOptimRenewed's, as they apply to a Muon + AdamW optimizer -------------------


def check_errors_invalid_param_type(make):
    """A bare Tensor for params: TypeError (the words are each optimizer's own)."""
    with pytest.raises(TypeError):
        type(make(Tiny()))(torch.nn.Parameter(torch.randn(2, 2)))


def check_errors_duplicate_in_group(make):
    """torch warns of a param twice in a group (an error in future); ours refuses now."""
    model = Tiny()
    opt = make(model)
    group = dict(opt.param_groups[0], params=[model.fc.weight, model.fc.weight])
    group.pop("param_names", None)
    if name_of(make) in OURS:
        with pytest.raises(ValueError, match="param 1 is already in param 0"):
            type(opt)([group])
        return "refused"
    with pytest.warns(UserWarning, match="duplicate parameters"):
        type(opt)([group], **{k: v for k, v in opt.defaults.items() if k == "lr"})


def check_errors_duplicate_across_groups(make):
    model = Tiny()
    opt = make(model)
    with pytest.raises(ValueError):
        opt.add_param_group(dict(opt.param_groups[0]))


def _goes_right_direction(make, contiguous=True, scheds=()):
    model = Tiny()
    if not contiguous:  # views of every other element of a buffer twice the size
        for p in model.parameters():
            p.data = torch.stack([p.data, p.data], -1)[..., 0]
            assert not p.is_contiguous() or p.numel() == 1
    opt = make(model)
    made = [s(opt) for s in scheds]
    x = batch(0)

    def closure():
        opt.zero_grad()
        loss = model(x)
        loss.backward()
        return loss
    first = closure().item()
    for _ in range(20):
        loss = opt.step(closure)
        for s in made:
            s.step(loss.item()) if isinstance(s, ls.ReduceLROnPlateau) else s.step()
    assert closure().item() < first


def check_forloop_goes_right_direction(make):
    _goes_right_direction(make)


def check_forloop_goes_right_direction_noncontiguous(make):
    if name_of(make) == "DistMuonAdamW":  # flat shards of params need them contiguous
        with pytest.raises(ValueError, match="needs contiguous params"):
            _goes_right_direction(make, contiguous=False)
        return "refused"
    _goes_right_direction(make, contiguous=False)


def check_forloop_goes_right_direction_with_lrsched(make):
    for sched in (lambda o: ls.StepLR(o, gamma=0.9, step_size=10), ls.ReduceLROnPlateau):
        _goes_right_direction(make, scheds=[sched])


def check_param_group_with_lrscheduler_goes_right_direction(make):
    def one_group_lr(opt):
        opt.param_groups[-1]["lr"] = 0.01
        return ls.StepLR(opt, gamma=0.9, step_size=10)
    _goes_right_direction(make, scheds=[one_group_lr, ls.ReduceLROnPlateau])


def check_tensor_lr(make):
    a, b = Tiny(), Tiny()
    opt_a, opt_b = make(a), make(b, tensor_lr=True)
    for s in range(5):
        for m, o in ((a, opt_a), (b, opt_b)):
            o.zero_grad()
            backward(m, s)
            o.step()
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q)  # tensor(lr) is the float32 nearest lr


def check_param_groups_weight_decay(make):
    model = Tiny()
    opt = make(model)
    opt.param_groups[-1]["weight_decay"] = 0.0
    first = backward(model).item()
    train(model, opt, 20)
    assert backward(model).item() < first


def check_param_groups_lr(make):
    """A group at lr 1e-28 leaves its params as they were; the others still descend."""
    model = Tiny()
    opt = make(model)
    opt.param_groups[-1]["lr"] = 1e-28
    frozen = [p.detach().clone() for p in opt.param_groups[-1]["params"]]
    x = batch(0)
    first = model(x).item()
    for _ in range(20):
        opt.zero_grad()
        model(x).backward()
        opt.step()
    assert model(x).item() < first
    assert all(torch.equal(p, q) for p, q in zip(opt.param_groups[-1]["params"], frozen))


def check_step_is_noop_when_params_have_no_grad(make):
    model = Tiny()
    opt = make(model)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step(lambda: torch.tensor([1.0]))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def check_step_is_noop_for_zero_grads(make):
    model = Tiny()
    opt = make(model, weight_decay=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    for p in params_of(opt):
        p.grad = torch.zeros_like(p)
    opt.step(lambda: torch.tensor([1.0]))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def check_optimizer_can_be_printed(make):
    assert type(make(Tiny())).__name__ in repr(make(Tiny()))


def _state_dict_deterministic(make, named0, named1):
    model = Tiny()
    opt = make(model, named=named0)
    train(model, opt, 10, closure=True)
    model_c = copy.deepcopy(model)
    opt_c = make(model_c, named=named1)
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
    for s in range(10, 20):
        for m, o in ((model, opt), (model_c, opt_c)):
            o.step(functools.partial(fwd_bwd, o, m, s))
        assert equal_models(model, model_c)
    assert same(without_names(opt.state_dict()), without_names(opt_c.state_dict()))
    opt_c.param_groups.extend(opt_c.param_groups)  # repeated params: one representation
    assert same(without_names(opt.state_dict())["param_groups"][-1],
                without_names(opt_c.state_dict())["param_groups"][-1])


def check_state_dict_deterministic(make):
    _state_dict_deterministic(make, False, False)


def check_state_dict_deterministic_named(make):
    for named0, named1 in ((True, True), (True, False), (False, True)):
        _state_dict_deterministic(make, named0, named1)


def check_can_load_older_state_dict(make):
    """Flags newer than a checkpoint (torch: maximize, foreach, ...; ours: every optional key,
    at its default) are left out of it; it loads and steps."""
    model = Tiny()
    opt = make(model)
    train(model, opt, 3)
    old = copy.deepcopy(opt.state_dict())
    newer = ("maximize", "foreach", "fused", "differentiable", "capturable")
    for g in old["param_groups"]:
        optional = ({k for k in g if k not in ("params", "kind", "lr", "momentum", "ns_steps",
                                                  "beta2", "weight_decay", "betas", "eps")}
                    if name_of(make) in OURS else set(newer))
        for k in optional & set(g):
            del g[k]
    opt.load_state_dict(old)
    train(model, opt, 1)


def check_can_load_from_to_named_state_dict(make):
    for named0 in (True, False):
        for named1 in (True, False):
            model = Tiny()
            opt = make(model, named=named0)
            train(model, opt, 3)
            opt2 = make(model, named=named1)
            opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
            train(model, opt2, 1)
            if named0 or named1:
                want = [n for g in opt.param_groups for n in g.get("param_names", ())] or [
                    n for g in opt2.param_groups for n in g["param_names"]]
                got = [n for g in opt2.state_dict()["param_groups"] for n in g["param_names"]]
                assert got == want


def check_save_load_equality_with_weights_only(make):
    for named in (False, True):
        model = Tiny()
        opt = make(model, named=named)
        train(model, opt, 3, closure=True)
        sd = opt.state_dict()
        buf = io.BytesIO()
        torch.save(sd, buf)
        for weights_only in (False, True):
            buf.seek(0)
            assert same(torch.load(buf, weights_only=weights_only), sd)


def check_load_nontensor_step(make):
    model = Tiny()
    opt = make(model)
    train(model, opt, 3)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        if isinstance(st.get("step"), torch.Tensor):
            st["step"] = st["step"].item()
    opt.load_state_dict(sd)
    train(model, opt, 1)


def check_state_dict_hooks(make):
    """Pre, post, and pre then post, as test_state_dict_pre_hook and its two siblings."""
    def pre(o):
        o.state["test"] = 1

    def post(o, sd):
        sd["ran_state_dict_pre_hook"] = "test" in sd["state"]
        sd["state"].pop("test", None)
        return sd
    for hooks, want in (((pre,), "pre"), ((post,), False), ((pre, post), True)):
        opt = make(Tiny())
        opt.register_state_dict_pre_hook(hooks[0]) if pre in hooks else None
        opt.register_state_dict_post_hook(post) if post in hooks else None
        sd = opt.state_dict()
        if want == "pre":
            assert sd["state"]["test"] == 1
        else:
            assert sd["ran_state_dict_pre_hook"] is want and "test" not in sd["state"]


def check_load_state_dict_hooks(make):
    """test_load_state_dict_pre_hook_and_prepend, _post_hook and _pre_post_hook."""
    def pre1(o, sd):  # lrs no optimizer here starts with
        sd["param_groups"][0]["lr"] = 0.0012

    def pre2(o, sd):
        sd = copy.deepcopy(sd)
        sd["param_groups"][0]["lr"] = 0.0013
        return sd

    def post(o):
        o.state["ran_pre2"] = o.param_groups[0]["lr"] == 0.0013
        o.state["ran_post"] = True
    opt = make(Tiny())
    sd = opt.state_dict()
    opt.register_load_state_dict_pre_hook(pre1)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.0012
    opt.register_load_state_dict_pre_hook(pre2, prepend=True)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.0012
    opt = make(Tiny())
    opt.register_load_state_dict_post_hook(post)
    opt.load_state_dict(opt.state_dict())
    assert opt.state["ran_pre2"] is False and opt.state["ran_post"] is True
    opt = make(Tiny())
    opt.register_load_state_dict_pre_hook(pre2)
    opt.register_load_state_dict_post_hook(post)
    opt.load_state_dict(opt.state_dict())
    assert opt.state["ran_pre2"] is True and opt.state["ran_post"] is True


def check_load_state_dict_pre_hook_runs_first(make):
    """A pre-hook adapts a checkpoint before it is checked: groups saved in the other order."""
    model = Tiny()
    opt = make(model)
    train(model, opt, 3)
    model_c = copy.deepcopy(model)
    opt_c = make(model_c, reverse=True)
    opt_c.register_load_state_dict_pre_hook(
        lambda o, sd: dict(sd, param_groups=sd["param_groups"][::-1]))
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load does not copy
    assert_same_training(model, opt, model_c, opt_c)


def check_step_hooks(make):
    """test_step_pre_hook, _post_hook and _all_hooks: order, and removal."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    model = Tiny()
    opt, data = make(model), []
    handles = [register_optimizer_step_pre_hook(lambda *a: data.append(0)),
               register_optimizer_step_post_hook(lambda *a: data.append(5)),
               opt.register_step_pre_hook(lambda *a: data.append(1)),
               opt.register_step_post_hook(lambda *a: data.append(2))]
    try:
        train(model, opt, 2)
    finally:
        for h in handles:
            h.remove()
    train(model, opt, 1)
    assert data == [0, 1, 2, 5] * 2


def check_deepcopy_copies_all_public_attrs(make):
    model = Tiny()
    opt = make(model)
    train(model, opt, 3)
    public = lambda o: {k for k in o.__dict__ if not k.startswith("_")}
    assert public(opt) == public(copy.deepcopy(opt))


def check_non_empty_state(make):
    model = Tiny()
    opt = make(model)
    train(model, opt, 1)
    assert all(len(st) > 0 for st in opt.state.values())


def check_complex(make):
    """Complex params: AdamW steps them as view_as_real; Muon (torch's too) does not take them."""
    if name_of(make) != "torch.AdamW":
        raise NotApplicable("complex params: supports_complex=False, as torch.optim.Muon")
    z = torch.randn(10, 5, dtype=torch.complex64, requires_grad=True)
    r = torch.view_as_real(z).detach().clone().requires_grad_()
    oz, orr = torch.optim.AdamW([z]), torch.optim.AdamW([r])
    for _ in range(3):
        r.grad = torch.randn_like(r)
        z.grad = torch.view_as_complex(r.grad.clone())
        oz.step()
        orr.step()
    torch.testing.assert_close(torch.view_as_real(z), r)


def check_bare_params(make):
    """torch's bare form, optimizer(model.parameters(), lr=...): ours refuses it in one line
    naming muon_param_groups, as a bare tensor cannot say which kind trains it."""
    model = Tiny()
    cls = type(make(model))
    params = [p for p in model.parameters() if p.ndim == 2]
    if name_of(make) in OURS:
        with pytest.raises(TypeError, match="muon_param_groups"):
            cls(params, lr=0.02)
        return "refused"
    train(model, cls(params, lr=1e-3), 2)


def check_add_param_group_mid_run(make):
    model = Tiny()
    opt = make(model)
    last = opt.param_groups.pop()
    train(model, opt, 2)
    opt.add_param_group({k: v for k, v in last.items() if k != "step"})
    train(model, opt, 2)
    model_c = copy.deepcopy(model)
    opt_c = make(model_c)
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load does not copy
    assert_same_training(model, opt, model_c, opt_c)


def check_zero_grad(make):
    model = Tiny()
    opt = make(model)
    backward(model)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params_of(opt))
    opt.zero_grad()
    assert all(p.grad is None for p in params_of(opt))


def check_closure_returns_loss(make):
    model = Tiny()
    opt = make(model)
    loss = opt.step(lambda: backward(model))
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0


# -- copies, other code's keys, dtype casts ------------------------------------------------------


def _copies_train_alike(make, copier):
    model = Tiny()
    opt = make(model)
    train(model, opt, 3)
    model_c, opt_c = copier((model, opt))
    assert {id(p) for p in params_of(opt_c)} <= {id(p) for p in model_c.parameters()}
    assert_same_training(model, opt, model_c, opt_c)


def check_deepcopy_trains_bitwise(make):
    _copies_train_alike(make, copy.deepcopy)


def check_pickle_trains_bitwise(make):
    _copies_train_alike(make, lambda x: pickle.loads(pickle.dumps(x)))


def check_torch_save_trains_bitwise(make):
    def saved(x):
        buf = io.BytesIO()
        torch.save(x, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)
    _copies_train_alike(make, saved)


def check_copies_over_another_process_group(make):
    """A DistMuonAdamW over a group other than the default one: a deepcopy shares the group and
    trains alike; pickling it is refused in one line naming state_dict() (DDP refuses too)."""
    if name_of(make) != "DistMuonAdamW":
        raise NotApplicable("no process group")
    import torch.distributed as dist
    group = dist.new_group(list(range(dist.get_world_size())))
    model = Tiny()
    opt = DistMuonAdamW(muon_param_groups(model, MUON, ADAMW), process_group=group)
    train(model, opt, 2)
    model_c, opt_c = copy.deepcopy((model, opt))
    assert opt_c.pg is group
    assert_same_training(model, opt, model_c, opt_c)
    with pytest.raises(TypeError, match="save optimizer.state_dict"):
        pickle.dumps(opt)


def check_unpickled_on_another_rank_is_refused(make):
    """ZeRO-1 state is this rank's share: an unpickled DistMuonAdamW re-binds to the default
    group only at the rank and world size it was pickled at, else refuses in one line."""
    if name_of(make) != "DistMuonAdamW":
        raise NotApplicable("no process group")
    opt = make(Tiny())
    state = pickle.loads(pickle.dumps(opt)).__getstate__()
    elsewhere = type(opt).__new__(type(opt))
    with pytest.raises(ValueError, match="load its state_dict"):
        elsewhere.__setstate__(dict(state, world_size=state["world_size"] + 1))


def check_keys_other_code_adds_survive_load(make):
    """OneCycleLR's, CyclicLR's and SWALR's keys are saved and loaded back, and a checkpoint
    whose group gained a key nothing added is refused, for ours, in one line."""
    for attach in (lambda o: ls.OneCycleLR(o, max_lr=0.03, total_steps=20),
                   lambda o: ls.CyclicLR(o, base_lr=0.001, max_lr=0.01, step_size_up=3),
                   lambda o: SWALR(o, swa_lr=0.005, anneal_epochs=3)):
        model = Tiny()
        opt = make(model)
        sched = attach(opt)
        train(model, opt, 3, scheds=[sched])
        sd = opt.state_dict()
        fresh = make(Tiny())
        added = [{k: g[k] for k in set(g) - set(f)} for g, f in zip(opt.param_groups,
                                                                     fresh.param_groups)]
        assert any(added), "the scheduler added no key"
        fresh.load_state_dict(copy.deepcopy(sd))
        for g, keys in zip(fresh.param_groups, added):
            assert all(k in g and g[k] == v for k, v in keys.items()), (keys, g)
    if name_of(make) in OURS:
        sd["param_groups"][0]["wobble"] = 3
        with pytest.raises(ValueError, match=r"unknown keys \['wobble'\]"):
            make(Tiny()).load_state_dict(sd)
        theirs = torch.optim.AdamW(Tiny().parameters()).state_dict()
        with pytest.raises(ValueError, match="different model or optimizer setup"):
            make(Tiny()).load_state_dict(theirs)


def check_load_casts_floating_state(make):
    """A float64 run's checkpoint loads into a float32 model: the state in the dtypes a float32
    run keeps (torch: the param's; ours: the declared ones, some fp32 on purpose)."""
    model64, model32 = Tiny(dtype=torch.float64), Tiny()
    opt64, opt32 = make(model64), make(model32)
    train(model64, opt64, 2)
    train(model32, opt32, 2)
    fresh = Tiny()
    opt = make(fresh)
    opt.load_state_dict(opt64.state_dict())
    want = {k: {n: v.dtype for n, v in st.items() if isinstance(v, torch.Tensor)}
            for k, st in opt32.state_dict()["state"].items()}
    got = {k: {n: v.dtype for n, v in st.items() if isinstance(v, torch.Tensor)}
           for k, st in opt.state_dict()["state"].items()}
    assert got == want
    train(fresh, opt, 1)
    if name_of(make) in OURS:  # the value checks hold after the cast: 1e300 is inf in fp32
        sd = opt64.state_dict()
        k = next(k for k, st in sd["state"].items() if "exp_avg" in st)
        sd["state"][k]["exp_avg"] = sd["state"][k]["exp_avg"] + 1e300
        with pytest.raises(ValueError, match="NaN or infinite"):
            make(Tiny()).load_state_dict(sd)


def check_grad_scaler(make):
    """torch.amp.GradScaler on CPU: unscale_, a step skipped on inf grads, the scale backed
    off; the steps it takes equal those of an unscaled run."""
    model, ref = Tiny(), Tiny()
    opt, opt_ref = make(model), make(ref)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    for s in range(4):
        opt.zero_grad()
        opt_ref.zero_grad()
        scaler.scale(model(batch(s))).backward()
        if s == 2:  # an overflow: this step must change nothing
            model.fc.weight.grad[0, 0] = math.inf
            before = [p.detach().clone() for p in model.parameters()]
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        if s == 2:
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            assert scaler.get_scale() == 2.0 ** 9
            continue
        backward(ref, s)
        opt_ref.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)


CHECKS = {name.removeprefix("check_"): f for name, f in globals().items()
          if name.startswith("check_")}


def run_check(check: str, make) -> str:
    """'pass', 'refused', 'n/a' or 'FAIL: <the error>', for the table."""
    try:
        out = CHECKS[check](make)
    except NotApplicable:
        return "n/a"
    except (Exception, pytest.fail.Exception) as e:  # the table records every failure
        return f"FAIL: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return out or "pass"


# torch's optimizers are the references: the heavy leg runs them (torch.optim.Muon's bf16
# Newton-Schulz is slow on a CPU); the default suite runs ours.
REFERENCES = [pytest.param(name, marks=pytest.mark.heavy) if name.startswith("torch") else name
              for name in OPTIMIZERS]


@pytest.mark.parametrize("optimizer", REFERENCES)
@pytest.mark.parametrize("check", CHECKS)
def test_contract(check, optimizer):
    make = OPTIMIZERS[optimizer]
    try:
        CHECKS[check](make)
    except NotApplicable as e:
        pytest.skip(str(e))


# -- every scheduler resumes bitwise, in torch's format and in base_train's sharded one ----------


def _swa(o):
    return SWALR(o, swa_lr=0.005, anneal_epochs=3)


SCHEDULERS = {
    "StepLR": lambda o: ls.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o: ls.MultiStepLR(o, milestones=[2, 5], gamma=0.5),
    "ConstantLR": lambda o: ls.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: ls.LinearLR(o, start_factor=0.2, total_iters=6),
    "ExponentialLR": lambda o: ls.ExponentialLR(o, gamma=0.8),
    "PolynomialLR": lambda o: ls.PolynomialLR(o, total_iters=8, power=2.0),
    "CosineAnnealingLR": lambda o: ls.CosineAnnealingLR(o, T_max=8),
    "CosineAnnealingWarmRestarts": lambda o: ls.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    "CyclicLR": lambda o: ls.CyclicLR(o, base_lr=0.001, max_lr=0.01, step_size_up=3),
    "OneCycleLR": lambda o: ls.OneCycleLR(o, max_lr=0.03, total_steps=12),
    "LambdaLR": lambda o: ls.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "MultiplicativeLR": lambda o: ls.MultiplicativeLR(o, lambda s: 0.9),
    "SequentialLR": lambda o: ls.SequentialLR(o, [ls.LinearLR(o, 0.2, total_iters=3),
                                                  ls.ExponentialLR(o, 0.8)], milestones=[3]),
    "ChainedScheduler": lambda o: ls.ChainedScheduler([ls.ConstantLR(o, 0.5, total_iters=4),
                                                       ls.ExponentialLR(o, 0.9)]),
    "ReduceLROnPlateau": lambda o: ls.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "SWALR": _swa,
}


def resume_check(make, scheduler: str, fmt: str, tmp: Path) -> None:
    """Steps 0-5 then a checkpoint, resumed into fresh objects for steps 6-9: bitwise the run
    that went on. ReduceLROnPlateau steps on a loss that stops falling, so it cuts the lr."""
    model = Tiny()
    opt = make(model)
    sched = SCHEDULERS[scheduler](opt)
    loss_of = lambda s: 1.0 if s > 1 else 2.0 - s  # noqa: E731 - a plateau from step 2
    step = lambda m, o, sc, s: (o.zero_grad(), backward(m, s), o.step(),  # noqa: E731
                                sc.step(loss_of(s)) if isinstance(sc, ls.ReduceLROnPlateau)
                                else sc.step())
    for s in range(6):
        step(model, opt, sched, s)
    sched_state = copy.deepcopy(sched.state_dict())  # torch 2.9 SWALR: a function, not a file
    if fmt == "torch":
        buf = io.BytesIO()
        torch.save(dict(model=model.state_dict(), optim=opt.state_dict()), buf)
    else:  # base_train's: model and optimizer pieces through DCP (checkpoint.py)
        tensors, files = checkpoint.state_of(model, opt)
        tmp.mkdir(parents=True, exist_ok=True)
        checkpoint.save_checkpoint(tmp, 6, tensors, dict(step=6), files)
    for s in range(6, 10):
        step(model, opt, sched, s)
    model_r = Tiny(seed=1)
    opt_r = make(model_r)
    sched_r = SCHEDULERS[scheduler](opt_r)  # torch's order: the scheduler, then the loads
    if fmt == "torch":
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        model_r.load_state_dict(saved["model"])
        opt_r.load_state_dict(saved["optim"])
    else:
        checkpoint.load_into(tmp, 6, model_r, opt_r)
    sched_r.load_state_dict(sched_state)
    for s in range(6, 10):
        step(model_r, opt_r, sched_r, s)
    assert equal_models(model, model_r), f"{scheduler} ({fmt}) resumed differently"
    assert [float(g["lr"]) for g in opt.param_groups] == [float(g["lr"])
                                                          for g in opt_r.param_groups]


@pytest.mark.parametrize("fmt", ["torch", "sharded"])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("optimizer", REFERENCES)
def test_scheduler_resumes_bitwise(optimizer, scheduler, fmt, tmp_path, request):
    """Ours in torch's format by default, and in the sharded one with the schedulers that add
    keys to groups; the rest in the heavy leg."""
    keys = scheduler in ("OneCycleLR", "CyclicLR", "SWALR")
    if fmt == "sharded" and not keys and not request.config.getoption("--heavy") | \
            request.config.getoption("--slow"):
        pytest.skip("heavy: run with --heavy")
    resume_check(OPTIMIZERS[optimizer], scheduler, fmt, tmp_path)


# -- DistMuonAdamW: every check in gloo ranks ----------------------------------------------------


def _dist_worker(rank, world_size, out_dir):
    results = {check: run_check(check, DIST) for check in CHECKS}
    for scheduler in SCHEDULERS:
        for fmt in ("torch", "sharded"):
            tmp = Path(out_dir) / f"{scheduler}-{fmt}"
            try:
                resume_check(DIST, scheduler, fmt, tmp)
                results[f"resume_{scheduler}_{fmt}"] = "pass"
            except (Exception, pytest.fail.Exception) as e:
                results[f"resume_{scheduler}_{fmt}"] = f"FAIL: {type(e).__name__}: {e}"[:200]
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))


def dist_results(world_size: int, out_dir: Path) -> dict:
    from test_dist import spawn
    spawn(_dist_worker, world_size, str(out_dir))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.heavy)])
def test_dist_contract(world_size, tmp_path):
    """Every check and every scheduler's resume, for DistMuonAdamW over gloo ranks."""
    for results in dist_results(world_size, tmp_path):
        failed = {k: v for k, v in results.items() if v.startswith("FAIL")}
        assert not failed, failed


# -- torch.compile of the step, with inductor ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_compiled_step_with_inductor(optimizer):
    """opt.step compiled by inductor trains as the eager step (to float tolerance: inductor
    fuses differently), on CPU."""
    torch._dynamo.reset()
    eager_model, model = Tiny(), Tiny()
    eager = OPTIMIZERS[optimizer](eager_model)
    opt = OPTIMIZERS[optimizer](model)
    step = torch.compile(opt.step, backend="inductor")
    for s in range(2):
        for m, o, f in ((eager_model, eager, eager.step), (model, opt, step)):
            o.zero_grad()
            backward(m, s)
            f()
    for p, q in zip(eager_model.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)
    assert not equal_models(Tiny(), model)
