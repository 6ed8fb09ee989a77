"""The stock-PyTorch baseline (torch.optim.Muon + torch.optim.AdamW behind the kind convention) against a
float64 re-derivation of Keller Jordan's Muon and torch.optim.AdamW, on one process and on gloo ranks."""

import copy
import math

import pytest
import torch
from test_dist import spawn

from nanomuon.baselines import TorchMuonAdamW

SHAPES = [(24, 40), (48, 16), (16, 16)]  # wide, tall, square
NS5 = (3.4445, -4.775, 2.0315)


def params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(dtype)) for s in SHAPES + [(40,)]]


def grads(step, rank=0, world_size=1):
    """Rank r's grads: G + (r - (N-1)/2) E, whose mean over ranks is G at any world size."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for s in SHAPES + [(40,)]:
        G, E = torch.randn(s, generator=g, dtype=torch.float64), torch.randn(s, generator=g, dtype=torch.float64)
        out.append(G + (rank - (world_size - 1) / 2) * E)
    return out


def groups(ps, lr=0.02, wd=0.1):
    return [dict(kind="muon", params=ps[:3], lr=lr, momentum=0.95, weight_decay=wd, name="matrices"),
            dict(kind="adamw", params=ps[3:], lr=3e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.01)]


def reference(steps, lr=0.02, wd=0.1):
    """Muon in float64, written from the algorithm: m = mu m + (1 - mu) g; u = (1 - mu) g + mu m (Nesterov);
    five NS5 iterations on u / ||u||_F (on the wide orientation); p *= 1 - lr wd; p -= lr sqrt(max(1, r/c)) O.
    The vector goes through torch.optim.AdamW in float64."""
    ps = params(torch.float64)
    bufs = [torch.zeros_like(p) for p in ps[:3]]
    adamw = torch.optim.AdamW(ps[3:], lr=3e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.01)
    for step in range(steps):
        gs = grads(step)
        with torch.no_grad():
            for p, g, m in zip(ps[:3], gs, bufs):
                m.mul_(0.95).add_(0.05 * g)
                X = 0.05 * g + 0.95 * m
                tall = X.size(0) > X.size(1)
                X = X.T if tall else X
                X = X / X.norm()
                a, b, c = NS5
                for _ in range(5):
                    A = X @ X.T
                    X = a * X + (b * A + c * A @ A) @ X
                X = X.T if tall else X
                p.mul_(1 - lr * wd).sub_(lr * math.sqrt(max(1, p.size(0) / p.size(1))) * X)
        ps[3].grad = gs[3]
        adamw.step()
    return ps


def run(opt, ps, steps, rank=0, world_size=1):
    for step in range(steps):
        for p, g in zip(ps, grads(step, rank, world_size)):
            p.grad = g.to(p.dtype)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("precision, atol", [("fp32", 2e-5), ("bf16", 3e-3)])
def test_matches_float64_muon_and_adamw(precision, atol):
    ps = params()
    run(TorchMuonAdamW(groups(ps), ns_precision=precision), ps, 4)
    for p, q in zip(ps, reference(4)):
        torch.testing.assert_close(p.double(), q, rtol=0, atol=atol)


def test_state_dict_round_trip_and_mismatch():
    ps = params()
    opt = TorchMuonAdamW(groups(ps))
    run(opt, ps, 2)
    saved = copy.deepcopy(opt.state_dict())  # state_dict() holds live tensors; a checkpoint holds copies
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    again = TorchMuonAdamW(groups(twin))
    again.load_state_dict(saved)
    for o, c in ((opt, ps), (again, twin)):
        for step in range(2, 4):
            for p, g in zip(c, grads(step)):
                p.grad = g.float()
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, twin))
    with pytest.raises(ValueError, match="not saved by TorchMuonAdamW"):
        TorchMuonAdamW(groups(params())[:1]).load_state_dict(saved)


def test_a_schedule_reaches_the_optimizers_after_a_load():
    """base_train writes lr and momentum into param_groups every step; after load_state_dict (a resume)
    those writes must still reach torch's optimizers, or a resumed run keeps the checkpoint's lrs."""
    ps, twin = params(), params()
    opt, again = TorchMuonAdamW(groups(ps)), TorchMuonAdamW(groups(twin))
    run(opt, ps, 2)
    run(again, twin, 2)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))
    for step in range(2, 5):
        for o, c in ((opt, ps), (again, twin)):
            for group, lr in zip(o.param_groups, (0.02, 3e-3)):
                group["lr"] = lr * (1 - step / 5)
            for p, g in zip(c, grads(step)):
                p.grad = g.float()
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, twin))
    reference = params()  # the same schedule without a load: the lrs must have moved the params differently
    ref_opt = TorchMuonAdamW(groups(reference))
    run(ref_opt, reference, 2)
    for step in range(2, 5):
        for p, g in zip(reference, grads(step)):
            p.grad = g.float()
        ref_opt.step()
    assert not all(torch.equal(p, q) for p, q in zip(ps, reference))


def test_bad_groups():
    ps = params()
    with pytest.raises(ValueError, match="set kind='muon' or kind='adamw'"):
        TorchMuonAdamW([dict(params=ps[:1], lr=0.1)])
    with pytest.raises(ValueError, match=r"has no option \['beta2'\]"):
        TorchMuonAdamW([dict(kind="muon", params=ps[:1], lr=0.1, beta2=0.95)])


def _dist_worker(rank, world_size):
    import torch.distributed as dist

    ps = params()
    run(TorchMuonAdamW(groups(ps), ns_precision="fp32"), ps, 3, rank, world_size)
    ref = params()
    run(TorchMuonAdamW(groups(ref), ns_precision="fp32"), ref, 3)  # one process, the mean grads
    for p, q in zip(ps, ref):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
        everyone = [torch.empty_like(p) for _ in range(world_size)]
        dist.all_gather(everyone, p.detach())
        assert all(torch.equal(e, everyone[0]) for e in everyone), "replicas differ"


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.heavy)])
def test_distributed_averages_grads_and_stays_replicated(world_size):
    spawn(_dist_worker, world_size)


def test_bench_optim_runs(capsys):
    """The optimizer benchmark (ours vs this baseline) works end to end on a tiny model."""
    from scripts.bench_optim import main

    main(["--depth", "1", "--steps", "1", "--warmup", "0", "--imbalance-depth", "2"])
    out = capsys.readouterr().out
    assert "step d1" in out and "MuonAdamW" in out and "torch Muon+AdamW" in out and "matmul floor" in out, out
