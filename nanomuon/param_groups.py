"""
Which parameters of a model train with Muon and which with AdamW, for models other than nanomuon's GPT
(whose setup_optimizer() splits its own params by role).

The rule: 2-D weight matrices inside the network go to Muon; embeddings, the output head, vectors
(norm gains, biases) and scalars go to AdamW. MoE expert weights (named by expert_keys) are batches
of matrices, (experts, out, in), so they go to Muon from 3 dims up. Other tensors of 3+ dims (conv
kernels) go to AdamW: Muon would treat their leading dims as a batch of matrices.

Names are matched per component after removing wrapper components that torch.compile
("_orig_mod"), activation checkpointing ("_checkpoint_wrapped_module") and FSDP1
("_fsdp_wrapped_module") insert, so the split is the same for a wrapped and an unwrapped model.
Set the "nanomuon" logger to DEBUG to see why each param went where.
"""

import logging

import torch

logger = logging.getLogger("nanomuon")

WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
# name components of embeddings and output heads in common model families (GPT-2, nanochat, Llama, HF)
SKIP_KEYS = ("wte", "wpe", "embed_tokens", "tok_embeddings", "embeddings", "lm_head", "output")


def normalize_fqn(name: str) -> str:
    """A parameter name without compile / checkpoint / FSDP1 wrapper components."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def _matches(parts: list[str], key: str) -> bool:
    """key ('experts' or 'mlp.experts') appears in parts as whole, contiguous components."""
    key_parts = key.split(".")
    n = len(key_parts)
    return any(parts[i:i + n] == key_parts for i in range(len(parts) - n + 1))


def classify(name: str, p: torch.Tensor, skip_keys=SKIP_KEYS, expert_keys=(), embedding: bool = False):
    """(True for Muon / False for AdamW, the reason) for one named parameter."""
    parts = normalize_fqn(name).split(".")
    if embedding:
        return False, "an nn.Embedding weight"
    hit = next((k for k in skip_keys if _matches(parts, k)), None)
    if hit:
        return False, f"matches skip key {hit!r} (embedding or output head)"
    expert = next((k for k in expert_keys if _matches(parts, k)), None)
    if expert:
        if p.ndim >= 3:
            return True, f"expert weight (key {expert!r}): {p.ndim - 1}-D matrices, one per expert"
        return False, f"expert param (key {expert!r}) with {p.ndim} dims: not a batch of matrices"
    if p.ndim == 2:
        return True, "2-D matrix"
    if p.ndim < 2:
        return False, f"{p.ndim}-D (gain, bias or scalar)"
    return False, f"{p.ndim}-D and not an expert weight: Muon would treat its leading dims as a batch"


def muon_param_groups(model: torch.nn.Module, muon: dict, adamw: dict, skip_keys=SKIP_KEYS, expert_keys=()):
    """[muon group, adamw group] for MuonAdamW / DistMuonAdamW: `muon` and `adamw` hold each group's
    hyperparameters (kind and params are filled in). Frozen params (requires_grad=False) are left out."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    groups = (dict(muon, kind="muon", params=[]), dict(adamw, kind="adamw", params=[]))
    for name, p in model.named_parameters():
        if not p.requires_grad:
            logger.debug("%s: frozen, left out", name)
            continue
        to_muon, why = classify(name, p, skip_keys, expert_keys, embedding=id(p) in embeddings)
        logger.debug("%s %s -> %s: %s", name, tuple(p.shape), "muon" if to_muon else "adamw", why)
        groups[0 if to_muon else 1]["params"].append(p)
    return list(groups)
