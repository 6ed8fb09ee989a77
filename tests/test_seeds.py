"""
Batched seeds (base_train --seeds, nanomuon/seeds.py): each seed of a batched run trains as its own
run of that seed would, for muon, adamw and a variant of each stage family, in fp32 on the CPU; one
batched Muon step against the float64 reference; resume is exact; under torchrun (DistMuonAdamW) it
equals one process; what cannot be batched is refused in one line.
"""

import functools
import json
import math
import re
import sys

import pytest
import torch
from test_train import TINY, run, torchrun

from nanomuon.optim import MuonAdamW
from nanomuon.reference import muon_step
from nanomuon.seeds import SeedBatch, seed_model, seeded_gpt

FLAGS = [*TINY, "--total-batch-size", "256", "--num-iterations", "6", "--eval-every", "3",
         "--final-eval-tokens", "2048", "--dtype", "fp32", "--no-compile"]
# muon and adamw, then one variant of each stage family: precondition (with and without state),
# orthogonalizer, post-process, apply (with state); and the per-head layout (split, transposed)
VARIANTS = ["muon", pytest.param("adamw", marks=pytest.mark.heavy),
            *(pytest.param(v, marks=pytest.mark.slow) for v in ("muon-eq", "muon-soap", "muon-gram",
                                                                 "muon-plus", "muon-hyperball", "muon-per-head"))]


def summary(base, name: str) -> dict:
    return json.loads((base / "runs" / name / "summary.json").read_text())


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def each_seed_is_its_own_run(base, flags: list[str], batched: dict, prefix: str) -> None:
    """Train each seed of a batched run's summary alone (runs prefix-SEED) and assert that its
    final val bpb, final eval and val history are the batched run's for it, within 1e-4 relative
    (batched matmuls may round otherwise)."""
    from scripts.base_train import main

    for seed in batched["seeds"]:
        main([*flags, "--seed", str(seed), "--run", f"{prefix}-{seed}"])
        alone, mine = summary(base, f"{prefix}-{seed}"), batched["per_seed"][str(seed)]
        for key in ("final_val_bpb", "min_val_bpb", "final_eval_bpb"):
            assert relative(mine[key], alone[key]) <= 1e-4, (seed, key, mine[key], alone[key])
        assert [s for s, _ in mine["val_history"]] == [s for s, _ in alone["val_history"]]
        assert all(relative(a, b) <= 1e-4 for (_, a), (_, b) in zip(mine["val_history"],
                                                                    alone["val_history"]))
        assert mine["final_eval_tokens"] == alone["final_eval_tokens"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_seed_of_a_batched_run_trains_as_its_own_run(base, variant):
    """Seeds 1 and 2 batched against each trained alone: the same final val bpb, final eval and
    val history (1e-4 relative: batched matmuls may round otherwise)."""
    from scripts.base_train import main

    flags = [*FLAGS, "--optimizer", variant]
    main([*flags, "--seeds", "1,2", "--run", f"{variant}-batched"])
    batched = summary(base, f"{variant}-batched")
    assert batched["seeds"] == [1, 2] and "final_val_bpb" not in batched
    each_seed_is_its_own_run(base, flags, batched, variant)
    report = (base / "runs" / f"{variant}-batched" / "report.md").read_text()
    assert "- seed 1: final val bpb" in report and "- seed 2: final val bpb" in report, report
    assert "| step | seed 1 | seed 2 |" in report, report


def test_a_batched_muon_step_is_each_seeds_float64_reference_step():
    """MuonAdamW on (seeds, rows, cols) params, in float64, against nanomuon.reference.muon_step on
    each seed's matrix: the optimizer sees no seeds, only a batch of matrices."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 12, 20), (3, 20, 12)]  # wide and tall: variance reduction per row or column
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64) * 0.3)
              for s in shapes]
    group = dict(lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.2)
    opt = MuonAdamW([dict(kind="muon", params=params, ns_precision="fp32", **group)])
    starts = [p.detach().clone() for p in params]
    ref = [[p.detach()[i].clone() for i in range(3)] for p in params]
    states = [[{} for _ in range(3)] for _ in params]
    for _ in range(3):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for k, g in enumerate(grads):
            for i in range(3):
                ref[k][i] = muon_step(ref[k][i], g[i], states[k][i], group)
    for p, start, mats in zip(params, starts, ref):
        assert (torch.stack(mats) - start).abs().max() > 0.01  # large against the tolerance
        # Newton-Schulz in fp32 (the float64 reference has no such rounding)
        torch.testing.assert_close(p.detach(), torch.stack(mats), rtol=0, atol=1e-6)


def test_seed_models_are_views_and_the_batch_runs_each_seed_alone():
    """seed_model(i) is seed i's weights (no copy), and SeedBatch's losses are each seed model's."""
    from nanomuon.gpt import config_from_depth

    config = config_from_depth(2, 512, 32, aspect_ratio=32, head_dim=32)
    model = seeded_gpt(config, [5, 6, 7], "cpu")
    x = torch.randint(0, 512, (2, 32))
    with torch.no_grad():
        losses = SeedBatch(model)(x, x)
        for i in range(3):
            one = seed_model(model, i)
            assert one.wte.weight.data_ptr() == model.wte.weight[i].data_ptr()
            torch.testing.assert_close(losses[i], one(x, x), rtol=1e-6, atol=0)
    assert len(set(losses.tolist())) == 3  # three different inits


def compiled_graphs(module, *args) -> tuple[list, list]:
    """module(*args) compiled whole, then backward from its sum: (forward graphs, backward
    graphs) as AOT autograd hands them to inductor."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    forward, backward = [], []

    def backend(gm, inputs):
        def keep(into):
            return lambda g, _: into.append(g) or make_boxed_func(g.forward)
        return aot_module_simplified(gm, inputs, fw_compiler=keep(forward),
                                     bw_compiler=keep(backward))

    torch._dynamo.reset()
    torch.compile(module, backend=backend, fullgraph=True, dynamic=False)(*args).sum().backward()
    return forward, backward


def attention_calls(graphs: list) -> list[tuple[str, int]]:
    """(op, batch) of every attention call in the graphs."""
    return [(str(n.target), n.args[0].meta["val"].shape[0]) for g in graphs for n in g.graph.nodes
            if n.op == "call_function" and "attention" in str(n.target)]


@pytest.mark.parametrize("arch", ["classic", pytest.param("nanochat", marks=pytest.mark.heavy)])
def test_compiled_seeds_call_the_single_runs_kernel_once_on_every_seeds_rows(arch):
    """The compiled graph of 3 batched seeds holds, per layer, one call of seed_attention on the
    3 x 2 rows, forward and backward, and no attention traced through vmap's rules. Its kernel is
    the one the single run's graph holds: the op it calls on those 6 rows is the op that graph
    calls on its 2. Each seed's loss and gradients are its own model's (eager, unfolded)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from nanomuon.gpt import GPT, config_from_depth, sdpa
    from nanomuon.seeds import KERNELS

    # at 256 tokens nanochat's short window (128) cuts the context: SDPA with a mask
    config = config_from_depth(2, 97, 256, aspect_ratio=32, head_dim=16, arch=arch,
                               window_pattern="SL" if arch == "nanochat" else None)
    model, x = seeded_gpt(config, [1, 2, 3], "cpu"), torch.randint(0, 97, (2, 256))
    forward, backward = compiled_graphs(SeedBatch(model), x, x)
    assert attention_calls(forward) == [("nanomuon.seed_attention.default", 6)] * 2, forward
    assert attention_calls(backward) == [("nanomuon.seed_attention_backward.default", 6)] * 2
    assert {a.attend.kernel for a in (b.attn for b in model.blocks)} == {sdpa}
    single = GPT(config)
    single.init_weights()
    one = compiled_graphs(single, x, x)[0]
    q = torch.randn(6, 256, 2, 16)
    for window in config.window_sizes():
        inner = make_fx(functools.partial(KERNELS["nanomuon.gpt.sdpa"], window=window))(q, q, q)
        assert {op for op, _ in attention_calls([inner])} == {op for op, _ in attention_calls(one)}
    model.zero_grad()
    SeedBatch(model)(x, x).sum().backward()
    for i in range(3):
        alone = seed_model(model, i)
        for p in alone.parameters():
            p.requires_grad_(True)
        grads = torch.autograd.grad(alone(x, x), list(alone.parameters()))
        for (name, p), g in zip(model.named_parameters(), grads):
            torch.testing.assert_close(p.grad[i], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.heavy
def test_a_batched_run_resumes_exactly(base, capsys):
    """Saved at step 3 and resumed by another main(), a batched run ends bitwise where the
    uninterrupted one does (model and optimizer state); export writes it and says it holds the
    seeds' models stacked."""
    from test_train import assert_bitwise_equal

    from nanomuon.checkpoint import load_checkpoint
    from scripts.base_train import main

    flags = [*FLAGS, "--seeds", "3,4", "--save-every", "3", "--keep-checkpoints", "-1"]
    main([*flags, "--run", "whole"])
    main([*flags, "--run", "halves", "--num-iterations", "6"])
    (base / "runs" / "halves" / "step_000006").rename(base / "spare")
    main([*flags, "--run", "halves", "--resume-from-step", "3"])
    names = ("model", "optim")
    (a, _), (b, _) = (load_checkpoint(base / "runs" / r, 6, names) for r in ("whole", "halves"))
    assert_bitwise_equal(a, b, "step 6")
    assert summary(base, "whole")["per_seed"] == summary(base, "halves")["per_seed"]
    # export writes the stacked models, and says so
    from scripts.export import main as export

    out = export(["--run", "whole", "--model-only"])
    assert out.is_file()
    said = capsys.readouterr().out.strip().splitlines()[-1]
    assert "2 seeds' models stacked on dim 0 of every tensor" in said, said


@pytest.mark.heavy
def test_one_seed_is_a_plain_run_and_what_cannot_be_batched_is_refused(base, capsys):
    """--seeds 9 is --seed 9 (the same summary, bitwise); --qk-clip, --fp8, --fsdp and torch-muon
    are refused with --seeds in one line, as are --seed beside it and repeated or non-integer
    seeds; base_eval refuses a batched run's checkpoint in one line."""
    from scripts.base_train import main

    main([*FLAGS, "--seeds", "9", "--run", "one-seed"])
    main([*FLAGS, "--seed", "9", "--run", "plain-seed"])
    a, b = summary(base, "one-seed"), summary(base, "plain-seed")
    assert a["final_val_bpb"] == b["final_val_bpb"] and a["history"] == b["history"]
    for extra, what in ((["--qk-clip", "50", "--no-qk-norm"], "--qk-clip"), (["--fp8"], "--fp8"),
                        (["--fsdp"], "--fsdp"), (["--optimizer", "torch-muon"], "torch-muon")):
        with pytest.raises(SystemExit):
            main([*FLAGS, "--seeds", "1,2", *extra])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "--seeds 1,2 trains the seeds as one batched model" in err and what in err, err
    with pytest.raises(SystemExit):
        main([*FLAGS, "--seeds", "1,2", "--seed", "3"])
    assert "--seed 3 and --seeds: give one" in capsys.readouterr().err
    for bad in ("1,1", "1,x", "-3,2"):
        with pytest.raises(SystemExit):
            main([*FLAGS, "--seeds", bad])
        assert "--seeds" in capsys.readouterr().err
    main([*FLAGS, "--seeds", "1,2", "--run", "for-eval"])
    p = run(["python", "-m", "scripts.base_eval", "--run", "for-eval"], base, check=False)
    assert p.returncode != 0 and "holds 2 seeds trained as one batched model" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.slow
def test_batched_seeds_under_torchrun_equal_one_process(base):
    """DistMuonAdamW (2 gloo processes) on batched seeds against MuonAdamW in one process: each
    seed's final val bpb within 1e-4 relative (the processes average their halves' gradients)."""
    flags = [*FLAGS, "--seeds", "1,2"]
    # each step's 4 rows: 2 a process, or all 4 in one micro-batch (the same rows)
    run(torchrun(2, "scripts.base_train", [*flags, "--device-batch-size", "2", "--run", "dist-seeds"]),
        base)
    run(["python", "-m", "scripts.base_train", *flags, "--run", "one-seeds"], base)
    dist_, one = summary(base, "dist-seeds"), summary(base, "one-seeds")
    assert dist_["world_size"] == 2 and one["world_size"] == 1
    for seed in ("1", "2"):
        a, b = dist_["per_seed"][seed]["final_val_bpb"], one["per_seed"][seed]["final_val_bpb"]
        assert math.isfinite(a) and relative(a, b) <= 1e-4, (seed, a, b)


# Peak RSS in GiB of `base_train --seeds 1,...,N` (2 steps, the eval and the checkpoint; OMP_NUM_THREADS
# 1 or 2; /usr/bin/time's maximum resident set) on a 2-core bf16 CPU: vocab, depth, aspect ratio,
# head dim, max-seq-len, rows, compiled, dtype, threads, then N -> peak
MEASURED = [
    (4096, 2, 32, 32, 64, 4, False, "bf16", 1, {2: 0.477, 5: 0.557, 20: 0.937}),
    (32768, 2, 32, 32, 64, 4, False, "bf16", 1, {2: 0.796, 5: 1.367, 20: 4.069}),
    (32768, 2, 32, 32, 64, 4, False, "fp32", 1, {5: 1.249}),
    (32768, 2, 32, 32, 64, 16, False, "bf16", 1, {2: 1.396, 8: 4.191}),
    (32768, 2, 128, 64, 64, 4, False, "bf16", 1, {2: 1.239, 5: 2.400}),
    (4096, 4, 64, 128, 256, 8, False, "bf16", 1, {2: 1.047, 5: 1.993}),
    (4096, 2, 1024, 128, 64, 4, False, "bf16", 2, {2: 5.510}),  # width 2,048: the state dominates
]


def seeds_flags(vocab, depth, aspect, head_dim, seq, rows, compiled, dtype, seeds):
    return ["--dataset", "embedded", "--device-type", "cpu", "--depth", str(depth), "--aspect-ratio",
            str(aspect), "--head-dim", str(head_dim), "--max-seq-len", str(seq), "--device-batch-size",
            str(rows), "--total-batch-size", str(rows * seq), "--num-iterations", "2", "--dtype", dtype,
            "--compile" if compiled else "--no-compile", "--seeds", ",".join(map(str, range(1, seeds + 1)))]


def memory_check(monkeypatch, free: float, vocab: int, *shape, seeds: int,
                 process: int | None = None) -> str | None:
    """check_memory's refusal of `seeds` batched seeds of this shape with `free` GiB, or None; the
    process's own bytes as MEASURED's were, with a CPU build of torch, unless given."""
    from nanomuon.gpt import config_from_depth
    from scripts import train_args

    args = train_args.parse_args(seeds_flags(vocab, *shape, seeds))
    depth, aspect, head_dim, seq, rows, compiled, dtype = shape
    config = config_from_depth(depth, vocab, seq, aspect, head_dim)
    monkeypatch.setattr(train_args, "available_memory", lambda: (int(free * 2 ** 30), 0))
    monkeypatch.setattr(train_args, "process_memory", lambda: process or train_args.PROCESS_MEMORY)
    try:
        train_args.check_memory(args, config, 1, compiled=compiled)
    except SystemExit as e:
        return str(e.code)
    return None


@pytest.mark.parametrize("row", MEASURED, ids=lambda r: f"v{r[0]}-d{r[1]}-a{r[2]}-rows{r[5]}-{r[7]}")
def test_the_batched_seeds_estimate_bounds_their_measured_peak(row, monkeypatch):
    """check_memory refuses batched seeds with 10% more memory free than their measured peak RSS: at
    vocab 32,768 the logits' batched backward alone keeps 4x what a single run's does."""
    vocab, *shape, _threads, peaks = row
    for seeds, peak in peaks.items():
        assert memory_check(monkeypatch, 1.1 * peak, vocab, *shape, seeds=seeds), (seeds, peak)


def test_the_refusal_names_a_count_of_seeds_that_fits(monkeypatch):
    """With the memory 20 seeds measured to peak at free, 40 are refused, naming at most 20 seeds
    (each seed takes memory: fewer peak lower), and that many pass the check."""
    vocab, *shape, _threads, peaks = MEASURED[1]
    refusal = memory_check(monkeypatch, peaks[20], vocab, *shape, seeds=40)
    fits = int(re.search(r"train at most (\d+) seeds at once \(--seeds of \1\)", refusal)[1])
    assert 10 <= fits <= 20, refusal
    assert memory_check(monkeypatch, peaks[20], vocab, *shape, seeds=fits) is None
    assert memory_check(monkeypatch, peaks[20], vocab, *shape, seeds=fits + 1)


def test_a_batched_run_stays_under_its_estimate(base, monkeypatch):
    """A real run of 8 batched seeds (the test tokenizer's vocab of 512) peaks below what
    check_memory estimates, counting the process as the run's own check does (a CUDA build of
    torch holds 0.3 GiB more): with its peak RSS free, the check refuses it."""
    seeds = 8
    # VmHWM, not ru_maxrss: exec keeps the parent's peak in ru_maxrss, and pytest's grows
    code = ("import sys; from scripts.base_train import main; from scripts import train_args; "
            "from nanomuon.common import process_status; process = train_args.process_memory(); "
            "main(sys.argv[1:]); print('process', process, 'peak', process_status('VmHWM'))")
    shape = (2, 32, 32, 64, 4, False, "bf16")
    p = run([sys.executable, "-c", code, *seeds_flags(512, *shape, seeds), "--num-iterations", "1",
             "--eval-every", "-1", "--eval-tokens", "256", "--sample-tokens", "0", "--run",
             "measured"], base)
    process, peak = map(int, p.stdout.split("process")[-1].split(" peak "))
    assert memory_check(monkeypatch, peak / 2 ** 30, 512, *shape, seeds=seeds, process=process), (
        peak / 2 ** 30, process / 2 ** 30)


def test_memory_that_cannot_be_read_is_said_and_never_skipped_silently(monkeypatch, capsys):
    """No /proc/meminfo (macOS, a sandbox): the check says so in a line and bounds the run by the
    machine's memory, so 3,000 seeds are refused; where that cannot be read either, the run stops
    and names --no-memory-check, which alone trains without the check."""
    import os

    from nanomuon.gpt import config_from_depth
    from scripts import train_args

    def check(*flags, total=16 << 30):
        def sysconf(name):
            if total is None:
                raise ValueError(name)
            return {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": total // 4096}[name]

        args = train_args.parse_args(["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
                                      "--max-seq-len", "64", "--device-batch-size", "4",
                                      "--seeds", ",".join(map(str, range(1, 3001))), *flags])
        with monkeypatch.context() as mp:
            mp.setattr(train_args, "available_memory", lambda: None)
            mp.setattr(os, "sysconf", sysconf)
            try:
                train_args.check_memory(args, config_from_depth(2, 4096, 64, 32, 32), 1, False)
            except SystemExit as e:
                return str(e.code)
        return None

    assert "train at most" in check() and "checked against all 16.0 GiB" in capsys.readouterr().out
    said = check(total=None)
    assert said.startswith("error: training this model takes about") and said.endswith(
        "give --no-memory-check to train without the check"), said
    assert check("--no-memory-check", total=None) is None


SOAP_HEAD = ["--optimizer", "muon", "--variant-option", "roles.lm_head.kind=muon",
             "--variant-option", "roles.lm_head.precondition=soap"]


@pytest.mark.parametrize("kind", ["lion", "adam_mini"])
def test_optimizer_state_counts_a_registered_kind_s_state_as_declared(kind):
    """A role turned a registered kind keeps the state the kind declares (Lion one moment,
    Adam-mini a per-row second one), not AdamW's two: optimizer_state is what a step holds."""
    from scripts import train_args

    args = train_args.parse_args(["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
                                  "--max-seq-len", "64", "--total-batch-size", "256",
                                  "--optimizer", "muon",
                                  "--variant-option", f"roles.lm_head.kind={kind}"])
    config, held = held_after_a_step(args)
    assert train_args.optimizer_state(args, config) == held


def held_after_a_step(args):
    """(The depth-2 test model's config, the bytes of state its real optimizer holds after a step
    with args' variant), the reference optimizer_state is held to."""
    from nanomuon.gpt import GPT, config_from_depth
    from scripts.base_train import optimizer_options

    model = GPT(config_from_depth(2, 512, 64, 32, 32))
    model.init_weights()
    opt = model.setup_optimizer(**optimizer_options(args, compiled=False), horizon=3)
    model(torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))).backward()
    opt.step()
    return model.config, sum(t.numel() * t.element_size() for state in opt.state.values()
                             for k, t in state.items() if torch.is_tensor(t) and k != "step")


def test_the_memory_checks_count_each_stages_state_at_its_role(monkeypatch):
    """optimizer_state is the bytes a real optimizer holds after a step (a SOAP lm_head's factors
    included); at vocab 32,768 those are 8 GiB, so the CPU check refuses the run with 6 GiB free
    (plain muon passes) and the GPU fit leaves no row for it in 10 GiB."""
    from nanomuon import arch
    from nanomuon.gpt import config_from_depth
    from scripts import train_args

    shape = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
             "--device-batch-size", "4", "--num-iterations", "3", "--total-batch-size", "256"]
    args = train_args.parse_args([*shape, *SOAP_HEAD])
    config, held = held_after_a_step(args)
    assert train_args.optimizer_state(args, config) == held
    big = config_from_depth(2, 32768, 64, 32, 32)
    monkeypatch.setattr(train_args, "available_memory", lambda: (6 << 30, 0))
    with pytest.raises(SystemExit, match="optimizer 8.0"):
        train_args.check_memory(args, big, 1, compiled=False)
    train_args.check_memory(train_args.parse_args([*shape, "--optimizer", "muon"]), big, 1, False)
    state = train_args.optimizer_state(args, big) - arch.train_memory(big, 1)["optimizer"]
    assert arch.fit_device_batch(big, 10 << 30, 32) == 32
    with pytest.raises(ValueError, match="needs about 8"):
        arch.fit_device_batch(big, 10 << 30, 32, state=state)
