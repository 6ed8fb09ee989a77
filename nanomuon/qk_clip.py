"""
QK-clip (Kimi K2's MuonClip): after the optimizer step, each head whose largest pre-softmax logit S
exceeds tau has its W_q rows scaled by (tau/S)^alpha and W_k rows by (tau/S)^(1-alpha), so that
logit shrinks to at most tau. max_logits is MAX-reduced across ranks; a grouped-query K head takes
the strongest factor of its Q heads; DTensor weights are scaled in place, each rank its own rows.
nanomuon's GPT bounds its logits with QK-norm; built with --no-qk-norm it clips them (GPT.qk_clip_).
"""

import torch
import torch.distributed as dist
from torch import Tensor

from nanomuon.sharded import DTensor, block_of


def _scale_rows_(w: Tensor, row_scale: Tensor) -> None:
    """w[i, :] *= row_scale[i] for the rows this rank holds (all of them for a plain tensor)."""
    if isinstance(w, DTensor):
        offset, shape, _ = block_of(w)
        w, row_scale = w.to_local(), row_scale[offset[0]:offset[0] + shape[0]]
    if w.numel():
        w.mul_(row_scale.to(w.dtype).unsqueeze(1))


@torch.no_grad()
def qk_clip_(q_weight: Tensor, k_weight: Tensor, max_logits: Tensor, n_head: int,
             n_kv_head: int | None = None, tau: float = 100.0, alpha: float = 0.5,
             reduce: bool = True) -> Tensor:
    """Rescale W_q (n_head * head_dim, d) and W_k (n_kv_head * head_dim, d) in place by the
    (n_head,) max_logits; return each head's gamma = min(1, tau / S)."""
    n_kv_head = n_kv_head or n_head
    if max_logits.shape != (n_head,):
        raise ValueError(f"max_logits has shape {tuple(max_logits.shape)}; expected ({n_head},), "
                         "one per query head")
    if n_head % n_kv_head or q_weight.shape[0] % n_head or k_weight.shape[0] % n_kv_head:
        raise ValueError(f"W_q {tuple(q_weight.shape)} and W_k {tuple(k_weight.shape)} do not "
                         f"split into {n_head} query and {n_kv_head} key heads")
    if not (tau > 0 and 0.0 <= alpha <= 1.0):
        raise ValueError(f"qk_clip needs tau > 0 and alpha in [0, 1], got tau={tau}, alpha={alpha}")
    s = max_logits.detach().double().clone()  # float64: the factors are tiny vectors
    if reduce and dist.is_available() and dist.is_initialized():
        dist.all_reduce(s, op=dist.ReduceOp.MAX)
    # shrink only; a tensor numerator, as python / tensor is off by an ulp at S = tau
    gamma = (torch.full_like(s, tau) / s.clamp_min(1e-30)).clamp(max=1.0)
    _scale_rows_(q_weight, gamma.pow(alpha).repeat_interleave(q_weight.shape[0] // n_head))
    # a K head serves a group of Q heads
    kv_gamma = gamma.view(n_kv_head, n_head // n_kv_head).amin(dim=1)
    _scale_rows_(k_weight,
                 kv_gamma.pow(1 - alpha).repeat_interleave(k_weight.shape[0] // n_kv_head))
    return gamma
