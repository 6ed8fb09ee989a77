"""
Stock PyTorch as a baseline (`--optimizer torch-muon`): torch.optim.Muon and torch.optim.AdamW
behind MuonAdamW's param-group convention, in the same loop. torch.optim.Muon is not distributed,
so under torch.distributed this averages the grads itself and every rank does the whole update.
"""

import contextlib
from unittest import mock

import torch
import torch.distributed as dist
from torch.optim import _muon as torch_muon

from nanomuon.stages import resolve_ns_precision


def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz in float32 where torch uses bfloat16: on CPUs bf16 matmul is
    emulated (20-50x slower than fp32), so the baseline would time the emulation."""
    a, b, c = ns_coefficients
    X = grad.float()
    tall = grad.size(0) > grad.size(1)
    if tall:
        X = X.T
    # Out of place: for an fp32 grad, .float() returns the caller's tensor itself (with
    # nesterov=False that is the momentum buffer), and torch's in-place div_ would overwrite it.
    X = X / X.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = X @ X.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        X = torch.addmm(X, update, X, beta=a)
    return X.T if tall else X


def fp32_newton_schulz():
    """torch.optim.Muon's Newton-Schulz in fp32 inside the block (it looks it up at every step)."""
    return mock.patch.object(torch_muon, "_zeropower_via_newtonschulz", newton_schulz_fp32)


class TorchMuonAdamW:
    """torch.optim.Muon + torch.optim.AdamW as one optimizer over kind='muon' / 'adamw' groups:
    param_groups are the inner optimizers' own dicts, so a schedule's writes reach them."""

    MUON_KEYS = ("lr", "momentum", "weight_decay", "nesterov", "ns_steps")
    ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")
    # muon keys whose value says what torch.optim.Muon does anyway: no VR, no stages around it
    SAME_AS_TORCH = {"beta2": None, "precondition": (), "post_process": ()}

    def __init__(self, param_groups, ns_precision: str = "auto"):
        muon, adamw = [], []
        for i, group in enumerate(param_groups):
            kind = group.get("kind")
            if kind not in ("muon", "adamw"):
                raise ValueError(f"param group {i}: kind={kind!r}; set kind='muon' or kind='adamw'")
            allowed = self.MUON_KEYS if kind == "muon" else self.ADAMW_KEYS
            dropped = {k for k in group
                       if k not in allowed + ("params", "kind", "name", "initial_lr",
                                              "initial_weight_decay", "initial_momentum", "horizon")
                       and not (kind == "muon" and k in self.SAME_AS_TORCH
                                and group[k] == self.SAME_AS_TORCH[k])}
            if dropped:
                raise ValueError(f"param group {i} ({kind}): torch.optim."
                                 f"{'Muon' if kind == 'muon' else 'AdamW'} has no option "
                                 f"{sorted(dropped)}; remove it for the torch baseline")
            (muon if kind == "muon" else adamw).append(dict(group))
        if ns_precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"ns_precision must be 'auto', 'bf16' or 'fp32', got {ns_precision!r}")
        self.ns_precision = ns_precision
        self.optimizers = (([torch.optim.Muon(muon)] if muon else [])
                           + ([torch.optim.AdamW(adamw)] if adamw else []))

    @property
    def param_groups(self):
        # live: torch's load_state_dict replaces the inner group dicts a schedule writes
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self):
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def wants_inputs(self) -> bool:  # torch.optim.Muon reads no layer inputs
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # average the grads, as DDP would; a rank without a grad contributes zeros
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())
        fp32 = resolve_ns_precision(self.ns_precision, params[0].device) == "fp32"
        with fp32_newton_schulz() if fp32 else contextlib.nullcontext():
            for opt in self.optimizers:
                opt.step()

    def state_dict(self) -> dict:
        return dict(torch_baseline=[opt.state_dict() for opt in self.optimizers])

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("torch_baseline")
        if saved is None or len(saved) != len(self.optimizers):
            raise ValueError("this optimizer state was not saved by TorchMuonAdamW with the same "
                             "groups; resume with the --optimizer the run was started with")
        for opt, sd in zip(self.optimizers, saved):
            opt.load_state_dict(sd)
