"""
A run's directory, runs/<run>/, but for the inside of a checkpoint: its names and what an
interrupted write leaves (clean_run_dir), its lock (lock_run_dir), earlier runs (refused, or set
aside into previous.N or rewound_from_step_S.N), report.md and summary.json (base_train's, with
the parts other WRITERS add), and the step record that ablate reads.
"""

import argparse
import contextlib
import fcntl
import itertools
import json
import os
import re
import shutil
import socket
import stat
import sys
import time
from pathlib import Path
from typing import NamedTuple

from nanomuon.common import (
    check_regular,
    exit_if_any_failed,
    exit_unless_ranks_agree,
    fsync_path,
    load_json,
    one_line,
    print0,
    read_regular,
    shown,
    size_str,
    user_errors,
    write_atomic,
)

# -- what a run dir holds -------------------------------------------------------------------------

STEP_DIR = re.compile(r"^step_(\d{6,})$")  # a checkpoint: checkpoint.py writes what is inside
# what a checkpoint's directory holds: DCP's data files and these
DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")
CHECKPOINT_FILES = {".metadata", ".metadata.tmp", "optim.pt", "meta.json", "checksums.json"}
RUN_FILES = ("report.md", "summary.json", "curves.png", ".lock")  # what runs write beside them
# What a killed save leaves: a checkpoint being written (.tmp_step_N), replaced
# (.tmp_old_step_N_PID) or pruned (.tmp_pruned_step_N), and write_atomic's temporary files
SAVE_LEFTOVER = re.compile(r"^\.tmp_(old_|pruned_)?(step_\d{6,})(_\d+)?$")
ATOMIC_LEFTOVER = re.compile(r"^(report\.md|summary\.json|curves\.png|\.lock)\.\d+\.tmp$")


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"step_{step:06d}"


def _entries(run_dir: Path) -> list[Path]:
    """What run_dir holds, sorted by name; nothing if it is no directory (yet)."""
    return sorted(Path(run_dir).iterdir()) if Path(run_dir).is_dir() else []


def list_steps(run_dir: Path) -> list[int]:
    """Steps with a complete checkpoint in run_dir, ascending."""
    return sorted(int(m.group(1)) for d in _entries(run_dir)
                  if (m := STEP_DIR.match(d.name)) and d.is_dir() and not d.is_symlink())


def _looks_like_checkpoint(d: Path) -> bool:
    """A real directory holding nothing but what save_checkpoint writes."""
    return not d.is_symlink() and d.is_dir() and all(
        (f.name in CHECKPOINT_FILES or DATA_FILE.match(f.name)) and not f.is_symlink()
        and f.is_file() for f in d.iterdir())


def check_links(run_dir: Path) -> None:
    """ValueError naming a symlink where a run reads or writes its own files, and the way out."""
    run_dir = Path(run_dir)
    if run_dir.is_symlink():
        raise ValueError(f"{run_dir} is a symlink (to {os.readlink(run_dir)}); a run dir must be "
                         "a directory of its own: remove the link, or move the directory there")
    for p in _entries(run_dir):
        ours = p.name in RUN_FILES or STEP_DIR.match(p.name)  # a leftover's link: clean_run_dir's
        inner = ([f for f in p.iterdir() if f.is_symlink()]
                 if STEP_DIR.match(p.name) and p.is_dir() else [])
        link = p if p.is_symlink() and ours else (inner[0] if inner else None)
        if link is not None:
            raise ValueError(f"{link} is a symlink (to {os.readlink(link)}); nanomuon reads and "
                             "writes only real files in a run dir: replace it with a copy (cp -L), "
                             f"or remove it")


def clean_run_dir(run_dir: Path) -> list[str]:
    """Clear what an interrupted save left, by our exact names only; one line per thing done."""
    run_dir, done = Path(run_dir), []
    for d in _entries(run_dir):
        m = SAVE_LEFTOVER.match(d.name)
        if m and m.group(1) == "old_" and not step_dir(run_dir, int(m.group(2)[5:])).exists() \
                and _looks_like_checkpoint(d):
            os.replace(d, run_dir / m.group(2))
            done.append(f"restored {m.group(2)} from {d.name} (a re-save was interrupted)")
        elif m and (_looks_like_checkpoint(d) or d.is_symlink()):
            size = 0 if d.is_symlink() else sum(f.stat().st_size for f in d.iterdir())
            d.unlink() if d.is_symlink() else shutil.rmtree(d)
            done.append(f"removed {d.name} ({size_str(size)}) left by an interrupted save")
        elif ATOMIC_LEFTOVER.match(d.name) and (d.is_symlink() or d.is_file()):
            d.unlink()
            done.append(f"removed {d.name} left by an interrupted write")
        elif (m := ASIDE.match(d.name)) and m.group(1) and d.is_dir() and not d.is_symlink():
            done.append(finish_set_aside(run_dir, d))
    return done


# -- earlier runs: kept, refused or set aside, never trained over -------------------------------

RESULTS = ("summary.json", "report.md", "curves.png")  # what a finished run leaves beside its steps
EXPORT = re.compile(r"^export_step_(\d{6,})\.pt$")  # scripts/export.py's file of one step
# set_aside's folders: previous.N (--start-over), rewound_from_step_S.N (a rewind); while it fills
# one, .tmp_<that name>, holding MOVING: the entries that go in
ASIDE = re.compile(r"^(\.tmp_)?((previous|rewound_from_step_\d+)\.(\d+))$")
MOVING = ".moving.json"
LIST_LEFTOVER = re.compile(re.escape(MOVING) + r"\.\d+\.tmp")  # write_atomic's, of MOVING


def exports(run_dir: Path) -> dict[int, str]:
    """step -> the name of its export_step_N.pt in run_dir."""
    return {int(m.group(1)): m.group(0) for p in _entries(run_dir) if (m := EXPORT.match(p.name))}


def _movable(name: str) -> bool:
    """Whether set_aside moves entries so named: steps, results, exports, wandb's and rewinds'."""
    m = ASIDE.match(name)
    return bool(STEP_DIR.match(name) or name in RESULTS or EXPORT.match(name) or name == "wandb"
                or (m and not m.group(1) and m.group(3) != "previous"))


def set_aside(run_dir: Path, names: list[str], tag: str) -> Path:
    """Move these entries of run_dir into a new run_dir/<tag>.<n> by way of .tmp_<tag>.<n>, whose
    list (MOVING) lets clean_run_dir finish a killed move; OSError, all put back."""
    run_dir = Path(run_dir)
    moving = next(run_dir / f".tmp_{tag}.{n}" for n in itertools.count(1) if not any(
        os.path.lexists(run_dir / f"{prefix}{tag}.{n}") for prefix in ("", ".tmp_")))
    try:
        moving.mkdir()
        write_atomic(moving / MOVING, json.dumps(names), sync=True)
        fsync_path(moving)
    except OSError as e:
        shutil.rmtree(moving, ignore_errors=True)
        raise OSError(e.errno, f"cannot create {moving} ({e.strerror}); nothing was moved: make "
                      f"{run_dir} writable and run again") from None
    return _fill_aside(run_dir, moving, names)


def _fill_aside(run_dir: Path, moving: Path, names: list[str]) -> Path:
    """set_aside's moves into `moving` (those not made yet), then its rename."""
    final = run_dir / moving.name[len(".tmp_"):]
    try:
        for name in names:
            if os.path.lexists(run_dir / name):
                os.replace(run_dir / name, moving / name)
        tag, n = final.name.rsplit(".", 1)  # a later n where one was made since the move began
        final = next(f for n in itertools.count(int(n))
                     if not os.path.lexists(f := run_dir / f"{tag}.{n}"))
        os.replace(moving, final)
    except OSError as e:  # put back what moved; what will not stays, listed, for the next start
        for name in names:
            with contextlib.suppress(OSError):
                if os.path.lexists(moving / name) and not os.path.lexists(run_dir / name):
                    os.replace(moving / name, run_dir / name)
        undone = f"what moved stays in {moving}: the next start tries again"
        if not any(os.path.lexists(moving / name) for name in names):
            shutil.rmtree(moving, ignore_errors=True)
            undone = f"all is back in {run_dir} as it was"
        raise OSError(e.errno, f"{e.filename} does not move into {final.name} ({e.strerror}); "
                      f"{undone}: make it movable (chattr -i, if lsattr shows it immutable) and "
                      "run again") from None
    (final / MOVING).unlink(missing_ok=True)
    fsync_path(run_dir)
    return final


def finish_set_aside(run_dir: Path, moving: Path) -> str:
    """Finish a set_aside stopped midway, or clear it if it holds no list; what was done."""
    try:
        names = load_json(moving / MOVING, 1 << 24, "the list of what a set-aside moves")
    except (OSError, ValueError):
        names = None
    if not (isinstance(names, list) and all(isinstance(n, str) and _movable(n) for n in names)):
        if any(not LIST_LEFTOVER.fullmatch(p.name) for p in moving.iterdir()):
            return f"note: left {moving} as it is: it holds no list of entries nanomuon wrote"
        shutil.rmtree(moving)
        return f"removed an empty {moving.name} left by a move that was stopped"
    try:
        final = _fill_aside(run_dir, moving, names)
    except OSError as e:
        raise ValueError(f"cannot finish a move of an earlier run that was stopped: "
                         f"{e.strerror}") from None
    return (f"finished moving the earlier run ({len(names)} entries) into {final}: the "
            "--start-over or rewind that moved it was stopped midway")


def earlier_run(run_dir: Path) -> list[str]:
    """What an earlier run left: checkpoints, results, exports (a result must be a regular file)."""
    run_dir = Path(run_dir)
    results = [check_regular(run_dir / name).name for name in RESULTS
               if os.path.lexists(run_dir / name)]
    return ([step_dir(run_dir, s).name for s in list_steps(run_dir)] + results
            + list(exports(run_dir).values()))


def held_by(run_dir: Path, earlier: list[str]) -> str:
    """What earlier_run found, for a line: the newest steps (three at most) and the results."""
    steps = list_steps(run_dir)
    return ", ".join(([f"steps {', '.join(map(str, steps[-3:]))}"] if steps else [])
                     + [name for name in earlier if not name.startswith("step_")])


# -- the lock: one run per directory ---------------------------------------------------------------

_LOCKS = {}  # run dir -> (its open directory fd, the holder line we wrote into .lock)


def lock_run_dir(run_dir: Path, other: str = "another --run") -> str | None:
    """Take the run dir's lock (a flock: never stale), or RuntimeError naming its holder."""
    run_dir, path = Path(run_dir), Path(run_dir) / ".lock"
    check_links(run_dir)
    while True:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = lock_holder(run_dir) or "another process"
            raise RuntimeError(f"{run_dir} is in use by {holder}; wait for that run to end "
                               f"(or stop it), or pick {other}") from None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(run_dir).st_ino == os.fstat(fd).st_ino:  # not removed by its last holder
                break
        os.close(fd)
    previous = lock_holder(run_dir)
    line = (f"pid {os.getpid()} on {socket.gethostname()} since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} ({' '.join(sys.argv)[:200]})")
    write_atomic(path, line + "\n", sync=True)  # a rename: never writes through a link
    fsync_path(run_dir)  # the other nodes read it
    _LOCKS[run_dir] = (fd, line)
    return (f"note: {path} was left by {previous}, which is no longer running; taking over"
            if previous else None)


def lock_holder(run_dir: Path) -> str:
    """Who .lock says holds run_dir, escaped and bounded (anyone may have written it); ''."""
    return shown(_lock_line(Path(run_dir) / ".lock"), 300, quote=False)


def _lock_line(path: Path) -> str:
    """.lock's line ('' if absent or not ours)."""
    return read_text(path, 1 << 16, quiet=(OSError, ValueError)).strip()


def unlock_run_dir(run_dir: Path) -> None:
    """Release this process's lock: .lock goes if it still names us, the run dir if empty."""
    fd, line = _LOCKS.pop(Path(run_dir), (None, None))
    if fd is None:
        return
    path = Path(run_dir) / ".lock"
    if _lock_line(path) == line:
        path.unlink(missing_ok=True)
    os.close(fd)
    with contextlib.suppress(OSError):
        Path(run_dir).rmdir()


def run_arg(s: str) -> str:
    """argparse type for a run name: a directory under runs/, nothing that walks out of it."""
    if len(s) > 200:
        raise argparse.ArgumentTypeError(f"{s[:20]!r}... is {len(s)} characters: a run name is at "
                                         "most 200 (it names a directory under runs/)")
    if not s.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise argparse.ArgumentTypeError(f"{s!r}: use letters, digits, '-', '_' and '.' only "
                                         "(it names a directory under runs/)")
    return s


def aside_steps(run_dir: Path) -> str:
    """The steps set_aside's folders hold and how to load one, for a line that finds none; ''."""
    held = sorted((int(m.group(4)), m.group(2), steps) for p in _entries(run_dir)
                  if (m := ASIDE.match(p.name)) and not m.group(1) and (steps := list_steps(p)))
    if not held:
        return ""
    said = [f"{name} holds step{'s' * (len(steps) > 1)} "
            + (", ".join(map(str, steps)) if len(steps) < 7 else
               f"{steps[0]}, ..., {steps[-1]} ({len(steps)})") for _, name, steps in held]
    newest = step_dir(Path(run_dir) / held[-1][1], held[-1][2][-1])
    return (f", but {'; '.join(said)} (set aside by --start-over or a rewind): move one back to "
            f"load it (mv {newest} {run_dir}/)")


# -- a run's start: the claim, a fresh start over an earlier run, a rewind, the disk --------------

def claim_run_dir(run_dir: Path, rank: int, held: contextlib.ExitStack) -> None:
    """Rank 0 locks and cleans the run dir (until `held` closes), every rank seeing it."""
    error = None
    if rank == 0:
        try:
            note = lock_run_dir(run_dir)
            held.callback(unlock_run_dir, run_dir)
            for line in filter(None, [note, *clean_run_dir(run_dir)]):
                print0(line)
        except (RuntimeError, ValueError) as e:  # in use; a symlink where the run writes
            error = str(e)
        except OSError as e:
            error = (f"cannot write to the run dir {run_dir} ({e.strerror}): point "
                     "NANOMUON_BASE_DIR at a writable directory")
    exit_if_any_failed(error)
    seen = lock_holder(run_dir) or f"no {run_dir / '.lock'}"
    exit_unless_ranks_agree(seen, f"the run dirs {run_dir} (their .lock files)",
                            "every process writes its part of each checkpoint into runs/<run>, so "
                            "put runs/ (or all of NANOMUON_BASE_DIR) on a filesystem every node "
                            "mounts (docs/training.md, 'Several nodes')")


def keep_earlier_runs(run_dir: Path, rank: int, fresh: bool, start_over: bool) -> None:
    """Refuse a fresh run over an earlier one, or with --start-over move it into previous.N."""
    error, earlier = None, []  # rank 0's, the others waiting for its word
    try:  # a result that is a FIFO would hang the end of any run
        earlier = earlier_run(run_dir) if rank == 0 else []
    except ValueError as e:
        error = str(e)
    if fresh and earlier and not start_over:
        error = (f"{run_dir} holds an earlier run ({held_by(run_dir, earlier)}): continue "
                 "it with --resume-from-step latest, pick another --run, or pass --start-over "
                 "to move it into previous.N and train afresh")
    elif fresh and earlier:
        try:
            # wandb's folder and rewinds' move with an earlier run, but alone are none
            earlier += sorted(p.name for p in Path(run_dir).iterdir() if _movable(p.name)
                              and (p.name == "wandb" or ASIDE.match(p.name)))
            aside = set_aside(run_dir, earlier, "previous")
            print0(f"--start-over: moved the earlier run ({len(earlier)} entries) into {aside}")
        except OSError as e:
            error = f"--start-over cannot move the earlier run aside: {e.strerror}"
    exit_if_any_failed(error)


def set_aside_later_steps(run_dir: Path, rank: int, step: int) -> None:
    """Resumed from an earlier step: later steps and their results move to rewound_from_step_S.N."""
    error = None
    if rank == 0:  # the others wait for its word
        try:
            later = [s for s in list_steps(run_dir) if s > step]
            exported = [name for s, name in exports(run_dir).items() if s > step]
            kept, later_lines, record, core, measured = results_after(run_dir, step)
            if later or exported or measured:
                names = [step_dir(run_dir, s).name for s in later] + exported
                aside = set_aside(run_dir, names, f"rewound_from_step_{step}")
                # into aside's files first, then out of run_dir's: never in neither
                if later_lines:
                    of = f" of step {', '.join(map(str, measured))}" if measured else ""
                    title = (f"# {run_dir.name}: base_eval's results{of}, set aside by a resume "
                             f"from step {step}")
                    write_atomic(aside / "report.md", "\n".join([title, "", *later_lines]))
                    write_atomic(run_dir / "report.md", "\n".join(kept))
                if core:
                    write_atomic(aside / "summary.json", json.dumps(core) + "\n")
                    write_atomic(run_dir / "summary.json", json.dumps(record) + "\n")
                moved = ([f"the later steps {', '.join(map(str, later))}"] if later else []) + (
                    [", ".join(exported)] if exported else []) + (
                    [f"base_eval's results of step {', '.join(map(str, measured))}"]
                    if measured else [])
                print0(f"resumed from step {step}: moved {' and '.join(moved)} into {aside} "
                       f"(kept; this run goes on from {step})")
        except OSError as e:
            error = f"cannot move the steps after {step} aside in {run_dir}: {e.strerror}"
        except ValueError as e:  # a report or summary that is not base_train's: it names which
            error = str(e)
    exit_if_any_failed(error)


def check_disk(run_dir: Path, rank: int, optimizer, num_iterations: int, save_every: int,
               keep: int) -> None:
    """Refuse now a checkpoint the run dir's disk cannot hold; warn if `keep` of them do not fit."""
    need = sum(p.numel() * p.element_size() * (2 if g["kind"] == "muon" else 3)
               for g in optimizer.param_groups for p in g["params"])
    saves = 1 + (num_iterations // save_every if save_every > 0 else 0)
    saves, error = saves if keep == -1 else min(saves, keep + 1), None
    if rank == 0:
        free = shutil.disk_usage(run_dir).free
        if free < need:
            error = (f"a checkpoint of this model takes about {size_str(need)}, and {run_dir} "
                     f"has {size_str(free)} free: free some space, or point NANOMUON_BASE_DIR at a "
                     "bigger disk")
        elif free < need * saves:
            print0(f"warning: {saves} checkpoints of about {size_str(need)} each "
                   f"(--keep-checkpoints {keep}, and the one being saved) will not all fit in the "
                   f"{size_str(free)} free on the disk of {run_dir}")
    exit_if_any_failed(error)

# -- report.md and summary.json: base_train's, with the parts other tools add --------------------

class Writer(NamedTuple):
    """What a tool other than base_train adds to report.md and summary.json."""
    keys: tuple[str, ...]  # its summary.json keys
    step_key: str  # the one of them that names the step its results are about
    headline: str  # the mark of its line right under report.md's title (replaced as it writes)


WRITERS = {"base_eval": Writer(keys=("core", "core_step", "core_tasks", "core_max_per_task",
                                     "core_headline"), step_key="core_step", headline="> CORE: ")}
REPORT_BYTES = 4 << 20  # a run's report.md read back: base_train and base_eval write a few KB
SUMMARY_BYTES = 1 << 20  # a run's summary.json read back: base_train writes a few KB
MAX_STEP_DIGITS = 12  # a section's step: more digits than any run takes is no section
REPORT, SUMMARY = "the report base_train writes", "the summary base_train writes"


def section_of(line: str) -> tuple[str, int] | None:
    """(writer, step) of a line heading another writer's section ("## writer, step N"), or None."""
    m = re.fullmatch(rf"## (.+), step (\d{{1,{MAX_STEP_DIGITS}}})", line)
    return (m[1], int(m[2])) if m and m[1] in WRITERS else None


def split_results(lines: list[str], record: dict, step: int):
    """Other writers' results of steps after `step`: (report lines kept, report lines of later
    steps, summary kept, its keys of a later step, the later steps measured)."""
    starts = [i for i, x in enumerate(lines) if section_of(x)]
    sections = [(*section_of(lines[i]), lines[i:j])  # (writer, step, lines)
                for i, j in zip(starts, [*starts[1:], len(lines)])]
    head = lines[:starts[0]] if starts else lines
    later_head, moved, measured_later = [], {}, set()
    for name, writer in WRITERS.items():
        measured = record.get(writer.step_key)
        counted = isinstance(measured, int) and not isinstance(measured, bool)
        for headline in [x for x in head if x.startswith(writer.headline)]:  # planted ones too
            shown_in = [s for w, s, body in sections
                        if w == name and headline[len(writer.headline):] in body]
            # its step: the last section showing it, else the summary's; unknown: not kept
            if (shown_in[-1] if shown_in else measured if counted else step + 1) > step:
                later_head.append(headline)
        # a step that is no int: unknown, so moved aside rather than kept as current
        if writer.step_key in record and (not counted or measured > step):
            moved.update({k: v for k, v in record.items() if k in writer.keys})
            if counted:
                measured_later.add(measured)
    kept = [x for x in head if x not in later_head]
    kept += [x for _, s, body in sections if s <= step for x in body]
    later = [*later_head, ""] if later_head else []
    later += [x for _, s, body in sections if s > step for x in body]
    steps = sorted({s for _, s, _ in sections if s > step} | measured_later)
    return kept, later, {k: v for k, v in record.items() if k not in moved}, moved, steps


def results_after(run_dir: Path, step: int):
    """split_results of run_dir's report.md and summary.json (an unreadable summary: as {})."""
    text = read_text(run_dir / "report.md")
    return split_results(text.split("\n") if text else [],
                         summary_record(run_dir / "summary.json") or {}, step)


def read_text(path: Path, limit: int = REPORT_BYTES, quiet=(FileNotFoundError,)) -> str:
    """A file of a run's, bounded and never a FIFO (read_regular); '' where it raises `quiet`."""
    try:
        return read_regular(path, limit, REPORT).decode(errors="replace")
    except quiet:
        return ""


def others_report(report: Path) -> tuple[list[str], list[str]]:
    """Other writers' headlines and sections in report.md, kept when base_train rewrites it."""
    try:
        text = read_text(report)
    except ValueError as e:  # swapped for a FIFO or a huge file mid-run: kept aside, not read
        set_aside_file(report, "report", one_line(e))
        return [], []
    marks = tuple(w.headline for w in WRITERS.values())
    headlines = [x for x in text.split("\n") if x.startswith(marks)]
    lines = text.rstrip("\n").split("\n")
    at = next((i for i, x in enumerate(lines) if i and section_of(x)), None)
    return headlines, [] if at is None else ["", *lines[at:]]


def set_aside_file(path: Path, what: str, why: str) -> None:
    """Move an unreadable report.md or summary.json to NAME.aside.N, kept, with a note."""
    aside = next(a for n in itertools.count(1)
                 if not os.path.lexists(a := path.with_name(f"{path.name}.aside.{n}")))
    try:
        os.rename(path, aside)
        done = f"moved to {aside.name}, kept; base_train writes its {what} anew"
    except OSError as e:
        done = f"it could not be moved aside ({e.strerror}): base_train's {what} replaces it"
    print0(f"note: {why}; {done}")


def summary_record(summary: Path, then: str = "", missing: str = "") -> dict | None:
    """A run's summary.json if it holds an object, else None, with a note of why and `then`."""
    try:
        record = load_json(summary, SUMMARY_BYTES, SUMMARY)
        why = "" if isinstance(record, dict) else "is not a JSON object"
    except FileNotFoundError:
        record, why = None, missing
    except (OSError, ValueError) as e:
        record, why = None, f"is unreadable ({one_line(e)})"
    if why and then:
        print0(f"note: {summary} {why}; {then}")
    return record if isinstance(record, dict) else None


def others_summary(summary: Path) -> dict:
    """Other writers' keys in summary.json; a file it cannot read back is moved aside, kept."""
    record = summary_record(summary)
    if record is None and os.path.lexists(summary):
        set_aside_file(summary, "summary", f"{summary} is not a summary base_train can read back")
    theirs = {k for w in WRITERS.values() for k in w.keys}
    return {k: v for k, v in (record or {}).items() if k in theirs}


def check_report(report) -> None:
    """Exit now, before evaluating, if report cannot be appended to."""
    try:  # non-blocking: a FIFO with no reader would hold the open forever
        fd = os.open(report, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK)
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        os.close(fd)
        if not regular:
            raise SystemExit(f"error: {report} is not a regular file: remove it (base_eval "
                             "appends its results there)")
    except FileNotFoundError:
        if not os.access(report.parent, os.W_OK | os.X_OK):
            raise SystemExit(f"error: cannot create {report}: {report.parent} is not writable; "
                             "make it writable, or copy the run into a writable base dir") from None
    except OSError as e:
        raise SystemExit(f"error: cannot append to {report} ({e.strerror}): make it a writable "
                         "regular file (not a link), or copy the run into a writable base dir"
                         ) from None


def check_summary(summary) -> None:
    """Exit now, before evaluating, if summary.json is there but no regular file."""
    with user_errors(), contextlib.suppress(FileNotFoundError):
        check_regular(summary, SUMMARY, "remove it (base_eval adds CORE to it)")


def append_section(run_dir: Path, writer: str, step: int, lines: list[str]) -> None:
    """Append `writer`'s section about `step` to the run's report.md (a link refused)."""
    report = Path(run_dir) / "report.md"
    try:
        fd = os.open(report, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise SystemExit(f"error: cannot append to {report} ({e.strerror}): it must be a "
                         "regular file of the run's own, not a link") from None
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(["", f"## {writer}, step {step}", "", *lines]) + "\n")
        f.flush()
        os.fsync(f.fileno())
    print0(f"appended to {report}")


def put_headline(run_dir: Path, writer: str, line: str) -> None:
    """Put `writer`'s line right under report.md's title, replacing its earlier one."""
    report, mark = Path(run_dir) / "report.md", WRITERS[writer].headline
    try:  # just appended to; a FIFO swapped in since would hang a plain read
        text = read_regular(report, REPORT_BYTES, REPORT).decode()
    except (OSError, ValueError) as e:
        print0(f"note: {report} is unreadable ({one_line(e)}); its {writer} line stays in its "
               "section")
        return
    lines = [x for x in text.split("\n") if not x.startswith(mark)]
    at = 1 if lines and lines[0].startswith("# ") else 0
    lines[at:at] = [mark + line]
    write_atomic(report, "\n".join(lines))


def merge_summary(run_dir: Path, writer: str, values: dict) -> None:
    """Put `writer`'s values (all its WRITERS keys) into an existing summary.json."""
    summary = Path(run_dir) / "summary.json"
    if set(values) != set(WRITERS[writer].keys):
        raise ValueError(f"{writer} writes {sorted(WRITERS[writer].keys)} into summary.json, "
                         f"not {sorted(values)}")
    record = summary_record(summary, f"{writer}'s results are in the report only",
                            "does not exist yet (base_train writes it when training ends)")
    if record is not None:
        write_atomic(summary, json.dumps(record | values) + "\n")


# -- the step record -------------------------------------------------------------------------------

def append_step_record(path: Path, *, step: int, steps: int, loss, dt_ms: float,
                       tok_per_s: float, finite: bool, line: str) -> None:
    """One logged step as a JSON line at the end of `path`, before its line is printed."""
    with open(path, "a") as f:
        f.write(json.dumps(dict(step=step, steps=steps, loss=loss, dt_ms=dt_ms,
                                tok_per_s=tok_per_s, finite=finite, line=line)) + "\n")


class StepRecords:
    """The step records a base_train run appends to `path` (--step-record), read as they come."""

    def __init__(self, path: Path):
        self.path, self.read, self.partial = path, 0, ""

    def new(self) -> list[dict]:
        """The records written since the last call; a line still being written waits."""
        try:
            with open(self.path) as f:
                f.seek(self.read)
                text = self.partial + f.read()
                self.read = f.tell()
        except FileNotFoundError:  # no step yet
            return []
        *lines, self.partial = text.split("\n")
        return [json.loads(line) for line in lines]
