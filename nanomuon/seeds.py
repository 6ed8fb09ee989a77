"""
Many seeds of one GPT, trained as one model in one process (base_train --seeds).

A seed's run as a process of its own pays for its start-up, tokenizer and data, compile and evals,
and on a GPU a small model leaves the device idle. Batched, every parameter gets a leading seed
dim: a (rows, cols) matrix becomes (seeds, rows, cols). One forward, torch.vmap over
torch.func.functional_call, runs every seed on the same batch (ablate's fixed data order), and the
loss is the sum of the seeds' losses, so each seed's gradient is its own run's. The optimizer
needs nothing new: Muon treats leading dims as a batch of matrices (update_math), so a stacked
matrix is its seeds' matrices, each orthogonalized alone; AdamW is elementwise.

The model code is unchanged: GPT.forward runs per seed under vmap (its fused loss has a vmap rule,
gpt.SoftcapCrossEntropy). What a per-seed forward cannot share is refused (check_seeds): QK-clip
tracks logits in the modules, fp8 swaps the layers, FSDP shards them, torch.optim.Muon takes 2-D
matrices only, and the flash attention kernels have no vmap rule (SDPA has).
"""

import statistics
import warnings

import torch
import torch.nn as nn
from torch.func import functional_call

from nanomuon.gpt import GPT, GPTConfig

# vmap runs CPU flash attention seed by seed, as the seeds' own runs would: nothing to warn about
warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet "
                        "implemented the batching rule for aten::_scaled_dot_product")


def parse_seeds(s: str) -> list[int]:
    """--seeds' value: distinct ints in [0, 2**64), comma-separated; ValueError says what is
    wrong."""
    try:
        seeds = [int(x) for x in s.split(",")]
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated ints, e.g. 1,2,3; got {s!r}") from None
    if any(not 0 <= x < 2 ** 64 for x in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must be distinct ints in [0, 2**64); got {s!r}")
    return seeds


def check_seeds(seeds: list[int], qk_clip: float, fp8: bool, fsdp: bool, optimizer: str,
                attention: str = "auto") -> None:
    """Refuse what batched seeds cannot train, in one line (ValueError)."""
    refused = [(qk_clip, "--qk-clip (it tracks each head's logits in the model's modules)"),
               (fp8, "--fp8 (it swaps the linear layers for torchao's)"),
               (fsdp, "--fsdp (it shards one model's layers)"),
               (optimizer == "torch-muon", "--optimizer torch-muon (torch.optim.Muon takes 2-D "
                                           "matrices only)"),
               (attention not in ("auto", "sdpa"), f"--attention {attention} (vmap batches SDPA; "
                                                   "the flash kernels are not batched)")]
    named = (",".join(map(str, seeds)) if len(seeds) <= 8
             else f"{seeds[0]},...,{seeds[-1]} ({len(seeds)} seeds)")
    for given, what in refused:
        if given:
            raise ValueError(f"--seeds {named} trains the seeds as one batched model, which "
                             f"cannot take {what}: train each seed alone with --seed, or drop it")


def seeded_gpt(config: GPTConfig, seeds: list[int], device) -> GPT:
    """A GPT whose every parameter holds its seeds' stacked on dim 0 (model.seeds = their number),
    seed i's slice initialized exactly as a single run with --seed seeds[i] (torch.manual_seed,
    then init_weights), one seed at a time, so memory holds one extra model at most."""
    with torch.device("meta"):
        model, one = GPT(config), GPT(config)
    model.to_empty(device=device)
    one.to_empty(device=device)
    for i, seed in enumerate(seeds):
        torch.manual_seed(seed)
        one.init_weights()
        if i == 0:
            for name, b in one.named_buffers():  # the rotary tables (not in a state_dict)
                model.get_buffer(name).copy_(b)
            stacked = {name: p.new_empty((len(seeds), *p.shape))
                       for name, p in one.named_parameters()}
        for name, p in one.named_parameters():
            stacked[name][i].copy_(p)
    for name, value in stacked.items():
        module, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        setattr(module, attr, nn.Parameter(value))
    model.seeds = len(seeds)
    return model


def seed_model(model: GPT, i: int) -> GPT:
    """Seed i of a seeded GPT as a plain GPT whose weights are views of its slices (samples,
    inspection): no copy, and it changes as the seeded model trains."""
    with torch.device("meta"):
        one = GPT(model.config)
    one.to_empty(device=model.cos.device)
    one.load_state_dict({name: p.detach()[i] for name, p in model.named_parameters()},
                        strict=False, assign=True)
    one.cos, one.sin = model.cos, model.sin
    return one


class SeedBatch(nn.Module):
    """The forward of a seeded GPT (seeded_gpt): GPT.forward run per seed under torch.vmap, on the
    same batch. With targets, each seed's mean loss, (seeds,) (sum them to backward: each seed's
    gradient is its own), or with loss_reduction='none' the per-token losses (seeds, B, T);
    without, the logits (seeds, B, T, vocab)."""

    def __init__(self, model: GPT):
        super().__init__()
        if not getattr(model, "seeds", None):
            raise ValueError("SeedBatch takes a seeded GPT (nanomuon.seeds.seeded_gpt)")
        self.model = model

    def forward(self, idx, targets=None, loss_reduction: str = "mean"):
        buffers = dict(self.model.named_buffers())

        def one_seed(params, idx, targets):
            return functional_call(self.model, (params, buffers), (idx, targets),
                                   dict(loss_reduction=loss_reduction))

        params = dict(self.model.named_parameters())
        return torch.vmap(one_seed, in_dims=(0, None, None), randomness="error")(params, idx,
                                                                                 targets)


# A run's per-step numbers (losses, val bpb) are a number each, or with --seeds a list: one per seed.

def per_seed(fn, *values):
    """fn of the values, or where they are lists (one entry per seed), of each seed's."""
    if isinstance(values[0], list):
        return [fn(*vs) for vs in zip(*values)]
    return fn(*values)


def mean_of(value) -> float:
    """A number, or the mean of each seed's."""
    return statistics.fmean(value) if isinstance(value, list) else value


def numbers_text(value, fmt: str = "{:.4f}") -> str:
    """A number for a log line, or each seed's as their mean and range."""
    if not isinstance(value, list):
        return fmt.format(value)
    return (f"{fmt.format(statistics.fmean(value))} (mean of {len(value)} seeds, "
            f"{fmt.format(min(value))} to {fmt.format(max(value))})")


def wandb_values(key: str, value, seeds: list[int] | None) -> dict:
    """wandb keys of a number, or of each seed's (key/seed_N) and their mean (key)."""
    if not isinstance(value, list):
        return {key: value}
    return {key: statistics.fmean(value), **{f"{key}/seed_{s}": v for s, v in zip(seeds, value)}}


def seed_records(seeds: list[int], summary: dict, loop: dict) -> dict:
    """seed -> what a single run of it records in summary.json (final and min val bpb, the final
    eval, the val and train loss histories), from a batched run's lists."""
    out = {}
    for i, seed in enumerate(seeds):
        record = {key: summary[key][i] for key in ("final_val_bpb", "min_val_bpb",
                                                    "final_eval_bpb") if key in summary}
        if "final_eval_tokens" in summary:
            record["final_eval_tokens"] = summary["final_eval_tokens"]
        record.update(val_history=[(s, v[i]) for s, v in loop["val_history"]],
                      history=[(s, v[i]) for s, v in loop["history"]])
        out[str(seed)] = record
    return out
