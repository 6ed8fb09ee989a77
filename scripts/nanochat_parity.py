"""
Parity with nanochat: nanomuon's arch 'nanochat' against nanochat's own code (imported from the
checkout, never copied), step by step, on the CPU in fp32. Run it as
`python -m scripts.bench_nanochat --parity --nanochat PATH`. nanochat's loop formulas live in its
scripts/base_train.py, which runs on import, so they are written out here (NanochatRecipe). Checks:
1. At SHAPE, nanochat's initial weights loaded into nanomuon's model (nanochat_name): the forward
   losses on one batch agree within 1e-5, relative.
2. TRAIN_STEPS steps, each repo with its own optimizer and schedules, on the same cycled batches:
   every loss agrees within 1e-4. The lrs are nanochat's d12 defaults times LR_SCALE: at full lrs
   this tiny model is chaotic (nanochat against itself with a weight nudged by 1e-7 differs by 6e-3
   at step 17); that nudged run is printed as the floor of what agreement can mean.
3. At d24, 2^20 tokens a step, 8 tokens per scaling param (its speedrun): every group's lr, betas
   and weight decay, and Muon's momentum and decay at TABLE_STEPS; nanomuon's from base_train's
   own functions, nanochat's from its setup_optimizer (meta device) and loop formulas.
4. Parameter counts and FLOPs a token at d4, d12 and d24.
The last line holds "parity"; the exit status is 0 only when everything agrees.
"""

import contextlib
import copy
import io
import math
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from nanomuon.arch import ARCHS, Variant
from nanomuon.common import one_line
from nanomuon.gpt import GPT, config_from_depth
from nanomuon.recipe import PeakLRs
from scripts.base_train import horizon_steps, lr_multiplier, optimizer_options, schedule_group
from scripts.train_args import parse_args

# depth, aspect ratio, head dim, tokens a row, vocab (a multiple of 64: nanochat pads its vocab to
# one), rows a batch; the row is long enough for the short windows (128 tokens) to cut it
SHAPE = dict(depth=4, aspect_ratio=32, head_dim=32, seq=256, vocab=512, rows=2)
TRAIN_STEPS = 20
WARMUP_STEPS = 5
BATCHES = 4  # distinct batches, cycled, so the loss falls
# nanochat's scripts/base_train.py defaults at 92d63d4 (its setup_optimizer's arguments)
D12_LRS = dict(embedding_lr=0.3, unembedding_lr=0.008, matrix_lr=0.02, scalar_lr=0.5)
LR_SCALE = 0.5  # sqrt(2^17 / 2^19)
TRAIN_LRS = {key: lr * LR_SCALE for key, lr in D12_LRS.items()}  # check 2's
WEIGHT_DECAY = 0.28
TABLE_STEPS = (0, 39, 399, 1000, 2500, 4000, 5567)
FORWARD_TOL, TRAIN_TOL = 1e-5, 1e-4


def nanochat_name(name: str) -> str:
    """nanomuon's param name -> nanochat's."""
    head, dot, rest = name.partition(".")
    return {"wte": "transformer.wte", "blocks": "transformer.h"}.get(head, head) + dot + rest


@dataclass
class NanochatRecipe:
    """nanochat 92d63d4's scripts/base_train.py formulas for one run, written out."""
    num_iterations: int
    warmup_steps: int = 40
    warmdown_ratio: float = 0.65
    final_lr_frac: float = 0.05
    weight_decay: float = WEIGHT_DECAY  # already scaled to the batch and horizon

    def lr_multiplier(self, it: int) -> float:
        warmdown = round(self.warmdown_ratio * self.num_iterations)
        if it < self.warmup_steps:
            return (it + 1) / self.warmup_steps
        if it <= self.num_iterations - warmdown:
            return 1.0
        progress = (self.num_iterations - it) / warmdown
        return progress + (1 - progress) * self.final_lr_frac

    def momentum(self, it: int) -> float:
        warmdown = round(self.warmdown_ratio * self.num_iterations)
        start = self.num_iterations - warmdown
        if it < 400:
            return (1 - it / 400) * 0.85 + it / 400 * 0.97
        if it >= start:
            progress = (it - start) / warmdown
            return 0.97 * (1 - progress) + 0.90 * progress
        return 0.97

    def muon_weight_decay(self, it: int) -> float:
        return self.weight_decay * 0.5 * (1 + math.cos(math.pi * it / self.num_iterations))


def nanochat_gpt(nc, depth: int, vocab: int, seq: int, aspect_ratio: int, head_dim: int,
                 device: str, window_pattern: str = "SSSL"):
    """nanochat's GPT as its base_train builds it, initialized on `device` (unless meta)."""
    c = config_from_depth(depth, vocab, seq, aspect_ratio, head_dim, arch="nanochat")
    with torch.device("meta"):
        model = nc.GPT(nc.GPTConfig(sequence_len=seq, vocab_size=vocab, n_layer=depth,
                                    n_head=c.n_head, n_kv_head=c.n_kv_head, n_embd=c.n_embd,
                                    window_pattern=window_pattern))
    if device != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model


def twin_models(nc):
    """(nanochat's GPT, nanomuon's) at SHAPE, nanomuon's holding nanochat's initial weights."""
    dims = [SHAPE[k] for k in ("depth", "vocab", "seq", "aspect_ratio", "head_dim")]
    theirs = nanochat_gpt(nc, *dims, "cpu")
    # Zero projections give the lambdas exactly zero first gradients (the final norm cancels a
    # multiple of the embedding), whose rounding noise Adam turns into full-size steps no two codes
    # share. Small projections, set before the copy, give them real gradients.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith("c_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    ours = GPT(config_from_depth(*dims, arch="nanochat"))
    ours.init_weights()
    state = theirs.state_dict()
    mapped = {name: state[nanochat_name(name)] for name in ours.state_dict()}
    if len(mapped) != len(state):
        raise RuntimeError(f"the name map covers {len(mapped)} of nanochat's {len(state)} tensors")
    ours.load_state_dict(mapped, strict=True)
    return theirs, ours


def our_optimizer(model: GPT):
    """nanomuon's optimizer with the given lrs (base_train's lr flags) and weight decay."""
    lrs = PeakLRs(adamw_matrix_lr=0.0, **TRAIN_LRS)
    # nanochat's Polar Express runs in its compute dtype, fp32; auto could pick bf16 on a CPU
    variant = Variant(weight_decay=WEIGHT_DECAY, muon_options=dict(ns_precision="fp32"))
    return model.setup_optimizer(variant, lrs, compile=False)


def train_side(model, optimizer, schedule, data) -> list[float]:
    """TRAIN_STEPS steps; schedule(group, step) sets a group's scheduled values. The losses."""
    losses = []
    for step in range(TRAIN_STEPS):
        x, y = data[step % len(data)]
        loss = model(x, y)
        loss.backward()
        for group in optimizer.param_groups:
            schedule(group, step)
        optimizer.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def check_training(nc) -> list[str]:
    """Checks 1 and 2: the forward loss, then every step's."""
    theirs, ours = twin_models(nc)
    tokens = torch.randint(0, SHAPE["vocab"], (BATCHES, SHAPE["rows"], SHAPE["seq"] + 1),
                           generator=torch.Generator().manual_seed(0))
    data = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    with torch.no_grad():
        a, b = theirs(*data[0]).item(), ours(*data[0]).item()
    problems = [] if abs(a - b) <= FORWARD_TOL * abs(a) else [f"forward loss {b} vs {a}"]
    print(f"parity forward loss: nanomuon {b:.7f}, nanochat {a:.7f}, "
          f"relative difference {abs(a - b) / abs(a):.1e} (tolerance {FORWARD_TOL:g})")
    nudged = copy.deepcopy(theirs)
    with torch.no_grad():
        w = nudged.transformer.h[0].mlp.c_fc.weight
        w.mul_(1 + 1e-7 * torch.randn(w.shape, generator=torch.Generator().manual_seed(2)))
    # base_train's schedule flags, set to nanochat's recipe
    flags = ["--warmup-ratio", str(WARMUP_STEPS / TRAIN_STEPS), "--warmdown-ratio", "0.65",
             "--final-lr-frac", "0.05", "--weight-decay", str(WEIGHT_DECAY)]
    args = parse_args(["--arch", "nanochat", "--num-iterations", str(TRAIN_STEPS), *flags])
    schedule = recipe_schedule(NanochatRecipe(TRAIN_STEPS, warmup_steps=WARMUP_STEPS))
    theirs_losses, nudged_losses = (train_side(m, their_optimizer(m), schedule, data)
                                    for m in (theirs, nudged))
    ours_losses = train_side(ours, our_optimizer(ours), our_schedule(args, TRAIN_STEPS), data)
    print(f"parity training, {TRAIN_STEPS} steps: step, nanomuon loss, nanochat loss, relative "
          "difference; nanochat with one weight nudged by 1e-7, its relative difference")
    for step, (b, a, c) in enumerate(zip(ours_losses, theirs_losses, nudged_losses)):
        rel = abs(a - b) / abs(a)
        print(f"  {step:2d}  {b:.7f}  {a:.7f}  {rel:.1e}    {c:.7f}  {abs(a - c) / abs(a):.1e}")
        if not rel <= TRAIN_TOL:
            problems.append(f"step {step} loss {b} vs {a}")
    return problems


def their_optimizer(model):
    with contextlib.redirect_stdout(io.StringIO()):  # its lr scaling line
        return model.setup_optimizer(**TRAIN_LRS, weight_decay=WEIGHT_DECAY)


def our_schedule(args, num_iterations: int):
    """base_train's train_step's schedule of a group, as a function of (group, step)."""
    return lambda group, step: schedule_group(group, step, num_iterations, args, ARCHS["nanochat"])


def our_table(depth: int, batch: int, ratio: float, shape=(32768, 2048, 64, 128), model=None,
              compiled: bool = False):
    """(steps, optimizer, flags) as nanomuon's base_train plans a run; shape: (vocab, sequence,
    aspect ratio, head dim); the optimizer `model`'s, or a meta-device GPT's."""
    vocab, seq, aspect, head_dim = shape
    args = parse_args(["--arch", "nanochat", "--depth", str(depth), "--total-batch-size",
                       str(batch), "--target-param-data-ratio", str(ratio), "--max-seq-len",
                       str(seq), "--aspect-ratio", str(aspect), "--head-dim", str(head_dim)])
    if model is None:
        with torch.device("meta"):
            model = GPT(config_from_depth(depth, vocab, seq, aspect, head_dim, arch="nanochat"))
    with contextlib.redirect_stdout(io.StringIO()):  # its recipe lines
        steps = horizon_steps(args, model)
    return steps, model.setup_optimizer(**optimizer_options(args, compiled=compiled)), args


def their_table(nc, depth: int, batch: int, ratio: float, shape=(32768, 2048, 64, 128),
                model=None):
    """(NanochatRecipe, optimizer) as nanochat's base_train sets up a run, as our_table."""
    def scaling(d):
        counts = nanochat_gpt(nc, d, *shape, "meta").num_scaling_params()
        return counts["transformer_matrices"] + counts["lm_head"]

    target, ref = int(ratio * scaling(depth)), ratio * scaling(12)
    lr_scale = (batch / 2 ** 19) ** 0.5
    decay = WEIGHT_DECAY * lr_scale * ref / target
    model = model or nanochat_gpt(nc, depth, *shape, "meta")
    with contextlib.redirect_stdout(io.StringIO()):  # its lr scaling line
        optimizer = model.setup_optimizer(**{k: v * lr_scale for k, v in D12_LRS.items()},
                                          weight_decay=decay)
    return NanochatRecipe(max(1, target // batch), weight_decay=decay), optimizer


def recipe_schedule(recipe: NanochatRecipe):
    """nanochat's loop's schedule of a group, as a function of (group, step)."""
    def schedule(group, step):
        group["lr"] = group["initial_lr"] * recipe.lr_multiplier(step)
        if group["kind"] == "muon":
            group["momentum"] = recipe.momentum(step)
            group["weight_decay"] = recipe.muon_weight_decay(step)
    return schedule


def check_table(nc, depth: int = 24, batch: int = 2 ** 20, ratio: float = 8.0) -> list[str]:
    """Check 3: every group's hyperparameters at TABLE_STEPS, printed side by side."""
    steps, ours, args = our_table(depth, batch, ratio)
    recipe, theirs = their_table(nc, depth, batch, ratio)
    print(f"parity hyperparameters at d{depth}, {batch:,} tokens a step, {ratio:g} tokens per "
          "scaling param: nanomuon | nanochat")
    rows = [("steps", steps, recipe.num_iterations)]
    order = ["lm_head", "embedding", "value_embeds", "resid_lambdas", "x0_lambdas", "smear"]
    for group in ours.param_groups:
        mine = ([order.index(group["name"])] if group["name"] in order else
                [i for i, g in enumerate(theirs.param_groups) if g["kind"] == "muon"])
        keys = (("lr", "betas", "eps", "weight_decay") if group["kind"] == "adamw"
                else ("lr", "ns_steps", "beta2"))
        rows += [(f"{group['name']} {key}", group[key], theirs.param_groups[i][key])
                 for i in mine for key in keys]
    muon = next(g for g in ours.param_groups if g["kind"] == "muon")
    for step in TABLE_STEPS:
        rows += [(f"step {step} lr multiplier",
                  lr_multiplier(step, steps, args), recipe.lr_multiplier(step)),
                 (f"step {step} Muon momentum",
                  ARCHS["nanochat"].momentum(step, steps, args.warmdown_ratio),
                  recipe.momentum(step)),
                 (f"step {step} Muon weight decay",
                  ARCHS["nanochat"].weight_decay(step, steps, muon["initial_weight_decay"]),
                  recipe.muon_weight_decay(step))]
    return compare_rows(rows)


def check_sizes(nc) -> list[str]:
    """Check 4: params and FLOPs a token at d4, d12 and d24."""
    print("parity sizes (vocab 32,768, 2,048 tokens): nanomuon | nanochat")
    rows = []
    for depth in (4, 12, 24):
        with torch.device("meta"):
            ours = GPT(config_from_depth(depth, 32768, 2048, arch="nanochat"))
        theirs = nanochat_gpt(nc, depth, 32768, 2048, 64, 128, "meta")
        rows += [(f"d{depth} params", ours.num_params(),
                  sum(p.numel() for p in theirs.parameters())),
                 (f"d{depth} FLOPs a token", ours.estimate_flops(), theirs.estimate_flops())]
    return compare_rows(rows)


def compare_rows(rows) -> list[str]:
    """Print (label, ours, theirs) rows; the ones that differ beyond float rounding."""
    problems = []
    for label, mine, other in rows:
        same = (mine == other if not isinstance(mine, float) else
                math.isclose(mine, other, rel_tol=1e-12, abs_tol=1e-15))
        shown, theirs = (f"{v:,}" if isinstance(v, int) else f"{v:.6g}" if isinstance(v, float)
                         else str(tuple(v)) for v in (mine, other))
        print(f"  {label:34s} {shown:>16s} | {theirs:<16s}{'' if same else '  DIFFERS'}")
        if not same:
            problems.append(f"{label}: {shown} vs {theirs}")
    return problems


def run_parity(nc) -> int:
    """All four checks; the last line says parity or not. 0 when everything agrees."""
    torch.manual_seed(0)
    try:
        with torch.compiler.set_stance("force_eager"):  # nanochat's fused steps run eager too
            problems = check_training(nc) + check_table(nc) + check_sizes(nc)
    except (TypeError, AttributeError, KeyError) as e:  # another nanochat's calls and names
        at = traceback.extract_tb(e.__traceback__)[-1]
        raise SystemExit(f"error: parity could not run against this nanochat ({one_line(e)}, at "
                         f"{Path(at.filename).name}:{at.lineno}): it compares with nanochat "
                         "92d63d4's model and setup_optimizer; check that commit out") from None
    if problems:
        print(f"parity: FAILED, {len(problems)} differences: {'; '.join(problems[:5])}")
        return 1
    print(f"parity: nanomuon's arch 'nanochat' equals nanochat's model and recipe (forward "
          f"within {FORWARD_TOL:g}, {TRAIN_STEPS} steps within {TRAIN_TOL:g}, hyperparameters "
          "and sizes equal)")
    return 0
