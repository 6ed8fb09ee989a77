"""
Optimizer benchmark: nanomuon's fused MuonAdamW against torch.optim.Muon + torch.optim.AdamW, on the
parameter shapes of nanomuon's GPT. It checks the fused optimizer's two claims against stated
targets: faster than stock Muon and AdamW side by side, and Muon work spread evenly over ranks.
  1. median step time, ours vs the stock optimizers on identical params and grads, three ways
     (COMPARISONS): defaults; both with fp32 Newton-Schulz; both doing torch's update;
  2. newton_schulz() FLOP/s on the optimizer's stacks against batched matmul on the same device,
     in bf16 and fp32, and Gram Newton-Schulz against the standard iteration where it is cheaper;
  3. Newton-Schulz load imbalance across DistMuonAdamW's ranks vs nanochat's chunks (shapes only).

    python -m scripts.bench_optim                      # d12, default device
    python -m scripts.bench_optim --depth 20 --device cuda --compile
"""

import argparse
import contextlib
import datetime
import math
import os
import platform
import statistics
import sys
import time

import torch

from nanomuon.baselines import TorchMuonAdamW
from nanomuon.common import resolve_compile, synchronizer
from nanomuon.gpt import GPT, config_from_depth
from nanomuon.muon import newton_schulz
from nanomuon.optim import MuonAdamW
from nanomuon.owners import bucket_by, gram_pays, ns_flops, owner_buckets
from nanomuon.param_groups import fill_defaults
from nanomuon.stages import NS_DTYPES, resolve_ns_precision, stage_context

VOCAB = 32768
ADAMW_HP = dict(lr=0.004, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
MUON_HP = dict(lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.2)
# ours / baseline step time, at most
STEP_TARGET = {"cpu": {"defaults": 0.8, "matched-fp32": 0.8, "same-math": 0.7},
               "cuda": {"defaults": 0.3, "matched-fp32": 0.3, "same-math": 0.3}}
NS_TARGET = 0.8  # Newton-Schulz FLOP/s / batched-matmul FLOP/s, at least
IMBALANCE_TARGET = 1.03  # max rank Newton-Schulz cost / mean, at most


def gpt_shapes(depth: int):
    """(width, AdamW shapes, Muon shapes) of nanomuon's depth-`depth` GPT, in model order: the
    embedding and lm_head train with AdamW, the block matrices with Muon."""
    with torch.device("meta"):  # shapes only
        model = GPT(config_from_depth(depth, VOCAB, 2048))
    adamw = [tuple(model.wte.weight.shape), tuple(model.lm_head.weight.shape)]
    return model.config.n_embd, adamw, [tuple(p.shape) for p in model.blocks.parameters()]


def timed(fn, device: torch.device) -> float:
    sync = synchronizer(device)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def median_time(fn, device: torch.device, args) -> float:
    """Median seconds of args.steps calls of fn, after args.warmup untimed ones."""
    for _ in range(args.warmup):
        fn()
    return statistics.median(timed(fn, device) for _ in range(args.steps))


def bmm_rate(K: int, m: int, dtype: torch.dtype, device: torch.device, args) -> float:
    """FLOP/s of a (K, m, m) @ (K, m, m) batched matmul."""
    a, b = (torch.randn(K, m, m, device=device).to(dtype) for _ in range(2))
    return 2 * K * m ** 3 / median_time(lambda: torch.bmm(a, b), device, args)


def gflops(x: float) -> str:
    return f"{x / 1e9:.1f} GFLOP/s"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# name -> (MuonAdamW options, torch.optim.Muon's Newton-Schulz precision: 'bf16' (its own), 'fp32'
# (through fp32_newton_schulz) or 'ours' (what MuonAdamW resolves)); same-math: torch's update
COMPARISONS = {
    "defaults": ({}, "bf16"),
    "matched-fp32": (dict(ns_precision="fp32"), "fp32"),
    "same-math": (dict(ns_coefficients="jordan", beta2=None, apply="decoupled"), "ours"),
}


def bench_step(args, device, compile, name):
    """Section 1: median step time of MuonAdamW vs torch Muon + AdamW in one comparison, and the
    floor: each side's Newton-Schulz matmuls alone, timed as bmm, the lowest ratio they allow."""
    width, adamw_shapes, muon_shapes = gpt_shapes(args.depth)
    options, torch_precision = COMPARISONS[name]
    ours_precision = resolve_ns_precision(options.get("ns_precision", "auto"), device)
    torch_precision = ours_precision if torch_precision == "ours" else torch_precision
    n_muon, n_adamw = (sum(map(math.prod, shapes)) / 1e6 for shapes in (muon_shapes, adamw_shapes))
    print(f"\n== 1. optimizer step, {name}: d{args.depth} (width {width}), {n_muon:.1f}M Muon + "
          f"{n_adamw:.1f}M AdamW ==")
    gen = torch.Generator().manual_seed(0)
    shapes = adamw_shapes + muon_shapes
    init = [(torch.randn(s, generator=gen) * 0.02).to(device) for s in shapes]
    stored = [torch.randn(s, generator=gen).to(device) for s in shapes]

    ours_params, base_params = ([torch.nn.Parameter(t.clone()) for t in init] for _ in range(2))
    del init
    for p, g in zip(ours_params + base_params, stored + stored):
        p.grad = g.clone()
    n = len(adamw_shapes)
    ours = MuonAdamW([dict(kind="adamw", params=ours_params[:n], **ADAMW_HP),
                      dict(kind="muon", params=ours_params[n:], **{**MUON_HP, **options})],
                     compile=compile)
    # torch.optim.Muon has no beta2
    torch_hp = {k: MUON_HP[k] for k in TorchMuonAdamW.MUON_KEYS if k in MUON_HP}
    base = TorchMuonAdamW([dict(kind="adamw", params=base_params[:n], **ADAMW_HP),
                           dict(kind="muon", params=base_params[n:], **torch_hp)],
                          ns_precision=torch_precision)

    def run(opt, params):
        torch._foreach_copy_([p.grad for p in params], stored)  # same grads every step, untimed
        return timed(opt.step, device)

    # interleaved: load drift hits both alike
    times = [(run(ours, ours_params), run(base, base_params))
             for _ in range(args.warmup + args.steps)]
    ours_t, base_t = zip(*times[args.warmup:])

    gram = {s for s in muon_shapes if gram_pays(s, MUON_HP["ns_steps"], NS_DTYPES[ours_precision])}
    print(f"MuonAdamW: {options or 'defaults'}; Newton-Schulz {ours_precision}, Gram on "
          f"{sorted(gram) or 'none'}, compile {compile}")
    print("torch.optim.Muon (eager, per matrix, Jordan NS5) + AdamW (foreach): Newton-Schulz "
          f"{torch_precision}"
          + (" through an fp32 copy of torch's iteration (it hard-codes bf16)"
             if torch_precision == "fp32" else ", unpatched"))
    ours_med, base_med = statistics.median(ours_t), statistics.median(base_t)
    ratio = ours_med / base_med
    target = STEP_TARGET[device.type][name]
    for label, ts in (("MuonAdamW", ours_t), ("torch Muon + AdamW", base_t)):
        print(f"  {label:20s} median {statistics.median(ts) * 1e3:9.1f} ms   min "
              f"{min(ts) * 1e3:9.1f} ms   (all, ms: {', '.join(f'{t * 1e3:.0f}' for t in ts)})")
    print(f"  ratio ours/baseline  {ratio:.3f}   target <= {target}   {verdict(ratio <= target)}")
    steps, gen = MUON_HP["ns_steps"], torch.Generator().manual_seed(1)
    floors = [sum(steps * iteration_bmm(s, NS_DTYPES[p], device, args, gen)
                  * ns_flops(s[1:], steps, s[1:] in g) / ns_flops(s[1:], steps)
                  for s in stacks_of(muon_shapes))
              for g, p in ((gram, ours_precision), ((), torch_precision))]
    print(f"  matmul floor         ours {floors[0] * 1e3:.0f} ms, torch {floors[1] * 1e3:.0f} ms "
          "(Newton-Schulz matmuls alone, as bmm): ours at its floor would be "
          f"{floors[0] / base_med:.3f} of torch's measured step")
    return dict(ours=ours_med, base=base_med, ratio=ratio, target=target,
                precision=(ours_precision, torch_precision), floor=floors[0] / base_med)


def stacks_of(muon_shapes) -> list[tuple]:
    """One (K, rows, cols) stack per shape bucket, as the optimizer stacks them."""
    return [(len(b), *muon_shapes[b[0]]) for b in bucket_by([tuple(s) for s in muon_shapes])]


def iteration_bmm(shape, dtype, device, args, gen) -> float:
    """Seconds of one Newton-Schulz iteration's matmuls on a stack (X X^T, A A, A X) as bmm."""
    K, m, n = shape[0], *sorted(shape[1:])
    X = torch.randn(K, m, n, generator=gen).to(device, dtype)
    A = torch.randn(K, m, m, generator=gen).to(device, dtype)
    return median_time(lambda: (X @ X.mT, A @ A, A @ X), device, args)


def bench_ns(args, device, compile, precision):
    """Section 2: newton_schulz() FLOP/s on the optimizer's stacks vs bmm, and Gram against the
    standard iteration where it is cheaper."""
    _, _, muon_shapes = gpt_shapes(args.depth)
    dtype, steps = NS_DTYPES[precision], MUON_HP["ns_steps"]
    standard = dict(kind="muon", params=[], **MUON_HP, ns_coefficients="polar_express",
                    ns_precision=precision, orthogonalizer="newton_schulz")
    fill_defaults(standard)
    gram = dict(standard, orthogonalizer="gram_newton_schulz")
    # a static graph per stack, dtype and method: 5 per precision, and dynamo's limit is 8 in all
    if compile:
        torch._dynamo.reset()
    ortho = (torch.compile(newton_schulz, dynamic=False, fullgraph=True) if compile
             else newton_schulz)
    print(f"\n== 2. Newton-Schulz throughput, d{args.depth}, {precision}, compile {compile} ==")
    gen = torch.Generator().manual_seed(1)
    # (NS FLOPs, NS seconds, bmm FLOPs, bmm seconds) per stack; auto's seconds
    totals, gram_total = [], 0.0
    for shape in stacks_of(muon_shapes):
        G = torch.randn(shape, generator=gen).to(device)
        flops = ns_flops(shape, steps)
        ns_ctx, gram_ctx = (stage_context(g, G) for g in (standard, gram))
        t_ns = median_time(lambda G=G, ctx=ns_ctx: ortho(G, ctx), device, args)
        t_ref = iteration_bmm(shape, dtype, device, args, gen)
        ref_flops = ns_flops(shape, 1)
        print(f"  {str(tuple(shape)):18s} newton_schulz {t_ns * 1e3:9.1f} ms  "
              f"{gflops(flops / t_ns):>16s}   bmm {gflops(ref_flops / t_ref):>16s}   ratio "
              f"{flops / t_ns / (ref_flops / t_ref):.3f}")
        t_gram = t_ns
        if ns_flops(shape, steps, True) < flops:
            t_gram = median_time(lambda G=G, ctx=gram_ctx: ortho(G, ctx), device, args)
            print(f"  {'':18s} gram          {t_gram * 1e3:9.1f} ms: {t_ns / t_gram:.2f}x faster "
                  f"for {flops / ns_flops(shape, steps, True):.2f}x fewer FLOPs")
        gram_total += t_gram if gram_pays(shape, steps, dtype) else t_ns
        totals.append((flops, t_ns, ref_flops, t_ref))
        del G
    tot_flops, tot_ns, tot_ref_flops, tot_ref = map(sum, zip(*totals))
    ns_rate, ref_rate = tot_flops / tot_ns, tot_ref_flops / tot_ref
    ratio = ns_rate / ref_rate
    print(f"  all stacks: {tot_flops / 1e9:.0f} GFLOP per step in {tot_ns * 1e3:.1f} ms = "
          f"{gflops(ns_rate)}; bmm {gflops(ref_rate)}")
    print(f"  ratio NS/bmm {ratio:.3f}   target >= {NS_TARGET}   {verdict(ratio >= NS_TARGET)}")
    print(f"  orthogonalizer 'auto' in {precision}: {gram_total * 1e3:.1f} ms for the stacks that "
          f"took {tot_ns * 1e3:.1f} ms standard ({tot_ns / gram_total:.2f}x)")
    return dict(rate=ns_rate, ref=ref_rate, ratio=ratio, auto=tot_ns / gram_total)


def gram_flops(depth: int) -> str:
    """Newton-Schulz FLOPs a step at depth `depth`, standard vs Gram where cheaper."""
    _, _, shapes = gpt_shapes(depth)
    steps = MUON_HP["ns_steps"]
    std = sum(ns_flops(s, steps) for s in shapes)
    gram = sum(min(ns_flops(s, steps), ns_flops(s, steps, True)) for s in shapes)
    return f"d{depth}: {std / 1e9:.0f} -> {gram / 1e9:.0f} GFLOP per step ({std / gram:.2f}x fewer)"


def bench_imbalance(args):
    """Section 3: Newton-Schulz load per rank, DistMuonAdamW's owner plan vs nanochat's chunks."""
    N = args.world_size
    _, _, muon_shapes = gpt_shapes(args.imbalance_depth)
    costs = [ns_flops(s, MUON_HP["ns_steps"]) for s in muon_shapes]
    buckets = owner_buckets(muon_shapes, costs, N)  # DistMuonAdamW's own owners for one muon group
    ours = [sum(b["cost"] * len(b["slots"][r]) for b in buckets) for r in range(N)]
    chunks = [0.0] * N  # nanochat: per shape group, rank r owns [r * chunk, (r + 1) * chunk)
    for b in buckets:
        chunk = -(-len(b["members"]) // N)
        for j in range(len(b["members"])):
            chunks[j // chunk] += b["cost"]
    # matrices in the padded stacks: ceil(count / N) per rank in both
    sent = sum(N * b["per_rank"] for b in buckets)
    mean = sum(costs) / N
    res = {}
    print(f"\n== 3. Newton-Schulz load imbalance, d{args.imbalance_depth}, {N} ranks, {len(costs)} "
          f"matrices in {len(buckets)} shape buckets ==")
    for name, loads in (("DistMuonAdamW", ours), ("nanochat chunks", chunks)):
        res[name] = max(loads) / mean
        per_rank = " ".join(f"{x / 1e9:.0f}" for x in loads)
        print(f"  {name:16s} max/mean {res[name]:.3f}   matrices per stack exchange (padded) "
              f"{sent:4d}   per-rank GFLOP: {per_rank}")
    print(f"  target <= {IMBALANCE_TARGET} for DistMuonAdamW   "
          f"{verdict(res['DistMuonAdamW'] <= IMBALANCE_TARGET)}")
    return dict(ours=res["DistMuonAdamW"], chunks=res["nanochat chunks"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=12, help="model depth for the step and NS timings")
    p.add_argument("--imbalance-depth", type=int, default=20,
                   help="model depth for the ownership imbalance")
    p.add_argument("--world-size", type=int, default=8, help="ranks for the ownership imbalance")
    p.add_argument("--steps", type=int, default=5,
                   help="timed repetitions per measurement (medians reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions before timing")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile MuonAdamW and newton_schulz (default: on for CUDA only)")
    p.add_argument("--compare", nargs="+", choices=list(COMPARISONS), default=list(COMPARISONS),
                   help="step-time comparisons to run (section 1)")
    p.add_argument("--ns-precision", nargs="+", choices=("bf16", "fp16", "fp32"),
                   default=["bf16", "fp32"], help="Newton-Schulz precisions to time in section 2")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    compile = resolve_compile(args.compile, device)
    command = " ".join(["python -m scripts.bench_optim", *sys.argv[1:]])
    name = device_name(device)
    threads = torch.get_num_threads()
    print(f"{command}\ndevice {device} ({name}), torch {torch.__version__}, {threads} threads; "
          f"ns_precision 'auto' here: {resolve_ns_precision('auto', device)}")
    load_before = os.getloadavg()[0]  # other processes on the machine skew every timing below

    with torch.no_grad():
        # matmul rates first: they explain the precision choice (~1 s in bf16 on a CPU)
        K, m = (16, 4096) if device.type == "cuda" else (4, 512)
        rates = {p: bmm_rate(K, m, dt, device, args)
                 for p, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
        print(f"\n== 0. batched matmul ({K}, {m}, {m}) @ ({K}, {m}, {m}) ==\n  bf16 "
              f"{gflops(rates['bf16'])}   fp32 {gflops(rates['fp32'])}")
        steps = {c: bench_step(args, device, compile, c) for c in args.compare}
        ns = {p: bench_ns(args, device, compile, p) for p in args.ns_precision}
    imb = bench_imbalance(args)

    print("\n== summary ==")
    print(f"date        {datetime.date.today().isoformat()}")
    print(f"load        1-min load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} "
          f"after (this process alone adds ~{threads})")
    print(f"device      {name} ({device.type}), {threads} threads, torch {torch.__version__}")
    print(f"command     {command}")
    print(f"matmul      bf16 {gflops(rates['bf16'])}, fp32 {gflops(rates['fp32'])}")
    for c, r in steps.items():
        print(f"step d{args.depth:<4d}  {c + ':':13s} MuonAdamW {r['ours'] * 1e3:.0f} ms vs torch "
              f"Muon+AdamW {r['base'] * 1e3:.0f} ms (NS {r['precision'][0]} vs "
              f"{r['precision'][1]}, compile {compile}): ratio {r['ratio']:.3f} (matmul floor "
              f"{r['floor']:.3f}), target <= {r['target']} {verdict(r['ratio'] <= r['target'])}")
    for p, r in ns.items():
        print(f"NS d{args.depth:<6d}  {p}: {gflops(r['rate'])} vs bmm {gflops(r['ref'])}: ratio "
              f"{r['ratio']:.3f}, target >= {NS_TARGET} {verdict(r['ratio'] >= NS_TARGET)}; "
              f"orthogonalizer 'auto' {r['auto']:.2f}x")
    print(f"Gram FLOPs  {gram_flops(12)}; {gram_flops(20)} (auto runs Gram in fp32 and fp16)")
    print(f"imbalance   d{args.imbalance_depth}, {args.world_size} ranks: DistMuonAdamW "
          f"{imb['ours']:.3f}, nanochat chunks {imb['chunks']:.3f}, target <= {IMBALANCE_TARGET} "
          f"{verdict(imb['ours'] <= IMBALANCE_TARGET)}")


if __name__ == "__main__":
    main()
