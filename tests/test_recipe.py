"""The training recipe (nanomuon/recipe.py): the lr rule between the CPU's tuned lrs and nanochat's,
nanochat's GPU recipe written out and compared, and the memory estimate against a measured step."""

import math
from pathlib import Path

import pytest
import torch

from nanomuon.arch import fit_device_batch, train_memory
from nanomuon.gpt import GPT, config_from_depth, scaling_params
from nanomuon.recipe import rule_lrs, rule_weight_decay, training_recipe
from nanomuon.variants import OPTIMIZER_VARIANTS

# Measured, not derived from the rule: each group's tuned lr at width 768 at the CPU miniature's
# 4,096 tokens per step (docs/lr_rule.md), and nanochat's at 2^19 tokens per step, tuned on its
# d12 (its scripts/base_train.py defaults, nanochat 92d63d4): the two ends the rule joins.
TUNED_AT_4096 = dict(embedding=0.075, lm_head=0.002, matrices=0.02, adamw_matrices=0.001)
NANOCHAT_AT_2_19 = dict(embedding=0.3, lm_head=0.008, matrices=0.02, scalars=0.5)
NANOCHAT_WEIGHT_DECAY, CPU_WEIGHT_DECAY = 0.28, 0.2
RULE_KEYS = dict(embedding="embedding_lr", lm_head="unembedding_lr", matrices="matrix_lr",
                 scalars="scalar_lr", adamw_matrices="adamw_matrix_lr")


def between(at_4096: float, at_2_19: float, batch: int) -> float:
    """A power law through both ends, written as a weighted geometric mean: log2(batch) lies
    w of the way from 12 (4,096) to 19 (2^19)."""
    w = (math.log2(batch) - 12) / 7
    return at_4096 ** (1 - w) * at_2_19 ** w


@pytest.mark.parametrize("batch", [2 ** 13, 2 ** 17, 2 ** 18])
def test_lr_rule_joins_the_cpus_tuned_lrs_to_nanochats(batch):
    """Between 4,096 and 2^19 tokens per step each group's lr and Muon's weight decay lie on the
    power law through the CPU's tuned value and nanochat's, not on an extrapolation from one end;
    the adamw variant's matrices, which nanochat does not train with AdamW, keep the CPU's B^0.2.
    At 2^17 nanochat's own sqrt rule would give 0.15 and 0.004: the rule is above it."""
    got = rule_lrs(batch)
    for name in ("embedding", "lm_head", "matrices"):
        want = between(TUNED_AT_4096[name], NANOCHAT_AT_2_19[name], batch)
        assert got[RULE_KEYS[name]] == pytest.approx(want, rel=1e-12), name
    assert got["matrix_lr"] == 0.02 and got["scalar_lr"] == 0.5
    assert got["adamw_matrix_lr"] == pytest.approx(0.001 * (batch / 4096) ** 0.2, rel=1e-12)
    assert rule_weight_decay(batch) == pytest.approx(
        between(CPU_WEIGHT_DECAY, NANOCHAT_WEIGHT_DECAY, batch), rel=1e-12)
    if batch == 2 ** 17:  # 0.075^(2/7) 0.3^(5/7) and 0.002^(2/7) 0.008^(5/7)
        assert got["embedding_lr"] == pytest.approx(0.2019, abs=1e-4)
        assert got["unembedding_lr"] == pytest.approx(0.005383, abs=1e-6)


def test_lr_rule_below_4096_keeps_the_cpus_slope():
    """Below the CPU's tuned batch nothing was measured: AdamW's lrs follow (B / 4,096)^0.2, the
    slope the CPU's sweeps found just above it, Muon's and the weight decay stay."""
    for batch in (256, 1024, 4096):
        got = rule_lrs(batch)
        for name, lr in TUNED_AT_4096.items():
            want = lr * (batch / 4096) ** (0 if name == "matrices" else 0.2)
            assert got[RULE_KEYS[name]] == pytest.approx(want, rel=1e-12), (batch, name)
        assert rule_weight_decay(batch) == 0.2
    with pytest.raises(ValueError, match="1 or more tokens per step, got 0"):
        rule_lrs(0)


def nanochat_recipe(depth: int, total_batch_size: int | None, ratio: float = 8.0,
                    vocab: int = 32768) -> dict:
    """nanochat's scripts/base_train.py (92d63d4), written out: the horizon is ratio x (block
    matrices + lm_head) params, D_ref is d12's, B_ref = 2^19; a batch left out is
    2^round(log2(B_ref (D / D_ref)^0.383)); its default lrs (embedding 0.3, lm_head 0.008, Muon
    0.02, scalars 0.5) scale by sqrt(B / B_ref); weight decay 0.28 sqrt(B / B_ref) D_ref / D;
    warmup 40 steps, warmdown 0.65, final lr 0.05. Our GPT's matrices: 12 width^2 a block
    (attention 4, MLP 8)."""
    def matrices_and_head(d: int) -> int:
        width = d * 64  # aspect ratio 64, a multiple of head_dim 128 at even depths
        return 12 * d * width ** 2 + vocab * width

    tokens, ref_tokens = ratio * matrices_and_head(depth), ratio * matrices_and_head(12)
    if total_batch_size is None:
        total_batch_size = 2 ** round(math.log2(2 ** 19 * (tokens / ref_tokens) ** 0.383))
    lr_scale = (total_batch_size / 2 ** 19) ** 0.5
    return dict(total_batch_size=total_batch_size, lr_scale=lr_scale,
                lrs=dict(embedding_lr=0.3 * lr_scale, unembedding_lr=0.008 * lr_scale,
                         matrix_lr=0.02 * lr_scale, scalar_lr=0.5 * lr_scale),
                weight_decay=0.28 * lr_scale * ref_tokens / tokens,
                schedule=dict(warmup_steps=40, warmdown_ratio=0.65, final_lr_frac=0.05))


@pytest.mark.parametrize("depth", [12, 24])
@pytest.mark.parametrize("batch", [2 ** 19, 2 ** 20, None])
def test_gpu_recipe_is_nanochats(depth, batch):
    """At 2^19 tokens per step and above every default is nanochat's: the batch from the horizon
    when left out, each lr (Muon's and the scalars' too) its default times sqrt(B / 2^19), weight
    decay scaled with batch and horizon, its schedule; a given weight decay wins."""
    want = nanochat_recipe(depth, batch)
    ref = scaling_params(config_from_depth(12, 32768, 2048))
    got = training_recipe(8 * scaling_params(config_from_depth(depth, 32768, 2048)), 8 * ref,
                          batch)
    assert got.total_batch_size == want["total_batch_size"]
    assert got.weight_decay == pytest.approx(want["weight_decay"], rel=1e-12)
    assert {k: got.lrs[k] for k in want["lrs"]} == pytest.approx(want["lrs"], rel=1e-12)
    assert got.schedule == want["schedule"]
    assert training_recipe(1e9, 1e9, batch, weight_decay=0.1).weight_decay == 0.1
    if batch is None:  # nanochat's speedrun shapes: d12 at 2^19, d24 at 2^20 (its 1M-token steps)
        assert got.total_batch_size == {12: 2 ** 19, 24: 2 ** 20}[depth]
    if (depth, batch) == (12, 2 ** 19):  # the point nanochat tuned: its defaults as they are
        assert got.lrs == pytest.approx(dict(embedding_lr=0.3, unembedding_lr=0.008,
                                             matrix_lr=0.02, scalar_lr=0.5,
                                             adamw_matrix_lr=got.lrs["adamw_matrix_lr"]))
        assert got.weight_decay == pytest.approx(0.28)


def test_cpu_recipe_below_2_19():
    """Below 2^19 tokens per step the weight decay is the rule's, whatever the horizon, and the
    schedule the CPU's; at 4,096 they are the CPU's as tuned; a batch from a short horizon lands
    below 2^19; a derived weight decay that would flip the weights is refused in one line."""
    got = training_recipe(1e6, 1e9, 4096)
    assert got.weight_decay == 0.2 and got.lrs == rule_lrs(4096)
    assert got.schedule == dict(warmup_steps=0, warmdown_ratio=0.4, final_lr_frac=0.0)
    got = training_recipe(1e6, 1e9, 2 ** 18)
    assert got.weight_decay == pytest.approx(0.2 ** (1 / 7) * 0.28 ** (6 / 7), rel=1e-12)
    assert got.schedule["warmdown_ratio"] == 0.4
    short = training_recipe(1e6, 1e9)
    assert short.total_batch_size == 2 ** round(math.log2(2 ** 19 * 1e-3 ** 0.383))
    with pytest.raises(ValueError, match="would flip the weights' sign.*give --weight-decay"):
        training_recipe(2e6, 4e8, 2 ** 20)


def test_speedrun_and_ablate_take_the_rules_lrs():
    """The CPU miniature's lrs come from the rule, not from flags beside it."""
    from scripts.ablate import DEFAULT_FLAGS

    speedrun = (Path(__file__).parents[1] / "speedrun.sh").read_text()
    assert not [f for f in DEFAULT_FLAGS if f.endswith("-lr")] and "-lr " not in speedrun
    assert all(not v.lrs for v in OPTIMIZER_VARIANTS.values())

# -- memory estimate and the auto-fit of the device batch ------------------------------------------------

MEASURE = """
import json, sys, torch
from scripts.bench_memory import status
from nanomuon.gpt import GPT, config_from_depth
depth, vocab, seq, rows, compiled = json.loads(sys.argv[1])
torch.manual_seed(0)
model = GPT(config_from_depth(depth, vocab, seq))
model.init_weights()
step = torch.compile(model, dynamic=False) if compiled else model
peaks = []
for _ in range(3):  # the first warms up (and compiles)
    idx, tgt = torch.randint(0, vocab, (rows, seq)), torch.randint(0, vocab, (rows, seq))
    model.zero_grad(set_to_none=True)
    open("/proc/self/clear_refs", "w").write("5")
    start = status("VmRSS")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model_loss = step(idx, tgt)
    model_loss.backward()
    peaks.append(status("VmHWM") - start)
print(min(peaks[1:]))
"""


def measured_step_peak(depth, vocab, seq, rows, compiled):
    """Peak RSS above the start of one bf16 forward + backward on CPU, grads None before it, in a fresh process that
    mmaps every allocation over 128 KiB (so freed memory leaves the RSS at once, as in scripts/bench_memory.py)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", MEASURE, json.dumps([depth, vocab, seq, rows, compiled])], env=env,
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.compile])])
@pytest.mark.parametrize("depth, vocab, seq, rows", [pytest.param(3, 2048, 512, 4, marks=pytest.mark.heavy),
                                                     pytest.param(6, 8192, 128, 8, marks=pytest.mark.slow)])
def test_train_memory_bounds_the_measured_peak_of_a_step(depth, vocab, seq, rows, compiled):
    """What one forward + backward really holds on CPU (grads, autocast's bf16 weight copies, activations) is at most
    the estimate, and not far under it: a bound that fits the device batch without wasting the memory."""
    est = train_memory(config_from_depth(depth, vocab, seq), rows, compiled)
    estimate = est["grads"] + est["bf16_copies"] + est["activations"]
    peak = measured_step_peak(depth, vocab, seq, rows, compiled)
    assert peak <= 1.03 * estimate and estimate <= 1.4 * peak, (peak, estimate)


def test_train_memory_state_is_what_the_optimizer_holds():
    torch.manual_seed(0)
    model = GPT(config_from_depth(2, 97, 16, aspect_ratio=32, head_dim=16))
    model.init_weights()
    est = train_memory(model.config, rows=1)
    assert est["params"] == est["grads"] == 4 * model.num_params()
    opt = model.setup_optimizer()
    model(torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))).backward()
    opt.step()
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for st in opt.state.values()
            for t in st.values() if isinstance(t, torch.Tensor) and t.numel() > 1}  # stacked state shares storage
    assert sum(held.values()) == est["optimizer"]
    assert train_memory(model.config, 4)["activations"] == 4 * est["activations"]
    assert train_memory(model.config, 4, bf16=False)["activations"] == 8 * est["activations"]


def test_fit_device_batch_takes_the_most_rows_that_fit_and_divide_the_step():
    c = config_from_depth(12, 32768, 2048)
    need = {rows: sum(train_memory(c, rows).values()) for rows in (1, 2, 4, 8, 16, 32)}
    for rows in (1, 2, 4, 8, 16, 32):  # free memory just enough for `rows`, and just short of it
        free = (need[rows] + 2 ** 30) / 0.85
        assert fit_device_batch(c, free + 1, rows_per_step=256) == rows
        if rows > 1:
            assert fit_device_batch(c, free - 2 ** 20, rows_per_step=256) == rows // 2
    assert fit_device_batch(c, 10 ** 15, rows_per_step=256) == 32  # the cap
    assert fit_device_batch(c, 10 ** 15, rows_per_step=256, cap=64) == 64
    assert fit_device_batch(c, 10 ** 15, rows_per_step=24) == 8  # 16 would not divide the step's 24 rows
    assert fit_device_batch(c, 10 ** 15, rows_per_step=3) == 1
    assert fit_device_batch(c, 80 * 2 ** 30, rows_per_step=256) == 32  # d12 on an 80 GB GPU
    assert fit_device_batch(c, 24 * 2 ** 30, rows_per_step=256) == 16  # and on a 24 GB one
    with pytest.raises(ValueError, match=r"one row of 2048 tokens of this 12-layer model needs about .* GiB, and "
                                         r"2.0 GiB are free: lower --depth or --max-seq-len"):
        fit_device_batch(c, 2 * 2 ** 30, rows_per_step=256)
