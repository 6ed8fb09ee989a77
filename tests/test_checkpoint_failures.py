"""
A save that does not finish says why in the words of its cause: a full disk on any rank of a torchrun
job is named as one (as in one process), and an interrupt that lands inside a save is an interrupt.
"""

import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_dist import spawn
from test_train import REPO, TINY, child_env

from nanomuon import checkpoint


def _full_disk_on_rank_1(rank, world_size, path):
    """Rank 1's tensor file fails as a full tmpfs makes it fail: torch.save's RuntimeError, with the
    ENOSPC as its context (which DCP's pickling to rank 0 drops)."""
    from torch.distributed.checkpoint import filesystem

    def full(*args, **kwargs):
        said = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError(said)  # noqa: B904 (a context, as torch.save's has)

    if rank == 1:
        filesystem._write_item = full
    w = torch.full((64, 32), float(rank))
    with pytest.raises(OSError) as e:
        checkpoint.save_checkpoint(path, 3, {f"model.w{rank}": w}, dict(step=3))
    assert e.value.errno == errno.ENOSPC, e.value
    assert f"no space left on the device of {path} while saving step 3" in str(e.value), e.value
    assert not list(path.iterdir()), "a failed save left files behind"


@pytest.mark.heavy
def test_a_full_disk_on_another_rank_is_named_as_one(tmp_path):
    spawn(_full_disk_on_rank_1, 2, tmp_path)


# base_train, whose DCP tensor writes send this process a real SIGINT in its second save
INTERRUPTED_SAVE = textwrap.dedent("""
    import os, signal, sys, time
    from torch.distributed.checkpoint import filesystem
    from nanomuon import checkpoint
    from scripts.base_train import main

    saves, write, save = [], filesystem._write_item, checkpoint.save_checkpoint
    checkpoint.save_checkpoint = lambda *a, **k: (saves.append(1), save(*a, **k))[1]

    def interrupted(*args, **kwargs):
        if len(saves) == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the KeyboardInterrupt lands here
        return write(*args, **kwargs)

    filesystem._write_item = interrupted
    main(sys.argv[1:])
""")


@pytest.mark.heavy
def test_an_interrupt_inside_a_save_is_an_interrupt(base):
    """Ctrl-C during a save ends the run as Ctrl-C between steps does: rc 130 and the checkpoint to
    resume from, not 'cannot save step N' with rc 1; the half-written one is gone."""
    run_dir = base / "runs" / "interrupted-save"
    flags = [*TINY, "--total-batch-size", "256", "--eval-every", "-1", "--num-iterations", "4",
             "--save-every", "2", "--run", "interrupted-save"]
    p = subprocess.run([sys.executable, "-c", INTERRUPTED_SAVE, *flags], cwd=REPO,
                       env=child_env(base), capture_output=True, text=True, timeout=300)
    assert p.returncode == 130 and "Traceback" not in p.stderr, p.stdout[-2000:] + p.stderr
    assert p.stdout.strip().splitlines()[-1] == (
        f"interrupted; the last checkpoint is {checkpoint.step_dir(run_dir, 2)} (continue with "
        "--resume-from-step latest)"), p.stdout[-2000:]
    assert sorted(os.listdir(run_dir)) == ["step_000002"]


# base_train, under a file-size limit (ulimit -f) from its second save on; SIGXFSZ ignored (as
# Python does), so a write past the limit fails with EFBIG
LIMITED_SAVE = textwrap.dedent("""
    import resource, signal, sys
    from nanomuon import checkpoint
    from scripts.base_train import main

    saves, save = [], checkpoint.save_checkpoint

    def limited(*args, **kwargs):
        saves.append(1)
        if len(saves) == 2:
            limit = int(sys.argv[1])
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        return save(*args, **kwargs)

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    checkpoint.save_checkpoint = limited
    main(sys.argv[2:])
""")


def test_a_file_size_limit_at_a_save_is_named_and_keeps_the_last_checkpoint(base):
    """A save that reaches the file-size limit (which torch reports as "unexpected pos") stops the
    run with one line that says so, keeps the checkpoint before it, and leaves nothing
    half-written: as a full disk does."""
    name, limit = "limited", 1000
    run_dir = base / "runs" / name
    flags = [*TINY, "--total-batch-size", "256", "--eval-every", "-1", "--num-iterations", "4",
             "--save-every", "2", "--run", name]
    p = subprocess.run([sys.executable, "-c", LIMITED_SAVE, str(limit), *flags], cwd=REPO,
                       env=child_env(base), capture_output=True, text=True, timeout=300)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stdout[-2000:] + p.stderr
    assert f"file-size limit ({limit:,} bytes, ulimit -f) while saving step 4" in last, last
    assert "the checkpoint of step 2 is kept" in last and "ulimit -f unlimited" in last, last
    assert sorted(os.listdir(run_dir)) == ["step_000002"]
