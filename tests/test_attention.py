"""The attention kernels of nanomuon.attention against a dense float64 reference written out here,
forward and gradients, at windows None (the whole context), 0 (the token alone), small, and as
long as the context, with GQA; and which kernel a windowed model gets off a GPU.

The flash kernels need a Hopper GPU. What of their windowed paths a CPU can run runs here:
registry_attend's packing of the batch for varlen_attn (against a stand-in for varlen_attn
written from its documented window_size), flex_attention's forward (torch has no flex backward on
the CPU), chunked_attend whole. tests/test_fake_cuda.py checks the choice on a fake H100."""

import warnings

import pytest
import torch

import nanomuon.attention as attention
from nanomuon.attention import choose_attention
from nanomuon.gpt import GPT, config_from_depth, sdpa

# (T, window): none, the token alone, a few, one chunk (CHUNK_MIN) with T not a multiple of it,
# windows of T - 2 (cuts one key), T - 1 and more (the whole context)
WINDOWS = [(96, None), (200, 0), (200, 5), (200, 64), (256, 100), (96, 94), (96, 95), (96, 500)]


def reference(q, k, v, window):
    """Causal attention in float64 on (B, T, heads, head_dim): query i sees keys i - window .. i
    (all of 0 .. i for None); each group of n_head / n_kv_head query heads shares a kv head."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / q.size(-1) ** 0.5
    i = torch.arange(q.size(2))
    behind = i[:, None] - i[None, :]
    seen = (behind >= 0) & (behind <= (q.size(2) if window is None else window))
    weights = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
    return (weights @ v).transpose(1, 2)


def qkv(T, n_head=4, n_kv_head=2, head_dim=16, B=2, dtype=torch.float32, grads=True):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, T, h, head_dim, generator=g, dtype=dtype, requires_grad=grads)
            for h in (n_head, n_kv_head, n_kv_head)]


def check(attend, T, window, grads=True, dtype=torch.float32, tol=1e-5):
    """attend's output (and q, k, v's gradients) against reference's, to tol of their scale."""
    q, k, v = qkv(T, dtype=dtype, grads=grads)
    out = attend(q, k, v, window)
    want = reference(q, k, v, window)
    assert out.shape == want.shape and out.dtype == dtype, (out.shape, out.dtype)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    if grads:
        up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        got = torch.autograd.grad(out, (q, k, v), up.to(dtype))
        expect = torch.autograd.grad(want, (q, k, v), up)
        for name, a, b in zip("qkv", got, expect):
            scale = max(1.0, b.abs().max().item())
            torch.testing.assert_close(a.double(), b.double(), atol=tol * scale, rtol=tol,
                                       msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("T, window", WINDOWS)
def test_sdpa_with_a_window_is_the_reference(T, window):
    check(sdpa, T, window)


@pytest.mark.parametrize("T, window", WINDOWS)
def test_chunked_is_the_reference(T, window):
    check(attention.chunked_attend, T, window)


def test_chunked_in_bf16_is_as_close_as_sdpa():
    """bf16 chunks round as bf16 SDPA does: each within a few bf16 ulps of the reference."""
    for T, window in ((300, 64), (512, 128)):
        q, k, v = qkv(T, dtype=torch.bfloat16)
        want = reference(q, k, v, window)
        for attend in (sdpa, attention.chunked_attend):
            err = (attend(q, k, v, window).double() - want).abs().max().item()
            assert err < 2e-2, (attend.__name__, T, window, err)


def test_chunked_masks_only_what_the_window_hides():
    """Each chunk against itself and the one before: its mask shows query a of chunk j exactly
    the keys jc + a - window .. jc + a, and none of the zeros before the first chunk."""
    n, c, window = 3, 4, 4
    mask = attention.make_chunk_mask(n, c, window, 2, torch.device("cpu"))
    assert mask.shape == (1, n * 2, c, 2 * c) and torch.equal(mask[0, 0], mask[0, 1])
    for j in range(n):
        for a in range(c):
            keys = {(j - 1) * c + b for b in range(2 * c) if mask[0, 2 * j, a, b]}
            i = j * c + a
            assert keys == set(range(max(0, i - window), i + 1)), (j, a, keys)


def varlen_reference(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1),
                     enable_gqa=False, **unused):
    """varlen_attn as torch documents it, in float64: each sequence of the packed batch alone;
    window_size (left, 0) shows query i keys i - left .. i ((-1, 0): all before it)."""
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k and not unused
    left, right = window_size
    assert right == 0 and left >= 0 and enable_gqa == (k.size(1) != q.size(1)), window_size
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16, (q.dtype, k.dtype, v.dtype)
    starts = cu_seq_q.tolist()
    outs = [reference(*(x[a:b].unsqueeze(0) for x in (q, k, v)), left)[0]
            for a, b in zip(starts[:-1], starts[1:])]
    assert max(b - a for a, b in zip(starts[:-1], starts[1:])) == max_q
    return torch.cat(outs).to(q.dtype)


@pytest.mark.parametrize("T, window", WINDOWS)
def test_registry_windows_reach_varlen_attn_as_its_window_size(T, window, monkeypatch):
    """registry_attend hands a window to varlen_attn (the registry kernel's windowed call) as B
    sequences of T tokens with window_size (window, 0), in bf16, and a layer without one to
    SDPA; fp32 outside autocast to SDPA too (no flash kernel takes it)."""
    if not attention.varlen_windows():
        pytest.skip(f"torch {torch.__version__}'s varlen_attn takes no window: the registry "
                    "kernels are not chosen for windows here")
    from torch.nn.attention import varlen

    calls = []
    monkeypatch.setattr(varlen, "varlen_attn", lambda *a, **k: calls.append(k["window_size"])
                        or varlen_reference(*a, **k))
    check(attention.registry_attend, T, window, dtype=torch.bfloat16, tol=2e-2)
    want = [(window, 0)] if attention.cuts(window, T) else []
    assert calls == want, calls
    check(attention.registry_attend, T, window)  # fp32: SDPA
    assert calls == want, calls


def test_this_torch_hands_windows_to_the_registry_kernels():
    """torch 2.13's varlen_attn takes window_size: a windowed model keeps fa3 and fa4."""
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13):
        assert attention.varlen_windows()


@pytest.mark.parametrize("T, window", WINDOWS)
def test_flex_forward_is_the_reference(T, window):
    """flex's forward, uncompiled (torch has no flex_attention backward on the CPU); its block
    mask is the reference's mask."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention uncompiled: "materializes the scores"
        check(attention.windowed_flex(compiled=False), T, window, grads=False)
    if attention.cuts(window, T):
        from torch.nn.attention.flex_attention import create_mask

        mask = create_mask(attention.window_block_mask(T, window, torch.device("cpu")).mask_mod,
                           None, None, T, T, "cpu")
        i = torch.arange(T)
        assert torch.equal(mask[0, 0], (i[:, None] >= i) & (i[:, None] - i <= window))


def test_the_block_mask_is_made_once_per_shape():
    cpu = torch.device("cpu")
    assert attention.window_block_mask(256, 64, cpu) is attention.window_block_mask(256, 64, cpu)
    assert attention.window_block_mask(256, 64, cpu) is not attention.window_block_mask(256, 63,
                                                                                         cpu)


@pytest.mark.compile
def test_compiled_flex_forward_is_the_reference():
    """The compiled flex_attention that CUDA runs, here on the CPU's inductor (forward only)."""
    check(attention.windowed_flex(), 256, 100, grads=False)


def test_a_windowed_model_off_a_gpu_attends_in_chunks():
    """auto for a windowed model on the CPU: chunked, saying why not a flash kernel; sdpa asked
    for is sdpa; flex asked for is refused (no backward on the CPU); a model without windows keeps
    today's sdpa."""
    cpu, heads = torch.device("cpu"), (4, 2, 64)
    got = choose_attention(cpu, "bf16", heads, windowed=True)
    assert (got.name, got.func) == ("chunked", attention.chunked_attend)
    assert got.why.startswith("chunked: ") and got.why.endswith(
        "(flash kernels need a CUDA GPU, this is cpu)"), got.why
    assert choose_attention(cpu, "fp32", heads, "chunked").name == "chunked"
    assert choose_attention(cpu, "bf16", heads, "sdpa", windowed=True).name == "sdpa"
    with pytest.raises(ValueError, match="^--attention flex cannot run here: flex_attention has "
                       "no backward on cpu"):
        choose_attention(cpu, "bf16", heads, "flex", windowed=True)
    assert choose_attention(cpu, "bf16", heads) == attention.Attention(
        "sdpa", "sdpa (flash kernels need a CUDA GPU, this is cpu)")


@pytest.mark.parametrize("dtype", [torch.float32,  # bf16 autocast: the heavy leg
                                   pytest.param(torch.bfloat16, marks=pytest.mark.heavy)])
def test_a_nanochat_model_through_chunks_is_the_model_through_sdpa(dtype):
    """arch 'nanochat' (windows SSSL) through chunked_attend: SDPA's loss and gradients, in fp32
    and under bf16 autocast (value embeddings make v fp32 there, q and k bf16)."""
    torch.manual_seed(0)
    model = GPT(config_from_depth(4, 97, 512, arch="nanochat", head_dim=64))
    model.init_weights()
    for block in model.blocks:  # non-zero output projections, so attention reaches the loss
        torch.nn.init.normal_(block.attn.c_proj.weight, std=0.05)
    assert model.config.window_sizes() == [128, 128, 128, None]
    x, y = torch.randint(0, 97, (2, 512)), torch.randint(0, 97, (2, 512))
    results = []
    for func in (None, attention.chunked_attend):
        model.use_attention(func)
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    (loss0, grads0), (loss1, grads1) = results
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss1, loss0, atol=tol, rtol=tol)
    for a, b in zip(grads1, grads0):
        torch.testing.assert_close(a, b, atol=tol * max(1.0, b.abs().max().item()), rtol=tol)


def test_the_hub_kernel_is_fetched_at_a_pinned_commit(monkeypatch):
    """fa3-hub fetched the kernel at its repo's main, which moves: it asks for one commit (40 hex
    digits, not a branch or a tag), as the datasets are read at a pinned revision, and says it."""
    import re
    import sys
    import types

    asked = []
    hub = types.SimpleNamespace(flash_attn_interface=object())
    fake = types.ModuleType("kernels")
    fake.get_kernel = lambda repo, **kwargs: asked.append((repo, kwargs)) or hub
    monkeypatch.setitem(sys.modules, "kernels", fake)
    got = attention.load_hub()
    assert asked == [("varunneal/flash-attention-3", dict(revision=attention.HUB_REVISION))]
    assert re.fullmatch(r"[0-9a-f]{40}", attention.HUB_REVISION)
    assert f"varunneal/flash-attention-3 at {attention.HUB_REVISION[:12]}" in got.why
