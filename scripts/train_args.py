"""
base_train's flags and the checks they pass before anything is built: each value and combination
refused in one line (check_args), a model or a horizon past what can run (check_reach,
check_model_fits), and on a CPU the memory training will take (check_memory). ablate and the
benches parse base_train's flags with parse_args too, without importing the trainer.
"""

import argparse
import functools
import math
import os
import traceback
from pathlib import Path

import torch

from nanomuon import checkpoint, common, ideas, reads, recipe
from nanomuon.arch import ARCHS, LR_SCHEDULES, param_groups, train_memory
from nanomuon.attention import CHOICES as ATTENTION_CHOICES
from nanomuon.common import available_memory, print0  # tests stand in for available_memory
from nanomuon.fp8 import RECIPES
from nanomuon.gpt import GPT, GPTConfig, config_from_depth
from nanomuon.kinds import state_slots
from nanomuon.param_groups import fill_defaults
from nanomuon.run import run_arg
from nanomuon.seeds import check_seeds, parse_seeds
from nanomuon.sharded import check_sharded_stages
from nanomuon.sources import add_data_args
from nanomuon.stages import muon_state_layout
from nanomuon.variants import OPTIMIZER_VARIANTS

# The largest lr a flag may ask for: 1,000x the tuned ones, far past divergence, yet with the update
# math's factors on it (sqrt of a dimension, 1/(1 - beta1)) far inside fp32, where the step fits
MAX_LR = 1000.0
MAX_STEPS = 10 ** 9  # a year of the CPU miniature's steps: a horizon over it is a typo, not a run
LR_FLAGS = recipe.PeakLRs._fields[:4]  # embedding_lr, unembedding_lr, matrix_lr, adamw_matrix_lr


def seeds_arg(s: str):
    """argparse type for --seeds: distinct seeds, comma-separated."""
    try:
        return parse_seeds(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def batch_arg(s: str):
    """argparse type for --device-batch-size: rows >= 1, or 'auto'."""
    if s == "auto" or (s.isdigit() and int(s) >= 1):
        return s if s == "auto" else int(s)
    raise argparse.ArgumentTypeError(f"expected a number of rows >= 1 or 'auto', got {s!r}")


def add_optimizer_args(p: argparse.ArgumentParser) -> None:
    """Each group's lr (a flag left out takes the lr rule's), weight decay, variant, schedule."""
    rule = "default: the lr rule's at --total-batch-size"
    for name, what in (("embedding", "AdamW lr of the embedding, at width 768"),
                       ("unembedding", "AdamW lr of lm_head, at width 768"),
                       ("matrix", "Muon lr of the block matrices"),
                       ("adamw-matrix", "AdamW lr of the block matrices, at width 768, for a "
                        "variant that trains them with AdamW")):
        p.add_argument(f"--{name}-lr", type=float, default=None, help=f"{what} ({rule})")
    p.add_argument("--weight-decay", type=float, default=None, help="Muon's cautious weight "
                   "decay (default: the rule's, by batch and horizon: docs/lr_rule.md)")
    p.add_argument("--lr-multiplier", type=float, default=1.0, help="scales every lr, the "
                   "--optimizer variant's own included")
    p.add_argument("--optimizer", choices=list(OPTIMIZER_VARIANTS), default="muon",
                   help="optimizer variant (nanomuon/variants.py; scripts.ablate compares them)")
    p.add_argument("--ideas", action="append", default=[], metavar="FILE",
                   help="a Python file of yours that registers stages and variants (run as your "
                   "code before the flags parse; nanomuon/ideas.py)")
    p.add_argument("--variant-option", action="append", default=None, metavar="KEY=VALUE",
                   help="set one of the --optimizer variant's settings: a Muon option "
                   "(precondition_frequency=10), a field of its record, or a dotted path "
                   "(roles.mlp.fc.lr_factor=2); repeatable (ideas.with_options)")
    p.add_argument("--schedule", choices=list(LR_SCHEDULES), default="warmup_warmdown",
                   help="lr schedule (arch.LR_SCHEDULES; the --optimizer variant may set its own)")
    recipe = "default: the recipe's, by batch: docs/lr_rule.md"
    p.add_argument("--warmup-ratio", type=float, default=None, help="fraction of steps with "
                   f"linear lr warmup ({recipe}; none below 2^19 tokens/step, 40 steps from there)")
    p.add_argument("--warmdown-ratio", type=float, default=None, help="fraction of steps with "
                   f"linear lr decay ({recipe}; 0.4 below 2^19 tokens/step, 0.65 from there)")
    p.add_argument("--final-lr-frac", type=float, default=None, help="lr at the end, as a "
                   f"fraction of the peak ({recipe}; 0 below 2^19 tokens/step, 0.05 from there)")


def add_compute_args(p: argparse.ArgumentParser) -> None:
    """How the steps compute: compile, precision, the attention kernel, fp8, sharding."""
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model and the optimizer update (default: on for CUDA)")
    p.add_argument("--dtype", choices=common.DTYPES, default="auto", help="forward and backward "
                   "in bf16 autocast or fp32 (params stay fp32); auto: bf16 where its matmuls are "
                   "fast")
    p.add_argument("--attention", choices=ATTENTION_CHOICES, default="auto",
                   help="the attention kernel; auto: fa3, fa4 or fa3-hub on a Hopper GPU in bf16, "
                   "else flex (CUDA) or chunked (CPU) for sliding windows, else sdpa "
                   "(nanomuon/attention.py); base_train says which, and why")
    p.add_argument("--fp8", action="store_true", help="fp8 matmuls in the blocks' linear layers "
                   "and lm_head, as nanochat, through torchao (compute capability 8.9+; emulated "
                   "on CPU); the embedding, attention and evaluation stay in --dtype")
    p.add_argument("--fp8-recipe", choices=RECIPES, default="tensorwise",
                   help="fp8 scaling: one scale per tensor (faster) or per row (more precise)")
    p.add_argument("--fsdp", action="store_true", help="shard params, grads and optimizer state "
                   "over the torchrun processes with FSDP2; Muon stays exact (nanomuon/sharded.py)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in its help, but None: that flag's help says what its absence does."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """When the run evaluates and saves, and what it starts from: nothing, or a checkpoint."""
    p.add_argument("--eval-every", type=int, default=250,
                   help="steps between val bpb evals (-1: only at the end)")
    p.add_argument("--eval-tokens", type=int, default=10 * 524288,
                   help="validation tokens per eval")
    p.add_argument("--final-eval-tokens", type=int, default=0, help="after the last eval, score "
                   "this many val tokens once more (-1: the whole split; 0: none): final_eval_bpb")
    p.add_argument("--save-every", type=int, default=-1,
                   help="steps between checkpoints (-1: only at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="the newest checkpoints kept "
                   "after each save (two: a corrupt newest still leaves one); -1: keep all")
    p.add_argument("--resume-from-step", default=-1,
                   type=functools.partial(checkpoint.step_arg, words=("latest", "auto")),
                   help="continue from this checkpoint: a step, 'latest', or 'auto' (latest if "
                   "there is one, else start fresh: for torchrun --max-restarts); -1: start fresh")
    p.add_argument("--start-over", action="store_true", help="train afresh in a --run that holds "
                   "checkpoints or results, moving them into runs/<run>/previous.N")


def load_ideas(argv) -> None:
    """Run each --ideas file in argv before the parser lists the variants --optimizer takes."""
    q = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    q.add_argument("--ideas", action="append", default=[])
    for path in q.parse_known_args(argv)[0].ideas:
        try:
            ideas.load(path)
        except ValueError as e:  # the file itself, or what it raised (then: where)
            where = raised_at(e)
            q.error(f"--ideas {common.shown(path, 300, quote=False)}: your file raised "
                    f"{common.one_line(e)}{where}" if where else str(e))


def raised_at(e: BaseException) -> str:
    """' (at FILE:LINE)' of the innermost user code (an ideas file) e came through, else ''."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if reads.is_user(f.filename)]
    return (f" (at {common.shown(frames[-1].filename, 300, quote=False)}:{frames[-1].lineno})"
            if frames else "")


def parse_args(argv=None):
    load_ideas(argv)
    p = argparse.ArgumentParser(description="Pretrain a GPT with Muon+AdamW", allow_abbrev=False,
                                formatter_class=HelpFormatter)
    # run
    p.add_argument("--run", type=run_arg, default=None, help="run name: names the "
                   "checkpoint directory and the wandb run (default d<depth>)")
    p.add_argument("--wandb", choices=["off", "online", "offline"], default="off",
                   help="log to Weights & Biases")
    p.add_argument("--device-type", choices=["auto", "cuda", "cpu", "mps"], default="auto")
    p.add_argument("--memory-check", action=argparse.BooleanOptionalAction, default=True,
                   help="on a CPU or MPS, refuse a run whose estimated memory is over what is "
                   "free; --no-memory-check trains where free memory cannot be read")
    # fineweb-edu: download with python -m nanomuon.dataset; embedded: no network
    add_data_args(p, "fineweb-edu")
    p.add_argument("--seed", type=int, default=None, help="seed of the init (default 42)")
    p.add_argument("--seeds", type=seeds_arg, default=None, help="train these seeds' inits "
                   "(e.g. 1,2,3) as one batched model on the same batches (nanomuon/seeds.py)")
    p.add_argument("--data-seed", type=int, default=None,
                   help="shuffle the training documents with this seed (the row groups, then the "
                   "documents of every 8 of them; default: file order)")
    add_compute_args(p)
    # model
    p.add_argument("--depth", type=int, default=20,
                   help="number of transformer blocks; sets the width too")
    p.add_argument("--aspect-ratio", type=int, default=64,
                   help="width = depth * aspect ratio (rounded up)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--arch", choices=("auto", *ARCHS), default="auto", help="the model: "
                   "nanochat (92d63d4's, with its recipe) or classic (its late-2025 plain GPT, the "
                   "CPU miniature's); auto: nanochat on CUDA, classic elsewhere (docs/training.md)")
    p.add_argument("--window-pattern", default=None, help="sliding windows, tiled over the "
                   "layers: L the whole context, S a quarter of it; the last layer is always L "
                   "(default: SSSL for --arch nanochat, L for classic, which takes nothing else)")
    p.add_argument("--qk-norm", action=argparse.BooleanOptionalAction, default=True,
                   help="RMS-normalize q and k in attention (--no-qk-norm to try --qk-clip)")
    # horizon: the first of these that is set wins
    p.add_argument("--num-iterations", type=int, default=-1,
                   help="optimizer steps (-1: from the next two)")
    p.add_argument("--target-flops", type=float, default=-1.0,
                   help="training FLOPs budget (-1: off)")
    p.add_argument("--target-param-data-ratio", type=float,
                   default=recipe.NANOCHAT_TOKENS_PER_PARAM, help="tokens per scaling parameter "
                   "(block matrices and lm_head, as nanochat counts them; Chinchilla's 20 counts "
                   "every parameter)")
    # batch
    p.add_argument("--device-batch-size", type=batch_arg, default="auto", help="rows per "
                   "micro-batch per process; auto: on CUDA the most (up to 32) that fit, else 32")
    p.add_argument("--total-batch-size", type=int, default=-1,
                   help="tokens per optimizer step, all processes (-1: nanochat's, from the "
                   "horizon: 2^19 at d12's, growing as its 0.383th power)")
    add_optimizer_args(p)
    add_checkpoint_args(p)
    p.add_argument("--sample-tokens", type=int, default=None,
                   help="tokens per sample at the end (0: none; default 32, at most --max-seq-len)")
    p.add_argument("--log-every", type=int, default=1, help="steps between step lines")
    p.add_argument("--step-record", default=None, help="append each step line's numbers to "
                   "this file as a JSON line (step, steps, loss, dt_ms, tok_per_s, the line)")
    p.add_argument("--qk-clip", type=float, default=0.0, help="QK-clip threshold tau after each "
                   "step (Kimi K2's MuonClip; needs --no-qk-norm; 0: off)")
    p.add_argument("--max-nonfinite-steps", type=int, default=10, help="steps in a row with a "
                   "non-finite loss or gradient (each skipped with a warning) before the run stops")
    args = p.parse_args(argv)
    check_args(p, args)
    args.run = args.run or f"d{args.depth}"
    return args


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Every flag's value and their combinations, each refused with p.error's one line."""
    rules = [  # (flags, test, what each must be)
        (["depth", "aspect_ratio", "head_dim", "max_seq_len", "eval_tokens",
          "log_every", "max_nonfinite_steps"], lambda v: v >= 1, ">= 1"),
        (["num_iterations", "total_batch_size"], lambda v: v >= 1 or v == -1,
         ">= 1 (or -1 to derive it)"),
        (["eval_every", "save_every"], lambda v: v >= 1 or v == -1,
         ">= 1, or -1 for only at the end"),
        (["keep_checkpoints"], lambda v: v >= 1 or v == -1, ">= 1, or -1 to keep all"),
        (["warmup_ratio", "warmdown_ratio", "final_lr_frac"],
         lambda v: v is None or 0.0 <= v <= 1.0, "in [0, 1]"),
        ([*LR_FLAGS, "weight_decay", "qk_clip", "lr_multiplier"],
         lambda v: v is None or (math.isfinite(v) and v >= 0), "a finite number >= 0"),
        (["target_flops", "target_param_data_ratio"], math.isfinite,
         "a finite number (or <= 0: off)"),
        (["seed", "data_seed"], lambda v: v is None or 0 <= v < 2 ** 64, "in [0, 2**64)"),
        (["final_eval_tokens"], lambda v: v >= -1,
         ">= 1, 0 for none, or -1 for the whole val split"),
    ]
    for names, ok, what in rules:
        for name in names:
            if not ok(getattr(args, name)):
                p.error(f"--{name.replace('_', '-')} must be {what}, got {getattr(args, name)}")
    check_reach(p, args)
    if (args.warmup_ratio or 0.0) + (args.warmdown_ratio or 0.0) > 1.0:
        p.error(f"--warmup-ratio {args.warmup_ratio} + --warmdown-ratio {args.warmdown_ratio} "
                "exceed 1")
    if args.num_iterations == -1 and args.target_flops <= 0 and args.target_param_data_ratio <= 0:
        p.error("no training horizon: set --num-iterations, --target-flops or "
                "--target-param-data-ratio")
    if args.qk_clip and args.qk_norm:
        p.error("--qk-clip has nothing to do with QK-norm on (it already bounds the logits); add "
                "--no-qk-norm")
    if args.fsdp and args.optimizer == "torch-muon":
        p.error("--fsdp needs a nanomuon optimizer variant; torch-muon (stock torch.optim.Muon) "
                "runs replicated only")
    check_variant_options(p, args)
    if args.fsdp:  # each Muon group's stages, a role's included, as a tiny model takes them
        config = config_from_depth(2, 64, 16, aspect_ratio=32, head_dim=16, arch=arch_on(
            args.arch, "cuda" if torch.cuda.is_available() else "cpu"))
        for group in variant_groups(args, config):
            role = "" if group["name"] == "matrices" else f" (its group {group['name']!r})"
            try:
                if group["kind"] == "muon":
                    check_sharded_stages(f"--optimizer {args.optimizer}{role}", group)
            except ValueError as e:
                p.error(f"{e}: drop --fsdp")
    if args.seeds is not None and args.seed is not None:
        p.error(f"--seed {args.seed} and --seeds: give one (--seeds trains each seed it lists)")
    if args.seeds is not None and len(args.seeds) == 1:  # one seed: a plain run of it
        args.seed, args.seeds = args.seeds[0], None
    args.seed = 42 if args.seed is None else args.seed
    if args.seeds:
        try:
            check_seeds(args.seeds, args.qk_clip, args.fp8, args.fsdp, args.optimizer)
        except ValueError as e:
            p.error(str(e))
    if args.start_over and args.resume_from_step != -1:
        p.error("--start-over trains afresh; it cannot go with --resume-from-step "
                f"{args.resume_from_step} (drop one)")
    if isinstance(args.resume_from_step, int) and args.resume_from_step < -1:
        p.error("--resume-from-step must be a step >= 0, 'latest', 'auto', or -1; got "
                f"{args.resume_from_step}")
    # more than the window only re-runs its last max-seq-len tokens, ever longer, before the report
    if args.sample_tokens is None:  # the default never refuses a short --max-seq-len
        args.sample_tokens = min(32, args.max_seq_len)
    if not 0 <= args.sample_tokens <= args.max_seq_len:
        p.error(f"--sample-tokens must be in [0, {args.max_seq_len}] (0: none; at most "
                f"--max-seq-len), got {args.sample_tokens}")
    record = Path(args.step_record or ".")  # a regular file (or none yet) in a folder that exists
    if args.step_record is not None and not record.parent.is_dir():
        p.error(f"--step-record {record}: its folder {record.parent} does not exist; create it or "
                "name a file in another")
    if args.step_record is not None and record.exists() and not record.is_file():
        p.error(f"--step-record {record} is not a regular file; name a file")
    check_model_fits(p, args)


def arch_on(arch: str, device_type: str) -> str:
    """--arch as it trains on device_type: auto is nanochat on CUDA, else classic."""
    return arch if arch != "auto" else "nanochat" if device_type == "cuda" else "classic"


def check_variant_options(p: argparse.ArgumentParser, args) -> None:
    """The variant (an ideas file's too) with any --variant-option set, as a tiny model of the
    run's arch takes it: a misspelt role or a bad value is one line now, not a traceback later."""
    if not args.variant_option and not ideas.ideas_of(args.optimizer):
        return  # the library's own variants: its tests check them
    cuda = args.device_type in ("auto", "cuda") and torch.cuda.is_available()
    given = " ".join(args.variant_option or [])
    what = (f"--optimizer {args.optimizer}"
            + (f" --variant-option {common.shown(given, 300, quote=False)}" if given else ""))
    try:
        settings = ideas.with_options(args.optimizer, args.variant_option)
        ideas.check_settings(settings, arch_on(args.arch, "cuda" if cuda else "cpu"))
    except (ValueError, TypeError) as e:
        p.error(f"{what}: {common.shown(str(e), 1000, quote=False)}{raised_at(e)}")
    for name in recipe.PeakLRs._fields[:-1]:  # the lrs, bounded as their flags are (check_reach)
        lr = settings.lrs.get(name)
        if isinstance(lr, (int, float)) and not 0 <= lr * args.lr_multiplier <= MAX_LR:
            p.error(f"{what}: {name} {lr:g} x --lr-multiplier {args.lr_multiplier:g} is not in "
                    f"[0, {MAX_LR:,g}]: no lr that large trains (the tuned ones are below 1)")


def check_reach(p: argparse.ArgumentParser, args) -> None:
    """Values that parse but cannot run: lrs over MAX_LR, steps over MAX_STEPS, wandb keyless."""
    if (problem := common.wandb_key_problem(args.wandb)) is not None:
        p.error(problem)
    if args.num_iterations > MAX_STEPS:
        p.error(f"--num-iterations {args.num_iterations} is more than the {MAX_STEPS:,} steps a "
                "run may take")
    lrs = {f"--lr-multiplier {args.lr_multiplier:g}": args.lr_multiplier}
    for name in LR_FLAGS:
        if (lr := getattr(args, name)) is not None:
            lrs[f"--{name.replace('_', '-')} {lr:g} x --lr-multiplier {args.lr_multiplier:g} = "
                f"{lr * args.lr_multiplier:,g}"] = lr * args.lr_multiplier
    for flag, lr in lrs.items():
        if lr > MAX_LR:
            p.error(f"{flag} is over {MAX_LR:,g}: no lr that large trains (the tuned ones are "
                    "below 1), and near 3e38 the step overflows fp32; give a smaller one")


def check_model_fits(p: argparse.ArgumentParser, args) -> None:
    """Refuse a model whose fp32 block matrices alone exceed the memory (all processes' with --fsdp)
    before a tensor is built, where torch would fail with an overflow or an OOM."""
    width = math.ceil(args.depth * args.aspect_ratio / args.head_dim) * args.head_dim  # as gpt.py
    params = 12 * args.depth * width ** 2  # attention 4 d^2 + MLP 8 d^2 a block; vocab adds more
    if args.device_type in ("auto", "cuda") and torch.cuda.is_available():
        where, memory = "this GPU", torch.cuda.get_device_properties(0).total_memory
    elif args.device_type in ("auto", "cpu", "mps"):
        where, memory = "this machine", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        return  # --device-type cuda without CUDA: build() says so
    world = os.environ.get("WORLD_SIZE", "1")
    shards = int(world) if args.fsdp and world.isdigit() and int(world) > 0 else 1
    if 4 * params > memory * shards:
        p.error(f"--depth {args.depth}, --aspect-ratio {args.aspect_ratio} and --head-dim "
                f"{args.head_dim} make a model of over {params:.3g} parameters, over the memory of "
                f"{where} ({common.size_str(memory * shards)}) in fp32 alone; lower --depth, "
                "--aspect-ratio or --head-dim")


# Batched seeds on a CPU: each seed's params, grads, optimizer state and bf16 copies as
# train_memory counts them, times SEEDS_STATE; activations at SEEDS_ACTIVATION_BYTES a token, per
# layer x width and per vocabulary entry (vmap makes every matmul a batched one, whose backward
# keeps fp32 copies of a bf16 step's operands: the logits' alone take 12.6 bytes an entry, not 3);
# and the process itself (process_memory). Fitted to 2 steps' peak RSS at vocab 4,096 and 32,768,
# widths 64 to 256, 256 to 2,048 tokens a micro-batch, 2 to 20 seeds, eager and compiled, bf16 and
# fp32, on a CPU build of torch, with a margin for threads and the allocator. At width 2,048 the
# state dominates, and 2 seeds peaked at 5.51 GiB: 1.25 fell 10% short, 1.75 bounds it
SEEDS_STATE = 1.75
SEEDS_ACTIVATION_BYTES = (92, 16)
# the process: what it holds at the check (Python, torch, the scripts: 0.33 GiB with a CPU build of
# torch, 0.64 with a CUDA build, whose libraries load on import), then the tokenizer, the data and
# threads (0.25 GiB measured); PROCESS_MEMORY where /proc/self/status is not there
PROCESS_GROWTH = int(0.3 * 2 ** 30)
PROCESS_MEMORY = int(0.6 * 2 ** 30)


def process_memory() -> int:
    """This process's own bytes in training, counted whole: free memory was read after part of it
    was held, so the part is counted twice, a margin."""
    held = common.process_status("VmRSS")
    return PROCESS_MEMORY if held is None else held + PROCESS_GROWTH


def variant_groups(args, config: GPTConfig) -> list[dict]:
    """The --optimizer variant's param groups (--variant-option set, defaults filled) on a
    meta-device model of config: no memory, no init, no optimizer."""
    variant = ideas.with_options(args.optimizer, args.variant_option)
    with torch.device("meta"):
        groups = param_groups(GPT(config), variant, horizon=1)
    for group in groups:
        fill_defaults(group)
    return groups


def optimizer_state(args, config: GPTConfig) -> int:
    """Bytes of this run's optimizer state, exactly: each Muon param's slots as its stages declare
    them (StateSpec, at the roles they run on: a SOAP lm_head keeps vocab-sized factors), AdamW's
    two moments, a registered kind's as it declares them (kinds.KindState: Lion's one moment)."""
    total = 0
    for group in variant_groups(args, config):
        for p in group["params"]:
            slots = (muon_state_layout(p.shape, torch.float32, group) if group["kind"] == "muon"
                     else state_slots(group["kind"], p.shape, torch.float32)).values()
            total += sum(math.prod(shape) * dtype.itemsize for shape, dtype, *_ in slots)
    return total


def memory_parts(args, config: GPTConfig, world_size: int, compiled: bool) -> dict[str, int]:
    """One process's bytes of training on a CPU, by part: arch.train_memory's, its optimizer
    state at least optimizer_state's; with --fsdp the state's shard; with --seeds each seed's, as
    measured (SEEDS_STATE, SEEDS_ACTIVATION_BYTES), and the process's own (process_memory)."""
    parts = train_memory(config, args.device_batch_size, compiled, args.dtype == "bf16")
    parts["optimizer"] = max(parts["optimizer"], optimizer_state(args, config))
    if not args.seeds:  # with --fsdp each process holds its shard of the state, its activations
        shards = world_size if args.fsdp else 1
        return {k: v // (1 if k == "activations" else shards) for k, v in parts.items()}
    n, (per_layer, per_vocab) = len(args.seeds), SEEDS_ACTIVATION_BYTES
    token = per_layer * config.n_layer * config.n_embd + per_vocab * config.vocab_size
    state = {k: n * int(SEEDS_STATE * v) for k, v in parts.items() if k != "activations"}
    return dict(state, activations=n * args.device_batch_size * config.sequence_len * token,
                process=process_memory())


def physical_memory() -> tuple[int, int] | None:
    """Where free memory cannot be read (no /proc/meminfo: macOS, a sandbox), all of the machine's
    as the bound, said in a line; None where that cannot be read either."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    print0(f"memory: free memory cannot be read here (/proc/meminfo), so training is checked "
           f"against all {total / 2 ** 30:.1f} GiB of this machine's (--no-memory-check skips it)")
    return total, 0


def check_memory(args, config: GPTConfig, world_size: int, compiled: bool) -> None:
    """On a CPU, training's memory (memory_parts, this machine's processes) before any is
    allocated: stop when over free memory and swap (the OOM killer is silent); warn on swap. Too
    many seeds: the most that fit."""
    if not args.memory_check:
        return
    parts = memory_parts(args, config, world_size, compiled)
    if (free := available_memory() or physical_memory()) is None:
        common.exit_if_any_failed(
            f"training this model takes about {sum(parts.values()) / 2 ** 30:.1f} GiB, and "
            "neither the free memory (/proc/meminfo) nor the machine's can be read here to check "
            "it; give --no-memory-check to train without the check")
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # processes on this machine
    need, (mem, swap), gib = local * sum(parts.values()), free, 2 ** 30
    what = (f"training this model takes about {need / gib:.1f} GiB of memory ("
            + ", ".join(f"{k.replace('_', ' ')} {v / gib:.1f}" for k, v in parts.items() if v)
            + f" GiB{f' per process, x {local} processes' if local > 1 else ''}; activations at "
            f"--device-batch-size {args.device_batch_size}, --max-seq-len {args.max_seq_len})")
    error = None
    if need > mem + swap:
        fits = 0
        if args.seeds:  # the process once, then each seed alike: the most seeds that fit
            seed = (sum(parts.values()) - parts["process"]) // len(args.seeds)
            fits = max(0, int((mem + swap) / local - parts["process"]) // seed)
        lower = (f"train at most {fits} seeds at once (--seeds of {fits})" if fits
                 else "lower --depth, --device-batch-size or --max-seq-len (or train on a GPU)")
        error = (f"{what}, and this machine has {mem / gib:.1f} GiB free"
                 + (f" and {swap / gib:.1f} GiB of swap" if swap else "") + f": {lower}")
    elif need > mem:
        print0(f"warning: {what}: more than the {mem / gib:.1f} GiB free, so it will swap (slow) "
               "or be killed when memory runs out")
    common.exit_if_any_failed(error)
