"""
Damaged files a run reads (meta.json, tokenizer.json, the run dir's report.md), each stopped where it
is first read with one line naming the file and the way out; a damaged last checkpoint lets
'latest' fall back to the step before.
"""

import json
import os
import shutil
import struct
import zipfile

import pytest
from test_bad_input import GOOD

from nanomuon.checkpoint import load_checkpoint, load_step
from nanomuon.tokenizer import Tokenizer, get_tokenizer

DEEP = '{"a":' * 200_000 + "1" + "}" * 200_000


@pytest.fixture(scope="module")
def good(base):
    """A finished 2-step run with checkpoints at steps 1 and 2, copied by the tests that damage one."""
    from scripts.base_train import main

    main([*GOOD, "--run", "files", "--save-every", "1"])
    return base / "runs" / "files"


def damaged(good, name, damage):
    """A copy of the good run with step 2's meta.json rewritten by damage(meta) -> text."""
    run = good.parent / name
    shutil.copytree(good, run)
    path = run / "step_000002" / "meta.json"
    path.write_text(damage(json.loads(path.read_text())))
    return run


def one_line(call, capsys):
    """call()'s error, checked to be one line with no traceback; one_line.out: what it printed."""
    capsys.readouterr()
    with pytest.raises((SystemExit, ValueError)) as e:
        call()
    message = e.value.code if isinstance(e.value, SystemExit) else str(e.value)
    assert isinstance(message, str) and "\n" not in message, message
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    one_line.out = out
    return message


def test_meta_nested_too_deep_falls_back(good, capsys):
    run = damaged(good, "deep", lambda meta: DEEP)
    assert "unreadable meta.json" in one_line(lambda: load_step(run, 2), capsys)
    warned = []
    assert load_step(run, "latest", warn=warned.append)[0] == 1
    assert "step 2 does not load" in warned[0] and "delete" in warned[0]


def test_meta_loader_entry_not_a_dict(good, capsys):
    def edit(meta):
        meta["loader"] = [7] * len(meta["loader"])
        return json.dumps(meta)
    run = damaged(good, "loader7", edit)
    message = one_line(lambda: load_step(run, 2, ("loader", "world_size")), capsys)
    assert "loader[0] is an int, not a dict" in message and "resume from an earlier step" in message
    assert load_step(run, "latest", ("loader",), warn=lambda _: None)[0] == 1


@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_meta_loop_number_not_finite(good, value, capsys):
    def edit(meta):
        return json.dumps(meta).replace('"smooth_loss": ', f'"smooth_loss": {value}, "was": ')
    run = damaged(good, f"loop{value}", edit)
    message = one_line(lambda: load_step(run, 2, ("loop",)), capsys)
    assert "'loop.smooth_loss' is" in message and "not a finite number" in message, message


@pytest.mark.parametrize("text,says", [('{"a":' * 10_000 + "1" + "}" * 10_000, "nests too deep"),
                                       ("{}" + " " * 70_000, "is over 65,536 bytes")],
                         ids=["deep", "huge"])
def test_tokenizer_json_nested_too_deep_or_too_big(base, tmp_path, text, says, capsys):
    get_tokenizer().save(tmp_path / "t")
    (tmp_path / "t" / "tokenizer.json").write_text(text)
    message = one_line(lambda: Tokenizer.load(tmp_path / "t"), capsys)
    assert f"tokenizer.json {says}" in message and "scripts.tok_train" in message, message


def within(seconds, call):
    """call()'s result or exception, from a thread: a read that waits on a FIFO fails the test in
    `seconds` instead of hanging it."""
    import threading

    got = {}

    def run():
        try:
            got["value"] = call()
        except Exception as e:  # noqa: BLE001 -- handed to the test to check
            got["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{call} still waits after {seconds} s (it opened a FIFO)"
    return got


def test_what_the_project_reads_back_is_never_a_fifo_or_unbounded(good, tmp_path):
    """Every file nanomuon wrote and reads again (manifests, the hash memo, the pinned revision,
    a run's report and summary, a checkpoint's meta.json) is read by read_regular: a FIFO put in
    its place is refused at once, never waited on, and a huge one is never read whole."""
    from nanomuon.checkpoint import read_meta
    from nanomuon.common import content_hashes, file_hash
    from nanomuon.dataset import MANIFEST, REVISION_FILE, manifest_shards, pin_revision
    from nanomuon.run import results_after

    run = good.parent / "fifos"
    shutil.copytree(good, run)
    for path in (run / "summary.json", run / "step_000002" / "meta.json", tmp_path / MANIFEST,
                 tmp_path / "memo.json", tmp_path / REVISION_FILE):
        path.unlink(missing_ok=True)
        os.mkfifo(path)
    assert within(10, lambda: manifest_shards(tmp_path)) == {"value": None}
    data = tmp_path / "data.bin"
    data.write_bytes(b"tokens")
    assert within(10, lambda: content_hashes([data], tmp_path / "memo.json"))["value"] == \
        [file_hash(data)]
    assert "is a FIFO, not the commit nanomuon pinned" in str(
        within(10, lambda: pin_revision(tmp_path, None))["error"])
    assert "unreadable meta.json" in str(within(10, lambda: read_meta(run / "step_000002"))["error"])
    assert within(10, lambda: results_after(run, 1))["value"][-1] == []  # the summary: not ours
    os.replace(run / "summary.json", tmp_path / "was-a-fifo")
    os.mkfifo(run / "report.md.fifo")
    os.replace(run / "report.md.fifo", run / "report.md")
    assert "is a FIFO, not the report base_train writes" in str(
        within(10, lambda: results_after(run, 1))["error"])
    os.unlink(run / "report.md")
    with open(run / "report.md", "wb") as f:
        f.truncate((1 << 30) + 1)  # sparse: a report no run writes, never read whole
    # refused by its size, unread: within a second
    assert "is over 4,194,304 bytes (1,073,741,825)" in str(
        within(1, lambda: results_after(run, 1))["error"])


@pytest.mark.parametrize("pattern", ["", "a*", "x|(?=y)"])
def test_tokenizer_split_pattern_matching_empty_text(base, tmp_path, pattern, capsys):
    """Saved by Tokenizer itself, so its fingerprint fits: only the pattern is wrong."""
    Tokenizer(get_tokenizer().mergeable_ranks, pattern).save(tmp_path / "t")
    message = one_line(lambda: Tokenizer.load(tmp_path / "t"), capsys)
    assert "tokenizer.json's split pattern" in message and "scripts.tok_train" in message


def test_base_eval_checks_report_before_evaluating(good, monkeypatch, capsys):
    from scripts.base_eval import main

    shutil.copytree(good, good.parent / "evaldir")
    report = good.parent / "evaldir" / "report.md"
    report.unlink(missing_ok=True)
    report.mkdir()  # even root cannot append to a directory
    argv = ["--run", "evaldir", "--device-type", "cpu", "--sample-tokens", "0"]
    message = one_line(lambda: main(argv), capsys)
    assert f"cannot append to {report}" in message
    assert "val bpb" not in one_line.out  # stopped before evaluating
    report.rmdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if p == report.parent else real(p, mode))
    assert f"{report.parent} is not writable" in one_line(lambda: main(argv), capsys)


def zero_member(path, name):
    """Zero the stored bytes of one record of a torch.save zip archive, its framing kept."""
    data = bytearray(path.read_bytes())
    info = next(i for i in zipfile.ZipFile(path).infolist() if i.filename.endswith(name))
    names, extra = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + names + extra
    data[start:start + info.compress_size] = bytes(info.compress_size)
    path.write_bytes(bytes(data))


ZEROED = {
    "every byte": lambda path: path.write_bytes(bytes(path.stat().st_size)),
    "the pickle": lambda path: zero_member(path, "/data.pkl"),
    "the byte order": lambda path: zero_member(path, "/byteorder"),
}


@pytest.mark.parametrize("what", list(ZEROED))
def test_a_zeroed_optimizer_file_is_not_told_to_load_unsafely(good, what, capsys):
    """optim.pt with bytes zeroed and no checksums.json to catch it: torch's safe loader refuses
    it, and its message advises weights_only=False (or another torch.save): the line says what is
    wrong with the file in nanomuon's words, escaped (no NUL of it reaches the terminal), and the
    way out."""
    run = good.parent / f"zeroed-{what.replace(' ', '-')}"
    shutil.copytree(good, run)
    for step in ("step_000001", "step_000002"):
        (run / step / "checksums.json").unlink()
        ZEROED[what](run / step / "optim.pt")
    for call in (lambda: load_step(run, 2), lambda: load_checkpoint(run, 2, ("optim",))):
        message = one_line(call, capsys)
        assert "optim.pt" in message and f"delete {run / 'step_000002'}" in message, message
        assert message.isprintable() and len(message) < 400, message
        for advice in ("weights_only", "torch.save", "trust"):
            assert advice not in message, message
