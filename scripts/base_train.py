"""
Pretrain the GPT with Muon+AdamW: one process, or data parallel under torchrun (nccl on CUDA, gloo
on CPU). No DDP wrapper: DistMuonAdamW averages the gradients itself (ZeRO-1); with --fsdp, FSDP2
shards the model and MuonAdamW updates the shards (nanomuon/sharded.py). Checkpoints resume bit for
bit, at any process count; one run at a time owns its run dir (docs/training.md).
"""

import argparse
import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from nanomuon import checkpoint, common, reads, recipe, report
from nanomuon.arch import ARCHS, LR_SCHEDULES, Arch, fit_device_batch, train_memory
from nanomuon.attention import choose_attention
from nanomuon.common import evaluate_bpb, print0  # a test stands in for evaluate_bpb
from nanomuon.dataloader import DataError, DataLoader, reshard_states, scored_tokens, val_rows
from nanomuon.fp8 import check_fp8, convert_to_fp8, plain_linears
from nanomuon.gpt import GPT, GPTConfig, config_from_depth, scaling_params
from nanomuon.hardware import peak_flops
from nanomuon.ideas import with_options
from nanomuon.run import (
    append_step_record,
    check_disk,
    claim_run_dir,
    keep_earlier_runs,
    set_aside_later_steps,
)
from nanomuon.seeds import SeedBatch, seeded_gpt
from nanomuon.sources import prepare
from nanomuon.stages import muon_plan
from nanomuon.tokenizer import Tokenizer, get_tokenizer
from nanomuon.variants import OPTIMIZER_VARIANTS
from scripts.train_args import (
    LR_FLAGS,
    MAX_STEPS,
    arch_on,
    check_memory,
    optimizer_state,
    parse_args,
)


def auto_device_batch(args, config, device, world_size: int, compiled: bool) -> int:
    """--device-batch-size auto: on CUDA the most rows that fit (fit_device_batch), else 32."""
    rows_per_step, rest = divmod(args.total_batch_size, args.max_seq_len * world_size)
    if device.type != "cuda" or rest or not rows_per_step:
        # (a total batch that no row count divides is reported by the caller, with the numbers)
        return 32
    free = torch.cuda.mem_get_info(device)[0]
    bf16 = args.dtype == "bf16"  # resolved by build
    # the stages' state past the estimate's (a SOAP lm_head's vocab-sized factors, say)
    state = max(0, optimizer_state(args, config)
                - train_memory(config, 1, compiled, bf16)["optimizer"])
    with common.user_errors():  # batched seeds: each a whole model's memory
        rows = fit_device_batch(config, free // len(args.seeds or [1]), rows_per_step,
                                compiled=compiled, bf16=bf16, state=state)
    # every rank must take the same micro-batches: the GPU with the least free memory decides
    if world_size > 1:
        fewest = torch.tensor([rows], device=device)
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
        rows = int(fewest.item())
    need = sum(train_memory(config, rows, compiled, bf16).values()) + state
    print0(f"device batch: {rows} rows (auto: about {need / 2 ** 30:.1f} GiB estimated for "
           f"training, {free / 2 ** 30:.1f} GiB free on {torch.cuda.get_device_name(device)}; "
           "--device-batch-size overrides)")
    return rows



def lr_multiplier(step: int, num_iterations: int, args) -> float:
    """Every group's lr multiplier at `step`: the run's lr schedule (schedule_name) at its flags."""
    return LR_SCHEDULES[schedule_name(args)](step, num_iterations, args.warmup_ratio,
                                             args.warmdown_ratio, args.final_lr_frac)


def schedule_group(group: dict, step: int, num_iterations: int, args, arch: Arch) -> None:
    """A group's lr (initial_lr x lr_multiplier) and a Muon group's momentum and weight decay at
    `step`: the arch's schedules, the decay's from the group's own peak; a momentum the variant
    sets (momentum_scheduled) is kept as given."""
    group["lr"] = group["initial_lr"] * lr_multiplier(step, num_iterations, args)
    if group["kind"] == "muon":
        group["momentum"] = (arch.momentum(step, num_iterations, args.warmdown_ratio)
                             if momentum_scheduled(group, args) else group["initial_momentum"])
        group["weight_decay"] = arch.weight_decay(step, num_iterations,
                                                  group["initial_weight_decay"])


def momentum_scheduled(group: dict, args) -> bool:
    """Whether the arch's schedule runs a Muon group's momentum: unless the --optimizer variant
    (with its --variant-option) sets one for it, which then stays whatever its value, the
    recipe's own 0.95 included. Asked at every step: decided once per variant entry."""
    key = (args.optimizer, tuple(args.variant_option or ()), group.get("name", ""))
    entry = OPTIMIZER_VARIANTS[args.optimizer]
    if key not in SETS_MOMENTUM or SETS_MOMENTUM[key][0] is not entry:
        SETS_MOMENTUM[key] = entry, variant_sets_momentum(*key)
    return not SETS_MOMENTUM[key][1]


SETS_MOMENTUM = {}  # (variant, options, group name) -> (its registry entry, the answer)


def variant_sets_momentum(optimizer: str, options: tuple, group_name: str) -> bool:
    """Whether the variant's settings give the group a momentum: its Muon options (every Muon
    group starts from them) or its role's (a role group is named '<group>, <role>' or '<role>')."""
    variant = with_options(optimizer, list(options))
    role = variant.roles.get(group_name.rpartition(", ")[2])
    return any((where or {}).get("momentum") is not None  # None: the arch's schedule
               for where in (variant.muon_options, role))


@dataclass
class Run:
    """What the stages share: made by build(), restored by resume(), advanced by train()."""
    args: argparse.Namespace
    rank: int
    world_size: int
    device: torch.device
    run_dir: Path
    tokenizer: Tokenizer
    token_bytes: torch.Tensor
    config: GPTConfig
    model: GPT
    train_model: torch.nn.Module  # the model, or its torch.compile wrapper
    optimizer: torch.optim.Optimizer
    train_loader: DataLoader
    val: torch.Tensor
    final_val: torch.Tensor | None  # --final-eval-tokens' rows, scored once after the last eval
    num_params: int
    flops_per_token: float
    num_iterations: int
    grad_accum: int
    compiled: bool
    autocast: contextlib.AbstractContextManager  # bf16 autocast or none, made once for every step
    synchronize: Callable[[], None]  # waits for the device's queued work (common.synchronizer)
    step: int = 0
    # loop state, saved in checkpoints; val_train_time[i]: training seconds (no evals, no warm-up)
    # at val_history[i]; step_times, optim_times: every timed step's seconds, resumes included
    loop: dict = field(default_factory=lambda: dict(
        smooth_loss=0.0, train_time=0.0, history=[], val_history=[], val_train_time=[],
        skipped_steps=0, nonfinite_in_a_row=0, step_times=[], optim_times=[]))
    wandb: object = None
    peak_flops: float | None = None  # of one device, for MFU; None where unknown
    copies: int = 1  # models trained at once: --seeds' count, each on every token
    decays_applied: list[bool] = field(default_factory=list)  # each Muon group's, in order


def main(argv=None):
    args = parse_args(argv)
    # the run dir's lock and the loader's thread, let go however it ends
    with contextlib.ExitStack() as held:
        try:
            run = build(args, held)
            if args.resume_from_step != -1:
                resume(run)
            train(run)
            summary = report_on(run)
        except KeyboardInterrupt:  # Ctrl-C: say where to continue from, not where Python was
            run_dir = common.get_base_dir() / "runs" / args.run
            steps = checkpoint.list_steps(run_dir)
            print0(f"interrupted; the last checkpoint is {checkpoint.step_dir(run_dir, steps[-1])} "
                   "(continue with --resume-from-step latest)" if steps
                   else f"interrupted before the first checkpoint of {run_dir}")
            sys.exit(130)
    common.compute_cleanup()
    return summary


SHARE = ("give every node the same base dir: NANOMUON_BASE_DIR on a filesystem they all mount, or "
         "identical copies of its tokenizer and data with runs/ shared (docs/training.md, "
         "'Several nodes')")


def optimizer_options(args, compiled: bool) -> dict:
    """GPT.setup_optimizer's arguments but the horizon: the --optimizer variant with the lrs and
    decay its flags give where it sets none (it is tuned for its own; each flag overridden is
    said), and the lr rule's PeakLRs at the run's batch and --lr-multiplier for the rest."""
    variant = with_options(args.optimizer, args.variant_option)
    for line in flags_not_used(args):
        print0(line)
    given = {k: getattr(args, k) for k in LR_FLAGS if getattr(args, k) is not None}
    decay = args.weight_decay if variant.weight_decay is None else variant.weight_decay
    variant = variant._replace(lrs=given | variant.lrs, weight_decay=decay)
    return dict(variant=variant, lrs=recipe.peak_lrs(args.total_batch_size, args.lr_multiplier),
                compile=compiled)


def flags_not_used(args) -> list[str]:
    """A line for each flag the --optimizer variant's own setting overrides (its report holds
    them, and ablate echoes them)."""
    flags = {k: getattr(args, k) for k in (*LR_FLAGS, "weight_decay", "schedule")}
    own = with_options(args.optimizer, args.variant_option).own_flags()
    return [f"--optimizer {args.optimizer} sets {key} {own[key]} "
            f"(--{key.replace('_', '-')} {flags[key]} is not used)"
            for key in sorted(flags.keys() & own.keys()) if flags[key] is not None]


def schedule_name(args) -> str:
    """The lr schedule this run follows: the --optimizer variant's, else --schedule."""
    return OPTIMIZER_VARIANTS[args.optimizer].schedule or args.schedule


def horizon_steps(args, model: GPT) -> int:
    """The run's steps; a batch, weight decay or schedule flag left out takes the recipe's, written
    into args (a resume compares like with like) and printed with the reason. As in nanochat, the
    recipe's horizon is the data ratio's: a short --num-iterations check gets the real run's."""
    ratio = (args.target_param_data_ratio if args.target_param_data_ratio > 0
             else recipe.NANOCHAT_TOKENS_PER_PARAM)
    params = model.num_scaling_params()
    ref = scaling_params(config_from_depth(recipe.NANOCHAT_REF_DEPTH, model.config.vocab_size,
                                           args.max_seq_len, args.aspect_ratio, args.head_dim,
                                           arch=model.config.arch))
    batch = None if args.total_batch_size == -1 else args.total_batch_size
    with common.user_errors():
        chosen = recipe.training_recipe(ratio * params, ratio * ref, batch, args.weight_decay)
    args.total_batch_size, args.weight_decay = chosen.total_batch_size, chosen.weight_decay
    for line in chosen.why:
        print0(f"recipe: {line}")
    if args.num_iterations > 0:
        steps = args.num_iterations
    elif args.target_flops > 0:
        steps = max(1, round(args.target_flops / (model.estimate_flops() * args.total_batch_size)))
    else:
        steps = max(1, int(ratio * params) // args.total_batch_size)  # nanochat's floor
    if steps > MAX_STEPS:
        flag, value = (("--target-flops", args.target_flops) if args.target_flops > 0
                       else ("--target-param-data-ratio", ratio))
        raise SystemExit(f"error: {flag} {value:g} plans {steps:.3g} steps of "
                         f"{args.total_batch_size:,} tokens, more than the {MAX_STEPS:,} a run "
                         f"may take: give at most {value * MAX_STEPS / steps:.3g}, or "
                         "--num-iterations")
    # the recipe's warmup (its steps as a fraction of the run's), warmdown and final lr
    ratios = dict(chosen.schedule, warmup_ratio=min(1.0, chosen.schedule["warmup_steps"] / steps))
    left_out = [key for key in ("warmup_ratio", "warmdown_ratio", "final_lr_frac")
                if getattr(args, key) is None]
    for key in left_out:
        setattr(args, key, ratios[key])
    if left_out:
        print0(f"recipe: schedule: warmup {round(args.warmup_ratio * steps)} steps, warmdown "
               f"{args.warmdown_ratio:g} of the steps, final lr {args.final_lr_frac:g} of the peak "
               f"({', '.join('--' + k.replace('_', '-') for k in left_out)} left out: "
               f"{'nanochat' if chosen.schedule['warmup_steps'] else 'the CPU rule'}'s at "
               f"{args.total_batch_size:,} tokens/step)")
    return steps


def resolve_model(args, vocab_size: int, device: torch.device):
    """(GPTConfig, attention kernel) of the flags, --arch (auto: nanochat on CUDA, else classic) and
    --attention resolved in args and said; a kernel that cannot run here, or ranks that disagree,
    stop the run. Sliding windows get a kernel that runs them (SDPA's mask rules out flash)."""
    why = f"--arch {args.arch}" + (f" on {device.type}" if args.arch == "auto" else "")
    args.arch = arch_on(args.arch, device.type)
    print0(f"model: {ARCHS[args.arch].about} ({why})")
    # an impossible size: the same flags on every rank, so every rank stops
    with common.user_errors():
        config = config_from_depth(args.depth, vocab_size, args.max_seq_len, args.aspect_ratio,
                                   args.head_dim, qk_norm=args.qk_norm, arch=args.arch,
                                   window_pattern=args.window_pattern)
        windowed = any(w is not None for w in config.window_sizes())
        attention = choose_attention(device, args.dtype, (config.n_head, config.n_kv_head,
                                                          config.n_embd // config.n_head),
                                     args.attention, windowed)
    folded = " (batched seeds: each call takes every seed's rows)" if args.seeds else ""
    print0(f"attention: {attention.why}{folded}")
    common.exit_unless_ranks_agree(attention.name, "the attention kernel", "install the same "
                                   "flash attention on every node, or pass --attention sdpa")
    args.attention = attention.name
    return config, attention


def build(args, held: contextlib.ExitStack) -> Run:
    """Process group, locked run dir, tokenizer, model, data and optimizer: a run at step 0."""
    distributed, rank, _, world_size, device = common.compute_init(args.device_type)
    if args.fsdp and not distributed:
        raise SystemExit("error: --fsdp shards the model over torchrun processes; launch with "
                         "torchrun (or drop --fsdp)")
    if args.fp8:
        with common.user_errors():  # no fp8 tensor cores here, or no torchao: before anything loads
            check_fp8(device)
    run_dir = common.get_base_dir() / "runs" / args.run
    claim_run_dir(run_dir, rank, held)  # before anything reads the run dir
    # a restarted job (torchrun --max-restarts) picks up where it died
    if args.resume_from_step == "auto":
        args.resume_from_step = "latest" if checkpoint.list_steps(run_dir) else -1
    fresh = args.resume_from_step == -1  # a fresh run over an earlier one is refused now
    keep_earlier_runs(run_dir, rank, fresh=fresh and not args.start_over, start_over=False)
    # missing or unreadable: one line that says what to do
    tokenizer = common.on_every_rank(get_tokenizer)
    compiled = common.resolve_compile(args.compile, device)
    # saved resolved: base_eval scores in what the run trained in
    args.dtype = common.resolve_dtype(device, args.dtype)
    config, attention = resolve_model(args, tokenizer.vocab_size, device)
    with torch.device("meta"):  # sizes only: nothing is allocated before the device batch is fit
        model = GPT(config)
    num_params, flops_per_token = model.num_params(), model.estimate_flops()
    num_iterations = horizon_steps(args, model)
    if args.device_batch_size == "auto":
        args.device_batch_size = auto_device_batch(args, config, device, world_size, compiled)
    tokens_per_fwdbwd = args.device_batch_size * args.max_seq_len * world_size
    if args.total_batch_size % tokens_per_fwdbwd:
        raise SystemExit(f"error: --total-batch-size {args.total_batch_size} is not a multiple of "
                         "--device-batch-size x --max-seq-len x processes = "
                         f"{args.device_batch_size} x {args.max_seq_len} x {world_size} = "
                         f"{tokens_per_fwdbwd}; pick a total batch that is")
    if device.type in ("cpu", "mps"):  # MPS shares the machine's memory
        check_memory(args, config, world_size, compiled)
    model = init_model(args, model, device, attention)

    def load_data():  # missing or unreadable data; a custom source is converted once
        data = prepare(args.dataset, args.text_column, args.val_fraction)
        loader = DataLoader(tokenizer, data, "train", args.device_batch_size, args.max_seq_len,
                            rank, world_size, device, prefetch=2, shuffle_seed=args.data_seed)
        held.callback(loader.close)  # its prefetch thread stops however the run ends
        # the rows every eval scores, and those the final weights score once more (0: none)
        final = (val_rows(tokenizer, data, args.max_seq_len, args.final_eval_tokens)
                 if args.final_eval_tokens else None)
        return data, loader, val_rows(tokenizer, data, args.max_seq_len, args.eval_tokens), final

    data, train_loader, val, final_val = common.on_every_rank(load_data)
    common.exit_unless_ranks_agree((tokenizer.fingerprint, data, train_loader.num_docs, len(val),
                                    final_val is not None and len(final_val)),
                                   "the tokenizer and data (fingerprint, dataset, train "
                                   "documents, val rows)", SHARE)
    if len(val) < max(1, args.eval_tokens // args.max_seq_len):
        print0(f"note: the {common.shown(args.dataset, 300, quote=False)} val split holds only "
               f"{len(val)} rows of {args.max_seq_len} tokens, fewer than --eval-tokens "
               f"{args.eval_tokens:,} asks for; evaluating on all of it")
    if args.fsdp:
        mesh = init_device_mesh(device.type, (world_size,))
        for block in model.blocks:  # each block's params are gathered just before it runs
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = model.setup_optimizer(**optimizer_options(args, compiled), horizon=num_iterations)
    forward = SeedBatch(model) if args.seeds else model
    train_model = torch.compile(forward, dynamic=False) if compiled else forward
    run = Run(args=args, rank=rank, world_size=world_size, device=device, run_dir=run_dir,
              tokenizer=tokenizer, token_bytes=tokenizer.token_bytes().to(device), config=config,
              model=model, train_model=train_model, optimizer=optimizer, train_loader=train_loader,
              val=val, final_val=final_val, num_params=num_params, flops_per_token=flops_per_token,
              num_iterations=num_iterations, grad_accum=args.total_batch_size // tokens_per_fwdbwd,
              compiled=compiled, autocast=common.autocast(device, args.dtype),
              synchronize=common.synchronizer(device))
    if args.seeds:  # one value per seed
        run.copies, run.loop["smooth_loss"] = len(args.seeds), [0.0] * len(args.seeds)
    run.loop["precision"] = [[0, *report.precision_of(args)]]  # a resume reads the run's own
    # --start-over moves the earlier run aside only now, with every flag accepted
    keep_earlier_runs(run_dir, rank, fresh=fresh and args.start_over, start_over=True)
    check_disk(run_dir, rank, optimizer, num_iterations, args.save_every, args.keep_checkpoints)
    return run


def init_model(args, model: GPT, device, attention) -> GPT:
    """The meta model initialized on `device` alike on every rank (from --seed, or each --seeds
    init its own run's), attending through `attention`, with --fp8 its linears in fp8."""
    if args.seeds:
        model = seeded_gpt(model.config, args.seeds, device)
    else:
        torch.manual_seed(args.seed)
        model.to_empty(device=device)
        model.init_weights()
    model.use_attention(attention.func)
    if args.fp8:  # before FSDP and compile wrap the layers; the same Parameters, so after init
        swapped = convert_to_fp8(model, args.fp8_recipe, device)
        head = "lm_head" if type(model.lm_head).__name__ == "Float8Linear" else "not lm_head"
        print0(f"fp8: {swapped} linear layers in fp8, {head} among them ({args.fp8_recipe} scales"
               f"{', emulated off CUDA' if device.type != 'cuda' else ''}); the embedding and "
               f"attention in {args.dtype}")
    return model


def resume(run: Run) -> None:
    """Continue from a checkpoint: refuse one these flags cannot continue exactly, else restore the
    model, the optimizer, the data loader (resharded to a new process count) and the loop state."""
    args = run.args
    # every rank reads it: one that cannot stops all, and 'latest' must be one step everywhere
    step, meta = common.on_every_rank(lambda: checkpoint.load_step(
        run.run_dir, args.resume_from_step, tuple(checkpoint.META_TYPES), warn=print0))
    common.exit_unless_ranks_agree(step, "the checkpoint step resumed from", SHARE)
    with common.user_errors():  # a mismatched checkpoint
        # hand edits
        problems = [f"loop.{k} is {common.shown(repr(v), 120, quote=False)} in its meta.json"
                    for k, v in meta["loop"].items()
                    if k in run.loop and not isinstance(v, type(run.loop[k]) if k != "smooth_loss"
                                                        or args.seeds else (int, float))]
        problems = problems or report.precision_problems(meta["loop"], step)
        # older configs: defaults
        if (saved := GPTConfig(**meta["model_config"]).to_dict()) != run.config.to_dict():
            problems += checkpoint.model_changes(saved, run.config.to_dict())
        if meta["tokenizer"] != run.tokenizer.fingerprint:
            problems.append("it was trained with a different tokenizer (retrain or restore the "
                            f"tokenizer in {common.get_base_dir() / 'tokenizer'})")
        # the process count and --device-batch-size may change; a new --eval-tokens would mix two
        # val sets in one history
        for key in ("dataset", "text_column", "val_fraction", "total_batch_size", "optimizer",
                    "variant_option", "eval_tokens", "data_seed", "seeds"):
            saved = meta["args"].get(key, "muon" if key == "optimizer" else None)  # runs before it
            if saved != getattr(args, key):
                problems.append(f"--{key.replace('_', '-')} was {common.shown(saved, 80)}, now "
                                f"{getattr(args, key)!r}")
        if meta["num_iterations"] != run.num_iterations:  # the lr schedule depends on the horizon
            problems.append(f"the run was {meta['num_iterations']} steps long, these flags make it "
                            f"{run.num_iterations} (pass --num-iterations "
                            f"{meta['num_iterations']})")
        if problems:
            raise SystemExit(f"error: cannot resume {run.run_dir} at step {step}: "
                             + "; ".join(problems))
        # the model and optimizer state, each rank reading its pieces; every group value the
        # flags decided (initial_lr, weight_decay, ...) wins over the saved one, a change said
        scheduled = ("params", "lr", "momentum", "step")  # follow from those, or saved
        flags = [{k: v for k, v in g.items() if k not in scheduled
                  and not (k == "weight_decay" and "initial_weight_decay" in g)}
                 for g in run.optimizer.param_groups]
        checkpoint.load_into(run.run_dir, step, run.model, run.optimizer)
        plain = lambda v: list(v) if isinstance(v, tuple) else v  # tuples come back as lists
        for group, wanted in zip(run.optimizer.param_groups, flags):
            for key, value in wanted.items():
                if plain(group.get(key)) != plain(value):
                    print0(f"resume: {group.get('name', 'a group')} {key} was "
                           f"{group.get(key)!r} in the checkpoint, {value!r} now (the flags win)")
                group[key] = value
        same = meta["world_size"] == run.world_size
        run.train_loader.load_state_dict(meta["loader"][run.rank] if same else
                                         reshard_states(meta["loader"], run.rank, run.world_size))
        if not same:
            print0(f"resharded the data loader from {meta['world_size']} to {run.world_size} "
                   "processes: the same documents, read in a different order from here on")
    run.step, run.loop = step, dict(run.loop, **meta["loop"])
    run.loop["precision"] = report.resumed_precision(meta["loop"], meta["args"], args, step)
    print0(f"resumed {run.run_dir} at step {step}")
    set_aside_later_steps(run.run_dir, run.rank, step)


def evaluate(run: Run, final: bool = False) -> None:
    """Val bpb (each seed's) over --eval-tokens' rows, or (final) --final-eval-tokens' once, into
    the loop state and this step's checkpoint if one was just saved."""
    rows = run.final_val if final else run.val
    run.model.eval()
    with plain_linears(run.model):  # bf16, as nanochat evaluates an fp8 run
        bpb = evaluate_bpb(run.train_model, rows, run.args.device_batch_size, run.token_bytes,
                           run.args.dtype)
    run.model.train()
    said, key = f"val bpb {common.numbers_text(bpb)}", "val/bpb"
    if final:
        run.loop["final_eval"] = [scored_tokens(rows), bpb]
        said, key = f"final eval: {said} over {scored_tokens(rows):,} tokens", "val/final_eval_bpb"
    else:
        run.loop["val_history"].append((run.step, bpb))
        run.loop["val_train_time"].append(run.loop["train_time"])
    if run.rank == 0 and run.step in checkpoint.list_steps(run.run_dir):
        checkpoint.record_loop(run.run_dir, run.step, run.loop)
    print0(f"step {run.step:05d} | {said}")
    if run.wandb:
        run.wandb.log({"step": run.step, **common.wandb_values(key, bpb, run.args.seeds)})


def save(run: Run) -> None:
    """A checkpoint of this step that resumes exactly, at any process count (collective)."""
    if not tensors_finite(run.model.parameters()):  # a collective: every rank agrees
        common.compute_cleanup()
        raise SystemExit(f"error: the model has non-finite parameters at step {run.step}; not "
                         f"checkpointing it. {where_to_resume(run).capitalize()} with lower lrs")
    tensors, files = checkpoint.state_of(run.model, run.optimizer)  # this rank's pieces
    mine = run.train_loader.state_dict()
    loader_states = [mine] * run.world_size  # one process: its own state
    if run.world_size > 1:  # torchrun: every rank's
        dist.all_gather_object(loader_states, mine)
    meta = dict(step=run.step, num_iterations=run.num_iterations, model_config=run.config.to_dict(),
                args=vars(run.args), tokenizer=run.tokenizer.fingerprint, world_size=run.world_size,
                loader=loader_states, loop=run.loop, torch=torch.__version__)
    error = None
    try:  # every rank writes its pieces; rank 0 the rest, and renames the whole into place
        path = checkpoint.save_checkpoint(run.run_dir, run.step, tensors, meta, files)
        print0(f"saved {path}")
        if run.rank == 0:
            for line in checkpoint.prune_checkpoints(run.run_dir, run.args.keep_checkpoints):
                print0(line)
    # one line, the same on every rank (a full disk says so); earlier checkpoints stay
    except OSError as e:
        error = e.strerror
    common.exit_if_any_failed(error)


def where_to_resume(run: Run, before: int | None = None) -> str:
    """The way back for a stopped run: its newest checkpoint (before step `before`), or none."""
    steps = checkpoint.list_steps(run.run_dir)
    if not (earlier := [s for s in steps if before is None or s < before]):
        return (f"there is no checkpoint from before step {before}" if steps
                else "there is no checkpoint yet") + ": start the run afresh"
    where = checkpoint.step_dir(run.run_dir, earlier[-1])
    if before is None:
        return f"resume from its last checkpoint, {where} (--resume-from-step latest),"
    return f"resume from {where} (--resume-from-step {earlier[-1]}),"


def first_plan(group: dict):
    """A muon group's MuonPlan for its first matrix: what it says of the group holds for all."""
    p = group["params"][0]
    return muon_plan(group, p.shape, p.dtype, p.device)


def group_words(group: dict, arch: Arch, args) -> str:
    """A group's header line: its kind and peak lr and, for a Muon group, the momentum and weight
    decay that run (scheduled, kept, or not applied by its apply stage)."""
    words = f"{group.get('name', 'group')}: {group['kind']}, peak lr {group['initial_lr']:.3g}"
    if group["kind"] != "muon":  # AdamW or a kind of kinds.py: a momentum runs as beta1 (MuonAdamW)
        betas = tuple(group.get("betas", ()))
        if betas and group.get("momentum") is not None:
            betas = (group["momentum"], betas[1])
        words += f", betas {betas}" * bool(betas)
        return f"{words}, weight decay {group['weight_decay']:.3g}"
    momentum = ("the arch's schedule" if momentum_scheduled(group, args)
                else f"{group['initial_momentum']:.3g}, kept")
    decay = group["initial_weight_decay"]
    if not decay_applied(group):
        decay_words = f"not applied by its apply stage {group['apply']!r}"
    elif decay and arch.weight_decay(1, 2, 1.0) < 1:
        decay_words = f"{decay:.4g} on a cosine to 0"
    else:
        decay_words = f"{decay:.4g}"
    return f"{words}, momentum {momentum}, weight decay {decay_words}"


def decay_applied(group: dict) -> bool:
    """Whether a Muon group's weight decay runs: its apply stage's choice (torch-muon's groups, of
    torch.optim.Muon, always decay)."""
    return "apply" not in group or first_plan(group).decays


def muon_values(optimizer, decays_applied: list[bool]) -> str:
    """The step line's Muon momentum and weight decay as they run now: one value where the Muon
    groups agree, else each group's in the header's order (a decay not applied shows as -)."""
    muon = [g for g in optimizer.param_groups if g["kind"] == "muon"]
    momenta = [f"{g['momentum']:.3g}" for g in muon]
    decays = [f"{g['weight_decay']:.3g}" if applied else "-"
              for g, applied in zip(muon, decays_applied, strict=True)]
    return " | ".join(f"{name} {values[0] if len(set(values)) == 1 else '/'.join(values)}"
                      for name, values in (("mom", momenta), ("wd", decays)) if values)


def announce(run: Run) -> None:
    """What is about to train, and (on request, rank 0) the wandb run."""
    args, run.peak_flops = run.args, peak_flops(run.device)
    print0(f"model: depth {run.config.n_layer}, width {run.config.n_embd}, {run.config.n_head} "
           f"heads, {run.num_params:,} params, {run.flops_per_token:.3e} FLOPs/token")
    print0(f"batch: {args.total_batch_size:,} tokens/step = {args.device_batch_size} rows x "
           f"{args.max_seq_len} tokens x {run.world_size} processes x {run.grad_accum} "
           "accumulation steps")
    print0(f"groups (each lr not given by a flag is the lr rule's at "
           f"{args.total_batch_size:,} tokens/step, nanomuon/recipe.py):")
    for group in run.optimizer.param_groups:
        print0(f"  {group_words(group, ARCHS[args.arch], args)}")
    run.decays_applied = [decay_applied(g) for g in run.optimizer.param_groups
                          if g["kind"] == "muon"]  # asked once: the step line shows them
    for group in (g for g in run.optimizer.param_groups if "apply" in g):
        print0(f"Muon update ({group.get('name', 'muon')}): {first_plan(group).summary}")
    tokens = run.num_iterations * args.total_batch_size
    print0(f"training: {run.num_iterations:,} steps, {tokens:,} tokens "
           f"({tokens / run.model.num_scaling_params():.3g} per scaling param), on "
           f"{common.shown(args.dataset, 300, quote=False)}, {run.world_size} x "
           f"{run.device.type}{' (compiled)' if run.compiled else ''}, "
           f"{report.precision_words(*report.precision_of(args))}")
    if args.wandb != "off" and run.rank == 0:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        run.wandb = report.start_wandb(args.wandb, args.run, run.run_dir, config=vars(args))


def train(run: Run) -> None:
    """The loop: checkpoint and evaluate on schedule, then one step (train_step, record_step)."""
    args = run.args
    announce(run)
    run.model.train()
    start_step, resumed = run.step, args.resume_from_step != -1
    while True:
        step = run.step
        last = step == run.num_iterations
        # Save first: a failing eval then loses nothing. A resumed run's step is saved already, and
        # its eval too if it got that far (evaluate records it in the checkpoint).
        if step != start_step and (last or (args.save_every > 0 and step % args.save_every == 0)):
            save(run)
        evaluated = (resumed and step == start_step
                     and any(s == step for s, _ in run.loop["val_history"]))
        if not evaluated and (last or (args.eval_every > 0 and step % args.eval_every == 0)):
            evaluate(run)
        if last:
            # a resumed finished run scores newly asked-for rows too
            if run.final_val is not None and (run.loop.get("final_eval", [None])[0]
                                              != scored_tokens(run.final_val)):
                evaluate(run, final=True)
            break
        record_step(run, train_step(run), warm=step > start_step + 2)
    run.train_loader.close()


@torch.no_grad()
def tensors_finite(tensors) -> bool:
    """True when every tensor (a DTensor: its local shard) is finite on every rank (a collective).
    A norm is non-finite when an element is, and _foreach_norm is a few kernels, not 2 a tensor."""
    local = [t.detach().to_local() if isinstance(t, common.DTensor) else t.detach()
             for t in tensors]
    ok = torch.ones((), dtype=torch.int32, device=local[0].device if local else "cpu")
    if nonempty := [t for t in local if t.numel()]:
        ok = (torch.stack([n.float() for n in torch._foreach_norm(nonempty)])
              .isfinite().all().to(torch.int32))
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def all_finite(loss: torch.Tensor, params, inputs: dict | None = None) -> bool:
    """True when the loss (each seed's), every gradient and the traces of any input covariances (a
    trace bounds its entries: MuonAdamW.give_inputs refuses one that overflows) are finite on
    every rank (collective)."""
    traces = [c.diagonal(dim1=-2, dim2=-1).sum(-1) for c in (inputs or {}).values()]
    return tensors_finite([loss.reshape(-1)] + [p.grad for p in params if p.grad is not None]
                          + traces)


@dataclass
class Step:
    """What one optimizer step measured (train_step), for record_step."""
    loss: float | list  # this rank's mean loss over the micro-batches (each seed's)
    finite: bool  # False: the update was skipped
    lrm: float  # the lr multiplier it ran at
    seconds: float
    optimizer_seconds: float


def train_step(run: Run) -> Step:
    """One optimizer step over grad_accum micro-batches, skipped on every rank alike when any loss
    or gradient is not finite."""
    args, model, step = run.args, run.model, run.step
    run.synchronize()
    t0 = time.perf_counter()
    loss_sum = torch.zeros((run.copies,) if args.seeds else (), device=run.device)
    if args.qk_clip:
        model.track_max_logits()  # this step's logits decide this step's clip
    # a stage that reads its matrices' inputs this step (Newton-Muon): their mean covariances
    inputs = {} if run.optimizer.wants_inputs() else None
    for micro in range(run.grad_accum):
        if args.fsdp:  # reduce-scatter the grads once per step, after the last micro-batch
            model.set_requires_gradient_sync(micro == run.grad_accum - 1)
        try:
            x, y = run.train_loader.next_batch()
        except DataError as e:  # bad data met mid-epoch: its line, not the loader thread's stack
            raise SystemExit(f"error: {e}") from None
        with run.autocast:
            loss = run.train_model(x, y, input_stats=inputs is not None)
        if inputs is not None:
            loss, stats = loss
            for name, cov in stats.items():
                inputs[name] = inputs.get(name, 0) + cov / run.grad_accum
        loss_sum += loss.detach()
        # batched seeds: each seed's loss its own, so the sum's gradient is every seed's own
        (loss.sum() / run.grad_accum).backward()
    lrm = lr_multiplier(step, run.num_iterations, args)
    for group in run.optimizer.param_groups:
        schedule_group(group, step, run.num_iterations, args, ARCHS[run.config.arch])
    # One NaN or inf anywhere would poison every replica through the optimizer's reductions, so
    # all ranks agree to skip the update instead; a run that keeps producing them is stopped.
    finite = all_finite(loss_sum, model.parameters(), inputs)
    run.synchronize()
    t1 = time.perf_counter()
    if finite:
        if inputs is not None:
            named = dict(model.named_parameters())
            run.optimizer.give_inputs({named[name]: cov for name, cov in inputs.items()})
        run.optimizer.step()
        if args.qk_clip:
            run.loop["qk_clipped"] = run.loop.get("qk_clipped", 0) + model.qk_clip_(args.qk_clip)
            model.track_max_logits(False)  # evals and samples need no logits
    model.zero_grad(set_to_none=True)
    train_loss = (loss_sum / run.grad_accum).tolist()  # this rank's (each seed's); syncs
    t2 = time.perf_counter()
    run.step += 1
    return Step(train_loss, finite, lrm, t2 - t0, t2 - t1)


def record_step(run: Run, s: Step, warm: bool) -> None:
    """Count a skipped step (stopping a run that diverged), keep the timings (warm: past the steps
    that compile) and the smoothed loss, and print and log the step."""
    args, loop, step = run.args, run.loop, run.step
    beta = 0.9  # the smoothed loss's decay
    if s.finite:
        loop["nonfinite_in_a_row"] = 0
        if warm:
            loop["step_times"].append(s.seconds)
            loop["optim_times"].append(s.optimizer_seconds)
            loop["train_time"] += s.seconds
        loop["smooth_loss"] = common.per_seed(lambda old, new: beta * old + (1 - beta) * new,
                                              loop["smooth_loss"], s.loss)
        loop["history"].append((step, s.loss))
    else:
        loop["skipped_steps"] += 1
        loop["nonfinite_in_a_row"] += 1
        print0(f"warning: step {step}: non-finite loss or gradients, update skipped "
               f"({loop['nonfinite_in_a_row']} in a row, {loop['skipped_steps']} in this run)")
        if loop["nonfinite_in_a_row"] >= args.max_nonfinite_steps:
            common.compute_cleanup()
            # the weights that gave the first bad step's loss are those of the step before it
            # (and, updates skipped, of every step since): a checkpoint from before those
            held = step - loop["nonfinite_in_a_row"]
            raise SystemExit(f"error: {loop['nonfinite_in_a_row']} steps in a row, through step "
                             f"{step}, had a non-finite loss or gradients: the run diverged. "
                             f"{where_to_resume(run, before=held).capitalize()} with lower lrs "
                             "(--matrix-lr, --embedding-lr, --unembedding-lr) or a warmup "
                             "(--warmup-ratio)")
    trained = step - loop["skipped_steps"]  # the average's bias correction counts these
    smooth_loss = (common.per_seed(lambda v: v / (1 - beta ** trained), loop["smooth_loss"])
                   if trained else math.nan)
    tok_per_s = args.total_batch_size * run.copies / s.seconds  # every seed's tokens
    if step % args.log_every == 0 or step == run.num_iterations:
        parts = [f"step {step:05d}/{run.num_iterations:05d} "
                 f"({100 * step / run.num_iterations:5.1f}%)",
                 f"loss {common.numbers_text(smooth_loss)}" if s.finite else "skipped (non-finite)",
                 f"lrm {s.lrm:.2f}", f"dt {1000 * s.seconds:.0f}ms", f"tok/s {tok_per_s:,.0f}"]
        if run.peak_flops:
            mfu = run.flops_per_token * tok_per_s / (run.peak_flops * run.world_size)
            parts.append(f"mfu {100 * mfu:.1f}%")
        if muon := muon_values(run.optimizer, run.decays_applied):
            parts.append(muon)
        parts.append(f"attn {args.attention}")
        if args.qk_clip:
            parts.append(f"qk-clipped heads {loop.get('qk_clipped', 0)}")
        if loop["step_times"]:
            eta = statistics.median(loop["step_times"]) * (run.num_iterations - step)
            parts.append(f"eta {eta / 60:.1f}m")
        line = " | ".join(parts)
        if args.step_record and run.rank == 0:  # before the line: whoever reads it finds its record
            append_step_record(args.step_record, step=step, steps=run.num_iterations,
                               loss=smooth_loss, dt_ms=1000 * s.seconds, tok_per_s=tok_per_s,
                               finite=s.finite, line=line)
        print0(line)
    if run.wandb:
        logged = (common.wandb_values("train/loss", smooth_loss, args.seeds) if s.finite
                  else {"train/skipped_steps": loop["skipped_steps"]})
        run.wandb.log({"step": step, **logged, "train/lrm": s.lrm, "train/tok_per_s": tok_per_s})


def report_on(run: Run) -> dict:
    """The run's numbers and greedy samples, and (rank 0) its report files (nanomuon/report.py)."""
    args = run.args
    summary = report.summarize(run)
    samples = (report.greedy_samples(run.model, run.tokenizer, args.sample_tokens, args.seeds)
               if args.sample_tokens > 0 and (run.rank == 0 or args.fsdp) else [])
    if run.wandb:  # so base_eval logs CORE into this run, not a new one
        summary["wandb_id"] = run.wandb.id
    if run.rank == 0:  # with what the process read: ablate caches the run by it, or not at all
        report.write_report(run, dict(summary, read=reads.record(),
                                      not_used=flags_not_used(args)), samples)
    if run.wandb:
        run.wandb.summary.update(summary)
        run.wandb.finish()
    return summary


if __name__ == "__main__":
    main()
