"""
Named optimizer variants: what `base_train --optimizer NAME` trains with and
`scripts.ablate` compares.

Each entry holds keyword arguments for GPT.setup_optimizer. To try an idea, add an entry (a new
orthogonalizer: one function registered in update_math.ORTHOGONALIZERS, and an entry naming it),
then run `python -m scripts.ablate --variants muon,<yours>`. An entry that sets what a flag sets
(an lr, weight_decay) overrides that flag, and base_train says so;
--lr-multiplier still scales it. It lives here, not in the model file, so the model knows nothing of
baselines.
"""

from nanomuon.baselines import TorchMuonAdamW

OPTIMIZER_VARIANTS = {
    "muon": {},  # the default: Muon (Polar Express, variance reduction, cautious wd) + AdamW
    "adamw": dict(matrix_optimizer="adamw"),  # the baseline: AdamW everywhere
    "muon-no-vr": dict(muon_options=dict(beta2=None)),  # without factored variance reduction
    "muon-jordan": dict(muon_options=dict(ns_coefficients="jordan")),  # Keller Jordan's NS5 triple
    "muon-no-nesterov": dict(muon_options=dict(nesterov=False)),
    "muon-no-cautious-wd": dict(muon_options=dict(cautious_wd=False)),
    # MuonEq's default (rows; nanochat's too)
    "muon-eq": dict(muon_options=dict(equilibrate="row")),
    "muon-plus": dict(muon_options=dict(post_normalize="col_row")),  # Muon+, its GPT-small setting
    "muon-per-head": dict(per_head=True),  # attention matrices orthogonalized head by head
    # Gram Newton-Schulz on every matrix, in fp32: in bf16 it is not accurate
    # (update_math.use_gram), and CPUs run fp16 matmuls at a few GFLOP/s
    "muon-gram": dict(muon_options=dict(orthogonalizer="gram_newton_schulz", ns_precision="fp32")),
    # stock torch.optim.Muon + torch.optim.AdamW (baselines.py) on the same groups and lrs
    "torch-muon": dict(optimizer_class=TorchMuonAdamW, muon_options=dict(beta2=None)),
}
