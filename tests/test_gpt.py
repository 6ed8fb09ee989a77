"""The GPT: sizing, shapes, causality, rotary, init, FLOPs against torch's flop counter, optimizer groups
and the default lrs they take from the lr rule, the fused softcap loss, QK-clip, attention kernels."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_recipe import NANOCHAT_AT_2_19, TUNED_AT_4096
from torch.utils.flop_counter import FlopCounterMode

from nanomuon.arch import Variant
from nanomuon.gpt import GPT, GPTConfig, apply_rotary, config_from_depth
from nanomuon.optim import DistMuonAdamW, MuonAdamW
from nanomuon.recipe import PeakLRs, peak_lrs
from nanomuon.variants import OPTIMIZER_VARIANTS


def small_model(seq_len=32, vocab=97, depth=2, seed=0, arch="classic"):
    torch.manual_seed(seed)
    model = GPT(config_from_depth(depth, vocab, seq_len, aspect_ratio=32, head_dim=16, arch=arch))
    model.init_weights()
    return model


def test_sizing_follows_depth():
    c = config_from_depth(20, 32768, 2048)
    assert (c.n_embd, c.n_head, c.n_layer) == (1280, 10, 20)
    c = config_from_depth(4, 4096, 256)  # 4 * 64 = 256 = 2 heads of 128
    assert (c.n_embd, c.n_head) == (256, 2)
    c = config_from_depth(3, 100, 16, aspect_ratio=64, head_dim=128)  # 192 rounds up to 256
    assert c.n_embd == 256
    with pytest.raises(ValueError, match="head_dim"):
        config_from_depth(2, 100, 16, head_dim=3)
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_embd=100, n_head=3, n_kv_head=3)


def test_shapes_and_param_count():
    model = small_model()
    c = model.config
    d, V, L = c.n_embd, c.vocab_size, c.n_layer
    assert model.num_params() == 2 * V * d + L * (4 * d * d + 8 * d * d)  # no biases, no norm weights
    x = torch.randint(0, V, (3, 20))
    assert model(x).shape == (3, 20, V)
    assert model(x, x, loss_reduction="none").shape == (3, 20)
    assert model(x, x).dim() == 0
    with pytest.raises(ValueError, match="sequence_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_causal():
    model = small_model()
    x = torch.randint(0, 97, (2, 24))
    for block in model.blocks:  # non-zero output projections, so every block matters
        torch.nn.init.normal_(block.attn.c_proj.weight, std=0.05)
        torch.nn.init.normal_(block.mlp.c_proj.weight, std=0.05)
    base = model(x)
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 97
    changed = model(y)
    assert torch.equal(base[:, :10], changed[:, :10])
    assert not torch.allclose(base[:, 10:], changed[:, 10:])


def test_rotary_scores_depend_on_relative_position_only():
    model = small_model(seq_len=64)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m, n):
        qm = apply_rotary(q, model.cos[:, m:m + 1], model.sin[:, m:m + 1])
        kn = apply_rotary(k, model.cos[:, n:n + 1], model.sin[:, n:n + 1])
        return (qm * kn).sum().item()

    assert score(5, 2) == pytest.approx(score(40, 37), abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)
    # rotation preserves the norm
    assert apply_rotary(q, model.cos[:, 9:10], model.sin[:, 9:10]).norm().item() == pytest.approx(q.norm().item())


def test_init_makes_blocks_identity_and_logits_flat():
    model = small_model()
    x = torch.randint(0, 97, (2, 16))
    h = F.rms_norm(model.wte(x), (model.config.n_embd,))
    expected = model.lm_head(F.rms_norm(h, (model.config.n_embd,)))
    expected = 15 * torch.tanh(expected / 15)
    torch.testing.assert_close(model(x), expected)
    loss = model(x, x).item()
    assert abs(loss - math.log(97)) < 0.05  # near-uniform predictions at init


def test_estimate_flops_matches_torch_flop_counter(monkeypatch):
    # torch's counter does not see inside CPU SDPA, so count attention through explicit matmuls
    def explicit_attention(q, k, v, is_causal=False, enable_gqa=False):
        T = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return scores.softmax(-1) @ v

    monkeypatch.setattr(F, "scaled_dot_product_attention", explicit_attention)
    model = small_model(seq_len=32)
    B, T = 2, model.config.sequence_len
    x = torch.randint(0, 97, (B, T))
    with FlopCounterMode(display=False) as counter:
        model(x, x).backward()
    counted = counter.get_total_flops() / (B * T)
    assert counted == pytest.approx(model.estimate_flops(), rel=1e-6)


def test_setup_optimizer_groups():
    model = small_model()
    opt = model.setup_optimizer(lrs=peak_lrs(2 ** 19, embedding_lr=0.2, unembedding_lr=0.004,
                                             matrix_lr=0.02))
    assert isinstance(opt, MuonAdamW) and not isinstance(opt, DistMuonAdamW)
    groups = {g["name"]: g for g in opt.param_groups}
    muon = {id(p) for p in groups["matrices"]["params"]}
    for name, p in model.named_parameters():
        if name.startswith("blocks."):
            assert id(p) in muon, name
    assert groups["embedding"]["params"] == [model.wte.weight]
    assert groups["lm_head"]["params"] == [model.lm_head.weight]
    scale = (model.config.n_embd / 768) ** -0.5
    assert groups["embedding"]["lr"] == pytest.approx(0.2 * scale)
    assert groups["lm_head"]["lr"] == pytest.approx(0.004 * scale)
    assert groups["matrices"]["lr"] == 0.02
    assert all(g["initial_lr"] == g["lr"] for g in opt.param_groups)
    x = torch.randint(0, 97, (2, 16))
    before = model(x, x).item()
    for _ in range(5):
        model(x, x).backward()
        opt.step()
        model.zero_grad(set_to_none=True)
    assert model(x, x).item() < before




def test_setup_optimizer_applies_the_multiplier_once():
    """A PeakLRs is each group's lr at width 768 and one multiplier: every group's lr and
    initial_lr are its role's lr x width scale (AdamW's but the scalars') x the multiplier, once;
    a variant's own lr wins over the PeakLRs' and takes the multiplier too."""
    model = small_model()
    lrs = PeakLRs(embedding_lr=0.2, unembedding_lr=0.004, matrix_lr=0.02, adamw_matrix_lr=0.001,
                  scalar_lr=0.5, multiplier=0.25)
    scale = (model.config.n_embd / 768) ** -0.5
    want = dict(embedding=0.2 * scale * 0.25, lm_head=0.004 * scale * 0.25, matrices=0.02 * 0.25,
                scalars=0.5 * 0.25)
    for variant, matrices in ((Variant(), want["matrices"]), (OPTIMIZER_VARIANTS["muon-per-head"], None),
                              (OPTIMIZER_VARIANTS["adamw"], 0.001 * scale * 0.25),
                              (Variant(lrs=dict(matrix_lr=0.03)), 0.03 * 0.25)):
        for g in model.setup_optimizer(variant, lrs).param_groups:
            name = "matrices" if g["name"].startswith("matrices") else g["name"]
            expected = want[name] if matrices is None or name != "matrices" else matrices
            assert g["initial_lr"] == g["lr"] == pytest.approx(expected, rel=1e-12), g["name"]


def test_roles_give_each_role_its_own_lr_and_decay():
    """roles=: each role named gets its matrices in a Muon group of its own, its lr and decay the
    matrix group's times its factors (the multiplier once), head by head too; the other matrices
    keep the matrix group's. In a step a role at lr 0 and decay 0 does not move while every other
    matrix does. An unknown role, an unknown key or a bad number is refused in one line."""
    model = small_model()
    lrs = PeakLRs(embedding_lr=0.2, unembedding_lr=0.004, matrix_lr=0.02, adamw_matrix_lr=0.001,
                  scalar_lr=0.5, multiplier=0.5)
    roles = {"mlp.fc": dict(lr_factor=0.0, weight_decay_factor=0.0),
             "attn.qkv": dict(lr_factor=2.0, weight_decay_factor=0.25)}
    opt = model.setup_optimizer(Variant(weight_decay=0.2, roles=roles), lrs)
    groups = {g["name"]: g for g in opt.param_groups}
    attn, mlp = [b.attn for b in model.blocks], [b.mlp for b in model.blocks]
    members = {name: {id(p) for p in groups[name]["params"]} for name in groups}
    assert members["matrices, attn.qkv"] == {id(lin.weight) for a in attn
                                             for lin in (a.c_q, a.c_k, a.c_v)}
    assert members["matrices, mlp.fc"] == {id(m.c_fc.weight) for m in mlp}
    assert members["matrices"] == {id(w) for a, m in zip(attn, mlp)
                                   for w in (a.c_proj.weight, m.c_proj.weight)}
    for name, lr, decay in (("matrices, attn.qkv", 0.02, 0.05), ("matrices, mlp.fc", 0.0, 0.0),
                            ("matrices", 0.01, 0.2)):
        g = groups[name]
        assert g["lr"] == g["initial_lr"] == pytest.approx(lr, rel=1e-12), name
        assert g["weight_decay"] == g["initial_weight_decay"] == decay, name
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, 97, (2, 16))
    model(x, x).backward()
    opt.step()
    for n, p in model.named_parameters():
        if n.startswith("blocks.") and p.ndim == 2:
            assert torch.equal(p, before[n]) == (".mlp.c_fc." in n), n
    heads = {g["name"] for g in model.setup_optimizer(Variant(per_head=True, roles=roles)).param_groups}
    assert "matrices, 4 heads, attn.qkv" in heads and "matrices, mlp.fc" in heads, heads
    for bad, says in (({"attn.o": {}}, r"roles: \['attn.o'\] names no role here; "
                                        r"this model's roles are \['lm_head', 'embedding', "
                                        r"'attn.qkv', 'attn.proj', 'mlp.fc', 'mlp.proj'\]$"),
                      ({"mlp.fc": dict(weight_decay=0.1)}, r"roles\['mlp.fc'\]: \['weight_decay'\] is "
                                                           r"not a key of kind 'muon': its roles take \["),
                      ({"lm_head": dict(ns_steps=3)}, r"\['ns_steps'\] is not a key of kind 'adamw': "
                                                      r"its roles take \['betas', 'eps', 'kind', 'lr_factor', "
                                                      r"'momentum', 'weight_decay_factor'\]"),
                      ({"lm_head": dict(kind="sgd")}, r"roles\['lm_head'\]=\{'kind': 'sgd'\}: give a dict "
                                                      r"with kind 'muon', 'adamw' or one of kinds.KINDS \['lion', "),
                      ({"mlp.fc": dict(lr_factor=-1.0)}, r"must be numbers, each in \[0, 1000\); got \[-1.0, 1.0\]"),
                      (["mlp.fc"], r"roles=\['mlp.fc'\]: give a dict of role -> dict")):
        with pytest.raises(ValueError, match=says):
            model.setup_optimizer(Variant(roles=bad))


def test_any_role_takes_any_update_by_its_name():
    """roles= reaches every group: lm_head and the embedding turned Muon with another
    orthogonalizer start from the matrix group's Muon (its lr, decay and muon_options, the
    embedding transposed), a matrix role turned AdamW from matrix_optimizer='adamw''s group, an
    AdamW role kept AdamW from its own; each times its factors, the multiplier once. Under an
    AdamW baseline a role is reachable too. A 1-D scalar turned Muon, and a role the arch lacks,
    are refused in one line."""
    model = small_model()
    lrs = PeakLRs(embedding_lr=0.2, unembedding_lr=0.004, matrix_lr=0.02, adamw_matrix_lr=0.001,
                  scalar_lr=0.5, multiplier=0.5)
    scale = (model.config.n_embd / 768) ** -0.5
    roles = {"lm_head": dict(kind="muon", orthogonalizer="sign", lr_scale="one", extra_scale=10.0,
                             lr_factor=2.0),
             "embedding": dict(kind="muon", orthogonalizer="col_norm", weight_decay_factor=0.5),
             "mlp.fc": dict(kind="adamw", betas=(0.9, 0.99), lr_factor=3.0)}
    variant = Variant(weight_decay=0.2, roles=roles, muon_options=dict(nesterov=False, apply="decoupled"))
    opt = model.setup_optimizer(variant, lrs)
    groups = {g["name"]: g for g in opt.param_groups}
    assert [g["name"] for g in opt.param_groups] == ["lm_head", "embedding", "matrices",
                                                     "matrices, mlp.fc"]
    want = {"lm_head": ("muon", 0.02 * 2 * 0.5, 0.2, False, "sign"),
            "embedding": ("muon", 0.02 * 0.5, 0.1, True, "col_norm"),
            "matrices": ("muon", 0.02 * 0.5, 0.2, False, "auto")}
    for name, (kind, lr, decay, transposed, orthogonalizer) in want.items():
        g = groups[name]
        assert (g["kind"], g["transposed"], g["orthogonalizer"], g["nesterov"], g["apply"]) == (
            kind, transposed, orthogonalizer, False, "decoupled"), name
        assert g["lr"] == g["initial_lr"] == pytest.approx(lr, rel=1e-12), name
        assert g["weight_decay"] == g["initial_weight_decay"] == pytest.approx(decay), name
    assert groups["lm_head"]["extra_scale"] == 10.0 and groups["lm_head"]["lr_scale"] == "one"
    fc = groups["matrices, mlp.fc"]
    assert (fc["kind"], fc["betas"], fc["weight_decay"]) == ("adamw", (0.9, 0.99), 0.0)
    assert fc["lr"] == pytest.approx(0.001 * scale * 3.0 * 0.5, rel=1e-12)
    assert {id(p) for p in fc["params"]} == {id(b.mlp.c_fc.weight) for b in model.blocks}
    x = torch.randint(0, 97, (2, 16))
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):  # the zero-initialized projections pass c_fc a gradient from the second on
        model(x, x).backward()
        opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    adamw = model.setup_optimizer(OPTIMIZER_VARIANTS["adamw"]._replace(
        roles={"lm_head": dict(lr_factor=4.0)}), lrs)
    head = next(g for g in adamw.param_groups if g["name"] == "lm_head")
    assert head["lr"] == pytest.approx(0.004 * scale * 4.0 * 0.5, rel=1e-12)
    torch.manual_seed(0)
    nanochat = GPT(config_from_depth(2, 97, 32, aspect_ratio=32, head_dim=16, arch="nanochat"))
    ve = nanochat.setup_optimizer(Variant(roles={"value_embeds": dict(kind="muon")})).param_groups
    assert next(g for g in ve if g["name"] == "value_embeds")["transposed"] is True
    with pytest.raises(ValueError, match=r"param group \d 'resid_lambdas' \(kind='muon'\), param 0: "
                                         r"shape \(2,\) has 1 dim\(s\); Muon needs matrices"):
        nanochat.setup_optimizer(Variant(roles={"resid_lambdas": dict(kind="muon")}))
    with pytest.raises(ValueError, match=r"this model's roles are \['lm_head', 'embedding', 'attn"):
        model.setup_optimizer(Variant(roles={"value_embeds": dict(kind="muon")}))


def lrs_of(model, variant=None, total_batch_size=2 ** 19, **given) -> dict:
    lrs = peak_lrs(total_batch_size, **given)
    return {g["name"]: g["lr"] for g in model.setup_optimizer(variant, lrs).param_groups}


@pytest.mark.parametrize("depth", [4, 6])  # widths 256 and 384, where the rule was checked
def test_default_lrs_follow_the_lr_rule(depth):
    """Every default lr is the lr rule's: the tuned lrs at 4,096 tokens per step, nanochat's at
    2^19, AdamW's growing with the batch in between while Muon's stays, AdamW's scaled as
    1/sqrt(width / 768) and Muon's not; a given lr wins over the rule."""
    model = GPT(config_from_depth(depth, 97, 16))
    scale = (model.config.n_embd / 768) ** -0.5
    at = {batch: lrs_of(model, total_batch_size=batch) for batch in (4096, 8192, 2 ** 19)}
    assert at[4096] == pytest.approx({k: TUNED_AT_4096[k] * (1 if k == "matrices" else scale)
                                      for k in ("embedding", "lm_head", "matrices")})
    adamw = lrs_of(model, OPTIMIZER_VARIANTS["adamw"], total_batch_size=4096)["matrices"]
    assert adamw == pytest.approx(TUNED_AT_4096["adamw_matrices"] * scale)
    default = {g["name"]: g["lr"] for g in model.setup_optimizer().param_groups}
    assert default == at[2 ** 19]  # setup_optimizer's default batch is the GPU's
    for name in ("embedding", "lm_head", "matrices"):
        want = NANOCHAT_AT_2_19[name] * (1 if name == "matrices" else scale)
        assert at[2 ** 19][name] == pytest.approx(want, rel=1e-12), name
    for name in ("embedding", "lm_head"):
        assert at[4096][name] < at[8192][name] < at[2 ** 19][name]
    assert at[4096]["matrices"] == at[8192]["matrices"] == at[2 ** 19]["matrices"]
    given = lrs_of(model, embedding_lr=0.1, matrix_lr=0.03)
    assert given["embedding"] == pytest.approx(0.1 * scale) and given["matrices"] == 0.03
    assert given["lm_head"] == at[2 ** 19]["lm_head"]


def test_setup_optimizer_is_distributed_under_a_process_group():
    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        assert isinstance(small_model().setup_optimizer(), DistMuonAdamW)
    finally:
        dist.destroy_process_group()


def test_generate_greedy_is_deterministic():
    model = small_model()
    a = list(model.generate([1, 2, 3], 10, temperature=0.0))
    b = list(model.generate([1, 2, 3], 10, temperature=0.0))
    assert a == b and len(a) == 10
    s1 = list(model.generate([1, 2, 3], 10, temperature=1.0, top_k=5, seed=1))
    s2 = list(model.generate([1, 2, 3], 10, temperature=1.0, top_k=5, seed=1))
    assert s1 == s2
    # greedy equals argmax of a plain forward
    logits = model(torch.tensor([[1, 2, 3]]))[0, -1]
    assert a[0] == logits.argmax().item()


def softcap_loss_float64(logits, targets, cap, reduction):
    """The loss as written in the paper trail: softcap with tanh, then cross-entropy, in float64 autograd."""
    return F.cross_entropy(cap * torch.tanh(logits.double() / cap), targets, ignore_index=-1, reduction=reduction)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_softcap_cross_entropy_against_float64(dtype, reduction):
    """The eager loss (sigmoid form, blocks of rows, gradient made in forward) against tanh + cross_entropy in float64:
    5 rows per block at this vocabulary, so 13 rows are 3 blocks, the last one short; ignored targets; a backward
    scaled by 3 (grad accumulation divides the loss) and, for 'none', by a different weight per row."""
    from nanomuon.gpt import softcap_cross_entropy

    gen = torch.Generator().manual_seed(0)
    vocab, rows, cap = (1 << 18) // 5, 13, 15.0
    logits = (torch.randn(rows, vocab, generator=gen) * 20).to(dtype).requires_grad_()  # some beyond the cap
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[[2, 7]] = -1
    weight = torch.rand(rows, generator=gen, dtype=torch.float64) + 0.5
    ref_logits = logits.detach().double().requires_grad_()
    ref = softcap_loss_float64(ref_logits, targets, cap, reduction)
    (ref * 3 if reduction == "mean" else ref @ weight).backward()
    loss = softcap_cross_entropy(logits, targets, cap, reduction, True)
    (loss * 3 if reduction == "mean" else loss @ weight.to(loss.dtype)).backward()
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=tol, atol=tol)
    assert logits.grad.dtype == dtype
    if dtype != torch.bfloat16:
        torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=tol, atol=tol * 1e-3)
    else:  # two roundings to bf16: the fp32 gradient, then its product with the backward's scale
        err = (logits.grad.double() - ref_logits.grad).abs() / ref_logits.grad.abs().clamp(min=1e-30)
        assert err.max() <= 2 ** -7 + 1e-5 and err.median() <= 2 ** -9, (err.max(), err.median())  # u = 2 ** -8
    assert not logits.grad[[2, 7]].any()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # its gradient is scaled in place
        loss = softcap_cross_entropy(logits, targets, cap, "mean", True)
        loss.backward(retain_graph=True)
        loss.backward()


def test_model_loss_is_the_cross_entropy_of_its_softcapped_logits():
    """GPT.forward's fused loss equals cross_entropy of the logits it returns without targets, with and without
    grad (eval computes none), and refuses targets outside the vocabulary; a batch of only -1 targets gives NaN
    and zero gradients, as F.cross_entropy does."""
    model = small_model()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)  # logits past the softcap
    idx = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    targets = idx.roll(-1, dims=1)
    targets[0, :5] = -1
    logits = model(idx)
    ref = F.cross_entropy(logits.view(-1, 97), targets.view(-1), ignore_index=-1, reduction="none").view(2, 32)
    torch.testing.assert_close(model(idx, targets, loss_reduction="none"), ref)
    with torch.no_grad():
        torch.testing.assert_close(model(idx, targets), ref.sum() / (ref.numel() - 5))
    for bad in (-2, 97):
        with pytest.raises(RuntimeError, match="out of bounds"):
            model(idx, targets.index_put((torch.tensor(1), torch.tensor(3)), torch.tensor(bad)))
    loss = model(idx, torch.full_like(idx, -1))
    loss.backward()
    assert loss.isnan() and not any(p.grad.any() for p in model.parameters())


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_model_equals_eager():
    """base_train --compile trains torch.compile(model): its loss and gradients must match eager's."""
    import torch._dynamo

    torch._dynamo.reset()
    model = small_model()
    with torch.no_grad():  # non-zero output projections, so every gradient path is exercised
        for p in model.parameters():
            p.normal_(std=0.05)
    compiled = torch.compile(model, dynamic=False)
    idx = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for m in (model, compiled):
        model.zero_grad(set_to_none=True)
        loss = m(idx, idx.roll(-1, dims=1))
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for g_compiled, g_eager in zip(grads[1], grads[0]):
        torch.testing.assert_close(g_compiled, g_eager, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("variant", list(OPTIMIZER_VARIANTS))
def test_every_optimizer_variant_builds_and_steps(variant):
    model = small_model(arch="nanochat" if variant.endswith("-nanochat") else "classic")  # its roles
    opt = model.setup_optimizer(OPTIMIZER_VARIANTS[variant], horizon=10)  # Muown's schedule needs one
    matrices = next(g for g in opt.param_groups if g["name"] == "matrices")
    assert matrices["kind"] == ("adamw" if variant == "adamw" else "muon")
    for key, value in OPTIMIZER_VARIANTS[variant].muon_options.items():
        assert matrices[key] == value
    before = [p.detach().clone() for p in matrices["params"]]
    x, y = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    if opt.wants_inputs():  # a stage that reads its matrices' inputs (muon-newton)
        loss, stats = model(x, y, input_stats=True)
        named = dict(model.named_parameters())
        opt.give_inputs({named[name]: cov for name, cov in stats.items()})
    else:
        loss = model(x, y)
    loss.backward()
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, matrices["params"]))


def test_per_head_updates_each_head_as_a_matrix_of_its_own():
    """per_head=True: each head's rows of c_q, c_k, c_v (GQA: 2 kv heads) and each head's columns of c_proj move
    as a separate Muon param would (c_proj's as the transposed block, so its lr factor is that of (16, 64))."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=97, n_layer=1, n_head=4, n_kv_head=2, n_embd=64))
    model.init_weights()
    attn = model.blocks[0].attn
    torch.nn.init.normal_(attn.c_proj.weight, std=0.05)  # not zero, so cautious decay has signs to compare
    opt = model.setup_optimizer(Variant(per_head=True, muon_options=dict(ns_precision="fp32")))
    x = torch.randint(0, 97, (2, 16))
    model(x, x).backward()
    heads = ((attn.c_q, 4, 0), (attn.c_k, 2, 0), (attn.c_v, 2, 0), (attn.c_proj, 4, 1))
    before = [(lin.weight.detach().clone(), lin.weight.grad.clone()) for lin, _, _ in heads]
    opt.step()
    for (lin, n, dim), (w, g) in zip(heads, before):
        blocks = [torch.nn.Parameter(b.clone() if dim == 0 else b.T.clone()) for b in w.chunk(n, dim=dim)]
        for b, gb in zip(blocks, g.chunk(n, dim=dim)):
            b.grad = gb.clone() if dim == 0 else gb.T.clone()
        whole = torch.nn.Parameter(w.clone())
        whole.grad = g.clone()
        for ps in (blocks, [whole]):
            MuonAdamW([dict(kind="muon", params=ps, lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.2,
                            ns_precision="fp32")]).step()
        expected = torch.cat([b.detach() if dim == 0 else b.detach().T for b in blocks], dim=dim)
        assert (expected - whole.detach()).abs().max() > 1e-3  # per head is not the whole matrix's update
        torch.testing.assert_close(lin.weight.detach(), expected, rtol=0, atol=1e-6)
    assert {g["name"] for g in opt.param_groups} >= {"matrices", "matrices, 4 heads", "matrices, 2 heads",
                                                     "matrices, 4 heads by columns"}
    with pytest.raises(ValueError, match="need matrix_optimizer=.muon."):
        model.setup_optimizer(Variant(per_head=True, matrix_optimizer="adamw"))


def hand_max_logits(model, idx):
    """Each head's largest causal q.k / sqrt(head_dim), recomputed in float64 from the layer-0 weights."""
    attn = model.blocks[0].attn
    B, T = idx.shape
    x = F.rms_norm(model.wte(idx), (model.config.n_embd,)).double()
    cos, sin = model.cos[:, :T].double(), model.sin[:, :T].double()
    q = (x @ attn.c_q.weight.double().T).view(B, T, attn.n_head, attn.head_dim)
    k = (x @ attn.c_k.weight.double().T).view(B, T, attn.n_kv_head, attn.head_dim)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k = k.repeat_interleave(attn.n_head // attn.n_kv_head, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / attn.head_dim ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return scores.amax(dim=(0, 2, 3))


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_tracked_logits_and_qk_clip(n_kv_head):
    """Without QK-norm: the tracked per-head max logits match a float64 recomputation, and after
    model.qk_clip_(tau) the same batch's logits are all at or below tau."""
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=16, vocab_size=50, n_layer=1, n_head=4, n_kv_head=n_kv_head, n_embd=32,
                       qk_norm=False)
    model = GPT(config)
    model.init_weights()
    with torch.no_grad():
        model.blocks[0].attn.c_q.weight.mul_(8)  # large logits, as a diverging run would have
    idx = torch.randint(0, 50, (3, 16))
    model.track_max_logits()
    model(idx)
    tracked = model.blocks[0].attn.max_logits
    torch.testing.assert_close(tracked.double(), hand_max_logits(model, idx), rtol=1e-4, atol=1e-4)
    tau = tracked.median().item()
    assert model.qk_clip_(tau) == int((tracked > tau).sum()) > 0
    after = hand_max_logits(model, idx)
    assert torch.all(after <= tau * (1 + 1e-4)), (after, tau)
    model.track_max_logits(False)
    with pytest.raises(RuntimeError, match="call model.track_max_logits"):
        model.qk_clip_(tau)


def test_attention_off_a_gpu_is_sdpa_and_a_named_kernel_says_why_not():
    """choose_attention off a GPU: SDPA with the reason; a kernel asked for by name is refused with
    it, an unknown name in one line."""
    from nanomuon.attention import choose_attention

    cpu, heads = torch.device("cpu"), (2, 2, 64)
    got = choose_attention(cpu, "bf16", heads)
    assert (got.name, got.func) == ("sdpa", None)
    assert got.why == "sdpa (flash kernels need a CUDA GPU, this is cpu)"
    assert choose_attention(cpu, "fp32", heads, "sdpa").name == "sdpa"
    for name in ("fa3", "fa4", "fa3-hub"):
        with pytest.raises(ValueError, match=f"^--attention {name} cannot run here: flash kernels "
                           "need a CUDA GPU, this is cpu$"):
            choose_attention(cpu, "bf16", heads, name)
    with pytest.raises(ValueError, match="attention 'fa2' is unknown; use one of auto, fa3"):
        choose_attention(cpu, "bf16", heads, "fa2")


def test_use_attention_routes_every_layer_through_the_kernel():
    """A kernel from use_attention gets each layer's q, k, v as (B, T, heads, head_dim), the layout
    flash kernels take, and its output is used: a kernel that computes SDPA gives the model's
    logits exactly; one that returns zeros gives other logits."""
    model = GPT(config_from_depth(2, 97, 16, aspect_ratio=64, head_dim=32))
    model.init_weights()
    for block in model.blocks:  # non-zero output projections, so attention reaches the logits
        torch.nn.init.normal_(block.attn.c_proj.weight, std=0.1)
    x = torch.randint(0, 97, (2, 16))
    plain = model(x)
    seen = []

    def attend(q, k, v, window):
        seen.append(tuple(q.shape))
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True).transpose(1, 2)

    model.use_attention(attend)
    assert torch.equal(model(x), plain) and seen == [(2, 16, 4, 32)] * 2
    model.use_attention(lambda q, k, v, window: torch.zeros_like(q))
    assert not torch.allclose(model(x), plain)
    model.use_attention(None)
    assert torch.equal(model(x), plain)
