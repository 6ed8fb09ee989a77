"""
The param group convention of MuonAdamW and DistMuonAdamW: which parameters train with Muon, and what
a valid group holds. One home, so the GPT, other models and the optimizers agree.

classify() is the rule, muon_param_groups() applies it to any model (README, "The optimizer") and
GPT.setup_optimizer() to nanomuon's own. check_group() refuses a bad group when it is added;
check_group_values() re-checks the hyperparameters at every step, since schedules edit them;
check_state_dict() refuses an optimizer checkpoint that does not fit the groups.
"""

import logging
import math

import torch
from torch import Tensor

from nanomuon.update_math import COEFFICIENT_SETS, LR_SCALES, NS_DTYPES

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


# Param group checks. Every message names the group, the parameter and the fix.

REQUIRED_KEYS = {
    "adamw": ("lr", "betas", "eps", "weight_decay"),
    "muon": ("lr", "momentum", "ns_steps", "beta2", "weight_decay"),
}
OPTIONAL_KEYS = {
    "adamw": {},
    "muon": {"nesterov": True, "cautious_wd": True, "ns_coefficients": "polar_express", "ns_precision": "auto",
             "lr_scale": "shape", "extra_scale": 1.0, "weight_decay_mode": "decoupled", "comm_precision": "fp32",
             "sharded_mode": "owner", "qkv_split": None},
}
# Keys other code legitimately adds to groups: LR schedulers write initial_lr; 'name' labels a group.
PASSIVE_KEYS = {"params", "kind", "name", "initial_lr"}
SHARDED_MODES = ("owner", "duplicated", "distributed", "blockwise")  # DTensor params: see sharded.py


def group_label(i: int, group: dict) -> str:
    name = f" '{group['name']}'" if "name" in group else ""
    return f"param group {i}{name} (kind={group.get('kind')!r})"


def _check_number(label, key, value, lo=0.0, hi=math.inf, hi_open=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and lo <= value and (value < hi if hi_open else value <= hi)
    if not ok:
        bound = f"in [{lo}, {hi})" if hi_open else (f"in [{lo}, {hi}]" if hi != math.inf else f">= {lo}")
        raise ValueError(f"{label}: {key}={value!r} must be a finite number {bound}; fix the value you pass "
                         f"(or your LR schedule, if it sets {key})")


def check_group_values(i: int, group: dict) -> None:
    """Hyperparameter checks; cheap, so they also run at every step (schedules edit groups)."""
    label = group_label(i, group)
    kind = group.get("kind")
    if kind not in REQUIRED_KEYS:
        raise ValueError(f"{label}: kind must be 'adamw' or 'muon'; add kind='adamw' or kind='muon' to the group")
    missing = [k for k in REQUIRED_KEYS[kind] if k not in group]
    if missing:
        raise ValueError(f"{label}: missing {missing}; a {kind} group needs {list(REQUIRED_KEYS[kind])}")
    _check_number(label, "lr", group["lr"])
    _check_number(label, "weight_decay", group["weight_decay"])
    if kind == "adamw":
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"{label}: betas={betas!r} must be a pair (beta1, beta2), e.g. betas=(0.9, 0.95)")
        _check_number(label, "betas[0]", betas[0], 0.0, 1.0, hi_open=True)
        _check_number(label, "betas[1]", betas[1], 0.0, 1.0, hi_open=True)
        _check_number(label, "eps", group["eps"])
        return
    _check_number(label, "momentum", group["momentum"], 0.0, 1.0, hi_open=True)
    if group["beta2"] is not None:
        _check_number(label, "beta2", group["beta2"], 0.0, 1.0, hi_open=True)
    steps = group["ns_steps"]
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        raise ValueError(f"{label}: ns_steps={steps!r} must be an int >= 1 (5 is standard)")
    spec = group.get("ns_coefficients", "polar_express")
    if isinstance(spec, str):
        if spec not in COEFFICIENT_SETS:
            raise ValueError(f"{label}: ns_coefficients={spec!r} is unknown; use one of {list(COEFFICIENT_SETS)} "
                             "or a list of (a, b, c) triples")
        available = len(COEFFICIENT_SETS[spec][0])
    else:
        try:
            available = len(spec)
            ok = available >= 1 and all(len(t) == 3 and all(math.isfinite(float(x)) for x in t) for t in spec)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{label}: ns_coefficients must be a name or a non-empty list of finite (a, b, c) "
                             f"triples, got {spec!r}")
    if available > 1 and steps > available:
        raise ValueError(f"{label}: ns_steps={steps} but ns_coefficients={spec if isinstance(spec, str) else 'list'} "
                         f"has {available} per-iteration triples; use ns_steps <= {available}")
    if group.get("ns_precision", "auto") not in ("auto", *NS_DTYPES):
        raise ValueError(f"{label}: ns_precision={group['ns_precision']!r} must be 'auto', 'bf16' or 'fp32'")
    for key in ("nesterov", "cautious_wd"):
        if not isinstance(group.get(key, True), bool):
            raise ValueError(f"{label}: {key}={group[key]!r} must be True or False")
    for key, choices in (("lr_scale", LR_SCALES), ("weight_decay_mode", ("decoupled", "l2")),
                         ("comm_precision", NS_DTYPES), ("sharded_mode", SHARDED_MODES)):
        if key in group and group[key] not in choices:
            raise ValueError(f"{label}: {key}={group[key]!r} must be one of {list(choices)}")
    if "extra_scale" in group:
        _check_number(label, "extra_scale", group["extra_scale"])
    split = group.get("qkv_split")
    if split is not None:
        if not (isinstance(split, (tuple, list)) and len(split) == 3
                and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in split)):
            raise ValueError(f"{label}: qkv_split={split!r} must be three positive row counts (q, k, v)")
        if group.get("sharded_mode", "owner") in ("distributed", "blockwise"):
            raise ValueError(f"{label}: qkv_split needs whole matrices: use sharded_mode 'owner' or 'duplicated'")


def check_group(i: int, group: dict) -> None:
    """Full check of a new group: structure, keys, values and every parameter."""
    if not isinstance(group, dict):
        raise TypeError(f"param group {i}: expected a dict with 'kind' and 'params', got {type(group).__name__}")
    label = group_label(i, group)
    if "params" not in group:
        raise ValueError(f"{label}: missing 'params'; give the list of parameters this group trains")
    check_group_values(i, group)
    kind = group["kind"]
    unknown = set(group) - PASSIVE_KEYS - set(REQUIRED_KEYS[kind]) - set(OPTIONAL_KEYS[kind])
    if unknown:
        allowed = sorted(set(REQUIRED_KEYS[kind]) | set(OPTIONAL_KEYS[kind]) | {"name"})
        raise ValueError(f"{label}: unknown keys {sorted(unknown)}; a {kind} group takes {allowed}")
    for j, p in enumerate(group["params"]):
        where = f"{label}, param {j}"
        if not isinstance(p, Tensor):
            raise TypeError(f"{where}: expected a torch.Tensor (nn.Parameter), got {type(p).__name__}")
        if not p.is_floating_point():
            raise TypeError(f"{where}: dtype {p.dtype} is not supported; parameters must be real floating point "
                            "(complex and integer tensors cannot be trained here)")
        if kind == "muon" and p.ndim < 2:
            raise ValueError(f"{where}: shape {tuple(p.shape)} has {p.ndim} dim(s); Muon needs matrices "
                             "(>= 2 dims; extra leading dims are a batch). Move it to an adamw group.")
        split = group.get("qkv_split") if kind == "muon" else None
        if split is not None and p.shape[-2] != sum(split):
            raise ValueError(f"{where}: shape {tuple(p.shape)} has {p.shape[-2]} rows, but qkv_split={tuple(split)} "
                             f"sums to {sum(split)}; put only fused QKV weights of that layout in this group")


def check_grad(i: int, group: dict, j: int, p: Tensor) -> None:
    g = p.grad
    where = f"{group_label(i, group)}, param {j}"
    if g.is_sparse:
        raise ValueError(f"{where}: sparse gradients are not supported; use a dense nn.Embedding (sparse=False)")
    if g.is_complex():
        raise ValueError(f"{where}: complex gradients are not supported")
    if g.shape != p.shape:
        raise ValueError(f"{where}: grad shape {tuple(g.shape)} differs from param shape {tuple(p.shape)}")


def check_state_dict(param_groups: list[dict], state_dict: dict) -> None:
    """Refuse a checkpoint whose groups or state shapes do not fit these params, naming the first misfit."""
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or not isinstance(state_dict.get("state"), dict):
        raise ValueError("optimizer state_dict must have 'state' and 'param_groups'; the file is not an optimizer "
                         "checkpoint or is corrupt")
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"optimizer checkpoint has {len(saved_groups)} param groups but this optimizer has "
                         f"{len(param_groups)}; it was saved from a different model or optimizer setup")
    params = []
    for i, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]) or saved.get("kind") != group["kind"]:
            raise ValueError(f"optimizer checkpoint group {i} has {len(saved['params'])} {saved.get('kind')} params, "
                             f"this optimizer's has {len(group['params'])} {group['kind']} params; it was saved from a "
                             "different model or optimizer setup")
        params += [(i, j, p, group["kind"]) for j, p in enumerate(group["params"])]
    ids = [pid for g in saved_groups for pid in g["params"]]
    where = dict(zip(ids, params))
    for pid, st in state_dict["state"].items():
        if pid not in where:
            raise ValueError(f"optimizer checkpoint has state for param id {pid}, which no group lists; corrupt file?")
        i, j, p, kind = where[pid]
        names = ("exp_avg", "exp_avg_sq") if kind == "adamw" else ("momentum_buffer",)
        for name in names:
            if name in st and tuple(st[name].shape) != tuple(p.shape):
                raise ValueError(f"optimizer checkpoint: group {i} param {j} {name} has shape {tuple(st[name].shape)}, "
                                 f"the param has {tuple(p.shape)}; the checkpoint is from a different model size")


def saved_params(param_groups: list[dict], state_dict: dict) -> dict:
    """Saved param id -> this optimizer's param, matched by position across the groups."""
    saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
    return dict(zip(saved_ids, (p for g in param_groups for p in g["params"])))
