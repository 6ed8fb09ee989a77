"""
Checkpoints: one directory per step, written atomically and validated on load.

Layout: <run dir>/step_000123/{model.pt, optim.pt, meta.json}. The files are written into a hidden
temporary directory, fsynced, and only then renamed into place, so a crash or a kill at any moment
leaves either the complete checkpoint or none: a directory named step_* is always whole. optim.pt is
the world-size-independent optimizer state (MuonAdamW.state_dict() format), so any process count can
load it. meta.json holds everything else a resume needs (config, loop and data loader state) as text.
"""

import argparse
import json
import os
import re
import shutil
from pathlib import Path

import torch

STEP_DIR = re.compile(r"^step_(\d{6,})$")


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"step_{step:06d}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, step: int, tensors: dict, meta: dict) -> Path:
    """Write tensors[name] to name.pt and meta to meta.json under run_dir/step_NNNNNN, atomically."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob(".tmp_step_*"):  # left by a run killed mid-save; never a valid checkpoint
        shutil.rmtree(stale, ignore_errors=True)
    final = step_dir(run_dir, step)
    tmp = run_dir / f".tmp_{final.name}_{os.getpid()}"
    tmp.mkdir()
    for name, obj in tensors.items():
        torch.save(obj, tmp / f"{name}.pt")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    if final.exists():  # re-saving a step (a resumed run reaching it again): swap, then drop the old one
        old = run_dir / f".tmp_old_{final.name}_{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync(run_dir)
    return final


def list_steps(run_dir: Path) -> list[int]:
    """Steps with a complete checkpoint in run_dir, ascending."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for d in run_dir.iterdir() if (m := STEP_DIR.match(d.name)) and d.is_dir())


def run_arg(s: str) -> str:
    """argparse type for a run name: it names a directory under runs/, so nothing that walks out of it."""
    if not s.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise argparse.ArgumentTypeError(f"{s!r}: use letters, digits, '-', '_' and '.' only (it names a directory "
                                         "under runs/)")
    return s


def step_arg(s: str):
    """argparse type for a checkpoint step: a number or 'latest'."""
    if s == "latest":
        return s
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number or 'latest', got {s!r}") from None


def resolve_step(run_dir: Path, step: str | int) -> int:
    """'latest' or a step number -> a step that has a checkpoint; a clear error otherwise."""
    steps = list_steps(run_dir)
    if not steps:
        raise FileNotFoundError(f"no checkpoints in {run_dir}; check --run (and NANOMUON_BASE_DIR), or train "
                                "one with `python -m scripts.base_train`")
    if step == "latest":
        return steps[-1]
    if int(step) not in steps:
        raise FileNotFoundError(f"no checkpoint for step {step} in {run_dir}; saved steps: "
                                f"{', '.join(map(str, steps))}")
    return int(step)


def load_checkpoint(run_dir: Path, step: int, names: tuple[str, ...] = ("model",), map_location="cpu"):
    """Return ({name: object}, meta) for a saved step; unreadable files raise with the way out."""
    d = step_dir(run_dir, step)
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {d} has an unreadable meta.json ({e}); delete {d} and resume from an "
                         "earlier step") from e
    out = {}
    for name in names:
        path = d / f"{name}.pt"
        try:
            out[name] = torch.load(path, map_location=map_location, weights_only=True)
        except Exception as e:  # torch raises several types for truncated or foreign files
            raise ValueError(f"checkpoint file {path} is unreadable or corrupt ({type(e).__name__}: {e}); delete "
                             f"{d} and resume from an earlier step") from e
    return out, meta


def load_model(run_dir: Path, step: str | int, device):
    """Rebuild the GPT a checkpoint was trained as and load its weights. Returns (model, meta)."""
    from nanomuon.gpt import GPT, GPTConfig

    step = resolve_step(run_dir, step)
    objs, meta = load_checkpoint(run_dir, step, ("model",), map_location=device)
    with torch.device(device):
        model = GPT(GPTConfig(**meta["model_config"]))
    model.init_weights()  # fills the rotary tables; weights are overwritten next
    model.load_state_dict(objs["model"])
    model.eval()
    return model, meta
