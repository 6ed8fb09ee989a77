"""qk_clip_ against logits recomputed by hand: clipped heads end exactly at tau, the others untouched,
grouped-query heads all at or below tau; sharded W_q / W_k and the cross-rank MAX of the logits."""

import pytest
import torch
from test_dist import spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from nanomuon.qk_clip import qk_clip_

D, HEAD_DIM = 32, 8


def max_logits(wq, wk, x, n_head, n_kv_head):
    """Per query head, the largest q.k / sqrt(head_dim) over all positions, in float64."""
    q = (x @ wq.double().T).view(len(x), n_head, HEAD_DIM)
    k = (x @ wk.double().T).view(len(x), n_kv_head, HEAD_DIM).repeat_interleave(n_head // n_kv_head, dim=1)
    return torch.einsum("ihd,jhd->hij", q, k).amax(dim=(1, 2)) / HEAD_DIM ** 0.5


def weights(n_head, n_kv_head, seed=0):
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(n_head * HEAD_DIM, D, generator=g, dtype=torch.float64)
    wk = torch.randn(n_kv_head * HEAD_DIM, D, generator=g, dtype=torch.float64)
    x = torch.randn(24, D, generator=g, dtype=torch.float64)
    return wq, wk, x


@pytest.mark.parametrize("n_kv_head", [4, 2])
@pytest.mark.parametrize("alpha", [0.5, 1.0, 0.0])
def test_clipped_heads_end_at_tau(n_kv_head, alpha):
    n_head = 4
    wq, wk, x = weights(n_head, n_kv_head)
    before = max_logits(wq, wk, x, n_head, n_kv_head)
    tau = before.median().item()  # about half the heads are over it
    q2, k2 = wq.clone(), wk.clone()
    gamma = qk_clip_(q2, k2, before, n_head, n_kv_head, tau=tau, alpha=alpha)
    after = max_logits(q2, k2, x, n_head, n_kv_head)
    over = before > tau
    assert over.any() and (~over).any()
    assert torch.all(after <= tau * (1 + 1e-9))
    torch.testing.assert_close(gamma.double(), torch.where(over, tau / before, 1.0), rtol=1e-6, atol=0)
    if n_kv_head == n_head:  # each head's logit scales by exactly gamma: clipped heads land on tau
        torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-6, atol=0)
        torch.testing.assert_close(after[~over], before[~over])
    q_rows = torch.repeat_interleave(over, HEAD_DIM)
    assert torch.equal(q2[~q_rows], wq[~q_rows])  # heads under tau keep their W_q rows
    if alpha == 1.0:
        assert torch.equal(k2, wk)
    if alpha == 0.0:
        assert torch.equal(q2, wq)


def test_bad_arguments():
    wq, wk, x = weights(4, 4)
    with pytest.raises(ValueError, match="expected \\(4,\\), one per query head"):
        qk_clip_(wq, wk, torch.ones(3), 4)
    with pytest.raises(ValueError, match="do not split into 4 query and 3 key heads"):
        qk_clip_(wq, wk, torch.ones(4), 4, 3)
    with pytest.raises(ValueError, match="tau > 0 and alpha in \\[0, 1\\]"):
        qk_clip_(wq, wk, torch.ones(4), 4, tau=0.0)


def _sharded_worker(rank, world_size):
    n_head = n_kv_head = 4
    wq, wk, x = weights(n_head, n_kv_head)
    wq, wk = wq.float(), wk.float()
    logits = max_logits(wq, wk, x, n_head, n_kv_head).float()
    tau = logits.median().item()
    mine = logits * 0.5 if rank else logits  # other ranks saw smaller logits: the MAX across ranks must win
    mesh = init_device_mesh("cpu", (world_size,))
    dq = distribute_tensor(wq.clone(), mesh, [Shard(0)])  # 32 rows over 3 ranks: shard edges cut through heads
    dk = distribute_tensor(wk.clone(), mesh, [Shard(1)])
    qk_clip_(dq, dk, mine, n_head, tau=tau)
    q2, k2 = wq.clone(), wk.clone()
    qk_clip_(q2, k2, logits, n_head, tau=tau, reduce=False)
    torch.testing.assert_close(dq.full_tensor(), q2, rtol=0, atol=0)
    torch.testing.assert_close(dk.full_tensor(), k2, rtol=0, atol=0)


def test_sharded_weights_and_max_across_ranks():
    spawn(_sharded_worker, 3)
