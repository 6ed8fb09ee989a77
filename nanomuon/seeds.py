"""
Many seeds of one GPT, trained as one model in one process (base_train --seeds).

A process per seed pays for its own start-up, compile and evals, and on a GPU a small model leaves
the device idle. Batched, every parameter gets a leading seed dim and torch.vmap runs every seed on
the same batch; the loss is the sum of the seeds', so each seed's gradient is its own run's. Muon
treats leading dims as a batch of matrices and AdamW is elementwise, so the optimizer is unchanged.
Attention leaves vmap: each layer calls the kernel a single run would once, on every seed's rows
folded into its batch (seed_attention): vmap's rule for SDPA picks a kernel per shape (on an H200,
cuDNN's, whose compiled graph broke), and the flash kernels have none.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from nanomuon.gpt import GPT, GPTConfig, sdpa


def parse_seeds(s: str) -> list[int]:
    """--seeds' value: distinct ints in [0, 2**64), comma-separated (else ValueError)."""
    try:
        seeds = [int(x) for x in s.split(",")]
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated ints, e.g. 1,2,3; got {s!r}") from None
    if any(not 0 <= x < 2 ** 64 for x in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must be distinct ints in [0, 2**64); got {s!r}")
    return seeds


def check_seeds(seeds: list[int], qk_clip: float, fp8: bool, fsdp: bool, optimizer: str) -> None:
    """Refuse what batched seeds cannot train, in one line (ValueError)."""
    refused = [(qk_clip, "--qk-clip (it tracks each head's logits in the model's modules)"),
               (fp8, "--fp8 (it swaps the linear layers for torchao's)"),
               (fsdp, "--fsdp (it shards one model's layers)"),
               (optimizer == "torch-muon", "--optimizer torch-muon (torch.optim.Muon takes 2-D "
                                           "matrices only)")]
    named = (",".join(map(str, seeds)) if len(seeds) <= 8
             else f"{seeds[0]},...,{seeds[-1]} ({len(seeds)} seeds)")
    for given, what in refused:
        if given:
            raise ValueError(f"--seeds {named} trains the seeds as one batched model, which "
                             f"cannot take {what}: train each seed alone with --seed, or drop it")


def seeded_gpt(config: GPTConfig, seeds: list[int], device) -> GPT:
    """A GPT whose every parameter holds its seeds' stacked on dim 0, seed i's initialized as a
    single run with --seed seeds[i] would be, one seed at a time (one extra model in memory)."""
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
        setattr(module, attr, torch.nn.Parameter(value))
    model.seeds = len(seeds)
    return model


def seed_model(model: GPT, i: int) -> GPT:
    """Seed i of a seeded GPT as a plain GPT whose weights are views of its slices (no copy)."""
    with torch.device("meta"):
        one = GPT(model.config)
    one.to_empty(device=model.cos.device)
    one.load_state_dict({name: p.detach()[i] for name, p in model.named_parameters()},
                        strict=False, assign=True)
    one.cos, one.sin = model.cos, model.sin
    return one


# The attention kernels seed_attention runs, by name: the model's own, registered by SeedBatch.
# A name, not the function, goes into the compiled graph, so the compile cache holds across runs.
KERNELS: dict[str, Callable] = {}


def kernel_name(attend: Callable) -> str:
    """attend's name in KERNELS, registering it: its qualified name, numbered where taken."""
    base = f"{attend.__module__}.{getattr(attend, '__qualname__', type(attend).__name__)}"
    for n in range(1, len(KERNELS) + 2):
        name = base if n == 1 else f"{base}#{n}"
        if KERNELS.setdefault(name, attend) is attend:
            return name
    raise AssertionError("unreachable: a free name is among len(KERNELS) + 1")


@torch.library.custom_op("nanomuon::seed_attention", mutates_args=())
def seed_attention(q: Tensor, k: Tensor, v: Tensor, window: int, kernel: str) -> Tensor:
    """KERNELS[kernel] on (B, T, heads, head_dim) q, k, v (window < 0: the whole context). Under
    vmap, one call on the seeds' rows folded into B (fold_seeds); an op of its own, so that
    torch.compile keeps it whole rather than tracing the kernel through vmap's rules."""
    return KERNELS[kernel](q, k, v, None if window < 0 else window).contiguous()


@seed_attention.register_fake
def _(q, k, v, window, kernel):
    return q.new_empty((*q.shape[:-1], v.size(-1)))


@torch.library.custom_op("nanomuon::seed_attention_backward", mutates_args=())
def seed_attention_backward(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, window: int,
                            kernel: str) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k and v through KERNELS[kernel], its forward run again: any kernel's
    own backward, for one more forward pass of attention (no output or log-sum-exp is kept)."""
    attend = KERNELS[kernel]
    _, pull = torch.func.vjp(lambda *qkv: attend(*qkv, None if window < 0 else window), q, k, v)
    return tuple(g.contiguous() for g in pull(grad))


@seed_attention_backward.register_fake
def _(q, k, v, grad, window, kernel):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save_inputs(ctx, inputs, output):
    q, k, v, ctx.window, ctx.kernel = inputs
    ctx.save_for_backward(q, k, v)


def _backward(ctx, grad):
    return (*seed_attention_backward(*ctx.saved_tensors, grad, ctx.window, ctx.kernel), None, None)


def fold_seeds(info, in_dims, q, k, v, window, kernel):
    """seed_attention's vmap rule: the seed dim folded into the batch, one kernel call."""
    q, k, v = (t.movedim(d, 0) if d is not None else t.expand(info.batch_size, *t.shape)
               for t, d in zip((q, k, v), in_dims))
    out = seed_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), window, kernel)
    return out.unflatten(0, q.shape[:2]), 0


seed_attention.register_autograd(_backward, setup_context=_save_inputs)
seed_attention.register_vmap(fold_seeds)


def folded(attend: Callable) -> Callable:
    """attend as a layer's kernel (GPT.use_attention) whose seeds are folded into its batch."""
    attend = getattr(attend, "kernel", attend)  # folded once only
    kernel = kernel_name(attend)

    def attend_folded(q, k, v, window=None):
        return seed_attention(q, k, v, -1 if window is None else window, kernel)

    attend_folded.kernel = attend
    return attend_folded


class SeedBatch(torch.nn.Module):
    """The forward of a seeded GPT: GPT.forward per seed under torch.vmap, on the same batch,
    each layer's attention folded; GPT.forward's outputs, seeds first (sum losses to backward)."""

    def __init__(self, model: GPT):
        super().__init__()
        if not getattr(model, "seeds", None):
            raise ValueError("SeedBatch takes a seeded GPT (nanomuon.seeds.seeded_gpt)")
        self.model = model
        for attn in (block.attn for block in model.blocks):  # the kernel GPT.use_attention set
            attn.attend = folded(attn.attend or sdpa)

    def forward(self, idx, targets=None, loss_reduction: str = "mean", input_stats: bool = False):
        buffers = dict(self.model.named_buffers())

        def one_seed(params, idx, targets):
            return torch.func.functional_call(
                self.model, (params, buffers), (idx, targets),
                dict(loss_reduction=loss_reduction, input_stats=input_stats))

        params = dict(self.model.named_parameters())
        return torch.vmap(one_seed, in_dims=(0, None, None), randomness="error")(params, idx,
                                                                                 targets)


def seed_records(seeds: list[int], summary: dict, loop: dict) -> dict:
    """seed -> what a single run of it records in summary.json, from a batched run's lists."""
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
