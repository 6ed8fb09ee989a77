"""
The param group convention of MuonAdamW and DistMuonAdamW: which parameters train with Muon
(classify(), applied to any model by muon_param_groups()), and what a valid group holds:
check_group() refuses a bad group when it is added, check_group_values() when its keys change,
check_state_dict() an optimizer checkpoint that does not fit the groups. It knows no model: the
GPT's groups by role are its arch's (nanomuon/arch.py).
"""

import logging
import math

import torch
from torch import Tensor

from nanomuon import kinds, stages
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


def _named_by(parts: list[str], key: str) -> bool:
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
    if hit := next((k for k in skip_keys if _named_by(parts, k)), None):
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

# Read from the rows (stages.GROUP_KEYS, stages.OPTIONS): what each kind's groups must give, and
# the bookkeeping other code adds (LR schedulers' initial_lr, base_train's initial_weight_decay
# and initial_momentum, 'name', a muon group's update count 'step'), which either kind may carry.
REQUIRED_KEYS = {kind: stages.keys_with("required", (kind,)) for kind in ("adamw", "muon")}
PASSIVE_KEYS = set(stages.keys_with("passive"))


def fill_defaults(group: dict) -> None:
    """Give a group every key it lacks that has a default in its row, its options and a muon
    group's step (state_dict() then records what ran); the LEGACY_KEYS of older checkpoints
    become stage names."""
    if group.get("kind") == "muon" and any(k in group for k in LEGACY_KEYS):
        eq, post = group.pop("equilibrate", None), group.pop("post_normalize", None)
        group.setdefault("precondition", (f"equilibrate_{eq}",) if eq else ())
        group.setdefault("post_process", ((f"normalize_{post}",) if post else ())
                         + ("variance_reduction",))
        cautious = group.pop("cautious_wd", stages.GROUP_KEYS["muon"]["cautious_wd"].default)
        group.setdefault("apply", "cautious" if cautious else "decoupled")
    own = stages.GROUP_KEYS.get(group.get("kind"), {})  # a muon group's step; older keys are read
    for key, o in {**kind_keys(group)[1], **own}.items():
        if o.default is not stages.NO_DEFAULT and not o.legacy:
            group.setdefault(key, o.default)


# muon keys that stage names replaced: fill_defaults() converts them
LEGACY_KEYS = stages.keys_with("legacy", ("muon",))


def kind_keys(group: dict) -> tuple[tuple, dict]:
    """(the keys a group must give, key -> Option of those it may leave out) for its kind:
    muon's and adamw's here and in stages.py, a registered kind's in its entry (kinds.KINDS)."""
    kind = group.get("kind")
    if kind in kinds.KINDS:
        return kinds.KINDS[kind].required, kinds.optional(kind)
    return REQUIRED_KEYS.get(kind, ()), stages.group_options(group)


def group_label(i: int, group: dict) -> str:
    name = f" '{group['name']}'" if "name" in group else ""
    return f"param group {i}{name} (kind={group.get('kind')!r})"


def check_group_values(i: int, group: dict) -> None:
    """Every check of a group's keys and values but what schedules edit (optim.check_numbers):
    its kind, required keys and options (a registered kind's as its entry declares them), then a
    muon group's coefficients, layout and stages."""
    label, kind = group_label(i, group), group.get("kind")
    if kind in kinds.KINDS:  # a registered kind: its entry declares its keys
        kinds.check_entry(label, kind)
    elif kind not in REQUIRED_KEYS:
        raise ValueError(f"{label}: kind must be 'adamw', 'muon' or one of kinds.KINDS "
                         f"{list(kinds.KINDS)}; add kind='adamw' or kind='muon' to the group")
    if missing := [k for k in kind_keys(group)[0] if k not in group]:
        raise ValueError(f"{label}: missing {missing}; "
                         f"a {kind} group needs {list(kind_keys(group)[0])}")
    # a kind's every key, required ones too; Muon's and AdamW's required ones: optim.check_numbers
    for key, option in (kinds.KINDS[kind].options if kind in kinds.KINDS
                        else stages.group_options(group)).items():
        if key in group and (wrong := option.check(group[key])):
            raise ValueError(f"{label}: {key}={group[key]!r} {wrong}")
        if (option.check is stages.an_interval and isinstance(group.get(key), float)
                and group.get("horizon") is None):
            raise ValueError(f"{label}: {key}={group[key]!r} is a fraction of the run, which "
                             "this group does not know: give it horizon= (GPT.setup_optimizer's "
                             "horizon; base_train sets it), or the interval in steps")
    if kind != "muon":
        return
    if group.get("qkv_split") is not None and group.get("split") is not None:
        raise ValueError(f"{label}: give split or qkv_split, not both "
                         "(qkv_split=(q, k, v) is split's 3-block case)")
    whole = next((k for k in ("split", "qkv_split", "transposed") if group.get(k)), None)
    if whole and stages.muon_option(group, "sharded_mode") in ("distributed", "blockwise"):
        raise ValueError(f"{label}: {whole} needs whole matrices: use sharded_mode 'owner' or "
                         "'duplicated'")
    steps = group["ns_steps"]
    if wrong := stages.a_count(steps, hi=1000):  # each step is a matmul chain: 1,000 is plenty
        raise ValueError(f"{label}: ns_steps={steps!r} {wrong} (5 is standard)")
    spec = stages.muon_option(group, "ns_coefficients")
    try:
        triples, safety, _ = ns_coefficients(spec, steps, stages.muon_option(group, "ns_repeat_last"))
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


# A group's param names (torch's named params) and, in a saved group, the keys other code (LR
# schedulers, SWA) added to it: the load keeps those, and refuses any other key no group takes.
NAMES, ADDED = "param_names", "added_keys"


def given_groups(param_groups, defaults: dict) -> list[dict]:
    """The groups an optimizer was given, as a list of dicts. Bare params are refused: a tensor
    cannot say whether it is an embedding or head (AdamW) or a hidden matrix (Muon), nor which
    lr, as the two kinds' lrs differ a hundredfold; so are torch's keyword defaults (lr=...)."""
    if isinstance(param_groups, (Tensor, dict)) or not hasattr(param_groups, "__iter__"):
        raise TypeError("MuonAdamW takes a list of param group dicts (an iterable of dicts, "
                        f"each with kind='muon' or 'adamw'), got {type(param_groups).__name__}")
    groups = list(param_groups)
    if len(groups) == 0:
        raise ValueError("MuonAdamW got no param groups; pass at least one group")
    if not all(isinstance(g, dict) for g in groups):
        raise TypeError("MuonAdamW takes a list of param group dicts, not bare params: a tensor "
                        "cannot say if it is an embedding or head (AdamW) or a matrix (Muon); "
                        "build the groups with nanomuon.param_groups.muon_param_groups(model, "
                        "muon=dict(lr=...), adamw=dict(lr=...))")
    if defaults:
        raise TypeError(f"MuonAdamW takes hyperparameters in each group, not as keywords "
                        f"({', '.join(sorted(defaults))}): the kinds' lrs differ a hundredfold; "
                        "give them to muon_param_groups(model, muon=dict(lr=...), adamw=dict(...))")
    return groups


def split_names(i: int, group: dict) -> None:
    """(name, tensor) params, as torch's optimizers take them (named_parameters()), split into
    params and param_names, in place."""
    params = group["params"]
    if any(isinstance(p, tuple) for p in params):
        if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in params):
            raise ValueError(f"{group_label(i, group)}: give every param as a tensor or every "
                             "one as a (name, tensor) pair (named_parameters()), not a mix")
        group["param_names"], group["params"] = [n for n, _ in params], [p for _, p in params]


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
    kind, (required, options) = group["kind"], kind_keys(group)
    unknown = set(group) - PASSIVE_KEYS - set(required) - set(options) - {NAMES}
    names = group.get(NAMES, [""] * len(group["params"]))
    if not isinstance(names, list) or len(names) != len(group["params"]) or not all(
            isinstance(n, str) for n in names):
        raise ValueError(f"{label}: param_names={shown(repr(names), 80, quote=False)} must be "
                         f"one name (str) per param, {len(group['params'])} of them")
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
        allowed = sorted(set(required) | set(options) | {"name"})
        raise ValueError(f"{label}: unknown keys {sorted(unknown)}; a {kind} group takes {allowed}")
    if kind == "muon":  # stages that share state wrongly: refused here, not at the first step
        try:
            stages.check_shared_state(stages.group_stages(
                {key: stages.muon_option(group, key) for key in stages.STAGE_KEYS}))
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None
    split, groups = group.get("split") or group.get("qkv_split"), stages.muon_option(group, "split_groups")
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


def added_keys(group: dict) -> list[str]:
    """The keys of a live group that no group of its kind takes: other code's (OneCycleLR's
    max_lr, SWALR's swa_lr, ...); state_dict() lists them in the saved group as ADDED."""
    required, options = kind_keys(group)
    own = PASSIVE_KEYS | set(required) | set(options)
    return sorted(set(group) - own - {NAMES, ADDED})


def check_state_dict(param_groups: list[dict], state_dict: dict) -> dict:
    """Refuse a checkpoint whose groups or state shapes do not fit these params; return it with
    floating state cast to the dtype each param's group keeps (torch casts to the param's), the
    checks made after the cast."""
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
        added = saved.get(ADDED, [])
        if not (isinstance(added, list) and all(isinstance(k, str) for k in added)):
            shown_added = shown(repr(added), 80, quote=False)
            raise ValueError(f"optimizer checkpoint group {i}: {ADDED}={shown_added} is not a "
                             "list of key names; the file is corrupt")
        # keys its constructor would refuse (older checkpoints' keys load as what they meant),
        # but those other code added (ADDED)
        if unknown := sorted(set(added_keys(saved)) - {*LEGACY_KEYS, "ns_method", *added}):
            raise ValueError(f"optimizer checkpoint group {i} has unknown keys {unknown}, which "
                             f"no {group['kind']} group takes; the file is corrupt or from "
                             "another optimizer")
    state_dict = cast_state(param_groups, state_dict)
    where = _saved_places(param_groups, state_dict)
    for pid, st in state_dict["state"].items():
        if pid not in where:
            raise ValueError(f"optimizer checkpoint has state for param id {pid}, "
                             "which no group lists; corrupt file?")
        i, j, p, group = where[pid]
        check_param_state(f"optimizer checkpoint: group {i} param {j}", st, p, group)
    return state_dict


def state_slots(p: Tensor, group: dict) -> dict:
    """name -> muon.StateSlot of each state p may carry in its group's checkpoint: Muon's as its
    stages declare it (stages.muon_state_layout; with state an option turns off now), a registered
    kind's or AdamW's as kinds.state_slots."""
    if group["kind"] == "muon":
        return stages.muon_state_layout(p.shape, p.dtype, group, declared=True)
    return kinds.state_slots(group["kind"], p.shape, p.dtype)


def cast_state(param_groups: list[dict], state_dict: dict) -> dict:
    """state_dict with each floating state tensor in the dtype its group keeps it (state_slots:
    some fp32 on purpose), else the param's, as torch casts; step not."""
    where, state = _saved_places(param_groups, state_dict), {}
    for pid, st in state_dict["state"].items():
        if pid not in where or not isinstance(st, dict):
            state[pid] = st
            continue
        _, _, p, group = where[pid]
        slots = state_slots(p, group)
        kept = {name: getattr(slots.get(name), "dtype", p.dtype) for name in st}
        state[pid] = {name: v.to(kept[name]) if (isinstance(v, Tensor) and v.is_floating_point()
                                                 and kept[name].is_floating_point
                                                 and name != "step") else v
                      for name, v in st.items()}
    return dict(state_dict, state=state)


def check_param_state(where: str, st: dict, p: Tensor, group: dict) -> None:
    """A param's saved state against what its group keeps (state_slots): each a tensor of the
    declared shape and dtype, nothing else but the step count of a kind that keeps one (all but
    Muon, whose group counts); a Muon stage's state missing (a stage added on resume) is made
    afresh, noted."""
    kind, slots = group["kind"], state_slots(p, group)
    counted = kind != "muon"  # a step per param
    keeper = f"a {kind} group" if counted else "this group"  # Muon's: as its stages say
    for name, v in st.items():
        slot, what = slots.get(name), f"{where} state {name!r}"
        if counted and name == "step":  # checked with the values (state_values_problem)
            continue
        if slot is None:
            raise ValueError(f"{what} is not state {keeper} keeps "
                             f"({', '.join(['step'] * counted + [*slots])}); the checkpoint is "
                             "from another optimizer setup")
        if not isinstance(v, Tensor):
            raise ValueError(f"{what} is a {type(v).__name__}, not a tensor; corrupt file?")
        if tuple(v.shape) != tuple(slot.shape) or v.dtype != slot.dtype:
            # Muon's stages keep dtypes of their own; other state was cast (cast_state), so its
            # dtype is wrong only where not a float
            dtypes = not counted or v.dtype != slot.dtype
            saved, kept = (f"{tuple(t.shape)}" + f" {t.dtype}" * dtypes for t in (v, slot))
            said = (f"{where} {name} has shape {saved}, the param has {kept}" if kind == "adamw"
                    else f"{what} is {saved}, {keeper} keeps {kept} for a param of "
                    f"{tuple(p.shape)}")  # AdamW's: shaped as its param
            raise ValueError(f"{said}; the checkpoint is from another model or optimizer setup")
    # a Muon stage's state may be new on resume; momentum and a kind's state exist from step 1
    needed = ["step", *slots] if counted else ["momentum_buffer"] * ("momentum_buffer" in slots)
    if st and (missing := [name for name in needed if name not in st]):
        raise ValueError(f"{where} has state but no {', '.join(missing)}; corrupt file?")
    if st and not counted and (missing := [name for name in stages.muon_state_layout(
            p.shape, p.dtype, group) if name not in st]):
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
        nonnegative = {name for name, s in state_slots(p, group).items() if s.nonnegative}
        for name, v in st.items():
            if group["kind"] != "muon" and name == "step":
                wrong = _bad_step(v)
            else:
                wrong = isinstance(v, Tensor) and _bad_values(v, name in nonnegative)
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
