"""
Inputs that someone else may control: export's --out (it must not replace a device, FIFO,
symlink or, without --force, a file), HF_ENDPOINT (plain http off this machine, however spelled,
and malformed URLs are refused), and a checkpoint's meta.json (it must not pick the data that
base_eval reads or downloads).
"""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train import TINY

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(base):
    """A finished 1-step run, the one all tests here read."""
    from scripts.base_train import main

    main([*TINY, "--total-batch-size", "256", "--num-iterations", "1", "--eval-every", "-1",
          "--run", "r"])
    return base / "runs" / "r"


def error_line(call) -> str:
    """The one line a call stops with."""
    with pytest.raises(SystemExit) as e:
        call()
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def export(*argv):
    from scripts.export import main

    return main(["--run", "r", "--model-only", *map(str, argv)])


# -- export --out ------------------------------------------------------------
def make_symlink(d: Path) -> Path:
    (d / "target.pt").write_text("not to be replaced\n")
    (d / "out.pt").symlink_to(d / "target.pt")
    return d / "out.pt"


def make_device(d: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("making a device node takes root")
    os.mknod(d / "out.pt", 0o600 | stat.S_IFCHR, os.makedev(1, 7))  # /dev/full's numbers
    return d / "out.pt"


KINDS = {
    "symlink": (make_symlink, f"is a symlink to {{d}}{os.sep}target.pt"),
    "dangling-symlink": (lambda d: (d / "out.pt").symlink_to(d / "nowhere") or d / "out.pt",
                         "is a symlink to {d}"),
    "fifo": (lambda d: os.mkfifo(d / "out.pt") or d / "out.pt", "is a FIFO, not a regular file"),
    "directory": (lambda d: (d / "out.pt").mkdir() or d / "out.pt", "is a directory, not a"),
    "device": (make_device, "is a character device, not a regular file"),
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("force", [False, True])
def test_export_replaces_only_a_regular_file(run, tmp_path, kind, force):
    make, phrase = KINDS[kind]
    out = make(tmp_path)
    before = {p.name: (os.lstat(p).st_mode, os.lstat(p).st_ino) for p in tmp_path.iterdir()}
    message = error_line(lambda: export("--out", out, *(["--force"] if force else [])))
    assert phrase.format(d=tmp_path) in message and "give another --out" in message, message
    after = {p.name: (os.lstat(p).st_mode, os.lstat(p).st_ino) for p in tmp_path.iterdir()}
    assert after == before, "export changed or left files"
    if kind == "symlink":
        assert (tmp_path / "target.pt").read_text() == "not to be replaced\n"


def test_export_overwrites_a_file_only_with_force(run, tmp_path, capsys):
    out = tmp_path / "d.pt"
    out.write_text("precious\n")
    message = error_line(lambda: export("--out", out))
    assert f"{out} exists" in message and "add --force to overwrite it" in message, message
    assert out.read_text() == "precious\n"
    export("--out", out, "--force")
    assert torch.load(out, weights_only=True)["meta"]["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.pt"]  # no temporary file left
    default = export()  # the default path follows the same rule
    assert default == run / "export_step_000001.pt"
    assert "add --force" in error_line(export)
    assert "wrote" in capsys.readouterr().out


def test_export_needs_an_existing_folder(run, tmp_path):
    message = error_line(lambda: export("--out", tmp_path / "no" / "d.pt"))
    assert f"there is no folder {tmp_path / 'no'}; create it first" in message, message


def test_export_writes_through_no_planted_temporary_symlink(run, tmp_path):
    """The temporary file's name is predictable: a symlink planted there is not written through."""
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    out = tmp_path / "d.pt"
    out.with_name(f"{out.name}.{os.getpid()}.tmp").symlink_to(victim)
    export("--out", out)
    assert victim.read_text() == "keep\n"
    assert out.is_file() and not out.is_symlink()
    assert torch.load(out, weights_only=True)["meta"]["step"] == 1


# -- HF_ENDPOINT -------------------------------------------------------------
MALFORMED = ["https://", "http://", "mirror.example", "https://h:abc", "https://h:99999",
             "https://h:0", "https://h/x?y=1", "https://h/#x", "https://h\n.com",
             # userinfo and backslashes, which can make a parser see another host than the request
             "http://127.0.0.1:80@evil.com", "http://localhost@evil.com",
             "http://evil.com\\@127.0.0.1"]
PLAIN_HTTP = ["HTTP://mirror.example:8080", "Http://10.0.0.1", "http://mirror.example",
              "http://127.0.0.1.evil.com", "http://localhost.evil.com",
              "http://10.0.0.1/127.0.0.1"]
OTHER_SCHEME = ["ftp://mirror.example", "file://host/x", "HTTPX://mirror.example"]
GOOD = ["https://huggingface.co", "HTTPS://huggingface.co", "https://mirror.example:8443/hf",
        "http://127.0.0.1:9", "HTTP://localhost", "http://LocalHost:8080", "http://[::1]:80",
        "http://127.0.0.2"]


def endpoint(monkeypatch, url, allow_http=False):
    import huggingface_hub.constants

    from nanomuon.dataset import check_endpoint

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return check_endpoint(allow_http)


@pytest.mark.parametrize("allow_http", [False, True])
def test_endpoint_must_be_a_url_with_a_host(monkeypatch, allow_http):
    for url in MALFORMED:
        with pytest.raises(ValueError, match=r"is not a URL like https://host\[:port\]") as e:
            endpoint(monkeypatch, url, allow_http)
        assert "\n" not in str(e.value), url
    for url in OTHER_SCHEME:
        with pytest.raises(ValueError, match="is not https: use an https mirror"):
            endpoint(monkeypatch, url, allow_http)


def test_endpoint_plain_http_only_on_loopback_or_when_allowed(monkeypatch):
    for url in PLAIN_HTTP:
        with pytest.raises(ValueError, match=f"HF_ENDPOINT {url} is not https.*--allow-http"):
            endpoint(monkeypatch, url)
        assert endpoint(monkeypatch, url, allow_http=True) == url
    for url in GOOD:
        assert endpoint(monkeypatch, url) == url


def test_endpoint_upper_case_http_stops_a_download(tmp_path):
    """The whole path: huggingface_hub reads HF_ENDPOINT at import; one line, nothing fetched."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT="HTTP://mirror.example:8080", HF_HOME=str(tmp_path / "hf"),
               NANOMUON_BASE_DIR=str(tmp_path))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "nanomuon.dataset", "-n", "1", "--out-dir", str(out)]
    r = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "HF_ENDPOINT HTTP://mirror.example:8080 is not https" in r.stderr
    assert not out.exists()


# -- base_eval's data --------------------------------------------------------
def edited_run(base, run, name, dataset, **more):
    """A copy of run whose meta.json names another dataset, as one from someone else may."""
    copy = base / "runs" / name
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run, copy)
    meta_path = copy / "step_000001" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["args"].update(dataset=dataset, **more)
    meta_path.write_text(json.dumps(meta))
    return name


def base_eval(name, *argv):
    from scripts.base_eval import main

    return main(["--run", name, "--device-type", "cpu", "--device-batch-size", "4",
                 "--sample-tokens", "0", *argv])


def private_folder(tmp_path) -> Path:
    d = tmp_path / "private"
    d.mkdir()
    for i in range(3):
        (d / f"doc{i}.txt").write_text(f"private document {i} " * 20)
    return d


@pytest.mark.parametrize("source", ["folder", "hub", "control-characters"])
def test_base_eval_reads_no_data_a_checkpoint_picks(base, run, tmp_path, monkeypatch, source):
    import scripts.base_eval

    calls = []
    monkeypatch.setattr(scripts.base_eval, "prepare", lambda *a: calls.append(a) or "embedded")
    spec = {"folder": str(private_folder(tmp_path)), "hub": "hf:evil/data",
            "control-characters": "/tmp/x\n\x1b[2Jy"}[source]
    name = edited_run(base, run, f"edited-{source}", spec, val_fraction=0.5)
    message = error_line(lambda: base_eval(name))
    assert not calls, f"base_eval prepared {calls}"
    shown = ascii(spec) if source == "control-characters" else spec
    assert (f"run {name}'s checkpoint names --dataset {shown}, which is not built in "
            "(fineweb-edu, climbmix, embedded)") in message, message
    assert message.endswith(f"pass --dataset {shown} if you trust it"), message


def test_base_eval_evaluates_other_data_when_asked(base, run, tmp_path, capsys):
    """Named, the run's own source comes with its --val-fraction; others with the flags given."""
    folder = private_folder(tmp_path)
    name = edited_run(base, run, "edited-asked", str(folder), val_fraction=0.5)
    own = base_eval(name, "--dataset", str(folder))
    out = capsys.readouterr().out
    assert f"evaluating on --dataset {folder} --val-fraction 0.5, the run's data\n" in out, out
    assert f"{folder} val bpb {own:.4f}" in out
    base_eval(name, "--dataset", str(folder), "--val-fraction", "0.4")
    assert f"evaluating on --dataset {folder} --val-fraction 0.4\n" in capsys.readouterr().out
    base_eval(name, "--dataset", "embedded")
    assert "evaluating on --dataset embedded\n" in capsys.readouterr().out


def test_base_eval_on_the_runs_own_built_in_data_is_unchanged(run, capsys):
    bpb = base_eval("r")
    out = capsys.readouterr().out
    assert "evaluating on --dataset embedded, the run's data" in out, out
    assert f"embedded val bpb {bpb:.4f}" in out
    trained = json.loads((run / "summary.json").read_text())["final_val_bpb"]
    assert bpb == pytest.approx(trained, abs=1e-6)


ESC = "\x1b[2J"


@pytest.mark.parametrize("argv", [
    ["scripts.base_train", "--variant-option", f"x{ESC}"],
    ["scripts.base_train", "--variant-option", f"roles.lm{ESC}.kind=muon"],
    ["scripts.base_train", "--variant-option", f"precondition=so{ESC}ap"],
    ["scripts.base_train", "--ideas", f"missing{ESC}.py"],
    ["scripts.ablate", "--variants", f"muon,ad{ESC}amw"],
    ["scripts.ablate", "--variants", "muon,adamw", "--sweep", f"muon:lr-multiplier=1,x{ESC}"],
    ["scripts.ablate", "--variants", "muon,adamw", "--sweep", f"mu{ESC}on:lr-multiplier=1,2"],
])
def test_flag_text_reaches_the_terminal_escaped(argv, capsys):
    """A refusal quotes the user's flag text with every control byte escaped: no ESC moves the
    cursor or clears the screen."""
    import importlib

    main = importlib.import_module(argv[0]).main
    with pytest.raises(SystemExit):
        main(argv[1:])
    said = capsys.readouterr()
    assert "\x1b" not in said.err + said.out and "\\x1b" in said.err, said


def test_ablates_own_lines_and_an_ideas_files_error_are_escaped_and_placed(tmp_path, capsys):
    """ablate's launch lines (a --dataset folder's name) go out escaped; a ValueError an ideas file
    raises names the file and line, not a flag."""
    from nanomuon.ablation import runs
    from scripts.train_args import load_ideas

    runs.tell(f"== muon seed 1: python -m scripts.base_train --dataset data{ESC}")
    assert capsys.readouterr().out == "== muon seed 1: python -m scripts.base_train --dataset " \
        "data\\x1b[2J\n"
    bad = tmp_path / "bad.py"
    bad.write_text("X = 1\nraise ValueError('my own check failed')\n")
    with pytest.raises(SystemExit):
        load_ideas(["--ideas", str(bad)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith(f"--ideas {bad}: your file raised ValueError: my own check failed "
                         f"(at {bad.resolve()}:2)"), line
