"""
Evaluate a base_train checkpoint: validation bits per byte, plus a few samples; appends to the run's
report. It evaluates on the run's own data if that is a built-in source (fineweb-edu, embedded); any
other source (a local path, a hub dataset) takes an explicit --dataset: a checkpoint may come from
someone else, and must not pick what is read or downloaded.

    python -m scripts.base_eval -- --run d20
    torchrun --standalone --nproc_per_node=8 -m scripts.base_eval -- --run d20 --eval-tokens 20971520
"""

import argparse
import os
import shlex

import torch

from nanomuon.common import (
    DTYPES,
    compute_cleanup,
    compute_init,
    evaluate_bpb,
    get_base_dir,
    print0,
    user_errors,
)
from nanomuon.dataloader import val_rows
from nanomuon.dataset import DATASETS
from nanomuon.sources import add_data_args, prepare
from scripts.base_train import PROMPTS
from scripts.sample import add_checkpoint_args, load_for_inference, sample

KEYS = ("dataset", "text_column", "val_fraction")


def quoted(value) -> str:
    """value as a word to paste into a shell, or as Python writes it if not printable text."""
    return shlex.quote(value) if isinstance(value, str) and value.isprintable() else ascii(value)


def flags(data) -> str:
    """data's --dataset, --text-column and --val-fraction, as words to paste into a command."""
    return " ".join(f"--{k.replace('_', '-')} {quoted(getattr(data, k))}" for k in KEYS
                    if k == "dataset" or getattr(data, k) is not None)


def eval_data(args, meta) -> argparse.Namespace:
    """The data to evaluate on: --dataset as given, else the run's own if it is a built-in source;
    anything else is read or downloaded only on the user's say-so. The run's own source, named,
    comes with the run's --text-column and --val-fraction unless given, so the numbers compare."""
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


def check_report(report) -> None:
    """Exit now, before evaluating, if report cannot be appended to (every rank checks, so all
    stop together)."""
    try:
        os.close(os.open(report, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW))
    except FileNotFoundError:
        if not os.access(report.parent, os.W_OK | os.X_OK):
            raise SystemExit(f"error: cannot create {report}: {report.parent} is not writable; "
                             "make it writable, or copy the run into a writable base dir") from None
    except OSError as e:
        raise SystemExit(f"error: cannot append to {report} ({e.strerror}): make it a writable "
                         "regular file (not a link), or copy the run into a writable base dir"
                         ) from None


def main(argv=None):
    p = argparse.ArgumentParser(description="Validation bpb and samples for a nanomuon checkpoint",
                                allow_abbrev=False)
    add_checkpoint_args(p)
    add_data_args(p, None)  # default: the run's own data, if built in (eval_data)
    p.add_argument("--device-batch-size", type=int, default=32)
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="val tokens to score (default: the run's own --eval-tokens, so the numbers "
                   "compare)")
    p.add_argument("--sample-tokens", type=int, default=48, help="0: no samples")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="bf16 autocast or fp32 (default: "
                   "what the run trained in; auto: bf16 where bf16 matmuls are fast)")
    args = p.parse_args(argv)
    if (args.device_batch_size < 1 or (args.eval_tokens is not None and args.eval_tokens < 1)
            or args.sample_tokens < 0):
        p.error("--device-batch-size and --eval-tokens must be >= 1, --sample-tokens >= 0")
    if args.dataset is None and (args.text_column is not None or args.val_fraction is not None):
        p.error("--text-column and --val-fraction go with --dataset; without it, the run's own "
                "data and options")
    distributed, rank, _, world_size, device = compute_init(args.device_type)
    model, tokenizer, meta = load_for_inference(args, device)
    check_report(get_base_dir() / "runs" / args.run / "report.md")
    data_args = eval_data(args, meta)
    dataset = data_args.dataset
    print0(f"evaluating on {flags(data_args)}" + ("" if data_args is args else ", the run's data"))
    eval_tokens = args.eval_tokens or meta["args"].get("eval_tokens", 10 * 524288)
    with user_errors():
        data = prepare(dataset, data_args.text_column, data_args.val_fraction)
        rows = val_rows(tokenizer, data, model.config.sequence_len, eval_tokens)
    # runs from before --dtype autocast on CUDA only, as evaluate_bpb did
    dtype = args.dtype or meta["args"].get("dtype") or ("bf16" if device.type == "cuda" else "fp32")
    bpb = evaluate_bpb(model, rows, args.device_batch_size, tokenizer.token_bytes().to(device),
                       dtype)
    scored = int((rows[:, 1:] >= 0).sum())  # padding is not scored
    print0(f"run {args.run} step {meta['step']}: {dataset} val bpb {bpb:.4f} over {scored:,} "
           "tokens")
    lines = ["", f"## base_eval, step {meta['step']}", "", f"- {dataset} val bpb: {bpb:.4f}"]
    if rank == 0 and args.sample_tokens:
        for prompt in PROMPTS:
            text = sample(model, tokenizer, prompt, args.sample_tokens, temperature=0.8, top_k=50,
                          seed=0)
            print0(f"--- {prompt!r}\n{prompt}{text}")
            lines.append(f"- sample (T=0.8): `{prompt + text!r}`")
    if rank == 0:
        report = get_base_dir() / "runs" / args.run / "report.md"
        # a link there is refused, not followed
        append = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
        try:
            fd = os.open(report, append, 0o644)
        except OSError as e:
            raise SystemExit(f"error: cannot append to {report} ({e.strerror}): it must be a "
                             "regular file of the run's own, not a link") from None
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print0(f"appended to {report}")
    compute_cleanup()
    return bpb


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
