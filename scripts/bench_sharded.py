"""
Sharded Muon benchmark: one Muon step on a depth-D GPT's block matrices, every way nanomuon runs
data-parallel Muon (docs/benchmarks.md, "Sharded modes"), on the same ranks: replicated
(DistMuonAdamW, reducing its grads itself), owner (Shard(0) DTensors gathered to owners), owner-bf16
(comm_precision='bf16'), and Megatron's duplicated, distributed and blockwise. The sharded modes
start from reduced grads, as FSDP2 leaves them.

    python -m scripts.bench_sharded --world-size 4 --depth 4            # CPU: gloo, spawned ranks
    torchrun --nproc_per_node=8 -m scripts.bench_sharded -- --depth 20   # GPUs: nccl
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from nanomuon.common import compute_cleanup, compute_init, synchronizer
from nanomuon.optim import DistMuonAdamW, MuonAdamW
from scripts.bench_memory import free_port
from scripts.bench_optim import MUON_HP, gpt_shapes

MODES = ["replicated", "owner", "owner-bf16", "duplicated", "distributed", "blockwise"]


def make_optimizer(mode: str, shapes, device, mesh):
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    group = dict(kind="muon", **MUON_HP)
    if mode == "replicated":
        params = [torch.nn.Parameter(t.to(device)) for t in full]
        return DistMuonAdamW([dict(group, params=params)]), params, [t.to(device) for t in grads]
    params = [torch.nn.Parameter(distribute_tensor(t.to(device), mesh, [Shard(0)])) for t in full]
    grads = [distribute_tensor(t.to(device), mesh, [Shard(0)]) for t in grads]
    options = (dict(comm_precision="bf16") if mode == "owner-bf16"
               else dict(sharded_mode=mode.split("-")[0]))
    return MuonAdamW([dict(group, params=params, **options)]), params, grads


def run(args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    shapes = [s for s in gpt_shapes(args.depth)[2] if len(s) == 2]  # the block matrices
    times, sync = {}, synchronizer(device)
    for mode in MODES:
        opt, params, grads = make_optimizer(mode, shapes, device, mesh)
        samples = []
        for _ in range(args.warmup + args.steps):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            sync()
            dist.barrier()
            samples.append(time.perf_counter() - t0)
        times[mode] = statistics.median(samples[args.warmup:])
        del opt, params, grads
    if rank == 0:
        n = sum(torch.Size(s).numel() for s in shapes)
        print(f"d{args.depth}: {len(shapes)} block matrices, {n / 1e6:.1f}M params, {world} x "
              f"{device.type}, torch {torch.__version__}; medians of {args.steps} steps after "
              f"{args.warmup} warm-up")
        print(f"{'mode':<12} {'step ms':>9} {'vs owner':>9}")
        for mode in MODES:
            print(f"{mode:<12} {1000 * times[mode]:>9.1f} {times[mode] / times['owner']:>9.2f}")


def _ranked(args, device_type: str = "auto") -> None:
    """run() in a process group made from torchrun's environment (or _spawned's)."""
    _, _, _, _, device = compute_init(device_type)
    try:
        run(args, device)
    finally:
        compute_cleanup()


def _spawned(rank, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(args.world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    _ranked(args, "cpu")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0], allow_abbrev=False)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--world-size", type=int, default=2,
                   help="CPU ranks to spawn when not under torchrun")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    if args.depth < 1 or args.world_size < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--depth, --world-size and --steps must be >= 1, --warmup >= 0")
    if "RANK" in os.environ:  # under torchrun: nccl on GPUs, gloo on CPU
        return _ranked(args)
    mp.spawn(_spawned, args=(free_port(), args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
