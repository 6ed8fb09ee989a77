"""
The training recipe, decided before the first step: the lr rule (rule_lrs: every default lr and
Muon's weight decay, from the CPU's sweep to nanochat's GPU recipe as the batch grows), Muon's
higher lr for short runs, nanochat's batch, weight decay and schedule for a horizon
(training_recipe), and a step's memory (train_memory), which picks the micro-batch that fits
(fit_device_batch). Pure functions of sizes and token counts, so the model takes its default lrs
from here and base_train sizes a run before allocating anything.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

# The lr rule, the one source of every default lr: each group's lr at width 768 was measured at two
# batches, RULE_BATCH (the CPU miniature's sweep, RULE_LRS) and NANOCHAT_BATCH (nanochat's recipe,
# tuned on its d12, NANOCHAT_LRS), and the rule joins them with a power law (docs/lr_rule.md).
# Above NANOCHAT_BATCH every lr grows as sqrt(B / NANOCHAT_BATCH), nanochat's rule (Muon's too, an
# assumption nanochat states); below RULE_BATCH the rule keeps the slope the CPU's sweeps at 2x and
# 4x its batch found (CPU_EXPONENTS). Muon's lr is 0.02 at both ends, but its best rises at 2-4x the
# CPU's batch: sweep it there. AdamW's lrs scale as 1/sqrt(width / 768) (GPT.setup_optimizer);
# Muon's do not: its update is orthogonalized, so its size does not grow with the width.
RULE_BATCH = 4096
RULE_LRS = dict(embedding_lr=0.075, unembedding_lr=0.002, adamw_matrix_lr=0.001, matrix_lr=0.02,
                scalar_lr=0.5)
NANOCHAT_BATCH = 2 ** 19  # B_ref: nanochat's measured best batch at d12's horizon
# nanochat's base_train defaults: no AdamW matrix lr (that group keeps its CPU slope); its scalar
# lr holds everywhere (the CPU's was never tuned)
NANOCHAT_LRS = dict(embedding_lr=0.3, unembedding_lr=0.008, matrix_lr=0.02, scalar_lr=0.5)
CPU_EXPONENTS = dict(embedding_lr=0.2, unembedding_lr=0.2, adamw_matrix_lr=0.2, matrix_lr=0.0,
                     scalar_lr=0.0)
NANOCHAT_REF_DEPTH = 12  # the model whose horizon is D_ref
NANOCHAT_TOKENS_PER_PARAM = 10.5  # its compute-optimal tokens per scaling param (scaling_params)
POWER_LINES_EXPONENT = 0.383  # best batch grows as D^0.383 (Power Lines, arXiv 2505.13738)
# Muon's weight decay at RULE_BATCH (the CPU's, never swept) and nanochat's at NANOCHAT_BATCH and
# D_ref; in between the same power law as the lrs
WEIGHT_DECAY = 0.2
NANOCHAT_WEIGHT_DECAY = 0.28
# Muon's momentum as a group is built; an arch's schedule (gpt.Arch.momentum) stands in for it
MUON_MOMENTUM = 0.95


def _between(at_rule: float, at_nanochat: float, total_batch_size: int) -> float:
    """The power law through (RULE_BATCH, at_rule) and (NANOCHAT_BATCH, at_nanochat): at_rule
    below RULE_BATCH, the law up to NANOCHAT_BATCH, then times sqrt(B / NANOCHAT_BATCH)."""
    between = min(max(total_batch_size, RULE_BATCH), NANOCHAT_BATCH)
    exponent = math.log(at_nanochat / at_rule) / math.log(NANOCHAT_BATCH / RULE_BATCH)
    return (at_rule * (between / RULE_BATCH) ** exponent
            * max(1.0, total_batch_size / NANOCHAT_BATCH) ** 0.5)


def rule_lrs(total_batch_size: int) -> dict[str, float]:
    """Each group's lr at width 768 (setup_optimizer's arguments) at total_batch_size tokens a
    step: the CPU's below RULE_BATCH, the power law up to NANOCHAT_BATCH, sqrt scaling above."""
    if total_batch_size < 1:
        raise ValueError(f"the lr rule needs 1 or more tokens per step, got {total_batch_size}")
    below = min(total_batch_size / RULE_BATCH, 1.0)
    lrs = {}
    for key, lr in RULE_LRS.items():
        gpu = NANOCHAT_LRS.get(key, lr * (NANOCHAT_BATCH / RULE_BATCH) ** CPU_EXPONENTS[key])
        # _between holds the CPU's lr below RULE_BATCH: the CPU's slope takes it down from there
        lrs[key] = _between(lr, gpu, total_batch_size) * below ** CPU_EXPONENTS[key]
    return lrs


class PeakLRs(NamedTuple):
    """Each group's peak lr, decided once before the optimizer is built: a group's initial_lr is
    its lr here (at width 768) x setup_optimizer's width scale x `multiplier` (--lr-multiplier)."""
    embedding_lr: float
    unembedding_lr: float
    matrix_lr: float
    adamw_matrix_lr: float
    scalar_lr: float
    multiplier: float = 1.0


def peak_lrs(total_batch_size: int, multiplier: float = 1.0, **given: float | None) -> PeakLRs:
    """The PeakLRs at total_batch_size tokens a step: each lr given (not None), else the rule's."""
    chosen = {k: v for k, v in given.items() if v is not None}
    return PeakLRs(**(rule_lrs(total_batch_size) | chosen), multiplier=multiplier)


def rule_weight_decay(total_batch_size: int) -> float:
    """Muon's weight decay before training_recipe's horizon scaling, by the lrs' rule: WEIGHT_DECAY
    up to RULE_BATCH, the power law to nanochat's, then sqrt(B / NANOCHAT_BATCH)."""
    return _between(WEIGHT_DECAY, NANOCHAT_WEIGHT_DECAY, total_batch_size)


# The CPU rule was tuned at RULE_STEPS steps; in shorter runs Muon's matrices do best at a higher
# lr while AdamW's stay best (at 76 steps of RULE_BATCH tokens: matrices at 2x, the rest at 1x;
# docs/research.md). ablate, whose budgets make short runs, trains them at short_run_matrix_lr.
RULE_STEPS = 200
SHORT_RUN_EXPONENT = 0.7  # 2x at 76 steps: (200 / 76) ** 0.7 = 1.97
SHORT_RUN_FLOOR = 50  # fewer steps get 50's lr (2.6x): shorter is not training, just its start


def short_run_matrix_lr(steps: int, total_batch_size: int) -> float:
    """Muon's matrix lr for `steps` steps of total_batch_size (< NANOCHAT_BATCH) tokens: the rule's,
    times (RULE_STEPS / steps) ** SHORT_RUN_EXPONENT when shorter (steps >= SHORT_RUN_FLOOR)."""
    if not 0 < total_batch_size < NANOCHAT_BATCH or steps < 1:
        raise ValueError(f"short_run_matrix_lr is the CPU rule's, for 1 or more steps below "
                         f"{NANOCHAT_BATCH:,} tokens; got {steps} steps of {total_batch_size:,}")
    return (rule_lrs(total_batch_size)["matrix_lr"]
            * max(1.0, RULE_STEPS / max(steps, SHORT_RUN_FLOOR)) ** SHORT_RUN_EXPONENT)


# The lr schedule each regime was measured with: the CPU miniature's below NANOCHAT_BATCH;
# nanochat's, tuned on d12 together with NANOCHAT_LRS and NANOCHAT_WEIGHT_DECAY, from there
RECIPE_SCHEDULES = {False: dict(warmup_steps=0, warmdown_ratio=0.4, final_lr_frac=0.0),
                    True: dict(warmup_steps=40, warmdown_ratio=0.65, final_lr_frac=0.05)}


@dataclass(frozen=True)
class Recipe:
    """What training_recipe chose, and why (one line per choice, for base_train to print)."""
    total_batch_size: int
    lrs: dict  # each group's lr at width 768, setup_optimizer's arguments
    weight_decay: float
    schedule: dict  # warmup_steps, warmdown_ratio, final_lr_frac
    why: tuple[str, ...]


def training_recipe(horizon: float, ref_horizon: float, total_batch_size: int | None = None,
                    weight_decay: float | None = None) -> Recipe:
    """Batch, lrs, Muon's weight decay and schedule for a run of `horizon` tokens; ref_horizon is
    nanochat's D_ref (as many tokens per scaling param at d12). A batch left out is nanochat's
    (Power Lines). A weight decay left out is the rule's, times ref_horizon / horizon from
    NANOCHAT_BATCH up, which holds AdamW's T_epoch (arXiv 2405.13698) under sqrt lr scaling."""
    if horizon <= 0 or ref_horizon <= 0:
        raise ValueError(f"training_recipe needs horizons > 0 tokens, got {horizon} and "
                         f"{ref_horizon}")
    why, given = [], weight_decay is not None
    if total_batch_size is None:
        predicted = NANOCHAT_BATCH * (horizon / ref_horizon) ** POWER_LINES_EXPONENT
        total_batch_size = 2 ** max(0, round(math.log2(predicted)))
        why.append(f"batch {total_batch_size:,} tokens/step: nanochat's 2^19 at d12's horizon "
                   f"x (D / D_ref)^0.383 = {predicted:,.0f}, to a power of 2 (Power Lines)")
    gpu = total_batch_size >= NANOCHAT_BATCH
    scale = (total_batch_size / NANOCHAT_BATCH) ** 0.5
    if weight_decay is None:
        weight_decay = rule_weight_decay(total_batch_size)
        if gpu:
            weight_decay *= ref_horizon / horizon
            why.append(f"weight decay {weight_decay:.4g}: nanochat's {NANOCHAT_WEIGHT_DECAY} x "
                       f"sqrt(B / 2^19) x D_ref / D (a horizon of {horizon:,.0f} tokens, "
                       f"{horizon / ref_horizon:.3g}x d12's), T_epoch held")
    lrs = rule_lrs(total_batch_size)
    shown = ", ".join(f"{name} {lrs[key]:.4g}" for name, key in (
        ("embedding", "embedding_lr"), ("lm_head", "unembedding_lr"), ("Muon", "matrix_lr"),
        ("scalars", "scalar_lr")))
    why.append(f"lrs at width 768: {shown}: " + (
        f"nanochat's at 2^19 x sqrt(B / 2^19) = {scale:.3g}" if gpu else
        f"the lr rule's at {total_batch_size:,} tokens/step (the CPU's tuned at {RULE_BATCH:,}, "
        "nanochat's at 2^19, a power law between)"))
    lr = lrs["matrix_lr"]
    if lr * weight_decay >= 1:  # each step would scale the weights by <= 0
        if given:
            raise ValueError(f"--weight-decay {weight_decay:g} x Muon's lr {lr:.3g} >= 1 would "
                             "flip the weights' sign at every step: give a --weight-decay below "
                             f"{1 / lr:.3g}")
        raise ValueError(f"Muon's weight decay {weight_decay:.4g} x lr {lr:.3g} >= 1 would flip "
                         f"the weights' sign: a horizon of {horizon:,.0f} tokens is too short for "
                         f"{total_batch_size:,}-token steps; give --weight-decay, a smaller batch "
                         "or a longer horizon")
    return Recipe(total_batch_size, lrs, weight_decay, dict(RECIPE_SCHEDULES[gpu]), tuple(why))


# Bytes per token autograd keeps plus backward's largest temporaries, in bf16 autocast with fused
# attention: per layer and unit of width, and per vocabulary entry (the logits). The classic GPT's
# fit the peak RSS of CPU steps at d3 and d4 (d6 and d8 come out 1.2-1.3x over; tests/test_recipe.py
# checks the bound). Arch 'nanochat' keeps more (an fp32 residual mixed with x0, value embeddings):
# eager, 77 measured on the fake H100 at d24 (tests/test_fake_cuda.py); compiled, the classic's
# scaled alike (36 x 80 / 50) until tests/test_cuda.py measures it on a GPU.
# arch -> compiled -> (per layer x width, per vocab entry)
ACTIVATION_BYTES = {"classic": {False: (50, 3), True: (36, 5)},
                    "nanochat": {False: (80, 3), True: (58, 5)}}


def param_counts(config) -> dict[str, int]:
    """A GPT's parameters by how they train: Muon's matrices, AdamW's vocabulary tables, scalars."""
    c = config
    kv = c.n_kv_head * (c.n_embd // c.n_head)
    matrices = c.n_layer * (2 * c.n_embd * c.n_embd + 2 * c.n_embd * kv + 8 * c.n_embd * c.n_embd)
    tables, small = 2 * c.vocab_size * c.n_embd, 0
    if getattr(c, "arch", "classic") == "nanochat":
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
    per_layer, per_vocab = ACTIVATION_BYTES[getattr(c, "arch", "classic")][compiled]
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
