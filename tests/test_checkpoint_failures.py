"""
A save that does not finish says why in the words of its cause: a full disk on any rank of a torchrun
job is named as one (as in one process), and an interrupt that lands inside a save is an interrupt.
"""

import errno

import pytest
import torch
from test_dist import spawn

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


def test_a_full_disk_on_another_rank_is_named_as_one(tmp_path):
    spawn(_full_disk_on_rank_1, 2, tmp_path)
