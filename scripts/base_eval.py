"""
Evaluate a base_train checkpoint: validation bits per byte, the CORE metric (docs/core.md) and a
few samples, appended to the run's report; `core` also goes into its summary.json and, with
--wandb, the training's wandb run. It holds the run dir's lock, so no training moves the step it
measures away from the report. bpb is measured on the run's own data if that is a built-in source;
any other takes an explicit --dataset: a checkpoint must not pick what is read or downloaded.

--eval picks any of core, bpb, sample: by default bpb and sample, plus core when an eval bundle is
already in the base dir, so the default runs offline; `--eval core,...` downloads a missing bundle.

    python -m scripts.base_eval -- --run d20
    python -m scripts.base_eval -- --run d20 --eval core --max-per-task 100   # a quick look
    torchrun --standalone --nproc_per_node=8 -m scripts.base_eval -- --run d20 --eval core,bpb
"""

import argparse
import contextlib
import re
import shlex

import torch

from nanomuon.common import (
    DTYPES,
    compute_cleanup,
    compute_init,
    evaluate_bpb,
    get_base_dir,
    print0,
    shown,
    user_errors,
    wandb_key_problem,
)
from nanomuon.core_eval import BUNDLE_URL, evaluate_core, find_bundle, headline, load_tasks
from nanomuon.dataloader import scored_tokens, val_rows
from nanomuon.dataset import DATASETS
from nanomuon.report import PROMPTS, start_wandb
from nanomuon.run import (
    append_section,
    check_report,
    check_summary,
    claim_run_dir,
    merge_summary,
    put_headline,
    summary_record,
)
from nanomuon.sources import add_data_args, prepare
from scripts.sample import add_checkpoint_args, load_for_inference, stream

KEYS = ("dataset", "text_column", "val_fraction")


def quoted(value) -> str:
    """value as a word to paste into a shell, or as Python writes it if not printable text."""
    return shlex.quote(value) if isinstance(value, str) and value.isprintable() else ascii(value)


def flags(data) -> str:
    """data's --dataset, --text-column and --val-fraction, as words to paste into a command."""
    return " ".join(f"--{k.replace('_', '-')} {quoted(getattr(data, k))}" for k in KEYS
                    if k == "dataset" or getattr(data, k) is not None)


def eval_data(args, meta) -> argparse.Namespace:
    """The data to evaluate on: --dataset as given, else the run's own if it is built in. The run's
    own source, named, comes with the run's --text-column and --val-fraction unless given."""
    own = meta.get("args") if isinstance(meta.get("args"), dict) else {}
    data = argparse.Namespace(**{k: own.get(k) for k in KEYS})
    if args.dataset:
        given = args.text_column is not None or args.val_fraction is not None
        return args if given or args.dataset != data.dataset else data
    if data.dataset not in DATASETS:
        raise SystemExit(f"error: run {args.run}'s checkpoint names --dataset "
                         f"{quoted(data.dataset)}, which is not built in ({', '.join(DATASETS)}); "
                         "base_eval reads or downloads other data only when asked: pass --dataset "
                         f"{quoted(data.dataset)} if you trust it")
    return data


EVALS = ("core", "bpb", "sample")


def evals_arg(text: str) -> list[str]:
    """argparse type of --eval: a comma-separated subset of EVALS."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in EVALS]
    if not names or bad:
        what = f"{bad[0]!r} is not one of" if bad else "name at least one of"
        raise argparse.ArgumentTypeError(f"{what} {', '.join(EVALS)} (comma-separated)")
    return names


def parse_args(argv):
    p = argparse.ArgumentParser(description="Validation bpb, CORE and samples for a nanomuon "
                                "checkpoint", allow_abbrev=False)
    add_checkpoint_args(p)
    add_data_args(p, None)  # default: the run's own data, if built in (eval_data)
    p.add_argument("--eval", type=evals_arg, default=None, help="any of core,bpb,sample (default: "
                   "bpb,sample, and core when an eval bundle is in the base dir; naming core "
                   "downloads the bundle if it is missing)")
    p.add_argument("--core-bundle", default=None, help="a CORE eval bundle to use: nanochat's "
                   "eval_bundle.zip, or a folder of its layout (default: the base dir's)")
    p.add_argument("--max-per-task", type=int, default=None,
                   help="CORE: at most this many items per task, for a quick look")
    p.add_argument("--device-batch-size", type=int, default=32)
    p.add_argument("--eval-tokens", type=int, default=None, help="val tokens to score (default: "
                   "the run's own --eval-tokens; -1: the whole val split)")
    p.add_argument("--sample-tokens", type=int, default=48, help="0: no samples")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="bf16 autocast or fp32 (default: "
                   "what the run trained in; auto: bf16 where bf16 matmuls are fast)")
    p.add_argument("--wandb", choices=["off", "online", "offline"], default="off", help="log bpb "
                   "and CORE to Weights & Biases, into the training's run if summary.json names it")
    args = p.parse_args(argv)
    if args.device_batch_size < 1 or args.sample_tokens < 0:
        p.error("--device-batch-size must be >= 1, --sample-tokens >= 0")
    if args.eval_tokens is not None and args.eval_tokens < 1 and args.eval_tokens != -1:
        p.error("--eval-tokens must be >= 1, or -1 for the whole val split; got "
                f"{args.eval_tokens}")
    if args.max_per_task is not None and args.max_per_task < 1:
        p.error(f"--max-per-task must be >= 1, got {args.max_per_task}")
    if args.dataset is None and (args.text_column is not None or args.val_fraction is not None):
        p.error("--text-column and --val-fraction go with --dataset; without it, the run's own "
                "data and options")
    if (problem := wandb_key_problem(args.wandb)) is not None:  # before the evals, not after
        p.error(problem)
    return args


def run_bpb(args, model, tokenizer, meta, device, dtype) -> tuple[float, list[str]]:
    """Validation bits per byte on the run's data (or --dataset), and its report line."""
    data_args = eval_data(args, meta)
    print0(f"evaluating on {flags(data_args)}" + ("" if data_args is args else ", the run's data"))
    eval_tokens = args.eval_tokens or meta["args"].get("eval_tokens", 10 * 524288)
    with user_errors():
        data = prepare(data_args.dataset, data_args.text_column, data_args.val_fraction)
        rows = val_rows(tokenizer, data, model.config.sequence_len, eval_tokens)
    bpb = evaluate_bpb(model, rows, args.device_batch_size, tokenizer.token_bytes().to(device),
                       dtype)
    named = shown(data_args.dataset, 500, quote=False)  # escaped, in the report too
    print0(f"run {args.run} step {meta['step']}: {named} val bpb {bpb:.4f} over "
           f"{scored_tokens(rows):,} tokens")
    return bpb, [f"- {named} val bpb: {bpb:.4f}"]


def run_core(args, model, tokenizer, meta, device, dtype) -> tuple[dict | None, list[str]]:
    """CORE (None when skipped) and its report lines: the headline, then a row per task."""
    with user_errors():
        bundle = find_bundle(args.core_bundle, fetch=args.eval is not None)
        if bundle is None:
            note = (f"CORE skipped: no eval bundle in {get_base_dir()} (`--eval core` downloads "
                    f"{BUNDLE_URL} there, or pass --core-bundle PATH; docs/core.md)")
            print0(note)
            return None, [f"- {note}"]
        tasks = load_tasks(bundle, args.max_per_task)
    print0(f"CORE: {len(tasks)} tasks from {bundle.path}")
    result = evaluate_core(model, tokenizer, tasks, device, dtype)
    train_time = (meta.get("loop") or {}).get("train_time")
    hours = train_time / 3600 if isinstance(train_time, (int, float)) else None
    line = headline(result["core"], hours, len(tasks), args.max_per_task)
    print0(line)
    seconds = sum(r["seconds"] for r in result["tasks"].values())
    lines = [line, "", f"- CORE: {result['core']:.4f}, the mean centered accuracy of "
             f"{len(tasks)} tasks ({seconds:.0f} s) from {bundle.path} (sha256 {bundle.digest()})",
             "", "| task | kind | shots | items | accuracy | random | centered | s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {k} | {r['kind']} | {r['shots']} | {r['items']} | {r['accuracy']:.4f} | "
              f"{r['baseline'] / 100:.3f} | {r['centered']:+.4f} | {r['seconds']:.1f} |"
              for k, r in result["tasks"].items()]
    result.update(headline=line, max_per_task=args.max_per_task, step=meta["step"])
    return result, lines + [""]


def training_wandb_id(summary) -> str | None:
    """The wandb run id base_train recorded in summary.json (untrusted: else None, with a note)."""
    wandb_id = (summary_record(summary, "logging to a new wandb run") or {}).get("wandb_id")
    if wandb_id is None or isinstance(wandb_id, str) and re.fullmatch(r"[a-z0-9]{1,64}", wandb_id):
        return wandb_id
    print0(f"note: {summary}'s wandb_id {wandb_id!r} is not a wandb run id; logging to a new run")
    return None


def log_wandb(args, run_dir, step: int, bpb, core) -> None:
    """bpb and CORE (each task's too) into the training's wandb run, resumed, or a new one."""
    wandb_id = training_wandb_id(run_dir / "summary.json")
    run = start_wandb(args.wandb, args.run, run_dir, id=wandb_id,
                      resume="allow" if wandb_id else None)
    logged = {} if bpb is None else {"eval/bpb": bpb}
    if core:
        logged["eval/core"] = core["core"]
        logged.update({f"eval/core/{k}": r["centered"] for k, r in core["tasks"].items()})
    run.log({"step": step, **logged})
    run.summary.update({k.removeprefix("eval/"): v for k, v in logged.items()})
    run.finish()


def main(argv=None):
    args = parse_args(argv)
    _, rank, _, _, device = compute_init(args.device_type)
    run_dir = get_base_dir() / "runs" / args.run
    with contextlib.ExitStack() as held:
        claim_run_dir(run_dir, rank, held)  # until the results are written
        bpb = measure(args, run_dir, rank, device)
    compute_cleanup()
    return bpb


def measure(args, run_dir, rank: int, device) -> float | None:
    """The evaluations asked for, into the run's report (rank 0), CORE also into its summary.json
    and headline; returns bpb, or None when not asked for."""
    evals = args.eval or ["bpb", "core", "sample"]  # core: only with a bundle already here
    model, tokenizer, meta = load_for_inference(args, device)
    check_report(run_dir / "report.md")
    if "core" in evals:
        check_summary(run_dir / "summary.json")
    # runs from before --dtype autocast on CUDA only, as evaluate_bpb did
    dtype = args.dtype or meta["args"].get("dtype") or ("bf16" if device.type == "cuda" else "fp32")
    bpb, core, lines = None, None, []
    if "bpb" in evals:
        bpb, more = run_bpb(args, model, tokenizer, meta, device, dtype)
        lines += more
    if "core" in evals:
        core, more = run_core(args, model, tokenizer, meta, device, dtype)
        # the headline opens the section; the table, or the note of a skip, follows bpb
        lines = (more[:2] if core else []) + lines + (more[2:] if core else more)
    if rank == 0 and args.sample_tokens and "sample" in evals:
        for prompt in PROMPTS:
            text = "".join(stream(model, tokenizer, prompt, args.sample_tokens, temperature=0.8,
                                  top_k=50, seed=0))
            print0(f"--- {prompt!r}\n{prompt}{text}")
            lines.append(f"- sample (T=0.8): `{prompt + text!r}`")
    if rank == 0:
        append_section(run_dir, "base_eval", meta["step"], lines)
        if core:
            put_headline(run_dir, "base_eval", core["headline"])
            merge_summary(run_dir, "base_eval", dict(
                core=core["core"], core_step=core["step"], core_tasks=core["tasks"],
                core_max_per_task=core["max_per_task"], core_headline=core["headline"]))
        if args.wandb != "off":
            log_wandb(args, run_dir, meta["step"], bpb, core)
    return bpb


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
