"""
scripts.base_train end to end on the embedded corpus: under torchrun with 2 gloo processes it saves,
is resumed from a checkpoint by a fresh launch, and ends bitwise equal to the uninterrupted run; bad
flags and missing inputs stop it with one line that says what to do; base_eval and sample read its
checkpoints; speedrun.sh's CPU miniature runs end to end (slow).
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_dist import _free_port
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanomuon.checkpoint import list_steps, load_checkpoint, save_checkpoint
from nanomuon.recipe import rule_lrs

REPO = Path(__file__).resolve().parents[1]
TINY = ["--dataset", "embedded", "--device-type", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
        "--max-seq-len", "64", "--device-batch-size", "4", "--eval-tokens", "1024", "--sample-tokens", "0"]


def child_env(base, **extra):
    """The environment for a training subprocess: our base dir, no torchrun variables inherited."""
    env = dict(os.environ, NANOMUON_BASE_DIR=str(base), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run(cmd, base, timeout=300, check=True):
    p = subprocess.run(cmd, cwd=REPO, env=child_env(base), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def torchrun(nproc, module, args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module,
            "--", *args]


def assert_bitwise_equal(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    for k in a:
        if isinstance(a[k], dict):
            assert_bitwise_equal(a[k], b[k], f"{what}.{k}")
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{what}.{k} differs"
        else:
            assert a[k] == b[k], f"{what}.{k}: {a[k]!r} != {b[k]!r}"


@pytest.mark.heavy
def test_a_resume_takes_the_new_lrs_from_the_flags(base, capsys):
    """torch's load_state_dict restores the checkpoint's initial_lr and weight_decay; the flags must win:
    resumed with every lr at 0, the model must not move from the checkpoint at all."""
    from scripts.base_train import main

    flags = [*TINY, "--total-batch-size", "256", "--num-iterations", "4", "--eval-every", "-1", "--run", "newlr"]
    main([*flags, "--save-every", "2"])
    shutil.rmtree(base / "runs" / "newlr" / "step_000004")
    capsys.readouterr()
    main([*flags, "--resume-from-step", "2", "--matrix-lr", "0", "--embedding-lr", "0", "--unembedding-lr", "0"])
    out = capsys.readouterr().out
    assert "matrices initial_lr was 0.02 in the checkpoint, 0.0 now (the flags win)" in out, out
    names = ("model", "optim")
    (at2, _), (at4, _) = (load_checkpoint(base / "runs" / "newlr", s, names) for s in (2, 4))
    for k, v in at2["model"].items():
        assert torch.equal(at4["model"][k], v), k
    assert at4["optim"]["param_groups"][2]["initial_lr"] == 0.0
    # the first run gave no lr flags: each group took the lr rule's at its 256-token steps
    rule, scale = rule_lrs(256), (64 / 768) ** -0.5  # width 64: depth 2 x aspect ratio 32
    assert {g["name"]: g["initial_lr"] for g in at2["optim"]["param_groups"]} == pytest.approx(dict(
        lm_head=rule["unembedding_lr"] * scale, embedding=rule["embedding_lr"] * scale,
        matrices=rule["matrix_lr"]))
    with pytest.raises(SystemExit, match="--eval-tokens was 1024, now 2048"):
        main([*flags, "--resume-from-step", "2", "--eval-tokens", "2048"])


def test_the_lr_multiplier_scales_each_groups_peak_lr_once():
    """--lr-multiplier is decided with the other lrs, before the optimizer is built: each group's
    initial_lr is the lr rule's at 4,096 tokens per step (written out) x width scale x the
    multiplier, a variant's groups too, and the schedule then scales initial_lr alone."""
    from nanomuon.gpt import GPT, config_from_depth
    from scripts.base_train import optimizer_options
    from scripts.train_args import parse_args

    with torch.device("meta"):
        model = GPT(config_from_depth(4, 97, 64))
    scale = (model.config.n_embd / 768) ** -0.5
    rule = dict(embedding=0.075 * scale, lm_head=0.002 * scale, matrices=0.02, scalars=0.5)
    for variant, matrices in (("muon", 0.02), ("muon-muown", 0.02), ("adamw", 0.001 * scale)):
        args = parse_args([*TINY, "--total-batch-size", "4096", "--lr-multiplier", "3",
                           "--optimizer", variant])
        opt = model.setup_optimizer(**optimizer_options(args, compiled=False), horizon=10)
        for g in opt.param_groups:
            want = matrices if g["name"] == "matrices" else rule[g["name"]]
            assert g["initial_lr"] == g["lr"] == pytest.approx(want * 3, rel=1e-12), (variant, g)


@pytest.mark.heavy
def test_a_resume_takes_the_lr_multiplier_from_the_flags(base, capsys):
    """A resume with another --lr-multiplier trains at the flags' lrs, not the checkpoint's, and
    says so (the flags win, as for every lr flag)."""
    from scripts.base_train import main

    flags = [*TINY, "--total-batch-size", "256", "--num-iterations", "4", "--eval-every", "-1",
             "--run", "newmult"]
    main([*flags, "--save-every", "2", "--lr-multiplier", "2"])
    shutil.rmtree(base / "runs" / "newmult" / "step_000004")
    capsys.readouterr()
    main([*flags, "--resume-from-step", "2", "--lr-multiplier", "0.5"])
    out = capsys.readouterr().out
    rule, scale = rule_lrs(256), (64 / 768) ** -0.5  # width 64: depth 2 x aspect ratio 32
    want = dict(lm_head=rule["unembedding_lr"] * scale, embedding=rule["embedding_lr"] * scale,
                matrices=rule["matrix_lr"])
    assert f"matrices initial_lr was {want['matrices'] * 2!r} in the checkpoint" in out, out
    for step, multiplier in ((2, 2), (4, 0.5)):
        saved, _ = load_checkpoint(base / "runs" / "newmult", step, ("optim",))
        got = {g["name"]: g["initial_lr"] for g in saved["optim"]["param_groups"]}
        assert got == pytest.approx({k: v * multiplier for k, v in want.items()}, rel=1e-12)


def test_final_eval_scores_the_last_weights_over_the_whole_val_split(base, capsys, tmp_path):
    """--final-eval-tokens: after the last eval, the final weights score that many val tokens' rows
    (-1: every row of the split, of which --eval-tokens' rows are the first), re-derived here in
    float64 from the logits; a finished run resumed with another count scores its rows then, and
    base_eval --eval-tokens -1 scores the same. A small source keeps the whole split small."""
    from nanomuon.checkpoint import load_model
    from nanomuon.dataloader import val_rows
    from nanomuon.dataset import iter_texts
    from nanomuon.sources import prepare
    from nanomuon.tokenizer import get_tokenizer
    from scripts.base_eval import main as base_eval
    from scripts.base_train import main

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in iter_texts("embedded", "train", 150_000)))
    source = ["--dataset", str(path), "--val-fraction", "0.2"]
    tokenizer, data = get_tokenizer(), prepare(str(path), None, 0.2)
    rows = val_rows(tokenizer, data, 64, -1)
    # the whole split: asking for more rows than it holds gives the same rows; --eval-tokens' set
    # is their first rows
    assert torch.equal(val_rows(tokenizer, data, 64, 64 * (len(rows) + 7)), rows)
    assert torch.equal(val_rows(tokenizer, data, 64, 1024), rows[:16]) and len(rows) > 16
    token_bytes = tokenizer.token_bytes().double()

    def float64_bpb(model, rows):
        nats = nbytes = 0.0
        with torch.no_grad():
            for batch in rows.split(32):
                x, y = batch[:, :-1].clamp(min=0), batch[:, 1:]
                logp = torch.log_softmax(model(x).double(), -1).gather(-1, y.clamp(min=0)[..., None])
                b = token_bytes[y.clamp(min=0)] * (y >= 0)
                nats -= float((logp[..., 0] * (b > 0)).sum())
                nbytes += float(b.sum())
        return nats / (math.log(2) * nbytes)

    flags = [*TINY, *source, "--total-batch-size", "256", "--num-iterations", "3",
             "--eval-every", "-1", "--run", "final-eval"]
    summaries = []
    for tokens, more in (("1024", []), ("-1", ["--resume-from-step", "latest"])):
        main([*flags, "--final-eval-tokens", tokens, *more])
        assert "final eval: val bpb" in capsys.readouterr().out
        summaries.append(json.loads((base / "runs" / "final-eval" / "summary.json").read_text()))
    model, _ = load_model(base / "runs" / "final-eval", "latest", "cpu")
    for summary, scored in zip(summaries, (rows[:16], rows)):
        assert summary["final_eval_tokens"] == int((scored[:, 1:] >= 0).sum())
        assert summary["final_eval_bpb"] == pytest.approx(float64_bpb(model, scored), rel=1e-5)
    assert summaries[1]["final_eval_bpb"] != summaries[1]["final_val_bpb"]
    # a resume that asks for rows already scored does not score them again
    main([*flags, "--final-eval-tokens", "-1", "--resume-from-step", "latest"])
    assert "final eval" not in capsys.readouterr().out
    base_eval(["--run", "final-eval", "--eval", "bpb", "--eval-tokens", "-1", "--sample-tokens", "0", *source])
    said = f"val bpb {summaries[1]['final_eval_bpb']:.4f} over {summaries[1]['final_eval_tokens']:,} tokens"
    assert said in capsys.readouterr().out


@pytest.mark.heavy
def test_the_summary_paces_steps_as_the_step_lines_do(base, capsys):
    """summary.json's median_step_ms and mean_step_ms (what ablate's budget plans with: a run's wall
    pays for its slow steps) are those of the step lines' dt over the steps the summary counts."""
    import statistics

    from scripts.base_train import main

    main([*TINY, "--total-batch-size", "256", "--num-iterations", "9", "--eval-every", "-1",
          "--log-every", "1", "--run", "paced"])
    out = capsys.readouterr().out
    counted = int(re.search(r"medians over (\d+) steps", out)[1])
    dts = [int(m) for m in re.findall(r"^step \d+/\d+ .*\| dt (\d+)ms", out, re.M)][-counted:]
    summary = json.loads((base / "runs" / "paced" / "summary.json").read_text())
    assert 5 <= counted <= 8 and len(dts) == counted
    assert summary["mean_step_ms"] == pytest.approx(statistics.fmean(dts), abs=0.5)  # dt is rounded
    assert summary["median_step_ms"] == pytest.approx(statistics.median(dts), abs=0.5)


def test_a_run_says_which_attention_it_trains_with(base, capsys):
    """Off a GPU attention is SDPA: base_train says why at the start, every step line and the report
    say sdpa; a flash kernel asked for by name where it cannot run stops the run in one line."""
    from scripts.base_train import main

    main([*TINY, "--total-batch-size", "256", "--num-iterations", "2", "--eval-every", "-1",
          "--run", "attn"])
    out = capsys.readouterr().out
    assert "attention: sdpa (flash kernels need a CUDA GPU, this is cpu)" in out, out
    steps = re.findall(r"^step \d+/\d+ .*$", out, re.M)
    assert len(steps) == 2 and all(" | attn sdpa" in line for line in steps), steps
    report = (base / "runs" / "attn" / "report.md").read_text()
    assert "fp32 params; attention sdpa" in report, report
    with pytest.raises(SystemExit, match="^error: --attention fa3 cannot run here: flash kernels "
                       "need a CUDA GPU, this is cpu$"):
        main([*TINY, "--total-batch-size", "256", "--num-iterations", "2", "--run", "attn-fa3",
              "--attention", "fa3"])


def speedrun_gpu_flags(depth: int) -> list[str]:
    """The flags speedrun.sh's GPU branch gives base_train, read from the script, its variables
    filled in for a d`depth` run on climbmix (no fp8 flag, no extra arguments)."""
    import shlex

    text = (REPO / "speedrun.sh").read_text()
    gpu = text[text.index('if [ "$MODE" = gpu ]'):text.index("\nelse\n")]
    start = gpu.index("-m scripts.base_train --") + len("-m scripts.base_train --")
    line = re.match(r"(.*?[^\\])\n", gpu[start:].replace("\\\n", " "), re.S).group(1)
    values = dict(DATASET="climbmix", DEPTH=str(depth), RUN=f"d{depth}", WANDB="off")
    flags = [re.sub(r"\$(\w+)", lambda m: values[m.group(1)], t) for t in shlex.split(line)
             if not t.startswith("${FP8_FLAG") and t != "$@"]
    assert "--target-param-data-ratio" in flags and "--depth" in flags, flags
    return flags


def test_speedrun_gpu_d24_prints_nanochats_batch_lrs_and_decay(capsys):
    """speedrun.sh's GPU run at d24: the batch, each group's peak lr, the weight decay, the
    schedule and the steps nanochat's scripts/base_train.py (92d63d4) gives the same shape,
    written out here (12 depth width^2 + vocab width scaling params, d12's horizon as D_ref; lrs
    0.3, 0.008, 0.02 x sqrt(B / 2^19), AdamW's x (width / 768)^-1/2; weight decay 0.28 x sqrt(B /
    2^19) x D_ref / D), each printed; a short --num-iterations check keeps the real run's batch,
    decay and schedule; given flags win."""
    from types import SimpleNamespace

    from nanomuon.gpt import GPT, config_from_depth
    from scripts.base_train import announce, horizon_steps, optimizer_options
    from scripts.train_args import parse_args

    def scaling(depth):
        return 12 * depth * (64 * depth) ** 2 + 32768 * 64 * depth

    batch = 2 ** round(math.log2(2 ** 19 * (scaling(24) / scaling(12)) ** 0.383))
    assert batch == 2 ** 20
    lr_scale, width_scale = (batch / 2 ** 19) ** 0.5, (24 * 64 / 768) ** -0.5
    want_decay = 0.28 * lr_scale * scaling(12) / scaling(24)
    want_lrs = dict(lm_head=0.008 * lr_scale * width_scale, embedding=0.3 * lr_scale * width_scale,
                    matrices=0.02 * lr_scale)
    with torch.device("meta"):
        model = GPT(config_from_depth(24, 32768, 2048))
    flags = speedrun_gpu_flags(24)
    for extra, steps in (([], round(8 * scaling(24) / batch)), (["--num-iterations", "20"], 20)):
        args = parse_args([*flags, *extra])
        assert horizon_steps(args, model) == steps
        assert args.total_batch_size == batch
        assert args.weight_decay == pytest.approx(want_decay, rel=1e-12)
        assert args.warmdown_ratio == 0.65 and args.final_lr_frac == 0.05
        assert round(args.warmup_ratio * steps) == min(40, steps)
        opt = model.setup_optimizer(**optimizer_options(args, compiled=False))
        got = {g["name"]: g["initial_lr"] for g in opt.param_groups}
        assert got == pytest.approx(want_lrs, rel=1e-12)
        run = SimpleNamespace(args=args, device=torch.device("cpu"), config=model.config,
                              num_params=1, flops_per_token=1.0, world_size=8, grad_accum=4,
                              optimizer=opt, num_iterations=steps, model=model, compiled=True,
                              rank=0)
        args.device_batch_size = 16
        announce(run)
        out = capsys.readouterr().out
        assert f"batch: {batch:,} tokens/step" in out, out
        assert "recipe: batch 1,048,576 tokens/step" in out and "sqrt(B / 2^19) = 1.41" in out
        assert f"recipe: weight decay {want_decay:.4g}" in out, out
        assert f"weight decay {want_decay:.4g} on a cosine to 0" in out, out
        assert (f"lrs at width 768: embedding {0.3 * lr_scale:.4g}, lm_head "
                f"{0.008 * lr_scale:.4g}, Muon {0.02 * lr_scale:.4g}") in out, out
        for name, lr in want_lrs.items():
            assert f"  {name}: {'muon' if name == 'matrices' else 'adamw'}, peak lr {lr:.3g}," in out, out
        assert (f"recipe: schedule: warmup {min(40, steps)} steps, warmdown 0.65 of the steps, "
                "final lr 0.05 of the peak") in out, out
    args = parse_args(["--depth", "24", "--total-batch-size", "524288", "--weight-decay", "0.1",
                       "--warmdown-ratio", "0.5"])
    horizon_steps(args, model)
    assert (args.total_batch_size, args.weight_decay, args.warmdown_ratio) == (524288, 0.1, 0.5)
    assert (args.final_lr_frac, round(args.warmup_ratio * horizon_steps(args, model))) == (0.05, 40)
    assert "recipe: batch" not in capsys.readouterr().out


@pytest.mark.slow
def test_torchrun_resume_is_bitwise_exact(base):
    """Run A trains 6 steps with 2 processes, saving at 3 and 6. Run B starts from a copy of A's step-3
    checkpoint in a fresh torchrun launch and trains to 6: model, optimizer and loader state must equal A's."""
    flags = [*TINY, "--total-batch-size", "1024", "--num-iterations", "6", "--eval-every", "3", "--save-every", "3"]
    a = run(torchrun(2, "scripts.base_train", [*flags, "--run", "a"]), base)
    out = a.stdout
    assert "2 processes x 2 accumulation steps" in out
    assert re.search(r"step 00006/00006 .*\| loss \d+\.\d+ .*\| tok/s [\d,]+", out), out
    assert "optimizer step:" in out and "final val bpb" in out
    report = (base / "runs" / "a" / "report.md").read_text()
    assert "final val bpb" in report and "![train loss and val bpb](curves.png)" in report
    assert (base / "runs" / "a" / "curves.png").read_bytes().startswith(b"\x89PNG")

    (base / "runs" / "b").mkdir(parents=True)
    shutil.copytree(base / "runs" / "a" / "step_000003", base / "runs" / "b" / "step_000003")
    b = run(torchrun(2, "scripts.base_train", [*flags, "--run", "b", "--resume-from-step", "latest"]), base)
    assert "resumed" in b.stdout and "step 00003/00006" not in b.stdout  # continued, did not redo step 3

    names = ("model", "optim")
    (ta, ma), (tb, mb) = (load_checkpoint(base / "runs" / r, 6, names) for r in ("a", "b"))
    assert_bitwise_equal(ta, tb, "checkpoint")
    assert ma["loader"] == mb["loader"]
    assert ma["loop"]["val_history"] == mb["loop"]["val_history"]
    moved = load_checkpoint(base / "runs" / "a", 3, ("model",))[0]["model"]
    assert any(not torch.equal(moved[k], ta["model"][k]) for k in moved)  # steps 4-6 really trained

    # sharded: each process wrote its own file, and its own rows of the large AdamW params (DistMuonAdamW's shards)
    step3 = base / "runs" / "a" / "step_000003"
    assert sorted(f.name for f in step3.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    saved = dcp.FileSystemReader(step3).read_metadata().state_dict_metadata
    rows = saved["model.wte.weight"].size[0]
    assert any([c.offsets[0] for c in m.chunks] == [0, rows // 2] for k, m in saved.items() if k.startswith("optim."))

    # export writes the whole state, the model as the checkpoint holds it
    run([sys.executable, "-m", "scripts.export", "--run", "a", "--step", "3", "--out", str(base / "a3.pt")], base)
    whole = torch.load(base / "a3.pt", weights_only=True)
    assert whole.keys() == {"model", "optim", "meta"} and whole["meta"]["step"] == 3
    assert_bitwise_equal(whole["model"], moved, "export")

    # base_eval and sample read the checkpoint; base_eval's bpb equals base_train's final eval
    e = run(torchrun(2, "scripts.base_eval", ["--run", "a", "--device-type", "cpu", "--device-batch-size", "4",
                                              "--eval-tokens", "1024", "--sample-tokens", "4"]), base)
    final = re.search(r"final val bpb (\d+\.\d+)", out).group(1)
    assert f"val bpb {final}" in e.stdout, (out, e.stdout)
    s = run([sys.executable, "-m", "scripts.sample", "--run", "a", "--device-type", "cpu", "--prompt", "def",
             "--max-tokens", "5"], base)
    assert "--- 'def'" in s.stdout


@pytest.mark.slow  # four launches, about a minute; a session's own --slow run covers it, CI does not
def test_resume_at_another_process_count(base):
    """A run checkpointed by 2 processes resumes with 1 (and another --device-batch-size), 3 and 4 and
    finishes the same run: same tokens per step, the optimizer state resharded, the loader states
    resharded (that no document is skipped or repeated is proven in test_dataloader). The rows are dealt
    to other ranks in another order, so the run matches the uninterrupted one closely, not bitwise."""
    flags = [*TINY, "--device-batch-size", "1", "--total-batch-size", "768", "--num-iterations", "8",
             "--eval-every", "4", "--save-every", "4"]
    whole = run(torchrun(2, "scripts.base_train", [*flags, "--run", "w2"]), base).stdout

    def losses(out):
        return {int(s): float(v) for s, v in re.findall(r"step (\d+)/\d+ .*\| loss (\d+\.\d+)", out)}

    def final_bpb(out):
        return float(re.search(r"final val bpb (\d+\.\d+)", out).group(1))

    for world in (1, 3, 4):
        name = f"w2to{world}"
        (base / "runs" / name).mkdir(parents=True)
        shutil.copytree(base / "runs" / "w2" / "step_000004", base / "runs" / name / "step_000004")
        args = [*flags, "--run", name, "--resume-from-step", "latest"]
        if world == 1:  # a plain process, with 4 rows per micro-batch instead of 1
            out = run([sys.executable, "-m", "scripts.base_train", *args, "--device-batch-size", "4"], base).stdout
        else:
            out = run(torchrun(world, "scripts.base_train", args), base).stdout
        assert f"resharded the data loader from 2 to {world} processes" in out, out
        assert "step 00004/00008" not in out and "step 00008/00008" in out
        # the same run: the train losses come from other rows (other documents, whose losses differ by several
        # percent at this size), so they are only near the uninterrupted ones; val bpb measures the same tokens
        for step, loss in losses(out).items():
            assert abs(loss - losses(whole)[step]) < 0.1 * losses(whole)[step], (world, step, out, whole)
        assert abs(final_bpb(out) - final_bpb(whole)) < 0.03 * final_bpb(whole), (world, out, whole)
        meta = load_checkpoint(base / "runs" / name, 8, ())[1]
        assert meta["world_size"] == world and [s["rank"] for s in meta["loader"]] == list(range(world))


@pytest.mark.slow  # four launches; a session's own --slow run covers it, CI does not
def test_fsdp_matches_replicated_and_resumes(base):
    """--fsdp (FSDP2 params, sharded Muon) with 2 processes trains like the replicated run (DistMuonAdamW) and
    saves the same world-size-independent checkpoint; a fresh --fsdp launch resumes from it bitwise exactly,
    and the checkpoint also resumes without --fsdp in one process."""
    flags = [*TINY, "--total-batch-size", "1024", "--num-iterations", "6", "--eval-every", "3", "--save-every", "3"]
    run(torchrun(2, "scripts.base_train", [*flags, "--run", "rep"]), base)
    out = run(torchrun(2, "scripts.base_train", [*flags, "--run", "fsdp", "--fsdp", "--sample-tokens", "3"]), base)
    assert "sample: 'def fibonacci(n):'" in out.stdout  # every rank generated, in step
    names = ("model", "optim")
    (rep, _), (fsdp, meta) = (load_checkpoint(base / "runs" / r, 6, names) for r in ("rep", "fsdp"))
    for k, v in rep["model"].items():
        torch.testing.assert_close(fsdp["model"][k], v, rtol=0, atol=1e-5, msg=k)
    assert fsdp["optim"]["state"].keys() == rep["optim"]["state"].keys()
    for k, st in rep["optim"]["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(fsdp["optim"]["state"][k][name], v, rtol=0, atol=1e-5, msg=f"{k}.{name}")

    (base / "runs" / "fsdp-b").mkdir(parents=True)
    shutil.copytree(base / "runs" / "fsdp" / "step_000003", base / "runs" / "fsdp-b" / "step_000003")
    run(torchrun(2, "scripts.base_train", [*flags, "--run", "fsdp-b", "--fsdp", "--resume-from-step", "latest"]), base)
    resumed, resumed_meta = load_checkpoint(base / "runs" / "fsdp-b", 6, names)
    assert_bitwise_equal(fsdp, resumed, "checkpoint")
    assert meta["loader"] == resumed_meta["loader"]

    (base / "runs" / "fsdp-1").mkdir(parents=True)
    shutil.copytree(base / "runs" / "fsdp" / "step_000003", base / "runs" / "fsdp-1" / "step_000003")
    one = run([sys.executable, "-m", "scripts.base_train", *flags, "--run", "fsdp-1", "--resume-from-step", "3"], base)
    assert "resharded the data loader from 2 to 1 processes" in one.stdout and "step 00006/00006" in one.stdout


def workers_of(pid: int) -> list[int]:
    """The training processes torchrun `pid` started (its descendants that run base_train)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        parents[int(stat.parent.name)] = (int(fields[1]), b"scripts.base_train" in cmdline)
    def descends(p):
        while p in parents and p != pid:
            p = parents[p][0]
        return p == pid
    return [p for p, (_, trains) in parents.items() if p != pid and trains and descends(p)]


def wait_for_checkpoints(run_dir, step, job, timeout=240):
    """Until run_dir has a checkpoint of step or later (older ones are pruned as it goes)."""
    deadline = time.time() + timeout
    while (list_steps(run_dir) or [-1])[-1] < step and job.poll() is None and time.time() < deadline:
        time.sleep(0.02)


@pytest.mark.heavy
def test_sigkill_mid_run_then_resume_is_bitwise_exact(base):
    """SIGKILL lands while a torchrun job trains and checkpoints. (1) One worker dies; torchrun
    --max-restarts restarts the job, which resumes by itself (--resume-from-step auto). (2) The whole job
    dies; it is restarted by hand with --resume-from-step latest. Either way it continues from the last
    complete checkpoint (a half-written one is never picked) and ends bitwise equal to a run that was
    never interrupted."""
    flags = [*TINY, "--total-batch-size", "512", "--num-iterations", "10", "--eval-every", "-1", "--save-every", "1"]
    run(torchrun(2, "scripts.base_train", [*flags, "--run", "whole"]), base)
    names = ("model", "optim")
    whole = load_checkpoint(base / "runs" / "whole", 10, names)

    env = child_env(base)
    cmd = torchrun(2, "scripts.base_train", [*flags, "--run", "restarted", "--resume-from-step", "auto"])
    cmd.insert(3, "--max-restarts=1")
    # torch shares torchrun's rendezvous store with the process group, and a restarted group can read the
    # previous round's addresses from it (pytorch/pytorch#135712); docs/training.md says to set this with restarts
    restart_env = dict(env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    job = subprocess.Popen(cmd, cwd=REPO, env=restart_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_checkpoints(base / "runs" / "restarted", 4, job)
    victims = workers_of(job.pid)
    assert len(victims) == 2, victims
    os.kill(victims[1], signal.SIGKILL)
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 0, out[-5000:]
    assert "resumed" in out  # the restarted workers picked up the last checkpoint
    restarted = load_checkpoint(base / "runs" / "restarted", 10, names)
    assert_bitwise_equal(whole[0], restarted[0], "checkpoint")
    assert whole[1]["loader"] == restarted[1]["loader"]

    killed = base / "runs" / "killed"
    job = subprocess.Popen(torchrun(2, "scripts.base_train", [*flags, "--run", "killed"]), cwd=REPO, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_checkpoints(killed, 4, job)
    os.killpg(job.pid, signal.SIGKILL)  # torchrun and both ranks at once, wherever they are
    job.wait()
    saved = list_steps(killed)
    assert 4 <= saved[-1] < 10, saved  # killed mid-run, with checkpoints behind it
    run(torchrun(2, "scripts.base_train", [*flags, "--run", "killed", "--resume-from-step", "latest"]), base)
    resumed = load_checkpoint(killed, 10, names)
    assert_bitwise_equal(whole[0], resumed[0], "checkpoint")
    assert whole[1]["loader"] == resumed[1]["loader"]
    assert not list(killed.glob(".tmp_*"))  # debris of a save the kill interrupted is cleared at the restart


def test_single_process_and_gradient_accumulation(base):
    """A plain `python -m` run (no torchrun) with 2 accumulation steps trains: its loss falls."""
    flags = [*TINY, "--total-batch-size", "512", "--num-iterations", "12", "--eval-every", "-1", "--run", "single",
             "--matrix-lr", "0.04"]
    p = run([sys.executable, "-m", "scripts.base_train", *flags], base)
    losses = [float(x) for x in re.findall(r"\| loss (\d+\.\d+)", p.stdout)]
    assert len(losses) == 12 and losses[-1] < losses[0]
    assert "1 processes x 2 accumulation steps" in p.stdout


@pytest.mark.heavy
def test_qk_clip_run(base):
    """--no-qk-norm --qk-clip with a tiny tau: heads get clipped every step, and the run trains and saves."""
    flags = [*TINY, "--total-batch-size", "256", "--num-iterations", "3", "--eval-every", "-1", "--run", "clip",
             "--no-qk-norm", "--qk-clip", "0.5"]
    p = run([sys.executable, "-m", "scripts.base_train", *flags], base)
    counts = [int(c) for c in re.findall(r"qk-clipped heads (\d+)", p.stdout)]
    assert len(counts) == 3 and counts[0] > 0 and counts == sorted(counts), p.stdout
    _, meta = load_checkpoint(base / "runs" / "clip", 3, ())
    assert meta["model_config"]["qk_norm"] is False


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    """A save that fails midway leaves no step directory and no temporary one (a killed save's debris is
    cleared by clean_run_dir at the next start: test_run_safety)."""
    calls = {"n": 0}
    real_save = torch.save

    def dying_save(obj, f):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("an I/O error")
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="an I/O error"):
        save_checkpoint(tmp_path, 5, {"model.w": torch.ones(2), "model.v": torch.ones(3)}, dict(step=5))
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(torch, "save", real_save)
    save_checkpoint(tmp_path, 5, {"model.w": torch.ones(2)}, dict(step=5), dict(optim={"s": 1}))
    assert [p.name for p in tmp_path.iterdir()] == ["step_000005"]


def test_nonfinite_steps_are_skipped_then_the_run_stops(base, capsys, monkeypatch):
    """Skipped steps never run the optimizer; the stop names a checkpoint from before the weights
    that gave the first non-finite loss (those of step 3, and, updates skipped, of 4 and 5 too)."""
    import scripts.base_train as bt
    from nanomuon.optim import MuonAdamW

    flags = [*TINY, "--total-batch-size", "256", "--num-iterations", "8", "--eval-every", "-1", "--run", "nan",
             "--keep-checkpoints", "-1", "--save-every", "1"]
    bt.main(flags)
    capsys.readouterr()
    steps_taken = []
    real_step = MuonAdamW.step
    monkeypatch.setattr(MuonAdamW, "step", lambda self: steps_taken.append(1) or real_step(self))
    monkeypatch.setattr(bt, "all_finite", lambda *_: False)  # from step 4 on, as a diverged run
    with pytest.raises(SystemExit, match=r"3 steps in a row, through step 6, had a non-finite loss") as e:
        bt.main([*flags, "--resume-from-step", "3", "--max-nonfinite-steps", "3"])
    out = capsys.readouterr().out
    assert out.count("update skipped") == 3 and "(3 in a row, 3 in this run)" in out
    assert not steps_taken  # skipped means the optimizer never ran
    assert "Resume from " + str(base / "runs" / "nan" / "step_000002") + " (--resume-from-step 2), with lower" \
        in str(e.value.code), e.value.code


@pytest.mark.heavy
def test_nonfinite_model_is_never_checkpointed(base, monkeypatch):
    import scripts.base_train as bt

    flags = [*TINY, "--total-batch-size", "256", "--num-iterations", "4", "--eval-every", "-1", "--run", "nan-save"]
    bt.main([*flags, "--save-every", "2"])
    shutil.rmtree(base / "runs" / "nan-save" / "step_000004")
    real_load = bt.checkpoint.load_into

    def poisoned(run_dir, step, model, optimizer=None):  # a NaN the gradient check lets through
        real_load(run_dir, step, model, optimizer)
        model.lm_head.weight.data[0, 0] = float("nan")
    monkeypatch.setattr(bt.checkpoint, "load_into", poisoned)
    monkeypatch.setattr(bt, "all_finite", lambda *_: True)
    with pytest.raises(SystemExit, match="non-finite parameters at step 3; not checkpointing"):
        bt.main([*flags, "--save-every", "1", "--resume-from-step", "2"])
    assert list_steps(base / "runs" / "nan-save") == [2]


def _all_finite_worker(rank, world_size):
    from scripts.base_train import all_finite

    params = [torch.nn.Parameter(torch.ones(shape)) for shape in ((3, 4), (5,), (2,))]
    for p in params[:2]:
        p.grad = torch.full_like(p, 0.5)  # params[2] has no grad: ignored
    loss = torch.tensor(2.0)
    assert all_finite(loss, params)
    params[1].grad[3] = float("inf") if rank == 1 else 0.5  # one rank's gradient only: every rank must skip
    assert not all_finite(loss, params)
    params[1].grad[3] = 0.5
    assert not all_finite(torch.tensor(float("nan") if rank == 0 else 2.0), params)
    assert all_finite(loss, params)


@pytest.mark.heavy
def test_all_finite_agrees_across_ranks():
    from test_dist import spawn

    spawn(_all_finite_worker, 2)


@pytest.mark.slow
def test_speedrun_cpu_miniature(tmp_path):
    """The README's main command on a CPU machine: data, tokenizer, 2-process training, eval, samples, report."""
    env = dict(os.environ, NANOMUON_BASE_DIR=str(tmp_path), MODE="cpu")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS"):
        env.pop(key, None)
    p = subprocess.run(["bash", "speedrun.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    bpbs = [float(x) for x in re.findall(r"step \d+ \| val bpb (\d+\.\d+)", p.stdout)]
    assert len(bpbs) >= 3 and bpbs[-1] < 0.6 * bpbs[0], bpbs  # val bpb visibly falls
    assert re.search(r"throughput: [\d,]+ tok/s", p.stdout)
    report = (tmp_path / "runs" / "cpu-d4" / "report.md").read_text()
    assert "final val bpb" in report and "base_eval" in report


@pytest.mark.slow
def test_speedrun_gpu_mode_runs_offline_on_the_embedded_corpus(base, tmp_path):
    """speedrun.sh's GPU branch with DATASET=embedded (what gpu_check.sh runs on a lent GPU), here on the CPU:
    no download, the tokenizer already in the base dir reused (a GPU image has no rustbpe), and base_eval
    scoring the run's own val tokens, so its bpb equals the training run's final one."""
    from nanomuon.dataset import iter_texts
    from nanomuon.tokenizer import Tokenizer

    shutil.copytree(base / "data", tmp_path / "data")
    # the vocab size GPU mode trains, made beforehand, as gpu_check.sh --prepare does
    Tokenizer.train(iter_texts("embedded", "train", 8_000_000), vocab_size=32768).save(tmp_path / "tokenizer")
    env = dict(os.environ, NANOMUON_BASE_DIR=str(tmp_path), MODE="gpu", NPROC="1", DEPTH="2", DATASET="embedded",
               RUN="gpu-mode")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    p = subprocess.run(["bash", "speedrun.sh", "--num-iterations", "3", "--max-seq-len", "64", "--device-batch-size",
                        "2", "--total-batch-size", "128", "--eval-tokens", "2048", "--sample-tokens", "4"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert "reusing the tokenizer" in p.stdout and "tok_train" not in p.stdout
    assert "== fp8 off: compute capability unknown (no nvidia-smi) has no fp8 tensor cores" in p.stdout
    final = re.search(r"final val bpb (\d+\.\d+)", p.stdout).group(1)
    assert re.search(rf"embedded val bpb {final} over 2,048 tokens", p.stdout), p.stdout[-2000:]


def speedrun_env(base_dir, **extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "RUN", "DEPTH", "DATASET")}
    return dict(env, NANOMUON_BASE_DIR=str(base_dir), MODE="cpu", **extra)


def speedrun_until_it_starts(base_dir, *argv, **extra):
    """speedrun.sh run until it ends or prints its first line (then stopped with its children):
    (that first line, its stderr, its exit status)."""
    job = subprocess.Popen(["bash", "speedrun.sh", *argv], cwd=REPO, env=speedrun_env(base_dir, **extra),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    first = job.stdout.readline()  # "" when it ended without a word
    if first:
        os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=60)
    return first, job.stderr.read(), job.returncode


@pytest.mark.heavy
def test_speedrun_refuses_an_earlier_run_before_anything_starts(tmp_path):
    """Re-running speedrun.sh over an interrupted run stops at once, before torchrun, in one line that
    says how to go on in speedrun's own flags; --resume with --start-over, or with nothing to resume,
    is refused as early."""
    run_dir = tmp_path / "runs" / "cpu-d4"
    (run_dir / "step_000100").mkdir(parents=True)
    (run_dir / "report.md").write_text("# an earlier run\n")
    first, err, rc = speedrun_until_it_starts(tmp_path)
    assert first == "" and rc == 1, f"speedrun.sh started: {first}{err}"
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    assert f"{run_dir} holds an earlier run (steps 100, report.md)" in err
    assert "`bash speedrun.sh --resume`" in err and "`bash speedrun.sh --start-over`" in err
    assert "--resume-from-step" not in err, err
    first, err, rc = speedrun_until_it_starts(tmp_path, "--resume", "--start-over")
    assert first == "" and rc == 2 and "--resume and --start-over" in err.strip(), first + err
    first, err, rc = speedrun_until_it_starts(tmp_path, "--resume", RUN="never")
    assert first == "" and rc == 1 and err.strip().count("\n") == 0, first + err
    assert "--resume, but" in err and "holds no checkpoint to continue" in err, err


@pytest.mark.heavy
def test_speedrun_resume_and_start_over_reach_base_train(base, tmp_path):
    """--resume is base_train's --resume-from-step latest, --start-over its own flag; base_eval gets
    neither. torchrun is a stand-in that records its command and fails, so nothing trains."""
    from nanomuon.tokenizer import Tokenizer

    shutil.copytree(base / "data", tmp_path / "data")
    pairs = [bytes([a, b]) for a in range(97, 123) for b in range(256)][:4096 - 257]
    ranks = {bytes([i]): i for i in range(256)} | {t: 256 + i for i, t in enumerate(pairs)}
    Tokenizer(ranks).save(tmp_path / "tokenizer")  # the CPU mode's vocab, so tok_train keeps it
    (tmp_path / "runs" / "cpu-d4" / "step_000100").mkdir(parents=True)
    bin_dir, log = tmp_path / "bin", tmp_path / "torchrun.log"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 3\n')
    (bin_dir / "torchrun").chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}"
    for flag, passed in (("--resume", "--resume-from-step latest"), ("--start-over", "--start-over")):
        log.unlink(missing_ok=True)
        p = subprocess.run(["bash", "speedrun.sh", flag, "--num-iterations", "3"], cwd=REPO,
                           env=speedrun_env(tmp_path, PATH=path), capture_output=True, text=True, timeout=300)
        assert p.returncode == 3 and "reusing the tokenizer" in p.stdout, p.stdout + p.stderr
        called = log.read_text().splitlines()
        assert len(called) == 1 and "-m scripts.base_train" in called[0], called
        assert called[0].endswith(f"{passed} --num-iterations 3"), called


@pytest.mark.slow
def test_gpu_check_dry_run_lists_the_steps_and_checks_the_flags():
    """The dry run lists every step with its limit, most valuable first, cuts them into calls that
    each fit a 9-minute allocation (--only per piece) and a 15-minute device budget at the seconds
    the steps are expected to take, says the rest as over the budget, shows how a timeout reads
    apart from a failure, and checks the imports and flags; --only keeps the steps it names, by
    name or prefix, and refuses others; --plan with a smaller budget says which calls no longer
    fit."""

    def dry(*args):
        return subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=300)

    p = dry()
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    limits = {step: int(s) for step, s in re.findall(r"^  (\S+) +(\d+)s ", p.stdout, re.M)}
    assert {"tests", "ablate", "base_train_d12", "h2h_d24_fp8", "h2h_d24_bf16", "speedrun"} <= set(limits)
    pieces = re.findall(r"^  call \d+: +(\d+)s \(about +\d+ s\)  bash scripts/gpu_check.sh --only (\S+)$",
                        p.stdout, re.M)
    # what 15 minutes cannot hold comes last, the least valuable steps, said as over the budget
    over = re.findall(r"^  over the budget \(\d+ s with it\): +(\d+)s  --only (\S+)$", p.stdout, re.M)
    assert [s for _, piece in pieces + over for s in piece.split(",")] == list(limits)  # each once, in order
    for secs, piece in pieces + over:  # each piece fits one call, and says what its limits add up to
        assert int(secs) == sum(limits[s] for s in piece.split(",")) <= 540, (secs, piece)
    assert [piece for _, piece in pieces] == ["h2h_d24_fp8", "h2h_d24_bf16"], p.stdout
    assert re.search(r"^left after the calls: \d+ s", p.stdout, re.M)
    assert "carry: .gpu_check" in p.stdout
    assert "a step past its limit: timed out after 1 s" in p.stdout
    assert "a failing step: FAILED (exit 3)" in p.stdout
    assert "imports: ok" in p.stdout and "base_train flags: ok" in p.stdout and "cuda tests: collected" in p.stdout
    assert "bench_nanochat flags: ok" in p.stdout and re.search(r"^nanochat( in the kit: |: none)", p.stdout, re.M)
    p = dry("--only", "base_train,tests")
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.findall(r"^  (\S+) +\d+s ", p.stdout, re.M) == ["tests", "base_train_d12", "base_train_d20"]
    # the head-to-heads: the two at d24 are calls within the 15 minutes, d12 is over the budget
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--plan", "--only", "h2h"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert re.findall(r"^  call \d+: .* --only (\S+)$", p.stdout, re.M) == ["h2h_d24_fp8", "h2h_d24_bf16"]
    assert re.findall(r"^  over the budget .* --only (\S+)$", p.stdout, re.M) == ["h2h_d12"], p.stdout
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--plan", "--budget-min", "8"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "  call 1: " in p.stdout and "--only h2h_d24_fp8" in p.stdout, p.stderr
    over = re.findall(r"^  over the budget \(\d+ s with it\): +\d+s  --only (\S+)$", p.stdout, re.M)
    assert over and over[0] == "h2h_d24_bf16" and over[-1].split(",")[-1] == list(limits)[-1], p.stdout
    p = dry("--only", "tests,nosuch")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no step 'nosuch'" in p.stderr, p.stderr
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--help"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0 and "--only" in p.stdout, p.stderr
    assert "timed out after N s" in " ".join(p.stdout.split()), p.stdout  # as the help wraps it


class NoFloat64(TorchDispatchMode):
    """Fails on any op that makes a float64 tensor. MPS has none; this CPU run stands in for it (the model's device
    is the CPU here, so host-side float64 tensors count too)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.dtype == torch.float64]
        assert not made, f"{func} made a float64 tensor"
        return out


@pytest.mark.parametrize("dtype", [pytest.param("fp32", marks=pytest.mark.heavy), "bf16"])
def test_train_and_eval_make_no_float64_tensor(base, capsys, dtype):
    """base_train's steps, evals, checkpoint and samples, and base_eval, with no float64 tensor anywhere (an MPS
    device would fail on one): the guard is live, as evaluate_bpb's old float64 sums trip it."""
    from scripts.base_eval import main as eval_main
    from scripts.base_train import main

    flags = [*TINY, "--total-batch-size", "256", "--num-iterations", "2", "--eval-every", "1", "--run", f"f64-{dtype}",
             "--dtype", dtype]
    with NoFloat64():
        main(flags)
        eval_main(["--run", f"f64-{dtype}", "--device-type", "cpu", "--device-batch-size", "4", "--sample-tokens", "4"])
    out = capsys.readouterr().out
    assert ("bf16 autocast" if dtype == "bf16" else "1 x cpu, fp32") in out
    with NoFloat64(), pytest.raises(AssertionError, match="float64"):
        torch.zeros(2, dtype=torch.float64)


def test_device_batch_auto_is_32_rows_off_cuda(base, capsys):
    """--device-batch-size auto (the default) fits the free memory on CUDA (tests/test_cuda.py checks the estimate
    there; tests/test_recipe.py the fit); on the CPU it is 32 rows, as the flag's default was."""
    from scripts.base_train import main

    main([*TINY, "--device-batch-size", "auto", "--total-batch-size", "4096", "--num-iterations", "1", "--run", "auto"])
    assert "4,096 tokens/step = 32 rows x 64" in capsys.readouterr().out


def launch_nodes(bases, args, nproc=1):
    """One torchrun launcher per base dir, as the nodes of one job meeting at a c10d rendezvous on 127.0.0.1
    (what two machines would run, each with its own NANOMUON_BASE_DIR); (returncode, stdout + stderr) of each."""
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(bases)}", f"--nproc_per_node={nproc}",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=nanomuon-test", "-m",
           "scripts.base_train", "--", *args]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=child_env(b), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for b in bases]
    return [(p.wait(timeout=300), p.stdout.read()) for p in procs]


@pytest.mark.slow  # five 2-node launches, about 90 s
def test_two_nodes_train_checkpoint_resume_and_refuse_what_they_do_not_share(base, tmp_path):
    """Two launchers on this machine as two nodes (--nnodes 2, c10d rendezvous). With a shared base dir: train,
    checkpoint, and resume both on 2 nodes and on 1 node of 2 processes, bitwise as the uninterrupted run. With a
    second node whose base dir lacks the tokenizer, or has a runs/ of its own (each process writes its part of a
    checkpoint there): every process stops at the start with one line naming the rank and host, instead of the job
    hanging or writing a checkpoint in halves."""
    flags = [*TINY, "--total-batch-size", "512", "--num-iterations", "4", "--eval-every", "-1", "--save-every", "2"]
    nodes = launch_nodes([base, base], [*flags, "--run", "mn"])
    assert all(code == 0 for code, _ in nodes), nodes
    out = "".join(out for _, out in nodes)  # rank 0 prints, on whichever node the rendezvous made it
    assert "x 2 processes x 1 accumulation steps" in out
    for name, nodes in (("mn2", [base, base]), ("mn1", None)):
        (base / "runs" / name).mkdir(parents=True)
        shutil.copytree(base / "runs" / "mn" / "step_000002", base / "runs" / name / "step_000002")
        resume = [*flags, "--run", name, "--resume-from-step", "latest"]
        if nodes:
            assert all(code == 0 for code, _ in launch_nodes(nodes, resume)), out
        else:  # one node, 2 processes: the same world size, so the same bits
            run(torchrun(2, "scripts.base_train", resume), base)
        (ta, ma), (tb, mb) = (load_checkpoint(base / "runs" / r, 4, ("model", "optim")) for r in ("mn", name))
        assert_bitwise_equal(ta, tb, name)
        assert ma["loader"] == mb["loader"]

    bare = tmp_path / "node2"  # a second node that shares runs/, but has no tokenizer
    bare.mkdir()
    (bare / "runs").symlink_to(base / "runs")
    for code, out in launch_nodes([base, bare], [*flags, "--run", "mn3"]):
        assert code != 0 and "no tokenizer" in out and re.search(r"\(rank [01] on [^)]+\)", out), out[-3000:]
    (bare / "tokenizer").symlink_to(base / "tokenizer")  # now the tokenizer and the data, but a runs/ of its own
    (bare / "data").symlink_to(base / "data")
    (bare / "runs").unlink()
    for code, out in launch_nodes([base, bare], [*flags, "--run", "mn", "--resume-from-step", "latest"]):
        assert code != 0, out[-3000:]
        assert re.search(r"error: the run dirs \S+ \(their \.lock files\) differ between processes: rank 0 on \S+ has "
                         r".+, rank 1 on \S+ has .+; every process writes its part of each checkpoint", out), out


FAULTS = """
import resource, sys, torch
from nanomuon.common import compute_init
if sys.argv[1] == "cpu-run":
    compute_init("cpu")  # what every CPU run starts with
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(2 ** 24)  # 64 MiB: over glibc's 32 MiB mmap threshold, as a batch's logits are
del x
before = faults()
y = torch.ones(2 ** 24 - 2 ** 12)  # as the next step allocates it (a little less: alignment may pad a request)
print(faults() - before)
"""


def test_cpu_runs_reuse_the_memory_they_free():
    """A CPU run keeps freed memory in glibc's heap (common.reuse_freed_memory): a step's large temporaries then
    reuse it, instead of each being mmapped afresh and page-faulted in, 16,384 faults per 64 MiB."""
    faults = {mode: int(subprocess.run([sys.executable, "-c", FAULTS, mode], cwd=REPO, capture_output=True,
                                       text=True, check=True).stdout) for mode in ("default", "cpu-run")}
    assert faults["default"] > 10_000 and faults["cpu-run"] < 500, faults


def test_a_momentum_a_variant_gives_is_kept_even_at_the_recipes_value(monkeypatch):
    """A sweep point at 0.95 (the recipe's momentum) trains at 0.95, as 0.9 and 0.99 train at
    theirs: --variant-option momentum=0.95, a variant's own 0.95 and a role's 0.95 all stay flat,
    where plain muon follows the arch's schedule (0.85 at step 0)."""
    from nanomuon import variants
    from nanomuon.arch import ARCHS, Variant
    from nanomuon.gpt import GPT, config_from_depth
    from scripts.base_train import group_words, horizon_steps, optimizer_options, schedule_group
    from scripts.train_args import parse_args

    monkeypatch.setitem(variants.OPTIMIZER_VARIANTS, "own-095", Variant(muon_options=dict(
        momentum=0.95)))
    monkeypatch.setitem(variants.OPTIMIZER_VARIANTS, "role-095", Variant(roles={"mlp.fc": dict(
        momentum=0.95)}))
    model = GPT(config_from_depth(2, 64, 16, aspect_ratio=32, head_dim=16, arch="classic"))
    for flags, kept in ((["--optimizer", "muon", "--variant-option", "momentum=0.95"], 1),
                        (["--optimizer", "muon", "--variant-option", "momentum=0.9"], 1),
                        (["--optimizer", "own-095"], 1), (["--optimizer", "role-095"], 0),
                        (["--optimizer", "muon"], 0)):
        args = parse_args([*flags, "--arch", "classic", "--num-iterations", "100",
                           "--total-batch-size", "4096"])
        assert horizon_steps(args, model) == 100
        opt = model.setup_optimizer(**optimizer_options(args, compiled=False), horizon=100)
        muon = {g["name"]: g for g in opt.param_groups if g["kind"] == "muon"}
        for g in muon.values():
            schedule_group(g, 0, 100, args, ARCHS["classic"])
        given = muon["matrices"]["initial_momentum"]
        assert muon["matrices"]["momentum"] == (given if kept else 0.85), flags
        assert ("kept" in group_words(muon["matrices"], ARCHS["classic"], args)) == bool(kept)
        if "matrices, mlp.fc" in muon:
            assert muon["matrices, mlp.fc"]["momentum"] == 0.95, flags


def test_the_header_shows_the_betas_an_adamw_role_runs(monkeypatch):
    """A role's AdamW momentum runs as beta1: the header says (0.7, 0.95), as the step runs."""
    from nanomuon.gpt import ARCHS, GPT, config_from_depth
    from scripts.base_train import group_words, optimizer_options
    from scripts.train_args import parse_args

    args = parse_args(["--optimizer", "muon", "--variant-option", "roles.lm_head.momentum=0.7",
                       "--arch", "classic", "--weight-decay", "0.2", "--total-batch-size", "4096"])
    model = GPT(config_from_depth(2, 64, 16, aspect_ratio=32, head_dim=16, arch="classic"))
    model(torch.randint(0, 64, (1, 16)), torch.randint(0, 64, (1, 16))).backward()
    opt = model.setup_optimizer(**optimizer_options(args, compiled=False), horizon=10)
    (head,) = [g for g in opt.param_groups if g["name"] == "lm_head"]
    said = group_words(head, ARCHS["classic"], args)
    opt.step()
    assert f"betas {tuple(head['betas'])}," in said and head["betas"][0] == 0.7, said


def test_schedules_keep_a_variants_own_momentum_and_decay_from_its_own_peak(monkeypatch, capsys):
    """A Muon group at the recipe's momentum follows the arch's schedule (nanochat's: 0.85 -> 0.97
    over 400 steps, written out here); a role whose momentum a variant set keeps it at every step,
    and its weight decay follows the cosine from its own peak (0 stays 0). The header and the step
    line say the values that run, per group."""
    from nanomuon import variants
    from nanomuon.arch import ARCHS, Variant
    from nanomuon.gpt import GPT, config_from_depth
    from scripts.base_train import (
        group_words,
        horizon_steps,
        muon_values,
        optimizer_options,
        schedule_group,
    )
    from scripts.train_args import parse_args

    monkeypatch.setitem(variants.OPTIMIZER_VARIANTS, "kept", Variant(
        muon_options=dict(momentum=0.9), roles={"mlp.fc": dict(weight_decay_factor=0.0)}))
    args = parse_args(["--optimizer", "kept", "--arch", "nanochat", "--weight-decay", "0.2",
                       "--num-iterations", "1000", "--total-batch-size", "4096"])
    model = GPT(config_from_depth(2, 64, 16, aspect_ratio=32, head_dim=16, arch="nanochat"))
    assert horizon_steps(args, model) == 1000
    opt = model.setup_optimizer(**optimizer_options(args, compiled=False), horizon=1000)
    muon = {g["name"]: g for g in opt.param_groups if g["kind"] == "muon"}
    assert set(muon) == {"matrices", "matrices, mlp.fc"}
    lines = [group_words(g, ARCHS["nanochat"], args) for g in muon.values()]
    assert lines[0].endswith("momentum 0.9, kept, weight decay 0.2 on a cosine to 0"), lines
    assert lines[1].endswith("momentum 0.9, kept, weight decay 0"), lines
    for step in (0, 200, 999):
        for g in opt.param_groups:
            schedule_group(g, step, 1000, args, ARCHS["nanochat"])
        cosine = 0.2 * 0.5 * (1 + math.cos(math.pi * step / 1000))
        assert [g["momentum"] for g in muon.values()] == [0.9, 0.9]
        assert muon["matrices"]["weight_decay"] == pytest.approx(cosine, rel=1e-12)
        assert muon["matrices, mlp.fc"]["weight_decay"] == 0.0
        assert muon_values(opt, [True, True]) == f"mom 0.9 | wd {cosine:.3g}/0"
    monkeypatch.setitem(variants.OPTIMIZER_VARIANTS, "kept", Variant())
    opt = model.setup_optimizer(**optimizer_options(args, compiled=False), horizon=1000)
    (group,) = [g for g in opt.param_groups if g["kind"] == "muon"]
    assert "momentum the arch's schedule" in group_words(group, ARCHS["nanochat"], args)
    schedule_group(group, 200, 1000, args, ARCHS["nanochat"])
    assert group["momentum"] == pytest.approx(0.85 + 0.5 * (0.97 - 0.85), rel=1e-12)
