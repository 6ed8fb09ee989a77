"""
Export a checkpoint as one whole-state file, for tools that want plain tensors: an inference server, a
conversion script, torch.load in a notebook. Training checkpoints are sharded (each process writes its own
pieces through torch.distributed.checkpoint; nanomuon/checkpoint.py); this reads one back whole in a single
process and writes {"model": the model's state_dict, "optim": the optimizer's world-size-independent state
(MuonAdamW.full_state_dict() format), "meta": its meta.json}, atomically. It loads with
torch.load(path, weights_only=True).

    python -m scripts.export --run d20                  # runs/d20/export_step_NNNNNN.pt
    python -m scripts.export --run d20 --step 5000 --model-only --out d20.pt
"""

import argparse
import os
from pathlib import Path

import torch

from nanomuon.checkpoint import load_checkpoint, load_step, run_arg, step_arg
from nanomuon.common import get_base_dir, size_str, user_errors, write_atomic


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description="Write a checkpoint as one whole-state file", allow_abbrev=False)
    p.add_argument("--run", type=run_arg, required=True, help="run name, as given to base_train --run (e.g. d20)")
    p.add_argument("--step", type=step_arg, default="latest", help="checkpoint step, or 'latest'")
    p.add_argument("--out", type=Path, default=None, help="file to write (default: the run dir's "
                   "export_step_NNNNNN.pt)")
    p.add_argument("--model-only", action="store_true", help="leave out the optimizer state (a third of the size "
                   "with AdamW, half with Muon): enough for inference")
    args = p.parse_args(argv)
    run_dir = get_base_dir() / "runs" / args.run
    with user_errors():
        step, _ = load_step(run_dir, args.step)
        names = ("model",) if args.model_only else ("model", "optim")
        state, meta = load_checkpoint(run_dir, step, names)
    out = args.out or run_dir / f"export_step_{step:06d}.pt"

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            torch.save(dict(state, meta=meta), f)
            f.flush()
            os.fsync(f.fileno())
    try:
        write_atomic(out, write)  # never a half-written file
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        raise SystemExit(f"error: cannot write {out}: {e}") from None
    print(f"wrote {out} ({size_str(out.stat().st_size)}): {' and '.join(names)} of {run_dir} at step {step}")
    return out


if __name__ == "__main__":
    main()
