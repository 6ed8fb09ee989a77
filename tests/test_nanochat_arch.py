"""
Arch 'nanochat' (nanochat 92d63d4's GPT and recipe; nanomuon/gpt.py) against references written
out here from its formulas, in float64, never from its code: the forward loss with every piece
(value embeddings, sliding windows, resid and x0 lambdas, smear, backout, QK scale 1.2, RoPE base
100,000, GQA), each piece shown to matter; the init; parameter and FLOP counts at d4, d12, d24;
the optimizer's groups; a Muon step of its recipe; its momentum and weight-decay schedules;
data parallel, batched seeds and resume against one process, one seed and an unbroken run.
"""

import copy
import math

import pytest
import torch
from test_dist import assert_replicated_tensors, spawn
from test_seeds import each_seed_is_its_own_run, relative, summary
from test_train import TINY, assert_bitwise_equal

from nanomuon import reference, stages
from nanomuon.arch import ARCHS, Variant, param_groups
from nanomuon.coefficients import COEFFICIENT_SETS, POLAR_EXPRESS
from nanomuon.gpt import GPT, GPTConfig, config_from_depth, sdpa, window_mask
from nanomuon.optim import DistMuonAdamW, MuonAdamW
from nanomuon.recipe import PeakLRs, peak_lrs
from nanomuon.reference import muon_step
from nanomuon.stages import equilibrate_to_mean


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread for this module's small tensors: on a busy machine, a second OpenMP
    thread that spins at each barrier made them up to 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# 5 layers of SSSL at 256 tokens: S is ceil(256 / 4 / 128) x 128 = 128 keys back, the last layer
# L; value embeddings on layers 4, 2, 0; backout takes layer 5 // 2 = 2's output
TINY_CONFIG = dict(sequence_len=256, vocab_size=61, n_layer=5, n_head=4, n_kv_head=2, n_embd=32,
                   arch="nanochat", window_pattern="SSSL")
TINY_WINDOWS = [128, 128, 128, None, None]
LRS = PeakLRs(embedding_lr=0.3, unembedding_lr=0.008, matrix_lr=0.02, adamw_matrix_lr=0.001,
              scalar_lr=0.5)


FP32_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's eps on fp32


def rms(x):
    return x / (x.square().mean(-1, keepdim=True) + FP32_EPS).sqrt()


def rotate(x, base):
    """RoPE on (B, T, heads, D) in nanochat's sense: channels j and j + D/2 at position t turn by
    -t base^(-2j/D)."""
    T, D = x.shape[1], x.shape[-1]
    angle = torch.arange(T, dtype=torch.float64)[:, None] * base ** (
        -torch.arange(0, D, 2, dtype=torch.float64) / D)
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    a, b = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([a * cos + b * sin, b * cos - a * sin], dim=-1)


def attend(q, k, v, window):
    """Causal softmax attention on (B, T, heads, D), GQA by repeating each kv head, a key j seen
    by query i when 0 <= i - j <= window (None: any)."""
    T, D = q.shape[1], q.shape[-1]
    k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
    behind = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    seen = (behind >= 0) & (behind <= (T if window is None else window))
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D)
    return torch.einsum("bhij,bjhd->bihd", scores.masked_fill(~seen, -math.inf).softmax(-1), v)


def reference_forward(model, idx, targets, windows, qk_scale=1.2, rope_base=100000.0):
    """(logits, mean loss) of the nanochat arch in float64 from the model's weights."""
    c = model.config
    W = {name: p.detach().double() for name, p in model.named_parameters()}
    B, T = idx.shape
    H, KV, D = c.n_head, c.n_kv_head, c.n_embd // c.n_head
    x = rms(W["wte.weight"][idx])
    gate = W["smear_lambda"] * torch.sigmoid(x[:, 1:, :24] @ W["smear_gate.weight"].T)
    x = torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)  # x[t] += g x[t-1], t >= 1
    x0 = x
    for i in range(c.n_layer):
        w = lambda name, i=i: W[f"blocks.{i}.{name}.weight"].T
        x = W["resid_lambdas"][i] * x + W["x0_lambdas"][i] * x0
        h = rms(x)
        q, k, v = (h @ w(f"attn.c_{n}") for n in "qkv")
        q, k, v = q.view(B, T, H, D), k.view(B, T, KV, D), v.view(B, T, KV, D)
        if f"value_embeds.{i}.weight" in W:
            gate = 3 * torch.sigmoid(h[..., :12] @ w("attn.ve_gate"))  # (B, T, KV)
            v = v + gate[..., None] * W[f"value_embeds.{i}.weight"][idx].view(B, T, KV, D)
        q, k = (qk_scale * rms(rotate(t, rope_base)) for t in (q, k))
        x = x + attend(q, k, v, windows[i]).reshape(B, T, -1) @ w("attn.c_proj")
        x = x + torch.relu(rms(x) @ w("mlp.c_fc")).square() @ w("mlp.c_proj")
        if i == c.n_layer // 2:
            middle = x
    x = x - W["backout_lambda"] * middle
    logits = 15 * torch.tanh(rms(x) @ W["lm_head.weight"].T / 15)
    loss = -logits.log_softmax(-1).gather(-1, targets[..., None]).mean()
    return logits, loss


def scrambled_model(seed=0):
    """The tiny nanochat GPT with every weight random (output projections too, logits near the
    softcap) and the lambdas, gates and backout far from their init, so every piece matters."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**TINY_CONFIG))
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(std=(8.0 if "lm_head" in name else 1.0) / math.sqrt(p.shape[1]))
        model.value_embeds["2"].weight.mul_(4)  # comparable to v
        model.resid_lambdas.uniform_(0.6, 1.4)
        model.x0_lambdas.uniform_(0.1, 0.6)
        model.smear_lambda.fill_(0.8)
        model.backout_lambda.fill_(0.35)
    return model


def batch(T=256, B=2, vocab=61, seed=1):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, vocab, (B, T), generator=g) for _ in range(2))


def test_windows_masks_and_sdpa_are_the_formula():
    """window_sizes: S = ceil(seq / 4 / 128) x 128 keys back, the pattern tiled, the last layer L
    (None); window_mask(T, w)[i, j] = 0 <= i - j <= w; sdpa with a window equals attention with
    that explicit mask (GQA too)."""
    assert GPTConfig(**TINY_CONFIG).window_sizes() == TINY_WINDOWS
    c = config_from_depth(12, 32768, 2048, arch="nanochat")
    assert c.window_pattern == "SSSL"
    assert c.window_sizes() == [512, 512, 512, None] * 3
    assert config_from_depth(5, 9, 1000, arch="nanochat").window_sizes() == [256] * 3 + [None] * 2
    assert config_from_depth(6, 100, 64, arch="nanochat").window_sizes() == [None] * 6  # 128 >= 64
    for T, w in ((9, 3), (16, 0), (7, 6)):
        want = [[0 <= i - j <= w for j in range(T)] for i in range(T)]
        assert window_mask(T, w, "cpu").tolist() == want
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    for window in (None, 0, 5, 38, 39, 100):
        torch.testing.assert_close(sdpa(q, k, v, window), attend(q, k, v, window),
                                   rtol=0, atol=1e-12)


def test_forward_loss_is_the_float64_formula():
    """The fp32 forward of a tiny nanochat GPT (GQA, windows that cut the context, every weight
    and scalar set off its init) equals the float64 forward written out above: the logits and the
    mean loss within 1e-5 relative."""
    model = scrambled_model()
    assert model.config.rope_base == 100000.0
    assert [b.attn.window for b in model.blocks] == TINY_WINDOWS
    assert sorted(model.value_embeds.keys()) == ["0", "2", "4"]
    idx, targets = batch()
    want_logits, want_loss = reference_forward(model, idx, targets, TINY_WINDOWS)
    with torch.no_grad():
        logits, loss = model(idx), model(idx, targets)
    assert want_logits.abs().max() > 10  # the softcap bites
    assert (logits.double() - want_logits).abs().max() <= 1e-5 * want_logits.abs().max()
    assert relative(loss.item(), want_loss.item()) <= 1e-5, (loss.item(), want_loss.item())


def _no_windows(model):
    for block in model.blocks:
        block.attn.window = None
    return dict(windows=[None] * 5)


def _qk_scale_one(model):
    for block in model.blocks:
        block.attn.qk_scale = 1.0
    return dict(qk_scale=1.0)


def _set(name, value):
    def change(model):
        with torch.no_grad():
            getattr(model, name).fill_(value)
        return {}
    return change


def _no_value_embeddings(model):
    with torch.no_grad():
        for ve in model.value_embeds.values():
            ve.weight.zero_()
    return {}


def _closed_ve_gates(model):
    with torch.no_grad():
        for block in model.blocks:
            if block.attn.ve_gate is not None:
                block.attn.ve_gate.weight.zero_()  # gate 3 sigmoid(0) = 1.5
    return {}


@pytest.mark.parametrize("change", [
    _set("backout_lambda", 0.0), _set("smear_lambda", 0.0), _set("resid_lambdas", 1.0),
    _set("x0_lambdas", 0.0), _no_value_embeddings, _closed_ve_gates, _no_windows, _qk_scale_one],
    ids=["backout", "smear", "resid_lambdas", "x0_lambdas", "value_embeds", "ve_gate",
         "windows", "qk_scale"])
def test_each_piece_matters_and_still_matches(change):
    """Each piece turned off (or to its neutral value) moves the loss by over 2e-4 relative, and
    the model still equals the float64 forward with the same change."""
    model = scrambled_model()
    idx, targets = batch()
    with torch.no_grad():
        before = model(idx, targets).item()
        ref = dict(windows=TINY_WINDOWS) | change(model)
        after = model(idx, targets).item()
    want = reference_forward(model, idx, targets, **ref)[1].item()
    assert relative(after, before) > 2e-4, (after, before)
    assert relative(after, want) <= 1e-5, (after, want)


def test_rope_base_and_classic_differ():
    """The rotary tables are cos and sin of t base^(-2j/D) for base 100,000 (nanochat) and
    10,000 (classic); the float64 forward with the classic base does not match the model."""
    for arch, base in (("nanochat", 100000.0), ("classic", 10000.0)):
        c = dict(TINY_CONFIG, arch=arch, window_pattern="SSSL" if arch == "nanochat" else "L")
        model = GPT(GPTConfig(**c))
        model.init_weights()
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(1, 256, 1, 8, dtype=torch.float64, generator=gen)
        got = x * model.cos.double() + x.roll(4, dims=-1) * model.sin.double()
        torch.testing.assert_close(got, rotate(x, base), rtol=0, atol=1e-4)
    model = scrambled_model()
    idx, targets = batch()
    with torch.no_grad():
        loss = model(idx, targets).item()
    wrong = reference_forward(model, idx, targets, TINY_WINDOWS, rope_base=10000.0)[1].item()
    assert relative(loss, wrong) > 1e-3


def uniform_bound(t, bound):
    """t looks like uniform(-bound, bound): inside, near both ends, std bound / sqrt(3)."""
    assert t.abs().max() <= bound and t.max() > 0.98 * bound and t.min() < -0.98 * bound
    assert abs(t.std().item() - bound / math.sqrt(3)) < 0.03 * bound / math.sqrt(3)
    assert abs(t.mean().item()) < 0.03 * bound


def test_init_is_nanochats():
    """wte ~ N(0, 0.8); lm_head ~ N(0, 0.001); c_q, c_k, c_v and the value embeddings uniform at
    std 1/sqrt(n_embd), c_fc at 0.4x; the output projections zero; resid_lambdas 1.15 - 0.10 i /
    (L - 1) and x0_lambdas 0.20 - 0.15 i / (L - 1), each the float32 nearest the formula; smear
    0, backout 0.2; smear and value-embedding gates uniform(0, 0.02)."""
    torch.manual_seed(0)
    model = GPT(config_from_depth(6, 4096, 256, aspect_ratio=64, head_dim=64, arch="nanochat"))
    model.init_weights()
    d, L = model.config.n_embd, model.config.n_layer
    assert (d, L) == (384, 6)
    assert abs(model.wte.weight.std().item() - 0.8) < 0.01
    assert abs(model.lm_head.weight.std().item() - 0.001) < 1e-5
    bound = math.sqrt(3 / d)
    for block in model.blocks:
        for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v):
            uniform_bound(lin.weight, bound)
        uniform_bound(block.mlp.c_fc.weight, 0.4 * bound)
        assert not block.attn.c_proj.weight.any() and not block.mlp.c_proj.weight.any()
    assert sorted(model.value_embeds.keys(), key=int) == ["1", "3", "5"]
    for ve in model.value_embeds.values():
        uniform_bound(ve.weight, bound)
    exact = lambda values: torch.tensor(values, dtype=torch.float64).float()
    assert torch.equal(model.resid_lambdas.data, exact([1.15 - 0.10 * i / 5 for i in range(L)]))
    assert torch.equal(model.x0_lambdas.data, exact([0.20 - 0.15 * i / 5 for i in range(L)]))
    assert model.smear_lambda.item() == 0.0 and model.backout_lambda.item() == exact([0.2]).item()
    gates = [model.smear_gate.weight] + [b.attn.ve_gate.weight for b in model.blocks
                                         if b.attn.ve_gate is not None]
    assert [tuple(g.shape) for g in gates] == [(1, 24)] + [(6, 12)] * 3
    gates = torch.cat([g.flatten() for g in gates])
    assert gates.min() >= 0 and gates.max() <= 0.02 and abs(gates.mean().item() - 0.01) < 0.002
    one = GPT(GPTConfig(**dict(TINY_CONFIG, n_layer=1)))
    one.init_weights()  # a single layer: i / max(L - 1, 1)
    assert (one.resid_lambdas.item(), one.x0_lambdas.item()) == (exact([1.15]).item(),
                                                                 exact([0.20]).item())


def written_out_counts(depth):
    """(params, scaling params, FLOPs per token) of nanochat's GPT at vocab 32768, 2048 tokens,
    aspect 64, head dim 128, from its shapes."""
    V, T = 32768, 2048
    d = math.ceil(depth * 64 / 128) * 128
    heads = d // 128
    ve_layers = list(range(depth - 1, -1, -2))  # every other layer down from the last
    # c_q, c_k, c_v, c_proj (n_kv_head = n_head: all d x d), c_fc, mlp c_proj, and the ve gates
    blocks = depth * (4 * d * d + 8 * d * d) + len(ve_layers) * heads * 12
    total = blocks + 2 * V * d + len(ve_layers) * V * d + 2 * depth + 24 + 1 + 1
    short = math.ceil(T / 4 / 128) * 128
    keys = sum(T if i % 4 == 3 or i == depth - 1 else short for i in range(depth))
    flops = 6 * (blocks + V * d + 24) + 12 * d * keys
    return total, blocks + V * d, flops


@pytest.mark.parametrize("depth", [4, 12, 24])
def test_param_count_and_flops(depth):
    """num_params, num_scaling_params (blocks + lm_head) and estimate_flops (6 x every linear
    weight + 12 x width x each layer's keys) on the meta device equal the counts from the shapes;
    d12 is nanochat's 286.3M."""
    with torch.device("meta"):
        model = GPT(config_from_depth(depth, 32768, 2048, arch="nanochat"))
    total, scaling, flops = written_out_counts(depth)
    assert model.num_params() == total
    assert model.num_scaling_params() == scaling
    assert model.estimate_flops() == flops
    if depth == 12:
        assert round(total / 1e6, 1) == 286.3


def test_optimizer_groups_are_nanochats():
    """Each AdamW group's params, lr (embedding-like ones x (n_embd / 768)^-0.5), betas, eps and
    weight decay as in nanochat's table; the Muon group holds every block param (the value
    embedding gates too) with nanochat's recipe; each param in exactly one group."""
    torch.manual_seed(0)
    model = GPT(config_from_depth(3, 97, 64, aspect_ratio=64, head_dim=64, arch="nanochat"))
    model.init_weights()
    opt = model.setup_optimizer(Variant(weight_decay=0.28), LRS)
    assert type(opt) is MuonAdamW
    s = (model.config.n_embd / 768) ** -0.5
    assert model.config.n_embd == 192
    ve = [model.value_embeds[k].weight for k in ("0", "2")]
    smear = [model.smear_gate.weight, model.smear_lambda, model.backout_lambda]
    want = {  # name: (params, lr, betas, weight decay)
        "lm_head": ([model.lm_head.weight], 0.008 * s, (0.8, 0.96), 0.01),
        "embedding": ([model.wte.weight], 0.3 * s, (0.8, 0.995), 0.001),
        "value_embeds": (ve, 0.3 * s * 0.5, (0.8, 0.995), 0.01),
        "resid_lambdas": ([model.resid_lambdas], 0.5 * 0.01, (0.8, 0.95), 0.05),
        "x0_lambdas": ([model.x0_lambdas], 0.5, (0.96, 0.95), 0.0),
        "smear": (smear, 0.2, (0.8, 0.95), 0.0),
    }
    groups = {g["name"]: g for g in opt.param_groups}
    assert list(groups) == [*want, "matrices"]
    for name, (params, lr, betas, decay) in want.items():
        g = groups[name]
        assert g["kind"] == "adamw" and g["eps"] == 1e-10, name
        assert [id(p) for p in g["params"]] == [id(p) for p in params], name
        assert g["lr"] == g["initial_lr"] == pytest.approx(lr, rel=1e-12), name
        assert tuple(g["betas"]) == betas and g["weight_decay"] == decay, name
    muon = groups["matrices"]
    assert {id(p) for p in muon["params"]} == {id(p) for p in model.blocks.parameters()}
    assert all(id(b.attn.ve_gate.weight) in {id(p) for p in muon["params"]}
               for b in (model.blocks[0], model.blocks[2]))
    assert model.blocks[1].attn.ve_gate is None
    assert (muon["kind"], muon["lr"], muon["momentum"], muon["ns_steps"], muon["beta2"],
            muon["weight_decay"]) == ("muon", 0.02, 0.95, 5, 0.9, 0.28)
    assert tuple(muon["precondition"]) == ("equilibrate_row_mean",)
    assert tuple(muon["post_process"]) == ("normalize_fro", "variance_reduction")
    assert (muon["nesterov"], muon["apply"], muon["lr_scale"], muon["ns_coefficients"]) == (
        True, "cautious", "shape", "polar_express")
    assert COEFFICIENT_SETS["polar_express"][1:] == (1.01, 1e-6)
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    with pytest.raises(ValueError, match="adam_betas"):
        model.setup_optimizer(Variant(adam_betas=(0.9, 0.95)), LRS)


def test_equilibrate_row_mean_is_the_formula():
    """reference.py's float64 'equilibrate_row_mean' and stages.py's equilibrate_to_mean (on a
    stack) scale each row to the mean row norm ||G||_F / sqrt(rows), a row norm floored at 1e-6."""
    g = torch.Generator().manual_seed(0)
    stack = torch.randn(3, 7, 5, generator=g, dtype=torch.float64)
    stack[1, 2] = 0.0  # a zero row stays zero
    stack[2, 4] *= 1e-9  # a row below the floor is scaled by target / 1e-6
    want = []
    for u in stack:
        row = u.norm(dim=1, keepdim=True)
        target = u.square().sum().sqrt() / math.sqrt(u.shape[0])
        want.append(u * target / row.clamp(min=1e-6))
    want = torch.stack(want)
    assert (want[0].norm(dim=1) - stack[0].norm() / math.sqrt(7)).abs().max() < 1e-12
    to_mean = reference._builtin("equilibrate_row_mean")
    torch.testing.assert_close(torch.stack([to_mean(u) for u in stack]), want, rtol=1e-14, atol=0)
    torch.testing.assert_close(equilibrate_to_mean(stack, None), want, rtol=1e-14, atol=0)


def nanochat_step(p, g, st, lr, wd, momentum, beta2):
    """nanochat's fused Muon step on one matrix in float64, written out: Nesterov momentum, rows
    to their mean norm, Polar Express at norm 1.01, Frobenius norm to sqrt(min(rows, cols)),
    variance reduction, cautious weight decay at lr x sqrt(max(1, rows / cols))."""
    rows, cols = p.shape
    st["m"] = momentum * st.get("m", 0) + (1 - momentum) * g
    u = (1 - momentum) * g + momentum * st["m"]
    u = u * (u.norm() / rows ** 0.5) / u.norm(dim=1, keepdim=True).clamp_min(1e-6)
    X = (u if rows <= cols else u.T) / (1.01 * u.norm() + 1e-6)
    for a, b, c in POLAR_EXPRESS:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    o = X if rows <= cols else X.T
    o = o * min(rows, cols) ** 0.5 / o.norm()
    v = o.square().mean(dim=1 if rows >= cols else 0, keepdim=True)
    st["v"] = beta2 * st.get("v", 0) + (1 - beta2) * v
    scaled = o / st["v"].clamp_min(1e-10).sqrt()
    o = scaled * o.norm() / scaled.norm()
    lr = lr * max(1.0, rows / cols) ** 0.5
    return p - lr * o - lr * wd * p * (o * p >= 0)


def test_a_muon_step_of_the_recipe_is_the_float64_reference():
    """MuonAdamW with the nanochat recipe's Muon group (arch.param_groups' matrices) on tall, wide
    and square matrices (two of one shape: a stack) equals reference.muon_step over 3 steps; the
    reference with that group is nanochat's step written out."""
    groups = param_groups(GPT(GPTConfig(**TINY_CONFIG)), Variant(weight_decay=0.2),
                          peak_lrs(2 ** 19, matrix_lr=0.02))
    recipe = {k: v for k, v in groups[-1].items() if k != "params"}
    assert recipe["name"] == "matrices"
    gen = torch.Generator().manual_seed(0)
    shapes = [(24, 10), (24, 10), (10, 24), (16, 16)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64) * 0.3)
              for s in shapes]
    # Newton-Schulz in fp32: this CPU's 'auto' may be bf16
    opt = MuonAdamW([dict(recipe, params=params, ns_precision="fp32")])
    start = [p.detach().clone() for p in params]
    ref, written = list(start), list(start)
    states, written_states = [{} for _ in params], [{} for _ in params]
    for _ in range(3):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):
            ref[i] = muon_step(ref[i], g, states[i], recipe)
            written[i] = nanochat_step(written[i], g, written_states[i], 0.02, 0.2, 0.95, 0.9)
            torch.testing.assert_close(ref[i], written[i], rtol=0, atol=1e-12)
    for p, s, want in zip(params, start, ref):
        assert (want - s).abs().max() > 0.01  # large against the tolerance
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-6)


def want_momentum(step, n, ratio):
    """nanochat's Muon momentum: 0.85 -> 0.97 linearly over steps 0..400, which wins; then 0.97,
    down to 0.90 linearly from the warmdown's start (n - round(ratio n)) to step n."""
    if step < 400:
        return 0.85 + (0.97 - 0.85) * step / 400
    start = n - round(ratio * n)
    return 0.97 if step < start else 0.97 + (0.90 - 0.97) * (step - start) / (n - start)


@pytest.mark.parametrize("n, ratio", [(50, 0.65), (120, 0.4), (399, 0.65), (400, 0.5),
                                      (1000, 0.65), (1000, 0.0), (5000, 0.4), (3000, 1.0)])
def test_momentum_and_weight_decay_schedules(n, ratio):
    """Each arch's momentum and weight_decay schedules (Arch) at every step (a grid for long runs) against the
    written-out schedules: nanochat's (the step < 400 warmup winning in short runs; weight decay
    peak cos^2(pi step / 2n)) and classic's (0.85 -> 0.95 over 300 steps; constant decay)."""
    steps = sorted(set(range(0, n + 1, max(1, n // 97))) | {0, 299, 300, 399, 400, n - 1, n})
    steps = [s for s in steps if s <= n and (ratio > 0 or s < n)]
    for step in steps:
        got = ARCHS["nanochat"].momentum(step, n, ratio)
        assert got == pytest.approx(want_momentum(step, n, ratio), abs=1e-12), step
        assert ARCHS["nanochat"].weight_decay(step, n, 0.28) == pytest.approx(
            0.28 * math.cos(math.pi * step / (2 * n)) ** 2, abs=1e-12)
        classic = 0.85 + 0.10 * min(step, 300) / 300
        assert ARCHS["classic"].momentum(step, n, ratio) == pytest.approx(classic, abs=1e-12)
        assert ARCHS["classic"].weight_decay(step, n, 0.28) == 0.28
    if n < 400:  # a short run never leaves the warmup
        assert all(ARCHS["nanochat"].momentum(s, n, ratio) < 0.97 for s in range(n))


# -- data parallel, batched seeds, resume -----------------------------------------------------


def dist_model():
    torch.manual_seed(0)
    model = GPT(config_from_depth(3, 97, 256, aspect_ratio=32, head_dim=32, arch="nanochat"))
    model.init_weights()
    with torch.no_grad():  # off the init: every group gets gradients that matter
        for block in model.blocks:
            block.attn.c_proj.weight.normal_(std=0.05)
            block.mlp.c_proj.weight.normal_(std=0.05)
        model.smear_lambda.fill_(0.5)
    return model


def _dist_worker(rank, world_size, steps, weight_decay, atol, rtol_fro, adamw_eps=None):
    model = dist_model()
    ref = copy.deepcopy(model)
    variant = Variant(weight_decay=weight_decay, muon_options=dict(ns_precision="fp32"))
    opt = model.setup_optimizer(variant, LRS)
    ref_opt = ref.setup_optimizer(variant._replace(optimizer_class=MuonAdamW), LRS)
    assert type(opt) is DistMuonAdamW and type(ref_opt) is MuonAdamW
    for g in (g for o in (opt, ref_opt) for g in o.param_groups if g["kind"] == "adamw"):
        g["eps"] = g["eps"] if adamw_eps is None else adamw_eps
    rows = 2
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(steps):
        idx, targets = batch(T=256, B=rows * world_size, vocab=97, seed=100 + step)
        mine = slice(rank * rows, (rank + 1) * rows)
        model(idx[mine], targets[mine]).backward()
        opt.step()
        for r in range(world_size):  # the mean of the ranks' gradients, in one process
            part = slice(r * rows, (r + 1) * rows)
            (ref(idx[part], targets[part]) / world_size).backward()
        ref_opt.step()
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        assert_replicated_tensors(list(model.parameters()))
        for (name, p), q, s in zip(model.named_parameters(), ref.parameters(), start):
            torch.testing.assert_close(p, q, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
            assert (p - q).norm() <= rtol_fro * (q - s).norm(), (name, step)
    for (name, p), s in zip(model.named_parameters(), start):
        assert not torch.equal(p, s), f"{name} never moved"


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.heavy)])
def test_data_parallel_equals_one_process(world_size):
    """DistMuonAdamW on every group of the nanochat arch (gloo; each rank its own rows) against
    MuonAdamW in one process on the mean gradient, after each of 3 steps, the ranks bitwise
    identical and every param moved. World 2: the full recipe within 2e-5 (bitwise here: a mean
    of two is exact). World 3: a mean of three rounds, and the recipe amplifies rounding where
    it is discontinuous or divides by a cancelled sum: cautious decay flips its mask where an
    update crosses zero (lr x wd x p at once), AdamW normalizes a gradient element that cancels
    to near zero. So Muon's weight decay is 0 there (the AdamW groups keep theirs), AdamW's eps
    is torch's 1e-8, not the recipe's 1e-10 (at 1e-10 an embedding element whose gradient
    cancels to rounding noise steps a whole lr either way: seen on an AMX Xeon, 1.2x the bound),
    and each param is held to 1e-3 of how far it moved (Frobenius; 8e-5 measured) and 3% of
    AdamW's largest lr per element."""
    if world_size == 2:
        spawn(_dist_worker, 2, 3, 0.2, 2e-5, 1e-4)
    else:
        embedding_lr = LRS.embedding_lr * (96 / 768) ** -0.5  # dist_model's width: 96
        spawn(_dist_worker, 3, 3, 0.0, 0.03 * embedding_lr, 1e-3, 1e-8)


# depth 4 (at 2, backout would take the last layer's output, which the final norm makes a
# no-op: its lambda's gradient is rounding noise), 256 tokens: the first 3 layers' window of 128
# cuts the context. The CPU's windowed kernel (chunked) on both sides: batched seeds fold theirs
# into its batch (nanomuon.attention's choices have tests of their own)
FLAGS = [*TINY, "--depth", "4", "--aspect-ratio", "16", "--max-seq-len", "256",
         "--device-batch-size", "2", "--total-batch-size", "512", "--eval-tokens", "512",
         "--num-iterations", "4", "--eval-every", "2", "--final-eval-tokens", "1024",
         "--dtype", "fp32", "--no-compile", "--arch", "nanochat", "--attention", "chunked"]


@pytest.mark.heavy
def test_batched_seeds_train_as_their_own_runs(base, monkeypatch):
    """--arch nanochat with --seeds 1,2 against each seed alone: the same final val bpb, final
    eval and val history within 1e-4 relative (test_seeds' tolerance). Newton-Schulz in fp32, as
    on CPUs without bf16 units: in bf16 (this CPU's 'auto') a stack of two seeds' matrices rounds
    otherwise than one seed's, about 1e-2 of each update: the bpb drifted 2e-4 in 6 steps (5e-7
    in fp32)."""
    from scripts.base_train import main

    monkeypatch.setattr(stages, "bf16_matmuls_fast", lambda device: False)
    main([*FLAGS, "--seeds", "1,2", "--run", "nc-batched"])
    batched = summary(base, "nc-batched")
    assert batched["seeds"] == [1, 2]
    each_seed_is_its_own_run(base, FLAGS, batched, "nc")
    assert batched["per_seed"]["1"]["final_val_bpb"] != batched["per_seed"]["2"]["final_val_bpb"]


def test_a_resumed_run_continues_bit_for_bit(base):
    """A nanochat-arch run saved at step 2, resumed from there by another main(), saves at step 4
    bitwise what the unbroken run saved (model and optimizer state): its momentum and weight-decay
    schedules and every AdamW group's own betas and decay carry over."""
    from nanomuon.checkpoint import load_checkpoint
    from scripts.base_train import main

    flags = [*FLAGS, "--save-every", "2", "--keep-checkpoints", "-1", "--run", "nc-resumed"]
    run_dir, names = base / "runs" / "nc-resumed", ("model", "optim")
    main(flags)
    whole, _ = load_checkpoint(run_dir, 4, names)
    (run_dir / "step_000004").rename(base / "nc-spare")
    main([*flags, "--resume-from-step", "2"])
    resumed, _ = load_checkpoint(run_dir, 4, names)
    assert "value_embeds.1.weight" in whole["model"] and "backout_lambda" in whole["model"]
    assert_bitwise_equal(whole, resumed, "step 4")
    groups = {g["name"]: g for g in resumed["optim"]["param_groups"]}
    assert tuple(groups["x0_lambdas"]["betas"]) == (0.96, 0.95)
    # the last step's (3 of 4; the CPU recipe's warmdown ratio 0.4)
    assert groups["matrices"]["momentum"] == pytest.approx(want_momentum(3, 4, 0.4), abs=1e-15)
    # the CPU rule's peak 0.2 on the cosine, at step 3 of 4; the AdamW groups keep their own
    wd = 0.2 * math.cos(math.pi * 3 / 8) ** 2
    assert groups["matrices"]["weight_decay"] == pytest.approx(wd, abs=1e-15)
    assert groups["lm_head"]["weight_decay"] == 0.01
    assert groups["resid_lambdas"]["weight_decay"] == 0.05
