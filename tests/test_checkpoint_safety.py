"""
Checkpoints and run dirs as untrusted input, and training that loses nothing: a pickle in a checkpoint's
index never runs, symlinks in a run dir are refused rather than followed, bytes changed on disk are
caught by checksums, the lock survives a deleted .lock, start-up cleanup removes only what our saves
left, old checkpoints are pruned, the final checkpoint is saved before the final eval, skipped steps
print as skipped, and base_eval's report sections survive a resumed base_train.
"""

import errno
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_bad_input import GOOD
from test_train import REPO, child_env

from nanomuon import checkpoint
from nanomuon import run as run_dirs
from nanomuon.checkpoint import (
    file_crc32,
    list_steps,
    load_checkpoint,
    load_step,
    prune_checkpoints,
    save_checkpoint,
    step_dir,
)
from nanomuon.run import clean_run_dir, lock_run_dir, unlock_run_dir

PAYLOAD = b"cos\nsystem\n(S'touch {marker}'\ntR0"  # runs os.system, then pops its result off the stack


def saved(run_dir, *steps):
    """Small checkpoints of a two-tensor model at these steps, as save_checkpoint writes them."""
    for s in steps:
        w = torch.full((64, 32), float(s))
        save_checkpoint(run_dir, s, {"model.w": w, "model.b": w[0].clone()}, dict(step=s), dict(optim=dict(s=s)))
    return run_dir


def test_a_pickle_in_the_index_never_runs(tmp_path):
    """An os.system pickle prefixed to a real .metadata (so plain pickle.load would run it and then read
    the real index) is refused with a line naming the file; 'latest' falls back to the step before."""
    run_dir, marker = saved(tmp_path / "run", 1, 2), tmp_path / "ran"
    index = step_dir(run_dir, 2) / ".metadata"
    index.write_bytes(PAYLOAD.replace(b"{marker}", str(marker).encode()) + index.read_bytes())
    with pytest.raises(ValueError, match=r"\.metadata is not a checkpoint index nanomuon loads .*os\.system"):
        load_step(run_dir, 2)
    warned = []
    assert load_step(run_dir, "latest", warn=warned.append)[0] == 1 and "step 2 does not load" in warned[0]
    with pytest.raises(ValueError, match="os.system"):
        load_checkpoint(run_dir, 2)
    assert not marker.exists()


def test_an_index_may_hold_only_tensors_in_files_of_its_own(tmp_path):
    """DCP torch.loads a non-tensor entry with weights_only=False, and reads a piece from whatever path
    the index names: both are refused before anything is read."""
    d = tmp_path / "bytes"
    dcp.save({"model.w": torch.ones(3), "model.obj": [1, 2]}, storage_writer=dcp.FileSystemWriter(d), no_dist=True)
    with pytest.raises(ValueError, match="BytesStorageMetadata"):
        checkpoint.read_index(d)
    d = tmp_path / "path"
    dcp.save({"model.w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(d), no_dist=True)
    md = pickle.loads((d / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ValueError, match=r"a piece is stored in '\.\./\.\./etc/passwd'"):
        checkpoint.read_index(d)


def test_bytes_changed_on_disk_are_caught(tmp_path):
    """Zeros written into the middle of a tensor file (its size unchanged) fail the checksum: a step asked
    for by number is refused, 'latest' falls back to the one before."""
    run_dir = saved(tmp_path / "run", 1, 2)
    data = step_dir(run_dir, 2) / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.seek(data.stat().st_size // 2)
        f.write(bytes(64))
    with pytest.raises(ValueError, match=r"__0_0\.distcp has CRC-32 \w+, \w+ when it was saved"):
        load_step(run_dir, 2)
    assert load_step(run_dir, "latest", warn=lambda _: None)[0] == 1


def test_symlinks_in_a_run_dir_are_refused_not_followed(tmp_path):
    """A link where a run writes (.lock, report.md) or reads (a step dir, a file in one) is refused with a
    line naming it, before anything is written; the file it points at is untouched."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    for name in (".lock", "report.md", "summary.json"):
        run_dir = tmp_path / name.strip(".")
        run_dir.mkdir()
        (run_dir / name).symlink_to(victim)
        with pytest.raises(ValueError, match=f"{name} is a symlink"):
            lock_run_dir(run_dir)
    assert victim.read_text() == "precious\n"

    run_dir = saved(tmp_path / "run", 1)
    (run_dir / "step_000002").symlink_to(step_dir(run_dir, 1))
    with pytest.raises(ValueError, match="step_000002 is a symlink"):
        load_step(run_dir, "latest")
    (run_dir / "step_000002").unlink()
    (step_dir(run_dir, 1) / "optim.pt").rename(tmp_path / "optim.pt")
    (step_dir(run_dir, 1) / "optim.pt").symlink_to(tmp_path / "optim.pt")
    with pytest.raises(ValueError, match="optim.pt is a symlink"):
        load_step(run_dir, 1)
    (tmp_path / "link").symlink_to(run_dir)
    with pytest.raises(ValueError, match="link is a symlink"):
        lock_run_dir(tmp_path / "link")


def test_start_up_cleanup_removes_only_what_our_saves_left(tmp_path):
    """A user's notes.tmp, a .tmp_backup/ copy of a checkpoint and a .tmp_step_N holding a file of theirs
    stay; a half-written save goes, and a link named like one goes without touching its target."""
    run_dir = saved(tmp_path / "run", 1)
    (run_dir / "notes.tmp").write_text("mine")
    os.system(f"cp -r {step_dir(run_dir, 1)} {run_dir / '.tmp_backup'}")
    theirs = run_dir / ".tmp_step_000005"
    theirs.mkdir()
    (theirs / "thesis.txt").write_text("mine")
    os.system(f"cp -r {step_dir(run_dir, 1)} {run_dir / '.tmp_step_000002'}")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("mine")
    (run_dir / ".tmp_step_000003").symlink_to(target)
    done = clean_run_dir(run_dir)
    assert len(done) == 2 and all("left by an interrupted save" in line for line in done), done
    assert sorted(p.name for p in run_dir.iterdir()) == [".tmp_backup", ".tmp_step_000005", "notes.tmp",
                                                         "step_000001"]
    assert (target / "keep").read_text() == "mine" and (theirs / "thesis.txt").exists()


def test_the_lock_survives_a_deleted_lock_file(tmp_path):
    """The lock is on the run dir itself: deleting .lock lets no second run in, and a holder never removes
    a .lock that is no longer its own."""
    run_dir = tmp_path / "run"
    assert lock_run_dir(run_dir) is None
    (run_dir / ".lock").unlink()
    with pytest.raises(RuntimeError, match="is in use by another process"):
        lock_run_dir(run_dir)
    (run_dir / ".lock").write_text("pid 1 on elsewhere\n")  # as another run would have written it
    unlock_run_dir(run_dir)
    assert (run_dir / ".lock").read_text() == "pid 1 on elsewhere\n"
    assert "no longer running; taking over" in lock_run_dir(run_dir)
    unlock_run_dir(run_dir)
    assert not run_dir.exists()


def test_pruning_keeps_the_newest(tmp_path):
    """keep=2 leaves the two newest, oldest removed first; a prune killed between its rename and its delete
    leaves a leftover that the next start removes, never a newer checkpoint."""
    run_dir = saved(tmp_path / "run", 1, 2, 3, 4)
    assert prune_checkpoints(run_dir, -1) == [] and list_steps(run_dir) == [1, 2, 3, 4]
    done = prune_checkpoints(run_dir, 2)
    assert list_steps(run_dir) == [3, 4] and "step 1" in done[0] and "step 2" in done[1]
    os.replace(step_dir(run_dir, 3), run_dir / ".tmp_pruned_step_000003")  # killed mid-prune
    assert clean_run_dir(run_dir) and sorted(p.name for p in run_dir.iterdir()) == ["step_000004"]
    assert load_checkpoint(run_dir, 4)[0]["model"]["w"].eq(4).all()


def run_main(*argv):
    from scripts.base_train import main

    return main([*GOOD, *argv])


@pytest.mark.heavy
def test_the_final_checkpoint_is_saved_before_the_final_eval(base, monkeypatch, capsys):
    """An eval that dies at the last step leaves the final checkpoint; resuming it runs only the eval, which
    is then recorded in the checkpoint and in the report. --keep-checkpoints prunes as it goes."""
    import scripts.base_train as bt

    real = bt.evaluate_bpb

    def dies(*a, **kw):
        raise RuntimeError("out of memory in the eval")
    monkeypatch.setattr(bt, "evaluate_bpb", dies)
    with pytest.raises(RuntimeError, match="out of memory in the eval"):
        run_main("--run", "final", "--num-iterations", "3", "--save-every", "1")
    run_dir = base / "runs" / "final"
    assert list_steps(run_dir) == [2, 3]
    monkeypatch.setattr(bt, "evaluate_bpb", real)
    capsys.readouterr()
    run_main("--run", "final", "--num-iterations", "3", "--save-every", "1", "--resume-from-step", "latest")
    out = capsys.readouterr().out
    assert "resumed" in out and "step 00003 | val bpb" in out and "saved" not in out, out
    meta = json.loads((step_dir(run_dir, 3) / "meta.json").read_text())
    assert [s for s, _ in meta["loop"]["val_history"]] == [3]
    assert "| 3 |" in (run_dir / "report.md").read_text()


@pytest.mark.heavy
def test_base_eval_sections_survive_a_resumed_base_train(base):
    run_main("--run", "reported", "--num-iterations", "2")
    report = base / "runs" / "reported" / "report.md"
    report.write_text(report.read_text() + "\n## base_eval, step 2\n\n- embedded val bpb: 9.0\n")
    run_main("--run", "reported", "--num-iterations", "2", "--resume-from-step", "latest")
    text = report.read_text()
    assert text.count("## base_eval, step 2") == 1 and text.index("## Validation") < text.index("## base_eval")


def test_skipped_steps_print_as_skipped(base, monkeypatch, capsys):
    """Every update skipped (non-finite): no step line shows a loss, and the closing line names no
    checkpoint that does not exist. (Every gradient reads as non-finite: an lr large enough to
    overflow is refused by the flags.)"""
    monkeypatch.setattr("scripts.base_train.all_finite", lambda *_: False)
    with pytest.raises(SystemExit) as e:
        run_main("--run", "diverged", "--num-iterations", "30", "--max-nonfinite-steps", "5")
    lines = [s for s in capsys.readouterr().out.splitlines() if s.startswith("step 0")]
    assert lines and all("skipped (non-finite)" in s for s in lines[1:]), lines
    assert "There is no checkpoint yet: start the run afresh" in str(e.value.code)


def test_a_resume_keeps_the_data_seed(base, capsys):
    run_main("--run", "seeded", "--num-iterations", "2", "--data-seed", "5", "--save-every", "1")
    with pytest.raises(SystemExit, match="--data-seed was 5, now None"):
        run_main("--run", "seeded", "--num-iterations", "2", "--resume-from-step", "1")


@pytest.mark.heavy
def test_a_fresh_run_over_an_earlier_one_is_refused_or_moves_it_aside(base, capsys):
    """A re-run of the same --run without --resume-from-step neither trains over the earlier run
    nor prunes it: one line says how to go on; --start-over moves its checkpoints and results into
    previous.N, where they stay whole, and trains afresh with pruning limited to its own steps."""
    run_dir = base / "runs" / "again"
    run_main("--run", "again", "--num-iterations", "4", "--save-every", "1", "--keep-checkpoints",
             "2")
    first = {s: file_crc32(step_dir(run_dir, s) / "meta.json") for s in list_steps(run_dir)}
    report = (run_dir / "report.md").read_text()
    with pytest.raises(SystemExit, match=r"holds an earlier run \(steps 3, 4, summary.json, "
                                         r"report.md.*--resume-from-step latest.*--start-over"):
        run_main("--run", "again", "--num-iterations", "4")
    assert {s: file_crc32(step_dir(run_dir, s) / "meta.json") for s in list_steps(run_dir)} == first
    capsys.readouterr()
    run_main("--run", "again", "--num-iterations", "3", "--save-every", "1", "--keep-checkpoints",
             "2", "--start-over")
    assert "--start-over: moved the earlier run (5 entries) into" in capsys.readouterr().out
    assert list_steps(run_dir) == [2, 3]
    aside = run_dir / "previous.1"
    assert list_steps(aside) == [3, 4] and (aside / "report.md").read_text() == report
    assert {s: file_crc32(step_dir(aside, s) / "meta.json") for s in (3, 4)} == first
    with pytest.raises(SystemExit):
        run_main("--run", "again", "--start-over", "--resume-from-step", "latest")
    assert "--start-over trains afresh" in capsys.readouterr().err


@pytest.mark.heavy
def test_a_rewind_keeps_the_abandoned_steps_aside_and_prunes_only_its_own(base, capsys):
    """Resuming from an earlier step while later checkpoints exist: the later ones move into
    rewound_from_step_S.N (latest no longer finds them, pruning never touches them), and pruning
    keeps the newest of the new line, the step just saved included."""
    run_dir = base / "runs" / "rewind"
    flags = ("--run", "rewind", "--num-iterations", "6", "--save-every", "1",
             "--keep-checkpoints", "-1")
    run_main(*flags[:-1], "-1")
    later = {s: file_crc32(step_dir(run_dir, s) / "meta.json") for s in (3, 4, 5, 6)}
    for s in (2, 6):  # scripts.export's files: step 6's is a model of the abandoned line
        (run_dir / f"export_step_{s:06d}.pt").write_bytes(b"export")
    capsys.readouterr()
    run_main(*flags[:-2], "--keep-checkpoints", "2", "--resume-from-step", "2",
             "--num-iterations", "6")
    out = capsys.readouterr().out
    assert "moved the later steps 3, 4, 5, 6 and export_step_000006.pt into" in out, out
    assert list_steps(run_dir) == [5, 6]  # the new line's newest two
    aside = run_dir / "rewound_from_step_2.1"
    assert {s: file_crc32(step_dir(aside, s) / "meta.json") for s in list_steps(aside)} == later
    assert (aside / "export_step_000006.pt").is_file()
    assert (run_dir / "export_step_000002.pt").is_file()
    assert not (run_dir / "export_step_000006.pt").exists()


@pytest.mark.heavy
def test_a_resume_keeps_what_base_eval_wrote(base):
    """base_train resuming a finished run keeps base_eval's CORE keys in summary.json and its
    "> CORE:" headline in report.md."""
    run_main("--run", "scored", "--num-iterations", "2")
    run_dir = base / "runs" / "scored"
    summary = json.loads((run_dir / "summary.json").read_text())
    core = dict(core=0.12, core_step=2, core_tasks={"piqa": 0.1}, core_max_per_task=100,
                core_headline="CORE 0.1200 at step 2")
    (run_dir / "summary.json").write_text(json.dumps(dict(summary, **core)))
    report = (run_dir / "report.md").read_text().split("\n")
    (run_dir / "report.md").write_text("\n".join([report[0], "> CORE: 0.1200", *report[1:]]))
    run_main("--run", "scored", "--num-iterations", "2", "--resume-from-step", "latest")
    after = json.loads((run_dir / "summary.json").read_text())
    assert {k: after[k] for k in core} == core and after["final_val_bpb"] == summary["final_val_bpb"]
    assert (run_dir / "report.md").read_text().split("\n")[1] == "> CORE: 0.1200"


def base_eval_main(run, *argv):
    from scripts.base_eval import main

    return main(["--run", run, "--device-type", "cpu", "--device-batch-size", "4",
                 "--sample-tokens", "0", *argv])


@pytest.mark.heavy
def test_a_rewind_moves_base_eval_results_of_the_later_steps_aside(base, tmp_path):
    """CORE measured at steps 4 and 8, then a rewind to 4 that trains another step 8: step 8's
    results (its report section, the "> CORE:" headline, summary.json's core keys) move into
    rewound_from_step_4.1 with that step, and are not the new line's; step 4's section stays."""
    from test_core_eval import write_zip

    run_dir, bundle = base / "runs" / "rewound-eval", write_zip(tmp_path / "b.zip")
    flags = ("--run", "rewound-eval", "--num-iterations", "8", "--save-every", "4")
    run_main(*flags)
    for step in (4, 8):
        base_eval_main("rewound-eval", "--step", str(step), "--eval", "core", "--core-bundle",
                       str(bundle))
    measured = json.loads((run_dir / "summary.json").read_text())
    assert measured["core_step"] == 8
    run_main(*flags, "--resume-from-step", "4")
    summary = json.loads((run_dir / "summary.json").read_text())
    report = (run_dir / "report.md").read_text()
    assert not any(k.startswith("core") for k in summary), summary.keys()
    assert "## base_eval, step 4" in report and "## base_eval, step 8" not in report
    assert not any(x.startswith("> CORE: ") for x in report.split("\n")), report
    aside = run_dir / "rewound_from_step_4.1"
    kept = json.loads((aside / "summary.json").read_text())
    assert {k: kept[k] for k in measured if k.startswith("core")} == \
        {k: v for k, v in measured.items() if k.startswith("core")}
    moved = (aside / "report.md").read_text()
    assert "## base_eval, step 8" in moved and "## base_eval, step 4" not in moved
    assert "> CORE: " + measured["core_headline"] in moved.split("\n")


@pytest.mark.heavy
def test_base_eval_holds_the_run_dir_while_it_measures(base, monkeypatch):
    """A --start-over while base_eval measures step 4 is refused (base_eval holds the run dir's
    lock), so its results are filed with the run it measured, not with a new one."""
    import scripts.base_eval as be

    run_dir = base / "runs" / "measured"
    run_main("--run", "measured", "--num-iterations", "4")
    real, refused = be.evaluate_bpb, []

    def start_over_meanwhile(*args, **kwargs):
        try:
            run_main("--run", "measured", "--num-iterations", "2", "--start-over")
        except SystemExit as e:
            refused.append(str(e.code))
        return real(*args, **kwargs)
    monkeypatch.setattr(be, "evaluate_bpb", start_over_meanwhile)
    base_eval_main("measured", "--eval", "bpb")
    assert refused and f"is in use by pid {os.getpid()}" in refused[0], refused
    assert not (run_dir / "previous.1").exists() and checkpoint.list_steps(run_dir) == [4]
    assert "## base_eval, step 4" in (run_dir / "report.md").read_text()
    assert not (run_dir / ".lock").exists()  # let go when it ends


THROUGHPUT = ("mean_step_ms", "median_step_ms", "median_optimizer_ms", "optimizer_share",
              "tok_per_s")


@pytest.mark.heavy
def test_a_resume_that_times_no_step_keeps_the_throughput(base):
    """A finished run resumed (its process trains, and so times, no step) keeps summary.json's
    throughput keys (ablate reads mean_step_ms and tok_per_s) and report.md's lines for them."""
    run_main("--run", "timed", "--num-iterations", "6")
    run_dir = base / "runs" / "timed"
    before = json.loads((run_dir / "summary.json").read_text())
    lines = [x for x in (run_dir / "report.md").read_text().split("\n")
             if x.startswith(("- tok per s:", "- optimizer share:"))]
    assert len(lines) == 2 and all(k in before for k in THROUGHPUT), before.keys()
    run_main("--run", "timed", "--num-iterations", "6", "--resume-from-step", "latest")
    after = json.loads((run_dir / "summary.json").read_text())
    assert {k: after.get(k) for k in THROUGHPUT} == {k: before[k] for k in THROUGHPUT}
    assert all(x in (run_dir / "report.md").read_text().split("\n") for x in lines)


@pytest.mark.parametrize("key,value,says", [pytest.param("dtype", "fp16", "'args.dtype' is 'fp16', not one of",
                                                         marks=pytest.mark.heavy),
                                            ("eval_tokens", -5, "'args.eval_tokens' is -5, not an int >= 1")])
def test_base_eval_refuses_a_bad_saved_flag_in_one_line(base, key, value, says):
    """meta.json is text: a hand-edited dtype or eval_tokens is one line naming it, not a traceback
    or a silent 64-token eval."""
    from scripts.base_eval import main as base_eval

    run_main("--run", f"edited-{key}", "--num-iterations", "1")
    meta_path = step_dir(base / "runs" / f"edited-{key}", 1) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["args"][key] = value
    meta_path.write_text(json.dumps(meta))
    (meta_path.parent / "checksums.json").unlink()  # the edit is the point here, not the checksum
    with pytest.raises(SystemExit, match=says):
        base_eval(["--run", f"edited-{key}", "--step", "1", "--device-type", "cpu", "--eval", "bpb"])


def test_a_step_without_checksums_loads_with_a_note(base, capsys):
    """Deleting checksums.json does not turn the check off in silence: the step loads, unverified,
    and says so."""
    run_main("--run", "unsummed", "--num-iterations", "1")
    d = step_dir(base / "runs" / "unsummed", 1)
    (d / "checksums.json").unlink()
    capsys.readouterr()
    load_step(base / "runs" / "unsummed", "latest")
    assert f"note: {d} has no checksums.json: its files load unverified" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["meta.json", *(pytest.param(n, marks=pytest.mark.heavy)
                                                for n in ("checksums.json", ".metadata", "optim.pt"))])
def test_a_fifo_in_the_newest_step_falls_back_and_never_hangs(base, capsys, name):
    """A FIFO where a checkpoint file belongs (nothing writes to it: opening it for reading would
    wait forever) makes that step corrupt: `latest` takes the one before, at once."""
    run_dir = base / "runs" / f"fifo-{name.strip('.')}"
    run_main("--run", run_dir.name, "--num-iterations", "2", "--save-every", "1",
             "--keep-checkpoints", "-1")
    target = step_dir(run_dir, 2) / name
    target.unlink()
    os.mkfifo(target)
    capsys.readouterr()
    assert load_step(run_dir, "latest")[0] == 1
    assert f"{target} is a FIFO, not the regular file nanomuon wrote" in capsys.readouterr().out


@pytest.mark.heavy
def test_a_fifo_for_a_report_is_refused_at_the_start(base, tmp_path):
    """report.md or summary.json as a FIFO: base_train refuses at the start, before it takes hours
    to reach them, and base_eval before it evaluates; neither waits on the FIFO."""
    import subprocess
    import sys

    from test_train import REPO, child_env

    run_main("--run", "fifo-report", "--num-iterations", "1")
    report = base / "runs" / "fifo-report" / "report.md"
    report.unlink()
    os.mkfifo(report)
    for cmd in (["scripts.base_train", *GOOD, "--run", "fifo-report", "--resume-from-step", "latest"],
                ["scripts.base_eval", "--run", "fifo-report", "--device-type", "cpu"]):
        p = subprocess.run([sys.executable, "-m", *cmd], cwd=REPO, env=child_env(base),
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 1 and "report.md" in p.stderr and "regular file" in p.stderr, p.stderr
        assert p.stderr.strip().count("\n") == 0, p.stderr


def test_a_reader_beside_a_pruner_says_the_step_was_removed_and_takes_the_next(base, capsys,
                                                                                monkeypatch):
    """A step pruned by a live run while sample reads it is not called corrupt (nor is anyone told
    to delete it and start afresh): the note says the run removed it, and the newest one left
    loads; read by number, the one line says so too."""
    run_dir = base / "runs" / "pruned-under"
    run_main("--run", "pruned-under", "--num-iterations", "3", "--save-every", "1",
             "--keep-checkpoints", "-1")
    real = checkpoint.check_files

    def pruned_while_read(d):  # the live run prunes this step just as it is read
        if d == step_dir(run_dir, 3):
            shutil.move(d, base / "pruned-step-3")
        return real(d)

    monkeypatch.setattr(checkpoint, "check_files", pruned_while_read)
    capsys.readouterr()
    assert load_step(run_dir, "latest")[0] == 2
    out = capsys.readouterr().out
    assert "note: step 3 was removed by the run saving there" in out and "corrupt" not in out, out
    shutil.move(base / "pruned-step-3", step_dir(run_dir, 3))
    with pytest.raises(ValueError, match="was removed while it was read: the run saving there "
                                         "prunes its older checkpoints"):
        load_step(run_dir, 3)


@pytest.mark.heavy
def test_sample_loads_the_next_step_when_latest_is_pruned_mid_read(base, capsys, monkeypatch):
    """load_model (sample, base_eval): 'latest' checked, then pruned before its tensors are read:
    it says so and loads the newest step left."""
    run_dir = base / "runs" / "pruned-mid-read"
    run_main("--run", "pruned-mid-read", "--num-iterations", "3", "--save-every", "1",
             "--keep-checkpoints", "-1")
    real, moved = checkpoint.load_into, []

    def pruned_before_read(rd, step, model, optimizer=None):
        if step == 3 and not moved:
            moved.append(shutil.move(step_dir(run_dir, 3), base / "pruned-mid-read-3"))
        return real(rd, step, model, optimizer)

    monkeypatch.setattr(checkpoint, "load_into", pruned_before_read)
    capsys.readouterr()
    _, meta = checkpoint.load_model(run_dir, "latest", torch.device("cpu"))
    assert meta["step"] == 2 and moved
    assert "note: step 3 was removed by the run saving there while it was read" in \
        capsys.readouterr().out


@pytest.mark.heavy
def test_a_step_pruned_as_dcp_reads_it_logs_no_traceback(base, caplog, capsys, monkeypatch):
    """DCP logs an index it cannot read, with its traceback, before it raises: a step pruned just
    as its tensors are read gets load_model's one-line note and nothing else."""
    run_dir = base / "runs" / "pruned-in-dcp"
    run_main("--run", "pruned-in-dcp", "--num-iterations", "3", "--save-every", "1",
             "--keep-checkpoints", "-1")
    real = checkpoint.SafeReader.read_metadata

    def pruned_as_read(self, *args, **kwargs):  # DCP's signature: it also tries a rank's index
        if str(self.path) == str(step_dir(run_dir, 3)) and step_dir(run_dir, 3).exists():
            shutil.move(step_dir(run_dir, 3), base / "pruned-in-dcp-3")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(checkpoint.SafeReader, "read_metadata", pruned_as_read)
    capsys.readouterr()
    with caplog.at_level("DEBUG"):
        _, meta = checkpoint.load_model(run_dir, "latest", torch.device("cpu"))
    out, err = capsys.readouterr()
    assert meta["step"] == 2 and "Traceback" not in out + err, out + err
    assert "note: step 3 was removed by the run saving there while it was read" in out, out
    # caplog.text, formatted as each record was logged: DCP's records hold a dict it edits later
    assert "metadata is not" not in caplog.text and "Traceback" not in caplog.text, caplog.text


@pytest.mark.heavy
def test_start_over_takes_all_of_the_earlier_run_past_a_dangling_link(base, capsys):
    """--start-over picks the first previous.N that nothing holds (a dangling link holds its name)
    and moves everything of the earlier run: its exports, wandb's folder and its rewinds' folders
    too, which would otherwise stand beside the new run's steps."""
    run_dir = base / "runs" / "whole"
    run_main("--run", "whole", "--num-iterations", "2", "--save-every", "1")
    (run_dir / "export_step_000002.pt").write_bytes(b"export")
    (run_dir / "wandb").mkdir()
    (run_dir / "wandb" / "run.log").write_text("logged")
    (run_dir / "rewound_from_step_1.1").mkdir()
    (run_dir / "previous.1").symlink_to(base / "nowhere")
    capsys.readouterr()
    run_main("--run", "whole", "--num-iterations", "1", "--start-over")
    out = capsys.readouterr().out
    assert f"moved the earlier run (8 entries) into {run_dir / 'previous.2'}" in out, out
    aside = run_dir / "previous.2"
    assert list_steps(aside) == [1, 2] and (aside / "wandb" / "run.log").read_text() == "logged"
    assert (aside / "export_step_000002.pt").is_file()
    assert (aside / "rewound_from_step_1.1").is_dir()
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "curves.png", "previous.1", "previous.2", "report.md", "step_000001", "summary.json"]


def test_a_set_aside_that_cannot_move_an_entry_puts_all_back(tmp_path, monkeypatch):
    """An entry that will not move (an immutable file) stops the move with one line naming it, and
    everything moved so far goes back: no empty or half-filled previous.N is left."""
    run_dir = saved(tmp_path / "run", 1, 2)
    (run_dir / "report.md").write_text("report")
    before = sorted(p.name for p in run_dir.iterdir())
    real = os.replace

    def immutable(src, dst):
        if os.path.basename(src) == "report.md" and "previous" in str(dst):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(src), None, str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", immutable)
    with pytest.raises(OSError) as e:
        run_dirs.set_aside(run_dir, ["step_000001", "step_000002", "report.md"], "previous")
    line = e.value.strerror
    assert line.startswith(f"{run_dir / 'report.md'} does not move into previous.1 (Operation "
                           f"not permitted); all is back in {run_dir} as it was"), line
    assert "chattr -i" in line and "\n" not in line
    assert sorted(p.name for p in run_dir.iterdir()) == before
    assert load_checkpoint(run_dir, 2)[0]["model"]["w"].eq(2).all()


SET_ASIDE_KILLED = """
import os, signal, sys
from nanomuon import run
real, calls = os.replace, []

def killed(src, dst):  # the first rename writes the list of entries; the moves follow
    calls.append(src)
    if len(calls) == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst)

os.replace = killed
run.set_aside(sys.argv[1], ["step_000001", "step_000002", "report.md"], "previous")
"""


@pytest.mark.parametrize("kill_at", [1, 3])  # before the list is written; after one move
def test_a_set_aside_killed_midway_is_finished_at_the_next_start(tmp_path, kill_at):
    """A --start-over killed in the middle of its move leaves no run split over previous.N and
    the run dir: the next start (clean_run_dir) finishes the move, or clears a folder that holds
    nothing yet, and says so."""
    run_dir = saved(tmp_path / "run", 1, 2)
    (run_dir / "report.md").write_text("report")
    p = subprocess.run([sys.executable, "-c", SET_ASIDE_KILLED, str(run_dir), str(kill_at)],
                       cwd=REPO, env=child_env(tmp_path), timeout=120)
    assert p.returncode == -signal.SIGKILL
    done = clean_run_dir(run_dir)
    if kill_at == 1:
        assert done == ["removed an empty .tmp_previous.1 left by a move that was stopped"]
        assert sorted(p.name for p in run_dir.iterdir()) == ["report.md", "step_000001",
                                                             "step_000002"]
        return
    assert done == [f"finished moving the earlier run (3 entries) into {run_dir / 'previous.1'}: "
                    "the --start-over or rewind that moved it was stopped midway"], done
    aside = run_dir / "previous.1"
    assert [p.name for p in run_dir.iterdir()] == ["previous.1"]
    assert sorted(p.name for p in aside.iterdir()) == ["report.md", "step_000001", "step_000002"]
    assert load_checkpoint(aside, 2)[0]["model"]["w"].eq(2).all()


def test_no_checkpoints_names_the_ones_set_aside_and_how_to_load_them(tmp_path):
    run_dir = tmp_path / "run"
    saved(run_dir / "previous.1", 1, 2, 3, 4)
    saved(run_dir / "rewound_from_step_2.1", *range(3, 13))
    with pytest.raises(FileNotFoundError) as e:
        load_step(run_dir, "latest")
    assert str(e.value) == (
        f"no checkpoints in {run_dir}, but previous.1 holds steps 1, 2, 3, 4; "
        "rewound_from_step_2.1 holds steps 3, ..., 12 (10) (set aside by --start-over or a "
        f"rewind): move one back to load it (mv {run_dir}/rewound_from_step_2.1/step_000012 "
        f"{run_dir}/)")
