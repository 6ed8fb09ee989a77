"""
The param group convention of MuonAdamW and DistMuonAdamW: which parameters train with Muon, and what a valid group
holds. One home, so the GPT, other models and the optimizers agree.

classify() is the rule, muon_param_groups() applies it to any model (README, "The optimizer") and GPT.setup_optimizer()
to nanomuon's own. check_group() refuses a bad group when it is added; check_group_values() re-checks hyperparameters at
every step, since schedules edit them; check_state_dict() refuses an optimizer checkpoint that does not fit the groups.
"""

import logging
import math

import torch
from torch import Tensor

from nanomuon import update_math
from nanomuon.update_math import LR_SCALES, NS_DTYPES, NS_METHODS, ns_coefficients

logger = logging.getLogger("nanomuon")

WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
# Embeddings and output heads in common model families (GPT-2, nanochat, Llama, HF), matched against the param's own
# name or its module's: Meta Llama's head is `output`, but BERT's `attention.output.dense` is a hidden matrix.
SKIP_KEYS = ("wte", "wpe", "embed_tokens", "tok_embeddings", "embeddings", "lm_head", "output")
# Fused weights of equal row blocks, updated block by block (split): transformers 5's MoE experts
# (E, 2I, H) [gate; up] and GPT-2's (H, 3H) Conv1D [Q; K; V].
FUSED_KEYS = {"gate_up_proj": 2, "c_attn": 3}


def normalize_fqn(name: str) -> str:
    """A parameter name without compile / checkpoint / FSDP1 wrapper components."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def _matches(parts: list[str], key: str) -> bool:
    """key ('experts' or 'mlp.experts') appears in parts as whole, contiguous components."""
    key_parts = key.split(".")
    n = len(key_parts)
    return any(parts[i:i + n] == key_parts for i in range(len(parts) - n + 1))


def _names(parts: list[str], key: str) -> bool:
    """key names the param itself or the module that owns it (the last components, or all but the last)."""
    key_parts = key.split(".")
    return key_parts in (parts[-len(key_parts):], parts[-len(key_parts) - 1:-1])


def classify(name: str, p: torch.Tensor, skip_keys=SKIP_KEYS, expert_keys=("experts",), embedding: bool = False):
    """(True for Muon / False for AdamW, the reason) for one named parameter."""
    parts = normalize_fqn(name).split(".")
    if embedding:
        return False, "an nn.Embedding weight"
    if hit := next((k for k in skip_keys if _names(parts, k)), None):
        return False, f"matches skip key {hit!r} (embedding or output head)"
    if expert := next((k for k in expert_keys if _matches(parts, k)), None):
        if p.ndim >= 3:
            return True, f"expert weight (key {expert!r}): {p.ndim - 1}-D matrices, one per expert"
        return False, f"expert param (key {expert!r}) with {p.ndim} dims: not a batch of matrices"
    if p.ndim == 2:
        return True, "2-D matrix"
    if p.ndim < 2:
        return False, f"{p.ndim}-D (gain, bias or scalar)"
    return False, f"{p.ndim}-D and not an expert weight: Muon would treat its leading dims as a batch"


def muon_param_groups(model: torch.nn.Module, muon: dict, adamw: dict, skip_keys=SKIP_KEYS, expert_keys=("experts",),
                      fused_keys=FUSED_KEYS):
    """[muon group, muon groups of other layouts..., adamw group] for MuonAdamW / DistMuonAdamW: `muon` and
    `adamw` hold the hyperparameters (kind and params are filled in). Weights stored (in, out), as GPT-2's
    Conv1D, go to a group with transposed=True, so their lr factor and statistics follow the logical
    shape; fused weights (fused_keys: name -> number of equal blocks) to a group with that split. Frozen
    params (requires_grad=False) are left out; the `nanomuon` logger says why each param went where."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    transposed = {id(m.weight) for m in model.modules() if type(m).__name__ == "Conv1D"}  # transformers' (in, out)
    groups, adamw_group = {(None, False): dict(muon, kind="muon", params=[])}, dict(adamw, kind="adamw", params=[])
    for name, p in model.named_parameters():
        if not p.requires_grad:
            logger.debug("%s: frozen, left out", name)
            continue
        to_muon, why = classify(name, p, skip_keys, expert_keys, embedding=id(p) in embeddings)
        rows = p.shape[-1] if id(p) in transposed else p.shape[-2] if p.ndim >= 2 else 0
        blocks = next((n for k, n in fused_keys.items() if _matches(normalize_fqn(name).split("."), k)), 0)
        layout = ((rows // blocks,) * blocks if blocks and rows % blocks == 0 else None, id(p) in transposed)
        if to_muon and layout != (None, False):
            why += f", split {layout[0]}" * bool(layout[0]) + ", stored (in, out)" * layout[1]
            groups.setdefault(layout, dict(muon, kind="muon", params=[], split=layout[0], transposed=layout[1],
                                           name=f"muon split={layout[0]} transposed={layout[1]}"))
        logger.debug("%s %s -> %s: %s", name, tuple(p.shape), "muon" if to_muon else "adamw", why)
        (groups[layout] if to_muon else adamw_group)["params"].append(p)
    return [*groups.values(), adamw_group]


# Param group checks. Every message names the group, the parameter and the fix.

REQUIRED_KEYS = {"adamw": ("lr", "betas", "eps", "weight_decay"),
                 "muon": ("lr", "momentum", "ns_steps", "beta2", "weight_decay")}
OPTIONAL_KEYS = {
    "adamw": {"momentum": None},  # set (by OneCycleLR or CyclicLR, say), it becomes betas[0] at the next step
    "muon": {"nesterov": True, "cautious_wd": True, "ns_coefficients": "polar_express", "ns_precision": "auto",
             "ns_method": "auto", "ns_repeat_last": False, "equilibrate": None, "post_normalize": None,
             "lr_scale": "shape", "extra_scale": 1.0, "decay_lr": "adjusted", "weight_decay_mode": "decoupled",
             "comm_precision": "fp32", "sharded_mode": "owner", "qkv_split": None, "split": None, "split_groups": 1,
             "transposed": False},
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
        if group.get("momentum") is not None:
            _check_number(label, "momentum", group["momentum"], 0.0, 1.0, hi_open=True)
        return
    _check_number(label, "momentum", group["momentum"], 0.0, 1.0, hi_open=True)
    if group["beta2"] is not None:
        _check_number(label, "beta2", group["beta2"], 0.0, 1.0, hi_open=True)
    for key in ("nesterov", "cautious_wd", "ns_repeat_last", "transposed"):
        if not isinstance(group.get(key, False), bool):
            raise ValueError(f"{label}: {key}={group[key]!r} must be True or False")
    _check_coefficients(label, group)
    for key, choices in (("ns_precision", ("auto", *NS_DTYPES)), ("ns_method", NS_METHODS), ("lr_scale", LR_SCALES),
                         ("weight_decay_mode", ("decoupled", "l2")), ("decay_lr", ("adjusted", "group")),
                         ("comm_precision", ("bf16", "fp32")), ("sharded_mode", SHARDED_MODES),
                         ("equilibrate", update_math.EQUILIBRATE_MODES),
                         ("post_normalize", update_math.POST_NORMALIZE_MODES)):
        if key in group and group[key] not in choices:
            raise ValueError(f"{label}: {key}={group[key]!r} must be one of {list(choices)}")
    if "extra_scale" in group:
        _check_number(label, "extra_scale", group["extra_scale"])
    _check_layout(label, group)


def _check_coefficients(label: str, group: dict) -> None:
    steps = group["ns_steps"]
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        raise ValueError(f"{label}: ns_steps={steps!r} must be an int >= 1 (5 is standard)")
    try:
        ns_coefficients(group.get("ns_coefficients", "polar_express"), steps, group.get("ns_repeat_last", False))
    except ValueError as e:
        raise ValueError(f"{label}: {e}") from None


def _check_layout(label: str, group: dict) -> None:
    qkv, split, groups = group.get("qkv_split"), group.get("split"), group.get("split_groups", 1)
    if qkv is not None and split is not None:
        raise ValueError(f"{label}: give split or qkv_split, not both (qkv_split=(q, k, v) is split's 3-block case)")
    for key, value, n in (("qkv_split", qkv, 3), ("split", split, None)):
        if value is not None and not (isinstance(value, (tuple, list)) and len(value) == (n or len(value)) >= 2
                                      and all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in value)):
            raise ValueError(f"{label}: {key}={value!r} must be " + ("three positive row counts (q, k, v)" if n else
                             "two or more positive row counts, one per block"))
    if not (isinstance(groups, int) and not isinstance(groups, bool) and groups >= 1):
        raise ValueError(f"{label}: split_groups={groups!r} must be an int >= 1 (Megatron's num_query_groups)")
    if (qkv or split or group.get("transposed")) and group.get("sharded_mode", "owner") in ("distributed", "blockwise"):
        raise ValueError(f"{label}: {'split' if split else 'qkv_split' if qkv else 'transposed'} needs whole matrices: "
                         "use sharded_mode 'owner' or 'duplicated'")


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
        split, groups = (group.get("split") or group.get("qkv_split")), group.get("split_groups", 1)
        dim, n = ("columns", -1) if group.get("transposed") else ("rows", -2)
        if kind == "muon" and split and p.shape[n] != sum(split) * groups:
            raise ValueError(f"{where}: shape {tuple(p.shape)} has {p.shape[n]} {dim}, but the split {tuple(split)} x "
                             f"split_groups={groups} covers {sum(split) * groups}; put only fused weights of that "
                             "layout in this group")


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
    where = dict(zip([pid for g in saved_groups for pid in g["params"]], params))
    for pid, st in state_dict["state"].items():
        if pid not in where:
            raise ValueError(f"optimizer checkpoint has state for param id {pid}, which no group lists; corrupt file?")
        i, j, p, kind = where[pid]
        for name in ("exp_avg", "exp_avg_sq") if kind == "adamw" else ("momentum_buffer",):
            if name in st and tuple(st[name].shape) != tuple(p.shape):
                raise ValueError(f"optimizer checkpoint: group {i} param {j} {name} has shape {tuple(st[name].shape)}, "
                                 f"the param has {tuple(p.shape)}; the checkpoint is from a different model size")


def saved_params(param_groups: list[dict], state_dict: dict) -> dict:
    """Saved param id -> this optimizer's param, matched by position across the groups."""
    saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
    return dict(zip(saved_ids, (p for g in param_groups for p in g["params"])))
