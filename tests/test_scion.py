"""
The scion variant (unconstrained Scion, Pethick et al. 2025, arXiv 2502.07529) on the GPT: every
group's step against a float64 re-derivation of the authors' Scion.step (written out below, from
their LMOs: Spectral, ColNorm transposed for the embedding, Sign); data parallel at 2 and 3 ranks
equal to one process; a checkpoint saved at 2 ranks resumed at 3; a compiled step and a batched-seed
run equal to eager, single ones.
"""

import pytest
import torch
from test_dist import assert_replicated_tensors, spawn

from nanomuon import checkpoint, stages
from nanomuon.gpt import GPT, config_from_depth
from nanomuon.optim import MuonAdamW
from nanomuon.recipe import PeakLRs
from nanomuon.variants import OPTIMIZER_VARIANTS

LR = 0.02  # Scion's one lr: every group's (the matrix lr), its scale per layer
LRS = PeakLRs(embedding_lr=0.3, unembedding_lr=0.004, matrix_lr=LR, adamw_matrix_lr=0.001,
              scalar_lr=0.5, multiplier=1.0)


def spectral(G):
    """Their Spectral(): Keller Jordan's NS5 on G / (||G||_F + 1e-7), wide side up, times
    sqrt(d_out / d_in)."""
    tall = G.shape[0] > G.shape[1]
    X = G.T if tall else G
    X = X / (X.norm() + 1e-7)
    for _ in range(5):
        A = X @ X.T
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return (X.T if tall else X) * (G.shape[0] / G.shape[1]) ** 0.5


def col_norm_transposed(G):
    """Their ColNorm(transpose=True) on nn.Embedding's (vocab, dim): g = G^T, each column (a
    token) divided by its RMS over dim 0 plus 1e-8."""
    g = G.T
    rms = (g ** 2).sum(dim=0, keepdim=True).sqrt() / g.size(0) ** 0.5
    return (g / (rms + 1e-8)).T


def col_norm(G):
    """Their ColNorm(): each column divided by its RMS plus 1e-8."""
    return G / ((G ** 2).sum(dim=0, keepdim=True).sqrt() / G.size(0) ** 0.5 + 1e-8)


def row_norm(G):
    """Their RowNorm(): each row divided by its norm times sqrt(d_in), plus 1e-8."""
    return G / ((G ** 2).sum(dim=-1, keepdim=True).sqrt() * G.size(1) ** 0.5 + 1e-8)


def sign(G):
    """Their Sign(): sign(G) / d_in, d_in of nn.Linear's (d_out, d_in)."""
    return torch.sign(G) / G.shape[1]


def scion_step(params: dict, grads: dict, bufs: dict) -> None:
    """Their Scion.step, unconstrained, momentum 0.1: buf <- (1 - 0.1) buf + 0.1 g, then
    p <- p - lr scale lmo(buf); the shallow-nanogpt groups: wte ColNorm 1, lm_head Sign 10, every
    block matrix Spectral 3."""
    for name, p in params.items():
        buf = bufs.setdefault(name, torch.zeros_like(p))
        buf.mul_(1 - 0.1).add_(grads[name], alpha=0.1)
        lmo, scale = ((col_norm_transposed, 1.0) if name == "wte.weight" else
                      (sign, 10.0) if name == "lm_head.weight" else (spectral, 3.0))
        p.add_(scale * lmo(buf), alpha=-LR)


def model64(seed=0):
    torch.manual_seed(seed)
    model = GPT(config_from_depth(2, 97, 32, aspect_ratio=32, head_dim=16))  # arch classic
    model.init_weights()
    return model.double()


def scion_kwargs(compile=None, optimizer_class=None) -> dict:
    """The variant's setup_optimizer arguments, Newton-Schulz in fp32 (none in float64)."""
    scion = OPTIMIZER_VARIANTS["scion"]
    variant = scion._replace(muon_options=dict(scion.muon_options, ns_precision="fp32"),
                             optimizer_class=optimizer_class)
    return dict(variant=variant, lrs=LRS, compile=compile)


def test_every_group_steps_as_the_authors_scion_step_in_float64():
    """Five steps of the GPT's real gradients: the lm_head, embedding and matrix groups (all the
    classic GPT's, no AdamW) move as the written-out Scion step moves a float64 copy fed the same
    gradients: the embedding and lm_head within 1e-12, the matrices within 5e-7 (their
    Newton-Schulz runs in fp32, seen at 1.4e-7); every param moves 1e-2 and more. First, each
    LMO stage on a matrix against theirs, RowNorm too."""
    G = torch.randn(24, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    G[:, 3] = 0.0  # a zero column and row: 0 / eps
    G[5] = 0.0
    for name, theirs in (("sign", sign), ("col_norm", col_norm), ("row_norm", row_norm)):
        torch.testing.assert_close(stages.ORTHOGONALIZERS[name].fn(G, None), theirs(G), rtol=0,
                                   atol=1e-14, msg=name)
    model = model64()
    opt = model.setup_optimizer(**scion_kwargs())
    assert sorted((g["name"], g["kind"], g["lr"]) for g in opt.param_groups) == [
        ("embedding", "muon", LR), ("lm_head", "muon", LR), ("matrices", "muon", LR)]
    named = dict(model.named_parameters())
    ref = {n: p.detach().clone() for n, p in named.items()}
    start, bufs = {n: p.clone() for n, p in ref.items()}, {}
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randint(0, 97, (4, 32), generator=gen)
        model(x, x.roll(-1, dims=1)).backward()
        grads = {n: p.grad.detach().clone() for n, p in named.items()}
        opt.step()
        opt.zero_grad()
        scion_step(ref, grads, bufs)
    for n, p in named.items():
        assert (ref[n] - start[n]).abs().max() > 1e-2, n
        tol = 1e-12 if n in ("wte.weight", "lm_head.weight") else 5e-7
        torch.testing.assert_close(p.detach(), ref[n], rtol=0, atol=tol, msg=n)


def rank_grads(model, step: int, rank: int, world: int) -> list:
    """Rank r's grads: G + (r - (N-1)/2) E per param, whose mean over the ranks is G."""
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for p in model.parameters():
        G, E = (torch.randn(p.shape, generator=gen, dtype=p.dtype) for _ in range(2))
        out.append(G + (rank - (world - 1) / 2) * E)
    return out


def mean_grads(model, step: int, world: int) -> list:
    return [sum(gs) / world for gs in zip(*(rank_grads(model, step, r, world)
                                            for r in range(world)))]


def feed(model, opt, grads) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    opt.step()


def _dist_worker(rank, world):
    model, ref = model64(), model64()
    opt = model.setup_optimizer(**scion_kwargs())  # under torch.distributed: DistMuonAdamW
    ref_opt = ref.setup_optimizer(**scion_kwargs(optimizer_class=MuonAdamW))
    assert type(opt).__name__ == "DistMuonAdamW"
    for step in range(4):
        feed(model, opt, rank_grads(model, step, rank, world))
        feed(ref, ref_opt, mean_grads(ref, step, world))
        assert_replicated_tensors(list(model.parameters()))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-9)


@pytest.mark.heavy
@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_equals_one_process(world):
    """Each rank's own grads, averaged by DistMuonAdamW, give one process's step on their mean,
    and every rank's params stay bitwise identical."""
    spawn(_dist_worker, world)


def _resume_worker(rank, world, path, mode):
    """'save': 3 steps at this world size, then a checkpoint; 'load': read it here, 3 more."""
    model = model64()
    opt = model.setup_optimizer(**scion_kwargs())
    if mode == "load":
        checkpoint.load_into(path, 3, model, opt)
    for step in range(3) if mode == "save" else range(3, 6):
        feed(model, opt, rank_grads(model, step, rank, world))
    if mode == "save":
        tensors, files = checkpoint.state_of(model, opt)
        checkpoint.save_checkpoint(path, 3, tensors, dict(step=3), files)
    elif rank == 0:
        torch.save([p.detach() for p in model.parameters()], path / "scion.pt")


@pytest.mark.heavy
def test_a_checkpoint_saved_at_2_ranks_resumes_at_3(tmp_path):
    """The momenta come back resharded: the run equals an unbroken one on one process."""
    spawn(_resume_worker, 2, tmp_path, "save")
    spawn(_resume_worker, 3, tmp_path, "load")
    ref = model64()
    opt = ref.setup_optimizer(**scion_kwargs())
    for step in range(6):
        feed(ref, opt, mean_grads(ref, step, 2 if step < 3 else 3))
    for p, q in zip(torch.load(tmp_path / "scion.pt"), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-9)


@pytest.mark.heavy
def test_a_compiled_step_equals_the_eager_one():
    """Every scion group runs compiled under --compile (no stage of theirs is eager) and steps as
    the eager optimizer does, in fp32."""
    models = [model64().float() for _ in range(2)]
    eager, compiled = (m.setup_optimizer(**scion_kwargs(compile=c)) for m, c in zip(models, (0, 1)))
    assert compiled.compiled and not eager.compiled
    for step in range(3):
        grads = rank_grads(models[0], step, 0, 1)
        for model, opt in zip(models, (eager, compiled)):
            feed(model, opt, grads)
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


@pytest.mark.heavy
def test_each_seed_of_a_batched_run_trains_as_its_own_run(base):
    """base_train --optimizer scion --seeds 1,2 against each seed trained alone (test_seeds')."""
    from test_seeds import FLAGS, each_seed_is_its_own_run, summary

    from scripts.base_train import main

    flags = [*FLAGS, "--optimizer", "scion"]
    main([*flags, "--seeds", "1,2", "--run", "scion-batched"])
    each_seed_is_its_own_run(base, flags, summary(base, "scion-batched"), "scion")
