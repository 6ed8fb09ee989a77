"""
The param group convention of MuonAdamW and DistMuonAdamW: which parameters train with Muon
(classify(), applied to any model by muon_param_groups()), and what a valid group holds:
check_group() refuses a bad group when it is added, check_group_values() when its keys change,
check_state_dict() an optimizer checkpoint that does not fit the groups. Last, the GPT's groups
by role, which GPT.setup_optimizer builds with table_groups(), per_head_groups() and
role_groups().
"""

import logging
import math

import torch
from torch import Tensor

from nanomuon import stages
from nanomuon.coefficients import NS_GROWTH_MAX, ns_coefficients, ns_growth
from nanomuon.common import DTensor, shown

logger = logging.getLogger("nanomuon")

WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
# Embeddings and output heads (GPT-2, nanochat, Llama, HF), matched against the param's own name or
# its module's: Meta Llama's head is `output`, but BERT's `attention.output.dense` is a matrix.
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
    """key names the param itself or the module that owns it (its last components)."""
    key_parts = key.split(".")
    return key_parts in (parts[-len(key_parts):], parts[-len(key_parts) - 1:-1])


def has_dtensors(params) -> bool:
    """Whether any of these params is a DTensor (FSDP2, tensor parallel): sharded.py's."""
    return any(isinstance(p, DTensor) for p in params)


def classify(name: str, p: torch.Tensor, skip_keys=SKIP_KEYS, expert_keys=("experts",),
             embedding: bool = False):
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
    return False, (f"{p.ndim}-D and not an expert weight: "
                   "Muon would treat its leading dims as a batch")


def muon_param_groups(model: torch.nn.Module, muon: dict, adamw: dict, skip_keys=SKIP_KEYS,
                      expert_keys=("experts",), fused_keys=FUSED_KEYS):
    """[muon group, muon groups of other layouts..., adamw group] with the hyperparameters `muon`
    and `adamw`: weights stored (in, out), as GPT-2's Conv1D, in a transposed=True group, fused
    ones (fused_keys: name -> equal blocks) split. The `nanomuon` logger says where each went."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    transposed = {id(m.weight) for m in model.modules() if type(m).__name__ == "Conv1D"}
    groups, adamw_group = ({(None, False): dict(muon, kind="muon", params=[])},
                           dict(adamw, kind="adamw", params=[]))
    for name, p in model.named_parameters():
        if not p.requires_grad:
            logger.debug("%s: frozen, left out", name)
            continue
        to_muon, why = classify(name, p, skip_keys, expert_keys, embedding=id(p) in embeddings)
        rows = p.shape[-1] if id(p) in transposed else p.shape[-2] if p.ndim >= 2 else 0
        blocks = next((n for k, n in fused_keys.items()
                       if _matches(normalize_fqn(name).split("."), k)), 0)
        layout = ((rows // blocks,) * blocks if blocks and rows % blocks == 0 else None,
                  id(p) in transposed)
        if to_muon and layout != (None, False):
            why += f", split {layout[0]}" * bool(layout[0]) + ", stored (in, out)" * layout[1]
            groups.setdefault(layout, dict(muon, kind="muon", params=[], split=layout[0],
                                           transposed=layout[1],
                                           name=f"muon split={layout[0]} transposed={layout[1]}"))
        logger.debug("%s %s -> %s: %s", name, tuple(p.shape), "muon" if to_muon else "adamw", why)
        (groups[layout] if to_muon else adamw_group)["params"].append(p)
    return [*groups.values(), adamw_group]


# Param group checks. Every message names the group, the parameter and the fix.

REQUIRED_KEYS = {"adamw": ("lr", "betas", "eps", "weight_decay"),
                 "muon": ("lr", "momentum", "ns_steps", "beta2", "weight_decay")}
# Keys other code adds to groups: LR schedulers' initial_lr (and base_train's schedules'
# initial_weight_decay, initial_momentum); 'name'; a muon group's update count 'step'.
PASSIVE_KEYS = {"params", "kind", "name", "initial_lr", "initial_weight_decay",
                "initial_momentum", "step"}


def fill_defaults(group: dict) -> None:
    """Give a group every optional key it lacks, at its default (state_dict() then records what
    ran); the LEGACY_KEYS of older checkpoints become stage names."""
    if group.get("kind") == "muon" and any(k in group for k in LEGACY_KEYS):
        eq, post = group.pop("equilibrate", None), group.pop("post_normalize", None)
        group.setdefault("precondition", (f"equilibrate_{eq}",) if eq else ())
        group.setdefault("post_process", ((f"normalize_{post}",) if post else ())
                         + ("variance_reduction",))
        group.setdefault("apply", "cautious" if group.pop("cautious_wd", True) else "decoupled")
    for key, option in stages.group_options(group).items():
        group.setdefault(key, option.default)
    if group.get("kind") == "muon":
        group.setdefault("step", 0)


# muon keys that stage names replaced: fill_defaults() converts them
LEGACY_KEYS = ("equilibrate", "post_normalize", "cautious_wd")


def group_label(i: int, group: dict) -> str:
    name = f" '{group['name']}'" if "name" in group else ""
    return f"param group {i}{name} (kind={group.get('kind')!r})"


def check_group_values(i: int, group: dict) -> None:
    """Every check of a group's keys and values but what schedules edit (optim.check_numbers):
    its kind and required keys, then a muon group's options, coefficients, layout and stages."""
    label, kind = group_label(i, group), group.get("kind")
    if kind not in REQUIRED_KEYS:
        raise ValueError(f"{label}: kind must be 'adamw' or 'muon'; "
                         "add kind='adamw' or kind='muon' to the group")
    if missing := [k for k in REQUIRED_KEYS[kind] if k not in group]:
        raise ValueError(f"{label}: missing {missing}; "
                         f"a {kind} group needs {list(REQUIRED_KEYS[kind])}")
    if kind == "adamw":
        return
    for key, option in stages.group_options(group).items():
        if key in group and (wrong := option.check(group[key])):
            raise ValueError(f"{label}: {key}={group[key]!r} {wrong}")
        if (option.check is stages.an_interval and isinstance(group.get(key), float)
                and group.get("horizon") is None):
            raise ValueError(f"{label}: {key}={group[key]!r} is a fraction of the run, which "
                             "this group does not know: give it horizon= (GPT.setup_optimizer's "
                             "horizon; base_train sets it), or the interval in steps")
    if group.get("qkv_split") is not None and group.get("split") is not None:
        raise ValueError(f"{label}: give split or qkv_split, not both "
                         "(qkv_split=(q, k, v) is split's 3-block case)")
    whole = next((k for k in ("split", "qkv_split", "transposed") if group.get(k)), None)
    if whole and group.get("sharded_mode", "owner") in ("distributed", "blockwise"):
        raise ValueError(f"{label}: {whole} needs whole matrices: use sharded_mode 'owner' or "
                         "'duplicated'")
    steps = group["ns_steps"]
    if wrong := stages.a_count(steps, hi=1000):  # each step is a matmul chain: 1,000 is plenty
        raise ValueError(f"{label}: ns_steps={steps!r} {wrong} (5 is standard)")
    spec = group.get("ns_coefficients", "polar_express")
    try:
        triples, safety, _ = ns_coefficients(spec, steps, group.get("ns_repeat_last", False))
    except ValueError as e:
        raise ValueError(f"{label}: {e}") from None
    if (peak := ns_growth(triples, safety)) > NS_GROWTH_MAX:
        raise ValueError(f"{label}: ns_coefficients={shown(repr(spec), 120, quote=False)} take a "
                         f"normalized input's singular values to {peak:.3g} within {steps} steps, "
                         f"where they must stay near 1 (at most {NS_GROWTH_MAX:g}, as "
                         "every named set does): larger ones overflow fp32 in the update")
    filled = dict(group)
    fill_defaults(filled)
    for key, name, s in stages.group_stages(filled):  # a stage's check of the whole group
        if s.check is not None and (wrong := s.check(filled)):
            raise ValueError(f"{label}: {key} {name!r}: {wrong}")
        if filled["sharded_mode"] == "distributed" and key != "apply" and not s.flags.on_slices:
            raise ValueError(f"{label}: sharded_mode='distributed' runs the direction on "
                             f"slices of each matrix; {key} {name!r} needs whole matrices: "
                             "use sharded_mode 'owner' or 'duplicated'")


def check_group(i: int, group: dict) -> None:
    """Full check of a new group: structure, keys, values and every parameter."""
    if not isinstance(group, dict):
        raise TypeError(f"param group {i}: expected a dict with 'kind' and 'params', "
                        f"got {type(group).__name__}")
    label = group_label(i, group)
    if "params" not in group:
        raise ValueError(f"{label}: missing 'params'; "
                         "give the list of parameters this group trains")
    check_group_values(i, group)
    kind, options = group["kind"], stages.group_options(group)
    unknown = set(group) - PASSIVE_KEYS - set(REQUIRED_KEYS[kind]) - set(options)
    if kind == "muon" and (legacy := sorted(unknown & set(LEGACY_KEYS))):
        raise ValueError(f"{label}: {legacy[0]} is now a stage name: equilibrate='row' is "
                         "precondition=('equilibrate_row',), post_normalize='col' is post_process="
                         "('normalize_col', 'variance_reduction'), cautious_wd=False is apply="
                         "'decoupled'")
    for key in sorted(unknown) if kind == "muon" else ():
        if (owner := getattr(stages.MUON_OPTIONS.get(key), "stage", None)) is not None:
            raise ValueError(f"{label}: {key} is an option of {owner[0]} {owner[1]!r}, which this "
                             "group does not run; name the stage too, or drop the key")
    if unknown:
        allowed = sorted(set(REQUIRED_KEYS[kind]) | set(options) | {"name"})
        raise ValueError(f"{label}: unknown keys {sorted(unknown)}; a {kind} group takes {allowed}")
    split, groups = group.get("split") or group.get("qkv_split"), group.get("split_groups", 1)
    dim, n = ("columns", -1) if group.get("transposed") else ("rows", -2)
    for j, p in enumerate(group["params"]):
        where = f"{label}, param {j}"
        if not isinstance(p, Tensor):
            raise TypeError(f"{where}: expected a torch.Tensor (nn.Parameter), "
                            f"got {type(p).__name__}")
        if not p.is_floating_point():
            raise TypeError(f"{where}: dtype {p.dtype} is not supported; parameters must be real "
                            "floating point (complex and integer tensors cannot be trained here)")
        if kind == "muon" and p.ndim < 2:
            raise ValueError(f"{where}: shape {tuple(p.shape)} has {p.ndim} dim(s); Muon needs "
                             "matrices (>= 2 dims; extra leading dims are a batch). Move it to an "
                             "adamw group.")
        if kind == "muon" and split and p.shape[n] != sum(split) * groups:
            raise ValueError(f"{where}: shape {tuple(p.shape)} has {p.shape[n]} {dim}, "
                             f"but the split {tuple(split)} x split_groups={groups} covers "
                             f"{sum(split) * groups}; put only fused weights of that layout in "
                             "this group")


def check_state_dict(param_groups: list[dict], state_dict: dict) -> None:
    """Refuse a checkpoint whose groups or state shapes do not fit these params."""
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or not isinstance(state_dict.get("state"), dict):
        raise ValueError("optimizer state_dict must have 'state' and 'param_groups'; "
                         "the file is not an optimizer checkpoint or is corrupt")
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"optimizer checkpoint has {len(saved_groups)} param groups "
                         f"but this optimizer has {len(param_groups)}; "
                         "it was saved from a different model or optimizer setup")
    for i, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]) or saved.get("kind") != group["kind"]:
            raise ValueError(f"optimizer checkpoint group {i} has {len(saved['params'])} "
                             f"{saved.get('kind')} params, this optimizer's has "
                             f"{len(group['params'])} {group['kind']} params; "
                             "it was saved from a different model or optimizer setup")
        # keys its constructor would refuse (older checkpoints' keys load as what they meant)
        known = PASSIVE_KEYS | set(REQUIRED_KEYS[group["kind"]]) | {*LEGACY_KEYS, "ns_method"}
        if unknown := sorted(set(saved) - known - set(stages.group_options(saved))):
            raise ValueError(f"optimizer checkpoint group {i} has unknown keys {unknown}, which "
                             f"no {group['kind']} group takes; the file is corrupt or from "
                             "another optimizer")
    where = _saved_places(param_groups, state_dict)
    for pid, st in state_dict["state"].items():
        if pid not in where:
            raise ValueError(f"optimizer checkpoint has state for param id {pid}, "
                             "which no group lists; corrupt file?")
        i, j, p, group = where[pid]
        if group["kind"] == "muon":
            check_muon_state(f"optimizer checkpoint: group {i} param {j}", st, p, group)
            continue
        for name in ("exp_avg", "exp_avg_sq"):
            if name in st and tuple(st[name].shape) != tuple(p.shape):
                raise ValueError(f"optimizer checkpoint: group {i} param {j} {name} has shape "
                                 f"{tuple(st[name].shape)}, the param has {tuple(p.shape)}; "
                                 "the checkpoint is from a different model size")


def check_muon_state(where: str, st: dict, p: Tensor, group: dict) -> None:
    """A Muon param's saved state against what this group keeps: every tensor of the declared
    shape and dtype; a stage's state missing (a stage added on resume) is made afresh, noted."""
    layout = stages.muon_state_layout(p.shape, p.dtype, group, declared=True)
    kept = stages.muon_state_layout(p.shape, p.dtype, group)
    for name, v in st.items():
        slot = layout.get(name)
        what = f"{where} state {name!r}"
        if slot is None:
            raise ValueError(f"{what} is not state this group keeps ({', '.join(layout)}); the "
                             "checkpoint is from another optimizer setup")
        if not isinstance(v, Tensor):
            raise ValueError(f"{what} is a {type(v).__name__}, not a tensor; corrupt file?")
        if tuple(v.shape) != tuple(slot.shape) or v.dtype != slot.dtype:
            raise ValueError(f"{what} is {tuple(v.shape)} {v.dtype}, this group keeps "
                             f"{tuple(slot.shape)} {slot.dtype}; the checkpoint is from another "
                             "model or optimizer setup")
    if st and "momentum_buffer" in layout and "momentum_buffer" not in st:
        raise ValueError(f"{where} has state but no momentum_buffer; corrupt file?")
    if st and (missing := [name for name in kept if name not in st]):
        logger.warning("%s: no saved %s; the stage starts it afresh at the next step", where,
                       ", ".join(missing))


def _bad_values(v: Tensor, nonnegative: bool) -> str | None:
    """What is wrong with a state tensor's values (this rank's piece of a DTensor), if any."""
    v = v.to_local() if isinstance(v, DTensor) else v
    if v.is_meta or not v.is_floating_point() or v.numel() == 0:
        return None
    if bad := int((~torch.isfinite(v)).sum()):
        return f"holds {bad} NaN or infinite value{'s' * (bad > 1)} of {v.numel()}"
    if nonnegative and (low := float(v.min())) < 0:
        return f"holds negative values (down to {low:.3g}), where it can only be >= 0"
    return None


def _bad_step(step) -> str | None:
    """An AdamW step count: an int >= 0, or a finite one-element tensor >= 0 (torch's AdamW)."""
    if isinstance(step, Tensor):
        ok = (step.numel() == 1 and not step.is_complex() and not step.is_meta
              and math.isfinite(float(step)) and float(step) >= 0)
    else:
        ok = isinstance(step, int) and not isinstance(step, bool) and step >= 0
    return None if ok else (f"is {shown(repr(step), 60, quote=False)}, not a step count "
                             "(an int >= 0)")


class DamagedState(ValueError):
    """Optimizer state whose values would poison the next step: the state's fault."""


def state_values_problem(param_groups: list[dict], state_dict: dict) -> str | None:
    """The first state value that would poison the next step (NaN or inf, a negative second
    moment, a step count that is not one), as a line; None if there is none."""
    where = _saved_places(param_groups, state_dict)
    for pid, st in state_dict["state"].items():
        i, j, p, group = where[pid]
        slots = (stages.muon_state_layout(p.shape, p.dtype, group, declared=True)
                 if group["kind"] == "muon" else {})
        for name, v in st.items():
            if group["kind"] == "adamw" and name == "step":
                wrong = _bad_step(v)
            else:
                wrong = isinstance(v, Tensor) and _bad_values(v, name == "exp_avg_sq" or getattr(
                    slots.get(name), "nonnegative", False))
            if wrong:
                return (f"optimizer state: {group_label(i, group)}, param {j}: {name!r} {wrong}; "
                        "the saved state is damaged and would poison the next step")
    return None


def _saved_places(param_groups: list[dict], state_dict: dict) -> dict:
    """Saved param id -> (group index, index in it, param, group) of this optimizer's param,
    matched by position across the groups."""
    places = [(i, j, p, g) for i, g in enumerate(param_groups) for j, p in enumerate(g["params"])]
    return dict(zip([pid for g in state_dict["param_groups"] for pid in g["params"]], places))


def saved_params(param_groups: list[dict], state_dict: dict) -> dict:
    """Saved param id -> this optimizer's param, matched by position across the groups."""
    return {pid: p for pid, (_, _, p, _) in _saved_places(param_groups, state_dict).items()}


# The GPT's groups by role: GPT.setup_optimizer builds its groups with these.

# each matrix role's modules within a block
MATRIX_ROLES = {"attn.qkv": ("attn.c_q", "attn.c_k", "attn.c_v"), "attn.proj": ("attn.c_proj",),
                "mlp.fc": ("mlp.c_fc",), "mlp.proj": ("mlp.c_proj",)}
ROLE_FACTORS = ("lr_factor", "weight_decay_factor")  # what a role scales of the group it starts from


def table_groups(model: torch.nn.Module, table, lr: dict, scale: float, betas) -> list[dict]:
    """The arch's AdamW groups (gpt.Arch.adamw), each a role: a table's lr (the embeddings',
    lm_head's) times `scale`, the scalars' not; each group's own betas, else the pair `betas`."""
    named, groups = list(model.named_parameters()), []
    for g in table:
        rate = g.factor if g.lr is None else lr[g.lr] * g.factor
        if g.lr in ("embedding_lr", "unembedding_lr"):
            rate *= scale
        params = [p for path in g.params or (g.name,) for name, p in named
                  if name == path or name.startswith(path + ".")]
        groups.append(dict(kind="adamw", eps=1e-10, name=g.name, params=params, lr=rate,
                           betas=g.betas or betas, weight_decay=g.weight_decay))
    return groups


def per_head_groups(model: torch.nn.Module, matrix_group: dict) -> list[dict]:
    """matrix_group split: one group per (heads, by columns) of attention matrices, the rest."""
    heads, hd = {}, model.config.n_embd // model.config.n_head
    for a in (block.attn for block in model.blocks):
        for lin, n, cols in ((a.c_q, a.n_head, False), (a.c_k, a.n_kv_head, False),
                             (a.c_v, a.n_kv_head, False), (a.c_proj, a.n_head, True)):
            if n > 1:  # one head is the whole matrix
                heads.setdefault((n, cols), []).append(lin.weight)
    per = {id(w) for ws in heads.values() for w in ws}
    whole = dict(matrix_group, params=[w for w in matrix_group["params"] if id(w) not in per])
    return [whole] + [dict(matrix_group, name=f"matrices, {n} heads" + " by columns" * cols,
                           params=ws, split=(hd,) * n, transposed=cols)
                      for (n, cols), ws in heads.items()]


def role_groups(model: torch.nn.Module, table: list[dict], matrices: list[dict], roles: dict,
                fresh: dict) -> list[dict]:
    """table + matrices (the arch's groups, then the matrix groups), each role named in `roles`
    moved to a group of its own. A role is a table group's name or a MATRIX_ROLES name; roles[role]
    is a dict of kind (default: the kind its params train with now), lr_factor,
    weight_decay_factor and any key of that kind's groups. Of its own kind it starts from the
    group its params are in, else from fresh[kind] (GPT.setup_optimizer's Muon group, or its AdamW
    for matrices); an nn.Embedding weight turned Muon is transposed=True (its logical matrix is
    (dim, vocab)). Its lr and decay are that group's times its factors."""
    known = [*(g["name"] for g in table), *MATRIX_ROLES]
    if not isinstance(roles, dict):  # a list would drop the settings
        raise ValueError(f"roles={shown(repr(roles), 80, quote=False)}: give a dict of role -> "
                         f"dict(kind=, lr_factor=, weight_decay_factor=, group keys); this model's "
                         f"roles are {known}")
    if unknown := sorted(set(roles) - set(known), key=str):
        raise ValueError(f"roles: {shown(unknown, 300)} names no role here; this model's roles "
                         f"are {known}")
    members = {g["name"]: {id(p) for p in g["params"]} for g in table}
    members.update({role: {id(b.get_submodule(path).weight) for b in model.blocks
                           for path in MATRIX_ROLES[role]} for role in MATRIX_ROLES})
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    out = []
    for g in table + matrices:
        parts = [(r, [p for p in g["params"] if id(p) in members[r]]) for r in roles]
        taken = {id(p) for _, params in parts for p in params}
        out += [dict(g, params=[p for p in g["params"] if id(p) not in taken])]
        out += [_role_group(r, roles[r], g, params, fresh, all(id(p) in embeddings for p in params))
                for r, params in parts if params]
    return out


def _role_group(role: str, spec, source: dict, params: list, fresh: dict, embedding: bool) -> dict:
    """Role `role`'s group of `params`, now in group `source`, as spec asks (role_groups)."""
    kind = spec.get("kind", source["kind"]) if isinstance(spec, dict) else None
    if kind not in REQUIRED_KEYS:
        raise ValueError(f"roles[{role!r}]={shown(repr(spec), 80, quote=False)}: give a dict "
                         "with kind 'muon' or 'adamw' (default: the kind it trains with now)")
    allowed = ({"kind", *ROLE_FACTORS, *REQUIRED_KEYS[kind], *stages.OPTIONS[kind]}
               - {"lr", "weight_decay"})
    if unknown := sorted(set(spec) - allowed):
        raise ValueError(f"roles[{role!r}]: {unknown} is not a key of kind {kind!r}: its roles "
                         f"take {sorted(allowed)} (lr and decay as factors)")
    factors = [spec.get(k, 1.0) for k in ROLE_FACTORS]
    if any(stages.a_number(v, 1e3) for v in factors):
        raise ValueError(f"roles[{role!r}]: lr_factor and weight_decay_factor (times the group's "
                         f"it starts from) must be numbers, each in [0, 1000); got {factors}")
    base = source
    if kind != source["kind"]:  # an embedding's logical matrix is (dim, vocab): Muon transposes
        base = dict(fresh[kind], transposed=embedding) if kind == "muon" else fresh[kind]
    name = role if source["name"] == role else f"{source['name']}, {role}"
    return dict(base, **{k: v for k, v in spec.items() if k not in ("kind", *ROLE_FACTORS)},
                name=name, params=params, lr=base["lr"] * factors[0],
                weight_decay=base["weight_decay"] * factors[1])
