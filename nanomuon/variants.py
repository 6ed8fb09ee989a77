"""
Named optimizer variants: what `base_train --optimizer NAME` trains with and `scripts.ablate`
compares. Each is a Variant record (nanomuon/arch.py: each field, its values and its default);
arch.param_groups writes the groups from it. One that sets what a flag sets (an lr, the decay,
the schedule) overrides the flag (base_train says so), and --lr-multiplier still scales it.
Adding one: README.md, "Trying an idea".
"""

from nanomuon.arch import Variant
from nanomuon.baselines import TorchMuonAdamW

# A role turned to another kind (kinds.py) keeps its own lr and decay, times these factors.
# Lion (Chen et al. 2023): an lr 3-10x below AdamW's, the decay as much above (lr x wd kept).
# Adam-mini (Zhang et al. 2024): AdamW's lr, betas and eps, one second moment per token.
LION = dict(kind="lion", lr_factor=0.3, weight_decay_factor=1 / 0.3)
ADAM_MINI = dict(kind="adam_mini")
# the nanochat arch's AdamW roles: the embeddings, the head and the scalars (classic: the first 2)
NANOCHAT_ROLES = ("embedding", "lm_head", "value_embeds", "resid_lambdas", "x0_lambdas", "smear")

OPTIMIZER_VARIANTS = {
    # the default: Muon (Polar Express, variance reduction, cautious wd) + AdamW
    "muon": Variant(),
    "adamw": Variant(matrix_optimizer="adamw"),  # the baseline: AdamW everywhere
    "muon-no-vr": Variant(muon_options=dict(beta2=None)),  # without factored variance reduction
    "muon-jordan": Variant(muon_options=dict(ns_coefficients="jordan")),  # Keller Jordan's NS5 triple
    "muon-no-nesterov": Variant(muon_options=dict(nesterov=False)),
    "muon-no-cautious-wd": Variant(muon_options=dict(apply="decoupled")),
    "muon-eq": Variant(muon_options=dict(precondition="equilibrate_row")),  # MuonEq's, nanochat's
    # Muon+, its GPT-small setting
    "muon-plus": Variant(muon_options=dict(post_process=("normalize_col_row", "variance_reduction"))),
    "muon-per-head": Variant(per_head=True),  # attention matrices orthogonalized head by head
    # Gram Newton-Schulz in fp32: bf16 is inaccurate (owners.gram_pays), CPUs' fp16 slow
    "muon-gram": Variant(muon_options=dict(orthogonalizer="gram_newton_schulz", ns_precision="fp32")),
    # six from modded-nanogpt's optimization track, each one or two stages or a schedule
    "muon-hyperball": Variant(muon_options=dict(apply="hyperball")),  # MuonH, on NorMuon
    "muon-uw-floor": Variant(muon_options=dict(post_process=("variance_reduction", "uw_floor"))),
    "muon-soap": Variant(muon_options=dict(precondition="soap")),  # SOAP-Muon
    # ContraMuon (record 11): on any orthogonalizer, before variance reduction as published
    "muon-contra": Variant(muon_options=dict(post_process=("contra", "variance_reduction"))),
    "muon-powercool": Variant(schedule="powercool"),  # the lr schedule (arch.LR_SCHEDULES)
    # Muown (record 23): rows as gain x direction, Muon on the direction, Adam on the gain; no
    # variance reduction or weight decay. The record's lrs as factors on Muon's (0.00325 / 0.02 =
    # 0.1625; the direction's x 0.2 x sqrt(max(rows, cols))); 5 NS steps (its 12), one v-norm target
    "muon-muown": Variant(muon_options=dict(precondition="muown", post_process=(), apply="muown",
                                    lr_scale="spectral", extra_scale=0.1625 * 0.2,
                                    muown_gain_lr=0.1625)),
    # Newton-Muon (record 15): gradients times their inputs' inverse covariance, refreshed every
    # 64 of the record's 3,275 steps (0.02 of the run), then plain Muon; its per-role lrs and
    # decays as ratios to q/k/v's (0.020, 0.025): attn.proj 0.025, mlp.fc 0.030/0.0375, proj 0.030
    "muon-newton": Variant(muon_options=dict(precondition="newton", input_interval=0.02,
                                     post_process=(), apply="decoupled"),
                           roles={"attn.proj": dict(lr_factor=1.25),
                                  "mlp.fc": dict(lr_factor=1.5, weight_decay_factor=1.5),
                                  "mlp.proj": dict(lr_factor=1.5)}),
    # unconstrained Scion (Pethick et al. 2025, arXiv 2502.07529): each layer's LMO of an EMA of
    # its grads (their momentum 0.1 is our 0.9, no Nesterov), x -= lr x scale x lmo, no decay, no
    # Adam; their shallow-nanogpt scales: hidden Spectral 3, embedding ColNorm 1, lm_head Sign 10
    "scion": Variant(weight_decay=0.0, muon_options=dict(
        momentum=0.9, nesterov=False, precondition=(), orthogonalizer="newton_schulz",
        ns_coefficients="jordan", post_process=(), apply="decoupled", lr_scale="unit_rms",
        extra_scale=3.0), roles={
        "embedding": dict(kind="muon", orthogonalizer="col_norm", lr_scale="one", extra_scale=1.0),
        "lm_head": dict(kind="muon", orthogonalizer="sign", lr_scale="one", extra_scale=10.0)}),
    # the embedding and head on Lion or Adam-mini, each at its own lr times the factor
    "muon-lion": Variant(roles=dict.fromkeys(("embedding", "lm_head"), LION)),
    "muon-adam-mini": Variant(roles=dict.fromkeys(("embedding", "lm_head"), ADAM_MINI)),
    # and the nanochat arch's value embeddings and scalars (--arch nanochat; classic lacks them)
    "muon-lion-nanochat": Variant(roles=dict.fromkeys(NANOCHAT_ROLES, LION)),
    "muon-adam-mini-nanochat": Variant(roles=dict.fromkeys(NANOCHAT_ROLES, ADAM_MINI)),
    # stock torch.optim.Muon + torch.optim.AdamW (baselines.py) on the same groups and lrs
    "torch-muon": Variant(optimizer_class=TorchMuonAdamW,
                          muon_options=dict(beta2=None, precondition=(), post_process=())),
}
