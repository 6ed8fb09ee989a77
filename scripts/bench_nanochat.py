"""
Head to head with nanochat: nanomuon and Karpathy's nanochat, each training its own GPT with its own
optimizer, in one process on one device, on the same work, measured the same way.

--nanochat PATH (or NANOCHAT=PATH) names a checkout of https://github.com/karpathy/nanochat,
imported as it is, never copied; its commit (a COMMIT file, as gpu_check.sh --prepare writes, else
git's) is printed. PyPI's `nanochat` holds only the tokenizer.

Both models get the same shape (nanochat's sizing), micro-batches of random tokens made on the
device, precision (bf16: nanomuon's autocast, nanochat's NANOCHAT_DTYPE; or fp32), compile (the
model with dynamic=False, each optimizer as its project compiles it; off: all eager) and attention
(SDPA by default). Each optimizer is its GPT.setup_optimizer's at its base_train's lrs. fp8:
nanochat's own fp8 linears and nanomuon's --fp8 (torchao's), on a GPU with fp8 tensor cores.

Per side and precision: tok/s over the median step, MFU (its own FLOPs a token), the optimizer
step's median ms, the peak memory (CUDA only) and the attention it ran; then the ratios nanomuon /
nanochat. The sides run one after the other, each freed before the next is built; one that fails
(out of memory, a compile error) is one line, FAILED and why, and the other still runs.

At the speedrun's shape (d24 and the defaults) with fp8, the last line is the time to GPT-2 this
ratio implies: nanochat's 1.65 hours on 8xH100 x nanochat's tok/s / nanomuon's. It holds for one
GPU's steps; on 8 GPUs each side also shards its optimizer and communicates.

    python -m scripts.bench_nanochat --nanochat ~/nanochat --depth 12            # a GPU
    python -m scripts.bench_nanochat --nanochat ~/nanochat --depth 24 --device-batch-size 16 \\
        --total-batch-size 262144 --precision bf16 fp8
    python -m scripts.bench_nanochat --nanochat ~/nanochat --device cpu --precision fp32 \\
        --depth 2 --aspect-ratio 32 --head-dim 32 --max-seq-len 64 --vocab-size 512 \\
        --device-batch-size 2 --total-batch-size 256 --steps 2 --warmup 1    # a CPU, tiny
"""

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.util
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from nanomuon.attention import choose_attention
from nanomuon.common import autocast, one_line, resolve_compile, resolve_dtype, synchronizer
from nanomuon.fp8 import MIN_CAPABILITY, check_fp8, convert_to_fp8
from nanomuon.gpt import GPT, config_from_depth
from nanomuon.hardware import peak_flops
from scripts.bench_optim import device_name
from scripts.nanochat_parity import (
    nanochat_gpt,
    our_schedule,
    our_table,
    recipe_schedule,
    their_table,
)

SIDES = ("nanomuon", "nanochat")
# nanochat 92d63d4's leaderboard: d24 with fp8 reached GPT-2's CORE in 1.65 hours on 8xH100
GPT2_HOURS = 1.65
SPEEDRUN_SHAPE = dict(depth=24, aspect_ratio=64, head_dim=128, max_seq_len=2048,
                      vocab_size=32768, window_pattern="SSSL")
SPEEDRUN_RATIO = 8  # tokens per scaling param of both speedruns: each side's horizon and decay
GiB = 2 ** 30


@dataclasses.dataclass
class Side:
    """One project's model, ready to train: what the timing loop calls."""
    model: torch.nn.Module
    train: Callable  # the model, or its torch.compile wrapper
    optimizer: torch.optim.Optimizer
    flops_per_token: float
    context: Callable  # the precision context each forward runs in
    schedule: Callable  # (group, step): the lr, momentum and decay its base_train sets
    notes: str  # windows, fp8 layers


def locate(given: str | None) -> Path:
    """The nanochat checkout from --nanochat or NANOCHAT, or one line saying what is wrong."""
    raw = given or os.environ.get("NANOCHAT")
    if not raw:
        raise SystemExit("error: no nanochat: pass --nanochat PATH or set NANOCHAT=PATH, a "
                         "checkout of https://github.com/karpathy/nanochat (PyPI's nanochat holds only its "
                         "tokenizer)")
    try:
        root = Path(raw).expanduser().resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop: RuntimeError before Python 3.13
        raise SystemExit(f"error: --nanochat (or NANOCHAT) {raw}: a symlink loop or an unreadable "
                         f"path ({one_line(e)}): name the checkout's real folder") from None
    if root.name == "nanochat" and (root / "gpt.py").is_file():  # the package folder itself
        root = root.parent
    if not (root / "nanochat" / "gpt.py").is_file():
        raise SystemExit(f"error: {raw} holds no nanochat/gpt.py: point --nanochat (or NANOCHAT) "
                         "at a nanochat checkout, the folder that holds nanochat/")
    return root


def commit_of(root: Path) -> str:
    """nanochat's commit: its COMMIT file (gpu_check.sh --prepare), else git's HEAD when root is a
    checkout's top (not a folder inside another repository), '+changes' if its package differs.
    Read as letters, digits and ._+- only; git runs none of the checkout's hooks, fsmonitor or
    filters (blobs are compared by hash-object --no-filters, not by git diff)."""
    if (root / "COMMIT").is_file() and not (root / "COMMIT").is_symlink():
        with contextlib.suppress(OSError), open(root / "COMMIT", "rb") as f:
            return clean_commit(f.read(256).decode("latin-1")) or "unknown (COMMIT file empty)"

    def git(*args):
        return subprocess.run(["git", "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null",
                               "--no-optional-locks", "-C", str(root), *args],
                              capture_output=True, text=True, timeout=30)

    with contextlib.suppress(OSError, subprocess.SubprocessError):
        top = git("rev-parse", "--show-toplevel")
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == root:
            head = clean_commit(git("rev-parse", "--verify", "-q", "HEAD").stdout)
            files = {*git("ls-tree", "--name-only", "HEAD", "--", "nanochat/").stdout.split(),
                     *(str(p.relative_to(root)) for p in (root / "nanochat").glob("*.py")
                       if p.is_file() and not p.is_symlink())}
            dirty = any(not (root / f).is_file() or (root / f).is_symlink()  # a FIFO: unread
                        or git("rev-parse", "-q", "--verify", f"HEAD:{f}").stdout
                        != git("hash-object", "--no-filters", "--", f).stdout
                        for f in sorted(files) if f.endswith(".py"))
            return (head or "unknown") + ("+changes" if dirty else "")
    return "unknown (no COMMIT file, not a git checkout)"


def clean_commit(text: str) -> str:
    """A commit as letters, digits and ._+- only (64 at most): no escape reaches a terminal."""
    return re.sub(r"[^A-Za-z0-9._+-]", "", text)[:64]


def import_nanochat(root: Path, dtype: str, attention: str):
    """nanochat.gpt from root, computing in `dtype`; attention 'sdpa': no FA3 fetched or used."""
    print(f"nanochat: the code of {root} is imported and run in this process, as it is (its "
          "nanochat/*.py)", flush=True)
    os.environ["NANOCHAT_DTYPE"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    if attention == "sdpa":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(root))
    try:
        gpt = importlib.import_module("nanochat.gpt")
    except Exception as e:
        raise SystemExit(f"error: nanochat at {root} does not import here: {one_line(e)}") from None
    if not Path(gpt.__file__).resolve().is_relative_to(root):
        raise SystemExit(f"error: another nanochat was imported ({gpt.__file__}), not {root}'s")
    if missing := [name for name in ("GPT", "GPTConfig") if not hasattr(gpt, name)]:
        raise SystemExit(f"error: nanochat at {root} has no {' or '.join(missing)} in "
                         "nanochat/gpt.py: name a nanochat checkout of 2026 (this compares with "
                         "92d63d4)")
    flash = sys.modules.get("nanochat.flash_attention")
    if attention == "sdpa" and hasattr(flash, "USE_FA3"):
        flash.USE_FA3 = False  # read at each call
    return gpt


def nanochat_fp8(model) -> int:
    """nanochat's own fp8 linears, on the layers its base_train picks: both sizes multiples of 16,
    the smaller at least 128 (lm_head included)."""
    fp8 = importlib.import_module("nanochat.fp8")

    def eligible(module, fqn):
        return (isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0
                and module.out_features % 16 == 0
                and min(module.in_features, module.out_features) >= 128)

    config = fp8.Float8LinearConfig.from_recipe_name("tensorwise")
    fp8.convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    return sum("Float8" in type(m).__name__ for m in model.modules())


def build(name: str, nc, args, device: torch.device, fp8: bool, attention) -> Side:
    """One side's model from args.seed, with its fp8 layers and optimizer; nanomuon's with
    `attention` (choose_attention's)."""
    shape = (args.vocab_size, args.max_seq_len, args.aspect_ratio, args.head_dim)
    windows, notes = args.window_pattern, f"windows {args.window_pattern}"
    torch.manual_seed(args.seed)
    if name == "nanochat":
        model = nanochat_gpt(nc, args.depth, *shape, device, windows)
        flops = model.estimate_flops()  # before fp8: its Float8Linear layers drop out of the count
        if fp8:
            notes += f", {nanochat_fp8(model)} fp8 linears (its own)"
        recipe, optimizer = their_table(nc, args.depth, args.total_batch_size, SPEEDRUN_RATIO,
                                        shape, model)
        context, schedule = contextlib.nullcontext, recipe_schedule(recipe)
    else:
        config = config_from_depth(args.depth, *shape, arch="nanochat", window_pattern=windows)
        with torch.device("meta"):
            model = GPT(config)
        model.to_empty(device=device)
        model.init_weights()
        model.use_attention(attention.func)
        flops = model.estimate_flops()
        if fp8:
            notes += f", {convert_to_fp8(model, 'tensorwise', device)} fp8 linears (torchao)"
        steps, optimizer, flags = our_table(args.depth, args.total_batch_size, SPEEDRUN_RATIO,
                                            shape, model, args.compile)
        context, schedule = (lambda: autocast(device, args.dtype)), our_schedule(flags, steps)
    train = torch.compile(model, dynamic=False) if args.compile else model
    return Side(model, train, optimizer, flops, context, schedule, notes)


def make_batches(args, device: torch.device) -> list:
    """One step's micro-batches of random tokens, made on the device: (inputs, targets) pairs."""
    gen = torch.Generator(device=device).manual_seed(args.seed)
    rows = args.total_batch_size // args.max_seq_len
    tokens = torch.randint(0, args.vocab_size, (rows, args.max_seq_len + 1), device=device,
                           generator=gen)
    return [(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous())
            for chunk in tokens.split(args.device_batch_size)]


def train_step(side: Side, batches: list, device: torch.device,
               step: int) -> tuple[float, float, float]:
    """(step seconds, optimizer seconds, last loss) of step `step`, at its base_train's schedule."""
    sync = synchronizer(device)
    sync()
    t0 = time.perf_counter()
    for x, y in batches:
        with side.context():
            loss = side.train(x, y)
        (loss / len(batches)).backward()
    sync()
    t1 = time.perf_counter()
    for group in side.optimizer.param_groups:
        side.schedule(group, step)
    side.optimizer.step()
    sync()
    t2 = time.perf_counter()
    side.model.zero_grad(set_to_none=True)
    return t2 - t0, t2 - t1, loss.item()


def measure(build, args, device: torch.device, batches: list) -> dict:
    """Build and train one side: warmup (compiling) timed as one, then medians and peak memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    side = build()
    steps = [train_step(side, batches, device, i) for i in range(args.warmup)]
    warm = time.perf_counter() - t0
    steps += [train_step(side, batches, device, args.warmup + i) for i in range(args.steps)]
    timed = steps[args.warmup:]
    step_s = statistics.median(s for s, _, _ in timed)
    tokens = len(batches) * args.device_batch_size * args.max_seq_len
    peak = peak_flops(device)
    params = sum(p.numel() for p in side.model.parameters())
    out = dict(notes=side.notes, params=params, flops=side.flops_per_token, warm=warm,
               step=step_s, optimizer=statistics.median(o for _, o, _ in timed),
               tok_s=tokens / step_s, losses=[loss for _, _, loss in steps],
               mfu=side.flops_per_token * tokens / step_s / peak if peak else None,
               peak=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
    del side
    torch._dynamo.reset()  # the next side compiles afresh, and its graphs let this one's go
    return out


def fp8_missing(device: torch.device, side: str) -> str | None:
    """Why `side` cannot train in fp8 here, or None."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        return (f"fp8 needs a CUDA GPU with fp8 tensor cores (compute capability "
                f"{'.'.join(map(str, MIN_CAPABILITY))}+), this is {device_name(device)}")
    if side == "nanomuon":
        try:
            check_fp8(device)
        except ValueError as e:
            return str(e)
    elif importlib.util.find_spec("nanochat.fp8") is None:
        return "this nanochat has no nanochat/fp8.py"


def run_side(name: str, precision: str, nc, args, device, batches, attention) -> dict:
    """One side at one precision: its measurements, or n/a (it cannot run here) or error."""
    fp8 = precision == "fp8"
    if fp8 and (why := fp8_missing(device, name)):
        return dict(na=why)
    try:
        res = measure(lambda: build(name, nc, args, device, fp8, attention), args, device, batches)
    except Exception as e:  # out of memory, an API this checkout lacks: the other side still runs
        traceback.print_exc()
        torch._dynamo.reset()
        return dict(error=one_line(e))
    if not all(map(math.isfinite, res["losses"])):
        res["error"] = f"a loss was not finite: {res['losses']}"
    return res


def describe(res: dict, args) -> str:
    """A side's full line in the log."""
    if "na" in res or "error" in res:
        return cell(res)
    return (f"{res['params'] / 1e6:.1f}M params, {res['flops']:.3g} FLOPs a token, "
            f"{res['notes']}; build, compile and warmup ({args.warmup} steps) {res['warm']:.1f} s; "
            f"{args.steps} steps: median {res['step'] * 1e3:.1f} ms, {cell(res)}; "
            f"loss {res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}")


def cell(res: dict) -> str:
    """A side's numbers in the summary."""
    if "na" in res:
        return f"n/a ({res['na']})"
    if "error" in res and "tok_s" not in res:
        return f"FAILED ({res['error']})"
    mfu = f"MFU {res['mfu']:.1%}" if res["mfu"] is not None else "MFU n/a"
    peak = f"peak {res['peak'] / GiB:.1f} GiB" if res["peak"] is not None else "peak n/a"
    failed = f" FAILED ({res['error']})" if "error" in res else ""
    return (f"{res['tok_s']:,.0f} tok/s, {mfu}, optimizer {res['optimizer'] * 1e3:.1f} ms, "
            f"{peak}, build+warmup {res['warm']:.0f} s, attention {res['attention']}{failed}")


def attentions(args, device: torch.device):
    """nanomuon's attention (choose_attention's, for its builds) and what each side runs, named
    alike: nanochat's is its hub FA3 where that loaded, else SDPA."""
    c = config_from_depth(args.depth, args.vocab_size, args.max_seq_len, args.aspect_ratio,
                          args.head_dim, arch="nanochat", window_pattern=args.window_pattern)
    windowed = any(w is not None for w in c.window_sizes())
    ours = choose_attention(device, args.dtype, (c.n_head, c.n_kv_head, c.n_embd // c.n_head),
                            args.attention, windowed)
    fa3 = getattr(sys.modules.get("nanochat.flash_attention"), "USE_FA3", False)
    mask = " with windows as a mask" if windowed else ""
    return ours, dict(nanomuon=ours.name + (mask if ours.name == "sdpa" else ""),
                      nanochat="fa3 from the kernel hub" if fa3 else "sdpa" + mask)


def gpt2_estimate(args, results: dict, header: str) -> str | None:
    """The time to GPT-2 on 8xH100 that this run's fp8 ratio implies, or why there is none; None
    without fp8 or at another shape than the speedrun's."""
    if "fp8" not in results or any(getattr(args, k) != v for k, v in SPEEDRUN_SHAPE.items()):
        return None
    ours, theirs = results["fp8"]["nanomuon"], results["fp8"]["nanochat"]
    line = f"time to GPT-2 on 8xH100 ≈ {GPT2_HOURS} h × nanochat tok/s ÷ nanomuon tok/s at d24, fp8"
    if any("error" in r or "tok_s" not in r for r in (ours, theirs)):
        return f"{line}: no estimate (nanomuon {cell(ours)}; nanochat {cell(theirs)})"
    hours = GPT2_HOURS * theirs["tok_s"] / ours["tok_s"]
    caveat = ("" if theirs["attention"].startswith("fa3") else
              f"; nanochat's {GPT2_HOURS} h ran FA3, here it ran {theirs['attention']}")
    return (f"{line} = {GPT2_HOURS} h × {theirs['tok_s']:,.0f} ÷ {ours['tok_s']:,.0f} = "
            f"{hours:.2f} h (the ratio of this run's {args.steps} steps of "
            f"{args.total_batch_size:,} tokens on one GPU: {header}{caveat})")


def summary_line(args, precision: str, pair: dict) -> str:
    """Both sides at one precision and their ratios, nanomuon / nanochat."""
    parts = [f"{name} {cell(pair[name])}" for name in SIDES]
    a, b = pair["nanomuon"], pair["nanochat"]
    if "tok_s" in a and "tok_s" in b:
        ratios = [f"tok/s {a['tok_s'] / b['tok_s']:.3f}",
                  f"optimizer {a['optimizer'] / b['optimizer']:.3f}"]
        if a["peak"] and b["peak"]:
            ratios.append(f"peak {a['peak'] / b['peak']:.3f}")
        parts.append("nanomuon/nanochat " + ", ".join(ratios))
    return f"h2h d{args.depth} {precision}: " + "; ".join(parts)


def shape_line(args) -> str:
    c = config_from_depth(args.depth, args.vocab_size, args.max_seq_len, args.aspect_ratio,
                          args.head_dim)
    rows = args.total_batch_size // args.max_seq_len
    return (f"d{args.depth}: width {c.n_embd}, {c.n_head} heads of {c.n_embd // c.n_head}, "
            f"{args.max_seq_len:,} tokens a row, vocab {args.vocab_size:,}; "
            f"{args.total_batch_size:,} tokens a step ({rows // args.device_batch_size} "
            f"micro-batches of {args.device_batch_size} rows), random; compile "
            f"{'on' if args.compile else 'off'}, {args.dtype}, attention {args.attention}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--nanochat", help="a nanochat checkout (default: $NANOCHAT)")
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--aspect-ratio", type=int, default=64, help="width = depth x this, rounded "
                   "up to the head dim")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=2048, help="tokens a row")
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--device-batch-size", type=int, default=32, help="rows a micro-batch")
    p.add_argument("--total-batch-size", type=int, default=2 ** 19, help="tokens a step")
    p.add_argument("--steps", type=int, default=5, help="timed steps (medians reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (they compile)")
    p.add_argument("--precision", nargs="+", choices=("bf16", "fp32", "fp8"),
                   help="what to run, in order (default: bf16 and fp8 on a GPU, elsewhere bf16 "
                   "or fp32 as nanomuon picks); fp8 computes the rest in bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile both (default: on for CUDA)")
    p.add_argument("--attention", choices=("sdpa", "auto"), default="sdpa",
                   help="sdpa in both (windows as masks), or each project's own choice (FA3 "
                   "where it loads; nanomuon's flex or chunked windows)")
    p.add_argument("--window-pattern", default="SSSL", help="both models' sliding windows, tiled "
                   "over the layers (L: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parity", action="store_true", help="instead of timing: prove nanomuon's "
                   "arch 'nanochat' equals nanochat's model and recipe, on the CPU in fp32, at "
                   "its own shapes (scripts/nanochat_parity.py); takes --nanochat alone")
    args = p.parse_args(argv)
    given = [a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)
             if a.startswith("--") and a.split("=")[0] not in ("--parity", "--nanochat")]
    if args.parity and given:
        p.error(f"--parity runs at its own shapes, on the CPU in fp32: drop {', '.join(given)}")
    sizes = ("depth", "aspect_ratio", "head_dim", "max_seq_len", "vocab_size",
             "device_batch_size", "total_batch_size", "steps", "warmup")
    if bad := [f"--{k.replace('_', '-')}" for k in sizes if getattr(args, k) < 1]:
        p.error(f"{', '.join(bad)} must be >= 1")
    if args.total_batch_size % (args.device_batch_size * args.max_seq_len):
        p.error(f"--total-batch-size {args.total_batch_size} is not a multiple of "
                "--device-batch-size x --max-seq-len = "
                f"{args.device_batch_size * args.max_seq_len}")
    return args


def resolve(args) -> torch.device:
    """The device, the precisions and the dtype both compute in (nanochat fixes its own once)."""
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise SystemExit(f"error: --device {args.device}: {one_line(e)}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but torch sees no CUDA device here")
    if not args.precision:
        args.precision = ["bf16", "fp8"] if device.type == "cuda" else [resolve_dtype(device)]
    args.precision = list(dict.fromkeys(args.precision))
    if "fp32" in args.precision and len(args.precision) > 1:
        raise SystemExit("error: --precision fp32 runs alone: nanochat's dtype is set once a "
                         "process, and fp8 computes the rest in bf16")
    args.dtype = "fp32" if args.precision == ["fp32"] else "bf16"
    args.compile = resolve_compile(args.compile, device)
    return device


def main(argv=None) -> int:
    args = parse_args(argv)
    device = None if args.parity else resolve(args)  # parity: the CPU, in fp32
    root = locate(args.nanochat)
    machine = f"{device_name(device)} ({device.type}), " if device else ""
    header = (f"nanochat {commit_of(root)} ({root}); {machine}torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, {datetime.date.today().isoformat()}")
    if args.parity:
        from scripts.nanochat_parity import run_parity

        print(f"parity with {header}")
        return run_parity(import_nanochat(root, "fp32", "sdpa"))
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # as both base_trains
    nc = import_nanochat(root, args.dtype, args.attention)
    ours, attention = attentions(args, device)
    command = " ".join(["python -m scripts.bench_nanochat",
                        *(sys.argv[1:] if argv is None else argv)])
    print(f"{command}\n{header}\n{shape_line(args)}\nattention: nanomuon "
          f"{attention['nanomuon']}, nanochat {attention['nanochat']}\n  nanomuon's: {ours.why}")
    batches = make_batches(args, device)
    results = {}
    # compile off: nanochat's optimizer, which compiles its fused steps itself, runs eager too
    with contextlib.nullcontext() if args.compile else torch.compiler.set_stance("force_eager"):
        for precision in args.precision:
            print(f"\n== {precision} ==")
            for name in SIDES:
                res = run_side(name, precision, nc, args, device, batches, ours) | dict(
                    attention=attention[name])
                results.setdefault(precision, {})[name] = res
                print(f"  {name:9s} {describe(res, args)}", flush=True)
    print(f"\n== summary ==\nh2h {header}\nh2h {shape_line(args)}")
    for precision, pair in results.items():
        print(summary_line(args, precision, pair))
    if estimate := gpt2_estimate(args, results, header):
        print(estimate)
    return int(any("error" in res for pair in results.values() for res in pair.values()))


if __name__ == "__main__":
    raise SystemExit(main())
