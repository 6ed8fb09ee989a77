"""base_train --fp8: torchao's float8 training, emulated on this CPU (the same rounding as fp8
tensor cores, fp32 matmuls). Its val bpb stays near a plain run's, its checkpoints are a plain
run's (resumed, sampled and exported either way), and distributed equals one process."""

import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchao.float8", reason="--fp8 needs torchao (pip install torchao)")

from test_dist import assert_replicated_tensors, spawn  # noqa: E402
from test_train import REPO, TINY, run  # noqa: E402

from nanomuon.checkpoint import load_checkpoint  # noqa: E402
from nanomuon.fp8 import check_fp8, convert_to_fp8, plain_linears  # noqa: E402
from nanomuon.gpt import GPT, config_from_depth  # noqa: E402

FLAGS = [*TINY, "--total-batch-size", "1024", "--eval-every", "-1"]


def train(base, name, *extra, steps=6):
    from scripts.base_train import main

    return main([*FLAGS, "--num-iterations", str(steps), "--run", name, *extra])


def test_fp8_swaps_the_block_linears_and_keeps_their_weights():
    """Every block Linear becomes Float8Linear on the same Parameter; lm_head, 97 outputs (not
    a multiple of 16), stays a plain Linear; within plain_linears the model computes as the plain
    one, then as fp8 again; the fp8 forward is a rounding of the plain one (close, not equal)."""
    model = GPT(config_from_depth(2, 97, 16, aspect_ratio=32, head_dim=32))
    model.init_weights()
    for block in model.blocks:
        nn.init.normal_(block.attn.c_proj.weight, std=0.05)
        nn.init.normal_(block.mlp.c_proj.weight, std=0.05)
    weights = {n: p for n, p in model.named_parameters()}
    x = torch.randint(0, 97, (4, 16))
    plain = model(x)
    assert convert_to_fp8(model, "tensorwise", torch.device("cpu")) == 2 * 6
    assert {n: p for n, p in model.named_parameters()} == weights  # same names, same objects
    assert type(model.lm_head) is nn.Linear
    assert all(type(m).__name__ == "Float8Linear"
               for b in model.blocks for m in b.modules() if isinstance(m, nn.Linear))
    fp8 = model(x)
    assert not torch.equal(fp8, plain)
    torch.testing.assert_close(fp8, plain, rtol=0, atol=0.1 * plain.abs().max().item())
    with plain_linears(model):
        assert torch.equal(model(x), plain)
    assert torch.equal(model(x), fp8) and type(model.blocks[0].attn.c_q).__name__ == "Float8Linear"


@pytest.mark.slow
def test_fp8_run_is_near_the_plain_run_and_its_checkpoint_is_a_plain_one(base, capsys):
    """A tiny model's val bpb with --fp8 is within 3% of the plain run's; the checkpoint has the
    same keys, shapes and dtypes; the fp8 run resumes without --fp8, a plain run resumes with it,
    and sample and export read the fp8 run's checkpoint as any other."""
    keep = ("--save-every", "3", "--keep-checkpoints", "-1")
    plain = train(base, "plain", *keep, steps=12)
    fp8 = train(base, "fp8", "--fp8", *keep, steps=12)
    out = capsys.readouterr().out
    assert "fp8: 13 linear layers in fp8, lm_head among them (tensorwise scales, emulated" in out
    assert abs(fp8["final_val_bpb"] - plain["final_val_bpb"]) <= 0.03 * plain["final_val_bpb"]
    assert fp8["final_val_bpb"] != plain["final_val_bpb"]  # the fp8 path really ran
    (a, _), (b, _) = (load_checkpoint(base / "runs" / r, 12, ("model", "optim"))
                      for r in ("plain", "fp8"))
    assert a["model"].keys() == b["model"].keys()
    for k, v in a["model"].items():
        assert (b["model"][k].shape, b["model"][k].dtype) == (v.shape, v.dtype), k
    for source, flag in (("fp8", []), ("plain", ["--fp8"])):  # each resumes from step 6 the other way
        runs = base / "runs"
        shutil.copytree(runs / source / "step_000006", runs / f"{source}-resumed" / "step_000006")
        train(base, f"{source}-resumed", "--resume-from-step", "latest", *flag, steps=12)
        assert f"resumed {runs / f'{source}-resumed'} at step 6" in capsys.readouterr().out
    sample = run([sys.executable, "-m", "scripts.sample", "--run", "fp8", "--device-type", "cpu",
                  "--prompt", "def", "--max-tokens", "4"], base)
    assert "step 12" in sample.stdout
    export = run([sys.executable, "-m", "scripts.export", "--run", "fp8", "--model-only"], base)
    assert (base / "runs" / "fp8" / "export_step_000012.pt").is_file(), export.stdout


def fp8_model():
    torch.manual_seed(0)
    model = GPT(config_from_depth(2, 97, 16, aspect_ratio=32, head_dim=32))
    model.init_weights()
    convert_to_fp8(model, "tensorwise", torch.device("cpu"))
    return model


def _fp8_worker(rank, world_size, fsdp, steps, atol):
    """The same global batch on every rank count: rank r trains rows r::world of it; the
    reference, one process, accumulates the same rows' grads micro-batch by micro-batch."""
    from torch.distributed.fsdp import fully_shard

    from nanomuon.arch import Variant
    from nanomuon.optim import DistMuonAdamW, MuonAdamW
    from nanomuon.recipe import peak_lrs

    model, ref = fp8_model(), fp8_model()
    if fsdp:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    # fp32 Newton-Schulz: 'auto' is bf16 on CPUs with bf16 units, where a sum order's 1e-7 can
    # flip a bf16 rounding of the update (lr x 2^-8, ~8e-5), which is not what this test is about
    fp32_ns, lrs = Variant(muon_options=dict(ns_precision="fp32")), peak_lrs(4096)
    opt = model.setup_optimizer(fp32_ns, lrs)
    assert isinstance(opt, MuonAdamW if fsdp else DistMuonAdamW)
    ref_opt = ref.setup_optimizer(fp32_ns._replace(optimizer_class=MuonAdamW), lrs)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 97, (2 * world_size, 17), generator=g)
        rows = [x[r::world_size] for r in range(world_size)]
        model(rows[rank][:, :-1], rows[rank][:, 1:]).backward()
        for part in rows:  # each micro-batch's fp8 scales are its own, as on its rank
            (ref(part[:, :-1], part[:, 1:]) / world_size).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(set_to_none=True), ref_opt.zero_grad(set_to_none=True)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            whole = p.full_tensor() if fsdp else p
            torch.testing.assert_close(whole, q, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    if not fsdp:
        assert_replicated_tensors(list(model.parameters()))


@pytest.mark.parametrize("world_size,fsdp", [(2, False), pytest.param(2, True, marks=pytest.mark.heavy)])
def test_fp8_distributed_equals_one_process(world_size, fsdp):
    """--fp8 under DistMuonAdamW (ranks replicated, bitwise identical) and FSDP2 trains as one
    process does on the same rows, bitwise at 2 ranks: each micro-batch's fp8 scales are its own,
    and halving a sum of two is exact."""
    spawn(_fp8_worker, world_size, fsdp, 4, 0.0)


@pytest.mark.heavy
def test_fp8_at_three_ranks_differs_from_one_process_only_by_the_sum_order():
    """At 3 ranks the mean's rounding differs from one process's (a few 1e-7 after a step, as
    without fp8); from the next step fp8's rounding, whose last bit is 6% of a value, amplifies
    such differences (0.06 in the embedding after 2 steps, 3e-5 without fp8), so one step."""
    spawn(_fp8_worker, 3, False, 1, 2e-5)


def test_fp8_in_fp32_says_so_and_the_report_says_fp8(base, capsys):
    """Where the run computes in fp32 (a CPU without bf16 units, or --dtype fp32) the embedding and
    attention run in fp32, and the fp8 line says so; the training line and the report say fp8, not only the
    command line does."""
    capsys.readouterr()
    train(base, "fp8-fp32", "--fp8", "--dtype", "fp32", steps=2)
    out = capsys.readouterr().out
    assert "; the embedding and attention in fp32" in out and "in bf16" not in out, out
    assert "1 x cpu, fp32 with fp8 matmuls (tensorwise scales)" in out, out
    report = (base / "runs" / "fp8-fp32" / "report.md").read_text().splitlines()
    said = [line for line in report if "fp8" in line and not line.startswith(("- command:", "# "))]
    assert said and "fp32 with fp8 matmuls (tensorwise scales), fp32 params" in said[0], report


@pytest.mark.heavy
def test_a_resume_in_another_precision_says_so_and_the_report_keeps_both(base, capsys):
    """An fp8 checkpoint resumes without --fp8, or with another --fp8-recipe (it is a plain
    one), but not silently: a note at the resume, and the report says what each part trained in."""
    train(base, "fp8-then", "--fp8", "--dtype", "fp32", "--save-every", "2", steps=4)
    run = base / "runs" / "fp8-then"
    capsys.readouterr()
    train(base, "fp8-then", "--dtype", "fp32", "--resume-from-step", "2", steps=4)
    out = capsys.readouterr().out
    assert ("note: resume: the run trained in fp32 with fp8 matmuls (tensorwise scales) to step "
            "2 and goes on in fp32 (--dtype, --fp8 and --fp8-recipe as given now)") in out, out
    assert "; fp32 with fp8 matmuls (tensorwise scales) to step 2, then fp32, fp32 params" in \
        (run / "report.md").read_text()
    train(base, "fp8-then", "--fp8", "--fp8-recipe", "rowwise", "--dtype", "fp32", "--resume-from-step", "2",
          steps=4)
    assert "and goes on in fp32 with fp8 matmuls (rowwise scales)" in capsys.readouterr().out
    assert ("; fp32 with fp8 matmuls (tensorwise scales) to step 2, then fp32 with fp8 matmuls "
            "(rowwise scales), fp32 params") in (run / "report.md").read_text()


def test_fp8_refused_where_it_cannot_run(monkeypatch):
    """One line each: a GPU without fp8 tensor cores, a device with neither, no torchao; and
    --help names what stays in the run's dtype."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"^--fp8 needs fp8 tensor cores .*A100-SXM4-80GB has "
                                         r"8\.0: drop --fp8"):
        check_fp8(torch.device("cuda"))
    with pytest.raises(ValueError, match="not mps: drop --fp8"):
        check_fp8(torch.device("mps"))
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ValueError, match=r"--fp8 needs torchao .*pip install torchao"):
        check_fp8(torch.device("cpu"))
    help_text = subprocess.run([sys.executable, "-m", "scripts.base_train", "--help"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout
    assert "the embedding, attention and evaluation stay in --dtype" in " ".join(help_text.split())


@pytest.mark.slow  # two torchrun launches
def test_fsdp_fp8_run_evaluates_and_samples_in_plain_layers(base):
    """base_train --fsdp --fp8 with 2 processes: the eval and the samples run the fp8 layers as
    plain ones while FSDP2 gathers their weights, and the step-0 eval (the same init) equals the
    replicated run's."""
    import re

    from test_train import torchrun

    flags = [*FLAGS, "--num-iterations", "2", "--eval-every", "2", "--fp8", "--sample-tokens", "3"]
    outs = [run(torchrun(2, "scripts.base_train", [*flags, *extra, "--run", f"fp8-{name}"]),
                base).stdout for name, extra in (("rep", []), ("fsdp", ["--fsdp"]))]
    first = [float(re.search(r"step 00000 \| val bpb (\d+\.\d+)", o).group(1)) for o in outs]
    assert abs(first[0] - first[1]) < 1e-3, first
    assert all("sample: 'def fibonacci(n):'" in o and "final val bpb" in o for o in outs)
