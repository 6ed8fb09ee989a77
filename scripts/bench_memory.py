"""
Optimizer memory benchmark: the per-rank peak memory of one data-parallel optimizer step,
DistMuonAdamW (state sharded) against DDP-style all_reduce and stock torch.optim.Muon + AdamW
replicated on every rank (`--optimizer torch-muon`): sharding pays only if the step's temporaries do
not eat the saving (docs/optimizer.md, "Data parallel: DistMuonAdamW").

Per world size, CPU ranks (gloo) build the same GPT and step each optimizer on fresh grads. Per
rank: the state (bytes of its tensors) and the temporaries (the step's peak RSS above its start,
Linux's VmHWM reset before each step; glibc mmaps every allocation over 128 KiB, so freed memory
leaves the RSS at once). Printed: the largest rank's state, temporaries and peak in MiB, and ratios.

--checkpoint measures a save the same way, whole-state (rank 0 torch.saves the gathered state)
against sharded (checkpoint.save_checkpoint), with and without --fsdp. The target: a save's peak
within 1.25x the state the rank holds.

    python -m scripts.bench_memory                          # depth 6, world sizes 2, 4, 8
    python -m scripts.bench_memory --depth 12 --world-sizes 4
    python -m scripts.bench_memory --checkpoint --depth 12 --vocab-size 65536 --world-sizes 4
"""

import argparse
import os
import shutil
import socket
import tempfile
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from nanomuon import checkpoint
from nanomuon.arch import param_groups
from nanomuon.common import process_status
from nanomuon.gpt import GPT, config_from_depth
from nanomuon.sharded import DTensor
from nanomuon.variants import OPTIMIZER_VARIANTS

MiB = 2 ** 20
SETUPS = {"DistMuonAdamW": "muon", "all_reduce + torch Muon + AdamW": "torch-muon"}
SAVES = {"replicated, whole-state save": (False, True), "replicated, sharded save": (False, False),
         "--fsdp, whole-state save": (True, True), "--fsdp, sharded save": (True, False)}


def status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: now; VmHWM: peak since the last reset)."""
    if (value := process_status(field)) is None:
        raise RuntimeError(f"/proc/self/status has no {field}: bench_memory needs Linux")
    return value


def state_bytes(opt, params=()) -> int:
    """Bytes of the optimizer state (and params) this rank holds, each storage once (stacked state
    is one storage of many views)."""
    tensors = [*params, *(t for st in opt.state.values() for t in st.values()
                          if isinstance(t, torch.Tensor))]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (x.to_local() if isinstance(x, DTensor) else x for x in tensors)}.values())


def model_and_optimizer(args, variant: str, fsdp: bool = False):
    """The benchmark's GPT from seed 0 (each block and the whole FSDP2-sharded with `fsdp`), and
    the optimizer `variant` makes for it."""
    torch.manual_seed(0)
    model = GPT(config_from_depth(args.depth, args.vocab_size, 256))
    model.init_weights()
    if fsdp:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model, model.setup_optimizer(OPTIMIZER_VARIANTS[variant])


def measure_save(args, fsdp: bool, whole: bool) -> tuple[int, int]:
    """(bytes of model and optimizer tensors this rank holds, one save's temporaries)."""
    model, opt = model_and_optimizer(args, "muon", fsdp)
    for p in model.parameters():  # one step makes the state
        p.grad = torch.zeros_like(p)
    opt.step()
    model.zero_grad(set_to_none=True)
    held = state_bytes(opt, model.parameters())
    dist.barrier()
    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    if whole:  # the whole-state form: every rank gathers everything, rank 0 writes it
        state = dict(model={k: v.full_tensor() if isinstance(v, DTensor) else v
                            for k, v in model.state_dict().items()}, optim=opt.state_dict())
        if dist.get_rank() == 0:
            os.makedirs(args.tmp)
            torch.save(state, Path(args.tmp) / "whole.pt")
        del state
    else:
        tensors, files = checkpoint.state_of(model, opt)
        checkpoint.save_checkpoint(Path(args.tmp), 1, tensors, dict(step=1), files)
        del tensors, files
    temporaries = status("VmHWM") - before
    dist.barrier()
    if dist.get_rank() == 0:  # the next save starts from an empty dir
        shutil.rmtree(args.tmp)
    return held, temporaries


def measure(args, variant: str) -> tuple[int, int]:
    """(state bytes, largest temporaries of the steps after the first) of one optimizer."""
    model, opt = model_and_optimizer(args, variant)
    gen = torch.Generator().manual_seed(dist.get_rank())
    peaks = []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        for p in model.parameters():  # what backward leaves: a fresh grad per param
            p.grad = torch.randn(p.shape, generator=gen)
        dist.barrier()
        before = status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset VmHWM to the current RSS
        opt.step()
        peaks.append(status("VmHWM") - before)
    return state_bytes(opt), max(0, *peaks[1:])  # the first step also allocates the state


def free_port() -> int:
    """A port on 127.0.0.1 free now, for the MASTER_PORT of ranks spawned on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if args.checkpoint:  # each rank saves into a temporary dir of rank 0's (one machine)
            out[rank] = {name: measure_save(args, *how) for name, how in SAVES.items()}
        else:
            out[rank] = {name: measure(args, variant) for name, variant in SETUPS.items()}
    finally:
        dist.destroy_process_group()


def run_world(args, world: int) -> dict:
    """{setup: (state, temporaries)} in bytes of the rank with the highest peak."""
    # the workers' glibc reads it once, at their start
    with (mock.patch.dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024)),
          mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp):
        out, args.tmp = manager.dict(), os.path.join(tmp, "saves")
        mp.spawn(_spawned, args=(world, free_port(), args, out), nprocs=world, join=True)
        per_rank = dict(out)
    return {name: max((per_rank[r][name] for r in per_rank), key=sum) for name in per_rank[0]}


def param_counts(args) -> tuple[int, int]:
    """(Muon, AdamW) param counts of the benchmark's GPT."""
    with torch.device("meta"):
        groups = param_groups(GPT(config_from_depth(args.depth, args.vocab_size, 256)))
    return tuple(sum(p.numel() for g in groups if (g["kind"] == "muon") == m for p in g["params"])
                 for m in (1, 0))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0], allow_abbrev=False)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--world-sizes", default="2,4,8", help="comma-separated CPU process counts")
    p.add_argument("--checkpoint", action="store_true", help="measure a checkpoint save "
                   "(whole-state against sharded), not the optimizer step")
    p.add_argument("--steps", type=int, default=3, help="steps per optimizer; the first (which "
                   "allocates the state) is not counted in the temporaries")
    args = p.parse_args(argv)
    try:
        args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    except ValueError:
        args.world_sizes = []
    if not args.world_sizes or min(args.world_sizes) < 2 or args.depth < 1 or args.steps < 2:
        p.error("--world-sizes must list process counts >= 2 (e.g. 2,4,8), --depth >= 1, --steps "
                ">= 2")
    return args


def main(argv=None):
    args = parse_args(argv)
    ours, base = SETUPS
    n_muon, n_adamw = param_counts(args)
    print(f"d{args.depth}, vocab {args.vocab_size}: {n_muon / 1e6:.1f}M Muon + "
          f"{n_adamw / 1e6:.1f}M AdamW params (fp32 grads {4 * (n_muon + n_adamw) / MiB:.1f} MiB), "
          f"torch {torch.__version__}, gloo")
    if args.checkpoint:
        print("per rank, MiB, on the rank with the highest peak; held: its model and optimizer "
              "tensors; temps: the save's peak above its starting RSS")
        print(f"{'world':>5} {'setup':<30} {'held':>7} {'temps':>7} {'peak':>7} "
              f"{'peak / held':>12}")
        for world in args.world_sizes:
            for name, (held, temps) in run_world(args, world).items():
                print(f"{world:>5} {name:<30} {held / MiB:>7.1f} {temps / MiB:>7.1f} "
                      f"{(held + temps) / MiB:>7.1f} {(held + temps) / held:>12.2f}")
        return
    print("per rank, MiB, on the rank with the highest peak; temporaries: the most any of steps "
          f"2..{args.steps} held above its starting RSS")
    print(f"{'world':>5} {'setup':<34} {'state':>7} {'temps':>7} {'peak':>7} {'vs DDP-style':>13}")
    for world in args.world_sizes:
        res = run_world(args, world)
        for name in SETUPS:
            state, temps = res[name]
            print(f"{world:>5} {name:<34} {state / MiB:>7.1f} {temps / MiB:>7.1f} "
                  f"{(state + temps) / MiB:>7.1f} {sum(res[name]) / sum(res[base]):>13.2f}")


if __name__ == "__main__":
    main()
