"""
What an arch is and how it trains. An arch is one record (Arch): the model it builds (GPT reads
it), its AdamW groups, its Muon settings, and the schedules of its lr, Muon momentum and weight
decay. A variant (Variant) is what an optimizer idea changes on top, by named fields.
param_groups() writes a run's groups from the two, every field of each group explicit, as
nanochat's setup_optimizer does; MuonAdamW takes them as they are. Last, the memory a step
of an arch takes (train_memory), which picks the micro-batch that fits.
"""

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from nanomuon import kinds, stages
from nanomuon.common import shown
from nanomuon.param_groups import REQUIRED_KEYS, classify
from nanomuon.recipe import MUON_MOMENTUM, NANOCHAT_BATCH, WEIGHT_DECAY, PeakLRs, peak_lrs


# -- the schedules a run steps its groups through (base_train, at every step) --------------------
def warmup_warmdown(step: int, steps: int, warmup_ratio: float, warmdown_ratio: float,
                    final_lr_frac: float, power: float = 1.0) -> float:
    """nanochat's lr multiplier: linear warmup, flat, then a linear decay to final_lr_frac; power
    1.2 makes the decay PowerCool's (modded-nanogpt record 20): lr = min(lr0, c (T - step)^1.2)."""
    warmup, warmdown = round(warmup_ratio * steps), round(warmdown_ratio * steps)
    if step < warmup:
        return (step + 1) / warmup
    if step <= steps - warmdown:
        return 1.0
    progress = ((steps - step) / warmdown) ** power
    return progress + (1 - progress) * final_lr_frac


# --schedule NAME: every group's lr multiplier (step, steps, warmup ratio, warmdown ratio, final
# lr fraction); a variant picks one with schedule='NAME' (Variant.schedule)
LR_SCHEDULES = {"warmup_warmdown": warmup_warmdown,
                "powercool": functools.partial(warmup_warmdown, power=1.2)}


def classic_momentum(step: int, steps: int, warmdown_ratio: float) -> float:
    """Muon's momentum, classic: 0.85 -> 0.95 over 300 steps, then flat."""
    frac = min(step / 300, 1.0)
    return (1 - frac) * 0.85 + frac * 0.95


def nanochat_momentum(step: int, steps: int, warmdown_ratio: float) -> float:
    """Muon's momentum, nanochat 92d63d4's: 0.85 -> 0.97 over 400 steps, then down to 0.90 across
    the lr warmdown (its last round(warmdown_ratio x steps) steps)."""
    if step < 400:
        frac = step / 400
        return (1 - frac) * 0.85 + frac * 0.97
    warmdown = round(warmdown_ratio * steps)
    if step >= steps - warmdown:
        progress = (step - (steps - warmdown)) / warmdown
        return 0.97 * (1 - progress) + 0.90 * progress
    return 0.97


def cosine_decay(step: int, steps: int, peak: float) -> float:
    """Muon's weight decay, nanochat 92d63d4's: a cosine from `peak` to 0 over the run."""
    return peak * 0.5 * (1 + math.cos(math.pi * step / steps))


# -- the archs: each one record of what it builds, how it trains and on what schedules -----------
class AdamWGroup(NamedTuple):
    """One of an arch's AdamW groups, each a role a variant may name (Variant.roles)."""
    name: str
    lr: str | None  # its PeakLRs lr, times `factor` (and, a table's, the width scale); None: factor
    factor: float = 1.0
    betas: tuple[float, float] | None = None  # None: the variant's adam_betas, else (0.8, 0.95)
    weight_decay: float = 0.0
    params: tuple[str, ...] = ()  # GPT's parameters or modules (all their parameters); (): `name`


class Arch(NamedTuple):
    """An arch: the model it builds (GPT reads these), its groups (param_groups), the schedules of
    Muon's momentum and weight decay (base_train asks them at every step), its memory."""
    about: str  # what it is, in a few words, for base_train's line
    rope_base: float
    window_pattern: str  # config_from_depth's default
    windows: bool  # sliding windows (S in window_pattern) allowed
    extras: bool  # value embeddings, residual and x0 lambdas, smear, backout (_trunk_nanochat)
    qk_scale: float  # q and k each scaled by it after QK-norm (above 1: sharper attention)
    embedding_std: float  # wte's init
    fc_init: float  # c_fc's init bound, as a fraction of the other matrices'
    adamw: tuple[AdamWGroup, ...]
    muon: dict  # the Muon group's settings beyond kind, lr, momentum, ns_steps and weight decay
    momentum: Callable[[int, int, float], float]  # (step, steps, warmdown ratio) -> momentum
    weight_decay: Callable[[int, int, float], float]  # (step, steps, peak) -> weight decay
    # bytes a token keeps for backward, eager and compiled (train_memory): (per layer x width,
    # per vocabulary entry)
    activation_bytes: dict[bool, tuple[int, int]]


# Two generations of nanochat's GPT (docs/training.md): "nanochat" is 92d63d4's, what the GPU
# speedrun trains; "classic" is the plain late-2025 transformer that the CPU miniature, ablate and
# the lr rule were measured with. Activation bytes, in bf16 autocast with fused attention: the
# classic's fit the peak RSS of CPU steps at d3 and d4 (d6 and d8 come out 1.2-1.3x over;
# tests/test_recipe.py checks the bound). The nanochat arch keeps more (an fp32 residual mixed
# with x0, value embeddings): eager, 77 measured on the fake H100 at d24 (tests/test_fake_cuda.py);
# compiled, the classic's scaled alike (36 x 80 / 50) until tests/test_cuda.py measures it on a GPU.
ARCHS = {
    "nanochat": Arch(
        about="nanochat 92d63d4's GPT and recipe", rope_base=100000.0, window_pattern="SSSL",
        windows=True, extras=True, qk_scale=1.2, embedding_std=0.8, fc_init=0.4,
        # nanochat 92d63d4's groups, each with its own betas and decay
        adamw=(AdamWGroup("lm_head", "unembedding_lr", 1.0, (0.8, 0.96), 0.01),
               AdamWGroup("embedding", "embedding_lr", 1.0, (0.8, 0.995), 0.001, ("wte",)),
               AdamWGroup("value_embeds", "embedding_lr", 0.5, (0.8, 0.995), 0.01),
               AdamWGroup("resid_lambdas", "scalar_lr", 0.01, (0.8, 0.95), 0.05),
               AdamWGroup("x0_lambdas", "scalar_lr", 1.0, (0.96, 0.95)),
               AdamWGroup("smear", None, 0.2, (0.8, 0.95), 0.0,
                          ("smear_gate", "smear_lambda", "backout_lambda"))),
        # rows equilibrated before Polar Express and rescaled after, variance reduction at 0.9
        muon=dict(beta2=0.9, precondition=("equilibrate_row_mean",),
                  post_process=("normalize_fro", "variance_reduction")),
        momentum=nanochat_momentum, weight_decay=cosine_decay,
        activation_bytes={False: (80, 3), True: (58, 5)}),
    "classic": Arch(
        about="the classic GPT (nanochat's of late 2025) and its recipe", rope_base=10000.0,
        window_pattern="L", windows=False, extras=False, qk_scale=1.0, embedding_std=1.0,
        fc_init=1.0,  # one betas pair (the variant's adam_betas), no decay
        adamw=(AdamWGroup("lm_head", "unembedding_lr"),
               AdamWGroup("embedding", "embedding_lr", params=("wte",))),
        muon=dict(beta2=0.95), momentum=classic_momentum,
        weight_decay=lambda step, steps, peak: peak,  # flat: the peak throughout
        activation_bytes={False: (50, 3), True: (36, 5)}),
}


# -- a variant: what an optimizer idea changes, by named fields ----------------------------------
class Variant(NamedTuple):
    """How the GPT's params train beyond its arch: nanomuon/variants.py names them; base_train's
    --variant-option and ablate's sweeps set a field by its path (ideas.with_options). The dicts
    are read, never changed: a new setting is a new record (_replace)."""
    matrix_optimizer: str = "muon"  # 'muon' | 'adamw': what trains the block matrices
    # Muon group keys over the arch's (Arch.muon): any of stages.MUON_OPTIONS (beta2=None,
    # precondition='soap', ...); momentum: absent or None, the arch's schedule (Arch.momentum);
    # a number, this variant's own, kept as given all run
    muon_options: dict = {}
    # role -> dict(kind='muon' | 'adamw', lr_factor=, weight_decay_factor=, any key of that
    # kind's groups): that role's params a group of their own (role_groups). The roles: the arch's
    # AdamW groups ('lm_head', 'embedding', ...) and MATRIX_ROLES ('attn.qkv', 'mlp.fc', ...)
    roles: dict = {}
    per_head: bool = False  # True: attention orthogonalized head by head (per_head_groups)
    weight_decay: float | None = None  # Muon's peak decay; None: the run's (else WEIGHT_DECAY)
    # PeakLRs name -> lr at width 768 ('matrix_lr', 'embedding_lr', 'unembedding_lr',
    # 'adamw_matrix_lr', 'scalar_lr'), over param_groups' lrs (the lr rule's); base_train adds
    # the lr flags a run gives where the variant sets none
    lrs: dict = {}
    # the betas of the arch's AdamW groups that set none (Arch.adamw); None: (0.8, 0.95)
    adam_betas: tuple[float, float] | None = None
    schedule: str | None = None  # 'warmup_warmdown' | 'powercool' (LR_SCHEDULES); None: the run's
    optimizer_class: type | None = None  # None: MuonAdamW; a class: optimizer_class(groups)

    def own_flags(self) -> dict:
        """flag name -> value of base_train's flags this variant sets itself (an lr, the weight
        decay, the schedule): its own wins over the flag, which base_train says."""
        own = dict(self.lrs, weight_decay=self.weight_decay, schedule=self.schedule)
        return {k: v for k, v in own.items() if v is not None}


# -- the groups a run trains with ------------------------------------------------------------------
def param_groups(model: torch.nn.Module, variant: Variant | None = None,
                 lrs: PeakLRs | None = None, horizon: int | None = None) -> list[dict]:
    """The GPT's groups: the arch's AdamW groups, then Muon for the block matrices (or AdamW, as
    the variant says), each role the variant names a group of its own. Each lr is its role's at
    width 768 (the variant's, else `lrs`, else the lr rule's at nanochat's batch); AdamW's but the
    scalars' scale as 1/sqrt(width) (Muon's update is orthogonalized, so needs none);
    lrs.multiplier then scales all, here alone. horizon: the run's steps, which stages read."""
    variant, arch = variant or Variant(), ARCHS[model.config.arch]
    if variant.matrix_optimizer not in ("muon", "adamw"):
        raise ValueError(f"matrix_optimizer must be 'muon' or 'adamw', got "
                         f"{variant.matrix_optimizer!r}")
    if variant.matrix_optimizer == "adamw" and (variant.muon_options or variant.per_head):
        raise ValueError("muon_options and per_head need matrix_optimizer='muon': the "
                         "matrices train with one optimizer")
    if variant.adam_betas is not None and all(g.betas for g in arch.adamw):
        raise ValueError(f"adam_betas is the pair of AdamW groups without betas of their own: "
                         f"arch {model.config.arch!r} sets each group's (Arch.adamw)")
    lrs = (lrs or peak_lrs(NANOCHAT_BATCH))._replace(**variant.lrs)
    scale = (model.config.n_embd / 768) ** -0.5
    betas = tuple(variant.adam_betas or (0.8, 0.95))
    tables = [dict(kind="adamw", name=g.name, params=module_params(model, g.params or (g.name,)),
                   # a table's lr (the embeddings', lm_head's) scales with the width, a scalar's not
                   lr=(g.factor if g.lr is None else getattr(lrs, g.lr) * g.factor)
                   * (scale if g.lr in ("embedding_lr", "unembedding_lr") else 1.0),
                   betas=g.betas or betas, eps=1e-10, weight_decay=g.weight_decay)
              for g in arch.adamw]
    decay = WEIGHT_DECAY if variant.weight_decay is None else variant.weight_decay
    muon = (dict(kind="muon", lr=lrs.matrix_lr, momentum=MUON_MOMENTUM, ns_steps=5,
                 weight_decay=decay)
            | arch.muon | ({} if horizon is None else dict(horizon=horizon)) | variant.muon_options)
    if muon["momentum"] is None:  # the arch's schedule stands in for it
        muon["momentum"] = MUON_MOMENTUM
    adamw = dict(kind="adamw", lr=lrs.adamw_matrix_lr * scale, betas=betas, eps=1e-10,
                 weight_decay=0.0)
    matrices = dict(muon if variant.matrix_optimizer == "muon" else adamw, name="matrices",
                    params=[p for name, p in model.named_parameters()  # a seeded model's: one seed's
                            if classify(name, p if model.seeds is None else p[0],
                                        embedding=p is model.wte.weight)[0]
                            and not any(p is q for g in tables for q in g["params"])])
    groups = role_groups(model, tables,
                         per_head_groups(model, matrices) if variant.per_head else [matrices],
                         variant.roles, dict(muon=muon, adamw=adamw))
    groups = [g for g in groups if g["params"]]
    if sum(len(g["params"]) for g in groups) != len(list(model.parameters())):
        raise RuntimeError("a parameter is in no group or in two: Arch.adamw and classify "
                           "must cover the model's own")
    for g in groups:  # the one place the multiplier applies
        g["lr"] = g["initial_lr"] = g["lr"] * lrs.multiplier
        if g["kind"] == "muon":  # the peak a decay schedule scales; a momentum it may keep
            g["initial_weight_decay"], g["initial_momentum"] = g["weight_decay"], g["momentum"]
    return groups


def module_params(model: torch.nn.Module, paths) -> list:
    """The parameters named by `paths`: a parameter's name, or a module's (all its parameters)."""
    named = list(model.named_parameters())
    return [p for path in paths for name, p in named
            if name == path or name.startswith(path + ".")]


# each matrix role's modules within a block
MATRIX_ROLES = {"attn.qkv": ("attn.c_q", "attn.c_k", "attn.c_v"), "attn.proj": ("attn.c_proj",),
                "mlp.fc": ("mlp.c_fc",), "mlp.proj": ("mlp.c_proj",)}
ROLE_FACTORS = ("lr_factor", "weight_decay_factor")  # what a role scales of the group it starts from


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
    group its params are in, else from fresh[kind] (param_groups' Muon group, or its AdamW for
    matrices); an nn.Embedding weight turned Muon is transposed=True (its logical matrix is
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
    if kind not in REQUIRED_KEYS and kind not in kinds.KINDS:
        raise ValueError(f"roles[{role!r}]={shown(repr(spec), 80, quote=False)}: give a dict "
                         f"with kind 'muon', 'adamw' or one of kinds.KINDS {list(kinds.KINDS)} "
                         "(default: the kind it trains with now)")
    options = kinds.KINDS[kind].options if kind in kinds.KINDS else stages.OPTIONS[kind]
    allowed = ({"kind", *ROLE_FACTORS, *REQUIRED_KEYS.get(kind, ()), *options}
               - {"lr", "weight_decay"})
    if unknown := sorted(set(spec) - allowed):
        raise ValueError(f"roles[{role!r}]: {unknown} is not a key of kind {kind!r}: its roles "
                         f"take {sorted(allowed)} (lr and decay as factors)")
    factors = [spec.get(k, 1.0) for k in ROLE_FACTORS]
    if any(stages.a_number(v, 1e3) for v in factors):
        raise ValueError(f"roles[{role!r}]: lr_factor and weight_decay_factor (times the group's "
                         f"it starts from) must be numbers, each in [0, 1000); got {factors}")
    base = source
    if kind != source["kind"] and kind in kinds.KINDS:  # its own lr and decay, not the matrices'
        base = kinds.role_start(kind, source)
    elif kind != source["kind"]:  # an embedding's logical matrix is (dim, vocab): Muon transposes
        base = dict(fresh[kind], transposed=embedding) if kind == "muon" else fresh[kind]
    name = role if source["name"] == role else f"{source['name']}, {role}"
    return dict(base, **{k: v for k, v in spec.items() if k not in ("kind", *ROLE_FACTORS)},
                name=name, params=params, lr=base["lr"] * factors[0],
                weight_decay=base["weight_decay"] * factors[1])


# -- the memory a step takes, which picks the micro-batch that fits -------------------------------
def param_counts(config) -> dict[str, int]:
    """A GPT's parameters by how they train: Muon's matrices, AdamW's vocabulary tables, scalars."""
    c = config
    kv = c.n_kv_head * (c.n_embd // c.n_head)
    matrices = c.n_layer * (2 * c.n_embd * c.n_embd + 2 * c.n_embd * kv + 8 * c.n_embd * c.n_embd)
    tables, small = 2 * c.vocab_size * c.n_embd, 0
    if ARCHS[c.arch].extras:
        with_ve = (c.n_layer + 1) // 2  # every other layer, the last included
        matrices += with_ve * 12 * c.n_kv_head  # the value embeddings' gates
        tables += with_ve * c.vocab_size * kv
        small = 2 * c.n_layer + 24 + 2  # resid and x0 lambdas, the smear gate, two lambdas
    return dict(matrices=matrices, tables=tables, small=small)


def train_memory(config, rows: int, compiled: bool = True, bf16: bool = True) -> dict[str, int]:
    """Estimated peak bytes of training a GPT of this GPTConfig (only its sizes and arch are read)
    on one device, micro-batches of `rows` rows, by part: fp32 params and grads, optimizer state,
    the bf16 copies autocast makes, and activations (twice as many in fp32, bf16=False)."""
    c, n = config, param_counts(config)
    every = n["matrices"] + n["tables"] + n["small"]
    per_layer, per_vocab = ARCHS[c.arch].activation_bytes[compiled]
    per_token = (per_layer * c.n_layer * c.n_embd + per_vocab * c.vocab_size) * (1 if bf16 else 2)
    # Muon: momentum and a per-row second moment; AdamW: two moments of each table and scalar
    optimizer = 4 * n["matrices"] + 4 * 12 * c.n_layer * c.n_embd + 8 * (n["tables"] + n["small"])
    # autocast copies the matrices and lm_head to bf16; lookups are not copied
    copies = 2 * (n["matrices"] + c.vocab_size * c.n_embd) if bf16 else 0
    return dict(params=4 * every, grads=4 * every, optimizer=optimizer, bf16_copies=copies,
                activations=rows * c.sequence_len * per_token)


def fit_device_batch(config, free_bytes: int, rows_per_step: int, cap: int = 32,
                     compiled: bool = True, bf16: bool = True, state: int = 0) -> int:
    """The most rows per micro-batch, a power of two up to cap dividing rows_per_step (a step's rows
    per process), whose train_memory fits in free_bytes less 1 GiB and 15% (CUDA context, kernel
    workspaces, fragmentation); state: optimizer bytes past its estimate (stages' own state). A
    ValueError that says what to change when not even one row fits."""
    budget = 0.85 * free_bytes - 2 ** 30
    rows = 1 << (min(cap, rows_per_step).bit_length() - 1)
    while rows > 1 and (rows_per_step % rows
                        or sum(train_memory(config, rows, compiled, bf16).values()) + state
                        > budget):
        rows //= 2
    need = sum(train_memory(config, rows, compiled, bf16).values()) + state
    if need > budget:
        raise ValueError(f"one row of {config.sequence_len} tokens of this {config.n_layer}-layer "
                         f"model needs about {need / 2 ** 30:.1f} GiB, and "
                         f"{free_bytes / 2 ** 30:.1f} GiB are free: lower --depth or "
                         "--max-seq-len, or use a GPU with more memory (or --fsdp over several)")
    return rows
