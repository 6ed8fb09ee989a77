"""
Named optimizer variants: what `base_train --optimizer NAME` trains with and
`scripts.ablate` compares.

Each entry holds keyword arguments for GPT.setup_optimizer, and may name base_train's lr schedule
(schedule=). How to try an idea with a new entry: README.md, "Trying an idea". An entry that sets
what a flag sets (an lr, weight_decay) overrides that flag, and base_train says so; --lr-multiplier
still scales it. It lives here, not in the model file, so the model knows nothing of baselines.
"""

from nanomuon.baselines import TorchMuonAdamW

OPTIMIZER_VARIANTS = {
    "muon": {},  # the default: Muon (Polar Express, variance reduction, cautious wd) + AdamW
    "adamw": dict(matrix_optimizer="adamw"),  # the baseline: AdamW everywhere
    "muon-no-vr": dict(muon_options=dict(beta2=None)),  # without factored variance reduction
    "muon-jordan": dict(muon_options=dict(ns_coefficients="jordan")),  # Keller Jordan's NS5 triple
    "muon-no-nesterov": dict(muon_options=dict(nesterov=False)),
    "muon-no-cautious-wd": dict(muon_options=dict(apply="decoupled")),
    # MuonEq's default (rows; nanochat's too)
    "muon-eq": dict(muon_options=dict(precondition="equilibrate_row")),
    # Muon+, its GPT-small setting
    "muon-plus": dict(muon_options=dict(post_process=("normalize_col_row", "variance_reduction"))),
    "muon-per-head": dict(per_head=True),  # attention matrices orthogonalized head by head
    # Gram Newton-Schulz on every matrix, in fp32: in bf16 it is not accurate
    # (update_math.gram_pays), and CPUs run fp16 matmuls at a few GFLOP/s
    "muon-gram": dict(muon_options=dict(orthogonalizer="gram_newton_schulz", ns_precision="fp32")),
    # six from modded-nanogpt's optimization track, each one or two stages (update_math) or a
    # schedule
    "muon-hyperball": dict(muon_options=dict(apply="hyperball")),  # MuonH, on NorMuon
    "muon-uw-floor": dict(muon_options=dict(post_process=("variance_reduction", "uw_floor"))),
    "muon-soap": dict(muon_options=dict(precondition="soap")),  # SOAP-Muon
    # ContraMuon (record 11): on any orthogonalizer, before variance reduction as published
    "muon-contra": dict(muon_options=dict(post_process=("contra", "variance_reduction"))),
    "muon-powercool": dict(schedule="powercool"),  # the lr schedule (base_train.SCHEDULES)
    # Muown (record 23): rows as gain x direction, Muon on the direction (its momentum the
    # precondition's own), Adam on the gain, the v-norm schedule over the run; no variance
    # reduction, no weight decay. The record's lrs as factors on Muon's matrix lr (its 0.00325
    # against its Muon's 0.02): the direction's step lr x 0.1625 x 0.2 x sqrt(max(rows, cols)),
    # the gain's lr x 0.1625. Polar Express at nanomuon's 5 steps (the record runs 12), one
    # v-norm target for every matrix (the record's mlp.proj takes 3.33x)
    "muon-muown": dict(muon_options=dict(precondition="muown", post_process=(), apply="muown",
                                         lr_scale="spectral", extra_scale=0.1625 * 0.2,
                                         muown_gain_lr=0.1625)),
    # Newton-Muon (record 15): each matrix's gradient times the inverse covariance of its inputs,
    # refreshed every 64 of the record's 3,275 steps (0.02 of the run here), then plain Muon
    # (no variance reduction, decoupled decay). Its lrs and decays per role as ratios to q/k/v's
    # (0.020 and 0.025): attn.proj 0.025, mlp.fc 0.030 and 0.0375, mlp.proj 0.030
    "muon-newton": dict(muon_options=dict(precondition="newton", input_interval=0.02,
                                          post_process=(), apply="decoupled"),
                        roles={"attn.proj": dict(lr_factor=1.25),
                               "mlp.fc": dict(lr_factor=1.5, weight_decay_factor=1.5),
                               "mlp.proj": dict(lr_factor=1.5)}),
    # stock torch.optim.Muon + torch.optim.AdamW (baselines.py) on the same groups and lrs
    "torch-muon": dict(optimizer_class=TorchMuonAdamW,
                       muon_options=dict(beta2=None, precondition=(), post_process=())),
}


def optimizer_kwargs(name: str) -> dict:
    """Variant `name`'s GPT.setup_optimizer arguments: all but its schedule (base_train's)."""
    return {k: v for k, v in OPTIMIZER_VARIANTS[name].items() if k != "schedule"}
