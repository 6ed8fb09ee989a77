"""
The training recipe, decided before the first step: the lr rule (rule_lrs: every default lr and
Muon's weight decay, from the CPU's sweep to nanochat's GPU recipe as the batch grows), Muon's
higher lr for short runs, and nanochat's batch, weight decay and schedule for a horizon
(training_recipe). Pure functions of token counts, so the model takes its default lrs from here
before anything is allocated (an arch's memory: nanomuon/arch.py's train_memory).
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
# CPU's batch: sweep it there. AdamW's lrs scale as 1/sqrt(width / 768) (arch.param_groups);
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
# Muon's momentum as a group is built; an arch's schedule (arch.Arch.momentum) stands in for it
MUON_MOMENTUM = 0.95


def _between(at_rule: float, at_nanochat: float, total_batch_size: int) -> float:
    """The power law through (RULE_BATCH, at_rule) and (NANOCHAT_BATCH, at_nanochat): at_rule
    below RULE_BATCH, the law up to NANOCHAT_BATCH, then times sqrt(B / NANOCHAT_BATCH)."""
    between = min(max(total_batch_size, RULE_BATCH), NANOCHAT_BATCH)
    exponent = math.log(at_nanochat / at_rule) / math.log(NANOCHAT_BATCH / RULE_BATCH)
    return (at_rule * (between / RULE_BATCH) ** exponent
            * max(1.0, total_batch_size / NANOCHAT_BATCH) ** 0.5)


def rule_lrs(total_batch_size: int) -> dict[str, float]:
    """Each group's lr at width 768 (the PeakLRs fields) at total_batch_size tokens a
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
    its lr here (at width 768) x param_groups' width scale x `multiplier` (--lr-multiplier)."""
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
    lrs: dict  # each group's lr at width 768, the PeakLRs fields
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
