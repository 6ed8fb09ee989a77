"""
Run safety with real processes and real kills: one base_train per run dir (a second is refused within
10 s, a SIGKILLed holder's lock is taken over), a re-save of a step that SIGKILL cannot leave without a
complete checkpoint, `latest` falling back past a corrupt checkpoint to a bitwise-exact resume, a full
disk at start and mid-run (a tmpfs in a user namespace), and Ctrl-C.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from test_train import REPO, TINY, assert_bitwise_equal, child_env, run

from nanomuon.checkpoint import list_steps, load_checkpoint, step_dir
from nanomuon.run import clean_run_dir

FLAGS = [*TINY, "--total-batch-size", "256", "--eval-every", "-1"]


def train_cmd(*extra):
    return [sys.executable, "-m", "scripts.base_train", *FLAGS, *extra]


def start(cmd, base, **kw):
    return subprocess.Popen(cmd, cwd=REPO, env=child_env(base), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kw)


def wait_until(cond, job, timeout=120):
    deadline = time.time() + timeout
    while not cond():
        assert job.poll() is None, f"the job ended early:\n{job.stdout.read()[-3000:]}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def last_line(out):
    return out.strip().splitlines()[-1]


@pytest.mark.heavy
def test_one_run_per_run_dir_and_a_dead_holder_is_detected(base):
    run_dir = base / "runs" / "locked"
    flags = ["--run", "locked", "--num-iterations", "30", "--save-every", "5"]
    holder = start(train_cmd(*flags), base)
    wait_until(lambda: list_steps(run_dir), holder)
    holder.send_signal(signal.SIGSTOP)  # a run that holds the dir for as long as we look (a hung one, say)
    t0 = time.time()
    second = run(train_cmd(*flags), base, check=False)
    took = time.time() - t0
    assert second.returncode == 1 and took < 10, (second.returncode, took)
    assert "Traceback" not in second.stderr
    assert f"is in use by pid {holder.pid} on" in last_line(second.stderr), second.stderr
    assert holder.poll() is None and (run_dir / ".lock").is_file()  # the refused run took nothing away

    holder.send_signal(signal.SIGKILL)
    holder.wait()
    saved = list_steps(run_dir)
    p = run(train_cmd(*flags, "--resume-from-step", "latest"), base)
    assert f"was left by pid {holder.pid} on" in p.stdout and "no longer running; taking over" in p.stdout
    assert f"resumed {run_dir} at step {saved[-1]}" in p.stdout
    assert list_steps(run_dir)[-1] == 30 and not (run_dir / ".lock").exists()  # released at exit


RESAVER = textwrap.dedent("""
    import sys, torch
    from nanomuon import checkpoint
    if sys.argv[2] == "two-renames":
        checkpoint.SWAP = None  # as on a filesystem without an atomic exchange
    i = 0
    while True:
        i += 1
        w = torch.full((256, 1024), float(i))
        checkpoint.save_checkpoint(sys.argv[1], 3, {"model.w": w, "model.v": w[:7]}, dict(step=3, i=i), dict(optim=i))
""")


def complete(run_dir):
    """Whether step 3 is whole: its meta, tensors and optim.pt load and agree."""
    objs, meta = load_checkpoint(run_dir, 3, ("model", "optim"))
    return bool((objs["model"]["w"] == meta["i"]).all() and (objs["model"]["v"] == meta["i"]).all()
                and objs["optim"] == meta["i"])


@pytest.mark.parametrize("mode", ["swap", pytest.param("two-renames", marks=pytest.mark.heavy)])
def test_a_resave_killed_at_any_moment_keeps_a_complete_step(base, tmp_path, mode):
    """A process re-saves step 3 over and over and is SIGKILLed at random moments. With the atomic swap,
    step_000003 exists at every instant we look; with two renames, clean_run_dir (run at every start)
    brings back the old one when the kill fell between them. Either way the step is whole after the kill
    and no temporary directory survives the cleanup."""
    run_dir = tmp_path / "run"
    rng = random.Random(0)
    for trial in range(8):
        job = subprocess.Popen([sys.executable, "-c", RESAVER, str(run_dir), mode], cwd=REPO, env=child_env(base))
        first = time.time()
        while not step_dir(run_dir, 3).exists():
            time.sleep(0.005)
            assert time.time() - first < 60 and job.poll() is None
        deadline = time.time() + rng.uniform(0.2, 1.5)
        while time.time() < deadline:  # every look finds the step, with the swap
            if mode == "swap":
                assert step_dir(run_dir, 3).is_dir()
        job.send_signal(signal.SIGKILL)
        job.wait()
        clean_run_dir(run_dir)
        assert complete(run_dir), trial
        assert sorted(p.name for p in run_dir.iterdir()) == ["step_000003"]


@pytest.mark.heavy
def test_latest_falls_back_past_a_corrupt_checkpoint(base):
    """auto / latest skip a checkpoint that does not load, with a warning naming it, and resume from the one
    before: the run still ends bitwise equal to an uninterrupted one. A step named by number must load."""
    flags = ["--num-iterations", "6", "--save-every", "2", "--keep-checkpoints", "-1"]
    run(train_cmd(*flags, "--run", "straight"), base)
    broken = base / "runs" / "broken"
    shutil.copytree(base / "runs" / "straight", broken)
    shutil.rmtree(step_dir(broken, 6))  # as if the run had died after step 4's save, which got corrupted
    tensors = step_dir(broken, 4) / "__0_0.distcp"
    tensors.write_bytes(tensors.read_bytes()[:1000])

    explicit = run(train_cmd(*flags, "--run", "broken", "--resume-from-step", "4"), base, check=False)
    assert explicit.returncode == 1 and "is incomplete or corrupt" in last_line(explicit.stderr)
    p = run(train_cmd(*flags, "--run", "broken", "--resume-from-step", "auto"), base)
    assert "warning: step 4 does not load, trying the checkpoint before it" in p.stdout
    assert f"resumed {broken} at step 2" in p.stdout
    names = ("model", "optim")
    (a, ma), (b, mb) = (load_checkpoint(base / "runs" / r, 6, names) for r in ("straight", "broken"))
    assert_bitwise_equal(a, b, "checkpoint")
    assert ma["loader"] == mb["loader"]


def in_small_tmpfs(cmd, mount, size_kb):
    """cmd, run in a new user and mount namespace with a tmpfs of size_kb at mount (a disk that fills), then
    a listing of what it left there (the tmpfs goes with the namespace)."""
    script = (f"mount -t tmpfs -o size={size_kb}k tmpfs {mount} && \"$@\"; rc=$?; echo left: $(ls -A {mount}); "
              "exit $rc")
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", *cmd]


def can_mount_tmpfs(tmp_path):
    probe = subprocess.run(in_small_tmpfs(["true"], tmp_path, 64), capture_output=True)
    return shutil.which("unshare") and probe.returncode == 0


@pytest.mark.heavy
def test_a_full_disk_stops_the_run_at_start_or_at_a_save(base, tmp_path):
    """A run dir on a disk smaller than one checkpoint is refused before training; one that fills at the
    second save stops with one line, keeping the first checkpoint, and leaves no temporary files."""
    if not can_mount_tmpfs(tmp_path):
        pytest.skip("cannot mount a tmpfs in a user namespace here (unshare)")
    flags = ["--num-iterations", "4", "--save-every", "1"]
    run(train_cmd(*flags, "--run", "sized", "--num-iterations", "1"), base)
    size = sum(f.stat().st_size for f in step_dir(base / "runs" / "sized", 1).iterdir())

    run_dir = base / "runs" / "tiny-disk"
    run_dir.mkdir(parents=True)
    p = subprocess.run(in_small_tmpfs(train_cmd(*flags, "--run", "tiny-disk"), run_dir, size // 2048), cwd=REPO,
                       env=child_env(base), capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "step 00001" not in p.stdout, p.stdout + p.stderr
    assert "a checkpoint of this model takes about" in last_line(p.stderr), p.stderr
    assert "left:\n" in p.stdout

    run_dir = base / "runs" / "full-disk"
    run_dir.mkdir(parents=True)
    p = subprocess.run(in_small_tmpfs(train_cmd(*flags, "--run", "full-disk"), run_dir, size * 3 // 2048),
                       cwd=REPO, env=child_env(base), capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert "warning: 3 checkpoints of about" in p.stdout
    assert "saved" in p.stdout and "no space left on the device of" in last_line(p.stderr), p.stderr
    assert "the checkpoint of step 1 is kept" in last_line(p.stderr)
    assert "left: step_000001\n" in p.stdout  # the first checkpoint, whole, and nothing half-written


def test_ctrl_c_says_where_the_last_checkpoint_is(base):
    run_dir = base / "runs" / "interrupted"
    job = start(train_cmd("--run", "interrupted", "--num-iterations", "500", "--save-every", "3"), base)
    wait_until(lambda: list_steps(run_dir), job)
    job.send_signal(signal.SIGINT)
    out, _ = job.communicate(timeout=60)
    assert job.returncode == 130 and "Traceback" not in out, out[-3000:]
    last = list_steps(run_dir)[-1]
    assert last_line(out) == (f"interrupted; the last checkpoint is {step_dir(run_dir, last)} (continue with "
                              "--resume-from-step latest)")
    assert not (run_dir / ".lock").exists()
    load_checkpoint(run_dir, last, ("model", "optim"))
    assert os.listdir(run_dir)


def test_each_writers_part_is_found_by_its_own_mark(tmp_path, monkeypatch):
    """What a tool in run.WRITERS wrote into report.md and summary.json (its keys, its headline, its
    sections) is what a rewriting base_train keeps: a second writer registered there is kept with
    no other change, and a key no writer declares (though it starts like CORE's) is base_train's."""
    from nanomuon import run

    probe = run.Writer(keys=("probe_bpb", "probe_step"), step_key="probe_step", headline="> probe: ")
    monkeypatch.setitem(run.WRITERS, "probe", probe)
    (tmp_path / "summary.json").write_text(json.dumps(dict(
        final_val_bpb=2.0, core=0.1, core_step=4, probe_bpb=1.5, probe_step=4, core_like=3)))
    report = ["# a run", "> CORE: 0.1", "> probe: 1.5", "", "- base_train's line", "", "## Curves",
              "", "## base_eval, step 4", "", "0.1", "## probe, step 4", "", "1.5",
              "## no writer, step 4", "- inside probe's section"]
    (tmp_path / "report.md").write_text("\n".join(report))
    assert run.others_summary(tmp_path / "summary.json") == dict(core=0.1, core_step=4,
                                                                 probe_bpb=1.5, probe_step=4)
    assert run.others_report(tmp_path / "report.md") == (report[1:3], ["", *report[8:]])
    # a rewind to step 3 moves each writer's part about step 4 aside (a headline with the section
    # that shows it), probe's as base_eval's
    kept, later, record, moved, steps = run.split_results(
        report, json.loads((tmp_path / "summary.json").read_text()), 3)
    assert kept == [report[0], *report[3:8]] and later == [*report[1:3], "", *report[8:]]
    assert record == dict(final_val_bpb=2.0, core_like=3) and steps == [4]
    assert moved == dict(core=0.1, core_step=4, probe_bpb=1.5, probe_step=4)
    with pytest.raises(ValueError, match=r"probe writes \['probe_bpb', 'probe_step'\]"):
        run.merge_summary(tmp_path, "probe", dict(probe_bpb=1.4))
    run.merge_summary(tmp_path, "probe", dict(probe_bpb=1.4, probe_step=6))
    run.append_section(tmp_path, "probe", 6, ["- bpb 1.4"])
    run.put_headline(tmp_path, "probe", "1.4")
    record = json.loads((tmp_path / "summary.json").read_text())
    assert record["probe_bpb"] == 1.4 and record["final_val_bpb"] == 2.0
    headlines, sections = run.others_report(tmp_path / "report.md")
    assert headlines == ["> probe: 1.4", "> CORE: 0.1"] and sections[-3:] == ["## probe, step 6", "",
                                                                                 "- bpb 1.4"]


def test_a_rewind_sets_aside_every_core_headline_of_the_steps_it_drops():
    """Every "> CORE:" line under the title goes with the step it shows (its last section, else
    summary.json's core_step): copies, a planted one and one of no known step are set aside by a
    rewind that drops that step; only step 2's, whose section stays, is kept."""
    from nanomuon import run

    head = ["# a run", "> CORE: 0.3 at 8", "> CORE: planted", "> CORE: 0.3 at 8", "> CORE: 0.1 at 2"]
    sections = ["## base_eval, step 2", "", "0.1 at 2", "## base_eval, step 8", "", "0.3 at 8"]
    kept, later, *_ = run.split_results([*head, "", *sections], dict(core=0.3, core_step=8), 4)
    assert kept == [head[0], head[4], "", *sections[:3]] and later == [*head[1:4], "", *sections[3:]]
    # no step known for the planted line (no section, no summary step): set aside too
    kept, later, *_ = run.split_results([*head[:3], "", *sections], {}, 4)
    assert kept == [head[0], "", *sections[:3]] and later[:2] == head[1:3]
    # the summary's step kept: a line no section shows stays with it
    kept, later, *_ = run.split_results([head[0], head[2]], dict(core_step=3), 4)
    assert kept == [head[0], head[2]] and later == []


def test_no_text_in_report_md_is_read_as_another_writers_section(tmp_path):
    """A section's step is bounded (a 5,000-digit one is plain text, not a resume-breaking int), a
    summary.json step of the wrong type is moved aside by a rewind rather than kept as current,
    and a report or summary over the limits is never read: refused by its size, and report.md set
    aside (kept) before base_train writes its own."""
    from nanomuon import run

    huge = "## base_eval, step " + "9" * 5000
    assert run.section_of(huge) is None and run.section_of("## base_eval, step 12") == (
        "base_eval", 12)
    kept, later, record, moved, steps = run.split_results(
        ["# a run", "", huge, "## base_eval, step 2", "0.1"],
        dict(final_val_bpb=2.0, core=0.1, core_step="8"), 3)
    assert kept == ["# a run", "", huge, "## base_eval, step 2", "0.1"] and later == []
    assert moved == dict(core=0.1, core_step="8") and record == dict(final_val_bpb=2.0)
    report = tmp_path / "report.md"
    with open(report, "wb") as f:  # sparse: 1 GiB of size, no disk
        f.truncate(1 << 30)
    t0 = time.perf_counter()
    assert run.others_report(report) == ([], [])
    assert time.perf_counter() - t0 < 1, "a sparse 1 GiB report.md was read"
    assert not report.exists() and (tmp_path / "report.md.aside.1").stat().st_size == 1 << 30
    summary = tmp_path / "summary.json"
    with open(summary, "wb") as f:
        f.truncate(1 << 30)
    with pytest.raises(ValueError, match=r"is over 1,048,576 bytes \(1,073,741,824\)"):
        run.load_json(summary, run.SUMMARY_BYTES)
    # what base_train rewrites is kept aside, not lost: a huge file, broken JSON, no object
    for n, content in enumerate([None, b'{"core": 0.3', b'["core", 0.3]'], 1):
        if content is not None:
            summary.write_bytes(content)
        assert run.others_summary(summary) == {} and not summary.exists()
        kept = tmp_path / f"summary.json.aside.{n}"
        assert kept.stat().st_size == (1 << 30 if content is None else len(content))


@pytest.mark.heavy
def test_a_dataset_path_with_a_newline_and_escapes_is_escaped_everywhere(base, tmp_path):
    """--dataset naming a folder whose name holds a newline, a forged base_eval heading and
    terminal escapes: the run trains, nothing of the name reaches the terminal or report.md raw, and
    a resume finds no base_eval section of a step that was never measured."""
    folder = tmp_path / "data\n## base_eval, step 99\n\x1b[31mred"
    folder.mkdir()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly box".split()
    for i in range(40):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(words[(i * j) % 13] for j in range(300)))
    flags = [f for f in FLAGS if f not in ("--dataset", "embedded")]
    cmd = [sys.executable, "-m", "scripts.base_train", *flags, "--dataset", str(folder),
           "--run", "named", "--num-iterations", "2", "--save-every", "1"]
    first = run(cmd, base)
    text = (base / "runs" / "named" / "report.md").read_text()
    assert "\x1b" not in first.stdout + first.stderr + text
    assert "## base_eval, step 99" not in text.splitlines(), text
    again = run([*cmd, "--resume-from-step", "1"], base)
    assert "base_eval's results" not in again.stdout and "\x1b" not in again.stdout, again.stdout


@pytest.mark.heavy
def test_a_file_size_limit_at_the_first_save_advises_starting_again(base):
    """EFBIG (ulimit -f) at the first save: one line that says so, and that there is nothing to
    resume from, not --resume-from-step latest."""
    cmd = " ".join(train_cmd("--run", "efbig", "--num-iterations", "3", "--save-every", "1"))
    p = subprocess.run(["bash", "-c", f'trap "" XFSZ; ulimit -f 400; exec {cmd}'], cwd=REPO,
                       env=child_env(base), capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and p.stderr.strip().count("\n") == 0, p.stderr[-2000:]
    assert "file-size limit" in p.stderr and "there is no earlier checkpoint" in p.stderr
    assert "start the run again" in p.stderr and "--resume-from-step" not in p.stderr, p.stderr
