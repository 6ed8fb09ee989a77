"""
The CUDA paths, which CI (CPU only) cannot run: scripts/gpu_check.sh runs these on a lent GPU with
`pytest --slow -m cuda`; elsewhere they skip. Compiled against eager for the optimizer and the model,
bf16 Newton-Schulz, fp16 Gram Newton-Schulz and bf16 autocast against fp64 references, the nccl path of
DistMuonAdamW against MuonAdamW, and that LR schedules never recompile the compiled update.
"""

import pytest
import torch
import torch.distributed as dist
from test_optim import (
    assert_equal_but_for_cautious_flips,
    orthogonalize,
    scheduled_muon_lr,
    step_under_a_schedule,
)

from nanomuon.coefficients import ns_coefficients
from nanomuon.gpt import GPT, config_from_depth
from nanomuon.muon import NewtonSchulz
from nanomuon.optim import DistMuonAdamW, MuonAdamW

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = [(256, 128), (256, 128), (128, 512), (384, 384), (1000, 64), (64,)]


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).cuda()) for s in SHAPES]


def groups(ps, **muon):
    return [dict(kind="muon", params=ps[:5], lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.1, **muon),
            dict(kind="adamw", params=ps[5:], lr=3e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.01)]


def set_grads(param_lists, step):
    g = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(s, generator=g).cuda() for s in SHAPES]
    for ps in param_lists:
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()


@pytest.mark.compile
def test_compiled_update_equals_eager_and_schedules_do_not_recompile():
    import torch._dynamo

    torch._dynamo.reset()
    eager, compiled = make(), make()
    opt_e = MuonAdamW(groups(eager, ns_precision="fp32"), compile=False)
    opt_c = MuonAdamW(groups(compiled, ns_precision="fp32"))  # compile defaults to on for CUDA params
    assert opt_c.compiled
    torch._dynamo.utils.counters.clear()
    step_under_a_schedule([opt_e, opt_c], [eager, compiled], set_grads)
    decay = sum(map(scheduled_muon_lr, range(6))) * 0.1  # lr x weight_decay, over the schedule
    for p, q in zip(eager[:5], compiled[:5]):  # the muon group, under cautious decay
        assert_equal_but_for_cautious_flips(p, q, decay, tol=1e-4)
    for p, q in zip(eager[5:], compiled[5:]):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-4)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames <= 5, f"{frames} graphs: 4 muon shapes + 1 adamw shape, and no more for lr changes"


def test_bf16_newton_schulz_is_close_to_the_fp64_polar_factor():
    """orthogonalize in bf16 on the GPU against U V^T from a float64 SVD: the same direction, singular
    values near 1 (Polar Express's 5 steps land in about [0.7, 1.2])."""
    g = torch.Generator().manual_seed(3)
    G = torch.randn(4, 256, 1024, generator=g, dtype=torch.float64)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    polar = U @ Vh
    coeffs, safety, eps = ns_coefficients("polar_express", 5)
    X = orthogonalize(G.float().cuda(), NewtonSchulz(coeffs, safety, eps, torch.bfloat16)).double().cpu()
    cos = (X * polar).sum(dim=(-2, -1)) / (X.norm(dim=(-2, -1)) * polar.norm(dim=(-2, -1)))
    assert cos.min() > 0.97, cos
    s = torch.linalg.svdvals(X)
    assert s.min() > 0.6 and s.max() < 1.25, (s.min(), s.max())


@pytest.mark.compile
def test_fp16_gram_newton_schulz_on_the_gpu():
    """Gram Newton-Schulz in fp16 (what the 'auto' orthogonalizer runs with ns_precision='fp16', as
    Dao-AILab does on GPUs), eager and compiled, is as close to the float64 U V^T as the standard
    iteration in fp16, on tall and wide stacks."""
    from test_optim import polynomial_via_svd, rel_err, spectral_band_input

    coeffs, safety, eps = ns_coefficients("polar_express", 5)
    compiled = torch.compile(orthogonalize, fullgraph=True)
    for shape in ((768, 192), (192, 768)):
        G = torch.stack([spectral_band_input(*shape, seed) for seed in range(3)]).float()
        _, polar = polynomial_via_svd(G, coeffs, safety, eps)
        ns = NewtonSchulz(coeffs, safety, eps, torch.float16)
        standard = orthogonalize(G.cuda(), ns).cpu()
        for fn in (orthogonalize, compiled):
            gram = fn(G.cuda(), ns, True).cpu()
            assert gram.dtype == torch.float16
            assert rel_err(gram, polar) < 1.05 * rel_err(standard, polar) + 2e-3, shape


def test_default_bf16_optimizer_tracks_fp32():
    """The CUDA default (ns_precision 'auto' = bf16) against fp32 Newton-Schulz on the same grads: the
    updates agree to bf16's precision (3-5% of each param's total change on a CPU's emulated bf16)."""
    start, bf16, fp32 = make(), make(), make()
    opt_b, opt_f = MuonAdamW(groups(bf16), compile=False), MuonAdamW(groups(fp32, ns_precision="fp32"), compile=False)
    assert opt_b.param_groups[0]["ns_precision"] == "auto"
    for step in range(5):
        set_grads([bf16, fp32], step)
        opt_b.step()
        opt_f.step()
    for p, q, p0 in zip(bf16, fp32, start):
        assert (p - q).norm() <= 0.08 * (q - p0).norm(), (p.shape, ((p - q).norm() / (q - p0).norm()).item())


@pytest.mark.compile
def test_compiled_model_under_bf16_autocast_equals_eager():
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(config_from_depth(2, 512, 128, aspect_ratio=64, head_dim=64)).cuda()
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.05)
    compiled = torch.compile(model, dynamic=False)
    idx = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(1)).cuda()
    losses, grads = [], []
    for m in (model, compiled):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(idx, idx.roll(-1, dims=1))
        loss.backward()
        losses.append(loss.detach().float())
        grads.append([p.grad.float().clone() for p in model.parameters()])
    with torch.no_grad():
        ref = model.double()(idx, idx.roll(-1, dims=1))  # fp64: how close bf16 gets to the truth
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=2e-2)
    assert abs(losses[0].item() - ref.item()) < 5e-2
    for g_c, g_e in zip(grads[1], grads[0]):
        assert (g_c - g_e).norm() <= 5e-2 * g_e.norm() + 1e-6


def test_nccl_dist_optimizer_equals_single_device():
    """DistMuonAdamW on nccl (one rank: the AVG reductions, the in-place reduce-scatter and all_gather) takes
    the same steps as MuonAdamW."""
    store = dist.HashStore()
    dist.init_process_group("nccl", rank=0, world_size=1, store=store, device_id=torch.device("cuda", 0))
    try:
        single, distributed = make(), make()
        opt_s = MuonAdamW(groups(single), compile=False)
        opt_d = DistMuonAdamW(groups(distributed), compile=False)
        for step in range(3):
            set_grads([single, distributed], step)
            opt_s.step()
            opt_d.step()
        for p, q in zip(single, distributed):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["nanochat", "classic"])
@pytest.mark.parametrize("depth", [12, 20])
def test_train_memory_estimate_bounds_a_real_step(depth, arch):
    """The estimate that --device-batch-size auto fits to the free memory, against torch's own peak count of a
    compiled bf16 training step (forward, backward, optimizer step) at d12 and d20 with 4 rows of 2048 tokens:
    at most the estimate, and not so far under it that the fit wastes most of the GPU."""
    from nanomuon.arch import train_memory

    torch.manual_seed(0)
    config = config_from_depth(depth, 32768, 2048, arch=arch)
    model = GPT(config).cuda()
    model.init_weights()
    opt = model.setup_optimizer(compile=True)
    step = torch.compile(model, dynamic=False)
    for _ in range(2):  # the first compiles; the second is the one measured
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        idx = torch.randint(0, 32768, (4, 2048), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            step(idx, idx).backward()
        opt.step()
        model.zero_grad(set_to_none=True)
    peak, estimate = torch.cuda.max_memory_allocated(), sum(train_memory(config, 4).values())
    print(f"d{depth} {arch}, 4 x 2048 tokens: peak {peak / 2 ** 30:.2f} GiB, estimate "
          f"{estimate / 2 ** 30:.2f} GiB")
    assert peak <= estimate <= 2 * peak, (peak, estimate)
