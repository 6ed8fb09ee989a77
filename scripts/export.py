"""
Export a (sharded) checkpoint as one whole-state file for tools that want plain tensors: {"model":
the state_dict, "optim": the optimizer's world-size-independent state, "meta": its meta.json},
written atomically; torch.load(path, weights_only=True) reads it. --out must be a new path, or a
regular file to overwrite with --force: the file is renamed over it, which would put a file in
place of a device, FIFO or symlink.

    python -m scripts.export --run d20                  # runs/d20/export_step_NNNNNN.pt
    python -m scripts.export --run d20 --step 5000 --model-only --out d20.pt
"""

import argparse
import os
import stat
from pathlib import Path

import torch

from nanomuon.checkpoint import load_checkpoint, load_step
from nanomuon.common import file_kind, get_base_dir, size_str, user_errors, write_atomic
from scripts.sample import add_checkpoint_args


def check_out(out: Path, force: bool) -> None:
    """Stop with one line unless out is a new path in a folder, or a regular file and force."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        if not out.parent.is_dir():
            raise SystemExit(f"error: cannot write {out}: there is no folder {out.parent}; "
                             "create it first") from None
        return
    except OSError as e:  # a parent that is a file, no permission, a name too long
        raise SystemExit(f"error: cannot write {out}: {e}") from None
    again = "give another --out: a new path, or a regular file with --force"
    if stat.S_ISLNK(st.st_mode):
        raise SystemExit(f"error: {out} is a symlink to {os.readlink(out)}, which export would "
                         f"replace; {again}")
    if not stat.S_ISREG(st.st_mode):
        raise SystemExit(f"error: {out} is a {file_kind(st.st_mode)}, not a regular file, which "
                         f"export would replace; {again}")
    if not force:
        raise SystemExit(f"error: {out} exists ({size_str(st.st_size)}); add --force to overwrite "
                         "it, or give another --out")


def out_arg(s: str) -> Path:
    """argparse type of --out: a path (an empty one would be the current folder)."""
    if not s.strip():
        raise argparse.ArgumentTypeError("is empty (an unset variable?): give a file to write, or "
                                         "leave --out out for the run dir's export_step_NNNNNN.pt")
    return Path(s)


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description="Write a checkpoint as one whole-state file",
                                allow_abbrev=False)
    add_checkpoint_args(p, device=False)
    p.add_argument("--out", type=out_arg, default=None,
                   help="file to write (default: the run dir's export_step_NNNNNN.pt)")
    p.add_argument("--model-only", action="store_true", help="leave out the optimizer state (a "
                   "third of the size with AdamW, half with Muon): enough for inference")
    p.add_argument("--force", action="store_true",
                   help="overwrite --out if it is an existing regular file")
    args = p.parse_args(argv)
    run_dir = get_base_dir() / "runs" / args.run
    with user_errors():
        step, _ = load_step(run_dir, args.step)
        out = args.out or run_dir / f"export_step_{step:06d}.pt"
        check_out(out, args.force)
        names = ("model",) if args.model_only else ("model", "optim")
        state, meta = load_checkpoint(run_dir, step, names)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # write_atomic made it, as a new regular file
            torch.save(dict(state, meta=meta), f)
        check_out(out, args.force)  # again: out may have changed during the save
    try:
        write_atomic(out, write, sync=True)  # never a half-written file
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        raise SystemExit(f"error: cannot write {out}: {e}") from None
    seeds = meta["args"].get("seeds") if isinstance(meta.get("args"), dict) else None
    stacked = (f"; {len(seeds)} seeds' models stacked on dim 0 of every tensor (base_train "
               f"--seeds), seed i at index i" if isinstance(seeds, list) and seeds else "")
    print(f"wrote {out} ({size_str(out.stat().st_size)}): {' and '.join(names)} of {run_dir} at "
          f"step {step}{stacked}")
    return out


if __name__ == "__main__":
    main()
