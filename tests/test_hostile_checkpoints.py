"""
Checkpoints re-saved with valid checksums, or files planted in a run dir, that hold what no run
saves: quoted values are escaped and bounded (checksums.json, .lock, meta.json), a checksums.json
that leaves files out says so, and NaN, mistyped tensors, damaged optimizer state or loop fields
are refused at load in one line by every script that loads them, naming the earlier steps to use
instead.
"""

import json
import shutil

import pytest
import torch
from test_bad_input import GOOD
from test_checkpoint_safety import saved

from nanomuon.checkpoint import load_checkpoint, load_step, save_checkpoint, step_dir
from nanomuon.run import lock_run_dir, unlock_run_dir

ESCAPES = "\x1b[2J\x1b]0;PWNED\x07"


def sums_of(d):
    return json.loads((d / "checksums.json").read_text())["crc32"]


def write_sums(d, sums):
    (d / "checksums.json").write_text(json.dumps(dict(crc32=sums)))


def test_a_crc_holding_escapes_is_quoted_escaped(tmp_path):
    run_dir = saved(tmp_path / "run", 1)
    d = step_dir(run_dir, 1)
    write_sums(d, dict(sums_of(d), **{"optim.pt": ESCAPES}))
    with pytest.raises(ValueError) as e:
        load_step(run_dir, 1)
    assert "\x1b" not in str(e.value) and "\x07" not in str(e.value), str(e.value)
    assert "'\\x1b[2J\\x1b]0;PWNED\\x07', not 8 hex digits" in str(e.value)


@pytest.mark.parametrize("size", [100_000, 2_000_000])
def test_a_huge_crc_is_not_echoed(tmp_path, size):
    """A value of 100 KB is cut in the line; a checksums.json past 1 MB is not read at all."""
    run_dir = saved(tmp_path / "run", 1)
    d = step_dir(run_dir, 1)
    write_sums(d, dict(sums_of(d), **{"optim.pt": "7" * size}))
    with pytest.raises(ValueError) as e:
        load_step(run_dir, 1)
    assert len(str(e.value)) < 600 and ("not 8 hex digits" in str(e.value)
                                        or "not the few lines nanomuon writes" in str(e.value))


def test_a_planted_lock_line_is_escaped(tmp_path):
    """.lock says who holds a run dir; anyone may have written it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").write_text(f"pid 1 {ESCAPES}{'x' * 5000}\n")
    note = lock_run_dir(run_dir)
    try:
        assert "\x1b" not in note and "\\x1b[2J" in note and len(note) < 600, note
        (run_dir / ".lock").write_text(f"pid 2 {ESCAPES}\n")
        with pytest.raises(RuntimeError) as e:
            lock_run_dir(run_dir)  # a second open file: the flock is taken
        assert "\x1b" not in str(e.value) and "in use by pid 2 \\x1b[2J" in str(e.value)
    finally:
        unlock_run_dir(run_dir)


def test_a_checksums_json_that_leaves_files_out_says_so(tmp_path):
    """The data file still listed, optim.pt and .metadata left out: they load, but not in silence,
    as a missing checksums.json does not."""
    run_dir = saved(tmp_path / "run", 1)
    d, warned = step_dir(run_dir, 1), []
    whole = sums_of(d)
    load_step(run_dir, 1, warn=warned.append)
    assert not warned
    write_sums(d, {k: v for k, v in whole.items() if k not in ("optim.pt", ".metadata")})
    assert load_step(run_dir, 1, warn=warned.append)[0] == 1
    assert warned == [f"note: {d}/checksums.json does not list .metadata, optim.pt: they load "
                      "unverified"], warned


# -- values no run saves, re-saved with valid checksums ----------------------------------------------


@pytest.fixture(scope="module")
def trained(base):
    """Steps 1 and 2 of a tiny run, which every edit below starts from."""
    from scripts.base_train import main

    main([*GOOD, "--run", "hostile", "--save-every", "1", "--keep-checkpoints", "-1"])
    return base / "runs" / "hostile"


def resaved(trained, name, edit):
    """A copy of the run whose step 2 is edit(tensors, optim rest, meta)'d and saved again (so its
    checksums hold)."""
    run_dir = trained.parent / name
    shutil.copytree(trained, run_dir)
    meta = json.loads((step_dir(run_dir, 2) / "meta.json").read_text())
    state, _ = load_checkpoint(run_dir, 2, ("model", "optim"))
    tensors = {f"model.{k}": v for k, v in state["model"].items()}
    rest = state["optim"]
    for idx, st in rest["state"].items():
        for key in [k for k, v in st.items() if isinstance(v, torch.Tensor)]:
            tensors[f"optim.{idx}.{key}"] = st.pop(key)
    edit(tensors, rest, meta)
    save_checkpoint(run_dir, 2, tensors, meta, dict(optim=rest))
    return run_dir


def script_calls(run_dir):
    """{script: a call that loads run_dir's step 2}: base_train's resume, base_eval, sample."""
    from scripts.base_eval import main as base_eval
    from scripts.base_train import main as base_train
    from scripts.sample import main as sample

    return dict(
        base_train=lambda: base_train([*GOOD, "--run", run_dir.name, "--resume-from-step", "2"]),
        base_eval=lambda: base_eval(["--run", run_dir.name, "--step", "2", "--device-type", "cpu",
                                     "--eval", "bpb", "--device-batch-size", "4"]),
        sample=lambda: sample(["--run", run_dir.name, "--step", "2", "--device-type", "cpu",
                               "--max-tokens", "2"]))


def scripts_refuse(run_dir, which, says):
    """Each script in `which` stops at the load with one line saying `says`."""
    calls = script_calls(run_dir)
    report = (run_dir / "report.md").read_text()
    for script in which:
        with pytest.raises(SystemExit) as e:
            calls[script]()
        line = str(e.value.code)
        assert line.startswith("error: ") and "\n" not in line and says in line, (script, line)
        assert "load an earlier step instead (saved: 1)" in line, line
    assert (run_dir / "report.md").read_text() == report  # no "val bpb nan" appended


def wte(tensors):
    return next(k for k in tensors if k.startswith("model.") and "wte" in k)


def fill_model(value):
    return lambda t, *_: t[wte(t)].fill_(value)


def cast_model(dtype):
    return lambda t, *_: t.update({wte(t): t[wte(t)].to(dtype)})


def adamw_state(key, value):
    def edit(t, rest, _):
        idx = next(i for i, st in rest["state"].items() if "step" in st)
        if key == "step":
            rest["state"][idx]["step"] = value
        else:
            t[f"optim.{idx}.{key}"].fill_(value)
    return edit


ALL = ("base_train", "base_eval", "sample")
BAD_TENSORS = {
    "NaN embedding": (fill_model(float("nan")), ALL, "wte.weight holds NaN or infinite values"),
    "int64 embedding": (cast_model(torch.int64), ALL,
                        "wte.weight is saved as torch.int64, where nanomuon saves torch.float32"),
    "fp16 embedding": (cast_model(torch.float16), ("base_eval",), "saved as torch.float16"),
    "NaN exp_avg_sq": (adamw_state("exp_avg_sq", float("nan")), ("base_train",),
                       "'exp_avg_sq' holds"),
    "negative exp_avg_sq": (adamw_state("exp_avg_sq", -1.0), ("base_train",),
                            "'exp_avg_sq' holds negative values"),
    "step 'x'": (adamw_state("step", "x"), ("base_train",), "'step' is 'x', not a step count"),
    "step -5": (adamw_state("step", -5), ("base_train",), "'step' is -5, not a step count"),
}


@pytest.mark.parametrize("name", list(BAD_TENSORS))
def test_bad_tensors_are_refused_at_load_by_every_script(trained, name):
    """NaN trained a step and then pointed at the step holding it; sample crashed; int64 and fp16
    were cast in silence; a bad AdamW step count was a traceback at the first step."""
    edit, which, says = BAD_TENSORS[name]
    run_dir = resaved(trained, "t-" + name.replace(" ", "-").replace("'", ""), edit)
    scripts_refuse(run_dir, which, says)


BAD_LOOPS = {
    "final_eval": ("abc", "'loop.final_eval' is 'abc', not [val tokens scored, val bpb]"),
    "history": ([[1]], "'loop.history' is [[1]], not a list of [step, train loss] pairs"),
    "val_history": ([["a", "b"]], "'loop.val_history' is [['a', 'b']], not a list of [step, val bpb]"),
    "train_time": (-1e308, "'loop.train_time' is -1e+308, not a number of seconds in [0, 1e+09]"),
    "skipped_steps": (-3, "'loop.skipped_steps' is -3, not an int >= 0"),
}


@pytest.mark.parametrize("key", list(BAD_LOOPS))
def test_bad_loop_state_is_refused_at_the_resume(trained, key):
    """They loaded, trained the whole run, then crashed writing the report (or printed a 309-digit
    training time)."""
    value, says = BAD_LOOPS[key]
    run_dir = resaved(trained, f"loop-{key}", lambda _t, _r, meta: meta["loop"].update({key: value}))
    from scripts.base_train import main

    with pytest.raises(SystemExit) as e:
        main([*GOOD, "--run", run_dir.name, "--resume-from-step", "2"])
    line = str(e.value.code)
    assert line.startswith("error: ") and "\n" not in line and says in line, line


MB = 1 << 20
HUGE_FIELDS = {  # meta.json edit, the scripts that read it, what their one line says
    "long window_pattern": (lambda m: m["model_config"].update(window_pattern="L" * MB), ALL,
                            f"window_pattern has {MB} letters for 2 layers"),
    "bad window_pattern": (lambda m: m["model_config"].update(window_pattern="x" * MB), ALL,
                           "must be letters S and L"),
    "arch": (lambda m: m["model_config"].update(arch="x" * MB), ALL, "is not one of"),
    "model_config key": (lambda m: m["model_config"].update({"x" * MB: 1}), ALL,
                         "unexpected keyword argument"),
    "tokenizer": (lambda m: m.update(tokenizer=["x" * MB]), ("base_train",), "'tokenizer' is"),
    "dtype": (lambda m: m["args"].update(dtype="x" * MB), ALL, "'args.dtype' is"),
    "dataset": (lambda m: m["args"].update(dataset="x" * MB), ("base_train",), "--dataset was"),
    "loader dataset": (lambda m: m["loader"][0].update(dataset="x" * MB), ("base_train",),
                       "data loader state does not match"),
}


@pytest.mark.parametrize("name", list(HUGE_FIELDS))
def test_a_huge_meta_field_is_refused_in_a_bounded_line(trained, name):
    """A 1 MB field of meta.json was echoed whole in the refusal, and a 1 MB window pattern of L's
    was sampled from: each script now refuses it in one line of at most a few hundred columns."""
    edit, which, says = HUGE_FIELDS[name]
    run_dir = resaved(trained, "huge-" + name.replace(" ", "-"), lambda _t, _r, meta: edit(meta))
    for script, call in script_calls(run_dir).items():
        if script in which:
            with pytest.raises(SystemExit) as e:
                call()
            line = str(e.value.code)
            assert line.startswith("error: ") and "\n" not in line and says in line, line[:2000]
            assert len(line) < 1000, (script, len(line), line[:2000])
