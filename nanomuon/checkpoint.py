"""
Checkpoints: <run dir>/step_000123/ holds a torch.distributed.checkpoint (DCP) of the model and
optimizer tensors, each rank writing its pieces and any process count reading them resharded, and
from rank 0 optim.pt, meta.json and checksums.json (CRC-32s). It is written into a hidden
directory, fsynced, then renamed (or swapped in one rename), so a step_* directory is always whole.
All that is loaded is untrusted: DCP's index is unpickled with an allowlist (read_index).
"""

import argparse
import contextlib
import ctypes
import errno
import json
import logging
import math
import os
import pickle
import re
import shutil
import warnings
import zipfile
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from nanomuon.common import (
    DTYPES,
    causes,
    check_regular,
    exit_unless_ranks_agree,
    filled,
    fsync_path,
    load_json,
    on_every_rank,
    one_line,
    read_regular,
    shown,
    size_str,
    what_filled,
    write_atomic,
)
from nanomuon.gpt import GPT, GPTConfig
from nanomuon.param_groups import DamagedState
from nanomuon.run import CHECKPOINT_FILES, DATA_FILE, aside_steps, check_links, list_steps, step_dir

_LIBC = ctypes.CDLL(None, use_errno=True)
# libc's atomic exchange of two paths (renameat2 on Linux, -100 being AT_FDCWD; renamex_np on
# macOS), or None
SWAP = ((lambda a, b: _LIBC.renameat2(-100, a, -100, b, 2)) if hasattr(_LIBC, "renameat2")
        else (lambda a, b: _LIBC.renamex_np(a, b, 2)) if hasattr(_LIBC, "renamex_np") else None)


def _swap(a: Path, b: Path) -> bool:
    """Exchange two directories atomically; False where the OS or the filesystem cannot."""
    if SWAP is not None and SWAP(os.fsencode(a), os.fsencode(b)) == 0:
        return True
    err = errno.ENOSYS if SWAP is None else ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a))


# All a DCP index (.metadata) of tensors unpickles to: DCP's own reader calls plain pickle.load
_DCP_META = "torch.distributed.checkpoint.metadata"
METADATA_CLASSES = {(_DCP_META, name) for name in (
    "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_CLASSES or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, which no checkpoint index of "
                                     "tensors holds")


def read_index(d: Path):
    """d/.metadata unpickled by METADATA_CLASSES: tensors only, in d's data files, or ValueError."""
    path = check_regular(Path(d) / ".metadata")
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError,
            IndexError) as e:
        raise ValueError(f"{path} is not a checkpoint index nanomuon loads ({one_line(e)}): "
                         "a tampered or foreign checkpoint") from None
    problems = []
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        problems.append(f"it holds a {type(md).__name__}")
    else:
        problems += [f"{k!r} is a {type(v).__name__}, not a tensor" for k, v in
                     md.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)][:1]
        problems += [f"a piece is stored in {getattr(v, 'relative_path', v)!r}"
                     for v in md.storage_data.values()
                     if not (isinstance(v, _StorageInfo) and DATA_FILE.match(str(v.relative_path))
                             and not v.transform_descriptors)][:1]
    if problems:
        raise ValueError(f"{path} is not a checkpoint index nanomuon loads ({problems[0]}): "
                         "a tampered or foreign checkpoint")
    return md


class SafeReader(dcp.FileSystemReader):
    """DCP's FileSystemReader, reading its index through read_index."""

    def read_metadata(self, *args, **kwargs):
        md = read_index(Path(self.path))  # a Metadata, whose storage_meta defaults to None
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def alone() -> bool:
    """Whether this process runs without torch.distributed (DCP then reads and writes alone)."""
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _full_disk_kept():
    """Re-raise a full disk as that OSError: DCP's pickling drops it from the context."""
    try:
        yield
    except Exception as e:
        if getattr(e, "errno", None) is None and (code := filled(e)):
            raise OSError(code, os.strerror(code)) from e
        raise


class SafeWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter, whose full disk is still one when another rank reports it."""

    write_data = _full_disk_kept()(dcp.FileSystemWriter.write_data)
    finish = _full_disk_kept()(dcp.FileSystemWriter.finish)


def _no_index_logs(record: logging.LogRecord) -> bool:
    """False for DCP's tracebacks of an index it cannot read: the error raised next says so."""
    msg = str(record.msg)
    return "metadata is not found" not in msg and "metadata is not None" not in msg


def _dcp(fn, tensors: dict, d: Path, no_dist: bool):
    """dcp.save or dcp.load of tensors at d, without DCP's one-process warning."""
    io = dict(storage_writer=SafeWriter(d, sync_files=True)) if fn is dcp.save else \
        dict(storage_reader=SafeReader(d))
    # A logger's filter sees only records logged on it, so DCP's own logger gets one too.
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in list(
        logging.root.manager.loggerDict) if name.endswith("dcp_logger")]
    with warnings.catch_warnings(), contextlib.ExitStack() as filtered:
        warnings.filterwarnings("ignore", "torch.distributed is .*unavailable or uninitialized")
        for logger in loggers:
            logger.addFilter(_no_index_logs)
            filtered.callback(logger.removeFilter, _no_index_logs)
        return fn(tensors, no_dist=no_dist, **io)


def state_of(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """(tensors, files) for save_checkpoint: this rank's pieces, and optim.pt (with DTensor Muon
    params planned, a collective)."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    if not hasattr(optimizer, "sharded_state_dict"):
        return tensors, dict(optim=optimizer.state_dict())
    optim_tensors, rest = optimizer.sharded_state_dict()
    return {**tensors, **{f"optim.{k}": v for k, v in optim_tensors.items()}}, dict(optim=rest)


def _failure(e: BaseException) -> tuple[BaseException, str]:
    """(the error, it in one line); of a DCP CheckpointException, its first rank's."""
    if isinstance(e, dcp.api.CheckpointException) and e.failures:
        rank, (first, _) = next(iter(e.failures.items()))
        return first, f"{one_line(first)} (rank {rank})"
    return e, one_line(e)


def file_crc32(path: Path) -> str:
    """A file's CRC-32 as 8 hex digits: fast, and enough to catch bytes changed on disk."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


CRC = re.compile(r"^[0-9a-f]{8}$")
SUMS_MAX = 1 << 20  # bytes: ours list a few files in under 1 KB
META_BYTES = 1 << 26  # a meta.json holds the config, flags and loop state: kilobytes


def _finish(run_dir: Path, tmp: Path, final: Path, meta: dict | None, files: dict | None) -> None:
    """Rank 0's part of a save: files, checksums, meta.json, fsynced; tmp renamed into place."""
    for name, obj in (files or {}).items():
        with open(tmp / f"{name}.pt", "wb") as f:  # torch.save keeps a file's OSError as context
            torch.save(obj, f)
    sums = {f.name: file_crc32(f) for f in sorted(tmp.iterdir())}
    (tmp / "checksums.json").write_text(json.dumps(dict(crc32=sums), indent=1))
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    for f in [*tmp.iterdir(), tmp]:  # the files, then the directory's entries
        fsync_path(f)
    if not final.exists():
        os.replace(tmp, final)
    elif _swap(tmp, final):  # a re-save: tmp now holds the old one
        shutil.rmtree(tmp, ignore_errors=True)
    else:  # a kill between these two renames leaves the old one, which clean_run_dir puts back
        old = run_dir / f".tmp_old_{final.name}_{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    fsync_path(run_dir)


def save_checkpoint(run_dir: Path, step: int, tensors: dict, meta: dict | None,
                    files: dict | None = None) -> Path:
    """Write step_NNNNNN atomically: every rank's tensors through DCP, rank 0's meta and files
    (name -> object). A collective: all return, or all raise one OSError or KeyboardInterrupt."""
    run_dir = Path(run_dir)
    final = step_dir(run_dir, step)
    tmp = run_dir / f".tmp_{final.name}"  # one name on every rank: all write into it
    rank0, error = alone() or dist.get_rank() == 0, None
    try:  # every rank's files fsynced, then .metadata; raises on all ranks
        _dcp(dcp.save, tensors, tmp, alone())
    except (OSError, RuntimeError, dcp.api.CheckpointException, KeyboardInterrupt) as e:
        error = e
    if rank0 and error is None:
        try:
            _finish(run_dir, tmp, final, meta, files)
        # torch.save reports a full disk as a RuntimeError
        except (OSError, RuntimeError, KeyboardInterrupt) as e:
            error = e
    if rank0 and error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    interrupted = error and any(isinstance(c, KeyboardInterrupt) for c in causes(error))
    outcome = [error and (interrupted, filled(error), _failure(error)[1])]
    # rank 0 knows every rank's DCP outcome, and its own part: all return or raise alike
    if not alone():
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] and outcome[0][0]:  # the caller's Ctrl-C handling says where to resume from
        raise KeyboardInterrupt
    if not outcome[0]:
        return final
    kept = [s for s in list_steps(run_dir) if s != step]
    then = ("then resume with --resume-from-step latest" if kept else
            "then start the run again (there is nothing to resume from)")
    kept = f"the checkpoint of step {kept[-1]} is kept" if kept else "there is no earlier checkpoint"
    if code := outcome[0][1]:
        what, fix = what_filled(code, run_dir)
        raise OSError(code, f"{what} while saving step {step}; {kept}: {fix}, {then}")
    raise OSError(errno.EIO, f"cannot save step {step} in {run_dir}: {outcome[0][2]}; {kept}")


def record_loop(run_dir: Path, step: int, loop: dict) -> None:
    """Put the loop state into a saved step's meta.json (an eval after the save is then in it)."""
    d = step_dir(run_dir, step)
    write_atomic(d / "meta.json", json.dumps(dict(read_meta(d), loop=loop), indent=1))


def prune_checkpoints(run_dir: Path, keep: int) -> list[str]:
    """Delete all but the `keep` newest checkpoints, each renamed aside first; a line for each."""
    run_dir, done = Path(run_dir), []
    for s in list_steps(run_dir)[:-keep] if keep > 0 else []:
        doomed = run_dir / f".tmp_pruned_{step_dir(run_dir, s).name}"
        os.replace(step_dir(run_dir, s), doomed)
        shutil.rmtree(doomed)
        done.append(f"removed the checkpoint of step {s} (--keep-checkpoints {keep})")
    if done:
        fsync_path(run_dir)
    return done


def step_arg(s: str, words=("latest",)):
    """argparse type for a checkpoint step: a number or one of `words`."""
    if s in words:
        return s
    try:
        return int(s)
    except ValueError:
        expected = ", ".join(["a step number", *map(repr, words[:-1])]) + f" or {words[-1]!r}"
        raise argparse.ArgumentTypeError(f"expected {expected}, got {s!r}") from None


META_TYPES = dict(step=int, num_iterations=int, model_config=dict, args=dict, tokenizer=str,
                  world_size=int, loader=list, loop=dict)


def _num(v, lo=-math.inf, hi=math.inf) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and lo <= v <= hi)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _value(v) -> bool:
    """A loss or a bpb: a finite number, or (--seeds) a list of them, one per seed."""
    return _num(v) or (isinstance(v, list) and len(v) > 0 and all(_num(x) for x in v))


def _pairs(v) -> bool:
    return isinstance(v, list) and all(
        isinstance(x, list) and len(x) == 2 and _count(x[0]) and _value(x[1]) for x in v)


SECONDS = 1e9  # 31 years: more time than any run trains
# meta.json's loop state, field -> (check, what it must be): a resume reads each into the lines,
# summary and report at the end of the run, hours after the load
LOOP_FIELDS = dict(
    smooth_loss=(_value, "a finite number (with --seeds, a list of them)"),
    train_time=(lambda v: _num(v, 0, SECONDS), f"a number of seconds in [0, {SECONDS:g}]"),
    history=(_pairs, "a list of [step, train loss] pairs"),
    val_history=(_pairs, "a list of [step, val bpb] pairs"),
    **dict.fromkeys(("val_train_time", "step_times", "optim_times"),
                    (lambda v: isinstance(v, list) and all(_num(x, 0, SECONDS) for x in v),
                     f"a list of numbers of seconds in [0, {SECONDS:g}]")),
    **dict.fromkeys(("skipped_steps", "nonfinite_in_a_row", "qk_clipped"),
                    (_count, "an int >= 0")),
    final_eval=(lambda v: isinstance(v, list) and len(v) == 2 and _count(v[0]) and _value(v[1]),
                "[val tokens scored, val bpb]"))


def check_meta(meta, d: Path, keys) -> None:
    """A meta.json has the keys asked for, with the right types (it is text: hand edits happen)."""
    problems = []
    for key in keys:
        want = META_TYPES[key]
        if key not in meta:
            problems.append(f"no {key!r}")
        elif not isinstance(meta[key], want) or isinstance(meta[key], bool):
            problems.append(f"{key!r} is {shown(meta[key], 80)}, "
                            f"not a{'n' if want is int else ''} {want.__name__}")
    if not problems and "model_config" in keys:
        try:
            GPTConfig(**meta["model_config"])
        except (TypeError, ValueError) as e:  # echoes the hand-edited values
            problems.append(f"model_config: {shown(str(e), 400, quote=False)}")
    if not problems and "step" in keys and meta["step"] != int(d.name[len("step_"):]):
        problems.append(f"'step' is {meta['step']}, the directory says {d.name}")
    if (not problems and {"loader", "world_size"} <= set(keys)
            and len(meta["loader"]) != meta["world_size"]):
        problems.append(f"{len(meta['loader'])} loader states for world_size {meta['world_size']}")
    if not problems and "loader" in keys:
        problems += [f"loader[{i}] is a{'n' * (type(s).__name__[0] in 'aeiou')} "
                     f"{type(s).__name__}, not a dict" for i, s in enumerate(meta["loader"])
                     if not isinstance(s, dict)][:1]
    if not problems and isinstance(args := meta.get("args"), dict):  # base_eval and sample read
        if args.get("dtype", DTYPES[0]) not in DTYPES:
            problems.append(f"'args.dtype' is {shown(args['dtype'], 80)}, not one of {', '.join(DTYPES)}")
        if not (_count(tokens := args.get("eval_tokens", 1)) and tokens >= 1):
            problems.append(f"'args.eval_tokens' is {shown(tokens, 80)}, not an int >= 1")
    if not problems and "loop" in keys:  # a NaN here would be carried into every later line
        loop = meta["loop"]
        problems += [f"'loop.{k}' is {shown(repr(loop[k]), 80, quote=False)}, not {what}"
                     for k, (ok, what) in LOOP_FIELDS.items() if k in loop and not ok(loop[k])][:1]
    if problems:
        raise ValueError(f"{d / 'meta.json'} is not a valid checkpoint meta.json "
                         f"({'; '.join(problems)}); restore it, or delete {d} and resume from an "
                         "earlier step")


def read_meta(d: Path, meta_keys=()) -> dict:
    """A checkpoint's meta.json, checked for meta_keys; ValueError with the way out if bad."""
    try:
        meta = load_json(d / "meta.json", META_BYTES)
    except (OSError, ValueError) as e:  # load_json: nested too deep is a ValueError too
        raise ValueError(f"checkpoint {d} has an unreadable meta.json ({e}); delete {d} and resume "
                         "from an earlier step") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{d / 'meta.json'} holds a {type(meta).__name__}, not a checkpoint's "
                         f"meta.json; delete {d} and resume from an earlier step")
    check_meta(meta, d, meta_keys)
    return meta


# base_train's flag -> the GPTConfig field it sets (head_dim: n_embd // n_head)
MODEL_FLAGS = {"--arch": "arch", "--window-pattern": "window_pattern", "--depth": "n_layer",
               "--max-seq-len": "sequence_len", "--head-dim": "head_dim", "--qk-norm": "qk_norm",
               "--aspect-ratio (the width)": "n_embd"}


def model_changes(saved: dict, built: dict) -> list[str]:
    """How the flags' model differs from a checkpoint's (two GPTConfig dicts), as '--arch was
    'nanochat', now 'classic''; the fields no flag sets (softcap, rope_base, ...) by name."""
    saved, built = ({**c, "head_dim": c["n_embd"] // c["n_head"]} for c in (saved, built))
    return [f"{flag} was {shown(saved[k], 60)}, now {shown(built[k], 60)}"  # bounded: hand edits
            for flag, k in MODEL_FLAGS.items() if saved[k] != built[k]] or [
        f"the model's {k} was {shown(saved[k], 60)}, these flags build {shown(built[k], 60)}"
        for k in built if saved[k] != built[k]]


def _corrupt(d: Path, e: BaseException) -> ValueError:
    """A checkpoint that does not read: delete it if its files are bad, not if the machine is."""
    first, line = _failure(e)
    if not Path(d).exists():
        return ValueError(f"checkpoint {d} was removed while it was read: the run saving there "
                          "prunes its older checkpoints (--keep-checkpoints); load a newer step")
    if isinstance(first, (MemoryError, torch.OutOfMemoryError)) or (
            isinstance(first, OSError) and not isinstance(first, FileNotFoundError)):
        return ValueError(f"cannot read checkpoint {d} ({line}); fix that and run again")
    return ValueError(f"checkpoint {d} is incomplete or corrupt ({line}); delete {d} and "
                      "resume from an earlier step")


def read_optim(d: Path, **kwargs):
    """d/optim.pt by torch's safe loader; what it refuses is a ValueError in nanomuon's words."""
    path = check_regular(d / "optim.pt")
    if not zipfile.is_zipfile(path):
        raise ValueError("optim.pt is not a zip archive, as every one nanomuon saves is (its bytes "
                         "are damaged, or it is another file)")
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError:
        raise ValueError("optim.pt holds what the safe loader refuses: more than tensors and plain "
                         "values, or a damaged pickle") from None
    except (OSError, MemoryError, torch.OutOfMemoryError):
        raise  # the machine's trouble, not the file's: _corrupt tells them apart
    except Exception as e:  # torch raises several types for a damaged archive
        raise ValueError(f"optim.pt does not load ({one_line(e)})") from None


def _saved_tensors(d: Path) -> dict:
    """name -> (shape, dtype) of every tensor in a sharded checkpoint (its DCP .metadata)."""
    md = read_index(d).state_dict_metadata
    return {k: (tuple(m.size), m.properties.dtype) for k, m in md.items() if hasattr(m, "chunks")}


def check_files(d: Path) -> list[str]:
    """A checkpoint's files are there, long enough for its index, with the CRCs checksums.json
    gives; returns those it does not vouch for (all, without one; never meta.json)."""
    try:
        for info in read_index(d).storage_data.values():  # every piece inside its file
            name, end = info.relative_path, info.offset + info.length
            if (size := (d / name).stat().st_size) < end:
                raise ValueError(f"{name} is {size} bytes, its index says at least {end}")
        read_optim(d, mmap=True)
        files = sorted(f.name for f in d.iterdir() if f.name not in ("checksums.json", "meta.json"))
        listed = d / "checksums.json"
        if not os.path.lexists(listed):
            return files
        if check_regular(listed).stat().st_size > SUMS_MAX:
            raise ValueError(f"checksums.json is {size_str(listed.stat().st_size)}, not the few "
                             "lines nanomuon writes")
        sums = json.loads(read_regular(listed, SUMS_MAX).decode(errors="replace"))
        if not isinstance(sums := sums.get("crc32") if isinstance(sums, dict) else None, dict):
            raise ValueError("checksums.json holds no map of file names to CRC-32s")
        for name, crc in sums.items():
            if not (DATA_FILE.match(name) or name in CHECKPOINT_FILES):
                raise ValueError(f"checksums.json names {shown(name, 80)}, not a checkpoint file")
            if not (isinstance(crc, str) and CRC.match(crc)):
                raise ValueError(f"checksums.json gives {name} the CRC-32 "
                                 f"{shown(repr(crc), 80, quote=False)}, not 8 hex digits")
        if unsummed := [name for name in files if DATA_FILE.match(name) and name not in sums]:
            raise ValueError(f"{unsummed[0]} is not in checksums.json")
        for name, crc in sums.items():
            if (now := file_crc32(d / name)) != crc:
                raise ValueError(f"{name} has CRC-32 {now}, {crc} when it was saved "
                                 "(its bytes changed on disk)")
        return [name for name in files if name not in sums]
    except Exception as e:  # torch and pickle raise several types for truncated or foreign files
        raise _corrupt(d, e) from e


class Unusable(ValueError):
    """A checkpoint that reads, but holds what no run saves: refused as it is, not as corrupt."""


def _unusable(d: Path, what: str) -> Unusable:
    """Unusable for step dir d, with the way back: the steps saved before it, or none."""
    earlier = [s for s in list_steps(d.parent) if s < int(d.name[len("step_"):])]
    way = (f"load an earlier step instead (saved: {', '.join(map(str, earlier[-5:]))})"
           if earlier else "no earlier step is saved: start the run afresh")
    return Unusable(f"checkpoint {d}: {what}; {way}")


def _check_values(d: Path, tensors: dict, collective: bool = False) -> None:
    """Refuse a step whose tensors hold NaN or inf (collective: on every rank if on any)."""
    found = next((k for k, v in tensors.items() if v.is_floating_point() and not bool(
        torch.isfinite(v.to_local() if hasattr(v, "to_local") else v).all())), None)
    if collective:
        device = next((v.device for v in tensors.values()), "cpu")
        flag = torch.tensor([found is not None], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        found = found or ("a tensor another process holds" if flag.item() else None)
    if found is not None:
        raise _unusable(d, f"{shown(found, 120, quote=False)} holds NaN or infinite values (a "
                        "diverged or damaged step; every step from it would be too)")


def _check_dtypes(d: Path, saved: dict, want) -> None:
    """Refuse a tensor whose dtype want(name, dtype) names (a load would cast it in silence)."""
    for name, (_, dtype) in saved.items():
        if (should := want(name, dtype)) is not None:
            raise _unusable(d, f"{shown(name, 120, quote=False)} is saved as {dtype}, where "
                            f"nanomuon saves {should} (a tampered or foreign checkpoint)")


def load_checkpoint(run_dir: Path, step: int, names: tuple[str, ...] = ("model",)):
    """({name: object}, meta) of a saved step read whole by this process ('model', 'optim'), on
    the CPU."""
    d = step_dir(run_dir, step)
    meta, out = read_meta(d), {}
    try:
        saved = _saved_tensors(d)
        _check_dtypes(d, saved, lambda _, dtype: None if dtype.is_floating_point else "floats")
        wanted = {k: torch.empty(shape, dtype=dtype, device="cpu")
                  for k, (shape, dtype) in saved.items() if k.split(".", 1)[0] in names}
        _dcp(dcp.load, wanted, d, no_dist=True)
        _check_values(d, wanted)
        if "model" in names:
            out["model"] = {k.split(".", 1)[1]: v
                            for k, v in wanted.items() if k.startswith("model.")}
        if "optim" in names:
            out["optim"] = read_optim(d, map_location="cpu")
            for key, v in wanted.items():
                if key.startswith("optim."):
                    _, idx, name = key.split(".", 2)
                    out["optim"]["state"].setdefault(int(idx), {})[name] = v
    except Unusable:
        raise
    except (Exception, dcp.api.CheckpointException) as e:
        raise _corrupt(d, e) from e
    return out, meta


def load_into(run_dir: Path, step: int, model: torch.nn.Module, optimizer=None) -> None:
    """Restore a checkpoint into model (and optimizer): a collective; ValueError on a misfit."""
    d = step_dir(run_dir, step)
    saved = _saved_tensors(d)
    own = {f"model.{k}": v for k, v in model.state_dict().items()}
    theirs = {k: shape for k, (shape, _) in saved.items() if k.startswith("model.")}
    if (mine := {k: tuple(v.shape) for k, v in own.items()}) != theirs:
        diff = sorted(set(mine.items()) ^ set(theirs.items()))[:4]
        raise ValueError(f"checkpoint {d} holds another model: these (name, shape) are in one "
                         f"but not the other: {shown(str(diff), 300, quote=False)}")
    _check_dtypes(d, {k: v for k, v in saved.items() if k in own},
                  lambda k, dtype: None if dtype == own[k].dtype else own[k].dtype)
    try:
        _dcp(dcp.load, own, d, alone())
        _check_values(d, own, collective=not alone())
        if optimizer is None:
            return
        rest = read_optim(d, map_location=next(model.parameters()).device)
        if not hasattr(optimizer, "load_sharded_state_dict"):  # replicated: its whole state
            return optimizer.load_state_dict(rest)
        shapes = {k.split(".", 1)[1]: v for k, v in saved.items() if k.startswith("optim.")}
        optimizer.load_sharded_state_dict(shapes, rest, lambda targets: _dcp(
            dcp.load, {f"optim.{k}": v for k, v in targets.items()}, d, alone()))
    except DamagedState as e:
        raise _unusable(d, str(e)) from None
    except dcp.api.CheckpointException as e:
        raise _corrupt(d, e) from None


def load_step(run_dir: Path, step: str | int, meta_keys=(), warn=print) -> tuple[int, dict]:
    """A step number or 'latest' (the newest that checks out, warn()ing of others): (step, meta)."""
    check_links(run_dir)
    steps = list_steps(run_dir)
    if not steps:
        raise FileNotFoundError(f"no checkpoints in {run_dir}" + (aside_steps(run_dir) or (
            "; check --run (and NANOMUON_BASE_DIR), or train one with "
            "`python -m scripts.base_train`")))

    def checked(s):
        d = step_dir(run_dir, s)
        meta, unverified = read_meta(d, meta_keys), check_files(d)
        if not (d / "checksums.json").is_file():  # deleted, or saved before checksums
            warn(f"note: {d} has no checksums.json: its files load unverified")
        elif unverified:  # a list that leaves files out vouches for them no more than none
            names = [shown(n, 60, quote=False) for n in unverified[:4]]
            more = f" and {len(unverified) - 4} more" if len(unverified) > 4 else ""
            warn(f"note: {d}/checksums.json does not list "
                 f"{', '.join(names)}{more}: they load unverified")
        return s, meta
    if step != "latest":
        if int(step) not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {run_dir}; saved steps: "
                                    f"{', '.join(map(str, steps))}")
        return checked(int(step))
    tried = set()
    # newest first, listed again after each miss: a live run may save new steps and prune old ones
    while untried := [s for s in list_steps(run_dir) if s not in tried]:
        s = untried[-1]
        tried.add(s)
        try:
            return checked(s)
        except ValueError as e:
            warn(f"note: step {s} was removed by the run saving there (it prunes older "
                 "checkpoints) while it was read; trying the newest one left"
                 if not step_dir(run_dir, s).exists() else
                 f"warning: step {s} does not load, trying the checkpoint before it: {e}")
    raise ValueError(f"none of the {len(tried)} checkpoints in {run_dir} loads (each is named "
                     "above); start the run afresh")


def load_model(run_dir: Path, step: str | int, device):
    """(the GPT a checkpoint was trained as, with its weights, meta); a collective."""
    asked = step
    for _ in range(3):  # 'latest' pruned by a live run between its check and read: try the next
        step, meta = on_every_rank(lambda: load_step(run_dir, asked, ("model_config",)))
        exit_unless_ranks_agree(step, f"the checkpoint steps picked in {run_dir}",
                                "run again when no run saves there")
        if isinstance(seeds := meta.get("args", {}).get("seeds"), list):
            raise ValueError(f"{run_dir} holds {len(seeds)} seeds trained as one batched model "
                             "(base_train --seeds), and this reads one model: train the seed you "
                             "want alone (base_train --seed N)")
        with torch.device(device):
            model = GPT(GPTConfig(**meta["model_config"]))
        model.init_weights()  # fills the rotary tables; weights are overwritten next
        try:
            load_into(run_dir, step, model)
            break
        except (ValueError, FileNotFoundError):
            if asked != "latest" or step_dir(run_dir, step).exists():
                raise
            print(f"note: step {step} was removed by the run saving there while it was read; "
                  "loading the newest one left")
    else:
        raise ValueError(f"the newest checkpoint in {run_dir} was pruned three times while it was "
                         "read: load a step by number, or when the run there has stopped")
    model.eval()
    return model, meta
